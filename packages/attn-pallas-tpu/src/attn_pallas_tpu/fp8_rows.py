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

In VMEM, :func:`dequantize_rows` turns a unit's ``latent [RB, 512]`` and ``side [RB,
128]`` into the bfloat16 rows ``[RB, 640]`` the MXU takes: ``bf16(latent * scale)`` per
128-group (the float32 product of the reference's ``dequantize_latent_cache``, rounded
once to bf16), the rope, then 64 zero lanes (the query's zero padding meets them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attn_common.fp8_cache import GROUP, GROUPS, LATENT, ROPE, Fp8LatentCache

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
    lead = cache.shape
    parts = scale_parts(cache.scale).reshape(*lead, GROUPS * SCALE_PARTS)
    pad = jnp.zeros((*lead, SIDE - ROPE - GROUPS * SCALE_PARTS), jnp.bfloat16)
    return jnp.concatenate([cache.rope.astype(jnp.bfloat16), parts, pad], axis=-1)


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
