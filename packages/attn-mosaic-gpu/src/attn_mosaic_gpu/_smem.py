"""Shared-memory sizing rules common to the Hopper ranker kernels."""

from __future__ import annotations

# Opt-in shared memory per block on H100/H200 (sm_90): 227 KiB.
SMEM_LIMIT_BYTES = 227 * 1024
# Swizzled buffers are 1024-byte aligned.
SMEM_ALIGN = 1024


def round_up(x: int, m: int) -> int:
    """The smallest multiple of ``m`` that is ``>= x``."""
    return -(-x // m) * m
