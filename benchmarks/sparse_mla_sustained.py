"""The Hopper sparse-MLA op's time call by call over a long back-to-back run (H200).

``attn bench sparse-mla`` reports the median of a few calls after a warm-up. Held busy
longer, an H200 reaches its power limit and lowers its SM clock; this script shows how
far the op's time moves then: ``--calls`` back-to-back calls of the op on one benchmark
case, CUPTI device time per call, twice, for ours and (``--impl xla``) for the XLA
gather + einsum baseline in chunks of 1024 queries (docs/sparse_mla_gpu.md). Sample the clock
alongside with ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms
100`` (read-only)::

    python benchmarks/sparse_mla_sustained.py --case flat-h128-t128k --calls 100 --impl ours xla
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax

from attn_mosaic_gpu import bench_sparse_mla as bench
from attn_mosaic_gpu.bench import cupti_call_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="flat-h128-t128k")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--impl", nargs="+", choices=("ours", "xla"), default=["ours"])
    args = parser.parse_args()
    case = next(c for c in bench.CASES if c.name == args.case)
    inputs = bench.make_inputs(case, seed=0)
    for impl in args.impl:
        op = (
            bench.load_impl("mosaic-gpu")
            if impl == "ours"
            else functools.partial(bench.xla_sparse_mla, chunk=1024)
        )
        fn, call_args = bench.jit_call(op, inputs["args"], inputs["kwargs"])
        compiled = jax.jit(fn).lower(*call_args).compile()
        for run in range(args.runs):
            report(f"{case.name} {impl} run {run}", compiled, call_args, args.calls)


def report(label: str, compiled, call_args: tuple, calls: int) -> None:
    ms = cupti_call_ms(compiled, call_args, calls)
    print(f"{label}: {calls} back-to-back calls, ms per call: first 10 "
          f"median {statistics.median(ms[:10]):.3f}, last 10 median "
          f"{statistics.median(ms[-10:]):.3f}, all median {statistics.median(ms):.3f}",
          flush=True)  # fmt: skip
    print("  every 10th:", " ".join(f"{t:.3f}" for t in ms[::10]), flush=True)


if __name__ == "__main__":
    main()
