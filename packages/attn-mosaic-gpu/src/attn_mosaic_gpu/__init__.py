"""Pallas Mosaic GPU attention kernels for NVIDIA Hopper (sm_90a).

``ranker_attention``: the warp-specialized ranker-attention forward kernel (history +
isolated candidates, logit soft cap, GQA, optional LSE), under the shared API name.
Its backward kernels and the sparse MLA kernels for Hopper are separate issues.
"""

from importlib.metadata import PackageNotFoundError, version

from attn_mosaic_gpu.ranker import ranker_attention
from attn_mosaic_gpu.ranker_fwd import default_config, ranker_attention_fwd

try:
    __version__: str = version("attn-mosaic-gpu")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["default_config", "ranker_attention", "ranker_attention_fwd"]
