"""Public ranker attention for TPU: forward and backward kernels behind the shared API name.

``ranker_attention`` is a ``jax.custom_vjp`` of the function returning ``(out, lse)``:
the forward runs ``ranker_fwd.ranker_attention_fwd`` (always computing the LSE, which the
backward needs) and the backward runs the dq and dk/dv kernels of ``ranker_bwd``. The
residuals are ``q, k, v, bounds, out, lse``. With ``return_lse=True`` the LSE is
differentiable: its cotangent enters the backward through ``delta' = rowsum(dO * O) -
dlse``. ``bounds`` (integers) gets no cotangent. The kernels accumulate in a fixed order
without atomics, so gradients are deterministic.

Validation happens before tracing (``attn_common.check_ranker_inputs`` plus the TPU
rules: bf16 or fp32, D in {64, 128, 256}, blocks that are multiples of 128), and errors
name the argument, the value and the rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_common import CapParams, KernelConfig, check_bounds
from attn_common.ranker import kernel_vjp
from attn_pallas_tpu.ranker_bwd import ranker_attention_bwd
from attn_pallas_tpu.ranker_fwd import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    prepare,
    ranker_attention_fwd,
)

__all__ = ["ranker_attention", "supports"]


_attention = kernel_vjp(ranker_attention_fwd, ranker_attention_bwd)


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
    interpret=False,
    debug_checks: bool = False,
):
    """Ranker attention on TPU; same contract as ``attn_reference.ranker_attention``.

    Args:
      q: ``[B, S, Hq, D]`` bf16 or fp32; k, v: ``[B, S, Hkv, D]`` same dtype,
        ``Hq % Hkv == 0``; D in {64, 128, 256}; any ``S``.
      bounds: ``SegmentBounds`` or int ``[B, 4]`` / ``[4]`` = (history_lo, history_hi,
        candidate_lo, candidate_hi); traced data (one compile serves every batch),
        clipped to ``[0, S]``.
      sm_scale: logit scale, default ``1/sqrt(D)``. cap: ``CapParams`` or ``None``.
      config: ``KernelConfig`` (block_q, block_kv: multiples of 128), shared by the
        forward and both backward kernels; default ``ranker_fwd.default_config(S, D)``.
      return_lse: also return ``lse [B, Hq, S]`` float32 (natural log, ``-inf`` for rows
        with no allowed key).
      interpret: ``True`` or a ``pltpu.InterpretParams``: run the kernels in Pallas TPU
        interpret mode (CPU).
      debug_checks: emit ``checkify`` checks that the bounds are in range (wrap the call
        in ``jax.experimental.checkify.checkify``).

    Returns ``out [B, S, Hq, D]`` in q's dtype, or ``(out, lse)``. Differentiable in q,
    k, v (``jax.grad`` / ``jax.vjp``), including through ``lse``.
    """
    # Validate eagerly (before custom_vjp traces anything) so errors name the argument.
    prepare(q, k, v, bounds, sm_scale=sm_scale, cap=cap, config=config)
    if debug_checks:
        check_bounds(bounds, seq_len=q.shape[1])
    if isinstance(interpret, bool) and not interpret:
        interpret = False
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

    Read by ``attn_common``'s dispatch for every op this backend exports; only the ranker
    kernels restrict inputs here (q's dtype and head dim, static facts only).
    """
    if op != "ranker_attention":
        return None
    q = args[0] if args else kwargs.get("q")
    dtype, shape = getattr(q, "dtype", None), getattr(q, "shape", None)
    if dtype is None or shape is None or len(shape) != 4:
        return None  # not a rank-4 array: the kernel's validation says what is wrong
    if not any(jnp.dtype(dtype) == jnp.dtype(d) for d in SUPPORTED_DTYPES):
        names = " or ".join(jnp.dtype(d).name for d in SUPPORTED_DTYPES)
        return f"q: got dtype {jnp.dtype(dtype).name}, the TPU ranker kernels take {names}"
    if shape[-1] not in SUPPORTED_HEAD_DIMS:
        return (
            f"q: got head dim D = {shape[-1]}, the TPU ranker kernels take D in "
            f"{SUPPORTED_HEAD_DIMS}"
        )
    return None
