"""Tuned kernel configs for the Hopper ranker kernels: a measured table, read by default.

``ranker_attention(..., config=None)`` asks ``lookup`` for the forward's ``KernelConfig``
and the backward's schedule knobs (``BackwardTuning``) of the problem, keyed by
``(device kind, dtype, head dim, cap method, sequence bucket)`` (the bucket is the power
of two >= S, at least 256). Two tables are read, the first hit wins:

1. the user's table, written by ``attn tune`` on the user's GPU: the file named by
   ``$ATTN_TUNED_CONFIGS``, else ``$XDG_CONFIG_HOME/attn/hopper_ranker_tuned.json``
   (``~/.config/...`` without XDG_CONFIG_HOME);
2. the table shipped in the package (``tuned_configs.json``), measured on an H200 by the
   same sweep (each entry records the commit and command that produced it).

The format and the matching are ``attn_common.tuned_table``'s (the TPU backend's table
shares them). In each table an exact key wins; else the same device, head dim and cap at the nearest
sequence bucket (either 2-byte dtype). A problem neither table covers (another GPU, a
new head dim) gets ``ranker_fwd.default_config`` and the backward's defaults: never an
error. An explicit ``config=`` always wins over the tables for the forward.

``attn_mosaic_gpu.tuner.tune`` is the sweep that writes the tables (coordinate descent over the knobs, CUPTI device time, median of
iterations): the forward's tiling, then how many key columns of each score tile compute
``exp2`` and soft_sign's reciprocal on the FMA pipe instead of the MUFU
(``attn_mosaic_gpu.fastmath``), then the compute warpgroups' register count; then the
same two knobs, the persistent dq (0 or one program per SM) and the ring depth of the
backward kernels, timed on the backward alone. A knob value is kept only when it beats
the incumbent by more than ``min_gain`` (1%), so noise cannot pick a variant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax

from attn_common import CapParams, KernelConfig, tuned_table
from attn_mosaic_gpu.ranker_config import BackwardTuning

__all__ = [
    "PACKAGE_TABLE",
    "BackwardTuning",
    "RankerTuning",
    "lookup",
    "seq_bucket",
    "user_table_path",
]

PACKAGE_TABLE = Path(__file__).with_name("tuned_configs.json")


@dataclasses.dataclass(frozen=True)
class RankerTuning:
    """What ``lookup`` found: the forward config, backward knobs, and where they came from."""

    forward: KernelConfig
    backward: BackwardTuning
    source: str


def seq_bucket(seq_len: int) -> int:
    """The table's sequence bucket of ``seq_len``: the power of two >= it, at least 256."""
    return tuned_table.seq_bucket(seq_len)


def user_table_path() -> Path:
    """Where ``attn tune`` writes and ``lookup`` first reads (see the module docstring)."""
    return tuned_table.user_path("ATTN_TUNED_CONFIGS", "hopper_ranker_tuned.json")


def _tuning_of(entry: dict) -> RankerTuning:
    forward = KernelConfig(**entry["forward"])
    backward = BackwardTuning(**entry.get("backward", {}))
    return RankerTuning(forward, backward, "")


def _parse_entry(entry: dict) -> tuple[tuple, RankerTuning]:
    return tuned_table.entry_key(entry), _tuning_of(entry)


def lookup(
    *,
    head_dim: int,
    dtype,
    cap: CapParams | None,
    seq_len: int,
    device_kind: str | None = None,
    default_forward: Callable[[int], KernelConfig] | None = None,
) -> RankerTuning:
    """The tuned configs for a problem (user table, then package table, then defaults).

    ``device_kind`` defaults to ``jax.devices()[0].device_kind`` (e.g. ``"NVIDIA H200"``).
    """
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    tables = ((user_table_path(), "user table"), (PACKAGE_TABLE, "package table"))
    found, source = tuned_table.lookup(
        tables, _tuning_of, device_kind=device_kind, dtype=dtype, head_dim=head_dim, cap=cap,
        seq_len=seq_len,
    )  # fmt: skip
    if found is not None:
        return dataclasses.replace(found, source=source)
    if default_forward is None:
        from attn_mosaic_gpu.ranker_fwd import default_config

        default_forward = default_config
    return RankerTuning(default_forward(head_dim), BackwardTuning(), "defaults")


def merge_tables(old: dict | None, new: dict) -> dict:
    """``new``'s entries (and trials) replace ``old``'s with the same key (case); the
    rest of ``old`` stays."""
    return tuned_table.merge_tables(old, new)
