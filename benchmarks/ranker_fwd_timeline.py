"""Per-step timeline of the Hopper ranker forward's compute warpgroups (H200), from
Mosaic GPU's profiler, with and without the case's cap.

``ranker_fwd._PROFILE`` turns on Mosaic GPU's profiler (``CompilerParams(profile_space,
profile_dir)``): each compute warpgroup records, in shared memory, the clock at the
start and end of the named scopes of every KV step, and jax writes one Perfetto trace
per call. The scopes, in the order a step runs them:

* ``qk``: issue ``Q K^T`` and wait for it (its wgmma is ordered after the other WG's
  turn by the schedule barrier, so this includes waiting for the tensor cores);
* ``softmax``: mask, row max, cap, exp2, row sum, the rescale, P to 16 bits;
* ``wait_v``: wait until this step's V block has landed;
* ``wait_turn``: wait until the other warpgroup has issued its wgmmas (the ping-pong);
* ``pv``: issue ``P V``, wait for it, and wait for the next K block.

For each case and cap, the tuned config with one program per tile (``programs=0``: a
program's events must fit its shared-memory buffer) at a reduced batch; the third call's
trace is summarised: per scope, the mean cycles per step and the share of the
warpgroups' time; ``outside`` is the time between scopes (mask setup, arrivals, the
loop, the epilogue). The recording costs a few cycles per scope, the same with and
without the cap::

    python benchmarks/ranker_fwd_timeline.py --cases phoenix long --batch 4 --out /tmp/tl
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import ranker_case
from attn_mosaic_gpu import ranker_fwd
from attn_mosaic_gpu.ranker import resolve_tuning

SCOPES = ("qk", "softmax", "wait_v", "wait_turn", "pv")
# Ranges per warpgroup and call: 6 scopes per step (softmax is opened twice), long's
# 40 KV steps of 128 keys, and room to spare.
PROFILE_SPACE = 320


def summarise(trace_file: str) -> str:
    """Mean cycles per step of each scope and its share of the warpgroups' busy time."""
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    per_trace = collections.defaultdict(list)
    for event in events:
        per_trace[(event["pid"], event["tid"])].append(event)
    totals = collections.Counter()
    steps = 0
    busy = 0.0
    for trace in per_trace.values():
        stack, last_end, start = [], None, trace[0]["ts"]
        for event in trace:
            if event["ph"] == "B":
                stack.append(event)
                if last_end is not None and len(stack) == 1:
                    totals["outside"] += event["ts"] - last_end
            else:
                begin = stack.pop()
                totals[begin["name"]] += event["ts"] - begin["ts"]
                if begin["name"] == "qk":
                    steps += 1
                last_end = event["ts"]
        busy += last_end - start
    # ts is in units of 1000 clock cycles (the profiler's %clock deltas / 1e3).
    lines = [f"  {len(per_trace)} warpgroup traces, {steps} KV steps"]
    for name in (*SCOPES, "outside"):
        cycles = 1e3 * totals[name] / max(steps, 1)
        lines.append(f"  {name:9s} {cycles:8.0f} cycles/step  {100 * totals[name] / busy:5.1f} %")
    lines.append(f"  {'step':9s} {1e3 * busy / max(steps, 1):8.0f} cycles/step (busy span / steps)")
    return "\n".join(lines)


def run_case(name: str, batch: int, out: str, calls: int) -> None:
    case = dataclasses.replace(ranker_case(name), batch=batch)
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    config = resolve_tuning(q, case.cap, None, None, bounds=bounds)[0].replace(programs=0)
    for label, cap in (("cap", case.cap), ("no cap", None)):
        folder = os.path.join(out, f"{name}-{label.replace(' ', '_')}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        ranker_fwd._PROFILE = (PROFILE_SPACE, folder)
        jax.clear_caches()
        fn = jax.jit(
            lambda q, k, v, cap=cap: ranker_fwd.ranker_attention_fwd(
                q, k, v, bounds, cap=cap, config=config
            )
        )
        for _ in range(calls):
            jax.block_until_ready(fn(q, k, v))
        jax.effects_barrier()  # the trace is written by a host callback
        traces = sorted(glob.glob(os.path.join(folder, "*-trace.json")))
        print(f"{name} B{batch} {label} ({cap}), {config}: {len(traces)} traces", flush=True)
        print(summarise(traces[-1]), flush=True)
        with open(traces[-1], "rb") as src, gzip.open(f"{folder}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        shutil.rmtree(folder)
    ranker_fwd._PROFILE = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["phoenix"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    np.set_printoptions(precision=3)
    for name in args.cases:
        run_case(name, args.batch, args.out, args.calls)


if __name__ == "__main__":
    main()
