"""Ranker attention conformance: one suite, every backend (``conformance.RANKER``).

Each backend runs as this machine can (natively on its accelerator, in Pallas interpret
mode on the CPU) and is compared against ``attn_reference`` in float32 at HIGHEST
precision on the upcast inputs: out (rel L2 and max-abs per dtype), LSE (``-inf``
exactly on empty rows, out exactly 0 there), and the gradients of a loss whose LSE term
moves dq and dk far beyond the tolerance (a dropped LSE cotangent fails), exactly 0
where nothing is allowed. Interpret mode fills uninitialised memory with NaN and NaN
never passes, so an unwritten output element fails.

Hypothesis draws the bounds (unaligned, empty segments, padding, values outside
``[0, S]``, candidates overlapping the history; packed rows of several users in every
shape, unused slots) and fresh random inputs at fixed small shapes, so a kernel compiles
once per test and each example only runs it. Each test runs an explicit example of the
edge cases first; the forward tests then two derandomized examples (CI is reproducible;
the first is hypothesis's simplest, all-empty bounds; none for the Hopper kernels in the
quick tier, ``Backend.quick_examples``), the fixed-case gradient tests none off the
accelerator (a backward took 45-55 s per run in interpret mode on the shared 2-core
machine) and ``NATIVE_EXAMPLES`` on it; the ``slow`` cases add dtypes and shapes. The
drawn gradient tests (``test_grad_drawn``) run the backward at a smaller shape (B1 S96,
two tiles of 64 with one partly padding, or one of 128 mostly padding) with
hypothesis-drawn packed or plain bounds and inputs: ``Backend.grad_examples`` generated
examples off the accelerator. Where the kernel runs natively they are not generated:
there ``test_grad`` and ``test_grad_packed`` already draw ``NATIVE_EXAMPLES`` bounds per
case from the same strategies, so the drawn test would only add compiles to the GPU suite.

The quick tier (``-m "not slow"``) runs each backend at the first case it takes through
``test_forward_packed`` (packed users, hypothesis-drawn bounds) and ``test_grad`` (plain
bounds, the edge-case example), each compiling its own programs: the plain-bounds forward
runs there as the gradient's primal (its ``out`` and LSE feed the backward). The plain
forward's own test, the packed and drawn gradients, the other cases (dtypes, head dims
with a backward kernel of their own: Hopper's D=256, TPU's D=128) are ``slow``; where the
kernels run natively the plain forward and those head dims' gradients are not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import (
    EXAMPLES,
    GRAD_TOL,
    LSE_ATOL,
    OUT_TOL,
    RANKER,
    examples,
    params,
    reference_f32,
    runs_natively,
    slow_off_accelerator,
)
from helpers import (
    assert_ranker_close,
    randn,
    rng_for,
    run_interpret,
    shaped_packed_bounds,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attn_reference as ref
from attn_common import CapMethod, CapParams
from attn_common.packed import ranker_mask_packed

CAPS = {
    "none": None,
    "tanh": CapParams(CapMethod.TANH, 5.0),
    "soft_sign": CapParams(CapMethod.SOFT_SIGN, 80.0),  # the suite's; the TPU "row" softmax
}


# (dtype, head_dim, cap, batch, seq, q_heads, kv_heads): seq is no multiple of the
# interpret tilings (64, 128), so the last block is partly padding. 5 query heads on 1 kv
# head: the TPU kernels' five heads a program, and on a v5e (which lays [B, S, 5, 128]
# out heads-major) their [B, H, S, D] layout.
CASES = [
    ("bfloat16", 64, "soft_sign", 2, 200, 2, 1),
    ("float32", 128, "tanh", 2, 200, 5, 1),
    ("float16", 64, "none", 2, 200, 2, 1),
    ("bfloat16", 256, "tanh", 1, 136, 4, 1),
    ("bfloat16", 128, "none", 2, 330, 4, 2),
]


def _cases(grad: bool = False, packed: bool = False, quick: bool = True):
    """(backend, case) pairs the backend supports. The quick tier runs the first
    supported case of each backend (none where ``quick`` is False); where the kernels
    run natively it also runs the first case (``quick`` or not) and, for gradients of
    plain rows, the first case of each head dim with a backward kernel of its own
    (Hopper: D=256 is not pipelined; TPU: D=64 is transposed); the others are ``slow``
    (``conformance.slow_off_accelerator``)."""
    out = []
    for backend in RANKER:
        first = True
        kernel_dims = set(backend.grad_kernel_head_dims if grad and not packed else ())
        for case in CASES:
            dtype, dim, cap, *_ = case
            dims = backend.packed_head_dims if packed else None
            ok = backend.takes(dtype=dtype, head_dim=dim, cap=cap)
            ok = ok and (not packed or backend.packed) and (not grad or backend.grad)
            ok = ok and (dims is None or dim in dims)
            if not ok:
                continue
            if first and quick:
                marks = []
            elif first or dim in kernel_dims:
                marks = slow_off_accelerator(backend)
            else:
                marks = [pytest.mark.slow]
            first = False
            kernel_dims.discard(dim)
            out.append(
                pytest.param(backend, case, id=f"{backend}-{dtype}-d{dim}-{cap}", marks=marks)
            )
    return out


# ------------------------------------------------------------------------- strategies


def edge_bounds(batch: int, seq: int) -> np.ndarray:
    """The explicit example every plain-bounds test runs first (hypothesis's first
    generated example is its simplest, all-zero bounds): a block shared by history and
    candidates with trailing padding, leading padding, an empty history, candidates
    overlapping the history up to the end."""
    rows = [
        [0, seq // 2, seq // 2, 3 * seq // 4],
        [10, 37, 37, seq - 10],
        [0, 0, 5, 2 * seq // 3],
        [20, 3 * seq // 4, 64, seq],
    ]
    return np.asarray(rows[:batch], np.int32)


def edge_packed_bounds(batch: int, seq: int) -> np.ndarray:
    """The explicit packed example: three users per row in three shapes, unaligned, with
    gaps and padding (``helpers.shaped_packed_bounds``)."""
    return shaped_packed_bounds(0, batch, seq, users=3)


def _bound(seq: int):
    """A bound: anywhere in [-2, S+2] (clipped by the op), or a block edge / an end."""
    return st.one_of(st.integers(-2, seq + 2), st.sampled_from([0, 64, 128, seq]))


@st.composite
def plain_bounds(draw, batch: int, seq: int):
    """int32 ``[B, 4]``: any (hl, hu, cl, cu), inverted segments being empty."""
    return np.asarray([[draw(_bound(seq)) for _ in range(4)] for _ in range(batch)], np.int32)


@st.composite
def packed_bounds(draw, batch: int, seq: int, slots: int = 3):
    """int32 ``[B, slots, 4]``: per row 1..slots disjoint users at unaligned cut points,
    each in one shape (history then candidates, a gap between them, candidates first,
    candidates overlapping their history), unused slots all zero, slots shuffled."""
    rows = []
    for _ in range(batch):
        users = draw(st.integers(1, slots))
        cuts = sorted(
            draw(st.lists(st.integers(0, seq), min_size=4 * users, max_size=4 * users, unique=True))
        )
        row = []
        for u in range(users):
            a, b, c, d = cuts[4 * u : 4 * u + 4]
            shape = draw(st.integers(0, 3))
            row.append([(a, c, c, d), (a, b, c, d), (c, d, a, b), (a, c, b, d)][shape])
        row += [(0, 0, 0, 0)] * (slots - users)
        rows.append(draw(st.permutations(row)))
    return np.asarray(rows, np.int32)


# --------------------------------------------------------------------------- running


def _inputs(seed, case):
    dtype, dim, _, batch, seq, hq, hkv = case
    rng = rng_for(seed)
    # q and k scaled up so that the soft caps bite.
    q = randn(rng, (batch, seq, hq, dim), dtype, scale=2.0)
    k = randn(rng, (batch, seq, hkv, dim), dtype, scale=2.0)
    v = randn(rng, (batch, seq, hkv, dim), dtype)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def _kwargs(backend):
    kw = backend.call_kwargs()
    if backend.config is not None:
        kw["config"] = backend.config
    return kw


@functools.cache
def _forward(backend, cap: str):
    """The backend's forward, jitted once per (backend, cap): bounds are an argument, so
    every hypothesis example of a shape reuses one compilation."""
    fn = backend.module().ranker_attention
    kw = _kwargs(backend)
    return jax.jit(lambda q, k, v, b: fn(q, k, v, b, cap=CAPS[cap], return_lse=True, **kw))


def _loss(fn, w, cap, use_lse=True, **kw):
    def loss(q, k, v, bounds):
        out, lse = fn(q, k, v, bounds, cap=CAPS[cap], return_lse=True, **kw)
        total = jnp.sum(out.astype(jnp.float32) * w)
        if use_lse:
            # A linear LSE term at the out term's gradient scale (sqrt(D)): a dropped LSE
            # cotangent moves dq and dk far beyond the tolerance (checked).
            wl = np.sqrt(q.shape[-1]) * jnp.moveaxis(w[..., 0], 1, 2)
            total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)
        return total

    return loss


@functools.cache
def _grad(backend, cap: str, shape: tuple):
    w = jnp.asarray(np.random.default_rng(100).standard_normal(shape), jnp.float32)
    loss = _loss(backend.module().ranker_attention, w, cap, **_kwargs(backend))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), w


# Jitted: one compile per shape for every example (eagerly, one per operation).
_mask_packed = jax.jit(ranker_mask_packed)


def _allowed(bounds, seq):
    """bool ``[B, S, S]``: query i may attend key j (plain or packed bounds)."""
    b = np.asarray(bounds)
    if b.ndim == 2:
        b = b[:, None]
    pos = np.arange(seq)
    return np.asarray(_mask_packed(pos[None, :, None], pos[None, None, :], b[:, None, None]))


def check_forward(backend, case, bounds, seed):
    dtype, _, cap, *_ = case
    q, k, v = _inputs(seed, case)
    out, lse = run_interpret(_forward(backend, cap), q, k, v, jnp.asarray(bounds))
    want = reference_f32(
        ref.ranker_attention, q, k, v, jnp.asarray(bounds), cap=CAPS[cap], return_lse=True
    )
    rtol, atol = OUT_TOL[dtype]
    assert_ranker_close(q, (out, lse), want, rtol_l2=rtol, atol=atol, lse_atol=LSE_ATOL[dtype])
    empty = np.moveaxis(np.isneginf(np.asarray(lse)), 1, 2)  # [B, S, Hq]
    dead = ~_allowed(bounds, q.shape[1]).any(axis=2)  # [B, S]: rows with no key
    assert np.array_equal(empty, np.broadcast_to(dead[..., None], empty.shape))


def _reference_grads(q, k, v, bounds, w, *, cap: str):
    """The reference's ``(dq, dk, dv)`` of the loss and ``(dq, dk)`` of its out term
    alone (``reference_f32`` jits it once per shape and cap, for every backend)."""
    fn = ref.ranker_attention
    want = jax.grad(_loss(fn, w, cap), argnums=(0, 1, 2))(q, k, v, bounds)
    without = jax.grad(_loss(fn, w, cap, use_lse=False), argnums=(0, 1))(q, k, v, bounds)
    return want, without


def check_grad(backend, case, bounds, seed):
    dtype, _, cap, *_ = case
    q, k, v = _inputs(seed, case)
    grad, w = _grad(backend, cap, q.shape)
    got = run_interpret(grad, q, k, v, jnp.asarray(bounds))
    want, without = reference_f32(_reference_grads, q, k, v, jnp.asarray(bounds), w, cap=cap)
    tol = GRAD_TOL[dtype]
    allowed = _allowed(bounds, q.shape[1])
    row_dead, key_dead = ~allowed.any(axis=2), ~allowed.any(axis=1)
    for name, r, r0, dead in zip(
        ("dq", "dk"), want[:2], without, (row_dead, key_dead), strict=True
    ):
        r, r0 = np.asarray(r, np.float64), np.asarray(r0, np.float64)
        if np.linalg.norm(r) > 0 and not dead.all():
            moved = np.linalg.norm(r - r0) / np.linalg.norm(r)
            assert moved > 10 * tol, f"{name}: the LSE term moves it by only {moved:.3g}"
    for name, g, r, dead in zip(
        ("dq", "dk", "dv"), got, want, (row_dead, key_dead, key_dead), strict=True
    ):
        assert g.dtype == q.dtype and g.shape == r.shape, name
        g = np.asarray(g.astype(jnp.float32), np.float64)
        r = np.asarray(r, np.float64)
        assert np.all(np.isfinite(g)), f"{name}: {np.sum(~np.isfinite(g))} non-finite values"
        assert np.all(g[dead] == 0.0), f"{name}: nonzero gradient where nothing is allowed"
        if not np.any(r):
            assert not np.any(g), f"{name}: nonzero where the reference is all zero"
            continue
        err = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert err < tol, f"{name}: rel L2 {err:.3g} >= {tol:.3g}"
        mx, bound = np.abs(g - r).max(), 5 * tol * np.abs(r).max()
        assert mx <= bound, f"{name}: max-abs {mx:.3g} > {bound:.3g}"


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("backend", params(RANKER))
def test_supports_flags_agree_with_the_backend(backend):
    """The registry's flags say what the backend's own ``supports`` says."""
    mod = backend.module()
    if not hasattr(mod, "supports"):
        return  # the reference takes every input; its flags list all of them
    for dtype in ("float32", "bfloat16", "float16"):
        for dim in (32, 64, 128, 256):
            q = jax.ShapeDtypeStruct((1, 128, 2, dim), jnp.dtype(dtype))
            k = jax.ShapeDtypeStruct((1, 128, 1, dim), jnp.dtype(dtype))
            bounds = jnp.zeros((1, 4), jnp.int32)
            why = mod.supports("ranker_attention", q, k, k, bounds)
            expected = backend.takes(dtype=dtype, head_dim=dim)
            assert (why is None) == expected, (backend.name, dtype, dim, why)


def _check_drawn(backend, case, layout: str, check_case, small: int) -> None:
    """``check_case(backend, case, bounds, seed)`` over hypothesis-drawn bounds of
    ``layout`` ("plain" or "packed") and seeds, after the layout's edge case; ``small``
    generated examples off the backend's accelerator (``conformance.examples``)."""
    batch, seq = case[3], case[4]
    packed = layout == "packed"
    strategy = packed_bounds(batch, seq) if packed else plain_bounds(batch, seq)
    edge = edge_packed_bounds(batch, seq) if packed else edge_bounds(batch, seq)

    @settings(EXAMPLES, **examples(backend, small))
    @given(bounds=strategy, seed=st.integers(0, 2**31 - 1))
    @example(bounds=edge, seed=0)
    def check(bounds, seed):
        check_case(backend, case, bounds, seed)

    check()


@pytest.mark.parametrize(("backend", "case"), _cases(quick=False))
def test_forward(backend, case):
    """``slow`` in interpret mode: the quick tier runs the plain-bounds forward as
    ``test_grad``'s primal and the forward's own checks in ``test_forward_packed``."""
    backend.require()
    _check_drawn(backend, case, "plain", check_forward, 2)


@pytest.mark.parametrize(("backend", "case"), _cases(packed=True))
def test_forward_packed(backend, case):
    backend.require()
    _check_drawn(backend, case, "packed", check_forward, 2)


@pytest.mark.parametrize(("backend", "case"), _cases(grad=True))
def test_grad(backend, case):
    backend.require()
    _check_drawn(backend, case, "plain", check_grad, 0)


def _grad_packed_cases():
    """As ``_cases(grad=True, packed=True)``, all ``slow`` (so is ``test_grad_drawn``,
    which checks packed gradients at a smaller shape with drawn bounds)."""
    return [
        pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow])
        for p in _cases(grad=True, packed=True)
    ]


@pytest.mark.parametrize(("backend", "case"), _grad_packed_cases())
def test_grad_packed(backend, case):
    backend.require()
    _check_drawn(backend, case, "packed", check_grad, 0)


# Drawn gradients: (layout, cap, case), all ``slow`` (the quick tier checks gradients in
# ``test_grad``): packed rows with the soft cap (several users per row, unaligned, gaps,
# padding, unused slots), plain bounds, the other caps and a larger shape (GQA 2:1,
# D 128, three tiles of 64).
# Tolerances are GRAD_TOL's: bf16 inputs against the float32 reference on the same
# (upcast) inputs. The gradients come back in bf16, whose rounding alone (2^-9 relative
# per element) gives a rel L2 error of about 2.5e-3; measured with the edge-case and
# shaped packed bounds at B1 S96: 2.5e-3 to 3.1e-3 for dq/dk/dv of both kernels in
# interpret mode. 3e-2 leaves a 10x margin for the kernels' bf16 P and dS, while a wrong
# mask, a dropped row, a missing GQA reduction or a dropped LSE cotangent (checked to move
# dq/dk by more than 10x the tolerance) each give errors of order 1; max-abs is bounded at
# 5x the tolerance times the largest reference gradient.
DRAWN_GRAD = [
    ("packed", "soft_sign", ("bfloat16", 64, "soft_sign", 1, 96, 2, 1)),
    ("plain", "soft_sign", ("bfloat16", 64, "soft_sign", 1, 96, 2, 1)),
    ("packed", "tanh", ("bfloat16", 64, "tanh", 1, 96, 2, 1)),
    ("packed", "none", ("bfloat16", 64, "none", 1, 96, 2, 1)),
    ("packed", "tanh", ("bfloat16", 128, "tanh", 2, 200, 4, 2)),
]


def _drawn_grad_cases():
    out = []
    for backend in RANKER:
        if runs_natively(backend):
            continue  # test_grad / test_grad_packed draw their bounds there (docstring)
        for layout, cap, case in DRAWN_GRAD:
            dtype, dim = case[:2]
            dims = backend.packed_head_dims if layout == "packed" else None
            if not (backend.grad and backend.takes(dtype=dtype, head_dim=dim, cap=cap)):
                continue
            if layout == "packed" and not (backend.packed and (dims is None or dim in dims)):
                continue
            name = f"{backend}-{layout}-{cap}-d{dim}-s{case[4]}"
            out.append(pytest.param(backend, layout, case, id=name, marks=pytest.mark.slow))
    return out


@pytest.mark.parametrize(("backend", "layout", "case"), _drawn_grad_cases())
def test_grad_drawn(backend, layout, case):
    """dq, dk, dv of each backend against the reference, hypothesis drawing the bounds
    (packed users or plain segments, out-of-range values, padding) and the inputs."""
    backend.require()
    _check_drawn(backend, case, layout, check_grad, backend.grad_examples)
