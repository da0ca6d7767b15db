"""A/B of soft_sign's MUFU reciprocal in the Hopper ranker kernels, H200: the forms
``fastmath.fast_reciprocal_tile`` can take in the compiled kernels.

* ``rsqrt.approx.ftz^2``: ``rsqrt.approx.ftz.f32`` squared (the default).
* ``rcp.approx.ftz``: one ``rcp.approx.ftz.f32`` per element, a multiply less; not
  bitwise the same, and slower in the phoenix forward (docs/ranker_gpu.md).
* ``rsqrt.approx^2``: ``fastmath.fast_reciprocal``, Mosaic GPU's own
  ``rsqrt.approx.f32`` squared, around which ptxas puts a subnormal guard.

For each suite case, in one process and in the order given (``--variants``; a name
may repeat, to see the drift between runs): the tuned forward and ``jax.grad`` of a
forward+backward loss (what ``config=None`` runs), with the kernels built on that form
(``fastmath.fast_reciprocal_tile``, which ``fastmath.mufu_reciprocal`` hands the
compiled kernels at build time, is switched and jax's caches cleared between), CUPTI
median of iterations. Each output and gradient is compared bitwise with the earlier
variants' and measured against the float32 reference (``attn_reference``, float32
inputs): rel L2 and max-abs, the two figures the GPU conformance tests bound.
``--exp2-cols`` also times the forward with each variant at those ``exp2_fma_cols``
(the tuned config otherwise): the tuned split was chosen with one reciprocal, and the
best split moves with the MUFU's load::

    python benchmarks/ranker_reciprocal.py phoenix ragged --exp2-cols 0 16 32 48 64
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import attn_reference
from attn_common import ranker_case, ranker_flops
from attn_mosaic_gpu import fastmath, ranker_attention
from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.ranker import resolve_tuning

DEFAULT_TILE = fastmath.fast_reciprocal_tile


def _rcp_ftz(d):
    return fastmath.ptx_unary_tile(d, "rcp.approx.ftz.f32")


RECIPROCALS = {
    "rsqrt.approx.ftz^2": DEFAULT_TILE,
    "rcp.approx.ftz": _rcp_ftz,
    "rsqrt.approx^2": fastmath.fast_reciprocal,
}
NAMES = ("out", "dq", "dk", "dv")


def _errors(got, want) -> str:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    rel_l2 = np.linalg.norm(g - w) / np.linalg.norm(w)
    return f"{rel_l2:.4e}/{np.abs(g - w).max():.3e}"


def run_case(name: str, variants: list[str], iterations: int, exp2_cols: list[int]) -> None:
    case = ranker_case(name)
    q, k, v, dout = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)

    def value_and_grads(attention, *args):
        def loss(q, k, v):
            return (attention(q, k, v).astype(jnp.float32) * dout).sum()

        return attention(*args), *jax.grad(loss, (0, 1, 2))(*args)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(
        lambda q, k, v: value_and_grads(
            lambda q, k, v: attn_reference.ranker_attention(q, k, v, bounds, cap=case.cap), q, k, v
        )
    )(*f32)
    want = [np.asarray(x) for x in want]

    results = {}
    for label in variants:
        fastmath.fast_reciprocal_tile = RECIPROCALS[label]
        jax.clear_caches()

        def fwd(q, k, v):
            return ranker_attention(q, k, v, bounds, cap=case.cap)

        f = jax.jit(fwd)
        g = jax.jit(lambda q, k, v: value_and_grads(fwd, q, k, v)[1:])
        ms_f, _ = device_ms(f, q, k, v, iterations=iterations)
        ms_g, _ = device_ms(g, q, k, v, iterations=iterations)
        outs = [np.asarray(x.astype(jnp.float32)) for x in (f(q, k, v), *g(q, k, v))]
        bitwise = {
            other: all(np.array_equal(a, b) for a, b in zip(outs, prev, strict=True))
            for other, prev in results.items()
        }
        results[label] = outs
        errors = "  ".join(
            f"{n} {_errors(o, w)}" for n, o, w in zip(NAMES, outs, want, strict=True)
        )
        print(
            f"{name:8s} {label:20s} fwd {ms_f:.3f} ms ({flops / ms_f / 1e9:.0f} TFLOP/s)"
            f"  fwd+bwd {ms_g:.3f} ms ({3.5 * flops / ms_g / 1e9:.0f})"
            f"  rel-L2/max-abs vs f32 reference: {errors}  bitwise equal to {bitwise}",
            flush=True,
        )
        tuned = resolve_tuning(q, case.cap, None, None, bounds=bounds)[0]
        for cols in exp2_cols:
            config = tuned.replace(exp2_fma_cols=cols)
            ms, _ = device_ms(
                jax.jit(lambda q, k, v, c=config: ranker_attention(q, k, v, bounds, cap=case.cap, config=c)),
                q, k, v, iterations=iterations,
            )  # fmt: skip
            print(f"{name:8s} {label:20s} fwd {ms:.3f} ms with {config}", flush=True)
    fastmath.fast_reciprocal_tile = DEFAULT_TILE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=["phoenix", "ragged"])
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(RECIPROCALS),
        default=["rsqrt.approx.ftz^2", "rcp.approx.ftz", "rsqrt.approx.ftz^2"],
    )
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--exp2-cols", nargs="*", type=int, default=[])
    args = parser.parse_args()
    for name in args.cases:
        run_case(name, args.variants, args.iterations, args.exp2_cols)


if __name__ == "__main__":
    main()
