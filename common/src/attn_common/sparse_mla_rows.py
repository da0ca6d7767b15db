"""Sparse MLA: where each query's selected keys live, as units and as token rows.

Both modes of ``sparse_mla_attention`` (``attn_common.sparse_mla``) read keys from one
row-addressable latent store: flat mode ``kv.reshape(B * T, Dk)``, ragged paged mode
``kv.reshape(num_pages * page_size, Dk_pad)`` (a page's rows are consecutive in the paged
cache ``[num_pages, page_size // pk, pk, Dk_pad]``). Here, per query token (``N = B * S``
of them, flattened):

* ``flat_units`` / ``ragged_units``: its selected units as ``UnitRows`` (the store row
  and request-local position of each unit's first token, plus the query's position and
  kv length); ``sparse_mla_units`` picks the mode and also returns the store;
* ``selected_rows``: the token rows it attends, as a sorted, duplicate-free row table
  ``[N, Kp]`` padded with ``-1`` and a count per query (what a row-gather kernel reads);
* ``block_union``: per block of ``query_block`` consecutive queries, the union of their
  rows, each once, with a bit per query saying who attends it (what a query-blocked
  row-gather kernel reads); ``sampled_union_pairs`` estimates its size from a few blocks.

Token ``first_pos + r`` (``r < read_block``) of a selected unit is a key of the query iff
``first_pos + r <= position`` and ``< kv_len``; a selection is a set, so a unit listed
twice, or two selections reaching the same store row, give that row once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from attn_common.fp8_cache import Fp8LatentCache
from attn_common.sparse_mla import SparseMlaProblem, lift_ragged_indices, ragged_query_info
from attn_common.tables import sanitize_unit_ids

ABSENT = 2**31 - 1  # sort key of a row that is not attended (never a real row)
# Compares per query (Kp * K) up to which selected_rows expands units to rows by one
# fused [N, Kp, K] max-reduction rather than a scatter and a scan: 65536 for 32 pages of
# 64 rows, where it measured 0.12 against 0.19 ms for 4096 queries on the H200.
EXPAND_BY_MAX_COMPARES = 2**17


class UnitRows(NamedTuple):
    """Where each query's selected units live, all ``[N, K]`` int32 except ``[N]``."""

    first_row: jax.Array  # first row of the unit in the flattened store; -1 = not selected
    first_pos: jax.Array  # request-local position of the unit's first token
    position: jax.Array  # [N] query position (causal bound)
    kv_len: jax.Array  # [N] number of valid key positions


def flat_units(
    indices: jax.Array, positions: jax.Array, *, kv_len: int, read_block: int, num_units: int
) -> UnitRows:
    """Flat mode: ``indices [B, S, K]`` unit ids, ``positions [B, S]`` -> ``UnitRows``.

    The store is ``kv.reshape(B * T, Dk)`` with ``T = kv_len``: unit ``u`` of batch row
    ``b`` starts at row ``b * T + u * read_block``. Ids outside ``[0, num_units)`` are
    not selections (``first_row = -1``). ``N = B * S``.
    """
    batch, seq, _ = indices.shape
    unit = sanitize_unit_ids(indices, num_units)
    batch_base = (jnp.arange(batch, dtype=jnp.int32) * kv_len)[:, None, None]
    first_row = jnp.where(unit >= 0, batch_base + unit * read_block, -1)
    return UnitRows(
        first_row=first_row.reshape(batch * seq, -1),
        first_pos=(jnp.maximum(unit, 0) * read_block).reshape(batch * seq, -1),
        position=positions.astype(jnp.int32).reshape(-1),
        kv_len=jnp.full((batch * seq,), kv_len, jnp.int32),
    )


def ragged_units(
    indices: jax.Array,
    positions: jax.Array,
    q_seq_id: jax.Array,
    seq_lens: jax.Array,
    cu_kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    page_size: int,
    num_pages: int,
) -> UnitRows:
    """Ragged paged mode: ``indices [1, S, K]`` request-local page ids -> ``UnitRows``.

    The store is ``kv.reshape(num_pages * page_size, Dk_pad)``: local page ``p`` of the
    request of query ``i`` starts at row ``page_indices[base + p] * page_size`` (``base
    = cu_kv_lens[r] // page_size``). Ids outside the request's page extent or the page
    table, and slots whose physical page is outside ``[0, num_pages)``, are not
    selections. ``positions [1, S]`` request-local; ``kv_len`` is ``seq_lens[r]``.
    """
    info = ragged_query_info(q_seq_id, seq_lens, cu_kv_lens, page_size=page_size)
    keys = lift_ragged_indices(indices[0], info, page_indices.shape[0])  # [S, K] slots
    phys = jnp.asarray(page_indices, jnp.int32)[jnp.maximum(keys, 0)]
    ok = (keys >= 0) & (phys >= 0) & (phys < num_pages)
    local_page = keys - info.base_page[:, None]
    return UnitRows(
        first_row=jnp.where(ok, phys * page_size, -1),
        first_pos=jnp.where(ok, local_page * page_size, 0),
        position=positions.astype(jnp.int32).reshape(-1),
        kv_len=info.kv_len,
    )


def sparse_mla_units(
    problem: SparseMlaProblem,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    page_size: int | None = None,
    q_seq_id: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
    cu_kv_lens: jax.Array | None = None,
    page_indices: jax.Array | None = None,
) -> tuple[UnitRows, jax.Array]:
    """The validated call's ``UnitRows`` (``N = B * S``) and its row store ``[R, W]``.

    ``problem`` is ``check_sparse_mla_inputs``'s answer for the same arguments. Flat:
    store ``kv.reshape(B * T, Dk)``; ragged: ``kv.reshape(num_pages * page_size,
    Dk_pad)`` (keys are its first ``Dk`` features). An ``Fp8LatentCache`` gives an
    ``Fp8LatentCache`` store on the token grid ``[R]``.
    """
    fp8 = isinstance(kv, Fp8LatentCache)
    if problem.ragged:
        units = ragged_units(
            indices,
            positions,
            q_seq_id,
            seq_lens,
            cu_kv_lens,
            page_indices,
            page_size=page_size,
            num_pages=kv.shape[0],
        )
        return units, kv.reshape(-1) if fp8 else kv.reshape(-1, kv.shape[-1])
    units = flat_units(
        indices,
        positions,
        kv_len=problem.kv_len,
        read_block=problem.read_block,
        num_units=problem.num_units,
    )
    return units, kv.reshape(-1) if fp8 else kv.reshape(-1, problem.dk)


def row_table_width(top_k: int, read_block: int, block: int = 64) -> int:
    """``Kp``: the row table's width, ``top_k * read_block`` rounded up to ``block``."""
    return -(-top_k * read_block // block) * block


def sort_rows(key: jax.Array, num_rows: int | None) -> jax.Array:
    """``jnp.sort(key, axis=1)`` for ``key [N, K]``: store rows and ``ABSENT``.

    With ``num_rows`` (every row below it) and ``N`` small enough, one 1-D sort of
    ``(query << row_bits) | row`` in uint32 does it: each query's ``K`` keys stay in its
    own ``K`` slots, sorted. XLA on Hopper runs a 1-D sort of that size as a CUB radix
    sort (``cub_sort_keys``) and the batched ``[N, K]`` sort of ``K = 2048`` keys as its
    own sort kernel: 0.26 against 0.44 ms for 4096 queries on the H200
    (docs/sparse_mla_gpu.md). Otherwise the batched sort.
    """
    n, top_k = key.shape
    row_bits = None if num_rows is None else int(num_rows).bit_length()
    if row_bits is None or n * top_k <= 1 or (n - 1).bit_length() + row_bits > 32:
        return jnp.sort(key, axis=1)
    absent = (1 << row_bits) - 1  # above every row
    query = jnp.arange(n, dtype=jnp.uint32)[:, None] << row_bits
    row = jnp.where(key == ABSENT, absent, key).astype(jnp.uint32)
    packed = lax.sort((query | row).reshape(-1), is_stable=False).reshape(n, top_k)
    row = (packed & jnp.uint32(absent)).astype(jnp.int32)
    return jnp.where(row == absent, ABSENT, row)


def _kept_lengths(key: jax.Array, length: jax.Array) -> jax.Array:
    """``length`` with every copy but the first of a key (sorted ``[N, K]``) zeroed."""
    first = jnp.concatenate([jnp.ones((key.shape[0], 1), bool), key[:, 1:] != key[:, :-1]], 1)
    return jnp.where(first, length, 0)


def _first_slots(length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Kept entries (``length > 0``) packed in order: ``(start, counts)``, entry ``k``'s
    first slot (a prefix sum of ``length``) and each query's slots used."""
    end = jnp.cumsum(length, axis=1, dtype=jnp.int32)
    return end - length, end[:, -1]


def _to_first_slots(values: jax.Array, length: jax.Array, start: jax.Array, width: int):
    """``[N, width]`` table of ``-1`` with each kept entry's ``values[k]`` at its first
    slot ``start[k]`` (the others sent to distinct slots past the table, dropped)."""
    n, top_k = length.shape
    dest = jnp.where(length > 0, start, width + jnp.arange(top_k, dtype=jnp.int32))
    query = jnp.arange(n, dtype=jnp.int32)[:, None]
    table = jnp.full((n, width), -1, jnp.int32)
    return table.at[query, dest].set(values, mode="drop", unique_indices=True)


def token_rows_by_sort(
    key: jax.Array, width: int, num_rows: int | None
) -> tuple[jax.Array, jax.Array]:
    """``selected_rows`` of token-level selections from their keys ``[N, K]`` (store
    rows, ``ABSENT`` where not attended): ``sort_rows``, then ``_token_rows``."""
    return _token_rows(sort_rows(key, num_rows), width)


def _token_rows(key: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """``selected_rows`` of token-level selections from their sorted keys ``[N, K]``
    (rows, then ``ABSENT``): each query's rows once, ascending, padded to ``width``.

    A batch without a repeated row (what a top-K indexer emits) is its own table: the
    sorted keys with ``ABSENT`` as ``-1``. Only a batch with a repeat pays for the
    compaction, a prefix sum and a scatter of every key to its slot (about 0.1 of the
    table's 0.40 ms for 4096 queries x 2048 tokens on the H200; docs/sparse_mla_gpu.md).
    """
    top_k = key.shape[1]
    present = (key != ABSENT).astype(jnp.int32)
    kept = _kept_lengths(key, present)

    def as_is():
        rows = jnp.where(present > 0, key, -1)
        return jnp.pad(rows, ((0, 0), (0, width - top_k)), constant_values=-1), present.sum(
            1, dtype=jnp.int32
        )

    def compacted():
        start, counts = _first_slots(kept)
        return _to_first_slots(key, kept, start, width), counts

    return lax.cond(jnp.any(kept != present), compacted, as_is)


def selected_rows(
    units: UnitRows,
    *,
    read_block: int,
    block: int = 64,
    num_rows: int | None = None,
    token_table: Callable[[jax.Array, int, int | None], tuple[jax.Array, jax.Array]] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each query's attended store rows, sorted and duplicate-free; jit-friendly.

    Unit ``k`` of query ``i`` covers rows ``first_row[i, k] + r`` (``r < read_block``) at
    positions ``first_pos[i, k] + r``; such a row is attended iff the unit is selected
    (``first_row >= 0``), its position is ``<= position[i]`` and ``< kv_len[i]``. Units
    listed more than once (the same ``first_row``, also from two page-table slots of one
    physical page) give their rows once: a row is attended when any copy makes it valid.

    Precondition (``flat_units`` and ``ragged_units`` meet it): a query's selected units
    tile the store, i.e. their first rows are congruent modulo ``read_block``, so two
    selections are one unit or cover disjoint rows.

    Returns ``rows [N, Kp]`` int32, ``Kp = row_table_width(K, read_block, block)``: query
    ``i``'s attended rows in ascending order in ``rows[i, :counts[i]]``, then ``-1``;
    and ``counts [N]`` int32. Cost: one sort of ``[N, K]`` (by first row; no ``K^2``
    comparison), then for token-level selections (``read_block == 1``) nothing more
    unless a row repeats (then a prefix sum and a scatter), for units prefix sums and
    either one fused ``[N, Kp, K]`` max-reduction (``Kp * K <=
    EXPAND_BY_MAX_COMPARES``) or a scatter and a scan. Store rows must be below
    ``2**31 - 1``.

    ``num_rows`` (optional, static): a bound on the store rows, which lets token-level
    selections (``read_block == 1``) be sorted as one 1-D array (``sort_rows``); the
    table is the same either way. ``token_table`` (optional, static): what builds the
    table of token-level selections from their keys, ``token_table(key [N, K] int32
    (store rows, ``ABSENT`` where not attended), width, num_rows)`` -> ``(rows [N,
    width], counts [N])`` as above (default ``token_rows_by_sort``; a backend can pass
    its own kernel, ``attn_mosaic_gpu.row_sort``).
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block: got {block!r}, expected a positive int")
    if isinstance(read_block, bool) or not isinstance(read_block, int) or read_block < 1:
        raise ValueError(f"read_block: got {read_block!r}, expected a positive int")
    if num_rows is not None and (
        isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0
    ):
        raise ValueError(f"num_rows: got {num_rows!r}, expected a non-negative int or None")
    n, top_k = units.first_row.shape
    width = row_table_width(top_k, read_block, block)
    if width == 0:
        return jnp.full((n, 0), -1, jnp.int32), jnp.zeros((n,), jnp.int32)
    first_row = units.first_row.astype(jnp.int32)
    first_pos = units.first_pos.astype(jnp.int32)
    # A unit's valid rows are a prefix: r < length (causal bound and kv length).
    limit = (
        jnp.minimum(units.position.astype(jnp.int32) + 1, units.kv_len.astype(jnp.int32))[:, None]
        - first_pos
    )
    length = jnp.where(first_row >= 0, jnp.clip(limit, 0, read_block), 0)
    key = jnp.where(length > 0, first_row, ABSENT)
    if read_block == 1:
        return (token_table or token_rows_by_sort)(key, width, num_rows)
    # Copies of a unit adjacent, the longest valid prefix first.
    key, neg_length = jax.lax.sort((key, -length), dimension=1, num_keys=2)
    length = _kept_lengths(key, -neg_length)
    start, counts = _first_slots(length)
    slot = jnp.arange(width, dtype=jnp.int32)
    if width * top_k <= EXPAND_BY_MAX_COMPARES:
        # Slot m holds row (key[k] - start[k]) + m of the kept unit k that owns it (the
        # last one starting <= m). Kept units have ascending keys at least read_block
        # apart and at most read_block rows each, so key - start never decreases along
        # them: the owner's is the maximum over the kept units starting <= m. One
        # [N, Kp, K] max-reduction that XLA fuses; no scatter, scan or gather.
        offset = jnp.where(length > 0, key - start, jnp.iinfo(jnp.int32).min)
        owns = start[:, None, :] <= slot[None, :, None]
        rows = jnp.max(jnp.where(owns, offset[:, None, :], jnp.iinfo(jnp.int32).min), axis=2)
        return jnp.where(slot < counts[:, None], rows + slot, -1), counts
    # Slot m holds row m - start[k] of the unit k that owns it (the last one starting <= m).
    unit = jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (n, top_k))
    owner = _to_first_slots(unit, length, start, width)
    owner = jnp.maximum(jax.lax.cummax(owner, axis=1), 0)
    row0 = jnp.take_along_axis(key, owner, axis=1)
    rows = row0 + slot - jnp.take_along_axis(start, owner, axis=1)
    return jnp.where(slot < counts[:, None], rows, -1), counts


class BlockUnion(NamedTuple):
    """The rows a block of queries attends (``block_union``), all int32."""

    rows: jax.Array  # [NB, Up]: the block's distinct rows, ascending, then -1
    counts: jax.Array  # [NB]: how many
    member: jax.Array  # [NB, Up]: bit j set iff query j of the block attends the row


def union_width(query_block: int, width: int, block: int = 64) -> int:
    """``Up``: a block union table's width, ``query_block * width`` rounded up to ``block``."""
    return -(-query_block * width // block) * block


def block_union(
    rows: jax.Array,
    counts: jax.Array,
    query_block: int,
    *,
    block: int = 64,
    num_rows: int | None = None,
) -> BlockUnion:
    """The union of the row tables of each block of ``query_block`` consecutive queries.

    ``rows [N, Kp]`` / ``counts [N]`` as ``selected_rows`` returns them (``N`` a multiple
    of ``query_block``; a query's rows distinct, or repeats ignored). Block ``b`` attends
    ``BlockUnion.rows[b, :counts[b]]`` (ascending, each row once, then ``-1``); bit ``j``
    of ``member[b, m]`` is set iff query ``b * query_block + j`` attends row ``rows[b,
    m]`` (``0`` past the count), so a kernel restores each query's own selection by
    masking. One sort of ``[NB, query_block * Kp]`` keys ``row * query_block + j``, a
    prefix sum and two scatters; jit-friendly. ``query_block`` at most 32 (the bits of
    an int32); ``num_rows`` (static, optional) a bound on the store rows, checked to
    keep the keys below ``2**31 - 1``.
    """
    n, kp = rows.shape
    qb = query_block
    if isinstance(qb, bool) or not isinstance(qb, int) or not 1 <= qb <= 32 or n % qb:
        raise ValueError(f"query_block: got {qb!r}, expected an int in [1, 32] dividing N = {n}")
    if num_rows is not None and num_rows * qb >= ABSENT:
        raise ValueError(f"num_rows: {num_rows} rows x {qb} queries exceed the int32 sort keys")
    nb, width = n // qb, union_width(qb, kp, block)
    j = jnp.arange(n, dtype=jnp.int32) % qb
    valid = jnp.arange(kp, dtype=jnp.int32)[None, :] < counts[:, None]
    key = jnp.where(valid, rows.astype(jnp.int32) * qb + j[:, None], ABSENT)
    key = jnp.sort(key.reshape(nb, qb * kp), axis=1)
    live = key != ABSENT
    prev = jnp.concatenate([jnp.full((nb, 1), -1, jnp.int32), key[:, :-1]], axis=1)
    row = key // qb
    first = live & (row != jnp.where(prev >= 0, prev // qb, -1))  # a new row
    fresh = live & (key != prev)  # a new (row, query): a repeat adds no bit
    pos = jnp.cumsum(first, axis=1, dtype=jnp.int32) - 1
    b = jnp.arange(nb, dtype=jnp.int32)[:, None]
    union = jnp.full((nb, width), -1, jnp.int32)
    union = union.at[b, jnp.where(first, pos, width)].set(row, mode="drop")
    # Distinct powers of two: their int32 sum (wrapping at bit 31) is their OR.
    bit = jnp.left_shift(jnp.int32(1), key % qb)
    member = jnp.zeros((nb, width), jnp.int32)
    member = member.at[b, jnp.where(fresh, pos, width)].add(bit, mode="drop")
    return BlockUnion(union, first.sum(axis=1, dtype=jnp.int32), member)


def sampled_union_pairs(
    rows: jax.Array, counts: jax.Array, query_block: int, *, samples: int, pair: int
) -> jax.Array:
    """An estimate of ``sum over blocks of ceil(union / pair)`` (``block_union``'s blocks)
    from ``samples`` evenly spaced blocks, scaled to all of them: float32, traced. Costs a
    union of ``samples`` blocks, whatever ``N``."""
    nb = rows.shape[0] // query_block
    take = min(samples, nb)
    picked = (jnp.arange(take, dtype=jnp.int32) * nb) // take
    members = (picked[:, None] * query_block + jnp.arange(query_block, dtype=jnp.int32)).ravel()
    sample = block_union(rows[members], counts[members], query_block, block=pair)
    per_block = (sample.counts + pair - 1) // pair
    return per_block.sum().astype(jnp.float32) * (nb / take)
