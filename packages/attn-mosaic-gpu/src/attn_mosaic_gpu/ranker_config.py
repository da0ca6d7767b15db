"""The configuration of the Hopper ranker kernels: the forward (``ranker_fwd``), the
pipelined dq and dk/dv kernels (``ranker_bwd_pipelined``, D 64 and 128) and the simple
D = 256 ones (``ranker_bwd_d256``): their knobs and fixed sizes, the heuristics that pick
the knobs, their shared memory, its budget, and their barriers.

* Knobs: the forward's ``attn_common.KernelConfig`` (``block_q``, ``block_kv``,
  ``num_stages``, ``exp2_fma_cols``, ``rcp_fma_cols``, ``programs``,
  ``compute_registers``), checked by ``validate_config``; the pipelined backward's
  ``BackwardTuning`` (``num_stages``, ``exp2_fma_cols``, ``rcp_fma_cols``,
  ``dq_programs``), checked by ``check_backward_knobs``. The backward's blocks are fixed:
  ``BLOCK`` = 64 rows (one wgmma M per warpgroup), for both backward kernel families.
* Heuristics: ``default_config`` (the forward's tiling per D) and ``pipelined_stages``
  (the backward's ring depth per D); the tuned tables (``tuning.lookup``) come first.
* Shared memory: ``forward_scratch`` / ``dq_scratch`` / ``dkv_scratch`` are the buffers
  (a shape per buffer) and barriers the kernels allocate, and ``smem_bytes`` /
  ``pipelined_smem_bytes`` count them (exactly what Mosaic GPU allocates:
  ``tests/test_ranker_fwd_cpu.py``, ``test_ranker_bwd_cpu.py``); ``simple_smem_bytes``
  the D = 256 kernels'. ``SMEM_LIMIT_BYTES`` is the budget.
* Barriers: one registry (``ForwardBarriers``, ``DqBarriers``, ``DkvBarriers``, and the
  D = 256 kernels' barrier indices ``D256Dq`` / ``D256Dkv``) named by the package's
  rule (``_registers``): ``<data>_landed`` (TMA copies have landed), ``<data>_free``
  (every reader is done), ``mma_turn`` (the forward's ping-pong on the tensor cores).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common import CapMethod, CapParams, KernelConfig
from attn_common.packed import PACKED_KEY_FIELDS, PACKED_QUERY_FIELDS
from attn_mosaic_gpu._registers import (
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    LAUNCH_REGISTERS,
    MAX_COMPUTE_REGISTERS,
    MIN_REGISTERS,
)
from attn_mosaic_gpu._smem import (
    SMEM_ALIGN,
    SMEM_LIMIT_BYTES,
    allocated_bytes,
    round_up,
    tile_transforms,
)

__all__ = [
    "BLOCK",
    "MIN_PACKED_USERS",
    "PIPELINED_HEAD_DIMS",
    "SMEM_LIMIT_BYTES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "BackwardTuning",
    "BwdRefs",
    "D256Dkv",
    "D256Dq",
    "DkvBarriers",
    "DkvBuffers",
    "DqBarriers",
    "DqBuffers",
    "ForwardBarriers",
    "ForwardBuffers",
    "bwd_smem_bytes",
    "check_backward_knobs",
    "default_config",
    "dkv_scratch",
    "dq_scratch",
    "forward_scratch",
    "head_dim_parts",
    "pipelined_smem_bytes",
    "pipelined_stages",
    "simple_smem_bytes",
    "smem_bytes",
    "validate_bwd",
    "validate_config",
]

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
PIPELINED_HEAD_DIMS = (64, 128)  # the pipelined backward; D = 256 runs ranker_bwd_d256
# Bounds [B, U, 4] with U >= 2 take the packed step lists; [B, 1, 4] the one-user kernels.
MIN_PACKED_USERS = 2
# The backward's rows per compute WG and per streamed block (one wgmma M), and both of
# the D = 256 kernels' blocks.
BLOCK = 64
# Accumulator registers per thread (f32 S and O tiles) a forward compute WG may hold;
# COMPUTE_REGISTERS are granted by setmaxnreg, the rest is left for addresses, m, l, P
# and the mask.
FWD_ACC_REGISTER_LIMIT = 160
# f32 accumulator registers per thread a D = 256 backward warpgroup may hold (of 255).
BWD_ACC_REGISTER_LIMIT = 192


# ----------------------------------------------------------------------------- forward


def default_config(head_dim: int, dtype=jnp.bfloat16) -> KernelConfig:
    """The tuned default tiling per head dim (bf16 and fp16 share it: both 2 bytes).

    Shared memory (``smem_bytes``, with LSE): D=64 ~145 KiB, D=128 ~161 KiB,
    D=256 ~193 KiB, all under the 227 KiB limit.
    """
    del dtype  # both supported dtypes are 2 bytes wide
    if head_dim <= 64:
        return KernelConfig(block_q=64, block_kv=128, num_stages=4)
    if head_dim <= 128:
        return KernelConfig(block_q=64, block_kv=128, num_stages=2)
    return KernelConfig(block_q=64, block_kv=64, num_stages=2)


class ForwardBuffers(NamedTuple):
    """The forward's shared memory (persistent programs, ``programs > 0``: a leading
    axis of 2 on Q/O and the LSE, tile ``j + 1``'s beside tile ``j``'s)."""

    qo: Any  # [(2,) 2, block_q, D]: each compute WG's Q tile, then its O
    k: Any  # [num_stages, block_kv, D]: the K ring
    v: Any  # [num_stages, block_kv, D]: the V ring
    lse: Any  # [(2,) 2, block_q] f32: each compute WG's LSE (None without the LSE)
    p: Any  # [2, block_q, block_kv]: interpret mode's P staging (None compiled)
    keys: Any  # [2, PACKED_QUERY_FIELDS, block_q] int32: packed rows' query table, or None


class ForwardBarriers(NamedTuple):
    """The forward's barriers (field order is allocation order)."""

    k_landed: Any  # [num_stages]: the slot's K block
    v_landed: Any  # [num_stages]: the slot's V block
    q_landed: Any  # [(2 x) 2] per compute WG (and Q/O copy): its Q tile
    keys_landed: Any  # [2] per compute WG: its rows' query table (packed rows), or None
    k_free: Any  # [num_stages], 2 arrivals: both compute WGs' QK^T read the slot's K
    v_free: Any  # [num_stages], 2 arrivals: both compute WGs' PV read the slot's V
    mma_turn: Any  # 2 arrivals: the ping-pong; a WG owns the tensor cores after its wait


def forward_scratch(
    config: KernelConfig, head_dim: int, dtype, *, return_lse: bool, packed: bool,
    interpret: bool = False,
) -> tuple[ForwardBuffers, ForwardBarriers]:  # fmt: skip
    """The forward's shared memory and barriers for ``config``."""
    copies = (2,) if config.programs else ()  # persistent: Q/O and LSE double-buffered
    block_q, block_kv, slots = config.block_q, config.block_kv, config.num_stages
    t = tile_transforms()
    buffers = ForwardBuffers(
        qo=plgpu.SMEM((*copies, COMPUTE_WGS, block_q, head_dim), dtype, transforms=t),
        k=plgpu.SMEM((slots, block_kv, head_dim), dtype, transforms=t),
        v=plgpu.SMEM((slots, block_kv, head_dim), dtype, transforms=t),
        lse=plgpu.SMEM((*copies, COMPUTE_WGS, block_q), jnp.float32) if return_lse else None,
        p=plgpu.SMEM((COMPUTE_WGS, block_q, block_kv), dtype, transforms=t) if interpret else None,
        keys=(
            plgpu.SMEM((COMPUTE_WGS, PACKED_QUERY_FIELDS, block_q), jnp.int32) if packed else None
        ),
    )
    barriers = ForwardBarriers(
        k_landed=plgpu.Barrier(num_barriers=slots),
        v_landed=plgpu.Barrier(num_barriers=slots),
        q_landed=plgpu.Barrier(num_barriers=COMPUTE_WGS * (2 if config.programs else 1)),
        keys_landed=plgpu.Barrier(num_barriers=COMPUTE_WGS) if packed else None,
        k_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=slots),
        v_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=slots),
        mma_turn=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    )
    return buffers, barriers


def _count(buffers, barriers) -> int:
    """Shared memory Mosaic GPU allocates for these buffers and barriers (no reduction
    scratch: the kernels turn it off or have no reduction that reserves it)."""
    sizes = [math.prod(b.shape) * jnp.dtype(b.dtype).itemsize for b in buffers if b is not None]
    count = sum(math.prod(b.num_barriers) for b in barriers if b is not None)
    return allocated_bytes(sizes, count)


def smem_bytes(
    config: KernelConfig, head_dim: int, dtype, *, return_lse: bool = True, packed: bool = False
) -> int:
    """Shared memory the forward allocates for ``config``, in bytes: what Mosaic GPU
    counts against the 227 KiB (``tests/test_ranker_fwd_cpu.py`` checks it exactly).

    Q/O tiles of both compute WGs, the K ring, the V ring, the LSE staging buffer and
    (packed rows) the rows' key table, each 1024-byte aligned, and 8 bytes per barrier
    (no reduction scratch: ``CompilerParams(reduction_scratch_bytes=0)``).
    """
    return _count(*forward_scratch(config, head_dim, dtype, return_lse=return_lse, packed=packed))


def validate_config(
    config: KernelConfig,
    head_dim: int,
    dtype,
    *,
    return_lse: bool = True,
    cap: CapParams | None = None,
    packed: bool = False,
) -> None:
    """Raise ``ValueError`` naming the Hopper rule ``config`` breaks for this problem."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected KernelConfig or None")
    if config.block_q != 64:
        raise ValueError(
            f"config.block_q: got {config.block_q}, expected 64 (each compute warpgroup owns "
            "block_q rows and one wgmma has M = 64 rows per warpgroup)"
        )
    if config.block_kv % 64 or config.block_kv > 256:
        raise ValueError(
            f"config.block_kv: got {config.block_kv}, expected a multiple of 64 no larger "
            "than 256 (wgmma N <= 256 and the 128-byte swizzle tile of K/V; TMA boxes hold "
            "at most 256 rows)"
        )
    if config.num_stages < 2:
        raise ValueError(
            f"config.num_stages: got {config.num_stages}, expected >= 2 (the K/V ring needs "
            "a second slot so the next block loads while the current one is consumed)"
        )
    if config.programs and packed:
        raise ValueError(
            f"config.programs: got {config.programs}, expected 0 for packed bounds [B, U, 4] "
            "(persistent programs take one user per row)"
        )
    if config.rcp_fma_cols and (cap is None or cap.method is not CapMethod.SOFT_SIGN):
        raise ValueError(
            f"config.rcp_fma_cols: got {config.rcp_fma_cols}, expected 0 unless the cap is "
            "soft_sign (the only cap with a reciprocal)"
        )
    regs = config.compute_registers
    if regs and not LAUNCH_REGISTERS <= regs <= MAX_COMPUTE_REGISTERS:
        raise ValueError(
            f"config.compute_registers: got {regs}, expected 0 (the default, "
            f"{COMPUTE_REGISTERS}) or {LAUNCH_REGISTERS} to {MAX_COMPUTE_REGISTERS} "
            f"(the launch's {LAUNCH_REGISTERS} per thread up to what leaves the memory "
            f"warpgroup setmaxnreg's floor of {MIN_REGISTERS})"
        )
    acc_regs = config.block_q * (head_dim + config.block_kv) // 128
    if acc_regs > FWD_ACC_REGISTER_LIMIT:
        raise ValueError(
            f"config: block_q * (D + block_kv) / 128 = {acc_regs} f32 accumulator registers "
            f"per thread for D={head_dim}, block_kv={config.block_kv}; the limit is "
            f"{FWD_ACC_REGISTER_LIMIT} of the {regs or COMPUTE_REGISTERS} a compute "
            "warpgroup gets (use a smaller block_kv)"
        )
    need = smem_bytes(config, head_dim, dtype, return_lse=return_lse, packed=packed)
    if need > SMEM_LIMIT_BYTES:
        raise ValueError(
            f"config: needs {need} bytes of shared memory (Q/O {COMPUTE_WGS}x{config.block_q}"
            f"x{head_dim}, K+V {config.num_stages}x2x{config.block_kv}x{head_dim}, "
            f"{jnp.dtype(dtype).name}), more than the {SMEM_LIMIT_BYTES} bytes (227 KiB) "
            "available per block on sm_90; lower num_stages or block_kv"
        )


# ----------------------------------------------------------------------------- backward


class BwdRefs(NamedTuple):
    """The backward kernels' inputs in global memory (dq and dk/dv, pipelined and
    D = 256 alike); their outputs follow them."""

    q: Any  # [B, S_pad, Hq, D]
    k: Any  # [B, S_pad, Hkv, D]
    v: Any  # [B, S_pad, Hkv, D]
    do: Any  # [B, S_pad, Hq, D]: dO
    lse: Any  # [B, Hq, S_pad] f32: the base-2 LSE, +inf on rows with no key
    delta: Any  # [B, Hq, S_pad] f32: delta' = rowsum(dO * O) - dlse
    bounds: Any  # [B, 4] int32, or packed [B, U, 4]
    # Packed rows only (else None): the tiles' step lists [B, tiles, words] int32, and
    # the rows' table [B, fields, S_pad] int32 (dq: PACKED_QUERY_FIELDS, the query
    # table; dk/dv: PACKED_KEY_FIELDS, the key table).
    steps: Any = None
    table: Any = None


@dataclasses.dataclass(frozen=True)
class BackwardTuning:
    """Schedule knobs of the pipelined backward kernels (D 64 and 128; see
    ``ranker_bwd_pipelined``). ``num_stages=None`` is the per-D default ring depth."""

    num_stages: int | None = None
    exp2_fma_cols: int = 0
    rcp_fma_cols: int = 0
    dq_programs: int = 0
    # Deprecated (0.2.0; removed in the next release): the kernels always fold the cap
    # and overlap; True is accepted with a warning, False is refused.
    fold: bool | None = None
    overlap: bool | None = None

    def __post_init__(self):
        for name in ("fold", "overlap"):
            value = getattr(self, name)
            if value is None:
                continue
            if value is not True:
                raise ValueError(
                    f"BackwardTuning.{name}: got {value!r}; the schedule without it was "
                    "removed (git da2ec0c has it); leave it unset"
                )
            warnings.warn(
                f"BackwardTuning.{name} is deprecated and ignored: always on",
                DeprecationWarning,
                stacklevel=3,
            )

    def knobs(self) -> dict:
        """The overrides ``ranker_bwd_pipelined.pipelined_bwd(tuning=...)`` takes."""
        knobs = dataclasses.asdict(self)
        del knobs["fold"], knobs["overlap"]
        if knobs["num_stages"] is None:
            del knobs["num_stages"]
        return knobs


_KNOBS = ("num_stages", "exp2_fma_cols", "rcp_fma_cols", "dq_programs")


def check_backward_knobs(knobs: dict, cap: CapParams) -> None:
    """Raise ``ValueError`` naming a bad backward schedule knob."""
    unknown = sorted(set(knobs) - set(_KNOBS))
    if unknown:
        raise ValueError(f"backward tuning: unknown knobs {unknown}; known: {list(_KNOBS)}")
    stages = knobs.get("num_stages", 2)
    if isinstance(stages, bool) or not isinstance(stages, int) or not 2 <= stages <= 4:
        raise ValueError(f"backward tuning num_stages: got {stages!r}, expected 2, 3 or 4")
    for name in ("exp2_fma_cols", "rcp_fma_cols"):
        cols = knobs.get(name, 0)
        if (
            isinstance(cols, bool)
            or not isinstance(cols, int)
            or cols % 8
            or not 0 <= cols <= BLOCK
        ):
            raise ValueError(
                f"backward tuning {name}: got {cols!r}, expected a multiple of 8 from 0 to {BLOCK}"
            )
    if knobs.get("rcp_fma_cols", 0) and cap.method is not CapMethod.SOFT_SIGN:
        raise ValueError("backward tuning rcp_fma_cols: needs a soft_sign cap (else 0)")
    programs = knobs.get("dq_programs", 0)
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 0:
        raise ValueError(
            f"backward tuning dq_programs: got {programs!r}, expected 0 (one program per "
            "tile) or a positive number of persistent programs"
        )


def pipelined_stages(head_dim: int) -> int:
    """Ring depth: 2 for D=128 (~129 KiB of shared memory; on the H200 2 stages ran
    4-8% faster than 3 in ``benchmarks/ranker_bwd_sweep.py``), 4 for D=64 (~97 KiB)."""
    return 2 if head_dim > 64 else 4


class DqBuffers(NamedTuple):
    """The pipelined dq kernel's shared memory (persistent programs, ``dq_programs >
    0``: a leading axis of 2 on each compute WG's fixed buffers)."""

    q: Any  # [(2,) 2, 64, D]: each compute WG's Q rows, at the end its dQ
    do: Any  # [(2,) 2, 64, D]: their dO
    lse: Any  # [(2,) 2, 64] f32: their base-2 LSE
    delta: Any  # [(2,) 2, 64] f32: their delta'
    k: Any  # [num_stages, 64, D]: the K ring
    v: Any  # [num_stages, 64, D]: the V ring
    ds: Any  # [2, 64, 64]: interpret mode's dS staging (None compiled)
    keys: Any  # [(2,) 2, PACKED_QUERY_FIELDS, 64] int32: packed rows' query table, or None


class DqBarriers(NamedTuple):
    """The pipelined dq kernel's barriers (field order is allocation order); the fixed
    ones have one barrier per compute WG (and copy)."""

    q_landed: Any
    do_landed: Any
    lse_landed: Any
    delta_landed: Any
    keys_landed: Any  # packed rows only, else None
    k_landed: Any  # [num_stages]
    v_landed: Any  # [num_stages]
    kv_free: Any  # [num_stages], 2 arrivals: both compute WGs are done with the slot

    @property
    def fixed(self) -> tuple:
        """The fixed operands' barriers, in ``DqBuffers`` order."""
        names = ("q_landed", "do_landed", "lse_landed", "delta_landed", "keys_landed")
        return tuple(getattr(self, n) for n in names if getattr(self, n) is not None)


def dq_scratch(
    head_dim: int, dtype, *, num_stages: int, persistent: bool, packed: bool,
    interpret: bool = False,
) -> tuple[DqBuffers, DqBarriers]:  # fmt: skip
    lead = (2,) if persistent else ()
    t = tile_transforms()
    own = plgpu.SMEM((*lead, COMPUTE_WGS, BLOCK, head_dim), dtype, transforms=t)
    own_vec = plgpu.SMEM((*lead, COMPUTE_WGS, BLOCK), jnp.float32)
    ring = plgpu.SMEM((num_stages, BLOCK, head_dim), dtype, transforms=t)
    staging = plgpu.SMEM((COMPUTE_WGS, BLOCK, BLOCK), dtype, transforms=t)
    keys = plgpu.SMEM((*lead, COMPUTE_WGS, PACKED_QUERY_FIELDS, BLOCK), jnp.int32)
    fixed = plgpu.Barrier(num_barriers=(2 if persistent else 1) * COMPUTE_WGS)
    buffers = DqBuffers(
        own, own, own_vec, own_vec, ring, ring, staging if interpret else None,
        keys if packed else None,
    )  # fmt: skip
    barriers = DqBarriers(
        q_landed=fixed,
        do_landed=fixed,
        lse_landed=fixed,
        delta_landed=fixed,
        keys_landed=fixed if packed else None,
        k_landed=plgpu.Barrier(num_barriers=num_stages),
        v_landed=plgpu.Barrier(num_barriers=num_stages),
        kv_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=num_stages),
    )
    return buffers, barriers


class DkvBuffers(NamedTuple):
    """The pipelined dk/dv kernel's shared memory."""

    k: Any  # [2, 64, D]: each compute WG's K rows, at the end its dK
    v: Any  # [2, 64, D]: its V rows, at the end its dV
    q: Any  # [num_stages, 64, D]: the Q ring
    do: Any  # [num_stages, 64, D]: the dO ring
    lse: Any  # [num_stages, 64] f32: the base-2 LSE ring
    delta: Any  # [num_stages, 64] f32: the delta' ring
    p: Any  # [2, 64, 64]: interpret mode's P^T staging (None compiled)
    ds: Any  # [2, 64, 64]: interpret mode's dS^T staging (None compiled)
    keys: Any  # [2, PACKED_KEY_FIELDS, 64] int32: packed rows' key table, or None


class DkvBarriers(NamedTuple):
    """The pipelined dk/dv kernel's barriers (field order is allocation order)."""

    k_landed: Any  # [2] per compute WG
    v_landed: Any  # [2] per compute WG
    keys_landed: Any  # [2] per compute WG, packed rows only, else None
    q_landed: Any  # [num_stages]
    do_landed: Any  # [num_stages]
    lse_landed: Any  # [num_stages]
    delta_landed: Any  # [num_stages]
    step_free: Any  # [num_stages], 2 arrivals: both compute WGs are done with the slot

    @property
    def fixed(self) -> tuple:
        """The fixed operands' barriers, in ``DkvBuffers`` order."""
        names = ("k_landed", "v_landed", "keys_landed")
        return tuple(getattr(self, n) for n in names if getattr(self, n) is not None)


def dkv_scratch(
    head_dim: int, dtype, *, num_stages: int, packed: bool, interpret: bool = False
) -> tuple[DkvBuffers, DkvBarriers]:
    t = tile_transforms()
    own = plgpu.SMEM((COMPUTE_WGS, BLOCK, head_dim), dtype, transforms=t)
    ring = plgpu.SMEM((num_stages, BLOCK, head_dim), dtype, transforms=t)
    ring_vec = plgpu.SMEM((num_stages, BLOCK), jnp.float32)
    staging = plgpu.SMEM((COMPUTE_WGS, BLOCK, BLOCK), dtype, transforms=t) if interpret else None
    keys = plgpu.SMEM((COMPUTE_WGS, PACKED_KEY_FIELDS, BLOCK), jnp.int32) if packed else None
    fixed = plgpu.Barrier(num_barriers=COMPUTE_WGS)
    slots = plgpu.Barrier(num_barriers=num_stages)
    buffers = DkvBuffers(own, own, ring, ring, ring_vec, ring_vec, staging, staging, keys)
    barriers = DkvBarriers(
        k_landed=fixed,
        v_landed=fixed,
        keys_landed=fixed if packed else None,
        q_landed=slots,
        do_landed=slots,
        lse_landed=slots,
        delta_landed=slots,
        step_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=num_stages),
    )
    return buffers, barriers


def pipelined_smem_bytes(
    head_dim: int,
    dtype,
    *,
    interpret: bool = False,
    num_stages: int | None = None,
    dq_programs: int = 0,
    packed: bool = False,
) -> dict[str, int]:
    """Shared memory of the dq and dk/dv kernels in bytes: what Mosaic GPU allocates
    (``tests/test_ranker_bwd_cpu.py`` checks it exactly). ``num_stages=None`` is the
    default ring depth of ``head_dim``; persistent dq programs (``dq_programs > 0``)
    double its fixed buffers; ``packed`` adds the rows' key tables (bounds ``[B, U, 4]``).
    Neither kernel has a reduction that Pallas reserves scratch for."""
    stages = pipelined_stages(head_dim) if num_stages is None else num_stages
    kw = dict(num_stages=stages, packed=packed, interpret=interpret)
    return {
        "dq": _count(*dq_scratch(head_dim, dtype, persistent=bool(dq_programs), **kw)),
        "dkv": _count(*dkv_scratch(head_dim, dtype, **kw)),
    }


def head_dim_parts(head_dim: int) -> int:
    """Head-dim parts of the D = 256 kernels' dQ and dK/dV outputs, one program each (the
    f32 accumulator and the fresh wgmma result added to it must fit the registers)."""
    return 2 if head_dim > 128 else 1


class D256Dq(enum.IntEnum):
    """The D = 256 dq kernel's barriers: indices into its one array of 7."""

    Q_LANDED = 0
    DO_LANDED = 1
    LSE_LANDED = 2
    DELTA_LANDED = 3
    K_LANDED = 4
    V_LANDED = 5
    K_HALF_LANDED = 6  # the head-dim half of K that dQ needs


class D256Dkv(enum.IntEnum):
    """The D = 256 dk/dv kernel's barriers: indices into its one array of 8."""

    K_LANDED = 0
    V_LANDED = 1
    Q_LANDED = 2
    DO_LANDED = 3
    LSE_LANDED = 4
    DELTA_LANDED = 5
    Q_HALF_LANDED = 6  # the head-dim halves of Q and dO that dK / dV need
    DO_HALF_LANDED = 7


def simple_smem_bytes(head_dim: int, dtype) -> dict[str, int]:
    """Shared memory of the D = 256 kernels (bytes, a model: their vectors unaligned)."""
    item = jnp.dtype(dtype).itemsize
    b = BLOCK
    tile = round_up(b * head_dim * item, SMEM_ALIGN)
    sq = round_up(b * b * item, SMEM_ALIGN)
    vec = 2 * b * 4
    dh = head_dim // head_dim_parts(head_dim)
    half = round_up(b * dh * item, SMEM_ALIGN) if head_dim_parts(head_dim) > 1 else 0
    dq = 4 * tile + half + sq + vec + 8 * len(D256Dq)
    dkv = 4 * tile + 2 * half + 2 * sq + vec + 8 * len(D256Dkv)
    return {"dq": dq, "dkv": dkv}


def bwd_smem_bytes(head_dim: int, dtype) -> dict[str, int]:
    """Shared memory of the dq and dk/dv kernels used for ``head_dim`` (bytes; for D 64
    and 128 at the default ring depth, with the packed rows' key tables, the larger
    layout)."""
    if head_dim in PIPELINED_HEAD_DIMS:
        return pipelined_smem_bytes(head_dim, dtype, packed=True)
    return simple_smem_bytes(head_dim, dtype)


def validate_bwd(head_dim: int, dtype) -> None:
    """Raise ``ValueError`` naming the Hopper limit the backward would break."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: got {head_dim}, expected one of {SUPPORTED_HEAD_DIMS}")
    b = BLOCK
    dh = head_dim // head_dim_parts(head_dim)
    # per compute thread: dQ (or dK + dV) accumulators and the two 64x64 score tiles
    dq_regs = b * (dh + 2 * b) // 128
    dkv_regs = b * (2 * dh + 2 * b) // 128
    for name, regs in (("dq", dq_regs), ("dk/dv", dkv_regs)):
        if regs > BWD_ACC_REGISTER_LIMIT:
            raise ValueError(
                f"backward {name} kernel: {regs} f32 accumulator registers per thread for "
                f"D={head_dim}, more than the limit of {BWD_ACC_REGISTER_LIMIT}"
            )
    for name, need in bwd_smem_bytes(head_dim, dtype).items():
        if need > SMEM_LIMIT_BYTES:
            raise ValueError(
                f"backward {name} kernel: needs {need} bytes of shared memory for "
                f"D={head_dim}, more than the {SMEM_LIMIT_BYTES} bytes (227 KiB) available "
                "per block on sm_90"
            )
