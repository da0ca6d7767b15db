"""The ranker benchmark suite (``attn bench``; ``benchmarks/ranker_gpu.py``).

What the suite measures and how: docs/design.md, "Benchmarks". The sparse MLA prefill
benchmark (``attn bench sparse-mla``) is ``attn_mosaic_gpu.bench_sparse_mla``; it shares
the timing, ceilings, provenance and output-folder helpers here.

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
``ranker_gpu.png`` into ``--out``: by default a new folder ``attn-results/<timestamp>``
under the current directory, never a committed path. An ``--out`` that already holds
results is refused unless ``--overwrite`` is given. Every report records the commit and
the command it was measured with. The exit status is non-zero when any row failed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.bounds import ranker_mask
from attn_common.cli_args import (
    MAX_SEED,
    OneLineParser,
    check_out_dir,
    default_out_dir,
    implementation_choices,
    iterations_int,
    out_path,
    provenance,
    seed_int,
)
from attn_common.dispatch import device_class, select_backend
from attn_common.ranker import ranker_flops
from attn_common.suite import RANKER_SUITE, ranker_case
from attn_mosaic_gpu._compat import cupti_init, cupti_timings, mosaic_gpu_ext

_WALLCLOCK_NOTED = False
CASE_NAMES = tuple(c.name for c in RANKER_SUITE)
RESULT_FILES = ("ranker_gpu.json", "ranker_gpu.md", "ranker_gpu.png")
SMOKE_LABEL = "Smoke run, not a measurement"


# --------------------------------------------------------------------------- arguments


def _on_gpu() -> bool:
    return device_class() in ("hopper", "gpu")


def cupti_call_ms(fn, args, iterations: int) -> list[float] | None:
    """Each call's device time (ms, the sum of its kernels' CUPTI durations).

    What ``jax.experimental.mosaic.gpu.profiler.measure`` does, except that a call's
    kernels need not be recorded in the same order every call, only be the same
    kernels: for a program with a conditional (the Hopper sparse-MLA op while its row
    table was a sort kernel followed by XLA's conditional compaction) CUPTI listed the
    branch's kernel late, so the calls' kernels came in different orders, which
    ``measure`` refuses. Where the branch's kernel is listed after the next call's
    first kernels (the query-blocked op's per-call choice, a ``lax.cond`` of two
    kernels, on the H200), cutting the calls' record into equal slices mixes calls;
    then each call is recorded on its own, waited for before the next starts. A call
    recorded alone must list as many kernels as a slice of the joint record (a lone
    call's late kernel can go unlisted: docs/sparse_mla_gpu.md); where one lists fewer,
    ``None``: no CUPTI time, and :func:`device_ms` times wall clock.
    """
    mosaic_gpu_ext()  # ImportError without the Mosaic GPU bindings, before any call
    jax.block_until_ready(fn(*args))  # warm-up, outside the record
    cupti_init()
    try:
        jax.block_until_ready([fn(*args) for _ in range(iterations)])
    finally:
        records = cupti_timings(True)
    if not records:
        return None
    if len(records) % iterations:
        raise RuntimeError(f"{len(records)} kernel records for {iterations} calls")
    per_call = len(records) // iterations
    calls = [records[i * per_call : (i + 1) * per_call] for i in range(iterations)]
    if not _same_kernels(calls):
        calls = []
        for _ in range(iterations):
            cupti_init()
            try:
                jax.block_until_ready(fn(*args))
            finally:
                calls.append(cupti_timings(True) or [])
        if any(len(call) != per_call for call in calls):
            return None
        if not _same_kernels(calls):
            first, other = ([name[:40] for name, _ in c] for c in (calls[0], calls[-1]))
            raise RuntimeError(f"the calls ran different kernels: {first} against {other}")
    return [sum(ms for _, ms in call) for call in calls]


def _same_kernels(calls: list[list]) -> bool:
    """Whether every call's record lists the same kernel names (in any order)."""
    names = sorted(name for name, _ in calls[0])
    return all(sorted(name for name, _ in call) == names for call in calls[1:])


def kernel_breakdown(fn, args, *, top: int = 8, calls: int = 3) -> list[list] | None:
    """Where one call's device time goes: ``[name, ms, launches]`` per kernel name (CUPTI;
    XLA's numeric suffixes dropped, so a ``lax.scan`` body's launches add up), longest
    first, the kernels past ``top`` summed as ``"other"``. The fastest of ``calls``
    recorded calls; ``None`` where CUPTI records nothing."""
    mosaic_gpu_ext()
    jax.block_until_ready(fn(*args))
    best = None
    for _ in range(calls):
        cupti_init()
        try:
            jax.block_until_ready(fn(*args))
        finally:
            records = cupti_timings(True)
        if records and (best is None or sum(ms for _, ms in records) < sum(ms for _, ms in best)):
            best = records
    if not best:
        return None
    groups: dict[str, list] = {}
    for name, ms in best:
        key = re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+", "", name))
        entry = groups.setdefault(key, [key, 0.0, 0])
        entry[1] += ms
        entry[2] += 1
    ranked = sorted(groups.values(), key=lambda e: -e[1])
    if len(ranked) > top:
        rest = ranked[top:]
        ranked = [*ranked[:top], ["other", sum(e[1] for e in rest), sum(e[2] for e in rest)]]
    return ranked


def device_ms(fn, *args, iterations: int = 20) -> tuple[float, str]:
    """Median device time of ``fn(*args)`` in ms, and the method used."""
    global _WALLCLOCK_NOTED
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations: got {iterations!r}, expected a positive int")
    if _on_gpu():
        try:
            timings = cupti_call_ms(fn, args, iterations)
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
    b, s, hq, d = case.batch, case.seq_len, case.q_heads, case.head_dim
    bounds = case.bounds(seed)
    q, k, v, do = case.inputs(seed)
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


def write_reports(result: dict, out: Path, *, plot: bool = True) -> list[str]:
    """Write the JSON and Markdown reports (and the PNG when ``plot``); the names written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranker_gpu.json").write_text(json.dumps(result, indent=2))
    rows = result["rows"]
    base = _baseline(rows)
    base_label = "cuDNN-mask" if base == "cudnn-dense-mask" else "XLA-mask"
    ref_ms = {(r["case"], r["mode"]): r["ms"] for r in rows if r["impl"] == base and r.get("ms")}
    ceil = result["ceilings"]
    prov = result.get("provenance", {})
    if ceil.get("matmul_bf16_tflops") and ceil.get("copy_tbps"):
        ceiling = (
            f"ceilings: bf16 matmul {ceil['matmul_bf16_tflops']:.0f} TFLOP/s, copy "
            f"{ceil['copy_tbps']:.2f} TB/s."
        )
    else:
        ceiling = "ceilings: not measured."
    lines = [
        f"Commit: {prov.get('commit', 'unknown')}; command: `{prov.get('command', '?')}`; "
        f"date: {prov.get('date', '?')}.",
        "",
        *(
            [
                f"**{SMOKE_LABEL}**: tiny shapes off a GPU, wall clock; it checks that the "
                "suite runs, its times say nothing about the kernels.",
                "",
            ]
            if result.get("smoke")
            else []
        ),
        f"Device: {result['device']}; jax {result['jax']}; timing: {result['timing']}; " + ceiling,
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
    written = ["ranker_gpu.json", "ranker_gpu.md"]
    if plot and write_plot(result, out / "ranker_gpu.png"):
        written.append("ranker_gpu.png")
    return written


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
    parser.add_argument(
        "--out",
        type=out_path,
        default=None,
        help="folder for ranker_gpu.json/.md/.png (default: a new folder "
        "attn-results/<timestamp> under the current directory)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="allow an --out that already holds results (default: refuse)",
    )
    parser.add_argument(
        "--iterations",
        type=iterations_int,
        default=20,
        help="timed calls per measurement, 1..10000 (default: 20; 2 in the smoke subset)",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=CASE_NAMES,
        default=None,
        metavar="CASE",
        help=f"cases to run, of {', '.join(CASE_NAMES)} (default: all on a GPU; off a GPU "
        "only the smoke subset, and naming cases there needs --full)",
    )
    parser.add_argument("--no-ours", action="store_true", help="only the comparisons")
    parser.add_argument(
        "--implementation",
        choices=implementation_choices(),
        default=None,
        help="our backend (default: the dispatch choice for the default device)",
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0, help=f"0 <= seed <= {MAX_SEED} (default: 0)"
    )
    parser.add_argument(
        "--full", action="store_true", help="run the whole suite even when not on a GPU"
    )


def suite_epilog() -> str:
    """The suite's shapes, for ``--help``."""
    lines = ["cases (bf16; effective FLOPs count allowed pairs, fwd+bwd = 3.5x fwd):"]
    for c in RANKER_SUITE:
        hist = "ragged 126..1022" if c.ragged else f"{c.history[1] - c.history[0]}"
        cand = c.candidates[1] - c.candidates[0]
        lines.append(
            f"  {c.name:<10} B{c.batch} S{c.seq_len} Hq{c.q_heads}/Hkv{c.kv_heads} "
            f"D{c.head_dim}, history {hist}, {cand} candidates, cap {c.cap.method.value}"
        )
    lines.append("off a GPU (smoke subset): small-d64 at batch 1, ours vs XLA, wall clock")
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> str | None:
    """Checks that need the device or the file system; the one-line error, or None."""
    if args.cases and not _on_gpu() and not args.full:
        return (
            f"--cases: got {' '.join(args.cases)}; the suite's cases are sized for a GPU and "
            f"the default device is {device_class()}: leave --cases out for the smoke subset, "
            "or add --full to run these cases here anyway (minutes per case)"
        )
    if args.out is None:
        args.out = default_out_dir()
    return check_out_dir(args.out, overwrite=args.overwrite, result_files=RESULT_FILES)


def run(args: argparse.Namespace) -> dict:
    """Run the suite into ``args.out``; ``result["failed"]`` counts the failed rows."""
    if getattr(args, "out", None) is None:
        args.out = default_out_dir()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, device {dev.device_kind}")
    cases = [ranker_case(name) for name in (args.cases or CASE_NAMES)]
    iterations = args.iterations
    smoke = not _on_gpu() and not args.full
    if smoke:
        if args.cases:
            raise ValueError(check_args(args) or "--cases needs --full off a GPU")
        print(
            f"The ranker suite is meant for a GPU; the default device is {device_class()}. "
            "Running a smoke subset only (small-d64 at batch 1, wall clock): smoke run, not a "
            "measurement; "
            "--full runs the whole suite anyway."
        )
        cases = [ranker_case("small-d64").scaled(1)]
        iterations = min(iterations, 2)
    if not _on_gpu():
        global _WALLCLOCK_NOTED
        _WALLCLOCK_NOTED = True
        print("Not a GPU: timing by wall clock.")
    result = {
        "provenance": provenance(getattr(args, "argv", None)),
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
        # keep partial results if a later case dies; the plot only once, at the end
        write_reports(result, args.out, plot=False)
    result["failed"] = sum(1 for r in result["rows"] if r.get("ms") is None)
    written = write_reports(result, args.out)
    print(f"wrote {', '.join(str(args.out / name) for name in written)}")
    print((args.out / "ranker_gpu.md").read_text())
    if result["failed"]:
        print(f"{result['failed']} of {len(result['rows'])} rows failed", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        description=__doc__.splitlines()[0],
        epilog=suite_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    return 1 if run(args)["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())


# --------------------------------------------------------------------------- populations


def simulate_ranker_users(
    num_users: int = 10_000,
    *,
    median_history: float = 200.0,
    sigma: float = 1.0,
    max_history: int = 1024,
    num_candidates: int = 64,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic ranker batch: history lengths log-normal (median ``median_history``,
    log-space ``sigma``) rounded and clipped to ``[1, max_history]``, and
    ``num_candidates`` candidates per user. Returns ``(history_lens, num_candidates)``."""
    rng = np.random.default_rng(seed)
    hist = np.exp(rng.normal(np.log(median_history), sigma, size=num_users))
    hist = np.clip(np.rint(hist), 1, max_history).astype(np.int64)
    return hist, np.full(num_users, num_candidates, np.int64)
