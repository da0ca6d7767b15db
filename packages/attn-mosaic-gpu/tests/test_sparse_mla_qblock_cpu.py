"""CPU checks of the query-blocked Hopper sparse-MLA kernel (no GPU needed).

* The union tables (``attn_common.sparse_mla_rows.block_union``) against a numpy
  oracle, hypothesis-drawn: empty queries, a query block of 1 to 32, rows repeated
  within a query, ``N`` of several blocks; and ``sampled_union_pairs`` exact when every
  block is sampled.
* The per-call choice (``sparse_mla._prefer_blocked``) on the benchmark generator's
  picks: overlapping picks take the blocked kernel, random ones the per-query kernel.
* Interpret mode (race detection on, shared memory NaN) against the per-query kernel
  and the reference: the kernel on its own (union counts of two full pairs, one inside
  a block and 0; unlisted store rows dirty), query blocks of 2, 8 and 32 (H 32, 8, 2)
  with ``N`` not a multiple of the block, and the FP8 cache bitwise as its bf16
  dequantization.
* Cross-lowering (``jax.export``, ``platforms=["cuda"]``) at the benchmark shapes: flat
  4096 queries x top-2048 tokens at H 16 under the per-call choice (both kernels),
  ragged paged decode at H 32, FP8 on chip.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_sparse_mla_close,
    export_mosaic_gpu,
    gpu_interpret,
    poison_fp8_cache,
    random_row_table,
    rng_for,
    run_interpret,
    sparse_mla_flat_case,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_mosaic_gpu as gpu
import attn_reference as ref
from attn_common import dequantize_latent_cache, quantize_latent_cache
from attn_common.picks import overlapping_picks, random_picks
from attn_common.sparse_mla_rows import (
    block_union,
    flat_units,
    sampled_union_pairs,
    selected_rows,
)
from attn_mosaic_gpu import sparse_mla
from attn_mosaic_gpu.sparse_mla_kernel import (
    query_block_for,
    sparse_mla_rows_attention,
    sparse_mla_union_attention,
)

INTERPRET = gpu_interpret()
SM_SCALE = 0.07


def _run(fn, *args, **kwargs):
    return run_interpret(fn, *args, interpret=INTERPRET, **kwargs)


def _equal(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------
# The union tables


@st.composite
def row_tables(draw):
    """``(rows [N, Kp], counts [N], query_block)``: rows ascending below 40, repeats in
    some queries, empty queries."""
    # Few distinct shapes (each one compiles): blocks of 1, 3, 8 and 32, one or two of them.
    qb = draw(st.sampled_from([1, 3, 8, 32]))
    blocks = draw(st.integers(1, 2))
    kp = 8
    n = qb * blocks
    rows = np.full((n, kp), -1, np.int32)
    counts = np.zeros(n, np.int32)
    for i in range(n):
        picked = draw(st.lists(st.integers(0, 39), max_size=kp))
        counts[i] = len(picked)
        rows[i, : len(picked)] = sorted(picked)  # duplicates kept: the union drops them
    return rows, counts, qb


@pytest.mark.slow  # ~19 s: in the quick tier the union tables feed the blocked kernel
# against the reference (test_op_vs_reference[2], query blocks of 32)
@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(row_tables())
def test_block_union_matches_numpy(table):
    rows, counts, qb = table
    got = block_union(jnp.asarray(rows), jnp.asarray(counts), qb, block=8, num_rows=40)
    width = -(-qb * rows.shape[1] // 8) * 8
    assert got.rows.shape == got.member.shape == (rows.shape[0] // qb, width)
    for b in range(rows.shape[0] // qb):
        own = [set(rows[b * qb + j, : counts[b * qb + j]].tolist()) for j in range(qb)]
        union = sorted(set().union(*own))
        n = len(union)
        assert int(got.counts[b]) == n
        np.testing.assert_array_equal(np.asarray(got.rows[b, :n]), union)
        assert (np.asarray(got.rows[b, n:]) == -1).all()
        want = [sum(1 << j for j in range(qb) if r in own[j]) for r in union]
        np.testing.assert_array_equal(
            np.asarray(got.member[b, :n]).view(np.uint32), np.asarray(want, np.uint32)
        )
        assert (np.asarray(got.member[b, n:]) == 0).all()
    nb = rows.shape[0] // qb
    exact = sampled_union_pairs(jnp.asarray(rows), jnp.asarray(counts), qb, samples=nb, pair=8)
    assert float(exact) == float(((got.counts + 7) // 8).sum())


def test_block_union_refuses():
    rows, counts = jnp.zeros((6, 8), jnp.int32), jnp.zeros((6,), jnp.int32)
    with pytest.raises(ValueError, match="query_block"):
        block_union(rows, counts, 4)
    with pytest.raises(ValueError, match="query_block"):
        block_union(rows, counts, 33)
    with pytest.raises(ValueError, match="int32"):
        block_union(rows, counts, 2, num_rows=2**30)


def test_query_block_for():
    assert [query_block_for(h) for h in (1, 2, 3, 8, 12, 16, 17, 32, 33, 64, 128)] == [
        32, 32, 16, 8, 4, 4, 2, 2, 1, 1, 1,
    ]  # fmt: skip


# ------------------------------------------------------------------------------------
# The per-call choice


@pytest.mark.slow  # ~11 s (a 32K cache's units on XLA): a performance choice, not a
# kernel path; the quick tier traces and lowers it in test_cross_lowers_flat_token_level
@pytest.mark.parametrize(
    ("picks", "heads", "blocked"),
    [("overlap", 16, True), ("overlap", 32, True), ("random", 16, False), ("random", 32, False)],
)
def test_choice_follows_the_overlap(picks, heads, blocked):
    """512 queries at the end of a 32K cache, 32 units of 64 (the benchmark's
    generator): the overlapping picks' unions are 0.3-0.6 of the queries' rows, random
    picks' 0.9-0.97."""
    rng = np.random.default_rng(5)
    unit, seq, kv_len = 64, 512, 32768
    pos = np.arange(kv_len - seq, kv_len, dtype=np.int32)
    gen = overlapping_picks if picks == "overlap" else random_picks
    idx = gen(rng, pos, unit=unit, k=32)
    units = flat_units(
        jnp.asarray(idx)[None], jnp.asarray(pos)[None], kv_len=kv_len, read_block=unit,
        num_units=kv_len // unit,
    )  # fmt: skip
    rows, counts = selected_rows(units, read_block=unit, block=128, num_rows=kv_len)
    choice = sparse_mla._prefer_blocked(rows, counts, query_block_for(heads))
    assert bool(choice) is blocked


# ------------------------------------------------------------------------------------
# Interpret mode


@pytest.mark.slow  # ~27 s: the quick tier's blocked kernel runs against the reference in
# test_op_vs_reference[2] (-1, duplicate, out-of-range ids, empty queries)
def test_kernel_union_vs_per_query_dirty_store():
    """Union counts 256 (two full pairs), 63 and 0; every unlisted store row NaN/Inf."""
    rng = np.random.default_rng(8)
    heads, dv, kp, store_rows = 16, 128, 128, 400
    qb = query_block_for(heads)
    counts = np.array([100, 90, 128, 0, 40, 30, 0, 0, 0, 0, 0, 0], np.int32)
    shared = rng.choice(store_rows, 60, replace=False)  # rows most queries of a block share
    rows = np.full((len(counts), kp), -1, np.int32)
    for n, c in enumerate(counts):
        own = np.union1d(shared[: c // 2], rng.choice(store_rows, c, replace=False))[:c]
        rows[n, : len(own)] = own
        counts[n] = len(own)
    keep = np.zeros(store_rows, bool)
    keep[rows[rows >= 0]] = True
    store = rng.standard_normal((store_rows, dv + 64)).astype(np.float32)
    store[~keep] = np.nan
    store[~keep & (np.arange(store_rows) % 2 == 0)] = np.inf
    store = jnp.asarray(store, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((len(counts), heads, dv + 64)), jnp.bfloat16)
    args = (jnp.asarray(rows), jnp.asarray(counts))
    union = block_union(*args, qb, block=128)
    assert [int(c) for c in union.counts] == [
        len(set(rows[i : i + 4][rows[i : i + 4] >= 0].tolist())) for i in (0, 4, 8)
    ]
    got = _run(sparse_mla_union_attention, q, store, union, sm_scale=SM_SCALE, dv=dv)
    want = _run(sparse_mla_rows_attention, q, store, *args, sm_scale=SM_SCALE, dv=dv)
    assert_sparse_mla_close(got, want, rtol_l2=1e-2, atol=3e-2, lse_atol=2e-3)
    assert np.isneginf(np.asarray(got[1])[3]).all() and not np.asarray(got[0])[3].any()


# H 2: blocks of 32 queries, every bit of the membership word; H 8 / 32 (blocks of 8 / 2)
# in the slow tier (the conformance suite runs the op at its own heads in the quick one).
@pytest.mark.parametrize(
    "heads", [2, pytest.param(8, marks=pytest.mark.slow), pytest.param(32, marks=pytest.mark.slow)]
)
def test_op_vs_reference(heads):
    """The op (query blocks of 32, 8 and 2 queries; 9 queries, so the last block is
    partly padded) on a case with ``-1``, duplicate and out-of-range ids, empty
    queries and a selection past its query."""
    q, kv, idx, pos = sparse_mla_flat_case(
        heads, dk=192, batch=1, seq=9, heads=heads, kv_len=88, rb=16, top_k=4,
        dtype="bfloat16",
    )  # fmt: skip
    kw = dict(sm_scale=SM_SCALE, kv_lora_rank=128, read_block=16, return_lse=True)
    got = _run(gpu.sparse_mla_attention_qblock, q, kv, idx, pos, **kw)
    want = ref.sparse_mla_attention(q, kv, idx, pos, **kw)
    assert_sparse_mla_close(got, want, rtol_l2=1e-2, atol=3e-2, lse_atol=2e-3)


@pytest.mark.slow  # interpret mode at Dv = 512, two runs
def test_kernel_fp8_bitwise_as_bf16():
    """The FP8 cache dequantized on chip by the blocked kernel: the bits of the blocked
    kernel on ``dequantize_latent_cache(store).astype(bfloat16)``."""
    rng = rng_for(9)
    heads, kp, store_rows = 32, 128, 300
    counts = np.array([128, 70, 0, 5], np.int32)
    rows = random_row_table(np.random.default_rng(9), counts, kp, store_rows)
    keep = np.zeros(store_rows, bool)
    keep[rows[rows >= 0]] = True
    x = rng.standard_normal((store_rows, 576)).astype(np.float32)
    store = poison_fp8_cache(quantize_latent_cache(jnp.asarray(x)), keep, seed=9)
    q = jnp.asarray(rng.standard_normal((len(counts), heads, 576)), jnp.bfloat16)
    union = block_union(jnp.asarray(rows), jnp.asarray(counts), query_block_for(heads), block=128)
    got = _run(sparse_mla_union_attention, q, store, union, sm_scale=SM_SCALE)
    bf16 = dequantize_latent_cache(store).astype(jnp.bfloat16)
    _equal(got, _run(sparse_mla_union_attention, q, bf16, union, sm_scale=SM_SCALE))
    assert np.isfinite(np.asarray(got[0])).all()


# ------------------------------------------------------------------------------------
# Cross-lowering at the benchmark shapes


def _export(fn, *shapes):
    return export_mosaic_gpu(fn, *(jax.ShapeDtypeStruct(s, d) for s, d in shapes))


def test_cross_lowers_flat_token_level():
    """H 16, 4096 queries, top-2048 tokens of a 32K flat cache: the choice, the union
    tables and both kernels lower."""
    tokens, top_k, cache = 4096, 2048, 32768

    def fn(q, kv, idx, pos):
        return sparse_mla.scheduled("auto")(
            q, kv, idx, pos, sm_scale=0.0721, read_block=1, return_lse=True
        )

    text = _export(
        fn,
        ((1, tokens, 16, 576), jnp.bfloat16),
        ((1, cache, 576), jnp.bfloat16),
        ((1, tokens, top_k), jnp.int32),
        ((1, tokens), jnp.int32),
    )
    # The row sort, the per-query and the blocked kernel (one runs, chosen on the device).
    assert len(re.findall(r"custom_call @mosaic_gpu", text)) == 3


# bf16 in the slow tier: the blocked kernel's bf16 lowering is test_cross_lowers_flat_token_level.
@pytest.mark.parametrize(
    "fp8", [pytest.param(False, marks=pytest.mark.slow), True], ids=["bf16", "fp8"]
)
def test_cross_lowers_ragged_decode(fp8):
    """128 requests x 2 tokens, 32 pages of 64 of 8K each, H 32 (blocks of 2)."""
    requests, per, page, top_k = 128, 2, 64, 32
    pages = requests * 8192 // page
    tokens = requests * per

    def fn(q, kv, idx, pos, q_seq_id, seq_lens, cu_kv_lens, page_indices):
        return gpu.sparse_mla_attention_qblock(
            q, kv, idx, pos, sm_scale=0.0721, read_block=page, page_size=page,
            q_seq_id=q_seq_id, seq_lens=seq_lens, cu_kv_lens=cu_kv_lens,
            page_indices=page_indices, return_lse=True,
            **({"fp8_dequantize": False} if fp8 else {}),
        )  # fmt: skip

    if fp8:
        cache = quantize_latent_cache(jnp.zeros((1, page, 576), jnp.float32))
        kv = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((pages, page, *a.shape[2:]), a.dtype), cache
        )
    else:
        kv = jax.ShapeDtypeStruct((pages, page // 2, 2, 640), jnp.bfloat16)
    S = jax.ShapeDtypeStruct
    export_mosaic_gpu(
        fn,
        S((1, tokens, 32, 576), jnp.bfloat16),
        kv,
        S((1, tokens, top_k), jnp.int32),
        S((1, tokens), jnp.int32),
        S((tokens,), jnp.int32),
        S((requests,), jnp.int32),
        S((requests + 1,), jnp.int32),
        S((pages,), jnp.int32),
    )
