"""Mosaic GPU's compiler dumps (PTX, ptxas report) of the Hopper kernels, and what ptxas
spills in each loop.

On the GPU machine (one GPU): compile each target in a child process with
``MOSAIC_GPU_DUMP_{PTX,PTXAS}`` on, pack what Mosaic GPU wrote into
``--out/<target>.tar.gz`` and print ptxas's register and spill lines::

    python benchmarks/kernel_dump.py --out /tmp/r sparse ranker-fwd ranker-bwd

Anywhere (no GPU): ``--loops FILE.ptx`` compiles a dumped PTX file for sm_90a with
``ptxas``, disassembles it with ``nvdisasm`` (both on ``PATH``: the PyPI wheels
``nvidia-cuda-nvcc`` and ``nvidia-cuda-nvdisasm`` carry them; the GPU machine has no
``nvdisasm``, so Mosaic GPU's own SASS dump stays empty there) and prints, per loop
with wgmma instructions, its SASS instruction count and its HGMMA, MUFU and spill
(STL/LDL) instructions. A spill in a step loop costs every step; that is how the
dk/dv kernel's hoisted K/V descriptors showed (``ranker_bwd_pipelined._build_dkv_kernel``).

Targets: ``sparse`` (the sparse-MLA kernel as it ships) or ``sparse:<name>``
(a variant of ``benchmarks/sparse_mla_variants.py``), or ``sparse-file:<kernel file>:<block_k>,<num_stages>,<exchange>`` (another
revision's ``sparse_mla_kernel.py``, as ``git show REV:path`` writes it, at that
config), at 8 tokens x 64 heads x 2048 rows; ``ranker-fwd`` (phoenix's forward at the
tuned config, 2 rows of the batch), ``ranker-bwd`` (phoenix's backward kernels). ptxas's
lines also go to ``--out/ptxas.txt``. (This script took over
``benchmarks/sparse_mla_ptxas.py``, which older result files name.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TARGETS = ("sparse", "ranker-fwd", "ranker-bwd")
SPARSE_DEFAULT = "64-row split"  # the variant that is SparseMlaKernelConfig()


def sparse_file_target(name: str) -> tuple[Path, tuple[int, int, str]]:
    """``(kernel file, (block_k, num_stages, exchange))`` of a ``sparse-file:`` target."""
    path, _, spec = name[len("sparse-file:") :].rpartition(":")
    fields = spec.split(",")
    if not Path(path).is_file() or len(fields) != 3 or not all(f.isdigit() for f in fields[:2]):
        raise SystemExit(f"target {name!r}: expected sparse-file:<file>:<bk>,<stages>,<exchange>")
    return Path(path), (int(fields[0]), int(fields[1]), fields[2])


def check_target(name: str) -> None:
    """Raise ``SystemExit`` naming the choices if ``name`` is no target."""
    if name.startswith("sparse-file:"):
        sparse_file_target(name)
    elif name.startswith("sparse:"):
        variants = sparse_variants().VARIANTS
        if name[len("sparse:") :] not in variants:
            raise SystemExit(f"target {name!r}: sparse variants are {list(variants)}")
    elif name not in TARGETS:
        raise SystemExit(f"target: got {name!r}, expected one of {TARGETS} or sparse:<variant>")


def sparse_variants():
    sys.path.insert(0, str(Path(__file__).parent))
    import sparse_mla_variants

    return sparse_mla_variants


def target_fn(name: str):
    """``(fn, args)``: target ``name``'s jitted computation and its inputs."""
    import functools

    import jax
    import jax.numpy as jnp

    if name == "sparse" or name.startswith(("sparse:", "sparse-file:")):
        variants = sparse_variants()
        if name.startswith("sparse-file:"):
            path, config_args = sparse_file_target(name)
            module = variants.load_module(path)
            attend = module.sparse_mla_rows_attention
            config = module.SparseMlaKernelConfig(*config_args)
        else:
            variant = name.partition(":")[2] or SPARSE_DEFAULT
            attend, config = variants.variant_attend(variants.VARIANTS[variant])
        fn = jax.jit(functools.partial(attend, sm_scale=0.07, dv=512, config=config))
        args = (
            jnp.zeros((8, 64, 576), jnp.bfloat16),
            jnp.zeros((1024, 576), jnp.bfloat16),
            jnp.zeros((8, 2048), jnp.int32),
            jnp.full((8,), 2048, jnp.int32),
        )
        return fn, args
    from attn_common import ranker_case
    from attn_mosaic_gpu import ranker_attention

    case = ranker_case("phoenix").scaled(2)
    q, kk, v, dout = case.inputs()
    bounds = jnp.asarray(case.bounds())

    def fwd(q, kk, v):
        return ranker_attention(q, kk, v, bounds, cap=case.cap)

    if name == "ranker-fwd":
        return jax.jit(fwd), (q, kk, v)
    grads = jax.grad(lambda *a: (fwd(*a).astype(jnp.float32) * dout).sum(), (0, 1, 2))
    return jax.jit(grads), (q, kk, v)


def compile_target(name: str) -> None:
    """Compile and run target ``name`` once (in the child process that has the dump flags)."""
    import jax

    fn, args = target_fn(name)
    jax.block_until_ready(fn(*args))


def dump(targets: list[str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in targets:
        check_target(name)
    summary = []
    for name in targets:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name)  # a file name the device hands back
        with tempfile.TemporaryDirectory() as tmp:
            flags = dict.fromkeys(("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS"), "1")
            env = dict(os.environ, MOSAIC_GPU_DUMP_TO=tmp, **flags)
            cmd = [sys.executable, __file__, "--compile-one", name]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            files = sorted(f for f in Path(tmp).iterdir() if f.suffix in (".ptx", ".ptxas"))
            with tarfile.open(out / f"{stem}.tar.gz", "w:gz") as tar:
                for f in files:
                    tar.add(f, arcname=f"{stem}/{f.name}")
            summary.append(f"{name}: rc={proc.returncode}, {len(files)} files")
            if proc.returncode:
                summary.append(proc.stderr[-3000:])
            for f in files:
                if f.suffix == ".ptxas":
                    for line in f.read_text(errors="replace").splitlines():
                        if "Used" in line or "spill" in line or "warning" in line.lower():
                            summary.append(f"  {f.name}: {line.strip()}")
        print("\n".join(summary[-50:]), flush=True)
    (out / "ptxas.txt").write_text("\n".join(summary) + "\n")


def sass_loops(sass: str) -> list[dict]:
    """The innermost loops of a SASS listing (a backward branch to an earlier label)
    that hold wgmma instructions, with their instruction counts."""
    lines = sass.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        if m := re.match(r"^\.(L_x_\d+):", line.strip()):
            labels[m.group(1)] = i
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\()?\.?(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)] : i + 1]

            def count(pattern, body=body):
                return sum(1 for x in body if re.search(pattern, x))

            if count("HGMMA"):
                loops.append({
                    "lines": (labels[m.group(1)], i),
                    "instructions": count(r"/\*[0-9a-f]{4,5}\*/"),
                    **{op: count(op) for op in ("HGMMA", "MUFU", "STL", "LDL")},
                })  # fmt: skip

    def inside(a, b):
        return a is not b and b["lines"][0] <= a["lines"][0] and a["lines"][1] <= b["lines"][1]

    # innermost only: the step loops (a barrier wait's retry branch also jumps back)
    return [a for a in loops if not any(inside(b, a) for b in loops)]


def loops_report(ptx: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        report = subprocess.run(
            ["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
        print("\n".join(x.strip() for x in report.splitlines() if "spill" in x or "Used" in x))
        sass = subprocess.run(
            ["nvdisasm", "-c", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    for loop in sass_loops(sass):
        print(loop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the dumps go (on the GPU machine)")
    parser.add_argument("--loops", type=Path, help="a dumped .ptx file to analyse (anywhere)")
    parser.add_argument("--compile-one", help=argparse.SUPPRESS)
    parser.add_argument("targets", nargs="*", default=list(TARGETS))
    args = parser.parse_args()
    if args.compile_one:
        compile_target(args.compile_one)
    elif args.loops:
        loops_report(args.loops)
    elif args.out:
        dump(args.targets, args.out)
    else:
        parser.error("give --out (dump on the GPU machine) or --loops FILE.ptx")


if __name__ == "__main__":
    main()
