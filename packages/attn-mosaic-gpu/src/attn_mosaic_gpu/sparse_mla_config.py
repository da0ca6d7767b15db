"""The configuration of the Hopper sparse-MLA kernels, forward and backward: one home for
every size they are built on.

One schedule ships, so the kernels have no knobs: every size is a constant here, and the
kernels (``sparse_mla_kernel``, ``sparse_mla_bwd_kernel``, their shared gathers in
``_sparse_mla_rows``) and their callers (the row tables of ``sparse_mla``, the benchmark's
bytes estimate) read them from here. ``SparseMlaKernelConfig`` is the public name of the
schedule; it holds no field.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

from attn_mosaic_gpu._registers import COMPUTE_REGISTERS, COMPUTE_WGS, WARPGROUP_THREADS

__all__ = [
    "BLOCK_K",
    "CHUNK",
    "COMPUTE_REGISTERS",
    "COMPUTE_WGS",
    "HEADS_PER_PROGRAM",
    "KV_CHUNK",
    "PAIR_ROWS",
    "PARTS_BYTES",
    "ROPE",
    "SWIZZLE",
    "THREADS",
    "TILE",
    "TOKEN_LAG",
    "SparseMlaKernelConfig",
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
