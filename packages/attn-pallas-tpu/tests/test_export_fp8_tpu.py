"""Cross-lowering for TPU of the sparse-MLA kernels over an FP8 latent cache, at
production shapes, with ``jax.export`` (nothing executes; Mosaic's TPU compiler passes
need a TPU, as in ``test_export_tpu.py``).

Prefill: 4096 query tokens, 2048 selected tokens per query (32 units of 64), heads 16
and 128, flat (``T = 32768``) and ragged paged (4 requests of 32K tokens). Decode: 128
requests x 2 query tokens, 32K tokens each, ragged paged. Each for both kernels
(per-query; query-blocked with the automatic tiling, a ``lax.cond`` over two kernels
under jit) and both stored forms: a plain ``Fp8LatentCache`` (side rows built in the
call) and a ``TpuFp8LatentCache`` (read as stored: no op over the whole cache's scales
may appear in the module). The kernels read the FP8 rows (``fp8_dequantize=False``;
at these prefill shapes the default would copy the bf16 rows first, which
``test_export_copy_path`` lowers).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from helpers import (
    export_tpu,
    flat_call_structs,
    prefill_call_structs,
    ragged_call_structs,
    ragged_positional,
)

from attn_common import Fp8LatentCache
from attn_pallas_tpu import (
    TpuFp8LatentCache,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
    sparse_mla_attention,
    sparse_mla_attention_qblock,
)

SD = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
DV, ROPE = 512, 64
UNIT, SELECTED, T = 64, 2048, 32768
TOP_K = SELECTED // UNIT
PREFILL_Q, PREFILL_SEQS = 4096, 4
DECODE_SEQS, DECODE_Q_PER_SEQ = 128, 2
IN_VMEM = dict(fp8_dequantize=False)
KERNELS = {
    "per_query": (functools.partial(sparse_mla_attention, **IN_VMEM), 1),
    "qblock": (functools.partial(sparse_mla_attention_qblock, **IN_VMEM), 2),
}
FORMS = ("fp8", "tpu")


def _cache(form: str, *grid: int):
    if form == "tpu":
        return TpuFp8LatentCache(SD((*grid, DV), jnp.float8_e4m3fn), SD((*grid, 128), BF16))
    return Fp8LatentCache(
        SD((*grid, DV), jnp.float8_e4m3fn), SD((*grid, 4), jnp.float32), SD((*grid, ROPE), BF16)
    )


def _check(exported, form: str, grid: tuple[int, ...]) -> None:
    if form == "tpu":  # never materialised: the kernels DMA latent and side as stored
        assert "tensor<" + "x".join(map(str, grid)) + "x4xf32>" not in exported.mlir_module()


def _cases(*quick):
    """Both kernels, heads 16 and 128, both stored forms: the ``quick`` ones in the
    default tier (each kernel and each form lowered once), the rest slow."""
    return pytest.mark.parametrize(
        ("kernel", "heads", "form"),
        [
            pytest.param(*case, marks=[] if case in quick else [pytest.mark.slow])
            for case in itertools.product(KERNELS, (16, 128), FORMS)
        ],
    )


@_cases(("per_query", 16, "fp8"), ("qblock", 16, "tpu"))
def test_export_flat_prefill(kernel, heads, form):
    fn, count = KERNELS[kernel]
    exported = export_tpu(
        functools.partial(fn, sm_scale=0.04, read_block=UNIT, return_lse=True),
        *flat_call_structs(_cache(form, 1, T), PREFILL_Q, heads, TOP_K),
        kernels=count,
    )
    _check(exported, form, (1, T))


def _ragged(kernel, num_q, heads, num_seqs, form):
    fn, count = KERNELS[kernel]
    num_pages = num_seqs * (T // UNIT) + 8
    kw = dict(sm_scale=0.04, read_block=UNIT, page_size=UNIT, return_lse=True)
    exported = export_tpu(
        ragged_positional(fn, **kw),
        *ragged_call_structs(
            _cache(form, num_pages, UNIT), num_q, heads, TOP_K, num_seqs, num_pages - 8
        ),
        kernels=count,
    )
    _check(exported, form, (num_pages, UNIT))


# Ragged: the TPU form quick (the plain form's side rows are built as in flat mode).
@_cases(("qblock", 16, "tpu"))
def test_export_ragged_prefill(kernel, heads, form):
    _ragged(kernel, PREFILL_Q, heads, PREFILL_SEQS, form)


@_cases(("per_query", 16, "tpu"))
def test_export_ragged_decode(kernel, heads, form):
    _ragged(kernel, DECODE_SEQS * DECODE_Q_PER_SEQ, heads, DECODE_SEQS, form)


WRAPPERS = (
    functools.partial(prefill_write_and_attend_ragged, **IN_VMEM),
    functools.partial(prefill_write_and_attend_ragged_qblock, **IN_VMEM),
)
QUICK_WRAPPERS = {(0, "fp8"), (1, "tpu")}  # each wrapper and each form once, the rest slow


@pytest.mark.parametrize(
    ("fn", "count", "form"),
    [
        pytest.param(
            fn, n + 1, form, id=f"{form}-fn{n}-{n + 1}",
            marks=[] if (n, form) in QUICK_WRAPPERS else [pytest.mark.slow],
        )
        for form in FORMS
        for n, fn in enumerate(WRAPPERS)
    ],
)  # fmt: skip
def test_export_write_then_attend(fn, count, form):
    """The write is the XLA scatter of the quantized rows; the attention the kernel."""
    heads, num_pages = 16, PREFILL_SEQS * (T // UNIT) + 8
    cache = _cache(form, num_pages, UNIT)
    exported = export_tpu(  # latent DV = 512, rope ROPE = 64
        functools.partial(fn, kv_lora_rank=DV, page_size=UNIT, sm_scale=0.04),
        *prefill_call_structs(cache, PREFILL_Q, heads, TOP_K, PREFILL_SEQS, num_pages - 8),
        kernels=count,
    )
    _check(exported, form, (num_pages, UNIT))


@pytest.mark.parametrize("kernel", [pytest.param("per_query", marks=pytest.mark.slow), "qblock"])
def test_export_copy_path(kernel):
    """The default at the flat prefill shape: the cache's bf16 rows copied by XLA, then
    the bf16 kernels (no kernel takes an FP8 array)."""
    fn = {"per_query": sparse_mla_attention, "qblock": sparse_mla_attention_qblock}[kernel]
    exported = export_tpu(
        functools.partial(fn, sm_scale=0.04, read_block=UNIT, return_lse=True),
        *flat_call_structs(_cache("tpu", 1, T), PREFILL_Q, 16, TOP_K),
        kernels=KERNELS[kernel][1],
    )
    _check(exported, "tpu", (1, T))
    calls = [line for line in exported.mlir_module().splitlines() if "tpu_custom_call" in line]
    assert calls and not any("f8E4M3FN" in line for line in calls)
