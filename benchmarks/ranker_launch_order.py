"""A/B of the Hopper ranker kernels' launch order at the suite shapes (H200).

Pallas Mosaic GPU maps the last grid axis to CUDA's x, the fastest-launched one, so the
per-tile grids ``(heads, tiles, batch)`` of the forward (``programs=0``) and of the
backward's dq (``dq_programs=0``) and dk/dv kernels start every batch row of one tile
before the next tile, and GQA siblings (which read the same K/V) or the tiles of one
(batch, head) (which read the same Q/dO in dk/dv) far apart. The kernels read their
program ids by axis name, so permuting the grid tuple changes only the launch order.
This script rewrites the grids of those kernels while tracing (``--orders``):

* ``batch``: ``(heads, tiles, batch)``, the shipped order (batch fastest);
* ``heads``: ``(batch, tiles, heads)``, heads fastest;
* ``tiles``: ``(batch, heads, tiles)``, the tiles of one (batch, head) fastest.

For each case it compiles, per order, the forward with the tuned config at
``programs=0`` and the backward with the tuned knobs (and at ``dq_programs=0``), checks
every output bitwise against the first order's, then times round after round (CUPTI
device time, median of ``--iterations``)::

    python benchmarks/ranker_launch_order.py --cases phoenix long small-d64 ragged
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common import ranker_case, ranker_flops
from attn_mosaic_gpu import _axes, ranker_bwd, ranker_bwd_pipelined, ranker_fwd
from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.ranker import resolve_tuning
from attn_mosaic_gpu.ranker_bwd import ranker_attention_bwd
from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd

ORDERS = ("batch", "heads", "tiles")
_MODULES = (ranker_fwd, ranker_bwd, ranker_bwd_pipelined)


class _Reordered:
    """``plgpu`` with ``kernel`` rewriting a ``(heads, tiles, batch)`` grid to ``order``."""

    def __init__(self, order: str):
        self.order, self.rewritten = order, 0

    def __getattr__(self, name):
        return getattr(plgpu, name)

    def kernel(self, body, *, grid=(), grid_names=(), **kwargs):
        names = tuple(grid_names)
        if len(names) == 3 and names[0] == _axes.HEADS and names[2] == _axes.BATCH:
            heads, tiles, batch = grid
            perm = {"batch": (0, 1, 2), "heads": (2, 1, 0), "tiles": (2, 0, 1)}[self.order]
            grid = tuple((heads, tiles, batch)[i] for i in perm)
            names = tuple(names[i] for i in perm)
            self.rewritten += 1
        return plgpu.kernel(body, grid=grid, grid_names=names, **kwargs)


@contextlib.contextmanager
def launch_order(order: str):
    proxy = _Reordered(order)
    for module in _MODULES:
        module.plgpu = proxy
    try:
        yield proxy
    finally:
        for module in _MODULES:
            module.plgpu = plgpu


def run_case(name: str, orders: list[str], rounds: int, iterations: int) -> None:
    case = ranker_case(name)
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    fwd_flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)
    config, tuning = resolve_tuning(q, case.cap, None, None, bounds=bounds)
    out, lse = ranker_attention_fwd(q, k, v, bounds, cap=case.cap, config=config, return_lse=True)
    dout = jax.random.normal(jax.random.key(7), out.shape, out.dtype)
    # Persistent kernels (programs, dq_programs > 0) have a 1-D grid: only their per-tile
    # twins and the dk/dv kernel feel the order.
    variants = {"fwd programs=0": ("fwd", config.replace(programs=0))}
    if tuning is not None:
        variants["bwd tuned"] = ("bwd", tuning)
        if tuning.dq_programs:
            variants["bwd dq_programs=0"] = ("bwd", dataclasses.replace(tuning, dq_programs=0))
    print(f"{name}: config {config}, backward {tuning}", flush=True)

    def fn(kind, knobs):
        if kind == "fwd":
            return lambda q, k, v: ranker_attention_fwd(
                q, k, v, bounds, cap=case.cap, config=knobs, return_lse=True
            )
        return lambda q, k, v: ranker_attention_bwd(
            q, k, v, bounds, out, lse, dout, cap=case.cap, tuning=knobs
        )

    compiled, first = {}, {}
    for order in orders:
        jax.clear_caches()  # the kernels' own jit caches must retrace under the new order
        with launch_order(order) as proxy:
            for label, (kind, knobs) in variants.items():
                compiled[order, label] = jax.jit(fn(kind, knobs)).lower(q, k, v).compile()
        print(f"{name} order={order}: {proxy.rewritten} grids rewritten", flush=True)
        for label in variants:
            outs = [np.asarray(x) for x in compiled[order, label](q, k, v)]
            first.setdefault(label, outs)
            same = all(np.array_equal(a, b) for a, b in zip(outs, first[label], strict=True))
            print(f"{name} order={order} {label}: bitwise equal to order={orders[0]}: {same}",
                  flush=True)  # fmt: skip
    for r in range(rounds):
        for label, (kind, _) in variants.items():
            flops = fwd_flops * (1 if kind == "fwd" else 2.5)
            for order in orders:
                ms, _ = device_ms(compiled[order, label], q, k, v, iterations=iterations)
                print(f"{name:9s} round {r} {label:18s} order={order:5s}: {ms:.3f} ms "
                      f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    parser.add_argument("--cases", nargs="+", default=["phoenix", "ragged", "long", "small-d64"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    for name in args.cases:
        run_case(name, args.orders, args.rounds, args.iterations)


if __name__ == "__main__":
    main()
