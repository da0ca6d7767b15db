"""Sparse-MLA TPU kernels vs the reference, run in Pallas TPU interpret mode on the CPU.

Interpret mode runs the kernels' DMAs, semaphores and VMEM/SMEM refs on the CPU with the
race detector on, out-of-bounds reads raising and uninitialised memory (including the
output buffers) filled with NaN, so an unwritten output element fails the comparison.
Shapes are small (interpret mode executes every kernel op one by one).
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
    assert_no_races,
    assert_sparse_mla_close,
    attended_rows_flat,
    poison_ragged_case,
    poison_rows,
    randn,
    rng_for,
    sparse_mla_flat_case,
    sparse_mla_ragged_call,
    sparse_mla_ragged_case,
    tpu_interpret,
)

import attn_pallas_tpu.sparse_mla_qblock as sq
import attn_reference as ref
from attn_pallas_tpu import sparse_mla_attention, sparse_mla_attention_qblock
from attn_pallas_tpu._prep import default_chip
from attn_pallas_tpu.config import SparseMlaConfig
from attn_pallas_tpu.plan import (
    MIN_SHARING,
    block_union_sizes,
    choose_plan,
    distinct_units_per_query,
    per_query_seconds,
    qblock_seconds,
    static_qblock_config,
)

INTERPRET = tpu_interpret()
DV, ROPE = 128, 64
DK = DV + ROPE  # 192 -> Dk_pad 256: the feature padding path is exercised
SM_SCALE = 0.07
TOL = {"float32": dict(rtol_l2=2e-5, atol=2e-4), "bfloat16": dict(rtol_l2=2e-2, atol=5e-2)}
LSE_ATOL = {"float32": 1e-4, "bfloat16": 5e-2}


def _check(got, want, dtype):
    assert_sparse_mla_close(got, want, **TOL[dtype], lse_atol=LSE_ATOL[dtype])


# ------------------------------------------------------------------------------------
# Flat mode


def flat_case(seed, *, batch=2, seq=21, heads=2, kv_len=88, rb=16, top_k=4, dtype="float32"):
    """Random flat inputs: -1, duplicate and out-of-range ids, empty queries, tail unit."""
    return sparse_mla_flat_case(
        seed, dk=DK, batch=batch, seq=seq, heads=heads, kv_len=kv_len, rb=rb, top_k=top_k,
        dtype=dtype,
    )  # fmt: skip


def _flat_call(fn, case, *, rb=16, **kw):
    q, kv, idx, pos = case
    return fn(
        q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=rb, return_lse=True, **kw
    )


PER_QUERY = functools.partial(sparse_mla_attention, interpret=INTERPRET)
KERNELS = {
    "per_query": PER_QUERY,
    "qblock_qb8": functools.partial(
        sparse_mla_attention_qblock, query_block=8, interpret=INTERPRET
    ),
    "qblock_qb16_hb1": functools.partial(
        sparse_mla_attention_qblock, query_block=16, head_block=1, interpret=INTERPRET
    ),
}


# The default kernels (per query, query blocks) against the reference: the conformance
# suite (tests/test_conformance_sparse_mla.py). Here the one-head-per-block variant.
@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["qblock_qb16_hb1"])
def test_flat_vs_reference(kernel):
    case = flat_case(1)
    got = _flat_call(KERNELS[kernel], case)
    assert_no_races()
    want = _flat_call(ref.sparse_mla_attention, case)
    assert np.isneginf(np.asarray(want[1])).any()  # the case has empty queries
    _check(got, want, "float32")


@pytest.mark.slow
def test_flat_bf16_heads4_rb32():
    case = flat_case(2, batch=1, seq=13, heads=4, kv_len=128, rb=32, top_k=3, dtype="bfloat16")
    want = _flat_call(ref.sparse_mla_attention, case, rb=32)
    for fn in (PER_QUERY, KERNELS["qblock_qb8"]):
        got = _flat_call(fn, case, rb=32)
        assert_no_races()
        _check(got, want, "bfloat16")


@pytest.mark.slow
def test_flat_out_only():
    case = flat_case(3, batch=1, seq=9)
    q, kv, idx, pos = case
    for fn in (PER_QUERY, KERNELS["qblock_qb8"]):
        out = fn(q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=16)
        want = ref.sparse_mla_attention(
            q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=16
        )
        assert_close(np.asarray(out), np.asarray(want), **TOL["float32"])


# Slow: the quick tier's poisoned caches are in test_sparse_mla_grad_interpret.py, its
# full and partial steps in test_kernels_wait_for_every_copy_they_start.
@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["per_query", "qblock_qb8"])
def test_ring_full_and_partial_steps(kernel):
    """Queries selecting 0-9 distinct units, 4 units a step: full steps and partial ones
    (their dead entries re-copying the step's first unit, masked) interleave in one
    program's ring, and every slot is reused. Every cache row no query attends
    (unselected, or past its query's position) is NaN/Inf."""
    rng = rng_for(11)
    seq, top_k, rb, kv_len = 20, 9, 16, 320  # 20 units
    q = randn(rng, (1, seq, 2, DK), "bfloat16")
    kv = randn(rng, (1, kv_len, DK), "bfloat16")
    pos = rng.integers(kv_len // 2, kv_len, size=(1, seq)).astype(np.int32)
    idx = np.full((1, seq, top_k), -1, np.int32)
    for i in range(seq):
        n = (3 * i) % (top_k + 1)  # 0, 3, 6, 9, 2, 5, 8, 1, 4, 7, ...
        idx[0, i, :n] = rng.choice(kv_len // rb, n, replace=False)
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=rb)
    assert (~keep).any() and keep.any()
    want = _flat_call(ref.sparse_mla_attention, (q, kv, idx, pos))
    dirty = jnp.asarray(poison_rows(kv, keep, seed=11))
    cfg = SparseMlaConfig(units_per_step=4, forward_units_per_step=4, ring_slots=2)
    got = _flat_call(KERNELS[kernel], (q, dirty, idx, pos), config=cfg)
    assert_no_races()
    _check(got, want, "bfloat16")


@pytest.mark.parametrize(
    ("op", "slots"),
    [
        pytest.param("per_query", 2, marks=pytest.mark.slow),
        ("per_query", 3),  # the default ring
        pytest.param("per_query", 5, marks=pytest.mark.slow),
        ("qblock", 2),
        pytest.param("qblock", 4, marks=pytest.mark.slow),
    ],
)
def test_kernels_wait_for_every_copy_they_start(op, slots, capfd):
    """Run with DMAs executed when started, a copy nobody waits for leaves its
    semaphore's count non-zero at kernel exit, which the interpreter reports (the chip
    halts); the default mode runs a DMA only when waited for, so it cannot see one. The
    forward and, through ``jax.vjp``, the backward kernels of each op: the per-query
    forward starts spare copies past its program's last step and drains them, the others
    guard each start. Programs of 4 queries: one without units (no steps), one with a
    single step (fewer than ``S - 1``), one with many."""
    rng = rng_for(5)
    seq, top_k, rb, kv_len = 12, 6, 16, 192
    q = randn(rng, (1, seq, 2, DK), "float32")
    kv = randn(rng, (1, kv_len, DK), "float32")
    pos = np.full((1, seq), kv_len - 1, np.int32)
    idx = np.full((1, seq, top_k), -1, np.int32)
    idx[0, 5, 0] = 3  # program 1: one unit; program 0: none
    for i in range(8, seq):  # program 2: 6 units a query
        idx[0, i] = rng.choice(kv_len // rb, top_k, replace=False)
    cfg = SparseMlaConfig(
        units_per_step=2, ring_slots=slots, queries_per_program=4, query_block=8, u_max=4
    )
    eager = dataclasses.replace(INTERPRET, dma_execution_mode="eager")
    fn = sparse_mla_attention if op == "per_query" else sparse_mla_attention_qblock

    def f(q, kv):
        return fn(
            q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=rb, config=cfg,
            interpret=eager,
        )  # fmt: skip

    @jax.jit  # one compile of forward and backward, not one per eager operation
    def forward_and_grads(q, kv):
        out, vjp = jax.vjp(f, q, kv)
        return out, vjp(jnp.ones_like(out))

    out, _ = jax.block_until_ready(forward_and_grads(q, kv))
    assert "non-zero count" not in capfd.readouterr().out
    want = ref.sparse_mla_attention(
        q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=rb
    )
    assert_close(np.asarray(out), np.asarray(want), **TOL["float32"])


def big_union_case(seed, dtype="float32"):
    """Flat, 100 units of 16 tokens, K = 16 scattered picks: block unions of 8 queries
    reach ~70-90 units, so 32- and 64-slot chunks are walked several times."""
    rng = rng_for(seed)
    kv_len, rb, top_k, seq = 1600, 16, 16, 19
    q = randn(rng, (1, seq, 2, DK), dtype)
    kv = randn(rng, (1, kv_len, DK), dtype)
    pos = rng.integers(kv_len // 2, kv_len, size=(1, seq)).astype(np.int32)
    idx = rng.integers(-1, kv_len // rb, size=(1, seq, top_k)).astype(np.int32)
    idx[0, :, 0] = pos[0] // rb
    idx[0, 4, 1] = idx[0, 4, 2]  # a duplicate
    return q, kv, idx, pos


@pytest.mark.slow
@pytest.mark.parametrize("u_max", [1, 40, None])
def test_qblock_exact_for_any_u_max(u_max):
    """u_max is a chunk width: unions larger than a chunk are streamed, never dropped."""
    case = big_union_case(4)
    unions = np.asarray(block_union_sizes(case[2], query_block=8))
    assert unions.max() > 64  # three 32-slot chunks, two 64-slot chunks
    got = _flat_call(
        sparse_mla_attention_qblock, case, query_block=8, u_max=u_max, interpret=INTERPRET
    )
    assert_no_races()
    want = _flat_call(ref.sparse_mla_attention, case)
    _check(got, want, "float32")


@pytest.mark.slow
@pytest.mark.parametrize("u_max", [None, 300])
def test_qblock_wide_union(u_max):
    """Unions past 256 slots: a chunk's membership words span several aligned 8-word
    windows (slot 256 is in the second), in one chunk or in two; causal limits inside
    the picked units, NaN / Inf in every row no query attends."""
    rng = rng_for(11)
    kv_len, rb, top_k, seq = 6400, 16, 16, 32  # 400 units
    q = randn(rng, (1, seq, 2, DK), "float32")
    kv = randn(rng, (1, kv_len, DK), "float32")
    pos = rng.integers(kv_len // 2, kv_len, size=(1, seq)).astype(np.int32)
    idx = np.stack([rng.permutation(kv_len // rb)[:top_k] for _ in range(seq)])[None]
    idx = idx.astype(np.int32)
    idx[0, :, 0] = pos[0] // rb  # each query's own unit straddles its limit
    idx[0, 3, 5] = -1
    assert np.asarray(block_union_sizes(idx, query_block=32)).max() > 256
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=rb)
    assert (~keep).any() and keep.any()
    dirty = jnp.asarray(poison_rows(kv, keep, seed=11))
    got = _flat_call(
        sparse_mla_attention_qblock, (q, dirty, idx, pos), query_block=32, u_max=u_max,
        interpret=INTERPRET,
    )  # fmt: skip
    assert_no_races()
    _check(got, _flat_call(ref.sparse_mla_attention, (q, kv, idx, pos)), "float32")


# ------------------------------------------------------------------------------------
# Ragged paged mode

SEQ_LENS = [37, 64, 5, 50, 20]
NEW_LENS = [9, 16, 0, 5, 20]
EXTRA_PAGES = [1, 0, 2, 0, 1]
HEADS = 2
TOP_K = 5


def ragged_case(seed, page_size, dtype):
    """Shuffled physical pages, junk in the cache padding, -1/duplicate/out-of-extent ids,
    a query with nothing selected and queries whose kv_len binds."""
    return sparse_mla_ragged_case(
        seed, seq_lens=SEQ_LENS, new_lens=NEW_LENS, extra_pages=EXTRA_PAGES,
        page_size=page_size, heads=HEADS, top_k=TOP_K, dk=DK, dk_pad=256, dtype=dtype,
    )  # fmt: skip


def _ragged_call(fn, case, page_size, **kw):
    return sparse_mla_ragged_call(fn, case, page_size, sm_scale=SM_SCALE, dv=DV, **kw)


# Page size 16 of the default kernels: the conformance suite. Here 32-token pages (with
# 50 queries: 7 query blocks, most straddling requests) and the one-head-per-block variant.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kernel", "page_size", "dtype"),
    [
        ("per_query", 32, "bfloat16"),
        ("qblock_qb8", 32, "bfloat16"),
        ("qblock_qb16_hb1", 16, "float32"),
    ],
)
def test_ragged_vs_reference(kernel, page_size, dtype):
    case = ragged_case(10, page_size, dtype)
    got = _ragged_call(KERNELS[kernel], case, page_size)
    assert_no_races()
    want = _ragged_call(ref.sparse_mla_attention, case, page_size)
    assert np.isneginf(np.asarray(want[1])[0, 3]).all()
    _check(got, want, dtype)


TABLES = ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")


def _ragged_jit(fn, case, page_size, **kw):
    """Run with the ragged tables as traced jit arguments (no host-side check)."""
    layout, cache, q, idx, positions = case
    tables = {k: layout[k] for k in TABLES}

    @jax.jit
    def run(q, cache, idx, positions, tables):
        return _ragged_call(fn, (tables, cache, q, idx, positions), page_size, **kw)

    return run(q, cache, idx, positions, tables)


@pytest.mark.slow
def test_ragged_invalid_physical_page():
    """A page-table entry outside the cache: refused when the tables are host values;
    under jit never read (masked like the reference)."""
    layout, cache, q, idx, positions = ragged_case(11, 16, "float32")
    layout = dict(layout)
    page_indices = layout["page_indices"].copy()
    page_indices[[0, 5]] = [-3, layout["num_pages"] + 4]
    layout["page_indices"] = page_indices
    case = (layout, cache, q, idx, positions)
    for fn in (ref.sparse_mla_attention, PER_QUERY, KERNELS["qblock_qb8"]):
        with pytest.raises(ValueError, match="page_indices: entry 0 is -3"):
            _ragged_call(fn, case, 16)
    want = _ragged_jit(ref.sparse_mla_attention, case, 16)
    for kernel in ("per_query", "qblock_qb8"):
        got = _ragged_jit(KERNELS[kernel], case, 16)
        assert_no_races()
        _check(got, want, "float32")


# Slow: the quick tier runs the ragged query-blocked kernel in
# test_qblock_under_jit_with_traced_tables (and its backward over the paged cache).
@pytest.mark.slow
@pytest.mark.parametrize("u_max", [1, 64])
def test_ragged_qblock_chunked_u_max(u_max):
    case = ragged_case(12, 16, "float32")
    got = _ragged_call(
        sparse_mla_attention_qblock, case, 16, query_block=16, u_max=u_max, interpret=INTERPRET
    )
    assert_no_races()
    want = _ragged_call(ref.sparse_mla_attention, case, 16)
    _check(got, want, "float32")


def test_qblock_under_jit_with_traced_tables():
    """The ragged tables may be traced jit arguments (one compile serves every batch)."""
    case = ragged_case(13, 16, "float32")
    got = _ragged_jit(KERNELS["qblock_qb8"], case, 16)
    want = _ragged_jit(ref.sparse_mla_attention, case, 16)  # one compile, not one per op
    _check(got, want, "float32")


# ------------------------------------------------------------------------------------
# Automatic tiling: host values plan on the true unions, traced values guard at run time

AUTO = functools.partial(sparse_mla_attention_qblock, interpret=INTERPRET)


@pytest.mark.slow
def test_auto_tiling_flat_and_ragged():
    flat = flat_case(21)
    _check(_flat_call(AUTO, flat), _flat_call(ref.sparse_mla_attention, flat), "float32")
    assert_no_races()
    ragged = ragged_case(22, 16, "float32")
    want = _ragged_call(ref.sparse_mla_attention, ragged, 16)
    _check(_ragged_call(AUTO, ragged, 16), want, "float32")
    _check(_ragged_jit(AUTO, ragged, 16), want, "float32")  # lax.cond guard
    assert_no_races()


def _jit_guard_picks_qblock(sel, *, heads, dk_pad, itemsize):
    """The wrapper's run-time condition, recomputed from the public model functions."""
    shape = dict(
        heads=heads, top_k=sel.shape[-1], read_block=16, dk_pad=dk_pad, dv=DV,
        itemsize=itemsize, chip=default_chip(),
    )  # fmt: skip
    qb, hb, u_max = static_qblock_config(num_units=100, **shape)
    qb = min(qb, -(-sel.shape[1] // 8) * 8)  # as the wrapper: no block past the queries
    unions = block_union_sizes(jnp.asarray(sel), query_block=qb)
    distinct = distinct_units_per_query(jnp.asarray(sel))
    fewer_bytes = (heads // hb) * int(unions.sum()) * MIN_SHARING <= int(distinct.sum())
    faster = float(
        qblock_seconds(unions, query_block=qb, head_block=hb, u_max=u_max, num_units=100, **shape)
    ) < float(per_query_seconds(distinct, **shape))
    return fewer_bytes and faster


def _sharing_case(seed):
    """``(q, kv, pos, shared, disjoint)``: 24 queries at the end of 100 units of 16 (H 2);
    ``shared``: every query picks the same 64 units; ``disjoint``: 4 units each, none
    shared (96 in all, -1 padded to 64). Both selections have one dtype."""
    rng = rng_for(seed)
    seq, top_k, units = 24, 64, 100
    q = randn(rng, (1, seq, 2, DK), "float32")
    kv = randn(rng, (1, units * 16, DK), "float32")
    pos = np.full((1, seq), units * 16 - 1, np.int32)
    shared = np.broadcast_to(rng.permutation(units)[:top_k], (1, seq, top_k)).copy()
    disjoint = np.full_like(shared, -1)
    disjoint[0, :, :4] = np.arange(seq * 4).reshape(seq, 4)
    return q, kv, pos, shared, disjoint


@pytest.mark.slow
def test_auto_tiling_under_jit_takes_both_branches():
    """Shared selections -> the query-blocked branch; disjoint ones -> per-query (too
    little sharing). Both must equal the reference."""
    q, kv, pos, shared, disjoint = _sharing_case(23)
    for sel, want_qblock in ((shared, True), (disjoint, False)):
        assert _jit_guard_picks_qblock(sel, heads=2, dk_pad=256, itemsize=4) == want_qblock
        c = (q, kv, sel, pos)
        got = jax.jit(lambda q, kv, i, p: _flat_call(AUTO, (q, kv, i, p)))(*c)
        assert_no_races()
        _check(got, _flat_call(ref.sparse_mla_attention, c), "float32")


def test_jitted_guard_and_tables_share_one_sort():
    """Under jit the automatic op sorts each query block's picks once for the guard's
    union sizes and the tables (three block-wide sorts in all: that one, the tables'
    compaction and the membership's sort back), not a second time for the guard."""
    q, kv, pos, shared, _ = _sharing_case(24)
    jaxpr = jax.make_jaxpr(lambda q, kv, i, p: _flat_call(AUTO, (q, kv, i, p)))(q, kv, shared, pos)
    top_k, widths = shared.shape[-1], []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "sort" and e.invars[0].aval.shape[-1] > top_k:
                widths.append(e.invars[0].aval.shape)
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    assert len(widths) == 3, widths


def test_eager_plan_cache_routes_calls(monkeypatch):
    """The eager front door's routing, kernels stubbed: the first call of a shape runs
    the planned op; later ones the guarded op at the kept tiling (``None`` after a
    per-query plan); an empty call keeps nothing; a new dtype or shape plans again."""
    ran = []
    monkeypatch.setattr(sq, "_jitted_op", lambda pq, st: lambda *a, **k: ran.append(("op", pq)))
    monkeypatch.setattr(
        sq, "_jitted_guarded", lambda st, tiling: lambda *a, **k: ran.append(("kept", tiling))
    )
    monkeypatch.setattr(sq, "_EAGER_PLANS", {})
    rng = rng_for(25)
    seq, units = 64, 400
    q = randn(rng, (1, seq, 2, DK), "float32")
    kv = randn(rng, (1, units * 16, DK), "float32")
    pos = np.full((1, seq), units * 16 - 1, np.int32)
    shared = np.broadcast_to(np.arange(0, 256, 4, dtype=np.int32), (1, seq, 64)).copy()
    random = np.full_like(shared, -1)
    random[0, :, :8] = np.stack([rng.permutation(units)[:8] for _ in range(seq)])
    for sel in (np.full_like(shared, -1), shared, random, shared, shared.astype(np.int64)):
        _flat_call(AUTO, (q, kv, sel, pos))
    (qb, hb, u_max), kept = ran[3][1], ("kept", ran[3][1])
    assert ran == [("op", True), ("op", False), kept, kept, ("op", False)]
    assert qb % 8 == 0 and hb == 2 and u_max >= 16  # 16 shared units
    monkeypatch.setattr(sq, "_EAGER_PLANS", {})
    ran.clear()
    for sel in (random, shared):
        _flat_call(AUTO, (q, kv, sel, pos))
    assert ran == [("op", True), ("kept", None)]  # per-query plan: the shapes' tiling


@pytest.mark.slow  # ~16 s
def test_eager_plan_kept_per_shape(monkeypatch):
    """An eager call plans on the host once per shape: later calls of the shape reuse the
    tiling behind the run-time guard, stay exact (unattended rows poisoned) when their
    selections no longer share, and a warm-up call with no selection plans nothing for
    them."""
    q, kv, pos, shared, disjoint = _sharing_case(24)
    plans = []
    monkeypatch.setattr(sq, "choose_plan", lambda **kw: plans.append(1) or choose_plan(**kw))
    monkeypatch.setattr(sq, "_EAGER_PLANS", {})
    for sel, planned in ((np.full_like(shared, -1), 1), (shared, 2), (disjoint, 2), (shared, 2)):
        want = _flat_call(ref.sparse_mla_attention, (q, kv, sel, pos))
        keep = attended_rows_flat(sel, pos, kv_len=kv.shape[1], read_block=16)
        dirty = poison_rows(kv, keep, seed=planned)  # rows no query attends: NaN / Inf
        _check(_flat_call(AUTO, (q, dirty, sel, pos)), want, "float32")
        assert_no_races()
        assert len(plans) == planned  # the empty call's plan is not kept
    ((_, tiling),) = sq._EAGER_PLANS.items()
    assert tiling is not None and tiling[0] % 8 == 0  # the shared picks' query-blocked plan
    _flat_call(AUTO, (q[:, :16], kv, shared[:, :16], pos[:, :16]))  # another shape: plans
    assert len(plans) == 3 and len(sq._EAGER_PLANS) == 2


# ------------------------------------------------------------------------------------
# Dirty caches: outputs depend only on the rows a query attends


def _check_every_kernel(run, want, dtype):
    """``run(fn)`` for every kernel, the automatic query-blocked one and the reference,
    each against ``want``; a failure names the kernel."""
    fns = {**KERNELS, "qblock_auto": AUTO, "reference": ref.sparse_mla_attention}
    for name, fn in fns.items():
        got = run(fn)
        assert_no_races()
        try:
            _check(got, want, dtype)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flat_poisoned_unattended_rows(dtype):
    q, kv, idx, pos = flat_case(30, dtype=dtype)
    want = _flat_call(ref.sparse_mla_attention, (q, kv, idx, pos))
    keep = attended_rows_flat(idx, pos, kv_len=kv.shape[1], read_block=16)
    assert (~keep).any() and keep.any()
    dirty = poison_rows(kv, keep, seed=30)
    _check_every_kernel(lambda fn: _flat_call(fn, (q, dirty, idx, pos)), want, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ragged_poisoned_unattended_rows(dtype):
    """NaN / +-Inf in page tails past seq_len, unreferenced pages, unselected pages and in
    the feature padding of every row."""
    case = ragged_case(31, 16, dtype)
    want = _ragged_call(ref.sparse_mla_attention, case, 16)
    dirty = poison_ragged_case(case, 16, dk=DK, seed=31)
    _check_every_kernel(lambda fn: _ragged_call(fn, dirty, 16), want, dtype)


@pytest.mark.slow
def test_qblock_row_attended_by_one_query_only():
    """A NaN row that one query attends: that query is NaN (as in the reference); the
    other queries of its block, which share the fetched unit, are untouched."""
    q, kv, idx, pos = flat_case(32, batch=1, seq=8)
    idx = np.broadcast_to(idx[:, :1], idx.shape).copy()  # every query selects one unit...
    pos[0, :] = 40  # ...of kv_len 88: unit (40 // 16) = 2, rows 32..47
    idx[0, :, 0] = 2
    pos[0, 3] = 47  # query 3 alone sees row 47
    want = _flat_call(ref.sparse_mla_attention, (q, kv, idx, pos))
    dirty = kv.copy()
    dirty[0, 47] = np.nan
    got_ref = _flat_call(ref.sparse_mla_attention, (q, dirty, idx, pos))
    for fn in (KERNELS["qblock_qb8"], PER_QUERY):
        got = _flat_call(fn, (q, dirty, idx, pos))
        assert_no_races()
        out = np.asarray(got[0])
        assert np.isnan(out[0, 3]).all() and np.isnan(np.asarray(got_ref[0])[0, 3]).all()
        others = [i for i in range(8) if i != 3]
        assert_close(out[:, others], np.asarray(want[0])[:, others], **TOL["float32"])


# ------------------------------------------------------------------------------------
# Empty work


@pytest.mark.parametrize(
    ("seq", "top_k", "kv_len"), [(0, 3, 32), (5, 0, 32), (5, 3, 0)], ids=["S0", "K0", "T0"]
)
def test_empty_work(seq, top_k, kv_len):
    rng = rng_for(40)
    q = randn(rng, (2, seq, 2, DK))
    kv = randn(rng, (2, kv_len, DK))
    idx = np.zeros((2, seq, top_k), np.int32)
    pos = np.zeros((2, seq), np.int32)
    for fn in (*KERNELS.values(), AUTO, ref.sparse_mla_attention):
        out, lse = _flat_call(fn, (q, kv, idx, pos))
        assert out.shape == (2, seq, 2, DV) and lse.shape == (2, seq, 2)
        assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
