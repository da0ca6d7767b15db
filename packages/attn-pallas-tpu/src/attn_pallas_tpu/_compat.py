"""The JAX names outside its documented API that attn-pallas-tpu uses, all here (checked
against jax 0.11.2 and, on the TPU machine, 0.10.2).

A jax upgrade is a look at this file: each name says what it is for.

* ``default_major_to_minor(shape, dtype)``: the layout (dims major to minor) the default
  device gives an array of that shape and dtype, the one a jitted function's parameters
  and results take. A TPU lays some shapes out in another order than row-major (a v5e:
  ``[64, 1152, 20, 128]`` bf16 as ``(0, 2, 1, 3)``, heads major), so a kernel layout
  that matches it saves XLA's relayout copies around the kernel. It asks the device's
  PJRT client (``Device.client.get_default_layout``, what ``jax``'s own layout checks
  call) and converts with ``jax.experimental.layout.Layout.from_pjrt_layout``; ``None``
  where the backend does not say.
* ``approx_reciprocal(x)``: the TPU's approximate reciprocal (Pallas' ``reciprocal``
  with ``approx=True``, ``full_range=False``: one EUP instruction, no IEEE edge cases).
  jax 0.11 exports it as ``pallas.tpu.reciprocal`` and deprecates ``pallas.reciprocal``,
  the only name jax 0.10.2 has.
"""

from __future__ import annotations

import functools

import jax
import numpy as np


@functools.lru_cache(maxsize=256)
def _default_major_to_minor(shape: tuple[int, ...], dtype: str, platform: str):
    from jax.experimental.layout import Layout

    device = jax.devices(platform)[0]
    try:
        pjrt = device.client.get_default_layout(np.dtype(dtype), shape, device)
        return tuple(Layout.from_pjrt_layout(pjrt).major_to_minor)
    except (AttributeError, TypeError, jax.errors.JaxRuntimeError):
        return None


def default_major_to_minor(shape, dtype) -> tuple[int, ...] | None:
    """The default device's layout of a ``shape`` / ``dtype`` array, dims major to minor
    (``(0, 1, 2, 3)``: row-major), or ``None`` where the backend does not say."""
    name = jax.numpy.dtype(dtype).name
    return _default_major_to_minor(tuple(int(s) for s in shape), name, jax.default_backend())


def approx_reciprocal(x):
    """``1 / x``, approximately, for finite ``x`` away from 0 (the TPU's EUP reciprocal;
    interpret mode computes it exactly)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    fn = getattr(pltpu, "reciprocal", None) or pl.reciprocal
    return fn(x, approx=True, full_range=False)
