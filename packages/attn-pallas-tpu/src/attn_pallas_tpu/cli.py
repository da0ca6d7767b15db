"""The ``attn`` subcommands this backend adds: ``attn tune``, the TPU ranker kernels'
tiling search (``attn_pallas_tpu.tune_ranker``); ``attn bench sparse-mla``, the TPU
sparse-MLA suite (``attn_pallas_tpu.bench_sparse_mla``, also ``python -m
attn_pallas_tpu.bench_sparse_mla``, with the same flags), and ``attn bench ranker``, the
TPU ranker suite (``attn_pallas_tpu.bench_ranker``, likewise).

``attn_common.cli`` finds it through the backend's ``attn.backends`` entry point
(``attn_pallas_tpu.cli_commands()``): attn-common never imports a backend by name. With
attn-mosaic-gpu installed too, ``attn bench`` is this backend's when the default device
is a TPU and the Hopper backend's elsewhere (``attn_common.cli.backend_commands``). Off a
TPU the suite's real cases refuse to start (one line; ``--smoke`` runs in interpret mode
anywhere). On a TPU the suite name is required (the Hopper backend's ``attn bench``
alone is its ranker suite).
"""

from __future__ import annotations

import argparse

from attn_pallas_tpu import bench_ranker as _bench_ranker
from attn_pallas_tpu import bench_sparse_mla as _bench_sparse_mla
from attn_pallas_tpu import tune_ranker as _tune_ranker

# --------------------------------------------------------------------------- attn bench

SPARSE_DESCRIPTION = (
    "The TPU sparse-MLA suite (attn_pallas_tpu.bench_sparse_mla): the per-query and "
    "query-blocked kernels at prefill (random and overlapping picks), decode, training "
    "and eager (host planning) cases, each against the XLA reference on the same inputs "
    "and against the chip's bytes and MXU bounds computed in the same run. Needs a TPU; "
    "--smoke runs tiny cases in interpret mode anywhere. Exit status 1 when a case fails."
)

RANKER_DESCRIPTION = (
    "The TPU ranker suite (attn_pallas_tpu.bench_ranker): attn_common.RANKER_SUITE at "
    "full batch, forward and forward+backward, wall and device time, allowed-pair TFLOP/s "
    "against the bf16 matmul rate measured in the same run and the cost model's "
    "prediction, the XLA reference where it fits, packed against padded ragged users; "
    "--sweep also times the (block_q, block_kv) grid that fits VMEM. Needs a TPU; --smoke "
    "runs tiny cases in interpret mode anywhere. Exit status 1 when a case fails."
)
SUITES = {"sparse-mla": _bench_sparse_mla, "ranker": _bench_ranker}
# suite -> (its one-line help in `attn bench --help`, its --help description)
HELP = {
    "sparse-mla": (
        "the TPU sparse-MLA suite against the XLA reference and the chip's bounds",
        SPARSE_DESCRIPTION,
    ),
    "ranker": (
        "the TPU ranker suite against the XLA reference and the measured matmul rate",
        RANKER_DESCRIPTION,
    ),
}


def _suite(args: argparse.Namespace):
    """The module of the named suite."""
    return SUITES[args.suite]


def cmd_bench(args: argparse.Namespace) -> int:
    """``attn bench sparse-mla`` / ``attn bench ranker``: run the TPU suite; 1 when a case
    failed."""
    return _suite(args).run(args)


def check_bench(args: argparse.Namespace) -> str | None:
    """The one-line error for ``attn bench`` without the suite this backend has, or the
    suite's own check."""
    if args.suite not in SUITES:
        return (
            "attn-pallas-tpu's `attn bench` needs a suite name: attn bench sparse-mla or "
            "attn bench ranker"
        )
    args.error_prog = f"attn bench {args.suite}"
    return _suite(args).check_args(args)


def add_bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        usage="%(prog)s {sparse-mla,ranker} [-h] [flags: attn bench SUITE --help]",
        help="the TPU benchmark suites: attn bench sparse-mla, attn bench ranker",
        description="Benchmark suites of the TPU backend: sparse-mla (`attn bench "
        "sparse-mla --help`) and ranker (`attn bench ranker --help`).",
    )
    suites = b.add_subparsers(dest="suite", metavar="{sparse-mla,ranker}", prog="attn bench")
    for name, module in SUITES.items():
        one_line, description = HELP[name]
        suite = suites.add_parser(
            name,
            help=one_line,
            description=description,
            epilog=f"Same flags as `python -m {module.__name__}`.",
        )
        module.add_arguments(suite)
    b.set_defaults(func=cmd_bench, check=check_bench, error_prog="attn bench", suite=None)


# --------------------------------------------------------------------------- attn tune


def cmd_tune(args: argparse.Namespace) -> int:
    """``attn tune`` on a TPU: the ranker kernels' tilings, timed; the user's table."""
    return _tune_ranker.run(args)


def add_tune(sub) -> None:
    t = sub.add_parser(
        "tune",
        help="time the TPU ranker kernels' tilings on this TPU; write the user's table",
        description=_tune_ranker.__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=f"Same flags as `python -m {_tune_ranker.__name__}`.",
    )
    _tune_ranker.add_arguments(t)
    t.set_defaults(func=cmd_tune, check=_tune_ranker.check_args, error_prog="attn tune")


COMMANDS = {"bench": add_bench, "tune": add_tune}
