"""Flat sparse MLA reference vs the independent float64 oracle (docs/design.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_lse_close,
    assert_sparse_mla_close,
    attended_rows_flat,
    poison_rows,
    randn,
    rng_for,
    upcast,
)
from oracle import sparse_mla_oracle_flat

from attn_reference import sparse_mla_attention, sparse_mla_attention_qblock

F32_TOL = {"rtol_l2": 1e-5, "atol": 1e-5}
LSE_ATOL = 1e-4


def flat_inputs(
    seed, *, batch, seq, heads, dk, num_tokens, top_k, read_block, dtype="float32", causal=False
):
    """Random q/kv and selections with -1, duplicates, out-of-range ids; a few rows with no
    valid key (all -1, or a position before every selected token)."""
    rng = rng_for(seed)
    q = randn(rng, (batch, seq, heads, dk), dtype)
    kv = randn(rng, (batch, num_tokens, dk), dtype)
    units = -(-num_tokens // read_block)
    idx = rng.integers(0, units, size=(batch, seq, top_k))
    kind = rng.random((batch, seq, top_k))
    idx = np.where(kind < 0.15, -1, idx)
    idx = np.where((kind >= 0.15) & (kind < 0.22), units + rng.integers(0, 3, idx.shape), idx)
    idx = np.where((kind >= 0.22) & (kind < 0.25), 2**30, idx)
    idx = np.where((kind >= 0.25) & (kind < 0.28), -(2**20), idx)
    dup = rng.random((batch, seq)) < 0.4
    idx[..., -1] = np.where(dup, idx[..., 0], idx[..., -1])
    if causal:
        pos = np.broadcast_to(np.arange(num_tokens - seq, num_tokens), (batch, seq)).copy()
    else:
        pos = rng.integers(0, num_tokens + 8, size=(batch, seq))  # some beyond T
    # Row 0 of batch 0: nothing selected. Row 1: selects only units after its position.
    idx[0, 0] = -1
    idx[0, 1] = units - 1
    pos[0, 1] = rng.integers(0, (units - 1) * read_block)
    return q, kv, idx.astype(np.int32), pos.astype(np.int32)


def _oracle(q, kv, idx, pos, *, sm_scale, dv, read_block):
    return sparse_mla_oracle_flat(upcast(q), upcast(kv), idx, pos, sm_scale, dv, read_block)


def _check(out, lse, want_out, want_lse, *, tol=F32_TOL):
    assert_sparse_mla_close((out, lse), (want_out, want_lse), **tol, lse_atol=LSE_ATOL)


SMALL = {"batch": 2, "seq": 19, "dk": 40, "num_tokens": 45, "top_k": 4, "read_block": 16}


# Each heads x dtype compiles the reference again (~1-2 s on 2 cores): the quick tier
# (-m "not slow") keeps each heads value and each dtype once.
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "heads, dtype",
    [
        pytest.param(1, "float32", marks=pytest.mark.slow),
        (1, "bfloat16"),
        (4, "float32"),
        pytest.param(4, "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_flat_small_dims(heads, dtype, causal):
    """Dk=40, Dv=32, T=45 (last unit of 16 has 13 tokens), -1/dups/out-of-range ids."""
    q, kv, idx, pos = flat_inputs(20 + heads, heads=heads, dtype=dtype, causal=causal, **SMALL)
    sm_scale = 0.21
    out, lse = sparse_mla_attention(
        q, kv, idx, pos, sm_scale=sm_scale, kv_lora_rank=32, read_block=16, return_lse=True
    )
    assert out.shape == (2, 19, heads, 32) and lse.shape == (2, 19, heads)
    want_out, want_lse = _oracle(q, kv, idx, pos, sm_scale=sm_scale, dv=32, read_block=16)
    # Both the oracle and the reference see the exact bf16 values; the reference computes
    # in float32, so the float32 tolerance applies to bf16 inputs too.
    _check(out, lse, want_out, want_lse)
    empty = np.isneginf(want_lse)
    assert empty[0, 0].all() and empty[0, 1].all() and (~empty).sum() > empty.sum()
    plain = sparse_mla_attention(q, kv, idx, pos, sm_scale=sm_scale, kv_lora_rank=32, read_block=16)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(out))


@pytest.mark.parametrize("heads", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_flat_mla_dims(heads):
    """Dk=576, Dv=512 (the defaults kv_lora_rank=512, read_block=128), small T=300."""
    q, kv, idx, pos = flat_inputs(
        30 + heads, batch=1, seq=6, heads=heads, dk=576, num_tokens=300, top_k=3, read_block=128
    )
    sm_scale = 1.0 / math.sqrt(192.0)
    out, lse = sparse_mla_attention(q, kv, idx, pos, sm_scale=sm_scale, return_lse=True)
    assert out.shape == (1, 6, heads, 512)
    want_out, want_lse = _oracle(q, kv, idx, pos, sm_scale=sm_scale, dv=512, read_block=128)
    _check(out, lse, want_out, want_lse)


def _call(q, kv, idx, pos, **kw):
    out, lse = sparse_mla_attention(
        q, kv, idx, pos, sm_scale=0.21, kv_lora_rank=32, read_block=16, return_lse=True, **kw
    )
    return np.asarray(out), np.asarray(lse)


def test_no_valid_key_rows():
    """All -1; all out of range; position before every selected token; only t >= T."""
    rng = rng_for(40)
    q = randn(rng, (1, 5, 4, 40))
    kv = randn(rng, (1, 45, 40))
    idx = np.asarray(
        [[[-1, -1, -1, -1], [3, 7, -5, 99], [2, 2, -1, 1], [2, -1, -1, -1], [0, -1, 1, -1]]],
        np.int32,
    )
    pos = np.asarray([[44, 44, 15, 31, 0]], np.int32)
    out, lse = _call(q, kv, idx, pos)
    want_out, want_lse = _oracle(q, kv, idx, pos, sm_scale=0.21, dv=32, read_block=16)
    assert np.isneginf(want_lse[0, :4]).all() and np.isfinite(want_lse[0, 4]).all()
    _check(out, lse, want_out, want_lse)
    assert np.all(out[0, :4] == 0.0) and np.all(np.isneginf(lse[0, :4]))
    # Query 4 sees exactly token 0: out is v_0 and lse is its scaled logit.
    np.testing.assert_allclose(out[0, 4], np.broadcast_to(kv[0, 0, :32], (4, 32)), rtol=1e-6)


def test_duplicates_and_order_are_a_set():
    q, kv, idx, pos = flat_inputs(41, heads=4, **SMALL)
    base_out, base_lse = _call(q, kv, idx, pos)
    rng = rng_for(42)
    # Same sets written differently: shuffled order, every id repeated.
    shuffled = np.take_along_axis(
        idx, rng.permuted(np.tile(np.arange(4), (*idx.shape[:2], 1)), axis=-1), axis=-1
    )
    doubled = np.concatenate([idx, idx[..., ::-1]], axis=-1)
    for name, alt in (("shuffled", shuffled), ("doubled", doubled)):
        out, lse = _call(q, kv, alt, pos)
        assert_close(out, base_out, rtol_l2=1e-6, atol=1e-5, name=name)
        assert_lse_close(lse, base_lse, atol=1e-5, name=name)
    # Duplicates removed by hand (set semantics computed here, not by the reference).
    dedup = idx.copy()
    for b, s in np.ndindex(idx.shape[:2]):
        seen = set()
        for kk in range(idx.shape[2]):
            u = int(idx[b, s, kk])
            if u in seen:
                dedup[b, s, kk] = -1
            seen.add(u)
    out, lse = _call(q, kv, dedup, pos)
    assert_close(out, base_out, rtol_l2=1e-6, atol=1e-5, name="dedup")


def test_out_of_range_ids_ignored():
    q, kv, idx, pos = flat_inputs(43, heads=4, **SMALL)
    units = -(-SMALL["num_tokens"] // SMALL["read_block"])
    cleaned = np.where((idx >= 0) & (idx < units), idx, -1).astype(np.int32)
    assert (cleaned != idx).any()
    out, lse = _call(q, kv, idx, pos)
    out2, lse2 = _call(q, kv, cleaned, pos)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)


# --------------------------------------------------------------------------------------
# Query-blocked twin


@pytest.mark.parametrize("query_block", [None, 4, 8, 256])
@pytest.mark.parametrize("u_max", [None, 1, 2, 5])
def test_qblock_equals_plain_for_any_knobs(query_block, u_max):
    """query_block / u_max / head_block are kernel knobs: the answer never changes."""
    q, kv, idx, pos = flat_inputs(50, heads=4, **SMALL)
    kw = {"sm_scale": 0.21, "kv_lora_rank": 32, "read_block": 16, "return_lse": True}
    out, lse = sparse_mla_attention(q, kv, idx, pos, **kw)
    qout, qlse = sparse_mla_attention_qblock(
        q, kv, idx, pos, query_block=query_block, u_max=u_max, head_block=2, **kw
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(qout))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(qlse))


@pytest.mark.parametrize("knob", ["query_block", "u_max", "head_block"])
@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_qblock_bad_knobs(knob, bad):
    q, kv, idx, pos = flat_inputs(52, heads=4, **SMALL)
    with pytest.raises(ValueError, match=knob):
        sparse_mla_attention_qblock(
            q, kv, idx, pos, sm_scale=0.2, kv_lora_rank=32, read_block=16, **{knob: bad}
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unattended_rows_may_hold_nan_and_inf(dtype):
    """Rows no query attends (after every position, unselected units) hold NaN / +-Inf:
    the output and LSE equal the oracle on the clean cache."""
    shape = {**SMALL, "causal": True}
    q, kv, idx, pos = flat_inputs(53, heads=4, dtype=dtype, **shape)
    keep = attended_rows_flat(idx, pos, kv_len=SMALL["num_tokens"], read_block=16)
    assert (~keep).any()
    dirty = poison_rows(kv, keep, seed=53)
    kw = {"sm_scale": 0.21, "kv_lora_rank": 32, "read_block": 16, "return_lse": True}
    out, lse = sparse_mla_attention(q, dirty, idx, pos, **kw)
    want_out, want_lse = _oracle(q, kv, idx, pos, sm_scale=0.21, dv=32, read_block=16)
    if dtype == "float32":
        _check(out, lse, want_out, want_lse)
    clean_out, clean_lse = sparse_mla_attention(q, kv, idx, pos, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))


@pytest.mark.parametrize(("seq", "top_k", "num_tokens"), [(0, 3, 40), (5, 0, 40), (5, 3, 0)])
def test_empty_work_gives_zeros(seq, top_k, num_tokens):
    rng = rng_for(54)
    q = randn(rng, (2, seq, 3, 48))
    kv = randn(rng, (2, num_tokens, 48))
    idx = np.zeros((2, seq, top_k), np.int32)
    pos = np.zeros((2, seq), np.int32)
    for fn in (sparse_mla_attention, sparse_mla_attention_qblock):
        out, lse = fn(
            q, kv, idx, pos, sm_scale=0.2, kv_lora_rank=32, read_block=16, return_lse=True
        )
        assert out.shape == (2, seq, 3, 32) and lse.shape == (2, seq, 3)
        assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
