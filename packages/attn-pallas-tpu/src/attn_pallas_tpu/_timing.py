"""The TPU benchmark suites' measuring helpers (``bench_sparse_mla``, ``bench_ranker``):
wall clock (each call waited for, and calls queued back to back), device time from a
``jax.profiler`` trace, the measured bf16 matmul rate and the relative L2 error. One
home, so both suites time the same way."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "device_ms",
    "matmul_tflops",
    "queued_calls",
    "queued_ms",
    "rel_l2",
    "timed",
    "trace_times",
    "wall_ms",
]
QUEUED_CALLS = 5  # calls a queued_ms sample issues at least ...
# ... and enough to span about this long, so the one wait at its end (a host round trip,
# 0.6 ms on the v5e machine) adds little to each call: 5 decode calls of 0.7 ms carried
# 0.12 ms of it each.
QUEUED_SPAN_MS = 100.0
QUEUED_MAX_CALLS = 200
# The samples queued_ms takes the median of for a call shorter than QUEUED_SPAN_MS /
# QUEUED_CALLS (one for longer calls): one sample of such a call moved by up to 0.15 ms
# on the v5e machine (host dispatch jitter), a fifth of a decode call.
QUEUED_SAMPLES = 3


def wall_ms(fn, *args, iterations: int) -> float:
    """Median wall-clock ms of ``fn(*args)`` after one warm-up call, each call waited."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def queued_ms(fn, *args, iterations: int) -> float:
    """Wall-clock ms per call of ``fn(*args)`` issued back to back, as a training or
    serving loop dispatches them: after one waited warm-up call, samples of
    ``queued_calls`` calls queued with one wait at the end, each sample's total over its
    calls; the median of ``QUEUED_SAMPLES`` samples for a call shorter than
    ``QUEUED_SPAN_MS / QUEUED_CALLS``, else one. The host round trip of a waited call
    (0.6 ms for a jitted ``x + 1`` on the v5e machine) is paid once per sample, spread
    over enough calls to be small in each."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    waited_ms = (time.perf_counter() - t0) * 1e3
    calls = queued_calls(waited_ms, iterations)
    samples = QUEUED_SAMPLES if waited_ms * QUEUED_CALLS < QUEUED_SPAN_MS else 1
    per_call = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls - 1):
            fn(*args)  # dropped: its buffers are freed once it has run
        jax.block_until_ready(fn(*args))  # one device queue: the last call finishes last
        per_call.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(per_call)


def queued_calls(waited_ms: float, iterations: int) -> int:
    """Calls a ``queued_ms`` sample issues: at least ``iterations`` and ``QUEUED_CALLS``,
    and enough calls of ``waited_ms`` (one waited call) to span ``QUEUED_SPAN_MS``, at
    most ``QUEUED_MAX_CALLS`` for that."""
    span = min(math.ceil(QUEUED_SPAN_MS / max(waited_ms, 1e-3)), QUEUED_MAX_CALLS)
    return max(iterations, QUEUED_CALLS, span)


def device_ms(fn, *args, iterations: int, top_ops: int = 8) -> dict:
    """Device-side times of ``fn(*args)`` from a profiler trace of ``iterations`` waited
    calls: ``device_ms``, the median of the TPU's "XLA Modules" spans (their mean per
    call when a call runs several executables), ``kernel_device_ms``, the mean per call
    of its Pallas kernels' ops (custom calls) on the "XLA Ops" line, and ``xla_ops_ms``,
    the ``top_ops`` other ops that took longest, ``[name, ms per call]`` with the name
    cut to 160 characters (an op's HLO text: its shapes and layouts say what a copy or
    a transpose moves), and ``kernel_ops_ms``, each Pallas kernel's ``[name, ms per
    call]`` the same way, in the order the trace first lists them (a forward + backward
    call's three kernels apart: their output shapes tell them apart);
    ``None`` where the trace has no TPU plane (interpret mode, a CPU)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(iterations):
                jax.block_until_ready(fn(*args))
        paths = sorted(Path(d).rglob("*.xplane.pb"))
        data = jax.profiler.ProfileData.from_file(str(paths[0])) if paths else None
    lines = {
        line.name: [(ev.name, ev.duration_ns) for ev in line.events]
        for plane in (data.planes if data else ())
        if plane.name.startswith("/device:TPU:0")
        for line in plane.lines
    }
    return trace_times(lines, iterations=iterations, top_ops=top_ops)


def trace_times(lines: dict, *, iterations: int, top_ops: int = 8) -> dict:
    """:func:`device_ms`'s fields from a trace's TPU lines ``{line name: [(event name,
    ns), ...]}`` of ``iterations`` calls."""
    spans = [ns for _, ns in lines.get("XLA Modules", ())]
    if not spans:
        return dict.fromkeys(("device_ms", "kernel_device_ms", "xla_ops_ms", "kernel_ops_ms"))
    per_call = statistics.median(spans) if len(spans) == iterations else sum(spans) / iterations
    kernels, others = {}, {}
    for name, ns in lines.get("XLA Ops", ()):
        ops = kernels if " custom-call(" in name else others
        ops[name[:160]] = ops.get(name[:160], 0) + ns
    top = sorted(others.items(), key=lambda kv: -kv[1])[:top_ops]
    return {
        "device_ms": per_call / 1e6,
        "kernel_device_ms": sum(kernels.values()) / iterations / 1e6,
        "xla_ops_ms": [[name, ns / iterations / 1e6] for name, ns in top],
        "kernel_ops_ms": [[name, ns / iterations / 1e6] for name, ns in kernels.items()],
    }


def timed(fn, *args, iterations: int) -> dict:
    """``ms`` (wall clock, each call waited for), ``queued_ms`` (:func:`queued_ms`) and
    :func:`device_ms`'s fields of ``fn(*args)``."""
    return {
        "ms": wall_ms(fn, *args, iterations=iterations),
        "queued_ms": queued_ms(fn, *args, iterations=iterations),
        **device_ms(fn, *args, iterations=iterations),
    }


def matmul_tflops(smoke: bool) -> float:
    """The bf16 matmul rate of this chip, measured (8192^3, random data)."""
    n = 256 if smoke else 8192
    a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    ms = wall_ms(f, a, b, iterations=3 if smoke else 10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def rel_l2(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = np.isfinite(want)
    with np.errstate(invalid="ignore"):  # inf - inf where both are non-finite
        num = np.linalg.norm(np.where(finite, got - want, 0.0))
    return float(num / max(np.linalg.norm(np.where(finite, want, 0.0)), 1e-30))
