"""Every backend under ``jax_enable_x64``: a user whose program enables 64-bit types gets
the same bits as without, forward and gradients, from each op (ranker attention and
sparse MLA; kernels in interpret mode on the CPU, natively on their accelerator), and
the compiled kernels lower for their accelerator. Python integers become int64 there,
so an index computation that mixes them with the kernels' int32 values would fail to
trace or lower.

The 64-bit side runs in a subprocess started with ``JAX_ENABLE_X64=1`` (this file as a
script): flipping the flag inside a test worker would leak into the interpreters'
callback threads and into whatever else that process runs.

Every interpret-mode call runs to the end (``run_interpret``) before the next is
dispatched, and each gradient is one jitted program: the interpreters of jax 0.11.2
dispatch JAX operations from their callback threads, and with more eager work queued
behind a running kernel on a 2-core machine both can wait on each other for good (seen
here: two test workers idle in ``_deallocate_barrier``'s slicing while the main thread
dispatched the backward's ops).

The quick tier (``-m "not slow"``) checks each op once, on the reference; the kernels'
interpret-mode runs and the lowerings are ``slow`` (``nox -s tests-cpu-full`` runs them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # run as a script: the helpers beside it
from conformance import RANKER, SPARSE_MLA, slow_off_accelerator
from helpers import attended_rows_flat, poison_rows, randn, rng_for, run_interpret

from attn_common import CapMethod, CapParams

LOWER_CASES = ["sparse-mla", "ranker", "ranker-packed"]
KERNEL_PACKAGES = [("attn_mosaic_gpu", "cuda"), ("attn_pallas_tpu", "tpu")]


def sparse_mla_run(backend) -> list[np.ndarray]:
    """out, LSE, attention mass, dq, dkv: a flat token-level (or 16-token-unit) call
    over a dirty cache, with an empty query and a duplicate id."""
    fn = backend.module().sparse_mla_attention
    read_block = 1 if backend.read_block_1 else 16
    kw = dict(backend.call_kwargs(), sm_scale=576**-0.5, read_block=read_block)
    rng = rng_for(7)
    kv_len, seq, heads = 40, 3, 16
    q = jnp.asarray(randn(rng, (1, seq, heads, 576), np.float32), jnp.bfloat16)
    idx = rng.integers(-1, -(-kv_len // read_block) + 2, (1, seq, 4)).astype(np.int32)
    idx[0, 0] = -1  # nothing selected
    idx[0, 1, 1] = idx[0, 1, 0]  # a duplicate
    pos = np.asarray([[3, 20, 39]], np.int32)
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=read_block)
    kv = jnp.asarray(
        poison_rows(randn(rng, (1, kv_len, 576), np.float32), keep, seed=7), jnp.bfloat16
    )
    w = jnp.asarray(randn(rng, (1, seq, heads, 512), np.float32))

    def loss(q, kv):
        out, lse, mass = fn(q, kv, idx, pos, return_lse=True, return_attn_mass=True, **kw)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * w) + jnp.sum(finite), (out, lse, mass)

    grads, outs = run_interpret(jax.jit(jax.grad(loss, (0, 1), has_aux=True)), q, kv)
    return [np.asarray(a) for a in (*outs, *grads)]


def ranker_run(backend) -> list[np.ndarray]:
    """out, LSE and the gradients of a capped GQA call with padding."""
    fn = backend.module().ranker_attention
    kw = backend.call_kwargs()
    if backend.config is not None:
        kw["config"] = backend.config
    rng = rng_for(8)
    q, k, v = (jnp.asarray(randn(rng, (2, 128, 2, 64), np.float32), jnp.bfloat16)
               for _ in range(3))  # fmt: skip
    bounds = jnp.asarray([[0, 70, 70, 100], [5, 40, 60, 128]], jnp.int32)
    cap = CapParams(CapMethod.TANH, 5.0)
    w = jnp.asarray(randn(rng, (2, 128, 2, 64), np.float32))

    def loss(q, k, v):  # through out only (the LSE's cotangent is zero)
        out, lse = fn(q, k, v, bounds, cap=cap, return_lse=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    grads, outs = run_interpret(jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True)), q, k, v)
    return [np.asarray(a) for a in (*outs, *grads)]


def lowered(package: str, platform: str, case: str) -> list[np.ndarray]:
    """The case's gradient lowered for ``platform`` (a CUDA or TPU module on any host):
    the compiled kernels' paths, which interpret mode does not run."""
    module = __import__(package)
    s = jax.ShapeDtypeStruct
    if case == "sparse-mla":

        def fn(q, kv, idx, pos):
            out, lse = module.sparse_mla_attention(
                q, kv, idx, pos, sm_scale=0.05, read_block=16, return_lse=True
            )
            return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        grad, args = jax.grad(fn, (0, 1)), (
            s((1, 64, 64, 576), jnp.bfloat16), s((1, 2048, 576), jnp.bfloat16),
            s((1, 64, 8), jnp.int32), s((1, 64), jnp.int32),
        )  # fmt: skip
    else:
        cap = CapParams(CapMethod.SOFT_SIGN, 8.0)

        def fn(q, k, v, bounds):
            return jnp.sum(module.ranker_attention(q, k, v, bounds, cap=cap).astype(jnp.float32))

        kv = s((2, 256, 2, 128), jnp.bfloat16)
        bounds = s((2, 3, 4) if case == "ranker-packed" else (2, 4), jnp.int32)
        grad, args = jax.grad(fn, (0, 1, 2)), (s((2, 256, 4, 128), jnp.bfloat16), kv, kv, bounds)
    text = jax.export.export(jax.jit(grad), platforms=[platform])(*args).mlir_module()
    return [np.asarray("custom_call" in text)]


def _backend(op: str, name: str):
    return next(b for b in (SPARSE_MLA if op == "sparse-mla" else RANKER) if b.name == name)


def _run(kind: str, *names: str) -> list[np.ndarray]:
    if kind == "lower":  # every case in one process: one JAX start per package
        return [a for case in LOWER_CASES for a in lowered(*names, case)]
    backend = _backend(kind, names[0])
    return (sparse_mla_run if kind == "sparse-mla" else ranker_run)(backend)


def _with_x64(tmp_path, kind: str, *names: str) -> list[np.ndarray]:
    """``_run(kind, *names)`` in a fresh process with 64-bit types on."""
    out = tmp_path / "x64.npz"
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    done = subprocess.run(
        [sys.executable, __file__, str(out), kind, *names],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(out) as f:  # raw bytes and dtype names: npz does not keep bfloat16
        count = len(f.files) // 2
        return [f[f"a{i}"].view(jnp.dtype(str(f[f"d{i}"]))) for i in range(count)]


def _params(backends):
    """``pytest.param`` per backend, the kernels ``slow`` in interpret mode: one check per
    op, the reference's, in the quick tier (``conformance.slow_off_accelerator``)."""
    return [
        pytest.param(b, id=b.name, marks=() if b.name == "reference" else slow_off_accelerator(b))
        for b in backends
    ]


def _assert_same(plain, wide):
    assert len(plain) == len(wide)
    for a, b in zip(plain, wide, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", _params(SPARSE_MLA))
def test_sparse_mla_same_bits_under_x64(backend, tmp_path):
    backend.require()
    plain = sparse_mla_run(backend)
    _assert_same(plain, _with_x64(tmp_path, "sparse-mla", backend.name))
    assert np.isfinite(plain[-1]).all()  # the dirty rows stay out of the cache gradient


@pytest.mark.parametrize("backend", _params(RANKER))
def test_ranker_same_bits_under_x64(backend, tmp_path):
    backend.require()
    _assert_same(ranker_run(backend), _with_x64(tmp_path, "ranker", backend.name))


@pytest.mark.slow  # one lowering per package: 6 s (TPU) and 20 s (CUDA) here
@pytest.mark.parametrize(("package", "platform"), KERNEL_PACKAGES)
def test_kernels_lower_under_x64(package, platform, tmp_path):
    pytest.importorskip(package, reason=f"{package} is not installed")
    kernels = _with_x64(tmp_path, "lower", package, platform)
    found = {case: bool(a) for case, a in zip(LOWER_CASES, kernels, strict=True)}
    assert found == dict.fromkeys(LOWER_CASES, True), f"no kernel in the module: {found}"


if __name__ == "__main__":  # the 64-bit side: OUT KIND NAMES...
    assert jax.config.jax_enable_x64
    arrays = _run(*sys.argv[2:])
    np.savez(
        sys.argv[1],
        **{f"a{i}": np.ascontiguousarray(a).view(np.uint8) for i, a in enumerate(arrays)},
        **{f"d{i}": np.asarray(a.dtype.name) for i, a in enumerate(arrays)},
    )
