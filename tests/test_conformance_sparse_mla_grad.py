"""Sparse MLA training conformance: one suite, every backend (``conformance.SPARSE_MLA``).

For each backend (natively, or in Pallas interpret mode on the CPU) and each selection
hypothesis draws (``test_conformance_sparse_mla``'s strategies: -1, duplicate and
out-of-range ids, a query with nothing selected, positions anywhere; ragged layouts with
shuffled pages), on a cache whose unattended rows hold NaN/Inf (and NaN feature padding):

* ``jax.grad`` of a loss on ``out`` and the finite ``lse`` w.r.t. ``q`` and the cache
  against the reference's in float32 at HIGHEST precision on the upcast inputs
  (``GRAD_TOL``: rel L2, and max-abs within 5x that of the largest reference entry);
* the cache gradient exactly 0 on every row no query attends;
* ``return_attn_mass`` against the reference's (max-abs within the LSE tolerance, since
  a kernel's mass is ``exp(s - lse)`` with its own LSE), 0 wherever the reference's is.

The kernels' query-blocked ops run here too. TPU's has a backward of its own
(``attn_pallas_tpu.sparse_mla_qblock_bwd``), run at 8-query blocks (every union of these
shapes fits its partial buffer: the blocked kernels run, not the per-query fallback),
with one generated example in interpret mode; Hopper's is the query-blocked forward
(blocks of 32 queries at these 2 heads) under the per-query backward. The reference's own
gradient is checked against float64 finite differences in ``test_sparse_mla_grad.py``.

The quick tier (``-m "not slow"``) runs the reference's and TPU's plain op, flat at unit
level and ragged paged, each on its explicit edge case only (every example compiles its
own programs: 8-18 s each for TPU's ops in interpret mode here) except the reference's
flat one, which draws one example besides. The query-blocked twins, token level (``read_block=1``) and every Hopper
case are ``slow`` (the Hopper interpreter; the package tests cover its backward); where
the TPU kernels run natively their query-blocked twin is not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import (
    GRAD_TOL,
    SPARSE_LSE_ATOL,
    SPARSE_MLA,
    examples,
    reference_f32,
    slow_off_accelerator,
)
from helpers import (
    attended_rows_flat,
    poison_rows,
    randn,
    rng_for,
    run_interpret,
    sparse_mla_loss_grad,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_conformance_sparse_mla import (
    EXAMPLES,
    FLAT,
    PAGE,
    _flat_edges,
    dirty_ragged_inputs,
    flat_selection,
    layout_dict,
    ragged_layout,
)

import attn_reference as ref

SM_SCALE = 0.07


# The kernel ops and their knobs: TPU's query-blocked op at blocks of 8 queries (Hopper's
# block is set by the heads and ignores the knob).
QBLOCK = ("sparse_mla_attention_qblock", {"query_block": 8})
PLAIN = ("sparse_mla_attention", {})


def _budget(backend, op, mode: str) -> dict:
    """Hypothesis settings off the accelerator: the query-blocked twin takes one generated
    example (its backward also has fixed edge cases in the package's tests), the quick
    tier none but in the reference's flat case (one); natively every op takes
    ``NATIVE_EXAMPLES``."""
    small = min(1, backend.sparse_examples) if op == QBLOCK else backend.sparse_examples
    quick = 1 if backend.name == "reference" and mode == "flat" else 0
    return examples(backend, small, quick=quick)


def _cases(mode: str):
    out = []
    for backend in SPARSE_MLA:
        for rb in [16] if mode == "ragged" else [16, 1]:
            if rb == 1 and not backend.read_block_1:
                continue
            dtype = backend.dtypes[-1]  # bf16 where the backend takes it (the kernels' case)
            ops = [PLAIN, QBLOCK] if backend.name != "reference" and rb > 1 else [PLAIN]
            slow = backend.name == "mosaic-gpu" or (backend.name == "pallas-tpu" and rb == 1)
            for op in ops:
                if slow:
                    marks = [pytest.mark.slow]
                elif rb == 1 or op == QBLOCK:  # run natively (slow_off_accelerator)
                    marks = slow_off_accelerator(backend)
                else:
                    marks = []
                name = f"{backend}-{op[0].removeprefix('sparse_mla_attention') or 'plain'}"
                ident = f"{name}-{dtype}-rb{rb}"
                out.append(pytest.param(backend, op, dtype, rb, id=ident, marks=marks))
    return out


def _reference_grads(q, kv, idx, pos, w_out, w_lse, *, dv: int, **kw):
    """The reference's :func:`helpers.sparse_mla_loss_grad` at ``(q, kv)``, the selection
    and the loss weights as arguments: ``reference_f32`` jits it once per shape and
    static keywords, for every example and backend."""
    grad = sparse_mla_loss_grad(
        ref.sparse_mla_attention, idx, pos, w_out, w_lse, sm_scale=SM_SCALE, dv=dv, **kw
    )
    return grad(q, kv)


@functools.cache
def _kernel_grads(backend, name: str, static: tuple):
    """The backend's :func:`helpers.sparse_mla_loss_grad` with the selection, the loss
    weights and the array keywords (ragged tables) as arguments, jitted once per
    function and static keywords: every example of a shape reuses one compile."""
    fn = getattr(backend.module(), name)
    static = dict(static)

    @jax.jit
    def grads(q, kv, idx, pos, w_out, w_lse, tables):
        return sparse_mla_loss_grad(
            fn, idx, pos, w_out, w_lse, sm_scale=SM_SCALE, dv=backend.sparse_dims[0],
            **tables, **static, **backend.call_kwargs(),
        )(q, kv)  # fmt: skip

    return grads


def _check(backend, op, dtype, q, kv, idx, pos, keep_rows, **kw):
    dv = backend.sparse_dims[0]
    rng = rng_for(7)
    w_out = jnp.asarray(rng.standard_normal((*q.shape[:3], dv)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    name, knobs = op
    tables = {k: a for k, a in kw.items() if hasattr(a, "shape")}
    static = tuple(sorted({**{k: a for k, a in kw.items() if k not in tables}, **knobs}.items()))
    (dq, dkv), (_, _, mass) = run_interpret(
        _kernel_grads(backend, name, static), q, kv, idx, pos, w_out, w_lse, tables
    )
    kv32 = np.asarray(kv, np.float32)
    if kv.ndim == 4:  # the paged cache: a float32 one holds one token per packed row
        kv32 = kv32.reshape(kv.shape[0], -1, 1, kv.shape[-1])
    (want_dq, want_dkv), (_, _, want_mass) = reference_f32(
        _reference_grads, q, kv32, idx, pos, w_out, w_lse, dv=dv, **kw
    )
    want_dkv = np.asarray(want_dkv).reshape(kv.shape)  # same row order
    tol = GRAD_TOL[dtype]
    for name, got, want in (("dq", dq, want_dq), ("dkv", dkv, want_dkv)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.isfinite(got).all(), f"{name}: non-finite gradient"
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        assert err < tol, f"{name}: rel L2 {err:.3g} >= {tol}"
        assert np.abs(got - want).max() <= 5 * tol * max(np.abs(want).max(), 1e-30), name
    rows = np.asarray(dkv, np.float32).reshape(keep_rows.size, -1)
    assert np.all(rows[~keep_rows.reshape(-1)] == 0.0), "an unattended row got a gradient"
    mass, want_mass = np.asarray(mass), np.asarray(want_mass)
    assert mass.shape == idx.shape and mass.dtype == np.float32
    np.testing.assert_allclose(mass, want_mass, atol=SPARSE_LSE_ATOL[dtype])
    assert np.all(mass[want_mass == 0.0] == 0.0)


@pytest.mark.parametrize(("backend", "op", "dtype", "rb"), _cases("flat"))
def test_flat_grad(backend, op, dtype, rb):
    backend.require()
    batch, seq, heads, kv_len, top_k = FLAT[rb]
    dv, rope = backend.sparse_dims

    @settings(EXAMPLES, **_budget(backend, op, "flat"))
    @given(
        sel=flat_selection(batch=batch, seq=seq, kv_len=kv_len, rb=rb, top_k=top_k),
        seed=st.integers(0, 2**31 - 1),
    )
    def check(sel, seed):
        idx, pos = sel
        rng = rng_for(seed)
        q = randn(rng, (batch, seq, heads, dv + rope), dtype)
        kv = randn(rng, (batch, kv_len, dv + rope), dtype)
        keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=rb)
        dirty = poison_rows(kv, keep, seed=seed)
        _check(backend, op, dtype, q, dirty, idx, pos, keep, read_block=rb)

    example(sel=_flat_edges(rb), seed=1)(check)()


@pytest.mark.parametrize(("backend", "op", "dtype", "rb"), _cases("ragged"))
def test_ragged_grad(backend, op, dtype, rb):
    backend.require()
    dv, rope = backend.sparse_dims

    @settings(EXAMPLES, **_budget(backend, op, "ragged"))
    @given(layout=ragged_layout(), seed=st.integers(0, 2**31 - 1))
    @example(layout=layout_dict([5, 0, 7], [40, 3, 7], [10, 3, 7, 0, 8, 1, 5, 9, 2, 4, 6]), seed=1)
    def check(layout, seed):
        q, dirty, idx, positions, keep, tables = dirty_ragged_inputs(
            layout, seed, dv, rope, dtype, bind_kv_len=False
        )
        _check(
            backend, op, dtype, q, dirty, idx[None], positions[None], keep,
            read_block=PAGE, page_size=PAGE, **tables,
        )  # fmt: skip

    check()
