"""paged_write_back and the prefill wrappers vs the reference, in TPU interpret mode.

The write-back DMA kernel (dynamic-size HBM->HBM runs and word read-modify-writes) runs
in jax 0.11.2's TPU interpret mode; the tests call the kernel path directly (no
fallback possible) and through the public function with a run table that fits and one
that overflows (scatter fallback). Results must be bit-identical to the scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_close, assert_no_races, randn, rng_for, tpu_interpret

import attn_reference as ref
from attn_common import kv_packing
from attn_common.tables import TOKEN_RUN, build_write_runs
from attn_pallas_tpu import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
)
from attn_pallas_tpu.paged import _write_back_call

INTERPRET = tpu_interpret()
NUM_PAGES, PAGE, FEAT = 6, 16, 128
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "int8": np.int8}


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8).reshape((*x.shape, -1))


def _case(seed, dtype, loc):
    rng = rng_for(seed)
    pk = kv_packing(dtype)
    dt = DTYPES[dtype]
    shape = (NUM_PAGES, PAGE // pk, pk, FEAT)
    if dtype == "int8":
        cache = rng.integers(-128, 128, size=shape).astype(dt)
        rows = rng.integers(-128, 128, size=(len(loc), FEAT)).astype(dt)
    else:
        cache, rows = randn(rng, shape, dt), randn(rng, (len(loc), FEAT), dt)
    return jnp.asarray(cache), jnp.asarray(rows), jnp.asarray(np.asarray(loc, np.int32))


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_write_back_overlapping_runs_last_write_wins(dtype):
    """Runs that overlap (a re-sent chunk, a repeated slot): the last row of each slot
    wins, as a sequential write would; never DMA order."""
    loc = [*range(10, 30), *range(20, 36), 5, 5, -1, 5, *range(60, 70), 64, 33]
    cache, rows, loc = _case(8, dtype, loc)
    new = paged_write_back(cache, rows, loc, page_size=PAGE, interpret=INTERPRET)
    assert_no_races()
    want = ref.paged_write_back(cache, rows, loc, page_size=PAGE)
    np.testing.assert_array_equal(_bits(new), _bits(want))
    flat = np.asarray(new).reshape(-1, FEAT)
    last = {}
    for t, slot in enumerate(np.asarray(loc)):
        if slot >= 0:
            last[int(slot)] = t
    for slot, t in last.items():
        np.testing.assert_array_equal(_bits(flat[slot]), _bits(np.asarray(rows)[t]))


# Contiguous runs at odd and even word phases, a run crossing a page boundary, -1 slots,
# an out-of-range slot, single tokens, and a run whose source and destination phases
# differ (all token RMWs).
LOC = [*range(17, 26), -1, 3, 10_000, *range(40, 51), -1, 66, *range(80, 85), 95]


@pytest.mark.parametrize(
    "dtype", [pytest.param(d, marks=pytest.mark.slow) if d == "float32" else d for d in DTYPES]
)
def test_write_back_bit_identical(dtype):
    cache, rows, loc = _case(1, dtype, LOC)
    # Traced loc: the slot past the cache is dropped (host values are refused).
    want = jax.jit(functools.partial(ref.paged_write_back, page_size=PAGE))(cache, rows, loc)
    write = functools.partial(paged_write_back, page_size=PAGE, interpret=INTERPRET)
    got = jax.jit(write)(cache, rows, loc)
    assert_no_races()
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not np.array_equal(_bits(got), _bits(cache))


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("int8", marks=pytest.mark.slow)])
def test_write_back_kernel_path_directly(dtype):
    """The DMA kernel alone (no lax.cond): word runs plus token read-modify-writes."""
    cache, rows, loc = _case(2, dtype, LOC)
    pk = kv_packing(cache.dtype)
    slots = NUM_PAGES * PAGE
    loc_ok = jnp.where((loc >= 0) & (loc < slots), loc, -1)
    pad = -len(LOC) % pk
    rows_p = jnp.pad(rows, ((0, pad), (0, 0)))
    loc_p = jnp.pad(loc_ok, (0, pad), constant_values=-1)
    runs = build_write_runs(loc_p, kv_packing=pk, r_cap=16)
    assert int(runs.num_runs) <= 16
    table = np.asarray(runs.table)
    assert ((table[:, 0] == TOKEN_RUN) & (table[:, 3] > 0)).any()  # odd phases present
    out = _write_back_call(
        cache.reshape(slots // pk, pk, FEAT),
        rows_p.reshape(-1, pk, FEAT),
        runs.table.reshape(-1),
        interpret=INTERPRET,
    )
    assert_no_races()
    want = jax.jit(functools.partial(ref.paged_write_back, page_size=PAGE))(cache, rows, loc)
    np.testing.assert_array_equal(_bits(out.reshape(cache.shape)), _bits(want))


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_write_back_fragmented_loc_falls_back(dtype):
    """More runs than r_cap: the scatter fallback, still bit-identical."""
    loc = list(range(0, 90, 3))  # 30 single-token runs
    cache, rows, loc = _case(3, dtype, loc)
    runs = build_write_runs(loc, kv_packing=kv_packing(cache.dtype), r_cap=4)
    assert int(runs.num_runs) > 4
    want = ref.paged_write_back(cache, rows, loc, page_size=PAGE)
    got = paged_write_back(cache, rows, loc, page_size=PAGE, r_cap=4, interpret=INTERPRET)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def test_write_back_all_dropped_and_validation():
    cache, rows, _ = _case(4, "bfloat16", [0] * 5)
    loc = jnp.asarray([-1, -1, 999, -7, -1], jnp.int32)
    write = functools.partial(paged_write_back, page_size=PAGE, interpret=INTERPRET)
    got = jax.jit(write)(cache, rows, loc)  # traced: the slot past the cache is dropped
    np.testing.assert_array_equal(_bits(got), _bits(cache))
    with pytest.raises(ValueError, match="loc: entry 2 is 999"):  # host values: refused
        write(cache, rows, loc)
    with pytest.raises(ValueError, match="cache"):
        paged_write_back(cache, rows, loc, page_size=32)
    with pytest.raises(ValueError, match="rows"):
        paged_write_back(cache, rows[:, :64], loc, page_size=PAGE)
    with pytest.raises(ValueError, match="loc"):
        paged_write_back(cache, rows, loc[:3], page_size=PAGE)
    with pytest.raises(TypeError, match="loc"):
        paged_write_back(cache, rows, loc.astype(jnp.float32), page_size=PAGE)
    with pytest.raises(ValueError, match="r_cap"):
        paged_write_back(cache, rows, loc, page_size=PAGE, r_cap=0)


# ------------------------------------------------------------------------------------
# prefill_write_and_attend_ragged(_qblock): write then attend, drop-in replacements

DV, ROPE, HEADS, TOP_K = 128, 64, 2, 4


def _prefill_case(seed, dtype, page_size=16):
    """Three requests; the new tokens' slots are the tail of each request's pages."""
    rng = rng_for(seed)
    seq_lens = np.array([40, 7, 29], np.int32)
    new_lens = np.array([9, 7, 12], np.int32)
    pages = -(-seq_lens // page_size) + 1
    cu_kv = (np.concatenate([[0], np.cumsum(pages)]) * page_size).astype(np.int32)
    num_pages = int(pages.sum()) + 2
    page_indices = rng.permutation(num_pages)[: int(pages.sum())].astype(np.int32)
    cu_q = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    total = int(new_lens.sum())
    sid = np.repeat(np.arange(3), new_lens)
    positions = np.concatenate(
        [np.arange(s - n, s) for s, n in zip(seq_lens, new_lens, strict=True)]
    )
    base = cu_kv[sid] // page_size
    phys = page_indices[base + positions // page_size]
    loc = (phys * page_size + positions % page_size).astype(np.int32)
    loc[4] = -1  # a padded token: not written
    pk = kv_packing(DTYPES[dtype])
    cache = randn(rng, (num_pages, page_size // pk, pk, 256), DTYPES[dtype])
    own = positions // page_size
    topk = rng.integers(0, pages[sid][:, None], size=(total, TOP_K))
    topk[:, 0] = own
    topk[:, 1] = np.where(rng.random(total) < 0.3, -1, topk[:, 1])
    topk[2] = -1
    args = (
        randn(rng, (total, HEADS, DV), dtype),
        randn(rng, (total, HEADS, ROPE), dtype),
        randn(rng, (total, DV), dtype),
        randn(rng, (total, ROPE), dtype),
        jnp.asarray(cache),
        topk.astype(np.int32),
        positions.astype(np.int32),
        loc,
        seq_lens,
        cu_q,
        cu_kv,
        page_indices,
    )
    return args, dict(kv_lora_rank=DV, page_size=page_size, sm_scale=0.09)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "fn", [prefill_write_and_attend_ragged, prefill_write_and_attend_ragged_qblock]
)
def test_prefill_write_and_attend_vs_reference(fn, dtype):
    args, kw = _prefill_case(5, dtype)
    out, cache = fn(*args, **kw, query_block=8, interpret=INTERPRET)
    assert_no_races()
    want_out, want_cache = ref.prefill_write_and_attend_ragged(*args, **kw)
    np.testing.assert_array_equal(_bits(cache), _bits(want_cache))
    tol = dict(rtol_l2=2e-5, atol=2e-4) if dtype == "float32" else dict(rtol_l2=2e-2, atol=5e-2)
    assert_close(np.asarray(out), np.asarray(want_out), **tol)
    assert np.all(np.asarray(out)[2] == 0.0)  # nothing selected


@pytest.mark.slow
def test_prefill_shapes_and_validation():
    args, kw = _prefill_case(6, "float32")
    out, cache = prefill_write_and_attend_ragged_qblock(*args, **kw, interpret=INTERPRET)
    assert out.shape == (args[0].shape[0], HEADS, DV) and out.dtype == jnp.float32
    assert cache.shape == args[4].shape and cache.dtype == args[4].dtype
    with pytest.raises(ValueError, match="ql"):
        prefill_write_and_attend_ragged(*args, **{**kw, "kv_lora_rank": 64})
