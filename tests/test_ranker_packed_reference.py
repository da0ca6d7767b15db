"""Packed ranker rows (bounds ``[B, U, 4]``): the reference vs the float64 packed oracle.

Edge cases per user (empty users, unaligned boundaries, users sharing a block, gaps,
padding at the end of a row, candidates before / inside a user's history, out-of-range
values), forward and LSE, gradients, and the equivalence "U users in one row == the
same users each alone in their own padded row".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    check_ranker_against_oracle,
    check_ranker_bounds_as_data,
    oracle_cap_args,
    ranker_inputs,
    rng_for,
)
from jax.experimental import checkify
from oracle import ranker_allowed_packed, ranker_oracle_packed, ranker_oracle_packed_grad

from attn_common import CapMethod, CapParams
from attn_common import ranker_attention as front_door
from attn_reference import ranker_attention

S = 37
# B = 3 rows of S = 37 with U = 4 slots; each row mixes the per-user edge cases.
PACKED_37 = np.asarray(
    [
        [  # users back to back, unaligned, sharing blocks; padding at the end
            [0, 7, 7, 10],
            [10, 21, 21, 23],
            [23, 24, 24, 30],
            [0, 0, 0, 0],  # unused slot
        ],
        [  # gaps between users, a user with a gap between H and C, slots out of order
            [20, 26, 26, 29],
            [2, 8, 12, 15],  # H, gap, C
            [31, 31, 31, 37],  # empty history: candidates attend themselves only
            [9, 11, 11, 11],  # empty candidates
        ],
        [  # candidates first, own H/C overlap, out-of-range and inverted values
            [6, 12, 0, 4],  # candidates before the history
            [14, 22, 18, 25],  # its candidates overlap its history
            [30, 50, 28, 30],  # history clipped to [30, 37)
            [5, 2, 9, 3],  # inverted: an empty user
        ],
    ],
    np.int32,
)
CAPS = {
    "none": None,
    "tanh": CapParams(CapMethod.TANH, 2.0),
    "soft_sign80": CapParams(CapMethod.SOFT_SIGN, 80.0),
}
# Each new shape, dtype or cap compiles the reference again (~2-3 s on 2 cores): the
# quick tier (-m "not slow") keeps the cases that no other quick test covers.
SLOW = pytest.mark.slow


def _check(q, k, v, bounds, *, cap=None, sm_scale=None, dtype="float32"):
    out, lse = ranker_attention(q, k, v, bounds, cap=cap, sm_scale=sm_scale, return_lse=True)
    out, lse = np.asarray(out), np.asarray(lse)
    check_ranker_against_oracle(
        ranker_oracle_packed, q, k, v, bounds, (out, lse), cap=cap, sm_scale=sm_scale, dtype=dtype
    )
    return out, lse


# Quick: the strongest cap (tanh 2.0); the packed rows are independent of the cap
# method, each of which test_ranker_reference.py checks quickly.
@pytest.mark.parametrize(
    "cap_name", [pytest.param("none", marks=SLOW), "tanh", pytest.param("soft_sign80", marks=SLOW)]
)
def test_packed_edge_cases_gqa5(cap_name):
    q, k, v = ranker_inputs(21, 3, S, 10, 2, 64)
    _check(q, k, v, PACKED_37, cap=CAPS[cap_name], sm_scale=1.0)


# bf16 is checked quickly by test_ranker_reference.py::test_shapes_dtypes, the [1, U, 4]
# broadcast by common/tests/test_packed_bounds.py::test_normalize_packed_forms.
@SLOW
def test_packed_bf16_and_broadcast_row():
    q, k, v = ranker_inputs(22, 3, S, 4, 2, 64, "bfloat16")
    _check(q, k, v, PACKED_37, cap=CAPS["soft_sign80"], dtype="bfloat16")
    q, k, v = ranker_inputs(23, 3, S, 4, 4, 32)
    out, _ = _check(q, k, v, PACKED_37[1:2])  # [1, U, 4] is broadcast to every row
    want = ranker_oracle_packed(q, k, v, np.repeat(PACKED_37[1:2], 3, axis=0))
    assert_close(out, want[0], rtol_l2=1e-5, atol=3e-5)


@SLOW  # the oracle checks (assert_ranker_close) of test_packed_edge_cases_gqa5 cover it
def test_empty_rows_exact_and_finite():
    q, k, v = ranker_inputs(24, 3, S, 4, 2, 64)
    out, lse = ranker_attention(q, k, v, PACKED_37, return_lse=True)
    out, lse = np.asarray(out), np.asarray(lse)
    for b in range(3):
        has_key = ranker_allowed_packed(PACKED_37[b], S).any(axis=1)
        assert (~has_key).any() and has_key.any()
        assert np.all(out[b, ~has_key] == 0.0)
        assert np.all(np.isneginf(lse[b][:, ~has_key]))
        assert np.all(np.isfinite(lse[b][:, has_key]))


@SLOW  # ~4 s; the forms' normalization: test_packed_bounds.py::test_normalize_packed_forms
def test_one_user_forms_agree():
    """[B, 4], [B, 1, 4] and [B, U, 4] with one used slot give identical results."""
    q, k, v = ranker_inputs(25, 3, S, 4, 2, 64)
    one = np.asarray([[0, 20, 20, 30], [3, 9, 12, 37], [0, 0, 5, 9]], np.int32)
    padded = np.zeros((3, 3, 4), np.int32)
    padded[:, 1] = one
    ref_out, ref_lse = ranker_attention(q, k, v, one, return_lse=True)
    for bounds in (one[:, None], padded):
        out, lse = ranker_attention(q, k, v, bounds, return_lse=True)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))


def _alone_rows(q, k, v, bounds_row, users_extents, rng):
    """Each user of a packed row moved alone to the start of its own padded row."""
    rows_q, rows_k, rows_v, rows_b = [], [], [], []
    for (a, e), u in users_extents:
        qa, ka, va = (rng.standard_normal(x.shape[1:]).astype(x.dtype) for x in (q, k, v))
        qa[: e - a], ka[: e - a], va[: e - a] = q[0, a:e], k[0, a:e], v[0, a:e]
        hl, hu, cl, cu = (int(x) for x in bounds_row[u])
        rows_b.append([hl - a, hu - a, cl - a, cu - a] if hl < hu else [0, 0, cl - a, cu - a])
        rows_q.append(qa), rows_k.append(ka), rows_v.append(va)
    return (np.stack(x) for x in (rows_q, rows_k, rows_v, rows_b))


def _extents(bounds_row):
    ext = []
    for u, (hl, hu, cl, cu) in enumerate(bounds_row.tolist()):
        segs = [(lo, hi) for lo, hi in ((hl, hu), (cl, cu)) if lo < hi]
        if segs:
            ext.append(((min(s[0] for s in segs), max(s[1] for s in segs)), u))
    return ext


# ~12 s each on 2 cores: in the full tier. Quick, the packed users' values and gradients
# are checked against the packed oracle (test_packed_edge_cases_gqa5,
# test_grads_float64_vs_packed_oracle_deterministic), and another user's rows poisoned
# change nothing (tests/test_ranker_isolation.py, "other_user", on the reference).
@pytest.mark.parametrize("row", [0, 1])
@SLOW
def test_packed_row_equals_users_alone(row):
    """Outputs, LSE and gradients of each user are the same packed or alone (padding and
    other users' tokens around it change nothing)."""
    bounds_row = PACKED_37[row]
    q, k, v = ranker_inputs(26 + row, 1, S, 4, 2, 16)
    rng = rng_for(30 + row)
    ext = _extents(bounds_row)
    aq, ak, av, ab = _alone_rows(q, k, v, bounds_row, ext, rng)
    cap = CAPS["tanh"]
    w_out = rng.standard_normal(q.shape).astype(np.float32)
    w_lse = rng.standard_normal((1, 4, S)).astype(np.float32)

    def loss(bounds, w_o, w_l):
        def f(q, k, v):
            out, lse = ranker_attention(q, k, v, bounds, cap=cap, return_lse=True)
            return jnp.sum(out * w_o) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_l, 0.0))

        return f

    packed_b = bounds_row[None]
    p_out, p_lse = ranker_attention(q, k, v, packed_b, cap=cap, return_lse=True)
    a_out, a_lse = ranker_attention(aq, ak, av, ab, cap=cap, return_lse=True)
    # alone-row weights: the packed weights of the user's positions, zero elsewhere
    wa_out = np.zeros(aq.shape, np.float32)
    wa_lse = np.zeros((len(ext), 4, S), np.float32)
    for n, ((a, e), _) in enumerate(ext):
        wa_out[n, : e - a] = w_out[0, a:e]
        wa_lse[n, :, : e - a] = w_lse[0, :, a:e]
    p_grads = jax.grad(loss(packed_b, w_out, w_lse), argnums=(0, 1, 2))(q, k, v)
    a_grads = jax.grad(loss(ab, wa_out, wa_lse), argnums=(0, 1, 2))(aq, ak, av)
    for n, ((a, e), u) in enumerate(ext):
        # the user's own positions (another user may sit in a gap of its extent)
        hl, hu, cl, cu = (int(x) for x in bounds_row[u])
        own = np.asarray([hl <= t < hu or cl <= t < cu for t in range(a, e)])
        pos_p, pos_a = np.arange(a, e)[own], np.arange(e - a)[own]
        close = dict(rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            np.asarray(p_out)[0, pos_p], np.asarray(a_out)[n, pos_a], **close
        )
        np.testing.assert_allclose(
            np.asarray(p_lse)[0][:, pos_p], np.asarray(a_lse)[n][:, pos_a], **close
        )
        for pg, ag in zip(p_grads, a_grads, strict=True):
            np.testing.assert_allclose(np.asarray(pg)[0, pos_p], np.asarray(ag)[n, pos_a], **close)


def test_grads_float64_vs_packed_oracle_deterministic():
    """jax.grad of the reference == the packed oracle's hand-derived backward (float64);
    no NaN; padding rows and keys nobody reads get exactly 0; repeat runs are bitwise equal."""
    cap = CAPS["soft_sign80"]
    bounds = PACKED_37[:, :, :]
    with jax.enable_x64(True):
        qn, kn, vn = (x.astype(np.float64) for x in ranker_inputs(40, 3, S, 4, 2, 8))
        rng = rng_for(41)
        w_out, w_lse = rng.standard_normal(qn.shape), rng.standard_normal((3, 4, S))

        def loss(q, k, v):
            out, lse = ranker_attention(q, k, v, jnp.asarray(bounds), cap=cap, return_lse=True)
            return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_lse, 0.0))

        args = tuple(jnp.asarray(x) for x in (qn, kn, vn))
        grads = jax.grad(loss, argnums=(0, 1, 2))(*args)
        again = jax.grad(loss, argnums=(0, 1, 2))(*args)
        want = ranker_oracle_packed_grad(qn, kn, vn, bounds, w_out, w_lse, **oracle_cap_args(cap))
        for name, g, g2, w in zip("qkv", grads, again, want, strict=True):
            g = np.asarray(g)
            assert g.dtype == np.float64 and np.all(np.isfinite(g))
            np.testing.assert_array_equal(g, np.asarray(g2))
            assert_close(g, w, rtol_l2=1e-10, atol=1e-10, name=f"d{name}")
    dq, dk, dv = (np.asarray(g) for g in grads)
    for b in range(3):
        allowed = ranker_allowed_packed(bounds[b], S)
        no_key, unread = ~allowed.any(axis=1), ~allowed.any(axis=0)
        assert no_key.any() and unread.any()
        assert np.all(dq[b, no_key] == 0.0)
        assert np.all(dk[b, unread] == 0.0) and np.all(dv[b, unread] == 0.0)


# --------------------------------------------------------------------------------------
# the overlap rule, traced bounds, dispatch

OVERLAPPING = np.asarray([[[0, 10, 10, 12], [11, 20, 20, 22]]], np.int32)  # C0 meets H1


def test_overlapping_users_refused_on_host():
    q, k, v = ranker_inputs(50, 1, S, 2, 2, 16)
    with pytest.raises(ValueError, match=r"bounds: row 0: users 0 \[0, 10, 10, 12\] and 1"):
        ranker_attention(q, k, v, OVERLAPPING)


# ~5 s on 2 cores: the same checks (overlap, out of range) under jit and checkify are
# checked quickly by common/tests/test_packed_bounds.py::test_check_packed_bounds_checkify,
# the ranker's debug_checks by test_reference_validation.py::test_ranker_checkify_bounds.
@SLOW
def test_debug_checks_report_overlap_under_jit():
    q, k, v = ranker_inputs(51, 1, S, 2, 2, 16)

    @jax.jit
    def f(q, k, v, b):
        return ranker_attention(q, k, v, b, debug_checks=True)

    checked = checkify.checkify(f)
    err, _ = checked(q, k, v, jnp.asarray(OVERLAPPING))
    assert "overlapping users: row 0, users 0 and 1" in err.get()
    err, _ = checked(q, k, v, jnp.asarray(PACKED_37[:1, :3]))
    assert err.get() is None
    err, _ = checked(q, k, v, jnp.asarray([[[0, 10, 10, 40]]], jnp.int32))
    assert "out of range" in err.get()


# ~3 s on 2 cores: bounds as data (one compile) are checked quickly by
# test_ranker_reference.py::test_traced_bounds_one_compile, packed bounds against the
# oracle by test_packed_edge_cases_gqa5.
@SLOW
def test_traced_packed_bounds_one_compile():
    q, k, v = ranker_inputs(52, 3, S, 4, 2, 16)
    cases = {
        "packed": PACKED_37,
        "rows_reversed": PACKED_37[::-1],
        "slots_reversed": PACKED_37[:, ::-1],
    }
    check_ranker_bounds_as_data(ranker_oracle_packed, q, k, v, cases)


# ~3 s on 2 cores: the front door's dispatch is checked quickly by
# common/tests/test_dispatch.py, packed bounds through the reference's own entry point
# (the same spec) by test_packed_edge_cases_gqa5.
@SLOW
def test_front_door_runs_packed_on_reference():
    q, k, v = ranker_inputs(53, 3, S, 4, 2, 16)
    out = front_door(q, k, v, PACKED_37)
    want, _ = ranker_oracle_packed(q, k, v, PACKED_37)
    assert_close(out, want, rtol_l2=1e-5, atol=3e-5)


def test_hopper_supports_packed_for_pipelined_head_dims():
    """The Hopper kernels take packed rows for D 64 and 128; D=256 (simple backward
    kernels) is refused by name, so dispatch falls back to the reference."""
    mgpu = pytest.importorskip("attn_mosaic_gpu")
    packed = jax.ShapeDtypeStruct((2, 3, 4), jnp.int32)
    for d in (64, 128):
        q = jax.ShapeDtypeStruct((2, 64, 4, d), jnp.bfloat16)
        assert mgpu.supports("ranker_attention", q, q, q, packed) is None
        assert mgpu.supports("ranker_attention", q, q, q, bounds=packed) is None
    q256 = jax.ShapeDtypeStruct((2, 64, 4, 256), jnp.bfloat16)
    reason = mgpu.supports("ranker_attention", q256, q256, q256, packed)
    assert reason is not None and "head_dim" in reason
    assert "head_dim" in mgpu.supports(
        "ranker_attention", q256, q256, q256, [[[0, 1, 1, 2]] * 2] * 2
    )
    for one in ((2, 4), (2, 1, 4), (4,)):
        bounds = jax.ShapeDtypeStruct(one, jnp.int32)
        assert mgpu.supports("ranker_attention", q256, q256, q256, bounds) is None
    qf = jnp.zeros((2, 64, 4, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="packed rows"):
        mgpu.ranker_attention(qf, qf, qf, jnp.zeros((2, 3, 4), jnp.int32), interpret=True)


# ~12 s on 2 cores; pack_users' gather / scatter and their gradients are checked quickly
# by common/tests/test_packing.py, the packed rows as above.
@SLOW
def test_pack_users_training_step_matches_unpacked():
    """A jitted gradient through ``pack_users``' gather -> ranker attention -> scatter, on
    flat per-user features: the loss and the gradients of the flat q, k, v equal those of
    the unpacked computation (each user alone at the start of its own row, built here
    without the packer), with GQA and a soft cap. One compile serves two batches."""
    from attn_common import pack_users

    rng = rng_for(57)
    seq, hq, hkv, d = 24, 4, 2, 16
    cap = CAPS["soft_sign80"]
    traces = []

    @jax.jit
    def packed_loss_and_grads(p, fq, fk, fv, w):
        traces.append(1)

        def loss(fq, fk, fv):
            out = ranker_attention(p.gather(fq), p.gather(fk), p.gather(fv), p.bounds, cap=cap)
            return jnp.sum(p.scatter(out) * w)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(fq, fk, fv)

    @jax.jit
    def unpacked_loss_and_grads(index, bounds, fq, fk, fv, w):
        def rows(x):  # [F, ...] -> [N, S, ...], zeros at padding (index -1)
            return jnp.where((index >= 0)[..., None, None], x[jnp.maximum(index, 0)], 0.0)

        def loss(fq, fk, fv):
            out = ranker_attention(rows(fq), rows(fk), rows(fv), bounds, cap=cap)
            return jnp.sum(out * rows(w))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(fq, fk, fv)

    def unpacked_layout(hist, cand):
        """Row ``i`` holds user ``i`` alone at positions ``0 .. len - 1``."""
        offsets = np.concatenate([[0], np.cumsum(hist + cand)])
        index = np.full((len(hist), seq), -1)
        for i in range(len(hist)):
            index[i, : hist[i] + cand[i]] = np.arange(offsets[i], offsets[i + 1])
        return index, np.stack([0 * hist, hist, hist, hist + cand], axis=1).astype(np.int32)

    for n in (9, 9):  # two batches, same static shapes
        hist = rng.integers(0, 18, n)
        cand = rng.integers(1, 6, n)
        flat_len = 9 * seq
        p = pack_users(hist, cand, seq_len=seq, num_rows=9, users_per_row=4, flat_len=flat_len)
        t = p.num_tokens
        fq, fk, fv = (
            rng.standard_normal((flat_len, h, d)).astype(np.float32) for h in (hq, hkv, hkv)
        )
        w = rng.standard_normal((flat_len, hq, d)).astype(np.float32)
        w[t:] = 0.0  # the loss reads real tokens only
        for x in (fq, fk, fv):
            x[t:] = np.nan  # flat padding: never read, gets no gradient
        val, grads = packed_loss_and_grads(p, fq, fk, fv, w)
        want_val, want_grads = unpacked_loss_and_grads(*unpacked_layout(hist, cand), fq, fk, fv, w)
        np.testing.assert_allclose(float(val), float(want_val), rtol=1e-5)
        for g, wg in zip(grads, want_grads, strict=True):
            g, wg = np.asarray(g), np.asarray(wg)
            assert (g[t:] == 0).all() and np.isfinite(g).all()
            np.testing.assert_allclose(g[:t], wg[:t], rtol=1e-5, atol=1e-5)
    assert len(traces) == 1
