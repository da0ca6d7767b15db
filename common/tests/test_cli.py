"""The ``attn`` command: info, run (small shapes), bench smoke (the ranker suite and
``attn bench sparse-mla``), argument errors, exit status, output folders, timing,
--json, --version and the help texts."""

import json
import os
import subprocess
import sys

import pytest

from attn_common import bench, bench_sparse_mla, cli, dispatch

OFF_GPU = dispatch.device_class() not in ("gpu", "hopper")


def _exit_code(argv) -> int:
    """``cli.main(argv)``'s status, also when argparse exits through SystemExit."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "jax " in out and "devices" in out and "backends:" in out
    for name in dispatch.KNOWN_BACKENDS:
        assert name in out
    assert "ranker_attention" in out


def test_info_as_a_command():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [sys.executable, "-m", "attn_common.cli", "info"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "dispatch on the default device" in proc.stdout


def test_version(capsys):
    assert _exit_code(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attn-common ")
    for name in dispatch.KNOWN_BACKENDS:
        assert f"{name}:" in out
    assert "jax " in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["run", "ranker", "--batch", "0"], "--batch: got 0, expected a positive int"),
        (["run", "ranker", "--batch", "-1"], "--batch: got -1"),
        (["run", "ranker", "--batch", "two"], "--batch: got 'two'"),
        (["run", "ranker", "--iterations", "0"], "--iterations: got 0"),
        (["run", "ranker", "--seed", "-1"], "--seed: got -1, expected 0 <= seed"),
        (["run", "ranker", "--seed", str(2**70)], f"--seed: got {2**70}"),
        (["run", "ranker", "--implementation", "cuda"], "invalid choice: 'cuda'"),
        (["run", "sparse-mla", "--batch", "2"], "does not apply to sparse-mla"),
        (["run", "phoenix"], "invalid choice: 'phoenix'"),
        (["bench", "--iterations", "-3"], "--iterations: got -3"),
        (["bench", "--iterations", "0"], "--iterations: got 0"),
        (["bench", "--seed", "-1"], "--seed: got -1"),
        (["bench", "--seed", str(2**64)], "expected 0 <= seed"),
        (["bench", "--cases", "nope"], "invalid choice: 'nope'"),
        (["bench", "--implementation", "cuda"], "invalid choice: 'cuda'"),
        (["bench", "ranker", "--iterations", "0"], "--iterations: got 0"),
        (["bench", "nope"], "invalid choice: 'nope'"),
        (["bench", "sparse-mla", "--iterations", "0"], "--iterations: got 0"),
        (["bench", "sparse-mla", "--impl", "cuda"], "invalid choice: 'cuda'"),
        (["bench", "sparse-mla", "--cases", "nope"], "--cases: ['nope'] match none of"),
        (["bench", "sparse-mla", "--no-ours"], "unrecognized arguments: --no-ours"),
        (["bench", "--iterations", "5", "sparse-mla"], "before the suite name 'sparse-mla'"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, needle, capsys):
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


@pytest.mark.skipif(not OFF_GPU, reason="on a GPU the suite's cases run as asked")
def test_bench_cases_off_gpu_are_refused_not_replaced(capsys, tmp_path):
    assert _exit_code(["bench", "--cases", "phoenix", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--cases: got phoenix" in err and "--full" in err
    assert not (tmp_path / "o" / "ranker_gpu.json").exists()


def test_bench_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert _exit_code(["bench", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "--out: got" in err and "not writable" in err and "Traceback" not in err
    assert _exit_code(["bench", "--out", str(blocker)]) == 2
    assert "which is a file" in capsys.readouterr().err


def test_bench_never_clobbers_results(tmp_path, capsys):
    (tmp_path / "ranker_gpu.json").write_text("{}")
    assert _exit_code(["bench", "--out", str(tmp_path)]) == 2
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
    assert _exit_code(["bench", "sparse-mla", "--out", str(folder)]) == 2
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


def test_run_ranker_small(tmp_path, capsys):
    pytest.importorskip("attn_reference")
    path = tmp_path / "run.json"
    assert cli.main(["run", "ranker", "--small", "--iterations", "2", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "ranker B2 S256" in out and "grads finite: True" in out
    assert "fwd GFLOP/s" in out and "fwd+bwd GFLOP/s" in out and "min/median/max" in out
    assert "forward+backward, compile" in captured.err  # progress lines
    err = float(out.split("dense f64 rel err ")[1].split(";")[0].split(",")[0])
    assert err < 2e-2
    doc = json.loads(path.read_text())
    (row,) = doc["rows"]
    assert row["ok"] and row["fwd"]["n"] == 2 and row["fwd+bwd"]["n"] == 2
    assert row["fwd"]["min_s"] <= row["fwd"]["median_s"] <= row["fwd"]["max_s"]
    assert doc["provenance"]["command"].startswith("attn run ranker")


def test_run_times_fwd_bwd_once_not_plus_forward(monkeypatch):
    """fwd+bwd is the time of one value_and_grad call, never forward + that call."""
    pytest.importorskip("attn_reference")
    timed = []

    def fake_times(fn, *args, repeats=3):
        timed.append(fn)
        fn(*args)
        return [1.0, 2.0, 6.0]

    monkeypatch.setattr(cli, "_times", fake_times)
    row = cli.run_ranker(small=True, implementation="reference", iterations=3)
    assert len(timed) == 2
    assert row["fwd"] == row["fwd+bwd"] == {"min_s": 1.0, "median_s": 2.0, "max_s": 6.0, "n": 3}
    assert row["fwd_gflops"] == pytest.approx(row["flops_fwd"] / 2.0 / 1e9)
    assert row["fwd+bwd_gflops"] == pytest.approx(3.5 * row["flops_fwd"] / 2.0 / 1e9)


def test_run_failed_check_exits_non_zero(monkeypatch, capsys):
    pytest.importorskip("attn_reference")
    monkeypatch.setattr(cli, "RANKER_TOL", 0.0)
    assert cli.main(["run", "ranker", "--small", "--iterations", "1"]) == 1
    captured = capsys.readouterr()
    assert "FAIL (tol 0)" in captured.out and "row(s) failed" in captured.err


def test_run_json_path_checked_before_running(tmp_path, capsys):
    assert _exit_code(["run", "ranker", "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "--json: got" in capsys.readouterr().err
    assert _exit_code(["run", "ranker", "--json", str(tmp_path)]) == 2
    assert "which is a folder" in capsys.readouterr().err


@pytest.mark.slow  # ~7 s on 2 cores; test_run_ranker_small covers `attn run` quickly
def test_run_sparse_mla_small(capsys):
    pytest.importorskip("attn_reference")
    assert cli.main(["run", "sparse-mla", "--small", "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "sparse MLA flat" in out and "sparse MLA ragged" in out
    for part in out.split("dense f64 rel err ")[1:]:
        assert float(part.split()[0].rstrip(",;")) < 1e-3


def test_run_unavailable_backend_is_a_clean_error(capsys, monkeypatch):
    monkeypatch.setattr(dispatch, "installed_backends", lambda: {})
    assert cli.main(["run", "ranker", "--small", "--implementation", "mosaic-gpu"]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "pip install" in err


@pytest.mark.skipif(dispatch.device_class() != "cpu", reason="the device check is for a CPU")
def test_wrong_device_error_names_the_cli_flag(capsys):
    if "pallas-tpu" not in dispatch.installed_backends():
        pytest.skip("attn-pallas-tpu not installed")
    assert cli.main(["run", "sparse-mla", "--small", "--implementation", "pallas-tpu"]) == 2
    err = capsys.readouterr().err
    assert "attn run --interpret" in err and "leave --implementation out" in err


def test_help_lists_shapes_choices_and_defaults(capsys):
    assert _exit_code(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # help wraps lines
    assert "B4 S1152 Hq20/Hkv4 D128" in out and "B2 S256" in out and "flat S256 T8192" in out
    for name in dispatch.KNOWN_BACKENDS:
        assert name in out
    assert "default: 3" in out and "default: 0" in out and "default: 4" in out
    assert _exit_code(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for case in bench.CASE_NAMES:
        assert case in out
    assert "B64 S1152" in out and "attn-results/<timestamp>" in out and "default: 20" in out
    for name in dispatch.KNOWN_BACKENDS:
        assert name in out
    assert "sparse-mla" in out and "attn bench sparse-mla --help" in out
    assert _exit_code(["bench", "sparse-mla", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: attn bench sparse-mla ")
    for flag in ("--impl", "--xla-chunks", "--kernel-config", "--smoke", "--full", "--overwrite"):
        assert flag in out
    for case in (*bench_sparse_mla.CASES, *bench_sparse_mla.SMOKE_CASES):
        assert case.name in out
    assert "attn-results/<timestamp>" in out and "default: 20" in out
    assert _exit_code(["bench", "ranker", "--help"]) == 0
    assert "B64 S1152" in capsys.readouterr().out
    assert _exit_code(["--help"]) == 0
    assert "--version" in capsys.readouterr().out


def test_reference_demo_is_attn_run_all(monkeypatch):
    demo = pytest.importorskip("attn_reference.demo")
    seen = []
    monkeypatch.setattr(demo, "_attn_main", lambda argv: seen.append(argv) or 0)
    assert demo.main(["--small"]) == 0
    assert seen == [["run", "all", "--implementation", "reference", "--small"]]
