"""The warp specialization of the Hopper kernels: two compute warpgroups and one memory
warpgroup per program, their register split (``setmaxnreg``), and the one naming rule of
the barriers between them.

Every barrier of the package's kernels (the registries: ``sparse_mla_config``,
``ranker_config``) is named ``<data>_<event>`` (as FA3's ``named_barrier.hpp`` keeps its
barriers in one enum by one rule), the event one of:

* ``landed``: asynchronous copies of ``data`` (TMA, or ``cp.async`` on a hand-kept
  mbarrier) have landed in shared memory;
* ``ready``: a warpgroup stored ``data`` itself and published it (``commit_smem``);
* ``free``: every reader of ``data`` is done; its writer may overwrite it;
* ``turn`` (``<resource>_turn``): whose turn it is on a shared resource (the ranker
  forward's ping-pong on the tensor cores).

Per step each barrier gets one arrival per producer (or reader) and one wait per
consumer.
"""

from __future__ import annotations

# The kernels launch with 168 registers per thread (3 warpgroups x 128 threads share the
# SM's 64K); setmaxnreg may move them between warpgroups, but the three counts must sum
# to at most 3 x 168, or an increase waits forever.
REGISTER_POOL = 504
MIN_REGISTERS = 24  # setmaxnreg's floor
LAUNCH_REGISTERS = REGISTER_POOL // 3
COMPUTE_WGS = 2  # the memory warpgroup is warpgroup COMPUTE_WGS (num_threads = 3)
WARPGROUP_THREADS = 128
# setmaxnreg of each compute warpgroup (the memory warpgroup keeps 40): the ranker
# forward's and backward's and the sparse-MLA kernels' default. On the H200 the sparse-MLA
# forward ran 1.09-1.10x faster than with 240/24, and as fast with 224/56; the ranker
# forward takes 232-240 (``KernelConfig.compute_registers``, a tuned knob).
COMPUTE_REGISTERS = 232
# The most a compute warpgroup may take: what leaves the memory warpgroup setmaxnreg's
# floor (the ranker dk/dv kernel at D = 128 runs at it).
MAX_COMPUTE_REGISTERS = (REGISTER_POOL - MIN_REGISTERS) // COMPUTE_WGS  # 240


def memory_registers(compute_registers: int, compute_wgs: int = COMPUTE_WGS) -> int:
    """What the memory warpgroup keeps when each of ``compute_wgs`` compute warpgroups
    takes ``compute_registers``."""
    return REGISTER_POOL - compute_wgs * compute_registers
