"""Pallas Mosaic GPU attention kernels for NVIDIA Hopper (sm_90a).

``ranker_attention``: ranker attention (history + isolated candidates, logit soft cap,
GQA, optional differentiable LSE) under the shared API name. The forward is the
warp-specialized kernel of ``ranker_fwd``; ``jax.grad`` / ``jax.vjp`` run the dq and
dk/dv kernels of ``ranker_bwd`` (warp-specialized and TMA-pipelined for D 64/128 in
``ranker_bwd_pipelined``; fixed accumulation order, no atomics, bitwise deterministic;
GQA dK/dV accumulated per kv head). Measured results: docs/ranker_gpu.md.
``sparse_mla_attention`` (and its ``_qblock`` twin): sparse MLA prefill (DeepSeek sparse
attention), flat and ragged paged, unit- or token-level selections, on the gather-attend
kernel of ``sparse_mla_kernel``; ``paged_write_back`` (an XLA scatter) and the
``prefill_write_and_attend_ragged`` wrappers. Measured results: docs/sparse_mla_gpu.md.
``supports(op, *args, **kwargs)`` tells ``attn_common``'s dispatch which inputs the
kernels take (ranker: bf16/fp16, D in {64, 128, 256}; sparse MLA: bf16, Dk = Dv + 64,
Dv a multiple of 128 up to 512); others fall back to the reference.
"""

from importlib.metadata import PackageNotFoundError, version

from attn_mosaic_gpu._supports import supports
from attn_mosaic_gpu.ranker import ranker_attention
from attn_mosaic_gpu.ranker_bwd import ranker_attention_bwd
from attn_mosaic_gpu.ranker_fwd import default_config, ranker_attention_fwd
from attn_mosaic_gpu.sparse_mla import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
    sparse_mla_attention,
    sparse_mla_attention_qblock,
)
from attn_mosaic_gpu.sparse_mla_kernel import SparseMlaKernelConfig


def cli_commands() -> dict:
    """The ``attn`` subcommands this backend adds (``attn bench``, ``attn tune``): name
    -> a function that adds the subparser. ``attn_common.cli`` calls this through the
    ``attn.backends`` entry point; the benchmark code is imported only then."""
    from attn_mosaic_gpu import cli

    return dict(cli.COMMANDS)


try:
    __version__: str = version("attn-mosaic-gpu")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "SparseMlaKernelConfig",
    "cli_commands",
    "default_config",
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
    "ranker_attention",
    "ranker_attention_bwd",
    "ranker_attention_fwd",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
    "supports",
]
