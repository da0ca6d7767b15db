"""The sparse MLA benchmark (``attn_mosaic_gpu.bench_sparse_mla``: ``attn bench sparse-mla``
and ``benchmarks/sparse_mla_gpu.py``) on CPU: the smoke run end to end (with the
reference as "ours"), its input generators, the XLA baseline against the reference, and
the script as a thin wrapper with its own defaults."""

from __future__ import annotations

import json
import time
from pathlib import Path
from xml.etree import ElementTree

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_script

from attn_common import check_sparse_mla_inputs
from attn_common.sparse_mla_rows import selected_rows, sparse_mla_units
from attn_mosaic_gpu import bench_sparse_mla
from attn_reference import sparse_mla_attention

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "sparse_mla_gpu.py"


@pytest.fixture(scope="module")
def bench():
    """The benchmark module (what ``attn bench sparse-mla`` and the script run)."""
    return bench_sparse_mla


@pytest.fixture(scope="module")
def script():
    """The script as a module (benchmarks/ is not a package)."""
    with load_script(SCRIPT, "sparse_mla_gpu_bench") as module:
        yield module


def test_case_list(bench):
    names = [c.name for c in bench.CASES]
    assert len(names) == len(set(names)) == 12
    for c in bench.CASES:
        assert c.top_k * c.read_block == 2048 and c.num_queries == 4096
        assert (c.dk, c.dv, c.heads in (64, 128)) == (576, 512, True)
    assert {c.kv_len for c in bench.CASES} == {8192, 32768, 131072}
    assert [c.name for c in bench.select_cases(["flat-h128-*"], False)] == [
        "flat-h128-t8k",
        "flat-h128-t32k",
        "flat-h128-t128k",
    ]
    with pytest.raises(ValueError, match="match none"):
        bench.select_cases(["nope"], False)


@pytest.mark.slow  # the same smoke run as test_cli_bench.py's quick
# test_bench_sparse_mla_smoke_off_gpu (attn bench sparse-mla), through the script
def test_smoke_run(script, tmp_path):
    """The documented CPU command of the script, end to end."""
    t0 = time.perf_counter()
    result = script.main(["--smoke", "--impl", "reference", "--out", str(tmp_path)])
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"smoke run took {elapsed:.0f} s"
    saved = json.loads((tmp_path / "sparse_mla_gpu.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert saved["smoke"] and saved["impl"] == "reference"
    prov = saved["provenance"]
    assert prov["commit"] and "--smoke" in prov["command"] and prov["date"]
    assert [r["case"] for r in saved["rows"]] == ["flat-smoke", "paged-smoke"]
    for row in saved["rows"]:
        for key in ("xla_ms", "xla_tflops", "ours_ms", "ours_tflops", "speedup_vs_xla"):
            assert row[key] > 0, key
        assert row["xla_chunk"] >= 1 and "ours_error" not in row
        assert row["rel_l2_ours_vs_xla"] < 1e-2
        assert row["xla_vs_reference_rel_l2"] < 1e-2
        assert 0 < row["valid_pairs"] < row["num_queries"] * row["top_k"] * row["read_block"]
        assert row["flops"] == 2 * row["heads"] * (576 + 512) * row["valid_pairs"]
        want_bytes = row["valid_pairs"] * 1152 + row["num_queries"] * row["heads"] * (
            576 * 2 + 512 * 4
        )
        assert row["bytes"] == want_bytes
        assert row["target"] is None and "target_met" not in row
    flat, paged = saved["rows"]
    assert "write_rows" not in flat
    assert paged["write_rows"] == paged["num_queries"] and paged["write_row_bytes"] == 2 * 640
    for key in ("write_back", "write_back_loop", "write_and_attend"):
        assert paged[f"{key}_ms"] > 0, key
    assert "write_and_attend_loop_ms" not in paged
    assert paged["write_back_tbps"] > 0 and paged["write_and_attend_tflops"] > 0
    assert not any(k.endswith("_error") for k in paged)
    assert saved["failed"] == result["failed"] == 0
    md = (tmp_path / "sparse_mla_gpu.md").read_text()
    assert "flat-smoke" in md and "paged-smoke" in md and prov["commit"] in md
    assert "| paged-smoke | 32 |" in md  # the write-back table
    assert "not a measurement" in md
    svg = (tmp_path / "sparse_mla_gpu.svg").read_text()
    assert "flat-smoke" in svg and "not a measurement" in svg


def test_plot_bars_follow_the_rows(bench, tmp_path):
    """The SVG: one XLA and one ours bar per case, heights proportional to TFLOP/s on a
    shared axis, a dashed target line per head count, a failed row without its bar."""
    rows = [
        {"case": "flat-h128-t8k", "xla_tflops": 100.0, "ours_tflops": 400.0},
        {"case": "paged-h64-<t>", "xla_tflops": 50.0, "ours_tflops": None},
    ]
    result = {
        "rows": rows,
        "device": "NVIDIA H200",
        "impl": "mosaic-gpu",
        "provenance": {"commit": "abc1234"},
        "targets": {"128": {"tflops": 500.0}, "64": {"tflops": 350.0}},
    }
    path = tmp_path / "plot.svg"
    bench.write_plot(result, path)
    root = ElementTree.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    heights = [float(r.get("height")) for r in root.iter(f"{ns}rect")][:-2]  # less legend
    assert len(heights) == 3 and heights[1] == pytest.approx(4 * heights[0], rel=1e-2)
    assert heights[2] == pytest.approx(heights[0] / 2, rel=1e-2)
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "target H=128" in texts and "target H=64" in texts and "400" in texts
    assert "paged-h64-<t>" in texts and any("abc1234" in (t or "") for t in texts)
    dashed = [ln for ln in root.iter(f"{ns}line") if ln.get("stroke-dasharray")]
    assert len(dashed) == 2


def test_script_keeps_its_defaults(script, bench):
    """The wrapper: the module's logic, the script's own defaults and flags."""
    args = script.bench_sparse_mla.build_parser(script_out=script.ROOT / "docs" / "results")
    args = args.parse_args(
        ["--iterations", "10", "--xla-chunks", "1024", "--kernel-config", "32", "2"]
    )
    assert args.out == ROOT / "docs" / "results" and args.impl == "mosaic-gpu"
    assert (args.iterations, args.xla_chunks, args.kernel_config) == (10, [1024], [32, 2])
    assert not bench.is_smoke(args) and not hasattr(args, "overwrite")
    assert script.bench_sparse_mla is bench
    names = {n for n in vars(script) if not n.startswith("_")}
    assert names <= {"annotations", "sys", "Path", "bench_sparse_mla", "ROOT", "main"}


def test_smoke_not_a_measurement_in_bench_mode(bench, monkeypatch):
    """``attn bench``'s conventions: smoke off a GPU unless --full or --smoke."""
    parser = bench.build_parser()
    monkeypatch.setattr(bench, "_on_gpu", lambda: False)
    assert bench.is_smoke(parser.parse_args([]))
    assert not bench.is_smoke(parser.parse_args(["--full"]))
    assert bench.is_smoke(parser.parse_args(["--full", "--smoke"]))
    monkeypatch.setattr(bench, "_on_gpu", lambda: True)
    assert not bench.is_smoke(parser.parse_args([]))
    assert parser.parse_args([]).out is None and parser.parse_args([]).impl is None


def test_failing_impl_is_recorded(bench, script, tmp_path, monkeypatch):
    def unavailable(impl, config=None):
        raise NotImplementedError(f"{impl}: not yet")

    monkeypatch.setattr(bench, "load_impl", unavailable)
    result = script.main(["--smoke", "--cases", "flat-*", "--out", str(tmp_path)])
    (row,) = result["rows"]
    assert row["ours_ms"] is None and row["xla_ms"] > 0
    assert row["ours_error"] == "NotImplementedError: mosaic-gpu: not yet"
    assert result["failed"] == 1 and bench.row_failed(row)
    assert "NotImplementedError" in (tmp_path / "sparse_mla_gpu.md").read_text()


def test_distinct_choices(bench):
    rng = np.random.default_rng(0)
    avail = np.array([0, 1, 5, 8, 9, 1000])
    got = bench.distinct_choices(rng, avail, 8)
    assert got.shape == (6, 8) and got.dtype == np.int32
    for row, n in zip(got, avail, strict=True):
        ids = row[row >= 0]
        assert len(ids) == min(n, 8) and len(set(ids.tolist())) == len(ids)
        assert np.all(ids < n) and np.all(row[len(ids) :] == -1)


def _small_case(bench, mode, **kw):
    base = {"num_queries": 24, "top_k_tokens": 32, "dk": 72, "dv": 64}
    if mode == "paged":
        base["page_size"] = 16
    return bench.Case(f"test-{mode}", mode, 3, 40, **{**base, **kw})


@pytest.mark.parametrize("mode", ["flat", "paged"])
def test_rows_per_query_match_the_row_table(bench, mode):
    """The FLOP count's valid keys per query equal ``selected_rows``'s counts."""
    inputs = bench.make_inputs(_small_case(bench, mode), seed=3)
    args, kw = inputs["args"], inputs["kwargs"]
    problem = check_sparse_mla_inputs(*args, **kw)
    names = ("page_size", "q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")
    tables = {k: kw[k] for k in names if k in kw}
    units, _ = sparse_mla_units(problem, *args[1:], **tables)
    _, counts = selected_rows(units, read_block=kw["read_block"])
    np.testing.assert_array_equal(np.asarray(counts), inputs["rows_per_query"])
    assert (inputs["rows_per_query"] < 32).any()  # early positions: -1 padded


def test_write_inputs_are_the_cases_newest_tokens(bench):
    """``write_inputs``: each query token's slot is its own position in its request's
    pages, so the wrapper writes the new rows where the case's attention reads them:
    the reference wrapper equals the reference attention over the cache written by
    ``paged_write_back`` (q rebuilt from ``ql``, ``qpe``)."""
    import attn_reference

    case = _small_case(bench, "paged")
    inputs = bench.make_inputs(case, seed=5)
    args, kw = inputs["args"], inputs["kwargs"]
    w = bench.write_inputs(case, args, kw)
    ps = case.page_size
    loc = np.asarray(w["loc"])
    assert len(set(loc.tolist())) == loc.size  # one slot per new token
    page_of = np.asarray(kw["page_indices"])[
        np.asarray(kw["cu_kv_lens"])[np.asarray(kw["q_seq_id"])] // ps
        + np.asarray(args[3][0]) // ps
    ]
    np.testing.assert_array_equal(loc // ps, page_of)
    np.testing.assert_array_equal(loc % ps, np.asarray(args[3][0]) % ps)
    out, cache = attn_reference.prefill_write_and_attend_ragged(
        *w.values(), kv_lora_rank=case.dv, page_size=ps, sm_scale=bench.SM_SCALE
    )
    q = jnp.concatenate([w["ql"], w["qpe"]], axis=-1)[None]
    want = sparse_mla_attention(q, cache, *args[2:], **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("calls", [1, 3])
def test_carried_calls_feed_each_new_cache_to_the_next(bench, calls):
    """``carried_calls``: ``calls`` calls, each on the cache the last one returned (a
    bare new cache, or a tuple ending with it), the caller's cache left as it was."""
    cache, step = jnp.arange(4.0), jnp.float32(10)

    def write(x, cache):
        return cache * 2 + x

    def write_and_read(x, cache):
        return jnp.stack([cache.sum(), cache[0]]), write(x, cache)

    want = np.arange(4.0)
    for _ in range(calls):
        want = want * 2 + 10
    got = bench.carried_calls(write, 1, calls)(step, cache)
    np.testing.assert_array_equal(np.asarray(got), want)
    total, got = bench.carried_calls(write_and_read, 1, calls)(step, cache)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert float(total) == float(((want - 10) / 2).sum())  # read by the last call; first element
    np.testing.assert_array_equal(np.asarray(cache), np.arange(4.0))


# chunk 5: several chunks and a short last one; 512 (the whole case in one chunk) is slow
@pytest.mark.parametrize("chunk", [5, pytest.param(512, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["flat", "paged"])
def test_xla_baseline_equals_reference(bench, mode, chunk):
    inputs = bench.make_inputs(_small_case(bench, mode), seed=4)
    args, kw = inputs["args"], inputs["kwargs"]
    got = bench.xla_sparse_mla(*args, chunk=chunk, **kw)
    want = sparse_mla_attention(*args, **kw)
    assert got.shape == want.shape and got.dtype == jnp.float32
    got, want = np.asarray(got), np.asarray(want)
    # bf16 probabilities in the value product: about 2**-9 relative.
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 5e-3, err
    np.testing.assert_allclose(got, want, atol=3e-2)


def test_xla_flat_units_with_read_block(bench):
    """Unit ids with read_block > 1, -1 and causal cuts: still the reference's answer."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 6, 2, 40)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((2, 45, 40)), jnp.bfloat16)
    idx = np.stack([rng.permutation(3) for _ in range(12)]).reshape(2, 6, 3).astype(np.int32)
    idx[0, 0, 1] = -1
    pos = rng.integers(0, 50, (2, 6)).astype(np.int32)
    kw = {"sm_scale": 0.2, "kv_lora_rank": 32, "read_block": 16}
    got = np.asarray(bench.xla_sparse_mla(q, kv, jnp.asarray(idx), jnp.asarray(pos), **kw))
    want = np.asarray(sparse_mla_attention(q, kv, idx, pos, **kw))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
