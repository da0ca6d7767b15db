"""Sparse MLA prefill on Hopper (sm_90a): the gather-attend kernel over a per-query row table.

Op (docs/design.md#sparse-mla-prefill): every query token ``n`` attends exactly the rows
``rows[n, :counts[n]]`` of a row-addressable latent store ``store [R, W]`` (``W >= Dk``);
the row table is built outside (``attn_common.sparse_mla_rows.selected_rows``: flat or
paged, units expanded to token rows, causal / ``kv_len`` / ``-1`` / duplicates already
applied, valid rows first). Keys are a row's first ``Dk = Dv + 64`` features, values its
first ``Dv = 512``. ``out [N, Hp, Dv]`` float32 and ``lse [N, Hp]`` float32 (natural log,
``-inf`` for a query with no row, whose ``out`` is 0).

Schedule (the one that ships; docs/sparse_mla_gpu.md has the measurements)
--------------------------------------------------------------------------
How rows reach shared memory (the launch order, ``Part``, the gathers, the FP8 staging
and dequantization, the hand-kept copy barriers) is in ``_sparse_mla_rows``, which the
backward kernel shares; this file holds the schedule that uses them.

One program per (query token, group of 64 heads), launched in chunks of 8 tokens: the
chunk's head group 0 programs, then its head group 1 programs, and so on, so each head
group of a token runs a few programs behind the one before and reads the token's rows
from L2, where the earlier one brought them (``lagged_program``). Three warpgroups
(``num_threads=3``), registers 232 / 232 / 40 (``setmaxnreg``).

Shared memory (``_Buffers``; Q and the pair take 216 of the 227 KiB): all of Q (72 KiB: its 512 latent and
64 rope features, loaded once by TMA, one copy each, from one ``[N, H, Dk]`` array or
from two, ``q_rope``: the prefill wrapper's ``ql`` and ``qpe`` as they come, never joined
into a copy of Q), one pair of 64-row blocks of keys (144 KiB; block 0 is WG0's, block 1
WG1's), WG1's P, the row statistics the compute WGs swap, and four hand-kept mbarriers.
WG0's P goes where its block's rope features were (dead after its QK^T). QK^T wgmmas
are N = 64 wide, so Q is read from shared memory once per 64 keys.

Each block is two parts (``Part``) with their own barriers: ``L`` (latent features
0-255, WG0's value half) and ``R`` (latent 256-511, WG1's value half, and the rope
features), so the next pair streams in while this one is used.

* WG2 (memory) gathers the token's selected rows with 16-byte ``cp.async`` copies issued
  by all 128 threads (Hopper's TMA has no row gather): 8 threads per row, each copying the
  same 16-byte chunk of every 64-feature tile of its rows, straight into the
  128-byte-swizzled tiled layout wgmma reads (``gather_part``). Rows past ``counts[n]``
  are zero-filled (``cp.async`` with a source size of 0), so stale or uninitialised
  shared memory never reaches the value product. It refills the parts in the order they
  are freed: ``L0`` and ``R1`` (each WG's own value half), then ``R0`` and ``L1``, each
  once its ``consumed`` barrier says its last reader is done. It does not wait for a
  part's copies: each thread executes ``cp.async.mbarrier.arrive.noinc`` on the part's
  copy barrier (128 arrivals), which arrives once that thread's copies have landed.
  Pallas barriers cannot be handed to inline Mosaic GPU code, so these four copy barriers
  are hand-kept in a shared-memory buffer, initialised by one thread before the
  warpgroups split, and waited on by parity (``p & 1``); the waiting compute thread
  fences the async proxy (the copies are generic-proxy writes, wgmma reads through the
  async proxy).
* WG0, WG1 (compute) each own one block of every pair and one half of the value
  features (``Dv / 2`` = 256 columns, a 64 x 256 f32 accumulator). Per pair: ``S = Q
  K^T`` of its own block, part by part as the parts land (WG0 part L first, WG1 part R),
  the columns past ``counts[n]`` masked on the last pair only (``_walk_pairs``). The max
  exchange is one-way (as FlashMLA's Hopper sparse prefill does it): WG0 takes ``m0 =
  max(m, rowmax S_0)``, publishes it (``stats[0]``, ``max_ready[0]``), computes ``P_0``
  on it and issues ``P_0 V_0``; WG1 waits for ``m0``, publishes ``m' = max(m0, rowmax
  S_1)`` (``max_ready[1]``), computes ``P_1`` on it, issues ``P_1 V_1`` and publishes
  ``P_1`` (``p_ready[1]``). WG0 hands part ``L0`` back once its own product is done,
  then rescales by ``exp2(m0 - m')``: the ``P_0`` it publishes for WG1 (``p_ready[0]``),
  its row sums and its accumulator, before ``P_1 V_1``, and hands ``L1`` back once that
  has landed. WG1 hands ``R1`` back once its own product has landed, and ``R0`` (where
  ``P_0`` is) once its product with ``P_0`` has. Every barrier gets one arrival and one wait per pair, and a WG
  overwrites a ``stats`` or ``P`` buffer only after a wait that the other WG's last read
  of it precedes, so no barrier runs two phases ahead of its waiter.
* Every buffer is addressed with ``p & opaque_zero`` (an input that holds 0) each pair:
  with one pair of blocks every address is loop-invariant, and the compiler would
  otherwise compute all 80 wgmma descriptors before the loop and spill them (1048
  bytes; 1.6x slower). A zero derived from ``count`` is folded away.
* At the end the WGs add their row sums through shared memory (``pair`` barrier),
  normalise, and store their output half to global memory; WG0 writes the LSE.

FP8 latent cache (``store`` an ``attn_common.Fp8LatentCache``: 656 bytes a row against
1,152): the same schedule, slots and barriers; only the bytes that land differ, and who
turns them into bf16. Hopper has no copy that converts, and Q and the pair leave no room
for a staging buffer, so each part is staged inside its own slot:

* WG2 (``stage_part_fp8``) copies by ``cp.async``, with the same thread map and
  zero-fill as the bf16 gather, a row's 256 FP8 bytes of the part into the part's
  feature tiles 2 and 3 (``fp8_stage``), its 16 bytes of scales into chunk 0 of the
  part's tile 0 (``fp8_scale_at``), and for part ``R`` its bf16 rope features as
  before; the copy barriers work as for bf16 (``noinc`` arrivals).
* The compute WG that owns the block (WG0 block 0, WG1 block 1), once a part's copies
  have landed and before its QK^T, dequantizes it in place (``dequantize_part_fp8``,
  ``fp8_dequant_map``): two threads per row, neighbours in a warp; each loads its 8
  staged 16-byte chunks and its group's scale, the warp syncs (each overwrites chunks
  the other loaded), then each converts (``bf16(float32(e4m3) * scale)``, the bits of
  ``dequantize_latent_cache(store).astype(bfloat16)``) and stores 16 chunks into the
  swizzled slot; an async-proxy fence and a warpgroup barrier, then the wgmma. The
  other WG reads the part as values only after ``p_ready`` of its owner, which follows
  the owner's dequantization.

On the H200 this runs at 0.64-0.79x the bf16 kernel (docs/fp8_cache.md): it is bound by
the compute WGs (without any gather it takes as long), where the dequantization (about
3.2 instructions per value) sits before each QK^T and adds 1.38 ms per head group of
4096 queries x 2048 rows, more than the bytes saved. Registers 232 / 232 / 40, as for
bf16.

Softmax: base 2, the running max starts at a finite ``-1e30`` so a row with no key yet
never computes ``-inf - -inf``; ``l == 0`` at the end marks an empty row (out 0,
LSE ``-inf``). Every pair is walked by both compute WGs and the memory WG alike
(``ceil(counts[n] / 128)`` pairs), so all barrier arrival counts are static.

Interpret mode (``interpret=True``, the CPU tests) runs the same schedule and barriers;
the interpreter runs no inline Mosaic GPU code, so rows are copied by plain loads and
stores and the memory WG arrives on ``ready`` itself, and no wgmma with its A operand in
registers, so each P is read back from shared memory.

Rejected alternatives (built, measured on an H200, removed; the code is at da2ec0c)
--------------------------------------------------------------------------------------
* 32-row blocks, a ring of two pairs (``SparseMlaKernelConfig(32, 2)``, the default
  before 47d9805): kernel alone 5.08 / 5.44 ms against 3.84 / 4.49 on 4096 tokens x 128
  heads x 2048 rows of an 8K / 128K cache; its N = 32 QK^T is bound by shared-memory
  reads of Q (compute alone 469 TFLOP/s).
* The lockstep max exchange (``exchange="lockstep"``: both WGs swap block maxima, then
  P): 5-6 % slower than the one-way exchange (5.67 against 5.33 ms, 9026ac9).
* 64-row blocks without parts (the memory WG refills a whole pair at once): 1.4-1.8x
  slower than the 32-row ring at 766d571 (8.06 against 5.69 ms on an 8K cache).
* The memory WG waiting for its copies and arriving itself (still the interpret path):
  the ``noinc`` arrivals ran the kernel 1.10-1.13x faster, 1.15-1.18x with 232/40.
* Registers 240/24 (``compute_registers``): 232/40 ran 1.09-1.10x faster (no spills).
* Launch orders (``token_lag``): the 2-D grid (every token's head group 0 first) ran
  1.01-1.04x slower than chunks of 8 tokens (4.469 against 4.312 ms on a 128K cache);
  16-64 within 1 % of 8.
* Diagnostic probes (``probe="no_gather"`` / ``"no_compute"``, wrong results, timing
  only): the compute alone of this schedule took 3.354 ms on an 8K cache at 47d9805.
* FP8, the memory WG dequantizing instead (each part in place once the next part's
  copies are issued, one thread per row side, no warp sync, 40 registers): 0.34-0.41x
  the bf16 kernel (prefill 6.4-13.1 ms against 2.1-4.3; decode 0.51 / 0.89 ms against
  0.21 / 0.31), a47786e.
* FP8, the memory WG loading the FP8 rows into registers by plain global loads and
  dequantizing them there (224 / 224 / 56): 0.40-0.58x, the gather at about 1 TB/s,
  0123d29.
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

from attn_common.fp8_cache import LATENT as FP8_LATENT
from attn_common.fp8_cache import Fp8LatentCache, check_fp8_cache
from attn_mosaic_gpu import _axes
from attn_mosaic_gpu._interpret import resolve_interpret
from attn_mosaic_gpu._registers import memory_registers
from attn_mosaic_gpu._sparse_mla_rows import (
    BLOCK_K,
    CHUNK,
    HEADS_PER_PROGRAM,
    ROPE,
    THREADS,
    TOKEN_LAG,
    Part,
    arrive_on_copies,
    dequantize_part_fp8,
    gather_part,
    gather_part_fp8_interpret,
    gather_part_interpret,
    init_copy_barriers,
    lagged_program,
    stage_part_fp8,
    swizzled_tiles,
    wait_copies_landed,
)

__all__ = ["SparseMlaKernelConfig", "resolve_interpret", "sparse_mla_rows_attention"]

_COMPUTE_WGS = 2
# setmaxnreg of each compute WG; the memory WG keeps the rest of the 504 per thread slot
# (40). 232 ran the kernel 1.09-1.10x faster than 240/24 on the H200, 224/56 as fast.
_COMPUTE_REGISTERS = 232
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30
_AXIS_PROGRAM = _axes.PROGRAMS
_AXIS_WG = _axes.WARPGROUP
_Q_LATENT, _Q_ROPE = 0, 1  # the two TMA copies of Q and their `q_ready` barriers


@dataclasses.dataclass(frozen=True)
class SparseMlaKernelConfig:
    """The Hopper sparse-MLA kernel's schedule: ``(block_k, num_stages, exchange)``.

    One schedule ships, ``(64, 1, "one_way")`` (``exchange=None`` resolves to
    ``"one_way"``): one pair of 64-row blocks, each block in two parts with their own
    barriers, and the one-way max exchange (see the module docstring). On the H200 the
    kernel alone ran 3.84 / 4.49 ms on 4096 tokens x 128 heads x 2048 rows of an 8K /
    128K cache, against 5.08 / 5.44 for ``(32, 2, "one_way")``
    (docs/sparse_mla_gpu.md). The other schedules (32-row blocks, the lockstep
    exchange) were removed; commit da2ec0c has them. The fields stay for callers that
    spell the schedule out.
    """

    block_k: int = BLOCK_K
    num_stages: int = 1
    exchange: str | None = None

    def __post_init__(self):
        if self.exchange is None:  # frozen: resolve the default in place
            object.__setattr__(self, "exchange", "one_way")
        shipped = {"block_k": BLOCK_K, "num_stages": 1, "exchange": "one_way"}
        for name, want in shipped.items():
            if getattr(self, name) != want:
                raise ValueError(
                    f"{name}: got {getattr(self, name)!r}, expected {want!r}: the kernel "
                    f"ships one schedule, {tuple(shipped.values())} (commit da2ec0c has the "
                    "others)"
                )


@dataclasses.dataclass(frozen=True)
class _SparseMlaStatics:
    """The static facts one kernel build is specialised on (``_launch``'s static key)."""

    tokens: int
    heads: int  # padded to a multiple of HEADS_PER_PROGRAM
    dv: int
    width: int  # store row width (elements)
    sm_scale: float
    # Column of the rope ref's first rope feature: dv when Q comes joined (the same
    # array as the latent ref), 0 when its rope features come as their own array.
    rope_at: int
    # The store is an FP8 latent cache (latent / scale / rope arrays, one row per token):
    # staged in the key slots by cp.async, dequantized there by the compute WGs.
    fp8: bool = False


_HALVES = ("L", "R")
# The memory WG's refill order within a pair: each WG's own value half first (freed
# mid-pair), then the halves the other WG's value product reads.
_REFILL_ORDER = ((Part.L0, Part.R1), (Part.R0, Part.L1))


class _Buffers(NamedTuple):
    """The kernel's shared memory (``_buffer_types`` allocates it)."""

    q_lat: Any  # [1, 64, Dv]: Q's latent features (a leading axis of 1: `p & opaque_zero`)
    q_rope: Any  # [1, 64, 64]: Q's rope features
    k_lat: Any  # [2, 64, Dv]: the pair's blocks' latent features (parts L, R)
    k_rope: Any  # [2, 64, 64]: their rope features (part R); k_rope[0] then WG0's P
    p_wg1: Any  # [1, 64, 64]: WG1's P
    stats: Any  # [2, 64] f32: each compute WG's running max, at the end its row sums
    copied: Any  # [8] u32: the four hand-kept copy barriers (None in interpret mode)


class _Barriers(NamedTuple):
    """The kernel's Pallas barriers (``_barrier_types`` allocates them)."""

    # [4] per Part: the memory WG's copies have landed. Interpret mode only: compiled,
    # the copies arrive on their hand-kept barriers (`_Buffers.copied`) and this one is
    # unused, though allocated (32 bytes) as it was before the other schedules left.
    ready: Any
    consumed: Any  # [4] per Part: its last reader is done; the memory WG may refill it
    q_ready: Any  # [2]: Q's latent / rope features have landed (_Q_LATENT, _Q_ROPE)
    pair: Any  # both compute WGs: the row sums are in `stats`
    max_ready: Any  # [2] per compute WG: its running max of the pair is in `stats`
    p_ready: Any  # [2] per compute WG: its P of the pair is in shared memory


def _buffer_types(st: _SparseMlaStatics, interpret: bool) -> _Buffers:
    tiled = swizzled_tiles()
    bf16 = jnp.bfloat16
    heads, dv = HEADS_PER_PROGRAM, st.dv
    return _Buffers(
        q_lat=plgpu.SMEM((1, heads, dv), bf16, transforms=tiled),
        q_rope=plgpu.SMEM((1, heads, ROPE), bf16, transforms=tiled),
        k_lat=plgpu.SMEM((_COMPUTE_WGS, BLOCK_K, dv), bf16, transforms=tiled),
        k_rope=plgpu.SMEM((_COMPUTE_WGS, BLOCK_K, ROPE), bf16, transforms=tiled),
        p_wg1=plgpu.SMEM((1, heads, BLOCK_K), bf16, transforms=tiled),
        stats=plgpu.SMEM((_COMPUTE_WGS, heads), jnp.float32),
        # two 32-bit words per mbarrier
        copied=None if interpret else plgpu.SMEM((2 * len(Part),), jnp.uint32),
    )


def _barrier_types() -> _Barriers:
    parts = len(Part)
    return _Barriers(
        ready=plgpu.Barrier(num_barriers=parts),
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=parts),
        q_ready=plgpu.Barrier(num_barriers=2),
        pair=plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
        max_ready=plgpu.Barrier(num_barriers=_COMPUTE_WGS),
        p_ready=plgpu.Barrier(num_barriers=_COMPUTE_WGS),
    )


@dataclasses.dataclass(frozen=True)
class _Program:
    """What every warpgroup of one program reads: the static facts, the refs, the
    shared memory and barriers, and its token's values."""

    st: _SparseMlaStatics
    interpret: bool
    q_ref: Any
    q_rope_ref: Any
    stores: tuple  # (store,) bf16, or an FP8 cache's (latent, scale, rope) row arrays
    rows_ref: Any
    out_ref: Any
    lse_ref: Any
    q_dst: tuple[Any, Any]  # Q's latent and rope features' TMA destinations
    buf: _Buffers
    bar: _Barriers
    wg: Any  # this warpgroup's index (traced)
    token: Any
    h0: Any  # first head of the head group
    count: Any  # rows of the token
    opaque_zero: Any  # 0 at run time, opaque to the compiler (see the module docstring)
    num_pairs: Any

    @property
    def half(self) -> int:
        return self.st.dv // _COMPUTE_WGS

    def pair_sync(self) -> None:
        plgpu.barrier_arrive(self.bar.pair)
        plgpu.barrier_wait(self.bar.pair)


class _RowInit(NamedTuple):
    """A compute WG's starting values: the running max and sum per row, zero S and
    accumulator tiles, all in the wgmma layout."""

    row_layout: Any
    m: Any
    l: Any
    s_zero: Any
    acc_zero: Any


def _compute_wg(prog: _Program):
    """WG0 and WG1: load Q, walk the pairs, write the output (see the module docstring)."""
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    st, bar, heads = prog.st, prog.bar, HEADS_PER_PROGRAM
    other = 1 - prog.wg

    @pl.when(prog.wg == 0)
    def _load_q():
        parts = (
            (prog.q_ref, 0, st.dv, prog.q_dst[_Q_LATENT]),
            (prog.q_rope_ref, st.rope_at, ROPE, prog.q_dst[_Q_ROPE]),
        )
        for i, (src, lo, width, dst) in enumerate(parts):
            plgpu.copy_gmem_to_smem(
                src.at[prog.token, pl.ds(prog.h0, heads), pl.ds(lo, width)], dst, bar.q_ready.at[i]
            )

    plgpu.barrier_wait(bar.q_ready.at[_Q_LATENT])
    plgpu.barrier_wait(bar.q_ready.at[_Q_ROPE])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    init = _RowInit(
        row_layout,
        plgpu.layout_cast(jnp.full((heads,), _M_INIT, jnp.float32), row_layout),
        plgpu.layout_cast(jnp.full((heads,), 0.0, jnp.float32), row_layout),
        plgpu.layout_cast(jnp.full((heads, BLOCK_K), 0.0, jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((heads, prog.half), 0.0, jnp.float32), plgpu.Layout.WGMMA),
    )
    for w in range(_COMPUTE_WGS):

        @pl.when(prog.wg == w)
        def _pairs(w=w):
            _finish(prog, init, other, *_run_pairs(prog, w, init))


def _run_pairs(prog: _Program, w: int, init: _RowInit):
    """WG ``w``'s pair loop: ``(acc, m, l)`` at the end. Compiled, S and the value
    accumulator are ACC refs; in interpret mode they are values."""

    def loop(s_ref=None, acc_ref=None):
        step = functools.partial(_pair_step, prog, w, init, s_ref, acc_ref)
        acc = init.acc_zero if prog.interpret else None
        m_i, l_i, acc = _walk_pairs(prog, step, (init.m, init.l, acc))
        return (acc if prog.interpret else acc_ref[...]), m_i, l_i

    if prog.interpret:
        return loop()
    return pl.run_scoped(
        loop,
        plgpu.ACC((HEADS_PER_PROGRAM, BLOCK_K), jnp.float32),
        plgpu.ACC((HEADS_PER_PROGRAM, prog.half), jnp.float32),
    )


def _walk_pairs(prog: _Program, step, init):
    """``step(p, carry, masked=...)`` over every pair: first the pairs wholly below the
    query's row count, whose columns are all rows and need no mask (no column iota,
    compare and select per score, nor the registers they hold), then the last, partial
    pair, if any, masked."""
    full = lax.div(prog.count, jnp.int32(2 * BLOCK_K))
    carry = lax.fori_loop(0, full, functools.partial(step, masked=False), init)
    return lax.fori_loop(full, prog.num_pairs, functools.partial(step, masked=True), carry)


def _pair_step(prog: _Program, w: int, init: _RowInit, s_ref, acc_ref, p, carry, masked):
    """WG ``w``'s pair ``p``: its scores, its running max (the one-way exchange), its
    own value product, then WG0's rescale and product with WG1's P, or WG1's product
    with WG0's P; every part handed back as soon as its last reader is done."""
    buf, bar = prog.buf, prog.bar
    m_i, l_i, acc = carry
    o = lax.bitwise_and(p, prog.opaque_zero)
    # This WG's P buffer and the other's: WG0's P where block 0's rope features were.
    p_mine = buf.k_rope.at[o] if w == 0 else buf.p_wg1.at[o]
    p_theirs = buf.p_wg1.at[o] if w == 0 else buf.k_rope.at[o]
    s = _masked_scores(prog, p, _scores(prog, w, init, s_ref, o, p), masked)
    cols = pl.ds(w * prog.half, prog.half)
    own_v = buf.k_lat.at[w + o].at[:, cols]
    their_v = buf.k_lat.at[1 - w + o].at[:, cols]
    if w == 0:
        m_own = jnp.maximum(m_i, _scaled_max(prog, s))
    else:
        plgpu.barrier_wait(bar.max_ready.at[0])
        m_0 = plgpu.load(buf.stats.at[0], layout=init.row_layout, optimized=False)
        m_own = jnp.maximum(m_0, _scaled_max(prog, s))
    buf.stats.at[w][...] = m_own
    plgpu.barrier_arrive(bar.max_ready.at[w])
    scale2 = prog.st.sm_scale * _LOG2E
    probs = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_own, s.shape, [0]))
    alpha = jnp.exp2(m_i - m_own)
    l_i = l_i * alpha + probs.sum(axis=1)
    p16 = probs.astype(jnp.bfloat16)
    if prog.interpret:  # the own product reads P back from shared memory
        p_mine[...] = p16
    own_p = p_mine if prog.interpret else p16
    acc = _pv_add(prog, acc, acc_ref, own_p, own_v, _to_acc(prog, alpha))
    if w == 0:
        return _wg0_rescale(
            prog, init, acc, acc_ref, s, probs, m_own, l_i, p_mine, p_theirs, their_v
        )
    return _wg1_exchange(prog, acc, acc_ref, m_own, l_i, p16, p_mine, p_theirs, their_v)


def _wg0_rescale(
    prog: _Program, init, acc, acc_ref, s, probs, m_own, l_i, p_mine, p_theirs, their_v
):
    """WG0 after its own product: hand back ``L0``; take the pair's max from WG1,
    publish ``P_0`` rescaled to it, rescale the sums and the accumulator, add ``P_1
    V_1``, hand back ``L1``. (Publishing the rescaled ``P_0`` first, while the own
    product runs, measured 1.07-1.12x slower.)"""
    buf, bar = prog.buf, prog.bar
    if not prog.interpret:
        plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(bar.consumed.at[Part.L0])
    plgpu.barrier_wait(bar.max_ready.at[1])
    m_new = plgpu.load(buf.stats.at[1], layout=init.row_layout, optimized=False)
    shift = jnp.exp2(m_own - m_new)
    p_mine[...] = (probs * lax.broadcast_in_dim(shift, s.shape, [0])).astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.barrier_arrive(bar.p_ready.at[0])
    l_i = l_i * shift
    plgpu.barrier_wait(bar.p_ready.at[1])
    acc = _pv_add(prog, acc, acc_ref, p_theirs, their_v, _to_acc(prog, shift))
    if not prog.interpret:
        plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(bar.consumed.at[Part.L1])
    return m_new, l_i, acc


def _wg1_exchange(prog: _Program, acc, acc_ref, m_own, l_i, p16, p_mine, p_theirs, their_v):
    """WG1 after issuing its own product: publish ``P_1``, add ``P_0 V_0`` (``P_0``
    already on the pair's max), hand back ``R1`` and then ``R0``."""
    bar = prog.bar
    if not prog.interpret:
        p_mine[...] = p16
    plgpu.commit_smem()
    plgpu.barrier_arrive(bar.p_ready.at[1])
    plgpu.barrier_wait(bar.p_ready.at[0])
    acc = _pv_add(prog, acc, acc_ref, p_theirs, their_v)
    if not prog.interpret:
        plgpu.wgmma_wait(1)
    plgpu.barrier_arrive(bar.consumed.at[Part.R1])
    if not prog.interpret:
        plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(bar.consumed.at[Part.R0])
    return m_own, l_i, acc


def _qk_part(prog: _Program, w: int, half: str, acc, o, p):
    """Wait for part ``half`` of WG ``w``'s block of pair ``p``; add its QK^T to ``acc``."""
    buf = prog.buf
    part = Part.of(w, half)
    if prog.interpret:
        plgpu.barrier_wait(prog.bar.ready.at[part])
    else:
        wait_copies_landed(buf.copied, part, lax.bitwise_and(p, jnp.int32(1)))
        if prog.st.fp8:  # this WG's own block: dequantize the staged part in place
            dequantize_part_fp8(half)(buf.k_lat.at[w + o])
    feats = pl.ds(_HALVES.index(half) * prog.half, prog.half)
    k_part = buf.k_lat.at[w + o].at[:, feats].transpose((1, 0))
    plgpu.wgmma(acc, buf.q_lat.at[o].at[:, feats], k_part)
    if half == "R":
        plgpu.wgmma(acc, buf.q_rope.at[o], buf.k_rope.at[w + o].transpose((1, 0)))


def _scores(prog: _Program, w: int, init: _RowInit, s_ref, o, p):
    """S of WG ``w``'s block of pair ``p`` (WG0: part L then R; WG1: R then L)."""
    first, second = _HALVES[w], _HALVES[1 - w]
    if prog.interpret:

        def qk(acc_ref):
            _qk_part(prog, w, first, acc_ref, o, p)
            _qk_part(prog, w, second, acc_ref, o, p)
            return acc_ref[...]

        return pl.run_scoped(qk, plgpu.ACC((HEADS_PER_PROGRAM, BLOCK_K), jnp.float32))
    s_ref[...] = init.s_zero
    _qk_part(prog, w, first, s_ref, o, p)
    _qk_part(prog, w, second, s_ref, o, p)
    return s_ref[...]


def _masked_scores(prog: _Program, p, s, masked: bool):
    """This WG's scores of pair ``p``, ``-inf`` past the query's row count (``masked``;
    a pair wholly below the count is returned as it is)."""
    if not masked:
        return s
    col = (2 * p + prog.wg) * BLOCK_K + plgpu.broadcasted_iota(
        jnp.int32, (HEADS_PER_PROGRAM, BLOCK_K), 1, layout=plgpu.Layout.WGMMA
    )
    return jnp.where(col < prog.count, s, -jnp.inf)


def _scaled_max(prog: _Program, s):
    """Row max of ``s`` in the exp2 domain; a row with no key yet gets the finite
    ``_M_INIT``, never ``-inf``."""
    block_max = s.max(axis=1)
    return jnp.where(block_max > -jnp.inf, block_max * (prog.st.sm_scale * _LOG2E), _M_INIT)


def _to_acc(prog: _Program, x):
    return lax.broadcast_in_dim(x, (HEADS_PER_PROGRAM, prog.half), [0])


def _pv_add(prog: _Program, acc, acc_ref, a, v, scale=None):
    """``acc * scale + a @ v``: issued into ``acc_ref`` and not waited for (``a`` in
    registers or shared memory), or in interpret mode computed from ``a`` in shared
    memory and returned."""
    if prog.interpret:

        def pv(r):
            plgpu.wgmma(r, a, v)
            return r[...]

        product = pl.run_scoped(pv, plgpu.ACC((HEADS_PER_PROGRAM, prog.half), jnp.float32))
        return (acc if scale is None else acc * scale) + product
    if scale is not None:
        acc_ref[...] = acc_ref[...] * scale  # waits for the wgmmas in flight
    plgpu.wgmma(acc_ref, a, v)
    return None


def _finish(prog: _Program, init: _RowInit, other, acc, m_i, l_i):
    """Add the two WGs' row sums, normalise, store the output half and the LSE."""
    stats, wg, half = prog.buf.stats, prog.wg, prog.half
    # `stats` now carries the row sums (every read of the maxima is done: each WG is
    # past the last point where the other reads them).
    stats.at[wg][...] = l_i
    prog.pair_sync()
    l_tot = l_i + plgpu.load(stats.at[other], layout=init.row_layout, optimized=False)
    has_key = l_tot > 0.0
    inv_l = 1.0 / jnp.where(has_key, l_tot, 1.0)
    out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    heads = pl.ds(prog.h0, HEADS_PER_PROGRAM)
    prog.out_ref.at[prog.token, heads, pl.ds(wg * half, half)][...] = out

    @pl.when(wg == 0)
    def _lse():
        lse = jnp.where(has_key, (m_i + jnp.log2(jnp.where(has_key, l_tot, 1.0))) * _LN2, -jnp.inf)
        prog.lse_ref.at[prog.token, heads][...] = lse


def _memory_wg(prog: _Program):
    """WG2: gather every pair's parts in ``_REFILL_ORDER``, each once it is free."""
    plgpu.set_max_registers(memory_registers(_COMPUTE_REGISTERS), action="decrease")
    buf, bar = prog.buf, prog.bar
    if prog.st.fp8:
        make = gather_part_fp8_interpret if prog.interpret else stage_part_fp8
    else:
        make = gather_part_interpret if prog.interpret else gather_part
    gather = {half: make(prog.st, half) for half in _HALVES}

    @pl.loop(0, prog.num_pairs)
    def _issue(p):
        for parts in _REFILL_ORDER:
            for part in parts:

                @pl.when(p >= 1)
                def _wait_free(part=part):
                    plgpu.barrier_wait(bar.consumed.at[part])

                rows = pl.ds((2 * p + part.block) * BLOCK_K, BLOCK_K)
                gather[part.half](
                    *prog.stores,
                    prog.rows_ref.at[prog.token, rows],
                    buf.k_lat.at[part.block],
                    buf.k_rope.at[part.block],
                )
                if not prog.interpret:
                    arrive_on_copies(buf.copied, part)
            if prog.interpret:  # publish the two parts (the copies are synchronous)
                for part in parts:
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(bar.ready.at[part])

    # Drain: observe the consumption of the last pair before the barriers die.
    @pl.when(prog.num_pairs > 0)
    def _drain():
        for part in Part:
            plgpu.barrier_wait(bar.consumed.at[part])


def _build_kernel(st: _SparseMlaStatics, *, interpret: bool):
    """The kernel body: shared memory and barriers, the program's token, then each
    warpgroup's part. ``interpret``: the Mosaic GPU interpreter runs neither inline
    Mosaic GPU code (the cp.async gather: rows are copied by plain loads and stores
    instead, and the memory WG publishes them itself), ``run_state``, nor a wgmma whose A
    operand is in registers (P is read back from shared memory, where it is anyway, into
    a fresh accumulator that is then added). The schedule and barriers are the same."""

    def kernel(q_ref, q_rope_ref, stores, rows_ref, counts_ref, zero_ref, out_ref, lse_ref, scoped):
        buf, bar = scoped
        # Q's TMA destinations (the buffers' leading axis of 1 is for `p & opaque_zero`).
        q_dst = (buf.q_lat.at[0], buf.q_rope.at[0])
        group, token = lagged_program(lax.axis_index(_AXIS_PROGRAM), TOKEN_LAG, st)
        wg = lax.axis_index(_AXIS_WG)
        h0 = group * HEADS_PER_PROGRAM
        count = counts_ref[token]
        prog = _Program(
            st=st,
            interpret=interpret,
            q_ref=q_ref,
            q_rope_ref=q_rope_ref,
            stores=stores,
            rows_ref=rows_ref,
            out_ref=out_ref,
            lse_ref=lse_ref,
            q_dst=q_dst,
            buf=buf,
            bar=bar,
            wg=wg,
            token=token,
            h0=h0,
            count=count,
            # 0 at run time (an input that holds 0), so the compiler can derive nothing
            # about it: the pair loops address their buffers with `p & opaque_zero`,
            # which keeps the 80 wgmma descriptors from being computed before the loop
            # and spilled (1048 bytes of spills and 1.6x slower without; a zero derived
            # from `count` is folded away, since the loop runs only while count > 0).
            opaque_zero=zero_ref[0],
            num_pairs=lax.div(count + 2 * BLOCK_K - 1, jnp.int32(2 * BLOCK_K)),
        )
        if not interpret:
            init_copy_barriers(buf.copied, THREADS)
        pl.when(wg < _COMPUTE_WGS)(functools.partial(_compute_wg, prog))
        pl.when(wg == _COMPUTE_WGS)(functools.partial(_memory_wg, prog))

    stores = 3 if st.fp8 else 1

    def entry(q_ref, q_rope_ref, *refs):  # refs: the stores, rows, counts, zero, out, lse
        store_refs, (rows_ref, counts_ref, *outs) = refs[:stores], refs[stores:]
        pl.run_scoped(
            lambda *scoped: kernel(
                q_ref, q_rope_ref, store_refs, rows_ref, counts_ref, *outs, scoped
            ),
            _buffer_types(st, interpret),
            _barrier_types(),
            collective_axes=_AXIS_WG,
        )

    return entry


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def _launch(q, q_rope, stores, rows, counts, *, st: _SparseMlaStatics, interpret):
    """The kernel on ``stores``: ``(store,)``, or an FP8 cache's ``(latent, scale, rope)``."""
    out_type = (
        jax.ShapeDtypeStruct((st.tokens, st.heads, st.dv), jnp.float32),
        jax.ShapeDtypeStruct((st.tokens, st.heads), jnp.float32),
    )
    return plgpu.kernel(
        _build_kernel(st, interpret=interpret is not None),
        out_type=out_type,
        grid=(st.heads // HEADS_PER_PROGRAM * st.tokens,),
        grid_names=(_AXIS_PROGRAM,),
        num_threads=_COMPUTE_WGS + 1,
        thread_name=_AXIS_WG,
        # No cross-warp reduction (row maxima and sums stay within a warp's quads), so
        # none of the default 2 KiB of reduction scratch; Q's rope features need it.
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            reduction_scratch_bytes=0,
        ),
        interpret=interpret,
    )(q, q_rope, *stores, rows, counts, jnp.zeros((1,), jnp.int32))


def _padded_static(
    q: jax.Array,
    q_rope: jax.Array | None,
    store: jax.Array | Fp8LatentCache,
    *,
    sm_scale: float,
    dv: int,
) -> tuple[jax.Array, jax.Array, _SparseMlaStatics]:
    """The kernel's latent and rope query refs, heads padded to a multiple of 64 (``q``
    twice when ``q_rope`` is ``None``), and its static facts."""
    tokens, heads, _ = q.shape
    heads_pad = -(-heads // HEADS_PER_PROGRAM) * HEADS_PER_PROGRAM
    if heads_pad != heads:
        pad = ((0, 0), (0, heads_pad - heads), (0, 0))
        q = jnp.pad(q, pad)
        q_rope = None if q_rope is None else jnp.pad(q_rope, pad)
    st = _SparseMlaStatics(
        tokens=tokens,
        heads=heads_pad,
        dv=dv,
        width=store.latent.shape[1] if isinstance(store, Fp8LatentCache) else store.shape[1],
        sm_scale=float(sm_scale),
        rope_at=dv if q_rope is None else 0,
        fp8=isinstance(store, Fp8LatentCache),
    )
    return q, q if q_rope is None else q_rope, st


def sparse_mla_rows_attention(
    q: jax.Array,
    store: jax.Array | Fp8LatentCache,
    rows: jax.Array,
    counts: jax.Array,
    *,
    sm_scale: float,
    dv: int = 512,
    q_rope: jax.Array | None = None,
    config: SparseMlaKernelConfig | None = None,
    interpret: object = False,
) -> tuple[jax.Array, jax.Array]:
    """Attend each query token's gathered rows (see the module docstring).

    Args:
      q: ``[N, H, dv + 64]`` bfloat16, or with ``q_rope`` its latent features ``[N, H,
        dv]``.
      store: ``[R, W]`` bfloat16, ``W >= dv + 64`` and ``W % 8 == 0``, or an
        ``Fp8LatentCache`` on the token grid ``[R]`` (``dv = 512``), whose rows the
        kernel dequantizes on chip (``bf16(float32(latent) * scale)``, the bits of
        ``dequantize_latent_cache(store).astype(bfloat16)``); only the rows named in
        ``rows`` are read.
      rows: ``[N, Kp]`` int32, ``Kp % 128 == 0`` (a pair of 64-row blocks); row ids of ``store``, the
        query's valid rows first, ``-1`` after.
      counts: ``[N]`` int32, the number of valid rows of each query (``<= Kp``).
      q_rope: ``None`` or ``[N, H, 64]`` bfloat16, the rope features of the queries,
        read where they are: a caller holding the two parts apart (the prefill
        wrappers' ``ql`` and ``qpe``) saves concatenating them, a copy of all of Q.
      config: ``SparseMlaKernelConfig`` or ``None``: the one schedule the kernel ships.
      interpret: ``True`` or ``plgpu.InterpretGPUParams``: Mosaic GPU interpret mode.

    Returns:
      ``out [N, H, dv]`` float32 and ``lse [N, H]`` float32.
    """
    if config is not None and not isinstance(config, SparseMlaKernelConfig):
        raise TypeError(
            f"config: got {type(config).__name__}, expected SparseMlaKernelConfig or None"
        )
    tokens, heads, dk = q.shape
    fp8 = isinstance(store, Fp8LatentCache)
    if fp8:
        check_fp8_cache(store, "store", grid=(None,), hint="[R]")
    store_dtype = store.rope.dtype if fp8 else store.dtype
    if q.dtype != jnp.bfloat16 or store_dtype != jnp.bfloat16:
        raise TypeError(f"q, store: got {q.dtype}, {store_dtype}, expected bfloat16")
    if q_rope is not None:
        if q_rope.dtype != jnp.bfloat16 or q_rope.shape != (tokens, heads, ROPE):
            raise ValueError(
                f"q_rope: got {q_rope.dtype} {q_rope.shape}, expected bfloat16 "
                f"{(tokens, heads, ROPE)}"
            )
        dk += ROPE
    if dv % 128 or dk != dv + ROPE:
        raise NotImplementedError(
            f"q: head dim {dk} with dv={dv}; the Hopper kernel takes Dk = Dv + {ROPE}, Dv a "
            "multiple of 128"
        )
    if fp8 and dv != FP8_LATENT:
        raise NotImplementedError(
            f"dv: got {dv}, an Fp8LatentCache store holds {FP8_LATENT} latent values per row"
        )
    if not fp8 and (store.ndim != 2 or store.shape[1] < dk or store.shape[1] % CHUNK):
        raise ValueError(
            f"store: got shape {store.shape}, expected [R, W] with W >= {dk}, W % {CHUNK} == 0"
        )
    kp = rows.shape[1]
    if rows.shape[0] != tokens or kp % (2 * BLOCK_K):
        raise ValueError(
            f"rows: got shape {rows.shape}, expected [{tokens}, Kp] with Kp a multiple of "
            f"{2 * BLOCK_K}"
        )
    q, q_rope, st = _padded_static(q, q_rope, store, sm_scale=sm_scale, dv=dv)
    out, lse = _launch(
        q,
        q_rope,
        (store.latent, store.scale, store.rope) if fp8 else (store,),
        rows.astype(jnp.int32),
        counts.astype(jnp.int32),
        st=st,
        interpret=resolve_interpret(interpret),
    )
    return out[:, :heads], lse[:, :heads]
