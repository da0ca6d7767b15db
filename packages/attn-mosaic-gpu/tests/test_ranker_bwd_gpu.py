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

from attn_common import CapMethod, CapParams, KernelConfig, ranker_mask
from attn_mosaic_gpu import ranker_attention
from attn_mosaic_gpu.tuning import BackwardTuning
from attn_reference.ranker import ranker_attention as reference

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a GPU (Hopper) backend"
)

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 1e-2}
MAX_ABS_FACTOR = 5  # max-abs error <= 5 x TOL x max|reference|
NONE = None
TANH30 = CapParams(CapMethod.TANH, 30.0)
TANH5 = CapParams(CapMethod.TANH, 5.0)
SS80 = CapParams(CapMethod.SOFT_SIGN, 80.0)
SS8 = CapParams(CapMethod.SOFT_SIGN, 8.0)


def _inputs(seed, batch, seq, q_heads, kv_heads, head_dim, dtype):
    rng = np.random.default_rng(seed)

    def draw(heads, scale=1.0):
        x = rng.standard_normal((batch, seq, heads, head_dim)).astype(np.float32) * scale
        return jnp.asarray(x).astype(dtype)

    return draw(q_heads, 2.0), draw(kv_heads, 2.0), draw(kv_heads)


def _loss(fn, q, k, v, bounds, w, *, cap, use_lse, **kw):
    if use_lse:
        out, lse = fn(q, k, v, bounds, cap=cap, return_lse=True, **kw)
        # A linear LSE term with a random per-row weight of the out term's gradient scale
        # (sqrt(D)): a dropped LSE cotangent moves dq and dk far beyond the tolerance
        # (_check_grads checks that), which a 1e-3 weight on lse**2 hid.
        wl = np.sqrt(q.shape[-1]) * jnp.moveaxis(w[..., 0], 1, 2)  # [B, Hq, S]
        z = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)
        return jnp.sum(out.astype(jnp.float32) * w) + z
    return jnp.sum(fn(q, k, v, bounds, cap=cap, **kw).astype(jnp.float32) * w)


def _kernel_grad(cap, use_lse, **kw):
    def loss(q, k, v, bounds, w):
        return _loss(ranker_attention, q, k, v, bounds, w, cap=cap, use_lse=use_lse, **kw)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _dead(bounds, batch, seq):
    """Rows and keys with nothing allowed, for [B, 4] bounds or packed [B, U, 4] rows."""
    from attn_common.packed import ranker_mask_packed

    pos = np.arange(seq)
    bounds = np.asarray(bounds)
    if bounds.ndim == 3:
        allowed = np.asarray(
            ranker_mask_packed(pos[None, :, None], pos[None, None, :], bounds[:, None, None])
        )
    else:
        arr = np.broadcast_to(np.clip(bounds, 0, seq), (batch, 4))
        allowed = np.asarray(
            ranker_mask(
                pos[None, :, None], pos[None, None, :], *(arr[:, i, None, None] for i in range(4))
            )
        )
    return ~allowed.any(axis=2), ~allowed.any(axis=1)  # rows [B, S], keys [B, S]


def _check_lse_term_matters(want, want_without_lse, tol):
    """The LSE term must move dq and dk by far more than the tolerance, so that a kernel
    dropping the LSE cotangent fails (dv does not depend on it)."""
    for name, r, r0 in zip(("dq", "dk"), want[:2], want_without_lse[:2], strict=True):
        r, r0 = np.asarray(r, np.float64), np.asarray(r0, np.float64)
        moved = np.linalg.norm(r - r0) / max(np.linalg.norm(r), 1e-30)
        assert moved > 10 * tol, f"{name}: the LSE term moves it by only {moved:.3g}"


def _check_max_abs(name, g, r, tol):
    """Max-abs error bound next to rel L2: a few bad elements cannot hide in the norm."""
    mx = np.abs(g - r).max(initial=0.0)
    bound = MAX_ABS_FACTOR * tol * max(np.abs(r).max(initial=0.0), 1e-30)
    assert mx <= bound, (
        f"{name}: max-abs {mx:.3g} > {bound:.3g} ({MAX_ABS_FACTOR} x tol x max|ref|)"
    )


def _check_grads(q, k, v, bounds, *, cap, use_lse=True, seed=0, **kw):
    w = jnp.asarray(np.random.default_rng(seed + 100).standard_normal(q.shape), jnp.float32)
    got = _kernel_grad(cap, use_lse, **kw)(q, k, v, bounds, w)

    def ref_loss(q, k, v):
        return _loss(reference, q, k, v, bounds, w, cap=cap, use_lse=use_lse)

    up = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(*up)
    if use_lse:

        def ref_loss_without_lse(q, k, v):
            return _loss(reference, q, k, v, bounds, w, cap=cap, use_lse=False)

        _check_lse_term_matters(
            want, jax.jit(jax.grad(ref_loss_without_lse, argnums=(0, 1, 2)))(*up), TOL[q.dtype.type]
        )
    row_dead, key_dead = _dead(bounds, q.shape[0], q.shape[1])
    for name, g, r, dead in zip(
        ("dq", "dk", "dv"), got, want, (row_dead, key_dead, key_dead), strict=True
    ):
        assert g.dtype == q.dtype and g.shape == r.shape, name
        g = np.asarray(g.astype(jnp.float32), np.float64)
        r = np.asarray(r, np.float64)
        assert not np.isnan(g).any(), f"{name}: NaN"
        assert np.isfinite(g).all(), f"{name}: non-finite"
        assert np.all(g[dead] == 0.0), f"{name}: nonzero gradient where nothing is allowed"
        err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
        assert err < TOL[q.dtype.type], f"{name}: rel L2 {err:.3g}"
        _check_max_abs(name, g, r, TOL[q.dtype.type])


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
    q, k, v = _inputs(0, batch, seq, q_heads, kv_heads, head_dim, dtype)
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
    q, k, v = _inputs(1, 6, 1000, 10, 2, head_dim, dtype)
    _check_grads(q, k, v, EDGE_BOUNDS, cap=cap, seed=1)


@pytest.mark.parametrize("head_dim,cap", [(128, SS80), (64, TANH5)], ids=["d128", "d64"])
def test_grad_lone_tiles(head_dim, cap):
    """Tiles with one live half: the live rows first with an odd step count, second
    with one step, candidates only; GQA 5:1, LSE z-loss."""
    bounds = jnp.asarray(
        [[0, 300, 300, 320], [70, 120, 120, 127], [0, 0, 200, 230], [0, 1090, 1090, 1100]],
        jnp.int32,
    )
    q, k, v = _inputs(2, 4, 1152, 10, 2, head_dim, jnp.bfloat16)
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
    q, k, v = _inputs(3, 6, 1000, 10, 2, head_dim, jnp.bfloat16)
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
        "packed": _packed_bounds(17, 4, seq) if layout == "packed" else None,
    }[layout]
    tuning = BackwardTuning(dq_programs=programs)
    q, k, v = _inputs(21, bounds.shape[0], seq, 10, 2, head_dim, jnp.bfloat16)
    _check_grads(q, k, v, bounds, cap=cap, seed=21, backward_tuning=tuning)
    w = jnp.asarray(np.random.default_rng(121).standard_normal(q.shape), jnp.float32)
    got = _kernel_grad(cap, True, backward_tuning=tuning)(q, k, v, bounds, w)
    want = _kernel_grad(cap, True, backward_tuning=BackwardTuning())(q, k, v, bounds, w)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), name


def _packed_bounds(seed, rows, seq, max_users=8):
    from attn_common.packing import pack_users

    rng = np.random.default_rng(seed)
    hist = np.minimum(rng.lognormal(np.log(60), 1.0, size=6 * rows).astype(int), seq // 2)
    cand = rng.integers(1, 20, size=hist.size)
    packed = pack_users(hist, cand, seq_len=seq, max_users_per_row=max_users)
    bounds = np.asarray(packed.bounds)[:rows]
    bounds[0, -1] = 0  # an unused slot
    return jnp.asarray(bounds, jnp.int32)


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
        bounds = _packed_bounds(13, 4, seq)
    else:
        bounds = jnp.asarray(shaped_packed_bounds(22, 4, seq))
    q, k, v = _inputs(13, 4, seq, 10, 2, head_dim, jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(14).standard_normal(q.shape), jnp.float32)
    grad = _kernel_grad(cap, True)
    got = grad(q, k, v, bounds, w)

    def ref_loss(q, k, v):
        return _loss(reference, q, k, v, bounds, w, cap=cap, use_lse=True)

    up = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(*up)
    row_dead, key_dead = _dead(bounds, q.shape[0], seq)
    dead = (row_dead, key_dead, key_dead)
    for name, g, r, d in zip(("dq", "dk", "dv"), got, want, dead, strict=True):
        g = np.asarray(g.astype(jnp.float32), np.float64)
        r = np.asarray(r, np.float64)
        assert np.isfinite(g).all(), f"{name}: non-finite"
        assert np.all(g[d] == 0.0), f"{name}: nonzero gradient where nothing is allowed"
        err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
        assert err < TOL[jnp.bfloat16], f"{name}: rel L2 {err:.3g}"
        _check_max_abs(name, g, r, TOL[jnp.bfloat16])
    again = grad(q, k, v, bounds, w)
    for name, a, b in zip(("dq", "dk", "dv"), got, again, strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), name


@pytest.mark.parametrize("head_dim", [128, 64])
def test_grad_soft_sign_huge_scores(head_dim):
    """soft_sign 80: scores up to ~1e18 (``helpers.huge_keys``; keys up to 1e20 put dq
    0.35 rel L2 from the float32 reference in interpret mode: the bf16 backward's limit
    at such scores)."""
    from helpers import huge_keys

    q, k, v = _inputs(31, 2, 384, 10, 2, head_dim, jnp.bfloat16)
    k = jnp.asarray(huge_keys(k.astype(jnp.float32), seed=32, max_exp=16)).astype(jnp.bfloat16)
    bounds = jnp.asarray([[0, 256, 256, 320], [0, 200, 230, 352]], jnp.int32)
    _check_grads(q, k, v, bounds, cap=SS80)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_grad_deterministic(head_dim):
    """Same inputs -> bitwise identical dq, dk, dv (no atomics; fixed GQA order)."""
    q, k, v = _inputs(2, 4, 1152, 20, 4, head_dim, jnp.bfloat16)
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
