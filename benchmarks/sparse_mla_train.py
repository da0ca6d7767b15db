"""Sparse-MLA training step on one GPU: forward, backward and both, against XLA's gradient.

The shape of issue 40: ``S`` query tokens (one flat sequence whose last ``S`` tokens are
the queries), each attending ``top-K`` distinct token-level selections (``read_block=1``)
of a ``T``-token latent cache, ``Dk = 576`` / ``Dv = 512``, bf16, heads 64 and 128.

Implementations, all timed in the same run (CUPTI device time, median of
``--iterations`` calls, ``attn_mosaic_gpu.bench.device_ms``):

* ``xla``: what a JAX trainer writes today, the gather + einsum attention of the
  forward benchmarks (``attn_mosaic_gpu.bench_sparse_mla.xla_sparse_mla``, queries in
  chunks of 512) differentiated by ``jax.vjp``.
* ``reference``: ``attn_reference.sparse_mla_attention`` (XLA, the executable definition:
  its chunks are rematerialised in the backward).
* ``mosaic-gpu``: ``attn_mosaic_gpu.sparse_mla_attention``: the Hopper forward kernel
  and the backward kernel (``sparse_mla_bwd_kernel``) from the saved ``out`` and
  ``lse``, the cache gradient added by float32 atomics (the default);
* ``mosaic-gpu-deterministic``: the same with ``deterministic=True`` (the key-gradient
  parts stored, then summed per cache row in a fixed order: bitwise reproducible).

For each: the forward alone, the backward alone (the VJP function of a saved forward,
applied to a cotangent) and forward + backward (``jax.vjp`` then the VJP, one jitted
call), and on a GPU one forward + backward call's device time by kernel
(``attn_mosaic_gpu.bench.kernel_breakdown``). TFLOP/s count the forward as
``2 H K (Dk + Dv)`` per query and forward + backward as 3.53 times that (issue 40's
convention). The gradients of ``reference``
and ``mosaic-gpu`` are checked against ``xla``'s (relative L2 of ``dq`` and ``dkv``).

Writes ``<out>/sparse_mla_train.{json,md,svg}`` with the commit, command and device.
The JSON's ``rows`` have one entry per implementation, shape and ``mode`` (``fwd``,
``bwd``, ``fwd+bwd``): ``impl`` (``xla``, ``reference``, ``ours``, ``ours-deterministic``),
``heads``, ``tokens`` (the cache's ``T``), ``queries``, ``top_k``, ``ms``, ``tflops``
and ``vs_xla`` (XLA's time for that mode and shape over this one); ``cases`` keep each
implementation's whole measurement (kernel breakdown, gradient errors).
Run on the H200: ``python benchmarks/sparse_mla_train.py --out docs/results``;
``--smoke`` runs tiny shapes on any device, timed by wall clock off a GPU: seconds with
``--impls xla reference``, about 7 minutes on 2 CPU cores per Hopper implementation
(interpreted). A run longer than one device call (the whole set takes about 8 minutes on
the H200) can go in several calls, each with ``--kv-lens`` / ``--heads``, then
``--merge run1.json run2.json --out docs/results`` writes one report from them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.cli import MIN_XLA_CPU_THREADS
from attn_common.cli_args import provenance
from attn_mosaic_gpu.bench import device_ms, kernel_breakdown
from attn_mosaic_gpu.bench_sparse_mla import distinct_choices, rel_l2, write_json, xla_sparse_mla

DK, DV = 576, 512
BWD_FACTOR = 3.53  # forward + backward FLOPs over forward FLOPs (issue 40)
IMPLS = ("xla", "reference", "mosaic-gpu", "mosaic-gpu-deterministic")
ROW_NAMES = {"mosaic-gpu": "ours", "mosaic-gpu-deterministic": "ours-deterministic"}
MODES = (
    ("fwd", "fwd_ms", 1.0),
    ("bwd", "bwd_ms", BWD_FACTOR - 1.0),
    ("fwd+bwd", "step_ms", BWD_FACTOR),
)
FULL = {"queries": 4096, "top_k": 2048, "kv_lens": (32768, 131072), "heads": (64, 128)}
SMOKE = {"queries": 16, "top_k": 8, "kv_lens": (64,), "heads": (4,)}


def make_inputs(queries: int, top_k: int, kv_len: int, heads: int, seed: int = 0) -> dict:
    """``q [1, S, H, 576]``, ``kv [1, T, 576]`` bf16, ``indices [1, S, K]`` distinct
    token ids ``<= position`` (``-1`` past a query's available tokens), ``positions
    [1, S]`` = the last ``S`` tokens, and a cotangent ``g [1, S, H, 512]``."""
    rng = np.random.default_rng(seed)
    kq, kkv, kg = jax.random.split(jax.random.key(seed), 3)
    positions = np.arange(kv_len - queries, kv_len, dtype=np.int32)
    idx = distinct_choices(rng, positions + 1, top_k)
    return {
        "q": jax.random.normal(kq, (1, queries, heads, DK), jnp.bfloat16),
        "kv": jax.random.normal(kkv, (1, kv_len, DK), jnp.bfloat16),
        "indices": jnp.asarray(idx)[None],
        "positions": jnp.asarray(positions)[None],
        "g": jax.random.normal(kg, (1, queries, heads, DV), jnp.float32),
    }


def attention(impl: str):
    """``(q, kv, indices, positions) -> out [1, S, H, 512]`` of one implementation."""
    kw = {"sm_scale": DK**-0.5, "kv_lora_rank": DV, "read_block": 1}
    if impl == "xla":
        return functools.partial(xla_sparse_mla, **kw)
    if impl == "reference":
        return functools.partial(__import__("attn_reference").sparse_mla_attention, **kw)
    interpret = jax.default_backend() != "gpu"  # --smoke off a GPU: the kernel interpreted
    kernel = __import__("attn_mosaic_gpu").sparse_mla_attention
    deterministic = impl == "mosaic-gpu-deterministic"
    return functools.partial(kernel, interpret=interpret, deterministic=deterministic, **kw)


def timed_calls(fn):
    """Jitted forward, backward-alone and forward + backward calls of ``fn``."""

    def fwd(q, kv, idx, pos):
        return fn(q, kv, idx, pos).astype(jnp.float32)

    @jax.jit
    def saved(q, kv, idx, pos):
        return jax.vjp(lambda q, kv: fwd(q, kv, idx, pos), q, kv)[1]

    @jax.jit
    def bwd(vjp, g):
        return vjp(g)

    @jax.jit
    def step(q, kv, idx, pos, g):
        out, vjp = jax.vjp(lambda q, kv: fwd(q, kv, idx, pos), q, kv)
        return out, vjp(g)

    return jax.jit(fwd), saved, bwd, step


def run_case(impl: str, x: dict, iterations: int, want: tuple | None) -> dict:
    """One implementation at one shape: its three times, and its gradients' error
    against ``want`` (``xla``'s ``(dq, dkv)``) where given."""
    fwd, saved, bwd, step = timed_calls(attention(impl))
    args = (x["q"], x["kv"], x["indices"], x["positions"])
    row = {"impl": impl}
    row["fwd_ms"], method = device_ms(fwd, *args, iterations=iterations)
    vjp = saved(*args)
    row["bwd_ms"], _ = device_ms(bwd, vjp, x["g"], iterations=iterations)
    del vjp
    row["step_ms"], _ = device_ms(step, *args, x["g"], iterations=iterations)
    row["method"] = method
    if method == "cupti":  # where the step's device time goes, kernel by kernel
        row["step_kernels"] = kernel_breakdown(step, (*args, x["g"]))
    _, grads = step(*args, x["g"])
    if want is not None:
        row["dq_rel_l2"] = rel_l2(grads[0], want[0])
        row["dkv_rel_l2"] = rel_l2(grads[1], want[1])
    return row, grads


def run(args: argparse.Namespace) -> dict:
    """Every shape and implementation; the reports are rewritten after each row, so a run
    cut short by a time limit still leaves what it measured."""
    shapes = SMOKE if args.smoke else FULL
    cases, rows = [], []  # each measurement; its rows by mode
    result = {**provenance(), "device": str(jax.devices()[0].device_kind)}
    result.update(iterations=args.iterations, rows=rows)
    for kv_len in args.kv_lens or shapes["kv_lens"]:
        for heads in args.heads or shapes["heads"]:
            x = make_inputs(shapes["queries"], shapes["top_k"], kv_len, heads)
            flops = 2.0 * heads * shapes["top_k"] * (DK + DV) * shapes["queries"]
            want = None
            for impl in args.impls:
                case = {"kv_len": kv_len, "heads": heads, "queries": shapes["queries"]}
                try:
                    row, grads = run_case(impl, x, args.iterations, want)
                except Exception as e:  # one failure is reported, the rest still run
                    traceback.print_exc()
                    cases.append({**case, "impl": impl, "error": f"{type(e).__name__}: {e}"})
                    continue
                if impl == "xla":
                    want = grads
                row["step_tflops"] = BWD_FACTOR * flops / row["step_ms"] / 1e9
                row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
                if want is not None and impl != "xla":
                    xla = next(r for r in cases if r["impl"] == "xla" and r["kv_len"] == kv_len
                               and r["heads"] == heads)  # fmt: skip
                    row["step_vs_xla"] = xla["step_ms"] / row["step_ms"]
                cases.append({**case, "top_k": shapes["top_k"], **row})
                print(json.dumps(cases[-1]), flush=True)
                rows[:] = mode_rows(cases)
                write_reports({**result, "cases": cases}, args.out)
    return {**result, "cases": cases}


def merge(paths: list[Path]) -> dict:
    """One report from several runs of the same commit on the same kind of device (a run
    cut short by a device call's time limit, then the shapes it missed): a shape measured
    in a later file replaces every case of that shape from the earlier ones, so each
    shape's implementations, and its ``vs_xla``, come from one run. Each case names its
    run (``run``: an index into ``runs``, which hold each file's command and date)."""
    results = [json.loads(Path(f).read_text()) for f in paths]
    first = results[0]
    for r in results[1:]:
        for key in ("commit", "device", "iterations"):
            if r[key] != first[key]:
                raise ValueError(f"{key} differs: {first[key]!r} against {r[key]!r}")
    by_shape = {}
    for i, r in enumerate(results):
        shapes = {(c["kv_len"], c["heads"]) for c in r["cases"]}
        for shape in shapes:
            by_shape[shape] = [{**c, "run": i} for c in r["cases"]
                               if (c["kv_len"], c["heads"]) == shape]  # fmt: skip
    cases = [c for shape in sorted(by_shape) for c in by_shape[shape]]
    runs = [{"command": r["command"], "date": r["date"]} for r in results]
    merged = {key: first[key] for key in ("commit", "device", "iterations")}
    return {**merged, "runs": runs, "rows": mode_rows(cases), "cases": cases}


def mode_rows(cases: list[dict]) -> list[dict]:
    """Issue 40's rows: one per implementation, shape and mode, from the cases."""
    out = []
    for c in cases:
        if "error" in c:
            continue
        flops = 2.0 * c["heads"] * c["top_k"] * (DK + DV) * c["queries"]
        xla = next((x for x in cases if x["impl"] == "xla" and "error" not in x
                    and (x["kv_len"], x["heads"]) == (c["kv_len"], c["heads"])), None)  # fmt: skip
        for mode, key, factor in MODES:
            row = {
                "impl": ROW_NAMES.get(c["impl"], c["impl"]), "heads": c["heads"],
                "tokens": c["kv_len"], "queries": c["queries"], "top_k": c["top_k"],
                "mode": mode, "ms": c[key], "tflops": factor * flops / c[key] / 1e9,
            }  # fmt: skip
            if xla is not None:
                row["vs_xla"] = xla[key] / c[key]
            out.append(row)
    return out


def write_reports(result: dict, out: Path) -> None:
    write_json(result, out, "sparse_mla_train")
    lines = [
        "# Sparse-MLA training step",
        "",
        f"Commit `{result['commit']}`, {_runs_text(result)}, {result['device']}. "
        f"Device time, median of {result['iterations']} calls. "
        "Flat, token-level top-K, Dk 576 / Dv 512, bf16. TFLOP/s: forward "
        "`2 H K (Dk + Dv)` per query; forward + backward 3.53 times that.",
        "",
        "| T | heads | impl | fwd ms | bwd ms | fwd+bwd ms | fwd+bwd TFLOP/s "
        "| vs xla | dq rel L2 | dkv rel L2 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        head = f"| {r['kv_len']} | {r['heads']} | {r['impl']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:120]} | | | | | | |")
            continue
        err = [f"{r[k]:.1e}" if k in r else "" for k in ("dq_rel_l2", "dkv_rel_l2")]
        lines.append(
            f"{head} {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['step_ms']:.2f} | "
            f"{r['step_tflops']:.1f} | {r.get('step_vs_xla', 1.0):.2f}x | {err[0]} | {err[1]} |"
        )
    lines += _kernel_lines(result["cases"])
    (out / "sparse_mla_train.md").write_text("\n".join(lines) + "\n")
    write_plot(result, out / "sparse_mla_train.svg")


def _runs_text(result: dict) -> str:
    """The command and date of a report, or of each run merged into it."""
    if "runs" not in result:
        return f"`{result['command']}`, {result['date']}"
    return (
        "runs "
        + "; ".join(f"{i}: `{r['command']}`, {r['date']}" for i, r in enumerate(result["runs"]))
        + " (each case's `run` in the JSON; a shape's cases all come from one run)"
    )


def _kernel_lines(rows: list[dict]) -> list[str]:
    """The forward + backward's device time by kernel (``step_kernels``), per row."""
    have = [r for r in rows if r.get("step_kernels")]
    if not have:
        return []
    lines = [
        "",
        "## Where the forward + backward's device time goes",
        "",
        "One call's CUPTI records by kernel name (the fastest of 3 calls; a `lax.scan` "
        "body's launches summed), longest first.",
        "",
        "| T | heads | impl | kernel | ms | share | launches |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in have:
        total = sum(ms for _, ms, _ in r["step_kernels"])
        for name, ms, count in r["step_kernels"]:
            lines.append(
                f"| {r['kv_len']} | {r['heads']} | {r['impl']} | `{name[:60]}` | {ms:.2f} | "
                f"{100 * ms / total:.1f} % | {count} |"
            )
    return lines


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["cases"] if "error" not in r]
    shapes = sorted({(r["kv_len"], r["heads"]) for r in ok})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(IMPLS)
    for i, impl in enumerate(IMPLS):
        ms = [next((r["step_ms"] for r in ok if (r["kv_len"], r["heads"]) == s
                    and r["impl"] == impl), np.nan) for s in shapes]  # fmt: skip
        ax.bar(np.arange(len(shapes)) + i * width, ms, width, label=impl)
    ax.set_xticks(np.arange(len(shapes)) + width, [f"T {t}\nH {h}" for t, h in shapes])
    ax.set_ylabel("forward + backward, ms (lower is better)")
    ax.set_title(f"Sparse-MLA training step, {result['device']}, {result['commit']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("attn-results"))
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any device, seconds")
    p.add_argument("--kv-lens", type=int, nargs="*", help="cache lengths T (default: issue 40's)")
    p.add_argument("--heads", type=int, nargs="*", help="head counts (default 64 128)")
    p.add_argument("--impls", nargs="*", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="measure nothing: write one report from these runs' JSON files "
                   "(same commit and device; a later file's shapes replace earlier ones)")  # fmt: skip
    args = p.parse_args(argv)
    if args.merge:
        write_reports(merge(args.merge), args.out)
        print(f"wrote {args.out}/sparse_mla_train.{{json,md,svg}}")
        return 0
    # The Mosaic GPU interpreter (--smoke off a GPU) needs that many XLA CPU threads.
    os.environ["NPROC"] = str(max(int(os.environ.get("NPROC") or 0), MIN_XLA_CPU_THREADS))
    if "xla" in args.impls:  # the baseline runs first: the others' gradients are checked on it
        args.impls = ["xla", *[i for i in args.impls if i != "xla"]]
    result = run(args)
    print(f"wrote {args.out}/sparse_mla_train.{{json,md,svg}}")
    return 1 if any("error" in r for r in result["cases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
