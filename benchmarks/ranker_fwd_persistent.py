"""Hopper ranker forward: one program per tile against persistent programs (H200).

For each suite case, the tuned config (what ``config=None`` runs) with
``programs=0`` (one program per query tile, the default) and ``programs=N`` (``N``
persistent programs walking the tiles; one per SM by default), CUPTI device time,
median of iterations, same inputs, same run; the outputs of the two compared bitwise::

    python benchmarks/ranker_fwd_persistent.py --out DIR [--cases phoenix small-d64]

Writes ``ranker_fwd_persistent.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import ranker_case, ranker_flops
from attn_common.cli_args import provenance
from attn_mosaic_gpu.bench import device_ms


def time_case(name: str, programs: list[int], iterations: int) -> list[dict]:
    """The case's forward at each ``programs`` value (the tuned config otherwise)."""
    from attn_mosaic_gpu.ranker import resolve_tuning
    from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd

    case = ranker_case(name)
    hq, d = case.q_heads, case.head_dim
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), hq, d)
    tuned = resolve_tuning(q, case.cap, None, None)[0]
    rows, first = [], None
    for n in programs:
        config = tuned.replace(programs=n)
        fn = jax.jit(
            functools.partial(ranker_attention_fwd, cap=case.cap, config=config, return_lse=True)
        )
        ms, method = device_ms(fn, q, k, v, bounds, iterations=iterations)
        out = [np.asarray(x) for x in fn(q, k, v, bounds)]
        row = {"case": name, "programs": n, "config": repr(config), "ms": ms,
               "tflops": flops / ms / 1e9, "timing": method}  # fmt: skip
        if first is None:
            first = out
        else:
            row["bitwise_equal_to_first"] = all(
                np.array_equal(a, b) for a, b in zip(out, first, strict=True)
            )
        print(row, flush=True)
        rows.append(row)
    return rows


def write_reports(data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranker_fwd_persistent.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [
        f"Commit {data.get('commit')} ({data['device']}); command: `{data['command']}`.",
        "",
        "Forward only, bf16, tuned config, CUPTI median; effective TFLOP/s (allowed pairs).",
        "",
        "| case | programs | ms | TFLOP/s | bitwise equal to programs=0 |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        equal = r.get("bitwise_equal_to_first", "")
        lines.append(
            f"| {r['case']} | {r['programs'] or 'one per tile'} | {r['ms']:.3f} | "
            f"{r['tflops']:.0f} | {equal} |"
        )
    (out / "ranker_fwd_persistent.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="*", default=["phoenix", "long", "small-d64", "ragged"])
    parser.add_argument("--programs", type=int, nargs="*", default=None,
                        help="persistent program counts (default: the SM count)")  # fmt: skip
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    programs = [0, *(args.programs or [sms])]
    rows = []
    for name in args.cases:
        rows += time_case(name, programs, args.iterations)
    data = {
        **provenance(),
        "device": jax.devices()[0].device_kind,
        "command": "ranker_fwd_persistent.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    write_reports(data, args.out)


if __name__ == "__main__":
    main()
