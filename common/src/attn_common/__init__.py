"""attn-common: the specs every attention backend shares.

One definition each of the config, the segment bounds and mask predicate, the soft cap
and its derivative, the block ranges kernels visit, the sparse-MLA and paged-write
tables, and the input contracts. The reference and every kernel import these.

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
    BlockRanges,
    SegmentBounds,
    check_bounds,
    normalize_bounds,
    ranker_full_kv_steps,
    ranker_full_q_steps,
    ranker_kv_block_ranges,
    ranker_mask,
    ranker_q_block_ranges,
)
from attn_common.cap import (
    CapMethod,
    CapParams,
    cap_derivative,
    cap_derivative_from_output,
    cap_forward,
    cap_scaled_with_derivative,
)
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
from attn_common.metadata import check_ragged_metadata, check_unit_indices
from attn_common.packed import (
    PackedBlockRanges,
    check_packed_bounds,
    normalize_packed_bounds,
    packed_full_kv_steps,
    packed_full_q_steps,
    packed_kv_block_ranges,
    packed_q_block_ranges,
    packed_runs_per_tile,
    ranker_mask_packed,
    validate_packed_bounds,
)
from attn_common.packing import PackedUsers, pack_users, simulate_ranker_users
from attn_common.paged import (
    check_paged_cache,
    check_prefill_inputs,
    check_write_back_inputs,
    latent_rows,
    scatter_write_back,
    write_back_by_scatter,
    write_then_attend,
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
    lift_ragged_indices,
    padded_dk,
    ragged_query_info,
    seq_id_from_cu_q_lens,
)
from attn_common.sparse_mla_plan import (
    SparseMlaPlan,
    block_union_sizes,
    choose_plan,
    sparse_mla_union_sizes,
)
from attn_common.sparse_mla_rows import (
    UnitRows,
    flat_units,
    ragged_units,
    row_table_width,
    selected_rows,
    sparse_mla_units,
)
from attn_common.suite import RANKER_SUITE, RankerCase, ranker_case
from attn_common.tables import (
    TOKEN_RUN,
    WORD_RUN,
    BlockUnitTables,
    WriteRuns,
    build_block_unit_tables,
    build_write_runs,
    default_write_run_cap,
    keep_last_writes,
    kv_packing,
    lossless_u_max,
    resolve_u_max,
    sanitize_unit_ids,
)

try:
    __version__ = _metadata.version("attn-common")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "RANKER_SUITE",
    "SEGMENT_CANDIDATE",
    "SEGMENT_HISTORY",
    "SEGMENT_PADDING",
    "TOKEN_RUN",
    "WORD_RUN",
    "BackendFallbackWarning",
    "BackendUnavailableError",
    "BlockRanges",
    "BlockUnitTables",
    "CapMethod",
    "CapParams",
    "KernelConfig",
    "PackedBlockRanges",
    "PackedUsers",
    "RankerCase",
    "RankerProblem",
    "SegmentBounds",
    "SparseMlaPlan",
    "SparseMlaProblem",
    "UnitRows",
    "UnsupportedInputError",
    "WriteRuns",
    "block_union_sizes",
    "build_block_unit_tables",
    "build_write_runs",
    "cap_derivative",
    "cap_derivative_from_output",
    "cap_forward",
    "cap_scaled_with_derivative",
    "check_bounds",
    "check_packed_bounds",
    "check_paged_cache",
    "check_prefill_inputs",
    "check_ragged_metadata",
    "check_ranker_inputs",
    "check_sparse_mla_inputs",
    "check_unit_indices",
    "check_write_back_inputs",
    "choose_plan",
    "default_write_run_cap",
    "device_class",
    "flat_units",
    "installed_backends",
    "keep_last_writes",
    "kv_packing",
    "latent_rows",
    "lift_ragged_indices",
    "lossless_u_max",
    "normalize_bounds",
    "normalize_packed_bounds",
    "pack_users",
    "packed_full_kv_steps",
    "packed_full_q_steps",
    "packed_kv_block_ranges",
    "packed_q_block_ranges",
    "packed_runs_per_tile",
    "padded_dk",
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
    "ragged_query_info",
    "ragged_units",
    "ranker_attention",
    "ranker_case",
    "ranker_flops",
    "ranker_full_kv_steps",
    "ranker_full_q_steps",
    "ranker_kv_block_ranges",
    "ranker_mask",
    "ranker_mask_packed",
    "ranker_q_block_ranges",
    "resolve_u_max",
    "row_table_width",
    "sanitize_unit_ids",
    "scatter_write_back",
    "select_backend",
    "selected_rows",
    "seq_id_from_cu_q_lens",
    "shard_ranker_attention",
    "shard_sparse_mla_attention",
    "shard_sparse_mla_attention_ragged",
    "simulate_ranker_users",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
    "sparse_mla_union_sizes",
    "sparse_mla_units",
    "validate_packed_bounds",
    "write_back_by_scatter",
    "write_then_attend",
]
