"""H200: the per-query row-key sort kernel (``attn_mosaic_gpu.row_sort``) is ``jnp.sort``.

Skipped unless JAX's default backend is a GPU. Bitwise against ``jnp.sort(axis=1)`` on
fresh random keys (store rows of a 128K-row store, heavy repeats, absent keys
``2**31 - 1``, negative and extreme int32, sorted and reversed rows) for every width
the kernel takes and query counts that do not fill the GPU or fill it many times; the
output buffer is handed a poisoned block first, so an unwritten key fails. The Hopper
op's row table built with it is the table of XLA's sort.

Run (on the H200, from the repository root):

    PYTHONPATH=common/src:packages/attn-reference/src:packages/attn-mosaic-gpu/src \
        python -m pytest packages/attn-mosaic-gpu/tests/test_row_sort_gpu.py -q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU (jax.default_backend() != 'gpu')", allow_module_level=True)

from attn_common import selected_rows
from attn_common.sparse_mla_rows import UnitRows
from attn_mosaic_gpu.row_sort import segment_sort, sort_rows

BIG = np.iinfo(np.int32).max


def _keys(rng, queries, size, kind):
    if kind == "rows":
        return rng.integers(0, 1 << 17, (queries, size))
    if kind == "repeats":
        return rng.integers(0, 16, (queries, size))
    if kind == "absent":
        return np.where(
            rng.random((queries, size)) < 0.4, BIG, rng.integers(0, 1 << 17, (queries, size))
        )
    if kind == "extremes":
        return rng.integers(np.iinfo(np.int32).min, BIG, (queries, size), endpoint=True)
    if kind == "ordered":
        row = np.arange(size)
        return np.stack([row if q % 2 else row[::-1] for q in range(queries)])
    raise ValueError(kind)


@pytest.mark.parametrize("size", [512, 1024, 2048, 4096])
@pytest.mark.parametrize("queries", [1, 7, 4096])
@pytest.mark.parametrize("kind", ["rows", "repeats", "absent", "extremes", "ordered"])
def test_segment_sort_is_jnp_sort(size, queries, kind):
    rng = np.random.default_rng([size, queries, len(kind)])
    keys = jnp.asarray(_keys(rng, queries, size, kind), jnp.int32)
    # Leave a poisoned block of the output's size for the allocator to hand out.
    poison = jnp.full((queries, size), -7, jnp.int32).block_until_ready()
    del poison
    got = jax.jit(segment_sort)(keys)
    np.testing.assert_array_equal(np.asarray(got), np.sort(np.asarray(keys), axis=1))


def test_sort_rows_deterministic():
    keys = jnp.asarray(np.random.default_rng(3).integers(0, 1 << 17, (4096, 2048)), jnp.int32)
    fn = jax.jit(sort_rows, static_argnums=1)
    first = np.asarray(fn(keys, 1 << 17))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(fn(keys, 1 << 17)), first)


@pytest.mark.parametrize("repeat", [False, True])
def test_row_table_same_as_xla_sort(repeat):
    """``selected_rows`` with the kernel's sort: the table of XLA's sort, with and without
    a repeated row (the compaction path), with ``-1`` and causally cut selections."""
    rng = np.random.default_rng(11)
    n, k, rows = 512, 2048, 1 << 15
    first = np.stack([rng.permutation(rows)[:k] for _ in range(n)]).astype(np.int32)
    first[rng.random((n, k)) < 0.05] = -1
    if repeat:
        first[3, 10] = first[3, 11]
    units = UnitRows(
        first_row=jnp.asarray(first),
        first_pos=jnp.asarray(np.maximum(first, 0)),
        position=jnp.asarray(rng.integers(0, rows, n), jnp.int32),
        kv_len=jnp.full((n,), rows, jnp.int32),
    )
    build = jax.jit(selected_rows, static_argnames=("read_block", "block", "num_rows", "sort_keys"))
    want = build(units, read_block=1, block=128, num_rows=rows)
    got = build(units, read_block=1, block=128, num_rows=rows, sort_keys=sort_rows)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
