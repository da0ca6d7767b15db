"""Backend selection: device classes, preference order, fall-through, explicit errors."""

import inspect
import pydoc
import sys
import types
import warnings
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from attn_common import dispatch
from attn_common.dispatch import BackendUnavailableError, device_class, select_backend

ALL_OPS = dispatch.OPS
RANKER_ONLY = ("ranker_attention",)
SPARSE_ONLY = tuple(op for op in ALL_OPS if op != "ranker_attention")


def _fake_module(name: str, ops) -> types.ModuleType:
    mod = types.ModuleType(name)
    for op in ops:
        setattr(mod, op, lambda *a, _n=name, _op=op, **k: (_n, _op, a, k))
    return mod


@pytest.fixture
def fake(monkeypatch):
    """Install fake backends and a fake default device: ``fake(device, **backends)``."""

    def setup(device, **backends):
        mapping = {}
        for backend, ops in backends.items():
            name = backend.replace("-", "_")
            mod_name = f"_fake_attn_{name}"
            monkeypatch.setitem(sys.modules, mod_name, _fake_module(mod_name, ops))
            mapping[{"mosaic_gpu": "mosaic-gpu", "pallas_tpu": "pallas-tpu"}.get(name, name)] = (
                mod_name
            )
        monkeypatch.setattr(dispatch, "installed_backends", lambda: dict(mapping))
        monkeypatch.setattr(dispatch, "default_device", lambda: device)

    return setup


def _valid_inputs():
    """Tiny valid arguments per op: the front door validates before it dispatches."""
    f32, i32 = np.float32, np.int32
    q = np.zeros((1, 8, 2, 16), f32)
    sparse = (np.zeros((1, 2, 1, 576), f32), np.zeros((1, 16, 576), f32),
              np.zeros((1, 2, 1), i32), np.arange(2, dtype=i32)[None])  # fmt: skip
    cache = np.zeros((2, 8, 2, 640), jnp.bfloat16)
    prefill = (
        np.zeros((2, 1, 512), f32), np.zeros((2, 1, 64), f32), np.zeros((2, 512), f32),
        np.zeros((2, 64), f32), cache, np.zeros((2, 1), i32), np.arange(2, dtype=i32),
        np.arange(2, dtype=i32), np.asarray([2], i32), np.asarray([0, 2], i32),
        np.asarray([0, 16], i32), np.asarray([0], i32),
    )  # fmt: skip
    return {
        "ranker": (q, q, q, np.asarray([0, 4, 4, 8], i32)),
        "sparse": sparse,
        "write": (cache, np.zeros((2, 640), f32), np.arange(2, dtype=i32)),
        "prefill": prefill,
    }


VALID = _valid_inputs()
H200 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
A100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB")
TPU = SimpleNamespace(platform="tpu", device_kind="TPU v5p")
CPU = SimpleNamespace(platform="cpu", device_kind="cpu")


@pytest.mark.parametrize(
    "device, want",
    [
        (H200, "hopper"),
        (SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3"), "hopper"),
        (SimpleNamespace(platform="gpu", device_kind="NVIDIA GH200 480GB"), "hopper"),
        (SimpleNamespace(platform="gpu", device_kind="NVIDIA H800"), "hopper"),
        (
            SimpleNamespace(platform="gpu", device_kind="Some GPU", compute_capability="9.0"),
            "hopper",
        ),
        (SimpleNamespace(platform="gpu", device_kind="Some GPU", compute_capability="8.0"), "gpu"),
        (A100, "gpu"),
        (TPU, "tpu"),
        (CPU, "cpu"),
    ],
)
def test_device_class(device, want):
    assert device_class(device) == want


def test_real_default_device_is_classified():
    assert device_class() in ("cpu", "gpu", "hopper", "tpu")


def test_hopper_prefers_mosaic_and_falls_through_for_missing_ops(fake):
    fake(H200, reference=ALL_OPS, mosaic_gpu=RANKER_ONLY, pallas_tpu=SPARSE_ONLY)
    assert select_backend("ranker_attention")[0] == "mosaic-gpu"
    for op in SPARSE_ONLY:  # mosaic-gpu has no sparse MLA: next in line is the reference
        assert select_backend(op)[0] == "reference"


def test_hopper_without_mosaic_uses_reference(fake):
    fake(H200, reference=ALL_OPS)
    assert select_backend("ranker_attention")[0] == "reference"


def test_tpu_prefers_pallas_tpu(fake):
    fake(TPU, reference=ALL_OPS, mosaic_gpu=RANKER_ONLY, pallas_tpu=SPARSE_ONLY)
    assert select_backend("sparse_mla_attention")[0] == "pallas-tpu"
    assert select_backend("paged_write_back")[0] == "pallas-tpu"
    assert select_backend("ranker_attention")[0] == "reference"


@pytest.mark.parametrize("device", [CPU, A100])
def test_other_devices_use_reference(fake, device):
    fake(device, reference=ALL_OPS, mosaic_gpu=RANKER_ONLY, pallas_tpu=SPARSE_ONLY)
    for op in ALL_OPS:
        assert select_backend(op)[0] == "reference"


def test_nothing_installed_says_how_to_install(fake):
    fake(CPU)
    with pytest.raises(BackendUnavailableError, match=r"pip install .*attn-reference"):
        select_backend("ranker_attention")


def test_explicit_not_installed(fake):
    fake(H200, reference=ALL_OPS)
    with pytest.raises(BackendUnavailableError) as e:
        select_backend("ranker_attention", "mosaic-gpu")
    msg = str(e.value)
    assert "'mosaic-gpu' is not installed" in msg
    assert "pip install" in msg and "./packages/attn-mosaic-gpu" in msg and "jax[cuda13]" in msg


def test_explicit_wrong_device(fake):
    fake(CPU, reference=ALL_OPS, mosaic_gpu=RANKER_ONLY, pallas_tpu=SPARSE_ONLY)
    with pytest.raises(BackendUnavailableError, match=r"runs on hopper.*device is cpu"):
        select_backend("ranker_attention", "mosaic-gpu")
    with pytest.raises(BackendUnavailableError, match=r"runs on tpu.*device is cpu"):
        select_backend("sparse_mla_attention", "pallas-tpu")


def test_explicit_interpret_lifts_device_check(fake):
    fake(CPU, reference=ALL_OPS, pallas_tpu=SPARSE_ONLY)
    assert select_backend("sparse_mla_attention", "pallas-tpu", interpret=True)[0] == "pallas-tpu"
    # and the dispatching op forwards interpret to the backend
    name, op, _, kwargs = dispatch.sparse_mla_attention(
        *VALID["sparse"], implementation="pallas-tpu", interpret=True, sm_scale=0.1
    )
    assert (name, op, kwargs["interpret"], kwargs["sm_scale"]) == (
        "_fake_attn_pallas_tpu",
        "sparse_mla_attention",
        True,
        0.1,
    )


def test_explicit_backend_lacking_op(fake):
    fake(H200, reference=ALL_OPS, mosaic_gpu=RANKER_ONLY)
    with pytest.raises(BackendUnavailableError, match=r"does not implement 'sparse_mla_attention'"):
        select_backend("sparse_mla_attention", "mosaic-gpu")


def test_explicit_never_falls_through(fake):
    fake(H200, reference=ALL_OPS, mosaic_gpu=RANKER_ONLY)
    assert select_backend("ranker_attention", "reference")[0] == "reference"


def test_unknown_names(fake):
    fake(CPU, reference=ALL_OPS)
    with pytest.raises(BackendUnavailableError, match="unknown implementation 'cuda'"):
        select_backend("ranker_attention", "cuda")
    with pytest.raises(ValueError, match="op: got 'attention'"):
        select_backend("attention")


def test_each_op_dispatches_with_its_arguments(fake):
    fake(CPU, reference=ALL_OPS)
    calls = {
        "ranker_attention": lambda: dispatch.ranker_attention(*VALID["ranker"], cap=None),
        "sparse_mla_attention": lambda: dispatch.sparse_mla_attention(
            *VALID["sparse"], sm_scale=1.0
        ),
        "sparse_mla_attention_qblock": lambda: dispatch.sparse_mla_attention_qblock(
            *VALID["sparse"], sm_scale=1.0, query_block=8
        ),
        "paged_write_back": lambda: dispatch.paged_write_back(*VALID["write"], page_size=16),
        "prefill_write_and_attend_ragged": lambda: dispatch.prefill_write_and_attend_ragged(
            *VALID["prefill"], kv_lora_rank=512, page_size=16, sm_scale=1.0
        ),
        "prefill_write_and_attend_ragged_qblock": (
            lambda: dispatch.prefill_write_and_attend_ragged_qblock(
                *VALID["prefill"], kv_lora_rank=512, page_size=16, sm_scale=1.0, query_block=8
            )
        ),
    }
    assert set(calls) == set(ALL_OPS)
    for op, call in calls.items():
        name, got_op, args, kwargs = call()
        assert (name, got_op) == ("_fake_attn_reference", op)
        assert "implementation" not in kwargs and args


def test_entry_points_then_known_modules(monkeypatch):
    ep = SimpleNamespace(name="reference", value="attn_reference")
    monkeypatch.setattr(dispatch.metadata, "entry_points", lambda group: [ep])
    assert dispatch.installed_backends() == {"reference": "attn_reference"}
    # no entry points at all (a PYTHONPATH checkout): the known modules on sys.path
    monkeypatch.setattr(dispatch.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(
        dispatch.importlib.util,
        "find_spec",
        lambda name: object() if name != "attn_pallas_tpu" else None,
    )
    assert dispatch.installed_backends() == {
        "reference": "attn_reference",
        "mosaic-gpu": "attn_mosaic_gpu",
    }


def test_real_dispatch_matches_reference():
    attn_reference = pytest.importorskip("attn_reference")
    import attn_common

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 32, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 32, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 32, 2, 16)), jnp.float32)
    bounds = jnp.array([0, 20, 20, 28], jnp.int32)
    want = attn_reference.ranker_attention(q, k, v, bounds)
    if device_class() == "cpu":
        np.testing.assert_array_equal(attn_common.ranker_attention(q, k, v, bounds), want)
    got = attn_common.ranker_attention(q, k, v, bounds, implementation="reference")
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- input fallback


def _fake_with_supports(name: str, ops, reason_for) -> types.ModuleType:
    """A fake backend whose ``supports`` rejects inputs for which ``reason_for`` says so."""
    mod = _fake_module(name, ops)
    mod.supports = lambda op, *args, **kwargs: reason_for(op, args, kwargs)
    return mod


@pytest.fixture
def fake_supports(monkeypatch):
    """Hopper with a mosaic-gpu that takes bf16 only, plus the reference."""

    def reason(op, args, kwargs):
        q = args[0]
        if getattr(q, "dtype", None) != jnp.bfloat16:
            return f"q: got dtype {q.dtype}, the Hopper kernels take bfloat16"
        if q.shape[-1] == 96:
            return "q: got head dim D = 96"
        return None

    monkeypatch.setitem(
        sys.modules, "_fake_mgpu", _fake_with_supports("_fake_mgpu", RANKER_ONLY, reason)
    )
    monkeypatch.setitem(sys.modules, "_fake_ref", _fake_module("_fake_ref", ALL_OPS))
    monkeypatch.setattr(
        dispatch,
        "installed_backends",
        lambda: {"mosaic-gpu": "_fake_mgpu", "reference": "_fake_ref"},
    )
    monkeypatch.setattr(dispatch, "default_device", lambda: H200)
    monkeypatch.setattr(dispatch, "_FALLBACK_WARNED", set())


def test_supported_inputs_run_on_the_preferred_backend(fake_supports, recwarn):
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    assert dispatch.ranker_attention(q, q, q, [0, 4, 4, 8])[0] == "_fake_mgpu"
    assert not [w for w in recwarn if issubclass(w.category, dispatch.BackendFallbackWarning)]


@pytest.mark.parametrize(
    "q, why",
    [
        (jnp.zeros((1, 8, 2, 64), jnp.float32), "dtype float32"),
        (jnp.zeros((1, 8, 2, 96), jnp.bfloat16), "D = 96"),
    ],
)
def test_unsupported_inputs_fall_back_with_one_warning(fake_supports, q, why):
    with pytest.warns(dispatch.BackendFallbackWarning, match=rf"'mosaic-gpu'.*{why}.*'reference'"):
        got = dispatch.ranker_attention(q, q, q, [0, 4, 4, 8])
    assert got[0] == "_fake_ref"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call warns no more
        assert dispatch.ranker_attention(q, q, q, [0, 4, 4, 8])[0] == "_fake_ref"


def test_explicit_implementation_raises_the_clear_error(fake_supports):
    q = jnp.zeros((1, 8, 2, 64), jnp.float32)
    with pytest.raises(dispatch.UnsupportedInputError, match=r"'mosaic-gpu'.*dtype float32"):
        dispatch.ranker_attention(q, q, q, [0, 4, 4, 8], implementation="mosaic-gpu")
    with pytest.raises(ValueError) as e:  # no fallback is promised for an explicit choice
        dispatch.ranker_attention(q, q, q, [0, 4, 4, 8], implementation="mosaic-gpu")
    assert "falls back" not in str(e.value)
    assert dispatch.ranker_attention(q, q, q, [0, 4, 4, 8], implementation="reference")[0] == (
        "_fake_ref"
    )


def test_no_backend_supports_the_inputs(monkeypatch):
    never = _fake_with_supports("_fake_never", ALL_OPS, lambda op, a, k: "never")
    monkeypatch.setitem(sys.modules, "_fake_never", never)
    monkeypatch.setattr(dispatch, "installed_backends", lambda: {"reference": "_fake_never"})
    monkeypatch.setattr(dispatch, "default_device", lambda: CPU)
    with pytest.raises(dispatch.UnsupportedInputError, match="reference: never"):
        dispatch.ranker_attention(*VALID["ranker"])


def test_select_backend_without_inputs_ignores_supports(fake_supports):
    assert select_backend("ranker_attention")[0] == "mosaic-gpu"


def test_only_arguments_the_caller_set_are_passed_on(fake):
    fake(CPU, reference=ALL_OPS)
    *_, kwargs = dispatch.ranker_attention(*VALID["ranker"])
    assert kwargs == {}
    *_, kwargs = dispatch.ranker_attention(*VALID["ranker"], debug_checks=True, return_lse=True)
    assert kwargs == {"debug_checks": True, "return_lse": True}
    *_, kwargs = dispatch.sparse_mla_attention_qblock(*VALID["sparse"], sm_scale=0.5, head_block=2)
    assert kwargs == {"sm_scale": 0.5, "head_block": 2}
    *_, kwargs = dispatch.prefill_write_and_attend_ragged(
        *VALID["prefill"], kv_lora_rank=512, page_size=16, sm_scale=1.0
    )
    assert kwargs == {"kv_lora_rank": 512, "page_size": 16, "sm_scale": 1.0}


@pytest.mark.parametrize("op", dispatch.OPS)
def test_front_doors_have_full_signatures_and_argument_docs(op):
    fn = getattr(dispatch, op)
    params = inspect.signature(fn).parameters
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())
    assert "implementation" in params and "interpret" in params
    doc = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    assert "Args:" in doc and "implementation:" in doc
    for name in params:
        assert name in doc
    reference = pytest.importorskip("attn_reference")
    ref_params = inspect.signature(getattr(reference, op)).parameters
    # every argument of the reference is an argument of the front door
    assert set(ref_params) <= set(params)


@pytest.mark.parametrize("op", dispatch.OPS)
def test_every_installed_backend_takes_the_spec(op):
    """Each installed backend's public op has the spec's signature (the front door's
    without ``implementation``: names, kinds, defaults), then keyword-only extras only;
    so no backend restates or drifts from an op's arguments."""
    door = inspect.signature(getattr(dispatch, op)).parameters.values()
    spec = [p for p in door if p.name != "implementation"]
    assert "debug_checks" in [p.name for p in spec]
    checked = 0
    for name in dispatch.installed_backends():
        try:
            module = dispatch.load_backend(name)
        except BackendUnavailableError:
            continue
        fn = getattr(module, op, None)
        if fn is None:  # a third-party backend may lack an op; the shipped ones have all
            assert name not in dispatch.KNOWN_BACKENDS, f"{name} does not export {op}"
            continue
        params = list(inspect.signature(fn).parameters.values())
        assert params[: len(spec)] == spec, (name, op, params)
        extras = params[len(spec) :]
        assert all(p.kind is p.KEYWORD_ONLY for p in extras), (name, op, extras)
        checked += 1
    assert checked or not dispatch.installed_backends()


def test_real_fp32_ranker_falls_back_to_reference_on_hopper(monkeypatch):
    """The real mosaic-gpu ``supports`` on a (faked) Hopper default device."""
    attn_reference = pytest.importorskip("attn_reference")
    pytest.importorskip("attn_mosaic_gpu")
    monkeypatch.setattr(dispatch, "default_device", lambda: H200)
    monkeypatch.setattr(dispatch, "_FALLBACK_WARNED", set())
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 16, 2, 96)), jnp.float32)
    bounds = jnp.array([0, 10, 10, 14], jnp.int32)
    with pytest.warns(dispatch.BackendFallbackWarning, match="float32"):
        got = dispatch.ranker_attention(q, q, q, bounds, debug_checks=True)
    np.testing.assert_array_equal(got, attn_reference.ranker_attention(q, q, q, bounds))
