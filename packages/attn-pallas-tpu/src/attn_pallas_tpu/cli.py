"""The ``attn`` subcommand this backend adds: ``attn bench sparse-mla``, the TPU
sparse-MLA suite (``attn_pallas_tpu.bench_sparse_mla``, also ``python -m
attn_pallas_tpu.bench_sparse_mla``, with the same flags).

``attn_common.cli`` finds it through the backend's ``attn.backends`` entry point
(``attn_pallas_tpu.cli_commands()``): attn-common never imports a backend by name. With
attn-mosaic-gpu installed too, ``attn bench`` is this backend's when the default device
is a TPU and the Hopper backend's elsewhere (``attn_common.cli.backend_commands``). Off a
TPU the suite's real cases refuse to start (one line; ``--smoke`` runs in interpret mode
anywhere). The ranker suite (``attn bench`` with no suite name) is the Hopper backend's.
"""

from __future__ import annotations

import argparse

from attn_pallas_tpu import bench_sparse_mla as _bench_sparse_mla

# --------------------------------------------------------------------------- attn bench

SPARSE_DESCRIPTION = (
    "The TPU sparse-MLA suite (attn_pallas_tpu.bench_sparse_mla): the per-query and "
    "query-blocked kernels at prefill (random and overlapping picks), decode, training "
    "and eager (host planning) cases, each against the XLA reference on the same inputs "
    "and against the chip's bytes and MXU bounds computed in the same run. Needs a TPU; "
    "--smoke runs tiny cases in interpret mode anywhere. Exit status 1 when a case fails."
)


def cmd_bench(args: argparse.Namespace) -> int:
    """``attn bench sparse-mla``: run the TPU suite; 1 when a case failed."""
    return _bench_sparse_mla.run(args)


def check_bench(args: argparse.Namespace) -> str | None:
    """The one-line error for ``attn bench`` without the suite this backend has, or the
    suite's own check."""
    if args.suite != "sparse-mla":
        return (
            "attn-pallas-tpu's `attn bench` has one suite: attn bench sparse-mla (the ranker "
            "suite comes with attn-mosaic-gpu, for a GPU)"
        )
    args.error_prog = "attn bench sparse-mla"
    return _bench_sparse_mla.check_args(args)


def add_bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        usage="%(prog)s sparse-mla [-h] [flags: attn bench sparse-mla --help]",
        help="the TPU sparse-MLA benchmark suite: attn bench sparse-mla",
        description="Benchmark suites of the TPU backend: sparse-mla (`attn bench "
        "sparse-mla --help`).",
    )
    suites = b.add_subparsers(dest="suite", metavar="{sparse-mla}", prog="attn bench")
    sparse = suites.add_parser(
        "sparse-mla",
        help="the TPU sparse-MLA suite against the XLA reference and the chip's bounds",
        description=SPARSE_DESCRIPTION,
        epilog="Same flags as `python -m attn_pallas_tpu.bench_sparse_mla`.",
    )
    _bench_sparse_mla.add_arguments(sparse)
    b.set_defaults(func=cmd_bench, check=check_bench, error_prog="attn bench", suite=None)


COMMANDS = {"bench": add_bench}
