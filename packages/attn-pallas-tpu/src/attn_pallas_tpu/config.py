"""The one config of the TPU sparse-MLA kernel family, its heuristics and its VMEM estimates.

Every tiling knob of the six sparse-MLA kernels (the per-query forward, the
query-blocked forward, the per-query backward's dq and dKV kernels, the query-blocked
backward's block and sum kernels) lives in :class:`SparseMlaConfig` or, where fixed, in a
constant here; buffer shapes are derived from them, the kernels read nothing else, and
the cost model (``attn_pallas_tpu.plan``) prices the same values.

The knobs, and why they exist (docs/tpu_sparse_mla.md has the measurements):

* ``units_per_step`` (``G``): units DMA'd into one ring slot and computed together. A
  unit is ``read_block`` rows; a step's matmuls see ``G * read_block`` keys, which fills
  the MXU's 128-row weight tiles at 16-64-token units and pays the per-iteration costs
  (semaphore waits, the online-softmax rescale of the accumulator) once per ``G`` units.
* ``forward_units_per_step``: the per-query forward kernel's own ``G`` (``None``: the
  shared ``units_per_step``). Its default takes more keys a step than the other kernels':
  the v5e sweep found the per-query forward fastest at 1024 keys a step, where the
  query-blocked kernel, at the same ``G``, was 5 % slower than at 512.
* ``ring_slots`` (``S``): steps held in the VMEM ring; ``(S - 1) * G`` unit copies are in
  flight behind the compute. A unit copy is latency-bound (about a microsecond on a
  v5e), so the ring must hold several to reach HBM bandwidth.
* ``forward_ring_slots``: the per-query forward kernel's own ``S`` (``None``: the shared
  ``ring_slots``). That kernel starts its copies after its compute, so its depth is
  measured apart from the other kernels', which start theirs before their wait.
* ``queries_per_program`` (``QP``, per-query forward and dq): queries one program walks
  back to back through one ring, so the ring fills and drains once per ``QP`` queries,
  not once per query, and the grid has ``N / QP`` steps. Its bounds: the program's SMEM
  tables hold ``QP * K`` words each, its double-buffered q and out blocks
  ``QP * H * (2 Dk_pad + 4 Dv)`` bytes.
* ``query_block`` / ``head_block`` / ``u_max`` (query-blocked forward): queries and heads
  per program and the union slots per chunk (``attn_pallas_tpu.sparse_mla_qblock``).
* ``pairs_per_step`` (dKV): (store block, query) pairs whose query rows are stacked into
  one step's matmuls.

The query-blocked backward (``attn_pallas_tpu.sparse_mla_qblock_bwd``) runs at the
forward's ``query_block`` / ``head_block``, in chunks of ``MEMBER_TILE`` union slots, with
the same ring; its partial-gradient buffer is sized by ``BACKWARD_SHARING``.

Fixed by the layout, not config: ``MEMBER_TILE`` (the 32 union slots of one int32
membership word, to which the query-blocked chunks align).
"""

from __future__ import annotations

import dataclasses

MEMBER_TILE = 32  # union slots a membership word holds: u_max aligns to it
MAX_UNITS_PER_STEP = MEMBER_TILE  # a step's membership bits lie in one word


def member_word_rows(u_chunk: int) -> int:
    """Rows of a chunk's membership words ``[rows, QB]`` int32: one word per 32 union
    slots, padded to the 8-row sublane tile (the kernels read aligned 8-row windows)."""
    return -(-u_chunk // (MEMBER_TILE * 8)) * 8


# The heuristic's keys per step and units per step, from v5e sweeps (the latest is
# docs/results/tpu_sparse_mla_sweep.json): every kernel pays ~0.2-0.7 us a step, so
# steps of 512 keys; the per-query forward kernel at 1024 keys a step was fastest or
# within 3 % of the fastest G in all 18 cells of the cost-model sweep (units of 16-128,
# H 4-128; at 512 it was 11 % slower at units of 16, H 16 and at H 128, units of 64), the
# query-blocked kernel 5 % slower at 1024 than at 512 (overlapping picks, H 16).
STEP_ROWS = 512
FORWARD_STEP_ROWS = 1024
MAX_DEFAULT_UNITS = 16
# The default queries per program: 32 (v5e at 179373b, against 8: 0.3-1.4 % less device
# time for the per-query forward at units of 16-32, H 64, 2.7 % at decode, 1.3 % for the
# random training step), at most QP_TABLE_WORDS words in each SMEM table (QP * K, K
# units a query) and QP_HEAD_ROWS rows (QP * H) of q and out blocks, the largest both
# were measured at (units of 16, H 64); never below MIN_DEFAULT_QP, the value the v5e
# sweeps and native tests ran at every K and H.
MAX_QUERIES_PER_PROGRAM = 32
MIN_DEFAULT_QP = 8
QP_TABLE_WORDS = 4096
QP_HEAD_ROWS = 2048
# 3 and 6 slots measured alike when a step started its copies before its wait (2 steps in
# flight). The per-query forward starts them after its compute (1-2 steps in flight at 3
# slots, 1.3-1.8x slower at 2). v5e at aa1c327, 4 slots against 3 for that kernel: H 64
# 1.2 % (units of 32) and 0.3 % (units of 16) less device time; H 16 1.5 % (units of 64)
# and 0.5 % (decode) more. So 4 from WIDE_HEADS heads on, where a step's compute is long.
RING_SLOTS = 3
FORWARD_RING_SLOTS_WIDE = 4
WIDE_HEADS = 64
MAX_ROWS = 4096  # default cap on the query-blocked kernel's score rows (Hb * QB)
PAIR_CHUNK = 128  # dKV (store block, query) pairs per program: bounds its SMEM tables
# The query-blocked backward's partial-gradient buffer: slots per (query block, head
# group) for a block's ``QB * K`` pairs shared at least this many ways (a wider union
# takes the per-query backward). ``RB * Dk_pad * 4`` bytes a slot: 0.67 GB for 2048
# queries x 32 units of 64 at ``Dk_pad`` 640.
BACKWARD_SHARING = 16
# Rows of the store one program of the query-blocked backward's sum kernel writes (whole
# store blocks): a program per store block paid a grid step for each, most of them only
# writing zeros.
SUM_ROWS = 512


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: got {value!r}, expected a positive int")
    return value


@dataclasses.dataclass(frozen=True)
class SparseMlaConfig:
    """Tiling of the TPU sparse-MLA kernels (validated; ``None`` = chosen per call).

    units_per_step: ``G``, a power of two up to 32 (a membership word's slots).
    ring_slots: ``S >= 2`` ring slots of ``G`` units; ``(S - 1) * G`` copies in flight.
    queries_per_program: ``QP`` queries per program of the per-query and dq kernels.
    query_block / head_block / u_max: the query-blocked kernel's ``QB`` (a multiple of
      8), ``Hb`` (a divisor of ``H``) and union slots per chunk.
    pairs_per_step: dKV (store block, query) pairs per step.
    forward_units_per_step: the per-query forward kernel's ``G`` (a power of two up to
      32); ``None``: ``units_per_step``.
    forward_ring_slots: the per-query forward kernel's ``S`` (at least 2); ``None``:
      ``ring_slots``.
    """

    units_per_step: int = 4
    ring_slots: int = RING_SLOTS
    queries_per_program: int = 8
    query_block: int | None = None
    head_block: int | None = None
    u_max: int | None = None
    pairs_per_step: int = 8
    forward_units_per_step: int | None = None
    forward_ring_slots: int | None = None

    def __post_init__(self):
        _check_group("units_per_step", self.units_per_step)
        if self.forward_units_per_step is not None:
            _check_group("forward_units_per_step", self.forward_units_per_step)
        for name in ("ring_slots", "forward_ring_slots"):
            slots = getattr(self, name)
            if slots is not None and _positive(name, slots) < 2:
                raise ValueError(f"{name}: got {slots}, expected >= 2")
        _positive("queries_per_program", self.queries_per_program)
        _positive("pairs_per_step", self.pairs_per_step)
        if self.query_block is not None and _positive("query_block", self.query_block) % 8:
            raise ValueError(f"query_block: got {self.query_block}, expected a multiple of 8")
        if self.head_block is not None:
            _positive("head_block", self.head_block)
        if self.u_max is not None:
            _positive("u_max", self.u_max)

    def replace(self, **changes) -> SparseMlaConfig:
        return dataclasses.replace(self, **changes)

    def per_query_forward(self) -> SparseMlaConfig:
        """The config the per-query forward kernel runs at: ``units_per_step`` and
        ``ring_slots`` set to ``forward_units_per_step`` and ``forward_ring_slots`` where
        those are given."""
        g = self.forward_units_per_step or self.units_per_step
        s = self.forward_ring_slots or self.ring_slots
        return self.replace(units_per_step=g, ring_slots=s, forward_units_per_step=None,
                            forward_ring_slots=None)  # fmt: skip

    @property
    def in_flight(self) -> int:
        """Unit copies in flight behind the compute."""
        return (self.ring_slots - 1) * self.units_per_step

    def step_rows(self, read_block: int) -> int:
        """Keys per step: ``G * read_block``."""
        return self.units_per_step * read_block

    def u_chunk(self) -> int:
        """The query-blocked chunk width: ``u_max`` rounded up to a membership word's
        slots (``u_max`` must be set)."""
        if self.u_max is None:
            raise ValueError("u_max: not set")
        return -(-self.u_max // MEMBER_TILE) * MEMBER_TILE


def default_config(*, read_block: int, top_k: int, num_queries: int, heads: int) -> SparseMlaConfig:
    """The heuristic tiling: ``G * read_block`` up to :data:`STEP_ROWS` keys (at most
    :data:`MAX_DEFAULT_UNITS` units, never more than a query selects, a power of two), the
    per-query forward's ``G`` likewise up to :data:`FORWARD_STEP_ROWS` keys (at most
    :data:`MAX_UNITS_PER_STEP` units), :data:`RING_SLOTS` slots (the per-query forward
    :data:`FORWARD_RING_SLOTS_WIDE` from :data:`WIDE_HEADS` heads) and
    :func:`default_queries_per_program`."""
    g = _default_group(STEP_ROWS // read_block, MAX_DEFAULT_UNITS, top_k)
    forward = _default_group(FORWARD_STEP_ROWS // read_block, MAX_UNITS_PER_STEP, top_k)
    qp = default_queries_per_program(top_k=top_k, num_queries=num_queries, heads=heads)
    slots = FORWARD_RING_SLOTS_WIDE if heads >= WIDE_HEADS else RING_SLOTS
    return SparseMlaConfig(units_per_step=g, ring_slots=RING_SLOTS, queries_per_program=qp,
                           forward_units_per_step=forward, forward_ring_slots=slots)  # fmt: skip


def default_queries_per_program(*, top_k: int, num_queries: int, heads: int) -> int:
    """:data:`MAX_QUERIES_PER_PROGRAM`, a power of two, halved until ``QP * top_k`` is at
    most :data:`QP_TABLE_WORDS` and ``QP * heads`` at most :data:`QP_HEAD_ROWS`, but not
    below :data:`MIN_DEFAULT_QP`; never more than ``num_queries`` (at least 1)."""
    fits = min(QP_TABLE_WORDS // max(top_k, 1), QP_HEAD_ROWS // max(heads, 1))
    qp = max(MIN_DEFAULT_QP, min(MAX_QUERIES_PER_PROGRAM, _pow2_floor(max(fits, 1))))
    return max(1, min(qp, num_queries))


def _default_group(units: int, cap: int, top_k: int) -> int:
    """The largest power of two at most ``units``, ``cap`` and ``top_k`` (at least 1)."""
    return _pow2_floor(max(1, min(units, cap, _pow2_floor(max(top_k, 1)))))


def _check_group(name: str, g) -> None:
    _positive(name, g)
    if g & (g - 1) or g > MAX_UNITS_PER_STEP:
        raise ValueError(f"{name}: got {g}, expected a power of two <= {MAX_UNITS_PER_STEP}")


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


# ------------------------------------------------------------------------- VMEM estimates


def ring_bytes(config: SparseMlaConfig, *, read_block: int, row_bytes: int) -> int:
    """The unit ring: ``S * G * read_block`` rows of ``row_bytes``."""
    return config.ring_slots * config.step_rows(read_block) * row_bytes


def per_query_vmem_bytes(
    config: SparseMlaConfig, *, heads, read_block, dk_pad, dv, itemsize, row_bytes, dequantize
) -> int:
    """One per-query program: the ring, the double-buffered q / out / lse blocks, the
    step's scores and rows temporaries and the carried accumulator."""
    qp, gr = config.queries_per_program, config.step_rows(read_block)
    blocks = qp * heads * (dk_pad * itemsize + dv * 4 + 4)
    temps = 4 * heads * gr * 4 + 2 * gr * dk_pad * 4 + 3 * heads * dv * 4
    if dequantize:
        temps += gr * dk_pad * 6
    return 2 * blocks + ring_bytes(config, read_block=read_block, row_bytes=row_bytes) + temps


def qblock_vmem_bytes(
    config: SparseMlaConfig,
    *,
    rows: int,
    read_block: int,
    dk_pad: int,
    dv: int,
    itemsize: int,
    row_bytes: int,
    dequantize: bool = False,
) -> int:
    """One query-blocked program (``rows = Hb * QB`` score rows; ``query_block`` and
    ``u_max`` set): double-buffered q ``[rows, Dk_pad]``, the float32 output accumulator
    ``[rows, Dv]``, LSE, the chunk's membership words ``[member_word_rows, QB]`` and ``lim``; the
    ring; the step's score temporaries ``5 x [G * RB, rows]`` float32 and the
    accumulator update ``2 x [rows, Dv]``; the m / l scratch; FP8: the dequantized rows."""
    qb, gr = config.query_block, config.step_rows(read_block)
    blocks = rows * dk_pad * itemsize + rows * dv * 4 + rows * 4
    blocks += member_word_rows(config.u_chunk()) * qb * 4 + qb * 4
    temps = 5 * gr * rows * 4 + 2 * rows * dv * 4
    if dequantize:
        temps += gr * dk_pad * (4 + 2)
    ring = ring_bytes(config, read_block=read_block, row_bytes=row_bytes)
    return 2 * blocks + ring + temps + 2 * rows * 4


def qblock_bwd_vmem_bytes(config: SparseMlaConfig, **shape) -> int:
    """One query-blocked backward program (``shape``: :func:`qblock_vmem_bytes`'s keywords
    but ``dequantize``): the forward's blocks plus double-buffered ``dO [rows, Dv]``, the
    float32 ``dq [rows, Dk_pad]`` and the chunk's float32 partials ``[u_chunk *
    read_block, Dk_pad]``, and the step's further temporaries (``dp``, ``ds``, the finite
    keys, ``dK`` / ``dV`` of the step)."""
    rows, dk_pad, dv, itemsize = shape["rows"], shape["dk_pad"], shape["dv"], shape["itemsize"]
    rb = shape["read_block"]
    gr = config.step_rows(rb)
    blocks = rows * dv * itemsize + rows * dk_pad * 4 + config.u_chunk() * rb * dk_pad * 4
    temps = 3 * gr * rows * 4 + gr * dk_pad * (4 + itemsize) + gr * (dk_pad + dv) * 4
    return qblock_vmem_bytes(config, **shape) + 2 * blocks + temps


def vmem_limit(need: int, physical: int) -> int:
    """The scoped-VMEM request for an estimate ``need``: ``need`` with a quarter of
    slack, at least 32 MiB, at most the core's physical VMEM."""
    return int(min(max(need * 5 // 4, 32 << 20), physical))
