"""The ``attn`` command: ``attn info``, ``attn run ranker|sparse-mla|all``, ``attn bench``.

* ``attn info``: installed backends (version, module, ops, devices), the backend each op
  dispatches to on the default device, the devices and the JAX version.
* ``attn run ranker``: a phoenix-like ranker batch (history + isolated candidates, GQA
  5:1, soft_sign cap 80, bf16; history length per row uniform in [126, 1022], then 64
  candidates) on the best backend: forward and forward+backward time, effective GFLOP/s
  (allowed pairs only), a sample row checked against a float64 dense softmax and, when
  the backend is not the reference and the reference is installed, against the reference
  on the same inputs. ``--small`` shrinks the shapes to run in seconds.
* ``attn run sparse-mla``: sparse MLA prefill, flat (DeepSeek latent dims 512 + 64, 16
  selected units of 64 tokens per query) and ragged paged (3 requests packed into a
  cache with shuffled physical pages), same report.
* ``attn bench``: the SPEC section 7 ranker suite, see ``attn_common.bench``.

``--implementation NAME`` pins a backend (default: the dispatch choice, see
``attn_common.dispatch``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.bounds import SegmentBounds
from attn_common.cap import CapMethod, CapParams
from attn_common.dispatch import (
    KNOWN_BACKENDS,
    OPS,
    BackendUnavailableError,
    backend_version,
    device_class,
    installed_backends,
    load_backend,
    select_backend,
    supported_devices,
)
from attn_common.ranker import ranker_flops
from attn_common.sparse_mla import padded_dk
from attn_common.tables import kv_packing

# --------------------------------------------------------------------------- helpers


def _time(fn, *args, repeats: int = 3) -> float:
    """Median wall time of ``fn(*args)`` in seconds after a compile + warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _reference_fn(op: str, backend: str):
    """The reference's ``op`` when it is installed and not already the backend, else None."""
    if backend == "reference" or "reference" not in installed_backends():
        return None
    try:
        return getattr(load_backend("reference"), op, None)
    except BackendUnavailableError:
        return None


def _dense_ranker_row(q, k, v, bounds, b, h, i, cap: CapParams):
    """Output row (b, i, h) by a direct dense softmax in float64 numpy (soft_sign cap)."""
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
    if cap.method == CapMethod.SOFT_SIGN:
        s = cap.value * s / (cap.value + np.abs(s))
    elif cap.method == CapMethod.TANH:
        s = cap.value * np.tanh(s / cap.value)
    p = np.exp(s - s.max())
    return p @ np.asarray(v[b, keys, h // group], np.float64) / p.sum()


def _row(op, backend, fwd_s, fwd_bwd_s, gflops, check) -> dict:
    return {
        "op": op,
        "backend": backend,
        "fwd_s": fwd_s,
        "fwd+bwd_s": fwd_bwd_s,
        "gflops": gflops,
        "check": check,
    }


# --------------------------------------------------------------------------- attn run


def run_ranker(
    batch: int | None = None, seed: int = 0, *, small: bool = False, implementation=None
) -> dict:
    """Ranker attention at a phoenix-like shape on the selected backend."""
    if small:
        seq, hq, hkv, d, n_cand, hist_range = 256, 4, 2, 64, 32, (30, 200)
        batch = batch or 2
    else:
        seq, hq, hkv, d, n_cand, hist_range = 1152, 20, 4, 128, 64, (126, 1023)
        batch = batch or 4
    backend, ranker_attention = select_backend("ranker_attention", implementation)
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, hkv, d), jnp.bfloat16)
    hist = rng.integers(*hist_range, size=batch)
    bounds = SegmentBounds.from_lengths(jnp.asarray(hist), n_cand).as_array()
    cap = CapParams(CapMethod.SOFT_SIGN, 80.0)

    fwd = jax.jit(lambda q, k, v, b: ranker_attention(q, k, v, b, cap=cap))
    t_fwd = _time(fwd, q, k, v, bounds)
    out = fwd(q, k, v, bounds)
    grad = jax.jit(
        jax.grad(
            lambda q, k, v, b: ranker_attention(q, k, v, b, cap=cap).astype(jnp.float32).sum(),
            argnums=(0, 1, 2),
        )
    )
    try:
        t_bwd = _time(grad, q, k, v, bounds, repeats=1)
        grads = grad(q, k, v, bounds)
        finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
        grad_note = f"grads finite: {finite}"
        t_total = t_fwd + t_bwd
    except NotImplementedError as e:
        grad_note, t_total = f"no backward ({str(e)[:40]})", float("nan")
    # spot check: a history row and a candidate row against a dense float64 softmax
    bnp = np.asarray(bounds)
    h = min(3, hq - 1)
    errs = []
    for b, i in ((0, int(hist[0]) // 2), (batch - 1, int(hist[-1]) + 3)):
        want = _dense_ranker_row(q, k, v, bnp, b, h, i, cap)
        errs.append(_rel_err(out[b, i, h], want))
    check = f"dense f64 rel err {max(errs):.1e}"
    ref = _reference_fn("ranker_attention", backend)
    if ref is not None:  # the first batch row on the reference, same inputs
        want = ref(q[:1], k[:1], v[:1], bounds[:1], cap=cap)
        check += f", vs reference {_rel_err(out[:1], want):.1e}"
    flops = ranker_flops(bnp, hq, d)
    return _row(
        f"ranker B{batch} S{seq} H{hq}/{hkv} D{d} bf16",
        backend,
        t_fwd,
        t_total,
        flops / t_fwd / 1e9,
        f"{check}; {grad_note}",
    )


def _sparse_pairs(sel_tokens_ok: np.ndarray) -> int:
    return int(sel_tokens_ok.sum())


def run_sparse_mla(seed: int = 0, *, small: bool = False, implementation=None) -> list[dict]:
    """Sparse MLA prefill, flat and ragged paged, on the selected backend."""
    dv, rope = 512, 64
    if small:
        heads, top_k, rb, seq, ctx = 4, 4, 64, 32, 1024
        lens, new = [300, 190, 410], [16, 8, 16]
    else:
        heads, top_k, rb, seq, ctx = 16, 16, 64, 256, 8192  # 1024 selected tokens / query
        lens, new = [3000, 1900, 4100], [96, 64, 96]
    dk = dv + rope
    backend, sparse_mla_attention = select_backend("sparse_mla_attention", implementation)
    ref = _reference_fn("sparse_mla_attention", backend)
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
    flat_kw = dict(sm_scale=scale, kv_lora_rank=dv, read_block=rb)
    flat = jax.jit(lambda q, kv, i, p: sparse_mla_attention(q, kv, i, p, **flat_kw))
    t_flat = _time(flat, q, kv, indices, positions)
    out = flat(q, kv, indices, positions)
    # spot check one query against a dense float64 computation
    qi = 7
    t = np.concatenate([np.arange(u * rb, (u + 1) * rb) for u in np.unique(idx[qi])])
    t = t[t <= int(positions[0, qi])]
    kk = np.asarray(kv[0, t], np.float64)
    s = kk @ np.asarray(q[0, qi], np.float64).T * scale
    p = np.exp(s - s.max(0))
    check = f"dense f64 rel err {_rel_err(out[0, qi], (p / p.sum(0)).T @ kk[:, :dv]):.1e}"
    if ref is not None:
        check += f", vs reference {_rel_err(out, ref(q, kv, indices, positions, **flat_kw)):.1e}"
    tok = (idx[:, :, None] * rb + np.arange(rb)).reshape(seq, -1)
    valid_pairs = _sparse_pairs(tok <= np.asarray(positions[0])[:, None])
    results = [
        _row(
            f"sparse MLA flat S{seq} T{ctx} H{heads} K{top_k}x{rb}",
            backend,
            t_flat,
            float("nan"),
            2 * heads * (dk + dv) * valid_pairs / t_flat / 1e9,
            check,
        )
    ]

    # ragged paged: requests packed into one cache with shuffled physical pages
    ps = rb
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
    ragged_kw = dict(sm_scale=scale, kv_lora_rank=dv, read_block=ps, page_size=ps)

    def ragged_call(fn):
        return lambda q, c, i, p, sid, sl, cu, pi: fn(
            q, c, i, p, q_seq_id=sid, seq_lens=sl, cu_kv_lens=cu, page_indices=pi, **ragged_kw
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
    ragged = jax.jit(ragged_call(sparse_mla_attention))
    t_ragged = _time(ragged, *args)
    out_r = ragged(*args)
    # dense check of one query: its request's selected pages, physical via the page table
    store = np.asarray(cache, np.float64).reshape(-1, cache.shape[-1])
    qi = total - 1
    r = int(q_seq_id[qi])
    rows, valid = [], 0
    for qq in range(total):
        rq = int(q_seq_id[qq])
        loc = (np.unique(sel[qq])[:, None] * ps + np.arange(ps)).ravel()
        ok = (loc <= pos[qq]) & (loc < lens[rq])
        valid += int(ok.sum())
        if qq == qi:
            loc = loc[ok]
            phys = perm[cu_kv[r] // ps + loc // ps]
            rows = phys * ps + loc % ps
    kk = store[rows, :dk]
    s = kk @ np.asarray(qr[0, qi], np.float64).T * scale
    p = np.exp(s - s.max(0))
    check = f"dense f64 rel err {_rel_err(out_r[0, qi], (p / p.sum(0)).T @ kk[:, :dv]):.1e}"
    if ref is not None:
        check += f", vs reference {_rel_err(out_r, jax.jit(ragged_call(ref))(*args)):.1e}"
    results.append(
        _row(
            f"sparse MLA ragged {len(lens)} reqs T{total} H{heads} K{top_k}x{ps}",
            backend,
            t_ragged,
            float("nan"),
            2 * heads * (dk + dv) * valid / t_ragged / 1e9,
            check,
        )
    )
    return results


def print_table(rows: list[dict]) -> None:
    header = f"{'op':<42} {'backend':<11} {'fwd ms':>9} {'fwd+bwd ms':>11} {'GFLOP/s':>9}  check"
    print(header)
    print("-" * len(header))
    for r in rows:
        bwd = "n/a" if math.isnan(r["fwd+bwd_s"]) else f"{r['fwd+bwd_s'] * 1e3:.1f}"
        print(
            f"{r['op']:<42} {r['backend']:<11} {r['fwd_s'] * 1e3:>9.1f} {bwd:>11} "
            f"{r['gflops']:>9.1f}  {r['check']}"
        )


def _describe_device() -> str:
    dev = jax.devices()[0]
    return (
        f"jax {jax.__version__} on {jax.default_backend()} ({dev.device_kind}, {device_class(dev)})"
    )


def cmd_run(args: argparse.Namespace) -> int:
    print(_describe_device())
    rows = []
    if args.op in ("ranker", "all"):
        rows.append(
            run_ranker(args.batch, args.seed, small=args.small, implementation=args.implementation)
        )
    if args.op in ("sparse-mla", "all"):
        rows += run_sparse_mla(args.seed, small=args.small, implementation=args.implementation)
    print("times: wall clock, median of 3 calls after a warm-up (fwd+bwd: one call)\n")
    print_table(rows)
    return 0


# --------------------------------------------------------------------------- attn info


def cmd_info(args: argparse.Namespace) -> int:
    try:
        common_version = metadata.version("attn-common")
    except metadata.PackageNotFoundError:
        common_version = "0+unknown (source tree)"
    print(f"attn-common {common_version}")
    print(f"jax {jax.__version__}, jaxlib {getattr(jax.lib, '__version__', '?')}")
    print(f"python {sys.version.split()[0]}")
    devices = jax.devices()
    print(f"default backend: {jax.default_backend()}; devices ({len(devices)}):")
    for d in devices[:16]:
        print(f"  {d.id}: {d.platform} {d.device_kind} -> {device_class(d)}")
    if len(devices) > 16:
        print(f"  ... {len(devices) - 16} more")
    installed = installed_backends()
    print("\nbackends:")
    for name in sorted(set(KNOWN_BACKENDS) | set(installed)):
        if name not in installed:
            print(f"  {name:<11} not installed ({KNOWN_BACKENDS[name]['install']})")
            continue
        try:
            module = load_backend(name)
        except BackendUnavailableError as e:
            print(f"  {name:<11} broken: {e}")
            continue
        devs = supported_devices(name, module)
        ops = [op for op in OPS if hasattr(module, op)]
        print(
            f"  {name:<11} {backend_version(name):<10} module {installed[name]}; "
            f"devices: {', '.join(devs) if devs else 'any'}; ops: {', '.join(ops) or 'none'}"
        )
    print(f"\ndispatch on the default device ({device_class()}):")
    for op in OPS:
        try:
            name, _ = select_backend(op)
        except BackendUnavailableError:
            name = "none installed"
        print(f"  {op:<40} -> {name}")
    return 0


# --------------------------------------------------------------------------- attn bench


def cmd_bench(args: argparse.Namespace) -> int:
    from attn_common import bench

    bench.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attn", description="Ranker attention and sparse MLA kernels for JAX."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="installed backends, devices, jax version")
    info.set_defaults(func=cmd_info)
    run = sub.add_parser("run", help="the main job: an op at realistic shapes, checked, timed")
    run.add_argument("op", choices=("ranker", "sparse-mla", "all"))
    run.add_argument("--implementation", default=None, help="backend (default: best here)")
    run.add_argument("--batch", type=int, default=None, help="ranker batch rows")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--small", action="store_true", help="small shapes (seconds on a CPU)")
    run.set_defaults(func=cmd_run)
    from attn_common import bench

    b = sub.add_parser("bench", help="the SPEC section 7 ranker suite (meant for a GPU)")
    bench.add_arguments(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BackendUnavailableError as e:
        print(f"attn: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
