"""The TPU ranker benchmark suite: ``attn bench ranker`` on a TPU, or ``python -m
attn_pallas_tpu.bench_ranker`` (the same flags; ``benchmarks/tpu_run.sh`` runs it after
the TPU tests with ``SUITES="sparse-mla ranker"``). The measurements docs/tpu_ranker.md's
targets are stated in.

Cases: ``attn_common.RANKER_SUITE`` at full batch, bf16, each case's own cap, with the
tiling ``config=None`` runs (``ranker_tuning.config_for``: a tuned table's, else
``ranker_config.default_config``). Modes: ``fwd`` (the jitted op) and ``fwd+bwd`` (the
jitted ``jax.grad`` of ``sum(out * dout)`` w.r.t. q, k, v). Every row is timed as
``bench_sparse_mla``'s (``attn_pallas_tpu._timing``): ``ms``, wall clock, median of
``--iterations`` waited calls after a warm-up; ``queued_ms``, wall clock per call of
calls issued back to back with one wait (``_timing.queued_ms``); ``device_ms``, the
call's spans on the TPU in a ``jax.profiler`` trace; ``kernel_device_ms``, its Pallas
kernels' share; ``xla_ops_ms``, the XLA ops around them that took longest. ``tflops``
counts allowed (query, key) pairs only (``attn_common.ranker_flops``; forward +
backward 3.5x the forward, the project's convention) over ``device_ms`` where the
trace has it (wall clock otherwise: ``tflops_basis``); ``peak_fraction`` sets it
against the bf16 matmul rate measured in the same run (an 8192^3 product) and
``chip_peak_fraction`` against the chip's datasheet bf16 peak (``plan.TPU_CHIPS``, the
figure docs/tpu_ranker.md's targets use). ``model_ms``
is ``ranker_model.predict``'s time for the same tiling on this chip (the cost model's
assumption, next to the measurement). ``xla_ms`` / ``xla_device_ms``: the reference
(``attn_reference``, dense scores) on the same inputs where it fits (``None`` and
``xla_error`` where it does not), and ``err``, the rel L2 of out and LSE (forward) or
dq, dk, dv (gradients) against it.

``packed`` rows (cases with ragged users): the same users packed several to a row
(``attn_common.packing.pack_users``, bounds ``[R, U, 4]``), against the padded
one-user-a-row layout; ``per_user_us`` on both rows compares them.

``--sweep`` also times every ``(block_q, block_kv)`` of ``ranker_config.BLOCK_CHOICES``
whose VMEM model (``vmem_bytes``, all three kernels) fits ``VMEM_LIMIT_BYTES``, forward
and forward + backward, each with the model's prediction (rows with ``sweep: true``):
the data an ``attn tune`` twin for the TPU and a refit of the cost model need.
``--modes`` restricts the rows to ``fwd`` or ``fwd+bwd`` (a sweep of every case and both
modes is ~200 compiles: split it over calls with ``--cases`` / ``--modes``).
``--smoke`` runs tiny cases in interpret mode (any machine); without it the default
device must be a TPU. Writes ``tpu_ranker.json`` (top-level ``commit``, ``device``,
``jax``, ``matmul_tflops``) and ``.md`` (and ``.svg`` with matplotlib) under ``--out``.
Exit status 1 when a case failed (failed sweep rows do not count).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import attn_pallas_tpu as tpu
from attn_common import KernelConfig
from attn_common.cap import CapMethod, CapParams
from attn_common.dispatch import load_backend
from attn_common.packing import pack_users
from attn_common.ranker import ranker_flops
from attn_common.suite import RANKER_SUITE, RankerCase, ranker_case
from attn_pallas_tpu import _suite, ranker_tuning
from attn_pallas_tpu._prep import default_chip
from attn_pallas_tpu._timing import matmul_tflops, rel_l2, timed
from attn_pallas_tpu.ranker_config import (
    BLOCK_CHOICES,
    VMEM_LIMIT_BYTES,
    vmem_bytes,
)

RESULT = "tpu_ranker"
MODES = ("fwd", "fwd+bwd")

CASES: tuple[RankerCase, ...] = RANKER_SUITE
SMOKE_CASES: tuple[RankerCase, ...] = (
    RankerCase(
        "phoenix-smoke",
        2,
        256,
        4,
        2,
        128,
        (0, 192),
        (192, 256),
        CapParams(CapMethod.SOFT_SIGN, 80.0),
    ),
    RankerCase("small-d64-smoke", 2, 256, 2, 2, 64, (0, 128), (128, 256), CapParams()),
    # The suite's ragged case at 4 users (histories 889, 697, 584, 367: 3 packed rows,
    # one holding two) and one head.
    dataclasses.replace(ranker_case("ragged"), name="ragged-smoke", batch=4, q_heads=1, kv_heads=1),
)


# ------------------------------------------------------------------------------ inputs


def packed_inputs(case: RankerCase, seed: int = 0) -> dict:
    """The ragged case's users packed several to a row: ``bounds`` ``[R, U, 4]`` and
    random ``q, k, v, dout`` of ``R`` rows (``case.inputs``'s shapes), ``users``."""
    b = case.bounds(seed)
    packed = pack_users(b[:, 1] - b[:, 0], b[:, 3] - b[:, 2], seq_len=case.seq_len)
    rows = packed.bounds.shape[0]
    return {
        "arrays": case.scaled(rows).inputs(seed),
        "bounds": np.asarray(packed.bounds, np.int32),
        "users": case.batch,
    }


def allowed_flops(bounds, case: RankerCase, mode: str) -> float:
    """Allowed-pair FLOPs of one call (``attn_common.ranker_flops``; packed bounds count
    each user slot, empty slots none)."""
    flat = np.asarray(bounds).reshape(-1, 4)
    return ranker_flops(flat, case.q_heads, case.head_dim, backward=mode == "fwd+bwd")


def sweep_configs(case: RankerCase, limit: int = VMEM_LIMIT_BYTES) -> list[KernelConfig]:
    """Every ``(block_q, block_kv)`` of ``BLOCK_CHOICES`` whose VMEM model fits ``limit``
    for all three kernels at the case's head dim (bf16)."""
    return [
        KernelConfig(block_q=bq, block_kv=bkv)
        for bq, bkv in itertools.product(BLOCK_CHOICES, BLOCK_CHOICES)
        if max(vmem_bytes(bq, bkv, case.head_dim, jnp.bfloat16).values()) <= limit
    ]


# ------------------------------------------------------------------------------ the suite


class Runner(_suite.Runner):
    def __init__(self, args):
        super().__init__(args, result=RESULT, write_report=write_report)
        self.modes = tuple(getattr(args, "modes", None) or MODES)
        self.costs: dict = {}
        self.chip = default_chip()
        self.mxu = matmul_tflops(self.smoke)
        self.start(
            self.chip,
            matmul_tflops=self.mxu,
            chip_peak_tflops=self.chip.mxu_flops / 1e12,
            flop_convention="allowed pairs, attn_common.ranker_flops; fwd+bwd 3.5x fwd",
        )

    def fn(self, case: RankerCase, mode: str, impl: str, config=None):
        """The jitted call of ``mode`` on ``impl`` ("tpu" or "xla", the reference)."""
        if impl == "tpu":
            op = tpu.ranker_attention
            extra = dict(self.extra, **({"config": config} if config is not None else {}))
        else:  # the reference, through its front door (a backend imports no other)
            op, extra = load_backend("reference").ranker_attention, {}
        if mode == "fwd":
            return jax.jit(
                lambda q, k, v, b, do: op(q, k, v, b, cap=case.cap, return_lse=True, **extra)
            )

        def loss(q, k, v, b, do):
            out = op(q, k, v, b, cap=case.cap, **extra)
            return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def measure(self, case, mode, args, bounds, config=None) -> tuple[dict, object]:
        f = self.fn(case, mode, "tpu", config)
        got = f(*args)
        t = timed(f, *args, iterations=self.iterations)
        flops = allowed_flops(bounds, case, mode)
        ms = t["device_ms"] or t["ms"]
        tflops = flops / (ms * 1e-3) / 1e12
        row = {
            **t,
            "flops": flops,
            "tflops": tflops,
            "tflops_basis": "device" if t["device_ms"] else "wall",
            "peak_fraction": tflops / self.mxu,
            "chip_peak_fraction": tflops / (self.chip.mxu_flops / 1e12),
        }
        return row, got

    @staticmethod
    def config_for(case: RankerCase) -> KernelConfig:
        """The tiling ``config=None`` runs for the case (a tuned table's, else the
        default: ``ranker_tuning.config_for``)."""
        return ranker_tuning.config_for(
            seq_len=case.seq_len, head_dim=case.head_dim, dtype=jnp.bfloat16, cap=case.cap
        )

    def model_ms(self, case, config, mode) -> float | None:
        """``ranker_model.predict``'s ms for ``mode`` (one prediction per case and tiling:
        it counts the visits on the host, ~1 s at full batch)."""
        from attn_pallas_tpu.ranker_model import predict

        key = (case.name, config.block_q, config.block_kv)
        if key not in self.costs:
            try:
                self.costs[key] = predict(
                    case, self.chip, block_q=config.block_q, block_kv=config.block_kv
                )
            except Exception as e:  # the model is a side column; its failure costs no row
                print(f"model {case.name}: {_suite.error_line(e)}", flush=True)
                self.costs[key] = None
        cost = self.costs[key]
        if cost is None:
            return None
        return (cost.fwd_s if mode == "fwd" else cost.fwd_s + cost.bwd_s) * 1e3

    def xla(self, case, mode, args) -> tuple[dict, object]:
        """The reference's times and result, or ``None``s and the error (OOM: its dense
        scores at full batch may not fit the chip)."""
        try:
            f = self.fn(case, mode, "xla")
            want = f(*args)
            t = timed(f, *args, iterations=self.iterations)
            return {"xla_ms": t["ms"], "xla_device_ms": t["device_ms"]}, want
        except Exception as e:
            print(f"xla {case.name} {mode}: {_suite.error_line(e)}", flush=True)
            return {"xla_ms": None, "xla_device_ms": None, "xla_error": _suite.error_line(e)}, None

    def run_case(self, case: RankerCase) -> None:
        q, k, v, do = case.inputs(0)
        bounds = case.bounds(0)
        args = (q, k, v, jnp.asarray(bounds), do)
        config = self.config_for(case)
        base = dict(case=case.name, layout="padded", batch=case.batch, users=case.batch,
                    seq_len=case.seq_len, q_heads=case.q_heads, kv_heads=case.kv_heads,
                    head_dim=case.head_dim, cap=case.cap.method.value,
                    block_q=config.block_q, block_kv=config.block_kv)  # fmt: skip
        for mode in self.modes:
            self.one_row(case, mode, args, bounds, base, model_ms=self.model_ms(case, config, mode))
        if case.ragged:
            p = packed_inputs(case)
            pq, pk, pv, pdo = p["arrays"]
            pargs = (pq, pk, pv, jnp.asarray(p["bounds"]), pdo)
            pcfg = self.config_for(case)
            pbase = dict(base, layout="packed", batch=int(p["bounds"].shape[0]),
                         users=p["users"], users_per_row=int(p["bounds"].shape[1]),
                         block_q=pcfg.block_q, block_kv=pcfg.block_kv)  # fmt: skip
            for mode in self.modes:
                self.one_row(case, mode, pargs, p["bounds"], pbase, model_ms=None)
        if self.sweep:
            for cfg in sweep_configs(case):
                for mode in self.modes:
                    srow = dict(base, sweep=True, block_q=cfg.block_q, block_kv=cfg.block_kv,
                                model_ms=self.model_ms(case, cfg, mode), mode=mode)  # fmt: skip
                    try:
                        t, _ = self.measure(case, mode, args, bounds, cfg)
                        self.record(**srow, **t)
                    except Exception as e:
                        self.record(**srow, error=_suite.error_line(e))

    def one_row(self, case, mode, args, bounds, base, model_ms) -> None:
        xla, want = self.xla(case, mode, args)
        t, got = self.measure(case, mode, args, bounds)
        if want is None:
            err = None
        else:
            names = ("out", "lse") if mode == "fwd" else ("dq", "dk", "dv")
            err = {n: rel_l2(a, b) for n, a, b in zip(names, got, want, strict=True)}
        ms = t["device_ms"] or t["ms"]
        self.record(**base, mode=mode, **t, per_user_us=ms * 1e3 / base["users"],
                    model_ms=model_ms, **xla, err=err)  # fmt: skip


def _f(x) -> str:
    return "" if x is None else f"{x:.3g}"


# ------------------------------------------------------------------------------ reports


def write_report(result: dict, out: Path) -> Path:
    """``tpu_ranker.md``: the suite's rows, then the sweep's best tiling per case and
    mode (by device ms, wall clock where unprofiled)."""
    rows = [r for r in result["rows"] if not r.get("sweep")]
    lines = [
        "# TPU ranker attention: results",
        "",
        _suite.report_provenance(result, ".3g")
        + "measured in the same run. Medians: `wall ms` each call waited for, `queued ms` "
        "per call of calls issued back to back with one wait, `device ms` the call's "
        "spans on the chip (profiler), `kernel ms` its Pallas kernels. TFLOP/s "
        "on allowed pairs (`attn_common.ranker_flops`, fwd+bwd 3.5x) over device ms where "
        "measured (wall clock otherwise); `% peak` of the measured matmul rate, `% chip` of "
        f"the {result.get('chip')} datasheet bf16 peak "
        f"({_f(result.get('chip_peak_tflops'))} TFLOP/s); `model ms` the cost model's "
        "prediction (`ranker_model.predict`).",
        *(["", result["note"]] if result.get("note") else []),
        "",
        "| case | layout | mode | blocks | wall ms | queued ms | device ms | kernel ms | TFLOP/s "
        "| % peak | % chip | model ms | per user us | XLA device ms | x XLA | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | | {r.get('mode', '')} | | | | | | | | | | | | | "
                         f"{r['error']} |")  # fmt: skip
            continue
        ms = r.get("device_ms") or r.get("ms")
        xla = r.get("xla_device_ms") or r.get("xla_ms")
        err = r.get("err")
        err_s = ", ".join(f"{k} {v:.2g}" for k, v in err.items()) if err else ""
        if xla is None and r.get("xla_error"):
            err_s = f"XLA: {r['xla_error'][:60]}"
        if r.get("commit"):  # rows merged from several runs name their own
            err_s = f"commit {r['commit'][:7]}; {err_s}"
        peak, chip = r.get("peak_fraction"), r.get("chip_peak_fraction")
        lines.append(
            f"| {r['case']} | {r.get('layout', '')} | {r['mode']} | "
            f"{r.get('block_q')}x{r.get('block_kv')} | {_f(r.get('ms'))} | "
            f"{_f(r.get('queued_ms'))} | {_f(r.get('device_ms'))} | "
            f"{_f(r.get('kernel_device_ms'))} | "
            f"{_f(r.get('tflops'))} | {_f(None if peak is None else 100 * peak)} | "
            f"{_f(None if chip is None else 100 * chip)} | "
            f"{_f(r.get('model_ms'))} | {_f(r.get('per_user_us'))} | {_f(xla)} | "
            f"{_f(xla / ms if ms and xla else None)} | {err_s} |"
        )
    sweep = [r for r in result["rows"] if r.get("sweep") and "error" not in r]
    if sweep:
        lines += ["", "## Sweep: best tiling", "",
                  "| case | mode | best blocks | device ms | default blocks | default ms "
                  "| tilings timed |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for (case, mode), group in _groups(sweep).items():
            best = min(group, key=lambda r: r.get("device_ms") or r["ms"])
            default = next((r for r in rows if r["case"] == case and r.get("mode") == mode
                            and r.get("layout") == "padded"), {})  # fmt: skip
            lines.append(
                f"| {case} | {mode} | {best['block_q']}x{best['block_kv']} | "
                f"{_f(best.get('device_ms') or best['ms'])} | "
                f"{default.get('block_q')}x{default.get('block_kv')} | "
                f"{_f(default.get('device_ms') or default.get('ms'))} | {len(group)} |"
            )
    return _suite.write_markdown(out, RESULT, lines)


def _groups(rows) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault((r["case"], r["mode"]), []).append(r)
    return out


def write_plot(result: dict, path: Path) -> bool:
    """``tpu_ranker.svg``: per case and mode the kernels' fraction of the measured matmul
    rate (padded and packed layouts); ``False`` without matplotlib."""
    plt = _suite.pyplot()
    if plt is None:
        return False
    rows = [r for r in result["rows"] if not r.get("sweep") and r.get("peak_fraction")]
    labels = list(dict.fromkeys(f"{r['case']} {r['mode']}" for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    for j, (layout, color) in enumerate((("padded", "#1f77b4"), ("packed", "#ff7f0e"))):
        for i, label in enumerate(labels):
            r = next((r for r in rows if f"{r['case']} {r['mode']}" == label
                      and r.get("layout") == layout), None)  # fmt: skip
            if r:
                ax.bar(i + (j - 0.5) * width, 100 * r["peak_fraction"], width, color=color,
                       label=layout if i == 0 or layout == "packed" else None)  # fmt: skip
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("% of measured bf16 matmul rate (allowed pairs)")
    ax.set_title(f"TPU ranker attention on {result.get('device')} "
                 f"({str(result.get('commit', ''))[:7]})")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's flags (``python -m attn_pallas_tpu.bench_ranker`` and ``attn bench
    ranker`` on a TPU take the same)."""
    _suite.add_common_arguments(
        parser, sweep_help="also time every (block_q, block_kv) that fits VMEM"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="what to time: fwd and/or fwd+bwd (default: both)",
    )


SUITE = _suite.Suite.of(globals())
check_args, run, main = _suite.check_args, SUITE.run, SUITE.main


if __name__ == "__main__":
    raise SystemExit(main())
