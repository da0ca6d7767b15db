"""Sharded vs unsharded ranker attention and sparse MLA on 8 CPU devices.

Run by ``test_sharding.py`` in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (it must be set before JAX
initialises, so it cannot run inside the pytest process). Prints ``OK`` on success.
"""

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from attn_common import (
    CapMethod,
    CapParams,
    SegmentBounds,
    ranker_attention,
    shard_ranker_attention,
    shard_sparse_mla_attention,
    sparse_mla_attention,
)


def check_ranker(mesh, **kw):
    b, s, hq, hkv, d = 4, 96, 4, 2, 32
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (b, s, hq, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.float32)
    bounds = SegmentBounds.from_lengths(jnp.array([40, 70, 10, 64]), 16).as_array()
    cap = CapParams(CapMethod.SOFT_SIGN, 30.0)
    want, want_lse = ranker_attention(q, k, v, bounds, cap=cap, return_lse=True)
    got, got_lse = shard_ranker_attention(mesh, cap=cap, return_lse=True, **kw)(q, k, v, bounds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-5)
    # [4] bounds broadcast to every row, no lse
    got = shard_ranker_attention(mesh, cap=cap, **kw)(q, k, v, bounds[1])
    np.testing.assert_allclose(got, ranker_attention(q, k, v, bounds[1], cap=cap), 1e-5, 1e-5)


def check_sparse_mla(mesh, **kw):
    b, s, h, dv, rope, t, rb, top_k = 4, 8, 4, 64, 16, 256, 32, 3
    dk = dv + rope
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    q = jax.random.normal(keys[0], (b, s, h, dk), jnp.float32)
    kv = jax.random.normal(keys[1], (b, t, dk), jnp.float32)
    rng = np.random.default_rng(0)
    idx = np.stack(
        [[rng.choice(t // rb, size=top_k, replace=False) for _ in range(s)] for _ in range(b)]
    )
    indices = jnp.asarray(idx, jnp.int32)
    positions = jnp.asarray(rng.integers(0, t, size=(b, s)), jnp.int32)
    args = dict(sm_scale=1 / math.sqrt(dk), kv_lora_rank=dv, read_block=rb, return_lse=True)
    want, want_lse = sparse_mla_attention(q, kv, indices, positions, **args)
    got, got_lse = shard_sparse_mla_attention(mesh, **args, **kw)(q, kv, indices, positions)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-5)


def main() -> None:
    assert len(jax.devices()) == 8, (jax.devices(), os.environ.get("XLA_FLAGS"))
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    check_ranker(mesh)
    check_sparse_mla(mesh)
    # other layouts: batch only; heads over 4 devices; a mesh with Auto axes
    check_ranker(jax.make_mesh((2, 4), ("batch", "heads")), batch_axis="batch", head_axis=None)
    check_sparse_mla(jax.make_mesh((2, 4), ("b", "h")), batch_axis="b", head_axis="h")
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    check_ranker(auto)
    check_sparse_mla(auto)
    print("OK")


if __name__ == "__main__":
    main()
    sys.exit(0)
