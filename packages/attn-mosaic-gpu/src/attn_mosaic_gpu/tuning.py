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

In each table an exact key wins; else the same device, head dim and cap at the nearest
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
import functools
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from attn_common import CapMethod, CapParams, KernelConfig
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
_TABLE_FORMAT = 1
_MIN_BUCKET = 256


@dataclasses.dataclass(frozen=True)
class RankerTuning:
    """What ``lookup`` found: the forward config, backward knobs, and where they came from."""

    forward: KernelConfig
    backward: BackwardTuning
    source: str


def seq_bucket(seq_len: int) -> int:
    """The table's sequence bucket of ``seq_len``: the power of two >= it, at least 256."""
    bucket = _MIN_BUCKET
    while bucket < seq_len:
        bucket *= 2
    return bucket


def user_table_path() -> Path:
    """Where ``attn tune`` writes and ``lookup`` first reads (see the module docstring)."""
    explicit = os.environ.get("ATTN_TUNED_CONFIGS")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "attn" / "hopper_ranker_tuned.json"


def _cap_method(cap: CapParams | None) -> str:
    return (cap.method if cap is not None else CapMethod.NONE).value


def _entry_key(entry: dict) -> tuple:
    return (
        entry["device_kind"],
        entry["dtype"],
        int(entry["head_dim"]),
        entry["cap"],
        int(entry["seq_bucket"]),
    )


def _parse_entry(entry: dict) -> tuple[tuple, RankerTuning]:
    key = _entry_key(entry)
    forward = KernelConfig(**entry["forward"])
    backward = BackwardTuning(**entry.get("backward", {}))
    return key, RankerTuning(forward, backward, "")


@functools.lru_cache(maxsize=8)
def _read_table(path: str, mtime_ns: int) -> tuple[tuple[tuple, RankerTuning], ...]:
    del mtime_ns  # part of the cache key: an edited file is read again
    data = json.loads(Path(path).read_text())
    if data.get("format") != _TABLE_FORMAT:
        raise ValueError(f"format: got {data.get('format')!r}, expected {_TABLE_FORMAT}")
    return tuple(_parse_entry(e) for e in data["entries"])


def _load(path: Path) -> tuple[tuple[tuple, RankerTuning], ...]:
    try:
        stat = path.stat()
    except OSError:
        return ()
    try:
        return _read_table(str(path), stat.st_mtime_ns)
    except (ValueError, KeyError, TypeError) as e:  # a broken file must not stop training
        warnings.warn(
            f"ignoring the tuned-config table {path}: {type(e).__name__}: {e} "
            "(re-run `attn tune` or delete the file)",
            stacklevel=3,
        )
        return ()


def _match(entries, key: tuple) -> RankerTuning | None:
    device, _, head_dim, cap, bucket = key
    exact = [t for k, t in entries if k == key]
    if exact:
        return exact[0]
    near = [
        (abs(k[4].bit_length() - bucket.bit_length()), k[4], t)
        for k, t in entries
        if (k[0], k[2], k[3]) == (device, head_dim, cap)
    ]
    return min(near, key=lambda x: (x[0], x[1]))[2] if near else None


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
    key = (device_kind, jnp.dtype(dtype).name, int(head_dim), _cap_method(cap), seq_bucket(seq_len))
    for path, label in ((user_table_path(), "user table"), (PACKAGE_TABLE, "package table")):
        found = _match(_load(path), key)
        if found is not None:
            return dataclasses.replace(found, source=f"{label} {path}")
    if default_forward is None:
        from attn_mosaic_gpu.ranker_fwd import default_config

        default_forward = default_config
    return RankerTuning(default_forward(head_dim), BackwardTuning(), "defaults")


def merge_tables(old: dict | None, new: dict) -> dict:
    """``new``'s entries (and trials) replace ``old``'s with the same key (case); the
    rest of ``old`` stays."""
    keep, keep_trials = [], []
    if old and old.get("format") == _TABLE_FORMAT:
        new_keys = {_entry_key(e) for e in new["entries"]}
        keep = [e for e in old.get("entries", []) if _entry_key(e) not in new_keys]
        new_cases = {t["case"] for t in new.get("trials", [])}
        keep_trials = [t for t in old.get("trials", []) if t.get("case") not in new_cases]
    merged = dict(new)
    merged["entries"] = keep + list(new["entries"])
    merged["trials"] = keep_trials + list(new.get("trials", []))
    return merged
