"""The ranker benchmark suite (docs/design.md#benchmarks): one definition for benchmarks and tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attn_common.cap import CapMethod, CapParams


@dataclasses.dataclass(frozen=True)
class RankerCase:
    """One benchmark shape. ``ragged``: history length per row uniform in [126, 1022]."""

    name: str
    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    history: tuple[int, int]
    candidates: tuple[int, int]
    cap: CapParams
    ragged: bool = False

    def bounds(self, seed: int = 0) -> np.ndarray:
        """int32 ``[batch, 4]`` bounds of the case (deterministic in ``seed``)."""
        if not self.ragged:
            row = np.array([*self.history, *self.candidates], np.int32)
            return np.tile(row, (self.batch, 1))
        num_cand = self.candidates[1] - self.candidates[0]
        hist = np.random.default_rng(seed).integers(126, 1023, size=self.batch)
        return np.stack([np.zeros_like(hist), hist, hist, hist + num_cand], 1).astype(np.int32)

    def inputs(self, seed: int = 0, dtype=jnp.bfloat16) -> tuple[jax.Array, ...]:
        """Random ``(q, k, v, dout)`` of the case's shapes: ``[B, S, Hq, D]`` for q and
        dout, ``[B, S, Hkv, D]`` for k and v; standard normal, deterministic in
        ``seed``."""
        b, s, hq, hkv, d = self.batch, self.seq_len, self.q_heads, self.kv_heads, self.head_dim
        keys = jax.random.split(jax.random.PRNGKey(seed), 4)
        shapes = ((b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d))
        return tuple(
            jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes, strict=True)
        )

    def scaled(self, batch: int) -> RankerCase:
        """The same case with another batch size (tests at reduced size)."""
        return dataclasses.replace(self, batch=batch)


RANKER_SUITE: tuple[RankerCase, ...] = (
    RankerCase(
        "phoenix",
        64,
        1152,
        20,
        4,
        128,
        (0, 1024),
        (1024, 1088),
        CapParams(CapMethod.SOFT_SIGN, 80.0),
    ),
    RankerCase(
        "long", 8, 5120, 16, 16, 128, (0, 4096), (4096, 5120), CapParams(CapMethod.TANH, 30.0)
    ),
    RankerCase("small-d64", 128, 640, 8, 8, 64, (0, 512), (512, 640), CapParams()),
    RankerCase(
        "ragged",
        64,
        1152,
        20,
        4,
        128,
        (0, 0),
        (0, 64),
        CapParams(CapMethod.SOFT_SIGN, 80.0),
        ragged=True,
    ),
)


def ranker_case(name: str) -> RankerCase:
    for case in RANKER_SUITE:
        if case.name == name:
            return case
    raise ValueError(f"case: got {name!r}, expected one of {[c.name for c in RANKER_SUITE]}")
