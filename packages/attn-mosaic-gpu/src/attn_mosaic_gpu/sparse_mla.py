"""Sparse MLA prefill on Hopper behind the shared API names (docs/design.md).

``sparse_mla_attention`` validates with ``attn_common.check_sparse_mla_inputs``, turns the
selection (flat unit ids or ragged request-local pages, ``read_block = 1`` for the
token-level selections of DeepSeek V3.2's indexer) into a per-query row table with
``attn_common.sparse_mla_units`` + ``selected_rows`` (causal bound, ``kv_len``, ``-1``,
out-of-range ids and duplicates all resolved there, outside the kernel; the tables of
token-level selections by the one-CTA-per-query kernel of ``row_sort``), and runs the
gather-attend kernel of ``sparse_mla_kernel``. ``sparse_mla_attention_qblock`` is the
same computation: the query-blocked union schedule is a TPU design, and on Hopper each
program gathers its own token's rows, so the TPU knobs are validated and do not change
anything. ``paged_write_back`` is the XLA scatter (``attn_common.scatter_write_back``),
and the two ``prefill_write_and_attend_ragged`` wrappers compose it with the kernel,
which reads their ``ql`` and ``qpe`` apart (no joined copy of Q).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attn_common import check_sparse_mla_inputs
from attn_common.paged import write_back_by_scatter, write_then_attend
from attn_common.sparse_mla import check_qblock_knobs, empty_result
from attn_common.sparse_mla_rows import selected_rows, sparse_mla_units
from attn_mosaic_gpu import row_sort
from attn_mosaic_gpu.sparse_mla_kernel import (
    ROPE,
    SparseMlaKernelConfig,
    resolve_interpret,
    sparse_mla_rows_attention,
)

__all__ = [
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
    "sparse_mla_unsupported",
]

KERNEL_DTYPE = jnp.bfloat16
_VALUE_MULTIPLE = 128  # each compute warpgroup takes Dv / 2 value columns, whole 64-wide tiles


def sparse_mla_unsupported(q_dtype, kv_dtype, dk: int | None, dv: int | None) -> str | None:
    """Why the Hopper kernel cannot take these static facts (``None``: it can)."""
    for name, dtype in (("q", q_dtype), ("kv", kv_dtype)):
        if dtype is not None and jnp.dtype(dtype) != KERNEL_DTYPE:
            return f"{name}: got dtype {jnp.dtype(dtype).name}, the Hopper kernel takes bfloat16"
    if dv is not None and (dv % _VALUE_MULTIPLE or dv < _VALUE_MULTIPLE):
        return f"kv_lora_rank: got {dv}, the Hopper kernel needs a multiple of {_VALUE_MULTIPLE}"
    if dk is not None and dv is not None and dk != dv + ROPE:
        return (
            f"q: got head dim {dk} with kv_lora_rank {dv}; the Hopper kernel takes "
            f"Dk = kv_lora_rank + {ROPE}"
        )
    return None


def sparse_mla_attention(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    kv_lora_rank: int = 512,
    read_block: int = 128,
    return_lse: bool = False,
    page_size: int | None = None,
    q_seq_id: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
    cu_kv_lens: jax.Array | None = None,
    page_indices: jax.Array | None = None,
    config: SparseMlaKernelConfig | None = None,
    interpret: object = False,
    debug_checks: bool = False,
):
    """Sparse MLA attention over selected KV units on Hopper; the reference's contract.

    Flat mode: ``q [B, S, H, Dk]`` bf16, ``kv [B, T, Dk]`` bf16, ``indices [B, S, K]``
    unit ids (a unit is ``read_block`` tokens, ``1`` for token-level selections; ``-1``
    or out of range = none; duplicates count once), ``positions [B, S]``. Ragged paged
    mode (``q_seq_id`` given): ``B == 1``, ``kv`` the paged cache ``[num_pages,
    page_size // 2, 2, Dk_pad]``, ``indices`` request-local page ids
    (``attn_common.sparse_mla``). ``Dk = kv_lora_rank + 64``, ``kv_lora_rank`` a multiple
    of 128; any ``H`` (padded to 64-head groups); cache rows no query attends may hold
    anything (NaN, Inf). ``config``: the kernel's ``SparseMlaKernelConfig``.
    ``interpret=True`` runs the kernel in Mosaic GPU interpret mode on the CPU.

    Returns ``out [B, S, H, kv_lora_rank]`` float32, or ``(out, lse [B, S, H])``
    (natural log; a query with no valid key gets ``out = 0``, ``lse = -inf``).
    """
    return _sparse_mla(
        q, None, kv, indices, positions, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank,
        read_block=read_block, return_lse=return_lse, page_size=page_size,
        q_seq_id=q_seq_id, seq_lens=seq_lens, cu_kv_lens=cu_kv_lens,
        page_indices=page_indices, config=config, interpret=interpret,
        debug_checks=debug_checks,
    )  # fmt: skip


def _sparse_mla(
    q, q_rope, kv, indices, positions, *, sm_scale, kv_lora_rank, read_block, return_lse,
    page_size, q_seq_id, seq_lens, cu_kv_lens, page_indices, config, interpret, debug_checks,
):  # fmt: skip
    """``sparse_mla_attention``; with ``q_rope`` (``[B, S, H, 64]``) ``q`` holds only the
    latent features ``[B, S, H, kv_lora_rank]`` and the kernel reads the two apart."""
    joined = q
    if q_rope is not None:  # validated as the [B, S, H, Dk] query they make up
        joined = jax.ShapeDtypeStruct((*q.shape[:-1], q.shape[-1] + q_rope.shape[-1]), q.dtype)
    problem = check_sparse_mla_inputs(
        joined,
        kv,
        indices,
        positions,
        sm_scale=sm_scale,
        kv_lora_rank=kv_lora_rank,
        read_block=read_block,
        page_size=page_size,
        q_seq_id=q_seq_id,
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
        debug_checks=debug_checks,
    )
    reason = sparse_mla_unsupported(q.dtype, kv.dtype, problem.dk, problem.dv)
    if reason is not None:
        raise NotImplementedError(reason + " (attn_reference.sparse_mla_attention takes it)")
    if config is not None and not isinstance(config, SparseMlaKernelConfig):
        raise TypeError(
            f"config: got {type(config).__name__}, expected SparseMlaKernelConfig or None"
        )
    config = config or SparseMlaKernelConfig()
    interpret = resolve_interpret(interpret)
    if problem.is_empty:
        return empty_result(problem, return_lse)
    units, store = sparse_mla_units(
        problem,
        kv,
        indices,
        positions,
        page_size=page_size,
        q_seq_id=q_seq_id,
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
    )
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
        config=config,
        interpret=interpret,
    )
    shape = (problem.batch, problem.num_queries, problem.heads)
    out = out.reshape(*shape, problem.dv)
    return (out, lse.reshape(shape)) if return_lse else out


@functools.partial(jax.jit, static_argnames=("sm_scale", "dv", "read_block", "config", "interpret"))
def _attend(q, q_rope, store, units, *, sm_scale, dv, read_block, config, interpret):
    rows, counts = selected_rows(
        units,
        read_block=read_block,
        block=2 * config.block_k,
        num_rows=store.shape[0],
        # Token-level tables built per query by one kernel (the interpreter cannot run
        # it, so interpret mode keeps XLA's sort; the table is the same either way).
        token_table=None if interpret else row_sort.token_rows,
    )
    return sparse_mla_rows_attention(
        q, store, rows, counts, sm_scale=sm_scale, dv=dv, q_rope=q_rope, config=config,
        interpret=interpret,
    )  # fmt: skip


def sparse_mla_attention_qblock(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    kv_lora_rank: int = 512,
    read_block: int = 128,
    return_lse: bool = False,
    page_size: int | None = None,
    q_seq_id: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
    cu_kv_lens: jax.Array | None = None,
    page_indices: jax.Array | None = None,
    query_block: int | None = None,
    u_max: int | None = None,
    head_block: int | None = None,
    config: SparseMlaKernelConfig | None = None,
    interpret: object = False,
    debug_checks: bool = False,
):
    """``sparse_mla_attention``'s twin under the query-blocked name: the same kernel.

    ``query_block``, ``u_max`` and ``head_block`` tune the TPU's query-blocked schedule;
    they are validated (positive ints or ``None``) and change nothing here.
    """
    check_qblock_knobs(query_block, u_max, head_block)
    return sparse_mla_attention(
        q, kv, indices, positions, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank,
        read_block=read_block, return_lse=return_lse, page_size=page_size,
        q_seq_id=q_seq_id, seq_lens=seq_lens, cu_kv_lens=cu_kv_lens,
        page_indices=page_indices, config=config, interpret=interpret,
        debug_checks=debug_checks,
    )  # fmt: skip


def paged_write_back(
    cache: jax.Array,
    rows: jax.Array,
    loc: jax.Array,
    *,
    page_size: int,
    r_cap: int | None = None,
    interpret: object = False,
) -> jax.Array:
    """``cache[loc[t]] = rows[t]`` for every ``loc[t] >= 0``, as an XLA scatter on the GPU.

    Bit-identical to ``attn_reference.paged_write_back`` (the same scatter); see it for
    the arguments. ``r_cap`` and ``interpret`` are accepted for API parity.
    """
    del r_cap, interpret
    return write_back_by_scatter(cache, rows, loc, page_size)


def prefill_write_and_attend_ragged(
    ql: jax.Array,
    qpe: jax.Array,
    kvc: jax.Array,
    kpe: jax.Array,
    cache: jax.Array,
    topk_pages: jax.Array,
    positions: jax.Array,
    loc: jax.Array,
    seq_lens: jax.Array,
    cu_q_lens: jax.Array,
    cu_kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    kv_lora_rank: int,
    page_size: int,
    sm_scale: float,
    interpret: object = False,
    query_block: int | None = None,
    u_max: int | None = None,
    config: SparseMlaKernelConfig | None = None,
    debug_checks: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Write the new tokens' latents into the paged cache, then attend (ragged mode).

    Same arguments and result as ``attn_reference.prefill_write_and_attend_ragged``:
    ``(out [T, H, kv_lora_rank] float32, new_cache)``. ``query_block`` / ``u_max`` are
    validated and change nothing on Hopper. The kernel reads ``ql`` and ``qpe`` where
    they are: joining them first would copy all of Q (0.3-0.4 ms for 4096 tokens x 128
    heads on the H200, docs/sparse_mla_gpu.md).
    """
    check_qblock_knobs(query_block, u_max, None)
    return write_then_attend(
        paged_write_back, _attend_q_parts, ql, qpe, kvc, kpe, cache, topk_pages,
        positions, loc, seq_lens, cu_q_lens, cu_kv_lens, page_indices,
        kv_lora_rank=kv_lora_rank, page_size=page_size, sm_scale=sm_scale, split_q=True,
        config=config, interpret=interpret, debug_checks=debug_checks,
    )  # fmt: skip


def _attend_q_parts(q_parts, kv, indices, positions, **kwargs):
    """``write_then_attend``'s ``attend`` with ``split_q``: ``q_parts = (ql, qpe)``."""
    ql, qpe = q_parts
    kwargs.setdefault("return_lse", False)
    return _sparse_mla(ql, qpe, kv, indices, positions, **kwargs)


prefill_write_and_attend_ragged_qblock = prefill_write_and_attend_ragged
