"""H200 conformance of the Hopper ranker forward kernel at real sizes.

Skipped unless JAX's default backend is a GPU. Every case compares against
``attn_reference.ranker_attention`` run in float32 (HIGHEST precision) on the upcast
inputs: relative L2 below 2e-2 (bf16) / 5e-3 (fp16), outputs finite, LSE ``-inf``
exactly on the rows with no allowed key and the output exactly 0 there.

GPU output buffers cannot be pre-filled through the public API, so before each kernel
call the allocator is handed a NaN-filled block of the outputs' size and freed again
(XLA's allocator then tends to reuse it): an element the kernel forgets to write then
reads NaN and fails the finiteness check.

Run (on the H200, from the repository root):

    PYTHONPATH=common/src:packages/attn-reference/src:packages/attn-mosaic-gpu/src \
        python -m pytest packages/attn-mosaic-gpu/tests/test_ranker_fwd_gpu.py -q

Timing lives in ``benchmarks/ranker_gpu.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jit_cache_size, packed_user_bounds, poison_allocator, ranker_reference_f32

if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (jax.default_backend() != 'gpu')", allow_module_level=True)

from attn_common import (
    CapMethod,
    CapParams,
    KernelConfig,
)
from attn_mosaic_gpu.ranker import resolve_tuning
from attn_mosaic_gpu.ranker_fwd import default_config, ranker_attention_fwd
from attn_reference.ranker import ranker_attention

REL_L2 = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 5e-3}
LSE_ATOL = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 5e-3}
MAX_ABS_FACTOR = 5  # out: max-abs error <= 5 x REL_L2 x max|reference|

CAPS = {
    "none": None,
    "tanh": CapParams(CapMethod.TANH, 30.0),
    "soft_sign": CapParams(CapMethod.SOFT_SIGN, 80.0),
    "tanh_tight": CapParams(CapMethod.TANH, 5.0),
}


# ----------------------------------------------------------------------------- helpers


def _inputs(seed, batch, seq, q_heads, kv_heads, head_dim, dtype, scale=1.0):
    key_q, key_k, key_v = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = (jax.random.normal(key_q, (batch, seq, q_heads, head_dim)) * scale).astype(dtype)
    k = (jax.random.normal(key_k, (batch, seq, kv_heads, head_dim)) * scale).astype(dtype)
    v = jax.random.normal(key_v, (batch, seq, kv_heads, head_dim)).astype(dtype)
    return q, k, v


def _errors(out, want):
    """(rel L2, max-abs) of ``out`` against the f32 reference output."""
    o = np.asarray(out.astype(jnp.float32), np.float64)
    w = np.asarray(want, np.float64)
    return np.linalg.norm(o - w) / np.linalg.norm(w), np.abs(o - w).max()


def _check(q, k, v, bounds, *, cap=None, config=None, sm_scale=None, return_lse=True):
    b, s, hq, d = q.shape
    if config is None:  # what users get: the tuned table's config (resolve_tuning)
        config = resolve_tuning(q, cap, None, None, bounds=bounds)[0]
    poison_allocator(b * s * hq * (d * q.dtype.itemsize + 4))
    got = ranker_attention_fwd(
        q, k, v, bounds, cap=cap, config=config, sm_scale=sm_scale, return_lse=return_lse
    )
    want_out, want_lse = ranker_reference_f32(q, k, v, bounds, cap=cap, sm_scale=sm_scale)
    out, lse = got if return_lse else (got, None)
    assert out.shape == q.shape and out.dtype == q.dtype
    o = np.asarray(out.astype(jnp.float32), np.float64)
    w = np.asarray(want_out, np.float64)
    wl = np.asarray(want_lse, np.float64)
    assert np.all(np.isfinite(o)), f"out: {np.sum(~np.isfinite(o))} non-finite values"
    empty = np.isneginf(wl)  # [B, Hq, S]
    assert np.all(o[np.moveaxis(empty, 1, 2)] == 0.0), "empty rows are not exactly 0"
    err = np.linalg.norm(o - w) / np.linalg.norm(w)
    assert err < REL_L2[q.dtype], f"out: rel L2 {err:.3g}, max-abs {np.abs(o - w).max():.3g}"
    mx, bound = np.abs(o - w).max(), MAX_ABS_FACTOR * REL_L2[q.dtype] * np.abs(w).max()
    assert mx <= bound, f"out: max-abs {mx:.3g} > {bound:.3g} (rel L2 {err:.3g})"
    if return_lse:
        assert lse.shape == (b, hq, s) and lse.dtype == jnp.float32
        gl = np.asarray(lse, np.float64)
        assert not np.any(np.isnan(gl)), "lse: NaN"
        assert np.array_equal(np.isneginf(gl), empty), "lse: -inf rows differ"
        assert np.all(np.isfinite(gl[~empty]))
        if (~empty).any():
            mx = np.abs(gl[~empty] - wl[~empty]).max()
            assert mx < LSE_ATOL[q.dtype], f"lse: max-abs {mx:.3g}"


def _ragged_bounds(seed, batch, seq, n_cand=64, lo=126, hi=1022):
    rng = np.random.default_rng(seed)
    hist = rng.integers(lo, hi + 1, size=batch)
    cand_end = np.minimum(hist + n_cand, seq)
    return jnp.asarray(np.stack([np.zeros(batch), hist, hist, cand_end], 1).astype(np.int32))


# ---------------------------------------------------------------- benchmark shapes


# name, B (reduced), S, Hq, Hkv, D, bounds, cap, return_lse
BENCH = [
    ("phoenix", 64, 1152, 20, 4, 128, [0, 1024, 1024, 1088], CAPS["soft_sign"], True),
    ("long", 8, 5120, 16, 16, 128, [0, 4096, 4096, 5120], CAPS["tanh"], False),
    ("small-d64", 128, 640, 8, 8, 64, [0, 512, 512, 640], None, False),
    ("ragged", 64, 1152, 20, 4, 128, "ragged", CAPS["soft_sign"], True),
]
REDUCED_BATCH = {"phoenix": 4, "long": 1, "small-d64": 8, "ragged": 8}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", BENCH, ids=[c[0] for c in BENCH])
def test_benchmark_shapes(case, dtype):
    name, _, seq, hq, hkv, d, bounds, cap, lse = case
    batch = REDUCED_BATCH[name]
    q, k, v = _inputs(1, batch, seq, hq, hkv, d, dtype)
    if isinstance(bounds, str):
        bounds = _ragged_bounds(2, batch, seq)
    else:
        bounds = jnp.asarray(bounds, jnp.int32)
    _check(q, k, v, bounds, cap=cap, return_lse=lse)


# ----------------------------------------------------------- head dims x dtypes x caps


def _mixed_bounds(seq):
    """Per-row bounds: unaligned H/C sharing a block, gaps, empty H, empty C, all-padding,
    overlapping H and C, block-aligned full tiles."""
    return jnp.asarray(
        [
            [0, 333, 333, 397],  # unaligned: a block holds history and candidates
            [17, 290, 301, 650],  # leading padding, a gap between H and C
            [0, 0, 40, 555],  # empty history
            [0, 640, 640, 640],  # empty candidates, aligned history
            [0, 0, 0, 0],  # all padding
            [64, 512, 256, seq],  # candidates overlapping the history, to the end
        ],
        jnp.int32,
    )


@pytest.mark.parametrize("cap", list(CAPS), ids=list(CAPS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims_dtypes_caps_gqa(head_dim, dtype, cap):
    seq = 700
    q, k, v = _inputs(3, 6, seq, 10, 2, head_dim, dtype, scale=1.5)  # GQA 5:1
    _check(q, k, v, _mixed_bounds(seq), cap=CAPS[cap])


@pytest.mark.parametrize(
    "config",
    [
        KernelConfig(block_q=64, block_kv=64, num_stages=2),
        KernelConfig(block_q=64, block_kv=64, num_stages=4),
        KernelConfig(block_q=64, block_kv=128, num_stages=3),
        KernelConfig(block_q=64, block_kv=192, num_stages=2),
    ],
    ids=lambda c: f"kv{c.block_kv}x{c.num_stages}",
)
def test_configs(config):
    seq = 1000
    q, k, v = _inputs(4, 6, seq, 4, 2, 64, jnp.bfloat16)
    _check(q, k, v, _mixed_bounds(seq), cap=CAPS["tanh"], config=config)


FMA_SPLITS = [
    (128, "soft_sign", KernelConfig(64, 128, 2, exp2_fma_cols=64, rcp_fma_cols=64)),
    (128, "soft_sign", KernelConfig(64, 128, 2, exp2_fma_cols=128, rcp_fma_cols=128)),
    (128, "soft_sign", KernelConfig(64, 64, 3, exp2_fma_cols=16, rcp_fma_cols=32)),
    (128, "tanh_tight", KernelConfig(64, 128, 2, exp2_fma_cols=48)),
    (64, "none", KernelConfig(64, 128, 4, exp2_fma_cols=32)),
    (64, "soft_sign", KernelConfig(64, 128, 2, exp2_fma_cols=96, rcp_fma_cols=64)),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "head_dim,cap,config",
    FMA_SPLITS,
    ids=[f"d{d}-{c}-e{k.exp2_fma_cols}-r{k.rcp_fma_cols}-kv{k.block_kv}" for d, c, k in FMA_SPLITS],
)
def test_fma_pipe_splits(head_dim, cap, config, dtype):
    """exp2 / soft_sign reciprocal on the FMA pipe for part or all of each tile's
    columns: GQA 5:1, mixed bounds (exact zeros on empty rows, -inf LSE), every check."""
    seq = 700
    q, k, v = _inputs(9, 6, seq, 10, 2, head_dim, dtype, scale=1.5)
    _check(q, k, v, _mixed_bounds(seq), cap=CAPS[cap], config=config)


@pytest.mark.parametrize("case", BENCH[:3], ids=[c[0] for c in BENCH[:3]])
def test_fma_split_no_less_accurate(case):
    """The FMA-pipe exp2 (polynomial, 1e-4) and reciprocal (Newton, 3e-7) must not make
    the output less accurate than the all-MUFU kernel on the suite shapes: rel L2 within
    2% of it, max-abs within 25% (one element's bf16 rounding decides the max)."""
    name, _, seq, hq, hkv, d, bounds, cap, _ = case
    q, k, v = _inputs(11, REDUCED_BATCH[name], seq, hq, hkv, d, jnp.bfloat16)
    bounds = jnp.asarray(bounds, jnp.int32)
    want = ranker_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), bounds, cap=cap
    )
    plain = default_config(d)
    all_fma = plain.replace(
        exp2_fma_cols=plain.block_kv,
        rcp_fma_cols=plain.block_kv if cap is not None and cap.method is CapMethod.SOFT_SIGN else 0,
    )
    tuned = resolve_tuning(q, cap, None, None)[0]
    base_l2, base_max = _errors(ranker_attention_fwd(q, k, v, bounds, cap=cap, config=plain), want)
    for label, config in (("tuned", tuned), ("all-fma", all_fma)):
        l2, mx = _errors(ranker_attention_fwd(q, k, v, bounds, cap=cap, config=config), want)
        print(
            f"{name} {label} {config}: rel L2 {l2:.4g} (MUFU {base_l2:.4g}), max-abs {mx:.4g} (MUFU {base_max:.4g})"
        )
        assert l2 <= 1.02 * base_l2, f"{label}: rel L2 {l2:.4g} vs {base_l2:.4g} all-MUFU"
        assert mx <= 1.25 * base_max, f"{label}: max-abs {mx:.4g} vs {base_max:.4g} all-MUFU"


# Tiles with one live half: the live rows first with an odd step count, second with a
# single step, candidates only, and a tile with both halves live, at S=1152.
LONE_BOUNDS = [[0, 300, 300, 320], [70, 120, 120, 127], [0, 0, 200, 230], [0, 1090, 1090, 1100]]


@pytest.mark.parametrize("head_dim,cap", [(128, "soft_sign"), (64, "tanh")], ids=["d128", "d64"])
def test_lone_tiles(head_dim, cap):
    """The idle warpgroup of a tile with one live half keeps the barrier protocol; its
    padding rows stay exactly 0 / -inf. GQA 5:1, tuned config."""
    q, k, v = _inputs(13, 4, 1152, 10, 2, head_dim, jnp.bfloat16, scale=1.5)
    _check(q, k, v, jnp.asarray(LONE_BOUNDS, jnp.int32), cap=CAPS[cap])


# ----------------------------------------------------------- persistent programs


PERSISTENT = [  # name, S, Hq, Hkv, D, bounds, cap, dtype
    ("phoenix", 1152, 20, 4, 128, "phoenix", "soft_sign", jnp.bfloat16),
    ("ragged", 1152, 20, 4, 128, "ragged", "soft_sign", jnp.bfloat16),
    ("lone-d64", 1152, 10, 2, 64, "lone", "tanh", jnp.bfloat16),
    ("mixed-d128-fp16", 700, 8, 2, 128, "mixed", "tanh_tight", jnp.float16),
    ("small-d64", 640, 8, 8, 64, "small", "none", jnp.bfloat16),
]


def _check_config_change_bitwise(case, seed, **changes):
    """The tuned config of a ``PERSISTENT`` case with ``changes`` applied: the reference
    check, and out and LSE bitwise equal to the tuned config's."""
    _, seq, hq, hkv, d, kind, cap, dtype = case
    batch = 6
    q, k, v = _inputs(seed, batch, seq, hq, hkv, d, dtype, scale=1.5)
    bounds = {
        "phoenix": jnp.asarray([[0, 1024, 1024, 1088]] * batch, jnp.int32),
        "ragged": _ragged_bounds(seed, batch, seq),
        "lone": jnp.asarray(LONE_BOUNDS + LONE_BOUNDS[:2], jnp.int32),
        "mixed": _mixed_bounds(seq),
        "small": jnp.asarray([[0, 512, 512, 640]] * batch, jnp.int32),
    }[kind]
    config = resolve_tuning(q, CAPS[cap], None, None)[0]
    changed = config.replace(**changes)
    _check(q, k, v, bounds, cap=CAPS[cap], config=changed)
    got = ranker_attention_fwd(q, k, v, bounds, cap=CAPS[cap], config=changed, return_lse=True)
    want = ranker_attention_fwd(q, k, v, bounds, cap=CAPS[cap], config=config, return_lse=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("programs", [132, 7])
@pytest.mark.parametrize("case", PERSISTENT, ids=[c[0] for c in PERSISTENT])
def test_persistent_matches_per_tile(case, programs):
    """``KernelConfig(programs=N)``: N persistent programs (132 = one per H200 SM; 7:
    many tiles each) give out and LSE bitwise equal to the per-tile kernel's, and pass the
    reference check; half-live tiles, empty rows, unaligned bounds, GQA 5:1."""
    _check_config_change_bitwise(case, 17, programs=programs)


@pytest.mark.parametrize("registers", [240, 224])
@pytest.mark.parametrize("case", PERSISTENT, ids=[c[0] for c in PERSISTENT])
def test_compute_registers(case, registers):
    """``KernelConfig(compute_registers=N)`` moves registers between the compute and the
    memory warpgroups and nothing else: out and LSE bitwise equal to the tuned config's
    (persistent or per tile, as the table has it), and the reference check."""
    _check_config_change_bitwise(case, 19, compute_registers=registers)


@pytest.mark.parametrize(
    "head_dim,cap",
    [(128, "soft_sign"), (128, "tanh"), (64, "none")],
    ids=["d128-ss", "d128-tanh", "d64"],
)
def test_packed_users(head_dim, cap):
    """Packed rows [B, U, 4] (several users per row) at S=1152, GQA 5:1."""
    seq = 1152
    bounds = packed_user_bounds(12, 4, seq, empty_history=True)
    q, k, v = _inputs(12, 4, seq, 10, 2, head_dim, jnp.bfloat16, scale=1.5)
    _check(q, k, v, bounds, cap=CAPS[cap])


@pytest.mark.parametrize("head_dim", [128, 64])
def test_packed_user_shapes(head_dim):
    """Packed rows with every user shape (gap between history and candidates,
    candidates first, a user's own history and candidates overlapping), shuffled slots."""
    from helpers import shaped_packed_bounds

    bounds = jnp.asarray(shaped_packed_bounds(21, 3, 1152))
    q, k, v = _inputs(21, 3, 1152, 4, 2, head_dim, jnp.bfloat16, scale=1.5)
    _check(q, k, v, bounds, cap=CAPS["soft_sign"])


@pytest.mark.parametrize("config", [None, KernelConfig(64, 64, 2)], ids=["tuned", "kv64"])
def test_soft_sign_huge_scores_dirty_padding_keys(config):
    """soft_sign 80: scores up to ~1e37 (``helpers.huge_keys``) saturate as in the
    reference (soft_sign's reciprocal stays a normal float under the MUFU's
    flush-to-zero), and NaN / Inf in keys that no row attends (``helpers.poison_rows``) reach no other score."""
    from helpers import huge_keys, poison_rows

    seq = 384
    q, k, v = _inputs(23, 2, seq, 10, 2, 128, jnp.bfloat16)
    attended = (np.arange(seq) < 352)[None, :, None]  # no row attends keys 352..383
    k = poison_rows(huge_keys(k.astype(jnp.float32), seed=24, max_exp=35), attended)
    k = jnp.asarray(k)
    bounds = jnp.asarray([[0, 256, 256, 320], [0, 200, 230, 352]], jnp.int32)
    _check(q, k.astype(jnp.bfloat16), v, bounds, cap=CAPS["soft_sign"], config=config)


@pytest.mark.parametrize("seq", [1, 65, 127, 129, 300])
def test_odd_lengths(seq):
    q, k, v = _inputs(5, 2, seq, 4, 4, 128, jnp.bfloat16)
    bounds = jnp.asarray([[0, seq // 2, seq // 2, seq], [1, seq, 0, 0]], jnp.int32)
    _check(q, k, v, bounds, cap=CAPS["soft_sign"], sm_scale=0.05)


def test_one_compile_serves_every_bounds():
    q, k, v = _inputs(6, 4, 1152, 20, 4, 128, jnp.bfloat16)
    fwd = jax.jit(functools.partial(ranker_attention_fwd, cap=CAPS["soft_sign"]))
    # same shape [4, 4] as the ragged bounds, other values: must reuse one executable
    a = fwd(q, k, v, jnp.tile(jnp.asarray([0, 1024, 1024, 1088], jnp.int32), (4, 1)))
    b = fwd(q, k, v, _ragged_bounds(7, 4, 1152))
    jax.block_until_ready((a, b))
    assert jit_cache_size(fwd) == 1


def test_default_configs_compile():
    for d in (64, 128, 256):
        cfg = default_config(d)
        q, k, v = _inputs(8, 1, 512, 2, 1, d, jnp.bfloat16)
        bounds = jnp.asarray([0, 384, 384, 512], jnp.int32)
        _check(q, k, v, bounds, config=cfg)
