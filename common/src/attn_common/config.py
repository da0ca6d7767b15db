"""``KernelConfig``: the static tiling knobs every kernel backend reads.

Frozen and hashable so a config can be a static argument of ``jax.jit``. Each field is
validated on construction; errors name the field, the value seen and the rule. Limits
that depend on a backend (shared memory, registers, VMEM) are checked by that backend,
which reports the limit that was hit.
"""

from __future__ import annotations

import dataclasses

_BLOCK_MULTIPLE = 16  # wgmma M/N granularity on Hopper, sublane packing on TPU
_MAX_BLOCK = 1024
_MAX_STAGES = 8


def _check_block(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"KernelConfig.{name}: got {value!r}, expected an int")
    if value <= 0 or value % _BLOCK_MULTIPLE or value > _MAX_BLOCK:
        raise ValueError(
            f"KernelConfig.{name}: got {value}, expected a positive multiple of "
            f"{_BLOCK_MULTIPLE} no larger than {_MAX_BLOCK}"
        )


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiling of an attention kernel.

    Attributes:
      block_q: query rows per compute tile (per compute warpgroup on Hopper).
      block_kv: keys per pipelined KV block.
      num_stages: depth of the K/V ring buffer (1 = no prefetch).
      block_q_bwd / block_kv_bwd: tiles of the backward kernels; ``None`` = the forward's.
      query_block: queries per program of the query-blocked sparse-MLA kernel.
      num_dma_buffers: depth of the sparse-MLA unit DMA ring.
    """

    block_q: int = 64
    block_kv: int = 64
    num_stages: int = 2
    block_q_bwd: int | None = None
    block_kv_bwd: int | None = None
    query_block: int = 256
    num_dma_buffers: int = 4

    def __post_init__(self) -> None:
        _check_block("block_q", self.block_q)
        _check_block("block_kv", self.block_kv)
        _check_block("block_q_bwd", self.block_q_bwd, optional=True)
        _check_block("block_kv_bwd", self.block_kv_bwd, optional=True)
        _check_block("query_block", self.query_block)
        for name in ("num_stages", "num_dma_buffers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KernelConfig.{name}: got {value!r}, expected an int")
            if not 1 <= value <= _MAX_STAGES:
                raise ValueError(
                    f"KernelConfig.{name}: got {value}, expected 1 <= {name} <= {_MAX_STAGES}"
                )

    @property
    def bwd_block_q(self) -> int:
        return self.block_q if self.block_q_bwd is None else self.block_q_bwd

    @property
    def bwd_block_kv(self) -> int:
        return self.block_kv if self.block_kv_bwd is None else self.block_kv_bwd

    def replace(self, **changes) -> KernelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
