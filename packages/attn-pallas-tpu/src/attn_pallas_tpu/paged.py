"""Paged KV write-back kernel and the ragged write-then-attend wrappers, Pallas Mosaic TPU.

``paged_write_back(cache, rows, loc)`` performs ``cache[loc[t]] = rows[t]`` (``loc >= 0``)
in place. The XLA scatter it replaces goes through a flat ``[slots, D]`` view of the 4-D
pool, which costs full-cache relayout copies on TPU; here the pool is input/output
aliased and only the new rows move.

Schedule (one program). ``attn_common.tables.build_write_runs`` splits ``loc`` into maximal
contiguous runs (a chunked prefill of one request is one run; a ragged batch about one
run per request and page boundary) and each run into three table entries: unaligned
head tokens, the word-aligned middle, tail tokens. The table ``[3 * r_cap * 4]`` int32
lives in SMEM. Both the pool and the rows stay in HBM, viewed as kv-packing words
(``[slots / pk, pk, D]``: the leading word axis is untiled, so a dynamic word offset is
legal where a single packed token row is not).

1. Every ``WORD_RUN`` entry starts one HBM->HBM DMA of ``n`` words on semaphore
   ``sem[0]``; all of them are in flight together.
2. Every ``TOKEN_RUN`` token is a synchronous word read-modify-write through VMEM on
   ``sem[1]``: read the destination word and the source word, overwrite the one token
   (static phase branches), write the word back. The words touched here are never
   touched by a word run (valid slots are distinct and word runs cover whole words of
   their own run), so step 2 overlaps step 1 without a race.
3. Wait for every word run (same descriptors, rebuilt from the table).

``loc`` is first reduced by ``attn_common.tables.keep_last_writes``: a slot listed more than once
keeps only its last row, so no two runs ever write the same slot and the result never
depends on DMA order (it is ``cache[loc[t]] = rows[t]`` applied in increasing ``t``).

When the run table overflows (``num_runs > r_cap``: a pathologically fragmented
``loc``) a ``lax.cond`` takes the scatter instead; the result is bit-identical either way
(a DMA copies the bits the scatter would write). ``loc`` outside ``[0, slots)`` is
dropped before the table is built, so no run can write outside the pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common.fp8_cache import Fp8LatentCache, quantize_latent_cache
from attn_common.paged import scatter_write_back, write_back_by_scatter, write_then_attend
from attn_common.spec import PrefillCall, WriteBackCall, prefill_call, public_op, write_back_call
from attn_common.tables import (
    TOKEN_RUN,
    WORD_RUN,
    build_write_runs,
    default_write_run_cap,
    keep_last_writes,
)
from attn_pallas_tpu._prep import resolve_interpret
from attn_pallas_tpu.fp8_rows import TpuFp8LatentCache
from attn_pallas_tpu.sparse_mla import sparse_mla_attention
from attn_pallas_tpu.sparse_mla_qblock import sparse_mla_attention_qblock

_FIELDS = 4  # (kind, src, dst, n) per table entry


def _write_back_kernel(table_ref, rows_hbm, cache_in, cache_w, word_dst, word_src, sems):
    del cache_in  # aliased with cache_w; every access goes through cache_w
    pk = cache_w.shape[1]
    n_entries = table_ref.shape[0] // _FIELDS

    def field(e, f):
        return table_ref[e * _FIELDS + f]

    def word_copy(e):
        src, dst, n = field(e, 1), field(e, 2), field(e, 3)
        return pltpu.make_async_copy(
            rows_hbm.at[pl.ds(src, n)], cache_w.at[pl.ds(dst, n)], sems.at[0]
        )

    def is_word_run(e):
        return (field(e, 0) == WORD_RUN) & (field(e, 3) > 0)

    def start_words(e, carry):
        @pl.when(is_word_run(e))
        def _():
            word_copy(e).start()

        return carry

    def tokens(e, carry):
        @pl.when((field(e, 0) == TOKEN_RUN) & (field(e, 3) > 0))
        def _():
            src, dst = field(e, 1), field(e, 2)

            def one_token(i, c):
                st, dt = src + i, dst + i  # non-negative: lax.div / lax.rem suffice
                sw, sp_, dw, dp_ = (
                    jax.lax.div(st, jnp.int32(pk)),
                    jax.lax.rem(st, jnp.int32(pk)),
                    jax.lax.div(dt, jnp.int32(pk)),
                    jax.lax.rem(dt, jnp.int32(pk)),
                )
                read_dst = pltpu.make_async_copy(cache_w.at[pl.ds(dw, 1)], word_dst, sems.at[1])
                read_src = pltpu.make_async_copy(rows_hbm.at[pl.ds(sw, 1)], word_src, sems.at[1])
                read_dst.start()
                read_src.start()
                read_dst.wait()
                read_src.wait()
                for sp in range(pk):
                    for dp in range(pk):

                        @pl.when((sp_ == sp) & (dp_ == dp))
                        def _(sp=sp, dp=dp):
                            word_dst[0, dp, :] = word_src[0, sp, :]

                write = pltpu.make_async_copy(word_dst, cache_w.at[pl.ds(dw, 1)], sems.at[1])
                write.start()
                write.wait()
                return c

            jax.lax.fori_loop(0, field(e, 3), one_token, 0)

        return carry

    def wait_words(e, carry):
        @pl.when(is_word_run(e))
        def _():
            word_copy(e).wait()

        return carry

    jax.lax.fori_loop(0, n_entries, start_words, 0)
    if pk > 1:  # with pk == 1 every run is a word run
        jax.lax.fori_loop(0, n_entries, tokens, 0)
    jax.lax.fori_loop(0, n_entries, wait_words, 0)


def _write_back_call(cache_w, rows_w, table, *, interpret):
    _, pk, feat = cache_w.shape
    return pl.pallas_call(
        _write_back_kernel,
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),  # run table
            pl.BlockSpec(memory_space=pltpu.HBM),  # rows, word view
            pl.BlockSpec(memory_space=pltpu.HBM),  # cache (aliased with the output)
        ],
        out_specs=pl.BlockSpec(memory_space=pltpu.HBM),
        out_shape=jax.ShapeDtypeStruct(cache_w.shape, cache_w.dtype),
        scratch_shapes=[
            pltpu.VMEM((1, pk, feat), cache_w.dtype),
            pltpu.VMEM((1, pk, feat), cache_w.dtype),
            pltpu.SemaphoreType.DMA((2,)),
        ],
        input_output_aliases={2: 0},
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
        interpret=interpret,
    )(table, rows_w, cache_w)


def _write_tpu_fp8(call: WriteBackCall) -> TpuFp8LatentCache:
    """The reference's write-back (quantize, keep the last row of a slot, scatter) into
    a ``TpuFp8LatentCache``: the same values, stored as latent and side rows."""
    rows = call.rows
    if not isinstance(rows, Fp8LatentCache):
        rows = quantize_latent_cache(rows.astype(jnp.float32))
    rows = TpuFp8LatentCache.from_cache(rows)
    return scatter_write_back(call.cache, rows, keep_last_writes(call.loc, call.slots))


def _scatter(cache, rows, loc):
    flat = cache.reshape(-1, cache.shape[-1])
    flat = flat.at[loc].set(rows, mode="drop", wrap_negative_indices=False)
    return flat.reshape(cache.shape)


@public_op(write_back_call)
def paged_write_back(call: WriteBackCall) -> jax.Array:
    """``cache[loc[t]] = rows[t]`` for every valid ``loc[t]``, in place; returns the cache.

    Donate the cache (``jax.jit(..., donate_argnums=...)``) for a true in-place update.
    ``r_cap``: run-table size (static); default ``attn_common.tables.default_write_run_cap``;
    more contiguous runs than this fall back to the XLA scatter (bit-identical). An
    ``Fp8LatentCache`` is written by the XLA scatter (``write_back_by_scatter``: the new
    rows quantized, nothing else read); a ``TpuFp8LatentCache`` likewise, with the new
    rows' latent and side rows (``attn_pallas_tpu.fp8_rows``) scattered.
    """
    if isinstance(call.cache, TpuFp8LatentCache):
        return _write_tpu_fp8(call)
    if isinstance(call.cache, Fp8LatentCache):  # the new rows quantized, then scattered
        return write_back_by_scatter(call)
    cache, rows, loc, page_size = call.cache, call.rows, call.loc, call.page_size
    _, _, pk, feat = cache.shape
    num_tokens = rows.shape[0]
    r_cap = call.r_cap
    if r_cap is None:
        r_cap = default_write_run_cap(num_tokens, page_size)
    interpret = resolve_interpret(call.interpret)
    if num_tokens == 0:
        return cache

    slots = call.slots
    # Out-of-range slots dropped, a repeated slot kept only for its last row: the runs
    # never overlap, so DMA order cannot matter, and the result is the sequential write.
    loc = keep_last_writes(loc, slots)
    rows = rows.astype(cache.dtype)
    padded = -(-num_tokens // pk) * pk  # whole source words
    rows_p = jnp.pad(rows, ((0, padded - num_tokens), (0, 0)))
    loc_p = jnp.pad(loc, (0, padded - num_tokens), constant_values=-1)
    runs = build_write_runs(loc_p, kv_packing=pk, r_cap=r_cap)

    def kernel(cache):
        # Word views: merging the leading axes keeps the tiled minor (pk, D) axes, so
        # these reshapes are free; the kernel sees no ref reshape (interpret mode cannot
        # DMA through one in jax 0.11.2).
        cache_w = cache.reshape(slots // pk, pk, feat)
        rows_w = rows_p.reshape(padded // pk, pk, feat)
        out = _write_back_call(cache_w, rows_w, runs.table.reshape(-1), interpret=interpret)
        return out.reshape(cache.shape)

    def scatter(cache):
        return _scatter(cache, rows, loc)

    return jax.lax.cond(runs.num_runs <= r_cap, kernel, scatter, cache)


@public_op(prefill_call)
def prefill_write_and_attend_ragged(
    call: PrefillCall, *, fp8_dequantize: bool | None = None
) -> tuple[jax.Array, jax.Array]:
    """Write the new tokens' latents into the paged cache, then attend (per-query kernel).

    ``query_block`` / ``u_max`` are validated and ignored here; accepted so the
    ``_qblock`` twin is a drop-in. An ``Fp8LatentCache`` gets the new rows quantized
    (the XLA scatter of :func:`paged_write_back`), then attended as
    ``fp8_dequantize`` says (:func:`sparse_mla_attention`).
    """
    attend = functools.partial(sparse_mla_attention.impl, fp8_dequantize=fp8_dequantize)
    return write_then_attend(paged_write_back.impl, attend, call)


@public_op(prefill_call)
def prefill_write_and_attend_ragged_qblock(
    call: PrefillCall, *, fp8_dequantize: bool | None = None
) -> tuple[jax.Array, jax.Array]:
    """Same as :func:`prefill_write_and_attend_ragged`, attending with the query-blocked
    kernel (``query_block`` queries per program and ``u_max`` union slots per chunk;
    ``None`` = the automatic tiling of :func:`sparse_mla_attention_qblock`)."""
    attend = functools.partial(sparse_mla_attention_qblock.impl, fp8_dequantize=fp8_dequantize)
    return write_then_attend(paged_write_back.impl, attend, call)
