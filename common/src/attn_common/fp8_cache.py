"""The FP8 latent cache of sparse MLA (DeepSeek V3.2's format), and its checks.

Per token, a latent row ``[c_kv (512) | k_rope (64)]`` is stored as:

* ``latent``: the 512 ``c_kv`` values in ``float8_e4m3fn``, each 128-group divided by
  its scale;
* ``scale``: one ``float32`` per 128-group (4), ``max |x| / 448`` over the group (448
  is e4m3fn's largest finite value; computed as ``max |x| * float32(1 / 448)``, within
  one ulp, the same bits on every platform), or 1 where that is 0 in float32 (an
  all-zero group, or one whose largest magnitude underflows);
* ``rope``: the 64 ``k_rope`` values in ``bfloat16``, kept as they are.

The value read back is ``latent * scale`` (in float32) followed by the rope: 656 bytes
per token against 1,152 in bf16. A group holding NaN or Inf reads back as all NaN.

:class:`Fp8LatentCache` holds the three as a pytree; the leading dims (the *token
grid*, :attr:`Fp8LatentCache.shape`) are the same for the three fields: ``[B, T]`` for
a flat cache, ``[num_pages, page_size]`` for a paged one. :meth:`Fp8LatentCache.to_packed`
and :meth:`Fp8LatentCache.from_packed` convert to and from the 656-byte-per-token layout
of DeepSeek's engines (``uint8 [..., 656]``: the 512 fp8 bytes, then the 4 scales as
little-endian float32, then the 64 rope values as little-endian bfloat16).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

LATENT = 512  # c_kv values per token (DeepSeek V3's kv_lora_rank)
ROPE = 64  # rope values per token
GROUP = 128  # latent values per scale
GROUPS = LATENT // GROUP
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# The scale is max |x| times float32(1 / 448): XLA turns a division by a constant into
# this multiplication on some platforms (CPU: 1 ulp apart), so the rule is written as
# the product that every platform computes to the same bits.
_INV_FP8_MAX = np.float32(1.0 / FP8_MAX)
PACKED_BYTES = LATENT + 4 * GROUPS + 2 * ROPE  # 656
LATENT_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
SCALE_DTYPE = jnp.dtype(jnp.float32)
ROPE_DTYPE = jnp.dtype(jnp.bfloat16)
COMPUTE_DTYPE = jnp.dtype(jnp.bfloat16)  # the query's dtype against an FP8 cache

_FIELDS = (
    ("latent", LATENT, LATENT_DTYPE),
    ("scale", GROUPS, SCALE_DTYPE),
    ("rope", ROPE, ROPE_DTYPE),
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8LatentCache:
    """A latent cache in FP8: ``latent`` float8_e4m3fn ``[..., 512]``, ``scale``
    float32 ``[..., 4]`` (one per 128 latent values), ``rope`` bfloat16 ``[..., 64]``.

    Build one with :func:`quantize_latent_cache` or :meth:`from_packed`; read it back
    with :func:`dequantize_latent_cache`. Ops take it wherever they take a cache (flat
    ``[B, T]`` or paged ``[num_pages, page_size]`` token grid) and check it there
    (:func:`check_fp8_cache`); the constructor does not, so that JAX can rebuild it
    with any leaves.
    """

    latent: jax.Array
    scale: jax.Array
    rope: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The token grid: the leading dims the three fields share."""
        return tuple(self.latent.shape[:-1])

    @property
    def nbytes(self) -> int:
        """Bytes held (656 per token)."""
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self._arrays())

    def _arrays(self):
        return self.latent, self.scale, self.rope

    def reshape(self, *shape: int) -> Fp8LatentCache:
        """The same tokens on another token grid (each field keeps its last dim)."""
        return jax.tree.map(lambda a: a.reshape(*shape, a.shape[-1]), self)

    def take_rows(self, rows: jax.Array) -> Fp8LatentCache:
        """Rows ``rows`` (any int shape) of a ``[R]`` grid: a cache on ``rows``' shape."""
        return jax.tree.map(lambda a: a[rows], self)

    def to_packed(self) -> jax.Array:
        """DeepSeek's per-token layout: ``uint8 [..., 656]`` (512 fp8 bytes, 4 float32
        scales, 64 bfloat16 rope values; little-endian)."""
        check_fp8_cache(self, "cache")
        lead = self.shape
        parts = [
            jax.lax.bitcast_convert_type(self.latent, jnp.uint8),
            jax.lax.bitcast_convert_type(self.scale, jnp.uint8).reshape(*lead, 4 * GROUPS),
            jax.lax.bitcast_convert_type(self.rope, jnp.uint8).reshape(*lead, 2 * ROPE),
        ]
        return jnp.concatenate(parts, axis=-1)

    @classmethod
    def from_packed(cls, packed: jax.Array) -> Fp8LatentCache:
        """The cache held in DeepSeek's per-token layout ``uint8 [..., 656]``."""
        shape = getattr(packed, "shape", None)
        if shape is None or not hasattr(packed, "dtype"):
            raise TypeError(f"packed: got {type(packed).__name__}, expected a uint8 array")
        if jnp.dtype(packed.dtype) != jnp.uint8:
            raise TypeError(f"packed: got dtype {jnp.dtype(packed.dtype).name}, expected uint8")
        if len(shape) < 1 or shape[-1] != PACKED_BYTES:
            raise ValueError(
                f"packed: got shape {tuple(shape)}, expected [..., {PACKED_BYTES}] (512 fp8 "
                "bytes, 4 float32 scales, 64 bfloat16 rope values per token)"
            )
        packed = jnp.asarray(packed)
        lead = tuple(shape[:-1])
        scale_end = LATENT + 4 * GROUPS
        latent = jax.lax.bitcast_convert_type(packed[..., :LATENT], LATENT_DTYPE)
        scale = packed[..., LATENT:scale_end].reshape(*lead, GROUPS, 4)
        rope = packed[..., scale_end:].reshape(*lead, ROPE, 2)
        return cls(
            latent,
            jax.lax.bitcast_convert_type(scale, SCALE_DTYPE),
            jax.lax.bitcast_convert_type(rope, ROPE_DTYPE),
        )


def _array_field(x, name: str) -> tuple[tuple[int, ...], jnp.dtype]:
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: got {type(x).__name__}, expected an array")
    return tuple(shape), jnp.dtype(x.dtype)


def check_fp8_cache(cache, name: str, grid: tuple | None = None, hint: str = "") -> tuple[int, ...]:
    """Validate an :class:`Fp8LatentCache` (field dtypes, last dims, a shared token
    grid, and ``grid`` when given, ``None`` entries free); return the token grid.

    ``hint`` names the grid's axes in the error (``"[B, T]"``).
    """
    if not isinstance(cache, Fp8LatentCache):
        raise TypeError(f"{name}: got {type(cache).__name__}, expected an Fp8LatentCache")
    lead = None
    for field, width, dtype in _FIELDS:
        shape, got = _array_field(getattr(cache, field), f"{name}.{field}")
        if got != dtype:
            raise TypeError(f"{name}.{field}: got dtype {got.name}, expected {dtype.name}")
        if not shape or shape[-1] != width:
            raise ValueError(f"{name}.{field}: got shape {shape}, expected [..., {width}]")
        if lead is None:
            lead = shape[:-1]
        elif shape[:-1] != lead:
            raise ValueError(
                f"{name}.{field}: got shape {shape}, expected the token grid of {name}.latent "
                f"{list(lead)} then {width}: the three fields hold the same tokens"
            )
    if grid is not None and (
        len(lead) != len(grid)
        or any(g is not None and g != d for g, d in zip(grid, lead, strict=False))
    ):
        want = ", ".join("*" if g is None else str(g) for g in grid)
        raise ValueError(
            f"{name}: got an Fp8LatentCache on the token grid {list(lead)}, expected "
            f"[{want}]{' = ' + hint if hint else ''}"
        )
    return lead


def check_fp8_widths(dk: int, kv_lora_rank: int, *, q_name: str) -> None:
    """An op over an :class:`Fp8LatentCache` has ``Dk = 576`` and ``kv_lora_rank = 512``."""
    if dk != LATENT + ROPE:
        raise ValueError(
            f"{q_name}: got Dk = {dk}, an Fp8LatentCache holds Dk = {LATENT} + {ROPE} = "
            f"{LATENT + ROPE} features per token"
        )
    if kv_lora_rank != LATENT:
        raise ValueError(
            f"kv_lora_rank: got {kv_lora_rank}, an Fp8LatentCache holds kv_lora_rank = "
            f"{LATENT} latent values per token"
        )


def cache_compute_dtype(cache) -> jnp.dtype:
    """The dtype a query takes against ``cache``: the cache's own dtype, or bfloat16 for
    an :class:`Fp8LatentCache` (kernels keep Q in bf16 and dequantize the rows)."""
    return COMPUTE_DTYPE if isinstance(cache, Fp8LatentCache) else jnp.dtype(cache.dtype)


def quantize_latent_cache(kv: jax.Array) -> Fp8LatentCache:
    """A latent cache ``[..., 576]`` (bfloat16 or float32) in FP8 (:class:`Fp8LatentCache`).

    Per token and 128-group of the first 512 values: ``scale = max |x| / 448`` (as
    ``max |x| * float32(1 / 448)``; 1 where that is 0), ``latent = x / scale`` rounded to nearest-even ``float8_e4m3fn``; the last
    64 values are kept as bfloat16.
    """
    shape, dtype = _array_field(kv, "kv")
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"kv: got dtype {dtype.name}, expected bfloat16 or float32")
    if not shape or shape[-1] != LATENT + ROPE:
        raise ValueError(
            f"kv: got shape {shape}, expected [..., {LATENT + ROPE}] ({LATENT} latent values, "
            f"then {ROPE} rope values)"
        )
    lead = shape[:-1]
    x = jnp.asarray(kv).astype(jnp.float32)
    groups = x[..., :LATENT].reshape(*lead, GROUPS, GROUP)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    scale = amax * _INV_FP8_MAX
    scale = jnp.where(scale == 0, 1.0, scale)  # NaN stays NaN: the group reads back NaN
    # Clipping only catches f32 rounding of amax / scale a hair above 448 (no e4m3fn
    # value above it: it would turn to NaN); NaN passes through jnp.clip.
    latent = jnp.clip(groups / scale[..., None], -FP8_MAX, FP8_MAX).astype(LATENT_DTYPE)
    return Fp8LatentCache(
        latent.reshape(*lead, LATENT), scale.astype(SCALE_DTYPE), x[..., LATENT:].astype(ROPE_DTYPE)
    )


def dequantize_latent_cache(cache: Fp8LatentCache) -> jax.Array:
    """An :class:`Fp8LatentCache` read back: float32 ``[..., 576]``, ``latent * scale``
    per 128-group, then the rope."""
    lead = check_fp8_cache(cache, "cache")
    latent = cache.latent.astype(jnp.float32).reshape(*lead, GROUPS, GROUP)
    latent = (latent * cache.scale[..., None]).reshape(*lead, LATENT)
    return jnp.concatenate([latent, cache.rope.astype(jnp.float32)], axis=-1)
