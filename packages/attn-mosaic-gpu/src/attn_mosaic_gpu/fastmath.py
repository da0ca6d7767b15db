"""Softmax arithmetic split between the MUFU and the FMA pipes of a Hopper SM.

A capped ranker score needs two transcendental operations (``exp2`` and the cap's
``tanh`` or reciprocal). Each is one op on the multi-function unit (MUFU), which
issues 16 ops per clock per SM, against 128 for the FMA pipe: with a cap the forward
is MUFU-bound (docs/ranker_gpu.md). The functions here compute the same values with
FMA-pipe instructions only (float adds and FMAs, integer shifts and adds), so a kernel
can send a chosen fraction of the elements to each pipe (``split_columns``), as
FlashAttention-4 does on Blackwell. Every function takes and returns float32 arrays
(Mosaic GPU fragmented arrays inside a kernel, or ordinary jax arrays: the CPU tests
check them elementwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax

__all__ = [
    "EXP2_MAX_REL_ERROR",
    "LN2",
    "LOG2E",
    "M_INIT",
    "RECIPROCAL_MAX_REL_ERROR",
    "exp2_fma",
    "fast_reciprocal",
    "fast_reciprocal_tile",
    "ptx_unary_tile",
    "reciprocal_fma",
    "split_columns",
]

# The kernels' softmax runs in base 2: logits times LOG2E, exp2, and the LSE back to the
# natural log times LN2. The running max starts at the finite M_INIT (base-2 units), so a
# row with no key yet never computes -inf - -inf.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
M_INIT = -1e30

# 2^f ~= 1 + f (c1 + f (c2 + f c3)) on f in [-1/2, 1/2]: the minimax fit of relative
# error with c0 pinned to 1 (so 2^0 == 1 exactly and the clamped -inf gives exactly 0).
# Max relative error 1.01e-4 in float32 Horner evaluation over [-1/2, 1/2] (measured on
# 400k points, see tests/test_fastmath.py), 20x below bf16's half-ulp (1.95e-3): P is
# rounded to bf16/fp16 before the PV matmul anyway.
_EXP2_COEFFS = (0.693282961845398, 0.2422109842300415, 0.055008918046951294)
EXP2_MAX_REL_ERROR = 1.02e-4
# 1.5 * 2^23: adding it rounds a float32 |x| < 2^22 to the nearest integer, which then
# sits in the low mantissa bits (the float add does the rounding, on the FMA pipe).
_ROUND_MAGIC = 12582912.0
# Exponents below -127 underflow (float32 normals stop at 2^-126); at exactly -127 the
# exponent arithmetic gives +0.0, so -inf (a masked score) maps to exactly 0.
_EXP2_MIN = -127.0
# 1/d seed for a positive normal d from its bits (max relative error 12.5%); three Newton steps
# square the error each time: 1.6e-2, 2.4e-4, 6e-8 (below float32's 6e-8 ulp at 1).
_RECIPROCAL_MAGIC = 0x7EF311C3
_NEWTON_STEPS = 3
RECIPROCAL_MAX_REL_ERROR = 3e-7


def exp2_fma(x, *, xla_fold_guard: bool = False):
    """``2**x`` for ``x <= 0`` (softmax exponents) without the MUFU.

    Cody-Waite split ``x = j + f`` with ``j = round(x)`` (the magic-number add) and
    ``f in [-1/2, 1/2]``; ``2**f`` by a degree-3 polynomial (max relative error
    ``EXP2_MAX_REL_ERROR``); ``2**j`` by adding ``j << 23`` to the result's exponent
    bits. ``x <= -127`` (and ``-inf``) gives ``+0.0`` exactly, as ``ex2.approx.ftz``
    gives 0 there. ``x`` must not be NaN or above 127 (softmax exponents are <= 0).
    """
    x = jnp.maximum(x, _EXP2_MIN)
    shifted = x + _ROUND_MAGIC
    if xla_fold_guard:
        shifted = lax.optimization_barrier(shifted)
    j = shifted - _ROUND_MAGIC
    f = x - j
    c1, c2, c3 = _EXP2_COEFFS
    poly = (f * (f * (f * c3 + c2) + c1)) + 1.0
    # The low bits of `shifted` hold j (two's complement); << 23 moves them into the
    # exponent field and drops the magic's own bits (its low 22 bits are zero).
    exponent = lax.shift_left(lax.bitcast_convert_type(shifted, jnp.int32), jnp.int32(23))
    return lax.bitcast_convert_type(
        lax.bitcast_convert_type(poly, jnp.int32) + exponent, jnp.float32
    )


def reciprocal_fma(d):
    """``1 / d`` for a positive normal float ``d`` (soft_sign's denominator, scaled)
    without the MUFU.

    A seed from the bits of ``d`` (``magic - bits(d)``, relative error <= 12.5%), then
    three Newton steps ``r += r * (1 - d * r)`` (two FMAs each): max relative error
    ``RECIPROCAL_MAX_REL_ERROR``.
    """
    seed = jnp.int32(_RECIPROCAL_MAGIC) - lax.bitcast_convert_type(d, jnp.int32)
    r = lax.bitcast_convert_type(seed, jnp.float32)
    for _ in range(_NEWTON_STEPS):
        r = r + r * (1.0 - d * r)
    return r


def fast_reciprocal(d):
    """``1 / d`` for ``d > 0`` as ``rsqrt(d)^2``: one MUFU op (``rsqrt.approx`` under
    ``approx_math``) and a multiply, where an IEEE divide is a long instruction sequence
    with a slow path."""
    r = lax.rsqrt(d)
    return r * r


def ptx_unary_tile(x, instruction: str):
    """One PTX instruction (``"rcp.approx.ftz.f32"``: one operand, one f32 result) on
    every element of a 2-D WGMMA-layout float32 tile inside a compiled Mosaic GPU kernel.

    For the MUFU forms Mosaic GPU does not emit: under ``approx_math`` it lowers
    ``lax.rsqrt`` to ``rsqrt.approx.f32`` and ``1 / x`` to a full division, and for the
    non-``ftz`` approximations ptxas guards every element against a subnormal input (a
    compare and two predicated multiplies around the MUFU op). Not for interpret mode,
    which runs no inline Mosaic GPU code.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from attn_mosaic_gpu._compat import ptx_unary

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(
        arg_types=(layout,),
        return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=layout),
    )
    def apply(ctx, tile):
        del ctx
        return ptx_unary(tile, instruction)

    return apply(x)


def fast_reciprocal_tile(d):
    """``fast_reciprocal`` of a 2-D WGMMA-layout tile inside a compiled Mosaic GPU kernel,
    with ``rsqrt.approx.ftz.f32``.

    Mosaic GPU lowers ``lax.rsqrt`` under ``approx_math`` to ``rsqrt.approx.f32``, for
    which ptxas guards every element against a subnormal input: a compare and two
    predicated multiplies around the MUFU op, 3 of a thread's ~15 instructions per
    score in the soft_sign forward (``benchmarks/kernel_dump.py --loops``). The ``ftz``
    form is the bare MUFU op. The kernels' denominators are at least ``1 / (scale *
    log2 e)`` (soft_sign's ``d / k``, ``attn_common.cap.cap_scaled_with_derivative``), far
    above the subnormals, so the results are bitwise those of ``fast_reciprocal``.
    One ``rcp.approx.ftz.f32`` per element (a multiply less) measured slower in the
    phoenix forward on an H200, 1.52 against 1.47 ms (docs/experiments.md).
    """
    r = ptx_unary_tile(d, "rsqrt.approx.ftz.f32")
    return r * r


def split_columns(x, fma_cols: int, on_fma: Callable, on_mufu: Callable):
    """``on_fma`` on ``x[:, :fma_cols]``, ``on_mufu`` on the rest, joined back.

    ``x`` is a 2-D tile (a wgmma accumulator: rows x keys); ``fma_cols`` is a multiple
    of 8 (the column width of a WGMMA-layout register tile, so both slices are whole
    register groups and the split costs no data movement). 0 and ``x.shape[1]`` send
    every element to one pipe.
    """
    cols = x.shape[1]
    if fma_cols <= 0:
        return on_mufu(x)
    if fma_cols >= cols:
        return on_fma(x)
    return jnp.concatenate([on_fma(x[:, :fma_cols]), on_mufu(x[:, fma_cols:])], axis=1)
