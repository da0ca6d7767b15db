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
One program per (query token, group of 64 heads), launched in chunks of 8 tokens: the
chunk's head group 0 programs, then its head group 1 programs, and so on, so each head
group of a token runs a few programs behind the one before and reads the token's rows
from L2, where the earlier one brought them (``_lagged_program``). Three warpgroups
(``num_threads=3``), registers 232 / 232 / 40 (``setmaxnreg``).

Shared memory (``_Buffers``; Q and the pair take 216 of the 227 KiB): all of Q (72 KiB: its 512 latent and
64 rope features, loaded once by TMA, one copy each, from one ``[N, H, Dk]`` array or
from two, ``q_rope``: the prefill wrapper's ``ql`` and ``qpe`` as they come, never joined
into a copy of Q), one pair of 64-row blocks of keys (144 KiB; block 0 is WG0's, block 1
WG1's), WG1's P, the row statistics the compute WGs swap, and four hand-kept mbarriers.
WG0's P goes where its block's rope features were (dead after its QK^T). QK^T wgmmas
are N = 64 wide, so Q is read from shared memory once per 64 keys.

Each block is two parts (``_Part``) with their own barriers: ``L`` (latent features
0-255, WG0's value half) and ``R`` (latent 256-511, WG1's value half, and the rope
features), so the next pair streams in while this one is used.

* WG2 (memory) gathers the token's selected rows with 16-byte ``cp.async`` copies issued
  by all 128 threads (Hopper's TMA has no row gather): 8 threads per row, each copying the
  same 16-byte chunk of every 64-feature tile of its rows, straight into the
  128-byte-swizzled tiled layout wgmma reads (``_gather_part``). Rows past ``counts[n]``
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

* WG2 (``_stage_part_fp8``) copies by ``cp.async``, with the same thread map and
  zero-fill as the bf16 gather, a row's 256 FP8 bytes of the part into the part's
  feature tiles 2 and 3 (``_fp8_stage``), its 16 bytes of scales into chunk 0 of the
  part's tile 0 (``_fp8_scale_at``), and for part ``R`` its bf16 rope features as
  before; the copy barriers work as for bf16 (``noinc`` arrivals).
* The compute WG that owns the block (WG0 block 0, WG1 block 1), once a part's copies
  have landed and before its QK^T, dequantizes it in place (``_dequantize_part_fp8``,
  ``_fp8_dequant_map``): two threads per row, neighbours in a warp; each loads its 8
  staged 16-byte chunks and its group's scale, the warp syncs (each overwrites chunks
  the other loaded), then each converts (``bf16(float32(e4m3) * scale)``, the bits of
  ``dequantize_latent_cache(store).astype(bfloat16)``) and stores 16 chunks into the
  swizzled slot; an async-proxy fence and a warpgroup barrier, then the wgmma. The
  other WG reads the part as values only after ``p_ready`` of its owner, which follows
  the owner's dequantization.

On the H200 this runs at 0.65-0.78x the bf16 kernel (docs/sparse_mla_gpu.md): the
dequantization (about 3.2 instructions per value) sits on each compute WG's path before
its QK^T and adds about 1 ms per head group of 4096 queries x 2048 rows, more than the
bytes saved. Registers 232 / 232 / 40, as for bf16.

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
import enum
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common.fp8_cache import GROUP as FP8_GROUP
from attn_common.fp8_cache import LATENT as FP8_LATENT
from attn_common.fp8_cache import Fp8LatentCache, check_fp8_cache
from attn_mosaic_gpu._interpret import resolve_interpret
from attn_mosaic_gpu._registers import memory_registers

__all__ = ["SparseMlaKernelConfig", "resolve_interpret", "sparse_mla_rows_attention"]

HEADS_PER_PROGRAM = 64  # wgmma M rows per warpgroup; both compute WGs share the heads
ROPE = 64  # rope features of a key row (Dk - Dv)
BLOCK_K = 64  # rows per block; a pair of blocks (one per compute WG) per step
_COMPUTE_WGS = 2
# setmaxnreg of each compute WG; the memory WG keeps the rest of the 504 per thread slot
# (40). 232 ran the kernel 1.09-1.10x faster than 240/24 on the H200, 224/56 as fast.
_COMPUTE_REGISTERS = 232
# Launch order: a token's head groups this many tokens apart, so the later ones find its
# rows in L2 (fetched by head group 0): 1.01-1.04x faster than all of head group 0 first.
_TOKEN_LAG = 8
_THREADS = 128  # per warpgroup
_CHUNK = 8  # bf16 elements per 16-byte cp.async
_SWIZZLE = 128  # bytes: wgmma's A and B share one swizzle; 64-row blocks take 128
_TILE = _SWIZZLE // 2  # bf16 columns of a swizzled tile
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30
_AXIS_PROGRAM = "program"
_AXIS_WG = "wg"
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


class _Part(enum.IntEnum):
    """A part of a block of the pair, valued as the index of its barriers in ``ready``,
    ``consumed`` and the hand-kept copy barriers. Block 0 is WG0's, block 1 WG1's; part
    ``L`` holds latent features 0-255 (WG0's value half), part ``R`` latent features
    256-511 (WG1's value half) and the rope features."""

    L0 = 0
    R0 = 1
    L1 = 2
    R1 = 3

    @classmethod
    def of(cls, block: int, half: str) -> _Part:
        return cls[f"{half}{block}"]

    @property
    def block(self) -> int:
        return int(self.name[1])

    @property
    def half(self) -> str:
        return self.name[0]


_HALVES = ("L", "R")
# The memory WG's refill order within a pair: each WG's own value half first (freed
# mid-pair), then the halves the other WG's value product reads.
_REFILL_ORDER = ((_Part.L0, _Part.R1), (_Part.R0, _Part.L1))


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

    # [4] per _Part: the memory WG's copies have landed. Interpret mode only: compiled,
    # the copies arrive on their hand-kept barriers (`_Buffers.copied`) and this one is
    # unused, though allocated (32 bytes) as it was before the other schedules left.
    ready: Any
    consumed: Any  # [4] per _Part: its last reader is done; the memory WG may refill it
    q_ready: Any  # [2]: Q's latent / rope features have landed (_Q_LATENT, _Q_ROPE)
    pair: Any  # both compute WGs: the row sums are in `stats`
    max_ready: Any  # [2] per compute WG: its running max of the pair is in `stats`
    p_ready: Any  # [2] per compute WG: its P of the pair is in shared memory


def _buffer_types(st: _SparseMlaStatics, interpret: bool) -> _Buffers:
    tiled = _transforms()
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
        copied=None if interpret else plgpu.SMEM((2 * len(_Part),), jnp.uint32),
    )


def _barrier_types() -> _Barriers:
    parts = len(_Part)
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


def _lagged_program(i, lag: int, st: _SparseMlaStatics):
    """(head group, token) of program ``i`` in the lagged launch order: chunks of ``lag``
    tokens (the last one shorter), each all of its tokens' head group 0, then 1...: so a
    token's head group ``g`` starts about ``g * lag`` programs after its head group 0."""
    groups = st.heads // HEADS_PER_PROGRAM
    chunk = lax.div(i, jnp.int32(groups * lag))
    within = i - chunk * (groups * lag)
    size = jnp.minimum(jnp.int32(lag), st.tokens - chunk * lag)
    return lax.div(within, size), chunk * lag + lax.rem(within, size)


def _transforms():
    """Every wgmma operand's shared-memory layout: 64-wide tiles, 128-byte swizzle."""
    return (plgpu.TilingTransform((8, _TILE)), plgpu.SwizzleTransform(_SWIZZLE))


def _gather_part(st: _SparseMlaStatics, half: str):
    """cp.async gather of part ``half`` (``"L"``: latent features 0-255; ``"R"``: latent
    256-511 and the rope features) of one block of rows into its slots (see the module
    docstring).

    The shared-memory slots are tiled ``[rows / 8, features / 64, 8, 64]`` and swizzled:
    16-byte chunk ``c`` of row ``r`` of a tile sits at chunk ``c ^ (r % 8)``. 8 threads
    share a row, thread ``t`` copying chunk ``t % 8`` of every tile of rows ``t // 8 + 16
    i``, so a warp reads whole 128-byte segments. Rows with id ``< 0`` copy 0 source
    bytes, which zero-fills the 16 destination bytes.
    """
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, memref, nvvm

    dv, width, tile = st.dv, st.width, _TILE
    chunks = tile // _CHUNK  # threads per row
    row_groups = _THREADS // chunks
    rows_per_thread = BLOCK_K // row_groups
    latent_tiles, rope_tiles = dv // tile, ROPE // tile
    tiled = _transforms()

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(tiled), plgpu.RefType(tiled)),
    )
    def gather(ctx, store, rows, latent, rope):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        bf16 = ir.BF16Type.get()
        index = ir.IndexType.get()

        def const(v, ty=i32):
            return arith.constant(ty, v)

        lane = arith.remui(mgpu_utils.thread_idx(), const(_THREADS))
        group = arith.divui(lane, const(chunks))
        chunk = arith.remui(lane, const(chunks))
        store_ptr = llvm.addrspacecast(
            llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(store)
        )
        latent_ptr, rope_ptr = mgpu_utils.memref_ptr(latent), mgpu_utils.memref_ptr(rope)
        # (slot, tiles per row of the slot, tile in the slot, feature tile of the row)
        first = 0 if half == "L" else latent_tiles // 2
        latent_range = range(first, first + latent_tiles // 2)
        copies = [(latent_ptr, latent_tiles, j, j) for j in latent_range]
        if half == "R":
            copies += [(rope_ptr, rope_tiles, j, latent_tiles + j) for j in range(rope_tiles)]
        for i in range(rows_per_thread):
            r = arith.addi(group, const(row_groups * i))
            row = memref.load(rows, [arith.index_cast(index, r)])
            valid = arith.cmpi(arith.CmpIPredicate.sge, row, const(0))
            src_bytes = arith.select(valid, const(16), const(0))
            # Element offset of the thread's chunk of feature tile 0, global and shared.
            src0 = arith.addi(
                arith.muli(arith.extui(i64, arith.select(valid, row, const(0))), const(width, i64)),
                arith.extui(i64, arith.muli(chunk, const(_CHUNK))),
            )
            r_lo = arith.remui(r, const(8))
            in_tile = arith.addi(
                arith.muli(r_lo, const(tile)),
                arith.muli(arith.xori(chunk, r_lo), const(_CHUNK)),
            )
            row_tile = arith.divui(r, const(8))
            for dst_base, tiles, j, feature_tile in copies:
                first_tile = arith.addi(arith.muli(row_tile, const(tiles)), const(j))
                dst_off = arith.addi(arith.muli(first_tile, const(8 * tile)), in_tile)
                src_off = arith.addi(src0, const(feature_tile * tile, i64))
                nvvm.cp_async_shared_global(
                    mgpu_utils.getelementptr(dst_base, [dst_off], bf16),
                    mgpu_utils.getelementptr(store_ptr, [src_off], bf16),
                    16,
                    nvvm.LoadCacheModifierKind.CG,
                    cp_size=src_bytes,
                )
        nvvm.cp_async_commit_group()

    return gather


def _gather_part_interpret(st: _SparseMlaStatics, half: str):
    """The same gather for interpret mode, which does not run inline Mosaic GPU code."""
    dv = st.dv
    lo, hi = {"L": (0, dv // 2), "R": (dv // 2, dv)}[half]

    def gather(store, rows, latent, rope):
        def one(r, carry):
            row = rows[r]
            data = store[jnp.maximum(row, 0), pl.ds(0, dv + ROPE)]
            data = jnp.where(row >= 0, data, jnp.zeros_like(data))
            latent[r, pl.ds(lo, hi - lo)] = data[lo:hi]
            if half != "L":
                rope[r, :] = data[dv:]
            return carry

        lax.fori_loop(0, BLOCK_K, one, 0)

    return gather


def _gather_part_fp8_interpret(st: _SparseMlaStatics, half: str):
    """The FP8 gather for interpret mode (which runs no inline Mosaic GPU code): each
    row's part dequantized by plain loads and stores straight into its bf16 slot, the
    values the compiled in-place dequantization writes (``_dequantize_part_fp8``)."""
    dv = st.dv
    lo, hi = {"L": (0, dv // 2), "R": (dv // 2, dv)}[half]
    g_lo = lo // FP8_GROUP

    def gather(latent, scale, rope, rows, k_lat, k_rope):
        def one(r, carry):
            row = rows[r]
            src = jnp.maximum(row, 0)
            values = latent[src, pl.ds(lo, hi - lo)].astype(jnp.float32)
            scales = scale[src, pl.ds(g_lo, (hi - lo) // FP8_GROUP)]
            values = values.reshape(-1, FP8_GROUP) * scales[:, None]
            values = values.reshape(hi - lo).astype(jnp.bfloat16)
            k_lat[r, pl.ds(lo, hi - lo)] = jnp.where(row >= 0, values, jnp.zeros_like(values))
            if half != "L":
                rope_row = rope[src, :]
                k_rope[r, :] = jnp.where(row >= 0, rope_row, jnp.zeros_like(rope_row))
            return carry

        lax.fori_loop(0, BLOCK_K, one, 0)

    return gather


# ------------------------------------------------------------------------------------
# FP8 latent cache: cp.async stages a part's FP8 bytes and scales inside its own key
# slot; the compute WG that owns the block dequantizes them there, in place.


class _Index:
    """An i32 MLIR value under ``+ * // % ^`` (unsigned), ints taken as constants: the
    slot maps below are written once and run on ints (the tests) and on MLIR values."""

    def __init__(self, value):
        self.value = value

    @staticmethod
    def _of(x):
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith

        if isinstance(x, _Index):
            return x.value
        return arith.constant(ir.IntegerType.get_signless(32), x)

    def _op(self, name, other, swap=False):
        from jaxlib.mlir.dialects import arith

        a, b = self.value, self._of(other)
        return _Index(getattr(arith, name)(*((b, a) if swap else (a, b))))

    def __add__(self, o):
        return self._op("addi", o)

    def __radd__(self, o):
        return self._op("addi", o, swap=True)

    def __mul__(self, o):
        return self._op("muli", o)

    def __rmul__(self, o):
        return self._op("muli", o, swap=True)

    def __floordiv__(self, o):
        return self._op("divui", o)

    def __mod__(self, o):
        return self._op("remui", o)

    def __xor__(self, o):
        return self._op("xori", o)

    def __rxor__(self, o):
        return self._op("xori", o, swap=True)


_FP8_TILES = FP8_LATENT // _TILE  # feature tiles of a key slot's latent features (8)
_PART_TILES = _FP8_TILES // 2  # per part (4): L tiles 0-3, R tiles 4-7
_STAGE_TILE = 2  # a part's FP8 bytes sit in its tiles 2 and 3 (128 bytes a row each)


def _slot_byte(r, tile, chunk):
    """Byte of 16-byte chunk ``chunk`` of row ``r``, feature tile ``tile``, in a ``[64,
    512]`` bf16 key slot (tiles of 8 rows x 64 features, chunk ``c`` of a tile row at
    ``c ^ (r % 8)``: the 128-byte swizzle wgmma reads)."""
    return (
        ((r // 8) * _FP8_TILES + tile) * (8 * _SWIZZLE)
        + (r % 8) * _SWIZZLE
        + ((chunk ^ (r % 8)) * 16)
    )


def _fp8_stage(r, k, half: str):
    """Where 16-byte chunk ``k`` (< 16) of row ``r``'s FP8 bytes of part ``half`` is
    staged: chunk ``k % 8`` of feature tile ``2 + k // 8`` of the part."""
    base = 0 if half == "L" else _PART_TILES
    return _slot_byte(r, base + _STAGE_TILE + k // 8, k % 8)


def _fp8_scale_at(r, half: str):
    """Where row ``r``'s 4 scales (one 16-byte chunk) are staged for part ``half``:
    chunk 0 of the part's first feature tile."""
    return _slot_byte(r, 0 if half == "L" else _PART_TILES, 0)


def _fp8_dequant_map(lane, half: str):
    """The compute WG's in-place dequantization of part ``half``: thread ``lane`` takes
    row ``r = lane // 2`` and side ``s = lane % 2``, the part's 128-group ``s`` (staged in
    the part's tile ``2 + s``). Returns ``(group, steps)``: the scale's group of the
    whole row (0-3) and, per step ``j < 8``, the staged chunk it loads and the two slot
    chunks its 16 bf16 values go to. Side ``s`` takes staged chunk ``j ^ 6 s`` at step
    ``j``, so that no two threads of a quarter warp meet in a bank, loading or storing
    (the two sides of a row would otherwise touch the same chunk of their tiles)."""
    r, s = lane // 2, lane % 2
    base = 0 if half == "L" else _PART_TILES
    steps = []
    for j in range(8):
        k = j ^ (6 * s)  # staged chunk of the side: part features 128 s + 16 k ...
        load = _slot_byte(r, base + _STAGE_TILE + s, k)
        tile = base + 2 * s + k // 4
        steps.append((load, [_slot_byte(r, tile, 2 * (k % 4) + h) for h in range(2)]))
    return base // 2 + s, steps


def _stage_part_fp8(st: _SparseMlaStatics, half: str):
    """cp.async of part ``half`` of one block of FP8 rows into its slot (see the module
    docstring): each row's 256 FP8 bytes of the part into the part's tiles 2-3
    (``_fp8_stage``), its 4 scales into chunk 0 of the part's tile 0 (``_fp8_scale_at``),
    and for part ``R`` the bf16 rope features into their slot, as ``_gather_part`` does.
    8 threads per row, thread ``t`` copying chunks ``t % 8`` and ``t % 8 + 8`` of rows
    ``t // 8 + 16 i`` (whole 128-byte segments per warp); the scales by the row's first
    thread. Rows with id ``< 0`` copy 0 source bytes: zero-filled, they dequantize to 0."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, memref, nvvm, scf

    tile = _TILE
    chunks = tile // _CHUNK  # threads per row
    row_groups = _THREADS // chunks
    part_bytes = FP8_LATENT // 2
    tiled = _transforms()

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(tiled),
            plgpu.RefType(tiled),
        ),
    )
    def stage(ctx, latent, scale, rope, rows, k_lat, k_rope):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        index = ir.IndexType.get()
        global_ptr = llvm.PointerType.get(address_space=1)

        def const(v, ty=i32):
            return arith.constant(ty, v)

        def copy(dst_base, dst, src_base, src, size):
            nvvm.cp_async_shared_global(
                mgpu_utils.getelementptr(dst_base, [dst], i8),
                mgpu_utils.getelementptr(src_base, [src], i8),
                16,
                nvvm.LoadCacheModifierKind.CG,
                cp_size=size,
            )

        lane = arith.remui(mgpu_utils.thread_idx(), const(_THREADS))
        group = arith.divui(lane, const(chunks))
        chunk = arith.remui(lane, const(chunks))
        first = arith.cmpi(arith.CmpIPredicate.eq, chunk, const(0))
        lat_g, scale_g, rope_g = (
            llvm.addrspacecast(global_ptr, mgpu_utils.memref_ptr(ref))
            for ref in (latent, scale, rope)
        )
        slot, rope_slot = mgpu_utils.memref_ptr(k_lat), mgpu_utils.memref_ptr(k_rope)
        part_off = 0 if half == "L" else part_bytes
        for i in range(BLOCK_K // row_groups):
            r = arith.addi(group, const(row_groups * i))
            row = memref.load(rows, [arith.index_cast(index, r)])
            valid = arith.cmpi(arith.CmpIPredicate.sge, row, const(0))
            size = arith.select(valid, const(16), const(0))
            row64 = arith.extui(i64, arith.select(valid, row, const(0)))
            c16 = arith.extui(i64, arith.muli(chunk, const(16)))
            for k_hi in range(2):  # chunks c and c + 8 of the part's 16
                src = arith.addi(
                    arith.muli(row64, const(FP8_LATENT, i64)),
                    arith.addi(c16, const(part_off + 128 * k_hi, i64)),
                )
                dst = _fp8_stage(_Index(r), _Index(chunk) + 8 * k_hi, half).value
                copy(slot, dst, lat_g, src, size)
            if_first = scf.IfOp(first)
            with ir.InsertionPoint(if_first.then_block):
                copy(
                    slot,
                    _fp8_scale_at(_Index(r), half).value,
                    scale_g,
                    arith.muli(row64, const(16, i64)),
                    size,
                )
                scf.yield_([])
            if half == "R":  # the rope: bf16 [64, 64] slot, chunk `chunk` of row r
                r_lo = arith.remui(r, const(8))
                dst = arith.addi(
                    arith.muli(arith.divui(r, const(8)), const(8 * _SWIZZLE)),
                    arith.addi(
                        arith.muli(r_lo, const(_SWIZZLE)),
                        arith.muli(arith.xori(chunk, r_lo), const(16)),
                    ),
                )
                src = arith.addi(arith.muli(row64, const(2 * ROPE, i64)), c16)
                copy(rope_slot, dst, rope_g, src, size)
        nvvm.cp_async_commit_group()

    return stage


def _dequantize_part_fp8(half: str):
    """The compute WG's in-place dequantization of part ``half`` of its own block (see
    ``_fp8_dequant_map``): every thread loads its 8 staged chunks and its scale, the warp
    syncs (a row's two threads are neighbours, and each overwrites chunks the other
    reads), then each converts and stores: e4m3 pairs to f16 pairs (exact), to f32
    (exact), times the scale (round to nearest), to bf16 pairs (round to nearest even),
    the bits of ``dequantize_latent_cache(store).astype(bfloat16)``. Then the async-proxy
    fence and a warpgroup barrier: wgmma reads the slot through the async proxy."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, nvvm

    tiled = _transforms()
    dequant = (
        "{ .reg .b16 l, h, a0, a1, a2, a3; .reg .b32 x, y; .reg .f32 f0, f1, f2, f3;\n"
        "  mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 x, l; cvt.rn.f16x2.e4m3x2 y, h;\n"
        "  mov.b32 {a0, a1}, x; mov.b32 {a2, a3}, y;\n"
        "  cvt.f32.f16 f0, a0; cvt.f32.f16 f1, a1; cvt.f32.f16 f2, a2; cvt.f32.f16 f3, a3;\n"
        "  mul.rn.f32 f0, f0, $3; mul.rn.f32 f1, f1, $3;\n"
        "  mul.rn.f32 f2, f2, $3; mul.rn.f32 f3, f3, $3;\n"
        "  cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }"
    )

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(tiled),))
    def dequantize(ctx, k_lat):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        f32 = ir.F32Type.get()
        lane = _Index(arith.remui(mgpu_utils.thread_idx(), arith.constant(i32, _THREADS)))
        group, steps = _fp8_dequant_map(lane, half)
        base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(k_lat))

        def addr(off):
            return arith.addi(base, off.value)

        staged = [
            mgpu_utils.inline_ptx(
                "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", addr(load), result_types=[i32] * 4
            )
            for load, _ in steps
        ]
        (scale,) = mgpu_utils.inline_ptx(
            "ld.shared.f32 $0, [$1];",
            addr(_fp8_scale_at(lane // 2, half) + group * 4),
            result_types=[f32],
        )
        # A row's two threads are neighbours in a warp, and each overwrites chunks the
        # other has just loaded (the scale chunk, the staged tile 2 + 0).
        mgpu_utils.warp_barrier()
        for words, (_, dsts) in zip(staged, steps, strict=True):
            out = []
            for w in words:
                out.extend(mgpu_utils.inline_ptx(dequant, w, scale, result_types=[i32] * 2))
            for h, dst in enumerate(dsts):
                mgpu_utils.inline_ptx(
                    "st.shared.v4.b32 [$0], {$1, $2, $3, $4};",
                    addr(dst),
                    *out[4 * h : 4 * h + 4],
                    has_side_effects=True,
                )
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)
        mgpu_utils.warpgroup_barrier()

    return dequantize


# The hand-kept copy barriers: Pallas's barriers cannot be handed to inline Mosaic GPU
# code, which ``cp.async.mbarrier.arrive`` needs, so these live in a plain shared-memory
# buffer (two 32-bit words per barrier, one barrier per ``_Part``) and are waited on by
# parity (pair ``p``: ``p & 1``).
def _mbarrier_ptr(ref, part: _Part):
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir

    i64 = ir.IntegerType.get_signless(64)
    return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [int(part)], i64)


def _init_copy_barriers(bars, arrivals: int):
    """Initialise every barrier of ``bars`` for ``arrivals`` arrivals (one thread), then
    sync the whole CTA, so no thread uses one before it is initialised."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def init(ctx, ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        first = mgpu_utils.single_thread_predicate(scope=mgpu_utils.ThreadSubset.BLOCK)
        for part in _Part:
            nvvm.mbarrier_init(
                _mbarrier_ptr(ref, part), arith.constant(i32, arrivals), predicate=first
            )
        nvvm.fence_mbarrier_init()
        gpu.barrier()

    init(bars)


def _arrive_on_copies(bars, part: _Part):
    """Arrive on ``part``'s copy barrier once this thread's cp.async copies so far have
    landed (``.noinc``: the arrival counts towards the barrier's initial count)."""
    from jaxlib.mlir.dialects import nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def arrive(ctx, ref):
        del ctx
        nvvm.cp_async_mbarrier_arrive(_mbarrier_ptr(ref, part), noinc=True)

    arrive(bars)


def _wait_copies_landed(bars, part: _Part, parity):
    """Wait for phase ``parity`` of ``part``'s copy barrier, then fence for the async
    proxy: the copies were written by the generic proxy, and wgmma reads through the
    async one."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(())))
    def wait(ctx, ref, phase):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        (phase,) = phase.registers.flat
        nvvm.mbarrier_try_wait_parity(
            _mbarrier_ptr(ref, part), phase, arith.constant(i32, 10_000_000)
        )
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    wait(bars, parity)


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
    plgpu.barrier_arrive(bar.consumed.at[_Part.L0])
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
    plgpu.barrier_arrive(bar.consumed.at[_Part.L1])
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
    plgpu.barrier_arrive(bar.consumed.at[_Part.R1])
    if not prog.interpret:
        plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(bar.consumed.at[_Part.R0])
    return m_own, l_i, acc


def _qk_part(prog: _Program, w: int, half: str, acc, o, p):
    """Wait for part ``half`` of WG ``w``'s block of pair ``p``; add its QK^T to ``acc``."""
    buf = prog.buf
    part = _Part.of(w, half)
    if prog.interpret:
        plgpu.barrier_wait(prog.bar.ready.at[part])
    else:
        _wait_copies_landed(buf.copied, part, lax.bitwise_and(p, jnp.int32(1)))
        if prog.st.fp8:  # this WG's own block: dequantize the staged part in place
            _dequantize_part_fp8(half)(buf.k_lat.at[w + o])
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
        make = _gather_part_fp8_interpret if prog.interpret else _stage_part_fp8
    else:
        make = _gather_part_interpret if prog.interpret else _gather_part
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
                    _arrive_on_copies(buf.copied, part)
            if prog.interpret:  # publish the two parts (the copies are synchronous)
                for part in parts:
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(bar.ready.at[part])

    # Drain: observe the consumption of the last pair before the barriers die.
    @pl.when(prog.num_pairs > 0)
    def _drain():
        for part in _Part:
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
        group, token = _lagged_program(lax.axis_index(_AXIS_PROGRAM), _TOKEN_LAG, st)
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
            _init_copy_barriers(buf.copied, _THREADS)
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
    if not fp8 and (store.ndim != 2 or store.shape[1] < dk or store.shape[1] % _CHUNK):
        raise ValueError(
            f"store: got shape {store.shape}, expected [R, W] with W >= {dk}, W % {_CHUNK} == 0"
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
