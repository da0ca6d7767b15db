"""The examples (``examples/*/``): each ``--small`` run works on the CPU as its README says,
and does what it claims (it trains, its checks pass, it writes its report).

Each example runs as a user runs it: ``python examples/<name>/<script> --small`` in a fresh
interpreter, with ``JAX_PLATFORMS=cpu`` (the reference backend). The examples need optax
(an example's extra, not a dependency of the wheels; the nox test sessions install it):
without it these tests skip, saying so.

XLA's CPU compiler is told to skip its slower backend optimisations
(``--xla_backend_optimization_level=0``): an example's ``--small`` run spends most of its
time compiling a handful of programs, and it checks its own results, which do not depend
on the flag (the timings they print are labelled a smoke run on a CPU anyway).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
HAVE_OPTAX = importlib.util.find_spec("optax") is not None
needs_optax = pytest.mark.skipif(
    not HAVE_OPTAX, reason="the examples need optax, which is not installed (pip install optax)"
)


def run_example(script: Path, out: Path, *args: str) -> tuple[str, dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    proc = subprocess.run(
        [sys.executable, str(script), "--small", "--out", str(out), *args],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script.name} --small failed:\n{proc.stdout}\n{proc.stderr}"
    (report,) = out.glob("*.json")
    return proc.stdout, json.loads(report.read_text())


def readme_commands(name: str) -> list[str]:
    text = (EXAMPLES / name / "README.md").read_text()
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return [line for line in lines if line.startswith("python ")]


@needs_optax
def test_ranker_small(tmp_path):
    assert "python examples/ranker/train.py --small" in readme_commands("ranker")
    stdout, report = run_example(EXAMPLES / "ranker" / "train.py", tmp_path)
    assert report["backend"] == "reference" and report["shape"] == "small"
    loss = np.asarray(report["loss"])
    assert np.isfinite(loss).all()
    assert loss[-20:].mean() < 0.5 * loss[:20].mean(), "the ranker did not train"
    assert report["accuracy"] > 0.75  # of unseen users' candidates (chance: 0.5)
    b = report["bench"]
    padded, packed = b["padded"], b["packed"]
    assert padded["users_per_step"] == 4  # one user per row, [B=4, S=32]
    assert packed["users_per_step"] > 2 * padded["users_per_step"]
    assert packed["efficiency"] > padded["efficiency"]
    for mode in (padded, packed):
        assert mode["users_per_s"] > 0 and mode["step_ms"] > 0 and mode["attention_ms"] > 0
    assert "packed / padded users/s" in stdout and "not a measurement" in stdout
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "ranker.png").stat().st_size > 0
    else:
        assert "matplotlib not installed: no plot" in stdout


@pytest.mark.slow  # 9.0 s on one quiet core (seven programs to compile): tests-cpu-full
@needs_optax
def test_deepseek_sparse_small(tmp_path):
    assert "python examples/deepseek_sparse/run.py --small" in readme_commands("deepseek_sparse")
    stdout, report = run_example(EXAMPLES / "deepseek_sparse" / "run.py", tmp_path)
    assert report["backend"] == "reference" and report["shape"] == "small"
    check = report["check"]
    assert check["ok"] and check["tolerance"] == 1e-4
    for key in (
        "vs_xla_output",
        "vs_xla_scores",
        "vs_xla_pool",
        "vs_flat_output",
        "vs_flat_scores",
    ):
        assert 0 <= check[key] <= 1e-4, (key, check[key])
    assert check["vs_xla_same_pages"] == 1.0 and check["vs_flat_same_valid_pages"]
    train = report["train"]
    main, kl, recall = (np.asarray(train[k]) for k in ("main_loss", "indexer_kl", "indexer_recall"))
    assert len(main) == 40 and np.isfinite(kl).all() and (kl >= 0).all()
    assert main[-5:].mean() < main[0] / 3, "the main loss did not fall"
    assert recall[-5:].mean() > recall[0] + 0.15, "the indexer did not learn where the pairs are"
    assert 0 <= report["answered"] <= 1
    times = report["time_ms"]
    assert all(times[k] > 0 for k in ("prefill ops", "prefill xla", "decode ops", "decode xla"))
    assert "check: ops vs plain XLA" in stdout and stdout.count(": ok") == 1


def _load(name: str, path: Path, monkeypatch):
    """An example's module, imported the way its script imports its neighbours."""
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_optax
def test_ranker_plot_skips_without_matplotlib(monkeypatch, tmp_path):
    train = _load("ranker_train_example", EXAMPLES / "ranker" / "train.py", monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ModuleNotFoundError
    msg = train.plot({}, tmp_path / "x.png")
    assert msg == "matplotlib not installed: no plot (pip install matplotlib)"
    assert not (tmp_path / "x.png").exists()


def test_examples_say_when_optax_is_missing(tmp_path):
    scripts = [EXAMPLES / "ranker" / "train.py", EXAMPLES / "deepseek_sparse" / "run.py"]
    code = (
        "import runpy, sys\n"
        "sys.modules['optax'] = None  # import optax raises ModuleNotFoundError\n"
        f"for script in {[str(s) for s in scripts]!r}:\n"
        "    sys.argv = [script, '--small']\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        print(e.code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "examples/ranker needs optax: pip install optax",
        "examples/deepseek_sparse needs optax: pip install optax",
    ]


def test_cli_points_to_the_examples(capsys):
    """``attn --help`` and ``attn info`` name every example with the command its README
    gives; every examples/ folder is named."""
    from attn_common import cli

    named = {path for path, _, _ in cli.EXAMPLES}
    folders = [d for d in EXAMPLES.iterdir() if d.is_dir() and not d.name.startswith(("_", "."))]
    assert named == {f"examples/{d.name}" for d in folders}
    for path, command, _ in cli.EXAMPLES:
        assert command in readme_commands(Path(path).name)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert cli.examples_text() in capsys.readouterr().out
    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(cli.examples_text())
