"""Where the ranker forward's warps stall, per SASS instruction (Nsight Compute, H200).

The step timeline (docs/ranker_gpu.md, "A step's timeline") says that one warpgroup's
softmax sets the pace; this script says what that softmax waits on. ``run`` executes the
tuned forward of a suite case once inside a ``cuProfilerStart`` / ``cuProfilerStop``
range (after a compile-and-warm call outside it), so ncu profiles only that call::

    ncu --clock-control none --profile-from-start off --section SourceCounters \\
        --section WarpStateStats -o phoenix python3 benchmarks/ranker_fwd_stalls.py run
    ncu --import phoenix.ncu-rep --page source --print-source sass --csv > phoenix.csv
    python3 benchmarks/ranker_fwd_stalls.py analyse phoenix.csv

``analyse`` (any machine) reads the source page of the longest kernel and prints, for
the instructions executed most often (the KV step loop), the warp-stall samples by
reason and by opcode, and the most-sampled instructions in program order.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import dataclasses
import gzip
import re


def run(case_name: str, no_cap: bool) -> None:
    import jax
    import jax.numpy as jnp

    from attn_common import ranker_case
    from attn_mosaic_gpu.ranker import resolve_tuning
    from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd

    case = ranker_case(case_name)
    cap = None if no_cap else case.cap
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    config = resolve_tuning(q, cap, None, None, bounds=bounds)[0]
    print(f"{case_name} cap={cap} {config}", flush=True)
    fn = jax.jit(lambda q, k, v: ranker_attention_fwd(q, k, v, bounds, cap=cap, config=config))
    jax.block_until_ready(fn(q, k, v))
    jax.block_until_ready(fn(q, k, v))
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    jax.block_until_ready(fn(q, k, v))
    cuda.cuProfilerStop()


@dataclasses.dataclass
class Row:
    address: str
    source: str
    executed: int
    samples: int
    stalls: dict[str, int]

    @property
    def opcode(self) -> str:
        text = re.sub(r"^@!?U?P\w+\s+", "", self.source.strip())
        return text.split(" ")[0].split(".")[0] if text else "?"


def _int(text: str) -> int:
    text = text.replace(",", "").strip()
    try:
        return int(float(text))
    except ValueError:
        return 0


def read_rows(path: str) -> list[Row]:
    """The rows of ``ncu --page source --print-source sass --csv`` (last kernel wins if
    the file holds several: ncu prints one table per kernel; the longest is taken)."""
    tables, current = [], None
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        for record in csv.reader(f):
            if record and "Address" in record[:2]:
                current = {"header": record, "rows": []}
                tables.append(current)
            elif current is not None and record:
                current["rows"].append(record)
    best = None
    for table in tables:
        header = table["header"]
        col = {name: i for i, name in enumerate(header)}
        exec_col = next((c for c in header if c.startswith("Instructions Executed")), None)
        samp_col = next((c for c in header if c.startswith("Warp Stall Sampling (All")), None)
        stall_cols = [c for c in header if c.startswith("stall_") or "Stall Reason" in c]
        rows = []
        for rec in table["rows"]:
            if len(rec) < len(header):
                continue
            rows.append(
                Row(
                    address=rec[col.get("Address", 0)],
                    source=rec[col.get("Source", 1)],
                    executed=_int(rec[col[exec_col]]) if exec_col else 0,
                    samples=_int(rec[col[samp_col]]) if samp_col else 0,
                    stalls={c: _int(rec[col[c]]) for c in stall_cols},
                )
            )
        if best is None or sum(r.samples for r in rows) > sum(r.samples for r in best):
            best = rows
    return best or []


def regions(loop: list[Row]) -> None:
    """The step loop cut at its landmarks (wgmma waits, barrier arrives, the last wgmma
    fence before ``P V``): each region's share of the samples, and where each mbarrier
    arrive sits among the step's exponentials."""
    marks = collections.defaultdict(list)
    for i, r in enumerate(loop):
        for key in ("DEPBAR", "SYNCS.ARRIVE", "TRYWAIT", "MUFU.EX2", "WARPGROUP.ARRIVE"):
            if key in r.source:
                marks[key].append(i)
    ex2 = marks["MUFU.EX2"]
    waits = marks["DEPBAR"]
    if len(waits) < 2 or not ex2 or not marks["WARPGROUP.ARRIVE"]:
        print("\n(no step-loop landmarks found)")
        return
    qk_wait, pv_wait = waits[0], waits[-1]
    pv_fence = marks["WARPGROUP.ARRIVE"][-1]
    turn = max((i for i in marks["TRYWAIT"] if i < pv_fence), default=qk_wait)
    cuts = [
        ("Q K^T issue, ping-pong sync", 0, qk_wait),
        ("wait for Q K^T (wgmma)", qk_wait, qk_wait + 1),
        ("softmax, up to the turn wait", qk_wait + 1, turn),
        ("turn wait .. P V fence", turn, pv_fence),
        ("P V issue, wait for next K", pv_fence, pv_wait),
        ("wait for P V (wgmma)", pv_wait, pv_wait + 1),
        ("loop end", pv_wait + 1, len(loop)),
    ]
    total = max(sum(r.samples for r in loop), 1)
    print("\nstep loop by region (share of its samples):")
    for name, a, b in cuts:
        n = sum(r.samples for r in loop[a:b])
        print(f"  {name:32s} [{a:4d}, {b:4d}) {n:8d} {n / total:6.1%}")
    print(f"exponentials (MUFU.EX2) at loop indices {ex2[0]}..{ex2[-1]} ({len(ex2)})")
    for i in marks["SYNCS.ARRIVE"]:
        before = sum(1 for e in ex2 if e < i)
        print(f"  mbarrier arrive at {i:4d}: {loop[i].source.strip()[:48]:48s} "
              f"after {before} of the {len(ex2)} EX2")  # fmt: skip


def analyse(path: str, top: int) -> None:
    rows = read_rows(path)
    if not rows:
        raise SystemExit(f"{path}: no source table found")
    total = sum(r.samples for r in rows)
    hot = max(r.executed for r in rows)
    # The KV step loop: instructions executed at least a quarter as often as the most
    # executed one (the prologue, epilogue and memory warpgroup run far fewer times).
    loop = [r for r in rows if r.executed >= hot / 4]
    loop_samples = sum(r.samples for r in loop)
    print(f"{path}: {len(rows)} instructions, {total} stall samples; hot loop "
          f"{len(loop)} instructions, {loop_samples} samples ({loop_samples / total:.0%})")  # fmt: skip
    by_reason = collections.Counter()
    by_opcode = collections.Counter()
    count_opcode = collections.Counter()
    for r in loop:
        by_reason.update(r.stalls)
        by_opcode[r.opcode] += r.samples
        count_opcode[r.opcode] += 1
    print("\nhot-loop samples by stall reason:")
    for reason, n in by_reason.most_common():
        if n:
            print(f"  {reason:60s} {n:8d} {n / max(loop_samples, 1):6.1%}")
    print("\nhot-loop samples by opcode (instructions of that opcode in the loop):")
    for op, n in by_opcode.most_common():
        print(f"  {op:12s} {n:8d} {n / max(loop_samples, 1):6.1%}  ({count_opcode[op]})")
    regions([r for r in loop if r.executed < hot])
    print(f"\nthe {top} most-sampled hot-loop instructions, in program order:")
    chosen = sorted(sorted(loop, key=lambda r: -r.samples)[:top], key=lambda r: int(r.address, 16))
    for r in chosen:
        reasons = ", ".join(
            f"{k.replace('stall_', '')}={v}"
            for k, v in sorted(r.stalls.items(), key=lambda x: -x[1])
            if v
        )[:140]
        print(
            f"  {r.address} {r.samples:6d} x{r.executed:<8d} {r.source.strip()[:60]:60s} {reasons}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("--case", default="phoenix")
    p_run.add_argument("--no-cap", action="store_true")
    p_an = sub.add_parser("analyse")
    p_an.add_argument("csv")
    p_an.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.command == "run":
        run(args.case, args.no_cap)
    else:
        analyse(args.csv, args.top)


if __name__ == "__main__":
    main()
