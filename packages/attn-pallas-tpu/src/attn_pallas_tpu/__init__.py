"""Pallas Mosaic TPU attention kernels: sparse MLA prefill and the paged KV write-back.

Exported under the shared names of docs/design.md#public-api:

* ``sparse_mla_attention``: per-query kernel (one program per query DMAs its own
  selected units through a VMEM ring), flat and packed-ragged paged KV.
* ``sparse_mla_attention_qblock``: query-blocked kernel (per block of ``query_block``
  queries the union of selected units is DMA'd once; membership restored by a ``-inf``
  bias inside one online softmax).
* ``paged_write_back``: in-place paged KV write (HBM->HBM DMA runs, scatter fallback).
* ``prefill_write_and_attend_ragged`` / ``prefill_write_and_attend_ragged_qblock``:
  write the new tokens' latents, then attend; drop-in replacements for each other and
  for ``attn_reference``'s.
* ``ranker_attention``: ranker attention (bidirectional history, isolated candidates,
  per-row traced bounds), forward and backward kernels behind a ``jax.custom_vjp``
  (docs/tpu_ranker.md).
* ``TpuFp8LatentCache``: an ``attn_common.Fp8LatentCache`` stored as the kernels read
  it (FP8 latent rows and one bf16 side row per token, 768 bytes), built once; a plain
  ``Fp8LatentCache`` is taken too (its side rows built per call; ``fp8_rows``).
* ``supports``: tells ``attn_common``'s dispatch which inputs these kernels take (the
  rest falls back to the reference).
* ``cli_commands``: the ``attn`` subcommand this backend adds (``attn bench sparse-mla``
  and ``attn bench ranker``, the TPU suites; ``attn_pallas_tpu.cli``).

Every function accepts ``interpret=True`` or a ``pltpu.InterpretParams`` to run in TPU
interpret mode on the CPU.
"""

from importlib.metadata import PackageNotFoundError, version

from attn_pallas_tpu._supports import supports
from attn_pallas_tpu.fp8_rows import TpuFp8LatentCache
from attn_pallas_tpu.paged import (
    paged_write_back,
    prefill_write_and_attend_ragged,
    prefill_write_and_attend_ragged_qblock,
)
from attn_pallas_tpu.ranker import ranker_attention
from attn_pallas_tpu.sparse_mla import sparse_mla_attention
from attn_pallas_tpu.sparse_mla_qblock import sparse_mla_attention_qblock


def cli_commands() -> dict:
    """The ``attn`` subcommands this backend adds (``attn bench``: its sparse-mla and
    ranker suites; ``attn tune``: the ranker kernels' tilings):
    name -> a function that adds the subparser. ``attn_common.cli`` calls this through
    the ``attn.backends`` entry point; the benchmark code is imported only then."""
    from attn_pallas_tpu import cli

    return dict(cli.COMMANDS)


try:
    __version__: str = version("attn-pallas-tpu")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__: list[str] = [
    "TpuFp8LatentCache",
    "cli_commands",
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
    "ranker_attention",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
    "supports",
]
