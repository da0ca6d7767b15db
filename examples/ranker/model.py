"""A phoenix-style generative-recommender ranker on packed users (plain JAX + attn_common).

Each user is one sequence ``[history | candidates]`` of item tokens. A block is
pre-norm attention (``attn_common.ranker_attention``: history tokens attend the whole
history, each candidate the history and itself, a soft cap on the logits, GQA) followed
by a SiLU MLP; after the blocks a head scores every candidate (will the user engage?).

Users of very different lengths are packed several to a row (``attn_common.pack_users``):
the token features live in one flat per-user array ``[F, ...]``; inside the jitted step
``PackedUsers.gather`` moves them into packed rows ``[B, S, ...]`` for the blocks and
``PackedUsers.scatter`` brings the blocks' output back to the flat order for the head and
the loss, so the embedding lookup and the loss never see padding, and the gradient
flows back through both moves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import CapMethod, CapParams, PackedUsers, ranker_attention

PHOENIX_CAP = CapParams(CapMethod.SOFT_SIGN, 80.0)  # phoenix's soft cap on the logits


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_items: int
    num_categories: int  # an item feature: item i is in category i % num_categories
    d_model: int
    q_heads: int
    kv_heads: int  # GQA: q_heads // kv_heads query heads share a key/value head
    head_dim: int
    layers: int
    mlp: int
    cap: CapParams = PHOENIX_CAP
    attn_dtype: str = "float32"  # the kernels want bfloat16 (Hopper, TPU)
    implementation: str | None = None  # None: the best installed backend
    interpret: bool = False  # run a Pallas kernel backend in interpret mode (CPU)


def init_params(seed: int, cfg: ModelConfig) -> dict:
    """Random parameters (numpy's generator: no compile on the host, then one transfer)."""
    rng = np.random.default_rng(seed)

    def dense(fan_in, shape, scale=1.0):
        return (rng.standard_normal(shape) * scale * fan_in**-0.5).astype(np.float32)

    def table(shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    d, hq, hkv, dh = cfg.d_model, cfg.q_heads, cfg.kv_heads, cfg.head_dim
    ones = np.ones(d, np.float32)
    layers = [
        {
            "norm1": ones,
            "wq": dense(d, (d, hq * dh)),
            "wk": dense(d, (d, hkv * dh)),
            "wv": dense(d, (d, hkv * dh)),
            "wo": dense(hq * dh, (hq * dh, d), 0.5),
            "norm2": ones,
            "w1": dense(d, (d, cfg.mlp)),
            "w2": dense(cfg.mlp, (cfg.mlp, d), 0.5),
        }
        for _ in range(cfg.layers)
    ]
    params = {
        "items": table((cfg.num_items, d)),
        "categories": table((cfg.num_categories, d)),
        "segment": table((2, d)),  # 0 history, 1 candidate
        "layers": layers,
        "head": {"norm": ones, "w": dense(d, (d,)), "b": np.zeros((), np.float32)},
    }
    return jax.device_put(params)


def rms_norm(x, gain):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * gain


def attention(layer, h, bounds, cfg: ModelConfig):
    """The block's attention on packed rows ``h [B, S, d]``: q/k/v projections, the
    ranker mask of the packed users (``bounds [B, U, 4]``), soft cap, GQA."""
    b, s, _ = h.shape
    dt = jnp.dtype(cfg.attn_dtype)
    q = (h @ layer["wq"]).reshape(b, s, cfg.q_heads, cfg.head_dim).astype(dt)
    k = (h @ layer["wk"]).reshape(b, s, cfg.kv_heads, cfg.head_dim).astype(dt)
    v = (h @ layer["wv"]).reshape(b, s, cfg.kv_heads, cfg.head_dim).astype(dt)
    out = ranker(q, k, v, bounds, cfg)
    return out.astype(jnp.float32).reshape(b, s, -1) @ layer["wo"]


def ranker(q, k, v, bounds, cfg: ModelConfig):
    """The attention op itself (what ``train.py`` times alone for the attention share)."""
    return ranker_attention(
        q, k, v, bounds, cap=cfg.cap, implementation=cfg.implementation, interpret=cfg.interpret
    )


def block(layer, x, bounds, cfg: ModelConfig):
    x = x + attention(layer, rms_norm(x, layer["norm1"]), bounds, cfg)
    h = rms_norm(x, layer["norm2"])
    return x + jax.nn.silu(h @ layer["w1"]) @ layer["w2"]


def logits(params, packed: PackedUsers, batch: dict, cfg: ModelConfig):
    """Flat per-user tokens (``batch["items"]``, ``batch["is_candidate"]`` ``[F]``) ->
    one logit per flat token ``[F]`` (only the candidates' are trained)."""
    items = batch["items"]
    x = (  # token features, flat [F, d]
        params["items"][items]
        + params["categories"][items % cfg.num_categories]
        + params["segment"][batch["is_candidate"]]
    )
    rows = packed.gather(x)  # [B, S, d]; padding positions are 0
    for layer in params["layers"]:
        rows = block(layer, rows, packed.bounds, cfg)
    y = packed.scatter(rows)  # [F, d], back in per-user order
    head = params["head"]
    return rms_norm(y, head["norm"]) @ head["w"] + head["b"]


def loss_fn(params, packed: PackedUsers, batch: dict, cfg: ModelConfig):
    """Binary cross-entropy over the real candidates (``batch["weight"]`` 1, else 0);
    returns ``(loss, logits [F])``."""
    z = logits(params, packed, batch, cfg)
    per_token = jnp.logaddexp(0.0, z) - batch["label"] * z  # -log sigmoid(+-z)
    w = batch["weight"]
    return jnp.sum(per_token * w) / jnp.maximum(jnp.sum(w), 1.0), z
