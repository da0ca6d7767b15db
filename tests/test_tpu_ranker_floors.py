"""benchmarks/tpu_ranker_floors.py: its patches apply to today's kernels, every floor
variant lowers for a TPU, and the report's shares are the rows' FLOPs over their times."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from helpers import load_script

from attn_common import RANKER_SUITE

pytest.importorskip("attn_pallas_tpu", reason="attn-pallas-tpu is not installed")


@pytest.fixture(scope="module")
def floors():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with load_script(root / "benchmarks" / "tpu_ranker_floors.py", "tpu_ranker_floors") as m:
        yield m


@pytest.mark.parametrize("name", ["phoenix", pytest.param("small-d64", marks=pytest.mark.slow)])
def test_every_floor_lowers_for_tpu(floors, name):
    """The patched kernels (row softmax, GQA heads a program; D 64 heads-major) lower
    through Mosaic for a TPU in every variant, and the variants are distinct kernels."""
    fwd, bwd = floors.floor_modules()
    case = next(c for c in RANKER_SUITE if c.name == name).scaled(1)
    q, k, v, do = case.inputs(0)
    bounds = jnp.asarray(case.bounds(0))
    st, args = floors.forward_args(fwd, q, k, v, bounds, cap=case.cap, config=None)
    lse = jnp.zeros((case.batch, case.q_heads, case.seq_len), jnp.float32)
    texts = set()
    for variant in floors.FWD_VARIANTS:
        fwd.FLOOR = variant
        jax.clear_caches()
        f = jax.jit(lambda *a: fwd._fwd_padded(*a, st=st, interpret=False))
        texts.add(jax.export.export(f, platforms=["tpu"])(*args).mlir_module())
    for variant in floors.BWD_VARIANTS:
        bwd.FLOOR = variant
        jax.clear_caches()
        g = jax.jit(lambda *a: bwd.ranker_attention_bwd(*a, cap=case.cap))
        texts.add(
            jax.export.export(g, platforms=["tpu"])(q, k, v, bounds, q, lse, do).mlir_module()
        )
    fwd.FLOOR = bwd.FLOOR = "full"
    assert len(texts) == len(floors.FWD_VARIANTS) + len(floors.BWD_VARIANTS)


def test_patch_fails_loudly_on_a_moved_anchor(floors):
    with pytest.raises(RuntimeError, match="anchor found 0 times"):
        floors.patched("attn_pallas_tpu.ranker_fwd", [("no such line\n", "")])


def test_kernels_are_the_longest_custom_calls_told_apart_by_their_results(floors):
    dkv = "%custom-call.3 = (bf16[2,4,1152,128]{3,2,1,0}, bf16[2,4,1152,128]{3,2,1,0}) custom-call(bf16"
    dq = "%custom-call.4 = bf16[2,20,1152,128]{3,2,1,0} custom-call(bf16[2,20,1152,128]{3,2,1,0} %q"
    tiny = "%custom-call.1 = s32[8]{0} custom-call(s32[8]{0} %b)"
    ops = [[dkv, 5.0], [tiny, 1e-6], [dq, 3.0]]
    assert floors.pallas_kernels(ops, 2) == [[dkv, 5.0], [dq, 3.0]]
    assert floors.backward_kernels(ops) == {"dq": 3.0, "dk/dv": 5.0}
    assert floors.backward_kernels([[dq, 3.0], [dkv, 5.0]]) == {"dq": 3.0, "dk/dv": 5.0}
    with pytest.raises(RuntimeError, match="cannot tell"):
        floors.backward_kernels([[dq, 3.0], [dq, 5.0]])


def test_report_shares(floors, tmp_path):
    base = dict(case="c", block_q=384, block_kv=384, heads_per_program=5, layout="[B, H, S, D]",
                allowed_flops_fwd=1e12, visited_flops_fwd=2e12)  # fmt: skip
    rows = [
        dict(base, kernel=k, floor=f, ms=ms)
        for k, f, ms in [("fwd", "full", 10.0), ("fwd", "mxu", 5.0), ("dq", "full", 10.0)]
    ]
    rows.append(dict(kernel="xla matmul", op="qk", head_dim=64, tile=640, batch=1, ms=0.5,
                     tflops=50.0))  # fmt: skip
    result = dict(device="TPU v5 lite", jax="x", commit="abc", command="cmd", date="d", matmul_tflops=200.0,
                  rows=rows)  # fmt: skip
    floors.write_markdown(result, tmp_path)
    md = (tmp_path / "tpu_ranker_floors.md").read_text()
    # 1e12 FLOPs in 10 ms = 100 TFLOP/s = 50 % of 200; mxu 5 ms: 100 %; visited 2x that
    assert (
        "| c | 384 x 384, 5 heads, [B, H, S, D] | fwd | 10.00 | 5.00 |  |  | 50.0 | 100.0 | 100.0 | 200.0 |"
        in md
    )
    # dq does 1.5x the forward's products: 1.5e12 in 10 ms = 75 %
    assert "| dq | 10.00 |  |  |  | 75.0 |  | 150.0 |  |" in md
    assert "| qk | 64 | 640 | 0.5000 | 50.0 | 25.0 |" in md


def test_merge_keeps_the_later_runs_cases_and_each_rows_rate(floors, tmp_path):
    def run(commit, rate, cases):
        rows = [dict(case=c, kernel="fwd", floor="full", ms=1.0) for c in cases]
        return dict(commit=commit, command="c", date="d", device="TPU v5 lite", jax="x",
                    matmul_tflops=rate, rows=rows)  # fmt: skip

    paths = []
    for i, r in enumerate((run("a", 100.0, ["p", "q"]), run("b", 200.0, ["q"]))):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(r))
    merged = floors.merge(paths)
    assert [(r["case"], r["run"], r["matmul_tflops"]) for r in merged["rows"]] == [
        ("p", 0, 100.0),
        ("q", 1, 200.0),
    ]
    assert [r["commit"] for r in merged["runs"]] == ["a", "b"]
