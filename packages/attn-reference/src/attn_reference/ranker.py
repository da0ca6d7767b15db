"""Reference ranker attention: the executable definition of the op (docs/design.md).

Plain JAX, differentiable by autodiff. Memory-bounded: queries are processed in chunks
by ``lax.map`` over a ``jax.checkpoint``-ed body, so neither the forward nor the
backward ever holds more than one chunk's ``[B, Hq, chunk, S]`` scores (the full
``[B, Hq, S, S]`` float32 score tensor of the ``phoenix`` shape would be 6.8 GB).
Each chunk runs an exact softmax over all ``S`` keys; masked scores are ``-inf``, and
the max, normaliser and log are guarded so a row with no allowed key gives ``out = 0``,
``lse = -inf`` and zero gradients, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attn_common import CapParams, cap_forward
from attn_common.packed import normalize_packed_bounds, ranker_mask_packed
from attn_common.spec import RankerCall, public_op, ranker_call

# Largest score chunk [B, Hq, chunk, S] the reference materialises at once (elements).
_CHUNK_ELEMENTS = 1 << 25


def _query_chunk(batch: int, q_heads: int, seq_len: int) -> int:
    chunk = max(1, _CHUNK_ELEMENTS // max(1, batch * q_heads * seq_len))
    if chunk >= 8:
        chunk -= chunk % 8
    return min(chunk, seq_len)


@functools.partial(jax.jit, static_argnames=("sm_scale", "cap", "chunk"))
def _ranker_reference(q, k, v, bounds, *, sm_scale: float, cap: CapParams, chunk: int):
    """q ``[B,S,Hq,D]``, k/v ``[B,S,Hkv,D]``, normalized bounds ``[B,U,4]`` -> out, lse."""
    batch, seq_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    compute = jnp.promote_types(q.dtype, jnp.float32)
    n_chunks = -(-seq_len // chunk)
    pad = n_chunks * chunk - seq_len

    qc = q.astype(compute).reshape(batch, seq_len, kv_heads, group, head_dim)
    qc = jnp.pad(qc, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    q_chunks = qc.reshape(batch, n_chunks, chunk, kv_heads, group, head_dim).swapaxes(0, 1)
    q_pos = jnp.arange(n_chunks * chunk, dtype=jnp.int32).reshape(n_chunks, chunk)
    kc, vc = k.astype(compute), v.astype(compute)
    kv_pos = jnp.arange(seq_len, dtype=jnp.int32)
    row_bounds = bounds[:, None, None]  # [B, 1, 1, U, 4]: fields broadcast to [B, c, S]

    @jax.checkpoint
    def attend_chunk(args):
        q_blk, pos = args  # [B, c, Hkv, G, D], [c]
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q_blk, kc, precision=jax.lax.Precision.HIGHEST)
        s = cap_forward(s * sm_scale, cap)
        allowed = ranker_mask_packed(pos[None, :, None], kv_pos[None, None, :], row_bounds)
        s = jnp.where(allowed[:, None, None], s, -jnp.inf)  # [B, Hkv, G, c, S]
        m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # empty row: exp(-inf - 0) = 0, not NaN
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1)
        has_key = denom > 0
        safe = jnp.where(has_key, denom, 1.0)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p, vc, precision=jax.lax.Precision.HIGHEST)
        o = o / jnp.moveaxis(safe, -1, 1)[..., None]
        lse = jnp.where(has_key, m[..., 0] + jnp.log(safe), -jnp.inf)  # [B, Hkv, G, c]
        return o, lse

    o, lse = jax.lax.map(attend_chunk, (q_chunks, q_pos))
    # o: [n, B, c, Hkv, G, D] -> [B, S, Hq, D];  lse: [n, B, Hkv, G, c] -> [B, Hq, S]
    out = o.swapaxes(0, 1).reshape(batch, n_chunks * chunk, q_heads, head_dim)[:, :seq_len]
    lse = jnp.moveaxis(lse, 0, 3).reshape(batch, q_heads, n_chunks * chunk)[:, :, :seq_len]
    lse_dtype = jnp.float64 if compute == jnp.float64 else jnp.float32
    return out.astype(q.dtype), lse.astype(lse_dtype)


@public_op(ranker_call)
def ranker_attention(call: RankerCall):
    """Ranker attention (reference): history + isolated candidates, soft cap, GQA.

    Plain JAX, any float dtype and head dim; ``config`` and ``interpret`` are accepted
    and ignored, so one call site serves every backend.
    """
    p = call.problem
    clipped = normalize_packed_bounds(call.bounds, batch=p.batch, seq_len=p.seq_len)
    out, lse = _ranker_reference(
        call.q,
        call.k,
        call.v,
        clipped,
        sm_scale=p.sm_scale,
        cap=p.cap,
        chunk=_query_chunk(p.batch, p.q_heads, p.seq_len),
    )
    return (out, lse) if call.return_lse else out
