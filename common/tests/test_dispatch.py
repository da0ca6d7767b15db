"""Backend selection: device classes, preference order, fall-through, explicit errors."""

import sys
import types
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
        1, 2, 3, 4, implementation="pallas-tpu", interpret=True, sm_scale=0.1
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
        "ranker_attention": lambda: dispatch.ranker_attention(1, 2, 3, 4, cap=None),
        "sparse_mla_attention": lambda: dispatch.sparse_mla_attention(1, 2, 3, 4, sm_scale=1.0),
        "sparse_mla_attention_qblock": lambda: dispatch.sparse_mla_attention_qblock(
            1, 2, 3, 4, sm_scale=1.0, query_block=8
        ),
        "paged_write_back": lambda: dispatch.paged_write_back(1, 2, 3, page_size=16),
        "prefill_write_and_attend_ragged": lambda: dispatch.prefill_write_and_attend_ragged(
            *range(12), kv_lora_rank=512, page_size=16, sm_scale=1.0
        ),
        "prefill_write_and_attend_ragged_qblock": (
            lambda: dispatch.prefill_write_and_attend_ragged_qblock(
                *range(12), kv_lora_rank=512, page_size=16, sm_scale=1.0, query_block=8
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
