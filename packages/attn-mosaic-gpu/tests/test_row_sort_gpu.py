"""H200: the row-table kernel of token-level selections (``attn_mosaic_gpu.row_sort``).

Skipped unless JAX's default backend is a GPU. Its rows and counts must equal
``attn_common``'s XLA table (``token_rows_by_sort``: sorted, repeats and absent keys
dropped, then ``-1``) exactly, and a NumPy one, on fresh random keys (store rows of a
128K-row store, heavy repeats, absent keys ``2**31 - 1``, negative and extreme int32,
sorted and reversed rows, all absent) for every width the kernel takes and query counts
that do not fill the GPU or fill it many times; the allocator is handed a poisoned block
of the output's size first, so an unwritten slot fails. The Hopper op's row table built
with it equals the one XLA builds.

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

from attn_common.sparse_mla_rows import ABSENT, UnitRows, selected_rows, token_rows_by_sort
from attn_mosaic_gpu.row_sort import distinct_sorted_rows, token_rows

BIG = np.iinfo(np.int32).max
assert BIG == ABSENT


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
    if kind == "all absent":
        return np.full((queries, size), BIG)
    if kind == "ordered":
        row = np.arange(size)
        return np.stack([row if q % 2 else row[::-1] for q in range(queries)])
    raise ValueError(kind)


def _numpy_table(keys):
    rows = np.full(keys.shape, -1, np.int32)
    counts = np.zeros(keys.shape[0], np.int32)
    for n, row in enumerate(keys):
        distinct = np.unique(row[row != BIG])
        rows[n, : distinct.size] = distinct
        counts[n] = distinct.size
    return rows, counts


SIZES = (512, 1024, 2048, 4096)
QUERIES = (1, 7, 4096)
KINDS = ("rows", "repeats", "absent", "extremes", "ordered", "all absent")


def _table_cases():
    """Every (width, query count) pair (one kernel compile each) with two of the six key
    kinds, rotated so that every width and every query count meets all six kinds (and
    every kind meets the NumPy check at 1 or 7 queries): 24 tests, not the 72 of the
    full product, whose extra 48 recompiled nothing and re-ran the 4096 x 4096 cases."""
    out = []
    for i, size in enumerate(SIZES):
        for j, queries in enumerate(QUERIES):
            first = 2 * ((i + j) % 3)
            out += [(size, queries, KINDS[first]), (size, queries, KINDS[first + 1])]
    return out


@pytest.mark.parametrize(("size", "queries", "kind"), _table_cases())
def test_kernel_table_is_the_table(size, queries, kind):
    rng = np.random.default_rng([size, queries, len(kind)])
    keys = _keys(rng, queries, size, kind).astype(np.int32)
    # Leave poisoned blocks of the outputs' sizes for the allocator to hand out.
    poison = [jnp.full((queries, size), -7, jnp.int32), jnp.full((queries,), -7, jnp.int32)]
    jax.block_until_ready(poison)
    del poison
    rows, counts = jax.jit(distinct_sorted_rows)(jnp.asarray(keys))
    want_rows, want_counts = jax.jit(token_rows_by_sort, static_argnums=(1, 2))(
        jnp.asarray(keys), size, None
    )
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(want_rows))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(want_counts))
    if queries <= 7:
        np_rows, np_counts = _numpy_table(keys)
        np.testing.assert_array_equal(np.asarray(rows), np_rows)
        np.testing.assert_array_equal(np.asarray(counts), np_counts)


def test_kernel_deterministic():
    keys = jnp.asarray(np.random.default_rng(3).integers(0, 1 << 12, (4096, 2048)), jnp.int32)
    fn = jax.jit(token_rows, static_argnums=(1, 2))
    first = [np.asarray(x) for x in fn(keys, 2048, 1 << 12)]
    for _ in range(3):
        for a, b in zip(fn(keys, 2048, 1 << 12), first, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("repeat", [False, True])
def test_row_table_same_as_xla_sort(repeat):
    """``selected_rows`` with the kernel: the table XLA builds, with and without a
    repeated row (XLA's compaction path), with ``-1`` and causally cut selections."""
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
    build = jax.jit(
        selected_rows, static_argnames=("read_block", "block", "num_rows", "token_table")
    )
    want = build(units, read_block=1, block=128, num_rows=rows)
    got = build(units, read_block=1, block=128, num_rows=rows, token_table=token_rows)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
