"""Cost model of the TPU ranker kernels, and of splash attention with the batch's union mask.

Everything is counted per **block visit** (one ``block_q x block_kv`` tile of one query
head of one batch row) from the same block ranges the kernels use
(``attn_common.bounds.ranker_kv_block_ranges`` / ``ranker_q_block_ranges`` and the full-block
steps). Chip figures are ``attn_pallas_tpu.plan.TPU_CHIPS`` (v5e, v5p, v6e). All
numbers are assumptions of the model, not measurements (docs/tpu_ranker.md).

Per visit, on one TensorCore (a chip's ``cores`` share the parallel grid axes):

* MXU: the forward does ``QK^T`` and ``PV`` (``4 * bq * bkv * D`` flops); the dq kernel
  ``QK^T, dO V^T, dS K`` (6), the dk/dv kernel ``K Q^T, V dO^T, P^T dO, dS^T Q`` (8), at
  the core's bf16 peak times the MXU fill ``K / ceil_mxu(K) * N / ceil_mxu(N)`` of each
  matmul (a 128-wide contraction or output fills half of v6e's 256x256 array) times the
  kernel's fitted ``mxu_efficiency``.
* VPU: ``vpu_ops`` float32 ops per score element (the cap adds ``CAP_OPS``; a step
  outside the full-block range adds ``mask_ops``) and ``acc_ops`` per accumulator element
  (``bq x D`` in the forward and dq, ``2 x bkv x D`` in dk/dv), at the core's VPU rate.
* HBM: the K and V blocks (forward, dq) or the Q and dO blocks plus the LSE / delta rows
  (dk/dv) at the core's share of the bandwidth. The tiles a program keeps for all its
  steps (Q and O; K, V, dK, dV) are counted once per program.
* A visit costs ``max(MXU, VPU, HBM)`` (the Pallas pipeline overlaps the next block's
  DMA with this block's compute) plus ``visit_s``; every grid step, visited or skipped,
  costs ``step_s`` (the kernels' grids have ``S_pad / block`` steps on the inner axis
  whatever the bounds). Layout copies outside the kernels (D = 64: the ``[B,H,S,D]``
  transposes) are added at the HBM bandwidth.
* The forward and dq kernels run ``heads_per_program`` query heads of one kv head a
  program, and the dk/dv kernel as many a step (``ranker_config.heads_per_program``, the
  value the kernels take): their grid steps and programs are counted over those grids,
  and a K / V block's bytes are shared by the program's heads. The splash comparison
  keeps one head a program.

The constants in ``FITTED`` are least-squares fits (:func:`refit`) to each kernel's
device time on a v5e over tiling sweeps (docs/tpu_ranker.md, "Cost model"); on other
chips the same constants are scaled by that chip's rates, which is an assumption.

Splash attention with the union mask takes one static mask for the whole batch: the
union over the rows of each row's allowed mask. It visits, for every row and head,
every block holding an allowed pair of **any** row, and masks every block that is not
fully allowed in the union. Its per-visit costs are the same as the kernels' here
(same block sizes, same dtypes): the ratio isolates the visited-block count and masking.
Not modelled: DMA latency at the start of each program, Mosaic layout padding,
imbalance between cores, and the correction of the union-mask result itself (splash
with the union mask attends keys a row may not see; a real deployment would need
segment ids or a dense mask on top, which only adds cost).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from attn_common import RANKER_SUITE, normalize_bounds, ranker_flops, ranker_mask
from attn_common.bounds import (
    ranker_full_kv_steps,
    ranker_full_q_steps,
    ranker_kv_block_ranges,
    ranker_q_block_ranges,
)
from attn_common.suite import RankerCase
from attn_pallas_tpu.plan import TPU_CHIPS, TpuChip
from attn_pallas_tpu.ranker_config import (
    default_config,
    grids,
    heads_per_program,
    padded_len,
    round_up,
)

__all__ = [
    "CAP_OPS",
    "FITTED",
    "KERNELS",
    "ModelConstants",
    "RankerCost",
    "VisitCounts",
    "kernel_ms",
    "predict",
    "refit",
    "suite_table",
    "visit_counts",
]

KERNELS = ("fwd", "dq", "dkv")
CAP_OPS = {"none": 0, "tanh": 3, "soft_sign": 6}  # extra per score (assumed, not fitted)


@dataclasses.dataclass(frozen=True)
class ModelConstants:
    """The model's free constants (per kernel where keyed by ``KERNELS``)."""

    mxu_efficiency: dict  # fraction of the MXU peak a visit's matmuls run at
    vpu_ops: dict  # float32 VPU ops per score element
    acc_ops: dict  # VPU ops per accumulator element per visit
    mask_ops: float  # extra ops per score element on a visit that runs the mask
    visit_s: float  # fixed seconds per visit (one query head)
    step_s: float  # seconds per grid step, visited or skipped

    def vector(self) -> list[float]:
        return [
            *(self.mxu_efficiency[k] for k in KERNELS),
            *(self.vpu_ops[k] for k in KERNELS),
            *(self.acc_ops[k] for k in KERNELS),
            self.mask_ops,
            self.visit_s,
            self.step_s,
        ]

    @classmethod
    def of_vector(cls, p) -> ModelConstants:
        p = [float(x) for x in p]
        return cls(
            mxu_efficiency=dict(zip(KERNELS, p[0:3], strict=True)),
            vpu_ops=dict(zip(KERNELS, p[3:6], strict=True)),
            acc_ops=dict(zip(KERNELS, p[6:9], strict=True)),
            mask_ops=p[9],
            visit_s=p[10],
            step_s=p[11],
        )


# FITTED_BEGIN (written by scripts/ranker_cost.py --refit from the v5e
# results of 19b546d, 7efc522, 7f48303, 9aead3e; the fit's error against them: docs/tpu_ranker.md, "Cost model")
FITTED = ModelConstants(
    mxu_efficiency={"fwd": 0.9803, "dq": 0.8283, "dkv": 1.0},
    vpu_ops={"fwd": 11.12, "dq": 0.0, "dkv": 17.0},
    acc_ops={"fwd": 4.651, "dq": 33.44, "dkv": 0.0},
    mask_ops=17.66,
    visit_s=2.295e-08,
    step_s=4.914e-07,
)
# FITTED_END

ITEMSIZE = 2  # bf16 (the suite's dtype)


@dataclasses.dataclass(frozen=True)
class VisitCounts:
    """Block visits of one problem, summed over batch rows and query heads.

    ``fwd_*``: (q tile, kv block) visits of the forward and dq kernels; ``dkv_*``:
    (kv tile, query head, q block) visits of the dk/dv kernel; ``*_masked`` of them run
    the mask. ``splash_*``: the same for splash with the union mask. Programs and grid
    steps are the kernels' (``heads`` query heads a forward / dq program and a dk/dv
    step); splash's ``splash_programs``, ``splash_grid_steps`` and
    ``splash_grid_steps_dkv`` are at one head a program or step.
    """

    fwd: int
    fwd_masked: int
    dkv: int
    dkv_masked: int
    splash: int
    splash_masked: int
    q_programs: int
    kv_programs: int
    grid_steps_fwd: int
    grid_steps_dkv: int
    splash_programs: int
    splash_grid_steps: int
    splash_grid_steps_dkv: int


def _blocks_of(ranges, n_blocks: int) -> np.ndarray:
    """Bool ``[..., n_blocks]`` membership of the (<= 2 run) block ranges."""
    blk = np.arange(n_blocks)
    fs, fn = np.asarray(ranges.first_start)[..., None], np.asarray(ranges.first_steps)[..., None]
    ss, sn = np.asarray(ranges.second_start)[..., None], np.asarray(ranges.second_steps)[..., None]
    return ((blk >= fs) & (blk < fs + fn)) | ((blk >= ss) & (blk < ss + sn))


def visit_counts(
    bounds, *, seq_len: int, q_heads: int, kv_heads: int, block_q: int, block_kv: int,
    heads: int = 1,
) -> VisitCounts:  # fmt: skip
    """Count the kernels' and splash's block visits for concrete bounds ``[B, 4]``
    (``heads``: the kernels' query heads per forward / dq program and dk/dv step)."""
    bounds = np.asarray(
        normalize_bounds(np.asarray(bounds, np.int32), batch=len(bounds), seq_len=seq_len)
    )
    batch = bounds.shape[0]
    # The kernels' padding and grids (ranker_config), so the counts are theirs.
    seq_pad = padded_len(seq_len, block_q, block_kv)
    grid = grids(batch, q_heads, kv_heads, seq_pad, block_q, block_kv, heads)
    one_head = grids(batch, q_heads, kv_heads, seq_pad, block_q, block_kv)
    per_head = one_head["fwd"]
    nq, nk = seq_pad // block_q, seq_pad // block_kv
    hl, hu, cl, cu = (bounds[:, t, None] for t in range(4))
    q0 = np.arange(nq)[None] * block_q
    kr = ranker_kv_block_ranges(hl, hu, cl, cu, q0, q0 + block_q, block_kv)
    kf = ranker_full_kv_steps(kr, hl, hu, cl, cu, q0, q0 + block_q, block_kv)
    fwd = int(np.asarray(kr.total_steps).sum())
    fwd_full = int(np.asarray(kf[1] - kf[0]).sum())
    k0 = np.arange(nk)[None] * block_kv
    qr = ranker_q_block_ranges(hl, hu, cl, cu, k0, k0 + block_kv, block_q)
    qf = ranker_full_q_steps(qr, hl, hu, cl, cu, k0, k0 + block_kv, block_q)
    dkv = int(np.asarray(qr.total_steps).sum())
    dkv_full = int(np.asarray(qf[1] - qf[0]).sum())

    # Splash with the union mask: block (i, j) is visited iff any row visits it; it is
    # full iff the union of the rows' masks allows every pair of the block.
    union_blocks = _blocks_of(kr, nk).any(axis=0)  # [nq, nk]
    pos = np.arange(seq_pad)
    union = np.zeros((seq_pad, seq_pad), bool)
    for row in bounds:
        union |= np.asarray(ranker_mask(pos[:, None], pos[None, :], *row))
    tiles = union.reshape(nq, block_q, nk, block_kv).all(axis=(1, 3))
    splash = int(union_blocks.sum())
    splash_full = int((union_blocks & tiles).sum())
    return VisitCounts(
        fwd=fwd * q_heads,
        fwd_masked=(fwd - fwd_full) * q_heads,
        dkv=dkv * q_heads,  # per (kv tile, query head of its group)
        dkv_masked=(dkv - dkv_full) * q_heads,
        splash=splash * batch * q_heads,
        splash_masked=(splash - splash_full) * batch * q_heads,
        q_programs=math.prod(grid["fwd"][:3]),
        kv_programs=math.prod(grid["dkv"][:3]),
        grid_steps_fwd=math.prod(grid["fwd"]),
        grid_steps_dkv=math.prod(grid["dkv"]),
        splash_programs=math.prod(per_head[:3]),
        splash_grid_steps=math.prod(per_head),
        splash_grid_steps_dkv=math.prod(one_head["dkv"]),
    )


def _fill(k: int, n: int, mxu: int) -> float:
    return (k / round_up(k, mxu)) * (n / round_up(n, mxu))


@dataclasses.dataclass(frozen=True)
class RankerCost:
    """Predicted seconds on one chip (``dq_s`` and ``dkv_s`` the backward's two kernels,
    ``bwd_s`` with the layout copies); ``mxu_fraction``: effective FLOPs on allowed
    pairs (``attn_common.ranker_flops``) / (time x the chip's bf16 peak)."""

    case: str
    chip: str
    block_q: int
    block_kv: int
    fwd_s: float
    bwd_s: float
    splash_fwd_s: float
    splash_bwd_s: float
    fwd_mxu_fraction: float
    fwd_bound: str
    dq_s: float = 0.0
    dkv_s: float = 0.0

    @property
    def fwd_ratio(self) -> float:
        """Splash (union mask) time / this kernel's time, forward."""
        return self.splash_fwd_s / self.fwd_s

    @property
    def train_ratio(self) -> float:
        return (self.splash_fwd_s + self.splash_bwd_s) / (self.fwd_s + self.bwd_s)


def _visit_seconds(kind: str, chip: TpuChip, *, bq, bkv, d, cap, masked: bool, heads, const):
    """(seconds, bound) of one visit (one query head) on one core; ``kind`` in fwd / dq /
    dkv; ``heads`` query heads share a fwd / dq visit's K and V blocks."""
    core_mxu = chip.mxu_flops / chip.cores * const.mxu_efficiency[kind]
    if kind == "fwd":
        fills = (_fill(d, bkv, chip.mxu_dim), _fill(bkv, d, chip.mxu_dim))
    elif kind == "dq":
        fills = (_fill(d, bkv, chip.mxu_dim),) * 2 + (_fill(bkv, d, chip.mxu_dim),)
    else:
        fills = (_fill(d, bq, chip.mxu_dim),) * 2 + (_fill(bq, d, chip.mxu_dim),) * 2
    mxu = sum(2 * bq * bkv * d / (core_mxu * f) for f in fills)
    ops = const.vpu_ops[kind] + CAP_OPS[cap] + (const.mask_ops if masked else 0)
    acc = d * (2 * bkv if kind == "dkv" else bq)  # accumulator elements updated a visit
    vpu = (bq * bkv * ops + acc * const.acc_ops[kind]) / (chip.vpu_ops / chip.cores)
    # dk/dv: the Q and dO blocks plus the f32 lse / delta rows; else the K and V blocks.
    bytes_ = 2 * bq * (d * ITEMSIZE + 4) if kind == "dkv" else 2 * bkv * d * ITEMSIZE / heads
    hbm = bytes_ / (chip.hbm_bytes_per_s / chip.cores)
    parts = {"MXU": mxu, "VPU": vpu, "HBM": hbm}
    bound = max(parts, key=parts.get)
    return parts[bound] + const.visit_s, bound


def _counts(case: RankerCase, block_q: int, block_kv: int, seed: int = 0):
    """(bounds, heads a program, ``visit_counts``) of a suite case at one tiling."""
    bounds = case.bounds(seed)
    hp = heads_per_program(case.q_heads // case.kv_heads, block_q, block_kv, case.head_dim)
    c = visit_counts(bounds, seq_len=case.seq_len, q_heads=case.q_heads, kv_heads=case.kv_heads,
                     block_q=block_q, block_kv=block_kv, heads=hp)  # fmt: skip
    return bounds, hp, c


def _seconds(case: RankerCase, chip: TpuChip, block_q, block_kv, hp, c, const) -> dict:
    """Predicted seconds of each kernel (``KERNELS``), of splash's forward and backward
    (``splash_fwd``, ``splash_bwd``) and of the D = 64 layout copies (``layout``)."""
    d, cap = case.head_dim, case.cap.method.value
    kw = dict(bq=block_q, bkv=block_kv, d=d, cap=cap, const=const)
    t = {
        (kind, m, h): _visit_seconds(kind, chip, masked=m, heads=h, **kw)[0]
        for kind in KERNELS
        for m in (False, True)
        for h in {1, hp}
    }
    core_bw = chip.hbm_bytes_per_s / chip.cores
    # Per head: Q in, O out (dq: Q, dO in; dQ out ~ 3); a kernel program has hp heads.
    q_prog = 2 * block_q * d * ITEMSIZE / core_bw
    kv_prog = 4 * block_kv * d * ITEMSIZE / core_bw  # K, V in; dK, dV out
    layout = 0.0
    if d % 128:  # D = 64: XLA transposes q, k, v (and out) to [B, H, S, D] and back
        elems = case.batch * case.seq_len * d * (2 * case.q_heads + 2 * case.kv_heads)
        layout = 2 * elems * ITEMSIZE / chip.hbm_bytes_per_s

    def visits(kind, total, masked, heads=hp):
        return (total - masked) * t[(kind, False, heads)] + masked * t[(kind, True, heads)]

    cores, step = chip.cores, const.step_s
    q_progs = c.q_programs * hp * q_prog  # the kernels' programs, hp heads each
    s_progs = c.splash_programs * q_prog  # splash: one head a program
    return {
        "fwd": (visits("fwd", c.fwd, c.fwd_masked) + q_progs + c.grid_steps_fwd * step) / cores,
        "dq": (visits("dq", c.fwd, c.fwd_masked) + 1.5 * q_progs + c.grid_steps_fwd * step) / cores,
        "dkv": (
            visits("dkv", c.dkv, c.dkv_masked) + c.kv_programs * kv_prog + c.grid_steps_dkv * step
        )
        / cores,
        "splash_fwd": (
            visits("fwd", c.splash, c.splash_masked, 1) + s_progs + c.splash_grid_steps * step
        )
        / cores
        + layout,
        # Splash's dk/dv pass visits the transpose of the same union block set.
        "splash_bwd": (
            visits("dq", c.splash, c.splash_masked, 1)
            + visits("dkv", c.splash, c.splash_masked, 1)
            + 1.5 * s_progs
            + c.kv_programs * kv_prog
            + (c.splash_grid_steps + c.splash_grid_steps_dkv) * step
        )
        / cores
        + layout,
        "layout": layout,
    }


def predict(
    case: RankerCase, chip: TpuChip, *, block_q: int, block_kv: int, seed: int = 0,
    const: ModelConstants | None = None,
) -> RankerCost:  # fmt: skip
    """The model for one suite case on one chip (bf16, the case's cap), with ``const``
    (default ``FITTED``)."""
    const = FITTED if const is None else const
    bounds, hp, c = _counts(case, block_q, block_kv, seed)
    sec = _seconds(case, chip, block_q, block_kv, hp, c, const)
    fwd = sec["fwd"] + sec["layout"]
    kw = dict(bq=block_q, bkv=block_kv, d=case.head_dim, cap=case.cap.method.value, const=const)
    return RankerCost(
        case=case.name,
        chip=chip.name,
        block_q=block_q,
        block_kv=block_kv,
        fwd_s=fwd,
        bwd_s=sec["dq"] + sec["dkv"] + sec["layout"],
        splash_fwd_s=sec["splash_fwd"],
        splash_bwd_s=sec["splash_bwd"],
        fwd_mxu_fraction=ranker_flops(bounds, case.q_heads, case.head_dim) / (fwd * chip.mxu_flops),
        fwd_bound=_visit_seconds("fwd", chip, masked=False, heads=hp, **kw)[1],
        dq_s=sec["dq"],
        dkv_s=sec["dkv"],
    )


def kernel_ms(row: dict) -> dict:
    """Each kernel's device ms (``KERNELS``) in a forward + backward results row's
    ``kernel_ops_ms`` (bench_ranker): the forward's op is named after ``_fwd_padded``,
    and of the backward's two the dk/dv kernel is the one with two outputs; ``{}``
    without per-kernel times."""
    out = {}
    for name, ms in row.get("kernel_ops_ms") or ():
        head = name.split(" custom-call(")[0].split(" = ", 1)[-1]
        if "fwd_padded" in name:
            out["fwd"] = ms
        elif "bwd_padded" in name:
            out["dkv" if head.startswith("(") and head.count("[") == 2 else "dq"] = ms
    return out


def refit(samples, chip: TpuChip, start: ModelConstants | None = None):
    """Least-squares fit of the model's constants to measured kernel times.

    ``samples``: ``(case, block_q, block_kv, {kernel: ms})`` (:func:`kernel_ms` of a
    results row). Minimises the squared log ratio of predicted to measured time over
    every (sample, kernel) with ``scipy.optimize.least_squares`` within physical bounds
    (efficiencies in (0.05, 1], nonnegative ops and overheads). Returns the fitted
    ``ModelConstants`` and ``[(case, block_q, block_kv, kernel, measured ms, predicted
    ms)]`` at the fit."""
    from scipy.optimize import least_squares

    prepared = []
    for case, bq, bkv, times in samples:
        _, hp, c = _counts(case, bq, bkv)
        prepared.append((case, bq, bkv, hp, c, times))

    def predicted(p):
        const = ModelConstants.of_vector(p)
        out = []
        for case, bq, bkv, hp, c, times in prepared:
            sec = _seconds(case, chip, bq, bkv, hp, c, const)
            out += [(case.name, bq, bkv, k, ms, sec[k] * 1e3) for k, ms in times.items()]
        return out

    def residuals(p):
        return np.array([math.log(pred / ms) for *_, ms, pred in predicted(p)])

    scale = np.array([1.0] * 10 + [1e-6, 1e-6])  # the overheads fitted in microseconds
    lower = [0.05] * 3 + [0.0] * 9
    upper = [1.0] * 3 + [500.0] * 7 + [100.0, 100.0]
    x0 = np.clip(np.array((start or FITTED).vector()) / scale, lower, upper)
    fit = least_squares(lambda x: residuals(x * scale), x0, bounds=(lower, upper))
    return ModelConstants.of_vector(fit.x * scale), predicted(fit.x * scale)


def suite_table(tiling=default_config, cases=RANKER_SUITE, chips=("v5e", "v5p", "v6e")):
    """``RankerCost`` for every suite case x chip, with the kernels' tiling ``tiling(S, D)``
    (``ranker_config.default_config``)."""
    rows = []
    for case in cases:
        cfg = tiling(case.seq_len, case.head_dim)
        for name in chips:
            rows.append(predict(case, TPU_CHIPS[name], block_q=cfg.block_q, block_kv=cfg.block_kv))
    return rows


def format_table(rows) -> str:
    """Markdown table of ``suite_table`` rows."""
    head = (
        "| case | chip | blocks | fwd (ms) | fwd MXU % (allowed pairs) | fwd bound | "
        "splash fwd (ms) | splash / ours fwd | fwd+bwd (ms) | splash fwd+bwd (ms) | "
        "splash / ours fwd+bwd |\n|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r.case} | {r.chip} | {r.block_q}x{r.block_kv} | {r.fwd_s * 1e3:.3f} | "
        f"{100 * r.fwd_mxu_fraction:.0f} | {r.fwd_bound} | {r.splash_fwd_s * 1e3:.3f} | "
        f"{r.fwd_ratio:.2f} | {(r.fwd_s + r.bwd_s) * 1e3:.3f} | "
        f"{(r.splash_fwd_s + r.splash_bwd_s) * 1e3:.3f} | {r.train_ratio:.2f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"
