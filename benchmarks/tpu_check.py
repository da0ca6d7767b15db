"""The TPU kernels natively on a TPU: correctness against the reference and wall-clock times.

For a TPU machine (one chip; no device profiler is used):
* the ranker suite's four cases at reduced batch (the reference's dense scores must fit
  a v5e's 15.7 GiB), forward and forward + backward, the TPU kernels against
  ``attn_reference`` (rel L2 of out, LSE, dq, dk, dv; wall-clock median of 10 calls each);
* the FP8 exactness check: each TPU kernel over an ``Fp8LatentCache``, its rows
  dequantized in VMEM (``fp8_dequantize=False``), against the same compiled kernel over
  ``bf16(dequantize_latent_cache(cache))``, and the op's default path against it, bit
  for bit (out and LSE), with the rows no query attends holding NaN bytes, NaN / Inf / 0
  scales and NaN rope, and -1 / duplicate ids in the selection; at 32- and 64-token
  units;
* flat sparse MLA, 1024 queries x 2048 selected tokens (as units of 32 and of 64) of a
  32K cache at H 16 and 64, bf16 and FP8 caches (FP8: the op's default, here the bf16
  rows copied first, and the rows dequantized in VMEM), the per-query and the
  query-blocked kernels and the reference (rel L2 against the reference on the same cache, the count
  of non-finite outputs beyond the reference's, and the selected rows' HBM bytes).
Writes ``<out>/tpu_check.json`` after every row. ``benchmarks/tpu_run.sh`` runs it with
the conformance tests. ``--smoke``: tiny sparse-MLA shapes in interpret mode, any
machine; ``--no-ranker`` leaves the ranker rows out.
"""

import argparse
import json
import os
import statistics
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import attn_pallas_tpu as tpu
import attn_reference as ref
from attn_common import dequantize_latent_cache, quantize_latent_cache
from attn_common.cli_args import provenance, wall_times
from attn_common.suite import ranker_case

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--out", default=os.environ.get("OUT", "."))
p.add_argument("--smoke", action="store_true")
p.add_argument("--no-ranker", action="store_true")
ARGS = p.parse_args()
OUT, SMOKE = ARGS.out, ARGS.smoke
EXTRA = dict(interpret=True) if SMOKE else {}
rows = []
print(jax.__version__, jax.devices(), flush=True)


def wall_ms(f, *args, n: int = 1 if SMOKE else 10) -> float:
    """Median wall-clock time of ``f(*args)`` over ``n`` calls after one warm-up, in ms."""
    return statistics.median(wall_times(f, *args, repeats=n)) * 1e3


def rel(got, want) -> tuple[float, int]:
    """Rel L2 of ``got`` against ``want`` over the elements where ``want`` is finite, and
    how many more non-finite elements ``got`` has than ``want``."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = np.isfinite(want)
    diff = np.linalg.norm((got - want)[finite]) / max(np.linalg.norm(want[finite]), 1e-30)
    return float(diff), int((~np.isfinite(got)).sum() - (~finite).sum())


def record(**row) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)
    result = {**provenance(), "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    with open(os.path.join(OUT, "tpu_check.json"), "w") as f:
        json.dump({**result, "rows": rows}, f, indent=1)


def ranker_row(name: str, batch: int) -> None:
    """One ranker case: the kernels against the reference, forward and gradients."""
    case = ranker_case(name).scaled(batch)
    q, k, v, do = case.inputs(0)
    bounds = jnp.asarray(case.bounds(0))

    def forward(impl):
        return jax.jit(lambda q, k, v, b: impl.ranker_attention(q, k, v, b, cap=case.cap,
                                                                return_lse=True))  # fmt: skip

    def grad(impl):
        def loss(q, k, v, b):
            out = impl.ranker_attention(q, k, v, b, cap=case.cap)
            return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    ft, fr, gt, gr = forward(tpu), forward(ref), grad(tpu), grad(ref)
    args = (q, k, v, bounds)
    (ot, lt), (orf, lr) = ft(*args), fr(*args)
    dt, dr = gt(*args), gr(*args)
    errors = dict(out=rel(ot, orf), lse=rel(lt, lr))
    errors.update({n: rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), dt, dr, strict=True)})
    record(
        op="ranker", case=name, batch=batch, errors=errors,
        fwd_ms=dict(tpu=wall_ms(ft, *args), reference=wall_ms(fr, *args)),
        fwd_bwd_ms=dict(tpu=wall_ms(gt, *args), reference=wall_ms(gr, *args)),
    )  # fmt: skip


def flat_selection(queries: int, kv_len: int, top_k: int, read_block: int, seed: int = 0):
    """Positions ``[1, S]`` (the last ``S`` of ``kv_len`` tokens) and unit ids ``[1, S,
    top_k]``: distinct causal units, -1 padded where a query has fewer."""
    rng = np.random.default_rng(seed)
    positions = np.arange(kv_len - queries, kv_len)
    idx = []
    for units in positions // read_block + 1:
        if units >= top_k:
            idx.append(rng.choice(units, size=top_k, replace=False))
        else:
            idx.append(np.pad(rng.permutation(units), (0, top_k - units), constant_values=-1))
    return jnp.asarray(positions, jnp.int32)[None], jnp.asarray(np.stack(idx), jnp.int32)[None]


KERNELS = {"tpu-per-query": tpu.sparse_mla_attention, "tpu-qblock": tpu.sparse_mla_attention_qblock}


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def fp8_exact_row(read_block: int, heads: int = 16, queries: int = 256) -> None:
    """Each TPU kernel over a dirty FP8 cache against itself over the bf16 rows it
    dequantizes to: differing bits of out and LSE (NaN-for-NaN counts as equal)."""
    top_k, kv_len = 2048 // read_block, 8192 - read_block // 2  # the last unit half unread
    if SMOKE:
        top_k, kv_len, queries = 4, 256 - read_block // 2, 8
    tokens = kv_len + read_block // 2
    positions, idx = flat_selection(queries, kv_len, top_k, read_block, seed=1)
    idx = idx.at[:, ::7, 1].set(-1).at[:, ::5, 2].set(idx[:, ::5, 0])  # -1 and duplicates
    kq, kkv = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (1, queries, heads, 576), jnp.bfloat16)
    clean = quantize_latent_cache(jax.random.normal(kkv, (1, tokens, 576), jnp.float32) * 3)
    unread = jnp.arange(tokens) >= kv_len  # no position reaches them: poison every field
    lat = jnp.where(unread[None, :, None], jnp.uint8(0x7F), clean.latent.view(jnp.uint8))
    scale = jnp.where(unread[None, :, None], jnp.array([jnp.nan, jnp.inf, 0.0, -jnp.inf]),
                      clean.scale)  # fmt: skip
    rope = jnp.where(unread[None, :, None], jnp.bfloat16(jnp.nan), clean.rope)
    dirty = type(clean)(latent=lat.view(jnp.float8_e4m3fn), scale=scale, rope=rope)
    rows = dequantize_latent_cache(dirty).astype(jnp.bfloat16)
    want_ref = ref.sparse_mla_attention(q, dirty, idx, positions, sm_scale=576**-0.5,
                                        kv_lora_rank=512, read_block=read_block,
                                        return_lse=True)  # fmt: skip

    def differing(got, want) -> dict:
        diff = {}
        for part, a, b in zip(("out", "lse"), got, want, strict=True):
            a, b = np.asarray(a), np.asarray(b)
            nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
            diff[part] = int((nan_a != nan_b).sum() + (_bits(a) != _bits(b))[~nan_a & ~nan_b].sum())
        return diff

    results = {}
    for name, fn in KERNELS.items():

        def call(fp8_dequantize, fn=fn):
            return jax.jit(lambda q, c: fn(q, c, idx, positions, sm_scale=576**-0.5,
                                           kv_lora_rank=512, read_block=read_block,
                                           return_lse=True, fp8_dequantize=fp8_dequantize,
                                           **EXTRA))  # fmt: skip

        try:
            stored = tpu.TpuFp8LatentCache.from_cache(dirty)
            got, want = call(False)(q, stored), call(False)(q, rows)
            default = call(None)(q, stored)
            results[name] = dict(differing=differing(got, want),
                                 default_differing=differing(default, got),
                                 ref_err=rel(got[0], want_ref[0]),
                                 lse_err=rel(got[1], want_ref[1]))  # fmt: skip
        except Exception as e:
            traceback.print_exc()
            results[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    record(op="sparse_mla_fp8_exact", heads=heads, queries=queries, units=top_k,
           read_block=read_block, kv_len=kv_len, results=results)  # fmt: skip


def sparse_row(heads: int, top_k: int, queries: int, kv_len: int, read_block: int) -> None:
    """Flat sparse MLA at one head count: each kernel on a bf16 and an FP8 cache."""
    kq, kkv = jax.random.split(jax.random.key(0))
    q = jax.random.normal(kq, (1, queries, heads, 576), jnp.bfloat16)
    kv = jax.random.normal(kkv, (1, kv_len, 576), jnp.bfloat16)
    positions, idx = flat_selection(queries, kv_len, top_k, read_block)
    fp8 = quantize_latent_cache(kv)
    kw = dict(sm_scale=576**-0.5, kv_lora_rank=512, read_block=read_block)

    def call(fn, extra):
        return jax.jit(lambda q, c: fn(q, c, idx, positions, **kw, **extra))

    reference = call(ref.sparse_mla_attention, {})
    want = {"bf16": reference(q, kv), "fp8": reference(q, fp8)}
    impls = {name: (fn, EXTRA) for name, fn in KERNELS.items()}
    impls["reference"] = (ref.sparse_mla_attention, {})
    caches = {"bf16": kv, "fp8": fp8, "fp8-vmem": fp8}
    results = {}
    for iname, (fn, extra) in impls.items():
        for cname, cache in caches.items():
            if cname != "bf16" and iname != "reference":
                cache = tpu.TpuFp8LatentCache.from_cache(fp8)
                extra = {**extra, "fp8_dequantize": False if cname == "fp8-vmem" else None}
            elif cname == "fp8-vmem":
                continue  # the reference has one FP8 path
            f = call(fn, extra)
            try:
                err = rel(f(q, cache), want[cname.removesuffix("-vmem")])
                results[f"{iname}/{cname}"] = dict(ms=wall_ms(f, q, cache), err=err)
            except Exception as e:  # one failure is reported, the rest still run
                traceback.print_exc()
                results[f"{iname}/{cname}"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    rows_read = int((np.asarray(idx) >= 0).sum()) * read_block
    flops = 2.0 * heads * top_k * read_block * (576 + 512) * queries
    record(
        op="sparse_mla", heads=heads, queries=queries, units=top_k, read_block=read_block,
        kv_len=kv_len, flops=flops, rows_read=rows_read,
        hbm_bytes=dict(bf16=rows_read * 640 * 2, fp8=rows_read * 768), results=results,
    )  # fmt: skip


def main() -> None:
    ranker_cases = (("phoenix", 8), ("small-d64", 32), ("long", 2), ("ragged", 8))
    for name, batch in () if SMOKE or ARGS.no_ranker else ranker_cases:
        try:
            ranker_row(name, batch)
        except Exception as e:
            traceback.print_exc()
            record(op="ranker", case=name, error=f"{type(e).__name__}: {str(e)[:500]}")
    for rb in (32, 64):
        fp8_exact_row(rb)
    for rb in (32, 64):
        queries, kv_len, top_k = (8, 512, 4) if SMOKE else (1024, 32768, 2048 // rb)
        for heads in (16,) if SMOKE else (16, 64):
            try:
                sparse_row(heads, top_k, queries=queries, kv_len=kv_len, read_block=rb)
            except Exception as e:
                traceback.print_exc()
                record(op="sparse_mla", heads=heads, read_block=rb,
                       error=f"{type(e).__name__}: {str(e)[:500]}")  # fmt: skip


if __name__ == "__main__":
    main()
