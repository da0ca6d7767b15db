"""The configuration of the TPU ranker kernels (the forward of ``ranker_fwd``, the dq and
dk/dv kernels of ``ranker_bwd``): every knob and size, the shapes derived from them, the
tiling heuristic and the VMEM budget. The cost model (``ranker_model``) reads the same
values.

* Knobs: ``attn_common.KernelConfig``'s ``block_q`` and ``block_kv`` (multiples of the
  lane width ``LANES``), shared by the three kernels; its Hopper knobs must be 0
  (``validate_config``) and ``num_stages`` is not read (the Pallas TPU pipeline
  double-buffers every block).
* Shapes: ``RankerStatic`` (the padded problem and the tiles: ``q_tiles``, ``kv_tiles``,
  ``heads_per_program``, the kernel layout, the step tables' ``runs``) and ``grids`` (the
  three kernels' grids, which the cost model counts steps over); the scratch of each
  kernel (``fwd_scratch``, ``dq_scratch``, ``dkv_scratch``).
* Derived, not knobs: ``RankerStatic.heads_per_program`` (from
  :func:`heads_per_program`), the query heads of one kv head that one forward or dq
  program computes: the largest divisor of the GQA group, at most
  ``MAX_HEADS_PER_PROGRAM``, whose VMEM estimate fits; ``RankerStatic.softmax``, how the
  forward's softmax offsets its logits: ``"fixed"`` at the cap's bound where it is tight
  enough (``BOUNDED_ERROR_BITS``; ``softmax_offset``), ``"row"`` at a bound per query row
  for other tanh / soft_sign caps (``row_floor_bits``: the rows it may not serve, which
  the wrapper then runs again with a running max), ``"running"`` (no cap, or
  ``running_max``) a running max.
* Heuristic: ``default_config``, the largest block of ``BLOCK_CHOICES`` that pads ``S``
  least, among those whose VMEM estimate (``vmem_bytes``) fits ``VMEM_LIMIT_BYTES``.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from attn_common import CapMethod, KernelConfig
from attn_common.packed import packed_runs_per_tile
from attn_common.ranker import RankerKernelStatic

__all__ = [
    "BLOCK_CHOICES",
    "BOUNDED_ERROR_BITS",
    "DIMENSION_SEMANTICS",
    "LANES",
    "MAX_HEADS_PER_PROGRAM",
    "ROW_BOUND_MARGIN",
    "ROW_BOUND_SLACK",
    "SCORE_TEMPORARIES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "TABLE_WORDS",
    "VMEM_LIMIT_BYTES",
    "RankerStatic",
    "default_config",
    "dkv_scratch",
    "dq_scratch",
    "fwd_scratch",
    "grids",
    "heads_per_program",
    "make_static",
    "padded_len",
    "round_up",
    "table_words",
    "validate_config",
    "vmem_bytes",
]

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float32)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
LANES = 128
TABLE_WORDS = 8  # words per tile in the scalar-prefetched step tables (one user per row)
BLOCK_CHOICES = (640, 512, 384, 256, 128)  # default_config's blocks, largest first
# Scoped VMEM the kernels may use; every supported chip has >= 64 MiB per TensorCore.
VMEM_LIMIT_BYTES = 32 << 20
# Score-sized float32 temporaries a kernel holds at once (S, P, dP, dS, the mask).
SCORE_TEMPORARIES = 5
# Grid axes: (batch, heads, tiles) parallel; the steps of a tile (the accumulators live
# across them in VMEM scratch) arbitrary.
DIMENSION_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")
# Query heads of one kv head per forward / dq program and per dk/dv step (K / V fetched
# once for them, a masked step's mask and V cleaning built once, the heads independent
# work in one step body). v5e, device ms, 5 heads against 1: forward at aa1c327 (bitwise
# equal) phoenix 25.55 -> 19.78, ragged 19.81 -> 15.50, ragged packed 19.02 -> 13.10;
# dk/dv at d2c3cc2 (forward + backward) phoenix 48.74 -> 45.70, ragged 35.83 -> 33.17.
# Bounded because the step body is unrolled per head; 8 heads not measured.
MAX_HEADS_PER_PROGRAM = 8
# A capped forward takes a fixed softmax offset, the logits' bound, instead of a running
# max (``RankerStatic.softmax_offset``) where that costs an absolute error in ``out`` of at
# most 2^-BOUNDED_ERROR_BITS: base-2 logits lie in (-C, C), C = c log2(e), so p = 2^(y - C)
# >= 2^-2C, and a product p v flushes below float32's smallest normal 2^-126 only for |v| <
# 2^(2C - 126) (the running max keeps p_max = 1); every attended p is at least 2^-2C, so
# the row's sum holds at least 2^-2C per lost term and out moves by at most 2^(2C - 126).
# So the rule is 2C <= 126 - BOUNDED_ERROR_BITS (c <= 35.3). v5e, device ms, at 5b28703
# against the running max (the long case, tanh cap 30): forward 20.72 -> 14.55 (kernel
# 18.66 -> 12.49); out within 3e-3 rel L2 of it (bf16 P rounding).
BOUNDED_ERROR_BITS = 24
# Other tanh / soft_sign caps offset each query row at a bound of its logits, ``cap(|q_i|
# max_j |k_j| sm_scale)`` in base 2 plus ROW_BOUND_MARGIN (Cauchy-Schwarz over the keys
# row i attends; the margin covers the rounding of the dot products and of the bound), so
# p <= 1 again. A row's logits may sit far below its bound: the kernel serves the row only
# where its sum l >= 2^-RankerStatic.row_floor_bits (then every lost term, a p or p v below
# 2^-126, moves out by at most 2^-126 max(1, |v|) / l, and the row's at most S_pad of them by
# 2^-BOUNDED_ERROR_BITS max(1, |v|)) and marks the others (NaN LSE), which the wrapper then
# takes from a running-max run (``ranker_fwd.forward_or_again``). v5e, device ms, at 0b56559
# against the running max (phoenix, soft_sign 80): forward 12.72 -> 10.86 (kernel 12.26 ->
# 9.71); out within 3e-3 rel L2 of it (bf16 P rounding).
ROW_BOUND_MARGIN = 1.0
ROW_BOUND_SLACK = 2.0**-8  # relative, on |q| max |k|: the dot's and the norms' f32 rounding
LOG2E = math.log2(math.e)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_len(seq_len: int, block_q: int, block_kv: int) -> int:
    """``S`` padded to a multiple of both blocks (``lcm(block_q, block_kv)``)."""
    return round_up(seq_len, math.lcm(block_q, block_kv))


def grids(batch: int, q_heads: int, kv_heads: int, seq_pad: int, block_q: int, block_kv: int,
          heads: int = 1):  # fmt: skip
    """The kernels' grids: ``fwd`` and ``dq`` ``(B, Hq / heads, q_tiles, kv_tiles)``
    (``heads`` query heads a program), ``dkv`` ``(B, Hkv, kv_tiles, group / heads *
    q_tiles)`` (the group's query heads in turn, ``heads`` a step)."""
    q_tiles, kv_tiles = seq_pad // block_q, seq_pad // block_kv
    fwd = (batch, q_heads // heads, q_tiles, kv_tiles)
    return {
        "fwd": fwd,
        "dq": fwd,
        "dkv": (batch, kv_heads, kv_tiles, q_heads // kv_heads // heads * q_tiles),
    }


def validate_config(config: KernelConfig) -> None:
    """Raise naming the TPU rule ``config`` breaks (blocks are multiples of 128)."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected KernelConfig or None")
    for name in ("block_q", "block_kv"):
        value = getattr(config, name)
        if value % LANES:
            raise ValueError(
                f"config.{name}: got {value}, the TPU ranker kernels need a multiple of "
                f"{LANES} (the lane width: {name} is the lane dim of the score tile or "
                "of the LSE row)"
            )
    for name in ("exp2_fma_cols", "rcp_fma_cols"):
        if getattr(config, name):
            raise ValueError(
                f"config.{name}: got {getattr(config, name)}, expected 0 (a Hopper knob: the "
                "TPU kernels have no MUFU/FMA split)"
            )
    if config.programs:
        raise ValueError(
            f"config.programs: got {config.programs}, expected 0 (a Hopper knob: the TPU "
            "kernels run one grid step per tile)"
        )
    if config.compute_registers:
        raise ValueError(
            f"config.compute_registers: got {config.compute_registers}, expected 0 (a Hopper "
            "knob: the register split of a warp-specialized kernel)"
        )


@dataclasses.dataclass(frozen=True)
class RankerStatic(RankerKernelStatic):
    """Static facts the kernels are specialised on (hashable: a jit static argument): the
    padded problem plus the tiles."""

    block_q: int
    block_kv: int
    packed_users: int = 0  # U of packed bounds [B, U, 4]; 0: one user per row, [B, 4]
    heads_per_program: int = 1  # query heads of one kv head: a forward / dq program, a dk/dv step
    heads_major: bool = False  # the [B, H, S, D] kernel layout at any D (see ``flat``)
    running_max: bool = False  # the forward's softmax takes a running max whatever the cap

    @property
    def cap_bound(self) -> float | None:
        """``C = c log2(e)``, the bound of a tanh or soft_sign cap's base-2 logits
        (``|y| < C``), else ``None``."""
        cap = self.cap
        if cap is None or cap.method is CapMethod.NONE:
            return None
        return cap.value * LOG2E

    @property
    def softmax(self) -> str:
        """How the forward's softmax offsets the base-2 logits ``y`` (``ranker_fwd``):
        ``"fixed"``, at ``C`` for a cap with ``2C <= 126 - BOUNDED_ERROR_BITS`` (``p = 2^(y
        - C)``); ``"row"``, at a bound of each query row's logits, for the other caps and
        no cap; or ``"running"``, at a running max (``running_max``: the second run of
        ``ranker_fwd.forward_or_again``, and A/B runs)."""
        bound = self.cap_bound
        if self.running_max:
            return "running"
        if bound is None:
            return "row"
        return "fixed" if 2 * bound <= 126 - BOUNDED_ERROR_BITS else "row"

    @property
    def softmax_offset(self) -> float | None:
        """The fixed offset ``C`` where ``softmax == "fixed"``, else ``None``."""
        return self.cap_bound if self.softmax == "fixed" else None

    @property
    def row_floor_bits(self) -> int:
        """``T``: on the ``"row"`` softmax a row is served where its sum ``l >= 2^-T``, ``T
        = 126 - BOUNDED_ERROR_BITS - ceil(log2 S_pad)`` (``ROW_BOUND_MARGIN``'s comment)."""
        return 126 - BOUNDED_ERROR_BITS - math.ceil(math.log2(self.seq_pad))

    @property
    def runs(self) -> int:
        """Block runs per tile in the step tables: 0 (the two-run one-user layout) or
        ``2U`` (packed, ``attn_common.packed``)."""
        return packed_runs_per_tile(self.packed_users) if self.packed_users else 0

    @property
    def q_tiles(self) -> int:
        return self.seq_pad // self.block_q

    @property
    def kv_tiles(self) -> int:
        return self.seq_pad // self.block_kv

    @property
    def flat(self) -> bool:
        """``[B, S, H*D]`` view (True) or ``[B, H, S, D]`` transpose (False: D = 64, or
        ``heads_major``, where the device lays q out heads-major by default)."""
        return self.head_dim % LANES == 0 and not self.heads_major

    def grid(self, kernel: str) -> tuple[int, int, int, int]:
        """The grid of ``kernel`` (``"fwd"``, ``"dq"`` or ``"dkv"``; see ``grids``)."""
        g = grids(
            self.batch, self.q_heads, self.kv_heads, self.seq_pad, self.block_q, self.block_kv,
            self.heads_per_program,
        )  # fmt: skip
        return g[kernel]


def make_static(
    problem, config: KernelConfig, packed_users: int = 0, heads_major: bool = False
) -> RankerStatic:
    group = problem.q_heads // problem.kv_heads
    return RankerStatic(
        **problem.padded(padded_len(problem.seq_len, config.block_q, config.block_kv)),
        block_q=config.block_q,
        block_kv=config.block_kv,
        packed_users=packed_users,
        heads_per_program=heads_per_program(
            group, config.block_q, config.block_kv, problem.head_dim
        ),
        heads_major=heads_major,
    )


def heads_per_program(group: int, block_q: int, block_kv: int, head_dim: int) -> int:
    """Query heads a forward / dq program, and a dk/dv step, computes: the largest
    divisor of the GQA ``group`` that is at most ``MAX_HEADS_PER_PROGRAM`` and whose VMEM
    estimates (``vmem_bytes`` at float32, as ``default_config``) fit
    ``VMEM_LIMIT_BYTES``; 1 when none larger does."""
    for heads in range(min(group, MAX_HEADS_PER_PROGRAM), 1, -1):
        if group % heads:
            continue
        need = vmem_bytes(block_q, block_kv, head_dim, jnp.float32, heads=heads)
        if max(need.values()) <= VMEM_LIMIT_BYTES:
            return heads
    return 1


def table_words(runs: int) -> int:
    """Words per tile of a step table: 8 (one user) or ``2 R + 2`` (packed, R runs)."""
    return 2 * runs + 2 if runs else TABLE_WORDS


# ----------------------------------------------------------------------------- VMEM


def fwd_scratch(block_q: int, head_dim: int, heads: int = 1) -> list:
    """The forward's scratch, per head of the program: the running max and sum
    (lane-broadcast) and the f32 accumulator, which live across a tile's KV steps."""
    return [
        pltpu.VMEM((heads, block_q, LANES), jnp.float32),
        pltpu.VMEM((heads, block_q, LANES), jnp.float32),
        pltpu.VMEM((heads, block_q, head_dim), jnp.float32),
    ]


def dq_scratch(block_q: int, head_dim: int, heads: int = 1) -> list:
    """The dq kernel's scratch: the f32 dQ accumulator of each head of the program."""
    return [pltpu.VMEM((heads, block_q, head_dim), jnp.float32)]


def dkv_scratch(block_kv: int, head_dim: int) -> list:
    """The dk/dv kernel's scratch: the f32 dK and dV accumulators."""
    return [pltpu.VMEM((block_kv, head_dim), jnp.float32)] * 2


def vmem_bytes(block_q: int, block_kv: int, head_dim: int, dtype, heads: int = 1) -> dict[str, int]:
    """A model of each kernel's VMEM (bytes): its blocks, double-buffered by the Pallas
    pipeline (a ``(1, rows)`` f32 row statistic takes 8 sublanes), its scratch, and
    ``SCORE_TEMPORARIES`` float32 score tiles (once: the heads of a program take their
    turns). ``heads``: query heads per forward / dq program and dk/dv step (their
    q-side blocks and scratch scale with it). A model: Mosaic's own layouts and
    temporaries are known only on a TPU."""
    item = jnp.dtype(dtype).itemsize
    bq, bkv, d, h = block_q, block_kv, head_dim, heads
    stat = 8 * 4  # bytes per position of a (1, rows) f32 block

    def scratch(shapes):
        return sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in shapes)

    scores = SCORE_TEMPORARIES * bq * bkv * 4
    blocks = {
        "fwd": (2 * h * bq * d + 2 * bkv * d) * item + h * bq * stat,  # q, o; k, v; lse
        "dq": (3 * h * bq * d + 2 * bkv * d) * item + 2 * h * bq * stat,  # q, dO, dq; k, v; stats
        "dkv": (4 * bkv * d + 2 * h * bq * d) * item + 2 * h * bq * stat,  # k, v, dk, dv; q, dO
    }
    scratches = {
        "fwd": fwd_scratch(bq, d, h),
        "dq": dq_scratch(bq, d, h),
        "dkv": dkv_scratch(bkv, d),
    }
    return {k: 2 * blocks[k] + scratch(scratches[k]) + scores for k in blocks}


def default_config(seq_len: int, head_dim: int = 128) -> KernelConfig:
    """The default tiling: ``block_q = block_kv`` = the largest of ``BLOCK_CHOICES``
    that pads ``S`` least (S=1152 -> 384, S=5120 -> 640, S=640 -> 640) among those whose
    VMEM model fits ``VMEM_LIMIT_BYTES`` at ``head_dim`` and float32 (every one does at
    the supported D): large blocks amortise the per-grid-step overhead
    (docs/tpu_ranker.md, cost model)."""
    fits = [
        b
        for b in BLOCK_CHOICES
        if max(vmem_bytes(b, b, head_dim, jnp.float32).values()) <= VMEM_LIMIT_BYTES
    ]
    best = min(fits, key=lambda b: (round_up(seq_len, b), -b))
    return KernelConfig(block_q=best, block_kv=best)
