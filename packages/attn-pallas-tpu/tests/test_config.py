"""The TPU sparse-MLA config, its heuristic and the per-query step tables (CPU only)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_pallas_tpu.config import SparseMlaConfig, default_config
from attn_pallas_tpu.unit_ring import FAR, entry_positions, query_steps


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(units_per_step=3), "power of two"),
        (dict(units_per_step=64), "power of two"),
        (dict(units_per_step=0), "positive"),
        (dict(ring_slots=1), ">= 2"),
        (dict(queries_per_program=True), "positive int"),
        (dict(query_block=12), "multiple of 8"),
        (dict(head_block=0), "positive"),
        (dict(u_max=-1), "positive"),
        (dict(forward_units_per_step=12), "forward_units_per_step.*power of two"),
        (dict(forward_units_per_step=0), "forward_units_per_step.*positive"),
        (dict(forward_ring_slots=1), "forward_ring_slots.*>= 2"),
        (dict(forward_ring_slots=0), "forward_ring_slots.*positive"),
    ],
)
def test_config_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseMlaConfig(**kwargs)


def test_config_derived_sizes():
    cfg = SparseMlaConfig(units_per_step=8, ring_slots=3, u_max=40)
    assert cfg.in_flight == 16 and cfg.step_rows(64) == 512 and cfg.u_chunk() == 64
    with pytest.raises(ValueError, match="u_max"):
        SparseMlaConfig().u_chunk()


@pytest.mark.parametrize(
    "read_block, top_k, queries, heads, want",
    [(16, 128, 1024, 64, (16, 32, 32)), (32, 64, 1024, 16, (16, 32, 32)),
     (64, 32, 1024, 128, (8, 16, 16)), (128, 16, 4, 16, (4, 8, 4)), (64, 3, 1, 1, (2, 2, 1)),
     (16, 16, 8, 16, (16, 16, 8)), (1, 2048, 1024, 16, (16, 32, 8)),
     (64, 32, 40, 512, (8, 16, 8)), (16, 256, 1024, 16, (16, 32, 16))],
)  # fmt: skip
def test_default_config(read_block, top_k, queries, heads, want):
    """``G`` up to 512 keys a step (16 units), the per-query forward's up to 1024 (32);
    ``QP`` 32 down to what the SMEM tables (``QP * K``) and blocks (``QP * H``) allow, not
    below 8, not above the queries; the per-query forward's ring 4 slots from 64 heads,
    the other kernels' 3."""
    cfg = default_config(read_block=read_block, top_k=top_k, num_queries=queries, heads=heads)
    got = (cfg.units_per_step, cfg.forward_units_per_step, cfg.queries_per_program)
    assert got == want
    assert cfg.units_per_step * read_block <= 512
    assert cfg.ring_slots == 3 and cfg.forward_ring_slots == (4 if heads >= 64 else 3)
    forward = cfg.per_query_forward()
    assert forward.units_per_step == cfg.forward_units_per_step
    assert forward.ring_slots == cfg.forward_ring_slots
    assert forward.forward_units_per_step is None and forward.forward_ring_slots is None
    assert forward.replace(units_per_step=cfg.units_per_step, ring_slots=3) == cfg.replace(
        forward_units_per_step=None, forward_ring_slots=None
    )  # nothing else differs
    plain = SparseMlaConfig(units_per_step=8, ring_slots=5).per_query_forward()
    assert (plain.units_per_step, plain.ring_slots) == (8, 5)


def _brute_steps(count, qp, g, k):
    """Per program: (query, first unit) of each step, a query's units in order."""
    out = []
    for p in range(len(count) // qp):
        steps = [(i, j) for i in range(qp) for j in range(0, count[p * qp + i], g)]
        out.append(steps)
    return out


_steps_jit = jax.jit(query_steps, static_argnames=("qp", "group", "rb"))


@settings(max_examples=40, deadline=None)
@given(
    qp=st.sampled_from([1, 2, 4]),
    g=st.sampled_from([1, 2, 4]),
    counts=st.lists(st.integers(0, 6), min_size=8, max_size=8),
    lims=st.lists(st.integers(0, 8 * 6 * 16 + 20), min_size=8, max_size=8),
)
def test_query_steps_match_brute_force(qp, g, counts, lims):
    k, rb = 6, 16
    count = np.asarray(counts, np.int32)
    addr = np.arange(8 * k, dtype=np.int32).reshape(8, k)
    kb = addr * rb
    lim = np.asarray(lims, np.int32)
    t = _steps_jit(addr, kb, count, lim, qp=qp, group=g, rb=rb)
    meta, steps = np.asarray(t.meta)[:, 0], np.asarray(t.steps)[:, 0]
    t_max = steps.shape[-1] // 3
    assert t_max == qp * -(-k // g)
    for p, want in enumerate(_brute_steps(count, qp, g, k)):
        assert meta[p, 0] == len(want)
        np.testing.assert_array_equal(meta[p, 1 : 1 + qp], count[p * qp : (p + 1) * qp])
        np.testing.assert_array_equal(meta[p, 1 + qp :], lim[p * qp : (p + 1) * qp])
        got = list(zip(steps[p, : len(want)], steps[p, t_max : t_max + len(want)], strict=True))
        assert got == want
        for s, (i, j0) in enumerate(want):  # clean: every entry live, every token < lim
            n = p * qp + i
            clean = all(j < count[n] and kb[n, j] + rb <= lim[n] for j in range(j0, j0 + g))
            assert steps[p, 2 * t_max + s] == int(clean)
    kg = -(-k // g) * g  # a step's G entries consecutive in the tables
    got_addr, got_kb = (np.asarray(x).reshape(8, kg) for x in (t.addr, t.kb))
    for i in range(8):
        for j in range(kg):
            live = j < count[i]
            # past the count: the step's first unit, re-copied without a select, and FAR
            want = addr[i, j] if live else (addr[i, j // g * g] if j // g * g < count[i] else None)
            if want is not None:
                assert got_addr[i, j] == want
            assert got_kb[i, j] == (kb[i, j] if live else FAR)


def test_entry_positions():
    kbs = [100, 7, FAR]
    got = np.asarray(entry_positions(kbs, rb=4, shape=(1, 12), axis=1))
    np.testing.assert_array_equal(got[0, :8], [100, 101, 102, 103, 7, 8, 9, 10])
    assert np.all(got[0, 8:] >= FAR)
    rows = np.asarray(entry_positions(kbs, rb=4, shape=(6, 1), axis=0, stride=2))
    np.testing.assert_array_equal(rows[:4, 0], [100, 102, 7, 9])  # first token of a word row
