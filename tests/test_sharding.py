"""Sharding helpers on 8 CPU devices against the unsharded result (in a subprocess).

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX
initialises, so ``sharding_check.py`` runs in a fresh interpreter with the same
``sys.path``; the rest of the suite keeps its single CPU device.
"""

import os
import re
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


def test_wrong_rank_is_named_before_sharding():
    """A q of the wrong rank is refused by name, before the wrappers index its shape (it
    was an unpacking or index error from inside the wrapper)."""
    import jax
    import numpy as np

    from attn_common import sharding

    mesh = jax.make_mesh((1, 1), ("data", "model"))
    q = np.zeros((2, 3), np.float32)
    calls = {
        "[B, S, Hq, D]": lambda: sharding.shard_ranker_attention(mesh)(q, q, q, None),
        "[B, S, H, Dk]": lambda: sharding.shard_sparse_mla_attention(mesh, sm_scale=1.0)(
            q, q, q, q
        ),
        "[1, S, H, Dk]": lambda: sharding.shard_sparse_mla_attention_ragged(
            mesh, sm_scale=1.0, page_size=16
        )(q, q, q, q, q, q, q, q),
    }
    for hint, call in calls.items():
        with pytest.raises(ValueError, match=re.escape(f"q: got shape (2, 3), expected {hint}")):
            call()
    q4 = np.zeros((2, 3, 4, 8), np.float32)
    with pytest.raises(ValueError, match=re.escape("k: got shape (2, 3), expected [B, S, Hkv")):
        sharding.shard_ranker_attention(mesh)(q4, q, q, None)
