"""Per-query sparse-MLA kernel (flat and ragged paged KV), Pallas Mosaic TPU.

Schedule. Before the kernel, plain ``jnp`` turns each query's ``K`` selections into a
compact list of distinct units sorted by store address (``_prep.compact_units``):
duplicates and invalid ids (``-1``, out of range, a page-table slot past the request's
extent, a physical page outside the cache) are dropped there, so selections are sets by
construction. The grid has one program per ``QP`` consecutive queries (``parallel``;
``config.SparseMlaConfig``). A program walks its queries' units back to back in *steps*
of ``G`` units of one query (``unit_ring.query_steps``: per step its query and first
unit), all in SMEM:

* ``meta [1, 1, 1 + 2 QP]``: the step count, then ``count`` and ``lim`` per query (key
  position ``p`` is valid for the query iff ``p < lim``);
* ``steps [1, 1, 3 T]``: per step its query, first unit index and whether it is
  *clean* (every entry holds a unit wholly before the query's ``lim``);
* ``addr, kb [1, 1, QP Kg]``: each unit's store address and first token position, ``K``
  rounded up to a multiple of ``G``; an entry past the query's count already holds its
  step's first unit's address and ``kb = FAR``, so reading an entry takes two SMEM loads
  and no branch or select.

DMA. The store stays in HBM (``unit_ring``: row arrays, or the paged cache read in
place). Step ``t``'s ``G`` units are copied into ring slot ``t % S`` (entry ``e`` into
rows ``[e RB, (e + 1) RB)``), signalling the slot's semaphore. The prologue starts steps
``0 .. S - 2``; step ``t`` waits for its own copies, computes, then starts step ``t + S
- 1`` into the slot step ``t - 1`` finished reading: ``(S - 2) G`` to ``(S - 1) G`` unit
copies stay in flight across the program's queries. That start has no branch: past the
program's last step it repeats the last step's copies into the next slots, and after the
loop the program waits for those ``S - 1`` spare slots, so every started copy is waited
for before the program ends (``RingWalk.fill / start_ahead / drain``). On the v5e this
order ran 4-9 % faster than starting before the wait or guarding the start at 64 heads,
and 2 % slower at 64-token units and 16 heads (docs/experiments.md). A step starts all
``G`` copies without a branch and waits once for the slot's bytes; entries past the
query's count re-copy the step's first unit, and their rows are masked.

Compute per step, for query ``i``: on a step that is not clean, each entry holding a
token at or past ``lim`` (causal, ``kv_len``; an entry without a unit has ``kb = FAR``)
is masked in place in the slot, alone (``StepWalk.words``): zeroed without a read when
it lies wholly past ``lim``, otherwise its 32-bit words ANDed with ``kb_e + r < lim``
and stored back; a clean step's slot is taken as copied. Then the slot as 32-bit words
(``UnitRing.words``), for a paged cache ANDed with the feature padding, bitcast to the
``[G RB, Dk_pad]`` rows: rows a query may not see are exact zeros (they may hold NaN or
Inf: page tails, unwritten or recycled slots, stale ring rows), so ``0 * NaN`` never
reaches a product. On the v5e, masking only where needed took 15-25 % off units of 16
and 32 at 64 heads (docs/experiments.md). An FP8 store masks every step's dequantized
rows as values instead. Scores ``q_i [H, Dk_pad] . rows^T -> [H, G RB]`` in float32 at
``sm_scale``, ``-inf`` where invalid; an online softmax carried across the query's
steps. A row that has seen no valid key keeps ``m = -inf`` and uses 0 in the exponent,
so no ``-inf - -inf`` NaN appears. At the query's last step ``out = acc / l`` (0 where
``l == 0``) and ``lse = m + log(l)`` (natural log; ``-inf`` where ``l == 0``) are written
into the program's output block; queries without units keep the zeros and ``-inf`` the
program writes first.

An FP8 latent cache is two row arrays with a ring each, one DMA per array per entry, the
slot dequantized in VMEM before the masks (``fp8_rows.dequantize_rows``): 768 HBM bytes
per token instead of 1,280, the query in bf16.

The per-query kernel re-fetches a unit once for every query that selected it; the
query-blocked kernel (``sparse_mla_qblock``) fetches each unit once per block of queries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common.paged import check_fp8_dequantize
from attn_common.spec import SparseMlaCall, public_op, sparse_mla_call
from attn_pallas_tpu._mxu import mxu_dot
from attn_pallas_tpu._prep import (
    default_chip,
    fp8_copy,
    pad_features,
    program_tables,
    require_tpu_kernels,
    resolve_interpret,
    unit_space,
)
from attn_pallas_tpu.config import (
    SparseMlaConfig,
    default_config,
    per_query_vmem_bytes,
    vmem_limit,
)
from attn_pallas_tpu.plan import VMEM_USABLE_FRACTION
from attn_pallas_tpu.sparse_mla_bwd import sparse_mla_result
from attn_pallas_tpu.unit_ring import (
    StepWalk,
    Store,
    UnitRing,
    entry_positions,
    in_hbm,
    query_step_specs,
    ring_scratch,
)


def _per_query_kernel(
    *refs, n_store: int, kind: str, sm_scale: float, dk: int, dv: int, rb: int, cfg, interpret
):
    # SMEM: meta [1,1,1+2QP], steps [1,1,3T], addr / kb [1,1,QP*Kg]; VMEM: q [QP,H,Dk_pad];
    # HBM: the store (1 or 2 arrays); out: o [QP,H,Dv] f32, lse [QP,H,1] f32;
    # scratch: ring buffers (1 or 2), DMA semaphores [n_store, S].
    tables, q_ref = refs[:4], refs[4]
    hbm = refs[5 : 5 + n_store]
    o_ref, lse_ref = refs[5 + n_store : 7 + n_store]
    scratch = refs[7 + n_store :]
    ring = UnitRing(kind, hbm, scratch[:-1], scratch[-1], rb=rb, interpret=interpret)
    qp, heads, _ = q_ref.shape
    walk = StepWalk(
        tables, ring, qp=qp, top_k=tables[2].shape[-1] // qp, group=cfg.units_per_step,
        slots=cfg.ring_slots,
    )  # fmt: skip
    o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)  # queries without units
    lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, jnp.float32)
    walk.fill()
    gr = cfg.units_per_step * rb
    init = (  # the carry at a query's first step
        jnp.full((heads, 1), -jnp.inf, jnp.float32),
        jnp.zeros((heads, 1), jnp.float32),
        jnp.zeros((heads, dv), jnp.float32),
    )

    def body(t, carry):
        slot = walk.wait(t)
        i = walk.query(t)
        lim = walk.lim(i)
        rows, kbs = walk.words(
            t, slot, rb=rb, dtype=q_ref.dtype, lim=lim, dk=dk if kind == "pages" else None
        )
        first = walk.first_unit(t) == 0
        m_i, l_i, acc = (jnp.where(first, a, c) for a, c in zip(init, carry, strict=True))
        s = mxu_dot(q_ref[i], rows, (((1,), (1,)), ((), ())))  # [H, G RB]
        valid = entry_positions(kbs, rb=rb, shape=(1, gr), axis=1) < lim
        s = jnp.where(valid, s * sm_scale, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1, keepdims=True))  # [H, 1]
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_i - m_safe)  # m_i = -inf -> 0 (acc and l are 0 there anyway)
        l_new = l_i * alpha + jnp.sum(p, axis=1, keepdims=True)
        pv = mxu_dot(p.astype(rows.dtype), rows[:, :dv], (((1,), (0,)), ((), ())))
        acc_new = acc * alpha + pv
        walk.start_ahead(t)  # after the step's compute, unguarded (docstring, "DMA")

        @pl.when(walk.last(t))
        def _():
            empty = l_new == 0.0
            o_ref[i] = acc_new / jnp.where(empty, 1.0, l_new)
            lse_ref[i] = jnp.where(empty, -jnp.inf, m_new + jnp.log(jnp.where(empty, 1.0, l_new)))

        return m_new, l_new, acc_new

    jax.lax.fori_loop(0, walk.n_steps, body, init)
    walk.drain()


@functools.partial(
    jax.jit, static_argnames=("kind", "sm_scale", "dk", "dv", "rb", "cfg", "interpret")
)
def _per_query_call(q, arrays, tables, *, kind, sm_scale, dk, dv, rb, cfg, interpret):
    """``q [N, H, Dk_pad]`` (``N`` a multiple of ``QP``), the store's HBM ``arrays`` and
    the :class:`QuerySteps` ``tables`` -> ``out [N, H, Dv]``, ``lse [N, H, 1]``."""
    n, heads, dk_pad = q.shape
    qp = cfg.queries_per_program
    store = Store(kind, arrays)
    kernel = functools.partial(
        _per_query_kernel, n_store=len(arrays), kind=kind, sm_scale=sm_scale, dk=dk, dv=dv,
        rb=rb, cfg=cfg, interpret=bool(interpret),
    )  # fmt: skip
    need = per_query_vmem_bytes(
        cfg, heads=heads, read_block=rb, dk_pad=dk_pad, dv=dv, itemsize=q.dtype.itemsize,
        row_bytes=store.row_bytes, dequantize=len(arrays) == 2,
    )  # fmt: skip
    physical = int(default_chip().vmem_bytes / VMEM_USABLE_FRACTION)
    return pl.pallas_call(
        kernel,
        grid=(n // qp,),
        in_specs=[
            *query_step_specs(tables),
            pl.BlockSpec((qp, heads, dk_pad), lambda p: (p, 0, 0)),
            *[pl.BlockSpec(memory_space=pltpu.HBM) for _ in arrays],
        ],
        out_specs=[
            pl.BlockSpec((qp, heads, dv), lambda p: (p, 0, 0)),
            pl.BlockSpec((qp, heads, 1), lambda p: (p, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n, heads, dv), jnp.float32),
            jax.ShapeDtypeStruct((n, heads, 1), jnp.float32),
        ],
        scratch_shapes=ring_scratch(store, rb=rb, group=cfg.units_per_step, slots=cfg.ring_slots),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit(need, physical)
        ),
        interpret=interpret,
    )(*tables, q, *in_hbm(*arrays))


def resolve_config(problem, config: SparseMlaConfig | None) -> SparseMlaConfig:
    """``config``, or the heuristic one for the problem's shape."""
    if config is not None:
        if not isinstance(config, SparseMlaConfig):
            raise TypeError(f"config: got {type(config).__name__}, expected SparseMlaConfig")
        return config
    n = problem.batch * problem.num_queries
    return default_config(
        read_block=problem.read_block, top_k=problem.top_k, num_queries=n, heads=problem.heads
    )


@public_op(sparse_mla_call)
def sparse_mla_attention(
    call: SparseMlaCall,
    *,
    fp8_dequantize: bool | None = None,
    config: SparseMlaConfig | None = None,
):
    """Sparse MLA attention, one TPU program per ``QP`` queries (each query's own units).

    The kernel takes a float32 or bfloat16 cache (the query takes its dtype), or an
    ``Fp8LatentCache`` / ``TpuFp8LatentCache`` (FP8 rows dequantized in VMEM, the query
    in bfloat16; ``attn_pallas_tpu.fp8_rows``), and ``read_block % 16 == 0``; the
    query-blocked knobs are validated and ignored here (``sparse_mla_attention_qblock``
    uses them). ``interpret``: ``True`` or a ``pltpu.InterpretParams`` runs the kernel in
    TPU interpret mode (CPU). Empty work (``S``, ``K`` or ``T`` = 0) gives ``out == 0``,
    ``lse == -inf``. Cache rows no query attends may hold anything.

    ``config``: an ``attn_pallas_tpu.config.SparseMlaConfig`` (units per step, ring
    slots, queries per program); ``None`` takes ``config.default_config``. It never
    changes the answer.

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
    cfg = resolve_config(problem, config)
    interpret = resolve_interpret(call.interpret)

    def forward(c: SparseMlaCall):
        kv, ragged = fp8_copy(problem, c.kv, c.ragged_kwargs(), fp8_dequantize)
        space = unit_space(problem, kv, c.indices, c.positions, **ragged)
        return _per_query(problem, c.q, space, interpret=interpret, config=cfg)

    return sparse_mla_result(call, forward, interpret=interpret, config=cfg)


def _per_query(problem, q, space, *, interpret, config):
    """``(out, lse)`` of the per-query path after validation over the call's unit space
    (``_prep.unit_space``; the query-blocked wrapper's fallback shares its guard's), at
    the config's per-query forward tiling."""
    config = config.per_query_forward()
    batch, seq, heads = problem.batch, problem.num_queries, problem.heads
    n = batch * seq
    rb = problem.read_block
    tables, n_pad = program_tables(space, rb, config, n)
    q_pad = pad_features(q.astype(space.store.dtype), space.store.width).reshape(n, heads, -1)
    q_pad = jnp.pad(q_pad, ((0, n_pad - n), (0, 0), (0, 0)))
    out, lse = _per_query_call(
        q_pad,
        space.store.arrays,
        tables,
        kind=space.store.kind,
        sm_scale=problem.sm_scale,
        dk=problem.dk,
        dv=problem.dv,
        rb=rb,
        cfg=config,
        interpret=interpret,
    )
    return out[:n].reshape(batch, seq, heads, problem.dv), lse[:n].reshape(batch, seq, heads)


__all__ = ["resolve_config", "sparse_mla_attention"]
