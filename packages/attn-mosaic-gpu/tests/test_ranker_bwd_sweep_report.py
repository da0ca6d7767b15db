"""``benchmarks/ranker_bwd_sweep.py``'s labels and report, off a GPU: the kernels are
told apart by their CUDA names (XLA may launch them in either order), and the report
names the run's commit first and lists dq before dk/dv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "ranker_bwd_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    with load_script(SCRIPT, "ranker_bwd_sweep") as module:
        yield module


def test_kernel_labels_by_cuda_name(sweep):
    from attn_mosaic_gpu.ranker_bwd_pipelined import DKV_KERNEL, DQ_KERNEL

    assert sweep.kernel_label(f"{DQ_KERNEL}_mosaic_gpu") == "dq"
    assert sweep.kernel_label(f"{DKV_KERNEL}_mosaic_gpu") == "dk/dv"
    assert sweep.kernel_label("input_reduce_fusion") == "input_reduce_fusion"
    assert DQ_KERNEL != DKV_KERNEL and not DKV_KERNEL.startswith(DQ_KERNEL)


def test_report_names_the_commit_and_orders_the_kernels(sweep, tmp_path):
    row = {
        "case": "phoenix",
        "variant": "fold + overlap, 2 stages",
        "num_stages": 2,
        "knobs": {"fold": True, "overlap": True, "num_stages": 2},
        "kernels_ms": {"dk/dv": 3.25, "dq": 2.35},  # in launch order, dk/dv first
        "total_ms": 5.6,
        "bwd_effective_tflops": 326.0,
    }
    data = {
        "commit": "abc1234",
        "command": "ranker_bwd_sweep.py --cases phoenix",
        "date": "2026-12-01T00:00:00Z",
        "device": "NVIDIA H200",
        "jax": "0.11.2",
        "rows": [row],
        "note": "a note",
    }
    text = sweep.write_reports(data, tmp_path)
    assert (tmp_path / "ranker_bwd_sweep.md").read_text() == text
    assert json.loads((tmp_path / "ranker_bwd_sweep.json").read_text()) == data
    lines = text.splitlines()
    assert lines[2].startswith("Commit abc1234; command: `ranker_bwd_sweep.py --cases phoenix`")
    (table_row,) = [line for line in lines if line.startswith("| phoenix")]
    assert "| dq: 2.350; dk/dv: 3.250 | 5.600 | 326 |" in table_row
    assert lines[-1] == "a note"
