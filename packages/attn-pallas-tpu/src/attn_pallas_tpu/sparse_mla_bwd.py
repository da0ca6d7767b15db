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
query (``parallel``), walking the query's compacted distinct units (``compact_units``, the
forward's tables) through the same ``NBUF``-deep VMEM DMA ring from the HBM row store.
Per unit: zero the rows the query may not see (``kb + r >= lim``: page tails, future
tokens; they may hold NaN) and the feature padding, ``s = q k^T [H, RB]``, ``p``, ``dp =
dO v^T``, ``ds``, ``dq += ds k``; ``dq * sm_scale`` is written once.

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
come in SMEM blocks; per pair the query's ``q [H, Dk_pad]``, ``dO [H, Dv]`` and ``(lse, delta) [2, H]``
are DMA'd from HBM through a ring like the forward's. Compute per pair is key-major (keys
on sublanes, heads on lanes: no transpose): ``s^T = k q^T [RB, H]``, the valid rows are a
prefix ``r < nvalid`` (causal and ``kv_len`` bounds cut a unit at one row),
``dK += ds^T q``, ``dV += p^T dO``.

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
    SUBLANE,
    compact_units,
    pad_features,
    query_table_specs,
    unit_space,
    vmem_limit,
)

NBUF = 4  # DMA ring depth (both kernels): NBUF - 1 copies in flight behind the compute
PAIR_CHUNK = 128  # (block, query) pairs per dKV program


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


def invert_selection(src8, kb, count, lim, *, rb: int, num_blocks: int, chunk: int = PAIR_CHUNK):
    """Token -> pairs: the compacted per-query tables ``src8, kb [N, K]``, ``count [N]``
    (``compact_units``) and ``lim [N]`` turned into per-store-block runs of (query,
    valid rows) pairs, sorted by (block, query) and cut into chunks of ``chunk``.

    Unit ``j < count[n]`` of query ``n`` covers store block ``src8 * 8 // rb`` and its
    rows ``r`` with ``kb + r < lim[n]``, a prefix of ``nvalid = clip(lim - kb, 0, rb)``
    rows; pairs with ``nvalid == 0`` are dropped. Both sort keys together are unique
    (compacted selections are sets), so the order does not depend on sort stability."""
    n, k = src8.shape
    slot = jax.lax.broadcasted_iota(jnp.int32, (n, k), 1)
    query = jax.lax.broadcasted_iota(jnp.int32, (n, k), 0)
    nvalid = jnp.clip(lim[:, None] - kb, 0, rb)
    live = (slot < count[:, None]) & (nvalid > 0)
    block = jnp.where(live, src8 * SUBLANE // rb, num_blocks)
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
    idx = jnp.clip(starts[blk][:, None] + i[:, None] * chunk + lane, 0, n * k - 1)
    used = lane < cnt[:, None]
    qid = jnp.where(used, query[idx], 0).reshape(n_chunks, 1, chunk)
    nval = jnp.where(used, nvalid[idx], 0).reshape(n_chunks, 1, chunk)
    meta = jnp.stack([cnt, first.astype(jnp.int32), last.astype(jnp.int32)], axis=-1)
    return InvertedSelection(blk, meta.reshape(n_chunks, 1, 3).astype(jnp.int32), qid, nval)


# --------------------------------------------------------------------------- dq kernel


def _dq_kernel(
    meta_ref,  # SMEM [1, 1, 2]: (count, lim)
    src_ref,  # SMEM [1, 1, K]: first store row // 8 of each unit (compacted)
    kb_ref,  # SMEM [1, 1, K]: global position of each unit's first token
    q_ref,  # VMEM [1, H, Dk_pad]
    do_ref,  # VMEM [1, H, Dv]
    stats_ref,  # VMEM [1, H, 2] float32: (lse, delta), lse 0 where -inf
    kv_hbm,  # HBM  [R, Dk_pad] row store
    dq_ref,  # VMEM [1, H, Dk_pad] float32
    ring,  # VMEM [NBUF, RB, Dk_pad] unit ring
    sems,  # DMA semaphores [NBUF]
    *,
    sm_scale: float,
    dk: int,
    dv: int,
    rb: int,
):
    count, lim = meta_ref[0, 0, 0], meta_ref[0, 0, 1]
    q, do, stats = q_ref[0], do_ref[0], stats_ref[0]
    lse, delta = stats[:, 0:1], stats[:, 1:2]  # [H, 1]
    dk_pad = q.shape[1]

    def copy(j, slot):
        start = pl.multiple_of(src_ref[0, 0, j] * SUBLANE, SUBLANE)
        slot = jnp.int32(slot)  # int32 indices, also for a Python int under jax_enable_x64
        return pltpu.make_async_copy(kv_hbm.at[pl.ds(start, rb)], ring.at[slot], sems.at[slot])

    for d in range(NBUF - 1):  # prologue: fill the ring

        @pl.when(d < count)
        def _(d=d):
            copy(d, d).start()

    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, rb), 1)
    key_rows = jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)
    feat = jax.lax.broadcasted_iota(jnp.int32, (1, dk_pad), 1)

    def body(j, dq):
        nxt = j + NBUF - 1

        @pl.when(nxt < count)
        def _():
            copy(nxt, jax.lax.rem(nxt, jnp.int32(NBUF))).start()

        slot = jax.lax.rem(j, jnp.int32(NBUF))
        copy(j, slot).wait()
        kb = kb_ref[0, 0, j]
        # Rows this query may not see and the feature padding may hold NaN/Inf: zero them
        # before any product (ds k and dO v^T would otherwise give 0 * NaN).
        seen = ((kb + key_rows) < lim) & (feat < dk)  # [RB, Dk_pad]
        kv = ring[slot]
        kv = jnp.where(seen, kv, jnp.zeros_like(kv))
        s = mxu_dot(q, kv, (((1,), (1,)), ((), ())))
        valid = (kb + lanes) < lim  # [1, RB]
        p = jnp.where(valid, jnp.exp(s * sm_scale - lse), 0.0)  # [H, RB]
        dp = mxu_dot(do, kv[:, :dv], (((1,), (1,)), ((), ())))
        ds = p * (dp - delta)
        return dq + mxu_dot(ds.astype(kv.dtype), kv, (((1,), (0,)), ((), ())))

    dq = jax.lax.fori_loop(0, count, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[0] = dq * sm_scale


def _dq_call(q, do, stats, store, src8, kb, count, lim, *, sm_scale, dk, dv, rb, interpret):
    n, heads, dk_pad = q.shape
    top_k = src8.shape[-1]
    meta = jnp.stack([count, lim], axis=-1).reshape(n, 1, 2)
    kernel = functools.partial(_dq_kernel, sm_scale=sm_scale, dk=dk, dv=dv, rb=rb)
    itemsize = jnp.dtype(store.dtype).itemsize
    return pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[
            *query_table_specs(top_k),
            pl.BlockSpec((1, heads, dk_pad), lambda i: (i, 0, 0)),
            pl.BlockSpec((1, heads, dv), lambda i: (i, 0, 0)),
            pl.BlockSpec((1, heads, 2), lambda i: (i, 0, 0)),
            pl.BlockSpec(memory_space=pltpu.HBM),
        ],
        out_specs=pl.BlockSpec((1, heads, dk_pad), lambda i: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((n, heads, dk_pad), jnp.float32),
        scratch_shapes=[
            pltpu.VMEM((NBUF, rb, dk_pad), store.dtype),
            pltpu.SemaphoreType.DMA((NBUF,)),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=vmem_limit(
                NBUF * rb * dk_pad * itemsize,
                2 * heads * (dk_pad + dv) * itemsize,
                3 * heads * dk_pad * 4,
                4 * heads * rb * 4,
            ),
        ),
        interpret=interpret,
    )(meta, src8.reshape(n, 1, top_k), kb.reshape(n, 1, top_k), q, do, stats, store)


# -------------------------------------------------------------------------- dKV kernel


def _dkv_walk(count, qid_ref, nval_ref, kv, q_hbm, do_hbm, st_hbm, rings, sems, acc, *, sm_scale, dk, dv):  # fmt: skip
    """One chunk: ``count`` pairs, each query's rows DMA'd through the rings; returns the
    updated float32 sums ``(dK [RB, Dk_pad], dV [RB, Dv])`` (``dK`` without ``sm_scale``)."""
    q_ring, do_ring, st_ring = rings
    rb, dk_pad = kv.shape
    feat = jax.lax.broadcasted_iota(jnp.int32, (1, dk_pad), 1)
    kv = jnp.where(feat < dk, kv, jnp.zeros_like(kv))  # the paged cache's padding: garbage
    v = kv[:, :dv]
    key_rows = jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)

    def copies(j, slot):
        n = qid_ref[0, 0, j]
        slot = jnp.int32(slot)  # int32 indices, also for a Python int under jax_enable_x64
        return tuple(
            pltpu.make_async_copy(src.at[n], ring.at[slot], sems.at[jnp.int32(i), slot])
            for i, (src, ring) in enumerate(((q_hbm, q_ring), (do_hbm, do_ring), (st_hbm, st_ring)))
        )

    for d in range(NBUF - 1):  # prologue: fill the rings

        @pl.when(d < count)
        def _(d=d):
            for cp in copies(d, d):
                cp.start()

    def body(j, carry):
        dk_acc, dv_acc = carry
        nxt = j + NBUF - 1

        @pl.when(nxt < count)
        def _():
            for cp in copies(nxt, jax.lax.rem(nxt, jnp.int32(NBUF))):
                cp.start()

        slot = jax.lax.rem(j, jnp.int32(NBUF))
        for cp in copies(j, slot):
            cp.wait()
        q, do, st = q_ring[slot], do_ring[slot], st_ring[slot]  # [H, Dk_pad] [H, Dv] [2, H]
        valid = key_rows < nval_ref[0, 0, j]  # [RB, 1]: the valid rows are a prefix
        s_t = mxu_dot(kv, q, (((1,), (1,)), ((), ())))  # [RB, H]
        # Invalid rows may hold NaN (their s and dp too): select, never multiply.
        p_t = jnp.where(valid, jnp.exp(s_t * sm_scale - st[0:1, :]), 0.0)
        dp_t = mxu_dot(v, do, (((1,), (1,)), ((), ())))
        ds_t = jnp.where(valid, p_t * (dp_t - st[1:2, :]), 0.0)
        dk_acc = dk_acc + mxu_dot(ds_t.astype(q.dtype), q, (((1,), (0,)), ((), ())))
        dv_acc = dv_acc + mxu_dot(p_t.astype(do.dtype), do, (((1,), (0,)), ((), ())))
        return dk_acc, dv_acc

    return jax.lax.fori_loop(0, count, body, acc)


def _dkv_kernel(
    block_ref,  # scalar prefetch SMEM [NC]: the store block of each chunk (index maps)
    meta_ref,  # SMEM [1, 1, 3]: (pairs, first, last) of this chunk
    qid_ref,  # SMEM [1, 1, PC]: query of each pair
    nval_ref,  # SMEM [1, 1, PC]: valid rows (a prefix) of the block for that query
    kv_ref,  # VMEM [1, RB, Dk_pad]: the chunk's store block
    q_hbm,  # HBM [N, H, Dk_pad]
    do_hbm,  # HBM [N, H, Dv]
    st_hbm,  # HBM [N, 2, H] float32: (lse, delta), lse 0 where -inf
    dkv_ref,  # VMEM [1, RB, Dk_pad] in the store dtype
    q_ring,  # VMEM [NBUF, H, Dk_pad]
    do_ring,  # VMEM [NBUF, H, Dv]
    st_ring,  # VMEM [NBUF, 2, H] float32
    sems,  # DMA semaphores [3, NBUF]
    acc_k,  # VMEM [RB, Dk_pad] float32: dK / sm_scale of the block, across its chunks
    acc_v,  # VMEM [RB, Dv] float32
    *,
    sm_scale: float,
    dk: int,
    dv: int,
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
            count, qid_ref, nval_ref, kv_ref[0], q_hbm, do_hbm, st_hbm,
            (q_ring, do_ring, st_ring), sems, (acc_k[...], acc_v[...]),
            sm_scale=sm_scale, dk=dk, dv=dv,
        )  # fmt: skip
        acc_k[...] = dk_acc
        acc_v[...] = dv_acc

    @pl.when(meta_ref[0, 0, 2] == 1)  # the block's last chunk: write it once
    def _():
        dkv_ref[0, :, :dv] = (acc_k[:, :dv] * sm_scale + acc_v[...]).astype(dkv_ref.dtype)
        if dv < acc_k.shape[1]:
            dkv_ref[0, :, dv:] = (acc_k[:, dv:] * sm_scale).astype(dkv_ref.dtype)


def _dkv_call(inv: InvertedSelection, store_blocks, q, do, stats_t, *, sm_scale, dk, dv, interpret):
    _, rb, dk_pad = store_blocks.shape
    heads = q.shape[1]
    n_chunks, _, chunk = inv.qid.shape
    kernel = functools.partial(_dkv_kernel, sm_scale=sm_scale, dk=dk, dv=dv)
    itemsize = jnp.dtype(store_blocks.dtype).itemsize
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
            pltpu.VMEM((NBUF, heads, dk_pad), q.dtype),
            pltpu.VMEM((NBUF, heads, dv), do.dtype),
            pltpu.VMEM((NBUF, 2, heads), jnp.float32),
            pltpu.SemaphoreType.DMA((3, NBUF)),
            pltpu.VMEM((rb, dk_pad), jnp.float32),
            pltpu.VMEM((rb, dv), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(store_blocks.shape, store_blocks.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=vmem_limit(
                NBUF * heads * (dk_pad + dv) * itemsize,
                4 * rb * dk_pad * itemsize,
                2 * rb * (dk_pad + dv) * 4,
                6 * rb * heads * 4,
            ),
        ),
        interpret=interpret,
    )(inv.block, inv.meta, inv.qid, inv.nvalid, store_blocks, q, do, stats_t)


# ----------------------------------------------------------------------------- wrapper


def _backward(call: SparseMlaCall, out, lse, d_out, d_lse, *, interpret):
    """``(dq, dkv)`` of a validated call (float32 or bfloat16 cache) from the forward's
    ``out [B, S, H, Dv]`` and ``lse [B, S, H]`` (float32) and their cotangents."""
    problem = call.problem
    kv = call.kv
    space = unit_space(problem, kv, call.indices, call.positions, **call.ragged_kwargs())
    batch, seq, heads, rb = problem.batch, problem.num_queries, problem.heads, problem.read_block
    dk, dv, dk_pad = problem.dk, problem.dv, problem.dk_pad
    n = batch * seq
    src8, kb, count = compact_units(space.src8, space.keys * rb, space.unit_ok)
    src8, kb, count, lim = (
        src8.reshape(n, -1),
        kb.reshape(n, -1),
        count.reshape(n),
        space.lim.reshape(n),
    )
    dtype = space.store.dtype
    q = pad_features(call.q.astype(dtype), dk_pad).reshape(n, heads, dk_pad)
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out.astype(jnp.float32), axis=-1) - d_lse.astype(jnp.float32)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0).astype(jnp.float32)  # -inf: no valid key
    stats = jnp.stack([lse_safe, delta], axis=-1).reshape(n, heads, 2)
    do = d_out.astype(dtype).reshape(n, heads, dv)
    kw = dict(sm_scale=problem.sm_scale, dk=dk, dv=dv, interpret=interpret)
    dq = _dq_call(q, do, stats, space.store, src8, kb, count, lim, rb=rb, **kw)
    num_blocks = space.store.shape[0] // rb
    inv = invert_selection(src8, kb, count, lim, rb=rb, num_blocks=num_blocks, chunk=PAIR_CHUNK)
    dstore = _dkv_call(
        inv, space.store.reshape(num_blocks, rb, dk_pad), q, do, jnp.swapaxes(stats, 1, 2), **kw
    )
    dq = dq[..., :dk].reshape(batch, seq, heads, dk).astype(call.q.dtype)
    if problem.ragged:
        return dq, dstore.reshape(kv.shape)
    tp = problem.num_units * rb
    return dq, dstore.reshape(batch, tp, dk_pad)[:, : problem.kv_len, :dk]


def kernel_covers(call: SparseMlaCall) -> bool:
    """Whether the backward kernels take this call's cache (a plain float32 / bfloat16
    array; else the XLA backward)."""
    kv = call.kv
    return not isinstance(kv, Fp8LatentCache) and jnp.dtype(kv.dtype) in KERNEL_DTYPES


def with_kernel_backward(forward, *, interpret):
    """A kernel ``forward(call) -> (out, lse)`` made differentiable in ``call.q`` and
    ``call.kv`` (``attn_common.sparse_mla_xla.with_saved_backward``) with the two kernels
    above as its backward, from the residuals ``q``, the cache, the integer tables and
    the forward's ``out`` and ``lse``."""

    def backward(call, out, lse, cotangents):
        return _backward(call, out, lse, *cotangents, interpret=interpret)

    return with_saved_backward(forward, backward)


def sparse_mla_result(call: SparseMlaCall, forward, *, interpret):
    """The op's result for a TPU forward kernel ``forward(call) -> (out, lse)``: the empty
    result for an empty problem; else the kernel's ``out`` and ``lse``, differentiable
    through the backward kernels (:func:`with_kernel_backward`; a cache they do not take:
    the XLA backward, ``with_xla_backward``), plus the attention mass from the LSE."""
    if call.problem.is_empty:
        return empty_result(call.problem, call.return_lse, call.return_attn_mass)
    if kernel_covers(call):
        out, lse = with_kernel_backward(forward, interpret=interpret)(call)
    else:
        out, lse = with_xla_backward(forward)(call)
    mass = attn_mass_from_lse(call, lse) if call.return_attn_mass else None
    return call.result(out, lse, mass)


# -------------------------------------------------------------------------- cost model


def backward_cost(chip, *, queries, heads, units, read_block, cache_rows, dk_pad, dv, itemsize=2):
    """Counted bytes, FLOPs and DMAs of the two kernels for ``queries`` queries that each
    attend ``units`` whole units of ``read_block`` rows (every pair valid: the end of a
    prefill), over a cache of ``cache_rows`` rows, and the time ``attn_pallas_tpu.plan``'s
    assumptions give on ``chip`` (a ``plan.TpuChip``): per unit / pair the slowest of its
    MXU work (at ``rows / mxu_dim`` efficiency: ``H`` rows for dq, ``read_block`` for the
    key-major dKV), its transfer at HBM bandwidth and the ring's issue rate
    (``DMA_LATENCY_S / (NBUF - 1)``, the three copies of a pair counted as one), spread
    over the TensorCores (dq; dKV runs on one: its grid is sequential), floored by all
    bytes at HBM bandwidth. Returns ``{"dq": {...}, "dkv": {...}}`` with ``bytes``,
    ``kv_bytes`` (the key-row or query-row traffic of the walk), ``flops``, ``dmas``,
    ``seconds``."""
    from attn_pallas_tpu.plan import DMA_LATENCY_S, STEP_OVERHEAD_S

    h, rb, n = heads, read_block, queries
    pairs = n * units
    issue = DMA_LATENCY_S / (NBUF - 1)
    core_flops = chip.mxu_flops / chip.cores

    def unit_time(flops, rows, nbytes):
        mxu = flops / (core_flops * min(1.0, rows / chip.mxu_dim))
        return max(mxu, nbytes / chip.hbm_bytes_per_s, issue)

    # dq: per query its units' rows; q, dO, (lse, delta) in, dq (float32) out.
    dq_walk = pairs * rb * dk_pad * itemsize
    dq_rows = n * h * (dk_pad * itemsize + dv * itemsize + 2 * 4 + dk_pad * 4)
    dq_unit_flops = 2 * rb * h * (2 * dk_pad + dv)
    per_query = (
        STEP_OVERHEAD_S
        + DMA_LATENCY_S
        + units * unit_time(dq_unit_flops, h, rb * dk_pad * itemsize)
    )
    dq_bytes = dq_walk + dq_rows
    dq_s = max(n * per_query / chip.cores, dq_bytes / chip.hbm_bytes_per_s)
    # dKV: per pair the query's q, dO, (lse, delta); each store block read and written once.
    pair_bytes = h * (dk_pad * itemsize + dv * itemsize + 2 * 4)
    dkv_walk = pairs * pair_bytes
    dkv_rows = 2 * cache_rows * dk_pad * itemsize
    dkv_pair_flops = 2 * rb * h * 2 * (dk_pad + dv)
    chunks = -(-pairs // PAIR_CHUNK) + cache_rows // rb
    dkv_chain = chunks * (STEP_OVERHEAD_S + DMA_LATENCY_S) + pairs * unit_time(
        dkv_pair_flops, rb, pair_bytes
    )
    dkv_bytes = dkv_walk + dkv_rows
    dkv_s = max(dkv_chain, dkv_bytes / chip.hbm_bytes_per_s)
    return {
        "dq": dict(bytes=dq_bytes, kv_bytes=dq_walk, flops=n * units * dq_unit_flops,
                   dmas=pairs, seconds=dq_s),
        "dkv": dict(bytes=dkv_bytes, kv_bytes=dkv_walk, flops=pairs * dkv_pair_flops,
                    dmas=3 * pairs, seconds=dkv_s),
    }  # fmt: skip


__all__ = [
    "PAIR_CHUNK",
    "backward_cost",
    "invert_selection",
    "sparse_mla_result",
    "with_kernel_backward",
]
