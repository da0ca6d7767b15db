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
    compare_sparse_mla_grads,
    dirty_ragged_grad_case,
    export_sparse_mla_grad,
    poison_rows,
    run_interpret,
    sparse_mla_flat_case,
)
from jax.experimental.pallas import tpu as pltpu

import attn_pallas_tpu as tpu

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


def _compare(kernel, q, kv, idx, pos, keep_rows, **kw):
    fn, knobs = KERNELS[kernel]
    _, dkv = compare_sparse_mla_grads(
        fn, q, kv, idx, pos, keep_rows, kernel_kw=dict(interpret=INTERPRET, **knobs),
        sm_scale=SM_SCALE, dv=DV, grad_tol=GRAD_TOL, mass_atol=MASS_ATOL, **kw,
    )  # fmt: skip
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
    q, cache, idx, pos, keep, tables = dirty_ragged_grad_case(
        5, seq_lens=[37, 5, 20], new_lens=[4, 0, 3], extra_pages=[1, 0, 1], page_size=16,
        heads=2, top_k=3, dk=DV + ROPE, dtype="float32",
    )  # fmt: skip
    dcache = _compare(kernel, q, cache, idx, pos, keep, **tables)
    assert np.all(dcache.reshape(keep.size, -1)[:, DV + ROPE :] == 0.0)


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
    text = export_sparse_mla_grad(
        fn, "tpu", tokens=512, heads=128, cache=16384, top_k=16, sm_scale=0.04, read_block=128,
        **knobs,
    )  # fmt: skip
    assert text.count("tpu_custom_call") == count


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
