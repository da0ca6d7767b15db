"""The private JAX names attn-mosaic-gpu uses, all here (checked against jax 0.11.2).

A jax upgrade is a look at this file: each name says what it is for. The kernels' MLIR
comes from the public ``jaxlib.mlir`` (the same modules as ``jax._src.lib.mlir`` in
0.11.2) and ``jax.experimental.mosaic.gpu``, not from here.

* ``mosaic_gpu_ext()``: jaxlib's Mosaic GPU extension, for its CUPTI hooks
  (``_cupti_init``, ``_cupti_get_timings``): the device time of every kernel a call
  launches (``bench.cupti_call_ms``). ``jax.experimental.mosaic.gpu.profiler.measure``
  wraps the same hooks but refuses calls whose kernels CUPTI lists in varying order.
  Raises ImportError where jaxlib has no Mosaic GPU bindings (a CPU-only install).
* ``fragmented_array(registers, layout, is_signed=...)``: a Mosaic GPU
  ``FragmentedArray`` from its registers, for inline Mosaic GPU code that builds one
  register by register (the sparse-MLA backward's row ids). jax 0.11.2 has no public
  constructor; the dataclass's fields are ``_registers``, ``_layout``, ``_is_signed``.
* ``ptx_unary(array, instruction)``: one PTX instruction on every element of a
  ``FragmentedArray``, by its own elementwise helpers ``_pointwise`` and
  ``_lift_fast_instr`` (as its ``rsqrt`` does), for the MUFU forms Mosaic GPU does not
  emit (``fastmath.ptx_unary_tile``).
"""

from __future__ import annotations

from types import ModuleType

CHECKED_WITH_JAX = "0.11.2"


def mosaic_gpu_ext() -> ModuleType:
    """jaxlib's ``_mosaic_gpu_ext`` (``cupti_init`` / ``cupti_timings`` below)."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    return mosaic_gpu_lib._mosaic_gpu_ext


def cupti_init() -> None:
    """Start recording kernel timings (CUPTI)."""
    mosaic_gpu_ext()._cupti_init()


def cupti_timings(finalize: bool = True) -> list[tuple[str, float]]:
    """The kernels recorded since ``cupti_init``: ``(name, ms)`` in CUPTI's order."""
    return mosaic_gpu_ext()._cupti_get_timings(finalize)


def fragmented_array(registers, layout, *, is_signed: bool | None):
    """A Mosaic GPU ``FragmentedArray`` of ``registers`` (an object ndarray of MLIR
    values, as ``FragmentedArray.registers``) in ``layout``."""
    from jax.experimental.mosaic import gpu as mgpu

    return mgpu.FragmentedArray(_registers=registers, _layout=layout, _is_signed=is_signed)


def ptx_unary(array, instruction: str):
    """``instruction`` (one f32 operand, one f32 result, e.g. ``"rsqrt.approx.ftz.f32"``)
    on every element of the float32 ``FragmentedArray`` ``array``."""
    return array._pointwise(array._lift_fast_instr(instruction))
