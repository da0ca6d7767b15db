"""Names that left ``attn_common``'s top level in 0.2.0 and keep working until 0.3.0.

Two kinds, each reached through a module-level ``__getattr__`` that warns
(``DeprecationWarning``) and names the new home:

* ``DEMOTED``: helpers only kernels use (block ranges, unit and write tables, the cap's
  derivative...). They stay in their ``attn_common`` module; import them from there.
* ``MOVED``: code only one backend uses (the benchmark harnesses, the TPU planner, the
  user simulator) now lives in that backend. It is found through the backend's
  ``attn.backends`` entry point (``attn_common.dispatch.load_backend``), never by
  importing a backend module by name.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# name -> the attn_common module that holds it
DEMOTED: dict[str, str] = {
    **dict.fromkeys(
        (
            "BlockRanges",
            "ranker_full_kv_steps",
            "ranker_full_q_steps",
            "ranker_kv_block_ranges",
            "ranker_q_block_ranges",
        ),
        "bounds",
    ),
    **dict.fromkeys(
        ("cap_derivative", "cap_derivative_from_output", "cap_scaled_with_derivative"), "cap"
    ),
    **dict.fromkeys(
        (
            "PackedBlockRanges",
            "packed_full_kv_steps",
            "packed_full_q_steps",
            "packed_kv_block_ranges",
            "packed_q_block_ranges",
            "packed_runs_per_tile",
            "validate_packed_bounds",
        ),
        "packed",
    ),
    **dict.fromkeys(("scatter_write_back", "write_back_by_scatter", "write_then_attend"), "paged"),
    **dict.fromkeys(("lift_ragged_indices", "ragged_query_info"), "sparse_mla"),
    **dict.fromkeys(
        ("UnitRows", "flat_units", "ragged_units", "row_table_width", "selected_rows", "sparse_mla_units"),
        "sparse_mla_rows",
    ),
    "RankerCase": "suite",
    **dict.fromkeys(
        (
            "TOKEN_RUN",
            "WORD_RUN",
            "BlockUnitTables",
            "WriteRuns",
            "build_block_unit_tables",
            "build_write_runs",
            "default_write_run_cap",
            "keep_last_writes",
            "lossless_u_max",
            "resolve_u_max",
            "sanitize_unit_ids",
        ),
        "tables",
    ),
}  # fmt: skip

# (old attn_common module, "" for the package) -> {name: (backend, module in the backend)}
MOVED: dict[str, dict[str, tuple[str, str]]] = {
    "": {
        "SparseMlaPlan": ("pallas-tpu", "plan"),
        "block_union_sizes": ("pallas-tpu", "plan"),
        "choose_plan": ("pallas-tpu", "plan"),
        "sparse_mla_union_sizes": ("pallas-tpu", "plan"),
        "simulate_ranker_users": ("mosaic-gpu", "bench"),
    },
    "packing": {"simulate_ranker_users": ("mosaic-gpu", "bench")},
}
# old attn_common modules that moved whole: module -> (backend, module in the backend)
MOVED_MODULES: dict[str, tuple[str, str]] = {
    "bench": ("mosaic-gpu", "bench"),
    "bench_sparse_mla": ("mosaic-gpu", "bench_sparse_mla"),
    "sparse_mla_plan": ("pallas-tpu", "plan"),
}
REMOVED_IN = "0.3.0"


def backend_module(backend: str, module: str) -> Any:
    """``module`` of the installed ``backend`` package, found by its entry point."""
    from attn_common.dispatch import load_backend

    package = load_backend(backend).__name__.split(".")[0]
    return importlib.import_module(f"{package}.{module}")


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is deprecated (removed in attn-common {REMOVED_IN}); use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


def resolve(module: str, name: str) -> Any:
    """The value of the deprecated ``attn_common[.module].name``; AttributeError if none."""
    old = f"attn_common.{module + '.' if module else ''}{name}"
    if module == "" and name in DEMOTED:
        _warn(old, f"attn_common.{DEMOTED[name]}.{name}")
        return getattr(importlib.import_module(f"attn_common.{DEMOTED[name]}"), name)
    if name in MOVED.get(module, {}):
        backend, where = MOVED[module][name]
        target = backend_module(backend, where)
        _warn(old, f"{target.__name__}.{name} (the {backend} backend)")
        return getattr(target, name)
    raise AttributeError(
        f"module 'attn_common{'.' + module if module else ''}' has no attribute {name!r}"
    )


def resolve_module(module: str, name: str) -> Any:
    """``name`` of the moved module ``attn_common.<module>`` (a deprecated shim)."""
    if name.startswith("__"):
        raise AttributeError(name)
    backend, where = MOVED_MODULES[module]
    target = backend_module(backend, where)
    _warn(f"attn_common.{module}.{name}", f"{target.__name__}.{name} (the {backend} backend)")
    return getattr(target, name)
