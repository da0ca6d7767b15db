"""attn-reference: pure-JAX reference implementations; runs on any JAX backend.

The executable definition of the semantics of every op (docs/design.md): every
kernel backend is tested against these functions, and they are the CPU default.
"""

from importlib import metadata as _metadata

from attn_reference.paged import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
)
from attn_reference.ranker import ranker_attention
from attn_reference.sparse_mla import sparse_mla_attention, sparse_mla_attention_qblock

try:
    __version__ = _metadata.version("attn-reference")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
    "ranker_attention",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
]
