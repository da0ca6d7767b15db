"""Sparse MLA training on the TPU backend: interpret mode and cross-lowering (CPU only).

Forward and backward are kernels (``attn_pallas_tpu.sparse_mla_bwd``: dq per query, dKV
over the inverted selection), run in TPU interpret mode (races detected, out-of-bounds
reads raise, uninitialised memory NaN). The gradients through both forward kernels equal
the reference's (its XLA VJP, at HIGHEST precision) on the same inputs, through ``out``
and ``lse``: float32 within ``rtol 1e-5, atol 1e-6`` elementwise, bfloat16 within ``2e-2
+ 1e-2 |ref|`` (gradients up to ~2.4: about 1 %; bf16 ``p`` and ``ds`` feed the MXU as in
the forward). Inputs hold -1, duplicate, triplicate and out-of-range ids, empty queries
(their ``dq`` exactly 0), NaN/Inf in every cache row no query attends (its gradient
exactly 0) and NaN in the paged cache's feature padding; ``return_attn_mass`` matches.
The inverted selection is checked against a brute force (hypothesis); the gradients are
equal bit for bit across runs and across pair chunkings (which change the dKV grid).
``jax.export(..., platforms=["tpu"])`` lowers ``jax.grad`` (the forward and both backward
kernels) plus the mass, at the production shape too (flat and paged). A cache the
kernels do not take (FP8) gets the XLA backward; the prefill wrapper's ``ql`` / ``qpe``
gradients equal the reference wrapper's; the cost model counts what it says.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    attended_rows_flat,
    check_wrapper_query_grads,
    compare_sparse_mla_grads,
    dirty_ragged_grad_case,
    export_sparse_mla_grad,
    poison_rows,
    rng_for,
    run_interpret,
    sparse_mla_flat_case,
    sparse_mla_loss_grad,
    tpu_interpret,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_pallas_tpu as tpu
import attn_reference as ref
from attn_common.fp8_cache import quantize_latent_cache
from attn_common.sparse_mla_xla import xla_sparse_mla
from attn_common.spec import sparse_mla_call
from attn_pallas_tpu import (
    _prep,
    sparse_mla,
    sparse_mla_bwd,
    sparse_mla_qblock,
    sparse_mla_qblock_bwd,
)
from attn_pallas_tpu.config import SparseMlaConfig
from attn_pallas_tpu.plan import block_union_sizes
from attn_pallas_tpu.sparse_mla_bwd import invert_selection

INTERPRET = tpu_interpret()
DV, ROPE = 128, 64
SM_SCALE = 0.07
GRAD_TOL = {
    "float32": dict(rtol=1e-5, atol=1e-6),
    "bfloat16": dict(rtol=1e-2, atol=2e-2),
}
MASS_ATOL = 1e-4  # exp(s - lse) with the kernel's LSE
KERNELS = {
    "per_query": (tpu.sparse_mla_attention, {}),
    "qblock": (tpu.sparse_mla_attention_qblock, {"query_block": 8}),
}


def _compare(kernel, q, kv, idx, pos, keep_rows, **kw):
    fn, knobs = KERNELS[kernel]
    return compare_sparse_mla_grads(
        fn, q, kv, idx, pos, keep_rows, kernel_kw=dict(interpret=INTERPRET, **knobs),
        sm_scale=SM_SCALE, dv=DV, grad_tol=GRAD_TOL[jnp.dtype(q.dtype).name],
        mass_atol=MASS_ATOL, **kw,
    )  # fmt: skip


# Both forward kernels feed the same backward kernels: the default tier runs the per-query
# op over the flat cache (float32) and the query-blocked op's own backward over the paged
# cache (test_qblock_backward_over_the_paged_cache, bfloat16); the other modes, dtypes,
# knobs, schedules and bitwise repeats are slow.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [
        ("per_query", "float32"),
        pytest.param("per_query", "bfloat16", marks=_SLOW),
        pytest.param("qblock", "bfloat16", marks=_SLOW),
        pytest.param("qblock", "float32", marks=_SLOW),
    ],
)
def test_flat_gradients_through_the_kernels(kernel, dtype):
    q, kv, idx, pos = sparse_mla_flat_case(
        2, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3, dtype=dtype
    )
    keep = attended_rows_flat(idx, pos, kv_len=64, read_block=16)
    dq, _ = _compare(kernel, q, poison_rows(kv, keep, seed=3), idx, pos, keep, read_block=16)
    # sparse_mla_flat_case's empty queries: nothing selected, a negative position, a
    # selection entirely after the query.
    assert np.all(dq[0, [3, 4, 6]] == 0.0) and np.any(dq[0, [0, 1, 2, 5, 7]] != 0.0)


@_SLOW
@pytest.mark.parametrize(("dtype", "heads"), [("float32", 8), ("bfloat16", 16)])
def test_dkv_stacks_pairs_when_heads_fill_tiles(dtype, heads):
    """H a multiple of the sublane tile: the dKV step stacks several (block, query) pairs'
    query rows (3 here, so chunks end in partial steps whose stale ring rows must stay
    out), over a poisoned cache; the per-query programs walk 2 units a step."""
    q, kv, idx, pos = sparse_mla_flat_case(
        6, dk=DV + ROPE, batch=1, seq=12, heads=heads, kv_len=64, rb=16, top_k=3, dtype=dtype
    )
    keep = attended_rows_flat(idx, pos, kv_len=64, read_block=16)
    cfg = SparseMlaConfig(units_per_step=2, ring_slots=2, queries_per_program=4, pairs_per_step=3)
    assert sparse_mla_bwd.pairs_per_step(cfg, heads, dtype) == 3
    assert sparse_mla_bwd.pairs_per_step(cfg, 2, dtype) == 1
    compare_sparse_mla_grads(
        tpu.sparse_mla_attention, q, poison_rows(kv, keep, seed=7), idx, pos, keep,
        kernel_kw=dict(interpret=INTERPRET, config=cfg), sm_scale=SM_SCALE, dv=DV,
        grad_tol=GRAD_TOL[dtype], mass_atol=MASS_ATOL, read_block=16,
    )  # fmt: skip


@_SLOW
def test_forward_walks_its_own_units_per_step(monkeypatch):
    """``forward_units_per_step`` is the per-query forward's ``G`` (4 units a step here,
    the last step of most queries partial) and the backward keeps ``units_per_step`` (1):
    both exact over a poisoned cache."""
    seen = []
    real = sparse_mla._per_query_call

    def spy(*args, **kwargs):
        seen.append(kwargs["cfg"].units_per_step)
        return real(*args, **kwargs)

    monkeypatch.setattr(sparse_mla, "_per_query_call", spy)
    q, kv, idx, pos = sparse_mla_flat_case(
        8, dk=DV + ROPE, batch=1, seq=12, heads=8, kv_len=128, rb=16, top_k=4, dtype="float32"
    )
    keep = attended_rows_flat(idx, pos, kv_len=128, read_block=16)
    cfg = SparseMlaConfig(units_per_step=1, forward_units_per_step=4, ring_slots=2,
                          queries_per_program=4)  # fmt: skip
    compare_sparse_mla_grads(
        tpu.sparse_mla_attention, q, poison_rows(kv, keep, seed=8), idx, pos, keep,
        kernel_kw=dict(interpret=INTERPRET, config=cfg), sm_scale=SM_SCALE, dv=DV,
        grad_tol=GRAD_TOL["float32"], mass_atol=MASS_ATOL, read_block=16,
    )  # fmt: skip
    assert seen and set(seen) == {4}


@_SLOW
@pytest.mark.parametrize("mode", ["flat", "ragged"])
def test_per_query_clean_and_masked_steps(monkeypatch, mode):
    """2 units a step: steps whose units lie wholly before the query's limit are *clean*
    (their slot reaches the products as copied) and the others mask in place each entry
    that straddles the limit or lies past it (``StepWalk.words``), in one program's ring,
    forward and dq, over a poisoned cache (bf16, so the ragged cache's rows are packed
    token pairs). The call's step tables hold both kinds of step. Fails when either kind
    of entry goes unmasked."""
    seen = []
    real = _prep.query_steps

    def spy(*args, **kwargs):
        t = real(*args, **kwargs)
        jax.debug.callback(
            lambda m, s: seen.append((np.asarray(m), np.asarray(s))), t.meta, t.steps
        )
        return t

    monkeypatch.setattr(_prep, "query_steps", spy)
    cfg = SparseMlaConfig(units_per_step=2, forward_units_per_step=2, ring_slots=2,
                          queries_per_program=4)  # fmt: skip
    kw = dict(kernel_kw=dict(interpret=INTERPRET, config=cfg), sm_scale=SM_SCALE, dv=DV,
              grad_tol=GRAD_TOL["bfloat16"], mass_atol=MASS_ATOL)  # fmt: skip
    if mode == "flat":
        q, kv, idx, pos = sparse_mla_flat_case(
            12, dk=DV + ROPE, batch=1, seq=12, heads=2, kv_len=128, rb=16, top_k=5,
            dtype="bfloat16",
        )  # fmt: skip
        keep = attended_rows_flat(idx, pos, kv_len=128, read_block=16)
        compare_sparse_mla_grads(
            tpu.sparse_mla_attention, q, poison_rows(kv, keep, seed=12), idx, pos, keep,
            read_block=16, **kw,
        )  # fmt: skip
    else:
        q, cache, idx, pos, keep, tables = dirty_ragged_grad_case(
            13, seq_lens=[70, 5, 40], new_lens=[4, 0, 3], extra_pages=[1, 0, 1],
            page_size=16, heads=2, top_k=4, dk=DV + ROPE, dtype="bfloat16",
        )  # fmt: skip
        compare_sparse_mla_grads(tpu.sparse_mla_attention, q, cache, idx, pos, keep, **tables, **kw)
    flags = [
        s[p, 0, 2 * (s.shape[-1] // 3) + t]
        for m, s in seen
        for p in range(s.shape[0])
        for t in range(m[p, 0, 0])
    ]
    assert 1 in flags and 0 in flags


@_SLOW
@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [("per_query", "float32"), ("per_query", "bfloat16"), ("qblock", "float32"),
     ("qblock", "bfloat16")],
)  # fmt: skip
def test_ragged_gradients_through_the_kernels(kernel, dtype):
    q, cache, idx, pos, keep, tables = dirty_ragged_grad_case(
        5, seq_lens=[37, 5, 20], new_lens=[4, 0, 3], extra_pages=[1, 0, 1], page_size=16,
        heads=2, top_k=3, dk=DV + ROPE, dtype=dtype,
    )  # fmt: skip
    _, dcache = _compare(kernel, q, cache, idx, pos, keep, **tables)
    assert np.all(dcache.reshape(keep.size, -1)[:, DV + ROPE :] == 0.0)


# Per-query kernel; query-blocked with QB 64; automatic tiling (a lax.cond between the
# two kernels under jit). Forward kernels, backward kernels: the per-query op's dq and
# dKV; the query-blocked op's block and sum kernels in a lax.cond with dq and dKV.
EXPORTED = {
    "per_query": (tpu.sparse_mla_attention, {}, 1, 2),
    "qblock_qb64": (tpu.sparse_mla_attention_qblock, {"query_block": 64}, 1, 4),
    "qblock_auto": (tpu.sparse_mla_attention_qblock, {}, 2, 4),
}


@pytest.mark.parametrize(
    "kernel", [pytest.param(k, marks=_SLOW) if k == "qblock_qb64" else k for k in EXPORTED]
)
def test_grad_cross_lowers_for_tpu(kernel):
    """``jax.grad`` through out and lse, plus the mass: 512 tokens, 128 heads, top-16
    units of 128 tokens of a 16K flat cache, Dk 576 / Dv 512."""
    fn, knobs, forward, backward = EXPORTED[kernel]
    text = export_sparse_mla_grad(
        fn, "tpu", tokens=512, heads=128, cache=16384, top_k=16, sm_scale=0.04, read_block=128,
        **knobs,
    )  # fmt: skip
    assert text.count("tpu_custom_call") == forward + backward


@_SLOW  # ~12 s: the forward and backward kernels interpreted
def test_integer_inputs_get_float0_cotangents():
    """``jax.vjp`` over every positional input of the kernel path: ``float0`` for the
    indices and positions (the custom_vjp gives the integer tables no cotangent)."""
    q, kv, idx, pos = sparse_mla_flat_case(
        9, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3, dtype="bfloat16"
    )

    def f(q, kv, idx, pos):
        return tpu.sparse_mla_attention(
            q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=16,
            interpret=INTERPRET,
        )  # fmt: skip

    out, vjp = run_interpret(jax.vjp, f, q, kv, jnp.asarray(idx), jnp.asarray(pos))
    dq, dkv, didx, dpos = vjp(jnp.ones_like(out))
    assert dq.dtype == jnp.bfloat16 and dkv.dtype == jnp.bfloat16
    assert didx.dtype == jax.dtypes.float0 and dpos.dtype == jax.dtypes.float0


INV_QUERIES, INV_SLOTS, INV_BLOCKS = 6, 4, 5  # fixed shapes: one compile per (rb, chunk)


@st.composite
def _compacted_tables(draw):
    """Per-query compacted unit tables as ``compact_units`` leaves them: ``count`` distinct
    store blocks first (ascending), zeros after; ``kb`` and ``lim`` anywhere."""
    rb = draw(st.sampled_from([16, 32]))
    n, k = INV_QUERIES, INV_SLOTS
    block, kb, count = np.zeros((n, k), np.int32), np.zeros((n, k), np.int32), []
    for i in range(n):
        blocks = sorted(draw(st.sets(st.integers(0, INV_BLOCKS - 1), max_size=k)))
        count.append(len(blocks))
        block[i, : len(blocks)] = np.asarray(blocks, np.int32)
        kb[i] = draw(st.lists(st.integers(0, 4 * rb), min_size=k, max_size=k))
    lim = np.asarray(draw(st.lists(st.integers(0, 5 * rb), min_size=n, max_size=n)), np.int32)
    return block, kb, np.asarray(count, np.int32), lim, rb, INV_BLOCKS


_invert = jax.jit(invert_selection, static_argnames=("rb", "num_blocks", "chunk"))


@settings(max_examples=30, deadline=None)
@given(tables=_compacted_tables(), chunk=st.integers(1, 3))
def test_invert_selection_matches_brute_force(tables, chunk):
    """Every block's chunks, in order, list exactly its (query, valid rows) pairs with at
    least one valid row, queries ascending; every block has a first and a last chunk;
    chunks past the real ones are empty, unflagged and point at the last block."""
    block, kb, count, lim, rb, num_blocks = tables
    inv = _invert(block, kb, count, lim, rb=rb, num_blocks=num_blocks, chunk=chunk)
    table = np.concatenate([np.asarray(inv.block)[:, None], np.asarray(inv.meta)[:, 0]], axis=1)
    qid, nvalid = np.asarray(inv.qid)[:, 0], np.asarray(inv.nvalid)[:, 0]
    want = {b: [] for b in range(num_blocks)}
    for i in range(len(count)):
        for j in range(count[i]):
            valid = int(np.clip(lim[i] - kb[i, j], 0, rb))
            if valid:
                want[int(block[i, j])].append((i, valid))
    got = {b: [] for b in range(num_blocks)}
    order = []
    for c, (blk, cnt, first, last) in enumerate(table):
        assert 0 <= cnt <= chunk
        if not (first or last or cnt):  # past the real chunks (all of them at the end)
            assert blk == num_blocks - 1 and np.all(table[c:, 1:] == 0)
            break
        if first:
            assert not got[blk] and blk not in order
            order.append(blk)
        assert order[-1] == blk
        got[blk] += list(zip(qid[c, :cnt].tolist(), nvalid[c, :cnt].tolist(), strict=True))
        assert last == (len(got[blk]) == len(want[blk]))
    assert order == list(range(num_blocks)) and got == want


def _flat_grads(kernel="per_query", dtype="bfloat16"):
    fn, knobs = KERNELS[kernel]
    q, kv, idx, pos = sparse_mla_flat_case(
        4, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3, dtype=dtype
    )
    keep = attended_rows_flat(idx, pos, kv_len=64, read_block=16)
    kv = poison_rows(kv, keep, seed=4)
    w_out = jnp.asarray(rng_for(2).standard_normal((*q.shape[:3], DV)), jnp.float32)
    w_lse = jnp.asarray(rng_for(3).standard_normal(q.shape[:3]), jnp.float32)
    grads, _ = run_interpret(
        sparse_mla_loss_grad(
            fn, idx, pos, w_out, w_lse, sm_scale=SM_SCALE, dv=DV, read_block=16,
            interpret=INTERPRET, **knobs,
        ),
        q, kv,
    )  # fmt: skip
    return [np.asarray(g) for g in grads]


@_SLOW
def test_gradients_bitwise_reproducible(monkeypatch):
    """Two runs equal bit for bit although the second one's dKV grid cuts each block's
    pairs into chunks of 2 (several chunks per block: the float32 sums cross program
    boundaries in VMEM scratch; the summation order is the queries' order either way)."""
    first = _flat_grads()
    monkeypatch.setattr(sparse_mla_bwd, "PAIR_CHUNK", 2)
    chunked = _flat_grads()
    for a, b in zip(first, chunked, strict=True):
        assert a.tobytes() == b.tobytes()
    assert np.any(first[1] != 0.0)


# ------------------------------------------------------------- the query-blocked backward


def _nan_gradients(monkeypatch, module, name: str):
    """``module.name`` (a backward) made to return NaN gradients: a test that still
    matches the reference did not take it."""
    real = getattr(module, name)

    def nan(*args, **kw):
        dq, dkv = real(*args, **kw)
        return jnp.full_like(dq, jnp.nan), jnp.full_like(dkv, jnp.nan)

    monkeypatch.setattr(module, name, nan)


@_SLOW  # ~25 s; quick: test_qblock_backward_over_the_paged_cache
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qblock_backward_walks_block_unions(monkeypatch, dtype):
    """The query-blocked op's gradients come from its own kernels (the per-query backward
    returns NaN here): 2 query blocks of 16 (the last one partial), 2 head groups, unions
    of up to 64 slots walked in 2 chunks (``BACKWARD_SHARING`` 1: every union fits), 2
    units a step, every edge of ``sparse_mla_flat_case`` over a poisoned cache."""
    _nan_gradients(monkeypatch, sparse_mla_qblock, "per_query_backward")
    monkeypatch.setattr(sparse_mla_qblock_bwd, "BACKWARD_SHARING", 1)
    q, kv, idx, pos = sparse_mla_flat_case(
        11, dk=DV + ROPE, batch=2, seq=24, heads=4, kv_len=1000, rb=16, top_k=4, dtype=dtype
    )
    keep = attended_rows_flat(idx, pos, kv_len=1000, read_block=16)
    cfg = SparseMlaConfig(units_per_step=2, ring_slots=2)
    compare_sparse_mla_grads(
        tpu.sparse_mla_attention_qblock, q, poison_rows(kv, keep, seed=11), idx, pos, keep,
        kernel_kw=dict(interpret=INTERPRET, config=cfg, query_block=16, head_block=2),
        sm_scale=SM_SCALE, dv=DV, grad_tol=GRAD_TOL[dtype], mass_atol=MASS_ATOL, read_block=16,
    )  # fmt: skip
    unions = np.asarray(block_union_sizes(jnp.asarray(np.where(idx < 63, idx, -1)), query_block=16))
    assert unions.max() > 32  # two chunks


def test_qblock_backward_over_the_paged_cache(monkeypatch):
    """The same through a ragged paged cache read in place (NaN in the unattended rows and
    in the feature padding, which gets exactly 0)."""
    _nan_gradients(monkeypatch, sparse_mla_qblock, "per_query_backward")
    q, cache, idx, pos, keep, tables = dirty_ragged_grad_case(
        5, seq_lens=[37, 5, 20], new_lens=[4, 0, 3], extra_pages=[1, 0, 1], page_size=16,
        heads=2, top_k=3, dk=DV + ROPE, dtype="bfloat16",
    )  # fmt: skip
    _, dcache = _compare("qblock", q, cache, idx, pos, keep, **tables)
    assert np.all(dcache.reshape(keep.size, -1)[:, DV + ROPE :] == 0.0)


def _shared_case(seed: int, *, shared: bool):
    """8 queries at the end of 1024 tokens, 2 heads, 4 units of 16 each: the query's own
    unit and 3 of 5 (a sink, 4 shared: the block's union at most 6 units) or 3 of all 64
    at random; over a poisoned cache."""
    rng = rng_for(seed)
    q, kv, _, _ = sparse_mla_flat_case(
        seed, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=1024, rb=16, top_k=4,
        dtype="float32",
    )  # fmt: skip
    pos = np.arange(1016, 1024, dtype=np.int32)[None]
    pool = np.array([0, 50, 51, 52, 53]) if shared else np.arange(63)
    idx = np.stack([rng.choice(pool, 4, replace=False) for _ in range(8)])[None]
    idx[0, :, 0] = 63  # the queries' own unit
    idx = idx.astype(np.int32)
    keep = attended_rows_flat(idx, pos, kv_len=1024, read_block=16)
    return q, poison_rows(kv, keep, seed=seed), idx, pos, keep


@_SLOW
@pytest.mark.parametrize("shared", [True, False])
def test_qblock_backward_under_automatic_tiling(monkeypatch, shared):
    """Under ``jax.grad`` the automatic tiling (no ``query_block``) decides at run time:
    blocks whose picks repeat take the blocked backward (the per-query one returns NaN
    here); random picks, which share too little, the per-query backward (the blocked one
    returns NaN)."""
    other = "per_query_backward" if shared else "blocked_backward"
    _nan_gradients(monkeypatch, sparse_mla_qblock, other)
    q, kv, idx, pos, keep = _shared_case(21, shared=shared)
    compare_sparse_mla_grads(
        tpu.sparse_mla_attention_qblock, q, kv, idx, pos, keep,
        kernel_kw=dict(interpret=INTERPRET), sm_scale=SM_SCALE, dv=DV,
        grad_tol=GRAD_TOL["float32"], mass_atol=MASS_ATOL, read_block=16,
    )  # fmt: skip


@_SLOW
def test_qblock_backward_falls_back_past_its_slots(monkeypatch):
    """A union wider than the partial buffer takes the per-query backward (the blocked one
    returns NaN here), decided at run time."""
    _nan_gradients(monkeypatch, sparse_mla_qblock, "blocked_backward")
    monkeypatch.setattr(sparse_mla_qblock, "backward_slots", lambda *shape: 0)
    q, kv, idx, pos = sparse_mla_flat_case(
        2, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3, dtype="bfloat16"
    )
    keep = attended_rows_flat(idx, pos, kv_len=64, read_block=16)
    _compare("qblock", q, poison_rows(kv, keep, seed=3), idx, pos, keep, read_block=16)


@_SLOW
def test_qblock_gradients_bitwise_reproducible(monkeypatch):
    """The blocked backward twice, the second time with the sum kernel writing one store
    block a program: equal bit for bit (each store block's partials are added in the same
    order)."""
    first = _flat_grads("qblock")
    monkeypatch.setattr(sparse_mla_qblock_bwd, "SUM_ROWS", 1)
    chunked = _flat_grads("qblock")
    for a, b in zip(first, chunked, strict=True):
        assert a.tobytes() == b.tobytes()
    assert np.any(first[1] != 0.0)


def test_sum_span_divides_the_store():
    """The sum kernel's span: the largest divisor of the store's blocks within its rows."""
    span = sparse_mla_qblock_bwd.sum_span
    assert span(1728, 64) == 8 and span(1728, 16) == 32 and span(126, 16) == 21
    assert span(127, 16) == 1 and span(3, 16) == 3 and span(1, 128) == 1


# The production shape of issue 40: S 4096, 2048 selected tokens per query from a 32K
# flat cache, Dk 576 / Dv 512. The TPU kernels need read_block % 16 == 0, so token-level
# selections (read_block 1) are not theirs: 2048 tokens as 128 units of 16. Slow: the
# quick tier cross-lowers the same kernels in test_grad_cross_lowers_for_tpu.
@_SLOW
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("kernel", ["per_query", "qblock_auto"])
def test_grad_cross_lowers_at_the_production_shape(kernel, heads):
    """Both ops; the query-blocked one with its lax.cond forward and backward pairs (its
    partial buffer and sorted-slot table at this shape: 32K slots at H 128)."""
    fn, knobs, forward, backward = EXPORTED[kernel]
    text = export_sparse_mla_grad(
        fn, "tpu", tokens=4096, heads=heads, cache=32768, top_k=128, sm_scale=0.04,
        read_block=16, **knobs,
    )  # fmt: skip
    assert text.count("tpu_custom_call") == forward + backward


@pytest.mark.slow  # the write-back, forward and both backward kernels interpreted
def test_prefill_wrapper_gradient_reaches_the_query_parts():
    """``prefill_write_and_attend_ragged``: ``ql`` and ``qpe`` get the reference
    wrapper's gradients through the backward kernels (the paged write-back kernel has no
    JVP, so not the new rows)."""
    check_wrapper_query_grads(
        tpu.prefill_write_and_attend_ragged, ref.prefill_write_and_attend_ragged,
        dv=DV, sm_scale=SM_SCALE, tol=GRAD_TOL["bfloat16"], interpret=INTERPRET,
    )  # fmt: skip


@_SLOW
@pytest.mark.parametrize(("page", "heads"), [(16, 64), (64, 128)])
@pytest.mark.parametrize("kernel", ["per_query", "qblock_auto"])
def test_ragged_grad_cross_lowers_at_the_production_shape(kernel, page, heads):
    """``jax.grad`` w.r.t. ``q`` and the paged bf16 cache ``[P, page / 2, 2, 640]`` (32K
    rows) through ``out`` and the LSE: 4096 queries of 3 requests, 2048 selected tokens
    each as ``2048 / page`` pages, through either op (each op's kernels, both branches of
    the query-blocked op's runtime choices); the gradients keep the shapes."""
    sd, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    n, pages, seqs = 4096, 32768 // page, 3
    fn, _, forward, backward = EXPORTED[kernel]

    def f(q, cache, idx, pos, sid, seq_lens, cu_kv, table):
        def loss(q, cache):
            out, lse = fn(
                q, cache, idx, pos, sm_scale=0.04, read_block=page, page_size=page,
                q_seq_id=sid, seq_lens=seq_lens, cu_kv_lens=cu_kv, page_indices=table,
                return_lse=True,
            )  # fmt: skip
            return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jax.grad(loss, argnums=(0, 1))(q, cache)

    avals = (
        sd((1, n, heads, 576), bf16), sd((pages, page // 2, 2, 640), bf16),
        sd((1, n, 2048 // page), i32), sd((1, n), i32), sd((n,), i32), sd((seqs,), i32),
        sd((seqs + 1,), i32), sd((pages,), i32),
    )  # fmt: skip
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*avals)
    assert [a.shape for a in exported.out_avals] == [avals[0].shape, avals[1].shape]
    assert exported.mlir_module().count("tpu_custom_call") == forward + backward


def _fp8_case():
    q, kv, idx, pos = sparse_mla_flat_case(
        6, dk=576, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3, dtype="bfloat16"
    )
    kw = dict(sm_scale=SM_SCALE, kv_lora_rank=512, read_block=16, return_lse=True)
    return q, kv, quantize_latent_cache(jnp.asarray(kv)), idx, pos, kw


def test_kernel_covers_plain_caches_only():
    """``kernel_covers``: float32 / bfloat16 caches run the backward kernels, an
    ``Fp8LatentCache`` (which no TPU forward kernel takes today) the XLA backward."""
    q, kv, fp8, idx, pos, kw = _fp8_case()
    for cache, covered in ((kv, True), (np.asarray(kv, np.float32), True), (fp8, False)):
        assert sparse_mla_bwd.kernel_covers(sparse_mla_call(q, cache, idx, pos, **kw)) is covered


@pytest.mark.slow  # XLA compiles of the FP8 path, ~7 s
def test_caches_the_kernels_do_not_take_fall_back_to_the_xla_vjp():
    """Through ``sparse_mla_result`` with the XLA forward, an ``Fp8LatentCache`` call's
    ``q`` gradient is the XLA backward from the saved forward (``with_xla_backward``,
    bf16 products): the reference's within 2e-2 rel L2, and its cache gradient too."""
    q, _, fp8, idx, pos, kw = _fp8_case()

    def loss(fn, q):
        out, lse = fn(sparse_mla_call(q, fp8, idx, pos, **kw))
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    def through_result(call):
        forward = lambda c: xla_sparse_mla(c, attn_mass=False)[:2]  # noqa: E731
        return sparse_mla_bwd.sparse_mla_result(
            call, forward, interpret=False, config=SparseMlaConfig()
        )

    got = jax.grad(functools.partial(loss, through_result))(jnp.asarray(q))
    want = jax.grad(functools.partial(loss, lambda c: xla_sparse_mla(c)[:2]))(jnp.asarray(q))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2 and np.any(got != 0.0)
