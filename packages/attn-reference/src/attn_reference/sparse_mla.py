"""Reference sparse MLA prefill: flat and ragged paged modes (docs/design.md).

Both modes reduce to one gather-based core: each query gathers the ``K * read_block``
key rows of its selected units from a row-addressable latent store (``kv`` flattened
over the batch, or the paged cache flattened over pages; ``attn_common.sparse_mla_rows``
says where each unit lives), marks which gathered rows are
valid (a real selection, first occurrence of its unit, ``position >= t``, ``t <
kv_len``), and runs an exact masked softmax. Values of rows a query does not attend are
zeroed before the value product, so whatever those rows hold (NaN, Inf) never reaches
its output. Queries are processed in chunks so memory
stays bounded by one chunk's gathered keys. An ``Fp8LatentCache`` is read the same way:
the gathered rows are dequantized to float32 (``latent * scale``, then the rope), so the
result is the op's on ``dequantize_latent_cache(kv)``; a NaN scale of an unattended row
is masked like any other value there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attn_common.fp8_cache import Fp8LatentCache, dequantize_latent_cache
from attn_common.sparse_mla import empty_result
from attn_common.sparse_mla_rows import UnitRows, sparse_mla_units
from attn_common.spec import SparseMlaCall, public_op, sparse_mla_call

_CHUNK_ELEMENTS = 1 << 25  # gathered key elements per query chunk


def _dedupe(first_row: jax.Array) -> jax.Array:
    """Drop repeated selections of a unit (selections are sets): later copies -> -1."""
    k = first_row.shape[-1]
    same = first_row[:, :, None] == first_row[:, None, :]
    earlier = jnp.tril(jnp.ones((k, k), bool), k=-1)[None]
    repeated = jnp.any(same & earlier, axis=2)
    return jnp.where(repeated, -1, first_row)


def _gather_keys(store, rows, dk: int) -> jax.Array:
    """Store rows ``rows`` as float32 keys ``[..., Dk]``; an ``Fp8LatentCache`` store's
    rows are dequantized here, after the gather (never the whole cache)."""
    if isinstance(store, Fp8LatentCache):
        return dequantize_latent_cache(store.take_rows(rows))
    return store[rows, :dk].astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "read_block", "chunk"))
def _attend_units(q, store, units: UnitRows, *, sm_scale, dv, read_block, chunk):
    """q ``[N, H, Dk]``, store ``[R, >=Dk]`` -> out ``[N, H, dv]`` f32, lse ``[N, H]``."""
    n, heads, dk = q.shape
    rows_total = store.shape[0]
    first_row = _dedupe(units.first_row)
    r = jnp.arange(read_block, dtype=jnp.int32)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def chunked(x, fill):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    qf = q.astype(jnp.float32)
    xs = (
        chunked(qf, 0),
        chunked(first_row, -1),
        chunked(units.first_pos, 0),
        chunked(units.position, -1),
        chunked(units.kv_len, 0),
    )

    def attend(args):
        q_c, row0, pos0, qpos, kv_len = args
        rows = (row0[:, :, None] + r).reshape(chunk, -1)  # [c, K*RB]
        tpos = (pos0[:, :, None] + r).reshape(chunk, -1)
        selected = jnp.repeat(row0 >= 0, read_block, axis=1)
        valid = selected & (tpos <= qpos[:, None]) & (tpos < kv_len[:, None])
        keys = _gather_keys(store, jnp.clip(rows, 0, rows_total - 1), dk)
        s = jnp.einsum("chd,ctd->cht", q_c, keys, precision=jax.lax.Precision.HIGHEST)
        s = jnp.where(valid[:, None, :], s * sm_scale, -jnp.inf)
        # Rows the query does not attend may hold anything (page tails, unwritten slots):
        # zero them, or their 0-weight times NaN/Inf would poison the value product.
        vals = jnp.where(valid[:, :, None], keys[..., :dv], 0.0)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1)
        safe = jnp.where(denom > 0, denom, 1.0)
        o = jnp.einsum("cht,ctd->chd", p, vals, precision=jax.lax.Precision.HIGHEST)
        lse = jnp.where(denom > 0, m[..., 0] + jnp.log(safe), -jnp.inf)
        return o / safe[..., None], lse

    out, lse = jax.lax.map(attend, xs)
    return out.reshape(-1, heads, dv)[:n], lse.reshape(-1, heads)[:n]


@public_op(sparse_mla_call)
def sparse_mla_attention(call: SparseMlaCall):
    """Sparse MLA attention over selected KV units (reference, plain JAX, any float cache
    or an ``Fp8LatentCache``).

    The query-blocked knobs (``query_block``, ``u_max``, ``head_block``) tune the TPU
    kernel and never change the answer: the reference validates them and computes the
    exact result. ``interpret`` is accepted and ignored.
    """
    problem = call.problem
    if problem.is_empty:
        return empty_result(problem, call.return_lse)
    q = call.q
    if isinstance(q, tuple):  # (latent, rope) parts from a write-then-attend wrapper
        q = jnp.concatenate(q, axis=-1)
    batch, seq, heads, dk = q.shape
    units, store = sparse_mla_units(
        problem, call.kv, call.indices, call.positions, **call.ragged_kwargs()
    )
    per_query = problem.top_k * problem.read_block * dk
    chunk = max(1, min(batch * seq, _CHUNK_ELEMENTS // max(1, per_query)))
    out, lse = _attend_units(
        q.reshape(batch * seq, heads, dk),
        store,
        units,
        sm_scale=problem.sm_scale,
        dv=problem.dv,
        read_block=problem.read_block,
        chunk=chunk,
    )
    out = out.reshape(batch, seq, heads, problem.dv)
    lse = lse.reshape(batch, seq, heads)
    return (out, lse) if call.return_lse else out


# One kernel under both names: every knob of the query-blocked variant is in the spec.
sparse_mla_attention_qblock = sparse_mla_attention
