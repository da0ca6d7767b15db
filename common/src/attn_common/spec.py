"""One spec per op: each public signature, its defaults, argument docs and validation.

Every op is declared once here as a *builder* that takes the public arguments, checks
all of them (naming the argument, the value seen and the rule) and returns a frozen,
validated call value:

* :func:`ranker_call` -> :class:`RankerCall` (``ranker_attention``);
* :func:`sparse_mla_call` -> :class:`SparseMlaCall` (``sparse_mla_attention`` and its
  ``_qblock`` twin; ragged paged metadata as one :class:`~attn_common.metadata.RaggedBatch`);
* :func:`write_back_call` -> :class:`WriteBackCall` (``paged_write_back``);
* :func:`prefill_call` -> :class:`PrefillCall` (``prefill_write_and_attend_ragged`` and
  its ``_qblock`` twin).

A backend implements an op as ``impl(call, **backend_extras)`` and publishes it with
:func:`public_op`, which gives the public function the builder's signature and argument
docs plus the backend's own keyword-only extras (for example Hopper's ``config``). The
front door (``attn_common.dispatch``) builds the call value once and hands it to the
selected backend's ``impl``. Adding a keyword to an op changes its builder plus each
backend's use of it; no backend restates the signature or the validation, so no two
backends can refuse the same input differently.

What a backend's kernels cannot take (a dtype, a head dim) is not a property of the op:
the backend states it with :meth:`RankerCall.require` / :func:`require_kernel`, which
raise ``TypeError`` (a dtype) or ``NotImplementedError`` in one wording, never
promising a fallback.

Builders are trace-safe: array *values* are checked only when they are host values
(numpy or a concrete ``jax.Array``), and under ``jit`` with ``debug_checks=True``
through ``checkify``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from attn_common.bounds import SegmentBounds, check_bounds
from attn_common.cap import CapParams
from attn_common.config import KernelConfig
from attn_common.fp8_cache import cache_compute_dtype
from attn_common.metadata import RaggedBatch, is_concrete, ragged_batch
from attn_common.packed import _packed_array, check_packed_bounds, validate_packed_bounds
from attn_common.paged import check_prefill_inputs, check_write_back_inputs
from attn_common.ranker import RankerProblem, check_ranker_inputs
from attn_common.sparse_mla import (
    SparseMlaProblem,
    check_page_size,
    check_qblock_knobs,
    validate_sparse_mla,
)


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}: got {value!r}, expected True or False")
    return bool(value)


def require_kernel(
    name: str,
    value,
    allowed: Collection,
    *,
    what: str,
    kernels: str,
) -> None:
    """A backend's kernel limit: ``TypeError`` for a dtype (``what="dtype"``), else
    ``NotImplementedError``, naming the argument, the value and what these kernels take
    (no fallback is promised: the caller picks another backend)."""
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        error = TypeError if what == "dtype" else NotImplementedError
        raise error(
            f"{name}: got {what} {value}, the {kernels} kernels take {shown}; "
            "attn_reference takes any"
        )


# ---------------------------------------------------------------------------- ranker


@dataclasses.dataclass(frozen=True)
class RankerCall:
    """A validated ``ranker_attention`` call (:func:`ranker_call`)."""

    problem: RankerProblem
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bounds: Any  # SegmentBounds or int [4] / [B, 4] / [B, U, 4], form-checked
    packed_users: int  # U of packed [B, U, 4] bounds; 0: not packed ([4], [B, 4], SegmentBounds)
    config: KernelConfig | None
    return_lse: bool
    debug_checks: bool
    interpret: Any

    def require(self, *, dtypes: Collection, head_dims: Collection[int], kernels: str):
        """Raise unless these kernels take q's dtype (``TypeError``) and head dim
        (``NotImplementedError``)."""
        names = [jnp.dtype(d).name for d in dtypes]
        require_kernel("q", jnp.dtype(self.q.dtype).name, names, what="dtype", kernels=kernels)
        require_kernel(
            "q", self.problem.head_dim, tuple(head_dims), what="head dim", kernels=kernels
        )


def ranker_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bounds,
    *,
    sm_scale: float | None = None,
    cap: CapParams | None = None,
    config: KernelConfig | None = None,
    return_lse: bool = False,
    debug_checks: bool = False,
    interpret: Any = False,
) -> RankerCall:
    """Ranker attention: history + isolated candidates, soft cap, GQA.

    Args:
      q: ``[B, S, Hq, D]`` float. k, v: ``[B, S, Hkv, D]``, q's dtype (mixed dtypes are
        refused), ``Hq % Hkv == 0``.
      bounds: ``SegmentBounds`` or int array ``[B, 4]`` / ``[4]`` = (history_lo,
        history_hi, candidate_lo, candidate_hi); or packed ``[B, U, 4]`` (``U >= 1``
        users per row, each with its own segments; unused slots all-zero). Data, so it
        may be traced. Values are clipped to ``[0, S]``; ``debug_checks`` refuses
        out-of-range values. Overlapping users are refused on host values.
      sm_scale: logit scale, default ``1/sqrt(D)``; applied before the cap.
      cap: ``CapParams`` soft cap (tanh or soft_sign), or ``None``.
      config: ``KernelConfig`` tiling; ``None`` picks the backend's default (the
        reference ignores it).
      return_lse: also return ``lse [B, Hq, S]`` float32 (natural log, ``-inf`` for
        rows with no allowed key; differentiable).
      debug_checks: also check at run time that the bounds are in range and packed
        users disjoint (``checkify`` checks: wrap the call in
        ``jax.experimental.checkify.checkify``).
      interpret: run a Pallas kernel in interpret mode (on a CPU): ``True`` or the
        backend's interpret parameters; the reference ignores it.

    Returns:
      ``out [B, S, Hq, D]`` in q's dtype, or ``(out, lse)``. Differentiable in q, k, v,
      including through ``lse``.
    """
    problem = check_ranker_inputs(q, k, v, sm_scale=sm_scale, cap=cap)
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config: got {type(config).__name__}, expected KernelConfig or None")
    return_lse = _check_flag(return_lse, "return_lse")
    debug_checks = _check_flag(debug_checks, "debug_checks")
    if isinstance(bounds, SegmentBounds):
        packed_users = 0
    else:
        shape = np.shape(bounds) if not hasattr(bounds, "shape") else tuple(bounds.shape)
        arr = _packed_array(bounds)  # dtype and form: [4], [B, 4] or [B, U >= 1, 4]
        if arr.shape[0] not in (1, problem.batch):
            raise ValueError(
                f"bounds: got {arr.shape[0]} rows, expected {problem.batch} (the batch size) or 1"
            )
        packed_users = int(shape[1]) if len(shape) == 3 else 0
        validate_packed_bounds(bounds, batch=problem.batch, seq_len=problem.seq_len)
    if debug_checks:
        check = check_packed_bounds if packed_users else check_bounds
        check(bounds, seq_len=problem.seq_len)
    return RankerCall(
        problem, q, k, v, bounds, packed_users, config, return_lse, debug_checks, interpret
    )  # fmt: skip


# ------------------------------------------------------------------------ sparse MLA


@dataclasses.dataclass(frozen=True)
class SparseMlaCall:
    """A validated sparse-MLA call (:func:`sparse_mla_call`).

    ``q`` is ``[B, S, H, Dk]``; a backend that reads the latent and rope parts of the
    query apart may receive the pair ``(q_latent, q_rope)`` from the write-then-attend
    wrappers (:meth:`PrefillCall.attend`). ``ragged`` is ``None`` in flat mode.
    """

    problem: SparseMlaProblem
    q: Any
    kv: jax.Array
    indices: jax.Array
    positions: jax.Array
    ragged: RaggedBatch | None
    return_lse: bool
    query_block: int | None
    u_max: int | None
    head_block: int | None
    debug_checks: bool
    interpret: Any
    return_attn_mass: bool = False

    def result(self, out, lse, attn_mass=None):
        """The op's return value: ``out``, then ``lse`` if ``return_lse``, then the
        attention mass if ``return_attn_mass`` (a tuple when either is asked for)."""
        extra = (lse,) if self.return_lse else ()
        extra += (attn_mass,) if self.return_attn_mass else ()
        return (out, *extra) if extra else out

    def ragged_kwargs(self) -> dict:
        """``page_size`` and the ragged tables as keywords (all ``None`` in flat mode)."""
        if self.ragged is None:
            names = ("page_size", "q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")
            return dict.fromkeys(names)
        return self.ragged.as_kwargs()

    def replace(self, **changes) -> SparseMlaCall:
        return dataclasses.replace(self, **changes)


def sparse_mla_call(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    kv_lora_rank: int = 512,
    read_block: int = 128,
    return_lse: bool = False,
    return_attn_mass: bool = False,
    page_size: int | None = None,
    q_seq_id: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
    cu_kv_lens: jax.Array | None = None,
    page_indices: jax.Array | None = None,
    query_block: int | None = None,
    u_max: int | None = None,
    head_block: int | None = None,
    debug_checks: bool = False,
    interpret: Any = False,
) -> SparseMlaCall:
    """Sparse MLA prefill (DeepSeek sparse attention): each query attends to its selected
    units of the latent cache.

    Args:
      q: flat mode ``[B, S, H, Dk]`` (Dk = kv_lora_rank + rope, e.g. 512 + 64); ragged
        paged mode ``[1, T, H, Dk]`` (all requests packed into one row). Floating; cast
        to kv's dtype (the cache's dtype is the compute dtype on every backend; bfloat16
        for an ``Fp8LatentCache``).
      kv: flat mode the latent cache ``[B, T_kv, Dk]``; ragged paged mode the paged cache
        ``[num_pages, page_size // pk, pk, Dk_pad]`` (``pk = kv_packing(dtype)``,
        ``Dk_pad = padded_dk(Dk)``). Or, in either mode, an ``Fp8LatentCache``
        (``attn_common.fp8_cache``; Dk = 512 + 64, ``kv_lora_rank = 512``) on the token
        grid ``[B, T_kv]`` (flat) or ``[num_pages, page_size]`` (paged): the result is
        the op's on ``dequantize_latent_cache(kv)``.
      indices: int ``[B, S, K]`` selected units per query: flat mode unit ids (a unit is
        ``read_block`` tokens), ragged mode request-local page ids; ``-1`` or out of
        range = none; duplicates count once.
      positions: int ``[B, S]`` the query's position (keys at positions ``<=`` it only).
      sm_scale: logit scale (required; e.g. ``1/sqrt(192)`` for DeepSeek V3).
      kv_lora_rank: the value width: values are the first ``kv_lora_rank`` features.
      read_block: tokens per selected unit (flat mode; ragged mode: ``page_size``).
      return_lse: also return ``lse [B, S, H]`` float32 (natural log, ``-inf`` for a
        query with no valid key; differentiable).
      return_attn_mass: also return the indexer's target ``[B, S, K]`` float32: per
        query and selection slot, the attention probability of the slot's tokens summed
        over them and over heads, divided by ``H`` (``0`` for ``-1``, out-of-range and
        duplicate slots and for a query with no valid key). ``stop_gradient``: a loss on
        it sends no gradient into q or the cache (docs/semantics.md).
      page_size, q_seq_id, seq_lens, cu_kv_lens, page_indices: ragged paged mode
        (``q_seq_id`` given): tokens per page, request of each query ``[T]``, request
        lengths, cumulative page-table offsets in tokens and the page table; see
        docs/semantics.md, "Sparse MLA prefill". Checked before launch on host values.
      query_block: queries per program of the query-blocked TPU kernel (``None``:
        planned automatically). Never changes the answer; other kernels validate and
        ignore it, so the two variants are drop-ins for each other.
      u_max: union slots per chunk of the query-blocked kernel (``None``: its default);
        a VMEM/speed knob that never changes the answer.
      head_block: heads per program of the query-blocked kernel (``None``: planned).
      debug_checks: also check at run time (``checkify``) the ragged tables and that
        the indices are in range.
      interpret: run a Pallas kernel in interpret mode (on a CPU); the reference
        ignores it.

    Returns:
      ``out [B, S, H, kv_lora_rank]`` float32, or the tuple ``(out, lse)``, ``(out,
      attn_mass)`` or ``(out, lse, attn_mass)``. Differentiable in ``q`` and ``kv``
      (through ``out`` and ``lse``); the integer inputs are not differentiable.
    """
    debug_checks = _check_flag(debug_checks, "debug_checks")
    problem, ragged = validate_sparse_mla(
        q,
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
    check_qblock_knobs(query_block, u_max, head_block)
    return SparseMlaCall(
        problem,
        q.astype(cache_compute_dtype(kv)),  # the query takes the cache's dtype (FP8: bf16)
        kv,
        indices,
        positions,
        ragged,
        _check_flag(return_lse, "return_lse"),
        query_block,
        u_max,
        head_block,
        debug_checks,
        interpret,
        return_attn_mass=_check_flag(return_attn_mass, "return_attn_mass"),
    )


# ------------------------------------------------------------------------ write-back


def _check_loc_in_cache(loc, slots: int, *, debug_checks: bool) -> None:
    """``loc[t] < slots`` (negative = no write). Host values always; traced ones with
    ``debug_checks`` through ``checkify``. A slot past the cache would drop the row."""
    if is_concrete(loc):
        host = np.asarray(loc).astype(np.int64)
        bad = np.flatnonzero(host >= slots)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"loc: entry {i} is {int(host[i])}, expected a cache slot < num_pages * "
                f"page_size = {slots} (or negative: no write); the row would be lost"
            )
    elif debug_checks and loc.size:
        loc = jnp.asarray(loc)
        checkify.check(
            jnp.all(loc < slots),
            "loc: entry {i} is {v}, expected a cache slot < num_pages * page_size = {n} "
            "(or negative: no write)",
            i=jnp.argmax(loc >= slots).astype(jnp.int32),
            v=jnp.max(loc).astype(jnp.int32),
            n=jnp.asarray(slots, jnp.int32),
        )


@dataclasses.dataclass(frozen=True)
class WriteBackCall:
    """A validated ``paged_write_back`` call (:func:`write_back_call`)."""

    cache: jax.Array
    rows: jax.Array
    loc: jax.Array
    page_size: int
    r_cap: int | None
    debug_checks: bool
    interpret: Any

    @property
    def slots(self) -> int:
        """Cache rows: ``num_pages * page_size``."""
        return int(self.cache.shape[0]) * self.page_size


def write_back_call(
    cache: jax.Array,
    rows: jax.Array,
    loc: jax.Array,
    *,
    page_size: int,
    r_cap: int | None = None,
    debug_checks: bool = False,
    interpret: Any = False,
) -> WriteBackCall:
    """Write new latent rows into the paged cache: ``cache[loc[t]] = rows[t]`` for every
    ``loc[t] >= 0``; returns the new cache.

    Args:
      cache: paged cache ``[num_pages, page_size // pk, pk, D]``, floating; flat slot
        ``s`` is page ``s // page_size``, row ``s % page_size``. Or an
        ``Fp8LatentCache`` on the token grid ``[num_pages, page_size]``.
      rows: ``[T, D]`` new rows, floating, cast to the cache dtype (the cache's dtype is
        the storage format). For an ``Fp8LatentCache``: ``[T, 576]`` floating, quantized
        as they are written (``quantize_latent_cache``), or an ``Fp8LatentCache`` ``[T]``
        written as it is.
      loc: int ``[T]`` flat slot per row; a negative slot writes nothing. A slot at or
        past ``num_pages * page_size`` is refused (host values; traced ones under
        ``debug_checks``). A slot listed more than once keeps its last row, as a
        sequential write would.
      page_size: tokens per page.
      r_cap: size of the TPU kernel's run table (``None``: its default); more runs than
        this fall back to the XLA scatter. Other backends validate and ignore it.
      debug_checks: check ``loc`` at run time under ``jit`` (``checkify``).
      interpret: run a Pallas kernel in interpret mode (on a CPU).

    Returns:
      the new cache (same shape and dtype).
    """
    check_write_back_inputs(cache, rows, loc, page_size)
    if r_cap is not None and (isinstance(r_cap, bool) or not isinstance(r_cap, int) or r_cap < 1):
        raise ValueError(f"r_cap: got {r_cap!r}, expected a positive int or None")
    debug_checks = _check_flag(debug_checks, "debug_checks")
    call = WriteBackCall(cache, rows, loc, page_size, r_cap, debug_checks, interpret)
    _check_loc_in_cache(loc, call.slots, debug_checks=debug_checks)
    return call


# --------------------------------------------------------------- write, then attend


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """A validated write-then-attend call (:func:`prefill_call`)."""

    ql: jax.Array
    qpe: jax.Array
    kvc: jax.Array
    kpe: jax.Array
    cache: jax.Array
    topk_pages: jax.Array
    positions: jax.Array
    loc: jax.Array
    ragged: RaggedBatch
    attention: SparseMlaProblem  # the attend step's static facts (the cache shape is kept)
    query_block: int | None
    u_max: int | None
    debug_checks: bool
    interpret: Any

    def write(self, rows) -> WriteBackCall:
        """The write step: ``rows [T, Dk_pad]`` (validated here) into ``cache`` at ``loc``."""
        return WriteBackCall(
            self.cache, rows, self.loc, self.ragged.page_size, None, self.debug_checks,
            self.interpret,
        )  # fmt: skip

    def attend(self, new_cache, *, split_q: bool = False) -> SparseMlaCall:
        """The attend step over ``new_cache``: its query is ``[1, T, H, Dk]``, ``ql`` and
        ``qpe`` joined (a copy of all of Q), or with ``split_q`` the pair
        ``(ql[None], qpe[None])`` for a backend that reads the two where they are."""
        dtype = cache_compute_dtype(new_cache)
        ql, qpe = self.ql.astype(dtype), self.qpe.astype(dtype)
        q = (ql[None], qpe[None]) if split_q else jnp.concatenate([ql, qpe], axis=-1)[None]
        return SparseMlaCall(
            self.attention, q, new_cache, self.topk_pages[None], self.positions[None],
            self.ragged, False, self.query_block, self.u_max, None, self.debug_checks,
            self.interpret,
        )  # fmt: skip


def prefill_call(
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
    query_block: int | None = None,
    u_max: int | None = None,
    debug_checks: bool = False,
    interpret: Any = False,
) -> PrefillCall:
    """Write the new tokens' latents into the paged cache, then attend (ragged mode).

    Args:
      ql: ``[T, H, kv_lora_rank]`` absorbed latent query; qpe: ``[T, H, rope]``.
      kvc: ``[T, kv_lora_rank]`` new latents; kpe: ``[T, rope]`` (or ``[T, 1, rope]``).
        All four floating, cast to the cache's dtype (as in ``sparse_mla_attention``
        and ``paged_write_back``; an ``Fp8LatentCache`` quantizes the new rows).
      cache: the paged cache ``[num_pages, page_size // pk, pk, Dk_pad]``, or an
        ``Fp8LatentCache`` on the token grid ``[num_pages, page_size]``.
      topk_pages: ``[T, K]`` request-local page ids (``-1`` = none).
      positions: ``[T]`` request-local query positions.
      loc: ``[T]`` flat cache slots (negative: no write; past the cache: refused).
      seq_lens, cu_q_lens, cu_kv_lens, page_indices: the packed ragged tables.
      kv_lora_rank, page_size, sm_scale: as in ``sparse_mla_attention``.
      query_block: queries per program of the query-blocked kernel (``None``: the
        backend's default; the per-query variant accepts it for a drop-in swap).
      u_max: union slots per chunk of the query-blocked kernel (never changes the
        answer; ``None``: its default).
      debug_checks: also check at run time the ragged tables, ``loc`` and the indices.
      interpret: run a Pallas kernel in interpret mode (on a CPU).

    Returns:
      ``(out [T, H, kv_lora_rank] float32, new_cache)``.
    """
    check_prefill_inputs(
        ql, qpe, kvc, kpe, cache, topk_pages, positions, loc, seq_lens, cu_q_lens,
        cu_kv_lens, page_indices, kv_lora_rank=kv_lora_rank, page_size=page_size,
    )  # fmt: skip
    page_size = check_page_size(page_size)
    debug_checks = _check_flag(debug_checks, "debug_checks")
    check_qblock_knobs(query_block, u_max, None)
    num_tokens, heads = ql.shape[:2]
    ragged = ragged_batch(
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
        page_size=page_size,
        num_pages=cache.shape[0],
        num_tokens=num_tokens,
        cu_q_lens=cu_q_lens,
        debug_checks=debug_checks,
    )
    _check_loc_in_cache(loc, cache.shape[0] * page_size, debug_checks=debug_checks)
    joined = jax.ShapeDtypeStruct((1, num_tokens, heads, ql.shape[2] + qpe.shape[2]), ql.dtype)
    attention, _ = validate_sparse_mla(
        joined,
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), cache),
        jax.ShapeDtypeStruct((1, *topk_pages.shape), topk_pages.dtype),
        jax.ShapeDtypeStruct((1, num_tokens), positions.dtype),
        sm_scale=sm_scale,
        kv_lora_rank=kv_lora_rank,
        read_block=page_size,
        page_size=page_size,
        q_seq_id=jax.ShapeDtypeStruct((num_tokens,), jnp.int32),  # values checked above
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
    )
    from attn_common.metadata import check_unit_indices

    check_unit_indices(topk_pages, attention.num_units, debug_checks=debug_checks)
    return PrefillCall(
        ql, qpe, kvc, kpe, cache, topk_pages, positions, loc, ragged, attention, query_block,
        u_max, debug_checks, interpret,
    )  # fmt: skip


# ------------------------------------------------------------- backends' public ops


def public_op(builder: Callable) -> Callable:
    """Decorator: publish a backend's ``impl(call, *, extras...)`` as the public op.

    The public function has the builder's signature (positional arrays, keywords and
    defaults) followed by the impl's keyword-only extras; it validates with the builder
    and calls the impl. Its docstring is the impl's, then the builder's argument docs.
    ``op.impl`` is the impl (the front door calls it with the call value it built) and
    ``op.spec`` the builder.
    """

    def decorate(impl: Callable) -> Callable:
        extras = [
            p for p in inspect.signature(impl).parameters.values() if p.kind is p.KEYWORD_ONLY
        ]
        extra_names = frozenset(p.name for p in extras)

        @functools.wraps(impl)
        def op(*args, **kwargs):
            own = {name: kwargs.pop(name) for name in extra_names & kwargs.keys()}
            return impl(builder(*args, **kwargs), **own)

        spec = inspect.signature(builder)
        op.__signature__ = spec.replace(
            parameters=[*spec.parameters.values(), *extras],
            return_annotation=inspect.Signature.empty,
        )
        builder_doc = inspect.getdoc(builder) or ""
        args_doc = builder_doc[builder_doc.find("Args:") :] if "Args:" in builder_doc else ""
        op.__doc__ = (inspect.getdoc(impl) or "") + "\n\n" + args_doc
        op.impl = impl
        op.spec = builder
        del op.__wrapped__  # the signature is the public one, not impl(call, ...)
        return op

    return decorate
