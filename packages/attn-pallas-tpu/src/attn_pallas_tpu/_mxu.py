"""The one matmul every TPU kernel here issues: ``lax.dot_general`` on the MXU with
float32 accumulation, and ``Precision.HIGHEST`` for float32 operands.

Without the precision, a TPU multiplies float32 operands in a single bfloat16 pass: on a
TPU v5e (jax 0.10.2, the device image's) the sparse-MLA kernels' float32 outputs were
2.5e-3 rel L2 from the reference, where the ranker kernels, which asked for
``HIGHEST``, passed the float32 conformance tests. Interpret mode computes in float32
either way, so only a chip shows the difference.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def mxu_dot(a, b, dims):
    """``lax.dot_general(a, b, dims)`` accumulated in float32, at ``Precision.HIGHEST``
    when ``a`` is float32 (bfloat16 operands take the MXU's native pass)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
