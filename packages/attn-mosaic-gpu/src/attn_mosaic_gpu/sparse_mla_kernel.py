"""Sparse MLA prefill on Hopper (sm_90a): the gather-attend kernel over a per-query row table.

Op (docs/design.md#sparse-mla-prefill): every query token ``n`` attends exactly the rows
``rows[n, :counts[n]]`` of a row-addressable latent store ``store [R, W]`` (``W >= Dk``);
the row table is built outside (``attn_common.sparse_mla_rows.selected_rows``: flat or
paged, units expanded to token rows, causal / ``kv_len`` / ``-1`` / duplicates already
applied, valid rows first). Keys are a row's first ``Dk = Dv + 64`` features, values its
first ``Dv = 512``. ``out [N, Hp, Dv]`` float32 and ``lse [N, Hp]`` float32 (natural log,
``-inf`` for a query with no row, whose ``out`` is 0).

Schedule (docs/sparse_mla_gpu.md has the measurements; ``sparse_mla_config`` every size,
buffer and barrier; ``_sparse_mla_rows`` how rows reach shared memory)
--------------------------------------------------------------------------------------
One program per (query token, group of 64 heads), launched in chunks of ``TOKEN_LAG``
tokens: the chunk's head group 0 programs, then its head group 1 programs, and so on, so
each head group of a token runs a few programs behind the one before and reads the
token's rows from L2, where the earlier one brought them (``lagged_program``). Three
warpgroups (``num_threads=3``), registers 232 / 232 / 40 (``setmaxnreg``).

Shared memory (``ForwardBuffers``): all of Q (its latent and rope features, loaded once
by TMA, from one ``[N, H, Dk]`` array or from two, ``q_rope``: the prefill wrapper's
``ql`` and ``qpe`` as they come, never joined into a copy), one pair of 64-row key blocks
(block 0 is WG0's, block 1 WG1's), WG1's P, the row statistics the compute WGs swap, and
the four hand-kept ``part_landed`` mbarriers. WG0's P goes where its block's rope
features were (dead after its QK^T). QK^T wgmmas are N = 64 wide, so Q is read from
shared memory once per 64 keys.

Each block is two parts (``Part``) with their own barriers: ``L`` (latent features
0-255, WG0's value half) and ``R`` (latent 256-511, WG1's value half, and the rope
features), so the next pair streams in while this one is used.

* WG2 (memory) gathers the token's selected rows with 16-byte ``cp.async`` copies issued
  by all 128 threads (Hopper's TMA has no row gather) straight into the 128-byte-swizzled
  tiled layout wgmma reads (``gather_part``). Rows past ``counts[n]`` are zero-filled, so
  stale shared memory never reaches the value product. It refills the parts in the order
  they are freed (``_REFILL_ORDER``): ``L0`` and ``R1`` (each WG's own value half), then
  ``R0`` and ``L1``, each once its ``part_free`` barrier says its last reader is done.
  It does not wait for a part's copies: each thread arrives on the part's
  ``part_landed`` barrier once its own copies have landed (``.noinc``, 128 arrivals);
  the waiting compute thread fences the async proxy (the copies are generic-proxy
  writes, wgmma reads through the async proxy).
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
  ``P_0`` is) once its product with ``P_0`` has.
* At the end the WGs add their row sums through shared memory (``sums_ready``),
  normalise, and store their output half to global memory; WG0 writes the LSE.

Invariants:

* Every pair is walked by both compute WGs and the memory WG alike (``ceil(counts[n] /
  128)`` pairs), so every barrier's arrival count is static; every barrier gets one
  arrival and one wait per pair, and a WG overwrites a ``stats`` or ``P`` buffer only
  after a wait that the other WG's last read of it precedes, so no barrier runs two
  phases ahead of its waiter. The memory WG drains the last pair's ``part_free`` before
  the barriers are freed.
* Every buffer is addressed with ``p & opaque_zero`` (an input that holds 0) each pair:
  with one pair of blocks every address is loop-invariant, and the compiler would
  otherwise compute all 80 wgmma descriptors before the loop and spill them. A zero
  derived from ``count`` is folded away.
* Softmax in base 2; the running max starts at the finite ``M_INIT``, so a row with no
  key yet never computes ``-inf - -inf``; ``l == 0`` at the end marks an empty row (out
  0, LSE ``-inf``).

FP8 latent cache (``store`` an ``attn_common.Fp8LatentCache``: 656 bytes a row against
1,152): the same schedule, slots and barriers; only the bytes that land differ, and who
turns them into bf16. Hopper has no copy that converts, and Q and the pair leave no room
for a staging buffer, so each part is staged inside its own slot:

* WG2 (``stage_part_fp8``) copies by ``cp.async``, with the same thread map and
  zero-fill as the bf16 gather, a row's 256 FP8 bytes of the part into the part's
  feature tiles 2 and 3 (``fp8_stage``), its 16 bytes of scales into chunk 0 of the
  part's tile 0 (``fp8_scale_at``), and for part ``R`` its bf16 rope features as
  before; the ``part_landed`` barriers work as for bf16.
* The compute WG that owns the block (WG0 block 0, WG1 block 1), once a part has landed
  and before its QK^T, dequantizes it in place (``dequantize_part_fp8``,
  ``fp8_dequant_map``): two threads per row, neighbours in a warp; each loads its 8
  staged 16-byte chunks and its group's scale, the warp syncs (each overwrites chunks
  the other loaded), then each converts (``bf16(float32(e4m3) * scale)``, the bits of
  ``dequantize_latent_cache(store).astype(bfloat16)``) and stores 16 chunks into the
  swizzled slot; an async-proxy fence and a warpgroup barrier, then the wgmma. The
  other WG reads the part as values only after ``p_ready`` of its owner, which follows
  the owner's dequantization. The kernel is then bound by the compute WGs
  (docs/fp8_cache.md).

Query-blocked (``sparse_mla_union_attention``, ``query_block > 1``; ``H <= 32``): a
program's "token" is a block of ``query_block = 64 / Hq`` consecutive queries (``Hq``
each query's heads, padded to a power of two), its 64 rows their heads query-major (Q
``[N, Hq, Dk]`` reshaped to ``[N / query_block, 64, Dk]``), its row table the block's
union (``attn_common.sparse_mla_rows.block_union``), gathered once by WG2 as above.
Each compute WG loads the 64 int32 membership words of its block of pair ``p`` from
global memory (``_member_words``, in the score tile's column layout; issued before the
scores are waited for) and masks ``S[r, c]`` to ``-inf`` where bit ``r / Hq`` of word
``c`` is clear (``_masked_scores``), on every pair: the words past the union's count
are 0, so no count compare is needed. Nothing else changes: the barriers, the
exchanges and the FP8 path are the per-query schedule's.

Interpret mode (``interpret=True``, the CPU tests) runs the same schedule and barriers
(``_interpret.Target``); the interpreter runs no inline Mosaic GPU code, so rows are
copied by plain loads and stores and the memory WG publishes them on ``part_ready``, and
no wgmma with its A operand in registers, so each P is read back from shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common.fp8_cache import LATENT as FP8_LATENT
from attn_common.fp8_cache import Fp8LatentCache, check_fp8_cache
from attn_common.sparse_mla_rows import BlockUnion
from attn_mosaic_gpu import _axes
from attn_mosaic_gpu._interpret import Target, resolve_interpret, resolve_target
from attn_mosaic_gpu._registers import memory_registers
from attn_mosaic_gpu._sparse_mla_rows import lagged_program, launch_args, parts_of
from attn_mosaic_gpu.fastmath import LN2, LOG2E, M_INIT
from attn_mosaic_gpu.sparse_mla_config import (
    BLOCK_K,
    CHUNK,
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    HEADS_PER_PROGRAM,
    PAIR_ROWS,
    Q_LATENT,
    Q_ROPE,
    ROPE,
    TOKEN_LAG,
    ForwardBarriers,
    ForwardBuffers,
    Part,
    SparseMlaKernelConfig,
    forward_scratch,
    unsupported_dv,
)

__all__ = [
    "SparseMlaKernelConfig",
    "query_block_for",
    "resolve_interpret",
    "sparse_mla_rows_attention",
    "sparse_mla_union_attention",
]

_AXIS_PROGRAM = _axes.PROGRAMS
_AXIS_WG = _axes.WARPGROUP


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
    # Queries per program (query-blocked: a "token" is a block of this many queries, its
    # 64 rows their heads query-major, its row table their union; 1: one query).
    query_block: int = 1


_HALVES = ("L", "R")
# The memory WG's refill order within a pair: each WG's own value half first (freed
# mid-pair), then the halves the other WG's value product reads.
_REFILL_ORDER = ((Part.L0, Part.R1), (Part.R0, Part.L1))


@dataclasses.dataclass(frozen=True)
class _Program:
    """What every warpgroup of one program reads: the static facts, the refs, the
    shared memory and barriers, and its token's values."""

    st: _SparseMlaStatics
    target: Target
    parts: Any  # how the key parts land: _sparse_mla_rows.Parts (compiled) or the interpreter's
    q_ref: Any
    q_rope_ref: Any
    stores: tuple  # (store,) bf16, or an FP8 cache's (latent, scale, rope) row arrays
    rows_ref: Any
    member_ref: Any  # query-blocked: [NB, Up] int32 membership bits; else None
    out_ref: Any
    lse_ref: Any
    q_dst: tuple[Any, Any]  # Q's latent and rope features' TMA destinations
    buf: ForwardBuffers
    bar: ForwardBarriers
    wg: Any  # this warpgroup's index (traced)
    token: Any
    h0: Any  # first head of the head group
    count: Any  # rows of the token
    opaque_zero: Any  # 0 at run time, opaque to the compiler (see the module docstring)
    num_pairs: Any

    @property
    def half(self) -> int:
        return self.st.dv // COMPUTE_WGS

    def pair_sync(self) -> None:
        plgpu.barrier_arrive(self.bar.sums_ready)
        plgpu.barrier_wait(self.bar.sums_ready)


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
    plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
    st, bar, heads = prog.st, prog.bar, HEADS_PER_PROGRAM
    other = 1 - prog.wg

    @pl.when(prog.wg == 0)
    def _load_q():
        parts = (
            (prog.q_ref, 0, st.dv, prog.q_dst[Q_LATENT]),
            (prog.q_rope_ref, st.rope_at, ROPE, prog.q_dst[Q_ROPE]),
        )
        for i, (src, lo, width, dst) in enumerate(parts):
            plgpu.copy_gmem_to_smem(
                src.at[prog.token, pl.ds(prog.h0, heads), pl.ds(lo, width)], dst, bar.q_landed.at[i]
            )

    plgpu.barrier_wait(bar.q_landed.at[Q_LATENT])
    plgpu.barrier_wait(bar.q_landed.at[Q_ROPE])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    init = _RowInit(
        row_layout,
        plgpu.layout_cast(jnp.full((heads,), M_INIT, jnp.float32), row_layout),
        plgpu.layout_cast(jnp.full((heads,), 0.0, jnp.float32), row_layout),
        plgpu.layout_cast(jnp.full((heads, BLOCK_K), 0.0, jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((heads, prog.half), 0.0, jnp.float32), plgpu.Layout.WGMMA),
    )
    for w in range(COMPUTE_WGS):

        @pl.when(prog.wg == w)
        def _pairs(w=w):
            _finish(prog, init, other, *_run_pairs(prog, w, init))


def _run_pairs(prog: _Program, w: int, init: _RowInit):
    """WG ``w``'s pair loop: ``(acc, m, l)`` at the end. S and the value accumulator are
    ACC refs (compiled) or values (interpreted: ``Target.accumulators``)."""

    def loop(s_ref, acc_ref):
        step = functools.partial(_pair_step, prog, w, init, s_ref, acc_ref)
        acc = prog.target.pick(None, init.acc_zero)  # carried only as a value
        m_i, l_i, acc = _walk_pairs(prog, step, (init.m, init.l, acc))
        return prog.target.value(acc, acc_ref), m_i, l_i

    return prog.target.accumulators(
        loop, (HEADS_PER_PROGRAM, BLOCK_K), (HEADS_PER_PROGRAM, prog.half)
    )


def _walk_pairs(prog: _Program, step, init):
    """``step(p, carry, masked=...)`` over every pair: first the pairs wholly below the
    query's row count, whose columns are all rows and need no mask (no column iota,
    compare and select per score, nor the registers they hold), then the last, partial
    pair, if any, masked."""
    if prog.st.query_block > 1:  # every pair masked, by membership
        return lax.fori_loop(0, prog.num_pairs, functools.partial(step, masked=True), init)
    full = lax.div(prog.count, jnp.int32(PAIR_ROWS))
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
    # Query-blocked: the block's membership words, loaded before the scores are waited for.
    words = _member_words(prog, p) if masked and prog.st.query_block > 1 else None
    s = _masked_scores(prog, p, _scores(prog, w, init, s_ref, o, p), masked, words)
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
    scale2 = prog.st.sm_scale * LOG2E
    probs = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_own, s.shape, [0]))
    alpha = jnp.exp2(m_i - m_own)
    l_i = l_i * alpha + probs.sum(axis=1)
    p16 = probs.astype(jnp.bfloat16)
    own_p = prog.target.stage(p16, p_mine)  # the A operand, from registers
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
    V_1``, hand back ``L1``."""
    buf, bar = prog.buf, prog.bar
    prog.target.wgmma_wait(0)
    plgpu.barrier_arrive(bar.part_free.at[Part.L0])
    plgpu.barrier_wait(bar.max_ready.at[1])
    m_new = plgpu.load(buf.stats.at[1], layout=init.row_layout, optimized=False)
    shift = jnp.exp2(m_own - m_new)
    p_mine[...] = (probs * lax.broadcast_in_dim(shift, s.shape, [0])).astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.barrier_arrive(bar.p_ready.at[0])
    l_i = l_i * shift
    plgpu.barrier_wait(bar.p_ready.at[1])
    acc = _pv_add(prog, acc, acc_ref, p_theirs, their_v, _to_acc(prog, shift))
    prog.target.wgmma_wait(0)
    plgpu.barrier_arrive(bar.part_free.at[Part.L1])
    return m_new, l_i, acc


def _wg1_exchange(prog: _Program, acc, acc_ref, m_own, l_i, p16, p_mine, p_theirs, their_v):
    """WG1 after issuing its own product: publish ``P_1``, add ``P_0 V_0`` (``P_0``
    already on the pair's max), hand back ``R1`` and then ``R0``."""
    bar = prog.bar
    p_mine[...] = p16  # (interpreted, staged there already for the own product)
    plgpu.commit_smem()
    plgpu.barrier_arrive(bar.p_ready.at[1])
    plgpu.barrier_wait(bar.p_ready.at[0])
    acc = _pv_add(prog, acc, acc_ref, p_theirs, their_v)
    prog.target.wgmma_wait(1)
    plgpu.barrier_arrive(bar.part_free.at[Part.R1])
    prog.target.wgmma_wait(0)
    plgpu.barrier_arrive(bar.part_free.at[Part.R0])
    return m_own, l_i, acc


def _qk_part(prog: _Program, w: int, half: str, acc, o, p):
    """Wait for part ``half`` of WG ``w``'s block of pair ``p``; add its QK^T to ``acc``."""
    buf = prog.buf
    prog.parts.wait(Part.of(w, half), p)
    prog.parts.dequantize(half, lambda: buf.k_lat.at[w + o])  # FP8: this WG's own block
    feats = pl.ds(_HALVES.index(half) * prog.half, prog.half)
    k_part = buf.k_lat.at[w + o].at[:, feats].transpose((1, 0))
    plgpu.wgmma(acc, buf.q_lat.at[o].at[:, feats], k_part)
    if half == "R":
        plgpu.wgmma(acc, buf.q_rope.at[o], buf.k_rope.at[w + o].transpose((1, 0)))


def _scores(prog: _Program, w: int, init: _RowInit, s_ref, o, p):
    """S of WG ``w``'s block of pair ``p`` (WG0: part L then R; WG1: R then L)."""
    first, second = _HALVES[w], _HALVES[1 - w]

    def qk(acc_ref):
        _qk_part(prog, w, first, acc_ref, o, p)
        _qk_part(prog, w, second, acc_ref, o, p)

    return prog.target.product(s_ref, (HEADS_PER_PROGRAM, BLOCK_K), qk, zero=init.s_zero)


def _member_words(prog: _Program, p):
    """Query-blocked: the membership words of this WG's 64 rows of pair ``p`` (``[64]``
    int32, one per key row, in the layout of a score tile's columns)."""
    cols = pl.ds((2 * p + prog.wg) * BLOCK_K, BLOCK_K)
    return plgpu.load(
        prog.member_ref.at[prog.token, cols], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False
    )


def _masked_scores(prog: _Program, p, s, masked: bool, words=None):
    """This WG's scores of pair ``p``, ``-inf`` past the query's row count (``masked``;
    a pair wholly below the count is returned as it is); query-blocked, ``-inf`` where
    the row's query does not attend the key (bit ``row // heads_per_query`` of the key's
    membership word; the words past the union's count are 0)."""
    if not masked:
        return s
    if words is not None:
        shape = (HEADS_PER_PROGRAM, BLOCK_K)
        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        shift = (HEADS_PER_PROGRAM // prog.st.query_block).bit_length() - 1
        query = lax.shift_right_logical(row, jnp.int32(shift))
        bits = lax.shift_right_logical(lax.broadcast_in_dim(words, shape, [1]), query)
        return jnp.where(lax.bitwise_and(bits, jnp.int32(1)) != 0, s, -jnp.inf)
    col = (2 * p + prog.wg) * BLOCK_K + plgpu.broadcasted_iota(
        jnp.int32, (HEADS_PER_PROGRAM, BLOCK_K), 1, layout=plgpu.Layout.WGMMA
    )
    return jnp.where(col < prog.count, s, -jnp.inf)


def _scaled_max(prog: _Program, s):
    """Row max of ``s`` in the exp2 domain; a row with no key yet gets the finite
    ``M_INIT``, never ``-inf``."""
    block_max = s.max(axis=1)
    return jnp.where(block_max > -jnp.inf, block_max * (prog.st.sm_scale * LOG2E), M_INIT)


def _to_acc(prog: _Program, x):
    return lax.broadcast_in_dim(x, (HEADS_PER_PROGRAM, prog.half), [0])


def _pv_add(prog: _Program, acc, acc_ref, a, v, scale=None):
    """``acc * scale + a @ v``, not waited for (``Target.add_product``)."""

    def pv(ref):
        plgpu.wgmma(ref, a, v)

    return prog.target.add_product(acc, acc_ref, (HEADS_PER_PROGRAM, prog.half), pv, scale)


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
        lse = jnp.where(has_key, (m_i + jnp.log2(jnp.where(has_key, l_tot, 1.0))) * LN2, -jnp.inf)
        prog.lse_ref.at[prog.token, heads][...] = lse


def _memory_wg(prog: _Program):
    """WG2: gather every pair's parts in ``_REFILL_ORDER``, each once it is free."""
    plgpu.set_max_registers(memory_registers(COMPUTE_REGISTERS), action="decrease")
    buf, bar = prog.buf, prog.bar
    gather = {half: prog.parts.gather(half) for half in _HALVES}

    @pl.loop(0, prog.num_pairs)
    def _issue(p):
        for parts in _REFILL_ORDER:
            for part in parts:

                @pl.when(p >= 1)
                def _wait_free(part=part):
                    plgpu.barrier_wait(bar.part_free.at[part])

                rows = pl.ds((2 * p + part.block) * BLOCK_K, BLOCK_K)
                gather[part.half](
                    *prog.stores,
                    prog.rows_ref.at[prog.token, rows],
                    buf.k_lat.at[part.block],
                    buf.k_rope.at[part.block],
                )
                prog.parts.publish(part)

    # Drain: observe the consumption of the last pair before the barriers die.
    @pl.when(prog.num_pairs > 0)
    def _drain():
        for part in Part:
            plgpu.barrier_wait(bar.part_free.at[part])


def _kernel(st: _SparseMlaStatics, target: Target):
    """The kernel body: the program's token and head group, then each warpgroup's part
    (the module docstring has the schedule)."""

    def kernel(*refs):
        # inputs (global memory): q_ref [N, Hp, Dv + 64] bf16, or Q's latent features
        # [N, Hp, Dv]; q_rope_ref [N, Hp, 64] bf16 Q's rope features, or q_ref (from
        # st.rope_at); the stores: (store [R, W] bf16,) or (latent [R, 512] e4m3,
        # scale [R, 4] f32, rope [R, 64] bf16).
        stores_end = 2 + (3 if st.fp8 else 1)
        q_ref, q_rope_ref = refs[:2]
        stores = refs[2:stores_end]
        (
            rows_ref,  # [N, Kp] int32: each query's rows, valid first, -1 after
            counts_ref,  # [N] int32: each query's valid rows
            *member,  # query-blocked: ([NB, Up] int32 membership bits,); else ()
            zero_ref,  # [1] int32: holds 0 (opaque_zero)
            # outputs (global memory)
            out_ref,  # [N, Hp, Dv] f32
            lse_ref,  # [N, Hp] f32, natural log
            # scratch (shared memory)
            buf,  # ForwardBuffers
            bar,  # ForwardBarriers
        ) = refs[stores_end:]
        # Q's TMA destinations (the buffers' leading axis of 1 is for `p & opaque_zero`).
        q_dst = (buf.q_lat.at[0], buf.q_rope.at[0])
        group, token = lagged_program(lax.axis_index(_AXIS_PROGRAM), TOKEN_LAG, st)
        wg = lax.axis_index(_AXIS_WG)
        h0 = group * HEADS_PER_PROGRAM
        count = counts_ref[token]
        prog = _Program(
            st=st,
            target=target,
            parts=parts_of(target, st, buf, bar, fp8=st.fp8),
            q_ref=q_ref,
            q_rope_ref=q_rope_ref,
            stores=stores,
            rows_ref=rows_ref,
            member_ref=member[0] if member else None,
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
            num_pairs=lax.div(count + PAIR_ROWS - 1, jnp.int32(PAIR_ROWS)),
        )
        prog.parts.init()
        pl.when(wg < COMPUTE_WGS)(functools.partial(_compute_wg, prog))
        pl.when(wg == COMPUTE_WGS)(functools.partial(_memory_wg, prog))

    return kernel


@functools.partial(jax.jit, static_argnames=("st", "target"))
def _launch(q, q_rope, stores, rows, counts, member, *, st: _SparseMlaStatics, target: Target):
    """The kernel on ``stores``: ``(store,)``, or an FP8 cache's ``(latent, scale, rope)``;
    ``member``: ``(bits,)`` query-blocked, else ``()``."""
    out_type = (
        jax.ShapeDtypeStruct((st.tokens, st.heads, st.dv), jnp.float32),
        jax.ShapeDtypeStruct((st.tokens, st.heads), jnp.float32),
    )
    scratch = forward_scratch(st.dv, interpret=target.interpret)
    launch = launch_args(_kernel(st, target), st, target, scratch)
    call = plgpu.kernel(out_type=out_type, **launch)
    return call(q, q_rope, *stores, rows, counts, *member, jnp.zeros((1,), jnp.int32))


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


def _checked(q, store, q_rope, dv: int, config) -> int:
    """Validate the inputs both public functions share; ``Dk`` (with ``q_rope``'s)."""
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
    if dk != dv + ROPE:
        raise NotImplementedError(
            f"q: head dim {dk} with dv={dv}; the Hopper kernel takes Dk = Dv + {ROPE}"
        )
    if (reason := unsupported_dv(dv)) is not None:
        raise NotImplementedError(reason)
    if fp8 and dv != FP8_LATENT:
        raise NotImplementedError(
            f"dv: got {dv}, an Fp8LatentCache store holds {FP8_LATENT} latent values per row"
        )
    if not fp8 and (store.ndim != 2 or store.shape[1] < dk or store.shape[1] % CHUNK):
        raise ValueError(
            f"store: got shape {store.shape}, expected [R, W] with W >= {dk}, W % {CHUNK} == 0"
        )
    return dk


def _store_arrays(store) -> tuple:
    if isinstance(store, Fp8LatentCache):
        return (store.latent, store.scale, store.rope)
    return (store,)


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
    _checked(q, store, q_rope, dv, config)
    tokens, heads, _ = q.shape
    kp = rows.shape[1]
    if rows.shape[0] != tokens or kp % PAIR_ROWS:
        raise ValueError(
            f"rows: got shape {rows.shape}, expected [{tokens}, Kp] with Kp a multiple of "
            f"{PAIR_ROWS}"
        )
    q, q_rope, st = _padded_static(q, q_rope, store, sm_scale=sm_scale, dv=dv)
    out, lse = _launch(
        q,
        q_rope,
        _store_arrays(store),
        rows.astype(jnp.int32),
        counts.astype(jnp.int32),
        (),
        st=st,
        target=resolve_target(interpret),
    )
    return out[:, :heads], lse[:, :heads]


def query_block_for(heads: int) -> int:
    """The query-blocked kernel's queries per program at ``heads`` heads: ``64 // Hq``,
    ``Hq`` the power of two ``>= max(heads, 2)`` its query's heads are padded to (1 at
    ``heads > 32``: nothing to block, each query fills its own program)."""
    hq = 1 << max(int(heads) - 1, 1).bit_length()
    return max(HEADS_PER_PROGRAM // hq, 1)


def sparse_mla_union_attention(
    q: jax.Array,
    store: jax.Array | Fp8LatentCache,
    union: BlockUnion,
    *,
    sm_scale: float,
    dv: int = 512,
    q_rope: jax.Array | None = None,
    config: SparseMlaKernelConfig | None = None,
    interpret: object = False,
) -> tuple[jax.Array, jax.Array]:
    """Query-blocked: attend each block's union of rows, each query its own (module docstring).

    ``q``, ``store``, ``q_rope``, ``config``, ``interpret``: as for
    :func:`sparse_mla_rows_attention`, with ``H <= 32`` and ``N`` a multiple of
    ``query_block_for(H)``; ``union``: ``attn_common.sparse_mla_rows.block_union`` of the
    queries' row tables at that query block (``Up % 128 == 0``). Each query's heads are
    padded to ``Hq = 64 // query_block``, so a block's queries fill one program's 64
    rows. Returns ``out [N, H, dv]`` and ``lse [N, H]`` float32, the same as the
    per-query kernel on the queries' own rows.
    """
    _checked(q, store, q_rope, dv, config)
    tokens, heads, _ = q.shape
    qb = query_block_for(heads)
    hq = HEADS_PER_PROGRAM // qb
    nb, up = union.rows.shape
    if qb == 1:
        raise ValueError(f"q: {heads} heads fill a program alone; there is no query block")
    if tokens != nb * qb or union.member.shape != (nb, up) or union.counts.shape != (nb,):
        raise ValueError(
            f"union: got rows {union.rows.shape}, member {union.member.shape}, counts "
            f"{union.counts.shape}, expected [{tokens // qb}, Up] twice and [{tokens // qb}] "
            f"for {tokens} queries in blocks of {qb}"
        )
    if up % PAIR_ROWS:
        raise ValueError(f"union: width {up} is not a multiple of {PAIR_ROWS}")

    def packed(x):  # [N, H, D] -> [NB, 64, D]: a block's queries' heads, padded to hq
        x = jnp.pad(x, ((0, 0), (0, hq - heads), (0, 0))) if hq != heads else x
        return x.reshape(nb, HEADS_PER_PROGRAM, x.shape[-1])

    qp = packed(q)
    st = _SparseMlaStatics(
        tokens=nb,
        heads=HEADS_PER_PROGRAM,
        dv=dv,
        width=_store_arrays(store)[0].shape[1],
        sm_scale=float(sm_scale),
        rope_at=dv if q_rope is None else 0,
        fp8=isinstance(store, Fp8LatentCache),
        query_block=qb,
    )
    out, lse = _launch(
        qp,
        qp if q_rope is None else packed(q_rope),
        _store_arrays(store),
        union.rows.astype(jnp.int32),
        union.counts.astype(jnp.int32),
        (union.member.astype(jnp.int32),),
        st=st,
        target=resolve_target(interpret),
    )
    return (
        out.reshape(tokens, hq, dv)[:, :heads],
        lse.reshape(tokens, hq)[:, :heads],
    )
