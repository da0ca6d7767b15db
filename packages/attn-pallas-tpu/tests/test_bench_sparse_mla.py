"""The TPU sparse-MLA benchmark suite end to end at tiny shapes in interpret mode."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from attn_pallas_tpu import bench_sparse_mla


def test_cases_cover_the_regimes():
    names = {c.name for c in bench_sparse_mla.CASES}
    for prefix in ("prefill-random-u16", "prefill-overlap", "decode-u64", "decode-pool-8x",
                   "train-random", "train-overlap", "eager"):  # fmt: skip
        assert any(n.startswith(prefix) for n in names), prefix
    pools = {c.name: c.pool_pages for c in bench_sparse_mla.CASES if "pool" in c.name}
    assert pools["decode-pool-8x"] == 8 * pools["decode-pool-1x"]


@pytest.mark.slow  # interpret-mode kernels, ~30 s
def test_smoke_suite_writes_rows_and_reports(tmp_path):
    assert bench_sparse_mla.main(["--smoke", "--out", str(tmp_path), "--cases", "decode",
                                  "prefill-random", "eager"]) == 0  # fmt: skip
    result = json.loads((tmp_path / "tpu_sparse_mla.json").read_text())
    rows = result["rows"]
    assert {"commit", "device", "platform", "matmul_tflops"} <= result.keys()
    kinds = {(r["case"], r["kernel"]) for r in rows}
    assert ("decode-smoke", "per-query") in kinds and ("decode-smoke", "qblock") in kinds
    for r in rows:
        assert "error" not in r, r
        if r["mode"] in ("prefill", "decode"):
            assert r["ms"] > 0 and r["queued_ms"] > 0 and r["bound_ms"] > 0
            assert r["err"] < 2e-2
    md = (tmp_path / "tpu_sparse_mla.md").read_text()
    assert md.count("| decode-smoke |") == 2 and "| wall ms | queued ms | device ms |" in md


def test_merge_results_replaces_the_rows_it_remeasures():
    """A partial re-run's rows replace the same (case, kernel) rows in place and name
    their run's commit; other rows stay; new ones are appended; commands and dates
    become lists."""
    from attn_pallas_tpu._suite import merge_results

    base = {"commit": "a", "command": "first", "date": "d1", "note": "n",
            "rows": [{"case": "x", "kernel": "per-query", "ms": 1.0},
                     {"case": "x", "kernel": "qblock", "ms": 2.0, "commit": "old"},
                     {"case": "y", "kernel": "per-query", "ms": 3.0}]}  # fmt: skip
    run = {"commit": "b", "command": "second", "date": "d2",
           "rows": [{"case": "x", "kernel": "qblock", "ms": 1.5},
                    {"case": "z", "kernel": "per-query", "ms": 4.0}]}  # fmt: skip
    got = merge_results(base, run)
    assert [(r["case"], r["kernel"], r["ms"], r.get("commit")) for r in got["rows"]] == [
        ("x", "per-query", 1.0, None), ("x", "qblock", 1.5, "b"), ("y", "per-query", 3.0, None),
        ("z", "per-query", 4.0, "b"),
    ]  # fmt: skip
    assert got["command"] == ["first", "second"] and got["date"] == ["d1", "d2"]
    assert got["commit"] == "a" and got["note"] == "n"
    assert merge_results(got, run)["rows"] == got["rows"]  # merging twice changes no row
    assert base["command"] == "first"  # the base is not modified


def test_merge_results_keeps_the_ranker_layouts_apart():
    """The ranker suite's padded and packed rows of one case and mode are two rows: a
    re-run replaces each by its own."""
    from attn_pallas_tpu._suite import merge_results

    rows = [{"case": "ragged", "mode": "fwd", "layout": lay, "ms": ms}
            for lay, ms in (("padded", 1.0), ("packed", 2.0))]  # fmt: skip
    run = {"commit": "b", "rows": [dict(r, ms=r["ms"] / 2) for r in rows]}
    got = merge_results({"commit": "a", "rows": rows}, run)["rows"]
    assert [(r["layout"], r["ms"], r["commit"]) for r in got] == [
        ("padded", 0.5, "b"), ("packed", 1.0, "b"),
    ]  # fmt: skip


def test_merge_results_keeps_each_sweep_tiling():
    """A ranker sweep's rows of one case and mode differ by tiling only: a re-run
    replaces each tiling's row by its own and keeps the suite row apart."""
    from attn_pallas_tpu._suite import merge_results

    def row(bq, bkv, ms, **kw):
        return {"case": "long", "mode": "fwd+bwd", "layout": "padded", "block_q": bq,
                "block_kv": bkv, "ms": ms, **kw}  # fmt: skip

    base = {"commit": "a", "rows": [row(640, 640, 9.0), row(640, 640, 9.0, sweep=True),
                                    row(640, 512, 8.0, sweep=True)]}  # fmt: skip
    run = {"commit": "b", "rows": [row(640, 512, 7.0, sweep=True), row(512, 512, 6.0, sweep=True)]}
    got = merge_results(base, run)["rows"]
    assert [(r["block_kv"], r.get("sweep", False), r["ms"], r.get("commit")) for r in got] == [
        (640, False, 9.0, None), (640, True, 9.0, None), (512, True, 7.0, "b"),
        (512, True, 6.0, "b"),
    ]  # fmt: skip


def test_report_merge_into_rewrites_the_results_beside_it(tmp_path, capsys):
    """``--report RUN.json --merge-into RESULTS.json`` merges and rewrites the JSON, its
    .md and .svg; ``--merge-into`` alone is refused in one line."""
    from pathlib import Path

    committed = json.loads(
        (Path(__file__).parents[3] / "docs/results/tpu_sparse_mla.json").read_text()
    )
    target = tmp_path / "res" / "tpu_sparse_mla.json"
    target.parent.mkdir()
    target.write_text(json.dumps(committed))
    row = next(r for r in committed["rows"] if r["case"] == "decode-u64-h64")
    run = {**{k: v for k, v in committed.items() if k != "rows"}, "commit": "f00d123",
           "command": "attn bench sparse-mla --cases decode-u64-h64", "date": "2026-12-07",
           "rows": [{**row, "device_ms": 0.5, "commit": None}]}  # fmt: skip
    del run["rows"][0]["commit"]
    src = tmp_path / "run.json"
    src.write_text(json.dumps(run))
    assert bench_sparse_mla.main(["--report", str(src), "--merge-into", str(target)]) == 0
    merged = json.loads(target.read_text())
    assert len(merged["rows"]) == len(committed["rows"])
    got = next(
        r for r in merged["rows"] if (r["case"], r["kernel"]) == (row["case"], row["kernel"])
    )
    assert got["device_ms"] == 0.5 and got["commit"] == "f00d123"
    assert merged["command"][-1] == run["command"]
    md = (target.parent / "tpu_sparse_mla.md").read_text()
    assert "commit f00d123" in md
    with pytest.raises(SystemExit):
        bench_sparse_mla.main(["--merge-into", str(target)])
    assert "--merge-into" in capsys.readouterr().err


def test_cases_run_in_the_order_named():
    """``--cases`` substrings pick cases in their own order, each once, so a run cut by
    its time limit has done what was named first."""
    from attn_pallas_tpu._suite import select_cases

    cases = bench_sparse_mla.SWEEP_CASES
    got = [c.name for c in select_cases(cases, ["train", "u16-h16", "train-overlap"])]
    trains = [c.name for c in cases if "train" in c.name]
    assert got[: len(trains)] == trains  # the suite's order within one substring
    assert got[len(trains) :] == [c.name for c in cases if "u16-h16" in c.name]
    assert [c.name for c in select_cases(cases, None)] == [c.name for c in cases]


def test_inputs_are_placed_row_major_and_jit_keeps_them():
    """The suite hands q and the cache over row-major (a v5e lays a fresh ``[1, T, 576]``
    array out ``T``-minor) and its jit takes each argument in the layout it has."""
    kv = bench_sparse_mla.row_major(jnp.arange(2 * 8 * 5, dtype=jnp.float32).reshape(2, 8, 5))
    assert kv.format.layout.major_to_minor == (0, 1, 2)
    f = bench_sparse_mla.jit_placed(lambda a, b: a.sum() + b, kv, jnp.float32(1.0))
    assert float(f(kv, jnp.float32(1.0))) == float(kv.sum()) + 1.0
    assert jax.tree.leaves(f.lower(kv, jnp.float32(1.0)).compile().input_formats)[0] == kv.format
