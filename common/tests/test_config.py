"""KernelConfig: defaults, per-field validation naming the field, frozen/hashable, replace."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_static_value

from attn_common import KernelConfig

BLOCK_FIELDS = ("block_q", "block_kv")
OPTIONAL_BLOCK_FIELDS = ()
STAGE_FIELDS = ("num_stages",)


def test_defaults_valid():
    c = KernelConfig()
    assert (c.block_q, c.block_kv, c.num_stages) == (64, 64, 2)


def test_only_fields_a_kernel_reads():
    """Fields no backend read (backward tiles, sparse-MLA knobs) are gone, not ignored."""
    assert [f.name for f in dataclasses.fields(KernelConfig)] == [
        "block_q",
        "block_kv",
        "num_stages",
        "exp2_fma_cols",
        "rcp_fma_cols",
        "programs",
        "compute_registers",
    ]
    for gone in ("block_q_bwd", "block_kv_bwd", "query_block", "num_dma_buffers"):
        with pytest.raises(TypeError):
            KernelConfig(**{gone: 64})


@pytest.mark.parametrize("field", BLOCK_FIELDS + OPTIONAL_BLOCK_FIELDS)
@pytest.mark.parametrize("value", [16, 32, 48, 64, 128, 1024])
def test_block_fields_accept(field, value):
    c = KernelConfig(**{field: value})
    assert getattr(c, field) == value


@pytest.mark.parametrize("field", BLOCK_FIELDS + OPTIONAL_BLOCK_FIELDS)
@pytest.mark.parametrize("value", [0, -16, -1, 8, 15, 17, 100, 1040, 2048])
def test_block_fields_reject_values(field, value):
    with pytest.raises(ValueError, match=rf"KernelConfig\.{field}: got {value}\b"):
        KernelConfig(**{field: value})


@pytest.mark.parametrize("field", BLOCK_FIELDS + OPTIONAL_BLOCK_FIELDS)
@pytest.mark.parametrize("value", [64.0, "64", True, False, [64], jnp.int32(64)])
def test_block_fields_reject_types(field, value):
    with pytest.raises(TypeError, match=rf"KernelConfig\.{field}"):
        KernelConfig(**{field: value})


@pytest.mark.parametrize("field", BLOCK_FIELDS)
def test_required_block_fields_reject_none(field):
    with pytest.raises(TypeError, match=rf"KernelConfig\.{field}"):
        KernelConfig(**{field: None})


@pytest.mark.parametrize("field", STAGE_FIELDS)
@pytest.mark.parametrize("value", [2, 3, 4, 8])
def test_stage_fields_accept(field, value):
    assert getattr(KernelConfig(**{field: value}), field) == value


@pytest.mark.parametrize("field", STAGE_FIELDS)
@pytest.mark.parametrize("value", [0, 1, 9, -1, 100])
def test_stage_fields_reject_values(field, value):
    with pytest.raises(ValueError, match=rf"KernelConfig\.{field}: got {value}\b"):
        KernelConfig(**{field: value})


@pytest.mark.parametrize("field", STAGE_FIELDS)
@pytest.mark.parametrize("value", [2.0, True, None, "2"])
def test_stage_fields_reject_types(field, value):
    with pytest.raises(TypeError, match=rf"KernelConfig\.{field}"):
        KernelConfig(**{field: value})


def test_frozen_and_hashable():
    a = KernelConfig(block_q=128)
    assert_static_value(a, KernelConfig(block_q=128), KernelConfig(), "block_q")


def test_static_jit_arg():
    jf = jax.jit(lambda x, config: x * config.block_q, static_argnames="config")
    assert int(jf(jnp.int32(2), config=KernelConfig(block_q=32))) == 64
    assert int(jf(jnp.int32(3), config=KernelConfig(block_q=32))) == 96
    assert int(jf(jnp.int32(2), config=KernelConfig(block_q=16))) == 32


def test_replace_validates():
    c = KernelConfig()
    d = c.replace(block_kv=128, num_stages=4)
    assert (d.block_kv, d.num_stages) == (128, 4)
    assert (c.block_kv, c.num_stages) == (64, 2)  # original untouched
    with pytest.raises(ValueError, match=r"KernelConfig\.block_kv"):
        c.replace(block_kv=100)
    with pytest.raises(ValueError, match=r"KernelConfig\.num_stages"):
        c.replace(num_stages=9)
    with pytest.raises(TypeError, match=r"KernelConfig\.block_q"):
        c.replace(block_q=True)
    with pytest.raises(TypeError):
        c.replace(no_such_field=1)


@pytest.mark.parametrize("field", ["exp2_fma_cols", "rcp_fma_cols"])
def test_fma_cols(field):
    assert getattr(KernelConfig(block_kv=128, **{field: 0}), field) == 0
    assert getattr(KernelConfig(block_kv=128, **{field: 128}), field) == 128
    for bad in (-8, 12, 136):
        with pytest.raises(ValueError, match=rf"KernelConfig\.{field}: got {bad}\b"):
            KernelConfig(block_kv=128, **{field: bad})
    for bad in (8.0, True, "8"):
        with pytest.raises(TypeError, match=rf"KernelConfig\.{field}"):
            KernelConfig(block_kv=128, **{field: bad})


def test_programs():
    assert KernelConfig().programs == 0 and KernelConfig(programs=132).programs == 132
    with pytest.raises(ValueError, match=r"KernelConfig\.programs: got -1\b"):
        KernelConfig(programs=-1)
    for bad in (1.0, True, "4"):
        with pytest.raises(TypeError, match=r"KernelConfig\.programs"):
            KernelConfig(programs=bad)


def test_compute_registers():
    assert KernelConfig().compute_registers == 0
    assert KernelConfig(compute_registers=240).compute_registers == 240
    for bad in (-8, 236, 264):
        with pytest.raises(ValueError, match=rf"KernelConfig\.compute_registers: got {bad}\b"):
            KernelConfig(compute_registers=bad)
    for bad in (240.0, True, "240"):
        with pytest.raises(TypeError, match=r"KernelConfig\.compute_registers"):
            KernelConfig(compute_registers=bad)
