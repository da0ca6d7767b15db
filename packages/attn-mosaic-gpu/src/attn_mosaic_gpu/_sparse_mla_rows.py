"""How key rows reach shared memory in the Hopper sparse-MLA kernels: the forward
(``sparse_mla_kernel``) and the backward (``sparse_mla_bwd_kernel``) share these pieces.

* ``lagged_program``: the launch order, a token's head groups ``TOKEN_LAG`` tokens
  apart, so the later ones find its rows in L2.
* ``Part``: the halves of a 64-row key block, each with its own barriers (``L``: latent
  features 0-255; ``R``: latent 256-511 and the rope features).
* ``gather_part``: the bf16 gather, 16-byte ``cp.async`` copies straight into the
  128-byte-swizzled tiles wgmma reads (``swizzled_tiles``), rows past the count
  zero-filled.
* FP8 latent cache: ``stage_part_fp8`` copies a part's FP8 bytes and scales inside its
  own key slot (``fp8_stage``, ``fp8_scale_at``), ``dequantize_part_fp8`` turns them
  into bf16 there, in place (``fp8_dequant_map``).
* The hand-kept copy barriers (``init_copy_barriers``, ``arrive_on_copies``,
  ``wait_copies_landed``): Pallas barriers cannot be handed to inline Mosaic GPU code,
  which ``cp.async.mbarrier.arrive`` needs.
* ``Parts``: the protocol a kernel fills and waits for its key parts by (gather,
  publish, wait, dequantize), compiled; ``parts_of`` picks it or the interpreter's
  (``_interpret.InterpretedParts``: plain loads and stores, ``part_ready``).

The forward kernel's docstring says who calls these when, and why.
"""

from __future__ import annotations

from typing import Protocol

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common.fp8_cache import LATENT as FP8_LATENT
from attn_mosaic_gpu import _axes
from attn_mosaic_gpu._interpret import InterpretedParts, Target
from attn_mosaic_gpu.sparse_mla_config import (
    BLOCK_K,
    CHUNK,
    COMPUTE_WGS,
    HEADS_PER_PROGRAM,
    ROPE,
    SWIZZLE,
    THREADS,
    TILE,
    Part,
    swizzled_tiles,
)


class RowStatics(Protocol):
    """What these pieces read of a kernel's static facts (both kernels' statics)."""

    tokens: int
    heads: int  # padded to a multiple of HEADS_PER_PROGRAM
    dv: int
    width: int  # store row width (elements)


def lagged_program(i, lag: int, st: RowStatics):
    """(head group, token) of program ``i`` in the lagged launch order: chunks of ``lag``
    tokens (the last one shorter), each all of its tokens' head group 0, then 1...: so a
    token's head group ``g`` starts about ``g * lag`` programs after its head group 0."""
    groups = st.heads // HEADS_PER_PROGRAM
    chunk = lax.div(i, jnp.int32(groups * lag))
    within = i - chunk * (groups * lag)
    size = jnp.minimum(jnp.int32(lag), st.tokens - chunk * lag)
    return lax.div(within, size), chunk * lag + lax.rem(within, size)


def _cp_async_16(dst_base, dst, src_base, src, size, element):
    """One 16-byte ``cp.async`` (L2 only, ``.cg``) from global element ``src`` of
    ``src_base`` to shared element ``dst`` of ``dst_base`` (offsets in ``element``
    units); ``size`` source bytes (0-16), the rest zero-filled."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir.dialects import nvvm

    nvvm.cp_async_shared_global(
        mgpu_utils.getelementptr(dst_base, [dst], element),
        mgpu_utils.getelementptr(src_base, [src], element),
        16,
        nvvm.LoadCacheModifierKind.CG,
        cp_size=size,
    )


def gather_part(st: RowStatics, half: str):
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

    dv, width, tile = st.dv, st.width, TILE
    chunks = tile // CHUNK  # threads per row
    row_groups = THREADS // chunks
    rows_per_thread = BLOCK_K // row_groups
    latent_tiles, rope_tiles = dv // tile, ROPE // tile
    tiled = swizzled_tiles()

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

        lane = arith.remui(mgpu_utils.thread_idx(), const(THREADS))
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
                arith.extui(i64, arith.muli(chunk, const(CHUNK))),
            )
            r_lo = arith.remui(r, const(8))
            in_tile = arith.addi(
                arith.muli(r_lo, const(tile)),
                arith.muli(arith.xori(chunk, r_lo), const(CHUNK)),
            )
            row_tile = arith.divui(r, const(8))
            for dst_base, tiles, j, feature_tile in copies:
                first_tile = arith.addi(arith.muli(row_tile, const(tiles)), const(j))
                dst_off = arith.addi(arith.muli(first_tile, const(8 * tile)), in_tile)
                src_off = arith.addi(src0, const(feature_tile * tile, i64))
                _cp_async_16(dst_base, dst_off, store_ptr, src_off, src_bytes, bf16)
        nvvm.cp_async_commit_group()

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
    def operand(x):
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith

        if isinstance(x, _Index):
            return x.value
        return arith.constant(ir.IntegerType.get_signless(32), x)

    def apply(self, name, other, swap=False):
        from jaxlib.mlir.dialects import arith

        a, b = self.value, self.operand(other)
        return _Index(getattr(arith, name)(*((b, a) if swap else (a, b))))

    def __add__(self, o):
        return self.apply("addi", o)

    def __radd__(self, o):
        return self.apply("addi", o, swap=True)

    def __mul__(self, o):
        return self.apply("muli", o)

    def __rmul__(self, o):
        return self.apply("muli", o, swap=True)

    def __floordiv__(self, o):
        return self.apply("divui", o)

    def __mod__(self, o):
        return self.apply("remui", o)

    def __xor__(self, o):
        return self.apply("xori", o)

    def __rxor__(self, o):
        return self.apply("xori", o, swap=True)


_FP8_TILES = FP8_LATENT // TILE  # feature tiles of a key slot's latent features (8)
_PART_TILES = _FP8_TILES // 2  # per part (4): L tiles 0-3, R tiles 4-7
_STAGE_TILE = 2  # a part's FP8 bytes sit in its tiles 2 and 3 (128 bytes a row each)


def _slot_byte(r, tile, chunk):
    """Byte of 16-byte chunk ``chunk`` of row ``r``, feature tile ``tile``, in a ``[64,
    512]`` bf16 key slot (tiles of 8 rows x 64 features, chunk ``c`` of a tile row at
    ``c ^ (r % 8)``: the 128-byte swizzle wgmma reads)."""
    return (
        ((r // 8) * _FP8_TILES + tile) * (8 * SWIZZLE)
        + (r % 8) * SWIZZLE
        + ((chunk ^ (r % 8)) * 16)
    )


def fp8_stage(r, k, half: str):
    """Where 16-byte chunk ``k`` (< 16) of row ``r``'s FP8 bytes of part ``half`` is
    staged: chunk ``k % 8`` of feature tile ``2 + k // 8`` of the part."""
    base = 0 if half == "L" else _PART_TILES
    return _slot_byte(r, base + _STAGE_TILE + k // 8, k % 8)


def fp8_scale_at(r, half: str):
    """Where row ``r``'s 4 scales (one 16-byte chunk) are staged for part ``half``:
    chunk 0 of the part's first feature tile."""
    return _slot_byte(r, 0 if half == "L" else _PART_TILES, 0)


def fp8_dequant_map(lane, half: str):
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


def stage_part_fp8(st: RowStatics, half: str):
    """cp.async of part ``half`` of one block of FP8 rows into its slot (see the module
    docstring): each row's 256 FP8 bytes of the part into the part's tiles 2-3
    (``fp8_stage``), its 4 scales into chunk 0 of the part's tile 0 (``fp8_scale_at``),
    and for part ``R`` the bf16 rope features into their slot, as ``gather_part`` does.
    8 threads per row, thread ``t`` copying chunks ``t % 8`` and ``t % 8 + 8`` of rows
    ``t // 8 + 16 i`` (whole 128-byte segments per warp); the scales by the row's first
    thread. Rows with id ``< 0`` copy 0 source bytes: zero-filled, they dequantize to 0."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, memref, nvvm, scf

    tile = TILE
    chunks = tile // CHUNK  # threads per row
    row_groups = THREADS // chunks
    part_bytes = FP8_LATENT // 2
    tiled = swizzled_tiles()

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
            _cp_async_16(dst_base, dst, src_base, src, size, i8)

        lane = arith.remui(mgpu_utils.thread_idx(), const(THREADS))
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
                dst = fp8_stage(_Index(r), _Index(chunk) + 8 * k_hi, half).value
                copy(slot, dst, lat_g, src, size)
            if_first = scf.IfOp(first)
            with ir.InsertionPoint(if_first.then_block):
                copy(
                    slot,
                    fp8_scale_at(_Index(r), half).value,
                    scale_g,
                    arith.muli(row64, const(16, i64)),
                    size,
                )
                scf.yield_([])
            if half == "R":  # the rope: bf16 [64, 64] slot, chunk `chunk` of row r
                r_lo = arith.remui(r, const(8))
                dst = arith.addi(
                    arith.muli(arith.divui(r, const(8)), const(8 * SWIZZLE)),
                    arith.addi(
                        arith.muli(r_lo, const(SWIZZLE)),
                        arith.muli(arith.xori(chunk, r_lo), const(16)),
                    ),
                )
                src = arith.addi(arith.muli(row64, const(2 * ROPE, i64)), c16)
                copy(rope_slot, dst, rope_g, src, size)
        nvvm.cp_async_commit_group()

    return stage


def dequantize_part_fp8(half: str):
    """The compute WG's in-place dequantization of part ``half`` of its own block (see
    ``fp8_dequant_map``): every thread loads its 8 staged chunks and its scale, the warp
    syncs (a row's two threads are neighbours, and each overwrites chunks the other
    reads), then each converts and stores: e4m3 pairs to f16 pairs (exact), to f32
    (exact), times the scale (round to nearest), to bf16 pairs (round to nearest even),
    the bits of ``dequantize_latent_cache(store).astype(bfloat16)``. Then the async-proxy
    fence and a warpgroup barrier: wgmma reads the slot through the async proxy."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, nvvm

    tiled = swizzled_tiles()
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
        lane = _Index(arith.remui(mgpu_utils.thread_idx(), arith.constant(i32, THREADS)))
        group, steps = fp8_dequant_map(lane, half)
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
            addr(fp8_scale_at(lane // 2, half) + group * 4),
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
# buffer (two 32-bit words per barrier, one barrier per ``Part``) and are waited on by
# parity (pair ``p``: ``p & 1``).
def _mbarrier_ptr(ref, part: Part):
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir

    i64 = ir.IntegerType.get_signless(64)
    return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [int(part)], i64)


def init_copy_barriers(bars, arrivals: int):
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
        for part in Part:
            nvvm.mbarrier_init(
                _mbarrier_ptr(ref, part), arith.constant(i32, arrivals), predicate=first
            )
        nvvm.fence_mbarrier_init()
        gpu.barrier()

    init(bars)


def arrive_on_copies(bars, part: Part):
    """Arrive on ``part``'s copy barrier once this thread's cp.async copies so far have
    landed (``.noinc``: the arrival counts towards the barrier's initial count)."""
    from jaxlib.mlir.dialects import nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def arrive(ctx, ref):
        del ctx
        nvvm.cp_async_mbarrier_arrive(_mbarrier_ptr(ref, part), noinc=True)

    arrive(bars)


def wait_copies_landed(bars, part: Part, parity):
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


class Parts:
    """How a kernel's key parts reach shared memory, compiled: ``cp.async`` gathers
    (bf16, or FP8 staged in the slot and dequantized there by the compute WG that owns
    the block), arriving on the hand-kept ``part_landed`` barriers of ``buf``."""

    def __init__(self, st: RowStatics, buf, bar, *, fp8: bool = False):
        del bar  # the compiled copies arrive on the hand-kept barriers in ``buf``
        self.st, self.landed, self.fp8 = st, buf.part_landed, fp8

    def init(self) -> None:
        """Initialise the barriers (one thread) and sync the CTA, before the WGs split."""
        init_copy_barriers(self.landed, THREADS)

    def gather(self, half: str):
        """The memory WG's copy of part ``half`` of a block: ``gather(*stores, rows,
        latent slot, rope slot)``."""
        return (stage_part_fp8 if self.fp8 else gather_part)(self.st, half)

    def publish(self, part: Part) -> None:
        """After the memory WG issued ``part``'s copies: each thread arrives on its
        barrier once its own copies have landed."""
        arrive_on_copies(self.landed, part)

    def wait(self, part: Part, step) -> None:
        """Wait for ``part``'s copies of step ``step`` (phase ``step & 1``)."""
        wait_copies_landed(self.landed, part, lax.bitwise_and(step, jnp.int32(1)))

    def dequantize(self, half: str, slot) -> None:
        """FP8: turn the staged part ``half`` of the block in ``slot()`` into bf16, in
        place (bf16: nothing)."""
        if self.fp8:
            dequantize_part_fp8(half)(slot())


def parts_of(target: Target, st: RowStatics, buf, bar, *, fp8: bool = False):
    """The kernel's ``Parts`` (compiled) or ``InterpretedParts`` (interpreted)."""
    return target.pick(Parts, InterpretedParts)(st, buf, bar, fp8=fp8)


def launch_args(body, st: RowStatics, target: Target, scratch, kernel_name: str | None = None):
    """``plgpu.kernel``'s arguments but ``out_type`` for a sparse-MLA kernel (the forward
    and the backward share this skeleton): one program per (head group, token) of ``st``
    (grid axis ``_axes.PROGRAMS``, in ``lagged_program``'s order), three warpgroups
    (``_axes.WARPGROUP``: two compute, one memory) that allocate ``scratch = (buffers,
    barriers)`` together, and no reduction scratch (row maxima and sums stay within a
    warp's quads; Q's rope features need the 2 KiB). ``body(*refs, buf, bar)``: the
    kernel's refs, inputs then outputs, then the scratch."""
    buffers, barriers = scratch

    def entry(*refs):
        pl.run_scoped(
            lambda buf, bar: body(*refs, buf, bar),
            buffers,
            barriers,
            collective_axes=_axes.WARPGROUP,
        )

    return dict(
        body=entry,
        grid=(st.heads // HEADS_PER_PROGRAM * st.tokens,),
        grid_names=(_axes.PROGRAMS,),
        num_threads=COMPUTE_WGS + 1,
        thread_name=_axes.WARPGROUP,
        kernel_name=kernel_name,
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=target.params,
    )
