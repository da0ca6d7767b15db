"""One front door: call an op on the best installed backend for the default device.

Backends register through the Python entry-point group ``attn.backends`` (declared in
each backend's ``pyproject.toml``)::

    [project.entry-points."attn.backends"]
    reference = "attn_reference"

The entry's value is the module that exports the ops under the shared names of SPEC
section 9. When no entry point is found at all (a ``PYTHONPATH`` checkout that was never
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
sparse MLA kernels yet, so sparse MLA on a Hopper GPU runs on the reference, and
``pallas-tpu`` has no ranker kernel yet). Selection looks at the forward op only:
``jax.grad`` of the selected op runs that backend's backward.

An explicit ``implementation="mosaic-gpu"`` (or any other name) never falls through: if
the backend is not installed, does not run on the default device, or does not export
the op, :class:`BackendUnavailableError` says which and how to install it. Passing a
truthy ``interpret=`` (Pallas interpret mode) lifts the device check, so that e.g.
``implementation="pallas-tpu", interpret=True`` runs the TPU kernels on the CPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax

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
    op: str, implementation: str | None = None, *, device: Any = None, interpret: Any = False
) -> tuple[str, Callable[..., Any]]:
    """The backend name and function that ``op`` dispatches to (see the module docstring)."""
    _check_op(op)
    dev_class = device_class(device)
    if implementation is None:
        installed = installed_backends()
        order = PREFERENCE.get(dev_class, DEFAULT_PREFERENCE)
        for name in order:
            if name not in installed:
                continue
            try:
                module = load_backend(name)
            except BackendUnavailableError:
                continue
            fn = getattr(module, op, None)
            if fn is not None:
                return name, fn
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
            "use implementation=None for the best backend here, pass interpret=True to run "
            "the kernels in Pallas interpret mode, or on a supported machine "
            + _install_hint(implementation)
        )
    fn = getattr(module, op, None)
    if fn is None:
        others = [n for n in _implementers(op, installed_backends()) if n != implementation]
        raise BackendUnavailableError(
            f"backend {implementation!r} does not implement {op!r} (yet); installed backends "
            f"that do: {others or 'none'}" + ("" if others else "; " + _install_hint("reference"))
        )
    return implementation, fn


def _dispatch(op: str, implementation: str | None, args, kwargs):
    _, fn = select_backend(op, implementation, interpret=kwargs.get("interpret", False))
    return fn(*args, **kwargs)


def ranker_attention(q, k, v, bounds, *, implementation: str | None = None, **kwargs):
    """Ranker attention on the selected backend; arguments as in SPEC section 9
    (``sm_scale``, ``cap``, ``config``, ``return_lse``, plus backend extras)."""
    return _dispatch("ranker_attention", implementation, (q, k, v, bounds), kwargs)


def sparse_mla_attention(q, kv, indices, positions, *, implementation: str | None = None, **kw):
    """Sparse MLA prefill (per-query kernel on TPU) on the selected backend."""
    return _dispatch("sparse_mla_attention", implementation, (q, kv, indices, positions), kw)


def sparse_mla_attention_qblock(
    q, kv, indices, positions, *, implementation: str | None = None, **kw
):
    """Sparse MLA prefill, query-blocked variant (``query_block``, ``u_max``)."""
    return _dispatch("sparse_mla_attention_qblock", implementation, (q, kv, indices, positions), kw)


def paged_write_back(cache, rows, loc, *, implementation: str | None = None, **kwargs):
    """Write new latent rows into the paged cache; returns the new cache."""
    return _dispatch("paged_write_back", implementation, (cache, rows, loc), kwargs)


def prefill_write_and_attend_ragged(*args, implementation: str | None = None, **kwargs):
    """Write the new tokens' latents into the paged cache, then attend (per-query)."""
    return _dispatch("prefill_write_and_attend_ragged", implementation, args, kwargs)


def prefill_write_and_attend_ragged_qblock(*args, implementation: str | None = None, **kwargs):
    """Write the new tokens' latents into the paged cache, then attend (query-blocked)."""
    return _dispatch("prefill_write_and_attend_ragged_qblock", implementation, args, kwargs)


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
