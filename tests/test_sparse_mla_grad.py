"""Sparse MLA training on the reference: gradients and the attention mass (docs/semantics.md).

* The reference's gradient (``jax.grad`` in float32 at HIGHEST precision) against
  central finite differences of the independent float64 numpy oracle (``oracle.py``):
  every element of ``dq`` and ``dkv`` in flat mode (units and tokens), random directions
  in ragged paged mode and in the hypothesis cases. The loss weighs ``out`` and the
  finite ``lse``, so the LSE's gradient is checked too.
* Set semantics and isolation: duplicates give the gradient of the deduplicated
  selection; a query with no valid key gets ``dq == 0`` exactly; cache rows no query
  attends, holding NaN and Inf, get exactly zero gradient while every other gradient is
  bit-identical to the clean cache's; integer inputs get ``float0`` cotangents.
* ``return_attn_mass``: against a numpy float64 mass; ``stop_gradient``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    attended_rows_flat,
    attended_rows_ragged,
    build_ragged_layout,
    poison_rows,
    randn,
    random_page_selection,
    rng_for,
    sparse_mla_flat_case,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import sparse_mla_oracle_flat, sparse_mla_oracle_ragged

import attn_common.sparse_mla_xla as sparse_mla_xla
from attn_reference import sparse_mla_attention

SCALE = 0.3
EPS = 1e-5  # central differences in float64: truncation ~EPS^2, rounding ~1e-16 / EPS
GRAD_RTOL = 2e-5  # rel L2 of the float32 reference gradient against float64 differences
# Each new shape compiles a forward and a backward (~2-4 s on 2 cores): the quick tier
# (-m "not slow") keeps the cases that no other quick test covers.
SLOW = pytest.mark.slow


def _weights(rng, out_shape, lse_shape):
    return rng.standard_normal(out_shape), rng.standard_normal(lse_shape)


def _oracle_loss(oracle_out_lse, w_out, w_lse) -> float:
    out, lse = oracle_out_lse
    return float(np.sum(w_out * out) + np.sum(np.where(np.isfinite(lse), w_lse * lse, 0.0)))


def _ref_grad(q, kv, call, w_out, w_lse):
    """``d loss / d (q, kv)`` of the reference, float32, HIGHEST precision."""

    def loss(q, kv):
        out, lse = call(q, kv)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(w_out * out) + jnp.sum(w_lse * finite)

    with jax.default_matmul_precision("highest"):
        return jax.grad(loss, argnums=(0, 1))(
            jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32)
        )


def _fd_elementwise(f, x):
    """Central differences of ``f`` at every element of ``x`` (float64)."""
    x = np.array(x, np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        keep = x[i]
        x[i] = keep + EPS
        up = f(x)
        x[i] = keep - EPS
        down = f(x)
        x[i] = keep
        g[i] = (up - down) / (2 * EPS)
    return g


def _assert_grad_close(got, want, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{name}: non-finite gradient"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    mx = np.max(np.abs(got - want))
    assert err < GRAD_RTOL, f"{name}: rel L2 {err:.3g} >= {GRAD_RTOL} (max-abs {mx:.3g})"
    assert mx < 10 * GRAD_RTOL * max(np.max(np.abs(want)), 1e-30), f"{name}: max-abs {mx:.3g}"


# ------------------------------------------------------------------------- flat mode

FLAT = dict(batch=2, seq=7, heads=2, kv_len=22, top_k=3)
DV, ROPE = 8, 4


def _flat_call(idx, pos, rb, **kw):
    def call(q, kv):
        return sparse_mla_attention(
            q, kv, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=rb, return_lse=True,
            **kw,
        )  # fmt: skip

    return call


def _flat_oracle(idx, pos, rb):
    return lambda q, kv: sparse_mla_oracle_flat(q, kv, idx, pos, SCALE, DV, rb)


def _flat_inputs(seed, rb):
    if rb > 1:
        return sparse_mla_flat_case(seed, dk=DV + ROPE, rb=rb, **FLAT)
    rng = rng_for(seed)
    b, s, h, t, k = (FLAT[n] for n in ("batch", "seq", "heads", "kv_len", "top_k"))
    q = randn(rng, (b, s, h, DV + ROPE))
    kv = randn(rng, (b, t, DV + ROPE))
    idx = rng.integers(-1, t + 3, size=(b, s, 2 * k)).astype(np.int32)  # tokens, some past T
    idx[0, 0, 1] = idx[0, 0, 0]  # a duplicate token
    idx[1, 2] = -1  # nothing selected
    pos = rng.integers(0, t + 4, size=(b, s)).astype(np.int32)
    return q, kv, idx, pos


# tokens (read_block 1: the same gather with one-token units) in the full tier.
@pytest.mark.parametrize("rb", [4, pytest.param(1, marks=SLOW)], ids=["units", "tokens"])
def test_flat_gradient_matches_finite_differences_elementwise(rb):
    """Every element of dq and dkv (out and lse weighted) against float64 differences of
    the oracle; the edge cases (-1, duplicates, out of range, empty queries, kv_len
    binding, a selection after its query) are in the inputs."""
    q, kv, idx, pos = _flat_inputs(3, rb)
    rng = rng_for(4)
    w_out, w_lse = _weights(rng, (*q.shape[:3], DV), q.shape[:3])
    dq, dkv = _ref_grad(q, kv, _flat_call(idx, pos, rb), w_out, w_lse)
    oracle = _flat_oracle(idx, pos, rb)
    q64, kv64 = q.astype(np.float64), kv.astype(np.float64)
    want_dq = _fd_elementwise(lambda x: _oracle_loss(oracle(x, kv64), w_out, w_lse), q64)
    want_dkv = _fd_elementwise(lambda x: _oracle_loss(oracle(q64, x), w_out, w_lse), kv64)
    _assert_grad_close(dq, want_dq, "dq")
    _assert_grad_close(dkv, want_dkv, "dkv")
    # The oracle's differences are 0 on rows no query attends, and so is the gradient.
    keep = attended_rows_flat(idx, pos, kv_len=FLAT["kv_len"], read_block=rb)
    assert np.all(np.asarray(dkv)[~keep] == 0.0) and (~keep).any()


def test_lse_alone_is_differentiable():
    """A loss on the LSE only (a z-loss): d lse / d s is the softmax, so d/dq of
    sum(lse) is sum_t p_t k_t * scale; checked against differences of the oracle."""
    q, kv, idx, pos = _flat_inputs(5, 4)
    w_out = np.zeros((*q.shape[:3], DV))
    w_lse = rng_for(6).standard_normal(q.shape[:3])
    dq, dkv = _ref_grad(q, kv, _flat_call(idx, pos, 4), w_out, w_lse)
    oracle = _flat_oracle(idx, pos, 4)
    kv64 = kv.astype(np.float64)
    want = _fd_elementwise(lambda x: _oracle_loss(oracle(x, kv64), w_out, w_lse), q)
    _assert_grad_close(dq, want, "dq")
    assert np.abs(np.asarray(dkv)).max() > 0


def _dedupe_by_hand(idx):
    out = np.array(idx, copy=True)
    for i in np.ndindex(idx.shape[:-1]):
        seen = set()
        for k in range(idx.shape[-1]):
            if int(idx[i][k]) in seen:
                out[i][k] = -1
            seen.add(int(idx[i][k]))
    return out


# ~2 s each on 2 cores (a compile of the doubled selection): in the full tier; quick, the
# finite-difference test's inputs hold duplicates, and the forward's set semantics are
# checked by test_sparse_mla_reference.py::test_duplicates_and_order_are_a_set.
@pytest.mark.parametrize("rb", [4, 1], ids=["units", "tokens"])
@SLOW
def test_duplicates_contribute_once(rb):
    """Every id listed twice (and shuffled): the gradients of the deduplicated selection,
    bit for bit (the reference drops later copies before gathering)."""
    q, kv, idx, pos = _flat_inputs(7, rb)
    doubled = np.concatenate([idx, idx[..., ::-1]], axis=-1)
    w = _weights(rng_for(8), (*q.shape[:3], DV), q.shape[:3])
    got = _ref_grad(q, kv, _flat_call(doubled, pos, rb), *w)
    want = _ref_grad(q, kv, _flat_call(_dedupe_by_hand(doubled), pos, rb), *w)
    for g, x in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
    plain = _ref_grad(q, kv, _flat_call(idx, pos, rb), *w)
    for g, x in zip(got, plain, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=1e-5, atol=1e-6)


def test_empty_queries_get_zero_gradient():
    """All -1, only out-of-range ids, a position before every selected token: dq is
    exactly 0 for those queries, and they send nothing into dkv."""
    rng = rng_for(9)
    q = randn(rng, (1, 4, 2, DV + ROPE))
    kv = randn(rng, (1, 16, DV + ROPE))
    idx = np.asarray([[[-1, -1], [4, 9], [3, -1], [0, 1]]], np.int32)
    pos = np.asarray([[15, 15, 5, 2]], np.int32)  # query 2 selects tokens 12..15 only
    w = _weights(rng, (1, 4, 2, DV), (1, 4, 2))
    dq, dkv = _ref_grad(q, kv, _flat_call(idx, pos, 4), *w)
    dq, dkv = np.asarray(dq), np.asarray(dkv)
    assert np.all(dq[0, :3] == 0.0) and np.abs(dq[0, 3]).min() > 0
    assert np.all(dkv[0, 3:] == 0.0) and np.abs(dkv[0, :3, :DV]).min() > 0


@pytest.mark.parametrize("rb", [4, pytest.param(1, marks=SLOW)], ids=["units", "tokens"])
def test_flat_unattended_rows_nan_get_exact_zero_gradient(rb):
    """Rows no query attends hold NaN/+Inf/-Inf: their gradient is exactly 0, and every
    output and gradient is bit-identical to the clean cache's (the poison is selected
    away before any product, in the backward too)."""
    q, kv, idx, pos = _flat_inputs(11, rb)
    keep = attended_rows_flat(idx, pos, kv_len=FLAT["kv_len"], read_block=rb)
    dirty = poison_rows(kv, keep, seed=12)
    assert np.isnan(dirty).any() and np.isinf(dirty).any()
    w = _weights(rng_for(13), (*q.shape[:3], DV), q.shape[:3])
    call = _flat_call(idx, pos, rb)
    dq, dkv = (np.asarray(g) for g in _ref_grad(q, dirty, call, *w))
    clean_dq, clean_dkv = (np.asarray(g) for g in _ref_grad(q, kv, call, *w))
    assert np.all(dkv[~keep] == 0.0)
    np.testing.assert_array_equal(dq, clean_dq)
    np.testing.assert_array_equal(dkv, clean_dkv)
    for got, want in zip(call(q, dirty), call(q, kv), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_integer_inputs_get_float0_and_bf16_cotangents_keep_dtype():
    """``jax.vjp`` over every positional input: float0 cotangents for indices and
    positions, q's and kv's own dtypes for theirs (bf16 here), under jit."""
    q, kv, idx, pos = (jnp.asarray(x) for x in _flat_inputs(14, 4))
    q, kv = q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16)

    def f(q, kv, idx, pos):
        return sparse_mla_attention(
            q, kv, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=4, return_lse=True
        )

    (out, lse), vjp = jax.jit(lambda *a: jax.vjp(f, *a))(q, kv, idx, pos)
    dq, dkv, didx, dpos = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
    assert dq.dtype == jnp.bfloat16 and dkv.dtype == jnp.bfloat16
    assert didx.dtype == jax.dtypes.float0 and dpos.dtype == jax.dtypes.float0
    assert didx.shape == idx.shape and dpos.shape == pos.shape
    assert np.isfinite(np.asarray(dq, np.float32)).all()


def test_chunked_backward_equals_one_chunk(monkeypatch):
    """The backward recomputes query chunks (``jax.checkpoint`` inside ``lax.map``):
    with 3-query chunks (the last one padded) the gradient equals the one-chunk run."""
    q, kv, idx, pos = _flat_inputs(15, 4)
    w = _weights(rng_for(16), (*q.shape[:3], DV), q.shape[:3])
    call = _flat_call(idx, pos, 4)
    whole = _ref_grad(q, kv, call, *w)
    per_query = FLAT["top_k"] * 4 * (DV + ROPE)
    monkeypatch.setattr(sparse_mla_xla, "CHUNK_ELEMENTS", 3 * per_query)
    assert (
        sparse_mla_xla._chunk_for(
            sparse_mla_attention.spec(
                q, kv, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=4
            )
        )
        == 3
    )
    chunked = _ref_grad(q, kv, call, *w)
    for a, b in zip(chunked, whole, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def _saved_forward_grad(q, kv, idx, pos, w_out, w_lse, *, chunk=None, **kw):
    """The kernels' backward (``with_xla_backward``: from the saved ``out``/``lse``) around
    the reference's own forward, through ``out`` and the finite ``lse``."""

    def forward(call):
        out, lse, _ = sparse_mla_xla.xla_sparse_mla(call, attn_mass=False)
        return out, lse

    def loss(q, kv):
        call = sparse_mla_attention.spec(q, kv, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, **kw)
        out, lse = sparse_mla_xla.with_xla_backward(forward)(call)
        return jnp.sum(w_out * out) + jnp.sum(w_lse * jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)


@pytest.mark.parametrize("rb", [4, pytest.param(1, marks=SLOW)], ids=["units", "tokens"])
def test_saved_forward_backward_matches_reference(rb, monkeypatch):
    """The backward from the saved ``out``/``lse`` equals the reference's VJP: float32
    within rounding (in one chunk and in 2-query chunks), bfloat16 within the bf16
    products' error; rows no query attends (NaN/Inf) get exactly 0."""
    q, kv, idx, pos = _flat_inputs(40, rb)
    keep = attended_rows_flat(idx, pos, kv_len=kv.shape[1], read_block=rb)
    dirty = poison_rows(kv, keep, seed=41)
    w = _weights(rng_for(42), (*q.shape[:3], DV), q.shape[:3])
    want = _ref_grad(q, dirty, _flat_call(idx, pos, rb), *w)
    got = _saved_forward_grad(q, dirty, idx, pos, *w, read_block=rb)
    per_query = idx.shape[-1] * rb * (DV + ROPE)
    monkeypatch.setattr(sparse_mla_xla, "BACKWARD_CHUNK_ELEMENTS", 2 * per_query)
    chunked = _saved_forward_grad(q, dirty, idx, pos, *w, read_block=rb)
    bf16 = _saved_forward_grad(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(dirty, jnp.bfloat16), idx, pos, *w,
        read_block=rb,
    )  # fmt: skip
    for g, c, b, ref, name in zip(got, chunked, bf16, want, ("dq", "dkv"), strict=True):
        _assert_grad_close(g, ref, name)
        _assert_grad_close(c, ref, name + " chunked")
        b, ref = np.asarray(b, np.float64), np.asarray(ref, np.float64)
        assert b.dtype == np.float64 and np.isfinite(b).all()
        assert np.linalg.norm(b - ref) / np.linalg.norm(ref) < 2e-2, name + " bf16"
    for g in (got[1], chunked[1], bf16[1]):
        rows = np.asarray(g, np.float32).reshape(-1, DV + ROPE)
        assert np.all(rows[~keep.reshape(-1)] == 0.0) and (~keep).any()


# ~5 s on 2 cores: the saved-forward backward is checked quickly in flat mode
# (test_saved_forward_backward_matches_reference).
@SLOW
def test_saved_forward_backward_ragged_dirty_cache():
    """Ragged paged, NaN in unattended rows and in the feature padding: the backward from
    the saved forward equals the reference's VJP; those rows and features get 0."""
    q, cache, idx, pos, tables, layout = _ragged_case(43)
    num_pages = layout["num_pages"]
    keep = attended_rows_ragged(layout, idx[0], pos[0], page_size=PAGE, num_pages=num_pages)
    rows = poison_rows(cache.reshape(num_pages * PAGE, -1), keep, seed=44)
    rows[:, DV + ROPE :] = np.nan
    dirty = rows.reshape(cache.shape)
    w = _weights(rng_for(45), (*q.shape[:3], DV), q.shape[:3])
    want = _ref_grad(q, dirty, _ragged_call(idx, pos, tables), *w)
    got = _saved_forward_grad(q, dirty, idx, pos, *w, read_block=PAGE, page_size=PAGE, **tables)
    for g, ref, name in zip(got, want, ("dq", "dcache"), strict=True):
        _assert_grad_close(g, ref, name)
    dc_rows = np.asarray(got[1]).reshape(num_pages * PAGE, -1)
    assert np.all(dc_rows[~keep] == 0.0) and np.all(dc_rows[:, DV + ROPE :] == 0.0)


# ------------------------------------------------------------------------ ragged mode

PAGE = 16


def _ragged_case(seed, *, dk=DV + ROPE, top_k=3):
    rng = rng_for(seed)
    layout = build_ragged_layout(
        rng, seq_lens=[37, 5, 20], new_lens=[4, 0, 3], extra_pages=[1, 0, 1], page_size=PAGE
    )
    num_q, num_pages = len(layout["q_seq_id"]), layout["num_pages"]
    dk_pad = -(-dk // 128) * 128
    cache = randn(rng, (num_pages, PAGE, 1, dk_pad))
    q = randn(rng, (1, num_q, 2, dk))
    idx = random_page_selection(rng, layout, top_k, PAGE)
    positions = layout["positions"].copy()
    positions[0] += 40  # kv_len binds
    tables = {k: layout[k] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")}
    return q, cache, idx[None], positions[None], tables, layout


def _ragged_call(idx, pos, tables, **kw):
    def call(q, cache):
        return sparse_mla_attention(
            q, cache, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=PAGE,
            page_size=PAGE, return_lse=True, **tables, **kw,
        )  # fmt: skip

    return call


def _ragged_oracle(idx, pos, tables):
    return lambda q, cache: sparse_mla_oracle_ragged(
        q, cache, idx, pos, **tables, page_size=PAGE, sm_scale=SCALE, dv=DV
    )


def _fd_directions(f, x, grad, rng, n):
    """``<grad, v>`` against the central difference of ``f`` along ``n`` random ``v``."""
    x = np.asarray(x, np.float64)
    for _ in range(n):
        v = rng.standard_normal(x.shape)
        want = (f(x + EPS * v) - f(x - EPS * v)) / (2 * EPS)
        got = float(np.sum(np.asarray(grad, np.float64) * v))
        assert abs(got - want) <= GRAD_RTOL * 10 * max(abs(want), 1.0), (got, want)


# The ragged paged tests (~3-5 s each on 2 cores, a compile each) are in the full tier:
# the gradient, its exact zeros on a dirty cache and the mass are checked quickly in flat
# mode, the ragged paged forward against the oracle by test_paged_reference.py.
@SLOW
def test_ragged_gradient_matches_finite_differences():
    """Ragged paged: directional differences of the oracle along random directions of q
    and of the whole paged cache (feature padding included: its gradient is 0)."""
    q, cache, idx, pos, tables, _ = _ragged_case(17)
    w = _weights(rng_for(18), (*q.shape[:3], DV), q.shape[:3])
    dq, dcache = _ref_grad(q, cache, _ragged_call(idx, pos, tables), *w)
    oracle = _ragged_oracle(idx, pos, tables)
    rng = rng_for(19)
    q64, c64 = q.astype(np.float64), cache.astype(np.float64)
    _fd_directions(lambda x: _oracle_loss(oracle(x, c64), *w), q64, dq, rng, 4)
    _fd_directions(lambda x: _oracle_loss(oracle(q64, x), *w), c64, dcache, rng, 4)
    assert np.all(np.asarray(dcache)[..., DV + ROPE :] == 0.0)


@SLOW
def test_ragged_unattended_rows_nan_get_exact_zero_gradient():
    q, cache, idx, pos, tables, layout = _ragged_case(20)
    num_pages = layout["num_pages"]
    keep = attended_rows_ragged(layout, idx[0], pos[0], page_size=PAGE, num_pages=num_pages)
    rows = poison_rows(cache.reshape(num_pages * PAGE, -1), keep, seed=21)
    rows[:, DV + ROPE :] = np.nan  # the feature padding
    dirty = rows.reshape(cache.shape)
    w = _weights(rng_for(22), (*q.shape[:3], DV), q.shape[:3])
    call = _ragged_call(idx, pos, tables)
    dq, dc = (np.asarray(g) for g in _ref_grad(q, dirty, call, *w))
    clean_dq, clean_dc = (np.asarray(g) for g in _ref_grad(q, cache, call, *w))
    dc_rows = dc.reshape(num_pages * PAGE, -1)
    assert np.all(dc_rows[~keep] == 0.0) and np.all(dc_rows[:, DV + ROPE :] == 0.0)
    assert (~keep).any() and np.abs(dc_rows[keep, :DV]).max() > 0
    np.testing.assert_array_equal(dq, clean_dq)
    np.testing.assert_array_equal(dc, clean_dc)


# ------------------------------------------------------------------- attention mass


def _mass_oracle_flat(q, kv, idx, pos, rb):
    """float64 mass by loops: slot k of query (b, s) gets (1/H) sum_h sum over its
    unit's valid tokens of the softmax probability; 0 for -1, out-of-range, repeats."""
    q, kv = np.asarray(q, np.float64), np.asarray(kv, np.float64)
    batch, seq, heads, _ = q.shape
    t_len = kv.shape[1]
    mass = np.zeros(idx.shape)
    for b, s in np.ndindex(batch, seq):
        units = [int(u) for u in idx[b, s]]
        valid_units = {u for u in units if u >= 0 and u * rb < t_len}
        tokens = [t for t in range(t_len) if t // rb in valid_units and t <= pos[b, s]]
        if not tokens:
            continue
        logits = q[b, s] @ kv[b, tokens].T * SCALE  # [H, n]
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        per_token = dict(zip(tokens, p.sum(axis=0) / heads, strict=True))
        seen = set()
        for k, u in enumerate(units):
            if u in valid_units and u not in seen:
                mass[b, s, k] = sum(v for t, v in per_token.items() if t // rb == u)
            seen.add(u)
    return mass


@pytest.mark.parametrize("rb", [4, pytest.param(1, marks=SLOW)], ids=["units", "tokens"])
def test_attn_mass_matches_oracle_and_is_stop_gradient(rb):
    q, kv, idx, pos = _flat_inputs(23, rb)
    out, lse, mass = sparse_mla_attention(
        q, kv, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=rb, return_lse=True,
        return_attn_mass=True,
    )  # fmt: skip
    assert mass.shape == idx.shape and mass.dtype == jnp.float32
    want = _mass_oracle_flat(q, kv, idx, pos, rb)
    np.testing.assert_allclose(np.asarray(mass), want, rtol=1e-5, atol=1e-6)
    sums = np.asarray(mass).sum(-1)
    empty = np.isneginf(np.asarray(lse)).all(-1)
    np.testing.assert_allclose(sums[~empty], 1.0, rtol=1e-5)
    assert np.all(sums[empty] == 0.0) and empty.any()
    # Only out/lse flags change the tuple; out and lse are the same with or without mass.
    out2, mass2 = sparse_mla_attention(
        q, kv, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=rb, return_attn_mass=True
    )
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(mass2), np.asarray(mass))

    # stop_gradient: a loss on the mass alone sends exactly nothing into q or kv.
    def mass_loss(q, kv):
        return jnp.sum(
            sparse_mla_attention(
                q, kv, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=rb,
                return_attn_mass=True,
            )[1] ** 2
        )  # fmt: skip

    dq, dkv = jax.grad(mass_loss, argnums=(0, 1))(q, kv)
    assert not np.asarray(dq).any() and not np.asarray(dkv).any()


@SLOW  # see test_ragged_gradient_matches_finite_differences; empty work (K = 0) forward:
# test_sparse_mla_reference.py::test_empty_work_gives_zeros
def test_attn_mass_ragged_and_empty_work():
    q, cache, idx, pos, tables, layout = _ragged_case(24)
    call = _ragged_call(idx, pos, tables, return_attn_mass=True)
    _, lse, mass = call(q, cache)
    mass = np.asarray(mass)
    assert mass.shape == idx.shape
    # Slots whose page is -1, outside the request, a repeat, or causally empty get 0.
    extents = layout["extents"][layout["q_seq_id"]]
    for i, k in np.ndindex(idx.shape[1:]):
        p = int(idx[0, i, k])
        if p < 0 or p >= extents[i] or p in idx[0, i, :k].tolist():
            assert mass[0, i, k] == 0.0
    nonempty = ~np.isneginf(np.asarray(lse)).all(-1)
    np.testing.assert_allclose(mass.sum(-1)[nonempty], 1.0, rtol=1e-5)
    # Empty work (K = 0): zeros [B, S, 0] in the right place of the tuple.
    out0, mass0 = sparse_mla_attention(
        q, cache, idx[..., :0], pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=PAGE,
        page_size=PAGE, return_attn_mass=True, **tables,
    )  # fmt: skip
    assert mass0.shape == (1, q.shape[1], 0) and not np.asarray(out0).any()


def test_return_attn_mass_is_checked():
    q, kv, idx, pos = _flat_inputs(25, 4)
    with pytest.raises(TypeError, match="return_attn_mass: got 'yes'"):
        sparse_mla_attention(
            q, kv, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, return_attn_mass="yes"
        )


# ---------------------------------------------------------------- hypothesis cases


# ~18 s on 2 cores (a compile per example): the same checks run quickly on fixed inputs
# (test_flat_gradient_matches_finite_differences_elementwise,
# test_flat_unattended_rows_nan_get_exact_zero_gradient, test_attn_mass_matches_oracle_...).
@SLOW
@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    rb=st.sampled_from([1, 2, 5]),
    kv_len=st.integers(1, 17),
    top_k=st.integers(1, 5),
    seq=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_selections(rb, kv_len, top_k, seq, seed):
    """Random selections (-1, repeats, out of range, positions anywhere): a directional
    difference of the oracle matches the gradient, unattended NaN rows get exactly 0,
    and the mass matches the oracle."""
    rng = rng_for(seed)
    units = -(-kv_len // rb)
    q = randn(rng, (1, seq, 2, DV + ROPE))
    kv = randn(rng, (1, kv_len, DV + ROPE))
    idx = rng.integers(-1, units + 2, size=(1, seq, top_k)).astype(np.int32)
    if top_k > 1:
        idx[0, 0, -1] = idx[0, 0, 0]
    pos = rng.integers(-2, kv_len + 3, size=(1, seq)).astype(np.int32)
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=rb)
    dirty = poison_rows(kv, keep, seed=seed)
    w = _weights(rng, (1, seq, 2, DV), (1, seq, 2))
    dq, dkv = _ref_grad(q, dirty, _flat_call(idx, pos, rb), *w)
    assert np.all(np.asarray(dkv)[~keep] == 0.0)
    oracle = _flat_oracle(idx, pos, rb)
    q64, kv64 = q.astype(np.float64), kv.astype(np.float64)
    kv64[~keep] = 0.0  # the oracle never reads them; finite differences need finite rows
    _fd_directions(lambda x: _oracle_loss(oracle(x, kv64), *w), q64, dq, rng, 2)
    dkv_clean = np.where(keep[..., None], np.asarray(dkv), 0.0)
    _fd_directions(lambda x: _oracle_loss(oracle(q64, x), *w), kv64, dkv_clean, rng, 2)
    _, mass = sparse_mla_attention(
        q, dirty, idx, pos, sm_scale=SCALE, kv_lora_rank=DV, read_block=rb,
        return_attn_mass=True,
    )  # fmt: skip
    np.testing.assert_allclose(
        np.asarray(mass), _mass_oracle_flat(q, kv, idx, pos, rb), rtol=1e-5, atol=1e-6
    )
