"""The ``attn`` subcommands this backend adds: ``attn bench [ranker|sparse-mla]`` and
``attn tune``.

``attn_common.cli`` finds them through the backend's ``attn.backends`` entry point
(``attn_mosaic_gpu.cli_commands()``): attn-common never imports a backend by name. Each
``COMMANDS`` value adds its subparser to the ``attn`` parser and sets ``func`` (runs the
command, returns the exit status), ``error_prog`` (the prefix of its errors) and, where
argparse cannot express a check, ``check`` (the one-line error, or None; the command
then exits 2).
"""

from __future__ import annotations

import argparse
import sys
import textwrap

import jax

from attn_common import tuned_table
from attn_common.cli_args import (
    bounded_float,
    iterations_int,
    out_path,
    positive_int,
    progress,
    provenance,
)
from attn_common.dispatch import device_class
from attn_common.suite import RANKER_SUITE, ranker_case
from attn_mosaic_gpu import bench as _bench
from attn_mosaic_gpu import bench_sparse_mla as _bench_sparse_mla

# --------------------------------------------------------------------------- attn bench


def cmd_bench(args: argparse.Namespace) -> int:
    """``attn bench [ranker|sparse-mla]``: run the suite; 1 when a row failed."""
    suite = _bench_sparse_mla if args.suite == "sparse-mla" else _bench
    return 1 if suite.run(args)["failed"] else 0


def _bench_suite_first(args: argparse.Namespace) -> str | None:
    """``attn bench --iterations 5 sparse-mla`` would lose ``--iterations 5`` to the
    suite's defaults: the suite's flags go after its name. The error, or None."""
    if not getattr(args, "suite_named", False):
        return None
    argv = list(getattr(args, "argv", None) or [])
    if "bench" not in argv:
        return None
    before = argv[argv.index("bench") + 1 :]
    before = before[: before.index(args.suite)] if args.suite in before else []
    if before:
        return (
            f"got {' '.join(before)} before the suite name {args.suite!r}; put the flags "
            f"after it: attn bench {args.suite} {' '.join(before)} ..."
        )
    return None


def check_bench(args: argparse.Namespace) -> str | None:
    problem = _bench_suite_first(args)
    if problem:
        return problem
    if args.suite == "sparse-mla":
        args.error_prog = "attn bench sparse-mla"
        return _bench_sparse_mla.check_args(args)
    return _bench.check_args(args)


def add_bench(sub) -> None:
    ranker_description = (
        "The ranker benchmark suite: our kernel against cuDNN and XLA with the dense mask "
        "(and FA3 dense on Hopper), in the same run on the same inputs; see "
        "docs/design.md, 'Benchmarks'. Exit status 1 when any row fails."
    )
    sparse_description = (
        "The sparse MLA prefill benchmark: our kernel (the Hopper one on a Hopper GPU) "
        "against XLA gather + einsum, flat and ragged paged, H 128/64, cache 8K/32K/128K, "
        "on the same inputs; TFLOP/s, bytes against the copy ceiling, targets; see "
        "docs/sparse_mla_gpu.md. Off a GPU: a smoke run with tiny shapes (not a "
        "measurement) unless --full. Exit status 1 when any row fails."
    )
    b = sub.add_parser(
        "bench",
        usage="%(prog)s [ranker] [-h] [flags below]\n"
        "       %(prog)s sparse-mla [-h] [flags: attn bench sparse-mla --help]",
        help="benchmark suites against cuDNN/XLA (meant for a GPU): ranker (the default) "
        "or sparse-mla",
        description=textwrap.fill(
            ranker_description.replace(
                "The ranker benchmark suite",
                "Benchmark suites. Without a suite name: the ranker suite (= attn bench "
                "ranker); `attn bench sparse-mla --help` for the sparse MLA prefill "
                "benchmark. The ranker suite",
            ),
            88,
        ),
        epilog=_bench.suite_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _bench.add_arguments(b)
    suites = b.add_subparsers(
        dest="suite",
        metavar="{ranker,sparse-mla}",
        prog="attn bench",
        title="suites (optional; the flags of a named suite go after its name)",
    )
    ranker = suites.add_parser(
        "ranker",
        help="the ranker suite (the default; same flags as above)",
        description=ranker_description,
        epilog=_bench.suite_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _bench.add_arguments(ranker)
    ranker.set_defaults(suite_named=True)
    sparse = suites.add_parser(
        "sparse-mla",
        help="sparse MLA prefill, ours vs XLA gather + einsum (`attn bench sparse-mla --help`)",
        description=textwrap.fill(sparse_description, 88),
        epilog=_bench_sparse_mla.epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _bench_sparse_mla.add_arguments(sparse)
    sparse.set_defaults(suite_named=True)
    b.set_defaults(
        func=cmd_bench,
        check=check_bench,
        error_prog="attn bench",
        suite="ranker",
        suite_named=False,
    )


# --------------------------------------------------------------------------- attn tune


def cmd_tune(args: argparse.Namespace) -> int:
    """Sweep the Hopper ranker kernels' knobs on this GPU and write the user's table."""
    from attn_mosaic_gpu import tuner, tuning

    found = device_class()
    if found != "hopper" and not args.allow_any_device:
        print(
            f"attn tune: error: needs a Hopper GPU (the default device is {found}); the "
            "table it writes is per GPU kind",
            file=sys.stderr,
        )
        return 2
    out = args.out if args.out is not None else tuning.user_table_path()
    cases = [ranker_case(name) for name in args.cases]
    if args.batch is not None:
        cases = [case.scaled(args.batch) for case in cases]
    print(f"attn tune: {len(cases)} case(s) on {jax.devices()[0].device_kind}; writing {out}")
    prov = provenance(args.argv)
    entries: list = []
    merged: dict = {"entries": []}
    for case in cases:  # the table is written after every case: a cut-off sweep keeps them
        table = tuner.tune(
            [case], iterations=args.iterations, min_gain=args.min_gain, progress=progress
        )
        table["provenance"] = prov
        entries += table["entries"]
        merged = tuned_table.write_merged(out, table)
    print(f"{'case':<10} {'forward config':<58} {'fwd ms':>8}  backward knobs (bwd ms)")
    for e in entries:
        fwd = ", ".join(f"{k}={v}" for k, v in e["forward"].items())
        bwd = ", ".join(f"{k}={v}" for k, v in e["backward"].items()) or "-"
        fms = f"{e['forward_ms']:.3f}" if e["forward_ms"] is not None else "-"
        bms = f"{e['backward_ms']:.3f}" if e["backward_ms"] is not None else "-"
        print(f"{e['case']:<10} {fwd:<58} {fms:>8}  {bwd} ({bms})")
    print(
        f"wrote {out} ({len(merged['entries'])} entries); ranker_attention(config=None) reads it first"
    )
    return 0


def add_tune(sub) -> None:
    t = sub.add_parser(
        "tune",
        help="sweep the Hopper ranker kernels' configs on this GPU; write the user's table",
        description="Time the Hopper ranker kernels over their tiling and schedule knobs "
        "(forward: block_kv, ring depth, exp2 / soft_sign reciprocal split between the MUFU "
        "and the FMA pipe; backward: the same split and ring depth) at the suite's shapes "
        "and write the best per (GPU kind, dtype, head dim, cap, sequence bucket) to the "
        "user's table, which ranker_attention(config=None) reads before the package's.",
    )
    names = [c.name for c in RANKER_SUITE]
    t.add_argument(
        "--cases",
        nargs="+",
        choices=names,
        default=["phoenix", "long", "small-d64"],
        help="suite shapes to tune (default: phoenix long small-d64; ragged has phoenix's key)",
    )
    t.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="override the cases' batch rows, 1..1000000",
    )
    t.add_argument(
        "--iterations",
        type=iterations_int,
        default=10,
        help="timed calls per trial, 1..10000 (CUPTI median; default: 10)",
    )
    t.add_argument(
        "--min-gain",
        type=bounded_float(0.0, 0.5, "a fraction"),
        default=0.01,
        help="keep a knob value only if it is this much faster, 0 <= value < 0.5 "
        "(default: 0.01 = 1%%)",
    )
    t.add_argument(
        "--out",
        type=out_path,
        default=None,
        help="table to write (default: $ATTN_TUNED_CONFIGS, else "
        "$XDG_CONFIG_HOME/attn/hopper_ranker_tuned.json); existing entries with other "
        "keys are kept",
    )
    t.add_argument("--allow-any-device", action="store_true", help=argparse.SUPPRESS)
    t.set_defaults(func=cmd_tune, error_prog="attn tune")


COMMANDS = {"bench": add_bench, "tune": add_tune}
