"""Which inputs the Hopper kernels take: ``supports`` for ``attn_common``'s dispatch.

With ``implementation=None`` a call this returns a reason for falls back to the next
backend (the reference) with a one-time warning; an explicit ``implementation=
"mosaic-gpu"`` raises the reason instead. Static facts only (dtypes, shapes, static
options), never array values.
"""

from __future__ import annotations

from attn_common.fp8_cache import COMPUTE_DTYPE, Fp8LatentCache
from attn_mosaic_gpu.ranker import supports as ranker_supports
from attn_mosaic_gpu.sparse_mla import sparse_mla_unsupported

_ATTEND = ("sparse_mla_attention", "sparse_mla_attention_qblock")
_PREFILL = ("prefill_write_and_attend_ragged", "prefill_write_and_attend_ragged_qblock")


def _arg(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _last_dim(x) -> int | None:
    shape = getattr(x, "shape", None)
    return int(shape[-1]) if shape else None


def supports(op: str, *args, **kwargs) -> str | None:
    """Why these inputs cannot run on the Hopper kernels (``None``: they can)."""
    if op == "ranker_attention":
        return ranker_supports(op, *args, **kwargs)
    dv = kwargs.get("kv_lora_rank", 512)
    if not isinstance(dv, int) or isinstance(dv, bool):
        return None  # the op's own validation names the problem
    if op in _ATTEND:
        names = ("q", "kv")
        q, kv = _arg(args, kwargs, 0, "q"), _arg(args, kwargs, 1, "kv")
        dk = _last_dim(q)
    elif op in _PREFILL:
        names = ("qpe", "cache")
        q, kv = _arg(args, kwargs, 0, "ql"), _arg(args, kwargs, 4, "cache")
        ql_dim, qpe_dim = _last_dim(q), _last_dim(_arg(args, kwargs, 1, "qpe"))
        dk = None if ql_dim is None or qpe_dim is None else ql_dim + qpe_dim
    else:  # paged_write_back: the XLA scatter takes every cache, FP8 too
        return None
    # An Fp8LatentCache: the kernel dequantizes its rows to bf16 on chip.
    kv_dtype = COMPUTE_DTYPE if isinstance(kv, Fp8LatentCache) else getattr(kv, "dtype", None)
    return sparse_mla_unsupported(None, kv_dtype, dk, dv, names=names)
