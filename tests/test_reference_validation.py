"""Bad input raises the documented error naming the argument (docs/design.md#bad-input),
and the ``checkify`` debug path reports out-of-range data."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import build_ragged_layout, randn, rng_for
from jax.experimental import checkify

from attn_common import CapMethod, CapParams, KernelConfig, SegmentBounds
from attn_reference import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
    ranker_attention,
    sparse_mla_attention,
    sparse_mla_attention_qblock,
)

RNG = rng_for(90)
B, S, HQ, HKV, D = 2, 21, 4, 2, 16
Q = randn(RNG, (B, S, HQ, D))
K = randn(RNG, (B, S, HKV, D))
V = randn(RNG, (B, S, HKV, D))
BOUNDS = np.asarray([[0, 10, 10, 15], [2, 8, 12, 21]], np.int32)


# --------------------------------------------------------------------------------------
# ranker_attention

RANKER_BAD = {
    "q_rank": (ValueError, "q", lambda: ranker_attention(Q[0], K, V, BOUNDS)),
    "q_not_array": (TypeError, "q", lambda: ranker_attention(Q.tolist(), K, V, BOUNDS)),
    "k_batch": (ValueError, "k", lambda: ranker_attention(Q, K[:1], V[:1], BOUNDS)),
    "k_seq": (ValueError, "k", lambda: ranker_attention(Q, K[:, :20], V[:, :20], BOUNDS)),
    "k_head_dim": (ValueError, "k", lambda: ranker_attention(Q, K[..., :8], V[..., :8], BOUNDS)),
    "v_shape": (ValueError, "v", lambda: ranker_attention(Q, K, V[:, :, :1], BOUNDS)),
    "gqa_divisibility": (
        ValueError,
        "Hq % Hkv",
        lambda: ranker_attention(Q[:, :, :3], K, V, BOUNDS),
    ),
    "empty_seq": (ValueError, "q", lambda: ranker_attention(Q[:, :0], K[:, :0], V[:, :0], BOUNDS)),
    "int_dtype": (
        TypeError,
        "q",
        lambda: ranker_attention(
            Q.astype(np.int32), K.astype(np.int32), V.astype(np.int32), BOUNDS
        ),
    ),
    "mixed_dtype": (
        TypeError,
        "dtype",
        lambda: ranker_attention(Q, K.astype(np.float16), V, BOUNDS),
    ),
    "sm_scale_negative": (
        ValueError,
        "sm_scale",
        lambda: ranker_attention(Q, K, V, BOUNDS, sm_scale=-1.0),
    ),
    "sm_scale_nan": (
        ValueError,
        "sm_scale",
        lambda: ranker_attention(Q, K, V, BOUNDS, sm_scale=float("nan")),
    ),
    "sm_scale_zero": (
        ValueError,
        "sm_scale",
        lambda: ranker_attention(Q, K, V, BOUNDS, sm_scale=0.0),
    ),
    "sm_scale_type": (
        TypeError,
        "sm_scale",
        lambda: ranker_attention(Q, K, V, BOUNDS, sm_scale="0.5"),
    ),
    "cap_type": (TypeError, "cap", lambda: ranker_attention(Q, K, V, BOUNDS, cap=30.0)),
    "config_type": (
        TypeError,
        "config",
        lambda: ranker_attention(Q, K, V, BOUNDS, config={"block_q": 64}),
    ),
    "bounds_width": (ValueError, "bounds", lambda: ranker_attention(Q, K, V, BOUNDS[:, :3])),
    "bounds_rank": (ValueError, "bounds", lambda: ranker_attention(Q, K, V, BOUNDS[None])),
    "bounds_rows": (
        ValueError,
        "bounds",
        lambda: ranker_attention(Q, K, V, np.zeros((3, 4), np.int32)),
    ),
    "bounds_float": (
        TypeError,
        "bounds",
        lambda: ranker_attention(Q, K, V, BOUNDS.astype(np.float32)),
    ),
    "bounds_bool": (TypeError, "bounds", lambda: ranker_attention(Q, K, V, BOUNDS.astype(bool))),
}


@pytest.mark.parametrize("case", list(RANKER_BAD))
def test_ranker_bad_input(case):
    exc, match, call = RANKER_BAD[case]
    with pytest.raises(exc, match=match):
        call()


SHARED_BAD = {
    "cap_method": (ValueError, "CapParams.method", lambda: CapParams("cube", 2.0)),
    "cap_method_type": (TypeError, "CapParams.method", lambda: CapParams(3, 2.0)),
    "cap_value_missing": (TypeError, "CapParams.value", lambda: CapParams(CapMethod.TANH)),
    "cap_value_negative": (ValueError, "CapParams.value", lambda: CapParams(CapMethod.TANH, -1.0)),
    "cap_value_inf": (ValueError, "CapParams.value", lambda: CapParams("soft_sign", float("inf"))),
    "config_block": (ValueError, "block_q", lambda: KernelConfig(block_q=40)),
    "config_block_type": (TypeError, "block_kv", lambda: KernelConfig(block_kv=64.0)),
    "config_stages": (ValueError, "num_stages", lambda: KernelConfig(num_stages=0)),
    "lengths_negative": (
        ValueError,
        "history_len",
        lambda: SegmentBounds.from_lengths(np.asarray([3, -1]), 2),
    ),
    "lengths_float": (TypeError, "candidate_len", lambda: SegmentBounds.from_lengths(3, 2.5)),
    "segment_ids_value": (
        ValueError,
        "segment_ids",
        lambda: SegmentBounds.from_segment_ids(np.asarray([[0, 1, 3]])),
    ),
    "segment_ids_gap": (
        ValueError,
        "segment_ids",
        lambda: SegmentBounds.from_segment_ids(np.asarray([[1, 1, 0, 1, 2]])),
    ),
    "segment_ids_rank": (
        ValueError,
        "segment_ids",
        lambda: SegmentBounds.from_segment_ids(np.asarray([1, 1, 2])),
    ),
}


@pytest.mark.parametrize("case", list(SHARED_BAD))
def test_shared_types_bad_input(case):
    exc, match, call = SHARED_BAD[case]
    with pytest.raises(exc, match=match):
        call()


def test_ranker_checkify_bounds():
    def f(bounds):
        return ranker_attention(Q, K, V, bounds, debug_checks=True)

    checked = checkify.checkify(f)
    err, _ = checked(BOUNDS)
    assert err.get() is None
    for bad in (
        [[0, 10, 10, 22], [2, 8, 12, 21]],
        [[-1, 10, 10, 15], [2, 8, 12, 21]],
        [[0, 10, 10, 15], [9, 8, 12, 21]],
        [0, 30, 30, 40],
    ):
        err, out = checked(np.asarray(bad, np.int32))
        msg = err.get()
        assert msg is not None and "bounds" in msg
        assert np.all(np.isfinite(np.asarray(out)))  # still a defined (clipped) result
    err, _ = checked(SegmentBounds.from_array(BOUNDS))
    assert err.get() is None


# --------------------------------------------------------------------------------------
# sparse_mla_attention: flat mode

SQ, SH, SDK, ST, SK = 5, 2, 40, 45, 3
SQ_ = randn(RNG, (1, SQ, SH, SDK))
SKV = randn(RNG, (1, ST, SDK))
SIDX = RNG.integers(-1, 3, (1, SQ, SK)).astype(np.int32)
SPOS = RNG.integers(0, ST, (1, SQ)).astype(np.int32)
FLAT_KW = {"sm_scale": 0.2, "kv_lora_rank": 32, "read_block": 16}


def _flat(q=SQ_, kv=SKV, idx=SIDX, pos=SPOS, fn=sparse_mla_attention, **kw):
    return fn(q, kv, idx, pos, **{**FLAT_KW, **kw})


FLAT_BAD = {
    "q_rank": (ValueError, "q", lambda: _flat(q=SQ_[0])),
    "q_dtype": (TypeError, "q", lambda: _flat(q=SQ_.astype(np.int32))),
    "q_not_array": (TypeError, "q", lambda: _flat(q=SQ_.tolist())),
    "kv_dtype": (TypeError, "kv", lambda: _flat(kv=SKV.astype(np.int32))),
    "kv_shape": (ValueError, "kv", lambda: _flat(kv=SKV[..., :20])),
    "kv_batch": (ValueError, "kv", lambda: _flat(kv=np.concatenate([SKV, SKV]))),
    "kv_rank": (ValueError, "kv", lambda: _flat(kv=SKV[0])),
    "indices_rank": (ValueError, "indices", lambda: _flat(idx=SIDX[0])),
    "indices_dtype": (TypeError, "indices", lambda: _flat(idx=SIDX.astype(np.float32))),
    "indices_shape": (ValueError, "indices", lambda: _flat(idx=SIDX[:, :3])),
    "positions_rank": (ValueError, "positions", lambda: _flat(pos=SPOS[0])),
    "positions_shape": (ValueError, "positions", lambda: _flat(pos=SPOS[:, :2])),
    "positions_dtype": (TypeError, "positions", lambda: _flat(pos=SPOS.astype(np.float32))),
    "sm_scale_missing": (ValueError, "sm_scale", lambda: _flat(sm_scale=None)),
    "sm_scale_negative": (ValueError, "sm_scale", lambda: _flat(sm_scale=-0.1)),
    "sm_scale_type": (TypeError, "sm_scale", lambda: _flat(sm_scale=np.ones(1))),
    "kv_lora_rank_big": (ValueError, "kv_lora_rank", lambda: _flat(kv_lora_rank=41)),
    "kv_lora_rank_zero": (ValueError, "kv_lora_rank", lambda: _flat(kv_lora_rank=0)),
    "read_block_zero": (ValueError, "read_block", lambda: _flat(read_block=0)),
    "read_block_float": (TypeError, "read_block", lambda: _flat(read_block=16.0)),
    "ragged_arg_without_seq_id": (
        ValueError,
        "seq_lens",
        lambda: _flat(seq_lens=np.asarray([3], np.int32)),
    ),
    "qblock_query_block": (
        ValueError,
        "query_block",
        lambda: _flat(fn=sparse_mla_attention_qblock, query_block=0),
    ),
    "qblock_u_max": (ValueError, "u_max", lambda: _flat(fn=sparse_mla_attention_qblock, u_max=0)),
    "qblock_forwards_checks": (
        ValueError,
        "positions",
        lambda: _flat(fn=sparse_mla_attention_qblock, pos=SPOS[0]),
    ),
}


@pytest.mark.parametrize("case", list(FLAT_BAD))
def test_sparse_mla_flat_bad_input(case):
    exc, match, call = FLAT_BAD[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("variant", ["plain", "qblock", "qblock_small_u_max"])
def test_sparse_mla_checkify_indices(variant):
    fn = sparse_mla_attention if variant == "plain" else sparse_mla_attention_qblock
    extra = {"query_block": 2, "u_max": 2} if variant == "qblock_small_u_max" else {}

    def f(idx):
        return _flat(idx=idx, fn=fn, debug_checks=True, **extra)

    checked = checkify.checkify(f)
    ok = np.asarray([[[0, 1, 2], [-1, -1, 2], [2, 2, 2], [0, -1, 1], [1, 1, -1]]], np.int32)
    err, _ = checked(ok)
    assert err.get() is None
    for bad_value in (3, 100, -2):  # 3 units over T = 45 with read_block 16
        bad = ok.copy()
        bad[0, 2, 1] = bad_value
        err, out = checked(bad)
        msg = err.get()
        assert msg is not None and "indices" in msg
        assert np.all(np.isfinite(np.asarray(out)))


# --------------------------------------------------------------------------------------
# sparse_mla_attention: ragged paged mode

PAGE = 16
LAYOUT = build_ragged_layout(
    rng_for(91), seq_lens=[20, 33], new_lens=[3, 4], extra_pages=[0, 1], page_size=PAGE
)
NQ = 7
RQ = randn(RNG, (1, NQ, SH, SDK))
RCACHE_BF16 = randn(RNG, (LAYOUT["num_pages"], PAGE // 2, 2, 128), "bfloat16")
RCACHE_F32 = randn(RNG, (LAYOUT["num_pages"], PAGE, 1, 128), np.float32)
RIDX = RNG.integers(-1, 2, (1, NQ, SK)).astype(np.int32)
RPOS = LAYOUT["positions"][None]
RAGGED_TABLES = {
    "q_seq_id": LAYOUT["q_seq_id"],
    "seq_lens": LAYOUT["seq_lens"],
    "cu_kv_lens": LAYOUT["cu_kv_lens"],
    "page_indices": LAYOUT["page_indices"],
}


def _ragged(q=RQ, kv=RCACHE_BF16, idx=RIDX, pos=RPOS, fn=sparse_mla_attention, **kw):
    args = {
        "sm_scale": 0.2,
        "kv_lora_rank": 32,
        "read_block": PAGE,
        "page_size": PAGE,
        **RAGGED_TABLES,
        **kw,
    }
    return fn(q, kv, idx, pos, **args)


RAGGED_BAD = {
    "batch_not_one": (
        ValueError,
        "q",
        lambda: _ragged(
            q=np.concatenate([RQ, RQ]),
            idx=np.concatenate([RIDX, RIDX]),
            pos=np.concatenate([RPOS, RPOS]),
        ),
    ),
    "missing_seq_lens": (ValueError, "seq_lens", lambda: _ragged(seq_lens=None)),
    "missing_cu_kv_lens": (ValueError, "cu_kv_lens", lambda: _ragged(cu_kv_lens=None)),
    "missing_page_indices": (ValueError, "page_indices", lambda: _ragged(page_indices=None)),
    "missing_page_size": (ValueError, "page_size", lambda: _ragged(page_size=None)),
    "page_size_not_16x": (ValueError, "page_size", lambda: _ragged(page_size=24, read_block=24)),
    "read_block_mismatch": (ValueError, "read_block", lambda: _ragged(read_block=32)),
    "q_seq_id_len": (ValueError, "q_seq_id", lambda: _ragged(q_seq_id=LAYOUT["q_seq_id"][:5])),
    "q_seq_id_dtype": (
        TypeError,
        "q_seq_id",
        lambda: _ragged(q_seq_id=LAYOUT["q_seq_id"].astype(np.float32)),
    ),
    "seq_lens_rank": (ValueError, "seq_lens", lambda: _ragged(seq_lens=LAYOUT["seq_lens"][None])),
    "cu_kv_lens_len": (
        ValueError,
        "cu_kv_lens",
        lambda: _ragged(cu_kv_lens=LAYOUT["cu_kv_lens"][:2]),
    ),
    "page_indices_dtype": (
        TypeError,
        "page_indices",
        lambda: _ragged(page_indices=LAYOUT["page_indices"].astype(np.float32)),
    ),
    "cache_packing": (
        ValueError,
        "kv",
        lambda: _ragged(kv=RCACHE_F32.astype("float32").reshape(-1, PAGE // 2, 2, 128)),
    ),
    "cache_bf16_unpacked": (
        ValueError,
        "kv",
        lambda: _ragged(kv=RCACHE_BF16.reshape(-1, PAGE, 1, 128)),
    ),
    "cache_dk_pad": (ValueError, "kv", lambda: _ragged(kv=RCACHE_BF16[..., :64])),
    "cache_flat": (ValueError, "kv", lambda: _ragged(kv=RCACHE_BF16.reshape(1, -1, 128))),
    "qblock_ragged": (
        ValueError,
        "read_block",
        lambda: _ragged(fn=sparse_mla_attention_qblock, read_block=32),
    ),
}


@pytest.mark.parametrize("case", list(RAGGED_BAD))
def test_sparse_mla_ragged_bad_input(case):
    exc, match, call = RAGGED_BAD[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.slow  # ~6 s on 2 cores; tests/test_ragged_metadata.py covers checkify quickly
def test_ragged_valid_call_and_checkify():
    out = _ragged()
    assert np.all(np.isfinite(np.asarray(out)))
    assert np.all(np.isfinite(np.asarray(_ragged(kv=RCACHE_F32))))
    checked = checkify.checkify(lambda idx: _ragged(idx=idx, debug_checks=True))
    err, _ = checked(RIDX)
    assert err.get() is None
    bad = RIDX.copy()
    bad[0, 1, 0] = LAYOUT["page_indices"].shape[0]  # beyond the whole page table
    err, _ = checked(bad)
    assert err.get() is not None and "indices" in err.get()


# --------------------------------------------------------------------------------------
# paged_write_back

WCACHE = randn(RNG, (4, PAGE // 2, 2, 128), "bfloat16")
WROWS = randn(RNG, (6, 128))
WLOC = np.asarray([0, 5, -1, 17, 63, 64], np.int32)


def _write(cache=WCACHE, rows=WROWS, loc=WLOC, page_size=PAGE):
    return paged_write_back(cache, rows, loc, page_size=page_size)


WRITE_BAD = {
    "page_size_zero": (ValueError, "page_size", lambda: _write(page_size=0)),
    "page_size_type": (ValueError, "page_size", lambda: _write(page_size=16.0)),
    "page_size_mismatch": (ValueError, "cache", lambda: _write(page_size=32)),
    "cache_rank": (ValueError, "cache", lambda: _write(cache=WCACHE.reshape(4, 16, 128))),
    "cache_packing": (ValueError, "cache", lambda: _write(cache=WCACHE.reshape(4, 16, 1, 128))),
    "cache_not_array": (TypeError, "cache", lambda: _write(cache=None)),
    "rows_rank": (ValueError, "rows", lambda: _write(rows=WROWS[None])),
    "rows_width": (ValueError, "rows", lambda: _write(rows=WROWS[:, :64])),
    "loc_shape": (ValueError, "loc", lambda: _write(loc=WLOC[:4])),
    "loc_dtype": (TypeError, "loc", lambda: _write(loc=WLOC.astype(np.float32))),
}


@pytest.mark.parametrize("case", list(WRITE_BAD))
def test_paged_write_back_bad_input(case):
    exc, match, call = WRITE_BAD[case]
    with pytest.raises(exc, match=match):
        call()


# --------------------------------------------------------------------------------------
# prefill_write_and_attend_ragged (and its _qblock twin)

ROPE = 8
PQL = randn(RNG, (NQ, SH, 32))
PQPE = randn(RNG, (NQ, SH, ROPE))
PKVC = randn(RNG, (NQ, 32))
PKPE = randn(RNG, (NQ, ROPE))
PLOC = np.arange(NQ, dtype=np.int32)


def _prefill(fn=prefill_write_and_attend_ragged, **over):
    args = {
        "ql": PQL,
        "qpe": PQPE,
        "kvc": PKVC,
        "kpe": PKPE,
        "cache": RCACHE_BF16,
        "topk_pages": RIDX[0],
        "positions": RPOS[0],
        "loc": PLOC,
        "seq_lens": LAYOUT["seq_lens"],
        "cu_q_lens": LAYOUT["cu_q_lens"],
        "cu_kv_lens": LAYOUT["cu_kv_lens"],
        "page_indices": LAYOUT["page_indices"],
    }
    kw = {"kv_lora_rank": 32, "page_size": PAGE, "sm_scale": 0.2}
    for name, value in over.items():
        (kw if name in kw else args)[name] = value
    return fn(*args.values(), **kw)


PREFILL_BAD = {
    "ql_rank": (ValueError, "ql", {"ql": PQL[0]}),
    "ql_not_array": (TypeError, "ql", {"ql": None}),
    "ql_lora": (ValueError, "ql", {"kv_lora_rank": 16}),
    "qpe_shape": (ValueError, "qpe", {"qpe": PQPE[:, :1]}),
    "qpe_rank": (ValueError, "qpe", {"qpe": PQPE[0]}),
    "kvc_shape": (ValueError, "kvc", {"kvc": PKVC[:, :16]}),
    "kvc_rank": (ValueError, "kvc", {"kvc": PKVC[None]}),
    "kpe_tokens": (ValueError, "kpe", {"kpe": PKPE[:3]}),
    "kpe_width": (ValueError, "kpe", {"kpe": PKPE[:, :4]}),
    "cache_dk_pad": (ValueError, "cache", {"cache": RCACHE_BF16[..., :64]}),
    "cache_page_size": (ValueError, "cache", {"page_size": 32}),
    "page_size_bad": (ValueError, "page_size", {"page_size": -16}),
    "loc_shape": (ValueError, "loc", {"loc": PLOC[:3]}),
    "topk_pages_rank": (ValueError, "topk_pages", {"topk_pages": RIDX}),
    "topk_pages_tokens": (ValueError, "topk_pages", {"topk_pages": RIDX[0, :3]}),
    "topk_pages_dtype": (TypeError, "topk_pages", {"topk_pages": RIDX[0].astype(np.float32)}),
    "positions_shape": (ValueError, "positions", {"positions": RPOS[0, :3]}),
    "positions_2d": (ValueError, "positions", {"positions": RPOS}),
    "positions_dtype": (TypeError, "positions", {"positions": RPOS[0].astype(np.float32)}),
    "cu_q_lens_len": (ValueError, "cu_q_lens", {"cu_q_lens": LAYOUT["cu_q_lens"][:2]}),
    "cu_q_lens_dtype": (TypeError, "cu_q_lens", {"cu_q_lens": LAYOUT["cu_q_lens"] * 1.0}),
    "seq_lens_rank": (ValueError, "seq_lens", {"seq_lens": LAYOUT["seq_lens"][None]}),
    "loc_dtype": (TypeError, "loc", {"loc": PLOC.astype(np.float32)}),
    "page_indices_dtype": (
        TypeError,
        "page_indices",
        {"page_indices": LAYOUT["page_indices"].astype(np.float32)},
    ),
    "sm_scale_missing": (ValueError, "sm_scale", {"sm_scale": None}),
}


@pytest.mark.parametrize(
    "fn", [prefill_write_and_attend_ragged, prefill_write_and_attend_ragged_qblock]
)
@pytest.mark.parametrize("case", list(PREFILL_BAD))
def test_prefill_bad_input(case, fn):
    exc, match, over = PREFILL_BAD[case]
    with pytest.raises(exc, match=match):
        _prefill(fn=fn, **over)


def test_prefill_valid_call():
    out, cache = _prefill()
    assert np.all(np.isfinite(np.asarray(out)))
    assert cache.shape == RCACHE_BF16.shape and cache.dtype == RCACHE_BF16.dtype
