"""Where the TPU ranker kernels' time goes: each kernel with its step body cut down.

For a TPU machine (one chip). At the ranker suite's full batches and shipped tilings
(``attn_common.RANKER_SUITE``, bf16, each case's cap; ``ragged-packed``: the ragged case's
users packed several to a row), the device time of each Pallas kernel (profiler) with
its per-step body

* ``full``: the kernel as shipped;
* ``mxu``: the matrix products alone (the forward's ``Q K^T`` and ``P V``; dq's three
  and dk/dv's four), their operands cast to bf16 as the kernel does, the backward's
  ``dS`` one add of its two products: what the MXU work costs on these tiles;
* ``vpu`` (forward only): the score chain alone, no product: logits from q's first lane
  plus a ramp, then the cap, the mask on masked steps, ``exp2``, the row sum and the
  bf16 cast: what the VPU / EUP work costs;
* ``grid``: nothing but one vector add: the grid's steps and the pipeline's DMAs.

Only the per-step body is cut: every variant keeps each program's ``init`` and
``finish`` (the forward's row offsets, normalisation and LSE transpose; the backward's
accumulator zeroing and write-back), so a floor is that work plus the cut step.

Against these the measured kernel says which unit bounds it (docs/tpu_ranker.md, "Where
the time goes"). Also XLA's batched bf16 matmuls at the forward's tile shapes
(``[N, t, D] x [N, t, D]^T`` and ``[N, t, t] x [N, t, D]``, D 64 and 128).

The variants are built here by patching the kernels' source text into separate modules
(the package has no such knob); an anchor that a kernel change moves fails loudly.

    python benchmarks/tpu_ranker_floors.py --out $OUT [--cases phoenix long] [--smoke]
    python benchmarks/tpu_ranker_floors.py --out DIR --merge RUN0.json RUN1.json

(with ``common/src``, ``packages/attn-reference/src`` and ``packages/attn-pallas-tpu/src``
on ``PYTHONPATH``, as ``benchmarks/tpu_run.sh`` sets it). ``--smoke``: two-row cases in
interpret mode, any machine (no times). Writes ``<out>/tpu_ranker_floors.{json,md}``;
``--merge`` writes them from several runs' JSON, a later run's cases replacing an earlier's.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

FWD_STEP = "        def step(i, j, steps, bounds, masked: bool):\n"
FWD_LOAD = FWD_STEP + "            k, v = k_ref[...], v_ref[...]\n"
DKV_LOAD = (
    "        def step(t, s, steps, bounds, masked: bool):\n"
    "            k, v = k_ref[...], v_ref[...]\n"
)
FWD_FLOORS = """
            if FLOOR == "mxu":
                for g in range(heads):
                    s = dot(q_ref[head_of(st, g)], k, trans_b=True)
                    acc_sc[g] = acc_sc[g] + dot(s.astype(v.dtype), v)
                return
            if FLOOR == "vpu":
                ramp = lax.broadcasted_iota(jnp.int32, (bq, st.block_kv), 1)
                ramp = ramp.astype(jnp.float32) * 1e-3
                if masked:
                    kv0 = steps.block_at(j) * st.block_kv
                    allowed = tile_mask(bounds, i * bq, kv0, (bq, st.block_kv), q_axis=0)
                for g in range(heads):
                    s = scaled_capped(q_ref[head_of(st, g)][:, :1].astype(jnp.float32) + ramp, st)
                    if masked:
                        s = jnp.where(allowed, s, -jnp.inf)
                    off = offset if softmax == "fixed" else m_sc[g][:, :1]
                    p = jnp.exp2(s - off)
                    l_sc[g] = l_sc[g] + jnp.sum(p, axis=1, keepdims=True)
                    pb = p.astype(v.dtype)[:, : st.head_dim]
                    acc_sc[g] = acc_sc[g] + pb.astype(jnp.float32)
                return
"""
DQ_FLOORS = """
            if FLOOR == "mxu":
                for g in range(heads):
                    raw = dot(q_ref[head_of(st, g)], k, trans_b=True)
                    dp = dot(do_ref[head_of(st, g)], v, trans_b=True)
                    acc[g] += dot((raw + dp).astype(k.dtype), k)
                return
"""
DKV_FLOORS = """
            if FLOOR == "mxu":
                for g in range(heads):
                    q, do = q_ref[head_of(st, g)], do_ref[head_of(st, g)]
                    raw = dot(k, q, trans_b=True)
                    dp = dot(v, do, trans_b=True)
                    dv_acc[...] += dot(raw.astype(do.dtype), do)
                    dk_acc[...] += dot((raw + dp).astype(q.dtype), q)
                return
"""
FWD_VARIANTS = ("full", "mxu", "vpu", "grid")
BWD_VARIANTS = ("full", "mxu", "grid")


def grid_floor(target: str) -> str:
    return f'            if FLOOR == "grid":\n                {target} += 1.0\n                return\n'


def patched(name: str, edits: list[tuple[str, str]]) -> types.ModuleType:
    """Module ``name`` re-executed from its source with each ``(anchor, replacement)``
    applied once (each anchor must occur exactly once), and a module global ``FLOOR``."""
    source = inspect.getsource(importlib.import_module(name))
    for anchor, new in edits:
        if source.count(anchor) != 1:
            raise RuntimeError(f"{name}: anchor found {source.count(anchor)} times:\n{anchor}")
        source = source.replace(anchor, new)
    module = types.ModuleType(f"{name}_floors")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    module.FLOOR = "full"
    exec(compile(source, f"<{name}, floors>", "exec"), module.__dict__)
    return module


def floor_modules() -> tuple[types.ModuleType, types.ModuleType]:
    fwd = patched(
        "attn_pallas_tpu.ranker_fwd",
        [
            (
                FWD_LOAD,
                FWD_STEP + grid_floor("l_sc[0]") + FWD_LOAD.removeprefix(FWD_STEP) + FWD_FLOORS,
            )
        ],
    )
    bwd = patched(
        "attn_pallas_tpu.ranker_bwd",
        [
            (FWD_LOAD, FWD_STEP + grid_floor("acc[0]") + FWD_LOAD.removeprefix(FWD_STEP) + DQ_FLOORS),
            (DKV_LOAD, DKV_LOAD.split("\n")[0] + "\n" + grid_floor("dk_acc[...]")
             + DKV_LOAD.split("\n", 1)[1] + DKV_FLOORS),
        ],
    )  # fmt: skip
    return fwd, bwd


def case_inputs(name: str, smoke: bool):
    from attn_common import RANKER_SUITE
    from attn_pallas_tpu.bench_ranker import packed_inputs

    case = {c.name: c for c in RANKER_SUITE}[name.removesuffix("-packed")]
    case = case.scaled(2) if smoke else case
    if name.endswith("-packed"):
        p = packed_inputs(case)
        q, k, v, do = p["arrays"]
        return case, (q, k, v, jnp.asarray(p["bounds"]), do)
    q, k, v, do = case.inputs(0)
    return case, (q, k, v, jnp.asarray(case.bounds(0)), do)


def pallas_kernels(ops: list, n: int) -> list[list]:
    """The ``n`` longest of ``[[name, ms], ...]`` custom calls (the Pallas kernels: a call
    may hold other, microsecond custom calls), in trace order."""
    top = sorted(range(len(ops)), key=lambda i: -ops[i][1])[:n]
    return [ops[i] for i in sorted(top)]


def backward_kernels(ops: list) -> dict:
    """``{"dq": ms, "dk/dv": ms}`` of a backward call's two kernels, told apart by their
    results: dk/dv's is a tuple (``= (`` in the HLO text), dq's one array. XLA may
    schedule either first."""
    kernels = pallas_kernels(ops, 2)
    pairs = [
        name.split(" custom-call(")[0].split(" = ", 1)[1].startswith("(") for name, _ in kernels
    ]
    if sorted(pairs) != [False, True]:
        raise RuntimeError(f"cannot tell dq from dk/dv: {[name for name, _ in kernels]}")
    return {("dk/dv" if pair else "dq"): ms for pair, (_, ms) in zip(pairs, kernels, strict=True)}


def kernel_ops(fn, args, smoke: bool) -> list | None:
    """``fn``'s custom calls, ``[[name, device ms per call], ...]`` in trace order
    (profiler); None in smoke (interpret mode has no device trace)."""
    from attn_pallas_tpu._timing import device_ms

    jax.block_until_ready(fn(*args))
    if smoke:
        return None
    return device_ms(fn, *args, iterations=5)["kernel_ops_ms"]


def forward_args(fwd, q, k, v, bounds, *, cap, config):
    """``(static, args)`` of the forward kernel's ``_fwd_padded(*args, st=static)`` as
    ``kernel_forward`` builds them: q, k, v in the kernel layout, the clipped bounds and
    the row softmax's key norms (else ``None``)."""
    problem, st, clipped = fwd.prepare(q, k, v, bounds, sm_scale=None, cap=cap, config=config)
    rows = fwd.q_rows(st, problem.seq_len)
    kmax = fwd.attended_key_norms(k, clipped, rows) if st.softmax == "row" else None
    layout = (fwd.to_kernel_layout(q, st, rows), fwd.to_kernel_layout(k, st),
              fwd.to_kernel_layout(v, st))  # fmt: skip
    return st, (*layout, clipped, kmax)


def run_case(name: str, fwd, bwd, smoke: bool, emit) -> None:
    from attn_pallas_tpu.bench_ranker import Runner, allowed_flops
    from attn_pallas_tpu.ranker_model import visit_counts

    case, (q, k, v, bounds, do) = case_inputs(name, smoke)
    config = Runner.config_for(case)
    interpret = fwd.resolve_interpret(True) if smoke else False
    st, fargs = forward_args(fwd, q, k, v, bounds, cap=case.cap, config=config)
    clipped = fargs[3]
    out, lse = fwd.kernel_forward(q, k, v, bounds, sm_scale=None, cap=case.cap, config=config,
                                  interpret=interpret)  # fmt: skip
    base = dict(case=name, block_q=config.block_q, block_kv=config.block_kv,
                heads_per_program=st.heads_per_program, softmax=st.softmax,
                layout="[B, S, H*D]" if st.flat else "[B, H, S, D]",
                allowed_flops_fwd=allowed_flops(np.asarray(bounds), case, "fwd"))  # fmt: skip
    if bounds.ndim == 2:
        counts = visit_counts(np.asarray(clipped), seq_len=case.seq_len, q_heads=case.q_heads,
                              kv_heads=case.kv_heads, block_q=config.block_q,
                              block_kv=config.block_kv, heads=st.heads_per_program)  # fmt: skip
        pairs = config.block_q * config.block_kv * 4 * case.head_dim
        base.update(visited_flops_fwd=counts.fwd * pairs, visited_steps=counts.fwd,
                    masked_steps=counts.fwd_masked)  # fmt: skip
    for variant in FWD_VARIANTS:
        fwd.FLOOR = variant
        jax.clear_caches()
        ops = kernel_ops(lambda *a: fwd._fwd_padded(*a, st=st, interpret=interpret), fargs, smoke)
        emit(**base, kernel="fwd", floor=variant, ms=pallas_kernels(ops, 1)[0][1] if ops else None)
    bwd_call = bwd.ranker_attention_bwd
    for variant in BWD_VARIANTS:
        bwd.FLOOR = variant
        jax.clear_caches()
        ops = kernel_ops(
            lambda q, k, v, b, o, l, do: bwd_call(q, k, v, b, o, l, do, cap=case.cap,
                                                  config=config, interpret=interpret),
            (q, k, v, bounds, out, lse, do), smoke,
        )  # fmt: skip
        ms = backward_kernels(ops) if ops else {}
        for kernel in ("dq", "dk/dv"):
            emit(**base, kernel=kernel, floor=variant, ms=ms.get(kernel))
    fwd.FLOOR = bwd.FLOOR = "full"


def xla_matmuls(emit) -> None:
    from attn_pallas_tpu._timing import device_ms

    def qk(a, b):
        return jnp.einsum("nqd,nkd->nqk", a, b, preferred_element_type=jnp.float32).astype(a.dtype)

    def pv(p, b):
        return jnp.einsum("nqk,nkd->nqd", p, b, preferred_element_type=jnp.float32).astype(p.dtype)

    for d in (64, 128):
        for t in (384, 640):
            n = max(1, 2**30 // (t * t * d * 4))
            keys = jax.random.split(jax.random.PRNGKey(0), 3)
            a, b = (jax.random.normal(key, (n, t, d), jnp.bfloat16) for key in keys[:2])
            p = jax.random.normal(keys[2], (n, t, t), jnp.bfloat16)
            for op, f, args in (("qk", qk, (a, b)), ("pv", pv, (p, b))):
                ms = device_ms(jax.jit(f), *args, iterations=5)["device_ms"]
                emit(kernel="xla matmul", op=op, head_dim=d, tile=t, batch=n, ms=ms,
                     tflops=2 * n * t * t * d / ms / 1e9)  # fmt: skip


def merge(paths: list[Path]) -> dict:
    """One result from several runs' JSON: a later run's rows replace an earlier run's
    rows of the same case (the XLA matmuls count as one case); each row keeps its run's
    matmul rate, and ``runs`` lists every run's provenance and rate."""
    runs, rows = [], []
    for i, path in enumerate(paths):
        run = json.loads(Path(path).read_text())
        runs.append({k: v for k, v in run.items() if k not in ("rows", "runs")})
        new = [dict(r, run=i, matmul_tflops=run["matmul_tflops"]) for r in run["rows"]]
        cases = {r.get("case", "xla matmul") for r in new}
        rows = [r for r in rows if r.get("case", "xla matmul") not in cases] + new
    return {"runs": runs, "device": runs[-1]["device"], "jax": runs[-1]["jax"], "rows": rows}


def write_markdown(result: dict, out: Path) -> None:
    runs = result.get("runs", [result])
    lines = [
        "# TPU ranker kernels: floors",
        "",
        f"Device {result['device']}, jax {result['jax']}. "
        + " ".join(
            f"Run {i}: commit {run['commit']}, `{run['command']}`, {run['date']}, bf16 "
            f"matmul {run['matmul_tflops']:.1f} TFLOP/s measured in the same run."
            for i, run in enumerate(runs)
        )
        + " Kernel device ms (profiler, median of 5 calls) with the step body cut to its "
        "matrix products (mxu), its score chain (vpu, forward only) or nothing (grid: the "
        "grid's steps and DMAs); every variant keeps each program's init and finish; `% rate` the kernel's allowed-pair FLOPs over its time "
        "as a share of its run's matmul rate (dq 1.5x and dk/dv 2x the forward's FLOPs: "
        "3 and 4 products a pair against 2), `visited %` the same on the pairs the forward's "
        "and dq's tiles visit.",
        "",
        "| case | tiling | kernel | full | mxu | vpu | grid | full % rate | mxu % rate "
        "| full visited % | mxu visited % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {}
    for r in result["rows"]:
        if r["kernel"] != "xla matmul":
            by.setdefault((r["case"], r["kernel"]), {})[r["floor"]] = r
    for (case, kernel), floors in by.items():
        r = floors["full"]
        ms = {f: floors[f]["ms"] for f in floors}
        rate = r.get("matmul_tflops") or result["matmul_tflops"]

        def pct(flops, f, ms=ms, rate=rate):
            t = ms.get(f)
            return f"{100 * flops / (t * 1e9) / rate:.1f}" if flops and t else ""

        products = {"fwd": 1.0, "dq": 1.5, "dk/dv": 2.0}[kernel]  # 2, 3, 4 products a pair
        allowed = r["allowed_flops_fwd"] * products
        # dq walks the forward's visits; dk/dv its own (kv tile, q block) ones: not counted
        visited = kernel != "dk/dv" and r.get("visited_flops_fwd", 0) * products
        cells = [f"{ms[f]:.2f}" if ms.get(f) else "" for f in ("full", "mxu", "vpu", "grid")]
        pcts = [
            pct(allowed, "full"),
            pct(allowed, "mxu"),
            pct(visited, "full"),
            pct(visited, "mxu"),
        ]
        lines.append(
            f"| {case} | {r['block_q']} x {r['block_kv']}, {r['heads_per_program']} heads, "
            f"{r['layout']} | {kernel} | " + " | ".join(cells) + " | "
            + " | ".join(pcts) + " |"
        )  # fmt: skip
    lines += ["", "| XLA batched matmul | head dim | tile | ms | TFLOP/s | % rate |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if r["kernel"] == "xla matmul":
            rate = r.get("matmul_tflops") or result["matmul_tflops"]
            lines.append(f"| {r['op']} | {r['head_dim']} | {r['tile']} | {r['ms']:.4f} | "
                         f"{r['tflops']:.1f} | {100 * r['tflops'] / rate:.1f} |")  # fmt: skip
    (out / "tpu_ranker_floors.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    from attn_common.cli_args import provenance
    from attn_pallas_tpu._timing import matmul_tflops

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="+",
                        default=["phoenix", "long", "small-d64", "ragged", "ragged-packed"])  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="two-row cases, interpret mode")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="RUN_JSON",
                        help="write one report from these runs' JSON (later runs' cases win)")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merged = merge(args.merge)
        (args.out / "tpu_ranker_floors.json").write_text(json.dumps(merged, indent=1))
        write_markdown(merged, args.out)
        return
    result = {
        **provenance(argv),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "matmul_tflops": matmul_tflops(args.smoke),
        "rows": [],
    }

    def emit(**row):
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        (args.out / "tpu_ranker_floors.json").write_text(json.dumps(result, indent=1))
        write_markdown(result, args.out)

    fwd, bwd = floor_modules()
    if not args.smoke:
        xla_matmuls(emit)
    for name in args.cases:
        run_case(name, fwd, bwd, args.smoke, emit)


if __name__ == "__main__":
    main()
