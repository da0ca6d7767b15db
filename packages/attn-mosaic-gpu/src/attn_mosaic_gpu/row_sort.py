"""The row table of token-level selections on Hopper: sort, drop repeats, compact, in one CTA.

The sparse-MLA row table (``attn_common.sparse_mla_rows.selected_rows``) lists each
query's ``K`` selected store rows once, ascending, then ``-1``, with a count. XLA's best
form of its sort, one CUB radix sort of ``(query << row_bits) | row`` packed into uint32,
makes four passes over all ``N * K`` keys through global memory (0.26 of the table's
0.29 ms for 4096 queries x 2048 tokens on an H200), and dropping repeats then takes a
conditional, and a prefix sum and a scatter when a row repeats. Here one program does a
query's whole table where its keys fit, inside one CTA: read once, written once.

Schedule
--------
One program (one warpgroup, 128 threads) per query; ``K`` a power of two, ``E = K / 128``
keys per thread: thread ``t`` holds keys ``t * E + e`` (``e < E``) in registers, loaded
and stored as 16-byte vectors.

1. **Sort.** The bitonic network written with "flips", so that every compare-exchange
   keeps the smaller key at the lower index (no direction bits): for ``k = 2, 4, ...,
   K`` a flip step pairs index ``i`` with ``i ^ (k - 1)``, then half-cleaner steps pair
   ``i`` with ``i ^ j`` for ``j = k / 4, ..., 1``. A step's partner mask ``x`` splits
   into a thread part ``x // E`` and a key part ``x % E`` (``sort_plan``):

   * thread part 0: both keys are the thread's own (a min and a max of two registers);
   * thread part below 32: the partner is a lane of the same warp; one butterfly
     shuffle per key brings the partner's key ``e ^ (x % E)`` across;
   * otherwise (the partner is in another warp; 3 of the 66 steps at ``K = 2048``):
     every thread stores its keys to shared memory, one CTA barrier, and reads its
     partner's. Two buffers alternate, so the next such step's stores never overwrite
     keys a slower thread has still to read (between them lies the other buffer's
     barrier).

   The thread on the lower side of the pair keeps the minimum, the other the maximum.
   38 of the 66 steps at ``K = 2048`` stay in registers.
2. **Drop repeats and absent keys.** A key is kept iff it is not ``ABSENT`` and differs
   from the key before it (the previous thread's last key comes through shared memory).
3. **Compact.** Each thread counts its kept keys; a shuffle scan within each warp and
   the four warps' totals in shared memory give every thread its first output slot and
   the query's count. The kept keys are stored to their slots of a shared-memory row
   prefilled with ``-1`` (keys not kept go to one spare slot past the row), and the row
   goes out to global memory as 16-byte vectors. Three CTA barriers here, six with the sort's.

The same ``sort_plan`` drives the tests' NumPy model of the network
(``packages/attn-mosaic-gpu/tests/test_row_sort_cpu.py``). Mosaic GPU's interpreter does
not run inline Mosaic GPU code, so under ``interpret`` (and for ``K`` or widths the
kernel does not take) ``token_rows`` is ``attn_common``'s XLA sort and compaction.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common.sparse_mla_rows import ABSENT, token_rows_by_sort
from attn_mosaic_gpu import _axes

__all__ = ["SortStep", "distinct_sorted_rows", "row_sort_supported", "sort_plan", "token_rows"]

_THREADS = 128
_WARP = 32
_WARPS = _THREADS // _WARP
_VECTOR = 4  # int32 keys per 16-byte load or store
MIN_KEYS, MAX_KEYS = 512, 4096  # K: 4 to 32 keys per thread
_AXIS = _axes.QUERIES


class SortStep(NamedTuple):
    """One compare-exchange step: index ``i`` meets ``i ^ mask``; ``where`` is
    ``"registers"``, ``"shuffle"`` or ``"shared"`` (see the module docstring)."""

    mask: int
    where: str


def row_sort_supported(keys_per_query: int) -> bool:
    """Whether the kernel takes ``K`` keys per query: a power of two in
    ``[MIN_KEYS, MAX_KEYS]``."""
    k = keys_per_query
    return MIN_KEYS <= k <= MAX_KEYS and k & (k - 1) == 0


def sort_plan(keys_per_query: int) -> tuple[SortStep, ...]:
    """The flip-form bitonic network for ``K`` keys at ``K / 128`` keys per thread."""
    per_thread = keys_per_query // _THREADS
    steps = []
    k = 2
    while k <= keys_per_query:
        for mask in (k - 1, *(1 << b for b in reversed(range((k // 4).bit_length())))):
            thread_part = mask // per_thread
            where = (
                "registers" if thread_part == 0 else "shuffle" if thread_part < _WARP else "shared"
            )
            steps.append(SortStep(mask, where))
        k *= 2
    return tuple(steps)


class _Emitter:
    """The inline body's building blocks (Mosaic GPU's MLIR dialects): int32 constants,
    this thread's indices, 16-byte vector loads and stores of a thread's keys."""

    def __init__(self, per_thread: int):
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith

        self.per_thread = per_thread
        self.i32 = ir.IntegerType.get_signless(32)
        self.i64 = ir.IntegerType.get_signless(64)
        self.vec = ir.VectorType.get((_VECTOR,), self.i32)
        self.thread = arith.remui(mgpu_utils.thread_idx(), self.const(_THREADS))
        self.lane = arith.remui(self.thread, self.const(_WARP))
        self.warp = arith.divui(self.thread, self.const(_WARP))

    def const(self, v, ty=None):
        from jaxlib.mlir.dialects import arith

        return arith.constant(self.i32 if ty is None else ty, v)

    @staticmethod
    def global_ptr(ref):
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
        from jaxlib.mlir.dialects import llvm

        return llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref))

    def vectors_at(self, ptr, first_key):
        """Pointers to the ``per_thread / 4`` vectors from key ``first_key`` on."""
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
        from jaxlib.mlir.dialects import arith

        first = arith.divui(first_key, self.const(_VECTOR, first_key.type))
        return [
            mgpu_utils.getelementptr(ptr, [arith.addi(first, self.const(v, first.type))], self.vec)
            for v in range(self.per_thread // _VECTOR)
        ]

    def load(self, ptrs):
        from jaxlib.mlir.dialects import llvm, vector

        regs = []
        for ptr in ptrs:
            loaded = llvm.load(self.vec, ptr)
            regs += [vector.extract(loaded, [], [i]) for i in range(_VECTOR)]
        return regs

    def store(self, ptrs, regs):
        from jaxlib.mlir.dialects import llvm, vector

        for v, ptr in enumerate(ptrs):
            llvm.store(vector.from_elements(self.vec, regs[v * _VECTOR : (v + 1) * _VECTOR]), ptr)

    def word(self, ptr, index):
        from jax.experimental.mosaic.gpu import utils as mgpu_utils

        return mgpu_utils.getelementptr(ptr, [index], self.i32)

    def is_lower(self, top_bit: int):
        from jaxlib.mlir.dialects import arith

        masked = arith.andi(self.thread, self.const(top_bit))
        return arith.cmpi(arith.CmpIPredicate.eq, masked, self.const(0))


def _sort(em: _Emitter, plan: tuple[SortStep, ...], regs: list, exchange_ptr, keys: int):
    """1. The bitonic network ``plan`` over the thread's keys ``regs`` (see the module
    docstring): in registers, by shuffles, or through the two shared-memory buffers
    at ``exchange_ptr``."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir.dialects import arith, gpu

    per_thread = em.per_thread
    buffer = 0
    for step in plan:
        thread_part, key_part = step.mask // per_thread, step.mask % per_thread
        if step.where == "registers":
            for e in range(per_thread):
                p = e ^ key_part
                if e < p:
                    regs[e], regs[p] = (
                        arith.minsi(regs[e], regs[p]),
                        arith.maxsi(regs[e], regs[p]),
                    )
            continue
        if step.where == "shuffle":
            other = [
                mgpu_utils.shfl_bfly(regs[e ^ key_part], thread_part) for e in range(per_thread)
            ]
        else:
            base = buffer * keys
            own = arith.addi(arith.muli(em.thread, em.const(per_thread)), em.const(base))
            em.store(em.vectors_at(exchange_ptr, own), regs)
            gpu.barrier()
            partner = arith.xori(em.thread, em.const(thread_part))
            theirs = arith.addi(arith.muli(partner, em.const(per_thread)), em.const(base))
            partner_regs = em.load(em.vectors_at(exchange_ptr, theirs))
            other = [partner_regs[e ^ key_part] for e in range(per_thread)]
            buffer ^= 1
        # The lower index of a pair keeps the minimum: this thread is the lower side
        # iff the mask's top bit (in the thread part) is clear in its index.
        lower = em.is_lower(1 << (thread_part.bit_length() - 1))
        regs = [
            arith.select(lower, arith.minsi(a, b), arith.maxsi(a, b))
            for a, b in zip(regs, other, strict=True)
        ]
    return regs


def _kept_keys(em: _Emitter, regs: list, table_ptr, scan_ptr, first_own):
    """2. Which sorted keys are kept: not ABSENT and not equal to the key before (the
    previous thread's last key comes through ``scan``). The table row starts as -1 (its
    spare slot past the end takes the keys not kept, see ``_compact``). Returns (kept
    flags, their count, whether this is thread 0)."""
    from jaxlib.mlir.dialects import arith, gpu, llvm

    em.store(em.vectors_at(table_ptr, first_own), [em.const(-1)] * em.per_thread)
    llvm.store(regs[-1], em.word(scan_ptr, em.thread))
    gpu.barrier()  # the last keys and the -1 row are out
    previous_thread = arith.maxsi(arith.subi(em.thread, em.const(1)), em.const(0))
    before = llvm.load(em.i32, em.word(scan_ptr, previous_thread))
    first_thread = arith.cmpi(arith.CmpIPredicate.eq, em.thread, em.const(0))
    count = em.const(0)
    kept = []
    for e in range(em.per_thread):
        previous = regs[e - 1] if e else before
        new = arith.cmpi(arith.CmpIPredicate.ne, regs[e], previous)
        if not e:
            new = arith.ori(new, first_thread)
        absent = arith.cmpi(arith.CmpIPredicate.ne, regs[e], em.const(ABSENT))
        keep = arith.andi(new, absent)
        kept.append(keep)
        count = arith.addi(count, arith.extui(em.i32, keep))
    return kept, count, first_thread


def _compact(em: _Emitter, regs: list, kept: list, count, table_ptr, scan_ptr, keys: int):
    """3. Store the kept keys to their slots of the table row: each thread's first slot
    is an inclusive shuffle scan of the counts within the warp, plus the totals of the
    warps before (through shared memory). Returns the query's count."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir.dialects import arith, gpu, llvm, nvvm

    inclusive = count
    for d in (1, 2, 4, 8, 16):
        up = nvvm.shfl_sync(em.const(-1), inclusive, em.const(d), em.const(0), nvvm.ShflKind.up)
        has = arith.cmpi(arith.CmpIPredicate.uge, em.lane, em.const(d))
        inclusive = arith.addi(inclusive, arith.select(has, up, em.const(0)))
    # Warp totals go past the last keys, which slower threads may still be reading.
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, em.lane, em.const(_WARP - 1))):
        llvm.store(inclusive, em.word(scan_ptr, arith.addi(em.warp, em.const(_THREADS))))
    gpu.barrier()  # warp totals are out
    slot = arith.subi(inclusive, count)
    total = em.const(0)
    for w in range(_WARPS):
        warp_total = llvm.load(em.i32, em.word(scan_ptr, em.const(_THREADS + w)))
        earlier = arith.cmpi(arith.CmpIPredicate.ugt, em.warp, em.const(w))
        slot = arith.addi(slot, arith.select(earlier, warp_total, em.const(0)))
        total = arith.addi(total, warp_total)
    spare = em.const(keys)
    for e in range(em.per_thread):
        llvm.store(regs[e], em.word(table_ptr, arith.select(kept[e], slot, spare)))
        slot = arith.addi(slot, arith.extui(em.i32, kept[e]))
    gpu.barrier()  # the row is compacted
    return total


def _table_body(keys_per_query: int):
    """The inline Mosaic GPU body: row ``query`` of ``keys`` -> its table and count."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir.dialects import arith, llvm

    per_thread = keys_per_query // _THREADS
    plan = sort_plan(keys_per_query)

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.Layout.WG_SPLAT(()),
        ),
    )
    def body(ctx, keys, rows_out, counts_out, exchange, table, scan, query):
        del ctx
        (query,) = query.registers.flat
        em = _Emitter(per_thread)
        i64 = em.i64
        row_start = arith.muli(arith.extui(i64, query), em.const(keys_per_query, i64))
        mine = arith.addi(row_start, arith.extui(i64, arith.muli(em.thread, em.const(per_thread))))
        regs = em.load(em.vectors_at(em.global_ptr(keys), mine))
        exchange_ptr = mgpu_utils.memref_ptr(exchange)
        regs = _sort(em, plan, regs, exchange_ptr, keys_per_query)
        table_ptr, scan_ptr = mgpu_utils.memref_ptr(table), mgpu_utils.memref_ptr(scan)
        first_own = arith.muli(em.thread, em.const(per_thread))
        kept, count, first_thread = _kept_keys(em, regs, table_ptr, scan_ptr, first_own)
        total = _compact(em, regs, kept, count, table_ptr, scan_ptr, keys_per_query)
        out = arith.addi(row_start, arith.extui(i64, first_own))
        em.store(
            em.vectors_at(em.global_ptr(rows_out), out),
            em.load(em.vectors_at(table_ptr, first_own)),
        )
        with mgpu_utils.when(first_thread):
            llvm.store(total, em.word(em.global_ptr(counts_out), query))

    return body


@functools.cache
def _table_call(queries: int, keys_per_query: int):
    body = _table_body(keys_per_query)

    def kernel(keys_ref, rows_ref, counts_ref, exchange_ref, table_ref, scan_ref):
        body(
            keys_ref, rows_ref, counts_ref, exchange_ref, table_ref, scan_ref,
            lax.axis_index(_AXIS),
        )  # fmt: skip

    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((queries, keys_per_query), jnp.int32),
            jax.ShapeDtypeStruct((queries,), jnp.int32),
        ),
        scratch_types=[
            plgpu.SMEM((2, keys_per_query), jnp.int32),  # the sort's exchange buffers
            plgpu.SMEM((keys_per_query + _VECTOR,), jnp.int32),  # the row (+ a spare slot)
            plgpu.SMEM((_THREADS + _WARPS,), jnp.int32),  # last keys; warp totals
        ],
        grid=(queries,),
        grid_names=(_AXIS,),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
    )


def distinct_sorted_rows(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each query's distinct keys, ascending, then ``-1``, and their count, on Hopper.

    ``keys [N, K]`` int32 (``K`` satisfying ``row_sort_supported``): store rows, with
    ``ABSENT`` (``2**31 - 1``) where not attended; any other int32 is a row. Returns
    ``rows [N, K]`` int32 and ``counts [N]`` int32, what ``token_rows_by_sort`` gives at
    ``width = K``.
    """
    if keys.ndim != 2 or keys.dtype != jnp.int32:
        raise ValueError(f"keys: got {keys.dtype} {keys.shape}, expected int32 [N, K]")
    queries, keys_per_query = keys.shape
    if not row_sort_supported(keys_per_query):
        raise ValueError(
            f"keys: got K = {keys_per_query}, expected a power of two in [{MIN_KEYS}, {MAX_KEYS}]"
        )
    if queries == 0:
        return keys, jnp.zeros((0,), jnp.int32)
    return _table_call(queries, keys_per_query)(keys)


def token_rows(keys: jax.Array, width: int, num_rows: int | None) -> tuple[jax.Array, jax.Array]:
    """``selected_rows``'s ``token_table`` on Hopper: ``distinct_sorted_rows`` where it
    applies (``K`` supported, ``width == K``), else ``attn_common``'s XLA sort."""
    supported = keys.ndim == 2 and keys.dtype == jnp.int32 and row_sort_supported(keys.shape[1])
    if supported and width == keys.shape[1]:
        return distinct_sorted_rows(keys)
    return token_rows_by_sort(keys, width, num_rows)
