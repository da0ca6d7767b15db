"""Sort each query's row keys on Hopper: one CTA per query, a bitonic network in registers.

The sparse-MLA row table (``attn_common.sparse_mla_rows.selected_rows``) sorts every
query's ``K`` selected rows to drop repeats. XLA's best form of that sort, one CUB radix
sort of ``(query << row_bits) | row`` packed into uint32, makes four passes over all
``N * K`` keys through global memory: 0.26 of the table's 0.29 ms for 4096 queries x 2048
tokens on an H200 (docs/sparse_mla_gpu.md). Here each query's keys are sorted where they
fit, inside one CTA, read once and written once.

Schedule
--------
One program (one warpgroup, 128 threads) per query; ``K`` a power of two, ``E = K / 128``
keys per thread: thread ``t`` holds keys ``t * E + e`` (``e < E``) in registers, loaded
and stored as 16-byte vectors. The network is the bitonic sort written with "flips" so
that every compare-exchange keeps the smaller key at the lower index (no direction bits):
for ``k = 2, 4, ..., K`` a flip step pairs index ``i`` with ``i ^ (k - 1)``, then
half-cleaner steps pair ``i`` with ``i ^ j`` for ``j = k / 4, ..., 1``. A step's partner
mask ``x`` splits into a thread part ``x // E`` and an element part ``x % E``
(``sort_plan``):

* thread part 0: both keys are the thread's own (a min and a max of two registers);
* thread part below 32: the partner is a lane of the same warp; one butterfly shuffle
  per key brings the partner's key ``e ^ (x % E)`` across;
* otherwise (the partner is in another warp; 3 of the 66 steps at ``K = 2048``): every
  thread stores its keys to shared memory, one CTA barrier, and reads its partner's.
  Two buffers alternate, so the next such step's stores never overwrite keys a slower
  thread has still to read (between them lies the other buffer's barrier).

The thread on the lower side of the pair keeps the minimum, the other the maximum. 38 of
the 66 steps at ``K = 2048`` stay in registers. The same ``sort_plan`` drives the tests'
NumPy model of the network (``packages/attn-mosaic-gpu/tests/test_row_sort.py``).

Mosaic GPU's interpreter does not run inline Mosaic GPU code, so under ``interpret``
(and for ``K`` the kernel does not take) ``sort_rows`` is ``attn_common``'s XLA sort.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common.sparse_mla_rows import sort_rows as xla_sort_rows

__all__ = ["SortStep", "row_sort_supported", "segment_sort", "sort_plan", "sort_rows"]

_THREADS = 128
_WARP = 32
_VECTOR = 4  # int32 keys per 16-byte load or store
MIN_KEYS, MAX_KEYS = 512, 4096  # K: 4 to 32 keys per thread
_AXIS = "query"


class SortStep(NamedTuple):
    """One compare-exchange step: index ``i`` meets ``i ^ mask``; ``where`` is
    ``"registers"``, ``"shuffle"`` or ``"shared"`` (see the module docstring)."""

    mask: int
    where: str


def row_sort_supported(keys_per_query: int) -> bool:
    """Whether ``segment_sort`` takes ``K`` keys per query: a power of two in
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


def _sort_body(keys_per_query: int):
    """The inline Mosaic GPU body: sort row ``query`` of ``keys`` into ``out``."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm, vector
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    per_thread = keys_per_query // _THREADS
    plan = sort_plan(keys_per_query)

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.Layout.WG_SPLAT(()),
        ),
    )
    def body(ctx, keys, out, exchange, query):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        vec = ir.VectorType.get((_VECTOR,), i32)

        def const(v, ty=i32):
            return arith.constant(ty, v)

        (query,) = query.registers.flat
        thread = arith.remui(mgpu_utils.thread_idx(), const(_THREADS))

        def global_ptr(ref):
            return llvm.addrspacecast(
                llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(ref)
            )

        def vectors_at(ptr, first_key):
            """Pointers to the thread's ``per_thread / 4`` vectors from key ``first_key``."""
            first = arith.divui(first_key, const(_VECTOR, first_key.type))
            return [
                mgpu_utils.getelementptr(ptr, [arith.addi(first, const(v, first.type))], vec)
                for v in range(per_thread // _VECTOR)
            ]

        def load(ptrs):
            regs = []
            for ptr in ptrs:
                loaded = llvm.load(vec, ptr)
                regs += [vector.extract(loaded, [], [lane]) for lane in range(_VECTOR)]
            return regs

        def store(ptrs, regs):
            for v, ptr in enumerate(ptrs):
                llvm.store(vector.from_elements(vec, regs[v * _VECTOR : (v + 1) * _VECTOR]), ptr)

        row_start = arith.muli(arith.extui(i64, query), const(keys_per_query, i64))
        mine = arith.addi(row_start, arith.extui(i64, arith.muli(thread, const(per_thread))))
        regs = load(vectors_at(global_ptr(keys), mine))
        exchange_ptr = mgpu_utils.memref_ptr(exchange)
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
                base = buffer * keys_per_query
                own = arith.addi(arith.muli(thread, const(per_thread)), const(base))
                store(vectors_at(exchange_ptr, own), regs)
                gpu.barrier()
                partner = arith.xori(thread, const(thread_part))
                theirs = arith.addi(arith.muli(partner, const(per_thread)), const(base))
                partner_regs = load(vectors_at(exchange_ptr, theirs))
                other = [partner_regs[e ^ key_part] for e in range(per_thread)]
                buffer ^= 1
            # The lower index of a pair keeps the minimum: this thread is the lower side
            # iff the mask's top bit (in the thread part) is clear in its index.
            top = 1 << (thread_part.bit_length() - 1)
            lower = arith.cmpi(arith.CmpIPredicate.eq, arith.andi(thread, const(top)), const(0))
            regs = [
                arith.select(lower, arith.minsi(a, b), arith.maxsi(a, b))
                for a, b in zip(regs, other, strict=True)
            ]
        store(vectors_at(global_ptr(out), mine), regs)

    return body


@functools.cache
def _sort_call(queries: int, keys_per_query: int):
    body = _sort_body(keys_per_query)

    def kernel(keys_ref, out_ref, exchange_ref):
        body(keys_ref, out_ref, exchange_ref, lax.axis_index(_AXIS))

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((queries, keys_per_query), jnp.int32),
        scratch_types=[plgpu.SMEM((2, keys_per_query), jnp.int32)],
        grid=(queries,),
        grid_names=(_AXIS,),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
    )


def segment_sort(keys: jax.Array) -> jax.Array:
    """``jnp.sort(keys, axis=1)`` for ``keys [N, K]`` int32 on a Hopper GPU.

    ``K`` must satisfy ``row_sort_supported``; any int32 values (the row table's keys
    are store rows and ``2**31 - 1``). Returns ``[N, K]`` int32, each row ascending.
    """
    if keys.ndim != 2 or keys.dtype != jnp.int32:
        raise ValueError(f"keys: got {keys.dtype} {keys.shape}, expected int32 [N, K]")
    queries, keys_per_query = keys.shape
    if not row_sort_supported(keys_per_query):
        raise ValueError(
            f"keys: got K = {keys_per_query}, expected a power of two in [{MIN_KEYS}, {MAX_KEYS}]"
        )
    if queries == 0:
        return keys
    return _sort_call(queries, keys_per_query)(keys)


def sort_rows(keys: jax.Array, num_rows: int | None) -> jax.Array:
    """``selected_rows``'s ``sort_keys`` on Hopper: ``segment_sort`` where it applies,
    else ``attn_common``'s XLA sort (the packed CUB sort or the batched one)."""
    if keys.ndim == 2 and keys.dtype == jnp.int32 and row_sort_supported(keys.shape[1]):
        return segment_sort(keys)
    return xla_sort_rows(keys, num_rows)
