"""The FP8 latent cache format (attn_common.fp8_cache) against numpy / ml_dtypes rules:
the scale rule (incl. all-zero groups), round-to-nearest-even e4m3fn, exact round trips,
the error bound, DeepSeek's packed byte order, and the checks' errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attn_common.fp8_cache import (
    FP8_MAX,
    GROUP,
    GROUPS,
    LATENT,
    PACKED_BYTES,
    ROPE,
    Fp8LatentCache,
    check_fp8_cache,
    dequantize_latent_cache,
    quantize_latent_cache,
)

E4M3 = ml_dtypes.float8_e4m3fn


def _numpy_quantize(x: np.ndarray):
    """The format's rule written in numpy (float32 arithmetic, ml_dtypes RNE cast)."""
    x = np.asarray(x, np.float32)
    lead = x.shape[:-1]
    groups = x[..., :LATENT].reshape(*lead, GROUPS, GROUP)
    scale = (np.max(np.abs(groups), axis=-1) * np.float32(1 / FP8_MAX)).astype(np.float32)
    scale = np.where(scale == 0, np.float32(1), scale)
    latent = (groups / scale[..., None]).astype(np.float32).astype(E4M3)
    rope = x[..., LATENT:].astype(ml_dtypes.bfloat16)
    return latent.reshape(*lead, LATENT), scale, rope


def _assert_latent_rounded(got, want, x, scale) -> None:
    """``got`` equals the rule's codes bit for bit, except where ``x / scale`` is a tie
    between two e4m3fn values to within float32 rounding of the quotient: XLA's CPU
    division is not always correctly rounded (e.g. -0.0068359375 = 3.5 subnormal steps
    came out 1 ulp low and rounded down); there either neighbour is the rule's answer."""
    differ = _bits(got) != _bits(want)
    lead = x.shape[:-1]
    exact = x[..., :LATENT].astype(np.float64).reshape(*lead, GROUPS, GROUP) / scale[..., None]
    exact = exact.reshape(*lead, LATENT)[differ]
    g, w = got[differ].astype(np.float64), want[differ].astype(np.float64)
    mid = (g + w) / 2
    assert (np.abs(exact - mid) <= np.abs(mid) * 2.0**-22).all(), (exact, g, w)
    assert differ.mean() < 1e-3, differ.mean()


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _random_cache_input(seed: int, shape, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*shape, LATENT + ROPE)).astype(np.float32)
    x[..., :LATENT] *= 10.0 ** rng.uniform(-3, 3, size=(*shape, LATENT))  # wide range
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_quantize_equals_the_rule_bit_for_bit(dtype):
    x = _random_cache_input(0, (3, 7), dtype)
    x[0, 0, :GROUP] = 0  # an all-zero group: scale 1, latent 0
    x[1, 2, GROUP : 2 * GROUP] = -0.0
    got = quantize_latent_cache(jnp.asarray(x))
    assert got.latent.dtype == jnp.float8_e4m3fn and got.latent.shape == (3, 7, LATENT)
    assert got.scale.dtype == jnp.float32 and got.scale.shape == (3, 7, GROUPS)
    assert got.rope.dtype == jnp.bfloat16 and got.rope.shape == (3, 7, ROPE)
    latent, scale, rope = _numpy_quantize(x)
    np.testing.assert_array_equal(_bits(got.scale), _bits(scale))
    _assert_latent_rounded(np.asarray(got.latent), latent, x, scale)
    np.testing.assert_array_equal(_bits(got.rope), _bits(rope))
    assert np.asarray(got.scale)[0, 0, 0] == 1 and np.asarray(got.scale)[1, 2, 1] == 1
    # Every nonzero group's largest magnitude maps to e4m3fn's largest value.
    mags = np.abs(np.asarray(got.latent, np.float32)).reshape(3, 7, GROUPS, GROUP).max(-1)
    nonzero = np.abs(x[..., :LATENT].astype(np.float32)).reshape(3, 7, GROUPS, GROUP).max(-1) > 0
    np.testing.assert_array_equal(mags[nonzero], FP8_MAX)


def test_scale_rule_and_dequantize_rule():
    x = np.zeros((2, LATENT + ROPE), np.float32)
    x[0, 5] = -896.0  # group 0 of token 0: scale 2, latent -448
    x[0, GROUP + 3] = 1e-3  # group 1: scale 1e-3 / 448
    x[0, LATENT:] = np.arange(ROPE) / 8  # rope kept (exact in bf16)
    c = quantize_latent_cache(jnp.asarray(x))
    scale = np.asarray(c.scale)
    assert scale[0, 0] == 2.0
    assert scale[0, 1] == np.float32(np.float32(1e-3) * np.float32(1 / 448))
    assert abs(scale[0, 1] - np.float32(1e-3) / np.float32(448)) <= np.spacing(scale[0, 1])
    assert scale[0, 2] == scale[0, 3] == 1.0 and (scale[1] == 1.0).all()
    assert np.asarray(c.latent, np.float32)[0, 5] == -448
    back = np.asarray(dequantize_latent_cache(c))
    assert back.dtype == np.float32 and back.shape == x.shape
    want = np.concatenate(
        [
            (np.asarray(c.latent, np.float32).reshape(2, GROUPS, GROUP) * scale[..., None]).reshape(
                2, LATENT
            ),
            np.asarray(c.rope, np.float32),
        ],
        axis=-1,
    )
    np.testing.assert_array_equal(back, want)
    np.testing.assert_array_equal(back[:, LATENT:], x[:, LATENT:])
    assert back[0, 5] == -896.0


def test_representable_values_round_trip_exactly():
    """Values that are e4m3fn numbers times a power-of-two scale, with +-448 * scale in
    each group, come back bit for bit; a second quantization changes nothing."""
    rng = np.random.default_rng(1)
    shape = (4, 9)
    codes = rng.integers(0, 256, size=(*shape, LATENT), dtype=np.uint8).view(E4M3)
    codes = np.where(np.isnan(codes.astype(np.float32)), E4M3(0), codes)
    groups = codes.astype(np.float32).reshape(*shape, GROUPS, GROUP)
    groups[..., 0] = np.where(rng.random((*shape, GROUPS)) < 0.5, 448.0, -448.0)
    scale = np.float32(2.0) ** rng.integers(-20, 20, size=(*shape, GROUPS)).astype(np.float32)
    x = np.concatenate(
        [
            (groups * scale[..., None]).reshape(*shape, LATENT),
            rng.standard_normal((*shape, ROPE)).astype(ml_dtypes.bfloat16).astype(np.float32),
        ],
        axis=-1,
    )
    c = quantize_latent_cache(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(c.scale), scale)
    back = np.asarray(dequantize_latent_cache(c))
    np.testing.assert_array_equal(back, x)
    again = quantize_latent_cache(jnp.asarray(back))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(c), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_error_bound():
    """|x - read back| <= max(|x| 2**-4, scale 2**-10): e4m3fn's half-ulp for normals,
    and its subnormal spacing 2**-9 (halved) times the scale; rope is bf16 rounding."""
    x = _random_cache_input(2, (64,))
    c = quantize_latent_cache(jnp.asarray(x))
    back = np.asarray(dequantize_latent_cache(c))
    scale = np.repeat(np.asarray(c.scale), GROUP, axis=-1)
    lat = x[:, :LATENT]
    bound = np.maximum(np.abs(lat) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert (np.abs(back[:, :LATENT] - lat) <= bound).all()
    rope_err = np.abs(back[:, LATENT:] - x[:, LATENT:])
    assert (rope_err <= np.abs(x[:, LATENT:]) * 2.0**-8).all()


def test_non_finite_group_reads_back_nan():
    x = _random_cache_input(3, (3,))
    x[0, 7] = np.nan
    x[1, GROUP * 2 + 1] = np.inf
    back = np.asarray(dequantize_latent_cache(quantize_latent_cache(jnp.asarray(x))))
    assert np.isnan(back[0, :GROUP]).all() and np.isfinite(back[0, GROUP:]).all()
    assert np.isnan(back[1, 2 * GROUP : 3 * GROUP]).all()
    assert np.isfinite(np.delete(back[1], np.s_[2 * GROUP : 3 * GROUP])).all()
    assert np.isfinite(back[2]).all()


def test_packed_layout_byte_order():
    """``to_packed``: the 512 fp8 bytes, then the 4 scales as little-endian float32, then
    the 64 rope values as little-endian bfloat16, built here byte by byte."""
    x = _random_cache_input(4, (2, 3))
    c = quantize_latent_cache(jnp.asarray(x))
    packed = np.asarray(c.to_packed())
    assert packed.dtype == np.uint8 and packed.shape == (2, 3, PACKED_BYTES)
    latent, scale, rope = np.asarray(c.latent), np.asarray(c.scale), np.asarray(c.rope)
    want = np.zeros((2, 3, PACKED_BYTES), np.uint8)
    for i in range(2):
        for j in range(3):
            buf = bytearray(latent[i, j].tobytes())
            for s in scale[i, j]:
                buf += np.float32(s).astype("<f4").tobytes()
            for r in rope[i, j].view(np.uint16):
                buf += int(r).to_bytes(2, "little")
            want[i, j] = np.frombuffer(bytes(buf), np.uint8)
    np.testing.assert_array_equal(packed, want)
    # Spot-check against plain struct arithmetic: scale 0 of token (0, 0).
    s0 = int.from_bytes(bytes(packed[0, 0, LATENT : LATENT + 4]), "little")
    assert np.uint32(s0).view(np.float32) == scale[0, 0, 0]
    back = Fp8LatentCache.from_packed(jnp.asarray(packed))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(c), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda p: p.to_packed())(back)), packed)


def test_pytree_jit_and_grid():
    c = quantize_latent_cache(jnp.asarray(_random_cache_input(5, (4, 6))))
    assert c.shape == (4, 6) and c.nbytes == 4 * 6 * PACKED_BYTES
    leaves, tree = jax.tree.flatten(c)
    assert len(leaves) == 3 and jax.tree.unflatten(tree, leaves) == c
    got = jax.jit(dequantize_latent_cache)(c)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(dequantize_latent_cache(c)))
    flat = c.reshape(-1)
    assert flat.shape == (24,) and flat.latent.shape == (24, LATENT)
    rows = flat.take_rows(jnp.array([[5, 0], [23, 5]]))
    assert rows.shape == (2, 2)
    np.testing.assert_array_equal(_bits(rows.scale[1, 0]), _bits(c.scale[3, 5]))


def _fields(c):
    return c.latent, c.scale, c.rope


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda c: Fp8LatentCache(c.latent.astype(jnp.bfloat16), c.scale, c.rope), TypeError,
         r"kv\.latent: got dtype bfloat16, expected float8_e4m3fn"),
        (lambda c: Fp8LatentCache(c.latent, c.scale.astype(jnp.bfloat16), c.rope), TypeError,
         r"kv\.scale: got dtype bfloat16, expected float32"),
        (lambda c: Fp8LatentCache(c.latent, c.scale, c.rope.astype(jnp.float32)), TypeError,
         r"kv\.rope: got dtype float32, expected bfloat16"),
        (lambda c: Fp8LatentCache(c.latent[..., :256], c.scale, c.rope), ValueError,
         r"kv\.latent: got shape \(2, 3, 256\), expected \[\.\.\., 512\]"),
        (lambda c: Fp8LatentCache(c.latent, c.scale[..., :2], c.rope), ValueError,
         r"kv\.scale: got shape \(2, 3, 2\), expected \[\.\.\., 4\]"),
        (lambda c: Fp8LatentCache(c.latent, c.scale[:, :2], c.rope), ValueError,
         r"kv\.scale: got shape \(2, 2, 4\), expected the token grid of kv\.latent \[2, 3\]"),
        (lambda c: Fp8LatentCache(c.latent, c.scale, np.zeros(3)), TypeError,
         r"kv\.rope: got dtype float64, expected bfloat16"),
        (lambda c: Fp8LatentCache(c.latent, [1.0], c.rope), TypeError,
         r"kv\.scale: got list, expected an array"),
        (lambda c: dequantize_latent_cache(c), TypeError,
         r"kv: got \w+, expected an Fp8LatentCache"),
    ],
)  # fmt: skip
def test_check_names_field_value_and_rule(change, error, match):
    c = quantize_latent_cache(jnp.asarray(_random_cache_input(6, (2, 3))))
    bad = change(c)
    with pytest.raises(error, match=match):
        check_fp8_cache(bad, "kv")


def test_check_grid():
    c = quantize_latent_cache(jnp.asarray(_random_cache_input(7, (2, 3))))
    assert check_fp8_cache(c, "kv", (2, None)) == (2, 3)
    with pytest.raises(ValueError, match=r"kv: got an Fp8LatentCache on the token grid \[2, 3\], "
                       r"expected \[\*, 16\] = \[num_pages, page_size=16\]"):  # fmt: skip
        check_fp8_cache(c, "kv", (None, 16), "[num_pages, page_size=16]")


@pytest.mark.parametrize(
    ("arg", "error", "match"),
    [
        (np.zeros((2, 576), np.float16), TypeError, r"kv: got dtype float16, expected bfloat16 or float32"),
        (np.zeros((2, 640), np.float32), ValueError, r"kv: got shape \(2, 640\), expected \[\.\.\., 576\]"),
        ([1.0], TypeError, r"kv: got list, expected an array"),
    ],
)  # fmt: skip
def test_quantize_refuses(arg, error, match):
    with pytest.raises(error, match=match):
        quantize_latent_cache(arg)


@pytest.mark.parametrize(
    ("arg", "error", "match"),
    [
        (np.zeros((2, PACKED_BYTES), np.int8), TypeError, r"packed: got dtype int8, expected uint8"),
        (np.zeros((2, 576), np.uint8), ValueError, r"packed: got shape \(2, 576\), expected \[\.\.\., 656\]"),
        ("x", TypeError, r"packed: got str, expected a uint8 array"),
    ],
)  # fmt: skip
def test_from_packed_refuses(arg, error, match):
    with pytest.raises(error, match=match):
        Fp8LatentCache.from_packed(arg)
