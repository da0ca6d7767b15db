"""The ``interpret`` argument of the Hopper kernels, resolved once for all of them."""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu


def resolve_interpret(interpret):
    """``False``/``None`` -> ``None`` (compile for the GPU); ``True`` -> default params;
    a ``plgpu.InterpretGPUParams`` as given; anything else is a TypeError."""
    if interpret is None or interpret is False:
        return None
    if interpret is True:
        return plgpu.InterpretGPUParams()
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    raise TypeError(
        f"interpret: got {type(interpret).__name__}, expected a bool or "
        "jax.experimental.pallas.mosaic_gpu.InterpretGPUParams"
    )
