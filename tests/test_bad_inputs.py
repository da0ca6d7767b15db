"""A table of bad inputs, walked through every backend and the front door.

Validation lives in one spec per op (``attn_common.spec``) and runs before any kernel,
so every backend must refuse each input with the same exception type and a message
that names the argument, shows the value and never promises a fallback. No kernel runs
here (the inputs are refused first), so the Hopper and TPU backends are checked on the
CPU without interpret-mode kernel runs.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import attn_common
from attn_common import CapMethod, CapParams, SegmentBounds

BACKENDS = ["reference", "mosaic-gpu", "pallas-tpu"]
MODULES = {"reference": "attn_reference", "mosaic-gpu": "attn_mosaic_gpu",
           "pallas-tpu": "attn_pallas_tpu"}  # fmt: skip
PACKAGE_DIRS = {"reference": "attn-reference", "mosaic-gpu": "attn-mosaic-gpu",
                "pallas-tpu": "attn-pallas-tpu"}  # fmt: skip


def _backend(backend: str):
    """The backend's module; skips the test when that package is not installed."""
    return pytest.importorskip(
        MODULES[backend],
        reason=f"not installed: pip install ./packages/{PACKAGE_DIRS[backend]}",
    )


BF16, F32, I32 = jnp.bfloat16, np.float32, np.int32

# ranker: B=1, S=128, Hq=Hkv=2, D=64, bf16 (a shape every kernel takes)
Q = np.zeros((1, 128, 2, 64), BF16)
BOUNDS = np.asarray([[0, 96, 96, 112]], I32)
RANKER = {"q": Q, "k": Q, "v": Q, "bounds": BOUNDS}

# sparse MLA, flat: Dk = 512 + 64, one 128-token unit, bf16
SQ = np.zeros((1, 2, 1, 576), BF16)
SPARSE = {
    "q": SQ,
    "kv": np.zeros((1, 128, 576), BF16),
    "indices": np.zeros((1, 2, 1), I32),
    "positions": np.arange(2, dtype=I32)[None],
    "sm_scale": 0.1,
}

# paged: page_size 16, 2 pages of bf16 rows of width 640 (= padded_dk(512 + 64))
CACHE = np.zeros((2, 8, 2, 640), BF16)
WRITE = {"cache": CACHE, "rows": np.zeros((2, 640), F32), "loc": np.arange(2, dtype=I32),
         "page_size": 16}  # fmt: skip
PREFILL = {
    "ql": np.zeros((2, 1, 512), BF16),
    "qpe": np.zeros((2, 1, 64), BF16),
    "kvc": np.zeros((2, 512), BF16),
    "kpe": np.zeros((2, 64), BF16),
    "cache": CACHE,
    "topk_pages": np.zeros((2, 1), I32),
    "positions": np.arange(2, dtype=I32),
    "loc": np.arange(2, dtype=I32),
    "seq_lens": np.asarray([2], I32),
    "cu_q_lens": np.asarray([0, 2], I32),
    "cu_kv_lens": np.asarray([0, 16], I32),
    "page_indices": np.asarray([0], I32),
    "kv_lora_rank": 512,
    "page_size": 16,
    "sm_scale": 0.1,
}
POSITIONAL = {
    "ranker_attention": ("q", "k", "v", "bounds"),
    "sparse_mla_attention": ("q", "kv", "indices", "positions"),
    "paged_write_back": ("cache", "rows", "loc"),
    "prefill_write_and_attend_ragged": tuple(list(PREFILL)[:12]),
}
BASE = {
    "ranker_attention": RANKER,
    "sparse_mla_attention": SPARSE,
    "paged_write_back": WRITE,
    "prefill_write_and_attend_ragged": PREFILL,
}

# (op, changes, exception, argument named, text the message must hold)
BAD = {
    # issue 39: Hopper raised AttributeError from its tuning tables for these two
    "cap_str": ("ranker_attention", {"cap": "tanh"}, TypeError, "cap", "got str 'tanh'"),
    "cap_float": ("ranker_attention", {"cap": 30.0}, TypeError, "cap", "got float 30.0"),
    "q_list": ("ranker_attention", {"q": Q.tolist()}, TypeError, "q", "got list"),
    "q_int32": ("ranker_attention", {"q": Q.astype(I32)}, TypeError, "q", "dtype int32"),
    "ranker_mixed_dtypes": (
        "ranker_attention", {"k": Q.astype(F32), "v": Q.astype(F32)}, TypeError, "q, k, v",
        "expected one dtype",
    ),
    "q_rank": ("ranker_attention", {"q": Q[0]}, ValueError, "q", "rank 4"),
    "kv_heads": ("ranker_attention", {"k": np.zeros((1, 128, 3, 64), BF16),
                                      "v": np.zeros((1, 128, 3, 64), BF16)}, ValueError, "k",
                 "Hq % Hkv == 0"),
    "k_length": ("ranker_attention", {"k": Q[:, :64], "v": Q[:, :64]}, ValueError, "k", "S=128"),
    "bounds_no_users": (
        "ranker_attention", {"bounds": np.zeros((1, 0, 4), I32)}, ValueError, "bounds",
        "U >= 1",
    ),
    "bounds_float": ("ranker_attention", {"bounds": BOUNDS.astype(F32)}, TypeError, "bounds",
                     "float32"),
    "bounds_rows": ("ranker_attention", {"bounds": np.zeros((3, 4), I32)}, ValueError, "bounds",
                    "got 3 rows"),
    "sm_scale_negative": ("ranker_attention", {"sm_scale": -1.0}, ValueError, "sm_scale", "-1.0"),
    "config_type": ("ranker_attention", {"config": {"block_q": 64}}, TypeError, "config", "dict"),
    "return_lse_type": ("ranker_attention", {"return_lse": "yes"}, TypeError, "return_lse",
                        "'yes'"),
    "packed_overlap": (
        "ranker_attention", {"bounds": np.asarray([[[0, 60, 60, 64], [50, 90, 90, 96]]], I32)},
        ValueError, "bounds", "overlap",
    ),
    # issue 39: Hopper said "needs a multiple of 128" for both
    "kv_lora_rank_600": ("sparse_mla_attention", {"kv_lora_rank": 600}, ValueError,
                         "kv_lora_rank", "got 600, expected <= Dk = 576"),
    "kv_lora_rank_0": ("sparse_mla_attention", {"kv_lora_rank": 0}, ValueError, "kv_lora_rank",
                       "got 0"),
    "sm_scale_missing": ("sparse_mla_attention", {"sm_scale": None}, ValueError, "sm_scale",
                         "required"),
    "return_attn_mass_type": ("sparse_mla_attention", {"return_attn_mass": 1}, TypeError,
                              "return_attn_mass", "got 1"),
    "sparse_q_list": ("sparse_mla_attention", {"q": SQ.tolist()}, TypeError, "q", "got list"),
    "sparse_q_int": ("sparse_mla_attention", {"q": SQ.astype(I32)}, TypeError, "q",
                     "dtype int32"),
    "indices_float": ("sparse_mla_attention", {"indices": np.zeros((1, 2, 1), F32)}, TypeError,
                      "indices", "float32"),
    "positions_shape": ("sparse_mla_attention", {"positions": np.zeros((1, 3), I32)},
                        ValueError, "positions", "(1, 3)"),
    "ragged_without_q_seq_id": ("sparse_mla_attention", {"seq_lens": np.asarray([2], I32)},
                                ValueError, "seq_lens", "without q_seq_id"),
    "query_block_zero": ("sparse_mla_attention", {"query_block": 0}, ValueError, "query_block",
                         "got 0"),
    # issue 39: Hopper named "q: got head dim 320" for a 256-wide ql
    "prefill_ql_width": ("prefill_write_and_attend_ragged",
                         {"ql": np.zeros((2, 1, 256), BF16)}, ValueError, "ql",
                         "got last dim 256, expected kv_lora_rank = 512"),
    # issue 39: a loc past the cache silently dropped the new rows
    "prefill_loc_past_cache": ("prefill_write_and_attend_ragged",
                               {"loc": np.asarray([0, 32], I32)}, ValueError, "loc",
                               "entry 1 is 32"),
    "prefill_cu_q_lens": ("prefill_write_and_attend_ragged",
                          {"cu_q_lens": np.asarray([0, 3], I32)}, ValueError, "cu_q_lens",
                          "entry 1 is 3"),
    "prefill_page_size": ("prefill_write_and_attend_ragged", {"page_size": 8}, ValueError,
                          "cache", "page_size = 8"),
    # issue 39: int32 rows were cast into a bf16 cache without a word
    "write_int_rows": ("paged_write_back", {"rows": np.zeros((2, 640), I32)}, TypeError,
                       "rows", "int32 for a bfloat16 cache"),
    "write_loc_past_cache": ("paged_write_back", {"loc": np.asarray([5, 32], I32)}, ValueError,
                             "loc", "entry 1 is 32"),
    "write_rows_width": ("paged_write_back", {"rows": np.zeros((2, 512), F32)}, ValueError,
                         "rows", "(2, 512)"),
    "write_r_cap": ("paged_write_back", {"r_cap": 0}, ValueError, "r_cap", "got 0"),
}  # fmt: skip


def _call(fn, op, changes):
    kwargs = {**BASE[op], **changes}
    args = [kwargs.pop(name) for name in POSITIONAL[op]]
    return fn(*args, **kwargs)


def _check(excinfo, exc, name, text):
    msg = str(excinfo.value)
    assert excinfo.type is exc or issubclass(excinfo.type, exc), (excinfo.type, msg)
    assert msg.startswith(f"{name}:"), msg  # the argument is named first
    assert text in msg, msg
    assert "falls back" not in msg and "fall back" not in msg, msg


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD))
def test_every_backend_refuses_the_same_way(case, backend):
    op, changes, exc, name, text = BAD[case]
    module = _backend(backend)
    with pytest.raises(exc) as excinfo:
        _call(getattr(module, op), op, changes)
    _check(excinfo, exc, name, text)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD))
def test_front_door_refuses_before_choosing_a_backend(case, backend):
    op, changes, exc, name, text = BAD[case]
    fn = getattr(attn_common, op)
    with pytest.raises(exc) as excinfo:
        _call(lambda *a, **k: fn(*a, implementation=backend, interpret=True, **k), op, changes)
    _check(excinfo, exc, name, text)


def test_qblock_twins_share_the_spec():
    """The ``_qblock`` names validate through the same spec."""
    for backend in BACKENDS:
        module = _backend(backend)
        for op, twin in (
            ("sparse_mla_attention", "sparse_mla_attention_qblock"),
            ("prefill_write_and_attend_ragged", "prefill_write_and_attend_ragged_qblock"),
        ):
            changes = {"kv_lora_rank": 600} if op == "sparse_mla_attention" else {
                "ql": np.zeros((2, 1, 256), BF16)}  # fmt: skip
            with _no_warning(), pytest.raises(ValueError, match=r"^(kv_lora_rank|ql): got"):
                _call(getattr(module, twin), op, changes)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_kernel_limits_name_the_argument_and_promise_nothing():
    """A valid input a kernel cannot take: NotImplementedError, the argument, the value."""
    attn_mosaic_gpu = _backend("mosaic-gpu")
    attn_pallas_tpu = _backend("pallas-tpu")

    q = Q.astype(jnp.float16)
    with pytest.raises(TypeError, match=r"^q: got dtype float16, the TPU ranker") as e:
        attn_pallas_tpu.ranker_attention(q, q, q, BOUNDS)
    assert "attn_reference takes any" in str(e.value) and "falls back" not in str(e.value)
    q = Q[..., :32]
    with pytest.raises(NotImplementedError, match=r"^q: got head dim 32, the Hopper"):
        attn_mosaic_gpu.ranker_attention(q, q, q, BOUNDS)
    kv = SPARSE["kv"].astype(F32)
    with pytest.raises(TypeError, match=r"^kv: got dtype float32, the Hopper"):
        attn_mosaic_gpu.sparse_mla_attention(SQ, kv, *list(SPARSE.values())[2:4], sm_scale=0.1)
    with pytest.raises(NotImplementedError, match=r"^read_block: got 8, the TPU kernels"):
        attn_pallas_tpu.sparse_mla_attention(
            SQ, SPARSE["kv"], SPARSE["indices"], SPARSE["positions"], sm_scale=0.1, read_block=8
        )


def test_out_of_range_bounds_clip_and_debug_checks_refuse():
    """``from_lengths(200, 16)`` with S = 128: clipped to [0, S] by default (documented),
    refused under ``debug_checks``."""
    from jax.experimental import checkify

    import attn_reference

    q = np.ones((1, 128, 2, 64), F32)
    bounds = SegmentBounds.from_lengths(200, 16)
    clipped = SegmentBounds.from_array(np.asarray([[0, 128, 128, 128]], I32))
    np.testing.assert_array_equal(
        attn_reference.ranker_attention(q, q, q, bounds),
        attn_reference.ranker_attention(q, q, q, clipped),
    )
    checked = checkify.checkify(
        lambda q: attn_reference.ranker_attention(q, q, q, bounds, debug_checks=True)
    )
    err, _ = checked(q)
    with pytest.raises(checkify.JaxRuntimeError, match="bounds out of range"):
        err.throw()


def test_cap_params_still_accepted():
    import attn_reference

    q = np.ones((1, 16, 1, 8), F32)
    out = attn_reference.ranker_attention(
        q, q, q, [0, 8, 8, 16], cap=CapParams(method=CapMethod.TANH, value=30.0)
    )
    assert out.shape == q.shape


def test_dtype_policy_sparse_mla_casts_the_query_to_the_cache_dtype():
    """Sparse MLA's one policy (docs/semantics.md): q is cast to kv's dtype, everywhere."""
    import attn_reference

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 1, 576)).astype(F32)
    kv = rng.standard_normal((1, 128, 576)).astype(BF16)
    args = (SPARSE["indices"], SPARSE["positions"])
    mixed = attn_reference.sparse_mla_attention(q, kv, *args, sm_scale=0.1)
    cast = attn_reference.sparse_mla_attention(q.astype(BF16), kv, *args, sm_scale=0.1)
    np.testing.assert_array_equal(mixed, cast)
