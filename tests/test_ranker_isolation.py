"""Ranker isolation on every backend (docs/semantics.md, "Isolation").

A row's output, LSE and dq, and a key row's dk and dv, must equal what they would be if
every row that row does not attend were zero, whatever those rows hold. Each case runs a
backend twice on fresh random inputs: once with some rows poisoned (every feature of q,
k, v, and of the cotangents dout and dlse, set to NaN, +Inf, -Inf or 1e30, one value per
row), once with the same rows zeroed. On the rows that are checked the two runs must
agree and be finite; rows with no allowed key must give exactly 0, LSE -inf and zero
gradients in both. Batch rows never mix, so one call runs every case, one per row:

* ``padding``: the poisoned rows are the padding of the row (the gaps between users and
  between a user's history and candidates, the tail, the head); every user is checked.
* ``out_of_range``: bounds reaching outside ``[0, S)`` (clipped), the rest poisoned.
* ``other_user``: every row of one packed user is poisoned (plus the padding); the other
  users of the row, which share query tiles and key blocks with it, are checked.

Every cap (none, tanh, soft-sign) at D 64 and 128, GQA (4 query heads on 2 kv heads),
S = 100 (one 128-block for the TPU kernels, two 64-blocks for the Hopper ones). And the
other side of the promise: an attended key with a +Inf logit gives what the reference
gives (NaN under no cap and soft-sign, finite under tanh), reference and TPU kernels.
The kernels run in interpret mode: Pallas TPU with race detection, out-of-bounds reads
raising and uninitialised memory NaN; Mosaic GPU with race detection off a GPU, compiled
on one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpu_interpret, hopper_small_config, rng_for, tpu_interpret

from attn_common import CapMethod, CapParams, KernelConfig

S = 100
BATCH, Q_HEADS, KV_HEADS = 2, 4, 2
POISONS = (np.nan, np.inf, -np.inf, 1e30)
CAPS = {
    "none": None,
    "tanh": CapParams(CapMethod.TANH, 5.0),
    "soft_sign": CapParams(CapMethod.SOFT_SIGN, 80.0),  # the suite's; the TPU "row" softmax
}
# Packed rows of U = 3 slots: users sharing query tiles and key blocks, gaps, a user with
# a gap between history and candidates, candidates before the history, an empty slot,
# padding at the head and the tail; bounds outside [0, S) (clipped).
ROW_A = [[3, 30, 30, 41], [41, 57, 60, 70], [75, 90, 90, 97]]
ROW_B = [[20, 44, 5, 12], [50, 66, 66, 80], [0, 0, 0, 0]]
OUT_A = [[-20, 30, 30, 45], [60, 180, 50, 60], [0, 0, 0, 0]]
OUT_B = [[47, 80, 80, 300], [-5, -1, 2, 9], [10, 30, 35, 40]]
# Batch rows never mix, so one call runs every case, one per row: (bounds, the user slot
# poisoned besides the padding, or None).
CASES = {
    "padding": (ROW_A, None),
    "other_user": (ROW_A, 0),  # user 0 shares the query tile and key blocks with 1 and 2
    "other_user_b": (ROW_B, 1),
    "out_of_range": (OUT_A, None),
    "out_of_range_b": (OUT_B, 0),
}
BOUNDS = np.asarray([c[0] for c in CASES.values()], np.int32)
BATCH = len(CASES)


def _tpu():
    attn_pallas_tpu = pytest.importorskip(
        "attn_pallas_tpu", reason="not installed: pip install ./packages/attn-pallas-tpu"
    )

    config = KernelConfig(block_q=128, block_kv=128)
    return functools.partial(
        attn_pallas_tpu.ranker_attention, config=config, interpret=tpu_interpret()
    )


def _gpu():

    attn_mosaic_gpu = pytest.importorskip(
        "attn_mosaic_gpu", reason="not installed: pip install ./packages/attn-mosaic-gpu"
    )

    # On a GPU the compiled kernel (what users run); the Mosaic GPU interpreter crashed
    # its pytest worker there (H200 runs at 5498db2 and 6d7986e; not yet run compiled).
    interpret = None if jax.default_backend() == "gpu" else gpu_interpret()
    config = hopper_small_config()
    return functools.partial(attn_mosaic_gpu.ranker_attention, config=config, interpret=interpret)


def _reference():
    import attn_reference

    return attn_reference.ranker_attention


BACKENDS = {
    "reference": (_reference, ()),
    "pallas-tpu": (_tpu, ()),
    # An expected failure: the quick tier would pay ~35-55 s of interpret mode a change to
    # learn that it still fails, so all its cases are slow (tests-cpu-full and the GPU
    # session run them, strict: a kernel that starts to isolate fails the run).
    "mosaic-gpu": (
        _gpu,
        (
            pytest.mark.xfail(
                strict=True,
                reason="issue 39: the Hopper kernels do not isolate yet (0 * NaN in P V, dS K)",
            ),
            pytest.mark.slow,
        ),
    ),
}
CAP_DIMS = [("none", 64), ("tanh", 128), ("soft_sign", 64)]
# Interpret mode costs ~20 s (TPU) and ~35 s (Mosaic GPU) of one core per call: -m "not
# slow" keeps one cap per backend, the kernels' first, the reference's second (another cap
# and head dim than the TPU kernels'); the others are marked slow.
QUICK_CAP = {"reference": 1, "pallas-tpu": 0, "mosaic-gpu": 0}
PARAMS = [
    pytest.param(
        fn,
        cap,
        dim,
        id=f"{cap}-{dim}-{name}",
        marks=(*marks, *((pytest.mark.slow,) if n != QUICK_CAP[name] else ())),
    )
    for name, (fn, marks) in BACKENDS.items()
    for n, (cap, dim) in enumerate(CAP_DIMS)
]


def _segments(bounds) -> tuple[np.ndarray, np.ndarray]:
    """``(owner [B, S] int, -1 = padding; live [B, S] bool)`` of clipped packed bounds."""
    owner = np.full((BATCH, S), -1)
    for b in range(BATCH):
        for u, row in enumerate(np.clip(bounds[b], 0, S)):
            hl, hu, cl, cu = (int(x) for x in row)
            for lo, hi in ((hl, hu), (cl, cu)):
                assert np.all(owner[b, lo:hi] <= -1) or np.all(owner[b, lo:hi] == u)
                owner[b, lo:hi] = u
    return owner, owner >= 0


def _poisoned(x, rows, seed):
    """``x [B, S, ...]`` with every feature of the ``rows [B, S]`` set to one poison value
    per row (cycling NaN, +Inf, -Inf, 1e30 from a random start)."""
    x = np.array(x, np.float32)
    start = int(rng_for(seed).integers(len(POISONS)))
    for n, (b, s) in enumerate(np.argwhere(rows)):
        x[b, s] = POISONS[(start + n) % len(POISONS)]
    return x


def _zeroed(x, rows):
    x = np.array(x, np.float32)
    x[rows] = 0.0
    return x


def _runner(fn, cap, dtype):
    """``jit``-ed forward + VJP (one compile serves the poisoned and the zeroed run):
    numpy inputs -> float32 ``out, lse [B, S, Hq], dq, dk, dv``."""

    @jax.jit
    def run(q, k, v, dout, dlse, bounds):
        def f(q, k, v):
            return fn(q, k, v, bounds, cap=cap, return_lse=True)

        (out, lse), vjp = jax.vjp(f, q.astype(dtype), k.astype(dtype), v.astype(dtype))
        grads = vjp((dout.astype(dtype), jnp.moveaxis(dlse, 1, 2)))
        return [x.astype(jnp.float32) for x in (out, jnp.moveaxis(lse, 1, 2), *grads)]

    return lambda *args: [np.asarray(x) for x in run(*args)]


@pytest.mark.parametrize(("backend", "cap", "head_dim"), PARAMS)
def test_poisoned_rows_do_not_leak(backend, cap, head_dim):
    fn = backend()
    dtype = jnp.bfloat16 if backend is _gpu else jnp.float32
    bounds = BOUNDS
    owner, live = _segments(bounds)
    seed = sum(map(ord, cap)) + head_dim
    rng = rng_for(seed)
    shapes = {
        "q": (BATCH, S, Q_HEADS, head_dim),
        "k": (BATCH, S, KV_HEADS, head_dim),
        "v": (BATCH, S, KV_HEADS, head_dim),
        "dout": (BATCH, S, Q_HEADS, head_dim),
        "dlse": (BATCH, S, Q_HEADS),
    }
    clean = {
        name: np.asarray(jnp.asarray(rng.standard_normal(shape), dtype), np.float32)
        for name, shape in shapes.items()
    }
    slots = np.asarray([-2 if c[1] is None else c[1] for c in CASES.values()])
    poisoned = (owner == slots[:, None]) | ~live
    checked = ~poisoned  # [B, S]: rows whose results must not change
    dirty = {n: _poisoned(x, poisoned, seed + i) for i, (n, x) in enumerate(clean.items())}
    zero = {n: _zeroed(x, poisoned) for n, x in clean.items()}
    names = ("out", "lse", "dq", "dk", "dv")
    run = _runner(fn, CAPS[cap], dtype)
    got = dict(zip(names, run(*dirty.values(), bounds), strict=True))
    want = dict(zip(names, run(*zero.values(), bounds), strict=True))
    # A float32 rerun of the same computation with zeros where the poison was: equal up
    # to summation order (the backends give bitwise-equal results today).
    atol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    for name in names:
        assert np.all(np.isfinite(want[name][checked])), f"{name}: clean run not finite (test bug)"
        for b, case in enumerate(CASES):
            g, w = got[name][b][checked[b]], want[name][b][checked[b]]
            bad = ~np.isfinite(g)
            assert not bad.any(), f"{case}: {name}: {bad.sum()} non-finite values on checked rows"
            err = float(np.max(np.abs(g - w)))
            scale = max(1.0, float(np.max(np.abs(w))))
            assert err <= atol * scale, f"{case}: {name}: max-abs {err:.3g} vs the zeroed run"
    # Rows that attend nothing: exactly out 0, lse -inf and zero gradients in both runs.
    for res in (got, want):
        dead = ~live
        assert np.all(res["out"][dead] == 0.0)
        assert np.all(np.isneginf(res["lse"][dead]))
        for name in ("dq", "dk", "dv"):
            assert np.all(res[name][dead] == 0.0), f"{name}: a padding row is not exactly 0"


# An attended key whose logit is +Inf (a +Inf feature against a positive q feature): not
# isolation (the row is attended) but the same promise from the other side: garbage a row
# attends reaches its output as the reference's IEEE arithmetic gives it. No cap: +Inf -
# +Inf in the softmax, NaN; tanh: the cap's value, finite; soft-sign: Inf / Inf, NaN. The
# TPU kernels' soft-sign takes an approximate reciprocal on a chip (interpret mode
# computes it exactly), so the native run is what checks it there: -m "not slow" runs that
# case on a TPU (benchmarks/tpu_run.sh), the others are ``slow`` (the quick tier's
# isolation check is test_poisoned_rows_do_not_leak).
INF_KEY = 10  # a history row every later history row and every candidate attends
ON_TPU = jax.default_backend() == "tpu"
INF_PARAMS = [
    pytest.param(
        fn,
        cap,
        id=f"{cap}-{name}",
        marks=() if ON_TPU and name == "pallas-tpu" and cap == "soft_sign" else pytest.mark.slow,
    )
    for name, fn in (("reference", _reference), ("pallas-tpu", _tpu))
    for cap in CAPS
]


@pytest.mark.parametrize(("backend", "cap"), INF_PARAMS)
def test_attended_infinite_logit_as_the_reference(backend, cap):
    fn = backend()
    rng = rng_for(sum(map(ord, cap)))
    q = rng.standard_normal((1, S, Q_HEADS, 64)).astype(np.float32)
    k = rng.standard_normal((1, S, KV_HEADS, 64)).astype(np.float32)
    v = rng.standard_normal((1, S, KV_HEADS, 64)).astype(np.float32)
    q[..., 0] = np.abs(q[..., 0]) + 0.5
    k[:, INF_KEY, :, 0] = np.inf
    bounds = np.asarray([[0, 64, 64, S]], np.int32)  # history [0, 64), candidates [64, S)

    def run(f):
        out, lse = jax.jit(lambda q, k, v: f(q, k, v, bounds, cap=CAPS[cap], return_lse=True))(
            q, k, v
        )
        return np.asarray(out, np.float32), np.asarray(lse, np.float32)

    (out, lse), (want_out, want_lse) = run(fn), run(_reference())
    attends = np.zeros(S, bool)
    attends[INF_KEY:] = True  # history rows at or after the key, and every candidate
    assert np.isnan(want_out[0, attends]).all() == (cap != "tanh"), "reference (test bug)"
    for name, got, want in (("out", out, want_out), ("lse", lse, want_lse)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{cap}: {name}")
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"{cap}: {name}")
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5, err_msg=name)
