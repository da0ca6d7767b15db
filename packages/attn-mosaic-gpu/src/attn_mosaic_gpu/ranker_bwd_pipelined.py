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
  ``attn_common.cap_scaled_with_derivative`` (constants folded, the derivative from the
  same terms). The ring has 2 slots for D=128 and 4 for D=64. The schedules without
  this overlap and fold were measured slower (``docs/results/ranker_bwd_sweep.md``) and
  left the kernel at da2ec0c.

  Knob ``dq_programs`` (0, one program per tile, unless the tuned table says otherwise):
  dq runs as that many persistent programs (one per SM), each walking the tiles
  ``p, p + P, ...``; a compute
  WG issues the next tile's fixed-operand loads into a second buffer before walking the
  current tile's steps, and the K/V ring runs on across tiles
  (``_build_dq_persistent_kernel``). It targets the ~7 us that each per-tile program
  spends besides its steps (1d4614c, docs/experiments.md); on the H200 it
  took phoenix's dq from 2.39 to 2.17 ms and small-d64's from 0.37 to 0.29 ms, while
  long and ragged moved within noise.

  After the last step it writes its f32 accumulators (scaled) into its fixed buffers
  (Q / K, V are dead by then) and TMA-stores them. The mask
  (``attn_common.ranker_mask`` on the tile iotas) is skipped on the steps
  ``attn_common.ranker_full_kv_steps`` / ``ranker_full_q_steps`` prove fully allowed
  for the WG's rows (most history steps).
* WG2 (memory, ``setmaxnreg 40``): TMA-loads the streamed operands of every step into a
  ring of ``num_stages`` slots (dq: K and V blocks of the tile's
  ``ranker_kv_block_ranges``; dk/dv: Q, dO, lse2 and delta' blocks of the tile's
  ``ranker_q_block_ranges`` for each query head of the kv head's GQA group in turn).
  Step ``t + num_stages`` waits on slot ``t % num_stages``'s *consumed* barrier.

Both compute WGs walk every step of the tile (a WG whose rows see nothing gets ``p = 0``
and writes zeros), which keeps every barrier's arrival count static. Barriers:
``*_ready[slot]`` (TMA transaction barriers, one per streamed operand so each wait
covers one copy), ``fixed[wg]`` (one per fixed operand and WG) and ``consumed[slot]``
(2 arrivals, one per compute WG, after the step's last wgmma has completed).

dK/dV of a kv head are summed over its query heads in a fixed order inside one program:
no atomics, no per-head copies, bitwise deterministic. Every program writes its whole
output tile, so rows and keys with no allowed pair get exactly 0.

Interpret mode (CPU): jax 0.11.2's Mosaic GPU interpreter has no ``run_state`` and no
register-A wgmma, so ``P``/``dS`` are staged through per-WG shared buffers and the
products go into fresh accumulators that are then added. Everything else is the GPU code.
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

from attn_common import CapMethod, CapParams, ranker_mask
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
from attn_mosaic_gpu._persistent import program_tiles, ring_walk, tile_coords
from attn_mosaic_gpu._registers import (
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    MAX_COMPUTE_REGISTERS,
    memory_registers,
)
from attn_mosaic_gpu._smem import SMEM_LIMIT_BYTES, allocated_bytes, tile_transforms
from attn_mosaic_gpu.fastmath import (
    LOG2E,
    exp2_fma,
    mufu_reciprocal,
    reciprocal_fma,
    split_columns,
)
from attn_mosaic_gpu.ranker_fwd import packed_tile_mask, ranker_tile_mask

__all__ = [
    "PIPELINED_HEAD_DIMS",
    "check_backward_knobs",
    "pipelined_bwd",
    "pipelined_smem_bytes",
    "pipelined_stages",
]

BLOCK = 64  # rows per compute WG and rows per streamed block (one wgmma M)
PIPELINED_HEAD_DIMS = (64, 128)
# CUDA kernel names (as ``<name>_mosaic_gpu``): profiles tell the two kernels apart by
# name, not by launch order, which XLA may swap (dq and dk/dv are independent).
DQ_KERNEL = "ranker_bwd_dq"
DKV_KERNEL = "ranker_bwd_dkv"


def pipelined_stages(head_dim: int) -> int:
    """Ring depth: 2 for D=128 (~129 KiB of shared memory; on the H200 2 stages ran
    4-8% faster than 3 in ``benchmarks/ranker_bwd_sweep.py``), 4 for D=64 (~97 KiB)."""
    return 2 if head_dim > 64 else 4


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

    The buffers and barriers are those of ``_dq_entry`` and ``_build_dkv_kernel``'s
    entry (``_smem.allocated_bytes``); neither kernel has a reduction that Pallas
    reserves scratch for.
    """
    item = jnp.dtype(dtype).itemsize
    stages = pipelined_stages(head_dim) if num_stages is None else num_stages
    tile = BLOCK * head_dim * item  # one WG's rows, or one streamed block
    staging = COMPUTE_WGS * BLOCK * BLOCK * item if interpret else 0
    lead = 2 if dq_programs else 1
    dq_table = lead * COMPUTE_WGS * PACKED_QUERY_FIELDS * BLOCK * 4 if packed else 0
    dq_buffers = [
        *[lead * COMPUTE_WGS * tile] * 2,  # Q, dO
        *[lead * COMPUTE_WGS * BLOCK * 4] * 2,  # lse2, delta'
        *[stages * tile] * 2,  # K, V ring
        staging,
        dq_table,
    ]
    dq = allocated_bytes(dq_buffers, (5 if packed else 4) * lead * COMPUTE_WGS + 3 * stages)
    dkv_table = COMPUTE_WGS * PACKED_KEY_FIELDS * BLOCK * 4 if packed else 0
    dkv_buffers = [
        *[COMPUTE_WGS * tile] * 2,  # K, V
        *[stages * tile] * 2,  # Q, dO ring
        *[stages * BLOCK * 4] * 2,  # lse2, delta' ring
        staging,
        staging,
        dkv_table,
    ]
    dkv = allocated_bytes(dkv_buffers, (3 if packed else 2) * COMPUTE_WGS + 5 * stages)
    return {"dq": dq, "dkv": dkv}


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
    # Interpret mode: it runs on XLA, which would fold exp2_fma's rounding step away
    #   (hence its guard), and runs no inline Mosaic GPU code (fastmath.mufu_reciprocal).
    interpret: bool = False
    # 0: one user per row (bounds [B, 4]); U >= 2: packed rows (bounds [B, U, 4]) with
    # step lists built outside (attn_common.packed.packed_step_list).
    packed_users: int = 0


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


def _softmax_terms(raw, lse2, allowed, st: _Static, q_axis: int):
    """``P`` (f32) and ``cap'`` (``None`` without a cap) from the raw ``Q.K`` tile.

    ``q_axis`` is the axis of the tile that indexes queries (``lse2`` runs along it);
    ``allowed`` is ``None`` on fully allowed steps.
    """

    def reciprocal(d):
        on_mufu = mufu_reciprocal(compiled=not st.interpret)
        return split_columns(d, st.rcp_fma_cols, reciprocal_fma, on_mufu)

    s2, dcap = cap_scaled_with_derivative(
        raw, st.cap, st.sm_scale, out_scale=LOG2E, reciprocal=reciprocal
    )
    if allowed is not None:
        s2 = jnp.where(allowed, s2, -jnp.inf)
    on_fma = functools.partial(exp2_fma, xla_fold_guard=st.interpret)
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


def _accumulate(accs, lhs, rhs_smem, staging, in_place: bool):
    """``accs[i] += lhs[i] @ rhs_smem[i]`` for each pair, waited once.

    On the GPU the A operands stay in registers and the wgmmas accumulate in place;
    in interpret mode they are staged through ``staging[i]`` into fresh accumulators.
    """
    if in_place:

        def body(refs):
            for ref, a, b in zip(refs, lhs, rhs_smem, strict=True):
                plgpu.wgmma(ref, a, b)

        return pl.run_state(body)(tuple(plgpu.ACC.init(a) for a in accs))
    for buf, a in zip(staging, lhs, strict=True):
        buf[...] = a
    plgpu.commit_smem()  # generic-proxy writes visible to the async proxy (wgmma)

    def fresh(*refs):
        for ref, buf, b in zip(refs, staging, rhs_smem, strict=True):
            plgpu.wgmma(ref, buf, b)
        return tuple(ref[...] for ref in refs)

    shapes = [plgpu.ACC(a.shape, jnp.float32) for a in accs]
    products = pl.run_scoped(fresh, *shapes)
    return tuple(a + d for a, d in zip(accs, products, strict=True))


def _dkv_update(dk, dv, p_t, factor, q_slot, do_slot, staging, st: _Static, in_place, dtype):
    """``dV += P^T dO`` and ``dK += dS^T Q`` with ``dS^T = P^T * factor``.

    On the GPU dV's wgmma is issued first and dS^T is formed on the CUDA cores while it
    runs.
    """
    if in_place:

        def body(refs):
            dv_ref, dk_ref = refs
            plgpu.wgmma(dv_ref, p_t.astype(dtype), do_slot)
            ds_t = p_t * factor
            plgpu.wgmma(dk_ref, ds_t.astype(dtype), q_slot)

        dv, dk = pl.run_state(body)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
        return dk, dv
    lhs = (p_t.astype(dtype), (p_t * factor).astype(dtype))
    dv, dk = _accumulate((dv, dk), lhs, (do_slot, q_slot), staging, in_place)
    return dk, dv


def _ring_loads(num_slots, total_steps, issue, consumed):
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
        plgpu.barrier_wait(consumed.at[slot])
        issue(step, slot)

    @pl.loop(jnp.maximum(total_steps - num_slots, 0), total_steps)
    def _drain(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, jnp.int32(num_slots))])


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
    """A dq compute WG's fixed shared buffers for its 64 rows (``keys``: the rows'
    ``packed_query_table`` entries, packed rows only)."""

    q: object
    do: object
    lse: object
    delta: object
    keys: object = None


class _DqRing(NamedTuple):
    """The dq kernel's K/V ring and its barriers."""

    k: object
    v: object
    k_ready: object
    v_ready: object
    consumed: object


def _dq_tile(
    st: _Static, dtype, in_place: bool, fixed: _DqFixed, ring: _DqRing, staging, ranges,
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
        plgpu.barrier_wait(ring.k_ready.at[slot])
        plgpu.barrier_wait(ring.v_ready.at[slot])
        mask_fn = None
        if masked:

            def mask_fn():
                kv0 = ranges.block_at(i) * b
                if st.packed_users:
                    return packed_tile_mask(ranker_mask_from_query_table, row_keys, kv0, (b, b))
                return ranker_tile_mask(row0, kv0, (b, b), hl, hu, cl, cu)

        operands = (fixed.q, ring.k.at[slot], fixed.do, ring.v.at[slot])
        p, factor = _p_and_grad_factor(operands, lse2, delta, mask_fn, st, 0)
        ds = p * factor
        (dq,) = _accumulate((dq,), (ds.astype(dtype),), (ring.k.at[slot],), staging, in_place)
        plgpu.barrier_arrive(ring.consumed.at[slot])
        return dq

    dq0 = plgpu.layout_cast(jnp.full((b, st.head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return _three_phase_loop(full_lo, full_hi, total_steps, step, dq0)


def _issue_kv(k_ref, v_ref, ring: _DqRing, batch, block, kv_head, slot):
    """TMA-load key/value block ``block`` of ``(batch, kv_head)`` into ring slot ``slot``."""
    kv_rows = (batch, pl.ds(block * BLOCK, BLOCK), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], ring.k.at[slot], ring.k_ready.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], ring.v.at[slot], ring.v_ready.at[slot])


def _dq_entry(kernel, st: _Static, dtype, *, in_place: bool, fixed_copies: int):
    """The dq kernel's entry: split the operands (q, k, v, dO, lse2, delta', bounds, the
    packed rows' step list and query key table, dQ) and allocate the scratch that
    ``kernel(*operands, scoped)`` receives: the fixed buffers (``fixed_copies`` = 2: a
    leading axis of two, for the persistent kernel), the K/V ring, the interpret-mode dS
    staging, and the barriers (one per fixed operand and buffer and WG; ready per slot for
    K and V; consumed per slot)."""
    b = BLOCK
    lead = (fixed_copies,) if fixed_copies > 1 else ()
    fields = 5 if st.packed_users else 4

    def entry(*refs):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref = refs[:7]
        steps_ref, keys_ref = refs[7:9] if st.packed_users else (None, None)
        dq_ref = refs[-1]
        t = tile_transforms()
        own = plgpu.SMEM((*lead, COMPUTE_WGS, b, st.head_dim), dtype, transforms=t)
        own_vec = plgpu.SMEM((*lead, COMPUTE_WGS, b), jnp.float32)
        ring = plgpu.SMEM((st.num_stages, b, st.head_dim), dtype, transforms=t)
        staging = None if in_place else plgpu.SMEM((COMPUTE_WGS, b, b), dtype, transforms=t)
        keys = None
        if st.packed_users:
            keys = plgpu.SMEM((*lead, COMPUTE_WGS, PACKED_QUERY_FIELDS, b), jnp.int32)
        operands = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref, steps_ref)
        pl.run_scoped(
            lambda *args: kernel(*operands, keys_ref, dq_ref, args),
            [own, own, own_vec, own_vec, ring, ring, staging, keys],
            (plgpu.Barrier(num_barriers=fixed_copies * COMPUTE_WGS),) * fields,
            (plgpu.Barrier(num_barriers=st.num_stages),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=st.num_stages),
            collective_axes=_axes.WARPGROUP,
        )

    return entry


def _build_dq_kernel(st: _Static, dtype, *, in_place: bool):
    b = BLOCK
    num_slots = st.num_stages
    group = st.group_size

    def kernel(
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref, steps_ref, keys_ref, dq_ref,
        scoped,
    ):  # fmt: skip
        bufs, fixed_ready, (k_ready, v_ready), consumed = scoped
        q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem, ds_smem2, keys_smem2 = bufs
        batch = lax.axis_index(_axes.BATCH)
        q_head = lax.axis_index(_axes.HEADS)
        wg = lax.axis_index(_axes.WARPGROUP)
        kv_head = lax.div(q_head, jnp.int32(group))
        tile_start, ranges, one_user = _tile_steps(
            st, bounds_ref, steps_ref, batch, _axes.Q_TILES, ranker_kv_block_ranges
        )
        total_steps = ranges.total_steps
        ring = _DqRing(k_smem, v_smem, k_ready, v_ready, consumed)

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            row0 = tile_start + wg * b
            rows = (batch, pl.ds(row0, b), q_head)
            vec = (batch, q_head, pl.ds(row0, b))
            srcs = [q_ref.at[rows], do_ref.at[rows], lse_ref.at[vec], delta_ref.at[vec]]
            dsts = [q_smem, do_smem, lse_smem2.at[wg], delta_smem2.at[wg]]
            if st.packed_users:  # the rows' packed_query_table entries
                srcs.append(keys_ref.at[batch, :, pl.ds(row0, b)])
                dsts.append(keys_smem2.at[wg])
            _load_fixed(srcs, dsts, fixed_ready, wg)
            fixed = _DqFixed(q_smem, do_smem, lse_smem2.at[wg], delta_smem2.at[wg])
            if st.packed_users:
                fixed = fixed._replace(keys=keys_smem2.at[wg])
            staging = None if in_place else (ds_smem2.at[wg],)
            dq = _dq_tile(
                st, dtype, in_place, fixed, ring, staging, ranges, total_steps, one_user, row0,
                wg, slot_of=lambda i: lax.rem(i, jnp.int32(num_slots)),
            )  # fmt: skip
            q_smem[...] = (dq * st.sm_scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory_wg():
            plgpu.set_max_registers(memory_registers(COMPUTE_REGISTERS), action="decrease")

            def issue(step, slot):
                _issue_kv(k_ref, v_ref, ring, batch, ranges.block_at(step), kv_head, slot)

            _ring_loads(num_slots, total_steps, issue, consumed)

    return _dq_entry(kernel, st, dtype, in_place=in_place, fixed_copies=1)


def _build_dq_persistent_kernel(st: _Static, dtype, *, in_place: bool):
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
    b = BLOCK
    num_slots = st.num_stages
    group = st.group_size
    programs = st.dq_programs
    tiles = st.seq_pad // (COMPUTE_WGS * b)
    num_tiles = st.q_heads * tiles * st.batch
    fields = 5 if st.packed_users else 4

    def kernel(
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref, steps_ref, keys_ref, dq_ref,
        scoped,
    ):  # fmt: skip
        bufs, fixed_ready, (k_ready, v_ready), consumed = scoped
        q_smem3, do_smem3, lse_smem3, delta_smem3, k_smem, v_smem, ds_smem2, keys_smem3 = bufs
        program = lax.axis_index(_axes.PROGRAMS)
        wg = lax.axis_index(_axes.WARPGROUP)
        my_tiles = program_tiles(program, programs, num_tiles)

        def tile_of(j):
            """Program-local tile ``j``: its query head, batch row, steps and rows."""
            q_head, tile, batch = tile_coords(
                program, j, programs=programs, heads=st.q_heads, tiles=tiles
            )
            tile_start, ranges, one_user = _tile_steps(
                st, bounds_ref, steps_ref, batch, tile, ranker_kv_block_ranges
            )
            return q_head, batch, tile_start, ranges, one_user

        ring = _DqRing(k_smem, v_smem, k_ready, v_ready, consumed)

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            staging = None if in_place else (ds_smem2.at[wg],)

            def rows_of(q_head, batch, tile_start):
                row0 = tile_start + wg * b
                return row0, (batch, pl.ds(row0, b), q_head), (batch, q_head, pl.ds(row0, b))

            def fixed_of(buf):
                fixed = _DqFixed(
                    q_smem3.at[buf, wg], do_smem3.at[buf, wg], lse_smem3.at[buf, wg],
                    delta_smem3.at[buf, wg],
                )  # fmt: skip
                return fixed._replace(keys=keys_smem3.at[buf, wg]) if st.packed_users else fixed

            def issue_fixed(j, buf):
                q_head, batch, tile_start, _, _ = tile_of(j)
                row0, rows, vec = rows_of(q_head, batch, tile_start)
                srcs = [q_ref.at[rows], do_ref.at[rows], lse_ref.at[vec], delta_ref.at[vec]]
                if st.packed_users:
                    srcs.append(keys_ref.at[batch, :, pl.ds(row0, b)])
                for src, dst, bar in zip(srcs, fixed_of(buf)[:fields], fixed_ready, strict=True):
                    plgpu.copy_gmem_to_smem(src, dst, bar.at[buf * COMPUTE_WGS + wg])

            @pl.when(my_tiles > 0)
            def _first():
                issue_fixed(0, 0)

            def walk(j, base):
                buf = lax.rem(j, jnp.int32(2))
                q_head, batch, tile_start, ranges, one_user = tile_of(j)
                row0, rows, _ = rows_of(q_head, batch, tile_start)
                total_steps = ranges.total_steps
                for bar in fixed_ready:
                    plgpu.barrier_wait(bar.at[buf * COMPUTE_WGS + wg])

                @pl.when(j + 1 < my_tiles)
                def _prefetch():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # tile j-1's dQ store
                    issue_fixed(j + 1, 1 - buf)

                fixed = fixed_of(buf)
                dq = _dq_tile(
                    st, dtype, in_place, fixed, ring, staging, ranges, total_steps, one_user,
                    row0, wg, slot_of=lambda i: lax.rem(base + i, jnp.int32(num_slots)),
                )  # fmt: skip
                fixed.q[...] = (dq * st.sm_scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(fixed.q, dq_ref.at[rows])
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
                        plgpu.barrier_wait(consumed.at[slot])

                    _issue_kv(k_ref, v_ref, ring, batch, ranges.block_at(i), kv_head, slot)

                return ranges.total_steps, issue

            total = ring_walk(my_tiles, num_slots, tile_steps)

            @pl.loop(jnp.maximum(total - num_slots, 0), total)
            def _drain(step):
                plgpu.barrier_wait(consumed.at[lax.rem(step, jnp.int32(num_slots))])

    return _dq_entry(kernel, st, dtype, in_place=in_place, fixed_copies=2)


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


def _dkv_memory_wg(st: _Static, refs, scoped, batch, kv_head, ranges, steps, compute_registers):
    """The dk/dv kernel's memory WG: the ring of query-side blocks (Q, LSE, dO, delta')
    over the group's query heads: ``steps = (head_steps, total_steps)``."""
    q_ref, _, _, do_ref, lse_ref, delta_ref = refs[:6]
    bufs, _, ready, consumed = scoped
    q_smem, do_smem, lse_smem, delta_smem = bufs[2:6]
    q_ready, do_ready, lse_ready, delta_ready = ready
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
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem.at[slot], lse_ready.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem.at[slot], delta_ready.at[slot])

    _ring_loads(st.num_stages, total_steps, issue, consumed)


def _build_dkv_kernel(st: _Static, dtype, *, in_place: bool):
    b = BLOCK
    num_slots = st.num_stages
    group = st.group_size
    per_step_kv = _dkv_per_step_kv(st)
    compute_registers = MAX_COMPUTE_REGISTERS if per_step_kv else COMPUTE_REGISTERS

    def kernel(
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref, steps_ref, queries_ref,
        dk_ref, dv_ref, scoped,
    ):  # fmt: skip
        bufs, fixed_ready, ready, consumed = scoped
        k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, p_smem2, ds_smem2 = bufs[:8]
        queries_smem2 = bufs[8]
        q_ready, do_ready, lse_ready, delta_ready = ready
        batch = lax.axis_index(_axes.BATCH)
        kv_head = lax.axis_index(_axes.HEADS)
        wg = lax.axis_index(_axes.WARPGROUP)
        tile_start, ranges, one_user = _tile_steps(
            st, bounds_ref, steps_ref, batch, _axes.KV_TILES, ranker_q_block_ranges
        )
        if one_user is not None:
            hl, hu, cl, cu = one_user
        head_steps = ranges.total_steps  # steps per query head of the group
        total_steps = group * head_steps

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(compute_registers, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            if per_step_kv:
                # 0 at run time (bounds are clipped to [0, S]), unknown to the compiler.
                raw = bounds_ref[batch, 0] if not st.packed_users else bounds_ref[batch, 0, 0]
                opaque_zero = lax.shift_right_logical(raw, jnp.int32(31))
            kv0 = tile_start + wg * b
            kv_rows = (batch, pl.ds(kv0, b), kv_head)
            srcs, dsts = [k_ref.at[kv_rows], v_ref.at[kv_rows]], [k_smem, v_smem]
            if st.packed_users:  # the keys' packed_key_table entries
                srcs.append(queries_ref.at[batch, :, pl.ds(kv0, b)])
                dsts.append(queries_smem2.at[wg])
            _load_fixed(srcs, dsts, fixed_ready, wg)
            if st.packed_users:
                key_queries = _row_entries(queries_smem2.at[wg], PACKED_KEY_FIELDS)
            if st.packed_users:
                full_lo, full_hi = ranges.full_steps(wg)
            else:
                full_lo, full_hi = ranker_full_q_steps(ranges, hl, hu, cl, cu, kv0, kv0 + b, b)
            staging = None if in_place else (p_smem2.at[wg], ds_smem2.at[wg])
            layout = plgpu.Layout.WGMMA
            kv_ids = kv0 + plgpu.broadcasted_iota(jnp.int32, (b, b), 0, layout=layout)

            def step(i, carry, *, head, masked):
                dk, dv = carry
                slot = lax.rem(head * head_steps + i, jnp.int32(num_slots))
                for bar in (q_ready, lse_ready, do_ready, delta_ready):
                    plgpu.barrier_wait(bar.at[slot])
                lse2 = plgpu.load(lse_smem.at[slot], layout=layout.reduce(0))
                delta = plgpu.load(delta_smem.at[slot], layout=layout.reduce(0))
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
                    k_fixed, v_fixed = k_smem2.at[own], v_smem2.at[own]
                operands = (k_fixed, q_smem.at[slot], v_fixed, do_smem.at[slot])
                p_t, factor = _p_and_grad_factor(operands, lse2, delta, mask_fn, st, 1)
                dk, dv = _dkv_update(
                    dk, dv, p_t, factor, q_smem.at[slot], do_smem.at[slot], staging, st,
                    in_place, dtype,
                )  # fmt: skip
                plgpu.barrier_arrive(consumed.at[slot])
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
                st, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), scoped, batch, kv_head,
                ranges, (head_steps, total_steps), compute_registers,
            )
        )  # fmt: skip

    def entry(*refs):
        # Inputs q, k, v, dO, lse2, delta', bounds (+ the step list and the key query
        # table for packed rows), then dK, dV.
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref = refs[:7]
        steps_ref, queries_ref = refs[7:9] if st.packed_users else (None, None)
        dk_ref, dv_ref = refs[-2:]
        t = tile_transforms()
        own = plgpu.SMEM((COMPUTE_WGS, b, st.head_dim), dtype, transforms=t)
        ring = plgpu.SMEM((num_slots, b, st.head_dim), dtype, transforms=t)
        ring_vec = plgpu.SMEM((num_slots, b), jnp.float32)
        staging = None if in_place else plgpu.SMEM((COMPUTE_WGS, b, b), dtype, transforms=t)
        queries = None
        if st.packed_users:
            queries = plgpu.SMEM((COMPUTE_WGS, PACKED_KEY_FIELDS, b), jnp.int32)
        operands = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref)
        pl.run_scoped(
            lambda *args: kernel(*operands, steps_ref, queries_ref, dk_ref, dv_ref, args),
            [own, own, ring, ring, ring_vec, ring_vec, staging, staging, queries],
            (plgpu.Barrier(num_barriers=COMPUTE_WGS),) * (3 if st.packed_users else 2),
            (plgpu.Barrier(num_barriers=num_slots),) * 4,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=num_slots),
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
    keeps the defaults).
    """
    knobs = {"num_stages": pipelined_stages(st_fields["head_dim"]), **(tuning or {})}
    check_backward_knobs(knobs, st_fields["cap"])
    need = pipelined_smem_bytes(
        st_fields["head_dim"], q.dtype, interpret=interpret is not None,
        num_stages=knobs["num_stages"], dq_programs=knobs.get("dq_programs", 0),
        packed=bool(users),
    )  # fmt: skip
    for kernel, size in need.items():
        if size > SMEM_LIMIT_BYTES:
            raise ValueError(
                f"backward tuning {knobs}: the {kernel} kernel needs {size} bytes of shared "
                f"memory, more than the {SMEM_LIMIT_BYTES} available per block on sm_90"
            )
    st = _Static(**st_fields, **knobs, interpret=interpret is not None, packed_users=users)
    return _pipelined_bwd(q, k, v, do, lse2, delta, bounds, st=st, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def _pipelined_bwd(q, k, v, do, lse2, delta, bounds, *, st: _Static, interpret):
    in_place = interpret is None
    tiles = st.seq_pad // (COMPUTE_WGS * BLOCK)
    common = dict(
        num_threads=COMPUTE_WGS + 1,
        thread_name=_axes.WARPGROUP,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
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
        build_dq(st, q.dtype, in_place=in_place),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        **dq_grid,
        kernel_name=DQ_KERNEL,
        **common,
    )(*dq_in)
    dk, dv = plgpu.kernel(
        _build_dkv_kernel(st, q.dtype, in_place=in_place),
        out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(st.kv_heads, tiles, st.batch),
        grid_names=(_axes.HEADS, _axes.KV_TILES, _axes.BATCH),
        kernel_name=DKV_KERNEL,
        **common,
    )(*dkv_in)
    return dq, dk, dv
