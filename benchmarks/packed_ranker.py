"""Packed vs padded ranker rows: one transformer block and the attention alone (H200).

The population (``attn_mosaic_gpu.bench.simulate_ranker_users``, seeded): 10,000 users,
history lengths log-normal (median 200, sigma 1.0) rounded and clipped to [1, 1024], 64
candidates each. Three layouts of the same users:

* ``padded S=1152``: one user per row, per-row bounds ``[B, 4]`` = ``(0, h, h, h + 64)``;
* ``packed S=2048`` and ``packed S=4096``: users packed by ``attn_common.pack_users``
  (first-fit decreasing; no cap on users per row unless ``--max-users-per-row``),
  packed bounds ``[B, U, 4]``.

Model (the phoenix heads): ``Hq = 20``, ``Hkv = 4``, ``D = 128``, soft_sign cap 80, bf16.
One transformer block: QKV projection (width ``Hq * D = 2560`` to ``q 20 x 128``,
``k, v 4 x 128``), ranker attention, output projection, residual, MLP ``2560 -> 10240 ->
2560`` (gelu), residual (no norms, no biases). Measured per layout, each forward and
forward + backward (``jax.value_and_grad`` of a scalar loss, the mean square of the
block's output over real tokens, with respect to the parameters and the input):

* the block (projections, attention, MLP);
* the attention alone (``ranker_attention`` on random q, k, v; backward by ``jax.vjp``
  with a random cotangent).

What is timed: every layout's rows are dealt into batches of the same token count
(``64 x 1152 = 73,728`` tokens: 64 padded rows, 36 rows of 2048, 18 of 4096; a static
batch shape, so a batch may end in empty rows). Rows are dealt round-robin after sorting
them by allowed pairs, so every batch holds the same mix of long and short users.
``--batches`` batches per layout, evenly spaced over the batches, are timed (default 8;
``0`` times every batch), each with ``attn_mosaic_gpu.bench.device_ms`` (CUPTI device time
summed over the kernels of one call, median of ``--iterations`` calls, after a warm-up;
wall clock off a GPU); the times of the timed batches are summed. Users/s = users in the
timed batches / that time; the whole population's time is estimated as that time x
batches / timed batches.

Reported per layout: rows, users per row ``U``, tokens (``rows x S``), tokens per user,
users/s of the block and of the attention (forward and forward + backward), the
attention's effective TFLOP/s over allowed pairs only (``attn_common.ranker_flops``:
``4 D Hq x pairs``; forward + backward = 3.5x), the attention time per user and the
block users/s relative to the padded layout, and how much of the forward kernel's work
is useful: of the KV blocks the kernel's compute warpgroups visit (the step tables of
``attn_common.packed.packed_step_table`` that the Hopper forward kernel reads, tiles of
``2 x block_q`` query rows, ``block_kv`` keys per block, from the kernel's tuned config
for the shape; an all-padding warpgroup idles and is not counted), the fraction holding
at least one allowed pair for the warpgroup's ``block_q`` rows (also: the fraction of
those steps that need the mask, and allowed pairs / computed scores). This is computed
on the host for the whole population. Targets (printed with pass/fail per packed
layout): block forward + backward users/s >= 2x padded; attention time per user <= 1.1x
padded (forward and forward + backward, each).

Usage (H200; ``--impl reference`` on any device)::

    PYTHONPATH=common/src:packages/attn-reference/src:packages/attn-mosaic-gpu/src \\
        python benchmarks/packed_ranker.py --out docs/results

writes ``packed_ranker.json`` and ``packed_ranker.md`` into ``--out`` (rewritten after
every measurement, so a run cut short leaves what it measured). ``--smoke`` runs tiny
shapes (24 users, 4/2 heads of 16, rows of 64/128/256, one batch, one call, XLA
optimizations off) for a CPU check of the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import html
import json
import math
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import CapMethod, CapParams, KernelConfig, ranker_attention, ranker_flops
from attn_common.cli_args import implementation_choices, positive_int, provenance, seed_int
from attn_common.dispatch import BackendUnavailableError, device_class, select_backend
from attn_common.packed import packed_runs_per_tile, packed_step_table
from attn_common.packing import pack_users
from attn_mosaic_gpu.bench import ceilings, device_ms, simulate_ranker_users

RESULT_JSON = "packed_ranker.json"
RESULT_MD = "packed_ranker.md"
RESULT_SVG = "packed_ranker.svg"
MODES = ("fwd", "fwd+bwd")
TARGET_BLOCK_SPEEDUP = 2.0  # block fwd+bwd users/s >= 2x padded
TARGET_ATTENTION_RATIO = 1.1  # attention time per user <= 1.1x padded


@dataclasses.dataclass(frozen=True)
class Problem:
    """The users, the model and the layouts of one run."""

    users: int
    median_history: float
    sigma: float
    max_history: int
    candidates: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp_ratio: int
    cap: CapParams
    padded_seq: int
    packed_seqs: tuple[int, ...]
    batch_tokens: int  # tokens per timed call, every layout
    block_override: KernelConfig | None = None  # tile sizes of the visited-block stats

    @property
    def width(self) -> int:
        return self.q_heads * self.head_dim

    def dense_flops_per_token(self) -> float:
        """Forward matmul FLOPs of the projections and the MLP per row position."""
        w, d = self.width, self.head_dim
        qkv = w * (self.q_heads + 2 * self.kv_heads) * d
        return 2.0 * (qkv + self.q_heads * d * w + 2 * w * self.mlp_ratio * w)


FULL = Problem(
    users=10_000,
    median_history=200.0,
    sigma=1.0,
    max_history=1024,
    candidates=64,
    q_heads=20,
    kv_heads=4,
    head_dim=128,
    mlp_ratio=4,
    cap=CapParams(CapMethod.SOFT_SIGN, 80.0),
    padded_seq=1152,
    packed_seqs=(2048, 4096),
    batch_tokens=64 * 1152,
)
# Tiny shapes for a CPU run of the whole script (the reference implementation).
SMOKE = dataclasses.replace(
    FULL,
    users=24,
    median_history=16.0,
    max_history=56,
    candidates=8,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    padded_seq=64,
    packed_seqs=(128, 256),
    batch_tokens=8 * 64,
    block_override=KernelConfig(block_q=16, block_kv=32),
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout of the population: ``bounds [rows, U, 4]`` of rows of ``seq_len``."""

    name: str
    seq_len: int
    packed: bool
    bounds: np.ndarray
    real_tokens: int

    @property
    def rows(self) -> int:
        return self.bounds.shape[0]

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len

    def users_in(self, rows: np.ndarray) -> int:
        """Users placed in ``rows`` (a user is a slot with a non-empty segment)."""
        b = self.bounds[rows[rows >= 0]]
        return int(((b[..., 1] > b[..., 0]) | (b[..., 3] > b[..., 2])).sum())

    def op_bounds(self, rows: np.ndarray) -> np.ndarray:
        """The op's bounds for ``rows`` (``-1``: an empty row): packed ``[B, U, 4]``,
        padded ``[B, 4]`` (one user per row, as a padded pipeline passes them)."""
        b = np.where((rows >= 0)[:, None, None], self.bounds[np.maximum(rows, 0)], 0)
        return b.astype(np.int32) if self.packed else b[:, 0].astype(np.int32)


def build_layouts(problem: Problem, seed: int, max_users_per_row: int | None) -> list[Layout]:
    """The padded layout and one packed layout per ``problem.packed_seqs``."""
    hist, cand = simulate_ranker_users(
        problem.users,
        median_history=problem.median_history,
        sigma=problem.sigma,
        max_history=problem.max_history,
        num_candidates=problem.candidates,
        seed=seed,
    )
    real = int((hist + cand).sum())
    if int((hist + cand).max()) > problem.padded_seq:
        raise ValueError(f"padded_seq {problem.padded_seq} is shorter than the longest user")
    padded = np.stack([np.zeros_like(hist), hist, hist, hist + cand], axis=1)
    layouts = [
        Layout(
            f"padded S={problem.padded_seq}",
            problem.padded_seq,
            False,
            padded[:, None, :].astype(np.int32),
            real,
        )
    ]
    for seq_len in problem.packed_seqs:
        start = time.perf_counter()
        p = pack_users(hist, cand, seq_len=seq_len, max_users_per_row=max_users_per_row)
        cap = "" if max_users_per_row is None else f", U<={max_users_per_row}"
        print(
            f"  packed S={seq_len}{cap}: {p.rows} rows, U={p.bounds.shape[1]}, "
            f"{time.perf_counter() - start:.2f} s"
        )
        layouts.append(Layout(f"packed S={seq_len}{cap}", seq_len, True, p.bounds, real))
    return layouts


def row_pairs(bounds: np.ndarray) -> np.ndarray:
    """Allowed (query, key) pairs per row of ``bounds [R, U, 4]`` (disjoint users)."""
    rows, users = bounds.shape[:2]
    expected = ranker_flops(bounds.reshape(-1, 4), 1, 1) / 4.0  # pairs, by ranker_flops
    b = bounds.reshape(-1, 4).astype(np.int64)
    hist, cand = b[:, 1] - b[:, 0], b[:, 3] - b[:, 2]
    ov = np.maximum(np.minimum(b[:, 1], b[:, 3]) - np.maximum(b[:, 0], b[:, 2]), 0)
    pairs = ((hist + cand - ov) * hist + (cand - ov)).reshape(rows, users).sum(1)
    if pairs.sum() != expected:
        raise RuntimeError(f"allowed pairs: {pairs.sum()} per row, {expected} by ranker_flops")
    return pairs


def make_batches(layout: Layout, batch_rows: int) -> np.ndarray:
    """int ``[num_batches, batch_rows]`` row indices, ``-1`` for empty slots.

    Rows sorted by allowed pairs (most first) are dealt round-robin, so every batch
    holds the same mix of long and short rows."""
    order = np.argsort(-row_pairs(layout.bounds), kind="stable")
    num_batches = -(-layout.rows // batch_rows)
    batches = np.full((num_batches, batch_rows), -1, np.int64)
    for j in range(num_batches):
        rows = order[j::num_batches]
        batches[j, : len(rows)] = rows
    return batches


def timed_batch_ids(num_batches: int, count: int) -> np.ndarray:
    """``count`` batch indices evenly spaced over ``num_batches`` (all for 0)."""
    if count <= 0 or count >= num_batches:
        return np.arange(num_batches)
    return np.unique(np.linspace(0, num_batches - 1, count).round().astype(np.int64))


# ------------------------------------------------------------------ visited blocks


def kernel_blocks(problem: Problem, seq_len: int) -> tuple[KernelConfig, str]:
    """The Hopper forward's tiling for this shape (its tuned table, else its default)."""
    if problem.block_override is not None:
        return problem.block_override, "smoke override"
    try:
        from attn_mosaic_gpu.ranker import resolve_tuning
    except ImportError as e:
        return KernelConfig(), f"KernelConfig() defaults (attn_mosaic_gpu not importable: {e})"
    q = jax.ShapeDtypeStruct((1, seq_len, problem.q_heads, problem.head_dim), jnp.bfloat16)
    config, _ = resolve_tuning(q, problem.cap, None, None)
    return config, "attn_mosaic_gpu.ranker.resolve_tuning (tuned table, else default_config)"


def _overlap(lo, hi, seg_lo, seg_hi):
    return np.maximum(np.minimum(hi, seg_hi) - np.maximum(lo, seg_lo), 0)


def rect_pairs(bounds: np.ndarray, q0, q1, k0, k1) -> np.ndarray:
    """Allowed pairs with query in ``[q0, q1)`` and key in ``[k0, k1)`` (``[E]`` each;
    ``bounds [E, U, 4]``, users of a row disjoint): history keys are read by the user's
    history and candidate rows, a candidate key by its own row (``ranker_mask``)."""
    hl, hu, cl, cu = (bounds[..., t].astype(np.int64) for t in range(4))
    q0, q1, k0, k1 = (np.asarray(x, np.int64)[:, None] for x in (q0, q1, k0, k1))
    hc_lo, hc_hi = np.maximum(hl, cl), np.minimum(hu, cu)  # H and C of one user overlap
    rows = _overlap(q0, q1, hl, hu) + _overlap(q0, q1, cl, cu) - _overlap(q0, q1, hc_lo, hc_hi)
    hist_keys = _overlap(k0, k1, hl, hu)
    lo, hi = np.maximum(q0, k0), np.minimum(q1, k1)  # the diagonal: key == query
    own = _overlap(lo, hi, cl, cu) - _overlap(lo, hi, hc_lo, hc_hi)  # not a history key
    return (rows * hist_keys + own).sum(-1)


def _rows_seen(bounds: np.ndarray, q0, q1) -> np.ndarray:
    """The forward kernel's ``active`` test for a warpgroup's rows (``ranker_fwd``)."""
    q0, q1 = np.asarray(q0, np.int64)[:, None], np.asarray(q1, np.int64)[:, None]
    b = bounds.astype(np.int64)
    seen = _overlap(q0, q1, b[..., 0], b[..., 1]) + _overlap(q0, q1, b[..., 2], b[..., 3])
    return seen.sum(-1)


def visited_blocks(
    bounds: np.ndarray, seq_len: int, config: KernelConfig, chunk_rows: int = 64
) -> dict:
    """How much of the forward kernel's visited work holds allowed pairs.

    The kernel's grid program owns a tile of ``2 block_q`` query rows (two compute
    warpgroups of ``block_q`` rows each) and walks the KV blocks of its tile's runs in
    ``packed_step_table`` (the blocks its ``packed_step_list`` lists; for one user per row the
    same blocks as
    ``ranker_kv_block_ranges``). Each warpgroup with a real row computes a ``block_q x
    block_kv`` score tile per step. Counted over those warpgroup steps: ``visited``,
    ``useful`` (at least one allowed pair in the warpgroup's rows and the block's keys)
    and ``masked`` (outside the table's unmasked steps). ``covered_pairs`` (allowed
    pairs inside visited blocks) must equal ``allowed_pairs`` (all allowed pairs).
    """
    bounds = np.asarray(bounds, np.int32)
    rows, users = bounds.shape[:2]
    bq, bkv = config.block_q, config.block_kv
    tile = 2 * bq
    step = math.lcm(tile, bkv)
    seq_pad = -(-seq_len // step) * step
    num_tiles, runs = seq_pad // tile, packed_runs_per_tile(users)
    table_fn = jax.jit(
        functools.partial(packed_step_table, tile=tile, num_tiles=num_tiles, block=bkv, sub_tiles=2)
    )
    totals = dict.fromkeys(("visited", "useful", "masked", "tile_visits", "tile_useful"), 0)
    covered = 0
    for c0 in range(0, rows, chunk_rows):
        chunk = bounds[c0 : c0 + chunk_rows]
        n = chunk.shape[0]
        padded = np.zeros((chunk_rows, users, 4), np.int32)
        padded[:n] = chunk
        table = np.asarray(table_fn(jnp.asarray(padded)))[:n]  # [n, T, 2R + 4]
        starts, ends = table[..., :runs], table[..., runs : 2 * runs]
        steps = np.diff(ends, axis=-1, prepend=0)
        unmasked = table[..., 2 * runs :].reshape(n, num_tiles, 2, 2)
        r, t, u = np.nonzero(steps > 0)
        count = steps[r, t, u]
        within = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        e_row, e_tile = np.repeat(r, count), np.repeat(t, count)
        e_block = np.repeat(starts[r, t, u], count) + within
        e_step = np.repeat(ends[r, t, u] - count, count) + within  # the tile's step index
        e_bounds = chunk[e_row]
        k0 = e_block * bkv
        tile_pairs = 0
        for wg in range(2):
            q0 = e_tile * tile + wg * bq
            pairs = rect_pairs(e_bounds, q0, q0 + bq, k0, k0 + bkv)
            active = _rows_seen(e_bounds, q0, q0 + bq) > 0
            lo, hi = unmasked[e_row, e_tile, wg, 0], unmasked[e_row, e_tile, wg, 1]
            totals["visited"] += int(active.sum())
            totals["useful"] += int((active & (pairs > 0)).sum())
            totals["masked"] += int((active & ~((e_step >= lo) & (e_step < hi))).sum())
            covered += int(pairs.sum())
            tile_pairs = tile_pairs + pairs
        totals["tile_visits"] += len(e_block)
        totals["tile_useful"] += int((tile_pairs > 0).sum())
    allowed = int(row_pairs(bounds).sum())
    if covered != allowed:
        print(f"  WARNING: visited blocks cover {covered} of {allowed} allowed pairs")
    visited = max(totals["visited"], 1)
    return {
        "block_q": bq,
        "block_kv": bkv,
        "tile_rows": tile,
        "warpgroup_steps_visited": totals["visited"],
        "warpgroup_steps_useful": totals["useful"],
        "useful_fraction": totals["useful"] / visited,
        "masked_fraction": totals["masked"] / visited,
        "pair_density": allowed / (visited * bq * bkv),
        "tile_steps_visited": totals["tile_visits"],
        "tile_useful_fraction": totals["tile_useful"] / max(totals["tile_visits"], 1),
        "allowed_pairs": allowed,
        "covered_pairs": covered,
    }


# ------------------------------------------------------------------------- the model


@functools.partial(jax.jit, static_argnums=(1,))
def random_bf16(key: jax.Array, shapes: tuple) -> tuple[jax.Array, ...]:
    """Standard normal bf16 arrays of ``shapes`` ``((shape, scale), ...)`` times their
    scale (one compiled call for all of them)."""
    keys = jax.random.split(key, len(shapes))
    return tuple(
        (jax.random.normal(k, shape, jnp.float32) * scale).astype(jnp.bfloat16)
        for k, (shape, scale) in zip(keys, shapes, strict=True)
    )


def init_params(problem: Problem, key: jax.Array) -> dict[str, jax.Array]:
    """bf16 weights of one block, normal with variance 1 / fan-in."""
    w, d = problem.width, problem.head_dim
    shapes = {
        "wqkv": (w, (problem.q_heads + 2 * problem.kv_heads) * d),
        "wo": (problem.q_heads * d, w),
        "w1": (w, problem.mlp_ratio * w),
        "w2": (problem.mlp_ratio * w, w),
    }
    arrays = random_bf16(key, tuple((s, 1.0 / math.sqrt(s[0])) for s in shapes.values()))
    return dict(zip(shapes, arrays, strict=True))


def token_mask(bounds: jax.Array, seq_len: int) -> jax.Array:
    """bool ``[B, S]``: the position holds a user's history or candidate token."""
    b = bounds.reshape(bounds.shape[0], 1, -1, 4)  # [B, 1, U, 4]
    pos = jnp.arange(seq_len, dtype=jnp.int32)[None, :, None]
    hist = (pos >= b[..., 0]) & (pos < b[..., 1])
    cand = (pos >= b[..., 2]) & (pos < b[..., 3])
    return (hist | cand).any(-1)


def make_fns(problem: Problem, attention: Callable) -> dict[tuple[str, str], Callable]:
    """Jitted ``(part, mode) -> fn``: part ``block`` takes ``(params, x, bounds)``,
    ``attention`` takes ``(q, k, v, do, bounds)`` (``do`` unused by the forward)."""
    hq, hkv, d = problem.q_heads, problem.kv_heads, problem.head_dim

    def block(params, x, bounds):
        b, s, _ = x.shape
        qkv = x @ params["wqkv"]
        q = qkv[..., : hq * d].reshape(b, s, hq, d)
        k = qkv[..., hq * d : (hq + hkv) * d].reshape(b, s, hkv, d)
        v = qkv[..., (hq + hkv) * d :].reshape(b, s, hkv, d)
        x = x + attention(q, k, v, bounds).reshape(b, s, hq * d) @ params["wo"]
        return x + jax.nn.gelu(x @ params["w1"]) @ params["w2"]

    def loss(params, x, bounds):
        y = block(params, x, bounds).astype(jnp.float32)
        valid = token_mask(bounds, x.shape[1])
        total = jnp.sum(jnp.where(valid[..., None], y * y, 0.0))
        return total / jnp.maximum(valid.sum() * y.shape[-1], 1)

    def attention_fwd(q, k, v, do, bounds):
        del do
        return attention(q, k, v, bounds)

    def attention_fwd_bwd(q, k, v, do, bounds):
        # attn_mosaic_gpu.bench.fwd_bwd with the bounds as an argument (one compile serves
        # every batch; a closed-over bounds array would be a new function per batch).
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, bounds), q, k, v)
        return out, vjp(do)

    return {
        ("block", "fwd"): jax.jit(block),
        ("block", "fwd+bwd"): jax.jit(jax.value_and_grad(loss, argnums=(0, 1))),
        ("attention", "fwd"): jax.jit(attention_fwd),
        ("attention", "fwd+bwd"): jax.jit(attention_fwd_bwd),
    }


# ----------------------------------------------------------------------------- run


def measure_layout(
    problem: Problem,
    layout: Layout,
    fns: dict,
    params: dict,
    *,
    batches_to_time: int,
    iterations: int,
    seed: int,
    row: dict,
    saved: Callable[[], None] = lambda: None,
) -> None:
    """Time the attention and the block on the layout's timed batches into ``row``,
    calling ``saved`` after each measurement (partial reports survive a timeout)."""
    batch_rows = max(1, problem.batch_tokens // layout.seq_len)
    batches = make_batches(layout, batch_rows)
    ids = timed_batch_ids(len(batches), batches_to_time)
    timed_rows = batches[ids]
    users_timed = sum(layout.users_in(rows) for rows in timed_rows)
    bounds_list = [jnp.asarray(layout.op_bounds(rows)) for rows in timed_rows]
    attn_flops = sum(
        ranker_flops(
            layout.bounds[rows[rows >= 0]].reshape(-1, 4), problem.q_heads, problem.head_dim
        )
        for rows in timed_rows
    )
    b, s, w, hq, hkv, d = (
        batch_rows,
        layout.seq_len,
        problem.width,
        problem.q_heads,
        problem.kv_heads,
        problem.head_dim,
    )
    shapes = ((b, s, w), (b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d))
    x, q, k, v, do = random_bf16(jax.random.PRNGKey(seed), tuple((shape, 1.0) for shape in shapes))
    tokens_timed = len(ids) * b * s
    row.update(
        {
            "batch_rows": b,
            "batch_tokens": b * s,
            "num_batches": len(batches),
            "timed_batches": len(ids),
            "timed_users": users_timed,
            "timed_rows": int((timed_rows >= 0).sum()),
            "timed_tokens": tokens_timed,
        }
    )
    dense = problem.dense_flops_per_token() * tokens_timed
    for part in ("attention", "block"):
        row[part] = {}
        for mode in MODES:
            fn = fns[(part, mode)]
            args = (params, x) if part == "block" else (q, k, v, do)
            label = f"{layout.name:<22} {part:<9} {mode:<8}"
            print(f"  {label} ({len(ids)} batches of {b} x {s})", end="", flush=True)
            start = time.perf_counter()
            try:
                total_ms, method = 0.0, ""
                for bounds in bounds_list:
                    ms, method = device_ms(fn, *args, bounds, iterations=iterations)
                    total_ms += ms
            except Exception as e:
                row[part][mode] = {"ms": None, "error": f"{type(e).__name__}: {str(e)[:400]}"}
                print(f" FAILED {row[part][mode]['error']}", flush=True)
                traceback.print_exc(limit=4)
                saved()
                continue
            per_batch = total_ms / len(ids)
            entry = {
                "ms": total_ms,
                "timing": method,
                "users_per_s": users_timed / (total_ms * 1e-3),
                "ms_per_user": total_ms / users_timed,
                "population_s_estimate": per_batch * len(batches) * 1e-3,
            }
            scale = 3.5 if mode == "fwd+bwd" else 1.0
            if part == "attention":
                entry["effective_tflops"] = scale * attn_flops / total_ms * 1e-9
            else:
                entry["dense_tflops"] = (
                    (3.0 if mode == "fwd+bwd" else 1.0) * dense / total_ms * 1e-9
                )
            row[part][mode] = entry
            print(
                f" {total_ms:9.3f} ms  {entry['users_per_s']:12.1f} users/s"
                f"  [{time.perf_counter() - start:.1f} s wall]",
                flush=True,
            )
            saved()


def add_comparisons(result: dict) -> None:
    """Ratios vs the padded layout and the targets, in place."""
    layouts = result["layouts"]
    base = layouts[0]
    targets = []

    def value(row, part, mode, key):
        entry = row.get(part, {}).get(mode, {})
        return entry.get(key)

    for row in layouts:
        vs = {}
        for mode in MODES:
            ours, ref = (
                value(row, "block", mode, "users_per_s"),
                value(base, "block", mode, "users_per_s"),
            )
            vs[f"block_users_per_s_{mode}"] = ours / ref if ours and ref else None
            ours, ref = (
                value(row, "attention", mode, "ms_per_user"),
                value(base, "attention", mode, "ms_per_user"),
            )
            vs[f"attention_ms_per_user_{mode}"] = ours / ref if ours and ref else None
        row["vs_padded"] = vs
        if row is base:
            continue
        checks = [
            (
                "block fwd+bwd users/s vs padded",
                vs["block_users_per_s_fwd+bwd"],
                ">=",
                TARGET_BLOCK_SPEEDUP,
            ),
            (
                "attention fwd time/user vs padded",
                vs["attention_ms_per_user_fwd"],
                "<=",
                TARGET_ATTENTION_RATIO,
            ),
            (
                "attention fwd+bwd time/user vs padded",
                vs["attention_ms_per_user_fwd+bwd"],
                "<=",
                TARGET_ATTENTION_RATIO,
            ),
        ]
        for name, got, op, want in checks:
            ok = None if got is None else (got >= want if op == ">=" else got <= want)
            targets.append(
                {"layout": row["name"], "target": f"{name} {op} {want}x", "value": got, "pass": ok}
            )
    result["targets"] = targets


def _f(x, spec: str = ".1f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def write_plot(result: dict, path: Path) -> None:
    """An SVG of each layout against padded: block users/s (forward, forward + backward)
    and attention time per user, with the 2x and 1.1x targets as lines. Plain SVG, no
    plotting library."""
    groups = [
        ("block users/s vs padded (target >= 2x)", "block_users_per_s_", 2.0),
        ("attention time/user vs padded (target <= 1.1x)", "attention_ms_per_user_", 1.1),
    ]
    layouts = result["layouts"]
    colors = ["#8c8c8c", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    width, panel_h, left, bar_w = 760, 230, 60, 26
    height = 60 + panel_h * len(groups)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="20" font-size="14">Packed vs padded ranker rows '
        + html.escape(f"({result['device']}, commit {result['provenance'].get('commit')})")
        + "</text>",
    ]
    for g, (title, key, target) in enumerate(groups):
        top = 40 + g * panel_h
        values = [r.get("vs_padded", {}).get(f"{key}{mode}") for r in layouts for mode in MODES]
        vmax = max([v for v in values if v is not None] + [target]) * 1.15
        base = top + panel_h - 40

        def y(v, base=base, vmax=vmax, top=top):
            return base - (v / vmax) * (base - top - 20)

        out.append(f'<text x="{left}" y="{top + 12}">{html.escape(title)}</text>')
        out.append(f'<line x1="{left}" y1="{base}" x2="{width - 20}" y2="{base}" stroke="black"/>')
        ty = y(target)
        out.append(
            f'<line x1="{left}" y1="{ty:.1f}" x2="{width - 20}" y2="{ty:.1f}" '
            'stroke="#d62728" stroke-dasharray="4 3"/>'
        )
        out.append(f'<text x="{width - 60}" y="{ty - 4:.1f}" fill="#d62728">{target:g}x</text>')
        x = left + 20
        for i, r in enumerate(layouts):
            for m, mode in enumerate(MODES):
                v = r.get("vs_padded", {}).get(f"{key}{mode}")
                if v is None:
                    continue
                out.append(
                    f'<rect x="{x}" y="{y(v):.1f}" width="{bar_w}" height="{base - y(v):.1f}" '
                    f'fill="{colors[i % len(colors)]}" opacity="{1.0 if m else 0.6}"/>'
                )
                out.append(
                    f'<text x="{x + bar_w / 2}" y="{y(v) - 4:.1f}" text-anchor="middle">'
                    f"{v:.2f}</text>"
                )
                out.append(
                    f'<text x="{x + bar_w / 2}" y="{base + 14}" text-anchor="middle" '
                    f'font-size="10">{mode}</text>'
                )
                x += bar_w + 6
            out.append(
                f'<text x="{x - bar_w - 6}" y="{base + 28}" text-anchor="middle" '
                f'font-size="10">{html.escape(r["name"])}</text>'
            )
            x += 40
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def write_reports(result: dict, out: Path) -> None:
    """``packed_ranker.json``, ``packed_ranker.md`` and ``packed_ranker.svg`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_JSON).write_text(json.dumps(result, indent=2) + "\n")
    write_plot(result, out / RESULT_SVG)
    prov, cfg = result["provenance"], result["config"]
    lines = [
        f"# Packed vs padded ranker rows ({result['device']}, jax {result['jax']})",
        "",
        f"Commit: {prov.get('commit')}; command: `{prov.get('command')}`; date: {prov.get('date')}.",
        "",
        f"Attention: `{result['impl']}`; timing: {result['timing']}"
        + (" (SMOKE RUN: tiny shapes, not a measurement)" if result["smoke"] else "")
        + ".",
        "",
        f"Users: {cfg['users']} (seed {cfg['seed']}), history log-normal median "
        f"{cfg['median_history']:g}, sigma {cfg['sigma']:g}, capped at {cfg['max_history']}; "
        f"{cfg['candidates']} candidates each. Block: Hq={cfg['q_heads']}, Hkv={cfg['kv_heads']}, "
        f"D={cfg['head_dim']}, width {cfg['width']}, MLP {cfg['mlp_width']} ({cfg['activation']}), "
        f"cap {cfg['cap']}, bf16.",
        "",
        f"What was timed: {result['method']}",
        "",
    ]
    if result.get("ceilings"):
        c = result["ceilings"]
        lines += [
            f"Ceilings: bf16 matmul {_f(c.get('matmul_bf16_tflops'), '.0f')} TFLOP/s, "
            f"copy {_f(c.get('copy_tbps'), '.2f')} TB/s.",
            "",
        ]
    lines += [
        "| layout | rows | U | tokens | tokens/user | efficiency | batches (timed) | "
        "users timed | kernel blocks | useful visited blocks | masked steps | pair density |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["layouts"]:
        vb = r.get("visited_blocks", {})
        lines.append(
            f"| {r['name']} | {r['rows']} | {r['users_per_row']} | {r['tokens']} | "
            f"{r['tokens_per_user']:.1f} | {r['efficiency']:.3f} | "
            f"{r.get('num_batches', '?')} ({r.get('timed_batches', '?')}) | "
            f"{r.get('timed_users', '?')} | {vb.get('block_q', '?')} x {vb.get('block_kv', '?')} | "
            f"{_f(vb.get('useful_fraction'), '.3f')} | "
            f"{_f(vb.get('masked_fraction'), '.3f')} | {_f(vb.get('pair_density'), '.3f')} |"
        )
    lines += [
        "",
        "| layout | part | mode | ms (timed batches) | users/s | vs padded | ms/user | "
        "TFLOP/s | time/user vs padded | population s (est.) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["layouts"]:
        for part in ("block", "attention"):
            for mode in MODES:
                e = r.get(part, {}).get(mode)
                if e is None:
                    continue
                if e.get("ms") is None:
                    lines.append(
                        f"| {r['name']} | {part} | {mode} | failed: "
                        f"{e.get('error', '')[:80]} | | | | | | |"
                    )
                    continue
                vs = r.get("vs_padded", {})
                speed = vs.get(f"block_users_per_s_{mode}") if part == "block" else None
                ratio = vs.get(f"attention_ms_per_user_{mode}") if part == "attention" else None
                lines.append(
                    f"| {r['name']} | {part} | {mode} | {e['ms']:.3f} | {e['users_per_s']:.1f} | "
                    f"{_f(speed, '.2f', '')}{'x' if speed else ''} | {e['ms_per_user']:.5f} | "
                    f"{_f(e.get('effective_tflops', e.get('dense_tflops')), '.4g', '')} | "
                    f"{_f(ratio, '.3f', '')}{'x' if ratio else ''} | "
                    f"{e['population_s_estimate']:.2f} |"
                )
    lines += ["", "Targets:", ""]
    for t in result.get("targets", []):
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
        lines.append(f"- {verdict}: {t['layout']}: {t['target']} (got {_f(t['value'], '.3f')}x)")
    lines += [
        "",
        "Useful visited blocks: of the score tiles (`block_q` rows of one compute warpgroup x "
        "`block_kv` keys) that the Hopper forward kernel computes, following its step list "
        "(`attn_common.packed.packed_step_list`: the blocks of `packed_step_table`'s runs, "
        "tiles of `2 block_q` rows; an all-padding "
        "warpgroup idles and is not counted), the fraction holding at least one allowed pair; "
        "masked steps: the fraction that needs the mask; pair density: allowed pairs / "
        "(tiles computed x block_q x block_kv). Whole population, host-side; kernel blocks "
        f"block_q x block_kv from {result.get('kernel_blocks_source', '?')}.",
        "",
        "TFLOP/s: attention rows count allowed pairs only (4 D Hq x pairs; fwd+bwd 3.5x "
        "fwd); block rows count the projections and the MLP over every row position "
        "(padding too; fwd+bwd 3x fwd), divided by the whole block's time. Block users/s "
        "pay for every row position; ms are summed over the timed batches.",
    ]
    (out / RESULT_MD).write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--impl",
        choices=implementation_choices(),
        default="mosaic-gpu",
        help="attention backend (default: mosaic-gpu, the Hopper kernels; 'reference' runs "
        "anywhere)",
    )
    parser.add_argument(
        "--users", type=positive_int, default=None, help="users (default: 10000; 24 with --smoke)"
    )
    parser.add_argument("--seed", type=seed_int, default=0, help="RNG seed (default: 0)")
    parser.add_argument(
        "--iterations",
        type=positive_int,
        default=None,
        help="timed calls per batch, median (default: 10; 1 with --smoke)",
    )
    parser.add_argument(
        "--batches",
        type=int,
        default=None,
        help="batches timed per layout, evenly spaced; 0 = every batch (default: 8; 1 with "
        "--smoke)",
    )
    parser.add_argument(
        "--packed-seqs",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="S",
        help="row lengths of the packed layouts (default: 2048 4096; 128 256 with --smoke)",
    )
    parser.add_argument(
        "--max-users-per-row",
        type=positive_int,
        default=None,
        help="cap U of the packed layouts (default: none, as pack_users)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("docs/results"),
        help="folder for packed_ranker.json / .md (default: docs/results)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, for a CPU check of the script (not a measurement)",
    )
    parser.add_argument(
        "--no-ceilings",
        action="store_true",
        help="skip the bf16 matmul / copy ceilings (GPU runs only)",
    )
    args = parser.parse_args(argv)
    if args.batches is not None and args.batches < 0:
        parser.error(f"--batches: got {args.batches}, expected >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every measurement ran (targets do not set the status).

    ``--smoke`` compiles with ``jax_disable_most_optimizations`` (compiles dominate a
    tiny CPU run; restored on return)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    previous = bool(jax.config.values.get("jax_disable_most_optimizations", False))
    if args.smoke:
        jax.config.update("jax_disable_most_optimizations", True)
    try:
        return run(args, argv)
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """The benchmark for parsed ``args`` (``argv``: the command line, for provenance)."""
    problem = SMOKE if args.smoke else FULL
    if args.users is not None:
        problem = dataclasses.replace(problem, users=args.users)
    if args.packed_seqs:
        problem = dataclasses.replace(problem, packed_seqs=tuple(args.packed_seqs))
    iterations = args.iterations or (1 if args.smoke else 10)
    batches = args.batches if args.batches is not None else (1 if args.smoke else 8)
    t_start = time.perf_counter()
    try:
        select_backend("ranker_attention", args.impl)  # the device check, before any work
    except BackendUnavailableError as e:
        print(f"--impl {args.impl}: {e}", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, device {dev.device_kind}, attention: {args.impl}")
    on_gpu = device_class() in ("hopper", "gpu")  # as attn_mosaic_gpu.bench.device_ms decides

    layouts = build_layouts(problem, args.seed, args.max_users_per_row)
    attention = functools.partial(ranker_attention, cap=problem.cap, implementation=args.impl)
    fns = make_fns(problem, attention)
    params = init_params(problem, jax.random.PRNGKey(args.seed + 1))
    prov = provenance(argv)
    prov["command"] = shlex.join(["python", "benchmarks/packed_ranker.py", *argv])
    method = (
        f"each layout's rows dealt into batches of {problem.batch_tokens} tokens "
        f"(rows sorted by allowed pairs, dealt round-robin, so every batch holds the same mix); "
        + ("every batch" if batches == 0 else f"{batches} batches per layout, evenly spaced,")
        + f" timed one call at a time by attn_mosaic_gpu.bench.device_ms (median of {iterations} "
        "calls after a warm-up; CUPTI kernel time on a GPU, wall clock elsewhere), times "
        "summed over the timed batches; users/s = users in the timed batches / that time; "
        "population time estimated as that time x batches / timed batches. The block's input "
        "x and the attention's q, k, v, dO are random bf16, the same for every batch of a "
        "layout; only the bounds change."
    )
    result: dict = {
        "provenance": prov,
        "device": dev.device_kind,
        "jax": jax.__version__,
        "impl": args.impl,
        "smoke": args.smoke,
        "timing": "CUPTI device time, median of iterations" if on_gpu else "wall clock, median",
        "method": method,
        "config": {
            "users": problem.users,
            "seed": args.seed,
            "median_history": problem.median_history,
            "sigma": problem.sigma,
            "max_history": problem.max_history,
            "candidates": problem.candidates,
            "q_heads": problem.q_heads,
            "kv_heads": problem.kv_heads,
            "head_dim": problem.head_dim,
            "width": problem.width,
            "mlp_width": problem.mlp_ratio * problem.width,
            "activation": "gelu (tanh approximation)",
            "cap": f"{problem.cap.method.value} {problem.cap.value}",
            "dtype": "bfloat16",
            "iterations": iterations,
            "batches_per_layout": batches,
            "batch_tokens": problem.batch_tokens,
            "max_users_per_row": args.max_users_per_row,
        },
        "ceilings": {},
        "layouts": [],
        "targets": [],
    }
    if on_gpu and not args.smoke and not args.no_ceilings:
        try:
            result["ceilings"] = ceilings()
            print(f"ceilings: {result['ceilings']}")
        except Exception as e:
            print(f"ceilings failed: {type(e).__name__}: {e}")

    def saved() -> None:
        add_comparisons(result)
        write_reports(result, args.out)

    failed = 0
    for i, layout in enumerate(layouts):
        config, source = kernel_blocks(problem, layout.seq_len)
        result["kernel_blocks_source"] = source
        row = {
            "name": layout.name,
            "seq_len": layout.seq_len,
            "packed": layout.packed,
            "rows": layout.rows,
            "users": layout.users_in(np.arange(layout.rows)),
            "users_per_row": layout.bounds.shape[1],
            "tokens": layout.tokens,
            "real_tokens": layout.real_tokens,
            "tokens_per_user": layout.tokens / problem.users,
            "efficiency": layout.real_tokens / layout.tokens,
        }
        start = time.perf_counter()
        row["visited_blocks"] = visited_blocks(layout.bounds, layout.seq_len, config)
        vb = row["visited_blocks"]
        print(
            f"{layout.name}: {layout.rows} rows, U={layout.bounds.shape[1]}, "
            f"{row['tokens_per_user']:.1f} tokens/user; visited blocks useful "
            f"{vb['useful_fraction']:.3f} ({time.perf_counter() - start:.1f} s; "
            f"{time.perf_counter() - t_start:.0f} s since start)",
            flush=True,
        )
        result["layouts"].append(row)
        measure_layout(
            problem,
            layout,
            fns,
            params,
            batches_to_time=batches,
            iterations=iterations,
            seed=args.seed + 2 + i,
            row=row,
            saved=saved,
        )
        failed += sum(row[p][m].get("ms") is None for p in ("block", "attention") for m in MODES)
    result["failed"] = failed
    result["wall_s"] = time.perf_counter() - t_start
    write_reports(result, args.out)
    print((args.out / RESULT_MD).read_text())
    print(f"wrote {args.out / RESULT_JSON} and {args.out / RESULT_MD} ({result['wall_s']:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
