"""Every matmul inside the TPU kernels multiplies float32 operands at ``HIGHEST``.

A TPU multiplies float32 operands in one bfloat16 pass unless asked otherwise; interpret
mode computes in float32 either way, so only the traced kernels can show it here. On a
TPU v5e (jax 0.10.2) the sparse-MLA kernels, whose matmuls did not ask, missed the float32
conformance tolerance (2.5e-3 rel L2 against 2e-5), while the ranker kernels, which did,
passed it (``attn_pallas_tpu._mxu``). This walks the jaxprs of the forward and backward
kernels of both ops (every ``pallas_call`` body, loops included) and checks the
``precision`` of each ``dot_general`` by its operands' dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sparse_mla_flat_case, sparse_mla_loss_grad

import attn_pallas_tpu as tpu
from attn_common import CapMethod, CapParams

HIGHEST = jax.lax.Precision.HIGHEST


def _subjaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def kernel_dots(jaxpr, inside: bool = False):
    """``(operand dtypes, precision)`` of every ``dot_general`` inside a ``pallas_call``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and inside:
            dtypes = tuple(jnp.dtype(v.aval.dtype) for v in eqn.invars)
            yield dtypes, eqn.params["precision"]
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                yield from kernel_dots(sub, inside or eqn.primitive.name == "pallas_call")


def _check(fn, *args):
    dots = list(kernel_dots(jax.make_jaxpr(fn)(*args).jaxpr))
    assert dots, "no matmul found inside a kernel (the walk missed the pallas_call bodies)"
    for dtypes, precision in dots:
        if jnp.dtype(jnp.float32) in dtypes:
            assert precision == (HIGHEST, HIGHEST), f"{dtypes}: precision {precision}"
        else:
            assert precision is None, f"{dtypes}: precision {precision}"
    return dots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["sparse_mla_attention", "sparse_mla_attention_qblock"])
def test_sparse_mla_kernels_forward_and_backward(kernel, dtype):
    q, kv, idx, pos = sparse_mla_flat_case(
        0, dk=192, batch=1, seq=8, heads=4, kv_len=64, rb=16, top_k=3, dtype=dtype
    )
    w_out = jnp.ones((1, 8, 4, 128), jnp.float32)
    w_lse = jnp.ones((1, 8, 4), jnp.float32)
    grad = sparse_mla_loss_grad(
        getattr(tpu, kernel), idx, pos, w_out, w_lse, sm_scale=0.07, dv=128, read_block=16,
        interpret=True,
    )  # fmt: skip
    dots = _check(grad, q, kv)
    # The forward and both backward kernels: 2 + 3 + 4 matmuls at least.
    assert len(dots) >= 9


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ranker_kernels_forward_and_backward(dtype):
    key = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, 256, 2, 64), dtype) for kk in key)
    bounds = np.array([[0, 100, 100, 120]], np.int32)

    def loss(q, k, v):
        out = tpu.ranker_attention(
            q, k, v, bounds, cap=CapParams(CapMethod.TANH, 30.0), interpret=True
        )
        return jnp.sum(out.astype(jnp.float32))

    _check(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
