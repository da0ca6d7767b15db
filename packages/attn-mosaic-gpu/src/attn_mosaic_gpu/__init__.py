"""Pallas Mosaic GPU attention kernels for NVIDIA Hopper (sm_90a).

``ranker_attention``: ranker attention (history + isolated candidates, logit soft cap,
GQA, optional differentiable LSE) under the shared API name. The forward is the
warp-specialized kernel of ``ranker_fwd``; ``jax.grad`` / ``jax.vjp`` run the dq and
dk/dv kernels of ``ranker_bwd`` (warp-specialized and TMA-pipelined for D 64/128 in
``ranker_bwd_pipelined``; fixed accumulation order, no atomics, bitwise deterministic;
GQA dK/dV accumulated per kv head). Measured results: docs/ranker_gpu.md.
``supports(op, *args, **kwargs)`` tells ``attn_common``'s dispatch which inputs the
kernels take (bf16/fp16, D in {64, 128, 256}); others fall back to the reference.
The sparse MLA kernels for Hopper are a separate issue.
"""

from importlib.metadata import PackageNotFoundError, version

from attn_mosaic_gpu.ranker import ranker_attention, supports
from attn_mosaic_gpu.ranker_bwd import ranker_attention_bwd
from attn_mosaic_gpu.ranker_fwd import default_config, ranker_attention_fwd

try:
    __version__: str = version("attn-mosaic-gpu")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "default_config",
    "ranker_attention",
    "ranker_attention_bwd",
    "ranker_attention_fwd",
    "supports",
]
