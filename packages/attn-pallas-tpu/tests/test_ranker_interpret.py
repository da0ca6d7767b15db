"""TPU ranker attention vs the reference, run in Pallas TPU interpret mode on the CPU.

Interpret mode runs the kernels' block pipeline (the scalar-prefetched tables and the
index maps that read them), VMEM scratch and SMEM on the CPU with the race detector on,
out-of-bounds reads raising and uninitialised memory (outputs included) filled with NaN,
so an unwritten output element fails the comparison. Checked against
``attn_reference.ranker_attention`` on the f32 upcast inputs: out, LSE (``-inf`` exactly
on empty rows, out exactly 0 there) and the gradients of a loss whose LSE term is large
enough that a dropped LSE cotangent fails. Conformance cases (those of the Hopper
kernel's tests): unaligned bounds, a block shared by history and candidates, gaps, empty
history / candidates / rows, candidates overlapping the history, every cap, GQA 5:1, odd
S, D = 64 / 128 / 256, bf16 and fp32; the softmax's fixed offset, its row offsets (rows
served, bitwise isolated, or taken from the running-max run) and the running max. The
step tables are also checked against brute force: each tile's index map visits exactly
the blocks holding an allowed pair, each once, with one DMA per visited block, and the
unmasked steps are fully allowed. Packed
bounds ``[B, U, 4]`` (several users per row; the last section): gradients, the packed
step tables against brute force, overlapping users refused.

Shapes are small (interpret mode executes every op one by one; a kernel compiles in a
few seconds and a grid step costs ~35 ms on the CPU). The quick tier runs one case of
each path: against the reference, the forward at the fixed offset (soft_sign 35), the
``"row"`` softmax over poisoned rows (GQA 5:1, every conformance row), its running-max
rerun, the gradients at D = 64 with k / v padded and the packed gradients (a cap, GQA
2:1); the step tables against brute force. The other dtypes, caps, tilings, layouts,
heads-per-program counts and padding cases are ``slow``.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_no_races,
    assert_ranker_close,
    ranker_inputs,
    tpu_interpret,
)
from jax.experimental import checkify

import attn_reference as ref
from attn_common import CapMethod, CapParams, KernelConfig, SegmentBounds, ranker_mask
from attn_common.packed import ranker_mask_packed
from attn_common.spec import ranker_call
from attn_pallas_tpu import ranker_attention, supports
from attn_pallas_tpu.ranker_fwd import (
    TileSteps,
    default_config,
    kv_step_table,
    make_static,
    prepare,
    q_step_table,
    ranker_attention_fwd,
)

INTERPRET = tpu_interpret()
SMALL = KernelConfig(block_q=128, block_kv=128)
CAPS = {
    "none": None,
    "tanh": CapParams(CapMethod.TANH, 5.0),
    "soft_sign": CapParams(CapMethod.SOFT_SIGN, 8.0),
}
# dtype -> (rel L2, max-abs) for out and gradients; LSE max-abs.
TOL = {"float32": (2e-5, 2e-4), "bfloat16": (2e-2, 6e-2)}
GRAD_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
LSE_ATOL = {"float32": 1e-4, "bfloat16": 3e-2}

# Per-row bounds at S = 199 (block 128, two tiles), one row per conformance case.
MIXED_SEQ = 199
MIXED_BOUNDS = np.array(
    [
        [0, 100, 100, 150],  # unaligned: block 0 holds history and candidates
        [17, 60, 130, 190],  # leading padding and a gap between H and C
        [0, 0, 40, 170],  # empty history: candidates attend only themselves
        [0, 128, 128, 128],  # empty candidates, block-aligned history (unmasked path)
        [0, 0, 0, 0],  # all padding: every output 0 / -inf, zero gradients
        [20, 150, 64, MIXED_SEQ],  # candidates overlapping the history, to the end
    ],
    np.int32,
)


def _inputs(seed, batch, seq, q_heads, kv_heads, dim, dtype):
    return [jnp.asarray(x) for x in ranker_inputs(seed, batch, seq, q_heads, kv_heads, dim, dtype)]


def _f32(xs):
    return [x.astype(jnp.float32) for x in xs]


def _check_forward(q, k, v, bounds, *, cap, config=SMALL, forward=None, **kw):
    """``forward``: the public forward at these arguments, jitted, where the test calls
    it more than once (one compile)."""
    dtype = jnp.dtype(q.dtype).name
    if forward is None:
        forward = functools.partial(
            ranker_attention, cap=cap, config=config, return_lse=True, interpret=INTERPRET, **kw
        )
    out, lse = forward(q, k, v, bounds)
    jax.block_until_ready((out, lse))
    assert_no_races()
    want = ref.ranker_attention(*_f32((q, k, v)), bounds, cap=cap, return_lse=True, **kw)
    rtol, atol = TOL[dtype]
    assert_ranker_close(q, (out, lse), want, rtol_l2=rtol, atol=atol, lse_atol=LSE_ATOL[dtype])
    return out, lse


# ------------------------------------------------------------------------ forward


@pytest.mark.parametrize(
    "cap, bounded",
    [
        pytest.param(CapParams(CapMethod.TANH, 30.0), True, marks=pytest.mark.slow),
        (CapParams(CapMethod.SOFT_SIGN, 35.0), True),  # 2C = 101: the rule's edge
        # 2C = 103.9: a running max (quick: test_forward_row_offset_runs_unserved_rows_again)
        pytest.param(CapParams(CapMethod.TANH, 36.0), False, marks=pytest.mark.slow),
        pytest.param(CapParams(CapMethod.SOFT_SIGN, 80.0), False, marks=pytest.mark.slow),
    ],
    ids=["tanh30", "soft_sign35", "tanh36", "soft_sign80"],
)
def test_forward_softmax_offset_at_extreme_logits(cap, bounded):
    """The forward's softmax at a fixed offset (``RankerStatic.softmax_offset``, capped
    logits within ``BOUNDED_ERROR_BITS``) or a running max, at logits pinned to the cap's
    floor (every p at its smallest, 2^-2C), its ceiling, both in one row, and random, over
    V of magnitude 1e-10 (batch row 0) and 1e3 (row 1): out within float32 tolerance of
    the reference plus, on the fixed offset, the documented absolute bound 2^(2C - 126)
    (products below float32's smallest normal flush), LSE within 1e-5 relative."""
    from attn_pallas_tpu.ranker_config import BOUNDED_ERROR_BITS, LOG2E, RankerStatic

    seq, dim = 256, 128
    static = RankerStatic(1, seq, 1, 1, dim, dim**-0.5, cap, block_q=128, block_kv=128)
    c2 = cap.value * LOG2E
    assert (static.softmax_offset is not None) == bounded
    assert bounded == (2 * c2 <= 126 - BOUNDED_ERROR_BITS)
    rng = np.random.default_rng(7)
    k = rng.normal(size=(2, seq, 1, dim)).astype(np.float32)
    k[..., 0] = rng.uniform(1.0, 1.5, size=(2, seq, 1))  # > 0: q's sign pins the logits
    k[..., 1] = np.where(np.arange(seq) < 128, 1.2, -1.2)[:, None]
    q = rng.normal(size=(2, seq, 1, dim)).astype(np.float32)
    q[:, :192] = 0.0
    q[:, :64, :, 0] = -1e4  # rows 0-63: every logit at the floor
    q[:, 64:128, :, 0] = 1e4  # rows 64-127: at the ceiling
    q[:, 128:192, :, 1] = 1e4  # rows 128-191: the ceiling on keys 0-127, the floor after
    v = rng.normal(size=(2, seq, 1, dim)).astype(np.float32)
    v[0] *= 1e-10
    v[1] *= 1e3
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    bounds = jnp.array([[0, seq, seq, seq]] * 2, jnp.int32)
    out, lse = ranker_attention(q, k, v, bounds, cap=cap, config=SMALL, return_lse=True,
                                interpret=INTERPRET)  # fmt: skip
    assert_no_races()
    want, want_lse = ref.ranker_attention(q, k, v, bounds, cap=cap, return_lse=True)
    flush = 2.0 ** (2 * c2 - 126) if bounded else 0.0
    for b in range(2):
        scale = float(jnp.max(jnp.abs(v[b])))
        err = float(jnp.max(jnp.abs(out[b] - want[b])))
        assert err <= 2e-4 * scale + flush, (b, err, scale, flush)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-4)


ROW_CAP = CapParams(CapMethod.SOFT_SIGN, 80.0)  # 2C = 231: the "row" softmax


def _row_fast_path(q, k, v, bounds, cap):
    """The ``"row"`` softmax's kernel alone (no second run): ``(out, lse)`` at ``S``
    (callers check for races: under ``jax.jit`` this runs at trace time)."""
    from attn_pallas_tpu.ranker_fwd import (
        _fwd_padded,
        attended_key_norms,
        from_kernel_layout,
        q_rows,
        to_kernel_layout,
    )

    problem, st, clipped = prepare(q, k, v, bounds, sm_scale=None, cap=cap, config=SMALL)
    assert st.softmax == "row"
    rows = q_rows(st, problem.seq_len)
    out, lse = _fwd_padded(
        to_kernel_layout(q, st, rows), to_kernel_layout(k, st), to_kernel_layout(v, st),
        clipped, attended_key_norms(k, clipped, rows), st=st, interpret=INTERPRET,
    )  # fmt: skip
    out = from_kernel_layout(out, st, problem.q_heads, problem.seq_len)
    return out, lse[:, :, 0, : problem.seq_len]


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_forward_row_offset_serves_rows_bitwise_isolated(dtype):
    """A soft_sign 80 cap (``2C = 231``) takes the ``"row"`` softmax: each query row's
    offset from ``|q_i|`` and the largest norm of the keys it attends. On random inputs
    whose unattended rows hold NaN / Inf / 1e30 (every conformance row of MIXED_BOUNDS,
    GQA 5:1) the kernel serves every row itself (no NaN LSE), the public forward gives its
    results bit for bit and matches the reference, and zeroing every unattended row
    changes no bit: the offsets read only what a row attends."""
    q, k, v = _inputs(5, 6, MIXED_SEQ, 5, 1, 128, dtype)
    bounds = jnp.asarray(MIXED_BOUNDS)
    pos = np.arange(MIXED_SEQ)
    attended = np.asarray(ranker_mask(pos, pos, *(MIXED_BOUNDS[:, t, None] for t in range(4))))
    assert not attended.all() and attended.any()
    junk = np.array([np.nan, np.inf, -np.inf, 1e30], np.float32)
    nobody = ~attended[..., None, None]
    poisoned = [
        jnp.asarray(np.where(nobody, junk[(pos[:, None, None] + n) % 4], np.asarray(x, np.float32)))
        .astype(dtype)
        for n, x in enumerate((q, k, v))
    ]  # fmt: skip
    zeroed = [jnp.asarray(np.where(nobody, 0.0, np.asarray(x, np.float32))).astype(dtype)
              for x in (q, k, v)]  # fmt: skip
    # The fast path and the public forward each jitted (the public one compiled once for
    # both runs): eager operations around the kernel would round differently from fused
    # ones, so both sides run as one program each, as a user's jitted call does.
    fast = jax.jit(functools.partial(_row_fast_path, cap=ROW_CAP))(*poisoned, bounds)
    jax.block_until_ready(fast)
    assert_no_races()
    assert not np.isnan(np.asarray(fast[1])).any(), "a row the kernel should serve was not"
    forward = jax.jit(
        functools.partial(
            ranker_attention, cap=ROW_CAP, config=SMALL, return_lse=True, interpret=INTERPRET
        )
    )
    got = _check_forward(*poisoned, bounds, cap=ROW_CAP, forward=forward)
    clean = forward(*zeroed, bounds)
    for a, b, c in zip(fast, got, clean, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize(
    "cap", [pytest.param(ROW_CAP, marks=pytest.mark.slow), None], ids=["soft_sign80", "none"]
)
def test_forward_row_offset_runs_unserved_rows_again(cap):
    """Rows whose logits all sit far below their bound (past ``row_floor_bits``): under a
    soft_sign 80 cap, logits at the cap's floor while the bound sits at its ceiling
    (``2C = 231`` apart); with no cap, queries whose norm lies along a direction no key
    has (bound ``|q| kmax sm_scale`` near 1e4, logits near 1). The kernel marks exactly
    those attended rows (NaN LSE), and the public forward takes them from a running-max
    run (reference-close, bitwise the running-max kernel's) and every other row from the
    kernel, bit for bit; an attended NaN reaches the output as NaN either way."""
    import dataclasses

    from attn_pallas_tpu import ranker_fwd

    seq, dim = 256, 128
    rng = np.random.default_rng(11)
    k = rng.normal(size=(1, seq, 1, dim)).astype(np.float32)
    q = rng.normal(size=(1, seq, 1, dim)).astype(np.float32)
    if cap is None:  # rows 0-63 (history): |q| ~ 1e4 along dim 0, where no key reaches
        k[..., 0] = 0.0
        q[:, :64, :, 0] = 1e4
    else:  # k > 0 along dim 0, so q's sign pins rows 0-63's logits at the floor
        k[..., 0] = rng.uniform(1.0, 1.5, size=(1, seq, 1))
        q[:, :64, :, 0] = -1e4
    q[:, 200, :, 3] = np.nan  # an attended NaN (a candidate's own query)
    v = rng.normal(size=(1, seq, 1, dim)).astype(np.float32)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    bounds = jnp.array([[0, 160, 160, 230]], jnp.int32)  # rows 230-255 padding
    fast_out, fast_lse = _row_fast_path(q, k, v, bounds, cap)
    assert_no_races()
    redo = np.isnan(np.asarray(fast_lse))[0, 0]
    assert redo[:64].all() and redo[200] and redo.sum() == 65, np.flatnonzero(redo)
    out, lse = ranker_attention(q, k, v, bounds, cap=cap, config=SMALL, return_lse=True,
                                interpret=INTERPRET)  # fmt: skip
    assert_no_races()
    real_make_static = ranker_fwd.make_static

    def running(*a, **kw):
        return dataclasses.replace(real_make_static(*a, **kw), running_max=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ranker_fwd, "make_static", running)
        run_out, run_lse = ranker_attention(q, k, v, bounds, cap=cap, config=SMALL,
                                            return_lse=True, interpret=INTERPRET)  # fmt: skip
    for got, fast, run, axis in ((out, fast_out, run_out, 1), (lse, fast_lse, run_lse, 2)):
        got, fast, run = (np.asarray(x) for x in (got, fast, run))
        np.testing.assert_array_equal(np.compress(redo, got, axis), np.compress(redo, run, axis))
        np.testing.assert_array_equal(np.compress(~redo, got, axis), np.compress(~redo, fast, axis))
    want, want_lse = ref.ranker_attention(q, k, v, bounds, cap=cap, return_lse=True)
    ok = np.ones(seq, bool)
    ok[200] = False
    assert np.isnan(np.asarray(out)[0, 200]).all() and np.isnan(np.asarray(want)[0, 200]).all()
    atol = 2e-4 * float(jnp.max(jnp.abs(v)))  # as the extreme-logits test: pinned logits
    np.testing.assert_allclose(np.asarray(out)[:, ok], np.asarray(want)[:, ok], atol=atol)
    np.testing.assert_allclose(np.asarray(lse)[..., ok], np.asarray(want_lse)[..., ok], rtol=1e-5)


def test_attends_any_is_the_mask_diagonal():
    """``ranker_fwd.attends_any``'s rule, a row attends some key iff it attends itself,
    against the mask over every key, for random and packed bounds."""
    from attn_pallas_tpu.ranker_fwd import attends_any

    rng = np.random.default_rng(3)
    pos = np.arange(64)
    for _ in range(50):
        row = np.sort(rng.integers(0, 65, size=4))
        row = row[[0, 1, 2, 3]] if rng.random() < 0.5 else row[[2, 3, 0, 1]]
        full = np.asarray(ranker_mask(pos[:, None], pos[None, :], *row)).any(axis=1)
        diag = np.asarray(attends_any(tuple(int(x) for x in row), 0, 64))[:, 0]
        np.testing.assert_array_equal(diag, full, err_msg=str(row))
    packed = np.array([[3, 20, 20, 30], [30, 41, 50, 60], [41, 41, 45, 48]], np.int32)
    users = tuple(tuple(int(x) for x in user) for user in packed)
    full = np.asarray(ranker_mask_packed(pos[:, None], pos[None, :], packed)).any(axis=1)
    diag = np.asarray(attends_any(users, 0, 64))[:, 0]
    np.testing.assert_array_equal(diag, full)


@pytest.mark.slow  # D = 64 quick: test_gradient_pads_q_only_below_one_tile
def test_forward_d64_out_only_broadcast_bounds_bf16():
    """D=64 (the transposed layout), bf16, no cap; ``[4]`` bounds broadcast; out only."""
    q, k, v = _inputs(1, 1, 150, 1, 1, 64, "bfloat16")
    bounds = jnp.array([3, 90, 90, 121], jnp.int32)
    out = ranker_attention(q, k, v, bounds, config=SMALL, interpret=INTERPRET)
    assert_no_races()
    want = ref.ranker_attention(*_f32((q, k, v)), bounds)
    assert_close(out, want, **dict(zip(("rtol_l2", "atol"), TOL["bfloat16"], strict=True)))
    got = np.asarray(out, np.float32)
    assert np.all(got[:, :3] == 0.0) and np.all(got[:, 121:] == 0.0)


@pytest.mark.slow  # ~9 s: two interpreted forwards
def test_forward_entry_takes_the_spec():
    """``ranker_fwd.ranker_attention_fwd`` is built on the spec: ``ranker_call``'s
    signature, its refusals, and the public op's forward bit for bit."""
    spec = inspect.signature(ranker_call).parameters
    assert list(inspect.signature(ranker_attention_fwd).parameters) == list(spec)
    q, k, v = _inputs(2, 1, 150, 2, 1, 64, "float32")
    bounds = jnp.array([0, 90, 90, 140], jnp.int32)
    kw = dict(config=SMALL, return_lse=True, interpret=INTERPRET)
    got = ranker_attention_fwd(q, k, v, bounds, **kw)
    want = ranker_attention(q, k, v, bounds, **kw)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(TypeError, match="q: got dtype float16, the TPU ranker kernels take"):
        ranker_attention_fwd(*(x.astype(jnp.float16) for x in (q, k, v)), bounds)
    with pytest.raises(TypeError, match="cap: got str"):
        ranker_attention_fwd(q, k, v, bounds, cap="tanh")


# Slow: the quick gradient case below lowers this forward too (no q-shaped pad in it).
@pytest.mark.slow
@pytest.mark.parametrize(
    ("seq", "dim", "q_padded"),
    [(150, 128, False), (150, 64, False), (100, 128, True), (256, 128, False)],
)
def test_forward_pads_q_only_below_one_tile(seq, dim, q_padded):
    """q and the outputs keep their ``S`` rows where one q tile fits (the last tile runs
    past ``S``): the lowered forward pads only k and v then, and pads q below one tile;
    the outputs keep ``S`` rows and match the reference."""
    q, k, v = _inputs(4, 2, seq, 2, 1, dim, "float32")
    bounds = jnp.array([[0, seq // 2, seq // 2, seq], [3, seq - 9, seq - 9, seq - 1]], jnp.int32)

    def fwd(q, k, v):
        return ranker_attention(q, k, v, bounds, config=SMALL, return_lse=True,
                                interpret=INTERPRET)  # fmt: skip

    hlo = jax.jit(fwd).lower(q, k, v).as_text()
    pads = {line.split("->")[-1].strip() for line in hlo.splitlines() if "stablehlo.pad" in line}
    seq_pad = -(-seq // 128) * 128
    q_pad = f"tensor<2x{seq_pad}x2x{dim}xf32>"
    kv_pad = f"tensor<2x{seq_pad}x1x{dim}xf32>"
    assert any(q_pad in p for p in pads) == q_padded, pads
    assert any(kv_pad in p for p in pads) == (seq != seq_pad), pads
    out, lse = jax.block_until_ready(fwd(q, k, v))
    assert out.shape == q.shape and lse.shape == (2, 2, seq)
    _check_forward(q, k, v, bounds, cap=None)


@pytest.mark.slow
@pytest.mark.parametrize("cap", list(CAPS))
def test_forward_mixed_bounds_gqa5(cap):
    """GQA 5:1, odd S=199, per-row unaligned / shared-block / gapped / empty /
    overlapping bounds; bf16 D=128, fp32 for the no-cap case."""
    dtype = "float32" if cap == "none" else "bfloat16"
    q, k, v = _inputs(2, 6, MIXED_SEQ, 5, 1, 128, dtype)
    _check_forward(q, k, v, jnp.asarray(MIXED_BOUNDS), cap=CAPS[cap])


@pytest.mark.slow
def test_forward_d256_segment_bounds_block_256():
    """D=256, a 256x128 tiling, SegmentBounds from lengths, explicit sm_scale."""
    q, k, v = _inputs(3, 2, 300, 2, 2, 256, "bfloat16")
    bounds = SegmentBounds.from_lengths(jnp.array([200, 37]), jnp.array([40, 150]))
    config = KernelConfig(block_q=256, block_kv=128)
    _check_forward(q, k, v, bounds, cap=CAPS["soft_sign"], config=config, sm_scale=0.05)


# ---------------------------------------------------------------------- gradients


def _loss(fn, bounds, w, *, cap, use_lse, **kw):
    def loss(q, k, v):
        if not use_lse:
            return jnp.sum(fn(q, k, v, bounds, cap=cap, **kw).astype(jnp.float32) * w)
        out, lse = fn(q, k, v, bounds, cap=cap, return_lse=True, **kw)
        # A linear LSE term at the out term's gradient scale (sqrt(D)): dropping the LSE
        # cotangent moves dq and dk far beyond the tolerance (checked below).
        wl = np.sqrt(q.shape[-1]) * jnp.moveaxis(w[..., 0], 1, 2)
        z = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)
        return jnp.sum(out.astype(jnp.float32) * w) + z

    return loss


@functools.partial(jax.jit, static_argnames=("cap", "use_lse"))
def _reference_grads(q, k, v, bounds, w, *, cap, use_lse):
    """The reference's ``(dq, dk, dv)`` of :func:`_loss`, jitted."""
    return jax.grad(_loss(ref.ranker_attention, bounds, w, cap=cap, use_lse=use_lse), (0, 1, 2))(
        q, k, v
    )


def _grad_weights(q, seed):
    return jnp.asarray(np.random.default_rng(seed + 100).standard_normal(q.shape), jnp.float32)


def _kernel_grads(bounds, w, *, cap, use_lse=True):
    """The kernels' jitted ``(dq, dk, dv)`` of :func:`_loss`."""
    kernel_loss = _loss(
        ranker_attention, bounds, w, cap=cap, use_lse=use_lse, config=SMALL, interpret=INTERPRET
    )
    return jax.jit(jax.grad(kernel_loss, argnums=(0, 1, 2)))


def _check_grads(q, k, v, bounds, *, cap, use_lse=True, seed=0, compiled=None):
    """``compiled``: the ``jax.stages.Compiled`` of ``_kernel_grads`` at these inputs
    (weights ``_grad_weights(q, seed)``), where the test has lowered it already."""
    dtype = jnp.dtype(q.dtype).name
    w = _grad_weights(q, seed)
    grads = compiled if compiled is not None else _kernel_grads(bounds, w, cap=cap, use_lse=use_lse)
    got = grads(q, k, v)
    jax.block_until_ready(got)
    assert_no_races()
    up = _f32((q, k, v))
    want = _reference_grads(*up, bounds, w, cap=cap, use_lse=use_lse)
    tol = GRAD_TOL[dtype]
    if use_lse:
        without = _reference_grads(*up, bounds, w, cap=cap, use_lse=False)
        for name, r, r0 in zip(("dq", "dk"), want[:2], without[:2], strict=True):
            r, r0 = np.asarray(r, np.float64), np.asarray(r0, np.float64)
            moved = np.linalg.norm(r - r0) / np.linalg.norm(r)
            assert moved > 10 * tol, f"{name}: the LSE term moves it by only {moved:.3g}"

    arr = (
        SegmentBounds.from_array(bounds).as_array()
        if not isinstance(bounds, SegmentBounds)
        else bounds.as_array()
    )
    arr = np.broadcast_to(np.clip(np.asarray(arr), 0, q.shape[1]), (q.shape[0], 4))
    pos = np.arange(q.shape[1])
    allowed = np.asarray(
        ranker_mask(pos[None, :, None], pos[None, None, :], *(arr[:, i, None, None] for i in range(4)))
    )  # fmt: skip
    row_dead, key_dead = ~allowed.any(axis=2), ~allowed.any(axis=1)
    for name, g, r, dead in zip(("dq", "dk", "dv"), got, want, (row_dead, key_dead, key_dead), strict=True):  # fmt: skip
        assert g.dtype == q.dtype and g.shape == r.shape, name
        g = np.asarray(g.astype(jnp.float32), np.float64)
        r = np.asarray(r, np.float64)
        assert np.all(np.isfinite(g)), f"{name}: non-finite"
        assert np.all(g[dead] == 0.0), f"{name}: nonzero gradient where nothing is allowed"
        err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
        assert err < tol, f"{name}: rel L2 {err:.3g}"
        mx, bound = np.abs(g - r).max(), 5 * tol * np.abs(r).max()
        assert mx <= bound, f"{name}: max-abs {mx:.3g} > {bound:.3g}"
    return got


@pytest.mark.slow  # a 128 x 256 tiling
@pytest.mark.parametrize("grads", [False, True])
def test_padding_past_a_whole_q_tile(grads):
    """A tiling whose ``S_pad`` (``lcm(block_q, block_kv)``) runs a whole q tile past
    ``S`` (S 300, 128 x 256: S_pad 512, q tile 3 starts at 384) pads q: no kernel reads a
    q block past the array (interpret mode raises on it); the forward (and the gradients,
    the dq kernel's q reads) match the reference."""
    q, k, v = _inputs(6, 1, 300, 2, 1, 128, "float32")
    bounds = jnp.array([[0, 200, 200, 290]], jnp.int32)
    wide = KernelConfig(block_q=128, block_kv=256)
    _check_forward(q, k, v, bounds, cap=None, config=wide)
    if not grads:
        return
    w = jnp.ones(q.shape, jnp.float32)
    loss = _loss(ranker_attention, bounds, w, cap=None, use_lse=True, config=wide,
                 interpret=INTERPRET)  # fmt: skip
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert_no_races()
    want = jax.grad(_loss(ref.ranker_attention, bounds, w, cap=None, use_lse=True),
                    argnums=(0, 1, 2))(q, k, v)  # fmt: skip
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, rtol_l2=GRAD_TOL["float32"], atol=5 * GRAD_TOL["float32"])


@pytest.mark.parametrize(
    ("seq", "dim", "q_padded"),
    [
        pytest.param(150, 128, False, marks=pytest.mark.slow),
        (150, 64, False),
        pytest.param(100, 128, True, marks=pytest.mark.slow),
    ],
)
def test_gradient_pads_q_only_below_one_tile(seq, dim, q_padded):
    """The backward keeps q, dO, the LSE, delta' and dq at ``S`` rows as the forward
    does (k and v padded): no q-shaped pad in the lowered gradient where one q tile
    fits; the gradients match the reference and are exactly 0 where nothing is allowed."""
    q, k, v = _inputs(5, 2, seq, 2, 1, dim, "float32")
    bounds = jnp.array([[0, seq // 2, seq // 2, seq], [3, seq - 9, seq - 9, seq - 1]], jnp.int32)
    # The gradient checked below, lowered once: its HLO read here, then compiled and run.
    lowered = _kernel_grads(bounds, _grad_weights(q, seq), cap=None).lower(q, k, v)
    hlo = lowered.as_text()
    pads = {line.split("->")[-1].strip() for line in hlo.splitlines() if "stablehlo.pad" in line}
    seq_pad = -(-seq // 128) * 128
    assert any(f"tensor<2x{seq_pad}x2x{dim}xf32>" in p for p in pads) == q_padded, pads
    assert any(f"tensor<2x{seq_pad}x1x{dim}xf32>" in p for p in pads), pads
    _check_grads(q, k, v, bounds, cap=None, seed=seq, compiled=lowered.compile())


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["tanh", "soft_sign"])
def test_grad_mixed_bounds_gqa5(cap):
    """GQA 5:1 (dK/dV summed over the group in the kernel), odd S, the six per-row
    conformance bounds, z-loss on the LSE; bf16 for soft_sign, fp32 for tanh (no cap:
    ``test_grad_d64_no_cap_out_only_deterministic``)."""
    dtype = "bfloat16" if cap == "soft_sign" else "float32"
    q, k, v = _inputs(4, 6, MIXED_SEQ, 5, 1, 128, dtype)
    _check_grads(q, k, v, jnp.asarray(MIXED_BOUNDS), cap=CAPS[cap], seed=4)


@pytest.mark.slow
def test_grad_d64_no_cap_out_only_deterministic():
    """D=64 (transposed layout), no cap, GQA 2:1, out-only loss (zero LSE cotangent), a
    gap and an all-padding row; two runs give bitwise-identical gradients."""
    q, k, v = _inputs(5, 2, 260, 2, 1, 64, "float32")
    bounds = jnp.array([[5, 140, 200, 250], [0, 0, 0, 0]], jnp.int32)
    g1 = _check_grads(q, k, v, bounds, cap=None, use_lse=False, seed=5)
    w = jnp.asarray(np.random.default_rng(105).standard_normal(q.shape), jnp.float32)
    loss = _loss(
        ranker_attention, bounds, w, cap=None, use_lse=False, config=SMALL,
        interpret=INTERPRET,
    )  # fmt: skip
    g2 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g2, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------- heads per program


ONE_USER = np.array([[17, 100, 100, 150], [0, 60, 80, 140]], np.int32)
PACKED = np.array([[[17, 60, 60, 90], [90, 120, 120, 150]],
                   [[0, 70, 70, 100], [100, 130, 130, 140]]], np.int32)  # fmt: skip


def _fwd_and_grads(q, k, v, bounds, cap, seed, *, grads=True):
    """out, LSE and (``grads``) the three gradients of a loss through out and the LSE,
    as numpy."""
    w = jnp.asarray(np.random.default_rng(seed).standard_normal(q.shape), jnp.float32)
    fwd = ranker_attention(q, k, v, bounds, cap=cap, config=SMALL, return_lse=True,
                           interpret=INTERPRET)  # fmt: skip
    got = list(fwd)
    if grads:
        loss = _loss(ranker_attention, bounds, w, cap=cap, use_lse=True, config=SMALL,
                     interpret=INTERPRET)  # fmt: skip
        got += jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert_no_races()
    return [np.asarray(x) for x in got]


@pytest.mark.slow  # ~30 s; packed gradients quick: test_packed_grads_match_reference_deterministic
@pytest.mark.parametrize(
    ("dim", "bounds", "heads"),
    [(128, PACKED, (4, 1)),
     pytest.param(128, ONE_USER, (4, 2, 1), marks=pytest.mark.slow),
     pytest.param(64, PACKED, (4, 2, 1), marks=pytest.mark.slow)],
)  # fmt: skip
def test_heads_per_program_bitwise(dim, bounds, heads, monkeypatch):
    """The kernels at 4, 2 and 1 query heads a program or dk/dv step (Hq 8, Hkv 2: at 2
    a kv head's group spans two programs) give bitwise the same outputs, LSE and dq,
    and dk / dv within a bf16 rounding (their sum over the heads runs in another order),
    with NaN in the K / V rows nobody attends, and a cap; those rows change nothing
    (bitwise the run with them zeroed), and the outputs match the reference."""
    from attn_pallas_tpu import ranker_config

    q, k, v = _inputs(6, 2, 150, 8, 2, dim, "bfloat16")
    poison = jnp.zeros((2, 150, 1, 1), bool).at[0, :17].set(True)  # rows no query attends
    bounds = jnp.asarray(bounds)
    results = []
    for h in heads:
        monkeypatch.setattr(ranker_config, "MAX_HEADS_PER_PROGRAM", h)
        assert ranker_config.heads_per_program(4, 128, 128, dim) == h
        bad = [jnp.where(poison, jnp.nan, x) for x in (k, v)]
        results.append(_fwd_and_grads(q, *bad, bounds, CAPS["tanh"], seed=6))
    for other in results[1:]:  # out, LSE, dq bitwise; dk / dv summed in another order
        for a, b in zip(results[0][:3], other[:3], strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(results[0][3:], other[3:], strict=True):
            a, b = (np.asarray(x, np.float32) for x in (a, b))
            np.testing.assert_allclose(a, b, rtol=2**-7, atol=2**-7 * np.abs(b).max())
    clean = [jnp.where(poison, 0.0, x) for x in (k, v)]
    for a, b in zip(results[0][:2], _fwd_and_grads(q, *clean, bounds, CAPS["tanh"], seed=6,
                                                   grads=False), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    want = ref.ranker_attention(*_f32((q, *clean)), bounds, cap=CAPS["tanh"], return_lse=True)
    assert_ranker_close(q, results[0][:2], want, rtol_l2=TOL["bfloat16"][0],
                        atol=TOL["bfloat16"][1], lse_atol=LSE_ATOL["bfloat16"])  # fmt: skip


@pytest.mark.slow  # ~24 s; the layout's lowering quick: test_ranker_export_tpu
@pytest.mark.parametrize("bounds", [PACKED, ONE_USER])
def test_heads_major_layout_bitwise(bounds, monkeypatch):
    """Where the device lays q out heads-major (as a v5e does at 20 heads), the kernels
    take the ``[B, H, S, D]`` layout at D = 128: forward, LSE and gradients bitwise those
    of the ``[B, S, H*D]`` view, 2 heads a program. On the CPU the default layout is
    row-major, so the view is kept."""
    from attn_pallas_tpu import ranker_fwd
    from attn_pallas_tpu._compat import default_major_to_minor

    q, k, v = _inputs(7, 2, 150, 4, 2, 128, "bfloat16")
    bounds = jnp.asarray(bounds)
    assert default_major_to_minor(q.shape, q.dtype) == (0, 1, 2, 3)
    assert not ranker_fwd.heads_major(q)
    view = _fwd_and_grads(q, k, v, bounds, CAPS["soft_sign"], seed=7)
    monkeypatch.setattr(ranker_fwd, "default_major_to_minor", lambda shape, dtype: (0, 2, 1, 3))
    _, st, _ = ranker_fwd.prepare(q, k, v, bounds, sm_scale=None, cap=None, config=SMALL)
    assert st.heads_major and not st.flat and st.heads_per_program == 2
    for a, b in zip(view, _fwd_and_grads(q, k, v, bounds, CAPS["soft_sign"], seed=7), strict=True):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ step tables


def _brute_blocks(row, lo, hi, block, seq, *, q_side):
    """Blocks (of the other side) holding an allowed pair for positions [lo, hi)."""
    pos = np.arange(seq)
    if q_side:
        allowed = np.asarray(ranker_mask(pos[lo:hi, None], pos[None, :], *row))
        hit = allowed.any(axis=0)
    else:
        allowed = np.asarray(ranker_mask(pos[:, None], pos[None, lo:hi], *row))
        hit = allowed.any(axis=1)
    return {int(p) // block for p in np.nonzero(hit)[0]}, allowed


@functools.partial(jax.jit, static_argnums=(1,))
def _tables(clipped, st):
    """``kv_step_table`` and ``q_step_table``, jitted: one compile each per shape and
    static (run eagerly, their operations compiled one by one: ~6 s of the test)."""
    return kv_step_table(clipped, st), q_step_table(clipped, st)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _tile_walks(tab, tiles: int, steps: int):
    """Every tile's ``TileSteps`` as the kernels read it (traced table words): total,
    clamped block of each of ``steps`` grid steps, full_lo, full_hi and the block at each
    step, ``[tiles, ...]``."""

    def walk(tile):
        walk = TileSteps(tab, tile)
        j = jnp.arange(steps)
        return walk.total, walk.clamped_block(j), walk.full_lo, walk.full_hi, walk.block_at(j)

    return jax.vmap(walk)(jnp.arange(tiles))


@pytest.mark.parametrize("seed", range(2))
def test_step_tables_visit_once_one_dma_per_block(seed):
    """Index maps driven by the tables: each tile's clamped block sequence covers exactly
    the blocks with an allowed pair, each once (one DMA per visited block: the index
    changes only on a new block); unmasked steps are fully allowed for the tile."""
    rng = np.random.default_rng(seed)
    seq, batch = 517, 8
    lo_hi = np.sort(rng.integers(-5, seq + 5, size=(batch, 4)), axis=1)
    bounds = lo_hi[:, [0, 1, 2, 3]].astype(np.int32)
    bounds[::3, 2:] = bounds[::3, 1:2] + rng.integers(0, 60, size=(len(bounds[::3]), 1))
    bounds[1::4] = bounds[1::4][:, [2, 3, 0, 1]]  # candidates before / inside history
    q = jnp.zeros((batch, seq, 1, 128), jnp.float32)
    for config in (SMALL, KernelConfig(block_q=256, block_kv=128)):
        _, st, clipped = prepare(
            q, q, q, jnp.asarray(bounds), sm_scale=None, cap=None, config=config
        )
        clipped = np.asarray(clipped)
        kv_tab, q_tab = _tables(clipped, st)
        for tab, tiles, block, other, q_side in (
            (kv_tab, st.q_tiles, st.block_q, st.block_kv, True),
            (q_tab, st.kv_tiles, st.block_kv, st.block_q, False),
        ):
            steps_max = st.seq_pad // other
            walks = [np.asarray(w) for w in _tile_walks(tab, batch * tiles, steps_max)]
            for b in range(batch):
                row = tuple(int(x) for x in clipped[b])
                for t in range(tiles):
                    total, blocks, full_lo, full_hi, block_at = (w[b * tiles + t] for w in walks)
                    total = int(total)
                    assert total <= steps_max
                    seq_blocks = [int(x) for x in blocks]
                    visited = seq_blocks[:total]
                    want, allowed = _brute_blocks(
                        row, t * block, (t + 1) * block, other, st.seq_pad, q_side=q_side
                    )
                    assert sorted(visited) == sorted(want) and len(set(visited)) == total
                    dmas = 1 + sum(a != c for a, c in itertools.pairwise(seq_blocks))
                    assert dmas == max(total, 1)
                    for j in range(int(full_lo), int(full_hi)):
                        blk = int(block_at[j])
                        tile = (
                            allowed[:, blk * other : (blk + 1) * other]
                            if q_side
                            else allowed[blk * other : (blk + 1) * other]
                        )
                        assert tile.all(), (b, t, j)


# ------------------------------------------------------------ validation, dispatch


def test_bad_inputs_raise_clear_errors():
    q, k, v = _inputs(6, 1, 64, 2, 1, 128, "float32")
    bounds = jnp.array([0, 32, 32, 48], jnp.int32)
    with pytest.raises(TypeError, match="q: got dtype float16"):
        ranker_attention(*(x.astype(jnp.float16) for x in (q, k, v)), bounds)
    q96, k96, v96 = _inputs(6, 1, 64, 2, 1, 96, "float32")
    with pytest.raises(NotImplementedError, match="head dim 96"):
        ranker_attention(q96, k96, v96, bounds)
    with pytest.raises(ValueError, match=r"config.block_kv: got 64, .*multiple of 128"):
        ranker_attention(q, k, v, bounds, config=KernelConfig(block_q=128, block_kv=64))
    with pytest.raises(ValueError, match=r"config.programs: got 132, expected 0 \(a Hopper"):
        ranker_attention(q, k, v, bounds, config=KernelConfig(128, 128, programs=132))
    with pytest.raises(ValueError, match=r"config.compute_registers: got 240, expected 0"):
        ranker_attention(q, k, v, bounds, config=KernelConfig(128, 128, compute_registers=240))
    with pytest.raises(ValueError, match="expected Hq % Hkv == 0"):
        ranker_attention(q, k[:, :, :0], v[:, :, :0], bounds)
    with pytest.raises(ValueError, match="bounds"):
        ranker_attention(q, k, v, jnp.zeros((3, 4), jnp.int32))


def test_supports_and_default_config():
    q = jax.ShapeDtypeStruct((1, 8, 2, 128), jnp.bfloat16)
    assert supports("ranker_attention", q) is None
    assert "float16" in supports(
        "ranker_attention", jax.ShapeDtypeStruct((1, 8, 2, 128), jnp.float16)
    )
    assert "head dim" in supports(
        "ranker_attention", jax.ShapeDtypeStruct((1, 8, 2, 32), jnp.bfloat16)
    )
    assert supports("sparse_mla_attention", q) is None
    assert default_config(1152).block_q == 384
    assert default_config(5120).block_q == 640
    assert default_config(640).block_q == 640
    st = make_static(
        prepare(q, q, q, jnp.zeros((4,), jnp.int32), sm_scale=None, cap=None, config=None)[0],
        default_config(8),
    )
    assert st.seq_pad == 128  # S=8 -> one 128 block


# --------------------------------------------------------------------------------------
# Packed bounds [B, U, 4] (several users per row)

PACKED_SEQ = 300  # three 128-blocks, the last partly padding
# Per row U = 4 slots: users back to back sharing blocks, gaps, a user with a gap
# between history and candidates, empty users, padding at the end of the row.
PACKED = np.asarray(
    [
        [[0, 90, 90, 100], [100, 140, 140, 150], [150, 250, 250, 260], [0, 0, 0, 0]],
        [[200, 230, 280, 290], [5, 60, 60, 70], [0, 0, 0, 0], [130, 131, 131, 190]],
    ],
    np.int32,
)
PACKED_CAP = CapParams(CapMethod.SOFT_SIGN, 8.0)


def _packed_inputs(seed):
    return _inputs(seed, 2, PACKED_SEQ, 2, 1, 128, "float32")


def test_packed_grads_match_reference_deterministic():
    q, k, v = _packed_inputs(1)
    w = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape), jnp.float32)
    wl = jnp.asarray(np.random.default_rng(8).standard_normal((2, 2, PACKED_SEQ)), jnp.float32)

    def loss(fn, **kw):
        def f(q, k, v):
            out, lse = fn(q, k, v, jnp.asarray(PACKED), cap=PACKED_CAP, return_lse=True, **kw)
            return jnp.sum(out * w) + 10.0 * jnp.sum(jnp.where(jnp.isfinite(lse), lse * wl, 0.0))

        return f

    kernel = jax.jit(jax.grad(loss(ranker_attention, config=SMALL, interpret=INTERPRET), (0, 1, 2)))
    got = jax.block_until_ready(kernel(q, k, v))
    again = jax.block_until_ready(kernel(q, k, v))
    assert_no_races()
    want = jax.jit(jax.grad(loss(ref.ranker_attention), (0, 1, 2)))(q, k, v)
    for name, g, g2, r in zip(("dq", "dk", "dv"), got, again, want, strict=True):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert np.array_equal(np.asarray(g), np.asarray(g2)), f"{name}: not deterministic"
        assert_close(g, r, rtol_l2=1e-4, atol=1e-3, name=name)


@pytest.mark.slow  # ~13 s (eager table reads)
def test_packed_step_tables_visit_once_one_dma_per_block():
    q = jnp.zeros((2, PACKED_SEQ, 1, 128), jnp.float32)
    for config in (SMALL, KernelConfig(block_q=256, block_kv=128)):
        _, st, clipped = prepare(q, q, q, PACKED, sm_scale=None, cap=None, config=config)
        assert st.packed_users == 4 and st.runs == 8
        clipped = np.asarray(clipped)
        pos = np.arange(st.seq_pad)
        for tab, tiles, block, other, q_side in (
            (kv_step_table(clipped, st), st.q_tiles, st.block_q, st.block_kv, True),
            (q_step_table(clipped, st), st.kv_tiles, st.block_kv, st.block_q, False),
        ):
            tab = np.asarray(tab)
            steps_max = st.seq_pad // other
            for b in range(2):
                allowed = np.asarray(
                    ranker_mask_packed(pos[:, None], pos[None, :], clipped[b])
                )  # [q, k]
                for t in range(tiles):
                    steps = TileSteps(tab, b * tiles + t, st.runs)
                    total = int(steps.total)
                    seq_blocks = [int(steps.clamped_block(j)) for j in range(steps_max)]
                    part = allowed[t * block : (t + 1) * block]
                    if not q_side:
                        part = allowed[:, t * block : (t + 1) * block].T
                    want = {int(p) // other for p in np.nonzero(part.any(axis=0))[0]}
                    visited = seq_blocks[:total]
                    assert sorted(visited) == sorted(want) and len(set(visited)) == total
                    dmas = 1 + sum(a != c for a, c in itertools.pairwise(seq_blocks))
                    assert dmas == max(total, 1)
                    for j in range(int(steps.full_lo), int(steps.full_hi)):
                        blk = int(steps.block_at(j))
                        assert part[:, blk * other : (blk + 1) * other].all(), (b, t, j)


@pytest.mark.slow  # ~6 s in interpret mode
def test_packed_overlap_refused_and_debug_checks():
    q, k, v = _packed_inputs(2)
    bad = PACKED.copy()
    bad[0, 3] = [95, 99, 0, 0]  # inside user 0's candidates
    with pytest.raises(ValueError, match="bounds: row 0: users 0"):
        ranker_attention(q, k, v, bad, config=SMALL, interpret=INTERPRET)

    def f(b):
        return ranker_attention(q, k, v, b, config=SMALL, interpret=INTERPRET, debug_checks=True)

    err, _ = checkify.checkify(jax.jit(f))(jnp.asarray(bad))
    assert "overlapping users: row 0, users 0 and 3" in err.get()
    assert supports("ranker_attention", q, k, v, PACKED) is None
