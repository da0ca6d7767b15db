"""Sparse-MLA TPU kernels vs the reference, run in Pallas TPU interpret mode on the CPU.

Interpret mode runs the kernels' DMAs, semaphores and VMEM/SMEM refs on the CPU with the
race detector on, out-of-bounds reads raising and uninitialised memory (including the
output buffers) filled with NaN, so an unwritten output element fails the comparison.
Shapes are small (interpret mode executes every kernel op one by one).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_exact_zero_rows,
    assert_lse_close,
    build_ragged_layout,
    randn,
    random_page_selection,
    rng_for,
)
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interp
from jax.experimental.pallas import tpu as pltpu

import attn_reference as ref
from attn_common import LossyUnionCapWarning
from attn_common import tables as _tables
from attn_pallas_tpu import sparse_mla_attention, sparse_mla_attention_qblock

INTERPRET = pltpu.InterpretParams(
    detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan"
)
DV, ROPE = 128, 64
DK = DV + ROPE  # 192 -> Dk_pad 256: the feature padding path is exercised
SM_SCALE = 0.07
TOL = {"float32": dict(rtol_l2=2e-5, atol=2e-4), "bfloat16": dict(rtol_l2=2e-2, atol=5e-2)}
LSE_ATOL = {"float32": 1e-4, "bfloat16": 5e-2}


def _no_races():
    races = _interp.races
    assert races is None or not races.races_found, "interpret mode detected a data race"


def _check(got, want, dtype):
    out, lse = (np.asarray(x) for x in got)
    want_out, want_lse = (np.asarray(x) for x in want)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert_close(out, want_out, **TOL[dtype])
    assert_lse_close(lse, want_lse, atol=LSE_ATOL[dtype])
    assert_exact_zero_rows(out, lse)


# ------------------------------------------------------------------------------------
# Flat mode


def flat_case(seed, *, batch=2, seq=21, heads=2, kv_len=88, rb=16, top_k=4, dtype="float32"):
    """Random flat inputs: -1, duplicate and out-of-range ids, empty queries, tail unit."""
    rng = rng_for(seed)
    num_units = -(-kv_len // rb)
    q = randn(rng, (batch, seq, heads, DK), dtype)
    kv = randn(rng, (batch, kv_len, DK), dtype)
    pos = rng.integers(0, kv_len + 8, size=(batch, seq)).astype(np.int32)
    idx = rng.integers(-1, num_units + 2, size=(batch, seq, top_k)).astype(np.int32)
    idx[:, :, 0] = pos // rb  # the query's own unit: most rows are non-empty
    idx[0, 1, 1] = idx[0, 1, 0]  # duplicate
    idx[0, 2, 2:] = idx[0, 2, 0]  # triplicate
    b = batch - 1
    idx[b, 3] = -1  # nothing selected
    pos[b, 4] = -5  # negative position: causally empty
    idx[0, 5] = num_units - 1  # only the (partial) tail unit, selected K times
    pos[0, 5] = kv_len + 100  # kv_len binds
    idx[b, 6] = np.array([num_units - 1, -1, num_units + 7, 2**30])[:top_k]
    pos[b, 6] = 0  # selection entirely after the query: empty
    return q, kv, idx, pos


def _flat_call(fn, case, *, rb=16, **kw):
    q, kv, idx, pos = case
    return fn(
        q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=rb, return_lse=True, **kw
    )


PER_QUERY = functools.partial(sparse_mla_attention, interpret=INTERPRET)
KERNELS = {
    "per_query": PER_QUERY,
    "qblock_qb8": functools.partial(
        sparse_mla_attention_qblock, query_block=8, interpret=INTERPRET
    ),
    "qblock_qb16_hb1": functools.partial(
        sparse_mla_attention_qblock, query_block=16, head_block=1, interpret=INTERPRET
    ),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_flat_vs_reference(kernel):
    case = flat_case(1)
    got = _flat_call(KERNELS[kernel], case)
    _no_races()
    want = _flat_call(ref.sparse_mla_attention, case)
    assert np.isneginf(np.asarray(want[1])).any()  # the case has empty queries
    _check(got, want, "float32")


def test_flat_bf16_heads4_rb32():
    case = flat_case(2, batch=1, seq=13, heads=4, kv_len=128, rb=32, top_k=3, dtype="bfloat16")
    want = _flat_call(ref.sparse_mla_attention, case, rb=32)
    for fn in (PER_QUERY, KERNELS["qblock_qb8"]):
        got = _flat_call(fn, case, rb=32)
        _no_races()
        _check(got, want, "bfloat16")


def test_flat_out_only():
    case = flat_case(3, batch=1, seq=9)
    q, kv, idx, pos = case
    for fn in (PER_QUERY, KERNELS["qblock_qb8"]):
        out = fn(q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=16)
        want = ref.sparse_mla_attention(
            q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=16
        )
        assert_close(np.asarray(out), np.asarray(want), **TOL["float32"])


@pytest.mark.parametrize(("query_block", "u_max"), [(8, 3), (16, 5)])
def test_flat_qblock_lossy_u_max(query_block, u_max):
    """A cap below the union size warns and drops the same units as the reference."""
    case = flat_case(4)
    _tables._warn_lossy_u_max.cache_clear()
    try:
        with pytest.warns(LossyUnionCapWarning):
            got = _flat_call(
                sparse_mla_attention_qblock,
                case,
                query_block=query_block,
                u_max=u_max,
                interpret=INTERPRET,
            )
        _no_races()
        want = _flat_call(
            ref.sparse_mla_attention_qblock, case, query_block=query_block, u_max=u_max
        )
        lossless = _flat_call(ref.sparse_mla_attention, case)
    finally:
        _tables._warn_lossy_u_max.cache_clear()
    _check(got, want, "float32")
    assert not np.allclose(np.asarray(want[0]), np.asarray(lossless[0]))  # the cap bit


# ------------------------------------------------------------------------------------
# Ragged paged mode

SEQ_LENS = [37, 64, 5, 50, 20]
NEW_LENS = [9, 16, 0, 5, 20]
EXTRA_PAGES = [1, 0, 2, 0, 1]
HEADS = 2
TOP_K = 5


def ragged_case(seed, page_size, dtype):
    """Shuffled physical pages, junk in the cache padding, -1/duplicate/out-of-extent ids,
    a query with nothing selected and queries whose kv_len binds."""
    rng = rng_for(seed)
    layout = build_ragged_layout(
        rng, seq_lens=SEQ_LENS, new_lens=NEW_LENS, extra_pages=EXTRA_PAGES, page_size=page_size
    )
    pk = 2 if dtype == "bfloat16" else 1
    cache = randn(rng, (layout["num_pages"], page_size // pk, pk, 256), dtype)
    num_q = int(sum(NEW_LENS))
    q = randn(rng, (1, num_q, HEADS, DK), dtype)
    idx = random_page_selection(rng, layout, TOP_K, page_size)
    idx[3] = -1
    positions = layout["positions"].copy()
    positions[[5, num_q - 1]] += 40
    return layout, cache, q, idx, positions


def _ragged_call(fn, case, page_size, **kw):
    layout, cache, q, idx, positions = case
    return fn(
        q,
        cache,
        idx[None],
        positions[None],
        sm_scale=SM_SCALE,
        kv_lora_rank=DV,
        read_block=page_size,
        page_size=page_size,
        q_seq_id=layout["q_seq_id"],
        seq_lens=layout["seq_lens"],
        cu_kv_lens=layout["cu_kv_lens"],
        page_indices=layout["page_indices"],
        return_lse=True,
        **kw,
    )


@pytest.mark.parametrize(
    ("kernel", "page_size", "dtype"),
    [
        ("per_query", 16, "float32"),
        ("per_query", 32, "bfloat16"),
        ("qblock_qb8", 16, "float32"),  # 50 queries: 7 blocks, most straddle requests
        ("qblock_qb8", 32, "bfloat16"),
        ("qblock_qb16_hb1", 16, "float32"),
    ],
)
def test_ragged_vs_reference(kernel, page_size, dtype):
    case = ragged_case(10, page_size, dtype)
    got = _ragged_call(KERNELS[kernel], case, page_size)
    _no_races()
    want = _ragged_call(ref.sparse_mla_attention, case, page_size)
    assert np.isneginf(np.asarray(want[1])[0, 3]).all()
    _check(got, want, dtype)


def test_ragged_invalid_physical_page_masked():
    """A page-table entry outside the cache is never read (masked like the reference)."""
    layout, cache, q, idx, positions = ragged_case(11, 16, "float32")
    layout = dict(layout)
    page_indices = layout["page_indices"].copy()
    page_indices[[0, 5]] = [-3, layout["num_pages"] + 4]
    layout["page_indices"] = page_indices
    case = (layout, cache, q, idx, positions)
    want = _ragged_call(ref.sparse_mla_attention, case, 16)
    for kernel in ("per_query", "qblock_qb8"):
        got = _ragged_call(KERNELS[kernel], case, 16)
        _no_races()
        _check(got, want, "float32")


@pytest.mark.parametrize(("query_block", "u_max"), [(8, 3), (16, 6)])
def test_ragged_qblock_lossy_u_max(query_block, u_max):
    case = ragged_case(12, 16, "float32")
    _tables._warn_lossy_u_max.cache_clear()
    try:
        with pytest.warns(LossyUnionCapWarning):
            got = _ragged_call(
                sparse_mla_attention_qblock,
                case,
                16,
                query_block=query_block,
                u_max=u_max,
                interpret=INTERPRET,
            )
        _no_races()
        want = _ragged_call(
            ref.sparse_mla_attention_qblock, case, 16, query_block=query_block, u_max=u_max
        )
        lossless = _ragged_call(ref.sparse_mla_attention, case, 16)
    finally:
        _tables._warn_lossy_u_max.cache_clear()
    _check(got, want, "float32")
    assert not np.allclose(np.asarray(want[0]), np.asarray(lossless[0]))


def test_qblock_under_jit_with_traced_tables():
    """The ragged tables may be traced jit arguments (one compile serves every batch)."""
    layout, cache, q, idx, positions = ragged_case(13, 16, "float32")
    tables = {k: layout[k] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")}

    @jax.jit
    def run(q, cache, idx, positions, tables):
        return _ragged_call(KERNELS["qblock_qb8"], (tables, cache, q, idx, positions), 16)

    got = run(q, cache, idx, positions, tables)
    want = _ragged_call(ref.sparse_mla_attention, (layout, cache, q, idx, positions), 16)
    _check(got, want, "float32")
