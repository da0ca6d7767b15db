"""An FP8 latent cache as the TPU sparse-MLA kernels read it: latent rows plus side rows.

The contract's ``attn_common.Fp8LatentCache`` holds, per token, ``latent``
float8_e4m3fn ``[512]``, ``scale`` float32 ``[4]`` and ``rope`` bfloat16 ``[64]``. In
TPU HBM an array's two minor dims are tiled (``(8, 128)`` for 32-bit, ``(16, 128)``
for 16-bit, ``(32, 128)`` for 8-bit elements), so a DMA of token rows moves whole
128-lane rows:

=========  ===================  ========================  ==================
field      logical bytes/token  DMA'd as stored (bytes)   read by the kernels
=========  ===================  ========================  ==================
latent     512                  512 (4 x 128 lanes)       as stored
scale      16                   512 (4 of 128 lanes)      via the side rows
rope       128                  256 (64 of 128 lanes)     via the side rows
=========  ===================  ========================  ==================

Read as stored that is 1,280 bytes per token, the bf16 paged cache's ``Dk_pad = 640``
x 2: no saving. So the kernels read the latent as stored and one lane-dense **side
row** per token, bfloat16 ``[128]`` (:func:`side_rows`, a pure function of ``scale``
and ``rope``):

* lanes ``0 .. 63``: the rope, as it is;
* lanes ``64 + 3 g + (0, 1, 2)``: group ``g``'s float32 scale split into three
  bfloat16 parts ``(hi, mid, lo)``: ``hi`` is the scale with its low 16 bits dropped,
  ``mid`` the remainder's likewise, ``lo`` the remainder of that, so that
  ``(hi + mid) + lo`` in float32 is the scale bit for bit (every partial sum is exact):
  for every finite scale of magnitude ``>= 2**-103`` (group max ``>= 448 * 2**-103``;
  below, the parts are float32 subnormals, which the TPU flushes to zero), for
  ``+-Inf`` (``mid = lo = 0``) and NaN (NaN);
* lanes ``76 .. 127``: zero.

That is 512 + 256 = **768 bytes per token** read from HBM, against 1,280 for the bf16
paged cache (0.6x) and 1,152 for dense bf16 rows; the contract's 656 would need the
side data of several tokens packed into one 128-lane row, which the kernels would have
to unpack across sublanes (not done).

The side rows are built once per call from a plain ``Fp8LatentCache`` (a pass over its
scale and rope: about 1 KB per token of the whole cache read and written on the TPU,
negligible next to a prefill's gathers, about ten times a decode step's). A
:class:`TpuFp8LatentCache` keeps them instead: it *is* an ``Fp8LatentCache`` (every op
takes it; ``scale`` and ``rope`` are read back exactly from the side rows), stored as
``latent`` and ``side`` only, 768 bytes per token at rest, and the TPU write-back keeps
it in that form. Build it once with :meth:`TpuFp8LatentCache.from_cache`.

In VMEM, :func:`dequantize_rows` turns a unit's ``latent [RB, 512]`` and ``side [RB,
128]`` into the bfloat16 rows ``[RB, 640]`` the MXU takes: ``bf16(latent * scale)`` per
128-group (the float32 product of the reference's ``dequantize_latent_cache``, rounded
once to bf16), the rope, then 64 zero lanes (the query's zero padding meets them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_common.fp8_cache import (
    GROUP,
    GROUPS,
    LATENT,
    ROPE,
    SCALE_DTYPE,
    Fp8LatentCache,
    check_fp8_cache,
)

SIDE = 128  # lanes of a side row
SCALE_LANE = ROPE  # first lane of the scale parts
SCALE_PARTS = 3  # bf16 parts per float32 scale
ROW_BYTES = LATENT + 2 * SIDE  # HBM bytes per token the kernels DMA: 768
ROWS_DTYPE = jnp.dtype(jnp.bfloat16)  # the dequantized rows' dtype (the MXU's)


def _drop_low_bits(x: jax.Array) -> jax.Array:
    """float32 -> bfloat16 keeping the top 16 bits (exact: no rounding)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)


def scale_parts(scale: jax.Array) -> jax.Array:
    """float32 ``[..., 4]`` -> bfloat16 ``[..., 4, 3]``: ``(hi, mid, lo)`` per scale,
    ``(hi + mid) + lo == scale`` in float32 (module docstring: the range it holds on)."""
    scale = scale.astype(jnp.float32)
    hi = _drop_low_bits(scale)
    rest = jnp.where(jnp.isinf(scale), 0.0, scale - hi.astype(jnp.float32))  # Inf - Inf
    mid = _drop_low_bits(rest)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)  # <= 8 significant bits
    return jnp.stack([hi, mid, lo], axis=-1)


def side_rows(cache: Fp8LatentCache) -> jax.Array:
    """The side rows of ``cache`` (any token grid): bfloat16 ``[..., 128]``, the rope in
    lanes 0-63, the scales' exact bf16 parts in lanes 64-75, zeros after. Reads only
    ``scale`` and ``rope``."""
    if isinstance(cache, TpuFp8LatentCache):
        return cache.side
    lead = cache.shape
    parts = scale_parts(cache.scale).reshape(*lead, GROUPS * SCALE_PARTS)
    pad = jnp.zeros((*lead, SIDE - ROPE - GROUPS * SCALE_PARTS), jnp.bfloat16)
    return jnp.concatenate([cache.rope.astype(jnp.bfloat16), parts, pad], axis=-1)


def side_scale(side: jax.Array) -> jax.Array:
    """The float32 scales ``[..., 4]`` a side row holds (exactly those it was built from)."""
    parts = side[..., SCALE_LANE : SCALE_LANE + GROUPS * SCALE_PARTS].astype(jnp.float32)
    parts = parts.reshape(*side.shape[:-1], GROUPS, SCALE_PARTS)
    return ((parts[..., 0] + parts[..., 1]) + parts[..., 2]).astype(SCALE_DTYPE)


class TpuFp8LatentCache(Fp8LatentCache):
    """An ``Fp8LatentCache`` stored the way the TPU kernels read it: ``latent``
    float8_e4m3fn ``[..., 512]`` and ``side`` bfloat16 ``[..., 128]`` (:func:`side_rows`),
    768 bytes per token. ``scale`` and ``rope`` are computed from ``side`` when read
    (exactly the values it was built from), so every op that takes an
    ``Fp8LatentCache`` takes this one and gives the same result; the TPU kernels DMA
    ``latent`` and ``side`` as they are, with no per-call conversion, and the TPU
    ``paged_write_back`` writes the new rows' side rows too. A pytree of ``(latent,
    side)``.

    Build it once: ``TpuFp8LatentCache.from_cache(quantize_latent_cache(kv))``; back:
    :meth:`to_cache`. The reference's ``paged_write_back`` writes plain
    ``Fp8LatentCache`` values only (its scatter is per field).
    """

    def __init__(self, latent: jax.Array, side: jax.Array):  # no checks: pytree leaves
        object.__setattr__(self, "latent", latent)
        object.__setattr__(self, "side", side)

    def _side(self):
        """``side``, checked: the ops validate a cache through ``scale`` and ``rope``."""
        side = self.side
        shape, dtype = getattr(side, "shape", None), getattr(side, "dtype", None)
        if shape is None or dtype is None:
            raise TypeError(f"cache.side: got {type(side).__name__}, expected an array")
        if jnp.dtype(dtype) != ROWS_DTYPE or not shape or shape[-1] != SIDE:
            raise ValueError(
                f"cache.side: got {jnp.dtype(dtype).name} {tuple(shape)}, expected bfloat16 "
                f"[..., {SIDE}] (attn_pallas_tpu.fp8_rows.side_rows)"
            )
        return side

    @property
    def scale(self) -> jax.Array:
        side = self._side()
        if isinstance(side, jax.ShapeDtypeStruct):  # validation of shapes only
            return jax.ShapeDtypeStruct((*side.shape[:-1], GROUPS), SCALE_DTYPE)
        return side_scale(side)

    @property
    def rope(self) -> jax.Array:
        side = self._side()
        if isinstance(side, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((*side.shape[:-1], ROPE), side.dtype)
        return side[..., :ROPE]

    def _arrays(self):
        return self.latent, self.side

    def __repr__(self) -> str:
        return f"TpuFp8LatentCache(latent={self.latent!r}, side={self.side!r})"

    @classmethod
    def from_cache(cls, cache: Fp8LatentCache) -> TpuFp8LatentCache:
        """``cache`` in the TPU layout: its latent as it is, its side rows built."""
        if isinstance(cache, TpuFp8LatentCache):
            return cache
        check_fp8_cache(cache, "cache")
        return cls(cache.latent, side_rows(cache))

    def to_cache(self) -> Fp8LatentCache:
        """The plain ``Fp8LatentCache`` (latent, scale, rope) holding the same values."""
        return Fp8LatentCache(self.latent, self.scale, self.rope)


jax.tree_util.register_pytree_node(
    TpuFp8LatentCache,
    lambda c: ((c.latent, c.side), None),
    lambda _, leaves: TpuFp8LatentCache(*leaves),
)


def dequantize_rows(latent: jax.Array, side: jax.Array) -> jax.Array:
    """``latent [RB, 512]`` float8_e4m3fn and ``side [RB, 128]`` -> bfloat16 ``[RB,
    640]``: ``bf16(latent * scale)`` per 128-group, the rope, 64 zero lanes.

    Runs inside the kernels (VMEM values) and in plain XLA alike: static lane slices,
    float32 products, one rounding to bf16."""
    side32 = side.astype(jnp.float32)
    groups = []
    for g in range(GROUPS):
        c = SCALE_LANE + SCALE_PARTS * g
        scale = (side32[:, c : c + 1] + side32[:, c + 1 : c + 2]) + side32[:, c + 2 : c + 3]
        values = latent[:, g * GROUP : (g + 1) * GROUP].astype(jnp.float32)
        groups.append((values * scale).astype(ROWS_DTYPE))
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, SIDE), 1)
    rope = jnp.where(lane < ROPE, side, jnp.zeros_like(side)).astype(ROWS_DTYPE)
    return jnp.concatenate([*groups, rope], axis=1)
