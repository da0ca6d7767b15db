"""Sparse MLA on XLA: the executable definition, its gradient and the attention mass.

``attn_reference.sparse_mla_attention`` is :func:`xla_sparse_mla` behind the shared
spec; the kernel backends use it where they have no kernel of their own:

* :func:`xla_sparse_mla` (forward, differentiable): each query gathers the ``K *
  read_block`` key rows of its selected units from the row store
  (``attn_common.sparse_mla_rows.sparse_mla_units``), marks which are valid (a real
  selection, the first occurrence of its unit, ``position >= t``, ``t < kv_len``) and
  runs an exact masked softmax. Queries go in chunks (``lax.map``) so that memory stays
  bounded by one chunk's gathered keys, in the backward too: each chunk is
  rematerialised (``jax.checkpoint``) rather than saved.
* :func:`with_xla_backward`: a kernel forward made differentiable by a ``custom_vjp``
  whose backward is the VJP of :func:`xla_sparse_mla` (recomputed from ``q``, the cache
  and the integer tables), until backward kernels land.
* :func:`attn_mass_from_lse`: the indexer's target from a kernel's LSE.

Rows a query does not attend may hold anything (NaN, Inf): the gathered keys of those
rows are replaced by zeros (a select, not a product) *before* the score and value
products, so ``0 * NaN`` never happens in the forward or the backward. The gradient
reaching the store is the transpose of that select: exactly zero for a row no query
attends, whatever it holds. The running max is a ``stop_gradient`` (the softmax does not
depend on it), so no gradient flows through the argmax either. Duplicate selections are
dropped before anything is gathered, so a unit listed twice contributes, and receives
gradient, once.

The attention mass (``return_attn_mass``) is ``stop_gradient``: it is the target the
indexer is trained toward (KL), not a path for that loss into the main attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from attn_common.fp8_cache import Fp8LatentCache, dequantize_latent_cache
from attn_common.sparse_mla import empty_result
from attn_common.sparse_mla_rows import UnitRows, sparse_mla_units
from attn_common.spec import SparseMlaCall

CHUNK_ELEMENTS = 1 << 25  # gathered key elements per query chunk


def _dedupe(first_row: jax.Array) -> jax.Array:
    """Drop repeated selections of a unit (selections are sets): later copies -> -1.

    Two stable sorts of ``[N, K]`` (by row, then back by slot), not a ``K x K``
    comparison: ``K = 2048`` token selections would compare 4M pairs per query."""
    n, k = first_row.shape
    if k < 2:
        return first_row
    slot = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (n, k))
    rows, slots = jax.lax.sort((first_row, slot), dimension=1, num_keys=2)  # copies by slot
    repeat = jnp.concatenate([jnp.zeros((n, 1), bool), rows[:, 1:] == rows[:, :-1]], axis=1)
    _, repeated = jax.lax.sort((slots, repeat), dimension=1, num_keys=1)
    return jnp.where(repeated, -1, first_row)


def _chunked(chunk: int, q, units: UnitRows, lse=None) -> tuple:
    """The per-query inputs in ``[n_chunks, chunk, ...]`` blocks (``lax.map``'s xs),
    duplicates dropped; padding queries select nothing."""
    n = q.shape[0]
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def blocks(x, fill):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    xs = (
        blocks(q, 0),
        blocks(_dedupe(units.first_row), -1),
        blocks(units.first_pos, 0),
        blocks(units.position, -1),
        blocks(units.kv_len, 0),
    )
    return xs if lse is None else (*xs, blocks(lse, -jnp.inf))


def _gather_keys(store, rows, dk: int, dtype) -> jax.Array:
    """Store rows ``rows`` as keys ``[..., Dk]`` in ``dtype``; an ``Fp8LatentCache``
    store's rows are dequantized here, after the gather (never the whole cache)."""
    if isinstance(store, Fp8LatentCache):
        return dequantize_latent_cache(store.take_rows(rows)).astype(dtype)
    return store[rows, :dk].astype(dtype)


def _chunk_scores(q_c, store, row0, pos0, qpos, kv_len, *, sm_scale, read_block):
    """One chunk: masked scores ``[c, H, K*RB]`` (``-inf`` where not attended), the
    attended rows' keys ``[c, K*RB, Dk]`` (zeros elsewhere) and the valid mask."""
    chunk, dk = q_c.shape[0], q_c.shape[-1]
    r = jnp.arange(read_block, dtype=jnp.int32)
    rows = (row0[:, :, None] + r).reshape(chunk, -1)  # [c, K*RB]
    tpos = (pos0[:, :, None] + r).reshape(chunk, -1)
    selected = jnp.repeat(row0 >= 0, read_block, axis=1)
    valid = selected & (tpos <= qpos[:, None]) & (tpos < kv_len[:, None])
    gathered = _gather_keys(store, jnp.clip(rows, 0, store.shape[0] - 1), dk, q_c.dtype)
    # Rows the query does not attend may hold anything (page tails, unwritten slots):
    # select zeros there before any product, so that neither the scores nor the
    # backward's ds @ K and P^T dO ever multiply garbage (0 * NaN = NaN).
    keys = jnp.where(valid[:, :, None], gathered, 0.0)
    s = jnp.einsum("chd,ctd->cht", q_c, keys, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(valid[:, None, :], s * sm_scale, -jnp.inf), keys


def _slot_mass(p, top_k: int, read_block: int):
    """``p [c, H, K*RB]`` normalised probabilities -> ``[c, K]`` summed over each slot's
    tokens, averaged over heads."""
    chunk, heads, _ = p.shape
    return jnp.sum(p.reshape(chunk, heads, top_k, read_block), axis=(1, 3)) / heads


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "read_block", "chunk", "attn_mass"))
def _attend_units(q, store, units: UnitRows, *, sm_scale, dv, read_block, chunk, attn_mass):
    """q ``[N, H, Dk]``, store ``[R, >=Dk]`` -> out ``[N, H, dv]``, lse ``[N, H]`` and
    (``attn_mass``) mass ``[N, K]``, all in the compute dtype (float32, or wider)."""
    n, heads, _ = q.shape
    top_k = units.first_row.shape[1]
    compute = jnp.promote_types(q.dtype, jnp.float32)
    xs = _chunked(chunk, q.astype(compute), units)

    @jax.checkpoint  # the backward recomputes a chunk instead of keeping its gathered keys
    def attend(args):
        q_c, row0, pos0, qpos, kv_len = args
        s, keys = _chunk_scores(
            q_c, store, row0, pos0, qpos, kv_len, sm_scale=sm_scale, read_block=read_block
        )
        m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1)
        safe = jnp.where(denom > 0, denom, 1.0)
        o = jnp.einsum("cht,ctd->chd", p, keys[..., :dv], precision=jax.lax.Precision.HIGHEST)
        lse = jnp.where(denom > 0, m[..., 0] + jnp.log(safe), -jnp.inf)
        mass = (
            _slot_mass(jax.lax.stop_gradient(p / safe[..., None]), top_k, read_block)
            if attn_mass
            else jnp.zeros((q_c.shape[0], 0), compute)
        )
        return o / safe[..., None], lse, mass

    out, lse, mass = jax.lax.map(attend, xs)
    out = out.reshape(-1, heads, dv)[:n]
    lse = lse.reshape(-1, heads)[:n]
    return out, lse, (mass.reshape(-1, top_k)[:n] if attn_mass else None)


def _flat_query(call: SparseMlaCall) -> jax.Array:
    q = call.q
    if isinstance(q, tuple):  # (latent, rope) parts from a write-then-attend wrapper
        q = jnp.concatenate(q, axis=-1)
    return q.reshape(-1, *q.shape[2:])  # [B * S, H, Dk]


def _chunk_for(call: SparseMlaCall) -> int:
    problem = call.problem
    per_query = problem.top_k * problem.read_block * problem.dk
    n = problem.batch * problem.num_queries
    return max(1, min(n, CHUNK_ELEMENTS // max(1, per_query)))


def xla_sparse_mla(call: SparseMlaCall, *, attn_mass: bool | None = None):
    """The op on XLA: ``(out [B, S, H, Dv], lse [B, S, H], mass [B, S, K] or None)``.

    Computed in float32 (float64 for a float64 cache) at HIGHEST precision; ``out`` and
    ``lse`` are float32 for every narrower cache. Differentiable in ``call.q`` and
    ``call.kv`` through ``out`` and ``lse``; ``mass`` (``attn_mass``, default
    ``call.return_attn_mass``) is ``stop_gradient``. Needs a non-empty problem
    (``problem.is_empty`` is the caller's ``empty_result``).
    """
    problem = call.problem
    attn_mass = call.return_attn_mass if attn_mass is None else attn_mass
    units, store = sparse_mla_units(
        problem, call.kv, call.indices, call.positions, **call.ragged_kwargs()
    )
    out, lse, mass = _attend_units(
        _flat_query(call),
        store,
        units,
        sm_scale=problem.sm_scale,
        dv=problem.dv,
        read_block=problem.read_block,
        chunk=_chunk_for(call),
        attn_mass=attn_mass,
    )
    shape = (problem.batch, problem.num_queries, problem.heads)
    out, lse = out.reshape(*shape, problem.dv), lse.reshape(shape)
    if mass is not None:
        mass = mass.reshape(*shape[:2], problem.top_k).astype(jnp.float32)
    return out, lse, mass


@functools.partial(jax.jit, static_argnames=("sm_scale", "read_block", "chunk"))
def _mass_from_lse(q, store, units: UnitRows, lse, *, sm_scale, read_block, chunk):
    n, top_k = units.first_row.shape
    compute = jnp.promote_types(q.dtype, jnp.float32)
    xs = _chunked(chunk, q.astype(compute), units, lse.astype(compute))

    def mass(args):
        q_c, row0, pos0, qpos, kv_len, lse_c = args
        s, _ = _chunk_scores(
            q_c, store, row0, pos0, qpos, kv_len, sm_scale=sm_scale, read_block=read_block
        )
        # lse = -inf only where no key is valid, and then every s is -inf too.
        p = jnp.exp(s - jnp.where(jnp.isfinite(lse_c), lse_c, 0.0)[..., None])
        return _slot_mass(p, top_k, read_block)

    return jax.lax.map(mass, xs).reshape(-1, top_k)[:n]


def attn_mass_from_lse(call: SparseMlaCall, lse: jax.Array) -> jax.Array:
    """The attention mass ``[B, S, K]`` float32 from a kernel's ``lse [B, S, H]``:
    ``exp(s - lse)`` over each slot's valid tokens, summed, averaged over heads, with
    the scores ``s`` recomputed on XLA in float32 (the gather and ``Q K^T`` of the
    forward, no softmax pass and no value product). ``stop_gradient``; ``0`` for ``-1``,
    out-of-range and duplicate slots and for queries with no valid key."""
    problem = call.problem
    q, kv, lse = jax.lax.stop_gradient((call.q, call.kv, lse))
    units, store = sparse_mla_units(
        problem, kv, call.indices, call.positions, **call.ragged_kwargs()
    )
    mass = _mass_from_lse(
        _flat_query(call.replace(q=q)),
        store,
        units,
        lse.reshape(-1, problem.heads),
        sm_scale=problem.sm_scale,
        read_block=problem.read_block,
        chunk=_chunk_for(call),
    )
    return mass.reshape(problem.batch, problem.num_queries, problem.top_k).astype(jnp.float32)


def with_xla_backward(
    forward: Callable[[SparseMlaCall], tuple[jax.Array, jax.Array]],
) -> Callable[[SparseMlaCall], tuple[jax.Array, jax.Array]]:
    """A kernel ``forward(call) -> (out, lse)`` made differentiable in ``call.q`` and
    ``call.kv``: a ``jax.custom_vjp`` whose forward is the kernel and whose backward is
    the VJP of :func:`xla_sparse_mla` recomputed from the residuals ``q``, the cache and
    the integer tables (the kernel's ``out`` and ``lse`` are not kept). Both ``out`` and
    ``lse`` take cotangents, so a loss on the LSE is differentiable. The integer inputs
    (indices, positions, the ragged tables) get no cotangent (``float0`` zeros to
    ``jax.vjp``). ``forward`` must compute ``lse`` whatever ``call.return_lse`` says.
    """

    join = join_call

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attention(static, q, kv, data):
        return forward(join(static, q, kv, data))

    def attention_fwd(static, q, kv, data):
        return forward(join(static, q, kv, data)), (q, kv, data)

    def attention_bwd(static, residuals, cotangents):
        q, kv, data = residuals

        def xla(q, kv):
            out, lse, _ = xla_sparse_mla(join(static, q, kv, data), attn_mass=False)
            return out, lse

        _, vjp = jax.vjp(xla, q, kv)
        dq, dkv = vjp(cotangents)
        return dq, dkv, None

    attention.defvjp(attention_fwd, attention_bwd)
    return lambda call: attention(*split_call(call))


def split_call(call: SparseMlaCall):
    """``(static, q, kv, data)`` of a call for a ``jax.custom_vjp`` over ``q`` and ``kv``:
    ``static`` (hashable, no arrays) its non-differentiable argument, ``data`` the integer
    inputs (indices, positions, the ragged tables), which get no cotangent."""
    data = (call.indices, call.positions, call.ragged)
    static = call.replace(q=None, kv=None, indices=None, positions=None, ragged=None)
    return static, call.q, call.kv, data


def join_call(static, q, kv, data) -> SparseMlaCall:
    """The call :func:`split_call` took apart."""
    indices, positions, ragged = data
    return static.replace(q=q, kv=kv, indices=indices, positions=positions, ragged=ragged)


def kernel_result(call: SparseMlaCall, forward: Callable[[SparseMlaCall], tuple]):
    """The op's result (``call.result``) for a kernel ``forward(call) -> (out, lse)``
    (the LSE always): the empty result for an empty problem; else the kernel's ``out``
    and ``lse`` made differentiable by :func:`with_xla_backward`, plus the attention mass
    from its LSE (:func:`attn_mass_from_lse`) where the call asks for it."""
    if call.problem.is_empty:
        return empty_result(call.problem, call.return_lse, call.return_attn_mass)
    out, lse = with_xla_backward(forward)(call)
    mass = attn_mass_from_lse(call, lse) if call.return_attn_mass else None
    return call.result(out, lse, mass)


__all__ = [
    "CHUNK_ELEMENTS",
    "attn_mass_from_lse",
    "join_call",
    "kernel_result",
    "split_call",
    "with_xla_backward",
    "xla_sparse_mla",
]
