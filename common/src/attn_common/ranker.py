"""Ranker attention: the input contract every backend validates the same way.

Shapes: ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]``, ``bounds [B, 4]`` (see
``attn_common.bounds``). Query head ``h`` reads kv head ``h // (Hq // Hkv)``.
Outputs ``out [B, S, Hq, D]`` (q's dtype) and optionally ``lse [B, Hq, S]`` float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.cap import CapParams, normalize_cap


class _GroupedHeads:
    """``group_size`` of a class with ``q_heads`` and ``kv_heads`` fields."""

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.q_heads // self.kv_heads


@dataclasses.dataclass(frozen=True)
class RankerProblem(_GroupedHeads):
    """Static facts about one ranker call, after validation."""

    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    sm_scale: float
    cap: CapParams

    def padded(self, seq_pad: int) -> dict:
        """The fields of :class:`RankerKernelStatic` for this problem with the sequence
        padded to ``seq_pad`` rows (a multiple of the kernel's tiles)."""
        if seq_pad < self.seq_len:
            raise ValueError(f"seq_pad: got {seq_pad}, expected at least seq_len {self.seq_len}")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["seq_len"]
        return {**fields, "seq_pad": seq_pad}


@dataclasses.dataclass(frozen=True)
class RankerKernelStatic(_GroupedHeads):
    """The facts of a ranker problem every kernel is specialised on, the sequence padded
    to ``seq_pad`` rows: the base of the backends' (hashable, jit-static) kernel statics,
    which add their tiling and schedule fields. Built by ``RankerProblem.padded``."""

    batch: int
    seq_pad: int
    q_heads: int
    kv_heads: int
    head_dim: int
    sm_scale: float
    cap: CapParams


def array_shape(x, name: str) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: got {type(x).__name__}, expected an array")
    return tuple(shape)


def resolve_sm_scale(sm_scale, head_dim: int, *, required: bool = False) -> float:
    """``None`` -> ``1/sqrt(head_dim)`` (unless required); else a positive finite float."""
    if sm_scale is None:
        if required:
            raise ValueError("sm_scale: got None, expected a positive float (it is required)")
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, int | float):
        raise TypeError(f"sm_scale: got {sm_scale!r}, expected a Python float")
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale: got {sm_scale!r}, expected a positive finite float")
    return float(sm_scale)


def check_ranker_inputs(
    q,
    k,
    v,
    *,
    sm_scale=None,
    cap: CapParams | None = None,
    dtypes: Collection | None = None,
    head_dims: Collection[int] | None = None,
) -> RankerProblem:
    """Validate ranker inputs before tracing; raise naming the argument and the rule.

    ``dtypes`` / ``head_dims`` restrict what a kernel supports (the reference takes any
    float dtype and head dim).
    """
    q_shape, k_shape, v_shape = array_shape(q, "q"), array_shape(k, "k"), array_shape(v, "v")
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name}: got shape {shape}, expected rank 4 [B, S, H, D]")
    batch, seq_len, q_heads, head_dim = q_shape
    if k_shape[:2] != (batch, seq_len) or k_shape[3] != head_dim:
        raise ValueError(
            f"k: got shape {k_shape}, expected [B={batch}, S={seq_len}, Hkv, D={head_dim}] "
            "(self-attention: k shares q's batch, length and head dim)"
        )
    if v_shape != k_shape:
        raise ValueError(f"v: got shape {v_shape}, expected k's shape {k_shape}")
    kv_heads = k_shape[2]
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(
            f"k: got {kv_heads} kv heads for {q_heads} query heads, expected Hq % Hkv == 0"
        )
    if seq_len == 0 or head_dim == 0 or batch == 0:
        raise ValueError(f"q: got shape {q_shape}, expected non-empty B, S and D")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}: got dtype {x.dtype}, expected a floating dtype")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: got dtypes {q.dtype}, {k.dtype}, {v.dtype}, expected one dtype")
    if dtypes is not None and jnp.dtype(q.dtype) not in {jnp.dtype(d) for d in dtypes}:
        raise TypeError(
            f"q: got dtype {q.dtype}, expected one of {sorted(str(jnp.dtype(d)) for d in dtypes)}"
        )
    if head_dims is not None and head_dim not in head_dims:
        raise NotImplementedError(
            f"q: got head dim {head_dim}, this backend supports {sorted(head_dims)}"
        )
    return RankerProblem(
        batch=batch,
        seq_len=seq_len,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        sm_scale=resolve_sm_scale(sm_scale, head_dim),
        cap=normalize_cap(cap),
    )


def ranker_flops(bounds_array, q_heads: int, head_dim: int, *, backward: bool = False) -> float:
    """Effective FLOPs over allowed pairs: ``4 * D * Hq * sum |allowed(i)|`` (x3.5 fwd+bwd).

    ``bounds_array`` is a concrete, clipped ``[B, 4]`` array.
    """
    b = np.asarray(bounds_array, dtype=np.int64)
    hist = b[:, 1] - b[:, 0]
    cand = b[:, 3] - b[:, 2]
    # overlap of H and C (candidates inside H count their self key once)
    ov = np.maximum(np.minimum(b[:, 1], b[:, 3]) - np.maximum(b[:, 0], b[:, 2]), 0)
    queries_reading_hist = hist + cand - ov
    pairs = queries_reading_hist * hist + (cand - ov)
    flops = 4.0 * head_dim * q_heads * float(pairs.sum())
    return flops * 3.5 if backward else flops


def kernel_vjp(forward: Callable, backward: Callable) -> Callable:
    """A backend's ranker kernels as one differentiable ``attention(q, k, v, bounds, kw)``.

    ``forward(q, k, v, bounds, **kw, return_lse=True) -> (out, lse)`` and
    ``backward(q, k, v, bounds, out, lse, dout, dlse, **kw) -> (dq, dk, dv)``; ``kw`` is
    a hashable tuple of ``(name, value)`` pairs (static). The result is a
    ``jax.custom_vjp`` returning ``(out, lse)`` whose residuals are ``q, k, v, bounds,
    out, lse``: the LSE is always computed (the backward needs it) and its cotangent
    reaches the backward (the kernels fold it in as ``delta' = rowsum(dO * O) - dlse``),
    so a loss on the LSE (``return_lse=True``) is differentiable. ``bounds`` (integers)
    gets no cotangent.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def attention(q, k, v, bounds, kw):
        return forward(q, k, v, bounds, **dict(kw), return_lse=True)

    def attention_fwd(q, k, v, bounds, kw):
        out, lse = forward(q, k, v, bounds, **dict(kw), return_lse=True)
        return (out, lse), (q, k, v, bounds, out, lse)

    def attention_bwd(kw, residuals, cotangents):
        q, k, v, bounds, out, lse = residuals
        dout, dlse = cotangents
        dq, dk, dv = backward(q, k, v, bounds, out, lse, dout, dlse, **dict(kw))
        return dq, dk, dv, None

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


def unsupported_ranker_inputs(
    args: tuple, kwargs: dict, *, dtypes, head_dims, kernels: str
) -> str | None:
    """The reason a backend's ranker kernels cannot take a call (``None``: they can).

    Static facts only, for a backend's ``supports`` hook (``attn_common.dispatch``): q's
    dtype and head dim (every backend's kernels take packed bounds ``[B, U, 4]``).
    Inputs too malformed to judge give ``None``, so the kernel's own validation names
    what is wrong. ``args``/``kwargs`` are those of ``ranker_attention(q, k, v, bounds,
    ...)``; ``kernels`` names them in the message.
    """
    q = args[0] if args else kwargs.get("q")
    dtype, shape = getattr(q, "dtype", None), getattr(q, "shape", None)
    if dtype is None or shape is None or len(shape) != 4:
        return None
    if not any(jnp.dtype(dtype) == jnp.dtype(d) for d in dtypes):
        names = " or ".join(jnp.dtype(d).name for d in dtypes)
        return f"q: got dtype {jnp.dtype(dtype).name}, the {kernels} kernels take {names}"
    if shape[-1] not in head_dims:
        return (
            f"q: got head dim D = {shape[-1]}, the {kernels} kernels take D in {tuple(head_dims)}"
        )
    return None
