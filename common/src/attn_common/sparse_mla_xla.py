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
  whose backward runs on XLA from the kernel's saved ``out`` and ``lse`` (the
  flash-attention backward over each query's gathered keys, in ``lax.scan`` chunks,
  products in the query's dtype with float32 sums), until backward kernels land.
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
BACKWARD_CHUNK_ELEMENTS = 1 << 27  # the same for the kernels' backward (with_xla_backward)


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


def _chunked(chunk: int, q, units: UnitRows, *extra: tuple[jax.Array, float]) -> tuple:
    """The per-query inputs in ``[n_chunks, chunk, ...]`` blocks (``lax.map``'s xs),
    duplicates dropped; padding queries select nothing. ``extra``: more per-query
    ``(array, padding value)`` pairs, appended in order."""
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
    return (*xs, *(blocks(x, fill) for x, fill in extra))


def _gather_keys(store, rows, dk: int, dtype) -> jax.Array:
    """Store rows ``rows`` as keys ``[..., Dk]`` in ``dtype``; an ``Fp8LatentCache``
    store's rows are dequantized here, after the gather (never the whole cache)."""
    if isinstance(store, Fp8LatentCache):
        return dequantize_latent_cache(store.take_rows(rows)).astype(dtype)
    return store[rows, :dk].astype(dtype)


def _chunk_keys(store, row0, pos0, qpos, kv_len, *, dk, dtype, read_block):
    """One chunk's store rows ``[c, K*RB]``, which of them the query attends (a
    selection, ``position >= t``, ``t < kv_len``) and their keys ``[c, K*RB, Dk]`` in
    ``dtype``, zeros where not attended."""
    chunk = row0.shape[0]
    r = jnp.arange(read_block, dtype=jnp.int32)
    rows = (row0[:, :, None] + r).reshape(chunk, -1)  # [c, K*RB]
    tpos = (pos0[:, :, None] + r).reshape(chunk, -1)
    selected = jnp.repeat(row0 >= 0, read_block, axis=1)
    valid = selected & (tpos <= qpos[:, None]) & (tpos < kv_len[:, None])
    gathered = _gather_keys(store, jnp.clip(rows, 0, store.shape[0] - 1), dk, dtype)
    # Rows the query does not attend may hold anything (page tails, unwritten slots):
    # select zeros there before any product, so that neither the scores nor the
    # backward's ds @ K and P^T dO ever multiply garbage (0 * NaN = NaN).
    return rows, valid, jnp.where(valid[:, :, None], gathered, jnp.zeros((), dtype))


def _chunk_scores(q_c, store, row0, pos0, qpos, kv_len, *, sm_scale, read_block):
    """One chunk: masked scores ``[c, H, K*RB]`` (``-inf`` where not attended), the
    attended rows' keys ``[c, K*RB, Dk]`` (zeros elsewhere) and the valid mask."""
    _, valid, keys = _chunk_keys(
        store, row0, pos0, qpos, kv_len, dk=q_c.shape[-1], dtype=q_c.dtype, read_block=read_block
    )
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


def _chunk_for(call: SparseMlaCall, elements: int | None = None) -> int:
    """Queries per chunk: ``elements`` (default ``CHUNK_ELEMENTS``) gathered key
    elements, at most all queries."""
    elements = CHUNK_ELEMENTS if elements is None else elements
    problem = call.problem
    per_query = problem.top_k * problem.read_block * problem.dk
    n = problem.batch * problem.num_queries
    return max(1, min(n, elements // max(1, per_query)))


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
    xs = _chunked(chunk, q.astype(compute), units, (lse.astype(compute), -jnp.inf))

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


def _store_keys(store) -> jax.Array:
    """The row store ``[R, W]`` as the backward's float32 (or wider) key gradient
    differentiates it: an ``Fp8LatentCache`` dequantized, a plain store cast."""
    if isinstance(store, Fp8LatentCache):
        keys = dequantize_latent_cache(store)
        return keys.reshape(-1, keys.shape[-1])
    return store.astype(jnp.promote_types(store.dtype, jnp.float32))


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "read_block", "chunk"))
def _backward_units(
    q, store, units: UnitRows, lse, g_out, delta, *, sm_scale, dv, read_block, chunk
):
    """The gradient from the saved LSE: ``dq [N, H, Dk]`` and the store keys' gradient
    ``[R, Dk]`` float32, queries in chunks (``lax.scan``, the store gradient in the carry).

    Per chunk, with the chunk's attended keys ``K`` (zeros where not attended):
    ``P = exp(Q K^T s - lse)``, ``dP = dO V^T``, ``dS = P (dP - delta)``, ``dq = s dS K``,
    ``dK = s dS^T Q + [P^T dO, 0]``, scatter-added into the carry at the attended rows
    only. Products take ``q``'s dtype with float32 accumulation (HIGHEST precision for
    float32 and wider), elementwise math is float32."""
    n, heads, dk = q.shape
    dtype = q.dtype
    acc = jnp.promote_types(dtype, jnp.float32)
    wide = jnp.dtype(dtype).itemsize >= 4
    precision = jax.lax.Precision.HIGHEST if wide else jax.lax.Precision.DEFAULT
    prod = functools.partial(jnp.einsum, precision=precision, preferred_element_type=acc)
    xs = _chunked(chunk, q, units, (lse.astype(acc), -jnp.inf), (g_out.astype(dtype), 0),
                  (delta.astype(acc), 0))  # fmt: skip
    n_rows = store.shape[0]

    def step(dkeys_all, args):
        q_c, row0, pos0, qpos, kv_len, lse_c, do_c, delta_c = args
        rows, valid, keys = _chunk_keys(
            store, row0, pos0, qpos, kv_len, dk=dk, dtype=dtype, read_block=read_block
        )
        s = prod("chd,ctd->cht", q_c, keys) * sm_scale
        m = jnp.where(jnp.isfinite(lse_c), lse_c, 0.0)[..., None]
        p = jnp.where(valid[:, None, :], jnp.exp(s - m), 0.0)
        ds = p * (prod("chv,ctv->cht", do_c, keys[..., :dv]) - delta_c[..., None])
        dq_c = prod("cht,ctd->chd", ds.astype(dtype), keys) * sm_scale
        dkeys = prod("cht,chd->ctd", ds.astype(dtype), q_c) * sm_scale
        dkeys = dkeys.at[..., :dv].add(prod("cht,chv->ctv", p.astype(dtype), do_c))
        target = jnp.where(valid, rows, n_rows).reshape(-1)  # not attended: dropped
        return dkeys_all.at[target].add(dkeys.reshape(-1, dk), mode="drop"), dq_c

    dkeys_all, dq = jax.lax.scan(step, jnp.zeros((n_rows, dk), acc), xs)
    return dq.reshape(-1, heads, dk)[:n], dkeys_all


def _lse_backward(call: SparseMlaCall, out, lse, cotangents, units_backward=None):
    """``(dq, dkv)`` of the op at ``call`` from its ``out`` and ``lse`` and their
    cotangents: ``units_backward(q, store, units, lse, g_out, delta, problem) -> (dq
    [N, H, Dk], dkeys [R, Dk])`` float32 (a backend's kernels), or where it is ``None``
    or returns ``None`` :func:`_backward_units` on XLA."""
    problem = call.problem
    heads, dv = problem.heads, problem.dv
    kwargs = call.ragged_kwargs()

    def store_keys(kv):  # the differentiated keys [R, Dk]; the tables and store as aux
        units, store = sparse_mla_units(problem, kv, call.indices, call.positions, **kwargs)
        return _store_keys(store)[:, : problem.dk], (units, store)

    _, keys_vjp, (units, store) = jax.vjp(store_keys, call.kv, has_aux=True)
    q, q_vjp = jax.vjp(lambda q: _flat_query(call.replace(q=q)), call.q)
    g_out, g_lse = cotangents
    g_out = g_out.reshape(-1, heads, dv).astype(jnp.float32)
    lse = lse.reshape(-1, heads).astype(jnp.float32)
    # A query with no valid key has lse = -inf whatever its cotangent: no gradient.
    g_lse = jnp.where(jnp.isfinite(lse), g_lse.reshape(-1, heads), 0.0)
    delta = jnp.sum(g_out * out.reshape(-1, heads, dv).astype(jnp.float32), axis=-1) - g_lse
    grads = None
    if units_backward is not None:
        grads = units_backward(q, store, units, lse, g_out, delta, problem)
    if grads is None:
        grads = _backward_units(
            q, store, units, lse, g_out, delta, sm_scale=problem.sm_scale, dv=dv,
            read_block=problem.read_block, chunk=_chunk_for(call, BACKWARD_CHUNK_ELEMENTS),
        )  # fmt: skip
    dq, dkeys = grads
    (dq,) = q_vjp(dq.astype(q.dtype))
    (dkv,) = keys_vjp(dkeys)
    return dq, dkv


def with_saved_backward(
    forward: Callable[[SparseMlaCall], tuple[jax.Array, jax.Array]],
    backward: Callable[[SparseMlaCall, jax.Array, jax.Array, tuple], tuple],
) -> Callable[[SparseMlaCall], tuple[jax.Array, jax.Array]]:
    """A kernel ``forward(call) -> (out, lse)`` made differentiable in ``call.q`` and
    ``call.kv``: a ``jax.custom_vjp`` that keeps ``out`` and ``lse`` and calls
    ``backward(call, out, lse, (d_out, d_lse)) -> (dq, dkv)``. Both outputs take
    cotangents, so a loss on the LSE is differentiable; the integer inputs (indices,
    positions, the ragged tables) get none. ``forward`` must compute ``lse`` whatever
    ``call.return_lse`` says."""

    join = join_call

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attention(static, q, kv, data):
        return forward(join(static, q, kv, data))

    def attention_fwd(static, q, kv, data):
        out, lse = forward(join(static, q, kv, data))
        return (out, lse), (q, kv, data, out, lse)

    def attention_bwd(static, residuals, cotangents):
        q, kv, data, out, lse = residuals
        dq, dkv = backward(join(static, q, kv, data), out, lse, cotangents)
        return dq, dkv, None

    attention.defvjp(attention_fwd, attention_bwd)
    return lambda call: attention(*split_call(call))


def with_xla_backward(
    forward: Callable[[SparseMlaCall], tuple[jax.Array, jax.Array]],
) -> Callable[[SparseMlaCall], tuple[jax.Array, jax.Array]]:
    """:func:`with_saved_backward` with the backward on XLA from the saved ``out`` and
    ``lse`` (:func:`_backward_units`: the flash-attention backward over each query's
    gathered keys, nothing of the forward recomputed but the scores). The semantics are
    the reference's (sets, zero gradient on rows no query attends, whatever they hold);
    the products take the query's dtype (bfloat16 operands, float32 accumulation), as
    the forward kernel's do."""
    return with_saved_backward(forward, _lse_backward)


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


def kernel_result(
    call: SparseMlaCall, forward: Callable[[SparseMlaCall], tuple], units_backward=None
):
    """The op's result (``call.result``) for a kernel ``forward(call) -> (out, lse)``
    (the LSE always): the empty result for an empty problem; else the kernel's ``out``
    and ``lse`` made differentiable from the saved ``out`` and ``lse``, by the backend's
    ``units_backward`` (see :func:`_lse_backward`) or on XLA (:func:`with_xla_backward`),
    plus the attention mass from its LSE (:func:`attn_mass_from_lse`) where the call
    asks for it."""
    if call.problem.is_empty:
        return empty_result(call.problem, call.return_lse, call.return_attn_mass)
    backward = functools.partial(_lse_backward, units_backward=units_backward)
    out, lse = with_saved_backward(forward, backward)(call)
    mass = attn_mass_from_lse(call, lse) if call.return_attn_mass else None
    return call.result(out, lse, mass)


__all__ = [
    "CHUNK_ELEMENTS",
    "attn_mass_from_lse",
    "join_call",
    "kernel_result",
    "split_call",
    "with_saved_backward",
    "with_xla_backward",
    "xla_sparse_mla",
]
