"""Packed ranker rows: several users per sequence row (varlen), ``bounds [B, U, 4]``.

This module holds what the op and the kernels need of packed bounds (the mask, the
checks, the block ranges and step tables); ``attn_common.packing`` is the host-side
packer (``pack_users``) that builds such rows from per-user lengths.

A packed row holds up to ``U`` users; slot ``u`` of row ``b`` is ``bounds[b, u] =
(history_lo, history_hi, candidate_lo, candidate_hi)`` of one user, with history
``H_u = [hl, hu)`` and candidates ``C_u = [cl, cu)``. Query ``i`` may attend key ``j``
iff some user of the row allows it under the one-user rule (``attn_common.ranker_mask``):

    any over u of  (j in H_u and (i in H_u or i in C_u)) or (i in C_u and j == i)

With disjoint users (below) a token belongs to at most one user, so this is "a token
attends only within its own user": history -> own history, candidate -> own history +
itself. ``[B, 4]`` (and ``[4]``, ``SegmentBounds``) is the one-user case ``U = 1``.

Normalization (``normalize_packed_bounds``): values are clipped to ``[0, S]``; an
inverted or empty segment becomes the canonical ``(0, 0)``, so an unused slot is
all-zero. The mask of the normalized bounds equals the mask of the raw ones.

The overlap rule (``check_packed_bounds`` under ``debug_checks``; ``validate_packed_bounds``
on host values): after normalization, for two different users ``u != w`` of a row, every
non-empty segment of ``u`` is disjoint from every non-empty segment of ``w``. Empty
segments (so unused all-zero slots) are ignored; a user's own history and candidates
may overlap, as in the one-user op. Slots may come in any order and gaps between users
are padding. Overlapping users are refused by the checks; unchecked (traced bounds
without ``debug_checks``), the TPU kernels compute the union of their masks, and the
reference and the Hopper kernels give each row to the first user slot holding it (see
the per-position tables below).

Block ranges (``packed_kv_block_ranges`` / ``packed_q_block_ranges``): the KV blocks a
query tile must visit are the union over users of the one-user ranges, i.e. of at most
two block intervals per user (``u``'s history blocks, when the tile holds a query of
``u``; the blocks of ``u``'s candidates inside the tile). A union of ``2U`` intervals is
at most ``2U`` maximal runs, so the result is a padded list of ``R = 2U`` runs, sorted
by first block, pairwise disjoint and non-adjacent (touching runs are merged), empty
runs last. The bound is tight: a tile spanning ``U`` users whose history and
candidates are separated by more than a block, with gaps between users, needs ``2U``
runs. It holds whether or not users overlap (it only counts intervals). The dK/dV
transpose has the same structure (history keys: every query block of the user's
history and candidates; candidate keys: their own query blocks).

Per-position tables (``packed_query_table`` / ``packed_key_table``): the OR over ``U``
users costs a kernel about ``6 U`` operations per score. With disjoint users a token
belongs to at most one user, so what a query row may attend is one key interval plus
itself (``[B, 3, S]``: ``key_lo, key_hi, self_key``), and which queries may attend a
key is at most two query intervals plus itself (``[B, 5, S]``). Built outside a kernel
(XLA, ``O(B U S)``), loaded once per tile of rows, they make the mask ``O(1)`` per
score for any ``U`` (``ranker_mask_from_query_table`` / ``_from_key_table``). For
disjoint users they give exactly ``ranker_mask_packed``; for overlapping users (which
the checks refuse) a row takes the first user slot that holds it, so the Hopper
kernels' result is defined but may differ from the union.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from attn_common.bounds import (
    SegmentBounds,
    _as_int_array,
    _cdiv,
    _overlaps,
    normalize_bounds,
    overlap_len,
    ranker_mask,
)
from attn_common.metadata import is_concrete

__all__ = [
    "PackedBlockRanges",
    "TileRuns",
    "TileSteps",
    "check_packed_bounds",
    "normalize_packed_bounds",
    "normalize_ranker_bounds",
    "packed_full_kv_steps",
    "packed_full_q_steps",
    "packed_key_table",
    "packed_kv_block_ranges",
    "packed_q_block_ranges",
    "packed_query_table",
    "packed_runs_per_tile",
    "packed_step_list",
    "packed_step_table",
    "packed_users",
    "ranker_mask_from_key_table",
    "ranker_mask_from_query_table",
    "ranker_mask_packed",
    "ranker_mask_users",
    "validate_packed_bounds",
]

_RULE = (
    "users of a row must be disjoint: every non-empty segment (history or candidates) of "
    "a user must not intersect any non-empty segment of another user of the row"
)


def packed_runs_per_tile(num_users: int) -> int:
    """``R = 2 U``: the most block runs one tile can need (the tight bound, see above)."""
    return 2 * max(int(num_users), 1)


def _packed_array(bounds) -> jax.Array:
    """``SegmentBounds`` / int ``[4]`` / ``[B, 4]`` / ``[B, U, 4]`` -> int32 ``[B', U, 4]``."""
    if isinstance(bounds, SegmentBounds):
        return bounds.as_array()[:, None, :]
    arr = _as_int_array(bounds, "bounds")
    if arr.ndim not in (1, 2, 3) or arr.shape[-1] != 4 or (arr.ndim == 3 and arr.shape[1] == 0):
        raise ValueError(  # the shape as given, before the one-user forms are lifted
            f"bounds: got shape {tuple(arr.shape)}, expected [B, U, 4] (U >= 1 users per row), "
            "[B, 4] or [4]"
        )
    return arr.reshape((-1, 1, 4) if arr.ndim < 3 else arr.shape)


def normalize_packed_bounds(bounds, *, batch: int, seq_len: int) -> jax.Array:
    """Validate the form of ``bounds`` and return int32 ``[batch, U, 4]``.

    Accepts ``SegmentBounds``, an int array ``[batch, U, 4]`` / ``[1, U, 4]`` or the
    one-user forms ``[batch, 4]`` / ``[1, 4]`` / ``[4]`` (``U = 1``). Values are clipped
    to ``[0, seq_len]``; a segment with ``hi <= lo`` becomes ``(0, 0)``, so unused slots
    are all-zero. Works on traced values (no value checks: see ``check_packed_bounds``).
    """
    arr = _packed_array(bounds)
    if arr.shape[0] not in (1, batch):
        raise ValueError(f"bounds: got {arr.shape[0]} rows, expected {batch} (the batch size) or 1")
    arr = jnp.broadcast_to(arr, (batch, *arr.shape[1:]))
    arr = jnp.clip(arr, 0, seq_len)
    lo, hi = arr[..., 0::2], arr[..., 1::2]
    empty = hi <= lo
    lo = jnp.where(empty, 0, lo)
    hi = jnp.where(empty, 0, hi)
    return jnp.stack([lo[..., 0], hi[..., 0], lo[..., 1], hi[..., 1]], axis=-1).astype(jnp.int32)


def _overlap_pairs(xp, arr):
    """``[B, U, U]`` bool: users ``u != w`` have intersecting non-empty segments."""
    lo, hi = arr[..., 0::2], arr[..., 1::2]  # [B, U, 2]
    lo_u, hi_u = lo[:, :, None, :, None], hi[:, :, None, :, None]  # [B, U, 1, 2, 1]
    lo_w, hi_w = lo[:, None, :, None, :], hi[:, None, :, None, :]  # [B, 1, U, 1, 2]
    hit = (lo_u < hi_w) & (lo_w < hi_u) & (lo_u < hi_u) & (lo_w < hi_w)
    hit = hit.any(axis=(-1, -2))
    num_users = arr.shape[1]
    return hit & ~xp.eye(num_users, dtype=bool)[None]


def validate_packed_bounds(bounds, *, batch: int, seq_len: int) -> None:
    """Host-side overlap rule: raise ``ValueError`` naming the row, the users and their
    (clipped) values when two users of a row overlap. A no-op on traced bounds."""
    if isinstance(bounds, SegmentBounds) or not is_concrete(bounds):
        return  # SegmentBounds holds one user per row: nothing can overlap
    normalize_packed_bounds(bounds, batch=batch, seq_len=seq_len)  # the form checks
    arr = np.asarray(bounds)
    if arr.ndim != 3 or arr.shape[1] < 2:
        return
    # numpy only (this may run while a function is traced, e.g. under checkify)
    arr = np.clip(arr.astype(np.int64), 0, seq_len)
    arr = np.broadcast_to(arr, (batch, *arr.shape[1:])).copy()
    lo, hi = arr[..., 0::2], arr[..., 1::2]
    empty = hi <= lo
    lo[empty], hi[empty] = 0, 0
    arr[..., 0::2], arr[..., 1::2] = lo, hi
    bad = _overlap_pairs(np, arr)
    if bad.any():
        b, u, w = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"bounds: row {b}: users {u} {arr[b, u].tolist()} and {w} {arr[b, w].tolist()} "
            f"(hl, hu, cl, cu after clipping to [0, {seq_len}]) overlap; {_RULE}"
        )


def packed_users(bounds, *, min_users: int = 1) -> int:
    """``U`` when ``bounds`` is packed ``[B, U, 4]`` with ``U >= min_users``, else 0.

    ``[B, 4]``, ``[4]`` and ``SegmentBounds`` are the one-user layout (0). A backend
    whose one-user kernels also serve ``[B, 1, 4]`` passes ``min_users=2``.
    """
    if isinstance(bounds, SegmentBounds):
        return 0
    shape = np.shape(bounds)
    return int(shape[1]) if len(shape) == 3 and shape[1] >= min_users else 0


def normalize_ranker_bounds(bounds, *, batch: int, seq_len: int, min_users: int = 1):
    """``(clipped int32 bounds, users)`` for a kernel: packed bounds (``packed_users``
    > 0) are checked for overlapping users on host values and normalized to
    ``[B, U, 4]``; any other layout goes through ``normalize_bounds`` to ``[B, 4]`` with
    ``users = 0``."""
    users = packed_users(bounds, min_users=min_users)
    if users:
        validate_packed_bounds(bounds, batch=batch, seq_len=seq_len)
        return normalize_packed_bounds(bounds, batch=batch, seq_len=seq_len), users
    return normalize_bounds(bounds, batch=batch, seq_len=seq_len), 0


def check_packed_bounds(bounds, *, seq_len: int) -> None:
    """``checkify`` debug path: every segment in ``0 <= lo <= hi <= S`` and users disjoint.

    The range check is ``check_bounds``' rule applied to every (row, user); the overlap
    rule is checked on the clipped values. Call it inside ``checkify.checkify`` (the
    public ops do so with ``debug_checks=True``).
    """
    arr = _packed_array(bounds)
    lo, hi = arr[..., 0::2], arr[..., 1::2]
    ok = jnp.all((lo >= 0) & (lo <= hi) & (hi <= seq_len), axis=-1)  # [B, U]
    first = jnp.argmin(ok.reshape(-1))
    num_users = arr.shape[1]
    checkify.check(
        jnp.all(ok),
        "bounds out of range: need 0 <= lo <= hi <= {S} for every row and user; "
        "first bad row {r}, user {u}",
        S=jnp.asarray(seq_len, jnp.int32),
        r=first // num_users,
        u=first % num_users,
    )
    clipped = normalize_packed_bounds(arr, batch=arr.shape[0], seq_len=seq_len)
    bad = _overlap_pairs(jnp, clipped)  # [B, U, U]
    flat = jnp.argmax(bad.reshape(-1))
    checkify.check(
        ~jnp.any(bad),
        "bounds: overlapping users: row {r}, users {u} and {w}; " + _RULE,
        r=flat // (num_users * num_users),
        u=(flat // num_users) % num_users,
        w=flat % num_users,
    )


def ranker_mask_packed(q_idx, kv_idx, bounds):
    """The packed mask predicate: ``True`` where query ``q_idx`` may attend key ``kv_idx``.

    ``bounds`` is ``[..., U, 4]``; each field ``bounds[..., u, t]`` must broadcast
    against ``q_idx`` and ``kv_idx`` (e.g. bounds ``[B, 1, 1, U, 4]`` with positions
    ``[1, S, 1]`` and ``[1, 1, S]`` give ``[B, S, S]``; a kernel passes ``[U, 4]`` of
    scalars and its tile iotas). The OR over users of ``ranker_mask``.
    """
    bounds = jnp.asarray(bounds)
    users = [tuple(bounds[..., u, t] for t in range(4)) for u in range(bounds.shape[-2])]
    return ranker_mask_users(q_idx, kv_idx, users)


def ranker_mask_users(q_idx, kv_idx, users):
    """``ranker_mask_packed`` with the users given as a sequence of ``(hl, hu, cl, cu)``
    tuples (scalars in a kernel): the OR over users of ``ranker_mask``."""
    allowed = None
    for user in users:
        m = ranker_mask(q_idx, kv_idx, *user)
        allowed = m if allowed is None else allowed | m
    return allowed


# ------------------------------------------------------------------- per-position tables

PACKED_QUERY_FIELDS = 3
PACKED_KEY_FIELDS = 5


def _first_user(member, values, default=0):
    """``values [B, U]`` of the first user where ``member [B, U, S]`` holds, per position."""
    first = jnp.argmax(member, axis=1)  # [B, S]
    picked = jnp.take_along_axis(values, first, axis=1)
    return jnp.where(member.any(axis=1), picked, default)


def _positions(bounds, seq_len: int):
    bounds = jnp.asarray(bounds, jnp.int32)
    pos = jnp.arange(seq_len, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    hl, hu, cl, cu = (bounds[..., t] for t in range(4))  # [B, U]
    in_hist = (pos >= hl[..., None]) & (pos < hu[..., None])  # [B, U, S]
    in_cand = (pos >= cl[..., None]) & (pos < cu[..., None])
    self_pos = jnp.where(in_cand.any(axis=1), pos[:, 0], -1)  # [B, S]
    return (hl, hu, cl, cu), in_hist, in_cand, self_pos


def packed_query_table(bounds, seq_len: int) -> jax.Array:
    """int32 ``[B, 3, seq_len]``: for each query position ``i`` of each row, the keys it
    may attend: ``key_lo <= j < key_hi`` (its user's history) or ``j == self_key``
    (``i`` itself when ``i`` is a candidate, else ``-1``). Positions of no user get the
    empty interval ``(0, 0)``. ``bounds`` ``[B, U, 4]`` normalized."""
    (hl, hu, _, _), in_hist, in_cand, self_pos = _positions(bounds, seq_len)
    own = in_hist | in_cand
    return jnp.stack([_first_user(own, hl), _first_user(own, hu), self_pos], axis=1)


def packed_key_table(bounds, seq_len: int) -> jax.Array:
    """int32 ``[B, 5, seq_len]``: for each key position ``j`` of each row, the queries
    that may attend it: ``q_lo0 <= i < q_hi0`` (its user's history) or ``q_lo1 <= i <
    q_hi1`` (that user's candidates), when ``j`` is a history key, or ``i == self_query``
    (``j`` itself when ``j`` is a candidate, else ``-1``). ``bounds`` ``[B, U, 4]``
    normalized."""
    (hl, hu, cl, cu), in_hist, _, self_pos = _positions(bounds, seq_len)
    fields = [_first_user(in_hist, x) for x in (hl, hu, cl, cu)]
    return jnp.stack([*fields, self_pos], axis=1)


def ranker_mask_from_query_table(kv_idx, key_lo, key_hi, self_key):
    """The mask from a query row's ``packed_query_table`` entries (broadcastable):
    three compares and two logic operations per score."""
    return ((kv_idx >= key_lo) & (kv_idx < key_hi)) | (kv_idx == self_key)


def ranker_mask_from_key_table(q_idx, q_lo0, q_hi0, q_lo1, q_hi1, self_query):
    """The mask from a key row's ``packed_key_table`` entries (broadcastable)."""
    in_hist = (q_idx >= q_lo0) & (q_idx < q_hi0)
    in_cand = (q_idx >= q_lo1) & (q_idx < q_hi1)
    return in_hist | in_cand | (q_idx == self_query)


# ------------------------------------------------------------------------------ runs


class PackedBlockRanges(NamedTuple):
    """``R`` runs of block indices per tile, in visiting order (fields ``[..., R]``).

    Run ``r`` visits blocks ``starts[r] .. starts[r] + steps[r] - 1``. Non-empty runs
    come first, sorted by ``starts``, pairwise disjoint and non-adjacent; empty runs
    have ``starts = steps = 0``. Step ``s`` (``0 <= s < total_steps``) visits
    ``block_at(s)``; no block appears twice.
    """

    starts: jax.Array
    steps: jax.Array

    @property
    def num_runs(self) -> int:
        return self.starts.shape[-1]

    @property
    def total_steps(self):
        return jnp.sum(self.steps, axis=-1)

    @property
    def offsets(self):
        """``[..., R]`` first step of each run (exclusive prefix sum of ``steps``)."""
        return jnp.cumsum(self.steps, axis=-1) - self.steps

    def block_at(self, step):
        """The block of ``step``; ``step`` broadcasts against the leading dims.

        A chain of ``R - 1`` selects over the runs (scalar-friendly for kernels). Steps
        past ``total_steps`` give the last run's block continued (callers clamp)."""
        offsets = self.offsets
        block = self.starts[..., 0] + step
        for r in range(1, self.num_runs):
            take = (step >= offsets[..., r]) & (self.steps[..., r] > 0)
            block = jnp.where(take, self.starts[..., r] + (step - offsets[..., r]), block)
        return block

    def blocks_to_steps(self, block_lo, block_hi):
        """Steps ``[lo, hi)`` visiting blocks ``[block_lo, block_hi)`` when that interval
        lies in one run; clipped to the run holding ``block_lo``, empty if none does."""
        offsets = self.offsets
        lo = jnp.zeros_like(block_lo + self.starts[..., 0])
        hi = lo
        for r in range(self.num_runs):
            start, n = self.starts[..., r], self.steps[..., r]
            inside = (block_hi > block_lo) & (block_lo >= start) & (block_lo < start + n)
            r_lo = offsets[..., r] + (block_lo - start)
            r_hi = offsets[..., r] + (jnp.minimum(block_hi, start + n) - start)
            lo = jnp.where(inside, r_lo, lo)
            hi = jnp.where(inside, r_hi, hi)
        return lo, hi


class TileRuns(NamedTuple):
    """One tile's runs as scalars (a row of ``packed_step_table`` read in a kernel):
    ``starts[r]`` and ``ends[r]``, the cumulative step count after run ``r``."""

    starts: tuple
    ends: tuple

    @classmethod
    def read(cls, word, runs: int) -> TileRuns:
        """From ``word(i)``, the ``i``-th int32 of the tile's table row."""
        return cls(tuple(word(r) for r in range(runs)), tuple(word(runs + r) for r in range(runs)))

    @property
    def total_steps(self):
        return self.ends[-1]

    def block_at(self, step):
        """The block of ``step``: runs are sorted with empty ones last, so a chain of
        ``R - 1`` selects; past the end, the last run continued (callers clamp)."""
        block = self.starts[0] + step
        for r in range(1, len(self.starts)):
            prev = self.ends[r - 1]
            block = jnp.where(step >= prev, self.starts[r] + (step - prev), block)
        return block


def _tile_ranges(bounds, tile: int, num_tiles: int, block: int, sub_tiles: int, keys: bool):
    """Every tile's runs (``[B, T, R]``) and each sub-tile's unmasked steps (``[B, T]``
    pairs); see ``packed_step_table``."""
    rows = jnp.asarray(bounds, jnp.int32)[:, None]  # [B, 1, U, 4]
    t0 = jnp.arange(num_tiles, dtype=jnp.int32)[None] * tile  # [1, T]
    if keys:
        ranges_fn, full_fn = packed_q_block_ranges, packed_full_q_steps
    else:
        ranges_fn, full_fn = packed_kv_block_ranges, packed_full_kv_steps
    ranges = ranges_fn(rows, t0, t0 + tile, block)
    sub = tile // sub_tiles
    full = [
        full_fn(ranges, rows, t0 + s * sub, t0 + (s + 1) * sub, block) for s in range(sub_tiles)
    ]
    return ranges, full


def packed_step_table(
    bounds, *, tile: int, num_tiles: int, block: int, sub_tiles: int = 1, keys: bool = False
) -> jax.Array:
    """int32 ``[B, num_tiles, 2R + 2 sub_tiles]``: per row and tile of ``tile`` positions,
    the visit-once runs over blocks of ``block`` (``starts[R]``, then ``ends[R]``, the
    cumulative step counts; ``R = 2U``), then for each of ``sub_tiles`` equal sub-tiles
    the steps ``[lo, hi)`` that need no mask. ``keys=False``: query tiles visiting KV
    blocks (``packed_kv_block_ranges`` / ``packed_full_kv_steps``); ``keys=True``: key
    tiles visiting query blocks (``packed_q_block_ranges`` / ``packed_full_q_steps``).
    Built outside a kernel (XLA) and read by it as scalars (``TileRuns``)."""
    ranges, full = _tile_ranges(bounds, tile, num_tiles, block, sub_tiles, keys)
    cols = [ranges.starts, jnp.cumsum(ranges.steps, axis=-1)]
    for lo, hi in full:
        cols += [lo[..., None], hi[..., None]]
    return jnp.concatenate([c.astype(jnp.int32) for c in cols], axis=-1)


def packed_step_list(
    bounds, *, tile: int, num_tiles: int, block: int, sub_tiles: int = 1, keys: bool = False
) -> jax.Array:
    """int32 ``[B, num_tiles, 1 + 2 sub_tiles + num_blocks]``: ``packed_step_table`` as a
    list. Per row and tile: the step count, then each sub-tile's unmasked steps ``[lo,
    hi)``, then the block of every step (``num_blocks = num_tiles * tile // block``
    entries, the most a tile can visit; 0 past the step count).

    A kernel reads one word per step (``TileSteps``) instead of keeping the ``2R`` run
    scalars of ``TileRuns`` live across its loop (``4U`` registers, and a chain of
    ``R - 1`` selects per step).
    """
    ranges, full = _tile_ranges(bounds, tile, num_tiles, block, sub_tiles, keys)
    num_blocks = num_tiles * tile // block
    steps = jnp.arange(num_blocks, dtype=jnp.int32)
    blocks = ranges.block_at(steps[:, None, None])  # [num_blocks, B, T]
    blocks = jnp.where(steps[:, None, None] < ranges.total_steps[None], blocks, 0)
    cols = [ranges.total_steps[..., None]]
    for lo, hi in full:
        cols += [lo[..., None], hi[..., None]]
    cols.append(jnp.moveaxis(blocks, 0, -1))
    return jnp.concatenate([c.astype(jnp.int32) for c in cols], axis=-1)


class TileSteps:
    """One tile's row of ``packed_step_list``, read in a kernel through ``word(i)`` (a
    scalar load of the row's ``i``-th int32): ``total_steps`` once, then one load per
    ``block_at``."""

    def __init__(self, word, sub_tiles: int):
        self._word = word
        self._blocks = 1 + 2 * sub_tiles
        self.total_steps = word(0)

    def full_steps(self, sub: int):
        """Sub-tile ``sub``'s steps ``[lo, hi)`` that need no mask."""
        return self._word(1 + 2 * sub), self._word(2 + 2 * sub)

    def block_at(self, step):
        return self._word(self._blocks + step)


def _union_runs(lo, hi) -> PackedBlockRanges:
    """Union of intervals ``[lo, hi)`` (``[..., n]``; ``hi <= lo`` is empty) as ``n`` runs."""
    n = lo.shape[-1]
    empty = hi <= lo
    big = jnp.iinfo(jnp.int32).max
    key = jnp.where(empty, big, lo)
    order = jnp.argsort(key, axis=-1, stable=True)
    lo = jnp.take_along_axis(key, order, axis=-1)
    hi = jnp.take_along_axis(jnp.where(empty, big, hi), order, axis=-1)
    valid = lo < big
    reach = jax.lax.cummax(hi, axis=hi.ndim - 1)
    prev = jnp.concatenate([jnp.full_like(reach[..., :1], -1), reach[..., :-1]], axis=-1)
    new_run = valid & (lo > prev)  # touching intervals (lo == prev reach) merge
    run_id = jnp.cumsum(new_run, axis=-1) - 1  # [..., n]
    # Run r: first block = lo of its first member, end = max hi of its members.
    r_ids = jnp.arange(n, dtype=run_id.dtype)
    member = valid[..., None, :] & (run_id[..., None, :] == r_ids[:, None])  # [..., R, n]
    starts = jnp.min(jnp.where(member, lo[..., None, :], big), axis=-1)
    ends = jnp.max(jnp.where(member, hi[..., None, :], 0), axis=-1)
    used = member.any(axis=-1)
    starts = jnp.where(used, starts, 0).astype(jnp.int32)
    steps = jnp.where(used, ends - starts, 0).astype(jnp.int32)
    return PackedBlockRanges(starts=starts, steps=steps)


def _fields(bounds, *tile):
    """Bounds ``[..., U, 4]`` -> four ``[..., U]`` fields, tile ends -> ``[..., 1]``."""
    bounds = jnp.asarray(bounds, jnp.int32)
    fields = tuple(bounds[..., t] for t in range(4))
    return fields, tuple(jnp.asarray(x, jnp.int32)[..., None] for x in tile)


def _block_interval(ok, lo, hi, block):
    return jnp.where(ok, lo // block, 0), jnp.where(ok, _cdiv(hi, block), 0)


def packed_kv_block_ranges(bounds, q_start, q_end, block_kv: int) -> PackedBlockRanges:
    """KV blocks (of ``block_kv`` keys) that query rows ``[q_start, q_end)`` must visit.

    ``bounds`` ``[..., U, 4]`` (normalized or not: empty segments are ignored); the
    tile ends broadcast against ``bounds``' leading dims ``[...]``. Exactly the blocks
    holding at least one allowed (query in tile, key) pair, each once, as ``2U`` runs.
    For ``U = 1`` the same blocks as ``ranker_kv_block_ranges`` (sorted).
    """
    (hl, hu, cl, cu), (qs, qe) = _fields(bounds, q_start, q_end)
    tile_attends = _overlaps(qs, qe, hl, hu) | _overlaps(qs, qe, cl, cu)
    h0, h1 = _block_interval(tile_attends & (hl < hu), hl, hu, block_kv)
    self_lo, self_hi = jnp.maximum(cl, qs), jnp.minimum(cu, qe)
    c0, c1 = _block_interval(self_lo < self_hi, self_lo, self_hi, block_kv)
    return _union_runs(jnp.concatenate([h0, c0], -1), jnp.concatenate([h1, c1], -1))


def packed_q_block_ranges(bounds, kv_start, kv_end, block_q: int) -> PackedBlockRanges:
    """Query blocks (of ``block_q`` rows) that key rows ``[kv_start, kv_end)`` must visit.

    The transpose of ``packed_kv_block_ranges``, for dK/dV: a user's history keys are
    read by every history and candidate query of that user; a candidate key by its own
    query only. ``2U`` runs; for ``U = 1`` the blocks of ``ranker_q_block_ranges``.
    """
    (hl, hu, cl, cu), (ks, ke) = _fields(bounds, kv_start, kv_end)
    has_hist = _overlaps(ks, ke, hl, hu)
    h0, h1 = _block_interval(has_hist, hl, hu, block_q)
    c_lo = jnp.where(has_hist, cl, jnp.maximum(cl, ks))
    c_hi = jnp.where(has_hist, cu, jnp.minimum(cu, ke))
    c0, c1 = _block_interval(c_lo < c_hi, c_lo, c_hi, block_q)
    return _union_runs(jnp.concatenate([h0, c0], -1), jnp.concatenate([h1, c1], -1))


def _widest(ok, b0, b1):
    """Among users where ``ok`` (``[..., U]``), the block interval with the most blocks."""
    n = jnp.where(ok, jnp.maximum(b1 - b0, 0), 0)
    pick = jnp.argmax(n, axis=-1)[..., None]
    lo = jnp.take_along_axis(jnp.where(ok, b0, 0), pick, axis=-1)[..., 0]
    hi = jnp.take_along_axis(jnp.where(ok, b1, 0), pick, axis=-1)[..., 0]
    has = jnp.take_along_axis(n, pick, axis=-1)[..., 0] > 0
    return jnp.where(has, lo, 0), jnp.where(has, hi, 0)


def packed_full_kv_steps(ranges: PackedBlockRanges, bounds, q_start, q_end, block_kv: int):
    """Steps ``[lo, hi)`` of ``ranges`` whose KV block every row of ``[q_start, q_end)``
    may attend in full, so a kernel can skip the mask there.

    ``ranges`` are ``packed_kv_block_ranges`` of a tile containing the rows (it may be
    larger). A block is fully allowed for the rows when some user ``u`` holds every row
    in ``H_u`` or ``C_u`` and the block lies inside ``H_u``; those blocks are contiguous,
    hence one step interval. Sound for any bounds; for disjoint users and
    ``q_end - q_start >= 2`` it is every fully allowed step (rows of two users share no
    allowed key, and a non-history key is seen by one row only).
    """
    (hl, hu, cl, cu), (qs, qe) = _fields(bounds, q_start, q_end)
    rows = qe - qs
    n_hist = overlap_len(qs, qe, hl, hu)
    n_cand = overlap_len(qs, qe, cl, cu)
    n_both = overlap_len(qs, qe, jnp.maximum(hl, cl), jnp.minimum(hu, cu))
    rows_full = (rows > 0) & (n_hist + n_cand - n_both == rows)
    b0, b1 = _widest(rows_full, _cdiv(hl, block_kv), hu // block_kv)
    return ranges.blocks_to_steps(b0, b1)


def packed_full_q_steps(ranges: PackedBlockRanges, bounds, kv_start, kv_end, block_q: int):
    """Steps ``[lo, hi)`` of ``ranges`` whose query block attends every key of
    ``[kv_start, kv_end)`` (the transpose of ``packed_full_kv_steps``).

    When every key lies in ``H_u`` for a user ``u``, the counted blocks are those inside
    ``H_u``, or inside ``H_u`` + ``C_u`` when the two touch (the ranker layouts); one
    step interval. As ``ranker_full_q_steps``: blocks made only of candidate rows across a
    gap from the history are left to the masked path.
    """
    (hl, hu, cl, cu), (ks, ke) = _fields(bounds, kv_start, kv_end)
    keys_hist = (ke > ks) & (ks >= hl) & (ke <= hu)
    has_cand = cl < cu
    touch = has_cand & (cl <= hu) & (hl <= cu)
    rows_lo = jnp.where(touch, jnp.minimum(hl, cl), hl)
    rows_hi = jnp.where(touch, jnp.maximum(hu, cu), hu)
    b0, b1 = _widest(keys_hist, _cdiv(rows_lo, block_q), rows_hi // block_q)
    return ranges.blocks_to_steps(b0, b1)
