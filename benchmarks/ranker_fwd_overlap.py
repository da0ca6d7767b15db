"""A/B of the Hopper ranker forward's schedule: FA3's intra-warpgroup overlap (step
``i``'s ``Q K^T`` issued with step ``i - 1``'s ``P V``, the softmax running while ``P V``
is in flight) against the ping-pong alone, at the suite shapes (H200).

For each case and each ``compute_registers`` in ``--registers`` (0 = the tuned config's):
both schedules built in one process, out and LSE compared bitwise, then timed round after
round in the same order (CUPTI device time, median of ``--iterations``). ``--no-cap``
adds each case without its cap (what the cap costs)::

    python benchmarks/ranker_fwd_overlap.py --cases phoenix long small-d64 ragged
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import ranker_case, ranker_flops
from attn_common.bench import device_ms
from attn_mosaic_gpu import ranker_fwd
from attn_mosaic_gpu.ranker import resolve_tuning


def build(case, bounds, config, cap, overlap: bool):
    fn = jax.jit(
        lambda q, k, v: ranker_fwd.ranker_attention_fwd(
            q, k, v, bounds, cap=cap, config=config, return_lse=True
        )
    )
    shipped = ranker_fwd._OVERLAP
    ranker_fwd._OVERLAP = overlap  # read when the function is traced (its first call)
    try:
        q, k, v, _ = case.inputs()
        outs = [np.asarray(x) for x in fn(q, k, v)]
    finally:
        ranker_fwd._OVERLAP = shipped
    return fn, outs


def run_case(name, registers, rounds, iterations, no_cap):
    case = ranker_case(name)
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)
    tuned = resolve_tuning(q, case.cap, None, None, bounds=bounds)[0]
    caps = [("cap", case.cap)] + ([("no cap", None)] if no_cap and case.cap is not None else [])
    fns = {}
    for cap_name, cap in caps:
        for regs in registers:
            config = tuned.replace(compute_registers=regs) if regs else tuned
            outs = {}
            for overlap in (False, True):
                key = (cap_name, config.compute_registers, overlap)
                fns[key], outs[overlap] = build(case, bounds, config, cap, overlap)
            same = all(np.array_equal(a, b) for a, b in zip(outs[False], outs[True], strict=True))
            print(f"{name:9s} {cap_name} {config}: overlap out and lse bitwise equal to "
                  f"the ping-pong's: {same}", flush=True)  # fmt: skip
    for r in range(rounds):
        for (cap_name, regs, overlap), fn in fns.items():
            ms, _ = device_ms(fn, q, k, v, iterations=iterations)
            schedule = "overlap  " if overlap else "ping-pong"
            print(f"{name:9s} round {r} {cap_name:6s} registers={regs} {schedule}: {ms:.3f} ms "
                  f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["phoenix", "long", "small-d64", "ragged"])
    parser.add_argument("--registers", nargs="+", type=int, default=[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--no-cap", action="store_true")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    for name in args.cases:
        run_case(name, args.registers, args.rounds, args.iterations, args.no_cap)


if __name__ == "__main__":
    main()
