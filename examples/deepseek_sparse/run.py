"""Train, serve and check a DeepSeek-V3.2-style sparse attention layer (layer.py).

    python examples/deepseek_sparse/run.py --small     # CPU, seconds (the reference backend)
    python examples/deepseek_sparse/run.py             # an H200: DeepSeek V3.2's layer sizes

1. **Train** (optax Adam) on a retrieval task: a sequence first lists key-value pairs
   (one token each, distinct keys), then asks for keys; the answer to a key is its
   value, stored pages back: the main attention has to find the pair's token and the
   indexer has to select its page. As in V3.2, a dense warm-up (every page attended,
   the indexer learning the dense attention's distribution) comes before the sparse
   stage (the top-k pages). Prints the main loss (cross-entropy of the answers), the
   indexer's KL and how often the answer's page is among the indexer's top-k.
2. **Serve** a few requests of different lengths from one paged pool (pages shuffled):
   prefill packs the prompts and fills the pool (``prefill_write_and_attend_ragged``),
   then decode steps feed each request its next question, write its row
   (``paged_write_back``) and attend over the same pool (``sparse_mla_attention``, ragged
   paged mode); the answers are the argmax of the layer's logits.
3. **Check** the serving path: against the same layer in plain XLA (the pool written by
   a scatter, attention by a gather and a masked softmax) and against the training
   forward (flat mode, over each request's whole sequence): outputs within tolerance,
   the indexer's page scores too, the pools equal.
4. **Time** prefill and one decode step, ops against plain XLA (``--no-bench`` skips).
   On a CPU that is a smoke run of the code path, not a measurement.

Writes ``deepseek_sparse.json`` into ``--out``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
except ModuleNotFoundError:  # an example's extra, not a dependency of the wheels
    sys.exit("examples/deepseek_sparse needs optax: pip install optax")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/: harness.py
import harness
import layer as L

SHAPES = {
    "small": dict(
        task=dict(keys=32, values=4, pairs=32, questions=32),  # 64 tokens: 4 pages
        layer=dict(
            d_model=64,
            heads=4,
            q_lora=32,
            kv_lora=32,
            nope=16,
            rope=16,
            v_dim=16,
            idx_heads=4,
            idx_dim=16,
            page_size=16,
            top_k=2,
            dtype="float32",
            query_chunk=64,
        ),
        batch=8,
        steps=40,  # half of them the dense warm-up; --steps 300 learns the task
        lr=1e-2,
        prompts=(40, 35, 50),  # the requests served: prompt lengths ...
        decode=6,  # ... then this many greedy decode steps
        tol=1e-4,  # relative L2 tolerance of the checks (float32)
        bench_repeats=3,
        kernel=dict(  # --implementation mosaic-gpu or pallas-tpu: sizes the kernels take
            layer=dict(kv_lora=128, rope=64, dtype="bfloat16"), tol=2e-2
        ),
    ),
    "full": dict(  # DeepSeek V3.2's attention sizes (one layer)
        task=dict(keys=2048, values=4, pairs=2048, questions=2048),
        layer=dict(
            d_model=7168,
            heads=128,
            q_lora=1536,
            kv_lora=512,
            nope=128,
            rope=64,
            v_dim=128,
            idx_heads=64,
            idx_dim=128,
            page_size=64,
            top_k=32,  # 2048 tokens
            dtype="bfloat16",
            query_chunk=1024,
        ),
        batch=2,
        steps=100,
        lr=1e-4,
        prompts=(8192, 6000, 4096, 3000, 8192, 2048, 5000, 7000),
        decode=16,
        tol=2e-2,  # bf16 caches: the kernels round products to bf16
        bench_repeats=10,
    ),
}


def vocab_size(task: dict) -> int:
    """Pair tokens ``key * values + value``, then one question token per key, then one
    answer token per value."""
    return task["keys"] * task["values"] + task["keys"] + task["values"]


def retrieval_batch(rng, batch: int, task: dict, questions: int | None = None):
    """``(tokens, targets, source)`` ``[B, pairs + questions]``: ``pairs`` pair tokens
    (distinct keys), then questions (random keys among them); a question's target is the
    answer token of its key's value and its source the position of that pair; ``-1``
    (no loss, no source) on the pairs."""
    k, v, n = task["keys"], task["values"], task["pairs"]
    q = task["questions"] if questions is None else questions
    keys = np.stack([rng.permutation(k)[:n] for _ in range(batch)])
    vals = rng.integers(0, v, (batch, n))
    which = rng.integers(0, n, (batch, q))
    asked = np.take_along_axis(keys, which, axis=1)
    answer = np.take_along_axis(vals, which, axis=1)
    tokens = np.concatenate([keys * v + vals, k * v + asked], axis=1).astype(np.int32)
    targets = np.concatenate([np.full((batch, n), -1), k * v + k + answer], axis=1)
    source = np.concatenate([np.full((batch, n), -1), which], axis=1)
    return tokens, targets.astype(np.int32), source


def train(params, shape: dict, cfg: L.LayerConfig, seed: int, steps: int, warmup: int):
    opt = optax.adam(shape["lr"])
    opt_state = jax.jit(opt.init)(params)
    grad_fn = jax.value_and_grad(L.train_loss, has_aux=True)

    @jax.jit
    def step(params, opt_state, tokens, targets, keep):
        (_, (main, kl, indices)), grads = grad_fn(params, tokens, targets, keep, cfg)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, main, kl, indices

    rng = np.random.default_rng(seed)
    task = shape["task"]
    pages = -(-(task["pairs"] + task["questions"]) // cfg.page_size)
    history = []
    for i in range(steps):
        tokens, targets, source = retrieval_batch(rng, shape["batch"], task)
        keep = pages if i < warmup else cfg.top_k  # dense warm-up, then sparse
        if i == warmup:
            print(f"  -- sparse stage: each query attends its top-{cfg.top_k} pages of {pages}")
        params, opt_state, main, kl, indices = step(params, opt_state, tokens, targets, keep)
        # the indexer's recall: questions whose answer's page it selected
        asked = source >= 0
        hit = (np.asarray(indices) == (source // cfg.page_size)[..., None]).any(-1)
        history.append((float(main), float(kl), float(hit[asked].mean())))
        if i == 0 or (i + 1) % max(steps // 5, 1) == 0:
            main, kl, recall = history[-1]
            print(
                f"  step {i + 1:4d}  main loss {main:.4f}  indexer KL {kl:.4f}  "
                f"answer's page in the indexer's top-{cfg.top_k} {recall:.0%}"
            )
    return params, history


# ------------------------------------------------------------------ host-side planning


def plan_pool(prompts, decode: int, cfg: L.LayerConfig, rng) -> dict:
    """The page table: each request gets the pages its prompt and decode steps need,
    physical pages drawn at random from a pool with spares (a page table maps
    request-local pages to them)."""
    p = cfg.page_size
    need = [-(-(n + decode) // p) for n in prompts]
    num_pages = sum(need) + 3  # spare pages: never written, they stay NaN
    page_indices = rng.permutation(num_pages)[: sum(need)].astype(np.int32)
    cu_kv_lens = (np.concatenate([[0], np.cumsum(need)]) * p).astype(np.int32)
    return {
        "num_pages": num_pages,
        "max_pages": max(need),
        "page_indices": page_indices,
        "cu_kv_lens": cu_kv_lens,
    }


def step_tables(plan: dict, start, count, cfg: L.LayerConfig) -> dict:
    """The ragged tables of one packed step: request ``r`` adds ``count[r]`` tokens at
    positions ``start[r] ..``. ``loc``: each token's flat pool slot."""
    p = cfg.page_size
    start, count = np.asarray(start), np.asarray(count)
    sid = np.repeat(np.arange(len(count)), count).astype(np.int32)
    pos = np.concatenate([np.arange(s, s + c) for s, c in zip(start, count, strict=True)])
    pos = pos.astype(np.int32)
    page = plan["page_indices"][plan["cu_kv_lens"][sid] // p + pos // p]
    return {
        "positions": pos,
        "q_seq_id": sid,
        "loc": (page * p + pos % p).astype(np.int32),
        "cu_q_lens": np.concatenate([[0], np.cumsum(count)]).astype(np.int32),
        "seq_lens": (start + count).astype(np.int32),
        "cu_kv_lens": plan["cu_kv_lens"],
        "page_indices": plan["page_indices"],
    }


# --------------------------------------------------------------------------- serving


def jit_step(layer_fn, cfg: L.LayerConfig, max_pages: int):
    """``layer_fn`` (a prefill or decode step of layer.py) jitted, returning each
    request's answer (the argmax of the logits at its last token) instead of ``h``."""

    @jax.jit
    def step(params, tokens, pool, req):
        h, aux, pool = layer_fn(params, tokens, pool, req, cfg, max_pages)
        last = req["cu_q_lens"][1:] - 1
        return jnp.argmax(L.lm_logits(params, h[last]), -1), aux, pool

    return step


def serve(params, seqs, lens, plan, cfg, decode: int, prefill_fn, decode_fn):
    """Prefill request ``r``'s first ``lens[r]`` tokens of ``seqs[r]`` (all requests in one
    packed step), then ``decode`` steps, each feeding every request its next token.
    Returns the steps' outputs, the answers (argmax of the logits at the last prompt
    token and at each decoded token, ``[R, decode + 1]``) and the final pool."""
    pool = L.empty_pool(plan["num_pages"], cfg)
    req = step_tables(plan, np.zeros_like(lens), lens, cfg)
    prompts = np.concatenate([s[:n] for s, n in zip(seqs, lens, strict=True)])
    answer, aux, pool = prefill_fn(params, prompts, pool, req)
    steps, answers = [aux], [np.asarray(answer)]
    for i in range(decode):
        req = step_tables(plan, lens + i, np.ones_like(lens), cfg)
        fed = np.array([s[n + i] for s, n in zip(seqs, lens, strict=True)], np.int32)
        answer, aux, pool = decode_fn(params, fed, pool, req)
        steps.append(aux)
        answers.append(np.asarray(answer))
    return steps, np.stack(answers, axis=1), pool


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(params, seqs, lens, plan, cfg, ops, xla, tol: float) -> dict:
    """The serving path against plain XLA and against the training forward."""
    steps_ops, answers, pool_ops = ops
    steps_xla, answers_xla, pool_xla = xla
    decode = len(steps_ops) - 1
    out = {"tolerance": tol}
    # 1. ops vs the plain-XLA twin: every step's selected pages (two programs may round
    # the indexer's scores apart and break a near-tie differently: the share of queries
    # with the same pages, and the outputs of those), the scores, the pools
    pairs = [jax.tree.map(np.asarray, ab) for ab in zip(steps_ops, steps_xla, strict=True)]
    same = [np.all(a["indices"] == b["indices"], -1) for a, b in pairs]
    out["vs_xla_same_pages"] = float(np.mean(np.concatenate(same)))
    out["vs_xla_output"] = max(
        rel_l2(a["o_latent"][m], b["o_latent"][m]) for (a, b), m in zip(pairs, same, strict=True)
    )
    out["vs_xla_scores"] = max(
        rel_l2(*(np.where(np.isfinite(x["scores"]), x["scores"], 0) for x in ab)) for ab in pairs
    )
    out["vs_xla_same_answers"] = bool(np.array_equal(answers, answers_xla))
    written = step_tables(plan, 0 * lens, lens + decode, cfg)["loc"]

    def rows(cache):  # the rows serving wrote, Dk features (not the lane padding)
        return np.asarray(cache.reshape(-1, cache.shape[-1])[written][:, : cfg.dk], np.float64)

    out["vs_xla_pool"] = rel_l2(rows(pool_ops.cache), rows(pool_xla.cache))
    # 2. paged serving vs the flat training forward over each whole sequence, with the
    # pages serving selected (request-local page ids are the flat unit ids)
    n_req, t_max = len(lens), int(lens.max()) + decode
    tokens = np.zeros((n_req, t_max), np.int32)
    indices = np.full((n_req, t_max, cfg.top_k), -1, np.int32)
    served_o = np.zeros((n_req, t_max, cfg.heads, cfg.kv_lora), np.float32)
    served_s = np.full((n_req, t_max, plan["max_pages"]), -np.inf, np.float32)
    real = np.zeros((n_req, t_max), bool)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    for r, n in enumerate(lens):
        tokens[r, : n + decode] = seqs[r][: n + decode]
        real[r, : n + decode] = True
        for key, dst in (("indices", indices), ("o_latent", served_o), ("scores", served_s)):
            dst[r, :n] = np.asarray(steps_ops[0][key])[offsets[r] : offsets[r + 1]]
            for i, st in enumerate(steps_ops[1:]):
                dst[r, n + i] = np.asarray(st[key])[r]
    flat = jax.jit(lambda p, t, i: L.flat_forward(p, t, cfg, i))
    flat_o, flat_s, _ = flat(params, tokens, indices)
    out["vs_flat_output"] = rel_l2(served_o[real], np.asarray(flat_o)[real])
    pages = min(flat_s.shape[-1], plan["max_pages"])
    a, b = served_s[real][:, :pages], np.asarray(flat_s)[real][:, :pages]
    out["vs_flat_same_valid_pages"] = bool(np.array_equal(np.isfinite(a), np.isfinite(b)))
    out["vs_flat_scores"] = rel_l2(np.where(np.isfinite(a), a, 0), np.where(np.isfinite(b), b, 0))
    out["ok"] = bool(
        out["vs_xla_output"] <= tol
        and out["vs_xla_same_pages"] >= 0.999
        and out["vs_xla_scores"] <= tol
        and out["vs_xla_pool"] <= tol
        and out["vs_flat_output"] <= tol
        and out["vs_flat_same_valid_pages"]
        and out["vs_flat_scores"] <= tol
    )
    return out


def bench(params, seqs, lens, plan, cfg, fns: dict, repeats: int) -> dict:
    """Prefill of every prompt and one decode step (at the prompts' end), ms, ops vs
    plain XLA; the same jitted layer functions the serving run used."""
    pool = L.empty_pool(plan["num_pages"], cfg)
    pre = step_tables(plan, np.zeros_like(lens), lens, cfg)
    dec = step_tables(plan, lens, np.ones_like(lens), cfg)
    tokens = np.concatenate([s[:n] for s, n in zip(seqs, lens, strict=True)])
    fed = np.array([s[n] for s, n in zip(seqs, lens, strict=True)], np.int32)
    _, _, filled = fns["prefill ops"](params, tokens, pool, pre)
    out = {}
    for name in ("ops", "xla"):
        prefill, decode = fns[f"prefill {name}"], fns[f"decode {name}"]
        out[f"prefill {name}"] = 1e3 * harness.timed(
            prefill, params, tokens, pool, pre, repeats=repeats
        )
        out[f"decode {name}"] = 1e3 * harness.timed(
            decode, params, fed, filled, dec, repeats=repeats
        )
    out["prefill speedup"] = out["prefill xla"] / out["prefill ops"]
    out["decode speedup"] = out["decode xla"] / out["decode ops"]
    return out


def main(argv=None) -> int:
    ap = harness.parser(__doc__, "deepseek_sparse", "the ops'", "deepseek_sparse.json")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="of those, dense warm-up steps: every page attended (default: half)",
    )
    ap.add_argument("--no-bench", action="store_true", help="skip the timing")
    args = ap.parse_args(argv)
    shape, report = harness.start(args, SHAPES, "sparse_mla_attention")
    task = shape["task"]
    cfg = L.LayerConfig(
        vocab=vocab_size(task),
        **shape["layer"],
        implementation=args.implementation,
        interpret=args.interpret,
    )
    steps = args.steps if args.steps is not None else shape["steps"]
    print(
        f"deepseek_sparse example: {report['backend']} backend on {report['device']}; "
        f"H {cfg.heads}, latent "
        f"{cfg.kv_lora} + rope {cfg.rope}, pages of {cfg.page_size}, top-{cfg.top_k} pages"
    )
    params = L.init_params(args.seed, cfg)
    length = task["pairs"] + task["questions"]
    print(f"train: {steps} steps, {shape['batch']} x {length} tokens ({task['pairs']} pairs)")
    warmup = args.warmup if args.warmup is not None else steps // 2
    params, history = train(params, shape, cfg, args.seed, steps, warmup)

    rng = np.random.default_rng(args.seed + 1)
    lens = np.array(shape["prompts"])
    decode = shape["decode"]
    questions = int(lens.max()) + decode - task["pairs"]
    seqs, targets, _ = retrieval_batch(rng, len(lens), task, questions)
    plan = plan_pool(lens, decode, cfg, rng)
    mp = plan["max_pages"]
    fns = {
        "prefill ops": jit_step(L.prefill, cfg, mp),
        "decode ops": jit_step(L.decode_step, cfg, mp),
        "prefill xla": jit_step(L.prefill_xla, cfg, mp),
        "decode xla": jit_step(L.decode_step_xla, cfg, mp),
    }
    print(
        f"serve: {len(lens)} requests, prompts {'/'.join(map(str, lens))} tokens, "
        f"{decode} decode steps; a pool of {plan['num_pages']} pages"
    )
    ops = serve(params, seqs, lens, plan, cfg, decode, fns["prefill ops"], fns["decode ops"])
    xla = serve(params, seqs, lens, plan, cfg, decode, fns["prefill xla"], fns["decode xla"])
    # the answers due at the last prompt token and at each decoded token
    want = np.stack([t[n - 1 : n + decode] for t, n in zip(targets, lens, strict=True)])
    asked = want >= 0
    answered = float(np.mean(ops[1][asked] == want[asked]))
    print(
        f"  answers right: {answered:.0%} of {int(asked.sum())} questions "
        f"(chance {1 / task['values']:.0%})"
    )
    result = check(params, seqs, lens, plan, cfg, ops, xla, shape["tol"])
    print(
        f"check: ops vs plain XLA rel L2 {result['vs_xla_output']:.1e} (the same pages for "
        f"{result['vs_xla_same_pages']:.1%} of the queries, pool "
        f"{result['vs_xla_pool']:.1e}); paged serving vs the flat training forward "
        f"{result['vs_flat_output']:.1e}, indexer scores {result['vs_flat_scores']:.1e}; "
        f"tolerance {result['tolerance']:g}: {'ok' if result['ok'] else 'FAILED'}"
    )
    timing = None
    if not args.no_bench:
        timing = bench(params, seqs, lens, plan, cfg, fns, shape["bench_repeats"])
        print(
            f"time: prefill {timing['prefill ops']:.2f} ms (plain XLA "
            f"{timing['prefill xla']:.2f} ms: {timing['prefill speedup']:.2f}x); decode step "
            f"{timing['decode ops']:.2f} ms (plain XLA {timing['decode xla']:.2f} ms: "
            f"{timing['decode speedup']:.2f}x)"
        )
        harness.cpu_timing_note()
    report |= {
        "config": dataclasses.asdict(cfg),
        "train": {
            "main_loss": [h[0] for h in history],
            "indexer_kl": [h[1] for h in history],
            "indexer_recall": [h[2] for h in history],
        },
        "answered": answered,
        "check": result,
        "time_ms": timing,
    }
    print(f"wrote {harness.write_report(args.out, 'deepseek_sparse.json', report)}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
