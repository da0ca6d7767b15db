"""Pallas Mosaic TPU attention kernels: sparse MLA prefill and the paged KV write-back.

Exported under the shared names of SPEC section 9:

* ``sparse_mla_attention``: per-query kernel (one program per query DMAs its own
  selected units through a VMEM ring), flat and packed-ragged paged KV.
* ``sparse_mla_attention_qblock``: query-blocked kernel (per block of ``query_block``
  queries the union of selected units is DMA'd once; membership restored by a ``-inf``
  bias inside one online softmax).
* ``paged_write_back``: in-place paged KV write (HBM->HBM DMA runs, scatter fallback).
* ``prefill_write_and_attend_ragged`` / ``prefill_write_and_attend_ragged_qblock``:
  write the new tokens' latents, then attend; drop-in replacements for each other and
  for ``attn_reference``'s.

Every function accepts ``interpret=True`` or a ``pltpu.InterpretParams`` to run in TPU
interpret mode on the CPU. Ranker attention is not implemented in this backend yet.
"""

from importlib.metadata import PackageNotFoundError, version

from attn_pallas_tpu.paged import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
)
from attn_pallas_tpu.sparse_mla import sparse_mla_attention
from attn_pallas_tpu.sparse_mla_qblock import sparse_mla_attention_qblock

try:
    __version__: str = version("attn-pallas-tpu")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__: list[str] = [
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
]
