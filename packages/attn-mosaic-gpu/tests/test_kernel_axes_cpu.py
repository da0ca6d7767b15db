"""The kernels' axis names, and the kernels under ``jax.shard_map`` (CPU, no GPU needed).

A Mosaic GPU kernel's ``lax.axis_index(name)`` is lowered against the mesh axes of an
enclosing ``shard_map`` before the kernel's own axes, so a kernel axis named like a mesh
axis reads the device index and computes the wrong rows (seen on two H200s). The rule:
every axis a kernel names comes from ``attn_mosaic_gpu._axes`` (prefix ``attn_mgpu_``).
Here, for every kernel (``tests/kernel_axes_check.py``'s cases):

* its traced axis names are ``_axes`` names, and the source names no axis otherwise;
* (slow) lowered for CUDA under ``shard_map`` over a mesh named like plain kernel axes,
  the sparse-MLA kernels and the row sort read no device index (one device, in process);
* (slow) on two CPU devices, every kernel lowers to the same modules under such a mesh
  as unsharded, and to different ones under a mesh of the prefixed names (the
  comparison sees the hazard).

Interpret mode cannot show the hazard: Mosaic GPU's interpreter resolves a kernel's own
axes first (``tests/sharding_check.py`` runs the kernels sharded in interpret mode).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import load_script

from attn_mosaic_gpu import _axes

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tests" / "kernel_axes_check.py"
SOURCE = Path(_axes.__file__).parent
# The modules that launch a Mosaic GPU kernel, all traced by kernel_axes_check's cases.
KERNEL_MODULES = {
    "ranker_fwd.py",
    "ranker_bwd_pipelined.py",
    "ranker_bwd_d256.py",
    "sparse_mla_kernel.py",
    "sparse_mla_bwd_kernel.py",
    "row_sort.py",
}
AXIS_KEYWORDS = ("grid_names", "thread_name", "cluster_names", "collective_axes", "axis_name")


@pytest.fixture(scope="module")
def check():
    with load_script(SCRIPT, "kernel_axes_check") as module:
        yield module


def test_axes_module_names_are_prefixed():
    assert _axes.KERNEL_AXES, "no kernel axes"
    assert len(set(_axes.KERNEL_AXES)) == len(_axes.KERNEL_AXES)
    for name in _axes.KERNEL_AXES:
        assert name.startswith("attn_mgpu_") and len(name) > len("attn_mgpu_"), name


def test_every_kernel_traces_only_prefixed_axes(check):
    """Trace every kernel: each axis a kernel binds or reads is an ``_axes`` name."""
    seen = set()
    for label, fn, args, kernels in check.kernel_cases():
        names, meshes = check.kernel_axes(jax.make_jaxpr(fn)(*args))
        assert meshes == kernels, f"{label}: {meshes} kernels traced, expected {kernels}"
        assert names, f"{label}: no kernel axes found: the check inspects nothing"
        plain = names - set(_axes.KERNEL_AXES)
        assert not plain, (
            f"{label}: kernel axes {sorted(plain)} are not attn_mosaic_gpu._axes names"
        )
        seen |= names
    assert {_axes.PROGRAMS, _axes.WARPGROUP, _axes.QUERIES} <= seen


def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    return {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _plain_axis_names(expr: ast.expr, constants: dict[str, ast.expr]) -> list[str]:
    """What in an axis-name expression is not an ``_axes`` name: string literals, and
    module constants or attributes that are not ``_axes.X``. A function's own variable
    (a name passed in) is left to the traced check."""
    if isinstance(expr, ast.Tuple | ast.List):
        return [bad for item in expr.elts for bad in _plain_axis_names(item, constants)]
    if isinstance(expr, ast.Constant):
        return [] if expr.value is None else [repr(expr.value)]
    if isinstance(expr, ast.Attribute):
        ok = isinstance(expr.value, ast.Name) and expr.value.id == "_axes"
        return [] if ok else [ast.unparse(expr)]
    if isinstance(expr, ast.Name) and expr.id in constants:
        return _plain_axis_names(constants[expr.id], constants)
    if isinstance(expr, ast.Name):
        return []
    return [ast.unparse(expr)]


def test_kernel_sources_name_axes_through_axes_module():
    """Static: every ``grid_names=``, ``thread_name=``, ``collective_axes=`` and
    ``lax.axis_index(...)`` in the package is an ``_axes`` name (directly or through a
    module constant); and every module that launches a kernel is one the traced check
    covers."""
    problems, launching = [], set()
    for path in sorted(SOURCE.glob("*.py")):
        tree = ast.parse(path.read_text())
        constants = _module_constants(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if func == "plgpu.kernel" or func.endswith(".pallas_call"):
                launching.add(path.name)
            exprs = [kw.value for kw in node.keywords if kw.arg in AXIS_KEYWORDS]
            if func.endswith("axis_index") and node.args:
                exprs.append(node.args[0])
            for expr in exprs:
                for bad in _plain_axis_names(expr, constants):
                    problems.append(f"{path.name}:{node.lineno}: {bad}")
    assert not problems, "axis names not from attn_mosaic_gpu._axes: " + "; ".join(problems)
    assert launching == KERNEL_MODULES, launching ^ KERNEL_MODULES


@pytest.mark.slow  # ~8 s: the quick tier checks the rule itself (every traced kernel axis
# prefixed: test_every_kernel_traces_only_prefixed_axes, and the sources statically)
def test_sparse_kernels_read_no_device_index_under_a_plain_mesh(check):
    """Lowered for CUDA under ``shard_map`` over a one-device mesh named like plain
    kernel axes (``program``, ``wg``, ``query``, ...), the sparse-MLA forward and
    backward and the row sort read no device index: a clashing name would lower to
    ``nvshmem_my_pe``."""
    label, fn, args, kernels = check.kernel_cases()[3]
    assert label == "sparse-mla-token-grad"
    names, _ = check.kernel_axes(jax.make_jaxpr(fn)(*args))
    plain = check.plain_names(names)
    assert {"program", "wg", "query", "programs", "warpgroup", "batch"} <= set(plain)
    text = check.lowered(*check.under_mesh(fn, args, plain, devices=jax.devices()[:1]))
    modules = text.split("module @")[1:]
    assert len(modules) == kernels
    reading = [
        i for i, m in enumerate(modules) if "nvshmem_my_pe" in m or "collective_metadata" in m
    ]
    assert not reading, f"modules {reading} of {len(modules)} read the device index"


@pytest.mark.slow  # ~40 s on 2 cores: every kernel lowered three times
def test_every_kernel_lowers_the_same_under_a_mesh_of_plain_names():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK"), proc.stdout
