"""``fixed_order_sum.segment_sum_fixed_order``: the deterministic backward's row sums.

* Integer-valued rows (exact in float32) sum exactly to NumPy's segment sums, for any
  ids (out-of-range ones dropped: their rows hold NaN and never reach an output), row
  counts past one, two and three levels of pieces (hypothesis), and empty inputs.
* A segment's bits depend only on its own rows in their order: rows of other segments
  inserted anywhere, and other segments' values changed, leave them bit for bit.
* Random float rows match a float64 sum to float32 rounding, and two compiled runs give
  the same bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_mosaic_gpu.fixed_order_sum import segment_sum_fixed_order


def _sum(data, ids, num_segments, **kw):
    """``segment_sum_fixed_order`` compiled (eager dispatch of its ops is slow)."""
    run = jax.jit(functools.partial(segment_sum_fixed_order, num_segments=num_segments, **kw))
    return np.asarray(run(jnp.asarray(data), jnp.asarray(ids, jnp.int32)))


def _numpy_sum(data, ids, num_segments):
    out = np.zeros((num_segments, data.shape[1]), np.float64)
    live = (ids >= 0) & (ids < num_segments)
    np.add.at(out, ids[live], data[live].astype(np.float64))
    return out


ROWS, SEGMENTS, WIDTH = 600, 40, 3  # fixed shapes: one compilation per fan-in


@functools.cache
def _compiled(fan):
    return jax.jit(lambda d, i: segment_sum_fixed_order(d, i, SEGMENTS, fan_in=fan))


@pytest.mark.slow  # ~18 s (four fan-ins compiled): exact sums stay in the quick tier in
# test_max_count_bounds_the_levels, dropped ids in test_empty_inputs, and the deterministic
# backward's sums against the reference in test_sparse_mla_grad_cpu.py
@settings(max_examples=tier_examples(40), deadline=None)
@given(
    live=st.integers(0, ROWS),
    segments=st.integers(1, SEGMENTS),
    hot=st.floats(0.0, 0.9),
    fan=st.sampled_from([(2, 2), (4, 2), (8, 8), (64, 8)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_integer_rows_sum_exactly(live, segments, hot, fan, seed):
    rng = np.random.default_rng(seed)
    # Ids over the first `segments` segments, -1 and out-of-range ones, a hot segment
    # (many levels of pieces); rows past `live` dropped.
    ids = rng.integers(-2, segments + 2, size=ROWS)
    ids[rng.random(ROWS) < hot] = rng.integers(0, segments)
    ids[live:] = -1
    data = rng.integers(-64, 64, size=(ROWS, WIDTH)).astype(np.float32)
    data[(ids < 0) | (ids >= segments)] = np.nan  # dropped rows are never read
    ids[ids >= segments] = SEGMENTS + 1  # out of range of the compiled call too
    got = _compiled(fan)(jnp.asarray(data), jnp.asarray(ids, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), _numpy_sum(data, ids, SEGMENTS))


def test_empty_inputs():
    got = segment_sum_fixed_order(jnp.zeros((0, 3)), jnp.zeros(0, jnp.int32), 5)
    np.testing.assert_array_equal(np.asarray(got), np.zeros((5, 3)))
    got = segment_sum_fixed_order(jnp.ones((4, 3)), jnp.full(4, -1, jnp.int32), 5)
    np.testing.assert_array_equal(np.asarray(got), np.zeros((5, 3)))


def test_max_count_bounds_the_levels():
    """A bound on the rows per segment: still exact at the bound."""
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(6), 50)
    rng.shuffle(ids)
    data = rng.integers(-9, 9, size=(300, 3)).astype(np.float32)
    got = _sum(data, ids, 6, max_count=50, fan_in=(4, 2))
    np.testing.assert_array_equal(got, _numpy_sum(data, ids, 6))


def test_a_segment_depends_only_on_its_rows_in_order():
    rng = np.random.default_rng(1)
    mine = rng.standard_normal((300, 5)).astype(np.float32)
    others = rng.standard_normal((900, 5)).astype(np.float32)
    other_ids = rng.integers(1, 30, size=900)
    where = np.sort(rng.choice(1200, 300, replace=False))  # segment 0's positions
    data = np.empty((1200, 5), np.float32)
    ids = np.empty(1200, np.int32)
    rest = np.setdiff1d(np.arange(1200), where)
    data[where], ids[where] = mine, 0
    data[rest], ids[rest] = others, other_ids
    alone = _sum(mine, np.zeros(300), 30)
    mixed = _sum(data, ids, 30)
    data[rest] *= 3.0
    changed = _sum(data, ids, 30)
    np.testing.assert_array_equal(alone[0], mixed[0])
    np.testing.assert_array_equal(mixed[0], changed[0])


@pytest.mark.slow  # ~7 s (100,000 rows): the quick tier's sums are exact in
# test_max_count_bounds_the_levels and bitwise reproducible in
# test_a_segment_depends_only_on_its_rows_in_order
def test_float_rows_match_float64_and_repeat_bitwise():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 300, size=100_000).astype(np.int32)
    data = rng.standard_normal((100_000, 16)).astype(np.float32)
    run = jax.jit(lambda d, i: segment_sum_fixed_order(d, i, 300))
    got = np.asarray(run(jnp.asarray(data), jnp.asarray(ids)))
    again = np.asarray(jax.jit(lambda d, i: segment_sum_fixed_order(d, i, 300))(data, ids))
    want = _numpy_sum(data, ids, 300)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got, again)


def test_bad_ids_shape_is_refused():
    with pytest.raises(ValueError, match="ids"):
        segment_sum_fixed_order(jnp.zeros((4, 2)), jnp.zeros(3, jnp.int32), 2)
