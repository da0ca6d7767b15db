"""attn_common.picks: the benchmark selections (random, overlapping, decode)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from attn_common.picks import OverlapParams, decode_picks, overlapping_picks, random_picks


def _check_rows(picks, positions, unit, k):
    """Every row: distinct units, all visible (unit <= position // unit), ``-1`` only at
    the end and only when fewer than ``k`` units are visible."""
    assert picks.shape == (len(positions), k) and picks.dtype == np.int32
    for row, pos in zip(picks, positions, strict=True):
        live = row[row >= 0]
        assert len(set(live.tolist())) == len(live)
        assert np.all(live <= pos // unit)
        assert len(live) == min(k, pos // unit + 1)
        assert np.all(row[len(live) :] == -1)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_picks(seed):
    pos = np.array([0, 5, 63, 64, 1000, 4095])
    picks = random_picks(np.random.default_rng(seed), pos, unit=64, k=8)
    _check_rows(picks, pos, 64, 8)


def test_overlapping_picks_share_and_hold_sinks_and_window():
    pos = np.arange(8192 - 256, 8192)
    p = OverlapParams(sinks=2, window=3, hot_pool=24, segment=64, drift=0.25)
    picks = overlapping_picks(np.random.default_rng(0), pos, unit=16, k=24, params=p)
    _check_rows(picks, pos, 16, 24)
    for row, q in zip(picks, pos, strict=True):
        u = q // 16
        assert {0, 1, u, u - 1, u - 2} <= set(row.tolist())
    # Neighbouring queries share most of their picks; all queries together touch few.
    shared = [len(set(a) & set(b)) for a, b in itertools.pairwise(picks)]
    assert np.mean(shared) > 0.7 * 24
    assert len(np.unique(picks)) < 0.1 * picks.size
    rand = random_picks(np.random.default_rng(0), pos, unit=16, k=24)
    assert len(np.unique(rand)) > 3 * len(np.unique(picks))


def test_overlapping_picks_random_part_and_short_contexts():
    pos = np.array([0, 3, 20, 40])  # fewer units than k: every visible unit, then -1
    picks = overlapping_picks(
        np.random.default_rng(2), pos, unit=4, k=8, params=OverlapParams(random=2)
    )
    _check_rows(picks, pos, 4, 8)


def test_decode_picks_share():
    pos = np.repeat([4000, 9000], 3) + np.tile([0, 1, 2], 2)
    picks = decode_picks(np.random.default_rng(0), pos, unit=64, k=20, tokens=3, share=0.9)
    _check_rows(picks, pos, 64, 20)
    for g in (0, 3):
        for t in (1, 2):
            assert len(set(picks[g]) & set(picks[g + t])) >= 18
    none = decode_picks(np.random.default_rng(0), pos, unit=64, k=20, tokens=3, share=0.0)
    _check_rows(none, pos, 64, 20)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sinks=-1), "sinks"),
        (dict(segment=0), "segment"),
        (dict(drift=1.5), "drift"),
        (dict(random=True), "random"),
    ],
)
def test_overlap_params_validate(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OverlapParams(**kwargs)


def test_decode_picks_validate():
    with pytest.raises(ValueError, match="share"):
        decode_picks(np.random.default_rng(0), [1, 2], unit=4, k=2, tokens=2, share=2.0)
    with pytest.raises(ValueError, match="groups of 2"):
        decode_picks(np.random.default_rng(0), [1, 2, 3], unit=4, k=2, tokens=2)
