"""The query-blocked Hopper sparse-MLA kernel against the per-query one, same picks, same run.

``attn_mosaic_gpu.sparse_mla_attention`` runs one of two kernels per call: the per-query
kernel (each program one query's 64-head group, its own rows) and, at ``H <= 32``, the
query-blocked one (``64 / H`` queries share a program; their union of rows is gathered
once, membership masks restore each query's selection). Here the same inputs run
through each kernel forced (``attn_mosaic_gpu.sparse_mla.scheduled``) and through the
op's own choice (``auto``). Cases (``Dk = 576``, ``Dv = 512``, ``sm_scale = 1 /
sqrt(192)``; picks by ``attn_common.picks``, the generator the TPU benchmark uses):

* ``prefill-overlap-h{H}``: flat, 4096 queries at the end of a 32K-token cache, each
  selecting 2048 tokens as 32 units of 64 (``overlapping_picks`` defaults: 2 sinks, a
  window of 4, 26 from a 32-unit hot set shared per 64 queries drifting by an eighth),
  passed token by token (``read_block = 1``, DeepSeek V3.2's indexer output);
* ``prefill-random-h{H}``: the same with 2048 distinct random tokens per query;
* ``decode-x{T}-h{H}``: ragged paged, 128 requests of about 32K tokens, ``T`` query
  tokens each (multi-token prediction) sharing 90 % of their 32 picked pages
  (``decode_picks``), 64-token pages;

for H in {16, 32, 64, 128} (prefill; the blocked kernel exists at ``H <= 32`` only, so
the larger H rows are the per-query kernel under both names) and {16, 128} (decode, T
in {2, 4}); FP8 rows (``Fp8LatentCache``, dequantized on chip: ``fp8_dequantize=False``)
for prefill-overlap at H 16 / 32 and decode at H 16 / 128.

Per row: CUPTI device time (median of ``--iterations`` after a warm-up; the row table,
the union tables and the choice included); TFLOP/s counting ``2 H (576 + 512)`` per
valid (query, key token); the rows gathered (per-query: each query's valid rows once per
64-head group; query-blocked: each block's union once) at 1,152 bytes (656 FP8) over the
time against the copy ceiling; the matrix work issued (64-row programs x gathered rows x
``2 (576 + 512)``, padded heads and masked keys included) against the measured bf16
rate. Each case's ``qblock`` and ``auto`` rows add the speed-up over ``per-query``.

    python benchmarks/sparse_mla_qblock_gpu.py --out docs/results      # on the H200
    python benchmarks/sparse_mla_qblock_gpu.py --smoke --out /tmp/s    # CPU, interpret mode

``--merge a.json b.json --out DIR`` writes one report from runs of the same commit on
the same kind of device (a device call's time limit splits the cases over calls): each
case's rows come from one run (a later file's case replaces an earlier one's), and name
it (``run``, an index into the report's ``runs``).

Writes ``sparse_mla_qblock_gpu.{json,md,svg}`` into ``--out`` (top-level ``commit``;
rows carry ``kernel`` ("qblock" / "per-query" / "auto"), ``mode``, ``picks``,
``heads``, ``cache``, ``ms``, ``tflops``, ``gather_tbps``). Exit status 1 when a row
failed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import quantize_latent_cache
from attn_common.picks import decode_picks, distinct_choices, overlapping_picks
from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.bench_sparse_mla import (
    DK,
    DV,
    ROW_BYTES,
    SM_SCALE,
    jit_call,
    paged_layout,
    rel_l2,
    script_report,
    script_run,
    speedup_svg,
)
from attn_mosaic_gpu.sparse_mla import scheduled
from attn_mosaic_gpu.sparse_mla_kernel import query_block_for

ROOT = Path(__file__).resolve().parents[1]
RESULT = "sparse_mla_qblock_gpu"
PROGRAM_ROWS = 64  # rows of one program's matrices (heads, or a block's queries x heads)
KERNELS = ("per-query", "qblock", "auto")
# Issue 56's targets: the blocked kernel over the per-query one.
TARGETS = {
    ("prefill", "overlap", 16): 2.5,
    ("prefill", "overlap", 32): 2.0,
    ("prefill", "overlap", 64): 1.3,
    ("prefill", "overlap", 128): 1.0,
    ("decode", "decode", 16): 1.6,
    ("decode", "decode", 128): 1.1,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mode: str  # "prefill" | "decode"
    picks: str  # "overlap" | "random" | "decode" (tokens sharing 90 %)
    heads: int
    cache: str = "bf16"  # "bf16" | "fp8"
    kv_len: int = 32768
    num_queries: int = 4096
    requests: int = 1
    tokens: int = 1  # decode: query tokens per request
    unit: int = 64
    top_k_units: int = 32


def cases(smoke: bool) -> list[Case]:
    if smoke:  # tiny shapes for a CPU run end to end (interpret mode)
        return [
            Case("prefill-overlap-h16", "prefill", "overlap", 16, kv_len=600, num_queries=8,
                 unit=16, top_k_units=6),
            Case("decode-x2-h16", "decode", "decode", 16, kv_len=300, num_queries=8, requests=4,
                 tokens=2, unit=16, top_k_units=4),
        ]  # fmt: skip
    out = []
    for picks in ("overlap", "random"):
        out += [Case(f"prefill-{picks}-h{h}", "prefill", picks, h) for h in (16, 32, 64, 128)]
    out += [
        Case(f"prefill-overlap-h{h}-fp8", "prefill", "overlap", h, cache="fp8") for h in (16, 32)
    ]
    for t in (2, 4):
        for h in (16, 128):
            out.append(
                Case(f"decode-x{t}-h{h}", "decode", "decode", h, num_queries=128 * t,
                     requests=128, tokens=t)
            )  # fmt: skip
    out += [
        Case(f"decode-x2-h{h}-fp8", "decode", "decode", h, cache="fp8", num_queries=256,
             requests=128, tokens=2)
        for h in (16, 128)
    ]  # fmt: skip
    return out


def _union_rows(keys: list[np.ndarray], block: int) -> int:
    """Sum over blocks of ``block`` consecutive queries of their distinct keys."""
    total = 0
    for i in range(0, len(keys), block):
        total += len(np.unique(np.concatenate(keys[i : i + block])))
    return total


def make_inputs(case: Case, seed: int = 0):
    """``(args, kwargs, per-query key ids)``: the op's arrays and keywords, and each
    query's attended keys (flat: token ids; ragged: request * 2**20 + token) to count
    the gathered rows."""
    rng = np.random.default_rng(seed)
    k_q, k_kv = jax.random.split(jax.random.PRNGKey(seed))
    s, h, t = case.num_queries, case.heads, case.kv_len
    q = jax.random.normal(k_q, (1, s, h, DK), jnp.bfloat16)
    kw = {"sm_scale": SM_SCALE}
    if case.mode == "prefill":
        pos = np.arange(t - s, t, dtype=np.int32)
        if case.picks == "overlap":
            units = overlapping_picks(rng, pos, unit=case.unit, k=case.top_k_units)
            tok = units[:, :, None] * case.unit + np.arange(case.unit)
            idx = np.where(units[:, :, None] >= 0, tok, -1).reshape(s, -1).astype(np.int32)
        else:
            idx = distinct_choices(rng, pos + 1, case.top_k_units * case.unit)
        keys = [np.unique(r[(r >= 0) & (r <= p)]) for r, p in zip(idx, pos, strict=True)]
        kv = jax.random.normal(k_kv, (1, t, DK), jnp.bfloat16)
        if case.cache == "fp8":
            kv = quantize_latent_cache(kv)
        rest = (jnp.asarray(idx)[None], jnp.asarray(pos)[None])
        return (q, kv, *rest), {**kw, "read_block": 1}, keys
    ps, n = case.unit, case.requests
    lens = [t - 3 * r for r in range(n)]
    layout = paged_layout(rng, lens, [case.tokens] * n, page_size=ps)
    pos = layout["positions"]
    idx = decode_picks(rng, pos, unit=ps, k=case.top_k_units, tokens=case.tokens)
    keys = []
    for i in range(s):
        pages = np.unique(idx[i][idx[i] >= 0])
        tok = (pages[:, None] * ps + np.arange(ps)).ravel()
        keys.append(int(layout["q_seq_id"][i]) * 2**20 + tok[tok <= pos[i]])
    rows = jax.random.normal(k_kv, (layout["num_pages"], ps, DK), jnp.bfloat16)
    if case.cache == "fp8":
        kv = quantize_latent_cache(rows)
    else:
        kv = jnp.pad(rows, ((0, 0), (0, 0), (0, 640 - DK))).reshape(-1, ps // 2, 2, 640)
    del rows
    tables = {
        k: jnp.asarray(layout[k]) for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")
    }
    rest = (jnp.asarray(idx)[None], jnp.asarray(pos)[None])
    return (q, kv, *rest), {**kw, "read_block": ps, "page_size": ps, **tables}, keys


def run_case(case: Case, *, iterations: int, ceil: dict, interpret: bool) -> list[dict]:
    """The three kernels' rows of one case; a failure is recorded in the row."""
    t0 = time.perf_counter()
    args, kw, keys = make_inputs(case)
    if interpret:
        kw = {**kw, "interpret": True}
    if case.cache == "fp8":
        kw = {**kw, "fp8_dequantize": False}
    pairs = sum(len(k) for k in keys)
    qb = query_block_for(case.heads)
    groups = -(-case.heads // PROGRAM_ROWS)
    gathered = {"per-query": groups * pairs, "qblock": _union_rows(keys, qb) if qb > 1 else None}
    gathered["qblock"] = gathered["qblock"] or gathered["per-query"]
    flops = 2.0 * case.heads * (DK + DV) * pairs
    print(f"{case.name}: {pairs / case.num_queries:.0f} keys/query, query block {qb}, union "
          f"rows {gathered['qblock'] / max(gathered['per-query'], 1):.3f} of the per-query "
          f"({time.perf_counter() - t0:.1f} s inputs)")  # fmt: skip
    rows, outs = [], {}
    # At H > 32 there is no query block: "qblock" would be the per-query kernel again.
    for kernel in KERNELS if qb > 1 else ("per-query", "auto"):
        rows_read = gathered["qblock" if kernel == "qblock" else "per-query"]
        row = {
            "case": case.name, "run": 0, "kernel": kernel, "mode": case.mode, "picks": case.picks,
            "heads": case.heads, "cache": case.cache, "query_block": qb,
            "num_queries": case.num_queries, "requests": case.requests, "tokens": case.tokens,
            "kv_len": case.kv_len, "valid_pairs": pairs, "flops": flops,
            "gathered_rows": rows_read, "ms": None, "tflops": None, "gather_tbps": None,
        }  # fmt: skip
        try:
            jitted, call_args = jit_call(scheduled(kernel), args, kw)
            outs[kernel] = jitted(*call_args)
            ms, method = device_ms(jitted, *call_args, iterations=iterations)
            rate = rows_read * ROW_BYTES[case.cache] / ms / 1e9
            issued = 2.0 * PROGRAM_ROWS * (DK + DV) * rows_read
            row.update(
                ms=ms, timing=method, tflops=flops / ms / 1e9, gather_tbps=rate,
                gather_vs_copy=rate / ceil["copy_tbps"] if ceil else None,
                issued_tflops=issued / ms / 1e9,
                issued_vs_matmul=issued / ms / 1e9 / ceil["matmul_bf16_tflops"] if ceil else None,
                useful_share=flops / issued,
            )  # fmt: skip
            print(f"  {kernel:>9}: {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s, gather "
                  f"{rate:5.2f} TB/s ({method})")  # fmt: skip
        except Exception as e:  # recorded, never raised: the other rows still run
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc()
        rows.append(row)
    base = rows[0]
    for row in rows[1:]:
        if base["ms"] and row["ms"]:
            row["speedup_vs_per_query"] = base["ms"] / row["ms"]
            row["out_rel_l2_vs_per_query"] = rel_l2(outs[row["kernel"]], outs["per-query"])
        if row["kernel"] == "qblock":
            row["target_speedup"] = TARGETS.get((case.mode, case.picks, case.heads))
    return rows


def merge(paths: list[Path]) -> dict:
    """One report from several runs (module docstring)."""
    results = [json.loads(Path(f).read_text()) for f in paths]
    first = results[0]
    for r in results[1:]:
        for key in ("commit", "device", "iterations", "ceilings"):
            if key != "ceilings" and r[key] != first[key]:
                raise ValueError(f"{key} differs: {first[key]!r} against {r[key]!r}")
    by_case: dict[str, list] = {}
    for i, r in enumerate(results):
        for name in dict.fromkeys(row["case"] for row in r["rows"]):
            by_case[name] = [{**row, "run": i} for row in r["rows"] if row["case"] == name]
    rows = [row for case in by_case.values() for row in case]
    runs = [{**r["provenance"], "ceilings": r["ceilings"]} for r in results]
    return {
        **{k: first[k] for k in ("commit", "device", "iterations", "smoke")},
        "provenance": {**first["provenance"], "command": "; ".join(
            f"run {i}: {r['command']}" for i, r in enumerate(runs))},
        "ceilings": first["ceilings"],
        "runs": runs,
        "rows": rows,
        "failed": sum("error" in row for row in rows),
    }  # fmt: skip


def write_reports(result: dict, out: Path) -> list[Path]:
    paths, opening = script_report(result, out, RESULT)
    ceil = result["ceilings"]
    lines = [
        "# Sparse MLA on Hopper: the query-blocked kernel against the per-query one",
        "",
        f"{opening}, row and union tables included. "
        "Same inputs for the three kernels: `per-query` (today's kernel), `qblock` (the "
        "query-blocked kernel forced; at H > 32 there is none and this is the per-query "
        "kernel) and `auto` (the op's own choice). Union: rows gathered by the blocked "
        "kernel over the per-query kernel's. Gather: rows gathered x 1,152 bytes (656 "
        f"FP8) over the time; copy ceiling {ceil.get('copy_tbps', float('nan')):.2f} TB/s. "
        "Issued: 64-row programs' matrix work (padded heads and masked keys included) "
        f"against the bf16 matmul rate {ceil.get('matmul_bf16_tflops', float('nan')):.0f} "
        "TFLOP/s (same run). Target: issue 56's blocked over per-query.",
        "",
        "| case | cache | H | block | union | per-query ms | qblock ms | speed-up | target "
        "| auto ms | auto speed-up | TFLOP/s (best) | gather TB/s per-query / qblock (of copy) "
        "| issued TFLOP/s qblock (of matmul, useful share) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.0f} %"

    by_case: dict[str, dict] = {}
    for row in result["rows"]:
        by_case.setdefault(row["case"], {})[row["kernel"]] = row
    for name, rows in by_case.items():
        p, b, a = rows.get("per-query", {}), rows.get("qblock", {}), rows.get("auto", {})
        speed, target = b.get("speedup_vs_per_query"), b.get("target_speedup")
        met = (
            ""
            if speed is None or target is None or result.get("smoke")
            else (" met" if speed >= target else " **not met**")
        )
        union = (b.get("gathered_rows") or 0) / max(p.get("gathered_rows") or 1, 1)
        best = max([r.get("tflops") or 0 for r in rows.values()])
        lines.append(
            f"| {name} | {p.get('cache')} | {p.get('heads')} | {p.get('query_block')} "
            f"| {union:.3f} | {f(p.get('ms'), '.3f')} | {f(b.get('ms'), '.3f')} "
            f"| {f(speed, '.2f')}x | {f(target, '.1f')}x{met} | {f(a.get('ms'), '.3f')} "
            f"| {f(a.get('speedup_vs_per_query'), '.2f')}x | {best:.0f} "
            f"| {f(p.get('gather_tbps'), '.2f')} ({pct(p.get('gather_vs_copy'))}) / "
            f"{f(b.get('gather_tbps'), '.2f')} ({pct(b.get('gather_vs_copy'))}) "
            f"| {f(b.get('issued_tflops'), '.0f')} ({pct(b.get('issued_vs_matmul'))}, "
            f"{pct(b.get('useful_share'))}) |"
        )
    errors = [f"- {r['case']} {r['kernel']}: {r['error']}" for r in result["rows"] if "error" in r]
    if errors:
        lines += ["", "Failed rows:", "", *errors]
    paths[1].write_text("\n".join(lines) + "\n")
    write_plot(by_case, paths[2])
    return paths


def write_plot(by_case: dict, path: Path) -> None:
    """Bars: the blocked and the automatic choice's speed-up over the per-query kernel."""
    names = list(by_case)
    series = [
        (color, [by_case[n].get(k, {}).get("speedup_vs_per_query") for n in names])
        for k, color in (("qblock", "#4c78a8"), ("auto", "#f58518"))
    ]
    targets = [by_case[n].get("qblock", {}).get("target_speedup") for n in names]
    title = (
        "Speed-up over the per-query Hopper kernel (blue: query-blocked, orange: automatic "
        "choice; tick: target)"
    )
    speedup_svg(path, title, names, series, targets)


def main(argv: list[str] | None = None) -> dict:
    args, selected, result = script_run(
        argv, __doc__, cases, out=ROOT / "docs" / "results", merge=True
    )
    if args.merge:
        result = merge(args.merge)
        for path in write_reports(result, args.out):
            print(f"wrote {path}")
        return result
    for case in selected:  # the reports rewritten after each case: a killed run keeps them
        result["rows"] += run_case(
            case, iterations=args.iterations, ceil=result["ceilings"], interpret=args.smoke
        )
        result["failed"] = sum("error" in r for r in result["rows"])
        paths = write_reports(result, args.out)
    for path in paths:
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
