"""The cost model's sweep rows and its fit: the bench's counted terms are the plan's own
model, the fit recovers known costs, and the plan is scored as ``choose_plan`` picks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from attn_pallas_tpu import bench_sparse_mla, fit_plan, plan
from attn_pallas_tpu.config import default_config

HBM = plan.TPU_CHIPS["v5e"].hbm_bytes_per_s


def _case(name):
    return next(c for c in bench_sparse_mla.SWEEP_SMOKE_CASES if c.name == name)


def test_sweep_cases_cover_the_issue_grid():
    cells = bench_sparse_mla.SWEEP_CASES
    assert {c.unit for c in cells} == {16, 32, 64, 128}
    assert {c.heads for c in cells} == {4, 16, 64, 128}
    assert {(c.mode, c.picks) for c in cells} >= {
        ("prefill", "random"),
        ("decode", "random"),
        ("prefill", "overlapping"),
        ("train", "overlapping"),
        ("train", "random"),
    }
    assert len({c.name for c in cells}) == len(cells)


@pytest.mark.parametrize("name", ["prefill-overlap-smoke", "decode-smoke"])
def test_sweep_rows_price_as_the_plan_does(name, monkeypatch):
    """Every timed tiling's terms and bytes, priced by ``model_seconds``, give the plan's
    own prediction for it (``predict_per_query`` / ``predict_qblock``)."""
    monkeypatch.setattr(bench_sparse_mla, "default_chip", lambda: plan.TPU_CHIPS["v5e"])
    case = _case(name)
    idx = bench_sparse_mla.make_inputs(case)["idx"]
    rows, static = bench_sparse_mla.sweep_tilings(case, idx)
    keys = np.where(idx >= 0, idx, -1)[None]
    distinct = plan.host_distinct_units(keys)
    kinds = {r["kernel"] for r in rows}
    assert kinds == ({"per-query"} if case.paged else {"per-query", "qblock"})
    assert sum(r.get("default", False) for r in rows) == 1
    for r in rows:
        cfg = r["knobs"]["config"]
        shape = bench_sparse_mla.plan_shape(case, cfg)
        s = plan.PlanShape(**shape)
        got = fit_plan.model_s(r, {k: v for k, v in _costs(r).items()}, HBM)
        if r["kernel"] == "per-query":
            want = plan.predict_per_query(distinct_per_query=distinct, **shape).predicted_s
        else:
            qb, hb = r["config"]["query_block"], r["config"]["head_block"]
            unions = plan.host_union_sizes(keys, (qb,))[qb]
            want = plan.predict_qblock(
                union_sizes=unions,
                query_block=qb,
                head_block=hb,
                u_max=r["config"]["u_max"],
                **shape,
            ).predicted_s
            assert r["shares"] == (r["terms"]["unit"] * plan.MIN_SHARING <= distinct.sum())
        assert got == pytest.approx(want, rel=1e-12), r
        assert s.chip.cores == 1
    if case.paged:
        assert static is None
    else:
        qb, hb, _ = plan.static_qblock_config(
            **bench_sparse_mla.plan_shape(
                case,
                default_config(
                    read_block=case.unit,
                    top_k=case.top_k,
                    num_queries=case.queries,
                    heads=case.heads,
                ),
            ),
            max_rows=4096,
        )
        assert static["config"]["query_block"] == min(qb, -(-case.queries // 8) * 8)
        assert static["config"]["head_block"] == hb


def _costs(row):
    return plan.PER_QUERY_COSTS if row["kernel"] == "per-query" else plan.QBLOCK_COSTS


def _synthetic(rng, kernel, n, costs):
    names = list(costs)
    rows = []
    for _ in range(n):
        terms = {k: (1.0 if k == "call" else float(rng.uniform(1, 1e6))) for k in names}
        row = {"kernel": kernel, "role": "tiling", "terms": terms, "model_bytes": 0.0}
        row["device_ms"] = fit_plan.model_s(row, costs, HBM) * 1e3
        rows.append(row)
    return rows


def test_fit_recovers_known_costs():
    rng = np.random.default_rng(0)
    for kernel, names in fit_plan.COSTS.items():
        true = {k: float(rng.uniform(0.5, 2)) * (1e-4 if k == "call" else 1e-9) for k in names}
        rows = _synthetic(rng, kernel, 40, true)
        rows.append(dict(rows[0], error="boom"))  # failed rows do not count
        rows.append({k: v for k, v in rows[1].items() if k != "terms"})  # nor rows without terms
        got = fit_plan.fit_costs(rows, kernel)
        for k in names:
            assert got[k] == pytest.approx(true[k], rel=1e-6), (kernel, k)


def _row(kernel, ms, g, *, terms, shares=True, qb=None, case="c", mode="prefill"):
    cfg = {"units_per_step": g, "query_block": qb, "head_block": 4 if qb else None}
    return {"case": case, "mode": mode, "sweep": True, "role": "tiling", "kernel": kernel,
            "unit": 64, "top_k": 32, "queries": 1024, "heads": 16, "config": cfg, "terms": terms,
            "model_bytes": 0.0, "device_ms": ms, "shares": shares}  # fmt: skip


def test_pick_and_score_follow_choose_plan():
    cfg = default_config(read_block=64, top_k=32, num_queries=1024, heads=16)
    g, gf = cfg.units_per_step, cfg.forward_units_per_step  # query-blocked, per-query
    assert g != gf
    costs = {"per-query": {"call": 0.0, "step": 1e-3}, "qblock": {"call": 0.0, "step": 1e-3}}
    pq = _row("per-query", 5.0, gf, terms={"call": 1, "step": 4})  # modelled 4 ms
    other_g = _row("per-query", 3.0, g, terms={"call": 1, "step": 2})  # not the default
    fast = _row("qblock", 2.0, g, terms={"call": 1, "step": 3}, qb=64)  # modelled 3 ms
    cheap = _row("qblock", 9.0, g, terms={"call": 1, "step": 1}, qb=8, shares=False)
    cell = [pq, other_g, fast, cheap]
    assert fit_plan.pick(cell, costs, HBM) is fast  # the unshared one is never picked
    verdict = fit_plan.score(cell, costs, HBM, 0.1)[0]
    assert verdict["choice"] == "qblock QB 64 Hb 4" and verdict["hit"]  # 2.0 is the fastest
    slow = dict(fast, terms={"call": 1, "step": 4})  # a tie goes to the per-query kernel
    assert fit_plan.pick([pq, other_g, slow], costs, HBM) is pq
    verdict = fit_plan.score([pq, other_g, slow], costs, HBM, 0.1)[0]
    assert verdict["ratio"] == pytest.approx(5.0 / 2.0) and verdict["hit"] is False
    moved = dict(fast, config=dict(fast["config"], units_per_step=gf))
    assert fit_plan.pick([pq, moved], costs, HBM) is None  # its candidates were not timed
    assert fit_plan.score([pq, moved], costs, HBM, 0.1)[0]["hit"] is None


def test_guard_takes_the_static_tiling_only_where_it_shares_and_is_faster():
    cfg = default_config(read_block=64, top_k=32, num_queries=1024, heads=16)
    costs = {"per-query": {"call": 0.0, "step": 1e-3}, "qblock": {"call": 0.0, "step": 1e-3}}
    pq = _row("per-query", 5.0, cfg.forward_units_per_step, terms={"call": 1, "step": 4})
    tiled = _row("qblock", 2.0, cfg.units_per_step, terms={"call": 1, "step": 3}, qb=64)
    static = {"config": {"query_block": 128, "head_block": 4}, "terms": {"call": 1, "step": 3},
              "model_bytes": 0.0, "shares": True}  # fmt: skip
    auto = {"case": "c", "mode": "prefill", "sweep": True, "role": "auto", "kernel": "qblock",
            "device_ms": 2.5, "static": static}  # fmt: skip
    (v,) = fit_plan.guard([pq, tiled, auto], costs, HBM)
    assert v["guard"] == "qblock QB 128 Hb 4"
    assert (v["auto_s"], v["per_query_s"], v["best_s"]) == pytest.approx((2.5e-3, 5e-3, 2e-3))
    for change in ({"shares": False}, {"terms": {"call": 1, "step": 4}}):  # a tie: per-query
        slow = dict(auto, static=dict(static, **change))
        assert fit_plan.guard([pq, tiled, slow], costs, HBM)[0]["guard"] == "per-query"
    assert fit_plan.guard([pq, tiled], costs, HBM) == []  # no front-door row


def test_training_cells_score_the_front_door_as_measured():
    grad = {"case": "t", "mode": "train", "sweep": True, "kernel": "per-query", "role": "grad"}
    rows = [dict(grad, device_ms=10.0), dict(grad, kernel="qblock", role="auto", device_ms=10.5)]
    (v,) = fit_plan.score(rows, fit_plan.COSTS, HBM, 0.1)
    assert v["ratio"] == pytest.approx(1.05) and v["hit"]
    (v,) = fit_plan.score(rows[:1], fit_plan.COSTS, HBM, 0.1)
    assert v["hit"] is None and math.isnan(v["ratio"])


def test_main_reports_and_writes_the_fit(tmp_path, capsys):
    rng = np.random.default_rng(1)
    rows = []
    for i, kernel in enumerate(("per-query", "qblock")):
        for r in _synthetic(rng, kernel, 12, fit_plan.COSTS[kernel]):
            cfg = {"units_per_step": 8, "forward_units_per_step": 16, "query_block": 64,
                   "head_block": 4}  # fmt: skip
            rows.append(dict(r, case=f"cell{i}", mode="prefill", sweep=True, unit=64, top_k=32, heads=16,
                             queries=1024, config=cfg, shares=True))  # fmt: skip
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"device": "TPU v5 lite", "hbm_gbps": 819.0, "rows": rows}))
    out = tmp_path / "costs.json"
    assert fit_plan.main([str(sweep), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| per-query | key_row |" in text and "24 timed tilings in 2 cells" in text
    assert "not scored" in text  # the qblock-only cell lacks its per-query candidate
    fitted = json.loads(out.read_text())
    assert set(fitted) == {"per-query", "qblock"}
    for kernel, names in fit_plan.COSTS.items():
        for k, v in names.items():
            assert fitted[kernel][k] == pytest.approx(v, rel=1e-6, abs=1e-15)


@pytest.mark.slow  # interpret-mode kernels
def test_smoke_sweep_writes_rows_with_terms(tmp_path):
    argv = ["--sweep", "--smoke", "--out", str(tmp_path), "--cases", "prefill-overlap"]
    assert bench_sparse_mla.main(argv) == 0
    result = json.loads((tmp_path / "tpu_sparse_mla_sweep.json").read_text())
    rows = result["rows"]
    assert {r["role"] for r in rows} == {"tiling", "auto"}
    for r in rows:
        assert "error" not in r and r["ms"] > 0, r
        assert r["role"] == "auto" or set(r["terms"]) == set(_costs(r))
    assert (tmp_path / "tpu_sparse_mla_sweep.md").read_text().count("| prefill-overlap") == len(
        rows
    )
    assert not (tmp_path / "tpu_sparse_mla.json").exists()
