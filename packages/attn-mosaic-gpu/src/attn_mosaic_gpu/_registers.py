"""The register split of the Hopper kernels that run two compute warpgroups and one
memory warpgroup (``setmaxnreg``)."""

from __future__ import annotations

# The kernels launch with 168 registers per thread (3 warpgroups x 128 threads share the
# SM's 64K); setmaxnreg may move them between warpgroups, but the three counts must sum
# to at most 3 x 168, or an increase waits forever.
REGISTER_POOL = 504
MIN_REGISTERS = 24  # setmaxnreg's floor
LAUNCH_REGISTERS = REGISTER_POOL // 3


def memory_registers(compute_registers: int, compute_wgs: int = 2) -> int:
    """What the memory warpgroup keeps when each of ``compute_wgs`` compute warpgroups
    takes ``compute_registers``."""
    return REGISTER_POOL - compute_wgs * compute_registers
