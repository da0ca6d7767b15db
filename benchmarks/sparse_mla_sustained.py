"""The Hopper sparse-MLA op's time call by call over a long back-to-back run (H200).

``attn bench sparse-mla`` reports the median of a few calls after a warm-up. Held busy
longer, an H200 reaches its power limit and lowers its SM clock; this script shows how
far the op's time moves then: ``--calls`` back-to-back calls of the op on one benchmark
case, CUPTI device time per call, twice (docs/sparse_mla_gpu.md). Sample the clock
alongside with ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms
100`` (read-only)::

    python benchmarks/sparse_mla_sustained.py --case flat-h128-t128k --calls 100
"""

from __future__ import annotations

import argparse
import statistics

import jax
from jax.experimental.mosaic.gpu import profiler

from attn_common import bench_sparse_mla as bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="flat-h128-t128k")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    case = next(c for c in bench.CASES if c.name == args.case)
    inputs = bench.make_inputs(case, seed=0)
    fn, call_args = bench.jit_call(bench.load_impl("mosaic-gpu"), inputs["args"], inputs["kwargs"])
    compiled = jax.jit(fn).lower(*call_args).compile()
    for run in range(args.runs):
        _, ms = profiler.Cupti().measure(compiled, iterations=args.calls)(*call_args)
        print(f"{case.name} run {run}: {args.calls} back-to-back calls, ms per call: first 10 "
              f"median {statistics.median(ms[:10]):.3f}, last 10 median "
              f"{statistics.median(ms[-10:]):.3f}, all median {statistics.median(ms):.3f}",
              flush=True)  # fmt: skip
        print("  every 10th:", " ".join(f"{t:.3f}" for t in ms[::10]), flush=True)


if __name__ == "__main__":
    main()
