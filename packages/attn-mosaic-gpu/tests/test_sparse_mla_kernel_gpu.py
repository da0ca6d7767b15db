"""H200 conformance of the Hopper sparse-MLA gather-attend kernel (row-table level).

Skipped unless JAX's default backend is a GPU. The kernel attends exactly the rows
``rows[n, :counts[n]]`` of a latent store; the oracle here is a float64 numpy gather +
softmax over the same rows, on the bf16 inputs upcast. Store rows that no query attends
are NaN (a dirty cache), so a wild read or an unmasked padding row shows up as NaN.
Front-door conformance against ``attn_reference.sparse_mla_attention`` (flat, ragged,
duplicates, ``-1``, causal) is in ``test_sparse_mla_gpu.py``.

Run (on the H200, from the repository root):

    PYTHONPATH=common/src:packages/attn-reference/src:packages/attn-mosaic-gpu/src \
        python -m pytest packages/attn-mosaic-gpu/tests/test_sparse_mla_kernel_gpu.py -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (jax.default_backend() != 'gpu')", allow_module_level=True)

from helpers import poison_allocator

from attn_mosaic_gpu.sparse_mla_kernel import sparse_mla_rows_attention

DV = 512
DK = 576
REL_L2 = 1e-2  # bf16 P in the value product
LSE_ATOL = 2e-2


def _problem(seed, tokens, heads, kp, store_rows, width, counts):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((tokens, heads, DK), np.float32)
    store = rng.standard_normal((store_rows, width), np.float32)
    rows = np.full((tokens, kp), -1, np.int32)
    attended = np.zeros(store_rows, bool)
    for n, c in enumerate(counts):
        ids = rng.choice(store_rows, size=c, replace=False).astype(np.int32)
        rows[n, :c] = ids
        attended[ids] = True
    store[~attended] = np.nan  # rows nobody attends: a dirty cache
    return (
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(store, jnp.bfloat16),
        jnp.asarray(rows),
        jnp.asarray(np.asarray(counts, np.int32)),
    )


def _oracle(q, store, rows, counts, sm_scale):
    q = np.asarray(q.astype(jnp.float32), np.float64)
    store = np.asarray(store.astype(jnp.float32), np.float64)
    rows, counts = np.asarray(rows), np.asarray(counts)
    n, h, _ = q.shape
    out = np.zeros((n, h, DV))
    lse = np.full((n, h), -np.inf)
    for i in range(n):
        keys = store[rows[i, : counts[i]], :DK]
        if not len(keys):
            continue
        s = q[i] @ keys.T * sm_scale
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        out[i] = p @ keys[:, :DV] / p.sum(axis=1, keepdims=True)
        lse[i] = m[:, 0] + np.log(p.sum(axis=1))
    return out, lse


@pytest.mark.parametrize(
    "heads,kp,counts",
    [
        (128, 2048, [2048, 2047, 1000, 0, 1, 64, 65, 128, 129, 1500]),
        (64, 256, [256, 255, 0, 3, 200, 128, 64, 127]),
        (16, 512, [512, 17, 0, 300, 384, 511]),
    ],
)
@pytest.mark.parametrize("width", [576, 640])
def test_kernel_matches_oracle(heads, kp, counts, width):
    sm_scale = 1.0 / np.sqrt(192.0)
    q, store, rows, counts_a = _problem(
        len(counts) + heads, len(counts), heads, kp, 4096, width, counts
    )
    poison_allocator(len(counts) * heads * DV * 4)
    out, lse = sparse_mla_rows_attention(q, store, rows, counts_a, sm_scale=sm_scale)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    want_out, want_lse = _oracle(q, store, rows, counts_a, sm_scale)
    assert np.isfinite(out).all(), "NaN/Inf in out"
    empty = np.asarray(counts_a) == 0
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
    live = ~empty
    err = np.linalg.norm(out[live] - want_out[live]) / np.linalg.norm(want_out[live])
    assert err < REL_L2, f"rel L2 {err:.3e}"
    assert np.abs(lse[live] - want_lse[live]).max() < LSE_ATOL


def test_kernel_deterministic():
    q, store, rows, counts = _problem(7, 8, 128, 512, 2048, 576, [512, 400, 100, 0, 64, 65, 511, 1])
    a = sparse_mla_rows_attention(q, store, rows, counts, sm_scale=0.1)
    b = sparse_mla_rows_attention(q, store, rows, counts, sm_scale=0.1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
