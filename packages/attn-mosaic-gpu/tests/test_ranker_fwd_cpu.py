"""CPU checks of the Hopper ranker forward kernel (no GPU needed).

* Cross-lowering: ``jax.export`` with ``platforms=["cuda"]`` at the benchmark
  suite's shapes (docs/design.md#benchmarks) (and D=256) traces and lowers the kernel to its Mosaic GPU custom call
  on a CPU-only machine. It catches tracing and lowering errors, not every ptxas error.
* Interpret mode: ``plgpu.InterpretGPUParams`` (race detection on, buffers start as NaN so
  an unwritten element fails) at small shapes against ``attn_reference`` run in float32
  on the upcast inputs.
* Input validation: bad dtypes, head dims and configs raise before tracing.

Interpret mode of jax 0.11.2 implements neither ``run_state`` nor a wgmma with its A
operand in registers, so there the kernel stages P through shared memory for the PV
wgmma (``accumulate_in_place=False``); everything else (TMA, barriers, the ring, the
QK^T wgmma, masking, softmax, stores) is the code that runs on the GPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    gpu_interpret,
    hopper_small_config,
    ranker_kernel_inputs,
    ranker_reference_f32,
    run_interpret,
)

from attn_common import CapMethod, CapParams, KernelConfig, SegmentBounds
from attn_mosaic_gpu.ranker_fwd import (
    SMEM_LIMIT_BYTES,
    default_config,
    ranker_attention_fwd,
    smem_bytes,
    validate_config,
)
from attn_reference.ranker import ranker_attention

INTERPRET = gpu_interpret()
SMALL = hopper_small_config()
TOL = {jnp.bfloat16: (2e-2, 3e-2), jnp.float16: (5e-3, 5e-3)}
LSE_ATOL = 2e-3

SOFT_SIGN = CapParams(CapMethod.SOFT_SIGN, 5.0)
TANH = CapParams(CapMethod.TANH, 3.0)
PHOENIX_CAP = CapParams(CapMethod.SOFT_SIGN, 80.0)


# ----------------------------------------------------------------------------- helpers


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32), dtype=np.float64)


def _run_interpret(*args, **kwargs):
    return run_interpret(ranker_attention_fwd, *args, interpret=INTERPRET, **kwargs)


def _check(q, k, v, bounds, *, cap=None, sm_scale=None, config=SMALL):
    out, lse = _run_interpret(
        q, k, v, bounds, cap=cap, sm_scale=sm_scale, config=config, return_lse=True
    )
    want_out, want_lse = ranker_reference_f32(q, k, v, bounds, cap=cap, sm_scale=sm_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == jnp.float32
    got, want = _f32(out), _f32(want_out)
    got_lse, want_lse = _f32(lse), _f32(want_lse)

    assert np.all(np.isfinite(got)), f"out: {np.sum(~np.isfinite(got))} non-finite values"
    assert not np.any(np.isnan(got_lse)), "lse: NaN present"
    empty = np.isneginf(want_lse)  # [B, Hq, S]
    assert np.array_equal(np.isneginf(got_lse), empty), (
        "lse: -inf rows differ from the reference at "
        f"{np.argwhere(np.isneginf(got_lse) != empty)[:5].tolist()}"
    )
    assert np.all(np.isfinite(got_lse[~empty]))
    if (~empty).any():
        lse_err = np.max(np.abs(got_lse[~empty] - want_lse[~empty]))
        assert lse_err < LSE_ATOL, f"lse: max-abs {lse_err:.3g}"
    empty_out = np.moveaxis(empty, 1, 2)  # [B, S, Hq]
    assert np.all(got[empty_out] == 0.0), "rows with no allowed key are not exactly 0"

    rtol_l2, atol = TOL[q.dtype.type]
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    mx = np.max(np.abs(got - want))
    assert err < rtol_l2, f"out: rel L2 {err:.3g} (max-abs {mx:.3g})"
    assert mx < atol, f"out: max-abs {mx:.3g} (rel L2 {err:.3g})"
    return got, got_lse


# ------------------------------------------------------------------ interpret mode


@pytest.mark.slow  # interpret mode, ~7 s on 2 cores
def test_interpret_tanh_empty_candidates_and_gap():
    """tanh cap, explicit sm_scale; empty candidates; a padding gap between H and C that
    leaves a whole compute warpgroup idle (rows 64..127 of row 1)."""
    q, k, v = ranker_kernel_inputs(1, 2, 200, 2, 1, 64, jnp.bfloat16)
    bounds = SegmentBounds.from_array(jnp.array([[0, 170, 170, 170], [20, 60, 130, 200]]))
    _check(q, k, v, bounds, cap=TANH, sm_scale=0.2)


@pytest.mark.slow  # interpret mode, ~8 s on 2 cores
def test_interpret_no_cap_empty_row_aligned_and_overlap_fp16():
    """fp16, no cap; an all-padding row (zero-step programs), block-aligned history
    (the unmasked fast path), and candidates overlapping the history; default config
    for D=64 (block_kv=128, 4 stages)."""
    q, k, v = ranker_kernel_inputs(2, 3, 200, 2, 2, 64, jnp.float16)
    bounds = jnp.array([[0, 0, 0, 0], [0, 128, 128, 200], [0, 128, 64, 180]], jnp.int32)
    _check(q, k, v, bounds, config=default_config(64, jnp.float16))


@pytest.mark.slow  # interpret mode, ~10 s on 2 cores
@pytest.mark.parametrize(
    "cap, config",
    [
        (SOFT_SIGN, SMALL.replace(exp2_fma_cols=32, rcp_fma_cols=64)),
        (SOFT_SIGN, SMALL.replace(exp2_fma_cols=64, rcp_fma_cols=8)),
        (TANH, KernelConfig(block_q=64, block_kv=128, num_stages=2, exp2_fma_cols=48)),
    ],
    ids=["ss-exp2-half-rcp-all", "ss-exp2-all-rcp-8", "tanh-exp2-48of128"],
)
def test_interpret_fma_pipe_split(cap, config):
    """exp2 / soft_sign reciprocal on the FMA pipe for part or all of the columns:
    same results as the reference, empty rows still exactly 0 and -inf (the polynomial
    exp2 maps a masked -inf to exactly 0), gaps, padding, GQA."""
    q, k, v = ranker_kernel_inputs(4, 2, 200, 4, 2, 64, jnp.bfloat16)
    bounds = jnp.array([[0, 100, 100, 150], [20, 60, 130, 190]], jnp.int32)
    _check(q, k, v, bounds, cap=cap, config=config)


@pytest.mark.slow  # interpret mode, ~15 s on 2 cores
@pytest.mark.parametrize("config", [SMALL, KernelConfig(64, 128, 2)], ids=["kv64", "kv128"])
def test_interpret_soft_sign_huge_scores_dirty_padding_keys(config):
    """soft_sign 80: scores up to ~1e37 (``helpers.huge_keys``) saturate as in the
    reference, and NaN / Inf in keys that no row attends (``helpers.poison_rows``) (masked before the softmax)
    reach no other score."""
    from helpers import huge_keys, poison_rows

    q, k, v = ranker_kernel_inputs(11, 2, 200, 4, 2, 64, jnp.bfloat16)
    attended = (np.arange(200) < 190)[None, :, None]  # no row attends keys 190..199
    k = poison_rows(huge_keys(k.astype(jnp.float32), seed=12, max_exp=35), attended)
    k = jnp.asarray(k).astype(jnp.bfloat16)
    bounds = jnp.array([[0, 100, 100, 150], [0, 128, 128, 190]], jnp.int32)
    _check(q, k, v, bounds, cap=PHOENIX_CAP, config=config)


@pytest.mark.slow  # interpret mode, ~15 s on 2 cores
@pytest.mark.parametrize("cap", [SOFT_SIGN, None], ids=["soft_sign", "none"])
def test_interpret_packed_users(cap):
    """Packed rows [B, U, 4]: users sharing a block, unaligned boundaries, an empty
    user, a gap, padding at the end, unused all-zero slots, users in any slot order;
    GQA 2:1. Rows that attend nothing stay exactly 0 with -inf LSE."""
    q, k, v = ranker_kernel_inputs(6, 2, 300, 4, 2, 64, jnp.bfloat16)
    bounds = jnp.array(
        [
            [[0, 40, 40, 50], [50, 120, 120, 140], [150, 150, 150, 160], [0, 0, 0, 0]],
            [[200, 260, 260, 290], [0, 0, 0, 0], [3, 100, 100, 101], [101, 190, 195, 200]],
        ],
        jnp.int32,
    )
    _check(q, k, v, bounds, cap=cap, config=KernelConfig(block_q=64, block_kv=64, num_stages=2))


@pytest.mark.slow  # interpret mode, ~20 s on 2 cores
@pytest.mark.parametrize(
    "config", [SMALL, default_config(64)], ids=["kv64-2stages", "kv128-4stages"]
)
def test_interpret_lone_tiles(config):
    """Tiles with one live half: the live rows first with an odd step count (row 0,
    tile 1), second with a single step (rows 1 and 2, candidates only in row 2); the
    idle warpgroup keeps the barrier protocol and its padding rows stay exactly 0 /
    -inf. GQA 2:1, soft_sign."""
    q, k, v = ranker_kernel_inputs(8, 3, 300, 4, 2, 64, jnp.bfloat16)
    bounds = jnp.array([[0, 150, 150, 170], [70, 120, 120, 127], [0, 0, 200, 230]], jnp.int32)
    _check(q, k, v, bounds, cap=SOFT_SIGN, config=config)


@pytest.mark.slow  # interpret mode, ~1 min on 2 cores
@pytest.mark.parametrize(
    "config",
    [SMALL.replace(programs=1), SMALL.replace(programs=4), default_config(64).replace(programs=5),
     SMALL.replace(programs=40)],
    ids=["kv64-1prog", "kv64-4progs", "kv128-4stages-5progs", "kv64-40progs"],
)  # fmt: skip
def test_interpret_persistent_matches_per_tile(config):
    """``programs`` (persistent programs walking the tiles, Q/O double-buffered, the K/V
    ring running on across tiles): out and LSE bitwise the per-tile kernel's, with tiles
    that have one live half, an empty tile (row 2's history ends early), zero-step tiles
    and more programs than tiles (40 > 24); race detection on."""
    q, k, v = ranker_kernel_inputs(11, 3, 300, 4, 2, 64, jnp.bfloat16)
    bounds = jnp.array([[0, 150, 150, 170], [70, 120, 120, 127], [0, 0, 200, 230]], jnp.int32)
    got = _check(q, k, v, bounds, cap=SOFT_SIGN, config=config)
    want = _run_interpret(
        q, k, v, bounds, cap=SOFT_SIGN, config=config.replace(programs=0), return_lse=True
    )
    np.testing.assert_array_equal(got[0], _f32(want[0]))
    np.testing.assert_array_equal(got[1], _f32(want[1]))


def test_persistent_programs_refuse_packed_bounds():
    q, k, v = ranker_kernel_inputs(7, 1, 128, 2, 1, 64, jnp.bfloat16)
    packed = jnp.array([[[0, 30, 30, 40], [40, 90, 90, 100]]], jnp.int32)
    with pytest.raises(ValueError, match="programs"):
        ranker_attention_fwd(q, k, v, packed, config=SMALL.replace(programs=2))


def test_packed_users_must_not_overlap():
    q, k, v = ranker_kernel_inputs(7, 1, 128, 2, 1, 64, jnp.bfloat16)
    bounds = jnp.array([[[0, 50, 50, 60], [40, 80, 80, 90]]], jnp.int32)
    with pytest.raises(ValueError, match="overlap"):
        ranker_attention_fwd(q, k, v, bounds, config=SMALL)


def test_rcp_fma_cols_needs_soft_sign():
    q, k, v = ranker_kernel_inputs(5, 1, 64, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="rcp_fma_cols"):
        ranker_attention_fwd(
            q, k, v, jnp.array([0, 32, 32, 64]), cap=TANH, config=SMALL.replace(rcp_fma_cols=8)
        )


def test_interpret_out_only_broadcast_bounds():
    """return_lse=False returns only out; [4] bounds broadcast to every row."""
    q, k, v = ranker_kernel_inputs(3, 2, 130, 2, 1, 64, jnp.bfloat16)
    bounds = jnp.array([3, 90, 90, 121], jnp.int32)
    out = _run_interpret(q, k, v, bounds, config=SMALL)
    assert isinstance(out, jax.Array) and out.shape == q.shape
    want = ranker_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), bounds
    )
    got = _f32(out)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - _f32(want)) / np.linalg.norm(_f32(want)) < 2e-2
    assert np.all(got[:, :3] == 0.0) and np.all(got[:, 121:] == 0.0)


# ------------------------------------------------------------------- cross-lowering


def _sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


# name, B, S, Hq, Hkv, D, cap, return_lse, dtype  (the benchmark suite + D=256)
LOWERING_SHAPES = [
    ("phoenix", 64, 1152, 20, 4, 128, CapParams(CapMethod.SOFT_SIGN, 80.0), True, jnp.bfloat16),
    ("long", 8, 5120, 16, 16, 128, CapParams(CapMethod.TANH, 30.0), False, jnp.bfloat16),
    ("small-d64", 128, 640, 8, 8, 64, None, False, jnp.bfloat16),
    # ragged: same shapes as phoenix; the per-row bounds are traced data.
    ("ragged", 64, 1152, 20, 4, 128, CapParams(CapMethod.SOFT_SIGN, 80.0), True, jnp.bfloat16),
    ("d256", 8, 1000, 16, 4, 256, CapParams(CapMethod.TANH, 30.0), True, jnp.bfloat16),
    ("d256-fp16", 4, 777, 8, 8, 256, None, False, jnp.float16),
]


def _mosaic_gpu_calls(mlir_text: str) -> int:
    """Mosaic GPU kernels in a lowered module: its ``mosaic_gpu*`` custom calls."""
    return len(re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(", mlir_text))


# Quick: phoenix (D=128, the LSE) and d256; the suite's other shapes are slow (D=64 and
# persistent programs lower in the quick tier in test_tuning.py's
# test_package_table_forward_configs_lower[one-user]).
@pytest.mark.parametrize(
    "name,batch,seq,q_heads,kv_heads,head_dim,cap,return_lse,dtype",
    [
        pytest.param(*s, id=s[0], marks=() if s[0] in ("phoenix", "d256") else pytest.mark.slow)
        for s in LOWERING_SHAPES
    ],
)
def test_cross_lowering_cuda(name, batch, seq, q_heads, kv_heads, head_dim, cap, return_lse, dtype):
    def f(q, k, v, bounds):
        return ranker_attention_fwd(q, k, v, bounds, cap=cap, return_lse=return_lse)

    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        _sds(batch, seq, q_heads, head_dim, dtype=dtype),
        _sds(batch, seq, kv_heads, head_dim, dtype=dtype),
        _sds(batch, seq, kv_heads, head_dim, dtype=dtype),
        _sds(batch, 4, dtype=jnp.int32),
    )
    text = exported.mlir_module()
    calls = _mosaic_gpu_calls(text)
    assert calls == 1, f"{name}: {calls} Mosaic GPU custom calls, expected the one forward kernel"
    out_avals = exported.out_avals
    assert out_avals[0].shape == (batch, seq, q_heads, head_dim)
    assert out_avals[0].dtype == dtype
    if return_lse:
        assert out_avals[1].shape == (batch, q_heads, seq)
        assert out_avals[1].dtype == jnp.float32


@pytest.mark.slow  # ~15 s in all: the package table's configs (persistent programs, 240
# registers, D 64 and 128) lower in the quick tier in test_tuning.py's
# test_package_table_forward_configs_lower[one-user], with the same register check
@pytest.mark.parametrize(
    "head_dim,config",
    [
        (64, KernelConfig(block_q=64, block_kv=64, num_stages=4)),
        (64, KernelConfig(block_q=64, block_kv=128, num_stages=3)),
        (64, KernelConfig(block_q=64, block_kv=192, num_stages=2)),
        (128, KernelConfig(block_q=64, block_kv=64, num_stages=4)),
        (256, KernelConfig(block_q=64, block_kv=64, num_stages=2)),
        (128, KernelConfig(block_q=64, block_kv=128, num_stages=2, programs=132)),
        (64, KernelConfig(block_q=64, block_kv=128, num_stages=4, programs=132)),
        (128, KernelConfig(64, 128, 2, programs=528, compute_registers=240)),
        (128, KernelConfig(64, 128, 2, compute_registers=224)),
    ],
    ids=lambda x: (
        f"kv{x.block_kv}x{x.num_stages}"
        + (f"-{x.programs}progs" if x.programs else "")
        + (f"-{x.compute_registers}regs" if x.compute_registers else "")
        if isinstance(x, KernelConfig)
        else f"d{x}"
    ),
)
def test_cross_lowering_configs(head_dim, config):
    """Each config lowers to one kernel; its compute warpgroups' register count leaves
    the memory warpgroup the rest of the 504 (232 -> 40 by default)."""

    def f(q, k, v, bounds):
        return ranker_attention_fwd(q, k, v, bounds, cap=TANH, config=config, return_lse=True)

    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        _sds(2, 1000, 4, head_dim, dtype=jnp.float16),
        _sds(2, 1000, 2, head_dim, dtype=jnp.float16),
        _sds(2, 1000, 2, head_dim, dtype=jnp.float16),
        _sds(2, 4, dtype=jnp.int32),
    )
    text = exported.mlir_module()
    assert _mosaic_gpu_calls(text) == 1
    memory = 504 - 2 * (config.compute_registers or 232)
    assert text.count(f"setmaxnreg.dec.sync.aligned.u32 {memory};") == 1


@pytest.mark.parametrize(
    "head_dim,cap,config",
    [  # one split in the quick tier (exp2 and the reciprocal both on the FMA pipe)
        pytest.param(
            128,
            PHOENIX_CAP,
            KernelConfig(64, 128, 2, exp2_fma_cols=64, rcp_fma_cols=64),
            marks=pytest.mark.slow,
        ),
        (128, PHOENIX_CAP, KernelConfig(64, 128, 2, exp2_fma_cols=128, rcp_fma_cols=8)),
        pytest.param(128, TANH, KernelConfig(64, 128, 2, exp2_fma_cols=40), marks=pytest.mark.slow),
        pytest.param(64, None, KernelConfig(64, 128, 4, exp2_fma_cols=32), marks=pytest.mark.slow),
    ],
    ids=["ss-64-64", "ss-128-8", "tanh-40", "d64-none-32"],
)
def test_cross_lowering_fma_split(head_dim, cap, config):
    """The MUFU/FMA column split lowers to one kernel (slices and concatenation of WGMMA
    register tiles, integer bit arithmetic on them)."""

    def f(q, k, v, bounds):
        return ranker_attention_fwd(q, k, v, bounds, cap=cap, config=config, return_lse=True)

    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        _sds(64, 1152, 20, head_dim),
        _sds(64, 1152, 4, head_dim),
        _sds(64, 1152, 4, head_dim),
        _sds(64, 4, dtype=jnp.int32),
    )
    assert _mosaic_gpu_calls(exported.mlir_module()) == 1


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_default_config_fits_shared_memory(head_dim, dtype):
    cfg = default_config(head_dim, dtype)
    assert smem_bytes(cfg, head_dim, dtype, return_lse=True) <= SMEM_LIMIT_BYTES


@pytest.mark.parametrize(
    "head_dim,config,return_lse,users",
    [
        (128, KernelConfig(64, 128, 2), True, 0),
        (128, KernelConfig(64, 128, 2, programs=528), True, 0),
        (128, KernelConfig(64, 192, 2), True, 0),  # 1,960 bytes under the limit
        (128, KernelConfig(64, 192, 2), True, 2),  # 104 bytes over: refused
        (128, KernelConfig(64, 192, 2), False, 2),  # fits without the LSE buffer
        (128, KernelConfig(64, 128, 3), True, 0),
        (64, KernelConfig(64, 64, 4), True, 0),
        (256, KernelConfig(64, 64, 2), True, 0),
        (128, KernelConfig(64, 128, 2), True, 2),
        (64, KernelConfig(64, 128, 4), False, 2),
    ],
    ids=lambda x: (
        f"kv{x.block_kv}x{x.num_stages}-p{x.programs}" if isinstance(x, KernelConfig) else str(x)
    ),
)
def test_smem_bytes_is_what_mosaic_allocates(monkeypatch, head_dim, config, return_lse, users):
    """``smem_bytes`` (what ``validate_config`` checks) equals Mosaic GPU's own count, so
    a config is refused by our validation exactly when Mosaic would refuse it. Mosaic
    states its count when it exceeds the bound; a bound of 0 makes it state it always."""
    import jax.experimental.mosaic.gpu.core as mosaic_core

    import attn_mosaic_gpu.ranker_fwd as fwd

    monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", 0)
    monkeypatch.setattr(fwd, "validate_config", lambda *args, **kwargs: None)
    if users:
        bounds = jnp.array([[[0, 100, 100, 200], [200, 300, 300, 400]]], jnp.int32)
    else:
        bounds = jnp.array([[0, 300, 300, 512]], jnp.int32)
    kv = jnp.zeros((1, 512, 1, head_dim), jnp.bfloat16)
    q = jnp.zeros((1, 512, 2, head_dim), jnp.bfloat16)
    fn = jax.jit(
        lambda q, k, v: fwd.ranker_attention_fwd(
            q, k, v, bounds, config=config, return_lse=return_lse
        )
    )
    with pytest.raises(ValueError, match=r"smem_bytes=(\d+)") as info:
        jax.export.export(fn, platforms=["cuda"])(q, kv, kv)
    mosaic = int(re.search(r"smem_bytes=(\d+)", str(info.value)).group(1))
    assert (
        smem_bytes(config, head_dim, jnp.bfloat16, return_lse=return_lse, packed=bool(users))
        == mosaic
    )


def test_rejects_config_mosaic_would_refuse():
    """192-key blocks at D=128 with packed bounds and the LSE need 104 bytes more than the
    227 KiB: refused by validation (naming shared memory), not by Mosaic at compile time;
    without the LSE, or with one user per row, they fit."""
    q, k, v, _ = _bad(head_dim=128)
    packed_bounds = jnp.array([[[0, 16, 16, 24], [32, 48, 48, 56]]], jnp.int32)
    config = KernelConfig(block_q=64, block_kv=192, num_stages=2)
    with pytest.raises(ValueError, match="shared memory"):
        ranker_attention_fwd(q, k, v, packed_bounds, config=config, return_lse=True)
    validate_config(config, 128, jnp.bfloat16, return_lse=False, packed=True)
    validate_config(config, 128, jnp.bfloat16, return_lse=True)


def _bad(dtype=jnp.bfloat16, head_dim=64, q_heads=2, kv_heads=1):
    q = jnp.zeros((1, 64, q_heads, head_dim), dtype)
    kv = jnp.zeros((1, 64, kv_heads, head_dim), dtype)
    return q, kv, kv, jnp.array([0, 32, 32, 48], jnp.int32)


def test_rejects_float32():
    with pytest.raises(TypeError, match="q: got dtype float32"):
        ranker_attention_fwd(*_bad(jnp.float32))


def test_rejects_head_dim():
    with pytest.raises(NotImplementedError, match="head dim 96"):
        ranker_attention_fwd(*_bad(head_dim=96))


def test_rejects_bad_gqa():
    with pytest.raises(ValueError, match="Hq % Hkv"):
        ranker_attention_fwd(*_bad(q_heads=3, kv_heads=2))


@pytest.mark.parametrize(
    "config,match",
    [
        (KernelConfig(block_q=128, block_kv=64), "block_q"),
        (KernelConfig(block_q=64, block_kv=96), "block_kv"),
        (KernelConfig(block_q=64, block_kv=256, num_stages=1 + 1), "registers"),
        (KernelConfig(block_q=64, block_kv=128, num_stages=4), "shared memory"),
        (KernelConfig(block_q=64, block_kv=128, compute_registers=248), "compute_registers"),
        (KernelConfig(block_q=64, block_kv=128, compute_registers=160), "compute_registers"),
    ],
)
def test_rejects_config(config, match):
    q, k, v, bounds = _bad(head_dim=128)
    with pytest.raises(ValueError, match=match):
        ranker_attention_fwd(q, k, v, bounds, config=config)


def test_one_stage_ring_is_no_config():
    """The K/V ring always prefetches: KernelConfig itself refuses num_stages=1."""
    with pytest.raises(ValueError, match=r"KernelConfig\.num_stages: got 1"):
        KernelConfig(block_q=64, block_kv=64, num_stages=1)


def test_rejects_bad_bounds_shape():
    q, k, v, _ = _bad()
    with pytest.raises(ValueError, match="bounds"):
        ranker_attention_fwd(q, k, v, jnp.zeros((3, 4), jnp.int32))
