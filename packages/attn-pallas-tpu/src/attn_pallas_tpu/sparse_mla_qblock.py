"""Query-blocked sparse-MLA prefill kernel (flat and ragged paged KV), Pallas Mosaic TPU.

Why. At long context the queries of a prefill chunk select heavily overlapping units
(attention sinks, the local window, correlated mid-context picks), so the per-query
kernel fetches the same unit from HBM once per query that selected it, and its score
matmul has only ``H`` rows. Here ``QB`` consecutive queries share one program: the
union of the units they selected is DMA'd once per block, and each query's own
selection is restored by a ``-inf`` bias (membership AND causal AND kv_len) inside one
online softmax over ``Hb * QB`` score rows.

Preprocessing (plain ``jnp``, outside the kernel). Unit keys (flat: unit ids; ragged:
request-local pages lifted to global page-table slots with
``attn_common.sparse_mla.lift_ragged_indices``, so a block may straddle requests) go through
``_prep.union_tables`` (``attn_common.tables.build_block_unit_tables``) at a width ``C * UC``
that no union can exceed (``UC`` = ``u_max`` rounded up to 32, ``C = ceil(min(QB * K,
num_units) / UC)``): per block the sorted union ``units``, the membership of each
query by union slot (scatter-free), packed 32 slots to an int32 word, and the true union
size. Units whose physical page is invalid keep their slot but get membership 0. Per query one int32
``lim`` folds the causal bound and the kv length (key position ``p`` valid iff ``p <
lim``; in ragged mode positions are global, ``key * page_size + r``, and ``lim``
carries the request's base).

Grid ``(B, nQB, G, C)``: batch row, query block, head group of ``Hb = H / G`` heads (the
score rows of one program are ``r = h * QB + q`` for the group's heads ``h``), and the
union chunk. The union sizes ``[B * nQB]`` are scalar-prefetched. A step gets in SMEM
its chunk of the union as ``kb`` (first token position of each slot) and ``src`` (first
store row // 8), ``[B, nQB * C, 1, UC]`` tables; in VMEM the chunk's membership words
``[W, QB]`` int32 (``W = config.member_word_rows(UC)``: ``UC / 32`` rounded up to 8),
``lim [1, QB]`` and the group's q rows ``[Hb * QB, Dk_pad]``. The
chunk axis is sequential (``arbitrary``) and innermost: the output block, resident
across it, is the accumulator, and the running max ``m`` and denominator ``l`` live in
VMEM scratch, initialised at chunk 0 and turned into ``out``/``lse`` at chunk ``C - 1``.
A chunk past the block's union maps (index maps read the prefetched sizes) to the
block's last real chunk, so the pipeline sees an unchanged block index and fetches
nothing; the kernel skips it. So ``u_max`` trades VMEM/SMEM for per-chunk prologues
and never changes the answer.

DMA schedule (``unit_ring``). The store stays in HBM. The chunk's union slots are walked
in steps of ``G`` (``config.SparseMlaConfig.units_per_step``): step ``t``'s ``G`` slots
are copied into ring slot ``t % S`` (slot ``e`` of the step into rows ``[e RB, (e + 1)
RB)``), all on that ring slot's semaphore; the prologue starts steps ``0 .. S - 2`` and
step ``t`` starts step ``t + S - 1`` before waiting for its own copies. Slots past the
chunk's count re-copy the step's first slot and are zeroed after the load. An FP8
cache's store is two arrays with a ring each, dequantized in VMEM after the wait.

Compute per step, key-major: ``s = k [G RB, Dk_pad] . q^T -> [G RB, rows]`` (keys on
sublanes, score rows on lanes), so the per-query membership and ``lim`` are lane rows
broadcast over each slot's keys and no dynamic lane slicing is needed. The step's ``G``
slots share one membership word row (``G`` divides 32), read from its aligned 8-row
window (a dynamic sublane offset must be a multiple of the 32-bit tile's 8 rows) by an
iota select; each slot's bit and ``lim`` give one lane row ``room`` (``lim - kb`` where
the query selected the slot, else 0), and key ``r`` of the slot is valid iff ``r <
room`` (``unit_ring.slot_rooms``). The online softmax reduces over axis 0; a row that has seen no
valid key keeps ``m = -inf`` and uses 0 in the exponent (``exp(-inf - 0) = 0``, never
``-inf - -inf``). The float32 output block is the accumulator. The output is
``acc / l`` (exactly 0 for an empty row) and the LSE ``m + log(l)`` (natural log,
``-inf`` for an empty row), always written.

Dirty caches. The value tile's non-finite entries are replaced by 0 before ``P V``: a
row may be attended by some queries of the block and not by others (page tails past
``seq_len``, unwritten slots, another request's rows), and ``0 * NaN`` would reach every
query of the block. A query that attends such a row still has its non-finite score.

Tiling. ``sparse_mla_attention_qblock`` picks ``(QB, Hb, u_max)`` itself unless told
(``attn_pallas_tpu.plan``: a cost model fitted on a v5e, and a VMEM estimate per chip)
and runs the per-query kernel instead unless the blocks read at most half its bytes.

HBM traffic per layer: ``(H / Hb) * sum_blocks(union) * read_block * row_bytes``
(``Dk_pad * itemsize``, or 768 for an FP8 cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common.metadata import is_concrete
from attn_common.paged import check_fp8_dequantize
from attn_common.spec import SparseMlaCall, public_op, sparse_mla_call
from attn_common.tables import lossless_u_max, resolve_u_max
from attn_pallas_tpu._mxu import mxu_dot
from attn_pallas_tpu._prep import (
    SUBLANE,
    UnionGrid,
    UnionStatic,
    default_chip,
    fp8_copy,
    from_blocks,
    host_unit_keys,
    pad_features,
    query_dtype,
    require_tpu_kernels,
    resolve_interpret,
    row_bytes,
    sorted_picks,
    to_blocks,
    union_tables,
    unit_space,
)
from attn_pallas_tpu.config import (
    MAX_ROWS,
    MEMBER_TILE,
    SparseMlaConfig,
    qblock_vmem_bytes,
    vmem_limit,
)
from attn_pallas_tpu.plan import (
    AUTO_QUERY_BLOCKS,
    MIN_SHARING,
    VMEM_USABLE_FRACTION,
    choose_plan,
    distinct_units_per_query,
    host_distinct_units,
    host_union_sizes,
    per_query_seconds,
    qblock_seconds,
    static_qblock_config,
)
from attn_pallas_tpu.sparse_mla import _per_query, resolve_config, sparse_mla_attention
from attn_pallas_tpu.sparse_mla_bwd import per_query_backward, sparse_mla_result
from attn_pallas_tpu.sparse_mla_qblock_bwd import backward_slots, blocked_backward
from attn_pallas_tpu.unit_ring import (
    Store,
    UnionWalk,
    UnitRing,
    in_hbm,
    ring_scratch,
    slot_rooms,
)


def _qblock_kernel(
    unions_ref,  # scalar prefetch SMEM [B * nQB]: true union size per block
    kb_ref,  # SMEM [1, 1, 1, UC]: first token position of each slot of this chunk
    addr_ref,  # SMEM [1, 1, 1, UC]: store address of each slot of this chunk
    lim_ref,  # VMEM [1, 1, 1, QB] int32: key positions < lim are valid, per query
    mem_ref,  # VMEM [1, 1, W, QB] int32: membership words of this chunk's slots
    q_ref,  # VMEM [1, 1, 1, rows, Dk_pad], row = h * QB + q
    *refs,  # HBM store (1 or 2 arrays); o, lse; ring buffers, sems (unit_ring); m, l
    st: UnionStatic,
    grid: UnionGrid,
    n_store: int,
):
    # o: VMEM [1, 1, 1, rows, Dv] float32 (doubles as the accumulator); lse: [1, 1, 1, 1,
    # rows] float32; m / l: VMEM [1, rows] float32, the running max and denominator
    # carried across chunks.
    hbm, (o_ref, lse_ref) = refs[:n_store], refs[n_store : n_store + 2]
    m_ref, l_ref = refs[-2:]
    ring = UnitRing(
        st.kind, hbm, refs[n_store + 2 : -3], refs[-3], rb=st.rb, interpret=bool(st.interpret)
    )
    u_chunk = kb_ref.shape[-1]
    chunk = pl.program_id(3)
    union = unions_ref[pl.program_id(0) * grid.n_blocks + pl.program_id(1)]
    count = jnp.clip(union - chunk * u_chunk, 0, u_chunk)  # slots walked in this chunk
    rows = q_ref.shape[3]

    @pl.when(chunk == 0)
    def _():
        o_ref[0, 0, 0] = jnp.zeros((rows, st.dv), jnp.float32)
        m_ref[...] = jnp.full((1, rows), -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros((1, rows), jnp.float32)

    @pl.when(count > 0)
    def _():
        m_i, l_i = _walk_chunk(
            count, q_ref, kb_ref, addr_ref, lim_ref, mem_ref, ring, o_ref, m_ref[0], l_ref[0],
            st,
        )  # fmt: skip
        m_ref[0] = m_i
        l_ref[0] = l_i

    @pl.when(chunk == grid.n_chunks - 1)
    def _():
        m_i, l_i = m_ref[0], l_ref[0]
        empty = l_i == 0.0
        safe_l = jnp.where(empty, 1.0, l_i)
        o_ref[0, 0, 0] = o_ref[0, 0, 0] / safe_l[:, None]
        lse_ref[0, 0, 0] = jnp.where(empty, -jnp.inf, m_i + jnp.log(safe_l))[None, :]


def _walk_chunk(
    count, q_ref, kb_ref, addr_ref, lim_ref, mem_ref, ring, o_ref, m_i, l_i, st: UnionStatic
):  # fmt: skip
    """Online softmax over ``count`` union slots of one chunk, ``G`` slots a step;
    returns the new ``(m, l)``."""
    sm_scale, dk, dv, rb, heads_per_group, cfg = (
        st.sm_scale, st.page_dk, st.dv, st.rb, st.heads_per_group, st.cfg
    )  # fmt: skip
    g = cfg.units_per_step
    q = q_ref[0, 0, 0]  # [rows, Dk_pad]
    lim = lim_ref[0, 0]  # [1, QB]
    walk = UnionWalk(ring, kb_ref, addr_ref, count, group=g, slots=cfg.ring_slots)
    walk.prologue()
    key_row = jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)

    def body(t, carry):
        m_i, l_i = carry  # [rows] each
        slot = walk.advance(t)
        kv, kbs = walk.words(t, slot, rb=rb, dtype=q.dtype, dk=dk)  # [G RB, Dk_pad]
        # A row may be attended by some queries of the block and not by others, so a
        # per-row zeroing cannot keep garbage out of the shared P V product; replacing
        # non-finite values by 0 does: a query that attends such a row already has a
        # non-finite (NaN / +Inf: its output is NaN) or -Inf (weight 0) score for it.
        values = kv[:, :dv]
        finite = jnp.isfinite(values.astype(jnp.float32))  # Mosaic's is_finite takes f32
        values = jnp.where(finite, values, jnp.zeros_like(values))
        s = mxu_dot(kv, q, (((1,), (1,)), ((), ())))  # [G RB, rows]
        rooms = slot_rooms(mem_ref, t * g, kbs, lim, heads_per_group)  # [1, rows] each
        pieces = [
            jnp.where(key_row < room, s[e * rb : (e + 1) * rb] * sm_scale, -jnp.inf)
            for e, room in enumerate(rooms)
        ]  # [RB, rows] each
        s = pieces[0] if g == 1 else jnp.concatenate(pieces, axis=0)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=0))  # [rows]
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[None, :])  # [G RB, rows]
        alpha = jnp.exp(m_i - m_safe)  # m_i = -inf -> 0 (acc and l are 0 there anyway)
        l_new = l_i * alpha + jnp.sum(p, axis=0)
        pv = mxu_dot(
            p.astype(kv.dtype), values, (((0,), (0,)), ((), ()))
        )  # [rows, Dv]: contracts the key axis
        o_ref[0, 0, 0] = o_ref[0, 0, 0] * alpha[:, None] + pv
        return m_new, l_new

    return jax.lax.fori_loop(0, walk.n_steps, body, (m_i, l_i))


def _head_group(heads: int, query_block: int, head_block: int | None, max_rows: int) -> int:
    if head_block is not None:
        if isinstance(head_block, bool) or not isinstance(head_block, int) or head_block < 1:
            raise ValueError(f"head_block: got {head_block!r}, expected a positive int")
        if heads % head_block:
            raise ValueError(f"head_block: got {head_block}, expected a divisor of H = {heads}")
        return head_block
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and d * query_block <= max_rows]
    return max(fits, default=1)


@functools.partial(jax.jit, static_argnames=("st",))
def _qblock_call(q5, arrays, kb, addr, unions, lim, member, *, st: UnionStatic):
    batch, n_blocks, groups, rows, dk_pad = q5.shape
    u_chunk = kb.shape[-1]
    n_chunks = kb.shape[1] // n_blocks
    query_block = lim.shape[-1]
    store = Store(st.kind, arrays)
    grid = UnionGrid(n_blocks, n_chunks, u_chunk)
    kernel = functools.partial(_qblock_kernel, st=st, grid=grid, n_store=len(arrays))
    cfg, rb, dv = st.cfg, st.rb, st.dv
    physical = int(default_chip().vmem_bytes / VMEM_USABLE_FRACTION)  # a core's VMEM
    need = qblock_vmem_bytes(
        cfg.replace(query_block=query_block, u_max=u_chunk), rows=rows, read_block=rb,
        dk_pad=dk_pad, dv=dv, itemsize=q5.dtype.itemsize, row_bytes=store.row_bytes,
        dequantize=len(arrays) == 2,
    )  # fmt: skip
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, n_blocks, groups, n_chunks),
        in_specs=[
            *grid.table_specs(query_block),
            pl.BlockSpec((1, 1, 1, rows, dk_pad), grid.per_group),
            *[pl.BlockSpec(memory_space=pltpu.HBM) for _ in arrays],
        ],
        out_specs=[
            pl.BlockSpec((1, 1, 1, rows, dv), grid.per_group),
            pl.BlockSpec((1, 1, 1, 1, rows), grid.per_group),
        ],
        scratch_shapes=[
            *ring_scratch(store, rb=rb, group=cfg.units_per_step, slots=cfg.ring_slots),
            pltpu.VMEM((1, rows), jnp.float32),
            pltpu.VMEM((1, rows), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((batch, n_blocks, groups, rows, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, n_blocks, groups, 1, rows), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            # The chunk axis carries the softmax state: sequential, innermost.
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit(need, physical),
        ),
        interpret=st.interpret,
    )(unions, kb, addr, lim, member, q5, *in_hbm(*arrays))


@public_op(sparse_mla_call)
def sparse_mla_attention_qblock(
    call: SparseMlaCall,
    *,
    max_rows: int = MAX_ROWS,
    fp8_dequantize: bool | None = None,
    config: SparseMlaConfig | None = None,
):
    """Sparse MLA attention, query-blocked: one program per (query block, head group).

    Same arguments and results as :func:`attn_pallas_tpu.sparse_mla_attention`. None of
    the knobs changes the answer:

    query_block: queries per program (``QB``, a multiple of 8). ``None`` together with
      ``head_block=None`` (the default) plans the tiling automatically (below).
    u_max: union slots per chunk (rounded up to 32): a block's union is streamed in
      chunks of this many units with the softmax carried across chunks, so it is a
      VMEM/speed knob only. ``None``: ``attn_common.tables.resolve_u_max``.
    head_block / max_rows: heads per program; default the largest divisor of ``H`` with
      ``head_block * query_block <= max_rows``. Each head group re-reads the union.
    config: an ``attn_pallas_tpu.config.SparseMlaConfig`` for the ring (units per step,
      ring slots) and the per-query fallback; its ``query_block`` / ``head_block`` /
      ``u_max`` are used where the call's are ``None``.

    Automatic tiling (``query_block`` and ``head_block`` both ``None``): with host-value
    inputs the true per-query unit counts and per-block union sizes are computed and
    ``attn_pallas_tpu.plan.choose_plan`` picks the fastest modelled (kernel, QB, head
    block, u_max) under the chip's VMEM, the per-query kernel whenever that moves no
    more bytes. Under jit the tiling comes from the shapes (``static_qblock_config``) and
    a runtime ``lax.cond`` still runs the per-query kernel whenever the query-blocked one
    would move more KV bytes or is modelled slower.

    ``fp8_dequantize``: as for the per-query function (the plan then prices the rows
    the kernels read).

    Differentiable in ``q`` and ``kv``: the query-blocked backward
    (``attn_pallas_tpu.sparse_mla_qblock_bwd``, at the forward's tiling) where every
    block's union fits its partial buffer and (automatic tiling) the blocks share, else
    the per-query backward kernels (``attn_pallas_tpu.sparse_mla_bwd``), decided at run
    time. ``return_attn_mass`` from the kernel's LSE, as the per-query function.
    """
    problem = require_tpu_kernels(call)
    cfg = resolve_config(problem, config)
    call = call.replace(
        query_block=call.query_block if call.query_block is not None else cfg.query_block,
        head_block=call.head_block if call.head_block is not None else cfg.head_block,
        u_max=call.u_max if call.u_max is not None else cfg.u_max,
    )
    query_block, head_block = call.query_block, call.head_block
    if query_block is not None and query_block % SUBLANE:
        raise ValueError(f"query_block: got {query_block}, expected a multiple of {SUBLANE}")
    if head_block is not None:
        _head_group(problem.heads, query_block or SUBLANE, head_block, max_rows)  # validates
    check_fp8_dequantize(fp8_dequantize)
    if query_block is None and head_block is None and _host_values(call):
        return _host_planned(call, max_rows=max_rows, fp8_dequantize=fp8_dequantize, cfg=cfg)
    return _attend(call, max_rows=max_rows, fp8_dequantize=fp8_dequantize, cfg=cfg)


def _attend(call: SparseMlaCall, *, max_rows: int, fp8_dequantize, cfg, planned=None):
    """The op's result for a validated call. ``planned``: ``(query_block, head_block,
    u_max)`` an earlier eager call planned for this shape (see :func:`_host_planned`),
    used in place of the shape-only tiling and still guarded at run time; ``None``: the
    call's own tiling or the shapes'."""
    interpret = resolve_interpret(call.interpret)
    forward = functools.partial(
        _forward, max_rows=max_rows, fp8_dequantize=fp8_dequantize, interpret=interpret,
        cfg=cfg, planned=planned,
    )  # fmt: skip
    backward = functools.partial(_backward, max_rows=max_rows, planned=planned)
    return sparse_mla_result(call, forward, interpret=interpret, config=cfg, backward=backward)


def _plan_shape(problem, kv, cfg) -> dict:
    """The planner's shape keywords (``plan.PlanShape``) of a call over ``kv``."""
    return dict(
        heads=problem.heads,
        top_k=problem.top_k,
        num_units=problem.num_units,
        read_block=problem.read_block,
        dk_pad=problem.dk_pad,
        dv=problem.dv,
        itemsize=query_dtype(kv).itemsize,
        row_bytes=row_bytes(kv, problem.dk_pad),
        chip=default_chip(),
        config=cfg,
    )


def _host_values(call: SparseMlaCall) -> bool:
    """Every array of the call holds values (an eager call), the query one array."""
    ragged = call.ragged_kwargs()
    tables = [ragged[k] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")]
    arrays = [call.q, call.indices, call.positions, *(t for t in tables if t is not None)]
    return not call.problem.is_empty and not isinstance(call.q, tuple) and is_concrete(*arrays)


@functools.lru_cache(maxsize=64)
def _jitted_op(per_query: bool, static: tuple):
    """The per-query or query-blocked op with the keywords ``static`` fixed, jitted."""
    op = sparse_mla_attention if per_query else sparse_mla_attention_qblock
    return jax.jit(functools.partial(op, **dict(static)))


_OWN_KEYWORDS = ("fp8_dequantize", "config", "max_rows")  # the op's, not the spec's


@functools.lru_cache(maxsize=64)
def _jitted_guarded(static: tuple, planned: tuple | None):
    """The query-blocked op at the ``planned`` tiling (``None``: the shapes') with the
    run-time guard of a jitted call (:func:`_forward`), the keywords ``static`` fixed."""
    spec = {k: v for k, v in static if k not in _OWN_KEYWORDS}
    own = {k: v for k, v in static if k in _OWN_KEYWORDS}

    def run(q, kv, indices, positions, **tables):
        call = sparse_mla_call(q, kv, indices, positions, **spec, **tables)
        return _attend(
            call, max_rows=own["max_rows"], fp8_dequantize=own["fp8_dequantize"],
            cfg=own["config"], planned=planned,
        )  # fmt: skip

    return jax.jit(run)


_EAGER_PLANS: dict = {}  # shape key -> the tiling its first eager call planned
_EAGER_PLANS_MAX = 256


def _shape_key(call: SparseMlaCall, static: tuple) -> tuple:
    """What an eager call's plan depends on besides the selections: the keywords and
    every array's shape and dtype (the cache's pytree structure too)."""
    arrays = (call.q, call.kv, call.indices, call.positions, call.ragged_kwargs())
    leaves, tree = jax.tree.flatten(arrays)
    return static, tree, tuple((jnp.shape(x), getattr(x, "dtype", type(x))) for x in leaves)


def _host_planned(call: SparseMlaCall, *, max_rows: int, fp8_dequantize, cfg):
    """An eager call with automatic tiling.

    The first call of a shape (:func:`_shape_key`) plans on host-side counts: numpy
    (:func:`host_unit_keys`, ``plan.host_distinct_units`` and ``plan.host_union_sizes``
    for every ``AUTO_QUERY_BLOCKS`` size; ``O(S K + blocks x units / 8)`` work and a
    sort of each query's ``K`` keys, no device round trip for host-value indices), then
    runs the planned kernel and its tables under one ``jax.jit`` (dispatching the table
    building op by op cost ~120 ms on a v5e). The counts cost milliseconds on a v5e's
    host, more than the kernel at small shapes, so the plan's tiling is kept per shape:
    later calls of that shape run the query-blocked kernel at it (the per-query plan
    keeps the shapes' tiling) behind the run-time guard of a jitted call, which takes
    the per-query kernel for selections that share too little. No host counting then.
    """
    problem = call.problem
    ragged = call.ragged_kwargs()
    tables = {k: v for k, v in ragged.items() if k != "page_size"}
    static = tuple(sorted(dict(
        sm_scale=problem.sm_scale,
        kv_lora_rank=problem.dv,
        read_block=problem.read_block,
        return_lse=call.return_lse,
        return_attn_mass=call.return_attn_mass,
        page_size=ragged["page_size"],
        debug_checks=call.debug_checks,
        interpret=call.interpret,
        fp8_dequantize=fp8_dequantize,
        config=cfg,
        max_rows=max_rows,
    ).items()))  # fmt: skip
    args = (call.q, call.kv, call.indices, call.positions)
    key = _shape_key(call, static)
    if key in _EAGER_PLANS:
        return _jitted_guarded(static, _EAGER_PLANS[key])(*args, **tables)
    keys = host_unit_keys(problem, call.kv, call.indices, **ragged)
    plan = choose_plan(
        distinct_per_query=host_distinct_units(keys),
        union_sizes=host_union_sizes(keys, AUTO_QUERY_BLOCKS),
        max_rows=max_rows,
        **_plan_shape(problem, call.kv, cfg),
    )
    per_query = plan.kernel == "per_query"
    run = dict(static)
    if per_query:
        tiling = None
        del run["max_rows"]
    else:
        u_max = call.u_max if call.u_max is not None else plan.u_max
        tiling = (plan.query_block, plan.head_block, u_max)
        run.update(query_block=plan.query_block, head_block=plan.head_block, u_max=u_max)
    if plan.kv_bytes:  # a warm-up call with no selection plans nothing for later calls
        if len(_EAGER_PLANS) >= _EAGER_PLANS_MAX:
            _EAGER_PLANS.pop(next(iter(_EAGER_PLANS)))  # the oldest
        _EAGER_PLANS[key] = tiling
    return _jitted_op(per_query, tuple(sorted(run.items())))(*args, **tables)


def _tiling(call: SparseMlaCall, kv, *, max_rows: int, cfg, planned=None):
    """``(query_block, head_block, u_max, explicit)`` of a validated call: the call's own
    tiling where it sets ``query_block`` or ``head_block`` (``explicit``), else
    ``planned`` (an earlier eager call's plan), else the one the shapes give
    (``static_qblock_config``, the query block cut to the queries)."""
    problem = call.problem
    shape_args = _plan_shape(problem, kv, cfg)
    if call.query_block is not None or call.head_block is not None:
        qb = call.query_block or static_qblock_config(**shape_args, max_rows=max_rows)[0]
        hb = _head_group(problem.heads, qb, call.head_block, max_rows)
        return qb, hb, call.u_max, True
    if planned is not None:
        return (*planned, False)
    qb, hb, u_max = static_qblock_config(**shape_args, max_rows=max_rows)
    qb = min(qb, -(-problem.num_queries // SUBLANE) * SUBLANE)  # no block past the queries
    return qb, hb, call.u_max if call.u_max is not None else u_max, False


def _forward(call: SparseMlaCall, *, max_rows: int, fp8_dequantize, interpret, cfg, planned):
    """The planned kernel's ``(out, lse)`` for a validated call."""
    problem = call.problem
    q, indices, positions = call.q, call.indices, call.positions
    kv, ragged = fp8_copy(problem, call.kv, call.ragged_kwargs(), fp8_dequantize)
    space = unit_space(problem, kv, indices, positions, **ragged)
    # The per-query fallback takes the guard's unit space: one lift of the request-local
    # ids through the page table, not one per branch.
    per_query = functools.partial(_per_query, problem, q, space, interpret=interpret, config=cfg)
    qb, hb, u_max, explicit = _tiling(call, kv, max_rows=max_rows, cfg=cfg, planned=planned)
    qblock = functools.partial(
        _qblock, problem, q, space, query_block=qb, head_block=hb, u_max=u_max,
        interpret=interpret, cfg=cfg, page_indices=ragged["page_indices"],
    )  # fmt: skip
    if explicit:  # no fallback
        return qblock()
    # Under jit the unions are data: decide at run time. The query-blocked kernel runs
    # only if it moves fewer KV bytes (DMAs of one unit each) and the model predicts it
    # faster; otherwise (and on ties) the per-query kernel. The guard's union sizes come
    # from the sort the tables start from, done once.
    shape_args = _plan_shape(problem, kv, cfg)
    picks, unions = sorted_picks(space, query_block=qb)
    qblock = functools.partial(qblock, picks=picks)
    distinct = distinct_units_per_query(jnp.where(space.unit_ok, space.keys, -1))
    qblock_s = qblock_seconds(unions, query_block=qb, head_block=hb, u_max=u_max, **shape_args)
    per_query_s = per_query_seconds(distinct, **shape_args)
    shares = _shares(unions, distinct, groups=problem.heads // hb)
    return jax.lax.cond(shares & (qblock_s < per_query_s), qblock, per_query)


def _shares(unions, distinct, *, groups: int):
    """Whether the blocks' unions (re-read per head group) are at most ``1 / MIN_SHARING``
    of the per-query kernel's unit DMAs."""
    return groups * jnp.sum(unions) * MIN_SHARING <= jnp.sum(distinct)


def _backward(
    call: SparseMlaCall, out, lse, d_out, d_lse, *, max_rows: int, planned, interpret, config
):
    """``(dq, dkv)``: the query-blocked backward (``sparse_mla_qblock_bwd``) at the
    forward's tiling where every block's union fits its partial buffer and (automatic
    tiling) the blocks share as the forward requires; else the per-query backward.
    Decided at run time."""
    problem = call.problem
    space = unit_space(problem, call.kv, call.indices, call.positions, **call.ragged_kwargs())
    qb, hb, _, explicit = _tiling(call, call.kv, max_rows=max_rows, cfg=config, planned=planned)
    picks, unions = sorted_picks(space, query_block=qb)  # the guard's and the tables' sort
    take = jnp.max(unions) <= backward_slots(qb, problem.top_k, problem.num_units)
    if not explicit:
        distinct = distinct_units_per_query(jnp.where(space.unit_ok, space.keys, -1))
        take = take & _shares(unions, distinct, groups=problem.heads // hb)
    grads = (call, out, lse, d_out, d_lse)
    kw = dict(interpret=interpret, config=config, space=space)  # the guard's, for both
    return jax.lax.cond(
        take,
        lambda: blocked_backward(*grads, query_block=qb, head_block=hb, picks=picks, **kw),
        lambda: per_query_backward(*grads, **kw),
    )


def _qblock(
    problem, q, space, *, query_block, head_block, u_max, interpret, cfg, page_indices,
    picks=None,
):  # fmt: skip
    """Build the chunked union tables (from ``picks``, ``_prep.sorted_picks``, where the
    caller has them) and run the query-blocked kernel."""
    u_max = resolve_u_max(
        u_max, query_block=query_block, top_k=problem.top_k, num_units=problem.num_units
    )
    u_chunk = -(-u_max // MEMBER_TILE) * MEMBER_TILE
    widest = lossless_u_max(query_block, problem.top_k, problem.num_units)
    tables = union_tables(
        problem, space, query_block=query_block, u_chunk=u_chunk, n_chunks=-(-widest // u_chunk),
        page_indices=page_indices, picks=picks,
    )  # fmt: skip
    # (the width is >= every union: nothing is dropped)
    store = space.store
    q5 = to_blocks(pad_features(q.astype(store.dtype), store.width), query_block, head_block)
    out, lse = _qblock_call(
        q5,
        store.arrays,
        tables.kb,
        tables.addr,
        tables.unions,
        tables.lim,
        tables.member,
        st=UnionStatic(
            store.kind, problem.sm_scale, problem.dk, problem.dv, problem.read_block,
            head_block, cfg, interpret,
        ),
    )  # fmt: skip
    seq = problem.num_queries
    return (
        from_blocks(out, seq, query_block),
        from_blocks(lse.swapaxes(-1, -2), seq, query_block)[..., 0],
    )
