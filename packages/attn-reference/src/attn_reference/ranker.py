"""Reference ranker attention: the executable definition of the op (docs/design.md).

Plain JAX, differentiable by autodiff. Memory-bounded: queries are processed in chunks
by ``lax.map`` over a ``jax.checkpoint``-ed body, so neither the forward nor the
backward ever holds more than one chunk's ``[B, Hq, chunk, S]`` scores (the full
``[B, Hq, S, S]`` float32 score tensor of the ``phoenix`` shape would be 6.8 GB).
Each chunk runs an exact softmax over all ``S`` keys; masked scores are ``-inf``, and
the max, normaliser and log are guarded so a row with no allowed key gives ``out = 0``,
``lse = -inf`` and zero gradients.

Isolation (docs/semantics.md): rows a query does not attend may hold anything (NaN,
Inf, 1e30), in the inputs and in the cotangents. Each position belongs to the first
user slot holding it (the only one, users being disjoint). Per user ``u`` the queries
outside ``u`` and the keys outside ``u``'s history are selected to zero (``jnp.where``)
before the score product and the ``P @ V`` product, and the rows of that product that
are not ``u``'s are selected away, so no product over positions, nor its transpose in
the backward (autodiff: the VJP of a select is a select), ever multiplies a row of
another user, padding, or another candidate, even by 0. A candidate's score against
itself is an elementwise product of its own ``q`` and ``k`` rows. So a query row's
results depend only on its own rows and the rows it attends, and a poisoned run equals
the run with those rows zeroed bitwise. Cost: ``U`` score and ``U`` ``P @ V`` products
per chunk (``U`` users per row) and one softmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attn_common import CapParams, cap_forward
from attn_common.packed import normalize_packed_bounds
from attn_common.spec import RankerCall, public_op, ranker_call

# Largest score chunk [B, Hq, chunk, S] the reference materialises at once (elements).
_CHUNK_ELEMENTS = 1 << 25
HIGHEST = jax.lax.Precision.HIGHEST


def _query_chunk(batch: int, q_heads: int, seq_len: int) -> int:
    chunk = max(1, _CHUNK_ELEMENTS // max(1, batch * q_heads * seq_len))
    if chunk >= 8:
        chunk -= chunk % 8
    return min(chunk, seq_len)


@functools.partial(jax.jit, static_argnames=("sm_scale", "cap", "chunk"))
def _ranker_reference(q, k, v, bounds, *, sm_scale: float, cap: CapParams, chunk: int):
    """q ``[B,S,Hq,D]``, k/v ``[B,S,Hkv,D]``, normalized bounds ``[B,U,4]`` -> out, lse.

    Isolation by construction (module docstring): every contraction over positions runs
    on operands in which the rows outside one user are selected to zero.
    """
    batch, seq_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    num_users = bounds.shape[1]
    compute = jnp.promote_types(q.dtype, jnp.float32)
    n_chunks = -(-seq_len // chunk)
    total = n_chunks * chunk
    pad = total - seq_len

    pos = jnp.arange(seq_len, dtype=jnp.int32)
    hl, hu, cl, cu = (bounds[:, :, t, None] for t in range(4))  # [B, U, 1]
    in_h = (hl <= pos) & (pos < hu)  # [B, U, T]
    in_c = (cl <= pos) & (pos < cu)
    # Each position belongs to the first user slot holding it (only one with disjoint
    # users); -1: padding, attends nothing.
    held = in_h | in_c
    owner = jnp.where(held.any(axis=1), jnp.argmax(held, axis=1), -1).astype(jnp.int32)
    own_h = jnp.take_along_axis(in_h, jnp.maximum(owner, 0)[:, None], axis=1)[:, 0]
    own_c = jnp.take_along_axis(in_c, jnp.maximum(owner, 0)[:, None], axis=1)[:, 0]
    self_key = (owner >= 0) & own_c & ~own_h  # a candidate outside its own history: [B, T]

    def chunked(x, fill=0):  # [B, S, ...] -> [n, B, c, ...], padded with ``fill``
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
        return x.reshape(batch, n_chunks, chunk, *x.shape[2:]).swapaxes(0, 1)

    qc = q.astype(compute).reshape(batch, seq_len, kv_heads, group, head_dim)
    kc, vc = k.astype(compute), v.astype(compute)
    xs = (
        chunked(qc),  # [n, B, c, Hkv, G, D]
        chunked(kc),  # the chunk's own keys / values (the candidate self term)
        chunked(vc),
        chunked(owner, -1),  # [n, B, c]; the padding rows belong to no user
        chunked(self_key, False),
    )
    hist = in_h  # [B, U, S]: user u's history keys

    @jax.checkpoint
    def attend_chunk(args):
        q_blk, k_self, v_self, own, diag = args

        # Scores of each query against its own user's history: per user, the queries
        # and keys outside that user are selected to zero before the product, so the
        # products (and their transposes in the backward) never meet another user's rows.
        # A loop (a scan: one traced body whatever U is) over the user slots.
        def user_scores(u, s):
            rows = own == u  # [B, c]
            keys = hist[:, u]  # [B, S]
            q_u = jnp.where(rows[:, :, None, None, None], q_blk, 0.0)
            k_u = jnp.where(keys[:, :, None, None], kc, 0.0)
            s_u = jnp.einsum("bqhgd,bkhd->bhgqk", q_u, k_u, precision=HIGHEST)
            allowed = rows[:, None, None, :, None] & keys[:, None, None, None, :]
            return jnp.where(allowed, cap_forward(s_u * sm_scale, cap), s)

        s = jnp.full((batch, kv_heads, group, chunk, seq_len), -jnp.inf, compute)
        s = jax.lax.fori_loop(0, num_users, user_scores, s)
        # A candidate's score against itself: an elementwise product of its own rows.
        q_d = jnp.where(diag[:, :, None, None, None], q_blk, 0.0)
        k_d = jnp.where(diag[:, :, None, None], k_self, 0.0)
        s_d = jnp.einsum("bqhgd,bqhd->bhgq", q_d, k_d, precision=HIGHEST)
        s_d = jnp.where(diag[:, None, None, :], cap_forward(s_d * sm_scale, cap), -jnp.inf)

        m = jnp.maximum(jnp.max(s, axis=-1), s_d)  # [B, Hkv, G, c]
        m = jax.lax.stop_gradient(m)
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # empty row: exp(-inf - 0) = 0, not NaN
        p = jnp.exp(s - m[..., None])
        p_d = jnp.exp(s_d - m)
        denom = jnp.sum(p, axis=-1) + p_d
        has_key = denom > 0
        safe = jnp.where(has_key, denom, 1.0)
        v_d = jnp.where(diag[:, :, None, None], v_self, 0.0)

        def user_values(u, o):
            rows = own == u
            v_u = jnp.where(hist[:, u][:, :, None, None], vc, 0.0)
            p_u = jnp.where(rows[:, None, None, :, None], p, 0.0)
            o_u = jnp.einsum("bhgqk,bkhd->bqhgd", p_u, v_u, precision=HIGHEST)
            return o + jnp.where(rows[:, :, None, None, None], o_u, 0.0)

        o = jnp.zeros((batch, chunk, kv_heads, group, head_dim), compute)
        o = jax.lax.fori_loop(0, num_users, user_values, o)
        # The self term last, so the result does not depend on which slot holds a user
        # (XLA may fuse this product and sum into one FMA).
        o = o + jnp.moveaxis(p_d, -1, 1)[..., None] * v_d[:, :, :, None]
        o = o / jnp.moveaxis(safe, -1, 1)[..., None]
        lse = jnp.where(has_key, m + jnp.log(safe), -jnp.inf)  # [B, Hkv, G, c]
        return o, lse

    o, lse = jax.lax.map(attend_chunk, xs)
    # o: [n, B, c, Hkv, G, D] -> [B, S, Hq, D];  lse: [n, B, Hkv, G, c] -> [B, Hq, S]
    out = o.swapaxes(0, 1).reshape(batch, total, q_heads, head_dim)[:, :seq_len]
    lse = jnp.moveaxis(lse, 0, 3).reshape(batch, q_heads, total)[:, :, :seq_len]
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
