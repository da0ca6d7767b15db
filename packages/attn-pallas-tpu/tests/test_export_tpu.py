"""Cross-lowering for TPU at production shapes with ``jax.export`` (nothing executes).

This catches tracing and Pallas->Mosaic lowering errors on a CPU-only machine; it does
not run Mosaic's TPU compiler passes (layouts, VMEM limits), which need a TPU.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest

from attn_pallas_tpu import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
    sparse_mla_attention,
    sparse_mla_attention_qblock,
)

SD = jax.ShapeDtypeStruct
BF16, I32 = jnp.bfloat16, jnp.int32
DK, DV, DK_PAD = 576, 512, 640
SELECTED = 2048  # selected tokens per query
NUM_Q = 512  # prefill tokens in the exported call
T_FLAT = 16384
NUM_PAGES, NUM_SEQS = 4096, 3


def _assert_tpu_kernel(exported, count=1):
    """Exactly ``count`` Mosaic kernels in the module (a lax.cond holds one per branch)."""
    text = exported.mlir_module()
    found = text.count("tpu_custom_call")
    assert found == count, f"{found} Mosaic kernels in the exported module, expected {count}"
    assert exported.platforms == ("tpu",)


def _export(fn, *avals):
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals)


# Query-blocked variants: QB 256; QB 64 with 64-slot union chunks (several per block at
# these shapes); automatic tiling (under jit: a lax.cond between the query-blocked and
# the per-query kernel, so two kernels in the module).
QBLOCK = {
    "qb256": ({"query_block": 256}, 1),
    "qb64_chunked": ({"query_block": 64, "u_max": 64}, 1),
    "auto": ({}, 2),
}
VARIANTS = {"per_query": (sparse_mla_attention, {}, 1)} | {
    f"qblock_{k}": (sparse_mla_attention_qblock, kw, n) for k, (kw, n) in QBLOCK.items()
}
# Every variant, 64- and 128-token units, 16 and 128 heads.
EXPORT_CASES = pytest.mark.parametrize(
    ("kernel", "unit", "heads"), list(itertools.product(VARIANTS, (64, 128), (16, 128)))
)


@EXPORT_CASES
def test_export_flat(kernel, unit, heads):
    fn, extra, count = VARIANTS[kernel]
    top_k = SELECTED // unit

    def f(q, kv, idx, pos):
        return fn(q, kv, idx, pos, sm_scale=0.04, read_block=unit, return_lse=True, **extra)

    exported = _export(
        f,
        SD((1, NUM_Q, heads, DK), BF16),
        SD((1, T_FLAT, DK), BF16),
        SD((1, NUM_Q, top_k), I32),
        SD((1, NUM_Q), I32),
    )
    _assert_tpu_kernel(exported, count)


@EXPORT_CASES
def test_export_ragged(kernel, unit, heads):
    fn, extra, count = VARIANTS[kernel]
    top_k = SELECTED // unit

    def f(q, cache, idx, pos, sid, seq_lens, cu_kv, pages):
        return fn(
            q,
            cache,
            idx,
            pos,
            sm_scale=0.04,
            read_block=unit,
            page_size=unit,
            q_seq_id=sid,
            seq_lens=seq_lens,
            cu_kv_lens=cu_kv,
            page_indices=pages,
            return_lse=True,
            **extra,
        )

    exported = _export(
        f,
        SD((1, NUM_Q, heads, DK), BF16),
        SD((NUM_PAGES, unit // 2, 2, DK_PAD), BF16),
        SD((1, NUM_Q, top_k), I32),
        SD((1, NUM_Q), I32),
        SD((NUM_Q,), I32),
        SD((NUM_SEQS,), I32),
        SD((NUM_SEQS + 1,), I32),
        SD((NUM_PAGES - 8,), I32),
    )
    _assert_tpu_kernel(exported, count)


@pytest.mark.parametrize("page_size", [64, 128])
def test_export_paged_write_back(page_size):
    def f(cache, rows, loc):
        return paged_write_back(cache, rows, loc, page_size=page_size)

    exported = _export(
        f,
        SD((NUM_PAGES, page_size // 2, 2, DK_PAD), BF16),
        SD((4096, DK_PAD), BF16),
        SD((4096,), I32),
    )
    _assert_tpu_kernel(exported)


@pytest.mark.parametrize(
    "fn", [prefill_write_and_attend_ragged, prefill_write_and_attend_ragged_qblock]
)
def test_export_prefill_write_and_attend(fn):
    heads, page_size, top_k = 16, 64, SELECTED // 64

    def f(ql, qpe, kvc, kpe, cache, topk, pos, loc, seq_lens, cu_q, cu_kv, pages):
        return fn(
            ql,
            qpe,
            kvc,
            kpe,
            cache,
            topk,
            pos,
            loc,
            seq_lens,
            cu_q,
            cu_kv,
            pages,
            kv_lora_rank=DV,
            page_size=page_size,
            sm_scale=0.04,
        )

    exported = _export(
        f,
        SD((NUM_Q, heads, DV), BF16),
        SD((NUM_Q, heads, DK - DV), BF16),
        SD((NUM_Q, DV), BF16),
        SD((NUM_Q, DK - DV), BF16),
        SD((NUM_PAGES, page_size // 2, 2, DK_PAD), BF16),
        SD((NUM_Q, top_k), I32),
        SD((NUM_Q,), I32),
        SD((NUM_Q,), I32),
        SD((NUM_SEQS,), I32),
        SD((NUM_SEQS + 1,), I32),
        SD((NUM_SEQS + 1,), I32),
        SD((NUM_PAGES - 8,), I32),
    )
    # write-back + attention; the query-blocked twin plans automatically under jit, so its
    # attention is a lax.cond over two kernels.
    _assert_tpu_kernel(exported, count=2 if fn is prefill_write_and_attend_ragged else 3)
