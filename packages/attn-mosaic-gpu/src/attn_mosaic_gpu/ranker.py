"""Public ranker attention for Hopper: the forward kernel behind the shared API name.

``ranker_attention`` runs ``ranker_fwd.ranker_attention_fwd``. Its backward kernels are
not written yet (issue 5): differentiating it raises ``NotImplementedError`` at trace
time instead of silently falling back, and says where gradients are available today.
"""

from __future__ import annotations

import functools

import jax

from attn_common import CapParams, KernelConfig
from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd

_NO_BACKWARD = (
    "attn_mosaic_gpu.ranker_attention has no backward kernel yet (Hopper dq/dk/dv kernels "
    "are tracked as a separate issue); for gradients use attn_reference.ranker_attention, "
    "which has the same signature and semantics"
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _forward_only(q, k, v, bounds, kwargs):
    return ranker_attention_fwd(q, k, v, bounds, **dict(kwargs))


def _fwd(q, k, v, bounds, kwargs):
    return _forward_only(q, k, v, bounds, kwargs), None


def _bwd(kwargs, residuals, cotangents):
    raise NotImplementedError(_NO_BACKWARD)


_forward_only.defvjp(_fwd, _bwd)


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
):
    """Ranker attention on Hopper; same contract as ``attn_reference.ranker_attention``.

    Args:
      q: ``[B, S, Hq, D]`` bf16 or fp16; k, v: ``[B, S, Hkv, D]``; D in {64, 128, 256}.
      bounds: ``SegmentBounds`` or int ``[B, 4]`` / ``[4]``; traced data.
      sm_scale, cap, config, return_lse, interpret: see ``ranker_attention_fwd``.

    Returns ``out [B, S, Hq, D]`` or ``(out, lse [B, Hq, S])``. Forward only for now.
    """
    if isinstance(interpret, bool) and not interpret:
        interpret = False
    kwargs = (
        ("sm_scale", sm_scale),
        ("cap", cap),
        ("config", config),
        ("return_lse", bool(return_lse)),
        ("interpret", interpret),
    )
    return _forward_only(q, k, v, bounds, kwargs)
