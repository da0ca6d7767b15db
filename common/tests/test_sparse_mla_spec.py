"""Sparse-MLA input contract and ragged helpers against brute force."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sds, tier_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_common import (
    SparseMlaProblem,
    check_sparse_mla_inputs,
    kv_packing,
    padded_dk,
    seq_id_from_cu_q_lens,
)
from attn_common.sparse_mla import lift_ragged_indices, ragged_query_info

# --------------------------------------------------------------------------------------
# padded_dk


@pytest.mark.parametrize(
    "dk, expected", [(1, 128), (64, 128), (128, 128), (129, 256), (512, 512), (576, 640), (0, 0)]
)
def test_padded_dk(dk, expected):
    assert padded_dk(dk) == expected


# --------------------------------------------------------------------------------------
# check_sparse_mla_inputs: flat mode


def flat(b=2, s=8, h=4, dk=576, t=300, k=3, dtype=jnp.bfloat16, idx_dtype=jnp.int32):
    return (
        sds((b, s, h, dk), dtype),
        sds((b, t, dk), dtype),
        sds((b, s, k), idx_dtype),
        sds((b, s), idx_dtype),
    )


def test_flat_valid():
    p = check_sparse_mla_inputs(*flat(), sm_scale=0.1)
    assert isinstance(p, SparseMlaProblem)
    assert (p.batch, p.num_queries, p.heads, p.dk, p.dv, p.top_k) == (2, 8, 4, 576, 512, 3)
    assert p.read_block == 128 and p.sm_scale == 0.1 and not p.ragged
    assert p.kv_len == 300 and p.num_units == 3  # cdiv(300, 128)
    assert p.dk_pad == 640


@pytest.mark.parametrize(
    "t, rb, units", [(1, 128, 1), (128, 128, 1), (129, 128, 2), (300, 16, 19), (64, 1, 64)]
)
def test_flat_num_units(t, rb, units):
    p = check_sparse_mla_inputs(*flat(t=t, dk=64), sm_scale=1.0, kv_lora_rank=32, read_block=rb)
    assert p.num_units == units and p.kv_len == t and p.dv == 32


def test_flat_kv_lora_rank_equal_to_dk():
    p = check_sparse_mla_inputs(*flat(dk=576), sm_scale=0.1, kv_lora_rank=576)
    assert p.dv == 576


def test_flat_concrete_arrays_and_int_dtypes():
    q = jnp.zeros((1, 3, 2, 16), jnp.float32)
    kv = np.zeros((1, 20, 16), np.float32)
    idx = np.zeros((1, 3, 2), np.int64)
    pos = jnp.zeros((1, 3), jnp.int16)
    p = check_sparse_mla_inputs(q, kv, idx, pos, sm_scale=2, kv_lora_rank=16, read_block=4)
    assert p.sm_scale == 2.0 and p.num_units == 5 and p.dv == 16


def _flat_bad_cases():
    q, kv, idx, pos = flat()

    def bad_keyword(exc, **kw):  # the call with one bad keyword: the error names it
        (name,) = kw
        return (q, kv, idx, pos), kw, exc, name

    return {
        "q rank": ((sds((2, 8, 576)), kv, idx, pos), {}, ValueError, "q"),
        "q int dtype": ((sds(q.shape, jnp.int32), kv, idx, pos), {}, TypeError, "q"),
        "kv int dtype": ((q, sds(kv.shape, jnp.int8), idx, pos), {}, TypeError, "kv"),
        "q not an array": ((None, kv, idx, pos), {}, TypeError, "q"),
        "kv not an array": ((q, [1.0], idx, pos), {}, TypeError, "kv"),
        "indices rank 2": ((q, kv, sds((2, 8), jnp.int32), pos), {}, ValueError, "indices"),
        "indices rank 4": ((q, kv, sds((2, 8, 3, 1), jnp.int32), pos), {}, ValueError, "indices"),
        "indices float": ((q, kv, sds(idx.shape, jnp.float32), pos), {}, TypeError, "indices"),
        "indices batch": ((q, kv, sds((1, 8, 3), jnp.int32), pos), {}, ValueError, "indices"),
        "indices seq": ((q, kv, sds((2, 9, 3), jnp.int32), pos), {}, ValueError, "indices"),
        "positions rank": ((q, kv, idx, sds((2, 8, 1), jnp.int32)), {}, ValueError, "positions"),
        "positions shape": ((q, kv, idx, sds((2, 7), jnp.int32)), {}, ValueError, "positions"),
        "positions float": ((q, kv, idx, sds((2, 8), jnp.float32)), {}, TypeError, "positions"),
        "kv rank": ((q, sds((2, 300, 1, 576)), idx, pos), {}, ValueError, "kv"),
        "kv batch": ((q, sds((3, 300, 576)), idx, pos), {}, ValueError, "kv"),
        "kv dk": ((q, sds((2, 300, 512)), idx, pos), {}, ValueError, "kv"),
        "kv_lora_rank > Dk": bad_keyword(ValueError, kv_lora_rank=640),
        "kv_lora_rank Dk + 1": bad_keyword(ValueError, kv_lora_rank=577),
        "kv_lora_rank 0": bad_keyword(ValueError, kv_lora_rank=0),
        "kv_lora_rank float": bad_keyword(TypeError, kv_lora_rank=512.0),
        "read_block 0": bad_keyword(ValueError, read_block=0),
        "read_block bool": bad_keyword(TypeError, read_block=True),
        "page_size in flat mode": bad_keyword(ValueError, page_size=16),
        "read_block negative": bad_keyword(ValueError, read_block=-128),
        "sm_scale None": bad_keyword(ValueError, sm_scale=None),
        "sm_scale 0": bad_keyword(ValueError, sm_scale=0.0),
        "sm_scale negative": bad_keyword(ValueError, sm_scale=-1.0),
        "sm_scale nan": bad_keyword(ValueError, sm_scale=float("nan")),
        "sm_scale array": bad_keyword(TypeError, sm_scale=jnp.float32(0.1)),
        "seq_lens without q_seq_id": bad_keyword(ValueError, seq_lens=sds((2,), jnp.int32)),
        "cu_kv_lens without q_seq_id": bad_keyword(ValueError, cu_kv_lens=sds((3,), jnp.int32)),
        "page_indices without q_seq_id": bad_keyword(ValueError, page_indices=sds((4,), jnp.int32)),
    }


@pytest.mark.parametrize("case", list(_flat_bad_cases()))
def test_flat_bad_inputs(case):
    args, kwargs, exc, name = _flat_bad_cases()[case]
    kwargs = {"sm_scale": 0.1, **kwargs}
    with pytest.raises(exc) as info:
        check_sparse_mla_inputs(*args, **kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{name}: "), msg


# --------------------------------------------------------------------------------------
# check_sparse_mla_inputs: ragged paged mode


def ragged(
    s=10, h=4, dk=576, k=2, page_size=16, num_pages=7, n_seq=3, total_pages=9, dtype=jnp.bfloat16
):
    pk = kv_packing(dtype)
    args = (
        sds((1, s, h, dk), dtype),
        sds((num_pages, page_size // pk, pk, padded_dk(dk)), dtype),
        sds((1, s, k), jnp.int32),
        sds((1, s), jnp.int32),
    )
    kwargs = dict(
        sm_scale=0.1,
        read_block=page_size,
        page_size=page_size,
        q_seq_id=sds((s,), jnp.int32),
        seq_lens=sds((n_seq,), jnp.int32),
        cu_kv_lens=sds((n_seq + 1,), jnp.int32),
        page_indices=sds((total_pages,), jnp.int32),
    )
    return args, kwargs


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [16, 64])
def test_ragged_valid(dtype, page_size):
    args, kwargs = ragged(dtype=dtype, page_size=page_size)
    p = check_sparse_mla_inputs(*args, **kwargs)
    assert p.ragged
    assert p.read_block == page_size
    assert p.num_units == 9  # page-table width
    assert p.kv_len == 7 * page_size
    assert p.dk == 576 and p.dv == 512


def _ragged_bad_cases():
    args, kw = ragged()
    q, kv, idx, pos = args

    def with_(**changes):
        return args, {**kw, **changes}

    return {
        "batch 2": (
            (sds((2, 10, 4, 576)), kv, sds((2, 10, 2), jnp.int32), sds((2, 10), jnp.int32)),
            kw,
            ValueError,
            "q",
        ),
        "missing seq_lens": (*with_(seq_lens=None), ValueError, "seq_lens"),
        "missing cu_kv_lens": (*with_(cu_kv_lens=None), ValueError, "cu_kv_lens"),
        "missing page_indices": (*with_(page_indices=None), ValueError, "page_indices"),
        "missing page_size": (*with_(page_size=None), ValueError, "page_size"),
        "page_size not multiple of 16": (
            *with_(page_size=24, read_block=24),
            ValueError,
            "page_size",
        ),
        "page_size 8": (*with_(page_size=8, read_block=8), ValueError, "page_size"),
        "page_size 0": (*with_(page_size=0, read_block=16), ValueError, "page_size"),
        "read_block != page_size": (*with_(read_block=128), ValueError, "read_block"),
        "q_seq_id rank": (*with_(q_seq_id=sds((1, 10), jnp.int32)), ValueError, "q_seq_id"),
        "q_seq_id length": (*with_(q_seq_id=sds((11,), jnp.int32)), ValueError, "q_seq_id"),
        "q_seq_id float": (*with_(q_seq_id=sds((10,), jnp.float32)), TypeError, "q_seq_id"),
        "seq_lens rank": (*with_(seq_lens=sds((3, 1), jnp.int32)), ValueError, "seq_lens"),
        "seq_lens float": (*with_(seq_lens=sds((3,), jnp.float32)), TypeError, "seq_lens"),
        "cu_kv_lens length": (*with_(cu_kv_lens=sds((3,), jnp.int32)), ValueError, "cu_kv_lens"),
        "cu_kv_lens float": (*with_(cu_kv_lens=sds((4,), jnp.float32)), TypeError, "cu_kv_lens"),
        "page_indices rank": (
            *with_(page_indices=sds((3, 3), jnp.int32)),
            ValueError,
            "page_indices",
        ),
        "kv flat in ragged mode": ((q, sds((1, 100, 576)), idx, pos), kw, ValueError, "kv"),
        "kv unpadded dk": ((q, sds((7, 8, 2, 576)), idx, pos), kw, ValueError, "kv"),
        "kv wrong packing": ((q, sds((7, 16, 1, 640)), idx, pos), kw, ValueError, "kv"),
        "kv wrong page rows": ((q, sds((7, 16, 2, 640)), idx, pos), kw, ValueError, "kv"),
        "kv f32 packing": (
            (sds((1, 10, 4, 576), jnp.float32), sds((7, 8, 2, 640), jnp.float32), idx, pos),
            kw,
            ValueError,
            "kv",
        ),
    }


@pytest.mark.parametrize("case", list(_ragged_bad_cases()))
def test_ragged_bad_inputs(case):
    args, kwargs, exc, name = _ragged_bad_cases()[case]
    with pytest.raises(exc) as info:
        check_sparse_mla_inputs(*args, **kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{name}: "), msg


def test_ragged_kv_message_states_expected_shape():
    args, kw = ragged()
    q, _, idx, pos = args
    with pytest.raises(ValueError, match=r"\[num_pages, 8, 2, 640\]"):
        check_sparse_mla_inputs(q, sds((7, 16, 1, 640)), idx, pos, **kw)


# --------------------------------------------------------------------------------------
# seq_id_from_cu_q_lens


@st.composite
def cu_lens(draw):
    n_seq = draw(st.integers(1, 6))
    lens = draw(st.lists(st.integers(0, 7), min_size=n_seq, max_size=n_seq))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return cu


def seq_id_brute(cu, num_tokens):
    n_seq = len(cu) - 1
    out = []
    for t in range(num_tokens):
        sid = n_seq - 1  # tokens past the last request are clipped to it
        for r in range(n_seq):
            if cu[r] <= t < cu[r + 1]:
                sid = r
                break
        out.append(sid)
    return np.array(out, np.int32)


_seq_id_jit = jax.jit(seq_id_from_cu_q_lens, static_argnums=1)


@settings(max_examples=tier_examples(60), deadline=None)
@given(cu_lens(), st.integers(0, 8))
def test_seq_id_from_cu_q_lens(cu, extra):
    num_tokens = int(cu[-1]) + extra  # trailing padding tokens
    # pad cu to a fixed length (empty requests at the end) to reuse compiles
    cu_pad = np.concatenate([cu, np.full(7 - len(cu), cu[-1], np.int32)])
    for c in (cu, cu_pad):
        got = np.asarray(_seq_id_jit(jnp.asarray(c), 50))[:num_tokens]
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, seq_id_brute(c, 50)[:num_tokens])


def test_seq_id_examples():
    cu = jnp.array([0, 3, 3, 5, 5], jnp.int32)  # request 1 and 3 empty
    got = seq_id_from_cu_q_lens(cu, 7)
    np.testing.assert_array_equal(np.asarray(got), [0, 0, 0, 2, 2, 3, 3])
    assert got.shape == (7,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(seq_id_from_cu_q_lens(jnp.array([0, 4]), 4)), 0)


# --------------------------------------------------------------------------------------
# ragged_query_info / lift_ragged_indices


@st.composite
def ragged_tables(draw):
    page_size = draw(st.sampled_from([16, 32]))
    n_seq = draw(st.integers(1, 4))
    seq_lens = np.array(draw(st.lists(st.integers(0, 100), min_size=n_seq, max_size=n_seq)))
    pages = -(-seq_lens // page_size)
    extra = np.array(draw(st.lists(st.integers(0, 2), min_size=n_seq, max_size=n_seq)))
    cu_kv = np.concatenate([[0], np.cumsum((pages + extra) * page_size)]).astype(np.int32)
    num_tokens = 12
    q_seq_id = np.array(
        sorted(draw(st.lists(st.integers(0, n_seq - 1), min_size=num_tokens, max_size=num_tokens))),
        np.int32,
    )
    top_k = 3
    indices = np.array(
        draw(
            st.lists(st.integers(-3, 12), min_size=num_tokens * top_k, max_size=num_tokens * top_k)
        ),
        np.int32,
    ).reshape(num_tokens, top_k)
    total_pages = draw(st.integers(1, int(cu_kv[-1] // page_size) + 3))
    return page_size, seq_lens.astype(np.int32), cu_kv, q_seq_id, indices, total_pages


@settings(max_examples=tier_examples(60), deadline=None)
@given(ragged_tables())
def test_ragged_query_info_and_lift(p):
    page_size, seq_lens, cu_kv, q_seq_id, indices, total_pages = p
    info = ragged_query_info(
        jnp.asarray(q_seq_id), jnp.asarray(seq_lens), jnp.asarray(cu_kv), page_size=page_size
    )
    base = np.array([cu_kv[r] // page_size for r in q_seq_id])
    extent = np.array([cu_kv[r + 1] // page_size - cu_kv[r] // page_size for r in q_seq_id])
    np.testing.assert_array_equal(np.asarray(info.base_page), base)
    np.testing.assert_array_equal(np.asarray(info.pages), extent)
    np.testing.assert_array_equal(np.asarray(info.kv_len), seq_lens[q_seq_id])
    for f in info:
        assert f.dtype == jnp.int32 and f.shape == q_seq_id.shape

    lifted = np.asarray(lift_ragged_indices(jnp.asarray(indices), info, total_pages))
    assert lifted.dtype == np.int32 and lifted.shape == indices.shape
    for t in range(indices.shape[0]):
        for k in range(indices.shape[1]):
            i = int(indices[t, k])
            key = i + int(base[t])
            ok = 0 <= i < extent[t] and key < total_pages
            assert lifted[t, k] == (key if ok else -1), (t, k, i, base[t], extent[t], total_pages)


def test_lift_ragged_indices_examples():
    # two requests: pages [0, 2) and [2, 5) of the table; page_size 16
    cu_kv = jnp.array([0, 32, 80], jnp.int32)
    seq_lens = jnp.array([20, 40], jnp.int32)
    q_seq_id = jnp.array([0, 1, 1], jnp.int32)
    info = ragged_query_info(q_seq_id, seq_lens, cu_kv, page_size=16)
    np.testing.assert_array_equal(np.asarray(info.base_page), [0, 2, 2])
    np.testing.assert_array_equal(np.asarray(info.pages), [2, 3, 3])
    np.testing.assert_array_equal(np.asarray(info.kv_len), [20, 40, 40])
    idx = jnp.array([[0, 1, 2, -1], [0, 2, 3, -5], [1, 1, 2, 0]], jnp.int32)
    got = lift_ragged_indices(idx, info, total_pages=5)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, -1, -1], [2, 4, -1, -1], [3, 3, 4, 2]])
    # a page table shorter than the requests' extent drops keys beyond it
    got = lift_ragged_indices(idx, info, total_pages=4)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, -1, -1], [2, -1, -1, -1], [3, 3, -1, 2]])


def test_ragged_query_info_clips_bad_seq_ids():
    cu_kv = jnp.array([0, 16, 48], jnp.int32)
    seq_lens = jnp.array([10, 30], jnp.int32)
    info = ragged_query_info(jnp.array([-1, 5], jnp.int32), seq_lens, cu_kv, page_size=16)
    np.testing.assert_array_equal(np.asarray(info.base_page), [0, 1])
    np.testing.assert_array_equal(np.asarray(info.pages), [1, 2])
    np.testing.assert_array_equal(np.asarray(info.kv_len), [10, 30])


@pytest.mark.parametrize(
    ("s", "k", "t"), [(0, 2, 300), (10, 0, 300), (10, 2, 0)], ids=["S0", "K0", "T0"]
)
def test_empty_work_is_valid_and_empty(s, k, t):
    """S, K or T = 0 is empty work (zeros, -inf LSE), not an error."""
    from attn_common.sparse_mla import empty_result

    problem = check_sparse_mla_inputs(
        sds((2, s, 4, 576)),
        sds((2, t, 576)),
        sds((2, s, k), jnp.int32),
        sds((2, s), jnp.int32),
        sm_scale=0.1,
    )
    assert problem.is_empty
    out, lse = empty_result(problem, True)
    assert out.shape == (2, s, 4, 512) and lse.shape == (2, s, 4)
    assert not out.any() and bool(jnp.all(jnp.isneginf(lse)))
