"""attn-common: the specs every attention backend shares.

One definition each of the config, the segment bounds and mask predicate, the soft cap
and its derivative, the block ranges kernels visit, the sparse-MLA and paged-write
tables, the FP8 latent cache format, and the input contracts. The reference and every kernel import these.

It is also the front door for users: ``ranker_attention``, ``sparse_mla_attention``,
``sparse_mla_attention_qblock``, ``paged_write_back`` and
``prefill_write_and_attend_ragged(_qblock)`` here take ``implementation=None |
"mosaic-gpu" | "pallas-tpu" | "reference"`` and run on the best installed backend
(``attn_common.dispatch``); ``attn_common.sharding`` wraps them in ``jax.shard_map``;
``attn_common.cli`` is the ``attn`` command.
"""

from importlib import metadata as _metadata

from attn_common.bounds import (
    SEGMENT_CANDIDATE,
    SEGMENT_HISTORY,
    SEGMENT_PADDING,
    SegmentBounds,
    check_bounds,
    normalize_bounds,
    ranker_mask,
)
from attn_common.cap import CapMethod, CapParams, cap_forward
from attn_common.config import KernelConfig
from attn_common.dispatch import (
    BackendFallbackWarning,
    BackendUnavailableError,
    UnsupportedInputError,
    device_class,
    installed_backends,
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
    ranker_attention,
    select_backend,
    sparse_mla_attention,
    sparse_mla_attention_qblock,
)
from attn_common.fp8_cache import (
    Fp8LatentCache,
    dequantize_latent_cache,
    quantize_latent_cache,
)
from attn_common.metadata import check_ragged_metadata, check_unit_indices
from attn_common.packed import (
    check_packed_bounds,
    normalize_packed_bounds,
    ranker_mask_packed,
)
from attn_common.packing import PackedUsers, pack_users
from attn_common.paged import (
    check_paged_cache,
    check_prefill_inputs,
    check_write_back_inputs,
    latent_rows,
)
from attn_common.ranker import RankerProblem, check_ranker_inputs, ranker_flops
from attn_common.sharding import (
    shard_ranker_attention,
    shard_sparse_mla_attention,
    shard_sparse_mla_attention_ragged,
)
from attn_common.sparse_mla import (
    SparseMlaProblem,
    check_sparse_mla_inputs,
    padded_dk,
    seq_id_from_cu_q_lens,
)
from attn_common.suite import RANKER_SUITE, ranker_case
from attn_common.tables import kv_packing

try:
    __version__ = _metadata.version("attn-common")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "RANKER_SUITE",
    "SEGMENT_CANDIDATE",
    "SEGMENT_HISTORY",
    "SEGMENT_PADDING",
    "BackendFallbackWarning",
    "BackendUnavailableError",
    "CapMethod",
    "CapParams",
    "Fp8LatentCache",
    "KernelConfig",
    "PackedUsers",
    "RankerProblem",
    "SegmentBounds",
    "SparseMlaProblem",
    "UnsupportedInputError",
    "cap_forward",
    "check_bounds",
    "check_packed_bounds",
    "check_paged_cache",
    "check_prefill_inputs",
    "check_ragged_metadata",
    "check_ranker_inputs",
    "check_sparse_mla_inputs",
    "check_unit_indices",
    "check_write_back_inputs",
    "dequantize_latent_cache",
    "device_class",
    "installed_backends",
    "kv_packing",
    "latent_rows",
    "normalize_bounds",
    "normalize_packed_bounds",
    "pack_users",
    "padded_dk",
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
    "quantize_latent_cache",
    "ranker_attention",
    "ranker_case",
    "ranker_flops",
    "ranker_mask",
    "ranker_mask_packed",
    "select_backend",
    "seq_id_from_cu_q_lens",
    "shard_ranker_attention",
    "shard_sparse_mla_attention",
    "shard_sparse_mla_attention_ragged",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
]


def __getattr__(name: str):
    """Names that left the top level in 0.2.0 (``attn_common._moved``): a
    DeprecationWarning, then the value from its new home."""
    from attn_common import _moved

    return _moved.resolve("", name)
