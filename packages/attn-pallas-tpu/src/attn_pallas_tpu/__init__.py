"""Pallas Mosaic TPU attention kernels.

This backend will hold the sparse MLA prefill kernels (per-query and query-blocked, flat
and packed-ragged paged caches), the paged KV write-back kernel, the
``prefill_write_and_attend_ragged`` wrappers and ranker attention, exported under the
shared names of ``attn_common``'s API. The kernels come in later issues; for now the
package only carries its version, so that it builds and installs on its own.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("attn-pallas-tpu")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__: list[str] = []
