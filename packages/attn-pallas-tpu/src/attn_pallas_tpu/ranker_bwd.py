"""Ranker attention backward for TPU: a dq kernel and a dk/dv kernel (Pallas Mosaic TPU).

Math (per query head ``h``, kv head ``g = h // (Hq / Hkv)``, ``lse`` natural log from the
forward): ``y = cap(q.k * sm_scale)``, ``p = exp(y - lse)`` on allowed pairs (0
elsewhere), ``dp = dO . v``, ``delta' = sum_d dO * O - dlse`` (the LSE cotangent enters
here), ``ds = p * (dp - delta') * cap'(q.k * sm_scale)``; ``dq = sm_scale * sum_j ds_ij
k_j``, ``dk_j = sm_scale * sum_{h in group, i} ds_ij q_i``, ``dv_j = sum_{h in group, i}
p_ij dO_i``.

Preprocessing (plain XLA, outside the kernels): ``delta'`` ``[B, Hq, 1, R]`` f32 (``R``
the forward's q rows, ``ranker_fwd.q_rows``: q, dO, the LSE, ``delta'`` and dq keep
``S`` rows where one q tile fits, the last tile running past them; k, v, dk and dv are
padded to ``S_pad``);
the LSE goes in base 2 (``log2(e) * lse``: the kernels take ``p = exp2(log2(e) y -
log2(e) lse)``, ``log2(e)`` folded into the cap's multiplies), and the LSE of rows with
no allowed key is replaced by ``+inf`` (so ``p = 0``, never ``-inf - -inf``) and their
LSE cotangent by 0, so their gradients are exactly 0.

Schedule
--------
* ``dq`` kernel, grid ``(B, Hq / Hp, q_tiles, kv_steps)`` (``parallel x 3,
  arbitrary``): the forward's schedule, ``Hp`` query heads of one kv head a program
  (``RankerStatic.heads_per_program``). The same scalar-prefetched table of
  ``attn_common.bounds.ranker_kv_block_ranges`` drives the K/V index maps (visit-once blocks,
  fetched once for the ``Hp`` heads; steps past the tile's count clamp to its last
  block, so no DMA is issued, and ``pl.when`` skips them). Q, dO, lse and delta' are
  fetched once per ``(b, h, i)``. Per step and head: ``S = Q K^T``, ``dP = dO V^T`` on
  the MXU, the cap and its derivative (``attn_common.cap.cap_scaled_with_derivative``), the
  mask (built once a step for the heads) only on steps outside
  ``attn_common.bounds.ranker_full_kv_steps``, then ``dQ += dS K`` into the head's f32 VMEM
  accumulator, written (times ``sm_scale``) at the last step.
* ``dk/dv`` kernel, grid ``(B, Hkv, kv_tiles, group / Hp * q_steps)`` (``parallel x 3,
  arbitrary``): a program row owns ``block_kv`` keys of one (batch row, kv head); its
  K and V tiles are fetched once. The inner axis walks the group's query heads ``Hp``
  at a time (head block ``step // q_steps``; a masked step's mask built once for them)
  and, per head block, the query blocks of
  ``attn_common.bounds.ranker_q_block_ranges`` (the transpose of the forward's rule) from a
  second scalar-prefetched table; past the tile's count the index maps clamp to the
  head's last visited block. Per step it computes the transposed tiles ``S^T = K Q^T``
  and ``dP^T = V dO^T`` (so the lse / delta' rows broadcast along sublanes, no
  transpose), the mask only on steps outside ``attn_common.bounds.ranker_full_q_steps``, and
  ``dV += P^T dO``, ``dK += dS^T Q`` into f32 VMEM accumulators, written at the last
  step. GQA gradients are summed over the group's heads inside the kernel: there are
  no per-query-head dK/dV copies and no atomics.

Both kernels accumulate in a fixed order, so the gradients are deterministic (bitwise
identical on repeated runs). Every program writes its whole output tile (zeros when it
has no step), so padding rows and keys nobody attends get exactly 0. The rows of a last
q tile past ``S`` (unspecified when read, dropped when written) attend no key, so,
as any such row below, they only ever meet masked steps.

Isolation (docs/semantics.md; the forward's docstring has the argument). On masked
steps ``p`` and ``ds`` of a masked pair are selected to 0 (not multiplied: ``dP = dO
V^T`` of a pair is garbage when either row is, e.g. 1e30 * 1e30 = inf, and so may the
cap derivative of a garbage logit be). The multiplied operand of each product over
positions has its non-finite elements replaced by 0, and every row that attends a row
holding one gets NaN added to its accumulator: K for ``dQ += dS K`` (queries that attend
a non-finite key), Q and dO for ``dK += dS^T Q`` and ``dV += P^T dO`` (keys attended by a
query whose q or dO is non-finite in any of the step's ``Hp`` heads: the flags are
OR-ed over the heads and the NaN added once a step). Full steps are unchanged. Rows with
no allowed key never see a full step, so their own q and dO never matter either.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attn_common.cap import cap_scaled_with_derivative
from attn_pallas_tpu._prep import resolve_interpret
from attn_pallas_tpu.ranker_config import (
    DIMENSION_SEMANTICS,
    VMEM_LIMIT_BYTES,
    RankerStatic,
    dkv_scratch,
    dq_scratch,
)
from attn_pallas_tpu.ranker_fwd import (
    LOG2E,
    TileSteps,
    dot,
    finite_or_zero,
    from_kernel_layout,
    head_of,
    kernel_shape,
    kv_step_table,
    masked_kv_step,
    nan_where_attended,
    newton_reciprocal,
    prepare,
    q_rows,
    q_step_table,
    q_tile_index_maps,
    row_block_spec,
    row_to_col,
    stat_block_spec,
    tile_mask,
    to_kernel_layout,
    walk_tile,
)

__all__ = ["ranker_attention_bwd"]


def _probs_and_dlogits(raw, lse2, dp, delta, st: RankerStatic, allowed):
    """``p`` and ``ds`` (w.r.t. the raw ``q.k``, before ``sm_scale``) of one tile, from
    the LSE in base 2 (``lse2 = log2(e) * lse``): ``p = exp2(log2(e) y - lse2)``, the
    ``log2(e)`` folded into the cap's multiplies."""
    y2, dcap = cap_scaled_with_derivative(
        raw, st.cap, st.sm_scale, out_scale=LOG2E, reciprocal=newton_reciprocal
    )
    p = jnp.exp2(y2 - lse2)
    ds = p * (dp - delta)
    if dcap is not None:
        ds = ds * dcap
    if allowed is not None:  # selects: a masked pair is 0 whatever its dp, lse or logit
        p = jnp.where(allowed, p, 0.0)
        ds = jnp.where(allowed, ds, 0.0)
    return p, ds


def _build_dq_kernel(st: RankerStatic):
    bq, heads = st.block_q, st.heads_per_program

    def kernel(
        # scalar prefetch (SMEM)
        bounds_ref,  # [B * 4] or [B * U * 4] int32: the clipped bounds
        tab_ref,  # [B * q_tiles * words] int32: each q tile's KV steps (kv_step_table)
        # inputs (VMEM blocks; head g of a heads block at head_of(st, g))
        q_ref,  # [block_q, Hp * D] or [Hp, block_q, D]: Hp query heads of one kv head
        k_ref,  # [block_kv, D]
        v_ref,  # [block_kv, D]
        do_ref,  # as q_ref
        lse_ref,  # [Hp, 1, block_q] f32, log2(e) * LSE (+inf on rows with no key)
        delta_ref,  # [Hp, 1, block_q] f32
        # outputs
        dq_ref,  # as q_ref
        # scratch (dq_scratch)
        acc,  # [Hp, block_q, D] f32
    ):
        def init():
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

        def step(i, j, steps, bounds, masked: bool):
            k, v = k_ref[...], v_ref[...]
            allowed, k_clean, poison = None, k, 0.0
            if masked:  # once for the heads; isolation: no 0 * NaN from unattended K rows
                allowed, k_clean, poison = masked_kv_step(st, bounds, steps, i, j, k)
            for g in range(heads):
                head = head_of(st, g)
                raw = dot(q_ref[head], k, trans_b=True)  # (bq, bkv)
                dp = dot(do_ref[head], v, trans_b=True)
                lse = row_to_col(lse_ref[g], bq)
                delta = row_to_col(delta_ref[g], bq)
                _, ds = _probs_and_dlogits(raw, lse, dp, delta, st, allowed)
                d = dot(ds.astype(k.dtype), k_clean)
                acc[g] += d + poison if masked else d

        def finish():
            for g in range(heads):
                dq_ref[head_of(st, g)] = (acc[g] * st.sm_scale).astype(dq_ref.dtype)

        walk_tile(
            st, tab_ref, bounds_ref, tiles=st.q_tiles, steps=st.kv_tiles, init=init, step=step,
            finish=finish,
        )  # fmt: skip

    return kernel


def _build_dkv_kernel(st: RankerStatic):
    bq, bkv, heads = st.block_q, st.block_kv, st.heads_per_program
    q_steps = st.q_tiles

    def kernel(
        # scalar prefetch (SMEM)
        bounds_ref,  # [B * 4] or [B * U * 4] int32: the clipped bounds
        tab_ref,  # [B * kv_tiles * words] int32: each kv tile's query steps (q_step_table)
        # inputs (VMEM blocks; head g of a heads block at head_of(st, g))
        k_ref,  # [block_kv, D]: the tile's keys of one kv head
        v_ref,  # [block_kv, D]
        q_ref,  # [block_q, Hp * D] or [Hp, block_q, D]: the step's queries of Hp heads
        do_ref,  # as q_ref
        lse_ref,  # [Hp, 1, block_q] f32, log2(e) * LSE (+inf on rows with no key)
        delta_ref,  # [Hp, 1, block_q] f32
        # outputs
        dk_ref,  # [block_kv, D]
        dv_ref,  # [block_kv, D]
        # scratch (dkv_scratch)
        dk_acc,  # [block_kv, D] f32
        dv_acc,  # [block_kv, D] f32
    ):
        def init():
            dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

        def step(t, s, steps, bounds, masked: bool):
            k, v = k_ref[...], v_ref[...]
            allowed = None
            if masked:  # once for the heads
                q0 = steps.block_at(s) * bq
                allowed = tile_mask(bounds, q0, t * bkv, (bkv, bq), q_axis=1)
            bad = None  # (1, bq): query rows non-finite in some head's Q or dO
            for g in range(heads):
                q, do = q_ref[head_of(st, g)], do_ref[head_of(st, g)]
                raw = dot(k, q, trans_b=True)  # S^T (bkv, bq)
                dp = dot(v, do, trans_b=True)  # dP^T
                p, ds = _probs_and_dlogits(raw, lse_ref[g], dp, delta_ref[g], st, allowed)
                if masked:  # isolation: no 0 * NaN from Q / dO rows that do not attend a key
                    q, bad_q = finite_or_zero(q, bq)
                    do, bad_do = finite_or_zero(do, bq)
                    bad_g = jnp.maximum(bad_q, bad_do)
                    bad = bad_g if bad is None else jnp.maximum(bad, bad_g)
                dv_acc[...] += dot(p.astype(do.dtype), do)
                dk_acc[...] += dot(ds.astype(q.dtype), q)
            if masked:  # the keys that attend a flagged row, once for the heads
                poison = nan_where_attended(allowed, bad)
                dv_acc[...] += poison
                dk_acc[...] += poison

        def finish():
            dk_ref[...] = (dk_acc[...] * st.sm_scale).astype(dk_ref.dtype)
            dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

        walk_tile(
            st, tab_ref, bounds_ref, tiles=st.kv_tiles, steps=st.group_size // heads * q_steps,
            init=init, step=step, finish=finish, step_of=lambda j: lax.rem(j, jnp.int32(q_steps)),
        )  # fmt: skip

    return kernel


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def _bwd_padded(q, k, v, do, lse, delta, bounds, *, st: RankerStatic, interpret):
    """Kernel-layout q / dO (``R`` rows) and k / v (``S_pad``); lse, delta' ``[B, Hq, 1,
    R]``; clipped bounds."""
    group, q_steps = st.group_size, st.q_tiles
    flat_bounds = bounds.reshape(-1)
    params = pltpu.CompilerParams(
        dimension_semantics=DIMENSION_SEMANTICS, vmem_limit_bytes=VMEM_LIMIT_BYTES
    )

    # ---- dq
    kv_tab = kv_step_table(bounds, st)
    q_index, kv_index = q_tile_index_maps(st)

    heads = st.heads_per_program
    q_spec = row_block_spec(st, st.block_q, q_index, heads)
    kv_spec = row_block_spec(st, st.block_kv, kv_index)
    stat_spec = stat_block_spec(st.block_q, q_index, heads)
    dq = pl.pallas_call(
        _build_dq_kernel(st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=st.grid("dq"),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec],
            out_specs=q_spec,
            scratch_shapes=dq_scratch(st.block_q, st.head_dim, heads),
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
    )(flat_bounds, kv_tab, q, k, v, do, lse, delta)

    # ---- dk, dv
    q_tab = q_step_table(bounds, st)

    def own_index(b, g, t, j, bounds_ref, tab_ref):
        return b, g, t

    def head_q_index(b, g, t, j, bounds_ref, tab_ref):  # head blocks of Hp heads
        steps = TileSteps(tab_ref, b * st.kv_tiles + t, st.runs)
        head = g * (group // heads) + lax.div(j, jnp.int32(q_steps))
        return b, head, steps.clamped_block(lax.rem(j, jnp.int32(q_steps)))

    own_spec = row_block_spec(st, st.block_kv, own_index)
    hq_spec = row_block_spec(st, st.block_q, head_q_index, heads)
    hstat_spec = stat_block_spec(st.block_q, head_q_index, heads)
    dk, dv = pl.pallas_call(
        _build_dkv_kernel(st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=st.grid("dkv"),
            in_specs=[own_spec, own_spec, hq_spec, hq_spec, hstat_spec, hstat_spec],
            out_specs=[own_spec, own_spec],
            scratch_shapes=dkv_scratch(st.block_kv, st.head_dim),
        ),
        out_shape=[jax.ShapeDtypeStruct(kernel_shape(st, st.kv_heads), k.dtype)] * 2,
        compiler_params=params,
        interpret=interpret,
    )(flat_bounds, q_tab, k, v, q, do, lse, delta)
    return dq, dk, dv


def ranker_attention_bwd(
    q, k, v, bounds, out, lse, dout, dlse=None, *, sm_scale=None, cap=None, config=None,
    interpret=False,
):  # fmt: skip
    """Gradients ``(dq, dk, dv)`` of ranker attention (see the module docstring).

    Args:
      q, k, v, bounds, sm_scale, cap, config, interpret: as given to the forward.
      out: ``[B, S, Hq, D]`` the forward's output; lse: ``[B, Hq, S]`` float32 its LSE.
      dout: ``[B, S, Hq, D]`` cotangent of ``out``; dlse: ``[B, Hq, S]`` cotangent of
        ``lse`` or ``None`` (zero).

    Returns ``dq [B, S, Hq, D]``, ``dk, dv [B, S, Hkv, D]`` in the inputs' dtype.
    """
    problem, st, clipped = prepare(q, k, v, bounds, sm_scale=sm_scale, cap=cap, config=config)
    seq = problem.seq_len
    lse = lse.astype(jnp.float32)
    empty = jnp.isneginf(lse)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,S,Hq]
    delta = jnp.moveaxis(delta, 1, 2)
    if dlse is not None:
        delta = delta - jnp.where(empty, 0.0, dlse.astype(jnp.float32))
    delta = jnp.where(empty, 0.0, delta)
    lse = jnp.where(empty, jnp.inf, lse * LOG2E)  # base 2, as the kernels' exp2 takes it

    rows = q_rows(st, seq)

    def stat(x):
        return jnp.pad(x, ((0, 0), (0, 0), (0, rows - seq)))[:, :, None, :]

    dq, dk, dv = _bwd_padded(
        to_kernel_layout(q, st, rows),
        to_kernel_layout(k, st),
        to_kernel_layout(v, st),
        to_kernel_layout(dout.astype(q.dtype), st, rows),
        stat(lse),
        stat(delta),
        clipped,
        st=st,
        interpret=resolve_interpret(interpret),
    )
    return (
        from_kernel_layout(dq, st, problem.q_heads, seq),
        from_kernel_layout(dk, st, problem.kv_heads, seq),
        from_kernel_layout(dv, st, problem.kv_heads, seq),
    )
