"""Where the Hopper ranker forward spends its time: a config and cap sweep (H200).

For the phoenix, long and small-d64 shapes, times the forward kernel over tilings
(block_kv, num_stages) with the case's own cap and with no cap, plus JAX's dense FA3 on
the same shape (bf16 inputs cast to fp16) as the unmasked, uncapped speed. Device time
from CUPTI, median of iterations (``benchmarks/ranker_gpu.py``'s ``device_ms``).

Usage: ``python benchmarks/ranker_sweep.py --out DIR`` writes ``ranker_sweep.json`` / ``.md``
(default ``attn-results/ranker_sweep``). The shipped tilings come from ``attn tune``
(docs/ranker_gpu.md, "Tuned configs"); this sweep's last committed run (a18cffc, before
the tuned table) is in git history.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from ranker_gpu import device_ms

from attn_common import CapParams, KernelConfig, ranker_case, ranker_flops
from attn_common.cli_args import provenance

CONFIGS = {
    128: [(64, 128, 2), (64, 64, 2), (64, 64, 3), (64, 64, 4), (64, 192, 2)],
    64: [(64, 128, 4), (64, 128, 2), (64, 64, 4), (64, 256, 2)],
}


def main() -> None:
    import attn_mosaic_gpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("attn-results/ranker_sweep"))
    parser.add_argument("--cases", nargs="*", default=["phoenix", "long", "small-d64"])
    args = parser.parse_args()
    rows = []
    for name in args.cases:
        case = ranker_case(name)
        b, s, hq, d = case.batch, case.seq_len, case.q_heads, case.head_dim
        q, k, v, _ = case.inputs()
        bounds = case.bounds()
        flops = ranker_flops(bounds, hq, d)
        bdev = jnp.asarray(bounds)
        for bq, bkv, stages in CONFIGS[d]:
            for cap_name, cap in (("case", case.cap), ("none", CapParams())):
                if cap_name == "none" and not case.cap.active:
                    continue
                cfg = KernelConfig(block_q=bq, block_kv=bkv, num_stages=stages)
                try:
                    fn = jax.jit(
                        lambda q, k, v, b, cfg=cfg, cap=cap: attn_mosaic_gpu.ranker_attention(
                            q, k, v, b, cap=cap, config=cfg
                        )
                    )
                    ms, _ = device_ms(fn, q, k, v, bdev, iterations=20)
                    row = {"ms": ms, "tflops": flops / ms / 1e9}
                except Exception as e:
                    row = {"ms": None, "tflops": None, "error": f"{type(e).__name__}: {e}"[:200]}
                row.update(case=name, config=f"{bq}/{bkv}/{stages}", cap=cap_name)
                rows.append(row)
                print(row, flush=True)
        try:
            from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3

            cfg = fa3.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
            f16 = [x.astype(jnp.float16) for x in (q, k, v)]
            ms, _ = device_ms(jax.jit(lambda q, k, v, cfg=cfg: fa3.attention(q, k, v, cfg)), *f16)
            rows.append(
                {
                    "case": name,
                    "config": "fa3 64/128/2",
                    "cap": "none, dense",
                    "ms": ms,
                    "tflops": 4.0 * b * hq * s * s * d / ms / 1e9,
                }
            )
            print(rows[-1], flush=True)
        except Exception as e:
            print(f"fa3 failed: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    # The rows with the commit and command they were measured at.
    report = {"provenance": provenance(), "rows": rows}
    (args.out / "ranker_sweep.json").write_text(json.dumps(report, indent=2))
    lines = [
        "| case | block_q/block_kv/stages | cap | ms | effective TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") else "failed: " + r.get("error", "")[:60]
        tf = f"{r['tflops']:.0f}" if r.get("tflops") else ""
        lines.append(f"| {r['case']} | {r['config']} | {r['cap']} | {ms} | {tf} |")
    (args.out / "ranker_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
