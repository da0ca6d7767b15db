"""Sharded vs unsharded ranker attention and sparse MLA on CPU devices.

Run by ``test_sharding.py`` in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (it must be set before JAX
initialises, so it cannot run inside the pytest process). Prints ``OK`` on success.

On 8 devices, through the dispatching ops (the reference on a CPU): the ranker and flat
sparse MLA over batch and head meshes (forward, LSE, attention mass, gradients; bf16
and FP8 caches); ragged paged sparse MLA with the heads sharded, and with the requests
sharded (``request_axis``: the paged pool replicated or sharded by request, heads
sharded too or not; bf16 and FP8 caches; forward, LSE, mass and gradients against the
one-device batch of all requests). ``--interpret`` (2 devices): the Hopper and TPU
sparse-MLA kernels in interpret mode, sharded, against the same kernel on one device.
"""

import functools
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
    want_g = _grads(lambda q, kv: sparse_mla_attention(q, kv, indices, positions, **args))(q, kv)
    with jax.set_mesh(mesh):  # the scalar loss over sharded values needs the mesh
        got_g = _grads(lambda q, kv: sharded(q, kv, indices, positions))(q, kv)
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


def _grads(attend, fp8: bool = False, weights=None):
    """``jax.grad`` over ``(q, cache)`` (``q`` alone for an FP8 cache) of ``sum(out *
    weights) + sum(finite lse)``, ``attend(q, cache) -> (out, lse, ...)``; ``weights``
    ``None``: ``out`` itself (``sum(out**2)``)."""

    def f(q, cache):
        out, lse, *_ = attend(q, cache)
        w = out if weights is None else weights
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.grad(f, argnums=(0,) if fp8 else (0, 1))


def _check_flat_grads(mesh, sharded, one_device, q, cache, indices, positions, label):
    """Flat mode: the gradients through ``sharded`` against ``one_device(q, cache)``."""
    fp8 = not isinstance(cache, jax.Array)
    with jax.set_mesh(mesh):  # the scalar loss over sharded values needs the mesh
        got_g = _grads(lambda q, c: sharded(q, c, indices, positions), fp8)(q, cache)
    want_g = _grads(one_device, fp8)(q, cache)
    _close(got_g[0], want_g[0], rtol=1e-2, atol=1e-2, label=f"{label}: dq")
    if not fp8:
        _close_summed(got_g[1], want_g[1], label=f"{label}: dcache")


def _close(got, want, *, rtol=1e-5, atol=1e-5, label=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=label)
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol, err_msg=label)


def _close_summed(got, want, label=""):
    """A bf16 gradient summed over shards (a replicated cache's, over head shards): each
    shard's part is rounded to bf16 before the sum, so entries that cancel differ by a
    few bf16 steps of the largest entry, not relative to themselves."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max()
    assert scale > 0, label
    err = np.abs(got - want).max()
    assert err <= 2**-6 * scale, f"{label}: max error {err} against max entry {scale}"
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 2**-7, f"{label}: rel L2 {rel}"  # two bf16 roundings


def request_shards(shards, *, page_size, heads, fp8, seed, dv=512):
    """Ragged batches of ``shards`` (per device a list of ``(seq_len, new_len)``), the
    stacked form ``shard_sparse_mla_attention_ragged(..., request_axis=...)`` takes, and
    the same requests as one batch on one device.

    Device ``i`` owns pool pages ``[i * N, (i + 1) * N)`` of one pool (``N`` pages each,
    shuffled): ``tables(pool)`` gives page ids into its own ``N`` pages (``"sharded"``)
    or into the whole pool (``"replicated"``). Each batch is padded to the same sizes: a
    request of length 0 with one query of it (``-1`` and out-of-extent selections), and
    page-table slots of ``-1``. ``rows[i]`` are batch ``i``'s rows in the one-device
    batch (its padded queries have none)."""
    rng = np.random.default_rng(seed)
    n, dk, top_k = len(shards), dv + 64, 3
    pages = [[-(-seq // page_size) for seq, _ in shard] for shard in shards]
    pool_pages = max(sum(p) for p in pages) + 1  # N: each device's pool, one page spare
    local = [rng.permutation(pool_pages)[: sum(p)] for p in pages]
    num_q = [sum(new for _, new in shard) for shard in shards]
    s_pad, r_pad = max(num_q) + 1, max(len(shard) for shard in shards) + 1
    p_pad = max(sum(p) for p in pages) + 1
    stacked = {k: [] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "positions", "indices")}
    stacked["page_ids"] = []
    one = {k: [] for k in ("q_seq_id", "seq_lens", "extents", "positions", "indices", "pages")}
    rows, first_request, first_row = [], 0, 0
    for i, shard in enumerate(shards):
        seq = np.array([s for s, _ in shard] + [0] * (r_pad - len(shard)))
        extents = np.array(pages[i] + [0] * (r_pad - len(shard)))
        sid = np.concatenate([np.full(new, r) for r, (_, new) in enumerate(shard)])
        pos = np.concatenate([np.arange(s - new, s) for s, new in shard])
        sel = np.stack([rng.integers(-1, extents[r] + 1, size=top_k) for r in sid])
        sel[:, 0] = pos // page_size  # the query's own page
        pad = s_pad - len(sid)
        stacked["q_seq_id"].append(np.concatenate([sid, np.full(pad, len(shard))]))
        stacked["seq_lens"].append(seq)
        stacked["cu_kv_lens"].append(np.concatenate([[0], np.cumsum(extents)]) * page_size)
        stacked["positions"].append(np.concatenate([pos, np.zeros(pad, int)]))
        stacked["indices"].append(np.concatenate([sel, rng.integers(-1, 3, size=(pad, top_k))]))
        stacked["page_ids"].append(np.concatenate([local[i], np.full(p_pad - len(local[i]), -1)]))
        one["q_seq_id"].append(sid + first_request)
        one["seq_lens"].append(seq[: len(shard)])
        one["extents"].append(extents[: len(shard)])
        one["positions"].append(pos)
        one["indices"].append(sel)
        one["pages"].append(local[i] + i * pool_pages)
        rows.append(np.arange(first_row, first_row + len(sid)))
        first_request, first_row = first_request + len(shard), first_row + len(sid)
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    q = jax.random.normal(keys[0], (n, s_pad, heads, dk), jnp.bfloat16)
    # The feature padding (576 -> 640) holds noise: no op may read it.
    latent = jax.random.normal(keys[1], (n * pool_pages, page_size, padded_dk(dk)), jnp.float32)
    if fp8:
        cache = quantize_latent_cache(latent[..., :dk])
    else:
        pk = kv_packing(jnp.bfloat16)
        cache = latent.astype(jnp.bfloat16).reshape(n * pool_pages, page_size // pk, pk, -1)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    offsets = (np.arange(n) * pool_pages)[:, None]
    ids = np.stack(stacked["page_ids"])

    def tables(pool):
        page_ids = ids if pool == "sharded" else np.where(ids >= 0, ids + offsets, -1)
        return (i32(np.stack(stacked["indices"])), i32(np.stack(stacked["positions"])),
                i32(np.stack(stacked["q_seq_id"])), i32(np.stack(stacked["seq_lens"])),
                i32(np.stack(stacked["cu_kv_lens"])), i32(page_ids))  # fmt: skip

    q_one = jnp.concatenate([q[i, : len(r)] for i, r in enumerate(rows)])[None]
    extents = np.concatenate(one["extents"])
    one_tables = (
        i32(np.concatenate(one["indices"]))[None], i32(np.concatenate(one["positions"]))[None],
        i32(np.concatenate(one["q_seq_id"])), i32(np.concatenate(one["seq_lens"])),
        i32(np.concatenate([[0], np.cumsum(extents)]) * page_size),
        i32(np.concatenate(one["pages"])),
    )  # fmt: skip
    return q, cache, tables, q_one, one_tables, rows


SHARDS = [[(50, 5), (33, 3)], [(70, 6)], [(17, 2), (40, 4), (9, 1)], [(64, 4)]]


def check_sparse_mla_requests(
    mesh, request_axis, head_axis, pool, *, fp8, fn=None, tol=1e-5, shards=SHARDS, heads=4,
    dv=512, **kw,
):  # fmt: skip
    """Ragged paged mode, requests over ``request_axis`` (heads over ``head_axis``), the
    pool replicated or sharded by request: ``out``, ``lse``, the mass and the gradients
    (``q`` and a bf16 cache; ``q`` for an FP8 cache) equal the one-device batch of all
    requests (``fn``, default the dispatching op, with ``kw``), padded queries give 0
    and ``-inf``. ``shards``: per device its requests' ``(seq_len, new_len)``."""
    n = mesh.shape[request_axis]
    page_size = 16
    q, cache, tables, q_one, one_tables, rows = request_shards(
        shards[:n], page_size=page_size, heads=heads, fp8=fp8, seed=7 + n, dv=dv
    )
    opts = dict(sm_scale=(dv + 64) ** -0.5, kv_lora_rank=dv, page_size=page_size,
                return_lse=True, return_attn_mass=True, **kw)  # fmt: skip
    single = fn or sparse_mla_attention

    def one_device(q, cache):
        idx, pos, sid, sl, cu, pi = one_tables
        return single(q, cache, idx, pos, read_block=page_size, q_seq_id=sid, seq_lens=sl,
                      cu_kv_lens=cu, page_indices=pi, **opts)  # fmt: skip

    sharded = shard_sparse_mla_attention_ragged(
        mesh, fn, head_axis=head_axis, request_axis=request_axis, pool=pool, **opts
    )
    label = f"requests over {request_axis!r}, heads over {head_axis!r}, pool {pool}, fp8 {fp8}"
    got = [np.asarray(x) for x in sharded(q, cache, *tables(pool))]
    want = [np.asarray(x) for x in one_device(q_one, cache)]
    assert got[0].shape == (n, q.shape[1], heads, dv), got[0].shape
    for g, w, name in zip(got, want, ("out", "lse", "mass"), strict=True):
        for i, r in enumerate(rows):
            _close(g[i, : len(r)], w[0, r], rtol=tol, atol=tol, label=f"{label}: {name}")
    pad = np.concatenate([got[0][i, len(r) :].ravel() for i, r in enumerate(rows)])
    assert pad.size and not pad.any(), label  # padded queries: out 0
    pad_lse = np.concatenate([got[1][i, len(r) :].ravel() for i, r in enumerate(rows)])
    assert np.isneginf(pad_lse).all(), label

    w = jax.random.normal(jax.random.PRNGKey(11), got[0].shape, jnp.float32)
    w_one = jnp.concatenate([w[i, : len(r)] for i, r in enumerate(rows)])[None]

    with jax.set_mesh(mesh):  # the scalar loss over sharded values needs the mesh
        got_g = _grads(lambda q, c: sharded(q, c, *tables(pool)), fp8, w)(q, cache)
    want_g = _grads(one_device, fp8, w_one)(q_one, cache)
    dq, want_dq = np.asarray(got_g[0], np.float32), np.asarray(want_g[0], np.float32)
    for i, r in enumerate(rows):
        _close(dq[i, : len(r)], want_dq[0, r], rtol=1e-2, atol=1e-2, label=f"{label}: dq")
        assert not dq[i, len(r) :].any(), label  # padded queries: no gradient
    if not fp8:
        _close_summed(got_g[1], want_g[1], label=f"{label}: dcache")


def check_sparse_mla_flat_caches(mesh, **kw):
    """Flat mode over a bf16 cache and an FP8 one: forward and gradients."""
    b, s, h, t, rb = 4, 6, 4, 128, 32
    keys = jax.random.split(jax.random.PRNGKey(12), 4)
    q = jax.random.normal(keys[0], (b, s, h, 576), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (b, t, 576), jnp.bfloat16)
    indices = jax.random.randint(keys[2], (b, s, 3), -1, t // rb)
    positions = jax.random.randint(keys[3], (b, s), 0, t)
    _check_flat_cache(mesh, q, kv, indices, positions, kw)
    _check_flat_cache(mesh, q, quantize_latent_cache(kv), indices, positions, kw)


def _check_flat_cache(mesh, q, cache, indices, positions, kw):
    fp8 = not isinstance(cache, jax.Array)
    args = dict(sm_scale=0.05, read_block=32, return_lse=True)
    sharded = shard_sparse_mla_attention(mesh, **args, **kw)
    got = sharded(q, cache, indices, positions)
    want = sparse_mla_attention(q, cache, indices, positions, **args)
    for x, y in zip(got, want, strict=True):
        _close(x, y, label=f"flat, fp8 {fp8}")

    def one_device(q, cache):
        return sparse_mla_attention(q, cache, indices, positions, **args)

    _check_flat_grads(mesh, sharded, one_device, q, cache, indices, positions, f"flat, fp8 {fp8}")


def check_kernel_flat(
    mesh, fn, *, batch_axis, head_axis, b=2, s=3, h=2, t=48, rb=16, top_k=2, dv=128, fp8=False,
    **kw,
):  # fmt: skip
    """Flat mode through ``fn`` (a backend's op, e.g. a kernel; bf16, or an FP8 cache
    with ``dv = 512``): sharded forward and gradients (``q`` and a bf16 cache; ``q`` for
    an FP8 one) against ``fn`` on one device."""
    keys = jax.random.split(jax.random.PRNGKey(13), 4)
    q = jax.random.normal(keys[0], (b, s, h, dv + 64), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (b, t, dv + 64), jnp.bfloat16)
    cache = quantize_latent_cache(kv) if fp8 else kv
    indices = jax.random.randint(keys[2], (b, s, top_k), -1, t // rb)
    positions = jax.random.randint(keys[3], (b, s), 0, t)
    args = dict(sm_scale=0.1, kv_lora_rank=dv, read_block=rb, return_lse=True, **kw)
    sharded = shard_sparse_mla_attention(
        mesh, fn, batch_axis=batch_axis, head_axis=head_axis, **args
    )

    def one_device(q, cache):
        return fn(q, cache, indices, positions, **args)

    label = f"kernel, flat, {dict(mesh.shape)}, fp8 {fp8}, {kw}"
    got = sharded(q, cache, indices, positions)
    for x, y in zip(got, one_device(q, cache), strict=True):
        _close(x, y, rtol=1e-5, atol=1e-5, label=label)
    _check_flat_grads(mesh, sharded, one_device, q, cache, indices, positions, label)


def check_kernels_interpret():
    """The kernels in interpret mode, sharded over two devices, against the same kernel
    on one, forward and gradients; the mesh axes are named as kernel axes used to be
    (``program``, ``query``: interpret mode resolves a kernel's own axes first, so this
    checks the sharding, not the names; ``tests/kernel_axes_check.py`` checks those).

    The Mosaic GPU interpreter runs without race detection here: over two concurrently
    interpreted devices jax 0.11's detector reported, in 3 of 8 runs, a race between
    the sparse-MLA forward's compute and memory warpgroups on shared memory whose
    accesses are ordered by the kernel's barriers, never on one device (the
    single-device interpret tests keep it on). The TPU interpreter keeps it on."""
    from helpers import multi_device_gpu_interpret, races_detected, tpu_interpret
    from jax.experimental.pallas import mosaic_gpu as plgpu

    import attn_mosaic_gpu as gpu
    import attn_pallas_tpu as tpu

    devices = jax.devices()[:2]
    with multi_device_gpu_interpret():
        # Hopper: ragged paged, a request on one device, two on the other, each device's
        # own pool of pages.
        check_sparse_mla_requests(
            jax.make_mesh((2,), ("program",), devices=devices), "program", None, "sharded",
            fp8=False, fn=gpu.sparse_mla_attention, shards=[[(40, 2)], [(20, 1), (9, 1)]],
            heads=2, dv=128,
            interpret=plgpu.InterpretGPUParams(detect_races=False, uninitialized_memory="nan"),
        )  # fmt: skip
    print("Hopper interpret: ragged, requests sharded, pool sharded: OK", flush=True)
    # TPU: flat, heads over "query" (batch over "program", of size 1).
    mesh = jax.make_mesh((1, 2), ("program", "query"), devices=devices)
    check_kernel_flat(mesh, tpu.sparse_mla_attention, batch_axis="program", head_axis="query",
                      interpret=tpu_interpret())  # fmt: skip
    assert not races_detected(), "the TPU interpreter reported a data race"
    print("TPU interpret: flat, heads sharded: OK", flush=True)


def main() -> None:
    if sys.argv[1:] == ["--interpret"]:
        assert len(jax.devices()) >= 2, (jax.devices(), os.environ.get("XLA_FLAGS"))
        check_kernels_interpret()
        print("OK")
        return
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
    check_sparse_mla_flat_caches(mesh)  # bf16 and FP8 caches, batch and heads sharded
    # Requests over "data": the pool replicated or sharded by request, heads too.
    for pool in ("replicated", "sharded"):
        for fp8 in (False, True):
            check_sparse_mla_requests(mesh, "data", "model", pool, fp8=fp8)
    check_sparse_mla_requests(mesh, "data", None, "sharded", fp8=False)  # requests only
    print("OK")


if __name__ == "__main__":
    main()
    sys.exit(0)
