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


def test_step_model_counts_and_fits(capsys):
    """``benchmarks/ranker_bwd_step_model.py`` on the committed sweep: program counts are
    the kernels' grids, step counts are the blocks holding an allowed pair (brute force
    over the dense mask of the case's first rows), and it prints both fits."""
    import numpy as np

    from attn_common import ranker_case, ranker_mask

    path = SCRIPT.with_name("ranker_bwd_step_model.py")
    with load_script(path, "ranker_bwd_step_model") as model:
        counts = model.step_counts("phoenix")
        case = ranker_case("phoenix")
        tiles = case.seq_len // 128
        assert counts["dq"][0] == case.q_heads * tiles * case.batch
        assert counts["dk/dv"][0] == case.kv_heads * tiles * case.batch
        bounds = np.asarray(case.bounds(seed=0))
        pos = np.arange(case.seq_len)
        dq_steps = dkv_steps = 0
        for row in bounds:
            allowed = np.asarray(ranker_mask(pos[:, None], pos[None, :], *row))
            blocks = allowed.reshape(tiles, 128, case.seq_len // 64, 64).any(axis=(1, 3))
            dq_steps += int(blocks.sum())  # (query tile, key block) pairs
            blocks_t = allowed.T.reshape(tiles, 128, case.seq_len // 64, 64).any(axis=(1, 3))
            dkv_steps += int(blocks_t.sum())  # (key tile, query block) pairs
        assert counts["dq"][1] == dq_steps * case.q_heads
        assert counts["dk/dv"][1] == dkv_steps * case.q_heads

        model.main(
            ["--sweep", str(SCRIPT.parents[1] / "docs" / "results" / "ranker_bwd_sweep.json")]
        )
    out = capsys.readouterr().out
    assert "dq: fixed" in out and "dk/dv: fixed" in out and "phoenix" in out
