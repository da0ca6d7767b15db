"""Sparse-MLA table builders against brute force: block unions, u_max, paged write runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import property_settings, tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_common import kv_packing
from attn_common.tables import (
    DEFAULT_U_MAX_CAP,
    TOKEN_RUN,
    WORD_RUN,
    build_block_unit_tables,
    build_write_runs,
    default_write_run_cap,
    keep_last_writes,
    lossless_u_max,
    resolve_u_max,
    sanitize_unit_ids,
    sort_block_selections,
    union_counts,
)

_tables_jit = jax.jit(build_block_unit_tables, static_argnames=("query_block", "u_max"))
_runs_jit = jax.jit(build_write_runs, static_argnames=("kv_packing", "r_cap"))

# --------------------------------------------------------------------------------------
# build_block_unit_tables


def block_tables_brute(sel: np.ndarray, query_block: int, u_max: int):
    num_tokens, _ = sel.shape
    n_blocks = -(-num_tokens // query_block)
    units = np.full((n_blocks, u_max), -1, np.int64)
    member = np.zeros((n_blocks, query_block, u_max), np.int64)
    counts = np.zeros(n_blocks, np.int64)
    for b in range(n_blocks):
        qsets = []
        for q in range(query_block):
            t = b * query_block + q
            qsets.append({int(x) for x in sel[t] if x >= 0} if t < num_tokens else set())
        union = sorted(set().union(*qsets))
        counts[b] = len(union)
        kept = union[:u_max]
        units[b, : len(kept)] = kept
        for q in range(query_block):
            for u in range(u_max):
                member[b, q, u] = int(units[b, u] >= 0 and units[b, u] in qsets[q])
    return units, member, counts


def check_block_tables(sel, query_block: int, u_max: int):
    """``build_block_unit_tables`` (jitted) of ``sel`` against brute force; returns it."""
    out = _tables_jit(jnp.asarray(sel), query_block=query_block, u_max=u_max)
    num_tokens, _ = sel.shape
    n_blocks = -(-num_tokens // query_block)
    assert out.units.shape == (n_blocks, u_max) and out.units.dtype == jnp.int32
    assert out.member.shape == (n_blocks, query_block, u_max) and out.member.dtype == jnp.int8
    assert out.counts.shape == (n_blocks,) and out.counts.dtype == jnp.int32
    units, member, counts = block_tables_brute(sel, query_block, u_max)
    np.testing.assert_array_equal(np.asarray(out.units), units)
    np.testing.assert_array_equal(np.asarray(out.counts), counts)
    np.testing.assert_array_equal(np.asarray(out.member), member)
    # the packed words: slot u in bit u % 32 of word u // 32, nothing past u_max
    n_words = -(-u_max // 32)
    assert out.words.shape == (n_blocks, query_block, n_words) and out.words.dtype == jnp.uint32
    padded = np.zeros((n_blocks, query_block, n_words * 32), np.uint64)
    padded[..., :u_max] = member
    bits = padded.reshape(n_blocks, query_block, n_words, 32) << np.arange(32, dtype=np.uint64)
    np.testing.assert_array_equal(np.asarray(out.words), bits.sum(-1).astype(np.uint32))
    # padded tail queries select nothing
    tail = n_blocks * query_block - num_tokens
    if tail:
        assert not np.asarray(out.member)[-1, query_block - tail :].any()
    # the shared first sort: the union counts from it, and the tables built from it
    presorted = sort_block_selections(jnp.asarray(sel), query_block=query_block)
    np.testing.assert_array_equal(np.asarray(union_counts(presorted[0])), counts)
    again = _tables_jit(jnp.asarray(sel), query_block=query_block, u_max=u_max,
                        presorted=presorted)  # fmt: skip
    for got, want in zip(again, out, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    return out


@st.composite
def unit_problems(draw):
    num_tokens = draw(st.integers(1, 70))
    top_k = draw(st.integers(1, 6))
    query_block = draw(st.sampled_from([1, 2, 4, 8, 16]))
    num_units = 12
    sel = np.array(
        draw(
            st.lists(
                st.lists(st.integers(-1, num_units - 1), min_size=top_k, max_size=top_k),
                min_size=num_tokens,
                max_size=num_tokens,
            )
        ),
        np.int32,
    ).reshape(num_tokens, top_k)
    lossless = lossless_u_max(query_block, top_k, num_units)
    kind = draw(st.sampled_from(["lossless", "smaller", "wider"]))
    if kind == "lossless":
        u_max = lossless
    elif kind == "smaller":
        u_max = draw(st.integers(1, lossless))
    else:  # wider than query_block * K: the table is padded with -1
        u_max = query_block * top_k + draw(st.integers(1, 3))
    return sel, query_block, u_max


# ~2 s an example on 2 cores (each compiles its shapes): 2 in the quick tier, where
# test_block_unit_tables_fixed_shape_many_inputs checks many more inputs at one shape.
@settings(property_settings(30), max_examples=tier_examples(30, quick=2))
@given(unit_problems())
def test_block_unit_tables_match_brute_force(p):
    check_block_tables(*p)


# Quick: a lossy u_max (4, 5); the others in the full tier (~2.5 s each on 2 cores), where
# test_block_unit_tables_match_brute_force draws lossless and wider ones too.
@pytest.mark.parametrize(
    "query_block, u_max",
    [
        (4, 5),
        pytest.param(4, 12, marks=pytest.mark.slow),
        pytest.param(4, 2, marks=pytest.mark.slow),
        pytest.param(16, 12, marks=pytest.mark.slow),
    ],
)
def test_block_unit_tables_fixed_shape_many_inputs(query_block, u_max):
    """Many random inputs at one shape (one compile): duplicates, -1, other negatives."""
    rng = np.random.default_rng(query_block * 100 + u_max)
    for _ in range(25):
        sel = rng.integers(-3, 12, size=(37, 5)).astype(np.int32)
        # force duplicates within a query and across queries
        sel[:, 1] = np.where(rng.random(37) < 0.4, sel[:, 0], sel[:, 1])
        check_block_tables(sel, query_block, u_max)


# ~4.5 s on 2 cores (every op compiled eagerly): the tables are checked quickly against
# brute force by the two tests above (jitted; a lossy u_max in the fixed-shape one).
@pytest.mark.slow
def test_block_unit_tables_eager_example():
    sel = np.array(
        [
            [3, 3, -1],  # duplicate + none
            [7, 1, 3],
            [-1, -1, -1],  # selects nothing
            [9, 9, 9],
            [2, 0, 5],  # block 1 (QB=4): T=5 pads 3 empty queries
        ],
        np.int32,
    )
    out = build_block_unit_tables(jnp.asarray(sel), query_block=4, u_max=5)
    np.testing.assert_array_equal(np.asarray(out.units), [[1, 3, 7, 9, -1], [0, 2, 5, -1, -1]])
    np.testing.assert_array_equal(np.asarray(out.counts), [4, 3])
    m = np.asarray(out.member)
    np.testing.assert_array_equal(m[0, 0], [0, 1, 0, 0, 0])
    np.testing.assert_array_equal(m[0, 1], [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(m[0, 2], [0, 0, 0, 0, 0])
    np.testing.assert_array_equal(m[0, 3], [0, 0, 0, 1, 0])
    np.testing.assert_array_equal(m[1, 0], [1, 1, 1, 0, 0])
    assert not m[1, 1:].any()
    # lossy cap: keeps the smallest ids, counts stay the true union size
    out = _tables_jit(jnp.asarray(sel), query_block=4, u_max=2)
    np.testing.assert_array_equal(np.asarray(out.units), [[1, 3], [0, 2]])
    np.testing.assert_array_equal(np.asarray(out.counts), [4, 3])
    np.testing.assert_array_equal(np.asarray(out.member)[0, 1], [1, 1])
    np.testing.assert_array_equal(np.asarray(out.member)[0, 3], [0, 0])


def test_block_unit_tables_all_empty():
    sel = np.full((6, 3), -1, np.int32)
    out = _tables_jit(jnp.asarray(sel), query_block=4, u_max=3)
    assert (np.asarray(out.units) == -1).all()
    assert not np.asarray(out.member).any()
    assert (np.asarray(out.counts) == 0).all()


# --------------------------------------------------------------------------------------
# lossless_u_max / resolve_u_max


@pytest.mark.parametrize(
    "qb, k, n, expected",
    [(4, 3, 100, 12), (4, 3, 5, 5), (256, 2048, 865, 865), (1, 1, 1, 1), (4, 3, 0, 1)],
)
def test_lossless_u_max(qb, k, n, expected):
    assert lossless_u_max(qb, k, n) == expected


def test_resolve_u_max_default_and_explicit():
    """Default: the widest union, capped; an explicit value is kept as given (a chunk
    width, never a cap on the answer)."""
    assert resolve_u_max(None, query_block=16, top_k=8, num_units=1000) == 128
    assert resolve_u_max(None, query_block=16, top_k=8, num_units=50) == 50
    assert resolve_u_max(None, query_block=256, top_k=2048, num_units=10**6) == DEFAULT_U_MAX_CAP
    for u in (1, 37, 128, 4096):
        assert resolve_u_max(u, query_block=16, top_k=8, num_units=1000) == u


@pytest.mark.parametrize("bad", [0, -1, 2.5, 4.0, True, False, "8", np.int32(8)])
def test_resolve_u_max_invalid(bad):
    with pytest.raises(ValueError, match="u_max"):
        resolve_u_max(bad, query_block=4, top_k=2, num_units=10)


# --------------------------------------------------------------------------------------
# kv_packing / sanitize_unit_ids / default_write_run_cap


@pytest.mark.parametrize(
    "dtype, pk",
    [
        (jnp.bfloat16, 2),
        (jnp.float16, 2),
        (jnp.float32, 1),
        (jnp.int8, 4),
        (jnp.uint8, 4),
        (jnp.float8_e4m3fn, 4),
        (np.float32, 1),
        ("bfloat16", 2),
        (jnp.int32, 1),
    ],
)
def test_kv_packing(dtype, pk):
    assert kv_packing(dtype) == pk


@settings(max_examples=tier_examples(30), deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=16, max_size=16),
    st.integers(0, 40),
)
def test_sanitize_unit_ids(ids, num_units):
    ids = np.array(ids, np.int64)
    # mostly small ids so both branches are exercised
    ids[:12] = ids[:12] % 50 - 5
    got = np.asarray(sanitize_unit_ids(jnp.asarray(ids.astype(np.int32)), num_units))
    expected = np.where((ids >= 0) & (ids < num_units), ids, -1)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_sanitize_unit_ids_traced_num_units_and_dtype():
    ids = jnp.array([[-2, 0, 3], [4, 5, 1]], jnp.int16)
    got = jax.jit(sanitize_unit_ids)(ids, jnp.int32(4))
    np.testing.assert_array_equal(np.asarray(got), [[-1, 0, 3], [-1, -1, 1]])
    assert got.dtype == jnp.int32


def test_default_write_run_cap():
    assert default_write_run_cap(1, 16) == 132
    assert default_write_run_cap(64, 16) == 138
    assert default_write_run_cap(65, 16) == 140


# --------------------------------------------------------------------------------------
# build_write_runs


def runs_brute(loc):
    """Maximal runs of consecutive destinations: list of (src, dst, n)."""
    runs = []
    for t, x in enumerate(loc):
        if x < 0:
            continue
        if runs and t > 0 and loc[t - 1] >= 0 and loc[t - 1] + 1 == x:
            s, d, n = runs[-1]
            runs[-1] = (s, d, n + 1)
        else:
            runs.append((t, int(x), 1))
    return runs


def apply_table(table, pk, rows, cache):
    """Simulate the copy table at token granularity; return per-token src/dst coverage."""
    src_cov = np.zeros(rows.shape[0], np.int64)
    dst_cov = np.zeros(cache.shape[0], np.int64)
    for kind, src, dst, n in table:
        assert n >= 0
        if n == 0:
            continue
        if kind == WORD_RUN:
            s0, d0, m = src * pk, dst * pk, n * pk
        else:
            assert kind == TOKEN_RUN
            s0, d0, m = src, dst, n
        assert s0 >= 0 and s0 + m <= rows.shape[0], "read outside the source rows"
        assert d0 >= 0 and d0 + m <= cache.shape[0], "write outside the cache"
        cache[d0 : d0 + m] = rows[s0 : s0 + m]
        src_cov[s0 : s0 + m] += 1
        dst_cov[d0 : d0 + m] += 1
    return src_cov, dst_cov


def check_write_runs(loc, pk: int, r_cap: int):
    """``build_write_runs`` (jitted) of ``loc`` against brute force; returns it."""
    out = _runs_jit(jnp.asarray(loc, jnp.int32), kv_packing=pk, r_cap=r_cap)
    loc = np.asarray(loc, np.int64)
    num_tokens = loc.shape[0]
    table = np.asarray(out.table)
    assert table.shape == (3 * r_cap, 4) and table.dtype == np.int32
    assert out.num_runs.shape == () and out.num_runs.dtype == jnp.int32
    runs = runs_brute(loc)
    assert int(out.num_runs) == len(runs)
    # documented layout: per run (token head, words, token tail)
    np.testing.assert_array_equal(table[:, 0], np.tile([TOKEN_RUN, WORD_RUN, TOKEN_RUN], r_cap))
    assert (table[:, 3] >= 0).all()

    valid = loc >= 0
    cache_len = int(max(loc.max(initial=0) + 1, 1))
    cache_len = -(-cache_len // pk) * pk + pk
    rows = np.arange(num_tokens, dtype=np.int64) + 1000
    cache = np.full(cache_len, -7, np.int64)
    src_cov, dst_cov = apply_table(table.astype(np.int64), pk, rows, cache)

    for i in range(min(len(runs), r_cap)):
        s, d, n = runs[i]
        head, words, tail = table[3 * i : 3 * i + 3]
        assert head[3] + words[3] * pk + tail[3] == n
        assert (head[1], head[2]) == (s, d)
        if words[3] > 0:
            # word rows come from same-phase runs and copy whole aligned words of the run
            assert (s % pk) == (d % pk)
            assert s <= words[1] * pk and (words[1] + words[3]) * pk <= s + n
            assert words[1] * pk - s == words[2] * pk - d
        if s % pk == d % pk:
            # same word phase: only the unaligned ends go token by token
            assert head[3] < pk and tail[3] < pk
    assert (table[3 * min(len(runs), r_cap) :, 3] == 0).all()

    expected = np.full(cache_len, -7, np.int64)
    expected[loc[valid]] = rows[valid]
    if len(runs) <= r_cap:
        np.testing.assert_array_equal(cache, expected)
        np.testing.assert_array_equal(src_cov, valid.astype(np.int64))
        assert src_cov.sum() == valid.sum()
        assert dst_cov.max(initial=0) <= 1
    else:
        # overflow: the table holds the first r_cap runs, each written correctly
        written = dst_cov > 0
        np.testing.assert_array_equal(cache[written], expected[written])
        assert src_cov.max(initial=0) <= 1
        assert src_cov.sum() == sum(n for _, _, n in runs[:r_cap])
    return out


@st.composite
def loc_problems(draw, bucket=True):
    """loc built from random runs of consecutive slots, holes, in random order."""
    length = draw(st.integers(1, 64))
    pk = draw(st.sampled_from([1, 2, 4]))
    n_runs = draw(st.integers(1, max(1, length)))
    cuts = (
        sorted(draw(st.sets(st.integers(1, length - 1), max_size=n_runs - 1))) if length > 1 else []
    )
    pieces = np.split(np.arange(length), cuts)
    slots = draw(st.permutations(range(len(pieces))))
    gaps = [draw(st.integers(0, 5)) for _ in pieces]
    # destination of piece p: consecutive slots after a random gap, pieces in random order
    dst_start = {}
    cursor = draw(st.sampled_from([0, 0, 1, 2, 5, 9]))
    for p in slots:
        cursor += gaps[p]
        dst_start[p] = cursor
        cursor += len(pieces[p])
    loc = np.empty(length, np.int64)
    for p, idx in enumerate(pieces):
        loc[idx] = dst_start[p] + np.arange(len(idx))
    holes = draw(st.lists(st.integers(0, length - 1), max_size=length // 3 + 1))
    loc[holes] = -1
    if bucket:  # pad with trailing holes to a few shapes so compiles are reused
        size = next(b for b in (8, 16, 32, 64) if b >= length)
        loc = np.concatenate([loc, np.full(size - length, -1, np.int64)])
    r_cap = draw(st.sampled_from([1, 3, 8, 100]))
    return loc.astype(np.int32), pk, r_cap


# ~0.8 s an example on 2 cores: 5 in the quick tier, with the fixed examples below.
@settings(property_settings(50), max_examples=tier_examples(50, quick=5))
@given(loc_problems())
def test_write_runs_match_scatter(p):
    check_write_runs(*p)


# Quick: each kv_packing once (7, 1), (13, 4) and (1, 2); the rest in the full tier.
@pytest.mark.parametrize(
    "length, pk",
    [
        (1, 2),
        pytest.param(3, 4, marks=pytest.mark.slow),
        (7, 1),
        pytest.param(13, 2, marks=pytest.mark.slow),
        (13, 4),
    ],
)
def test_write_runs_odd_lengths(length, pk):
    rng = np.random.default_rng(length * 10 + pk)
    for r_cap in (1, length + 3):
        for _ in range(6):
            loc = rng.permutation(40)[:length].astype(np.int32)
            if rng.random() < 0.5:  # one contiguous run at a random phase
                loc = (np.arange(length) + rng.integers(0, 9)).astype(np.int32)
            loc[rng.random(length) < 0.2] = -1
            check_write_runs(loc, pk, r_cap)


def test_write_runs_examples():
    # one aligned run of 10 tokens, pk=2: 5 words, no tokens
    out = _runs_jit(jnp.arange(10, 20, dtype=jnp.int32), kv_packing=2, r_cap=2)
    assert int(out.num_runs) == 1
    np.testing.assert_array_equal(
        np.asarray(out.table)[:3],
        [[TOKEN_RUN, 0, 10, 0], [WORD_RUN, 0, 5, 5], [TOKEN_RUN, 10, 20, 0]],
    )
    # same-phase but unaligned: head token, words, tail token
    loc = np.array([-1, 5, 6, 7, 8, 9, 10], np.int32)  # src 1 -> dst 5 (phase 1 both)
    out = check_write_runs(loc, 2, 1)
    np.testing.assert_array_equal(
        np.asarray(out.table), [[TOKEN_RUN, 1, 5, 1], [WORD_RUN, 1, 3, 2], [TOKEN_RUN, 6, 10, 1]]
    )
    # different phase: all tokens
    loc = np.array([4, 5, 6, 7, 8], np.int32)  # src 0 -> dst 4, pk=4 same; use pk=4 + shift
    tab = np.asarray(check_write_runs(loc + 1, 4, 1).table)
    assert tab[1, 3] == 0 and tab[0, 3] + tab[2, 3] == 5


@pytest.mark.parametrize(
    "loc, n_runs",
    [
        ([-1, 0, 1, -1, 5], 2),  # slot 0 right after a hole: -1 + 1 == 0 is not a run
        ([0, -1, 1, 2], 2),  # a hole between consecutive slots splits the run
        ([3, 4, 5, 0, 1, 2], 2),
        ([-1], 0),
        ([0], 1),
    ],
)
def test_write_runs_hole_edges(loc, n_runs):
    loc = np.array(loc, np.int32)
    out = check_write_runs(loc, 2, 4)
    assert int(out.num_runs) == n_runs


def test_write_runs_exactly_r_cap_runs():
    loc = np.array([0, 1, 2, 10, 11, 20, -1, 30, 31, 32, 33], np.int32)  # 4 runs
    out = check_write_runs(loc, 2, 4)
    assert int(out.num_runs) == 4


# pk 1 and 4 in the full tier; quick, pk 2 here and test_write_runs_match_scatter's draws.
@pytest.mark.parametrize(
    "pk", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)]
)
def test_write_runs_overflow(pk):
    loc = (np.arange(24) * 3).astype(np.int32)  # every token its own run
    out = check_write_runs(loc, pk, 5)
    assert int(out.num_runs) == 24 > 5


def test_write_runs_all_holes():
    loc = np.full(9, -1, np.int32)
    out = _runs_jit(jnp.asarray(loc), kv_packing=2, r_cap=3)
    assert int(out.num_runs) == 0
    assert (np.asarray(out.table)[:, 3] == 0).all()


def test_write_runs_reversed_is_many_runs():
    loc = np.arange(16)[::-1].astype(np.int32)  # descending: 16 runs of 1
    out = check_write_runs(loc, 2, 16)
    assert int(out.num_runs) == 16


# --------------------------------------------------------------------------------------
# keep_last_writes


@settings(max_examples=tier_examples(60, quick=5), deadline=None)
@given(
    loc=st.lists(st.integers(min_value=-3, max_value=12), min_size=0, max_size=24),
    num_slots=st.integers(min_value=1, max_value=12),
)
def test_keep_last_writes_matches_sequential_writes(loc, num_slots):
    """Every slot keeps exactly its last writer; everything else (and out of range) -> -1."""
    loc = np.asarray(loc, np.int32)
    got = np.asarray(keep_last_writes(jnp.asarray(loc), num_slots))
    want = np.full_like(loc, -1)
    last = {}
    for t, slot in enumerate(loc):
        if 0 <= slot < num_slots:
            last[int(slot)] = t
    for slot, t in last.items():
        want[t] = slot
    np.testing.assert_array_equal(got, want)
