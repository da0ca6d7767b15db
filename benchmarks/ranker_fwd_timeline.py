"""Per-step timeline of the Hopper ranker forward's compute warpgroups (H200), from
Mosaic GPU's profiler, with and without the case's cap.

``ranker_fwd._PROFILE`` turns on Mosaic GPU's profiler (``CompilerParams(profile_space,
profile_dir)``): each compute warpgroup records, in shared memory, the clock at the
start and end of the named scopes of every KV step, and jax writes one Perfetto trace
per call (``--analyse`` summarises saved traces on any machine). The scopes, in the order a step runs them:

* ``qk``: issue ``Q K^T`` and wait for it (its wgmma is ordered after the other WG's
  turn by the schedule barrier, so this includes waiting for the tensor cores);
* ``softmax``: mask, row max, cap, exp2, row sum, the rescale, P to 16 bits;
* ``wait_v``: wait until this step's V block has landed;
* ``wait_turn``: wait until the other warpgroup has issued its wgmmas (the ping-pong);
* ``pv``: issue ``P V``, wait for it, and wait for the next K block.

For each case and cap, the tuned config with one program per tile (``programs=0``: a
program's events must fit its shared-memory buffer) at a reduced batch; the first
call's trace (jax names the file when it lowers the kernel, so later calls of the same
executable do not overwrite it) is summarised by ``analyse``: medians of the step
period and of each scope, and a merged timeline of one program. The recording costs a
few cycles per scope, the same with and without the cap::

    python benchmarks/ranker_fwd_timeline.py --cases phoenix long --batch 4 --out /tmp/tl

The shipped kernel carries neither the scopes nor the switch (they change no generated
code, but any edit of a kernel file owes the whole GPU suite a run): take the
instrumented ``ranker_fwd.py`` from b840bdb first (``git checkout b840bdb --
packages/attn-mosaic-gpu/src/attn_mosaic_gpu/ranker_fwd.py``), where this script ran
(``docs/results/ranker_fwd_timeline_b840bdb.log``, docs/ranker_gpu.md "A step's
timeline").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import itertools
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


def _ranges(trace):
    """(name, start, end) of each scope of one warpgroup's trace, in cycles, by start."""
    stack, ranges = [], []
    for event in trace:
        if event["ph"] == "B":
            stack.append(event)
        else:
            begin = stack.pop()
            ranges.append((begin["name"], 1e3 * begin["ts"], 1e3 * event["ts"]))
    return sorted(ranges, key=lambda r: r[1])


def analyse(trace_file: str) -> str:
    """Medians of a trace (``.json`` or ``.json.gz``): the step period (a WG's ``qk``
    start to its next), each scope, the prologue (Mosaic GPU's ``Init`` to the first
    ``qk``), how often both WGs of a program are in their softmax at once, and the
    merged timeline of the first program whose two WGs both run 8 steps."""
    opener = gzip.open if trace_file.endswith(".gz") else open
    with opener(trace_file, "rt") as f:
        events = json.load(f)["traceEvents"]
    programs = collections.defaultdict(dict)
    for event in events:
        pid, tid = event["pid"], event["tid"]
        programs[(pid, (tid - 1) // 3)].setdefault((tid - 1) % 3, []).append(event)
    periods, prologue, both = [], [], []
    scopes = collections.defaultdict(list)
    example = None
    for wgs in programs.values():
        softmax = {}
        for wg, trace in wgs.items():
            ranges = _ranges(trace)
            qks = [r for r in ranges if r[0] == "qk"]
            if not qks:
                continue
            init_end = next(r[2] for r in ranges if r[0] == "Init")
            prologue.append(qks[0][1] - init_end)
            periods += [b[1] - a[1] for a, b in itertools.pairwise(qks)]
            for name, start, end in ranges:
                if name != "Init":
                    scopes[name].append(end - start)
            softmax[wg] = [(a, b) for name, a, b in ranges if name == "softmax"]
            if wg == 1 and len(qks) == 8 and example is None and len(softmax.get(0, ())) == 8:
                example = wgs
        if len(softmax) == 2:
            total = sum(b - a for a, b in softmax[0])
            overlap = sum(
                max(0.0, min(b0, b1) - max(a0, a1))
                for a0, b0 in softmax[0]
                for a1, b1 in softmax[1]
            )
            both.append(overlap / total)
    lines = [f"{os.path.basename(trace_file)}: {len(periods)} step periods, medians in cycles"]
    lines.append(f"  step period {np.median(periods):.0f}")
    for name in SCOPES:
        lines.append(f"  {name:9s} {np.median(scopes[name]):.0f}")
    lines.append(f"  prologue (Init to the first qk) {np.median(prologue):.0f}")
    lines.append(f"  share of a WG's softmax time the other WG also spends in softmax: "
                 f"{np.mean(both):.3f}")  # fmt: skip
    if example is not None:
        rows = [(a, b, wg, n) for wg in (0, 1) for n, a, b in _ranges(example[wg]) if n != "Init"]
        rows.sort()
        lines.append("  one program, both WGs (start, end, cycles from its first scope):")
        for a, b, wg, name in rows[:24]:
            lines.append(
                f"  {a - rows[0][0]:7.0f} {b - rows[0][0]:7.0f} {'':{30 * wg}}WG{wg} {name} ({b - a:.0f})"
            )
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
        print(analyse(traces[-1]), flush=True)
        with open(traces[-1], "rb") as src, gzip.open(f"{folder}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        shutil.rmtree(folder)
    ranker_fwd._PROFILE = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["phoenix"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", help="where the traces go (on the GPU machine)")
    parser.add_argument("--analyse", nargs="+", help="traces to summarise (anywhere)")
    args = parser.parse_args()
    if args.analyse:
        for trace_file in args.analyse:
            print(analyse(trace_file))
        return
    if not hasattr(ranker_fwd, "_PROFILE"):
        raise SystemExit(
            "ranker_fwd has no profiler switch: check out the instrumented kernel first "
            "(git checkout b840bdb -- packages/attn-mosaic-gpu/src/attn_mosaic_gpu/ranker_fwd.py)"
        )
    if not args.out:
        parser.error("--out is needed to record traces")
    for name in args.cases:
        run_case(name, args.batch, args.out, args.calls)


if __name__ == "__main__":
    main()
