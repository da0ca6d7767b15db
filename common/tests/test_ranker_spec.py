"""Ranker input contract (check_ranker_inputs) and the effective-FLOP count."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sds, tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_common import (
    CapParams,
    RankerProblem,
    check_ranker_inputs,
    normalize_bounds,
    ranker_flops,
)
from attn_common.ranker import RankerKernelStatic


def qkv(b=2, s=16, hq=4, hkv=2, d=64, dtype=jnp.bfloat16):
    return sds((b, s, hq, d), dtype), sds((b, s, hkv, d), dtype), sds((b, s, hkv, d), dtype)


# --------------------------------------------------------------------------------------
# valid inputs


def test_valid_shape_dtype_structs():
    p = check_ranker_inputs(*qkv())
    assert isinstance(p, RankerProblem)
    assert (p.batch, p.seq_len, p.q_heads, p.kv_heads, p.head_dim) == (2, 16, 4, 2, 64)
    assert p.group_size == 2
    assert p.sm_scale == pytest.approx(1 / 8)
    assert p.cap == CapParams()


def test_valid_concrete_arrays_and_options():
    q = jnp.zeros((1, 5, 6, 32), jnp.float32)
    k = np.zeros((1, 5, 3, 32), np.float32)
    v = jnp.zeros((1, 5, 3, 32), jnp.float32)
    cap = CapParams("soft_sign", 80)
    p = check_ranker_inputs(q, k, v, sm_scale=0.25, cap=cap)
    assert p.sm_scale == 0.25 and isinstance(p.sm_scale, float)
    assert p.cap is cap
    assert p.group_size == 2
    p = check_ranker_inputs(q, k, v, sm_scale=2)  # an int scale is fine
    assert p.sm_scale == 2.0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
def test_any_float_dtype_without_restriction(dtype):
    p = check_ranker_inputs(*qkv(dtype=dtype), head_dims=None, dtypes=None)
    assert p.head_dim == 64


def test_default_sm_scale_uses_head_dim():
    for d in (1, 64, 100, 256):
        assert check_ranker_inputs(*qkv(d=d)).sm_scale == pytest.approx(1 / math.sqrt(d))


def test_restrictions_accept_supported():
    p = check_ranker_inputs(
        *qkv(d=128), dtypes=(jnp.bfloat16, jnp.float16), head_dims=(64, 128, 256)
    )
    assert p.head_dim == 128
    check_ranker_inputs(*qkv(dtype=jnp.float16), dtypes=("float16",))


def test_padded_gives_the_kernel_static_fields():
    p = check_ranker_inputs(*qkv(s=100), cap=CapParams("tanh", 30))
    st = RankerKernelStatic(**p.padded(128))
    assert (st.batch, st.seq_pad, st.q_heads, st.kv_heads, st.head_dim) == (2, 128, 4, 2, 64)
    assert (st.sm_scale, st.cap) == (p.sm_scale, p.cap)
    assert p.padded(100)["seq_pad"] == 100
    with pytest.raises(ValueError, match="seq_pad: got 99, expected at least seq_len 100"):
        p.padded(99)


def test_mha_and_mqa():
    assert check_ranker_inputs(*qkv(hq=8, hkv=8)).group_size == 1
    assert check_ranker_inputs(*qkv(hq=8, hkv=1)).group_size == 8


# --------------------------------------------------------------------------------------
# bad inputs: (args, kwargs, exception, name in message)


def _bad_cases():
    q, k, v = qkv()
    f32 = jnp.float32
    return {
        "q rank 3": ((sds((2, 16, 64)), k, v), {}, ValueError, "q"),
        "k rank 5": ((q, sds((2, 16, 2, 64, 1)), v), {}, ValueError, "k"),
        "v rank 3": ((q, k, sds((2, 16, 64))), {}, ValueError, "v"),
        "k batch": ((q, sds((3, 16, 2, 64)), sds((3, 16, 2, 64))), {}, ValueError, "k"),
        "k seq": ((q, sds((2, 17, 2, 64)), sds((2, 17, 2, 64))), {}, ValueError, "k"),
        "k head dim": ((q, sds((2, 16, 2, 32)), sds((2, 16, 2, 32))), {}, ValueError, "k"),
        "v shape": ((q, k, sds((2, 16, 1, 64))), {}, ValueError, "v"),
        "v head dim": ((q, k, sds((2, 16, 2, 32))), {}, ValueError, "v"),
        "Hq % Hkv": ((sds((2, 16, 5, 64)), k, v), {}, ValueError, "k"),
        "Hkv > Hq": (
            (sds((2, 16, 2, 64)), sds((2, 16, 4, 64)), sds((2, 16, 4, 64))),
            {},
            ValueError,
            "k",
        ),
        "zero kv heads": ((q, sds((2, 16, 0, 64)), sds((2, 16, 0, 64))), {}, ValueError, "k"),
        "empty seq": (qkv(s=0), {}, ValueError, "q"),
        "empty batch": (qkv(b=0), {}, ValueError, "q"),
        "empty head dim": (qkv(d=0), {}, ValueError, "q"),
        "int q": ((sds(q.shape, jnp.int32), k, v), {}, TypeError, "q"),
        "int k": ((q, sds(k.shape, jnp.int8), v), {}, TypeError, "k"),
        "bool v": ((q, k, sds(v.shape, jnp.bool_)), {}, TypeError, "v"),
        "mixed dtypes": ((sds(q.shape, f32), k, v), {}, TypeError, "q, k, v"),
        "mixed v dtype": ((q, k, sds(v.shape, jnp.float16)), {}, TypeError, "q, k, v"),
        "dtype restriction": (
            qkv(dtype=f32),
            {"dtypes": (jnp.bfloat16, jnp.float16)},
            TypeError,
            "q",
        ),
        "head dim restriction": (
            qkv(d=96),
            {"head_dims": (64, 128, 256)},
            NotImplementedError,
            "q",
        ),
        "sm_scale 0": (qkv(), {"sm_scale": 0.0}, ValueError, "sm_scale"),
        "sm_scale negative": (qkv(), {"sm_scale": -0.5}, ValueError, "sm_scale"),
        "sm_scale nan": (qkv(), {"sm_scale": float("nan")}, ValueError, "sm_scale"),
        "sm_scale inf": (qkv(), {"sm_scale": float("inf")}, ValueError, "sm_scale"),
        "sm_scale array": (qkv(), {"sm_scale": jnp.float32(0.1)}, TypeError, "sm_scale"),
        "sm_scale str": (qkv(), {"sm_scale": "0.1"}, TypeError, "sm_scale"),
        "sm_scale bool": (qkv(), {"sm_scale": True}, TypeError, "sm_scale"),
        "cap wrong type": (qkv(), {"cap": "tanh"}, TypeError, "cap"),
        "q not an array": (([[1.0]], k, v), {}, TypeError, "q"),
        "k not an array": ((q, None, v), {}, TypeError, "k"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs_raise_naming_argument(case):
    args, kwargs, exc, name = _bad_cases()[case]
    with pytest.raises(exc) as info:
        check_ranker_inputs(*args, **kwargs)
    # messages start with the argument name: "q: got ..., expected ..."
    assert str(info.value).startswith(f"{name}: got"), str(info.value)
    assert "expected" in str(info.value) or "supports" in str(info.value), str(info.value)


def test_messages_say_value_seen_and_expected():
    with pytest.raises(ValueError, match=r"^k: got 3 kv heads for 10 query heads.*Hq % Hkv"):
        check_ranker_inputs(sds((1, 4, 10, 8)), sds((1, 4, 3, 8)), sds((1, 4, 3, 8)))
    with pytest.raises(NotImplementedError, match=r"head dim 96.*\[64, 128, 256\]"):
        check_ranker_inputs(*qkv(d=96), head_dims=(256, 64, 128))
    with pytest.raises(TypeError, match=r"float32.*bfloat16"):
        check_ranker_inputs(*qkv(dtype=jnp.float32), dtypes=(jnp.bfloat16,))


# --------------------------------------------------------------------------------------
# ranker_flops


def pairs_brute(seq_len, bounds):
    i = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    total = 0
    for hl, hu, cl, cu in bounds:
        in_h_q = (hl <= i) & (i < hu)
        in_c_q = (cl <= i) & (i < cu)
        in_h_k = (hl <= j) & (j < hu)
        allowed = (in_h_k & (in_h_q | in_c_q)) | (in_c_q & (i == j))
        total += int(allowed.sum())
    return total


@settings(max_examples=tier_examples(80), deadline=None)
@given(
    st.integers(1, 40),
    st.lists(st.lists(st.integers(-10, 50), min_size=4, max_size=4), min_size=3, max_size=3),
    st.sampled_from([1, 4, 20]),
    st.sampled_from([64, 128]),
)
def test_ranker_flops_vs_pair_count(seq_len, raw, hq, d):
    bounds = np.asarray(normalize_bounds(np.array(raw, np.int32), batch=3, seq_len=seq_len))
    pairs = pairs_brute(seq_len, bounds.tolist())
    fwd = ranker_flops(bounds, hq, d)
    assert fwd == 4.0 * d * hq * pairs
    assert ranker_flops(bounds, hq, d, backward=True) == pytest.approx(3.5 * fwd)


def test_ranker_flops_phoenix_row():
    # phoenix: H = [0, 1024), C = [1024, 1088): 1088 queries x 1024 history keys + 64 self
    b = np.array([[0, 1024, 1024, 1088]])
    assert ranker_flops(b, 20, 128) == 4.0 * 128 * 20 * (1088 * 1024 + 64)
    # overlapping H and C: candidates inside H count their self key once
    b = np.array([[0, 10, 5, 15]])
    assert ranker_flops(b, 1, 1) == 4.0 * pairs_brute(20, [[0, 10, 5, 15]])
    assert ranker_flops(np.zeros((2, 4), np.int32), 8, 64) == 0.0
    # accepts a jax array
    assert ranker_flops(jnp.array([[0, 3, 3, 4]]), 1, 1) == 4.0 * (4 * 3 + 1)
