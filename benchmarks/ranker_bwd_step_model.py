"""Where the Hopper ranker backward's time goes per program and per step (CPU only).

For each suite case in a ``ranker_bwd_sweep.json`` (default: docs/results), counts the
programs and the 64-row steps that the dq and dk/dv kernels of ``ranker_bwd_pipelined``
walk (from the same block-range builders the kernels use), and prints the measured time
per step and SM, the fraction of tile work that is allowed pairs, and, per kernel, a
least-squares fit of ``time = (programs * fixed + steps * per_step) / SMs`` over the
cases: ``fixed`` is what a program costs besides its steps (loading its fixed operands,
filling the ring, storing its accumulators).

    python benchmarks/ranker_bwd_step_model.py [--sweep docs/results/ranker_bwd_sweep.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from attn_common import ranker_case, ranker_flops
from attn_common.bounds import ranker_kv_block_ranges, ranker_q_block_ranges

SMS = 132  # H200
BLOCK = 64  # rows per warpgroup and per streamed block
TILE = 2 * BLOCK  # rows per program


def step_counts(name: str) -> dict:
    """Programs and steps (summed over programs) of the dq and dk/dv kernels, and the
    allowed (query, key) pairs summed over query heads."""
    case = ranker_case(name)
    bounds = np.asarray(case.bounds(seed=0))  # the sweep's bounds
    tiles = case.seq_len // TILE
    hl, hu, cl, cu = (jnp.asarray(bounds[:, i])[:, None] for i in range(4))
    start = jnp.arange(tiles)[None, :] * TILE
    kv_steps = ranker_kv_block_ranges(hl, hu, cl, cu, start, start + TILE, BLOCK).total_steps
    q_steps = ranker_q_block_ranges(hl, hu, cl, cu, start, start + TILE, BLOCK).total_steps
    return {
        "dq": (case.q_heads * tiles * case.batch, int(kv_steps.sum()) * case.q_heads),
        # a dk/dv program walks its query blocks once per query head of its group
        "dk/dv": (case.kv_heads * tiles * case.batch, int(q_steps.sum()) * case.q_heads),
        "pairs": ranker_flops(bounds, case.q_heads, case.head_dim) / (4 * case.head_dim),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=Path, default=Path("docs/results/ranker_bwd_sweep.json"))
    args = parser.parse_args(argv)
    data = json.loads(args.sweep.read_text())
    tuned = {r["case"]: r["kernels_ms"] for r in data["rows"] if r["variant"].startswith("tuned")}
    counts = {name: step_counts(name) for name in tuned}
    print(f"{args.sweep} (commit {data['commit']}), tuned rows, {SMS} SMs")
    for name, c in counts.items():
        parts = []
        for kernel in ("dq", "dk/dv"):
            programs, steps = c[kernel]
            us_per_step = tuned[name][kernel] * 1e3 * SMS / steps
            density = c["pairs"] / (steps * TILE * BLOCK)
            parts.append(
                f"{kernel}: {programs} programs, {steps / programs:.1f} steps each, "
                f"{us_per_step:.2f} us/step/SM, allowed density {density:.2f}"
            )
        print(f"{name:8s} " + " | ".join(parts))
    if len(counts) < 3:
        return
    for kernel in ("dq", "dk/dv"):
        a = np.array([[c[kernel][0] / SMS, c[kernel][1] / SMS] for c in counts.values()])
        y = np.array([tuned[name][kernel] * 1e3 for name in counts])
        (fixed, per_step), *_ = np.linalg.lstsq(a, y, rcond=None)
        fit = a @ np.array([fixed, per_step])
        shares = ", ".join(
            f"{name} {100 * a[i, 0] * fixed / y[i]:.0f}% (fit {100 * (fit[i] / y[i] - 1):+.0f}%)"
            for i, name in enumerate(counts)
        )
        print(
            f"{kernel}: fixed {fixed:.1f} us/program, {per_step:.2f} us/step; fixed share {shares}"
        )


if __name__ == "__main__":
    main()
