"""Multi-device helpers: run the ops under ``jax.shard_map`` with batch and head sharding.

Both ops are independent per batch row and per head (per kv-head group for GQA), so
sharding needs no communication: every device runs the single-device op on its shard.

Ranker attention (``q [B, S, Hq, D]``, ``k``/``v`` ``[B, S, Hkv, D]``, ``bounds [B, 4]``)::

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    attend = shard_ranker_attention(mesh, cap=CapParams(CapMethod.SOFT_SIGN, 80.0))
    out = attend(q, k, v, bounds)  # same result as the unsharded call

``B`` is split over ``batch_axis`` and both ``Hq`` and ``Hkv`` over ``head_axis`` in
contiguous blocks. With GQA (``group = Hq // Hkv``) query head ``h`` reads kv head
``h // group``; splitting both head dimensions into the same number of contiguous
blocks keeps every query head on the device that holds its kv head, so ``Hkv`` (and
hence ``Hq``) must be divisible by the ``head_axis`` size. ``bounds`` given as ``[4]``
are broadcast to ``[B, 4]`` before sharding.

Sparse MLA, flat mode (``q [B, S, H, Dk]``, ``kv [B, T, Dk]``, ``indices [B, S, K]``,
``positions [B, S]``): ``B`` over ``batch_axis``, ``H`` over ``head_axis``; the latent
cache has no head dimension and is replicated along ``head_axis``. Ragged paged mode packs
every request into one batch row: ``shard_sparse_mla_attention_ragged`` shards the heads
(the paged cache and the ragged tables replicated), or with ``request_axis`` gives every
device a ragged batch of its own, over a pool replicated or sharded by request.

Either axis may be ``None`` (no sharding along it). ``fn`` defaults to the dispatching
op (``attn_common.ranker_attention`` / ``sparse_mla_attention``, with
``implementation=``); pass a backend's function directly to pin one. The returned
callable is jitted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attn_common.bounds import SegmentBounds


def _axis_size(mesh: Mesh, axis: str | None) -> int:
    if axis is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not in the mesh axes {tuple(mesh.shape)}")
    return int(mesh.shape[axis])


def _divisible(name: str, size: int, axis: str | None, n: int) -> None:
    if size % n:
        raise ValueError(f"{name} = {size} is not divisible by the size {n} of mesh axis {axis!r}")


def _shape(name: str, x, hint: str) -> tuple[int, ...]:
    """``x``'s shape, checked to have ``hint``'s rank before the wrappers index it (the op
    validates the rest, on each shard)."""
    shape = tuple(jnp.shape(x))
    if len(shape) != hint.count(",") + 1:
        raise ValueError(f"{name}: got shape {shape}, expected {hint}")
    return shape


def _shard_map(fn, mesh, in_specs, out_specs, check_vma):
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )

    def placed(*args):
        # Lay the inputs out as in_specs says (a no-op when they already are): needed for
        # meshes with explicit axes, where shard_map checks the inputs' own shardings.
        args = [
            jax.device_put(x, NamedSharding(mesh, spec))
            for x, spec in zip(args, in_specs, strict=True)
        ]
        return mapped(*args)

    return jax.jit(placed)


def _op_or_front_door(fn, op: str, implementation: str | None) -> Callable[..., Any]:
    """``fn``, or when ``None`` the dispatching front door of ``op`` on
    ``implementation``."""
    if fn is not None:
        return fn
    from attn_common import dispatch

    return functools.partial(getattr(dispatch, op), implementation=implementation)


def shard_ranker_attention(
    mesh: Mesh,
    fn: Callable[..., Any] | None = None,
    *,
    batch_axis: str | None = "data",
    head_axis: str | None = "model",
    implementation: str | None = None,
    check_vma: bool = False,
    **kwargs: Any,
) -> Callable[..., Any]:
    """A jitted ``(q, k, v, bounds) -> out`` (or ``(out, lse)``) sharded over ``mesh``.

    ``kwargs`` (``sm_scale``, ``cap``, ``config``, ``return_lse``, ...) go to ``fn``.
    ``sm_scale`` defaults to ``1/sqrt(D)`` inside ``fn`` as usual (D is not sharded).
    ``check_vma=False`` by default because Pallas kernels do not declare how their
    outputs vary across the mesh; every output here is fully sharded anyway.
    """
    fn = _op_or_front_door(fn, "ranker_attention", implementation)
    nb, nh = _axis_size(mesh, batch_axis), _axis_size(mesh, head_axis)
    return_lse = bool(kwargs.get("return_lse", False))
    qkv = PartitionSpec(batch_axis, None, head_axis, None)
    bspec = PartitionSpec(batch_axis, None)
    lse_spec = PartitionSpec(batch_axis, head_axis, None)  # lse [B, Hq, S]
    out_specs = (qkv, lse_spec) if return_lse else qkv

    def local(q, k, v, bounds):
        return fn(q, k, v, bounds, **kwargs)

    sharded = _shard_map(local, mesh, (qkv, qkv, qkv, bspec), out_specs, check_vma)

    def call(q, k, v, bounds):
        batch, _, hq, _ = _shape("q", q, "[B, S, Hq, D]")
        hkv = _shape("k", k, "[B, S, Hkv, D]")[2]
        _divisible("batch", batch, batch_axis, nb)
        _divisible("kv heads", hkv, head_axis, nh)
        _divisible("q heads", hq, head_axis, nh)
        if isinstance(bounds, SegmentBounds):
            bounds = bounds.as_array()
        bounds = jnp.asarray(bounds, jnp.int32)
        if bounds.ndim == 1:
            bounds = jnp.broadcast_to(bounds, (batch, 4))
        return sharded(q, k, v, bounds)

    return call


def _sparse_out_specs(out_spec, lse_spec, mass_spec, kwargs):
    """``out``, then ``lse`` (``return_lse``), then the mass (``return_attn_mass``)."""
    extra = (lse_spec,) if kwargs.get("return_lse", False) else ()
    extra += (mass_spec,) if kwargs.get("return_attn_mass", False) else ()
    return (out_spec, *extra) if extra else out_spec


def _mass_over_heads(result, head_axis, kwargs):
    """A shard's attention mass averages its own heads: the mean over the head shards
    (equal head counts) is the mass over all heads, the same on every head shard."""
    if not kwargs.get("return_attn_mass", False) or head_axis is None:
        return result
    *rest, mass = result
    return (*rest, jax.lax.pmean(mass, head_axis))


def shard_sparse_mla_attention(
    mesh: Mesh,
    fn: Callable[..., Any] | None = None,
    *,
    batch_axis: str | None = "data",
    head_axis: str | None = "model",
    implementation: str | None = None,
    check_vma: bool = False,
    **kwargs: Any,
) -> Callable[..., Any]:
    """A jitted flat-mode ``(q, kv, indices, positions) -> out`` (or the tuple with
    ``lse`` and the attention mass; the mass is averaged over the head shards).

    ``kwargs`` (``sm_scale`` is required; ``kv_lora_rank``, ``read_block``,
    ``return_lse``, ``return_attn_mass``, ``interpret``, ...) go to ``fn`` (default: the dispatching
    ``attn_common.sparse_mla_attention``; pass e.g. ``sparse_mla_attention_qblock`` of a
    backend to shard that one).
    """
    if "q_seq_id" in kwargs or "page_size" in kwargs:
        raise ValueError("shard_sparse_mla_attention shards the flat mode only")
    fn = _op_or_front_door(fn, "sparse_mla_attention", implementation)
    nb, nh = _axis_size(mesh, batch_axis), _axis_size(mesh, head_axis)
    q_spec = PartitionSpec(batch_axis, None, head_axis, None)
    kv_spec = PartitionSpec(batch_axis, None, None)
    row_spec = PartitionSpec(batch_axis, None)
    lse_spec = PartitionSpec(batch_axis, None, head_axis)  # lse [B, S, H]
    out_specs = _sparse_out_specs(q_spec, lse_spec, PartitionSpec(batch_axis, None, None), kwargs)

    def local(q, kv, indices, positions):
        return _mass_over_heads(fn(q, kv, indices, positions, **kwargs), head_axis, kwargs)

    sharded = _shard_map(local, mesh, (q_spec, kv_spec, kv_spec, row_spec), out_specs, check_vma)

    def call(q, kv, indices, positions):
        batch, _, heads, _ = _shape("q", q, "[B, S, H, Dk]")
        _divisible("batch", batch, batch_axis, nb)
        _divisible("heads", heads, head_axis, nh)
        return sharded(q, kv, indices, positions)

    return call


_POOLS = ("replicated", "sharded")


def shard_sparse_mla_attention_ragged(
    mesh: Mesh,
    fn: Callable[..., Any] | None = None,
    *,
    head_axis: str | None = "model",
    request_axis: str | None = None,
    pool: str = "replicated",
    implementation: str | None = None,
    check_vma: bool = False,
    **kwargs: Any,
) -> Callable[..., Any]:
    """A jitted ragged paged-mode sparse MLA: heads over ``head_axis``, requests over
    ``request_axis``.

    ``request_axis=None`` (heads only): the call takes the single-device arguments
    ``(q [1, S, H, Dk], cache, indices [1, S, K], positions [1, S], q_seq_id [S],
    seq_lens [R], cu_kv_lens [R + 1], page_indices [P])`` and returns ``out [1, S, H,
    Dv]`` (or the tuple with ``lse``, the mass); the cache and the tables are replicated.

    ``request_axis`` given: each of the ``n`` devices along it serves its own requests, a
    ragged batch of its own. The call takes the ``n`` batches stacked on a leading axis
    (each padded to the same ``S``, ``R`` and ``P``): ``q [n, S, H, Dk]``, ``indices
    [n, S, K]``, ``positions [n, S]``, ``q_seq_id [n, S]``, ``seq_lens [n, R]``,
    ``cu_kv_lens [n, R + 1]``, ``page_indices [n, P]``, and returns ``out [n, S, H,
    Dv]`` (``lse [n, S, H]``, mass ``[n, S, K]``). The paged pool (``pool``):

    * ``"replicated"``: ``cache`` is one pool every device holds whole; ``page_indices``
      are its page ids.
    * ``"sharded"``: ``cache`` is the ``n`` devices' pools of ``N`` pages each,
      concatenated (``[n * N, ...]``) and split over ``request_axis``; batch ``i``'s
      ``page_indices`` are ids into its own pool (``0 <= id < N``). No page crosses
      devices, and the cache gradient stays sharded.

    Padding a batch: a request with ``seq_lens = 0`` and no pages (``cu_kv_lens``
    repeated), queries of it (their ``out`` is 0, their ``lse`` ``-inf``), page-table
    slots past the last request's pages (any value). With ``head_axis`` too, ``H`` is
    split over it as well. ``kwargs`` (``sm_scale``, ``page_size``, ``kv_lora_rank``,
    ``return_lse``, ...) go to ``fn`` (default: the dispatching
    ``attn_common.sparse_mla_attention``); ``read_block`` defaults to ``page_size``.
    """
    if "page_size" not in kwargs:
        raise ValueError("page_size: missing; ragged mode needs the cache page size")
    if pool not in _POOLS:
        raise ValueError(f"pool: got {pool!r}, expected one of {_POOLS}")
    if pool == "sharded" and request_axis is None:
        raise ValueError("pool: got 'sharded' with request_axis=None; a pool is sharded by request")
    kwargs.setdefault("read_block", kwargs["page_size"])
    fn = _op_or_front_door(fn, "sparse_mla_attention", implementation)
    nh, nr = _axis_size(mesh, head_axis), _axis_size(mesh, request_axis)
    q_spec = PartitionSpec(request_axis, None, head_axis, None)
    lse_spec = PartitionSpec(request_axis, None, head_axis)  # lse [1 or n, S, H]
    row_spec = PartitionSpec(request_axis, None)  # indices, positions; stacked tables
    mass_spec = PartitionSpec(request_axis, None, None)  # [1 or n, S, K]
    out_specs = _sparse_out_specs(q_spec, lse_spec, mass_spec, kwargs)
    replicated = PartitionSpec()
    cache_spec = PartitionSpec(request_axis) if pool == "sharded" else replicated
    table_spec = replicated if request_axis is None else row_spec
    stacked = request_axis is not None

    def local(q, cache, indices, positions, q_seq_id, seq_lens, cu_kv_lens, page_indices):
        if stacked:  # this device's batch: [1, ...] tables to their single-batch shapes
            q_seq_id, seq_lens, cu_kv_lens, page_indices = (
                t[0] for t in (q_seq_id, seq_lens, cu_kv_lens, page_indices)
            )
        result = fn(
            q, cache, indices, positions, q_seq_id=q_seq_id, seq_lens=seq_lens,
            cu_kv_lens=cu_kv_lens, page_indices=page_indices, **kwargs,
        )  # fmt: skip
        return _mass_over_heads(result, head_axis, kwargs)

    in_specs = (q_spec, cache_spec, row_spec, row_spec) + (table_spec,) * 4
    sharded = _shard_map(local, mesh, in_specs, out_specs, check_vma)

    def call(q, cache, indices, positions, q_seq_id, seq_lens, cu_kv_lens, page_indices):
        _divisible("heads", _shape("q", q, "[1, S, H, Dk]")[2], head_axis, nh)
        if stacked:
            tables = dict(q=q, indices=indices, positions=positions, q_seq_id=q_seq_id,
                          seq_lens=seq_lens, cu_kv_lens=cu_kv_lens,
                          page_indices=page_indices)  # fmt: skip
            for name, x in tables.items():
                if x.ndim < 2 or x.shape[0] != nr:
                    raise ValueError(
                        f"{name}: got shape {tuple(x.shape)}, expected the {nr} batches of "
                        f"mesh axis {request_axis!r} stacked on a leading axis [{nr}, ...]"
                    )
        if pool == "sharded":
            _divisible("cache pages", jax.tree.leaves(cache)[0].shape[0], request_axis, nr)
        return sharded(q, cache, indices, positions, q_seq_id, seq_lens, cu_kv_lens, page_indices)

    return call
