"""``attn tune`` on a TPU: time the TPU ranker kernels over their tilings and write the
best per (TPU kind, dtype, head dim, cap, sequence bucket) to the user's table, which
``ranker_attention(config=None)`` reads first (``attn_pallas_tpu.ranker_tuning``). Also
``python -m attn_pallas_tpu.tune_ranker`` with the same flags.

The timing is the ranker suite's (``attn_pallas_tpu.bench_ranker`` with ``--sweep``):
each case's default tiling and every ``(block_q, block_kv)`` of ``BLOCK_CHOICES`` whose
VMEM model fits, in the chosen ``--objective`` mode (``fwd+bwd``, a training step, by
default; ``fwd`` for serving), by device time (profiler spans; wall clock where there
are none), the median of ``--iterations`` calls. A case's entry takes the fastest tiling
only if it beats the default by more than ``--min-gain`` (1 %), so noise cannot move it
off the default. The suite's report (``tpu_ranker.{json,md}``, sweep rows included) is
written under ``--results``; the table's ``trials`` keep every timed tiling and its
``provenance`` the commit and command. The table's key takes the suite case's dtype
(bf16), head dim, cap and ``seq_bucket(S)``: the default cases are phoenix, long and
small-d64 (ragged has phoenix's key). ``--smoke`` runs tiny cases in interpret mode on any
machine (the times mean nothing there; it checks the tool).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax.numpy as jnp

from attn_common import tuned_table
from attn_common.cli_args import (
    OneLineParser,
    bounded_float,
    iterations_int,
    out_path,
    provenance,
)
from attn_common.suite import RANKER_SUITE
from attn_pallas_tpu import _suite, bench_ranker, ranker_tuning

DEFAULT_CASES = ("phoenix", "long", "small-d64")
OBJECTIVES = ("fwd+bwd", "fwd")


def _ms(row: dict) -> float | None:
    return row.get("device_ms") or row.get("ms")


def table_from_result(result: dict, *, objective: str, min_gain: float) -> dict:
    """The tuned table of a ranker-suite result with sweep rows: per case (padded
    layout) the fastest ``objective`` tiling, or its default unless that is more than
    ``min_gain`` slower; ``trials`` every timed tiling."""
    rows = [r for r in result["rows"] if r.get("mode") == objective and "error" not in r]
    entries, trials = [], []
    for default in (r for r in rows if not r.get("sweep") and r.get("layout") == "padded"):
        case = default["case"]
        swept = [r for r in rows if r.get("sweep") and r["case"] == case and _ms(r)]
        trials += [
            {"case": case, "mode": objective, "block_q": r["block_q"],
             "block_kv": r["block_kv"], "ms": _ms(r)}
            for r in swept
        ]  # fmt: skip
        best = min(swept, key=_ms, default=default)
        if not _ms(best) < _ms(default) * (1.0 - min_gain):
            best = default
        entries.append({
            "device_kind": result["device"],
            "dtype": jnp.dtype(jnp.bfloat16).name,
            "head_dim": default["head_dim"],
            "cap": default["cap"],
            "seq_bucket": tuned_table.seq_bucket(default["seq_len"]),
            "case": case,
            "objective": objective,
            "block_q": best["block_q"],
            "block_kv": best["block_kv"],
            "ms": _ms(best),
            "default_block_q": default["block_q"],
            "default_block_kv": default["block_kv"],
            "default_ms": _ms(default),
        })  # fmt: skip
    return {"format": tuned_table.TABLE_FORMAT, "entries": entries, "trials": trials}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = [c.name for c in RANKER_SUITE]
    parser.add_argument(
        "--cases", nargs="+", choices=names, default=list(DEFAULT_CASES),
        help="suite shapes to tune (default: phoenix long small-d64; ragged has phoenix's key)",
    )  # fmt: skip
    parser.add_argument(
        "--objective", choices=OBJECTIVES, default="fwd+bwd",
        help="what the tiling minimises: fwd+bwd (a training step, default) or fwd",
    )  # fmt: skip
    parser.add_argument(
        "--iterations", type=iterations_int, default=5,
        help="timed calls per tiling, 1..10000 (median; default: 5)",
    )  # fmt: skip
    parser.add_argument(
        "--min-gain", type=bounded_float(0.0, 0.5, "a fraction"), default=0.01,
        help="take a tiling over the default only if this much faster, 0 <= value < 0.5 "
        "(default: 0.01 = 1%%)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=out_path, default=None,
        help="table to write (default: $ATTN_TPU_TUNED_CONFIGS, else "
        "$XDG_CONFIG_HOME/attn/tpu_ranker_tuned.json); entries with other keys are kept",
    )  # fmt: skip
    parser.add_argument(
        "--results", type=out_path, default=Path(os.environ.get("OUT", ".")),
        help="folder for the sweep's report, tpu_ranker.{json,md} (default: $OUT, else .)",
    )  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true", help="tiny cases in interpret mode (any machine)"
    )


def check_args(args: argparse.Namespace) -> str | None:
    """The one-line error off a TPU (``--smoke`` runs anywhere), else ``None``."""
    return _suite.check_args(argparse.Namespace(report=None, merge_into=None, smoke=args.smoke))


def run(args: argparse.Namespace) -> int:
    """Run the sweep, write the table; 1 when a case failed."""
    bench_args = argparse.Namespace(
        out=args.results, iterations=args.iterations, cases=list(args.cases), sweep=True,
        smoke=args.smoke, report=None, merge_into=None, modes=[args.objective],
    )  # fmt: skip
    status = bench_ranker.run(bench_args)
    result = json.loads((Path(args.results) / f"{bench_ranker.RESULT}.json").read_text())
    table = table_from_result(result, objective=args.objective, min_gain=args.min_gain)
    table["provenance"] = {**provenance(), "device": result.get("device")}
    out = Path(args.out) if args.out is not None else ranker_tuning.user_table_path()
    merged = tuned_table.write_merged(out, table)
    print(f"{'case':<12} {'blocks':<10} {'ms':>9}   default (ms)")
    for e in table["entries"]:
        print(
            f"{e['case']:<12} {e['block_q']}x{e['block_kv']:<6} {e['ms']:>9.3f}   "
            f"{e['default_block_q']}x{e['default_block_kv']} ({e['default_ms']:.3f})"
        )
    print(
        f"wrote {out} ({len(merged['entries'])} entries); ranker_attention(config=None) "
        "reads it first"
    )
    return status


def main(argv=None) -> int:
    parser = OneLineParser(prog="python -m attn_pallas_tpu.tune_ranker", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    error = check_args(args)
    if error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
