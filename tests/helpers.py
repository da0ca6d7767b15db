"""Input generators and comparison helpers shared by the conformance tests.

Inputs are fresh random draws from ``np.random.default_rng(seed)``, never zeros.
Comparisons use the relative L2 error and the max-abs error; NaN never passes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st

BF16 = ml_dtypes.bfloat16

# dtype name -> (rel L2, max-abs) for out vs the float64 oracle on the (upcast) inputs.
# float32: the reference computes in float32 at HIGHEST precision. bfloat16: the output
# is rounded to bf16 (relative step 2**-8).
RANKER_TOL = {"float32": (1e-5, 3e-5), "bfloat16": (1e-2, 2e-2)}


def sds(shape, dtype=BF16):
    """``jax.ShapeDtypeStruct(shape, dtype)``: an abstract input for tracing or export."""
    import jax

    return jax.ShapeDtypeStruct(shape, dtype)


def quick_tier() -> bool:
    """This run is the quick tier (``-m "not slow"``: tests-cpu and CI); the root
    conftest.py sets ``ATTN_TEST_TIER`` from the run's marker filter."""
    import os

    return os.environ.get("ATTN_TEST_TIER") == "quick"


def tier_examples(n: int, quick: int | None = None) -> int:
    """Hypothesis examples for a property test: ``n`` in the full tier (tests-cpu-full:
    no marker filter); in the quick tier, where each example is only a cost per change,
    ``quick`` (for tests whose examples compile or run eager JAX ops), else a quarter of
    ``n``, at least 10."""
    if not quick_tier():
        return n
    return min(n, quick) if quick is not None else max(min(n, 10), n // 4)


def property_settings(n: int):
    """``hypothesis.settings`` of a property test whose examples are slow to draw or to
    run (compiled code): ``tier_examples(n)`` examples, no deadline (the first example
    compiles) and no too-slow health check."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=tier_examples(n), deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


def rng_for(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(rng: np.random.Generator, shape, dtype=np.float32, scale: float = 1.0) -> np.ndarray:
    """Standard normal draws in ``dtype`` (a numpy dtype or ``"bfloat16"``)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return x.astype(BF16 if str(dtype) == "bfloat16" else dtype)


def upcast(x) -> np.ndarray:
    """The exact float64 value of an array of any float dtype (bf16 included)."""
    return np.asarray(x).astype(np.float32).astype(np.float64)


def rel_l2(got, want) -> float:
    got, want = upcast(got), upcast(want)
    denom = np.linalg.norm(want.ravel())
    num = np.linalg.norm((got - want).ravel())
    return float(num / denom) if denom > 0 else float(num)


def max_abs(got, want) -> float:
    got, want = upcast(got), upcast(want)
    return float(np.max(np.abs(got - want))) if got.size else 0.0


def assert_close(got, want, *, rtol_l2: float, atol: float, name: str = "out") -> None:
    """``got`` finite everywhere, same shape, rel L2 < ``rtol_l2`` and max-abs < ``atol``."""
    got, want = upcast(got), upcast(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(want)), f"{name}: oracle has non-finite values (test bug)"
    assert np.all(np.isfinite(got)), f"{name}: {np.sum(~np.isfinite(got))} non-finite values"
    err, mx = rel_l2(got, want), max_abs(got, want)
    assert err < rtol_l2, f"{name}: rel L2 {err:.3g} >= {rtol_l2:.3g} (max-abs {mx:.3g})"
    assert mx < atol, f"{name}: max-abs {mx:.3g} >= {atol:.3g} (rel L2 {err:.3g})"


def assert_lse_close(got, want, *, atol: float, name: str = "lse") -> None:
    """-inf exactly where the oracle has -inf, finite elsewhere, max-abs < ``atol``."""
    got, want = upcast(got), upcast(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.any(np.isnan(got)), f"{name}: NaN present"
    empty = np.isneginf(want)
    assert np.array_equal(np.isneginf(got), empty), (
        f"{name}: -inf at {np.argwhere(np.isneginf(got) != empty)[:5].tolist()} "
        "does not match the oracle's empty rows"
    )
    assert np.all(np.isfinite(got[~empty])), f"{name}: non-finite value on a non-empty row"
    if (~empty).any():
        mx = float(np.max(np.abs(got[~empty] - want[~empty])))
        assert mx < atol, f"{name}: max-abs {mx:.3g} >= {atol:.3g}"


def assert_exact_zero_rows(out, lse, *, out_axes_last: int = 1) -> None:
    """Where lse is -inf the output row is exactly 0 (not merely small)."""
    out, lse = upcast(out), upcast(lse)
    assert not np.any(np.isnan(out))
    empty = np.isneginf(lse)
    assert np.all(out[empty] == 0.0), "rows with no valid key are not exactly 0"


def assert_ranker_close(q, got, want, *, rtol_l2: float, atol: float, lse_atol: float):
    """Ranker ``(out, lse)`` for the query ``q`` against ``want``: ``out`` in q's shape
    and dtype, ``lse [B, Hq, S]`` float32, the values by ``assert_close`` /
    ``assert_lse_close``, rows with no allowed key exactly 0."""
    out, lse = (np.asarray(x) for x in got)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]), lse.shape
    assert lse.dtype == np.float32, lse.dtype
    want_out, want_lse = want
    assert_close(out, want_out, rtol_l2=rtol_l2, atol=atol)
    assert_lse_close(lse, want_lse, atol=lse_atol)
    assert_exact_zero_rows(np.moveaxis(out, 2, 1), lse)


def check_ranker_against_oracle(oracle, q, k, v, bounds, got, *, cap, sm_scale, dtype):
    """Ranker ``got = (out, lse)`` on ``q, k, v, bounds`` against ``oracle`` (a float64
    ranker oracle) on the upcast inputs, at the tolerances of ``dtype``
    (``assert_ranker_close``); the oracle's ``(out, lse)``."""
    want = oracle(
        upcast(q), upcast(k), upcast(v), bounds, sm_scale=sm_scale, **oracle_cap_args(cap)
    )
    rtol, atol = RANKER_TOL[dtype]
    lse_atol = 1e-4 if dtype == "float32" else 1e-3
    assert_ranker_close(q, got, want, rtol_l2=rtol, atol=atol, lse_atol=lse_atol)
    return want


def check_ranker_bounds_as_data(oracle, q, k, v, cases: dict, *, cap=None) -> None:
    """Bounds are data: one jitted reference ``ranker_attention(q, k, v, bounds, cap=cap,
    return_lse=True)`` serves every ``bounds`` of ``cases`` (name -> bounds) with a single
    compile, each ``(out, lse)`` within 1e-5 rel L2 and 3e-5 max-abs (out) and 1e-4 (LSE)
    of ``oracle`` (a float64 ranker oracle) on the same bounds."""
    import jax
    import jax.numpy as jnp

    from attn_reference import ranker_attention

    f = jax.jit(functools.partial(ranker_attention, cap=cap, return_lse=True))
    for name, bounds in cases.items():
        out, lse = f(q, k, v, jnp.asarray(np.ascontiguousarray(bounds)))
        want_out, want_lse = oracle(q, k, v, bounds, **oracle_cap_args(cap))
        assert_close(out, want_out, rtol_l2=1e-5, atol=3e-5, name=name)
        assert_lse_close(lse, want_lse, atol=1e-4, name=name)
    assert jit_cache_size(f) == 1


def assert_sparse_mla_close(got, want, *, rtol_l2: float, atol: float, lse_atol: float):
    """Sparse-MLA ``(out, lse)`` against ``want``: both float32, ``out`` by
    ``assert_close``, ``lse`` by ``assert_lse_close``, rows with no key exactly 0."""
    out, lse = (np.asarray(x) for x in got)
    want_out, want_lse = want
    assert out.dtype == np.float32 and lse.dtype == np.float32, (out.dtype, lse.dtype)
    assert_close(out, want_out, rtol_l2=rtol_l2, atol=atol)
    assert_lse_close(lse, want_lse, atol=lse_atol)
    assert_exact_zero_rows(out, lse)


# The Hopper sparse-MLA GPU tests' bf16 tolerances against the float32 reference.
GPU_SPARSE_MLA_TOL = dict(rtol_l2=1e-2, atol=3e-2)
GPU_SPARSE_MLA_LSE_ATOL = 2e-3


def check_gpu_sparse_mla(got, want) -> None:
    """A Hopper sparse-MLA ``(out, lse)`` against the reference's, at
    :data:`GPU_SPARSE_MLA_TOL` and :data:`GPU_SPARSE_MLA_LSE_ATOL`."""
    assert_sparse_mla_close(got, want, **GPU_SPARSE_MLA_TOL, lse_atol=GPU_SPARSE_MLA_LSE_ATOL)


def poison_allocator(nbytes: int) -> None:
    """Allocate ``nbytes`` of NaN on the default device and free them, so that the next
    allocation of that size likely reuses NaN memory: an output element a kernel leaves
    unwritten then fails the check."""
    import jax.numpy as jnp

    x = jnp.full((max(nbytes // 4, 1),), jnp.nan, jnp.float32)
    x.block_until_ready()
    del x


# The Hopper sparse-MLA GPU tests' problem: DeepSeek V3.2's latent (value) width, key
# width (latent + 64 RoPE features) and softmax scale; paged caches hold 64-token pages
# of bf16 rows padded to 640 features.
GPU_MLA_DV, GPU_MLA_DK = 512, 576
GPU_MLA_SM_SCALE = 1.0 / np.sqrt(192.0)


def gpu_sparse_mla_flat(fn, case, rb: int, **kw):
    """``fn`` (a ``sparse_mla_attention``) on the flat case ``(q, kv, idx, pos)`` with
    ``read_block=rb`` at :data:`GPU_MLA_SM_SCALE`, returning ``(out, lse)``."""
    q, kv, idx, pos = case
    return fn(q, kv, idx, pos, sm_scale=GPU_MLA_SM_SCALE, read_block=rb, return_lse=True, **kw)


def gpu_sparse_mla_ragged(fn, case, page_size: int = 64, **kw):
    """``fn`` on a ragged case ``(layout, cache, q, idx, positions)``
    (:func:`sparse_mla_ragged_call`) at the GPU tests' scale and latent width."""
    return sparse_mla_ragged_call(
        fn, case, page_size, sm_scale=GPU_MLA_SM_SCALE, dv=GPU_MLA_DV, **kw
    )


def gpu_prefill_wrapper_outputs(kernel_fn, reference_fn, case, *, seed: int):
    """``kernel_fn`` and ``reference_fn`` (a backend's and the reference's
    ``prefill_write_and_attend_ragged``) on the GPU tests' ragged case ``(layout, cache,
    q, idx, positions)`` (64-token pages), each query's new latent and RoPE row
    (``rng_for(seed)``) written at its own position. The two new caches must be equal bit
    for bit; returns ``(out, want_out)``."""
    layout, cache, q, idx, positions = case
    page, dv = 64, GPU_MLA_DV
    rng = rng_for(seed)
    num_q = q.shape[1]
    base = layout["cu_kv_lens"][layout["q_seq_id"]] // page
    slot_page = layout["page_indices"][base + positions // page]
    loc = (slot_page * page + positions % page).astype(np.int32)
    ql, qpe = q[0, :, :, :dv], q[0, :, :, dv:]
    kvc, kpe = randn(rng, (num_q, dv), "bfloat16"), randn(rng, (num_q, 64), "bfloat16")
    args = (ql, qpe, kvc, kpe, cache, idx, positions, loc, layout["seq_lens"],
            layout["cu_q_lens"], layout["cu_kv_lens"], layout["page_indices"])  # fmt: skip
    kw = dict(kv_lora_rank=dv, page_size=page, sm_scale=GPU_MLA_SM_SCALE)
    out, new_cache = kernel_fn(*args, **kw)
    want_out, want_cache = reference_fn(*args, **kw)
    np.testing.assert_array_equal(
        np.asarray(new_cache).view(np.uint16), np.asarray(want_cache).view(np.uint16)
    )
    return out, want_out


# --------------------------------------------------------------------------------------
# Ranker inputs


@st.composite
def segment_bounds(draw, seq_len: int) -> tuple[int, int, int, int]:
    """Ranker bounds ``(hl, hu, cl, cu)`` anywhere in ``[0, seq_len]``: half the draws
    keep each segment ordered (lo <= hi), the rest may be inverted (an empty segment);
    history and candidates may overlap, touch, or come in either order."""
    pos = st.integers(0, seq_len)
    hl, hu, cl, cu = (draw(pos) for _ in range(4))
    if draw(st.booleans()):
        hl, hu = min(hl, hu), max(hl, hu)
        cl, cu = min(cl, cu), max(cl, cu)
    return hl, hu, cl, cu


def oracle_cap_args(cap) -> dict:
    """The ranker oracles' cap keywords (``cap_method``, ``cap_value``) for a
    ``CapParams`` or ``None``."""
    if cap is None:
        return {"cap_method": "none", "cap_value": None}
    return {"cap_method": cap.method, "cap_value": cap.value}


def ranker_inputs(
    seed: int, batch: int, seq: int, q_heads: int, kv_heads: int, dim: int, dtype="float32"
):
    rng = rng_for(seed)
    q = randn(rng, (batch, seq, q_heads, dim), dtype)
    k = randn(rng, (batch, seq, kv_heads, dim), dtype)
    v = randn(rng, (batch, seq, kv_heads, dim), dtype)
    return q, k, v


# --------------------------------------------------------------------------------------
# Ragged paged layout


def build_ragged_layout(
    rng: np.random.Generator,
    *,
    seq_lens,
    new_lens,
    extra_pages,
    page_size: int,
    spare_pages: int = 2,
):
    """A packed ragged batch with shuffled physical pages.

    seq_lens[r]: kv length of request r (its last ``new_lens[r]`` tokens are the new
    queries); extra_pages[r]: unused page-table slots past the last needed page.
    Returns a dict with numpy int32 tables: seq_lens, cu_kv_lens (page aligned),
    cu_q_lens, q_seq_id, positions, page_indices (a random permutation of physical pages,
    ``spare_pages`` physical pages stay unreferenced), num_pages.
    """
    seq_lens = np.asarray(seq_lens, np.int64)
    new_lens = np.asarray(new_lens, np.int64)
    assert np.all(new_lens <= seq_lens)
    pages = [-(-int(n) // page_size) + int(e) for n, e in zip(seq_lens, extra_pages, strict=True)]
    cu_kv = np.concatenate([[0], np.cumsum(pages)]) * page_size
    total_pages = int(sum(pages))
    num_pages = total_pages + spare_pages
    page_indices = rng.permutation(num_pages)[:total_pages]
    cu_q = np.concatenate([[0], np.cumsum(new_lens)])
    q_seq_id = np.repeat(np.arange(len(seq_lens)), new_lens)
    positions = np.concatenate(
        [np.arange(int(s) - int(n), int(s)) for s, n in zip(seq_lens, new_lens, strict=True)]
    )
    return {
        "seq_lens": seq_lens.astype(np.int32),
        "new_lens": new_lens.astype(np.int32),
        "cu_kv_lens": cu_kv.astype(np.int32),
        "cu_q_lens": cu_q.astype(np.int32),
        "q_seq_id": q_seq_id.astype(np.int32),
        "positions": positions.astype(np.int32),
        "page_indices": page_indices.astype(np.int32),
        "num_pages": num_pages,
        "extents": np.asarray(pages, np.int64),
    }


def random_page_selection(rng: np.random.Generator, layout, top_k: int, page_size: int):
    """Request-local page ids ``[S, K]`` mixing valid ids (most near the query), -1,
    duplicates and ids at or beyond the request's page extent."""
    q_seq_id = layout["q_seq_id"]
    extents = layout["extents"]
    num_q = q_seq_id.shape[0]
    sel = np.empty((num_q, top_k), np.int64)
    for i in range(num_q):
        ext = int(extents[q_seq_id[i]])
        own = int(layout["positions"][i]) // page_size
        choices = rng.integers(0, ext, size=top_k)
        choices[0] = own  # the query's own page: keeps most rows non-empty
        kinds = rng.random(top_k)
        choices = np.where(kinds < 0.15, -1, choices)
        choices = np.where((kinds >= 0.15) & (kinds < 0.25), ext + rng.integers(0, 3), choices)
        if top_k > 2 and rng.random() < 0.5:
            choices[-1] = choices[0]  # a duplicate
        sel[i] = choices
    return sel.astype(np.int32)


def ragged_layout_cache_q(
    rng: np.random.Generator, *, seq_lens, new_lens, extra_pages, page_size: int, heads: int,
    dk: int, dk_pad: int, dtype: str,
):  # fmt: skip
    """``(layout, cache, q)`` drawn from ``rng`` in that order: a ``build_ragged_layout``
    (shuffled physical pages), a random paged cache ``[num_pages, page_size // pk, pk,
    dk_pad]`` (``pk`` = 2 tokens per packed row in bf16, else 1) and random queries
    ``[1, S, heads, dk]``."""
    layout = build_ragged_layout(
        rng, seq_lens=seq_lens, new_lens=new_lens, extra_pages=extra_pages, page_size=page_size
    )
    pk = 2 if dtype == "bfloat16" else 1
    cache = randn(rng, (layout["num_pages"], page_size // pk, pk, dk_pad), dtype)
    q = randn(rng, (1, int(layout["q_seq_id"].shape[0]), heads, dk), dtype)
    return layout, cache, q


def sparse_mla_ragged_case(
    seed: int, *, seq_lens, new_lens, extra_pages, page_size: int, heads: int, top_k: int,
    dk: int, dk_pad: int, dtype: str,
):  # fmt: skip
    """Ragged paged sparse-MLA inputs ``(layout, cache, q, indices, positions)``: a
    random cache (junk in the feature padding, spare pages and past seq_len), selections
    from ``random_page_selection``, query 3 with nothing selected, and queries 5 and the
    last with positions 40 past their request's kv length (``seq_lens`` then binds)."""
    rng = rng_for(seed)
    layout, cache, q = ragged_layout_cache_q(
        rng, seq_lens=seq_lens, new_lens=new_lens, extra_pages=extra_pages,
        page_size=page_size, heads=heads, dk=dk, dk_pad=dk_pad, dtype=dtype,
    )  # fmt: skip
    num_q = q.shape[1]
    idx = random_page_selection(rng, layout, top_k, page_size)
    idx[3] = -1  # a query with nothing selected
    positions = layout["positions"].copy()
    positions[[5, num_q - 1]] += 40  # kv_len (seq_lens) is then the binding bound
    return layout, cache, q, idx, positions


def sparse_mla_ragged_call(fn, case, page_size: int, *, sm_scale: float, dv: int, **kw):
    """``fn`` (a ``sparse_mla_attention``) on a ``sparse_mla_ragged_case`` in ragged paged
    mode, one unit per page, returning ``(out, lse)``."""
    layout, cache, q, idx, positions = case
    return fn(
        q,
        cache,
        idx[None],
        positions[None],
        sm_scale=sm_scale,
        kv_lora_rank=dv,
        read_block=page_size,
        page_size=page_size,
        q_seq_id=layout["q_seq_id"],
        seq_lens=layout["seq_lens"],
        cu_kv_lens=layout["cu_kv_lens"],
        page_indices=layout["page_indices"],
        return_lse=True,
        **kw,
    )


# --------------------------------------------------------------------------------------
# Dirty caches: garbage in every row no query attends

POISON = (np.nan, np.inf, -np.inf)


def attended_rows_flat(indices, positions, *, kv_len: int, read_block: int) -> np.ndarray:
    """bool ``[B, T]``: key rows some query of the batch row attends (flat mode)."""
    indices, positions = np.asarray(indices), np.asarray(positions)
    batch, seq, _ = indices.shape
    num_units = -(-kv_len // read_block)
    seen = np.zeros((batch, kv_len), bool)
    for b in range(batch):
        for s in range(seq):
            for u in set(int(x) for x in indices[b, s]):
                if 0 <= u < num_units:
                    lo, hi = u * read_block, min((u + 1) * read_block, kv_len)
                    hi = min(hi, int(positions[b, s]) + 1)
                    if hi > lo:
                        seen[b, lo:hi] = True
    return seen


def attended_rows_ragged(layout, indices, positions, *, page_size: int, num_pages: int):
    """bool ``[num_pages * page_size]``: physical cache rows some query attends."""
    indices, positions = np.asarray(indices), np.asarray(positions)
    cu, seq_lens = layout["cu_kv_lens"], layout["seq_lens"]
    page_indices = layout["page_indices"]
    seen = np.zeros((num_pages * page_size,), bool)
    for t, r in enumerate(np.asarray(layout["q_seq_id"])):
        base, extent = cu[r] // page_size, (cu[r + 1] - cu[r]) // page_size
        for p in set(int(x) for x in indices[t]):
            if not (0 <= p < extent and base + p < len(page_indices)):
                continue
            phys = int(page_indices[base + p])
            if not 0 <= phys < num_pages:
                continue
            for i in range(page_size):
                j = p * page_size + i
                if j <= positions[t] and j < seq_lens[r]:
                    seen[phys * page_size + i] = True
    return seen


def poison_rows(rows: np.ndarray, keep: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """Copy of ``rows [..., R, D]`` with every row where ``keep`` is False set to a mix of
    NaN, +Inf and -Inf (whole rows, every feature)."""
    rng = rng_for(seed)
    out = np.array(rows, copy=True)
    bad = ~np.broadcast_to(keep, out.shape[:-1])
    junk = rng.choice(np.asarray(POISON, np.float32), size=out.shape).astype(out.dtype)
    out[bad] = junk[bad]
    return out


def poison_ragged_case(case, page_size: int, *, dk: int, seed: int):
    """A ``sparse_mla_ragged_case`` whose cache holds garbage (NaN, +-Inf) in every row
    no query attends (page tails past ``seq_lens``, spare and unselected pages) and in
    every row's feature padding past ``dk``."""
    layout, cache, q, idx, positions = case
    num_pages = cache.shape[0]
    keep = attended_rows_ragged(layout, idx, positions, page_size=page_size, num_pages=num_pages)
    assert (~keep).any() and keep.any()
    rows = poison_rows(cache.reshape(num_pages * page_size, -1), keep, seed=seed)
    rows[:, dk:] = np.nan
    return layout, rows.reshape(cache.shape), q, idx, positions


def poison_fp8_cache(cache, keep: np.ndarray, *, seed: int):
    """Copy of an ``Fp8LatentCache`` whose every token where ``keep`` (bool, the token
    grid's size) is False holds NaN latent bytes (e4m3fn 0x7F / 0xFF), NaN / +-Inf / 0
    scales and NaN / Inf rope values (a mix per token)."""
    import jax.numpy as jnp

    from attn_common import Fp8LatentCache

    rng = rng_for(seed)
    latent, scale, rope = (np.array(a) for a in (cache.latent, cache.scale, cache.rope))
    bad = ~np.asarray(keep).reshape(cache.shape)
    latent_u8 = latent.view(np.uint8)
    latent_u8[bad] = np.where(rng.random(latent_u8[bad].shape) < 0.5, 0x7F, 0xFF)
    junk = rng.choice(np.asarray([np.nan, np.inf, -np.inf, 0.0], np.float32), scale[bad].shape)
    scale[bad] = junk
    rope[bad] = rng.choice(np.asarray([np.nan, np.inf], np.float32), rope[bad].shape).astype(BF16)
    return Fp8LatentCache(jnp.asarray(latent), jnp.asarray(scale), jnp.asarray(rope))


def huge_keys(k, *, seed: int, max_exp: float) -> np.ndarray:
    """Float32 copy of ``k`` ([B, S, H, D]) with each key scaled by ``10^u``, ``u``
    uniform in ``[0, max_exp]``, so that scores reach ~``10^max_exp`` (a soft cap must
    saturate them as the float32 reference does). Cast it back to the test's dtype;
    ``poison_rows`` dirties keys that no row attends."""
    scale = 10.0 ** rng_for(seed).uniform(0.0, max_exp, (*k.shape[:2], 1, 1))
    return np.asarray(k, np.float32) * scale.astype(np.float32)


def shaped_packed_bounds(seed: int, rows: int, seq_len: int, users: int = 6) -> np.ndarray:
    """int32 ``[rows, users, 4]`` packed bounds in every user shape, slots shuffled:
    history then candidates, a gap between them, candidates before the history, and a
    user whose own history and candidates overlap; users are disjoint, with gaps and
    padding between them, boundaries anywhere (not block-aligned)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        cuts = np.sort(rng.choice(seq_len + 1, size=4 * users, replace=False)).tolist()
        row = []
        for u in range(users):
            a, b, c, d = cuts[4 * u : 4 * u + 4]
            row.append([(a, c, c, d), (a, b, c, d), (c, d, a, b), (a, c, b, d)][u % 4])
        out.append([row[i] for i in rng.permutation(users)])
    return np.asarray(out, np.int32)


def sparse_mla_flat_case(
    seed: int, *, dk: int, batch: int, seq: int, heads: int, kv_len: int, rb: int, top_k: int,
    dtype="float32",
):  # fmt: skip
    """Flat sparse-MLA inputs ``(q, kv, indices, positions)`` with every edge a kernel
    must handle: -1, duplicate, triplicate and out-of-range unit ids, a query with
    nothing selected, a negative position, a selection of only the (partial) tail unit
    with ``kv_len`` binding, and a selection entirely after its query. Needs ``seq >= 7``
    and ``top_k >= 3``."""
    rng = rng_for(seed)
    num_units = -(-kv_len // rb)
    q = randn(rng, (batch, seq, heads, dk), dtype)
    kv = randn(rng, (batch, kv_len, dk), dtype)
    pos = rng.integers(0, kv_len + 8, size=(batch, seq)).astype(np.int32)
    idx = rng.integers(-1, num_units + 2, size=(batch, seq, top_k)).astype(np.int32)
    idx[:, :, 0] = pos // rb  # the query's own unit: most rows are non-empty
    idx[0, 1, 1] = idx[0, 1, 0]  # duplicate
    idx[0, 2, 2:] = idx[0, 2, 0]  # triplicate
    b = batch - 1
    idx[b, 3] = -1  # nothing selected
    pos[b, 4] = -5  # negative position: causally empty
    idx[0, 5] = num_units - 1  # only the (partial) tail unit, selected K times
    pos[0, 5] = kv_len + 100  # kv_len binds
    edge = np.array([num_units - 1, -1, num_units + 7, 2**30])[:top_k]
    idx[b, 6] = np.pad(edge, (0, top_k - len(edge)), constant_values=-1)
    pos[b, 6] = 0  # selection entirely after the query: empty
    return q, kv, idx, pos


# --------------------------------------------------------------------------------------
# Sparse-MLA gradients through a kernel (its forward, the XLA backward)


def dirty_ragged_grad_case(
    seed: int, *, seq_lens, new_lens, extra_pages, page_size: int, heads: int, top_k: int,
    dk: int, dtype: str,
):  # fmt: skip
    """Ragged paged inputs for a gradient test: ``(q, cache, indices [1, S, K], positions
    [1, S], keep, tables)``. ``cache [num_pages, page_size // pk, pk, 256]`` (``pk`` 2 for
    bfloat16, else 1) holds NaN/Inf in every row no query attends (``keep`` False, some
    are) and NaN in the feature padding past ``dk``; ``tables`` are the keywords of ragged
    mode (read_block = page_size, one unit per page)."""
    rng = rng_for(seed)
    layout = build_ragged_layout(
        rng, seq_lens=seq_lens, new_lens=new_lens, extra_pages=extra_pages, page_size=page_size
    )
    num_pages, pk = layout["num_pages"], 2 if dtype == "bfloat16" else 1
    cache = randn(rng, (num_pages, page_size // pk, pk, 256), dtype)
    q = randn(rng, (1, int(sum(new_lens)), heads, dk), dtype)
    idx = random_page_selection(rng, layout, top_k, page_size)
    pos = layout["positions"]
    keep = attended_rows_ragged(layout, idx, pos, page_size=page_size, num_pages=num_pages)
    rows = poison_rows(cache.reshape(num_pages * page_size, -1), keep, seed=seed + 1)
    rows[:, dk:] = np.nan  # the feature padding
    tables = {k: layout[k] for k in ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")}
    tables.update(read_block=page_size, page_size=page_size)
    return q, rows.reshape(cache.shape), idx[None], pos[None], keep, tables


def sparse_mla_loss_grad(fn, idx, pos, w_out, w_lse, *, sm_scale: float, dv: int, **kw):
    """``jax.grad`` w.r.t. ``(q, kv)`` of ``sum(w_out * out) + sum(w_lse * lse)`` (the
    finite LSE) of the sparse-MLA ``fn``, with ``(out, lse, mass)`` as aux."""
    import jax
    import jax.numpy as jnp

    def loss(q, kv):
        out, lse, mass = fn(
            q, kv, idx, pos, sm_scale=sm_scale, kv_lora_rank=dv, return_lse=True,
            return_attn_mass=True, **kw,
        )  # fmt: skip
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(w_out * out) + jnp.sum(w_lse * finite), (out, lse, mass)

    # One jitted program: an eager gradient dispatches the backward's operations while an
    # interpret-mode kernel may still run, which can deadlock (tests/test_x64.py says how).
    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def compare_sparse_mla_grads(
    fn, q, kv, idx, pos, keep_rows, *, kernel_kw: dict, sm_scale: float, dv: int,
    grad_tol: dict, mass_atol: float, **kw,
):  # fmt: skip
    """The kernel ``fn``'s gradients (called with ``kernel_kw`` and ``kw``, run to the
    end by ``run_interpret``) against ``attn_reference``'s on the same inputs (called with
    ``kw``), both through :func:`sparse_mla_loss_grad`: ``dq`` and ``dkv`` in the inputs' dtypes, finite,
    equal within ``grad_tol`` (``assert_allclose`` keywords), ``dkv`` exactly 0 on every
    row where ``keep_rows`` is False (some are); the attention mass ``[B, S, K]`` float32
    within ``mass_atol`` and 0 wherever the reference's is; ``-inf`` LSE on the same
    queries. Returns float32 ``(dq, dkv)``."""
    import jax
    import jax.numpy as jnp

    import attn_reference as ref

    rng = rng_for(1)
    w_out = jnp.asarray(rng.standard_normal((*q.shape[:3], dv)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal(q.shape[:3]), jnp.float32)
    call = dict(sm_scale=sm_scale, dv=dv)
    (dq, dkv), (_, lse, mass) = run_interpret(
        sparse_mla_loss_grad(fn, idx, pos, w_out, w_lse, **call, **kernel_kw, **kw), q, kv
    )
    with jax.default_matmul_precision("highest"):
        (ref_dq, ref_dkv), (_, ref_lse, ref_mass) = sparse_mla_loss_grad(
            ref.sparse_mla_attention, idx, pos, w_out, w_lse, **call, **kw
        )(q, kv)
    assert dq.dtype == q.dtype and dkv.dtype == kv.dtype, (dq.dtype, dkv.dtype)
    dq, dkv = np.asarray(dq, np.float32), np.asarray(dkv, np.float32)
    assert np.isfinite(dq).all() and np.isfinite(dkv).all()
    np.testing.assert_allclose(dq, np.asarray(ref_dq, np.float32), **grad_tol)
    np.testing.assert_allclose(dkv, np.asarray(ref_dkv, np.float32), **grad_tol)
    rows = dkv.reshape(-1, dkv.shape[-1])
    assert np.all(rows[~keep_rows.reshape(-1)] == 0.0) and (~keep_rows).any()
    assert mass.shape == idx.shape and mass.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(mass), np.asarray(ref_mass), atol=mass_atol)
    assert np.all(np.asarray(mass)[np.asarray(ref_mass) == 0.0] == 0.0)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    return dq, dkv


def random_row_table(rng, counts, width: int, store_rows: int) -> np.ndarray:
    """``rows [len(counts), width]`` int32 for the Hopper kernel: query ``n``'s first
    ``counts[n]`` entries distinct random store rows, ``-1`` after."""
    rows = np.full((len(counts), width), -1, np.int32)
    for n, c in enumerate(counts):
        rows[n, :c] = rng.choice(store_rows, c, replace=False)
    return rows


def ragged_positional(op, **kw):
    """``op`` (a sparse-MLA function) with the ragged tables as positional arguments:
    ``fn(q, cache, idx, pos, q_seq_id, seq_lens, cu_kv_lens, page_indices)``, the other
    keywords ``kw``; for ``jax.export`` and ``make_jaxpr`` at ``ShapeDtypeStruct``s."""

    def fn(q, cache, idx, pos, q_seq_id, seq_lens, cu_kv_lens, page_indices):
        return op(
            q, cache, idx, pos, q_seq_id=q_seq_id, seq_lens=seq_lens, cu_kv_lens=cu_kv_lens,
            page_indices=page_indices, **kw,
        )  # fmt: skip

    return fn


def flat_call_structs(cache, num_q: int, heads: int, top_k: int, *, dk: int = 576) -> tuple:
    """A flat sparse-MLA call's arguments as ``ShapeDtypeStruct``s, for export: bf16 ``q
    [1, num_q, heads, dk]``, ``cache`` (given: its form varies), int32 ``indices [1,
    num_q, top_k]`` and ``positions [1, num_q]``."""
    i32 = np.int32
    return sds((1, num_q, heads, dk)), cache, sds((1, num_q, top_k), i32), sds((1, num_q), i32)


def ragged_call_structs(
    cache, num_q: int, heads: int, top_k: int, num_seqs: int, table_pages: int, *, dk: int = 576
) -> tuple:
    """A ragged paged sparse-MLA call's arguments in ``ragged_positional``'s order:
    ``flat_call_structs``, then int32 ``q_seq_id [num_q]``, ``seq_lens [num_seqs]``,
    ``cu_kv_lens [num_seqs + 1]`` and ``page_indices [table_pages]``."""
    i32 = np.int32
    tables = (sds((num_q,), i32), sds((num_seqs,), i32), sds((num_seqs + 1,), i32))
    flat = flat_call_structs(cache, num_q, heads, top_k, dk=dk)
    return (*flat, *tables, sds((table_pages,), i32))


def prefill_call_structs(
    cache, num_q: int, heads: int, top_k: int, num_seqs: int, table_pages: int, *,
    dv: int = 512, rope: int = 64,
) -> tuple:  # fmt: skip
    """``prefill_write_and_attend_ragged``'s arguments as ``ShapeDtypeStruct``s: bf16
    ``q_latent [num_q, heads, dv]``, ``q_rope [num_q, heads, rope]``, the new rows
    ``kv_latent [num_q, dv]`` and ``k_rope [num_q, rope]``, ``cache``, int32 ``indices
    [num_q, top_k]``, ``positions`` and ``loc [num_q]``, ``seq_lens [num_seqs]``,
    ``cu_q_lens`` and ``cu_kv_lens [num_seqs + 1]``, ``page_indices [table_pages]``."""
    i32 = np.int32
    new = (sds((num_q, heads, dv)), sds((num_q, heads, rope)), sds((num_q, dv)), sds((num_q, rope)))
    per_token = (sds((num_q, top_k), i32), sds((num_q,), i32), sds((num_q,), i32))
    cu = sds((num_seqs + 1,), i32)
    return (*new, cache, *per_token, sds((num_seqs,), i32), cu, cu, sds((table_pages,), i32))


def export_tpu(fn, *structs, kernels: int):
    """``jax.export`` of ``fn`` for TPU (on any host) at ``structs``, whose module must hold
    exactly ``kernels`` Mosaic TPU kernels (a ``lax.cond`` holds one per branch)."""
    import jax

    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*structs)
    found = exported.mlir_module().count("tpu_custom_call")
    assert found == kernels, f"{found} Mosaic kernels in the exported module, expected {kernels}"
    assert exported.platforms == ("tpu",)
    return exported


def export_mosaic_gpu(fn, *structs) -> str:
    """``jax.export`` of ``fn`` for CUDA (on any host) at ``structs`` (``ShapeDtypeStruct``
    pytrees): the module's text, which must hold a Mosaic GPU call."""
    import jax

    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*structs).mlir_module()
    assert "mosaic_gpu" in text
    return text


def export_sparse_mla_grad(fn, platform: str, *, tokens, heads, cache, top_k, **kw) -> str:
    """``jax.export`` for ``platform`` of ``jax.grad`` (through ``out`` and the finite
    ``lse``, w.r.t. ``q`` and the flat bf16 cache ``[1, cache, 576]``) plus the attention
    mass of the sparse-MLA ``fn`` (called with ``kw``): asserts the shapes and dtypes of
    ``dq``, ``dkv`` and the mass; returns the lowered module's text."""
    import jax
    import jax.numpy as jnp

    def f(q, kv, idx, pos):
        def loss(q, kv):
            out, lse, mass = fn(q, kv, idx, pos, return_lse=True, return_attn_mass=True, **kw)
            return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), mass

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(q, kv)

    structs = [
        jax.ShapeDtypeStruct((1, tokens, heads, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, cache, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, tokens, top_k), jnp.int32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    ]
    exported = jax.export.export(jax.jit(f), platforms=[platform])(*structs)
    dq, dkv, mass = exported.out_avals
    assert dq.shape == structs[0].shape and dq.dtype == jnp.bfloat16
    assert dkv.shape == structs[1].shape and dkv.dtype == jnp.bfloat16
    assert mass.shape == (1, tokens, top_k) and mass.dtype == jnp.float32
    return exported.mlir_module()


# --------------------------------------------------------------------------------------
# Interpret mode: the race detectors' verdict


def cli_exit_code(argv) -> int:
    """``attn_common.cli.main(argv)``'s status, also when argparse exits through
    ``SystemExit``."""
    from attn_common import cli

    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def assert_cli_usage_error(argv, needle: str, capsys) -> None:
    """``attn <argv>`` exits with status 2 and prints one line, an ``error:`` holding
    ``needle`` (no usage block, no traceback)."""
    assert cli_exit_code(argv) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1 and "error: " in err, err


# --------------------------------------------------------------------------------------
# Hopper ranker kernel tests (packages/attn-mosaic-gpu/tests, interpret mode and GPU)

RANKER_GRAD_MAX_ABS_FACTOR = 5  # max-abs error <= 5 x tol x max|reference|


def ranker_kernel_inputs(seed, batch, seq, q_heads, kv_heads, head_dim, dtype):
    """jnp ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` in ``dtype`` from standard
    normals; q and k scaled by 2 so that the soft caps actually bite."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def draw(heads, scale=1.0):
        x = rng.standard_normal((batch, seq, heads, head_dim)).astype(np.float32) * scale
        return jnp.asarray(x).astype(dtype)

    return draw(q_heads, 2.0), draw(kv_heads, 2.0), draw(kv_heads)


def ranker_reference_f32(q, k, v, bounds, *, cap=None, sm_scale=None):
    """``attn_reference.ranker_attention`` on the float32 upcast inputs: ``(out, lse)``."""
    import jax.numpy as jnp

    from attn_reference.ranker import ranker_attention

    up = (x.astype(jnp.float32) for x in (q, k, v))
    return ranker_attention(*up, bounds, cap=cap, sm_scale=sm_scale, return_lse=True)


def ranker_grad_loss(fn, q, k, v, bounds, w, *, cap, use_lse, **kw):
    """``sum(out * w)`` of the ranker ``fn``, plus (``use_lse``) a linear LSE term."""
    import jax.numpy as jnp

    if use_lse:
        out, lse = fn(q, k, v, bounds, cap=cap, return_lse=True, **kw)
        # A linear LSE term with a random per-row weight of the out term's gradient scale
        # (sqrt(D)): a dropped LSE cotangent moves dq and dk far beyond the tolerance
        # (check_ranker_grads checks that), which a 1e-3 weight on lse**2 hid.
        wl = np.sqrt(q.shape[-1]) * jnp.moveaxis(w[..., 0], 1, 2)  # [B, Hq, S]
        z = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)
        return jnp.sum(out.astype(jnp.float32) * w) + z
    return jnp.sum(fn(q, k, v, bounds, cap=cap, **kw).astype(jnp.float32) * w)


def ranker_reference_grads(q, k, v, bounds, w, *, cap, use_lse):
    """``(dq, dk, dv)`` of :func:`ranker_grad_loss` through the reference, on the float32
    upcast inputs (jitted)."""
    import jax
    import jax.numpy as jnp

    from attn_reference.ranker import ranker_attention

    def loss(q, k, v):
        return ranker_grad_loss(ranker_attention, q, k, v, bounds, w, cap=cap, use_lse=use_lse)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))


def ranker_dead(bounds, batch: int, seq: int):
    """``(rows, keys)`` bool ``[B, S]`` each: the query rows and the keys with nothing
    allowed, for ``SegmentBounds``, ``[B, 4]`` (or broadcast ``[4]``) bounds or packed
    ``[B, U, 4]`` rows."""
    from attn_common import SegmentBounds, ranker_mask
    from attn_common.packed import ranker_mask_packed

    if isinstance(bounds, SegmentBounds):
        bounds = bounds.as_array()
    pos = np.arange(seq)
    bounds = np.asarray(bounds)
    if bounds.ndim == 3:
        mask = ranker_mask_packed(pos[None, :, None], pos[None, None, :], bounds[:, None, None])
    else:
        arr = np.broadcast_to(np.clip(bounds, 0, seq), (batch, 4))
        segs = (arr[:, i, None, None] for i in range(4))
        mask = ranker_mask(pos[None, :, None], pos[None, None, :], *segs)
    allowed = np.asarray(mask)
    return ~allowed.any(axis=2), ~allowed.any(axis=1)


def assert_ranker_grads(got, want, dead, *, dtype, tol: float) -> None:
    """Kernel ``(dq, dk, dv)`` against the reference's: ``dtype`` and shape, finite,
    exactly 0 where ``dead`` (rows for dq, keys for dk and dv: :func:`ranker_dead`), rel
    L2 < ``tol`` and max-abs <= ``RANKER_GRAD_MAX_ABS_FACTOR x tol x max|reference|``
    (a few bad elements cannot hide in the norm)."""
    row_dead, key_dead = dead
    for name, g, r, d in zip(
        ("dq", "dk", "dv"), got, want, (row_dead, key_dead, key_dead), strict=True
    ):
        assert g.dtype == dtype and g.shape == r.shape, name
        g = np.asarray(np.asarray(g, np.float32), np.float64)
        r = np.asarray(r, np.float64)
        assert not np.isnan(g).any(), f"{name}: NaN"
        assert np.isfinite(g).all(), f"{name}: non-finite"
        assert np.all(g[d] == 0.0), f"{name}: nonzero gradient where nothing is allowed"
        err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
        assert err < tol, f"{name}: rel L2 {err:.3g}"
        mx = np.abs(g - r).max(initial=0.0)
        bound = RANKER_GRAD_MAX_ABS_FACTOR * tol * max(np.abs(r).max(initial=0.0), 1e-30)
        assert mx <= bound, (
            f"{name}: max-abs {mx:.3g} > {bound:.3g} "
            f"({RANKER_GRAD_MAX_ABS_FACTOR} x tol x max|ref|)"
        )


def check_ranker_grads(got, q, k, v, bounds, w, *, cap, use_lse: bool, tol: float) -> None:
    """The kernel's ``(dq, dk, dv)`` of :func:`ranker_grad_loss` (weights ``w``) against
    the reference's (:func:`assert_ranker_grads`). With ``use_lse`` the LSE term must
    also move the reference's dq and dk by more than ``10 x tol``, so that a kernel
    dropping the LSE cotangent fails (dv does not depend on it)."""
    args = dict(cap=cap, use_lse=use_lse)
    want = ranker_reference_grads(q, k, v, bounds, w, **args)
    if use_lse:
        without = ranker_reference_grads(q, k, v, bounds, w, cap=cap, use_lse=False)
        for name, r, r0 in zip(("dq", "dk"), want[:2], without[:2], strict=True):
            r, r0 = np.asarray(r, np.float64), np.asarray(r0, np.float64)
            moved = np.linalg.norm(r - r0) / max(np.linalg.norm(r), 1e-30)
            assert moved > 10 * tol, f"{name}: the LSE term moves it by only {moved:.3g}"
    dead = ranker_dead(bounds, q.shape[0], q.shape[1])
    assert_ranker_grads(got, want, dead, dtype=q.dtype, tol=tol)


def packed_user_bounds(seed, rows, seq, max_users=8, *, empty_history=False):
    """jnp int32 ``[rows, U, 4]``: users with log-normal histories packed first-fit
    decreasing into ``rows`` rows of ``seq`` (``attn_common.pack_users``): unaligned
    boundaries, users sharing blocks, padding at the ends, an unused slot; with
    ``empty_history`` the last row's first user has an empty history."""
    import jax.numpy as jnp

    from attn_common.packing import pack_users

    rng = np.random.default_rng(seed)
    hist = np.minimum(rng.lognormal(np.log(60), 1.0, size=6 * rows).astype(int), seq // 2)
    cand = rng.integers(1, 20, size=hist.size)
    packed = pack_users(hist, cand, seq_len=seq, max_users_per_row=max_users)
    bounds = np.asarray(packed.bounds)[:rows]
    bounds[0, -1] = 0  # an unused slot
    if empty_history:
        b = bounds[-1, 0]
        bounds[-1, 0] = [b[0], b[0], b[2], b[3]]
    return jnp.asarray(bounds, jnp.int32)


def tpu_interpret():
    """Strict Pallas TPU interpret mode: race detection on, out-of-bounds reads raise,
    uninitialised memory (outputs included) is NaN."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(
        detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan"
    )


def gpu_interpret():
    """Strict Mosaic GPU interpret mode: race detection on, uninitialised shared memory
    is NaN."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")


def hopper_small_config():
    """The smallest Hopper ranker tiles (64 x 64, two stages): the interpret-mode tests'
    config, so a short sequence still spans several blocks."""
    from attn_common import KernelConfig

    return KernelConfig(block_q=64, block_kv=64, num_stages=2)


def assert_static_value(a, b, other, field: str) -> None:
    """A frozen dataclass that serves as a static ``jax.jit`` argument: ``a`` and ``b``
    equal with equal hashes, ``other`` different; setting ``field`` raises; passed as a
    static argument, ``b`` reuses ``a``'s trace and ``other`` traces again."""
    import dataclasses

    import jax

    assert a == b and hash(a) == hash(b)
    assert a != other
    assert len({a, b, other}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(a, field, getattr(other, field))
    traces = []

    def f(x, value):
        traces.append(value)
        return x

    jf = jax.jit(f, static_argnames="value")
    for value, count in ((a, 1), (b, 1), (other, 2)):
        jf(np.float32(0), value=value)
        assert len(traces) == count, (value, traces)


def jit_cache_size(fn) -> int:
    """How many executables the ``jax.jit`` function ``fn`` holds (a retrace adds one).
    Private in jax 0.11 (``_cache_size``): read here only."""
    return fn._cache_size()


def count_mosaic_smem(monkeypatch) -> list[int]:
    """From now on, append Mosaic GPU's own count of each kernel's shared-memory bytes to
    the returned list. Private in jax 0.11 (``mosaic.gpu.core._smem_tree_size``): read
    here only."""
    import jax.experimental.mosaic.gpu.core as mosaic_core

    counted: list[int] = []
    count = mosaic_core._smem_tree_size
    monkeypatch.setattr(
        mosaic_core, "_smem_tree_size", lambda tree: counted.append(count(tree)) or counted[-1]
    )
    return counted


def races_detected() -> bool:
    """Whether the last kernel run in Pallas interpret mode with ``detect_races=True``
    reported a data race, in Mosaic GPU's or Mosaic TPU's interpreter (each keeps the
    state of its last run). The one place that reads the interpreters' race state: it is
    private in jax 0.11 (``jax._src``)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interp
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return any(
        state is not None and state.races_found
        for state in (gpu_callbacks._races, tpu_interp.races)
    )


def box_interpret_callbacks_cheaply() -> bool:
    """Box the Pallas interpreters' host-callback arguments cheaply: for the test session
    (the root conftest).

    Pallas interpret mode runs every load, store, copy, semaphore and barrier of a kernel
    as a ``jax.experimental.io_callback``, and jax 0.11's implementation ``device_put``s
    every argument onto the CPU device before the callback, most of them int32 scalars
    (ids, tokens) that the callback turns straight back into Python ints. Profiles of
    interpret-mode tests put a third of their time there. Instead:

    * the Mosaic TPU interpreter's callbacks, which compute the same on numpy arrays,
      get XLA's arrays as numpy arrays, each copied (XLA lends its buffers only for the
      call);
    * the Mosaic GPU interpreter's callbacks, which require JAX arrays (``_to_int``), get
      JAX arrays as before, but each integer or bool scalar value is boxed once and
      reused (JAX arrays are immutable);
    * every other callback (the tests' own) goes through JAX's implementation.

    Private JAX (``jax._src.callback.io_callback_impl``): where it is absent or takes
    other keywords, nothing is replaced and the tests run at the old speed. Returns
    whether it is replaced."""
    import inspect

    import jax
    from jax import tree_util
    from jax._src import callback as jax_callback

    original = getattr(jax_callback, "io_callback_impl", None)
    if original is None or getattr(original, "boxes_cheaply", False):
        return original is not None
    expected = ["args", "result_avals", "callback", "sharding", "ordered"]
    if list(inspect.signature(original).parameters) != expected:
        return False
    scalars: dict = {}

    def module_of(callback) -> str:
        func = getattr(callback, "callback_func", None)
        func = getattr(func, "func", func)  # a functools.partial's function
        return getattr(func, "__module__", "") or ""

    def boxed(a, cpu):
        a = np.asarray(a)
        if a.ndim or a.dtype.kind not in "biu":
            return jax.device_put(a, cpu)
        key = (a.dtype.str, a.item())
        if key not in scalars:
            scalars[key] = jax.device_put(a, cpu)
        return scalars[key]

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        module = module_of(callback)
        if not module.startswith((_TPU_INTERPRETER, _GPU_INTERPRETER)):
            return original(
                *args, result_avals=result_avals, callback=callback, sharding=sharding,
                ordered=ordered,
            )  # fmt: skip
        cpu = jax.local_devices(backend="cpu")[0]
        if module.startswith(_TPU_INTERPRETER):
            args = tuple(np.array(a) for a in args)
        else:
            args = tuple(boxed(a, cpu) for a in args)
        with jax.default_device(cpu):
            return tree_util.tree_map(np.asarray, callback(*args))

    io_callback_impl.boxes_cheaply = True
    jax_callback.io_callback_impl = io_callback_impl
    return True


_TPU_INTERPRETER = "jax._src.pallas.mosaic.interpret"
_GPU_INTERPRETER = "jax._src.pallas.mosaic_gpu.interpret"


def assert_no_races() -> None:
    assert not races_detected(), "interpret mode's race detector reported a data race"


def run_interpret(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` to completion, then assert no race was detected. After a
    failure the Mosaic GPU interpreter's global state is reset, so the next test starts
    clean (it is left inconsistent otherwise)."""
    import jax
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
        reset_gpu_interpret_mode_state,
    )

    try:
        result = fn(*args, **kwargs)
        jax.block_until_ready(result)
    except Exception:
        reset_gpu_interpret_mode_state()
        raise
    assert_no_races()
    return result


@contextlib.contextmanager
def multi_device_gpu_interpret() -> Iterator[None]:
    """Mosaic GPU interpret mode on several devices (kernels under ``jax.shard_map``) for
    the calls traced inside this context.

    At the end of each device's kernel, jax 0.11's interpreter asserts that no barrier of
    *any* device is still allocated, while the other devices may still be running their
    copy of the kernel: two-device runs failed at random with "Barrier remains allocated"
    (7 of 8 runs of the sparse-MLA forward here). Traced in this context, that check first
    waits until every device has reached it (on the interpreter's device barrier, which
    the Mosaic GPU interpreter does not otherwise use), so it checks what it means to.
    Private JAX (``jax._src``), like ``races_detected``."""
    from jax._src import callback
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    def after_every_device(token):
        memory = gpu_callbacks._get_shared_memory()
        memory.barrier.wait()
        memory.assert_no_barriers_allocated()
        return token

    def call(token):
        return callback.io_callback(after_every_device, gpu_callbacks.TOKEN_SHAPE_DTYPE, token)

    original = gpu_callbacks.call_assert_no_barriers_allocated
    gpu_callbacks.call_assert_no_barriers_allocated = call
    try:
        yield
    finally:
        gpu_callbacks.call_assert_no_barriers_allocated = original


@contextlib.contextmanager
def load_script(path: Path, name: str) -> Iterator[object]:
    """Import a script (``benchmarks/`` and ``tests/`` are not packages) as module
    ``name``, registered in ``sys.modules`` while in use (dataclasses resolve their
    annotations through it). Skips the test when the script is absent (not a source
    checkout)."""
    if not path.exists():
        pytest.skip(f"{path} not present (not a source checkout)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def gpu_bench_script(name: str):
    """A module-scoped fixture: ``benchmarks/<name>.py`` loaded as module ``name``
    (:func:`load_script`); the test is skipped where attn-mosaic-gpu, which the Hopper
    benchmark scripts import, is not installed."""

    @pytest.fixture(scope="module")
    def bench():
        pytest.importorskip(
            "attn_mosaic_gpu",
            reason="attn-mosaic-gpu is not installed (pip install ./packages/attn-mosaic-gpu)",
        )
        root = Path(__file__).resolve().parents[1]
        with load_script(root / "benchmarks" / f"{name}.py", name) as module:
            yield module

    return bench


def script_result(rows: list, *, command: str = "x", **extra) -> dict:
    """A benchmark script's result as the scripts write it, around ``rows``: commit
    abc1234 on an H200, 10 iterations; ``extra`` adds or replaces top-level keys."""
    return {
        "provenance": {"commit": "abc1234", "command": command, "date": "d"},
        "commit": "abc1234",
        "device": "H200",
        "iterations": 10,
        "rows": rows,
        **extra,
    }


def check_script_reports(bench, result: dict, out, *, row_keys: set, md_row: str) -> None:
    """A GPU benchmark script's ``write_reports(result, out)``: the JSON, Markdown and SVG
    named after the script, the JSON with ``result``'s commit and every row carrying
    ``row_keys``, the Markdown with ``md_row``, the commit and the timing basis."""
    import json

    stem = bench.RESULT
    paths = bench.write_reports(result, out)
    assert [p.name for p in paths] == [f"{stem}.{x}" for x in ("json", "md", "svg")]
    data = json.loads(paths[0].read_text())
    assert data["commit"] == result["commit"]
    for row in data["rows"]:
        assert row_keys <= set(row)
    md = paths[1].read_text()
    assert md_row in md
    assert result["commit"] in md and "cupti (device time)" in md
    assert paths[2].read_text().startswith("<svg")


def wrapper_query_grads(fn, *, dv: int, sm_scale: float, **kw):
    """Gradients of ``sum(out)`` of a ``prefill_write_and_attend_ragged`` ``fn`` with
    respect to its query parts ``ql`` and ``qpe`` (bf16), on one fixed small case: two
    sequences of 16-row pages, each new token written to its own row; ``kw`` goes to
    ``fn`` (``interpret=...``)."""
    import jax
    import jax.numpy as jnp

    rng = rng_for(8)
    page = 16
    layout = build_ragged_layout(
        rng, seq_lens=[20, 9], new_lens=[3, 2], extra_pages=[0, 1], page_size=page
    )
    num_pages, t, rope = layout["num_pages"], 5, 64
    cache = randn(rng, (num_pages, page // 2, 2, 256), "bfloat16")
    ql, qpe = randn(rng, (t, 2, dv), "bfloat16"), randn(rng, (t, 2, rope), "bfloat16")
    kvc, kpe = randn(rng, (t, dv), "bfloat16"), randn(rng, (t, rope), "bfloat16")
    idx = random_page_selection(rng, layout, 2, page)
    pos = layout["positions"]
    slot = layout["cu_kv_lens"][layout["q_seq_id"]] // page + pos // page
    loc = (layout["page_indices"][slot] * page + pos % page).astype(np.int32)  # own row
    args = (kvc, kpe, cache, idx, pos, loc, layout["seq_lens"], layout["cu_q_lens"],
            layout["cu_kv_lens"], layout["page_indices"])  # fmt: skip

    def loss(ql, qpe):
        out, _ = fn(ql, qpe, *args, kv_lora_rank=dv, page_size=page, sm_scale=sm_scale, **kw)
        return jnp.sum(out)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(ql, qpe)  # one program, as above


def check_wrapper_query_grads(kernel_fn, reference_fn, *, dv: int, sm_scale: float, tol, **kw):
    """:func:`wrapper_query_grads` of a kernel's ``prefill_write_and_attend_ragged``
    (``kw``: its ``interpret``; interpreted by :func:`run_interpret`) against the
    reference wrapper's at float32 matmul precision: bf16, non-zero, within ``tol``
    (``assert_allclose`` keywords)."""
    import jax
    import jax.numpy as jnp

    got = run_interpret(lambda: wrapper_query_grads(kernel_fn, dv=dv, sm_scale=sm_scale, **kw))
    with jax.default_matmul_precision("highest"):
        want = wrapper_query_grads(reference_fn, dv=dv, sm_scale=sm_scale)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.bfloat16 and np.abs(np.asarray(w, np.float32)).max() > 0
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
