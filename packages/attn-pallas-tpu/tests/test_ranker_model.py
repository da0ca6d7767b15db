"""The TPU ranker cost model: visit counts against brute force, splash ratios' sanity."""

from __future__ import annotations

import numpy as np
import pytest

from attn_common import RANKER_SUITE, ranker_case, ranker_mask
from attn_pallas_tpu.plan import TPU_CHIPS
from attn_pallas_tpu.ranker_fwd import default_config
from attn_pallas_tpu.ranker_model import format_table, predict, visit_counts


def _brute(bounds, seq, bq, bkv):
    pos = np.arange(seq)
    per_row, union = [], np.zeros((seq, seq), bool)
    for row in bounds:
        m = np.asarray(ranker_mask(pos[:, None], pos[None, :], *row))
        union |= m
        per_row.append(m.reshape(seq // bq, bq, seq // bkv, bkv).any(axis=(1, 3)))
    per_row = np.stack(per_row)
    visited = per_row.any(axis=0)  # splash visits a block iff some row allows a pair in it
    full = union.reshape(seq // bq, bq, seq // bkv, bkv).all(axis=(1, 3))
    return int(per_row.sum()), int(visited.sum()), int((visited & ~full).sum())


@pytest.mark.parametrize("bq,bkv", [(128, 128), (256, 128)])
def test_visit_counts_match_brute_force(bq, bkv):
    rng = np.random.default_rng(0)
    seq = 512
    b = np.sort(rng.integers(0, seq, size=(6, 4)), axis=1).astype(np.int32)
    b[0] = [0, 300, 300, 340]
    b[1] = [0, 0, 0, 0]
    c = visit_counts(b, seq_len=seq, q_heads=2, kv_heads=1, block_q=bq, block_kv=bkv)
    fwd, union, union_masked = _brute(b, seq, bq, bkv)
    assert c.fwd == 2 * fwd
    assert c.dkv == 2 * fwd  # the transpose visits the same (q block, kv block) pairs
    assert c.splash == 2 * union * len(b)
    assert c.splash_masked == 2 * union_masked * len(b)
    assert c.splash >= c.fwd and c.fwd_masked <= c.fwd


def test_splash_ratio_one_for_uniform_bounds_above_one_for_ragged(monkeypatch):
    """Uniform bounds: splash with the union mask visits what the kernels visit, so the
    ratio is 1 at one head a program, and above 1 with the kernels' grouped heads (fewer
    grid steps, K / V shared). Ragged bounds: above 1 from the visits alone."""
    from attn_pallas_tpu import ranker_model

    chip = TPU_CHIPS["v5e"]
    grouped = predict(ranker_case("phoenix").scaled(2), chip, block_q=384, block_kv=384)
    monkeypatch.setattr(ranker_model, "heads_per_program", lambda *a: 1)
    same = predict(ranker_case("phoenix").scaled(2), chip, block_q=384, block_kv=384)
    assert same.fwd_ratio == pytest.approx(1.0) and grouped.fwd_ratio > 1.05
    ragged = predict(ranker_case("ragged").scaled(8), chip, block_q=384, block_kv=384)
    assert ragged.fwd_ratio > 1.05 and ragged.train_ratio > 1.05
    assert 0 < same.fwd_mxu_fraction < 1 and ragged.fwd_s < ragged.splash_fwd_s
    assert "| phoenix | v5e |" in format_table([same])


def test_default_tiling_of_suite_shapes():
    blocks = {c.name: default_config(c.seq_len, c.head_dim).block_q for c in RANKER_SUITE}
    assert blocks == {"phoenix": 384, "long": 640, "small-d64": 640, "ragged": 384}


def test_default_tiling_within_the_vmem_model(monkeypatch):
    """Every block ``default_config`` may pick fits the kernels' VMEM model at every
    supported D and dtype; with a smaller budget it picks the largest block that fits."""
    import jax.numpy as jnp

    from attn_pallas_tpu import ranker_config as cfg

    for d in cfg.SUPPORTED_HEAD_DIMS:
        for dtype in cfg.SUPPORTED_DTYPES:
            for b in cfg.BLOCK_CHOICES:
                assert max(cfg.vmem_bytes(b, b, d, dtype).values()) <= cfg.VMEM_LIMIT_BYTES
    # 640 x 640, D 256, f32: five f32 score tiles (8.2 MB), dk/dv's double-buffered
    # blocks (k, v, dk, dv, q, dO and two row statistics) and its two accumulators.
    blocks = (4 * 640 * 256 + 2 * 640 * 256) * 4 + 2 * 640 * 32
    want = 5 * 640 * 640 * 4 + 2 * blocks + 2 * 640 * 256 * 4
    assert cfg.vmem_bytes(640, 640, 256, jnp.float32)["dkv"] == want
    assert cfg.default_config(5120, 256).block_q == 640
    budget = max(cfg.vmem_bytes(384, 384, 256, jnp.float32).values())
    monkeypatch.setattr(cfg, "VMEM_LIMIT_BYTES", budget)
    assert cfg.default_config(5120, 256).block_q == 256  # 384 fits but pads 5120 more
    assert cfg.default_config(1152, 256).block_q == 384


def test_grid_counts_are_the_kernels_grids():
    """The model counts grid steps and programs over the kernels' own grids."""
    from attn_pallas_tpu.ranker_config import grids, padded_len

    b = np.asarray([[0, 300, 300, 340], [0, 10, 10, 20], [0, 0, 0, 0]], np.int32)
    c = visit_counts(b, seq_len=500, q_heads=4, kv_heads=2, block_q=256, block_kv=128)
    seq_pad = padded_len(500, 256, 128)
    assert seq_pad == 512
    g = grids(3, 4, 2, seq_pad, 256, 128)
    assert g["fwd"] == g["dq"] == (3, 4, 2, 4) and g["dkv"] == (3, 2, 4, 2 * 2)
    assert (c.q_programs, c.grid_steps_fwd) == (3 * 4 * 2, 3 * 4 * 2 * 4)
    assert (c.kv_programs, c.grid_steps_dkv) == (3 * 2 * 4, 3 * 2 * 4 * 4)
    # Two query heads a forward / dq program and a dk/dv step: half the programs and grid
    # steps; the visits, the dk/dv programs and splash's one-head grid unchanged.
    c2 = visit_counts(b, seq_len=500, q_heads=4, kv_heads=2, block_q=256, block_kv=128, heads=2)
    g2 = grids(3, 4, 2, seq_pad, 256, 128, 2)
    assert g2["fwd"] == (3, 2, 2, 4) and g2["dkv"] == (3, 2, 4, 2)
    assert (c2.q_programs, c2.grid_steps_fwd) == (3 * 2 * 2, 3 * 2 * 2 * 4)
    assert (c2.fwd, c2.dkv, c2.kv_programs) == (c.fwd, c.dkv, c.kv_programs)
    assert c2.grid_steps_dkv == c.grid_steps_dkv // 2
    assert (c2.splash_programs, c2.splash_grid_steps) == (c.q_programs, c.grid_steps_fwd)
    assert c2.splash_grid_steps_dkv == c.splash_grid_steps_dkv == c.grid_steps_dkv


def test_kernel_ms_names_the_three_kernels_of_a_results_row():
    """The trace's op names of a forward + backward call (as bench_ranker records them):
    the forward, dk/dv (two outputs) and dq; XLA's own custom calls are not kernels."""
    from attn_pallas_tpu.ranker_model import kernel_ms

    row = {"kernel_ops_ms": [
        ["%custom-call.2 = bf16[64,1152,4,128]{3,2,1,0} custom-call(bf16[16,1152,4,128]", 0.0],
        ["%jvp_jit__fwd_padded__.1 = (bf16[64,20,1152,128]{3,2,1,0}, f32[64,20,1,1152]{3,2,1,0})"
         " custom-call(s32[256]{0} %copy-done.1", 8.8],
        ["%transpose_jvp_jit__bwd_padded___.3 = (bf16[64,4,1152,128]{3,2,1,0}, "
         "bf16[64,4,1152,128]{3,2,1,0}) custom-call(s32[256]{0} %copy-done.3", 11.2],
        ["%transpose_jvp_jit__bwd_padded___.2 = bf16[64,20,1152,128]{3,2,1,0} "
         "custom-call(s32[256]{0} %copy-done.11, s32[1024]{0}", 9.2],
    ]}  # fmt: skip
    assert kernel_ms(row) == {"fwd": 8.8, "dkv": 11.2, "dq": 9.2}
    assert kernel_ms({"mode": "fwd+bwd"}) == {}


def test_refit_recovers_the_times_of_known_constants(monkeypatch):
    """Kernel times the model itself gives with known constants, over a few tilings of
    two shapes: the fit, started from other constants, reproduces every one within 2 %
    (the constants need not be identifiable, the times must be)."""
    from attn_pallas_tpu import ranker_model as m

    counted, count = {}, m._counts  # count each tiling once for the truth and the fit

    def once(case, bq, bkv, seed=0):
        key = (case, bq, bkv, seed)
        return counted[key] if key in counted else counted.setdefault(key, count(*key))

    monkeypatch.setattr(m, "_counts", once)
    chip = TPU_CHIPS["v5e"]
    truth = m.ModelConstants(
        mxu_efficiency={"fwd": 0.9, "dq": 0.7, "dkv": 0.95},
        vpu_ops={"fwd": 12.0, "dq": 6.0, "dkv": 20.0},
        acc_ops={"fwd": 8.0, "dq": 30.0, "dkv": 1.0},
        mask_ops=15.0, visit_s=0.05e-6, step_s=0.4e-6,
    )  # fmt: skip
    samples = []
    for name, scale in (("phoenix", 8), ("long", 8)):
        case = ranker_case(name).scaled(scale)
        for bq, bkv in ((128, 128), (256, 128), (128, 256), (384, 384)):
            pred = predict(case, chip, block_q=bq, block_kv=bkv, const=truth)
            times = {"fwd": (pred.fwd_s - _layout(pred)) * 1e3, "dq": pred.dq_s * 1e3,
                     "dkv": pred.dkv_s * 1e3}  # fmt: skip
            samples.append((case, bq, bkv, times))
    start = m.ModelConstants.of_vector([1.0] * 3 + [5.0] * 6 + [5.0, 0.2e-6, 0.2e-6])
    const, fitted = m.refit(samples, chip, start=start)
    assert len(fitted) == 3 * len(samples)
    ratios = np.array([pred / ms for *_, ms, pred in fitted])
    assert np.all(np.abs(ratios - 1) < 0.02), ratios
    assert const != start


def _layout(cost):
    """The D = 64 layout copies ``predict`` adds to the forward (none at D = 128)."""
    return cost.bwd_s - cost.dq_s - cost.dkv_s
