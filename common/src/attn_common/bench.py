"""The ranker benchmark suite of SPEC section 7 (``attn bench``; ``benchmarks/ranker_gpu.py``).

Runs the suite (phoenix, long, small-d64, ragged) for our kernel (the backend that
``attn_common.ranker_attention`` dispatches to, or ``--implementation``) and, in the same
process on the same inputs, what users would otherwise use: cuDNN and XLA through
``jax.nn.dot_product_attention`` with the dense ranker mask (no cap: cuDNN cannot apply
one), JAX's own Mosaic GPU FlashAttention-3 (dense, unmasked, fp16) as the speed of an
unmasked kernel, and the bf16 matmul and copy ceilings.

Timing: device-side kernel time from CUPTI (``jax.experimental.mosaic.gpu.profiler``),
summed over every kernel a call launches, median over ``--iterations`` calls after a
warm-up (saturated wall clock where CUPTI is unavailable). Effective TFLOP/s counts only
allowed (query, key) pairs (``attn_common.ranker_flops``); forward + backward counts 3.5x
the forward. FA3 dense is reported against its own dense FLOPs.

The suite is meant for a GPU (the shapes take minutes per case on a CPU). On any other
device ``attn bench`` says so and runs a smoke subset instead: ``small-d64`` at batch 1,
our backend against XLA with the dense mask, wall-clock timing, no ceilings;
``--full`` forces the whole suite anyway.

Writes ``ranker_gpu.json``, ``ranker_gpu.md`` and (with matplotlib installed)
``ranker_gpu.png`` into ``--out``.
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

from attn_common.bounds import ranker_mask
from attn_common.dispatch import device_class, select_backend
from attn_common.ranker import ranker_flops
from attn_common.suite import RANKER_SUITE, ranker_case

_WALLCLOCK_NOTED = False


def _on_gpu() -> bool:
    return device_class() in ("hopper", "gpu")


def device_ms(fn, *args, iterations: int = 20) -> tuple[float, str]:
    """Median device time of ``fn(*args)`` in ms, and the method used."""
    global _WALLCLOCK_NOTED
    if _on_gpu():
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, timings = profiler.measure(fn, iterations=iterations)(*args)
            if timings:
                return float(statistics.median(timings)), "cupti"
        except Exception as e:  # CUPTI unavailable: fall back to saturated wall clock
            print(f"  (cupti unavailable: {type(e).__name__}: {e}; using wall clock)")
    elif not _WALLCLOCK_NOTED:
        _WALLCLOCK_NOTED = True
        print("  (not a GPU: timing by wall clock)")
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(min(5, max(1, iterations))):
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


class Progress:
    """``[i/n]`` progress with elapsed time and a rough ETA, one line per measurement."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = max(1, total), 0, time.perf_counter()

    def prefix(self) -> str:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(1, self.done - 1) * (self.total - self.done + 1) if self.done > 1 else 0
        filled = int(20 * (self.done - 1) / self.total)
        bar = "#" * filled + "." * (20 - filled)
        return f"[{bar}] {self.done:>2}/{self.total} {elapsed:5.0f}s eta {eta:4.0f}s"


def run_case(
    case, impls: dict, iterations: int, seed: int, progress: Progress | None = None
) -> list[dict]:
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
        head = progress.prefix() + " " if progress is not None else "  "
        print(f"{head}{case.name:<10} {impl:<22} {mode:<8}", end="", flush=True)
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
            print(f" {ms:8.3f} ms {row['tflops']:8.2f} TFLOP/s")
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
        record(name, "fwd+bwd", fwd_bwd(fwd), (q, k, v, do), 3.5 * flops)

    if device_class() == "hopper":
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


def implementations(include_ours: bool, implementation: str | None = None) -> dict:
    """Name -> ``make(case, bounds, mask, scale)`` returning a ``(q, k, v) -> out`` fn."""

    def dpa(impl):
        def make(case, bounds, mask, scale):
            return lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=scale, implementation=impl
            )

        return make

    impls = {}
    if include_ours:
        backend, fn = select_backend("ranker_attention", implementation)

        def ours(case, bounds, mask, scale):
            return lambda q, k, v: fn(q, k, v, bounds, sm_scale=scale, cap=case.cap)

        impls[f"ours-{backend}"] = ours
    if _on_gpu():
        impls["cudnn-dense-mask"] = dpa("cudnn")
    impls["xla-dense-mask"] = dpa("xla")
    return impls


def _baseline(rows: list[dict]) -> str:
    impls = {r["impl"] for r in rows}
    return "cudnn-dense-mask" if "cudnn-dense-mask" in impls else "xla-dense-mask"


def write_reports(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranker_gpu.json").write_text(json.dumps(result, indent=2))
    rows = result["rows"]
    base = _baseline(rows)
    base_label = "cuDNN-mask" if base == "cudnn-dense-mask" else "XLA-mask"
    ref_ms = {(r["case"], r["mode"]): r["ms"] for r in rows if r["impl"] == base and r.get("ms")}
    ceil = result["ceilings"]
    lines = [
        f"Device: {result['device']}; jax {result['jax']}; timing: {result['timing']}; "
        f"ceilings: bf16 matmul {ceil.get('matmul_bf16_tflops', float('nan')):.0f} "
        f"TFLOP/s, copy {ceil.get('copy_tbps', float('nan')):.2f} TB/s.",
        "",
        f"| case | impl | mode | ms | effective TFLOP/s | speed-up vs {base_label} |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("ms") is None:
            lines.append(
                f"| {r['case']} | {r['impl']} | {r['mode']} | failed | | "
                f"{r.get('error', '')[:80]} |"
            )
            continue
        ref = ref_ms.get((r["case"], r["mode"]))
        ratio = f"{ref / r['ms']:.2f}x" if ref and not r["impl"].startswith("jax-fa3") else ""
        tflops = f"{r['tflops']:.0f}" if r["tflops"] >= 10 else f"{r['tflops']:.3f}"
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['mode']} | {r['ms']:.3f} | {tflops} | {ratio} |"
        )
    (out / "ranker_gpu.md").write_text("\n".join(lines) + "\n")
    write_plot(result, out / "ranker_gpu.png")


def write_plot(result: dict, path: Path) -> bool:
    """Bar chart of effective TFLOP/s; False (and a note) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print(f"  (matplotlib not installed: no {path.name}; pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
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
        if result["ceilings"].get("matmul_bf16_tflops"):
            ax.axhline(
                result["ceilings"]["matmul_bf16_tflops"],
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--cases", nargs="*", default=None, help="default: the whole suite")
    parser.add_argument("--no-ours", action="store_true", help="only the comparisons")
    parser.add_argument(
        "--implementation", default=None, help="our backend (default: the dispatch choice)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--full", action="store_true", help="run the whole suite even when not on a GPU"
    )


def run(args: argparse.Namespace) -> dict:
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, device {dev.device_kind}")
    cases = [ranker_case(name) for name in (args.cases or [c.name for c in RANKER_SUITE])]
    iterations = args.iterations
    smoke = not _on_gpu() and not args.full
    if smoke:
        print(
            f"The ranker suite is meant for a GPU; the default device is {device_class()}. "
            "Running a smoke subset only (small-d64 at batch 1, wall clock); "
            "--full runs the whole suite anyway."
        )
        cases = [ranker_case("small-d64").scaled(1)]
        iterations = min(iterations, 2)
    if not _on_gpu():
        global _WALLCLOCK_NOTED
        _WALLCLOCK_NOTED = True
        print("Not a GPU: timing by wall clock.")
    result = {
        "device": dev.device_kind,
        "jax": jax.__version__,
        "rows": [],
        "timing": "CUPTI device time, median of iterations" if _on_gpu() else "wall clock, median",
        "ceilings": {},
        "smoke": smoke,
    }
    if not smoke:
        try:
            result["ceilings"] = ceilings()
            print(f"ceilings: {result['ceilings']}")
        except Exception as e:
            print(f"ceilings failed: {e}")
    impls = implementations(not args.no_ours, args.implementation)
    per_case = 2 * len(impls) + (1 if device_class() == "hopper" else 0)
    progress = Progress(per_case * len(cases))
    for case in cases:
        result["rows"] += run_case(case, impls, iterations, args.seed, progress)
        write_reports(result, args.out)  # keep partial results if a later case dies
    write_reports(result, args.out)
    print(f"wrote {args.out}/ranker_gpu.json, .md, .png")
    print((args.out / "ranker_gpu.md").read_text())
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
