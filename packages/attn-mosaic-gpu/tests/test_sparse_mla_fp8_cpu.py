"""CPU checks of the Hopper sparse-MLA kernel over an FP8 latent cache (no GPU needed).

The kernel dequantizes the rows it gathers to bf16 on chip, ``bf16(float32(latent) *
scale)``: its result over an ``Fp8LatentCache`` is the bits of its result over the bf16
cache ``dequantize_latent_cache(cache).astype(bfloat16)``, which these tests check
exactly, and within bf16 tolerance of the reference on the FP8 cache.

* Interpret mode (race detection on, shared memory starts as NaN): the kernel alone (two
  head groups, row counts ending inside a block and a pair, a token with no row, ``-1``
  rows after the count), flat token-level, ragged paged and decode-shaped (8 requests
  of 1-4 query tokens) calls with ``-1``,
  duplicate and out-of-range ids and empty queries, the write-then-attend wrapper.
  Every cache row no query attends holds NaN latent bytes, a NaN, Inf or 0 scale and
  NaN rope values, so reading one would show. Interpret mode replaces the compiled
  path's ``cp.async`` staging and in-place dequantization (inline Mosaic GPU code) by
  plain loads and stores (``_sparse_mla_rows.gather_part_fp8_interpret``); the
  schedule and barriers are the same.
* The compiled path's maps, simulated byte for byte on integers: the staging copies and
  the in-place dequantization fill the slot exactly as wgmma reads it, without a bank
  conflict.
* Cross-lowering: ``jax.export`` with ``platforms=["cuda"]`` at the benchmark shapes
  (flat prefill, ragged decode) lowers the FP8 call, row table included, to its Mosaic
  GPU custom call; the lowered module's copies, conversions and registers are counted.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_sparse_mla_close,
    attended_rows_flat,
    attended_rows_ragged,
    build_ragged_layout,
    export_mosaic_gpu,
    gpu_interpret,
    load_script,
    ragged_positional,
    randn,
    random_page_selection,
    random_row_table,
    rng_for,
    run_interpret,
)

import attn_mosaic_gpu as gpu
import attn_reference as ref
from attn_common import Fp8LatentCache, dequantize_latent_cache, quantize_latent_cache
from attn_mosaic_gpu.sparse_mla import dequantize_store_first
from attn_mosaic_gpu.sparse_mla_kernel import sparse_mla_rows_attention

INTERPRET = gpu_interpret()
DV, ROPE, DK = 512, 64, 576
SM_SCALE = 0.05
# Against the reference on the FP8 cache (float32 keys): the kernel's keys are those
# values rounded to bf16 (its exact check is bitwise against the bf16 kernel on them),
# which moves the LSE by about sm_scale * |q| * |k| * 2**-9 at Dk = 576 and the output's
# largest elements by a few 1e-2 (0.034 seen at 7 queries x 2 heads, seed 600).
TOL = dict(rtol_l2=1e-2, atol=8e-2, lse_atol=1e-2)


def _run(fn, *args, **kwargs):
    return run_interpret(fn, *args, interpret=INTERPRET, **kwargs)


def _equal(got, want):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _as_bf16(cache: Fp8LatentCache) -> jax.Array:
    """The bf16 cache the FP8 one reads as on chip: ``[..., 576]``."""
    return dequantize_latent_cache(cache).astype(jnp.bfloat16)


def poison_fp8(cache: Fp8LatentCache, keep: np.ndarray, seed: int) -> Fp8LatentCache:
    """``cache`` (token grid flattened to ``[R]`` by ``keep [R]``) with every row not in
    ``keep`` dirty in every field: NaN latent bytes, a NaN, +Inf or 0 scale, NaN rope."""
    rng = np.random.default_rng(seed)
    grid = cache.shape
    latent = np.asarray(cache.latent).reshape(-1, DV).copy()
    scale = np.asarray(cache.scale).reshape(-1, 4).copy()
    rope = np.asarray(cache.rope).reshape(-1, ROPE).copy()
    dirty = ~keep.reshape(-1)
    assert dirty.any() and keep.any()
    latent[dirty] = np.asarray(jnp.full((DV,), jnp.nan, jnp.float8_e4m3fn))
    scale[dirty] = rng.choice([np.nan, np.inf, 0.0], size=(int(dirty.sum()), 4))
    rope[dirty] = np.nan
    return Fp8LatentCache(
        jnp.asarray(latent).reshape(*grid, DV),
        jnp.asarray(scale).reshape(*grid, 4),
        jnp.asarray(rope).reshape(*grid, ROPE),
    )


def _random_cache(rng, grid) -> Fp8LatentCache:
    x = rng.standard_normal((*grid, DK)).astype(np.float32)
    x[..., :DV] *= rng.uniform(0.25, 2.0, size=(*grid, 4)).repeat(128, -1)  # group scales
    return quantize_latent_cache(jnp.asarray(x))


# ------------------------------------------------------------------------------------
# The kernel on its own


@pytest.mark.slow  # interpret mode at Dv = 512, two runs (~25 s): the quick tier runs the
# kernel on chip over a dirty FP8 cache against the reference in
# test_q_gradient_over_fp8_cache
def test_kernel_fp8_rows_bitwise_as_bf16_rows():
    """Row counts 256 (two full pairs), 63 (inside a block) and 0 (nothing: out 0, LSE
    -inf); ``-1`` after each count; every unlisted store row dirty; race detection.
    (The memory warpgroup's work is per program: head groups are the bf16 tests'.)"""
    rng = np.random.default_rng(3)
    tokens, heads, kp, store_rows = 3, 64, 256, 300
    counts = np.array([256, 63, 0], np.int32)
    rows = random_row_table(rng, counts, kp, store_rows)
    keep = np.zeros(store_rows, bool)
    keep[rows[rows >= 0]] = True
    store = poison_fp8(_random_cache(rng, (store_rows,)), keep, seed=3)
    q = jnp.asarray(rng.standard_normal((tokens, heads, DK)), jnp.bfloat16)
    args = (jnp.asarray(rows), jnp.asarray(counts))
    got = _run(sparse_mla_rows_attention, q, store, *args, sm_scale=SM_SCALE)
    want = _run(sparse_mla_rows_attention, q, _as_bf16(store), *args, sm_scale=SM_SCALE)
    _equal(got, want)
    assert np.isfinite(np.asarray(got[0])).all()
    assert np.isneginf(np.asarray(got[1])[2]).all() and not np.asarray(got[0])[2].any()


def _slot_element(r: int, f: int) -> int:
    """Element of a ``[64, 512]`` bf16 key slot holding row ``r``, feature ``f``: tiles of
    8 rows x 64 features, row-major, 16-byte chunk ``j`` of a tile row at ``j ^ (r % 8)``
    (the 128-byte swizzle wgmma reads). Written out apart from the kernel's maps."""
    tile, col = f // 64, f % 64
    return ((r // 8) * 8 + tile) * 512 + (r % 8) * 64 + ((col // 8) ^ (r % 8)) * 8 + col % 8


def _banks(offsets) -> int:
    """Distinct 16-byte bank positions (of 8) that 16-byte accesses at ``offsets`` hit."""
    return len({(o % 128) // 16 for o in offsets})


@pytest.mark.parametrize("half", ["L", "R"])
def test_compiled_fp8_stage_and_dequantize_in_place(half):
    """The compiled path's maps (``fp8_stage``, ``fp8_scale_at``, ``fp8_dequant_map``:
    the functions the kernel's MLIR is built from, here on integers; interpret mode runs
    other code), simulated byte for byte on a slot full of garbage: the memory WG's
    cp.async copies as it issues them (8 threads a row), then each warp of the compute WG
    loading everything, syncing, and storing. The part's slot then holds ``bf16(latent *
    scale)`` of every row where ``_slot_element`` says, the other part's tiles are
    untouched, every thread stays inside its own row, and no quarter warp's 16-byte
    loads or stores meet in a bank."""
    from attn_mosaic_gpu._sparse_mla_rows import fp8_dequant_map, fp8_scale_at, fp8_stage

    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, DK)).astype(np.float32)
    x *= rng.uniform(0.1, 9.0, (64, 1)).astype(np.float32)
    cache = quantize_latent_cache(jnp.asarray(x))
    latent = np.asarray(cache.latent).view(np.uint8)
    scale = np.asarray(cache.scale)
    slot = rng.integers(0, 256, 64 * DV * 2, dtype=np.uint8)  # garbage
    before = slot.copy()
    lo = 0 if half == "L" else DV // 2
    part_bytes = set()
    # The memory WG: 8 threads per row, chunks c and c + 8, the scales by chunk 0.
    for lane in range(128):
        group, c = lane // 8, lane % 8
        for i in range(4):
            r = group + 16 * i
            for k in (c, c + 8):
                dst = fp8_stage(r, k, half)
                slot[dst : dst + 16] = latent[r, lo + 16 * k : lo + 16 * k + 16]
                part_bytes.update(range(dst, dst + 16))
            if c == 0:
                dst = fp8_scale_at(r, half)
                slot[dst : dst + 16] = scale[r].view(np.uint8)
                part_bytes.update(range(dst, dst + 16))
    assert len(part_bytes) == 64 * (256 + 16)  # no two copies overlap
    # The compute WG: per warp, every load, then every store.
    for warp in range(4):
        lanes = range(32 * warp, 32 * warp + 32)
        loaded = {}
        for lane in lanes:
            group, steps = fp8_dequant_map(lane, half)
            r = lane // 2
            s_off = fp8_scale_at(r, half) + 4 * group
            sc = slot[s_off : s_off + 4].copy().view(np.float32)[0]
            loaded[lane] = (sc, [slot[ld : ld + 16].copy() for ld, _ in steps])
        for lane in lanes:
            group, steps = fp8_dequant_map(lane, half)
            sc, chunks = loaded[lane]
            for chunk, (_, dsts) in zip(chunks, steps, strict=True):
                vals = chunk.view(jnp.float8_e4m3fn).astype(np.float32) * sc
                out = np.asarray(jnp.asarray(vals, jnp.float32).astype(jnp.bfloat16))
                out = out.view(np.uint8)
                for h, dst in enumerate(dsts):
                    slot[dst : dst + 16] = out[16 * h : 16 * h + 16]
    want = np.asarray(
        (cache.latent.astype(jnp.float32).reshape(64, 4, 128) * cache.scale[..., None])
        .reshape(64, DV)
        .astype(jnp.bfloat16)
    ).view(np.uint16)
    got = slot.view(np.uint16)
    for r in range(64):
        for f in range(DV):
            e = _slot_element(r, f)
            if lo <= f < lo + DV // 2:
                assert got[e] == want[r, f], (r, f)
            else:
                assert got[e] == before.view(np.uint16)[e], (r, f)  # the other part's
    # Every access of a thread lies in its own row's 128-byte segments; banks.
    row_of = lambda off: (off // 1024) // 8 * 8 + (off % 1024) // 128  # noqa: E731
    for j in range(8):
        for quarter in range(16):
            lanes = range(8 * quarter, 8 * quarter + 8)
            maps = {lane: fp8_dequant_map(lane, half) for lane in lanes}
            loads = [maps[lane][1][j][0] for lane in lanes]
            assert _banks(loads) == 8
            for h in range(2):
                assert _banks([maps[lane][1][j][1][h] for lane in lanes]) == 8
            for lane in lanes:
                ld, dsts = maps[lane][1][j]
                assert {row_of(ld), *map(row_of, dsts)} == {lane // 2}


def test_kernel_refuses_fp8_it_does_not_take():
    rng = np.random.default_rng(4)
    store = _random_cache(rng, (8,))
    q = jnp.zeros((1, 2, DK), jnp.bfloat16)
    rows, counts = jnp.zeros((1, 128), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"store: got an Fp8LatentCache on the token grid"):
        sparse_mla_rows_attention(q, store.reshape(2, 4), rows, counts, sm_scale=1.0)
    with pytest.raises(NotImplementedError, match="dv: got 384"):
        sparse_mla_rows_attention(q[..., 128:], store, rows, counts, sm_scale=1.0, dv=384)


# ------------------------------------------------------------------------------------
# The op: flat and ragged paged, and the write-then-attend wrapper


def _flat_case(seed, *, seq=5, heads=2, kv_len=160, top_k=136):
    """Token-level selections (``read_block=1``) with -1, duplicate and out-of-range
    ids, an empty query, positions before and inside the cache; unattended rows dirty."""
    rng = rng_for(seed)
    cache = _random_cache(rng, (1, kv_len))
    q = randn(rng, (1, seq, heads, DK), "bfloat16")
    pos = np.array([[kv_len - 1, 90, 17, -2, kv_len - 40]], np.int32)[:, :seq]
    idx = rng.integers(-1, kv_len + 3, size=(1, seq, top_k)).astype(np.int32)
    idx[0, 1, 5:40] = idx[0, 1, 4]  # duplicates
    idx[0, 2] = -1  # nothing selected
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=1)
    return q, poison_fp8(cache, keep, seed), idx, pos


def _flat(fn, case, **kw):
    q, kv, idx, pos = case
    return fn(
        q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=1, return_lse=True, **kw
    )


@pytest.mark.slow  # interpret mode at Dv = 512, two runs: 12-40 s on 2 shared cores
def test_flat_token_level_fp8():
    q, cache, idx, pos = case = _flat_case(20)
    got = _run(_flat, gpu.sparse_mla_attention, case, fp8_dequantize=False)
    _equal(got, _run(_flat, gpu.sparse_mla_attention, (q, _as_bf16(cache), idx, pos)))
    _equal(got, _run(_flat, gpu.sparse_mla_attention, case, fp8_dequantize=True))
    want = _flat(ref.sparse_mla_attention, case)
    assert np.isneginf(np.asarray(want[1])).any()  # the case has empty queries
    assert_sparse_mla_close(got, want, **TOL)


PAGE = 16


def _ragged_case(seed, heads=2, top_k=4, spare_pages=2):
    """Shuffled pages, -1 / duplicate / past-the-end page ids, a query with nothing
    selected; every row no query attends dirty (page tails, spare and unselected pages)."""
    rng = rng_for(seed)
    layout = build_ragged_layout(
        rng, seq_lens=[40, 20, 33], new_lens=[3, 2, 2], extra_pages=[0, 1, 1], page_size=PAGE,
        spare_pages=spare_pages,
    )  # fmt: skip
    cache = _random_cache(rng, (layout["num_pages"], PAGE))
    q = randn(rng, (1, 7, heads, DK), "bfloat16")
    idx = random_page_selection(rng, layout, top_k, PAGE)
    idx[3] = -1
    keep = attended_rows_ragged(
        layout, idx, layout["positions"], page_size=PAGE, num_pages=layout["num_pages"]
    )
    return layout, poison_fp8(cache, keep, seed), q, idx


def _ragged(fn, layout, cache, q, idx, **kw):
    return fn(
        q, cache, idx[None], layout["positions"][None], sm_scale=SM_SCALE, kv_lora_rank=DV,
        read_block=PAGE, page_size=PAGE, q_seq_id=layout["q_seq_id"],
        seq_lens=layout["seq_lens"], cu_kv_lens=layout["cu_kv_lens"],
        page_indices=layout["page_indices"], return_lse=True, **kw,
    )  # fmt: skip


def _paged_bf16(cache: Fp8LatentCache) -> jax.Array:
    """The bf16 paged cache ``[pages, page / 2, 2, 640]`` holding ``_as_bf16(cache)``."""
    rows = jnp.pad(_as_bf16(cache), ((0, 0), (0, 0), (0, 640 - DK)))
    return rows.reshape(cache.shape[0], PAGE // 2, 2, 640)


@pytest.mark.slow  # interpret mode at Dv = 512, three runs: 25-75 s on 2 shared cores
def test_ragged_paged_fp8():
    """On chip, on the bf16 cache and on the bf16 copy of the pages the table names
    (at most half the pool's 22: the copy holds those 10 only), with an unused slot's
    page outside the pool: the same bits."""
    layout, cache, q, idx = _ragged_case(21, spare_pages=12)
    layout = {**layout, "page_indices": layout["page_indices"].copy()}
    unused = layout["cu_kv_lens"][2] // PAGE - 1  # request 1's extra slot, past its tokens
    layout["page_indices"][unused] = layout["num_pages"] + 3
    assert 2 * layout["page_indices"].shape[0] <= layout["num_pages"]
    got = _run(_ragged, gpu.sparse_mla_attention, layout, cache, q, idx, fp8_dequantize=False)
    _equal(got, _run(_ragged, gpu.sparse_mla_attention, layout, _paged_bf16(cache), q, idx))
    _equal(got, _run(_ragged, gpu.sparse_mla_attention, layout, cache, q, idx, fp8_dequantize=True))
    want = _ragged(ref.sparse_mla_attention, layout, cache, q, idx)
    assert np.isneginf(np.asarray(want[1])[0, 3]).all()
    assert_sparse_mla_close(got, want, **TOL)


@pytest.mark.slow  # interpret mode at Dv = 512, two runs
def test_ragged_decode_fp8():
    """Decode: 8 requests of 1-4 query tokens each (their last positions), 3 pages each,
    one request with nothing selected; unattended rows dirty."""
    rng = rng_for(24)
    new_lens = [int(n) for n in rng.integers(1, 5, 8)]
    layout = build_ragged_layout(
        rng, seq_lens=[int(n) for n in rng.integers(20, 64, 8)], new_lens=new_lens,
        extra_pages=[1] * 8, page_size=PAGE,
    )  # fmt: skip
    cache = _random_cache(rng, (layout["num_pages"], PAGE))
    q = randn(rng, (1, int(sum(new_lens)), 2, DK), "bfloat16")
    idx = random_page_selection(rng, layout, 3, PAGE)
    first = int(np.cumsum([0, *new_lens])[2])
    idx[first : first + new_lens[2]] = -1  # request 2 selects nothing
    keep = attended_rows_ragged(
        layout, idx, layout["positions"], page_size=PAGE, num_pages=layout["num_pages"]
    )
    cache = poison_fp8(cache, keep, 24)
    got = _run(_ragged, gpu.sparse_mla_attention, layout, cache, q, idx, fp8_dequantize=False)
    _equal(got, _run(_ragged, gpu.sparse_mla_attention, layout, _paged_bf16(cache), q, idx))
    assert np.isneginf(np.asarray(got[1])[0, first : first + new_lens[2]]).all()
    assert_sparse_mla_close(got, _ragged(ref.sparse_mla_attention, layout, cache, q, idx), **TOL)


@pytest.mark.slow  # interpret mode at Dv = 512: 10-30 s on 2 shared cores
def test_prefill_wrapper_fp8_quantizes_then_attends():
    """The write-then-attend wrapper on an FP8 cache: the new rows quantized and written
    as the reference writes them (bit for bit), then the kernel attends."""
    layout, cache, q, idx = _ragged_case(22)
    rng = rng_for(22)
    num_q = q.shape[1]
    cu_kv, q_seq_id, positions = layout["cu_kv_lens"], layout["q_seq_id"], layout["positions"]
    slot_page = layout["page_indices"][cu_kv[q_seq_id] // PAGE + positions // PAGE]
    loc = (slot_page * PAGE + positions % PAGE).astype(np.int32)
    kvc, kpe = randn(rng, (num_q, DV), "float32"), randn(rng, (num_q, ROPE), "float32")
    args = (q[0, :, :, :DV], q[0, :, :, DV:], kvc, kpe, cache, idx, positions, loc,
            layout["seq_lens"], layout["cu_q_lens"], cu_kv, layout["page_indices"])  # fmt: skip
    kw = dict(kv_lora_rank=DV, page_size=PAGE, sm_scale=SM_SCALE)
    out, new_cache = _run(gpu.prefill_write_and_attend_ragged, *args, **kw, fp8_dequantize=False)
    want_out, want_cache = ref.prefill_write_and_attend_ragged(*args, **kw)
    for a, b in zip(jax.tree.leaves(new_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    lse = np.zeros(out.shape[:2], np.float32)
    assert_sparse_mla_close((out, lse), (want_out, lse), **TOL)
    assert np.isfinite(np.asarray(out)).all()


def test_supports_fp8():
    layout, cache, q, idx = _ragged_case(23)
    args = (q, cache, idx[None], layout["positions"][None])
    assert gpu.supports("sparse_mla_attention", *args, kv_lora_rank=DV) is None
    assert gpu.supports("sparse_mla_attention_qblock", *args, kv_lora_rank=DV) is None
    ql, qpe = q[0, :, :, :DV], q[0, :, :, DV:]
    assert gpu.supports("prefill_write_and_attend_ragged", ql, qpe, None, None, cache) is None


# ------------------------------------------------------------------------------------
# Cross-lowering at the benchmark shapes


def _fp8_struct(*grid):
    sds = jax.ShapeDtypeStruct
    return Fp8LatentCache(
        sds((*grid, DV), jnp.float8_e4m3fn),
        sds((*grid, 4), jnp.float32),
        sds((*grid, ROPE), jnp.bfloat16),
    )


@pytest.mark.parametrize("heads", [16, pytest.param(128, marks=pytest.mark.slow)])
def test_cross_lowers_flat_prefill(heads):
    """4096 tokens, top-2048 tokens of a 32K flat FP8 cache."""
    sds = jax.ShapeDtypeStruct
    tokens, top_k, cache = 4096, 2048, 32768
    fn = functools.partial(
        gpu.sparse_mla_attention, sm_scale=0.0721, read_block=1, return_lse=True,
        fp8_dequantize=False,  # the default dequantizes this cache first (test_fp8_path)
    )  # fmt: skip
    export_mosaic_gpu(
        fn,
        sds((1, tokens, heads, DK), jnp.bfloat16),
        _fp8_struct(1, cache),
        sds((1, tokens, top_k), jnp.int32),
        sds((1, tokens), jnp.int32),
    )


@pytest.mark.slow  # the quick tier lowers the FP8 call in test_cross_lowers_flat_prefill[16]
def test_cross_lowers_ragged_decode():
    """128 requests x 2 query tokens, each selecting 32 pages of 64 tokens (2048 tokens)
    of its 32K."""
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    requests, per, page, top_k = 128, 2, 64, 32
    pages = requests * 32768 // page
    tokens = requests * per

    fn = ragged_positional(
        gpu.sparse_mla_attention, sm_scale=0.0721, read_block=page, page_size=page
    )
    export_mosaic_gpu(
        fn,
        sds((1, tokens, 16, DK), jnp.bfloat16),
        _fp8_struct(pages, page),
        sds((1, tokens, top_k), i32),
        sds((1, tokens), i32),
        sds((tokens,), i32),
        sds((requests,), i32),
        sds((requests + 1,), i32),
        sds((pages,), i32),
    )


def _pallas_input_dtypes(fn, *structs) -> list[set[str]]:
    """The input dtypes of every Pallas kernel in ``fn``'s jaxpr at ``structs`` (traced,
    not run; a Mosaic GPU kernel of several warpgroups shows as ``mpmd_map``)."""
    found = []

    def visit(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("pallas_call", "mpmd_map"):
                found.append({str(v.aval.dtype) for v in eqn.invars})
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        visit(sub)

    visit(jax.make_jaxpr(fn)(*structs).jaxpr)
    return found


def test_fp8_path():
    """``dequantize_store_first`` at the benchmark shapes and its boundary, and the op
    following it: the attention kernel reads the FP8 arrays (on chip) or bf16 rows (the
    whole cache dequantized first), as ``fp8_dequantize`` says or, by default, the rule."""
    first = dequantize_store_first
    assert first(32768, 4096 * 2048, 16) and first(32768, 4096 * 2048, 128)  # prefill
    assert not first(128 * 32768, 256 * 2048, 16)  # decode, 128 requests x 2 tokens
    assert first(1000, 8000, 64) and not first(1001, 8000, 64)
    assert first(1001, 4004, 65)  # two head groups gather every row twice
    sds = jax.ShapeDtypeStruct
    tokens, top_k, kv_len = 4096, 2048, 32768
    args = (sds((1, tokens, 16, DK), jnp.bfloat16), _fp8_struct(1, kv_len),
            sds((1, tokens, top_k), jnp.int32), sds((1, tokens), jnp.int32))  # fmt: skip

    def reads_fp8(kv_len, **kw):
        fn = functools.partial(gpu.sparse_mla_attention, sm_scale=0.07, read_block=1, **kw)
        calls = _pallas_input_dtypes(fn, *args[:1], _fp8_struct(1, kv_len), *args[2:])
        attention = [c for c in calls if "bfloat16" in c]  # the row sort's are int32 only
        assert len(attention) == 1
        return "float8_e4m3fn" in attention[0]

    assert not reads_fp8(kv_len) and not reads_fp8(kv_len, fp8_dequantize=True)
    assert reads_fp8(kv_len, fp8_dequantize=False)
    long = tokens * top_k // 8 + 1  # one row past the rule's boundary
    assert reads_fp8(long) and not reads_fp8(long, fp8_dequantize=True)
    # Ragged: the copy holds the pages the table names, so prefill in a large pool takes
    # it (4 requests of 32K in a 4M-token pool) and decode over long requests does not.
    page, pool = 64, 65536
    for requests, per, want_fp8 in ((4, 1024, False), (128, 2, True)):
        slots, n = requests * 32768 // page, requests * per
        structs = (sds((1, n, 16, DK), jnp.bfloat16), _fp8_struct(pool, page),
                   sds((1, n, 32), jnp.int32), sds((1, n), jnp.int32), sds((n,), jnp.int32),
                   sds((requests,), jnp.int32), sds((requests + 1,), jnp.int32),
                   sds((slots,), jnp.int32))  # fmt: skip
        ragged = ragged_positional(
            gpu.sparse_mla_attention, sm_scale=0.07, read_block=page, page_size=page
        )
        calls = [c for c in _pallas_input_dtypes(ragged, *structs) if "bfloat16" in c]
        assert len(calls) == 1 and ("float8_e4m3fn" in calls[0]) == want_fp8
    with pytest.raises(TypeError, match="fp8_dequantize"):
        bad = functools.partial(gpu.sparse_mla_attention, fp8_dequantize="yes")
        jax.eval_shape(functools.partial(bad, sm_scale=0.07, read_block=1), *args)


def _kernel_module(store) -> str:
    """The Mosaic GPU module of ``sparse_mla_rows_attention`` on ``store``, lowered for
    CUDA, as text (``tests/kernel_fingerprint.py``'s ``lowered_kernels``)."""
    sds = jax.ShapeDtypeStruct

    def attend(q, store, rows, counts):
        return sparse_mla_rows_attention(q, store, rows, counts, sm_scale=0.07)

    args = (sds((8, 64, DK), jnp.bfloat16), store, sds((8, 256), jnp.int32), sds((8,), jnp.int32))
    script = Path(__file__).resolve().parents[3] / "tests" / "kernel_fingerprint.py"
    with load_script(script, "kernel_fingerprint") as fingerprint:
        return fingerprint.lowered_kernels(attend, args)


@pytest.mark.slow  # ~5 s: in the quick tier the FP8 kernel's code is pinned by
# tests/test_kernel_fingerprint.py (sparse-mla-fp8-kernel-h64) and lowers for CUDA in
# test_cross_lowers_flat_prefill[16]
def test_lowered_kernel_registers_and_copies():
    """The FP8 kernel's module: the bf16 kernel's registers (232 / 232 / 40); the memory
    WG's ``cp.async`` copies (per thread and row of a part: two 16-byte FP8 chunks, the
    scales by one thread of 8, and for part R the rope), each part's code emitted once
    per refill (L0, R1, R0, L1); the compute WGs' in-place dequantization (8 16-byte
    shared loads and 32 words converted per thread and part), emitted for each WG, part
    and pair loop (unmasked, masked). (The bf16 kernel's module is unchanged:
    ``tests/kernel_fingerprint.py``.)"""
    fp8 = _kernel_module(_fp8_struct(512))
    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+)", fp8)
    assert sorted(set(regs)) == [("dec", "40"), ("inc", "232")]
    rows_per_thread = 4
    per_part = {"L": rows_per_thread * 3, "R": rows_per_thread * 4}  # latent x2, scale, rope
    assert fp8.count("nvvm.cp.async.shared.global") == 2 * (per_part["L"] + per_part["R"])
    dequants = 2 * 2 * 2  # WGs x parts x pair loops
    assert fp8.count("ld.shared.v4.b32") == dequants * 8
    assert fp8.count("cvt.rn.f16x2.e4m3x2 x, l") == dequants * 32
    assert fp8.count("st.shared.v4.b32") == dequants * 16


def test_q_gradient_over_fp8_cache():
    """``jax.grad`` in ``q`` through the FP8 path (the kernel forward, XLA's backward from
    its saved LSE over the dequantized rows) against the reference's, on a cache whose
    unattended rows are dirty."""
    q, cache, idx, pos = _flat_case(30, seq=3, top_k=130)

    def loss(fn, q, **kw):
        out = fn(q, cache, idx, pos, sm_scale=SM_SCALE, read_block=1, **kw)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    on_chip = functools.partial(gpu.sparse_mla_attention, fp8_dequantize=False)
    # One jitted program: no eager operation queued behind the interpreted kernel
    # (tests/test_x64.py says why).
    grad = jax.jit(jax.grad(functools.partial(loss, on_chip, interpret=INTERPRET)))
    got = run_interpret(grad, q)
    want = jax.jit(jax.grad(functools.partial(loss, ref.sparse_mla_attention)))(q)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)
