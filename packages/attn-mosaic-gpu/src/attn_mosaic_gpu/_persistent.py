"""The tile walk of the persistent Hopper ranker kernels (forward, dq).

``N`` programs walk the tiles of the per-tile grid ``(heads, tiles, batch)``, head
fastest (the per-tile grid itself launches batch fastest: Pallas maps its last axis to
CUDA's x; docs/ranker_gpu.md measured the order): program ``p`` takes tiles ``p, p + N,
...``. Its memory warpgroup keeps one K/V ring running across its tiles: step ``i`` of a
tile whose program walked ``base`` steps before it uses ring slot ``(base + i) %
num_slots``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def program_tiles(program: jax.Array, programs: int, num_tiles: int) -> jax.Array:
    """How many tiles ``program`` walks (none when ``program >= num_tiles``)."""
    return lax.div(jnp.maximum(num_tiles - program, 0) + (programs - 1), jnp.int32(programs))


def tile_coords(program, j, *, programs: int, heads: int, tiles: int):
    """``(head, tile, batch)`` of ``program``'s local tile ``j``."""
    index = program + j * programs
    head = lax.rem(index, jnp.int32(heads))
    tile = lax.rem(lax.div(index, jnp.int32(heads)), jnp.int32(tiles))
    batch = lax.div(index, jnp.int32(heads * tiles))
    return head, tile, batch


def ring_walk(my_tiles, num_slots: int, tile_steps: Callable) -> jax.Array:
    """The memory warpgroup's walk over its ``my_tiles`` tiles; the total steps walked.

    ``tile_steps(j)`` gives local tile ``j``'s ``(steps, issue)``; ``issue(i, step,
    slot)`` loads the tile's step ``i`` (the program's ``step``-th) into ring ``slot``,
    first waiting for the slot's previous step to be consumed when ``step >=
    num_slots``.
    """

    def walk(j, base):
        steps, issue = tile_steps(j)

        @pl.loop(0, steps)
        def _issue(i):
            step = base + i
            issue(i, step, lax.rem(step, jnp.int32(num_slots)))

        return base + steps

    return lax.fori_loop(0, my_tiles, walk, jnp.int32(0))
