"""Measured tuned-config tables: the file format and lookup rules every backend's
``attn tune`` shares (the Hopper ranker's ``attn_mosaic_gpu.tuning``, the TPU ranker's
``attn_pallas_tpu.ranker_tuning``).

A table is JSON ``{"format": 1, "provenance": {...}, "entries": [...], "trials":
[...]}``. Each entry is keyed by ``(device_kind, dtype, head_dim, cap, seq_bucket)``
(:func:`entry_key`; the bucket is the power of two >= S, at least 256); what else it
holds is the backend's (its ``parse`` turns an entry into the value ``lookup`` returns).
Lookup (:func:`match`): an exact key wins; else the same device, head dim and cap at the
nearest sequence bucket (either 2-byte dtype). A file that is missing gives no entries;
one that cannot be read warns and gives none (a broken file must not stop training).
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from attn_common.cap import CapMethod, CapParams

__all__ = [
    "TABLE_FORMAT",
    "cap_method",
    "entry_key",
    "load",
    "lookup",
    "match",
    "merge_tables",
    "seq_bucket",
    "user_path",
    "write_merged",
]

TABLE_FORMAT = 1
MIN_BUCKET = 256


def seq_bucket(seq_len: int) -> int:
    """The table's sequence bucket of ``seq_len``: the power of two >= it, at least 256."""
    bucket = MIN_BUCKET
    while bucket < seq_len:
        bucket *= 2
    return bucket


def user_path(env: str, filename: str) -> Path:
    """The user's table: ``$env`` if set, else ``$XDG_CONFIG_HOME/attn/filename``
    (``~/.config/attn/filename`` without XDG_CONFIG_HOME)."""
    explicit = os.environ.get(env)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "attn" / filename


def cap_method(cap: CapParams | None) -> str:
    """The cap's table name ("none", "tanh", "soft_sign")."""
    return (cap.method if cap is not None else CapMethod.NONE).value


def entry_key(entry: dict) -> tuple:
    """``(device_kind, dtype, head_dim, cap, seq_bucket)`` of a table entry."""
    return (
        entry["device_kind"],
        entry["dtype"],
        int(entry["head_dim"]),
        entry["cap"],
        int(entry["seq_bucket"]),
    )


@functools.lru_cache(maxsize=16)
def _read(path: str, mtime_ns: int, parse: Callable) -> tuple:
    del mtime_ns  # part of the cache key: an edited file is read again
    data = json.loads(Path(path).read_text())
    if data.get("format") != TABLE_FORMAT:
        raise ValueError(f"format: got {data.get('format')!r}, expected {TABLE_FORMAT}")
    return tuple((entry_key(e), parse(e)) for e in data["entries"])


def load(path: Path, parse: Callable[[dict], object]) -> tuple:
    """``((key, parse(entry)), ...)`` of the table at ``path`` (re-read when the file
    changes); ``()`` if it is missing, and a warning if it cannot be read."""
    try:
        stat = path.stat()
    except OSError:
        return ()
    try:
        return _read(str(path), stat.st_mtime_ns, parse)
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(
            f"ignoring the tuned-config table {path}: {type(e).__name__}: {e} "
            "(re-run `attn tune` or delete the file)",
            stacklevel=3,
        )
        return ()


def match(entries, key: tuple):
    """The value for ``key``: the exact entry, else the nearest sequence bucket of the same
    device, head dim and cap (the smaller bucket on a tie), else ``None``."""
    device, _, head_dim, cap, bucket = key
    exact = [value for k, value in entries if k == key]
    if exact:
        return exact[0]
    near = [
        (abs(k[4].bit_length() - bucket.bit_length()), k[4], value)
        for k, value in entries
        if (k[0], k[2], k[3]) == (device, head_dim, cap)
    ]
    return min(near, key=lambda x: (x[0], x[1]))[2] if near else None


def lookup(tables, parse, *, device_kind: str, dtype, head_dim: int, cap, seq_len: int):
    """The first table of ``tables`` (``(path, label)`` pairs, in order) with a value for
    the problem (:func:`match`): ``(value, "label path")``, else ``(None, "defaults")``."""
    key = (device_kind, jnp.dtype(dtype).name, int(head_dim), cap_method(cap), seq_bucket(seq_len))
    for path, label in tables:
        found = match(load(path, parse), key)
        if found is not None:
            return found, f"{label} {path}"
    return None, "defaults"


def write_merged(out: Path, table: dict) -> dict:
    """Merge ``table`` into the table at ``out`` (:func:`merge_tables`; an unreadable or
    missing file counts as empty), write it, and return it."""
    old = None
    if out.exists():
        try:
            old = json.loads(out.read_text())
        except ValueError:
            old = None
    merged = merge_tables(old, table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    return merged


def merge_tables(old: dict | None, new: dict) -> dict:
    """``new``'s entries (and trials) replace ``old``'s with the same key (case); the
    rest of ``old`` stays."""
    keep, keep_trials = [], []
    if old and old.get("format") == TABLE_FORMAT:
        new_keys = {entry_key(e) for e in new["entries"]}
        keep = [e for e in old.get("entries", []) if entry_key(e) not in new_keys]
        new_cases = {t["case"] for t in new.get("trials", [])}
        keep_trials = [t for t in old.get("trials", []) if t.get("case") not in new_cases]
    merged = dict(new)
    merged["entries"] = keep + list(new["entries"])
    merged["trials"] = keep_trials + list(new.get("trials", []))
    return merged
