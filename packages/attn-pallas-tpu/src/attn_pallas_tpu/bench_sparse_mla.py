"""The TPU sparse-MLA benchmark suite: ``attn bench sparse-mla`` on a TPU, or ``python
-m attn_pallas_tpu.bench_sparse_mla`` (the same flags; ``benchmarks/tpu_run.sh`` runs it
after the TPU tests).

Every row is timed in one run, three ways, after a warm-up: ``ms``, wall clock with each
call waited for, the median of ``--iterations`` calls (on the v5e machine even a jitted
``x + 1`` takes 0.6 ms waited: the host round trip); ``queued_ms``, wall clock per call of
calls issued back to back for about 100 ms (at least 5) with one wait (as a training
or serving loop dispatches them: the round trip paid once, spread over the calls; the
median of 3 such samples for calls under 20 ms); and
``device_ms``, the median of the call's spans on the TPU in a ``jax.profiler`` trace
(what a layer inside a larger jitted step costs), with ``kernel_device_ms``, the share
of its Pallas kernels, and ``xla_ops_ms``, the XLA ops around them that took longest
(name and ms per call: what the rest of the call is).
q and the cache reach the jitted call row-major (``row_major``), as arrays made inside a
step do, not in the layout the runtime gives a fresh ``[1, T, 576]`` array (``T``
minor on a v5e, which each call would relay out first); the eager row keeps them as made.
Both are set against the XLA reference on the same inputs where it fits, and against
the chip's bound, computed in the same run:

* ``bytes``: the HBM bytes the kernel must read (each selected unit's rows once per query
  for the per-query kernel; the block unions for the query-blocked one) at the chip's
  HBM rate (819 GB/s on a v5e, its datasheet rate);
* ``mxu``: the matrix work at the bf16 matmul rate measured in the same run (an 8192^3
  product): useful work (valid query-key pairs) and, for the query-blocked kernel, the
  masked work it computes (block union tokens x ``QB * H`` score rows).

Cases (``CASES``; selections from ``attn_common.picks``, whose docstring documents the
overlapping family's parameters):

* ``prefill-random-u{16,32,64}-h{16,64}``: 1024 queries at the end of a 32K flat cache,
  each selecting 2048 tokens as units of 16 / 32 / 64 uniformly at random;
* ``prefill-overlap-u64-h{4,16,64}``: 2048 queries at the end of a 110,592-token flat
  cache, 32 units of 64 each, overlapping picks;
* ``decode-u64-h{16,64}``: ragged paged, 64 requests x 2 tokens, each request 32K tokens,
  each token 32 pages of 64 (random), the pool holding every request's pages;
* ``decode-pool-{1,8}x``: 8 requests x 2 tokens over a pool of 4,096 pages and one 8x
  larger: the time must not follow the pool;
* ``train-random-u64-h16`` / ``train-overlap-u64-h16``: ``jax.grad`` of a loss on out and
  LSE w.r.t. q and the cache, against XLA's gradient of the reference;
* ``eager-overlap-u64-h16``: the query-blocked front door called with host-value inputs
  against the same call under ``jit``, given device arrays (``jit_ms``) and given the
  same host values (``jit_host_args_ms``: the same transfers). ``ms`` is a call after
  the shape's first (its tiling is kept), ``host_ms`` its time past the jitted call
  given host values; ``first_call_ms`` is a shape's first call (host planning on the
  counts, then the planned kernel), ``first_host_ms`` its time past the same.

``--sweep`` runs the cost model's cells instead (``SWEEP_CASES``: prefill with random
and overlapping picks at units of 16-128 and H 4-128, decode, training): per cell every
tiling the automatic plan chooses among, each row with the model's counted terms
(:func:`sweep_tilings`), then the front door's own jitted call, into
``tpu_sparse_mla_sweep.json`` and ``.md``; ``python -m attn_pallas_tpu.fit_plan`` fits
the model (``attn_pallas_tpu.plan``) to them and scores the plan.

``--smoke`` runs tiny shapes in interpret mode (any machine); without it the default
device must be a TPU. Writes ``tpu_sparse_mla.json``
(rows with ``kernel``, ``mode``, ``picks``, ``unit``, ``heads``, ``ms``, ``bound_ms``,
``xla_ms``; top-level ``commit``, ``device``) and ``.md`` (and ``.svg`` with matplotlib)
under ``--out``. Exit status 1 when a case failed (sweep rows that failed do not count:
some tilings do not fit a chip).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

import attn_pallas_tpu as tpu
from attn_common import padded_dk
from attn_common.dispatch import load_backend
from attn_common.picks import decode_picks, overlapping_picks, random_picks
from attn_common.tables import kv_packing
from attn_pallas_tpu import _suite
from attn_pallas_tpu._prep import default_chip
from attn_pallas_tpu._timing import matmul_tflops, rel_l2, timed, wall_ms
from attn_pallas_tpu.config import (
    MAX_ROWS,
    MAX_UNITS_PER_STEP,
    SparseMlaConfig,
    default_config,
)
from attn_pallas_tpu.plan import (
    AUTO_QUERY_BLOCKS,
    MIN_SHARING,
    PlanShape,
    choose_plan,
    describe_plan,
    host_distinct_units,
    host_union_sizes,
    per_query_bytes,
    per_query_terms,
    qblock_bytes,
    qblock_terms,
    static_qblock_config,
    widest_head_group,
)
from attn_pallas_tpu.sparse_mla_qblock import _EAGER_PLANS

DK, DV = 576, 512
SM_SCALE = 1.0 / math.sqrt(192.0)
RESULT = "tpu_sparse_mla"
SWEEP_RESULT = "tpu_sparse_mla_sweep"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mode: str  # "prefill" | "decode" | "train" | "eager"
    picks: str  # "random" | "overlapping" | "decode"
    unit: int
    heads: int
    queries: int  # flat: queries at the end of the cache; paged: requests x tokens
    kv_len: int  # flat: cache tokens; paged: tokens per request
    top_k_tokens: int
    requests: int = 0  # paged only
    pool_pages: int = 0  # paged: physical pages (>= the requests' pages)

    @property
    def top_k(self) -> int:
        return self.top_k_tokens // self.unit

    @property
    def paged(self) -> bool:
        return self.requests > 0


def _cases() -> tuple[Case, ...]:
    out = []
    for unit in (16, 32, 64):
        for h in (16, 64):
            out.append(Case(f"prefill-random-u{unit}-h{h}", "prefill", "random", unit, h,
                            1024, 32768, 2048))  # fmt: skip
    for h in (4, 16, 64):
        out.append(Case(f"prefill-overlap-u64-h{h}", "prefill", "overlapping", 64, h, 2048,
                        110592, 2048))  # fmt: skip
    for h in (16, 64):
        out.append(Case(f"decode-u64-h{h}", "decode", "random", 64, h, 128, 32768, 2048,
                        requests=64, pool_pages=64 * 512))  # fmt: skip
    for grow in (1, 8):
        out.append(Case(f"decode-pool-{grow}x", "decode", "random", 64, 16, 16, 32768, 2048,
                        requests=8, pool_pages=8 * 512 * grow))  # fmt: skip
    out.append(Case("train-random-u64-h16", "train", "random", 64, 16, 1024, 32768, 2048))
    out.append(Case("train-overlap-u64-h16", "train", "overlapping", 64, 16, 2048, 110592, 2048))
    out.append(Case("eager-overlap-u64-h16", "eager", "overlapping", 64, 16, 2048, 110592, 2048))
    return tuple(out)


CASES = _cases()


def _sweep_cases() -> tuple[Case, ...]:
    """The cost model's cells (``--sweep``), most telling first (a cut run keeps its
    rows): overlapping and random prefill at units of 16-128 and H 4-128, decode, and
    training steps. Shapes as the suite's."""
    cells = []
    for picks, unit, h in (("overlapping", 64, 16), ("random", 64, 16), ("overlapping", 64, 4),
                           ("overlapping", 64, 64), ("random", 16, 16), ("random", 32, 64),
                           ("overlapping", 32, 16), ("overlapping", 128, 16),
                           ("random", 128, 64), ("overlapping", 64, 128), ("random", 64, 128),
                           ("random", 64, 4), ("overlapping", 16, 16)):  # fmt: skip
        q, kv_len = (2048, 110592) if picks == "overlapping" else (1024, 32768)
        name = f"prefill-{picks[:7]}-u{unit}-h{h}"
        cells.append(Case(name, "prefill", picks, unit, h, q, kv_len, 2048))
    for unit, h in ((64, 16), (64, 128), (32, 64), (128, 16)):
        cells.append(Case(f"decode-u{unit}-h{h}", "decode", "random", unit, h, 128, 32768, 2048,
                          requests=64, pool_pages=64 * (32768 // unit)))  # fmt: skip
    for picks, h in (("overlapping", 16), ("random", 16), ("overlapping", 64)):
        q, kv_len = (2048, 110592) if picks == "overlapping" else (1024, 32768)
        cells.append(Case(f"train-{picks[:7]}-u64-h{h}", "train", picks, 64, h, q, kv_len, 2048))
    return tuple(cells)


SWEEP_CASES = _sweep_cases()
SWEEP_SMOKE_CASES = (
    Case("prefill-overlap-smoke", "prefill", "overlapping", 16, 2, 16, 256, 64),
    Case("decode-smoke", "decode", "random", 16, 2, 4, 256, 64, requests=2, pool_pages=40),
    Case("train-overlap-smoke", "train", "overlapping", 16, 2, 16, 256, 64),
)
SMOKE_CASES = (
    Case("prefill-random-smoke", "prefill", "random", 16, 2, 16, 256, 64),
    Case("prefill-overlap-smoke", "prefill", "overlapping", 16, 2, 16, 256, 64),
    Case("decode-smoke", "decode", "random", 16, 2, 4, 256, 64, requests=2, pool_pages=40),
    Case("train-random-smoke", "train", "random", 16, 2, 8, 256, 64),
    Case("eager-overlap-smoke", "eager", "overlapping", 16, 2, 16, 256, 64),
)


# ------------------------------------------------------------------------------ inputs


def make_inputs(case: Case, seed: int = 0) -> dict:
    """``args`` / ``kwargs`` of ``sparse_mla_attention`` and the host-side ``idx``."""
    rng = np.random.default_rng(seed)
    k_q, k_kv = jax.random.split(jax.random.PRNGKey(seed))
    q = jax.random.normal(k_q, (1, case.queries, case.heads, DK), jnp.bfloat16)
    kw = {"sm_scale": SM_SCALE, "kv_lora_rank": DV, "read_block": case.unit}
    if not case.paged:
        pos = np.arange(case.kv_len - case.queries, case.kv_len, dtype=np.int32)
        pick = overlapping_picks if case.picks == "overlapping" else random_picks
        idx = pick(rng, pos, unit=case.unit, k=case.top_k)
        kv = jax.random.normal(k_kv, (1, case.kv_len, DK), jnp.bfloat16)
        args = (q, kv, jnp.asarray(idx)[None], jnp.asarray(pos)[None])
        return {"args": args, "kwargs": kw, "idx": idx, "pos": pos}
    ps, n_req = case.unit, case.requests
    tokens = case.queries // n_req
    pages = -(-case.kv_len // ps)
    if n_req * pages > case.pool_pages:
        raise ValueError(f"{case.name}: {n_req * pages} pages > pool {case.pool_pages}")
    seq_lens = np.full(n_req, case.kv_len, np.int32)
    cu_kv = (np.arange(n_req + 1) * pages * ps).astype(np.int32)
    page_indices = rng.permutation(case.pool_pages)[: n_req * pages].astype(np.int32)
    pos = np.concatenate([np.arange(case.kv_len - tokens, case.kv_len)] * n_req).astype(np.int32)
    idx = decode_picks(rng, pos, unit=ps, k=case.top_k, tokens=tokens, share=0.0)
    pk = kv_packing(jnp.bfloat16)
    cache = jax.random.normal(k_kv, (case.pool_pages, ps // pk, pk, padded_dk(DK)), jnp.bfloat16)
    tables = {
        "page_size": ps,
        "q_seq_id": jnp.asarray(np.repeat(np.arange(n_req), tokens).astype(np.int32)),
        "seq_lens": jnp.asarray(seq_lens),
        "cu_kv_lens": jnp.asarray(cu_kv),
        "page_indices": jnp.asarray(page_indices),
    }
    args = (q, cache, jnp.asarray(idx)[None], jnp.asarray(pos)[None])
    return {"args": args, "kwargs": {**kw, **tables}, "idx": idx, "pos": pos}


def row_major(x: jax.Array) -> jax.Array:
    """``x`` committed to its device in row-major layout: how an array made inside a
    jitted step reaches the kernels. A flat ``[1, T, 576]`` bf16 cache made outside one
    lands with ``T`` minor on a v5e (the runtime's default layout for that shape), and
    every call would then relay it out first (0.42 ms at 110,592 tokens)."""
    return jax.device_put(x, Format(Layout(major_to_minor=tuple(range(x.ndim))), x.sharding))


def jit_placed(fn, *args):
    """``jax.jit(fn)`` taking each array of ``args`` in the layout it has (jit would
    otherwise relay out a committed non-default layout to the default one)."""
    return jax.jit(fn, in_shardings=tuple(a.format for a in args))


def _valid_tokens(case: Case, idx, pos) -> int:
    """Valid (query, key token) pairs: selected units' tokens at or before the position."""
    sel = idx >= 0
    first = np.where(sel, idx * case.unit, 0)
    per = np.clip(pos[:, None] - first + 1, 0, case.unit)
    return int(np.where(sel, per, 0).sum())


# ------------------------------------------------------------------------------ the suite


class Runner(_suite.Runner):
    def __init__(self, args):
        if args.sweep:
            super().__init__(args, result=SWEEP_RESULT, write_report=write_sweep_report)
        else:
            super().__init__(args, result=RESULT, write_report=write_report)
        chip = default_chip()
        self.hbm = chip.hbm_bytes_per_s
        self.mxu = matmul_tflops(self.smoke) * 1e12
        self.start(chip, matmul_tflops=self.mxu / 1e12, hbm_gbps=self.hbm / 1e9)

    def fn(self, kernel: str, config=None, **knobs):
        extra = dict(self.extra, **knobs)
        if config is not None:
            extra["config"] = config
        if kernel == "per-query":
            f = tpu.sparse_mla_attention
        elif kernel == "qblock":
            f = tpu.sparse_mla_attention_qblock
        else:  # the reference, through the front door (a backend imports no other)
            f, extra = load_backend("reference").sparse_mla_attention, {}
        return lambda *a, **kw: f(*a, **kw, **extra)

    def time_forward(self, case, inputs, kernel, config=None, **knobs):
        args, kw = inputs["placed"], dict(inputs["kwargs"], return_lse=True)
        f = self.fn(kernel, config, **knobs)
        jitted = jit_placed(lambda *a: f(*a, **kw), *args)
        out = jitted(*args)
        return timed(jitted, *args, iterations=self.iterations), out

    def bounds(self, case, inputs, plan=None) -> dict:
        idx, pos = inputs["idx"], inputs["pos"]
        unit_bytes = case.unit * padded_dk(DK) * 2
        distinct = np.array([len(set(r[r >= 0].tolist())) for r in idx])
        valid = _valid_tokens(case, idx, pos)
        useful = 2 * case.heads * (DK + DV) * valid
        out = {
            "bytes_ms": distinct.sum() * unit_bytes / self.hbm * 1e3,
            "useful_mxu_ms": useful / self.mxu * 1e3,
            "valid_pairs": valid,
        }
        if not case.paged:
            unions = host_union_sizes(idx[None], (8, 16, 32, 64, 128, 256))
            out["unions"] = {str(k): float(v.mean()) for k, v in unions.items()}
        return out

    def run_case(self, case: Case) -> None:
        inputs = make_inputs(case)
        # q and the cache as a jitted step hands them over (row-major); the eager row
        # and the pool check keep the arrays as made.
        q, kv, *rest = inputs["args"]
        inputs["placed"] = (row_major(q), row_major(kv), *rest)
        base = dict(case=case.name, mode=case.mode, picks=case.picks, unit=case.unit,
                    heads=case.heads, queries=case.queries)  # fmt: skip
        bounds = self.bounds(case, inputs)
        if self.sweep:
            self._sweep_cell(
                case, inputs, dict(base, top_k=case.top_k, bytes_ms=bounds["bytes_ms"])
            )
        elif case.mode in ("prefill", "decode"):
            self._forward_rows(case, inputs, base, bounds)
        elif case.mode == "train":
            self._train_rows(case, inputs, base, bounds)
        else:
            self._eager_rows(case, inputs, base, bounds)

    def _xla(self, case, inputs):
        if case.paged and case.pool_pages > 4 * case.requests * (case.kv_len // case.unit):
            return None, None
        try:
            return self.time_forward(case, inputs, "xla")
        except Exception as e:
            print(f"xla {case.name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return None, None

    def pool_ops(self, case, inputs) -> list[str]:
        """HLO instructions of the compiled per-query call whose result has the pool's
        leading dimension (a relayout of the pool would show here)."""
        args, kw = inputs["args"], dict(inputs["kwargs"], return_lse=True)
        f = self.fn("per-query")
        text = jax.jit(lambda *a: f(*a, **kw)).lower(*args).compile().as_text()
        key = f"[{case.pool_pages},"
        return [ln.strip()[:160] for ln in text.splitlines() if key in ln and " = " in ln][:20]

    def _forward_rows(self, case, inputs, base, bounds):
        if case.paged and not self.smoke:
            try:
                base = dict(base, pool_pages=case.pool_pages, pool_ops=self.pool_ops(case, inputs))
            except Exception as e:
                base = dict(base, pool_ops=_suite.error_line(e))
        xla, want = self._xla(case, inputs)
        for kernel in ("per-query", "qblock"):
            t, got = self.time_forward(case, inputs, kernel)
            err = rel_l2(got[0], want[0]) if want is not None else None
            bound = bounds["bytes_ms"] if kernel == "per-query" else None
            row = dict(base, kernel=kernel, **t, bound_ms=bound, **_xla_fields(xla), err=err,
                       **{k: v for k, v in bounds.items() if k != "unions"})  # fmt: skip
            if kernel == "qblock":
                row.update(self._qblock_bounds(case, inputs, bounds))
            self.record(**row)

    def _qblock_bounds(self, case, inputs, bounds) -> dict:
        """The automatic plan of the query-blocked front door and its masked MXU bound."""
        plan = self.plan(case, inputs)
        row = {"plan": describe_plan(plan), "plan_ms_model": plan.predicted_s * 1e3}
        if plan.kernel == "qblock":
            u = host_union_sizes(inputs["idx"][None], (plan.query_block,))[plan.query_block]
            rows = plan.query_block * case.heads
            work = 2 * float(u.sum()) * case.unit * rows * (padded_dk(DK) + DV)
            row["bound_ms"] = work / self.mxu * 1e3
            row["union_bytes_ms"] = float(u.sum()) * case.unit * padded_dk(DK) * 2 / self.hbm * 1e3
        else:
            row["bound_ms"] = bounds["bytes_ms"]
        return row

    def plan(self, case, inputs):
        """The eager call's plan (``plan.choose_plan`` on host counts, the default config)."""
        keys = np.where(inputs["idx"] >= 0, inputs["idx"], -1)[None]
        cfg = default_config(
            read_block=case.unit, top_k=case.top_k, num_queries=case.queries, heads=case.heads
        )
        return choose_plan(
            distinct_per_query=host_distinct_units(keys),
            union_sizes=host_union_sizes(keys, AUTO_QUERY_BLOCKS),
            **plan_shape(case, cfg),
        )

    def _sweep_cell(self, case, inputs, base):
        """One cell of the cost model's sweep: every tiling of :func:`sweep_tilings`
        timed (``role: "tiling"``, with the model's terms), then the front door's own
        jitted call (``role: "auto"``: the shapes' tiling behind the run-time guard;
        its ``plan``, the eager call's choice, and the guard's query-blocked tiling
        priced as the tilings are). A training cell times the gradient through the
        per-query kernel (``role: "grad"``) and through the front door (``"auto"``)."""
        if case.mode == "train":
            q, kv = inputs["placed"][:2]
            for kernel, role in (("per-query", "grad"), ("qblock", "auto")):
                t = timed(self.grad_fn(inputs, kernel), q, kv, iterations=self.iterations)
                self.record(**base, kernel=kernel, role=role, sweep=True, **t)
            return
        tilings, static = sweep_tilings(case, inputs["idx"])
        for row in tilings:
            knobs = row.pop("knobs")
            try:
                t, _ = self.time_forward(case, inputs, row["kernel"], **knobs)
                self.record(**base, **row, role="tiling", sweep=True, **t)
            except Exception as e:
                self.record(**base, **row, role="tiling", sweep=True, error=_suite.error_line(e))
        t, _ = self.time_forward(case, inputs, "qblock")
        plan = None if case.paged else describe_plan(self.plan(case, inputs))
        self.record(**base, kernel="qblock", role="auto", sweep=True, plan=plan, static=static,
                    **t)  # fmt: skip

    def grad_fn(self, inputs, kernel: str):
        """The jitted gradient of a loss on out and LSE w.r.t. q and the cache through
        ``kernel`` (its automatic tiling)."""
        args, kw = inputs["placed"], dict(inputs["kwargs"], return_lse=True)
        q, kv = args[:2]
        cot = jax.random.normal(jax.random.PRNGKey(7), (*q.shape[:3], DV), jnp.float32)
        f = self.fn(kernel)

        def loss(q, kv):
            out, lse = f(q, kv, *args[2:], **kw)
            return jnp.sum(out * cot) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jit_placed(jax.grad(loss, argnums=(0, 1)), q, kv)

    def _train_rows(self, case, inputs, base, bounds):
        q, kv = inputs["placed"][:2]
        loss_of = functools.partial(self.grad_fn, inputs)
        xla = want = None
        try:
            g = loss_of("xla")
            want = g(q, kv)
            xla = timed(g, q, kv, iterations=max(1, self.iterations // 2))
        except Exception as e:
            print(f"xla grad {case.name}: {_suite.error_line(e)}", flush=True)
        for kernel in ("per-query", "qblock"):
            g = loss_of(kernel)
            got = g(q, kv)
            t = timed(g, q, kv, iterations=self.iterations)
            fwd, _ = self.time_forward(case, inputs, kernel)
            err = None if want is None else [rel_l2(a, b) for a, b in zip(got, want, strict=True)]
            self.record(**base, kernel=kernel, **t, fwd_ms=fwd["ms"],
                        fwd_device_ms=fwd["device_ms"],
                        fwd_kernel_device_ms=fwd["kernel_device_ms"], **_xla_fields(xla), err=err,
                        bound_ms=None, **{k: v for k, v in bounds.items() if k != "unions"})  # fmt: skip

    def _eager_rows(self, case, inputs, base, bounds):
        args = inputs["args"]
        kw = dict(inputs["kwargs"], return_lse=True)
        # Host-value indices and positions (the eager front door plans on them); q and
        # the cache stay on the device, as in a serving loop.
        host = (args[0], args[1], np.asarray(args[2]), np.asarray(args[3]))
        f = self.fn("qblock")

        def median_ms(first_calls: bool) -> float:
            times = []
            for _ in range(self.iterations):
                if first_calls:
                    _EAGER_PLANS.clear()  # the shape's first call: plans on the host
                t0 = time.perf_counter()
                jax.block_until_ready(f(*host, **kw))
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e3

        _EAGER_PLANS.clear()
        jax.block_until_ready(f(*host, **kw))  # compiles the planned kernel
        jax.block_until_ready(f(*host, **kw))  # compiles the kept tiling's program
        first_ms = median_ms(True)
        eager_ms = median_ms(False)
        jit, _ = self.time_forward(case, dict(inputs, placed=args), "qblock")  # same arrays
        # The jitted call handed the same host values: the same transfers, so the
        # difference is the eager call's planning (and its kernel choice).
        jitted = jax.jit(lambda *a: f(*a, **kw))
        jit_host = wall_ms(jitted, *host, iterations=self.iterations)
        self.record(**base, kernel="qblock", ms=eager_ms, jit_ms=jit["ms"],
                    jit_host_args_ms=jit_host, host_ms=eager_ms - jit_host,
                    first_call_ms=first_ms, first_host_ms=first_ms - jit_host, bound_ms=None,
                    xla_ms=None)  # fmt: skip


def plan_shape(case: Case, config: SparseMlaConfig) -> dict:
    """The planner's shape keywords (``plan.PlanShape``) of a case at ``config``."""
    return dict(heads=case.heads, top_k=case.top_k, num_units=-(-case.kv_len // case.unit),
                read_block=case.unit, dk_pad=padded_dk(DK), dv=DV, itemsize=2,
                chip=default_chip(), config=config)  # fmt: skip


def sweep_tilings(case: Case, idx: np.ndarray) -> tuple[list[dict], dict | None]:
    """The tilings a sweep cell times, and the jitted call's query-blocked tiling.

    Per-query: the forward's default units per step ``G`` (``config.default_config``'s
    ``forward_units_per_step``; the tiling the plan prices) and half and twice it. Flat caches also: the query-blocked kernel
    at every ``plan.AUTO_QUERY_BLOCKS`` size with the plan's head group and chunk there
    (``plan.widest_head_group``), where it reads at most the per-query kernel's KV bytes
    (``plan.MIN_SHARING`` of them is the plan's own filter; ``shares`` says whether it
    passes). Each row carries the model's ``terms`` and ``model_bytes`` for
    ``attn_pallas_tpu.fit_plan`` and ``knobs`` for the timed call. The second value
    prices ``static_qblock_config``'s tiling, the one the run-time guard of a jitted
    call weighs against the default per-query tiling (``None`` for a paged cache).
    """
    cfg0 = default_config(
        read_block=case.unit, top_k=case.top_k, num_queries=case.queries, heads=case.heads
    )
    keys = np.where(idx >= 0, idx, -1)[None]
    distinct = host_distinct_units(keys).astype(np.int64)
    g0, pq_units = cfg0.per_query_forward().units_per_step, int(distinct.sum())
    rows = []
    for g in sorted({max(1, g0 // 2), g0, min(2 * g0, MAX_UNITS_PER_STEP)}):
        cfg = cfg0.replace(forward_units_per_step=g)
        shape = PlanShape(**plan_shape(case, cfg))
        steps = int(((distinct + g - 1) // g).sum())
        rows.append(dict(
            kernel="per-query", config=dataclasses.asdict(cfg), default=g == g0,
            terms=_floats(per_query_terms(steps, pq_units, shape)),
            model_bytes=float(per_query_bytes(pq_units, distinct.size, shape)),
            knobs={"config": cfg},
        ))  # fmt: skip
    if case.paged:
        return rows, None
    shape = PlanShape(**plan_shape(case, cfg0))
    unions = host_union_sizes(keys, AUTO_QUERY_BLOCKS)

    g = cfg0.units_per_step  # the query-blocked kernel's

    def priced(qb, hb, u_max):
        u = unions[qb].ravel().astype(np.int64)
        steps, units = int(((u + g - 1) // g).sum()), int(u.sum())
        cfg = dict(query_block=qb, head_block=hb)
        read = units * (case.heads // hb)
        return dict(kernel="qblock", config=dict(dataclasses.asdict(cfg0), **cfg, u_max=u_max),
                    terms=_floats(qblock_terms(steps, units, u.size, shape, **cfg)),
                    model_bytes=float(qblock_bytes(units, u.size, shape, **cfg)),
                    shares=read * MIN_SHARING <= pq_units, reads=read)  # fmt: skip

    for qb in AUTO_QUERY_BLOCKS:
        fit = widest_head_group(query_block=qb, largest_union=int(unions[qb].max()),
                                **plan_shape(case, cfg0))  # fmt: skip
        if fit is None:
            continue
        row = priced(qb, *fit)
        if row.pop("reads") <= pq_units:
            row["knobs"] = dict(config=cfg0, query_block=qb, head_block=fit[0], u_max=fit[1])
            rows.append(row)
    qb, hb, u_max = static_qblock_config(**plan_shape(case, cfg0), max_rows=MAX_ROWS)
    qb = min(qb, -(-case.queries // 8) * 8)
    if qb not in unions:
        unions.update(host_union_sizes(keys, (qb,)))
    static = priced(qb, hb, u_max)
    static.pop("reads")
    return rows, static


def _floats(terms: dict) -> dict:
    return {k: float(v) for k, v in terms.items()}


def _xla_fields(xla: dict | None) -> dict:
    """The XLA reference's times as row fields (``None`` where it did not run)."""
    xla = xla or {}
    return {"xla_ms": xla.get("ms"), "xla_device_ms": xla.get("device_ms")}


def write_report(result: dict, out: Path) -> Path:
    """``tpu_sparse_mla.md``: the suite's rows (sweep rows summarised by their best)."""
    rows = [r for r in result["rows"] if not r.get("sweep")]
    lines = [
        "# TPU sparse MLA: results",
        "",
        _suite.report_provenance(result, ".0f")
        + f"measured, HBM {result.get('hbm_gbps', 0):.0f} GB/s. Medians: `wall ms` each call "
        "waited for, `queued ms` per call of calls issued back to back with one wait, "
        "`device ms` the call's spans on the chip (profiler); the ratios use device ms "
        "where measured (wall clock otherwise), XLA's likewise.",
        *(["", result["note"]] if result.get("note") else []),
        "",
        "| case | kernel | wall ms | queued ms | device ms | bound ms | x bound | XLA device ms "
        "| x XLA | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r.get("device_ms") or r.get("ms")
        bound = r.get("bound_ms")
        xla = r.get("xla_device_ms") or r.get("xla_ms")
        notes = [f"commit {r['commit'][:7]}"] if r.get("commit") else []
        for key in ("plan", "kernel_device_ms", "fwd_device_ms", "fwd_kernel_device_ms",
                    "jit_ms", "jit_host_args_ms", "host_ms", "first_call_ms", "first_host_ms",
                    "err"):  # fmt: skip
            if r.get(key) is not None:
                v = r[key]
                notes.append(f"{key} {v:.3g}" if isinstance(v, float) else f"{key} {v}")
        lines.append(
            f"| {r['case']} | {r['kernel']} | {_f(r.get('ms'))} | {_f(r.get('queued_ms'))} | "
            f"{_f(r.get('device_ms'))} | {_f(bound)} | "
            f"{_f(ms / bound if ms and bound else None)} | {_f(xla)} | "
            f"{_f(xla / ms if ms and xla else None)} | {'; '.join(notes)} |"
        )
    return _suite.write_markdown(out, RESULT, lines)


def write_sweep_report(result: dict, out: Path) -> Path:
    """``tpu_sparse_mla_sweep.md``: every cell's timed rows, each against the cell's
    fastest tiling (device time where profiled)."""
    lines = [
        "# TPU sparse MLA: the cost model's sweep",
        "",
        _suite.report_provenance(result, ".0f")
        + "measured. Medians; `x best` against the cell's fastest tiling (device ms where "
        "profiled). `auto` is the front door's jitted call (the shapes' tiling behind "
        "the run-time guard); `plan` the eager call's choice. `python -m "
        "attn_pallas_tpu.fit_plan` fits the cost model to these rows.",
        "",
        "| cell | kernel | tiling | wall ms | device ms | x best | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [r for r in result["rows"] if r.get("sweep")]
    for cell in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == cell]
        timed = [_ms(r) for r in mine if r.get("role") in ("tiling", "grad") and _ms(r)]
        best = min(timed, default=None)
        for r in mine:
            ms = _ms(r)
            notes = [r["error"]] if "error" in r else []
            notes += [f"plan {r['plan']}"] if r.get("plan") else []
            lines.append(
                f"| {cell} | {r.get('kernel', '')} | {_tiling_label(r)} | {_f(r.get('ms'))} | "
                f"{_f(r.get('device_ms'))} | {_f(ms / best if ms and best else None)} | "
                f"{'; '.join(notes)} |"
            )
    return _suite.write_markdown(out, SWEEP_RESULT, lines)


def _ms(row: dict):
    return row.get("device_ms") or row.get("ms")


def _tiling_label(row: dict) -> str:
    if row.get("role") == "auto":
        return "auto"
    c = row.get("config") or {}
    if row.get("kernel") == "qblock":
        return f"QB {c.get('query_block')} Hb {c.get('head_block')} u_max {c.get('u_max')}"
    g = c.get("forward_units_per_step") or c.get("units_per_step")
    return f"G {g}" + (" (default)" if row.get("default") else "")


def write_plot(result: dict, path: Path) -> bool:
    """``tpu_sparse_mla.svg``: per case the kernels' ms against the bound and XLA (log
    scale); ``False`` without matplotlib."""
    plt = _suite.pyplot()
    if plt is None:
        return False
    rows = [r for r in result["rows"] if not r.get("sweep") and r.get("ms") is not None]
    rows = [dict(r, ms=r.get("device_ms") or r["ms"], xla_ms=_xla_ms(r)) for r in rows]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.2
    for i, case in enumerate(cases):
        mine = {r["kernel"]: r for r in rows if r["case"] == case}
        bars = [
            ("per-query", mine.get("per-query", {}).get("ms"), "#1f77b4"),
            ("query-blocked (auto)", mine.get("qblock", {}).get("ms"), "#ff7f0e"),
            (
                "bound",
                (mine.get("qblock") or mine.get("per-query") or {}).get("bound_ms"),
                "#2ca02c",
            ),
            ("XLA", (mine.get("per-query") or mine.get("qblock") or {}).get("xla_ms"), "#999"),
        ]
        for j, (label, v, color) in enumerate(bars):
            if v:
                ax.bar(
                    i + (j - 1.5) * width, v, width, color=color, label=label if i == 0 else None
                )
    ax.set_yscale("log")
    ax.set_xticks(range(len(cases)), cases, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("ms (on the device where profiled, else wall clock; median)")
    ax.set_title(f"TPU sparse MLA on {result.get('device')} ({result.get('commit', '')[:7]})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _xla_ms(row: dict):
    return row.get("xla_device_ms") or row.get("xla_ms")


def _f(x) -> str:
    return "" if x is None else f"{x:.3g}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's flags (``python -m attn_pallas_tpu.bench_sparse_mla`` and ``attn bench
    sparse-mla`` on a TPU take the same)."""
    _suite.add_common_arguments(
        parser, sweep_help="run the cost model's cells instead (tpu_sparse_mla_sweep.json)"
    )


_SWEEP = dataclasses.replace(
    _suite.Suite.of(globals()), cases=SWEEP_CASES, smoke_cases=SWEEP_SMOKE_CASES,
    write_report=write_sweep_report, write_plot=lambda result, path: False, result=SWEEP_RESULT,
)  # fmt: skip
SUITE = dataclasses.replace(_suite.Suite.of(globals()), sweep=_SWEEP)
check_args, run, main = _suite.check_args, SUITE.run, SUITE.main


if __name__ == "__main__":
    raise SystemExit(main())
