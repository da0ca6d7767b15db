"""Sharded vs unsharded ranker attention (Mosaic GPU kernels) and sparse MLA on 2 GPUs.

Run on a machine with at least two Hopper GPUs (not part of the CPU suite)::

    python tests/sharding_gpu_check.py --out docs/results

Checks, each against the unsharded call on one device:

* ``attn_common.ranker_attention`` with ``implementation=None`` dispatches to
  ``mosaic-gpu`` on Hopper;
* ``shard_ranker_attention`` with batch sharding, head sharding and both: ``out`` and
  ``lse`` bitwise equal to the unsharded kernel (each (row, head) is computed by the
  same program either way), and within bf16 tolerance of the f32 reference;
* ``jax.grad`` through the sharded call matches the unsharded gradients (rel L2 < 1e-2;
  not bitwise: ``delta' = rowsum(dO * O)`` is an XLA reduction whose order may change
  with the sharded shapes; the kernels' own determinism is tested in
  ``test_ranker_bwd_gpu.py``);
* sparse MLA through the sharding helpers with the Hopper kernels pinned
  (``attn_mosaic_gpu.sparse_mla_attention``, never a fallback; ``check_sparse_mla_kernels``):
  flat with unit-level selections at 128 heads and token-level ones (the row-sort
  kernel builds the row tables), a bf16 and an FP8 cache (dequantized on chip), the
  deterministic backward; ragged paged with the requests sharded (the pool sharded by
  request or replicated) and with the heads sharded; forward, LSE and attention mass
  within 1e-5 of the unsharded kernel, gradients (the forward and backward kernels)
  within bf16 rounding (the cache gradient is summed by float32 atomics); dispatch
  must pick ``mosaic-gpu`` for sparse MLA too. The reference-backend sparse-MLA checks
  of the CPU suite run as well.

It also times the phoenix forward and forward+backward on one GPU and batch-sharded
over two (wall clock per call, median, queue kept full) and writes ``sharding_gpu.json``
and ``.md``. ``--cpu-dry-run`` runs the same code on 2 CPU devices with the reference
backend in place of the kernels (API check only: no bitwise claims, no timing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attn_common import (
    SegmentBounds,
    ranker_attention,
    ranker_case,
    select_backend,
    shard_ranker_attention,
)

sys.path.insert(0, str(Path(__file__).parent))
import sharding_check  # the CPU checks, reused on a 2-GPU mesh

DRY_RUN = False


FAILURES: list[str] = []


def _compare(label, got, want, *, rel_tol, require_bitwise=False):
    """Record (and print) how ``got`` compares with ``want``; failures are collected so
    that one run reports every comparison."""
    g = np.asarray(got.astype(jnp.float32) if hasattr(got, "astype") else got, np.float64)
    w = np.asarray(want.astype(jnp.float32) if hasattr(want, "astype") else want, np.float64)
    same_inf = np.array_equal(np.isneginf(g), np.isneginf(w))
    fin = np.isfinite(w)
    bitwise = bool(np.array_equal(np.asarray(got), np.asarray(want)))
    rel = _rel(g[fin], w[fin]) if fin.any() else 0.0
    ok = same_inf and np.isfinite(g[fin]).all() and rel < rel_tol
    if require_bitwise and not DRY_RUN:
        ok = ok and bitwise
    print(f"  {label}: bitwise={bitwise} rel_l2={rel:.2e} {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILURES.append(label)
    return {"bitwise": bitwise, "rel_l2": rel}


def _inputs(b, s, hq, hkv, d, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16)
    w = jax.random.normal(keys[3], (b, s, hq, d), jnp.float32)
    return q, k, v, w


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_ranker(mesh, report, **kw):
    case = ranker_case("phoenix")
    b, s = 4, 1152
    q, k, v, w = _inputs(b, s, case.q_heads, case.kv_heads, case.head_dim)
    hist = jnp.array([1024, 700, 130, 0], jnp.int32)
    bounds = SegmentBounds.from_lengths(hist, 64).as_array()
    cap = case.cap
    want, want_lse = jax.jit(
        lambda *a: ranker_attention(*a, cap=cap, return_lse=True)
    )(q, k, v, bounds)  # fmt: skip
    sharded = shard_ranker_attention(mesh, cap=cap, return_lse=True, **kw)
    got, got_lse = jax.jit(sharded)(q, k, v, bounds)
    assert got.sharding.mesh.size == mesh.size
    key = f"ranker {dict(mesh.shape)} {kw or ''}".strip()
    print(key)
    entry = {"check": key}
    # the same program computes each (row, head) sharded or not: expect the same bits
    tight = 1e-3 if DRY_RUN else 1e-6  # the CPU reference is not bitwise across shardings
    entry["out"] = _compare("out vs unsharded", got, want, rel_tol=tight, require_bitwise=True)
    entry["lse"] = _compare("lse vs unsharded", got_lse, want_lse, rel_tol=tight)

    ref, _ = ranker_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), bounds,
        cap=cap, return_lse=True, implementation="reference",
    )  # fmt: skip
    entry["out_vs_reference"] = _compare("out vs f32 reference", got, ref, rel_tol=2e-2)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, bounds).astype(jnp.float32) * w)

    def unsharded(q, k, v, bounds):
        return ranker_attention(q, k, v, bounds, cap=cap)

    plain = shard_ranker_attention(mesh, cap=cap, **kw)
    g_want = jax.jit(jax.grad(loss(unsharded), argnums=(0, 1, 2)))(q, k, v)
    g_got = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(q, k, v)
    # delta' = rowsum(dO * O) is an XLA reduction whose order may change with the
    # sharded shapes, so gradients agree to rounding, not necessarily bit for bit
    for name, g, r in zip(("dq", "dk", "dv"), g_got, g_want, strict=True):
        entry[name] = _compare(f"{name} vs unsharded", g, r, rel_tol=1e-2)
    report["checks"].append(entry)


def check_sparse_mla_kernels(both, heads, report):
    """Sparse MLA sharded over ``both`` (batch / requests over "data") and ``heads``
    (heads over "model") with the Hopper kernels pinned, against the unsharded kernel
    (``sharding_check``'s checks with ``fn``); the reference on a dry run."""
    if DRY_RUN:
        import attn_reference

        kernel, on_gpu = attn_reference.sparse_mla_attention, {}
    else:
        import attn_mosaic_gpu

        kernel, on_gpu = attn_mosaic_gpu.sparse_mla_attention, {"deterministic": True}
    flat = dict(b=2, s=32, t=1024, dv=512)
    cases = [
        ("flat, unit-level, H 128", dict(h=128, rb=64, top_k=4, **flat)),
        ("flat, token-level (row sort), H 64", dict(h=64, rb=1, top_k=512, **flat)),
        ("flat, FP8 on chip, H 64", dict(h=64, rb=64, top_k=4, fp8=True, **flat,
                                        **({} if DRY_RUN else {"fp8_dequantize": False}))),
        ("flat, deterministic backward, H 64", dict(h=64, rb=64, top_k=4, **flat, **on_gpu)),
    ]  # fmt: skip
    for mesh in (both, heads):
        for name, kw in cases:
            label = f"sparse MLA kernels {name} {dict(mesh.shape)}"
            _sparse_check(label, report, sharding_check.check_kernel_flat, mesh, kernel,
                          batch_axis="data", head_axis="model", **kw)  # fmt: skip
    for pool, fp8 in (("sharded", False), ("replicated", False), ("sharded", True)):
        label = f"sparse MLA kernels ragged, requests over 'data', pool {pool}, fp8 {fp8}"
        _sparse_check(label, report, sharding_check.check_sparse_mla_requests, both, "data",
                      "model", pool, fp8=fp8, fn=kernel, heads=64)  # fmt: skip
    label = "sparse MLA kernels ragged, heads over 'model', H 128"
    _sparse_check(label, report, sharding_check.check_sparse_mla_requests, heads, "data",
                  "model", "replicated", fp8=False, fn=kernel, heads=128)  # fmt: skip


def _sparse_check(label, report, check, *args, **kwargs):
    try:
        check(*args, **kwargs)
    except AssertionError as e:
        print(f"FAIL {label}: {e}")
        FAILURES.append(label)
        return
    report["checks"].append({"check": label})
    print(f"OK {label}", flush=True)


def _reference_checks(mesh):
    sharding_check.check_sparse_mla(mesh)
    sharding_check.check_sparse_mla_ragged(mesh, head_axis="model")


def _wall_ms(fn, *args, iterations=10, samples=5):
    """Median wall time per call in ms, the device queue kept full (CUPTI would add up
    the kernels of both GPUs, which is not what sharding saves)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(iterations)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) * 1e3 / iterations)
    return float(statistics.median(times))


def time_phoenix(mesh, report):
    """Phoenix fwd and fwd+bwd: one GPU vs batch-sharded over the mesh's data axis."""
    case = ranker_case("phoenix")
    q, k, v, w = _inputs(case.batch, case.seq_len, case.q_heads, case.kv_heads, case.head_dim)
    bounds = jnp.broadcast_to(jnp.array([0, 1024, 1024, 1088], jnp.int32), (case.batch, 4))
    cap = case.cap

    def fwd_one(q, k, v, bounds):
        return ranker_attention(q, k, v, bounds, cap=cap)

    fwd_sharded = shard_ranker_attention(mesh, cap=cap, head_axis=None)

    def step(fn):
        def f(q, k, v, bounds, w):
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, bounds), q, k, v)
            return out, vjp(w.astype(out.dtype))

        return jax.jit(f)

    spec = NamedSharding(mesh, P("data"))
    sq, sk, sv, sb, sw = (jax.device_put(x, spec) for x in (q, k, v, bounds, w))
    rows = []
    for mode, one, many in (
        ("fwd", jax.jit(fwd_one), jax.jit(fwd_sharded)),
        ("fwd+bwd", step(fwd_one), step(fwd_sharded)),
    ):
        extra = (w,) if mode == "fwd+bwd" else ()
        extra_s = (sw,) if mode == "fwd+bwd" else ()
        t1 = _wall_ms(one, q, k, v, bounds, *extra)
        t2 = _wall_ms(many, sq, sk, sv, sb, *extra_s)
        rows.append({"mode": mode, "one_gpu_ms": t1, "sharded_ms": t2, "speedup": t1 / t2})
        print(f"phoenix {mode}: 1 GPU {t1:.3f} ms, {mesh.size} GPUs batch-sharded {t2:.3f} ms")
    report["timing"] = rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    global DRY_RUN
    DRY_RUN = args.cpu_dry_run
    devices = jax.devices()
    assert len(devices) >= 2, devices
    report = {"devices": [d.device_kind for d in devices[:2]], "jax": jax.__version__}
    name, _ = select_backend("ranker_attention")
    assert name == ("reference" if DRY_RUN else "mosaic-gpu"), name
    report["ranker_backend"] = name
    report["sparse_mla_backend"] = select_backend("sparse_mla_attention")[0]
    assert report["sparse_mla_backend"] == name, report["sparse_mla_backend"]
    report["checks"] = []
    print(f"{len(devices)} x {devices[0].device_kind}; ranker -> {name}, "
          f"sparse MLA -> {report['sparse_mla_backend']}")  # fmt: skip

    both = jax.make_mesh((2, 1), ("data", "model"), devices=devices[:2])
    heads = jax.make_mesh((1, 2), ("data", "model"), devices=devices[:2])
    check_ranker(both, report)
    check_ranker(heads, report)
    check_ranker(jax.make_mesh((2,), ("batch",), devices=devices[:2]), report,
                 batch_axis="batch", head_axis=None)  # fmt: skip
    check_sparse_mla_kernels(both, heads, report)
    for mesh in (both, heads):  # float32 and D 80: these run on the reference
        label = f"sparse MLA flat + ragged paged (reference) {dict(mesh.shape)}"
        _sparse_check(label, report, _reference_checks, mesh)
    if DRY_RUN:
        print("FAILED: " + ", ".join(FAILURES) if FAILURES else "OK (dry run)")
        return
    time_phoenix(both, report)
    report["failures"] = FAILURES
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sharding_gpu.json").write_text(json.dumps(report, indent=2))
        lines = [
            f"# Sharding on {len(devices[:2])} x {devices[0].device_kind} (jax {jax.__version__})",
            "",
            "Produced by `python tests/sharding_gpu_check.py --out docs/results`.",
            "",
            f"Dispatch: ranker -> `{name}`, sparse MLA -> `{report['sparse_mla_backend']}`.",
            "",
            "| check | result |",
            "|---|---|",
        ]
        for c in report["checks"]:
            parts = []
            for field in ("out", "lse", "dq", "dk", "dv", "out_vs_reference"):
                if field in c:
                    r = c[field]
                    how = "bitwise equal" if r["bitwise"] else f"rel L2 {r['rel_l2']:.1e}"
                    parts.append(f"{field}: {how}")
            lines.append(f"| {c['check']} | {'; '.join(parts) or 'matches unsharded'} |")
        lines += ["", "| phoenix | 1 GPU (ms) | 2 GPUs, batch-sharded (ms) | speed-up |",
                  "|---|---|---|---|"]  # fmt: skip
        for r in report["timing"]:
            lines.append(
                f"| {r['mode']} | {r['one_gpu_ms']:.3f} | {r['sharded_ms']:.3f} | "
                f"{r['speedup']:.2f}x |"
            )
        (args.out / "sharding_gpu.md").write_text("\n".join(lines) + "\n")
    if FAILURES:
        raise SystemExit("FAILED: " + ", ".join(FAILURES))
    print("OK")


if __name__ == "__main__":
    main()
