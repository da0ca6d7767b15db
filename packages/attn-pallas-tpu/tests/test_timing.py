"""``_timing``: a profiler trace's TPU lines to the suites' device times; calls queued
back to back."""

from __future__ import annotations

import time
import types

import pytest

from attn_pallas_tpu._timing import (
    QUEUED_CALLS,
    QUEUED_MAX_CALLS,
    QUEUED_SAMPLES,
    QUEUED_SPAN_MS,
    queued_calls,
    queued_ms,
    trace_times,
)


def test_queued_calls_span_the_round_trip():
    """At least the iterations and ``QUEUED_CALLS``; short calls queue enough to span
    ``QUEUED_SPAN_MS`` (bounded), long ones no more than the minimum."""
    assert queued_calls(450.0, 3) == QUEUED_CALLS  # an XLA reference row
    assert queued_calls(450.0, QUEUED_CALLS + 4) == QUEUED_CALLS + 4
    decode = queued_calls(0.7, 3)
    assert decode * 0.7 >= QUEUED_SPAN_MS and (decode - 1) * 0.7 < QUEUED_SPAN_MS
    assert queued_calls(0.0, 3) == queued_calls(1e-6, 3) == QUEUED_MAX_CALLS


def _counting_fn(sleep_s: float):
    """``fn(x)`` sleeping ``sleep_s``, and the lists of its calls and of the call count
    at each wait."""
    calls, waits = [], []

    class Out:
        def block_until_ready(self):
            waits.append(len(calls))
            return self

    def fn(x):
        calls.append(x)
        time.sleep(sleep_s)
        return Out()

    return fn, calls, waits


def test_queued_ms_waits_once_per_sample():
    """A warm-up call waited for, then ``QUEUED_SAMPLES`` samples of ``queued_calls``
    calls issued with one wait at the end each; the time is per call."""
    fn, calls, waits = _counting_fn(0.002)
    ms = queued_ms(fn, 7, iterations=3)
    n = (len(calls) - 1) // QUEUED_SAMPLES  # a sample: the span of 2 ms calls, bounded
    assert calls == [7] * (1 + QUEUED_SAMPLES * n)
    assert waits == [1 + k * n for k in range(QUEUED_SAMPLES + 1)]
    assert QUEUED_CALLS < n <= QUEUED_SPAN_MS / 2.0
    assert ms >= 2.0
    calls.clear(), waits.clear()
    queued_ms(fn, 7, iterations=QUEUED_MAX_CALLS + 2)
    n = QUEUED_MAX_CALLS + 2
    assert len(calls) == 1 + QUEUED_SAMPLES * n
    assert waits == [1 + k * n for k in range(QUEUED_SAMPLES + 1)]


def test_queued_ms_is_the_median_sample(monkeypatch):
    """Per-call times of 1, 9 and 2 ms in the three samples (a fake clock the calls
    advance): the median, 2 ms, not the mean."""
    from attn_pallas_tpu import _timing

    clock = [0.0]
    calls = []
    monkeypatch.setattr(_timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(_timing.jax, "block_until_ready", lambda x: x)
    n = queued_calls(1.0, 3)
    per_sample = (1e-3, 9e-3, 2e-3)

    def fn(x):
        sample = max(len(calls) - 1, 0) // n
        clock[0] += 1e-3 if not calls else per_sample[sample]
        calls.append(x)
        return x

    assert QUEUED_SAMPLES == 3
    assert queued_ms(fn, 7, iterations=3) == pytest.approx(2.0)
    assert len(calls) == 1 + 3 * n


def test_queued_ms_takes_one_sample_of_long_calls():
    """A call of at least ``QUEUED_SPAN_MS / QUEUED_CALLS``: one sample of
    ``QUEUED_CALLS`` calls (its spread is small against the call)."""
    fn, calls, waits = _counting_fn(1.05 * QUEUED_SPAN_MS / QUEUED_CALLS / 1e3)
    ms = queued_ms(fn, 7, iterations=3)
    assert len(calls) == 1 + QUEUED_CALLS and waits == [1, 1 + QUEUED_CALLS]
    assert ms >= QUEUED_SPAN_MS / QUEUED_CALLS


def test_trace_times_splits_kernels_from_the_xla_ops_around_them():
    copy = "%copy.3 = bf16[64,1152,2560]{2,1,0:T(16,128)(2,1)} copy(%p.0)" + " " * 200
    lines = {
        "XLA Modules": [("jit_f", 4_000_000), ("jit_f", 5_000_000), ("jit_f", 9_000_000)],
        "XLA Ops": [
            ("%custom-call.1 = (f32[8,512]{1,0}) custom-call(%a), custom_call_target=", 3e6),
            ("%custom-call.2 = (bf16[8,64]{1,0}) custom-call(%b), custom_call_target=", 6e5),
            ("%custom-call.1 = (f32[8,512]{1,0}) custom-call(%a), custom_call_target=", 3e6),
            (copy, 600_000),
            (copy, 900_000),
            ("%sort.2 = s32[16,4096]{1,0} sort(%x)", 1_200_000),
            ("%fusion.7 = f32[8]{0} fusion(%y)", 30_000),
        ],
    }
    got = trace_times(lines, iterations=3, top_ops=2)
    assert got["device_ms"] == pytest.approx(5.0)  # the median span
    assert got["kernel_device_ms"] == pytest.approx(2.2)  # 6.6 ms over 3 calls
    assert got["kernel_ops_ms"] == [  # each kernel apart, in the trace's first order
        [
            "%custom-call.1 = (f32[8,512]{1,0}) custom-call(%a), custom_call_target=",
            pytest.approx(2.0),
        ],
        [
            "%custom-call.2 = (bf16[8,64]{1,0}) custom-call(%b), custom_call_target=",
            pytest.approx(0.2),
        ],
    ]
    assert (
        got["xla_ops_ms"]
        == [  # by time, the same op's events summed, names cut
            [copy[:160], pytest.approx(0.5)],
            ["%sort.2 = s32[16,4096]{1,0} sort(%x)", pytest.approx(0.4)],
        ]
    )


def test_trace_times_without_a_tpu_plane():
    assert trace_times({}, iterations=3) == {
        "device_ms": None,
        "kernel_device_ms": None,
        "xla_ops_ms": None,
        "kernel_ops_ms": None,
    }


def test_several_executables_a_call_take_the_mean():
    lines = {"XLA Modules": [("a", 1e6), ("b", 2e6), ("a", 1e6), ("b", 4e6)]}
    assert trace_times(lines, iterations=2)["device_ms"] == pytest.approx(4.0)
