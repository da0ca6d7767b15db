"""Main job on the CPU default backend: both ops with the reference at realistic shapes.

``python -m attn_reference.demo`` runs ranker attention (a phoenix-like ranker batch:
history + isolated candidates, GQA 5:1, soft_sign cap, forward and gradient) and sparse
MLA prefill (flat, DeepSeek-style latent dims, and ragged paged over several requests),
spot-checks each against a direct dense computation, and prints a table of times.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import CapMethod, CapParams, SegmentBounds, kv_packing, padded_dk, ranker_flops
from attn_reference import ranker_attention, sparse_mla_attention


def _time(fn, *args, repeats: int = 3) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _dense_ranker_row(q, k, v, bounds, b, h, i, cap: CapParams):
    """Output row (b, i, h) by a direct dense softmax, float64 numpy."""
    hl, hu, cl, cu = (int(x) for x in bounds[b])
    group = q.shape[2] // k.shape[2]
    keys = [
        j
        for j in range(q.shape[1])
        if (hl <= j < hu and (hl <= i < hu or cl <= i < cu)) or (cl <= i < cu and j == i)
    ]
    if not keys:
        return np.zeros(q.shape[-1])
    qv = np.asarray(q[b, i, h], np.float64)
    kk = np.asarray(k[b, keys, h // group], np.float64)
    s = kk @ qv / math.sqrt(q.shape[-1])
    s = cap.value * s / (cap.value + np.abs(s))
    p = np.exp(s - s.max())
    return p @ np.asarray(v[b, keys, h // group], np.float64) / p.sum()


def run_ranker(batch: int, seed: int) -> dict:
    seq, hq, hkv, d = 1152, 20, 4, 128
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, hkv, d), jnp.bfloat16)
    hist = rng.integers(126, 1023, size=batch)
    bounds = SegmentBounds.from_lengths(jnp.asarray(hist), 64).as_array()
    cap = CapParams(CapMethod.SOFT_SIGN, 80.0)

    fwd = jax.jit(lambda q, k, v, b: ranker_attention(q, k, v, b, cap=cap))
    loss = jax.jit(
        jax.grad(
            lambda q, k, v, b: ranker_attention(q, k, v, b, cap=cap).astype(jnp.float32).sum(),
            argnums=(0, 1, 2),
        )
    )
    t_fwd = _time(fwd, q, k, v, bounds)
    t_bwd = _time(loss, q, k, v, bounds, repeats=1)
    out = fwd(q, k, v, bounds)
    grads = loss(q, k, v, bounds)
    # spot check: a history row and a candidate row against a dense float64 softmax
    errs = []
    for b, i in ((0, int(hist[0]) // 2), (batch - 1, int(hist[-1]) + 3)):
        want = _dense_ranker_row(q, k, v, np.asarray(bounds), b, 3, i, cap)
        got = np.asarray(out[b, i, 3], np.float64)
        errs.append(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
    flops = ranker_flops(np.asarray(bounds), hq, d)
    return {
        "op": f"ranker B{batch} S{seq} H{hq}/{hkv} D{d} bf16",
        "fwd_s": t_fwd,
        "fwd+bwd_s": t_fwd + t_bwd,
        "gflops": flops / t_fwd / 1e9,
        "check": f"rel err {max(errs):.1e}, grads finite: {finite}",
    }


def run_sparse_mla(seed: int) -> list[dict]:
    heads, dv, rope, top_k, rb = 16, 512, 64, 16, 64  # 1024 selected tokens per query
    dk = dv + rope
    seq, ctx = 256, 8192
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    rng = np.random.default_rng(seed)
    q = jax.random.normal(keys[0], (1, seq, heads, dk), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (1, ctx, dk), jnp.bfloat16)
    positions = jnp.arange(ctx - seq, ctx, dtype=jnp.int32)[None]
    units = ctx // rb
    idx = np.stack([rng.choice(units, size=top_k, replace=False) for _ in range(seq)])
    idx[:, 0] = 0  # attention sink
    indices = jnp.asarray(idx, jnp.int32)[None]
    scale = 1.0 / math.sqrt(192.0)
    flat = jax.jit(
        lambda q, kv, i, p: sparse_mla_attention(
            q, kv, i, p, sm_scale=scale, kv_lora_rank=dv, read_block=rb
        )
    )
    t_flat = _time(flat, q, kv, indices, positions)
    out = flat(q, kv, indices, positions)
    # spot check one query against a dense float64 computation
    t = np.concatenate([np.arange(u * rb, (u + 1) * rb) for u in np.unique(idx[7])])
    t = t[t <= int(positions[0, 7])]
    kk = np.asarray(kv[0, t], np.float64)
    s = kk @ np.asarray(q[0, 7], np.float64).T * scale
    p = np.exp(s - s.max(0))
    want = (p / p.sum(0)).T @ kk[:, :dv]
    err = np.linalg.norm(np.asarray(out[0, 7]) - want) / np.linalg.norm(want)
    valid_pairs = seq * top_k * rb
    results = [
        {
            "op": f"sparse MLA flat S{seq} T{ctx} H{heads} K{top_k}x{rb}",
            "fwd_s": t_flat,
            "fwd+bwd_s": float("nan"),
            "gflops": 2 * heads * (dk + dv) * valid_pairs / t_flat / 1e9,
            "check": f"rel err {err:.1e}",
        }
    ]

    # ragged paged: 3 requests packed into one cache with shuffled physical pages
    ps = 64
    lens = [3000, 1900, 4100]
    new = [96, 64, 96]
    pages = [-(-n // ps) for n in lens]
    cu_kv = np.concatenate([[0], np.cumsum(pages)]) * ps
    perm = rng.permutation(sum(pages)).astype(np.int32)
    pk = kv_packing(jnp.bfloat16)
    cache = jax.random.normal(keys[2], (sum(pages), ps // pk, pk, padded_dk(dk)), jnp.bfloat16)
    q_seq_id = np.concatenate([np.full(n, r) for r, n in enumerate(new)]).astype(np.int32)
    pos = np.concatenate([np.arange(n - m, n) for n, m in zip(lens, new, strict=True)]).astype(
        np.int32
    )
    sel = np.stack([rng.choice(pages[r], size=top_k, replace=pages[r] < top_k) for r in q_seq_id])
    total = len(q_seq_id)
    qr = jax.random.normal(keys[0], (1, total, heads, dk), jnp.bfloat16)
    ragged = jax.jit(
        lambda q, c, i, p, sid, sl, cu, pi: sparse_mla_attention(
            q,
            c,
            i,
            p,
            sm_scale=scale,
            kv_lora_rank=dv,
            read_block=ps,
            page_size=ps,
            q_seq_id=sid,
            seq_lens=sl,
            cu_kv_lens=cu,
            page_indices=pi,
        )
    )
    args = (
        qr,
        cache,
        jnp.asarray(sel, jnp.int32)[None],
        jnp.asarray(pos)[None],
        jnp.asarray(q_seq_id),
        jnp.asarray(lens, jnp.int32),
        jnp.asarray(cu_kv, jnp.int32),
        jnp.asarray(perm),
    )
    t_ragged = _time(ragged, *args)
    out_r = ragged(*args)
    results.append(
        {
            "op": f"sparse MLA ragged {len(lens)} reqs T{total} H{heads} K{top_k}x{ps}",
            "fwd_s": t_ragged,
            "fwd+bwd_s": float("nan"),
            "gflops": float("nan"),
            "check": f"finite: {bool(jnp.isfinite(out_r).all())}",
        }
    )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="ranker batch rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    print("backend: attn-reference (pure JAX)\n")
    rows = [run_ranker(args.batch, args.seed), *run_sparse_mla(args.seed)]
    header = f"{'op':<44} {'fwd ms':>9} {'fwd+bwd ms':>11} {'GFLOP/s':>8}  check"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['op']:<44} {r['fwd_s'] * 1e3:>9.1f} {r['fwd+bwd_s'] * 1e3:>11.1f} "
            f"{r['gflops']:>8.1f}  {r['check']}"
        )


if __name__ == "__main__":
    main()
