"""The Hopper sparse-MLA row-table kernel of token-level selections, on the CPU.

``attn_mosaic_gpu.row_sort`` emits one network of compare-exchange steps (``sort_plan``)
and a compaction as inline Mosaic GPU code, which the interpreter cannot run. Here a
NumPy model runs the same plan on the same (thread, key) layout (128 threads x ``K /
128`` keys, shuffles as lane permutations, shared-memory steps as warp permutations) and
must sort exactly like ``np.sort``, and its compaction (per-thread counts, warp scans,
warp totals) must give ``attn_common``'s table; the kernel must lower for CUDA at the
benchmark shape, replace XLA's sort in the front door's lowering, and refuse what it
does not take. On the H200 ``test_row_sort_gpu.py`` checks the kernel itself.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st

import attn_mosaic_gpu as gpu
from attn_common.sparse_mla_rows import ABSENT, token_rows_by_sort
from attn_mosaic_gpu.row_sort import (
    MAX_KEYS,
    MIN_KEYS,
    distinct_sorted_rows,
    row_sort_supported,
    sort_plan,
    token_rows,
)

THREADS = 128
SIZES = [512, 1024, 2048, 4096]


def run_plan(keys: np.ndarray) -> np.ndarray:
    """``sort_plan`` applied as the kernel applies it, to one query's keys ``[K]``."""
    k = keys.shape[0]
    per_thread = k // THREADS
    regs = keys.reshape(THREADS, per_thread).copy()  # thread t holds keys t*E .. t*E+E-1
    thread = np.arange(THREADS)
    for step in sort_plan(k):
        thread_part, key_part = step.mask // per_thread, step.mask % per_thread
        if step.where == "registers":
            assert thread_part == 0
            for e in range(per_thread):
                p = e ^ key_part
                if e < p:
                    lo = np.minimum(regs[:, e], regs[:, p])
                    regs[:, p] = np.maximum(regs[:, e], regs[:, p])
                    regs[:, e] = lo
            continue
        # A shuffle stays inside a warp; a shared-memory step reaches another warp.
        assert (thread_part < 32) == (step.where == "shuffle")
        other = regs[thread ^ thread_part][:, np.arange(per_thread) ^ key_part]
        lower = (thread & (1 << (thread_part.bit_length() - 1))) == 0
        regs = np.where(lower[:, None], np.minimum(regs, other), np.maximum(regs, other))
    return regs.reshape(k)


def model_table(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """The kernel's table of one query's keys: ``run_plan``, then its compaction."""
    k = keys.shape[0]
    regs = run_plan(keys).reshape(THREADS, k // THREADS)
    before = np.concatenate([[regs[0, 0]], regs[:-1, -1]])  # the previous thread's last
    new = regs != np.concatenate([before[:, None], regs[:, :-1]], axis=1)
    new[0, 0] = True
    kept = new & (regs != ABSENT)
    count = kept.sum(1)
    warp_scan = count.reshape(-1, 32).cumsum(1)  # the shuffle scans
    warp_total = warp_scan[:, -1]
    slot = (warp_scan - count.reshape(-1, 32)).reshape(-1)
    slot += np.repeat(np.concatenate([[0], warp_total.cumsum()[:-1]]), 32)
    table = np.full(k + 1, -1, np.int64)
    for t in range(THREADS):
        s = slot[t]
        for e in range(regs.shape[1]):
            table[s if kept[t, e] else k] = regs[t, e]
            s += kept[t, e]
    return table[:k], int(warp_total.sum())


@pytest.mark.parametrize("size", SIZES)
def test_plan_sorts(size):
    rng = np.random.default_rng(size)
    big = np.iinfo(np.int32).max
    cases = [
        rng.integers(0, 1 << 17, size),  # distinct-ish rows of a 128K store
        rng.integers(0, 8, size),  # many repeats
        np.where(rng.random(size) < 0.3, big, rng.integers(0, 1000, size)),  # absent keys
        np.arange(size)[::-1],
        np.arange(size),
        np.full(size, 5),
        rng.integers(np.iinfo(np.int32).min, big, size, endpoint=True),
    ]
    for keys in cases:
        keys = keys.astype(np.int32)
        np.testing.assert_array_equal(run_plan(keys), np.sort(keys))


# Jitted: one compile per size for every example (eagerly, one per operation and size).
_token_rows_by_sort = jax.jit(token_rows_by_sort, static_argnums=(1, 2))


@settings(max_examples=tier_examples(60), deadline=None)
@given(
    size=st.sampled_from(SIZES),
    seed=st.integers(0, 2**32 - 1),
    distinct=st.integers(1, 1 << 20),
    absent=st.floats(0, 1),
)
def test_model_property(size, seed, distinct, absent):
    """The modelled network sorts like ``np.sort``, and the modelled compaction gives
    ``token_rows_by_sort``'s rows and count: repeats and ``ABSENT`` keys dropped, the
    rest ascending, then ``-1``."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, distinct, size).astype(np.int32)
    keys[rng.random(size) < absent] = ABSENT
    np.testing.assert_array_equal(run_plan(keys), np.sort(keys))
    rows, count = model_table(keys)
    want_rows, want_counts = _token_rows_by_sort(jnp.asarray(keys[None]), size, None)
    np.testing.assert_array_equal(rows, np.asarray(want_rows)[0])
    assert count == int(want_counts[0])


def test_plan_shape():
    """Each size's network: ``log2 K (log2 K + 1) / 2`` steps, of which only the three
    whose partner is in another warp go through shared memory."""
    for size in SIZES:
        plan = sort_plan(size)
        log = size.bit_length() - 1
        assert len(plan) == log * (log + 1) // 2
        assert sum(s.where == "shared" for s in plan) == 3


def test_supported_sizes():
    assert [k for k in range(1, 2 * MAX_KEYS + 1) if row_sort_supported(k)] == SIZES
    assert SIZES[0] == MIN_KEYS and SIZES[-1] == MAX_KEYS


@pytest.mark.parametrize(
    "keys",
    [jnp.zeros((4, 300), jnp.int32), jnp.zeros((4, 2048), jnp.uint32), jnp.zeros(2048, jnp.int32)],
)
def test_kernel_refuses(keys):
    with pytest.raises(ValueError, match="keys"):
        distinct_sorted_rows(keys)


@pytest.mark.parametrize(
    "size,width",
    [  # one fallback in the quick tier (a width the kernel does not take)
        pytest.param(300, 320, marks=pytest.mark.slow),
        (2048, 2112),
        pytest.param(256, 256, marks=pytest.mark.slow),
    ],
)
def test_token_rows_falls_back_to_xla(size, width):
    """Widths or ``K`` the kernel does not take go to ``attn_common``'s table."""
    keys = np.random.default_rng(size).integers(0, 5000, (6, size)).astype(np.int32)
    keys[:, 3] = keys[:, 4]
    keys[1, ::7] = ABSENT
    got = token_rows(jnp.asarray(keys), width, 5000)
    want = token_rows_by_sort(jnp.asarray(keys), width, 5000)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _export(fn, *structs):
    return jax.export.export(jax.jit(fn), platforms=["cuda"])(*structs).mlir_module()


def test_cross_lowers_at_benchmark_shape():
    text = _export(distinct_sorted_rows, jax.ShapeDtypeStruct((4096, 2048), jnp.int32))
    assert "mosaic_gpu" in text and "stablehlo.sort" not in text


@pytest.mark.slow  # ~7 s: in the quick tier the front door's token-level call lowers with
# the table kernel in test_sparse_mla_qblock_cpu.py's test_cross_lowers_flat_token_level
# (three Mosaic GPU calls: the row sort and both attention kernels)
def test_front_door_sorts_token_rows_in_the_kernel():
    """The Hopper op's token-level row table lowers with the table kernel, not XLA's sort
    or its conditional compaction (two Mosaic GPU calls: the table and the attention)."""
    tokens, top_k, cache = 256, 2048, 1 << 17

    def fn(q, kv, idx, pos):
        return gpu.sparse_mla_attention(q, kv, idx, pos, sm_scale=0.07, read_block=1)

    text = _export(
        fn,
        jax.ShapeDtypeStruct((1, tokens, 128, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, cache, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, tokens, top_k), jnp.int32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    )
    assert "stablehlo.sort" not in text and "stablehlo.case" not in text
    calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
    assert calls == ["mosaic_gpu_v2", "mosaic_gpu_v2"], calls
