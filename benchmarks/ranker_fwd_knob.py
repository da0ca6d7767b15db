"""A/B of one field of the Hopper ranker forward's ``KernelConfig`` at the suite shapes (H200).

For each case: the tuned config (what ``config=None`` runs) with ``--knob`` set to each
of ``--values`` in turn, all compiled first, then timed round after round in the same
order (``--rounds``, so a drift of the device shows as a drift, not as a difference),
CUPTI device time, median of ``--iterations`` per round. Out and LSE are compared
bitwise with the first value's::

    python benchmarks/ranker_fwd_knob.py --knob compute_registers --values 0 240 \\
        --cases phoenix ragged long small-d64
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import KernelConfig, ranker_case, ranker_flops
from attn_common.bench import device_ms
from attn_mosaic_gpu.ranker import resolve_tuning
from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd

KNOBS = [f.name for f in dataclasses.fields(KernelConfig)]


def run_case(name: str, knob: str, values: list[int], rounds: int, iterations: int) -> None:
    case = ranker_case(name)
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)
    tuned = resolve_tuning(q, case.cap, None, None, bounds=bounds)[0]
    fns, first = {}, None
    for value in values:
        config = tuned.replace(**{knob: value})
        fns[value] = jax.jit(
            lambda q, k, v, c=config: ranker_attention_fwd(
                q, k, v, bounds, cap=case.cap, config=c, return_lse=True
            )
        )
        outs = [np.asarray(x) for x in fns[value](q, k, v)]
        first = outs if first is None else first
        same = all(np.array_equal(a, b) for a, b in zip(outs, first, strict=True))
        print(f"{name:9s} {knob}={value}: {config}, out and lse bitwise equal to "
              f"{knob}={values[0]}'s: {same}", flush=True)  # fmt: skip
    for r in range(rounds):
        for value in values:
            ms, _ = device_ms(fns[value], q, k, v, iterations=iterations)
            print(f"{name:9s} round {r} {knob}={value}: {ms:.3f} ms "
                  f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--knob", choices=KNOBS, required=True)
    parser.add_argument("--values", nargs="+", type=int, required=True)
    parser.add_argument("--cases", nargs="+", default=["phoenix", "ragged", "long", "small-d64"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    for name in args.cases:
        run_case(name, args.knob, args.values, args.rounds, args.iterations)


if __name__ == "__main__":
    main()
