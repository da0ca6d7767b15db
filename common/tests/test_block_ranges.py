"""Block ranges the ranker kernels visit, against brute-force pair enumeration.

``ranker_kv_block_ranges`` must list exactly the KV blocks that hold at least one allowed
(query in tile, key) pair, each once; ``ranker_q_block_ranges`` is its transpose.
The oracle here is plain numpy over the mask predicate, written independently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import property_settings, segment_bounds, tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_common import normalize_bounds
from attn_common.bounds import BlockRanges, ranker_kv_block_ranges, ranker_q_block_ranges

BLOCKS = (16, 32, 64, 128)
MAX_STEPS = 32  # > cdiv(300 + 128, 16): enough steps for every case below


def _cdiv(a, b):
    return -(-a // b)


def allowed_np(seq_len, hl, hu, cl, cu):
    """[S, S] bool: allowed[i, j] by the predicate, written with Python sets semantics."""
    i = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    q_h = (hl <= i) & (i < hu)
    q_c = (cl <= i) & (i < cu)
    k_h = (hl <= j) & (j < hu)
    return (k_h & (q_h | q_c)) | (q_c & (i == j))


def expected_kv_blocks(seq_len, bounds, q_start, q_end, block):
    allowed = allowed_np(seq_len, *bounds)
    rows = allowed[max(q_start, 0) : max(min(q_end, seq_len), 0)]
    keys = np.nonzero(rows.any(axis=0))[0]
    return set((keys // block).tolist())


def expected_q_blocks(seq_len, bounds, kv_start, kv_end, block):
    allowed = allowed_np(seq_len, *bounds)
    cols = allowed[:, max(kv_start, 0) : max(min(kv_end, seq_len), 0)]
    queries = np.nonzero(cols.any(axis=1))[0]
    return set((queries // block).tolist())


def visited(ranges: BlockRanges) -> list[int]:
    total = int(ranges.total_steps)
    return [int(ranges.block_at(s)) for s in range(total)]


def check_visit(seq_len, block, blocks, expected):
    assert len(blocks) == len(set(blocks)), f"block visited twice: {blocks}"
    assert set(blocks) == expected, f"visited {sorted(blocks)}, expected {sorted(expected)}"
    n_blocks = _cdiv(seq_len, block)
    assert all(0 <= b < n_blocks for b in blocks), (blocks, n_blocks)


def check_fields(ranges: BlockRanges):
    for f in ranges:
        assert int(f) >= 0, ranges


# --------------------------------------------------------------------------------------
# strategies


@st.composite
def problems(draw):
    """(S, block, bounds, tile_start, tile_end) with ``segment_bounds`` anywhere in
    [0, S]."""
    seq_len = draw(st.integers(1, 300))
    block = draw(st.sampled_from(BLOCKS))
    hl, hu, cl, cu = draw(segment_bounds(seq_len))
    if draw(st.booleans()):
        # a block-aligned tile, possibly running past S (as kernels tile it)
        tile_block = draw(st.sampled_from(BLOCKS))
        b = draw(st.integers(0, _cdiv(seq_len, tile_block) - 1))
        start, end = b * tile_block, (b + 1) * tile_block
    else:
        start = draw(st.integers(0, seq_len - 1))
        end = draw(st.integers(start + 1, min(seq_len + block, start + 1 + seq_len)))
    return seq_len, block, (hl, hu, cl, cu), start, end


# --------------------------------------------------------------------------------------
# scalar (Python int) arguments


@pytest.mark.parametrize(
    ("ranges", "expected"),
    [(ranker_kv_block_ranges, expected_kv_blocks), (ranker_q_block_ranges, expected_q_blocks)],
    ids=["kv", "q"],
)
@property_settings(300)
@given(problems())
def test_block_ranges_match_brute_force(ranges, expected, p):
    """KV blocks of a query tile, or query blocks of a KV tile."""
    seq_len, block, bounds, start, end = p
    r = ranges(*bounds, start, end, block)
    check_fields(r)
    check_visit(seq_len, block, visited(r), expected(seq_len, bounds, start, end, block))


@settings(max_examples=tier_examples(100), deadline=None)
@given(
    st.integers(1, 300),
    st.sampled_from(BLOCKS),
    st.lists(st.integers(-50, 400), min_size=4, max_size=4),
    st.data(),
)
def test_block_ranges_after_normalize_bounds(seq_len, block, raw, data):
    """Out-of-range / inverted raw bounds, normalized first (as every op does)."""
    b = np.asarray(normalize_bounds(np.array(raw, np.int32), batch=1, seq_len=seq_len))[0]
    bounds = tuple(int(x) for x in b)
    start = data.draw(st.integers(0, seq_len - 1))
    end = data.draw(st.integers(start + 1, seq_len + block))
    r = ranker_kv_block_ranges(*bounds, start, end, block)
    check_visit(seq_len, block, visited(r), expected_kv_blocks(seq_len, bounds, start, end, block))
    r = ranker_q_block_ranges(*bounds, start, end, block)
    check_visit(seq_len, block, visited(r), expected_q_blocks(seq_len, bounds, start, end, block))


def test_every_tile_of_a_grid_exhaustively_small():
    """All bounds on a small grid, all tiles of a block grid: union of tiles is exact."""
    seq_len, block = 40, 16
    vals = range(0, seq_len + 1, 10)
    for hl in vals:
        for hu in vals:
            for cl in vals:
                for cu in (cl, min(cl + 7, seq_len), seq_len):
                    bounds = (hl, hu, cl, cu)
                    for t in range(_cdiv(seq_len, block)):
                        qs, qe = t * block, (t + 1) * block
                        r = ranker_kv_block_ranges(*bounds, qs, qe, block)
                        exp = expected_kv_blocks(seq_len, bounds, qs, qe, block)
                        check_visit(seq_len, block, visited(r), exp)


# --------------------------------------------------------------------------------------
# the pitfall (docs/design.md#ranker-attention): a block shared by the history range and a
# candidate range


@pytest.mark.parametrize(
    "seq_len, block, bounds, tile, expected",
    [
        # H = [0, 40), C = [40, 60): both live in KV block 0 of 64 keys
        (100, 64, (0, 40, 40, 60), (0, 64), [0]),
        # H ends mid-block 1 and the tile's candidates start in that same block
        (150, 64, (0, 70, 70, 130), (64, 128), [0, 1]),
        # C before H, sharing block 1 (bounds unaligned on both sides)
        (200, 32, (45, 90, 10, 45), (0, 64), [0, 1, 2]),
        # H and C overlap
        (120, 16, (10, 50, 30, 70), (48, 64), [0, 1, 2, 3]),
        # disjoint, far apart: two runs, each block once
        (300, 64, (0, 10, 200, 210), (192, 256), [0, 3]),
    ],
)
def test_shared_block_visited_once(seq_len, block, bounds, tile, expected):
    r = ranker_kv_block_ranges(*bounds, *tile, block)
    blocks = visited(r)
    assert sorted(blocks) == expected
    assert len(blocks) == len(set(blocks))
    assert set(blocks) == expected_kv_blocks(seq_len, bounds, *tile, block)


def test_shared_block_key_counted_once():
    """Summing per-block allowed keys over the visited blocks counts each key once."""
    seq_len, block = 100, 64
    bounds = (0, 40, 40, 60)
    allowed = allowed_np(seq_len, *bounds)
    for qs in range(0, seq_len, block):
        qe = qs + block
        r = ranker_kv_block_ranges(*bounds, qs, qe, block)
        counted = 0
        for b in visited(r):
            counted += int(allowed[qs:qe, b * block : (b + 1) * block].sum())
        assert counted == int(allowed[qs:qe].sum())


# --------------------------------------------------------------------------------------
# empty / no-work tiles


@pytest.mark.parametrize("fn", [ranker_kv_block_ranges, ranker_q_block_ranges])
def test_no_work(fn):
    # everything padding
    assert int(fn(0, 0, 0, 0, 0, 64, 16).total_steps) == 0
    # tile entirely in padding after the segments
    assert int(fn(0, 10, 10, 20, 32, 48, 16).total_steps) == 0
    # inverted segments are empty
    assert int(fn(30, 10, 50, 20, 0, 64, 16).total_steps) == 0


@pytest.mark.parametrize("fn", [ranker_kv_block_ranges, ranker_q_block_ranges])
def test_empty_tile_visits_nothing(fn):
    assert int(fn(0, 10, 10, 20, 5, 5, 16).total_steps) == 0


def test_q_tile_of_candidates_only_needs_history_and_self():
    # candidates [64, 96) with history [0, 32): tile [64, 80) needs blocks 0, 1 (hist), 4 (self)
    r = ranker_kv_block_ranges(0, 32, 64, 96, 64, 80, 16)
    assert sorted(visited(r)) == [0, 1, 4]


def test_kv_tile_of_candidate_keys_visited_by_own_queries_only():
    # KV tile [64, 80) holds candidate keys only: read only by queries 64..79
    r = ranker_q_block_ranges(0, 32, 64, 96, 64, 80, 16)
    assert visited(r) == [4]
    # KV tile of history keys: every history and candidate query block
    r = ranker_q_block_ranges(0, 32, 64, 96, 0, 16, 16)
    assert sorted(visited(r)) == [0, 1, 4, 5]


# --------------------------------------------------------------------------------------
# batched arrays and jit with traced scalars


def _random_rows(rng, n, seq_len):
    b = rng.integers(0, seq_len + 1, size=(n, 4))
    # half the rows keep segments ordered; the rest may be inverted / overlapping
    ordered = rng.random(n) < 0.5
    b[ordered, 0:2] = np.sort(b[ordered, 0:2], axis=1)
    b[ordered, 2:4] = np.sort(b[ordered, 2:4], axis=1)
    start = rng.integers(0, seq_len, size=n)
    end = np.minimum(start + rng.integers(1, seq_len + 1, size=n), seq_len + 64)
    return b.astype(np.int32), start.astype(np.int32), end.astype(np.int32)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("which", ["kv", "q"])
def test_batched_rows(block, which):
    rng = np.random.default_rng(1234 + block)
    seq_len, n = 200, 400
    b, start, end = _random_rows(rng, n, seq_len)
    fn = ranker_kv_block_ranges if which == "kv" else ranker_q_block_ranges
    expected_fn = expected_kv_blocks if which == "kv" else expected_q_blocks
    args = [jnp.asarray(b[:, c]) for c in range(4)] + [jnp.asarray(start), jnp.asarray(end)]
    r = fn(*args, block)
    assert r.first_start.shape == (n,)
    steps = jnp.arange(MAX_STEPS, dtype=jnp.int32)[:, None]
    at = np.asarray(r.block_at(steps))  # [MAX_STEPS, n]
    total = np.asarray(r.total_steps)
    assert (total <= MAX_STEPS).all()
    for row in range(n):
        bounds = tuple(int(x) for x in b[row])
        blocks = at[: total[row], row].tolist()
        exp = expected_fn(seq_len, bounds, int(start[row]), int(end[row]), block)
        check_visit(seq_len, block, blocks, exp)


_jit_kv = jax.jit(ranker_kv_block_ranges, static_argnums=6)
_jit_q = jax.jit(ranker_q_block_ranges, static_argnums=6)


@settings(max_examples=tier_examples(60), deadline=None)
@given(problems())
def test_jit_with_traced_scalars(p):
    seq_len, block, bounds, qs, qe = p
    args = [jnp.int32(x) for x in (*bounds, qs, qe)]
    r = _jit_kv(*args, block)
    check_visit(seq_len, block, visited(r), expected_kv_blocks(seq_len, bounds, qs, qe, block))
    r = _jit_q(*args, block)
    check_visit(seq_len, block, visited(r), expected_q_blocks(seq_len, bounds, qs, qe, block))


def test_block_at_inside_jit_loop():
    """The kernel pattern: a fori_loop over total_steps calling block_at on traced steps."""

    @jax.jit
    def visited_mask(hl, hu, cl, cu, qs, qe):
        r = ranker_kv_block_ranges(hl, hu, cl, cu, qs, qe, 16)

        def body(s, acc):
            return acc.at[r.block_at(s)].add(1)

        return jax.lax.fori_loop(0, r.total_steps, body, jnp.zeros(20, jnp.int32))

    rng = np.random.default_rng(7)
    seq_len = 300
    for _ in range(40):
        hl, hu, cl, cu = (int(x) for x in rng.integers(0, seq_len + 1, 4))
        qs = int(rng.integers(0, seq_len))
        qe = int(min(qs + rng.integers(1, 100), seq_len))
        counts = np.asarray(visited_mask(*(jnp.int32(x) for x in (hl, hu, cl, cu, qs, qe))))
        exp = expected_kv_blocks(seq_len, (hl, hu, cl, cu), qs, qe, 16)
        assert counts.max() <= 1
        assert set(np.nonzero(counts)[0].tolist()) == exp
