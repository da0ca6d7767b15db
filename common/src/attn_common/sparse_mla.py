"""Sparse MLA prefill (DeepSeek sparse attention): the input contract and ragged helpers.

Flat mode: ``q [B, S, H, Dk]``, ``kv [B, T, Dk]``, ``indices [B, S, K]`` unit ids (a
unit is ``read_block`` consecutive tokens, ``-1`` = none), ``positions [B, S]``. Key
token ``t`` is valid for a query iff its unit is selected, ``t <= position`` and
``t < kv_len`` (``T`` in flat mode). Selections are sets. Values are the first
``Dv = kv_lora_rank`` features of kv. Output ``[B, S, H, Dv]`` float32; optional LSE
``[B, S, H]`` float32 (natural log, ``-inf`` for a query with no valid key).

Ragged paged mode (``q_seq_id`` given, ``B == 1``): ``kv`` is the paged latent cache
``[num_pages, page_size // pk, pk, Dk_pad]`` (``pk = kv_packing(dtype)``, ``Dk_pad`` =
``Dk`` rounded up to 128). Request ``r`` owns page-table slots
``[cu_kv_lens[r] / page_size, cu_kv_lens[r+1] / page_size)`` of ``page_indices``; its
token ``j`` lives on physical page ``page_indices[cu_kv_lens[r] / page_size + j //
page_size]`` at row ``j % page_size``. ``indices`` are request-local page ids
(``read_block == page_size``), ``positions`` request-local, ``kv_len = seq_lens[r]``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attn_common.fp8_cache import Fp8LatentCache, check_fp8_cache, check_fp8_widths
from attn_common.metadata import (
    RaggedBatch,
    check_unit_indices,
    ragged_batch,
)
from attn_common.metadata import (
    seq_id_from_cu_q_lens as seq_id_from_cu_q_lens,  # re-exported: its old home
)
from attn_common.ranker import array_shape, resolve_sm_scale
from attn_common.tables import kv_packing

LANE = 128  # feature padding of the paged cache (TPU lane width)


def padded_dk(dk: int) -> int:
    """The paged cache's feature width: ``Dk`` rounded up to a multiple of 128."""
    return -(-dk // LANE) * LANE


@dataclasses.dataclass(frozen=True)
class SparseMlaProblem:
    """Static facts about one sparse-MLA call, after validation."""

    batch: int
    num_queries: int
    heads: int
    dk: int
    dv: int
    top_k: int
    read_block: int
    sm_scale: float
    ragged: bool
    num_units: int  # flat: units over T; ragged: page-table width
    kv_len: int  # flat: T; ragged: cache rows (num_pages * page_size)

    @property
    def dk_pad(self) -> int:
        return padded_dk(self.dk)

    @property
    def is_empty(self) -> bool:
        """No query can attend any key: zero batch, queries, heads, selections or keys."""
        return 0 in (self.batch, self.num_queries, self.heads, self.top_k, self.kv_len)


def empty_result(problem: SparseMlaProblem, return_lse: bool, return_attn_mass: bool = False):
    """The answer to empty work: ``out`` zeros ``[B, S, H, Dv]``, ``lse`` ``-inf`` ``[B, S, H]``,
    attention mass zeros ``[B, S, K]`` (as ``SparseMlaCall.result`` orders them)."""
    b, s, h = problem.batch, problem.num_queries, problem.heads
    out = jnp.zeros((b, s, h, problem.dv), jnp.float32)
    extra = (jnp.full((b, s, h), -jnp.inf, jnp.float32),) if return_lse else ()
    extra += (jnp.zeros((b, s, problem.top_k), jnp.float32),) if return_attn_mass else ()
    return (out, *extra) if extra else out


def _check_int_array(x, name: str, ndim: int, shape_hint: str) -> tuple[int, ...]:
    shape = array_shape(x, name)
    if len(shape) != ndim:
        raise ValueError(f"{name}: got shape {shape}, expected rank {ndim} {shape_hint}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: got dtype {x.dtype}, expected an integer dtype")
    return shape


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: got {value!r}, expected a positive int")
    if value <= 0:
        raise ValueError(f"{name}: got {value!r}, expected a positive int")
    return value


def check_qblock_knobs(query_block: int | None, u_max: int | None, head_block: int | None) -> None:
    """The query-blocked ops' tuning knobs: each a positive int or ``None`` (automatic).

    They change the schedule, never the answer; backends without that schedule check
    them with this and ignore them, the TPU kernel adds its own tiling rules.
    """
    for name, value in (("query_block", query_block), ("u_max", u_max), ("head_block", head_block)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name}: got {value!r}, expected a positive int or None")


def check_sparse_mla_inputs(q, kv, indices, positions, **kwargs) -> SparseMlaProblem:
    """Validate sparse-MLA inputs; return the static facts (``validate_sparse_mla``)."""
    return validate_sparse_mla(q, kv, indices, positions, **kwargs)[0]


def validate_sparse_mla(
    q,
    kv,
    indices,
    positions,
    *,
    sm_scale,
    kv_lora_rank: int = 512,
    read_block: int = 128,
    page_size: int | None = None,
    q_seq_id=None,
    seq_lens=None,
    cu_kv_lens=None,
    page_indices=None,
    debug_checks: bool = False,
) -> tuple[SparseMlaProblem, RaggedBatch | None]:
    """Validate sparse-MLA inputs before launch; raise naming the argument and the rule.

    Shapes, dtypes (``q`` and ``kv`` floating) and static arguments always. The ragged tables too when they are host values
    (``attn_common.metadata``); under jit, with ``debug_checks=True``, the same rules
    and the index range become ``checkify`` checks. Returns the static facts and, in
    ragged mode, the validated :class:`~attn_common.metadata.RaggedBatch`.
    """
    q_shape = array_shape(q, "q")
    if len(q_shape) != 4:
        raise ValueError(f"q: got shape {q_shape}, expected rank 4 [B, S, H, Dk]")
    batch, num_queries, heads, dk = q_shape
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"q: got dtype {q.dtype}, expected a floating dtype")
    fp8 = isinstance(kv, Fp8LatentCache)
    if fp8:  # the token grid is checked below, per mode
        kv_shape = check_fp8_cache(kv, "kv")
    else:
        kv_shape = array_shape(kv, "kv")
        if not jnp.issubdtype(kv.dtype, jnp.floating):
            raise TypeError(f"kv: got dtype {kv.dtype}, expected a floating dtype")
    idx_shape = _check_int_array(indices, "indices", 3, "[B, S, K]")
    if idx_shape[:2] != (batch, num_queries):
        raise ValueError(
            f"indices: got shape {idx_shape}, expected [B={batch}, S={num_queries}, K]"
        )
    pos_shape = _check_int_array(positions, "positions", 2, "[B, S]")
    if pos_shape != (batch, num_queries):
        raise ValueError(f"positions: got shape {pos_shape}, expected [{batch}, {num_queries}]")
    read_block = _check_positive_int(read_block, "read_block")
    kv_lora_rank = _check_positive_int(kv_lora_rank, "kv_lora_rank")
    if kv_lora_rank > dk:
        raise ValueError(f"kv_lora_rank: got {kv_lora_rank}, expected <= Dk = {dk} (q's last dim)")
    if fp8:
        check_fp8_widths(dk, kv_lora_rank, q_name="q")
    scale = resolve_sm_scale(sm_scale, dk, required=True)
    top_k = idx_shape[2]

    ragged_args = {
        "q_seq_id": q_seq_id,
        "seq_lens": seq_lens,
        "cu_kv_lens": cu_kv_lens,
        "page_indices": page_indices,
    }
    ragged = None
    if q_seq_id is None:
        given = [n for n, a in ragged_args.items() if a is not None]
        if page_size is not None:
            given.append("page_size")
        if given:
            raise ValueError(f"{given[0]}: given without q_seq_id; ragged mode needs q_seq_id")
        if fp8:
            check_fp8_cache(kv, "kv", (batch, None), f"[B={batch}, T]")
        elif len(kv_shape) != 3 or kv_shape[0] != batch or kv_shape[2] != dk:
            raise ValueError(f"kv: got shape {kv_shape}, expected [B={batch}, T, Dk={dk}]")
        kv_len = kv_shape[1]  # T = 0 is empty work: every query gets out 0, LSE -inf
        num_units = -(-kv_len // read_block)
    else:
        if batch != 1:
            raise ValueError(f"q: got B = {batch}, ragged mode packs every request into B == 1")
        missing = [n for n, a in ragged_args.items() if a is None]
        if missing:
            raise ValueError(f"{missing[0]}: missing; ragged mode needs {list(ragged_args)}")
        page_size = check_page_size(page_size)
        if read_block != page_size:
            raise ValueError(
                f"read_block: got {read_block}, ragged mode needs read_block == page_size "
                f"({page_size}): a unit is one page"
            )
        if fp8:
            check_fp8_cache(kv, "kv", (None, page_size), f"[num_pages, page_size={page_size}]")
        else:
            pk = kv_packing(kv.dtype)
            want = (page_size // pk, pk, padded_dk(dk))
            if len(kv_shape) != 4 or kv_shape[1:] != want:
                raise ValueError(
                    f"kv: got shape {kv_shape}, ragged mode expects the paged cache "
                    f"[num_pages, page_size // {pk}, {pk}, Dk_pad = {padded_dk(dk)}] = "
                    f"[num_pages, {', '.join(map(str, want))}] for dtype {kv.dtype}"
                )
        kv_len = kv_shape[0] * page_size
        ragged = ragged_batch(
            **ragged_args,
            page_size=page_size,
            num_pages=kv_shape[0],
            num_tokens=num_queries,
            debug_checks=debug_checks,
        )
        num_units = ragged.total_pages
    check_unit_indices(indices, num_units, debug_checks=debug_checks)
    problem = SparseMlaProblem(
        batch=batch,
        num_queries=num_queries,
        heads=heads,
        dk=dk,
        dv=kv_lora_rank,
        top_k=top_k,
        read_block=read_block,
        sm_scale=scale,
        ragged=ragged is not None,
        num_units=num_units,
        kv_len=kv_len,
    )
    return problem, ragged


def check_page_size(page_size) -> int:
    """A paged cache's ``page_size``: a positive multiple of 16 (whole bf16 tiles)."""
    if page_size is None:
        raise ValueError("page_size: missing; ragged mode needs the cache page size")
    page_size = _check_positive_int(page_size, "page_size")
    if page_size % 16:
        raise ValueError(f"page_size: got {page_size}, expected a multiple of 16")
    return page_size


class RaggedQueryInfo(NamedTuple):
    """Per packed query token, from the ragged tables (all ``[S]`` int32).

    base_page: the request's first page-table slot. pages: the request's page-table
    extent. kv_len: the request's kv length.
    """

    base_page: jax.Array
    pages: jax.Array
    kv_len: jax.Array


def ragged_query_info(q_seq_id, seq_lens, cu_kv_lens, *, page_size: int) -> RaggedQueryInfo:
    """Resolve each query token's request: page-table base, extent and kv length."""
    num_seqs = seq_lens.shape[0]
    sid = jnp.clip(jnp.asarray(q_seq_id, jnp.int32), 0, num_seqs - 1)
    # jnp.asarray: a numpy table indexed by a traced ``sid`` would raise under jit/checkify.
    cu = jnp.asarray(cu_kv_lens, jnp.int32)
    base = cu[sid] // page_size
    pages = jnp.maximum(cu[sid + 1] // page_size - base, 0)
    kv_len = jnp.asarray(seq_lens, jnp.int32)[sid]
    return RaggedQueryInfo(base_page=base, pages=pages, kv_len=kv_len)


def lift_ragged_indices(indices, info: RaggedQueryInfo, total_pages: int) -> jax.Array:
    """Request-local page ids ``[S, K]`` -> global page-table keys; invalid ids -> ``-1``.

    An id is invalid when negative, at or beyond the request's page-table extent, or
    beyond the page table: such a selection is dropped, never read.
    """
    idx = indices.astype(jnp.int32)
    key = idx + info.base_page[:, None]
    ok = (idx >= 0) & (idx < info.pages[:, None]) & (key < total_pages)
    return jnp.where(ok, key, -1)
