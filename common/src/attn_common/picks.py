"""Selections for sparse-MLA benchmarks: random picks and overlapping picks (numpy).

The benchmarks of every backend measure two families side by side:

* **random**: each query picks ``k`` distinct units uniformly among the units it may see
  (those with a token at or before its position). Nothing is shared between queries:
  the worst case for any reuse of a fetched unit.
* **overlapping**: what a DeepSeek-V3.2 indexer's top-k looks like in practice. Query
  ``i`` at position ``p`` (its unit ``u = p // unit``) picks, in this order, without
  repeats:

  - ``sinks``: the first units of the context (attention sinks), ``0 .. sinks - 1``;
  - ``window``: its local window, units ``u - window + 1 .. u``;
  - ``random`` units uniformly at random among the units it may see;
  - the rest of its ``k`` from the *hot set* of its segment. Queries are cut into
    segments of ``segment`` consecutive queries; a segment's hot set holds ``hot_pool``
    units, and each next segment keeps ``1 - drift`` of the previous segment's hot set
    and draws the rest afresh (uniform over the units before the segment's first query),
    so the hot set drifts along the sequence.

  With the defaults (``k = 32`` units: 2 sinks, a window of 4, 26 hot units of a pool of
  32 per 64 queries drifting by an eighth, no random ones), 2048 queries at the end of
  a 110K-token context of 64-token units select about 200 distinct units in all: each
  is re-read about 300 times, as a long-context prefill's pages are.
* **decode** (:func:`decode_picks`): ``tokens`` consecutive query tokens of a request
  (multi-token prediction) share ``share`` of their picks: the first token's
  selection, with the rest of each later token's drawn afresh.

Every function returns ``int32 [N, k]`` unit ids (``-1`` where a query may see fewer than
``k`` units) and is deterministic for a given ``numpy.random.Generator``.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class OverlapParams:
    """Parameters of :func:`overlapping_picks` (see the module docstring)."""

    sinks: int = 2
    window: int = 4
    random: int = 0
    hot_pool: int = 32
    segment: int = 64
    drift: float = 0.125

    def __post_init__(self):
        for name in ("sinks", "window", "random", "hot_pool", "segment"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (name == "segment"):
                raise ValueError(f"{name}: got {v!r}, expected a non-negative int")
        if not 0.0 <= self.drift <= 1.0:
            raise ValueError(f"drift: got {self.drift}, expected a fraction in [0, 1]")


def _fill(rng, row: list, avail: int, k: int) -> np.ndarray:
    """``row`` (distinct ids) completed to ``min(k, avail)`` distinct ids in ``[0, avail)``
    by uniform draws, then ``-1``."""
    want = min(k, avail)
    out = [u for u in row if 0 <= u < avail][:want]
    seen = set(out)
    if len(out) < want:
        free = np.setdiff1d(np.arange(avail), np.fromiter(seen, np.int64, len(seen)))
        out += rng.choice(free, want - len(out), replace=False).tolist()
    return np.asarray(out + [-1] * (k - len(out)), np.int32)


def distinct_choices(rng: np.random.Generator, avail, k: int) -> np.ndarray:
    """``[N, k]`` int32: row ``i`` holds ``min(avail[i], k)`` distinct random ids in
    ``[0, avail[i])`` (random order), then ``-1``."""
    avail = np.asarray(avail, np.int64)
    out = np.full((len(avail), k), -1, np.int32)
    for i, n in enumerate(avail):
        m = int(min(max(n, 0), k))
        if m:
            out[i, :m] = rng.choice(int(n), m, replace=False)
    return out


def random_picks(rng: np.random.Generator, positions, *, unit: int, k: int) -> np.ndarray:
    """Each query picks ``k`` distinct units among the ``position // unit + 1`` it may see."""
    return distinct_choices(rng, np.asarray(positions, np.int64) // unit + 1, k)


def overlapping_picks(
    rng: np.random.Generator,
    positions,
    *,
    unit: int,
    k: int,
    params: OverlapParams | None = None,
) -> np.ndarray:
    """Sinks, local window, a drifting hot set shared per segment, then random (module
    docstring). ``positions [N]``: each query's position."""
    p = params or OverlapParams()
    pos = np.asarray(positions, np.int64)
    out = np.full((len(pos), k), -1, np.int32)
    hot: np.ndarray = np.zeros(0, np.int64)
    for start in range(0, len(pos), p.segment):
        seg = pos[start : start + p.segment]
        avail = int(seg.min()) // unit + 1  # units every query of the segment may see
        keep = hot[hot < avail]
        keep = keep[: round(len(keep) * (1.0 - p.drift))] if len(hot) else keep
        fresh = np.setdiff1d(np.arange(avail), keep)
        need = min(p.hot_pool - len(keep), len(fresh))
        hot = np.concatenate([keep, rng.choice(fresh, need, replace=False)]).astype(np.int64)
        rng.shuffle(hot)
        for i, q_pos in enumerate(seg):
            u = int(q_pos) // unit
            row = list(range(min(p.sinks, u + 1)))
            row += [w for w in range(u, max(u - p.window, -1), -1) if w not in row]
            free = np.setdiff1d(np.arange(u + 1), row)
            row += rng.choice(free, min(p.random, len(free)), replace=False).tolist()
            hot_left = [int(h) for h in hot if int(h) not in row]
            n_hot = min(max(k - len(row), 0), len(hot_left))
            row += rng.choice(hot_left, n_hot, replace=False).tolist() if n_hot else []
            out[start + i] = _fill(rng, row[:k], u + 1, k)
    return out


def decode_picks(
    rng: np.random.Generator, positions, *, unit: int, k: int, tokens: int, share: float = 0.9
) -> np.ndarray:
    """Groups of ``tokens`` consecutive queries (a request's multi-token decode step)
    share ``share`` of their picks: each later token keeps that fraction of the first
    token's random selection (dropping the rest) and fills up with fresh draws."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share: got {share}, expected a fraction in [0, 1]")
    pos = np.asarray(positions, np.int64)
    if len(pos) % tokens:
        raise ValueError(f"positions: {len(pos)} queries do not split into groups of {tokens}")
    out = np.full((len(pos), k), -1, np.int32)
    for g in range(0, len(pos), tokens):
        first = random_picks(rng, pos[g : g + 1], unit=unit, k=k)[0]
        out[g] = first
        live = first[first >= 0].tolist()
        for t in range(1, tokens):
            kept = live[: round(len(live) * share)]
            out[g + t] = _fill(rng, kept, int(pos[g + t]) // unit + 1, k)
    return out


__all__ = [
    "OverlapParams",
    "decode_picks",
    "distinct_choices",
    "overlapping_picks",
    "random_picks",
]
