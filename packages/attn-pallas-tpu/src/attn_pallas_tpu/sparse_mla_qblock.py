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
``attn_common.lift_ragged_indices``, so a block may straddle requests) go through
``attn_common.build_block_unit_tables``: per block the sorted union ``units``
(``-1`` padded to ``u_max``), the membership ``member[q, slot]`` indexed by union slot
(scatter-free) and the true union size. Units whose physical page is invalid keep their
slot but get membership 0. Per query one int32 ``lim`` folds the causal bound and the
kv length (key position ``p`` valid iff ``p < lim``; in ragged mode positions are global,
``key * page_size + r``, and ``lim`` carries the request's base).

Grid ``(B, nQB, G)``: batch row, query block, head group of ``Hb = H / G`` heads (the
score rows of one program are ``r = h * QB + q`` for the group's heads ``h``; ``Hb`` is
the largest divisor of ``H`` with ``Hb * QB <= max_rows`` so the ``[rows, Dv]`` float32
accumulator fits VMEM). Each program gets in SMEM the block's union as ``kb`` (first
token position of each slot), ``src`` (first store row // 8) and the count; in VMEM the
membership ``[U_pad, QB]`` int8, ``lim [1, QB]`` and its q rows ``[Hb * QB, Dk_pad]``.

DMA schedule. The KV row store stays in HBM. Union slot ``j`` (``read_block`` rows from
row ``src[j] * 8``) is copied into slot ``j % NBUF`` of a VMEM ring
``[NBUF, read_block, Dk_pad]`` and signals DMA semaphore ``sem[j % NBUF]``. The prologue
starts slots ``0 .. NBUF-2``; iteration ``j`` starts ``j + NBUF - 1`` into the ring slot
that iteration ``j - 1`` finished reading, then waits for ``j``: ``NBUF - 1`` copies are
in flight behind the compute (per-unit copies are latency-bound, ~1.5 us each, so
without the prefetch the loop would run at DMA latency). All started copies are waited.

Compute per union slot, key-major: ``s = k [RB, Dk_pad] . q^T -> [RB, rows]`` (keys on
sublanes, score rows on lanes), so the per-query membership and ``lim`` are lane rows
broadcast over the keys and no in-kernel transpose or dynamic lane slicing is needed.
The slot's membership row comes from an aligned 32-row window of the int8 membership
(int8 tiles are (32, 128): a dynamic sublane offset must be provably a multiple of 32)
and an iota select. The online softmax reduces over axis 0; a row that has seen no
valid key keeps ``m = -inf`` and uses 0 in the exponent (``exp(-inf - 0) = 0``, never
``-inf - -inf``). The float32 output block is the accumulator. The output is
``acc / l`` (exactly 0 for an empty row) and the LSE ``m + log(l)`` (natural log,
``-inf`` for an empty row), always written.

``u_max``: the union table width. The default ``min(QB * K, num_units)`` is lossless. A
smaller cap warns once per (u_max, lossless bound) (``LossyUnionCapWarning``) and is
lossy: a block whose union is larger keeps only its ``u_max`` smallest unit keys, and
keys of the dropped units are not attended by any query of that block (the reference's
``sparse_mla_attention_qblock`` reproduces exactly this).

HBM traffic per layer: ``G * sum_blocks(union) * read_block * Dk_pad * itemsize``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common import build_block_unit_tables, resolve_u_max
from attn_pallas_tpu._prep import (
    SUBLANE,
    check_tpu_sparse_mla_inputs,
    pad_features,
    resolve_interpret,
    unit_source,
    unit_space,
)

NBUF = 4  # DMA ring depth: NBUF - 1 unit copies in flight behind the compute
MEMBER_TILE = 32  # int8 sublane tile: aligned window for the dynamic membership row
MAX_ROWS = 4096  # default cap on score rows (Hb * QB) per program


def _lane_tile(x, times: int):
    """``[1, n] -> [1, times * n]`` by lane concatenation (row r reads x[r % n])."""
    return x if times == 1 else jnp.concatenate([x] * times, axis=1)


def _qblock_kernel(
    cnt_ref,  # SMEM [1, 1, 1, 1]: union size walked (capped at u_max)
    kb_ref,  # SMEM [1, 1, 1, U_pad]: first token position of each union slot
    src_ref,  # SMEM [1, 1, 1, U_pad]: first store row // 8 of each union slot
    lim_ref,  # VMEM [1, 1, 1, QB] int32: key positions < lim are valid, per query
    mem_ref,  # VMEM [1, 1, U_pad, QB] int8: membership by union slot
    q_ref,  # VMEM [1, 1, 1, rows, Dk_pad], row = h * QB + q
    kv_hbm,  # HBM  [R, Dk_pad] row store
    o_ref,  # VMEM [1, 1, 1, rows, Dv] float32 (doubles as the accumulator)
    lse_ref,  # VMEM [1, 1, 1, 1, rows] float32
    ring,  # VMEM [NBUF, RB, Dk_pad]
    sems,  # DMA semaphores [NBUF]
    *,
    sm_scale: float,
    dk: int,
    dv: int,
    rb: int,
    heads_per_group: int,
):
    count = cnt_ref[0, 0, 0, 0]
    q = q_ref[0, 0, 0]  # [rows, Dk_pad]
    rows, dk_pad = q.shape
    lim = _lane_tile(lim_ref[0, 0], heads_per_group)  # [1, rows]

    def copy(j, slot):
        start = pl.multiple_of(src_ref[0, 0, 0, j] * SUBLANE, SUBLANE)
        return pltpu.make_async_copy(kv_hbm.at[pl.ds(start, rb)], ring.at[slot], sems.at[slot])

    for d in range(NBUF - 1):  # prologue: fill the ring

        @pl.when(d < count)
        def _(d=d):
            copy(d, d).start()

    o_ref[0, 0, 0] = jnp.zeros((rows, dv), jnp.float32)
    key_row = jax.lax.broadcasted_iota(jnp.int32, (rb, 1), 0)
    win_row = jax.lax.broadcasted_iota(jnp.int32, (MEMBER_TILE, 1), 0)
    feat = jax.lax.broadcasted_iota(jnp.int32, (1, dk_pad), 1)

    def body(j, carry):
        m_i, l_i = carry  # [rows] each
        nxt = j + NBUF - 1

        @pl.when(nxt < count)
        def _():
            copy(nxt, jax.lax.rem(nxt, NBUF)).start()

        # Membership row of slot j: aligned 32-row window, then select row j - j0.
        j0 = pl.multiple_of(jax.lax.div(j, MEMBER_TILE) * MEMBER_TILE, MEMBER_TILE)
        win = mem_ref[0, 0, pl.ds(j0, MEMBER_TILE), :].astype(jnp.int32)  # [32, QB]
        member = jnp.max(jnp.where(win_row == j - j0, win, 0), axis=0, keepdims=True)
        member = _lane_tile(member, heads_per_group)  # [1, rows]
        valid = (member > 0) & ((kb_ref[0, 0, 0, j] + key_row) < lim)  # [RB, rows]

        slot = jax.lax.rem(j, NBUF)
        copy(j, slot).wait()
        kv = ring[slot]  # [RB, Dk_pad]
        if dk < dk_pad:  # the paged cache's feature padding may hold anything
            kv = jnp.where(feat < dk, kv, jnp.zeros_like(kv))
        s = jax.lax.dot_general(
            kv, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [RB, rows]
        s = jnp.where(valid, s * sm_scale, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=0))  # [rows]
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[None, :])  # [RB, rows]
        alpha = jnp.exp(m_i - m_safe)  # m_i = -inf -> 0 (acc and l are 0 there anyway)
        l_new = l_i * alpha + jnp.sum(p, axis=0)
        pv = jax.lax.dot_general(
            p.astype(kv.dtype),
            kv[:, :dv],
            (((0,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )  # [rows, Dv]: contracts the key axis
        o_ref[0, 0, 0] = o_ref[0, 0, 0] * alpha[:, None] + pv
        return m_new, l_new

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    m_i, l_i = jax.lax.fori_loop(0, count, body, init)
    empty = l_i == 0.0
    safe_l = jnp.where(empty, 1.0, l_i)
    o_ref[0, 0, 0] = o_ref[0, 0, 0] / safe_l[:, None]
    lse_ref[0, 0, 0] = jnp.where(empty, -jnp.inf, m_i + jnp.log(safe_l))[None, :]


def _head_group(heads: int, query_block: int, head_block: int | None, max_rows: int) -> int:
    if head_block is not None:
        if isinstance(head_block, bool) or not isinstance(head_block, int) or head_block < 1:
            raise ValueError(f"head_block: got {head_block!r}, expected a positive int")
        if heads % head_block:
            raise ValueError(f"head_block: got {head_block}, expected a divisor of H = {heads}")
        return head_block
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and d * query_block <= max_rows]
    return max(fits, default=1)


def qblock_vmem_bytes(
    *, rows: int, query_block: int, u_pad: int, rb: int, dk_pad: int, dv: int, itemsize: int
) -> int:
    """VMEM estimate of one program: pipelined blocks (x2), ring, score temporaries."""
    blocks = (
        rows * dk_pad * itemsize  # q
        + rows * dv * 4  # out (accumulator)
        + rows * 4  # lse
        + u_pad * query_block  # membership int8
        + query_block * 4  # lim
    )
    temps = 5 * rb * rows * 4 + 2 * rows * dv * 4  # s, p, masks; acc update
    return 2 * blocks + NBUF * rb * dk_pad * itemsize + temps


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "dk", "dv", "rb", "heads_per_group", "interpret"),
)
def _qblock_call(
    q5, store, kb, src8, counts, lim, member, *, sm_scale, dk, dv, rb, heads_per_group, interpret
):
    batch, n_blocks, groups, rows, dk_pad = q5.shape
    u_pad = kb.shape[-1]
    query_block = lim.shape[-1]
    smem = pltpu.SMEM
    kernel = functools.partial(
        _qblock_kernel, sm_scale=sm_scale, dk=dk, dv=dv, rb=rb, heads_per_group=heads_per_group
    )
    per_block = lambda b, n, g: (b, n, 0, 0)  # noqa: E731
    vmem = qblock_vmem_bytes(
        rows=rows,
        query_block=query_block,
        u_pad=u_pad,
        rb=rb,
        dk_pad=dk_pad,
        dv=dv,
        itemsize=jnp.dtype(store.dtype).itemsize,
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, n_blocks, groups),
        in_specs=[
            pl.BlockSpec((1, 1, 1, 1), per_block, memory_space=smem),
            pl.BlockSpec((1, 1, 1, u_pad), per_block, memory_space=smem),
            pl.BlockSpec((1, 1, 1, u_pad), per_block, memory_space=smem),
            pl.BlockSpec((1, 1, 1, query_block), per_block),
            pl.BlockSpec((1, 1, u_pad, query_block), per_block),
            pl.BlockSpec((1, 1, 1, rows, dk_pad), lambda b, n, g: (b, n, g, 0, 0)),
            pl.BlockSpec(memory_space=pltpu.HBM),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, 1, rows, dv), lambda b, n, g: (b, n, g, 0, 0)),
            pl.BlockSpec((1, 1, 1, 1, rows), lambda b, n, g: (b, n, g, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, n_blocks, groups, rows, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, n_blocks, groups, 1, rows), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((NBUF, rb, dk_pad), store.dtype),
            pltpu.SemaphoreType.DMA((NBUF,)),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel"),
            vmem_limit_bytes=int(min(max(vmem * 5 // 4, 32 << 20), 100 << 20)),
        ),
        interpret=interpret,
    )(counts, kb, src8, lim, member, q5, store)


def sparse_mla_attention_qblock(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    kv_lora_rank: int = 512,
    read_block: int = 128,
    return_lse: bool = False,
    page_size: int | None = None,
    q_seq_id: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
    cu_kv_lens: jax.Array | None = None,
    page_indices: jax.Array | None = None,
    query_block: int = 256,
    u_max: int | None = None,
    head_block: int | None = None,
    max_rows: int = MAX_ROWS,
    interpret: bool | pltpu.InterpretParams = False,
):
    """Sparse MLA attention, query-blocked: one program per (query block, head group).

    Same arguments and results as :func:`attn_pallas_tpu.sparse_mla_attention` (flat
    ``q [B, S, H, Dk]``, ``kv [B, T, Dk]``, ``indices [B, S, K]``, ``positions [B, S]``;
    or ragged paged mode with ``q_seq_id`` etc.), returning ``out [B, S, H, Dv]`` float32
    and optionally ``lse [B, S, H]``. Extra knobs:

    query_block: queries per program (``QB``, a multiple of 8; 128-multiples keep the
      lane tiling of the membership free on TPU). ``S`` need not be a multiple.
    u_max: union table width; ``None`` = the lossless ``min(QB * K, num_units)``. A
      smaller value warns (``LossyUnionCapWarning``) and drops, per block, every unit key
      beyond the ``u_max`` smallest (see the module docstring).
    head_block / max_rows: heads per program; default the largest divisor of ``H`` with
      ``head_block * query_block <= max_rows``. Each head group re-reads the union.
    """
    problem = check_tpu_sparse_mla_inputs(
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
    )
    if isinstance(query_block, bool) or not isinstance(query_block, int) or query_block < 1:
        raise ValueError(f"query_block: got {query_block!r}, expected a positive int")
    if query_block % SUBLANE:
        raise ValueError(f"query_block: got {query_block}, expected a multiple of {SUBLANE}")
    u_max = resolve_u_max(
        u_max, query_block=query_block, top_k=problem.top_k, num_units=problem.num_units
    )
    interpret = resolve_interpret(interpret)
    batch, seq, heads = problem.batch, problem.num_queries, problem.heads
    hb = _head_group(heads, query_block, head_block, max_rows)
    groups = heads // hb
    rb = problem.read_block
    dk_pad = problem.dk_pad

    space = unit_space(
        problem,
        kv,
        indices,
        positions,
        page_size=page_size,
        q_seq_id=q_seq_id,
        seq_lens=seq_lens,
        cu_kv_lens=cu_kv_lens,
        page_indices=page_indices,
    )
    tables = jax.vmap(
        functools.partial(build_block_unit_tables, query_block=query_block, u_max=u_max)
    )(space.keys)
    n_blocks = tables.units.shape[1]
    if problem.ragged:
        src8, ok = unit_source(
            tables.units, page_indices=page_indices, page_size=page_size, num_pages=kv.shape[0]
        )
    else:
        src8, ok = unit_source(
            tables.units, flat_rows_per_batch=problem.num_units * rb, read_block=rb
        )
    u_pad = -(-u_max // MEMBER_TILE) * MEMBER_TILE
    slot_pad = ((0, 0), (0, 0), (0, u_pad - u_max))
    member = jnp.where(ok[:, :, None, :], tables.member, 0).astype(jnp.int8)
    member = jnp.pad(member.transpose(0, 1, 3, 2), (*slot_pad, (0, 0)))  # [B, nQB, U_pad, QB]
    kb = jnp.pad(jnp.maximum(tables.units, 0) * rb, slot_pad)[:, :, None, :]
    src8 = jnp.pad(src8, slot_pad)[:, :, None, :]
    counts = jnp.minimum(tables.counts, u_max).reshape(batch, n_blocks, 1, 1)

    seq_pad = n_blocks * query_block
    lim = jnp.pad(space.lim, ((0, 0), (0, seq_pad - seq)))  # padded queries: lim 0
    lim = lim.reshape(batch, n_blocks, 1, query_block)
    q5 = pad_features(q.astype(kv.dtype), dk_pad)
    q5 = jnp.pad(q5, ((0, 0), (0, seq_pad - seq), (0, 0), (0, 0)))
    q5 = q5.reshape(batch, n_blocks, query_block, groups, hb, dk_pad)
    q5 = q5.transpose(0, 1, 3, 4, 2, 5).reshape(batch, n_blocks, groups, hb * query_block, dk_pad)

    out, lse = _qblock_call(
        q5,
        space.store,
        kb,
        src8,
        counts,
        lim,
        member,
        sm_scale=problem.sm_scale,
        dk=problem.dk,
        dv=problem.dv,
        rb=rb,
        heads_per_group=hb,
        interpret=interpret,
    )
    dv = problem.dv
    out = out.reshape(batch, n_blocks, groups, hb, query_block, dv)
    out = out.transpose(0, 1, 4, 2, 3, 5).reshape(batch, seq_pad, heads, dv)[:, :seq]
    if not return_lse:
        return out
    lse = lse.reshape(batch, n_blocks, groups, hb, query_block)
    lse = lse.transpose(0, 1, 4, 2, 3).reshape(batch, seq_pad, heads)[:, :seq]
    return out, lse
