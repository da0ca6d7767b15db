"""The private JAX names attn-mosaic-gpu uses, all here (checked against jax 0.11.2).

A jax upgrade is a look at this file: each name says what it is for. The kernels' MLIR
comes from the public ``jaxlib.mlir`` (the same modules as ``jax._src.lib.mlir`` in
0.11.2) and ``jax.experimental.mosaic.gpu``, not from here.

* ``mosaic_gpu_ext()``: jaxlib's Mosaic GPU extension, for its CUPTI hooks
  (``_cupti_init``, ``_cupti_get_timings``): the device time of every kernel a call
  launches (``bench.cupti_call_ms``). ``jax.experimental.mosaic.gpu.profiler.measure``
  wraps the same hooks but refuses calls whose kernels CUPTI lists in varying order.
  Raises ImportError where jaxlib has no Mosaic GPU bindings (a CPU-only install).
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
