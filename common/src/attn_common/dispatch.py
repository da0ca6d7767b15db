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
backend that lacks the op falls through to the next (every backend here exports all of
``OPS``; a third-party one may not). Selection looks at the forward op only:
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

The front-door functions take the op's spec (``attn_common.spec``: one signature,
one set of argument docs, one validation for every backend). Each call is validated
once, before a backend is chosen, so a bad input gets the same error on every device;
the selected backend's ``impl`` receives the validated call value. Keyword arguments
the caller did not set are not passed on to ``supports`` or to a third-party backend,
so each applies its own default.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax

from attn_common.spec import prefill_call, ranker_call, sparse_mla_call, write_back_call

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
            f"implementation={implementation!r} does not support these {op} inputs: {reason}"
        )
    return implementation, fn


_SPECS: dict[str, Callable[..., Any]] = {
    "ranker_attention": ranker_call,
    "sparse_mla_attention": sparse_mla_call,
    "sparse_mla_attention_qblock": sparse_mla_call,
    "paged_write_back": write_back_call,
    "prefill_write_and_attend_ragged": prefill_call,
    "prefill_write_and_attend_ragged_qblock": prefill_call,
}


def _dispatch(op: str, implementation: str | None, args: tuple, kwargs: dict):
    """Validate once with the op's spec (the same errors whichever backend runs it),
    select the backend, and hand it the validated call (``fn.impl``; a backend function
    without one, e.g. a third-party backend, gets the arguments as given)."""
    call = _SPECS[op](*args, **kwargs)
    _, fn = select_backend(
        op,
        implementation,
        interpret=kwargs.get("interpret", False),
        args=args,
        kwargs=kwargs,
    )
    impl = getattr(fn, "impl", None)
    return impl(call) if impl is not None else fn(*args, **kwargs)


_IMPLEMENTATION_DOC = """      implementation: ``None`` (the best installed backend for the default device) or
        ``"mosaic-gpu"``, ``"pallas-tpu"``, ``"reference"``.
"""


def _front_door(op: str, summary: str) -> Callable[..., Any]:
    """The front-door function of ``op``: the spec's signature plus ``implementation``.

    Only the arguments the caller set are passed on (the backend applies its defaults).
    """
    builder = _SPECS[op]
    sig = inspect.signature(builder)
    arrays = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]

    def door(*args, implementation: str | None = None, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments  # the arguments the caller set
        positional = tuple(bound.pop(name) for name in arrays if name in bound)
        return _dispatch(op, implementation, positional, bound)

    implementation = inspect.Parameter(
        "implementation", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None"
    )
    door.__signature__ = sig.replace(
        parameters=[*sig.parameters.values(), implementation],
        return_annotation=inspect.Signature.empty,
    )
    spec_doc = inspect.getdoc(builder) or ""
    args_doc, _, returns = spec_doc[spec_doc.index("Args:") :].partition("\nReturns:")
    args_doc = "\n".join("    " + line if line else line for line in args_doc.splitlines())
    returns = "\n".join("    " + line if line else line for line in returns.splitlines())
    door.__doc__ = (
        f"{summary}\n\n    Semantics and arguments: ``attn_common.spec.{builder.__name__}`` "
        f"(one spec for every backend).\n\n{args_doc}\n{_IMPLEMENTATION_DOC}\n"
        f"    Returns:{returns}\n"
    )
    door.__name__ = door.__qualname__ = op
    door.__module__ = __name__
    return door


ranker_attention = _front_door(
    "ranker_attention",
    """Ranker attention (history + isolated candidates, soft cap, GQA) on the best backend.

    A history token attends to the whole history, a candidate to the history and to
    itself; every other row is padding (output 0, LSE ``-inf``, zero gradients). Inputs
    a preferred kernel cannot take (say fp32 on Hopper) run on the next backend, with a
    warning.""",
)
sparse_mla_attention = _front_door(
    "sparse_mla_attention",
    """Sparse MLA prefill (DeepSeek sparse attention) on the best backend: each query
    attends to the selected units of the latent cache (per-query kernel on TPU).""",
)
sparse_mla_attention_qblock = _front_door(
    "sparse_mla_attention_qblock",
    """Sparse MLA prefill, query-blocked variant, on the best backend: same semantics as
    :func:`sparse_mla_attention` and the same result for every setting of the knobs
    (they tile the TPU kernel; ``None`` plans the tiling automatically and runs the
    per-query kernel when it moves fewer bytes).""",
)
paged_write_back = _front_door(
    "paged_write_back",
    """Write new latent rows into the paged cache on the best backend: ``cache[loc[t]] =
    rows[t]`` for every ``loc[t] >= 0``; returns the new cache.""",
)
prefill_write_and_attend_ragged = _front_door(
    "prefill_write_and_attend_ragged",
    """Write the new tokens' latents into the paged cache, then attend (ragged mode,
    per-query kernel on TPU), on the best backend.""",
)
prefill_write_and_attend_ragged_qblock = _front_door(
    "prefill_write_and_attend_ragged_qblock",
    """Write the new tokens' latents into the paged cache, then attend with the
    query-blocked kernel (ragged mode), on the best backend.""",
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
