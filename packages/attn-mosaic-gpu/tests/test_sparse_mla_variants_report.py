"""``benchmarks/sparse_mla_variants.py`` off a GPU: another revision's kernel file loads
as its own module, every variant is a valid config, and the report names the commit
and keeps a failed variant's row."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "sparse_mla_variants.py"
KERNEL = SCRIPT.parents[1] / "packages/attn-mosaic-gpu/src/attn_mosaic_gpu/sparse_mla_kernel.py"


@pytest.fixture(scope="module")
def variants():
    with load_script(SCRIPT, "sparse_mla_variants") as module:
        yield module


def test_variants_are_configs_and_a_baseline_file_loads(variants):
    from attn_mosaic_gpu import sparse_mla_kernel

    static_fields = {f.name for f in dataclasses.fields(sparse_mla_kernel._Static)}
    assert set(variants.STATIC_KNOBS) <= static_fields  # benchmark-only knobs
    for label, knobs in variants.VARIANTS.items():
        config_knobs = {k: v for k, v in knobs.items() if k not in variants.STATIC_KNOBS}
        assert knobs.get("probe", "") in ("", "no_gather", "no_compute"), label
        _, config = variants.variant_attend(knobs)
        assert config == sparse_mla_kernel.SparseMlaKernelConfig(**config_knobs), label
    baseline = variants.load_module(KERNEL)
    assert baseline is not sparse_mla_kernel
    assert baseline.sparse_mla_rows_attention is not sparse_mla_kernel.sparse_mla_rows_attention
    assert baseline.SparseMlaKernelConfig() == baseline.SparseMlaKernelConfig()


def test_report_names_the_commit_and_keeps_failures(variants, tmp_path):
    rows = [
        {
            "case": "flat-h128-t8k",
            "variant": "default",
            "config": "C()",
            "ms": 5.7,
            "tflops": 411.0,
        },
        {
            "case": "flat-h128-t8k",
            "variant": "64x1",
            "config": "C(64, 1)",
            "ms": 8.1,
            "tflops": 290.0,
            "rel_l2_vs_first": 2.3e-4,
        },
        {"case": "flat-h128-t8k", "variant": "one-way", "config": "C()", "error": "boom"},
    ]
    data = {"commit": "abc1234", "device": "NVIDIA H200", "command": "x", "rows": rows}
    variants.write_reports(data, tmp_path)
    md = (tmp_path / "sparse_mla_variants.md").read_text().splitlines()
    assert md[0].startswith("Commit abc1234 (NVIDIA H200)")
    assert any("| 64x1 | 8.100 | 290 | 2.3e-04 |" in line for line in md)
    assert any("| one-way | failed |" in line and "boom" in line for line in md)
    assert json.loads((tmp_path / "sparse_mla_variants.json").read_text())["rows"] == rows


def test_kernel_dump_builds_each_sparse_variant():
    """``benchmarks/kernel_dump.py`` builds every sparse variant it may be asked to dump
    (cross-lowered for CUDA)."""
    import jax

    with load_script(SCRIPT.parent / "kernel_dump.py", "kernel_dump") as dump:
        for name in ("sparse", "sparse:one-way max exchange", "sparse:probe: no gather"):
            dump.check_target(name)
            fn, args = dump.target_fn(name)
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
            exported = jax.export.export(fn, platforms=["cuda"])(*structs)
            assert "mosaic_gpu" in exported.mlir_module()
        with pytest.raises(SystemExit, match="sparse variants are"):
            dump.check_target("sparse:no such variant")
        # `kernel_dump.py sparse` dumps the kernel users get.
        from attn_mosaic_gpu.sparse_mla_kernel import SparseMlaKernelConfig

        knobs = dump.sparse_variants().VARIANTS[dump.SPARSE_DEFAULT]
        assert SparseMlaKernelConfig(**knobs) == SparseMlaKernelConfig()
