"""Train the phoenix-style ranker block (model.py) with optax on packed users.

    python examples/ranker/train.py --small        # CPU, seconds (the reference backend)
    python examples/ranker/train.py                # a GPU (H200) or TPU: the full shapes

Synthetic users: every item has a category; a user's history is mostly items of the user's
category, and a candidate is engaged with (label 1) when it shares that category, so the model
has to read the history through attention to rank the candidates. History lengths are
heavy-tailed, as real ones are: padding every user to the longest wastes most of a row.

It trains on packed rows (the input pipeline packs users into a fixed ``[B, S]`` with
``attn_common.pack_users``; the jitted step gathers and scatters with ``PackedUsers``),
then times the same step on packed rows and on padded rows (one user per row, the same
``[B, S]``) and reports users per second for both, with the step's attention share
(the layers' ranker attention op, forward and backward, timed alone at the step's
shapes, over the step's time). It writes ``ranker.json`` and, with matplotlib, ``ranker.png``
(loss curve and throughput) into ``--out``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
except ModuleNotFoundError:  # an example's extra, not a dependency of the wheels
    sys.exit("examples/ranker needs optax: pip install optax")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: harness.py
import harness
from model import ModelConfig, init_params, loss_fn, ranker

from attn_common import pack_users

# The shapes: --small for a CPU (seconds), the full ones for an accelerator.
SHAPES = {
    "small": dict(
        model=dict(
            num_items=256,
            num_categories=8,
            d_model=32,
            q_heads=4,
            kv_heads=2,
            head_dim=8,
            layers=1,
            mlp=64,
        ),
        rows=4,
        seq_len=32,
        users_per_row=4,
        history=(4.0, 0.8, 28),  # lognormal median e^mu, sigma, the longest history
        candidates=4,
        steps=120,
        lr=1e-2,
        bench_steps=5,
        attn_dtype="float32",
        kernel=dict(model=dict(head_dim=64), attn_dtype="bfloat16"),  # --implementation
    ),
    "full": dict(
        model=dict(
            num_items=100_000,
            num_categories=64,
            d_model=512,
            q_heads=8,
            kv_heads=2,
            head_dim=64,
            layers=2,
            mlp=2048,
        ),
        rows=32,
        seq_len=1024,
        users_per_row=16,
        history=(5.0, 1.0, 992),
        candidates=32,
        steps=300,
        lr=1e-3,
        bench_steps=20,
        attn_dtype="bfloat16",
    ),
}


class Users:
    """An endless stream of synthetic users (numpy, host side)."""

    def __init__(self, seed: int, num_items: int, categories: int, history, candidates: int):
        self.rng = np.random.default_rng(seed)
        self.num_items, self.categories = num_items, categories
        self.mu, self.sigma, self.max_hist = history
        self.candidates = candidates
        self.queue: list[tuple] = []

    def _item(self, category):
        return category + self.categories * self.rng.integers(
            0, self.num_items // self.categories, category.shape
        )

    def _new(self):
        rng = self.rng
        category = int(rng.integers(0, self.categories))
        h = int(np.clip(rng.lognormal(np.log(self.mu), self.sigma), 1, self.max_hist))
        noise = rng.random(h) < 0.1
        hist_category = np.where(noise, rng.integers(0, self.categories, h), category)
        match = rng.random(self.candidates) < 0.5
        other = (category + rng.integers(1, self.categories, self.candidates)) % self.categories
        cand_category = np.where(match, category, other)
        return self._item(hist_category), self._item(cand_category), match.astype(np.float32)

    def take(self, n: int) -> list[tuple]:
        while len(self.queue) < n:
            self.queue.append(self._new())
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def put_back(self, users: list[tuple]) -> None:
        self.queue = users + self.queue


def make_batch(users: Users, shape: dict, packed: bool):
    """One step's batch, planned on the host: ``(PackedUsers, flat arrays, users)``.

    Both layouts are ``[rows, seq_len]``. Packed: as many users as first-fit decreasing
    fits into the rows (at most ``users_per_row`` per row); padded: one user per row.
    Every shape is fixed (``num_rows``, ``users_per_row``, ``flat_len`` and the users,
    padded with zero-length users) and the same for both layouts, so one compiled step
    serves both: they differ only in the data.
    """
    rows, seq, slots = shape["rows"], shape["seq_len"], shape["users_per_row"]
    cap = rows * slots if packed else rows
    max_users = rows * slots  # the users axis of every batch (zero-length users pad it)
    pool = users.take(cap)
    lens = np.array([len(h) + len(c) for h, c, _ in pool])

    def fits(n):
        p = pack_users(lens[:n], 0, seq_len=seq, max_users_per_row=slots if packed else 1)
        return p.rows <= rows

    lo, hi = 1, cap  # the most users (a prefix of the stream) that fit: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    users.put_back(pool[lo:])
    chosen = pool[:lo]
    hist = np.array([len(h) for h, _, _ in chosen] + [0] * (max_users - lo))
    cand = np.array([len(c) for _, c, _ in chosen] + [0] * (max_users - lo))
    p = pack_users(
        hist,
        cand,
        seq_len=seq,
        num_rows=rows,
        users_per_row=slots,
        max_users_per_row=None if packed else 1,
        flat_len=rows * seq,
    )
    flat = {
        "items": np.zeros(p.flat_len, np.int32),
        "is_candidate": np.zeros(p.flat_len, np.int32),
        "label": np.zeros(p.flat_len, np.float32),
        "weight": np.zeros(p.flat_len, np.float32),
    }
    t = 0
    for h, c, y in chosen:  # the flat layout: each user's history, then its candidates
        n = len(h) + len(c)
        flat["items"][t : t + n] = np.concatenate([h, c])
        flat["is_candidate"][t + len(h) : t + n] = 1
        flat["label"][t + len(h) : t + n] = y
        flat["weight"][t + len(h) : t + n] = 1.0
        t += n
    assert t == p.num_tokens
    return p, flat, lo


def make_step(cfg: ModelConfig, opt):
    """The jitted training step: ``(params, opt_state, packed, batch) -> (params,
    opt_state, loss, logits)``; the logits are the model's before the update, on users
    it has never seen (every batch is new users): a held-out prediction for free."""

    @jax.jit
    def step(params, opt_state, packed, batch):
        (loss, z), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, packed, batch, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, z

    return step


def make_attention_fwd_bwd(cfg: ModelConfig):
    """A layer's ranker attention op alone (the block's own call), forward + backward."""

    @jax.jit
    def fwd_bwd(q, k, v, bounds):
        out, vjp = jax.vjp(lambda q, k, v: ranker(q, k, v, bounds, cfg), q, k, v)
        return vjp(out)

    return fwd_bwd


def bench(step, params, opt_state, users: Users, shape: dict, cfg: ModelConfig) -> dict:
    """Users per second of the step on packed and on padded rows (the same ``[B, S]``
    and the same compiled step), and the share of the step's time in attention."""
    fwd_bwd = make_attention_fwd_bwd(cfg)
    rng = np.random.default_rng(2)
    result = {}
    for mode in ("packed", "padded"):
        n = shape["bench_steps"]
        t0 = time.perf_counter()
        batches = [make_batch(users, shape, packed=mode == "packed") for _ in range(n + 1)]
        plan_ms = 1e3 * (time.perf_counter() - t0) / (n + 1)
        n_users = sum(u for _, _, u in batches[1:]) / n
        tokens = sum(p.num_tokens for p, _, _ in batches[1:]) / n
        on_device = jax.device_put([(p, f) for p, f, _ in batches])  # time the step alone
        jax.block_until_ready(step(params, opt_state, *on_device[0]))  # warm up
        t0 = time.perf_counter()
        for p, f in on_device[1:]:
            out = step(params, opt_state, p, f)
        jax.block_until_ready(out)
        step_s = (time.perf_counter() - t0) / n
        # the attention op alone at the step's shapes: random q, k, v; this batch's users
        p0 = batches[0][0]
        b, s, dt = p0.rows, p0.seq_len, cfg.attn_dtype
        q, k, v = (
            jnp.asarray(rng.standard_normal((b, s, h, cfg.head_dim)), dt)
            for h in (cfg.q_heads, cfg.kv_heads, cfg.kv_heads)
        )
        bounds = jax.device_put(p0.bounds)
        attn_s = cfg.layers * harness.timed(fwd_bwd, q, k, v, bounds, repeats=n)
        result[mode] = {
            "users_per_step": n_users,
            "step_ms": 1e3 * step_s,
            "users_per_s": n_users / step_s,
            "efficiency": tokens / (p0.rows * p0.seq_len),
            "attention_ms": 1e3 * attn_s,
            "attention_share": attn_s / step_s,
            "host_plan_ms": plan_ms,
        }
    result["speedup"] = result["packed"]["users_per_s"] / result["padded"]["users_per_s"]
    return result


def plot(report: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return "matplotlib not installed: no plot (pip install matplotlib)"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(report["loss"])
    ax1.set(xlabel="step", ylabel="BCE loss", title="training on packed users")
    b = report["bench"]
    modes = ["padded", "packed"]
    ax2.bar(modes, [b[m]["users_per_s"] for m in modes], color=["0.6", "C0"])
    ax2.set(ylabel="users / s", title=f"throughput ({report['backend']}, {report['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def main(argv=None) -> int:
    ap = harness.parser(__doc__, "ranker", "the attention", "ranker.json and ranker.png")
    args = ap.parse_args(argv)
    shape, report = harness.start(args, SHAPES, "ranker_attention")
    cfg = ModelConfig(
        **shape["model"],
        attn_dtype=shape["attn_dtype"],
        implementation=args.implementation,
        interpret=args.interpret,
    )
    users = Users(
        args.seed, cfg.num_items, cfg.num_categories, shape["history"], shape["candidates"]
    )
    opt = optax.adam(shape["lr"])
    params = init_params(args.seed, cfg)
    opt_state = jax.jit(opt.init)(params)
    step = make_step(cfg, opt)
    steps = args.steps or shape["steps"]
    print(
        f"ranker example: {report['backend']} backend on {report['device']}, "
        f"{steps} steps on packed users"
    )

    losses, hits, t0 = [], [], time.perf_counter()
    for i in range(steps):
        packed, batch, n_users = make_batch(users, shape, packed=True)
        params, opt_state, loss, z = step(params, opt_state, packed, batch)
        losses.append(float(loss))
        w = batch["weight"] > 0
        hits.append(np.mean((np.asarray(z)[w] > 0) == (batch["label"][w] > 0.5)))
        if i == 0 or (i + 1) % max(steps // 5, 1) == 0:
            print(
                f"  step {i + 1:4d}  loss {losses[-1]:.4f}  users {n_users:3d}  "
                f"rows {packed.rows}x{packed.seq_len} ({packed.efficiency:.0%} real tokens)"
            )
    train_s = time.perf_counter() - t0
    last = max(steps // 5, 1)
    acc = float(np.mean(hits[-last:]))
    print(
        f"  trained in {train_s:.1f} s (compile included); accuracy on unseen users "
        f"(the last {last} steps, before each update) {acc:.1%}, first step {hits[0]:.1%}"
    )

    result = bench(step, params, opt_state, users, shape, cfg)
    print(f"throughput at [B={shape['rows']}, S={shape['seq_len']}] per step:")
    for mode in ("padded", "packed"):
        r = result[mode]
        print(
            f"  {mode:6s}  {r['users_per_step']:6.1f} users/step  {r['step_ms']:8.2f} ms/step  "
            f"{r['users_per_s']:9.1f} users/s  {r['efficiency']:4.0%} real tokens  "
            f"attention {r['attention_share']:4.0%} of the step  "
            f"(host packing {r['host_plan_ms']:.1f} ms/batch)"
        )
    print(f"  packed / padded users/s: {result['speedup']:.2f}x")
    harness.cpu_timing_note()

    report |= {
        "loss": losses,
        "accuracy": acc,
        "bench": result,
    }
    path = harness.write_report(args.out, "ranker.json", report)
    print(f"wrote {path}; {plot(report, args.out / 'ranker.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
