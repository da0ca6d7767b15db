"""TPU ranker kernels with packed bounds ``[B, U, 4]`` (several users per row), in Pallas
TPU interpret mode (race detector on, out-of-bounds reads raising, uninitialised memory
NaN) against ``attn_reference`` and the packed step tables against brute force."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_no_races,
    ranker_inputs,
    tpu_interpret,
)
from jax.experimental import checkify

import attn_reference as ref
from attn_common import CapMethod, CapParams, KernelConfig
from attn_common.packed import ranker_mask_packed
from attn_pallas_tpu import ranker_attention, supports
from attn_pallas_tpu.ranker_fwd import TileSteps, kv_step_table, prepare, q_step_table

INTERPRET = tpu_interpret()
SMALL = KernelConfig(block_q=128, block_kv=128)
SEQ = 300  # three 128-blocks, the last partly padding
# Per row U = 4 slots: users back to back sharing blocks, gaps, a user with a gap
# between history and candidates, empty users, padding at the end of the row.
PACKED = np.asarray(
    [
        [[0, 90, 90, 100], [100, 140, 140, 150], [150, 250, 250, 260], [0, 0, 0, 0]],
        [[200, 230, 280, 290], [5, 60, 60, 70], [0, 0, 0, 0], [130, 131, 131, 190]],
    ],
    np.int32,
)
CAP = CapParams(CapMethod.SOFT_SIGN, 8.0)


def _inputs(seed):
    return [jnp.asarray(x) for x in ranker_inputs(seed, 2, SEQ, 2, 1, 128, "float32")]


@pytest.mark.slow  # ~24 s in interpret mode
def test_packed_grads_match_reference_deterministic():
    q, k, v = _inputs(1)
    w = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape), jnp.float32)
    wl = jnp.asarray(np.random.default_rng(8).standard_normal((2, 2, SEQ)), jnp.float32)

    def loss(fn, **kw):
        def f(q, k, v):
            out, lse = fn(q, k, v, jnp.asarray(PACKED), cap=CAP, return_lse=True, **kw)
            return jnp.sum(out * w) + 10.0 * jnp.sum(jnp.where(jnp.isfinite(lse), lse * wl, 0.0))

        return f

    kernel = jax.jit(jax.grad(loss(ranker_attention, config=SMALL, interpret=INTERPRET), (0, 1, 2)))
    got = jax.block_until_ready(kernel(q, k, v))
    again = jax.block_until_ready(kernel(q, k, v))
    assert_no_races()
    want = jax.grad(loss(ref.ranker_attention), (0, 1, 2))(q, k, v)
    for name, g, g2, r in zip(("dq", "dk", "dv"), got, again, want, strict=True):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert np.array_equal(np.asarray(g), np.asarray(g2)), f"{name}: not deterministic"
        assert_close(g, r, rtol_l2=1e-4, atol=1e-3, name=name)


@pytest.mark.slow  # ~13 s (eager table reads)
def test_packed_step_tables_visit_once_one_dma_per_block():
    q = jnp.zeros((2, SEQ, 1, 128), jnp.float32)
    for config in (SMALL, KernelConfig(block_q=256, block_kv=128)):
        _, st, clipped = prepare(q, q, q, PACKED, sm_scale=None, cap=None, config=config)
        assert st.packed_users == 4 and st.runs == 8
        clipped = np.asarray(clipped)
        pos = np.arange(st.seq_pad)
        for tab, tiles, block, other, q_side in (
            (kv_step_table(clipped, st), st.q_tiles, st.block_q, st.block_kv, True),
            (q_step_table(clipped, st), st.kv_tiles, st.block_kv, st.block_q, False),
        ):
            tab = np.asarray(tab)
            steps_max = st.seq_pad // other
            for b in range(2):
                allowed = np.asarray(
                    ranker_mask_packed(pos[:, None], pos[None, :], clipped[b])
                )  # [q, k]
                for t in range(tiles):
                    steps = TileSteps(tab, b * tiles + t, st.runs)
                    total = int(steps.total)
                    seq_blocks = [int(steps.clamped_block(j)) for j in range(steps_max)]
                    part = allowed[t * block : (t + 1) * block]
                    if not q_side:
                        part = allowed[:, t * block : (t + 1) * block].T
                    want = {int(p) // other for p in np.nonzero(part.any(axis=0))[0]}
                    visited = seq_blocks[:total]
                    assert sorted(visited) == sorted(want) and len(set(visited)) == total
                    dmas = 1 + sum(a != c for a, c in itertools.pairwise(seq_blocks))
                    assert dmas == max(total, 1)
                    for j in range(int(steps.full_lo), int(steps.full_hi)):
                        blk = int(steps.block_at(j))
                        assert part[:, blk * other : (blk + 1) * other].all(), (b, t, j)


@pytest.mark.slow  # ~6 s in interpret mode
def test_packed_overlap_refused_and_debug_checks():
    q, k, v = _inputs(2)
    bad = PACKED.copy()
    bad[0, 3] = [95, 99, 0, 0]  # inside user 0's candidates
    with pytest.raises(ValueError, match="bounds: row 0: users 0"):
        ranker_attention(q, k, v, bad, config=SMALL, interpret=INTERPRET)

    def f(b):
        return ranker_attention(q, k, v, b, config=SMALL, interpret=INTERPRET, debug_checks=True)

    err, _ = checkify.checkify(jax.jit(f))(jnp.asarray(bad))
    assert "overlapping users: row 0, users 0 and 3" in err.get()
    assert supports("ranker_attention", q, k, v, PACKED) is None
