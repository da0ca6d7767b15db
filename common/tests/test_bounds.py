"""Segment bounds, the mask predicate, normalize_bounds and the checkify debug path."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

from attn_common import (
    SEGMENT_CANDIDATE,
    SEGMENT_HISTORY,
    SEGMENT_PADDING,
    SegmentBounds,
    check_bounds,
    normalize_bounds,
    ranker_mask,
)

# --------------------------------------------------------------------------------------
# oracle


def predicate(i, j, hl, hu, cl, cu) -> bool:
    """The mask predicate of docs/design.md#ranker-attention, literally, with Python ranges."""
    H = range(hl, hu)
    C = range(cl, cu)
    return (j in H and (i in H or i in C)) or (i in C and j == i)


def mask_brute(seq_len, bounds):
    return np.array(
        [[predicate(i, j, *bounds) for j in range(seq_len)] for i in range(seq_len)], bool
    )


# --------------------------------------------------------------------------------------
# ranker_mask


@settings(max_examples=tier_examples(150, quick=5), deadline=None)
@given(st.sampled_from([1, 5, 21]), st.data())
def test_ranker_mask_matches_predicate(seq_len, data):
    b = tuple(data.draw(st.integers(-3, seq_len + 3)) for _ in range(4))
    i = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    got = np.asarray(ranker_mask(jnp.asarray(i), jnp.asarray(j), *b))
    assert got.shape == (seq_len, seq_len)
    np.testing.assert_array_equal(got, mask_brute(seq_len, b))
    # numpy inputs work too (plain comparisons)
    np.testing.assert_array_equal(np.asarray(ranker_mask(i, j, *b)), got)


def test_ranker_mask_batched_bounds():
    rng = np.random.default_rng(0)
    seq_len, batch = 19, 12
    b = rng.integers(0, seq_len + 1, size=(batch, 4)).astype(np.int32)
    i = jnp.arange(seq_len)[None, :, None]
    j = jnp.arange(seq_len)[None, None, :]
    cols = [jnp.asarray(b[:, c])[:, None, None] for c in range(4)]
    got = np.asarray(ranker_mask(i, j, *cols))
    assert got.shape == (batch, seq_len, seq_len)
    for r in range(batch):
        np.testing.assert_array_equal(got[r], mask_brute(seq_len, tuple(b[r])))


def test_ranker_mask_known_layout():
    # H = [0, 3), C = [3, 5), padding [5, 6)
    m = np.asarray(ranker_mask(jnp.arange(6)[:, None], jnp.arange(6)[None, :], 0, 3, 3, 5))
    expected = np.array(
        [
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 1, 0],
            [0, 0, 0, 0, 0, 0],
        ],
        bool,
    )
    np.testing.assert_array_equal(m, expected)


def test_ranker_mask_inside_jit():
    f = jax.jit(lambda b: ranker_mask(jnp.arange(10)[:, None], jnp.arange(10)[None, :], *b))
    for b in [(0, 4, 4, 8), (2, 6, 4, 9), (5, 5, 0, 10), (7, 3, 9, 2)]:
        got = np.asarray(f(tuple(jnp.int32(x) for x in b)))
        np.testing.assert_array_equal(got, mask_brute(10, b))


# --------------------------------------------------------------------------------------
# normalize_bounds


def normalize_np(raw, seq_len):
    raw = np.clip(np.asarray(raw, np.int64), 0, seq_len)
    hl, hu, cl, cu = raw.T
    return np.stack([hl, np.maximum(hu, hl), cl, np.maximum(cu, cl)], axis=-1)


@settings(max_examples=tier_examples(100, quick=5), deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 5),
    st.data(),
)
def test_normalize_bounds_clip_and_inverted(seq_len, batch, data):
    raw = np.array(
        data.draw(
            st.lists(
                st.lists(st.integers(-100, 100), min_size=4, max_size=4),
                min_size=batch,
                max_size=batch,
            )
        ),
        np.int32,
    )
    got = np.asarray(normalize_bounds(raw, batch=batch, seq_len=seq_len))
    assert got.dtype == np.int32 and got.shape == (batch, 4)
    np.testing.assert_array_equal(got, normalize_np(raw, seq_len))
    assert ((got >= 0) & (got <= seq_len)).all()
    assert (got[:, 0] <= got[:, 1]).all() and (got[:, 2] <= got[:, 3]).all()
    # normalizing keeps the meaning: same mask over the sequence positions
    for r in range(batch):
        np.testing.assert_array_equal(
            mask_brute(seq_len, tuple(int(x) for x in raw[r])),
            mask_brute(seq_len, tuple(int(x) for x in got[r])),
        )


def test_normalize_bounds_examples():
    got = normalize_bounds(np.array([[-5, 20, 3, 1]], np.int32), batch=1, seq_len=10)
    np.testing.assert_array_equal(np.asarray(got), [[0, 10, 3, 3]])
    got = normalize_bounds([[4, 2, 12, 11]], batch=1, seq_len=10)
    np.testing.assert_array_equal(np.asarray(got), [[4, 4, 10, 10]])


@pytest.mark.parametrize("form", ["flat", "one_row", "python_list", "segment_bounds"])
def test_normalize_bounds_broadcast(form):
    row = [1, 6, 6, 9]
    bounds = {
        "flat": np.array(row, np.int32),
        "one_row": jnp.array([row], jnp.int32),
        "python_list": row,
        "segment_bounds": SegmentBounds.from_array(np.array([row])),
    }[form]
    got = np.asarray(normalize_bounds(bounds, batch=3, seq_len=8))
    np.testing.assert_array_equal(got, np.array([[1, 6, 6, 8]] * 3))


def test_normalize_bounds_int_dtypes():
    for dt in (np.int8, np.int16, np.int64, np.uint8):
        got = normalize_bounds(np.array([[1, 3, 3, 5]], dt), batch=2, seq_len=8)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), [[1, 3, 3, 5]] * 2)


@pytest.mark.parametrize(
    "bounds, exc",
    [
        (np.zeros((3, 4), np.int32), ValueError),  # wrong row count (batch 2)
        (np.zeros((2, 5), np.int32), ValueError),  # wrong width
        (np.zeros((3,), np.int32), ValueError),  # [3] is not [4]
        (np.zeros((2, 2, 4), np.int32), NotImplementedError),  # packed, U = 2
        (np.zeros((2, 2, 5), np.int32), ValueError),  # rank 3, not [B, U, 4]
        (np.zeros((), np.int32), ValueError),  # rank 0
        (np.zeros((2, 4), np.float32), TypeError),  # float dtype
        (np.zeros((2, 4), bool), TypeError),  # bool dtype
        (True, TypeError),
        (SegmentBounds.from_array(np.zeros((3, 4), np.int32)), ValueError),
    ],
)
def test_normalize_bounds_rejects(bounds, exc):
    with pytest.raises(exc, match="bounds"):
        normalize_bounds(bounds, batch=2, seq_len=8)


def test_normalize_bounds_one_user_packed():
    """``[B, 1, 4]`` is ``[B, 4]``; U > 1 is refused here (attn_common.packed takes it)."""
    raw = np.array([[[-1, 4, 4, 12]], [[3, 2, 5, 7]]], np.int32)
    got = normalize_bounds(raw, batch=2, seq_len=10)
    np.testing.assert_array_equal(np.asarray(got), normalize_np(raw[:, 0], 10))
    err, _ = _checked(10)(jnp.asarray(raw))
    assert "first bad row 0" in err.get()
    with pytest.raises(NotImplementedError, match="U = 3 users per row"):
        check_bounds(np.zeros((2, 3, 4), np.int32), seq_len=10)


def test_normalize_bounds_traced():
    f = jax.jit(lambda b: normalize_bounds(b, batch=3, seq_len=10))
    raw = np.array([[-1, 4, 4, 12], [3, 2, 5, 7], [0, 0, 0, 0]], np.int32)
    np.testing.assert_array_equal(np.asarray(f(raw)), normalize_np(raw, 10))
    g = jax.jit(lambda sb: normalize_bounds(sb, batch=3, seq_len=10))
    np.testing.assert_array_equal(
        np.asarray(g(SegmentBounds.from_array(raw))), normalize_np(raw, 10)
    )


# --------------------------------------------------------------------------------------
# check_bounds (checkify)


def _checked(seq_len):
    def f(b):
        check_bounds(b, seq_len=seq_len)
        return jnp.int32(0)

    return checkify.checkify(f)


@pytest.mark.parametrize(
    "bounds",
    [[[0, 4, 4, 8]], [[0, 0, 0, 0]], [[8, 8, 8, 8]], [[2, 5, 0, 8], [0, 8, 3, 3]], [1, 2, 3, 4]],
)
def test_check_bounds_passes_in_range(bounds):
    err, _ = _checked(8)(jnp.asarray(bounds, jnp.int32))
    assert err.get() is None


@pytest.mark.parametrize(
    "bounds, bad_row",
    [
        ([[0, 9, 4, 8]], 0),  # hi > S
        ([[-1, 4, 4, 8]], 0),  # lo < 0
        ([[0, 4, 6, 5]], 0),  # inverted candidates
        ([[0, 4, 4, 8], [5, 3, 0, 0]], 1),  # inverted history in row 1
        ([[0, 4, 4, 8], [0, 4, 4, 8], [0, 4, 4, 100]], 2),
    ],
)
def test_check_bounds_flags_out_of_range(bounds, bad_row):
    err, _ = _checked(8)(jnp.asarray(bounds, jnp.int32))
    msg = err.get()
    assert msg is not None
    assert "bounds out of range" in msg
    assert f"first bad row {bad_row}" in msg
    with pytest.raises(checkify.JaxRuntimeError):
        err.throw()


def test_check_bounds_under_jit_and_segment_bounds():
    f = checkify.checkify(jax.jit(lambda sb: (check_bounds(sb, seq_len=6), sb.as_array())[1]))
    ok = SegmentBounds.from_array(np.array([[0, 3, 3, 6]], np.int32))
    bad = SegmentBounds.from_array(np.array([[0, 3, 3, 7]], np.int32))
    assert f(ok)[0].get() is None
    assert f(bad)[0].get() is not None


@settings(max_examples=tier_examples(40), deadline=None)
@given(st.lists(st.lists(st.integers(-3, 12), min_size=4, max_size=4), min_size=2, max_size=2))
def test_check_bounds_random(rows):
    arr = np.array(rows, np.int32)
    seq_len = 9
    lo, hi = arr[:, 0::2], arr[:, 1::2]
    ok_rows = ((lo >= 0) & (lo <= hi) & (hi <= seq_len)).all(axis=1)
    err, _ = _checked(seq_len)(jnp.asarray(arr))
    if ok_rows.all():
        assert err.get() is None
    else:
        msg = err.get()
        assert msg is not None and f"first bad row {int(np.argmin(ok_rows))}" in msg


# --------------------------------------------------------------------------------------
# SegmentBounds


@st.composite
def segment_rows(draw, seq_len):
    """A contiguous layout: pieces [pad, hist, pad, cand, pad] in a random order."""
    pieces = [SEGMENT_PADDING, SEGMENT_HISTORY, SEGMENT_PADDING, SEGMENT_CANDIDATE]
    pieces = draw(st.permutations(pieces))
    cuts = sorted(draw(st.lists(st.integers(0, seq_len), min_size=3, max_size=3)))
    lengths = np.diff([0, *cuts, seq_len])
    row = np.concatenate([np.full(n, p, np.int32) for p, n in zip(pieces, lengths, strict=True)])
    assert row.shape == (seq_len,)
    return row


def bounds_from_ids_brute(ids):
    out = []
    for row in ids:
        rec = []
        for seg in (SEGMENT_HISTORY, SEGMENT_CANDIDATE):
            pos = [t for t, x in enumerate(row) if x == seg]
            rec += [pos[0], pos[-1] + 1] if pos else [0, 0]
        out.append(rec)
    return np.array(out, np.int64).reshape(len(ids), 4)


@settings(max_examples=tier_examples(80, quick=5), deadline=None)
@given(st.sampled_from([1, 4]), st.sampled_from([1, 2, 9, 30]), st.data())
def test_from_segment_ids_matches_brute_force(batch, seq_len, data):
    ids = np.stack([data.draw(segment_rows(seq_len)) for _ in range(batch)])
    sb = SegmentBounds.from_segment_ids(ids)
    assert sb.batch == batch
    got = np.asarray(sb.as_array())
    assert got.dtype == np.int32 and got.shape == (batch, 4)
    np.testing.assert_array_equal(got, bounds_from_ids_brute(ids))
    for f in (sb.history_lo, sb.history_hi, sb.candidate_lo, sb.candidate_hi):
        assert f.dtype == jnp.int32 and f.shape == (batch,)


def test_from_segment_ids_examples():
    ids = np.array(
        [
            [1, 1, 1, 2, 2, 0],  # history then candidates, padding
            [0, 0, 0, 0, 0, 0],  # all padding -> empty segments
            [2, 2, 0, 1, 1, 1],  # candidates first, gap
            [1, 1, 1, 1, 1, 1],  # no candidates
            [0, 2, 0, 0, 0, 0],  # no history
        ]
    )
    got = np.asarray(SegmentBounds.from_segment_ids(ids).as_array())
    np.testing.assert_array_equal(
        got, [[0, 3, 3, 5], [0, 0, 0, 0], [3, 6, 0, 2], [0, 6, 0, 0], [0, 0, 1, 2]]
    )


@settings(max_examples=tier_examples(40), deadline=None)
@given(st.sampled_from([3, 12]), st.integers(0, 3), st.sampled_from([1, 2]), st.data())
def test_from_segment_ids_non_contiguous_raises(seq_len, bad_row, seg, data):
    # rows before bad_row are valid layouts; bad_row has seg at a and c, not at b
    rows = [data.draw(segment_rows(seq_len)) for _ in range(bad_row)]
    a = data.draw(st.integers(0, seq_len - 3))
    b = data.draw(st.integers(a + 1, seq_len - 2))
    c = data.draw(st.integers(b + 1, seq_len - 1))
    row = np.zeros(seq_len, np.int32)
    row[a] = row[c] = seg
    row[b] = data.draw(st.sampled_from([x for x in (0, 1, 2) if x != seg]))
    rows.append(row)
    rows += [np.zeros(seq_len, np.int32)] * (3 - bad_row)
    with pytest.raises(ValueError, match=f"segment_ids: segment {seg} of row {bad_row}"):
        SegmentBounds.from_segment_ids(np.stack(rows))


@pytest.mark.parametrize("bad", [3, -1, 7])
def test_from_segment_ids_invalid_value(bad):
    ids = np.array([[1, 1, 2, 0], [1, 2, bad, 0]])
    with pytest.raises(ValueError, match=f"segment_ids: found value {bad}"):
        SegmentBounds.from_segment_ids(ids)


def test_from_segment_ids_bad_form():
    with pytest.raises(ValueError, match="segment_ids"):
        SegmentBounds.from_segment_ids(np.array([1, 1, 2]))
    with pytest.raises(TypeError, match="segment_ids"):
        SegmentBounds.from_segment_ids(np.array([[1.0, 2.0]]))


def test_from_segment_ids_under_jit():
    ids = np.array([[0, 1, 1, 2, 2, 2, 0], [2, 1, 1, 1, 0, 0, 0]], np.int32)
    got = jax.jit(lambda x: SegmentBounds.from_segment_ids(x).as_array())(ids)
    np.testing.assert_array_equal(np.asarray(got), bounds_from_ids_brute(ids))


@settings(max_examples=tier_examples(40), deadline=None)
@given(
    st.one_of(st.integers(0, 50), st.lists(st.integers(0, 50), min_size=3, max_size=3)),
    st.one_of(st.integers(0, 50), st.lists(st.integers(0, 50), min_size=3, max_size=3)),
    st.one_of(st.integers(0, 50), st.lists(st.integers(0, 50), min_size=3, max_size=3)),
)
def test_from_lengths(h, c, s):
    sb = SegmentBounds.from_lengths(h, c, s)
    hb, cb, sbb = np.broadcast_arrays(np.atleast_1d(h), np.atleast_1d(c), np.atleast_1d(s))
    expected = np.stack([sbb, sbb + hb, sbb + hb, sbb + hb + cb], axis=1)
    got = np.asarray(sb.as_array())
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)
    assert sb.batch == expected.shape[0]


def test_from_lengths_scalar_default_start():
    got = np.asarray(SegmentBounds.from_lengths(5, 3).as_array())
    np.testing.assert_array_equal(got, [[0, 5, 5, 8]])


@pytest.mark.parametrize(
    "kwargs, name, exc",
    [
        (dict(history_len=-1, candidate_len=2), "history_len", ValueError),
        (dict(history_len=[3, -2], candidate_len=2), "history_len", ValueError),
        (dict(history_len=3, candidate_len=[1, -1]), "candidate_len", ValueError),
        (dict(history_len=3, candidate_len=1, history_start=-4), "history_start", ValueError),
        (dict(history_len=[[3]], candidate_len=1), "history_len", ValueError),
        (dict(history_len=3.0, candidate_len=1), "history_len", TypeError),
        (dict(history_len=True, candidate_len=1), "history_len", TypeError),
    ],
)
def test_from_lengths_rejects(kwargs, name, exc):
    with pytest.raises(exc, match=name):
        SegmentBounds.from_lengths(**kwargs)


def test_from_lengths_traced():
    f = jax.jit(lambda h, c: SegmentBounds.from_lengths(h, c, 2).as_array())
    got = f(jnp.array([1, 4], jnp.int32), jnp.array([3, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), [[2, 3, 3, 6], [2, 6, 6, 6]])


def test_from_array_shapes():
    sb = SegmentBounds.from_array([1, 2, 3, 4])
    assert sb.batch == 1
    np.testing.assert_array_equal(np.asarray(sb.as_array()), [[1, 2, 3, 4]])
    arr = np.arange(12, dtype=np.int64).reshape(3, 4)
    sb = SegmentBounds.from_array(arr)
    assert sb.batch == 3
    np.testing.assert_array_equal(np.asarray(sb.history_lo), arr[:, 0])
    np.testing.assert_array_equal(np.asarray(sb.history_hi), arr[:, 1])
    np.testing.assert_array_equal(np.asarray(sb.candidate_lo), arr[:, 2])
    np.testing.assert_array_equal(np.asarray(sb.candidate_hi), arr[:, 3])
    assert sb.as_array().dtype == jnp.int32
    for bad in (
        np.zeros((3, 3), np.int32),
        np.zeros((5,), np.int32),
        np.zeros((1, 1, 4), np.int32),
    ):
        with pytest.raises(ValueError, match="bounds"):
            SegmentBounds.from_array(bad)
    with pytest.raises(TypeError, match="bounds"):
        SegmentBounds.from_array(np.zeros((1, 4), np.float32))


def test_segment_bounds_is_a_pytree():
    sb = SegmentBounds.from_array(np.array([[0, 3, 3, 5], [1, 2, 4, 6]], np.int32))
    leaves = jax.tree_util.tree_leaves(sb)
    assert len(leaves) == 4
    doubled = jax.tree_util.tree_map(lambda x: x * 2, sb)
    assert isinstance(doubled, SegmentBounds)
    np.testing.assert_array_equal(np.asarray(doubled.candidate_hi), [10, 12])

    @jax.jit
    def shift(b: SegmentBounds) -> SegmentBounds:
        return SegmentBounds(b.history_lo + 1, b.history_hi + 1, b.candidate_lo, b.candidate_hi)

    out = shift(sb)
    assert isinstance(out, SegmentBounds)
    np.testing.assert_array_equal(np.asarray(out.as_array()), [[1, 4, 3, 5], [2, 3, 4, 6]])
    with pytest.raises(dataclasses.FrozenInstanceError):
        sb.history_lo = jnp.zeros(2, jnp.int32)
