"""The TPU ranker benchmark suite: its cases, FLOPs and sweep grid, the report writer on a
synthetic result, and the suite end to end at tiny shapes in interpret mode."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from attn_common import RANKER_SUITE, ranker_flops
from attn_common.suite import ranker_case
from attn_pallas_tpu import bench_ranker
from attn_pallas_tpu.ranker_config import BLOCK_CHOICES, vmem_bytes


def test_cases_are_the_suite_at_full_batch():
    assert bench_ranker.CASES == RANKER_SUITE
    assert any(c.ragged for c in bench_ranker.SMOKE_CASES)  # the packed rows get smoked


def test_packing_keeps_the_users_and_their_allowed_flops():
    case = ranker_case("ragged").scaled(8)
    packed = bench_ranker.packed_inputs(case)
    rows, users, _ = packed["bounds"].shape
    assert rows < case.batch and users > 1 and packed["users"] == case.batch
    assert packed["arrays"][0].shape == (rows, *case.inputs(0)[0].shape[1:])
    for mode, factor in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        want = factor * ranker_flops(case.bounds(0), case.q_heads, case.head_dim)
        assert bench_ranker.allowed_flops(packed["bounds"], case, mode) == pytest.approx(want)
        assert bench_ranker.allowed_flops(case.bounds(0), case, mode) == pytest.approx(want)


def test_sweep_times_exactly_the_tilings_that_fit():
    case = ranker_case("phoenix")
    limit = max(vmem_bytes(384, 384, case.head_dim, jnp.bfloat16).values())
    got = {(c.block_q, c.block_kv) for c in bench_ranker.sweep_configs(case, limit=limit)}
    want = {
        (bq, bkv)
        for bq in BLOCK_CHOICES
        for bkv in BLOCK_CHOICES
        if max(vmem_bytes(bq, bkv, case.head_dim, jnp.bfloat16).values()) <= limit
    }
    assert got == want and (384, 384) in got and (640, 640) not in got
    assert len(bench_ranker.sweep_configs(case)) >= len(got)


def _row(case, mode, layout="padded", **kw):
    row = dict(case=case, mode=mode, layout=layout, block_q=384, block_kv=384, ms=2.0,
               queued_ms=1.2, device_ms=1.0, kernel_device_ms=0.8, tflops=50.0, peak_fraction=0.25,
               chip_peak_fraction=0.2,
               model_ms=0.7, per_user_us=15.6, xla_ms=4.0, xla_device_ms=3.0,
               err={"out": 2.4e-3, "lse": 1e-7})  # fmt: skip
    return {**row, **kw}


def test_report_from_a_synthetic_result(tmp_path):
    result = {
        "commit": "abc1234",
        "device": "TPU v5 lite",
        "jax": "0.10.2",
        "platform": "PJRT C API TFRT TPU v5 lite Built on Jan 1 2026",
        "matmul_tflops": 197.0,
        "chip": "v5e",
        "chip_peak_tflops": 250.0,
        "rows": [
            _row("phoenix", "fwd"),
            _row(
                "phoenix",
                "fwd+bwd",
                xla_ms=None,
                xla_device_ms=None,
                err=None,
                xla_error="XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory",
            ),
            _row("ragged", "fwd", layout="packed", per_user_us=9.5),
            {"case": "long", "error": "ValueError: boom"},
            _row("phoenix", "fwd", sweep=True, block_q=640, block_kv=640, device_ms=0.9),
            _row("phoenix", "fwd", sweep=True, block_q=128, block_kv=128, device_ms=1.7),
            _row("phoenix", "fwd", sweep=True, block_q=256, block_kv=256, error="Mosaic: VMEM"),
        ],
    }
    src = tmp_path / "in.json"
    src.write_text(json.dumps(result))
    assert bench_ranker.main(["--report", str(src), "--out", str(tmp_path / "o")]) == 0
    md = (tmp_path / "o" / "tpu_ranker.md").read_text()
    lines = md.splitlines()
    fwd = next(ln for ln in lines if ln.startswith("| phoenix | padded | fwd |"))
    cells = [c.strip() for c in fwd.strip("|").split("|")]
    # wall, queued, device, kernel, TFLOP/s, % peak, % chip, model, per user, XLA device, x XLA
    assert cells[4:15] == ["2", "1.2", "1", "0.8", "50", "25", "20", "0.7", "15.6", "3", "3"]
    assert "out 0.0024, lse 1e-07" in fwd
    assert "XLA: XlaRuntimeError: RESOURCE_EXHAUSTED" in md
    assert "| ragged | packed | fwd |" in md and "ValueError: boom" in md
    best = next(ln for ln in lines if ln.startswith("| phoenix | fwd | "))
    assert "| 640x640 | 0.9 | 384x384 | 1 | 2 |" in best  # the failed tiling is not counted
    assert "197 TFLOP/s" in md and "v5e datasheet bf16 peak (250 TFLOP/s)" in md
    assert "abc1234" in md
    assert "jax 0.10.2 (PJRT C API TFRT TPU v5 lite Built on Jan 1 2026), commit" in md


@pytest.mark.slow  # interpret-mode kernels, ~50 s
def test_smoke_suite_times_padded_and_packed_rows(tmp_path):
    assert bench_ranker.main(["--smoke", "--out", str(tmp_path), "--cases", "ragged"]) == 0
    result = json.loads((tmp_path / "tpu_ranker.json").read_text())
    assert {"commit", "device", "jax", "platform", "matmul_tflops"} <= result.keys()
    rows = result["rows"]
    assert {(r["layout"], r["mode"]) for r in rows} == {
        (layout, mode) for layout in ("padded", "packed") for mode in ("fwd", "fwd+bwd")
    }
    by = {(r["layout"], r["mode"]): r for r in rows}
    case = next(c for c in bench_ranker.SMOKE_CASES if c.name == "ragged-smoke")
    for r in rows:
        assert "error" not in r and r["ms"] > 0 and r["queued_ms"] > 0 and r["tflops"] > 0, r
        assert r["peak_fraction"] == pytest.approx(r["tflops"] / result["matmul_tflops"])
        want = r["tflops"] / result["chip_peak_tflops"]
        assert r["chip_peak_fraction"] == pytest.approx(want)
        assert r["err"] and max(r["err"].values()) < 1e-2, r["err"]
        assert r["per_user_us"] == pytest.approx((r["device_ms"] or r["ms"]) * 1e3 / case.batch)
    assert by["packed", "fwd"]["batch"] < by["padded", "fwd"]["batch"] == case.batch
    assert by["packed", "fwd"]["flops"] == by["padded", "fwd"]["flops"] > 0
    assert by["padded", "fwd+bwd"]["flops"] == pytest.approx(3.5 * by["padded", "fwd"]["flops"])
    assert by["padded", "fwd"]["model_ms"] > 0
    assert np.isfinite(result["matmul_tflops"]) and result["matmul_tflops"] > 0
    assert (tmp_path / "tpu_ranker.md").read_text().count("| ragged-smoke |") == 4


@pytest.mark.slow  # interpret-mode kernels, ~15 s
def test_smoke_sweep_times_each_tiling(tmp_path, monkeypatch):
    from attn_common import KernelConfig

    grid = [KernelConfig(block_q=128, block_kv=128), KernelConfig(block_q=256, block_kv=128)]
    monkeypatch.setattr(bench_ranker, "sweep_configs", lambda case: grid)
    argv = ["--smoke", "--out", str(tmp_path), "--cases", "small-d64", "--modes", "fwd",
            "--sweep"]  # fmt: skip
    assert bench_ranker.main(argv) == 0
    rows = json.loads((tmp_path / "tpu_ranker.json").read_text())["rows"]
    assert [(r["mode"], r.get("sweep", False)) for r in rows] == [("fwd", False)] + [
        ("fwd", True)
    ] * 2
    sweep = [r for r in rows if r.get("sweep")]
    assert [(r["block_q"], r["block_kv"]) for r in sweep] == [(128, 128), (256, 128)]
    for r in sweep:
        assert "error" not in r and r["ms"] > 0 and r["model_ms"] > 0, r
    assert sweep[0]["model_ms"] != sweep[1]["model_ms"]  # predicted per tiling
    assert "## Sweep: best tiling" in (tmp_path / "tpu_ranker.md").read_text()
