"""The TPU sparse-MLA kernels over an FP8 latent cache, in Pallas TPU interpret mode.

The kernels DMA the latent rows as stored and one bf16 side row per token
(``attn_pallas_tpu.fp8_rows``), and dequantize in VMEM to ``bf16(latent * scale)``.
So the contract ("the same op on ``dequantize_latent_cache(cache)`` up to bf16 rounding
of the dequantized values") is checked exactly: the FP8 kernel's out and LSE equal, bit
for bit, the same kernel's on the bf16 cache ``bf16(dequantize_latent_cache(cache))``;
and against the reference on the FP8 cache within the bf16 tolerance. Rows no query
attends hold NaN latent bytes and NaN / Inf / 0 scales and NaN / Inf rope; selections
have -1, duplicate and out-of-range ids; some queries attend nothing (out 0, LSE
-inf). Interpret mode runs with the race detector on and uninitialised memory NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    BF16,
    assert_exact_zero_rows,
    assert_no_races,
    assert_sparse_mla_close,
    attended_rows_flat,
    attended_rows_ragged,
    build_ragged_layout,
    poison_fp8_cache,
    ragged_positional,
    randn,
    random_page_selection,
    rng_for,
    sparse_mla_flat_case,
    tpu_interpret,
)

import attn_reference as ref
from attn_common import Fp8LatentCache, dequantize_latent_cache, padded_dk, quantize_latent_cache
from attn_pallas_tpu import (
    TpuFp8LatentCache,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
    sparse_mla_attention,
    sparse_mla_attention_qblock,
    supports,
)
from attn_pallas_tpu.fp8_rows import ROW_BYTES, dequantize_rows, scale_parts, side_rows

INTERPRET = tpu_interpret()
DV, ROPE = 512, 64
DK = DV + ROPE
DK_PAD = padded_dk(DK)
HEADS, SM_SCALE, PAGE = 2, 0.05, 16
TOL = dict(rtol_l2=2e-2, atol=5e-2, lse_atol=5e-2)  # bf16 rows against float32
# The FP8 rows dequantized in VMEM (``fp8_dequantize=False``): at these small shapes the
# default would copy the cache's bf16 rows first (test_copy_path_* check that path).
KERNELS = {
    "per_query": functools.partial(sparse_mla_attention, interpret=INTERPRET, fp8_dequantize=False),
    "qblock": functools.partial(
        sparse_mla_attention_qblock, query_block=8, interpret=INTERPRET, fp8_dequantize=False
    ),
}


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _assert_same(got, want):
    """Bit for bit, except that a NaN's sign and payload are free."""
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        nan = np.isnan(a.astype(np.float32))
        np.testing.assert_array_equal(nan, np.isnan(b.astype(np.float32)))
        np.testing.assert_array_equal(_bits(a)[~nan], _bits(b)[~nan])


def _bf16_rows(cache) -> np.ndarray:
    """``bf16(dequantize_latent_cache(cache))``: what the kernels compute on."""
    return np.asarray(dequantize_latent_cache(cache).astype(jnp.bfloat16))


# ----------------------------------------------------------------------- the layout


def test_scale_parts_rebuild_the_scale_bit_for_bit():
    """``(hi + mid) + lo`` in float32 is the scale, for random bit patterns over the
    whole exponent range down to 2**-103, +-Inf and the largest float32; NaN stays NaN."""
    bits = rng_for(120).integers(0, 2**32, size=50_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) >= 2.0**-103)]
    edge = [np.inf, -np.inf, np.finfo(np.float32).max, 2.0**-103, 1.0, 1.0 / 448]
    x = np.concatenate([x, np.asarray(edge, np.float32)])
    parts = np.asarray(scale_parts(jnp.asarray(x[:, None]))).astype(np.float32)[:, 0]
    np.testing.assert_array_equal(_bits((parts[:, 0] + parts[:, 1]) + parts[:, 2]), _bits(x))
    nan = np.asarray(scale_parts(jnp.full((1, 1), jnp.nan))).astype(np.float32)
    assert np.isnan(nan.sum())


def test_dequantized_rows_are_the_reference_rounded_to_bf16():
    """``dequantize_rows(latent, side_rows(cache))`` = ``bf16(dequantize_latent_cache)``
    then 64 zero lanes, bit for bit: normal, heavy-tailed (Student-t 2) and all-zero
    groups, and dirty tokens (NaN bytes, NaN / Inf / 0 scales, NaN rope)."""
    rng = rng_for(121)
    x = np.concatenate(
        [randn(rng, (40, DK), np.float32), rng.standard_t(2, (40, DK)).astype(np.float32)]
    )
    x[3, :128] = 0.0  # an all-zero group: scale 1
    cache = quantize_latent_cache(jnp.asarray(x))
    keep = np.ones(80, bool)
    keep[60:70] = False
    cache = poison_fp8_cache(cache, keep, seed=121)
    side = side_rows(cache)
    assert side.shape == (80, 128) and side.dtype == jnp.bfloat16
    assert cache.latent.nbytes // 80 + side.nbytes // 80 == ROW_BYTES == 768
    rows = np.asarray(jax.jit(dequantize_rows)(cache.latent, side))
    assert rows.shape == (80, DK_PAD) and rows.dtype == BF16
    _assert_same([rows[:, :DK]], [_bf16_rows(cache)])
    assert (rows[:, DK:].astype(np.float32) == 0).all()


def test_supports_takes_an_fp8_cache():
    """Whole 8-bit tiles compiled, any multiple of 16 interpreted (test_validation.py has
    the compiled refusal at 16)."""
    cache = quantize_latent_cache(jnp.zeros((1, 32, DK)))
    q = jnp.zeros((1, 2, HEADS, DK), jnp.bfloat16)
    for op in ("sparse_mla_attention", "sparse_mla_attention_qblock"):
        assert supports(op, q, cache, None, None, read_block=32) is None
        assert supports(op, q, cache, None, None, read_block=16, interpret=True) is None


# ------------------------------------------------------------------------------ flat


def _flat_case(seed, *, kv_len=88, rb=16, top_k=4, seq=9):
    """Flat case, every unattended row poisoned in every field."""
    q, kv, idx, pos = sparse_mla_flat_case(
        seed, dk=DK, batch=2, seq=seq, heads=HEADS, kv_len=kv_len, rb=rb, top_k=top_k
    )
    cache = quantize_latent_cache(jnp.asarray(kv))
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=rb)
    assert (~keep).any() and keep.any()
    return q.astype(BF16), poison_fp8_cache(cache, keep, seed=seed), idx, pos


def _flat(fn, q, kv, idx, pos, rb=16):
    return fn(q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=rb, return_lse=True)


def _check_flat(kernel, seed, tpu_layout=False, **case):
    rb = case.get("rb", 16)
    q, cache, idx, pos = _flat_case(seed, **case)
    stored = TpuFp8LatentCache.from_cache(cache) if tpu_layout else cache
    got = _flat(KERNELS[kernel], q, stored, idx, pos, rb)
    assert_no_races()
    same_op = _flat(KERNELS[kernel], q, jnp.asarray(_bf16_rows(cache)), idx, pos, rb)
    _assert_same(got, same_op)
    out, lse = (np.asarray(x) for x in got)
    assert np.isfinite(out).all() and np.isneginf(lse).any() and np.isfinite(lse).mean() > 0.5
    assert_exact_zero_rows(out, lse)
    assert_sparse_mla_close(got, _flat(ref.sparse_mla_attention, q, cache, idx, pos, rb), **TOL)


@pytest.mark.slow
def test_flat_per_query():
    _check_flat("per_query", 122)


@pytest.mark.slow
def test_flat_qblock_rb32_tpu_layout():
    """T = 150 padded to whole 32-token units: the TpuFp8LatentCache padded as stored."""
    _check_flat("qblock", 123, tpu_layout=True, kv_len=150, rb=32, top_k=3)


# ---------------------------------------------------------------------------- ragged


def _ragged_layout(seed):
    rng = rng_for(seed)
    layout = build_ragged_layout(
        rng, seq_lens=[37, 50, 5], new_lens=[6, 4, 0], extra_pages=[1, 0, 2], page_size=PAGE
    )
    kv = randn(rng, (layout["num_pages"], PAGE, DK), np.float32)
    idx = random_page_selection(rng, layout, 4, PAGE)
    idx[3] = -1  # nothing selected
    return rng, layout, quantize_latent_cache(jnp.asarray(kv)), idx


def _ragged_kw(layout):
    return dict(
        sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=PAGE, page_size=PAGE,
        q_seq_id=layout["q_seq_id"], seq_lens=layout["seq_lens"],
        cu_kv_lens=layout["cu_kv_lens"], page_indices=layout["page_indices"], return_lse=True,
    )  # fmt: skip


def _paged_bf16(cache) -> jnp.ndarray:
    """The bf16 paged cache ``[P, PS // 2, 2, Dk_pad]`` of ``bf16(dequantized)`` rows,
    NaN in the feature padding (the bf16 kernels never read it)."""
    rows = _bf16_rows(cache)
    rows = np.pad(rows, ((0, 0), (0, 0), (0, DK_PAD - DK)), constant_values=np.nan)
    return jnp.asarray(rows.reshape(cache.shape[0], PAGE // 2, 2, DK_PAD))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_ragged_attention(kernel):
    rng, layout, cache, idx = _ragged_layout(124)
    pos = layout["positions"].copy()
    pos[-1] += 40  # seq_lens binds
    keep = attended_rows_ragged(layout, idx, pos, page_size=PAGE, num_pages=cache.shape[0])
    cache = poison_fp8_cache(cache, keep, seed=124)
    q = randn(rng, (1, len(pos), HEADS, DK), BF16)
    _check_ragged(kernel, layout, cache, q, idx, pos, empty=slice(3, 4))


@pytest.mark.slow  # interpret mode at Dv = 512, both kernels
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_ragged_waits_for_every_copy_it_starts(kernel, capfd):
    """Two stores, two rings (the FP8 latent and its side rows), pages read in place, run
    with DMAs executed when started: a copy nobody waits for leaves a semaphore non-zero
    at kernel exit, which the interpreter reports. Bitwise the default mode's result."""
    rng, layout, cache, idx = _ragged_layout(31)
    pos = layout["positions"]
    q = randn(rng, (1, len(pos), HEADS, DK), BF16)
    kw = _ragged_kw(layout)
    eager = dataclasses.replace(INTERPRET, dma_execution_mode="eager")
    got = KERNELS[kernel](q, cache, idx[None], pos[None], **kw, interpret=eager)
    jax.block_until_ready(got)
    assert "non-zero count" not in capfd.readouterr().out
    _assert_same(got, KERNELS[kernel](q, cache, idx[None], pos[None], **kw))


def _check_ragged(kernel, layout, cache, q, idx, pos, *, empty: slice):
    """``kernel`` over the FP8 cache: bitwise itself over the bf16 dequantized cache,
    queries ``empty`` (which select nothing) out 0 and LSE -inf, close to the reference."""
    kw = _ragged_kw(layout)
    got = KERNELS[kernel](q, cache, idx[None], pos[None], **kw)
    assert_no_races()
    _assert_same(got, KERNELS[kernel](q, _paged_bf16(cache), idx[None], pos[None], **kw))
    out, lse = (np.asarray(x) for x in got)
    assert np.isneginf(lse[0, empty]).all() and (out[0, empty] == 0).all()
    assert_exact_zero_rows(out, lse)
    assert_sparse_mla_close(
        got, ref.sparse_mla_attention(q, cache, idx[None], pos[None], **kw), **TOL
    )


@pytest.mark.slow  # interpret mode at Dv = 512, both kernels
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_ragged_decode(kernel):
    """Decode: 8 requests of 1-4 query tokens each (their last positions), 3 pages
    each; one request with nothing selected; unattended rows poisoned."""
    rng = rng_for(126)
    seq_lens = [int(n) for n in rng.integers(20, 64, 8)]
    new_lens = [int(n) for n in rng.integers(1, 5, 8)]
    layout = build_ragged_layout(
        rng, seq_lens=seq_lens, new_lens=new_lens, extra_pages=[1] * 8, page_size=PAGE
    )
    kv = randn(rng, (layout["num_pages"], PAGE, DK), np.float32)
    cache = quantize_latent_cache(jnp.asarray(kv))
    idx = random_page_selection(rng, layout, 3, PAGE)
    pos = layout["positions"]
    first = int(np.cumsum([0, *new_lens])[2])
    idx[first : first + new_lens[2]] = -1  # request 2 selects nothing
    keep = attended_rows_ragged(layout, idx, pos, page_size=PAGE, num_pages=cache.shape[0])
    cache = poison_fp8_cache(cache, keep, seed=126)
    q = randn(rng, (1, len(pos), HEADS, DK), BF16)
    _check_ragged(kernel, layout, cache, q, idx, pos, empty=slice(first, first + new_lens[2]))


# ---------------------------------------------------------------- write-then-attend

WRAPPERS = {
    "per_query": functools.partial(prefill_write_and_attend_ragged, fp8_dequantize=False),
    "qblock": functools.partial(
        prefill_write_and_attend_ragged_qblock, query_block=8, fp8_dequantize=False
    ),
}


def _write_then_attend(kernel, tpu_layout: bool):
    """The wrapper on an FP8 cache (a plain ``Fp8LatentCache``, or with ``tpu_layout``
    a ``TpuFp8LatentCache``, which it keeps): the new cache equals the reference's bit
    for bit (new rows quantized by the XLA scatter), and the output equals the same
    kernel's on the bf16 rows of that new cache. Rows nobody attends are poisoned before
    the write (the new tokens' slots among them: the write must overwrite them)."""
    rng, layout, cache, idx = _ragged_layout(125)
    num_q = int(layout["new_lens"].sum())
    pos = layout["positions"]
    cu, pages = layout["cu_kv_lens"], layout["page_indices"]
    req = layout["q_seq_id"]  # the new tokens' slots: pos is request-local
    loc = (pages[cu[req] // PAGE + pos // PAGE] * PAGE + pos % PAGE).astype(np.int32)
    keep = attended_rows_ragged(layout, idx, pos, page_size=PAGE, num_pages=cache.shape[0])
    keep[loc] = False
    cache = poison_fp8_cache(cache, keep, seed=125)
    ql, qpe = randn(rng, (num_q, HEADS, DV), BF16), randn(rng, (num_q, HEADS, ROPE), BF16)
    kvc, kpe = randn(rng, (num_q, DV), np.float32), randn(rng, (num_q, ROPE), np.float32)
    args = (ql, qpe, kvc, kpe, cache, idx, pos, loc, layout["seq_lens"], layout["cu_q_lens"],
            layout["cu_kv_lens"], pages)  # fmt: skip
    kw = dict(kv_lora_rank=DV, page_size=PAGE, sm_scale=SM_SCALE)
    stored = TpuFp8LatentCache.from_cache(cache) if tpu_layout else cache
    # Jitted, each a single compile (eagerly, ~200 small ones: 9 of the test's 15 s).
    wrapper = jax.jit(functools.partial(WRAPPERS[kernel], **kw, interpret=INTERPRET))
    out, new_cache = wrapper(*args[:4], stored, *args[5:])
    assert_no_races()
    want_out, want_cache = jax.jit(functools.partial(ref.prefill_write_and_attend_ragged, **kw))(
        *args
    )
    assert isinstance(new_cache, TpuFp8LatentCache) == tpu_layout
    if tpu_layout:
        new_cache = new_cache.to_cache()
    _assert_same(jax.tree.leaves(new_cache), jax.tree.leaves(want_cache))
    q = jnp.concatenate([ql, qpe], axis=-1)[None]
    attend = jax.jit(functools.partial(KERNELS[kernel], **_ragged_kw(layout)))(
        q, _paged_bf16(new_cache), idx[None], pos[None]
    )
    _assert_same([out], [attend[0][0]])
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=0, atol=5e-2)


def test_write_then_attend_per_query_tpu_layout():
    _write_then_attend("per_query", tpu_layout=True)


@pytest.mark.slow
def test_write_then_attend_qblock():
    _write_then_attend("qblock", tpu_layout=False)


def test_tpu_layout_holds_the_same_cache():
    """``TpuFp8LatentCache``: 768 bytes per token, the same values as the cache it was
    built from (scale and rope read back exactly), through reshape and row gathers."""
    rng = rng_for(126)
    cache = quantize_latent_cache(jnp.asarray(rng.standard_t(2, (3, 32, DK)), jnp.float32))
    tpu = TpuFp8LatentCache.from_cache(cache)
    assert tpu.shape == (3, 32) and tpu.nbytes == 3 * 32 * ROW_BYTES
    assert len(jax.tree.leaves(tpu)) == 2
    back = tpu.reshape(96).take_rows(jnp.arange(95, -1, -1)).to_cache()
    want = cache.reshape(96).take_rows(jnp.arange(95, -1, -1))
    _assert_same(jax.tree.leaves(back), jax.tree.leaves(want))
    q = jnp.zeros((3, 2, HEADS, DK), jnp.bfloat16)
    idx, pos = jnp.zeros((3, 2, 1), jnp.int32), jnp.zeros((3, 2), jnp.int32)
    bad = TpuFp8LatentCache(tpu.latent, tpu.side[..., :64])
    with pytest.raises(ValueError, match=r"cache.side: got bfloat16 \(3, 32, 64\), expected"):
        sparse_mla_attention(q, bad, idx, pos, sm_scale=SM_SCALE, read_block=16)


# ------------------------------------------------------------- the bf16 copy path


# Slow (~13 s): the quick tier checks the copied rows (test_dequantized_rows_*), when the
# copy is taken (test_copy_path_choice) and the bf16 kernels elsewhere.
@pytest.mark.slow
def test_copy_path_flat_per_query():
    """``fp8_dequantize=True`` (XLA copies the cache's bf16 rows, ``dequantize_rows``,
    then the bf16 kernel) and the default, which takes the copy at this shape: the bits
    of the in-VMEM path."""
    q, cache, idx, pos = _flat_case(127)
    in_vmem = _flat(KERNELS["per_query"], q, cache, idx, pos)
    for choice in (True, None):
        kernel = functools.partial(sparse_mla_attention, interpret=INTERPRET, fp8_dequantize=choice)
        _assert_same(_flat(kernel, q, cache, idx, pos), in_vmem)
    assert_no_races()


@pytest.mark.slow
def test_copy_path_ragged_qblock_named_pages():
    """The query-blocked kernel over the copy of the 11 pages the table names (of a
    22-page pool, an unused slot's page outside it), a ``TpuFp8LatentCache``: the bits
    of the in-VMEM path."""
    rng = rng_for(128)
    layout = build_ragged_layout(
        rng, seq_lens=[37, 50, 5], new_lens=[6, 4, 0], extra_pages=[1, 0, 2], page_size=PAGE,
        spare_pages=11,
    )  # fmt: skip
    layout["page_indices"][layout["cu_kv_lens"][1] // PAGE - 1] = layout["num_pages"] + 5
    assert 2 * layout["page_indices"].shape[0] <= layout["num_pages"]
    cache = quantize_latent_cache(
        jnp.asarray(randn(rng, (layout["num_pages"], PAGE, DK), np.float32))
    )
    idx = random_page_selection(rng, layout, 4, PAGE)
    pos = layout["positions"]
    keep = attended_rows_ragged(layout, idx, pos, page_size=PAGE, num_pages=cache.shape[0])
    cache = TpuFp8LatentCache.from_cache(poison_fp8_cache(cache, keep, seed=128))
    q = randn(rng, (1, len(pos), HEADS, DK), BF16)
    kw = _ragged_kw(layout)
    in_vmem = KERNELS["qblock"](q, cache, idx[None], pos[None], **kw)
    copy = functools.partial(
        sparse_mla_attention_qblock, query_block=8, interpret=INTERPRET, fp8_dequantize=True
    )
    _assert_same(copy(q, cache, idx[None], pos[None], **kw), in_vmem)
    assert_no_races()


def _pallas_fp8_inputs(fn, *structs) -> list[bool]:
    """For each Pallas call in ``fn``'s jaxpr at ``structs`` (traced, not run): whether
    it takes an FP8 array."""
    found = []

    def visit(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(any(v.aval.dtype == jnp.float8_e4m3fn for v in eqn.invars))
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        visit(sub)

    visit(jax.make_jaxpr(fn)(*structs).jaxpr)
    return found


def test_copy_path_choice():
    """The default copies the bf16 rows where they are at most a quarter of the rows
    gathered (prefill: 4096 queries x 2048 tokens of a 32K cache) and reads FP8 in VMEM
    otherwise (decode: 256 queries x 2048 tokens of 128 requests x 32K); the rows a
    ragged copy holds are the pages the table names (prefill in a 4M-token pool)."""
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32

    def fp8_struct(*grid):
        return Fp8LatentCache(sds((*grid, DV), jnp.float8_e4m3fn), sds((*grid, 4), jnp.float32),
                              sds((*grid, ROPE), jnp.bfloat16))  # fmt: skip

    def flat_args(n, kv_len):
        return (sds((1, n, 16, DK), BF16), fp8_struct(1, kv_len), sds((1, n, 32), i32),
                sds((1, n), i32))  # fmt: skip

    def flat(n, kv_len, **kw):
        fn = functools.partial(sparse_mla_attention, sm_scale=0.07, read_block=64, **kw)
        return _pallas_fp8_inputs(fn, *flat_args(n, kv_len))

    # 32K rows x 4 against 4096 (or 64, the boundary) x 32 units x 64 rows gathered.
    assert flat(4096, 32768) == [False] and flat(4096, 32768, fp8_dequantize=False) == [True]
    assert flat(64, 32768) == [False] and flat(63, 32768) == [True]
    assert flat(63, 32768, fp8_dequantize=True) == [False]
    page, pool = 64, 65536
    for requests, per, want_fp8 in ((4, 1024, False), (128, 2, True)):
        slots, n = requests * 32768 // page, requests * per
        ragged = ragged_positional(
            sparse_mla_attention, sm_scale=0.07, read_block=page, page_size=page
        )
        structs = (sds((1, n, 16, DK), BF16), fp8_struct(pool, page), sds((1, n, 32), i32),
                   sds((1, n), i32), sds((n,), i32), sds((requests,), i32),
                   sds((requests + 1,), i32), sds((slots,), i32))  # fmt: skip
        assert _pallas_fp8_inputs(ragged, *structs) == [want_fp8]
    bad = functools.partial(sparse_mla_attention_qblock, fp8_dequantize=1)
    with pytest.raises(TypeError, match="fp8_dequantize"):
        jax.eval_shape(functools.partial(bad, sm_scale=0.07, read_block=64), *flat_args(8, 256))
