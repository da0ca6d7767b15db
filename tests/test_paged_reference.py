"""Ragged paged sparse MLA, paged_write_back and prefill_write_and_attend_ragged reference
vs the independent float64 / numpy oracles (docs/design.md)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_sparse_mla_close,
    poison_ragged_case,
    randn,
    rng_for,
    sparse_mla_ragged_call,
    sparse_mla_ragged_case,
    upcast,
)
from jax.experimental import checkify
from oracle import scatter_oracle, sparse_mla_oracle_ragged

from attn_reference import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
    sparse_mla_attention,
    sparse_mla_attention_qblock,
)

DV, ROPE = 32, 8
DK = DV + ROPE  # 40
DK_PAD = 128
HEADS = 4
TOP_K = 5
SM_SCALE = 0.19
# Request 0: 37 tokens (not a page multiple); request 2 has no new queries.
SEQ_LENS = [37, 64, 5, 50, 20]
NEW_LENS = [9, 16, 0, 5, 20]
EXTRA_PAGES = [1, 0, 2, 0, 1]

CASES = [(16, "bfloat16"), (16, "float32"), (32, "bfloat16"), (32, "float32")]
CASE_IDS = [f"ps{p}-{d}" for p, d in CASES]
# Each page size x dtype compiles the ops again: the quick tier (-m "not slow") runs the
# write tests at two of them (each page size and each dtype once), the full tier at all.
QUICK_CASES = [(16, "bfloat16"), (32, "float32")]


def _cases_with(values, quick=QUICK_CASES):
    """``(page_size, dtype, value)`` for CASES x ``values``; outside ``quick``: slow."""
    return [
        pytest.param(
            page_size, dtype, x, id=f"ps{page_size}-{dtype}-{x}",
            marks=() if (page_size, dtype) in quick else pytest.mark.slow,
        )
        for page_size, dtype in CASES
        for x in values
    ]  # fmt: skip


def _pk(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 1


def make_case(seed: int, page_size: int, dtype: str):
    """Layout, random cache (junk in the feature padding, spare pages and past seq_len),
    q and selections; two queries get positions past their request's kv length."""
    return sparse_mla_ragged_case(
        seed, seq_lens=SEQ_LENS, new_lens=NEW_LENS, extra_pages=EXTRA_PAGES,
        page_size=page_size, heads=HEADS, top_k=TOP_K, dk=DK, dk_pad=DK_PAD, dtype=dtype,
    )  # fmt: skip


def _ragged_call(fn, layout, cache, q, idx, positions, page_size, **kw):
    case = (layout, cache, q, idx, positions)
    return sparse_mla_ragged_call(fn, case, page_size, sm_scale=SM_SCALE, dv=DV, **kw)


def _ragged_oracle(layout, cache, q, idx, positions, page_size):
    return sparse_mla_oracle_ragged(
        upcast(q),
        upcast(cache),
        idx,
        positions,
        layout["q_seq_id"],
        layout["seq_lens"],
        layout["cu_kv_lens"],
        layout["page_indices"],
        page_size=page_size,
        sm_scale=SM_SCALE,
        dv=DV,
    )


def _check(out, lse, want_out, want_lse):
    assert_sparse_mla_close(
        (out, lse), (want_out, want_lse), rtol_l2=1e-5, atol=1e-5, lse_atol=1e-4
    )


@pytest.mark.parametrize(("page_size", "dtype"), CASES, ids=CASE_IDS)
def test_ragged_vs_oracle(page_size, dtype):
    layout, cache, q, idx, positions = make_case(60, page_size, dtype)
    out, lse = _ragged_call(sparse_mla_attention, layout, cache, q, idx, positions, page_size)
    assert out.shape == (1, q.shape[1], HEADS, DV)
    want_out, want_lse = _ragged_oracle(layout, cache, q, idx, positions, page_size)
    assert np.isneginf(want_lse[0, 3]).all()
    assert np.isfinite(want_lse).mean() > 0.8
    _check(out, lse, want_out, want_lse)


def test_ragged_under_jit():
    """Tables as numpy constants closed over by jit, or as traced jit arguments."""
    layout, cache, q, idx, positions = make_case(64, 16, "bfloat16")
    want = _ragged_call(sparse_mla_attention, layout, cache, q, idx, positions, 16)

    @jax.jit
    def closed(q, cache, idx, positions):
        return _ragged_call(sparse_mla_attention, layout, cache, q, idx, positions, 16)

    @jax.jit
    def traced(q, cache, idx, positions, tables):
        return _ragged_call(sparse_mla_attention, tables, cache, q, idx, positions, 16)

    tables = {k: layout[k] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")}
    for got in (closed(q, cache, idx, positions), traced(q, cache, idx, positions, tables)):
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(("page_size", "dtype"), CASES[:2], ids=CASE_IDS[:2])
def test_ragged_ids_outside_extent_ignored(page_size, dtype):
    """Ids < 0 or >= the request's own extent select nothing (never another request)."""
    layout, cache, q, idx, positions = make_case(61, page_size, dtype)
    extents = layout["extents"][layout["q_seq_id"]][:, None]
    cleaned = np.where((idx >= 0) & (idx < extents), idx, -1).astype(np.int32)
    assert (cleaned != idx).any()
    a = _ragged_call(sparse_mla_attention, layout, cache, q, idx, positions, page_size)
    b = _ragged_call(sparse_mla_attention, layout, cache, q, cleaned, positions, page_size)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(("query_block", "u_max"), [(None, None), (8, 3), (4, 1), (256, 6)])
def test_ragged_qblock_equals_plain(query_block, u_max):
    """Blocks straddle requests; any query_block / u_max gives the plain answer."""
    layout, cache, q, idx, positions = make_case(62, 16, "float32")
    a = _ragged_call(
        sparse_mla_attention_qblock,
        layout,
        cache,
        q,
        idx,
        positions,
        16,
        query_block=query_block,
        u_max=u_max,
    )
    b = _ragged_call(sparse_mla_attention, layout, cache, q, idx, positions, 16)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(("page_size", "dtype"), CASES, ids=CASE_IDS)
def test_ragged_unattended_rows_may_hold_nan_and_inf(page_size, dtype):
    """NaN / +-Inf in page tails past seq_len, spare and unselected pages and the feature
    padding: the result equals the oracle on the clean cache."""
    case = make_case(64, page_size, dtype)
    layout, cache, q, idx, positions = case
    dirty = poison_ragged_case(case, page_size, dk=DK, seed=64)[1]
    out, lse = _ragged_call(sparse_mla_attention, layout, dirty, q, idx, positions, page_size)
    clean = _ragged_call(sparse_mla_attention, layout, cache, q, idx, positions, page_size)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean[0]))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean[1]))
    want_out, want_lse = _ragged_oracle(layout, cache, q, idx, positions, page_size)
    if dtype == "float32":
        _check(out, lse, want_out, want_lse)


# --------------------------------------------------------------------------------------
# paged_write_back


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _assert_bit_identical(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _write_case(seed, page_size, dtype, rows_dtype):
    rng = rng_for(seed)
    pk = _pk(dtype)
    num_pages = 7
    slots = num_pages * page_size
    cache = randn(rng, (num_pages, page_size // pk, pk, DK_PAD), dtype)
    num_rows = 40
    rows = randn(rng, (num_rows, DK_PAD), rows_dtype)
    loc = rng.permutation(slots - 1)[:num_rows].astype(np.int64)  # distinct valid slots
    kind = rng.random(num_rows)
    loc = np.where(kind < 0.15, -1, loc)
    loc = np.where((kind >= 0.15) & (kind < 0.25), slots + rng.integers(0, 50, num_rows), loc)
    loc = np.where((kind >= 0.25) & (kind < 0.3), -rng.integers(2, 10**6, num_rows), loc)
    loc[:2] = [slots - 1, slots]  # the last slot, and one past it
    return cache, rows, loc.astype(np.int32)


@pytest.mark.parametrize(("page_size", "dtype", "rows_dtype"), _cases_with(["float32", "same"]))
def test_paged_write_back_random(page_size, dtype, rows_dtype):
    rows_dtype = dtype if rows_dtype == "same" else rows_dtype
    cache, rows, loc = _write_case(70, page_size, dtype, rows_dtype)
    # Traced loc: slots past the cache are dropped (host values are refused, below).
    write = jax.jit(functools.partial(paged_write_back, page_size=page_size))
    new = write(cache, rows, loc)
    _assert_bit_identical(new, scatter_oracle(cache, rows, loc))
    assert not np.array_equal(_bits(new), _bits(cache))


def test_paged_write_back_refuses_host_loc_past_the_cache():
    cache, rows, loc = _write_case(70, 16, "bfloat16", "float32")
    with pytest.raises(ValueError, match=r"loc: entry 1 is 112, expected a cache slot < .* 112"):
        paged_write_back(cache, rows, loc, page_size=16)
    # Under jit with debug_checks: a checkify error naming loc.
    checked = checkify.checkify(
        jax.jit(functools.partial(paged_write_back, page_size=16, debug_checks=True))
    )
    err, _ = checked(cache, rows, jnp.asarray(loc))
    with pytest.raises(checkify.JaxRuntimeError, match="loc: entry"):
        err.throw()
    with pytest.raises(TypeError, match="rows: got dtype int32 for a bfloat16 cache"):
        paged_write_back(cache, rows.astype(np.int32), np.maximum(loc, -1) % 112, page_size=16)


@pytest.mark.parametrize(("page_size", "dtype"), CASES, ids=CASE_IDS)
def test_paged_write_back_runs(page_size, dtype):
    """Contiguous runs (the kernel's DMA path): unaligned starts crossing pages, a gap."""
    rng = rng_for(71)
    pk = _pk(dtype)
    cache = randn(rng, (6, page_size // pk, pk, DK_PAD), dtype)
    loc = np.concatenate(
        [np.arange(3, 3 + 37), [-1, -1], np.arange(page_size * 4 + 1, page_size * 4 + 20)]
    )
    rows = randn(rng, (loc.shape[0], DK_PAD), "float32")
    new = paged_write_back(cache, rows, loc.astype(np.int32), page_size=page_size, r_cap=1)
    _assert_bit_identical(new, scatter_oracle(cache, rows, loc))


def test_paged_write_back_duplicate_slots_last_write_wins():
    """A slot listed more than once takes its last row, as a sequential write would."""
    rng = rng_for(72)
    cache = randn(rng, (4, 8, 2, DK_PAD), "bfloat16")
    loc = np.asarray([5, 6, 7, 5, 9, 6, 6, -1, 40, 41, 40], np.int32)
    rows = randn(rng, (loc.shape[0], DK_PAD), "float32")
    new = paged_write_back(cache, rows, loc, page_size=16)
    _assert_bit_identical(new, scatter_oracle(cache, rows, loc))
    flat = np.asarray(new).reshape(-1, DK_PAD)
    np.testing.assert_array_equal(upcast(flat[6]), upcast(rows[6].astype(cache.dtype)))


# --------------------------------------------------------------------------------------
# prefill_write_and_attend_ragged


def _new_token_slots(layout, page_size):
    """Flat cache slot of each new token, from the layout rule (independently of the ref)."""
    slots = []
    for r, (n_kv, n_new) in enumerate(zip(layout["seq_lens"], layout["new_lens"], strict=True)):
        base = int(layout["cu_kv_lens"][r]) // page_size
        for j in range(int(n_kv) - int(n_new), int(n_kv)):
            phys = int(layout["page_indices"][base + j // page_size])
            slots.append(phys * page_size + j % page_size)
    return np.asarray(slots, np.int32)


# Quick at one page size and dtype (the others are those of the attention and write-back
# tests above).
@pytest.mark.parametrize(
    ("page_size", "dtype", "kpe_rank"), _cases_with([2, 3], quick=[(16, "bfloat16")])
)
def test_prefill_write_and_attend(page_size, dtype, kpe_rank):
    layout, cache, _, idx, _ = make_case(80, page_size, dtype)
    rng = rng_for(81)
    num_q = int(sum(NEW_LENS))
    ql = randn(rng, (num_q, HEADS, DV), dtype)
    qpe = randn(rng, (num_q, HEADS, ROPE), dtype)
    kvc = randn(rng, (num_q, DV), dtype)
    kpe = randn(rng, (num_q, ROPE) if kpe_rank == 2 else (num_q, 1, ROPE), dtype)
    loc = _new_token_slots(layout, page_size)
    loc[7] = -1  # one token not written: attention then reads the old cache row
    positions = layout["positions"]
    args = (
        ql,
        qpe,
        kvc,
        kpe,
        cache,
        idx,
        positions,
        loc,
        layout["seq_lens"],
        layout["cu_q_lens"],
        layout["cu_kv_lens"],
        layout["page_indices"],
    )
    kw = {"kv_lora_rank": DV, "page_size": page_size, "sm_scale": SM_SCALE}
    out, new_cache = prefill_write_and_attend_ragged(*args, **kw)
    assert out.shape == (num_q, HEADS, DV) and out.dtype == np.float32

    rows = np.zeros((num_q, DK_PAD), np.float32)
    rows[:, :DV] = upcast(kvc)
    rows[:, DV:DK] = upcast(kpe).reshape(num_q, ROPE)
    want_cache = scatter_oracle(cache, rows.astype(cache.dtype), loc)
    _assert_bit_identical(new_cache, want_cache)

    q = np.concatenate([upcast(ql), upcast(qpe)], axis=-1)[None]
    want_out, want_lse = _ragged_oracle(layout, want_cache, q, idx, positions, page_size)
    assert_close(np.asarray(out), want_out[0], rtol_l2=1e-5, atol=1e-5)
    empty = np.isneginf(want_lse[0])
    assert np.all(np.asarray(out)[empty] == 0.0)

    qb_out, qb_cache = prefill_write_and_attend_ragged_qblock(*args, **kw, query_block=8)
    np.testing.assert_array_equal(np.asarray(qb_out), np.asarray(out))
    _assert_bit_identical(qb_cache, new_cache)

    if kpe_rank == 2:  # under jit, every table traced
        j_out, j_cache = jax.jit(functools.partial(prefill_write_and_attend_ragged, **kw))(*args)
        np.testing.assert_array_equal(np.asarray(j_out), np.asarray(out))
        _assert_bit_identical(j_cache, new_cache)
