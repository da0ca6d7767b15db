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

``tune`` is the sweep (coordinate descent over the knobs, CUPTI device time, median of
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
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import jax.numpy as jnp

from attn_common import CapMethod, CapParams, KernelConfig

__all__ = [
    "PACKAGE_TABLE",
    "BackwardTuning",
    "RankerTuning",
    "lookup",
    "seq_bucket",
    "tune",
    "user_table_path",
]

PACKAGE_TABLE = Path(__file__).with_name("tuned_configs.json")
_TABLE_FORMAT = 1
_MIN_BUCKET = 256


@dataclasses.dataclass(frozen=True)
class BackwardTuning:
    """Schedule knobs of the pipelined backward kernels (D 64 and 128; see
    ``ranker_bwd_pipelined``). ``num_stages=None`` is the per-D default ring depth."""

    num_stages: int | None = None
    exp2_fma_cols: int = 0
    rcp_fma_cols: int = 0
    dq_programs: int = 0
    # Deprecated (0.2.0; removed in the next release): the kernels always fold the cap
    # and overlap; True is accepted with a warning, False is refused.
    fold: bool | None = None
    overlap: bool | None = None

    def __post_init__(self):
        for name in ("fold", "overlap"):
            value = getattr(self, name)
            if value is None:
                continue
            if value is not True:
                raise ValueError(
                    f"BackwardTuning.{name}: got {value!r}; the schedule without it was "
                    "removed (git da2ec0c has it); leave it unset"
                )
            warnings.warn(
                f"BackwardTuning.{name} is deprecated and ignored: always on",
                DeprecationWarning,
                stacklevel=3,
            )

    def knobs(self) -> dict:
        """The overrides ``ranker_bwd_pipelined.pipelined_bwd(tuning=...)`` takes."""
        knobs = dataclasses.asdict(self)
        del knobs["fold"], knobs["overlap"]
        if knobs["num_stages"] is None:
            del knobs["num_stages"]
        return knobs


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


# ---------------------------------------------------------------------------- the sweep


def _forward_candidates(head_dim: int) -> list[tuple[int, int]]:
    """(block_kv, num_stages) tilings worth timing per head dim (docs/ranker_gpu.md)."""
    if head_dim <= 64:
        return [(128, 4), (128, 2), (64, 4)]
    if head_dim <= 128:
        return [(128, 2), (64, 3)]
    return [(64, 2)]


def _better(new: float, best: float, min_gain: float) -> bool:
    return new < best * (1.0 - min_gain)


def _descend(
    start: dict,
    axes: Iterable[tuple[str, list]],
    time_fn: Callable[[dict], float | None],
    min_gain: float,
    log: list,
) -> tuple[dict, float]:
    """Coordinate descent: for each knob in turn keep the value that beats the incumbent
    by more than ``min_gain``. The axis ``"tiling"`` takes whole (block_kv, num_stages)
    dicts. Each distinct point is timed once (``log`` gets every timing)."""
    seen: dict[tuple, float | None] = {}

    def measure(point: dict) -> float | None:
        key = tuple(sorted(point.items()))
        if key not in seen:
            seen[key] = time_fn(point)
            log.append({**point, "ms": seen[key]})
        return seen[key]

    best = dict(start)
    best_ms = measure(best)
    if best_ms is None:
        raise RuntimeError(f"the starting point {best} failed to run")
    for name, values in axes:
        for value in values:
            if name == "tiling":
                trial = {**best, "block_kv": value["block_kv"], "num_stages": value["num_stages"]}
            else:
                trial = {**best, name: value}
            too_wide = name.endswith("_cols") and value > trial.get("block_kv", 1 << 30)
            if trial == best or too_wide:
                continue
            ms = measure(trial)
            if ms is not None and _better(ms, best_ms, min_gain):
                best, best_ms = trial, ms
    return best, best_ms


def tune(
    cases: Iterable,
    *,
    iterations: int = 10,
    min_gain: float = 0.01,
    progress: Callable[[str], None] = print,
    timer: Callable | None = None,
) -> dict:
    """Sweep the knobs for each ``attn_common.RankerCase`` and return a table.

    Returns ``{"format", "entries": [...], "trials": [...]}``: one entry per case key
    (forward config, backward knobs, the measured ms) and every timed trial. Runs on a
    Hopper GPU. ``timer(fn, args, stage=..., knobs=...)`` returns ms; the default runs the
    jitted ``fn(*args)`` under ``attn_common.bench.device_ms`` (CUPTI); a test passes a
    model of the cost instead.
    """
    from attn_common.bench import device_ms

    if timer is None:

        def timer(fn, args, *, stage, knobs):
            del stage, knobs
            return device_ms(fn, *args, iterations=iterations)[0]

    device_kind = jax.devices()[0].device_kind
    entries, trials = [], []
    for case in cases:
        entry, trial = _tune_case(case, timer, min_gain, progress)
        entries.append({"device_kind": device_kind, **entry})
        trials.append(trial)
    return {"format": _TABLE_FORMAT, "entries": entries, "trials": trials}


def _tune_case(case, timer: Callable, min_gain: float, progress: Callable) -> tuple[dict, dict]:
    """One case's sweep: (table entry without the device, every trial)."""
    from attn_mosaic_gpu.ranker import ranker_attention
    from attn_mosaic_gpu.ranker_bwd_pipelined import PIPELINED_HEAD_DIMS, pipelined_stages

    s, d = case.seq_len, case.head_dim
    q, k, v, dout = case.inputs()
    bounds = jnp.asarray(case.bounds())
    soft_sign = case.cap.method is CapMethod.SOFT_SIGN

    def timed(fn, *args, label, knobs):
        try:
            return float(timer(jax.jit(fn), args, stage=label, knobs=knobs))
        except Exception as e:  # a config the compiler refuses is skipped, not fatal
            progress(f"  {case.name} {label} {knobs}: failed ({type(e).__name__}: {e})")
            return None

    def time_forward(knobs: dict) -> float | None:
        config = KernelConfig(block_q=64, **knobs)

        def forward(q, k, v, b):
            return ranker_attention(q, k, v, b, cap=case.cap, config=config)

        ms = timed(forward, q, k, v, bounds, label="forward", knobs=knobs)
        progress(f"  {case.name} forward {knobs}: {ms} ms")
        return ms

    fwd_log: list = []
    tilings = [
        {"block_kv": block_kv, "num_stages": stages, "exp2_fma_cols": 0, "rcp_fma_cols": 0}
        for block_kv, stages in _forward_candidates(d)
    ]
    start, axes = tilings[0], [("tiling", tilings[1:])]
    sms = _sm_count()
    if sms:  # persistent programs, 1-4 per SM (after the tiling: they double Q/O)
        axes.append(("programs", [0, sms, 2 * sms, 4 * sms]))
    block_kv_max = max(t["block_kv"] for t in tilings)
    cols = [c for c in (0, 32, 64, 96, 128) if c <= block_kv_max]
    axes.append(("exp2_fma_cols", cols))
    if soft_sign:
        axes.append(("rcp_fma_cols", [c for c in (0, 64, 128) if c <= block_kv_max]))
        axes.append(("exp2_fma_cols", cols))  # the best split moves with the other
    # 240 registers per compute warpgroup (the memory warpgroup keeps 24) against the
    # default 232: faster on some shapes, slower on others (docs/ranker_gpu.md).
    axes.append(("compute_registers", [0, 240]))
    forward, forward_ms = _descend(start, axes, time_forward, min_gain, fwd_log)

    backward, backward_ms, bwd_log = {}, None, []
    if d in PIPELINED_HEAD_DIMS:
        config = KernelConfig(block_q=64, **forward)

        def time_backward(knobs: dict) -> float | None:
            tuning = BackwardTuning(**knobs)

            def pullback(q, k, v, b, g):
                def fn(q, k, v):
                    return _forward_for_vjp(
                        q, k, v, b, cap=case.cap, config=config, backward=tuning
                    )

                return jax.vjp(fn, q, k, v)[1](g)

            total = timed(pullback, q, k, v, bounds, dout, label="fwd+bwd", knobs=knobs)
            ms = None if total is None else total - forward_ms
            progress(f"  {case.name} backward {knobs}: {ms} ms (fwd+bwd {total})")
            return ms

        bstart = {"num_stages": pipelined_stages(d), "exp2_fma_cols": 0, "rcp_fma_cols": 0}
        baxes = [("exp2_fma_cols", [0, 16, 32, 48, 64])]
        if soft_sign:
            baxes.append(("rcp_fma_cols", [0, 32, 64]))
        # Persistent dq, one program per SM, before the ring depth: at D=128 it fits only
        # the 2-slot ring, so a deeper ring chosen first would shut it out.
        if sms:
            baxes.append(("dq_programs", [0, sms]))
        baxes.append(("num_stages", [2, 3] if d > 64 else [2, 4]))
        backward, backward_ms = _descend(bstart, baxes, time_backward, min_gain, bwd_log)
    entry = {
        "dtype": "bfloat16",
        "head_dim": d,
        "cap": _cap_method(case.cap),
        "seq_bucket": seq_bucket(s),
        "case": case.name,
        "forward": {"block_q": 64, **forward},
        "backward": backward,
        "forward_ms": forward_ms,
        "backward_ms": backward_ms,
    }
    return entry, {"case": case.name, "forward": fwd_log, "backward": bwd_log}


def _sm_count() -> int | None:
    """The first device's SM count (``core_count``), ``None`` where it has none."""
    sms = getattr(jax.devices()[0], "core_count", None)
    return int(sms) if sms else None


def _forward_for_vjp(q, k, v, bounds, *, cap, config, backward):
    """The public op with a fixed backward tuning (the sweep's fwd+bwd timing)."""
    from attn_mosaic_gpu.ranker import ranker_attention

    return ranker_attention(q, k, v, bounds, cap=cap, config=config, backward_tuning=backward)


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
