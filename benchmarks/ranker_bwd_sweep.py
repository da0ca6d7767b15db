"""Per-kernel timing of the Hopper ranker backward under its schedule knobs (H200).

For each suite case given (docs/design.md#benchmarks; default: phoenix, long, ragged),
times the dq and dk/dv kernels of ``attn_mosaic_gpu.ranker_bwd_pipelined`` separately
(CUPTI, median of iterations) for each variant of the knobs ``fold`` (folded cap
constants, derivative from the same terms), ``overlap`` (P computed while dP's wgmma
runs; dS while dV's runs), ``num_stages`` (ring depth) and ``dq_programs`` (persistent
dq programs, one per SM, that load the next tile's fixed operands during the current
one). Inputs: random bf16 q, k, v, dO; the LSE from our forward kernel, so the
probabilities are the real ones.

    python benchmarks/ranker_bwd_sweep.py --out docs/results
    python benchmarks/ranker_bwd_sweep.py --cases phoenix --variants '*overlap*'

Writes ``ranker_bwd_sweep.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from fnmatch import fnmatch
from pathlib import Path

import jax
import jax.numpy as jnp

from attn_common import ranker_case, ranker_flops
from attn_common.cli_args import provenance
from attn_mosaic_gpu.ranker_bwd_pipelined import (
    DKV_KERNEL,
    DQ_KERNEL,
    pipelined_bwd,
    pipelined_stages,
)
from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd
from attn_mosaic_gpu.tuning import lookup

VARIANTS = {
    "plain, 3 stages": {"fold": False, "overlap": False, "num_stages": 3},
    "fold, 3 stages": {"fold": True, "overlap": False, "num_stages": 3},
    "fold, 2 stages": {"fold": True, "overlap": False, "num_stages": 2},
    "fold + overlap, 3 stages": {"fold": True, "overlap": True, "num_stages": 3},
    "fold + overlap, 2 stages": {"fold": True, "overlap": True, "num_stages": 2},
    # dq_programs None: one persistent dq program per SM of the device
    "fold + overlap, 2 stages, persistent dq": {
        "fold": True, "overlap": True, "num_stages": 2, "dq_programs": None,
    },
}  # fmt: skip
KERNELS = {DQ_KERNEL: "dq", DKV_KERNEL: "dk/dv"}


def kernel_label(cuda_name: str) -> str:
    """``dq`` / ``dk/dv`` for the backward kernels (CUDA name ``<name>_mosaic_gpu``),
    else the CUDA name. By name, not launch position: XLA may launch the two
    independent kernels in either order (it did: runs before 2026-12-01 swapped them)."""
    for name, label in KERNELS.items():
        if cuda_name.startswith(name):
            return label
    return cuda_name


def kernel_ms(fn, *args, iterations):
    """Median time per kernel, keyed by ``kernel_label``."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
    by_kernel: dict[str, list[float]] = {}
    for timings in per_iter:
        for name, ms in timings:
            by_kernel.setdefault(kernel_label(name), []).append(ms)
    return {label: statistics.median(v) for label, v in by_kernel.items()}


def run_case(name, iterations, patterns=None):
    case = ranker_case(name)
    b, s, hq, hkv, d = case.batch, case.seq_len, case.q_heads, case.kv_heads, case.head_dim
    assert s % 128 == 0, s
    q, k, v, do = case.inputs()
    bounds_np = case.bounds(seed=0)
    bounds = jnp.asarray(bounds_np, jnp.int32)
    sm_scale = 1.0 / math.sqrt(d)
    out, lse = ranker_attention_fwd(q, k, v, bounds, cap=case.cap, return_lse=True)
    delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), do.astype(jnp.float32))
    lse2 = jnp.where(jnp.isfinite(lse), lse * math.log2(math.e), jnp.inf)
    fields = dict(
        batch=b, seq_pad=s, q_heads=hq, kv_heads=hkv, head_dim=d, sm_scale=sm_scale, cap=case.cap
    )
    flops_bwd = 2.5 * ranker_flops(bounds_np, hq, d)
    rows = []
    tuned = lookup(head_dim=d, dtype=q.dtype, cap=case.cap, seq_len=s).backward.knobs()
    variants = {**VARIANTS, "tuned table (default)": {"num_stages": pipelined_stages(d), **tuned}}
    if patterns:
        variants = {k: t for k, t in variants.items() if any(fnmatch(k, p) for p in patterns)}
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    for label, tuning in variants.items():
        if tuning.get("dq_programs", 0) is None:
            tuning = {**tuning, "dq_programs": sms}

        def bwd(q, k, v, do, lse2, delta, bounds, tuning=tuning):
            return pipelined_bwd(
                q, k, v, do, lse2, delta, bounds, st_fields=fields, interpret=None, tuning=tuning
            )

        fn = jax.jit(bwd)
        times = kernel_ms(fn, q, k, v, do, lse2, delta, bounds, iterations=iterations)
        total = sum(times.values())
        row = {
            "case": name,
            "variant": label,
            "num_stages": tuning["num_stages"],
            "knobs": tuning,
            "kernels_ms": times,
            "total_ms": total,
            "bwd_effective_tflops": flops_bwd / total * 1e-9,  # ms -> TFLOP/s
        }
        rows.append(row)
        parts = ", ".join(f"{n}: {t:.3f}" for n, t in times.items())
        print(f"{name:8s} {label:30s} total {total:.3f} ms ({parts})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--cases", nargs="*", default=["phoenix", "long", "ragged"])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument(
        "--variants", nargs="*", default=None, help="globs of variant names (default: all)"
    )
    args = parser.parse_args()
    print(f"defaults: fold and overlap on; stages {pipelined_stages(128)} (D=128)")
    rows = []
    for name in args.cases:
        rows += run_case(name, args.iterations, args.variants)
    device = jax.devices()[0].device_kind
    data = {**provenance(), "device": device, "jax": jax.__version__, "rows": rows}
    print(write_reports(data, args.out))


def write_reports(data: dict, out: Path) -> str:
    """Write ``ranker_bwd_sweep.json`` and ``.md`` (commit, command and date first; dq
    before dk/dv) into ``out`` from a run's ``data``; return the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranker_bwd_sweep.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [
        f"# Ranker backward kernels by schedule knob ({data['device']}, jax {data['jax']})",
        "",
        f"Commit {data['commit']}; command: `{data['command']}`; date {data['date']}.",
        "",
        "CUPTI median per kernel, kernels told apart by their CUDA names; backward only "
        "(no forward, no XLA delta); effective TFLOP/s = 2.5 x forward FLOPs over allowed "
        "pairs / kernel time. The last row of each case is what `config=None` runs.",
        "",
        "| case | variant | stages | kernels (ms) | total (ms) | bwd TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    order = {label: i for i, label in enumerate(KERNELS.values())}
    for r in data["rows"]:
        kernels = sorted(r["kernels_ms"].items(), key=lambda kv: order.get(kv[0], len(order)))
        parts = "; ".join(f"{n}: {t:.3f}" for n, t in kernels)
        lines.append(
            f"| {r['case']} | {r['variant']} | {r['num_stages']} | {parts} | "
            f"{r['total_ms']:.3f} | {r['bwd_effective_tflops']:.0f} |"
        )
    if data.get("note"):
        lines += ["", data["note"]]
    text = "\n".join(lines) + "\n"
    (out / "ranker_bwd_sweep.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
