"""Ranker attention forward for TPU: a Pallas Mosaic TPU flash-attention kernel.

Op (docs/semantics.md, "Ranker attention"): ``q [B,S,Hq,D]``, ``k, v [B,S,Hkv,D]``,
traced ``bounds [B,4]``; query ``i`` attends key ``j`` iff ``attn_common.ranker_mask``
allows it; logits ``cap(q.k * sm_scale)``; ``out [B,S,Hq,D]`` in q's dtype and
``lse [B,Hq,S]`` float32 (natural log). A row with no allowed key gives ``out = 0``,
``lse = -inf``.

Schedule
--------
Grid ``(B, Hq / Hp, q_tiles, kv_steps)``, dimension semantics ``(parallel, parallel,
parallel, arbitrary)``. One program row ``(b, h, i)`` owns ``block_q`` query rows of
``Hp`` query heads of one kv head (``RankerStatic.heads_per_program``: the largest
divisor of the GQA group, up to 8, whose VMEM estimate fits) in one batch row, and walks
``kv_steps = S_pad / block_kv`` grid steps (the static maximum: bounds are data, so the
number of blocks a tile visits is not known at trace time).

* Tables (built outside the kernel by plain ``jnp``, ``kv_step_table``): for every
  ``(b, i)`` the visit-once KV block ranges of ``attn_common.bounds.ranker_kv_block_ranges``
  (two runs: the history blocks merged with the blocks of the tile's own candidates, so
  a block shared by both is visited once) and the steps ``[full_lo, full_hi)`` of
  ``attn_common.bounds.ranker_full_kv_steps`` whose block every row of the tile may attend in
  full. The table and the clipped bounds are scalar-prefetched into SMEM
  (``pltpu.PrefetchScalarGridSpec``).
* Who loads what: the Pallas pipeline DMAs the ``Hp`` heads' Q tiles once per ``(b, h,
  i)`` (their block index does not change along the KV axis). The K and V block specs'
  index maps read the table: step ``j < steps`` fetches block ``BlockRanges.block_at(j)``
  of the program's kv head, once for its ``Hp`` query heads (GQA reads the shared kv
  head in place: no per-query-head copies of K/V exist anywhere); step ``j >= steps`` is
  clamped to the tile's last visited block, so the block index does not change and the
  pipeline issues no DMA. Blocks outside the ranges are never fetched.
* Compute: ``pl.when(j < steps)``; per head, the QK^T product on the MXU (f32
  accumulation), the scale, cap and ``log2(e)`` folded into the cap's multiplies
  (``attn_common.cap.cap_scaled_with_derivative``: logits in base 2), the ranker mask
  (``ranker_mask`` on the tile iotas, built once a step for the ``Hp`` heads) only on
  steps outside ``[full_lo, full_hi)``, and an ``exp2`` softmax whose offsets (or, where
  ``softmax == "running"``, running max) / sum / f32 accumulator live in VMEM scratch
  (one slab per head) across the KV axis. The
  heads are independent chains in one step body, so one head's matmuls can overlap
  another's softmax.
* Bounded logits: where the cap bounds the base-2 logits to ``(-C, C)``, ``C = c
  log2(e)``, with ``2C <= 126 - BOUNDED_ERROR_BITS`` (``RankerStatic.softmax_offset``),
  the softmax takes the fixed offset ``C`` (:func:`bounded_softmax_update`): ``p = 2^(y
  - C) <= 1``, no row max (a reduction over the whole score tile that every ``p`` would
  wait on) and no rescale. ``p >= 2^-2C``, so a product ``p v`` flushes below
  float32's smallest normal only for ``|v| < 2^(2C - 126)``: at most that much absolute
  error in ``out``. The LSE is ``C + log2(l)``.
* No cap and the other tanh / soft_sign caps (``softmax == "row"``) take a fixed offset
  per query row: at the first step each head's ``m_i = cap(|q_i| kmax_i sm_scale)`` in
  base 2 (the identity for no cap; plus
  ``ROW_BOUND_MARGIN``; :func:`row_offset`), ``kmax_i`` the largest ``|k_j|`` over the
  keys query ``i`` attends (XLA, :func:`attended_key_norms`; a ``(1, block_q)`` row per
  tile), so ``p <= 1`` by Cauchy-Schwarz, again with no row max, and the offset reads
  only what the row attends (isolation stays bitwise). A row whose logits sit far below
  its bound would lose its ``p`` to float32's range: the last step writes a NaN LSE for
  an attended row whose sum is below ``2^-row_floor_bits``, and where one does the
  wrapper (:func:`forward_or_again`) runs the call again with a running max and takes
  those rows from it (a ``lax.cond`` on the device; under ``vmap``, a select that runs
  both). A NaN the inputs put in an attended row takes the same way, to the same NaN.
* At the last KV step the program normalises and writes its whole O tile and its LSE
  row (also when it had no step), so every element of the outputs is written.

Isolation (docs/semantics.md): rows a query does not attend may hold anything (NaN,
Inf, 1e30). Scores are pair-local (``s_ij`` reads only ``q_i`` and ``k_j``) and the mask
is a select, so garbage can only leak through a product over positions: ``P V`` sums
``p_ij v_j`` over the block's keys, and ``0 * NaN = NaN`` for a key ``j`` that row ``i``
does not attend. Zeroing the rows the tile does not attend is not enough (a tile can
hold rows of two packed users, or a candidate whose key only it attends), so on a
masked step (a boundary block; full steps keep the path above, every pair there being
attended) the kernel

* replaces the non-finite elements of the V block by 0 (a select on ``block_kv x D``
  elements) and notes which key rows held one (a lane reduction, turned into a lane
  row by the same transpose as the LSE);
* adds NaN to the accumulator row of every query that attends such a key (a select and
  a lane reduction over the step's mask), so attended garbage still gives NaN.

Unattended pairs then contribute exactly ``0 * finite = 0``: a query's output equals the
run with every row it does not attend zeroed, bitwise, and a poisoned row never reaches
another user of a packed row. The backward kernels do the same for their operands.

Empty rows stay NaN-free: the running max starts at a large finite negative number
(``-1e30``), so a row that has seen no allowed key gives ``exp(-inf - m) = 0`` and
``exp(m - m) = 1``, never ``exp(-inf - -inf)`` (the bounded path's ``2^(-inf - C)`` is
0 too); at the end ``l == 0`` marks an empty row,
whose divide is guarded, giving ``out = 0`` and ``lse = -inf``. A q tile with no history
or candidate row has zero steps and writes zeros / ``-inf`` directly.

Layouts: for ``D % 128 == 0`` q/k/v/out are viewed as ``[B, S, H*D]`` (a free
reshape), a head is a lane block of width ``D`` and a program's ``Hp`` heads (adjacent:
query head ``h`` belongs to kv head ``h // (Hq / Hkv)``) one block of width ``Hp * D``;
for ``D = 64`` (narrower than a lane tile), and where the device lays q out heads-major
by default (``heads_major``: a TPU does at some head counts, e.g. 20), they are
transposed to ``[B, H, S, D]`` by XLA outside the kernel (for such a q a free bitcast)
and a program's heads are a ``[Hp, rows, D]`` block. The LSE is stored as ``[B, Hq, 1,
S]`` (lane-dense; the column of row statistics is transposed once per tile in the
kernel).

Any ``S``: k and v are zero-padded to a multiple of ``lcm(block_q, block_kv)``; q and
the outputs keep their ``S`` rows where ``S >= block_q`` and only the last q tile runs
past ``S`` (:func:`q_rows`), that tile partly past them (Pallas reads unspecified rows
there and drops their writes; a query row's scores, softmax and output depend on that
row alone, so they touch no real row), else they are padded too and the outputs sliced.
Padding keys are never allowed because bounds are clipped to ``[0, S]``
(``attn_common.normalize_bounds``). fp32 inputs use ``Precision.HIGHEST`` matmuls.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common import check_ranker_inputs, ranker_mask
from attn_common.bounds import (
    ranker_full_kv_steps,
    ranker_full_q_steps,
    ranker_kv_block_ranges,
    ranker_q_block_ranges,
)
from attn_common.cap import cap_scaled_with_derivative
from attn_common.packed import (
    TileRuns,
    normalize_ranker_bounds,
    packed_step_table,
    ranker_mask_users,
)
from attn_common.spec import RankerCall, public_op, ranker_call
from attn_pallas_tpu import ranker_tuning
from attn_pallas_tpu._compat import approx_reciprocal, default_major_to_minor
from attn_pallas_tpu._mxu import mxu_dot
from attn_pallas_tpu._prep import resolve_interpret
from attn_pallas_tpu.ranker_config import (
    DIMENSION_SEMANTICS,
    LANES,
    LOG2E,
    ROW_BOUND_MARGIN,
    ROW_BOUND_SLACK,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    VMEM_LIMIT_BYTES,
    RankerStatic,
    default_config,
    fwd_scratch,
    make_static,
    table_words,
    validate_config,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "default_config",
    "head_of",
    "kernel_forward",
    "kv_step_table",
    "masked_kv_step",
    "program_tile",
    "q_step_table",
    "q_tile_index_maps",
    "ranker_attention_fwd",
    "run_step",
    "validate_config",
    "walk_tile",
]

# Initial running max: finite, so empty rows never compute -inf - -inf.
M_INIT = -1e30
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- layout


def to_kernel_layout(x, st: RankerStatic, rows: int | None = None):
    """``[B, S, H, D]`` -> kernel layout (``[B, R, H*D]`` or ``[B, H, R, D]``) of ``rows``
    (``R``; default ``S_pad``) positions, zero-padded from ``S``."""
    batch, seq, heads, dim = x.shape
    rows = st.seq_pad if rows is None else rows
    if seq != rows:
        x = jnp.pad(x, ((0, 0), (0, rows - seq), (0, 0), (0, 0)))
    if st.flat:
        return x.reshape(batch, rows, heads * dim)
    return x.transpose(0, 2, 1, 3)


def from_kernel_layout(y, st: RankerStatic, heads: int, seq_len: int):
    """Inverse of ``to_kernel_layout``: back to ``[B, S, H, D]``, padding sliced off."""
    flat = st.flat
    y = y.reshape(st.batch, y.shape[1], heads, st.head_dim) if flat else y.transpose(0, 2, 1, 3)
    return y if y.shape[1] == seq_len else y[:, :seq_len]


def q_rows(st: RankerStatic, seq_len: int) -> int:
    """Rows of q and of the forward's outputs in the kernel layout: ``S`` where at least
    one q tile fits in it and only the last tile runs past ``S`` (``S_pad``, a multiple of
    ``lcm(block_q, block_kv)``, can leave whole q tiles past it), else ``S_pad``. Skipping
    the pad skips XLA's pad of q and slice of the output, and the relayouts around them
    (at 64 x 1152, H 20, 640-row tiles on a v5e: 7.8 ms of a 28 ms forward)."""
    fits = seq_len >= st.block_q and st.seq_pad - st.block_q < seq_len
    return seq_len if fits else st.seq_pad


def kernel_shape(st: RankerStatic, heads: int, rows: int | None = None) -> tuple[int, ...]:
    """The kernel layout's shape of ``heads`` heads at ``rows`` positions (``S_pad``)."""
    rows = st.seq_pad if rows is None else rows
    if st.flat:
        return (st.batch, rows, heads * st.head_dim)
    return (st.batch, heads, rows, st.head_dim)


def row_block_spec(st: RankerStatic, rows: int, index, heads: int | None = None) -> pl.BlockSpec:
    """Block of ``rows`` positions x one head; ``index(*grid, *refs) -> (b, head, blk)``.
    With ``heads``: ``heads`` adjacent heads, ``head`` counting blocks of them (a kernel
    reads head ``g`` of the block at ``head_of(st, g)``)."""
    if st.flat:

        def flat_map(*args):
            b, head, blk = index(*args)
            return (b, blk, head)

        return pl.BlockSpec((None, rows, (heads or 1) * st.head_dim), flat_map)

    def heads_map(*args):
        b, head, blk = index(*args)
        return (b, head, blk, 0)

    return pl.BlockSpec((None, heads, rows, st.head_dim), heads_map)


def head_of(st: RankerStatic, g: int) -> tuple:
    """The index of head ``g`` in a ``row_block_spec(..., heads=...)`` block."""
    d = st.head_dim
    return (slice(None), slice(g * d, (g + 1) * d)) if st.flat else (g,)


def stat_block_spec(rows: int, index, heads: int | None = None) -> pl.BlockSpec:
    """Block ``(1, rows)`` of a ``[B, Hq, 1, S_pad]`` f32 row statistic (lse, delta);
    with ``heads``, ``(heads, 1, rows)`` (``head`` counting blocks of heads)."""

    def stat_map(*args):
        b, head, blk = index(*args)
        return (b, head, 0, blk)

    return pl.BlockSpec((None, heads, 1, rows), stat_map)


def row_to_col(row, rows: int):
    """``(1, rows)`` -> ``(rows, 1)`` via a lane-aligned ``(128, rows)`` transpose."""
    return jnp.broadcast_to(row, (LANES, rows)).T[:, :1]


def col_to_row(col, rows: int):
    """``(rows, 1)`` -> ``(1, rows)`` via a lane-aligned ``(rows, 128)`` transpose."""
    return jnp.broadcast_to(col, (rows, LANES)).T[:1, :]


def finite_or_zero(x, rows: int):
    """Isolation of a masked step (module docstring): ``x (rows, D)`` with every
    non-finite element replaced by 0, and a ``(1, rows)`` f32 lane row that is 1 where the
    row held a non-finite element (0 elsewhere)."""
    ok = jnp.isfinite(x.astype(jnp.float32))
    clean = jnp.where(ok, x, jnp.zeros_like(x))
    bad = jnp.max(jnp.where(ok, 0.0, 1.0), axis=1, keepdims=True)  # (rows, 1)
    return clean, col_to_row(bad, rows)


def nan_where_attended(allowed, bad_row):
    """``(n, 1)`` f32: NaN for a row whose ``allowed`` pairs (an ``(n, rows)`` mask) reach
    a row flagged in ``bad_row`` (``(1, rows)``), else 0. Added to an f32 accumulator it
    makes exactly the rows that attend a non-finite row NaN."""
    hit = jnp.max(jnp.where(allowed, bad_row, 0.0), axis=1, keepdims=True)
    return jnp.where(hit > 0.0, jnp.nan, 0.0)


def dot(a, b, *, trans_b: bool = False, trans_a: bool = False):
    """MXU matmul with f32 accumulation (``Precision.HIGHEST`` for f32 operands)."""
    return mxu_dot(a, b, (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ())))


# ----------------------------------------------------------------------------- tables


def _pack(ranges, full_lo, full_hi):
    zero = jnp.zeros_like(ranges.first_start)
    cols = (
        ranges.first_start,
        ranges.first_steps,
        ranges.second_start,
        ranges.second_steps,
        full_lo,
        full_hi,
        zero,
        zero,
    )
    return jnp.stack([jnp.asarray(c, jnp.int32) for c in cols], axis=-1).reshape(-1)


def _step_table(bounds, st: RankerStatic, *, keys: bool) -> jax.Array:
    """Per (b, tile) step-table rows: query tiles over KV blocks, or with ``keys`` KV
    tiles over query blocks."""
    if keys:
        tile, num_tiles, block = st.block_kv, st.kv_tiles, st.block_q
        block_ranges, full_steps = ranker_q_block_ranges, ranker_full_q_steps
    else:
        tile, num_tiles, block = st.block_q, st.q_tiles, st.block_kv
        block_ranges, full_steps = ranker_kv_block_ranges, ranker_full_kv_steps
    if st.packed_users:
        table = packed_step_table(bounds, tile=tile, num_tiles=num_tiles, block=block, keys=keys)
        return table.reshape(-1)
    hl, hu, cl, cu = (bounds[:, t, None] for t in range(4))
    t0 = jnp.arange(num_tiles, dtype=jnp.int32)[None] * tile
    t1 = t0 + tile
    ranges = block_ranges(hl, hu, cl, cu, t0, t1, block)
    lo, hi = full_steps(ranges, hl, hu, cl, cu, t0, t1, block)
    return _pack(ranges, lo, hi)


def kv_step_table(bounds, st: RankerStatic) -> jax.Array:
    """int32 ``[B * q_tiles * 8]``: per (b, q tile) ``first_start, first_steps,
    second_start, second_steps, full_lo, full_hi, 0, 0`` of its KV block ranges.
    Packed bounds ``[B, U, 4]`` (``st.packed_users``): ``[B * q_tiles * (4U + 2)]`` in the
    ``attn_common.packed.packed_step_table`` layout (``starts[R], ends[R], full_lo,
    full_hi``)."""
    return _step_table(bounds, st, keys=False)


def q_step_table(bounds, st: RankerStatic) -> jax.Array:
    """int32 ``[B * kv_tiles * 8]``: the same fields for the query block ranges of each
    (b, kv tile) (``ranker_q_block_ranges`` / ``ranker_full_q_steps``), for dK/dV;
    packed bounds as in ``kv_step_table``."""
    return _step_table(bounds, st, keys=True)


class TileSteps:
    """One tile's row of a step table, read from SMEM (scalars). ``runs`` is
    ``RankerStatic.runs``: 0 for the one-user layout, ``2U`` for packed tables."""

    def __init__(self, tab_ref, tile, runs: int = 0):
        self.runs = runs
        base = tile * table_words(runs)
        if runs:
            self.tile_runs = TileRuns.read(lambda i: tab_ref[base + i], runs)
            self.full_lo = tab_ref[base + 2 * runs]
            self.full_hi = tab_ref[base + 2 * runs + 1]
            return
        self.first_start = tab_ref[base]
        self.first_steps = tab_ref[base + 1]
        self.second_start = tab_ref[base + 2]
        self.second_steps = tab_ref[base + 3]
        self.full_lo = tab_ref[base + 4]
        self.full_hi = tab_ref[base + 5]

    @property
    def total(self):
        if self.runs:
            return self.tile_runs.total_steps
        return self.first_steps + self.second_steps

    def block_at(self, step):
        if self.runs:
            return self.tile_runs.block_at(step)
        return jnp.where(
            step < self.first_steps,
            self.first_start + step,
            self.second_start + (step - self.first_steps),
        )

    def clamped_block(self, step):
        """The block of ``step``, or of the last visited step past the end (no new DMA)."""
        last = jnp.maximum(self.total - 1, 0)
        return self.block_at(jnp.minimum(step, last))

    def is_full(self, step):
        return (step >= self.full_lo) & (step < self.full_hi)


def program_tile(st: RankerStatic, tab_ref, bounds_ref, *, tiles: int):
    """This program's ``(tile, j)`` (grid axes 2 and 3), its tile's ``TileSteps``
    (``tiles`` tiles per batch row) and its batch row's (axis 0) bounds."""
    b, t, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    steps = TileSteps(tab_ref, b * tiles + t, st.runs)
    return t, j, steps, read_bounds(bounds_ref, b, st.packed_users)


def run_step(steps: TileSteps, j, step) -> None:
    """``step(masked)`` at grid step ``j``: unmasked on the tile's full steps, masked on
    its other visited steps, nothing past them."""
    active = j < steps.total
    full = steps.is_full(j)
    pl.when(active & full)(functools.partial(step, False))
    pl.when(active & jnp.logical_not(full))(functools.partial(step, True))


def q_tile_index_maps(st: RankerStatic):
    """The index maps of the kernels that walk a q tile's KV steps (the forward and dq,
    ``st.heads_per_program`` query heads a program): ``q_index`` the tile's own blocks (Q,
    O, dO and the row statistics, fetched once per ``(b, h, i)``; ``h`` counts blocks of
    heads), ``kv_index`` the step's K/V block of the heads' kv head (past the tile's steps
    its last visited block, so no DMA is issued)."""
    group = st.group_size // st.heads_per_program  # head blocks per kv head

    def q_index(b, h, i, j, bounds_ref, tab_ref):
        return b, h, i

    def kv_index(b, h, i, j, bounds_ref, tab_ref):
        steps = TileSteps(tab_ref, b * st.q_tiles + i, st.runs)
        return b, lax.div(h, jnp.int32(group)), steps.clamped_block(j)

    return q_index, kv_index


def walk_tile(st: RankerStatic, tab_ref, bounds_ref, *, tiles: int, steps: int, init, step,
              finish, step_of=None):  # fmt: skip
    """The walk every TPU ranker kernel shares: grid axis 3 runs over ``steps`` steps of
    one tile (``tiles`` tiles per batch row); ``init()`` at the first, ``step(tile, s,
    tile_steps, bounds, masked)`` at each of the tile's visited steps ``s`` (the grid step
    ``j``, or ``step_of(j)``; ``run_step``), ``finish()`` at the last. The accumulators
    live in VMEM scratch across the steps."""
    tile, j, tile_steps, bounds = program_tile(st, tab_ref, bounds_ref, tiles=tiles)
    s = j if step_of is None else step_of(j)
    pl.when(j == 0)(init)
    run_step(tile_steps, s, functools.partial(step, tile, s, tile_steps, bounds))
    pl.when(j == steps - 1)(finish)


def read_bounds(bounds_ref, b, packed_users: int = 0):
    """Row ``b``'s bounds from SMEM: 4 scalars, or (packed) ``U`` tuples of 4."""
    if packed_users:
        return tuple(
            tuple(bounds_ref[(b * packed_users + u) * 4 + t] for t in range(4))
            for u in range(packed_users)
        )
    return tuple(bounds_ref[b * 4 + t] for t in range(4))


def masked_kv_step(st: RankerStatic, bounds, steps: TileSteps, i, j, x):
    """A q tile's masked step ``j`` (tile ``i``), once for the program's heads: the
    ``(block_q, block_kv)`` mask, the step's K or V block ``x`` with its non-finite
    elements zeroed, and the ``(block_q, 1)`` NaN-where-attended poison
    (``finite_or_zero``, ``nan_where_attended``)."""
    kv0 = steps.block_at(j) * st.block_kv
    allowed = tile_mask(bounds, i * st.block_q, kv0, (st.block_q, st.block_kv), q_axis=0)
    clean, bad = finite_or_zero(x, st.block_kv)
    return allowed, clean, nan_where_attended(allowed, bad)


def scaled_capped(raw, st: RankerStatic):
    """``log2(e) * cap(raw * sm_scale)`` (f32): the logit in base 2 for an ``exp2``
    softmax, ``sm_scale``, the cap's ``1 / c`` and ``log2(e)`` folded into the multiplies
    the cap takes anyway (the derivative the helper also returns is dead code here)."""
    y2, _ = cap_scaled_with_derivative(
        raw, st.cap, st.sm_scale, out_scale=LOG2E, reciprocal=newton_reciprocal
    )
    return y2


def newton_reciprocal(d):
    """``1 / d`` for soft_sign's denominator (``d >= 1 / k > 0``): the EUP's approximate
    reciprocal refined by one Newton step, ``r (2 - d r)`` (three VPU operations; the
    relative error squares, to about f32's rounding), in place of the IEEE divide's
    longer sequence. A NaN ``d`` gives NaN through ``d r``; an infinite one (an attended
    +-Inf logit) gives NaN, as IEEE's ``Inf / Inf`` does, where the approximation of
    ``1 / Inf`` is 0 (tests/test_ranker_isolation.py's attended-Inf case checks it on a
    chip; interpret mode divides exactly)."""
    r = approx_reciprocal(d)
    return r * (2.0 - d * r)


def tile_mask(bounds, q0, kv0, shape, *, q_axis: int):
    """Ranker mask of a tile whose query positions run along ``q_axis``."""
    q_ids = q0 + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    kv_ids = kv0 + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    if bounds and isinstance(bounds[0], tuple):  # packed: OR over the row's users
        return ranker_mask_users(q_ids, kv_ids, bounds)
    return ranker_mask(q_ids, kv_ids, *bounds)


# ----------------------------------------------------------------------------- kernel


def online_softmax_update(s, v, m_prev, l_prev, acc_prev):
    """One step of the running-max ``exp2`` softmax: base-2 logits ``s (bq, bkv)`` (-inf
    where masked), the step's V block, and the head's running max and sum ``(bq, 128)``
    (lane-broadcast) and f32 accumulator; returns the three updated."""
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, :1])
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    return m_next, l_next, acc_prev * alpha[:, :1] + dot(p.astype(v.dtype), v)


def bounded_softmax_update(s, v, offset, l_prev, acc_prev):
    """One step of the softmax at a fixed offset (a float, ``RankerStatic.softmax_offset``,
    or a ``(bq, 1)`` column, :func:`row_offset`), a bound of the logits: ``p = 2^(s -
    offset) <= 1`` needs no row max, so nothing waits on a reduction over the tile and
    nothing is rescaled; returns the sum and accumulator."""
    p = jnp.exp2(s - offset)
    return l_prev + jnp.sum(p, axis=1, keepdims=True), acc_prev + dot(p.astype(v.dtype), v)


def row_offset(q, kmax, st: RankerStatic):
    """The ``"row"`` softmax's ``(bq, 1)`` offsets of a head's q tile ``(bq, D)``, ``kmax``
    ``(bq, 1)``: the base-2 ``cap(|q_i| kmax_i sm_scale)`` (``kmax`` inflated by
    ``ROW_BOUND_SLACK``) plus ``ROW_BOUND_MARGIN``. Under a cap it is at most the cap's
    ``C`` plus the margin, which a non-finite ``q_i`` or ``kmax_i`` takes (rows past ``S``
    hold unspecified values); with no cap such a row's offset is ``+inf``: every ``p`` of
    it 0 (NaN where the logit is NaN or ``+inf``), so an attended one is run again and a
    row that attends nothing keeps its zero sum."""
    q = q.astype(jnp.float32)
    raw = jnp.sqrt(jnp.sum(q * q, axis=1, keepdims=True)) * (kmax * (1.0 + ROW_BOUND_SLACK))
    m = scaled_capped(raw, st) + ROW_BOUND_MARGIN
    top = jnp.inf if st.cap_bound is None else st.cap_bound + ROW_BOUND_MARGIN
    return jnp.where(m < top, m, top)


def attends_any(bounds, q0, rows: int):
    """``(rows, 1)``: whether query ``q0 + r`` attends any key. A row that attends one
    attends itself (a history row the history, a candidate itself), so this is the mask's
    diagonal."""
    ids = (q0 + lax.broadcasted_iota(jnp.int32, (rows, LANES), 0))[:, :1]
    if bounds and isinstance(bounds[0], tuple):  # packed
        return ranker_mask_users(ids, ids, bounds)
    return ranker_mask(ids, ids, *bounds)


def _build_fwd_kernel(st: RankerStatic):
    bq, heads, softmax, offset = st.block_q, st.heads_per_program, st.softmax, st.softmax_offset

    def kernel(
        # scalar prefetch (SMEM)
        bounds_ref,  # [B * 4] or [B * U * 4] int32: the clipped bounds
        tab_ref,  # [B * q_tiles * words] int32: each q tile's KV steps (kv_step_table)
        # inputs (VMEM blocks; head g of a heads block at head_of(st, g))
        q_ref,  # [block_q, Hp * D] or [Hp, block_q, D]: the tile's queries of Hp heads
        k_ref,  # [block_kv, D]: the step's keys of their kv head
        v_ref,  # [block_kv, D]
        *refs,  # the "row" softmax's kmax_ref, then the outputs and the scratch:
        # kmax_ref,  [1, block_q] f32: the tile's rows of attended_key_norms
        # o_ref,  as q_ref
        # lse_ref,  [Hp, 1, block_q] f32, natural log
        # m_sc,  [Hp, block_q, 128] f32: running max or offsets, lane-broadcast
        # l_sc,  [Hp, block_q, 128] f32: running sum
        # acc_sc,  [Hp, block_q, D] f32
    ):
        kmax_ref = refs[0] if softmax == "row" else None
        o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[softmax == "row" :]

        def init():
            if softmax == "row":
                kmax = row_to_col(kmax_ref[...], bq)
                for g in range(heads):
                    m = row_offset(q_ref[head_of(st, g)], kmax, st)
                    m_sc[g] = jnp.broadcast_to(m, (bq, LANES))
            else:
                m_sc[...] = jnp.full(m_sc.shape, M_INIT if offset is None else offset, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        def step(i, j, steps, bounds, masked: bool):
            k, v = k_ref[...], v_ref[...]
            poison = 0.0
            if masked:  # once for the heads; isolation: no 0 * NaN from unattended V rows
                allowed, v, poison = masked_kv_step(st, bounds, steps, i, j, v)
            for g in range(heads):
                s = scaled_capped(dot(q_ref[head_of(st, g)], k, trans_b=True), st)
                if masked:
                    s = jnp.where(allowed, s, -jnp.inf)
                if softmax == "running":
                    m_sc[g], l_sc[g], acc = online_softmax_update(s, v, m_sc[g], l_sc[g], acc_sc[g])
                else:  # m_sc holds the offsets throughout
                    off = offset if softmax == "fixed" else m_sc[g][:, :1]
                    l_sc[g], acc = bounded_softmax_update(s, v, off, l_sc[g], acc_sc[g])
                acc_sc[g] = acc + poison if masked else acc

        def finish():
            if softmax == "row":
                bounds = read_bounds(bounds_ref, pl.program_id(0), st.packed_users)
                attends = attends_any(bounds, pl.program_id(2) * bq, bq)
                floor = 2.0**-st.row_floor_bits
            for g in range(heads):
                l = l_sc[g][:, :1]
                has_key = l > 0.0
                safe_l = jnp.where(has_key, l, 1.0)
                o_ref[head_of(st, g)] = (acc_sc[g] * (1.0 / safe_l)).astype(o_ref.dtype)
                lse = jnp.where(has_key, (m_sc[g][:, :1] + jnp.log2(safe_l)) * LN2, -jnp.inf)
                if softmax == "row":  # NaN: an attended row this offset cannot serve
                    lse = jnp.where(attends & jnp.logical_not(l >= floor), jnp.nan, lse)
                lse_ref[g] = col_to_row(lse, bq)

        walk_tile(
            st, tab_ref, bounds_ref, tiles=st.q_tiles, steps=st.kv_tiles, init=init, step=step,
            finish=finish,
        )  # fmt: skip

    return kernel


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def _fwd_padded(q, k, v, bounds, kmax, *, st: RankerStatic, interpret):
    """q/k/v in kernel layout (q at ``q_rows``, k / v at ``S_pad`` rows); bounds clipped
    int32 ``[B, 4]`` (or ``[B, U, 4]``); ``kmax`` the ``"row"`` softmax's
    :func:`attended_key_norms` at q's rows (else ``None``). Returns (out, lse) at q's
    rows."""
    rows = q.shape[1] if st.flat else q.shape[2]
    tab = kv_step_table(bounds, st)
    q_index, kv_index = q_tile_index_maps(st)
    heads = st.heads_per_program
    row = st.softmax == "row"

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=st.grid("fwd"),
        in_specs=[
            row_block_spec(st, st.block_q, q_index, heads),
            row_block_spec(st, st.block_kv, kv_index),
            row_block_spec(st, st.block_kv, kv_index),
            *([kv_stat_block_spec(st, q_index)] if row else []),
        ],
        out_specs=[
            row_block_spec(st, st.block_q, q_index, heads),
            stat_block_spec(st.block_q, q_index, heads),
        ],
        scratch_shapes=fwd_scratch(st.block_q, st.head_dim, heads),
    )
    out, lse = pl.pallas_call(
        _build_fwd_kernel(st),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(kernel_shape(st, st.q_heads, rows), q.dtype),
            jax.ShapeDtypeStruct((st.batch, st.q_heads, 1, rows), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=DIMENSION_SEMANTICS,
            vmem_limit_bytes=VMEM_LIMIT_BYTES,
        ),
        interpret=interpret,
    )(bounds.reshape(-1), tab, q, k, v, *([kmax] if row else []))
    return out, lse


def kv_stat_block_spec(st: RankerStatic, q_index) -> pl.BlockSpec:
    """Block ``(1, block_q)`` of a ``[B, Hkv, 1, rows]`` f32 per-query statistic of the
    program's kv head (``attended_key_norms``), at the program's q tile."""
    head_blocks = st.group_size // st.heads_per_program  # head blocks per kv head

    def kv_stat_map(*args):
        b, head, blk = q_index(*args)
        return (b, lax.div(head, jnp.int32(head_blocks)), 0, blk)

    return pl.BlockSpec((None, None, 1, st.block_q), kv_stat_map)


def attended_key_norms(k, bounds, rows: int):
    """``[B, Hkv, 1, rows]`` f32: for query ``i``, the largest ``|k_j|`` of each kv head
    over the keys ``j`` that ``i`` attends (0 where none; ``rows >= S`` positions): its
    user's history, and its own key if it is a candidate. Only what ``i`` attends enters,
    so other users' rows and rows nobody attends, which may hold anything, do not.
    ``k [B, S, Hkv, D]``, ``bounds`` clipped ``[B, 4]`` or ``[B, U, 4]`` (users disjoint)."""
    users = bounds if bounds.ndim == 3 else bounds[:, None, :]
    pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    norms = jnp.sqrt(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1))  # [B, S, Hkv]
    kmax = jnp.zeros_like(norms)
    for u in range(users.shape[1]):
        hl, hu, cl, cu = (users[:, u, t][:, None] for t in range(4))
        hist = (pos >= hl) & (pos < hu)  # [B, S]
        cand = (pos >= cl) & (pos < cu)
        in_hist = jnp.max(jnp.where(hist[..., None], norms, 0.0), axis=1, keepdims=True)
        kmax = jnp.maximum(kmax, jnp.where((hist | cand)[..., None], in_hist, 0.0))
        kmax = jnp.maximum(kmax, jnp.where(cand[..., None], norms, 0.0))
    kmax = jnp.pad(kmax, ((0, 0), (0, rows - k.shape[1]), (0, 0)))
    return kmax.transpose(0, 2, 1)[:, :, None, :]


def forward_or_again(q, k, v, bounds, kmax, *, st: RankerStatic, interpret):
    """``_fwd_padded``; on the ``"row"`` softmax, where the offsets left an attended row
    unserved (a NaN in its LSE), the call again with a running max, whose results those
    rows take (``lax.cond`` on the device: the second kernel runs only then). Per row, so
    a row's result never depends on another row's data."""
    out, lse = _fwd_padded(q, k, v, bounds, kmax, st=st, interpret=interpret)
    if st.softmax != "row":
        return out, lse

    redo = jnp.isnan(lse)  # [B, Hq, 1, rows]

    def again():
        running = dataclasses.replace(st, running_max=True)
        out2, lse2 = _fwd_padded(q, k, v, bounds, None, st=running, interpret=interpret)
        if st.flat:  # [B, rows, Hq * D]
            redo_rows = jnp.repeat(redo[:, :, 0, :].transpose(0, 2, 1), st.head_dim, axis=2)
        else:  # [B, Hq, rows, D]
            redo_rows = redo[:, :, 0, :, None]
        return jnp.where(redo_rows, out2, out), jnp.where(redo, lse2, lse)

    return lax.cond(redo.any(), again, lambda: (out, lse))


def prepare(q, k, v, bounds, *, sm_scale, cap, config):
    """Validate and return ``(problem, static, clipped bounds)``."""
    problem = check_ranker_inputs(
        q, k, v, sm_scale=sm_scale, cap=cap, dtypes=SUPPORTED_DTYPES, head_dims=SUPPORTED_HEAD_DIMS
    )
    if config is None:
        config = ranker_tuning.config_for(
            seq_len=problem.seq_len, head_dim=problem.head_dim, dtype=q.dtype, cap=cap
        )
    validate_config(config)
    # Every [B, U, 4] (U = 1 too) takes the packed step tables on TPU.
    clipped, packed_users = normalize_ranker_bounds(
        bounds, batch=problem.batch, seq_len=problem.seq_len, min_users=1
    )
    st = make_static(problem, config, packed_users=packed_users, heads_major=heads_major(q))
    return problem, st, clipped


def heads_major(q) -> bool:
    """Whether the default device lays ``q [B, S, H, D]`` out heads-major (dims ``(0, 2, 1,
    3)`` major to minor; a v5e does at ``H`` 5, 12 and 20, not at 2, 4, 16 or 24): the
    kernels then take the ``[B, H, S, D]`` layout, which that array reaches by a free
    bitcast, where the ``[B, S, H*D]`` view needs XLA's relayout copies of q, the outputs
    and the gradients (at phoenix on a v5e, 4.8 ms of a 19.8 ms forward)."""
    return default_major_to_minor(q.shape, q.dtype) == (0, 2, 1, 3)


def kernel_forward(q, k, v, bounds, *, sm_scale, cap, config, interpret, return_lse=True):
    """The forward kernel on inputs ``ranker_call`` checked (the ``kernel_vjp`` forward):
    ``(out, lse)``, or ``out`` alone without ``return_lse``."""
    problem, st, clipped = prepare(q, k, v, bounds, sm_scale=sm_scale, cap=cap, config=config)
    out, lse = forward_or_again(
        to_kernel_layout(q, st, q_rows(st, problem.seq_len)),
        to_kernel_layout(k, st),
        to_kernel_layout(v, st),
        clipped,
        attended_key_norms(k, clipped, q_rows(st, problem.seq_len))
        if st.softmax == "row"
        else None,
        st=st,
        interpret=resolve_interpret(interpret),
    )
    out = from_kernel_layout(out, st, problem.q_heads, problem.seq_len)
    lse = lse[:, :, 0, : problem.seq_len]
    return (out, lse) if return_lse else out


@public_op(ranker_call)
def ranker_attention_fwd(call: RankerCall):
    """Ranker attention forward on TPU (see the module docstring for the schedule).

    The kernel takes bf16 or fp32 and D in {64, 128, 256}, any ``S``. ``config``:
    ``block_q`` and ``block_kv`` must be multiples of 128 (``num_stages`` is not used:
    the Pallas TPU pipeline double-buffers); default: the tuned table's tiling for the
    chip and shape (``attn_pallas_tpu.ranker_tuning``, written by ``attn tune`` on a TPU),
    else ``default_config(S, D)``.
    ``interpret``: ``True`` or a ``pltpu.InterpretParams`` runs the kernel on the CPU.
    Not differentiable on its own: ``attn_pallas_tpu.ranker_attention`` is the
    differentiable entry.
    """
    call.require(dtypes=SUPPORTED_DTYPES, head_dims=SUPPORTED_HEAD_DIMS, kernels="TPU ranker")
    p = call.problem
    return kernel_forward(
        call.q, call.k, call.v, call.bounds, sm_scale=p.sm_scale, cap=p.cap,
        config=call.config, interpret=call.interpret, return_lse=call.return_lse,
    )  # fmt: skip
