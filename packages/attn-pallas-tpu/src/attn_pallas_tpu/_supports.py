"""Which inputs the TPU kernels take: ``supports`` for ``attn_common``'s dispatch.

With ``implementation=None`` a call this returns a reason for falls back to the next
backend (the reference) with a one-time warning; an explicit ``implementation=
"pallas-tpu"`` raises the reason instead. Static facts only (dtypes, static options),
never array values.
"""

from __future__ import annotations

import jax.numpy as jnp

from attn_common.fp8_cache import Fp8LatentCache
from attn_pallas_tpu._prep import KERNEL_DTYPES, ROW_MULTIPLE, fp8_unit_reason
from attn_pallas_tpu.ranker import supports as ranker_supports

_ATTEND = ("sparse_mla_attention", "sparse_mla_attention_qblock")
_PREFILL = ("prefill_write_and_attend_ragged", "prefill_write_and_attend_ragged_qblock")


def _arg(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def supports(op: str, *args, **kwargs) -> str | None:
    """Why these inputs cannot run on the TPU kernels (``None``: they can)."""
    if op == "ranker_attention":
        return ranker_supports(op, *args, **kwargs)
    if op in _ATTEND:
        arrays = {"q": _arg(args, kwargs, 0, "q"), "kv": _arg(args, kwargs, 1, "kv")}
        unit, unit_name = kwargs.get("read_block"), "read_block"
    elif op in _PREFILL:
        arrays = {"ql": _arg(args, kwargs, 0, "ql"), "cache": _arg(args, kwargs, 4, "cache")}
        unit, unit_name = kwargs.get("page_size"), "page_size"
    else:
        return None
    for name, x in arrays.items():  # an Fp8LatentCache (no dtype) is taken
        dtype = getattr(x, "dtype", None)
        if dtype is not None and jnp.dtype(dtype) not in KERNEL_DTYPES:
            return f"{name}: got dtype {jnp.dtype(dtype).name}, the TPU kernels take float32 or bfloat16"
    if isinstance(unit, int) and not isinstance(unit, bool):
        if unit % ROW_MULTIPLE:
            return f"{unit_name}: got {unit}, the TPU kernels need a multiple of {ROW_MULTIPLE}"
        cache = next((x for x in arrays.values() if isinstance(x, Fp8LatentCache)), None)
        return fp8_unit_reason(cache, unit, kwargs.get("interpret"))
    return None
