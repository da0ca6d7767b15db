"""A/B of the Hopper ranker forward's lazy rescale at the suite shapes (H200).

``ranker_fwd._LAZY_RESCALE`` on: the running max moves only when a row's max grows by
more than ``_LAZY_MAX_THRESHOLD`` (base 2), and the output accumulator's rescale (one
multiply per element and step) is skipped by every thread whose rows kept their max
(``fastmath.rescale_rows_where_needed``). Off: the max and the rescale every step.

For each case: the tuned config (what ``config=None`` runs) built with the switch off
and on (jax's caches cleared between), then timed round after round in the same order,
CUPTI device time, median of ``--iterations`` per round; out and LSE of each variant
measured against the float32 reference (rel L2, max-abs; LSE max-abs)::

    python benchmarks/ranker_fwd_rescale.py --cases phoenix ragged long small-d64
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import attn_reference
from attn_common import ranker_case, ranker_flops
from attn_common.bench import device_ms
from attn_mosaic_gpu import ranker_fwd
from attn_mosaic_gpu.ranker import resolve_tuning

VARIANTS = {"every step": False, "lazy": True}


def _errors(out, lse, want_out, want_lse) -> str:
    o, w = np.asarray(out, np.float64), np.asarray(want_out, np.float64)
    rel_l2 = np.linalg.norm(o - w) / np.linalg.norm(w)
    gl, wl = np.asarray(lse, np.float64), np.asarray(want_lse, np.float64)
    live = np.isfinite(wl)
    return (
        f"out rel-L2 {rel_l2:.4e} max-abs {np.abs(o - w).max():.3e}, "
        f"lse max-abs {np.abs(gl[live] - wl[live]).max():.3e}"
    )


def run_case(name: str, rounds: int, iterations: int) -> None:
    case = ranker_case(name)
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)
    config = resolve_tuning(q, case.cap, None, None, bounds=bounds)[0]
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = attn_reference.ranker_attention(*f32, bounds, cap=case.cap, return_lse=True)
    fns = {}
    for label, lazy in VARIANTS.items():
        ranker_fwd._LAZY_RESCALE = lazy
        jax.clear_caches()
        fn = jax.jit(
            lambda q, k, v: ranker_fwd.ranker_attention_fwd(
                q, k, v, bounds, cap=case.cap, config=config, return_lse=True
            )
        )
        out, lse = fn(q, k, v)
        fns[label] = fn
        print(f"{name:9s} {label:10s} {config}: {_errors(out.astype(jnp.float32), lse, *want)}",
              flush=True)  # fmt: skip
    ranker_fwd._LAZY_RESCALE = True
    for r in range(rounds):
        for label, fn in fns.items():
            ms, _ = device_ms(fn, q, k, v, iterations=iterations)
            print(f"{name:9s} round {r} {label:10s}: {ms:.3f} ms "
                  f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["phoenix", "ragged", "long", "small-d64"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    for name in args.cases:
        run_case(name, args.rounds, args.iterations)


if __name__ == "__main__":
    main()
