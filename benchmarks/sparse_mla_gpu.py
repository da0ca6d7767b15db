"""Sparse MLA prefill on a Hopper GPU, our kernel vs XLA (docs/sparse_mla_gpu.md): a thin wrapper.

The benchmark lives in ``attn_mosaic_gpu.bench_sparse_mla`` (also ``attn bench sparse-mla``,
which writes into a new ``attn-results/<timestamp>`` folder and runs a smoke run off a
GPU). This script keeps its own defaults: ``--out docs/results``, ``--impl mosaic-gpu``,
the full cases unless ``--smoke``::

    python benchmarks/sparse_mla_gpu.py                       # all cases, docs/results
    python benchmarks/sparse_mla_gpu.py --cases 'flat-h128-*' --out /tmp/r
    python benchmarks/sparse_mla_gpu.py --smoke --impl reference --out /tmp/s   # CPU

Writes ``sparse_mla_gpu.json`` and ``sparse_mla_gpu.md`` into ``--out``; the exit status
is 1 when a row failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attn_mosaic_gpu import bench_sparse_mla

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark with this script's defaults; the result dict written to the JSON."""
    return bench_sparse_mla.main(argv, script_out=ROOT / "docs" / "results")


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
