"""``attn_mosaic_gpu.fastmath`` elementwise, on the CPU: the FMA-pipe ``exp2`` and
reciprocal against their stated error bounds. The compiled kernels run the same
functions on WGMMA register tiles; here they run on ordinary arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from attn_mosaic_gpu.fastmath import (
    EXP2_MAX_REL_ERROR,
    RECIPROCAL_MAX_REL_ERROR,
    exp2_fma,
    reciprocal_fma,
)


def test_exp2_fma_error_bound():
    """On XLA (CPU) the rounding step needs its guard, as in interpret mode."""
    fn = jax.jit(functools.partial(exp2_fma, xla_fold_guard=True))
    x = np.linspace(-126.0, 0.0, 400_001, dtype=np.float32)
    got = np.asarray(fn(x), np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1.0)) <= EXP2_MAX_REL_ERROR
    assert float(fn(jnp.float32(-jnp.inf))) == 0.0
    assert float(fn(jnp.float32(0.0))) == 1.0


def test_reciprocal_fma_error_bound():
    d = np.exp(np.random.default_rng(0).uniform(-80.0, 80.0, 200_000)).astype(np.float32)
    got = np.asarray(jax.jit(reciprocal_fma)(d), np.float64)
    assert np.max(np.abs(got * d.astype(np.float64) - 1.0)) <= RECIPROCAL_MAX_REL_ERROR
