"""Ranker attention backward for Hopper (sm_90a): dq and dk/dv Pallas Mosaic GPU kernels.

``ranker_attention_bwd`` is the public entry. For D in {64, 128} it runs the
warp-specialized, TMA-pipelined kernels of ``ranker_bwd_pipelined`` (two compute
warpgroups and a memory warpgroup per program). For D = 256 the f32 dK and dV
accumulators of two 64-row warpgroups do not fit the register file next to the
pipeline's shared memory, so it runs the simple single-warpgroup kernels of
``ranker_bwd_d256`` (no prefetch, head dim of the outputs split in halves); they are
correct but slower. Rows with no allowed key have ``lse = -inf``; this entry passes
``+inf`` to the kernels instead (``exp2(y - inf) = 0``, never ``-inf - -inf``) and zeroes
their LSE cotangent, so their gradient is 0, never NaN.

Math (per query head ``h``, kv head ``g = h // (Hq / Hkv)``, ``lse`` natural log from the
forward): ``s = q.k * sm_scale``, ``y = cap(s)``, ``p = exp(y - lse)`` on allowed pairs
(0 elsewhere), ``dp = dO . v``, ``delta' = sum_d dO * O - dlse`` (the LSE cotangent enters
here), ``ds = p * (dp - delta') * cap'(y)``; ``dq = sum_j ds_ij k_j * sm_scale``,
``dk_j = sum_{h in group, i} ds_ij q_i * sm_scale``, ``dv_j = sum_{h in group, i} p_ij dO_i``.
"""

from __future__ import annotations

import jax.numpy as jnp

from attn_common import CapParams, check_ranker_inputs
from attn_common.packed import normalize_ranker_bounds, packed_users
from attn_mosaic_gpu._interpret import resolve_target
from attn_mosaic_gpu._smem import round_up
from attn_mosaic_gpu.fastmath import LOG2E
from attn_mosaic_gpu.ranker_bwd_d256 import BwdStatic, d256_bwd
from attn_mosaic_gpu.ranker_bwd_pipelined import pipelined_bwd
from attn_mosaic_gpu.ranker_config import (
    BLOCK,
    MIN_PACKED_USERS,
    PIPELINED_HEAD_DIMS,
    SMEM_LIMIT_BYTES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    bwd_smem_bytes,
    validate_bwd,
)

__all__ = [
    "BWD_BLOCK",
    "SMEM_LIMIT_BYTES",
    "bwd_smem_bytes",
    "ranker_attention_bwd",
    "validate_bwd",
]

BWD_BLOCK = BLOCK  # the backward kernels' rows per block (ranker_config.BLOCK)


def ranker_attention_bwd(
    q,
    k,
    v,
    bounds,
    out,
    lse,
    dout,
    dlse=None,
    *,
    sm_scale: float | None = None,
    cap: CapParams | None = None,
    tuning=None,
    interpret=False,
):
    """Gradients ``(dq, dk, dv)`` of ranker attention from the forward's residuals.

    Args:
      q, k, v, bounds: the forward's inputs (see ``ranker_attention_fwd``).
      out: ``[B, S, Hq, D]`` the forward output; lse: ``[B, Hq, S]`` float32 natural-log
        LSE (``-inf`` on rows with no allowed key).
      dout: cotangent of ``out``; dlse: cotangent of ``lse`` or ``None`` (zero).
      sm_scale, cap: as in the forward. interpret: ``True`` or ``InterpretGPUParams``.
      tuning: ``attn_mosaic_gpu.tuning.BackwardTuning`` (schedule knobs of the pipelined
        kernels, D 64 and 128) or ``None`` for their defaults; D=256 takes none.

    Returns ``dq [B,S,Hq,D]``, ``dk, dv [B,S,Hkv,D]`` in the input dtypes.
    """
    problem = check_ranker_inputs(
        q,
        k,
        v,
        sm_scale=sm_scale,
        cap=cap,
        dtypes=SUPPORTED_DTYPES,
        head_dims=SUPPORTED_HEAD_DIMS,
    )
    validate_bwd(problem.head_dim, q.dtype)
    if (
        packed_users(bounds, min_users=MIN_PACKED_USERS)
        and problem.head_dim not in PIPELINED_HEAD_DIMS
    ):
        raise ValueError(
            f"bounds: packed rows [B, U, 4] need head_dim in {PIPELINED_HEAD_DIMS} on "
            f"Hopper; got {problem.head_dim}"
        )
    clipped, users = normalize_ranker_bounds(
        bounds, batch=problem.batch, seq_len=problem.seq_len, min_users=MIN_PACKED_USERS
    )
    target = resolve_target(interpret)

    finite = jnp.isfinite(lse)
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), dout.astype(jnp.float32))
    if dlse is not None:
        delta = delta - jnp.where(finite, dlse.astype(jnp.float32), 0.0)
    lse2 = jnp.where(finite, lse.astype(jnp.float32) * LOG2E, jnp.inf)

    seq = problem.seq_len
    pipelined = problem.head_dim in PIPELINED_HEAD_DIMS
    knobs = {} if tuning is None else tuning.knobs()
    if knobs and not pipelined:
        raise ValueError(
            f"tuning: the D={problem.head_dim} backward kernels have no schedule knobs "
            "(pass tuning=None)"
        )
    # the pipelined kernels own 2 x 64 rows per program
    seq_pad = round_up(seq, 2 * BLOCK if pipelined else BLOCK)
    dout = dout.astype(q.dtype)
    if seq_pad != seq:
        pad = ((0, 0), (0, seq_pad - seq), (0, 0), (0, 0))
        q, k, v, dout = (jnp.pad(x, pad) for x in (q, k, v, dout))
        pad_vec = ((0, 0), (0, 0), (0, seq_pad - seq))
        lse2 = jnp.pad(lse2, pad_vec, constant_values=jnp.inf)
        delta = jnp.pad(delta, pad_vec)
    fields = problem.padded(seq_pad)
    bounds = clipped.astype(jnp.int32)
    if pipelined:
        dq, dk, dv = pipelined_bwd(
            q, k, v, dout, lse2, delta, bounds, st_fields=fields, interpret=target,
            tuning=knobs, users=users,
        )  # fmt: skip
    else:
        dq, dk, dv = d256_bwd(
            q, k, v, dout, lse2, delta, bounds, st=BwdStatic(**fields), target=target
        )
    if seq_pad != seq:
        dq, dk, dv = dq[:, :seq], dk[:, :seq], dv[:, :seq]
    return dq, dk, dv
