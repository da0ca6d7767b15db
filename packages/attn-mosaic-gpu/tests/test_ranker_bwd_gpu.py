"""H200 checks of the Hopper ranker backward (skipped unless JAX's default backend is GPU).

``jax.grad`` of ``attn_mosaic_gpu.ranker_attention`` under ``jit`` (loss on ``out`` plus
a z-loss on the LSE) against ``jax.grad`` of ``attn_reference.ranker_attention`` on the
f32 upcast inputs, at reduced-batch versions of the benchmark suite shapes, D 64 /
128 / 256, bf16 and fp16, every cap, GQA 5:1, unaligned / per-row / empty / padding
bounds: rel L2 per tensor, no NaN, exact zeros where nothing is allowed. Plus
determinism: two runs give bitwise identical dq, dk, dv.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_ranker_grads,
    check_ranker_grads,
    packed_user_bounds,
    ranker_dead,
    ranker_grad_loss,
    ranker_kernel_inputs,
    ranker_reference_grads,
)

from attn_common import CapMethod, CapParams, KernelConfig
from attn_mosaic_gpu import ranker_attention
from attn_mosaic_gpu.tuning import BackwardTuning

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a GPU (Hopper) backend"
)

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 1e-2}
NONE = None
TANH30 = CapParams(CapMethod.TANH, 30.0)
TANH5 = CapParams(CapMethod.TANH, 5.0)
SS80 = CapParams(CapMethod.SOFT_SIGN, 80.0)
SS8 = CapParams(CapMethod.SOFT_SIGN, 8.0)


def _kernel_grad(cap, use_lse, **kw):
    def loss(q, k, v, bounds, w):
        return ranker_grad_loss(
            ranker_attention, q, k, v, bounds, w, cap=cap, use_lse=use_lse, **kw
        )

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _check_grads(q, k, v, bounds, *, cap, use_lse=True, seed=0, **kw):
    w = jnp.asarray(np.random.default_rng(seed + 100).standard_normal(q.shape), jnp.float32)
    got = _kernel_grad(cap, use_lse, **kw)(q, k, v, bounds, w)
    check_ranker_grads(got, q, k, v, bounds, w, cap=cap, use_lse=use_lse, tol=TOL[q.dtype.type])


def _suite_bounds(name, batch, seq, seed=0):
    if name == "phoenix":
        return jnp.tile(jnp.array([[0, 1024, 1024, 1088]], jnp.int32), (batch, 1))
    if name == "long":
        return jnp.tile(jnp.array([[0, 4096, 4096, 5120]], jnp.int32), (batch, 1))
    if name == "small-d64":
        return jnp.tile(jnp.array([[0, 512, 512, 640]], jnp.int32), (batch, 1))
    if name == "ragged":
        h = np.random.default_rng(seed).integers(126, 1023, size=batch)
        return jnp.asarray(np.stack([0 * h, h, h, h + 64], axis=1), jnp.int32)
    raise ValueError(name)


# name, B, S, Hq, Hkv, D, cap, dtype, use_lse
SUITE = [
    ("phoenix", 4, 1152, 20, 4, 128, SS80, jnp.bfloat16, True),
    ("phoenix", 2, 1152, 20, 4, 128, SS8, jnp.float16, False),
    ("long", 1, 5120, 16, 16, 128, TANH30, jnp.bfloat16, True),
    ("small-d64", 8, 640, 8, 8, 64, NONE, jnp.bfloat16, False),
    ("small-d64", 4, 640, 8, 8, 64, TANH5, jnp.float16, True),
    ("ragged", 6, 1152, 20, 4, 128, SS80, jnp.bfloat16, True),
]


@pytest.mark.parametrize(
    "name,batch,seq,q_heads,kv_heads,head_dim,cap,dtype,use_lse",
    SUITE,
    ids=[f"{s[0]}-{jnp.dtype(s[7]).name}" for s in SUITE],
)
def test_grad_suite_shapes(name, batch, seq, q_heads, kv_heads, head_dim, cap, dtype, use_lse):
    q, k, v = ranker_kernel_inputs(0, batch, seq, q_heads, kv_heads, head_dim, dtype)
    _check_grads(q, k, v, _suite_bounds(name, batch, seq), cap=cap, use_lse=use_lse)


EDGE_BOUNDS = jnp.array(
    [
        [0, 700, 700, 780],  # history and candidates share a block (unaligned)
        [13, 333, 333, 997],  # leading and trailing padding rows
        [0, 0, 5, 600],  # empty history: candidates attend only themselves
        [0, 900, 900, 900],  # empty candidates
        [0, 0, 0, 0],  # all padding: every gradient of the row is 0
        [100, 800, 400, 1000],  # candidates overlapping the history
    ],
    jnp.int32,
)


@pytest.mark.parametrize(
    "head_dim,cap,dtype",
    [
        (64, SS8, jnp.bfloat16),
        (128, TANH5, jnp.float16),
        (128, NONE, jnp.bfloat16),
        (256, TANH5, jnp.bfloat16),
        (256, SS8, jnp.float16),
    ],
    ids=["d64-ss-bf16", "d128-tanh-fp16", "d128-none-bf16", "d256-tanh-bf16", "d256-ss-fp16"],
)
def test_grad_edge_bounds_gqa5(head_dim, cap, dtype):
    """S=1000 (unaligned), GQA 5:1, per-row edge-case bounds, LSE z-loss."""
    q, k, v = ranker_kernel_inputs(1, 6, 1000, 10, 2, head_dim, dtype)
    _check_grads(q, k, v, EDGE_BOUNDS, cap=cap, seed=1)


@pytest.mark.parametrize("head_dim,cap", [(128, SS80), (64, TANH5)], ids=["d128", "d64"])
def test_grad_lone_tiles(head_dim, cap):
    """Tiles with one live half: the live rows first with an odd step count, second
    with one step, candidates only; GQA 5:1, LSE z-loss."""
    bounds = jnp.asarray(
        [[0, 300, 300, 320], [70, 120, 120, 127], [0, 0, 200, 230], [0, 1090, 1090, 1100]],
        jnp.int32,
    )
    q, k, v = ranker_kernel_inputs(2, 4, 1152, 10, 2, head_dim, jnp.bfloat16)
    _check_grads(q, k, v, bounds, cap=cap, seed=2)


@pytest.mark.parametrize(
    "head_dim,cap,tuning",
    [
        (128, SS80, BackwardTuning(exp2_fma_cols=32, rcp_fma_cols=64)),
        (128, SS8, BackwardTuning(num_stages=3, exp2_fma_cols=64, rcp_fma_cols=16)),
        (128, TANH5, BackwardTuning(exp2_fma_cols=48)),
        (64, NONE, BackwardTuning(exp2_fma_cols=16)),
    ],
    ids=["d128-ss80-32-64", "d128-ss8-64-16-s3", "d128-tanh5-48", "d64-none-16"],
)
def test_grad_fma_split_knobs(head_dim, cap, tuning):
    """exp2 / soft_sign reciprocal on the FMA pipe in the backward kernels (and the
    forward: the same split in its config), GQA 5:1 edge bounds, LSE z-loss."""
    q, k, v = ranker_kernel_inputs(3, 6, 1000, 10, 2, head_dim, jnp.bfloat16)
    config = KernelConfig(64, 128, 2, exp2_fma_cols=tuning.exp2_fma_cols)
    _check_grads(q, k, v, EDGE_BOUNDS, cap=cap, seed=3, backward_tuning=tuning, config=config)


PERSISTENT_DQ_CASES = [
    ("phoenix-ss80-132", 128, SS80, "suite", 132),
    ("edge-tanh5-7", 128, TANH5, "edge", 7),
    ("edge-d64-none-132", 64, NONE, "edge", 132),
    ("packed-ss80-132", 128, SS80, "packed", 132),
]


@pytest.mark.parametrize(
    "head_dim,cap,layout,programs", [c[1:] for c in PERSISTENT_DQ_CASES],
    ids=[c[0] for c in PERSISTENT_DQ_CASES],
)  # fmt: skip
def test_grad_persistent_dq(head_dim, cap, layout, programs):
    """Persistent dq programs (``dq_programs``; 132 = one per H200 SM, 7 = many tiles per
    program): gradients against the reference, and bitwise the per-tile dq (the steps of
    a tile run in the same order); GQA 5:1, LSE z-loss; suite, edge (empty segments,
    padding rows, zero-step tiles) and packed bounds."""
    seq = 1152 if layout in ("suite", "packed") else 1000
    bounds = {
        "suite": _suite_bounds("phoenix", 4, seq),
        "edge": EDGE_BOUNDS,
        "packed": packed_user_bounds(17, 4, seq) if layout == "packed" else None,
    }[layout]
    tuning = BackwardTuning(dq_programs=programs)
    q, k, v = ranker_kernel_inputs(21, bounds.shape[0], seq, 10, 2, head_dim, jnp.bfloat16)
    _check_grads(q, k, v, bounds, cap=cap, seed=21, backward_tuning=tuning)
    w = jnp.asarray(np.random.default_rng(121).standard_normal(q.shape), jnp.float32)
    got = _kernel_grad(cap, True, backward_tuning=tuning)(q, k, v, bounds, w)
    want = _kernel_grad(cap, True, backward_tuning=BackwardTuning())(q, k, v, bounds, w)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), name


@pytest.mark.parametrize(
    "head_dim,cap,layout",
    [(128, SS80, "packer"), (64, TANH5, "packer"), (128, SS80, "shapes"), (64, None, "shapes")],
    ids=["d128-ss80", "d64-tanh5", "d128-ss80-shapes", "d64-shapes"],
)
def test_grad_packed_users(head_dim, cap, layout):
    """Packed rows [B, U, 4] at S=1152, GQA 5:1, LSE z-loss: gradients against the
    reference, exact zeros where nothing is allowed (the packed mask), determinism.
    ``packer``: rows from attn_common.pack_users; ``shapes``: every user shape (gaps,
    candidates first, a user's own history and candidates overlapping), shuffled slots."""
    from helpers import shaped_packed_bounds

    seq = 1152
    if layout == "packer":
        bounds = packed_user_bounds(13, 4, seq)
    else:
        bounds = jnp.asarray(shaped_packed_bounds(22, 4, seq))
    q, k, v = ranker_kernel_inputs(13, 4, seq, 10, 2, head_dim, jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(14).standard_normal(q.shape), jnp.float32)
    grad = _kernel_grad(cap, True)
    got = grad(q, k, v, bounds, w)

    want = ranker_reference_grads(q, k, v, bounds, w, cap=cap, use_lse=True)
    dead = ranker_dead(bounds, q.shape[0], seq)
    assert_ranker_grads(got, want, dead, dtype=q.dtype, tol=TOL[jnp.bfloat16])
    again = grad(q, k, v, bounds, w)
    for name, a, b in zip(("dq", "dk", "dv"), got, again, strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), name


@pytest.mark.parametrize("head_dim", [128, 64])
def test_grad_soft_sign_huge_scores(head_dim):
    """soft_sign 80: scores up to ~1e18 (``helpers.huge_keys``; keys up to 1e20 put dq
    0.35 rel L2 from the float32 reference in interpret mode: the bf16 backward's limit
    at such scores)."""
    from helpers import huge_keys

    q, k, v = ranker_kernel_inputs(31, 2, 384, 10, 2, head_dim, jnp.bfloat16)
    k = jnp.asarray(huge_keys(k.astype(jnp.float32), seed=32, max_exp=16)).astype(jnp.bfloat16)
    bounds = jnp.asarray([[0, 256, 256, 320], [0, 200, 230, 352]], jnp.int32)
    _check_grads(q, k, v, bounds, cap=SS80)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_grad_deterministic(head_dim):
    """Same inputs -> bitwise identical dq, dk, dv (no atomics; fixed GQA order)."""
    q, k, v = ranker_kernel_inputs(2, 4, 1152, 20, 4, head_dim, jnp.bfloat16)
    bounds = _suite_bounds("ragged", 4, 1152, seed=2)
    w = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape), jnp.float32)
    grad = _kernel_grad(SS80, True)
    first = [np.asarray(x) for x in grad(q, k, v, bounds, w)]
    for _ in range(2):
        again = [np.asarray(x) for x in grad(q, k, v, bounds, w)]
        for name, a, b in zip(("dq", "dk", "dv"), first, again, strict=True):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), f"{name} differs"


# name, B, S, Hq, Hkv, D, cap, dtype, bounds [B, 4] or [B, U, 4]
ISOLATION_CASES = [
    ("phoenix-ragged", 4, 1152, 20, 4, 128, SS80, jnp.bfloat16, None),
    ("small-d64-gap", 4, 640, 8, 8, 64, NONE, jnp.float16, [[0, 300, 330, 400]] * 4),
    ("long-tanh", 1, 5120, 16, 16, 128, TANH30, jnp.bfloat16, [[100, 4000, 4000, 4500]]),
    ("d256", 2, 1000, 16, 4, 256, TANH5, jnp.bfloat16, [[0, 700, 700, 760], [30, 500, 600, 640]]),
    (
        "packed-d128",
        2,
        1152,
        20,
        4,
        128,
        SS80,
        jnp.bfloat16,
        [[[0, 300, 300, 340], [340, 800, 800, 864]], [[0, 100, 100, 164], [164, 1000, 1000, 1100]]],
    ),
]


@pytest.mark.parametrize(
    "name,batch,seq,q_heads,kv_heads,head_dim,cap,dtype,bounds",
    ISOLATION_CASES,
    ids=[c[0] for c in ISOLATION_CASES],
)
def test_isolation_poisoned_rows(name, batch, seq, q_heads, kv_heads, head_dim, cap, dtype, bounds):
    """Isolation at real sizes with the tuned configs (docs/ranker_gpu.md, "Isolation"):
    every row outside the checked users' segments holds NaN / +-Inf / 1e30 in q, k, v,
    dO and the LSE cotangent; out, lse, dq, dk, dv of the checked rows match the
    reference on the zeroed inputs, NaN-free (``test_ranker_isolation_cpu.check_isolation``).
    Packed: user 1 of each row is poisoned as a whole and user 0 checked."""
    from test_ranker_isolation_cpu import _segments, check_isolation

    if bounds is None:
        bounds = np.asarray(_suite_bounds("ragged", batch, seq, seed=3))
    bounds = np.asarray(bounds, np.int32)
    segs = _segments(bounds, seq)  # [B, U, S]
    checked = segs[:, 0] if bounds.ndim == 3 else segs.any(axis=1)
    check_isolation(
        jnp.asarray(bounds), checked, ~checked, head_dim=head_dim, cap=cap, dtype=dtype,
        q_heads=q_heads, kv_heads=kv_heads, interpret=False, config=None,
    )  # fmt: skip
