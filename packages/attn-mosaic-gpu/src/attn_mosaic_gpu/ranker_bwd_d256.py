"""Ranker attention backward for Hopper at D = 256: simple dq and dk/dv kernels.

For D = 256 the f32 dK and dV accumulators of two 64-row warpgroups do not fit the
register file next to the pipelined kernels' shared memory (``ranker_bwd_pipelined``
runs D 64 and 128), so ``ranker_bwd.ranker_attention_bwd`` runs these: one warpgroup
per program, head dim of the outputs split in halves. They are correct but slower.

Schedule of the simple D = 256 kernels (one warpgroup per program, no warp
specialization, no prefetch, fixed 64x64 blocks, every wgmma operand staged in shared
memory):

* ``dq`` kernel, grid ``(Hq, (S / block_q) * d_split, B)``: a program owns ``block_q``
  query rows of one (batch row, query head) and, for ``D = 256``, one of ``d_split = 2``
  halves of the head dim of dQ (``S`` and ``dP`` are recomputed per half; the half of K
  that dQ needs is TMA-loaded separately). It TMA-loads Q, dO, lse and delta' once, then walks the
  KV blocks of ``attn_common.bounds.ranker_kv_block_ranges`` (the forward's visit-once rule):
  per step it TMA-loads K and V, computes ``S = Q K^T`` and ``dP = dO V^T`` by wgmma,
  the cap, the mask (``attn_common.ranker_mask`` on the tile iotas, on every step), P and
  dS, writes dS to shared memory and accumulates ``dQ += dS K`` (a fresh accumulator
  added in registers).
* ``dk/dv`` kernel, grid ``(Hkv, (S / block_kv) * d_split, B)``: a program owns
  ``block_kv`` keys of one (batch row, kv head) and, for ``D = 256``, one of the
  ``d_split = 2`` halves of the head dim of dK/dV (so the f32 accumulators and the
  fresh wgmma results added to them fit the register file; ``S^T`` and ``dP^T`` are
  recomputed per half). It loads K and V once,
  loops over the group's query heads and, for each, over the query blocks of
  ``attn_common.bounds.ranker_q_block_ranges``: ``S^T = K Q^T``, ``dP^T = V dO^T``, P^T and
  dS^T to shared memory, ``dV += P^T dO``, ``dK += dS^T Q``. dK/dV accumulate in f32
  registers across the group's heads and blocks in a fixed order: GQA gradients are per
  kv head, with no per-query-head copies and no atomics, so the result is deterministic
  (bitwise identical on repeated runs).

Every program writes its whole output tile (zeros when it has no step), so padding rows
and keys nobody attends get exactly 0. Rows with no allowed key have ``lse = -inf``; the
wrapper passes ``+inf`` for them instead (``exp2(y - inf) = 0``, never ``-inf - -inf``)
and zeroes their LSE cotangent, so their gradient is 0, never NaN. The cap derivative is
taken from the unmasked capped logits, so masked entries never see ``0 * inf``.

Synchronisation: each TMA load has its own barrier, waited right after it is issued (no
prefetch ring); a warpgroup barrier (``commit_smem``, which is also the proxy fence
needed after writing P / dS to shared memory) precedes every reuse of a buffer the
previous wgmma read. The interpret-mode path is the GPU path: no ``run_state``, no wgmma
with a register A operand.

Any ``S``: inputs are zero-padded to a multiple of the block size and the gradients
sliced; padded positions are never allowed because bounds are clipped to ``[0, S]``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common import cap_forward, ranker_mask
from attn_common.bounds import ranker_kv_block_ranges, ranker_q_block_ranges
from attn_common.cap import cap_derivative_from_output
from attn_common.ranker import RankerKernelStatic
from attn_mosaic_gpu import _axes
from attn_mosaic_gpu._interpret import Target
from attn_mosaic_gpu._smem import tile_transforms
from attn_mosaic_gpu.fastmath import LOG2E
from attn_mosaic_gpu.ranker_config import (
    BLOCK,
    BwdRefs,
    D256Dkv,
    D256Dq,
    head_dim_parts,
    simple_smem_bytes,
)

__all__ = ["BWD_BLOCK", "BwdStatic", "d256_bwd", "head_dim_parts", "simple_smem_bytes"]

BWD_BLOCK = BLOCK  # the query and key block of both kernels (ranker_config.BLOCK)


@dataclasses.dataclass(frozen=True)
class BwdStatic(RankerKernelStatic):
    """The D=256 kernels' static facts: the padded problem (no tiling knobs)."""

    @property
    def d_split(self) -> int:
        """Parts the head dimension is split into for the dq / dk, dv accumulators."""
        return head_dim_parts(self.head_dim)

    @property
    def dh(self) -> int:
        """Columns of one part: ``head_dim // d_split``."""
        return self.head_dim // self.d_split


def _probs_and_dlogits(y, dcap, dp, allowed, lse2, delta, *, row_axis: int):
    """``P`` and ``dS`` of a score tile from its capped logits ``y``, ``cap'(y)``
    (``dcap``, None without a cap), ``dP`` and the mask; ``lse2`` (base-2 LSE) and
    ``delta`` are per query row, the tile's axis ``row_axis`` (1 for a transposed tile)."""
    y2 = jnp.where(allowed, y * LOG2E, -jnp.inf)
    p = jnp.exp2(y2 - lax.broadcast_in_dim(lse2, y.shape, [row_axis]))
    ds = p * (dp - lax.broadcast_in_dim(delta, y.shape, [row_axis]))
    if dcap is not None:
        ds = ds * dcap
    return p, ds


def _wgmma(a, b, shape):
    """``a @ b`` (shared-memory operands; a transposed view is fine) into a fresh float32
    WGMMA accumulator of ``shape``, returned as a value."""

    def fn(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(fn, plgpu.ACC(shape, jnp.float32))


def _logits(qk, st: BwdStatic):
    """Capped logits ``y`` (natural units) and ``cap'(y)`` (None without a cap)."""
    s = qk * st.sm_scale
    if not st.cap.active:
        return s, None
    y = cap_forward(s, st.cap)
    return y, cap_derivative_from_output(y, st.cap)


def _read_bounds(bounds_ref, batch):
    return tuple(bounds_ref[batch, i] for i in range(4))


def _entry(kernel, st: BwdStatic, dtype, *, halves: int, squares: int, barriers):
    """The entry of both kernels: their inputs (``BwdRefs``), outputs, and scratch: four
    ``[64, D]`` tiles, ``halves`` ``[64, D / 2]`` ones when the head dim is split,
    ``squares`` ``[64, 64]`` ones and two ``[64]`` f32 vectors, and the ``barriers``
    (``D256Dq`` / ``D256Dkv``) as one array."""
    b, t = BWD_BLOCK, tile_transforms()

    def entry(*refs):
        tile = plgpu.SMEM((b, st.head_dim), dtype, transforms=t)
        half = plgpu.SMEM((b, st.dh), dtype, transforms=t) if st.d_split > 1 else None
        sq = plgpu.SMEM((b, b), dtype, transforms=t)
        vec = plgpu.SMEM((b,), jnp.float32)
        pl.run_scoped(
            lambda *args: kernel(BwdRefs(*refs[:7]), *refs[7:], args),
            [tile] * 4 + [half] * halves + [sq] * squares + [vec, vec],
            plgpu.Barrier(num_barriers=len(barriers)),
        )

    return entry


def _build_dq_kernel(st: BwdStatic, dtype):
    bq = bkv = BWD_BLOCK
    group, d_split, dh = st.group_size, st.d_split, st.dh

    def kernel(
        ins: BwdRefs,  # inputs (global memory; one user per row)
        dq_ref,  # output: [B, S_pad, Hq, D]
        # scratch (shared memory): buffers (Q, dO, K, V [64, D]; K's half [64, D / 2] or
        # None; dS [64, 64]; lse2, delta' [64] f32) and the D256Dq barriers
        scoped,
    ):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref = ins[:7]
        (q_smem, do_smem, k_smem, v_smem, kh_smem, ds_smem, lse_smem, delta_smem), bars = scoped
        batch = lax.axis_index(_axes.BATCH)
        q_head = lax.axis_index(_axes.HEADS)
        idx = lax.axis_index(_axes.Q_TILES)
        q_tile = lax.div(idx, jnp.int32(d_split))
        d0 = lax.rem(idx, jnp.int32(d_split)) * dh
        kv_head = lax.div(q_head, jnp.int32(group))
        hl, hu, cl, cu = _read_bounds(bounds_ref, batch)
        row0 = q_tile * bq
        ranges = ranker_kv_block_ranges(hl, hu, cl, cu, row0, row0 + bq, bkv)
        steps = ranges.total_steps

        rows = (batch, pl.ds(row0, bq), q_head)
        vec = (batch, q_head, pl.ds(row0, bq))
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, bars.at[D256Dq.Q_LANDED])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, bars.at[D256Dq.DO_LANDED])
        plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem, bars.at[D256Dq.LSE_LANDED])
        plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem, bars.at[D256Dq.DELTA_LANDED])
        for landed in list(D256Dq)[:4]:
            plgpu.barrier_wait(bars.at[landed])
        lse2 = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(1))
        delta = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(1))

        def step(i, dq_acc):
            kv0 = ranges.block_at(i) * bkv
            kv_rows = (batch, pl.ds(kv0, bkv), kv_head)
            plgpu.commit_smem()  # every thread is done with the previous step's K/V/dS
            plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, bars.at[D256Dq.K_LANDED])
            plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, bars.at[D256Dq.V_LANDED])
            if d_split > 1:
                kv_half = (batch, pl.ds(kv0, bkv), kv_head, pl.ds(d0, dh))
                plgpu.copy_gmem_to_smem(k_ref.at[kv_half], kh_smem, bars.at[D256Dq.K_HALF_LANDED])
                plgpu.barrier_wait(bars.at[D256Dq.K_HALF_LANDED])
            plgpu.barrier_wait(bars.at[D256Dq.K_LANDED])
            plgpu.barrier_wait(bars.at[D256Dq.V_LANDED])

            qk = _wgmma(q_smem, k_smem.transpose((1, 0)), (bq, bkv))
            dp = _wgmma(do_smem, v_smem.transpose((1, 0)), (bq, bkv))
            y, dcap = _logits(qk, st)
            q_ids = row0 + plgpu.broadcasted_iota(
                jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA
            )
            kv_ids = kv0 + plgpu.broadcasted_iota(
                jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA
            )
            allowed = ranker_mask(q_ids, kv_ids, hl, hu, cl, cu)
            _, ds = _probs_and_dlogits(y, dcap, dp, allowed, lse2, delta, row_axis=0)
            ds_smem[...] = ds.astype(dtype)
            plgpu.commit_smem()

            k_b = kh_smem if d_split > 1 else k_smem

            return dq_acc + _wgmma(ds_smem, k_b, (bq, dh))

        dq0 = plgpu.layout_cast(jnp.full((bq, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        dq = lax.fori_loop(0, steps, step, dq0)
        out_smem = kh_smem if d_split > 1 else q_smem
        plgpu.commit_smem()  # every wgmma that read the staging buffer has completed
        out_smem[...] = (dq * st.sm_scale).astype(dtype)
        plgpu.commit_smem()
        dst = (batch, pl.ds(row0, bq), q_head, pl.ds(d0, dh)) if d_split > 1 else rows
        plgpu.copy_smem_to_gmem(out_smem, dq_ref.at[dst])
        plgpu.wait_smem_to_gmem(0)

    return _entry(kernel, st, dtype, halves=1, squares=1, barriers=D256Dq)


def _build_dkv_kernel(st: BwdStatic, dtype):
    bq = bkv = BWD_BLOCK
    group, d_split, dh = st.group_size, st.d_split, st.dh

    def kernel(
        ins: BwdRefs,  # inputs (global memory; one user per row)
        dk_ref,  # output: [B, S_pad, Hkv, D]
        dv_ref,  # output: [B, S_pad, Hkv, D]
        # scratch (shared memory): buffers (K, V, Q, dO [64, D]; Q's and dO's halves
        # [64, D / 2] or None; P^T, dS^T [64, 64]; lse2, delta' [64] f32) and the
        # D256Dkv barriers
        scoped,
    ):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref = ins[:7]
        bufs, bars = scoped
        k_smem, v_smem, q_smem, do_smem, qh_smem, doh_smem, p_smem, ds_smem = bufs[:8]
        lse_smem, delta_smem = bufs[8:]
        batch = lax.axis_index(_axes.BATCH)
        kv_head = lax.axis_index(_axes.HEADS)
        idx = lax.axis_index(_axes.KV_TILES)
        kv_tile = lax.div(idx, jnp.int32(d_split))
        part = lax.rem(idx, jnp.int32(d_split))
        d0 = part * dh
        hl, hu, cl, cu = _read_bounds(bounds_ref, batch)
        kv0 = kv_tile * bkv
        ranges = ranker_q_block_ranges(hl, hu, cl, cu, kv0, kv0 + bkv, bq)
        steps = ranges.total_steps

        kv_rows = (batch, pl.ds(kv0, bkv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, bars.at[D256Dkv.K_LANDED])
        plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, bars.at[D256Dkv.V_LANDED])
        plgpu.barrier_wait(bars.at[D256Dkv.K_LANDED])
        plgpu.barrier_wait(bars.at[D256Dkv.V_LANDED])
        kv_ids = kv0 + plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 0, layout=plgpu.Layout.WGMMA)

        def q_step(i, carry, q_head):
            dk_acc, dv_acc = carry
            q0 = ranges.block_at(i) * bq
            rows = (batch, pl.ds(q0, bq), q_head)
            vec = (batch, q_head, pl.ds(q0, bq))
            plgpu.commit_smem()  # every thread is done with the previous step's buffers
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, bars.at[D256Dkv.Q_LANDED])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, bars.at[D256Dkv.DO_LANDED])
            plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem, bars.at[D256Dkv.LSE_LANDED])
            plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem, bars.at[D256Dkv.DELTA_LANDED])
            if d_split > 1:
                half = (batch, pl.ds(q0, bq), q_head, pl.ds(d0, dh))
                plgpu.copy_gmem_to_smem(q_ref.at[half], qh_smem, bars.at[D256Dkv.Q_HALF_LANDED])
                plgpu.copy_gmem_to_smem(do_ref.at[half], doh_smem, bars.at[D256Dkv.DO_HALF_LANDED])
            for landed in list(D256Dkv)[2 : 8 if d_split > 1 else 6]:
                plgpu.barrier_wait(bars.at[landed])
            lse2 = plgpu.load(lse_smem, layout=plgpu.Layout.WGMMA.reduce(0))
            delta = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(0))

            s_t = _wgmma(k_smem, q_smem.transpose((1, 0)), (bkv, bq))
            dp_t = _wgmma(v_smem, do_smem.transpose((1, 0)), (bkv, bq))
            y, dcap = _logits(s_t, st)
            q_ids = q0 + plgpu.broadcasted_iota(jnp.int32, (bkv, bq), 1, layout=plgpu.Layout.WGMMA)
            allowed = ranker_mask(q_ids, kv_ids, hl, hu, cl, cu)
            p_t, ds_t = _probs_and_dlogits(y, dcap, dp_t, allowed, lse2, delta, row_axis=1)
            p_smem[...] = p_t.astype(dtype)
            ds_smem[...] = ds_t.astype(dtype)
            plgpu.commit_smem()
            q_b = qh_smem if d_split > 1 else q_smem
            do_b = doh_smem if d_split > 1 else do_smem

            dv_acc = dv_acc + _wgmma(p_smem, do_b, (bkv, dh))
            dk_acc = dk_acc + _wgmma(ds_smem, q_b, (bkv, dh))
            return dk_acc, dv_acc

        def head_loop(hh, carry):
            q_head = kv_head * group + hh
            return lax.fori_loop(0, steps, functools.partial(q_step, q_head=q_head), carry)

        zeros = plgpu.layout_cast(jnp.full((bkv, dh), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        dk, dv = lax.fori_loop(0, group, head_loop, (zeros, zeros))
        out_k = qh_smem if d_split > 1 else q_smem
        out_v = doh_smem if d_split > 1 else do_smem
        plgpu.commit_smem()  # every wgmma that read the staging buffers has completed
        out_k[...] = (dk * st.sm_scale).astype(dtype)
        out_v[...] = dv.astype(dtype)
        plgpu.commit_smem()
        dst = (batch, pl.ds(kv0, bkv), kv_head, pl.ds(d0, dh)) if d_split > 1 else kv_rows
        plgpu.copy_smem_to_gmem(out_k, dk_ref.at[dst])
        plgpu.copy_smem_to_gmem(out_v, dv_ref.at[dst])
        plgpu.wait_smem_to_gmem(0)

    return _entry(kernel, st, dtype, halves=2, squares=2, barriers=D256Dkv)


@functools.partial(jax.jit, static_argnames=("st", "target"))
def d256_bwd(q, k, v, do, lse2, delta, bounds, *, st: BwdStatic, target: Target):
    """The D = 256 dq and dk/dv kernels on padded inputs; ``lse2`` base-2 LSE (``+inf`` on empty rows), ``delta`` = delta'."""
    b = BWD_BLOCK
    dq = plgpu.kernel(
        _build_dq_kernel(st, q.dtype),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(st.q_heads, (st.seq_pad // b) * head_dim_parts(st.head_dim), st.batch),
        grid_names=(_axes.HEADS, _axes.Q_TILES, _axes.BATCH),
        interpret=target.params,
    )(q, k, v, do, lse2, delta, bounds)
    dk, dv = plgpu.kernel(
        _build_dkv_kernel(st, q.dtype),
        out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(st.kv_heads, (st.seq_pad // b) * head_dim_parts(st.head_dim), st.batch),
        grid_names=(_axes.HEADS, _axes.KV_TILES, _axes.BATCH),
        interpret=target.params,
    )(q, k, v, do, lse2, delta, bounds)
    return dq, dk, dv
