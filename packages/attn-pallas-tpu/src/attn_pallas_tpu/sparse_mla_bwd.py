"""Sparse-MLA backward kernels (flat and ragged paged KV), Pallas Mosaic TPU.

The gradient of ``out = softmax(s) V`` and ``lse = logsumexp(s)``, ``s = sm_scale * q K^T``
over each query's selected units, w.r.t. ``q`` and the latent cache (keys are all ``Dk``
features of a row, values its first ``Dv``). With ``P = exp(s - lse)`` recomputed from the
forward's LSE, ``dP = dO V^T`` and ``delta = rowsum(dO * O) - dlse`` (one float per query
and head, computed on XLA before the kernels; ``dlse`` is the LSE's cotangent):

    dS = P * (dP - delta),   dq = sm_scale * dS K,
    dK = sm_scale * dS^T q,  dV = P^T dO,  dcache[row] = dK[row] + [dV[row], 0].

Two kernels, both deterministic (fixed order, float32 accumulation, no atomics: TPUs have
none, and two runs are equal bit for bit):

**dq** (shaped like the per-query forward, ``attn_pallas_tpu.sparse_mla``). One program per
``QP`` queries (``parallel``), walking their compacted distinct units (``compact_units``,
the forward's tables and ``unit_ring.StepWalk``) ``G`` a step through the same VMEM ring.
Per step: clear the rows the query may not see (``kb + r >= lim``: page tails, future
tokens; they may hold NaN; in place, on steps that are not clean, as the forward does)
and the feature padding, ``s = q k^T [H, G RB]``, ``p``, ``dp
= dO v^T``, ``ds``, ``dq += ds k``; at the query's last step ``dq * sm_scale`` is
written.

**dKV** (one accumulator per store block of ``RB`` rows, walked over the *inverted
selection*). :func:`invert_selection` (small pure ``jnp``, outside the kernel) lists every
live (unit, query) pair of the compacted tables, drops pairs with no valid row, and sorts
them by (store block, query): each block's pairs are contiguous and in ascending query
order. A query's selection is already a set, so a unit a query listed twice is one pair.
Each block's run of pairs is cut into chunks of ``PAIR_CHUNK`` (at least one chunk per
block, so a block no query attends is still visited and written: exactly 0, whatever the
cache holds there). The grid is one program per chunk (``arbitrary``: sequential), with
each chunk's store block scalar-prefetched (one int32 per chunk: the only table that
grows with the cache, ~4 bytes per ``RB`` cache rows of SMEM); the store block ``[RB,
Dk_pad]`` and the output block are indexed by it, so consecutive chunks of one block
keep both resident (the pipeline neither re-reads nor writes back until the block
changes) and the float32 sums live in VMEM scratch from the block's first chunk to its
last. Per chunk ``(pairs, first, last)`` and the pairs' query ids and valid-row counts
come in SMEM blocks. A step takes ``QC`` pairs (``config.pairs_per_step`` when ``H``
fills whole sublane tiles, else 1): each pair's ``q [H, Dk_pad]``, ``dO [H, Dv]`` and
``(lse, delta) [H, 2]`` are DMA'd from HBM into its rows ``[c H, (c + 1) H)`` of a ring
slot, so the products see ``QC H`` rows: ``s = Q k^T [QC H, RB]``, the valid keys of
pair ``c`` a prefix ``r < nvalid_c`` (causal and ``kv_len`` bounds cut a unit at one row),
``dK += ds^T Q``, ``dV += p^T dO``; rows of pairs past the chunk's count are zeroed
before any product.

Why this dKV design. The alternative, each dq program adding its units' ``ds^T q`` into
the cache gradient, needs atomics (none on TPU) or per-pair partial sums in HBM
(``N K RB Dk`` float32: 21 GB at the production shape). The inverted walk reads each
pair's query rows instead of its key rows; its bytes are in docs/tpu_sparse_mla.md
("Backward"): at ``H = 128`` they are about 14x the dq kernel's, since one pair moves
``H (Dk + Dv)`` query-side values for ``RB`` key rows.

Dirty caches. Rows a query may not see are zeroed (dq) or their ``p`` and ``ds`` selected
to 0 (dKV) before any product, so ``0 * NaN`` never happens; the feature padding of a
paged cache is zeroed in both. The gradient of a row no pair marks valid is a sum of
exact zeros.

Coverage. Everything the forward kernels take (float32 / bfloat16 cache, ``read_block %
16 == 0``, flat and ragged paged) runs these kernels; any other cache (an FP8 cache, if a
forward kernel takes one) falls back to the XLA backward (``with_xla_backward``), explicitly.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common.fp8_cache import Fp8LatentCache
from attn_common.sparse_mla import empty_result
from attn_common.sparse_mla_xla import (
    attn_mass_from_lse,
    with_saved_backward,
    with_xla_backward,
)
from attn_common.spec import SparseMlaCall
from attn_pallas_tpu._mxu import mxu_dot
from attn_pallas_tpu._prep import (
    KERNEL_DTYPES,
    compact_units,
    default_chip,
    pad_features,
    program_tables,
    store_blocks,
    unit_space,
)
from attn_pallas_tpu.config import PAIR_CHUNK, SparseMlaConfig, per_query_vmem_bytes, vmem_limit
from attn_pallas_tpu.plan import VMEM_USABLE_FRACTION
from attn_pallas_tpu.unit_ring import (
    StepWalk,
    Store,
    UnitRing,
    entry_positions,
    in_hbm,
    query_step_specs,
    ring_scratch,
)

# ------------------------------------------------------------------ the inverted selection


class InvertedSelection(NamedTuple):
    """The dKV kernel's tables (all int32).

    block:  ``[NC]`` the store block of each chunk (scalar-prefetched: the index maps
      read it; only this table scales with the cache); ``NC`` is the static bound
      ``ceil(N K / PAIR_CHUNK) + num_blocks``; chunks past the real ones point at the
      last block, with 0 pairs and both flags 0 (the kernel skips them).
    meta:   ``[NC, 1, 3]`` per chunk ``(pairs, first, last)``: its pair count and
      whether it is its block's first / last chunk.
    qid:    ``[NC, 1, PAIR_CHUNK]`` query of each pair (0 past ``pairs``).
    nvalid: ``[NC, 1, PAIR_CHUNK]`` valid rows of the block for that query: rows
      ``r < nvalid`` (0 past ``pairs``).
    """

    block: jax.Array
    meta: jax.Array
    qid: jax.Array
    nvalid: jax.Array


def invert_selection(
    unit_block, kb, count, lim, *, rb: int, num_blocks: int, chunk: int = PAIR_CHUNK
):
    """Token -> pairs: the compacted per-query tables ``unit_block, kb [N, K]`` (each
    unit's store block and first token position), ``count [N]`` (``compact_units``) and
    ``lim [N]`` turned into per-store-block runs of (query, valid rows) pairs, sorted by
    (block, query) and cut into chunks of ``chunk``.

    Unit ``j < count[n]`` of query ``n`` covers store block ``unit_block`` and its
    rows ``r`` with ``kb + r < lim[n]``, a prefix of ``nvalid = clip(lim - kb, 0, rb)``
    rows; pairs with ``nvalid == 0`` are dropped. Both sort keys together are unique
    (compacted selections are sets), so the order does not depend on sort stability."""
    n, k = unit_block.shape
    slot = jax.lax.broadcasted_iota(jnp.int32, (n, k), 1)
    query = jax.lax.broadcasted_iota(jnp.int32, (n, k), 0)
    nvalid = jnp.clip(lim[:, None] - kb, 0, rb)
    live = (slot < count[:, None]) & (nvalid > 0)
    block = jnp.where(live, unit_block, num_blocks)
    block, query, nvalid = jax.lax.sort((block.ravel(), query.ravel(), nvalid.ravel()), num_keys=2)
    starts = jnp.searchsorted(block, jnp.arange(num_blocks + 1, dtype=jnp.int32))
    pairs = (starts[1:] - starts[:-1]).astype(jnp.int32)  # [num_blocks]
    per_block = jnp.maximum(1, -(-pairs // chunk))
    chunk0 = jnp.cumsum(per_block) - per_block
    total = chunk0[-1] + per_block[-1]
    n_chunks = -(-(n * k) // chunk) + num_blocks
    c = jnp.arange(n_chunks, dtype=jnp.int32)
    blk = (jnp.searchsorted(chunk0, c, side="right") - 1).astype(jnp.int32)
    i = c - chunk0[blk]
    real = c < total
    cnt = jnp.where(real, jnp.clip(pairs[blk] - i * chunk, 0, chunk), 0)
    first = real & (i == 0)
    last = real & (i == per_block[blk] - 1)
    lane = jnp.arange(chunk, dtype=jnp.int32)
    used = lane < cnt[:, None]
    # Each chunk is a window of ``chunk`` consecutive sorted pairs: one windowed gather
    # per chunk (an index a chunk), not one a pair. Lanes past ``cnt`` are masked, so
    # where the window runs past the pairs (its start clamped) does not matter.
    start = starts[blk] + i * chunk

    def windows(x):
        x = jnp.pad(x, (0, chunk))
        return jax.vmap(lambda s: jax.lax.dynamic_slice(x, (s,), (chunk,)))(start)

    qid = jnp.where(used, windows(query), 0).reshape(n_chunks, 1, chunk)
    nval = jnp.where(used, windows(nvalid), 0).reshape(n_chunks, 1, chunk)
    meta = jnp.stack([cnt, first.astype(jnp.int32), last.astype(jnp.int32)], axis=-1)
    return InvertedSelection(blk, meta.reshape(n_chunks, 1, 3).astype(jnp.int32), qid, nval)


# --------------------------------------------------------------------------- dq kernel


def _dq_kernel(*refs, kind: str, sm_scale: float, dk: int, dv: int, rb: int, cfg, interpret):
    # SMEM: the QuerySteps tables (meta, steps, addr, kb); VMEM: q [QP,H,Dk_pad],
    # dO [QP,H,Dv], (lse, delta) [QP,H,2] f32; HBM: the store (one array);
    # out: dq [QP,H,Dk_pad] f32; scratch: the ring buffer, DMA semaphores [1, S].
    tables, (q_ref, do_ref, st_ref, hbm, dq_ref, buf, sems) = refs[:4], refs[4:]
    ring = UnitRing(kind, (hbm,), (buf,), sems, rb=rb, interpret=interpret)
    qp = q_ref.shape[0]
    walk = StepWalk(
        tables, ring, qp=qp, top_k=tables[2].shape[-1] // qp, group=cfg.units_per_step,
        slots=cfg.ring_slots,
    )  # fmt: skip
    dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)  # queries without units
    walk.prologue()
    gr = cfg.units_per_step * rb

    def body(t, dq):
        slot = walk.advance(t)
        i = walk.query(t)
        lim = walk.lim(i)
        # Rows this query may not see and a paged cache's feature padding may hold
        # NaN/Inf: they are exact zeros before any product.
        rows, kbs = walk.words(
            t, slot, rb=rb, dtype=q_ref.dtype, lim=lim, dk=dk if kind == "pages" else None
        )
        dq = jnp.where(walk.first_unit(t) == 0, 0.0, dq)
        st = st_ref[i]
        lse, delta = st[:, 0:1], st[:, 1:2]  # [H, 1]
        s = mxu_dot(q_ref[i], rows, (((1,), (1,)), ((), ())))  # [H, G RB]
        valid = entry_positions(kbs, rb=rb, shape=(1, gr), axis=1) < lim
        p = jnp.where(valid, jnp.exp(s * sm_scale - lse), 0.0)
        dp = mxu_dot(do_ref[i], rows[:, :dv], (((1,), (1,)), ((), ())))
        ds = p * (dp - delta)
        dq = dq + mxu_dot(ds.astype(rows.dtype), rows, (((1,), (0,)), ((), ())))

        @pl.when(walk.last(t))
        def _():
            dq_ref[i] = dq * sm_scale

        return dq

    jax.lax.fori_loop(0, walk.n_steps, body, jnp.zeros(q_ref.shape[1:], jnp.float32))


def _dq_call(q, do, stats, store: Store, tables, *, sm_scale, dk, dv, rb, cfg, interpret):
    n, heads, dk_pad = q.shape
    qp = cfg.queries_per_program
    kernel = functools.partial(
        _dq_kernel,
        kind=store.kind,
        sm_scale=sm_scale,
        dk=dk,
        dv=dv,
        rb=rb,
        cfg=cfg,
        interpret=bool(interpret),
    )
    need = per_query_vmem_bytes(
        cfg, heads=heads, read_block=rb, dk_pad=dk_pad, dv=dv, itemsize=q.dtype.itemsize,
        row_bytes=store.row_bytes, dequantize=False,
    ) + 2 * qp * heads * (dv * q.dtype.itemsize + 8 + 3 * dk_pad * 4)  # fmt: skip

    def per_program(width):
        return pl.BlockSpec((qp, heads, width), lambda p: (p, 0, 0))

    return pl.pallas_call(
        kernel,
        grid=(n // qp,),
        in_specs=[
            *query_step_specs(tables),
            per_program(dk_pad),
            per_program(dv),
            per_program(2),
            pl.BlockSpec(memory_space=pltpu.HBM),
        ],
        out_specs=per_program(dk_pad),
        out_shape=jax.ShapeDtypeStruct((n, heads, dk_pad), jnp.float32),
        scratch_shapes=ring_scratch(store, rb=rb, group=cfg.units_per_step, slots=cfg.ring_slots),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit(need, _physical())
        ),
        interpret=interpret,
    )(*tables, q, do, stats, *in_hbm(*store.arrays))


def _physical() -> int:
    return int(default_chip().vmem_bytes / VMEM_USABLE_FRACTION)


# -------------------------------------------------------------------------- dKV kernel


def _dkv_walk(count, qid_ref, nval_ref, kv, rings, sems, acc, *, sm_scale, dk, dv, qc, slots):  # fmt: skip
    """One chunk: ``count`` pairs in steps of ``qc``, each pair's query rows (``q``,
    ``dO``, ``(lse, delta)``) DMA'd into rows ``[c H, (c + 1) H)`` of a ring slot; returns
    the updated float32 sums ``(dK [RB, Dk_pad], dV [RB, Dv])`` (``dK`` without
    ``sm_scale``)."""
    (q_hbm, do_hbm, st_hbm), (q_ring, do_ring, st_ring) = rings
    rb, dk_pad = kv.shape
    heads = q_hbm.shape[1]
    feat = jax.lax.broadcasted_iota(jnp.int32, (1, dk_pad), 1)
    kv = jnp.where(feat < dk, kv, jnp.zeros_like(kv))  # the paged cache's padding: garbage
    v = kv[:, :dv]
    n_steps = jax.lax.div(count + qc - 1, jnp.int32(qc))  # lax.div: // lowers through sign()
    pair_row = jax.lax.broadcasted_iota(jnp.int32, (qc * heads, 1), 0)
    key_lane = jax.lax.broadcasted_iota(jnp.int32, (1, rb), 1)

    def copies(t, slot):
        out = []
        for c in range(qc):
            j = jnp.minimum(t * qc + c, count - 1)
            n = qid_ref[0, 0, j]
            for i, (src, ring) in enumerate(
                ((q_hbm, q_ring), (do_hbm, do_ring), (st_hbm, st_ring))
            ):
                dst = ring.at[jnp.int32(slot), pl.ds(c * heads, heads)]
                out.append(
                    (
                        t * qc + c < count,
                        pltpu.make_async_copy(
                            src.at[n], dst, sems.at[jnp.int32(i), jnp.int32(slot)]
                        ),
                    )
                )
        return out

    def dma(t, slot, start: bool):
        for live, cp in copies(t, slot):

            @pl.when(live)
            def _(cp=cp):
                cp.start() if start else cp.wait()

    for d in range(slots - 1):  # prologue: fill the rings

        @pl.when(d < n_steps)
        def _(d=d):
            dma(d, d, True)

    def body(t, carry):
        dk_acc, dv_acc = carry
        nxt = t + slots - 1

        @pl.when(nxt < n_steps)
        def _():
            dma(nxt, jax.lax.rem(nxt, jnp.int32(slots)), True)

        slot = jax.lax.rem(t, jnp.int32(slots))
        dma(t, slot, False)
        # Valid rows of the block are a prefix per pair; pairs past the count hold stale
        # ring rows, zeroed before any product.
        nval = jnp.zeros((qc * heads, 1), jnp.int32)
        for c in range(qc):
            j = t * qc + c
            n_c = jnp.where(j < count, nval_ref[0, 0, jnp.minimum(j, count - 1)], 0)
            nval = jnp.where(pair_row >= c * heads, n_c, nval)
        live = pair_row < (count - t * qc) * heads  # [QC H, 1]
        q = jnp.where(live, q_ring[slot], jnp.zeros_like(q_ring[slot]))  # [QC H, Dk_pad]
        do = jnp.where(live, do_ring[slot], jnp.zeros_like(do_ring[slot]))  # [QC H, Dv]
        st = st_ring[slot]  # [QC H, 2]
        valid = key_lane < nval  # [QC H, RB]
        s = mxu_dot(q, kv, (((1,), (1,)), ((), ())))  # [QC H, RB]
        # Invalid rows may hold NaN (their s and dp too): select, never multiply.
        p = jnp.where(valid, jnp.exp(s * sm_scale - st[:, 0:1]), 0.0)
        dp = mxu_dot(do, v, (((1,), (1,)), ((), ())))
        ds = jnp.where(valid, p * (dp - st[:, 1:2]), 0.0)
        dk_acc = dk_acc + mxu_dot(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())))
        dv_acc = dv_acc + mxu_dot(p.astype(do.dtype), do, (((0,), (0,)), ((), ())))
        return dk_acc, dv_acc

    return jax.lax.fori_loop(0, n_steps, body, acc)


def _dkv_kernel(
    block_ref,  # scalar prefetch SMEM [NC]: the store block of each chunk (index maps)
    meta_ref,  # SMEM [1, 1, 3]: (pairs, first, last) of this chunk
    qid_ref,  # SMEM [1, 1, PC]: query of each pair
    nval_ref,  # SMEM [1, 1, PC]: valid rows (a prefix) of the block for that query
    kv_ref,  # VMEM [1, RB, Dk_pad]: the chunk's store block
    q_hbm,  # HBM [N, H, Dk_pad]
    do_hbm,  # HBM [N, H, Dv]
    st_hbm,  # HBM [N, H, 2] float32: (lse, delta), lse 0 where -inf
    dkv_ref,  # VMEM [1, RB, Dk_pad] in the store dtype
    q_ring,  # VMEM [S, QC H, Dk_pad]
    do_ring,  # VMEM [S, QC H, Dv]
    st_ring,  # VMEM [S, QC H, 2] float32
    sems,  # DMA semaphores [3, S]
    acc_k,  # VMEM [RB, Dk_pad] float32: dK / sm_scale of the block, across its chunks
    acc_v,  # VMEM [RB, Dv] float32
    *,
    sm_scale: float,
    dk: int,
    dv: int,
    qc: int,
    slots: int,
):
    del block_ref  # read by the index maps only
    count = meta_ref[0, 0, 0]

    @pl.when(meta_ref[0, 0, 1] == 1)  # the block's first chunk
    def _():
        acc_k[...] = jnp.zeros_like(acc_k)
        acc_v[...] = jnp.zeros_like(acc_v)

    @pl.when(count > 0)
    def _():
        dk_acc, dv_acc = _dkv_walk(
            count, qid_ref, nval_ref, kv_ref[0],
            ((q_hbm, do_hbm, st_hbm), (q_ring, do_ring, st_ring)), sems,
            (acc_k[...], acc_v[...]), sm_scale=sm_scale, dk=dk, dv=dv, qc=qc, slots=slots,
        )  # fmt: skip
        acc_k[...] = dk_acc
        acc_v[...] = dv_acc

    @pl.when(meta_ref[0, 0, 2] == 1)  # the block's last chunk: write it once
    def _():
        dkv_ref[0, :, :dv] = (acc_k[:, :dv] * sm_scale + acc_v[...]).astype(dkv_ref.dtype)
        if dv < acc_k.shape[1]:
            dkv_ref[0, :, dv:] = (acc_k[:, dv:] * sm_scale).astype(dkv_ref.dtype)


def pairs_per_step(cfg, heads: int, dtype) -> int:
    """The dKV step's pairs: ``cfg.pairs_per_step`` when ``H`` fills whole sublane tiles
    of ``dtype`` (pairs' rows stack at tile boundaries), else 1."""
    tile = 8 * (4 // jnp.dtype(dtype).itemsize)
    return cfg.pairs_per_step if heads % tile == 0 else 1


def _dkv_call(inv: InvertedSelection, blocks, q, do, stats, *, sm_scale, dk, dv, cfg, interpret):
    _, rb, dk_pad = blocks.shape
    heads = q.shape[1]
    n_chunks, _, chunk = inv.qid.shape
    qc = pairs_per_step(cfg, heads, q.dtype)
    slots = cfg.ring_slots
    kernel = functools.partial(_dkv_kernel, sm_scale=sm_scale, dk=dk, dv=dv, qc=qc, slots=slots)
    itemsize = jnp.dtype(blocks.dtype).itemsize
    smem, hbm = pltpu.SMEM, pltpu.HBM

    def block_of(c, blocks):
        return (blocks[c], 0, 0)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(n_chunks,),
        in_specs=[
            pl.BlockSpec((1, 1, 3), lambda c, blocks: (c, 0, 0), memory_space=smem),
            pl.BlockSpec((1, 1, chunk), lambda c, blocks: (c, 0, 0), memory_space=smem),
            pl.BlockSpec((1, 1, chunk), lambda c, blocks: (c, 0, 0), memory_space=smem),
            pl.BlockSpec((1, rb, dk_pad), block_of),
            pl.BlockSpec(memory_space=hbm),
            pl.BlockSpec(memory_space=hbm),
            pl.BlockSpec(memory_space=hbm),
        ],
        out_specs=pl.BlockSpec((1, rb, dk_pad), block_of),
        scratch_shapes=[
            pltpu.VMEM((slots, qc * heads, dk_pad), q.dtype),
            pltpu.VMEM((slots, qc * heads, dv), do.dtype),
            pltpu.VMEM((slots, qc * heads, 2), jnp.float32),
            pltpu.SemaphoreType.DMA((3, slots)),
            pltpu.VMEM((rb, dk_pad), jnp.float32),
            pltpu.VMEM((rb, dv), jnp.float32),
        ],
    )
    need = (
        slots * qc * heads * ((dk_pad + dv) * itemsize + 2 * 4 * 64)
        + 4 * rb * dk_pad * itemsize
        + 2 * rb * (dk_pad + dv) * 4
        + 6 * rb * qc * heads * 4
        + 2 * qc * heads * (dk_pad + dv) * 4
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(blocks.shape, blocks.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit(need, _physical())
        ),
        interpret=interpret,
    )(inv.block, inv.meta, inv.qid, inv.nvalid, blocks, *in_hbm(q, do, stats))


# ----------------------------------------------------------------------------- wrapper


def softmax_stats(out, lse, d_out, d_lse):
    """``[B, S, H, 2]`` float32 per query and head: the forward's LSE (0 where ``-inf``:
    the query has no valid key, so its ``p`` is 0 throughout) and ``delta = rowsum(dO *
    O) - dlse``, what both backwards' kernels read beside ``q`` and ``dO``."""
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = delta - d_lse.astype(jnp.float32)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0).astype(jnp.float32)
    return jnp.stack([lse_safe, delta], axis=-1)


def per_query_backward(
    call: SparseMlaCall, out, lse, d_out, d_lse, *, interpret, config, space=None
):  # fmt: skip
    """``(dq, dkv)`` through the dq and dKV kernels, of a validated call (float32 or
    bfloat16 cache) from the forward's ``out [B, S, H, Dv]`` and ``lse [B, S, H]``
    (float32) and their cotangents. ``space``: the call's ``_prep.unit_space``, where the
    caller has it (the query-blocked backward's guard), so it is not lifted again."""
    problem = call.problem
    kv = call.kv
    if space is None:
        space = unit_space(problem, kv, call.indices, call.positions, **call.ragged_kwargs())
    batch, seq, heads, rb = problem.batch, problem.num_queries, problem.heads, problem.read_block
    dk, dv, width = problem.dk, problem.dv, space.store.width
    n = batch * seq
    cfg = config
    tables, n_pad = program_tables(space, rb, cfg, n)
    dtype = space.store.dtype
    q = pad_features(call.q.astype(dtype), width).reshape(n, heads, width)
    stats = softmax_stats(out, lse, d_out, d_lse).reshape(n, heads, 2)
    do = d_out.astype(jnp.float32).astype(dtype).reshape(n, heads, dv)
    kw = dict(sm_scale=problem.sm_scale, dk=dk, dv=dv, interpret=interpret, cfg=cfg)

    def pad(x):
        return jnp.pad(x, ((0, n_pad - n), (0, 0), (0, 0)))

    dq = _dq_call(pad(q), pad(do), pad(stats), space.store, tables, rb=rb, **kw)[:n]
    addr, kb, count = compact_units(space.addr, space.keys * rb, space.unit_ok)
    unit = 1 if space.store.kind == "pages" else rb
    num_blocks = space.store.num_blocks(rb)
    inv = invert_selection(
        addr.reshape(n, -1) // unit, kb.reshape(n, -1), count.reshape(n), space.lim.reshape(n),
        rb=rb, num_blocks=num_blocks, chunk=PAIR_CHUNK,
    )  # fmt: skip
    dstore = _dkv_call(inv, store_blocks(space.store, rb), q, do, stats, **kw)
    dq = dq[..., :dk].reshape(batch, seq, heads, dk).astype(call.q.dtype)
    if problem.ragged:
        return dq, dstore.reshape(kv.shape)
    tp = problem.num_units * rb
    return dq, dstore.reshape(batch, tp, width)[:, : problem.kv_len]


def kernel_covers(call: SparseMlaCall) -> bool:
    """Whether the backward kernels take this call's cache (a plain float32 / bfloat16
    array; else the XLA backward)."""
    kv = call.kv
    return not isinstance(kv, Fp8LatentCache) and jnp.dtype(kv.dtype) in KERNEL_DTYPES


def with_kernel_backward(forward, *, interpret, config: SparseMlaConfig, backward=None):
    """A kernel ``forward(call) -> (out, lse)`` made differentiable in ``call.q`` and
    ``call.kv`` (``attn_common.sparse_mla_xla.with_saved_backward``) from the residuals
    ``q``, the cache, the integer tables and the forward's ``out`` and ``lse``: through
    ``backward(call, out, lse, d_out, d_lse, interpret=, config=) -> (dq, dkv)``, by
    default :func:`per_query_backward` (the two kernels above)."""
    backward = backward or per_query_backward

    def vjp(call, out, lse, cotangents):
        return backward(call, out, lse, *cotangents, interpret=interpret, config=config)

    return with_saved_backward(forward, vjp)


def sparse_mla_result(
    call: SparseMlaCall, forward, *, interpret, config: SparseMlaConfig, backward=None
):
    """The op's result for a TPU forward kernel ``forward(call) -> (out, lse)``: the empty
    result for an empty problem; else the kernel's ``out`` and ``lse``, differentiable
    through the backward kernels (:func:`with_kernel_backward`, ``backward`` as there; a
    cache they do not take: the XLA backward, ``with_xla_backward``), plus the attention
    mass from the LSE."""
    if call.problem.is_empty:
        return empty_result(call.problem, call.return_lse, call.return_attn_mass)
    if kernel_covers(call):
        out, lse = with_kernel_backward(
            forward, interpret=interpret, config=config, backward=backward
        )(call)
    else:
        out, lse = with_xla_backward(forward)(call)
    mass = attn_mass_from_lse(call, lse) if call.return_attn_mass else None
    return call.result(out, lse, mass)


__all__ = [
    "PAIR_CHUNK",
    "invert_selection",
    "per_query_backward",
    "softmax_stats",
    "sparse_mla_result",
    "with_kernel_backward",
]
