"""Every backend under ``jax_enable_x64``: a user whose program enables 64-bit types gets
the same bits as without, forward and gradients, from each op (ranker attention and
sparse MLA; kernels in interpret mode on the CPU). Python integers become int64 there, so
an index computation that mixes them with the kernels' int32 values would fail to trace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import RANKER, SPARSE_MLA, params
from helpers import attended_rows_flat, poison_rows, randn, rng_for

from attn_common import CapMethod, CapParams


def _both(fn, *args):
    """``fn(*args)`` without and with 64-bit types, as NumPy trees. The flag is set
    globally for the second call, not by the thread-local ``jax.enable_x64`` context:
    the interpreters run kernels in callbacks on other threads, which must see it too."""
    plain = jax.tree.map(np.asarray, fn(*args))
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        wide = jax.tree.map(np.asarray, fn(*args))
    finally:
        jax.config.update("jax_enable_x64", was)
    return plain, wide


def _assert_same(plain, wide):
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(wide), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", params(SPARSE_MLA))
def test_sparse_mla_same_bits_under_x64(backend):
    backend.require()
    read_block = 1 if backend.read_block_1 else 16  # token-level where the backend takes it
    fn = backend.module().sparse_mla_attention
    kw = dict(backend.call_kwargs(), sm_scale=576**-0.5, read_block=read_block)
    rng = rng_for(7)
    kv_len, seq, heads = 40, 3, 16
    q = jnp.asarray(randn(rng, (1, seq, heads, 576), np.float32), jnp.bfloat16)
    idx = rng.integers(-1, -(-kv_len // read_block) + 2, (1, seq, 4)).astype(np.int32)
    idx[0, 0] = -1  # nothing selected
    idx[0, 1, 1] = idx[0, 1, 0]  # a duplicate
    pos = np.asarray([[3, 20, 39]], np.int32)
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=read_block)
    kv = poison_rows(randn(rng, (1, kv_len, 576), np.float32), keep, seed=7)
    kv = jnp.asarray(kv, jnp.bfloat16)
    w = jnp.asarray(randn(rng, (1, seq, heads, 512), np.float32))

    def run(q, kv):
        def loss(q, kv):
            out, lse = fn(q, kv, idx, pos, return_lse=True, **kw)
            return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        (out, lse), mass = (
            fn(q, kv, idx, pos, return_lse=True, **kw),
            fn(q, kv, idx, pos, return_attn_mass=True, **kw)[-1],
        )
        return out, lse, mass, jax.grad(loss, (0, 1))(q, kv)

    plain, wide = _both(run, q, kv)
    _assert_same(plain, wide)
    assert np.isfinite(plain[3][1]).all()  # the dirty rows stay out of the gradient


@pytest.mark.parametrize("backend", params(RANKER))
def test_ranker_same_bits_under_x64(backend):
    backend.require()
    fn = backend.module().ranker_attention
    kw = backend.call_kwargs()
    if backend.config is not None:
        kw["config"] = backend.config
    rng = rng_for(8)
    batch, seq, heads, dim = 2, 128, 2, 64
    q, k, v = (jnp.asarray(randn(rng, (batch, seq, heads, dim), np.float32), jnp.bfloat16)
               for _ in range(3))  # fmt: skip
    bounds = jnp.asarray([[0, 70, 70, 100], [5, 40, 60, 128]], jnp.int32)
    cap = CapParams(CapMethod.TANH, 5.0)
    w = jnp.asarray(randn(rng, (batch, seq, heads, dim), np.float32))

    def run(q, k, v):
        def loss(q, k, v):
            out = fn(q, k, v, bounds, cap=cap, **kw)
            return jnp.sum(out.astype(jnp.float32) * w)

        out, lse = fn(q, k, v, bounds, cap=cap, return_lse=True, **kw)
        return out, lse, jax.grad(loss, (0, 1, 2))(q, k, v)

    plain, wide = _both(run, q, k, v)
    _assert_same(plain, wide)


def _sparse_grad(module):
    def loss(q, kv, idx, pos):
        out, lse = module.sparse_mla_attention(
            q, kv, idx, pos, sm_scale=0.05, read_block=16, return_lse=True
        )
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    s = jax.ShapeDtypeStruct
    args = (s((1, 64, 64, 576), jnp.bfloat16), s((1, 2048, 576), jnp.bfloat16),
            s((1, 64, 8), jnp.int32), s((1, 64), jnp.int32))  # fmt: skip
    return jax.grad(loss, (0, 1)), args


def _ranker_grad(module, packed: bool):
    cap = CapParams(CapMethod.SOFT_SIGN, 8.0)

    def loss(q, k, v, bounds):
        return jnp.sum(module.ranker_attention(q, k, v, bounds, cap=cap).astype(jnp.float32))

    s = jax.ShapeDtypeStruct
    kv = s((2, 256, 2, 128), jnp.bfloat16)
    bounds = s((2, 3, 4) if packed else (2, 4), jnp.int32)
    return jax.grad(loss, (0, 1, 2)), (s((2, 256, 4, 128), jnp.bfloat16), kv, kv, bounds)


@pytest.mark.parametrize("case", ["sparse-mla", "ranker", "ranker-packed"])
@pytest.mark.parametrize(
    ("package", "platform"), [("attn_mosaic_gpu", "cuda"), ("attn_pallas_tpu", "tpu")]
)
def test_kernels_lower_under_x64(package, platform, case):
    """The compiled kernels (forward and backward), lowered for their accelerator on any
    host with 64-bit types on: the paths interpret mode does not run (inline Mosaic GPU
    code, the pipelined backward's schedule)."""
    module = pytest.importorskip(package, reason=f"{package} is not installed")
    fn, args = (
        _sparse_grad(module)
        if case == "sparse-mla"
        else _ranker_grad(module, case == "ranker-packed")
    )
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        exported = jax.export.export(jax.jit(fn), platforms=[platform])(*args)
    finally:
        jax.config.update("jax_enable_x64", was)
    assert "custom_call" in exported.mlir_module()
