"""Ragged paged metadata: the rules, checked before launch and, under jit, by checkify.

A serving engine hands the sparse-MLA ops its packed tables (``q_seq_id``, ``seq_lens``,
``cu_kv_lens``, ``page_indices`` and, for the write-then-attend wrappers, ``cu_q_lens``).
A wrong table does not crash a kernel: it makes it read another request's page or drop
pages. So every rule is written once here, as a vectorised predicate over the arrays,
and used two ways:

* **host values** (numpy or concrete ``jax.Array``, i.e. outside ``jit``): evaluated
  eagerly before launch; the first broken rule raises ``ValueError`` naming the argument,
  the offending entry, its value and the rule;
* **traced values** with ``debug_checks=True``: each rule becomes a ``checkify.check``
  (wrap the call in ``jax.experimental.checkify.checkify`` to collect the error).

Under jit without ``debug_checks`` the kernels' defined behaviour applies: request ids
are clipped, page-table slots past a request's extent or the table are dropped, physical
pages outside the cache are never read.

The rules (``P = page_size``, ``R = num_seqs``, ``N = len(page_indices)``):

* ``cu_kv_lens``: ``>= 0``, non-decreasing, multiples of ``P`` (a request owns whole
  pages), and ``cu_kv_lens[R] <= N * P`` (the page table covers every request's pages);
* ``seq_lens``: ``0 <= seq_lens[r] <= cu_kv_lens[r + 1] - cu_kv_lens[r]``;
* ``q_seq_id``: ``0 <= q_seq_id[t] < R``;
* ``page_indices``: every slot that holds a request's tokens (the first
  ``ceil(seq_lens[r] / P)`` slots of its extent) names a page in ``[0, num_pages)``,
  and no two of one request's such slots name the same page (a page holds one run of
  the request's tokens; two positions for one row would leave a selection of both
  ambiguous). Different requests may share pages (a common prefix). Slots past a
  request's tokens may hold anything (``-1`` is usual);
* ``cu_q_lens``: ``cu_q_lens[0] == 0``, non-decreasing, ``cu_q_lens[R] == T`` (the number
  of packed query tokens).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def is_concrete(*arrays) -> bool:
    """True when every argument holds values: numpy data, or a jax array outside jit
    (not a tracer, nor a shape-only ``jax.ShapeDtypeStruct``)."""
    return all(
        not isinstance(a, jax.core.Tracer)
        and isinstance(a, (np.ndarray, np.generic, jax.Array, list, tuple, int))
        for a in arrays
    )


def _non_decreasing(name: str, cu) -> tuple[str, str, object, object, int]:
    """The rule that a cumulative table ``cu`` never decreases (checked from entry 1)."""
    return (
        name,
        f"expected non-decreasing ({name}[r] <= {name}[r + 1])",
        cu[1:] >= cu[:-1],
        cu[1:],
        1,
    )


def _rules(
    xp, q_seq_id, seq_lens, cu_kv_lens, page_indices, cu_q_lens, *, page_size, num_pages,
    num_tokens,
) -> Iterator[tuple[str, str, object, object, int]]:  # fmt: skip
    """Yield ``(argument, rule, ok, values, first_index)``: ``ok`` is elementwise over
    ``values``, whose entry ``i`` is the argument's entry ``first_index + i``."""
    cu = cu_kv_lens
    num_seqs = seq_lens.shape[0]
    total_pages = page_indices.shape[0]
    yield "cu_kv_lens", "expected >= 0", cu >= 0, cu, 0
    yield _non_decreasing("cu_kv_lens", cu)
    yield (
        "cu_kv_lens",
        f"expected a multiple of page_size = {page_size} (a request owns whole pages)",
        cu % page_size == 0,
        cu,
        0,
    )
    yield (
        "cu_kv_lens",
        f"expected <= len(page_indices) * page_size = {total_pages * page_size} (the page "
        "table must hold every request's pages)",
        cu[-1:] <= total_pages * page_size,
        cu[-1:],
        num_seqs,
    )
    extent = cu[1:] - cu[:-1]
    yield (
        "seq_lens",
        "expected 0 <= seq_lens[r] <= cu_kv_lens[r + 1] - cu_kv_lens[r] (the request's pages)",
        (seq_lens >= 0) & (seq_lens <= extent),
        seq_lens,
        0,
    )
    yield (
        "q_seq_id",
        f"expected a request id in [0, num_seqs = {num_seqs})",
        (q_seq_id >= 0) & (q_seq_id < num_seqs),
        q_seq_id,
        0,
    )
    # Slots holding tokens: slot g of request r is live iff g < base_r + ceil(seq_r / P).
    g = xp.arange(total_pages)
    base = cu // page_size
    owner = xp.clip(xp.searchsorted(base[1:], g, side="right"), 0, max(num_seqs - 1, 0))
    if num_seqs:
        live_end = base[:-1] + (xp.maximum(seq_lens, 0) + page_size - 1) // page_size
        live = (g >= base[owner]) & (g < live_end[owner])
    else:
        live = g < 0
    yield (
        "page_indices",
        f"expected a physical page in [0, num_pages = {num_pages}) for every page-table "
        "slot that holds a request's tokens",
        ~live | ((page_indices >= 0) & (page_indices < num_pages)),
        page_indices,
        0,
    )
    # One request's token-holding slots name distinct pages: sort (request, page) keys
    # (spare slots get unique negative keys) and flag a key equal to the one before it,
    # i.e. the later of two slots.
    page_key = owner * (num_pages + 2) + xp.clip(page_indices, -1, num_pages) + 1
    key = xp.where(live, page_key, -1 - g)
    order = xp.argsort(key, stable=True)
    sorted_key = key[order]
    repeat_sorted = xp.concatenate([xp.zeros((min(total_pages, 1),), bool),
                                    sorted_key[1:] == sorted_key[:-1]])  # fmt: skip
    repeat = repeat_sorted[xp.argsort(order, stable=True)]
    yield (
        "page_indices",
        "expected a page not already named by an earlier token-holding slot of the same "
        "request (a request's pages are distinct)",
        ~repeat,
        page_indices,
        0,
    )
    if cu_q_lens is not None:
        yield "cu_q_lens", "expected cu_q_lens[0] == 0", cu_q_lens[:1] == 0, cu_q_lens[:1], 0
        yield _non_decreasing("cu_q_lens", cu_q_lens)
        yield (
            "cu_q_lens",
            f"expected the last entry == the number of query tokens T = {num_tokens}",
            cu_q_lens[-1:] == num_tokens,
            cu_q_lens[-1:],
            cu_q_lens.shape[0] - 1,
        )


def check_ragged_metadata(
    *,
    q_seq_id=None,
    seq_lens,
    cu_kv_lens,
    page_indices,
    page_size: int,
    num_pages: int,
    cu_q_lens=None,
    num_tokens: int | None = None,
    debug_checks: bool = False,
) -> None:
    """Check the ragged tables (rules in the module docstring) before launch.

    Host values are always checked (``ValueError`` on the first broken rule). Traced
    values are checked only with ``debug_checks=True``, through ``checkify``. Shapes
    and dtypes must already be validated (``check_sparse_mla_inputs`` /
    ``check_prefill_inputs``). ``q_seq_id`` may be omitted when it is derived from
    ``cu_q_lens`` (the wrappers).
    """
    arrays = (q_seq_id, seq_lens, cu_kv_lens, page_indices, cu_q_lens)
    present = [a for a in arrays if a is not None]
    if q_seq_id is None:
        q_seq_id = np.zeros((0,), np.int32)
    if is_concrete(*present):
        host = [None if a is None else np.asarray(a).astype(np.int64) for a in arrays]
        host[0] = np.asarray(q_seq_id).astype(np.int64)
        for name, rule, ok, values, first in _rules(
            np, *host, page_size=page_size, num_pages=num_pages, num_tokens=num_tokens
        ):
            bad = np.flatnonzero(~np.asarray(ok))
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"{name}: entry {first + i} is {int(np.asarray(values)[i])}, {rule}"
                )
        return
    if not debug_checks:
        return
    traced = [None if a is None else jnp.asarray(a, jnp.int32) for a in arrays]
    traced[0] = jnp.asarray(q_seq_id, jnp.int32)
    for name, rule, ok, values, first in _rules(
        jnp, *traced, page_size=page_size, num_pages=num_pages, num_tokens=num_tokens
    ):
        if ok.size == 0:
            continue
        i = jnp.argmin(ok)  # the first False when any
        checkify.check(
            jnp.all(ok),
            f"{name}: entry {{i}} is {{v}}, {rule}",
            i=(i + first).astype(jnp.int32),
            v=values[i].astype(jnp.int32),
        )


def check_unit_indices(indices, num_units: int, *, debug_checks: bool) -> None:
    """With ``debug_checks``: checkify that every index is ``-1`` or in ``[0, num_units)``.

    Out-of-range ids are defined (no selection, never read), so host values are not
    refused; this is the debug path that finds an indexer bug.
    """
    if not debug_checks:
        return
    indices = jnp.asarray(indices)
    if indices.size == 0:
        return
    checkify.check(
        jnp.all((indices >= -1) & (indices < num_units)),
        "indices out of range: need -1 <= index < {n}",
        n=jnp.asarray(num_units, jnp.int32),  # checkify formats arrays only, not ints
    )


def _int_vector(x, name: str, hint: str, size: int | None = None) -> int:
    """Check that ``x`` is an integer ``[n]`` array (``n == size`` when given); return ``n``."""
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: got {type(x).__name__}, expected an integer array {hint}")
    if len(shape) != 1 or (size is not None and shape[0] != size):
        raise ValueError(f"{name}: got shape {tuple(shape)}, expected {hint}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: got dtype {x.dtype}, expected an integer dtype")
    return int(shape[0])


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["q_seq_id", "seq_lens", "cu_kv_lens", "page_indices"],
    meta_fields=["page_size"],
)
@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """The paged-cache metadata of a packed ragged batch, validated (a pytree).

    ``q_seq_id [T]`` request of each packed query token, ``seq_lens [R]``, page-aligned
    ``cu_kv_lens [R + 1]``, ``page_indices [N]`` and the static ``page_size``; the rules
    are in this module's docstring. Build it with :func:`ragged_batch`, which checks
    them once on the host (or under ``checkify`` with ``debug_checks``); every backend
    then reads the same validated tables.
    """

    q_seq_id: jax.Array
    seq_lens: jax.Array
    cu_kv_lens: jax.Array
    page_indices: jax.Array
    page_size: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def total_pages(self) -> int:
        """The page table's length (request-local page ids lift to ``[0, N)``)."""
        return int(self.page_indices.shape[0])

    def as_kwargs(self) -> dict:
        """``page_size``, ``q_seq_id``, ``seq_lens``, ``cu_kv_lens``, ``page_indices``."""
        return {
            "page_size": self.page_size,
            "q_seq_id": self.q_seq_id,
            "seq_lens": self.seq_lens,
            "cu_kv_lens": self.cu_kv_lens,
            "page_indices": self.page_indices,
        }


def ragged_batch(
    *,
    seq_lens,
    cu_kv_lens,
    page_indices,
    page_size: int,
    num_pages: int,
    num_tokens: int,
    q_seq_id=None,
    cu_q_lens=None,
    debug_checks: bool = False,
) -> RaggedBatch:
    """Validate the ragged tables once and return them as a :class:`RaggedBatch`.

    Give ``q_seq_id [T]`` (sparse MLA's ragged mode) or ``cu_q_lens [R + 1]`` (the
    write-then-attend wrappers; ``q_seq_id`` is derived from it). Shapes and integer
    dtypes always; the values when they are host values, or under ``checkify`` with
    ``debug_checks`` (:func:`check_ragged_metadata`). ``page_size`` must already be
    validated; ``num_pages`` is the cache's page count, ``num_tokens`` the query count.
    """
    num_seqs = _int_vector(seq_lens, "seq_lens", "[num_seqs]")
    _int_vector(cu_kv_lens, "cu_kv_lens", f"[num_seqs + 1 = {num_seqs + 1}]", num_seqs + 1)
    _int_vector(page_indices, "page_indices", "[total_pages]")
    if cu_q_lens is not None:
        _int_vector(cu_q_lens, "cu_q_lens", f"[num_seqs + 1 = {num_seqs + 1}]", num_seqs + 1)
    if q_seq_id is not None:
        _int_vector(q_seq_id, "q_seq_id", f"[S = {num_tokens}] (one per query token)", num_tokens)
    check_ragged_metadata(
        q_seq_id=q_seq_id,
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
        page_size=page_size,
        num_pages=num_pages,
        cu_q_lens=cu_q_lens,
        num_tokens=num_tokens if cu_q_lens is not None else None,
        debug_checks=debug_checks,
    )
    if q_seq_id is None:
        q_seq_id = seq_id_from_cu_q_lens(jnp.asarray(cu_q_lens), num_tokens)
    return RaggedBatch(q_seq_id, seq_lens, cu_kv_lens, page_indices, page_size)


def seq_id_from_cu_q_lens(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Request id of each packed query token, ``[num_tokens]`` int32 (clipped to a request)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = cu_q_lens.shape[0] - 1
    sid = jnp.searchsorted(cu_q_lens[1:].astype(jnp.int32), t, side="right")
    return jnp.clip(sid, 0, num_seqs - 1).astype(jnp.int32)
