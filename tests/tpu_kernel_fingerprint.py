"""Fingerprints of the TPU sparse-MLA kernels, to show a refactor changed nothing.

For flat and paged shapes, lowers ``jax.grad`` (through out and the LSE, w.r.t. q and the
cache) of ``attn_pallas_tpu.sparse_mla_attention`` and ``sparse_mla_attention_qblock``
for TPU on any host (``jax.export``, ``platforms=["tpu"]``) and prints a hash of each
Mosaic kernel the program holds, in the order of the lowered text (a ``lax.cond`` holds
both branches): the ``tpu_custom_call``'s backend config, which carries the serialized
kernel module, its grid, block specs and compiler parameters (the scoped VMEM limit
included). Source locations are left out of the lowering
(``jax_traceback_in_locations_limit = 0``), so the hashes do not depend on file names,
line numbers or how the code is factored: equal hashes mean the chip runs the same
kernels. Compare two checkouts:

    PYTHONPATH=<old>/common/src:<old>/packages/attn-reference/src:<old>/packages/attn-pallas-tpu/src \\
        python tests/tpu_kernel_fingerprint.py > old.txt
    python tests/tpu_kernel_fingerprint.py > new.txt && diff old.txt new.txt

``--only NAME`` lowers one case.
"""

from __future__ import annotations

import argparse
import hashlib
import re

import jax
import jax.numpy as jnp

import attn_pallas_tpu as tpu

SD, BF16, I32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
SM_SCALE = 0.04

# name -> (op, queries, heads, cache tokens, top_k units, unit, knobs); flat cache
# [1, T, 576] bf16.
FLAT = {
    "per-query-flat-h64-u16": ("per_query", 512, 64, 16384, 32, 16, {}),
    "qblock-flat-h16-u64": ("qblock", 512, 16, 16384, 16, 64, {}),
    "qblock-flat-h16-u64-qb64": ("qblock", 512, 16, 16384, 16, 64, {"query_block": 64}),
    "qblock-flat-h128-u128": ("qblock", 512, 128, 16384, 16, 128, {}),
}
# name -> (op, queries, heads, page, knobs); a paged bf16 pool of 32K rows, 3 requests,
# 2048 selected tokens a query.
PAGED = {
    "per-query-paged-h64-p16": ("per_query", 1024, 64, 16, {}),
    "qblock-paged-h16-p64": ("qblock", 1024, 16, 64, {}),
    "qblock-paged-h64-p16-qb16": ("qblock", 1024, 64, 16, {"query_block": 16}),
}
OPS = {"per_query": "sparse_mla_attention", "qblock": "sparse_mla_attention_qblock"}


def _grad(op: str, **kw):
    fn = getattr(tpu, OPS[op])

    def f(q, kv, *data):
        def loss(q, kv):
            out, lse = fn(q, kv, *data, sm_scale=SM_SCALE, return_lse=True, **kw)
            return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jax.grad(loss, argnums=(0, 1))(q, kv)

    return f


def _flat(op, queries, heads, tokens, top_k, unit, knobs):
    avals = (
        SD((1, queries, heads, 576), BF16), SD((1, tokens, 576), BF16),
        SD((1, queries, top_k), I32), SD((1, queries), I32),
    )  # fmt: skip
    return _grad(op, read_block=unit, **knobs), avals


def _paged(op, queries, heads, page, knobs):
    pages, seqs = 32768 // page, 3

    def f(q, cache, idx, pos, sid, seq_lens, cu_kv, table):
        tables = dict(q_seq_id=sid, seq_lens=seq_lens, cu_kv_lens=cu_kv, page_indices=table)
        grad = _grad(op, read_block=page, page_size=page, **tables, **knobs)
        return grad(q, cache, idx, pos)

    avals = (
        SD((1, queries, heads, 576), BF16), SD((pages, page // 2, 2, 640), BF16),
        SD((1, queries, 2048 // page), I32), SD((1, queries), I32), SD((queries,), I32),
        SD((seqs,), I32), SD((seqs + 1,), I32), SD((pages,), I32),
    )  # fmt: skip
    return f, avals


def kernel_hashes(fn, avals) -> list[str]:
    """The hash of each ``tpu_custom_call``'s backend config in ``jax.jit(fn)`` lowered
    for TPU at ``avals``, in the order of the lowered text, locations left out."""
    name = "jax_traceback_in_locations_limit"
    before = getattr(jax.config, name)
    jax.config.update(name, 0)
    try:
        text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals).mlir_module()
    finally:
        jax.config.update(name, before)
    configs = re.findall(r'tpu_custom_call.*?backend_config = "([^"]*)"', text, re.S)
    return [hashlib.sha256(c.encode()).hexdigest()[:16] for c in configs]


def cases(only: str | None = None):
    """``(name, fn, avals)`` of every case (or the one named)."""
    out = [(name, *_flat(*spec)) for name, spec in FLAT.items()]
    out += [(name, *_paged(*spec)) for name, spec in PAGED.items()]
    picked = [c for c in out if only in (None, c[0])]
    if not picked:
        raise SystemExit(f"--only: no case {only!r} (cases: {', '.join(c[0] for c in out)})")
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one case name")
    args = parser.parse_args()
    for name, fn, avals in cases(args.only):
        print(name, " ".join(kernel_hashes(fn, avals)), flush=True)


if __name__ == "__main__":
    main()
