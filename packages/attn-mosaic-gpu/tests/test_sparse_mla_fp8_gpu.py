"""H200 checks of the Hopper sparse-MLA kernel over an FP8 latent cache.

Skipped unless JAX's default backend is a GPU. The kernel dequantizes each gathered row
on chip to ``bf16(float32(latent) * scale)``, so on an ``Fp8LatentCache`` it must give
the bits it gives on the bf16 cache ``dequantize_latent_cache(cache).astype(bfloat16)``
(every case checks that exactly: the load, the conversion, the swizzled stores, the
barriers and the zero-fill of rows past the count all show in it; the on-chip path is
forced with ``fp8_dequantize=False``, and the default, which may dequantize the whole
cache first, must give the same bits), and stay within the
bf16 kernel's tolerance of the reference on that bf16 cache (on a sample of queries). Every cache row
no query attends is dirty (NaN latent bytes, NaN / Inf / 0 scales, NaN rope). Cases at
production-like shapes: flat token-level (top-2048 of 8K, duplicates, ``-1``, ids past
T, empty queries) at H 16 / 32 / 64 / 128; ragged paged prefill (4 requests, 64-token
pages, 32 pages per query) at H 16 / 128; decode (128 requests x 2 query tokens, 32
pages of 64 tokens of 8K each) at H 16 / 128; the write-then-attend wrapper.

Run (on the H200, from the repository root):

    PYTHONPATH=common/src:packages/attn-reference/src:packages/attn-mosaic-gpu/src \
        python -m pytest packages/attn-mosaic-gpu/tests/test_sparse_mla_fp8_gpu.py -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (jax.default_backend() != 'gpu')", allow_module_level=True)

from helpers import assert_sparse_mla_close, attended_rows_flat, attended_rows_ragged, rng_for

import attn_mosaic_gpu as gpu
import attn_reference as ref
from attn_common import Fp8LatentCache, dequantize_latent_cache, quantize_latent_cache
from attn_mosaic_gpu.bench_sparse_mla import distinct_choices, paged_layout

DV, ROPE, DK = 512, 64, 576
SM_SCALE = 1.0 / np.sqrt(192.0)
# Against the reference on the bf16-rounded dequantized cache (``_as_bf16``: what the
# op's contract promises, "up to bf16 rounding of the dequantized values"): the bf16
# kernel's own tolerance (test_sparse_mla_gpu.py).
TOL = dict(rtol_l2=1e-2, atol=3e-2, lse_atol=2e-3)
# The wrapper against the reference on the FP8 cache itself (float32 keys): the bf16
# rounding of the keys moves the LSE by about sm_scale * |q| * |k| * 2**-9 at Dk = 576
# (0.0106 seen at H 128 on 8 sampled queries) and the output's largest elements by a few
# 1e-2 (0.034 seen at 7 queries x 2 heads, seed 600).
FP8_TOL = dict(rtol_l2=1e-2, atol=8e-2, lse_atol=2e-2)
# (queries, cache tokens, selected tokens) of the flat cases; (requests, new tokens each,
# tokens per request, pages per query) of the ragged prefill and decode cases.
FLAT = (256, 8192, 2048)
PREFILL = (4, 256, 8192, 32)
DECODE = (128, 2, 8192, 32)
PAGE = 64


def _random_cache(rng, grid) -> Fp8LatentCache:
    """Normal values, each 128-group scaled by 0.25-2 (drawn on the device: the decode
    cache has a million tokens)."""
    k_x, k_s = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))))
    x = jax.random.normal(k_x, (*grid, DK), jnp.float32)
    group = jax.random.uniform(k_s, (*grid, 4), jnp.float32, 0.25, 2.0)
    x = x.at[..., :DV].multiply(jnp.repeat(group, 128, axis=-1))
    return quantize_latent_cache(x)


def _poison(cache: Fp8LatentCache, keep: np.ndarray, seed: int) -> Fp8LatentCache:
    """Every row not in ``keep`` (the flattened token grid) dirty in every field."""
    rng = np.random.default_rng(seed)
    dirty = jnp.asarray(~keep.reshape(cache.shape))
    bad_scale = rng.choice([np.nan, np.inf, 0.0], size=(*cache.shape, 4)).astype(np.float32)
    return Fp8LatentCache(
        jnp.where(dirty[..., None], jnp.asarray(jnp.nan, jnp.float8_e4m3fn), cache.latent),
        jnp.where(dirty[..., None], jnp.asarray(bad_scale), cache.scale),
        jnp.where(dirty[..., None], jnp.asarray(jnp.nan, jnp.bfloat16), cache.rope),
    )


def _as_bf16(cache: Fp8LatentCache) -> jax.Array:
    return dequantize_latent_cache(cache).astype(jnp.bfloat16)


def _paged_bf16(cache: Fp8LatentCache) -> jax.Array:
    pages, page = cache.shape
    rows = jnp.pad(_as_bf16(cache), ((0, 0), (0, 0), (0, 640 - DK)))
    return rows.reshape(pages, page // 2, 2, 640)


def _equal(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _sample_vs_reference(fn, got, q, idx, pos, sample, **kw):
    """The reference on ``SAMPLE`` queries (flat: batch row 0) against ``got``."""
    want = fn(q[:, sample], idx[:, sample], pos[:, sample], **kw)
    assert_sparse_mla_close(
        (np.asarray(got[0])[:, sample], np.asarray(got[1])[:, sample]), want, **TOL
    )


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_flat_token_level(heads):
    rng = rng_for(300 + heads)
    seq, kv_len, top_k = FLAT
    q = jnp.asarray(rng.standard_normal((1, seq, heads, DK)), jnp.bfloat16)
    pos = np.arange(kv_len - seq, kv_len, dtype=np.int32)
    idx = distinct_choices(rng, pos + 1, top_k)
    idx[0, : top_k // 4] = idx[0, top_k // 4 : top_k // 2]  # duplicates
    idx[1, ::5] = -1
    idx[2, :3] = [kv_len, kv_len + 9, 2**30]
    idx[3] = -1  # nothing selected
    pos[4] = -1  # causally empty
    idx, pos = idx[None], pos[None]
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=1)
    cache = _poison(_random_cache(rng, (1, kv_len)), keep, seed=heads)
    kw = dict(sm_scale=SM_SCALE, read_block=1, return_lse=True)
    got = gpu.sparse_mla_attention(q, cache, idx, pos, fp8_dequantize=False, **kw)
    _equal(got, gpu.sparse_mla_attention(q, _as_bf16(cache), idx, pos, **kw))
    _equal(gpu.sparse_mla_attention(q, cache, idx, pos, **kw), got)  # here the whole copy
    assert np.isneginf(np.asarray(got[1])[0, 3]).all() and not np.asarray(got[0])[0, 3].any()
    assert np.isfinite(np.asarray(got[0])).all()
    sample = np.r_[0:5, seq - 3 : seq]

    def reference(qs, i, p, **kw):
        return ref.sparse_mla_attention(qs, _as_bf16(cache), i, p, **kw)

    _sample_vs_reference(reference, got, q, idx, pos, sample, **kw)


def _ragged(requests, per_request, kv_len, pages_per_query, heads, seed, page=PAGE):
    """Ragged paged inputs: requests of about ``kv_len`` tokens (shuffled pages),
    ``per_request`` new tokens each (its last), ``pages_per_query`` distinct pages
    selected per query (``-1`` padded), unattended rows dirty."""
    rng = rng_for(seed)
    lens = [kv_len - 3 * r for r in range(requests)]
    layout = paged_layout(rng, lens, [per_request] * requests, page_size=page)
    pos = layout["positions"]
    idx = distinct_choices(rng, pos // page + 1, pages_per_query)
    idx[1] = -1  # nothing selected
    keep = attended_rows_ragged(layout, idx, pos, page_size=page, num_pages=layout["num_pages"])
    cache = _poison(_random_cache(rng, (layout["num_pages"], page)), keep, seed)
    q = jnp.asarray(rng.standard_normal((1, len(pos), heads, DK)), jnp.bfloat16)
    tables = {
        k: jnp.asarray(layout[k]) for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")
    }
    kw = dict(sm_scale=SM_SCALE, read_block=page, page_size=page, return_lse=True, **tables)
    return q, cache, idx[None], pos[None], kw


def _check_ragged(q, cache, idx, pos, kw):
    got = gpu.sparse_mla_attention(q, cache, idx, pos, fp8_dequantize=False, **kw)
    _equal(got, gpu.sparse_mla_attention(q, _paged_bf16(cache), idx, pos, **kw))
    _equal(gpu.sparse_mla_attention(q, cache, idx, pos, **kw), got)
    assert np.isneginf(np.asarray(got[1])[0, 1]).all()
    sample = np.r_[0:4, q.shape[1] - 4 : q.shape[1]]
    # The reference on a sample: the tables and kv lengths are per query, so keep them.
    tables = {k: kw[k] for k in ("seq_lens", "cu_kv_lens", "page_indices")}
    want = ref.sparse_mla_attention(
        q[:, sample], _paged_bf16(cache), idx[:, sample], pos[:, sample], sm_scale=SM_SCALE,
        read_block=kw["read_block"], page_size=kw["page_size"],
        q_seq_id=kw["q_seq_id"][sample], return_lse=True, **tables,
    )  # fmt: skip
    assert_sparse_mla_close(
        (np.asarray(got[0])[:, sample], np.asarray(got[1])[:, sample]), want, **TOL
    )


@pytest.mark.parametrize("heads", [16, 128])  # flat covers 32 and 64 (device time)
def test_ragged_paged_prefill(heads):
    _check_ragged(*_ragged(*PREFILL, heads, seed=400 + heads))


@pytest.mark.parametrize("heads", [16, 128])
def test_decode_128_requests_x_2_tokens(heads):
    _check_ragged(*_ragged(*DECODE, heads, seed=500 + heads))


def test_prefill_wrapper_quantizes_then_attends():
    requests, _, kv_len, pages_per_query = PREFILL
    q, cache, idx, pos, kw = _ragged(requests, 64, kv_len // 4, pages_per_query, 64, seed=600)
    layout_tables = {k: kw[k] for k in ("seq_lens", "cu_kv_lens", "page_indices")}
    rng = rng_for(601)
    num_q, page = q.shape[1], kw["page_size"]
    q_seq_id = np.asarray(kw["q_seq_id"])
    cu_kv = np.asarray(kw["cu_kv_lens"])
    positions = np.asarray(pos[0])
    slot_page = np.asarray(kw["page_indices"])[cu_kv[q_seq_id] // page + positions // page]
    loc = (slot_page * page + positions % page).astype(np.int32)
    kvc = jnp.asarray(rng.standard_normal((num_q, DV)), jnp.float32)
    kpe = jnp.asarray(rng.standard_normal((num_q, ROPE)), jnp.float32)
    counts = np.bincount(q_seq_id, minlength=requests)
    cu_q = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    args = (q[0, :, :, :DV], q[0, :, :, DV:], kvc, kpe, cache, idx[0], positions, loc,
            layout_tables["seq_lens"], cu_q, layout_tables["cu_kv_lens"],
            layout_tables["page_indices"])  # fmt: skip
    out, new_cache = gpu.prefill_write_and_attend_ragged(
        *args, kv_lora_rank=DV, page_size=page, sm_scale=SM_SCALE
    )
    want_out, want_cache = ref.prefill_write_and_attend_ragged(
        *args, kv_lora_rank=DV, page_size=page, sm_scale=SM_SCALE
    )
    for a, b in zip(jax.tree.leaves(new_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    lse = np.zeros(out.shape[:2], np.float32)
    assert_sparse_mla_close((out, lse), (want_out, lse), **FP8_TOL)
    on_chip, _ = gpu.prefill_write_and_attend_ragged(
        *args, kv_lora_rank=DV, page_size=page, sm_scale=SM_SCALE, fp8_dequantize=False
    )
    np.testing.assert_array_equal(np.asarray(on_chip), np.asarray(out))
