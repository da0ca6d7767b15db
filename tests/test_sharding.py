"""Sharding helpers on 8 (and 2) CPU devices against the unsharded result (in a subprocess).

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


def _run_check(devices: int, *args: str) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    script = Path(__file__).with_name("sharding_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK"), proc.stdout


@pytest.mark.slow  # ~90 s on 2 cores; the guide's sharding example (test_docs.py) stays quick
def test_sharded_matches_unsharded_on_8_cpu_devices():
    _run_check(8)


@pytest.mark.slow  # ~100 s on 2 cores: the kernels in interpret mode, forward and backward
def test_sharded_kernels_in_interpret_mode_on_2_cpu_devices():
    pytest.importorskip("attn_mosaic_gpu")
    pytest.importorskip("attn_pallas_tpu")
    _run_check(2, "--interpret")


def test_ragged_request_sharding_refuses_bad_arguments():
    """Argument errors name the argument, the value seen and what is expected (no
    device work: checked before tracing)."""
    import jax
    import jax.numpy as jnp

    from attn_common import shard_sparse_mla_attention_ragged

    mesh = jax.make_mesh((1,), ("data",))
    opts = dict(sm_scale=0.1, page_size=16)
    with pytest.raises(ValueError, match=r"pool: got 'pooled', expected one of"):
        shard_sparse_mla_attention_ragged(mesh, request_axis="data", pool="pooled", **opts)
    with pytest.raises(ValueError, match=r"pool: got 'sharded' with request_axis=None"):
        shard_sparse_mla_attention_ragged(mesh, head_axis=None, pool="sharded", **opts)
    with pytest.raises(ValueError, match=r"axis 'requests' is not in the mesh axes \('data',\)"):
        shard_sparse_mla_attention_ragged(mesh, head_axis=None, request_axis="requests", **opts)
    attend = shard_sparse_mla_attention_ragged(
        mesh, head_axis=None, request_axis="data", pool="sharded", **opts
    )
    z = jnp.zeros
    stacked = dict(q=z((1, 4, 2, 576)), cache=z((3, 8, 2, 640)), indices=z((1, 4, 2), int),
                   positions=z((1, 4), int), q_seq_id=z((1, 4), int), seq_lens=z((1, 2), int),
                   cu_kv_lens=z((1, 3), int), page_indices=z((1, 3), int))  # fmt: skip
    flat = dict(stacked, seq_lens=z((2,), int))  # one batch's tables, not stacked
    with pytest.raises(ValueError, match=r"seq_lens: got shape \(2,\), expected the 1 batches"):
        attend(*flat.values())


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
