"""CPU checks of the Hopper ranker backward (dq and dk/dv kernels, custom_vjp wiring).

* Interpret mode (``plgpu.InterpretGPUParams``, race detection on, buffers start as NaN
  so an unwritten element fails): ``jax.grad`` of ``attn_mosaic_gpu.ranker_attention``
  under ``jit`` against ``jax.grad`` of ``attn_reference.ranker_attention`` on the f32
  upcast inputs, with a loss on ``out`` and a z-loss on the LSE. Checks: rel L2 per
  tensor, no NaN, exact zeros for rows with no allowed key (dq) and for keys nobody
  attends (dk, dv). The interpret path is the GPU path of the backward kernels.
* Cross-lowering: ``jax.export`` of ``jit(grad(loss))`` with ``platforms=["cuda"]`` at
  every benchmark shape of the suite (docs/design.md#benchmarks) and D=256 (tracing and Mosaic GPU lowering; not
  ptxas). Determinism can only be tested on the GPU (``test_ranker_bwd_gpu.py``).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_ranker_grads,
    check_ranker_grads,
    gpu_interpret,
    hopper_small_config,
    races_detected,
    ranker_dead,
    ranker_grad_loss,
    ranker_kernel_inputs,
    ranker_reference_grads,
    run_interpret,
)

from attn_common import CapMethod, CapParams, KernelConfig, SegmentBounds
from attn_mosaic_gpu import ranker_attention
from attn_mosaic_gpu.ranker_bwd import SMEM_LIMIT_BYTES, bwd_smem_bytes, validate_bwd
from attn_mosaic_gpu.tuning import BackwardTuning
from attn_reference.ranker import ranker_attention as reference

INTERPRET = gpu_interpret()
SMALL = hopper_small_config()
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 1e-2}
TANH = CapParams(CapMethod.TANH, 5.0)
SOFT_SIGN = CapParams(CapMethod.SOFT_SIGN, 8.0)


def _mosaic_gpu_calls(mlir_text: str) -> int:
    """Mosaic GPU kernels in a lowered module: its ``mosaic_gpu*`` custom calls."""
    return len(re.findall(r"stablehlo\.custom_call @mosaic_gpu\w*\(", mlir_text))


def _check_grads(q, k, v, bounds, *, cap=None, use_lse=True, seed=0):
    w = jnp.asarray(np.random.default_rng(seed + 100).standard_normal(q.shape), jnp.float32)

    def kernel_loss(q, k, v):
        return ranker_grad_loss(
            ranker_attention, q, k, v, bounds, w, cap=cap, use_lse=use_lse,
            config=SMALL, interpret=INTERPRET,
        )  # fmt: skip

    got = run_interpret(jax.jit(jax.grad(kernel_loss, argnums=(0, 1, 2))), q, k, v)
    check_ranker_grads(got, q, k, v, bounds, w, cap=cap, use_lse=use_lse, tol=TOL[q.dtype.type])


@pytest.mark.slow  # interpret mode, > 15 s on 2 cores
def test_grad_soft_sign_empty_history_overlap_fp16():
    """fp16, soft_sign 8; empty history (candidates attend only themselves); candidates
    overlapping the history; SegmentBounds input."""
    q, k, v = ranker_kernel_inputs(1, 2, 160, 2, 2, 64, jnp.float16)
    bounds = SegmentBounds.from_array(jnp.array([[0, 0, 5, 133], [0, 100, 40, 150]]))
    _check_grads(q, k, v, bounds, cap=SOFT_SIGN, seed=1)


@pytest.mark.slow  # interpret mode, > 15 s on 2 cores
def test_grad_no_cap_empty_candidates_padding_row_out_only():
    """No cap, out-only loss (return_lse=False); S=260 unaligned; empty candidates and an
    all-padding batch row (every gradient of that row is exactly 0)."""
    q, k, v = ranker_kernel_inputs(2, 2, 260, 2, 2, 64, jnp.bfloat16)
    bounds = jnp.array([[20, 150, 150, 150], [0, 0, 0, 0]], jnp.int32)
    _check_grads(q, k, v, bounds, use_lse=False, seed=2)


@pytest.mark.slow  # interpret mode, > 15 s on 2 cores
def test_grad_ring_wraps_d128_gqa_unmasked_steps():
    """D=128 (3-slot ring): a 600-key history gives each query tile 10 KV steps and each
    key tile 3 heads x 10 query steps, so the rings wrap many times; history rows take the
    unmasked path on full history blocks; GQA 3:1 sums dK/dV over a head loop; a second
    row with a gap between history and candidates (separate block runs)."""
    q, k, v = ranker_kernel_inputs(4, 2, 700, 3, 1, 128, jnp.bfloat16)
    bounds = jnp.array([[0, 600, 600, 690], [64, 300, 450, 520]], jnp.int32)
    _check_grads(q, k, v, bounds, cap=SOFT_SIGN, seed=4)


@pytest.mark.slow  # interpret mode, > 15 s on 2 cores
def test_grad_soft_sign_80_huge_scores():
    """soft_sign 80 (the caps above are small): scores up to ~1e18 (``helpers.huge_keys``),
    GQA 2:1, padding, masked candidate blocks. (Keys up to 1e20 put dq 0.35 rel L2 from
    the float32 reference: the bf16 backward's limit at such scores.)"""
    from helpers import huge_keys

    q, k, v = ranker_kernel_inputs(9, 2, 200, 4, 2, 64, jnp.bfloat16)
    k = jnp.asarray(huge_keys(k.astype(jnp.float32), seed=10, max_exp=16)).astype(jnp.bfloat16)
    bounds = jnp.array([[0, 100, 100, 150], [0, 128, 128, 190]], jnp.int32)
    _check_grads(q, k, v, bounds, cap=CapParams(CapMethod.SOFT_SIGN, 80.0), seed=9)


@pytest.mark.slow  # interpret mode, > 15 s on 2 cores
def test_grad_ring_wraps_d64_tanh():
    """D=64 (4-slot ring) with 9 history blocks: the ring wraps; tanh cap."""
    q, k, v = ranker_kernel_inputs(5, 1, 640, 2, 1, 64, jnp.float16)
    bounds = jnp.array([[0, 576, 576, 640]], jnp.int32)
    _check_grads(q, k, v, bounds, cap=TANH, seed=5)


@pytest.mark.slow  # interpret mode, > 15 s on 2 cores
def test_grad_lone_tiles_owner_wg1_single_step():
    """Query tiles with one live half, the second (WG1's) with a single KV step, and
    candidates only; the padding rows' dQ is exactly 0. D=64 (4-slot ring), GQA 2:1,
    tanh."""
    q, k, v = ranker_kernel_inputs(8, 2, 260, 4, 2, 64, jnp.bfloat16)
    bounds = jnp.array([[70, 120, 120, 127], [0, 0, 200, 230]], jnp.int32)
    _check_grads(q, k, v, bounds, cap=TANH, seed=8)


@pytest.mark.slow  # 8-11 s each (two lowerings): in the quick tier the persistent dq kernel
# lowers in test_pipelined_smem_bytes_is_what_mosaic_allocates[128-3-132-0] and the knob
# reaches it through ranker_attention in test_kernel_axis_names_are_namespaced
@pytest.mark.parametrize(
    "name,bounds_shape",
    [("phoenix", (64, 4)), ("phoenix-packed", (64, 8, 4)), ("small-d64", (128, 4))],
)
def test_cross_lowering_persistent_dq_cuda(name, bounds_shape):
    """``dq_programs=132`` (one persistent dq program per H200 SM) lowers to three Mosaic
    GPU kernels at the suite shapes, and the knob reaches the dq kernel."""
    _, batch, seq, q_heads, kv_heads, head_dim, cap, dtype = next(
        s for s in LOWERING_SHAPES if s[0] == name.removesuffix("-packed")
    )

    def lowered(backward_tuning):
        def loss(q, k, v, bounds):
            out, lse = ranker_attention(
                q, k, v, bounds, cap=cap, return_lse=True, backward_tuning=backward_tuning
            )
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return jax.export.export(grad, platforms=["cuda"])(
            _sds(batch, seq, q_heads, head_dim, dtype=dtype),
            _sds(batch, seq, kv_heads, head_dim, dtype=dtype),
            _sds(batch, seq, kv_heads, head_dim, dtype=dtype),
            _sds(*bounds_shape, dtype=jnp.int32),
        ).mlir_module()

    text = lowered(BackwardTuning(dq_programs=132))
    assert _mosaic_gpu_calls(text) == 3
    assert text != lowered(BackwardTuning())


@pytest.mark.slow  # interpret mode, ~18 s on 2 cores
def test_grad_d256_gqa_soft_sign_fp16():
    """D=256 (the dk/dv kernel splits the head dim in two programs), GQA 2:1."""
    q, k, v = ranker_kernel_inputs(3, 1, 100, 2, 1, 256, jnp.float16)
    bounds = jnp.array([[3, 70, 70, 95]], jnp.int32)
    _check_grads(q, k, v, bounds, cap=SOFT_SIGN, seed=3)


# ------------------------------------------------------------------- cross-lowering


def _sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


# name, B, S, Hq, Hkv, D, cap, dtype  (the benchmark suite + D=256)
LOWERING_SHAPES = [
    ("phoenix", 64, 1152, 20, 4, 128, CapParams(CapMethod.SOFT_SIGN, 80.0), jnp.bfloat16),
    ("long", 8, 5120, 16, 16, 128, CapParams(CapMethod.TANH, 30.0), jnp.bfloat16),
    ("small-d64", 128, 640, 8, 8, 64, None, jnp.bfloat16),
    ("ragged", 64, 1152, 20, 4, 128, CapParams(CapMethod.SOFT_SIGN, 80.0), jnp.bfloat16),
    ("d256", 8, 1000, 16, 4, 256, CapParams(CapMethod.TANH, 30.0), jnp.bfloat16),
    ("d256-fp16", 4, 777, 8, 8, 256, None, jnp.float16),
]


# The quick tier lowers small-d64 (the pipelined kernels) and d256 (its own dk/dv kernel);
# the pipelined kernels at D=128 lower in test_pipelined_smem_bytes_is_what_mosaic_allocates;
# the suite's other shapes (~4-5 s each) are slow.
@pytest.mark.parametrize(
    "name,batch,seq,q_heads,kv_heads,head_dim,cap,dtype",
    [
        pytest.param(*s, id=s[0], marks=() if s[0] in ("small-d64", "d256") else pytest.mark.slow)
        for s in LOWERING_SHAPES
    ],
)
# The out-only loss lowers the same three kernels as out+lse (~4 s each): slow.
@pytest.mark.parametrize(
    "use_lse", [pytest.param(False, marks=pytest.mark.slow), True], ids=["out", "out+lse"]
)
def test_cross_lowering_grad_cuda(
    name, batch, seq, q_heads, kv_heads, head_dim, cap, dtype, use_lse
):
    def loss(q, k, v, bounds, w):
        return ranker_grad_loss(ranker_attention, q, k, v, bounds, w, cap=cap, use_lse=use_lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    exported = jax.export.export(grad, platforms=["cuda"])(
        _sds(batch, seq, q_heads, head_dim, dtype=dtype),
        _sds(batch, seq, kv_heads, head_dim, dtype=dtype),
        _sds(batch, seq, kv_heads, head_dim, dtype=dtype),
        _sds(batch, 4, dtype=jnp.int32),
        _sds(batch, seq, q_heads, head_dim, dtype=jnp.float32),
    )
    text = exported.mlir_module()
    # exactly the forward, dq and dk/dv kernels: three Mosaic GPU custom calls
    assert _mosaic_gpu_calls(text) == 3, (name, _mosaic_gpu_calls(text))
    dq, dk, dv = exported.out_avals
    assert dq.shape == (batch, seq, q_heads, head_dim) and dq.dtype == dtype
    assert dk.shape == dv.shape == (batch, seq, kv_heads, head_dim)
    assert dk.dtype == dv.dtype == dtype


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_backward_fits_shared_memory(head_dim, dtype):
    validate_bwd(head_dim, dtype)
    for name, need in bwd_smem_bytes(head_dim, dtype).items():
        assert need <= SMEM_LIMIT_BYTES, name


@pytest.mark.parametrize(
    "head_dim,stages,dq_programs,users",
    [
        pytest.param(64, 2, 0, 0, marks=pytest.mark.slow),
        pytest.param(64, 3, 0, 2, marks=pytest.mark.slow),
        pytest.param(64, 4, 132, 0, marks=pytest.mark.slow),
        (128, 2, 0, 2),  # packed rows
        pytest.param(128, 2, 132, 0, marks=pytest.mark.slow),
        (128, 3, 132, 0),  # 231,624 bytes: 824 under the limit
    ],
)
def test_pipelined_smem_bytes_is_what_mosaic_allocates(
    monkeypatch, head_dim, stages, dq_programs, users
):
    """``pipelined_smem_bytes`` (what ``pipelined_bwd`` checks before building) equals
    Mosaic GPU's own count for the dq and the dk/dv kernel, so a backward tuning is
    refused exactly when Mosaic would refuse it."""
    from helpers import count_mosaic_smem

    from attn_mosaic_gpu.ranker_bwd_pipelined import pipelined_bwd, pipelined_smem_bytes

    counted = count_mosaic_smem(monkeypatch)
    seq = 256
    fields = dict(
        batch=1, seq_pad=seq, q_heads=2, kv_heads=1, head_dim=head_dim, sm_scale=1.0, cap=TANH
    )
    sds = jax.ShapeDtypeStruct
    bounds = sds((1, users, 4) if users else (1, 4), jnp.int32)
    q = sds((1, seq, 2, head_dim), jnp.bfloat16)
    kv = sds((1, seq, 1, head_dim), jnp.bfloat16)
    vec = sds((1, 2, seq), jnp.float32)
    tuning = {"num_stages": stages, "dq_programs": dq_programs}

    def bwd(q, k, v, do, lse2, delta, bounds):
        return pipelined_bwd(
            q, k, v, do, lse2, delta, bounds, st_fields=fields, interpret=None,
            tuning=tuning, users=users,
        )  # fmt: skip

    jax.export.export(jax.jit(bwd), platforms=["cuda"])(q, kv, kv, q, vec, vec, bounds)
    need = pipelined_smem_bytes(
        head_dim, jnp.bfloat16, num_stages=stages, dq_programs=dq_programs, packed=bool(users)
    )
    assert counted == [need["dq"], need["dkv"]]


def test_backward_rejects_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        validate_bwd(96, jnp.bfloat16)


@pytest.mark.slow  # interpret mode, > 15 s on 2 cores
def test_schedule_knobs_do_not_change_results():
    """Ring depth changes the schedule only: bitwise-equal gradients (interpret mode)."""
    from attn_mosaic_gpu.ranker_bwd_pipelined import pipelined_bwd

    q, k, v = ranker_kernel_inputs(6, 1, 384, 2, 1, 128, jnp.bfloat16)
    do = ranker_kernel_inputs(7, 1, 384, 2, 1, 128, jnp.bfloat16)[0]
    bounds = jnp.array([[0, 300, 300, 380]], jnp.int32)
    out, lse = reference(
        *(x.astype(jnp.float32) for x in (q, k, v)), bounds, cap=SOFT_SIGN, return_lse=True
    )
    delta = jnp.einsum("bshd,bshd->bhs", out, do.astype(jnp.float32))
    lse2 = jnp.where(jnp.isfinite(lse), lse * np.log2(np.e), jnp.inf)
    fields = dict(
        batch=1, seq_pad=384, q_heads=2, kv_heads=1, head_dim=128,
        sm_scale=1 / np.sqrt(128), cap=SOFT_SIGN,
    )  # fmt: skip

    def run(**tuning):
        got = pipelined_bwd(
            q, k, v, do, lse2, delta, bounds, st_fields=fields, interpret=INTERPRET, tuning=tuning
        )
        assert not races_detected()
        return [np.asarray(g.astype(jnp.float32)) for g in got]

    base = run(num_stages=2)
    for name, a, b in zip(("dq", "dk", "dv"), base, run(num_stages=3), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} num_stages=3")
    # exp2 and the soft_sign reciprocal on the FMA pipe for some or all columns: the
    # polynomial exp2 (1e-4) and Newton reciprocal (3e-7) move only bf16 rounding.
    for tuning in (
        {"exp2_fma_cols": 32, "rcp_fma_cols": 64},
        {"exp2_fma_cols": 64, "rcp_fma_cols": 8},
    ):
        for name, a, b in zip(("dq", "dk", "dv"), base, run(num_stages=2, **tuning), strict=True):
            assert np.linalg.norm(a - b) <= 5e-3 * np.linalg.norm(b), f"{name} {tuning}"


@pytest.mark.slow  # interpret mode, ~60 s on 2 cores
@pytest.mark.parametrize("head_dim", [64, 128])
def test_persistent_dq_matches_per_tile(head_dim):
    """``dq_programs`` (persistent dq programs walking the tiles, fixed operands
    double-buffered, the K/V ring running on across tiles): bitwise the per-tile dq, with
    programs that get two tiles or more, one tile, or none (more programs than tiles);
    a row with history and candidates, an all-padding row (zero-step tiles between
    tiles with steps), a short row; GQA 2:1. No race."""
    from attn_mosaic_gpu.ranker_bwd_pipelined import pipelined_bwd

    batch, seq = 3, 384
    q, k, v = ranker_kernel_inputs(11, batch, seq, 2, 1, head_dim, jnp.bfloat16)
    do = ranker_kernel_inputs(12, batch, seq, 2, 1, head_dim, jnp.bfloat16)[0]
    bounds = jnp.array([[0, 300, 300, 380], [0, 0, 0, 0], [10, 70, 70, 75]], jnp.int32)
    out, lse = reference(
        *(x.astype(jnp.float32) for x in (q, k, v)), bounds, cap=SOFT_SIGN, return_lse=True
    )
    delta = jnp.einsum("bshd,bshd->bhs", out, do.astype(jnp.float32))
    lse2 = jnp.where(jnp.isfinite(lse), lse * np.log2(np.e), jnp.inf)
    fields = dict(
        batch=batch, seq_pad=seq, q_heads=2, kv_heads=1, head_dim=head_dim,
        sm_scale=1 / np.sqrt(head_dim), cap=SOFT_SIGN,
    )  # fmt: skip

    def dq(**tuning):
        got = pipelined_bwd(
            q, k, v, do, lse2, delta, bounds, st_fields=fields, interpret=INTERPRET, tuning=tuning
        )[0]
        assert not races_detected(), tuning
        return np.asarray(got.astype(jnp.float32))

    per_tile = dq()
    assert np.abs(per_tile).sum() > 0
    # 18 tiles: 4 programs walk 4-5 tiles each, 1 program all of them, 40 programs one
    # or none; with 3 ring slots a tile's steps start at any slot
    for tuning in ({"dq_programs": 4}, {"dq_programs": 1}, {"dq_programs": 40}):
        np.testing.assert_array_equal(dq(**tuning), per_tile, err_msg=str(tuning))
    if head_dim == 64:
        np.testing.assert_array_equal(dq(dq_programs=5, num_stages=3), per_tile)


@pytest.mark.parametrize(
    "head_dim,tuning",
    [(64, None), (128, None), (256, None), (128, BackwardTuning(dq_programs=4))],
    ids=["d64", "d128", "d256", "d128-persistent-dq"],
)
def test_kernel_axis_names_are_namespaced(head_dim, tuning):
    """Every axis a kernel names (grid, warpgroups, axis_index) carries the package
    prefix. ``lax.axis_index`` also sees the mesh axes of an enclosing ``shard_map``: with
    a plain ``"batch"`` grid axis, batch sharding over a mesh axis named ``"batch"`` gave
    wrong outputs and NaN gradients on two H200s (interpret mode cannot run multi-device,
    so this structural check stands in for it on the CPU)."""
    import re

    from attn_mosaic_gpu import _axes

    q = jax.ShapeDtypeStruct((1, 256, 2, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 1, head_dim), jnp.bfloat16)
    bounds = jax.ShapeDtypeStruct((1, 4), jnp.int32)

    def fwd_bwd(q, k, v, b):
        def loss(q, k, v):
            out, lse = ranker_attention(q, k, v, b, return_lse=True, backward_tuning=tuning)
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = str(jax.make_jaxpr(fwd_bwd)(q, kv, kv, bounds))
    if tuning is not None:
        assert f"grid_names=('{_axes.PROGRAMS}',)" in text
    names = set(re.findall(r"axis_name=(\w+)", text))
    for grid in re.findall(r"grid_names=\(([^)]*)\)", text):
        names |= {n.strip(" '") for n in grid.split(",") if n.strip(" '")}
    assert names, "no kernel axes found: the check inspects nothing"
    assert names <= set(_axes.KERNEL_AXES), names - set(_axes.KERNEL_AXES)
    kernels = len(re.findall(r"grid_names=", text))
    assert kernels == 3, f"{kernels} kernels, expected 3: fwd, dq and dk/dv"


def test_kernel_config_has_no_backward_tile_fields():
    """The backward kernels use fixed 64-row blocks: there is no knob that is ignored."""
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    assert not fields & {"block_q_bwd", "block_kv_bwd", "query_block", "num_dma_buffers"}
    with pytest.raises(TypeError):
        KernelConfig(block_kv_bwd=128)


@pytest.mark.slow  # ~5 s each: packed rows' dq and dk/dv kernels lower in the quick
# tier in test_pipelined_smem_bytes_is_what_mosaic_allocates[128-2-0-2], the forward's in
# test_ranker_fwd_cpu.py's test_smem_bytes_is_what_mosaic_allocates (users=2)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cross_lowering_packed_grad_cuda(head_dim):
    """Packed bounds [B, 8, 4] at the phoenix shape: forward, dq and dk/dv lower to three
    Mosaic GPU kernels (the step tables are XLA ops outside them)."""

    def f(q, k, v, bounds):
        def loss(q, k, v):
            out, lse = ranker_attention(q, k, v, bounds, cap=SOFT_SIGN, return_lse=True)
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    sds = jax.ShapeDtypeStruct
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        sds((64, 1152, 20, head_dim), jnp.bfloat16),
        sds((64, 1152, 4, head_dim), jnp.bfloat16),
        sds((64, 1152, 4, head_dim), jnp.bfloat16),
        sds((64, 8, 4), jnp.int32),
    )
    assert _mosaic_gpu_calls(exported.mlir_module()) == 3


PACKED = jnp.array(
    [
        [[0, 60, 60, 70], [70, 150, 150, 170], [170, 170, 175, 180], [0, 0, 0, 0]],
        [[190, 250, 250, 256], [0, 0, 0, 0], [5, 120, 120, 121], [121, 180, 184, 190]],
    ],
    jnp.int32,
)


@pytest.mark.slow  # interpret mode, > 30 s on 2 cores
@pytest.mark.parametrize(
    "head_dim, cap, tuning",
    [(64, SOFT_SIGN, None), (128, None, None), (128, SOFT_SIGN, BackwardTuning(dq_programs=3))],
    ids=["d64-ss", "d128", "d128-ss-persistent-dq"],
)
def test_grad_packed_users(head_dim, cap, tuning):
    """Packed rows [B, U, 4] through the forward and both backward kernels: users
    sharing blocks, unaligned boundaries, an empty-history user, gaps, an unused slot,
    padding at the end; GQA 2:1; LSE z-loss. Gradients against the reference's
    autodiff, exact zeros where nothing is allowed. Also with persistent dq programs
    (``dq_programs``: the packed step lists and key tables read per walked tile)."""
    q, k, v = ranker_kernel_inputs(8, 2, 256, 4, 2, head_dim, jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)

    def kernel_loss(q, k, v):
        return ranker_grad_loss(
            ranker_attention, q, k, v, PACKED, w, cap=cap, use_lse=True, interpret=INTERPRET,
            backward_tuning=tuning,
        )  # fmt: skip

    got = run_interpret(jax.jit(jax.grad(kernel_loss, argnums=(0, 1, 2))), q, k, v)
    want = ranker_reference_grads(q, k, v, PACKED, w, cap=cap, use_lse=True)
    dead = ranker_dead(PACKED, q.shape[0], q.shape[1])
    assert_ranker_grads(got, want, dead, dtype=q.dtype, tol=TOL[q.dtype.type])


def test_packed_rows_need_pipelined_head_dims():
    """Hopper takes packed rows for D 64 and 128 (the pipelined backward); D=256 falls
    back (dispatch) or is refused by name."""
    from attn_mosaic_gpu.ranker import supports

    q = jax.ShapeDtypeStruct((2, 256, 4, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 256), jnp.bfloat16)
    assert "head_dim" in supports("ranker_attention", q, kv, kv, PACKED)
    q128 = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    kv128 = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    assert supports("ranker_attention", q128, kv128, kv128, PACKED) is None


def _inline_mgpu_per_kernel(fn, *args) -> list[int]:
    """For each Mosaic GPU kernel in the jaxpr of ``fn(*args)`` (compiled path, traced
    on the CPU), how many inline Mosaic GPU blocks its body holds."""
    from jax.extend import core

    def subjaxprs(eqn):
        for value in eqn.params.values():
            for x in value if isinstance(value, tuple | list) else (value,):
                if isinstance(x, core.ClosedJaxpr):
                    yield x.jaxpr
                elif isinstance(x, core.Jaxpr):
                    yield x

    def count(jaxpr):
        return sum(
            (eqn.primitive.name == "inline_mgpu_p") + sum(map(count, subjaxprs(eqn)))
            for eqn in jaxpr.eqns
        )

    def kernels(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "mpmd_map":  # a plgpu.kernel launch
                yield sum(map(count, subjaxprs(eqn)))
            else:
                for sub in subjaxprs(eqn):
                    yield from kernels(sub)

    return list(kernels(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_compiled_soft_sign_uses_mufu_reciprocal(head_dim):
    """The compiled forward, dq and dk/dv kernels take soft_sign's MUFU reciprocal from
    ``fastmath.fast_reciprocal_tile`` (inline ``rsqrt.approx.ftz.f32``: without it ptxas
    guards every element against subnormals, ~20 % of the forward's instructions per
    step); no cap, no reciprocal."""
    b, s = 2, 256
    args = (
        _sds(b, s, 4, head_dim), _sds(b, s, 2, head_dim), _sds(b, s, 2, head_dim),
        _sds(b, 4, dtype=jnp.int32),
    )  # fmt: skip
    config = KernelConfig(block_q=64, block_kv=128, num_stages=2)  # reciprocal all on MUFU

    def grad(cap):
        def loss(q, k, v, bounds):
            out = ranker_attention(q, k, v, bounds, cap=cap, config=config)
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))

    with_cap = _inline_mgpu_per_kernel(grad(CapParams(CapMethod.SOFT_SIGN, 80.0)), *args)
    assert len(with_cap) == 3 and all(n > 0 for n in with_cap), with_cap
    assert _inline_mgpu_per_kernel(grad(None), *args) == [0, 0, 0]
