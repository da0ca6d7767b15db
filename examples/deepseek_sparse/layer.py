"""A DeepSeek-V3.2-style sparse attention layer built on the attn_common ops (plain JAX).

The pieces, as in DeepSeek V3.2 (DSA), at any size:

* **MLA with absorbed projections.** Keys and values of every head come from one
  latent ``c_kv [r]`` per token plus a shared rope key ``k_rope``; the cache holds the
  row ``[c_kv | k_rope]`` (``Dk = r + rope``). A head's key up-projection is absorbed
  into its query (``ql = W_uk^T q_nope``, ``[H, r]``) and its value up-projection is
  applied after attention (``o = o_latent W_uv``), so attention runs on the latent
  rows directly: ``sparse_mla_attention`` / ``prefill_write_and_attend_ragged``.
* **The lightning indexer.** Its own small heads: ``I[t, s] = sum_j w[t, j]
  ReLU(q_I[t, j] . k_I[s])`` over the causal past, its queries from the query latent,
  one shared key per token (cached beside the latent), rope on half of each. The ops
  read the cache in units of one page (``read_block == page_size`` in ragged paged
  mode), so a page scores the max of its tokens and each query keeps the ``top_k``
  pages (V3.2 keeps tokens: 2048 tokens = 32 pages of 64 here).
* **Training.** The main loss (next-token cross-entropy) trains everything but the
  indexer; the indexer is trained by the KL divergence from the main attention's mass on
  the selected pages (``return_attn_mass=True``) to its own distribution over them,
  on detached inputs (V3.2's sparse stage).
* **Serving.** The latent cache is a paged pool. Prefill runs
  ``prefill_write_and_attend_ragged`` (write the prompt's rows, then attend); each decode
  step writes the new tokens' rows (``paged_write_back``) and runs
  ``sparse_mla_attention`` in ragged paged mode over the same pool.
* **The plain-XLA twin** of the serving path (``*_xla``: a scatter, a gather of the
  selected pages and a masked softmax), for the checks and for timing against.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import (
    kv_packing,
    padded_dk,
    paged_write_back,
    prefill_write_and_attend_ragged,
    sparse_mla_attention,
)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    vocab: int
    d_model: int
    heads: int
    q_lora: int  # the query latent
    kv_lora: int  # r: the cached latent, and the attention's value width
    nope: int  # per-head query/key features without rope
    rope: int  # rope features (the shared rope key)
    v_dim: int  # per-head value features after W_uv
    idx_heads: int
    idx_dim: int
    page_size: int
    top_k: int  # pages each query keeps
    dtype: str = "float32"  # the cache's dtype (the ops' compute dtype); kernels: bfloat16
    query_chunk: int = 1024  # queries per chunk in the indexer and the XLA twin (memory)
    implementation: str | None = None  # None: the best installed backend
    interpret: bool = False

    @property
    def dk(self) -> int:
        return self.kv_lora + self.rope

    @property
    def sm_scale(self) -> float:
        return (self.nope + self.rope) ** -0.5  # 1/sqrt of the original q/k head dim

    @property
    def ops(self) -> dict:
        return {"implementation": self.implementation, "interpret": self.interpret}

    @property
    def attend(self) -> dict:
        """The keywords of every ``sparse_mla_attention`` call: scale, latent width, one
        page per selected unit, and the ops' backend."""
        return dict(
            sm_scale=self.sm_scale, kv_lora_rank=self.kv_lora, read_block=self.page_size, **self.ops
        )


def init_params(seed: int, cfg: LayerConfig) -> dict:
    rng = np.random.default_rng(seed)

    def w(fan_in, *shape):
        return (rng.standard_normal(shape) * fan_in**-0.5).astype(np.float32)

    d, h = cfg.d_model, cfg.heads
    return jax.device_put(
        {
            "embed": w(d, cfg.vocab, d),  # rows of norm ~1: tied logits start near 0
            "w_dq": w(d, d, cfg.q_lora),
            "q_norm": np.ones(cfg.q_lora, np.float32),
            "w_uq": w(cfg.q_lora, cfg.q_lora, h, cfg.nope),
            "w_qr": w(cfg.q_lora, cfg.q_lora, h, cfg.rope),
            "w_dkv": w(d, d, cfg.kv_lora),
            "kv_norm": np.ones(cfg.kv_lora, np.float32),
            "w_kr": w(d, d, cfg.rope),
            "w_uk": w(cfg.nope, h, cfg.nope, cfg.kv_lora),  # k_nope[h] = W_uk[h] c_kv
            "w_uv": w(cfg.kv_lora, h, cfg.kv_lora, cfg.v_dim),  # v[h] = c_kv W_uv[h]
            "w_o": w(h * cfg.v_dim, h * cfg.v_dim, d),
            "out_norm": np.ones(d, np.float32),
            "indexer": {
                "w_q": w(cfg.q_lora, cfg.q_lora, cfg.idx_heads, cfg.idx_dim),
                "w_k": w(d, d, cfg.idx_dim),
                "w_w": w(d, d, cfg.idx_heads),
            },
        }
    )


def rms_norm(x, gain):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain


def apply_rope(x, positions):
    """Rotary embedding on the last axis (halves rotated); ``positions`` broadcast
    against ``x``'s leading axes (one per token)."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None] * freq
    while angle.ndim < x.ndim:  # [..., T, half] -> [..., T, 1, half] for head axes
        angle = angle[..., None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Projections(NamedTuple):
    ql: jax.Array  # [..., H, r]   absorbed latent query
    qpe: jax.Array  # [..., H, rope]
    kvc: jax.Array  # [..., r]     the cached latent
    kpe: jax.Array  # [..., rope]  the cached rope key
    q_idx: jax.Array  # [..., HI, dI] indexer queries
    w_idx: jax.Array  # [..., HI]     indexer head weights
    k_idx: jax.Array  # [..., dI]     indexer key (cached beside the latent)


def project(params, x, positions, cfg: LayerConfig) -> Projections:
    """Token features ``x [..., d]`` at ``positions [...]`` -> the layer's projections."""
    c_q = rms_norm(x @ params["w_dq"], params["q_norm"])
    q_nope = jnp.einsum("...c,chn->...hn", c_q, params["w_uq"])
    ql = jnp.einsum("...hn,hnr->...hr", q_nope, params["w_uk"])  # W_uk absorbed
    qpe = apply_rope(jnp.einsum("...c,chp->...hp", c_q, params["w_qr"]), positions)
    kvc = rms_norm(x @ params["w_dkv"], params["kv_norm"])
    kpe = apply_rope(x @ params["w_kr"], positions)
    # The indexer reads detached inputs: its KL loss trains it alone (V3.2).
    idx = params["indexer"]
    c_q_d, x_d = jax.lax.stop_gradient(c_q), jax.lax.stop_gradient(x)
    q_idx = jnp.einsum("...c,chi->...hi", c_q_d, idx["w_q"])
    half = cfg.idx_dim // 2
    q_idx = jnp.concatenate([apply_rope(q_idx[..., :half], positions), q_idx[..., half:]], -1)
    k_idx = x_d @ idx["w_k"]
    k_idx = jnp.concatenate([apply_rope(k_idx[..., :half], positions), k_idx[..., half:]], -1)
    w_idx = (x_d @ idx["w_w"]) * (cfg.idx_heads * cfg.idx_dim) ** -0.5
    return Projections(ql, qpe, kvc, kpe, q_idx, w_idx, k_idx)


def output(params, x, o_latent):
    """``o_latent [..., H, r]`` -> the layer's residual output ``[..., d]`` (W_uv, W_o)."""
    o = jnp.einsum("...hr,hrv->...hv", o_latent, params["w_uv"])
    return x + o.reshape(*o.shape[:-2], -1) @ params["w_o"]


def lm_logits(params, h):
    return rms_norm(h, params["out_norm"]) @ params["embed"].T  # tied embedding


# ----------------------------------------------------------------------------- indexer


def _token_scores(q_idx, w_idx, keys):
    """``q_idx [..., HI, dI]``, ``w_idx [..., HI]``, ``keys [..., N, dI]`` -> ``[..., N]``:
    ``sum_j w_j ReLU(q_j . k)``."""
    dots = jnp.einsum("...hi,...ni->...hn", q_idx, keys)
    return jnp.einsum("...hn,...h->...n", jax.nn.relu(dots), w_idx)


def _chunked(fn, chunk: int, *xs):
    """``fn`` over the leading axis of ``xs`` in chunks of ``chunk`` (``lax.map``), so
    the indexer and the XLA twin hold one chunk's scores at a time."""
    n = xs[0].shape[0]
    if n <= chunk:
        return fn(*xs)
    pad = -n % chunk
    xs = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in xs]
    xs = [x.reshape(-1, chunk, *x.shape[1:]) for x in xs]
    out = jax.lax.map(lambda a: fn(*a), xs)
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[:n], out)


def top_pages(page_scores, top_k: int):
    """The ``top_k`` best pages (``-1`` where fewer are valid; scores ``-inf`` = invalid)."""
    k = min(top_k, page_scores.shape[-1])
    best, idx = jax.lax.top_k(page_scores, k)
    idx = jnp.where(jnp.isfinite(best), idx, -1).astype(jnp.int32)
    if k < top_k:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, top_k - k)], constant_values=-1)
    return jax.lax.stop_gradient(idx)


def flat_page_scores(pr: Projections, positions, cfg: LayerConfig):
    """Indexer page scores of a flat batch: ``[B, S, num_pages]`` (``-inf``: no token of
    the page at or before the query). Keys are the batch row's own tokens."""
    t = pr.k_idx.shape[1]
    pages = -(-t // cfg.page_size)
    keys = jnp.pad(pr.k_idx, ((0, 0), (0, pages * cfg.page_size - t), (0, 0)))
    key_pos = jnp.arange(pages * cfg.page_size).reshape(pages, cfg.page_size)

    def one_row(q_idx, w_idx, keys, pos):  # one batch row, its queries chunked
        def chunk(q_idx, w_idx, pos):
            s = _token_scores(q_idx, w_idx, keys)  # [c, pages * P]
            s = s.reshape(*s.shape[:-1], pages, cfg.page_size)
            ok = (key_pos <= pos[:, None, None]) & (key_pos < t)
            return jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1)

        return _chunked(chunk, cfg.query_chunk, q_idx, w_idx, pos)

    return jax.vmap(one_row)(pr.q_idx, pr.w_idx, keys, positions)


def paged_page_scores(q_idx, w_idx, idx_pool, req: dict, positions, q_seq_id, cfg, max_pages):
    """Indexer page scores of packed queries over their requests' pages in the paged
    indexer-key pool ``[num_pages, P, dI]``: ``[S, max_pages]`` by request-local page
    (``-inf`` past the request, its length or the query's position)."""
    p = cfg.page_size
    base = req["cu_kv_lens"][q_seq_id] // p
    n_pages = req["cu_kv_lens"][q_seq_id + 1] // p - base
    kv_len = req["seq_lens"][q_seq_id]
    local = jnp.arange(max_pages)
    key_pos = (local[:, None] * p + jnp.arange(p)).astype(jnp.int32)  # [max_pages, P]

    def chunk(q_idx, w_idx, base, n_pages, kv_len, pos):
        slot = jnp.clip(base[:, None] + local, 0, req["page_indices"].shape[0] - 1)
        keys = idx_pool[jnp.maximum(req["page_indices"][slot], 0)]  # [c, max_pages, P, dI]
        s = _token_scores(q_idx, w_idx, keys.reshape(keys.shape[0], -1, keys.shape[-1]))
        s = s.reshape(-1, max_pages, p)
        ok = (
            (local[None, :, None] < n_pages[:, None, None])
            & (key_pos <= pos[:, None, None])
            & (key_pos < kv_len[:, None, None])
        )
        return jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1)

    return _chunked(chunk, cfg.query_chunk, q_idx, w_idx, base, n_pages, kv_len, positions)


# ---------------------------------------------------------------------------- training


def _flat_inputs(params, tokens, cfg: LayerConfig):
    """A flat batch ``tokens [B, T]`` (token ``t`` at position ``t``): ``(positions,
    x, projections, the indexer's page scores [B, T, pages])``."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = params["embed"][tokens]
    pr = project(params, x, positions, cfg)
    return positions, x, pr, flat_page_scores(pr, positions, cfg)


def _flat_attend(pr: Projections, indices, positions, cfg: LayerConfig, **extra):
    """``sparse_mla_attention`` in flat mode over the batch's own latents: queries
    ``[B, T, H, Dk]``, rows ``[B, T, Dk]``, the pages ``indices [B, T, K]``."""
    dt = jnp.dtype(cfg.dtype)
    q = jnp.concatenate([pr.ql, pr.qpe], axis=-1).astype(dt)
    kv = jnp.concatenate([pr.kvc, pr.kpe], axis=-1).astype(dt)
    return sparse_mla_attention(q, kv, indices, positions, **cfg.attend, **extra)


def train_loss(params, tokens, targets, keep, cfg: LayerConfig):
    """Cross-entropy of a flat batch ``tokens [B, T]`` against ``targets [B, T]`` (``-1``:
    no loss there) plus the indexer's KL; each query attends its ``keep`` best pages.

    ``keep`` is data (one compile): the number of pages (``T / page_size``) for V3.2's
    dense warm-up (every page attended, the indexer learns the dense attention's
    distribution), ``cfg.top_k`` for the sparse stage. The selection slots past ``keep``
    are ``-1`` (none).

    Returns ``(main + kl, (main, kl, ranked))``, ``ranked [B, T, top_k]`` the indexer's
    best pages. The main loss trains everything but the indexer; the KL (from the
    attention mass, ``stop_gradient``, to the indexer's distribution over the selected
    pages) trains the indexer alone.
    """
    positions, x, pr, scores = _flat_inputs(params, tokens, cfg)  # scores [B, T, pages]
    ranked = top_pages(scores, scores.shape[-1])  # every page, best first; -1 = invalid
    slots = jnp.arange(ranked.shape[-1])
    indices = jnp.where(slots < keep, ranked, -1)  # [B, T, pages]
    o_lat, _, mass = _flat_attend(
        pr, indices, positions, cfg, return_lse=True, return_attn_mass=True
    )
    h = output(params, x, o_lat)
    logits = lm_logits(params, h)
    nll = jax.nn.logsumexp(logits, -1)
    nll -= jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], -1)[..., 0]
    scored = targets >= 0
    main = jnp.sum(jnp.where(scored, nll, 0.0)) / jnp.maximum(jnp.sum(scored), 1)
    # KL(mass || softmax(indexer scores of the selected pages)), per query with a key.
    sel = jnp.take_along_axis(scores, jnp.maximum(indices, 0), axis=-1)
    sel = jnp.where(indices >= 0, sel, -jnp.inf)
    log_q = jax.nn.log_softmax(sel, axis=-1)
    has = mass > 0  # a selected page (a -1 slot has mass 0)
    log_ratio = jnp.log(jnp.where(has, mass, 1.0)) - jnp.where(has, log_q, 0.0)
    kl_q = jnp.sum(jnp.where(has, mass * log_ratio, 0.0), -1)
    seen = jnp.sum(mass, -1) > 0
    kl = jnp.sum(jnp.where(seen, kl_q, 0.0)) / jnp.maximum(jnp.sum(seen), 1)
    return main + kl, (main, kl, ranked[..., : cfg.top_k])


def flat_forward(params, tokens, cfg: LayerConfig, indices=None):
    """The layer on a flat batch ``tokens [B, T]``: ``(o_latent [B, T, H, r], page
    scores, indices)``; ``indices`` given: use them instead of the indexer's."""
    positions, _, pr, scores = _flat_inputs(params, tokens, cfg)
    if indices is None:
        indices = top_pages(scores, cfg.top_k)
    return _flat_attend(pr, indices, positions, cfg), scores, indices


# ----------------------------------------------------------------------------- serving


class Pool(NamedTuple):
    """The paged pools: the latent cache ``[num_pages, P // pk, pk, Dk_pad]`` (the ops'
    layout) and the indexer keys ``[num_pages, P, dI]``, under one page table."""

    cache: jax.Array
    idx_keys: jax.Array


def empty_pool(num_pages: int, cfg: LayerConfig, fill=jnp.nan) -> Pool:
    """Pages never written hold ``fill`` (NaN by default: rows no query attends may
    hold anything, and neither the ops nor the XLA twin let them reach a result)."""
    dt = jnp.dtype(cfg.dtype)
    pk = kv_packing(dt)
    cache = jnp.full((num_pages, cfg.page_size // pk, pk, padded_dk(cfg.dk)), fill, dt)
    idx_keys = jnp.full((num_pages, cfg.page_size, cfg.idx_dim), fill, jnp.float32)
    return Pool(cache, idx_keys)


def _write_idx_keys(idx_keys, k_idx, loc):
    flat = idx_keys.reshape(-1, idx_keys.shape[-1])
    return flat.at[loc].set(k_idx, mode="drop").reshape(idx_keys.shape)


def _select(pr: Projections, idx_keys, req: dict, cfg: LayerConfig, max_pages: int):
    """The indexer over the pool: page scores ``[T, max_pages]`` and the top pages."""
    scores = paged_page_scores(
        pr.q_idx, pr.w_idx, idx_keys, req, req["positions"], req["q_seq_id"], cfg, max_pages
    )
    return scores, top_pages(scores, cfg.top_k)


def prefill(params, tokens, pool: Pool, req: dict, cfg: LayerConfig, max_pages: int):
    """Prefill a packed ragged batch with the ops: ``tokens [T]`` of every request back to
    back (``req``: ``positions``, ``q_seq_id``, ``loc``, ``cu_q_lens``, ``seq_lens`` after
    the prompt, ``cu_kv_lens``, ``page_indices``). Writes the prompt's latent rows with
    ``prefill_write_and_attend_ragged``, which then attends. Returns ``(h [T, d], aux,
    new pool)``, ``aux``: ``o_latent [T, H, r]``, page ``scores [T, max_pages]`` and the
    selected ``indices [T, K]``."""
    x = params["embed"][tokens]
    pr = project(params, x, req["positions"], cfg)
    idx_keys = _write_idx_keys(pool.idx_keys, pr.k_idx, req["loc"])
    scores, indices = _select(pr, idx_keys, req, cfg, max_pages)
    dt = jnp.dtype(cfg.dtype)
    o_lat, cache = prefill_write_and_attend_ragged(
        pr.ql.astype(dt),
        pr.qpe.astype(dt),
        pr.kvc.astype(dt),
        pr.kpe.astype(dt),
        pool.cache,
        indices,
        req["positions"],
        req["loc"],
        req["seq_lens"],
        req["cu_q_lens"],
        req["cu_kv_lens"],
        req["page_indices"],
        kv_lora_rank=cfg.kv_lora,
        page_size=cfg.page_size,
        sm_scale=cfg.sm_scale,
        **cfg.ops,
    )
    aux = {"o_latent": o_lat, "scores": scores, "indices": indices}
    return output(params, x, o_lat), aux, Pool(cache, idx_keys)


def attend_pool(pr: Projections, pool: Pool, indices, req: dict, cfg: LayerConfig):
    """``sparse_mla_attention`` in ragged paged mode over the pool: ``[T, H, r]``."""
    dt = jnp.dtype(cfg.dtype)
    q = jnp.concatenate([pr.ql, pr.qpe], axis=-1).astype(dt)[None]
    return sparse_mla_attention(
        q,
        pool.cache,
        indices[None],
        req["positions"][None],
        **cfg.attend,
        page_size=cfg.page_size,
        q_seq_id=req["q_seq_id"],
        seq_lens=req["seq_lens"],
        cu_kv_lens=req["cu_kv_lens"],
        page_indices=req["page_indices"],
    )[0]


def decode_step(params, tokens, pool: Pool, req: dict, cfg: LayerConfig, max_pages: int):
    """One decode step, one new token per request (``tokens [R]``; ``req`` as in
    ``prefill`` for these tokens, ``seq_lens`` counting them): write their latent rows
    (``paged_write_back``), select pages, then ``sparse_mla_attention`` over the pool.
    Returns ``(h [R, d], aux, new pool)`` as ``prefill``."""
    x = params["embed"][tokens]
    pr = project(params, x, req["positions"], cfg)
    idx_keys = _write_idx_keys(pool.idx_keys, pr.k_idx, req["loc"])
    rows = jnp.concatenate([pr.kvc, pr.kpe], axis=-1)
    rows = jnp.pad(rows, ((0, 0), (0, padded_dk(cfg.dk) - cfg.dk)))
    cache = paged_write_back(pool.cache, rows, req["loc"], page_size=cfg.page_size, **cfg.ops)
    pool = Pool(cache, idx_keys)
    scores, indices = _select(pr, idx_keys, req, cfg, max_pages)
    o_lat = attend_pool(pr, pool, indices, req, cfg)
    aux = {"o_latent": o_lat, "scores": scores, "indices": indices}
    return output(params, x, o_lat), aux, pool


# ------------------------------------------------------------------- the plain-XLA twin


def attend_xla(pr: Projections, cache, indices, req: dict, cfg: LayerConfig):
    """Sparse MLA over the paged pool in plain XLA: gather each query's selected pages
    (``[K * P, Dk]`` rows), mask (page valid for the request, key at or before the
    query and inside the request), softmax, the value product. Queries in chunks.
    Our indexer never repeats a page, so selections need no de-duplication here."""
    p, r = cfg.page_size, cfg.kv_lora
    dt = jnp.dtype(cfg.dtype)
    rows_of = cache.reshape(-1, cache.shape[-1])  # flat slot -> row
    q = jnp.concatenate([pr.ql, pr.qpe], axis=-1).astype(dt)
    sid = req["q_seq_id"]
    base = req["cu_kv_lens"][sid] // p
    n_pages = req["cu_kv_lens"][sid + 1] // p - base
    kv_len = req["seq_lens"][sid]

    def chunk(q, indices, base, n_pages, kv_len, pos):
        ok_page = (indices >= 0) & (indices < n_pages[:, None])  # [c, K]
        slot = jnp.clip(base[:, None] + indices, 0, req["page_indices"].shape[0] - 1)
        page = jnp.where(ok_page, req["page_indices"][slot], 0)
        tok = jnp.arange(p)
        keys = rows_of[page[:, :, None] * p + tok][..., : cfg.dk]  # [c, K, P, Dk]
        key_pos = indices[:, :, None] * p + tok
        ok = (
            ok_page[:, :, None]
            & (key_pos <= pos[:, None, None])
            & (key_pos < kv_len[:, None, None])
        )
        keys = jnp.where(ok[..., None], keys, 0).reshape(keys.shape[0], -1, cfg.dk)
        ok = ok.reshape(ok.shape[0], -1)
        s = jnp.einsum("chd,cnd->chn", q, keys, preferred_element_type=jnp.float32)
        s = jnp.where(ok[:, None], s * cfg.sm_scale, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(e, axis=-1, keepdims=True)
        pr_ = (e / jnp.where(denom > 0, denom, 1.0)).astype(dt)
        return jnp.einsum("chn,cnr->chr", pr_, keys[..., :r], preferred_element_type=jnp.float32)

    return _chunked(chunk, cfg.query_chunk, q, indices, base, n_pages, kv_len, req["positions"])


def _write_xla(cache, pr: Projections, loc, cfg: LayerConfig):
    rows = jnp.concatenate([pr.kvc, pr.kpe], axis=-1).astype(cache.dtype)
    rows = jnp.pad(rows, ((0, 0), (0, cache.shape[-1] - cfg.dk)))
    flat = cache.reshape(-1, cache.shape[-1])
    return flat.at[loc].set(rows, mode="drop").reshape(cache.shape)


def prefill_xla(params, tokens, pool: Pool, req: dict, cfg: LayerConfig, max_pages: int):
    """``prefill`` with the attention and the write in plain XLA (the same layer)."""
    x = params["embed"][tokens]
    pr = project(params, x, req["positions"], cfg)
    idx_keys = _write_idx_keys(pool.idx_keys, pr.k_idx, req["loc"])
    scores, indices = _select(pr, idx_keys, req, cfg, max_pages)
    cache = _write_xla(pool.cache, pr, req["loc"], cfg)
    o_lat = attend_xla(pr, cache, indices, req, cfg)
    aux = {"o_latent": o_lat, "scores": scores, "indices": indices}
    return output(params, x, o_lat), aux, Pool(cache, idx_keys)


def decode_step_xla(params, tokens, pool: Pool, req: dict, cfg: LayerConfig, max_pages: int):
    """``decode_step`` with the attention and the write in plain XLA."""
    return prefill_xla(params, tokens, pool, req, cfg, max_pages)
