"""H200 conformance of the Hopper sparse MLA front door against the reference.

Skipped unless JAX's default backend is a GPU. Every case compares
``attn_mosaic_gpu.sparse_mla_attention`` with ``attn_reference.sparse_mla_attention`` on
the same bf16 inputs (the reference computes in float32 at HIGHEST precision): relative
L2 below 1e-2 and max-abs below 3e-2 for ``out``, LSE within 2e-3, ``-inf`` LSE and
exact zeros on the same queries, no NaN. Unattended cache rows are NaN/Inf (dirty
caches), and the output allocator is handed a NaN block first so an unwritten element
fails. Cases: flat token-level selections (``read_block=1``, K = 2048 and K not a
multiple of the 64-row block, duplicates, ``-1``, ids past T, causal cut), flat unit
selections, ragged paged mode over four requests, H in {16, 64, 128}, and the
write-then-attend wrapper.

Run (on the H200, from the repository root):

    PYTHONPATH=common/src:packages/attn-reference/src:packages/attn-mosaic-gpu/src \
        python -m pytest packages/attn-mosaic-gpu/tests/test_sparse_mla_gpu.py -q
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (jax.default_backend() != 'gpu')", allow_module_level=True)

from helpers import GPU_MLA_DK as DK
from helpers import GPU_MLA_DV as DV
from helpers import GPU_MLA_SM_SCALE as SM_SCALE
from helpers import (
    GPU_SPARSE_MLA_TOL,
    assert_close,
    attended_rows_flat,
    check_gpu_sparse_mla,
    gpu_prefill_wrapper_outputs,
    gpu_sparse_mla_flat,
    gpu_sparse_mla_ragged,
    poison_allocator,
    poison_ragged_case,
    poison_rows,
    ragged_layout_cache_q,
    randn,
    random_page_selection,
    rng_for,
)

import attn_mosaic_gpu as gpu
import attn_reference as ref


def _token_case(seed, *, seq, heads, kv_len, top_k):
    """Token-level ids: distinct per query, then duplicates, -1, ids past T and past the
    query's position; positions spread so the causal bound cuts most selections."""
    rng = rng_for(seed)
    q = randn(rng, (1, seq, heads, DK), "bfloat16")
    kv = randn(rng, (1, kv_len, DK), "bfloat16")
    pos = np.sort(rng.integers(0, kv_len, size=seq)).astype(np.int32)[None]
    idx = np.stack([rng.permutation(kv_len)[:top_k] for _ in range(seq)])[None].astype(np.int32)
    idx[0, 0, : top_k // 4] = idx[0, 0, top_k // 4 : top_k // 2]  # duplicates
    idx[0, 1, ::5] = -1
    idx[0, 2, :3] = [kv_len, kv_len + 9, 2**30]
    idx[0, 3] = -1  # nothing selected
    pos[0, 4] = -1  # causally empty
    return q, kv, idx, pos


@pytest.mark.parametrize(
    "heads,top_k,kv_len", [(128, 2048, 8192), (64, 1000, 4096), (16, 333, 2000)]
)
def test_flat_token_level(heads, top_k, kv_len):
    case = _token_case(heads + top_k, seq=48, heads=heads, kv_len=kv_len, top_k=top_k)
    want = gpu_sparse_mla_flat(ref.sparse_mla_attention, case, 1)
    keep = attended_rows_flat(case[2], case[3], kv_len=kv_len, read_block=1)
    dirty = (case[0], poison_rows(case[1], keep, seed=heads), case[2], case[3])
    poison_allocator(48 * heads * DV * 4)
    got = gpu_sparse_mla_flat(gpu.sparse_mla_attention, dirty, 1)
    check_gpu_sparse_mla(got, want)


def test_flat_units_batch2():
    rng = rng_for(5)
    batch, seq, heads, kv_len, rb, top_k = 2, 40, 64, 3000, 64, 24
    q = randn(rng, (batch, seq, heads, DK), "bfloat16")
    kv = randn(rng, (batch, kv_len, DK), "bfloat16")
    pos = rng.integers(0, kv_len + 50, size=(batch, seq)).astype(np.int32)
    idx = rng.integers(-1, kv_len // rb + 3, size=(batch, seq, top_k)).astype(np.int32)
    idx[:, :, 1] = idx[:, :, 0]  # duplicates
    case = (q, kv, idx, pos)
    want = gpu_sparse_mla_flat(ref.sparse_mla_attention, case, rb)
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=rb)
    got = gpu_sparse_mla_flat(
        gpu.sparse_mla_attention, (q, poison_rows(kv, keep, seed=5), idx, pos), rb
    )
    check_gpu_sparse_mla(got, want)


def _ragged_case(seed, page_size=64, heads=128, top_k=32):
    rng = rng_for(seed)
    layout, cache, q = ragged_layout_cache_q(
        rng, seq_lens=[3000, 700, 2048, 90], new_lens=[40, 30, 25, 20],
        extra_pages=[2, 0, 1, 3], page_size=page_size, heads=heads, dk=DK, dk_pad=640,
        dtype="bfloat16",
    )  # fmt: skip
    idx = random_page_selection(rng, layout, top_k, page_size)
    idx[7] = -1
    return layout, cache, q, idx, layout["positions"].copy()


def test_ragged_paged_dirty_cache():
    case = _ragged_case(11)
    want = gpu_sparse_mla_ragged(ref.sparse_mla_attention, case)
    dirty = poison_ragged_case(case, 64, dk=DK, seed=11)
    got = gpu_sparse_mla_ragged(gpu.sparse_mla_attention, dirty)
    check_gpu_sparse_mla(got, want)


def test_prefill_wrapper_and_write_back():
    out, want_out = gpu_prefill_wrapper_outputs(
        gpu.prefill_write_and_attend_ragged,
        ref.prefill_write_and_attend_ragged,
        _ragged_case(12, heads=64),
        seed=12,
    )
    assert np.isfinite(np.asarray(out)).all()
    assert_close(np.asarray(out), np.asarray(want_out), **GPU_SPARSE_MLA_TOL)


def test_dispatch_picks_hopper_kernel():
    from attn_common.dispatch import select_backend

    case = _token_case(3, seq=8, heads=64, kv_len=512, top_k=64)
    name, _ = select_backend(
        "sparse_mla_attention", None, args=case, kwargs=dict(sm_scale=SM_SCALE, read_block=1)
    )
    assert name == "mosaic-gpu"


def test_deterministic():
    case = _token_case(4, seq=16, heads=128, kv_len=4096, top_k=2048)
    a = gpu_sparse_mla_flat(gpu.sparse_mla_attention, case, 1)
    b = gpu_sparse_mla_flat(gpu.sparse_mla_attention, case, 1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
