"""H200 checks of the query-blocked Hopper sparse-MLA kernel against the reference.

Skipped unless JAX's default backend is a GPU. ``attn_mosaic_gpu.sparse_mla_attention_qblock``
(the query-blocked kernel at ``H <= 32``) and ``sparse_mla.scheduled("auto")`` (the
kernel chosen per call) against ``attn_reference.sparse_mla_attention`` on the same bf16
inputs, at the per-query kernel's tolerances: picks that overlap (sinks, local window,
a shared hot set: ``attn_common.picks``) and picks with ``-1``, duplicates, ids past the
cache and causally empty queries; dirty caches (every row no query attends NaN/Inf); a
NaN block handed to the output allocator first; ``N`` not a multiple of the query block;
H in {8, 12, 16, 32}; ragged paged mode; the FP8 cache; the write-then-attend wrapper;
``return_attn_mass`` and the gradient (the per-query backward from the blocked
forward's ``out`` and ``lse``).

Run (on the H200, from the repository root):

    PYTHONPATH=common/src:packages/attn-reference/src:packages/attn-mosaic-gpu/src:tests \
        python -m pytest packages/attn-mosaic-gpu/tests/test_sparse_mla_qblock_gpu.py -q
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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
    rng_for,
)

import attn_mosaic_gpu as gpu
import attn_reference as ref
from attn_common import dequantize_latent_cache, quantize_latent_cache
from attn_common.picks import decode_picks, overlapping_picks
from attn_mosaic_gpu.sparse_mla import scheduled


def _overlap_case(seed, *, seq, heads, kv_len, rb, top_k):
    """Flat overlapping picks of ``top_k`` units of ``rb`` tokens for the last ``seq``
    positions, with edges: a query with nothing, duplicates, ids past the cache, a
    causally empty query."""
    rng = np.random.default_rng(seed)
    pos = np.arange(kv_len - seq, kv_len, dtype=np.int32)
    idx = overlapping_picks(rng, pos, unit=rb, k=top_k)
    idx[3] = -1
    idx[5, 1:4] = idx[5, 0]
    idx[6, :2] = [kv_len // rb + 1, 2**30]
    pos = pos.copy()
    pos[7] = -1
    q = randn(rng_for(seed), (1, seq, heads, DK), "bfloat16")
    kv = randn(rng_for(seed + 1), (1, kv_len, DK), "bfloat16")
    return q, kv, idx[None], pos[None]


@pytest.mark.parametrize("heads", [8, 12, 16, 32])
@pytest.mark.parametrize("op", ["qblock", "auto"])
def test_flat_overlapping_dirty(op, heads):
    rb, seq, kv_len = 16, 61, 6000  # 61 queries: the last block partly padded
    case = _overlap_case(heads, seq=seq, heads=heads, kv_len=kv_len, rb=rb, top_k=40)
    want = gpu_sparse_mla_flat(ref.sparse_mla_attention, case, rb)
    keep = attended_rows_flat(case[2], case[3], kv_len=kv_len, read_block=rb)
    dirty = (case[0], poison_rows(case[1], keep, seed=heads), case[2], case[3])
    poison_allocator(seq * heads * DV * 4)
    check_gpu_sparse_mla(gpu_sparse_mla_flat(scheduled(op), dirty, rb), want)


def test_flat_token_level_random_picks():
    """Token ids (``read_block = 1``), random: blocks share little, unions are wide."""
    rng = rng_for(21)
    seq, heads, kv_len, top_k = 40, 16, 4096, 700
    q = randn(rng, (1, seq, heads, DK), "bfloat16")
    kv = randn(rng, (1, kv_len, DK), "bfloat16")
    pos = np.sort(rng.integers(0, kv_len, size=seq)).astype(np.int32)[None]
    idx = np.stack([rng.permutation(kv_len)[:top_k] for _ in range(seq)])[None].astype(np.int32)
    idx[0, 1, ::5] = -1
    case = (q, kv, idx, pos)
    check_gpu_sparse_mla(
        gpu_sparse_mla_flat(gpu.sparse_mla_attention_qblock, case, 1),
        gpu_sparse_mla_flat(ref.sparse_mla_attention, case, 1),
    )


def _decode_case(seed, *, heads, tokens, page_size=64, top_k=32):
    """Ragged paged decode: 8 requests of ``tokens`` new tokens each sharing 90 % of
    their page picks (``decode_picks``), shuffled pages."""
    rng = rng_for(seed)
    seq_lens = [3000, 700, 2048, 4000, 1500, 128, 2600, 900]
    layout, cache, q = ragged_layout_cache_q(
        rng, seq_lens=seq_lens, new_lens=[tokens] * 8, extra_pages=[1, 0, 2, 0, 1, 0, 0, 3],
        page_size=page_size, heads=heads, dk=DK, dk_pad=640, dtype="bfloat16",
    )  # fmt: skip
    pos = layout["positions"].copy()
    idx = decode_picks(np.random.default_rng(seed), pos, unit=page_size, k=top_k, tokens=tokens)
    idx[4] = -1
    return layout, cache, q, idx, pos


@pytest.mark.parametrize("tokens", [2, 4])
def test_ragged_decode_dirty(tokens):
    case = _decode_case(30 + tokens, heads=16, tokens=tokens)
    want = gpu_sparse_mla_ragged(ref.sparse_mla_attention, case)
    dirty = poison_ragged_case(case, 64, dk=DK, seed=tokens)
    for op in (gpu.sparse_mla_attention_qblock, scheduled("auto")):
        check_gpu_sparse_mla(gpu_sparse_mla_ragged(op, dirty), want)


def test_fp8_cache():
    """The FP8 latent cache, dequantized on chip by the blocked kernel: the bits of the
    blocked kernel on ``dequantize_latent_cache(cache).astype(bfloat16)``, and the
    reference on that cache."""
    layout, cache, q, idx, pos = _decode_case(40, heads=32, tokens=2)
    rows = jnp.asarray(cache, jnp.float32).reshape(cache.shape[0], 64, 640)[..., :DK]
    fp8 = quantize_latent_cache(rows)  # on the (pages, page) grid
    bf16 = jnp.pad(dequantize_latent_cache(fp8).astype(jnp.bfloat16), ((0, 0),) * 2 + ((0, 64),))
    bf16 = bf16.reshape(cache.shape)
    got = gpu_sparse_mla_ragged(
        gpu.sparse_mla_attention_qblock, (layout, fp8, q, idx, pos), fp8_dequantize=False
    )
    same = gpu_sparse_mla_ragged(gpu.sparse_mla_attention_qblock, (layout, bf16, q, idx, pos))
    for a, b in zip(got, same, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check_gpu_sparse_mla(
        got, gpu_sparse_mla_ragged(ref.sparse_mla_attention, (layout, bf16, q, idx, pos))
    )


def test_prefill_wrapper():
    out, want_out = gpu_prefill_wrapper_outputs(
        gpu.prefill_write_and_attend_ragged_qblock,
        ref.prefill_write_and_attend_ragged,
        _decode_case(50, heads=16, tokens=4),
        seed=50,
    )
    assert_close(np.asarray(out), np.asarray(want_out), **GPU_SPARSE_MLA_TOL)


def test_attn_mass_and_gradient():
    rb = 16
    case = _overlap_case(60, seq=24, heads=16, kv_len=2000, rb=rb, top_k=24)
    q, kv, idx, pos = case
    kw = dict(sm_scale=SM_SCALE, read_block=rb)
    _, _, mass = gpu.sparse_mla_attention_qblock(
        q, kv, idx, pos, return_lse=True, return_attn_mass=True, **kw
    )
    _, _, want_mass = ref.sparse_mla_attention(
        q, kv, idx, pos, return_lse=True, return_attn_mass=True, **kw
    )
    assert_close(np.asarray(mass), np.asarray(want_mass), rtol_l2=1e-2, atol=1e-2)

    def loss(fn, q, kv):
        out = fn(q, kv, idx, pos, **kw)
        return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))

    grads = jax.grad(functools.partial(loss, gpu.sparse_mla_attention_qblock), (0, 1))(q, kv)
    f32 = (jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32))
    with jax.default_matmul_precision("highest"):
        want = jax.grad(functools.partial(loss, ref.sparse_mla_attention), (0, 1))(*f32)
    for g, w in zip(grads, want, strict=True):
        w = np.asarray(w)
        assert_close(np.asarray(g, np.float32), w, rtol_l2=3e-2, atol=0.15 * np.abs(w).max())
