"""Logit soft-capping: one definition of the cap and its derivative.

The reference and every kernel call these functions, so the math lives here once.
All functions are plain ``jnp`` elementwise ops: they trace inside Pallas kernels
(Mosaic GPU and TPU) as well as in ordinary JAX code.

Methods (``s`` is the scaled logit ``(q . k) * sm_scale``, ``c`` the cap value):

* ``NONE``:      ``y = s``
* ``TANH``:      ``y = c * tanh(s / c)``
* ``SOFT_SIGN``: ``y = s / (1 + |s| / c)``
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax.numpy as jnp


class CapMethod(enum.Enum):
    """How logits are soft-capped before the softmax."""

    NONE = "none"
    TANH = "tanh"
    SOFT_SIGN = "soft_sign"


@dataclasses.dataclass(frozen=True)
class CapParams:
    """A soft cap: ``method`` and its positive, finite ``value`` (ignored for NONE).

    Frozen and hashable, so it can be a static argument of ``jax.jit``.
    """

    method: CapMethod = CapMethod.NONE
    value: float | None = None

    def __post_init__(self) -> None:
        method = self.method
        if isinstance(method, str):
            try:
                method = CapMethod(method.lower())
            except ValueError:
                raise ValueError(
                    f"CapParams.method: got {self.method!r}, expected one of "
                    f"{[m.value for m in CapMethod]}"
                ) from None
            object.__setattr__(self, "method", method)
        if not isinstance(method, CapMethod):
            raise TypeError(f"CapParams.method: got {type(method).__name__}, expected CapMethod")
        if method is CapMethod.NONE:
            object.__setattr__(self, "value", None)
            return
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                f"CapParams.value: got {value!r} for method {method.value}, expected a "
                "positive finite number"
            )
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"CapParams.value: got {value!r} for method {method.value}, expected a "
                "positive finite number"
            )
        object.__setattr__(self, "value", float(value))

    @property
    def active(self) -> bool:
        return self.method is not CapMethod.NONE


NO_CAP = CapParams()


def normalize_cap(cap: CapParams | None) -> CapParams:
    """``None`` -> no cap; validates the type of anything else."""
    if cap is None:
        return NO_CAP
    if not isinstance(cap, CapParams):
        raise TypeError(
            f"cap: got {type(cap).__name__} {cap!r}, expected CapParams or None "
            "(e.g. CapParams(method=CapMethod.TANH, value=30.0))"
        )
    return cap


def _divide(x, d):
    return x / d


def cap_forward(s, cap: CapParams | None, *, reciprocal=None):
    """Apply the cap to logits ``s`` (any shape, float). Returns an array like ``s``.

    ``reciprocal(d)`` (``d > 0``) lets a kernel replace soft_sign's IEEE division,
    a long instruction sequence on GPUs, by a fast approximate reciprocal; the default
    divides exactly.
    """
    cap = normalize_cap(cap)
    if cap.method is CapMethod.NONE:
        return s
    c = cap.value
    if cap.method is CapMethod.TANH:
        return c * jnp.tanh(s * (1.0 / c))
    denom = 1.0 + jnp.abs(s) * (1.0 / c)
    if reciprocal is None:
        return _divide(s, denom)
    return s * reciprocal(denom)


def cap_derivative(s, cap: CapParams | None):
    """``d cap_forward(s) / d s`` from the uncapped logits ``s``."""
    cap = normalize_cap(cap)
    if cap.method is CapMethod.NONE:
        return jnp.ones_like(s)
    c = cap.value
    if cap.method is CapMethod.TANH:
        t = jnp.tanh(s * (1.0 / c))
        return 1.0 - t * t
    d = 1.0 + jnp.abs(s) * (1.0 / c)
    return 1.0 / (d * d)


def cap_derivative_from_output(y, cap: CapParams | None):
    """``d cap_forward(s) / d s`` written in terms of the capped value ``y``.

    Backward kernels that keep only capped logits use this form:
    tanh: ``1 - (y/c)^2``; soft_sign: ``(1 - |y|/c)^2``.
    """
    cap = normalize_cap(cap)
    if cap.method is CapMethod.NONE:
        return jnp.ones_like(y)
    c = cap.value
    r = y * (1.0 / c)
    if cap.method is CapMethod.TANH:
        return 1.0 - r * r
    a = 1.0 - jnp.abs(r)
    return a * a


def cap_scaled_with_derivative(
    raw, cap: CapParams | None, scale: float, *, out_scale=1.0, reciprocal=None
):
    """``(out_scale * cap(scale * raw), cap'(scale * raw))`` with the constants folded.

    The form backward kernels want: ``raw`` is the unscaled ``q . k`` tile, ``out_scale``
    typically ``log2(e)`` for an ``exp2`` softmax. Folding ``scale``, ``1/c`` and
    ``out_scale`` into the few multiplies the cap needs anyway, and taking the derivative
    from the quantities already computed (soft_sign: ``1/d^2`` from the reciprocal
    ``1/d``; tanh: ``1 - t^2`` from ``t = tanh``), saves about half the elementwise work
    of ``cap_forward`` + ``cap_derivative_from_output``. The derivative is ``None`` for
    ``CapMethod.NONE`` (it is 1). ``reciprocal`` as in ``cap_forward``.
    """
    cap = normalize_cap(cap)
    if cap.method is CapMethod.NONE:
        return raw * (scale * out_scale), None
    c = cap.value
    if cap.method is CapMethod.TANH:
        t = jnp.tanh(raw * (scale / c))
        return t * (c * out_scale), 1.0 - t * t
    # value = raw * k / d with k = scale * out_scale and d = 1 + |raw| scale / c; the
    # reciprocal is taken of d / k (one FMA away from raw), so k costs no multiply and
    # the value ends in one multiply, which a kernel fuses with what follows.
    k = scale * out_scale
    denom_k = jnp.abs(raw) * (scale / (c * k)) + 1.0 / k
    recip = reciprocal or (lambda d: _divide(jnp.ones_like(d), d))
    inv_k = recip(denom_k)
    return raw * inv_k, (inv_k * inv_k) * (1.0 / (k * k))
