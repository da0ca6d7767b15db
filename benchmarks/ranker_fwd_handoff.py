"""A/B of how the Hopper ranker forward's compute warpgroups hand over the CUDA cores (H200).

ncu's per-instruction view of the shipped forward (``benchmarks/ranker_fwd_stalls.py``)
showed ptxas issuing the *softmax done* arrive on the ping-pong's schedule barrier
before the step's exponentials (with a cap) or before the row max (without one), so the
other warpgroup starts its softmax early and the two share the MUFU. The variants
(``ranker_fwd._HANDOFF``, read when the kernel is built):

* ``arrive``: as shipped.
* ``pinned``: a shared-memory store of the row sums ``l_i`` before the arrive; the
  arrive's release semantics keep it after the store, so after every exponent of the
  thread's rows: the strict ping-pong the schedule was designed as.
* ``free``: no schedule barrier; the warpgroups only meet at the K/V ring.
* ``start``, ``max``, ``half``: the arrive placed (in program order) right after the
  ``Q K^T`` result, after the row max (pinned by a store of it), or after the first half
  of the exponentials (pinned by a store of their row sums).

For each case, the tuned config (``--no-cap`` also runs it without a cap), each variant
compiled and checked bitwise against the first, then timed round after round in the
same order (CUPTI device time, median of ``--iterations``)::

    python benchmarks/ranker_fwd_handoff.py --cases phoenix ragged long small-d64
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import ranker_case, ranker_flops
from attn_mosaic_gpu import ranker_fwd
from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.ranker import resolve_tuning

# The variants live in 71246cc's ranker_fwd.py (measured there, not kept).
EXPERIMENT_COMMIT = "71246cc"
VARIANTS = ("arrive", "pinned", "free", "start", "max", "half")


def run_case(name, cap, variants, rounds, iterations):
    case = ranker_case(name)
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)
    config = resolve_tuning(q, cap, None, None, bounds=bounds)[0]
    label = f"{name}{'' if cap is not None else ' (no cap)'}"
    print(f"{label}: {config}", flush=True)
    fns, first = {}, None
    for variant in variants:
        ranker_fwd._HANDOFF = variant
        fn = jax.jit(
            lambda q, k, v: ranker_fwd.ranker_attention_fwd(
                q, k, v, bounds, cap=cap, config=config, return_lse=True
            )
        )
        outs = [np.asarray(x) for x in fn(q, k, v)]
        first = outs if first is None else first
        same = all(np.array_equal(a, b) for a, b in zip(outs, first, strict=True))
        print(f"  {variant:7s} out and lse bitwise equal to {variants[0]}'s: {same}", flush=True)
        fns[variant] = fn
    ranker_fwd._HANDOFF = "arrive"
    for r in range(rounds):
        for variant in variants:
            ms, _ = device_ms(fns[variant], q, k, v, iterations=iterations)
            print(f"  round {r} {variant:7s} {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["phoenix", "ragged", "long", "small-d64"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--no-cap", action="store_true", help="also time each case without a cap")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    if not hasattr(ranker_fwd, "_HANDOFF"):
        raise SystemExit(
            f"ranker_fwd.py has no _HANDOFF switch: run this against {EXPERIMENT_COMMIT}'s "
            f"(git checkout {EXPERIMENT_COMMIT} -- packages/attn-mosaic-gpu/src/attn_mosaic_gpu/"
            "ranker_fwd.py)"
        )
    for name in args.cases:
        caps = [ranker_case(name).cap] + ([None] if args.no_cap else [])
        for cap in dict.fromkeys(caps):
            run_case(name, cap, args.variants, args.rounds, args.iterations)


if __name__ == "__main__":
    main()
