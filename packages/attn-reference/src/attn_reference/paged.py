"""Reference paged KV write and the ragged write-then-attend wrapper (docs/design.md).

``paged_write_back`` is the scatter the TPU kernel must match bit for bit;
``prefill_write_and_attend_ragged`` writes the new tokens' latents into the paged
cache and then runs ragged sparse MLA attention over it.
"""

from __future__ import annotations

import jax

from attn_common.paged import write_back_by_scatter, write_then_attend
from attn_common.spec import PrefillCall, WriteBackCall, prefill_call, public_op, write_back_call
from attn_reference.sparse_mla import sparse_mla_attention


@public_op(write_back_call)
def paged_write_back(call: WriteBackCall) -> jax.Array:
    """``cache[loc[t]] = rows[t]`` for every ``loc[t] >= 0`` (reference: one XLA scatter).

    ``r_cap`` (the TPU kernel's run table) and ``interpret`` are accepted and ignored.
    """
    return write_back_by_scatter(call)


@public_op(prefill_call)
def prefill_write_and_attend_ragged(call: PrefillCall) -> tuple[jax.Array, jax.Array]:
    """Write the new tokens' latents into the paged cache, then attend (reference).

    ``query_block`` / ``u_max`` are accepted so the ``_qblock`` twin is a drop-in.
    """
    return write_then_attend(paged_write_back.impl, sparse_mla_attention.impl, call)


prefill_write_and_attend_ragged_qblock = prefill_write_and_attend_ragged
