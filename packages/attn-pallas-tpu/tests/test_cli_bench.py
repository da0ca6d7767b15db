"""``attn bench sparse-mla`` on a TPU is this backend's suite (``attn_pallas_tpu.cli``,
reached through the backend's entry point): the command goes to it when the default
device is a TPU, its flags reach ``bench_sparse_mla``, and off a TPU it refuses in one
line. The device query is monkeypatched and the suite itself is not run (its smoke run
is test_bench_sparse_mla.py's). The same for ``attn bench ranker`` (``bench_ranker``,
smoked in test_bench_ranker.py)."""

from __future__ import annotations

import pytest
from helpers import assert_cli_usage_error, cli_exit_code

from attn_common import cli
from attn_pallas_tpu import _suite, bench_ranker, bench_sparse_mla

SUITES = {"sparse-mla": bench_sparse_mla, "ranker": bench_ranker}
# suite -> (a phrase of its --help description, its flags beyond the common ones)
HELP = {
    "sparse-mla": ("bytes and MXU bounds", ()),
    "ranker": ("the XLA reference where it fits", ("--modes",)),
}


@pytest.fixture
def only_tpu_backend(monkeypatch):
    """The installed backends as on a TPU host: the reference and attn-pallas-tpu."""
    monkeypatch.setattr(
        cli, "installed_backends", lambda: {"pallas-tpu": "attn_pallas_tpu", "reference": "x"}
    )


@pytest.fixture
def calls(monkeypatch) -> dict[str, list]:
    """Each suite's ``run`` (``bench_sparse_mla.run``, ``bench_ranker.run``) replaced by a
    recorder of its arguments (exit 0): suite name -> the recorded arguments."""
    recorded: dict[str, list] = {name: [] for name in SUITES}
    for name, module in SUITES.items():
        monkeypatch.setattr(module, "run", lambda args, c=recorded[name]: c.append(args) or 0)
    return recorded


def _on(monkeypatch, device: str) -> None:
    """The default device's class as ``attn`` and the suite see it."""
    monkeypatch.setattr(cli, "device_class", lambda *a: device)
    monkeypatch.setattr(_suite, "device_class", lambda *a: device)


def test_bench_is_the_tpu_backends_on_a_tpu(monkeypatch):
    """Whatever else is installed (attn-mosaic-gpu adds `attn bench` too)."""
    _on(monkeypatch, "tpu")
    assert cli.backend_commands()["bench"][0] == "pallas-tpu"


def test_attn_bench_sparse_mla_runs_the_tpu_suite_with_its_flags(monkeypatch, calls, tmp_path):
    _on(monkeypatch, "tpu")
    argv = ["bench", "sparse-mla", "--iterations", "3", "--cases", "overlap", "eager",
            "--sweep", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    (args,) = calls["sparse-mla"]
    assert not calls["ranker"]
    assert (args.iterations, args.cases, args.sweep, args.smoke) == (3, ["overlap", "eager"],
                                                                     True, False)  # fmt: skip
    assert args.out == tmp_path and args.report is None


def test_attn_bench_ranker_runs_the_tpu_ranker_suite_with_its_flags(monkeypatch, calls, tmp_path):
    _on(monkeypatch, "tpu")
    argv = ["bench", "ranker", "--iterations", "4", "--cases", "phoenix", "--sweep",
            "--modes", "fwd", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    (args,) = calls["ranker"]
    assert not calls["sparse-mla"]  # not the sparse-MLA suite
    assert (args.iterations, args.cases, args.sweep, args.smoke) == (4, ["phoenix"], True, False)
    assert args.modes == ["fwd"]
    assert args.out == tmp_path and args.report is None


@pytest.mark.parametrize("suite", list(SUITES))
def test_the_suites_defaults_are_python_m_s(monkeypatch, calls, suite):
    """`attn bench SUITE` and `python -m attn_pallas_tpu.bench_SUITE` parse the same flags
    to the same defaults."""
    import argparse

    _on(monkeypatch, "tpu")
    assert cli.main(["bench", suite]) == 0
    parser = argparse.ArgumentParser()
    SUITES[suite].add_arguments(parser)
    want = vars(parser.parse_args([]))
    assert {k: v for k, v in vars(calls[suite][0]).items() if k in want} == want


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("suite", list(SUITES))
def test_off_a_tpu_the_suite_refuses_in_one_line(
    monkeypatch, only_tpu_backend, calls, capsys, suite, device
):
    _on(monkeypatch, device)
    assert_cli_usage_error(
        ["bench", suite],
        f"attn bench {suite}: error: the suite times a TPU and the default device is "
        f"{device}; --smoke",
        capsys,
    )
    assert cli_exit_code(["bench", suite, "--smoke", "--iterations", "2"]) == 0
    assert [a.smoke for a in calls[suite]] == [True]


def test_bench_without_the_suite_name_is_a_one_line_error(
    monkeypatch, only_tpu_backend, calls, capsys
):
    _on(monkeypatch, "tpu")
    assert_cli_usage_error(
        ["bench"], "needs a suite name: attn bench sparse-mla or attn bench ranker", capsys
    )
    assert not any(calls.values())


@pytest.mark.parametrize("suite", list(SUITES))
def test_help_names_the_suite_and_its_flags(monkeypatch, only_tpu_backend, capsys, suite):
    _on(monkeypatch, "tpu")
    assert cli_exit_code(["bench", suite, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(f"usage: attn bench {suite} ")
    phrase, own_flags = HELP[suite]
    for flag in ("--out", "--iterations", "--cases", "--sweep", "--smoke", "--report", *own_flags):
        assert flag in out, flag
    assert phrase in out


@pytest.mark.parametrize("suite", list(SUITES))
def test_python_m_refuses_off_a_tpu(monkeypatch, capsys, suite):
    monkeypatch.setattr(_suite, "device_class", lambda *a: "cpu")
    with pytest.raises(SystemExit) as e:
        SUITES[suite].main([])
    assert e.value.code == 2
    assert "the suite times a TPU" in capsys.readouterr().err
