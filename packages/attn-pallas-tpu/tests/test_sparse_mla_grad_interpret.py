"""Sparse MLA training on the TPU backend: interpret mode and cross-lowering (CPU only).

The forward is the kernel (TPU interpret mode: races detected, out-of-bounds reads
raise, uninitialised memory NaN); the backward is the reference's XLA path
(``attn_common.sparse_mla_xla.with_xla_backward``) until a backward kernel lands. The
gradients through both kernels equal the reference's on the same inputs, through
``out`` and ``lse``, with NaN/Inf in every cache row no query attends (their gradient
exactly 0) and NaN in the paged cache's feature padding; ``return_attn_mass`` (on XLA
from the kernel's LSE) matches the reference's. ``jax.export(..., platforms=["tpu"])``
lowers ``jax.grad`` plus the mass at a production shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    attended_rows_flat,
    attended_rows_ragged,
    build_ragged_layout,
    poison_rows,
    randn,
    random_page_selection,
    rng_for,
    run_interpret,
    sparse_mla_flat_case,
)
from jax.experimental.pallas import tpu as pltpu

import attn_pallas_tpu as tpu
import attn_reference as ref

INTERPRET = pltpu.InterpretParams(
    detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan"
)
DV, ROPE = 128, 64
SM_SCALE = 0.07
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)  # the same XLA backward as the reference
MASS_ATOL = 1e-4  # exp(s - lse) with the kernel's LSE
KERNELS = {
    "per_query": (tpu.sparse_mla_attention, {}),
    "qblock": (tpu.sparse_mla_attention_qblock, {"query_block": 8}),
}


def _grads(fn, idx, pos, w_out, w_lse, **kw):
    def loss(q, kv):
        out, lse, mass = fn(
            q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, return_lse=True,
            return_attn_mass=True, **kw,
        )  # fmt: skip
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(w_out * out) + jnp.sum(w_lse * finite), (lse, mass)

    return jax.grad(loss, argnums=(0, 1), has_aux=True)


def _compare(kernel, q, kv, idx, pos, keep_rows, **kw):
    fn, knobs = KERNELS[kernel]
    rng = rng_for(1)
    w_out = jnp.asarray(rng.standard_normal((*q.shape[:3], DV)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    (dq, dkv), (lse, mass) = run_interpret(
        _grads(fn, idx, pos, w_out, w_lse, interpret=INTERPRET, **knobs, **kw), q, kv
    )
    with jax.default_matmul_precision("highest"):
        (ref_dq, ref_dkv), (ref_lse, ref_mass) = _grads(
            ref.sparse_mla_attention, idx, pos, w_out, w_lse, **kw
        )(q, kv)
    assert dq.dtype == q.dtype and dkv.dtype == kv.dtype
    dq, dkv = np.asarray(dq, np.float32), np.asarray(dkv, np.float32)
    assert np.isfinite(dq).all() and np.isfinite(dkv).all()
    np.testing.assert_allclose(dq, np.asarray(ref_dq, np.float32), **GRAD_TOL)
    np.testing.assert_allclose(dkv, np.asarray(ref_dkv, np.float32), **GRAD_TOL)
    rows = dkv.reshape(-1, dkv.shape[-1])
    assert np.all(rows[~keep_rows.reshape(-1)] == 0.0) and (~keep_rows).any()
    assert mass.shape == idx.shape and mass.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(mass), np.asarray(ref_mass), atol=MASS_ATOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    return dkv


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_flat_gradients_through_the_kernels(kernel, dtype):
    q, kv, idx, pos = sparse_mla_flat_case(
        2, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3, dtype=dtype
    )
    keep = attended_rows_flat(idx, pos, kv_len=64, read_block=16)
    _compare(kernel, q, poison_rows(kv, keep, seed=3), idx, pos, keep, read_block=16)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_ragged_gradients_through_the_kernels(kernel):
    rng = rng_for(5)
    page = 16
    layout = build_ragged_layout(
        rng, seq_lens=[37, 5, 20], new_lens=[4, 0, 3], extra_pages=[1, 0, 1], page_size=page
    )
    num_pages = layout["num_pages"]
    cache = randn(rng, (num_pages, page, 1, 256))
    q = randn(rng, (1, 7, 2, DV + ROPE))
    idx = random_page_selection(rng, layout, 3, page)
    keep = attended_rows_ragged(
        layout, idx, layout["positions"], page_size=page, num_pages=num_pages
    )
    rows = poison_rows(cache.reshape(num_pages * page, -1), keep, seed=6)
    rows[:, DV + ROPE :] = np.nan  # the feature padding
    tables = {k: layout[k] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")}
    dcache = _compare(
        kernel, q, rows.reshape(cache.shape), idx[None], layout["positions"][None], keep,
        read_block=page, page_size=page, **tables,
    )  # fmt: skip
    assert np.all(dcache.reshape(num_pages * page, -1)[:, DV + ROPE :] == 0.0)


# Per-query kernel; query-blocked with QB 64; automatic tiling (a lax.cond between the
# two kernels under jit).
EXPORTED = {
    "per_query": (tpu.sparse_mla_attention, {}, 1),
    "qblock_qb64": (tpu.sparse_mla_attention_qblock, {"query_block": 64}, 1),
    "qblock_auto": (tpu.sparse_mla_attention_qblock, {}, 2),
}


@pytest.mark.parametrize("kernel", list(EXPORTED))
def test_grad_cross_lowers_for_tpu(kernel):
    """``jax.grad`` through out and lse, plus the mass: 512 tokens, 128 heads, top-16
    units of 128 tokens of a 16K flat cache, Dk 576 / Dv 512."""
    fn, knobs, count = EXPORTED[kernel]
    tokens, heads, unit, top_k, cache = 512, 128, 128, 16, 16384

    def f(q, kv, idx, pos):
        def loss(q, kv):
            out, lse, mass = fn(
                q, kv, idx, pos, sm_scale=0.04, read_block=unit, return_lse=True,
                return_attn_mass=True, **knobs,
            )  # fmt: skip
            return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), mass

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(q, kv)

    structs = [
        jax.ShapeDtypeStruct((1, tokens, heads, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, cache, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, tokens, top_k), jnp.int32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    ]
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*structs)
    assert exported.mlir_module().count("tpu_custom_call") == count
    dq, dkv, mass = exported.out_avals
    assert dq.shape == structs[0].shape and dq.dtype == jnp.bfloat16
    assert dkv.shape == structs[1].shape and dkv.dtype == jnp.bfloat16
    assert mass.shape == (1, tokens, top_k) and mass.dtype == jnp.float32


def test_integer_inputs_get_float0_cotangents():
    """``jax.vjp`` over every positional input of the kernel path: ``float0`` for the
    indices and positions (the custom_vjp gives the integer tables no cotangent)."""
    q, kv, idx, pos = sparse_mla_flat_case(
        9, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3, dtype="bfloat16"
    )

    def f(q, kv, idx, pos):
        return tpu.sparse_mla_attention(
            q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=16,
            interpret=INTERPRET,
        )  # fmt: skip

    out, vjp = run_interpret(jax.vjp, f, q, kv, jnp.asarray(idx), jnp.asarray(pos))
    dq, dkv, didx, dpos = vjp(jnp.ones_like(out))
    assert dq.dtype == jnp.bfloat16 and dkv.dtype == jnp.bfloat16
    assert didx.dtype == jax.dtypes.float0 and dpos.dtype == jax.dtypes.float0
