"""Fit the sparse-MLA cost model (``attn_pallas_tpu.plan``) to a sweep measured on a TPU,
and score the automatic plan on it.

    python -m attn_pallas_tpu.fit_plan docs/results/tpu_sparse_mla_sweep.json

The sweep (``attn bench sparse-mla --sweep`` on the chip) times, per cell (a shape and
its selections), every tiling the plan chooses among, each row with the model's counted
terms (``plan.per_query_terms`` / ``plan.qblock_terms``) and HBM bytes. This fits each
kernel's costs (the :data:`plan.PER_QUERY_COSTS` / :data:`plan.QBLOCK_COSTS` keys) to the
rows' device time by non-negative least squares on relative error, then scores the plan
the way ``plan.choose_plan`` makes it: in each forward cell the modelled-fastest of the
default per-query tiling (``config.default_config``'s forward units per step now, whatever
they were when timed) and the query-blocked tilings that pass ``plan.MIN_SHARING`` (at
its default units per step),
its measured time against the cell's fastest timed tiling. A cell is a hit within
``--tolerance`` (10 %). The scores are printed for the costs in ``plan`` now, for the
fitted ones, and for fits that leave each cell out (the cell scored by a model that
never saw it). Training cells are scored as measured (the front door's gradient
against the per-query one's). Last, what a jitted call's run-time guard takes at the
costs now in each forward cell with a front-door row (:func:`guard`). Prints markdown;
``--json`` also writes the fitted costs.
"""

from __future__ import annotations

import argparse
import json
import math
import types
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from attn_pallas_tpu import plan
from attn_pallas_tpu.config import default_config

__all__ = ["fit_costs", "guard", "main", "pick", "score"]

COSTS = {"per-query": plan.PER_QUERY_COSTS, "qblock": plan.QBLOCK_COSTS}
_SCALAR = types.SimpleNamespace(maximum=max)  # plan.model_seconds on Python floats


def seconds(row: dict) -> float | None:
    """A row's measured seconds: device time where profiled, else wall clock."""
    ms = row.get("device_ms") or row.get("ms")
    return None if ms is None else ms * 1e-3


def tiling_rows(rows: list[dict]) -> list[dict]:
    """The timed tilings that ran (``role: "tiling"``, no error, a time)."""
    return [r for r in rows if r.get("role") == "tiling" and "error" not in r and seconds(r)
            and "terms" in r]  # fmt: skip


def fit_costs(rows: list[dict], kernel: str) -> dict[str, float]:
    """The costs of ``kernel`` ("per-query" / "qblock") fitted to its rows: non-negative
    least squares on each row's relative error (every row counts alike, 0.1 ms or 10)."""
    names = list(COSTS[kernel])
    mine = [r for r in tiling_rows(rows) if r["kernel"] == kernel]
    if not mine:
        return dict(COSTS[kernel])
    t = np.array([seconds(r) for r in mine])
    x = np.array([[r["terms"].get(k, 0.0) for k in names] for r in mine]) / t[:, None]
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    coef, _ = nnls(x / scale, np.ones(len(mine)))
    return dict(zip(names, (coef / scale).tolist(), strict=True))


def model_s(row: dict, costs: Mapping[str, float], hbm: float) -> float:
    """A row's modelled seconds at ``costs``: ``plan.model_seconds`` on one core (the
    sweep's chips) at ``hbm`` bytes per second."""
    return plan.model_seconds(_SCALAR, row["terms"], costs, row["model_bytes"], cores=1,
                              hbm_bytes_per_s=hbm)  # fmt: skip


def pick(cell: list[dict], costs: Mapping[str, Mapping[str, float]], hbm: float) -> dict | None:
    """The tiling the plan takes in a forward cell at ``costs``: the fastest modelled
    query-blocked tiling that shares (``shares``) if strictly faster than the default
    per-query tiling, else that one (``plan.choose_plan``'s rule); both at the default
    units per step. ``None`` where the cell lacks the default per-query row, or has
    query-blocked rows but none at the default units per step (the plan's candidates
    were not timed)."""
    pq = _default_per_query(cell)
    if pq is None:
        return None
    g = _config(pq).units_per_step  # the query-blocked kernel's default units per step
    qb = [r for r in cell if r["kernel"] == "qblock"]
    at_g = [r for r in qb if r["config"]["units_per_step"] == g]
    if qb and not at_g:
        return None
    best = min((r for r in at_g if r.get("shares")),
               key=lambda r: (model_s(r, costs["qblock"], hbm), r["model_bytes"]),
               default=None)  # fmt: skip
    return best if best is not None and _blocked_wins(best, pq, costs, hbm) else pq


def _default_per_query(cell: list[dict]) -> dict | None:
    """The cell's per-query row at today's default tiling (the plan's candidate)."""
    return next((r for r in cell if r["kernel"] == "per-query" and _default(r)), None)


def _blocked_wins(qblock: dict, per_query: dict, costs, hbm: float) -> bool:
    """The plan's and the run-time guard's one rule: a query-blocked tiling that shares
    runs only where modelled strictly faster than the per-query one."""
    return bool(qblock.get("shares")) and model_s(qblock, costs["qblock"], hbm) < model_s(
        per_query, costs["per-query"], hbm
    )


def _config(row: dict):
    """``config.default_config`` of a row's cell."""
    return default_config(
        read_block=row["unit"], top_k=row["top_k"], num_queries=row["queries"], heads=row["heads"]
    )


def _group(row: dict) -> int:
    """The units per step a per-query row ran its forward at."""
    c = row["config"]
    return c.get("forward_units_per_step") or c["units_per_step"]


def _default(row: dict) -> bool:
    """Whether a per-query row is at the tiling ``config.default_config`` gives its cell
    now (the plan's per-query candidate), whatever the default was when it was timed."""
    return _group(row) == _config(row).per_query_forward().units_per_step


def cells(rows: list[dict]) -> dict[str, list[dict]]:
    """The sweep's rows by cell, in order."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("sweep"):
            out.setdefault(r["case"], []).append(r)
    return out


def score(rows, costs, hbm: float, tolerance: float, *, leave_out: bool = False) -> list[dict]:
    """Per forward cell: the plan's pick at ``costs`` (refitted without the cell where
    ``leave_out``), its measured time over the cell's fastest, and whether that is
    within ``1 + tolerance``; per training cell the front door's gradient over the
    faster of the two."""
    out = []
    for name, cell in cells(rows).items():
        if cell[0].get("mode") == "train":
            grads = {r["role"]: seconds(r) for r in cell if "error" not in r and seconds(r)}
            if {"grad", "auto"} <= grads.keys():
                ratio = grads["auto"] / min(grads.values())
                out.append(_verdict(name, "front door (measured)", ratio, tolerance))
            else:
                out.append({"cell": name, "choice": "not scored: a gradient was not timed",
                            "ratio": math.nan, "hit": None})  # fmt: skip
            continue
        timed = tiling_rows(cell)
        if not timed:
            continue
        best = min(seconds(r) for r in timed)
        use = costs
        if leave_out:
            rest = [r for r in rows if r.get("case") != name]
            use = {k: fit_costs(rest, k) for k in COSTS}
        chosen = pick(timed, use, hbm)
        if chosen is None:
            out.append({"cell": name, "choice": "not scored: the plan's candidates were not "
                        "all timed", "ratio": math.nan, "hit": None})  # fmt: skip
        else:
            out.append(_verdict(name, _label(chosen), seconds(chosen) / best, tolerance))
    return out


def guard(rows, costs, hbm: float) -> list[dict]:
    """Per forward cell with a front-door row: the kernel a jitted call's run-time guard
    takes at ``costs`` (the shapes' query-blocked tiling, the row's ``static``, where it
    shares and is modelled strictly faster than the default per-query tiling), beside the
    front door's time as run (its guard priced at the run's costs, which may differ),
    the default per-query tiling's and the cell's fastest."""
    out = []
    for name, cell in cells(rows).items():
        auto = next((r for r in cell if r.get("role") == "auto" and r.get("static")), None)
        pq = _default_per_query(tiling_rows(cell))
        if auto is None or pq is None:
            continue
        st = auto["static"]
        c = st["config"]
        out.append({
            "cell": name,
            "guard": (f"qblock QB {c['query_block']} Hb {c['head_block']}"
                      if _blocked_wins(st, pq, costs, hbm) else "per-query"),
            "auto_s": seconds(auto), "per_query_s": seconds(pq),
            "best_s": min(seconds(r) for r in tiling_rows(cell)),
        })  # fmt: skip
    return out


def _verdict(cell: str, choice: str, ratio: float, tolerance: float) -> dict:
    return {"cell": cell, "choice": choice, "ratio": ratio, "hit": ratio <= 1 + tolerance}


def _label(row: dict) -> str:
    c = row["config"]
    if row["kernel"] == "qblock":
        return f"qblock QB {c['query_block']} Hb {c['head_block']}"
    return f"per-query G {_group(row)}"


def errors(rows: list[dict], costs, hbm: float) -> dict[str, float]:
    """Mean absolute relative error of the model per kernel over the timed tilings."""
    out = {}
    for kernel in COSTS:
        mine = [r for r in tiling_rows(rows) if r["kernel"] == kernel]
        if mine:
            e = [abs(model_s(r, costs[kernel], hbm) / seconds(r) - 1) for r in mine]
            out[kernel] = float(np.mean(e))
    return out


def report(data: dict, tolerance: float) -> tuple[str, dict]:
    """The markdown report of a sweep and the fitted costs."""
    rows = data["rows"]
    hbm = data.get("hbm_gbps", plan.TPU_CHIPS["v5e"].hbm_bytes_per_s / 1e9) * 1e9
    fitted = {k: fit_costs(rows, k) for k in COSTS}
    lines = [f"Sweep: {data.get('device')}, jax {data.get('jax')}, commit {data.get('commit')}; "
             f"{len(tiling_rows(rows))} timed tilings in {len(cells(rows))} cells.", "",
             "| kernel | term | now | fitted |", "|---|---|---|---|"]  # fmt: skip
    for kernel, names in COSTS.items():
        for k in names:
            lines.append(f"| {kernel} | {k} | {_sci(names[k])} | {_sci(fitted[kernel][k])} |")
    now_err, fit_err = errors(rows, COSTS, hbm), errors(rows, fitted, hbm)
    lines += ["", "Mean |relative error| over the timed tilings: " + ", ".join(
        f"{k} {now_err[k]:.0%} now, {fit_err[k]:.0%} fitted" for k in now_err), ""]  # fmt: skip
    scored = {
        "now": score(rows, COSTS, hbm, tolerance),
        "fitted": score(rows, fitted, hbm, tolerance),
        "fitted, cell left out": score(rows, fitted, hbm, tolerance, leave_out=True),
    }
    lines += ["| cell | " + " | ".join(scored) + " |", "|---" * (len(scored) + 1) + "|"]
    for i, v in enumerate(scored["now"]):
        parts = [_cell_text(s[i]) for s in scored.values()]
        lines.append(f"| {v['cell']} | " + " | ".join(parts) + " |")
    lines.append("")
    for name, s in scored.items():
        hits = sum(bool(v["hit"]) for v in s)
        n = sum(v["hit"] is not None for v in s)
        lines.append(f"- {name}: within {tolerance:.0%} of the fastest in {hits} of {n} "
                     "scored cells")  # fmt: skip
    lines += [
        "",
        "A jitted call's run-time guard at the costs now (ms; `auto` as run, its "
        "guard at the run's costs):",
        "",
        "| cell | guard takes | auto | per-query default | fastest |",
        "|---" * 5 + "|",
    ]
    for v in guard(rows, COSTS, hbm):
        lines.append(f"| {v['cell']} | {v['guard']} | {v['auto_s'] * 1e3:.3g} | "
                     f"{v['per_query_s'] * 1e3:.3g} | {v['best_s'] * 1e3:.3g} |")  # fmt: skip
    return "\n".join(lines) + "\n", fitted


def _cell_text(v: dict) -> str:
    if v["hit"] is None:
        return v["choice"]
    return f"{v['choice']}: {v['ratio']:.2f}x"


def _sci(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}" if 1e-3 <= abs(x) < 1e3 else f"{x:.3e}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", type=Path, help="a tpu_sparse_mla_sweep.json")
    p.add_argument("--tolerance", type=float, default=0.10, help="a hit's margin (0.10)")
    p.add_argument("--json", type=Path, help="also write the fitted costs here")
    args = p.parse_args(argv)
    text, fitted = report(json.loads(args.sweep.read_text()), args.tolerance)
    print(text, end="")
    if args.json:
        args.json.write_text(json.dumps(fitted, indent=1) + "\n")
    return 0 if all(math.isfinite(v) for c in fitted.values() for v in c.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
