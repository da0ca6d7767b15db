"""Sparse MLA backward on Hopper (sm_90a): ``dq`` and the store's key gradient in one
pass over each query's row table.

Op: the gradient of ``sparse_mla_kernel.sparse_mla_rows_attention`` from its saved
``lse`` and the output's cotangent ``dO``. For query token ``n``, head ``h`` and its rows
``rows[n, :counts[n]]`` (keys ``K``, values ``V = K[:, :Dv]``)::

    P  = exp(s Q K^T - lse)            dP = dO V^T          dS = s P (dP - delta)
    dq = dS K                          dkeys[rows] += dS^T Q + [P^T dO, 0]

``delta = rowsum(dO * out) - dlse`` comes from outside (XLA), as the LSE in base 2.
``dq [N, Hp, Dk]`` float32 is written (bitwise reproducible). The key gradient, two ways:

* atomics (the default): ``dkeys [R, Dk]`` float32 is a zero-initialised mutable array
  (``jax.new_ref``) every program adds its rows' contributions to with
  ``red.global.add.v4.f32`` straight from the registers; the sums over queries are not
  bitwise reproducible (float addition order);
* ``deterministic``: the same instructions store (``st.global.v4.f32``) each (head
  group, token, slot)'s row to parts ``[G, N, Kp, Dk]``, which
  ``fixed_order_sum.segment_sum_fixed_order`` sums per row id in a fixed order (dense
  gathers and reductions, no atomics); tokens go in chunks whose parts fit
  ``PARTS_BYTES``. Interpret mode always takes this path (the interpreter runs no
  atomics).

Schedule (``sparse_mla_config`` has every size, buffer and barrier)
--------
One program per (query token, group of 64 heads), in the forward's lagged launch order
(``lagged_program``: a token's head groups a few programs apart, the later ones finding
its rows in L2). Three warpgroups: WG0 and WG1 compute, WG2 gathers. Registers
232 / 232 / 40.

Shared memory (``BackwardBuffers``, 224 KiB of the 227): Q (72 KiB: 512 latent and 64
rope features) and ``dO`` (64 KiB), loaded once by TMA with ``lse2`` and ``delta``
(``inputs_landed``); one block of 64 rows (72 KiB, gathered as the forward's parts ``L``
and ``R`` with their own ``part_landed`` barriers); ``P`` and ``dS`` of the block in bf16
(8 KiB each).

Per block ``b`` (``ceil(counts[n] / 64)`` of them, the columns past the count masked on
the last):

* WG2 waits until both compute WGs have released block ``b - 1`` (``block_free``:
  their ``dq`` products with it have landed), then gathers block ``b`` by ``cp.async``
  (the forward's ``gather_part``: zero-filled past the count, ``noinc`` arrivals on
  ``part_landed``).
* WG0: ``S = Q K^T``; ``P = exp2(S s log2e - lse2)``, zero past the count; once WG1 has
  finished with the previous ``P`` (``p_free``) it stores ``P`` as bf16 and arrives
  ``p_ready``. WG1: ``dP = dO V^T``; waits ``p_ready``; once WG0 has finished with the
  previous ``dS`` (``ds_free``) it stores ``dS = s P (dP - delta)`` as bf16 and arrives
  ``ds_ready``. (``P`` reaches WG1 rounded to bf16, as it reaches the value product.)
* Both, after ``ds_ready``: ``dq += dS K`` over their own columns (WG0 latent 0-255 and
  the rope features, WG1 latent 256-511), wait for it and release the block
  (``block_free``): WG2 gathers the next block while they finish this one.
* Both: the key gradient of their columns, 64 at a time: ``acc = dS^T Q[:, c] + P^T
  dO[:, c]`` (A operands read transposed from shared memory), then each thread adds its
  accumulator to ``dkeys[rows[b * 64 + r], c]`` (or stores it to the parts), 16 bytes
  per instruction after a shuffle within each quad of lanes, so that a quad adds 64
  contiguous bytes of a row (``_red_global``; rows with id ``< 0`` skipped; the block's
  ids are loaded into registers as the block starts); WG0 then arrives ``ds_free``, WG1
  ``p_free``.

Invariants: every barrier gets one arrival and one wait per block, and no WG writes a
buffer before a wait that the other WG's last read of it precedes; each WG drains the
other's last release before the barriers are freed. At the end each WG stores its ``dq``
columns.

Interpret mode (``interpret=True``) runs the same schedule and barriers
(``_interpret.Target``); the interpreter runs no inline Mosaic GPU code, so rows are
gathered by plain loads and stores and published on ``part_ready``, and the key
gradient is stored to the parts (the deterministic path: it runs no atomics).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_mosaic_gpu import _axes
from attn_mosaic_gpu._compat import fragmented_array
from attn_mosaic_gpu._interpret import Target, resolve_target, store_key_rows
from attn_mosaic_gpu._registers import memory_registers
from attn_mosaic_gpu._sparse_mla_rows import lagged_program, launch_args, parts_of
from attn_mosaic_gpu.fastmath import LOG2E
from attn_mosaic_gpu.fixed_order_sum import segment_sum_fixed_order
from attn_mosaic_gpu.sparse_mla_config import (
    BLOCK_K,
    CHUNK,
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    HEADS_PER_PROGRAM,
    KV_CHUNK,
    PARTS_BYTES,
    ROPE,
    TOKEN_LAG,
    BackwardBarriers,
    BackwardBuffers,
    Part,
    backward_scratch,
    unsupported_dv,
)

__all__ = ["sparse_mla_rows_backward"]

KERNEL_NAME = "sparse_mla_backward"  # how the kernel shows in HLO and profiles
_AXIS_PROGRAM = _axes.PROGRAMS
_AXIS_WG = _axes.WARPGROUP
_PARTS = (Part.L0, Part.R0)  # the one block's two parts (the forward's block 0)


@dataclasses.dataclass(frozen=True)
class _BwdStatics:
    """The static facts one backward build is specialised on."""

    tokens: int
    heads: int  # padded to a multiple of 64
    dv: int
    width: int  # store row width (elements)
    sm_scale: float
    deterministic: bool  # per-slot parts stored, summed in a fixed order outside


@dataclasses.dataclass(frozen=True)
class _Program:
    st: _BwdStatics
    target: Target
    parts: Any  # how the key parts land: _sparse_mla_rows.Parts (compiled) or the interpreter's
    store: Any
    rows_ref: Any  # [N, Kp] int32
    dq_ref: Any  # [N, Hp, Dk] f32
    dkeys_ref: Any  # [R, Dk] f32, accumulated; or the parts [G, N, Kp, Dk] (see _red_rows)
    buf: BackwardBuffers
    bar: BackwardBarriers
    wg: Any
    token: Any
    h0: Any
    count: Any
    num_blocks: Any

    def block_rows(self, b):
        return self.rows_ref.at[self.token, pl.ds(b * BLOCK_K, BLOCK_K)]


# ------------------------------------------------------------------------------------
# Products (``Target.product``, ``Target.accumulate``).


def _issue(pairs):
    def issue(acc_ref):
        for a, b in pairs:
            plgpu.wgmma(acc_ref, a, b)

    return issue


def _product(prog: _Program, acc_ref, shape, pairs):
    """``sum(a @ b for a, b in pairs)`` as a float32 value of ``shape``, waited for."""
    return prog.target.product(acc_ref, shape, _issue(pairs))


def _accumulate(prog: _Program, acc, pairs):
    """``acc + sum(a @ b)``, waited for (``acc`` an ACC ref compiled, a value
    interpreted)."""
    return prog.target.accumulate(acc, _issue(pairs))


# ------------------------------------------------------------------------------------
# The key gradient's adds into global memory.


def _red_rows(prog: _Program, acc, ids, b, col0: int):
    """Add ``acc [64 rows, 64 cols]`` (the WGMMA layout) to ``dkeys[rows[b*64 + r],
    col0:col0 + 64]``; rows with id ``< 0`` are skipped. Deterministic: store it
    instead to the parts ``[G, N, Kp, Dk]`` at (head group, token, slot ``b*64 + r``),
    summed outside in a fixed order."""
    group = prog.h0 // HEADS_PER_PROGRAM
    slots = pl.ds(b * BLOCK_K, BLOCK_K)
    if prog.st.deterministic:
        parts = prog.dkeys_ref.at[group, prog.token, slots]
        prog.target.pick(_store_key_rows, store_key_rows)(acc, ids, parts, col0)
    else:
        _red_global(prog.dkeys_ref.shape[1], col0)(acc, ids, prog.dkeys_ref)


def _row_ids(prog: _Program, b):
    """Block ``b``'s row ids in the registers (``[64, 8]`` int32, the WGMMA layout: each
    thread its rows ``r`` and ``r + 8``), loaded from global memory as the block starts
    so that the loads' latency is hidden behind its products (loaded at every add, they
    stalled each chunk's adds). ``None`` interpreted (its stores take no ids)."""
    return prog.target.pick(lambda: _load_row_ids()(prog.block_rows(b)), lambda: None)()


def _load_row_ids():
    from jax.experimental.mosaic import gpu as mgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref, vector

    shape = (BLOCK_K, 8)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct(shape, jnp.int32, layout=plgpu.Layout.WGMMA),
    )
    def load(ctx, rows):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        ids = mgpu.FragmentedArray.splat(
            arith.constant(i32, 0), shape, mgpu.WGMMA_LAYOUT, is_signed=True
        )
        regs = ids.registers.copy()
        for k, (r, _) in enumerate(ids.layout.thread_idxs(shape)):
            row = memref.load(rows, [r])
            regs.flat[k] = vector.broadcast(regs.flat[k].type, row)
        return fragmented_array(regs, ids.layout, is_signed=True)

    return load


def _store_key_rows(acc, ids, parts, col0: int) -> None:
    _red_global(parts.shape[1], col0, store=True)(acc, ids, parts)


def _red_global(width: int, col0: int, *, store: bool = False):
    """Inline Mosaic GPU: add the accumulator ``[64, 64]`` to global memory, 16 bytes per
    ``red.global.add.v4.f32``, a quad of lanes 64 contiguous bytes of a row (``store``:
    ``st.global.v4.f32`` to row ``r`` of a ``[64, width]`` block instead). In the
    WGMMA layout the 4 lanes of a quad hold rows ``r`` and ``r + 8``, lane ``q`` columns
    ``8 j + 2 q`` and ``+ 1`` of each 8-column group ``j``. Shuffled within the quad
    (``shfl.idx``, 8 per add), lane ``q`` adds columns ``16 s + 4 q .. + 3`` of each
    16-column segment ``s``: group ``2 s + q // 2``'s pairs from lanes ``2 (q % 2)`` and
    ``2 (q % 2) + 1``: a quad writes 64 contiguous bytes of a row per instruction
    (docs/experiments.md has the layouts measured against it)."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, llvm

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA, plgpu.RefType()),
    )
    def red(ctx, acc, ids, dkeys):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        f32 = ir.F32Type.get()
        op = "st.global.v4.f32" if store else "red.global.add.v4.f32"

        def const(v, ty=i32):
            return arith.constant(ty, v)

        base = llvm.addrspacecast(
            llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(dkeys)
        )
        lane = arith.remui(mgpu_utils.thread_idx(), const(32))
        q = arith.andi(lane, const(3))
        quad = arith.subi(lane, q)
        # Lane q of a quad adds columns 16 s + 4 q .. + 3 of row r (then r + 8): the
        # pairs of group 2 s + q // 2 held by lanes 2 (q % 2) and 2 (q % 2) + 1.
        src0 = arith.addi(quad, arith.muli(arith.andi(q, const(1)), const(2)))
        src1 = arith.addi(src0, const(1))
        upper = arith.cmpi(arith.CmpIPredicate.uge, q, const(2))
        col_q = arith.muli(q, const(4))
        regs = list(zip(acc.layout.thread_idxs(acc.shape), acc.registers.flat, strict=True))
        groups = acc.shape[1] // 8

        def shfl(x, src):
            return gpu.shuffle(x, src, const(32), gpu.ShuffleMode.IDX)[0]

        for h in (0, 1):  # row r, then row r + 8 (flat order: per group, r then r + 8)
            (r, _), _ = regs[h]
            row = llvm.extractelement(ids.registers.flat[h], const(0))
            valid = arith.cmpi(arith.CmpIPredicate.sge, row, const(0))
            dest = arith.index_cast(i32, r) if store else arith.select(valid, row, const(0))
            row_off = arith.muli(arith.extui(i64, dest), const(width, i64))
            for seg in range(groups // 2):
                halves = []
                for j in (2 * seg, 2 * seg + 1):
                    v = regs[2 * j + h][1]
                    x, y = (llvm.extractelement(v, const(k)) for k in (0, 1))
                    halves.append([shfl(x, src0), shfl(y, src0), shfl(x, src1), shfl(y, src1)])
                vals = [arith.select(upper, b, a) for a, b in zip(*halves, strict=True)]
                col = arith.addi(const(col0 + 16 * seg), col_q)
                off = arith.addi(row_off, arith.extui(i64, col))
                ptr = mgpu_utils.getelementptr(base, [off], f32)
                llvm.inline_asm(
                    ir.Type.parse("!llvm.void"),
                    [arith.extui(i32, valid), ptr, *vals],
                    f"{{ .reg .pred p; setp.ne.u32 p, $0, 0; @p {op} [$1], {{$2, $3, $4, $5}}; }}",
                    "r,l,f,f,f,f",
                    has_side_effects=True,
                )

    return red


# ------------------------------------------------------------------------------------
# The warpgroups.


def _load_inputs(prog: _Program, q_ref, do_ref, lse2_ref, delta_ref):
    """WG0 issues the TMA copies of the program's Q, dO, lse2 and delta."""
    st, buf, bar, heads = prog.st, prog.buf, prog.bar, pl.ds(prog.h0, HEADS_PER_PROGRAM)
    copies = (
        (q_ref.at[prog.token, heads, pl.ds(0, st.dv)], buf.q_lat),
        (q_ref.at[prog.token, heads, pl.ds(st.dv, ROPE)], buf.q_rope),
        (do_ref.at[prog.token, heads], buf.do),
        (lse2_ref.at[prog.token, heads], buf.stats.at[0]),
        (delta_ref.at[prog.token, heads], buf.stats.at[1]),
    )
    for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, bar.inputs_landed)


def _wait_block(prog: _Program, b):
    for part in _PARTS:
        prog.parts.wait(part, b)


def _masked(prog: _Program, b, x, masked: bool):
    if not masked:
        return x
    col = b * BLOCK_K + plgpu.broadcasted_iota(
        jnp.int32, (HEADS_PER_PROGRAM, BLOCK_K), 1, layout=plgpu.Layout.WGMMA
    )
    return jnp.where(col < prog.count, x, 0.0)


def _row_stat(prog: _Program, i: int):
    layout = plgpu.Layout.WGMMA.reduce(1)
    stat = plgpu.load(prog.buf.stats.at[i], layout=layout, optimized=False)
    return lax.broadcast_in_dim(stat, (HEADS_PER_PROGRAM, BLOCK_K), [0])


def _key_grads(prog: _Program, kv_ref, ids, b, chunks):
    """The key gradient of columns ``chunks`` (``(col0, q_ref, do_ref or None)``) of
    block ``b`` (row ids ``ids``), added into ``dkeys``."""
    buf = prog.buf
    ds_t = buf.ds16.transpose((1, 0))
    p_t = buf.p16.transpose((1, 0))
    for col0, q_cols, do_cols in chunks:
        pairs = [(ds_t, q_cols)] + ([] if do_cols is None else [(p_t, do_cols)])
        acc = _product(prog, kv_ref, (BLOCK_K, KV_CHUNK), pairs)
        _red_rows(prog, acc, ids, b, col0)


def _latent_chunks(buf: BackwardBuffers, lo: int, hi: int):
    """``_key_grads``' chunks of latent columns ``lo:hi``: Q's and dO's columns."""
    cols = (pl.ds(c, KV_CHUNK) for c in range(lo, hi, KV_CHUNK))
    return [(c.start, buf.q_lat.at[:, c], buf.do.at[:, c]) for c in cols]


def _hand_over(b, value, dst, free, ready):
    """Block ``b``'s ``value`` to the other compute warpgroup: wait until it has freed
    ``dst`` (block 1 on), store the value as bf16, then arrive on ``ready``."""

    @pl.when(b > 0)
    def _wait_free():
        plgpu.barrier_wait(free)

    dst[...] = value.astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.barrier_arrive(ready)


def _wg0_block(prog: _Program, refs, b, dq, masked: bool):
    """WG0's block ``b``: S and P, its dq columns (latent 0-255, rope), its key
    gradient columns."""
    buf, bar, st = prog.buf, prog.bar, prog.st
    s_ref, kv_ref = refs
    k_lat, k_rope = buf.k_lat.at[0], buf.k_rope.at[0]
    ids = _row_ids(prog, b)
    _wait_block(prog, b)
    s = _product(
        prog,
        s_ref,
        (HEADS_PER_PROGRAM, BLOCK_K),
        [(buf.q_lat, k_lat.transpose((1, 0))), (buf.q_rope, k_rope.transpose((1, 0)))],
    )
    probs = jnp.exp2(s * (st.sm_scale * LOG2E) - _row_stat(prog, 0))
    probs = _masked(prog, b, probs, masked)
    _hand_over(b, probs, buf.p16, bar.p_free, bar.p_ready)
    plgpu.barrier_wait(bar.ds_ready)
    half = st.dv // 2
    dq_lat, dq_rope = dq
    dq_lat = _accumulate(prog, dq_lat, [(buf.ds16, k_lat.at[:, pl.ds(0, half)])])
    dq_rope = _accumulate(prog, dq_rope, [(buf.ds16, k_rope)])
    plgpu.barrier_arrive(bar.block_free)
    _key_grads(prog, kv_ref, ids, b, [*_latent_chunks(buf, 0, half), (st.dv, buf.q_rope, None)])
    plgpu.barrier_arrive(bar.ds_free)
    return dq_lat, dq_rope


def _wg1_block(prog: _Program, refs, b, dq, masked: bool):
    """WG1's block ``b``: dP, dS, its dq columns (latent 256-511), its key gradient
    columns."""
    buf, bar, st = prog.buf, prog.bar, prog.st
    s_ref, kv_ref = refs
    k_lat = buf.k_lat.at[0]
    ids = _row_ids(prog, b)
    _wait_block(prog, b)
    dp = _product(prog, s_ref, (HEADS_PER_PROGRAM, BLOCK_K), [(buf.do, k_lat.transpose((1, 0)))])
    plgpu.barrier_wait(bar.p_ready)
    probs = plgpu.load(buf.p16, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    ds = probs * (dp - _row_stat(prog, 1)) * st.sm_scale
    _hand_over(b, ds, buf.ds16, bar.ds_free, bar.ds_ready)
    half = st.dv // 2
    (dq_lat,) = dq
    dq_lat = _accumulate(prog, dq_lat, [(buf.ds16, k_lat.at[:, pl.ds(half, half)])])
    plgpu.barrier_arrive(bar.block_free)
    _key_grads(prog, kv_ref, ids, b, _latent_chunks(buf, half, st.dv))
    plgpu.barrier_arrive(bar.p_free)
    return (dq_lat,)


def _compute_wg(prog: _Program, inputs):
    """WG0 and WG1: the block loop, then their dq columns."""
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    st, heads, half = prog.st, HEADS_PER_PROGRAM, prog.st.dv // 2

    @pl.when(prog.wg == 0)
    def _load():
        _load_inputs(prog, *inputs)

    plgpu.barrier_wait(prog.bar.inputs_landed)
    for w, widths, body in ((0, (half, ROPE), _wg0_block), (1, (half,), _wg1_block)):
        cols = ((0, half), (st.dv, ROPE)) if w == 0 else ((half, half),)

        @pl.when(prog.wg == w)
        def _blocks(w=w, widths=widths, body=body, cols=cols):
            def walk(s_ref, kv_ref, *dq_refs):
                dq = prog.target.zeroed(dq_refs, [(heads, n) for n in widths])
                full = lax.div(prog.count, jnp.int32(BLOCK_K))
                step = functools.partial(body, prog, (s_ref, kv_ref))
                for lo, hi, masked in ((0, full, False), (full, prog.num_blocks, True)):
                    dq = prog.target.loop(lo, hi, functools.partial(step, masked=masked), dq)

                # Drain: observe the other WG's last release before the barriers die.
                @pl.when(prog.num_blocks > 0)
                def _drain():
                    plgpu.barrier_wait(prog.bar.p_free if w == 0 else prog.bar.ds_free)

                for (c0, n), d in zip(cols, dq, strict=True):
                    value = prog.target.value(d, d)
                    prog.dq_ref.at[prog.token, pl.ds(prog.h0, heads), pl.ds(c0, n)][...] = value

            shapes = [(heads, BLOCK_K), (BLOCK_K, KV_CHUNK), *((heads, n) for n in widths)]
            prog.target.accumulators(walk, *shapes)


def _memory_wg(prog: _Program):
    """WG2: gather every block once both compute WGs have released the one before."""
    plgpu.set_max_registers(memory_registers(COMPUTE_REGISTERS), action="decrease")
    buf, bar = prog.buf, prog.bar
    gather = {part: prog.parts.gather(part.half) for part in _PARTS}

    @pl.loop(0, prog.num_blocks)
    def _gather_block(b):
        @pl.when(b >= 1)
        def _wait_block_free():
            plgpu.barrier_wait(bar.block_free)

        for part in _PARTS:
            gather[part](prog.store, prog.block_rows(b), buf.k_lat.at[0], buf.k_rope.at[0])
            prog.parts.publish(part)

    @pl.when(prog.num_blocks > 0)
    def _drain():
        plgpu.barrier_wait(bar.block_free)


def _kernel(st: _BwdStatics, target: Target):
    """The kernel body: the program's token and head group, then each warpgroup's part
    (the module docstring has the schedule)."""

    def kernel(
        # inputs (global memory)
        q_ref,  # [N, Hp, Dk] bf16
        do_ref,  # [N, Hp, Dv] bf16: dO
        lse2_ref,  # [N, Hp] f32: the base-2 LSE, +inf where there is no row
        delta_ref,  # [N, Hp] f32: rowsum(dO * O) - dlse
        store,  # [R, W] bf16
        rows_ref,  # [N, Kp] int32: each query's rows, valid first
        counts_ref,  # [N] int32
        # atomics: dkeys [R, Dk] f32 (an input the kernel adds to), then the output dq
        # [N, Hp, Dk] f32; deterministic: the outputs dq, then the parts [G, N, Kp, Dk] f32
        a,
        b,
        # scratch (shared memory)
        buf,  # BackwardBuffers
        bar,  # BackwardBarriers
    ):
        dkeys_ref, dq_ref = (b, a) if st.deterministic else (a, b)
        group, token = lagged_program(lax.axis_index(_AXIS_PROGRAM), TOKEN_LAG, st)
        count = counts_ref[token]
        prog = _Program(
            st=st,
            target=target,
            parts=parts_of(target, st, buf, bar),
            store=store,
            rows_ref=rows_ref,
            dq_ref=dq_ref,
            dkeys_ref=dkeys_ref,
            buf=buf,
            bar=bar,
            wg=lax.axis_index(_AXIS_WG),
            token=token,
            h0=group * HEADS_PER_PROGRAM,
            count=count,
            num_blocks=lax.div(count + BLOCK_K - 1, jnp.int32(BLOCK_K)),
        )
        prog.parts.init()
        inputs = (q_ref, do_ref, lse2_ref, delta_ref)
        pl.when(prog.wg < COMPUTE_WGS)(functools.partial(_compute_wg, prog, inputs))
        pl.when(prog.wg == COMPUTE_WGS)(functools.partial(_memory_wg, prog))

    return kernel


@functools.partial(jax.jit, static_argnames=("st", "target"))
def _launch(q, do, lse2, delta, store, rows, counts, *, st: _BwdStatics, target: Target):
    dk, groups = st.dv + ROPE, st.heads // HEADS_PER_PROGRAM
    dq_type = jax.ShapeDtypeStruct((st.tokens, st.heads, dk), jnp.float32)
    if st.deterministic:
        # Each (head group, token, slot) stores its own row of key gradient; the rows
        # are summed in a fixed order.
        parts_type = jax.ShapeDtypeStruct((groups, *rows.shape, dk), jnp.float32)
        dq, parts = _call(st, target, (dq_type, parts_type))(
            q, do, lse2, delta, store, rows, counts
        )
        return dq, _sum_parts(parts, rows, counts, store.shape[0])
    dkeys = jax.new_ref(jnp.zeros((store.shape[0], dk), jnp.float32))
    dq = _call(st, target, dq_type)(q, do, lse2, delta, store, rows, counts, dkeys)
    return dq, dkeys[...]


def _sum_parts(parts, rows, counts, num_rows: int):
    """``dkeys [R, Dk]``: the parts ``[G, N, Kp, Dk]`` summed by row id in a fixed order
    (``segment_sum_fixed_order``); slots past a token's count or with id ``< 0`` were
    never written and are not read. A token names a row once (its table is a set), so
    no row has more than ``G N`` parts. The first level's pieces hold about half a row's
    mean count (8 to 16 parts): each row's last piece is padded, so larger pieces over a
    large cache read mostly padding, and XLA sums pieces of 64 by a slower reduction
    (9.9 ms against 6.3 with pieces of 16, 32K cache, H 64, on the H200)."""
    groups, tokens, width, dk = parts.shape
    counted = (jnp.arange(width)[None] < counts[:, None]) & (rows >= 0)
    ids = jnp.broadcast_to(jnp.where(counted, rows, num_rows), (groups, tokens, width))
    half_mean = groups * tokens * width // max(1, 2 * num_rows)
    fan = 1 << min(4, max(3, half_mean.bit_length() - 1))
    return segment_sum_fixed_order(
        parts.reshape(-1, dk), ids.reshape(-1), num_rows, max_count=groups * tokens,
        fan_in=(fan, 8),
    )  # fmt: skip


def _token_chunks(tokens: int, groups: int, width: int, dk: int) -> list[tuple[int, int]]:
    """The deterministic path's launches: ``(start, size)`` token ranges whose parts
    (``groups * size * width * dk`` float32) fit ``PARTS_BYTES``."""
    size = max(1, min(tokens, PARTS_BYTES // max(1, groups * width * dk * 4)))
    return [(t, min(size, tokens - t)) for t in range(0, tokens, size)]


def _call(st: _BwdStatics, target: Target, out_type):
    scratch = backward_scratch(st.dv, interpret=target.interpret)
    return plgpu.kernel(
        out_type=out_type, **launch_args(_kernel(st, target), st, target, scratch, KERNEL_NAME)
    )


def sparse_mla_rows_backward(
    q: jax.Array,
    store: jax.Array,
    rows: jax.Array,
    counts: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    delta: jax.Array,
    *,
    sm_scale: float,
    dv: int = 512,
    deterministic: bool = False,
    interpret: object = False,
) -> tuple[jax.Array, jax.Array]:
    """``(dq [N, H, Dk], dkeys [R, Dk])`` float32 of ``sparse_mla_rows_attention``.

    ``deterministic``: ``False``, ``dkeys`` added by float32 atomics (no parts buffer;
    the summation order is not fixed); ``True``, bitwise reproducible (per-slot parts
    stored, then summed per row in a fixed order, in token chunks of at most
    ``PARTS_BYTES``; slower, measured in docs/sparse_mla_gpu.md). ``dq`` is
    reproducible either way.

    Args:
      q: ``[N, H, Dk]`` bfloat16, ``Dk = dv + 64``.
      store: ``[R, W]`` bfloat16, ``W >= Dk``, ``W % 8 == 0``.
      rows, counts: the forward's row table (``[N, Kp]``, ``Kp % 64 == 0``; ``[N]``).
      lse: ``[N, H]`` float32, the forward's natural-log LSE.
      d_out: ``[N, H, dv]``, the output's cotangent (cast to bfloat16).
      delta: ``[N, H]`` float32, ``rowsum(d_out * out) - d_lse``.
    """
    tokens, heads, dk = q.shape
    if q.dtype != jnp.bfloat16 or store.dtype != jnp.bfloat16:
        raise TypeError(f"q, store: got {q.dtype}, {store.dtype}, expected bfloat16")
    if dk != dv + ROPE:
        raise NotImplementedError(
            f"q: head dim {dk} with dv={dv}; the Hopper kernel takes Dk = Dv + {ROPE}"
        )
    if (reason := unsupported_dv(dv)) is not None:
        raise NotImplementedError(reason)
    if store.ndim != 2 or store.shape[1] < dk or store.shape[1] % CHUNK:
        raise ValueError(f"store: got shape {store.shape}, expected [R, W >= {dk}]")
    if rows.shape[0] != tokens or rows.shape[1] % BLOCK_K:
        raise ValueError(f"rows: got shape {rows.shape}")
    hp = -(-heads // HEADS_PER_PROGRAM) * HEADS_PER_PROGRAM
    lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf).astype(jnp.float32)
    do = d_out.astype(jnp.bfloat16)
    delta = delta.astype(jnp.float32)
    if hp != heads:
        pad3, pad2 = ((0, 0), (0, hp - heads), (0, 0)), ((0, 0), (0, hp - heads))
        q, do = jnp.pad(q, pad3), jnp.pad(do, pad3)
        lse2 = jnp.pad(lse2, pad2, constant_values=jnp.inf)
        delta = jnp.pad(delta, pad2)
    rows, counts = rows.astype(jnp.int32), counts.astype(jnp.int32)
    if tokens == 0:
        return jnp.zeros((0, heads, dk), jnp.float32), jnp.zeros((store.shape[0], dk), jnp.float32)
    target = resolve_target(interpret)
    # The interpreter runs no atomics: it takes the deterministic path.
    deterministic = bool(deterministic) or target.interpret
    statics = functools.partial(
        _BwdStatics, heads=hp, dv=dv, width=store.shape[1], sm_scale=float(sm_scale),
        deterministic=deterministic,
    )  # fmt: skip
    if not deterministic:
        chunks = [(0, tokens)]
    else:
        chunks = _token_chunks(tokens, hp // HEADS_PER_PROGRAM, rows.shape[1], dk)
    dqs, dkeys = [], None
    for t0, n in chunks:
        part = (x[t0 : t0 + n] for x in (q, do, lse2, delta))
        dq, d = _launch(
            *part, store, rows[t0 : t0 + n], counts[t0 : t0 + n],
            st=statics(tokens=n), target=target,
        )  # fmt: skip
        dqs.append(dq)
        dkeys = d if dkeys is None else dkeys + d
    dq = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs)
    return dq[:, :heads], dkeys
