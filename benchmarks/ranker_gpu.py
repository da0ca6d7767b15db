"""Ranker attention benchmark on a Hopper GPU (SPEC section 7).

Runs the suite (phoenix, long, small-d64, ragged) for our Mosaic GPU kernel and, in the
same process on the same inputs, what users would otherwise use: cuDNN and XLA through
``jax.nn.dot_product_attention`` with the dense ranker mask (no cap: cuDNN cannot apply
one), JAX's own Mosaic GPU FlashAttention-3 (dense, unmasked, fp16) as the speed of an
unmasked kernel, and the bf16 matmul and copy ceilings.

Timing: device-side kernel time from CUPTI (``jax.experimental.mosaic.gpu.profiler``),
summed over every kernel a call launches, median over ``--iterations`` calls after a
warm-up. Effective TFLOP/s counts only allowed (query, key) pairs
(``attn_common.ranker_flops``); forward + backward counts 3.5x the forward. FA3 dense is
reported against its own dense FLOPs.

Usage: ``python benchmarks/ranker_gpu.py --out DIR`` writes ``ranker_gpu.json``,
``ranker_gpu.md`` and ``ranker_gpu.png`` into DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import RANKER_SUITE, ranker_flops, ranker_mask


def device_ms(fn, *args, iterations: int = 20) -> tuple[float, str]:
    """Median device time of ``fn(*args)`` in ms, and the method used."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, timings = profiler.measure(fn, iterations=iterations)(*args)
        if timings:
            return float(statistics.median(timings)), "cupti"
    except Exception as e:  # CUPTI unavailable: fall back to saturated wall clock
        print(f"  (cupti unavailable: {type(e).__name__}: {e}; using wall clock)")
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(iterations)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t0) * 1e3 / iterations)
    return float(statistics.median(samples)), "wallclock"


def dense_mask(bounds: np.ndarray, seq: int) -> jax.Array:
    pos = jnp.arange(seq, dtype=jnp.int32)
    b = jnp.asarray(bounds)
    m = ranker_mask(
        pos[None, :, None], pos[None, None, :], *(b[:, i, None, None] for i in range(4))
    )
    return m[:, None]  # [B, 1, S, S]


def fwd_bwd(fwd):
    """A jitted call computing out and the gradients (q, k, v) for a random cotangent."""

    def step(q, k, v, do):
        out, vjp = jax.vjp(fwd, q, k, v)
        return out, vjp(do)

    return jax.jit(step)


def ceilings() -> dict:
    a = jax.random.normal(jax.random.PRNGKey(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(2), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t_mm, _ = device_ms(mm, a, b)
    x = jax.random.normal(jax.random.PRNGKey(3), (1 << 29,), jnp.bfloat16)  # 1 GiB
    cp = jax.jit(lambda x: x * 1)
    t_cp, _ = device_ms(cp, x)
    return {
        "matmul_bf16_tflops": 2 * 8192**3 / t_mm / 1e9,
        "copy_tbps": 2 * x.nbytes / t_cp / 1e9,
    }


def run_case(case, impls: dict, iterations: int, seed: int) -> list[dict]:
    b, s, hq, hkv, d = case.batch, case.seq_len, case.q_heads, case.kv_heads, case.head_dim
    bounds = case.bounds(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, s, hq, d), jnp.bfloat16)
    bounds_dev = jnp.asarray(bounds)
    mask = dense_mask(bounds, s)
    flops = ranker_flops(bounds, hq, d)
    scale = 1.0 / math.sqrt(d)
    rows = []

    def record(impl, mode, fn, args, flop_count, note=""):
        print(f"  {case.name:<10} {impl:<22} {mode:<8}", end="", flush=True)
        try:
            ms, method = device_ms(fn, *args, iterations=iterations)
            row = {
                "case": case.name,
                "impl": impl,
                "mode": mode,
                "ms": ms,
                "tflops": flop_count / ms / 1e9,
                "timing": method,
                "note": note,
            }
            print(f" {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s")
        except Exception as e:
            row = {
                "case": case.name,
                "impl": impl,
                "mode": mode,
                "ms": None,
                "tflops": None,
                "error": f"{type(e).__name__}: {str(e)[:300]}",
            }
            print(f" FAILED {row['error']}")
            traceback.print_exc(limit=3)
        rows.append(row)

    for name, make in impls.items():
        fwd = make(case, bounds_dev, mask, scale)
        if fwd is None:
            continue
        record(name, "fwd", jax.jit(fwd), (q, k, v), flops)
        if getattr(make, "has_backward", True):
            record(name, "fwd+bwd", fwd_bwd(fwd), (q, k, v, do), 3.5 * flops)

    # JAX's Mosaic GPU FlashAttention-3: dense, unmasked, fp16 (its supported dtype).
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3

        cfg = fa3.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
        f16 = [x.astype(jnp.float16) for x in (q, k, v)]
        dense_flops = 4.0 * b * hq * s * s * d
        record(
            "jax-fa3-dense-fp16",
            "fwd",
            jax.jit(lambda q, k, v: fa3.attention(q, k, v, cfg)),
            f16,
            dense_flops,
            note="dense, unmasked: FLOPs = 4*B*Hq*S^2*D",
        )
    except Exception as e:
        rows.append(
            {
                "case": case.name,
                "impl": "jax-fa3-dense-fp16",
                "mode": "fwd",
                "ms": None,
                "tflops": None,
                "error": f"{type(e).__name__}: {e}",
            }
        )
    return rows


def implementations(include_ours: bool) -> dict:
    def dpa(implementation):
        def make(case, bounds, mask, scale):
            return lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=scale, implementation=implementation
            )

        return make

    impls = {}
    if include_ours:

        def ours(case, bounds, mask, scale):
            import attn_mosaic_gpu

            return lambda q, k, v: attn_mosaic_gpu.ranker_attention(
                q, k, v, bounds, sm_scale=scale, cap=case.cap
            )

        # The Hopper backward kernels are a separate issue: time the forward only.
        ours.has_backward = False
        impls["ours-mosaic-gpu"] = ours
    impls["cudnn-dense-mask"] = dpa("cudnn")
    impls["xla-dense-mask"] = dpa("xla")
    return impls


def write_reports(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranker_gpu.json").write_text(json.dumps(result, indent=2))
    rows = result["rows"]
    cudnn = {
        (r["case"], r["mode"]): r["ms"]
        for r in rows
        if r["impl"] == "cudnn-dense-mask" and r.get("ms")
    }
    lines = [
        f"Device: {result['device']}; jax {result['jax']}; timing: {result['timing']}; "
        f"ceilings: bf16 matmul {result['ceilings'].get('matmul_bf16_tflops', float('nan')):.0f} "
        f"TFLOP/s, copy {result['ceilings'].get('copy_tbps', float('nan')):.2f} TB/s.",
        "",
        "| case | impl | mode | ms | effective TFLOP/s | speed-up vs cuDNN-mask |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("ms") is None:
            lines.append(
                f"| {r['case']} | {r['impl']} | {r['mode']} | failed | | "
                f"{r.get('error', '')[:80]} |"
            )
            continue
        ref = cudnn.get((r["case"], r["mode"]))
        ratio = f"{ref / r['ms']:.2f}x" if ref and not r["impl"].startswith("jax-fa3") else ""
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['mode']} | {r['ms']:.3f} | "
            f"{r['tflops']:.0f} | {ratio} |"
        )
    (out / "ranker_gpu.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c.name for c in RANKER_SUITE]
    impls = sorted({r["impl"] for r in rows}, key=lambda n: (not n.startswith("ours"), n))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd"), strict=True):
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            vals = [
                next(
                    (
                        r["tflops"] or 0
                        for r in rows
                        if r["case"] == c and r["impl"] == impl and r["mode"] == mode
                    ),
                    0,
                )
                for c in cases
            ]
            ax.bar(np.arange(len(cases)) + i * width, vals, width, label=impl)
        ax.axhline(
            result["ceilings"].get("matmul_bf16_tflops", 0),
            color="k",
            ls="--",
            lw=0.8,
            label="bf16 matmul ceiling",
        )
        ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, cases)
        ax.set_ylabel("effective TFLOP/s (allowed pairs)")
        ax.set_title(f"ranker attention {mode}, {result['device']}")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ranker_gpu.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--cases", nargs="*", default=[c.name for c in RANKER_SUITE])
    parser.add_argument("--no-ours", action="store_true", help="only the comparisons")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, device {dev.device_kind}")
    result = {
        "device": dev.device_kind,
        "jax": jax.__version__,
        "rows": [],
        "timing": "CUPTI device time, median of iterations",
        "ceilings": {},
    }
    try:
        result["ceilings"] = ceilings()
        print(f"ceilings: {result['ceilings']}")
    except Exception as e:
        print(f"ceilings failed: {e}")
    impls = implementations(include_ours=not args.no_ours)
    for case in RANKER_SUITE:
        if case.name in args.cases:
            result["rows"] += run_case(case, impls, args.iterations, args.seed)
            write_reports(result, args.out)  # keep partial results if a later case dies
    write_reports(result, args.out)
    print((args.out / "ranker_gpu.md").read_text())


if __name__ == "__main__":
    main()
