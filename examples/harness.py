"""What the examples share: their command line, the shape they run at, a timer and the
report they write.

Each example script puts this folder on ``sys.path`` and imports it (``import harness``);
it is not an example itself.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import numpy as np

from attn_common import select_backend
from attn_common.cli_args import wall_times

KERNEL_BACKENDS = ("mosaic-gpu", "pallas-tpu")


def parser(doc: str, name: str, what: str, report: str) -> argparse.ArgumentParser:
    """The flags every example takes: ``--small``, ``--implementation``, ``--interpret``,
    ``--steps``, ``--seed`` and ``--out`` (default ``attn-results/examples/<name>``).
    ``what``: what the backend runs (for ``--implementation``'s help); ``report``: the
    files ``--out`` receives (for its help). The example adds its own flags."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="CPU shapes: seconds")
    ap.add_argument(
        "--implementation",
        default=None,
        choices=("reference", *KERNEL_BACKENDS),
        help=f"{what} backend (default: the best installed for the device)",
    )
    ap.add_argument(
        "--interpret", action="store_true", help="a kernel backend in interpret mode (CPU, slow)"
    )
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: per shape)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("attn-results/examples") / name,
        help=f"folder for {report} (default: %(default)s)",
    )
    return ap


def _enough_xla_cpu_threads() -> None:
    """The Mosaic GPU interpreter (``--interpret``) runs each warpgroup as its own program
    on an XLA CPU thread, and they wait on each other: with fewer threads than programs it
    hangs. Raise the pool to 16 (as ``attn`` does) before JAX creates its CPU client."""
    if int(os.environ.get("NPROC", "0") or 0) < 16:
        os.environ["NPROC"] = "16"


def pick_shape(shapes: dict, small: bool, implementation: str | None) -> dict:
    """The shape: ``full``, or ``small``; with a kernel backend named, ``small`` takes the
    smallest sizes the kernels accept (its ``kernel`` entry)."""
    if not small:
        return shapes["full"]
    shape = dict(shapes["small"])
    kernel = shape.pop("kernel")
    if implementation in KERNEL_BACKENDS:
        for key, value in kernel.items():
            shape[key] = {**shape[key], **value} if isinstance(value, dict) else value
    return shape


def start(args: argparse.Namespace, shapes: dict, op: str) -> tuple[dict, dict]:
    """After parsing: ``(shape, report)``, the shape the flags pick and the report's
    first entries (``backend``: the one ``op`` runs on, ``device``, ``shape``). With
    ``--interpret``, first raises XLA's CPU threads to what the interpreters need."""
    if args.interpret:
        _enough_xla_cpu_threads()
    shape = pick_shape(shapes, args.small, args.implementation)
    backend, _ = select_backend(op, args.implementation, interpret=args.interpret)
    report = {
        "backend": backend,
        "device": jax.devices()[0].device_kind,
        "shape": "small" if args.small else "full",
    }
    return shape, report


def timed(fn, *args, repeats: int) -> float:
    """Median wall time of ``fn(*args)`` (seconds), after one untimed call (compile)."""
    return float(np.median(wall_times(fn, *args, repeats=repeats)))


def cpu_timing_note() -> None:
    if jax.default_backend() == "cpu":
        print("  (CPU timings: a smoke run of the code path, not a measurement)")


def write_report(out: Path, name: str, report: dict) -> Path:
    """``report`` as JSON in ``out/<name>`` (the folder made if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(report, indent=1))
    return path
