"""Reference paged KV write and the ragged write-then-attend wrapper (SPEC section 4).

``paged_write_back`` is the scatter the TPU kernel must match bit for bit;
``prefill_write_and_attend_ragged`` writes the new tokens' latents into the paged
cache and then runs ragged sparse MLA attention over it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_common import kv_packing, padded_dk, seq_id_from_cu_q_lens
from attn_common.ranker import array_shape
from attn_reference.sparse_mla import sparse_mla_attention


def _check_paged_cache(cache, page_size) -> tuple[int, int, int, int]:
    shape = array_shape(cache, "cache")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size: got {page_size!r}, expected a positive int")
    pk = kv_packing(cache.dtype)
    if len(shape) != 4 or shape[2] != pk or shape[1] * shape[2] != page_size:
        raise ValueError(
            f"cache: got shape {shape}, expected [num_pages, page_size // {pk}, {pk}, D] "
            f"with page_size = {page_size} for dtype {cache.dtype}"
        )
    return shape


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
        are dropped. Valid slots must be distinct (a slot written twice is undefined).
      r_cap: the kernel's run-table size; accepted for API parity.
    """
    del r_cap, interpret
    _, _, _, feat = _check_paged_cache(cache, page_size)
    rows_shape = array_shape(rows, "rows")
    if len(rows_shape) != 2 or rows_shape[1] != feat:
        raise ValueError(f"rows: got shape {rows_shape}, expected [T, D={feat}]")
    loc_shape = array_shape(loc, "loc")
    if loc_shape != rows_shape[:1]:
        raise ValueError(f"loc: got shape {loc_shape}, expected [T={rows_shape[0]}]")
    if not jnp.issubdtype(loc.dtype, jnp.integer):
        raise TypeError(f"loc: got dtype {loc.dtype}, expected an integer dtype")
    return _scatter_rows(cache, rows, loc)


@jax.jit
def _scatter_rows(cache, rows, loc):
    flat = cache.reshape(-1, cache.shape[-1])
    flat = flat.at[loc.astype(jnp.int32)].set(
        rows.astype(cache.dtype), mode="drop", wrap_negative_indices=False
    )
    return flat.reshape(cache.shape)


def _check_index_array(x, name: str, want: tuple, hint: str) -> None:
    """Integer array of shape ``want`` (``None`` = any size on that axis)."""
    shape = array_shape(x, name)
    if len(shape) != len(want) or any(
        w is not None and g != w for g, w in zip(shape, want, strict=True)
    ):
        raise ValueError(f"{name}: got shape {shape}, expected {hint}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: got dtype {x.dtype}, expected an integer dtype")


def latent_rows(kvc: jax.Array, kpe: jax.Array, *, width: int, dtype) -> jax.Array:
    """Cache rows ``[T, width]``: ``[c_kv | k_rope | 0 ...]`` in the cache dtype."""
    num_tokens = kvc.shape[0]
    kpe = kpe.reshape(num_tokens, -1)
    row = jnp.concatenate([kvc.astype(dtype), kpe.astype(dtype)], axis=1)
    return jnp.pad(row, ((0, 0), (0, width - row.shape[1])))


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
    query_block: int = 256,
) -> tuple[jax.Array, jax.Array]:
    """Write the new tokens' latents into the paged cache, then attend (ragged mode).

    Args:
      ql: ``[T, H, kv_lora_rank]`` absorbed latent query; qpe: ``[T, H, rope]``.
      kvc: ``[T, kv_lora_rank]`` new latents; kpe: ``[T, rope]`` (or ``[T, 1, rope]``).
      cache: ``[num_pages, page_size // pk, pk, Dk_pad]``.
      topk_pages: ``[T, K]`` request-local page ids (``-1`` = none).
      positions: ``[T]`` request-local query positions. loc: ``[T]`` flat cache slot.
      seq_lens / cu_q_lens / cu_kv_lens / page_indices: the packed ragged tables.
      query_block: accepted so the ``_qblock`` twin is a drop-in replacement.

    Returns ``(out [T, H, kv_lora_rank] float32, new_cache)``.
    """
    del query_block
    for name, x, rank in (("ql", ql, 3), ("qpe", qpe, 3), ("kvc", kvc, 2)):
        shape = array_shape(x, name)
        if len(shape) != rank:
            raise ValueError(f"{name}: got shape {shape}, expected rank {rank}")
    num_tokens, heads, dv = ql.shape
    if dv != kv_lora_rank:
        raise ValueError(f"ql: got last dim {dv}, expected kv_lora_rank = {kv_lora_rank}")
    if qpe.shape[:2] != (num_tokens, heads):
        raise ValueError(f"qpe: got shape {qpe.shape}, expected [{num_tokens}, {heads}, rope]")
    rope = qpe.shape[2]
    _check_index_array(topk_pages, "topk_pages", (num_tokens, None), f"[T={num_tokens}, K]")
    _check_index_array(positions, "positions", (num_tokens,), f"[T={num_tokens}]")
    _check_index_array(seq_lens, "seq_lens", (None,), "[num_seqs]")
    num_seqs = seq_lens.shape[0]
    _check_index_array(cu_q_lens, "cu_q_lens", (num_seqs + 1,), f"[num_seqs + 1 = {num_seqs + 1}]")
    if kvc.shape != (num_tokens, dv):
        raise ValueError(f"kvc: got shape {kvc.shape}, expected [{num_tokens}, {dv}]")
    if array_shape(kpe, "kpe")[0] != num_tokens or int(jnp.size(kpe)) != num_tokens * rope:
        raise ValueError(f"kpe: got shape {kpe.shape}, expected [{num_tokens}, {rope}]")
    _check_paged_cache(cache, page_size)
    if cache.shape[-1] != padded_dk(dv + rope):
        raise ValueError(
            f"cache: got last dim {cache.shape[-1]}, expected Dk_pad = {padded_dk(dv + rope)}"
        )
    rows = latent_rows(kvc, kpe, width=cache.shape[-1], dtype=cache.dtype)
    new_cache = paged_write_back(cache, rows, loc, page_size=page_size)
    q = jnp.concatenate([ql, qpe.astype(ql.dtype)], axis=-1)[None]
    out = sparse_mla_attention(
        q,
        new_cache,
        topk_pages[None],
        positions.reshape(1, num_tokens),
        sm_scale=sm_scale,
        kv_lora_rank=dv,
        read_block=page_size,
        page_size=page_size,
        q_seq_id=seq_id_from_cu_q_lens(cu_q_lens, num_tokens),
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
    )
    return out[0], new_cache


prefill_write_and_attend_ragged_qblock = prefill_write_and_attend_ragged
