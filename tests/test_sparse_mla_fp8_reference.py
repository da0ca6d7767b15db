"""Sparse MLA over an FP8 latent cache (``attn_common.Fp8LatentCache``) on the reference:
flat and ragged paged, per-query and query-blocked, write-back and write-then-attend.

The result must equal the same op on ``dequantize_latent_cache(cache)`` (the reference
dequantizes the gathered rows in float32, so here: bit for bit, out and lse), with the
dirty-cache, set and empty-row semantics of a bf16 cache: NaN / Inf in rows no query
attends, in any field including the scales, never reaches an output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    BF16,
    assert_close,
    assert_exact_zero_rows,
    attended_rows_flat,
    attended_rows_ragged,
    build_ragged_layout,
    randn,
    random_page_selection,
    rng_for,
    sparse_mla_flat_case,
    upcast,
)
from oracle import scatter_oracle, sparse_mla_oracle_flat

import attn_common
from attn_common import Fp8LatentCache, dequantize_latent_cache, quantize_latent_cache
from attn_reference import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
    sparse_mla_attention,
    sparse_mla_attention_qblock,
)

DV, ROPE = 512, 64
DK = DV + ROPE
HEADS = 3
SM_SCALE = 0.05
SEQ_LENS = [37, 64, 5, 50]
NEW_LENS = [9, 16, 0, 5]
EXTRA_PAGES = [1, 0, 2, 0]
ATTEND = [sparse_mla_attention, sparse_mla_attention_qblock]
ATTEND_IDS = ["per-query", "qblock"]


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _assert_same(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _quantize(rows) -> Fp8LatentCache:
    return quantize_latent_cache(jnp.asarray(rows, jnp.float32))


def _fp8_numpy(cache: Fp8LatentCache):
    return tuple(np.array(a) for a in (cache.latent, cache.scale, cache.rope))


def _poison(cache: Fp8LatentCache, keep: np.ndarray, seed: int) -> Fp8LatentCache:
    """Every token where ``keep`` is False: NaN latent bytes, NaN / +-Inf / 0 scales and
    NaN / Inf rope values (a mix per token)."""
    rng = rng_for(seed)
    latent, scale, rope = _fp8_numpy(cache)
    bad = ~keep.reshape(cache.shape)
    latent_u8 = latent.view(np.uint8)
    latent_u8[bad] = np.where(rng.random(latent_u8[bad].shape) < 0.5, 0x7F, 0xFF)  # e4m3fn NaN
    junk = rng.choice(np.asarray([np.nan, np.inf, -np.inf, 0.0], np.float32), scale[bad].shape)
    scale[bad] = junk
    rope[bad] = rng.choice(np.asarray([np.nan, np.inf], np.float32), rope[bad].shape).astype(BF16)
    return Fp8LatentCache(jnp.asarray(latent), jnp.asarray(scale), jnp.asarray(rope))


# ------------------------------------------------------------------------------ flat


def _flat_case(seed: int, *, batch=2, seq=12, kv_len=70, rb=16, top_k=4):
    q, kv, idx, pos = sparse_mla_flat_case(
        seed, dk=DK, batch=batch, seq=seq, heads=HEADS, kv_len=kv_len, rb=rb, top_k=top_k
    )
    return q.astype(BF16), _quantize(kv), idx, pos


def _flat(fn, q, kv, idx, pos, rb=16, **kw):
    return fn(q, kv, idx, pos, sm_scale=SM_SCALE, read_block=rb, return_lse=True, **kw)


# rb 1 (token-level selections) compiles everything again (~3 s on 2 cores): in the full
# tier; the FP8 rows are gathered and dequantized the same way for any read_block.
@pytest.mark.parametrize("fn", ATTEND, ids=ATTEND_IDS)
@pytest.mark.parametrize("rb", [pytest.param(1, marks=pytest.mark.slow), 16])
def test_flat_equals_the_op_on_the_dequantized_cache(fn, rb):
    q, cache, idx, pos = _flat_case(90, rb=rb)
    if rb == 1:  # token-level selections, -1 and past-the-end ids among them
        idx = rng_for(91).integers(-1, 72, size=(*idx.shape[:2], 24)).astype(np.int32)
    out, lse = _flat(fn, q, cache, idx, pos, rb)
    assert out.dtype == np.float32 and out.shape == (*idx.shape[:2], HEADS, DV)
    want = _flat(fn, q, dequantize_latent_cache(cache), idx, pos, rb)
    _assert_same((out, lse), want)
    assert_exact_zero_rows(np.asarray(out), np.asarray(lse))
    # and the float64 oracle on the dequantized cache
    want_out, want_lse = sparse_mla_oracle_flat(
        upcast(q), np.asarray(dequantize_latent_cache(cache)), idx, pos, SM_SCALE, DV, rb
    )
    assert_close(np.asarray(out), want_out, rtol_l2=1e-5, atol=1e-5)
    assert np.isneginf(want_lse).any() and np.isfinite(want_lse).mean() > 0.5


def test_flat_fp8_against_bf16_cache_error_is_small():
    """The FP8 answer is close to the bf16 cache's (the format's error, not a bug)."""
    q, kv, idx, pos = sparse_mla_flat_case(
        92, dk=DK, batch=2, seq=12, heads=HEADS, kv_len=70, rb=16, top_k=4
    )
    q = q.astype(BF16)
    fp8, _ = _flat(sparse_mla_attention, q, _quantize(kv), idx, pos)
    bf16, _ = _flat(sparse_mla_attention, q, kv.astype(BF16), idx, pos)
    assert_close(np.asarray(fp8), np.asarray(bf16), rtol_l2=0.06, atol=0.5)
    assert not np.array_equal(np.asarray(fp8), np.asarray(bf16))


# ~3 s on 2 cores: the same poisoning of every field is checked quickly in ragged mode
# (test_ragged_unattended_rows_may_hold_nan_in_every_field).
@pytest.mark.parametrize("fn", ATTEND, ids=ATTEND_IDS)
@pytest.mark.slow
def test_flat_unattended_rows_may_hold_nan_in_every_field(fn):
    q, cache, idx, pos = _flat_case(93, kv_len=200, top_k=3)
    keep = attended_rows_flat(idx, pos, kv_len=200, read_block=16)
    assert (~keep).sum() > 50
    dirty = _poison(cache, keep, seed=93)
    assert np.isnan(np.asarray(dequantize_latent_cache(dirty))).any()
    _assert_same(_flat(fn, q, dirty, idx, pos), _flat(fn, q, cache, idx, pos))


def test_flat_under_jit_and_front_door():
    q, cache, idx, pos = _flat_case(94)
    want = _flat(sparse_mla_attention, q, cache, idx, pos)
    jitted = jax.jit(functools.partial(_flat, sparse_mla_attention))(q, cache, idx, pos)
    _assert_same(jitted, want)
    door = _flat(attn_common.sparse_mla_attention, q, cache, idx, pos, implementation=None)
    _assert_same(door, want)


def test_query_takes_bf16_against_an_fp8_cache():
    """The compute dtype of an FP8 cache is bf16: an f32 query is rounded to bf16 first."""
    q, cache, idx, pos = _flat_case(95)
    q32 = upcast(q) + randn(rng_for(95), q.shape, np.float32, scale=1e-4)
    _assert_same(
        _flat(sparse_mla_attention, q32, cache, idx, pos),
        _flat(sparse_mla_attention, q32.astype(BF16), cache, idx, pos),
    )


# ---------------------------------------------------------------------------- ragged


def _ragged_case(seed: int, page_size: int):
    rng = rng_for(seed)
    layout = build_ragged_layout(
        rng, seq_lens=SEQ_LENS, new_lens=NEW_LENS, extra_pages=EXTRA_PAGES, page_size=page_size
    )
    kv = randn(rng, (layout["num_pages"], page_size, DK), np.float32)
    num_q = int(sum(NEW_LENS))
    q = randn(rng, (1, num_q, HEADS, DK), BF16)
    idx = random_page_selection(rng, layout, 4, page_size)
    idx[3] = -1  # nothing selected
    positions = layout["positions"].copy()
    positions[[5, num_q - 1]] += 40  # seq_lens binds
    return layout, _quantize(kv), q, idx, positions


def _paged_f32(cache: Fp8LatentCache) -> np.ndarray:
    """The dequantized cache in the float32 paged layout [P, page_size, 1, Dk_pad]."""
    deq = np.asarray(dequantize_latent_cache(cache))
    pad = attn_common.padded_dk(DK) - DK
    return np.pad(deq, ((0, 0), (0, 0), (0, pad)))[:, :, None, :]


def _ragged(fn, layout, cache, q, idx, positions, page_size, **kw):
    return fn(
        q, cache, idx[None], positions[None], sm_scale=SM_SCALE, kv_lora_rank=DV,
        read_block=page_size, page_size=page_size, q_seq_id=layout["q_seq_id"],
        seq_lens=layout["seq_lens"], cu_kv_lens=layout["cu_kv_lens"],
        page_indices=layout["page_indices"], return_lse=True, **kw,
    )  # fmt: skip


# page_size 32 compiles everything again (~3 s on 2 cores): in the full tier; the
# paged ops at page size 32 are checked quickly by test_paged_reference.py.
@pytest.mark.parametrize("fn", ATTEND, ids=ATTEND_IDS)
@pytest.mark.parametrize("page_size", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_ragged_equals_the_op_on_the_dequantized_cache(fn, page_size):
    layout, cache, q, idx, positions = _ragged_case(96, page_size)
    got = _ragged(fn, layout, cache, q, idx, positions, page_size)
    want = _ragged(fn, layout, _paged_f32(cache), q, idx, positions, page_size)
    _assert_same(got, want)
    out, lse = (np.asarray(x) for x in got)
    assert np.isneginf(lse[0, 3]).all() and (out[0, 3] == 0).all()
    assert np.isfinite(lse).mean() > 0.8
    assert_exact_zero_rows(out, lse)


@pytest.mark.parametrize("fn", ATTEND, ids=ATTEND_IDS)
def test_ragged_unattended_rows_may_hold_nan_in_every_field(fn):
    layout, cache, q, idx, positions = _ragged_case(97, 16)
    num_pages = cache.shape[0]
    keep = attended_rows_ragged(layout, idx, positions, page_size=16, num_pages=num_pages)
    assert (~keep).sum() > 16
    dirty = _poison(cache, keep, seed=97)
    _assert_same(
        _ragged(fn, layout, dirty, q, idx, positions, 16),
        _ragged(fn, layout, cache, q, idx, positions, 16),
    )


@pytest.mark.slow  # ~5 s on 2 cores; test_ragged_equals_the_op_on_the_dequantized_cache
def test_decode_shapes():
    """Many requests with 1-4 new tokens each (decode), ragged paged."""
    rng = rng_for(98)
    seq_lens = rng.integers(20, 200, size=24)
    new_lens = rng.integers(1, 5, size=24)
    layout = build_ragged_layout(
        rng, seq_lens=seq_lens, new_lens=new_lens, extra_pages=[0] * 24, page_size=16
    )
    cache = _quantize(randn(rng, (layout["num_pages"], 16, DK), np.float32))
    q = randn(rng, (1, int(new_lens.sum()), HEADS, DK), BF16)
    idx = random_page_selection(rng, layout, 6, 16)
    positions = layout["positions"]
    got = _ragged(sparse_mla_attention, layout, cache, q, idx, positions, 16)
    want = _ragged(sparse_mla_attention, layout, _paged_f32(cache), q, idx, positions, 16)
    _assert_same(got, want)
    assert np.isfinite(np.asarray(got[1])).mean() > 0.9


# ------------------------------------------------------------------------ write-back


def _write_case(seed: int, page_size: int = 16):
    rng = rng_for(seed)
    num_pages = 6
    slots = num_pages * page_size
    cache = _quantize(randn(rng, (num_pages, page_size, DK), np.float32))
    rows = randn(rng, (30, DK), np.float32)
    rows[4, :128] = 0  # an all-zero group
    loc = rng.permutation(slots)[:30].astype(np.int32)
    loc[[3, 9]] = -1  # no write
    loc[[11, 12, 20]] = loc[10]  # a slot written four times: the last row wins
    return cache, rows, loc


def _scatter_fp8(cache: Fp8LatentCache, rows: Fp8LatentCache, loc) -> tuple[np.ndarray, ...]:
    """The numpy oracle per field (scatter_oracle's paged view with pk = 1)."""
    out = []
    for c, r in zip(_fp8_numpy(cache), _fp8_numpy(rows), strict=True):
        paged = _bits(c)[:, :, None, :]
        out.append(scatter_oracle(paged, _bits(r), loc)[:, :, 0, :].view(c.dtype))
    return tuple(out)


@pytest.mark.parametrize("rows_dtype", [np.float32, BF16, "fp8"])
def test_write_back_quantizes_the_new_rows(rows_dtype):
    cache, rows, loc = _write_case(100)
    quantized = _quantize(rows.astype(BF16) if rows_dtype == BF16 else rows)
    given = quantized if rows_dtype == "fp8" else rows.astype(rows_dtype)
    new = paged_write_back(cache, given, loc, page_size=16)
    assert isinstance(new, Fp8LatentCache) and new.shape == cache.shape
    _assert_same(tuple(_fp8_numpy(new)), _scatter_fp8(cache, quantized, loc))
    jitted = jax.jit(functools.partial(paged_write_back, page_size=16))(cache, given, loc)
    _assert_same(jitted, new)
    _assert_same(attn_common.paged_write_back(cache, given, loc, page_size=16), new)


def test_prefill_write_and_attend():
    page_size = 16
    layout, cache, _, idx, _ = _ragged_case(101, page_size)
    rng = rng_for(102)
    num_q = int(sum(NEW_LENS))
    ql = randn(rng, (num_q, HEADS, DV), BF16)
    qpe = randn(rng, (num_q, HEADS, ROPE), BF16)
    kvc = randn(rng, (num_q, DV), BF16)
    kpe = randn(rng, (num_q, ROPE), np.float32)
    slots = []
    for r, (n_kv, n_new) in enumerate(zip(layout["seq_lens"], layout["new_lens"], strict=True)):
        base = int(layout["cu_kv_lens"][r]) // page_size
        for j in range(int(n_kv) - int(n_new), int(n_kv)):
            slots.append(int(layout["page_indices"][base + j // page_size]) * page_size + j % 16)
    loc = np.asarray(slots, np.int32)
    loc[7] = -1  # not written: attention reads the old row
    positions = layout["positions"]
    args = (ql, qpe, kvc, kpe, cache, idx, positions, loc, layout["seq_lens"],
            layout["cu_q_lens"], layout["cu_kv_lens"], layout["page_indices"])  # fmt: skip
    kw = {"kv_lora_rank": DV, "page_size": page_size, "sm_scale": SM_SCALE}
    out, new_cache = prefill_write_and_attend_ragged(*args, **kw)
    assert out.shape == (num_q, HEADS, DV) and isinstance(new_cache, Fp8LatentCache)
    rows = np.concatenate([upcast(kvc), kpe], axis=-1)
    _assert_same(_fp8_numpy(new_cache), _scatter_fp8(cache, _quantize(rows), loc))
    q = np.concatenate([upcast(ql), upcast(qpe)], axis=-1)[None].astype(BF16)
    want, _ = _ragged(
        sparse_mla_attention, layout, _paged_f32(new_cache), q, idx, positions, page_size
    )
    _assert_same(out, want[0])
    qb = prefill_write_and_attend_ragged_qblock(*args, **kw, query_block=8)
    _assert_same(qb, (out, new_cache))
    jitted = jax.jit(functools.partial(prefill_write_and_attend_ragged, **kw))(*args)
    _assert_same(jitted, (out, new_cache))


# ------------------------------------------------------------------------ validation


def test_spec_refuses_a_bad_fp8_cache():
    q, cache, idx, pos = _flat_case(103)
    with pytest.raises(ValueError, match=r"kv: got an Fp8LatentCache on the token grid \[1, 140\], "
                       r"expected \[2, \*\] = \[B=2, T\]"):  # fmt: skip
        _flat(sparse_mla_attention, q, cache.reshape(1, 140), idx, pos)
    with pytest.raises(
        ValueError, match=r"q: got Dk = 640, an Fp8LatentCache holds Dk = 512 \+ 64"
    ):
        _flat(sparse_mla_attention, np.pad(q, ((0, 0),) * 3 + ((0, 64),)), cache, idx, pos)
    with pytest.raises(ValueError, match=r"kv_lora_rank: got 256, an Fp8LatentCache holds"):
        _flat(sparse_mla_attention, q, cache, idx, pos, kv_lora_rank=256)
    bad = Fp8LatentCache(cache.latent, cache.scale.astype(jnp.bfloat16), cache.rope)
    with pytest.raises(TypeError, match=r"kv\.scale: got dtype bfloat16, expected float32"):
        _flat(attn_common.sparse_mla_attention, q, bad, idx, pos)
    layout, paged, q, idx, positions = _ragged_case(104, 16)
    with pytest.raises(ValueError, match=r"kv: got an Fp8LatentCache on the token grid "
                       r"\[\d+, 16\], expected \[\*, 32\] = \[num_pages, page_size=32\]"):  # fmt: skip
        _ragged(sparse_mla_attention, layout, paged, q, idx, positions, 32)


def test_write_back_refuses_bad_rows():
    cache, rows, loc = _write_case(105)
    with pytest.raises(ValueError, match=r"rows: got shape \(30, 640\), expected \[T, 576\]"):
        paged_write_back(cache, np.pad(rows, ((0, 0), (0, 64))), loc, page_size=16)
    with pytest.raises(TypeError, match=r"rows: got dtype int32 for an Fp8LatentCache"):
        paged_write_back(cache, rows.astype(np.int32), loc, page_size=16)
    with pytest.raises(ValueError, match=r"loc: got shape \(29,\), expected \[T=30\]"):
        paged_write_back(cache, _quantize(rows), loc[:29], page_size=16)
    with pytest.raises(ValueError, match=r"cache: got an Fp8LatentCache on the token grid "
                       r"\[6, 16\], expected \[\*, 32\]"):  # fmt: skip
        paged_write_back(cache, rows, loc, page_size=32)
    with pytest.raises(ValueError, match=r"loc: entry 0 is 96, expected a cache slot < "):
        paged_write_back(cache, rows, np.full_like(loc, 96), page_size=16)
