"""benchmarks/sparse_mla_train.py: ``--merge`` writes one report from runs cut short by a
device call's time limit, a shape's cases always from a single run."""

from __future__ import annotations

import json

import pytest
from helpers import gpu_bench_script

pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib (common[bench])")

bench = gpu_bench_script("sparse_mla_train")


def _case(impl, kv_len, heads, step_ms):
    return {
        "kv_len": kv_len, "heads": heads, "queries": 4096, "top_k": 2048, "impl": impl,
        "fwd_ms": step_ms / 10, "bwd_ms": step_ms * 0.9, "step_ms": step_ms,
        "step_tflops": 1.0, "fwd_tflops": 1.0,
    }  # fmt: skip


def _run(path, command, cases, **over):
    result = {"commit": "abc1234", "command": command, "date": "2026-12-04T00:00:00Z",
              "device": "NVIDIA H200", "iterations": 5, "rows": [], "cases": cases, **over}  # fmt: skip
    path.write_text(json.dumps(result))
    return path


def test_merge_takes_each_shape_from_its_last_run(bench, tmp_path):
    first = _run(tmp_path / "a.json", "first", [
        _case("xla", 32768, 64, 100.0), _case("mosaic-gpu", 32768, 64, 25.0),
        _case("xla", 131072, 128, 999.0),  # cut short: its other impls missing
    ])  # fmt: skip
    second = _run(tmp_path / "b.json", "second", [
        _case("xla", 131072, 128, 120.0), _case("mosaic-gpu", 131072, 128, 40.0),
    ])  # fmt: skip
    assert bench.main(["--merge", str(first), str(second), "--out", str(tmp_path / "out")]) == 0
    merged = json.loads((tmp_path / "out" / "sparse_mla_train.json").read_text())
    got = [(c["kv_len"], c["heads"], c["impl"], c["step_ms"], c["run"]) for c in merged["cases"]]
    assert got == [
        (32768, 64, "xla", 100.0, 0), (32768, 64, "mosaic-gpu", 25.0, 0),
        (131072, 128, "xla", 120.0, 1), (131072, 128, "mosaic-gpu", 40.0, 1),
    ]  # fmt: skip
    assert [r["command"] for r in merged["runs"]] == ["first", "second"]
    step = {(r["impl"], r["tokens"]): r for r in merged["rows"] if r["mode"] == "fwd+bwd"}
    assert step["ours", 131072]["vs_xla"] == 3.0  # the same run's XLA, not the cut one's
    assert step["ours", 32768]["vs_xla"] == 4.0
    md = (tmp_path / "out" / "sparse_mla_train.md").read_text()
    assert "1: `second`" in md and "| 131072 | 128 | mosaic-gpu | 4.00 | 36.00 | 40.00 |" in md


def test_merge_refuses_other_commits(bench, tmp_path):
    a = _run(tmp_path / "a.json", "a", [_case("xla", 32768, 64, 1.0)])
    b = _run(tmp_path / "b.json", "b", [_case("xla", 32768, 64, 1.0)], commit="def5678")
    with pytest.raises(ValueError, match="commit differs"):
        bench.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out")])
