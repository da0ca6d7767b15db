"""Sparse MLA training on the Hopper backend, checked on the CPU (no GPU needed).

The forward and the backward are the kernels (Mosaic GPU interpret mode here: race
detection on, shared memory starts as NaN; the backward kernel
``sparse_mla_bwd_kernel`` from the forward's saved ``out`` and ``lse``). So:

* the gradients through the kernel equal the reference's float32 ones on the same bf16
  inputs within the bf16 products' error (the TPU kernels' tolerance), through ``out`` and ``lse``,
  with NaN/Inf in every cache row no query attends (their gradient exactly 0), flat
  unit- and token-level and ragged paged, and through the write-then-attend wrapper's
  split query;
* ``return_attn_mass`` (on XLA from the kernel's LSE) matches the reference's within
  bf16 tolerance, is ``stop_gradient``, and the tuple order is ``(out, lse, mass)``;
* ``jax.export(..., platforms=["cuda"])`` lowers ``jax.grad`` at the benchmark shape
  (4096 tokens, top-2048 tokens, 128 and 64 heads): the forward and backward kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    attended_rows_flat,
    check_wrapper_query_grads,
    compare_sparse_mla_grads,
    dirty_ragged_grad_case,
    export_sparse_mla_grad,
    gpu_interpret,
    poison_rows,
    randn,
    rng_for,
    run_interpret,
    sparse_mla_flat_case,
)

import attn_mosaic_gpu as gpu
import attn_reference as ref
from attn_mosaic_gpu import sparse_mla_bwd_kernel

INTERPRET = gpu_interpret()
DV, ROPE = 128, 64
SM_SCALE = 0.07
GRAD_TOL = dict(rtol=1e-2, atol=2e-2)  # bf16 products, float32 sums (as the TPU kernels)
MASS_ATOL = 1e-4  # exp(s - lse) with the kernel's LSE (float32 sums of the bf16 inputs)


def _compare(q, kv, idx, pos, keep_rows, **kw):
    return compare_sparse_mla_grads(
        gpu.sparse_mla_attention, q, kv, idx, pos, keep_rows, kernel_kw=dict(interpret=INTERPRET),
        sm_scale=SM_SCALE, dv=DV, grad_tol=GRAD_TOL, mass_atol=MASS_ATOL, **kw,
    )  # fmt: skip


# units (28 s) in the slow tier: the quick tier's [tokens] runs the same forward and
# backward kernels (and the conformance suite runs the unit-level forward).
@pytest.mark.parametrize(
    "rb", [pytest.param(16, marks=pytest.mark.slow), 1], ids=["units", "tokens"]
)
def test_flat_gradients_through_the_kernel(rb):
    """Flat mode, dirty cache: gradients equal the reference's, unattended rows get 0."""
    if rb > 1:
        q, kv, idx, pos = sparse_mla_flat_case(
            2, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3,
            dtype="bfloat16",
        )  # fmt: skip
    else:
        rng = rng_for(3)
        q = randn(rng, (1, 4, 2, DV + ROPE), "bfloat16")
        kv = randn(rng, (1, 80, DV + ROPE), "bfloat16")
        idx = rng.integers(-1, 84, size=(1, 4, 24)).astype(np.int32)
        idx[0, 0, 1] = idx[0, 0, 0]  # a duplicate token
        idx[0, 2] = -1  # nothing selected
        pos = np.asarray([[79, 40, 60, 5]], np.int32)
    keep = attended_rows_flat(idx, pos, kv_len=kv.shape[1], read_block=rb)
    dirty = poison_rows(kv, keep, seed=4)
    _compare(q, dirty, idx, pos, keep, read_block=rb)


@pytest.mark.slow  # 14-22 s in interpret mode on the shared CPU
def test_ragged_gradients_through_the_kernel():
    q, cache, idx, pos, keep, tables = dirty_ragged_grad_case(
        5, seq_lens=[37, 20], new_lens=[4, 3], extra_pages=[1, 0], page_size=16, heads=2,
        top_k=3, dk=DV + ROPE, dtype="bfloat16",
    )  # fmt: skip
    _, dcache = _compare(q, cache, idx, pos, keep, **tables)
    assert np.all(dcache.reshape(keep.size, -1)[:, DV + ROPE :] == 0.0)


@pytest.mark.slow  # 14-22 s in interpret mode on the shared CPU
def test_mass_alone_is_stop_gradient_and_tuple_order():
    q, kv, idx, pos = sparse_mla_flat_case(
        7, dk=DV + ROPE, batch=1, seq=8, heads=2, kv_len=64, rb=16, top_k=3, dtype="bfloat16"
    )

    def mass_loss(q, kv):
        out, mass = gpu.sparse_mla_attention(
            q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=DV, read_block=16,
            return_attn_mass=True, interpret=INTERPRET,
        )  # fmt: skip
        assert out.shape == (*q.shape[:3], DV) and mass.shape == idx.shape
        return jnp.sum(mass**2)

    dq, dkv = run_interpret(jax.jit(jax.grad(mass_loss, argnums=(0, 1))), q, kv)  # one program
    assert not np.asarray(dq, np.float32).any() and not np.asarray(dkv, np.float32).any()


@pytest.mark.slow  # 14-22 s in interpret mode on the shared CPU
def test_prefill_wrapper_gradient_reaches_the_split_query():
    """The wrapper's kernel reads ``ql`` and ``qpe`` apart (a tuple query): the backward
    gives each its own cotangent, equal to the reference wrapper's."""
    check_wrapper_query_grads(
        gpu.prefill_write_and_attend_ragged, ref.prefill_write_and_attend_ragged,
        dv=DV, sm_scale=SM_SCALE, tol=GRAD_TOL, interpret=INTERPRET,
    )  # fmt: skip


# One lowering in the quick tier (h64: the atomics path, which interpret mode cannot
# run); h128 and the deterministic path (parts and fixed-order sums, the path interpret
# mode takes in test_flat_gradients_through_the_kernel) are slow.
@pytest.mark.parametrize(
    "heads, deterministic",
    [pytest.param(128, False, marks=pytest.mark.slow), (64, False),
     pytest.param(128, True, marks=pytest.mark.slow)],
    ids=["h128", "h64", "h128-deterministic"],
)  # fmt: skip
def test_grad_cross_lowers_for_cuda(heads, deterministic):
    """``jax.grad`` (through out and lse) plus the attention mass, at the benchmark
    shape: 4096 tokens, top-2048 tokens of a 32K flat cache, Dk 576 / Dv 512; the
    deterministic path in as many launches as its token chunks."""
    text = export_sparse_mla_grad(
        gpu.sparse_mla_attention, "cuda", tokens=4096, heads=heads, cache=32768, top_k=2048,
        sm_scale=0.0721, read_block=1, deterministic=deterministic,
    )  # fmt: skip
    assert text.count("mosaic_gpu") >= 1
    # the backward kernel, not XLA's backward (deterministic: one build per chunk size)
    chunks = sparse_mla_bwd_kernel._token_chunks(4096, heads // 64, 2048, 576)
    builds = len({n for _, n in chunks}) if deterministic else 1
    assert text.count("sparse_mla_backward_mosaic_gpu") == builds
    assert ("st.global.v4.f32" in text) == deterministic  # the parts' stores


@pytest.mark.slow  # about 20 s in interpret mode on the shared CPU
def test_deterministic_token_chunks(monkeypatch):
    """The deterministic path one token per launch (``PARTS_BYTES`` below one token's
    parts): the same gradients as the reference, and the same bits twice."""
    monkeypatch.setattr(sparse_mla_bwd_kernel, "PARTS_BYTES", 1)
    q, kv, idx, pos = sparse_mla_flat_case(
        9, dk=DV + ROPE, batch=1, seq=7, heads=3, kv_len=64, rb=16, top_k=3, dtype="bfloat16"
    )
    keep = attended_rows_flat(idx, pos, kv_len=kv.shape[1], read_block=16)
    dirty = poison_rows(kv, keep, seed=2)

    def run():
        return compare_sparse_mla_grads(
            gpu.sparse_mla_attention, q, dirty, idx, pos, keep, sm_scale=SM_SCALE, dv=DV,
            kernel_kw=dict(interpret=INTERPRET, deterministic=True), grad_tol=GRAD_TOL,
            mass_atol=MASS_ATOL, read_block=16,
        )  # fmt: skip

    for a, b in zip(run(), run(), strict=True):
        np.testing.assert_array_equal(a, b)
