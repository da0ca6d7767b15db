"""``_timing``: a profiler trace's TPU lines to the suites' device times; calls queued
back to back."""

from __future__ import annotations

import time

import pytest

from attn_pallas_tpu._timing import (
    QUEUED_CALLS,
    QUEUED_MAX_CALLS,
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


def test_queued_ms_waits_once_per_sample():
    """A warm-up call waited for, then ``queued_calls`` calls issued with one wait at the
    end; the time is per call."""
    calls, waits = [], []

    class Out:
        def block_until_ready(self):
            waits.append(len(calls))
            return self

    def fn(x):
        calls.append(x)
        time.sleep(0.002)
        return Out()

    ms = queued_ms(fn, 7, iterations=3)
    n = len(calls) - 1  # after the warm-up: at least the span of 2 ms calls, bounded
    assert calls == [7] * (1 + n) and waits == [1, 1 + n]
    assert QUEUED_CALLS < n <= QUEUED_SPAN_MS / 2.0
    assert ms >= 2.0
    calls.clear(), waits.clear()
    queued_ms(fn, 7, iterations=QUEUED_MAX_CALLS + 2)
    assert len(calls) == QUEUED_MAX_CALLS + 3 and waits == [1, QUEUED_MAX_CALLS + 3]


def test_trace_times_splits_kernels_from_the_xla_ops_around_them():
    copy = "%copy.3 = bf16[64,1152,2560]{2,1,0:T(16,128)(2,1)} copy(%p.0)" + " " * 200
    lines = {
        "XLA Modules": [("jit_f", 4_000_000), ("jit_f", 5_000_000), ("jit_f", 9_000_000)],
        "XLA Ops": [
            ("%custom-call.1 = (f32[8,512]{1,0}) custom-call(%a), custom_call_target=", 3e6),
            ("%custom-call.1 = (f32[8,512]{1,0}) custom-call(%a), custom_call_target=", 3e6),
            (copy, 600_000),
            (copy, 900_000),
            ("%sort.2 = s32[16,4096]{1,0} sort(%x)", 1_200_000),
            ("%fusion.7 = f32[8]{0} fusion(%y)", 30_000),
        ],
    }
    got = trace_times(lines, iterations=3, top_ops=2)
    assert got["device_ms"] == pytest.approx(5.0)  # the median span
    assert got["kernel_device_ms"] == pytest.approx(2.0)  # 6 ms over 3 calls
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
    }


def test_several_executables_a_call_take_the_mean():
    lines = {"XLA Modules": [("a", 1e6), ("b", 2e6), ("a", 1e6), ("b", 4e6)]}
    assert trace_times(lines, iterations=2)["device_ms"] == pytest.approx(4.0)
