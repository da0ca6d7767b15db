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
    assert {"commit", "device", "matmul_tflops"} <= result.keys()
    kinds = {(r["case"], r["kernel"]) for r in rows}
    assert ("decode-smoke", "per-query") in kinds and ("decode-smoke", "qblock") in kinds
    for r in rows:
        assert "error" not in r, r
        if r["mode"] in ("prefill", "decode"):
            assert r["ms"] > 0 and r["bound_ms"] > 0 and r["err"] < 2e-2
    assert (tmp_path / "tpu_sparse_mla.md").read_text().count("| decode-smoke |") == 2


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
