"""The backend registry of the conformance suite: one entry per implementation.

Each conformance test is written once and parametrized over ``RANKER`` or
``SPARSE_MLA``; a backend's ``supports`` flags say which cases it takes (dtypes, head
dims, packed rows, caps, ``read_block=1``, paged, ``return_lse``, gradients), so a case a
backend does not take is not generated for it. ``Backend.call`` runs the backend the way
this machine can: natively on its own accelerator, in Pallas interpret mode on the CPU
(Mosaic GPU's and Mosaic TPU's interpreters: race detection on, uninitialised memory
NaN, so an unwritten output element fails the comparison), or not at all (skipped with
the reason). The reference runs everywhere; the others are compared against it in
float32 at HIGHEST precision on the upcast inputs (``reference_f32``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from helpers import gpu_interpret, quick_tier, tpu_interpret
from hypothesis import HealthCheck, Phase, settings

from attn_common import KernelConfig

# dtype name -> (rel L2, max-abs) of an output against the float32 reference.
OUT_TOL = {"float32": (2e-5, 2e-4), "bfloat16": (2e-2, 6e-2), "float16": (5e-3, 1e-2)}
# dtype name -> max-abs of the LSE on non-empty rows.
LSE_ATOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
# Sparse MLA: the LSE's max-abs (scores reach larger values than the ranker's).
SPARSE_LSE_ATOL = {"float32": 1e-4, "bfloat16": 5e-2}
# dtype name -> rel L2 of a gradient; max-abs <= 5 x this x max|reference gradient|.
GRAD_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation and what it supports.

    name: the ``implementation`` name. package / install: its import name and the
    command that installs it. native: the ``jax.default_backend()`` it runs on without
    interpretation (``None``: every platform). interpret: the interpreter parameters for
    running it on the CPU (``None``: it has no interpret mode). The remaining fields are
    the ``supports`` flags of the op the registry is for; ``config`` is a small tiling
    that keeps interpret mode quick (``None``: the backend's default)."""

    name: str
    package: str
    install: str
    native: str | None
    interpret: Callable[[], object] | None
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...] | None = None  # None: any
    packed: bool = True
    packed_head_dims: tuple[int, ...] | None = None  # packed rows [B, U, 4]; None: as head_dims
    caps: tuple[str, ...] = ("none", "tanh", "soft_sign")
    return_lse: bool = True
    grad: bool = True
    read_block_1: bool = True
    paged: bool = True
    config: object = None
    # Ranker head dims with a backward kernel of their own: test_grad's first case of each
    # is ``slow`` only in interpret mode (``slow_off_accelerator``), the others always.
    grad_kernel_head_dims: tuple[int, ...] = ()
    # Sparse MLA over an FP8 latent cache (attn_common.Fp8LatentCache) in its kernels.
    fp8: bool = False
    # Flat/paged sparse MLA: feature split and row multiple the kernels need.
    sparse_dims: tuple[int, int] = (128, 64)  # (Dv, Drope): Dk = Dv + Drope
    sparse_row_multiple: int = 1
    # Generated examples per sparse MLA test off the accelerator, besides the explicit
    # edge-case example (0: that one only; an interpret-mode run of the Hopper kernel at
    # these shapes took 20-60 s on the shared 2-core machine, 2 + 2 per test: too long).
    sparse_examples: int = 2
    # Generated examples of the drawn ranker gradient test off the accelerator, besides
    # its explicit edge-case example (an interpret-mode backward at B1 S96 D64 took about
    # 10 s per run for the Hopper kernels and 1 s for the TPU ones, plus one compile of
    # 15-25 s, on the shared 2-core machine at load 5).
    grad_examples: int = 4
    # At most this many generated examples per test in the quick tier off the accelerator
    # (``examples``; None: as in the full tier). Hopper's: 0, its interpreter took about
    # 2 s per ranker forward example here; the reference and TPU kernels draw the quick
    # tier's examples.
    quick_examples: int | None = None

    def __str__(self) -> str:
        return self.name

    def module(self):
        """The backend's package; skips the test when it is not installed."""
        if importlib.util.find_spec(self.package) is None:
            pytest.skip(f"{self.package} is not installed ({self.install})")
        return importlib.import_module(self.package)

    def call_kwargs(self) -> dict:
        """``interpret=`` for this machine, or a skip when the backend cannot run here."""
        platform = jax.default_backend()
        if self.native is None or platform == self.native:
            return {}
        if platform == "cpu" and self.interpret is not None:
            return {"interpret": self.interpret()}
        pytest.skip(f"{self.name} runs natively on {self.native} and in interpret mode on cpu")

    def require(self) -> None:
        """Skip the test unless the backend is installed and can run on this machine
        (called before hypothesis starts, so a skip is not reported as a failing example)."""
        self.module()
        self.call_kwargs()

    def takes(self, *, dtype: str, head_dim: int | None = None, cap: str = "none") -> bool:
        return (
            dtype in self.dtypes
            and (self.head_dims is None or head_dim is None or head_dim in self.head_dims)
            and cap in self.caps
        )


REFERENCE_INSTALL = "pip install ./packages/attn-reference"
MOSAIC_GPU_INSTALL = "pip install ./packages/attn-mosaic-gpu"
PALLAS_TPU_INSTALL = "pip install ./packages/attn-pallas-tpu"

RANKER = (
    Backend(
        "reference", "attn_reference", REFERENCE_INSTALL, None, None,
        dtypes=("float32", "bfloat16", "float16"), grad_examples=2,
    ),
    Backend(
        "mosaic-gpu", "attn_mosaic_gpu", MOSAIC_GPU_INSTALL, "gpu", gpu_interpret,
        dtypes=("bfloat16", "float16"), head_dims=(64, 128, 256),
        packed_head_dims=(64, 128), grad_kernel_head_dims=(64, 256),
        config=KernelConfig(block_q=64, block_kv=64, num_stages=2), grad_examples=2,
        quick_examples=0,
    ),
    Backend(
        "pallas-tpu", "attn_pallas_tpu", PALLAS_TPU_INSTALL, "tpu", tpu_interpret,
        dtypes=("float32", "bfloat16"), head_dims=(64, 128, 256), grad_kernel_head_dims=(64, 128),
        config=KernelConfig(block_q=128, block_kv=128),
    ),
)  # fmt: skip

SPARSE_MLA = (
    Backend(
        "reference", "attn_reference", REFERENCE_INSTALL, None, None,
        dtypes=("float32", "bfloat16"), fp8=True,
    ),
    Backend(
        "mosaic-gpu", "attn_mosaic_gpu", MOSAIC_GPU_INSTALL, "gpu", gpu_interpret,
        dtypes=("bfloat16",), sparse_examples=0,
    ),
    Backend(
        "pallas-tpu", "attn_pallas_tpu", PALLAS_TPU_INSTALL, "tpu", tpu_interpret,
        dtypes=("float32", "bfloat16"), read_block_1=False, sparse_row_multiple=8, fp8=True,
    ),
)  # fmt: skip


# Hypothesis examples per test where a kernel runs natively on its accelerator. The kernel
# call is cheap there, but each example also runs the float32 reference (and for the
# gradient tests two reference backward passes), op by op: 8 keeps the Hopper kernel's
# 21 ranker and 6 sparse MLA conformance tests, next to the other GPU test files, inside
# one 600 s device call on one H200 (the whole GPU suite with 20 was killed at 540 s at
# about 92 %).
NATIVE_EXAMPLES = 8
# Every conformance property test's settings, with ``examples(backend, n)`` on top:
# reproducible (derandomized, no example database) and no deadline (interpret mode).
EXAMPLES = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def runs_natively(backend) -> bool:
    """The backend's kernels run on this machine's default JAX platform (not interpreted)."""
    return backend.native is not None and jax.default_backend() == backend.native


def slow_off_accelerator(backend) -> list:
    """The marks of a case the quick tier leaves out in interpret mode but keeps where the
    backend's kernels run natively (cheap there; ``benchmarks/tpu_run.sh`` selects
    ``-m "not slow or fp8"`` on a TPU): ``slow`` off the accelerator, none on it."""
    return [] if runs_natively(backend) else [pytest.mark.slow]


def examples(backend, small: int, quick: int | None = None) -> dict:
    """Hypothesis settings for a test's budget: ``NATIVE_EXAMPLES`` generated examples
    for a kernel on its own accelerator, ``small`` elsewhere (interpret mode; the
    reference on the CPU), in the quick tier at most ``quick`` (``None``: no cap) and the
    backend's ``quick_examples``; 0: the explicit edge-case example only."""
    if runs_natively(backend):
        return {"max_examples": NATIVE_EXAMPLES}
    if quick_tier():
        caps = (quick, backend.quick_examples)
        small = min([small, *(c for c in caps if c is not None)])
    if small == 0:
        return {"max_examples": 1, "phases": (Phase.explicit,)}
    return {"max_examples": small}


def params(backends):
    """``pytest.param`` per backend, with the backend name as the test id."""
    return [pytest.param(b, id=b.name) for b in backends]


def reference_f32(fn, *args, **kwargs):
    """``fn`` (an ``attn_reference`` function) on float32 copies of the float arguments,
    at HIGHEST matmul precision, jitted: the positional and array keyword arguments are
    traced, the others static (one compile per function, shapes and static arguments,
    against one per operation and shape run eagerly; the tests compare its results within
    tolerances)."""
    up = [
        jnp.asarray(a, jnp.float32)
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)
        else a
        for a in args
    ]
    arrays = {k: a for k, a in kwargs.items() if hasattr(a, "shape")}
    static = tuple(
        sorted(((k, a) for k, a in kwargs.items() if k not in arrays), key=lambda item: item[0])
    )
    with jax.default_matmul_precision("highest"):
        return _jitted(fn, static)(*up, **arrays)


@functools.cache
def _jitted(fn, static: tuple):
    """``fn`` with the keyword arguments ``static`` ((name, value) pairs) bound, jitted."""
    return jax.jit(functools.partial(fn, **dict(static)))
