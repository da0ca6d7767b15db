"""Public ranker attention for TPU: forward and backward kernels behind the shared API name.

``ranker_attention`` is ``attn_common.ranker.kernel_vjp`` (the custom VJP shared with the
Hopper backend: its residuals, the LSE's cotangent) over ``ranker_fwd.kernel_forward`` and
the dq and dk/dv kernels of ``ranker_bwd``, which accumulate in a fixed order without
atomics: gradients are deterministic.

Validation happens before tracing (``attn_common.spec.ranker_call`` plus the TPU
rules: bf16 or fp32, D in {64, 128, 256}, blocks that are multiples of 128), and errors
name the argument, the value and the rule.
"""

from __future__ import annotations

from attn_common.ranker import kernel_vjp, unsupported_ranker_inputs
from attn_common.spec import RankerCall, public_op, ranker_call
from attn_pallas_tpu.ranker_bwd import ranker_attention_bwd
from attn_pallas_tpu.ranker_fwd import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    kernel_forward,
    prepare,
)

__all__ = ["ranker_attention", "supports"]


_attention = kernel_vjp(kernel_forward, ranker_attention_bwd)


@public_op(ranker_call)
def ranker_attention(call: RankerCall):
    """Ranker attention on TPU; same contract as ``attn_reference.ranker_attention``.

    The kernels take bf16 or fp32 and D in {64, 128, 256}, any ``S``; packed bounds
    ``[B, U, 4]`` run on the packed step tables (``2U`` block runs per tile, the mask
    the OR over the row's users; one compile per ``U`` serves every batch). ``config``
    (block_q, block_kv: multiples of 128) is shared by the forward and both backward
    kernels; default the tuned table's tiling (``ranker_tuning.config_for``), else
    ``ranker_fwd.default_config(S, D)``. ``interpret``: ``True`` or a
    ``pltpu.InterpretParams`` runs the kernels in Pallas TPU interpret mode (CPU).
    """
    call.require(dtypes=SUPPORTED_DTYPES, head_dims=SUPPORTED_HEAD_DIMS, kernels="TPU ranker")
    p = call.problem
    # Validate the tiling eagerly (before custom_vjp traces anything).
    prepare(call.q, call.k, call.v, call.bounds, sm_scale=p.sm_scale, cap=p.cap, config=call.config)
    interpret = call.interpret
    if isinstance(interpret, bool) and not interpret:
        interpret = False
    kwargs = (
        ("sm_scale", p.sm_scale),
        ("cap", p.cap),
        ("config", call.config),
        ("interpret", interpret),
    )
    out, lse = _attention(call.q, call.k, call.v, call.bounds, kwargs)
    return (out, lse) if call.return_lse else out


def supports(op: str, *args, **kwargs) -> str | None:
    """Why these inputs cannot run on this backend's ranker kernels (``None``: they can).

    Read by ``attn_common``'s dispatch: with ``implementation=None`` an unsupported call
    falls back to the next backend (the reference) with a one-time warning.
    """
    if op != "ranker_attention":
        return None
    return unsupported_ranker_inputs(
        args,
        kwargs,
        dtypes=SUPPORTED_DTYPES,
        head_dims=SUPPORTED_HEAD_DIMS,
        kernels="TPU ranker",
    )
