"""The sweep behind ``attn tune``: time the Hopper ranker kernels over their knobs and
build a table for ``attn_mosaic_gpu.tuning`` to read.

Coordinate descent over the knobs, CUPTI device time (``attn_mosaic_gpu.bench.device_ms``),
median of iterations: the forward's tiling, then how many key columns of each score tile
compute ``exp2`` and soft_sign's reciprocal on the FMA pipe instead of the MUFU
(``attn_mosaic_gpu.fastmath``), then the compute warpgroups' register count; then the
same two knobs, the persistent dq (0 or one program per SM) and the ring depth of the
backward kernels, timed on the backward alone. A knob value is kept only when it beats
the incumbent by more than ``min_gain`` (1%), so noise cannot pick a variant.

Split from ``tuning`` so that the kernels' entry (``ranker``) reads the table without
importing the sweep, which runs them: ``tuner`` -> ``ranker`` -> ``tuning``, no circle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp

from attn_common import CapMethod, KernelConfig
from attn_common.tuned_table import TABLE_FORMAT, cap_method
from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.ranker import ranker_attention
from attn_mosaic_gpu.ranker_bwd_pipelined import PIPELINED_HEAD_DIMS, pipelined_stages
from attn_mosaic_gpu.tuning import BackwardTuning, merge_tables, seq_bucket

__all__ = ["merge_tables", "tune"]


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
    """Sweep the knobs for each ``attn_common.suite.RankerCase`` and return a table.

    Returns ``{"format", "entries": [...], "trials": [...]}``: one entry per case key
    (forward config, backward knobs, the measured ms) and every timed trial. Runs on a
    Hopper GPU. ``timer(fn, args, stage=..., knobs=...)`` returns ms; the default runs the
    jitted ``fn(*args)`` under ``attn_mosaic_gpu.bench.device_ms`` (CUPTI); a test passes a
    model of the cost instead.
    """
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
    return {"format": TABLE_FORMAT, "entries": entries, "trials": trials}


def _tune_case(case, timer: Callable, min_gain: float, progress: Callable) -> tuple[dict, dict]:
    """One case's sweep: (table entry without the device, every trial)."""
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
        "cap": cap_method(case.cap),
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
    return ranker_attention(q, k, v, bounds, cap=cap, config=config, backward_tuning=backward)
