"""Public ranker attention for Hopper: forward and backward kernels behind the shared API name.

``ranker_attention`` is ``attn_common.ranker.kernel_vjp`` (the custom VJP shared with the
TPU backend: its residuals, the LSE's cotangent) over ``ranker_fwd.ranker_attention_fwd``
and the dq and dk/dv kernels of ``ranker_bwd``. The kernels accumulate in a fixed order
without atomics, so gradients are bitwise deterministic (checked on an H200).
"""

from __future__ import annotations

from attn_common import KernelConfig
from attn_common.packed import packed_users
from attn_common.ranker import kernel_vjp, unsupported_ranker_inputs
from attn_common.spec import RankerCall, public_op, ranker_call
from attn_mosaic_gpu._interpret import resolve_target
from attn_mosaic_gpu.ranker_bwd import ranker_attention_bwd
from attn_mosaic_gpu.ranker_bwd_pipelined import PIPELINED_HEAD_DIMS
from attn_mosaic_gpu.ranker_fwd import (
    MIN_PACKED_USERS,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    default_config,
    ranker_attention_fwd,
    validate_config,
)
from attn_mosaic_gpu.tuning import BackwardTuning, lookup


def _backward(
    q, k, v, bounds, out, lse, dout, dlse, *, sm_scale, cap, config, backward_tuning, interpret
):
    del config  # tiles the forward only: the backward kernels use fixed 64-row blocks
    return ranker_attention_bwd(
        q, k, v, bounds, out, lse, dout, dlse, sm_scale=sm_scale, cap=cap,
        tuning=backward_tuning, interpret=interpret,
    )  # fmt: skip


def _forward(q, k, v, bounds, *, backward_tuning, **kwargs):
    del backward_tuning  # read by the backward only
    return ranker_attention_fwd(q, k, v, bounds, **kwargs)


_attention = kernel_vjp(_forward, _backward)


def resolve_tuning(
    q, cap, config, backward_tuning, *, bounds=None
) -> tuple[KernelConfig, BackwardTuning | None]:
    """Fill ``config`` / ``backward_tuning`` left ``None`` from the tuned tables
    (``attn_mosaic_gpu.tuning.lookup``); a table config this problem cannot use (it
    breaks a shared-memory or cap rule) gives way to ``default_config``. For packed
    ``bounds`` ``[B, U, 4]`` (only their shape is read) a table config's persistent
    ``programs`` (one user per row only) drop to 0."""
    if config is not None and backward_tuning is not None:
        return config, backward_tuning
    packed = bounds is not None and packed_users(bounds, min_users=MIN_PACKED_USERS) > 0
    head_dim = q.shape[-1]
    tuned = lookup(head_dim=head_dim, dtype=q.dtype, cap=cap, seq_len=q.shape[1])
    if config is None:
        config = tuned.forward
        if packed and config.programs:
            config = config.replace(programs=0)
        try:
            validate_config(config, head_dim, q.dtype, cap=cap, packed=packed)
        except ValueError:
            config = default_config(head_dim, q.dtype)
    if backward_tuning is None and head_dim in PIPELINED_HEAD_DIMS:
        backward_tuning = tuned.backward
    return config, backward_tuning


@public_op(ranker_call)
def ranker_attention(call: RankerCall, *, backward_tuning: BackwardTuning | None = None):
    """Ranker attention on Hopper; same contract as ``attn_reference.ranker_attention``.

    The kernels take bf16 or fp16 and D in {64, 128, 256}; packed bounds ``[B, U, 4]``
    for D 64 and 128. ``config``: the forward's ``KernelConfig``; ``None`` reads the
    tuned tables (``attn_mosaic_gpu.tuning``: the user's ``attn tune`` table, then the
    package's H200 table, then ``default_config``); an explicit config always wins.
    ``backward_tuning``: the backward kernels' schedule knobs (``BackwardTuning``; they
    use fixed 64-row blocks, which ``KernelConfig`` has no field for); ``None`` reads the
    same tables. D=256 runs the simple backward kernels, which take none. The forward
    kernel always computes the LSE (a residual of the backward), also when
    ``return_lse=False``; ``config`` is then validated with the LSE buffer.
    """
    call.require(dtypes=SUPPORTED_DTYPES, head_dims=SUPPORTED_HEAD_DIMS, kernels="Hopper ranker")
    if backward_tuning is not None and not isinstance(backward_tuning, BackwardTuning):
        raise TypeError(
            f"backward_tuning: got {type(backward_tuning).__name__}, expected BackwardTuning "
            "or None"
        )
    q, p = call.q, call.problem
    packed = call.packed_users >= MIN_PACKED_USERS
    if packed and p.head_dim not in PIPELINED_HEAD_DIMS:
        raise ValueError(
            f"bounds: got {call.packed_users} users per row with head dim D = {p.head_dim}; the "
            f"Hopper kernels take packed rows [B, U, 4] for D in {PIPELINED_HEAD_DIMS}; "
            "attn_reference takes any"
        )
    interpret = resolve_target(call.interpret)  # once, for the forward and the backward
    config, backward_tuning = resolve_tuning(
        q, p.cap, call.config, backward_tuning, bounds=call.bounds
    )
    kwargs = (
        ("sm_scale", p.sm_scale),
        ("cap", p.cap),
        ("config", config),
        ("backward_tuning", backward_tuning),
        ("interpret", interpret),
    )
    out, lse = _attention(q, call.k, call.v, call.bounds, kwargs)
    return (out, lse) if call.return_lse else out


def supports(op: str, *args, **kwargs) -> str | None:
    """Why these inputs cannot run on this backend's ranker kernels (``None``: they can).

    Read by ``attn_common``'s dispatch: with ``implementation=None`` an unsupported call
    falls back to the next backend (the reference) with a one-time warning.
    """
    if op != "ranker_attention":
        return f"no {op} kernel for Hopper yet"
    reason = unsupported_ranker_inputs(
        args,
        kwargs,
        dtypes=SUPPORTED_DTYPES,
        head_dims=SUPPORTED_HEAD_DIMS,
        kernels="Hopper",
    )
    if reason is not None:
        return reason
    q = args[0] if args else kwargs.get("q")
    bounds = args[3] if len(args) > 3 else kwargs.get("bounds")
    head_dim = getattr(q, "shape", (0,))[-1]
    try:
        packed = bounds is not None and packed_users(bounds, min_users=MIN_PACKED_USERS) > 0
    except ValueError:  # ragged nested lists: the kernel's validation names the problem
        packed = False
    if packed and head_dim not in PIPELINED_HEAD_DIMS:
        return (
            f"bounds: packed rows [B, U, 4] run on the Hopper kernels for head_dim in "
            f"{PIPELINED_HEAD_DIMS}; got head_dim {head_dim}"
        )
    return None
