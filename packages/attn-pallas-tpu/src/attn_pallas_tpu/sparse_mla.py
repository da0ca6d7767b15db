"""Per-query sparse-MLA prefill kernel (flat and ragged paged KV), Pallas Mosaic TPU.

Schedule. The grid has one program per query (``B * S`` programs, all independent:
``parallel``). Before the kernel, plain ``jnp`` turns each query's ``K`` selections into
a compact list of distinct units, sorted by store row: duplicates and invalid ids
(``-1``, out of range, a page-table slot past the request's extent or a physical page
outside the cache) are dropped there, so the kernel walks ``count <= K`` units and
selections are sets by construction. The per-query list travels in SMEM (one block of
the table per program):

* ``src``  ``[N, 1, K]``: first store row of each unit, divided by 8;
* ``kb``   ``[N, 1, K]``: global position of the unit's first token;
* ``meta`` ``[N, 1, 2]``: ``(count, lim)``; key position ``p`` is valid iff ``p < lim``.

The KV store ``[R, Dk_pad]`` stays in HBM (``memory_space=HBM``). The program copies
unit ``j`` (``read_block`` rows starting at row ``src[j] * 8``) into slot ``j % NBUF``
of a VMEM ring ``[NBUF, read_block, Dk_pad]``; slot ``s`` signals DMA semaphore
``sem[0, s]``. The prologue starts units ``0 .. NBUF-2``; iteration ``j`` starts unit
``j + NBUF - 1`` into the slot iteration ``j - 1`` finished reading, then waits for unit
``j`` and computes on it, so ``NBUF - 1`` copies are in flight behind the compute. Every
started copy is waited for before the program ends.

FP8 latent cache (``attn_common.Fp8LatentCache``; ``fp8_rows``). The store is two HBM
arrays, the FP8 latent rows ``[R, 512]`` and the bf16 side rows ``[R, 128]`` (rope and
the scales' exact bf16 parts), with a ring each; a unit's copy is one DMA per array into
the same slot, on semaphores ``sem[0, s]`` and ``sem[1, s]`` (:class:`UnitRows`). After
the wait the slot is dequantized in VMEM (``fp8_rows.dequantize_rows``: ``bf16(latent *
scale)`` per 128-group, the rope, zero lanes to ``Dk_pad = 640``) and the rest is the
bf16 path: 768 HBM bytes per token instead of 1,280, the query in bf16.

Compute per unit: scores ``q [H, Dk_pad] . k^T -> [H, RB]`` in float32, the mask
``kb[j] + r < lim`` (causal and kv_len; the unit's selection is implied by the list),
then an online softmax over the units. The value rows of invalid keys are zeroed before
the ``P V`` product: a cache row no query may see (a page tail past ``seq_len``, an
unwritten or recycled slot) may hold NaN or Inf, and ``0 * NaN`` would otherwise reach
the output. Rows that have seen no valid key keep
``m = -inf``; the exponent uses ``m`` replaced by 0 there, so ``exp(-inf - 0) = 0`` and
no ``-inf - -inf`` NaN appears. The output is ``acc / l`` (0 where ``l == 0``) and the
LSE ``m + log(l)`` in natural log (``-inf`` where ``l == 0``), both always written.

The per-query kernel re-fetches a unit once for every query that selected it; the
query-blocked kernel (``sparse_mla_qblock``) fetches each unit once per block of queries.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common.paged import check_fp8_dequantize
from attn_common.spec import SparseMlaCall, public_op, sparse_mla_call
from attn_pallas_tpu._mxu import mxu_dot
from attn_pallas_tpu._prep import (
    SUBLANE,
    compact_units,
    fp8_copy,
    pad_features,
    query_dtype,
    query_table_specs,
    require_tpu_kernels,
    resolve_interpret,
    store_arrays,
    unit_space,
    vmem_limit,
)
from attn_pallas_tpu.fp8_rows import dequantize_rows
from attn_pallas_tpu.sparse_mla_bwd import sparse_mla_result

NBUF = 4  # DMA ring depth: NBUF - 1 unit copies in flight behind the compute


def row_alignment(rb: int) -> int:
    """What a unit's first store row is provably a multiple of: every unit starts at a
    multiple of ``read_block`` (flat: ``b * Tp + u * RB``; ragged: ``page * page_size``,
    ``page_size == RB``), so at ``gcd(RB, 32)``: 16 or 32 (``RB % 16 == 0``), the bf16
    and the 8-bit sublane tiles (an FP8 latent unit with ``RB % 32 == 0`` is
    tile-aligned)."""
    return math.gcd(rb, 32)


class UnitRows:
    """One unit's KV rows, HBM -> VMEM ring slot -> the rows the MXU takes.

    ``hbm`` is the row store: ``(kv [R, Dk_pad],)``, or ``(latent [R, 512], side [R,
    128])`` for an FP8 cache; ``rings`` its VMEM rings ``[NBUF, RB, width]``, one per
    array, and ``sems`` DMA semaphores ``[len(hbm), NBUF]``. A unit's copy is one DMA per
    array into ring slot ``slot``, signalling ``sems[array, slot]``; :meth:`load` reads
    the slot, dequantizing FP8 rows (``fp8_rows.dequantize_rows``)."""

    def __init__(self, hbm, rings, sems, *, rb: int):
        self.hbm, self.rings, self.sems, self.rb = hbm, rings, sems, rb

    def _copies(self, start, slot):
        slot = jnp.int32(slot)  # int32 indices, also for a Python int under jax_enable_x64
        return [
            pltpu.make_async_copy(
                h.at[pl.ds(start, self.rb)], r.at[slot], self.sems.at[jnp.int32(i), slot]
            )
            for i, (h, r) in enumerate(zip(self.hbm, self.rings, strict=True))
        ]

    def start(self, start, slot) -> None:
        for c in self._copies(start, slot):
            c.start()

    def wait(self, start, slot) -> None:
        for c in self._copies(start, slot):
            c.wait()

    def load(self, slot, *, dk: int) -> jax.Array:
        """The slot's rows ``[RB, Dk_pad]``; features past ``dk`` are zero."""
        if len(self.rings) == 2:  # FP8: zeros past the rope by construction
            return dequantize_rows(self.rings[0][slot], self.rings[1][slot])
        kv = self.rings[0][slot]
        dk_pad = kv.shape[-1]
        if dk < dk_pad:  # the paged cache's feature padding may hold anything
            feat = jax.lax.broadcasted_iota(jnp.int32, (1, dk_pad), 1)
            kv = jnp.where(feat < dk, kv, jnp.zeros_like(kv))
        return kv


def unit_rings(store, rb: int) -> list:
    """Scratch for :class:`UnitRows` over ``store`` (a tuple of HBM arrays): one VMEM
    ring ``[NBUF, RB, width]`` per array, then the DMA semaphores ``[len(store), NBUF]``."""
    rings = [pltpu.VMEM((NBUF, rb, a.shape[-1]), a.dtype) for a in store]
    return [*rings, pltpu.SemaphoreType.DMA((len(store), NBUF))]


def ring_bytes(store, rb: int) -> int:
    """VMEM bytes of the rings of :func:`unit_rings`."""
    return sum(NBUF * rb * a.shape[-1] * jnp.dtype(a.dtype).itemsize for a in store)


def _per_query_kernel(
    meta_ref,  # SMEM [1, 1, 2]: (count, lim)
    src_ref,  # SMEM [1, 1, K]: first store row // 8 of each unit (compacted)
    kb_ref,  # SMEM [1, 1, K]: global position of each unit's first token
    q_ref,  # VMEM [1, H, Dk_pad]
    *refs,  # HBM row store (1 or 2 arrays); o [1, H, Dv], lse [1, H, 1]; rings, sems
    sm_scale: float,
    dk: int,
    dv: int,
    rb: int,
    n_store: int,
):
    hbm, (o_ref, lse_ref), scratch = (
        refs[:n_store],
        refs[n_store : n_store + 2],
        refs[n_store + 2 :],
    )
    rows = UnitRows(hbm, scratch[:-1], scratch[-1], rb=rb)
    count = meta_ref[0, 0, 0]
    lim = meta_ref[0, 0, 1]
    q = q_ref[0]
    heads = q.shape[0]

    def start_row(j):
        return pl.multiple_of(src_ref[0, 0, j] * SUBLANE, row_alignment(rb))

    for d in range(NBUF - 1):  # prologue: fill the ring

        @pl.when(d < count)
        def _(d=d):
            rows.start(start_row(d), d)

    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, rb), 1)
    key_rows = jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)

    def body(j, carry):
        m_i, l_i, acc = carry
        nxt = j + NBUF - 1

        @pl.when(nxt < count)
        def _():
            rows.start(start_row(nxt), jax.lax.rem(nxt, jnp.int32(NBUF)))

        slot = jax.lax.rem(j, jnp.int32(NBUF))
        rows.wait(start_row(j), slot)
        kv = rows.load(slot, dk=dk)  # [RB, Dk_pad]
        s = mxu_dot(q, kv, (((1,), (1,)), ((), ())))  # [H, RB]
        kb = kb_ref[0, 0, j]
        valid = (kb + lanes) < lim  # [1, RB]
        # Rows past lim (page tails, future tokens) may hold NaN/Inf: zero their values so
        # that p = 0 times garbage cannot reach the output.
        values = jnp.where((kb + key_rows) < lim, kv[:, :dv], jnp.zeros_like(kv[:, :dv]))
        s = jnp.where(valid, s * sm_scale, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1, keepdims=True))  # [H, 1]
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_i - m_safe)  # m_i = -inf -> 0 (acc and l are 0 there anyway)
        l_new = l_i * alpha + jnp.sum(p, axis=1, keepdims=True)
        pv = mxu_dot(p.astype(kv.dtype), values, (((1,), (0,)), ((), ())))
        return m_new, l_new, acc * alpha + pv

    init = (
        jnp.full((heads, 1), -jnp.inf, jnp.float32),
        jnp.zeros((heads, 1), jnp.float32),
        jnp.zeros((heads, dv), jnp.float32),
    )
    m_i, l_i, acc = jax.lax.fori_loop(0, count, body, init)
    empty = l_i == 0.0
    o_ref[0] = acc / jnp.where(empty, 1.0, l_i)
    lse_ref[0] = jnp.where(empty, -jnp.inf, m_i + jnp.log(jnp.where(empty, 1.0, l_i)))


@functools.partial(jax.jit, static_argnames=("sm_scale", "dk", "dv", "rb", "interpret"))
def _per_query_call(q, store, src8, kb, count, lim, *, sm_scale, dk, dv, rb, interpret):
    """``store``: a tuple of HBM row arrays (:class:`UnitRows`)."""
    n, heads, dk_pad = q.shape
    top_k = src8.shape[-1]
    meta = jnp.stack([count, lim], axis=-1).reshape(n, 1, 2)
    kernel = functools.partial(
        _per_query_kernel, sm_scale=sm_scale, dk=dk, dv=dv, rb=rb, n_store=len(store)
    )
    dequantized = rb * dk_pad * 6 if len(store) == 2 else 0  # FP8: f32 products, bf16 rows
    return pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[
            *query_table_specs(top_k),
            pl.BlockSpec((1, heads, dk_pad), lambda i: (i, 0, 0)),
            *[pl.BlockSpec(memory_space=pltpu.HBM) for _ in store],
        ],
        out_specs=[
            pl.BlockSpec((1, heads, dv), lambda i: (i, 0, 0)),
            pl.BlockSpec((1, heads, 1), lambda i: (i, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n, heads, dv), jnp.float32),
            jax.ShapeDtypeStruct((n, heads, 1), jnp.float32),
        ],
        scratch_shapes=unit_rings(store, rb),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=vmem_limit(
                ring_bytes(store, rb),
                dequantized,
                2 * heads * dk_pad * q.dtype.itemsize,
                3 * heads * dv * 4,
                3 * heads * rb * 4,
            ),
        ),
        interpret=interpret,
    )(meta, src8.reshape(n, 1, top_k), kb.reshape(n, 1, top_k), q, *store)


@public_op(sparse_mla_call)
def sparse_mla_attention(call: SparseMlaCall, *, fp8_dequantize: bool | None = None):
    """Sparse MLA attention, one TPU program per query (DeepSeek sparse attention prefill).

    The kernel takes a float32 or bfloat16 cache (the query takes its dtype), or an
    ``Fp8LatentCache`` / ``TpuFp8LatentCache`` (FP8 rows dequantized in VMEM, the query
    in bfloat16; ``attn_pallas_tpu.fp8_rows``), and ``read_block % 16 == 0``; the query-blocked knobs are validated and ignored here
    (``sparse_mla_attention_qblock`` uses them). ``interpret``: ``True`` or a
    ``pltpu.InterpretParams`` runs the kernel in TPU interpret mode (CPU). Empty work
    (``S``, ``K`` or ``T`` = 0) gives ``out == 0``, ``lse == -inf``. Cache rows no query
    attends may hold anything.

    ``fp8_dequantize`` (an FP8 cache only; the same result bits either way): ``None``
    dequantizes in VMEM, or first copies the cache's bf16 rows by XLA (ragged: the pages
    the page table names) where that is cheaper (``_prep.fp8_copy``: prefill over its
    own context takes the copy, decode over long requests reads FP8); ``False`` always
    in VMEM (no copy); ``True`` always the copy.

    Differentiable in ``q`` and ``kv`` (through ``out`` and ``lse``): the backward is two
    Pallas kernels (``attn_pallas_tpu.sparse_mla_bwd``: dq per query, the cache gradient
    over the inverted selection; deterministic). ``return_attn_mass=True``: computed on
    XLA from the kernel's LSE (``attn_mass_from_lse``).
    """
    problem = require_tpu_kernels(call)
    check_fp8_dequantize(fp8_dequantize)
    interpret = resolve_interpret(call.interpret)

    def forward(c: SparseMlaCall):
        kv, ragged = fp8_copy(problem, c.kv, c.ragged_kwargs(), fp8_dequantize)
        return _per_query(
            problem, c.q, kv, c.indices, c.positions, return_lse=True, interpret=interpret,
            **ragged,
        )  # fmt: skip

    return sparse_mla_result(call, forward, interpret=interpret)


def _per_query(problem, q, kv, indices, positions, *, return_lse, interpret, **ragged):
    """The per-query path after validation (also the query-blocked wrapper's fallback)."""
    space = unit_space(
        problem,
        kv,
        indices,
        positions,
        **ragged,
    )
    batch, seq, heads = problem.batch, problem.num_queries, problem.heads
    n = batch * seq
    rb = problem.read_block
    src8, kb, count = compact_units(space.src8, space.keys * rb, space.unit_ok)
    q_pad = pad_features(q.astype(query_dtype(kv)), problem.dk_pad)
    out, lse = _per_query_call(
        q_pad.reshape(n, heads, problem.dk_pad),
        store_arrays(space.store),
        src8.reshape(n, -1),
        kb.reshape(n, -1),
        count.reshape(n),
        space.lim.reshape(n),
        sm_scale=problem.sm_scale,
        dk=problem.dk,
        dv=problem.dv,
        rb=rb,
        interpret=interpret,
    )
    out = out.reshape(batch, seq, heads, problem.dv)
    if not return_lse:
        return out
    return out, lse.reshape(batch, seq, heads)
