"""What the phoenix forward's half-padding candidate tile costs (H200).

The phoenix layout (S=1152, history [0, 1024), candidates [1024, 1088)) leaves the last
128-row query tile half padding, so one of its two compute warpgroups idles. This times
the forward (tuned config, CUPTI median) with the candidates ending at 1024 (no
candidate tile), 1088 (the suite: one live half) and 1152 (both halves live), same
inputs, same process. The lone half's cost relative to a full tile's says how much an
idle-free schedule could save at most.

    python benchmarks/ranker_lone_tile_cost.py --out docs/results

Writes ``ranker_lone_tile_cost.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from attn_common import ranker_case
from attn_common.cli_args import provenance
from attn_mosaic_gpu.bench import device_ms


def main() -> None:
    from attn_mosaic_gpu import ranker_attention

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    case = ranker_case("phoenix")
    b = case.batch
    q, k, v, _ = case.inputs()
    rows = []
    for repeat in range(2):  # twice, interleaved, to see the run-to-run spread
        for cand_end in (1024, 1088, 1152):
            bounds = jnp.tile(jnp.array([[0, 1024, 1024, cand_end]], jnp.int32), (b, 1))
            fn = jax.jit(functools.partial(ranker_attention, bounds=bounds, cap=case.cap))
            ms, method = device_ms(fn, q, k, v, iterations=args.iterations)
            row = {"repeat": repeat, "candidates_end": cand_end, "ms": ms, "timing": method}
            print(row, flush=True)
            rows.append(row)
    by_end = {e: min(r["ms"] for r in rows if r["candidates_end"] == e) for e in (1024, 1088, 1152)}
    summary = {
        "lone_half_tile_ms": by_end[1088] - by_end[1024],
        "full_candidate_tile_ms": by_end[1152] - by_end[1024],
    }
    summary["lone_over_full"] = summary["lone_half_tile_ms"] / summary["full_candidate_tile_ms"]
    print(summary)
    report = {**provenance(), "device": jax.devices()[0].device_kind, "rows": rows, **summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ranker_lone_tile_cost.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
