"""Soft cap: forward and derivatives against numpy formulas and jax.grad, CapParams."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_static_value, tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_common import CapMethod, CapParams, cap_forward
from attn_common.cap import cap_derivative, cap_derivative_from_output, cap_scaled_with_derivative

N = 64  # fixed length so compiled kernels are reused across examples


def forward_np(s, method, c):
    s = np.asarray(s, np.float64)
    if method is CapMethod.NONE:
        return s
    if method is CapMethod.TANH:
        return c * np.tanh(s / c)
    return s / (1.0 + np.abs(s) / c)


def derivative_np(s, method, c):
    s = np.asarray(s, np.float64)
    if method is CapMethod.NONE:
        return np.ones_like(s)
    if method is CapMethod.TANH:
        with np.errstate(over="ignore"):
            return 1.0 / np.cosh(s / c) ** 2
    return 1.0 / (1.0 + np.abs(s) / c) ** 2


logits = st.lists(
    st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False), min_size=N, max_size=N
)
cap_values = st.floats(0.01, 500.0, allow_nan=False)
methods = st.sampled_from(list(CapMethod))


@settings(max_examples=tier_examples(60), deadline=None)
@given(logits, methods, cap_values)
def test_forward_and_derivatives_float64(s, method, c):
    cap = CapParams(method, c)
    s = np.array(s, np.float64)
    with jax.enable_x64(True):
        x = jnp.asarray(s, jnp.float64)
        y = cap_forward(x, cap)
        assert y.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(y), forward_np(s, method, c), rtol=1e-13, atol=1e-13)
        d = np.asarray(cap_derivative(x, cap))
        np.testing.assert_allclose(d, derivative_np(s, method, c), rtol=1e-12, atol=1e-14)
        g = np.asarray(jax.vmap(jax.grad(lambda t: cap_forward(t, cap)))(x))
        np.testing.assert_allclose(d, g, rtol=1e-12, atol=1e-14)
        d_out = np.asarray(cap_derivative_from_output(y, cap))
        # from the capped value: same derivative (the y round trip loses a few ulps of y/c)
        np.testing.assert_allclose(d_out, derivative_np(s, method, c), rtol=1e-9, atol=1e-12)
        if method is not CapMethod.NONE:
            assert (np.abs(np.asarray(y)) <= c).all()
            assert ((d > 0) | (np.abs(s) > 10 * c)).all() and (d <= 1).all()


@settings(max_examples=tier_examples(60), deadline=None)
@given(
    logits,
    methods,
    cap_values,
    st.floats(0.01, 4.0),
    st.sampled_from([1.0, math.log2(math.e)]),
    st.booleans(),
)
def test_scaled_with_derivative_matches_forward_and_derivative(raw, method, c, scale, out, rec):
    """The folded kernel form equals out * cap(scale * raw) and cap'(scale * raw)."""
    cap = CapParams(method, c)
    raw = np.array(raw, np.float64)
    reciprocal = (lambda d: 1.0 / d) if rec else None
    with jax.enable_x64(True):
        x = jnp.asarray(raw, jnp.float64)
        y, d = cap_scaled_with_derivative(x, cap, scale, out_scale=out, reciprocal=reciprocal)
        s = raw * scale
        np.testing.assert_allclose(
            np.asarray(y), out * forward_np(s, method, c), rtol=1e-12, atol=1e-12
        )
        if method is CapMethod.NONE:
            assert d is None
        else:
            np.testing.assert_allclose(
                np.asarray(d), derivative_np(s, method, c), rtol=1e-12, atol=1e-14
            )


@settings(max_examples=tier_examples(25), deadline=None)
@given(methods, cap_values)
def test_monotone_and_odd(method, c):
    cap = CapParams(method, c)
    with jax.enable_x64(True):
        s = jnp.linspace(-5 * c, 5 * c, 401, dtype=jnp.float64)
        y = np.asarray(cap_forward(s, cap))
        assert (np.diff(y) > 0).all()
        np.testing.assert_allclose(y, -y[::-1], rtol=0, atol=1e-12 * c)
        # near zero the cap is the identity to first order
        np.testing.assert_allclose(
            np.asarray(cap_derivative(jnp.zeros(3, jnp.float64), cap)), 1.0, rtol=1e-15
        )


@pytest.mark.parametrize("method", list(CapMethod))
def test_float32_dtype_preserved(method):
    cap = CapParams(method, 30.0)
    s = jnp.linspace(-100, 100, 33, dtype=jnp.float32)
    for fn in (cap_forward, cap_derivative, cap_derivative_from_output):
        out = fn(s, cap)
        assert out.dtype == jnp.float32
        assert out.shape == s.shape
    np.testing.assert_allclose(
        np.asarray(cap_forward(s, cap)),
        forward_np(np.asarray(s), method, 30.0),
        rtol=2e-6,
        atol=2e-5,
    )
    bf = jnp.linspace(-8, 8, 16, dtype=jnp.bfloat16)
    assert cap_forward(bf, cap).dtype == jnp.bfloat16


def test_none_is_identity():
    s = jnp.array([-3.0, 0.0, 2.5])
    for cap in (None, CapParams(), CapParams(CapMethod.NONE), CapParams("none", 5.0)):
        np.testing.assert_array_equal(np.asarray(cap_forward(s, cap)), np.asarray(s))
        np.testing.assert_array_equal(np.asarray(cap_derivative(s, cap)), 1.0)
        np.testing.assert_array_equal(np.asarray(cap_derivative_from_output(s, cap)), 1.0)


def test_known_values():
    s = jnp.array([0.0, 30.0, -30.0])
    np.testing.assert_allclose(
        np.asarray(cap_forward(s, CapParams("tanh", 30.0))),
        [0.0, 30 * math.tanh(1.0), -30 * math.tanh(1.0)],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        np.asarray(cap_forward(s, CapParams("soft_sign", 30.0))), [0.0, 15.0, -15.0], rtol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(cap_derivative(s, CapParams("soft_sign", 30.0))), [1.0, 0.25, 0.25], rtol=1e-6
    )


@pytest.mark.parametrize("fn", [cap_forward, cap_derivative, cap_derivative_from_output])
@pytest.mark.parametrize("bad", ["tanh", CapMethod.TANH, 30.0, (CapMethod.TANH, 30.0)])
def test_cap_argument_type_checked(fn, bad):
    with pytest.raises(TypeError, match="cap"):
        fn(jnp.zeros(3), bad)


# --------------------------------------------------------------------------------------
# CapParams


@pytest.mark.parametrize(
    "method, expected",
    [
        ("tanh", CapMethod.TANH),
        ("TANH", CapMethod.TANH),
        ("soft_sign", CapMethod.SOFT_SIGN),
        ("Soft_Sign", CapMethod.SOFT_SIGN),
        (CapMethod.SOFT_SIGN, CapMethod.SOFT_SIGN),
    ],
)
def test_capparams_string_methods(method, expected):
    p = CapParams(method, 30)
    assert p.method is expected
    assert p.value == 30.0 and isinstance(p.value, float)
    assert p.active


def test_capparams_none():
    for p in (CapParams(), CapParams("none"), CapParams(CapMethod.NONE, 12.0)):
        assert p.method is CapMethod.NONE
        assert p.value is None
        assert not p.active
    assert CapParams("none", 3.0) == CapParams()


@pytest.mark.parametrize("method", ["tanh", "soft_sign"])
@pytest.mark.parametrize(
    "value, exc",
    [
        (0, ValueError),
        (0.0, ValueError),
        (-1.0, ValueError),
        (-30, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        (math.nan, ValueError),
        (None, TypeError),
        ("30", TypeError),
        (True, TypeError),
        (np.array([30.0]), TypeError),
    ],
)
def test_capparams_bad_value(method, value, exc):
    with pytest.raises(exc, match=r"CapParams\.value"):
        CapParams(method, value)


@pytest.mark.parametrize(
    "method, exc", [("cosine", ValueError), ("", ValueError), (3, TypeError), (None, TypeError)]
)
def test_capparams_bad_method(method, exc):
    with pytest.raises(exc, match=r"CapParams\.method"):
        CapParams(method, 1.0)


def test_capparams_frozen_and_hashable():
    a = CapParams("tanh", 30)
    assert a != CapParams("tanh", 31.0)
    assert_static_value(a, CapParams(CapMethod.TANH, 30.0), CapParams("soft_sign", 30.0), "value")


def test_capparams_static_jit_arg():
    """Equal caps share a compile (``assert_static_value``) and compute the same; a
    different cap computes its own function."""
    jf = jax.jit(cap_forward, static_argnames="cap")
    x = jnp.linspace(-50, 50, 11)
    y1 = jf(x, cap=CapParams("tanh", 30))
    y2 = jf(x, cap=CapParams(CapMethod.TANH, 30.0))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    y3 = jf(x, cap=CapParams("soft_sign", 30.0))
    np.testing.assert_allclose(
        np.asarray(y3), forward_np(np.asarray(x), CapMethod.SOFT_SIGN, 30.0), rtol=1e-6
    )
