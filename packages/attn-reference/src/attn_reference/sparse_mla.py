"""Reference sparse MLA prefill: flat and ragged paged modes (docs/design.md).

Both modes reduce to one gather-based core, ``attn_common.sparse_mla_xla`` (the kernel
backends' backward uses the same code): each query gathers the ``K * read_block`` key
rows of its selected units from a row-addressable latent store (``kv`` flattened over
the batch, or the paged cache flattened over pages; ``attn_common.sparse_mla_rows`` says
where each unit lives), marks which gathered rows are valid (a real selection, first
occurrence of its unit, ``position >= t``, ``t < kv_len``), and runs an exact masked
softmax. Keys of rows a query does not attend are replaced by zeros before the score and
value products, so whatever those rows hold (NaN, Inf) never reaches its output, its
LSE or any gradient, and such a row's gradient is exactly zero. Queries are processed
in chunks so memory stays bounded by one chunk's gathered keys, in the backward too.
An ``Fp8LatentCache`` is read the same way: the gathered rows are dequantized to
float32 (``latent * scale``, then the rope), so the result is the op's on
``dequantize_latent_cache(kv)``; a NaN scale of an unattended row is masked like any
other value there.
"""

from __future__ import annotations

from attn_common.sparse_mla import empty_result
from attn_common.sparse_mla_xla import xla_sparse_mla
from attn_common.spec import SparseMlaCall, public_op, sparse_mla_call


@public_op(sparse_mla_call)
def sparse_mla_attention(call: SparseMlaCall):
    """Sparse MLA attention over selected KV units (reference, plain JAX, any float cache
    or an ``Fp8LatentCache``).

    The query-blocked knobs (``query_block``, ``u_max``, ``head_block``) tune the TPU
    kernel and never change the answer: the reference validates them and computes the
    exact result. ``interpret`` is accepted and ignored.

    Differentiable (``jax.grad`` / ``jax.vjp``) in ``q`` and ``kv``, through ``out`` and
    ``lse``: a duplicate selection contributes once, a query with no valid key gets zero
    gradients, a cache row no query attends gets exactly zero gradient whatever it holds.
    ``return_attn_mass=True`` adds the indexer's target (``stop_gradient``).
    """
    problem = call.problem
    if problem.is_empty:
        return empty_result(problem, call.return_lse, call.return_attn_mass)
    return call.result(*xla_sparse_mla(call))


# One kernel under both names: every knob of the query-blocked variant is in the spec.
sparse_mla_attention_qblock = sparse_mla_attention
