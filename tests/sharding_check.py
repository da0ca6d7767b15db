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
    kv_packing,
    padded_dk,
    quantize_latent_cache,
    ranker_attention,
    shard_ranker_attention,
    shard_sparse_mla_attention,
    shard_sparse_mla_attention_ragged,
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
    args = dict(
        sm_scale=1 / math.sqrt(dk), kv_lora_rank=dv, read_block=rb, return_lse=True,
        return_attn_mass=True,
    )  # fmt: skip
    want, want_lse, want_mass = sparse_mla_attention(q, kv, indices, positions, **args)
    sharded = shard_sparse_mla_attention(mesh, **args, **kw)
    got, got_lse, got_mass = sharded(q, kv, indices, positions)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_mass, want_mass, rtol=1e-5, atol=1e-6)  # over all heads

    # Gradients: the cache is replicated over the head shards, its cotangent summed.
    def loss(attend):
        def f(q, kv):
            out, lse, _ = attend(q, kv)
            return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jax.grad(f, argnums=(0, 1))

    want_g = loss(lambda q, kv: sparse_mla_attention(q, kv, indices, positions, **args))(q, kv)
    with jax.set_mesh(mesh):  # the scalar loss over sharded values needs the mesh
        got_g = loss(lambda q, kv: sharded(q, kv, indices, positions))(q, kv)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def check_sparse_mla_ragged(mesh, **kw):
    """Three requests packed in one row over a shuffled paged cache; heads sharded."""
    h, dv, rope, ps, top_k = 8, 64, 16, 16, 3
    dk = dv + rope
    lens, new = [50, 33, 70], [5, 3, 6]
    pages = [-(-n // ps) for n in lens]
    rng = np.random.default_rng(2)
    pk = kv_packing(jnp.float32)
    cache = jax.random.normal(jax.random.PRNGKey(3), (sum(pages), ps // pk, pk, padded_dk(dk)))
    page_indices = jnp.asarray(rng.permutation(sum(pages)), jnp.int32)
    cu_kv = jnp.asarray(np.concatenate([[0], np.cumsum(pages)]) * ps, jnp.int32)
    sid = np.concatenate([np.full(m, r) for r, m in enumerate(new)]).astype(np.int32)
    pos = np.concatenate([np.arange(n - m, n) for n, m in zip(lens, new, strict=True)])
    sel = np.stack([rng.integers(-1, pages[r], size=top_k) for r in sid]).astype(np.int32)
    q = jax.random.normal(jax.random.PRNGKey(4), (1, len(sid), h, dk))
    args = (q, cache, jnp.asarray(sel)[None], jnp.asarray(pos, jnp.int32)[None],
            jnp.asarray(sid), jnp.asarray(lens, jnp.int32), cu_kv, page_indices)  # fmt: skip
    opts = dict(sm_scale=1 / math.sqrt(dk), kv_lora_rank=dv, page_size=ps, return_lse=True)
    q_, cache_, idx_, pos_, sid_, sl_, cu_, pi_ = args
    want, want_lse = sparse_mla_attention(
        q_, cache_, idx_, pos_, read_block=ps, q_seq_id=sid_, seq_lens=sl_, cu_kv_lens=cu_,
        page_indices=pi_, **opts,
    )  # fmt: skip
    got, got_lse = shard_sparse_mla_attention_ragged(mesh, **opts, **kw)(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(np.asarray(got_lse)[finite], np.asarray(want_lse)[finite], 1e-5)


def check_sparse_mla_fp8(mesh):
    """An Fp8LatentCache (a pytree of three arrays): flat with batch and heads sharded,
    ragged paged (replicated cache) with heads sharded."""
    b, s, h, t, rb = 4, 6, 4, 128, 32
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    q = jax.random.normal(keys[0], (b, s, h, 576), jnp.bfloat16)
    cache = quantize_latent_cache(jax.random.normal(keys[1], (b, t, 576)))
    indices = jax.random.randint(keys[2], (b, s, 3), -1, t // rb)
    positions = jnp.full((b, s), t - 1, jnp.int32)
    args = dict(sm_scale=0.05, read_block=rb, return_lse=True)
    want = sparse_mla_attention(q, cache, indices, positions, **args)
    got = shard_sparse_mla_attention(mesh, **args)(q, cache, indices, positions)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    ps, pages = 16, 6
    paged = quantize_latent_cache(jax.random.normal(keys[1], (pages, ps, 576)))
    sid = jnp.asarray([0, 0, 1, 1, 1], jnp.int32)
    ragged = (q[:1, :5], paged, indices[:1, :5] % 3, jnp.asarray([[40, 47, 30, 31, 32]]), sid,
              jnp.asarray([48, 33], jnp.int32), jnp.asarray([0, 48, 96], jnp.int32),
              jnp.asarray([5, 0, 3, 1, 4, 2], jnp.int32))  # fmt: skip
    opts = dict(sm_scale=0.05, page_size=ps, return_lse=True)
    q_, cache_, idx_, pos_, sid_, sl_, cu_, pi_ = ragged
    want = sparse_mla_attention(
        q_, cache_, idx_, pos_, read_block=ps, q_seq_id=sid_, seq_lens=sl_, cu_kv_lens=cu_,
        page_indices=pi_, **opts,
    )  # fmt: skip
    got = shard_sparse_mla_attention_ragged(mesh, head_axis="model", **opts)(*ragged)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))


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
    check_sparse_mla_ragged(jax.make_mesh((8,), ("model",)))
    check_sparse_mla_ragged(mesh, head_axis="model")
    check_sparse_mla_fp8(mesh)
    print("OK")


if __name__ == "__main__":
    main()
    sys.exit(0)
