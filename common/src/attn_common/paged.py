"""Paged KV cache: the latent row layout and the input contracts of the paged ops.

A paged cache is a pool of fixed-size pages holding one latent row per token:
``cache [num_pages, page_size // pk, pk, D]`` with ``pk = kv_packing(dtype)`` tokens per
32-bit word. Flat slot ``s`` is page ``s // page_size``, row ``s % page_size``; which
pages a request owns is given by the ragged tables (see the ragged paged mode in
``attn_common.sparse_mla``'s module docstring for the full layout). For sparse MLA each
row is ``[c_kv | k_rope | 0 ...]``, ``D = Dk_pad = padded_dk(kv_lora_rank + rope)``.

``paged_write_back(cache, rows, loc)`` writes ``cache[loc[t]] = rows[t]`` in increasing
``t`` (a slot listed twice keeps the last row: ``attn_common.tables.keep_last_writes``);
``prefill_write_and_attend_ragged`` builds the rows with :func:`latent_rows`, writes
them, then runs ragged sparse MLA over the cache. Every backend validates their inputs
here, before tracing, so they reject the same calls with the same errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from attn_common.fp8_cache import (
    LATENT,
    ROPE,
    Fp8LatentCache,
    check_fp8_cache,
    check_fp8_widths,
    quantize_latent_cache,
)
from attn_common.ranker import array_shape
from attn_common.sparse_mla import _check_positive_int, padded_dk
from attn_common.tables import keep_last_writes, kv_packing

if TYPE_CHECKING:
    from attn_common.spec import PrefillCall, SparseMlaCall, WriteBackCall


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
    must equal it bit for bit. An ``Fp8LatentCache`` and its ``Fp8LatentCache`` rows are
    scattered field by field.
    """
    if isinstance(cache, Fp8LatentCache):
        return jax.tree.map(lambda c, r: scatter_write_back(c, r, loc), cache, rows)
    flat = cache.reshape(-1, cache.shape[-1])
    flat = flat.at[loc.astype(jnp.int32)].set(
        rows.astype(cache.dtype), mode="drop", wrap_negative_indices=False
    )
    return flat.reshape(cache.shape)


def write_back_by_scatter(call: WriteBackCall) -> jax.Array:
    """The whole write-back as the reference defines it, on a validated call
    (``attn_common.spec.write_back_call``): keep the last row of a repeated slot
    (``keep_last_writes``) and scatter (``scatter_write_back``). Backends whose write-back
    is this XLA scatter use it; a kernel write-back must equal it bit for bit.

    An ``Fp8LatentCache`` takes floating rows quantized (``quantize_latent_cache``: only
    the new rows, the cache is neither read nor converted) or ``Fp8LatentCache`` rows."""
    rows = call.rows
    if isinstance(call.cache, Fp8LatentCache) and not isinstance(rows, Fp8LatentCache):
        rows = quantize_latent_cache(rows.astype(jnp.float32))
    return scatter_write_back(call.cache, rows, keep_last_writes(call.loc, call.slots))


def copy_pages(cache, page_indices: jax.Array | None) -> tuple[int, bool]:
    """What a dequantized copy of an FP8 cache (``[B, T]`` flat, ``[pages, page]``
    paged) would hold: ``(rows, named)``. Paged, when the page table has at most half
    as many slots as the pool has pages, only the pages it names (``named``: gather them
    with :func:`named_pages` first; nearer the pool's size the gather would cost more
    than it saves); else the whole cache."""
    grid = tuple(cache.shape)
    slots = None if page_indices is None else page_indices.shape[0]
    if slots is not None and 2 * slots <= grid[0]:
        return slots * grid[1], True
    return math.prod(grid), False


def check_fp8_dequantize(fp8_dequantize) -> None:
    """The kernel backends' ``fp8_dequantize`` option: ``True``, ``False`` or ``None``."""
    if fp8_dequantize is not None and not isinstance(fp8_dequantize, bool):
        raise TypeError(
            f"fp8_dequantize: got {type(fp8_dequantize).__name__}, expected bool or None"
        )


def named_pages(cache, page_indices: jax.Array):
    """``(pages, table)``: the pages of ``cache`` (a pytree of ``[num_pages, ...]``
    arrays) that ``page_indices`` names, in their physical order, and the page table
    renamed to them. A slot outside ``[0, num_pages)`` stays outside (``-1``), and its
    rows are not attended either way. The physical order keeps every query's rows in
    the order they had, so a kernel that sums them in row order keeps its bits."""
    num_pages = jax.tree.leaves(cache)[0].shape[0]
    slots = page_indices.shape[0]
    inside = (page_indices >= 0) & (page_indices < num_pages)
    key = jnp.where(inside, page_indices, num_pages)
    pages = jnp.unique(key, size=slots, fill_value=num_pages)  # sorted, the sentinel last
    cache = jax.tree.map(lambda a: a[jnp.minimum(pages, num_pages - 1)], cache)
    renamed = jnp.searchsorted(pages, key).astype(page_indices.dtype)
    return cache, jnp.where(inside, renamed, -1)


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

    ``cache`` a paged cache (:func:`check_paged_cache`), ``rows [T, D]``, ``loc`` int ``[T]``;
    or ``cache`` an ``Fp8LatentCache`` ``[num_pages, page_size]`` and ``rows`` floating
    ``[T, 576]`` or an ``Fp8LatentCache`` ``[T]`` (returns the token grid).
    """
    if isinstance(cache, Fp8LatentCache):
        return _check_fp8_write_back(cache, rows, loc, page_size)
    shape = check_paged_cache(cache, page_size)
    feat = shape[3]
    rows_shape = array_shape(rows, "rows")
    floating = jnp.issubdtype(rows.dtype, jnp.floating) and jnp.issubdtype(
        cache.dtype, jnp.floating
    )
    if not floating and jnp.dtype(rows.dtype) != jnp.dtype(cache.dtype):
        raise TypeError(
            f"rows: got dtype {jnp.dtype(rows.dtype).name} for a {jnp.dtype(cache.dtype).name} "
            "cache, expected the cache's dtype (floating rows are cast to a floating cache; "
            "nothing else is cast)"
        )
    if len(rows_shape) != 2 or rows_shape[1] != feat:
        raise ValueError(f"rows: got shape {rows_shape}, expected [T, D={feat}]")
    _check_int_array(loc, "loc", rows_shape[:1], f"[T={rows_shape[0]}]")
    return shape


def _check_fp8_paged(cache, page_size, name: str = "cache") -> tuple[int, ...]:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size: got {page_size!r}, expected a positive int")
    hint = f"[num_pages, page_size={page_size}]"
    return check_fp8_cache(cache, name, (None, page_size), hint)


def _check_fp8_write_back(cache, rows, loc, page_size) -> tuple[int, ...]:
    grid = _check_fp8_paged(cache, page_size)
    if isinstance(rows, Fp8LatentCache):
        (num_tokens,) = check_fp8_cache(rows, "rows", (None,), "[T]")
    else:
        rows_shape = array_shape(rows, "rows")
        if not jnp.issubdtype(rows.dtype, jnp.floating):
            raise TypeError(
                f"rows: got dtype {jnp.dtype(rows.dtype).name} for an Fp8LatentCache, expected "
                "a floating dtype (quantized as written) or an Fp8LatentCache"
            )
        if len(rows_shape) != 2 or rows_shape[1] != LATENT + ROPE:
            raise ValueError(
                f"rows: got shape {rows_shape}, expected [T, {LATENT + ROPE}] for an "
                "Fp8LatentCache (512 latent values, then 64 rope values)"
            )
        num_tokens = rows_shape[0]
    _check_int_array(loc, "loc", (num_tokens,), f"[T={num_tokens}]")
    return grid


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
    if isinstance(cache, Fp8LatentCache):
        _check_fp8_paged(cache, page_size)
        check_fp8_widths(dv + rope, kv_lora_rank, q_name="ql + qpe")
        return
    check_paged_cache(cache, page_size)
    _check_float_array(cache, "cache")
    dk_pad = padded_dk(dv + rope)
    if cache.shape[-1] != dk_pad:
        raise ValueError(f"cache: got last dim {cache.shape[-1]}, expected Dk_pad = {dk_pad}")


def write_then_attend(
    write_back: Callable[[WriteBackCall], jax.Array],
    attend: Callable[[SparseMlaCall], jax.Array],
    call: PrefillCall,
    *,
    split_q: bool = False,
):
    """The ``prefill_write_and_attend_ragged`` composition, for any backend.

    Builds each new token's row ``[c_kv | k_rope | 0...]``, writes the rows with the
    backend's ``write_back`` (an impl taking a ``WriteBackCall``), then runs ragged sparse
    MLA over the new cache with its ``attend`` (an impl taking a ``SparseMlaCall``; the
    query is ``ql`` and ``qpe`` joined, or the pair with ``split_q``:
    ``PrefillCall.attend``). Returns ``(out [T, H, kv_lora_rank] float32, new_cache)``.
    """
    cache = call.cache
    if isinstance(cache, Fp8LatentCache):  # quantized as written (write_back_by_scatter)
        rows = latent_rows(call.kvc, call.kpe, width=LATENT + ROPE, dtype=jnp.float32)
    else:
        rows = latent_rows(call.kvc, call.kpe, width=cache.shape[-1], dtype=cache.dtype)
    new_cache = write_back(call.write(rows))
    out = attend(call.attend(new_cache, split_q=split_q))
    return out[0], new_cache
