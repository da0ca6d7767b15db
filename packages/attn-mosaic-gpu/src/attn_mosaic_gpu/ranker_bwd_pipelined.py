"""Ranker attention backward for Hopper, D in {64, 128}: two warp-specialized kernels.

Math as in ``ranker_bwd`` (``p = exp2(y * log2e - lse2)``, ``ds = p * (dp - delta') *
cap'(y)``, ``dq = sm_scale * sum_j ds_ij k_j``, ``dk_j = sm_scale * sum ds_ij q_i``,
``dv_j = sum p_ij dO_i``; ``lse2`` is the base-2 LSE, ``+inf`` on rows with no allowed key).

Both kernels have the forward's shape: one program owns a tile of ``2 * 64`` rows (dq:
query rows; dk/dv: key rows) and runs three warpgroups (``num_threads=3``):

* WG0, WG1 (compute, ``setmaxnreg 232``; dk/dv at D=128 240, the memory WG then 24):
  each owns 64 rows of the tile. It TMA-loads its fixed operands once into its own
  shared buffers (dq: Q, dO, lse2, delta'; dk/dv: K, V), then walks the steps, reading
  the streamed operands from a ring slot:

  - dq: ``S = Q K^T`` and ``dP = dO V^T`` (one wgmma scope, both from shared memory),
    cap, mask, ``P``, ``dS``, then ``dQ += dS K`` with ``dS`` as the register A operand.
  - dk/dv: ``S^T = K Q^T`` and ``dP^T = V dO^T``, cap, mask, ``P^T``, ``dS^T``, then
    ``dV += P^T dO`` and ``dK += dS^T Q`` in one wgmma scope, A operands from registers.

  Within a step: the mask predicate is built while S is in flight, ``P`` is computed
  after ``wgmma.wait_group 1`` (S landed, dP still running), and in dk/dv ``dS^T`` is
  formed while dV's wgmma runs. The cap and its derivative come from
  ``attn_common.cap.cap_scaled_with_derivative`` (constants folded, the derivative from the
  same terms). The ring has 2 slots for D=128 and 4 for D=64 (``pipelined_stages``);
  the overlap and the fold are measured in ``docs/results/ranker_bwd_sweep.md``.

  Knob ``dq_programs`` (0, one program per tile, unless the tuned table says otherwise):
  dq runs as that many persistent programs (one per SM), each walking the tiles
  ``p, p + P, ...``; a compute
  WG issues the next tile's fixed-operand loads into a second buffer before walking the
  current tile's steps, and the K/V ring runs on across tiles
  (``_build_dq_persistent_kernel``). It targets the ~7 us that each per-tile program
  spends besides its steps (docs/experiments.md); on the H200 it
  took phoenix's dq from 2.39 to 2.17 ms and small-d64's from 0.37 to 0.29 ms, while
  long and ragged moved within noise.

  After the last step it writes its f32 accumulators (scaled) into its fixed buffers
  (Q / K, V are dead by then) and TMA-stores them. The mask
  (``attn_common.ranker_mask`` on the tile iotas) is skipped on the steps
  ``attn_common.bounds.ranker_full_kv_steps`` / ``ranker_full_q_steps`` prove fully allowed
  for the WG's rows (most history steps).
* WG2 (memory, ``setmaxnreg 40``): TMA-loads the streamed operands of every step into a
  ring of ``num_stages`` slots (dq: K and V blocks of the tile's
  ``ranker_kv_block_ranges``; dk/dv: Q, dO, lse2 and delta' blocks of the tile's
  ``ranker_q_block_ranges`` for each query head of the kv head's GQA group in turn).
  Step ``t + num_stages`` waits on slot ``t % num_stages``'s ``*_free`` barrier.

Both compute WGs walk every step of the tile (a WG whose rows see nothing gets ``p = 0``
and writes zeros), which keeps every barrier's arrival count static. Barriers
(``ranker_config.DqBarriers`` / ``DkvBarriers``; buffers ``DqBuffers`` /
``DkvBuffers``): ``<operand>_landed[slot]`` (TMA transaction barriers, one per streamed
operand so each wait covers one copy), ``<operand>_landed[wg]`` for the fixed operands
(one per operand and WG) and ``kv_free[slot]`` / ``step_free[slot]`` (2 arrivals, one
per compute WG, after the step's last wgmma has completed).

dK/dV of a kv head are summed over its query heads in a fixed order inside one program:
no atomics, no per-head copies, bitwise deterministic. Every program writes its whole
output tile, so rows and keys with no allowed pair get exactly 0.

Interpret mode (CPU; an ``_interpret.Target`` in ``_Static``): jax 0.11.2's Mosaic GPU
interpreter has no ``run_state`` and no register-A wgmma, so ``P``/``dS`` are staged
through per-WG shared buffers and the products go into fresh accumulators that are then
added (``Target.accumulate_registers``). Everything else is the GPU code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common import ranker_mask
from attn_common.bounds import (
    ranker_full_kv_steps,
    ranker_full_q_steps,
    ranker_kv_block_ranges,
    ranker_q_block_ranges,
)
from attn_common.cap import cap_scaled_with_derivative
from attn_common.packed import (
    PACKED_KEY_FIELDS,
    PACKED_QUERY_FIELDS,
    TileSteps,
    packed_key_table,
    packed_query_table,
    packed_step_list,
    ranker_mask_from_key_table,
    ranker_mask_from_query_table,
)
from attn_common.ranker import RankerKernelStatic
from attn_mosaic_gpu import _axes
from attn_mosaic_gpu._interpret import COMPILED, Target, resolve_target
from attn_mosaic_gpu._persistent import program_tiles, ring_walk, tile_coords
from attn_mosaic_gpu._registers import (
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    MAX_COMPUTE_REGISTERS,
    memory_registers,
)
from attn_mosaic_gpu.fastmath import (
    LOG2E,
    exp2_fma,
    reciprocal_fma,
    split_columns,
)
from attn_mosaic_gpu.ranker_config import (
    BLOCK,
    PIPELINED_HEAD_DIMS,
    SMEM_LIMIT_BYTES,
    BwdRefs,
    DkvBarriers,
    DkvBuffers,
    DqBarriers,
    DqBuffers,
    check_backward_knobs,
    dkv_scratch,
    dq_scratch,
    pipelined_smem_bytes,
    pipelined_stages,
)
from attn_mosaic_gpu.ranker_fwd import packed_tile_mask, ranker_tile_mask

__all__ = [
    "PIPELINED_HEAD_DIMS",
    "check_backward_knobs",
    "pipelined_bwd",
    "pipelined_smem_bytes",
    "pipelined_stages",
]

# CUDA kernel names (as ``<name>_mosaic_gpu``): profiles tell the two kernels apart by
# name, not by launch order, which XLA may swap (dq and dk/dv are independent).
DQ_KERNEL = "ranker_bwd_dq"
DKV_KERNEL = "ranker_bwd_dkv"


@dataclasses.dataclass(frozen=True)
class _Static(RankerKernelStatic):
    num_stages: int
    # exp2_fma_cols / rcp_fma_cols: key (dq) or query (dk/dv) columns of each 64 x 64
    #   tile whose exp2 / soft_sign reciprocal run on the FMA pipe (attn_mosaic_gpu.
    #   fastmath), the rest on the MUFU; multiples of 8, 0..64.
    exp2_fma_cols: int = 0
    rcp_fma_cols: int = 0
    # dq_programs: 0 runs dq as one program per (head, tile, batch); N > 0 runs N
    #   persistent programs that walk those tiles and load the next tile's fixed
    #   operands while the current one computes (_build_dq_persistent_kernel).
    dq_programs: int = 0
    # Where the kernels run (compiled, or on the interpreter: _interpret.Target).
    target: Target = COMPILED
    # 0: one user per row (bounds [B, 4]); U >= 2: packed rows (bounds [B, U, 4]) with
    # step lists built outside (attn_common.packed.packed_step_list).
    packed_users: int = 0


def _softmax_terms(raw, lse2, allowed, st: _Static, q_axis: int):
    """``P`` (f32) and ``cap'`` (``None`` without a cap) from the raw ``Q.K`` tile.

    ``q_axis`` is the axis of the tile that indexes queries (``lse2`` runs along it);
    ``allowed`` is ``None`` on fully allowed steps.
    """

    def reciprocal(d):
        on_mufu = st.target.reciprocal_tile()
        return split_columns(d, st.rcp_fma_cols, reciprocal_fma, on_mufu)

    s2, dcap = cap_scaled_with_derivative(
        raw, st.cap, st.sm_scale, out_scale=LOG2E, reciprocal=reciprocal
    )
    if allowed is not None:
        s2 = jnp.where(allowed, s2, -jnp.inf)
    on_fma = functools.partial(exp2_fma, xla_fold_guard=st.target.interpret)
    x = s2 - lax.broadcast_in_dim(lse2, raw.shape, [q_axis])
    return split_columns(x, st.exp2_fma_cols, on_fma, jnp.exp2), dcap


def _p_and_grad_factor(operands, lse2, delta, mask_fn, st: _Static, q_axis: int):
    """Issue ``S = A B^T`` and ``dP = C D^T`` (one wgmma scope); return ``P`` and
    ``(dP - delta') * cap'`` in f32, so that ``dS = P * factor``.

    The softmax terms are computed once S has landed, while the dP wgmma is still in
    flight (``wgmma.wait_group 1``); the mask predicate is built while S is in flight.
    """
    a, b, c, d = operands

    def body(s_ref, dp_ref):
        plgpu.wgmma(s_ref, a, b.transpose((1, 0)))
        plgpu.wgmma(dp_ref, c, d.transpose((1, 0)))
        allowed = None if mask_fn is None else mask_fn()
        raw = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
        p, dcap = _softmax_terms(raw, lse2, allowed, st, q_axis)
        factor = dp_ref[...] - lax.broadcast_in_dim(delta, raw.shape, [q_axis])
        if dcap is not None:
            factor = factor * dcap
        return p, factor

    acc = plgpu.ACC((BLOCK, BLOCK), jnp.float32)
    return pl.run_scoped(body, acc, acc)


def _accumulate(target: Target, accs, lhs, rhs_smem, staging):
    """``accs[i] += lhs[i] @ rhs_smem[i]`` for each pair, waited once, the A operands
    from registers (``Target.accumulate_registers``; ``staging()``: where the
    interpreter stages them)."""
    operands = [(lambda a=a: a, b) for a, b in zip(lhs, rhs_smem, strict=True)]
    return target.accumulate_registers(accs, staging, operands)


def _dkv_update(dk, dv, p_t, factor, q_slot, do_slot, staging, st: _Static, dtype):
    """``dV += P^T dO`` and ``dK += dS^T Q`` with ``dS^T = P^T * factor``: dV's wgmma is
    issued first and dS^T is formed on the CUDA cores while it runs."""
    dv, dk = st.target.accumulate_registers(
        (dv, dk),
        staging,
        [(lambda: p_t.astype(dtype), do_slot), (lambda: (p_t * factor).astype(dtype), q_slot)],
    )
    return dk, dv


def _ring_loads(num_slots, total_steps, issue, free):
    """The memory WG's loop: fill the ring, refill a slot once both compute WGs have
    consumed it, then observe the last ``num_slots`` consumptions (so every completed
    barrier phase is waited before the barriers are freed; interpret mode checks this)."""
    for i in range(num_slots):

        @pl.when(i < total_steps)
        def _prologue(i=i):
            issue(jnp.int32(i), i)

    @pl.loop(num_slots, jnp.maximum(total_steps, num_slots))
    def _steady(step):
        slot = lax.rem(step, jnp.int32(num_slots))
        plgpu.barrier_wait(free.at[slot])
        issue(step, slot)

    @pl.loop(jnp.maximum(total_steps - num_slots, 0), total_steps)
    def _drain(step):
        plgpu.barrier_wait(free.at[lax.rem(step, jnp.int32(num_slots))])


def _three_phase_loop(lo, hi, total, step, carry):
    """Masked steps ``[0, lo)``, unmasked ``[lo, hi)``, masked ``[hi, total)``."""
    masked = functools.partial(step, masked=True)
    carry = lax.fori_loop(0, lo, masked, carry)
    carry = lax.fori_loop(lo, hi, functools.partial(step, masked=False), carry)
    return lax.fori_loop(hi, total, masked, carry)


def _bounds(bounds_ref, batch):
    return tuple(bounds_ref[batch, i] for i in range(4))


def _tile_steps(st: _Static, bounds_ref, steps_ref, batch, tile, one_user_ranges):
    """The program's tile: its first row, its steps and, with one user per row, the
    row's bounds ``(hl, hu, cl, cu)`` (``None`` for packed rows).

    Packed rows read the tile's row of ``packed_step_list`` (its steps, and per compute
    WG the steps that need no mask; the mask itself comes from the per-position
    tables); one user per row gets ``one_user_ranges`` (``ranker_kv_block_ranges`` for
    dq, ``ranker_q_block_ranges`` for dk/dv) of its bounds.
    """
    bounds = None
    # ``tile``: a grid axis name (read where needed) or the tile index itself
    tile_index = (lambda: lax.axis_index(tile)) if isinstance(tile, str) else (lambda: tile)
    if st.packed_users:
        row = tile_index()
        ranges = TileSteps(lambda i: steps_ref[batch, row, i], COMPUTE_WGS)
    else:
        bounds = _bounds(bounds_ref, batch)
    tile_start = tile_index() * (COMPUTE_WGS * BLOCK)
    if bounds is not None:
        ranges = one_user_ranges(*bounds, tile_start, tile_start + 2 * BLOCK, BLOCK)
    return tile_start, ranges, bounds


def _load_fixed(srcs, dsts, bars, wg):
    """TMA-load a WG's fixed operands, each on its own barrier, then wait for all."""
    for src, dst, bar in zip(srcs, dsts, bars, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])
    for bar in bars:
        plgpu.barrier_wait(bar.at[wg])


def _row_entries(table_smem, fields: int):
    """A WG's rows' table entries (``[fields, 64]`` int32 in shared memory) as per-row
    vectors in the wgmma row layout."""
    return tuple(
        plgpu.load(table_smem.at[f], layout=plgpu.Layout.WGMMA.reduce(1)) for f in range(fields)
    )


class _DqFixed(NamedTuple):
    """A dq compute WG's fixed shared buffers for its 64 rows (views of ``DqBuffers``;
    ``keys``: the rows' ``packed_query_table`` entries, packed rows only)."""

    q: object
    do: object
    lse: object
    delta: object
    keys: object = None


def _fixed_views(buf: DqBuffers, *index) -> _DqFixed:
    """The fixed buffers of compute WG ``index[-1]`` (and copy ``index[0]``)."""
    keys = None if buf.keys is None else buf.keys.at[index]
    return _DqFixed(buf.q.at[index], buf.do.at[index], buf.lse.at[index], buf.delta.at[index], keys)


def _fixed_sources(refs: BwdRefs, st: _Static, batch, q_head, tile_start, wg):
    """Compute WG ``wg``'s rows of a tile: ``(row0, rows, sources)``, ``rows`` the index
    of its Q / dO / dQ rows and ``sources`` its fixed operands in ``DqBuffers`` order."""
    b = BLOCK
    row0 = tile_start + wg * b
    rows = (batch, pl.ds(row0, b), q_head)
    vec = (batch, q_head, pl.ds(row0, b))
    srcs = [refs.q.at[rows], refs.do.at[rows], refs.lse.at[vec], refs.delta.at[vec]]
    if st.packed_users:  # the rows' packed_query_table entries
        srcs.append(refs.table.at[batch, :, pl.ds(row0, b)])
    return row0, rows, srcs


def _store_dq(st: _Static, dtype, fixed: _DqFixed, dq, dq_ref, rows) -> None:
    """dQ (scaled) into the WG's Q buffer (Q is dead by then), TMA-stored, not waited."""
    fixed.q[...] = (dq * st.sm_scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(fixed.q, dq_ref.at[rows])


def _dq_tile(
    st: _Static, dtype, fixed: _DqFixed, buf: DqBuffers, bar: DqBarriers, staging, ranges,
    total_steps, one_user, row0, wg, *, slot_of,
):  # fmt: skip
    """One compute WG's dQ (f32, unscaled) for its 64 rows from ``row0``: the
    ``total_steps`` steps of ``ranges`` (step ``i`` reads ring slot ``slot_of(i)``),
    masked where needed."""
    b = BLOCK
    if st.packed_users:
        row_keys = _row_entries(fixed.keys, PACKED_QUERY_FIELDS)
    else:
        hl, hu, cl, cu = one_user
    lse2 = plgpu.load(fixed.lse, layout=plgpu.Layout.WGMMA.reduce(1))
    delta = plgpu.load(fixed.delta, layout=plgpu.Layout.WGMMA.reduce(1))
    if st.packed_users:
        full_lo, full_hi = ranges.full_steps(wg)
    else:
        full_lo, full_hi = ranker_full_kv_steps(ranges, hl, hu, cl, cu, row0, row0 + b, b)

    def step(i, dq, *, masked):
        slot = slot_of(i)
        plgpu.barrier_wait(bar.k_landed.at[slot])
        plgpu.barrier_wait(bar.v_landed.at[slot])
        mask_fn = None
        if masked:

            def mask_fn():
                kv0 = ranges.block_at(i) * b
                if st.packed_users:
                    return packed_tile_mask(ranker_mask_from_query_table, row_keys, kv0, (b, b))
                return ranker_tile_mask(row0, kv0, (b, b), hl, hu, cl, cu)

        operands = (fixed.q, buf.k.at[slot], fixed.do, buf.v.at[slot])
        p, factor = _p_and_grad_factor(operands, lse2, delta, mask_fn, st, 0)
        ds = p * factor
        (dq,) = _accumulate(st.target, (dq,), (ds.astype(dtype),), (buf.k.at[slot],), staging)
        plgpu.barrier_arrive(bar.kv_free.at[slot])
        return dq

    dq0 = plgpu.layout_cast(jnp.full((b, st.head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return _three_phase_loop(full_lo, full_hi, total_steps, step, dq0)


def _issue_kv(refs: BwdRefs, buf: DqBuffers, bar: DqBarriers, batch, block, kv_head, slot):
    """TMA-load key/value block ``block`` of ``(batch, kv_head)`` into ring slot ``slot``."""
    kv_rows = (batch, pl.ds(block * BLOCK, BLOCK), kv_head)
    plgpu.copy_gmem_to_smem(refs.k.at[kv_rows], buf.k.at[slot], bar.k_landed.at[slot])
    plgpu.copy_gmem_to_smem(refs.v.at[kv_rows], buf.v.at[slot], bar.v_landed.at[slot])


def _dq_entry(kernel, st: _Static, dtype, *, persistent: bool):
    """The dq kernel's entry: its inputs (``BwdRefs``: the packed rows' step list and
    query table only for packed rows), its output dQ ``[B, S_pad, Hq, D]`` and its
    scratch (``ranker_config.dq_scratch``: persistent programs double the fixed
    buffers), for ``kernel(refs, dq_ref, buf, bar)``."""
    buffers, barriers = dq_scratch(
        st.head_dim, dtype, num_stages=st.num_stages, persistent=persistent,
        packed=bool(st.packed_users), interpret=st.target.interpret,
    )  # fmt: skip

    def entry(*refs):
        packed = refs[7:9] if st.packed_users else ()
        ins = BwdRefs(*refs[:7], *packed)
        pl.run_scoped(
            lambda buf, bar: kernel(ins, refs[-1], buf, bar),
            buffers,
            barriers,
            collective_axes=_axes.WARPGROUP,
        )

    return entry


def _build_dq_kernel(st: _Static, dtype):
    num_slots = st.num_stages
    group = st.group_size

    def kernel(refs: BwdRefs, dq_ref, buf: DqBuffers, bar: DqBarriers):
        batch = lax.axis_index(_axes.BATCH)
        q_head = lax.axis_index(_axes.HEADS)
        wg = lax.axis_index(_axes.WARPGROUP)
        kv_head = lax.div(q_head, jnp.int32(group))
        tile_start, ranges, one_user = _tile_steps(
            st, refs.bounds, refs.steps, batch, _axes.Q_TILES, ranker_kv_block_ranges
        )
        total_steps = ranges.total_steps

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            row0, rows, srcs = _fixed_sources(refs, st, batch, q_head, tile_start, wg)
            fixed = _fixed_views(buf, wg)
            _load_fixed(srcs, fixed[: len(srcs)], bar.fixed, wg)
            staging = lambda: (buf.ds.at[wg],)  # noqa: E731
            dq = _dq_tile(
                st, dtype, fixed, buf, bar, staging, ranges, total_steps, one_user, row0, wg,
                slot_of=lambda i: lax.rem(i, jnp.int32(num_slots)),
            )  # fmt: skip
            _store_dq(st, dtype, fixed, dq, dq_ref, rows)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory_wg():
            plgpu.set_max_registers(memory_registers(COMPUTE_REGISTERS), action="decrease")

            def issue(step, slot):
                _issue_kv(refs, buf, bar, batch, ranges.block_at(step), kv_head, slot)

            _ring_loads(num_slots, total_steps, issue, bar.kv_free)

    return _dq_entry(kernel, st, dtype, persistent=False)


def _build_dq_persistent_kernel(st: _Static, dtype):
    """dq with ``st.dq_programs`` programs, each walking the tiles ``p, p + P, ...`` of
    the (head, tile, batch) grid, head fastest (``_persistent.tile_coords``).

    The fixed operands are double-buffered: while a compute WG walks the steps of its
    tile ``j`` it has already issued the TMA loads of tile ``j + 1``'s Q, dO, lse2 and
    delta' into the other buffer (after waiting for tile ``j - 1``'s dQ store to have
    read that buffer), and tile ``j``'s dQ store is not waited for until then. The K/V
    ring runs on across tiles: step ``i`` of a tile whose program has walked ``base``
    steps before it uses slot ``(base + i) % num_stages``, and the memory WG refills a
    slot once both compute WGs consumed its previous step, whatever tile that was. A
    tile's steps run in the same order as in the per-tile kernel, so dQ is bitwise the
    same.
    """
    num_slots = st.num_stages
    group = st.group_size
    programs = st.dq_programs
    tiles = st.seq_pad // (COMPUTE_WGS * BLOCK)
    num_tiles = st.q_heads * tiles * st.batch

    def kernel(refs: BwdRefs, dq_ref, buf: DqBuffers, bar: DqBarriers):
        program = lax.axis_index(_axes.PROGRAMS)
        wg = lax.axis_index(_axes.WARPGROUP)
        my_tiles = program_tiles(program, programs, num_tiles)

        def tile_of(j):
            """Program-local tile ``j``: its query head, batch row, steps and rows."""
            q_head, tile, batch = tile_coords(
                program, j, programs=programs, heads=st.q_heads, tiles=tiles
            )
            tile_start, ranges, one_user = _tile_steps(
                st, refs.bounds, refs.steps, batch, tile, ranker_kv_block_ranges
            )
            return q_head, batch, tile_start, ranges, one_user

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            staging = lambda: (buf.ds.at[wg],)  # noqa: E731

            def issue_fixed(j, copy):
                q_head, batch, tile_start, _, _ = tile_of(j)
                _, _, srcs = _fixed_sources(refs, st, batch, q_head, tile_start, wg)
                fixed = _fixed_views(buf, copy, wg)
                for src, dst, landed in zip(srcs, fixed, bar.fixed, strict=False):
                    plgpu.copy_gmem_to_smem(src, dst, landed.at[copy * COMPUTE_WGS + wg])

            @pl.when(my_tiles > 0)
            def _first():
                issue_fixed(0, 0)

            def walk(j, base):
                copy = lax.rem(j, jnp.int32(2))
                q_head, batch, tile_start, ranges, one_user = tile_of(j)
                row0 = tile_start + wg * BLOCK
                rows = (batch, pl.ds(row0, BLOCK), q_head)
                total_steps = ranges.total_steps
                for landed in bar.fixed:
                    plgpu.barrier_wait(landed.at[copy * COMPUTE_WGS + wg])

                @pl.when(j + 1 < my_tiles)
                def _prefetch():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # tile j-1's dQ store
                    issue_fixed(j + 1, 1 - copy)

                fixed = _fixed_views(buf, copy, wg)
                dq = _dq_tile(
                    st, dtype, fixed, buf, bar, staging, ranges, total_steps, one_user, row0, wg,
                    slot_of=lambda i: lax.rem(base + i, jnp.int32(num_slots)),
                )  # fmt: skip
                _store_dq(st, dtype, fixed, dq, dq_ref, rows)
                return base + total_steps

            lax.fori_loop(0, my_tiles, walk, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory_wg():
            plgpu.set_max_registers(memory_registers(COMPUTE_REGISTERS), action="decrease")

            def tile_steps(j):
                q_head, batch, _, ranges, _ = tile_of(j)
                kv_head = lax.div(q_head, jnp.int32(group))

                def issue(i, step, slot):
                    @pl.when(step >= num_slots)
                    def _wait_free():
                        plgpu.barrier_wait(bar.kv_free.at[slot])

                    _issue_kv(refs, buf, bar, batch, ranges.block_at(i), kv_head, slot)

                return ranges.total_steps, issue

            total = ring_walk(my_tiles, num_slots, tile_steps)

            @pl.loop(jnp.maximum(total - num_slots, 0), total)
            def _drain(step):
                plgpu.barrier_wait(bar.kv_free.at[lax.rem(step, jnp.int32(num_slots))])

    return _dq_entry(kernel, st, dtype, persistent=True)


def _dkv_per_step_kv(st: _Static) -> bool:
    """Whether the dk/dv kernel addresses its fixed K and V anew each step (D > 64).

    D=128: the accumulators dK, dV (2 x 64 of a thread's registers) and S^T, dP^T
    (2 x 32) leave too little room for the 16 wgmma descriptors of the fixed K and V,
    which the compiler hoists out of the step loops because their addresses are
    loop-invariant; ptxas then spilled (880 bytes, 55 local loads/stores per unmasked
    step). Addressing K and V anew each step (through a zero the compiler cannot
    see) keeps the descriptors in the loop, and 240 registers (the memory WG keeps
    24, setmaxnreg's floor) leave 128 bytes of spills, all outside the unmasked loop:
    dk/dv 18-27 % faster on phoenix and ragged (docs/ranker_gpu.md). D=64 measured
    no gain and keeps the plain addresses and 232/40."""
    return st.head_dim > 64


def _dkv_memory_wg(
    st: _Static, refs: BwdRefs, buf: DkvBuffers, bar: DkvBarriers, batch, kv_head, ranges,
    steps, compute_registers,
):  # fmt: skip
    """The dk/dv kernel's memory WG: the ring of query-side blocks (Q, LSE, dO, delta')
    over the group's query heads: ``steps = (head_steps, total_steps)``."""
    b, group = BLOCK, st.group_size
    head_steps, total_steps = steps
    plgpu.set_max_registers(memory_registers(compute_registers), action="decrease")

    def issue(step, slot):
        head = lax.div(step, jnp.maximum(head_steps, 1))
        i = step - head * head_steps
        q_head = kv_head * group + head
        q0 = ranges.block_at(i) * b
        rows = (batch, pl.ds(q0, b), q_head)
        vec = (batch, q_head, pl.ds(q0, b))
        plgpu.copy_gmem_to_smem(refs.q.at[rows], buf.q.at[slot], bar.q_landed.at[slot])
        plgpu.copy_gmem_to_smem(refs.lse.at[vec], buf.lse.at[slot], bar.lse_landed.at[slot])
        plgpu.copy_gmem_to_smem(refs.do.at[rows], buf.do.at[slot], bar.do_landed.at[slot])
        plgpu.copy_gmem_to_smem(refs.delta.at[vec], buf.delta.at[slot], bar.delta_landed.at[slot])

    _ring_loads(st.num_stages, total_steps, issue, bar.step_free)


def _build_dkv_kernel(st: _Static, dtype):
    b = BLOCK
    num_slots = st.num_stages
    group = st.group_size
    per_step_kv = _dkv_per_step_kv(st)
    compute_registers = MAX_COMPUTE_REGISTERS if per_step_kv else COMPUTE_REGISTERS

    def kernel(refs: BwdRefs, dk_ref, dv_ref, buf: DkvBuffers, bar: DkvBarriers):
        batch = lax.axis_index(_axes.BATCH)
        kv_head = lax.axis_index(_axes.HEADS)
        wg = lax.axis_index(_axes.WARPGROUP)
        tile_start, ranges, one_user = _tile_steps(
            st, refs.bounds, refs.steps, batch, _axes.KV_TILES, ranker_q_block_ranges
        )
        if one_user is not None:
            hl, hu, cl, cu = one_user
        head_steps = ranges.total_steps  # steps per query head of the group
        total_steps = group * head_steps

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(compute_registers, action="increase")
            k_smem, v_smem = buf.k.at[wg], buf.v.at[wg]
            if per_step_kv:
                # 0 at run time (bounds are clipped to [0, S]), unknown to the compiler.
                raw = refs.bounds[batch, 0] if not st.packed_users else refs.bounds[batch, 0, 0]
                opaque_zero = lax.shift_right_logical(raw, jnp.int32(31))
            kv0 = tile_start + wg * b
            kv_rows = (batch, pl.ds(kv0, b), kv_head)
            srcs, dsts = [refs.k.at[kv_rows], refs.v.at[kv_rows]], [k_smem, v_smem]
            if st.packed_users:  # the keys' packed_key_table entries
                srcs.append(refs.table.at[batch, :, pl.ds(kv0, b)])
                dsts.append(buf.keys.at[wg])
            _load_fixed(srcs, dsts, bar.fixed, wg)
            if st.packed_users:
                key_queries = _row_entries(buf.keys.at[wg], PACKED_KEY_FIELDS)
            if st.packed_users:
                full_lo, full_hi = ranges.full_steps(wg)
            else:
                full_lo, full_hi = ranker_full_q_steps(ranges, hl, hu, cl, cu, kv0, kv0 + b, b)
            staging = lambda: (buf.p.at[wg], buf.ds.at[wg])  # noqa: E731
            layout = plgpu.Layout.WGMMA
            kv_ids = kv0 + plgpu.broadcasted_iota(jnp.int32, (b, b), 0, layout=layout)

            def step(i, carry, *, head, masked):
                dk, dv = carry
                slot = lax.rem(head * head_steps + i, jnp.int32(num_slots))
                for landed in (bar.q_landed, bar.lse_landed, bar.do_landed, bar.delta_landed):
                    plgpu.barrier_wait(landed.at[slot])
                lse2 = plgpu.load(buf.lse.at[slot], layout=layout.reduce(0))
                delta = plgpu.load(buf.delta.at[slot], layout=layout.reduce(0))
                mask_fn = None
                if masked:

                    def mask_fn():
                        q0 = ranges.block_at(i) * b
                        if st.packed_users:
                            return packed_tile_mask(
                                ranker_mask_from_key_table, key_queries, q0, (b, b)
                            )
                        q_ids = q0 + plgpu.broadcasted_iota(jnp.int32, (b, b), 1, layout=layout)
                        return ranker_mask(q_ids, kv_ids, hl, hu, cl, cu)

                k_fixed, v_fixed = k_smem, v_smem
                if per_step_kv:  # the same buffers, addressed anew each step
                    own = wg + lax.bitwise_and(i, opaque_zero)
                    k_fixed, v_fixed = buf.k.at[own], buf.v.at[own]
                operands = (k_fixed, buf.q.at[slot], v_fixed, buf.do.at[slot])
                p_t, factor = _p_and_grad_factor(operands, lse2, delta, mask_fn, st, 1)
                dk, dv = _dkv_update(
                    dk, dv, p_t, factor, buf.q.at[slot], buf.do.at[slot], staging, st, dtype
                )
                plgpu.barrier_arrive(bar.step_free.at[slot])
                return dk, dv

            def head_loop(head, carry):
                fn = functools.partial(step, head=head)
                return _three_phase_loop(full_lo, full_hi, head_steps, fn, carry)

            zeros = plgpu.layout_cast(jnp.full((b, st.head_dim), 0.0, jnp.float32), layout)
            dk, dv = lax.fori_loop(0, group, head_loop, (zeros, zeros))
            k_smem[...] = (dk * st.sm_scale).astype(dtype)
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[kv_rows])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[kv_rows])
            plgpu.wait_smem_to_gmem(0)

        pl.when(wg == COMPUTE_WGS)(
            lambda: _dkv_memory_wg(
                st, refs, buf, bar, batch, kv_head, ranges, (head_steps, total_steps),
                compute_registers,
            )
        )  # fmt: skip

    buffers, barriers = dkv_scratch(
        st.head_dim, dtype, num_stages=num_slots, packed=bool(st.packed_users),
        interpret=st.target.interpret,
    )  # fmt: skip

    def entry(*refs):
        # Inputs (BwdRefs: the step list and the key table only for packed rows), then
        # the outputs dK, dV [B, S_pad, Hkv, D].
        packed = refs[7:9] if st.packed_users else ()
        ins = BwdRefs(*refs[:7], *packed)
        pl.run_scoped(
            lambda buf, bar: kernel(ins, *refs[-2:], buf, bar),
            buffers,
            barriers,
            collective_axes=_axes.WARPGROUP,
        )

    return entry


def pipelined_bwd(
    q,
    k,
    v,
    do,
    lse2,
    delta,
    bounds,
    *,
    st_fields: dict,
    interpret,
    tuning: dict | None = None,
    users: int = 0,
):
    """Run both kernels on padded inputs (``S`` a multiple of 128).

    ``q, do [B,S,Hq,D]``, ``k, v [B,S,Hkv,D]``, ``lse2, delta [B,Hq,S]`` float32 (base-2
    LSE with ``+inf`` on empty rows; ``delta'``), ``bounds [B,4]`` int32 clipped, or
    packed ``[B, U, 4]`` normalized with ``users = U >= 2``.
    ``st_fields``: batch, seq_pad, q_heads, kv_heads, head_dim, sm_scale, cap.
    ``tuning``: overrides of the schedule knobs ``num_stages``, ``exp2_fma_cols``,
    ``rcp_fma_cols``, ``dq_programs`` (``BackwardTuning``; ``None``
    keeps the defaults). ``interpret``: as the public functions take it, or a ``Target``.
    """
    target = resolve_target(interpret)
    knobs = {"num_stages": pipelined_stages(st_fields["head_dim"]), **(tuning or {})}
    check_backward_knobs(knobs, st_fields["cap"])
    need = pipelined_smem_bytes(
        st_fields["head_dim"], q.dtype, interpret=target.interpret,
        num_stages=knobs["num_stages"], dq_programs=knobs.get("dq_programs", 0),
        packed=bool(users),
    )  # fmt: skip
    for kernel, size in need.items():
        if size > SMEM_LIMIT_BYTES:
            raise ValueError(
                f"backward tuning {knobs}: the {kernel} kernel needs {size} bytes of shared "
                f"memory, more than the {SMEM_LIMIT_BYTES} available per block on sm_90"
            )
    st = _Static(**st_fields, **knobs, target=target, packed_users=users)
    return _pipelined_bwd(q, k, v, do, lse2, delta, bounds, st=st)


@functools.partial(jax.jit, static_argnames=("st",))
def _pipelined_bwd(q, k, v, do, lse2, delta, bounds, *, st: _Static):
    tiles = st.seq_pad // (COMPUTE_WGS * BLOCK)
    common = dict(
        num_threads=COMPUTE_WGS + 1,
        thread_name=_axes.WARPGROUP,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=st.target.params,
    )
    dq_in = [q, k, v, do, lse2, delta, bounds]
    dkv_in = list(dq_in)
    if st.packed_users:  # packed rows: the visit-once runs and unmasked steps, per tile
        table = functools.partial(
            packed_step_list, bounds, tile=2 * BLOCK, num_tiles=tiles, block=BLOCK,
            sub_tiles=COMPUTE_WGS,
        )  # fmt: skip
        dq_in += [table(), packed_query_table(bounds, st.seq_pad)]
        dkv_in += [table(keys=True), packed_key_table(bounds, st.seq_pad)]
    if st.dq_programs:
        dq_grid = dict(grid=(st.dq_programs,), grid_names=(_axes.PROGRAMS,))
        build_dq = _build_dq_persistent_kernel
    else:
        dq_grid = dict(
            grid=(st.q_heads, tiles, st.batch), grid_names=(_axes.HEADS, _axes.Q_TILES, _axes.BATCH)
        )
        build_dq = _build_dq_kernel
    dq = plgpu.kernel(
        build_dq(st, q.dtype),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        **dq_grid,
        kernel_name=DQ_KERNEL,
        **common,
    )(*dq_in)
    dk, dv = plgpu.kernel(
        _build_dkv_kernel(st, q.dtype),
        out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(st.kv_heads, tiles, st.batch),
        grid_names=(_axes.HEADS, _axes.KV_TILES, _axes.BATCH),
        kernel_name=DKV_KERNEL,
        **common,
    )(*dkv_in)
    return dq, dk, dv
