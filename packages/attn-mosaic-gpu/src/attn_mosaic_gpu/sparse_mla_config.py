"""The configuration of the Hopper sparse-MLA kernels, forward and backward: every size
they are built on, their shared memory and its budget, and their barriers.

One schedule ships, so the kernels have no knobs: every size is a constant here, and the
kernels (``sparse_mla_kernel``, ``sparse_mla_bwd_kernel``, their shared gathers in
``_sparse_mla_rows``) and their callers (the row tables of ``sparse_mla``, the benchmark's
bytes estimate) read them from here. ``SparseMlaKernelConfig`` is the public name of the
schedule; it holds no field.

* Shared memory: ``ForwardBuffers`` / ``BackwardBuffers`` name every buffer with its
  shape; ``forward_buffers`` / ``backward_buffers`` are what the kernels allocate and
  ``smem_bytes`` counts (exactly what Mosaic GPU allocates:
  ``tests/test_sparse_mla_cpu.py`` checks it), against ``SMEM_LIMIT_BYTES``.
* Barriers: ``ForwardBarriers`` / ``BackwardBarriers``, one registry for the family,
  named by the package's rule (``_registers``: ``<data>_landed`` / ``_ready`` /
  ``_free``). What the two kernels share: the key block's ``Part`` barriers (``part_landed``, the
  hand-kept ``cp.async`` barriers in shared memory, ``PART_LANDED_WORDS``; in interpret
  mode ``part_ready``: the memory WG copies by plain stores and publishes), ``p_ready``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_mosaic_gpu._registers import COMPUTE_REGISTERS, COMPUTE_WGS, WARPGROUP_THREADS
from attn_mosaic_gpu._smem import SMEM_LIMIT_BYTES, allocated_bytes

__all__ = [
    "BLOCK_K",
    "CHUNK",
    "COMPUTE_REGISTERS",
    "COMPUTE_WGS",
    "HEADS_PER_PROGRAM",
    "KV_CHUNK",
    "MAX_DV",
    "PAIR_ROWS",
    "PARTS_BYTES",
    "PART_LANDED_WORDS",
    "ROPE",
    "SWIZZLE",
    "THREADS",
    "TILE",
    "TOKEN_LAG",
    "VALUE_MULTIPLE",
    "BackwardBarriers",
    "BackwardBuffers",
    "ForwardBarriers",
    "ForwardBuffers",
    "Part",
    "SparseMlaKernelConfig",
    "backward_barriers",
    "backward_buffers",
    "backward_scratch",
    "backward_smem_bytes",
    "forward_barriers",
    "forward_buffers",
    "forward_scratch",
    "forward_smem_bytes",
    "smem_bytes",
    "swizzled_tiles",
    "unsupported_dv",
]

# --------------------------------------------------------------------- the schedule
HEADS_PER_PROGRAM = 64  # wgmma M rows per warpgroup; both compute WGs share the heads
ROPE = 64  # rope features of a key row (Dk - Dv)
# Key rows per block: the wgmma N of S (forward, backward) and dP (backward), the M of
# the backward's key gradient. The forward walks a pair of blocks per step (one per
# compute WG); 64-row blocks ran 1.3x faster than 32-row ones (docs/sparse_mla_gpu.md).
BLOCK_K = 64
PAIR_ROWS = COMPUTE_WGS * BLOCK_K  # the forward's step; row tables are padded to it
# Launch order: a token's head groups this many tokens apart, so the later ones find its
# rows in L2 (fetched by head group 0): 1.01-1.04x faster than all of head group 0 first.
TOKEN_LAG = 8
THREADS = WARPGROUP_THREADS  # threads of the memory WG that issue the gather
# Latent features: each compute WG takes Dv / 2 value columns, whole 64-wide tiles.
VALUE_MULTIPLE = COMPUTE_WGS * 64
KV_CHUNK = 64  # the backward's key-gradient columns per accumulator
PARTS_BYTES = 8 << 30  # the deterministic backward's parts buffer, at most (token chunks)

# --------------------------------------------------------------------- the gather
CHUNK = 8  # bf16 elements per 16-byte cp.async
SWIZZLE = 128  # bytes: wgmma's A and B share one swizzle; 64-row blocks take 128
TILE = SWIZZLE // 2  # bf16 columns of a swizzled tile


@dataclasses.dataclass(frozen=True, init=False)
class SparseMlaKernelConfig:
    """The Hopper sparse-MLA kernels' schedule: no knobs.

    One schedule ships: one pair of ``BLOCK_K``-row blocks per step, each block in two
    parts with their own barriers, and the one-way max exchange (``sparse_mla_kernel``).
    Its sizes are this module's constants; ``block_k``, ``num_stages`` and ``exchange``
    are read-only class constants. On the H200 the kernel alone ran 3.84 / 4.49 ms on
    4096 tokens x 128 heads x 2048 rows of an 8K / 128K cache (docs/sparse_mla_gpu.md).

    ``SparseMlaKernelConfig()`` is the one value. The spelled-out form
    ``SparseMlaKernelConfig(64, 1, "one_way")`` is deprecated (a ``DeprecationWarning``);
    any other value is a ``ValueError``.
    """

    block_k: ClassVar[int] = BLOCK_K
    num_stages: ClassVar[int] = 1
    exchange: ClassVar[str] = "one_way"

    def __init__(self, block_k: int | None = None, num_stages: int | None = None,
                 exchange: str | None = None) -> None:  # fmt: skip
        given = {"block_k": block_k, "num_stages": num_stages, "exchange": exchange}
        shipped = {name: getattr(type(self), name) for name in given}
        for name, value in given.items():
            if value is not None and value != shipped[name]:
                raise ValueError(
                    f"{name}: got {value!r}, expected {shipped[name]!r}: the kernel ships "
                    f"one schedule, {tuple(shipped.values())} (commit da2ec0c has the others)"
                )
        spelled = [name for name, value in given.items() if value is not None]
        if spelled:
            warnings.warn(
                f"SparseMlaKernelConfig({', '.join(spelled)}=...): the schedule has no "
                "knobs, these are constants (attn_mosaic_gpu.sparse_mla_config); pass "
                "SparseMlaKernelConfig() or None",
                DeprecationWarning,
                stacklevel=2,
            )


# --------------------------------------------------------------------- shared memory


class Part(enum.IntEnum):
    """A part of a key block, valued as the index of its barriers (``part_landed``,
    ``part_ready``, ``part_free``). The forward's pair: block 0 is WG0's, block 1 WG1's;
    the backward's one block is block 0. Part ``L`` holds latent features 0-255 (WG0's
    value half), part ``R`` latent features 256-511 (WG1's value half) and the rope
    features."""

    L0 = 0
    R0 = 1
    L1 = 2
    R1 = 3

    @classmethod
    def of(cls, block: int, half: str) -> Part:
        return cls[f"{half}{block}"]

    @property
    def block(self) -> int:
        return int(self.name[1])

    @property
    def half(self) -> str:
        return self.name[0]


PART_LANDED_WORDS = 2 * len(Part)  # the hand-kept mbarriers: two 32-bit words each


def swizzled_tiles():
    """Every wgmma operand's shared-memory layout: 64-wide tiles, 128-byte swizzle."""
    return (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(SWIZZLE))


class ForwardBuffers(NamedTuple):
    """The forward kernel's shared memory (216 of the 227 KiB at Dv = 512 are Q and the
    pair). A leading axis of 1 is for ``p & opaque_zero`` addressing."""

    q_lat: Any  # [1, 64, Dv] bf16: Q's latent features
    q_rope: Any  # [1, 64, 64] bf16: Q's rope features
    k_lat: Any  # [2, 64, Dv] bf16: the pair's blocks' latent features (parts L, R)
    k_rope: Any  # [2, 64, 64] bf16: their rope features (part R); k_rope[0] then WG0's P
    p_wg1: Any  # [1, 64, 64] bf16: WG1's P
    stats: Any  # [2, 64] f32: each compute WG's running max, at the end its row sums
    part_landed: Any  # [8] u32: the hand-kept Part barriers (None in interpret mode)


class BackwardBuffers(NamedTuple):
    """The backward kernel's shared memory (224 of the 227 KiB at Dv = 512)."""

    q_lat: Any  # [64, Dv] bf16: Q's latent features
    q_rope: Any  # [64, 64] bf16: Q's rope features
    do: Any  # [64, Dv] bf16: dO
    k_lat: Any  # [1, 64, Dv] bf16: the block's latent features (parts L and R)
    k_rope: Any  # [1, 64, 64] bf16: its rope features (part R)
    p16: Any  # [64, 64] bf16: P of the block
    ds16: Any  # [64, 64] bf16: dS of the block (sm_scale applied)
    stats: Any  # [2, 64] f32: lse2, delta of the program's heads
    part_landed: Any  # [8] u32: the hand-kept Part barriers (None in interpret mode)


def _part_landed(interpret: bool):
    return None if interpret else plgpu.SMEM((PART_LANDED_WORDS,), jnp.uint32)


def forward_buffers(dv: int, *, interpret: bool) -> ForwardBuffers:
    tiled = swizzled_tiles()
    bf16, heads = jnp.bfloat16, HEADS_PER_PROGRAM
    return ForwardBuffers(
        q_lat=plgpu.SMEM((1, heads, dv), bf16, transforms=tiled),
        q_rope=plgpu.SMEM((1, heads, ROPE), bf16, transforms=tiled),
        k_lat=plgpu.SMEM((COMPUTE_WGS, BLOCK_K, dv), bf16, transforms=tiled),
        k_rope=plgpu.SMEM((COMPUTE_WGS, BLOCK_K, ROPE), bf16, transforms=tiled),
        p_wg1=plgpu.SMEM((1, heads, BLOCK_K), bf16, transforms=tiled),
        stats=plgpu.SMEM((COMPUTE_WGS, heads), jnp.float32),
        part_landed=_part_landed(interpret),
    )


def backward_buffers(dv: int, *, interpret: bool) -> BackwardBuffers:
    tiled = swizzled_tiles()
    bf16, heads = jnp.bfloat16, HEADS_PER_PROGRAM
    return BackwardBuffers(
        q_lat=plgpu.SMEM((heads, dv), bf16, transforms=tiled),
        q_rope=plgpu.SMEM((heads, ROPE), bf16, transforms=tiled),
        do=plgpu.SMEM((heads, dv), bf16, transforms=tiled),
        k_lat=plgpu.SMEM((1, BLOCK_K, dv), bf16, transforms=tiled),
        k_rope=plgpu.SMEM((1, BLOCK_K, ROPE), bf16, transforms=tiled),
        p16=plgpu.SMEM((heads, BLOCK_K), bf16, transforms=tiled),
        ds16=plgpu.SMEM((heads, BLOCK_K), bf16, transforms=tiled),
        stats=plgpu.SMEM((2, heads), jnp.float32),
        part_landed=_part_landed(interpret),
    )


def forward_scratch(dv: int, *, interpret: bool):
    """The forward's ``(buffers, barriers)``."""
    return forward_buffers(dv, interpret=interpret), forward_barriers()


def backward_scratch(dv: int, *, interpret: bool):
    """The backward's ``(buffers, barriers)``."""
    return backward_buffers(dv, interpret=interpret), backward_barriers()


# --------------------------------------------------------------------- barriers
# The registry (the naming rule is in the module docstring). Field order is allocation
# order.


class ForwardBarriers(NamedTuple):
    """The forward kernel's Pallas barriers (its ``part_landed`` are in
    ``ForwardBuffers``)."""

    # [4] per Part: the memory WG's plain copies are published (interpret mode). Compiled,
    # the copies arrive on ``part_landed`` and these stay unused; they are allocated
    # (32 bytes, 4 inits) all the same: leaving them out changes the compiled kernel.
    part_ready: Any
    part_free: Any  # [4] per Part: its last reader is done; the memory WG may refill it
    q_landed: Any  # [2]: Q's latent / rope features (Q_LATENT, Q_ROPE)
    sums_ready: Any  # 2 arrivals, one per compute WG: its row sums are in ``stats``
    max_ready: Any  # [2] per compute WG: its running max of the pair is in ``stats``
    p_ready: Any  # [2] per compute WG: its P of the pair is in shared memory


Q_LATENT, Q_ROPE = 0, 1  # the forward's two TMA copies of Q: its ``q_landed`` barriers


class BackwardBarriers(NamedTuple):
    """The backward kernel's Pallas barriers (its ``part_landed`` are in
    ``BackwardBuffers``)."""

    part_ready: Any  # [4] per Part, interpret mode only (as the forward's)
    inputs_landed: Any  # INPUT_COPIES arrivals: Q (latent, rope), dO, lse2 and delta
    block_free: Any  # 2 arrivals, one per compute WG: done with the block
    p_ready: Any  # WG0's P of the block is in ``p16``
    ds_ready: Any  # WG1's dS of the block is in ``ds16``
    p_free: Any  # WG1 is done reading ``p16``
    ds_free: Any  # WG0 is done reading ``ds16``


INPUT_COPIES = 5  # the backward's TMA copies of its inputs, one arrival each


def forward_barriers() -> ForwardBarriers:
    parts = len(Part)
    return ForwardBarriers(
        part_ready=plgpu.Barrier(num_barriers=parts),
        part_free=plgpu.Barrier(num_arrivals=1, num_barriers=parts),
        q_landed=plgpu.Barrier(num_barriers=2),
        sums_ready=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
        max_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        p_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
    )


def backward_barriers() -> BackwardBarriers:
    return BackwardBarriers(
        part_ready=plgpu.Barrier(num_barriers=len(Part)),
        inputs_landed=plgpu.Barrier(num_arrivals=INPUT_COPIES),
        block_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
        p_ready=plgpu.Barrier(),
        ds_ready=plgpu.Barrier(),
        p_free=plgpu.Barrier(),
        ds_free=plgpu.Barrier(),
    )


# --------------------------------------------------------------------- the budget


def smem_bytes(buffers, barriers) -> int:
    """Shared memory Mosaic GPU allocates for these buffers and barriers (neither kernel
    reserves reduction scratch: ``reduction_scratch_bytes=0``)."""
    sizes = [math.prod(b.shape) * jnp.dtype(b.dtype).itemsize for b in buffers if b is not None]
    return allocated_bytes(sizes, sum(math.prod(b.num_barriers) for b in barriers))


def forward_smem_bytes(dv: int) -> int:
    """The compiled forward kernel's shared memory at ``dv`` latent features."""
    return smem_bytes(*forward_scratch(dv, interpret=False))


def backward_smem_bytes(dv: int) -> int:
    """The compiled backward kernel's shared memory at ``dv`` latent features."""
    return smem_bytes(*backward_scratch(dv, interpret=False))


def _fits(dv: int) -> bool:
    return max(forward_smem_bytes(dv), backward_smem_bytes(dv)) <= SMEM_LIMIT_BYTES


# The most latent features the kernels take: Q and a key block of each in shared memory.
MAX_DV = max(
    dv for dv in range(VALUE_MULTIPLE, 8 * VALUE_MULTIPLE + 1, VALUE_MULTIPLE) if _fits(dv)
)


def unsupported_dv(dv: int, name: str = "dv") -> str | None:
    """Why the kernels cannot take ``dv`` latent features (``None``: they can)."""
    if dv % VALUE_MULTIPLE or dv < VALUE_MULTIPLE:
        return f"{name}: got {dv}, the Hopper kernel needs a positive multiple of {VALUE_MULTIPLE}"
    if dv > MAX_DV:
        need = max(forward_smem_bytes(dv), backward_smem_bytes(dv))
        return (
            f"{name}: got {dv}, the Hopper kernels take at most {MAX_DV} (at {dv} they need "
            f"{need} bytes of shared memory, more than the {SMEM_LIMIT_BYTES} of a block on "
            "sm_90)"
        )
    return None
