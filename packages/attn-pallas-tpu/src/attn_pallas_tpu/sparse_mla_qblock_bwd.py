"""Query-blocked sparse-MLA backward (flat and ragged paged KV), Pallas Mosaic TPU.

The gradient of the query-blocked forward (``attn_pallas_tpu.sparse_mla_qblock``) where
the queries of a block share their units: the math of ``attn_pallas_tpu.sparse_mla_bwd``
(``P = exp(s - lse)``, ``dS = P (dP - delta)``, ``dq = sm_scale dS K``, ``dK = sm_scale
dS^T q``, ``dV = P^T dO``, ``dcache[row] = dK[row] + [dV[row], 0]``), walked the way the
forward walks: each block's union of units is DMA'd once per head group, not once per
query that selected it.

Two kernels:

**Block kernel**, grid ``(B, nQB, G, C)`` as the forward's (batch row, query block, head
group, union chunk; the chunk axis sequential and innermost). The forward's tables
(``_prep.union_tables``, chunks of ``UC = MEMBER_TILE`` slots), plus per program the
group's ``dO [Hb QB, Dv]`` and ``(lse, delta)`` as two lane rows ``[2, Hb QB]``. The
union slots go through the same ring (``unit_ring.RingWalk``), ``G`` units a step,
key-major like the forward: ``s = k q^T [G RB, rows]`` with the block's membership and
``lim`` as lane rows, ``p = exp(s sm_scale - lse)`` selected to 0 off the valid set,
``dp = v dO^T``, ``ds = p (dp - delta)`` selected likewise, then

* ``dq += ds^T k`` into the float32 ``dq`` output block, resident across the chunks
  (zeroed at chunk 0, scaled by ``sm_scale`` at the last);
* the step's slots' partial cache gradients ``sm_scale ds q + [p dO, 0]`` ``[G RB,
  Dk_pad]`` (float32) into rows ``[j RB, (j + 1) RB)`` of the chunk's partial block
  ``[UC RB, Dk_pad]``, which the pipeline writes back to HBM when the chunk changes.

A chunk past the block's union maps to its last real chunk (no fetch, no write-back) and
is skipped, as in the forward. The partial slots past the union are never written and
never read.

**Sum kernel**: a union slot's partial belongs to one store block, and several blocks and
head groups send partials to the same store block. One program per span of ``sum_span``
store blocks: the used partials sorted by (span, slot) and each span's run in that list
are scalar-prefetched; the program DMAs its run through a ring of ``S`` float32 tiles
``[RB, Dk_pad]``, adds each into its store block's rows of a VMEM accumulator ``[span
RB, Dk_pad]`` and writes the span once in the store dtype. Every span is written, so a
store block no query attends is exactly 0. The order is fixed (no atomics): two runs are
equal bit for bit. SMEM holds one int32 per partial slot and per span.

Dirty caches. Rows some queries of the block may not see can hold NaN/Inf: ``p`` and
``ds`` are selected (never multiplied) to 0 there, and the key tile that ``dq`` multiplies
has its non-finite entries replaced by 0, since ``0 * NaN`` in the shared ``ds^T k``
would reach every query of the block. The forward's ``lse`` is finite wherever a query
has a valid key (else 0: its ``p`` is 0 throughout).

Why partials and not an accumulator per store block. A store block's contributions come
from every query block whose union holds it; without atomics they meet either in HBM
partials summed afterwards (here: ``RB Dk_pad`` float32 per union slot, written once and
read once) or in an inverted walk that re-reads each query block's ``q`` and ``dO`` per
store block (``Hb QB (Dk + Dv)`` values per slot, 16x the partial at H 16, QB 64). The
partials need a static buffer: ``backward_slots`` slots per block and head group. A
call whose largest union exceeds it takes the per-query backward
(``sparse_mla_bwd``) instead, decided at run time.

HBM traffic per layer: the union rows as the forward (``(H / Hb) sum_blocks(union) RB
row_bytes``), ``q`` and ``dO`` once, and ``2 (H / Hb) sum_blocks(union) RB Dk_pad 4`` bytes
of partials, plus the cache gradient written once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common.spec import SparseMlaCall
from attn_pallas_tpu._mxu import mxu_dot
from attn_pallas_tpu._prep import (
    UnionGrid,
    UnionStatic,
    default_chip,
    from_blocks,
    pad_features,
    to_blocks,
    union_tables,
    unit_space,
)
from attn_pallas_tpu.config import (
    BACKWARD_SHARING,
    MEMBER_TILE,
    SUM_ROWS,
    SparseMlaConfig,
    qblock_bwd_vmem_bytes,
    vmem_limit,
)
from attn_pallas_tpu.plan import VMEM_USABLE_FRACTION
from attn_pallas_tpu.sparse_mla_bwd import softmax_stats
from attn_pallas_tpu.unit_ring import (
    Store,
    UnionWalk,
    UnitRing,
    in_hbm,
    ring_scratch,
    slot_rooms,
)


def backward_slots(query_block: int, top_k: int, num_units: int) -> int:
    """Partial slots per (block, head group): the block's pairs ``QB K`` over
    ``BACKWARD_SHARING``, rounded up to the chunk (``MEMBER_TILE``), at most the widest
    union ``min(QB K, num_units)`` rounded likewise. A larger union takes the per-query
    backward."""
    widest = max(1, min(query_block * top_k, num_units))
    shared = -(-query_block * top_k // BACKWARD_SHARING)
    return -(-min(shared, widest) // MEMBER_TILE) * MEMBER_TILE


# ------------------------------------------------------------------------- block kernel


def _block_kernel(
    unions_ref,  # scalar prefetch SMEM [B * nQB]: true union size per block
    kb_ref,  # SMEM [1, 1, 1, UC]: first token position of each slot of this chunk
    addr_ref,  # SMEM [1, 1, 1, UC]: store address of each slot of this chunk
    lim_ref,  # VMEM [1, 1, 1, QB] int32
    mem_ref,  # VMEM [1, 1, W, QB] int32 membership words
    q_ref,  # VMEM [1, 1, 1, rows, Dk_pad], row = h * QB + q
    do_ref,  # VMEM [1, 1, 1, rows, Dv]
    st_ref,  # VMEM [1, 1, 1, 2, rows] float32: lse (0 where -inf), delta
    hbm,  # HBM store (one array)
    dq_ref,  # VMEM [1, 1, 1, rows, Dk_pad] float32, resident across the chunks
    part_ref,  # VMEM [1, 1, 1, UC RB, Dk_pad] float32: the chunk's partial gradients
    buf,  # the ring (unit_ring.ring_scratch)
    sems,
    *,
    st: UnionStatic,
    grid: UnionGrid,
):
    ring = UnitRing(st.kind, (hbm,), (buf,), sems, rb=st.rb, interpret=bool(st.interpret))
    u_chunk = kb_ref.shape[-1]
    chunk = pl.program_id(3)
    union = unions_ref[pl.program_id(0) * grid.n_blocks + pl.program_id(1)]
    count = jnp.clip(union - chunk * u_chunk, 0, u_chunk)  # slots walked in this chunk

    @pl.when(chunk == 0)
    def _():
        dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    @pl.when(count > 0)
    def _():
        _walk_chunk(
            count, q_ref, do_ref, st_ref, kb_ref, addr_ref, lim_ref, mem_ref, ring, dq_ref,
            part_ref, st,
        )  # fmt: skip

    @pl.when(chunk == grid.n_chunks - 1)
    def _():
        dq_ref[...] = dq_ref[...] * st.sm_scale


def _walk_chunk(
    count, q_ref, do_ref, st_ref, kb_ref, addr_ref, lim_ref, mem_ref, ring, dq_ref, part_ref,
    st: UnionStatic,
):  # fmt: skip
    """``count`` union slots of one chunk, ``G`` a step: ``dq`` accumulated in place, each
    step's partial gradients written to its rows of the chunk's partial block."""
    sm_scale, dk, dv, rb, heads_per_group, cfg = (
        st.sm_scale, st.page_dk, st.dv, st.rb, st.heads_per_group, st.cfg
    )  # fmt: skip
    g = cfg.units_per_step
    q = q_ref[0, 0, 0]  # [rows, Dk_pad]
    do = do_ref[0, 0, 0]  # [rows, Dv]
    lse, delta = st_ref[0, 0, 0, 0:1, :], st_ref[0, 0, 0, 1:2, :]  # [1, rows] each
    lim = lim_ref[0, 0]  # [1, QB]
    walk = UnionWalk(ring, kb_ref, addr_ref, count, group=g, slots=cfg.ring_slots)
    walk.prologue()
    key_row = jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)

    def body(t, carry):
        slot = walk.advance(t)
        kv, kbs = walk.words(t, slot, rb=rb, dtype=q.dtype, dk=dk)  # [G RB, Dk_pad]
        rooms = slot_rooms(mem_ref, t * g, kbs, lim, heads_per_group)  # [1, rows] each
        valid = [key_row < room for room in rooms]  # [RB, rows] each
        valid = valid[0] if g == 1 else jnp.concatenate(valid, axis=0)  # [G RB, rows]
        s = mxu_dot(kv, q, (((1,), (1,)), ((), ())))  # [G RB, rows]
        # Rows off the valid set may hold NaN (and so their s and dp): select, never
        # multiply.
        p = jnp.where(valid, jnp.exp(s * sm_scale - lse), 0.0)
        dp = mxu_dot(kv[:, :dv], do, (((1,), (1,)), ((), ())))  # [G RB, rows]
        ds = jnp.where(valid, p * (dp - delta), 0.0)
        # The shared ds^T k: a row valid for some queries of the block only must not
        # bring its NaN to the others (a query that attends it has a NaN ds already).
        finite = jnp.isfinite(kv.astype(jnp.float32))  # Mosaic's is_finite takes f32
        keys = jnp.where(finite, kv, jnp.zeros_like(kv))
        ds_lo = ds.astype(kv.dtype)
        dq_ref[0, 0, 0] = dq_ref[0, 0, 0] + mxu_dot(ds_lo, keys, (((0,), (0,)), ((), ())))
        dkey = mxu_dot(ds_lo, q, (((1,), (0,)), ((), ()))) * sm_scale  # [G RB, Dk_pad]
        dval = mxu_dot(p.astype(do.dtype), do, (((1,), (0,)), ((), ())))  # [G RB, Dv]
        rows = pl.ds(pl.multiple_of(t * (g * rb), g * rb), g * rb)
        part_ref[0, 0, 0, rows, :dv] = dkey[:, :dv] + dval
        if dv < dkey.shape[1]:
            part_ref[0, 0, 0, rows, dv:] = dkey[:, dv:]
        return carry

    jax.lax.fori_loop(0, walk.n_steps, body, 0)


def _physical() -> int:
    return int(default_chip().vmem_bytes / VMEM_USABLE_FRACTION)


@functools.partial(jax.jit, static_argnames=("st",))
def _block_call(q5, do5, st5, array, kb, addr, unions, lim, member, *, st: UnionStatic):
    batch, n_blocks, groups, rows, dk_pad = q5.shape
    u_chunk = kb.shape[-1]
    n_chunks = kb.shape[1] // n_blocks
    query_block = lim.shape[-1]
    store = Store(st.kind, (array,))
    grid = UnionGrid(n_blocks, n_chunks, u_chunk)
    kernel = functools.partial(_block_kernel, st=st, grid=grid)
    cfg, rb, dv, interpret = st.cfg, st.rb, st.dv, st.interpret

    need = qblock_bwd_vmem_bytes(
        cfg.replace(query_block=query_block, u_max=u_chunk), rows=rows, read_block=rb,
        dk_pad=dk_pad, dv=dv, itemsize=q5.dtype.itemsize, row_bytes=store.row_bytes,
    )  # fmt: skip
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, n_blocks, groups, n_chunks),
        in_specs=[
            *grid.table_specs(query_block),
            pl.BlockSpec((1, 1, 1, rows, dk_pad), grid.per_group),
            pl.BlockSpec((1, 1, 1, rows, dv), grid.per_group),
            pl.BlockSpec((1, 1, 1, 2, rows), grid.per_group),
            pl.BlockSpec(memory_space=pltpu.HBM),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, 1, rows, dk_pad), grid.per_group),
            pl.BlockSpec((1, 1, 1, u_chunk * rb, dk_pad), grid.per_group_chunk),
        ],
        scratch_shapes=ring_scratch(store, rb=rb, group=cfg.units_per_step, slots=cfg.ring_slots),
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((batch, n_blocks, groups, rows, dk_pad), jnp.float32),
            jax.ShapeDtypeStruct(
                (batch, n_blocks, groups, n_chunks * u_chunk * rb, dk_pad), jnp.float32
            ),
        ],
        compiler_params=pltpu.CompilerParams(
            # The chunk axis carries dq: sequential, innermost.
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit(need, _physical()),
        ),
        interpret=interpret,
    )(unions, kb, addr, lim, member, q5, do5, st5, *in_hbm(array))


# --------------------------------------------------------------------------- sum kernel


def _sum_kernel(
    starts_ref,  # scalar prefetch SMEM [spans + 1]: each span's run in the sorted list
    order_ref,  # scalar prefetch SMEM [P]: partial slot * span + block's place, sorted
    part_hbm,  # HBM [P, RB, Dk_pad] float32
    out_ref,  # VMEM [1, span RB, Dk_pad] in the store dtype
    ring,  # VMEM [S, RB, Dk_pad] float32
    sems,  # DMA semaphores [S]
    acc,  # VMEM [span RB, Dk_pad] float32
    *,
    span: int,
    slots: int,
):
    rb = ring.shape[1]
    first = starts_ref[pl.program_id(0)]
    count = starts_ref[pl.program_id(0) + 1] - first
    acc[...] = jnp.zeros_like(acc)

    def copy(j, slot):
        pid = jax.lax.div(order_ref[first + jnp.minimum(j, count - 1)], jnp.int32(span))
        return pltpu.make_async_copy(part_hbm.at[pid], ring.at[slot], sems.at[slot])

    for d in range(slots - 1):  # prologue: fill the ring

        @pl.when(d < count)
        def _(d=d):
            copy(d, jnp.int32(d)).start()

    def body(j, carry):
        nxt = j + slots - 1

        @pl.when(nxt < count)
        def _():
            copy(nxt, jax.lax.rem(nxt, jnp.int32(slots))).start()

        slot = jax.lax.rem(j, jnp.int32(slots))
        copy(j, slot).wait()
        sub = jax.lax.rem(order_ref[first + j], jnp.int32(span))
        rows = pl.ds(pl.multiple_of(sub * rb, rb), rb)
        acc[rows, :] = acc[rows, :] + ring[slot]
        return carry

    jax.lax.fori_loop(0, count, body, 0)
    out_ref[0] = acc[...].astype(out_ref.dtype)


def sum_span(num_blocks: int, rb: int) -> int:
    """Store blocks one sum program writes: the largest divisor of ``num_blocks`` with at
    most ``SUM_ROWS`` rows."""
    top = max(1, SUM_ROWS // rb)
    return next(k for k in range(min(top, num_blocks), 0, -1) if num_blocks % k == 0)


def _sum_call(partials, block, used, *, num_blocks: int, dtype, cfg, interpret):
    """The store's gradient ``[num_blocks, RB, Dk_pad]``: partial ``p`` (``used[p]``) added
    to store block ``block[p]``, each block's partials in ascending ``p``. One program per
    span of :func:`sum_span` store blocks; the used partials sorted by (span, ``p``) and
    each span's run are scalar-prefetched (a sort and a search, no gather)."""
    n, rb, dk_pad = partials.shape
    span = sum_span(num_blocks, rb)
    spans = num_blocks // span
    key = jnp.where(used > 0, block // span, spans)
    order = jnp.arange(n, dtype=jnp.int32) * span + block % span
    key, order = jax.lax.sort((key, order), num_keys=2)
    starts = jnp.searchsorted(key, jnp.arange(spans + 1, dtype=jnp.int32)).astype(jnp.int32)
    slots = cfg.ring_slots
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(spans,),
        in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
        out_specs=pl.BlockSpec((1, span * rb, dk_pad), lambda s, starts, order: (s, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((slots, rb, dk_pad), jnp.float32),
            pltpu.SemaphoreType.DMA((slots,)),
            pltpu.VMEM((span * rb, dk_pad), jnp.float32),
        ],
    )
    itemsize = jnp.dtype(dtype).itemsize
    need = (slots + 2 * span) * rb * dk_pad * 4 + 2 * span * rb * dk_pad * itemsize
    out = pl.pallas_call(
        functools.partial(_sum_kernel, span=span, slots=slots),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((spans, span * rb, dk_pad), dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit(need, _physical())
        ),
        interpret=interpret,
    )(starts, order, *in_hbm(partials))
    return out.reshape(num_blocks, rb, dk_pad)


# ----------------------------------------------------------------------------- wrapper


def blocked_backward(
    call: SparseMlaCall, out, lse, d_out, d_lse, *, query_block: int, head_block: int,
    interpret, config: SparseMlaConfig, picks=None, space=None,
):  # fmt: skip
    """``(dq, dkv)`` of a validated call (float32 or bfloat16 cache) through the two
    kernels above, at ``query_block`` x ``head_block`` programs. Exact only where every
    block's union fits :func:`backward_slots` (the caller checks; a wider union is cut).
    ``space`` (the call's ``_prep.unit_space``) and ``picks`` (``_prep.sorted_picks``'
    first value at ``query_block``): where the caller has them (its guard's), so they
    are not built again."""
    problem = call.problem
    kv = call.kv
    ragged = call.ragged_kwargs()
    if space is None:
        space = unit_space(problem, kv, call.indices, call.positions, **ragged)
    store = space.store
    (array,) = store.arrays
    batch, seq, rb, dv = problem.batch, problem.num_queries, problem.read_block, problem.dv
    slots = backward_slots(query_block, problem.top_k, problem.num_units)
    tables = union_tables(
        problem, space, query_block=query_block, u_chunk=MEMBER_TILE,
        n_chunks=slots // MEMBER_TILE, page_indices=ragged["page_indices"], picks=picks,
    )  # fmt: skip
    dtype = store.dtype
    stats = softmax_stats(out, lse, d_out, d_lse)  # [B, S, H, 2]
    q5 = to_blocks(pad_features(call.q.astype(dtype), store.width), query_block, head_block)
    do5 = to_blocks(d_out.astype(jnp.float32).astype(dtype), query_block, head_block)
    st5 = to_blocks(stats, query_block, head_block).swapaxes(-1, -2)  # [B, nQB, G, 2, rows]
    dq5, partials = _block_call(
        q5, do5, st5, array, tables.kb, tables.addr, tables.unions, tables.lim, tables.member,
        st=UnionStatic(
            store.kind, problem.sm_scale, problem.dk, dv, rb, head_block, config, interpret
        ),
    )  # fmt: skip
    # Partial slot (b, block, group, slot) -> its unit's store block.
    n_blocks, groups = q5.shape[1], q5.shape[2]
    unit = 1 if store.kind == "pages" else rb
    block = jnp.broadcast_to(
        tables.addr.reshape(batch, n_blocks, 1, slots) // unit, (batch, n_blocks, groups, slots)
    )
    slot = jax.lax.broadcasted_iota(jnp.int32, (batch, n_blocks, groups, slots), 3)
    used = (slot < tables.unions.reshape(batch, n_blocks, 1, 1)).astype(jnp.int32)
    dstore = _sum_call(
        partials.reshape(-1, rb, store.width), block.reshape(-1), used.reshape(-1),
        num_blocks=store.num_blocks(rb), dtype=dtype, cfg=config, interpret=interpret,
    )  # fmt: skip
    dq = from_blocks(dq5, seq, query_block)[..., : problem.dk].astype(call.q.dtype)
    if problem.ragged:
        return dq, dstore.reshape(kv.shape)
    tp = problem.num_units * rb
    return dq, dstore.reshape(batch, tp, store.width)[:, : problem.kv_len]


__all__ = ["backward_slots", "blocked_backward", "sum_span"]
