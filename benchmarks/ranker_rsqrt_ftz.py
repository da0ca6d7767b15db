"""A/B of soft_sign's reciprocal in the Hopper ranker kernels: ``rsqrt.approx.ftz.f32``
(``fastmath.fast_reciprocal_tile``, the default) against ``rsqrt.approx.f32``
(``fastmath.fast_reciprocal``, ptxas's subnormal guard around every element), H200.

For each suite case, in one process: the tuned forward and ``jax.grad`` of a
forward+backward loss (what ``config=None`` runs), each with the kernels built on
the old reciprocal, the new one, and the old one again (``fastmath.fast_reciprocal_tile``,
which ``fastmath.mufu_reciprocal`` hands the compiled kernels at build time, is
switched and jax's caches cleared between), CUPTI median of
iterations; outputs and gradients compared bitwise with the earlier runs::

    python benchmarks/ranker_rsqrt_ftz.py phoenix ragged
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import ranker_case, ranker_flops
from attn_common.bench import device_ms
from attn_mosaic_gpu import fastmath, ranker_attention

FTZ_TILE = fastmath.fast_reciprocal_tile
RECIPROCALS = (
    ("rsqrt.approx", fastmath.fast_reciprocal),
    ("rsqrt.approx.ftz", FTZ_TILE),
    ("rsqrt.approx again", fastmath.fast_reciprocal),
)


def run_case(name: str, iterations: int) -> None:
    case = ranker_case(name)
    q, k, v, dout = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)
    results = {}
    for label, tile_reciprocal in RECIPROCALS:
        fastmath.fast_reciprocal_tile = tile_reciprocal
        jax.clear_caches()

        def fwd(q, k, v):
            return ranker_attention(q, k, v, bounds, cap=case.cap)

        def loss(q, k, v):
            return (fwd(q, k, v).astype(jnp.float32) * dout).sum()

        f, g = jax.jit(fwd), jax.jit(jax.grad(loss, (0, 1, 2)))
        ms_f, _ = device_ms(f, q, k, v, iterations=iterations)
        ms_g, _ = device_ms(g, q, k, v, iterations=iterations)
        outs = [np.asarray(f(q, k, v)), *(np.asarray(x) for x in g(q, k, v))]
        bitwise = {
            other: all(np.array_equal(a, b) for a, b in zip(outs, prev, strict=True))
            for other, prev in results.items()
        }
        results[label] = outs
        print(
            f"{name:8s} {label:20s} fwd {ms_f:.3f} ms ({flops / ms_f / 1e9:.0f} TFLOP/s)"
            f"  fwd+bwd {ms_g:.3f} ms ({3.5 * flops / ms_g / 1e9:.0f})  bitwise equal to"
            f" {bitwise}",
            flush=True,
        )
    fastmath.fast_reciprocal_tile = FTZ_TILE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=["phoenix", "ragged"])
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    for name in args.cases:
        run_case(name, args.iterations)


if __name__ == "__main__":
    main()
