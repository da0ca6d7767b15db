"""Ranker attention reference vs the independent float64 oracle (docs/design.md)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_lse_close,
    check_ranker_against_oracle,
    check_ranker_bounds_as_data,
    jit_cache_size,
    oracle_cap_args,
    ranker_inputs,
    rng_for,
)
from jax.test_util import check_grads
from oracle import ranker_allowed, ranker_oracle, ranker_oracle_grad

from attn_common import CapMethod, CapParams, KernelConfig, SegmentBounds
from attn_reference import ranker_attention
from attn_reference.ranker import _ranker_reference

CAPS = {
    "none": None,
    "tanh30": CapParams(CapMethod.TANH, 30.0),
    "soft_sign80": CapParams(CapMethod.SOFT_SIGN, 80.0),
    "tanh2": CapParams(CapMethod.TANH, 2.0),
    "soft_sign2": CapParams(CapMethod.SOFT_SIGN, 2.0),
}
# Each new (shape, dtype, cap, sm_scale) compiles the reference again (~2 s on 2 cores):
# the quick tier (-m "not slow") keeps a few of each grid, the full tier runs them all.
SLOW = pytest.mark.slow


# Bounds for B = 4 rows of S = 37 (nothing is a multiple of a block size).
S37 = 37
BOUNDS_37 = {
    "empty_history": [[0, 0, 0, 37], [0, 0, 5, 17], [0, 0, 36, 37], [3, 3, 0, 1]],
    "empty_candidates": [[0, 37, 37, 37], [0, 20, 20, 20], [3, 17, 30, 30], [0, 1, 1, 1]],
    "all_padding": [[0, 0, 0, 0], [5, 5, 9, 9], [20, 10, 30, 12], [37, 37, 37, 37]],
    "unaligned_per_row": [[0, 17, 17, 29], [3, 21, 24, 35], [1, 2, 2, 37], [11, 30, 30, 31]],
    "gaps_and_padding": [[2, 10, 15, 20], [0, 5, 30, 37], [10, 20, 0, 5], [0, 16, 16, 32]],
    "overlap_h_c": [[0, 20, 10, 30], [5, 25, 5, 25], [0, 37, 0, 37], [10, 20, 15, 18]],
    "out_of_range": [[-5, 20, 20, 50], [-3, -1, 40, 45], [30, 100, -7, 3], [0, 37, 37, 1000]],
    "mixed": [[0, 0, 0, 37], [0, 37, 37, 37], [9, 3, 40, 2], [3, 21, 24, 35]],
}


def _run(q, k, v, bounds, **kw):
    out, lse = ranker_attention(q, k, v, bounds, return_lse=True, **kw)
    return np.asarray(out), np.asarray(lse)


def _check_against_oracle(
    q, k, v, bounds, *, cap=None, sm_scale=None, dtype="float32", ref_bounds=None, **kw
):
    out, lse = _run(q, k, v, bounds, cap=cap, sm_scale=sm_scale, **kw)
    want_out, want_lse = check_ranker_against_oracle(
        ranker_oracle,
        q,
        k,
        v,
        bounds if ref_bounds is None else ref_bounds,
        (out, lse),
        cap=cap,
        sm_scale=sm_scale,
        dtype=dtype,
    )
    return out, lse, want_out, want_lse


# Quick: every bounds pattern under soft_sign2 (one compile per cap); the forward with no
# cap and with tanh is checked against the oracle quickly by test_bounds_forms_agree and
# test_traced_bounds_one_compile (tanh30, four of these patterns), test_shapes_dtypes.
QUICK_BOUNDS_CAPS = ("soft_sign2",)


@pytest.mark.parametrize(
    "case, cap_name",
    [
        pytest.param(case, cap, marks=() if cap in QUICK_BOUNDS_CAPS else SLOW, id=f"{case}-{cap}")
        for case in BOUNDS_37
        for cap in CAPS
    ],
)
def test_bounds_cases_gqa5(case, cap_name):
    """Every bounds pattern x every cap; GQA 5:1 (Hq=10, Hkv=2), D=64, S=37."""
    q, k, v = ranker_inputs(1, 4, S37, 10, 2, 64)
    bounds = np.asarray(BOUNDS_37[case], np.int32)
    # sm_scale = 1 gives logits with std ~8, so every cap (even 30 and 80) bends them.
    _check_against_oracle(q, k, v, bounds, cap=CAPS[cap_name], sm_scale=1.0)


def test_small_cap_matters():
    """The oracle itself: with cap 2.0 the answer is far from the uncapped one."""
    q, k, v = ranker_inputs(2, 1, S37, 2, 2, 64)
    bounds = np.asarray([[0, 20, 20, 37]])
    plain, _ = ranker_oracle(q, k, v, bounds)
    capped, _ = ranker_oracle(q, k, v, bounds, cap_method="tanh", cap_value=2.0)
    assert np.linalg.norm(plain - capped) > 0.1 * np.linalg.norm(plain)


@SLOW  # the oracle checks (assert_ranker_close) of test_bounds_cases_gqa5 cover it quickly
def test_empty_rows_exact():
    """Padding / gap / empty-segment rows: out exactly 0 and lse exactly -inf."""
    q, k, v = ranker_inputs(3, 4, S37, 10, 2, 64)
    bounds = np.asarray(BOUNDS_37["gaps_and_padding"], np.int32)
    out, lse = _run(q, k, v, bounds)
    for b, row in enumerate(bounds):
        has_key = ranker_allowed(row, S37).any(axis=1)
        assert np.all(out[b, ~has_key] == 0.0)
        assert np.all(np.isneginf(lse[b][:, ~has_key]))
        assert np.all(np.isfinite(lse[b][:, has_key]))
        assert np.all(np.any(out[b, has_key] != 0.0, axis=-1))


# Shapes: (B, S, Hq, Hkv, D). S is not a multiple of anything.
SHAPES = {
    "gqa5_d64_s130": (2, 130, 10, 2, 64),
    "gqa5_d128_s130": (2, 130, 10, 2, 128),
    "gqa5_d256_s37": (2, 37, 10, 2, 256),
    "mha_d128_s37": (2, 37, 4, 4, 128),
    "mha_d256_s130": (1, 130, 2, 2, 256),
}


def _bounds_for(seq: int, batch: int, rng) -> np.ndarray:
    rows = []
    for _ in range(batch):
        hl = int(rng.integers(0, seq // 4))
        hu = int(rng.integers(hl, seq * 3 // 4))
        cl = int(rng.integers(hu, seq))
        cu = int(rng.integers(cl, seq + 1))
        rows.append([hl, hu, cl, cu])
    return np.asarray(rows, np.int32)


# Quick: bfloat16, GQA, S = 130 (float32 at S = 37 and every cap method: the tests above).
QUICK_SHAPES = {("gqa5_d64_s130", "tanh30", "bfloat16")}


@pytest.mark.parametrize(
    "shape, cap_name, dtype",
    [
        pytest.param(shape, cap, dtype, marks=() if (shape, cap, dtype) in QUICK_SHAPES else SLOW)
        for dtype in ("float32", "bfloat16")
        for cap in ("none", "tanh30", "soft_sign80")
        for shape in SHAPES
    ],
)
def test_shapes_dtypes(shape, cap_name, dtype):
    batch, seq, hq, hkv, dim = SHAPES[shape]
    q, k, v = ranker_inputs(4, batch, seq, hq, hkv, dim, dtype)
    bounds = _bounds_for(seq, batch, rng_for(5))
    _check_against_oracle(q, k, v, bounds, cap=CAPS[cap_name], dtype=dtype)


@SLOW  # float32 and bfloat16 inputs are checked quickly by test_shapes_dtypes
def test_float16_inputs():
    q, k, v = ranker_inputs(6, 2, S37, 4, 2, 64, np.float16)
    bounds = np.asarray([[0, 20, 20, 33], [3, 9, 12, 37]], np.int32)
    out, lse = _run(q, k, v, bounds, cap=CAPS["tanh30"])
    assert out.dtype == np.float16 and lse.dtype == np.float32
    want_out, want_lse = ranker_oracle(q, k, v, bounds, cap_method="tanh", cap_value=30.0)
    assert_close(out, want_out, rtol_l2=2e-3, atol=5e-3)
    assert_lse_close(lse, want_lse, atol=1e-4)


# An explicit sm_scale (1.0) is checked quickly by test_bounds_cases_gqa5.
@pytest.mark.parametrize("sm_scale", [0.05, 0.3, 2.0])
@SLOW
def test_explicit_sm_scale(sm_scale):
    q, k, v = ranker_inputs(7, 4, S37, 10, 2, 64)
    bounds = np.asarray(BOUNDS_37["unaligned_per_row"], np.int32)
    _check_against_oracle(q, k, v, bounds, sm_scale=sm_scale, cap=CAPS["soft_sign80"])


def test_default_sm_scale_is_rsqrt_d():
    q, k, v = ranker_inputs(8, 4, S37, 10, 2, 64)
    bounds = np.asarray(BOUNDS_37["mixed"], np.int32)
    a, _ = _run(q, k, v, bounds)
    b, _ = _run(q, k, v, bounds, sm_scale=1.0 / 8.0)
    np.testing.assert_array_equal(a, b)


def test_bounds_forms_agree():
    """SegmentBounds (from_array / from_lengths / from_segment_ids), [4] and [1, 4]."""
    q, k, v = ranker_inputs(9, 4, S37, 10, 2, 64)
    hist = np.asarray([20, 0, 7, 30], np.int32)
    cand = np.asarray([10, 5, 0, 7], np.int32)
    start = np.asarray([0, 3, 2, 0], np.int32)
    arr = np.stack([start, start + hist, start + hist, start + hist + cand], axis=1)
    _check_against_oracle(q, k, v, arr)

    seg_ids = np.zeros((4, S37), np.int32)
    for b in range(4):
        seg_ids[b, arr[b, 0] : arr[b, 1]] = 1
        seg_ids[b, arr[b, 2] : arr[b, 3]] = 2
    forms = {
        "from_array": SegmentBounds.from_array(arr),
        "from_lengths": SegmentBounds.from_lengths(hist, cand, start),
        "from_segment_ids": SegmentBounds.from_segment_ids(seg_ids),
    }
    ref_out, ref_lse = _run(q, k, v, arr)
    for name, sb in forms.items():
        out, lse = _run(q, k, v, sb)
        np.testing.assert_array_equal(out, ref_out, err_msg=name)
        np.testing.assert_array_equal(lse, ref_lse, err_msg=name)

    # One row of bounds broadcast to every batch row.
    row = np.asarray([2, 19, 25, 36], np.int32)
    for bounds in (row, row[None], SegmentBounds.from_array(row)):
        _check_against_oracle(q, k, v, bounds, ref_bounds=np.repeat(row[None], 4, axis=0))
    _check_against_oracle(q, k, v, jnp.asarray(row))


def test_config_and_interpret_accepted():
    q, k, v = ranker_inputs(10, 4, S37, 10, 2, 64)
    bounds = np.asarray(BOUNDS_37["mixed"], np.int32)
    a, la = _run(q, k, v, bounds)
    b, lb = _run(q, k, v, bounds, config=KernelConfig(block_q=16, block_kv=32), interpret=True)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(la, lb)
    only_out = ranker_attention(q, k, v, bounds)
    np.testing.assert_array_equal(np.asarray(only_out), a)


def test_traced_bounds_one_compile():
    """Bounds are data: one jitted function serves different bound values."""
    q, k, v = ranker_inputs(11, 4, S37, 10, 2, 64)
    names = ("unaligned_per_row", "overlap_h_c", "out_of_range", "all_padding")
    cases = {case: np.asarray(BOUNDS_37[case], np.int32) for case in names}
    check_ranker_bounds_as_data(ranker_oracle, q, k, v, cases, cap=CAPS["tanh30"])

    # The un-jitted entry point: new bound values do not retrace the inner jit.
    ranker_attention(q, k, v, np.asarray(BOUNDS_37["mixed"], np.int32), cap=CAPS["tanh30"])
    size = jit_cache_size(_ranker_reference)
    ranker_attention(q, k, v, np.asarray(BOUNDS_37["gaps_and_padding"]), cap=CAPS["tanh30"])
    ranker_attention(q, k, v, SegmentBounds.from_lengths(3, 4), cap=CAPS["tanh30"])
    assert jit_cache_size(_ranker_reference) == size


# --------------------------------------------------------------------------------------
# Gradients (float64)

GRAD_BOUNDS = np.asarray(
    [[1, 7, 9, 12], [0, 0, 3, 5], [4, 4, 20, 2]],
    np.int32,  # gaps/padding; no history; empty
)
GRAD_SHAPE = (3, 13, 4, 2, 8)


def _loss_fn(bounds, cap, w_out, w_lse, sm_scale=None):
    def loss(q, k, v):
        out, lse = ranker_attention(q, k, v, bounds, cap=cap, sm_scale=sm_scale, return_lse=True)
        lse_term = jnp.where(jnp.isfinite(lse), lse * w_lse, 0.0)
        return jnp.sum(out * w_out) + jnp.sum(lse_term)

    return loss


# Finite differences (~3-6 s each on 2 cores): the gradient is checked quickly against the
# oracle's hand-derived backward by test_grads_vs_analytic_oracle_float64[tanh2].
@pytest.mark.parametrize("cap_name", ["none", "tanh2", "soft_sign2"])
@SLOW
def test_check_grads_float64(cap_name):
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in ranker_inputs(12, *GRAD_SHAPE))
        rng = rng_for(13)
        w_out = jnp.asarray(rng.standard_normal(q.shape))
        w_lse = jnp.asarray(rng.standard_normal((q.shape[0], q.shape[2], q.shape[1])))
        loss = _loss_fn(jnp.asarray(GRAD_BOUNDS), CAPS[cap_name], w_out, w_lse, sm_scale=0.7)
        assert loss(q, k, v).dtype == jnp.float64
        check_grads(loss, (q, k, v), order=1, modes=["rev"])


# ~3-6 s each on 2 cores: tanh2 stays quick (no cap is the same backward with an identity
# cap; the caps' own derivatives: common/tests/test_cap.py); soft_sign80 is checked
# quickly against the packed oracle's backward (test_ranker_packed_reference.py::
# test_grads_float64_vs_packed_oracle_deterministic; one-user bounds run as [B, 1, 4]).
@pytest.mark.parametrize(
    "cap_name",
    [pytest.param("none", marks=SLOW), "tanh2", pytest.param("soft_sign80", marks=SLOW)],
)
def test_grads_vs_analytic_oracle_float64(cap_name):
    """jax.grad of the reference == the oracle's hand-derived float64 backward."""
    cap = CAPS[cap_name]
    with jax.enable_x64(True):
        qn, kn, vn = (x.astype(np.float64) for x in ranker_inputs(14, *GRAD_SHAPE))
        rng = rng_for(15)
        w_out = rng.standard_normal(qn.shape)
        w_lse = rng.standard_normal((qn.shape[0], qn.shape[2], qn.shape[1]))
        loss = _loss_fn(jnp.asarray(GRAD_BOUNDS), cap, jnp.asarray(w_out), jnp.asarray(w_lse))
        grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x) for x in (qn, kn, vn)))
        want = ranker_oracle_grad(qn, kn, vn, GRAD_BOUNDS, w_out, w_lse, **oracle_cap_args(cap))
        for name, g, w in zip("qkv", grads, want, strict=True):
            assert g.dtype == jnp.float64
            assert_close(np.asarray(g), w, rtol_l2=1e-10, atol=1e-10, name=f"d{name}")


@pytest.mark.slow  # ~6 s on 2 cores; the float64 gradient tests stay quick
def test_grads_float32_vs_oracle_gqa5():
    """float32 gradients at the S=37 GQA 5:1 shape, against the float64 oracle."""
    cap = CAPS["soft_sign80"]
    q, k, v = ranker_inputs(16, 4, S37, 10, 2, 64)
    bounds = np.asarray(BOUNDS_37["mixed"], np.int32)
    rng = rng_for(17)
    w_out = rng.standard_normal(q.shape).astype(np.float32)
    w_lse = rng.standard_normal((4, 10, S37)).astype(np.float32)
    loss = _loss_fn(bounds, cap, w_out, w_lse)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = ranker_oracle_grad(q, k, v, bounds, w_out, w_lse, **oracle_cap_args(cap))
    for name, g, w in zip("qkv", grads, want, strict=True):
        assert_close(np.asarray(g), w, rtol_l2=1e-5, atol=1e-4, name=f"d{name}")


# The exact zeros are checked quickly by test_ranker_packed_reference.py::
# test_grads_float64_vs_packed_oracle_deterministic (padding rows, keys nobody reads).
@SLOW
def test_zero_grads_for_empty_rows_and_unread_keys():
    """float64: no NaN anywhere; rows with no key and keys nobody reads get exactly 0."""
    bounds = np.asarray([[2, 6, 9, 11], [0, 0, 0, 0], [5, 12, 0, 3]], np.int32)
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in ranker_inputs(18, *GRAD_SHAPE))
        rng = rng_for(19)
        w_out = jnp.asarray(rng.standard_normal(q.shape))
        w_lse = jnp.asarray(rng.standard_normal((q.shape[0], q.shape[2], q.shape[1])))
        loss = _loss_fn(jnp.asarray(bounds), CAPS["tanh2"], w_out, w_lse)
        dq, dk, dv = (np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    seq = GRAD_SHAPE[1]
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(g))
    for b, row in enumerate(bounds):
        allowed = ranker_allowed(row, seq)
        no_key = ~allowed.any(axis=1)  # query rows with nothing to attend
        unread = ~allowed.any(axis=0)  # keys no query reads
        assert no_key.any() and unread.any()
        assert np.all(dq[b, no_key] == 0.0)
        assert np.all(dk[b, unread] == 0.0) and np.all(dv[b, unread] == 0.0)
        assert np.all(np.any(dq[b, ~no_key] != 0.0, axis=-1))
        assert np.all(np.any(dv[b, ~unread] != 0.0, axis=-1))


# --------------------------------------------------------------------------------------
# Memory bound at the phoenix shape (compile only; nothing runs)

PHOENIX = (64, 1152, 20, 4, 128)
MEMORY_LIMIT = 4 << 30  # bytes of XLA temp; the target GPU has far more, 24 GiB is the bar


def _phoenix_args():
    batch, seq, hq, hkv, dim = PHOENIX
    return (
        jax.ShapeDtypeStruct((batch, seq, hq, dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, seq, hkv, dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, seq, hkv, dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((batch, 4), jnp.int32),
    )


@pytest.mark.parametrize("which", ["forward", pytest.param("grad", marks=pytest.mark.slow)])
def test_phoenix_memory_bound(which):
    cap = CAPS["soft_sign80"]

    def forward(q, k, v, bounds):
        return ranker_attention(q, k, v, bounds, cap=cap, return_lse=True)

    def loss(q, k, v, bounds):
        out, lse = forward(q, k, v, bounds)
        masked = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(jnp.square(out.astype(jnp.float32))) + jnp.sum(masked)

    fn = forward if which == "forward" else jax.grad(loss, argnums=(0, 1, 2))
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*_phoenix_args()).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    assert mem is not None
    assert mem.temp_size_in_bytes < MEMORY_LIMIT, (
        f"{which}: temp {mem.temp_size_in_bytes / 2**30:.2f} GiB >= {MEMORY_LIMIT / 2**30:.0f} GiB"
    )
    assert seconds < 60, f"{which}: compile took {seconds:.1f} s"


# Quick: the values of packed rows (a forward compile per chunking); the gradients (~12 s
# each on 2 cores: the backward of the chunked map) in the full tier, one-user bounds
# there too (they are lifted to [B, 1, 4] and run the same chunked code as packed ones).
@pytest.mark.parametrize("grads", [False, pytest.param(True, marks=SLOW)], ids=["values", "grads"])
@pytest.mark.parametrize("packed", [pytest.param(False, marks=SLOW), True])
def test_query_chunks_with_padding_match_one_chunk(monkeypatch, packed, grads):
    """The reference bounds memory by running queries in chunks; when the chunk does not
    divide S the last chunk is padded. Forced here (a tiny chunk budget: chunk 8 of S=45,
    three padding rows) and compared with the one-chunk run: values, and with ``grads``
    (values through ``value_and_grad``) the gradients too."""
    import attn_reference.ranker as ref_ranker

    rng = np.random.default_rng(7)
    b, s, hq, hkv, d = 2, 45, 4, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    bounds = (
        jnp.array([[[0, 10, 10, 14], [17, 30, 30, 41]], [[3, 20, 20, 25], [0, 0, 0, 0]]])
        if packed
        else jnp.array([[0, 30, 30, 41], [3, 20, 20, 25]])
    )
    cap = CapParams(CapMethod.TANH, 5.0)

    def loss(q, k, v):
        out, lse = ranker_attention(q, k, v, bounds, cap=cap, return_lse=True)
        return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    def run():
        """``((out, lse), grads or None)``."""
        if not grads:
            return ranker_attention(q, k, v, bounds, cap=cap, return_lse=True), None
        (_, out_lse), g = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return out_lse, g

    (want_out, want_lse), want_g = run()
    monkeypatch.setattr(ref_ranker, "_CHUNK_ELEMENTS", b * hq * s * 8)
    assert ref_ranker._query_chunk(b, hq, s) == 8  # 6 chunks, the last one 3 rows short
    (got_out, got_lse), got_g = run()
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-6)
    if grads:
        for got, want in zip(got_g, want_g, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
