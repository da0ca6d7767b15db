"""The sparse MLA prefill benchmark (``attn bench sparse-mla``; ``benchmarks/sparse_mla_gpu.py``).

DeepSeek sparse attention prefill on a Hopper GPU: our kernel vs XLA. Results and what
they mean: docs/sparse_mla_gpu.md.

Cases (bf16, ``Dk = 576``, ``Dv = kv_lora_rank = 512``, ``sm_scale = 1 / sqrt(192)``,
4096 prefill query tokens, each selecting 2048 key tokens), for ``H`` in {128, 64} heads
and cache length ``T`` in {8192, 32768, 131072}:

* ``flat``: ``kv [1, T, 576]``, token-level selection (``read_block = 1``): ``indices
  [1, 4096, 2048]`` distinct random token ids ``<= position`` (``-1`` padded when fewer
  exist); positions are the cache's last 4096 tokens (causal prefill).
* ``paged``: the ragged paged layout of ``attn_common.sparse_mla`` with 4 requests of
  about ``T`` tokens (1024 new tokens each, the request's last ones), page size 64,
  shuffled physical pages; each query selects 32 distinct random request-local pages
  holding tokens ``<= position`` (``-1`` padded), 2048 tokens.

Implementations, on the same inputs in one process:

* ``xla``: what a JAX user would write: gather the selected key rows (``store[rows]``),
  ``einsum`` QK^T over 576 features (bf16 in, f32 out), mask (``-1``, causal, kv
  length), softmax in f32, ``einsum`` with the first 512 features (P in bf16), in query
  chunks under ``jax.jit``; the fastest of ``--xla-chunks`` is reported.
* ours (``--implementation``): ``attn_mosaic_gpu.sparse_mla_attention``, or
  ``attn_reference.sparse_mla_attention`` (CPU smoke runs), or ``none``. The backends
  are imported lazily (attn-common does not depend on them); an import or call that
  fails is recorded in the results, not raised.

Per case: median device time (CUPTI, ``attn_mosaic_gpu.bench.device_ms``), TFLOP/s counting
``2 * H * (576 + 512)`` per valid (query, key token) pair (counted from the indices),
speed-up of ours over xla, the bytes a row-gather kernel must move (each query reads its
valid rows of 576 bf16 once per 64-head group, plus q in and the f32 out) against the
copy ceiling (``attn_mosaic_gpu.bench.ceilings``), the target (H=128: >= 500 TFLOP/s and
>= 3.3x xla; H=64: >= 350 TFLOP/s and >= 3.8x), and the rel L2 error of ours vs xla
(and of xla vs the reference on a sample of queries). Paged cases also time ours'
``paged_write_back`` of the queries' new rows (they are their requests' newest
tokens) and its ``prefill_write_and_attend_ragged`` (write, then attend), each jitted
as one call without donating the cache, and the write-back also as ``WRITE_LOOP_CALLS``
calls in a loop that carries the cache, updated in place as a serving loop with a
donated cache does (``time_write``). A row fails when ours raised or every XLA
chunk size failed; ``run`` counts them in ``result["failed"]``.

Two entry points share this code:

* ``attn bench sparse-mla [flags]`` follows ``attn bench``'s conventions: ``--out``
  defaults to a new folder ``attn-results/<timestamp>`` and one that already holds
  results is refused unless ``--overwrite``; ours defaults to ``mosaic-gpu`` on a Hopper
  GPU and the reference elsewhere; off a GPU it runs a smoke run (tiny shapes, 2
  iterations, wall clock: not a measurement) unless ``--full``; exit status 1 when a
  row failed.
* ``python benchmarks/sparse_mla_gpu.py [flags]`` keeps the script's defaults:
  ``--out docs/results`` (overwritten), ``--implementation mosaic-gpu``, the full cases unless
  ``--smoke``.

::

    attn bench sparse-mla                                     # all cases (a GPU)
    attn bench sparse-mla --cases 'flat-h128-*' --out /tmp/r
    attn bench sparse-mla                                     # off a GPU: smoke run
    python benchmarks/sparse_mla_gpu.py --smoke --implementation reference --out /tmp/s   # CPU

Writes ``sparse_mla_gpu.json`` and ``sparse_mla_gpu.md`` into ``--out``, with the commit
and command (``attn_mosaic_gpu.bench.provenance``).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import html
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpy.typing import ArrayLike

from attn_common.cli_args import (
    MAX_SEED,
    OneLineParser,
    check_out_dir,
    default_out_dir,
    iterations_int,
    out_path,
    positive_int,
    provenance,
    seed_int,
)
from attn_common.dispatch import device_class, load_backend
from attn_common.fp8_cache import LATENT, PACKED_BYTES, ROPE
from attn_common.picks import distinct_choices
from attn_common.sparse_mla import padded_dk
from attn_common.tables import kv_packing
from attn_mosaic_gpu.bench import ceilings, device_ms
from attn_mosaic_gpu.sparse_mla_config import HEADS_PER_PROGRAM

RESULT_JSON, RESULT_MD, RESULT_SVG = (
    "sparse_mla_gpu.json",
    "sparse_mla_gpu.md",
    "sparse_mla_gpu.svg",
)
RESULT_FILES = (RESULT_JSON, RESULT_MD, RESULT_SVG)
SM_SCALE = 1.0 / math.sqrt(192.0)
DK, DV = LATENT + ROPE, LATENT  # DeepSeek's latent row: Dk 576, Dv = kv_lora_rank 512
ROW_BYTES = {"bf16": 2 * DK, "fp8": PACKED_BYTES}  # one gathered row: 1152, 656 bytes
IMPLS = ("mosaic-gpu", "reference", "none")
HEAD_GROUP = HEADS_PER_PROGRAM  # heads sharing one read of a key row (bytes estimate)
WRITE_LOOP_CALLS = 8  # write-back timings: calls per loop that carries the cache
TARGETS = {128: {"tflops": 500.0, "speedup": 3.3}, 64: {"tflops": 350.0, "speedup": 3.8}}


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark shape. ``kv_len``: flat ``T``; paged: the longest request's length."""

    name: str
    mode: str  # "flat" | "paged"
    heads: int
    kv_len: int
    num_queries: int = 4096
    top_k_tokens: int = 2048
    dk: int = 576
    dv: int = 512
    page_size: int = 64
    num_requests: int = 4

    @property
    def read_block(self) -> int:
        return 1 if self.mode == "flat" else self.page_size

    @property
    def top_k(self) -> int:
        """Width of ``indices``: tokens (flat) or pages (paged)."""
        return self.top_k_tokens // self.read_block


def _cases() -> tuple[Case, ...]:
    out = []
    for mode in ("flat", "paged"):
        for heads in (128, 64):
            for t in (8192, 32768, 131072):
                out.append(Case(f"{mode}-h{heads}-t{t // 1024}k", mode, heads, t))
    return tuple(out)


CASES = _cases()
# Tiny shapes for a CPU run end to end; positions 8..39 < K = 32 exercise -1 padding.
SMOKE_CASES = (
    Case("flat-smoke", "flat", 4, 40, num_queries=32, top_k_tokens=32),
    Case("paged-smoke", "paged", 2, 40, num_queries=32, top_k_tokens=32, page_size=16),
)


# --------------------------------------------------------------------------- inputs


def paged_layout(
    rng: np.random.Generator,
    seq_lens: ArrayLike,
    new_lens: ArrayLike,
    *,
    page_size: int,
    spare_pages: int = 2,
) -> dict:
    """The ragged paged tables of ``attn_common.sparse_mla`` (numpy int32).

    Request ``r`` owns ``ceil(seq_lens[r] / page_size)`` page-table slots from
    ``cu_kv_lens[r] / page_size``; ``page_indices`` maps them to a random permutation of
    the physical pages (``spare_pages`` pages stay unreferenced). Its queries are its last
    ``new_lens[r]`` tokens: ``q_seq_id``, request-local ``positions``.
    """
    seq_lens = np.asarray(seq_lens, np.int64)
    new_lens = np.asarray(new_lens, np.int64)
    if np.any(new_lens > seq_lens):
        raise ValueError(f"new_lens {new_lens.tolist()} exceed seq_lens {seq_lens.tolist()}")
    pages = -(-seq_lens // page_size)
    cu_kv = np.concatenate([[0], np.cumsum(pages)]) * page_size
    total_pages = int(pages.sum())
    num_pages = total_pages + spare_pages
    return {
        "seq_lens": seq_lens.astype(np.int32),
        "cu_kv_lens": cu_kv.astype(np.int32),
        "page_indices": rng.permutation(num_pages)[:total_pages].astype(np.int32),
        "q_seq_id": np.repeat(np.arange(len(seq_lens)), new_lens).astype(np.int32),
        "positions": np.concatenate(
            [np.arange(s - n, s) for s, n in zip(seq_lens, new_lens, strict=True)]
        ).astype(np.int32),
        "num_pages": num_pages,
    }


def request_lens(case: Case) -> list[int]:
    """Paged mode: ``kv_len`` and shorter, not page multiples (8192: 8192, 7165, ...)."""
    return [case.kv_len - r * (case.kv_len // 8) - 3 * r for r in range(case.num_requests)]


def make_inputs(case: Case, seed: int = 0) -> dict:
    """Random inputs of a case: ``args`` and ``kwargs`` of ``sparse_mla_attention``, and
    ``rows_per_query [S]`` (valid key tokens of each query, from the indices)."""
    rng = np.random.default_rng(seed)
    k_q, k_kv = jax.random.split(jax.random.PRNGKey(seed))
    s, h, dk = case.num_queries, case.heads, case.dk
    q = jax.random.normal(k_q, (1, s, h, dk), jnp.bfloat16)
    kw = {"sm_scale": SM_SCALE, "kv_lora_rank": case.dv, "read_block": case.read_block}
    if case.mode == "flat":
        t = case.kv_len
        if s > t:
            raise ValueError(f"{case.name}: {s} queries > T = {t}")
        positions = np.arange(t - s, t, dtype=np.int32)
        idx = distinct_choices(rng, positions + 1, case.top_k)
        kv = jax.random.normal(k_kv, (1, t, dk), jnp.bfloat16)
        rows_per_query = (idx >= 0).sum(axis=1)
        args = (q, kv, jnp.asarray(idx)[None], jnp.asarray(positions)[None])
        return {"args": args, "kwargs": kw, "rows_per_query": rows_per_query}
    ps, n_req = case.page_size, case.num_requests
    if s % n_req:
        raise ValueError(f"{case.name}: {s} queries do not split over {n_req} requests")
    layout = paged_layout(rng, request_lens(case), [s // n_req] * n_req, page_size=ps)
    pos = layout["positions"]
    idx = distinct_choices(rng, pos // ps + 1, case.top_k)  # pages with a token <= pos
    pk = kv_packing(jnp.bfloat16)
    cache = jax.random.normal(
        k_kv, (layout["num_pages"], ps // pk, pk, padded_dk(dk)), jnp.bfloat16
    )
    # Page p holds local tokens p*ps .. p*ps+ps-1; those <= pos count (pos < seq_len).
    rows_per_query = np.where(idx >= 0, np.minimum(ps, pos[:, None] - idx * ps + 1), 0).sum(1)
    tables = {
        k: jnp.asarray(layout[k]) for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")
    }
    args = (q, cache, jnp.asarray(idx)[None], jnp.asarray(pos)[None])
    kw = {**kw, "page_size": ps, **tables}
    return {"args": args, "kwargs": kw, "rows_per_query": rows_per_query}


# --------------------------------------------------------------------------- xla baseline


def _attend_chunked(q, store, rows, valid, *, sm_scale: float, dv: int, chunk: int):
    """q ``[N, H, Dk]``, store ``[R, >=Dk]``, rows/valid ``[N, K]`` -> out ``[N, H, dv]`` f32.

    Per chunk of queries: gather keys, bf16 QK^T with f32 accumulation, masked softmax in
    f32, P (in the key dtype) times the first ``dv`` key features. No valid key: zeros.
    """
    n, heads, dk = q.shape
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def chunked(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    def attend(xs):
        q_c, rows_c, valid_c = xs
        keys = store[rows_c, :dk]  # [c, K, Dk]
        s = jnp.einsum("chd,ckd->chk", q_c, keys, preferred_element_type=jnp.float32)
        s = jnp.where(valid_c[:, None, :], s * sm_scale, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum(
            "chk,ckd->chd", p.astype(keys.dtype), keys[..., :dv], preferred_element_type=jnp.float32
        )
        return o / jnp.where(denom > 0, denom, 1.0)

    out = jax.lax.map(attend, (chunked(q), chunked(rows), chunked(valid)))
    return out.reshape(n_chunks * chunk, heads, dv)[:n]


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "read_block", "chunk"))
def xla_flat(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    kv_lora_rank: int,
    read_block: int,
    chunk: int,
) -> jax.Array:
    """Flat mode in plain JAX: ``q [B, S, H, Dk]``, ``kv [B, T, Dk]``, ``indices [B, S,
    K]`` unit ids (distinct; ``-1`` = none), ``positions [B, S]`` -> ``[B, S, H, Dv]``."""
    b, s, h, dk = q.shape
    t = kv.shape[1]
    tok = (indices[..., None] * read_block + jnp.arange(read_block)).reshape(b, s, -1)
    valid = (
        jnp.repeat(indices >= 0, read_block, axis=-1) & (tok <= positions[..., None]) & (tok < t)
    )
    rows = jnp.clip(tok, 0, t - 1) + (jnp.arange(b) * t)[:, None, None]
    out = _attend_chunked(
        q.reshape(b * s, h, dk),
        kv.reshape(b * t, dk),
        rows.reshape(b * s, -1),
        valid.reshape(b * s, -1),
        sm_scale=sm_scale,
        dv=kv_lora_rank,
        chunk=chunk,
    )
    return out.reshape(b, s, h, kv_lora_rank)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "read_block", "page_size", "chunk")
)
def xla_paged(
    q: jax.Array,
    cache: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    q_seq_id: jax.Array,
    seq_lens: jax.Array,
    cu_kv_lens: jax.Array,
    page_indices: jax.Array,
    sm_scale: float,
    kv_lora_rank: int,
    read_block: int,
    page_size: int,
    chunk: int,
) -> jax.Array:
    """Ragged paged mode in plain JAX: ``q [1, S, H, Dk]``, ``cache [P, ps // pk, pk,
    Dk_pad]``, ``indices [1, S, K]`` request-local page ids (distinct; ``-1`` = none),
    request-local ``positions [1, S]`` -> ``[1, S, H, Dv]``."""
    del read_block  # == page_size
    s = q.shape[1]
    base = cu_kv_lens[q_seq_id] // page_size
    extent = cu_kv_lens[q_seq_id + 1] // page_size - base
    page = indices[0]
    slot = jnp.clip(base[:, None] + page, 0, page_indices.shape[0] - 1)
    phys = page_indices[slot]
    r = jnp.arange(page_size)
    tok = (page[..., None] * page_size + r).reshape(s, -1)  # request-local positions
    rows = (phys[..., None] * page_size + r).reshape(s, -1)
    valid = (
        jnp.repeat((page >= 0) & (page < extent[:, None]), page_size, axis=-1)
        & (tok <= positions[0][:, None])
        & (tok < seq_lens[q_seq_id][:, None])
    )
    store = cache.reshape(-1, cache.shape[-1])
    out = _attend_chunked(
        q[0],
        store,
        jnp.clip(rows, 0, store.shape[0] - 1),
        valid,
        sm_scale=sm_scale,
        dv=kv_lora_rank,
        chunk=chunk,
    )
    return out[None]


def xla_sparse_mla(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    chunk: int = 512,
    **kwargs,
) -> jax.Array:
    """The xla baseline with ``sparse_mla_attention``'s arguments (flat or paged)."""
    fn = xla_paged if kwargs.get("q_seq_id") is not None else xla_flat
    return fn(q, kv, indices, positions, chunk=chunk, **kwargs)


# --------------------------------------------------------------------------- ours


def _backend(impl: str):
    """The named backend's package, through the dispatch (a backend imports no other;
    may raise ``BackendUnavailableError``)."""
    if impl not in IMPLS[:2]:
        raise ValueError(f"impl: got {impl!r}, expected one of {IMPLS[:2]}")
    return load_backend(impl)


def load_impl(impl: str, config: tuple[int, int] | None = None) -> Callable:
    """``sparse_mla_attention`` of the named backend (imported lazily; may raise);
    ``config``: the Hopper kernel's ``(block_k, num_stages)``, ``None`` its default."""
    module = _backend(impl)
    if impl == "mosaic-gpu" and config is not None:
        return functools.partial(
            module.sparse_mla_attention, config=module.SparseMlaKernelConfig(*config)
        )
    return module.sparse_mla_attention


def write_inputs(case: Case, args: tuple, kwargs: dict, seed: int = 0) -> dict:
    """Paged cases: the arguments of ``prefill_write_and_attend_ragged`` for the case's
    queries, which are the newest tokens of their requests: ``ql``/``qpe`` split from
    ``q``, random new latents ``kvc``/``kpe``, each token's cache slot ``loc`` (its
    request's page table), ``cu_q_lens``; the case's cache, selections and tables."""
    q, cache, idx, pos = args
    ps = case.page_size
    q_seq_id, cu_kv_lens = kwargs["q_seq_id"], kwargs["cu_kv_lens"]
    pos = pos[0]
    page = kwargs["page_indices"][cu_kv_lens[q_seq_id] // ps + pos // ps]
    k_c, k_r = jax.random.split(jax.random.PRNGKey(seed + 1))
    s = case.num_queries
    counts = jnp.bincount(q_seq_id, length=kwargs["seq_lens"].shape[0])
    return {
        "ql": q[0, :, :, : case.dv],
        "qpe": q[0, :, :, case.dv :],
        "kvc": jax.random.normal(k_c, (s, case.dv), jnp.bfloat16),
        "kpe": jax.random.normal(k_r, (s, case.dk - case.dv), jnp.bfloat16),
        "cache": cache,
        "topk_pages": idx[0],
        "positions": pos,
        "loc": (page * ps + pos % ps).astype(jnp.int32),
        "seq_lens": kwargs["seq_lens"],
        "cu_q_lens": jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)]).astype(
            jnp.int32
        ),
        "cu_kv_lens": cu_kv_lens,
        "page_indices": kwargs["page_indices"],
    }


def carried_calls(fn: Callable, cache_at: int, calls: int) -> Callable:
    """A jitted ``calls`` calls of ``fn`` (its positional argument ``cache_at`` the
    cache; its result the new cache, or a tuple ending with it), each call's new cache
    fed to the next through a loop, as a serving loop with a donated cache does: XLA
    updates a loop-carried buffer in place. Only the first call reads the caller's
    cache, which is not donated (a copy of it, if XLA makes one, comes once). Of the
    other results the loop carries the first element only, which keeps the call alive
    without copying a whole output into the carry each call. Returns the last call's
    new cache, or ``(first elements..., new cache)``."""

    def carried(result):
        if not isinstance(result, tuple):
            return result
        return (*(x.reshape(-1)[0] for x in result[:-1]), result[-1])

    def run(*xs):
        def call(cache):
            return carried(fn(*xs[:cache_at], cache, *xs[cache_at + 1 :]))

        return lax.fori_loop(1, calls, lambda _, r: call(r[-1] if isinstance(r, tuple) else r),
                             call(xs[cache_at]))  # fmt: skip

    return jax.jit(run)


def write_fns(case: Case, impl: str) -> tuple[Callable, Callable]:
    """The named backend's jitted ``paged_write_back`` and ``prefill_write_and_attend_ragged``
    at the case's page size (the wrapper's arguments: ``write_inputs``)."""
    module = _backend(impl)
    write = jax.jit(functools.partial(module.paged_write_back, page_size=case.page_size))
    wrapper = jax.jit(
        functools.partial(
            module.prefill_write_and_attend_ragged,
            kv_lora_rank=case.dv,
            page_size=case.page_size,
            sm_scale=SM_SCALE,
        )
    )
    return write, wrapper


def time_write(case: Case, args: tuple, kwargs: dict, *, impl: str, iterations: int) -> dict:
    """Paged cases: the backend's ``paged_write_back`` of the case's new rows (the
    wrapper's rows ``[c_kv | k_rope | 0...]``) and its ``prefill_write_and_attend_ragged``
    (write, then attend over the new cache), each jitted as one call without donating
    the cache (``*_ms``; XLA copies the cache first, which CUPTI sees only when it runs
    as a kernel), and the write-back as ``WRITE_LOOP_CALLS`` calls carrying the cache
    through a loop (``write_back_loop_ms``, per call: the in-place update of serving).
    The wrapper is not timed in a loop: 8 back-to-back attentions hold the H200 at its
    power limit, where its clock drops, so the loop measured the clock (the attention
    kernel 7 % slower; docs/sparse_mla_gpu.md). Failures are recorded."""
    from attn_common.paged import latent_rows

    write, wrapper = write_fns(case, impl)
    w = write_inputs(case, args, kwargs)
    rows = latent_rows(w["kvc"], w["kpe"], width=w["cache"].shape[-1], dtype=w["cache"].dtype)
    out: dict = {"write_rows": int(rows.shape[0]), "write_row_bytes": int(rows.shape[1]) * 2}
    write_args, wrapper_args = (w["cache"], rows, w["loc"]), tuple(w.values())
    loop = WRITE_LOOP_CALLS
    timed = (
        ("write_back", write, write_args, 1),
        ("write_back_loop", carried_calls(write, 0, loop), write_args, loop),
        ("write_and_attend", wrapper, wrapper_args, 1),
    )
    for name, fn, fn_args, calls in timed:
        try:
            ms, _ = device_ms(fn, *fn_args, iterations=iterations)
            out[f"{name}_ms"] = ms / calls
            print(f"  {name:<21}: {ms / calls:9.3f} ms")
        except Exception as e:
            out[f"{name}_error"] = _error(e)
            print(f"  {name:<21}: FAILED {out[f'{name}_error']}")
    return out


def jit_call(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """``(jitted, call_args)``: ``jitted(*call_args)`` is ``fn(*args, **kwargs)`` with the
    array kwargs (the ragged tables) traced arguments, the rest static."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    consts = {k: v for k, v in kwargs.items() if k not in arrays}
    names, n = tuple(arrays), len(args)

    @jax.jit
    def call(*xs):
        return fn(*xs[:n], **dict(zip(names, xs[n:], strict=True)), **consts)

    return call, (*args, *arrays.values())


def rel_l2(got: ArrayLike, want: ArrayLike) -> float:
    """``|got - want| / |want|`` in float32 (``|got - want|`` when ``want`` is zero)."""
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    den = float(jnp.linalg.norm(want))
    num = float(jnp.linalg.norm(got - want))
    return num / den if den > 0 else num


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:400]}"


def _sample(args: tuple, kwargs: dict, count: int) -> tuple[tuple, dict, np.ndarray]:
    """The same call restricted to ``count`` evenly spaced queries (the tables kept)."""
    s = args[0].shape[1]
    sel = np.unique(np.linspace(0, s - 1, min(count, s)).astype(np.int32))
    q, kv, idx, pos = args
    kw = dict(kwargs)
    if kw.get("q_seq_id") is not None:
        kw["q_seq_id"] = kw["q_seq_id"][sel]
    return (q[:, sel], kv, idx[:, sel], pos[:, sel]), kw, sel


# --------------------------------------------------------------------------- one case


def run_case(
    case: Case,
    *,
    impl: str,
    iterations: int,
    xla_chunks: list[int],
    seed: int,
    ceil: dict,
    check_queries: int,
    kernel_config: tuple[int, int] | None = None,
) -> dict:
    """Measure one case; every failure is recorded in the row, never raised."""
    t0 = time.perf_counter()
    inputs = make_inputs(case, seed)
    args, kwargs = inputs["args"], inputs["kwargs"]
    rows_per_query = inputs["rows_per_query"]
    valid_pairs = int(rows_per_query.sum())
    flops = 2.0 * case.heads * (case.dk + case.dv) * valid_pairs
    s, h = case.num_queries, case.heads
    groups = -(-h // HEAD_GROUP)
    bytes_moved = groups * valid_pairs * case.dk * 2 + s * h * case.dk * 2 + s * h * case.dv * 4
    row: dict = {
        "case": case.name,
        "mode": case.mode,
        "heads": h,
        "kv_len": case.kv_len,
        "num_queries": s,
        "top_k": case.top_k,
        "read_block": case.read_block,
        "dk": case.dk,
        "dv": case.dv,
        "valid_pairs": valid_pairs,
        "valid_rows_per_query_mean": valid_pairs / max(1, s),
        "flops": flops,
        "bytes": bytes_moved,
        "target": TARGETS.get(h),
        "input_s": None,
    }
    row["input_s"] = round(time.perf_counter() - t0, 2)
    print(f"{case.name}: {valid_pairs / max(1, s):.0f} valid keys/query ({row['input_s']} s)")

    # xla, fastest chunk
    xla_ms: dict[str, float | str] = {}
    best = None
    for chunk in sorted({min(c, s) for c in xla_chunks}):
        fn, call_args = jit_call(functools.partial(xla_sparse_mla, chunk=chunk), args, kwargs)
        try:
            ms, method = device_ms(fn, *call_args, iterations=iterations)
            xla_ms[str(chunk)] = ms
            row["timing"] = method
            if best is None or ms < best[1]:
                best = (chunk, ms, fn, call_args)
            print(f"  xla chunk {chunk:>5}: {ms:9.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s")
        except Exception as e:
            xla_ms[str(chunk)] = _error(e)
            print(f"  xla chunk {chunk:>5}: FAILED {_error(e)}")
    row["xla_chunks_ms"] = xla_ms
    xla_out = None
    if best is not None:
        row["xla_chunk"], row["xla_ms"] = best[0], best[1]
        row["xla_tflops"] = flops / best[1] / 1e9
        xla_out = best[2](*best[3])
        try:  # the baseline against the reference on a sample of queries
            reference = _backend("reference").sparse_mla_attention
            s_args, s_kw, sel = _sample(args, kwargs, check_queries)
            ref_fn, ref_args = jit_call(reference, s_args, s_kw)
            ref = ref_fn(*ref_args)
            row["xla_vs_reference_rel_l2"] = rel_l2(xla_out[:, sel], ref)
            row["xla_vs_reference_queries"] = len(sel)
        except Exception as e:
            row["xla_vs_reference_error"] = _error(e)
    else:
        row["xla_ms"] = None

    # ours
    row["impl"] = impl
    row["ours_ms"] = None
    if impl != "none":
        try:
            fn, call_args = jit_call(load_impl(impl, kernel_config), args, kwargs)
            out = fn(*call_args)
            ms, method = device_ms(fn, *call_args, iterations=iterations)
            row["ours_ms"], row["timing"] = ms, method
            row["ours_tflops"] = flops / ms / 1e9
            row["ours_tbps"] = bytes_moved / ms / 1e9
            print(f"  {impl:<15}: {ms:9.3f} ms {row['ours_tflops']:8.1f} TFLOP/s")
            if xla_out is not None:
                row["rel_l2_ours_vs_xla"] = rel_l2(out, xla_out)
                row["speedup_vs_xla"] = row["xla_ms"] / ms
        except Exception as e:
            row["ours_error"] = _error(e)
            print(f"  {impl:<15}: FAILED {row['ours_error']}")
            traceback.print_exc(limit=2)
    if case.mode == "paged" and impl != "none":
        row.update(time_write(case, args, kwargs, impl=impl, iterations=iterations))
        if row.get("write_back_loop_ms"):  # the new rows read and written once
            write_bytes = 2 * row["write_rows"] * row["write_row_bytes"]
            row["write_back_tbps"] = write_bytes / row["write_back_loop_ms"] / 1e9
        if row.get("write_and_attend_ms"):
            row["write_and_attend_tflops"] = flops / row["write_and_attend_ms"] / 1e9
    if ceil.get("copy_tbps"):
        row["copy_ceiling_ms"] = bytes_moved / (ceil["copy_tbps"] * 1e9)
        if row["ours_ms"]:
            row["ours_fraction_of_copy_ceiling"] = row["copy_ceiling_ms"] / row["ours_ms"]
    target = row["target"]
    if target and row["ours_ms"] and row.get("speedup_vs_xla"):
        row["target_met"] = bool(
            row["ours_tflops"] >= target["tflops"] and row["speedup_vs_xla"] >= target["speedup"]
        )
    row["case_s"] = round(time.perf_counter() - t0, 1)
    return row


def row_failed(row: dict) -> bool:
    """A failed row: ours raised, or every XLA chunk size failed."""
    return bool(row.get("ours_error")) or row.get("xla_ms") is None


# --------------------------------------------------------------------------- reports


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def write_reports(result: dict, out: Path) -> list[Path]:
    """Write ``sparse_mla_gpu.json``, ``.md`` and ``.svg`` into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / RESULT_JSON, out / RESULT_MD, out / RESULT_SVG]
    write_plot(result, paths[2])
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    prov, ceil = result["provenance"], result["ceilings"]
    ceil_text = (
        f"bf16 matmul {ceil['matmul_bf16_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s"
        if ceil
        else "not measured"
    )
    lines = [
        "# Sparse MLA prefill: ours vs XLA",
        "",
        f"Commit: {prov.get('commit', 'unknown')}; command: `{prov.get('command', '?')}`; "
        f"date: {prov.get('date', '?')}.",
        "",
        f"Device: {result['device']}; jax {result['jax']}; ours: {result['impl']}; timing: "
        f"{result['timing']}; ceilings: {ceil_text}. TFLOP/s count 2 * H * (576 + 512) per "
        "valid (query, key) pair; bytes: valid rows x 1152 B per 64-head group, q in, f32 "
        "out. Targets: H=128 >= 500 TFLOP/s and >= 3.3x XLA; H=64 >= 350 and >= 3.8x.",
        *(
            [
                "",
                "**Smoke run** (tiny shapes, few iterations, wall clock off a GPU): checks "
                "that the benchmark runs end to end; not a measurement.",
            ]
            if result.get("smoke")
            else []
        ),
        "",
        "| case | keys/query | XLA ms (chunk) | XLA TFLOP/s | ours ms | ours TFLOP/s | "
        "speed-up | target met | GB | ours TB/s | copy-ceiling ms | rel L2 ours vs XLA | "
        "XLA vs ref |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        xla = f"{r['xla_ms']:.3f} ({r['xla_chunk']})" if r.get("xla_ms") else "failed"
        ours = _f(r.get("ours_ms"), ".3f") or ("failed" if r.get("ours_error") else "")
        met = r.get("target_met")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["case"],
                    f"{r['valid_rows_per_query_mean']:.0f}",
                    xla,
                    _f(r.get("xla_tflops"), ".1f"),
                    ours,
                    _f(r.get("ours_tflops"), ".1f"),
                    _f(r.get("speedup_vs_xla"), ".2f") + ("x" if r.get("speedup_vs_xla") else ""),
                    "" if met is None else ("yes" if met else "no"),
                    f"{r['bytes'] / 1e9:.2f}",
                    _f(r.get("ours_tbps"), ".2f"),
                    _f(r.get("copy_ceiling_ms"), ".3f"),
                    _f(r.get("rel_l2_ours_vs_xla"), ".1e"),
                    _f(r.get("xla_vs_reference_rel_l2"), ".1e"),
                ]
            )
            + " |"
        )
    writes = [r for r in result["rows"] if "write_rows" in r]
    if writes:
        lines += [
            "",
            "Paged write-back (`paged_write_back`: the new tokens' rows into the cache) and "
            "the write-then-attend wrapper (`prefill_write_and_attend_ragged`), each "
            "jitted as one call without donating the cache (XLA copies the cache first; "
            "CUPTI counts that copy only when it runs as a kernel), and the write-back "
            f"also as {WRITE_LOOP_CALLS} calls in a loop that carries the cache, updated "
            'in place as a serving loop with a donated cache does ("in a loop", per '
            "call). TB/s count the new rows read and written once (the loop's time).",
            "",
            "| case | new rows | write-back ms, one call | in a loop | write-back TB/s | "
            "wrapper ms, one call | wrapper TFLOP/s | attention alone ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in writes:
            lines.append(
                f"| {r['case']} | {r['write_rows']} | "
                f"{_f(r.get('write_back_ms'), '.3f') or 'failed'} | "
                f"{_f(r.get('write_back_loop_ms'), '.3f') or 'failed'} | "
                f"{_f(r.get('write_back_tbps'), '.2f')} | "
                f"{_f(r.get('write_and_attend_ms'), '.3f') or 'failed'} | "
                f"{_f(r.get('write_and_attend_tflops'), '.1f')} | "
                f"{_f(r.get('ours_ms'), '.3f')} |"
            )
    errors = [(r["case"], r["ours_error"]) for r in result["rows"] if r.get("ours_error")]
    if errors:
        lines += ["", "Errors of ours:", ""]
        lines += [f"- {case}: `{err}`" for case, err in errors]
    paths[1].write_text("\n".join(lines) + "\n")
    return paths


_PLOT_COLORS = {"xla": "#999", "ours": "#1f77b4", 128: "#c00", 64: "#e80"}


def write_plot(result: dict, path: Path) -> None:
    """A plain SVG (no plotting library): per case, XLA's and our TFLOP/s side by side,
    with the TFLOP/s target of each head count as a dashed line."""
    rows = result["rows"]
    width, height, left, right, top, base = 900, 400, 60, 880, 30, 290
    targets = {int(h): t["tflops"] for h, t in result.get("targets", {}).items()}
    peak = max(
        [r.get(k) or 0.0 for r in rows for k in ("xla_tflops", "ours_tflops")]
        + list(targets.values())
        + [1.0]
    )
    step = 10 ** math.floor(math.log10(peak))
    step *= 1 if peak / step >= 4 else 0.5 if peak / step >= 2 else 0.25
    vmax = math.ceil(peak * 1.08 / step) * step

    def y(v: float) -> float:
        return base - v / vmax * (base - top)

    prov = result["provenance"]
    title = f"Sparse MLA prefill on {result['device']} (commit {prov.get('commit', 'unknown')})" + (
        ": smoke run, not a measurement" if result.get("smoke") else ": effective TFLOP/s"
    )
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">'
        f"{html.escape(title)}</text>",
    ]
    for i in range(round(vmax / step) + 1):
        v = i * step
        out.append(
            f'<line x1="{left}" x2="{right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
            f'<text x="{left - 5}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>'
        )
    for heads, tflops in sorted(targets.items(), reverse=True):
        color = _PLOT_COLORS.get(heads, "#c00")
        out.append(
            f'<line x1="{left}" x2="{right}" y1="{y(tflops):.1f}" y2="{y(tflops):.1f}" '
            f'stroke="{color}" stroke-dasharray="4 3"/><text x="{right - 2}" '
            f'y="{y(tflops) - 3:.1f}" text-anchor="end" fill="{color}">target H={heads}</text>'
        )
    slot = (right - left) / max(1, len(rows))
    bar = slot * 0.36
    for i, r in enumerate(rows):
        x0 = left + i * slot + slot * 0.14
        for j, key in enumerate(("xla", "ours")):
            v = r.get(f"{key}_tflops")
            if v is None:
                continue
            x = x0 + j * bar
            out.append(
                f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar:.1f}" '
                f'height="{base - y(v):.1f}" fill="{_PLOT_COLORS[key]}"/>'
            )
            if key == "ours":
                out.append(
                    f'<text x="{x + bar / 2:.1f}" y="{y(v) - 3:.1f}" '
                    f'text-anchor="middle">{v:.0f}</text>'
                )
        out.append(
            f'<text transform="translate({x0 + bar:.1f},{base + 12}) rotate(40)" '
            f'font-size="10">{html.escape(r["case"])}</text>'
        )
    for j, (key, label) in enumerate((("xla", "XLA gather + einsum"), ("ours", result["impl"]))):
        x = left + 10 + j * 180
        out.append(
            f'<rect x="{x}" y="{height - 14}" width="10" height="10" fill="{_PLOT_COLORS[key]}"/>'
            f'<text x="{x + 14}" y="{height - 5}">{html.escape(label)}</text>'
        )
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


# --------------------------------------------------------------------------- arguments


def script_run(
    argv: list[str] | None,
    doc: str,
    cases: Callable[[bool], list],
    *,
    out: Path,
    merge: bool = False,
) -> tuple[argparse.Namespace, list, dict]:
    """The command line of a ``benchmarks/sparse_mla_*.py`` script: ``(args, the selected
    cases, the result so far)``. Flags ``--out`` (default ``out``), ``--iterations``,
    ``--cases`` (names of ``cases(smoke)``), ``--smoke`` and with ``merge`` ``--merge``
    (``args.merge``: JSON files; no cases then). The result holds the provenance, the
    device, the ceilings (none in a smoke run) and no rows yet."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    if merge:
        parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON", help="merge runs")
    args = parser.parse_args(argv)
    if getattr(args, "merge", None):
        return args, [], {}
    names = [c.name for c in cases(args.smoke)]
    selected = [c for c in cases(args.smoke) if not args.cases or c.name in args.cases]
    if not selected:
        parser.error(f"--cases: got {args.cases}, expected names of {names}")
    ceil = {} if args.smoke else ceilings()
    print(f"ceilings: {ceil}")
    prov = provenance(argv)
    result = dict(provenance=prov, commit=prov["commit"], device=jax.devices()[0].device_kind,
                  iterations=args.iterations, smoke=args.smoke, ceilings=ceil, rows=[],
                  failed=0)  # fmt: skip
    return args, selected, result


def write_json(result: dict, out: Path, name: str) -> Path:
    """A benchmark script's ``result`` written to ``out/name.json`` (``out`` created,
    one-space indents, a final newline); the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def script_report(result: dict, out: Path, name: str) -> tuple[list[Path], str]:
    """A ``benchmarks/sparse_mla_*.py`` script's report: the paths ``name.{json,md,svg}``
    under ``out`` with the JSON written, and the Markdown's opening sentence (commit,
    date, device, command, the timing method and the median's calls)."""
    paths = [write_json(result, out, name), *(out / f"{name}.{ext}" for ext in ("md", "svg"))]
    prov = result["provenance"]
    timing = ", ".join(sorted({r["timing"] for r in result["rows"] if r.get("timing")})) or "none"
    kind = "device time" if timing == "cupti" else "not a device time"
    return paths, (
        f"Commit `{prov['commit']}`, {prov['date']}, device {result['device']}; command "
        f"`{prov['command']}`. Time: {timing} ({kind}), median of {result['iterations']} "
        "calls after a warm-up"
    )


def speedup_svg(path: Path, title: str, names: list[str], series: list, targets: list) -> None:
    """An SVG bar chart of speed-ups: per case name, one bar per ``(color, values)`` of
    ``series`` (``values[i]`` for ``names[i]``, ``None`` draws none), a red tick at
    ``targets[i]`` (``None``: none), and a grey line at 1."""
    bar = 24
    pitch = 32 + bar * len(series)
    width, height, left, base = 60 + pitch * len(names), 320, 50, 250
    top = max([2.0, *(v or 0 for _, values in series for v in values)])

    def y(v):
        return base - (base - 30) * v / top

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="10"><text x="10" y="15">{html.escape(title)}</text>',
        f'<line x1="{left}" y1="{y(1):.1f}" x2="{width - 10}" y2="{y(1):.1f}" stroke="#999"/>',
    ]
    for i, name in enumerate(names):
        x = left + 10 + pitch * i
        for j, (color, values) in enumerate(series):
            if (v := values[i]) is not None:
                xx = x + j * bar
                parts.append(
                    f'<rect x="{xx}" y="{y(v):.1f}" width="{bar - 2}" height="{base - y(v):.1f}" '
                    f'fill="{color}"/><text x="{xx}" y="{y(v) - 3:.1f}">{v:.2f}</text>'
                )
        if (t := targets[i]) is not None:
            parts.append(
                f'<line x1="{x - 4}" y1="{y(t):.1f}" x2="{x + bar * len(series) + 4}" '
                f'y2="{y(t):.1f}" stroke="#e45756" stroke-width="2"/>'
            )
        label = html.escape(name.replace("prefill-", "p-").replace("decode-", "d-"))
        parts.append(
            f'<text x="{x}" y="{base + 14}" transform="rotate(30 {x} {base + 14})">{label}</text>'
        )
    path.write_text("\n".join([*parts, "</svg>"]) + "\n")


def select_cases(patterns: list[str] | None, smoke: bool) -> list[Case]:
    """Cases whose name matches any glob of ``patterns`` (all when None)."""
    pool = SMOKE_CASES if smoke else CASES
    if not patterns:
        return list(pool)
    chosen = [c for c in pool if any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    if not chosen:
        names = ", ".join(c.name for c in pool)
        raise ValueError(f"--cases: {patterns} match none of {names}")
    return chosen


def _on_gpu() -> bool:
    return device_class() in ("hopper", "gpu")


def default_impl() -> str:
    """Ours when ``--implementation`` is left out under ``attn bench``: the dispatch choice for
    sparse MLA on the default device, ``mosaic-gpu`` on a Hopper GPU, else the reference."""
    return "mosaic-gpu" if device_class() == "hopper" else "reference"


def _describe(case: Case) -> str:
    layout = (
        f"kv [1, {case.kv_len}, {case.dk}]"
        if case.mode == "flat"
        else f"{case.num_requests} requests up to {case.kv_len} tokens, page {case.page_size}"
    )
    return (
        f"  {case.name:<16} H{case.heads} S{case.num_queries} top-{case.top_k_tokens} "
        f"tokens ({case.top_k} x {case.read_block}), {layout}"
    )


def epilog(*, bench: bool = True) -> str:
    """The cases and smoke cases, for ``--help``; ``bench``: ``attn bench``'s defaults."""
    lines = ["cases (bf16, Dk 576, Dv 512; --cases takes globs, e.g. 'flat-h128-*'):"]
    lines += [_describe(c) for c in CASES]
    lines.append("smoke cases (--smoke" + (", or off a GPU without --full" if bench else "") + "):")
    lines += [_describe(c) for c in SMOKE_CASES]
    lines.append(
        "TFLOP/s count 2 * H * (576 + 512) per valid (query, key) pair; targets: H=128 "
        ">= 500 TFLOP/s and >= 3.3x XLA, H=64 >= 350 and >= 3.8x."
    )
    if bench:
        lines.append("exit status 1 when a row fails (ours raised, or every XLA chunk failed).")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser, *, script_out: Path | None = None) -> None:
    """The benchmark's flags. ``script_out=None``: ``attn bench sparse-mla``'s defaults
    (a new ``attn-results`` folder, ``--overwrite``, ours by device, smoke off a GPU
    unless ``--full``); a path: ``benchmarks/sparse_mla_gpu.py``'s (``--out`` that
    path, ``--implementation mosaic-gpu``, the full cases unless ``--smoke``)."""
    bench = script_out is None
    parser.add_argument(
        "--out",
        type=out_path,
        default=script_out,
        help="folder for sparse_mla_gpu.json/.md (default: "
        + (
            "a new folder attn-results/<timestamp> under the current directory)"
            if bench
            else f"{script_out})"
        ),
    )
    if bench:
        parser.add_argument(
            "--overwrite",
            action="store_true",
            help="allow an --out that already holds results (default: refuse)",
        )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        metavar="GLOB",
        help="cases whose name matches any glob (default: all; the smoke cases in a smoke run)",
    )
    parser.add_argument(
        "--implementation",
        "--impl",  # the old spelling, kept as an alias
        dest="impl",
        choices=IMPLS,
        default=None if bench else "mosaic-gpu",
        help="ours: the Hopper kernel, the reference or none (default: "
        + ("mosaic-gpu on a Hopper GPU, else reference)" if bench else "mosaic-gpu)"),
    )
    parser.add_argument(
        "--iterations",
        type=iterations_int,
        default=20,
        help="timed calls per measurement, 1..10000 (default: 20; at most 2 in a smoke run)",
    )
    parser.add_argument(
        "--xla-chunks",
        type=positive_int,
        nargs="+",
        default=[256, 512, 1024],
        metavar="N",
        help="query chunk sizes of the XLA baseline; the fastest is reported "
        "(default: 256 512 1024)",
    )
    parser.add_argument(
        "--check-queries",
        type=positive_int,
        default=64,
        help="queries of each case checked against the reference, 1..1000000 (default: 64)",
    )
    parser.add_argument(
        "--kernel-config",
        type=positive_int,
        nargs=2,
        default=None,
        metavar=("BLOCK_K", "NUM_STAGES"),
        help="the Hopper kernel's SparseMlaKernelConfig (default: its default)",
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0, help=f"input seed, 0..{MAX_SEED} (default: 0)"
    )
    parser.add_argument(
        "--no-ceilings", action="store_true", help="skip the matmul and copy ceilings"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes (a CPU run in seconds), 2 iterations"
    )
    if bench:
        parser.add_argument(
            "--full", action="store_true", help="run the real cases even when not on a GPU"
        )
    parser.set_defaults(bench_conventions=bench)


def build_parser(
    *, script_out: Path | None = None, prog: str | None = None
) -> argparse.ArgumentParser:
    """A parser with :func:`add_arguments` (``script_out``: see there)."""
    parser = OneLineParser(
        prog=prog,
        description=__doc__.splitlines()[0],
        epilog=epilog(bench=script_out is None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, script_out=script_out)
    return parser


def is_smoke(args: argparse.Namespace) -> bool:
    """``--smoke``, or (``attn bench`` conventions) off a GPU without ``--full``."""
    if args.smoke:
        return True
    return bool(getattr(args, "bench_conventions", False)) and not _on_gpu() and not args.full


def check_args(args: argparse.Namespace) -> str | None:
    """Checks argparse cannot express; the one-line error, or None. Resolves a missing
    ``--out`` to a new folder (and, with ``attn bench``'s conventions, refuses one that
    holds results unless ``--overwrite``)."""
    try:
        select_cases(args.cases, is_smoke(args))
    except ValueError as e:
        return str(e)
    if args.out is None:
        args.out = default_out_dir()
    if getattr(args, "bench_conventions", False):
        return check_out_dir(
            args.out, overwrite=getattr(args, "overwrite", False), result_files=RESULT_FILES
        )
    return None


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark into ``args.out`` (parsed by :func:`add_arguments`); the result
    written to the JSON, with ``result["failed"]`` the number of failed rows."""
    smoke = is_smoke(args)
    cases = select_cases(args.cases, smoke)
    if args.out is None:
        args.out = default_out_dir()
    impl = args.impl or default_impl()
    iterations = min(args.iterations, 2) if smoke else args.iterations
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    print(f"jax {jax.__version__}, device {dev.device_kind}, ours: {impl}")
    if smoke and not args.smoke:
        print(
            "The sparse MLA benchmark is meant for a Hopper GPU; the default device is "
            f"{device_class()}. Running a smoke run only (tiny shapes, {iterations} "
            f"iteration{'' if iterations == 1 else 's'}, wall clock): not a measurement; "
            "--full runs the real cases anyway."
        )
    ceil = {}
    if not smoke and not args.no_ceilings:
        try:
            ceil = ceilings()
            print(f"ceilings: {ceil}")
        except Exception as e:
            print(f"ceilings failed: {_error(e)}")
    result = {
        "provenance": provenance(getattr(args, "argv", None)),
        "device": dev.device_kind,
        "jax": jax.__version__,
        "impl": impl,
        "kernel_config": args.kernel_config,
        "timing": "CUPTI device time, median of iterations" if on_gpu else "wall clock, median",
        "iterations": iterations,
        "ceilings": ceil,
        "smoke": smoke,
        "targets": {str(h): t for h, t in TARGETS.items()},
        "rows": [],
    }
    for case in cases:
        result["rows"].append(
            run_case(
                case,
                impl=impl,
                iterations=iterations,
                xla_chunks=args.xla_chunks,
                seed=args.seed,
                ceil=ceil,
                check_queries=args.check_queries,
                kernel_config=tuple(args.kernel_config) if args.kernel_config else None,
            )
        )
        write_reports(result, args.out)  # partial results survive a later failure
    result["failed"] = sum(1 for r in result["rows"] if row_failed(r))
    paths = write_reports(result, args.out)
    print("wrote " + ", ".join(map(str, paths)))
    print(paths[1].read_text())
    if result["failed"]:
        print(f"{result['failed']} of {len(result['rows'])} rows failed", file=sys.stderr)
    return result


def main(argv: list[str] | None = None, *, script_out: Path | None = None) -> dict:
    """Parse ``argv`` and run; returns the result dict written to the JSON.
    ``script_out``: ``benchmarks/sparse_mla_gpu.py``'s defaults (see
    :func:`add_arguments`); None: ``attn bench sparse-mla``'s."""
    parser = build_parser(script_out=script_out)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    return run(args)


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
