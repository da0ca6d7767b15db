"""benchmarks/fp8_cache_error.py runs, its figures are what the format promises, and
docs/fp8_cache.md quotes the table of the committed results (docs/results/fp8_cache_error.*)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


# ~6 s on 2 cores: the format's error bound is checked quickly by
# common/tests/test_fp8_cache.py::test_error_bound, the quoted table by the test below.
@pytest.mark.slow
def test_script_runs_and_fp8_error_is_bounded(tmp_path):
    with load_script(ROOT / "benchmarks" / "fp8_cache_error.py", "fp8_cache_error") as script:
        args = ["--tokens", "512", "--queries", "4", "--heads", "2", "--top-k", "128"]
        result = script.main([*args, "--out", str(tmp_path)])
    assert (tmp_path / "fp8_cache_error.md").read_text().count("\n|") == 2 + 3
    assert [r["data"] for r in result["rows"]] == ["normal", "student-t2", "outlier-channels"]
    for row in result["rows"]:
        # bf16 keeps 8 mantissa bits, e4m3fn 3: FP8's error is the larger, and its worst
        # error is half an e4m3fn step at the top of the group, 16/448 of the group max.
        for key in ("latent_rel_l2", "latent_median_rel_err", "out_rel_l2"):
            assert 0 < row[key]["bf16"] < row[key]["fp8"] < 0.05, (row["data"], key, row[key])
        assert row["latent_max_err_over_group_max"]["fp8"] <= 16 / 448 * (1 + 1e-6)
        assert row["latent_max_err_over_group_max"]["bf16"] <= 2.0**-8


def test_docs_quote_the_committed_table():
    with load_script(ROOT / "benchmarks" / "fp8_cache_error.py", "fp8_cache_error") as script:
        result = json.loads((ROOT / "docs" / "results" / "fp8_cache_error.json").read_text())
        table = script.table(result["rows"])
    doc = (ROOT / "docs" / "fp8_cache.md").read_text()
    quoted = doc.split("<!-- fp8-error-table: docs/results/fp8_cache_error.md -->\n", 1)[1]
    assert quoted.split("\n<!-- end fp8-error-table -->", 1)[0] == table
    results_md = (ROOT / "docs" / "results" / "fp8_cache_error.md").read_text()
    assert table in results_md and result["command"] in results_md
