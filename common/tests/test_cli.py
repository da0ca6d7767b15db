"""The ``attn`` command: info, run (small shapes), bench smoke (the ranker suite and
``attn bench sparse-mla``), argument errors, exit status, output folders, timing,
--json, --version and the help texts."""

import argparse
import json
import os
import subprocess
import sys

import pytest
from helpers import assert_cli_usage_error, cli_exit_code

from attn_common import cli, cli_args, dispatch

OFF_GPU = dispatch.device_class() not in ("gpu", "hopper")


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
    assert cli_exit_code(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("attn-common ")
    for name in dispatch.KNOWN_BACKENDS:
        assert f"{name}:" in out
    assert "jax " in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["run", "ranker", "--batch", "0"], "--batch: got 0, expected 1 <= value <= 1000000"),
        (["run", "ranker", "--batch", "-1"], "--batch: got -1"),
        (["run", "ranker", "--batch", "two"], "--batch: got 'two'"),
        (["run", "ranker", "--iterations", "0"], "--iterations: got 0"),
        (["run", "ranker", "--seed", "-1"], "--seed: got -1, expected 0 <= value"),
        (["run", "ranker", "--seed", str(2**70)], f"--seed: got {2**70}"),
        (["run", "ranker", "--implementation", "cuda"], "invalid choice: 'cuda'"),
        (["run", "sparse-mla", "--batch", "2"], "does not apply to sparse-mla"),
        (["run", "phoenix"], "invalid choice: 'phoenix'"),
        (["run", "ranker", "--batch", "9" * 20], "--batch: got 99999999999999999999, expected"),
        (["run", "ranker", "--batch", "100000000"], "expected 1 <= value <= 1000000"),
        (["run", "ranker", "--iterations", "9" * 20], "expected 1 <= value <= 10000"),
        (["run", "ranker", "--batch", "1000000"], "need about"),
        (["run", "ranker", "--batch", "1_0"], "--batch: got '1_0', expected a positive int"),
        (["run", "ranker", "--seed", " 7"], "--seed: got ' 7', expected an int"),
        (["run", "ranker", "--iterations", "\u0667"], "--iterations: got '\u0667', expected"),
        (["run", "ranker", "--json", ""], "attn run: error: --json: got '', expected a path"),
        (["run", "ranker", "--bogus"], "attn run: error: unrecognized arguments: --bogus"),
        (["run"], "attn run: error: the following arguments are required: op"),
        (["--bogus"], "attn: error: unrecognized arguments: --bogus"),
        ([], "a command is required, one of: info, run"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, needle, capsys):
    assert_cli_usage_error(argv, needle, capsys)


@pytest.mark.parametrize("text", ["0", "0.01", ".25", "0.", "1e-3", "4.9E-1", "-0"])
def test_bounded_float_takes_plain_decimals(text):
    assert cli_args.bounded_float(0.0, 0.5)(text) == float(text)


@pytest.mark.parametrize(
    "text",
    # float() takes every one of these but the last four
    [
        "0.0_1",
        "1_0e-2",
        " 0.1",
        "0.1\n",
        "+0.1",
        "nan",
        "inf",
        "-inf",
        "\u0660.1",
        "",
        ".",
        "1e",
        "0x1",
    ],
)
def test_bounded_float_refuses_what_is_not_a_plain_decimal(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a number \(a decimal number\)"):
        cli_args.bounded_float(0.0, 0.5)(text)


@pytest.mark.parametrize("text", ["0.5", "0.7", "-0.01", "1e9"])
def test_bounded_float_refuses_out_of_range(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected 0 <= value < 0.5$"):
        cli_args.bounded_float(0.0, 0.5)(text)


def test_run_ranker_small(tmp_path, capsys):
    pytest.importorskip("attn_reference")
    path = tmp_path / "run.json"
    assert cli.main(["run", "ranker", "--small", "--iterations", "2", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "ranker B2 S256" in out and "grads finite: True" in out
    assert "fwd GFLOP/s" in out and "fwd+bwd GFLOP/s" in out and "min/median/max" in out
    assert "forward+backward, compile + 2 timed calls" in captured.err  # progress lines
    err = float(out.split("dense f64 rel err ")[1].split(";")[0].split(",")[0])
    assert err < 2e-2
    doc = json.loads(path.read_text())
    (row,) = doc["rows"]
    assert row["ok"] and row["fwd"]["n"] == 2 and row["fwd+bwd"]["n"] == 2
    assert row["fwd"]["min_s"] <= row["fwd"]["median_s"] <= row["fwd"]["max_s"]
    assert doc["provenance"]["command"].startswith("attn run ranker")


def _stand_in(q, k, v, bounds, **kwargs):
    """A ranker attention stand-in for the tests of the command around it."""
    return q * 2


def test_run_times_fwd_bwd_once_not_plus_forward(monkeypatch):
    """fwd+bwd is the time of one value_and_grad call, never forward + that call. A
    stand-in backend, unchecked, keeps this quick (test_run_ranker_small runs the real one)."""
    timed = []

    def fake_times(fn, *args, repeats=3, keep=None, warmup=True):
        timed.append(fn)
        fn(*args)
        return [1.0, 2.0, 6.0]

    monkeypatch.setattr(cli, "_times", fake_times)
    monkeypatch.setattr(cli, "select_backend", lambda *a, **k: ("stand-in", _stand_in))
    monkeypatch.setattr(cli, "_reference_fn", lambda *a: None)
    row = cli.run_ranker(small=True, implementation="reference", iterations=3)
    assert len(timed) == 2
    assert row["fwd"] == row["fwd+bwd"] == {"min_s": 1.0, "median_s": 2.0, "max_s": 6.0, "n": 3}
    assert row["fwd_gflops"] == pytest.approx(row["flops_fwd"] / 2.0 / 1e9)
    assert row["fwd+bwd_gflops"] == pytest.approx(3.5 * row["flops_fwd"] / 2.0 / 1e9)


def test_run_failed_check_exits_non_zero(monkeypatch, capsys):
    """A stand-in backend, checked at tolerance 0, keeps this quick (test_run_ranker_small
    runs the real one)."""
    monkeypatch.setattr(cli, "select_backend", lambda *a, **k: ("stand-in", _stand_in))
    monkeypatch.setattr(cli, "_reference_fn", lambda *a: None)
    monkeypatch.setattr(cli, "RANKER_TOL", 0.0)
    assert cli.main(["run", "ranker", "--small", "--iterations", "1"]) == 1
    captured = capsys.readouterr()
    assert "FAIL (tol 0)" in captured.out and "row(s) failed" in captured.err
    assert "wall clock over 1 call after" in captured.out
    # the progress lines count in the singular too (they said "compile + 1 timed calls")
    assert "forward, compile + 1 timed call\n" in captured.err
    assert "forward+backward, compile + 1 timed call\n" in captured.err
    assert "1 timed calls" not in captured.err


def test_timing_note_counts_calls_and_says_when_compile_is_included():
    """Interpret mode has no warm-up call: its first timed call compiles."""
    assert cli._timing_note(1, False) == "compile + 1 timed call"
    assert cli._timing_note(3, False) == "compile + 3 timed calls"
    assert cli._timing_note(1, True) == "1 timed call (compile included)"
    assert cli._timing_note(2, True) == "2 timed calls (compile included)"


def test_run_json_path_checked_before_running(tmp_path, capsys):
    """--json follows --out's rule: a missing folder is created; an existing file is
    refused without --overwrite; a folder is refused. Checked before anything runs."""
    existing = tmp_path / "x.json"
    existing.write_text("{}")
    assert cli_exit_code(["run", "ranker", "--json", str(existing)]) == 2
    assert "which exists; pass --overwrite" in capsys.readouterr().err
    assert existing.read_text() == "{}"
    assert cli_exit_code(["run", "ranker", "--json", str(tmp_path)]) == 2
    assert "which is a folder" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli_exit_code(["run", "ranker", "--json", str(blocker / "x.json")]) == 2
    err = capsys.readouterr().err
    assert f"--json: got {str(blocker / 'x.json')!r}, but {str(blocker)!r} is a file" in err
    assert cli_exit_code(["run", "ranker", "--json", str(existing / "deeper" / "x.json")]) == 2
    assert f"but {str(existing)!r} is a file, not a folder" in capsys.readouterr().err
    missing = tmp_path / "no" / "such" / "x.json"
    assert cli_args.check_out_file(missing) is None and missing.parent.is_dir()
    assert cli_args.check_out_file(existing, overwrite=True) is None


@pytest.mark.slow  # ~7 s on 2 cores; test_run_ranker_small covers `attn run` quickly
def test_run_sparse_mla_small(capsys):
    pytest.importorskip("attn_reference")
    assert cli.main(["run", "sparse-mla", "--small", "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "sparse MLA flat" in out and "sparse MLA ragged" in out
    for part in out.split("dense f64 rel err ")[1:]:
        assert float(part.split()[0].rstrip(",;")) < 1e-3


@pytest.mark.parametrize("command", sorted(cli.BACKEND_COMMANDS))
def test_backend_command_without_its_backend_says_what_to_install(command, capsys, monkeypatch):
    """`attn bench` / `attn tune` without a backend that adds them: one line naming the
    wheels and their install commands (argparse alone said "invalid choice: 'bench'")."""
    monkeypatch.setattr(cli, "installed_backends", lambda: {"reference": "attn_reference"})
    backends = cli.BACKEND_COMMANDS[command]
    assert cli_exit_code([command]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error: " in err, err
    for backend in backends:
        info = dispatch.KNOWN_BACKENDS[backend]
        assert info["dist"] in err and info["install"] in err, err
    assert "is not installed" in err or "neither of which is installed" in err, err
    monkeypatch.setattr(cli, "installed_backends", lambda: {backends[-1]: "module"})
    monkeypatch.setattr(cli, "backend_commands", lambda: {})
    assert_cli_usage_error([command, "--help"], "installed but did not load", capsys)


def test_a_command_two_backends_add_goes_to_the_default_devices(monkeypatch):
    """`attn bench` from attn-mosaic-gpu and attn-pallas-tpu: the TPU backend's on a TPU,
    the Hopper backend's (the first by name) on any other device; a command one backend
    adds never asks for the device."""
    claims = [("mosaic-gpu", "add_gpu"), ("pallas-tpu", "add_tpu")]
    for device, want in [("tpu", "pallas-tpu"), ("hopper", "mosaic-gpu"), ("gpu", "mosaic-gpu"),
                         ("cpu", "mosaic-gpu")]:  # fmt: skip
        monkeypatch.setattr(cli, "device_class", lambda *a, d=device: d)
        assert cli._claim_for_this_device(claims)[0] == want, device
    monkeypatch.setattr(cli, "device_class", lambda *a: pytest.fail("device looked up"))
    assert cli._claim_for_this_device(claims[1:]) == ("pallas-tpu", "add_tpu")


def test_help_says_who_adds_bench_and_tune(capsys):
    assert cli_exit_code(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "`attn bench` and `attn tune` come with the pallas-tpu backend (attn-pallas-tpu, for a "
        "TPU)" in out
    )
    for name in ("bench", "tune"):
        assert (
            f"with both installed, `attn {name}` is pallas-tpu's on a TPU, else mosaic-gpu's" in out
        )


def test_sparse_mla_row_names_use_one_meaning_per_letter(monkeypatch):
    """S counts query tokens (the new ones, packed, in ragged rows) and T cache tokens in
    both rows; a stand-in backend, unchecked, keeps this quick."""
    import jax.numpy as jnp

    def zeros(q, *args, **kwargs):
        return jnp.zeros((*q.shape[:-1], 512), jnp.float32)

    monkeypatch.setattr(cli, "select_backend", lambda *a, **k: ("stand-in", zeros))
    monkeypatch.setattr(cli, "_reference_fn", lambda *a: None)
    monkeypatch.setattr(cli, "_sparse_check", lambda *a, **k: ("not checked", False))
    flat, ragged = cli.run_sparse_mla(small=True, iterations=1)
    shape = cli.SPARSE_SHAPES["small"]
    assert f"flat S{shape['seq']} T{shape['ctx']} H{shape['heads']}" in flat["op"]
    assert f"S{sum(shape['new'])} T{sum(shape['lens'])} H{shape['heads']}" in ragged["op"]


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
    assert cli_exit_code(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # help wraps lines
    assert "B4 S1152 Hq20/Hkv4 D128" in out and "B2 S256" in out and "flat S256 T8192" in out
    for name in dispatch.KNOWN_BACKENDS:
        assert name in out
    assert "default: 3" in out and "default: 0" in out and "default: 4" in out
    assert cli_exit_code(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--version" in out
    assert "`attn bench` and `attn tune` come with the mosaic-gpu backend (attn-mosaic-gpu" in out
    assert "S query tokens (the new tokens, in ragged rows), T cache tokens" in " ".join(
        cli._run_epilog().split()
    )


def test_reference_demo_is_attn_run_all(monkeypatch):
    demo = pytest.importorskip("attn_reference.demo")
    seen = []
    monkeypatch.setattr(demo, "_attn_main", lambda argv: seen.append(argv) or 0)
    assert demo.main(["--small"]) == 0
    assert seen == [["run", "all", "--implementation", "reference", "--small"]]


def test_sizes_that_cannot_fit_are_refused_up_front(monkeypatch, capsys):
    """The bytes are estimated from the shape and compared with the device's memory
    before anything is allocated: the same batch is refused when memory is short."""
    shape = cli.RANKER_SHAPES["full"]
    need = cli.ranker_bytes(shape, 8, "reference")
    # q, k, v, out and their gradients in bf16, plus the reference's f32 scores/probs
    assert need == 2 * 8 * 1152 * (20 + 8 + 20) * 128 * 2 + 2 * 8 * 20 * 1152**2 * 4
    assert cli.ranker_bytes(shape, 8, "mosaic-gpu") == 2 * 8 * 1152 * (20 + 8 + 20) * 128 * 2
    monkeypatch.setattr(cli, "available_memory", lambda: (need - 1, "available host memory"))
    argv = ["run", "ranker", "--batch", "8", "--implementation", "reference"]
    assert cli_exit_code(argv) == 2
    err = capsys.readouterr().err
    assert "--batch: got 8" in err and "more than the" in err and "Traceback" not in err
    ran = []
    monkeypatch.setattr(cli, "available_memory", lambda: (need, "available host memory"))
    monkeypatch.setattr(cli, "cmd_run", lambda args: ran.append(args.batch) or 0)
    assert cli_exit_code(argv) == 0 and ran == [8]


def test_available_memory_is_known_here():
    have = cli_args.available_memory()
    assert have is not None and have[0] > 0


def test_interpret_small_shapes_are_tinier():
    for table in (cli.RANKER_SHAPES, cli.SPARSE_SHAPES):
        tiny, small = table["small-interpret"], table["small"]
        assert all(tiny[k] <= small[k] for k in tiny if isinstance(tiny[k], int))
        assert tiny != small
    assert cli._shape_name(True, True) == "small-interpret"
    assert cli._shape_name(True, False) == "small" and cli._shape_name(False, True) == "full"


def test_provenance_commit_from_the_working_directory(tmp_path, monkeypatch):
    """The commit comes from the checkout the command runs in, not from where the
    package is installed; outside any checkout it says so."""
    monkeypatch.delenv("ATTN_PROVENANCE_COMMIT", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    monkeypatch.chdir(repo)
    assert cli_args.provenance([])["commit"] == head
    (repo / "f").write_text("y")
    assert cli_args.provenance([])["commit"] == head + "+dirty"


def test_attn_gives_xla_enough_cpu_threads_for_the_interpreter(tmp_path):
    """`attn` raises NPROC (XLA's CPU pool size) to 16 before JAX starts: the Mosaic GPU
    interpreter's warpgroup programs block on each other, and a pool of one thread (one
    core) hung `attn run sparse-mla --implementation mosaic-gpu --interpret --small`.
    A larger NPROC is kept. In a fresh process (this one's JAX has started)."""
    code = (
        "import os, sys\n"
        "from attn_common import cli\n"
        "cli.cmd_run = lambda args: print(os.environ['NPROC']) or 0\n"
        "for given in (None, '1', '32'):\n"
        "    os.environ.pop('NPROC', None)\n"
        "    if given is not None:\n"
        "        os.environ['NPROC'] = given\n"
        "    assert cli.main(['run', 'ranker', '--implementation', 'reference']) == 0\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["16", "16", "32"]
