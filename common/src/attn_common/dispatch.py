"""One front door: call an op on the best installed backend for the default device.

Backends register through the Python entry-point group ``attn.backends`` (declared in
each backend's ``pyproject.toml``)::

    [project.entry-points."attn.backends"]
    reference = "attn_reference"

The entry's value is the module that exports the ops under the shared names (the
signatures below; docs/design.md, "Backends and dispatch"). When no entry point is found at all (a ``PYTHONPATH`` checkout that was never
``pip install``-ed) the known module names (``attn_reference``, ``attn_mosaic_gpu``,
``attn_pallas_tpu``) are looked up on ``sys.path`` instead.

Selection with ``implementation=None``: the default device (``jax.devices()[0]``) is
classified from its platform and ``device_kind`` only (no CUDA runtime query):

* Hopper GPU (``device_kind`` containing H100/H200/H800/GH200, or compute capability
  9.x when the device object reports one): ``mosaic-gpu``, then ``reference``;
* TPU: ``pallas-tpu``, then ``reference``;
* anything else (CPU, other GPUs): ``reference``.

The first backend in that order that is installed **and exports the op** is used; a
backend that lacks the op falls through to the next (for example ``mosaic-gpu`` has no
sparse MLA kernels yet, so sparse MLA on a Hopper GPU runs on the reference). Selection
looks at the forward op only:
``jax.grad`` of the selected op runs that backend's backward.

A backend may also say which *inputs* it supports: a module-level function
``supports(op, *args, **kwargs) -> str | None`` that returns ``None`` when it runs the
call, or the reason it does not (``"q: float32 ..., expected bfloat16 or float16"``).
With ``implementation=None`` such a call falls back to the next backend in the order,
with a :class:`BackendFallbackWarning` issued once per (op, backend, reason); ``supports``
only looks at static facts (dtypes, shapes, static options), never at array values.

An explicit ``implementation="mosaic-gpu"`` (or any other name) never falls through: if
the backend is not installed, does not run on the default device, or does not export
the op, :class:`BackendUnavailableError` says which and how to install it. Passing a
truthy ``interpret=`` (Pallas interpret mode) lifts the device check, so that e.g.
``implementation="pallas-tpu", interpret=True`` runs the TPU kernels on the CPU; and
inputs that backend's ``supports`` rejects raise :class:`UnsupportedInputError` (a
``ValueError``) with its reason.

The front-door functions take the reference backend's arguments. Keyword arguments left
at their default are not passed on, so each backend applies its own default and a
backend is only handed the options its caller actually set.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from attn_common.bounds import SegmentBounds
    from attn_common.cap import CapParams
    from attn_common.config import KernelConfig

ENTRY_POINT_GROUP = "attn.backends"

OPS: tuple[str, ...] = (
    "ranker_attention",
    "sparse_mla_attention",
    "sparse_mla_attention_qblock",
    "paged_write_back",
    "prefill_write_and_attend_ragged",
    "prefill_write_and_attend_ragged_qblock",
)

# The backends this repository ships: module, distribution, devices, install command.
KNOWN_BACKENDS: dict[str, dict[str, Any]] = {
    "reference": {
        "module": "attn_reference",
        "dist": "attn-reference",
        "devices": None,  # any device
        "install": "pip install ./common ./packages/attn-reference",
    },
    "mosaic-gpu": {
        "module": "attn_mosaic_gpu",
        "dist": "attn-mosaic-gpu",
        "devices": ("hopper",),
        "install": 'pip install "jax[cuda13]==0.11.2" ./common ./packages/attn-mosaic-gpu',
    },
    "pallas-tpu": {
        "module": "attn_pallas_tpu",
        "dist": "attn-pallas-tpu",
        "devices": ("tpu",),
        "install": 'pip install "jax[tpu]==0.11.2" ./common ./packages/attn-pallas-tpu',
    },
}

# Preference order for implementation=None, per device class.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "hopper": ("mosaic-gpu", "reference"),
    "tpu": ("pallas-tpu", "reference"),
}
DEFAULT_PREFERENCE: tuple[str, ...] = ("reference",)

HOPPER_KINDS = ("H100", "H200", "H800", "GH200")


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend is not installed, not usable here, or lacks the op."""


class UnsupportedInputError(ValueError):
    """An explicitly requested backend does not support these inputs (its ``supports``)."""


class BackendFallbackWarning(UserWarning):
    """``implementation=None`` skipped the preferred backend for inputs it cannot run."""


_FALLBACK_WARNED: set[tuple[str, str, str]] = set()


def _unsupported_reason(module: ModuleType, op: str, args, kwargs) -> str | None:
    """The backend's ``supports(op, *args, **kwargs)`` verdict (None: supported)."""
    supports = getattr(module, "supports", None)
    if supports is None or args is None:
        return None
    return supports(op, *args, **(kwargs or {}))


def _warn_fallback(op: str, skipped: str, reason: str, used: str) -> None:
    key = (op, skipped, reason)
    if key in _FALLBACK_WARNED:
        return
    _FALLBACK_WARNED.add(key)
    warnings.warn(
        f"{op}: backend {skipped!r} does not support these inputs ({reason}); running on "
        f"{used!r} instead. Pass implementation={used!r} to silence this, or change the "
        f"inputs to use {skipped!r}. (Warned once per op, backend and reason.)",
        BackendFallbackWarning,
        stacklevel=4,
    )


def default_device() -> Any:
    """The device ops run on by default: ``jax.devices()[0]``."""
    return jax.devices()[0]


def device_class(device: Any = None) -> str:
    """``"hopper"``, ``"tpu"``, ``"gpu"`` (not Hopper), or the platform name (``"cpu"``).

    Uses only the device object's ``platform``, ``device_kind`` and, where present,
    ``compute_capability``: nothing that queries the CUDA runtime.
    """
    if device is None:
        device = default_device()
    platform = str(getattr(device, "platform", "cpu")).lower()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        kind = str(getattr(device, "device_kind", "") or "").upper()
        if any(tag in kind for tag in HOPPER_KINDS):
            return "hopper"
        cc = getattr(device, "compute_capability", None)
        if cc is not None and str(cc).split(".")[0].strip() == "9":
            return "hopper"
        return "gpu"
    return platform


def installed_backends() -> dict[str, str]:
    """Installed backends: name -> module (or ``module:attr``) that exports the ops.

    From the ``attn.backends`` entry points; if there are none, the known module names
    importable from ``sys.path`` (a source checkout on ``PYTHONPATH``).
    """
    found = {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if found:
        return found
    return {
        name: info["module"]
        for name, info in KNOWN_BACKENDS.items()
        if importlib.util.find_spec(info["module"]) is not None
    }


def _install_hint(name: str) -> str:
    info = KNOWN_BACKENDS.get(name)
    if info is None:
        return f"install the package that registers the {ENTRY_POINT_GROUP!r} entry point {name!r}"
    return f"install it with `{info['install']}` (from a checkout of this repository)"


def load_backend(name: str) -> ModuleType:
    """Import an installed backend's module; :class:`BackendUnavailableError` if absent."""
    installed = installed_backends()
    if name not in installed:
        known = sorted(set(KNOWN_BACKENDS) | set(installed))
        if name not in known:
            raise BackendUnavailableError(
                f"unknown implementation {name!r}; expected None or one of {known}"
            )
        raise BackendUnavailableError(
            f"backend {name!r} is not installed (installed: {sorted(installed) or 'none'}); "
            + _install_hint(name)
        )
    target = installed[name]
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendUnavailableError(
            f"backend {name!r} is registered but its module {module_name!r} failed to "
            f"import ({type(e).__name__}: {e}); " + _install_hint(name)
        ) from e
    for part in filter(None, attr.split(".")):
        module = getattr(module, part)
    return module


def supported_devices(name: str, module: ModuleType | None = None) -> tuple[str, ...] | None:
    """Device classes a backend runs on (None: any). Third-party backends may declare
    ``ATTN_DEVICES = ("hopper", ...)`` in their module; otherwise any device."""
    if name in KNOWN_BACKENDS:
        return KNOWN_BACKENDS[name]["devices"]
    return getattr(module, "ATTN_DEVICES", None)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op: got {op!r}, expected one of {list(OPS)}")


def _implementers(op: str, installed: dict[str, str]) -> list[str]:
    out = []
    for name in installed:
        try:
            if hasattr(load_backend(name), op):
                out.append(name)
        except BackendUnavailableError:
            pass
    return sorted(out)


def select_backend(
    op: str,
    implementation: str | None = None,
    *,
    device: Any = None,
    interpret: Any = False,
    args: tuple | None = None,
    kwargs: dict | None = None,
) -> tuple[str, Callable[..., Any]]:
    """The backend name and function that ``op`` dispatches to (see the module docstring).

    With ``args`` (and ``kwargs``) given, the call's inputs are checked against each
    backend's ``supports``: ``implementation=None`` falls back past a backend that
    rejects them (warning once), an explicit ``implementation`` raises
    :class:`UnsupportedInputError`. Without ``args`` only the op is looked at.
    """
    _check_op(op)
    dev_class = device_class(device)
    if implementation is None:
        installed = installed_backends()
        order = PREFERENCE.get(dev_class, DEFAULT_PREFERENCE)
        skipped: list[tuple[str, str]] = []
        for name in order:
            if name not in installed:
                continue
            try:
                module = load_backend(name)
            except BackendUnavailableError:
                continue
            fn = getattr(module, op, None)
            if fn is None:
                continue
            reason = _unsupported_reason(module, op, args, kwargs)
            if reason is not None:
                skipped.append((name, reason))
                continue
            for skipped_name, why in skipped:
                _warn_fallback(op, skipped_name, why, name)
            return name, fn
        if skipped:
            raise UnsupportedInputError(
                f"{op}: no installed backend supports these inputs on a {dev_class} device ("
                + "; ".join(f"{n}: {why}" for n, why in skipped)
                + ")"
            )
        raise BackendUnavailableError(
            f"no installed backend implements {op!r} on a {dev_class} device (tried "
            f"{list(order)}; installed: {sorted(installed) or 'none'}); the reference runs "
            "everywhere: " + _install_hint("reference")
        )
    module = load_backend(implementation)
    devices = supported_devices(implementation, module)
    if devices is not None and dev_class not in devices and not interpret:
        raise BackendUnavailableError(
            f"backend {implementation!r} runs on {', '.join(devices)} devices, but the default "
            f"device is {dev_class} ({getattr(device or default_device(), 'device_kind', '?')}); "
            "use implementation=None for the best backend here (on the command line: leave "
            "--implementation out), pass interpret=True (`attn run --interpret`) to run the "
            "kernels in Pallas interpret mode, or on a supported machine "
            + _install_hint(implementation)
        )
    fn = getattr(module, op, None)
    if fn is None:
        others = [n for n in _implementers(op, installed_backends()) if n != implementation]
        raise BackendUnavailableError(
            f"backend {implementation!r} does not implement {op!r} (yet); installed backends "
            f"that do: {others or 'none'}" + ("" if others else "; " + _install_hint("reference"))
        )
    reason = _unsupported_reason(module, op, args, kwargs)
    if reason is not None:
        raise UnsupportedInputError(
            f"implementation={implementation!r} does not support these {op} inputs: {reason} "
            "(implementation=None falls back to a backend that does)"
        )
    return implementation, fn


def _set_kwargs(local: dict, defaults: dict) -> dict:
    """The keyword arguments a caller set: those that differ from the front door's default."""
    out = {}
    for name, default in defaults.items():
        value = local[name]
        if value is default or (type(value) is type(default) and value == default):
            continue
        out[name] = value
    return out


def _dispatch(op: str, implementation: str | None, args: tuple, kwargs: dict):
    _, fn = select_backend(
        op,
        implementation,
        interpret=kwargs.get("interpret", False),
        args=args,
        kwargs=kwargs,
    )
    return fn(*args, **kwargs)


_RANKER_DEFAULTS = dict(
    sm_scale=None, cap=None, config=None, return_lse=False, debug_checks=False, interpret=False
)


def ranker_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bounds: SegmentBounds | jax.Array,
    *,
    sm_scale: float | None = None,
    cap: CapParams | None = None,
    config: KernelConfig | None = None,
    return_lse: bool = False,
    debug_checks: bool = False,
    interpret: Any = False,
    implementation: str | None = None,
):
    """Ranker attention (history + isolated candidates, soft cap, GQA) on the best backend.

    Semantics: docs/semantics.md, "Ranker attention"; a history token attends to the
    whole history, a candidate to the history and to itself; every other row is padding
    (output 0, LSE ``-inf``, zero gradients).

    Args:
      q: ``[B, S, Hq, D]`` float (the Hopper kernels take bf16/fp16 and D in
        {64, 128, 256}; other inputs fall back to the reference, with a warning).
      k, v: ``[B, S, Hkv, D]``, q's dtype, ``Hq % Hkv == 0``.
      bounds: ``SegmentBounds`` or int array ``[B, 4]`` / ``[4]`` = (history_lo,
        history_hi, candidate_lo, candidate_hi); traced data, clipped to ``[0, S]``.
      sm_scale: logit scale, default ``1/sqrt(D)``; applied before the cap.
      cap: ``CapParams`` soft cap (tanh or soft_sign), or ``None``.
      config: ``KernelConfig`` tiling; ``None`` picks the backend's default (the
        reference ignores it).
      return_lse: also return ``lse [B, Hq, S]`` float32 (natural log, differentiable).
      debug_checks: also check at run time that the bounds are in range (``checkify``
        checks: wrap the call in ``jax.experimental.checkify.checkify``).
      interpret: run a Pallas kernel in interpret mode (on a CPU); lifts the device
        check of an explicit ``implementation``.
      implementation: ``None`` (the best installed backend for the default device) or
        ``"mosaic-gpu"``, ``"pallas-tpu"``, ``"reference"``.

    Returns:
      ``out [B, S, Hq, D]`` in q's dtype, or ``(out, lse)``. Differentiable in q, k, v.
    """
    kwargs = _set_kwargs(locals(), _RANKER_DEFAULTS)
    return _dispatch("ranker_attention", implementation, (q, k, v, bounds), kwargs)


_SPARSE_ARGS_DOC = """
    Args:
      q: flat mode ``[B, S, H, Dk]`` (Dk = kv_lora_rank + rope, e.g. 512 + 64); ragged
        paged mode ``[1, T, H, Dk]`` (all requests packed into one row).
      kv: flat mode the latent cache ``[B, T_kv, Dk]``; ragged paged mode the paged cache
        ``[num_pages, page_size // pk, pk, Dk_pad]`` (``pk = kv_packing(dtype)``,
        ``Dk_pad = padded_dk(Dk)``).
      indices: int ``[B, S, K]`` selected units per query: flat mode unit ids (a unit is
        ``read_block`` tokens), ragged mode request-local page ids; ``-1`` or out of
        range = none; duplicates count once.
      positions: int ``[B, S]`` the query's position (keys at positions ``<=`` it only).
      sm_scale: logit scale (required; e.g. ``1/sqrt(192)`` for DeepSeek V3).
      kv_lora_rank: the value width: values are the first ``kv_lora_rank`` features.
      read_block: tokens per selected unit (flat mode; ragged mode: ``page_size``).
      return_lse: also return ``lse [B, S, H]`` float32.
      page_size, q_seq_id, seq_lens, cu_kv_lens, page_indices: ragged paged mode
        (``q_seq_id`` given): tokens per page, request of each query ``[T]``, request
        lengths, cumulative page-table offsets in tokens and the page table; see
        docs/semantics.md, "Sparse MLA prefill".
      debug_checks: also check at run time that the indices are in range.
      interpret: run a Pallas kernel in interpret mode (on a CPU); lifts the device
        check of an explicit ``implementation``.
      implementation: ``None`` (the best installed backend for the default device) or
        ``"mosaic-gpu"``, ``"pallas-tpu"``, ``"reference"``.
"""

_SPARSE_DEFAULTS = dict(
    kv_lora_rank=512,
    read_block=128,
    return_lse=False,
    page_size=None,
    q_seq_id=None,
    seq_lens=None,
    cu_kv_lens=None,
    page_indices=None,
    debug_checks=False,
    interpret=False,
)


def sparse_mla_attention(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    kv_lora_rank: int = 512,
    read_block: int = 128,
    return_lse: bool = False,
    page_size: int | None = None,
    q_seq_id: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
    cu_kv_lens: jax.Array | None = None,
    page_indices: jax.Array | None = None,
    debug_checks: bool = False,
    interpret: Any = False,
    implementation: str | None = None,
):
    kwargs = _set_kwargs(locals(), _SPARSE_DEFAULTS)
    kwargs["sm_scale"] = sm_scale
    return _dispatch("sparse_mla_attention", implementation, (q, kv, indices, positions), kwargs)


sparse_mla_attention.__doc__ = (
    """Sparse MLA prefill (DeepSeek sparse attention) on the best backend: each query
    attends to the selected units of the latent cache (per-query kernel on TPU).
"""
    + _SPARSE_ARGS_DOC
    + """
    Returns:
      ``out [B, S, H, kv_lora_rank]`` float32, or ``(out, lse)``.
    """
)


def sparse_mla_attention_qblock(
    q: jax.Array,
    kv: jax.Array,
    indices: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    kv_lora_rank: int = 512,
    read_block: int = 128,
    return_lse: bool = False,
    page_size: int | None = None,
    q_seq_id: jax.Array | None = None,
    seq_lens: jax.Array | None = None,
    cu_kv_lens: jax.Array | None = None,
    page_indices: jax.Array | None = None,
    query_block: int | None = None,
    u_max: int | None = None,
    head_block: int | None = None,
    debug_checks: bool = False,
    interpret: Any = False,
    implementation: str | None = None,
):
    kwargs = _set_kwargs(
        locals(), {**_SPARSE_DEFAULTS, "query_block": None, "u_max": None, "head_block": None}
    )
    kwargs["sm_scale"] = sm_scale
    return _dispatch(
        "sparse_mla_attention_qblock", implementation, (q, kv, indices, positions), kwargs
    )


sparse_mla_attention_qblock.__doc__ = (
    """Sparse MLA prefill, query-blocked variant, on the best backend: same semantics as
    :func:`sparse_mla_attention` and the same result for every setting of the knobs
    below (they tile the TPU kernel; ``None`` plans the tiling automatically and runs
    the per-query kernel when it moves fewer bytes).
"""
    + _SPARSE_ARGS_DOC
    + """      query_block: queries per program (they share one union of selected units);
        ``None``: planned automatically (docs/tpu_sparse_mla.md).
      u_max: union slots per chunk: a larger union is streamed in chunks, so this is a
        VMEM/speed knob that never changes the answer; ``None``: the backend's default.
      head_block: heads per program (TPU kernel; ``None``: planned automatically).

    Returns:
      ``out [B, S, H, kv_lora_rank]`` float32, or ``(out, lse)``.
    """
)


def paged_write_back(
    cache: jax.Array,
    rows: jax.Array,
    loc: jax.Array,
    *,
    page_size: int,
    r_cap: int | None = None,
    interpret: Any = False,
    implementation: str | None = None,
) -> jax.Array:
    """Write new latent rows into the paged cache on the best backend: ``cache[loc[t]] =
    rows[t]`` for every valid ``loc[t]``; returns the new cache.

    Args:
      cache: paged cache ``[num_pages, page_size // pk, pk, D]``; flat slot ``s`` is page
        ``s // page_size``, row ``s % page_size``.
      rows: ``[T, D]`` new rows, cast to the cache dtype.
      loc: int ``[T]`` flat slot per row; negative or out-of-range rows are dropped. A
        slot listed more than once keeps its last row (as a sequential write would).
      page_size: tokens per page.
      r_cap: size of the TPU kernel's run table (``None``: its default).
      interpret: run a Pallas kernel in interpret mode (on a CPU).
      implementation: ``None`` (best backend) or ``"pallas-tpu"``, ``"reference"``.
    """
    kwargs = _set_kwargs(locals(), dict(r_cap=None, interpret=False))
    kwargs["page_size"] = page_size
    return _dispatch("paged_write_back", implementation, (cache, rows, loc), kwargs)


_PREFILL_DOC = """
    Args:
      ql: ``[T, H, kv_lora_rank]`` absorbed latent query; qpe: ``[T, H, rope]``.
      kvc: ``[T, kv_lora_rank]`` new latents; kpe: ``[T, rope]`` (or ``[T, 1, rope]``).
      cache: the paged cache ``[num_pages, page_size // pk, pk, Dk_pad]``.
      topk_pages: ``[T, K]`` request-local page ids (``-1`` = none).
      positions: ``[T]`` request-local query positions. loc: ``[T]`` flat cache slots.
      seq_lens, cu_q_lens, cu_kv_lens, page_indices: the packed ragged tables.
      kv_lora_rank, page_size, sm_scale: as in :func:`sparse_mla_attention`.
      query_block: queries per program of the query-blocked kernel (``None``: the
        backend's default; the per-query variant accepts it for a drop-in swap).
      u_max: union slots per chunk of the query-blocked kernel (never changes the
        answer; ``None``: its default).
      debug_checks: also check at run time the ragged tables and the indices.
      interpret: run a Pallas kernel in interpret mode (on a CPU).
      implementation: ``None`` (best backend) or ``"pallas-tpu"``, ``"reference"``.
"""

_PREFILL_DEFAULTS = dict(query_block=None, u_max=None, debug_checks=False, interpret=False)


def prefill_write_and_attend_ragged(
    ql: jax.Array,
    qpe: jax.Array,
    kvc: jax.Array,
    kpe: jax.Array,
    cache: jax.Array,
    topk_pages: jax.Array,
    positions: jax.Array,
    loc: jax.Array,
    seq_lens: jax.Array,
    cu_q_lens: jax.Array,
    cu_kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    kv_lora_rank: int,
    page_size: int,
    sm_scale: float,
    query_block: int | None = None,
    u_max: int | None = None,
    debug_checks: bool = False,
    interpret: Any = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    args = (ql, qpe, kvc, kpe, cache, topk_pages, positions, loc, seq_lens, cu_q_lens,
            cu_kv_lens, page_indices)  # fmt: skip
    kwargs = _set_kwargs(locals(), _PREFILL_DEFAULTS)
    kwargs.update(kv_lora_rank=kv_lora_rank, page_size=page_size, sm_scale=sm_scale)
    return _dispatch("prefill_write_and_attend_ragged", implementation, args, kwargs)


prefill_write_and_attend_ragged.__doc__ = (
    """Write the new tokens' latents into the paged cache, then attend (ragged mode,
    per-query kernel on TPU), on the best backend.
"""
    + _PREFILL_DOC
    + """
    Returns:
      ``(out [T, H, kv_lora_rank] float32, new_cache)``.
    """
)


def prefill_write_and_attend_ragged_qblock(
    ql: jax.Array,
    qpe: jax.Array,
    kvc: jax.Array,
    kpe: jax.Array,
    cache: jax.Array,
    topk_pages: jax.Array,
    positions: jax.Array,
    loc: jax.Array,
    seq_lens: jax.Array,
    cu_q_lens: jax.Array,
    cu_kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    kv_lora_rank: int,
    page_size: int,
    sm_scale: float,
    query_block: int | None = None,
    u_max: int | None = None,
    debug_checks: bool = False,
    interpret: Any = False,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    args = (ql, qpe, kvc, kpe, cache, topk_pages, positions, loc, seq_lens, cu_q_lens,
            cu_kv_lens, page_indices)  # fmt: skip
    kwargs = _set_kwargs(locals(), _PREFILL_DEFAULTS)
    kwargs.update(kv_lora_rank=kv_lora_rank, page_size=page_size, sm_scale=sm_scale)
    return _dispatch("prefill_write_and_attend_ragged_qblock", implementation, args, kwargs)


prefill_write_and_attend_ragged_qblock.__doc__ = (
    """Write the new tokens' latents into the paged cache, then attend with the
    query-blocked kernel (ragged mode), on the best backend.
"""
    + _PREFILL_DOC
    + """
    Returns:
      ``(out [T, H, kv_lora_rank] float32, new_cache)``.
    """
)


def backend_version(name: str) -> str:
    """Installed version of a backend's distribution (or its module's ``__version__``)."""
    info = KNOWN_BACKENDS.get(name)
    if info is not None:
        try:
            return metadata.version(info["dist"])
        except metadata.PackageNotFoundError:
            pass
    try:
        return str(getattr(load_backend(name), "__version__", "unknown"))
    except Exception:
        return "unknown"
