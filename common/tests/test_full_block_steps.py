"""Property tests of ``ranker_full_kv_steps`` / ``ranker_full_q_steps`` against brute force.

A kernel skips the mask on the steps these return, so soundness is the property that
matters (every returned step's block is allowed for every pair of the sub-tile); the
docstrings also promise completeness on the first run, which is checked too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import property_settings, segment_bounds
from hypothesis import assume, given
from hypothesis import strategies as st

from attn_common import ranker_mask
from attn_common.bounds import (
    ranker_full_kv_steps,
    ranker_full_q_steps,
    ranker_kv_block_ranges,
    ranker_q_block_ranges,
)

BLOCKS = (8, 16, 32, 64)


def _cdiv(a, b):
    return -(-a // b)


@st.composite
def problems(draw):
    """(S, block, bounds, tile, sub-tile): the sub-tile is a warpgroup's part of a tile."""
    seq_len = draw(st.integers(2, 300))
    block = draw(st.sampled_from(BLOCKS))
    hl, hu, cl, cu = draw(segment_bounds(seq_len))
    if draw(st.booleans()):
        # the ranker layout: candidates right after the history
        cl, cu = hu, draw(st.integers(hu, seq_len))
    tile = draw(st.sampled_from(BLOCKS)) * 2
    t = draw(st.integers(0, _cdiv(seq_len, tile) - 1))
    start, end = t * tile, (t + 1) * tile
    half = draw(st.sampled_from([None, 0, 1]))
    if half is None:
        sub = (start, end)
    else:
        sub = (start + half * tile // 2, start + (half + 1) * tile // 2)
    return seq_len, block, (hl, hu, cl, cu), (start, end), sub


def _allowed(n, bounds):
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    return np.asarray(ranker_mask(i, j, *bounds))


def _check(ranges, lo, hi, full_block, *, complete=True):
    lo, hi = int(lo), int(hi)
    first = int(ranges.first_steps)
    assert 0 <= lo <= hi <= first, (lo, hi, first)
    for s in range(first):
        full = full_block(int(ranges.block_at(s)))
        if lo <= s < hi:
            assert full, f"step {s} (block {int(ranges.block_at(s))}) is not fully allowed"
        elif complete:
            assert not full, f"step {s} (block {int(ranges.block_at(s))}) is fully allowed"


@property_settings(400)
@given(problems())
def test_full_kv_steps_sound_and_complete(p):
    seq_len, block, bounds, (ts, te), (rs, re) = p
    assume(re - rs >= 2)
    n = max(te, _cdiv(seq_len, block) * block) + block
    allowed = _allowed(n, bounds)
    ranges = ranker_kv_block_ranges(*bounds, ts, te, block)
    lo, hi = ranker_full_kv_steps(ranges, *bounds, rs, re, block)
    _check(ranges, lo, hi, lambda b: allowed[rs:re, b * block : (b + 1) * block].all())


@property_settings(400)
@given(problems())
def test_full_q_steps_sound_and_complete(p):
    seq_len, block, bounds, (ts, te), (ks, ke) = p
    n = max(te, _cdiv(seq_len, block) * block) + block
    allowed = _allowed(n, bounds)
    ranges = ranker_q_block_ranges(*bounds, ts, te, block)
    lo, hi = ranker_full_q_steps(ranges, *bounds, ks, ke, block)
    hl, hu, cl, cu = bounds
    # complete when the segments touch or there are no candidates (the ranker layouts)
    complete = cl >= cu or (cl <= hu and hl <= cu)
    _check(
        ranges,
        lo,
        hi,
        lambda b: allowed[b * block : (b + 1) * block, ks:ke].all(),
        complete=complete,
    )


def test_phoenix_layout_has_full_steps():
    """History [0, 1024), candidates [1024, 1088), 64-blocks: rows of history get the 16
    history blocks unmasked; history keys get all 17 query blocks unmasked."""
    bounds = (0, 1024, 1024, 1088)
    r = ranker_kv_block_ranges(*bounds, 128, 256, 64)
    assert tuple(int(x) for x in ranker_full_kv_steps(r, *bounds, 192, 256, 64)) == (0, 16)
    r = ranker_q_block_ranges(*bounds, 0, 128, 64)
    assert tuple(int(x) for x in ranker_full_q_steps(r, *bounds, 64, 128, 64)) == (0, 17)
    # candidate rows 1024..1088 sit in a 128-row tile with 40 padding rows: masked
    r = ranker_kv_block_ranges(*bounds, 1024, 1152, 64)
    assert tuple(int(x) for x in ranker_full_kv_steps(r, *bounds, 1088, 1152, 64)) == (0, 0)


def test_traced_under_jit():
    def f(b):
        r = ranker_kv_block_ranges(b[0], b[1], b[2], b[3], 0, 128, 64)
        return jnp.stack(ranker_full_kv_steps(r, b[0], b[1], b[2], b[3], 0, 64, 64))

    got = jax.jit(f)(jnp.array([0, 1024, 1024, 1088], jnp.int32))
    assert got.tolist() == [0, 16]
