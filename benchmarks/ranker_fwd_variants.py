"""A/B of the Hopper ranker forward's softmax formulations at the suite shapes (H200).

``max_on_raw`` (the kernel's default): the row max runs on the raw scores and each
exponent is one FMA after the cap's last multiply; ``False``: the max runs on the capped
base-2 logits (the earlier formulation, one more multiply and a subtract per score).
CUPTI device time, median of iterations, same inputs, same run.

Usage: ``python benchmarks/ranker_fwd_variants.py --out DIR`` writes
``ranker_fwd_variants.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from attn_common import ranker_case, ranker_flops
from attn_common.cli_args import provenance
from attn_mosaic_gpu.bench import device_ms


def main() -> None:
    from attn_mosaic_gpu import ranker_fwd

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--cases", nargs="*", default=["phoenix", "long", "small-d64"])
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    static = ranker_fwd._Static
    rows = []
    for name in args.cases:
        case = ranker_case(name)
        hq, d = case.q_heads, case.head_dim
        q, k, v, _ = case.inputs()
        bounds = case.bounds()
        flops = ranker_flops(bounds, hq, d)
        for max_on_raw in (True, False):
            ranker_fwd._Static = functools.partial(static, max_on_raw=max_on_raw)
            try:
                fn = jax.jit(functools.partial(ranker_fwd.ranker_attention_fwd, cap=case.cap))
                ms, method = device_ms(fn, q, k, v, jnp.asarray(bounds), iterations=args.iterations)
            finally:
                ranker_fwd._Static = static
            row = {"case": name, "max_on_raw": max_on_raw, "ms": ms, "timing": method,
                   "tflops": flops / ms / 1e9}  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    report = {**provenance(), "device": jax.devices()[0].device_kind, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ranker_fwd_variants.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
