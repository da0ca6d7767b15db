"""What the TPU benchmark suites (``bench_sparse_mla``, ``bench_ranker``) share: their
common flags, the refusal off a TPU, the base of their runners, and the loop that runs
the cases and writes the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
from jax.extend import backend as jax_backend

from attn_common.cli_args import iterations_int, out_path, provenance
from attn_common.dispatch import device_class


def add_common_arguments(parser: argparse.ArgumentParser, *, sweep_help: str) -> None:
    """``--out``, ``--iterations``, ``--cases``, ``--sweep``, ``--smoke``, ``--report``,
    ``--merge-into``."""
    parser.add_argument(
        "--out",
        type=out_path,
        default=Path(os.environ.get("OUT", ".")),
        help="folder for the results (default: $OUT, else the working directory)",
    )
    parser.add_argument(
        "--iterations",
        type=iterations_int,
        default=10,
        help="timed calls per row, 1..10000 (median; default: 10, 1 in a smoke run)",
    )
    parser.add_argument(
        "--cases",
        nargs="*",
        help="substrings of case names to run, in that order (default: all, the suite's order)",
    )
    parser.add_argument("--sweep", action="store_true", help=sweep_help)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes in interpret mode (any machine)"
    )
    parser.add_argument(
        "--report", metavar="JSON", help="only rewrite the .md and .svg of a results JSON"
    )
    parser.add_argument(
        "--merge-into",
        metavar="JSON",
        help="with --report: merge that run's rows into this results JSON (each replaces "
        "the row of its case and kernel, naming its run's commit) and rewrite the JSON "
        "and its .md and .svg beside it",
    )


def check_args(args: argparse.Namespace) -> str | None:
    """The one-line error for arguments a suite cannot run, or None: the real cases
    time a TPU (``--smoke`` and ``--report`` run anywhere); ``--merge-into`` needs
    ``--report``."""
    if args.merge_into and not args.report:
        return "--merge-into: merges the run named by --report (--report RUN.json)"
    here = device_class()
    if args.report or args.smoke or here == "tpu":
        return None
    return (
        f"the suite times a TPU and the default device is {here}; --smoke runs its tiny "
        "cases in interpret mode on any device"
    )


class Runner:
    """The base of a suite's runner: the flags every suite reads, the run's metadata
    (:meth:`start`) and :meth:`record`. A suite's ``Runner(args)`` adds ``run_case``."""

    def __init__(self, args: argparse.Namespace, *, result: str, write_report: Callable):
        self.smoke = args.smoke
        self.iterations = 1 if args.smoke else args.iterations
        self.extra = {"interpret": True} if args.smoke else {}
        self.out = Path(args.out)
        self.sweep = args.sweep
        self.rows: list[dict] = []
        self.result, self.write_report = result, write_report

    def start(self, chip, **meta) -> None:
        """The run's metadata (provenance, device, jax, the runtime's own version string,
        the chip's name, then ``meta``), printed as the first JSON line. ``platform`` tells
        two runs on the same jax apart when the runtime under it (libtpu) differs."""
        self.meta = {
            **provenance(),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "platform": " ".join(jax_backend.get_backend().platform_version.split()),
            "chip": chip.name,
            **meta,
        }
        print(json.dumps(self.meta), flush=True)

    def record(self, **row) -> None:
        """Print a row and rewrite ``RESULT.json`` and the report with it."""
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.out.mkdir(parents=True, exist_ok=True)
        result = {**self.meta, "rows": self.rows}
        with open(self.out / f"{self.result}.json", "w") as f:
            json.dump(result, f, indent=1)
        self.write_report(result, self.out)  # a cut run keeps its rows


def select_cases(cases, substrings) -> list:
    """The cases whose names hold one of ``substrings``, in the order of the substrings
    (a time-limited run does the first named first), each once; every case, in the
    suite's order, when none are given."""
    if not substrings:
        return list(cases)
    picked = []
    for s in substrings:
        picked += [c for c in cases if s in c.name and c not in picked]
    return picked


def run_suite(args, *, runner_cls, cases, smoke_cases, write_report, write_plot, result: str):
    """Run the selected cases with ``runner_cls(args)`` (a case that raises is recorded
    as an error row) and write the report, or only rewrite the report of
    ``args.report``; 1 when a case failed (sweep rows aside), else 0."""
    if args.report:
        data = json.loads(Path(args.report).read_text())
        out = Path(args.out)
        if args.merge_into:
            target = Path(args.merge_into)
            data = merge_results(json.loads(target.read_text()), data)
            target.write_text(json.dumps(data, indent=1) + "\n")
            out = target.parent
        out.mkdir(parents=True, exist_ok=True)
        write_report(data, out)
        write_plot(data, out / f"{result}.svg")
        return 0
    cases = select_cases(smoke_cases if args.smoke else cases, args.cases)
    runner = runner_cls(args)
    for case in cases:
        try:
            runner.run_case(case)
        except Exception as e:
            traceback.print_exc()
            mode = {"mode": case.mode} if hasattr(case, "mode") else {}
            runner.record(case=case.name, **mode, error=error_line(e))
    data = {**runner.meta, "rows": runner.rows}
    write_report(data, runner.out)
    write_plot(data, runner.out / f"{result}.svg")
    return 1 if any("error" in r and not r.get("sweep") for r in runner.rows) else 0


def _row_key(row: dict) -> tuple:
    """A row's identity for merging: a sweep row's also names its tiling."""
    tiling = (row.get("block_q"), row.get("block_kv")) if row.get("sweep") else None
    return (
        row.get("case"), row.get("kernel"), row.get("mode"), row.get("role"), row.get("layout"),
        tiling,
    )  # fmt: skip


def merge_results(base: dict, run: dict) -> dict:
    """``base`` (a results JSON) with ``run``'s rows merged in, for re-measuring some
    cases of a suite: each of ``run``'s rows replaces ``base``'s row of the same case,
    kernel, mode, role and layout (a sweep row's tiling too) in its place (new ones are appended) and names ``run``'s
    commit; ``base``'s commands and dates become lists with ``run``'s appended. Rows
    ``run`` does not re-measure are kept as they are."""
    commit = run.get("commit")
    new = {_row_key(r): {**r, "commit": r.get("commit", commit)} for r in run["rows"]}
    rows = [new.pop(_row_key(r), r) for r in base["rows"]]
    rows += list(new.values())

    def listed(key):
        had = base.get(key, [])
        return [*(had if isinstance(had, list) else [had]), run.get(key)]

    return {**base, "command": listed("command"), "date": listed("date"), "rows": rows}


@dataclasses.dataclass(frozen=True)
class Suite:
    """A suite's entry points from its parts: ``run(args)`` (:func:`run_suite`) and
    ``main(argv)`` (``python -m``: parse, refuse off a TPU in one line, run)."""

    description: str
    add_arguments: Callable
    runner_cls: type
    cases: tuple
    smoke_cases: tuple
    write_report: Callable
    write_plot: Callable
    result: str
    sweep: Suite | None = None  # what ``--sweep`` runs instead, where it differs

    @classmethod
    def of(cls, namespace: dict) -> Suite:
        """The suite of a module from the names every suite module defines (pass its
        ``globals()``): the first paragraph of its docstring, ``add_arguments``,
        ``Runner``, ``CASES``, ``SMOKE_CASES``, ``write_report``, ``write_plot`` and
        ``RESULT``."""
        return cls(
            description=namespace["__doc__"].split("\n\n")[0],
            add_arguments=namespace["add_arguments"],
            runner_cls=namespace["Runner"],
            cases=namespace["CASES"],
            smoke_cases=namespace["SMOKE_CASES"],
            write_report=namespace["write_report"],
            write_plot=namespace["write_plot"],
            result=namespace["RESULT"],
        )

    def run(self, args: argparse.Namespace) -> int:
        """Run the suite (or only rewrite a report); 1 when a case failed, else 0."""
        if args.sweep and self.sweep is not None:
            return self.sweep.run(args)
        return run_suite(
            args, runner_cls=self.runner_cls, cases=self.cases, smoke_cases=self.smoke_cases,
            write_report=self.write_report, write_plot=self.write_plot, result=self.result,
        )  # fmt: skip

    def main(self, argv=None) -> int:
        p = argparse.ArgumentParser(description=self.description)
        self.add_arguments(p)
        args = p.parse_args(argv)
        problem = check_args(args)
        if problem:
            p.error(problem)
        return self.run(args)


def report_provenance(result: dict, tflops_format: str) -> str:
    """How a report begins: the run's device, jax (and runtime, where recorded), commit and
    measured bf16 matmul rate (``tflops_format``: its format spec), up to ``TFLOP/s ``
    inclusive."""
    tflops = result.get("matmul_tflops", 0)
    platform = f" ({result['platform']})" if result.get("platform") else ""
    return (
        f"Device {result.get('device')}, jax {result.get('jax')}{platform}, commit "
        f"{result.get('commit')}; bf16 matmul {tflops:{tflops_format}} TFLOP/s "
    )


def write_markdown(out: Path, result: str, lines: list[str]) -> Path:
    """``out/RESULT.md`` from the report's lines; its path."""
    path = out / f"{result}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only), or None without
    matplotlib: a suite's plot is optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def error_line(e: BaseException) -> str:
    """An exception as one line (type and the first line of its message)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
