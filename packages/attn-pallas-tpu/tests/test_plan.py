"""The sparse-MLA kernel plan: union/distinct counts vs brute force, plan invariants."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tier_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attn_pallas_tpu.plan as plan_module
from attn_common import SparseMlaProblem
from attn_common.tables import build_block_unit_tables, lossless_u_max
from attn_pallas_tpu._prep import host_unit_keys, unit_space
from attn_pallas_tpu.config import SparseMlaConfig, default_config, qblock_vmem_bytes
from attn_pallas_tpu.plan import (
    AUTO_QUERY_BLOCKS,
    TPU_CHIPS,
    PlanShape,
    SparseMlaPlan,
    TpuChip,
    block_union_sizes,
    chip_for_device_kind,
    choose_plan,
    distinct_units_per_query,
    host_distinct_units,
    host_union_sizes,
    per_query_seconds,
    predict_per_query,
    predict_qblock,
    qblock_seconds,
    static_qblock_config,
)

_unions_jit = jax.jit(block_union_sizes, static_argnames=("query_block",))
_distinct_jit = jax.jit(distinct_units_per_query)
_tables_jit = jax.jit(build_block_unit_tables, static_argnames=("query_block", "u_max"))

SHAPE = dict(dk_pad=640, dv=512, itemsize=2)
QUERY_BLOCKS = (8, 16, 32)


def unions_brute(keys: np.ndarray, query_block: int) -> np.ndarray:
    batch, seq, _ = keys.shape
    n_blocks = -(-seq // query_block)
    out = np.zeros((batch, n_blocks), np.int64)
    for b in range(batch):
        for n in range(n_blocks):
            rows = keys[b, n * query_block : (n + 1) * query_block]
            out[b, n] = len({int(x) for x in rows.ravel() if x >= 0})
    return out


def distinct_brute(keys: np.ndarray) -> np.ndarray:
    return np.array([[len({int(x) for x in r if x >= 0}) for r in row] for row in keys])


@st.composite
def key_arrays(draw, max_units: int = 20):
    # Few distinct shapes (each new shape compiles); S not a multiple of the blocks.
    batch = draw(st.integers(1, 2))
    seq = draw(st.sampled_from([1, 7, 13, 40]))
    top_k = draw(st.sampled_from([1, 3, 6]))
    num_units = draw(st.integers(1, max_units))
    flat = draw(
        st.lists(
            st.integers(-2, num_units - 1),
            min_size=batch * seq * top_k,
            max_size=batch * seq * top_k,
        )
    )
    keys = np.array(flat, np.int32).reshape(batch, seq, top_k)
    if top_k > 1 and draw(st.booleans()):  # force duplicates inside queries
        keys[..., 1] = keys[..., 0]
    return keys, num_units


# --------------------------------------------------------------------------------------
# block_union_sizes / distinct_units_per_query


@pytest.mark.slow  # ~5 s on 2 cores; test_block_union_sizes_eager_example stays quick
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key_arrays(), st.sampled_from([1, 3, 4, 8, 16]))
def test_block_union_sizes_match_tables_and_brute_force(p, query_block):
    keys, num_units = p
    got = np.asarray(_unions_jit(jnp.asarray(keys), query_block=query_block))
    batch, seq, top_k = keys.shape
    assert got.shape == (batch, -(-seq // query_block)) and got.dtype == np.int32
    np.testing.assert_array_equal(got, unions_brute(keys, query_block))
    u_max = lossless_u_max(query_block, top_k, num_units)
    for b in range(batch):
        tables = _tables_jit(jnp.asarray(keys[b]), query_block=query_block, u_max=u_max)
        np.testing.assert_array_equal(got[b], np.asarray(tables.counts))


@st.composite
def host_key_arrays(draw):
    """Keys as the eager planner counts them, and worse: ``-1`` and other negative ids,
    duplicates inside a query, queries repeating their neighbour's keys, ids far past
    the rest (a wide presence table), ``S`` not a multiple of the blocks."""
    batch = draw(st.integers(1, 2))
    seq = draw(st.sampled_from([1, 13, 40, 130]))
    top_k = draw(st.sampled_from([1, 5, 32]))
    high = draw(st.sampled_from([1, 20, 3000]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    keys = rng.integers(-3, high, (batch, seq, top_k)).astype(np.int32)
    if top_k > 1 and draw(st.booleans()):
        keys[..., 1] = keys[..., 0]
    if seq > 1 and draw(st.booleans()):
        keys[:, 1:] = keys[:, :-1].copy()
    return keys


# Slow (~9 s, a compile per drawn shape): the quick tier compares the same counts at the
# benchmark shapes (test_host_counts_at_the_benchmark_shapes) and at the edges.
@pytest.mark.slow
@settings(
    max_examples=tier_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(host_key_arrays(), st.sampled_from([AUTO_QUERY_BLOCKS, (8,), (16, 48), (8, 24, 40)]))
def test_host_counts_match_the_jit_definitions(keys, query_blocks):
    """The eager front door's numpy counts equal the jnp definitions under jit: unions of
    every query block at once (the presence table) and distinct units per query."""
    got = host_union_sizes(keys, query_blocks)
    assert sorted(got) == sorted(query_blocks)
    for qb in query_blocks:
        want = np.asarray(_unions_jit(jnp.asarray(keys), query_block=qb))
        np.testing.assert_array_equal(got[qb], want, strict=True)
    want = np.asarray(_distinct_jit(jnp.asarray(keys)))
    np.testing.assert_array_equal(host_distinct_units(keys), want, strict=True)


def test_host_union_sizes_in_slices(monkeypatch):
    """A presence table over the byte budget is built one slice of queries at a time,
    with the same counts."""
    keys = np.random.default_rng(0).integers(-1, 500, (2, 700, 6)).astype(np.int32)
    whole = host_union_sizes(keys, AUTO_QUERY_BLOCKS)
    monkeypatch.setattr(plan_module, "_TABLE_BYTES", 1)  # one slice per 256 queries
    sliced = host_union_sizes(keys, AUTO_QUERY_BLOCKS)
    for qb in AUTO_QUERY_BLOCKS:
        np.testing.assert_array_equal(sliced[qb], whole[qb], strict=True)
    np.testing.assert_array_equal(whole[8], unions_brute(keys, 8))


def test_host_counts_edge_shapes():
    empty = np.zeros((1, 0, 4), np.int32)
    assert host_union_sizes(empty, (8, 16))[16].shape == (1, 0)
    assert host_distinct_units(empty).shape == (1, 0)
    no_picks = np.zeros((2, 5, 0), np.int32)
    np.testing.assert_array_equal(host_union_sizes(no_picks, (8,))[8], [[0], [0]])
    np.testing.assert_array_equal(host_distinct_units(no_picks), np.zeros((2, 5)))
    with pytest.raises(ValueError, match="multiples of 16"):
        host_union_sizes(empty, (16, 24))


@pytest.mark.parametrize("picks", ["random", "overlapping"])
def test_host_counts_at_the_benchmark_shapes(picks):
    """bench_sparse_mla's prefill selections: the counts the eager plan is made of."""
    keys = _bench_keys(picks)
    got = host_union_sizes(keys, AUTO_QUERY_BLOCKS)
    for qb in AUTO_QUERY_BLOCKS:
        want = np.asarray(_unions_jit(jnp.asarray(keys), query_block=qb))
        np.testing.assert_array_equal(got[qb], want, strict=True)
    want = np.asarray(_distinct_jit(jnp.asarray(keys)))
    np.testing.assert_array_equal(host_distinct_units(keys), want, strict=True)


def _bench_keys(picks: str) -> np.ndarray:
    """``[1, S, 32]`` unit ids of bench_sparse_mla's prefill cases: 1024 queries at the
    end of a 32K cache (random) or 2048 at the end of 110,592 tokens (overlapping)."""
    from attn_common.picks import overlapping_picks, random_picks

    queries, kv_len = (1024, 32768) if picks == "random" else (2048, 110592)
    pick = random_picks if picks == "random" else overlapping_picks
    pos = np.arange(kv_len - queries, kv_len)
    return pick(np.random.default_rng(0), pos, unit=64, k=32)[None]


# --------------------------------------------------------------------------------------
# host_unit_keys: the eager plan's keys, numpy on host values


@functools.partial(jax.jit, static_argnames=("problem", "page_size"))
def _readable_keys_jit(problem, page_size, kv, indices, tables):
    """The definition: ``unit_space``'s keys where the unit is readable, else -1."""
    positions = jnp.zeros(indices.shape[:2], jnp.int32)
    space = unit_space(problem, kv, indices, positions, page_size=page_size, **tables)
    return jnp.where(space.unit_ok, space.keys, -1)


def _problem(batch, seq, top_k, *, ragged, num_units, kv_len):
    return SparseMlaProblem(
        batch=batch, num_queries=seq, heads=1, dk=64, dv=64, top_k=top_k, read_block=16,
        sm_scale=1.0, ragged=ragged, num_units=num_units, kv_len=kv_len,
    )  # fmt: skip


@settings(
    max_examples=tier_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.data())
def test_host_unit_keys_flat_match_unit_space(data):
    batch, seq = data.draw(st.integers(1, 2)), data.draw(st.sampled_from([1, 9]))
    top_k, kv_len = data.draw(st.sampled_from([1, 4])), data.draw(st.sampled_from([16, 88]))
    num_units = -(-kv_len // 16)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    dtype = data.draw(st.sampled_from([np.int32, np.int64]))
    low = data.draw(st.sampled_from([-1, -3]))  # -1 and in range: returned as given
    idx = rng.integers(low, num_units + data.draw(st.sampled_from([0, 3])), (batch, seq, top_k))
    idx = idx.astype(dtype)
    problem = _problem(batch, seq, top_k, ragged=False, num_units=num_units, kv_len=kv_len)
    kv = np.zeros((batch, kv_len, 64), np.float32)
    none = dict(page_size=None, q_seq_id=None, seq_lens=None, cu_kv_lens=None, page_indices=None)
    got = host_unit_keys(problem, kv, idx, **none)
    tables = {k: v for k, v in none.items() if k != "page_size"}
    want = np.asarray(_readable_keys_jit(problem, None, kv, jnp.asarray(idx), tables))
    np.testing.assert_array_equal(got, want, strict=True)


@settings(
    max_examples=tier_examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.data())
def test_host_unit_keys_ragged_match_unit_space(data):
    """Request-local pages lifted to page-table slots; ids past the request's extent,
    negative ids, out-of-range request ids (clipped) and page-table entries outside the
    cache all read as -1, as in ``unit_space``."""
    ps = 16
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    n_seq = data.draw(st.integers(1, 3))
    extents = rng.integers(0, 4, n_seq)
    cu = np.concatenate([[0], np.cumsum(extents)]).astype(np.int32) * ps
    total_pages = int(extents.sum()) + data.draw(st.integers(1, 2))  # spare slots
    num_pages = data.draw(st.sampled_from([2, 8]))
    seq, top_k = data.draw(st.sampled_from([1, 7])), data.draw(st.sampled_from([1, 3]))
    tables = dict(
        q_seq_id=rng.integers(-1, n_seq + 1, seq).astype(np.int32),
        seq_lens=(extents * ps).astype(np.int32),
        cu_kv_lens=cu,
        page_indices=rng.integers(-2, num_pages + 2, total_pages).astype(np.int32),
    )
    idx = rng.integers(-2, 6, (1, seq, top_k)).astype(np.int32)
    problem = _problem(1, seq, top_k, ragged=True, num_units=total_pages, kv_len=num_pages * ps)
    kv = np.zeros((num_pages, ps, 1, 128), np.float32)
    got = host_unit_keys(problem, kv, idx, page_size=ps, **tables)
    want = np.asarray(_readable_keys_jit(problem, ps, kv, jnp.asarray(idx), tables))
    np.testing.assert_array_equal(got, want, strict=True)


def test_block_union_sizes_eager_example():
    keys = np.array([[[3, 3, -1], [7, 1, 3], [-1, -1, -1], [9, 9, 9], [2, 0, 5]]], np.int32)
    np.testing.assert_array_equal(np.asarray(block_union_sizes(keys, query_block=4)), [[4, 3]])
    np.testing.assert_array_equal(np.asarray(distinct_units_per_query(keys)), [[1, 3, 0, 1, 3]])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key_arrays())
def test_distinct_units_per_query_matches_brute_force(p):
    keys, _ = p
    got = np.asarray(_distinct_jit(jnp.asarray(keys)))
    assert got.shape == keys.shape[:2] and got.dtype == np.int32
    np.testing.assert_array_equal(got, distinct_brute(keys))


# --------------------------------------------------------------------------------------
# choose_plan


def plan_inputs(keys: np.ndarray, query_blocks=QUERY_BLOCKS):
    return distinct_brute(keys), {qb: unions_brute(keys, qb) for qb in query_blocks}


def vmem(rows, query_block, u_max, read_block, row_bytes=1280, dequantize=False) -> int:
    cfg = SparseMlaConfig(query_block=query_block, u_max=u_max)
    return qblock_vmem_bytes(
        cfg, rows=rows, read_block=read_block, row_bytes=row_bytes, dequantize=dequantize,
        **SHAPE,
    )  # fmt: skip


def plan_vmem(plan: SparseMlaPlan, read_block: int) -> int:
    return vmem(plan.head_block * plan.query_block, plan.query_block, plan.u_max, read_block)


def check_plan(plan: SparseMlaPlan, keys, heads, read_block, num_units, chip: TpuChip):
    distinct, unions = plan_inputs(keys)
    top_k = keys.shape[-1]
    unit_bytes = read_block * SHAPE["dk_pad"] * SHAPE["itemsize"]
    shape = PlanShape(
        heads=heads, read_block=read_block, top_k=top_k, num_units=num_units, chip=chip, **SHAPE
    )
    per_query = predict_per_query(distinct_per_query=distinct, **vars(shape))
    assert per_query.kv_bytes == distinct.sum() * unit_bytes
    assert per_query.dma_count == distinct.sum()
    assert plan.chip == chip.name
    if plan.kernel == "per_query":
        assert plan == per_query
        return
    assert plan.kernel == "qblock"
    assert plan.kv_bytes < per_query.kv_bytes  # never a byte loser
    assert plan.predicted_s < per_query.predicted_s
    assert plan.query_block in unions and heads % plan.head_block == 0
    assert plan.head_block * plan.query_block <= 4096
    assert plan.u_max % 32 == 0
    groups = heads // plan.head_block
    assert plan.dma_count == groups * unions[plan.query_block].sum()
    assert plan.kv_bytes == plan.dma_count * unit_bytes
    assert plan_vmem(plan, read_block) <= chip.vmem_bytes
    config = dict(query_block=plan.query_block, head_block=plan.head_block, u_max=plan.u_max)
    again = predict_qblock(union_sizes=unions[plan.query_block], **config, **vars(shape))
    assert again == plan


@st.composite
def plan_problems(draw):
    seq = draw(st.integers(1, 70))
    top_k = draw(st.integers(1, 8))
    num_units = draw(st.integers(top_k, 200))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    share = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))  # fraction of a block-shared pool
    pool = rng.integers(0, num_units, size=top_k)
    keys = rng.integers(-1, num_units, size=(1, seq, top_k))
    keys = np.where(rng.random(keys.shape) < share, pool, keys).astype(np.int32)
    heads = draw(st.sampled_from([1, 2, 16, 128]))
    read_block = draw(st.sampled_from([16, 64, 128]))
    chip = TPU_CHIPS[draw(st.sampled_from(sorted(TPU_CHIPS)))]
    return keys, num_units, heads, read_block, chip


def _choose(keys, heads, read_block, num_units, chip, query_blocks=QUERY_BLOCKS):
    distinct, unions = plan_inputs(keys, query_blocks)
    return choose_plan(
        distinct_per_query=distinct,
        union_sizes=unions,
        heads=heads,
        read_block=read_block,
        top_k=keys.shape[-1],
        num_units=num_units,
        chip=chip,
        **SHAPE,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_problems())
def test_choose_plan_never_picks_a_byte_loser(p):
    keys, num_units, heads, read_block, chip = p
    plan = _choose(keys, heads, read_block, num_units, chip)
    check_plan(plan, keys, heads, read_block, num_units, chip)


@pytest.mark.parametrize("chip", sorted(TPU_CHIPS))
@pytest.mark.parametrize("heads", [16, 128])
def test_disjoint_selections_use_per_query(chip, heads):
    seq, top_k = 64, 8
    keys = np.arange(seq * top_k, dtype=np.int32).reshape(1, seq, top_k)
    plan = _choose(keys, heads, 64, seq * top_k, TPU_CHIPS[chip])
    assert plan.kernel == "per_query"
    assert (plan.query_block, plan.head_block, plan.u_max) == (None, None, None)


@pytest.mark.parametrize("chip", sorted(TPU_CHIPS))
@pytest.mark.parametrize("heads", [16, 128])
def test_identical_selections_use_qblock(chip, heads):
    seq, top_k = 256, 32
    keys = np.broadcast_to(np.arange(top_k, dtype=np.int32) * 3, (1, seq, top_k)).copy()
    plan = _choose(keys, heads, 64, 100, TPU_CHIPS[chip])
    assert plan.kernel == "qblock"
    check_plan(plan, keys, heads, 64, 100, TPU_CHIPS[chip])
    assert plan.kv_bytes * 8 <= seq * top_k * 64 * 640 * 2


def test_empty_inputs_use_per_query():
    chip = TPU_CHIPS["v6e"]
    for keys in (np.zeros((1, 0, 4), np.int32), np.full((1, 16, 4), -1, np.int32)):
        distinct, unions = plan_inputs(keys, (8,))
        plan = choose_plan(
            distinct_per_query=distinct,
            union_sizes=unions,
            heads=16,
            read_block=64,
            top_k=4,
            num_units=10,
            chip=chip,
            **SHAPE,
        )
        assert plan.kernel == "per_query" and plan.kv_bytes == 0 and plan.dma_count == 0
    plan = choose_plan(
        distinct_per_query=np.array([3, 3]),
        union_sizes={},
        heads=16,
        read_block=64,
        top_k=4,
        num_units=10,
        chip=chip,
        **SHAPE,
    )
    assert plan.kernel == "per_query"


@pytest.mark.parametrize("chip", sorted(TPU_CHIPS))
def test_chosen_config_fits_vmem_at_production_shape(chip):
    """1024 heavily shared queries, H = 128, unit 128: every query-blocked config the plan
    compares fits the chip's VMEM (the fitted model prefers per-query there: at H 128
    the masked scores of a 4096-row program cost more than the bytes they save)."""
    chip = TPU_CHIPS[chip]
    rng = np.random.default_rng(0)
    seq, top_k, num_units = 1024, 16, 860
    pool = rng.choice(num_units, size=top_k, replace=False)
    keys = np.where(rng.random((1, seq, top_k)) < 0.95, pool, rng.integers(0, num_units, top_k))
    keys = keys.astype(np.int32)
    distinct = np.asarray(_distinct_jit(keys))
    unions = {qb: np.asarray(_unions_jit(keys, query_block=qb)) for qb in (8, 32, 256)}
    plan = choose_plan(
        distinct_per_query=distinct,
        union_sizes=unions,
        heads=128,
        read_block=128,
        top_k=top_k,
        num_units=num_units,
        chip=chip,
        **SHAPE,
    )
    for qb, u in unions.items():
        hb = min(128, 4096 // qb)
        shape = dict(heads=128, read_block=128, top_k=top_k, num_units=num_units, chip=chip)
        forced = choose_plan(
            distinct_per_query=distinct * 100, union_sizes={qb: u}, **shape, **SHAPE
        )  # per-query priced 100x: the best fitting query-blocked config wins
        assert forced.kernel == "qblock" and forced.head_block <= hb
        assert plan_vmem(forced, 128) <= chip.vmem_bytes
    assert plan.kernel == "per_query" or plan_vmem(plan, 128) <= chip.vmem_bytes


@pytest.mark.parametrize("chip", sorted(TPU_CHIPS))
def test_jnp_seconds_match_numpy_model_under_jit(chip):
    chip = TPU_CHIPS[chip]
    rng = np.random.default_rng(1)
    keys = rng.integers(-1, 300, size=(2, 100, 16)).astype(np.int32)
    keys[:, 1::2] = keys[:, ::2]  # some sharing
    args = dict(heads=128, read_block=64, top_k=16, chip=chip, **SHAPE)
    distinct = _distinct_jit(keys)
    want = predict_per_query(distinct_per_query=np.asarray(distinct), **args).predicted_s
    got = jax.jit(lambda d: per_query_seconds(d, **args))(distinct)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    for qb, hb, u_max in [(8, 128, 64), (32, 16, 96), (16, 32, 1000)]:
        unions = _unions_jit(keys, query_block=qb)
        cfg = dict(query_block=qb, head_block=hb, u_max=u_max, num_units=300, **args)
        want = predict_qblock(union_sizes=np.asarray(unions), **cfg).predicted_s
        got = jax.jit(lambda u, cfg=cfg: qblock_seconds(u, **cfg))(unions)
        np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_qblock_vmem_bytes_formula():
    rows, qb, rb = 4096, 32, 64
    cfg = SparseMlaConfig(query_block=qb, u_max=1000)  # u_max 1000 -> a 1024-slot chunk
    gr = cfg.units_per_step * rb
    # the membership: 1024 slots = 32 int32 words a query (8-row aligned)
    blocks = rows * 640 * 2 + rows * 512 * 4 + rows * 4 + 32 * qb * 4 + qb * 4
    ring = cfg.ring_slots * gr * 1280
    expected = 2 * blocks + ring + 5 * gr * rows * 4 + 2 * rows * 512 * 4 + 2 * rows * 4
    assert vmem(rows, qb, 1000, rb) == expected


def test_fp8_rows_cost_768_bytes_per_token():
    """An FP8 cache (``row_bytes = 768``): KV bytes 0.6x the bf16 rows' 1,280, the ring
    counted at 768 bytes per row plus the step's dequantized temporaries, and the
    dequantization's VPU ops in the per-unit time (never faster per byte moved here)."""
    rows, qb, rb = 4096, 32, 64
    cfg = SparseMlaConfig()
    gr = cfg.units_per_step * rb
    bf16 = vmem(rows, qb, 1000, rb)
    got = vmem(rows, qb, 1000, rb, row_bytes=768, dequantize=True)
    assert got == bf16 - cfg.ring_slots * gr * (1280 - 768) + gr * 640 * (4 + 2)
    fp8 = dict(SHAPE, row_bytes=768)
    distinct = np.array([32, 7, 0, 32])
    args = dict(heads=16, read_block=rb, top_k=32, chip=TPU_CHIPS["v5e"])
    p16 = predict_per_query(distinct_per_query=distinct, **args, **SHAPE)
    p8 = predict_per_query(distinct_per_query=distinct, **args, **fp8)
    assert p16.kv_bytes == distinct.sum() * rb * 1280 and p8.kv_bytes == p16.kv_bytes * 0.6
    assert p8.dma_count == p16.dma_count and p8.predicted_s >= p16.predicted_s
    assert PlanShape(**args, **fp8).fp8 and not PlanShape(**args, **SHAPE).fp8


@pytest.mark.parametrize("chip", sorted(TPU_CHIPS))
@pytest.mark.parametrize("heads", [1, 16, 64, 128, 1024])
@pytest.mark.parametrize("read_block, top_k", [(64, 32), (128, 16)])
def test_static_qblock_config(chip, heads, read_block, top_k):
    chip = TPU_CHIPS[chip]
    num_units = 1720
    qb, hb, u_max = static_qblock_config(
        heads=heads,
        top_k=top_k,
        num_units=num_units,
        read_block=read_block,
        chip=chip,
        **SHAPE,
    )
    assert qb % 8 == 0 and 8 <= qb <= 128 and heads % hb == 0 and hb * qb <= 4096
    assert u_max % 32 == 0 and 32 <= u_max <= 1024
    assert u_max <= -(-lossless_u_max(qb, top_k, num_units) // 32) * 32
    assert vmem(hb * qb, qb, u_max, read_block) <= chip.vmem_bytes
    if heads * 8 <= 4096:
        assert hb == heads  # one head group: the union is fetched once
    if heads == 16 and chip.name != "v5p":
        assert (qb, hb, u_max) == (128, 16, 1024)  # 2048 score rows
    if heads == 128 and read_block == 64:
        assert (qb, hb, u_max) == (16, 128, 512)


def test_static_qblock_config_tiny_vmem_falls_back_to_head_groups():
    tiny = TpuChip("tiny", 1e12, 1e14, 128, 1e12, 1, 6 << 20, 1 << 16)
    qb, hb, _ = static_qblock_config(
        heads=128, top_k=16, num_units=500, read_block=128, chip=tiny, **SHAPE
    )
    assert qb == 8 and hb < 128 and 128 % hb == 0
    nothing = TpuChip("nothing", 1e12, 1e14, 128, 1e12, 1, 1 << 10, 1 << 16)
    with pytest.raises(ValueError, match="fits"):
        static_qblock_config(
            heads=16, top_k=16, num_units=500, read_block=128, chip=nothing, **SHAPE
        )


@pytest.mark.parametrize(
    "kind, name",
    [
        ("TPU v5 lite", "v5e"),
        ("TPU v5e", "v5e"),
        ("TPU v5litepod", "v5e"),
        ("TPU v5p", "v5p"),
        ("TPU v5", "v5p"),
        ("TPU v6 lite", "v6e"),
        ("TPU v6e", "v6e"),
        ("tpu V6E", "v6e"),
    ],
)
def test_chip_for_device_kind(kind, name):
    assert chip_for_device_kind(kind) is TPU_CHIPS[name]


@pytest.mark.parametrize("kind", [None, "", "TPU v4", "TPU7x", "cpu", "NVIDIA H200"])
def test_chip_for_unknown_kind_is_smallest_vmem(kind):
    chip = chip_for_device_kind(kind)
    assert chip.vmem_bytes == min(c.vmem_bytes for c in TPU_CHIPS.values())


def test_chip_table():
    assert set(TPU_CHIPS) == {"v5e", "v5p", "v6e"}
    v5e = TPU_CHIPS["v5e"]
    assert (v5e.hbm_bytes_per_s, v5e.mxu_flops, v5e.mxu_dim, v5e.cores) == (819e9, 197e12, 128, 1)
    for chip in TPU_CHIPS.values():
        assert 0 < chip.vmem_bytes <= 96 << 20 and chip.smem_words > 0


def test_sparse_mla_union_sizes_from_op_arguments():
    """Flat: unit ids over T; ragged: request-local pages lifted to page-table slots (a
    block straddling two requests counts their pages apart)."""
    from attn_pallas_tpu.plan import sparse_mla_union_sizes

    idx = np.array([[[0, 1, -1], [1, 2, 9]], [[3, 3, 3], [-1, -1, -1]]], np.int32)
    got = np.asarray(sparse_mla_union_sizes(idx, query_block=2, read_block=16, kv_len=64))
    np.testing.assert_array_equal(got, [[3], [1]])  # id 9 is past T = 64 (4 units)

    # Two requests with 2 and 3 page-table slots; both queries select local pages {0, 1}.
    ragged = dict(
        q_seq_id=np.array([0, 1], np.int32),
        seq_lens=np.array([32, 48], np.int32),
        cu_kv_lens=np.array([0, 32, 80], np.int32),
        page_indices=np.arange(5, dtype=np.int32),
        page_size=16,
    )
    sel = np.array([[[0, 1], [1, 0]]], np.int32)
    got = np.asarray(sparse_mla_union_sizes(sel, query_block=2, read_block=16, **ragged))
    np.testing.assert_array_equal(got, [[4]])
    with pytest.raises(ValueError, match="kv_len"):
        sparse_mla_union_sizes(idx, query_block=2, read_block=16)


# The v5e sweep (docs/results/tpu_sparse_mla_sweep.json): per cell the kernel that ran
# faster by a clear margin (>= 15 %) at the default tiling of each: 1024 queries at
# the end of a 32K flat cache, 2048 random tokens (units of 64); 2048 queries at the
# end of 110,592 tokens, 32 overlapping units of 64 (attn_common.picks).
V5E_FASTER = {("random", 16): "per_query", ("random", 64): "per_query",
              ("overlapping", 4): "qblock", ("overlapping", 16): "qblock"}  # fmt: skip


@pytest.mark.parametrize(("picks", "heads"), sorted(V5E_FASTER))
def test_plan_picks_the_kernel_the_v5e_ran_faster(picks, heads):
    keys = _bench_keys(picks)
    queries, kv_len = keys.shape[1], 32768 if picks == "random" else 110592
    cfg = default_config(read_block=64, top_k=32, num_queries=queries, heads=heads)
    plan = choose_plan(
        distinct_per_query=host_distinct_units(keys),
        union_sizes=host_union_sizes(keys, AUTO_QUERY_BLOCKS),
        heads=heads, top_k=32, num_units=kv_len // 64, read_block=64, chip=TPU_CHIPS["v5e"],
        config=cfg, **SHAPE,
    )  # fmt: skip
    assert plan.kernel == V5E_FASTER[picks, heads]
