"""Ragged metadata rules: host values are refused before launch, with the argument, the
entry, its value and the rule; under jit ``debug_checks=True`` reports the same through
checkify; without it the defined behaviour applies. Every backend shares the rules
(``attn_common.metadata``), so each public function is checked here: the TPU kernels
raise before anything is traced, so they cost nothing without a TPU."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import build_ragged_layout, randn, rng_for
from jax.experimental import checkify

import attn_reference as ref

tpu = pytest.importorskip(
    "attn_pallas_tpu",
    reason="attn-pallas-tpu is not installed (pip install ./packages/attn-pallas-tpu)",
)

PAGE = 16
LAYOUT = build_ragged_layout(
    rng_for(5), seq_lens=[20, 33], new_lens=[3, 4], extra_pages=[0, 1], page_size=PAGE
)
# Request 0: slots [0, 2), both hold tokens. Request 1: slots [2, 6); seq_len 33 -> slots
# 2..4 hold tokens, slot 5 is spare. cu_kv_lens = [0, 32, 96]; 6 table slots, 8 pages.
NQ = 7
RNG = rng_for(6)
Q = randn(RNG, (1, NQ, 2, 48))
CACHE = randn(RNG, (LAYOUT["num_pages"], PAGE // 2, 2, 128), "bfloat16")
IDX = RNG.integers(-1, 3, (1, NQ, 3)).astype(np.int32)
POS = LAYOUT["positions"][None]
TABLES = {k: LAYOUT[k] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")}
ATTEND = {
    "reference": ref.sparse_mla_attention,
    "reference_qblock": ref.sparse_mla_attention_qblock,
    "tpu": tpu.sparse_mla_attention,
    "tpu_qblock": tpu.sparse_mla_attention_qblock,
}


def _attend(fn, **tables):
    return fn(
        Q, CACHE, IDX, POS, sm_scale=0.2, kv_lora_rank=32, read_block=PAGE, page_size=PAGE,
        **{**TABLES, **tables},
    )  # fmt: skip


def _with(name, index, value):
    arr = np.array(TABLES[name] if name in TABLES else LAYOUT[name], copy=True)
    arr[index] = value
    return arr


BAD = {
    "cu_kv_lens_unaligned": (
        {"cu_kv_lens": _with("cu_kv_lens", 1, 40)},
        "cu_kv_lens: entry 1 is 40, expected a multiple of page_size = 16",
    ),
    "cu_kv_lens_negative": ({"cu_kv_lens": _with("cu_kv_lens", 0, -16)}, "cu_kv_lens: entry 0"),
    "cu_kv_lens_decreasing": (
        {"cu_kv_lens": np.array([0, 96, 32], np.int32)},
        "cu_kv_lens: entry 2 is 32, expected non-decreasing",
    ),
    "page_table_too_short": (
        {"page_indices": LAYOUT["page_indices"][:5]},
        r"cu_kv_lens: entry 2 is 96, expected <= len\(page_indices\) \* page_size = 80",
    ),
    "seq_lens_beyond_pages": (
        {"seq_lens": _with("seq_lens", 1, 65)},
        "seq_lens: entry 1 is 65, expected 0 <= seq_lens",
    ),
    "seq_lens_negative": ({"seq_lens": _with("seq_lens", 0, -1)}, "seq_lens: entry 0 is -1"),
    "q_seq_id_too_large": (
        {"q_seq_id": _with("q_seq_id", 3, 2)},
        r"q_seq_id: entry 3 is 2, expected a request id in \[0, num_seqs = 2\)",
    ),
    "q_seq_id_negative": ({"q_seq_id": _with("q_seq_id", 0, -1)}, "q_seq_id: entry 0 is -1"),
    "page_outside_cache": (
        {"page_indices": _with("page_indices", 4, LAYOUT["num_pages"])},
        "page_indices: entry 4 is 8, expected a physical page in",
    ),
    "page_negative": ({"page_indices": _with("page_indices", 1, -1)}, "page_indices: entry 1"),
    "page_repeated_in_request": (
        {"page_indices": _with("page_indices", 4, LAYOUT["page_indices"][2])},
        f"page_indices: entry 4 is {int(LAYOUT['page_indices'][2])}, expected a page not "
        "already named",
    ),
}


@pytest.mark.parametrize("fn", list(ATTEND))
@pytest.mark.parametrize("case", list(BAD))
def test_host_tables_refused(fn, case):
    tables, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        _attend(ATTEND[fn], **tables)


def test_spare_slots_may_hold_anything():
    """Slot 5 (past request 1's last token) and table slots past every request: any value."""
    out = _attend(ref.sparse_mla_attention, page_indices=_with("page_indices", 5, -1))
    assert np.all(np.isfinite(np.asarray(out)))
    seq_lens = np.array([20, 32], np.int32)  # request 1 now ends on a page boundary
    for bad in (-7, 10**6):
        out = _attend(
            ref.sparse_mla_attention, seq_lens=seq_lens, page_indices=_with("page_indices", 4, bad)
        )
        assert np.all(np.isfinite(np.asarray(out)))


def test_requests_may_share_pages():
    """A page in two requests' tables (a shared prefix) is allowed; within one request a
    repeated page is refused only in slots that hold tokens (slot 5 is spare)."""
    shared = _with("page_indices", 2, LAYOUT["page_indices"][0])
    out = _attend(ref.sparse_mla_attention, page_indices=shared)
    assert np.all(np.isfinite(np.asarray(out)))
    spare_repeat = _with("page_indices", 5, LAYOUT["page_indices"][2])
    out = _attend(ref.sparse_mla_attention, page_indices=spare_repeat)
    assert np.all(np.isfinite(np.asarray(out)))


def _attend_checked(tables):
    return _attend(ref.sparse_mla_attention, debug_checks=True, **tables)


# One jitted function for every case: the cases whose tables have the same shapes share
# its compile (~1.5 s on 2 cores each otherwise).
_CHECKED = jax.jit(checkify.checkify(_attend_checked))


@pytest.mark.parametrize("case", list(BAD))
def test_debug_checks_under_jit(case):
    """Traced tables: checkify reports the same rule; the valid tables report nothing."""
    tables, match = BAD[case]
    err, _ = _CHECKED(dict(TABLES))
    assert err.get() is None
    err, _ = _CHECKED({**TABLES, **tables})
    msg = err.get()
    assert msg is not None and match.split(",")[0].replace("\\", "") in msg, msg


def test_debug_checks_tpu_kernel_under_jit():
    """The TPU kernels take debug_checks too (interpret mode on the CPU)."""
    tables, _ = BAD["q_seq_id_too_large"]
    fn = functools.partial(tpu.sparse_mla_attention, interpret=True)
    checked = jax.jit(checkify.checkify(lambda t: _attend(fn, debug_checks=True, **t)))
    err, _ = checked({**TABLES, **tables})
    assert err.get() is not None and "q_seq_id" in err.get()


# --------------------------------------------------------------------------------------
# The write-then-attend wrappers: cu_q_lens


def _prefill_args(cu_q_lens):
    rng = rng_for(7)
    return (
        randn(rng, (NQ, 2, 32)),
        randn(rng, (NQ, 2, 16)),
        randn(rng, (NQ, 32)),
        randn(rng, (NQ, 16)),
        CACHE,
        IDX[0],
        LAYOUT["positions"],
        np.full((NQ,), -1, np.int32),
        LAYOUT["seq_lens"],
        cu_q_lens,
        LAYOUT["cu_kv_lens"],
        LAYOUT["page_indices"],
    )


WRAPPERS = {
    "reference": ref.prefill_write_and_attend_ragged,
    "reference_qblock": ref.prefill_write_and_attend_ragged_qblock,
    "tpu": tpu.prefill_write_and_attend_ragged,
    "tpu_qblock": tpu.prefill_write_and_attend_ragged_qblock,
}


@pytest.mark.parametrize("fn", list(WRAPPERS))
@pytest.mark.parametrize(
    ("cu_q_lens", "match"),
    [
        ([0, 3, 8], "cu_q_lens: entry 2 is 8, expected the last entry == the number of query"),
        ([0, 3, 6], "cu_q_lens: entry 2 is 6"),
        ([1, 3, 7], "cu_q_lens: entry 0 is 1, expected cu_q_lens"),
        ([0, 5, 4], "cu_q_lens: entry 2 is 4, expected non-decreasing"),
    ],
)
def test_wrappers_refuse_bad_cu_q_lens(fn, cu_q_lens, match):
    args = _prefill_args(np.asarray(cu_q_lens, np.int32))
    with pytest.raises(ValueError, match=match):
        WRAPPERS[fn](*args, kv_lora_rank=32, page_size=PAGE, sm_scale=0.2)
