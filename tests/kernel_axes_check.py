"""Every Hopper kernel lowered under ``jax.shard_map`` over a mesh named like its axes.

``lax.axis_index(name)`` in a Mosaic GPU kernel is lowered against the mesh axes of an
enclosing ``shard_map`` before the kernel's own grid and warpgroup axes (jax 0.11,
``pallas/mosaic_gpu/lowering.py``, ``_axis_index_rule``): a kernel axis named like a
mesh axis reads the device's index (``nvshmem_my_pe``, or the collective metadata on
several devices) instead of its program or warpgroup id, and the kernel computes the
wrong rows (seen on two H200s with a grid axis ``"batch"``). Mosaic GPU's interpreter
resolves the names the other way round (the kernel's first), so interpret mode cannot
show it; lowering for CUDA can, on any host. So the kernels take their axis names from
``attn_mosaic_gpu._axes`` (``attn_mgpu_*``), and a mesh must not use those names.

``kernel_cases()`` traces every Mosaic GPU kernel of the package (the ranker forward,
persistent forward, both backward schedules and the persistent ``dq``; the sparse-MLA
forward over bf16 and FP8 caches, its backward with atomics and deterministic, and the
row-sort kernel). Run as a script on two CPU devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python tests/kernel_axes_check.py

it lowers each case for CUDA under ``shard_map`` over a mesh whose axes are the plain
forms of every kernel axis name (``attn_mgpu_heads`` -> ``heads``, and the names the
kernels used before the prefix: ``program``, ``wg``, ``query``, ...) and requires the
Mosaic GPU modules to equal the unsharded ones; and, to show the comparison sees the
hazard, over a mesh of the kernels' own prefixed names, where every case must differ.
Prints ``OK``. ``packages/attn-mosaic-gpu/tests/test_kernel_axes_cpu.py`` runs it in a
subprocess.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
from kernel_fingerprint import lowered_kernels

PREFIX = "attn_mgpu_"
# Names kernels of this package used before the prefix rule, and the sharding helpers'
# default mesh axes: a mesh may well be named so.
PLAIN = ("program", "wg", "query", "data", "model")

sds = jax.ShapeDtypeStruct
bf16, i32, f32 = jnp.bfloat16, jnp.int32, jnp.float32


def _ranker_grad(head_dim, **kw):
    import attn_mosaic_gpu as gpu

    def grads(q, k, v, bounds):
        def loss(q, k, v):
            out, lse = gpu.ranker_attention(q, k, v, bounds, return_lse=True, **kw)
            return out.astype(f32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    q, kv = sds((1, 256, 2, head_dim), bf16), sds((1, 256, 1, head_dim), bf16)
    return grads, (q, kv, kv, sds((1, 4), i32))


def _sparse_grad(read_block, top_k, op="sparse_mla_attention", **kw):
    import attn_mosaic_gpu as gpu

    def grads(q, kv, indices, positions):
        def loss(q, kv):
            out, lse = getattr(gpu, op)(
                q, kv, indices, positions, sm_scale=0.07, read_block=read_block,
                return_lse=True, **kw,
            )  # fmt: skip
            return out.sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

        return jax.grad(loss, argnums=(0, 1))(q, kv)

    q, kv = sds((1, 4, 2, 576), bf16), sds((1, 1024, 576), bf16)
    return grads, (q, kv, sds((1, 4, top_k), i32), sds((1, 4), i32))


def _sparse_fp8_forward():
    import attn_mosaic_gpu as gpu
    from attn_common import Fp8LatentCache

    def forward(q, cache, indices, positions):
        return gpu.sparse_mla_attention(
            q, cache, indices, positions, sm_scale=0.07, read_block=1, return_lse=True,
            fp8_dequantize=False,
        )  # fmt: skip

    cache = Fp8LatentCache(
        sds((1, 1024, 512), jnp.float8_e4m3fn), sds((1, 1024, 4), f32), sds((1, 1024, 64), bf16)
    )
    return forward, (sds((1, 4, 2, 576), bf16), cache, sds((1, 4, 512), i32), sds((1, 4), i32))


def kernel_cases() -> list[tuple[str, object, tuple, int]]:
    """``(label, function, argument shapes, kernels)``: together every Mosaic GPU kernel
    of ``attn_mosaic_gpu``; ``kernels`` is how many kernel launches the case traces."""
    from attn_common import KernelConfig
    from attn_mosaic_gpu.tuning import BackwardTuning

    persistent = dict(
        config=KernelConfig(block_q=64, block_kv=64, num_stages=2, programs=2),
        backward_tuning=BackwardTuning(dq_programs=2),
    )
    return [
        ("ranker-d64-grad", *_ranker_grad(64), 3),  # forward, pipelined dq and dk/dv
        ("ranker-d256-grad", *_ranker_grad(256), 3),  # forward, the D 256 dq and dk/dv
        ("ranker-persistent-grad", *_ranker_grad(128, **persistent), 3),
        # row sort (forward and backward row tables), forward, backward with atomics
        ("sparse-mla-token-grad", *_sparse_grad(1, 512), 4),
        ("sparse-mla-unit-deterministic-grad", *_sparse_grad(16, 4, deterministic=True), 2),
        ("sparse-mla-fp8-forward", *_sparse_fp8_forward(), 2),  # row sort, FP8 forward
        # the query-blocked forward (at 2 heads: blocks of 32), the backward
        ("sparse-mla-qblock-grad", *_sparse_grad(16, 4, op="sparse_mla_attention_qblock"), 2),
    ]


def kernel_axes(closed: core.ClosedJaxpr) -> tuple[set[str], int]:
    """Every axis name the kernels in ``closed`` bind or read (grid, cluster and thread
    names of their meshes; ``axis_index`` names and ``collective_axes``), and how many
    kernel meshes there are."""
    names: set[str] = set()
    meshes = [0]

    def walk(jaxpr: core.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            for key, value in eqn.params.items():
                visit(key, value)

    def visit(key, value) -> None:
        if isinstance(value, core.ClosedJaxpr):
            walk(value.jaxpr)
        elif isinstance(value, core.Jaxpr):
            walk(value)
        elif isinstance(value, tuple | list):
            for item in value:
                visit(key, item)
        elif hasattr(value, "grid_names"):  # a Mosaic GPU kernel's mesh
            meshes[0] += 1
            names.update(value.grid_names, value.cluster_names)
            if value.thread_name is not None:
                names.add(value.thread_name)
        elif key in ("axis_name", "collective_axes") and value is not None:
            names.add(value)

    walk(closed.jaxpr)
    return names, meshes[0]


def plain_names(names) -> list[str]:
    """The names a user's mesh may have that clash with a kernel of ``names``: each of
    them and of ``attn_mosaic_gpu._axes.KERNEL_AXES`` without the package prefix, and
    ``PLAIN``."""
    from attn_mosaic_gpu import _axes

    plain = {n.removeprefix(PREFIX) for n in (*names, *_axes.KERNEL_AXES)} | set(PLAIN)
    return sorted(plain)


def lowered(fn, args) -> str:
    """The Mosaic GPU modules of ``fn`` lowered for CUDA, without the lowering counter
    (``dump_basename``) that numbers every lowering of the process."""
    return re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "", lowered_kernels(fn, args))


def under_mesh(fn, args, names, devices=None):
    """``fn`` under ``shard_map`` over a mesh with one axis per name (the first axis
    holds every device; the inputs are replicated), and its argument shapes."""
    devices = jax.devices() if devices is None else devices
    shape = (len(devices),) + (1,) * (len(names) - 1)
    mesh = jax.make_mesh(shape, tuple(names), devices=devices)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    placed = jax.tree.map(lambda s: sds(s.shape, s.dtype, sharding=NamedSharding(mesh, P())), args)
    return mapped, placed


def main() -> None:
    assert len(jax.devices()) >= 2, jax.devices()
    cases = kernel_cases()
    names = set()
    for _, fn, args, _ in cases:
        names |= kernel_axes(jax.make_jaxpr(fn)(*args))[0]
    plain = plain_names(names)
    prefixed = sorted(n for n in names if n.startswith(PREFIX))
    print("plain mesh:", plain)
    print("prefixed mesh:", prefixed)
    failures = []
    for label, fn, args, kernels in cases:
        want = lowered(fn, args)
        assert want.count("module @") == kernels, (label, want.count("module @"))
        same = lowered(*under_mesh(fn, args, plain)) == want
        # The check sees the hazard: under the kernels' own names every case changes.
        seen = not prefixed or lowered(*under_mesh(fn, args, prefixed)) != want
        print(f"{label}: plain mesh {'same' if same else 'DIFFERENT'}; "
              f"prefixed mesh {'different' if seen else 'SAME'}", flush=True)  # fmt: skip
        if not (same and seen):
            failures.append(label)
    if failures:
        raise SystemExit("FAILED: " + ", ".join(failures))
    print("OK")


if __name__ == "__main__":
    main()
