"""The kernel backends and an FP8 latent cache (``attn_common.Fp8LatentCache``).

Both kernel backends read FP8 rows (their results are tested in
``packages/attn-pallas-tpu/tests/test_fp8_interpret.py`` and
``packages/attn-mosaic-gpu/tests/test_sparse_mla_fp8_cpu.py``), so ``supports`` accepts
an ``Fp8LatentCache`` for every sparse-MLA op. The write-back is an XLA scatter of the
quantized new rows on every backend, bit-identical to the reference's.
"""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import build_ragged_layout, randn, random_page_selection, rng_for

import attn_reference as ref
from attn_common import quantize_latent_cache

BACKENDS = {"mosaic-gpu": ("attn_mosaic_gpu", "Hopper"), "pallas-tpu": ("attn_pallas_tpu", "TPU")}
DV, ROPE, DK, HEADS, PAGE = 512, 64, 576, 2, 16


def _backend(name):
    module, kernels = BACKENDS[name]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    return importlib.import_module(module), kernels


def _case():
    rng = rng_for(110)
    layout = build_ragged_layout(
        rng, seq_lens=[40, 20], new_lens=[3, 2], extra_pages=[0, 1], page_size=PAGE
    )
    cache = quantize_latent_cache(
        jnp.asarray(randn(rng, (layout["num_pages"], PAGE, DK), np.float32))
    )
    q = randn(rng, (1, 5, HEADS, DK), "bfloat16")
    idx = random_page_selection(rng, layout, 3, PAGE)
    kw = dict(
        sm_scale=0.05, kv_lora_rank=DV, read_block=PAGE, page_size=PAGE,
        q_seq_id=layout["q_seq_id"], seq_lens=layout["seq_lens"],
        cu_kv_lens=layout["cu_kv_lens"], page_indices=layout["page_indices"],
    )  # fmt: skip
    return layout, cache, q, idx, kw


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_fp8_cache_supported_and_write_back_scatters(name):
    """Every op takes the cache; the write-back is the reference's scatter, bit for bit."""
    module, _ = _backend(name)
    layout, cache, _, idx, _ = _case()
    rng = rng_for(111)
    ql, qpe = randn(rng, (5, HEADS, DV), "bfloat16"), randn(rng, (5, HEADS, ROPE), "bfloat16")
    kvc, kpe = randn(rng, (5, DV), "float32"), randn(rng, (5, ROPE), "float32")
    loc = np.asarray([3, 4, 5, PAGE * 2, -1], np.int32)
    args = (ql, qpe, kvc, kpe, cache, idx, layout["positions"], loc, layout["seq_lens"],
            layout["cu_q_lens"], layout["cu_kv_lens"], layout["page_indices"])  # fmt: skip
    pkw = dict(kv_lora_rank=DV, page_size=PAGE, sm_scale=0.05, interpret=True)
    for op in ("prefill_write_and_attend_ragged", "prefill_write_and_attend_ragged_qblock"):
        assert module.supports(op, *args, **pkw) is None
    _, cache, q, idx, kw = _case()
    attend = (q, cache, idx[None], layout["positions"][None])
    for op in ("sparse_mla_attention", "sparse_mla_attention_qblock"):
        assert module.supports(op, *attend, **kw, interpret=True) is None  # TPU: 16-row units
    rows = np.concatenate([kvc, kpe], axis=-1)
    assert module.supports("paged_write_back", cache, rows, loc, page_size=PAGE) is None
    got = module.paged_write_back(cache, rows, loc, page_size=PAGE, interpret=True)
    want_cache = ref.paged_write_back(cache, rows, loc, page_size=PAGE)
    for a, b in zip(
        (got.latent, got.scale, got.rope),
        (want_cache.latent, want_cache.scale, want_cache.rope),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
