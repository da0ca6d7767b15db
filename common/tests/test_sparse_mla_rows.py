"""Sparse-MLA row tables (``attn_common.sparse_mla_rows``) against brute force.

``selected_rows`` must list, per query, exactly the store rows the contract makes keys
(``attn_common.sparse_mla``: unit selected, ``t <= position``, ``t < kv_len``; a selection
is a set), ascending, each once, then ``-1``. The oracles here enumerate tokens one by one
in plain Python over the raw inputs (flat ids, or the ragged page tables), independently
of ``flat_units`` / ``ragged_units``. Attention over the gathered rows in float64 equals
the reference.
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    build_ragged_layout,
    randn,
    random_page_selection,
    rng_for,
    sparse_mla_ragged_case,
    tier_examples,
    upcast,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_common import check_sparse_mla_inputs, sparse_mla_rows
from attn_common.sparse_mla_rows import (
    ABSENT,
    UnitRows,
    flat_units,
    ragged_units,
    row_table_width,
    selected_rows,
    sort_rows,
    sparse_mla_units,
)
from attn_reference import sparse_mla_attention

BLOCKS = (1, 8, 64)
RAGGED_Q, RAGGED_SEQS, RAGGED_SLOTS = 24, 4, 32  # padded ragged shapes (see below)


_jit_rows = jax.jit(selected_rows, static_argnames=("read_block", "block", "num_rows"))


def _selected_rows(units, *, scatter: bool = False, **kw):
    """``selected_rows``, jitted; ``scatter``: eagerly, units expanded by the scatter."""
    if not scatter:
        return _jit_rows(units, **kw)
    with mock.patch.object(sparse_mla_rows, "EXPAND_BY_MAX_COMPARES", 0):
        return selected_rows(units, **kw)


# num_rows: none (batched sort); a bound that packs (query, row) into 32 bits with
# room to spare, or exactly (5 queries: 3 bits + 29); one too wide (the batched sort).
NUM_ROWS = (None, 64, 2**29 - 1, 2**31 - 2)


def _cdiv(a, b):
    return -(-a // b)


def _table(sets: list[set[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Row sets -> the expected ``rows [N, width]`` (ascending, -1 padded), ``counts``."""
    rows = np.full((len(sets), width), -1, np.int64)
    counts = np.zeros(len(sets), np.int64)
    for i, s in enumerate(sets):
        got = sorted(s)
        rows[i, : len(got)] = got
        counts[i] = len(got)
    return rows, counts


def _check(got, sets, width):
    rows, counts = (np.asarray(x) for x in got)
    assert rows.dtype == np.int32 and counts.dtype == np.int32
    assert rows.shape == (len(sets), width) and counts.shape == (len(sets),)
    want_rows, want_counts = _table(sets, width)
    np.testing.assert_array_equal(counts, want_counts)
    np.testing.assert_array_equal(rows, want_rows)


# --------------------------------------------------------------------------------------
# row_table_width


@pytest.mark.parametrize(
    ("k", "rb", "block", "want"),
    [(2048, 1, 64, 2048), (32, 64, 64, 2048), (5, 3, 64, 64), (5, 3, 1, 15), (0, 4, 64, 0)],
)
def test_row_table_width(k, rb, block, want):
    assert row_table_width(k, rb, block) == want


# --------------------------------------------------------------------------------------
# Hand-written example


def test_example():
    """Two queries, units of 4 rows: duplicates, aliases, -1, causal and kv_len cuts."""
    units = UnitRows(
        first_row=jnp.array([[8, -1, 8, 0], [4, 0, 12, -1]], jnp.int32),
        first_pos=jnp.array([[8, 0, 0, 0], [4, 0, 12, 0]], jnp.int32),
        position=jnp.array([9, 13], jnp.int32),
        kv_len=jnp.array([16, 13], jnp.int32),
    )
    rows, counts = selected_rows(units, read_block=4, block=8)
    # query 0: row 8 twice, at positions 8.. (cut at 9: rows 8, 9) and 0.. (rows 8..11):
    # the union 8..11; the unit at 0 -> 0..3. query 1: 0..7, and 12 (kv_len 13).
    np.testing.assert_array_equal(
        np.asarray(rows),
        [
            [0, 1, 2, 3, 8, 9, 10, 11] + [-1] * 8,
            [0, 1, 2, 3, 4, 5, 6, 7, 12] + [-1] * 7,
        ],
    )
    np.testing.assert_array_equal(np.asarray(counts), [8, 9])


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"read_block": 0}, "read_block"),
        ({"read_block": True}, "read_block"),
        ({"read_block": 2, "block": 0}, "block"),
        ({"read_block": 1, "num_rows": -1}, "num_rows"),
        ({"read_block": 1, "num_rows": 3.0}, "num_rows"),
    ],
)
def test_bad_static_arguments(kw, name):
    units = UnitRows(*(jnp.zeros((1, 1), jnp.int32),) * 2, *(jnp.zeros((1,), jnp.int32),) * 2)
    with pytest.raises(ValueError, match=name):
        selected_rows(units, **kw)


def test_empty_shapes():
    for n, k in ((0, 3), (4, 0)):
        units = UnitRows(
            first_row=jnp.zeros((n, k), jnp.int32),
            first_pos=jnp.zeros((n, k), jnp.int32),
            position=jnp.zeros((n,), jnp.int32),
            kv_len=jnp.ones((n,), jnp.int32),
        )
        for rb, num_rows in ((2, None), (1, 0), (1, 100)):
            rows, counts = selected_rows(units, read_block=rb, block=8, num_rows=num_rows)
            assert rows.shape == (n, row_table_width(k, rb, 8)) and counts.shape == (n,)
            assert not np.asarray(counts).any()


@pytest.mark.parametrize("num_rows", [5000, 2**24 - 1, 2**31 - 2])
def test_packed_sort_matches_batched(num_rows):
    """``sort_rows``: the packed 1-D sort (or its fallback) gives ``jnp.sort``'s rows."""
    rng = np.random.default_rng(num_rows)
    n, k = 256, 96  # 8 query bits: 2**24 - 1 packs exactly into 32, 2**31 - 2 falls back
    key = rng.integers(0, min(num_rows, 300), (n, k), dtype=np.int32)  # many repeats
    key[rng.random((n, k)) < 0.2] = num_rows - 1  # the highest row
    key[rng.random((n, k)) < 0.2] = ABSENT
    got = jax.jit(sort_rows, static_argnums=1)(jnp.asarray(key), num_rows)
    np.testing.assert_array_equal(np.asarray(got), np.sort(key, axis=1))
    packed = "u32[24576]" in str(jax.make_jaxpr(sort_rows, static_argnums=1)(key, num_rows))
    assert packed == (num_rows < 2**31 - 2)  # which of the two sorts ran


# --------------------------------------------------------------------------------------
# Arbitrary tiling UnitRows (duplicates, aliases at other positions): the union


@st.composite
def unit_rows(draw):
    n = 5
    k = draw(st.sampled_from([1, 4]))
    rb = draw(st.sampled_from([1, 3, 5]))
    ints = lambda lo, hi, size: np.array(  # noqa: E731
        draw(st.lists(st.integers(lo, hi), min_size=size, max_size=size)), np.int32
    )
    # Units tile the store (the precondition): first rows = base + multiple of rb per query.
    base = ints(0, 6, n)[:, None]
    unit = ints(-1, 6, n * k).reshape(n, k)
    first_row = np.where(unit >= 0, base + unit * rb, -1).astype(np.int32)
    first_pos = ints(0, 20, n * k).reshape(n, k)  # any: aliases of one unit included
    return UnitRows(first_row, first_pos, ints(-2, 25, n), ints(0, 25, n)), rb


def unit_rows_oracle(units: UnitRows, rb: int) -> list[set[int]]:
    sets = []
    for i in range(units.first_row.shape[0]):
        s = set()
        for k in range(units.first_row.shape[1]):
            row0, pos0 = int(units.first_row[i, k]), int(units.first_pos[i, k])
            if row0 < 0:
                continue
            for r in range(rb):
                if pos0 + r <= units.position[i] and pos0 + r < units.kv_len[i]:
                    s.add(row0 + r)
        sets.append(s)
    return sets


@pytest.mark.parametrize("repeats", [False, True])
@pytest.mark.parametrize("num_rows", [None, 4096])
def test_token_rows_with_and_without_repeats(repeats, num_rows):
    """Token-level tables: a batch with no repeated row takes the sorted keys as they
    are, one with a repeat (in one query) the compaction; both give the brute force's
    table, with ``-1``, causal and ``kv_len`` cuts in every query."""
    rng = np.random.default_rng(7)
    n, k = 16, 40
    first_row = np.stack([rng.choice(4000, k, replace=False) for _ in range(n)]).astype(np.int32)
    first_row[rng.random((n, k)) < 0.15] = -1
    if repeats:
        first_row[3, 5] = first_row[3, 6] = 17  # one query's row twice
    first_pos = first_row.copy()  # one request: positions are rows
    position = rng.integers(1000, 4000, n).astype(np.int32)
    kv_len = rng.integers(2000, 4001, n).astype(np.int32)
    units = UnitRows(*map(jnp.asarray, (first_row, first_pos, position, kv_len)))
    sets = [
        {int(r) for r in first_row[i] if 0 <= r <= position[i] and r < kv_len[i]} for i in range(n)
    ]
    got = _selected_rows(units, read_block=1, block=64, num_rows=num_rows)
    _check(got, sets, row_table_width(k, 1, 64))


# ~5 s on 2 cores: in the full tier; the flat and ragged units below are UnitRows too,
# through the same selected_rows, checked quickly against brute force by the next two.
@pytest.mark.slow
@settings(max_examples=tier_examples(80, quick=3), deadline=None)
@given(unit_rows(), st.sampled_from(BLOCKS), st.sampled_from(NUM_ROWS), st.booleans())
def test_unit_rows_vs_brute_force(p, block, num_rows, scatter):
    units, rb = p  # rows below 6 + 6 * 5 + 5 <= 64
    units = UnitRows(*map(jnp.asarray, units))
    got = _selected_rows(units, read_block=rb, block=block, num_rows=num_rows, scatter=scatter)
    want = unit_rows_oracle(UnitRows(*map(np.asarray, units)), rb)
    _check(got, want, row_table_width(units.first_row.shape[1], rb, block))


# --------------------------------------------------------------------------------------
# Flat mode: raw ids -> rows of kv.reshape(B * T, Dk)


@st.composite
def flat_problems(draw):
    batch, seq = 2, 4  # few shapes: few compiles
    top_k = draw(st.sampled_from([1, 5]))
    read_block = draw(st.sampled_from([1, 4, 7]))
    num_tokens = draw(st.integers(1, 40))
    units = _cdiv(num_tokens, read_block)
    pool = st.one_of(
        st.integers(0, units - 1),  # real units, duplicates by chance
        st.integers(-3, -1),  # none
        st.integers(units, units + 3),  # out of range
        st.sampled_from([2**30, -(2**20)]),
    )
    size = batch * seq * top_k
    idx = np.array(draw(st.lists(pool, min_size=size, max_size=size)), np.int32)
    pos = draw(
        st.lists(st.integers(-2, num_tokens + 4), min_size=batch * seq, max_size=batch * seq)
    )
    idx = idx.reshape(batch, seq, top_k)
    return idx, np.array(pos, np.int32).reshape(batch, seq), num_tokens, read_block


def flat_oracle(idx, pos, num_tokens: int, read_block: int) -> list[set[int]]:
    """Rows ``b * T + t`` with ``t // read_block`` a selected id, ``t <= pos``, ``t < T``."""
    batch, seq, _ = idx.shape
    sets = []
    for b in range(batch):
        for s in range(seq):
            ids = {int(u) for u in idx[b, s]}
            sets.append(
                {
                    b * num_tokens + t
                    for t in range(num_tokens)
                    if t // read_block in ids and t <= pos[b, s]
                }
            )
    return sets


@settings(max_examples=tier_examples(80, quick=3), deadline=None)
@given(flat_problems(), st.sampled_from(BLOCKS), st.sampled_from(NUM_ROWS), st.booleans())
def test_flat_vs_brute_force(p, block, num_rows, scatter):
    idx, pos, num_tokens, rb = p  # 8 queries, rows below 2 * 40
    units = flat_units(
        jnp.asarray(idx),
        jnp.asarray(pos),
        kv_len=num_tokens,
        read_block=rb,
        num_units=_cdiv(num_tokens, rb),
    )
    if num_rows == 64:
        num_rows = 2 * num_tokens  # the store's rows, as the op passes them
    got = _selected_rows(units, read_block=rb, block=block, num_rows=num_rows, scatter=scatter)
    _check(got, flat_oracle(idx, pos, num_tokens, rb), row_table_width(idx.shape[2], rb, block))


# --------------------------------------------------------------------------------------
# Ragged paged mode: request-local page ids -> rows of kv.reshape(num_pages * P, Dk_pad)


@st.composite
def ragged_problems(draw):
    seed = draw(st.integers(0, 2**16))
    page_size = draw(st.sampled_from([16, 32]))
    n_seq = draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.integers(0, 80), min_size=n_seq, max_size=n_seq))
    new_lens = [draw(st.integers(0, min(s, 6))) for s in seq_lens]
    if sum(new_lens) == 0:
        seq_lens[0], new_lens[0] = max(seq_lens[0], 1), 1
    extra = draw(st.lists(st.integers(0, 2), min_size=n_seq, max_size=n_seq))
    top_k = draw(st.sampled_from([2, 5]))
    rng = rng_for(seed)
    layout = build_ragged_layout(
        rng, seq_lens=seq_lens, new_lens=new_lens, extra_pages=extra, page_size=page_size
    )
    idx = random_page_selection(rng, layout, top_k, page_size)
    huge = rng.random(idx.shape) < 0.05
    idx = np.where(huge, rng.choice([2**30, -(2**20)], idx.shape), idx).astype(np.int32)
    # Positions that cut pages (earlier than the new tokens) or pass kv_len.
    pos = layout["positions"] + rng.integers(-40, 10, layout["positions"].shape)
    page_indices = layout["page_indices"].copy()
    if draw(st.booleans()) and len(page_indices) > 1:  # two slots alias one physical page
        page_indices[rng.integers(len(page_indices))] = page_indices[0]
    if draw(st.booleans()):  # a slot off the cache (a cache never read for that slot)
        page_indices[rng.integers(len(page_indices))] = draw(st.sampled_from([-1, 10**6]))
    layout["page_indices"] = page_indices.astype(np.int32)
    return layout, idx, pos.astype(np.int32), page_size


def ragged_oracle(layout, idx, pos, page_size: int) -> list[set[int]]:
    """Physical rows of tokens ``j`` of selected local pages with ``j <= pos``, ``j <
    seq_len``; a local page ``p`` is selected iff ``0 <= p < extent``, its slot is in the
    page table and its physical page in the cache."""
    cu, seq_lens, table = layout["cu_kv_lens"], layout["seq_lens"], layout["page_indices"]
    sets = []
    for i, r in enumerate(layout["q_seq_id"]):
        base, extent = cu[r] // page_size, (cu[r + 1] - cu[r]) // page_size
        s = set()
        for p in {int(x) for x in idx[i]}:
            if not (0 <= p < extent and base + p < len(table)):
                continue
            phys = int(table[base + p])
            if not 0 <= phys < layout["num_pages"]:
                continue
            for j in range(p * page_size, (p + 1) * page_size):
                if j <= pos[i] and j < seq_lens[r]:
                    s.add(phys * page_size + j % page_size)
        sets.append(s)
    return sets


def _pad(x, size: int, fill: int) -> np.ndarray:
    return np.concatenate([x, np.full((size - len(x), *x.shape[1:]), fill, x.dtype)])


@settings(max_examples=tier_examples(60, quick=3), deadline=None)
@given(ragged_problems(), st.sampled_from(BLOCKS), st.booleans())
def test_ragged_vs_brute_force(p, block, scatter):
    layout, idx, pos, page_size = p
    num_q = len(idx)
    # Fixed shapes (few compiles): padded queries (position -1) attend nothing, padded
    # requests are empty, padded page-table slots belong to no request.
    cu = layout["cu_kv_lens"]
    units = ragged_units(
        jnp.asarray(_pad(idx, RAGGED_Q, 0))[None],
        jnp.asarray(_pad(pos, RAGGED_Q, -1))[None],
        jnp.asarray(_pad(layout["q_seq_id"], RAGGED_Q, 0)),
        jnp.asarray(_pad(layout["seq_lens"], RAGGED_SEQS, 0)),
        jnp.asarray(_pad(cu, RAGGED_SEQS + 1, cu[-1])),
        jnp.asarray(_pad(layout["page_indices"], RAGGED_SLOTS, -1)),
        page_size=page_size,
        num_pages=layout["num_pages"],
    )
    got = _selected_rows(units, read_block=page_size, block=block, scatter=scatter)
    width = row_table_width(idx.shape[1], page_size, block)
    want = ragged_oracle(layout, idx, pos, page_size) + [set()] * (RAGGED_Q - num_q)
    _check(got, want, width)


# ~2.5 s on 2 cores: the jitted tables are checked quickly by the brute-force tests above,
# the eager ones by test_example and test_flat_attention_over_rows_equals_reference.
@pytest.mark.slow
def test_jit_equals_eager():
    rng = rng_for(3)
    idx = rng.integers(-2, 12, (2, 7, 5)).astype(np.int32)
    pos = rng.integers(0, 40, (2, 7)).astype(np.int32)
    units = flat_units(jnp.asarray(idx), jnp.asarray(pos), kv_len=40, read_block=4, num_units=10)

    @jax.jit
    def traced(units):
        return selected_rows(units, read_block=4)

    for got, want in zip(traced(units), selected_rows(units, read_block=4), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _check(traced(units), flat_oracle(idx, pos, 40, 4), 64)


# --------------------------------------------------------------------------------------
# Attention over the gathered rows equals the reference


def attend_rows_f64(q, store, rows, counts, *, sm_scale: float, dv: int):
    """Dense masked softmax in float64 over ``store[rows]``: q ``[N, H, Dk]`` -> out
    ``[N, H, dv]``, lse ``[N, H]`` (-inf and 0 for a query with no row)."""
    q, store = upcast(q), upcast(store)
    rows, counts = np.asarray(rows), np.asarray(counts)
    dk = q.shape[-1]
    assert np.all((rows == -1) == (np.arange(rows.shape[1]) >= counts[:, None]))
    keys = store[np.maximum(rows, 0), :dk]  # [N, Kp, Dk]; -1 rows masked below
    valid = rows >= 0
    s = np.einsum("nhd,nkd->nhk", q, keys) * sm_scale
    s = np.where(valid[:, None, :], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    z = p.sum(axis=-1)
    out = np.einsum("nhk,nkd->nhd", p, keys[..., :dv]) / np.where(z > 0, z, 1.0)[..., None]
    lse = np.where(z > 0, m[..., 0] + np.log(np.where(z > 0, z, 1.0)), -np.inf)
    return out, lse


def _compare(out, lse, want_out, want_lse):
    out, lse = np.asarray(out), np.asarray(lse)
    empty = np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert empty.any() and (~empty).any()
    np.testing.assert_allclose(lse[~empty], want_lse[~empty], atol=1e-4)
    err = np.linalg.norm(out - want_out) / np.linalg.norm(want_out)
    assert err < 1e-5, err
    assert np.all(out[empty] == 0) and np.all(want_out[empty] == 0)


# read_block 16 in the full tier; its rows are checked quickly by test_flat_vs_brute_force.
@pytest.mark.parametrize("read_block", [1, pytest.param(16, marks=pytest.mark.slow)])
def test_flat_attention_over_rows_equals_reference(read_block):
    rng = rng_for(10 + read_block)
    batch, seq, heads, dk, dv, num_tokens, top_k = 2, 9, 3, 40, 32, 45, 6
    q = randn(rng, (batch, seq, heads, dk))
    kv = randn(rng, (batch, num_tokens, dk))
    units = _cdiv(num_tokens, read_block)
    idx = rng.integers(-1, units + 2, (batch, seq, top_k)).astype(np.int32)
    idx[..., -1] = idx[..., 0]  # duplicates
    idx[0, 0] = -1  # a query with nothing selected
    pos = rng.integers(0, num_tokens + 4, (batch, seq)).astype(np.int32)
    kw = {"sm_scale": 0.21, "kv_lora_rank": dv, "read_block": read_block}
    want_out, want_lse = sparse_mla_attention(q, kv, idx, pos, return_lse=True, **kw)
    problem = check_sparse_mla_inputs(q, kv, idx, pos, **kw)
    units_, store = sparse_mla_units(problem, jnp.asarray(kv), jnp.asarray(idx), jnp.asarray(pos))
    rows, counts = selected_rows(units_, read_block=read_block)
    out, lse = attend_rows_f64(
        q.reshape(batch * seq, heads, dk), store, rows, counts, sm_scale=0.21, dv=dv
    )
    _compare(
        out.reshape(want_out.shape),
        lse.reshape(want_lse.shape),
        np.asarray(want_out),
        np.asarray(want_lse),
    )


# ~5.5 s on 2 cores: attention over the rows is checked quickly in flat mode
# (test_flat_attention_over_rows_equals_reference), the ragged rows by
# test_ragged_vs_brute_force.
@pytest.mark.slow
def test_ragged_attention_over_rows_equals_reference():
    page_size, dv, dk_pad = 16, 32, 128
    layout, cache, q, idx, pos = sparse_mla_ragged_case(
        20,
        seq_lens=[37, 64, 5, 50],
        new_lens=[9, 16, 0, 5],
        extra_pages=[1, 0, 2, 0],
        page_size=page_size,
        heads=4,
        top_k=5,
        dk=40,
        dk_pad=dk_pad,
        dtype="float32",  # pk = 1
    )
    tables = {k: layout[k] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")}
    kw = {"sm_scale": 0.19, "kv_lora_rank": dv, "read_block": page_size, "page_size": page_size}
    want_out, want_lse = sparse_mla_attention(
        q, cache, idx[None], pos[None], return_lse=True, **kw, **tables
    )
    problem = check_sparse_mla_inputs(q, cache, idx[None], pos[None], **kw, **tables)
    units, store = sparse_mla_units(
        problem,
        jnp.asarray(cache),
        jnp.asarray(idx)[None],
        jnp.asarray(pos)[None],
        page_size=page_size,
        **{k: jnp.asarray(v) for k, v in tables.items()},
    )
    assert store.shape == (layout["num_pages"] * page_size, dk_pad)
    rows, counts = selected_rows(units, read_block=page_size)
    out, lse = attend_rows_f64(q[0], store, rows, counts, sm_scale=0.19, dv=dv)
    _compare(out[None], lse[None], np.asarray(want_out), np.asarray(want_lse))
