"""Paged-cache contract: the latent row layout and the paged ops' input validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sds

from attn_common import (
    check_paged_cache,
    check_prefill_inputs,
    check_write_back_inputs,
    kv_packing,
    latent_rows,
    padded_dk,
)

# --------------------------------------------------------------------------------------
# latent_rows


@pytest.mark.parametrize("kpe_rank", [2, 3])
@pytest.mark.parametrize(
    ("src", "dst"),
    [("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "float32")],
)
def test_latent_rows_layout(kpe_rank, src, dst):
    num_tokens, lora, rope, width = 5, 32, 8, 128
    rng = np.random.default_rng(0)
    kvc = jnp.asarray(rng.standard_normal((num_tokens, lora)), src)
    kpe2 = jnp.asarray(rng.standard_normal((num_tokens, rope)), src)
    kpe = kpe2 if kpe_rank == 2 else kpe2[:, None, :]
    rows = latent_rows(kvc, kpe, width=width, dtype=dst)
    assert rows.shape == (num_tokens, width) and rows.dtype == jnp.dtype(dst)
    got = np.asarray(rows.astype(jnp.float32))
    np.testing.assert_array_equal(got[:, :lora], np.asarray(kvc.astype(dst).astype(jnp.float32)))
    np.testing.assert_array_equal(
        got[:, lora : lora + rope], np.asarray(kpe2.astype(dst).astype(jnp.float32))
    )
    np.testing.assert_array_equal(got[:, lora + rope :], 0.0)


def test_latent_rows_exact_width():
    kvc = jnp.ones((3, 96), jnp.float32)
    kpe = jnp.full((3, 1, 32), 2.0, jnp.float32)
    rows = latent_rows(kvc, kpe, width=128, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(rows[:, :96]), 1.0)
    np.testing.assert_array_equal(np.asarray(rows[:, 96:]), 2.0)


def test_latent_rows_under_jit():
    kvc = jnp.arange(8, dtype=jnp.float32).reshape(2, 4)
    kpe = jnp.full((2, 2), -1.0, jnp.float32)
    rows = jax.jit(lambda a, b: latent_rows(a, b, width=8, dtype=jnp.bfloat16))(kvc, kpe)
    want = np.array([[0, 1, 2, 3, -1, -1, 0, 0], [4, 5, 6, 7, -1, -1, 0, 0]], np.float32)
    np.testing.assert_array_equal(np.asarray(rows.astype(jnp.float32)), want)
    assert rows.dtype == jnp.bfloat16


# --------------------------------------------------------------------------------------
# check_paged_cache

PAGE = 16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_check_paged_cache_ok(dtype):
    pk = kv_packing(dtype)
    shape = (3, PAGE // pk, pk, 128)
    assert check_paged_cache(sds(shape, dtype), PAGE) == shape


CACHE = sds((4, PAGE // 2, 2, 128))

CACHE_BAD = {
    "not_array": (TypeError, "cache: got", None, PAGE),
    "page_size_zero": (ValueError, "page_size: got 0", CACHE, 0),
    "page_size_negative": (ValueError, "page_size: got -16", CACHE, -16),
    "page_size_float": (ValueError, "page_size: got 16.0", CACHE, 16.0),
    "page_size_bool": (ValueError, "page_size: got True", CACHE, True),
    "page_size_mismatch": (ValueError, "cache: got shape", CACHE, 32),
    "rank": (ValueError, "cache: got shape", sds((4, 16, 128)), PAGE),
    "packing": (ValueError, "cache: got shape", sds((4, 16, 1, 128)), PAGE),
    "packing_f32": (ValueError, "cache: got shape", sds((4, 8, 2, 128), jnp.float32), PAGE),
}


@pytest.mark.parametrize("case", list(CACHE_BAD))
def test_check_paged_cache_errors(case):
    exc, match, cache, page_size = CACHE_BAD[case]
    with pytest.raises(exc, match=match):
        check_paged_cache(cache, page_size)


# --------------------------------------------------------------------------------------
# check_write_back_inputs

ROWS = sds((6, 128), jnp.float32)
LOC = sds((6,), jnp.int32)


def test_check_write_back_inputs_ok():
    assert check_write_back_inputs(CACHE, ROWS, LOC, PAGE) == CACHE.shape
    # any integer loc dtype, any rows dtype (cast to the cache's), empty batch
    check_write_back_inputs(CACHE, sds((6, 128), jnp.bfloat16), sds((6,), jnp.int64), PAGE)
    check_write_back_inputs(CACHE, sds((0, 128)), sds((0,), jnp.int32), PAGE)


WRITE_BAD = {
    "cache_not_array": (TypeError, "cache: got", {"cache": None}),
    "cache_shape": (ValueError, "cache: got shape", {"cache": sds((4, 16, 128))}),
    "page_size": (ValueError, "page_size: got", {"page_size": 0}),
    "rows_not_array": (TypeError, "rows: got", {"rows": [[0.0] * 128]}),
    "rows_rank": (ValueError, "rows: got shape", {"rows": sds((1, 6, 128))}),
    "rows_width": (ValueError, "rows: got shape", {"rows": sds((6, 64))}),
    "loc_not_array": (TypeError, "loc: got", {"loc": list(range(6))}),
    "loc_length": (ValueError, "loc: got shape", {"loc": sds((4,), jnp.int32)}),
    "loc_rank": (ValueError, "loc: got shape", {"loc": sds((6, 1), jnp.int32)}),
    "loc_dtype": (TypeError, "loc: got dtype", {"loc": sds((6,), jnp.float32)}),
}


@pytest.mark.parametrize("case", list(WRITE_BAD))
def test_check_write_back_inputs_errors(case):
    exc, match, over = WRITE_BAD[case]
    args = {"cache": CACHE, "rows": ROWS, "loc": LOC, "page_size": PAGE, **over}
    with pytest.raises(exc, match=match):
        check_write_back_inputs(**args)


# --------------------------------------------------------------------------------------
# check_prefill_inputs

T, H, LORA, ROPE, K, NSEQ, NPT = 7, 2, 96, 16, 3, 2, 5
F32, I32 = jnp.float32, jnp.int32
DK_PAD = padded_dk(LORA + ROPE)


def _prefill_args(**over):
    args = {
        "ql": sds((T, H, LORA), F32),
        "qpe": sds((T, H, ROPE), F32),
        "kvc": sds((T, LORA), F32),
        "kpe": sds((T, ROPE), F32),
        "cache": sds((4, PAGE // 2, 2, DK_PAD)),
        "topk_pages": sds((T, K), I32),
        "positions": sds((T,), I32),
        "loc": sds((T,), I32),
        "seq_lens": sds((NSEQ,), I32),
        "cu_q_lens": sds((NSEQ + 1,), I32),
        "cu_kv_lens": sds((NSEQ + 1,), I32),
        "page_indices": sds((NPT,), I32),
    }
    kw = {"kv_lora_rank": LORA, "page_size": PAGE}
    for name, value in over.items():
        (kw if name in kw else args)[name] = value
    return args, kw


def _check(**over):
    args, kw = _prefill_args(**over)
    return check_prefill_inputs(*args.values(), **kw)


def test_check_prefill_inputs_ok():
    assert _check() is None
    _check(kpe=sds((T, 1, ROPE), F32))  # [T, 1, rope] is accepted too
    _check(ql=sds((T, H, LORA), jnp.bfloat16), topk_pages=sds((T, K), jnp.int64))
    _check(cache=sds((4, PAGE, 1, DK_PAD), F32))
    _check(topk_pages=sds((T, 0), I32))  # K == 0: nothing selected


def test_check_prefill_inputs_positional_order():
    """The signature order is the backends' public order (loc before the ragged tables)."""
    args, kw = _prefill_args()
    # swapping loc and seq_lens (both int 1-D) must be caught by their shapes
    args["loc"], args["seq_lens"] = args["seq_lens"], args["loc"]
    with pytest.raises(ValueError, match="loc: got shape"):
        check_prefill_inputs(*args.values(), **kw)


PREFILL_BAD = {
    # ql / qpe / kvc / kpe: arrays, ranks, shapes, floating dtypes
    "ql_not_array": (TypeError, "ql: got", {"ql": None}),
    "ql_rank": (ValueError, "ql: got shape", {"ql": sds((H, LORA), F32)}),
    "ql_dtype": (TypeError, "ql: got dtype", {"ql": sds((T, H, LORA), I32)}),
    "ql_lora": (ValueError, "ql: got last dim", {"kv_lora_rank": 64}),
    "kv_lora_rank_type": (TypeError, "kv_lora_rank: got", {"kv_lora_rank": float(LORA)}),
    "kv_lora_rank_zero": (ValueError, "kv_lora_rank: got", {"kv_lora_rank": 0}),
    "qpe_not_array": (TypeError, "qpe: got", {"qpe": None}),
    "qpe_rank": (ValueError, "qpe: got shape", {"qpe": sds((H, ROPE), F32)}),
    "qpe_tokens": (ValueError, "qpe: got shape", {"qpe": sds((T - 1, H, ROPE), F32)}),
    "qpe_heads": (ValueError, "qpe: got shape", {"qpe": sds((T, H + 1, ROPE), F32)}),
    "qpe_dtype": (TypeError, "qpe: got dtype", {"qpe": sds((T, H, ROPE), I32)}),
    "kvc_not_array": (TypeError, "kvc: got", {"kvc": None}),
    "kvc_rank": (ValueError, "kvc: got shape", {"kvc": sds((1, T, LORA), F32)}),
    "kvc_tokens": (ValueError, "kvc: got shape", {"kvc": sds((T + 1, LORA), F32)}),
    "kvc_width": (ValueError, "kvc: got shape", {"kvc": sds((T, LORA // 2), F32)}),
    "kvc_dtype": (TypeError, "kvc: got dtype", {"kvc": sds((T, LORA), I32)}),
    "kpe_not_array": (TypeError, "kpe: got", {"kpe": None}),
    "kpe_scalar": (ValueError, "kpe: got shape", {"kpe": sds((), F32)}),
    "kpe_tokens": (ValueError, "kpe: got shape", {"kpe": sds((T - 1, ROPE), F32)}),
    "kpe_width": (ValueError, "kpe: got shape", {"kpe": sds((T, ROPE // 2), F32)}),
    "kpe_same_size_other_shape": (
        ValueError,
        "kpe: got shape",
        {"kpe": sds((T, 2, ROPE // 2), F32)},
    ),
    "kpe_dtype": (TypeError, "kpe: got dtype", {"kpe": sds((T, ROPE), I32)}),
    # integer index arrays
    "topk_pages_not_array": (TypeError, "topk_pages: got", {"topk_pages": None}),
    "topk_pages_rank": (ValueError, "topk_pages: got shape", {"topk_pages": sds((1, T, K), I32)}),
    "topk_pages_tokens": (
        ValueError,
        "topk_pages: got shape",
        {"topk_pages": sds((T - 1, K), I32)},
    ),
    "topk_pages_dtype": (TypeError, "topk_pages: got dtype", {"topk_pages": sds((T, K), F32)}),
    "positions_shape": (ValueError, "positions: got shape", {"positions": sds((T - 1,), I32)}),
    "positions_2d": (ValueError, "positions: got shape", {"positions": sds((1, T), I32)}),
    "positions_dtype": (TypeError, "positions: got dtype", {"positions": sds((T,), F32)}),
    "loc_not_array": (TypeError, "loc: got", {"loc": None}),
    "loc_shape": (ValueError, "loc: got shape", {"loc": sds((T + 1,), I32)}),
    "loc_dtype": (TypeError, "loc: got dtype", {"loc": sds((T,), F32)}),
    "seq_lens_rank": (ValueError, "seq_lens: got shape", {"seq_lens": sds((1, NSEQ), I32)}),
    "seq_lens_dtype": (TypeError, "seq_lens: got dtype", {"seq_lens": sds((NSEQ,), F32)}),
    "cu_q_lens_len": (ValueError, "cu_q_lens: got shape", {"cu_q_lens": sds((NSEQ,), I32)}),
    "cu_q_lens_dtype": (TypeError, "cu_q_lens: got dtype", {"cu_q_lens": sds((NSEQ + 1,), F32)}),
    "cu_kv_lens_len": (ValueError, "cu_kv_lens: got shape", {"cu_kv_lens": sds((NSEQ + 2,), I32)}),
    "cu_kv_lens_dtype": (
        TypeError,
        "cu_kv_lens: got dtype",
        {"cu_kv_lens": sds((NSEQ + 1,), F32)},
    ),
    "page_indices_rank": (
        ValueError,
        "page_indices: got shape",
        {"page_indices": sds((1, NPT), I32)},
    ),
    "page_indices_dtype": (
        TypeError,
        "page_indices: got dtype",
        {"page_indices": sds((NPT,), F32)},
    ),
    # cache and page size
    "cache_not_array": (TypeError, "cache: got", {"cache": None}),
    "cache_page_size": (ValueError, "cache: got shape", {"page_size": 32}),
    "cache_rank": (ValueError, "cache: got shape", {"cache": sds((4, PAGE, DK_PAD))}),
    "cache_dtype": (
        TypeError,
        "cache: got dtype",
        {"cache": sds((4, PAGE // 2, 2, DK_PAD), jnp.int16)},
    ),
    "cache_dk_pad": (
        ValueError,
        "cache: got last dim",
        {"cache": sds((4, PAGE // 2, 2, DK_PAD + 128))},
    ),
    "page_size_bad": (ValueError, "page_size: got", {"page_size": -16}),
    "page_size_type": (ValueError, "page_size: got", {"page_size": 16.0}),
}


@pytest.mark.parametrize("case", list(PREFILL_BAD))
def test_check_prefill_inputs_errors(case):
    exc, match, over = PREFILL_BAD[case]
    with pytest.raises(exc, match=f"^{match}"):
        _check(**over)
