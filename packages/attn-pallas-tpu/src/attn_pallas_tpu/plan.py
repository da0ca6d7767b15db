"""Per-shape choice between the two TPU sparse-MLA prefill kernels, from a cost model.

The TPU backend has two sparse-MLA prefill kernels (``attn_pallas_tpu.sparse_mla`` and
``attn_pallas_tpu.sparse_mla_qblock``; ``docs/tpu_sparse_mla.md``):

* **per-query**: programs of ``QP`` queries with all ``H`` heads as score rows, each
  query's distinct valid units (a unit is ``read_block`` KV rows of ``row_bytes`` bytes:
  ``Dk_pad * itemsize`` for a float32 or bf16 cache, 768 for an FP8 cache) walked ``G``
  a step through a VMEM ring. KV bytes = ``sum_q distinct(q) * unit_bytes``.
* **query-blocked (qblock)**: one program per (block of ``QB`` queries, head group of
  ``Hb`` heads) streams the block's union of units in chunks of ``u_max`` union slots,
  ``G`` a step. Score rows per program ``Hb * QB``. KV bytes = ``(H / Hb) * sum_blocks
  union * unit_bytes``.

This module models both, picks the cheaper one per shape and is the one home of the
model (the wrapper imports :func:`choose_plan`, :func:`static_qblock_config` and the
jit-able :func:`per_query_seconds` / :func:`qblock_seconds`; the tilings' knobs and VMEM
estimates are ``attn_pallas_tpu.config``'s).

Model of one layer call (fitted to a TPU v5e; docs/tpu_sparse_mla.md, "Cost model")
------------------------------------------------------------------------------------

A call costs ``costs["call"]`` plus the larger of its work and its HBM bytes (KV units,
q, the float32 output) at the chip's HBM bandwidth; the work is a sum of counted terms
times fitted seconds (:data:`PER_QUERY_COSTS`, :data:`QBLOCK_COSTS`; FP8 dequantization
at the VPU rate on top), spread over the chip's TensorCores:

* Per-query (:func:`per_query_terms`): ring steps (``ceil(distinct / G)`` per query),
  units, key rows, and key rows times ``H`` (the score rows a key row meets).
* Query-blocked (:func:`qblock_terms`): steps of ``G`` union slots of every block and
  head group, (key, score row) pairs of those steps, accumulator elements rescaled per
  step, union units per head group, queries, and (query, head) pairs (the XLA-side
  layout changes of q and the output).

``attn_pallas_tpu.fit_plan`` fits the costs to a sweep of timed tilings on the chip.
The v5e sweeps found no cost from ring depth or queries per program (the copies hide),
so neither is priced.

Chips (:data:`TPU_CHIPS`; public peak numbers per chip, ``cores`` TensorCores share
the ``parallel`` grid):

====  ============  ==============  ====  ===========  =====  ============  ==========
chip  HBM           bf16 MXU        MXU   VPU f32 op/s cores  VMEM / core   usable
====  ============  ==============  ====  ===========  =====  ============  ==========
v5e   819 GB/s      197 TFLOP/s     128   6.1e12       1      128 MiB       96 MiB
v5p   2.765 TB/s    459 TFLOP/s     128   14.3e12      2      64 MiB        48 MiB
v6e   1.64 TB/s     918 TFLOP/s     256   6.1e12       1      128 MiB       96 MiB
====  ============  ==============  ====  ===========  =====  ============  ==========

VPU rates are a rough assumption (4 VALU slots x 1024 lanes x the clock: 1.5 GHz on
v5e and v6e, 1.75 GHz on v5p). Physical VMEM per TensorCore is taken from jax's own
TPU table (its private ``tpu_info`` module, jax 0.11.2: v5e 128 MiB, v5p 64 MiB, v6e 128 MiB);
note 95 GB is v5p's *HBM* size, not its VMEM. A program may use
``VMEM_USABLE_FRACTION = 3/4`` of it (``TpuChip.vmem_bytes``), the rest is margin for
Mosaic's internal scratch and layout padding that :func:`qblock_vmem_bytes` does not
count. SMEM: 1 MiB per core (same jax table; an assumption for real parts), i.e.
``smem_words = 262144`` int32 words; the qblock's two double-buffered unit tables
(``4 * u_pad`` words) may use at most half of it.

Fitted on the v5e only: other chips are priced with the v5e's per-step and per-row
constants scaled by nothing (their MXU and VPU rates do not enter the fitted terms),
which keeps the ranking and not the absolute time. The plan is a ranking device.

How the plan is chosen
----------------------

:func:`choose_plan` gets the per-query distinct counts and, for each candidate ``QB``,
the true union size of every block (:func:`host_union_sizes` on the host,
:func:`block_union_sizes` under jit). It enumerates ``Hb`` over the divisors of ``H``
with ``Hb * QB <= max_rows``, each with the widest ``u_max`` whose
``config.qblock_vmem_bytes`` and SMEM tables fit the chip, drops the configs that read
more than ``1 / MIN_SHARING`` of the per-query bytes, and returns the fastest if it beats
the per-query prediction; otherwise per-query.

:func:`static_qblock_config` is the shape-only fallback for use under ``jax.jit``
(unions unknown): all heads in one group (the union is fetched once) with the largest
``QB`` (a multiple of 8, at most 128) such that ``H * QB <= STATIC_ROWS`` and VMEM fits
(the wrapper also caps ``QB`` at the query count). :func:`per_query_seconds` and
:func:`qblock_seconds` evaluate the same model as jit-able ``jnp`` scalars for the
wrapper's run-time guard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.sparse_mla import lift_ragged_indices, ragged_query_info
from attn_common.tables import (
    block_selection_keys,
    lossless_u_max,
    sanitize_unit_ids,
    union_counts,
)
from attn_pallas_tpu.config import MEMBER_TILE, SparseMlaConfig, qblock_vmem_bytes

__all__ = [
    "AUTO_QUERY_BLOCKS",
    "DEQUANT_OPS_PER_VALUE",
    "MIN_SHARING",
    "PER_QUERY_COSTS",
    "QBLOCK_COSTS",
    "STATIC_U_MAX_CAP",
    "TPU_CHIPS",
    "VMEM_USABLE_FRACTION",
    "PlanShape",
    "SparseMlaPlan",
    "TpuChip",
    "block_union_sizes",
    "chip_for_device_kind",
    "choose_plan",
    "describe_plan",
    "distinct_units_per_query",
    "host_distinct_units",
    "host_union_sizes",
    "model_seconds",
    "per_query_bytes",
    "per_query_seconds",
    "per_query_terms",
    "predict_per_query",
    "predict_qblock",
    "qblock_bytes",
    "qblock_seconds",
    "qblock_terms",
    "sparse_mla_union_sizes",
    "static_qblock_config",
    "widest_head_group",
]

# The model's fitted costs (seconds per unit of each term; :func:`per_query_terms` and
# :func:`qblock_terms` count the terms), fitted to a TPU v5e (jax 0.10.2) by
# ``attn_pallas_tpu.fit_plan`` on the sweep of ``docs/results/tpu_sparse_mla_sweep.json``
# (docs/tpu_sparse_mla.md, "Cost model"): the device time of every timed tiling.
PER_QUERY_COSTS = {
    "call": 0.19e-3,  # a call: launch, the XLA-side tables
    "step": 0.167e-6,  # a ring step (ceil(distinct / G) per query)
    "unit": 25.0e-9,  # a unit's DMA
    "key_row": 1.03e-9,  # a key row of a unit
    "key_row_head": 9.05e-12,  # a key row per score row (head)
}
QBLOCK_COSTS = {
    "call": 0.175e-3,  # a call: launch, the XLA-side tables
    "step": 0.624e-6,  # a step of G union slots, per head group
    "score": 12.1e-12,  # a (key, score row) pair, masked ones included
    "acc": 0.0,  # an accumulator element rescaled per step
    "unit": 37.6e-9,  # a union unit's DMA, per head group
    "query": 17.0e-9,  # a query: its tables and its block's share
    "query_head": 16.1e-9,  # a (query, head) pair: q in, the output out of score-row order
}
DEQUANT_OPS_PER_VALUE = 4  # FP8 cache: VPU ops per dequantized value (once per unit)
AUTO_QUERY_BLOCKS = (8, 16, 32, 64, 128, 256)  # query blocks the automatic tiling compares
VMEM_USABLE_FRACTION = 0.75  # of the physical VMEM per TensorCore
SMEM_TABLE_FRACTION = 0.5  # of SMEM the qblock's unit tables may use
STATIC_U_MAX_CAP = 1024  # static_qblock_config's u_max cap (SMEM/VMEM-safe)
MIN_SHARING = 2  # the query-blocked kernel must read at most half per-query's bytes
STATIC_ROWS = 2048  # static_qblock_config's score rows (QB * H)
MAX_STATIC_QUERY_BLOCK = 128  # measured: QB 64-128 fastest at overlapping picks
U_MAX_WIDTHS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_WORD_BITS = 64  # host_union_sizes packs its presence table into uint64 words
_TABLE_BYTES = 1 << 24  # host_union_sizes' presence table per slice of queries
_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation as the cost model sees it (whole-chip rates).

    name: "v5e", "v5p" or "v6e".
    hbm_bytes_per_s: HBM bandwidth of the chip.
    mxu_flops: bf16 MXU peak of the chip (all TensorCores).
    mxu_dim: systolic array edge; a matmul with fewer LHS rows runs at ``rows / mxu_dim``.
    vpu_ops: float32 elementwise ops per second of the chip (all TensorCores).
    cores: TensorCores sharing a ``parallel`` grid.
    vmem_bytes: VMEM one program may use (``VMEM_USABLE_FRACTION`` of the physical
      VMEM per TensorCore).
    smem_words: int32 words of SMEM per TensorCore (1 MiB / 4, an assumption).
    """

    name: str
    hbm_bytes_per_s: float
    mxu_flops: float
    mxu_dim: int
    vpu_ops: float
    cores: int
    vmem_bytes: int
    smem_words: int


def _usable(physical_mib: int) -> int:
    return int(physical_mib * _MIB * VMEM_USABLE_FRACTION)


_SMEM_WORDS = (1 << 20) // 4

TPU_CHIPS: dict[str, TpuChip] = {
    "v5e": TpuChip("v5e", 819e9, 197e12, 128, 4 * 1024 * 1.5e9, 1, _usable(128), _SMEM_WORDS),
    "v5p": TpuChip(
        "v5p", 2.765e12, 459e12, 128, 2 * 4 * 1024 * 1.75e9, 2, _usable(64), _SMEM_WORDS
    ),
    "v6e": TpuChip("v6e", 1.640e12, 918e12, 256, 4 * 1024 * 1.5e9, 1, _usable(128), _SMEM_WORDS),
}


def chip_for_device_kind(kind: str | None) -> TpuChip:
    """The :data:`TPU_CHIPS` entry for a jax ``device_kind`` string.

    Case- and space-insensitive: "TPU v5 lite" / "TPU v5e" / "v5litepod" -> v5e;
    "TPU v5p" / "TPU v5" -> v5p (jax reports v5p as "TPU v5"); "TPU v6 lite" /
    "TPU v6e" / "TPU v6" -> v6e. Anything else (None, CPU/GPU kinds, "TPU v4",
    "TPU7x", ...) -> the chip with the smallest usable VMEM (v5p), so a plan made for
    an unknown chip is the most conservative about VMEM fit.
    """
    key = "".join(str(kind or "").lower().split()).removeprefix("tpu")
    if key in ("v5e", "v5lite", "v5litepod"):
        return TPU_CHIPS["v5e"]
    if key in ("v5", "v5p"):
        return TPU_CHIPS["v5p"]
    if key in ("v6", "v6e", "v6lite"):
        return TPU_CHIPS["v6e"]
    return min(TPU_CHIPS.values(), key=lambda c: (c.vmem_bytes, c.name))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _smem_ok(u_max: int, chip: TpuChip) -> bool:
    """Two int32 unit tables of ``u_pad`` entries, double-buffered."""
    u_pad = _round_up(max(u_max, 1), MEMBER_TILE)
    return 4 * u_pad <= chip.smem_words * SMEM_TABLE_FRACTION


def block_union_sizes(keys: jax.Array, *, query_block: int) -> jax.Array:
    """True union size per block of ``query_block`` consecutive queries.

    Args:
      keys: int ``[B, S, K]`` unit keys per query; negative (``-1``) = no selection;
        duplicates count once. ``S`` need not be a multiple of ``query_block``: the tail
        block is padded with empty queries.
      query_block: queries per block (static).

    Returns:
      int32 ``[B, nQB]``, ``nQB = ceil(S / query_block)``; equals
      ``build_block_unit_tables(keys[b], ...).counts``. Sort-based (no membership
      table), jit-able with ``query_block`` static.
    """
    vals = block_selection_keys(jnp.asarray(keys), query_block=query_block)
    return union_counts(jnp.sort(vals, axis=-1))


def host_union_sizes(keys: np.ndarray, query_blocks) -> dict[int, np.ndarray]:
    """:func:`block_union_sizes` on host keys for several query blocks at once.

    Args:
      keys: int ``[B, S, K]`` unit keys per query (numpy); negative = no selection;
        duplicates count once.
      query_blocks: the block sizes, each a multiple of the smallest.

    Returns:
      ``{query_block: int32 [B, ceil(S / query_block)]}``.

    Every valid key is scattered once into a presence table of the smallest blocks (a
    bit per unit once packed); each larger block's bits are the OR of its sub-blocks'
    (from the previous size when it divides, else from the smallest) and a block's
    union size is its popcount. No sort: ``O(B S K + blocks x units / 8)``; queries are
    taken in slices whose table stays within ``_TABLE_BYTES``.
    """
    keys = np.asarray(keys)
    qbs = sorted(set(query_blocks))
    if any(qb % qbs[0] for qb in qbs):
        raise ValueError(f"query_blocks: {qbs} are not all multiples of {qbs[0]}")
    batch, seq, _ = keys.shape
    width = _round_up(int(keys.max(initial=-1)) + 2, _WORD_BITS)  # column 0: no selection
    span = math.lcm(*qbs)  # queries of one slice are a whole number of every block size
    base_rows = span // qbs[0]
    step = span * max(1, _TABLE_BYTES // max(batch * base_rows * width, 1))
    if seq <= step:
        return _slice_union_sizes(keys, qbs, width, span)
    parts = [
        _slice_union_sizes(keys[:, i : i + step], qbs, width, span) for i in range(0, seq, step)
    ]
    return {qb: np.concatenate([p[qb] for p in parts], axis=1) for qb in qbs}


def _slice_union_sizes(keys: np.ndarray, qbs: list[int], width: int, span: int) -> dict:
    """:func:`host_union_sizes` of keys ``[B, S, K]`` with ids below ``width - 1``
    (``qbs`` sorted; the tail is padded with empty queries to a multiple of ``span``)."""
    batch, seq, _ = keys.shape
    base = qbs[0]
    rows = -(-seq // span) * (span // base)  # smallest blocks per batch row
    if keys.min(initial=0) < -1:
        keys = np.maximum(keys, -1)
    table = np.zeros((batch * rows, width), bool)
    table.reshape(-1)[(keys + _table_offsets(batch, seq, base, rows, width)).reshape(-1)] = True
    table[:, 0] = False  # where the no-selection keys landed
    smallest = np.packbits(table, axis=-1).view(np.uint64)  # [B * rows, width / 64]
    out, bits, level = {}, smallest, base
    for qb in qbs:
        if qb % level:
            bits, level = smallest, base
        if qb != level:
            bits = np.bitwise_or.reduce(bits.reshape(-1, qb // level, bits.shape[-1]), axis=1)
        level = qb
        counts = np.bitwise_count(bits).sum(axis=-1, dtype=np.int32)
        out[qb] = counts.reshape(batch, -1)[:, : -(-seq // qb)]
    return out


@functools.lru_cache(maxsize=16)
def _table_offsets(batch: int, seq: int, base: int, rows: int, width: int) -> np.ndarray:
    """int64 ``[B, S, 1]``: where key ``-1`` of each query lands in a flattened presence
    table of ``rows`` blocks of ``base`` queries per batch row and ``width`` columns a
    block (its block's column 0; key ``u`` lands in column ``u + 1``). Read-only
    (cached)."""
    block = np.arange(batch)[:, None] * rows + np.arange(seq)[None, :] // base
    out = (block.astype(np.int64) * width + 1)[:, :, None]
    out.flags.writeable = False
    return out


def sparse_mla_union_sizes(
    indices: jax.Array,
    *,
    query_block: int,
    read_block: int,
    kv_len: int | None = None,
    page_size: int | None = None,
    q_seq_id: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
    cu_kv_lens: jax.Array | None = None,
    page_indices: jax.Array | None = None,
) -> jax.Array:
    """True union size of every query block, from the op's own arguments: size ``u_max``.

    The query-blocked kernel streams a block's union in chunks of ``u_max`` slots, so
    ``u_max >= max(result)`` walks every block in one chunk; any smaller ``u_max`` gives
    the same answer with more chunks.

    Flat mode: ``indices [B, S, K]`` unit ids and ``kv_len`` (``T``). Ragged mode
    (``q_seq_id`` given): ``indices [1, S, K]`` request-local page ids and the ragged
    tables, keyed by global page-table slot as the kernel does (a block may straddle
    requests). Invalid ids (``-1``, out of range) do not count.

    Returns int32 ``[B, ceil(S / query_block)]``.
    """
    indices = jnp.asarray(indices)
    if q_seq_id is None:
        if kv_len is None:
            raise ValueError("kv_len: missing; flat mode needs the key length T")
        keys = sanitize_unit_ids(indices, -(-kv_len // read_block))
    else:
        if page_size is None or seq_lens is None or cu_kv_lens is None or page_indices is None:
            raise ValueError("ragged mode needs page_size, seq_lens, cu_kv_lens and page_indices")
        info = ragged_query_info(q_seq_id, seq_lens, cu_kv_lens, page_size=page_size)
        keys = lift_ragged_indices(indices[0], info, jnp.shape(page_indices)[0])[None]
    return block_union_sizes(keys, query_block=query_block)


def host_distinct_units(keys: np.ndarray) -> np.ndarray:
    """:func:`distinct_units_per_query` on host keys ``[..., K]`` (numpy): each query's
    keys sorted, a key counts where it is valid (``>= 0``) and differs from the one
    before it."""
    s = np.sort(np.asarray(keys), axis=-1)
    if s.size == 0:
        return np.zeros(s.shape[:-1], np.int32)
    new = np.empty(s.shape, bool)
    flat = s.reshape(-1)
    np.not_equal(flat[1:], flat[:-1], out=new.reshape(-1)[1:])  # one pass, across rows
    new[..., 0] = True  # a query's smallest key differs from nothing before it
    new &= s >= 0
    return np.einsum("...k->...", new.view(np.uint8), dtype=np.int32)


def distinct_units_per_query(keys: jax.Array) -> jax.Array:
    """Number of distinct valid (``>= 0``) keys per query.

    Args:
      keys: int ``[B, S, K]`` unit keys (any leading shape works: ``[..., K]``).

    Returns:
      int32 ``[B, S]`` (the leading shape of ``keys``): the per-query kernel's DMA count
      per query.
    """
    keys = jnp.asarray(keys).astype(jnp.int32)
    s = jnp.sort(keys, axis=-1)
    first = jnp.concatenate([jnp.ones((*s.shape[:-1], 1), bool), s[..., 1:] != s[..., :-1]], -1)
    return (first & (s >= 0)).sum(axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SparseMlaPlan:
    """A kernel choice with its modelled cost.

    kernel: "per_query" or "qblock".
    query_block / head_block / u_max: the qblock configuration (``None`` for per-query);
      ``u_max`` is the chunk width in union slots.
    kv_bytes: KV bytes the kernel reads from HBM.
    dma_count: unit DMAs it issues.
    predicted_s: modelled seconds for the whole call.
    chip: the :class:`TpuChip` name the prediction is for.
    """

    kernel: str
    query_block: int | None
    head_block: int | None
    u_max: int | None
    kv_bytes: int
    dma_count: int
    predicted_s: float
    chip: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanShape:
    """The problem shape the model prices: the keywords every planner function takes.

    heads: ``H`` (score rows per query).
    read_block / dk_pad / dv / itemsize: unit rows, padded key width, value width, bytes
      per query element (the cache's dtype; bf16 for an FP8 cache).
    row_bytes: KV bytes DMA'd per token: ``None`` = ``Dk_pad * itemsize`` (a float32 or
      bf16 cache), 768 for an FP8 cache (``attn_pallas_tpu.fp8_rows.ROW_BYTES``: 512
      latent bytes and a 128-lane bf16 side row), which the kernels dequantize in VMEM.
    top_k: ``K`` (size of the per-query unit lists in SMEM).
    chip: the target chip (:func:`chip_for_device_kind`).
    num_units: units per request (bounds the qblock's static chunk count ``C``); only
      the query-blocked model needs it.
    """

    heads: int
    read_block: int
    dk_pad: int
    dv: int
    itemsize: int
    top_k: int
    chip: TpuChip
    num_units: int | None = None
    row_bytes: int | None = None
    config: SparseMlaConfig = dataclasses.field(default_factory=SparseMlaConfig)

    @property
    def fp8(self) -> bool:
        """Rows that are not ``Dk_pad * itemsize`` wide: an FP8 cache, dequantized."""
        return self.row_bytes is not None and self.row_bytes != self.dk_pad * self.itemsize

    @property
    def unit_bytes(self) -> int:
        """HBM bytes of one unit (``read_block`` KV rows of ``row_bytes`` each)."""
        width = self.dk_pad * self.itemsize if self.row_bytes is None else self.row_bytes
        return self.read_block * width

    def vmem_bytes(self, *, rows: int, query_block: int, u_max: int) -> int:
        """:func:`qblock_vmem_bytes` of one qblock program at this shape."""
        return qblock_vmem_bytes(
            self.config.replace(query_block=query_block, u_max=u_max),
            rows=rows,
            read_block=self.read_block,
            dk_pad=self.dk_pad,
            dv=self.dv,
            itemsize=self.itemsize,
            row_bytes=self.dk_pad * self.itemsize if self.row_bytes is None else self.row_bytes,
            dequantize=self.fp8,
        )

    def units_per_request(self) -> int:
        """``num_units``, which the query-blocked model needs."""
        if self.num_units is None:
            raise ValueError("num_units: missing; the query-blocked model needs it")
        return self.num_units


def _dequant_seconds(s: PlanShape) -> float:
    """FP8: the VPU work of dequantizing one unit (once per unit)."""
    if not s.fp8:
        return 0.0
    return DEQUANT_OPS_PER_VALUE * s.read_block * s.dk_pad / (s.chip.vpu_ops / s.chip.cores)


def per_query_terms(steps, units, s: PlanShape) -> dict:
    """The per-query model's terms (:data:`PER_QUERY_COSTS`' keys) from its sums over
    the queries: ``steps`` (of ``ceil(distinct / G)``, ``G`` the per-query forward's,
    ``SparseMlaConfig.per_query_forward``) and ``units`` (of distinct units)."""
    rows = units * s.read_block
    return {"call": 1.0, "step": steps, "unit": units, "key_row": rows,
            "key_row_head": rows * s.heads}  # fmt: skip


def qblock_terms(steps, units, blocks: int, s: PlanShape, *, query_block, head_block) -> dict:
    """The query-blocked model's terms (:data:`QBLOCK_COSTS`' keys) from its sums over the
    blocks of one head group: ``steps`` (of ``ceil(union / G)``), ``units`` (of union
    sizes) and the number of ``blocks``; every head group walks them again. ``query_head``
    counts (query, head) pairs: q and the float32 output pass through XLA in score-row
    order, once each way."""
    if s.heads % head_block:
        raise ValueError(f"head_block {head_block} does not divide heads {s.heads}")
    groups = s.heads // head_block
    rows = head_block * query_block
    steps = steps * groups
    queries = blocks * query_block
    return {"call": 1.0, "step": steps, "score": steps * s.config.units_per_step *
            s.read_block * rows, "acc": steps * rows * s.dv, "unit": units * groups,
            "query": queries, "query_head": queries * s.heads}  # fmt: skip


def _query_bytes(queries, s: PlanShape):
    """HBM bytes of the queries' side of a call: q, the float32 output and the LSE."""
    return queries * s.heads * (s.dk_pad * s.itemsize + s.dv * 4 + 4)


def per_query_bytes(units, queries: int, s: PlanShape):
    """HBM bytes of a per-query call: its units and :func:`_query_bytes`."""
    return units * s.unit_bytes + _query_bytes(queries, s)


def qblock_bytes(units, blocks: int, s: PlanShape, *, query_block, head_block):
    """HBM bytes of a query-blocked call: its union units per head group and
    :func:`_query_bytes`."""
    return units * (s.heads // head_block) * s.unit_bytes + _query_bytes(blocks * query_block, s)


def model_seconds(xp, terms: Mapping, costs: Mapping[str, float], hbm_bytes, *, cores: int,
                  hbm_bytes_per_s: float, extra_s=0.0):  # fmt: skip
    """One call's modelled seconds: ``costs["call"]`` plus the larger of the other
    ``terms`` priced at ``costs`` (and ``extra_s``), spread over ``cores``, and
    ``hbm_bytes`` at ``hbm_bytes_per_s``. ``xp``: numpy, jax.numpy or anything with a
    ``maximum`` (the fit prices stored sweep rows with it too)."""
    work = sum(costs[k] * v for k, v in terms.items() if k != "call") + extra_s
    return costs["call"] + xp.maximum(work / cores, hbm_bytes / hbm_bytes_per_s)


def _chip_rates(s: PlanShape) -> dict:
    return {"cores": s.chip.cores, "hbm_bytes_per_s": s.chip.hbm_bytes_per_s}


def _per_query_seconds(xp, d, s: PlanShape):
    """The per-query model on a float array ``d`` of distinct units per query (``xp`` is
    numpy or jax.numpy): seconds."""
    g = s.config.per_query_forward().units_per_step
    return _per_query_model(xp, xp.ceil(d / g).sum(), d.sum(), d.size, s)


def _per_query_model(xp, steps, units, queries: int, s: PlanShape):
    """The per-query model from its sums over the queries: ``steps`` (of ``ceil(distinct
    / G)``), ``units`` (of distinct units) and the number of ``queries``: seconds."""
    terms = per_query_terms(steps, units, s)
    bytes_ = per_query_bytes(units, queries, s)
    dequant = units * _dequant_seconds(s)
    return model_seconds(xp, terms, PER_QUERY_COSTS, bytes_, **_chip_rates(s), extra_s=dequant)


def _qblock_seconds(xp, u, s: PlanShape, *, query_block: int, head_block: int):
    """The query-blocked model on a float array ``u`` of union sizes per block: seconds."""
    g = s.config.units_per_step
    return _qblock_model(
        xp, xp.ceil(u / g).sum(), u.sum(), u.size, s, query_block=query_block,
        head_block=head_block,
    )  # fmt: skip


def _qblock_model(xp, steps, units, blocks: int, s: PlanShape, *, query_block, head_block):
    """The query-blocked model from its sums over the blocks of one head group: ``steps``
    (of ``ceil(union / G)``), ``units`` (of union sizes) and the number of ``blocks``:
    seconds."""
    cfg = dict(query_block=query_block, head_block=head_block)
    terms = qblock_terms(steps, units, blocks, s, **cfg)
    dequant = terms["unit"] * _dequant_seconds(s)
    bytes_ = qblock_bytes(units, blocks, s, **cfg)
    return model_seconds(xp, terms, QBLOCK_COSTS, bytes_, **_chip_rates(s), extra_s=dequant)


_SCALAR = types.SimpleNamespace(maximum=max)  # the models' ``xp`` on Python floats


def _host_sums(x: np.ndarray, g: int) -> tuple[int, int, int]:
    """``(sum ceil(x / g), sum x, x.size)`` of a non-negative int array, exactly (the
    models' float sums of these integers are exact, so the seconds are the same)."""
    return int(((x + (g - 1)) // g).sum()), int(x.sum()), x.size


def predict_per_query(*, distinct_per_query: np.ndarray, **shape) -> SparseMlaPlan:
    """Modelled cost of the per-query kernel.

    Args:
      distinct_per_query: int array, any shape (one entry per query): distinct valid
        units per query (:func:`distinct_units_per_query`).
      **shape: the problem shape, the fields of :class:`PlanShape` (``num_units`` may
        be left out).

    Per query: one grid step, one DMA-latency prologue if it has any unit, and its
    distinct units at ``rows = H`` score rows.
    """
    s = PlanShape(**shape)
    d = np.asarray(distinct_per_query, np.int64).ravel()
    steps, units, queries = _host_sums(d, s.config.per_query_forward().units_per_step)
    t = _per_query_model(_SCALAR, float(steps), float(units), queries, s)
    return SparseMlaPlan(
        "per_query", None, None, None, units * s.unit_bytes, units, float(t), s.chip.name
    )


def predict_qblock(
    *, union_sizes: np.ndarray, query_block: int, head_block: int, u_max: int, **shape
) -> SparseMlaPlan:
    """Modelled cost of the chunked query-blocked kernel for one configuration.

    Args:
      union_sizes: int array, any shape: the true union size of every block of
        ``query_block`` queries (:func:`block_union_sizes`; padded tail blocks included).
      query_block / head_block / u_max: ``QB``, ``Hb`` (a divisor of ``heads``) and the
        chunk width in union slots (rounded up to 32, as the kernel does).
      **shape: the problem shape, the fields of :class:`PlanShape` (``num_units``
        included: it bounds the static chunk count ``C``).

    Per (block, group): ``C = ceil(min(QB * K, num_units) / u_pad)`` grid steps, one
    DMA-latency prologue per non-empty chunk (``ceil(union / u_pad)``) and ``union``
    units at ``rows = Hb * QB`` score rows.
    """
    return _predict_qblock(union_sizes, PlanShape(**shape), query_block, head_block, u_max)


def _predict_qblock(union_sizes, s: PlanShape, query_block: int, head_block: int, u_max: int):
    u = np.asarray(union_sizes, np.int64).ravel()
    sums = _host_sums(u, s.config.units_per_step)
    return _qblock_plan(sums, s, query_block, head_block, u_max)


def _qblock_plan(sums, s: PlanShape, query_block: int, head_block: int, u_max: int):
    """The qblock :class:`SparseMlaPlan` of one config from the blocks' :func:`_host_sums`."""
    steps, units, blocks = sums
    cfg = dict(query_block=query_block, head_block=head_block)
    t = _qblock_model(_SCALAR, float(steps), float(units), blocks, s, **cfg)
    units *= s.heads // head_block
    return SparseMlaPlan(
        "qblock", query_block, head_block, u_max, units * s.unit_bytes, units, float(t), s.chip.name
    )


def per_query_seconds(distinct_per_query: jax.Array, **shape) -> jax.Array:
    """:func:`predict_per_query`'s modelled seconds as a float32 jnp scalar (jit-able).

    For a runtime comparison under ``jax.jit`` (e.g. a ``lax.cond`` between the two
    kernels on modelled time rather than on bytes). ``distinct_per_query``: int, any
    shape (:func:`distinct_units_per_query`); ``**shape``: as in :func:`predict_per_query`.
    """
    d = jnp.asarray(distinct_per_query).astype(jnp.float32).ravel()
    return _per_query_seconds(jnp, d, PlanShape(**shape)).astype(jnp.float32)


def qblock_seconds(
    union_sizes: jax.Array, *, query_block: int, head_block: int, u_max: int, **shape
) -> jax.Array:
    """:func:`predict_qblock`'s modelled seconds as a float32 jnp scalar (jit-able).

    ``union_sizes``: int, any shape, one entry per block (:func:`block_union_sizes`);
    the keywords as in :func:`predict_qblock`.
    """
    u = jnp.asarray(union_sizes).astype(jnp.float32).ravel()
    cfg = dict(query_block=query_block, head_block=head_block)
    return _qblock_seconds(jnp, u, PlanShape(**shape), **cfg).astype(jnp.float32)


def _u_max_widths(largest: int) -> list[int]:
    """Multiples of 32 up to ``largest`` rounded up to 32: the powers of two below it
    and the rounded-up value itself."""
    top = _round_up(max(largest, 1), MEMBER_TILE)
    return sorted({w for w in U_MAX_WIDTHS if w < top} | {top})


def _widest_fitting(s: PlanShape, largest: int, *, rows: int, query_block: int) -> int | None:
    """The widest chunk (of :func:`_u_max_widths`) whose program fits VMEM and SMEM."""
    for u_max in reversed(_u_max_widths(largest)):
        vmem = s.vmem_bytes(rows=rows, query_block=query_block, u_max=u_max)
        if vmem <= s.chip.vmem_bytes and _smem_ok(u_max, s.chip):
            return u_max
    return None


def _check_query_block(query_block: int) -> None:
    if isinstance(query_block, bool) or not isinstance(query_block, int) or query_block < 8:
        raise ValueError(f"query_block: got {query_block!r}, expected a multiple of 8")
    if query_block % 8:
        raise ValueError(f"query_block: got {query_block}, expected a multiple of 8")


def choose_plan(
    *,
    distinct_per_query: np.ndarray,
    union_sizes: Mapping[int, np.ndarray],
    max_rows: int = 4096,
    **shape,
) -> SparseMlaPlan:
    """The fastest modelled kernel configuration for these selections.

    Args:
      distinct_per_query: int array, any shape (summed): distinct valid units per query.
      union_sizes: ``{query_block: int array of the true union size per block}`` for
        each candidate ``QB`` (a multiple of 8), e.g. from :func:`block_union_sizes`.
      max_rows: cap on ``head_block * query_block`` score rows per program.
      **shape: the problem shape, the fields of :class:`PlanShape` (``num_units``
        included; ``chip`` from :func:`chip_for_device_kind`).

    Searches ``QB`` in ``union_sizes`` and ``Hb`` over divisors of ``heads`` with
    ``Hb * QB <= max_rows``, each with the widest ``u_max`` (a chunk per union where
    VMEM and SMEM allow: chunks only add steps) whose :func:`qblock_vmem_bytes` is at
    most ``chip.vmem_bytes``; drops configs that do not move at most ``1 / MIN_SHARING``
    of per-query's KV bytes (with less sharing the per-query kernel was measured as fast
    or faster). Returns the fastest of them if it is predicted strictly
    faster than per-query, else the per-query plan (also for empty inputs). The
    ``(Hb, u_max)`` candidates of a shape are cached (:func:`_qblock_candidates`); each
    config's seconds come from three integer sums of the unions (:func:`_host_sums`).
    """
    s = PlanShape(**shape)
    per_query = predict_per_query(distinct_per_query=distinct_per_query, **shape)
    if per_query.kv_bytes == 0:
        return per_query
    best = None  # ((seconds, kv_bytes), sums, QB, Hb, u_max) of the fastest config
    for query_block in sorted(union_sizes):
        _check_query_block(query_block)
        u = np.asarray(union_sizes[query_block], np.int64).ravel()
        if u.size == 0 or u.max() <= 0:
            continue
        sums = _host_sums(u, s.config.units_per_step)
        if sums[1] * s.unit_bytes * MIN_SHARING > per_query.kv_bytes:
            continue  # the blocks share too little: even one head group saves too few bytes
        top = _round_up(int(u.max()), MEMBER_TILE)
        for head_block, u_max in _qblock_candidates(s, max_rows, query_block, top):
            kv_bytes = sums[1] * (s.heads // head_block) * s.unit_bytes
            if kv_bytes * MIN_SHARING > per_query.kv_bytes:
                continue
            cfg = dict(query_block=query_block, head_block=head_block)
            t = float(_qblock_model(_SCALAR, float(sums[0]), float(sums[1]), sums[2], s, **cfg))
            if best is None or (t, kv_bytes) < best[0]:
                best = ((t, kv_bytes), sums, query_block, head_block, u_max)
    if best is None or best[0][0] >= per_query.predicted_s:
        return per_query
    _, sums, query_block, head_block, u_max = best
    return _qblock_plan(sums, s, query_block, head_block, u_max)


@functools.lru_cache(maxsize=256)
def _qblock_candidates(
    s: PlanShape, max_rows: int, query_block: int, largest: int
) -> tuple[tuple[int, int], ...]:
    """``(head_block, u_max)`` per divisor ``head_block`` of ``heads`` (ascending) with
    ``head_block * query_block <= max_rows`` and a chunk that fits, ``u_max`` the widest
    (:func:`_widest_fitting` for unions of at most ``largest``). Shapes only: cached."""
    out = []
    for head_block in (d for d in range(1, s.heads + 1) if s.heads % d == 0):
        rows = head_block * query_block
        if rows > max_rows:
            break
        u_max = _widest_fitting(s, largest, rows=rows, query_block=query_block)
        if u_max is not None:
            out.append((head_block, u_max))
    return tuple(out)


def widest_head_group(
    *, query_block: int, largest_union: int, max_rows: int = 4096, **shape
) -> tuple[int, int] | None:
    """``(head_block, u_max)`` :func:`choose_plan` takes at ``query_block`` for unions of
    at most ``largest_union`` units: the most heads per program that fit (every cost of
    the model grows with the head groups), with the widest chunk; ``None`` if nothing
    fits. ``**shape``: the fields of :class:`PlanShape`."""
    _check_query_block(query_block)
    top = _round_up(max(largest_union, 1), MEMBER_TILE)
    found = _qblock_candidates(PlanShape(**shape), max_rows, query_block, top)
    return found[-1] if found else None


def static_qblock_config(*, max_rows: int = 4096, **shape) -> tuple[int, int, int]:
    """``(query_block, head_block, u_max)`` from shapes only (unions unknown, under jit).

    ``**shape``: the problem shape, the fields of :class:`PlanShape` (``num_units``
    included).

    Heuristic: every head group re-fetches the block's union, so prefer one group
    (``head_block = heads``) with the largest ``query_block`` (a multiple of 8, at most
    256) such that ``heads * query_block <= max_rows`` and the VMEM estimate fits
    ``chip.vmem_bytes``. If even ``query_block = 8`` does not fit with all heads, use
    ``query_block = 8`` and the largest divisor of ``heads`` that fits. ``u_max`` is the
    lossless bound ``min(QB * K, num_units)`` rounded up to 32, capped at
    ``STATIC_U_MAX_CAP = 1024`` (the kernel streams larger unions in chunks) and lowered
    further if VMEM or SMEM needs it. The wrapper is expected to compare the bytes of
    this config against per-query at run time.

    Raises:
      ValueError: if no configuration fits (not even 8 queries x 1 head).
    """
    s = PlanShape(**shape)
    chip, heads = s.chip, s.heads

    def u_max_for(query_block: int, head_block: int) -> int | None:
        lossless = lossless_u_max(query_block, s.top_k, s.units_per_request())
        u_max = min(_round_up(lossless, MEMBER_TILE), STATIC_U_MAX_CAP)
        rows = head_block * query_block
        while u_max >= MEMBER_TILE:
            vmem = s.vmem_bytes(rows=rows, query_block=query_block, u_max=u_max)
            if vmem <= chip.vmem_bytes and _smem_ok(u_max, chip):
                return u_max
            u_max -= MEMBER_TILE
        return None

    top = min(
        MAX_STATIC_QUERY_BLOCK,
        (STATIC_ROWS // max(heads, 1)) // 8 * 8,
        max_rows // max(heads, 1) // 8 * 8,
    )
    for query_block in range(top, 7, -8):
        u_max = u_max_for(query_block, heads)
        if u_max is not None:
            return query_block, heads, u_max
    for head_block in sorted((d for d in range(1, heads + 1) if heads % d == 0), reverse=True):
        if head_block * 8 > max_rows:
            continue
        u_max = u_max_for(8, head_block)
        if u_max is not None:
            return 8, head_block, u_max
    raise ValueError(
        f"no query-blocked configuration fits {chip.name} VMEM ({chip.vmem_bytes} bytes) "
        f"for heads={heads}, read_block={s.read_block}, dk_pad={s.dk_pad}, dv={s.dv}"
    )


def describe_plan(plan: SparseMlaPlan) -> str:
    """A short label: ``"per-query"`` or ``"qblock QB=.. Hb=.. u_max=.."``."""
    if plan.kernel == "per_query":
        return "per-query"
    return f"qblock QB={plan.query_block} Hb={plan.head_block} u_max={plan.u_max}"
