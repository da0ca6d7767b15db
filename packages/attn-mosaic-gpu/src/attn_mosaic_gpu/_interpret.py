"""Interpret mode at the edge: where the Hopper kernels run, resolved once, and every
difference between the two in one place.

The public functions take ``interpret`` (``False``/``None``, ``True`` or a
``plgpu.InterpretGPUParams``) and resolve it once (``resolve_target``) to a ``Target``;
the kernels take that one value (a static argument of their ``jax.jit``) and never test
interpret mode themselves: each difference is a method of ``Target``.

What jax 0.11.2's Mosaic GPU interpreter (CPU) does not run, and what runs instead:

* inline Mosaic GPU code: a plain JAX twin of the same values, chosen by
  ``Target.pick``: the sparse-MLA gathers, FP8 dequantization and hand-kept barriers
  (``InterpretedParts``, for ``_sparse_mla_rows.Parts``), the sparse-MLA backward's
  key-gradient stores (``store_key_rows``; it takes the deterministic path, as it runs
  no atomics) and row-id loads, ``fastmath``'s PTX tiles (``fastmath.fast_reciprocal``),
  the row-sort kernel (XLA's sort);
* ``run_state`` and a wgmma whose A operand is in registers: the A operand is staged
  through shared memory (``stage``, ``accumulate_registers``) and each product goes
  into a fresh accumulator that is then added (``product``, ``add_product``,
  ``accumulate``); the accumulators are values carried by the loops, not ACC refs
  (``accumulators``, ``zeroed``, ``loop``, ``value``); the interpreter's wgmma is
  synchronous, so there is nothing to wait for (``wgmma_wait``);
* XLA, which runs the interpreted kernel, folds ``fastmath.exp2_fma``'s rounding step
  away unless it is guarded (``exp2_fma(xla_fold_guard=target.interpret)``).

Everything else (TMA, barriers and their phases, the rings, the schedules) is the GPU
code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_common.fp8_cache import GROUP as FP8_GROUP
from attn_mosaic_gpu.sparse_mla_config import BLOCK_K, ROPE

__all__ = [
    "COMPILED",
    "InterpretedParts",
    "Target",
    "resolve_interpret",
    "resolve_target",
    "store_key_rows",
]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a kernel runs: compiled for the GPU (``params`` ``None``), or on the Mosaic
    GPU interpreter with ``params`` (what ``plgpu.kernel(interpret=...)`` takes)."""

    params: plgpu.InterpretGPUParams | None = None

    @property
    def interpret(self) -> bool:
        return self.params is not None

    @property
    def compiled(self) -> bool:
        return self.params is None

    def pick(self, compiled, interpreted):
        """``compiled`` on the GPU, ``interpreted`` on the interpreter (the plain-JAX
        twin of inline Mosaic GPU code, or what replaces a buffer or an argument)."""
        return compiled if self.params is None else interpreted

    def reciprocal_tile(self) -> Callable:
        """The MUFU reciprocal of a 2-D tile: ``fastmath.fast_reciprocal_tile`` (a PTX
        instruction) compiled, ``fastmath.fast_reciprocal`` interpreted."""
        from attn_mosaic_gpu.fastmath import fast_reciprocal, fast_reciprocal_tile

        return self.pick(fast_reciprocal_tile, fast_reciprocal)

    def wgmma_wait(self, pending: int) -> None:
        """Wait until at most ``pending`` wgmma groups are in flight (interpreted, every
        product has landed when it returns)."""
        if self.params is None:
            plgpu.wgmma_wait(pending)

    def accumulators(self, body: Callable, *shapes):
        """``body`` with a float32 ACC ref of each shape (compiled), or with ``None`` for
        each (interpreted: the products are values, ``product`` / ``add_product``)."""
        if self.params is None:
            return pl.run_scoped(body, *(plgpu.ACC(s, jnp.float32) for s in shapes))
        return body(*(None for _ in shapes))

    def product(self, acc_ref, shape, issue: Callable, zero=None):
        """The product ``issue(acc)`` adds to a zero accumulator, as a float32 value of
        ``shape``, waited for: compiled into ``acc_ref`` (set to ``zero``, by default a
        fresh zero tile), interpreted into a fresh accumulator."""
        if self.params is None:
            if zero is None:
                zero = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
            acc_ref[...] = zero
            issue(acc_ref)
            return acc_ref[...]
        return _fresh_product(shape, issue)

    def add_product(self, acc, acc_ref, shape, issue: Callable, scale=None):
        """``acc * scale + product`` (``scale`` ``None``: 1). Compiled: ``acc_ref``
        holds the accumulator; it is scaled in place (which waits for the wgmmas in
        flight) and ``issue(acc_ref)`` adds the product, not waited for; returns
        ``None``. Interpreted: ``acc`` is the value; the product goes into a fresh
        accumulator and the sum is returned."""
        if self.params is None:
            if scale is not None:
                acc_ref[...] = acc_ref[...] * scale
            issue(acc_ref)
            return None
        product = _fresh_product(shape, issue)
        return (acc if scale is None else acc * scale) + product

    def value(self, acc, acc_ref):
        """An accumulator's value: ``acc_ref[...]`` compiled (the ACC ref holds it),
        ``acc`` interpreted (carried as a value)."""
        return acc_ref[...] if self.params is None else acc

    def zeroed(self, acc_refs, shapes):
        """Zero accumulators: compiled, ``acc_refs`` set to zero tiles and returned;
        interpreted, zero values of ``shapes``."""
        if self.params is None:
            for ref in acc_refs:
                ref[...] = plgpu.layout_cast(jnp.zeros(ref.shape, jnp.float32), plgpu.Layout.WGMMA)
            return tuple(acc_refs)
        return tuple(jnp.zeros(shape, jnp.float32) for shape in shapes)

    def loop(self, lo, hi, body: Callable, accs):
        """``body(i, accs)`` for ``i`` in ``[lo, hi)``: compiled, ``accs`` are ACC refs
        that the body adds to (``pl.loop``, nothing carried); interpreted, values the
        body returns (``lax.fori_loop``). Returns the accumulators."""
        if self.params is None:

            @pl.loop(lo, hi)
            def _step(i):
                body(i, accs)

            return accs
        return lax.fori_loop(lo, hi, body, accs)

    def stage(self, a, staging):
        """A wgmma A operand from registers: compiled, ``a`` itself; interpreted (which
        runs no register-A wgmma), ``a`` stored to ``staging`` in shared memory, and
        ``staging``."""
        if self.params is None:
            return a
        staging[...] = a
        return staging

    def accumulate_registers(
        self, accs, staging: Callable, operands, after: Callable | None = None
    ):
        """``accs[i] + A_i @ B_i`` for ``operands[i] = (A_i thunk, B_i in shared memory)``,
        waited for: compiled, the A operands stay in registers and the wgmmas accumulate
        in place (``run_state``), each A computed just before its wgmma; interpreted,
        each A is stored to ``staging()[i]`` (shared memory, committed) and the products
        go into fresh accumulators that are added. ``after()`` runs once the wgmmas are
        issued."""
        if self.params is None:

            def body(refs):
                for ref, (a, b) in zip(refs, operands, strict=True):
                    plgpu.wgmma(ref, a(), b)
                if after is not None:
                    after()

            return pl.run_state(body)(tuple(plgpu.ACC.init(acc) for acc in accs))
        staging = staging()
        for buf, (a, _) in zip(staging, operands, strict=True):
            buf[...] = a()
        plgpu.commit_smem()  # generic-proxy writes visible to the async proxy (wgmma)

        def fresh(*refs):
            for ref, buf, (_, b) in zip(refs, staging, operands, strict=True):
                plgpu.wgmma(ref, buf, b)
            if after is not None:
                after()
            return tuple(ref[...] for ref in refs)

        products = pl.run_scoped(fresh, *(plgpu.ACC(acc.shape, jnp.float32) for acc in accs))
        return tuple(acc + d for acc, d in zip(accs, products, strict=True))

    def accumulate(self, acc, issue: Callable):
        """``acc + product``, waited for: compiled, ``acc`` is an ACC ref the product is
        added to (returned); interpreted, a value (the sum is returned)."""
        if self.params is None:
            issue(acc)
            plgpu.wgmma_wait(0)
            return acc
        return acc + _fresh_product(acc.shape, issue)


def _fresh_product(shape, issue: Callable):
    def run(acc_ref):
        issue(acc_ref)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


COMPILED = Target()


def resolve_interpret(interpret):
    """``False``/``None`` -> ``None`` (compile for the GPU); ``True`` -> default params;
    a ``plgpu.InterpretGPUParams`` as given; anything else is a TypeError."""
    if interpret is None or interpret is False:
        return None
    if interpret is True:
        return plgpu.InterpretGPUParams()
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    raise TypeError(
        f"interpret: got {type(interpret).__name__}, expected a bool or "
        "jax.experimental.pallas.mosaic_gpu.InterpretGPUParams"
    )


def resolve_target(interpret) -> Target:
    """The ``Target`` of a public function's ``interpret`` argument (a ``Target`` as
    given: the public functions call each other)."""
    if isinstance(interpret, Target):
        return interpret
    return Target(resolve_interpret(interpret))


# ------------------------------------------------------------------------------------
# The sparse-MLA kernels' twins of their inline Mosaic GPU code.


class InterpretedParts:
    """``_sparse_mla_rows.Parts`` on the interpreter: the memory WG copies a part by
    plain loads and stores (FP8 dequantized as it is copied), so the copies have landed
    when it publishes them, on the Pallas ``part_ready`` barriers."""

    def __init__(self, st, buf, bar, *, fp8: bool = False):
        del buf  # no hand-kept barriers
        self.st, self.ready, self.fp8 = st, bar.part_ready, fp8

    def init(self) -> None:
        pass

    def gather(self, half: str):
        return (_gather_part_fp8 if self.fp8 else _gather_part)(self.st, half)

    def publish(self, part) -> None:
        plgpu.commit_smem()
        plgpu.barrier_arrive(self.ready.at[part])

    def wait(self, part, step) -> None:
        del step
        plgpu.barrier_wait(self.ready.at[part])

    def dequantize(self, half: str, slot) -> None:
        del half, slot  # dequantized as it was copied


def store_key_rows(acc, ids, parts, col0: int) -> None:
    """The sparse-MLA backward's deterministic key-gradient store (``_red_global`` with
    ``store=True``) by a plain store: ``acc [64, n]`` to columns ``col0:col0 + n`` of
    the block's parts ``[64, Dk]``."""
    del ids  # a slot with id < 0 is never read back (its parts are not summed)
    parts.at[:, pl.ds(col0, acc.shape[1])][...] = acc


def _gather_part(st, half: str):
    """``_sparse_mla_rows.gather_part`` by plain loads and stores (rows with id ``< 0``
    zero-filled)."""
    dv = st.dv
    lo, hi = {"L": (0, dv // 2), "R": (dv // 2, dv)}[half]

    def gather(store, rows, latent, rope):
        def one(r, carry):
            row = rows[r]
            data = store[jnp.maximum(row, 0), pl.ds(0, dv + ROPE)]
            data = jnp.where(row >= 0, data, jnp.zeros_like(data))
            latent[r, pl.ds(lo, hi - lo)] = data[lo:hi]
            if half != "L":
                rope[r, :] = data[dv:]
            return carry

        lax.fori_loop(0, BLOCK_K, one, 0)

    return gather


def _gather_part_fp8(st, half: str):
    """The FP8 gather: each row's part dequantized by plain loads and stores straight
    into its bf16 slot, the values the compiled in-place dequantization writes
    (``_sparse_mla_rows.dequantize_part_fp8``)."""
    dv = st.dv
    lo, hi = {"L": (0, dv // 2), "R": (dv // 2, dv)}[half]
    g_lo = lo // FP8_GROUP

    def gather(latent, scale, rope, rows, k_lat, k_rope):
        def one(r, carry):
            row = rows[r]
            src = jnp.maximum(row, 0)
            values = latent[src, pl.ds(lo, hi - lo)].astype(jnp.float32)
            scales = scale[src, pl.ds(g_lo, (hi - lo) // FP8_GROUP)]
            values = values.reshape(-1, FP8_GROUP) * scales[:, None]
            values = values.reshape(hi - lo).astype(jnp.bfloat16)
            k_lat[r, pl.ds(lo, hi - lo)] = jnp.where(row >= 0, values, jnp.zeros_like(values))
            if half != "L":
                rope_row = rope[src, :]
                k_rope[r, :] = jnp.where(row >= 0, rope_row, jnp.zeros_like(rope_row))
            return carry

        lax.fori_loop(0, BLOCK_K, one, 0)

    return gather
