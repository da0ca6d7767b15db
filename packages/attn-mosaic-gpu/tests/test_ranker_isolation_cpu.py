"""Isolation of the Hopper ranker kernels in Mosaic GPU interpret mode (CPU).

The guarantee (docs/ranker_gpu.md, "Isolation"): for every user of a row, ``out``,
``lse``, ``dq``, ``dk`` and ``dv`` of that user's rows equal what they would be if every
row outside the user's segments were zero, whatever those rows hold in q, k, v and in
the cotangents. Each case poisons rows that the checked rows do not attend (padding
past the last candidate, the gap between history and candidates, rows outside the
bounds, the other user of a packed row) with NaN, +Inf, -Inf and 1e30 (fp16 turns
1e30 into inf) in q, k, v, dO and the LSE cotangent, runs forward and backward through
the kernels (``jax.vjp`` of ``attn_mosaic_gpu.ranker_attention``), and compares the
checked rows with the float32 reference on the inputs with the poisoned rows zeroed.
Rows with no allowed key must give ``out = 0``, ``lse = -inf`` and zero gradients.
One case checks that garbage a row does attend still reaches it (NaN out).

Small shapes (S = 128, one or two heads), race detection on, buffers start as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    get_races,
    reset_gpu_interpret_mode_state,
)
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common import CapMethod, CapParams, KernelConfig
from attn_mosaic_gpu import ranker_attention
from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd
from attn_reference.ranker import ranker_attention as reference

INTERPRET = plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
SMALL = KernelConfig(block_q=64, block_kv=64, num_stages=2)
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 1e-2}
POISONS = (np.nan, np.inf, -np.inf, 1e30)
TANH = CapParams(CapMethod.TANH, 5.0)
SOFT_SIGN = CapParams(CapMethod.SOFT_SIGN, 8.0)


def _segments(bounds: np.ndarray, seq: int) -> np.ndarray:
    """bool ``[B, U, S]``: the rows of each user (history or candidates)."""
    b = bounds.reshape(bounds.shape[0], -1, 4)
    pos = np.arange(seq)
    hist = (pos >= b[..., 0:1]) & (pos < b[..., 1:2])
    cand = (pos >= b[..., 2:3]) & (pos < b[..., 3:4])
    return hist | cand


def _poison(x: np.ndarray, rows: np.ndarray, seed: int) -> np.ndarray:
    """``x [B, S, H, D]`` with every element of the ``rows [B, S]`` drawn from POISONS."""
    pick = np.random.default_rng(seed).integers(0, len(POISONS), size=x.shape)
    values = np.asarray(POISONS, np.float32)[pick]
    with np.errstate(over="ignore"):
        return np.where(rows[:, :, None, None], values, x).astype(np.float32)


def _draw(rng, shape, scale=1.0):
    return rng.standard_normal(shape).astype(np.float32) * scale


def _kernel_vjp(q, k, v, bounds, do, dlse, cap, interpret, config):
    def f(q, k, v):
        return ranker_attention(
            q, k, v, bounds, cap=cap, return_lse=True, config=config, interpret=interpret
        )

    try:
        (out, lse), vjp = jax.vjp(f, q, k, v)
        grads = vjp((do, dlse))
        jax.block_until_ready(grads)
    except Exception:
        if interpret:
            reset_gpu_interpret_mode_state()
        raise
    if interpret:
        assert not get_races().races_found, "interpret mode race detector reported a race"
    return [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (out, lse, *grads)]


def _reference_vjp(q, k, v, bounds, do, dlse, cap):
    def f(q, k, v):
        return reference(q, k, v, bounds, cap=cap, return_lse=True)

    (out, lse), vjp = jax.vjp(f, q, k, v)
    return [np.asarray(x, np.float64) for x in (out, lse, *vjp((do, dlse)))]


def check_isolation(
    bounds, checked, dead, *, head_dim, cap, dtype, q_heads=2, kv_heads=1,
    interpret=INTERPRET, config=SMALL,
):  # fmt: skip
    """Poison the rows ``dead [B, S]`` (none of which a row of ``checked [B, S]``
    attends) in every input and cotangent; compare the checked rows with the
    reference on the zeroed inputs. ``interpret=False, config=None``: the compiled
    kernels with their tuned configs (``test_ranker_bwd_gpu.py``)."""
    batch, seq = checked.shape
    rng = np.random.default_rng(0)
    q = _draw(rng, (batch, seq, q_heads, head_dim), 2.0)
    k = _draw(rng, (batch, seq, kv_heads, head_dim), 2.0)
    v = _draw(rng, (batch, seq, kv_heads, head_dim))
    do = _draw(rng, (batch, seq, q_heads, head_dim))
    dlse = _draw(rng, (batch, q_heads, seq))
    clean = [np.where(dead[:, :, None, None], 0.0, x) for x in (q, k, v, do)]
    clean_dlse = np.where(dead[:, None, :], 0.0, dlse)
    dirty = [_poison(x, dead, seed) for seed, x in enumerate((q, k, v, do))]
    dirty_dlse = np.moveaxis(_poison(np.moveaxis(dlse, 1, 2)[..., None], dead, 9)[..., 0], 2, 1)

    cast = [jnp.asarray(x, dtype) for x in dirty]
    got = _kernel_vjp(*cast[:3], bounds, cast[3], jnp.asarray(dirty_dlse), cap, interpret, config)
    # The reference on the clean inputs as the kernel sees them (rounded to dtype).
    up = [jnp.asarray(jnp.asarray(x, dtype), jnp.float32) for x in clean]
    want = _reference_vjp(*up[:3], bounds, up[3], jnp.asarray(clean_dlse), cap)

    kv_rows = checked  # a key row of a checked user is one of its rows
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, r in zip(names, got, want, strict=True):
        sel = kv_rows if name in ("dk", "dv") else checked
        if name == "lse":
            g, r = np.moveaxis(g, 1, 2)[sel], np.moveaxis(r, 1, 2)[sel]
            assert np.array_equal(np.isneginf(g), np.isneginf(r)), f"{name}: -inf rows differ"
            g, r = np.where(np.isneginf(g), 0.0, g), np.where(np.isneginf(r), 0.0, r)
            assert not np.isnan(g).any(), f"{name}: NaN on checked rows"
            np.testing.assert_allclose(g, r, atol=2e-3, err_msg=name)
            continue
        g, r = g[sel], r[sel]
        assert np.isfinite(g).all(), f"{name}: {np.sum(~np.isfinite(g))} non-finite on checked rows"
        err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
        assert err <= TOL[dtype], f"{name}: rel L2 {err:.3g} > {TOL[dtype]}"
    # Rows with no allowed key: exactly 0 out and dq, lse -inf (checked rows included).
    live = _segments(np.asarray(bounds), seq).any(axis=1)
    empty = checked & ~live
    if empty.any():
        assert (got[0][empty] == 0).all() and (got[2][empty] == 0).all()
        assert np.isneginf(np.moveaxis(got[1], 1, 2)[empty]).all()


@pytest.mark.slow  # interpret mode
@pytest.mark.parametrize(
    "head_dim,cap,dtype",
    [(64, None, jnp.float16), (128, TANH, jnp.bfloat16), (256, SOFT_SIGN, jnp.bfloat16)],
    ids=["d64-none-fp16", "d128-tanh-bf16", "d256-softsign-bf16"],
)
def test_one_user_padding_gap_and_outside_bounds(head_dim, cap, dtype):
    """Row 0: history [0, 40), candidates [40, 56), padding after (a block that mixes
    candidates and padding). Row 1: history [8, 50), a gap, candidates [70, 90): rows
    before the history, in the gap and after the candidates are outside the bounds.
    Every such row is poisoned; the checked rows are the two users' rows plus the
    poisoned rows themselves for out/dq (they attend nothing: 0, -inf, 0)."""
    seq = 128
    bounds = np.array([[0, 40, 40, 56], [8, 50, 70, 90]], np.int32)
    live = _segments(bounds, seq)[:, 0]
    check_isolation(jnp.asarray(bounds), live, ~live, head_dim=head_dim, cap=cap, dtype=dtype)


@pytest.mark.slow  # interpret mode
@pytest.mark.parametrize("poisoned_user", [0, 1])
def test_packed_other_user_poisoned(poisoned_user):
    """Two users per row, sharing key blocks and query tiles: user A [0, 30) history,
    [30, 40) candidates; user B [40, 100) history, [100, 110) candidates; padding after.
    Every row of the poisoned user and the padding is poisoned (q, k, v, dO, dLSE);
    the other user's rows must match the reference with those rows zeroed. D=64,
    soft_sign cap, bf16."""
    seq = 128
    bounds = np.array([[[0, 30, 30, 40], [40, 100, 100, 110]]], np.int32)
    users = _segments(bounds, seq)[0]
    checked = users[1 - poisoned_user][None]
    check_isolation(
        jnp.asarray(bounds), checked, ~checked, head_dim=64, cap=SOFT_SIGN, dtype=jnp.bfloat16
    )


@pytest.mark.slow  # interpret mode
def test_attended_garbage_still_propagates():
    """NaN in a history V row reaches exactly the rows that attend it (that user's
    history and candidates) and no other row: not the padding, not the other user of
    the packed row."""
    rng = np.random.default_rng(1)
    seq = 128
    q, k, v = (jnp.asarray(_draw(rng, (1, seq, 1, 64)), jnp.bfloat16) for _ in range(3))
    bounds = jnp.asarray([[[0, 30, 30, 40], [40, 100, 100, 110]]], jnp.int32)
    v = v.at[0, 50].set(jnp.nan)  # a history row of user B
    try:
        out = ranker_attention_fwd(q, k, v, bounds, config=SMALL, interpret=INTERPRET)
        jax.block_until_ready(out)
    except Exception:
        reset_gpu_interpret_mode_state()
        raise
    assert not get_races().races_found
    nan_rows = np.isnan(np.asarray(out, np.float32)[0, :, 0]).any(axis=-1)
    want = np.zeros(seq, bool)
    want[40:110] = True
    np.testing.assert_array_equal(nan_rows, want)
