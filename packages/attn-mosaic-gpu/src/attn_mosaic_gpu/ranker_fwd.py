"""Ranker attention forward for Hopper (sm_90a): a warp-specialized Pallas Mosaic GPU kernel.

Op (docs/design.md#ranker-attention): ``q [B,S,Hq,D]``, ``k, v [B,S,Hkv,D]``, traced ``bounds [B,4]``;
query ``i`` attends key ``j`` iff ``attn_common.ranker_mask`` allows it; logits
``cap(q.k * sm_scale)``; ``out [B,S,Hq,D]`` in q's dtype and optionally ``lse [B,Hq,S]``
float32 (natural log). A row with no allowed key gives ``out = 0``, ``lse = -inf``.

Schedule
--------
Grid ``(Hq, q_tiles, B)``. Pallas Mosaic GPU maps the last grid axis to CUDA's x, the
fastest-launched one, so the batch rows of one (head, tile) launch next to each other
(batch fastest; permuting the grid measured no faster, docs/ranker_gpu.md). One program
owns ``2 * block_q`` query rows of one (batch row, query head) and runs three warpgroups
(``num_threads=3``):

* WG0, WG1 (compute, ``setmaxnreg 232``, or ``config.compute_registers`` up to 240):
  each owns ``block_q`` rows. It TMA-loads its Q tile into its half of the Q/O shared
  buffer (one barrier per WG), then walks the KV steps: ``S = Q K^T`` by wgmma from
  shared memory, ``sm_scale``, the soft cap (``attn_common.cap_forward``), the ranker
  mask (``attn_common.ranker_mask`` on the tile iotas, only on steps whose block is not
  fully allowed for all of the WG's rows), an online softmax in base 2, and ``O += P V``
  by wgmma with P from registers. At the end it normalises, writes O into the same
  shared buffer (Q is dead by then) and LSE into a small f32 buffer, and TMA-stores both
  to global memory.
* WG2 (memory, ``setmaxnreg 40``: what the compute WGs leave of the pool): TMA-loads the
  K and V blocks of every step into a ring of ``num_stages`` slots. The first
  ``num_stages`` steps are issued at once; step ``s + num_stages`` waits on the slot's
  ``k_free`` / ``v_free`` barriers before reusing it.

The KV steps are ``attn_common.bounds.ranker_kv_block_ranges`` of the program's ``2 * block_q``
rows: the history blocks merged with the blocks holding the tile's candidates' own keys,
so a block shared by both runs is visited once. Both compute WGs walk the same steps (the
mask handles the rows), which keeps every barrier's arrival count static. Bounds are read
per batch row from the int32 ``[B, 4]`` array in global memory; nothing about them is
static, so one compiled kernel serves every batch.

Barriers (``ranker_config.ForwardBarriers``, all in shared memory; buffers
``ForwardBuffers``):

* ``k_landed[slot]``, ``v_landed[slot]``: TMA completion (transaction-count barriers)
  for K and V of a slot; both compute WGs wait on them. V is waited separately, after the
  softmax, so the QK^T of a step can start as soon as K has landed.
* ``q_landed[wg]``: the WG's Q tile has landed.
* ``k_free[slot]``, ``v_free[slot]`` (2 arrivals: one per compute WG): the slot's K
  (after QK^T) or V (after PV) is no longer read; the memory WG waits on them before
  refilling the slot.
* ``mma_turn`` (2 arrivals): the FA3 ping-pong. WG1 starts one phase late, so while one
  WG runs its softmax on the CUDA cores the other owns the tensor cores for its wgmmas.
  Every WG arrives twice per step (once in QK^T, once after the softmax), plus once before
  or after the loop, so the two stay balanced whatever the step count. The softmax-done
  arrive depends on no value of the softmax, and ptxas issues it before the step's
  exponentials, so the two WGs' softmaxes overlap in part; measured on an H200, that is
  as fast as any placement tried, and pinning it after the softmax (a strict ping-pong)
  is 10-17 % slower (docs/ranker_gpu.md, "The forward").

A WG whose rows are all padding (no history or candidate row) does not compute: it walks
the same steps doing only its barrier arrivals (so the other WG and the memory WG never
stall) and writes zeros / ``-inf``. A program with zero steps writes zeros and ``-inf``
for both WGs, so every element of ``out`` and ``lse`` is written.

Persistent programs (``config.programs = N > 0``; one user per row): grid ``(N,)``,
program ``p`` walks the tiles ``p, p + N, ...`` of the (head, tile, batch) tiles, head
fastest (``_persistent.tile_coords``), so GQA siblings run together; each
exactly as the one-tile program computes it (out and LSE bitwise the same). Q/O and LSE
are double-buffered: a compute WG issues tile ``j + 1``'s Q load when it starts tile
``j``, once tile ``j - 1``'s output stores have read that buffer, and tile ``j``'s
stores are waited for only then. The K/V ring runs on across tiles (step ``i`` of a tile
whose program walked ``base`` steps before it uses slot ``(base + i) % num_stages``), so
the memory WG loads the next tile's first blocks while the current tile's last ones are
consumed. A WG idle on a tile also waits for each step's K and V there, so that its
barrier phases stay in step for the tiles where it computes. What this saves is the
fixed cost of a program (its Q load, first K/V loads and output store), which a short
tile cannot hide: 25 % on small-d64, 5-6 % on phoenix (docs/ranker_gpu.md).

Softmax: ``m`` is tracked in base-2 units (``m = max(s) * log2(e)``) and starts at a
large finite negative number instead of ``-inf``, so a row that has seen no allowed key
yet gives ``exp2(-inf - m) = 0`` and ``exp2(m - m) = 1`` rather than
``exp2(-inf - -inf) = NaN``. At the end ``l == 0`` marks an empty row: ``out = 0`` (the
divide is guarded) and ``lse = -inf``; otherwise ``lse = (m + log2(l)) * ln(2)``.
The softmax is bound by instruction issue as much as by the MUFU (docs/ranker_gpu.md),
so it spends few FMA-pipe instructions per score: the cap's constants are folded
(``attn_common.cap.cap_scaled_with_derivative``), the row max runs on the raw scores (every
cap is increasing, so ``max(cap(x)) = cap(max(x))``) and each exponent is one FMA after
the cap's last multiply. ``config.exp2_fma_cols`` / ``rcp_fma_cols`` key columns of each
tile compute ``exp2`` / soft_sign's reciprocal on the FMA pipe instead
(``attn_mosaic_gpu.fastmath``); the tuned tables choose them per problem.

Interpret mode (``interpret=True`` / ``plgpu.InterpretGPUParams``, CPU; resolved once to
an ``_interpret.Target``): jax 0.11.2's Mosaic GPU interpreter implements neither
``run_state`` nor a wgmma whose A operand is in registers, so the PV product is computed
from a copy of P in shared memory into a fresh accumulator that is then added
(``Target.accumulate_registers``). Everything else
(TMA, barriers and their phases, the ring, QK^T, mask, softmax, stores) is the GPU code.

Any ``S`` is supported: q, k, v are zero-padded to a multiple of ``2 * block_q`` and of
``block_kv``, and the outputs sliced. Padding keys are never allowed because bounds are
clipped to ``[0, S]`` (``attn_common.normalize_bounds``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common import CapParams, KernelConfig, check_ranker_inputs, ranker_mask
from attn_common.bounds import overlap_len, ranker_full_kv_steps, ranker_kv_block_ranges
from attn_common.cap import cap_scaled_with_derivative
from attn_common.packed import (
    PACKED_QUERY_FIELDS,
    TileSteps,
    normalize_ranker_bounds,
    packed_query_table,
    packed_step_list,
    ranker_mask_from_query_table,
)
from attn_common.ranker import RankerKernelStatic
from attn_mosaic_gpu import _axes
from attn_mosaic_gpu._interpret import Target, resolve_target
from attn_mosaic_gpu._persistent import program_tiles, ring_walk, tile_coords
from attn_mosaic_gpu._registers import (
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    memory_registers,
)
from attn_mosaic_gpu._smem import round_up
from attn_mosaic_gpu.fastmath import (
    LN2,
    LOG2E,
    M_INIT,
    exp2_fma,
    fast_reciprocal,
    reciprocal_fma,
    split_columns,
)
from attn_mosaic_gpu.ranker_config import (
    MIN_PACKED_USERS,
    SMEM_LIMIT_BYTES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    ForwardBarriers,
    ForwardBuffers,
    default_config,
    forward_scratch,
    smem_bytes,
    validate_config,
)

__all__ = [
    "SMEM_LIMIT_BYTES",
    "default_config",
    "ranker_attention_fwd",
    "smem_bytes",
    "validate_config",
]

# setmaxnreg of the compute WGs: config.compute_registers, else COMPUTE_REGISTERS (the
# memory WG keeps 40). 240 (memory WG 24) runs ragged's forward 2.4 % faster and long's
# no faster on an H200 (docs/ranker_gpu.md), so it is a tuned knob.


@dataclasses.dataclass(frozen=True)
class _Static(RankerKernelStatic):
    """Static facts the kernel is specialised on (hashable: a jit static argument): the
    padded problem plus the tiling and schedule."""

    block_q: int
    block_kv: int
    num_stages: int
    return_lse: bool
    exp2_fma_cols: int = 0
    rcp_fma_cols: int = 0
    # 0: one user per row (bounds [B, 4]); U >= 2: packed rows (bounds [B, U, 4]).
    packed_users: int = 0
    # 0: one program per tile; N: N persistent programs walking the tiles.
    programs: int = 0
    # setmaxnreg of each compute WG; the memory WG keeps the rest of the pool.
    compute_registers: int = COMPUTE_REGISTERS


def packed_tile_mask(mask_from_table, row_entries, offset, shape):
    """A packed tile's mask from its rows' table entries (``attn_common.packed``).

    ``row_entries``: per-row vectors in the wgmma row layout (a few values per thread),
    e.g. a query row's ``packed_query_table`` entries; ``offset``: the first position of
    the tile's columns. The entries are shifted by ``offset`` before they are broadcast,
    so each score compares against the bare column iota.
    """
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    shifted = [lax.broadcast_in_dim(x - offset, shape, [0]) for x in row_entries]
    return mask_from_table(cols, *shifted)


def ranker_tile_mask(row0, col0, shape, hl, hu, cl, cu):
    """The one-user ranker mask of a wgmma tile whose rows are queries ``row0 + i`` and
    whose columns are keys ``col0 + j`` (the forward and dq kernels)."""
    q_ids = row0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    kv_ids = col0 + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    return ranker_mask(q_ids, kv_ids, hl, hu, cl, cu)


def _scale_and_cap(st: _Static, qk, target: Target):
    """Base-2 logits ``s2 = cap(qk * sm_scale) * log2(e)`` of a raw ``Q K^T`` tile or of
    per-row maxima: the constants folded into the multiplies the cap needs anyway (no cap:
    one multiply), ending in a multiply so that ``s2 - m`` is one FMA. Soft_sign's
    reciprocal runs on the MUFU except for ``st.rcp_fma_cols`` key columns."""
    on_mufu = target.reciprocal_tile()

    def reciprocal(d):
        if d.ndim != 2:  # the per-row maxima: too few to split
            return fast_reciprocal(d)
        return split_columns(d, st.rcp_fma_cols, reciprocal_fma, on_mufu)

    # The derivative the helper also returns is dead code here.
    s2, _ = cap_scaled_with_derivative(
        qk, st.cap, st.sm_scale, out_scale=LOG2E, reciprocal=reciprocal
    )
    return s2


def _softmax_exp2(st: _Static, x, target: Target):
    """``exp2`` of a tile: the first ``st.exp2_fma_cols`` key columns on the FMA pipe, the
    rest on the MUFU. Interpret mode runs on XLA, which would fold exp2_fma's rounding
    step away, hence the guard."""
    on_fma = functools.partial(exp2_fma, xla_fold_guard=target.interpret)
    return split_columns(x, st.exp2_fma_cols, on_fma, jnp.exp2)


def _online_softmax_step(st: _Static, qk, allowed, m_i, target: Target):
    """One step of the online softmax on the raw ``Q K^T`` tile: ``P`` (f32), the
    rescale ``alpha`` of the running sums and the new running max (base 2).
    ``allowed`` is ``None`` on steps whose block needs no mask."""
    masked = allowed is not None
    # Every cap is increasing, so a row's largest base-2 logit is the logit of its
    # largest raw score: the max runs on the raw tile (beside the cap's reciprocals, not
    # after them), and each exponent s2 - m is one FMA after the cap's last multiply.
    raw = jnp.where(allowed, qk, -jnp.inf) if masked else qk
    raw_max = raw.max(axis=1)
    step_max = jnp.where(raw_max > -jnp.inf, _scale_and_cap(st, raw_max, target), M_INIT)
    m_new = jnp.maximum(m_i, step_max)
    x = _scale_and_cap(st, qk, target) - lax.broadcast_in_dim(m_new, qk.shape, [0])
    if masked:
        x = jnp.where(allowed, x, -jnp.inf)
    alpha = jnp.exp2(m_i - m_new)
    return _softmax_exp2(st, x, target), alpha, m_new


def _tile_info(st: _Static, bounds_ref, steps_ref, batch, q_tile):
    """A tile's first row, its KV steps and its bounds: ``users`` (packed rows) or
    ``(hl, hu, cl, cu)``."""
    if st.packed_users:
        # Packed rows: the tile's runs and each WG's unmasked steps come from the
        # step list built outside (attn_common.packed.packed_step_list).
        users = tuple(
            tuple(bounds_ref[batch, u, t] for t in range(4)) for u in range(st.packed_users)
        )
        tile_start = q_tile * (2 * st.block_q)
        ranges = TileSteps(lambda i: steps_ref[batch, q_tile, i], COMPUTE_WGS)
        return tile_start, ranges, users
    hl = bounds_ref[batch, 0]
    hu = bounds_ref[batch, 1]
    cl = bounds_ref[batch, 2]
    cu = bounds_ref[batch, 3]
    tile_start = q_tile * (2 * st.block_q)
    ranges = ranker_kv_block_ranges(
        hl, hu, cl, cu, tile_start, tile_start + 2 * st.block_q, st.block_kv
    )
    return tile_start, ranges, (hl, hu, cl, cu)


def _wg_rows(st: _Static, wg, tile_start, bnds):
    """Compute WG ``wg``'s rows ``[row0, row1)`` of the tile and whether one is live."""
    row0 = tile_start + wg * st.block_q
    row1 = row0 + st.block_q
    if st.packed_users:
        rows_seen = sum(
            overlap_len(row0, row1, u_hl, u_hu) + overlap_len(row0, row1, u_cl, u_cu)
            for u_hl, u_hu, u_cl, u_cu in bnds
        )
        return row0, row1, rows_seen > 0
    hl, hu, cl, cu = bnds
    return row0, row1, (overlap_len(row0, row1, hl, hu) + overlap_len(row0, row1, cl, cu)) > 0


def _compute_tile(
    st: _Static, dtype, wg, q_head, batch, tile_start, ranges, total_steps, bnds, qo_smem,
    lse_smem, buf: ForwardBuffers, bar: ForwardBarriers, out_refs, *, load_q, slot_of,
    idle_waits, target: Target,
):  # fmt: skip
    """One compute WG's part of a tile: its Q (``load_q(row0)``, called when it has a
    live row), the KV steps (step ``i`` in ring slot ``slot_of(i)``), the softmax and
    the output written to its Q/O tile ``qo_smem`` (and ``lse_smem``) and TMA-stored,
    not waited for.
    ``idle_waits``: a WG with no live row also waits for every step's K and V, so
    that its barrier phases stay in step across the tiles of a persistent program.
    ``P V`` takes P from registers (interpreted, staged through ``buf.p``:
    ``Target.accumulate_registers``)."""
    block_q, block_kv, head_dim = st.block_q, st.block_kv, st.head_dim
    k_smem, v_smem, p_smem2, keys_smem2 = buf.k, buf.v, buf.p, buf.keys
    out_ref, lse_ref = out_refs

    def turn_sync():
        plgpu.barrier_arrive(bar.mma_turn)
        plgpu.barrier_wait(bar.mma_turn)

    row0, row1, active = _wg_rows(st, wg, tile_start, bnds)
    if st.packed_users:
        unmasked_lo, unmasked_hi = ranges.full_steps(wg)
    else:
        hl, hu, cl, cu = bnds
        # Steps whose block every row of this WG attends in full need no mask.
        unmasked_lo, unmasked_hi = ranker_full_kv_steps(
            ranges, hl, hu, cl, cu, row0, row1, block_kv
        )
    wg_steps = jnp.where(active, total_steps, 0)
    pl.when(active)(lambda: load_q(row0))

    if st.packed_users:
        # The rows' packed_query_table entries (key_lo, key_hi, self_key), one
        # value per row: the mask is then three compares per score for any U.
        # An inactive WG never reads them (it has no masked step).
        row_keys = tuple(
            plgpu.load(keys_smem2.at[wg, f], layout=plgpu.Layout.WGMMA.reduce(1))
            for f in range(PACKED_QUERY_FIELDS)
        )

    m_i = plgpu.layout_cast(jnp.full((block_q,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(wg_steps > 0)
    def _wait_first_k():
        plgpu.barrier_wait(bar.k_landed.at[slot_of(0)])

    pl.when(wg == 1)(turn_sync)

    def kv_step(step, carry, *, masked: bool):
        acc, m_i, l_i = carry
        slot = slot_of(step)

        def compute_qk(acc_ref):
            plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
            turn_sync()
            return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
        plgpu.barrier_arrive(bar.k_free.at[slot])

        if masked:
            kv0 = ranges.block_at(step) * block_kv
            if st.packed_users:
                allowed = packed_tile_mask(
                    ranker_mask_from_query_table, row_keys, kv0, (block_q, block_kv)
                )
            else:
                allowed = ranker_tile_mask(row0, kv0, (block_q, block_kv), hl, hu, cl, cu)
        else:
            allowed = None

        p, alpha, m_new = _online_softmax_step(st, qk, allowed, m_i, target)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha
        p16 = p.astype(dtype)

        def end_softmax():
            plgpu.barrier_arrive(bar.mma_turn)  # softmax done
            plgpu.barrier_wait(bar.v_landed.at[slot])
            plgpu.barrier_wait(bar.mma_turn)  # tensor cores are ours

        if head_dim <= 128:
            l_i = l_i + p.sum(axis=1)
            acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
            end_softmax()
        else:
            end_softmax()
            l_i = l_i + p.sum(axis=1)

        def wait_next_k():
            nxt = step + 1

            @pl.when(nxt < wg_steps)
            def _wait_next_k():
                plgpu.barrier_wait(bar.k_landed.at[slot_of(nxt)])

        (acc,) = target.accumulate_registers(
            (acc,), lambda: (p_smem2.at[wg],), [(lambda: p16, v_smem.at[slot])], after=wait_next_k
        )
        plgpu.barrier_arrive(bar.v_free.at[slot])
        return acc, m_new, l_i

    masked_step = functools.partial(kv_step, masked=True)
    full_step = functools.partial(kv_step, masked=False)
    carry = (acc, m_i, l_i)
    carry = lax.fori_loop(0, unmasked_lo, masked_step, carry)
    carry = lax.fori_loop(unmasked_lo, unmasked_hi, full_step, carry)
    carry = lax.fori_loop(unmasked_hi, wg_steps, masked_step, carry)
    acc, m_i, l_i = carry

    def idle_step(step, _):
        # All-padding WG: keep the barrier protocol of a computing WG.
        slot = slot_of(step)
        if idle_waits:
            plgpu.barrier_wait(bar.k_landed.at[slot])
        turn_sync()
        plgpu.barrier_arrive(bar.k_free.at[slot])
        if idle_waits:
            plgpu.barrier_wait(bar.v_landed.at[slot])
        turn_sync()
        plgpu.barrier_arrive(bar.v_free.at[slot])

    lax.fori_loop(wg_steps, total_steps, idle_step, None)
    pl.when(wg == 0)(turn_sync)

    _store_output(
        st, dtype, acc, m_i, l_i, qo_smem, lse_smem, out_ref, lse_ref,
        batch=batch, q_head=q_head, row0=row0,
    )  # fmt: skip


def _store_output(
    st: _Static, dtype, acc, m_i, l_i, qo_smem, lse_smem, out_ref, lse_ref, *, batch, q_head,
    row0,
):  # fmt: skip
    """A compute WG's epilogue: ``O = acc / l`` into its Q/O tile (Q is dead by then) and
    the LSE (natural log) into its staging buffer, both TMA-stored and not waited for. A
    row with no allowed key (``l == 0``) gets ``O = 0`` and ``LSE = -inf``."""
    block_q = st.block_q
    has_key = l_i > 0.0
    inv_l = 1.0 / jnp.where(has_key, l_i, 1.0)
    out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    qo_smem[...] = out.astype(dtype)
    if lse_smem is not None:
        lse = jnp.where(has_key, (m_i + jnp.log2(jnp.where(has_key, l_i, 1.0))) * LN2, -jnp.inf)
        lse_smem[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(row0, block_q), q_head])
    if lse_smem is not None:
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(row0, block_q)])


class _Refs(NamedTuple):
    """The kernel's operands in global memory, by role."""

    # inputs
    q: Any  # [B, S_pad, Hq, D]
    k: Any  # [B, S_pad, Hkv, D]
    v: Any  # [B, S_pad, Hkv, D]
    bounds: Any  # [B, 4] int32, or packed [B, U, 4]
    steps: Any  # packed rows: [B, tiles, words] int32, the step list; else None
    keys: Any  # packed rows: [B, PACKED_QUERY_FIELDS, S_pad] int32, the query table; else None
    # outputs
    out: Any  # [B, S_pad, Hq, D]
    lse: Any  # [B, Hq, S_pad] f32, or None


def _ring_slot(num_slots: int, step):
    """The K/V ring slot of step ``step`` of a one-tile program."""
    return step % num_slots if isinstance(step, int) else lax.rem(step, jnp.int32(num_slots))


def _tile_compute_wg(
    st: _Static, dtype, refs: _Refs, buf: ForwardBuffers, bar: ForwardBarriers, tile,
    target: Target,
):  # fmt: skip
    """A compute WG of the one-tile kernel: its Q (and packed rows' key entries), then
    ``_compute_tile``; the output store is waited for before the program ends."""
    batch, q_head, wg, tile_start, ranges, total_steps, bnds = tile
    block_q = st.block_q
    plgpu.set_max_registers(st.compute_registers, action="increase")
    qo_smem = buf.qo.at[wg]

    def load_q(row0):
        plgpu.copy_gmem_to_smem(
            refs.q.at[batch, pl.ds(row0, block_q), q_head], qo_smem, bar.q_landed.at[wg]
        )
        if st.packed_users:
            plgpu.copy_gmem_to_smem(
                refs.keys.at[batch, :, pl.ds(row0, block_q)],
                buf.keys.at[wg],
                bar.keys_landed.at[wg],
            )
            plgpu.barrier_wait(bar.keys_landed.at[wg])
        plgpu.barrier_wait(bar.q_landed.at[wg])

    lse_smem = None if buf.lse is None else buf.lse.at[wg]
    _compute_tile(
        st, dtype, wg, q_head, batch, tile_start, ranges, total_steps, bnds, qo_smem,
        lse_smem, buf, bar, (refs.out, refs.lse),
        load_q=load_q, slot_of=functools.partial(_ring_slot, st.num_stages),
        idle_waits=False, target=target,
    )  # fmt: skip
    plgpu.wait_smem_to_gmem(0)


def _drain_ring(bar: ForwardBarriers, num_slots: int, total_steps):
    """The memory WG's last waits: observe the consumption of the last ``num_slots`` of
    ``total_steps`` ring steps, so that every completed phase of the ``*_free`` barriers is
    waited on before they are freed (interpret mode checks this; on the GPU it costs an
    idle warpgroup a few waits)."""

    @pl.loop(jnp.maximum(total_steps - num_slots, 0), total_steps)
    def _drain(step):
        slot = lax.rem(step, jnp.int32(num_slots))
        plgpu.barrier_wait(bar.k_free.at[slot])
        plgpu.barrier_wait(bar.v_free.at[slot])


def _tile_memory_wg(
    st: _Static, refs: _Refs, buf: ForwardBuffers, bar: ForwardBarriers, batch, kv_head,
    ranges, total_steps,
):  # fmt: skip
    """The memory WG of the one-tile kernel: fill the K/V ring (prologue), refill a slot
    once both compute WGs consumed it (steady), then observe the last consumptions
    (drain)."""
    k_smem, v_smem = buf.k, buf.v
    block_kv, num_slots = st.block_kv, st.num_stages
    plgpu.set_max_registers(memory_registers(st.compute_registers), action="decrease")

    def kv_rows(step):
        return (batch, pl.ds(ranges.block_at(step) * block_kv, block_kv), kv_head)

    for i in range(num_slots):

        @pl.when(i < total_steps)
        def _prologue(i=i):
            rows = kv_rows(jnp.int32(i))
            plgpu.copy_gmem_to_smem(refs.k.at[rows], k_smem.at[i], bar.k_landed.at[i])
            plgpu.copy_gmem_to_smem(refs.v.at[rows], v_smem.at[i], bar.v_landed.at[i])

    @pl.loop(num_slots, jnp.maximum(total_steps, num_slots))
    def _steady(step):
        slot = lax.rem(step, jnp.int32(num_slots))
        rows = kv_rows(step)
        plgpu.barrier_wait(bar.k_free.at[slot])
        plgpu.copy_gmem_to_smem(refs.k.at[rows], k_smem.at[slot], bar.k_landed.at[slot])
        plgpu.barrier_wait(bar.v_free.at[slot])
        plgpu.copy_gmem_to_smem(refs.v.at[rows], v_smem.at[slot], bar.v_landed.at[slot])

    _drain_ring(bar, num_slots, total_steps)


def _tile_kernel(st: _Static, dtype, refs: _Refs, buf, bar, target: Target):
    """One program per (head, tile, batch) grid cell: two compute WGs and one memory WG."""
    batch = lax.axis_index(_axes.BATCH)
    q_head = lax.axis_index(_axes.HEADS)
    q_tile = lax.axis_index(_axes.Q_TILES)
    wg = lax.axis_index(_axes.WARPGROUP)
    kv_head = lax.div(q_head, jnp.int32(st.group_size))
    tile_start, ranges, bnds = _tile_info(st, refs.bounds, refs.steps, batch, q_tile)
    total_steps = ranges.total_steps
    tile = (batch, q_head, wg, tile_start, ranges, total_steps, bnds)
    pl.when(wg < COMPUTE_WGS)(lambda: _tile_compute_wg(st, dtype, refs, buf, bar, tile, target))
    pl.when(wg == COMPUTE_WGS)(
        lambda: _tile_memory_wg(st, refs, buf, bar, batch, kv_head, ranges, total_steps)
    )


def _persistent_tile_of(st: _Static, refs: _Refs, program, j):
    """Program-local tile ``j`` of a persistent program: its query head, batch row,
    first row, steps and bounds."""
    tiles = st.seq_pad // (2 * st.block_q)
    q_head, q_tile, batch = tile_coords(
        program, j, programs=st.programs, heads=st.q_heads, tiles=tiles
    )
    return (q_head, batch, *_tile_info(st, refs.bounds, None, batch, q_tile))


def _persistent_compute_wg(
    st: _Static, dtype, refs: _Refs, buf: ForwardBuffers, bar: ForwardBarriers, program,
    my_tiles, wg, target: Target,
):  # fmt: skip
    """A compute WG of a persistent program: tile ``j + 1``'s Q is issued into the other
    Q/O buffer when tile ``j`` starts (after tile ``j - 1``'s stores read it)."""
    block_q, num_slots = st.block_q, st.num_stages
    plgpu.set_max_registers(st.compute_registers, action="increase")

    def issue_q(j, copy):
        q_head, batch, tile_start, _, bnds = _persistent_tile_of(st, refs, program, j)
        row0, _, active = _wg_rows(st, wg, tile_start, bnds)

        @pl.when(active)
        def _issue():
            plgpu.copy_gmem_to_smem(
                refs.q.at[batch, pl.ds(row0, block_q), q_head],
                buf.qo.at[copy, wg],
                bar.q_landed.at[copy * COMPUTE_WGS + wg],
            )

    @pl.when(my_tiles > 0)
    def _first():
        issue_q(jnp.int32(0), 0)

    def walk(j, base):
        copy = lax.rem(j, jnp.int32(2))
        q_head, batch, tile_start, ranges, bnds = _persistent_tile_of(st, refs, program, j)

        @pl.when(j + 1 < my_tiles)
        def _prefetch():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # tile j-1's stores
            issue_q(j + 1, 1 - copy)

        lse_smem = None if buf.lse is None else buf.lse.at[copy, wg]
        total_steps = ranges.total_steps
        _compute_tile(
            st, dtype, wg, q_head, batch, tile_start, ranges, total_steps, bnds,
            buf.qo.at[copy, wg], lse_smem, buf, bar, (refs.out, refs.lse),
            load_q=lambda _: plgpu.barrier_wait(bar.q_landed.at[copy * COMPUTE_WGS + wg]),
            slot_of=lambda i: lax.rem(base + i, jnp.int32(num_slots)),
            idle_waits=True, target=target,
        )  # fmt: skip
        return base + total_steps

    lax.fori_loop(0, my_tiles, walk, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)


def _persistent_memory_wg(
    st: _Static, refs: _Refs, buf: ForwardBuffers, bar: ForwardBarriers, program, my_tiles
):
    """The memory WG of a persistent program: one K/V ring across its tiles
    (``_persistent.ring_walk``), then the drain of the last ``num_stages`` steps."""
    k_smem, v_smem = buf.k, buf.v
    block_kv, num_slots = st.block_kv, st.num_stages
    plgpu.set_max_registers(memory_registers(st.compute_registers), action="decrease")

    def tile_steps(j):
        q_head, batch, _, ranges, _ = _persistent_tile_of(st, refs, program, j)
        kv_head = lax.div(q_head, jnp.int32(st.group_size))

        def issue(i, step, slot):
            rows = (batch, pl.ds(ranges.block_at(i) * block_kv, block_kv), kv_head)

            @pl.when(step >= num_slots)
            def _k_free():
                plgpu.barrier_wait(bar.k_free.at[slot])

            plgpu.copy_gmem_to_smem(refs.k.at[rows], k_smem.at[slot], bar.k_landed.at[slot])

            @pl.when(step >= num_slots)
            def _v_free():
                plgpu.barrier_wait(bar.v_free.at[slot])

            plgpu.copy_gmem_to_smem(refs.v.at[rows], v_smem.at[slot], bar.v_landed.at[slot])

        return ranges.total_steps, issue

    total = ring_walk(my_tiles, num_slots, tile_steps)

    _drain_ring(bar, num_slots, total)


def _persistent_kernel(st: _Static, dtype, refs: _Refs, buf, bar, target: Target):
    """``st.programs`` programs, each walking the tiles ``p, p + P, ...`` of the
    (head, tile, batch) grid, head fastest (``_persistent.tile_coords``). Q/O and LSE
    are double-buffered: a compute WG issues tile ``j + 1``'s Q load when it starts
    tile ``j`` (once tile ``j - 1``'s output store has read that buffer), and tile
    ``j``'s stores are waited for only then. The K/V ring runs on across tiles: step
    ``i`` of a tile whose program walked ``base`` steps before it uses slot
    ``(base + i) % num_stages``, so the memory WG loads the next tile's first blocks
    while the current tile's last ones are consumed. A tile computes exactly as in
    the per-tile kernel (the same steps, in the same order). One user per row only
    (``validate_config``)."""
    tiles = st.seq_pad // (2 * st.block_q)
    program = lax.axis_index(_axes.PROGRAMS)
    wg = lax.axis_index(_axes.WARPGROUP)
    my_tiles = program_tiles(program, st.programs, st.q_heads * tiles * st.batch)
    pl.when(wg < COMPUTE_WGS)(
        lambda: _persistent_compute_wg(st, dtype, refs, buf, bar, program, my_tiles, wg, target)
    )
    pl.when(wg == COMPUTE_WGS)(lambda: _persistent_memory_wg(st, refs, buf, bar, program, my_tiles))


def _build_kernel(st: _Static, dtype, target: Target):
    """The kernel entry: the shared-memory buffers and barriers (``forward_scratch``),
    then the one-tile or the persistent body."""
    config = KernelConfig(
        block_q=st.block_q, block_kv=st.block_kv, num_stages=st.num_stages, programs=st.programs
    )
    buffers, barriers = forward_scratch(
        config, st.head_dim, dtype, return_lse=st.return_lse, packed=bool(st.packed_users),
        interpret=target.interpret,
    )  # fmt: skip
    body = _persistent_kernel if st.programs else _tile_kernel

    def entry(*refs):
        # Inputs q, k, v, bounds (+ the step list and the query key table for packed
        # rows), then out (+ lse): _Refs has each one's shape.
        num_in = 6 if st.packed_users else 4
        steps_keys = refs[4:6] if st.packed_users else (None, None)
        outs = (*refs[num_in:], None)[:2]
        hbm = _Refs(*refs[:4], *steps_keys, *outs)
        pl.run_scoped(
            lambda buf, bar: body(st, dtype, hbm, buf, bar, target),
            buffers,
            barriers,
            collective_axes=_axes.WARPGROUP,
        )

    return entry


@functools.partial(jax.jit, static_argnames=("st", "target"))
def _ranker_fwd_padded(q, k, v, bounds, *, st: _Static, target: Target):
    """q/k/v already padded to ``st.seq_pad``; bounds clipped int32 ``[B, 4]``, or packed
    ``[B, U, 4]`` (``st.packed_users = U``), whose step list and query key table are built
    here."""
    inputs = [q, k, v, bounds]
    if st.packed_users:
        inputs.append(
            packed_step_list(
                bounds,
                tile=2 * st.block_q,
                num_tiles=st.seq_pad // (2 * st.block_q),
                block=st.block_kv,
                sub_tiles=COMPUTE_WGS,
            )
        )
        inputs.append(packed_query_table(bounds, st.seq_pad))
    out_type = [jax.ShapeDtypeStruct((st.batch, st.seq_pad, st.q_heads, st.head_dim), q.dtype)]
    if st.return_lse:
        out_type.append(jax.ShapeDtypeStruct((st.batch, st.q_heads, st.seq_pad), jnp.float32))
    grid = dict(
        grid=(st.q_heads, st.seq_pad // (2 * st.block_q), st.batch),
        grid_names=(_axes.HEADS, _axes.Q_TILES, _axes.BATCH),
    )
    if st.programs:
        grid = dict(grid=(st.programs,), grid_names=(_axes.PROGRAMS,))
    results = plgpu.kernel(
        _build_kernel(st, q.dtype, target),
        out_type=out_type,
        **grid,
        num_threads=COMPUTE_WGS + 1,
        thread_name=_axes.WARPGROUP,
        # The row max and sum reduce within a warp (shuffles), so the forward needs none of
        # the shared-memory scratch Pallas reserves for cross-warp reductions; a reduction
        # that did would fail to lower, not run wrong.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=target.params,
    )(*inputs)
    return tuple(results)


def ranker_attention_fwd(
    q,
    k,
    v,
    bounds,
    *,
    sm_scale: float | None = None,
    cap: CapParams | None = None,
    config: KernelConfig | None = None,
    return_lse: bool = False,
    interpret=False,
):
    """Ranker attention forward on Hopper (see the module docstring for the schedule).

    Args:
      q: ``[B, S, Hq, D]`` bf16 or fp16; k, v: ``[B, S, Hkv, D]`` same dtype,
        ``Hq % Hkv == 0``; D in {64, 128, 256}. Any ``S``.
      bounds: ``SegmentBounds`` or int array ``[B, 4]`` / ``[4]`` (history_lo, history_hi,
        candidate_lo, candidate_hi), or packed ``[B, U, 4]`` (``U`` users per row,
        ``attn_common.packed``: the runs of the tile's users' blocks and the unmasked
        steps come from a step list built outside the kernel, the mask from each
        row's ``packed_query_table`` entries); traced data, clipped to ``[0, S]``; overlapping users refused
        on host values. One compile per ``U`` serves every batch.
      sm_scale: logit scale, default ``1/sqrt(D)``; applied before the cap.
      cap: ``CapParams`` (none / tanh / soft_sign) or ``None``.
      config: ``KernelConfig`` (block_q, block_kv, num_stages); ``None`` picks
        ``default_config(D)``. Checked against the Hopper limits (``validate_config``).
      return_lse: also return ``lse [B, Hq, S]`` float32, natural log, ``-inf`` on rows
        with no allowed key.
      interpret: ``True`` or a ``plgpu.InterpretGPUParams`` to run in Mosaic GPU interpret
        mode on the CPU.

    Returns:
      ``out [B, S, Hq, D]`` in q's dtype, or ``(out, lse)``.
    """
    problem = check_ranker_inputs(
        q,
        k,
        v,
        sm_scale=sm_scale,
        cap=cap,
        dtypes=SUPPORTED_DTYPES,
        head_dims=SUPPORTED_HEAD_DIMS,
    )
    if config is None:
        config = default_config(problem.head_dim, q.dtype)
    clipped, users = normalize_ranker_bounds(
        bounds, batch=problem.batch, seq_len=problem.seq_len, min_users=MIN_PACKED_USERS
    )
    validate_config(
        config,
        problem.head_dim,
        q.dtype,
        return_lse=bool(return_lse),
        cap=problem.cap,
        packed=bool(users),
    )
    target = resolve_target(interpret)

    seq = problem.seq_len
    tile = math.lcm(2 * config.block_q, config.block_kv)
    seq_pad = round_up(seq, tile)
    if seq_pad != seq:
        pad = ((0, 0), (0, seq_pad - seq), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    st = _Static(
        **problem.padded(seq_pad),
        block_q=config.block_q,
        block_kv=config.block_kv,
        num_stages=config.num_stages,
        return_lse=bool(return_lse),
        exp2_fma_cols=config.exp2_fma_cols,
        rcp_fma_cols=config.rcp_fma_cols,
        packed_users=users,
        programs=config.programs,
        compute_registers=config.compute_registers or COMPUTE_REGISTERS,
    )
    results = _ranker_fwd_padded(q, k, v, clipped.astype(jnp.int32), st=st, target=target)
    out = results[0][:, :seq] if seq_pad != seq else results[0]
    if not return_lse:
        return out
    lse = results[1][:, :, :seq] if seq_pad != seq else results[1]
    return out, lse
