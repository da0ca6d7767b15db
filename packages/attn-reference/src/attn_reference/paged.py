"""Reference paged KV write and the ragged write-then-attend wrapper (docs/design.md).

``paged_write_back`` is the scatter the TPU kernel must match bit for bit;
``prefill_write_and_attend_ragged`` writes the new tokens' latents into the paged
cache and then runs ragged sparse MLA attention over it.
"""

from __future__ import annotations

import jax

from attn_common.paged import write_back_by_scatter, write_then_attend
from attn_reference.sparse_mla import sparse_mla_attention


def paged_write_back(
    cache: jax.Array,
    rows: jax.Array,
    loc: jax.Array,
    *,
    page_size: int,
    r_cap: int | None = None,
    interpret: object = False,
) -> jax.Array:
    """``cache[loc[t]] = rows[t]`` for every ``loc[t] >= 0``; returns the new cache.

    Args:
      cache: paged cache ``[num_pages, page_size // pk, pk, D]``; flat slot ``s`` is
        page ``s // page_size``, row ``s % page_size``.
      rows: ``[T, D]`` new rows, cast to the cache dtype.
      loc: int ``[T]`` flat slot per row; negative or ``>= num_pages * page_size`` rows
        are dropped. A slot listed more than once takes the last of its rows (largest
        ``t``), as if the writes ran in order.
      r_cap: the kernel's run-table size; accepted for API parity.
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
    debug_checks: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Write the new tokens' latents into the paged cache, then attend (ragged mode).

    Args:
      ql: ``[T, H, kv_lora_rank]`` absorbed latent query; qpe: ``[T, H, rope]``.
      kvc: ``[T, kv_lora_rank]`` new latents; kpe: ``[T, rope]`` (or ``[T, 1, rope]``).
      cache: ``[num_pages, page_size // pk, pk, Dk_pad]``.
      topk_pages: ``[T, K]`` request-local page ids (``-1`` = none).
      positions: ``[T]`` request-local query positions. loc: ``[T]`` flat cache slot.
      seq_lens / cu_q_lens / cu_kv_lens / page_indices: the packed ragged tables.
      query_block / u_max: accepted so the ``_qblock`` twin is a drop-in replacement.
      debug_checks: checkify the ragged tables and indices under jit.

    Returns ``(out [T, H, kv_lora_rank] float32, new_cache)``.
    """
    del query_block, u_max
    return write_then_attend(
        paged_write_back, sparse_mla_attention, ql, qpe, kvc, kpe, cache, topk_pages,
        positions, loc, seq_lens, cu_q_lens, cu_kv_lens, page_indices,
        kv_lora_rank=kv_lora_rank, page_size=page_size, sm_scale=sm_scale,
        debug_checks=debug_checks,
    )  # fmt: skip


prefill_write_and_attend_ragged_qblock = prefill_write_and_attend_ragged
