"""``tests/kernel_fingerprint.py``'s canonical jaxpr text: blind to how equal code is
factored, sensitive to any change of the operations."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
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


def test_literals_compare_by_value_and_type(fingerprint):
    x = jnp.zeros((), jnp.int32)
    same = [fingerprint.canonical(jax.make_jaxpr(f)(x))
            for f in (lambda x: x & 1, lambda x: x & jnp.int32(1), lambda x: x & np.int32(1))]  # fmt: skip
    assert same[0] == same[1] == same[2]
    assert same[0] != fingerprint.canonical(jax.make_jaxpr(lambda x: x & 3)(x))
    assert same[0] != fingerprint.canonical(
        jax.make_jaxpr(lambda x: x & 1)(jnp.zeros((), jnp.int8))
    )


def test_traces_every_case(fingerprint):
    labels = [label for label, _, _ in fingerprint.cases("small-d64")]
    assert labels == ["small-d64-packedFalse-grad", "small-d64-packedTrue-grad"]
    assert len(list(fingerprint.cases(None))) == 12


def test_sparse_mla_cases_trace(fingerprint):
    texts = {}
    for label, fn, shapes in fingerprint.sparse_mla_cases():
        texts[label] = fingerprint.canonical(jax.make_jaxpr(fn)(*shapes))
    assert list(texts) == [
        "sparse-mla-flat-unit-h128",
        "sparse-mla-flat-token-h128",
        "sparse-mla-flat-token-h64",
        "sparse-mla-flat-token-h16",
        "sparse-mla-flat-token-xla-sort-h64",
        "sparse-mla-paged-h128",
        "sparse-mla-paged-h64",
        "sparse-mla-paged-h16",
        "sparse-mla-prefill-wrapper-h128",
        "sparse-mla-kernel-h128",
        "sparse-mla-fp8-kernel-h64",
        "sparse-mla-backward-kernel-h128",
        "row-sort-k512",
        "row-sort-k2048",
        "row-sort-k4096",
    ]
    assert len(set(texts.values())) == len(texts)
    assert all(label.startswith(fingerprint.LOWERED_PREFIXES) for label in texts)


def test_lowered_kernels_hold_the_inline_code(fingerprint):
    """The row-sort kernel is one inline Mosaic GPU body: its jaxpr names it, its lowered
    module holds the sort's shuffles, one per key of a thread per shuffle step."""
    cases = {label: (fn, shapes) for label, fn, shapes in fingerprint.sparse_mla_cases()}
    fn, shapes = cases["row-sort-k512"]
    assert "shfl" not in fingerprint.canonical(jax.make_jaxpr(fn)(*shapes))
    text = fingerprint.lowered_kernels(fn, shapes)
    assert "loc(" not in text
    assert text.count("nvvm.shfl.sync") > 4 * 10
    assert fingerprint.lowered_kernels(*cases["row-sort-k2048"]) != text
