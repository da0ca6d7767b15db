"""Shared-memory sizing rules common to the Hopper ranker kernels."""

from __future__ import annotations

from collections.abc import Iterable

from jax.experimental.pallas import mosaic_gpu as plgpu

# Opt-in shared memory per block on H100/H200 (sm_90): 227 KiB.
SMEM_LIMIT_BYTES = 227 * 1024
# Swizzled buffers are 1024-byte aligned.
SMEM_ALIGN = 1024
# One mbarrier.
BARRIER_BYTES = 8


def tile_transforms() -> tuple:
    """The shared-memory layout of the ranker kernels' bf16/fp16 tiles (Q, K, V, dO, O, P,
    dS): (8, 64) tiles with the 128-byte swizzle, what TMA and wgmma both take."""
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def round_up(x: int, m: int) -> int:
    """The smallest multiple of ``m`` that is ``>= x``."""
    return -(-x // m) * m


def allocated_bytes(buffers: Iterable[int], barriers: int) -> int:
    """Shared memory Mosaic GPU allocates for a kernel's scratch: each buffer (sizes in
    bytes, 0 for an absent one) 1024-byte aligned, plus ``barriers`` mbarriers. A kernel
    with a reduction that Pallas reserves scratch for (``CompilerParams.
    reduction_scratch_bytes``) needs that on top; the ranker kernels have none or turn
    it off."""
    return sum(round_up(size, SMEM_ALIGN) for size in buffers) + BARRIER_BYTES * barriers
