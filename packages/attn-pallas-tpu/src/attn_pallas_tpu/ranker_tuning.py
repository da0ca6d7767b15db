"""Tuned tilings of the TPU ranker kernels: a measured table, read by default.

``ranker_attention(..., config=None)`` asks :func:`config_for` for the ``(block_q,
block_kv)`` of the problem, keyed by ``(TPU kind, dtype, head dim, cap method, sequence
bucket)`` (``attn_common.tuned_table``: its format and matching, shared with the Hopper
backend's table). Two tables are read, the first hit wins:

1. the user's table, written by ``attn tune`` on a TPU (``attn_pallas_tpu.tune_ranker``):
   the file named by ``$ATTN_TPU_TUNED_CONFIGS``, else
   ``$XDG_CONFIG_HOME/attn/tpu_ranker_tuned.json`` (``~/.config/...`` without it);
2. the table shipped in the package (``ranker_tuned.json``), written by the same tool on a
   TPU, with the commits and commands that measured it (a v5e's entries ship).

A tiling from a table is used only if it is valid, its VMEM model fits at the call's
dtype (``ranker_config.vmem_bytes``) and it pads ``S`` at most ``PAD_SLACK`` times what
the default tiling does; otherwise, and for a problem no table covers,
``ranker_config.default_config``. An explicit ``config=`` always wins. The three kernels
(forward, dq, dk/dv) share the one tiling.
"""

from __future__ import annotations

from pathlib import Path

import jax

from attn_common import CapParams, KernelConfig, tuned_table
from attn_pallas_tpu.ranker_config import (
    VMEM_LIMIT_BYTES,
    default_config,
    padded_len,
    validate_config,
    vmem_bytes,
)

__all__ = ["PACKAGE_TABLE", "PAD_SLACK", "config_for", "fits", "lookup", "user_table_path"]

PACKAGE_TABLE = Path(__file__).with_name("ranker_tuned.json")
# A tabled tiling may pad S at most this much more than the default tiling does. The
# nearest-bucket rule can hand a short problem the blocks of a longer one (640 x 640 for
# S = 128 pads it 5x); the v5e table's own gain came at 1.11x the default's padding
# (phoenix, S = 1152: 1280 rows against 1152, 3.6 % faster).
PAD_SLACK = 1.125


def user_table_path() -> Path:
    """Where ``attn tune`` (on a TPU) writes and :func:`lookup` first reads."""
    return tuned_table.user_path("ATTN_TPU_TUNED_CONFIGS", "tpu_ranker_tuned.json")


def _config_of(entry: dict) -> KernelConfig:
    return KernelConfig(block_q=int(entry["block_q"]), block_kv=int(entry["block_kv"]))


def lookup(
    *, head_dim: int, dtype, cap: CapParams | None, seq_len: int, device_kind: str | None = None
) -> tuple[KernelConfig | None, str]:
    """The tabled tiling of a problem and where it came from (``None, "defaults"`` when
    no table has one). ``device_kind``: ``jax.devices()[0].device_kind`` by default."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    tables = ((user_table_path(), "user table"), (PACKAGE_TABLE, "package table"))
    return tuned_table.lookup(
        tables, _config_of, device_kind=device_kind, dtype=dtype, head_dim=head_dim, cap=cap,
        seq_len=seq_len,
    )  # fmt: skip


def fits(config: KernelConfig, head_dim: int, dtype) -> bool:
    """A valid TPU tiling whose VMEM model fits at ``head_dim`` and ``dtype``."""
    try:
        validate_config(config)
    except (TypeError, ValueError):
        return False
    need = vmem_bytes(config.block_q, config.block_kv, head_dim, dtype)
    return max(need.values()) <= VMEM_LIMIT_BYTES


def config_for(
    *, seq_len: int, head_dim: int, dtype, cap: CapParams | None, device_kind: str | None = None
) -> KernelConfig:
    """The tiling ``config=None`` runs: the tabled one if it fits and pads ``S`` at most
    ``PAD_SLACK`` times the default's padding, else the default."""
    found, _ = lookup(
        head_dim=head_dim, dtype=dtype, cap=cap, seq_len=seq_len, device_kind=device_kind
    )
    default = default_config(seq_len, head_dim)
    if found is None or not fits(found, head_dim, dtype):
        return default
    pad = padded_len(seq_len, found.block_q, found.block_kv)
    if pad > PAD_SLACK * padded_len(seq_len, default.block_q, default.block_kv):
        return default
    return found
