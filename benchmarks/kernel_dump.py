"""Mosaic GPU's compiler dumps (PTX, SASS, ptxas report) of the Hopper kernels (one GPU).

Compiles each named target in a child process with ``MOSAIC_GPU_DUMP_{PTX,SASS,PTXAS}``
on and packs what Mosaic GPU wrote into ``--out/<target>.tar.gz``; prints ptxas's
register and spill lines. Read the SASS for what the loops keep live (e.g. wgmma
descriptors hoisted out of a loop)::

    python benchmarks/kernel_dump.py --out /tmp/r sparse sparse-opaque-q ranker-fwd

Targets: ``sparse`` (the default sparse-MLA kernel), ``sparse-opaque-q`` (its
``_Static(opaque_q=True)`` experiment), ``ranker-fwd`` (phoenix's forward, tuned
config, 2 rows of the batch), ``ranker-bwd`` (phoenix's backward kernels).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TARGETS = ("sparse", "sparse-opaque-q", "ranker-fwd", "ranker-bwd")
# The phoenix backward kernels with extra knobs (ranker_bwd_pipelined._Static).
BWD_KNOBS = {
    "ranker-bwd-opaque": {"opaque_fixed": True},
    "ranker-bwd-240": {"compute_registers": 240},
    "ranker-bwd-opaque-240": {"opaque_fixed": True, "compute_registers": 240},
}
TARGETS += tuple(BWD_KNOBS)


def compile_target(name: str) -> None:
    """Compile and run target ``name`` once (in the child process that has the dump flags)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    if name.startswith("sparse"):
        from attn_mosaic_gpu import sparse_mla_kernel as k

        q = jnp.zeros((8, 64, 576), jnp.bfloat16)
        store = jnp.zeros((1024, 576), jnp.bfloat16)
        rows = jnp.zeros((8, 2048), jnp.int32)
        counts = jnp.full((8,), 2048, jnp.int32)
        q, st = k._padded_static(q, store, sm_scale=0.07, dv=512, config=k.SparseMlaKernelConfig())
        st = dataclasses.replace(st, opaque_q=name == "sparse-opaque-q")
        jax.block_until_ready(k._launch(q, store, rows, counts, st=st, interpret=None))
        return
    from attn_common import ranker_case
    from attn_mosaic_gpu import ranker_attention

    case = ranker_case("phoenix").scaled(2)
    q, kk, v, dout = case.inputs()
    bounds = jnp.asarray(case.bounds())

    def fwd(q, kk, v):
        return ranker_attention(q, kk, v, bounds, cap=case.cap)

    if name == "ranker-fwd":
        jax.block_until_ready(jax.jit(fwd)(q, kk, v))
    elif name in BWD_KNOBS:
        import math

        from attn_mosaic_gpu.ranker_bwd_pipelined import pipelined_bwd
        from attn_mosaic_gpu.tuning import lookup

        b, s, hq, hkv, d = case.batch, case.seq_len, case.q_heads, case.kv_heads, case.head_dim
        fields = dict(
            batch=b, seq_pad=s, q_heads=hq, kv_heads=hkv, head_dim=d,
            sm_scale=1 / math.sqrt(d), cap=case.cap,
        )  # fmt: skip
        tuning = {**lookup(head_dim=d, dtype=q.dtype, cap=case.cap, seq_len=s).backward.knobs()}
        tuning.update(BWD_KNOBS[name])
        vec = jnp.zeros((b, hq, s), jnp.float32)
        got = pipelined_bwd(
            q, kk, v, dout, vec, vec, bounds, st_fields=fields, interpret=None, tuning=tuning
        )
        jax.block_until_ready(got)
    else:
        grads = jax.jit(jax.grad(lambda *a: (fwd(*a).astype(jnp.float32) * dout).sum(), (0, 1, 2)))
        jax.block_until_ready(grads(q, kk, v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compile-one", help=argparse.SUPPRESS)
    parser.add_argument("targets", nargs="*", default=list(TARGETS))
    args = parser.parse_args()
    if args.compile_one:
        compile_target(args.compile_one)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.targets:
        if name not in TARGETS:
            raise SystemExit(f"target: got {name!r}, expected one of {TARGETS}")
        with tempfile.TemporaryDirectory() as dump:
            flags = dict.fromkeys(
                ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_SASS", "MOSAIC_GPU_DUMP_PTXAS"), "1"
            )
            env = dict(os.environ, MOSAIC_GPU_DUMP_TO=dump, **flags)
            cmd = [sys.executable, __file__, "--out", str(args.out), "--compile-one", name]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            files = sorted(Path(dump).iterdir())
            with tarfile.open(args.out / f"{name}.tar.gz", "w:gz") as tar:
                for f in files:
                    tar.add(f, arcname=f"{name}/{f.name}")
            print(f"{name}: rc={proc.returncode}, {len(files)} files", flush=True)
            if proc.returncode:
                print(proc.stderr[-3000:], flush=True)
            for f in files:
                if "ptxas" in f.name:
                    for line in f.read_text(errors="replace").splitlines():
                        if "Used" in line or "spill" in line or "warning" in line.lower():
                            print(f"  {f.name}: {line.strip()}", flush=True)


if __name__ == "__main__":
    main()
