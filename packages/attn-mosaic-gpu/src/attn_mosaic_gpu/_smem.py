"""Shared-memory sizing rules common to the Hopper ranker kernels."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

# Opt-in shared memory per block on H100/H200 (sm_90): 227 KiB.
SMEM_LIMIT_BYTES = 227 * 1024
# Swizzled buffers are 1024-byte aligned.
SMEM_ALIGN = 1024
# Pallas reserves this scratch for any kernel with a reduction (a row max or sum), whether
# the reduction's layout needs it or not: CompilerParams.reduction_scratch_bytes.
REDUCTION_SCRATCH_BYTES = plgpu.CompilerParams().reduction_scratch_bytes


def tile_transforms() -> tuple:
    """The shared-memory layout of the ranker kernels' bf16/fp16 tiles (Q, K, V, dO, O, P,
    dS): (8, 64) tiles with the 128-byte swizzle, what TMA and wgmma both take."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def round_up(x: int, m: int) -> int:
    """The smallest multiple of ``m`` that is ``>= x``."""
    return -(-x // m) * m
