"""The Hopper sparse-MLA kernel against another revision's, on the benchmark's cases (one H200 run).

Times the row-table kernel alone (``sparse_mla_rows_attention``; the row table, built
once per case, is the same for every variant) as it ships, and, with ``--baseline
FILE``, the kernel of another revision (a copy of its
``sparse_mla_kernel.py``, e.g. ``git show REV:packages/.../sparse_mla_kernel.py``), so a
schedule change is measured against the schedule it replaces in the same process. (The
kernel ships one schedule; the variants it had, other schedules, diagnostic probes,
register splits and launch orders, are at da2ec0c, which ``--baseline`` can load.)
CUPTI median per variant (``--rounds R``: the variants timed in turn R times, the
median of the rounds); every variant's output is compared with the first's::

    python benchmarks/sparse_mla_variants.py --out /tmp/r --cases 'flat-h128-*' \
        --baseline /tmp/old_sparse_mla_kernel.py

Writes ``sparse_mla_variants.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from fnmatch import fnmatch
from pathlib import Path

import jax
import numpy as np

from attn_common import check_sparse_mla_inputs
from attn_common.cli_args import provenance
from attn_common.sparse_mla_rows import selected_rows, sparse_mla_units
from attn_mosaic_gpu import sparse_mla_kernel
from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.bench_sparse_mla import CASES, make_inputs, rel_l2, write_json
from attn_mosaic_gpu.sparse_mla_kernel import SparseMlaKernelConfig

VARIANTS = {"64-row split": {}}  # the kernel as it ships (SparseMlaKernelConfig())
ROW_BLOCK = 128  # row-table width multiple: a pair of 64-row blocks


def load_module(path: Path):
    """Import a kernel module from a file (the ``--baseline``)."""
    spec = importlib.util.spec_from_file_location("baseline_sparse_mla_kernel", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def variant_attend(knobs: dict) -> tuple:
    """``(attend, config)`` of a ``VARIANTS`` entry."""
    return sparse_mla_kernel.sparse_mla_rows_attention, SparseMlaKernelConfig(**knobs)


def case_problem(case) -> tuple[dict, object, dict]:
    """``(inputs, problem, tables)`` of a benchmark case: ``make_inputs``' answer, its
    ``check_sparse_mla_inputs`` problem and the ragged tables among its kwargs."""
    inputs = make_inputs(case)
    (q, kv, idx, pos), kw = inputs["args"], inputs["kwargs"]
    problem = check_sparse_mla_inputs(q, kv, idx, pos, **kw)
    tables = {
        k: kw[k]
        for k in ("page_size", "q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")
        if k in kw
    }
    return inputs, problem, tables


def case_rows(case) -> tuple:
    """``(q [N, H, Dk], store, rows, counts, sm_scale, flops)`` of a benchmark case."""
    inputs, problem, tables = case_problem(case)
    q, kv, idx, pos = inputs["args"]
    units, store = sparse_mla_units(problem, kv, idx, pos, **tables)
    rows, counts = selected_rows(units, read_block=problem.read_block, block=ROW_BLOCK)
    flops = 2.0 * case.heads * (case.dk + case.dv) * float(inputs["rows_per_query"].sum())
    return q.reshape(-1, case.heads, case.dk), store, rows, counts, problem.sm_scale, flops


def run(cases, variants: dict, baseline, iterations: int, rounds: int = 1) -> list[dict]:
    """Each case's variants timed in turn, ``rounds`` times over (the same compiled
    kernels; a row's ``ms`` is the median of its rounds' medians, ``ms_rounds`` each)."""
    out_rows = []
    for case in cases:
        q, store, rows, counts, sm_scale, flops = case_rows(case)
        fns = {label: variant_attend(knobs) for label, knobs in variants.items()}
        if baseline is not None:
            fns["baseline"] = (baseline.sparse_mla_rows_attention, baseline.SparseMlaKernelConfig())
        first = None
        compiled = {}
        for label, (attend, config) in fns.items():
            fn = jax.jit(functools.partial(attend, sm_scale=sm_scale, dv=case.dv, config=config))
            try:
                fn(q, store, rows, counts)
                compiled[label] = fn
            except Exception as e:  # one broken variant must not hide the others
                compiled[label] = e
        times = {label: [] for label in fns}
        for _ in range(rounds - 1):  # the last round is timed below, with the checks
            for label, fn in compiled.items():
                if not isinstance(fn, Exception):
                    times[label].append(
                        device_ms(fn, q, store, rows, counts, iterations=iterations)[0]
                    )
        for label, (_, config) in fns.items():
            fn = compiled[label]
            row = {"case": case.name, "variant": label, "config": repr(config)}
            try:
                if isinstance(fn, Exception):
                    raise fn
                out, lse = fn(q, store, rows, counts)
                ms, method = device_ms(fn, q, store, rows, counts, iterations=iterations)
                times[label].append(ms)
                ms = float(np.median(times[label]))
                row.update(ms=ms, ms_rounds=times[label], tflops=flops / ms / 1e9, timing=method)
                if first is None:
                    first = (np.asarray(out), np.asarray(lse))
                else:
                    row["rel_l2_vs_first"] = rel_l2(out, first[0])
                    row["lse_max_abs_vs_first"] = float(
                        np.nanmax(np.abs(np.asarray(lse) - first[1]))
                    )
                print(
                    f"{case.name:16s} {label:28s} {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
                    f" rel L2 vs first {row.get('rel_l2_vs_first', 0.0):.2e}"
                    f" (rounds: {' '.join(f'{t:.3f}' for t in times[label])})",
                    flush=True,
                )
            except Exception as e:  # one broken variant must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                print(f"{case.name:16s} {label:28s} FAILED {row['error']}", flush=True)
            out_rows.append(row)
    return out_rows


def write_reports(data: dict, out: Path) -> None:
    write_json(data, out, "sparse_mla_variants")
    lines = [
        f"Commit {data.get('commit')} ({data['device']}); command: `{data['command']}`.",
        "",
        "Row-table kernel only, CUPTI median; TFLOP/s count 2 H (576 + 512) per valid (query, "
        "key) pair; rel L2 / LSE against the first variant of the case.",
        "",
        "| case | variant | ms | TFLOP/s | rel L2 vs first | config |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['variant']} | failed | | | {r['error']} |")
            continue
        rel = r.get("rel_l2_vs_first")
        rel = "" if rel is None else f"{rel:.1e}"
        lines.append(
            f"| {r['case']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {rel} | "
            f"`{r['config']}` |"
        )
    (out / "sparse_mla_variants.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--cases", nargs="*", default=["flat-h128-t8k", "flat-h128-t128k", "flat-h64-t128k"]
    )
    parser.add_argument("--variants", nargs="*", default=None, help="globs of variant names")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another revision's kernel file"
    )
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1, help="times over every variant")
    args = parser.parse_args()
    cases = [c for c in CASES if any(fnmatch(c.name, p) for p in args.cases)]
    variants = VARIANTS
    if args.variants:
        variants = {k: v for k, v in VARIANTS.items() if any(fnmatch(k, p) for p in args.variants)}
    baseline = load_module(args.baseline) if args.baseline else None
    rows = run(cases, variants, baseline, args.iterations, args.rounds)
    data = {
        **provenance(),
        "device": jax.devices()[0].device_kind,
        "command": "sparse_mla_variants.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    write_reports(data, args.out)


if __name__ == "__main__":
    main()
