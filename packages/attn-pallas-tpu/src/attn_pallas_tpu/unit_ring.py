"""The VMEM ring every TPU sparse-MLA kernel reads its KV units through, and the step
tables of the per-query kernels.

A *store* is the KV cache as the kernels see it in HBM (``_prep.Store``):

* ``rows``: 2-D row arrays ``[R, W]``; a unit is ``read_block`` rows from row ``addr``.
  The flat cache (``[R, Dk]``, its own width) and an FP8 cache (``latent [R, 512]`` and bf16
  ``side [R, 128]``, dequantized in VMEM: ``fp8_rows``).
* ``pages``: the paged cache in its own layout ``[P, PS / pk, pk, Dk_pad]`` (``pk`` tokens
  of a 32-bit word per packed row: 2 for bf16, 1 for float32), read in place; a unit is
  page ``addr``. (Reshaping it to rows would relayout the whole pool on every call: the
  ``(pk, 128)`` tiles of the 4-D array are not the 2-D array's ``(16, 128)`` ones.)

A ring holds ``S`` slots of ``G`` units (``config.SparseMlaConfig``). Entry ``e`` of a
step is one DMA per store array into slot rows ``[e * RB, (e + 1) * RB)``, all entries
of a slot signalling the slot's DMA semaphore (one per array). Every step starts all
``G`` copies without a branch, an entry that holds no unit re-copying the step's first
unit (its rows are masked), and waits once for the slot's bytes
(:meth:`UnitRing.wait_slot`).
:meth:`UnitRing.words` reads a slot as 32-bit words ``[G * RB / pk, Dk_pad]``:
word row ``i`` packs tokens ``i * pk .. i * pk + pk - 1`` (low half first), for both
kinds (a bf16 row array's ``(16, 128)`` tile packs row pairs the same way), so one
integer AND masks rows and feature lanes without touching their values, and a bitcast
gives the ``[G * RB, Dk_pad]`` rows in token order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_pallas_tpu.config import MEMBER_TILE
from attn_pallas_tpu.fp8_rows import dequantize_rows

FAR = 1 << 30  # position of a step entry that holds no unit: never < any lim
_LO, _HI, _ALL = 0x0000FFFF, 0xFFFF0000, 0xFFFFFFFF


class Store(NamedTuple):
    """The KV store in HBM: ``kind`` "rows" (``arrays`` 2-D) or "pages" (one 4-D array)."""

    kind: str
    arrays: tuple

    @property
    def packing(self) -> int:
        """Tokens per 32-bit word of the rows the MXU takes (2 for bf16 / FP8, 1 f32)."""
        return 4 // jnp.dtype(self.dtype).itemsize

    @property
    def dtype(self):
        """The compute dtype of the rows (bf16 for an FP8 store)."""
        return jnp.dtype(jnp.bfloat16) if len(self.arrays) == 2 else self.arrays[0].dtype

    @property
    def width(self) -> int:
        """Features of a row as the kernels compute on it (the flat cache's ``Dk``, a paged
        cache's ``Dk_pad``, 640 for an FP8 store)."""
        if len(self.arrays) == 2:
            return sum(a.shape[-1] for a in self.arrays)  # FP8: 512 latent + 128 side lanes
        return self.arrays[0].shape[-1]

    @property
    def row_bytes(self) -> int:
        """HBM bytes DMA'd per token."""
        return sum(a.shape[-1] * jnp.dtype(a.dtype).itemsize for a in self.arrays)

    def num_blocks(self, rb: int) -> int:
        """Units the store holds."""
        a = self.arrays[0]
        return a.shape[0] if self.kind == "pages" else a.shape[0] // rb


def in_hbm(*arrays) -> tuple:
    """``arrays`` constrained to HBM as a kernel's operands (the ones it DMAs from).
    Without it XLA may place an operand that is a temporary of the same program (the
    cache relaid out from its parameter layout, a padded copy) in VMEM, and the ring's
    copies from there are slower than from HBM."""
    return tuple(pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in arrays)


def ring_scratch(store: Store, *, rb: int, group: int, slots: int) -> list:
    """VMEM ring buffers for ``store`` (one per array), then the DMA semaphores
    ``[len(arrays), slots]``."""
    if store.kind == "pages":
        (a,) = store.arrays
        _, rows, pk, width = a.shape
        bufs = [pltpu.VMEM((slots, group * rows, pk, width), a.dtype)]
    else:
        bufs = [pltpu.VMEM((slots, group * rb, a.shape[-1]), a.dtype) for a in store.arrays]
    return [*bufs, pltpu.SemaphoreType.DMA((len(store.arrays), slots))]


class UnitRing:
    """The kernel-side view of a ring (:func:`ring_scratch`) over a store's HBM refs.

    ``interpret``: the kernel runs in TPU interpret mode, which has no ref bitcast; the
    one place the kernels' code differs there (:meth:`words`)."""

    def __init__(self, kind: str, hbm, bufs, sems, *, rb: int, interpret: bool):
        self.kind, self.hbm, self.bufs, self.sems, self.rb = kind, hbm, bufs, sems, rb
        self.interpret = interpret

    def _copies(self, addr, slot, entry: int):
        slot = jnp.int32(slot)  # int32 indices, also for a Python int under jax_enable_x64
        out = []
        for i, (h, b) in enumerate(zip(self.hbm, self.bufs, strict=True)):
            if self.kind == "pages":
                n = h.shape[1]  # packed rows of a page
                src, dst = h.at[addr], b.at[slot, pl.ds(entry * n, n)]
            else:  # a unit starts at a multiple of read_block: say so, so the offset lowers
                row = pl.multiple_of(addr, math.gcd(self.rb, 32))
                src, dst = h.at[pl.ds(row, self.rb)], b.at[slot, pl.ds(entry * self.rb, self.rb)]
            out.append(pltpu.make_async_copy(src, dst, self.sems.at[jnp.int32(i), slot]))
        return out

    def start(self, addr, slot, entry: int) -> None:
        for c in self._copies(addr, slot, entry):
            c.start()

    def wait(self, addr, slot, entry: int) -> None:
        for c in self._copies(addr, slot, entry):
            c.wait()

    def wait_slot(self, slot) -> None:
        """Wait for all ``G`` entries' copies into ``slot``: one wait per array for the
        whole slot's bytes (a wait takes its byte count from the destination)."""
        slot = jnp.int32(slot)
        for i, b in enumerate(self.bufs):
            pltpu.make_async_copy(b.at[slot], b.at[slot], self.sems.at[jnp.int32(i), slot]).wait()

    @property
    def storable(self) -> bool:
        """Whether :meth:`store_entry_words` can write a slot's words back (not an FP8
        store, whose slot :meth:`words` dequantizes into a value)."""
        return len(self.bufs) == 1

    def _entry_rows(self) -> int:
        """Ring rows of one entry (``RB`` rows; a page's ``PS / pk`` packed rows)."""
        return self.hbm[0].shape[1] if self.kind == "pages" else self.rb

    def entry_words(self, slot, entry: int) -> jax.Array:
        """Entry ``entry`` of ``slot`` as uint32 words ``[RB / pk, Dk_pad]`` (rows ``[entry
        * RB / pk, (entry + 1) * RB / pk)`` of :meth:`words`). Not for an FP8 store."""
        (buf,) = self.bufs
        n = self._entry_rows()
        rows = pl.ds(entry * n, n)
        if self.kind == "rows":
            return pltpu.bitcast(buf[slot, rows, :], jnp.uint32)
        if self.interpret:
            v = buf[slot, rows]  # [PS / pk, pk, D]
            return pltpu.bitcast(v.reshape(-1, v.shape[-1]), jnp.uint32)
        view = buf.bitcast(jnp.uint32).at[slot]  # [G PS / pk, 1, D]
        return view.reshape(view.shape[0], view.shape[2])[rows, :]

    def store_entry_words(self, slot, entry: int, words) -> None:
        """Write ``words`` (as :meth:`entry_words` reads them) back into the entry."""
        (buf,) = self.bufs
        n = self._entry_rows()
        rows = pl.ds(entry * n, n)
        if self.kind == "rows":
            buf[slot, rows, :] = pltpu.bitcast(words, buf.dtype)
        elif self.interpret:
            buf[slot, rows] = pltpu.bitcast(words, buf.dtype).reshape(n, *buf.shape[2:])
        else:
            view = buf.bitcast(jnp.uint32).at[slot]
            view.reshape(view.shape[0], view.shape[2])[rows, :] = words

    def words(self, slot) -> jax.Array:
        """The slot as uint32 words ``[G * RB / pk, Dk_pad]`` (FP8: dequantized first)."""
        if len(self.bufs) == 2:
            rows = dequantize_rows(self.bufs[0][slot], self.bufs[1][slot])
            return pltpu.bitcast(rows, jnp.uint32)
        (buf,) = self.bufs
        if self.kind == "rows":  # [G RB, D]: a (16, 128) bf16 tile packs row pairs
            return pltpu.bitcast(buf[slot], jnp.uint32)
        if self.interpret:  # values: the packed rows in token order
            v = buf[slot]  # [G PS / pk, pk, D]
            return pltpu.bitcast(v.reshape(-1, v.shape[-1]), jnp.uint32)
        # The (pk, 128) tiles hold a word row's pk tokens in one 32-bit word: read the
        # words as they lie (tpu-inference's paged-attention idiom).
        view = buf.bitcast(jnp.uint32).at[slot]  # [G PS / pk, 1, D]
        return view.reshape(view.shape[0], view.shape[2])[...]


def entry_positions(kbs, *, rb: int, shape, axis: int, stride: int = 1) -> jax.Array:
    """Global key position of token ``t = stride * iota(axis)`` of a step whose entry
    ``e`` starts at position ``kbs[e]`` (``FAR`` for an entry with no unit): ``kbs[e] + t
    - e * rb`` for ``e = t // rb``. ``len(kbs)`` selects, no division."""
    t = jax.lax.broadcasted_iota(jnp.int32, shape, axis) * stride
    base = jnp.full(shape, FAR, jnp.int32)
    for e, kb in enumerate(kbs):
        base = jnp.where(t >= e * rb, kb - e * rb, base)
    return base + t


def lane_tile(x, times: int):
    """``[1, n] -> [1, times * n]`` by lane concatenation (row r reads x[r % n]): a
    query-blocked program's per-query lane row for its ``times`` heads."""
    return x if times == 1 else jnp.concatenate([x] * times, axis=1)


def slot_rooms(mem_ref, j, kbs, lim, heads_per_group: int) -> list:
    """The query-blocked kernels' per-slot limits, ``[1, rows]`` int32 lane rows for union
    slots ``j .. j + g - 1`` of the chunk (``g = len(kbs)`` divides 32 and ``j``): key
    ``r`` of slot ``e`` is valid for a score row iff ``r < room``, where ``room = lim -
    kbs[e]`` if the row's query selected the slot, else 0. ``mem_ref``: the chunk's
    ``[1, 1, W, QB]`` int32 membership words (bit ``j % 32`` of row ``j // 32``), read as
    the aligned 8-row window holding row ``j // 32`` and a select; ``lim`` ``[1, QB]``.
    Built at ``QB`` lanes, then tiled over the heads."""
    w = jax.lax.div(j, jnp.int32(MEMBER_TILE))
    w0 = pl.multiple_of(jax.lax.div(w, jnp.int32(8)) * 8, 8)
    win = mem_ref[0, 0, pl.ds(w0, 8), :]  # [8, QB]
    win_row = jax.lax.broadcasted_iota(jnp.int32, (8, 1), 0)
    low = jnp.iinfo(jnp.int32).min  # below or equal to every word: max picks the row
    word = jnp.max(jnp.where(win_row == w - w0, win, low), axis=0, keepdims=True)  # [1, QB]
    bit0 = j - w * MEMBER_TILE
    out = []
    for e, kb in enumerate(kbs):
        bit = jnp.left_shift(jnp.int32(1), bit0 + e)  # a scalar: bit 31 is INT32_MIN
        member = (word & bit) != 0
        out.append(lane_tile(jnp.where(member, lim - kb, 0), heads_per_group))
    return out


def keep_words(pos_first, lim, pk: int) -> jax.Array:
    """uint32 AND masks of the word rows whose first token is at ``pos_first``: each
    token's bits kept iff its position ``< lim``."""
    if pk == 1:
        return jnp.where(pos_first < lim, jnp.uint32(_ALL), jnp.uint32(0))
    lo = jnp.where(pos_first < lim, jnp.uint32(_LO), jnp.uint32(0))
    hi = jnp.where(pos_first + 1 < lim, jnp.uint32(_HI), jnp.uint32(0))
    return lo | hi


def feature_words(width: int, dk: int) -> jax.Array | None:
    """uint32 AND mask ``[1, width]`` of the features ``< dk`` (``None`` if all are)."""
    if dk >= width:
        return None
    feat = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    return jnp.where(feat < dk, jnp.uint32(_ALL), jnp.uint32(0))


def rows_of(words, dtype, *masks) -> jax.Array:
    """``words`` ANDed with every mask that is not ``None``, as ``dtype`` rows."""
    for m in masks:
        if m is not None:
            words = words & m
    return pltpu.bitcast(words, dtype)


# ----------------------------------------------------------------- per-query step tables


class QuerySteps(NamedTuple):
    """The per-query kernels' tables for programs of ``QP`` queries (all int32).

    meta:  ``[P, 1, 1 + 2 QP]``: the program's step count, then ``count`` and ``lim`` of
      each of its queries.
    steps: ``[P, 1, 3 T]``: per step its query (0..QP-1), then its first unit index,
      then whether it is *clean* (1: its ``G`` entries hold units whose every token is
      ``< lim``, so no row of its slot needs masking); ``T = QP * ceil(K / G)``.
    addr / kb: ``[P, 1, QP Kg]``: each query's compacted unit addresses and first token
      positions (query ``i``'s unit ``j`` at ``i * Kg + j``), ``K`` rounded up to ``Kg``,
      a multiple of ``G``, so a step's ``G`` entries are consecutive. An entry past the
      query's count holds ``kb = FAR`` and its step's first unit's address, which the
      step re-copies (its rows are masked): the kernels read both without a branch or
      a select.
    """

    meta: jax.Array
    steps: jax.Array
    addr: jax.Array
    kb: jax.Array


def query_steps(addr, kb, count, lim, *, qp: int, group: int, rb: int) -> QuerySteps:
    """Step tables from the compacted per-query lists ``addr, kb [N, K]``, ``count
    [N]``, ``lim [N]`` (``N`` a multiple of ``qp``) of ``rb``-token units: a query's
    units in steps of ``group``, its steps consecutive, the program's queries in order."""
    n, k = addr.shape
    p = n // qp
    k = -(-k // group) * group  # Kg
    addr, kb = (jnp.pad(x, ((0, 0), (0, k - x.shape[1]))) for x in (addr, kb))
    j = jnp.arange(k, dtype=jnp.int32)
    live = j[None, :] < count[:, None]
    addr = jnp.where(live, addr, addr[:, j // group * group])  # the step's first unit
    kb = jnp.where(live, kb, FAR)
    whole = (kb + rb <= lim[:, None]).reshape(n, k // group, group).all(axis=-1)  # [N, Kg/G]
    per_query = (count + group - 1) // group  # [N]
    per_query = per_query.reshape(p, qp)
    ends = jnp.cumsum(per_query, axis=1)  # [P, QP]
    t_max = qp * (-(-k // group))
    t = jnp.arange(t_max, dtype=jnp.int32)
    query = jnp.sum(t[None, None, :] >= ends[:, :, None], axis=1).astype(jnp.int32)  # [P, T]
    query = jnp.minimum(query, qp - 1)
    starts = ends - per_query
    first = (t[None, :] - jnp.take_along_axis(starts, query, axis=1)) * group
    meta = jnp.concatenate([ends[:, -1:], count.reshape(p, qp), lim.reshape(p, qp)], axis=1).astype(
        jnp.int32
    )
    row = jnp.arange(p, dtype=jnp.int32)[:, None] * qp + query  # [P, T]: the query's row
    clean = whole[row, jnp.minimum(first // group, k // group - 1)].astype(jnp.int32)
    steps = jnp.concatenate([query, first.astype(jnp.int32), clean], axis=1)
    return QuerySteps(
        meta.reshape(p, 1, -1),
        steps.reshape(p, 1, -1),
        addr.reshape(p, 1, qp * k),
        kb.reshape(p, 1, qp * k),
    )


def query_step_specs(tables: QuerySteps) -> list:
    """SMEM blocks of program ``i`` of each :class:`QuerySteps` table."""

    def spec(a):
        return pl.BlockSpec((1, 1, a.shape[-1]), lambda i: (i, 0, 0), memory_space=pltpu.SMEM)

    return [spec(a) for a in tables]


class RingWalk:
    """Steps through a ring: ``entries(t)`` gives step ``t``'s ``G`` entries as
    ``(addr, kb, live)`` (``kb = FAR`` where dead); steps start ``S - 1`` ahead."""

    def __init__(self, ring: UnitRing, entries, n_steps, *, slots: int):
        self.ring, self.entries, self.n_steps, self.slots = ring, entries, n_steps, slots

    def _start(self, t, slot):
        """Start step ``t``'s copies into ``slot``: all ``G`` without a branch, an entry
        without a unit re-copying the step's first (a step has at least one live entry,
        and entries are live in order; ``live`` is ``None`` where the entries already
        name that unit); one ``wait_slot`` then takes the slot's bytes."""
        entries = self.entries(t)
        first = entries[0][0]
        for e, (addr, _, live) in enumerate(entries):
            self.ring.start(addr if live is None else jnp.where(live, addr, first), slot, e)

    def prologue(self):
        """Start steps ``0 .. S - 2`` that exist, for :meth:`advance`."""
        for d in range(self.slots - 1):

            @pl.when(d < self.n_steps)
            def _(d=d):
                self._start(d, d)

    def fill(self):
        """The prologue of :meth:`start_ahead`'s order: steps ``0 .. S - 2``, each
        clamped to the last step, into slots ``0 .. S - 2``, under one branch (a program
        without steps starts nothing)."""
        last = self.n_steps - 1

        @pl.when(self.n_steps > 0)
        def _():
            for d in range(self.slots - 1):
                self._start(jnp.minimum(jnp.int32(d), last), d)

    def start_ahead(self, t):
        """Start step ``t + S - 1`` into its slot, the one step ``t - 1`` read, without a
        branch: past the program's last step the copy repeats that step (rows nobody
        reads), so the program's last ``S - 1`` steps start ``S - 1`` spare copies, which
        :meth:`drain` waits for. After :meth:`fill` only."""
        nxt = t + self.slots - 1
        step = jnp.minimum(nxt, self.n_steps - 1)
        self._start(step, jax.lax.rem(nxt, jnp.int32(self.slots)))

    def drain(self):
        """Wait for the spare copies :meth:`start_ahead` started past the last step."""

        @pl.when(self.n_steps > 0)
        def _():
            for d in range(self.slots - 1):
                self.ring.wait_slot(jax.lax.rem(self.n_steps + d, jnp.int32(self.slots)))

    def wait(self, t):
        """Wait for step ``t``'s copies; returns its slot."""
        slot = jax.lax.rem(t, jnp.int32(self.slots))
        self.ring.wait_slot(slot)
        return slot

    def advance(self, t):
        """After :meth:`prologue`: start step ``t + S - 1``, if there is one, and wait for
        step ``t``; returns ``t``'s slot. Nothing is left to drain."""
        nxt = t + self.slots - 1

        @pl.when(nxt < self.n_steps)
        def _():
            self._start(nxt, jax.lax.rem(nxt, jnp.int32(self.slots)))

        return self.wait(t)

    def words(self, t, slot, *, rb: int, dtype, lim=None, dk: int | None = None):
        """The step's rows ``[G RB, Dk_pad]`` as ``dtype``: zero where a token's position
        is ``>= lim`` (entries without a unit always: their ring rows are stale) and, with
        ``dk``, in the feature padding; plus the kb of each entry."""
        kbs = [kb for _, kb, _ in self.entries(t)]
        words = self.ring.words(slot)
        pk = 4 // jnp.dtype(dtype).itemsize  # tokens per word row
        pos = entry_positions(kbs, rb=rb, shape=(words.shape[0], 1), axis=0, stride=pk)
        feat = None if dk is None else feature_words(words.shape[1], dk)
        keep = keep_words(pos, FAR if lim is None else lim, pk)
        return rows_of(words, dtype, keep, feat), kbs


class UnionWalk(RingWalk):
    """A query-blocked program's walk over ``count`` union slots of its chunk, ``group``
    a step, from the chunk's SMEM tables ``kb_ref`` / ``addr_ref`` ``[1, 1, 1, UC]``
    (first token position and store address of each slot); slots past ``count`` start
    no copy and have ``kb = FAR``. Shared by the forward and backward kernels."""

    def __init__(self, ring: UnitRing, kb_ref, addr_ref, count, *, group: int, slots: int):
        self.kb, self.addr, self.count, self.g = kb_ref, addr_ref, count, group
        n_steps = jax.lax.div(count + group - 1, jnp.int32(group))  # //: through sign()
        super().__init__(ring, self._entries, n_steps, slots=slots)

    def _entries(self, t):
        u_chunk, out = self.kb.shape[-1], []
        for e in range(self.g):
            j = jnp.minimum(t * self.g + e, u_chunk - 1)
            live = t * self.g + e < self.count
            kb = jnp.where(live, self.kb[0, 0, 0, j], FAR)
            out.append((self.addr[0, 0, 0, j], kb, live))
        return out


class StepWalk(RingWalk):
    """A per-query program's steps over the :class:`QuerySteps` tables: step ``t``
    covers units ``first_unit(t) ..`` of query ``query(t)`` (shared with the dq kernel)."""

    def __init__(self, tables, ring: UnitRing, *, qp: int, top_k: int, group: int, slots: int):
        self.meta, self.steps, self.addr, self.kb = tables
        self.qp, self.k, self.g = qp, top_k, group
        self.t_max = self.steps.shape[-1] // 3
        super().__init__(ring, self._entries, self.meta[0, 0, 0], slots=slots)

    def query(self, t):
        return self.steps[0, 0, t]

    def first_unit(self, t):
        return self.steps[0, 0, self.t_max + t]

    def clean(self, t):
        """Whether step ``t``'s slot has no row to mask (:class:`QuerySteps`)."""
        return self.steps[0, 0, 2 * self.t_max + t] != 0

    def count(self, i):
        return self.meta[0, 0, 1 + i]

    def lim(self, i):
        return self.meta[0, 0, 1 + self.qp + i]

    def last(self, t):
        """Whether step ``t`` is its query's last."""
        return self.first_unit(t) + self.g >= self.count(self.query(t))

    def _entries(self, t):
        """Step ``t``'s entries as the tables hold them (:class:`QuerySteps`: an entry
        past the count already names the step's first unit and ``FAR``): two SMEM loads
        an entry; ``live`` is ``None``."""
        base = self.query(t) * self.k + self.first_unit(t)
        return [(self.addr[0, 0, base + e], self.kb[0, 0, base + e], None) for e in range(self.g)]

    def words(self, t, slot, *, rb: int, dtype, lim=None, dk: int | None = None):
        """:meth:`RingWalk.words`, masked in place in its slot and only where needed: a
        clean step's rows go to the products as copied; on a step that is not, each
        entry holding a token at or past ``lim`` (or no unit) is masked alone, in its own
        rows of the slot (at most one unit of a query straddles its ``lim``; an entry
        wholly past it is zeroed without a read). A paged cache's feature padding is
        masked either way; an FP8 store masks every step as :class:`RingWalk` does."""
        if not self.ring.storable:
            return super().words(t, slot, rb=rb, dtype=dtype, lim=lim, dk=dk)
        kbs = [kb for _, kb, _ in self.entries(t)]
        pk = 4 // jnp.dtype(dtype).itemsize  # tokens per word row
        lim = FAR if lim is None else lim

        @pl.when(jnp.logical_not(self.clean(t)))
        def _():
            for e, kb in enumerate(kbs):
                self._mask_entry(slot, e, kb, lim, rb=rb, pk=pk)

        words = self.ring.words(slot)
        feat = None if dk is None else feature_words(words.shape[1], dk)
        return rows_of(words, dtype, feat), kbs

    def _mask_entry(self, slot, e: int, kb, lim, *, rb: int, pk: int) -> None:
        """Zero the tokens at or past ``lim`` of entry ``e`` (first position ``kb``)."""

        @pl.when(kb >= lim)  # no token kept (an entry without a unit has kb = FAR)
        def _():
            shape = (rb // pk, self.ring.bufs[0].shape[-1])
            self.ring.store_entry_words(slot, e, jnp.zeros(shape, jnp.uint32))

        @pl.when(jnp.logical_and(kb < lim, kb + rb > lim))  # straddles lim
        def _():
            words = self.ring.entry_words(slot, e)
            pos = kb + jax.lax.broadcasted_iota(jnp.int32, (words.shape[0], 1), 0) * pk
            self.ring.store_entry_words(slot, e, words & keep_words(pos, lim, pk))
