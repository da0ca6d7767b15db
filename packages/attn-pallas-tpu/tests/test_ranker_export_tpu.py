"""Cross-lowering of the TPU ranker kernels at the four suite shapes (nothing executes).

``jax.export`` with ``platforms=["tpu"]`` traces the forward and ``jit(grad(loss))`` of
``attn_pallas_tpu.ranker_attention`` and lowers every Pallas kernel to Mosaic on a
CPU-only machine, at the shapes of ``attn_common.RANKER_SUITE`` (bf16, each case's cap).
It catches tracing and Pallas->Mosaic lowering errors; Mosaic's TPU compiler passes
(layouts, VMEM limits) need a TPU. The module holds exactly one Mosaic kernel for the
forward and three for the gradient (forward, dq, dk/dv), plus, on the ``"row"`` softmax
(the suite's soft_sign 80), the running-max forward in the ``lax.cond`` branch that runs
the rows the row offsets cannot serve again; GQA needs no extra kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import export_tpu

from attn_common import RANKER_SUITE
from attn_pallas_tpu import ranker_attention

SD = jax.ShapeDtypeStruct


def _again(case) -> int:
    """1 where the case's forward takes the ``"row"`` softmax (its ``lax.cond`` branch holds
    the running-max forward), else 0."""
    from attn_pallas_tpu.ranker_config import RankerStatic

    static = RankerStatic(1, 128, 1, 1, case.head_dim, 1.0, case.cap, block_q=128, block_kv=128)
    return int(static.softmax == "row")


def _avals(case, dtype=jnp.bfloat16):
    q = SD((case.batch, case.seq_len, case.q_heads, case.head_dim), dtype)
    kv = SD((case.batch, case.seq_len, case.kv_heads, case.head_dim), dtype)
    return q, kv, kv, SD((case.batch, 4), jnp.int32)


def _suite(*quick):
    """The suite's cases, the ``quick`` ones in the default tier and the rest slow."""
    return pytest.mark.parametrize(
        "case",
        [
            pytest.param(c, id=c.name, marks=[] if c.name in quick else [pytest.mark.slow])
            for c in RANKER_SUITE
        ],
    )


# Quick: phoenix; the quick gradient cases below lower the forward kernel too (the bounds
# of the ragged case are values, its kernels phoenix's).
@_suite("phoenix")
def test_export_forward(case):
    def f(q, k, v, bounds):
        return ranker_attention(q, k, v, bounds, cap=case.cap, return_lse=True)

    exported = export_tpu(f, *_avals(case), kernels=1 + _again(case))
    out, lse = exported.out_avals
    assert out.shape == (case.batch, case.seq_len, case.q_heads, case.head_dim)
    assert out.dtype == jnp.bfloat16
    assert lse.shape == (case.batch, case.q_heads, case.seq_len) and lse.dtype == jnp.float32


@_suite("phoenix", "long", "small-d64")  # soft_sign 80, tanh 30, no cap at D = 64
def test_export_gradient(case):
    def g(q, k, v, bounds):
        def loss(q, k, v):
            out, lse = ranker_attention(q, k, v, bounds, cap=case.cap, return_lse=True)
            z = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
            return jnp.sum(out.astype(jnp.float32)) + z

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    exported = export_tpu(g, *_avals(case), kernels=3 + _again(case))
    dq, dk, dv = exported.out_avals
    assert dq.shape == (case.batch, case.seq_len, case.q_heads, case.head_dim)
    assert dk.shape == dv.shape == (case.batch, case.seq_len, case.kv_heads, case.head_dim)


def test_export_fp32_d256_odd_seq():
    """fp32 (HIGHEST-precision matmuls) and D=256 at an odd S also lower (no cap: the
    ``"row"`` softmax, whose ``lax.cond`` holds the running-max forward too)."""

    def g(q, k, v, bounds):
        def loss(q, k, v):
            return jnp.sum(ranker_attention(q, k, v, bounds))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q = SD((2, 777, 8, 256), jnp.float32)
    kv = SD((2, 777, 2, 256), jnp.float32)
    export_tpu(g, q, kv, kv, SD((2, 4), jnp.int32), kernels=4)


def test_export_heads_major_layout_at_phoenix(monkeypatch):
    """Where the TPU lays q out heads-major by default (a v5e does at phoenix's 20
    heads; a CPU never does), the forward and gradient lower with the ``[B, H, S, D]``
    kernel layout at phoenix's shape: q enters the kernels as ``[64, 20, 1152, 128]``."""
    from attn_pallas_tpu import ranker_fwd

    case = next(c for c in RANKER_SUITE if c.name == "phoenix")
    monkeypatch.setattr(ranker_fwd, "default_major_to_minor", lambda shape, dtype: (0, 2, 1, 3))

    def g(q, k, v, bounds):
        def loss(q, k, v):
            out, lse = ranker_attention(q, k, v, bounds, cap=case.cap, return_lse=True)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    exported = export_tpu(g, *_avals(case), kernels=3 + _again(case))
    heads_major = f"tensor<{case.batch}x{case.q_heads}x{case.seq_len}x{case.head_dim}xbf16>"
    assert heads_major in exported.mlir_module()
    dq, dk, _ = exported.out_avals
    assert dq.shape == (case.batch, case.seq_len, case.q_heads, case.head_dim)
    assert dk.shape == (case.batch, case.seq_len, case.kv_heads, case.head_dim)
