"""The ``attn`` command: info, run (small shapes), bench smoke, errors, the demo alias."""

import json
import os
import subprocess
import sys

import pytest

from attn_common import cli, dispatch


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


def test_run_ranker_small(capsys):
    pytest.importorskip("attn_reference")
    assert cli.main(["run", "ranker", "--small"]) == 0
    out = capsys.readouterr().out
    assert "ranker B2 S256" in out and "grads finite: True" in out
    err = float(out.split("dense f64 rel err ")[1].split(";")[0].split(",")[0])
    assert err < 2e-2


def test_run_sparse_mla_small(capsys):
    pytest.importorskip("attn_reference")
    assert cli.main(["run", "sparse-mla", "--small"]) == 0
    out = capsys.readouterr().out
    assert "sparse MLA flat" in out and "sparse MLA ragged" in out
    for part in out.split("dense f64 rel err ")[1:]:
        assert float(part.split()[0].rstrip(",;")) < 1e-3


def test_run_unavailable_backend_is_a_clean_error(capsys, monkeypatch):
    monkeypatch.setattr(dispatch, "installed_backends", lambda: {})
    assert cli.main(["run", "ranker", "--small", "--implementation", "mosaic-gpu"]) == 2
    err = capsys.readouterr().err
    assert "not installed" in err and "pip install" in err


def test_bench_smoke_off_gpu(tmp_path, capsys):
    pytest.importorskip("attn_reference")
    if dispatch.device_class() in ("gpu", "hopper"):
        pytest.skip("the smoke subset runs off a GPU only")
    assert cli.main(["bench", "--out", str(tmp_path), "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "meant for a GPU" in out
    result = json.loads((tmp_path / "ranker_gpu.json").read_text())
    assert result["smoke"] and {r["impl"] for r in result["rows"]} == {
        "ours-reference",
        "xla-dense-mask",
    }
    assert all(r["ms"] for r in result["rows"])
    assert "| small-d64 | ours-reference | fwd |" in (tmp_path / "ranker_gpu.md").read_text()


def test_reference_demo_is_attn_run_all(monkeypatch):
    demo = pytest.importorskip("attn_reference.demo")
    seen = []
    monkeypatch.setattr(demo, "_attn_main", lambda argv: seen.append(argv) or 0)
    assert demo.main(["--small"]) == 0
    assert seen == [["run", "all", "--implementation", "reference", "--small"]]
