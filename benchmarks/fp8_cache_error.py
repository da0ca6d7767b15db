"""The FP8 latent cache's error against bf16, measured on the CPU (no accelerator).

For each data kind (standard normal; Student-t with 2 degrees of freedom, heavy-tailed;
a normal cache with a few outlier channels ten times larger), a cache of ``--tokens``
tokens x 576 float32 values is stored as bf16 and as FP8 (``quantize_latent_cache``) and
read back. Reported, against the float32 values:

* the stored latent values (the 512 quantized ones): relative L2 error, the largest
  error over the largest magnitude of its 128-group, and the median relative error of
  a value (small values next to a large one in their group lose the most);
* sparse MLA over that cache (``attn_reference``, token-level, ``--queries`` queries of
  ``--heads`` heads, each attending ``--top-k`` random distinct tokens, the query drawn
  normal): relative L2 error of the output against the float32 cache and query (the
  bf16 and FP8 runs both cast the query to bf16, the compute dtype of both caches).

Writes ``<out>/fp8_cache_error.json`` and ``.md``; docs/fp8_cache.md quotes the table.
Run: ``JAX_PLATFORMS=cpu python benchmarks/fp8_cache_error.py --out docs/results``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.fp8_cache import (
    GROUP,
    GROUPS,
    LATENT,
    dequantize_latent_cache,
    quantize_latent_cache,
)
from attn_reference import sparse_mla_attention

DK = 576


def cache_values(kind: str, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """``[tokens, 576]`` float32 values of one data kind."""
    if kind == "normal":
        return rng.standard_normal((tokens, DK)).astype(np.float32)
    if kind == "student-t2":
        return rng.standard_t(2, size=(tokens, DK)).astype(np.float32)
    if kind == "outlier-channels":
        x = rng.standard_normal((tokens, DK)).astype(np.float32)
        channels = rng.choice(LATENT, size=8, replace=False)
        x[:, channels] *= 10.0
        return x
    raise ValueError(f"kind: got {kind!r}, expected normal, student-t2 or outlier-channels")


KINDS = ("normal", "student-t2", "outlier-channels")


def _rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm((got - want).ravel()) / np.linalg.norm(want.ravel()))


def _group_max_err(got: np.ndarray, want: np.ndarray) -> float:
    """max over groups of max |err| / max |value| in the group (latent values only)."""
    err = np.abs(got[:, :LATENT] - want[:, :LATENT]).reshape(-1, GROUPS, GROUP).max(-1)
    top = np.abs(want[:, :LATENT]).reshape(-1, GROUPS, GROUP).max(-1)
    return float((err / np.where(top > 0, top, 1)).max())


def _median_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """The median over latent values of |err| / |value| (nonzero values)."""
    got, want = got[:, :LATENT], want[:, :LATENT]
    nonzero = want != 0
    return float(np.median(np.abs(got - want)[nonzero] / np.abs(want)[nonzero]))


def measure(kind: str, *, tokens: int, queries: int, heads: int, top_k: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    x = cache_values(kind, tokens, rng)
    fp8 = quantize_latent_cache(jnp.asarray(x))
    as_bf16 = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    as_fp8 = np.asarray(dequantize_latent_cache(fp8))
    q = rng.standard_normal((1, queries, heads, DK)).astype(np.float32)
    idx = np.stack([rng.choice(tokens, size=top_k, replace=False) for _ in range(queries)])
    idx = idx[None].astype(np.int32)
    pos = np.full((1, queries), tokens - 1, np.int32)
    kw = dict(sm_scale=1 / math.sqrt(DK), read_block=1)
    out32 = np.asarray(sparse_mla_attention(q, jnp.asarray(x)[None], idx, pos, **kw))
    out16 = np.asarray(
        sparse_mla_attention(q, jnp.asarray(x).astype(jnp.bfloat16)[None], idx, pos, **kw)
    )
    out8 = np.asarray(sparse_mla_attention(q, fp8.reshape(1, tokens), idx, pos, **kw))
    return {
        "data": kind,
        "latent_rel_l2": {"bf16": _rel_l2(as_bf16[:, :LATENT], x[:, :LATENT]),
                          "fp8": _rel_l2(as_fp8[:, :LATENT], x[:, :LATENT])},
        "latent_median_rel_err": {"bf16": _median_rel_err(as_bf16, x),
                                  "fp8": _median_rel_err(as_fp8, x)},
        "latent_max_err_over_group_max": {"bf16": _group_max_err(as_bf16, x),
                                          "fp8": _group_max_err(as_fp8, x)},
        "out_rel_l2": {"bf16": _rel_l2(out16, out32), "fp8": _rel_l2(out8, out32)},
    }  # fmt: skip


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(rows: list[dict]) -> str:
    """The Markdown table docs/fp8_cache.md quotes."""
    lines = [
        "| data | latent rel. L2, bf16 | latent rel. L2, FP8 | max err / group max, bf16 "
        "| max err / group max, FP8 | median rel. err, bf16 | median rel. err, FP8 "
        "| output rel. L2, bf16 | output rel. L2, FP8 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["latent_rel_l2"], r["latent_max_err_over_group_max"], r["latent_median_rel_err"],
            r["out_rel_l2"],
        ]  # fmt: skip
        nums = " | ".join(f"{c['bf16']:.2e} | {c['fp8']:.2e}" for c in cells)
        lines.append(f"| {r['data']} | {nums} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = [
        measure(kind, tokens=args.tokens, queries=args.queries, heads=args.heads,
                top_k=args.top_k, seed=args.seed + i)
        for i, kind in enumerate(KINDS)
    ]  # fmt: skip
    command = (
        "JAX_PLATFORMS=cpu python benchmarks/fp8_cache_error.py"
        f" --tokens {args.tokens} --queries {args.queries} --heads {args.heads}"
        f" --top-k {args.top_k} --seed {args.seed}"
    )
    result = {
        "commit": _commit(),
        "command": command,
        "jax": jax.__version__,
        "shape": {"tokens": args.tokens, "queries": args.queries, "heads": args.heads,
                  "top_k": args.top_k},
        "rows": rows,
    }  # fmt: skip
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_cache_error.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "fp8_cache_error.md").write_text(
            f"# FP8 latent cache error vs bf16\n\nCommit {result['commit']}, jax {result['jax']}"
            f", `{command}`.\n\n{text}\n"
        )
    return result


if __name__ == "__main__":
    main()
