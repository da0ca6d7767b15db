"""Pallas Mosaic GPU attention kernels for NVIDIA Hopper (sm_90a).

This backend will hold the warp-specialized ranker-attention kernels (forward and
backward: history + isolated candidates, logit soft cap, GQA, optional LSE) and the
sparse MLA prefill kernels, exported under the shared names of ``attn_common``'s API
(``ranker_attention``, ``sparse_mla_attention``, ...). The kernels come in later issues;
for now the package only carries its version, so that it builds and installs on its own.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("attn-mosaic-gpu")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__: list[str] = []
