"""``benchmarks/packed_ranker.py`` on the CPU: the visited-block count against a dense
brute force, the batching, and (marked slow: about 15 s) the whole script end to end with
``--smoke`` and the reference implementation (tiny shapes, wall-clock timing)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from helpers import load_script

from attn_common import KernelConfig, pack_users, ranker_mask_packed
from attn_common.packed import packed_kv_block_ranges

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "packed_ranker.py"


@pytest.fixture(scope="module")
def bench():
    with load_script(SCRIPT, "packed_ranker_bench") as module:
        yield module


def _bounds(seed: int, seq_len: int, users: int = 40) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hist = np.clip(np.rint(np.exp(rng.normal(np.log(20), 1.0, users))), 1, seq_len - 9)
    cand = rng.integers(1, 9, users)
    return pack_users(hist.astype(np.int64), cand, seq_len=seq_len).bounds


# 96 x (16, 32) (~6 s) in the slow tier: 100 x (16, 16) is the quick one (padded tiles).
@pytest.mark.parametrize(
    "seq_len,block_q,block_kv",
    [pytest.param(96, 16, 32, marks=pytest.mark.slow), (100, 16, 16)],
)
def test_visited_blocks_match_a_dense_brute_force(bench, seq_len, block_q, block_kv):
    bounds = _bounds(seq_len, seq_len)
    config = KernelConfig(block_q=block_q, block_kv=block_kv)
    got = bench.visited_blocks(bounds, seq_len, config, chunk_rows=3)

    tile = 2 * block_q
    seq_pad = -(-seq_len // math.lcm(tile, block_kv)) * math.lcm(tile, block_kv)
    pos = np.arange(seq_pad)
    rows, num_tiles, num_blocks = bounds.shape[0], seq_pad // tile, seq_pad // block_kv
    masks = np.asarray(ranker_mask_packed(pos[:, None], pos[None, :], bounds[:, None, None]))
    t0 = np.arange(num_tiles) * tile
    ranges = packed_kv_block_ranges(bounds[:, None], t0[None], t0[None] + tile, block_kv)
    starts, steps = np.asarray(ranges.starts), np.asarray(ranges.steps)  # [R, T, runs]
    visited = useful = masked = tile_visits = 0
    for r in range(rows):
        mask = masks[r]
        in_user = np.zeros(seq_pad, bool)
        for hl, hu, cl, cu in bounds[r]:
            in_user[hl:hu] = in_user[cl:cu] = True
        for t in range(num_tiles):
            blocks = [
                b for s, n in zip(starts[r, t], steps[r, t], strict=True) for b in range(s, s + n)
            ]
            # The kernel visits exactly the blocks with an allowed pair for the tile.
            tile_rows = mask[t * tile : (t + 1) * tile]
            want = [
                b
                for b in range(num_blocks)
                if tile_rows[:, b * block_kv : (b + 1) * block_kv].any()
            ]
            assert sorted(blocks) == want
            tile_visits += len(blocks)
            for wg in range(2):
                q0 = t * tile + wg * block_q
                if not in_user[q0 : q0 + block_q].any():
                    continue  # an all-padding warpgroup idles
                for b in blocks:
                    rect = mask[q0 : q0 + block_q, b * block_kv : (b + 1) * block_kv]
                    visited += 1
                    useful += bool(rect.any())
                    masked += not rect.all()
    assert got["warpgroup_steps_visited"] == visited
    assert got["warpgroup_steps_useful"] == useful
    assert got["masked_fraction"] == pytest.approx(masked / visited)
    assert got["tile_steps_visited"] == tile_visits
    assert got["tile_useful_fraction"] == 1.0
    assert got["covered_pairs"] == got["allowed_pairs"] > 0
    assert 0 < got["useful_fraction"] <= 1


def test_batches_cover_every_row_once(bench):
    layouts = bench.build_layouts(bench.SMOKE, seed=3, max_users_per_row=None)
    for layout in layouts:
        batches = bench.make_batches(layout, 5)
        rows = batches[batches >= 0]
        assert sorted(rows.tolist()) == list(range(layout.rows))
        assert sum(layout.users_in(b) for b in batches) == bench.SMOKE.users
        op = layout.op_bounds(batches[0])
        assert op.shape == ((5, layout.bounds.shape[1], 4) if layout.packed else (5, 4))
    ids = bench.timed_batch_ids(50, 8)
    assert len(ids) == 8 and ids[0] == 0 and ids[-1] == 49
    assert bench.timed_batch_ids(3, 8).tolist() == [0, 1, 2]
    assert bench.timed_batch_ids(3, 0).tolist() == [0, 1, 2]


@pytest.mark.slow  # a benchmark script, not the package: the tests above check its parts
def test_smoke_run_writes_sane_reports(bench, tmp_path, monkeypatch):
    pytest.importorskip("attn_reference")
    monkeypatch.setenv("ATTN_PROVENANCE_COMMIT", "abc1234")
    out = tmp_path / "results"
    assert bench.main(["--smoke", "--impl", "reference", "--out", str(out)]) == 0
    result = json.loads((out / "packed_ranker.json").read_text())
    assert (out / "packed_ranker.md").read_text().startswith("# Packed vs padded ranker rows")
    assert result["provenance"]["commit"] == "abc1234"
    assert result["smoke"] is True and result["impl"] == "reference" and result["failed"] == 0
    users = result["config"]["users"]
    layouts = result["layouts"]
    assert [lay["packed"] for lay in layouts] == [False, True, True]
    padded = layouts[0]
    assert padded["users_per_row"] == 1 and padded["rows"] == users
    for lay in layouts:
        assert lay["users"] == users
        assert 0 < lay["timed_users"] <= users
        assert lay["tokens"] == lay["rows"] * lay["seq_len"]
        assert lay["tokens_per_user"] == pytest.approx(lay["tokens"] / users)
        if lay["packed"]:
            assert lay["tokens"] < padded["tokens"]
        vb = lay["visited_blocks"]
        assert 0 < vb["useful_fraction"] <= 1
        assert vb["covered_pairs"] == vb["allowed_pairs"]
        for part in ("block", "attention"):
            for mode in ("fwd", "fwd+bwd"):
                entry = lay[part][mode]
                assert entry["ms"] > 0 and entry["users_per_s"] > 0, (lay["name"], part, mode)
                assert entry["population_s_estimate"] > 0
        assert lay["attention"]["fwd"]["effective_tflops"] > 0
        assert lay["vs_padded"]["block_users_per_s_fwd+bwd"] > 0
        assert lay["vs_padded"]["attention_ms_per_user_fwd"] > 0
    assert padded["vs_padded"]["block_users_per_s_fwd"] == 1.0
    targets = result["targets"]
    assert len(targets) == 3 * (len(layouts) - 1)
    assert all(t["pass"] in (True, False) for t in targets)


def test_simulated_population():
    """``bench.simulate_ranker_users`` (the benchmark's users, moved from
    attn_common.packing): log-normal histories, clipped, packing at >= 95 %."""
    from attn_mosaic_gpu.bench import simulate_ranker_users

    hist, cand = simulate_ranker_users(2000, seed=3)
    assert hist.min() >= 1 and hist.max() <= 1024 and (cand == 64).all()
    assert 150 < np.median(hist) < 260
    p = pack_users(hist, cand, seq_len=2048, max_users_per_row=16)
    assert (p.user_row >= 0).all()  # every user placed
    assert p.efficiency > 0.95
    again = simulate_ranker_users(2000, seed=3)
    assert (again[0] == hist).all()
