"""Sharding helpers on 8 CPU devices against the unsharded result (in a subprocess).

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX
initialises, so ``sharding_check.py`` runs in a fresh interpreter with the same
``sys.path``; the rest of the suite keeps its single CPU device.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("attn_reference")


@pytest.mark.slow  # ~30 s on 2 cores; the guide's sharding example (test_docs.py) stays quick
def test_sharded_matches_unsharded_on_8_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    script = Path(__file__).with_name("sharding_check.py")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK"), proc.stdout
