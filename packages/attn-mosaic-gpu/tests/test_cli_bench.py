"""The ``attn bench`` and ``attn tune`` commands this backend adds to ``attn``
(``attn_mosaic_gpu.cli``, reached through the backend's entry point): argument errors,
output folders, the smoke runs off a GPU, failed rows and the help texts."""

import json
import sys

import pytest
from helpers import assert_cli_usage_error, cli_exit_code

from attn_common import cli, dispatch
from attn_mosaic_gpu import bench, bench_sparse_mla

OFF_GPU = dispatch.device_class() not in ("gpu", "hopper")


def test_the_commands_come_from_the_entry_point():
    assert {"bench", "tune"} <= set(cli.backend_commands())
    assert cli.backend_commands()["bench"][0] == "mosaic-gpu"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["bench", "--iterations", "-3"], "--iterations: got -3"),
        (["bench", "--iterations", "0"], "--iterations: got 0"),
        (["bench", "--seed", "-1"], "--seed: got -1"),
        (["bench", "--seed", str(2**64)], "expected 0 <= value"),
        (["bench", "--cases", "nope"], "invalid choice: 'nope'"),
        (["bench", "--implementation", "cuda"], "invalid choice: 'cuda'"),
        (["bench", "ranker", "--iterations", "0"], "--iterations: got 0"),
        (["bench", "nope"], "invalid choice: 'nope'"),
        (["bench", "sparse-mla", "--iterations", "0"], "--iterations: got 0"),
        (["bench", "sparse-mla", "--implementation", "cuda"], "invalid choice: 'cuda'"),
        (["bench", "sparse-mla", "--cases", "nope"], "--cases: ['nope'] match none of"),
        (["bench", "sparse-mla", "--no-ours"], "unrecognized arguments: --no-ours"),
        (["bench", "--iterations", "5", "sparse-mla"], "before the suite name 'sparse-mla'"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, needle, capsys):
    assert_cli_usage_error(argv, needle, capsys)


def test_help_lists_cases_and_defaults(capsys):
    assert cli_exit_code(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for case in bench.CASE_NAMES:
        assert case in out
    assert "B64 S1152" in out and "attn-results/<timestamp>" in out and "default: 20" in out
    for name in dispatch.KNOWN_BACKENDS:
        assert name in out
    assert "sparse-mla" in out and "attn bench sparse-mla --help" in out
    assert cli_exit_code(["bench", "sparse-mla", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: attn bench sparse-mla ")
    for flag in (
        "--implementation",
        "--xla-chunks",
        "--kernel-config",
        "--smoke",
        "--full",
        "--overwrite",
    ):
        assert flag in out
    for case in (*bench_sparse_mla.CASES, *bench_sparse_mla.SMOKE_CASES):
        assert case.name in out
    assert "attn-results/<timestamp>" in out and "default: 20" in out
    assert cli_exit_code(["bench", "ranker", "--help"]) == 0
    assert "B64 S1152" in capsys.readouterr().out


@pytest.mark.skipif(not OFF_GPU, reason="on a GPU the suite's cases run as asked")
def test_bench_cases_off_gpu_are_refused_not_replaced(capsys, tmp_path):
    assert cli_exit_code(["bench", "--cases", "phoenix", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--cases: got phoenix" in err and "--full" in err
    assert not (tmp_path / "o" / "ranker_gpu.json").exists()


def test_bench_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli_exit_code(["bench", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert f"--out: got {str(blocker / 'sub')!r}, but {str(blocker)!r} is a file" in err
    assert "Traceback" not in err
    assert cli_exit_code(["bench", "--out", str(blocker)]) == 2
    assert "which is a file" in capsys.readouterr().err
    assert cli_exit_code(["bench", "--out", ""]) == 2
    assert "--out: got '', expected a path" in capsys.readouterr().err


def test_bench_never_clobbers_results(tmp_path, capsys):
    (tmp_path / "ranker_gpu.json").write_text("{}")
    assert cli_exit_code(["bench", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "already holds ranker_gpu.json" in err and "--overwrite" in err
    assert (tmp_path / "ranker_gpu.json").read_text() == "{}"


def test_bench_default_out_is_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = bench.default_out_dir(), None
    first.mkdir(parents=True)
    second = bench.default_out_dir()
    assert first.parent == second.parent == tmp_path / "attn-results"
    assert first != second and not second.exists()
    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).out is None  # resolved at run time, never docs/results


@pytest.mark.skipif(not OFF_GPU, reason="the smoke subset runs off a GPU only")
def test_bench_smoke_off_gpu(tmp_path, capsys, monkeypatch):
    pytest.importorskip("attn_reference")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no matplotlib: no PNG
    assert cli.main(["bench", "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "meant for a GPU" in out
    (folder,) = (tmp_path / "attn-results").iterdir()
    result = json.loads((folder / "ranker_gpu.json").read_text())
    assert result["smoke"] and {r["impl"] for r in result["rows"]} == {
        "ours-reference",
        "xla-dense-mask",
    }
    assert all(r["ms"] > 0 for r in result["rows"]) and result["failed"] == 0
    assert result["provenance"]["command"] == "attn bench --iterations 1"
    assert result["provenance"]["commit"]
    md = (folder / "ranker_gpu.md").read_text()
    assert md.startswith("Commit: ") and "| small-d64 | ours-reference | fwd |" in md
    assert "Smoke run, not a measurement" in md and "smoke run, not a measurement" in out
    assert "nan" not in md and "ceilings: not measured" in md
    assert not (folder / "ranker_gpu.png").exists()
    assert out.count("matplotlib not installed") == 1
    wrote = next(line for line in out.splitlines() if line.startswith("wrote "))
    assert "ranker_gpu.json" in wrote and ".png" not in wrote


def test_bench_suite_name_is_optional(tmp_path, monkeypatch):
    """`attn bench [flags]` is `attn bench ranker [flags]`; `sparse-mla` runs the other."""
    ran = []

    def fake(name):
        return lambda args: ran.append((name, args)) or {"failed": 0}

    monkeypatch.setattr(bench, "run", fake("ranker"))
    monkeypatch.setattr(bench_sparse_mla, "run", fake("sparse-mla"))
    flags = ["--iterations", "3", "--seed", "7", "--no-ours"]
    assert cli.main(["bench", *flags, "--out", str(tmp_path / "a")]) == 0
    assert cli.main(["bench", "ranker", *flags, "--out", str(tmp_path / "b")]) == 0
    assert cli.main(["bench", "sparse-mla", "--iterations", "3", "--out", str(tmp_path)]) == 0
    assert [name for name, _ in ran] == ["ranker", "ranker", "sparse-mla"]
    plain, named, sparse = (args for _, args in ran)
    for args in (plain, named):
        assert (args.suite, args.iterations, args.seed, args.no_ours) == ("ranker", 3, 7, True)
    assert (plain.out, named.out) == (tmp_path / "a", tmp_path / "b")
    assert sparse.suite == "sparse-mla" and sparse.iterations == 3 and sparse.impl is None
    assert sparse.xla_chunks == [256, 512, 1024] and sparse.out == tmp_path


@pytest.mark.skipif(not OFF_GPU, reason="the smoke run is chosen off a GPU only")
def test_bench_sparse_mla_smoke_off_gpu(tmp_path, capsys, monkeypatch):
    pytest.importorskip("attn_reference")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "sparse-mla", "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "meant for a Hopper GPU" in out and "not a measurement" in out
    assert "(tiny shapes, 1 iteration, wall clock)" in out  # was "1 iterations"
    (folder,) = (tmp_path / "attn-results").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [
        "sparse_mla_gpu.json", "sparse_mla_gpu.md", "sparse_mla_gpu.svg"
    ]  # fmt: skip
    result = json.loads((folder / "sparse_mla_gpu.json").read_text())
    assert result["smoke"] and result["impl"] == "reference" and result["failed"] == 0
    assert [r["case"] for r in result["rows"]] == ["flat-smoke", "paged-smoke"]
    for row in result["rows"]:
        assert row["xla_ms"] > 0 and row["ours_ms"] > 0 and row["rel_l2_ours_vs_xla"] < 1e-2
    assert result["provenance"]["command"] == "attn bench sparse-mla --iterations 1"
    md = (folder / "sparse_mla_gpu.md").read_text()
    assert "| flat-smoke |" in md and "| paged-smoke |" in md and "not a measurement" in md
    # the same folder again: refused without --overwrite, like the ranker suite
    assert cli_exit_code(["bench", "sparse-mla", "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "attn bench sparse-mla: error: --out" in err and "--overwrite" in err


def test_bench_sparse_mla_failed_row_exits_non_zero(tmp_path, monkeypatch, capsys):
    def unavailable(impl, config=None):
        raise NotImplementedError(f"{impl}: not yet")

    monkeypatch.setattr(bench_sparse_mla, "load_impl", unavailable)
    argv = ["bench", "sparse-mla", "--smoke", "--cases", "flat-*", "--out", str(tmp_path)]
    assert cli.main(argv) == 1
    assert "1 of 1 rows failed" in capsys.readouterr().err
    result = json.loads((tmp_path / "sparse_mla_gpu.json").read_text())
    assert result["failed"] == 1 and "NotImplementedError" in result["rows"][0]["ours_error"]


def test_bench_failed_row_exits_non_zero(tmp_path, monkeypatch, capsys):
    def broken(case, bounds, mask, scale):
        def fn(q, k, v):
            raise RuntimeError("kernel exploded")

        return fn

    monkeypatch.setattr(bench, "implementations", lambda *a, **k: {"ours-broken": broken})
    monkeypatch.setattr(bench, "_on_gpu", lambda: False)
    assert cli.main(["bench", "--iterations", "1", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "kernel exploded" in captured.out and "rows failed" in captured.err
    result = json.loads((tmp_path / "ranker_gpu.json").read_text())
    assert result["failed"] == 2


class FakeCupti:
    """CUPTI as ``bench`` reads it: each call runs kernels ``a`` (1 ms) and ``b`` (2 ms);
    recorded back to back, ``b`` of a call is listed after the next call's ``a`` (a
    conditional's kernel listed late), so equal slices of the record mix calls."""

    def __init__(self, monkeypatch, *, late: bool, lost_alone: bool = False):
        self.late, self.lost_alone, self.calls, self.pending = late, lost_alone, 0, []
        monkeypatch.setattr(bench, "mosaic_gpu_ext", lambda: None)
        monkeypatch.setattr(bench, "cupti_init", self.init)
        monkeypatch.setattr(bench, "cupti_timings", self.timings)
        self.init()

    def init(self):
        self.record, self.held = [], None

    def fn(self):
        self.calls += 1
        self.record.append(("a", 1.0))
        if self.late and self.held is None:
            self.held = ("b", 2.0)  # listed after the next call's first kernel
        else:
            self.record.append(("b", 2.0))
        return self.calls

    def timings(self, finalize):
        assert finalize
        alone = len(self.record) == 1  # one call recorded on its own, its late kernel held
        if self.held is not None and not (self.lost_alone and alone):
            self.record.append(self.held)
        return self.record


@pytest.mark.parametrize("late", [False, True])
def test_cupti_call_ms_per_call_device_time(monkeypatch, late):
    fake = FakeCupti(monkeypatch, late=late)
    assert bench.cupti_call_ms(fake.fn, (), 4) == [3.0] * 4
    # the warm-up, 4 calls recorded together and, where their slices mix, 4 alone
    assert fake.calls == (9 if late else 5)


def test_cupti_call_ms_refuses_a_lone_call_missing_its_late_kernel(monkeypatch):
    # On the H200 a call recorded alone did not list its conditional's late kernel: its
    # sum (1 ms here) would pass for the call's time. No CUPTI time; wall clock instead.
    fake = FakeCupti(monkeypatch, late=True, lost_alone=True)
    assert bench.cupti_call_ms(fake.fn, (), 4) is None
    monkeypatch.setattr(bench, "_on_gpu", lambda: True)
    ms, method = bench.device_ms(fake.fn, iterations=2)
    assert method == "wallclock" and ms > 0
