"""Ranker segments: bounds, the mask predicate, and the block ranges kernels visit.

A ranker sequence row holds a history segment ``H = [history_lo, history_hi)`` and a
candidate segment ``C = [candidate_lo, candidate_hi)``; every other position is padding.
Query ``i`` may attend key ``j`` iff

    (j in H and (i in H or i in C)) or (i in C and j == i)

Bounds are data (a traced int32 ``[B, 4]`` array), never static: one compiled kernel
serves every batch. Out-of-range bounds have a defined meaning: they are clipped to
``[0, S]`` and an inverted segment (``hi < lo``) is empty. ``check_bounds`` is the
``checkify`` debug path that reports them instead.

The block-range functions are the one definition of which KV blocks a query tile visits
(forward, dq) and which query blocks a KV tile visits (dk/dv). A history range and a
candidate range may share a block when bounds are not block-aligned; the two ranges are
then merged so that the shared block is visited exactly once.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

# Segment ids understood by ``SegmentBounds.from_segment_ids``.
SEGMENT_PADDING = 0
SEGMENT_HISTORY = 1
SEGMENT_CANDIDATE = 2


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentBounds:
    """Per-row segment bounds; each field is an int32 array ``[B]``.

    Build it with ``from_array``, ``from_lengths`` or ``from_segment_ids``; pass it (or
    the ``[B, 4]`` array of ``as_array()``) as ``bounds`` to ``ranker_attention``.
    """

    history_lo: jax.Array
    history_hi: jax.Array
    candidate_lo: jax.Array
    candidate_hi: jax.Array

    @classmethod
    def from_array(cls, bounds) -> SegmentBounds:
        """From ``[B, 4]`` (or ``[4]``, one row) = (history_lo, history_hi, cand_lo, cand_hi)."""
        arr = _as_int_array(bounds, "bounds")
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2 or arr.shape[1] != 4:
            raise ValueError(f"bounds: got shape {tuple(arr.shape)}, expected [B, 4] or [4]")
        return cls(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3])

    @classmethod
    def from_lengths(cls, history_len, candidate_len, history_start=0) -> SegmentBounds:
        """History ``[start, start+h)`` followed by candidates ``[start+h, start+h+c)``.

        Each argument is an int or an int array ``[B]``; they broadcast together.
        """
        h = _as_int_array(history_len, "history_len")
        c = _as_int_array(candidate_len, "candidate_len")
        s = _as_int_array(history_start, "history_start")
        for name, x in (("history_len", h), ("candidate_len", c), ("history_start", s)):
            if x.ndim > 1:
                raise ValueError(f"{name}: got shape {tuple(x.shape)}, expected a scalar or [B]")
            if _is_concrete(x) and np.any(np.asarray(x) < 0):
                raise ValueError(f"{name}: got negative values {np.asarray(x)}, expected >= 0")
        try:
            h, c, s = jnp.broadcast_arrays(jnp.atleast_1d(h), jnp.atleast_1d(c), jnp.atleast_1d(s))
        except ValueError:
            raise ValueError(
                f"history_len, candidate_len, history_start: got shapes {h.shape}, {c.shape}, "
                f"{s.shape}, expected scalars or [B] arrays of one length"
            ) from None
        return cls(s, s + h, s + h, s + h + c)

    @classmethod
    def from_segment_ids(cls, segment_ids) -> SegmentBounds:
        """From per-token ids ``[B, S]``: 0 padding, 1 history, 2 candidate.

        Each segment must be contiguous; with concrete ids this is checked and a
        ``ValueError`` names the first bad row. An absent segment becomes empty.
        """
        ids = _as_int_array(segment_ids, "segment_ids")
        if ids.ndim != 2 or 0 in ids.shape:
            raise ValueError(
                f"segment_ids: got shape {tuple(ids.shape)}, expected non-empty [B, S]"
            )
        if _is_concrete(ids):
            bad = ~np.isin(np.asarray(ids), (SEGMENT_PADDING, SEGMENT_HISTORY, SEGMENT_CANDIDATE))
            if bad.any():
                raise ValueError(
                    f"segment_ids: found value {np.asarray(ids)[bad][0]}, expected 0 (padding), "
                    "1 (history) or 2 (candidate)"
                )
        seq = ids.shape[1]
        pos = jnp.arange(seq, dtype=jnp.int32)

        def span(seg):
            hit = ids == seg
            lo = jnp.min(jnp.where(hit, pos, seq), axis=1)
            hi = jnp.max(jnp.where(hit, pos + 1, 0), axis=1)
            count = hit.sum(axis=1)
            lo = jnp.where(count > 0, lo, 0)
            hi = jnp.where(count > 0, hi, 0)
            if _is_concrete(ids):
                gaps = np.asarray(hi - lo) != np.asarray(count)
                if gaps.any():
                    row = int(np.argmax(gaps))
                    raise ValueError(
                        f"segment_ids: segment {seg} of row {row} is not contiguous; "
                        "each segment must be one run of positions"
                    )
            return lo.astype(jnp.int32), hi.astype(jnp.int32)

        hl, hu = span(SEGMENT_HISTORY)
        cl, cu = span(SEGMENT_CANDIDATE)
        return cls(hl, hu, cl, cu)

    @property
    def batch(self) -> int:
        return self.history_lo.shape[0]

    def as_array(self) -> jax.Array:
        """int32 ``[B, 4]``."""
        return jnp.stack(
            [self.history_lo, self.history_hi, self.candidate_lo, self.candidate_hi], axis=1
        ).astype(jnp.int32)


def _as_int_array(x, name: str):
    if isinstance(x, bool):
        raise TypeError(f"{name}: got a bool, expected integers")
    arr = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{name}: got dtype {arr.dtype}, expected an integer dtype")
    if arr.dtype.itemsize > 4 and _is_concrete(arr):
        # Saturate instead of wrapping: 2**32 + 3 must not become 3.
        info = np.iinfo(np.int32)
        arr = jnp.asarray(np.clip(np.asarray(arr), info.min, info.max))
    return arr.astype(jnp.int32)


def normalize_bounds(bounds, *, batch: int, seq_len: int) -> jax.Array:
    """Validate the form of ``bounds`` and return clipped int32 ``[batch, 4]``.

    Accepts ``SegmentBounds`` or an int array ``[batch, 4]`` / ``[1, 4]`` / ``[4]``.
    Values are clipped to ``[0, seq_len]`` and an inverted segment becomes empty, so
    out-of-range data never reads outside the sequence. Packed bounds ``[B, 1, 4]`` (one
    user per row) are taken as ``[B, 4]``; ``[B, U, 4]`` with ``U > 1`` raises
    ``NotImplementedError`` (``attn_common.packed`` handles several users per row).
    """
    bounds = _one_user(bounds)
    if isinstance(bounds, SegmentBounds):
        arr = bounds.as_array()
    else:
        arr = SegmentBounds.from_array(bounds).as_array()
    if arr.shape[0] not in (1, batch):
        raise ValueError(f"bounds: got {arr.shape[0]} rows, expected {batch} (the batch size) or 1")
    arr = jnp.broadcast_to(arr, (batch, 4))
    arr = jnp.clip(arr, 0, seq_len)
    lo = arr[:, 0::2]
    hi = jnp.maximum(arr[:, 1::2], lo)
    return jnp.stack([lo[:, 0], hi[:, 0], lo[:, 1], hi[:, 1]], axis=1)


def _one_user(bounds):
    """Packed ``[B, 1, 4]`` -> ``[B, 4]``; refuse ``[B, U, 4]`` with ``U > 1``; else as is."""
    if isinstance(bounds, SegmentBounds):
        return bounds
    shape = np.shape(bounds)
    if len(shape) != 3 or shape[2] != 4:
        return bounds
    if shape[1] != 1:
        raise NotImplementedError(
            f"bounds: got shape {tuple(shape)}, i.e. U = {shape[1]} users per row; this path "
            "takes one user per row ([B, 4] or [B, 1, 4]). Packed rows (U > 1) are "
            "normalized by attn_common.normalize_packed_bounds and run on the backends "
            "that support them (attn_reference)"
        )
    return bounds[:, 0, :]


def check_bounds(bounds, *, seq_len: int) -> None:
    """``checkify`` debug path: flags rows whose bounds are outside ``0 <= lo <= hi <= S``.

    Call it inside a function wrapped with ``checkify.checkify`` (the public ops do so
    when given ``debug_checks=True``). ``[B, 1, 4]`` is taken as ``[B, 4]``; ``[B, U, 4]``
    with ``U > 1`` raises ``NotImplementedError`` (use ``check_packed_bounds``).
    """
    bounds = _one_user(bounds)
    arr = bounds.as_array() if isinstance(bounds, SegmentBounds) else jnp.asarray(bounds)
    arr = jnp.atleast_2d(arr)
    lo, hi = arr[:, 0::2], arr[:, 1::2]
    ok = (lo >= 0) & (lo <= hi) & (hi <= seq_len)
    checkify.check(
        jnp.all(ok),
        "bounds out of range: need 0 <= lo <= hi <= {S} for every row; first bad row {r}",
        S=jnp.asarray(seq_len, jnp.int32),
        r=jnp.argmin(jnp.all(ok, axis=1)),
    )


def ranker_mask(q_idx, kv_idx, history_lo, history_hi, candidate_lo, candidate_hi):
    """The ranker mask predicate, elementwise over broadcastable position arrays.

    ``True`` where query position ``q_idx`` may attend key position ``kv_idx``. Plain
    ``jnp`` comparisons, so kernels call it on their tile iotas unchanged.
    """
    q_hist = (q_idx >= history_lo) & (q_idx < history_hi)
    q_cand = (q_idx >= candidate_lo) & (q_idx < candidate_hi)
    kv_hist = (kv_idx >= history_lo) & (kv_idx < history_hi)
    return (kv_hist & (q_hist | q_cand)) | (q_cand & (q_idx == kv_idx))


class BlockRanges(NamedTuple):
    """Up to two disjoint runs of block indices, in visiting order.

    Step ``s`` of ``total_steps`` visits block ``first_start + s`` while ``s <
    first_steps``, then ``second_start + (s - first_steps)``. No block appears twice.
    """

    first_start: jax.Array
    first_steps: jax.Array
    second_start: jax.Array
    second_steps: jax.Array

    @property
    def total_steps(self):
        return self.first_steps + self.second_steps

    def block_at(self, step):
        return jnp.where(
            step < self.first_steps,
            self.first_start + step,
            self.second_start + (step - self.first_steps),
        )


def _cdiv(a, b):
    return (a + (b - 1)) // b


def _merge_block_ranges(a0, a1, b0, b1) -> BlockRanges:
    """Union of block intervals ``[a0, a1)`` and ``[b0, b1)`` as <= 2 disjoint runs.

    Overlapping or touching intervals merge into one run, which is what keeps a block
    shared by the history range and a candidate range from being visited twice.
    """
    a_empty = a1 <= a0
    b_empty = b1 <= b0
    merge = (~a_empty) & (~b_empty) & (b0 <= a1) & (a0 <= b1)
    first_lo = jnp.where(a_empty, b0, jnp.where(merge, jnp.minimum(a0, b0), a0))
    first_hi = jnp.where(a_empty, b1, jnp.where(merge, jnp.maximum(a1, b1), a1))
    second_used = (~a_empty) & (~b_empty) & (~merge)
    zero = jnp.zeros_like(first_lo)
    return BlockRanges(
        first_start=jnp.maximum(first_lo, 0),
        first_steps=jnp.maximum(first_hi - first_lo, 0),
        second_start=jnp.where(second_used, b0, zero),
        second_steps=jnp.where(second_used, b1 - b0, zero),
    )


def _overlaps(lo, hi, seg_lo, seg_hi):
    return (lo < seg_hi) & (hi > seg_lo) & (seg_lo < seg_hi) & (lo < hi)


def ranker_kv_block_ranges(
    history_lo, history_hi, candidate_lo, candidate_hi, q_start, q_end, block_kv: int
) -> BlockRanges:
    """KV blocks (of ``block_kv`` keys) that query rows ``[q_start, q_end)`` must visit.

    History blocks are needed when the tile holds any history or candidate query; a
    candidate query also needs the block of its own position. The result is exactly the
    set of blocks holding at least one allowed (query, key) pair of the tile, each once.
    Arguments may be Python ints or int32 arrays (scalars inside kernels, or batched).
    """
    tile_attends = _overlaps(q_start, q_end, history_lo, history_hi) | _overlaps(
        q_start, q_end, candidate_lo, candidate_hi
    )
    need_hist = tile_attends & (history_lo < history_hi)
    h0 = jnp.where(need_hist, history_lo // block_kv, 0)
    h1 = jnp.where(need_hist, _cdiv(history_hi, block_kv), 0)
    self_lo = jnp.maximum(candidate_lo, q_start)
    self_hi = jnp.minimum(candidate_hi, q_end)
    has_self = self_lo < self_hi
    c0 = jnp.where(has_self, self_lo // block_kv, 0)
    c1 = jnp.where(has_self, _cdiv(self_hi, block_kv), 0)
    return _merge_block_ranges(h0, h1, c0, c1)


def ranker_q_block_ranges(
    history_lo, history_hi, candidate_lo, candidate_hi, kv_start, kv_end, block_q: int
) -> BlockRanges:
    """Query blocks (of ``block_q`` rows) that key rows ``[kv_start, kv_end)`` must visit.

    The transpose of ``ranker_kv_block_ranges``, for dK/dV kernels: history keys are read
    by every history and candidate query; a candidate key by its own query only.
    """
    tile_has_hist = _overlaps(kv_start, kv_end, history_lo, history_hi)
    h0 = jnp.where(tile_has_hist, history_lo // block_q, 0)
    h1 = jnp.where(tile_has_hist & (history_lo < history_hi), _cdiv(history_hi, block_q), 0)
    # Candidate queries: all of C if the tile holds history keys, else only C ∩ tile.
    c_lo = jnp.where(tile_has_hist, candidate_lo, jnp.maximum(candidate_lo, kv_start))
    c_hi = jnp.where(tile_has_hist, candidate_hi, jnp.minimum(candidate_hi, kv_end))
    has_c = c_lo < c_hi
    c0 = jnp.where(has_c, c_lo // block_q, 0)
    c1 = jnp.where(has_c, _cdiv(c_hi, block_q), 0)
    return _merge_block_ranges(h0, h1, c0, c1)


def overlap_len(lo, hi, seg_lo, seg_hi):
    """Length of ``[lo, hi) ∩ [seg_lo, seg_hi)`` (scalars or arrays; 0 when disjoint)."""
    return jnp.maximum(jnp.minimum(hi, seg_hi) - jnp.maximum(lo, seg_lo), 0)


def _clip_to_first_run(ranges: BlockRanges, ok, block_lo, block_hi):
    """Steps ``[lo, hi)`` of the first run of ``ranges`` whose block lies in
    ``[block_lo, block_hi)`` (empty unless ``ok``)."""
    ok = ok & (block_hi > block_lo)
    lo = jnp.where(ok, jnp.clip(block_lo - ranges.first_start, 0, ranges.first_steps), 0)
    hi = jnp.where(ok, jnp.clip(block_hi - ranges.first_start, lo, ranges.first_steps), 0)
    return lo, hi


def ranker_full_kv_steps(
    ranges: BlockRanges,
    history_lo,
    history_hi,
    candidate_lo,
    candidate_hi,
    q_start,
    q_end,
    block_kv: int,
):
    """Steps ``[lo, hi)`` of ``ranges`` whose KV block every row of ``[q_start, q_end)``
    may attend in full, so a kernel can skip the mask there.

    ``ranges`` are KV block ranges (``ranker_kv_block_ranges``) of a tile containing the
    rows (it may be larger: two warpgroups walk the steps of their shared tile). When
    every row is a history or candidate row, a block inside the history is fully allowed;
    those blocks are contiguous and lie in the first run. Any other block holds a key
    that some row of a multi-row tile may not see, so for ``q_end - q_start >= 2`` the
    result is every fully allowed step of the first run.
    """
    rows = q_end - q_start
    n_hist = overlap_len(q_start, q_end, history_lo, history_hi)
    n_cand = overlap_len(q_start, q_end, candidate_lo, candidate_hi)
    n_both = overlap_len(
        q_start, q_end, jnp.maximum(history_lo, candidate_lo), jnp.minimum(history_hi, candidate_hi)
    )
    rows_full = (rows > 0) & (n_hist + n_cand - n_both == rows)
    return _clip_to_first_run(
        ranges, rows_full, _cdiv(history_lo, block_kv), history_hi // block_kv
    )


def ranker_full_q_steps(
    ranges: BlockRanges,
    history_lo,
    history_hi,
    candidate_lo,
    candidate_hi,
    kv_start,
    kv_end,
    block_q: int,
):
    """Steps ``[lo, hi)`` of ``ranges`` whose query block may attend every key of
    ``[kv_start, kv_end)`` in full (the transpose of ``ranker_full_kv_steps``).

    ``ranges`` are query block ranges (``ranker_q_block_ranges``) of a key tile
    containing the keys. When every key is a history key, a query block is fully
    allowed iff each of its rows is a history or candidate row. The blocks counted are
    those inside the history, or inside history + candidates when the two touch (the
    ranker layouts), and they lie in the first run. When the segments touch or there
    are no candidates that is every fully allowed step of the first run; with a gap
    between them, blocks made only of candidate rows are left to the masked path.
    """
    keys_hist = (kv_end > kv_start) & (kv_start >= history_lo) & (kv_end <= history_hi)
    has_cand = candidate_lo < candidate_hi
    touch = has_cand & (candidate_lo <= history_hi) & (history_lo <= candidate_hi)
    rows_lo = jnp.where(touch, jnp.minimum(history_lo, candidate_lo), history_lo)
    rows_hi = jnp.where(touch, jnp.maximum(history_hi, candidate_hi), history_hi)
    return _clip_to_first_run(ranges, keys_hist, _cdiv(rows_lo, block_q), rows_hi // block_q)
