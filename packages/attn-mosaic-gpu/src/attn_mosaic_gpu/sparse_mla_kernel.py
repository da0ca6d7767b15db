"""Sparse MLA prefill on Hopper (sm_90a): the gather-attend kernel over a per-query row table.

Op (docs/design.md#sparse-mla-prefill): every query token ``n`` attends exactly the rows
``rows[n, :counts[n]]`` of a row-addressable latent store ``store [R, W]`` (``W >= Dk``);
the row table is built outside (``attn_common.sparse_mla_rows.selected_rows``: flat or
paged, units expanded to token rows, causal / ``kv_len`` / ``-1`` / duplicates already
applied, valid rows first). Keys are a row's first ``Dk = Dv + 64`` features, values its
first ``Dv = 512``. ``out [N, Hp, Dv]`` float32 and ``lse [N, Hp]`` float32 (natural log,
``-inf`` for a query with no row, whose ``out`` is 0).

Schedule
--------
One program per (query token, group of 64 heads), launched in chunks of 8 tokens: the
chunk's head group 0 programs, then its head group 1 programs, and so on, so each head
group of a token runs a few programs behind the one before and reads the token's rows
from L2, where the earlier one brought them (``_lagged_program``). A 2-D grid
``(Hp // 64, N)`` ran every token's head group 0 before any head group 1 (Pallas maps
the last grid axis to CUDA's fastest, x), so the second fetch of a token's rows came
``N`` programs later, long evicted from L2. Three warpgroups (``num_threads=3``):

* WG2 (memory; ``setmaxnreg`` 24, 40 in the split schedule) gathers the token's
  selected rows, ``block_k`` rows per block, with 16-byte ``cp.async`` copies issued by
  all 128 threads (Hopper's TMA has no row gather): 8 threads per row, each thread
  copying the same 16-byte chunk of every 64-feature tile of its rows, straight into
  the 128-byte-swizzled tiled layout wgmma reads. Rows past ``counts[n]`` are zero-filled (``cp.async`` with a source size
  of 0), so stale or uninitialised shared memory never reaches the value product.
  Blocks go in pairs (block ``2p`` for WG0, ``2p + 1`` for WG1) into a ring of
  ``num_stages`` pair slots. Before pair ``p``, the warpgroup waits for the copies of
  pair ``p - 1`` (``cp.async.wait_group``), fences them for the async proxy
  (``commit_smem``) and arrives on their ``ready`` barriers; only then does it wait for
  pair ``p``'s slots to be ``consumed`` and issue it. So a pair is published as soon as
  it has landed, never behind the next pair's issue (the row ids' global loads and the
  copies), and pair ``p`` is in flight while the compute WGs work on pair ``p - 1``.
* WG0, WG1 (compute; ``setmaxnreg`` 240, 232 in the split schedule) each own one
  block of every pair and one half of the value features (``Dv / 2`` = 256 columns, a
  64 x 256 f32 accumulator).
  Per pair: ``S = Q K^T`` over the 512 latent and the 64 rope features of its own block
  (two wgmmas from shared memory), the columns past ``counts[n]`` masked; the two WGs
  swap their row maxima through shared memory (``pair`` barrier) so both use the same
  running max; each writes its ``P`` in bf16 to shared memory (``pair`` barrier again)
  and then accumulates ``P_own V_own + P_other V_other`` over its value half (own P from
  registers, the other WG's from shared memory). Both WGs then arrive on both slots'
  ``consumed`` barriers, which the memory WG waits on before refilling them.
  All of Q (72 KiB) is in shared memory, loaded once by TMA (kept out of registers, where
  it would push the compute WGs into spills), its latent and rope features by one copy
  each, from one ``[N, H, Dk]`` array or from two (``q_rope``: the prefill wrapper's
  ``ql`` and ``qpe`` as they come, never joined into a copy of Q). With 64-row blocks a block's P goes where
  its rope features were (dead once its QK^T is done), so one pair of blocks fits in
  227 KiB; with 32-row blocks two pairs fit (one consumed while the next is gathered)
  plus one P buffer per compute WG, with 2.5 KiB to spare (the kernel reserves no
  reduction scratch: see ``_launch``).
* ``exchange="one_way"`` (the default at 32-row blocks; the other order of the same work, as
  FlashMLA's Hopper sparse prefill does it): WG0 does not wait for WG1 before its own
  value product. Per pair, WG0 takes ``m0 = max(m, rowmax S_0)``, publishes it
  (``stats[0]``, ``max_ready[0]``), computes ``P_0`` on it and issues ``P_0 V_0``; WG1
  waits for ``m0``, publishes ``m' = max(m0, rowmax S_1)`` (``max_ready[1]``), computes
  ``P_1`` on it, issues ``P_1 V_1`` and publishes ``P_1`` (``p_ready[1]``). WG0 then
  rescales by ``exp2(m0 - m')``: the ``P_0`` it publishes for WG1 (``p_ready[0]``), its
  row sums and, once ``P_0 V_0`` has landed, its accumulator, before ``P_1 V_1``. Every
  barrier gets one arrival and one wait per pair, and a WG overwrites a ``stats`` or
  ``P`` buffer only after a wait that the other WG's last read of it precedes (each
  WG's wait for the other's max of pair ``p + 1`` follows the other's pair ``p``), so no
  barrier runs two phases ahead of its waiter.
* The 64-row split schedule (``block_k=64`` with ``exchange="one_way"``, the default):
  one pair of 64-row blocks (Q and the pair take 216 of the 227 KiB), so QK^T runs
  N = 64 wide and reads Q from shared memory once per 64 keys instead of once per 32.
  So that the next pair streams in while this one is used, each block is two parts with
  their own ``ready`` and ``consumed`` barriers: ``L`` (latent features 0-255, WG0's
  value half) and ``R`` (latent 256-511, WG1's value half, and the rope features). WG0
  takes its block's QK^T part L first, WG1 part R first; WG0 hands part L of its block
  back once its own product is done, WG1 part R of its own block likewise, and each
  hands back the part the other's product read once that product has landed. The
  memory WG refills parts in that order: (0, L) and (1, R), then (0, R) and (1, L).
  The memory WG does not wait for a part's copies: after issuing them, each of its
  threads executes ``cp.async.mbarrier.arrive.noinc`` on the part's ``ready`` barrier
  (128 arrivals), which arrives once that thread's copies have landed, so it goes on to
  the next freed part at once (the kernel 1.10-1.13x faster on the H200 than waiting for
  the copies and arriving itself; with the registers 232/40, which the memory WG's
  gathers want, 1.15-1.18x). Pallas barriers cannot be handed to inline Mosaic GPU
  code, so these four are hand-kept in a shared-memory buffer and waited on by parity
  (``p & 1``); the waiting compute thread fences the async proxy (the copies are
  generic-proxy writes, wgmma reads through the async proxy). The interpreter keeps the
  memory WG's own arrivals. The max exchange is the one-way one above; WG0's P goes
  where its block's rope features were (dead after its QK^T, refilled only with part R
  once WG1's product has read it), WG1's into its own buffer. Every buffer is addressed
  with ``p & opaque_zero`` (an input that holds 0) each pair: with one pair of blocks
  every address is loop-invariant, and the compiler would otherwise compute all 80 wgmma
  descriptors before the loop and spill them (1048 bytes; 1.6x slower).
* At the end the WGs add their row sums through shared memory, normalise, and store
  their output half to global memory; WG0 writes the LSE.

Softmax: base 2, the running max starts at a finite ``-1e30`` so a row with no key yet
never computes ``-inf - -inf``; ``l == 0`` at the end marks an empty row (out 0,
LSE ``-inf``). Every pair is walked by both compute WGs and the memory WG alike
(``ceil(counts[n] / (2 block_k))`` pairs), so all barrier arrival counts are static.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_mosaic_gpu._registers import memory_registers

__all__ = ["SparseMlaKernelConfig", "resolve_interpret", "sparse_mla_rows_attention"]

HEADS_PER_PROGRAM = 64  # wgmma M rows per warpgroup; both compute WGs share the heads
ROPE = 64  # rope features of a key row (Dk - Dv)
_COMPUTE_WGS = 2
# setmaxnreg of each compute WG; the memory WG keeps the rest of the 504 per thread slot.
# 32-row blocks: 240 (the memory WG 24, setmaxnreg's floor) ran 3-4 % faster than 232/40,
# 224/56 and 216/72 slower. The split schedule: 232 (memory 40) ran the kernel 1.09-1.10x
# faster than 240/24 on the H200, 224/56 as fast as 232 (docs/sparse_mla_gpu.md).
_COMPUTE_REGISTERS = {"split": 232, "ring": 240}
# Launch order: a token's head groups this many tokens apart, so the later ones find its
# rows in L2 (fetched by head group 0). On the H200, 8 ran the split kernel 1.01-1.04x
# faster than the 2-D grid's order, all of head group 0 first (4.312 against 4.469 ms on
# a 128K-row cache); 16-64 within 1 % of 8 (docs/sparse_mla_gpu.md).
_TOKEN_LAG = 8
_THREADS = 128  # per warpgroup
_CHUNK = 8  # bf16 elements per 16-byte cp.async
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30
_AXIS_HEADS = "head_group"
_AXIS_TOKENS = "token"
_AXIS_PROGRAM = "program"
_AXIS_WG = "wg"
EXCHANGES = ("lockstep", "one_way")
_PARTS = ("L", "R")  # 64-row split schedule: latent 0-255; latent 256-511 and rope


def _part(block: int, part: str) -> int:
    """Barrier index of ``part`` of the pair's block ``block`` (split schedule)."""
    return 2 * block + _PARTS.index(part)


@dataclasses.dataclass(frozen=True)
class SparseMlaKernelConfig:
    """Tiling of the Hopper sparse-MLA kernel.

    ``block_k``: rows per block (each compute WG takes one block of every pair); 64 or
    32. ``num_stages``: pairs of blocks in shared memory. Q takes 72 KiB and a pair of
    64-row blocks 144 KiB of the 227 KiB, so at 64 rows one pair fits; at 32 rows two
    pairs fit with their P buffers, so one pair is gathered while the other is consumed.
    ``exchange``: how the two compute WGs share the running max, ``"lockstep"`` (both
    exchange their block maxima, then both their P) or ``"one_way"`` (WG0 goes ahead on
    its own max, WG1 publishes the pair's max, WG0 rescales; see the module docstring).
    ``None`` resolves to ``"one_way"``. At 64 rows the one-way exchange is the split
    schedule: each block in two parts with their own barriers, refilled as soon as
    their last reader is done, so the next pair streams in while this one is used.
    The default, (64, 1, one_way): its QK^T wgmmas are N = 64 wide, so Q is read from
    shared memory once per 64 keys instead of once per 32. On the H200 the kernel alone
    ran 3.84 / 4.49 ms on 4096 tokens x 128 heads x 2048 rows of an 8K / 128K cache,
    against 5.08 / 5.44 for (32, 2, one_way) (docs/sparse_mla_gpu.md).
    """

    block_k: int = 64
    num_stages: int = 1
    exchange: str | None = None

    def __post_init__(self):
        if self.block_k not in (32, 64):
            raise ValueError(f"block_k: got {self.block_k!r}, expected 32 or 64")
        limit = 1 if self.block_k == 64 else 2
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= limit:
            raise ValueError(
                f"num_stages: got {self.num_stages!r}, expected 1..{limit} at block_k="
                f"{self.block_k} (Q takes 72 KiB and a pair of blocks "
                f"{2 * self.block_k * 1152 // 1024} KiB of the 227 KiB of shared memory)"
            )
        if self.exchange is None:  # frozen: resolve the default in place
            object.__setattr__(self, "exchange", "one_way")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange: got {self.exchange!r}, expected one of {EXCHANGES}")


@dataclasses.dataclass(frozen=True)
class _Static:
    tokens: int
    heads: int  # padded to a multiple of HEADS_PER_PROGRAM
    dv: int
    width: int  # store row width (elements)
    sm_scale: float
    block_k: int
    num_stages: int
    exchange: str
    # Column of the rope ref's first rope feature: dv when Q comes joined (the same
    # array as the latent ref), 0 when its rope features come as their own array.
    rope_at: int
    # Benchmark-only diagnostics (wrong results): "no_gather" (the memory WG publishes
    # blocks without copying them) or "no_compute" (the compute WGs only consume them).
    probe: str = ""
    # Benchmark-only: setmaxnreg of each compute WG (the memory WG keeps the rest);
    # None: the schedule's own (_COMPUTE_REGISTERS).
    compute_registers: int | None = None
    # Benchmark-only: the launch order's token lag (None: _TOKEN_LAG; 0: the 2-D grid,
    # every token's head group 0 before any head group 1; see _lagged_program).
    token_lag: int | None = None


def _token_lag(st: _Static) -> int:
    return _TOKEN_LAG if st.token_lag is None else st.token_lag


def _lagged_program(i, lag: int, st: _Static):
    """(head group, token) of program ``i`` in the lagged launch order: chunks of ``lag``
    tokens (the last one shorter), each all of its tokens' head group 0, then 1...: so a
    token's head group ``g`` starts about ``g * lag`` programs after its head group 0."""
    groups = st.heads // HEADS_PER_PROGRAM
    chunk = lax.div(i, jnp.int32(groups * lag))
    within = i - chunk * (groups * lag)
    size = jnp.minimum(jnp.int32(lag), st.tokens - chunk * lag)
    return lax.div(within, size), chunk * lag + lax.rem(within, size)


def _smem_tiling(block_k: int) -> tuple[int, int]:
    """(swizzle bytes, tile width in bf16) of every wgmma operand in shared memory.

    wgmma's A and B share one swizzle, and the PV product contracts over ``block_k``
    keys, so 64-row blocks use the 128-byte swizzle (64-wide tiles) and 32-row blocks the
    64-byte one (32-wide tiles).
    """
    swizzle = 128 if block_k >= 64 else 64
    return swizzle, swizzle // 2


def _transforms(block_k: int):
    swizzle, tile = _smem_tiling(block_k)
    return (plgpu.TilingTransform((8, tile)), plgpu.SwizzleTransform(swizzle))


def _gather_block(st: _Static, part: str | None = None):
    """cp.async gather of one block of rows into its (latent, rope) slots (see the
    module docstring); ``part`` ``"L"`` copies only the first half of the latent
    features, ``"R"`` the second half and the rope features (64-row split schedule).

    The shared-memory slots are tiled ``[rows / 8, features / T, 8, T]`` (``T`` = 64 or
    32 bf16 per row of a tile, 128 or 64 bytes) and swizzled: 16-byte chunk ``c`` of row
    ``r`` of a tile sits at chunk ``c ^ (r % 8)`` (128-byte swizzle) or
    ``c ^ ((r // 2) % 4)`` (64-byte). ``T / 8`` threads share a row, thread ``t``
    copying chunk ``t % (T / 8)`` of every tile of rows ``t // (T / 8) + G i``
    (``G = 128 / (T / 8)`` rows at a time), so a warp reads whole 128- or 64-byte
    segments. Rows with id ``< 0`` copy 0 source bytes, which zero-fills the 16
    destination bytes.
    """
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, memref, nvvm

    block_k, dv, width = st.block_k, st.dv, st.width
    swizzle, tile = _smem_tiling(block_k)
    chunks = tile // _CHUNK  # threads per row
    row_groups = _THREADS // chunks
    rows_per_thread = block_k // row_groups
    latent_tiles, rope_tiles = dv // tile, ROPE // tile
    tiled = _transforms(block_k)

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
        latent_range = {
            None: range(latent_tiles),
            "L": range(latent_tiles // 2),
            "R": range(latent_tiles // 2, latent_tiles),
        }[part]
        copies = [(latent_ptr, latent_tiles, j, j) for j in latent_range]
        if part in (None, "R"):
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
            phase = r_lo if swizzle == 128 else arith.divui(r_lo, const(2))
            in_tile = arith.addi(
                arith.muli(r_lo, const(tile)),
                arith.muli(arith.xori(chunk, phase), const(_CHUNK)),
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


def _gather_block_interpret(st: _Static, part: str | None = None):
    """The same gather for interpret mode, which does not run inline Mosaic GPU code."""
    dv = st.dv
    lo, hi = {None: (0, dv), "L": (0, dv // 2), "R": (dv // 2, dv)}[part]

    def gather(store, rows, latent, rope):
        def one(r, carry):
            row = rows[r]
            data = store[jnp.maximum(row, 0), pl.ds(0, dv + ROPE)]
            data = jnp.where(row >= 0, data, jnp.zeros_like(data))
            latent[r, pl.ds(lo, hi - lo)] = data[lo:hi]
            if part != "L":
                rope[r, :] = data[dv:]
            return carry

        lax.fori_loop(0, st.block_k, one, 0)

    return gather


def _wait_copies(pending: int):
    """Wait until at most ``pending`` of this thread's cp.async groups are in flight."""
    from jaxlib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)

    wait()


# Hand-kept mbarriers (``noinc``): Pallas's barriers cannot be handed to inline Mosaic GPU
# code, which ``cp.async.mbarrier.arrive`` needs, so these live in a plain shared-memory
# buffer (two 32-bit words per barrier) and are waited on by parity (pair ``p``: ``p & 1``).
def _mbarrier_ptr(ref, index: int):
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir

    i64 = ir.IntegerType.get_signless(64)
    return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [index], i64)


def _init_copy_barriers(bars, arrivals: int):
    """Initialise every barrier of ``bars`` for ``arrivals`` arrivals (one thread), then
    sync the whole CTA, so no thread uses one before it is initialised."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, nvvm

    count = bars.shape[0] // 2

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def init(ctx, ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        first = mgpu_utils.single_thread_predicate(scope=mgpu_utils.ThreadSubset.BLOCK)
        for i in range(count):
            nvvm.mbarrier_init(
                _mbarrier_ptr(ref, i), arith.constant(i32, arrivals), predicate=first
            )
        nvvm.fence_mbarrier_init()
        gpu.barrier()

    init(bars)


def _arrive_on_copies(bars, index: int):
    """Arrive on barrier ``index`` once this thread's cp.async copies so far have landed
    (``.noinc``: the arrival counts towards the barrier's initial count)."""
    from jaxlib.mlir.dialects import nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def arrive(ctx, ref):
        del ctx
        nvvm.cp_async_mbarrier_arrive(_mbarrier_ptr(ref, index), noinc=True)

    arrive(bars)


def _wait_copies_landed(bars, index: int, parity):
    """Wait for phase ``parity`` of barrier ``index``, then fence for the async proxy:
    the copies were written by the generic proxy, and wgmma reads through the async one."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT(())))
    def wait(ctx, ref, phase):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        (phase,) = phase.registers.flat
        nvvm.mbarrier_try_wait_parity(
            _mbarrier_ptr(ref, index), phase, arith.constant(i32, 10_000_000)
        )
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    wait(bars, parity)


def _build_kernel(st: _Static, *, interpret: bool):
    """The kernel body. ``interpret``: the Mosaic GPU interpreter runs neither inline
    Mosaic GPU code (the cp.async gather: rows are copied by plain loads and stores
    instead, and there is nothing to wait for), ``run_state``, nor a wgmma whose A
    operand is in registers (P is read back from shared memory, where it is anyway, into
    a fresh accumulator that is then added). The schedule and barriers are the same."""
    block_k, dv, stages = st.block_k, st.dv, st.num_stages
    half = dv // _COMPUTE_WGS
    heads = HEADS_PER_PROGRAM
    scale2 = st.sm_scale * _LOG2E
    gather = _gather_block_interpret(st) if interpret else _gather_block(st)
    # 64-row blocks: a block's P [heads, 64] takes the bytes of its rope features
    # [64, 64], dead once its QK^T is done (the same tiled layout). 32-row blocks: one P
    # buffer per compute WG, reused every pair.
    p_in_rope = block_k == ROPE
    # 64-row blocks with the one-way exchange: one pair of blocks, each in two parts
    # with their own barriers (see the module docstring).
    split = block_k == ROPE and st.exchange == "one_way"
    if split and st.probe == "no_compute":
        raise NotImplementedError("probe='no_compute' takes the pair-ring schedules only")
    if split:
        make = _gather_block_interpret if interpret else _gather_block
        gather_part = {h: make(st, h) for h in _PARTS}
    # The split schedule's parts are published by their copies (cp.async.mbarrier.arrive
    # .noinc on hand-kept barriers); the interpreter runs no inline Mosaic GPU code, so
    # there the memory WG arrives once it has waited for them.
    noinc = split and not interpret
    token_lag = _token_lag(st)
    compute_registers = st.compute_registers or _COMPUTE_REGISTERS["split" if split else "ring"]

    def block(buf, ring, w):
        # Ring slot `ring` holds a pair of blocks, WG0's then WG1's: [2 * stages, block_k, F].
        return buf.at[ring * 2 + w]

    def wait_copies(pending):
        if not interpret:
            _wait_copies(pending)

    def kernel(
        q_ref, q_rope_ref, store_ref, rows_ref, counts_ref, zero_ref, out_ref, lse_ref, scoped
    ):
        (q_lat_all, q_rope_all, k_lat, k_rope, p_bufs, p_local, stats, copy_bars), barriers = scoped
        q_lat, q_rope = q_lat_all.at[0], q_rope_all.at[0]
        ready, consumed, q_ready, pair, max_ready, p_ready = barriers
        if token_lag:
            group, token = _lagged_program(lax.axis_index(_AXIS_PROGRAM), token_lag, st)
        else:
            group = lax.axis_index(_AXIS_HEADS)
            token = lax.axis_index(_AXIS_TOKENS)
        wg = lax.axis_index(_AXIS_WG)
        h0 = group * heads
        count = counts_ref[token]
        # 0 at run time (an input that holds 0), so the compiler can derive nothing
        # about it: the split schedule addresses its buffers with `p & opaque_zero` each
        # pair, which keeps its 80 wgmma descriptors from being computed before the pair
        # loop and spilled (1048 bytes of spills and 1.6x slower without; a zero derived
        # from `count` is folded away, since the loop runs only while count > 0).
        opaque_zero = zero_ref[0]
        num_pairs = lax.div(count + 2 * block_k - 1, jnp.int32(2 * block_k))

        def pair_sync():
            plgpu.barrier_arrive(pair)
            plgpu.barrier_wait(pair)

        if noinc:
            _init_copy_barriers(copy_bars, _THREADS)

        @pl.when(wg < _COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(compute_registers, action="increase")
            other = 1 - wg

            @pl.when(wg == 0)
            def _load_q():
                parts = ((q_ref, 0, dv, q_lat), (q_rope_ref, st.rope_at, ROPE, q_rope))
                for i, (src, lo, width, dst) in enumerate(parts):
                    plgpu.copy_gmem_to_smem(
                        src.at[token, pl.ds(h0, heads), pl.ds(lo, width)], dst, q_ready.at[i]
                    )

            plgpu.barrier_wait(q_ready.at[0])
            plgpu.barrier_wait(q_ready.at[1])
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            m_init = plgpu.layout_cast(jnp.full((heads,), _M_INIT, jnp.float32), row_layout)
            l_init = plgpu.layout_cast(jnp.full((heads,), 0.0, jnp.float32), row_layout)
            s_zero = plgpu.layout_cast(
                jnp.full((heads, block_k), 0.0, jnp.float32), plgpu.Layout.WGMMA
            )
            acc_zero = plgpu.layout_cast(
                jnp.full((heads, half), 0.0, jnp.float32), plgpu.Layout.WGMMA
            )

            def start_qk(s_ref, p):
                """Wait for this WG's block of pair ``p`` and start ``S = Q K^T``: issued
                into ``s_ref`` (the caller waits), or in interpret mode, whose wgmma is
                synchronous, computed and returned."""
                ring = lax.rem(p, jnp.int32(stages))
                plgpu.barrier_wait(ready.at[ring * 2 + wg])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_lat, block(k_lat, ring, wg).transpose((1, 0)))
                    plgpu.wgmma(acc_ref, q_rope, block(k_rope, ring, wg).transpose((1, 0)))
                    return acc_ref[...]

                if interpret:
                    return pl.run_scoped(qk, plgpu.ACC((heads, block_k), jnp.float32))
                s_ref[...] = s_zero
                plgpu.wgmma(s_ref, q_lat, block(k_lat, ring, wg).transpose((1, 0)))
                plgpu.wgmma(s_ref, q_rope, block(k_rope, ring, wg).transpose((1, 0)))
                return None

            def masked_scores(p, s, masked=True):
                """This WG's scores of pair ``p``, ``-inf`` past the query's row count
                (``masked``; a pair wholly below the count is returned as it is)."""
                if not masked:
                    return s
                col = (2 * p + wg) * block_k + plgpu.broadcasted_iota(
                    jnp.int32, (heads, block_k), 1, layout=plgpu.Layout.WGMMA
                )
                return jnp.where(col < count, s, -jnp.inf)

            def walk_pairs(step, init):
                """``step(p, carry, masked=...)`` over every pair: first the pairs wholly
                below the query's row count, whose columns are all rows and need no mask
                (no column iota, compare and select per score, nor the registers they
                hold), then the last, partial pair, if any, masked."""
                full = lax.div(count, jnp.int32(2 * block_k))
                carry = lax.fori_loop(0, full, functools.partial(step, masked=False), init)
                return lax.fori_loop(full, num_pairs, functools.partial(step, masked=True), carry)

            def scaled_max(s, other_max=None):
                """Row max of ``s`` (and ``other_max``) in the exp2 domain; a row with no
                key yet gets the finite ``_M_INIT``, never ``-inf``."""
                block_max = s.max(axis=1)
                if other_max is not None:
                    block_max = jnp.maximum(block_max, other_max)
                return jnp.where(block_max > -jnp.inf, block_max * scale2, _M_INIT)

            def pv_add(acc, acc_ref, a, v, scale=None):
                """``acc * scale + a @ v``: issued into ``acc_ref`` and not waited for
                (``a`` in registers or shared memory), or in interpret mode computed from
                ``a`` in shared memory and returned."""
                if interpret:

                    def pv(r):
                        plgpu.wgmma(r, a, v)
                        return r[...]

                    product = pl.run_scoped(pv, plgpu.ACC((heads, half), jnp.float32))
                    return (acc if scale is None else acc * scale) + product
                if scale is not None:
                    acc_ref[...] = acc_ref[...] * scale  # waits for the wgmmas in flight
                plgpu.wgmma(acc_ref, a, v)
                return None

            def softmax_and_pv(p, s, acc, acc_ref, m_i, l_i, masked):
                """Pair ``p``'s softmax (one running max for both WGs) and value product:
                issued into ``acc_ref`` and not waited for, or in interpret mode added
                to ``acc`` (own P read back from shared memory: no register-A wgmma)."""
                ring = lax.rem(p, jnp.int32(stages))
                s = masked_scores(p, s, masked)
                stats.at[wg][...] = s.max(axis=1)
                pair_sync()
                m_other = plgpu.load(stats.at[other], layout=row_layout, optimized=False)
                m_new = jnp.maximum(m_i, scaled_max(s, m_other))
                x = s * scale2 - lax.broadcast_in_dim(m_new, s.shape, [0])
                probs = jnp.exp2(x)
                alpha = lax.broadcast_in_dim(jnp.exp2(m_i - m_new), (heads, half), [0])
                l_i = l_i * jnp.exp2(m_i - m_new) + probs.sum(axis=1)
                p16 = probs.astype(jnp.bfloat16)
                if p_in_rope:
                    p_own, p_theirs = block(k_rope, ring, wg), block(k_rope, ring, other)
                else:
                    p_own, p_theirs = p_bufs.at[wg], p_bufs.at[other]
                p_own[...] = p16
                plgpu.commit_smem()
                pair_sync()
                cols = pl.ds(wg * half, half)
                own_v, their_v = block(k_lat, ring, wg), block(k_lat, ring, other)
                own_p = p_own if interpret else p16
                acc = pv_add(acc, acc_ref, own_p, own_v.at[:, cols], alpha)
                acc = pv_add(acc, acc_ref, p_theirs, their_v.at[:, cols])
                return acc, m_new, l_i

            def pairs(s_ref=None, acc_ref=None):
                """The pair loop: ``(acc, m, l)`` at the end. Compiled, S and the value
                accumulator are the ACC refs ``s_ref``, ``acc_ref``; in interpret mode
                they are values."""

                def step(p, carry, masked):
                    m_i, l_i, acc = carry
                    s = start_qk(s_ref, p)
                    if not interpret:
                        s = s_ref[...]  # waits for pair p's QK^T
                    acc, m_new, l_i = softmax_and_pv(p, s, acc, acc_ref, m_i, l_i, masked)
                    if not interpret:
                        plgpu.wgmma_wait(0)
                    ring = lax.rem(p, jnp.int32(stages))
                    plgpu.barrier_arrive(consumed.at[ring * 2 + wg])
                    plgpu.barrier_arrive(consumed.at[ring * 2 + other])
                    return m_new, l_i, acc

                acc = acc_zero if interpret else None
                m_i, l_i, acc = walk_pairs(step, (m_init, l_init, acc))
                return (acc if interpret else acc_ref[...]), m_i, l_i

            def one_way_pairs(w, s_ref=None, acc_ref=None):
                """WG ``w``'s pair loop with the one-way max exchange (``exchange=
                "one_way"``, see the module docstring): WG0 starts its own value product
                on its own running max; WG1 takes the max of both and publishes it; WG0
                rescales (P for WG1, its accumulator) before the product with WG1's P."""
                cols = pl.ds(w * half, half)

                def to_acc(x):
                    return lax.broadcast_in_dim(x, (heads, half), [0])

                def step(p, carry, masked):
                    m_i, l_i, acc = carry
                    ring = lax.rem(p, jnp.int32(stages))
                    s = start_qk(s_ref, p)
                    if not interpret:
                        s = s_ref[...]  # waits for pair p's QK^T
                    s = masked_scores(p, s, masked)
                    own_v = block(k_lat, ring, w).at[:, cols]
                    their_v = block(k_lat, ring, 1 - w).at[:, cols]
                    if w == 0:
                        m_own = jnp.maximum(m_i, scaled_max(s))
                        stats.at[0][...] = m_own
                        plgpu.barrier_arrive(max_ready.at[0])
                    else:
                        plgpu.barrier_wait(max_ready.at[0])
                        m_0 = plgpu.load(stats.at[0], layout=row_layout, optimized=False)
                        m_own = jnp.maximum(m_0, scaled_max(s))
                        stats.at[1][...] = m_own
                        plgpu.barrier_arrive(max_ready.at[1])
                    probs = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_own, s.shape, [0]))
                    alpha = jnp.exp2(m_i - m_own)
                    l_i = l_i * alpha + probs.sum(axis=1)
                    p16 = probs.astype(jnp.bfloat16)
                    if w == 0:
                        if interpret:  # WG1 may still read p_bufs[0] (the previous pair)
                            p_local[...] = p16
                        acc = pv_add(
                            acc, acc_ref, p_local if interpret else p16, own_v, to_acc(alpha)
                        )
                        plgpu.barrier_wait(max_ready.at[1])
                        m_new = plgpu.load(stats.at[1], layout=row_layout, optimized=False)
                        shift = jnp.exp2(m_own - m_new)
                        p_bufs.at[0][...] = (
                            probs * lax.broadcast_in_dim(shift, s.shape, [0])
                        ).astype(jnp.bfloat16)
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(p_ready.at[0])
                        l_i = l_i * shift
                        plgpu.barrier_wait(p_ready.at[1])
                        acc = pv_add(acc, acc_ref, p_bufs.at[1], their_v, to_acc(shift))
                    else:
                        m_new = m_own

                        def publish_p():
                            p_bufs.at[1][...] = p16
                            plgpu.commit_smem()
                            plgpu.barrier_arrive(p_ready.at[1])

                        if interpret:  # its own product reads P back from shared memory
                            publish_p()
                        acc = pv_add(
                            acc, acc_ref, p_bufs.at[1] if interpret else p16, own_v, to_acc(alpha)
                        )
                        if not interpret:
                            publish_p()
                        plgpu.barrier_wait(p_ready.at[0])
                        acc = pv_add(acc, acc_ref, p_bufs.at[0], their_v)
                    if not interpret:
                        plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[ring * 2 + w])
                    plgpu.barrier_arrive(consumed.at[ring * 2 + 1 - w])
                    return m_new, l_i, acc

                acc = acc_zero if interpret else None
                m_i, l_i, acc = walk_pairs(step, (m_init, l_init, acc))
                return (acc if interpret else acc_ref[...]), m_i, l_i

            def split_pairs(w, s_ref=None, acc_ref=None):
                """WG ``w``'s pair loop in the 64-row split schedule (``block_k=64``,
                ``exchange="one_way"``): the one-way exchange, QK^T issued part by part
                as the parts land, and every part handed back as soon as its last
                reader is done, so the memory WG refills it while the pair goes on."""
                cols = pl.ds(w * half, half)

                def p_bufs_of(o):
                    """(this WG's P buffer, the other's), addressed with ``o``."""
                    p_mine = k_rope.at[o] if w == 0 else p_bufs.at[o]  # where this WG's P goes
                    p_theirs = p_bufs.at[o] if w == 0 else k_rope.at[o]
                    return p_mine, p_theirs

                def to_acc(x):
                    return lax.broadcast_in_dim(x, (heads, half), [0])

                def qk_part(h, acc, o, p):
                    """Wait for part ``h`` of this WG's block of pair ``p``; add its QK^T
                    to ``acc``."""
                    if noinc:
                        _wait_copies_landed(copy_bars, _part(w, h), lax.bitwise_and(p, 1))
                    else:
                        plgpu.barrier_wait(ready.at[_part(w, h)])
                    feats = pl.ds(_PARTS.index(h) * half, half)
                    k_part = k_lat.at[w + o].at[:, feats].transpose((1, 0))
                    plgpu.wgmma(acc, q_lat_all.at[o].at[:, feats], k_part)
                    if h == "R":
                        plgpu.wgmma(acc, q_rope_all.at[o], k_rope.at[w + o].transpose((1, 0)))

                def scores(s_ref, o, p):
                    """S of this WG's block (WG0: L then R part; WG1: R then L)."""
                    if interpret:

                        def qk(acc_ref):
                            qk_part(_PARTS[w], acc_ref, o, p)
                            qk_part(_PARTS[1 - w], acc_ref, o, p)
                            return acc_ref[...]

                        return pl.run_scoped(qk, plgpu.ACC((heads, block_k), jnp.float32))
                    s_ref[...] = s_zero
                    qk_part(_PARTS[w], s_ref, o, p)
                    qk_part(_PARTS[1 - w], s_ref, o, p)
                    return s_ref[...]

                def step(p, carry, masked):
                    m_i, l_i, acc = carry
                    o = lax.bitwise_and(p, opaque_zero)
                    p_mine, p_theirs = p_bufs_of(o)
                    s = masked_scores(p, scores(s_ref, o, p), masked)
                    own_v = k_lat.at[w + o].at[:, cols]
                    their_v = k_lat.at[1 - w + o].at[:, cols]
                    if w == 0:
                        m_own = jnp.maximum(m_i, scaled_max(s))
                    else:
                        plgpu.barrier_wait(max_ready.at[0])
                        m_0 = plgpu.load(stats.at[0], layout=row_layout, optimized=False)
                        m_own = jnp.maximum(m_0, scaled_max(s))
                    stats.at[w][...] = m_own
                    plgpu.barrier_arrive(max_ready.at[w])
                    probs = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_own, s.shape, [0]))
                    alpha = jnp.exp2(m_i - m_own)
                    l_i = l_i * alpha + probs.sum(axis=1)
                    p16 = probs.astype(jnp.bfloat16)
                    if interpret:  # the own product reads P back from shared memory
                        p_mine[...] = p16
                    acc = pv_add(acc, acc_ref, p_mine if interpret else p16, own_v, to_acc(alpha))
                    if w == 0:
                        # Own block's value half (part L) is done: hand it back. (Publishing
                        # the rescaled P for WG1 first, while the product runs, measured
                        # 1.07-1.12x slower.)
                        if not interpret:
                            plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(consumed.at[_part(0, "L")])
                        plgpu.barrier_wait(max_ready.at[1])
                        m_new = plgpu.load(stats.at[1], layout=row_layout, optimized=False)
                        shift = jnp.exp2(m_own - m_new)
                        p_mine[...] = (probs * lax.broadcast_in_dim(shift, s.shape, [0])).astype(
                            jnp.bfloat16
                        )
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(p_ready.at[0])
                        l_i = l_i * shift
                        plgpu.barrier_wait(p_ready.at[1])
                        acc = pv_add(acc, acc_ref, p_theirs, their_v, to_acc(shift))
                        if not interpret:
                            plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(consumed.at[_part(1, "L")])
                    else:
                        m_new = m_own
                        if not interpret:
                            p_mine[...] = p16
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(p_ready.at[1])
                        plgpu.barrier_wait(p_ready.at[0])
                        acc = pv_add(acc, acc_ref, p_theirs, their_v)
                        if not interpret:
                            plgpu.wgmma_wait(1)
                        plgpu.barrier_arrive(consumed.at[_part(1, "R")])
                        if not interpret:
                            plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(consumed.at[_part(0, "R")])
                    return m_new, l_i, acc

                acc = acc_zero if interpret else None
                m_i, l_i, acc = walk_pairs(step, (m_init, l_init, acc))
                return (acc if interpret else acc_ref[...]), m_i, l_i

            def run_pairs(loop):
                if interpret:
                    return loop()
                return pl.run_scoped(
                    loop,
                    plgpu.ACC((heads, block_k), jnp.float32),
                    plgpu.ACC((heads, half), jnp.float32),
                )

            def finish(acc, m_i, l_i):
                """Add the two WGs' row sums, normalise, store the output half and LSE."""
                # `stats` now carries the row sums (every read of the maxima is done:
                # each WG is past the last point where the other reads them).
                stats.at[wg][...] = l_i
                pair_sync()
                l_tot = l_i + plgpu.load(stats.at[other], layout=row_layout, optimized=False)
                has_key = l_tot > 0.0
                inv_l = 1.0 / jnp.where(has_key, l_tot, 1.0)
                out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
                out_ref.at[token, pl.ds(h0, heads), pl.ds(wg * half, half)][...] = out

                @pl.when(wg == 0)
                def _lse():
                    lse = jnp.where(
                        has_key, (m_i + jnp.log2(jnp.where(has_key, l_tot, 1.0))) * _LN2, -jnp.inf
                    )
                    lse_ref.at[token, pl.ds(h0, heads)][...] = lse

            def consume_only():
                """``probe="no_compute"``: take every block and hand it back at once."""

                @pl.loop(0, num_pairs)
                def _consume(p):
                    ring = lax.rem(p, jnp.int32(stages))
                    plgpu.barrier_wait(ready.at[ring * 2 + wg])
                    plgpu.barrier_arrive(consumed.at[ring * 2 + wg])
                    plgpu.barrier_arrive(consumed.at[ring * 2 + other])

                return acc_zero, m_init, l_init

            if st.probe == "no_compute":
                finish(*consume_only())
            elif split:
                for w in range(_COMPUTE_WGS):

                    @pl.when(wg == w)
                    def _split(w=w):
                        finish(*run_pairs(functools.partial(split_pairs, w)))

            elif st.exchange == "one_way":
                for w in range(_COMPUTE_WGS):

                    @pl.when(wg == w)
                    def _one_way(w=w):
                        finish(*run_pairs(functools.partial(one_way_pairs, w)))

            else:
                finish(*run_pairs(pairs))

        def _memory_split():
            plgpu.set_max_registers(memory_registers(compute_registers), action="decrease")

            def publish(*parts):
                """Publish the last ``len(parts)`` issued parts (oldest first) once copied."""
                for i, (b, h) in enumerate(parts):
                    wait_copies(len(parts) - 1 - i)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ready.at[_part(b, h)])

            # Parts in the order they are freed: WG0's own value half (0, L) and WG1's
            # (1, R) mid-pair, then the halves read by the other WG's product.
            @pl.loop(0, num_pairs)
            def _issue(p):
                for parts in (((0, "L"), (1, "R")), ((0, "R"), (1, "L"))):
                    for b, h in parts:

                        @pl.when(p >= 1)
                        def _wait_free(b=b, h=h):
                            plgpu.barrier_wait(consumed.at[_part(b, h)])

                        if st.probe != "no_gather":
                            gather_part[h](
                                store_ref,
                                rows_ref.at[token, pl.ds((2 * p + b) * block_k, block_k)],
                                k_lat.at[b],
                                k_rope.at[b],
                            )
                        if noinc:
                            _arrive_on_copies(copy_bars, _part(b, h))
                    if not noinc:
                        publish(*parts)

            # Drain: observe the consumption of the last pair before the barriers die.
            @pl.when(num_pairs > 0)
            def _drain():
                for b in range(_COMPUTE_WGS):
                    for h in _PARTS:
                        plgpu.barrier_wait(consumed.at[_part(b, h)])

        def _memory():
            plgpu.set_max_registers(memory_registers(compute_registers), action="decrease")

            def signal_ready(pair):
                """Publish ``pair``'s two blocks once copied: the pair issued last, whose
                two cp.async groups (WG0's block first) are the only ones pending."""
                ring = lax.rem(pair, jnp.int32(stages))
                for w in range(_COMPUTE_WGS):
                    wait_copies(_COMPUTE_WGS - 1 - w)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ready.at[ring * 2 + w])

            @pl.loop(0, num_pairs)
            def _issue(p):
                # Publish the previous pair (the only one in flight) before waiting for a
                # free slot, so its consumers never wait for this pair's issue (the row
                # ids' loads and the copies: 1.3-1.6x faster than publishing after it).
                @pl.when(p >= 1)
                def _signal_previous():
                    signal_ready(p - 1)

                ring = lax.rem(p, jnp.int32(stages))
                for w in range(_COMPUTE_WGS):
                    slot = ring * 2 + w

                    @pl.when(p >= stages)
                    def _wait_free(slot=slot):
                        plgpu.barrier_wait(consumed.at[slot])

                    blk = (2 * p + w) * block_k
                    if st.probe == "no_gather":
                        continue
                    gather(
                        store_ref,
                        rows_ref.at[token, pl.ds(blk, block_k)],
                        block(k_lat, ring, w),
                        block(k_rope, ring, w),
                    )

            @pl.when(num_pairs > 0)
            def _signal_last():
                signal_ready(num_pairs - 1)

            # Drain: observe the consumption of the last pairs before the barriers die.
            @pl.loop(jnp.maximum(num_pairs - stages, 0), num_pairs)
            def _drain(p):
                ring = lax.rem(p, jnp.int32(stages))
                plgpu.barrier_wait(consumed.at[ring * 2])
                plgpu.barrier_wait(consumed.at[ring * 2 + 1])

        pl.when(wg == _COMPUTE_WGS)(_memory_split if split else _memory)

    def entry(q_ref, q_rope_ref, store_ref, rows_ref, counts_ref, *outs):  # outs: zero, out, lse
        tiled = _transforms(block_k)
        slots = 2 * stages
        bf16 = jnp.bfloat16
        # Q with a leading axis of 1, so the split schedule can address it anew each pair.
        q_lat = plgpu.SMEM((1, heads, dv), bf16, transforms=tiled)
        q_rope = plgpu.SMEM((1, heads, ROPE), bf16, transforms=tiled)
        k_lat = plgpu.SMEM((slots, block_k, dv), bf16, transforms=tiled)
        k_rope = plgpu.SMEM((slots, block_k, ROPE), bf16, transforms=tiled)
        p_bufs = None
        if not p_in_rope:
            p_bufs = plgpu.SMEM((_COMPUTE_WGS, heads, block_k), bf16, transforms=tiled)
        elif split:  # WG1's P (WG0's goes where block 0's rope was)
            p_bufs = plgpu.SMEM((1, heads, block_k), bf16, transforms=tiled)
        # one_way in interpret mode: WG0's own P, read back by its own value product.
        one_way = st.exchange == "one_way"
        p_local = None
        if interpret and one_way and not split:
            p_local = plgpu.SMEM((heads, block_k), bf16, transforms=tiled)
        # Per-row exchange between the compute WGs: the maxima, then the sums.
        stats = plgpu.SMEM((_COMPUTE_WGS, heads), jnp.float32)
        # noinc: the parts' hand-kept barriers, two 32-bit words each.
        copy_bars = plgpu.SMEM((2 * 2 * slots,), jnp.uint32) if noinc else None
        pl.run_scoped(
            lambda *args: kernel(q_ref, q_rope_ref, store_ref, rows_ref, counts_ref, *outs, args),
            [q_lat, q_rope, k_lat, k_rope, p_bufs, p_local, stats, copy_bars],
            (
                # ready / consumed: per block, or per part of a block (split)
                plgpu.Barrier(num_barriers=2 * slots if split else slots),
                plgpu.Barrier(num_arrivals=1, num_barriers=2 * slots)
                if split
                else plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=slots),
                plgpu.Barrier(num_barriers=2),
                plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
                # one_way: WG w's running max (max_ready[w]) and P (p_ready[w]) are out
                plgpu.Barrier(num_barriers=_COMPUTE_WGS) if one_way else None,
                plgpu.Barrier(num_barriers=_COMPUTE_WGS) if one_way else None,
            ),
            collective_axes=_AXIS_WG,
        )

    return entry


def resolve_interpret(interpret):
    """``False``/``None`` -> ``None`` (compile for the GPU); ``True`` -> default params."""
    if interpret is None or interpret is False:
        return None
    if interpret is True:
        return plgpu.InterpretGPUParams()
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    raise TypeError(
        f"interpret: got {type(interpret).__name__}, expected a bool or "
        "jax.experimental.pallas.mosaic_gpu.InterpretGPUParams"
    )


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def _launch(q, q_rope, store, rows, counts, *, st: _Static, interpret):
    out_type = (
        jax.ShapeDtypeStruct((st.tokens, st.heads, st.dv), jnp.float32),
        jax.ShapeDtypeStruct((st.tokens, st.heads), jnp.float32),
    )
    return plgpu.kernel(
        _build_kernel(st, interpret=interpret is not None),
        out_type=out_type,
        grid=(st.heads // HEADS_PER_PROGRAM * st.tokens,)
        if _token_lag(st)
        else (st.heads // HEADS_PER_PROGRAM, st.tokens),
        grid_names=(_AXIS_PROGRAM,) if _token_lag(st) else (_AXIS_HEADS, _AXIS_TOKENS),
        num_threads=_COMPUTE_WGS + 1,
        thread_name=_AXIS_WG,
        # No cross-warp reduction (row maxima and sums stay within a warp's quads), so
        # none of the default 2 KiB of reduction scratch; Q's rope features need it.
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            reduction_scratch_bytes=0,
        ),
        interpret=interpret,
    )(q, q_rope, store, rows, counts, jnp.zeros((1,), jnp.int32))


def _padded_static(
    q: jax.Array,
    q_rope: jax.Array | None,
    store: jax.Array,
    *,
    sm_scale: float,
    dv: int,
    config: SparseMlaKernelConfig,
) -> tuple[jax.Array, jax.Array, _Static]:
    """The kernel's latent and rope query refs, heads padded to a multiple of 64 (``q``
    twice when ``q_rope`` is ``None``), and its static shape."""
    tokens, heads, _ = q.shape
    heads_pad = -(-heads // HEADS_PER_PROGRAM) * HEADS_PER_PROGRAM
    if heads_pad != heads:
        pad = ((0, 0), (0, heads_pad - heads), (0, 0))
        q = jnp.pad(q, pad)
        q_rope = None if q_rope is None else jnp.pad(q_rope, pad)
    st = _Static(
        tokens=tokens,
        heads=heads_pad,
        dv=dv,
        width=store.shape[1],
        sm_scale=float(sm_scale),
        block_k=config.block_k,
        num_stages=config.num_stages,
        exchange=config.exchange,
        rope_at=dv if q_rope is None else 0,
    )
    return q, q if q_rope is None else q_rope, st


def sparse_mla_rows_attention(
    q: jax.Array,
    store: jax.Array,
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
      store: ``[R, W]`` bfloat16, ``W >= dv + 64`` and ``W % 8 == 0``; only the rows named
        in ``rows`` are read.
      rows: ``[N, Kp]`` int32, ``Kp % (2 * block_k) == 0``; row ids of ``store``, the
        query's valid rows first, ``-1`` after.
      counts: ``[N]`` int32, the number of valid rows of each query (``<= Kp``).
      q_rope: ``None`` or ``[N, H, 64]`` bfloat16, the rope features of the queries,
        read where they are: a caller holding the two parts apart (the prefill
        wrappers' ``ql`` and ``qpe``) saves concatenating them, a copy of all of Q.
      config: ``SparseMlaKernelConfig`` (``None``: the default).
      interpret: ``True`` or ``plgpu.InterpretGPUParams``: Mosaic GPU interpret mode.

    Returns:
      ``out [N, H, dv]`` float32 and ``lse [N, H]`` float32.
    """
    config = config or SparseMlaKernelConfig()
    tokens, heads, dk = q.shape
    if q.dtype != jnp.bfloat16 or store.dtype != jnp.bfloat16:
        raise TypeError(f"q, store: got {q.dtype}, {store.dtype}, expected bfloat16")
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
    if store.ndim != 2 or store.shape[1] < dk or store.shape[1] % _CHUNK:
        raise ValueError(
            f"store: got shape {store.shape}, expected [R, W] with W >= {dk}, W % {_CHUNK} == 0"
        )
    kp = rows.shape[1]
    if rows.shape[0] != tokens or kp % (2 * config.block_k):
        raise ValueError(
            f"rows: got shape {rows.shape}, expected [{tokens}, Kp] with Kp a multiple of "
            f"{2 * config.block_k}"
        )
    q, q_rope, st = _padded_static(q, q_rope, store, sm_scale=sm_scale, dv=dv, config=config)
    out, lse = _launch(
        q,
        q_rope,
        store,
        rows.astype(jnp.int32),
        counts.astype(jnp.int32),
        st=st,
        interpret=resolve_interpret(interpret),
    )
    return out[:, :heads], lse[:, :heads]
