"""The reference package exposes the shared API (docs/design.md#public-api) and signatures."""

import inspect
from importlib import metadata

import pytest

import attn_reference

# docs/design.md#public-api: parameters every backend's public functions must accept.
SHARED_API = {
    "ranker_attention": ("q k v bounds sm_scale cap config return_lse",),
    "sparse_mla_attention": (
        "q kv indices positions sm_scale kv_lora_rank read_block return_lse page_size "
        "q_seq_id seq_lens cu_kv_lens page_indices interpret",
    ),
    "sparse_mla_attention_qblock": (
        "q kv indices positions sm_scale kv_lora_rank read_block return_lse page_size "
        "q_seq_id seq_lens cu_kv_lens page_indices interpret query_block u_max",
    ),
    "paged_write_back": ("cache rows loc page_size r_cap interpret",),
    "prefill_write_and_attend_ragged": (
        "ql qpe kvc kpe cache topk_pages positions loc seq_lens cu_q_lens cu_kv_lens "
        "page_indices kv_lora_rank page_size sm_scale interpret",
    ),
    "prefill_write_and_attend_ragged_qblock": (
        "ql qpe kvc kpe cache topk_pages positions loc seq_lens cu_q_lens cu_kv_lens "
        "page_indices kv_lora_rank page_size sm_scale interpret query_block",
    ),
}


def test_version_matches_metadata():
    assert attn_reference.__version__ == metadata.version("attn-reference")


@pytest.mark.parametrize("name", sorted(SHARED_API))
def test_shared_signature(name):
    fn = getattr(attn_reference, name)
    assert name in attn_reference.__all__
    params = inspect.signature(fn).parameters
    (names,) = SHARED_API[name]
    missing = [p for p in names.split() if p not in params]
    assert not missing, f"{name} lacks shared parameters {missing}"
