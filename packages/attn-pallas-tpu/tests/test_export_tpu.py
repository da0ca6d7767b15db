"""Cross-lowering for TPU at production shapes with ``jax.export`` (nothing executes).

This catches tracing and Pallas->Mosaic lowering errors on a CPU-only machine; it does
not run Mosaic's TPU compiler passes (layouts, VMEM limits), which need a TPU.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from helpers import (
    export_tpu,
    flat_call_structs,
    prefill_call_structs,
    ragged_call_structs,
    ragged_positional,
)

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


def _export_cases(*quick):
    """Every variant, 64- and 128-token units, 16 and 128 heads; the ``quick`` ones (the
    per-query kernel and the automatic tiling, which lowers both kernels) in the default
    tier, the other tilings and shapes slow."""
    return pytest.mark.parametrize(
        ("kernel", "unit", "heads"),
        [
            pytest.param(*case, marks=[] if case in quick else [pytest.mark.slow])
            for case in itertools.product(VARIANTS, (64, 128), (16, 128))
        ],
    )


@_export_cases(("per_query", 64, 128), ("qblock_auto", 128, 16))
def test_export_flat(kernel, unit, heads):
    fn, extra, count = VARIANTS[kernel]
    kv = SD((1, T_FLAT, DK), BF16)
    export_tpu(
        functools.partial(fn, sm_scale=0.04, read_block=unit, return_lse=True, **extra),
        *flat_call_structs(kv, NUM_Q, heads, SELECTED // unit),
        kernels=count,
    )


@_export_cases(("per_query", 128, 16), ("qblock_auto", 64, 128))
def test_export_ragged(kernel, unit, heads):
    fn, extra, count = VARIANTS[kernel]
    kw = dict(sm_scale=0.04, read_block=unit, page_size=unit, return_lse=True, **extra)
    cache = SD((NUM_PAGES, unit // 2, 2, DK_PAD), BF16)
    export_tpu(
        ragged_positional(fn, **kw),
        *ragged_call_structs(cache, NUM_Q, heads, SELECTED // unit, NUM_SEQS, NUM_PAGES - 8),
        kernels=count,
    )


@pytest.mark.parametrize("page_size", [64, pytest.param(128, marks=pytest.mark.slow)])
def test_export_paged_write_back(page_size):
    export_tpu(
        functools.partial(paged_write_back, page_size=page_size),
        SD((NUM_PAGES, page_size // 2, 2, DK_PAD), BF16),
        SD((4096, DK_PAD), BF16),
        SD((4096,), I32),
        kernels=1,
    )


@pytest.mark.parametrize(
    "fn", [prefill_write_and_attend_ragged, prefill_write_and_attend_ragged_qblock]
)
def test_export_prefill_write_and_attend(fn):
    heads, page_size, top_k = 16, 64, SELECTED // 64
    # write-back + attention; the query-blocked twin plans automatically under jit, so its
    # attention is a lax.cond over two kernels.
    cache = SD((NUM_PAGES, page_size // 2, 2, DK_PAD), BF16)
    export_tpu(  # latent DV = 512, rope DK - DV = 64
        functools.partial(fn, kv_lora_rank=DV, page_size=page_size, sm_scale=0.04),
        *prefill_call_structs(cache, NUM_Q, heads, top_k, NUM_SEQS, NUM_PAGES - 8),
        kernels=2 if fn is prefill_write_and_attend_ragged else 3,
    )
