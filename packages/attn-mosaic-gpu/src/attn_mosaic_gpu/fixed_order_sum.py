"""A segment sum whose float addition order depends only on the ids: bitwise reproducible.

``segment_sum_fixed_order(data, ids, num_segments)`` is ``out[s] = sum(data[i] for i
with ids[i] == s)`` (ids outside ``[0, num_segments)`` dropped; their rows may hold
anything, NaN included, and are never read). A scatter-add on a GPU adds in whatever
order its atomics land; this sums each segment's rows in ascending ``i`` through a fixed
tree, with dense gathers and reductions only (no atomics), so two runs on the same
inputs give the same bits.

How: a stable sort of the ids lists each segment's rows in ascending order. Level one
cuts every segment into pieces of ``fan_in[0]`` consecutive rows (a table
``[pieces, fan]`` of row indices, -1 where a segment's last piece is short) and sums
each piece (an XLA gather fused into a reduction); the pieces, themselves sorted by
segment, are the next level's rows, ``fan_in[1]`` to a piece; and so on until no
segment has more than one piece. The number of levels is static: enough for a segment
of ``max_count`` rows. The tables are small pure functions of the ids (about ``4 M``
bytes at ``M`` rows); the only pass over ``data`` is level one's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["segment_sum_fixed_order"]

FAN_IN = (64, 8)  # rows per level-one piece; pieces per piece at every later level


def _pieces(sorted_ids: jax.Array, num_segments: int, fan: int):
    """Cut each segment of ``sorted_ids`` (nondecreasing; ids ``>= num_segments`` at
    the end are dropped) into pieces of ``fan`` consecutive positions.

    Returns ``(table [P, fan], piece_ids [P], first [num_segments], count
    [num_segments])``: ``table`` the positions of each piece (-1: none), ``piece_ids``
    each piece's segment (nondecreasing, ``num_segments`` past the last piece),
    ``first`` each segment's first piece and ``count`` its rows. ``P = M // fan +
    min(num_segments, M)`` bounds ``sum(ceil(count / fan))`` statically.
    """
    m = sorted_ids.shape[0]
    live = sorted_ids < num_segments
    seg = jnp.where(live, sorted_ids, num_segments)
    bounds = jnp.searchsorted(seg, jnp.arange(num_segments + 1, dtype=seg.dtype), side="left")
    start, count = bounds[:-1], jnp.diff(bounds)
    pieces = (count + fan - 1) // fan
    end = jnp.cumsum(pieces)
    first = end - pieces
    p_max = m // fan + min(num_segments, m)
    safe = jnp.minimum(seg, num_segments - 1)
    rank = jnp.arange(m, dtype=jnp.int32) - start[safe]
    piece = jnp.where(live, first[safe] + rank // fan, p_max)
    table = jnp.full((p_max, fan), -1, jnp.int32)
    table = table.at[piece, rank % fan].set(jnp.arange(m, dtype=jnp.int32), mode="drop")
    piece_ids = jnp.searchsorted(end, jnp.arange(p_max, dtype=end.dtype), side="right")
    return table, piece_ids.astype(jnp.int32), first, count


def _gather_sum(data: jax.Array, table: jax.Array) -> jax.Array:
    """``[P, D]``: each row of ``table`` summed over its entries, -1 contributing 0."""
    rows = data[jnp.maximum(table, 0)]
    return jnp.where((table >= 0)[..., None], rows, 0).sum(axis=1)


def segment_sum_fixed_order(
    data: jax.Array,
    ids: jax.Array,
    num_segments: int,
    *,
    max_count: int | None = None,
    fan_in: tuple[int, int] = FAN_IN,
) -> jax.Array:
    """``[num_segments, D]``: the rows of ``data [M, D]`` summed by ``ids [M]``, each
    segment in ascending row order through a fixed tree (bitwise reproducible).

    ``max_count``: a static bound on any segment's row count (default ``M``), which sets
    the number of levels. Rows whose id is out of range are never read.
    """
    m = data.shape[0]
    if ids.shape != (m,):
        raise ValueError(f"ids: got shape {ids.shape}, expected ({m},)")
    if m == 0 or num_segments == 0:
        return jnp.zeros((num_segments, *data.shape[1:]), data.dtype)
    max_count = m if max_count is None else min(max_count, m)
    ids = jnp.where((ids >= 0) & (ids < num_segments), ids, num_segments).astype(jnp.int32)
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    fan, later = fan_in
    table, piece_ids, first, count = _pieces(ids[order], num_segments, fan)
    sums = _gather_sum(data, jnp.where(table >= 0, order[jnp.maximum(table, 0)], -1))
    left = math.ceil(max(max_count, 1) / fan)  # pieces a segment may still have
    while left > 1:
        table, piece_ids, first, count = _pieces(piece_ids, num_segments, later)
        sums = _gather_sum(sums, table)
        left = math.ceil(left / later)
    first = jnp.minimum(first, sums.shape[0] - 1)
    return jnp.where((count > 0)[:, None], sums[first], 0).astype(data.dtype)
