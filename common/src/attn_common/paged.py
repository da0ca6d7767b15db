"""Paged KV cache: the latent row layout and the input contracts of the paged ops.

A paged cache is a pool of fixed-size pages holding one latent row per token:
``cache [num_pages, page_size // pk, pk, D]`` with ``pk = kv_packing(dtype)`` tokens per
32-bit word. Flat slot ``s`` is page ``s // page_size``, row ``s % page_size``; which
pages a request owns is given by the ragged tables (see the ragged paged mode in
``attn_common.sparse_mla``'s module docstring for the full layout). For sparse MLA each
row is ``[c_kv | k_rope | 0 ...]``, ``D = Dk_pad = padded_dk(kv_lora_rank + rope)``.

``paged_write_back(cache, rows, loc)`` writes ``cache[loc[t]] = rows[t]`` in increasing
``t`` (a slot listed twice keeps the last row: ``attn_common.keep_last_writes``);
``prefill_write_and_attend_ragged`` builds the rows with :func:`latent_rows`, writes
them, then runs ragged sparse MLA over the cache. Every backend validates their inputs
here, before tracing, so they reject the same calls with the same errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_common.metadata import check_ragged_metadata
from attn_common.ranker import array_shape
from attn_common.sparse_mla import _check_positive_int, padded_dk
from attn_common.tables import keep_last_writes, kv_packing


def latent_rows(kvc: jax.Array, kpe: jax.Array, *, width: int, dtype) -> jax.Array:
    """Cache rows ``[T, width]``: ``[c_kv | k_rope | 0 ...]`` in the cache dtype.

    ``kvc`` is ``[T, kv_lora_rank]``, ``kpe`` ``[T, rope]`` or ``[T, 1, rope]``.
    """
    num_tokens = kvc.shape[0]
    kpe = kpe.reshape(num_tokens, -1)
    row = jnp.concatenate([kvc.astype(dtype), kpe.astype(dtype)], axis=1)
    return jnp.pad(row, ((0, 0), (0, width - row.shape[1])))


@jax.jit
def scatter_write_back(cache: jax.Array, rows: jax.Array, loc: jax.Array) -> jax.Array:
    """The write-back as one XLA scatter: ``cache[loc[t]] = rows[t]`` where ``loc >= 0``.

    ``loc`` must already hold one row per slot (``keep_last_writes``: a repeated slot
    keeps its last row, the others ``-1``); negative or out-of-range slots are dropped.
    The reference ``paged_write_back`` is this scatter, and every backend's write-back
    must equal it bit for bit.
    """
    flat = cache.reshape(-1, cache.shape[-1])
    flat = flat.at[loc.astype(jnp.int32)].set(
        rows.astype(cache.dtype), mode="drop", wrap_negative_indices=False
    )
    return flat.reshape(cache.shape)


def write_back_by_scatter(cache: jax.Array, rows: jax.Array, loc: jax.Array, page_size: int):
    """The whole write-back as the reference defines it: validate the inputs
    (``check_write_back_inputs``), keep the last row of a repeated slot
    (``keep_last_writes``) and scatter (``scatter_write_back``). Backends whose write-back
    is this XLA scatter call it; a kernel write-back must equal it bit for bit."""
    num_pages, rows_per_page, pk, _ = check_write_back_inputs(cache, rows, loc, page_size)
    return scatter_write_back(cache, rows, keep_last_writes(loc, num_pages * rows_per_page * pk))


def check_paged_cache(cache, page_size) -> tuple[int, ...]:
    """Validate a paged cache ``[num_pages, page_size // pk, pk, D]``; return its shape."""
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


def _check_int_array(x, name: str, want: tuple, hint: str) -> tuple[int, ...]:
    """Integer array of shape ``want`` (``None`` = any size on that axis)."""
    shape = array_shape(x, name)
    if len(shape) != len(want) or any(
        w is not None and g != w for g, w in zip(shape, want, strict=True)
    ):
        raise ValueError(f"{name}: got shape {shape}, expected {hint}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: got dtype {x.dtype}, expected an integer dtype")
    return shape


def _check_float_array(x, name: str) -> tuple[int, ...]:
    shape = array_shape(x, name)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: got dtype {x.dtype}, expected a floating dtype")
    return shape


def check_write_back_inputs(cache, rows, loc, page_size) -> tuple[int, ...]:
    """Validate ``paged_write_back`` inputs; return the cache shape.

    ``cache`` a paged cache (:func:`check_paged_cache`), ``rows [T, D]``, ``loc`` int ``[T]``.
    """
    shape = check_paged_cache(cache, page_size)
    feat = shape[3]
    rows_shape = array_shape(rows, "rows")
    if len(rows_shape) != 2 or rows_shape[1] != feat:
        raise ValueError(f"rows: got shape {rows_shape}, expected [T, D={feat}]")
    _check_int_array(loc, "loc", rows_shape[:1], f"[T={rows_shape[0]}]")
    return shape


def check_prefill_inputs(
    ql,
    qpe,
    kvc,
    kpe,
    cache,
    topk_pages,
    positions,
    loc,
    seq_lens,
    cu_q_lens,
    cu_kv_lens,
    page_indices,
    *,
    kv_lora_rank,
    page_size,
) -> None:
    """Validate ``prefill_write_and_attend_ragged`` inputs before tracing.

    Shapes: ``ql [T, H, kv_lora_rank]``, ``qpe [T, H, rope]``, ``kvc [T, kv_lora_rank]``,
    ``kpe [T, rope]`` or ``[T, 1, rope]`` (all floating); ``cache`` a floating paged cache
    with ``D = padded_dk(kv_lora_rank + rope)``; integer ``topk_pages [T, K]``,
    ``positions [T]``, ``loc [T]``, ``seq_lens [num_seqs]``, ``cu_q_lens`` and
    ``cu_kv_lens [num_seqs + 1]``, ``page_indices [total_pages]``. Raises ``ValueError``
    for a bad shape or value and ``TypeError`` for a bad dtype, naming the argument.
    """
    for name, x, rank, hint in (
        ("ql", ql, 3, "[T, H, kv_lora_rank]"),
        ("qpe", qpe, 3, "[T, H, rope]"),
        ("kvc", kvc, 2, "[T, kv_lora_rank]"),
    ):
        shape = _check_float_array(x, name)
        if len(shape) != rank:
            raise ValueError(f"{name}: got shape {shape}, expected rank {rank} {hint}")
    kv_lora_rank = _check_positive_int(kv_lora_rank, "kv_lora_rank")
    num_tokens, heads, dv = ql.shape
    if dv != kv_lora_rank:
        raise ValueError(f"ql: got last dim {dv}, expected kv_lora_rank = {kv_lora_rank}")
    qpe_shape = tuple(qpe.shape)
    if qpe_shape[:2] != (num_tokens, heads):
        raise ValueError(f"qpe: got shape {qpe_shape}, expected [{num_tokens}, {heads}, rope]")
    rope = qpe_shape[2]
    kvc_shape = tuple(kvc.shape)
    if kvc_shape != (num_tokens, dv):
        raise ValueError(f"kvc: got shape {kvc_shape}, expected [{num_tokens}, {dv}]")
    kpe_shape = _check_float_array(kpe, "kpe")
    if kpe_shape not in ((num_tokens, rope), (num_tokens, 1, rope)):
        raise ValueError(
            f"kpe: got shape {kpe_shape}, expected [{num_tokens}, {rope}] "
            f"(or [{num_tokens}, 1, {rope}])"
        )
    _check_int_array(topk_pages, "topk_pages", (num_tokens, None), f"[T={num_tokens}, K]")
    _check_int_array(positions, "positions", (num_tokens,), f"[T={num_tokens}]")
    _check_int_array(loc, "loc", (num_tokens,), f"[T={num_tokens}]")
    (num_seqs,) = _check_int_array(seq_lens, "seq_lens", (None,), "[num_seqs]")
    for name, x in (("cu_q_lens", cu_q_lens), ("cu_kv_lens", cu_kv_lens)):
        _check_int_array(x, name, (num_seqs + 1,), f"[num_seqs + 1 = {num_seqs + 1}]")
    _check_int_array(page_indices, "page_indices", (None,), "[total_pages]")
    check_paged_cache(cache, page_size)
    if not jnp.issubdtype(cache.dtype, jnp.floating):
        raise TypeError(f"cache: got dtype {cache.dtype}, expected a floating dtype")
    dk_pad = padded_dk(dv + rope)
    if cache.shape[-1] != dk_pad:
        raise ValueError(f"cache: got last dim {cache.shape[-1]}, expected Dk_pad = {dk_pad}")


def write_then_attend(
    write_back,
    attend,
    ql,
    qpe,
    kvc,
    kpe,
    cache,
    topk_pages,
    positions,
    loc,
    seq_lens,
    cu_q_lens,
    cu_kv_lens,
    page_indices,
    *,
    kv_lora_rank: int,
    page_size: int,
    sm_scale: float,
    split_q: bool = False,
    **attend_kwargs,
):
    """The ``prefill_write_and_attend_ragged`` composition, for any backend.

    Validates, builds each new token's row ``[c_kv | k_rope | 0...]``, writes the rows with
    ``write_back(cache, rows, loc, page_size=...)``, then runs ragged sparse MLA with
    ``attend`` (a backend's ``sparse_mla_attention`` or its ``_qblock`` twin) over the new
    cache. Its query is ``[1, T, H, kv_lora_rank + rope]``, ``ql`` and ``qpe`` joined (a
    copy of all of Q), or with ``split_q`` the pair ``(ql[None], qpe[None])`` for a
    backend that reads the two where they are. Returns ``(out [T, H, kv_lora_rank]
    float32, new_cache)``.
    """
    from attn_common.sparse_mla import seq_id_from_cu_q_lens

    check_prefill_inputs(
        ql, qpe, kvc, kpe, cache, topk_pages, positions, loc, seq_lens, cu_q_lens,
        cu_kv_lens, page_indices, kv_lora_rank=kv_lora_rank, page_size=page_size,
    )  # fmt: skip
    num_tokens = ql.shape[0]
    check_ragged_metadata(
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
        page_size=page_size,
        num_pages=cache.shape[0],
        cu_q_lens=cu_q_lens,
        num_tokens=num_tokens,
        debug_checks=attend_kwargs.get("debug_checks", False),
    )
    rows = latent_rows(kvc, kpe, width=cache.shape[-1], dtype=cache.dtype)
    new_cache = write_back(cache, rows, loc, page_size=page_size)
    if split_q:
        q = (ql[None], qpe.astype(ql.dtype)[None])
    else:
        q = jnp.concatenate([ql, qpe.astype(ql.dtype)], axis=-1)[None]
    out = attend(
        q,
        new_cache,
        topk_pages[None],
        positions.reshape(1, num_tokens),
        sm_scale=sm_scale,
        kv_lora_rank=kv_lora_rank,
        read_block=page_size,
        page_size=page_size,
        q_seq_id=seq_id_from_cu_q_lens(cu_q_lens, num_tokens),
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
        **attend_kwargs,
    )
    return out[0], new_cache
