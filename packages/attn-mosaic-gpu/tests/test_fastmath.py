"""``attn_mosaic_gpu.fastmath`` elementwise, on the CPU: the FMA-pipe ``exp2`` and
reciprocal against their stated error bounds, and the paired reciprocal (one MUFU op per
two soft_sign denominators) over the whole float32 range of scores.

The compiled kernels run the same functions on WGMMA register tiles; here they run on
ordinary arrays (the MUFU op replaced by a correctly rounded float32 reciprocal, or by
``fast_reciprocal``, what interpret mode uses).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_common import CapMethod, CapParams, cap_scaled_with_derivative
from attn_mosaic_gpu.fastmath import (
    EXP2_MAX_REL_ERROR,
    RECIPROCAL_MAX_REL_ERROR,
    exp2_fma,
    fast_reciprocal,
    pair_scale,
    paired_affine_reciprocal,
    reciprocal_fma,
)

F32_MAX = float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
ULP = 2.0**-23


def _f32_rcp(p):
    return 1.0 / p


def _soft_sign_affine(cap: float, head_dim: int):
    """(slope, intercept) of the kernels' soft_sign denominator ``|raw| slope + intercept``
    (``attn_common.cap_scaled_with_derivative`` with ``out_scale = log2 e``)."""
    k = head_dim**-0.5 * LOG2E
    return head_dim**-0.5 / (cap * k), 1.0 / k


def _scores(rng, rows: int, cols: int):
    """|raw| from 0 to float32 max: log-uniform magnitudes, exact zeros and the extremes."""
    x = np.exp(rng.uniform(-30.0, math.log(F32_MAX), (rows, cols)))
    x[rng.random((rows, cols)) < 0.05] = 0.0
    x[0, :4] = [0.0, F32_MAX, F32_MAX, 1.0]
    x[0, cols // 2 : cols // 2 + 4] = [F32_MAX, F32_MAX, 0.0, 1e-45]
    return np.minimum(x, F32_MAX).astype(np.float32)


def test_exp2_fma_error_bound():
    """On XLA (CPU) the rounding step needs its guard, as in interpret mode."""
    fn = jax.jit(functools.partial(exp2_fma, xla_fold_guard=True))
    x = np.linspace(-126.0, 0.0, 400_001, dtype=np.float32)
    got = np.asarray(fn(x), np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1.0)) <= EXP2_MAX_REL_ERROR
    assert float(fn(jnp.float32(-jnp.inf))) == 0.0
    assert float(fn(jnp.float32(0.0))) == 1.0


def test_reciprocal_fma_error_bound():
    d = np.exp(np.random.default_rng(0).uniform(-80.0, 80.0, 200_000)).astype(np.float32)
    got = np.asarray(jax.jit(reciprocal_fma)(d), np.float64)
    assert np.max(np.abs(got * d.astype(np.float64) - 1.0)) <= RECIPROCAL_MAX_REL_ERROR


@pytest.mark.parametrize("cap", [18.0, 20.0, 30.0, 50.0, 80.0, 1e3, 1e6, 1e30])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pair_scale_keeps_every_intermediate_normal(cap, head_dim):
    """For soft_sign caps from ~18 up, a sigma exists and every product, reciprocal and
    folded constant of the pairing stays a normal float32 (what ``ftz`` needs)."""
    slope, intercept = _soft_sign_affine(cap, head_dim)
    sigma = pair_scale(slope, intercept)
    assert sigma is not None and math.log2(sigma) == round(math.log2(sigma))
    lo, hi = intercept, F32_MAX * slope + intercept
    tiny, huge = 2.0**-126, 2.0**126
    for value in (sigma * lo * lo, sigma * lo, sigma * slope, sigma, 1 / (sigma * lo)):
        assert tiny <= value < huge, value
    for value in (sigma * hi * hi, sigma * hi):
        assert tiny <= value < huge, value


@pytest.mark.parametrize("cap", [1.0, 10.0, 15.0])
def test_pair_scale_refuses_small_caps(cap):
    """Below ~18 no power of two covers scores up to float32 max: the kernels keep one
    MUFU op per element (``paired_affine_reciprocal`` falls back by itself)."""
    slope, intercept = _soft_sign_affine(cap, 128)
    assert pair_scale(slope, intercept) is None
    x = _scores(np.random.default_rng(1), 8, 32)
    got = paired_affine_reciprocal(x, slope, intercept, rcp=_f32_rcp)
    np.testing.assert_array_equal(got, _f32_rcp(x * np.float32(slope) + np.float32(intercept)))


@pytest.mark.parametrize("rcp", [_f32_rcp, fast_reciprocal], ids=["f32", "rsqrt_squared"])
@pytest.mark.parametrize("cap", [20.0, 80.0, 1e4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paired_reciprocal_full_range(rcp, cap, head_dim):
    """Every score magnitude from 0 to float32 max, as in a 64 x 128 forward tile and a
    64 x 64 backward tile: within 3 ulp of the exact reciprocal of the float32
    denominator, and the capped logit within 3 ulp of the reference's."""
    slope, intercept = _soft_sign_affine(cap, head_dim)
    rng = np.random.default_rng(int(cap) + head_dim)
    for cols in (128, 64, 16):
        x = _scores(rng, 64, cols)
        fn = jax.jit(lambda x: paired_affine_reciprocal(x, slope, intercept, rcp=rcp))
        got = np.asarray(fn(x), np.float64)
        denom = x.astype(np.float64) * np.float32(slope) + np.float32(intercept)
        assert np.all(np.isfinite(got)) and np.all(got > 0)
        np.testing.assert_allclose(got, 1.0 / denom, rtol=3 * ULP, atol=0)


@settings(max_examples=40, deadline=None)
@given(
    st.floats(20.0, 1e6),
    st.sampled_from([32, 64, 128, 256]),
    st.floats(-1e6, 1e6, width=32),
    st.floats(-1e6, 1e6, width=32),
)
def test_paired_cap_matches_reference_cap(cap, head_dim, left, right):
    """``cap_scaled_with_derivative`` with the paired reciprocal: value and derivative
    of the two partners within a few ulp of the exactly divided form."""
    soft_sign = CapParams(CapMethod.SOFT_SIGN, cap)
    scale = head_dim**-0.5
    raw = np.zeros((8, 16), np.float32)
    raw[:, 0], raw[:, 8] = left, right
    paired = cap_scaled_with_derivative(
        raw,
        soft_sign,
        scale,
        out_scale=LOG2E,
        affine_reciprocal=lambda x, a, b: paired_affine_reciprocal(x, a, b, rcp=_f32_rcp),
    )
    exact = cap_scaled_with_derivative(raw, soft_sign, scale, out_scale=LOG2E)
    for got, want in zip(paired, exact, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=4 * ULP, atol=1e-37)


def test_paired_partner_of_nonfinite_is_nan():
    """The documented shared fate: an Inf score makes its partner NaN (the kernels zero
    masked scores before the cap, so only an attended Inf, whose row is NaN in the
    reference too, can do this)."""
    slope, intercept = _soft_sign_affine(80.0, 128)
    x = np.ones((2, 16), np.float32)
    x[0, 3] = np.inf
    got = np.asarray(paired_affine_reciprocal(jnp.asarray(x), slope, intercept, rcp=_f32_rcp))
    assert np.isnan(got[0, 11]) and np.isfinite(np.delete(got[0], [3, 11])).all()
    assert np.isfinite(got[1]).all()
