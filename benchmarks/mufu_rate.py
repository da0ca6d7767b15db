"""MUFU and FMA-pipe issue rates of an H200 SM, measured with a Mosaic GPU kernel.

The ranker forward's softmax spends ~1670 cycles per KV step on ~570 SASS instructions
per thread (docs/ranker_gpu.md, "A step's timeline"). Whether that is the multi-function
unit's throughput or the dependency chain decides what can shorten it. This kernel
answers the first part: each warpgroup holds a 64 x 128 float32 tile in registers (64
values per thread, independent of each other) and applies one operation to every value
``--iterations`` times; ``--warpgroups`` warpgroups per SM (1 = one warp per
scheduler, as in the forward's ping-pong; 2 = two). The cycles per warp instruction
per scheduler follow from the CUPTI time and the SM clock::

    python benchmarks/mufu_rate.py --iterations 4096 --warpgroups 1 2
    python benchmarks/mufu_rate.py --ops ex2+fma4 rsqrt+fma6 --values 64

Operations: ``ex2``, ``rsqrt`` and ``tanh`` (``.approx.ftz.f32``, one MUFU
instruction each; ``ex2`` of the value's negation, a free operand modifier, keeps the
chain bounded) and ``fma`` (one FFMA) for scale. ``rcp`` is not offered: a chain of
reciprocals is the identity every second step, and the compiler removed it (at 8dd8460,
``results/mufu_rate_8dd8460.log``); so was ``rcp`` after ``ex2`` of a negation. Each
value's chain is dependent, so with 64 chains per thread the rate is the unit's
throughput once 64 chains cover its latency; ``--values 16`` (16 chains) shows the
latency side.
"""

from __future__ import annotations

import argparse
import subprocess

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.fastmath import ptx_unary_tile

ROWS = 64
INSTRUCTIONS = {
    "ex2": "ex2.approx.ftz.f32",
    "rsqrt": "rsqrt.approx.ftz.f32",
    "tanh": "tanh.approx.f32",
}


def _one(op: str):
    if op == "fma":
        return lambda x: x * 0.999 + 0.001
    if op == "ex2":
        return lambda x: ptx_unary_tile(-x, INSTRUCTIONS[op])
    return lambda x: ptx_unary_tile(x, INSTRUCTIONS[op])


def _step(op: str):
    """``op`` or a ``+``-joined sequence applied in turn (``ex2+tanh``, ``ex2+fma4``:
    four FMAs), which shows whether a warp's MUFU and FMA-pipe instructions overlap."""
    parts = []
    for name in op.split("+"):
        count = int(name[3:]) if name.startswith("fma") and name[3:] else 1
        parts += [_one("fma" if name.startswith("fma") else name)] * count

    def step(x):
        for part in parts:
            x = part(x)
        return x

    return step


def build(op: str, iterations: int, warpgroups: int, values: int, programs: int):
    """A kernel of ``programs`` programs x ``warpgroups`` warpgroups, each applying ``op``
    ``iterations`` times to a ``64 x (2 * values)`` tile (``values`` per thread)."""
    cols = 2 * values
    step = _step(op)
    layout = plgpu.Layout.WGMMA

    def body(out_ref, smem):
        wg = lax.axis_index("wg")
        program = lax.axis_index("program")
        iota = plgpu.broadcasted_iota(jnp.int32, (ROWS, cols), 1, layout=layout)
        x = iota.astype(jnp.float32) * (0.5 / cols) + 0.25
        x = lax.fori_loop(0, iterations, lambda _, x: step(x), x)
        smem.at[wg][...] = x
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem.at[wg], out_ref.at[program, wg])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((programs, warpgroups, ROWS, cols), jnp.float32),
        scratch_types=[plgpu.SMEM((warpgroups, ROWS, cols), jnp.float32)],
        grid=(programs,),
        grid_names=("program",),
        num_threads=warpgroups,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def sm_clock_mhz() -> float:
    """The SM clock nvidia-smi reports (the H200 runs at its maximum under load)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", default=["fma", "ex2", "rsqrt", "tanh"])
    parser.add_argument("--iterations", type=int, default=4096)
    parser.add_argument("--warpgroups", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--values", nargs="+", type=int, default=[64, 16])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    sms = jax.devices()[0].core_count
    mhz = sm_clock_mhz()
    print(f"{jax.devices()[0].device_kind}: {sms} SMs, SM clock {mhz:.0f} MHz (max)")
    for values in args.values:
        for warpgroups in args.warpgroups:
            for op in args.ops:
                fn = jax.jit(build(op, args.iterations, warpgroups, values, sms))
                ms, _ = device_ms(fn, iterations=args.repeats)
                cycles = ms * 1e-3 * mhz * 1e6
                # Warp instructions per scheduler: 4 warps per warpgroup over 4 schedulers.
                # A "+"-joined op counts each of its instructions.
                ops = sum(int(n[3:]) if n.startswith("fma") and n[3:] else 1 for n in op.split("+"))
                per_scheduler = warpgroups * values * args.iterations * ops
                print(
                    f"{op:6s} {values:3d} values/thread, {warpgroups} WG/SM: {ms:.3f} ms, "
                    f"{cycles / per_scheduler:.2f} cycles per warp instruction per scheduler",
                    flush=True,
                )


if __name__ == "__main__":
    main()
