"""HBM traffic, DMA count and a modelled TPU time of the two sparse-MLA prefill kernels.

No TPU is needed: the numbers come from the tables the kernels would walk. For an
indexer-like selection pattern (attention sinks + a local window + scattered
mid-context picks that adjacent queries mostly share) the script builds the per-query
unit lists and, with ``attn_common.build_block_unit_tables``, the per-block unions of the
query-blocked kernel, and counts

* per-query kernel: one DMA of ``read_block x Dk_pad`` bf16 per (query, distinct unit);
* query-blocked kernel: one DMA per (block, union unit, head group).

Run (CPU, about a minute)::

    PYTHONPATH=common/src:packages/attn-pallas-tpu/src \\
        python packages/attn-pallas-tpu/scripts/measure_dma.py --write-docs

``--write-docs`` replaces the generated section of ``docs/tpu_sparse_mla.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import build_block_unit_tables, lossless_u_max

DK_PAD, DV, ITEMSIZE = 640, 512, 2  # bf16 latent cache rows: 576 features padded to 640
SELECTED_TOKENS = 2048
CHUNK = 4096  # prefill queries per layer call: one 4K-token chunk at the end of the context
SINK_TOKENS, LOCAL_TOKENS = 128, 512
CONTEXTS = (16 * 1024, 64 * 1024, 110 * 1024)
UNITS = (64, 128)
QUERY_BLOCK = 256
MAX_ROWS = 4096  # the kernel's default cap on Hb * QB score rows per program
NBUF = 4
DOC = Path(__file__).resolve().parents[3] / "docs" / "tpu_sparse_mla.md"
BEGIN, END = "<!-- measure_dma:begin -->", "<!-- measure_dma:end -->"


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes_per_s: float
    mxu_flops: float  # bf16 peak, whole chip
    mxu_dim: int  # systolic array edge: a matmul with fewer LHS rows runs at rows/dim
    vpu_ops: float  # float32 elementwise ops per second, whole chip
    cores: int  # TensorCores sharing the 'parallel' grid


# Public peak numbers; the VPU rate is a rough assumption (4 VALU slots x 1024 lanes x clock).
CHIPS = (
    Chip("v5p", 2.765e12, 459e12, 128, 2 * 4 * 1024 * 1.75e9, 2),
    Chip("v6e", 1.640e12, 918e12, 256, 4 * 1024 * 1.5e9, 1),
)
DMA_LATENCY = 1.5e-6  # per DMA issue->complete, latency bound for one page-sized copy
STEP_OVERHEAD = 0.35e-6  # per grid step
VPU_OPS_PER_SCORE = 16  # mask build, select, max, sub, exp, sum, cast per score element


def selections(context: int, unit: int, churn: float, seed: int = 0) -> np.ndarray:
    """Request-local unit ids ``[CHUNK, K]`` for the last CHUNK queries of ``context``.

    Sinks: the units of the first SINK_TOKENS tokens. Local: the LOCAL_TOKENS / unit
    units ending with the query's own unit. The remaining picks are scattered over the middle of the context and
    follow a Markov chain along the queries: each pick is kept from the previous query
    and replaced, with probability ``churn``, by a fresh uniformly random mid-context unit.
    """
    rng = np.random.default_rng(seed)
    top_k = SELECTED_TOKENS // unit
    sinks = np.arange(-(-SINK_TOKENS // unit))
    out = np.full((CHUNK, top_k), -1, np.int64)
    picks = None
    for i, pos in enumerate(range(context - CHUNK, context)):
        local = np.arange(pos // unit - LOCAL_TOKENS // unit + 1, pos // unit + 1)
        lo, hi = len(sinks), max(len(sinks) + 1, local[0])  # mid-context unit range
        n_mid = top_k - len(sinks) - len(local)
        if picks is None:
            picks = rng.choice(np.arange(lo, hi), size=n_mid, replace=False)
        replace = rng.random(n_mid) < churn
        if replace.any():
            fresh = rng.integers(lo, hi, size=int(replace.sum()))
            picks = picks.copy()
            picks[replace] = fresh
        row = np.concatenate([sinks, local, picks])
        out[i, : len(row)] = row[:top_k]
    return out.astype(np.int32)


@dataclasses.dataclass
class Traffic:
    dmas: int
    kv_bytes: int
    programs: int
    rows: int  # score rows per program
    other_bytes: int  # q, out, lse, tables


def per_query_traffic(sel: np.ndarray, unit: int, heads: int) -> Traffic:
    counts = np.array([len(np.unique(r[r >= 0])) for r in sel])  # distinct valid units
    dmas = int(counts.sum())
    n = sel.shape[0]
    other = n * heads * (DK_PAD * ITEMSIZE + DV * 4 + 4) + n * sel.shape[1] * 8
    return Traffic(dmas, dmas * unit * DK_PAD * ITEMSIZE, n, heads, other)


def qblock_traffic(sel: np.ndarray, unit: int, heads: int, num_units: int, qb: int) -> Traffic:
    top_k = sel.shape[1]
    u_max = lossless_u_max(qb, top_k, num_units)
    tables = jax.jit(lambda s: build_block_unit_tables(s, query_block=qb, u_max=u_max).counts)(
        jnp.asarray(sel)
    )
    unions = np.asarray(tables)
    hb = max(d for d in range(1, heads + 1) if heads % d == 0 and d * qb <= MAX_ROWS)
    groups = heads // hb
    dmas = int(unions.sum()) * groups
    n_blocks = len(unions)
    u_pad = -(-u_max // 32) * 32
    n = sel.shape[0]
    other = n * heads * (DK_PAD * ITEMSIZE + DV * 4 + 4) + n_blocks * (
        u_pad * qb + 8 * u_pad + qb * 4
    )
    return Traffic(dmas, dmas * unit * DK_PAD * ITEMSIZE, n_blocks * groups, hb * qb, other)


def modelled_time(t: Traffic, unit: int, chip: Chip) -> float:
    """Seconds per layer: per program, the prologue latency plus, per unit, the slowest of
    compute (MXU + VPU), the unit's transfer and the DMA issue rate of the ring."""
    per_unit_bytes = unit * DK_PAD * ITEMSIZE
    units_per_program = t.dmas / t.programs
    mxu_eff = min(1.0, t.rows / chip.mxu_dim)
    flops = 2 * unit * t.rows * (DK_PAD + DV)
    t_mxu = flops / (chip.mxu_flops * mxu_eff) * chip.cores  # one core's share of the chip
    t_vpu = VPU_OPS_PER_SCORE * unit * t.rows / chip.vpu_ops * chip.cores
    t_dma = max(per_unit_bytes / chip.hbm_bytes_per_s, DMA_LATENCY / (NBUF - 1))
    per_program = DMA_LATENCY + STEP_OVERHEAD + units_per_program * max(t_mxu + t_vpu, t_dma)
    compute_bound = t.programs * per_program / chip.cores
    hbm_bound = (t.kv_bytes + t.other_bytes) / chip.hbm_bytes_per_s
    return max(compute_bound, hbm_bound)


def fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def measure(heads_list=(16, 128), churns=(0.02,), qb: int = QUERY_BLOCK) -> list[str]:
    lines = []
    for churn in churns:
        for heads in heads_list:
            lines += [
                "",
                f"**H = {heads}, QB = {qb}, churn = {churn:.1%}** (a query replaces each "
                f"mid-context pick of the previous query with probability {churn:.1%})",
                "",
                "| context | unit x K | mean union / block | per-query KV bytes | qblock KV bytes "
                "| bytes ratio | per-query DMAs | qblock DMAs | v5p per-query | v5p qblock "
                "| v6e per-query | v6e qblock |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for context in CONTEXTS:
                for unit in UNITS:
                    sel = selections(context, unit, churn)
                    num_units = -(-context // unit)
                    pq = per_query_traffic(sel, unit, heads)
                    bl = qblock_traffic(sel, unit, heads, num_units, qb)
                    groups = bl.programs // (CHUNK // qb)
                    union = bl.dmas / groups / (CHUNK // qb)
                    times = [modelled_time(t, unit, c) for c in CHIPS for t in (pq, bl)]
                    lines.append(
                        f"| {context // 1024}K | {unit} x {SELECTED_TOKENS // unit} | {union:.0f} "
                        f"| {fmt_bytes(pq.kv_bytes)} | {fmt_bytes(bl.kv_bytes)} "
                        f"| {pq.kv_bytes / bl.kv_bytes:.0f}x | {pq.dmas} | {bl.dmas} | "
                        + " | ".join(f"{x * 1e3:.2f} ms" for x in times)
                        + " |"
                    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOC}")
    args = parser.parse_args()
    lines = [
        BEGIN,
        "",
        "Generated by `PYTHONPATH=common/src:packages/attn-pallas-tpu/src python "
        "packages/attn-pallas-tpu/scripts/measure_dma.py --write-docs` "
        f"(one layer; {CHUNK} prefill queries at the end of the context; "
        f"{SELECTED_TOKENS} selected tokens per query; sinks {SINK_TOKENS} tokens, local "
        f"window {LOCAL_TOKENS} tokens, the rest scattered; QB = {QUERY_BLOCK}; "
        f"head groups of at most {MAX_ROWS} score rows; bf16 cache rows of {DK_PAD} "
        "features).",
    ]
    lines += measure(heads_list=(16, 128), churns=(0.02,))
    lines += ["", "H = 128 with a smaller query block (fewer masked scores per fetched unit):"]
    lines += measure(heads_list=(128,), churns=(0.02,), qb=64)
    lines += ["", "Sensitivity to the correlation between adjacent queries (H = 16):"]
    lines += measure(heads_list=(16,), churns=(0.005, 0.05, 0.2))
    lines += ["", END]
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        doc = DOC.read_text()
        pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
        if not pattern.search(doc):
            raise SystemExit(f"{DOC}: markers {BEGIN} / {END} not found")
        DOC.write_text(pattern.sub(lambda _: text, doc))
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
