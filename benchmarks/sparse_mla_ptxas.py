"""ptxas's register report (stack frame, spills) of Hopper sparse-MLA kernel variants.

Compiles each named variant of ``benchmarks/sparse_mla_variants.py`` at a small shape
with Mosaic GPU's ptxas dump on and prints the spill line of each (one GPU needed)::

    python benchmarks/sparse_mla_ptxas.py --out /tmp/r 'one-way max exchange'

Writes ``sparse_mla_ptxas.txt`` into ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def variant_fn(name: str):
    """``fn(q, store, rows, counts)``: variant ``name`` of the variants script, jitted."""
    import jax

    sys.path.insert(0, str(Path(__file__).parent))
    import sparse_mla_variants as variants

    attend, config = variants.variant_attend(variants.VARIANTS[name])
    return jax.jit(functools.partial(attend, sm_scale=0.07, dv=512, config=config))


def small_args():
    """A small problem (8 tokens, 64 heads, 2048 rows each) to compile at."""
    import jax.numpy as jnp

    return (
        jnp.zeros((8, 64, 576), jnp.bfloat16),
        jnp.zeros((1024, 576), jnp.bfloat16),
        jnp.zeros((8, 2048), jnp.int32),
        jnp.full((8,), 2048, jnp.int32),
    )


def compile_one(name: str) -> None:
    """Compile and run variant ``name`` once (in a child process with the dump flags)."""
    import jax

    jax.block_until_ready(variant_fn(name)(*small_args()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compile-one", help=argparse.SUPPRESS)
    parser.add_argument("variants", nargs="*")
    args = parser.parse_args()
    if args.compile_one:
        compile_one(args.compile_one)
        return
    lines = []
    for name in args.variants:
        with tempfile.TemporaryDirectory() as dump:
            env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dump)
            cmd = [sys.executable, __file__, "--out", str(args.out), "--compile-one", name]
            rc = subprocess.run(cmd, env=env, capture_output=True).returncode
            report = [
                line.strip()
                for f in sorted(Path(dump).glob("*ptxas*"))
                for line in f.read_text().splitlines()
                if "stack frame" in line or "Used" in line or "warning" in line.lower()
            ]
        lines.append(f"{name}: rc={rc}; " + "; ".join(report))
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sparse_mla_ptxas.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
