"""The reference package exposes the shared API (docs/design.md#public-api) and signatures."""

import inspect

import pytest

import attn_reference
from attn_common import spec

# docs/design.md#public-api: the ops every backend exports, and each one's spec.
SHARED_API = {
    "ranker_attention": spec.ranker_call,
    "sparse_mla_attention": spec.sparse_mla_call,
    "sparse_mla_attention_qblock": spec.sparse_mla_call,
    "paged_write_back": spec.write_back_call,
    "prefill_write_and_attend_ragged": spec.prefill_call,
    "prefill_write_and_attend_ragged_qblock": spec.prefill_call,
}


@pytest.mark.parametrize("name", sorted(SHARED_API))
def test_shared_signature(name):
    """The op's signature is its ``attn_common.spec`` builder's: names, kinds, defaults."""
    fn = getattr(attn_reference, name)
    assert name in attn_reference.__all__
    want = list(inspect.signature(SHARED_API[name]).parameters.values())
    assert list(inspect.signature(fn).parameters.values()) == want
