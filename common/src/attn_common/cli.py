"""The ``attn`` command: ``attn info``, ``attn run ranker|sparse-mla|all``, ``attn bench [ranker|sparse-mla]``.

* ``attn --version``: the versions of attn-common and of the installed backends.
* ``attn info``: installed backends (version, module, ops, devices), the backend each op
  dispatches to on the default device, the devices and the JAX version.
* ``attn run ranker``: a phoenix-like ranker batch (history + isolated candidates, GQA
  5:1, soft_sign cap 80, bf16; history length per row uniform in [126, 1022], then 64
  candidates) on the best backend: forward and forward+backward time, effective GFLOP/s
  (allowed pairs only), a sample row checked against a float64 dense softmax and, when
  the backend is not the reference and the reference is installed, against the reference
  on the same inputs. ``--small`` shrinks the shapes to run in seconds. Forward and
  forward+backward are timed as ``attn bench`` does: the jitted forward, and one jitted
  ``value_and_grad`` (which contains the forward); min / median / max over
  ``--iterations`` calls after a compile + warm-up call. ``--json PATH`` saves the rows.
* ``attn run sparse-mla``: sparse MLA prefill, flat (DeepSeek latent dims 512 + 64, 16
  selected units of 64 tokens per query) and ragged paged (3 requests packed into a
  cache with shuffled physical pages), same report.
* ``attn bench`` (= ``attn bench ranker``): the ranker benchmark suite, see
  ``attn_mosaic_gpu.bench`` and docs/design.md, "Benchmarks". ``attn bench sparse-mla``:
  the sparse MLA prefill benchmark (ours vs XLA gather + einsum), see
  ``attn_mosaic_gpu.bench_sparse_mla`` and docs/sparse_mla_gpu.md. Off a GPU both run a
  smoke run only (tiny shapes, not a measurement). On a TPU, with attn-pallas-tpu
  installed, ``attn bench sparse-mla`` is the TPU suite instead
  (``attn_pallas_tpu.bench_sparse_mla``, docs/tpu_sparse_mla.md): a backend's commands
  come from its entry point, and a command two backends add goes to the default device's
  (:func:`backend_commands`).

``--implementation NAME`` pins a backend (default: the dispatch choice, see
``attn_common.dispatch``). Arguments are validated by argparse (one-line errors, exit
status 2); the exit status is 1 when a row fails or a check does not pass.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.bounds import SegmentBounds
from attn_common.cap import CapMethod, CapParams
from attn_common.cli_args import (
    MAX_SEED,
    OneLineParser,
    available_memory,
    check_out_file,
    gib,
    implementation_choices,
    iterations_int,
    out_path,
    positive_int,
    progress,
    provenance,
    seed_int,
)
from attn_common.dispatch import (
    KNOWN_BACKENDS,
    OPS,
    BackendUnavailableError,
    backend_version,
    device_class,
    installed_backends,
    load_backend,
    select_backend,
    supported_devices,
)
from attn_common.ranker import ranker_flops
from attn_common.sparse_mla import padded_dk
from attn_common.tables import kv_packing

# --------------------------------------------------------------------------- helpers


# Shapes of `attn run` (also listed by `attn run --help`).
RANKER_SHAPES = {
    "full": dict(batch=4, seq=1152, hq=20, hkv=4, d=128, n_cand=64, hist=(126, 1023)),
    "small": dict(batch=2, seq=256, hq=4, hkv=2, d=64, n_cand=32, hist=(30, 200)),
    # --small --interpret: a kernel interpreted on a CPU runs each tile op by op
    "small-interpret": dict(batch=1, seq=128, hq=2, hkv=1, d=64, n_cand=16, hist=(20, 100)),
}
SPARSE_SHAPES = {
    "full": dict(heads=16, top_k=16, rb=64, seq=256, ctx=8192, lens=(3000, 1900, 4100), new=(96, 64, 96)),
    "small": dict(heads=4, top_k=4, rb=64, seq=32, ctx=1024, lens=(300, 190, 410), new=(16, 8, 16)),
    # --small --interpret: the Mosaic GPU interpreter runs one program per query token
    # (about 1 s each on a CPU core: every gathered cache row is a host callback), so as
    # few tokens as the checks need: 2 flat queries, one new token per packed request.
    "small-interpret": dict(heads=2, top_k=2, rb=64, seq=2, ctx=256, lens=(130, 70, 100), new=(1, 1, 1)),
}  # fmt: skip
# Pass thresholds of the checks (inputs are bf16; the float64 check sees one row).
RANKER_TOL = 2e-2
SPARSE_TOL = 1e-2
FWD_BWD_FLOP_FACTOR = 3.5  # as in `attn bench`: forward + backward counts 3.5x the forward

_progress = progress


def _shape_name(small: bool, interpret: bool) -> str:
    """``full``, ``small``, or ``small-interpret`` (--small with --interpret: tinier)."""
    if not small:
        return "full"
    return "small-interpret" if interpret else "small"


def _calls(n: int, what: str = "call") -> str:
    """``"1 call"``, ``"3 calls"``."""
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _timing_note(iterations: int, interpret: bool) -> str:
    """What a progress line says is timed: ``compile + 3 timed calls``, or in interpret
    mode, which has no warm-up call, ``1 timed call (compile included)``."""
    calls = _calls(iterations, "timed call")
    return f"{calls} (compile included)" if interpret else f"compile + {calls}"


def _times(
    fn, *args, repeats: int = 3, keep: list | None = None, warmup: bool = True
) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn(*args)`` in seconds, after a compile +
    warm-up call (none with ``warmup=False``: interpret mode, where a call takes seconds
    and times say nothing about the kernel). ``keep``: a list that receives the last
    call's result, which the check reuses rather than calling again."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: got {repeats!r}, expected a positive int")
    if warmup:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    if keep is not None:
        keep.append(result)
    return times


def _timed(fn, *args, repeats: int, interpret: bool = False) -> tuple[dict, object]:
    """``(spread of the wall times, the result)`` of ``fn(*args)``."""
    keep: list = []
    spread = _spread(_times(fn, *args, repeats=repeats, keep=keep, warmup=not interpret))
    return spread, (keep[-1] if keep else fn(*args))


def _spread(times: list[float]) -> dict:
    return {
        "min_s": min(times),
        "median_s": float(np.median(times)),
        "max_s": max(times),
        "n": len(times),
    }


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _reference_fn(op: str, backend: str):
    """The reference's ``op`` when it is installed and not already the backend, else None."""
    if backend == "reference" or "reference" not in installed_backends():
        return None
    try:
        return getattr(load_backend("reference"), op, None)
    except BackendUnavailableError:
        return None


def _dense_ranker_row(q, k, v, bounds, b, h, i, cap: CapParams):
    """Output row (b, i, h) by a direct dense softmax in float64 numpy (soft_sign cap)."""
    hl, hu, cl, cu = (int(x) for x in bounds[b])
    group = q.shape[2] // k.shape[2]
    keys = [
        j
        for j in range(q.shape[1])
        if (hl <= j < hu and (hl <= i < hu or cl <= i < cu)) or (cl <= i < cu and j == i)
    ]
    if not keys:
        return np.zeros(q.shape[-1])
    qv = np.asarray(q[b, i, h], np.float64)
    kk = np.asarray(k[b, keys, h // group], np.float64)
    s = kk @ qv / math.sqrt(q.shape[-1])
    if cap.method == CapMethod.SOFT_SIGN:
        s = cap.value * s / (cap.value + np.abs(s))
    elif cap.method == CapMethod.TANH:
        s = cap.value * np.tanh(s / cap.value)
    p = np.exp(s - s.max())
    return p @ np.asarray(v[b, keys, h // group], np.float64) / p.sum()


def _row(op, backend, flops, fwd, fwd_bwd, check: str, ok: bool) -> dict:
    """One result row. ``fwd`` / ``fwd_bwd``: ``_spread`` dicts (or None: not run)."""

    def rate(spread, factor):
        return None if spread is None else factor * flops / spread["median_s"] / 1e9

    return {
        "op": op,
        "backend": backend,
        "flops_fwd": flops,
        "fwd": fwd,
        "fwd+bwd": fwd_bwd,
        "fwd_gflops": rate(fwd, 1.0),
        "fwd+bwd_gflops": rate(fwd_bwd, FWD_BWD_FLOP_FACTOR),
        "check": check,
        "ok": ok,
    }


def _failed_row(op: str, backend: str, error: BaseException) -> dict:
    row = _row(op, backend, 0.0, None, None, f"FAILED {type(error).__name__}: {error}", False)
    row["error"] = f"{type(error).__name__}: {error}"
    return row


# --------------------------------------------------------------------------- attn run


def run_ranker(
    batch: int | None = None,
    seed: int = 0,
    *,
    small: bool = False,
    implementation=None,
    iterations: int = 3,
    interpret: bool = False,
) -> dict:
    """Ranker attention at a phoenix-like shape on the selected backend."""
    shape = RANKER_SHAPES[_shape_name(small, interpret)]
    seq, hq, hkv, d, n_cand = (shape[k] for k in ("seq", "hq", "hkv", "d", "n_cand"))
    batch = shape["batch"] if batch is None else batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: got {batch!r}, expected a positive int")
    backend, ranker_attention = select_backend(
        "ranker_attention", implementation, interpret=interpret
    )
    extra = {"interpret": True} if interpret else {}
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, hkv, d), jnp.bfloat16)
    hist = rng.integers(*shape["hist"], size=batch)
    bounds = SegmentBounds.from_lengths(jnp.asarray(hist), n_cand).as_array()
    cap = CapParams(CapMethod.SOFT_SIGN, 80.0)
    name = f"ranker B{batch} S{seq} H{hq}/{hkv} D{d} bf16"

    def attend(q, k, v, b):
        return ranker_attention(q, k, v, b, cap=cap, **extra)

    fwd = jax.jit(attend)
    _progress(f"{name} on {backend}: forward, {_timing_note(iterations, interpret)}")
    t_fwd, out = _timed(fwd, q, k, v, bounds, repeats=iterations, interpret=interpret)
    # One jitted value_and_grad: it contains the forward, so its time is forward+backward.
    fwd_bwd = jax.jit(
        jax.value_and_grad(
            lambda q, k, v, b: attend(q, k, v, b).astype(jnp.float32).sum(), argnums=(0, 1, 2)
        )
    )
    ok = True
    _progress(f"{name} on {backend}: forward+backward, {_timing_note(iterations, interpret)}")
    try:
        t_fwd_bwd, (_, grads) = _timed(
            fwd_bwd, q, k, v, bounds, repeats=iterations, interpret=interpret
        )
        finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
        grad_note = f"grads finite: {finite}"
        ok &= finite
    except NotImplementedError as e:
        grad_note, t_fwd_bwd = f"no backward ({str(e)[:40]})", None
    _progress(
        f"{name}: checking against float64"
        + (" and the reference" if backend != "reference" else "")
    )
    # spot check: a history row and a candidate row against a dense float64 softmax
    bnp = np.asarray(bounds)
    h = min(3, hq - 1)
    errs = []
    for b, i in ((0, int(hist[0]) // 2), (batch - 1, int(hist[-1]) + 3)):
        want = _dense_ranker_row(q, k, v, bnp, b, h, i, cap)
        errs.append(_rel_err(out[b, i, h], want))
    ok &= max(errs) <= RANKER_TOL
    check = f"dense f64 rel err {max(errs):.1e}"
    ref = _reference_fn("ranker_attention", backend)
    if ref is not None:  # the first batch row on the reference, same inputs
        err = _rel_err(out[:1], ref(q[:1], k[:1], v[:1], bounds[:1], cap=cap))
        ok &= err <= RANKER_TOL
        check += f", vs reference {err:.1e}"
    check = f"{'ok' if ok else 'FAIL'} (tol {RANKER_TOL:g}): {check}; {grad_note}"
    return _row(name, backend, ranker_flops(bnp, hq, d), t_fwd, t_fwd_bwd, check, ok)


def _sparse_pairs(sel_tokens_ok: np.ndarray) -> int:
    return int(sel_tokens_ok.sum())


def _sparse_check(out, qi: int, q_row, kk, *, scale: float, dv: int, reference):
    """``(line, ok)``: query ``qi`` of ``out [1, S, H, Dv]`` against a dense float64
    softmax over its keys ``kk [n, Dk]`` (``q_row [H, Dk]``), and all of ``out`` against
    ``reference()`` where there is one (not None), each within ``SPARSE_TOL``."""
    s = kk @ np.asarray(q_row, np.float64).T * scale
    p = np.exp(s - s.max(0))
    err = _rel_err(out[0, qi], (p / p.sum(0)).T @ kk[:, :dv])
    ok = err <= SPARSE_TOL
    check = f"dense f64 rel err {err:.1e}"
    if reference is not None:
        err = _rel_err(out, reference())
        ok &= err <= SPARSE_TOL
        check += f", vs reference {err:.1e}"
    return f"{'ok' if ok else 'FAIL'} (tol {SPARSE_TOL:g}): {check}", ok


def run_sparse_mla(
    seed: int = 0,
    *,
    small: bool = False,
    implementation=None,
    iterations: int = 3,
    interpret: bool = False,
) -> list[dict]:
    """Sparse MLA prefill, flat and ragged paged, on the selected backend (forward only)."""
    dv, rope = 512, 64
    shape = SPARSE_SHAPES[_shape_name(small, interpret)]
    heads, top_k, rb, seq, ctx = (shape[k] for k in ("heads", "top_k", "rb", "seq", "ctx"))
    lens, new = list(shape["lens"]), list(shape["new"])
    dk = dv + rope
    backend, sparse_mla_attention = select_backend(
        "sparse_mla_attention", implementation, interpret=interpret
    )
    extra = {"interpret": True} if interpret else {}
    ref = _reference_fn("sparse_mla_attention", backend)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    rng = np.random.default_rng(seed)
    q = jax.random.normal(keys[0], (1, seq, heads, dk), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (1, ctx, dk), jnp.bfloat16)
    positions = jnp.arange(ctx - seq, ctx, dtype=jnp.int32)[None]
    units = ctx // rb
    idx = np.stack([rng.choice(units, size=top_k, replace=False) for _ in range(seq)])
    idx[:, 0] = 0  # attention sink
    indices = jnp.asarray(idx, jnp.int32)[None]
    scale = 1.0 / math.sqrt(192.0)
    flat_kw = dict(sm_scale=scale, kv_lora_rank=dv, read_block=rb)
    flat = jax.jit(lambda q, kv, i, p: sparse_mla_attention(q, kv, i, p, **flat_kw, **extra))
    flat_name = f"sparse MLA flat S{seq} T{ctx} H{heads} K{top_k}x{rb}"
    _progress(f"{flat_name} on {backend}: forward, {_timing_note(iterations, interpret)}")
    t_flat, out = _timed(flat, q, kv, indices, positions, repeats=iterations, interpret=interpret)
    # spot check one query against a dense float64 computation
    qi = min(7, seq - 1)
    t = np.concatenate([np.arange(u * rb, (u + 1) * rb) for u in np.unique(idx[qi])])
    t = t[t <= int(positions[0, qi])]
    kk = np.asarray(kv[0, t], np.float64)
    flat_ref = None if ref is None else (lambda: ref(q, kv, indices, positions, **flat_kw))
    check, ok = _sparse_check(out, qi, q[0, qi], kk, scale=scale, dv=dv, reference=flat_ref)
    tok = (idx[:, :, None] * rb + np.arange(rb)).reshape(seq, -1)
    valid_pairs = _sparse_pairs(tok <= np.asarray(positions[0])[:, None])
    flops = 2 * heads * (dk + dv) * valid_pairs
    results = [_row(flat_name, backend, flops, t_flat, None, check, ok)]

    # ragged paged: requests packed into one cache with shuffled physical pages
    ps = rb
    pages = [-(-n // ps) for n in lens]
    cu_kv = np.concatenate([[0], np.cumsum(pages)]) * ps
    perm = rng.permutation(sum(pages)).astype(np.int32)
    pk = kv_packing(jnp.bfloat16)
    cache = jax.random.normal(keys[2], (sum(pages), ps // pk, pk, padded_dk(dk)), jnp.bfloat16)
    q_seq_id = np.concatenate([np.full(n, r) for r, n in enumerate(new)]).astype(np.int32)
    pos = np.concatenate([np.arange(n - m, n) for n, m in zip(lens, new, strict=True)]).astype(
        np.int32
    )
    sel = np.stack([rng.choice(pages[r], size=top_k, replace=pages[r] < top_k) for r in q_seq_id])
    total = len(q_seq_id)
    qr = jax.random.normal(keys[0], (1, total, heads, dk), jnp.bfloat16)
    ragged_kw = dict(sm_scale=scale, kv_lora_rank=dv, read_block=ps, page_size=ps)

    def ragged_call(fn, **kw):
        return lambda q, c, i, p, sid, sl, cu, pi: fn(
            q, c, i, p, q_seq_id=sid, seq_lens=sl, cu_kv_lens=cu, page_indices=pi, **ragged_kw,
            **kw,
        )  # fmt: skip

    args = (
        qr,
        cache,
        jnp.asarray(sel, jnp.int32)[None],
        jnp.asarray(pos)[None],
        jnp.asarray(q_seq_id),
        jnp.asarray(lens, jnp.int32),
        jnp.asarray(cu_kv, jnp.int32),
        jnp.asarray(perm),
    )
    ragged = jax.jit(ragged_call(sparse_mla_attention, **extra))
    ragged_name = f"sparse MLA ragged {len(lens)} reqs S{total} T{sum(lens)} H{heads} K{top_k}x{ps}"
    _progress(f"{ragged_name} on {backend}: forward, {_timing_note(iterations, interpret)}")
    t_ragged, out_r = _timed(ragged, *args, repeats=iterations, interpret=interpret)
    # dense check of one query: its request's selected pages, physical via the page table
    store = np.asarray(cache, np.float64).reshape(-1, cache.shape[-1])
    qi = total - 1
    r = int(q_seq_id[qi])
    rows, valid = [], 0
    for qq in range(total):
        rq = int(q_seq_id[qq])
        loc = (np.unique(sel[qq])[:, None] * ps + np.arange(ps)).ravel()
        ok = (loc <= pos[qq]) & (loc < lens[rq])
        valid += int(ok.sum())
        if qq == qi:
            loc = loc[ok]
            phys = perm[cu_kv[r] // ps + loc // ps]
            rows = phys * ps + loc % ps
    ragged_ref = None if ref is None else (lambda: jax.jit(ragged_call(ref))(*args))
    check, ok = _sparse_check(
        out_r, qi, qr[0, qi], store[rows, :dk], scale=scale, dv=dv, reference=ragged_ref
    )
    flops = 2 * heads * (dk + dv) * valid
    results.append(_row(ragged_name, backend, flops, t_ragged, None, check, ok))
    return results


def _ms(spread: dict | None) -> str:
    if spread is None:
        return "n/a"
    return "/".join(f"{spread[k] * 1e3:.1f}" for k in ("min_s", "median_s", "max_s"))


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'op':<42} {'backend':<11} {'fwd ms':>20} {'fwd+bwd ms':>20} "
        f"{'fwd GFLOP/s':>11} {'fwd+bwd GFLOP/s':>15}  check"
    )
    print(
        f"{'':<54} {'min/median/max':>20} {'min/median/max':>20} {'(median)':>11} {'(median)':>15}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['op']:<42} {r['backend']:<11} {_ms(r['fwd']):>20} {_ms(r['fwd+bwd']):>20} "
            f"{_rate(r['fwd_gflops']):>11} {_rate(r['fwd+bwd_gflops']):>15}  {r['check']}"
        )


def _describe_device() -> str:
    dev = jax.devices()[0]
    return (
        f"jax {jax.__version__} on {jax.default_backend()} ({dev.device_kind}, {device_class(dev)})"
    )


def cmd_run(args: argparse.Namespace) -> int:
    print(_describe_device())
    if args.iterations is None:  # an interpreted kernel takes seconds per call
        args.iterations = 1 if args.interpret else 3
    kw = dict(implementation=args.implementation, iterations=args.iterations)
    kw["interpret"] = args.interpret
    rows = []
    if args.op in ("ranker", "all"):
        try:
            rows.append(run_ranker(args.batch, args.seed, small=args.small, **kw))
        except BackendUnavailableError:
            raise
        except Exception as e:  # a failed row, reported in the table; exit status 1
            rows.append(_failed_row("ranker", args.implementation or "default", e))
    if args.op in ("sparse-mla", "all"):
        try:
            rows += run_sparse_mla(args.seed, small=args.small, **kw)
        except BackendUnavailableError:
            raise
        except Exception as e:
            rows.append(_failed_row("sparse MLA", args.implementation or "default", e))
    if args.interpret:
        print(
            "interpret mode: the kernel ran in the Pallas interpreter (the first call, "
            "compile included); the times are the interpreter's, not a measurement"
        )
    print(
        f"times: wall clock over {_calls(args.iterations)}"
        + ("" if args.interpret else " after a compile + warm-up call")
        + "; fwd = the jitted forward, fwd+bwd = one jitted value_and_grad (it contains the "
        "forward);\nGFLOP/s: effective (allowed pairs only) at the median time, fwd+bwd "
        f"counting {FWD_BWD_FLOP_FACTOR}x the forward FLOPs\n"
    )
    print_table(rows)
    if args.json is not None:
        doc = {
            "provenance": provenance(getattr(args, "argv", None)),
            "device": _describe_device(),
            "rows": rows,
        }
        args.json.write_text(json.dumps(doc, indent=2))
        print(f"\nwrote {args.json}")
    failed = [r["op"] for r in rows if not r["ok"]]
    if failed:
        print(f"attn run: {len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------- attn info


def cmd_info(args: argparse.Namespace) -> int:
    try:
        common_version = metadata.version("attn-common")
    except metadata.PackageNotFoundError:
        common_version = "0+unknown (source tree)"
    print(f"attn-common {common_version}")
    print(f"jax {jax.__version__}, jaxlib {getattr(jax.lib, '__version__', '?')}")
    print(f"python {sys.version.split()[0]}")
    devices = jax.devices()
    print(f"default backend: {jax.default_backend()}; devices ({len(devices)}):")
    for d in devices[:16]:
        print(f"  {d.id}: {d.platform} {d.device_kind} -> {device_class(d)}")
    if len(devices) > 16:
        print(f"  ... {len(devices) - 16} more")
    installed = installed_backends()
    print("\nbackends:")
    for name in sorted(set(KNOWN_BACKENDS) | set(installed)):
        if name not in installed:
            print(f"  {name:<11} not installed ({KNOWN_BACKENDS[name]['install']})")
            continue
        try:
            module = load_backend(name)
        except BackendUnavailableError as e:
            print(f"  {name:<11} broken: {e}")
            continue
        devs = supported_devices(name, module)
        ops = [op for op in OPS if hasattr(module, op)]
        print(
            f"  {name:<11} {backend_version(name):<10} module {installed[name]}; "
            f"devices: {', '.join(devs) if devs else 'any'}; ops: {', '.join(ops) or 'none'}"
        )
    print(f"\ndispatch on the default device ({device_class()}):")
    for op in OPS:
        try:
            name, _ = select_backend(op)
        except BackendUnavailableError:
            name = "none installed"
        print(f"  {op:<40} -> {name}")
    print(f"\n{examples_text()}")
    return 0


def versions_text() -> str:
    """``attn --version``: attn-common and each installed backend (from metadata only)."""
    lines = [f"attn-common {_dist_version('attn-common')}"]
    installed = installed_backends()
    for name in sorted(set(KNOWN_BACKENDS) | set(installed)):
        if name not in installed:
            lines.append(f"{name}: not installed")
            continue
        dist = KNOWN_BACKENDS.get(name, {}).get("dist")
        version = _dist_version(dist) if dist else backend_version(name)
        lines.append(f"{name}: {dist or installed[name]} {version}")
    lines.append(f"jax {jax.__version__}; python {sys.version.split()[0]}")
    return "\n".join(lines)


def _dist_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "0+unknown (source tree, not installed)"


class _VersionAction(argparse.Action):
    """Like argparse's ``version`` action, but computes the text only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions_text())
        parser.exit()


def _run_epilog() -> str:
    r, rs, ri = (RANKER_SHAPES[k] for k in ("full", "small", "small-interpret"))
    s, ss, si = (SPARSE_SHAPES[k] for k in ("full", "small", "small-interpret"))

    def ranker(x):
        return (
            f"B{x['batch']} S{x['seq']} Hq{x['hq']}/Hkv{x['hkv']} D{x['d']} bf16, history "
            f"{x['hist'][0]}..{x['hist'][1] - 1} + {x['n_cand']} candidates, soft_sign cap 80"
        )

    def sparse(x):
        return (
            f"flat S{x['seq']} T{x['ctx']} H{x['heads']} top-{x['top_k']} units of "
            f"{x['rb']}; ragged {len(x['lens'])} requests of {'/'.join(map(str, x['lens']))} "
            f"tokens, {sum(x['new'])} new"
        )

    return "\n".join(
        [
            "shapes (latent 512 + rope 64 for sparse MLA):",
            f"  ranker              {ranker(r)}",
            f"  ranker --small      {ranker(rs)}",
            f"    with --interpret  {ranker(ri)}",
            f"  sparse-mla          {sparse(s)}",
            f"  sparse-mla --small  {sparse(ss)}",
            f"    with --interpret  {sparse(si)}",
            f"checks: a sample row against float64 (tol ranker {RANKER_TOL:g}, sparse MLA "
            f"{SPARSE_TOL:g}) and against the reference when another backend ran;",
            "row names: B batch rows, S query tokens (the new tokens, in ragged rows), T "
            "cache tokens, H heads, K selected units x tokens per unit;",
            "exit status 1 when a row fails or a check does not pass.",
        ]
    )


# The examples live in the source repository (not in the wheels): models built on the ops.
EXAMPLES = (
    ("examples/ranker", "python examples/ranker/train.py --small",
     "a phoenix-style ranker block trained with optax on packed users"),
    ("examples/deepseek_sparse", "python examples/deepseek_sparse/run.py --small",
     "a DeepSeek-V3.2-style layer: indexer, MLA, paged cache, prefill then decode"),
)  # fmt: skip


def examples_text() -> str:
    """Where the examples are and how to run them (``attn --help``, ``attn info``)."""
    lines = ["examples (in the source repository; they need optax, each README says more):"]
    for path, command, what in EXAMPLES:
        lines.append(f"  {path + '/':<26} {what}")
        lines.append(f"  {'':<26} {command}")
    return "\n".join(lines)


def build_parser(*, backend_commands_too: bool = True) -> argparse.ArgumentParser:
    """The ``attn`` parser; ``backend_commands_too=False`` leaves the installed backends'
    commands out (importing them takes seconds; ``attn run`` and ``attn info`` need
    none)."""
    parser = OneLineParser(
        prog="attn",
        description="Ranker attention and sparse MLA kernels for JAX.",
        epilog=_backend_commands_epilog() + "\n\n" + examples_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="versions of attn-common and the backends"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser(
        "info",
        help="installed backends, devices, jax version",
        description="Installed backends (version, module, ops, devices), the backend each "
        "op dispatches to on the default device, the devices and the JAX version.",
    )
    info.set_defaults(func=cmd_info)
    impls = implementation_choices()
    run = sub.add_parser(
        "run",
        help="the main job: an op at realistic shapes, checked, timed",
        description="Run an op at realistic shapes on one backend: time (forward, and "
        "forward+backward for the ranker), effective GFLOP/s and a correctness check.",
        epilog=_run_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("op", choices=("ranker", "sparse-mla", "all"), help="the op(s) to run")
    run.add_argument(
        "--implementation",
        choices=impls,
        default=None,
        help=f"backend, one of {', '.join(impls)} (default: the dispatch choice for the "
        "default device, see `attn info`)",
    )
    run.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="ranker batch rows, 1..1000000, and the inputs must fit in the device's "
        "memory (default: 4, or 2 with --small); applies to the ranker only (refused for "
        "sparse-mla, whose shapes are fixed)",
    )
    run.add_argument(
        "--seed",
        type=seed_int,
        default=0,
        help=f"input seed, 0..{MAX_SEED} (default: 0)",
    )
    run.add_argument(
        "--iterations",
        type=iterations_int,
        default=None,
        help="timed calls per mode after a warm-up, 1..10000 (default: 3, or 1 with --interpret)",
    )
    run.add_argument(
        "--small",
        action="store_true",
        help="small shapes (seconds on a CPU; tinier still with --interpret)",
    )
    run.add_argument(
        "--interpret",
        action="store_true",
        help="run a kernel backend in Pallas interpret mode (e.g. --implementation "
        "pallas-tpu on a CPU; slow)",
    )
    run.add_argument(
        "--json",
        type=out_path,
        default=None,
        metavar="PATH",
        help="also save the rows as JSON (a missing folder is created, as for `attn bench "
        "--out`; an existing file is refused unless --overwrite)",
    )
    run.add_argument(
        "--overwrite", action="store_true", help="allow --json to replace an existing file"
    )
    run.set_defaults(func=cmd_run)

    for name, (backend, add) in (backend_commands() if backend_commands_too else {}).items():
        try:
            add(sub)
        except Exception as e:  # a broken backend must not take `attn info` down with it
            print(f"attn: note: {backend}'s `attn {name}` is unavailable ({e})", file=sys.stderr)
    return parser


def ranker_bytes(shape: dict, batch: int, backend: str) -> int:
    """Bytes ``attn run ranker`` holds at once, estimated from the shape before anything
    is allocated: q, k, v, the output and their gradients (bf16), and, on the reference
    (dense XLA), the float32 scores and probabilities [B, Hq, S, S]."""
    seq, hq, hkv, d = (shape[k] for k in ("seq", "hq", "hkv", "d"))
    inputs = batch * seq * (hq + 2 * hkv) * d * 2
    out = batch * seq * hq * d * 2
    need = 2 * (inputs + out)
    if backend == "reference":
        need += 2 * batch * hq * seq * seq * 4
    return need


def _check_memory(args: argparse.Namespace) -> str | None:
    """Refuse a ``--batch`` whose tensors cannot fit in the device's memory."""
    if args.op not in ("ranker", "all") or args.batch is None:
        return None
    shape = RANKER_SHAPES[_shape_name(args.small, args.interpret)]
    try:
        backend, _ = select_backend("ranker_attention", args.implementation)
    except BackendUnavailableError:
        return None  # cmd_run reports it
    need = ranker_bytes(shape, args.batch, backend)
    have = available_memory()
    if have is None or need <= have[0]:
        return None
    return (
        f"--batch: got {args.batch}, whose ranker tensors (S{shape['seq']} Hq{shape['hq']}/"
        f"Hkv{shape['hkv']} D{shape['d']} bf16 on {backend}) need about {gib(need)}, more "
        f"than the {gib(have[0])} {have[1]}; use a smaller --batch"
    )


def _check_args(args: argparse.Namespace) -> str | None:
    """Checks argparse cannot express; the one-line error, or None."""
    if args.command == "run":
        if args.batch is not None and args.op == "sparse-mla":
            return (
                f"--batch: got {args.batch}; it sets the ranker's batch rows and does not "
                "apply to sparse-mla (its flat and ragged shapes are fixed; --small for "
                "smaller ones)"
            )
        if args.json is not None:
            problem = check_out_file(args.json, overwrite=args.overwrite)
            if problem:
                return problem
        return _check_memory(args)
    check = getattr(args, "check", None)  # a backend's command
    return check(args) if check is not None else None


BUILT_IN_COMMANDS = ("info", "run")
# Commands backends add, and the backends that add them: named here so that `attn bench`
# without any of them says what to install (argparse alone would say "invalid choice:
# 'bench'"). Where several are installed, backend_commands() picks one per command.
BACKEND_COMMANDS = {"bench": ("mosaic-gpu", "pallas-tpu"), "tune": ("mosaic-gpu", "pallas-tpu")}


def _backend_commands_epilog() -> str:
    by_backend: dict[str, list[str]] = {}
    for name, backends in BACKEND_COMMANDS.items():
        for backend in backends:
            by_backend.setdefault(backend, []).append(f"`attn {name}`")
    lines = [
        f"{' and '.join(names)} {'come' if len(names) > 1 else 'comes'} with the {backend} "
        f"backend ({KNOWN_BACKENDS[backend]['dist']}, for {_device_words(backend)});"
        for backend, names in by_backend.items()
    ]
    for name, (first, *others) in BACKEND_COMMANDS.items():
        if others:
            on = ", ".join(f"{b}'s on {_device_words(b)}" for b in others)
            lines.append(f"with both installed, `attn {name}` is {on}, else {first}'s;")
    return "\n".join([*lines, "`attn info` lists the installed backends."])


def _device_words(backend: str) -> str:
    """``"a TPU"``: the devices a known backend's kernels run on, in words."""
    named = {"hopper": "a Hopper GPU", "tpu": "a TPU"}
    devices = KNOWN_BACKENDS[backend].get("devices") or ("any device",)
    return " or ".join(named.get(d, d) for d in devices)


def _missing_backend_command(name: str) -> str:
    """The error for ``attn NAME`` when no backend that adds NAME added it."""
    backends = BACKEND_COMMANDS[name]
    dists = " or ".join(KNOWN_BACKENDS[b]["dist"] for b in backends)
    loaded = [b for b in backends if b in installed_backends()]
    if loaded:
        return (
            f"`attn {name}` comes with {dists}; {KNOWN_BACKENDS[loaded[0]]['dist']} is "
            "installed but did not load (`attn info` says why)"
        )
    if len(backends) == 1:
        info = KNOWN_BACKENDS[backends[0]]
        return f"`attn {name}` comes with {info['dist']}, which is not installed: {info['install']}"
    installs = " or ".join(
        f"{KNOWN_BACKENDS[b]['install']} (for {_device_words(b)})" for b in backends
    )
    return f"`attn {name}` comes with {dists}, neither of which is installed: {installs}"


def _innermost_parser(parser: OneLineParser, argv: list[str]) -> OneLineParser:
    """The (sub)command parser ``argv`` names last: ``attn run ranker --bogus`` is an
    error of ``attn run``, not of ``attn``."""
    for word in argv:
        commands = parser.commands()
        if word in commands:
            parser = commands[word]
    return parser


def backend_commands() -> dict:
    """The subcommands installed backends add (``attn bench`` and ``attn tune`` from the
    Hopper backend, ``attn bench`` from the TPU one): name -> (backend, function adding
    the subparser).

    Each backend's ``attn.backends`` entry point module may define ``cli_commands()``;
    it is loaded through the entry point (``dispatch.load_backend``), so attn-common
    names no backend module. A name that several backends claim goes to the one whose
    devices (``KNOWN_BACKENDS``) include the default device's class (``device_class``:
    only then is the device looked up), else to the first in name order.
    """
    claims: dict[str, list] = {}
    for backend in sorted(installed_backends()):
        try:
            module = load_backend(backend)
        except BackendUnavailableError:
            continue
        commands = getattr(module, "cli_commands", None)
        if commands is None:
            continue
        for name, add in commands().items():
            claims.setdefault(name, []).append((backend, add))
    return {name: _claim_for_this_device(found) for name, found in claims.items()}


def _claim_for_this_device(claims: list):
    """The ``(backend, add)`` claim of a command for the default device (see
    :func:`backend_commands`)."""
    if len(claims) == 1:
        return claims[0]
    here = device_class()
    for backend, add in claims:
        if here in (KNOWN_BACKENDS.get(backend, {}).get("devices") or ()):
            return backend, add
    return claims[0]


# XLA's CPU client runs programs on an intra-op pool of NPROC threads (else one per usable
# core). The Mosaic GPU interpreter runs each warpgroup of a kernel as its own program on
# its own thread, blocking on the others at barriers: with fewer threads than programs
# one never runs. `attn run sparse-mla --implementation mosaic-gpu --interpret --small`
# (3 warpgroups) hung for ever pinned to one core (0 % CPU for 13 min under taskset -c 0;
# 38 s with NPROC=16). The repository's conftest.py sets the same floor for the tests.
MIN_XLA_CPU_THREADS = 16


def _enough_xla_cpu_threads() -> None:
    """Raise NPROC to ``MIN_XLA_CPU_THREADS`` before JAX creates its CPU client (no effect
    once a JAX backend exists in this process)."""
    if int(os.environ.get("NPROC", "0") or 0) < MIN_XLA_CPU_THREADS:
        os.environ["NPROC"] = str(MIN_XLA_CPU_THREADS)


def main(argv: list[str] | None = None) -> int:
    _enough_xla_cpu_threads()
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(backend_commands_too=command not in BUILT_IN_COMMANDS)
    # Unknown flags first: `attn --bogus` names --bogus (argparse would only say that a
    # command is missing).
    if command in BACKEND_COMMANDS and command not in parser.commands():
        parser.error(_missing_backend_command(command))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _innermost_parser(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        choices = ", ".join(parser.commands())
        parser.error(f"a command is required, one of: {choices}")
    args.argv = argv
    problem = _check_args(args)
    if problem:
        sub = getattr(args, "error_prog", None) or f"attn {args.command}"
        print(f"{sub}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except BackendUnavailableError as e:
        print(f"attn: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
