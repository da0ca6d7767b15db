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
_MIN_STAGES = 2  # a ring of one slot could not prefetch; no kernel takes it
_MAX_STAGES = 8
_FMA_COLS_MULTIPLE = 8  # column width of a Hopper WGMMA-layout register tile
_REGISTER_MULTIPLE = 8  # setmaxnreg takes multiples of 8 ...
_MAX_REGISTERS = 256  # ... up to 256 per thread


def _check_block(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"KernelConfig.{name}: got {value!r}, expected an int")
    if value <= 0 or value % _BLOCK_MULTIPLE or value > _MAX_BLOCK:
        raise ValueError(
            f"KernelConfig.{name}: got {value}, expected a positive multiple of "
            f"{_BLOCK_MULTIPLE} no larger than {_MAX_BLOCK}"
        )


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiling of an attention kernel (today: the Hopper ranker forward).

    Only fields a kernel reads are here. The Hopper backward kernels use fixed 64-row
    blocks and the TPU sparse-MLA kernels take their tiling as arguments
    (``query_block``, ``u_max``, ``head_block``), so neither has a field.

    Attributes:
      block_q: query rows per compute tile (per compute warpgroup on Hopper).
      block_kv: keys per pipelined K/V block.
      num_stages: depth of the K/V ring buffer, 2 to 8: the K/V blocks resident at once.
        The memory warpgroup issues the first ``num_stages`` loads up front and then
        keeps ``num_stages - 1`` loads in flight ahead of the block being computed, so
        2 = double buffering (prefetch one block ahead).
      exp2_fma_cols: of each ``block_q x block_kv`` score tile, how many key columns
        (a multiple of 8, at most ``block_kv``) compute the softmax's ``exp2`` with
        FMA-pipe arithmetic instead of the multi-function unit (Hopper forward only: the
        capped softmax is MUFU-bound there). 0 = all on the MUFU.
      rcp_fma_cols: the same split for soft_sign's reciprocal (Hopper forward only;
        needs a soft_sign cap).
      programs: 0 = one program per query tile; ``N > 0`` = ``N`` persistent programs
        (one per SM: 132 on an H200) that walk the tiles, each loading its next tile's Q
        while it computes the current one (Hopper forward only, one user per row).
      compute_registers: registers per thread the compute warpgroups take (``setmaxnreg``;
        the memory warpgroup gets what is left of the block's pool); 0 = the kernel's
        default (Hopper forward only: 232, at most 240).
    """

    block_q: int = 64
    block_kv: int = 64
    num_stages: int = 2
    exp2_fma_cols: int = 0
    rcp_fma_cols: int = 0
    programs: int = 0
    compute_registers: int = 0

    def __post_init__(self) -> None:
        _check_block("block_q", self.block_q)
        _check_block("block_kv", self.block_kv)
        value = self.num_stages
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"KernelConfig.num_stages: got {value!r}, expected an int")
        if not _MIN_STAGES <= value <= _MAX_STAGES:
            raise ValueError(
                f"KernelConfig.num_stages: got {value}, expected {_MIN_STAGES} <= num_stages "
                f"<= {_MAX_STAGES} (a ring of one slot cannot prefetch)"
            )
        for name in ("exp2_fma_cols", "rcp_fma_cols"):
            cols = getattr(self, name)
            if isinstance(cols, bool) or not isinstance(cols, int):
                raise TypeError(f"KernelConfig.{name}: got {cols!r}, expected an int")
            if cols < 0 or cols % _FMA_COLS_MULTIPLE or cols > self.block_kv:
                raise ValueError(
                    f"KernelConfig.{name}: got {cols}, expected a multiple of "
                    f"{_FMA_COLS_MULTIPLE} from 0 to block_kv={self.block_kv} (key columns "
                    "of a score tile, split at register-tile boundaries)"
                )
        if isinstance(self.programs, bool) or not isinstance(self.programs, int):
            raise TypeError(f"KernelConfig.programs: got {self.programs!r}, expected an int")
        if self.programs < 0:
            raise ValueError(f"KernelConfig.programs: got {self.programs}, expected >= 0")
        regs = self.compute_registers
        if isinstance(regs, bool) or not isinstance(regs, int):
            raise TypeError(f"KernelConfig.compute_registers: got {regs!r}, expected an int")
        if regs < 0 or regs % _REGISTER_MULTIPLE or regs > _MAX_REGISTERS:
            raise ValueError(
                f"KernelConfig.compute_registers: got {regs}, expected 0 (the kernel's "
                f"default) or a multiple of {_REGISTER_MULTIPLE} up to {_MAX_REGISTERS} "
                "(setmaxnreg's range)"
            )

    def replace(self, **changes) -> KernelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
