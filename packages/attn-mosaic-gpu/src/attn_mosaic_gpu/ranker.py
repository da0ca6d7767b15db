"""Public ranker attention for Hopper: forward and backward kernels behind the shared API name.

``ranker_attention`` is a ``jax.custom_vjp`` of the function returning ``(out, lse)``:
the forward runs ``ranker_fwd.ranker_attention_fwd`` (always computing the LSE, which the
backward needs) and the backward runs the dq and dk/dv kernels of ``ranker_bwd``. The
residuals are ``q, k, v, bounds, out, lse``. With ``return_lse=True`` the LSE is
differentiable: its cotangent enters the backward through ``delta' = rowsum(dO * O) -
dlse``. ``bounds`` (integers) gets no cotangent. The kernels accumulate in a fixed order
without atomics, so gradients are bitwise deterministic (checked on an H200).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_common import CapParams, KernelConfig, check_bounds
from attn_common.ranker import kernel_vjp
from attn_mosaic_gpu.ranker_bwd import ranker_attention_bwd
from attn_mosaic_gpu.ranker_fwd import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    ranker_attention_fwd,
)


def _backward(q, k, v, bounds, out, lse, dout, dlse, *, sm_scale, cap, config, interpret):
    del config  # tiles the forward only: the backward kernels use fixed 64-row blocks
    return ranker_attention_bwd(
        q, k, v, bounds, out, lse, dout, dlse, sm_scale=sm_scale, cap=cap, interpret=interpret
    )


_attention = kernel_vjp(ranker_attention_fwd, _backward)


def ranker_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bounds,
    *,
    sm_scale: float | None = None,
    cap: CapParams | None = None,
    config: KernelConfig | None = None,
    return_lse: bool = False,
    debug_checks: bool = False,
    interpret=False,
):
    """Ranker attention on Hopper; same contract as ``attn_reference.ranker_attention``.

    Args:
      q: ``[B, S, Hq, D]`` bf16 or fp16; k, v: ``[B, S, Hkv, D]``; D in {64, 128, 256}.
      bounds: ``SegmentBounds`` or int ``[B, 4]`` / ``[4]``; traced data.
      sm_scale, cap, config, return_lse, interpret: see ``ranker_attention_fwd``
        (``config`` tiles the forward; the backward kernels use fixed 64-row blocks,
        which ``KernelConfig`` has no field for).
      debug_checks: emit ``checkify`` checks that the bounds are in range, as the
        reference does (wrap the call in ``jax.experimental.checkify.checkify``).

    Returns ``out [B, S, Hq, D]`` or ``(out, lse [B, Hq, S])``. Differentiable in q, k, v
    (``jax.grad`` / ``jax.vjp``, under ``jit``), including through ``lse``. The forward
    kernel always computes the LSE (a residual of the backward), also when
    ``return_lse=False``; ``config`` is then validated with the LSE buffer.
    """
    if isinstance(interpret, bool) and not interpret:
        interpret = False
    if debug_checks:
        check_bounds(bounds, seq_len=q.shape[1])
    kwargs = (
        ("sm_scale", sm_scale),
        ("cap", cap),
        ("config", config),
        ("interpret", interpret),
    )
    out, lse = _attention(q, k, v, bounds, kwargs)
    return (out, lse) if return_lse else out


def supports(op: str, *args, **kwargs) -> str | None:
    """Why these inputs cannot run on this backend (``None``: they can).

    Read by ``attn_common``'s dispatch: with ``implementation=None`` an unsupported call
    falls back to the next backend (the reference), with a one-time warning. Looks only
    at static facts: the op, q's dtype and head dim.
    """
    if op != "ranker_attention":
        return f"no {op} kernel for Hopper yet"
    q = args[0] if args else kwargs.get("q")
    dtype, shape = getattr(q, "dtype", None), getattr(q, "shape", None)
    if dtype is None or shape is None or len(shape) != 4:
        return None  # not an array of rank 4: let the kernel's validation say what is wrong
    if not any(jnp.dtype(dtype) == jnp.dtype(d) for d in SUPPORTED_DTYPES):
        names = " or ".join(jnp.dtype(d).name for d in SUPPORTED_DTYPES)
        return f"q: got dtype {jnp.dtype(dtype).name}, the Hopper kernels take {names}"
    if shape[-1] not in SUPPORTED_HEAD_DIMS:
        return (
            f"q: got head dim D = {shape[-1]}, the Hopper kernels take D in {SUPPORTED_HEAD_DIMS}"
        )
    return None
