"""Preprocessing shared by the sparse-MLA kernels: validation, the KV row store, unit keys.

Everything here is plain ``jnp`` that runs outside the kernels. The kernels see the KV
cache as a store in HBM (``unit_ring.Store``): row arrays ``[R, Dk]`` (the flat
cache, float32 or bfloat16; an ``Fp8LatentCache`` as ``(latent [R, 512], side [R,
128])``, dequantized in VMEM: ``attn_pallas_tpu.fp8_rows``), or the paged cache in its
own layout ``[P, PS / pk, pk, Dk_pad]``, read in place. They address a unit by

* its **key**: an opaque int32 id whose tokens sit at global positions
  ``key * read_block + r`` (flat: the unit id; ragged: the global page-table slot, so the
  request-local position of token ``r`` is ``key * page_size + r - base_page * page_size``);
* its **address**: its first row in a row store (a multiple of ``read_block``, which the
  kernels declare to Mosaic so that the dynamic sublane offset lowers), or its physical
  page in a paged store.

A key token at global position ``kpg`` is valid for a query iff the query selected the
unit and ``kpg < lim``, where ``lim = base_tok + max(min(position, kv_len - 1) + 1, 0)``
folds the causal bound and the kv length into one int32 per query.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common import SparseMlaProblem
from attn_common.fp8_cache import Fp8LatentCache
from attn_common.paged import copy_pages, named_pages
from attn_common.sparse_mla import lift_ragged_indices, ragged_query_info
from attn_common.spec import SparseMlaCall, require_kernel
from attn_common.tables import (
    build_block_unit_tables,
    sanitize_unit_ids,
    sort_block_selections,
    union_counts,
)
from attn_pallas_tpu.config import MEMBER_TILE, SparseMlaConfig, member_word_rows
from attn_pallas_tpu.fp8_rows import ROW_BYTES, dequantize_rows, side_rows
from attn_pallas_tpu.plan import TpuChip, chip_for_device_kind
from attn_pallas_tpu.unit_ring import Store, query_steps

SUBLANE = 8
ROW_MULTIPLE = 16  # read_block rule of the TPU kernels: bf16 sublane packing (16, 128)
# read_block rule of the compiled kernels over an FP8 cache: an 8-bit array's tile is
# (32, 128), and at read_block 16 (half a tile per unit) both kernels gave wrong results
# on a TPU v5e (docs/tpu_sparse_mla.md); interpret mode, which has no tiles, takes 16.
FP8_ROW_MULTIPLE = 32
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_SENTINEL = jnp.iinfo(jnp.int32).max


def resolve_interpret(interpret) -> pltpu.InterpretParams | bool:
    """``False`` -> compile for TPU; ``True`` -> default TPU interpret mode; params as given."""
    if interpret is True:
        return pltpu.InterpretParams()
    if interpret is False or interpret is None:
        return False
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise TypeError(
        f"interpret: got {interpret!r}, expected a bool or a pltpu.InterpretParams instance"
    )


def default_chip() -> TpuChip:
    """The chip the automatic tiling plans for: the default device's TPU generation, or
    the most conservative chip off TPU (interpret mode, cross-lowering)."""
    device = jax.devices()[0]
    return chip_for_device_kind(device.device_kind if device.platform == "tpu" else None)


def require_tpu_kernels(call: SparseMlaCall) -> SparseMlaProblem:
    """The TPU kernels' limits on a validated call: a float32 or bfloat16 cache (the
    query takes its dtype) or an ``Fp8LatentCache`` (the query in bfloat16), and
    ``read_block % 16 == 0``; returns the problem."""
    problem = call.problem
    if not isinstance(call.kv, Fp8LatentCache):
        require_kernel(
            "kv", jnp.dtype(call.kv.dtype).name, [d.name for d in KERNEL_DTYPES],
            what="dtype", kernels="TPU sparse-MLA",
        )  # fmt: skip
    if problem.read_block % ROW_MULTIPLE:
        raise NotImplementedError(
            f"read_block: got {problem.read_block}, the TPU kernels need a multiple of "
            f"{ROW_MULTIPLE} (one unit is DMA'd as whole bf16 sublane tiles); "
            "attn_reference takes any"
        )
    reason = fp8_unit_reason(call.kv, problem.read_block, call.interpret)
    if reason is not None:
        raise NotImplementedError(reason)
    return problem


def fp8_unit_reason(kv, unit: int, interpret) -> str | None:
    """Why the compiled kernels refuse an FP8 cache with units of ``unit`` rows
    (``None``: they take it): units must be whole 8-bit tiles of ``FP8_ROW_MULTIPLE``
    rows. Interpret mode takes any multiple of ``ROW_MULTIPLE``."""
    if not isinstance(kv, Fp8LatentCache) or interpret or unit % FP8_ROW_MULTIPLE == 0:
        return None
    return (
        f"read_block: got {unit} (the page size in ragged mode) with an Fp8LatentCache; "
        f"the compiled TPU kernels need a multiple of {FP8_ROW_MULTIPLE} for an FP8 cache "
        "(a unit of 16 FP8 rows is half an 8-bit tile, and read_block 16 gave wrong results "
        "on a TPU v5e); attn_reference takes any"
    )


# An FP8 cache's rows cost the per-query kernel 2.6-5.4 ns more per gathered row than
# bf16 rows on a TPU v5e (de747ae: 35.6 / 21.4 against 24.2 / 15.9 ms for 2.1M rows at
# 32- / 64-token units; the query-blocked kernel about the same for both). A bf16 copy
# moves 768 + 1,280 bytes a copied row, 2.5 ns at 819 GB/s (from the bytes; not timed).
# So the copy is taken where it is at most a quarter of the rows gathered.
COPY_ROW_COST = 4


def fp8_copy(problem: SparseMlaProblem, kv, ragged: dict, fp8_dequantize):
    """``(kv, ragged)`` for the kernels: an FP8 cache as it is (dequantized in VMEM), or
    its bf16 rows ``fp8_rows.dequantize_rows`` (the kernels' own rows: the same result
    bits) copied by XLA first, where ``fp8_dequantize`` says (``None``: when ``copied
    rows * COPY_ROW_COST <= gathered rows``; ragged, the copy holds the pages the table
    names where ``attn_common.paged.copy_pages`` says). Any other cache as it is."""
    if not isinstance(kv, Fp8LatentCache):
        return kv, ragged
    rows, named = copy_pages(kv, ragged["page_indices"])
    if fp8_dequantize is None:
        gathered = problem.batch * problem.num_queries * problem.top_k * problem.read_block
        fp8_dequantize = rows * COPY_ROW_COST <= gathered
    if not fp8_dequantize:
        return kv, ragged
    if named:
        kv, table = named_pages(kv, ragged["page_indices"])
        ragged = {**ragged, "page_indices": table}
    grid = kv.shape
    flat = kv.reshape(-1)
    copy = dequantize_rows(flat.latent, side_rows(flat)).reshape(*grid, -1)
    # Flat rows go in Dk wide (unit_space pads them back with zeros); paged ones padded.
    return (copy if problem.ragged else copy[..., : problem.dk]), ragged


def row_bytes(kv, dk_pad: int) -> int:
    """HBM bytes the kernels DMA per token of ``kv``: ``Dk_pad * itemsize``, or 768 for
    an ``Fp8LatentCache`` (512 latent bytes and a 128-lane bf16 side row)."""
    if isinstance(kv, Fp8LatentCache):
        return ROW_BYTES
    return dk_pad * jnp.dtype(kv.dtype).itemsize


def query_dtype(kv) -> jnp.dtype:
    """The dtype of the query and of the rows on the MXU: the cache's, bf16 for FP8."""
    return jnp.dtype(jnp.bfloat16 if isinstance(kv, Fp8LatentCache) else kv.dtype)


def _row_arrays(kv, rows: int) -> tuple:
    """The row arrays of ``kv`` on ``rows`` token rows: ``kv [.., Dk]`` reshaped, or
    an ``Fp8LatentCache``'s ``(latent [R, 512], side [R, 128])`` (``fp8_rows``)."""
    if isinstance(kv, Fp8LatentCache):
        return kv.latent.reshape(rows, -1), side_rows(kv).reshape(rows, -1)
    return (kv.reshape(rows, kv.shape[-1]),)


class UnitSpace(NamedTuple):
    """Where the selected units live, for every query (all int32).

    store:     the :class:`~attn_pallas_tpu.unit_ring.Store` the kernels DMA from (HBM).
    keys:      ``[B, S, K]`` unit keys, ``-1`` = no selection (sanitized / lifted).
    addr:      ``[B, S, K]`` each selected unit's address in the store: its first row
               (a "rows" store) or its page (a "pages" store); 0 where none.
    unit_ok:   ``[B, S, K]`` bool, the unit exists (ragged: its physical page is valid).
    base_tok:  ``[B, S]`` the query's global position offset (ragged: base page * PS).
    lim:       ``[B, S]`` global key positions ``< lim`` are causal and inside kv_len.
    """

    store: Store
    keys: jax.Array
    addr: jax.Array
    unit_ok: jax.Array
    base_tok: jax.Array
    lim: jax.Array


def _limit(positions, kv_len):
    pos = positions.astype(jnp.int32)
    return jnp.maximum(jnp.minimum(pos, kv_len - 1) + 1, 0)


def unit_source(
    keys,
    *,
    flat_rows_per_batch=None,
    read_block=None,
    page_indices=None,
    rows_per_page=None,
    num_pages=None,
):
    """``(addr, ok)`` of unit keys ``[B, ...]``: the unit's store address, and whether it
    exists.

    Flat (``flat_rows_per_batch`` given): key ``u`` of batch row ``b`` starts at store row
    ``b * Tp + u * read_block``. Ragged: global page-table slot ``g`` is physical page
    ``page_indices[g]``, at row ``page * rows_per_page`` of a "rows" store, or page
    ``page`` itself of a "pages" store (``rows_per_page=None``); a physical page outside
    ``[0, num_pages)`` is not read.
    """
    ok = keys >= 0
    if flat_rows_per_batch is not None:
        b = jax.lax.broadcasted_iota(jnp.int32, keys.shape, 0)
        row0 = b * flat_rows_per_batch + jnp.maximum(keys, 0) * read_block
        return jnp.where(ok, row0, 0), ok
    phys = jnp.asarray(page_indices, jnp.int32)[jnp.maximum(keys, 0)]
    ok = ok & (phys >= 0) & (phys < num_pages)
    scale = 1 if rows_per_page is None else rows_per_page
    return jnp.where(ok, phys * scale, 0), ok


def paged_store(kv, page_size: int) -> Store:
    """The store of a paged cache: its own 4-D array read in place ("pages"), or row
    arrays for an FP8 cache and a bf16 copy on the token grid ``[P, PS, Dk_pad]``."""
    if isinstance(kv, Fp8LatentCache) or kv.ndim == 3:
        return Store("rows", _row_arrays(kv, kv.shape[0] * page_size))
    return Store("pages", (kv,))


def unit_space(
    problem: SparseMlaProblem,
    kv,
    indices,
    positions,
    *,
    page_size,
    q_seq_id,
    seq_lens,
    cu_kv_lens,
    page_indices,
) -> UnitSpace:
    """Build the row store and per-query unit keys/addresses for flat or ragged mode."""
    batch, seq = problem.batch, problem.num_queries
    rb = problem.read_block
    if not problem.ragged:
        # Flat: the cache's rows as they are (``Dk`` features: an HBM row is lane-padded
        # by its tiled layout already, and Mosaic masks a contraction's lane padding), the
        # tokens padded to whole units, the batch merged into the row axis: only a
        # reshape unless ``T`` is not a multiple of ``read_block`` (then one XLA copy of
        # the cache per call). A padded copy would also be an XLA temporary that XLA may
        # place in VMEM, where the kernels' DMAs from it ran 1.7x slower on a v5e.
        t = problem.kv_len
        tp = problem.num_units * rb
        if tp != t:
            kv = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, tp - t), (0, 0))), kv)
        store = Store("rows", _row_arrays(kv, batch * tp))
        keys = sanitize_unit_ids(indices, problem.num_units)
        addr, unit_ok = unit_source(keys, flat_rows_per_batch=tp, read_block=rb)
        base_tok = jnp.zeros((batch, seq), jnp.int32)
        lim = _limit(positions, jnp.int32(t))
        return UnitSpace(store, keys, addr, unit_ok, base_tok, lim)

    num_pages = kv.shape[0]
    store = paged_store(kv, page_size)
    info = ragged_query_info(q_seq_id, seq_lens, cu_kv_lens, page_size=page_size)
    keys = lift_ragged_indices(indices[0], info, problem.num_units)[None]  # [1, S, K]
    addr, unit_ok = unit_source(
        keys,
        page_indices=page_indices,
        rows_per_page=page_size if store.kind == "rows" else None,
        num_pages=num_pages,
    )
    base_tok = info.base_page * page_size
    lim = base_tok + _limit(positions[0], info.kv_len)
    return UnitSpace(store, keys, addr, unit_ok, base_tok[None], lim[None])


def host_unit_keys(
    problem: SparseMlaProblem,
    kv,
    indices,
    *,
    page_size,
    q_seq_id,
    seq_lens,
    cu_kv_lens,
    page_indices,
) -> np.ndarray:
    """:func:`unit_space`'s readable keys, ``where(unit_ok, keys, -1)`` int32 ``[B, S,
    K]``, computed in numpy from host values (device arrays are copied to the host).

    Flat: ids outside ``[0, num_units)`` are ``-1``. Ragged: request-local pages lifted to
    global page-table slots (``attn_common.sparse_mla.lift_ragged_indices``), ``-1`` where
    the page is outside the request's extent or the page table, or its physical page is
    outside ``[0, num_pages)``. Ids are cast to int32 first, as the jnp path does.
    """
    idx = np.asarray(indices).astype(np.int32, copy=False)
    if not problem.ragged:
        if idx.min(initial=-1) >= -1 and idx.max(initial=-1) < problem.num_units:
            return idx  # already -1 or in range (the caller's array, not copied)
        return np.where((idx >= 0) & (idx < problem.num_units), idx, np.int32(-1))
    n_seq = np.shape(seq_lens)[0]
    sid = np.clip(np.asarray(q_seq_id).astype(np.int32, copy=False), 0, n_seq - 1)
    cu = np.asarray(cu_kv_lens).astype(np.int32, copy=False)
    base = cu[sid] // page_size
    pages = np.maximum(cu[sid + 1] // page_size - base, 0)
    local = idx[0]
    key = local + base[:, None]
    lifted = (local >= 0) & (local < pages[:, None]) & (key < problem.num_units)
    key = np.where(lifted, key, np.int32(-1))
    table = np.asarray(page_indices).astype(np.int32, copy=False)
    if not table.size:
        return np.full((1, *key.shape), -1, np.int32)
    phys = table[np.maximum(key, 0)]
    ok = (key >= 0) & (phys >= 0) & (phys < kv.shape[0])
    return np.where(ok, key, np.int32(-1))[None]


def store_blocks(store: Store, rb: int) -> jax.Array:
    """A single-array store as ``[units, RB, Dk_pad]`` blocks (the dKV kernel's view; a
    "pages" store is relaid out, a pool-sized copy, as its gradient is pool-sized)."""
    (a,) = store.arrays
    return a.reshape(store.num_blocks(rb), rb, a.shape[-1])


def pad_features(q, dk_pad: int):
    """Zero-pad the last axis of ``q`` to ``dk_pad`` (zeros meet the store's zero pad)."""
    return jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, dk_pad - q.shape[-1])])


def compact_units(addr, kb, ok):
    """Per query: distinct units (by store address) first, ascending; returns count too.

    Duplicates (same address) are kept once, so selections are sets; the forward
    and the backward kernels walk the same compacted lists."""
    key = jnp.where(ok, addr, _SENTINEL)
    key, kb = jax.lax.sort((key, kb), dimension=-1, num_keys=1)
    dup = jnp.concatenate(
        [jnp.zeros_like(key[..., :1], bool), key[..., 1:] == key[..., :-1]], axis=-1
    )
    key = jnp.where(dup, _SENTINEL, key)
    key, kb = jax.lax.sort((key, kb), dimension=-1, num_keys=1)
    live = key != _SENTINEL
    count = live.sum(axis=-1).astype(jnp.int32)
    return jnp.where(live, key, 0), jnp.where(live, kb, 0), count


def program_tables(space: UnitSpace, rb: int, cfg: SparseMlaConfig, n: int):
    """The compacted per-query lists of a :class:`~_prep.UnitSpace`, padded to whole
    programs, as :class:`QuerySteps` tables; also the padded ``N``."""
    addr, kb, count = compact_units(space.addr, space.keys * rb, space.unit_ok)
    qp = cfg.queries_per_program
    n_pad = -(-n // qp) * qp
    pad = n_pad - n

    def flat(x):
        x = x.reshape(n, *x.shape[2:])
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))

    tables = query_steps(
        flat(addr),
        flat(kb),
        flat(count),
        flat(space.lim),
        qp=qp,
        group=cfg.units_per_step,
        rb=rb,
    )
    return tables, n_pad


# ------------------------------------------------------------ query-blocked kernels' tables


class UnionTables(NamedTuple):
    """The query-blocked kernels' tables: per block of ``QB`` queries its sorted union of
    units in ``C`` chunks of ``UC`` slots (all int32 but ``member``).

    kb:     ``[B, nQB * C, 1, UC]`` first token position of each slot (an SMEM block per
            (block, chunk): Mosaic wants the last two block dims equal to the array's).
    addr:   ``[B, nQB * C, 1, UC]`` the slot's store address (``unit_source``).
    unions: ``[B * nQB]`` true union sizes (scalar-prefetched).
    lim:    ``[B, nQB, 1, QB]`` per query: key positions ``< lim`` are valid (0 past the
            queries).
    member: ``[B, nQB, C * W, QB]`` int32 membership words, ``W = member_word_rows(UC)``
            a chunk: bit ``j % 32`` of row ``j // 32`` of a chunk's ``W`` is set iff query
            ``q`` selected the chunk's slot ``j``'s unit (0 where the unit's physical page
            is invalid; rows past ``UC / 32`` are 0).
    """

    kb: jax.Array
    addr: jax.Array
    unions: jax.Array
    lim: jax.Array
    member: jax.Array


def sorted_picks(space: UnitSpace, *, query_block: int):
    """Per batch row, each query block's picks sorted
    (``attn_common.tables.sort_block_selections``, ``[B, nQB, QB * K]`` twice) and the
    blocks' union sizes ``[B, nQB]``: one sort that both a jitted call's guard and
    :func:`union_tables` use."""
    picks = jax.vmap(lambda keys: sort_block_selections(keys, query_block=query_block))(space.keys)
    return picks, union_counts(picks[0])


def union_tables(
    problem: SparseMlaProblem, space: UnitSpace, *, query_block: int, u_chunk: int,
    n_chunks: int, page_indices, picks=None,
) -> UnionTables:  # fmt: skip
    """:class:`UnionTables` of ``space`` at width ``n_chunks * u_chunk`` (a union wider than
    that is cut; ``unions`` stays its true size, for the caller to check). ``picks``:
    :func:`sorted_picks`'s first value, where the caller has it."""
    batch, seq, rb = problem.batch, problem.num_queries, problem.read_block
    width = n_chunks * u_chunk
    if picks is None:
        picks = sorted_picks(space, query_block=query_block)[0]
    tables = jax.vmap(
        lambda keys, svals, place: build_block_unit_tables(
            keys, query_block=query_block, u_max=width, presorted=(svals, place)
        )
    )(space.keys, *picks)
    n_blocks = tables.units.shape[1]
    store = space.store
    if problem.ragged:
        addr, ok = unit_source(
            tables.units,
            page_indices=page_indices,
            rows_per_page=rb if store.kind == "rows" else None,
            num_pages=store.arrays[0].shape[0] // (rb if store.kind == "rows" else 1),
        )
    else:
        addr, ok = unit_source(
            tables.units, flat_rows_per_batch=problem.num_units * rb, read_block=rb
        )
    member = _chunk_words(tables.words, ok, n_chunks=n_chunks, u_chunk=u_chunk)
    kb = (jnp.maximum(tables.units, 0) * rb).reshape(batch, n_blocks * n_chunks, 1, u_chunk)
    lim = jnp.pad(space.lim, ((0, 0), (0, n_blocks * query_block - seq)))  # padded: lim 0
    return UnionTables(
        kb=kb,
        addr=addr.reshape(batch, n_blocks * n_chunks, 1, u_chunk),
        unions=tables.counts.reshape(batch * n_blocks),
        lim=lim.reshape(batch, n_blocks, 1, query_block),
        member=member,
    )


def _chunk_words(words, ok, *, n_chunks: int, u_chunk: int):
    """The kernels' membership words ``[B, nQB, C * W, QB]`` int32 from the tables'
    ``[B, nQB, QB, C * UC / 32]`` uint32 words and the slots' page validity ``ok [B,
    nQB, C * UC]`` (packed the same way and ANDed in)."""
    batch, n_blocks, query_block, n_words = words.shape
    shift = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, 1, MEMBER_TILE), 3)
    ok_bits = ok.reshape(batch, n_blocks, n_words, MEMBER_TILE).astype(jnp.uint32) << shift
    ok_words = jax.lax.reduce(ok_bits, jnp.uint32(0), jax.lax.bitwise_or, (3,))
    words = (words & ok_words[:, :, None, :]).reshape(
        batch, n_blocks, query_block, n_chunks, u_chunk // MEMBER_TILE
    )
    pad = member_word_rows(u_chunk) - u_chunk // MEMBER_TILE
    words = jnp.pad(words, ((0, 0),) * 4 + ((0, pad),))
    words = words.transpose(0, 1, 3, 4, 2)  # [B, nQB, C, W, QB]
    words = jax.lax.bitcast_convert_type(words, jnp.int32)
    return words.reshape(batch, n_blocks, n_chunks * member_word_rows(u_chunk), query_block)


class UnionStatic(NamedTuple):
    """What the query-blocked kernels (the forward and the backward's block kernel) are
    built for, beyond their grid: the store's kind, the softmax scale, ``Dk`` / ``Dv``, the
    read block ``RB``, the heads a program holds, the config and the interpret mode (a
    static argument of their jitted calls)."""

    kind: str  # Store.kind
    sm_scale: float
    dk: int
    dv: int
    rb: int
    heads_per_group: int
    cfg: SparseMlaConfig
    interpret: object  # resolve_interpret's value

    @property
    def page_dk(self) -> int | None:
        """``Dk`` where the store's pages carry padding past it (``"pages"``), else ``None``."""
        return self.dk if self.kind == "pages" else None


class UnionGrid(NamedTuple):
    """The query-blocked kernels' grid ``(B, nQB, G, C)`` (batch row, query block, head
    group, union chunk) over :class:`UnionTables`, with the unions scalar-prefetched: its
    index maps, and the block specs of the four tables."""

    n_blocks: int
    n_chunks: int
    u_chunk: int

    def chunk(self, b, n, c, unions_ref):
        """Chunk ``c``, or the block's last real chunk past its union: the pipeline sees
        the same block index and fetches nothing, and the kernel skips the step. (lax.div,
        not //: the union is >= 0, and jnp's floor division lowers through sign(), which
        asks for the TPU generation, absent when cross-lowering.)"""
        union = unions_ref[b * self.n_blocks + n]
        u = self.u_chunk
        last = jnp.maximum(jax.lax.div(union + u - 1, jnp.int32(u)) - 1, 0)
        return jnp.minimum(c, last)

    def per_chunk(self, b, n, g, c, unions_ref):  # membership [B, nQB, C * W, QB]
        return b, n, self.chunk(b, n, c, unions_ref), 0

    def per_chunk_smem(self, b, n, g, c, unions_ref):  # unit tables [B, nQB * C, 1, UC]
        return b, n * self.n_chunks + self.chunk(b, n, c, unions_ref), 0, 0

    def per_block(self, b, n, g, c, unions_ref):
        return b, n, 0, 0

    def per_group(self, b, n, g, c, unions_ref):  # [B, nQB, G, ...] blocks of a program
        return b, n, g, 0, 0

    def per_group_chunk(self, b, n, g, c, unions_ref):  # [B, nQB, G, C * X, ...]
        return b, n, g, self.chunk(b, n, c, unions_ref), 0

    def table_specs(self, query_block: int) -> list:
        """Specs of ``kb``, ``addr`` (SMEM), ``lim`` and ``member``, in that order."""
        smem, u = pltpu.SMEM, self.u_chunk
        return [
            pl.BlockSpec((1, 1, 1, u), self.per_chunk_smem, memory_space=smem),
            pl.BlockSpec((1, 1, 1, u), self.per_chunk_smem, memory_space=smem),
            pl.BlockSpec((1, 1, 1, query_block), self.per_block),
            pl.BlockSpec((1, 1, member_word_rows(u), query_block), self.per_chunk),
        ]


def to_blocks(x, query_block: int, head_block: int):
    """``[B, S, H, D] -> [B, nQB, G, Hb * QB, D]``: the query-blocked programs' rows ``h *
    QB + q`` for the ``Hb`` heads of each head group (queries padded with zeros)."""
    batch, seq, heads, d = x.shape
    n_blocks = -(-seq // query_block)
    groups = heads // head_block
    x = jnp.pad(x, ((0, 0), (0, n_blocks * query_block - seq), (0, 0), (0, 0)))
    x = x.reshape(batch, n_blocks, query_block, groups, head_block, d)
    x = x.transpose(0, 1, 3, 4, 2, 5)
    return x.reshape(batch, n_blocks, groups, head_block * query_block, d)


def from_blocks(x, seq: int, query_block: int):
    """The inverse of :func:`to_blocks`: ``[B, nQB, G, Hb * QB, D] -> [B, S, H, D]``."""
    batch, n_blocks, groups, rows, d = x.shape
    head_block = rows // query_block
    x = x.reshape(batch, n_blocks, groups, head_block, query_block, d)
    x = x.transpose(0, 1, 4, 2, 3, 5)
    return x.reshape(batch, n_blocks * query_block, groups * head_block, d)[:, :seq]
