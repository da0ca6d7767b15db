"""Packed bounds ``[B, U, 4]``: normalization, the mask, the overlap rule and block runs.

Every block-run property is checked against brute-force pair enumeration over a mask
written here with plain numpy (the OR over users of the one-user predicate), and the
``U = 1`` case against the existing one-user functions.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import property_settings, tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

from attn_common import SegmentBounds, normalize_bounds
from attn_common.bounds import (
    ranker_full_kv_steps,
    ranker_full_q_steps,
    ranker_kv_block_ranges,
    ranker_q_block_ranges,
)
from attn_common.packed import (
    PackedBlockRanges,
    check_packed_bounds,
    normalize_packed_bounds,
    packed_full_kv_steps,
    packed_full_q_steps,
    packed_key_table,
    packed_kv_block_ranges,
    packed_q_block_ranges,
    packed_query_table,
    packed_runs_per_tile,
    ranker_mask_from_key_table,
    ranker_mask_from_query_table,
    ranker_mask_packed,
    validate_packed_bounds,
)

BLOCKS = (4, 8, 16, 32)


SETTINGS = settings(property_settings(150), max_examples=tier_examples(150, quick=3))


def _cdiv(a, b):
    return -(-a // b)


def allowed_np(seq_len, users) -> np.ndarray:
    """``[S, S]``: OR over users of the one-user predicate, with Python ranges."""
    out = np.zeros((seq_len, seq_len), bool)
    i = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    for hl, hu, cl, cu in users:
        q_h = (hl <= i) & (i < hu)
        q_c = (cl <= i) & (i < cu)
        k_h = (hl <= j) & (j < hu)
        out |= (k_h & (q_h | q_c)) | (q_c & (i == j))
    return out


def disjoint(users) -> bool:
    segs = [[(lo, hi) for lo, hi in ((u[0], u[1]), (u[2], u[3])) if lo < hi] for u in users]
    for a in range(len(users)):
        for b in range(a + 1, len(users)):
            for lo1, hi1 in segs[a]:
                for lo2, hi2 in segs[b]:
                    if lo1 < hi2 and lo2 < hi1:
                        return False
    return True


def visited(r: PackedBlockRanges) -> list[int]:
    """Blocks in visiting order, from the run fields (``block_at`` is checked apart)."""
    starts, steps = np.asarray(r.starts), np.asarray(r.steps)
    return [int(a) + k for a, n in zip(starts, steps, strict=True) for k in range(int(n))]


# jit once per (U, block): hypothesis examples then run without eager op dispatch
_kv = jax.jit(packed_kv_block_ranges, static_argnums=3)
_q = jax.jit(packed_q_block_ranges, static_argnums=3)
_full_kv = jax.jit(packed_full_kv_steps, static_argnums=4)
_full_q = jax.jit(packed_full_q_steps, static_argnums=4)


def check_runs(r: PackedBlockRanges, num_users: int):
    starts, steps = np.asarray(r.starts), np.asarray(r.steps)
    assert starts.shape == steps.shape == (packed_runs_per_tile(num_users),)
    assert (starts >= 0).all() and (steps >= 0).all()
    used = steps > 0
    n = int(used.sum())
    assert used[:n].all() and not used[n:].any(), "empty runs must come last"
    assert (starts[~used] == 0).all()
    for a in range(n - 1):  # sorted, disjoint, non-adjacent
        assert starts[a] + steps[a] < starts[a + 1], (starts, steps)


def check_visit(blocks, expected, n_blocks):
    assert len(blocks) == len(set(blocks)), f"block visited twice: {blocks}"
    assert set(blocks) == expected, f"visited {sorted(blocks)}, expected {sorted(expected)}"
    assert all(0 <= b < n_blocks for b in blocks)


# --------------------------------------------------------------------------------------
# strategies


@st.composite
def packed_rows(draw, seq_len, max_users=4):
    """Users laid out like the packer (in order, gaps and padding), or anywhere."""
    num_users = draw(st.integers(1, max_users))
    if draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, seq_len), min_size=4 * num_users,
                                    max_size=4 * num_users)))  # fmt: skip
        users = []
        for u in range(num_users):
            a, b, c, d = cuts[4 * u : 4 * u + 4]
            kind = draw(st.sampled_from(["hc", "h_gap_c", "c_first", "empty", "overlap"]))
            if kind == "hc":
                users.append((a, c, c, d))
            elif kind == "h_gap_c":
                users.append((a, b, c, d))
            elif kind == "c_first":
                users.append((c, d, a, b))
            elif kind == "overlap":
                users.append((a, c, b, d))  # a user's own H and C may overlap
            else:
                users.append((0, 0, 0, 0))
        perm = draw(st.permutations(range(num_users)))
        users = [users[p] for p in perm]
    else:
        pos = st.integers(0, seq_len)
        users = [tuple(draw(pos) for _ in range(4)) for _ in range(num_users)]
        users = [(min(a, b), max(a, b), min(c, d), max(c, d)) for a, b, c, d in users]
    return users


@st.composite
def problems(draw):
    seq_len = draw(st.integers(1, 200))
    block = draw(st.sampled_from(BLOCKS))
    users = draw(packed_rows(seq_len))
    if draw(st.booleans()):
        tile = draw(st.sampled_from(BLOCKS)) * draw(st.sampled_from([1, 2, 4]))
        t = draw(st.integers(0, _cdiv(seq_len, tile) - 1))
        start, end = t * tile, (t + 1) * tile
    else:
        start = draw(st.integers(0, seq_len - 1))
        end = draw(st.integers(start + 1, seq_len + block))
    return seq_len, block, users, start, end


# --------------------------------------------------------------------------------------
# block runs against brute force


@pytest.mark.parametrize("steps, axis", [(_kv, 0), (_q, 1)], ids=["kv", "q"])
@SETTINGS
@given(problems())
def test_runs_match_brute_force(steps, axis, p):
    """kv: the key blocks a query range ``[s, e)`` visits; q: the query blocks a key
    range visits; each against the dense mask."""
    seq_len, block, users, s, e = p
    r = steps(np.asarray(users, np.int32), s, e, block)
    check_runs(r, len(users))
    allowed = allowed_np(seq_len, users)
    span = slice(s, min(e, seq_len))
    sub = allowed[span] if axis == 0 else allowed[:, span]
    expected = set((np.nonzero(sub.any(axis=axis))[0] // block).tolist())
    check_visit(visited(r), expected, _cdiv(seq_len, block))


def _check_full(r, lo, hi, full_block, *, complete):
    lo, hi = int(lo), int(hi)
    total = int(r.total_steps)
    assert 0 <= lo <= hi <= total, (lo, hi, total)
    for s, block in enumerate(visited(r)):
        full = full_block(block)
        if lo <= s < hi:
            assert full, f"step {s} (block {block}) is not fully allowed"
        elif complete:
            assert not full, f"step {s} (block {block}) is fully allowed"


@st.composite
def full_problems(draw):
    """Tile + a sub-tile of it (a warpgroup's rows), as in test_full_block_steps."""
    seq_len = draw(st.integers(2, 200))
    block = draw(st.sampled_from(BLOCKS))
    users = draw(packed_rows(seq_len))
    tile = draw(st.sampled_from(BLOCKS)) * 2
    t = draw(st.integers(0, _cdiv(seq_len, tile) - 1))
    start, end = t * tile, (t + 1) * tile
    half = draw(st.sampled_from([None, 0, 1]))
    sub = (
        (start, end) if half is None else (start + half * tile // 2, start + (half + 1) * tile // 2)
    )
    return seq_len, block, users, (start, end), sub


def _full_steps(p, steps, full):
    """``(allowed, r, lo, hi)`` for a ``full_problems`` draw: the dense mask, the tile's
    steps ``steps(bounds, start, end, block)`` and the fully allowed ones of the sub-range
    ``full(r, bounds, lo, hi, block)``."""
    seq_len, block, users, (ts, te), (s0, s1) = p
    n = max(te, _cdiv(seq_len, block) * block) + block
    b = np.asarray(users, np.int32)
    r = steps(b, ts, te, block)
    return allowed_np(n, users), r, *full(r, b, s0, s1, block)


@SETTINGS
@given(full_problems())
def test_full_kv_steps_sound_and_complete(p):
    _, block, users, _, (rs, re) = p
    allowed, r, lo, hi = _full_steps(p, _kv, _full_kv)
    _check_full(
        r, lo, hi, lambda k: allowed[rs:re, k * block : (k + 1) * block].all(),
        complete=disjoint(users) and re - rs >= 2,
    )  # fmt: skip


@SETTINGS
@given(full_problems())
def test_full_q_steps_sound_and_complete(p):
    _, block, users, _, (ks, ke) = p
    allowed, r, lo, hi = _full_steps(p, _q, _full_q)
    # complete (as for one user) when each user's segments touch or it has no candidates
    layouts = all(cl >= cu or (cl <= hu and hl <= cu) for hl, hu, cl, cu in users)
    _check_full(
        r, lo, hi, lambda k: allowed[k * block : (k + 1) * block, ks:ke].all(),
        complete=disjoint(users) and layouts,
    )  # fmt: skip


def test_two_u_runs_is_reached():
    """The bound R = 2U is tight: U users, each H and C a gap apart, gaps between users."""
    users = np.asarray([[0, 4, 8, 12], [16, 20, 24, 28], [32, 36, 40, 44]], np.int32)
    r = packed_kv_block_ranges(users, 0, 48, 4)
    assert int((np.asarray(r.steps) > 0).sum()) == 6 == packed_runs_per_tile(3)
    assert visited(r) == [0, 2, 4, 6, 8, 10]
    r = packed_q_block_ranges(users, 0, 48, 4)
    assert int((np.asarray(r.steps) > 0).sum()) == 6


def test_shared_block_between_users_visited_once():
    # user 0 ends at 10, user 1 starts at 10: both live in KV block 0 of 16 keys
    users = np.asarray([[0, 6, 6, 10], [10, 14, 14, 30]], np.int32)
    r = packed_kv_block_ranges(users, 0, 32, 16)
    assert visited(r) == [0, 1]
    allowed = allowed_np(32, users.tolist())
    counted = sum(int(allowed[:, k * 16 : (k + 1) * 16].sum()) for k in visited(r))
    assert counted == int(allowed.sum())


def test_no_work():
    zero = np.zeros((3, 4), np.int32)
    assert int(packed_kv_block_ranges(zero, 0, 64, 16).total_steps) == 0
    assert int(packed_q_block_ranges(zero, 0, 64, 16).total_steps) == 0
    users = np.asarray([[0, 10, 10, 20], [40, 50, 50, 60]], np.int32)
    assert int(packed_kv_block_ranges(users, 24, 36, 4).total_steps) == 0  # gap tile
    assert int(packed_kv_block_ranges(users, 5, 5, 4).total_steps) == 0  # empty tile


# --------------------------------------------------------------------------------------
# U = 1 agrees with the one-user functions


_legacy_kv = jax.jit(ranker_kv_block_ranges, static_argnums=6)
_legacy_q = jax.jit(ranker_q_block_ranges, static_argnums=6)
_legacy_full_kv = jax.jit(ranker_full_kv_steps, static_argnums=7)
_legacy_full_q = jax.jit(ranker_full_q_steps, static_argnums=7)


# ~4 s on 2 cores: U = 1 is among the draws of the brute-force tests above (runs and
# full steps), which check it quickly.
@pytest.mark.slow
@SETTINGS
@given(problems())
def test_one_user_agrees_with_ranker_block_ranges(p):
    _, block, users, qs, qe = p
    bounds = users[0]
    b = np.asarray([bounds], np.int32)
    for packed, legacy, full_packed, full_legacy in (
        (_kv, _legacy_kv, _full_kv, _legacy_full_kv),
        (_q, _legacy_q, _full_q, _legacy_full_q),
    ):
        r = packed(b, qs, qe, block)
        old = legacy(*bounds, qs, qe, block)
        first, second = int(old.first_steps), int(old.second_steps)
        old_blocks = [int(old.first_start) + k for k in range(first)]
        old_blocks += [int(old.second_start) + k for k in range(second)]
        new_blocks = visited(r)
        assert sorted(new_blocks) == sorted(old_blocks)
        lo, hi = full_packed(r, b, qs, qe, block)
        olo, ohi = full_legacy(old, *bounds, qs, qe, block)
        assert set(new_blocks[int(lo) : int(hi)]) == set(old_blocks[int(olo) : int(ohi)])


# --------------------------------------------------------------------------------------
# batched, jit, kernel-style scalar use


# q in the full tier (~3.5 s on 2 cores): batching under jit is checked quickly by kv, the
# query-block runs and full steps by test_runs_match_brute_force[q] and
# test_full_q_steps_sound_and_complete.
@pytest.mark.parametrize("which", ["kv", pytest.param("q", marks=pytest.mark.slow)])
def test_batched_tables_under_jit(which):
    rng = np.random.default_rng(5)
    seq_len, batch, users, block, tile = 150, 6, 3, 8, 16
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.integers(0, seq_len + 1, size=4 * users)).reshape(users, 4)
        rows.append(cuts[rng.permutation(users)])
    bounds = np.asarray(rows, np.int32)  # [B, U, 4], disjoint users in random slot order
    fn = packed_kv_block_ranges if which == "kv" else packed_q_block_ranges
    full = packed_full_kv_steps if which == "kv" else packed_full_q_steps
    t0 = jnp.arange(_cdiv(seq_len, tile), dtype=jnp.int32)[None] * tile

    @jax.jit
    def tables(b):
        r = fn(b[:, None], t0, t0 + tile, block)
        lo, hi = full(r, b[:, None], t0, t0 + tile, block)
        return r, lo, hi

    r, lo, hi = tables(jnp.asarray(bounds))
    assert r.starts.shape == (batch, t0.shape[1], 2 * users)
    # the tables on the host, and the one-tile full steps jitted once: the loop below
    # then runs no eager op per table entry (only block_at's)
    starts, steps, lo, hi = (np.asarray(x) for x in (r.starts, r.steps, lo, hi))
    want = _full_kv if which == "kv" else _full_q
    for b in range(batch):
        allowed = allowed_np(seq_len, bounds[b].tolist())
        for t in range(t0.shape[1]):
            one = PackedBlockRanges(starts[b, t], steps[b, t])
            assert [int(one.block_at(s)) for s in range(int(one.total_steps))] == visited(one)
            s0, s1 = t * tile, (t + 1) * tile
            part = allowed[s0:s1] if which == "kv" else allowed[:, s0:s1].T
            expected = set((np.nonzero(part.any(axis=0))[0] // block).tolist())
            check_visit(visited(one), expected, _cdiv(seq_len, block))
            w_lo, w_hi = want(one, bounds[b], s0, s1, block)
            assert (int(lo[b, t]), int(hi[b, t])) == (int(w_lo), int(w_hi))


def test_block_at_with_traced_scalars_in_loop():
    users = np.asarray([[0, 5, 20, 23], [40, 60, 60, 70], [90, 95, 95, 96]], np.int32)

    @jax.jit
    def counts(b):
        r = packed_kv_block_ranges(b, 0, 100, 8)
        return jax.lax.fori_loop(
            0, r.total_steps, lambda s, acc: acc.at[r.block_at(s)].add(1), jnp.zeros(13, jnp.int32)
        )

    got = np.asarray(counts(jnp.asarray(users)))
    expected = set((np.nonzero(allowed_np(100, users.tolist()).any(axis=0))[0] // 8).tolist())
    assert got.max() == 1 and set(np.nonzero(got)[0].tolist()) == expected


# --------------------------------------------------------------------------------------
# normalization, mask, overlap rule


@settings(max_examples=tier_examples(80, quick=3), deadline=None)
@given(st.integers(1, 30), st.integers(1, 3), st.integers(1, 4), st.data())
def test_normalize_packed(seq_len, batch, num_users, data):
    raw = np.asarray(
        data.draw(
            st.lists(
                st.integers(-40, 60), min_size=batch * num_users * 4, max_size=batch * num_users * 4
            )
        ),
        np.int32,
    ).reshape(batch, num_users, 4)
    got = np.asarray(normalize_packed_bounds(raw, batch=batch, seq_len=seq_len))
    assert got.dtype == np.int32 and got.shape == (batch, num_users, 4)
    assert ((got >= 0) & (got <= seq_len)).all()
    lo, hi = got[..., 0::2], got[..., 1::2]
    assert ((lo < hi) | ((lo == 0) & (hi == 0))).all(), "empty segments are (0, 0)"
    for b in range(batch):
        np.testing.assert_array_equal(
            allowed_np(seq_len, raw[b].tolist()), allowed_np(seq_len, got[b].tolist())
        )
    if num_users == 1:  # same mask as the one-user normalize_bounds
        old = np.asarray(normalize_bounds(raw[:, 0], batch=batch, seq_len=seq_len))
        for b in range(batch):
            np.testing.assert_array_equal(
                allowed_np(seq_len, [old[b].tolist()]), allowed_np(seq_len, got[b].tolist())
            )


@pytest.mark.parametrize(
    "bounds, shape",
    [
        ([1, 6, 6, 9], (3, 1, 4)),
        ([[1, 6, 6, 9]], (3, 1, 4)),
        ([[[1, 6, 6, 9], [0, 0, 0, 0]]], (3, 2, 4)),
        (SegmentBounds.from_array([[1, 6, 6, 9]] * 3), (3, 1, 4)),
    ],
)
def test_normalize_packed_forms(bounds, shape):
    got = normalize_packed_bounds(bounds, batch=3, seq_len=8)
    assert got.shape == shape
    np.testing.assert_array_equal(np.asarray(got)[:, 0], [[1, 6, 6, 8]] * 3)


@pytest.mark.parametrize(
    "bounds, exc",
    [
        (np.zeros((3, 2, 4), np.int32), ValueError),  # 3 rows for batch 2
        (np.zeros((2, 2, 5), np.int32), ValueError),
        (np.zeros((2, 0, 4), np.int32), ValueError),
        (np.zeros((2, 2, 2, 4), np.int32), ValueError),
        (np.zeros((2, 2, 4), np.float32), TypeError),
    ],
)
def test_normalize_packed_rejects(bounds, exc):
    with pytest.raises(exc, match="bounds"):
        normalize_packed_bounds(bounds, batch=2, seq_len=8)


_mask = jax.jit(ranker_mask_packed)


@settings(max_examples=tier_examples(60, quick=3), deadline=None)
@given(st.sampled_from([1, 7, 24]), st.data())
def test_mask_packed_matches_brute_force(seq_len, data):
    users = data.draw(packed_rows(seq_len))
    b = np.asarray(users, np.int32)
    i, j = np.arange(seq_len)[:, None], np.arange(seq_len)[None, :]
    got = np.asarray(_mask(jnp.asarray(i), jnp.asarray(j), b))
    np.testing.assert_array_equal(got, allowed_np(seq_len, users))


def test_mask_packed_batched_broadcast():
    bounds = np.asarray(
        [[[0, 3, 3, 5], [6, 8, 8, 9]], [[2, 4, 0, 1], [0, 0, 0, 0]]], np.int32
    )  # [B=2, U=2, 4]
    s = 10
    got = np.asarray(
        ranker_mask_packed(
            jnp.arange(s)[None, :, None], jnp.arange(s)[None, None, :], bounds[:, None, None]
        )
    )
    assert got.shape == (2, s, s)
    for b in range(2):
        np.testing.assert_array_equal(got[b], allowed_np(s, bounds[b].tolist()))


@pytest.mark.parametrize(
    "users, bad",
    [
        ([[0, 10, 10, 20], [15, 25, 0, 0]], (0, 1)),  # history of 1 inside C of 0
        ([[0, 10, 30, 40], [0, 0, 35, 36]], (0, 1)),  # candidates inside candidates
        ([[50, 60, 60, 70], [0, 5, 5, 6], [58, 59, 0, 0]], (0, 2)),
    ],
)
def test_validate_refuses_overlap(users, bad):
    b = np.asarray([[[0, 4, 4, 8]] + [[0, 0, 0, 0]] * (len(users) - 1), users], np.int32)
    with pytest.raises(ValueError, match="bounds: row 1: users") as e:
        validate_packed_bounds(b, batch=2, seq_len=100)
    u, w = bad
    assert f"users {u} {users[u]} and {w} {users[w]}" in str(e.value)
    assert "disjoint" in str(e.value)


@pytest.mark.parametrize(
    "users",
    [
        [[0, 10, 10, 20], [20, 25, 25, 30]],  # touching users
        [[0, 10, 30, 40], [10, 20, 20, 30]],  # interleaved but disjoint segments
        [[0, 10, 5, 15], [0, 0, 0, 0], [0, 0, 0, 0]],  # own H and C overlap; unused slots
        [[5, 3, 9, 2], [2, 8, 8, 8]],  # user 0 inverted (empty) after normalization
        [[0, 10, 10, 20], [15, 15, 50, 60]],  # an empty history at 15 is ignored
    ],
)
def test_validate_accepts_disjoint(users):
    validate_packed_bounds(np.asarray([users], np.int32), batch=1, seq_len=100)


def _checked(seq_len):
    def f(b):
        check_packed_bounds(b, seq_len=seq_len)
        return jnp.int32(0)

    return checkify.checkify(jax.jit(f))


def test_check_packed_bounds_checkify():
    ok = np.asarray([[[0, 4, 4, 6], [6, 8, 8, 9], [0, 0, 0, 0]]], np.int32)
    assert _checked(10)(ok)[0].get() is None
    overlap = ok.copy()
    overlap[0, 2] = [3, 5, 0, 0]
    msg = _checked(10)(overlap)[0].get()
    assert msg is not None and "overlapping users: row 0, users 0 and 2" in msg
    out_of_range = ok.copy()
    out_of_range[0, 1] = [6, 8, 8, 11]
    msg = _checked(10)(out_of_range)[0].get()
    assert msg is not None and "out of range" in msg and "first bad row 0, user 1" in msg


# --------------------------------------------------------------------------------------
# per-position tables (the O(1)-per-score mask of the Hopper packed kernels)


@st.composite
def table_rows(draw):
    seq_len = draw(st.integers(1, 120))
    rows = draw(st.lists(packed_rows(seq_len), min_size=1, max_size=3))
    num_users = max(len(u) for u in rows)
    rows = [u + [(0, 0, 0, 0)] * (num_users - len(u)) for u in rows]
    return seq_len, rows


@jax.jit
def _tables(bounds, pos):
    seq_len = pos.shape[0]
    return packed_query_table(bounds, seq_len), packed_key_table(bounds, seq_len)


@SETTINGS
@given(table_rows())
def test_position_tables_give_the_packed_mask(p):
    """For disjoint users, the mask from either table is the OR over users (brute force);
    for overlapping ones (refused by the checks) it is at least contained in it."""
    seq_len, rows = p
    bounds = normalize_packed_bounds(np.asarray(rows, np.int32), batch=len(rows), seq_len=seq_len)
    q_table, k_table = (np.asarray(t) for t in _tables(bounds, jnp.arange(seq_len)))
    assert q_table.shape == (len(rows), 3, seq_len) and k_table.shape == (len(rows), 5, seq_len)
    pos = np.arange(seq_len)
    for b, users in enumerate(np.asarray(bounds).tolist()):
        want = allowed_np(seq_len, users)
        from_q = ranker_mask_from_query_table(
            pos[None, :], *(q_table[b, f][:, None] for f in range(3))
        )
        from_k = ranker_mask_from_key_table(
            pos[:, None], *(k_table[b, f][None, :] for f in range(5))
        )
        if disjoint(users):
            np.testing.assert_array_equal(from_q, want)
            np.testing.assert_array_equal(from_k, want)
        else:
            assert not (from_q & ~want).any() and not (from_k & ~want).any()


def test_position_tables_known_row():
    """Two users with a gap, a candidate block away from its history, padding at the end."""
    bounds = jnp.asarray([[[0, 3, 3, 5], [6, 8, 9, 10]]], jnp.int32)
    q_table, k_table = packed_query_table(bounds, 11), packed_key_table(bounds, 11)
    np.testing.assert_array_equal(
        q_table[0],
        [
            [0, 0, 0, 0, 0, 0, 6, 6, 0, 6, 0],
            [3, 3, 3, 3, 3, 0, 8, 8, 0, 8, 0],
            [-1, -1, -1, 3, 4, -1, -1, -1, -1, 9, -1],
        ],
    )
    np.testing.assert_array_equal(
        k_table[0],
        [
            [0, 0, 0, 0, 0, 0, 6, 6, 0, 0, 0],
            [3, 3, 3, 0, 0, 0, 8, 8, 0, 0, 0],
            [3, 3, 3, 0, 0, 0, 9, 9, 0, 0, 0],
            [5, 5, 5, 0, 0, 0, 10, 10, 0, 0, 0],
            [-1, -1, -1, 3, 4, -1, -1, -1, -1, 9, -1],
        ],
    )


# keys=True in the full tier: its runs and full steps (packed_q_block_ranges /
# packed_full_q_steps) are checked quickly against brute force above.
@pytest.mark.parametrize("keys", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_step_list_matches_step_table(keys):
    """packed_step_list holds the same visits (in order) and unmasked steps as the runs
    of packed_step_table, read back through TileSteps / TileRuns."""
    from attn_common.packed import TileRuns, TileSteps, packed_step_list, packed_step_table

    rng = np.random.default_rng(11)
    seq_len, batch, users, block, tile = 256, 5, 4, 16, 64
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(seq_len + 1, size=4 * users, replace=False)).reshape(users, 4)
        rows.append(cuts[rng.permutation(users)])
    bounds = jnp.asarray(np.asarray(rows, np.int32))
    kw = dict(tile=tile, num_tiles=seq_len // tile, block=block, sub_tiles=2, keys=keys)
    # built under jit, as for a kernel (one compile instead of every op eagerly), and read
    # back on the host
    build = jax.jit(lambda b: (packed_step_table(b, **kw), packed_step_list(b, **kw)))
    table, steps = (np.asarray(x) for x in build(bounds))
    assert steps.shape == (batch, seq_len // tile, 1 + 4 + seq_len // block)
    for b in range(batch):
        for t in range(seq_len // tile):
            runs = TileRuns.read(lambda i, b=b, t=t: table[b, t, i], 2 * users)
            listed = TileSteps(lambda i, b=b, t=t: steps[b, t, i], 2)
            total = int(listed.total_steps)
            assert total == int(runs.total_steps)
            got = [int(listed.block_at(s)) for s in range(total)]
            assert got == [int(runs.block_at(s)) for s in range(total)]
            assert len(set(got)) == total
            assert np.all(np.asarray(steps[b, t, 5 + total :]) == 0)
            for sub in range(2):
                want = (
                    int(table[b, t, 4 * users + 2 * sub]),
                    int(table[b, t, 4 * users + 2 * sub + 1]),
                )
                assert tuple(int(x) for x in listed.full_steps(sub)) == want


@pytest.mark.parametrize("shape", [(2, 3), (3,), (2, 1, 3), (2, 2, 2, 4)])
def test_bad_bounds_error_names_the_shape_given(shape):
    """The error shows the caller's shape, not the [B, U, 4] form it would be lifted to."""
    with pytest.raises(ValueError, match=re.escape(f"bounds: got shape {shape}, expected")):
        normalize_packed_bounds(np.zeros(shape, np.int32), batch=2, seq_len=8)
