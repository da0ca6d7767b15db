"""``benchmarks/ranker_fwd_stalls.py analyse``, off a GPU, on the Nsight Compute source
table committed with its results: the reader finds the step loop, and the landmarks
put the ping-pong's *softmax done* arrive where the 3dc38fc profile showed it (before
every exponential of the step), so the check docs/ranker_gpu.md names keeps working."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "ranker_fwd_stalls.py"
TABLE = ROOT / "docs" / "results" / "ranker_fwd_stalls_phoenix_cap_3dc38fc.csv.gz"
PINNED = ROOT / "docs" / "results" / "ranker_fwd_stalls_phoenix_cap_pinned_f8ffa31.csv.gz"


@pytest.fixture(scope="module")
def stalls():
    with load_script(SCRIPT, "ranker_fwd_stalls") as module:
        yield module


def test_reads_the_longest_kernel_table(stalls):
    rows = stalls.read_rows(str(TABLE))
    assert len(rows) == 4744
    assert sum(r.samples for r in rows) == 169054
    hot = max(r.executed for r in rows)
    loop = [r for r in rows if hot / 4 <= r.executed < hot]
    assert sum("MUFU.EX2" in r.source for r in loop) == 66
    assert {r.opcode for r in loop} >= {"MUFU", "HGMMA", "FFMA", "SYNCS"}


@pytest.mark.parametrize(("table", "before"), [(TABLE, 0), (PINNED, 66)])
def test_arrive_position(stalls, capsys, table, before):
    stalls.analyse(str(table), top=5)
    out = capsys.readouterr().out
    arrives = [line for line in out.splitlines() if "mbarrier arrive" in line]
    # Four arrives per step, in SASS order: the schedule barrier's Q K^T sync, K
    # consumed, the schedule barrier's softmax done (before every EX2 as ptxas schedules
    # the shipped code; after all of them when a store pins it), V consumed.
    assert len(arrives) == 4
    assert arrives[2].endswith(f"after {before} of the 66 EX2")
    assert "step loop by region" in out
