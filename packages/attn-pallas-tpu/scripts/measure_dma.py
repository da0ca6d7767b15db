"""HBM traffic, DMA count and modelled TPU time of the sparse-MLA prefill kernels.

No TPU is needed: for synthetic index families the script counts what each kernel
would fetch (per query its distinct units; per query block the union, with
``attn_pallas_tpu.plan.block_union_sizes``) and feeds the counts to the cost
model of ``attn_pallas_tpu.plan`` (the one copy of the model; its docstring
lists every assumption). For each family, head count, context and unit size it
reports the per-query kernel, the query-blocked kernel at a fixed ``QB = 256`` with
the kernel's default head grouping, and the plan ``choose_plan`` picks per chip.

Index families (one generator function each, all ``(context, unit, seed) -> [CHUNK, K]``
request-local unit ids for the last ``CHUNK`` queries of the context; every family
selects the attention sinks and the local window, and differs only in how the
remaining "far" picks are drawn): :func:`markov`, :func:`high_churn`,
:func:`uniform_far`, :func:`zipf_far`, :func:`near_decay`.

Run (CPU, about 10 seconds; `--contexts 16 64 110` adds 64K)::

    PYTHONPATH=common/src:packages/attn-pallas-tpu/src \\
        python packages/attn-pallas-tpu/scripts/measure_dma.py --write-docs

``--write-docs`` replaces the generated section of ``docs/tpu_sparse_mla.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.tables import resolve_u_max
from attn_pallas_tpu.plan import (
    TPU_CHIPS,
    PlanShape,
    SparseMlaPlan,
    block_union_sizes,
    choose_plan,
    distinct_units_per_query,
    predict_per_query,
    predict_qblock,
    static_qblock_config,
)

DK_PAD, DV, ITEMSIZE = 640, 512, 2  # bf16 latent cache rows: 576 features padded to 640
SELECTED_TOKENS = 2048
CHUNK = 4096  # prefill queries per layer call: one 4K-token chunk at the end of the context
SINK_TOKENS, LOCAL_TOKENS = 128, 512
CONTEXTS = (16 * 1024, 110 * 1024)
UNITS = (64, 128)
HEADS = (16, 128)
FIXED_QUERY_BLOCK = 256
QUERY_BLOCKS = (8, 16, 32, 64, 128, 256)  # candidates of the auto plan
MAX_ROWS = 4096  # the kernel's default cap on Hb * QB score rows per program
MARKOV_CHURN, HIGH_CHURN = 0.02, 0.5
ZIPF_EXPONENT = 1.1
DECAY_TOKENS = 4096  # near_decay: mean distance (tokens) of a near pick before the window
FAR_FRACTION = 0.05  # near_decay: share of the far picks drawn uniformly instead
CHIP_NAMES = ("v5e", "v5p", "v6e")
DOC = Path(__file__).resolve().parents[3] / "docs" / "tpu_sparse_mla.md"
BEGIN, END = "<!-- measure_dma:begin -->", "<!-- measure_dma:end -->"


# --------------------------------------------------------------------------------------
# Index families


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the picks of each query may fall (request-local unit ids)."""

    top_k: int
    sinks: np.ndarray  # [n_sinks] units of the first SINK_TOKENS tokens
    local: np.ndarray  # [CHUNK, n_local] the local window, ending with the query's unit
    mid_lo: int  # far picks lie in [mid_lo, mid_hi[q])
    mid_hi: np.ndarray  # [CHUNK]
    n_far: int  # far picks per query


def layout(context: int, unit: int) -> Layout:
    top_k = SELECTED_TOKENS // unit
    sinks = np.arange(-(-SINK_TOKENS // unit))
    n_local = LOCAL_TOKENS // unit
    own = np.arange(context - CHUNK, context) // unit
    local = own[:, None] + np.arange(-n_local + 1, 1)[None, :]
    mid_hi = np.maximum(len(sinks) + 1, local[:, 0])
    return Layout(top_k, sinks, local, len(sinks), mid_hi, top_k - len(sinks) - n_local)


def assemble(lay: Layout, far: np.ndarray) -> np.ndarray:
    """``[CHUNK, K]`` int32: sinks, local window, far picks."""
    sinks = np.broadcast_to(lay.sinks, (CHUNK, len(lay.sinks)))
    rows = np.concatenate([sinks, lay.local, far], axis=1)[:, : lay.top_k]
    return rows.astype(np.int32)


def _top_far(lay: Layout, score: np.ndarray) -> np.ndarray:
    """Per query the ``n_far`` mid-context units of largest ``score`` (``[CHUNK, n_mid]``
    over units ``mid_lo + j``); units at or past the query's window are excluded.
    With ``score = log(weight) + Gumbel noise`` this samples without replacement with
    probabilities proportional to ``weight`` (the Gumbel top-k trick)."""
    units = lay.mid_lo + np.arange(score.shape[1])
    score = np.where(units[None, :] < lay.mid_hi[:, None], score, -np.inf)
    idx = np.argpartition(-score, lay.n_far - 1, axis=1)[:, : lay.n_far]
    return lay.mid_lo + idx


def _gumbel(rng: np.random.Generator, shape) -> np.ndarray:
    return -np.log(-np.log(rng.random(shape, dtype=np.float32) + 1e-12) + 1e-12)


def markov(context: int, unit: int, seed: int = 0, *, churn: float = MARKOV_CHURN) -> np.ndarray:
    """Sinks + local window + mid-context picks shared along a Markov chain (churn 2%).

    The first query draws its far picks uniformly without replacement; each following
    query keeps every pick of the previous query and replaces it, with probability
    ``churn``, by a fresh uniformly random mid-context unit. Adjacent queries therefore
    share almost all of their far picks (an indexer whose scores drift slowly).
    """
    rng = np.random.default_rng(seed)
    lay = layout(context, unit)
    hi0 = int(lay.mid_hi[0])
    picks = rng.choice(
        np.arange(lay.mid_lo, hi0), size=lay.n_far, replace=hi0 - lay.mid_lo < lay.n_far
    )
    far = np.empty((CHUNK, lay.n_far), np.int64)
    replace = rng.random((CHUNK, lay.n_far)) < churn
    fresh = rng.random((CHUNK, lay.n_far))
    for i in range(CHUNK):
        hi = int(lay.mid_hi[i])
        r = replace[i]
        if r.any():
            picks = picks.copy()
            picks[r] = lay.mid_lo + (fresh[i, r] * (hi - lay.mid_lo)).astype(np.int64)
        far[i] = picks
    return assemble(lay, far)


def high_churn(context: int, unit: int, seed: int = 0) -> np.ndarray:
    """:func:`markov` with churn 50%: half of the far picks change from query to query."""
    return markov(context, unit, seed, churn=HIGH_CHURN)


def uniform_far(context: int, unit: int, seed: int = 0) -> np.ndarray:
    """Sinks + local window + far picks drawn independently per query, uniformly
    without replacement from the mid-context units (no sharing beyond chance)."""
    rng = np.random.default_rng(seed)
    lay = layout(context, unit)
    n_mid = int(lay.mid_hi.max()) - lay.mid_lo
    return assemble(lay, _top_far(lay, rng.random((CHUNK, n_mid), dtype=np.float32)))


def zipf_far(context: int, unit: int, seed: int = 0) -> np.ndarray:
    """Sinks + local window + far picks drawn per query from a Zipf(1.1)-popular set.

    The mid-context units get popularity ranks ``r = 1, 2, ...`` by one random
    permutation (shared by all queries); each query independently draws its far picks
    without replacement with probability proportional to ``r ** -1.1``, so a few
    popular units are selected by most queries and the long tail by few.
    """
    rng = np.random.default_rng(seed)
    lay = layout(context, unit)
    n_mid = int(lay.mid_hi.max()) - lay.mid_lo
    rank = rng.permutation(n_mid) + 1
    log_w = (-ZIPF_EXPONENT * np.log(rank)).astype(np.float32)
    return assemble(lay, _top_far(lay, log_w[None, :] + _gumbel(rng, (CHUNK, n_mid))))


def near_decay(context: int, unit: int, seed: int = 0) -> np.ndarray:
    """Sinks + local window + far picks whose distance to the query decays exponentially,
    plus ~5% random far ones.

    Per query, a mid-context unit at distance ``d`` units before the query's local
    window has weight ``0.95 * exp(-d / L) / Z + 0.05 / n_mid`` (``L = 4096 tokens /
    unit``, ``Z`` normalizes the decaying part over the query's mid range, ``n_mid`` its
    size); the far picks are drawn independently per query without replacement with
    probability proportional to the weight.
    """
    rng = np.random.default_rng(seed)
    lay = layout(context, unit)
    n_mid = int(lay.mid_hi.max()) - lay.mid_lo
    units = lay.mid_lo + np.arange(n_mid)
    dist = (lay.mid_hi[:, None] - 1 - units[None, :]).astype(np.float32)  # [CHUNK, n_mid]
    valid = dist >= 0
    decay = np.where(valid, np.exp(-np.maximum(dist, 0) / (DECAY_TOKENS / unit)), 0.0)
    decay /= decay.sum(axis=1, keepdims=True)
    span = (lay.mid_hi - lay.mid_lo).astype(np.float32)[:, None]
    weight = (1 - FAR_FRACTION) * decay + FAR_FRACTION * valid / span
    with np.errstate(divide="ignore"):
        log_w = np.log(weight).astype(np.float32)
    return assemble(lay, _top_far(lay, log_w + _gumbel(rng, (CHUNK, n_mid))))


FAMILIES: dict[str, Callable[..., np.ndarray]] = {
    "markov": markov,
    "high_churn": high_churn,
    "uniform_far": uniform_far,
    "zipf_far": zipf_far,
    "near_decay": near_decay,
}


# --------------------------------------------------------------------------------------
# Counting and modelling


@functools.partial(jax.jit, static_argnames=("query_blocks",))
def _counts(keys: jax.Array, query_blocks: tuple[int, ...]):
    return distinct_units_per_query(keys), [
        block_union_sizes(keys, query_block=qb) for qb in query_blocks
    ]


@dataclasses.dataclass
class Row:
    family: str
    context: int
    unit: int
    heads: int
    per_query: dict[str, SparseMlaPlan]
    fixed: dict[str, SparseMlaPlan]  # QB = 256, default head grouping
    fixed_fits: dict[str, bool]
    auto: dict[str, SparseMlaPlan]
    static: dict[str, SparseMlaPlan]  # static_qblock_config (the jit path), modelled
    jit: dict[str, SparseMlaPlan]  # what the jit path runs: static config or per-query
    fixed_union: float  # mean union per block at QB = 256


def default_head_block(heads: int, query_block: int) -> int:
    """The kernel's default: the largest divisor of H with ``Hb * QB <= MAX_ROWS``."""
    return max(
        (d for d in range(1, heads + 1) if heads % d == 0 and d * query_block <= MAX_ROWS),
        default=1,
    )


def measure_case(family: str, context: int, unit: int) -> list[Row]:
    sel = FAMILIES[family](context, unit)
    top_k = sel.shape[1]
    num_units = -(-context // unit)
    shape = dict(read_block=unit, dk_pad=DK_PAD, dv=DV, itemsize=ITEMSIZE, top_k=top_k)
    statics = {
        (heads, name): static_qblock_config(
            heads=heads, num_units=num_units, chip=TPU_CHIPS[name], max_rows=MAX_ROWS, **shape
        )
        for heads in HEADS
        for name in CHIP_NAMES
    }
    blocks = tuple(sorted(set(QUERY_BLOCKS) | {qb for qb, _, _ in statics.values()}))
    distinct, unions = _counts(jnp.asarray(sel)[None], blocks)
    distinct = np.asarray(distinct)
    all_unions = {qb: np.asarray(u) for qb, u in zip(blocks, unions, strict=True)}
    union_sizes = {qb: all_unions[qb] for qb in QUERY_BLOCKS}  # the auto plan's candidates
    fixed_u = all_unions[FIXED_QUERY_BLOCK]
    # The kernel's default chunk width for an explicit query_block.
    fixed_u_max = resolve_u_max(
        None, query_block=FIXED_QUERY_BLOCK, top_k=top_k, num_units=num_units
    )
    rows = []
    for heads in HEADS:
        hb = default_head_block(heads, FIXED_QUERY_BLOCK)
        per_query, fixed, fits, auto, static, jit_run = {}, {}, {}, {}, {}, {}
        for name in CHIP_NAMES:
            chip = TPU_CHIPS[name]
            qblock_args = dict(heads=heads, num_units=num_units, chip=chip, **shape)
            per_query[name] = predict_per_query(distinct_per_query=distinct, **qblock_args)
            fixed[name] = predict_qblock(
                union_sizes=fixed_u,
                query_block=FIXED_QUERY_BLOCK,
                head_block=hb,
                u_max=fixed_u_max,
                **qblock_args,
            )
            vmem = PlanShape(**qblock_args).vmem_bytes(
                rows=hb * FIXED_QUERY_BLOCK, query_block=FIXED_QUERY_BLOCK, u_max=fixed_u_max
            )
            fits[name] = vmem <= chip.vmem_bytes
            auto[name] = choose_plan(
                distinct_per_query=distinct,
                union_sizes=union_sizes,
                max_rows=MAX_ROWS,
                **qblock_args,
            )
            sqb, shb, su = statics[heads, name]
            static[name] = predict_qblock(
                union_sizes=all_unions[sqb],
                query_block=sqb,
                head_block=shb,
                u_max=su,
                **qblock_args,
            )
            # The wrapper's runtime guard under jit: qblock iff it issues no more DMAs.
            guard = static[name].dma_count <= per_query[name].dma_count
            jit_run[name] = static[name] if guard else per_query[name]
        rows.append(
            Row(
                family,
                context,
                unit,
                heads,
                per_query,
                fixed,
                fits,
                auto,
                static,
                jit_run,
                float(fixed_u.mean()),
            )
        )
    return rows


# --------------------------------------------------------------------------------------
# Report


def fmt_bytes(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def fmt_ratio(pq: int, other: int) -> str:
    r = pq / other if other else float("inf")
    return f"{r:.1f}x" if r < 10 else f"{r:.0f}x"


def plan_label(p: SparseMlaPlan) -> str:
    return (
        "per-query"
        if p.kernel == "per_query"
        else f"qblock {p.query_block}/{p.head_block}/{p.u_max}"
    )


def per_chip(values: dict[str, str]) -> str:
    """One value if all chips agree, else the chips grouped by value: ``v5e, v5p: a; v6e: b``."""
    groups: dict[str, list[str]] = {}
    for chip, value in values.items():
        groups.setdefault(value, []).append(chip)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{', '.join(chips)}: {value}" for value, chips in groups.items())


def traffic_table(rows: list[Row]) -> list[str]:
    out = [
        "| family | context | unit x K | per-query KV bytes | per-query DMAs | union / block "
        "(QB 256) | QB 256 KV bytes (Hb) | QB 256 ratio | QB 256 DMAs | auto plan | auto KV "
        "bytes | auto ratio | auto DMAs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pq = r.per_query["v6e"]
        fx = r.fixed["v6e"]
        auto = r.auto
        out.append(
            f"| {r.family} | {r.context // 1024}K | {r.unit} x {SELECTED_TOKENS // r.unit} "
            f"| {fmt_bytes(pq.kv_bytes)} | {pq.dma_count} | {r.fixed_union:.0f} "
            f"| {fmt_bytes(fx.kv_bytes)} ({fx.head_block}) | {fmt_ratio(pq.kv_bytes, fx.kv_bytes)} "
            f"| {fx.dma_count} | {per_chip({c: plan_label(p) for c, p in auto.items()})} "
            f"| {per_chip({c: fmt_bytes(p.kv_bytes) for c, p in auto.items()})} "
            f"| {per_chip({c: fmt_ratio(pq.kv_bytes, p.kv_bytes) for c, p in auto.items()})} "
            f"| {per_chip({c: str(p.dma_count) for c, p in auto.items()})} |"
        )
    return out


def time_table(rows: list[Row]) -> list[str]:
    head = " | ".join(f"{c} per-query | {c} QB 256 | {c} auto" for c in CHIP_NAMES)
    out = [
        f"| family | context | unit x K | {head} |",
        "|---|---|---|" + "---|" * (3 * len(CHIP_NAMES)),
    ]
    for r in rows:
        cells = []
        for c in CHIP_NAMES:
            fx = f"{r.fixed[c].predicted_s * 1e3:.2f}" + ("" if r.fixed_fits[c] else " †")
            cells += [
                f"{r.per_query[c].predicted_s * 1e3:.2f}",
                fx,
                f"**{r.auto[c].predicted_s * 1e3:.2f}**",
            ]
        out.append(
            f"| {r.family} | {r.context // 1024}K | {r.unit} x {SELECTED_TOKENS // r.unit} | "
            + " | ".join(cells)
            + " |"
        )
    return out


def jit_table(rows: list[Row]) -> list[str]:
    out = [
        "| family | context | unit x K | H | static config | static ratio | bytes guard runs | "
        + " | ".join(f"{c} static / per-query / auto (ms)" for c in CHIP_NAMES)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(CHIP_NAMES),
    ]
    for r in rows:
        pq = r.per_query["v6e"].kv_bytes
        cells = []
        for c in CHIP_NAMES:
            times = [r.static[c], r.per_query[c], r.auto[c]]
            cells.append(" / ".join(f"{p.predicted_s * 1e3:.2f}" for p in times))
        runs = {c: "qblock" if p.kernel == "qblock" else "per-query" for c, p in r.jit.items()}
        out.append(
            f"| {r.family} | {r.context // 1024}K | {r.unit} x {SELECTED_TOKENS // r.unit} "
            f"| {r.heads} | {per_chip({c: plan_label(p) for c, p in r.static.items()})} "
            f"| {per_chip({c: fmt_ratio(pq, p.kv_bytes) for c, p in r.static.items()})} "
            f"| {per_chip(runs)} | " + " | ".join(cells) + " |"
        )
    return out


def report(rows: list[Row]) -> list[str]:
    gens = ", ".join(f"`{name}` = `measure_dma.{fn.__name__}`" for name, fn in FAMILIES.items())
    lines = [
        BEGIN,
        "",
        "Generated by `PYTHONPATH=common/src:packages/attn-pallas-tpu/src python "
        "packages/attn-pallas-tpu/scripts/measure_dma.py --write-docs` "
        f"(one layer; {CHUNK} prefill queries at the end of the context; "
        f"{SELECTED_TOKENS} selected tokens per query; bf16 cache rows of {DK_PAD} features; "
        f"every family selects the sinks ({SINK_TOKENS} tokens) and the local window "
        f"({LOCAL_TOKENS} tokens) and draws the rest as its far picks). Generators: {gens}.",
        "",
        "Columns: *ratio* = per-query KV bytes / the kernel's KV bytes (1.0x = per-query). "
        f"*QB 256*: the query-blocked kernel at QB = {FIXED_QUERY_BLOCK} with the default "
        f"head grouping (Hb = the largest divisor of H with Hb * QB <= {MAX_ROWS}; each of "
        "the H / Hb groups re-reads the union) and the kernel's default u_max "
        "(`attn_common.resolve_u_max`). *auto plan*: `choose_plan` per chip, written "
        "`qblock QB/Hb/u_max` or `per-query`; one value when v5e, v5p and v6e agree, else the chips grouped by value. "
        "Byte and DMA columns of the per-query and QB 256 kernels do not depend on the chip.",
    ]
    for heads in HEADS:
        sub = [r for r in rows if r.heads == heads]
        lines += ["", f"**H = {heads}: KV traffic**", "", *traffic_table(sub)]
        lines += [
            "",
            f"**H = {heads}: modelled time per layer (ms)**; bold = the auto plan; "
            "† = the QB 256 config does not fit this chip's usable VMEM (the time is the "
            "model's, the kernel would not compile)",
            "",
            *time_table(sub),
        ]
    lines += [
        "",
        "**Under jit** (unions unknown while tracing): `static_qblock_config` per chip "
        "(`qblock QB/Hb/u_max`) and its bytes ratio; *bytes guard runs*: what a runtime "
        "guard that compares unit DMA counts runs (the static config when it issues no more "
        "DMAs than per-query); then the modelled time of the static config, of per-query "
        "and of the auto plan (which needs the unions on the host)",
        "",
        *jit_table(rows),
        "",
        END,
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOC}")
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[c // 1024 for c in CONTEXTS],
        help="contexts in K tokens (default: 16 110)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for family in FAMILIES:
        for context_k in args.contexts:
            for unit in UNITS:
                rows += measure_case(family, context_k * 1024, unit)
    text = "\n".join(report(rows))
    print(text)
    print(f"({time.perf_counter() - start:.1f} s)")
    if args.write_docs:
        doc = DOC.read_text()
        pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
        if not pattern.search(doc):
            raise SystemExit(f"{DOC}: markers {BEGIN} / {END} not found")
        DOC.write_text(pattern.sub(lambda _: text, doc))
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
