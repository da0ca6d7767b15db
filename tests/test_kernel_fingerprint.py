"""``tests/kernel_fingerprint.py``'s canonical jaxpr text: blind to how equal code is
factored, sensitive to any change of the operations."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import load_script

pytest.importorskip(
    "attn_mosaic_gpu",
    reason="attn-mosaic-gpu is not installed (pip install ./packages/attn-mosaic-gpu)",
)
SCRIPT = Path(__file__).with_name("kernel_fingerprint.py")


@pytest.fixture(scope="module")
def fingerprint():
    with load_script(SCRIPT, "kernel_fingerprint") as module:
        yield module


def _step(i, x):
    return x * 2.0 + i


def _factored(x):
    y = jax.lax.fori_loop(0, 3, _step, x)
    return jax.lax.fori_loop(0, 4, _step, y)


def _inline(x):
    y = jax.lax.fori_loop(0, 3, lambda i, x: x * 2.0 + i, x)
    return jax.lax.fori_loop(0, 4, lambda i, x: x * 2.0 + i, y)


def _changed(x):
    y = jax.lax.fori_loop(0, 3, _step, x)
    return jax.lax.fori_loop(0, 4, lambda i, x: x * 3.0 + i, y)


def test_canonical_text_ignores_factoring_not_operations(fingerprint):
    x = jnp.zeros((4,), jnp.float32)
    texts = [fingerprint.canonical(jax.make_jaxpr(f)(x)) for f in (_factored, _inline, _changed)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]
    assert "scan" in texts[0] and "0x" not in texts[0]


def test_traces_every_case(fingerprint):
    labels = [label for label, _, _ in fingerprint.cases("small-d64")]
    assert labels == ["small-d64-packedFalse-grad", "small-d64-packedTrue-grad"]
    assert len(list(fingerprint.cases(None))) == 12


def test_sparse_mla_cases_trace(fingerprint):
    hashes = {}
    for label, fn, shapes in fingerprint.sparse_mla_cases():
        hashes[label] = fingerprint.canonical(jax.make_jaxpr(fn)(*shapes))
    assert list(hashes) == [
        "sparse-mla-32x2-one_way",
        "sparse-mla-64x1-lockstep",
        "sparse-mla-64x1-one_way",
    ]
    assert len(set(hashes.values())) == 3
