"""Per-kernel CUPTI times of the Hopper prefill wrapper, one call against a loop (H200).

``prefill_write_and_attend_ragged`` on one paged benchmark case, jitted as one call
(the cache not donated) and as 8 calls carrying the cache through a loop
(``attn_mosaic_gpu.bench_sparse_mla.carried_calls``): each kernel's count and summed time
per form, so a difference between the two shows which kernels it is in
(docs/sparse_mla_gpu.md)::

    python benchmarks/sparse_mla_write_loop.py --case paged-h128-t8k
"""

from __future__ import annotations

import argparse
import collections

from jax.experimental.mosaic.gpu import profiler

from attn_mosaic_gpu import bench_sparse_mla as bench

CALLS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="paged-h128-t8k")
    args = parser.parse_args()
    case = next(c for c in bench.CASES if c.name == args.case)
    inputs = bench.make_inputs(case, seed=0)
    w = bench.write_inputs(case, inputs["args"], inputs["kwargs"])
    _, wrapper = bench.write_fns(case, "mosaic-gpu")
    loop = bench.carried_calls(wrapper, list(w).index("cache"), CALLS)
    call_args = tuple(w.values())
    for name, fn in (("one", wrapper), ("loop", loop)):
        compiled = fn.lower(*call_args).compile()
        _, timings = profiler.Cupti().measure(compiled, aggregate=False, iterations=2)(*call_args)
        per_kernel = collections.defaultdict(list)
        for kernel, ms in timings[-1]:
            per_kernel[kernel[:60]].append(ms)
        print(name, "total ms", sum(ms for _, ms in timings[-1]))
        for kernel, ms in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1])):
            print(f"   {kernel:60s} n={len(ms):3d} sum={sum(ms):.4f} max={max(ms):.4f} "
                  f"min={min(ms):.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
