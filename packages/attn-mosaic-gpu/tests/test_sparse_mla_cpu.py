"""CPU checks of the Hopper sparse-MLA kernel and its front door (no GPU needed).

* Interpret mode (``plgpu.InterpretGPUParams``, race detection on, shared memory starts
  as NaN) at small shapes against ``attn_reference.sparse_mla_attention``: flat mode
  with unit- and token-level selections (``-1``, duplicate, out-of-range ids, causally
  empty queries, ``kv_len`` binding), ragged paged mode, caches whose unattended rows are
  NaN/Inf, empty work, the ``_qblock`` twin, the write-back and the write-then-attend
  wrapper. Interpret mode runs the same schedule and barriers as the GPU; only the
  cp.async row gather (inline Mosaic GPU, which the interpreter does not run) and the
  register-A wgmma are replaced (``sparse_mla_kernel._build_kernel``).
* Cross-lowering: ``jax.export`` with ``platforms=["cuda"]`` at the benchmark shapes
  (4096 tokens, 128 heads, top-2048 tokens; flat and ragged) traces and lowers the
  whole call, row table included, to its Mosaic GPU custom call.
* Validation: what the kernel does not take is refused by name, and ``supports`` says
  why so that dispatch falls back to the reference.
* The launch order: every (head group, token) once, in chunks of tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_sparse_mla_close,
    export_mosaic_gpu,
    gpu_interpret,
    poison_ragged_case,
    ragged_positional,
    randn,
    random_row_table,
    rng_for,
    run_interpret,
    sparse_mla_flat_case,
    sparse_mla_ragged_call,
    sparse_mla_ragged_case,
)

import attn_mosaic_gpu as gpu
import attn_reference as ref
from attn_mosaic_gpu import _sparse_mla_rows, sparse_mla_kernel
from attn_mosaic_gpu.sparse_mla_kernel import SparseMlaKernelConfig, sparse_mla_rows_attention

INTERPRET = gpu_interpret()
DV, ROPE = 128, 64
DK = DV + ROPE  # 192 -> Dk_pad 256 in the paged cache: the feature padding is exercised
SM_SCALE = 0.07
TOL = dict(rtol_l2=1e-2, atol=3e-2)  # bf16 inputs, P rounded to bf16 for the value product
LSE_ATOL = 2e-3
_LARGE_MAX_STEP = 8.0  # a rise of a row's running max (base 2) that counts as large


def _run(fn, *args, **kwargs):
    return run_interpret(fn, *args, interpret=INTERPRET, **kwargs)


def _check(got, want):
    assert_sparse_mla_close(got, want, **TOL, lse_atol=LSE_ATOL)


# ------------------------------------------------------------------------------------
# Flat mode


def flat_case(seed, *, batch=2, seq=7, heads=3, kv_len=88, rb=16, top_k=4):
    """bf16 inputs with -1, duplicate and out-of-range ids, empty queries, a tail unit."""
    return sparse_mla_flat_case(
        seed, dk=DK, batch=batch, seq=seq, heads=heads, kv_len=kv_len, rb=rb, top_k=top_k,
        dtype="bfloat16",
    )  # fmt: skip


def _flat(fn, case, *, rb=16, **kw):
    q, kv, idx, pos = case
    return fn(
        q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=rb, return_lse=True, **kw
    )


@pytest.mark.slow  # ~31 s: the quick tier's flat per-query kernel runs in
# test_sparse_mla_grad_cpu.py's test_flat_gradients_through_the_kernel[tokens] (and the
# conformance suite's test_flat[mosaic-gpu-plain-bfloat16-rb16])
def test_flat_units_vs_reference():
    """The case has empty queries, -1 and duplicate units; the config passed."""
    case = flat_case(1)
    config = SparseMlaKernelConfig()
    got = _run(_flat, gpu.sparse_mla_attention, case, config=config)
    want = _flat(ref.sparse_mla_attention, case)
    assert np.isneginf(np.asarray(want[1])).any()  # the case has empty queries
    _check(got, want)


@pytest.mark.slow  # ~11 s: the quick tier's query-blocked kernel against the reference
# is test_sparse_mla_qblock_cpu.py's test_op_vs_reference[2]
def test_qblock_twin_vs_reference_and_knobs_checked():
    """The query-blocked kernel (3 heads padded to 4: blocks of 16 queries, one partly
    padded) on a case with a duplicate and a triplicate id and empty queries."""
    case = flat_case(3, batch=2, seq=9)
    got = _run(_flat, functools.partial(gpu.sparse_mla_attention_qblock, query_block=8), case)
    _check(got, _flat(ref.sparse_mla_attention, case))
    with pytest.raises(ValueError, match="query_block"):
        _flat(functools.partial(gpu.sparse_mla_attention, query_block=0), case)


@pytest.mark.parametrize(
    ("seq", "top_k", "kv_len"), [(0, 3, 32), (5, 0, 32), (5, 3, 0)], ids=["S0", "K0", "T0"]
)
def test_empty_work(seq, top_k, kv_len):
    rng = rng_for(40)
    q = randn(rng, (2, seq, 2, DK), "bfloat16")
    kv = randn(rng, (2, kv_len, DK), "bfloat16")
    idx = np.zeros((2, seq, top_k), np.int32)
    pos = np.zeros((2, seq), np.int32)
    out, lse = _flat(
        functools.partial(gpu.sparse_mla_attention, interpret=INTERPRET), (q, kv, idx, pos)
    )
    assert out.shape == (2, seq, 2, DV) and lse.shape == (2, seq, 2)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


# ------------------------------------------------------------------------------------
# Ragged paged mode

SEQ_LENS = [40, 7, 33]
NEW_LENS = [6, 7, 5]
EXTRA_PAGES = [1, 0, 2]


def ragged_case(seed, page_size=16, heads=2, top_k=4, new_lens=NEW_LENS):
    return sparse_mla_ragged_case(
        seed, seq_lens=SEQ_LENS, new_lens=new_lens, extra_pages=EXTRA_PAGES,
        page_size=page_size, heads=heads, top_k=top_k, dk=DK, dk_pad=256, dtype="bfloat16",
    )  # fmt: skip


def _ragged(fn, case, page_size=16, **kw):
    return sparse_mla_ragged_call(fn, case, page_size, sm_scale=SM_SCALE, dv=DV, **kw)


@pytest.mark.slow  # the quick tier has the same case: test_conformance_sparse_mla.py's
# test_ragged_paged[mosaic-gpu-plain-bfloat16-rb16] (Dk 192, pages of 16, poisoned rows)
def test_ragged_poisoned_vs_reference():
    """Shuffled pages; NaN/Inf in page tails, unreferenced and unselected pages, and in
    the feature padding of every row."""
    case = ragged_case(10)
    want = _ragged(ref.sparse_mla_attention, case)
    assert np.isneginf(np.asarray(want[1])[0, 3]).all()
    dirty = poison_ragged_case(case, 16, dk=DK, seed=10)
    got = _run(_ragged, gpu.sparse_mla_attention, dirty)
    _check(got, want)


def test_write_back_bit_identical_and_prefill_wrapper():
    layout, cache, q, idx, positions = ragged_case(11, new_lens=[2, 3, 1])
    rng = rng_for(11)
    num_q = q.shape[1]
    rows = randn(rng, (num_q, 256), "bfloat16")
    slots = cache.shape[0] * 16
    loc = rng.integers(-1, slots, size=num_q).astype(np.int32)
    loc[1] = loc[0]  # a slot written twice: the last write wins
    got = gpu.paged_write_back(cache, rows, loc, page_size=16)
    want = ref.paged_write_back(cache, rows, loc, page_size=16)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))

    # The wrapper: write each new token's latent at its own slot, then attend.
    cu_kv, q_seq_id = layout["cu_kv_lens"], layout["q_seq_id"]
    local = positions - np.asarray([0, 0, 0])[q_seq_id]
    slot_page = layout["page_indices"][cu_kv[q_seq_id] // 16 + local // 16]
    new_loc = (slot_page * 16 + local % 16).astype(np.int32)
    new_loc[positions >= layout["seq_lens"][q_seq_id]] = -1
    ql, qpe = q[0, :, :, :DV], q[0, :, :, DV:]
    kvc, kpe = randn(rng, (num_q, DV), "bfloat16"), randn(rng, (num_q, ROPE), "bfloat16")
    args = (ql, qpe, kvc, kpe, cache, idx, positions, new_loc, layout["seq_lens"],
            layout["cu_q_lens"], cu_kv, layout["page_indices"])  # fmt: skip
    kw = dict(kv_lora_rank=DV, page_size=16, sm_scale=SM_SCALE)
    out, new_cache = _run(gpu.prefill_write_and_attend_ragged, *args, **kw)
    # The reference jitted: one compile (eagerly, one per operation).
    want_out, want_cache = jax.jit(functools.partial(ref.prefill_write_and_attend_ragged, **kw))(
        *args
    )
    np.testing.assert_array_equal(
        np.asarray(new_cache).view(np.uint16), np.asarray(want_cache).view(np.uint16)
    )
    lse = np.zeros(out.shape[:2], np.float32)  # the wrapper returns no LSE
    assert_close(np.asarray(out), np.asarray(want_out), **TOL)
    assert np.isfinite(np.asarray(out)).all() and lse.shape == (num_q, q.shape[2])


# ------------------------------------------------------------------------------------
# The kernel on its own


@pytest.mark.parametrize("lag", [1, 3, 8])
@pytest.mark.parametrize("groups", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
# 8 and 64 tokens (whole chunks only) and 3 head groups in the slow tier: 17 tokens have
# whole chunks and a short one, 2 head groups the order between groups.
@pytest.mark.parametrize(
    "tokens", [1, 7, pytest.param(8, marks=pytest.mark.slow), 17,
               pytest.param(64, marks=pytest.mark.slow)],
)  # fmt: skip
def test_lagged_launch_order(lag, groups, tokens):
    """The launch order runs every (head group, token) once; within each chunk of
    ``lag`` tokens (the last one shorter) all of head group ``g`` before ``g + 1``, so a
    token's head groups are ``min(lag, tokens left)`` programs apart."""
    st = sparse_mla_kernel._SparseMlaStatics(
        tokens=tokens, heads=64 * groups, dv=DV, width=DK, sm_scale=1.0, rope_at=DV
    )
    program = jnp.arange(groups * tokens, dtype=jnp.int32)
    group, token = (np.asarray(x) for x in _sparse_mla_rows.lagged_program(program, lag, st))
    order = {(int(g), int(t)): i for i, (g, t) in enumerate(zip(group, token, strict=True))}
    assert sorted(order) == [(g, t) for g in range(groups) for t in range(tokens)]
    for (g, t), i in order.items():
        chunk = t // lag
        size = min(lag, tokens - chunk * lag)
        assert i == chunk * lag * groups + g * size + t - chunk * lag


def _rows_vs_float64(q, store, rows, counts):
    """``sparse_mla_rows_attention`` in interpret mode against float64 math on the same
    bf16 inputs, token by token; returns each token's scores ``[heads, count]``."""
    out, lse = _run(
        sparse_mla_rows_attention, q, store, jnp.asarray(rows), jnp.asarray(counts),
        sm_scale=SM_SCALE, dv=DV,
    )  # fmt: skip
    qf = np.asarray(q.astype(jnp.float32), np.float64)
    sf = np.asarray(store.astype(jnp.float32), np.float64)
    scores = []
    for n, c in enumerate(counts):
        keys = sf[rows[n, :c], :DK]
        s = qf[n] @ keys.T * SM_SCALE
        m = s.max(1, keepdims=True)
        p = np.exp(s - m)
        want = p @ keys[:, :DV] / p.sum(1, keepdims=True)
        assert_close(np.asarray(out[n]), want, **TOL)
        np.testing.assert_allclose(np.asarray(lse[n]), m[:, 0] + np.log(p.sum(1)), atol=LSE_ATOL)
        scores.append(s)
    return scores


def test_kernel_two_head_groups_and_partial_pairs():
    """128 heads (two programs per token), counts that end inside a block and a pair
    (race detection on: the one-way exchange reuses its P and max buffers every pair)."""
    rng = np.random.default_rng(5)
    tokens, heads, kp, store_rows = 2, 128, 256, 300
    counts = np.array([129, 63], np.int32)
    rows = random_row_table(rng, counts, kp, store_rows)
    q = jnp.asarray(rng.standard_normal((tokens, heads, DK)), jnp.bfloat16)
    store = rng.standard_normal((store_rows, 200)).astype(np.float32)
    store[:, DK:] = np.nan  # row padding past Dk is never read
    store = jnp.asarray(store, jnp.bfloat16)
    _rows_vs_float64(q, store, rows, counts)


@pytest.mark.slow  # ~26 s: the quick tier reads Q's rope apart against the reference in
# test_write_back_bit_identical_and_prefill_wrapper (the wrapper's kernel reads ql, qpe)
def test_kernel_reads_q_rope_apart():
    """Q's rope features given as their own array (what the prefill wrapper passes, so
    as not to copy Q joining them) give the bits of the joined Q; 80 heads, so both
    parts are padded to two head groups; race detection."""
    rng = np.random.default_rng(8)
    tokens, heads, kp, store_rows = 2, 80, 128, 200
    counts = np.array([128, 70], np.int32)
    rows = random_row_table(rng, counts, kp, store_rows)
    q = jnp.asarray(rng.standard_normal((tokens, heads, DK)), jnp.bfloat16)
    store = jnp.asarray(rng.standard_normal((store_rows, DK)), jnp.bfloat16)
    args = (store, jnp.asarray(rows), jnp.asarray(counts))
    joined = _run(sparse_mla_rows_attention, q, *args, sm_scale=SM_SCALE, dv=DV)
    apart = _run(
        sparse_mla_rows_attention, q[..., :DV], *args, sm_scale=SM_SCALE, dv=DV,
        q_rope=q[..., DV:],
    )  # fmt: skip
    for got, want in zip(apart, joined, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="q_rope"):
        sparse_mla_rows_attention(q[..., :DV], *args, sm_scale=SM_SCALE, dv=DV, q_rope=q[..., :32])


@pytest.mark.slow  # ~34 s: the rescale is unconditional; the quick tier's
# test_kernel_two_head_groups_and_partial_pairs moves the running max over pairs too
def test_kernel_running_max_moves():
    """Scores whose row maxima rise from pair to pair by small steps and by large ones
    (keys scaled up along the selection), fall (the first pair holds every maximum) or
    jump once by far more: WG0's rescale of its P and accumulator by the pair's max,
    against float64 math on the same bf16 inputs; 64 heads, 4 pairs, a partial last
    block, race detection. One token (one program) per order, each over its own block
    of store rows, in one launch."""
    rng = np.random.default_rng(11)
    orders, heads, count, block_rows = ("rising", "falling", "jump"), 64, 420, 480
    rows = np.full((len(orders), 512), -1, np.int32)
    store = np.empty((len(orders) * block_rows, DK))
    for n, order in enumerate(orders):
        own = n * block_rows + rng.choice(block_rows, count, replace=False)
        rows[n, :count] = own
        # A key row's scale: how large the scores of the r-th selected row are.
        position = np.zeros(block_rows)
        position[own - n * block_rows] = np.arange(count)
        key_scale = {
            "rising": 1.0 + position / 40.0,  # each pair's maxima ~2 log2 units above the last
            "falling": 4.0 - 3.0 * position / count,
            "jump": np.where(position >= 200, 6.0, 1.0),
        }[order]
        store[n * block_rows : (n + 1) * block_rows] = (
            rng.standard_normal((block_rows, DK)) * key_scale[:, None]
        )
    q = jnp.asarray(rng.standard_normal((len(orders), heads, DK)), jnp.bfloat16)
    counts = np.full((len(orders),), count, np.int32)
    scores = _rows_vs_float64(q, jnp.asarray(store, jnp.bfloat16), rows, counts)
    for order, s in zip(orders, scores, strict=True):
        # Each token's selection is ordered by key scale: the max moves as meant.
        block_max = s[:, : 13 * 32].reshape(heads, 13, 32).max(2) * np.log2(np.e)
        steps = np.diff(np.maximum.accumulate(block_max, 1), axis=1)
        if order == "rising":
            assert ((steps > 0) & (steps < _LARGE_MAX_STEP)).any()
        if order == "jump":
            assert (steps > _LARGE_MAX_STEP).any()


# ------------------------------------------------------------------------------------
# Validation and dispatch facts


def test_refuses_what_the_kernel_does_not_take():
    case = flat_case(4, batch=1, seq=7)
    q, kv, idx, pos = case
    with pytest.raises(TypeError, match=r"kv: got dtype float32.*bfloat16"):
        _flat(gpu.sparse_mla_attention, (q, kv.astype(np.float32), idx, pos))
    with pytest.raises(NotImplementedError, match="multiple of 128"):
        gpu.sparse_mla_attention(q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=64, read_block=16)
    wide_q, wide_kv = np.concatenate([q, q[..., :DV]], -1), np.concatenate([kv, kv[..., :DV]], -1)
    with pytest.raises(NotImplementedError, match="rope = 64"):
        _flat(gpu.sparse_mla_attention, (wide_q, wide_kv, idx, pos))
    with pytest.raises(TypeError, match="config"):
        _flat(gpu.sparse_mla_attention, case, config=(64, 1))
    assert "bfloat16" in gpu.supports("sparse_mla_attention", q, kv.astype(np.float32))
    assert gpu.supports("sparse_mla_attention", q.astype(np.float32), kv, kv_lora_rank=DV) is None
    assert gpu.supports("sparse_mla_attention", q, kv, kv_lora_rank=DV) is None
    assert "multiple of 128" in gpu.supports("sparse_mla_attention_qblock", q, kv, kv_lora_rank=96)
    assert gpu.supports("paged_write_back", kv, kv, kv) is None
    with pytest.raises(ValueError, match=r"block_k: got 32, expected 64.*da2ec0c"):
        SparseMlaKernelConfig(32, 2, "one_way")  # the 32-row ring, removed
    with pytest.raises(ValueError, match="num_stages: got 2"):
        SparseMlaKernelConfig(block_k=64, num_stages=2)
    with pytest.raises(ValueError, match="exchange: got 'lockstep'"):
        SparseMlaKernelConfig(exchange="lockstep")  # removed
    with pytest.raises(TypeError, match="config"):
        sparse_mla_rows_attention(q[0], kv[0], idx[0], idx[0, :, 0], sm_scale=1.0, config=(64,))
    # The one schedule (one pair of 64-row blocks in parts, the one-way max exchange):
    # constants, not fields; spelling them out is deprecated.
    assert dataclasses.fields(SparseMlaKernelConfig) == ()
    schedule = SparseMlaKernelConfig
    assert (schedule.block_k, schedule.num_stages, schedule.exchange) == (64, 1, "one_way")
    with pytest.warns(DeprecationWarning, match=r"block_k, num_stages, exchange=.*no knobs"):
        assert SparseMlaKernelConfig(64, 1, "one_way") == SparseMlaKernelConfig()


@pytest.mark.parametrize("dv", [pytest.param(512, marks=pytest.mark.slow), 128])
def test_smem_bytes_is_what_mosaic_allocates(monkeypatch, dv):
    """``sparse_mla_config.forward_smem_bytes`` / ``backward_smem_bytes`` (what
    ``MAX_DV`` and the dv check rest on) equal Mosaic GPU's own count of each kernel's
    shared memory, lowered for the GPU (an FP8 store is staged in the same slots)."""
    from helpers import count_mosaic_smem

    from attn_mosaic_gpu import sparse_mla_config
    from attn_mosaic_gpu.sparse_mla_bwd_kernel import sparse_mla_rows_backward

    counted = count_mosaic_smem(monkeypatch)
    sds = jax.ShapeDtypeStruct
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    q, rows, counts = sds((8, 64, dv + 64), bf16), sds((8, 128), i32), sds((8,), i32)
    store, vec = sds((256, dv + 64), bf16), sds((8, 64), f32)

    def forward(q, store, rows, counts):
        return sparse_mla_rows_attention(q, store, rows, counts, sm_scale=0.1, dv=dv)

    def backward(q, store, rows, counts, lse, d_out, delta):
        return sparse_mla_rows_backward(
            q, store, rows, counts, lse, d_out, delta, sm_scale=0.1, dv=dv
        )

    jax.jit(forward).trace(q, store, rows, counts).lower(lowering_platforms=("cuda",))
    args = (q, store, rows, counts, vec, sds((8, 64, dv), f32), vec)
    jax.jit(backward).trace(*args).lower(lowering_platforms=("cuda",))
    assert counted == [
        sparse_mla_config.forward_smem_bytes(dv),
        sparse_mla_config.backward_smem_bytes(dv),
    ]


def test_latent_width_limited_by_shared_memory():
    """Dv = 512 fits the 227 KiB of a block (Q and a key block of each); 640 does not:
    ``supports`` falls back naming it, the kernels refuse it, never Mosaic at compile
    time."""
    from attn_mosaic_gpu import sparse_mla_config
    from attn_mosaic_gpu.sparse_mla_bwd_kernel import sparse_mla_rows_backward

    assert sparse_mla_config.MAX_DV == 512
    assert sparse_mla_config.forward_smem_bytes(512) <= sparse_mla_config.SMEM_LIMIT_BYTES
    assert sparse_mla_config.backward_smem_bytes(640) > sparse_mla_config.SMEM_LIMIT_BYTES
    q = np.zeros((1, 2, 1, 704), np.float32)
    kv = np.zeros((1, 8, 704), jnp.bfloat16)
    reason = gpu.supports("sparse_mla_attention", q, kv, kv_lora_rank=640)
    assert "kv_lora_rank: got 640" in reason and "at most 512" in reason and "bytes" in reason
    qk = jnp.zeros((2, 64, 704), jnp.bfloat16)
    store = jnp.zeros((8, 704), jnp.bfloat16)
    rows, counts = jnp.zeros((2, 128), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(NotImplementedError, match=r"dv: got 640.*at most 512.*shared memory"):
        sparse_mla_rows_attention(qk, store, rows, counts, sm_scale=0.1, dv=640)
    vec = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"dv: got 640.*at most 512"):
        sparse_mla_rows_backward(
            qk, store, rows, counts, vec, jnp.zeros((2, 64, 640)), vec, sm_scale=0.1, dv=640
        )


# ------------------------------------------------------------------------------------
# Cross-lowering at the benchmark shapes


def _export(fn, *shapes):
    return export_mosaic_gpu(fn, *(jax.ShapeDtypeStruct(s, d) for s, d in shapes))


# Quick: the per-query kernel lowers in test_sparse_mla_qblock_cpu.py's
# test_cross_lowers_flat_token_level (with the row sort and the blocked kernel) and in
# test_cross_lowers_prefill_wrapper_without_joining_q below.
@pytest.mark.slow
@pytest.mark.parametrize("heads", [128, 64])
def test_cross_lowers_flat_token_level(heads):
    """H=128 (and 64), 4096 tokens, top-2048 tokens of an 8K flat cache: the row-sort
    kernel builds the table, the sparse-MLA kernel attends."""
    tokens, top_k, cache = 4096, 2048, 8192

    def fn(q, kv, idx, pos):
        return gpu.sparse_mla_attention(
            q, kv, idx, pos, sm_scale=0.0721, read_block=1, return_lse=True
        )

    _export(
        fn,
        ((1, tokens, heads, 576), jnp.bfloat16),
        ((1, cache, 576), jnp.bfloat16),
        ((1, tokens, top_k), jnp.int32),
        ((1, tokens), jnp.int32),
    )


@pytest.mark.slow  # the ragged paged call lowers in the quick tier through the wrapper
# (test_cross_lowers_prefill_wrapper_without_joining_q)
def test_cross_lowers_ragged_paged():
    tokens, page, pages, top_k, requests = 4096, 64, 4 * 128 + 8, 32, 4

    fn = ragged_positional(
        gpu.sparse_mla_attention, sm_scale=0.0721, read_block=page, page_size=page
    )

    _export(
        fn,
        ((1, tokens, 128, 576), jnp.bfloat16),
        ((pages, page // 2, 2, 640), jnp.bfloat16),
        ((1, tokens, top_k), jnp.int32),
        ((1, tokens), jnp.int32),
        ((tokens,), jnp.int32),
        ((requests,), jnp.int32),
        ((requests + 1,), jnp.int32),
        ((pages,), jnp.int32),
    )


def test_cross_lowers_prefill_wrapper_without_joining_q():
    """The write-then-attend wrapper at a benchmark shape lowers for the GPU, and its
    kernel reads ``ql`` and ``qpe`` where they are: no ``[1, T, H, 576]`` joined query
    (a copy of all of Q, 0.3-0.4 ms at this shape on the H200) is built."""
    tokens, heads, page, pages, top_k, requests = 4096, 128, 64, 4 * 128 + 8, 32, 4

    def fn(ql, qpe, kvc, kpe, cache, idx, pos, loc, seq_lens, cu_q, cu_kv, page_indices):
        return gpu.prefill_write_and_attend_ragged(
            ql, qpe, kvc, kpe, cache, idx, pos, loc, seq_lens, cu_q, cu_kv, page_indices,
            kv_lora_rank=512, page_size=page, sm_scale=0.0721,
        )  # fmt: skip

    i32 = jnp.int32
    text = _export(
        fn,
        ((tokens, heads, 512), jnp.bfloat16),
        ((tokens, heads, 64), jnp.bfloat16),
        ((tokens, 512), jnp.bfloat16),
        ((tokens, 64), jnp.bfloat16),
        ((pages, page // 2, 2, 640), jnp.bfloat16),
        ((tokens, top_k), i32),
        ((tokens,), i32),
        ((tokens,), i32),
        ((requests,), i32),
        ((requests + 1,), i32),
        ((requests + 1,), i32),
        ((pages,), i32),
    )
    assert f"{tokens}x{heads}x576" not in text
