"""Sparse MLA prefill on Hopper behind the shared API names (docs/design.md).

``sparse_mla_attention`` takes the validated call of ``attn_common.spec.sparse_mla_call``, turns the
selection (flat unit ids or ragged request-local pages, ``read_block = 1`` for the
token-level selections of DeepSeek V3.2's indexer) into a per-query row table with
``attn_common.sparse_mla_rows.sparse_mla_units`` + ``selected_rows`` (causal bound,
``kv_len``, ``-1``, out-of-range ids and duplicates all resolved there, outside the
kernel; the tables of
token-level selections by the one-CTA-per-query kernel of ``row_sort``), and runs the
gather-attend kernel of ``sparse_mla_kernel`` (over a bf16 cache, or an
``Fp8LatentCache`` whose three arrays the row ids index alike, dequantized on chip, or
first dequantized by XLA, ragged only the pages the page table names, where that
costs less: ``dequantize_store_first``).

At ``H <= 32`` heads the kernel also runs query-blocked: ``query_block_for(H)``
consecutive queries share a program's 64 rows, and their union of rows
(``attn_common.sparse_mla_rows.block_union``) is gathered once, each query restoring
its own selection by a membership mask. ``sparse_mla_attention_qblock`` runs it;
``sparse_mla_attention`` keeps the per-query kernel until the blocked one has run on
a GPU. ``scheduled("auto")`` is the per-call choice meant to replace that
(``_prefer_blocked``: the union of ``PROBE_BLOCKS`` sampled blocks against the
queries' own rows, on the device, under ``jit``: overlapping picks take the blocked
kernel, random ones the per-query kernel), benchmarked beside both kernels.
``paged_write_back`` is the XLA scatter (``attn_common.paged.scatter_write_back``), and
the two ``prefill_write_and_attend_ragged`` wrappers compose it with the kernel,
which reads their ``ql`` and ``qpe`` apart (no joined copy of Q).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attn_common.fp8_cache import Fp8LatentCache, cache_compute_dtype, dequantize_latent_cache
from attn_common.paged import (
    check_fp8_dequantize,
    copy_pages,
    named_pages,
    write_back_by_scatter,
    write_then_attend,
)
from attn_common.sparse_mla_rows import (
    ABSENT,
    block_union,
    row_table_width,
    sampled_union_pairs,
    selected_rows,
    sparse_mla_units,
)
from attn_common.sparse_mla_xla import kernel_result
from attn_common.spec import (
    PrefillCall,
    SparseMlaCall,
    WriteBackCall,
    prefill_call,
    public_op,
    sparse_mla_call,
    write_back_call,
)
from attn_mosaic_gpu import row_sort
from attn_mosaic_gpu._interpret import resolve_target
from attn_mosaic_gpu.sparse_mla_bwd_kernel import sparse_mla_rows_backward
from attn_mosaic_gpu.sparse_mla_config import (
    HEADS_PER_PROGRAM,
    PAIR_ROWS,
    ROPE,
    SparseMlaKernelConfig,
    unsupported_dv,
)
from attn_mosaic_gpu.sparse_mla_kernel import (
    query_block_for,
    sparse_mla_rows_attention,
    sparse_mla_union_attention,
)

__all__ = [
    "dequantize_store_first",
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
    "sparse_mla_unsupported",
]

KERNEL_DTYPE = jnp.bfloat16
# The automatic choice (``_prefer_blocked``): blocks whose union is measured exactly,
# evenly spaced over the call, and the share of the per-query kernel's row pairs up to
# which the query-blocked kernel's estimated pairs make it the faster one (both move
# one pair of 64-row blocks per step; the blocked one also builds the union tables).
PROBE_BLOCKS = 16
BLOCKED_PAIR_SHARE = 0.75
# A whole FP8 store dequantized by XLA costs about as much per store row as the kernel's
# on-chip dequantization per this many gathered rows and 64-head group. H200, 5484fde
# (docs/results/sparse_mla_fp8.json): 0.88 ns a store row (128 x 32K tokens in 3.68 ms
# over the bf16 kernel) against 0.114-0.119 ns a gathered row and head group (the FP8
# kernel over the bf16 one, prefill H 16-128 and decode): 7.4-7.7.
WHOLE_STORE_ROW_COST = 8


def dequantize_store_first(store_rows: int, gathered_rows: int, heads: int) -> bool:
    """Whether an FP8 store is cheaper dequantized whole by XLA before the bf16 kernel
    than row by row on chip: ``store_rows * WHOLE_STORE_ROW_COST <= gathered_rows *
    head_groups``. ``store_rows`` are the rows the copy dequantizes (flat: the cache;
    ragged: the pool, or the pages the call's page table names if at most half as many),
    ``gathered_rows`` the selection's capacity (queries x padded rows per query),
    ``head_groups`` the 64-head programs per query, each of which gathers and
    dequantizes every row. Prefill over its own context takes this path (4096 queries x
    2048 rows of a 32K-token context: 8.4M gathered rows against 262K), however large
    the pool; decode over long requests keeps the on-chip path (256 queries x 2048 rows
    of 128 requests' 4M tokens). The transient bf16 copy (1,152 bytes a store row) is
    then at most ``gathered_rows * head_groups / 8`` rows."""
    groups = -(-heads // HEADS_PER_PROGRAM)
    return store_rows * WHOLE_STORE_ROW_COST <= gathered_rows * groups


def sparse_mla_unsupported(
    q_dtype, kv_dtype, dk: int | None, dv: int | None, *, names=("q", "kv")
) -> str | None:
    """Why the Hopper kernel cannot take these static facts (``None``: it can).

    ``q_dtype`` is not a limit (the query is cast to the cache's dtype); ``names`` are
    the query's and the cache's argument names (``("qpe", "cache")`` for the
    write-then-attend wrappers, whose rope width is ``qpe``'s last dim).
    """
    del q_dtype
    q_name, kv_name = names
    if kv_dtype is not None and jnp.dtype(kv_dtype) != KERNEL_DTYPE:
        return (
            f"{kv_name}: got dtype {jnp.dtype(kv_dtype).name}, the Hopper kernel takes a "
            "bfloat16 cache"
        )
    reason = None if dv is None else unsupported_dv(dv, "kv_lora_rank")
    if reason is not None:
        return reason
    if dk is not None and dv is not None and dk != dv + ROPE:
        return (
            f"{q_name}: got a rope width of {dk - dv} (Dk = {dk}, kv_lora_rank = {dv}), the "
            f"Hopper kernel takes rope = {ROPE} (Dk = kv_lora_rank + {ROPE})"
        )
    return None


@public_op(sparse_mla_call)
def sparse_mla_attention(
    call: SparseMlaCall,
    *,
    config: SparseMlaKernelConfig | None = None,
    fp8_dequantize: bool | None = None,
    deterministic: bool = False,
):
    """Sparse MLA attention over selected KV units on Hopper; the reference's contract.

    The kernel takes a bfloat16 cache (the query takes its dtype) or an
    ``attn_common.Fp8LatentCache``, whose rows it dequantizes to bf16 on chip (the query
    in bf16; the result is the bits of the same call on
    ``dequantize_latent_cache(cache).astype(bfloat16)``), ``Dk = kv_lora_rank + 64`` with
    ``kv_lora_rank`` a multiple of 128, and any ``H`` (padded to 64-head
    groups); ``read_block = 1`` serves token-level selections. Cache rows no query
    attends may hold anything (NaN, Inf). It runs the per-query kernel; at ``H <= 32``
    :func:`sparse_mla_attention_qblock` runs the query-blocked one (not yet run on a
    GPU, so not chosen here); the TPU's query-blocked knobs are validated and change
    nothing. ``config``:
    ``SparseMlaKernelConfig()`` or ``None``, the one schedule (it has no knobs). ``interpret=True`` runs the kernel in Mosaic GPU
    interpret mode on the CPU.

    ``fp8_dequantize`` (an ``Fp8LatentCache`` only; the same result bits either way):
    ``None`` picks the cheaper of the on-chip dequantization and dequantizing the cache
    with XLA first into a transient bf16 copy, in ragged mode only the pages the page
    table names (``dequantize_store_first``: prefill over a request's own context takes
    the copy, decode over long requests the on-chip path); ``False`` always on chip (no
    copy: the memory-lean choice); ``True`` always the copy.

    Differentiable in ``q`` and ``kv`` (through ``out`` and ``lse``): the forward is the
    kernel, the backward the kernel of ``sparse_mla_bwd_kernel`` from the saved ``out``
    and ``lse`` (bf16 products, float32 sums), for an ``Fp8LatentCache`` XLA's
    (``attn_common.sparse_mla_xla``); the reference's gradient semantics hold.
    ``deterministic`` (the backward kernel only; ``dq`` is reproducible either way):
    ``False``, the cache gradient added by float32 atomics (no extra memory, not
    reproducible bit for bit); ``True``, bitwise reproducible: each query's key-gradient
    rows stored (``sparse_mla_bwd_kernel.PARTS_BYTES`` at a time), then summed per cache
    row in a fixed order; slower, measured in docs/sparse_mla_gpu.md.
    ``return_attn_mass=True``: the mass is computed on XLA from the kernel's LSE
    (``attn_mass_from_lse``: the gather and ``Q K^T`` again, no softmax pass, no value
    product).
    """
    return _sparse_mla(call, config, fp8_dequantize, deterministic, schedule="per-query")


@public_op(sparse_mla_call)
def sparse_mla_attention_qblock(
    call: SparseMlaCall,
    *,
    config: SparseMlaKernelConfig | None = None,
    fp8_dequantize: bool | None = None,
    deterministic: bool = False,
):
    """:func:`sparse_mla_attention` with the query-blocked kernel always (``H <= 32``).

    ``query_block_for(H)`` consecutive queries (``64 / H``, heads padded to a power of
    two) share one program; their union of selected rows is gathered once and each
    query keeps its own by a membership mask. The same result as the per-query kernel
    (to rounding: keys meet the softmax in another order), the same contract, backward
    and ``return_attn_mass``; at ``H > 32`` it is the per-query kernel. Interpret-tested
    and cross-lowered for CUDA; not yet run on a GPU. Where picks overlap (sinks, a
    local window, a shared hot set, multi-token decode) it gathers a fraction of the
    rows (0.29-0.57 of them on the benchmark's overlapping picks at H 16 / 32).
    """
    return _sparse_mla(call, config, fp8_dequantize, deterministic, schedule="qblock")


def scheduled(schedule: str):
    """``sparse_mla_attention`` with its kernel fixed: ``"per-query"`` (what
    ``sparse_mla_attention`` runs), ``"qblock"`` (``sparse_mla_attention_qblock``) or
    ``"auto"`` (the per-call choice, ``_prefer_blocked``). For the benchmark that times
    them on the same call and the tests; not an API."""
    if schedule not in ("per-query", "qblock", "auto"):
        raise ValueError(f"schedule: got {schedule!r}, expected per-query, qblock or auto")

    @public_op(sparse_mla_call)
    def op(call: SparseMlaCall, *, fp8_dequantize: bool | None = None):
        return _sparse_mla(call, None, fp8_dequantize, False, schedule=schedule)

    return op


def _sparse_mla(call: SparseMlaCall, config, fp8_dequantize, deterministic, *, schedule):
    problem = call.problem
    # (latent, rope): the write-then-attend wrappers' query, read apart by the kernel.
    names = ("qpe", "cache") if isinstance(call.q, tuple) else ("q", "kv")
    reason = sparse_mla_unsupported(
        None, cache_compute_dtype(call.kv), problem.dk, problem.dv, names=names
    )
    if reason is not None:
        error = TypeError if "dtype" in reason else NotImplementedError
        raise error(reason + "; attn_reference takes any")
    if config is not None and not isinstance(config, SparseMlaKernelConfig):
        raise TypeError(
            f"config: got {type(config).__name__}, expected SparseMlaKernelConfig or None"
        )
    check_fp8_dequantize(fp8_dequantize)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: got {deterministic!r}, expected a bool")
    target = resolve_target(call.interpret)
    forward = functools.partial(
        _kernel_forward, fp8_dequantize=fp8_dequantize, target=target, schedule=schedule
    )
    backward = functools.partial(_kernel_backward, deterministic=deterministic, target=target)
    return kernel_result(call, forward, backward)


def _kernel_forward(call: SparseMlaCall, *, fp8_dequantize, target, schedule):
    """The kernel's ``(out [B, S, H, Dv], lse [B, S, H])`` (the LSE always)."""
    problem = call.problem
    q, q_rope = call.q if isinstance(call.q, tuple) else (call.q, None)
    kv, ragged = call.kv, call.ragged_kwargs()
    if isinstance(kv, Fp8LatentCache):
        kv, ragged = _fp8_store(problem, kv, ragged, fp8_dequantize, block=PAIR_ROWS)
    units, store = sparse_mla_units(problem, kv, call.indices, call.positions, **ragged)
    if q_rope is not None:
        q_rope = q_rope.reshape(-1, problem.heads, ROPE)
    out, lse = _attend(
        q.reshape(-1, problem.heads, q.shape[-1]),
        q_rope,
        store,
        units,
        sm_scale=problem.sm_scale,
        dv=problem.dv,
        read_block=problem.read_block,
        target=target,
        schedule=schedule,
    )
    shape = (problem.batch, problem.num_queries, problem.heads)
    return out.reshape(*shape, problem.dv), lse.reshape(shape)


def _kernel_backward(q, store, units, lse, g_out, delta, problem, *, deterministic, target):
    """``(dq, dkeys)`` float32 by the backward kernel, from the forward's row table
    (built again: 0.11 ms at 4096 x 2048); ``None`` (XLA's backward) for an
    ``Fp8LatentCache``, whose gradient goes through its dequantization."""
    if isinstance(store, Fp8LatentCache):
        return None
    rows, counts = _row_table(units, problem.read_block, store.shape[0], target)
    return sparse_mla_rows_backward(
        q.astype(jnp.bfloat16), store, rows, counts, lse, g_out, delta,
        sm_scale=problem.sm_scale, dv=problem.dv, deterministic=deterministic,
        interpret=target,
    )  # fmt: skip


def _row_table(units, read_block, num_rows, target):
    return selected_rows(
        units,
        read_block=read_block,
        block=PAIR_ROWS,
        num_rows=num_rows,
        # Token-level tables built per query by one kernel (the interpreter cannot run
        # it, so interpret mode keeps XLA's sort; the table is the same either way).
        token_table=target.pick(row_sort.token_rows, None),
    )


def _fp8_store(problem, cache: Fp8LatentCache, ragged: dict, fp8_dequantize, *, block: int):
    """The cache the kernel reads, and the ragged tables that address it: ``cache``
    itself (dequantized on chip), or its bf16 copy ``dequantize_latent_cache(rows)
    .astype(bfloat16)`` where ``fp8_dequantize`` (``None``: ``dequantize_store_first``)
    says so; ragged, of the pages the table names where ``copy_pages`` says (in their
    physical order, so each query's rows keep their order and the result its bits)."""
    rows, named = copy_pages(cache, ragged["page_indices"])
    if fp8_dequantize is None:
        capacity = (
            problem.batch
            * problem.num_queries
            * row_table_width(problem.top_k, problem.read_block, block)
        )
        fp8_dequantize = dequantize_store_first(rows, capacity, problem.heads)
    if not fp8_dequantize:
        return cache, ragged
    if named:
        cache, table = named_pages(cache, ragged["page_indices"])
        ragged = {**ragged, "page_indices": table}
    return dequantize_latent_cache(cache).astype(jnp.bfloat16), ragged


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "read_block", "target", "schedule"))
def _attend(q, q_rope, store, units, *, sm_scale, dv, read_block, target, schedule):
    """``(out [N, H, Dv], lse [N, H])``: ``schedule`` ``"qblock"`` (the blocked kernel
    where ``H <= 32``), ``"auto"`` (``_prefer_blocked`` picks, on the device) or
    ``"per-query"``."""
    rows, counts = _row_table(units, read_block, store.shape[0], target)
    kw = dict(sm_scale=sm_scale, dv=dv, q_rope=q_rope, interpret=target)
    qb = query_block_for(q.shape[1])
    # Nothing to block, keys past int32, or the per-query kernel asked for (benchmarks).
    if qb == 1 or store.shape[0] * qb >= ABSENT or schedule == "per-query":
        return sparse_mla_rows_attention(q, store, rows, counts, **kw)
    tokens = q.shape[0]
    pad = -tokens % qb
    if pad:  # the last block's missing queries attend nothing
        rows = jnp.pad(rows, ((0, pad), (0, 0)), constant_values=-1)
        counts = jnp.pad(counts, (0, pad))

    def blocked():
        def padded(x):
            return None if x is None else jnp.pad(x, ((0, pad), (0, 0), (0, 0)))

        union = block_union(rows, counts, qb, block=PAIR_ROWS, num_rows=store.shape[0])
        out, lse = sparse_mla_union_attention(
            padded(q), store, union, **{**kw, "q_rope": padded(q_rope)}
        )
        return out[:tokens], lse[:tokens]

    if schedule == "qblock":
        return blocked()

    def per_query():
        return sparse_mla_rows_attention(q, store, rows[:tokens], counts[:tokens], **kw)

    return jax.lax.cond(_prefer_blocked(rows, counts, qb), blocked, per_query)


def _prefer_blocked(rows, counts, query_block: int) -> jax.Array:
    """Whether the query-blocked kernel is the faster on this row table (traced bool):
    its row pairs, estimated from the exact unions of ``PROBE_BLOCKS`` evenly spaced
    blocks, at most ``BLOCKED_PAIR_SHARE`` of the per-query kernel's (each query's own
    pairs). Random picks share almost nothing (the union is ``query_block`` times a
    query's rows) and keep the per-query kernel; overlapping ones take the blocked."""
    blocked = sampled_union_pairs(rows, counts, query_block, samples=PROBE_BLOCKS, pair=PAIR_ROWS)
    own = ((counts + PAIR_ROWS - 1) // PAIR_ROWS).sum().astype(jnp.float32)
    return blocked <= BLOCKED_PAIR_SHARE * own


@public_op(write_back_call)
def paged_write_back(call: WriteBackCall) -> jax.Array:
    """``cache[loc[t]] = rows[t]`` for every ``loc[t] >= 0``, as an XLA scatter on the GPU.

    Bit-identical to ``attn_reference.paged_write_back`` (the same scatter; an
    ``Fp8LatentCache`` gets its new rows quantized and scattered field by field). ``r_cap``
    and ``interpret`` are accepted for API parity.
    """
    return write_back_by_scatter(call)


@public_op(prefill_call)
def prefill_write_and_attend_ragged(
    call: PrefillCall,
    *,
    config: SparseMlaKernelConfig | None = None,
    fp8_dequantize: bool | None = None,
    deterministic: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Write the new tokens' latents into the paged cache, then attend (ragged mode).

    The attention is :func:`sparse_mla_attention`'s (the per-query kernel);
    ``query_block`` / ``u_max`` are validated and change nothing on Hopper. The kernel
    reads ``ql`` and ``qpe`` where they are: joining them first would copy all of Q
    (0.3-0.4 ms for 4096 tokens x 128 heads on the H200, docs/sparse_mla_gpu.md).
    ``config``, ``fp8_dequantize`` and ``deterministic``: as for
    :func:`sparse_mla_attention` (the cache attended is the one written).
    """
    return _write_then_attend(sparse_mla_attention, call, config, fp8_dequantize, deterministic)


@public_op(prefill_call)
def prefill_write_and_attend_ragged_qblock(
    call: PrefillCall,
    *,
    config: SparseMlaKernelConfig | None = None,
    fp8_dequantize: bool | None = None,
    deterministic: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """:func:`prefill_write_and_attend_ragged` attending with
    :func:`sparse_mla_attention_qblock` (the query-blocked kernel always, ``H <= 32``)."""
    return _write_then_attend(
        sparse_mla_attention_qblock, call, config, fp8_dequantize, deterministic
    )


def _write_then_attend(op, call: PrefillCall, config, fp8_dequantize, deterministic):
    attend = functools.partial(
        op.impl, config=config, fp8_dequantize=fp8_dequantize, deterministic=deterministic
    )
    return write_then_attend(paged_write_back.impl, attend, call, split_q=True)
