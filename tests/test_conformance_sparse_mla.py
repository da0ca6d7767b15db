"""Sparse MLA conformance: one suite, every backend (``conformance.SPARSE_MLA``).

Flat mode (unit ids, and token ids with ``read_block=1`` where the backend supports it)
and ragged paged mode, each backend run as this machine can (natively, or in Pallas
interpret mode on the CPU with uninitialised memory NaN) and compared against
``attn_reference`` in float32 at HIGHEST precision on the upcast inputs: out (rel L2 and
max-abs per dtype), LSE (``-inf`` exactly on empty queries, out exactly 0 there).

An FP8 latent cache (``attn_common.Fp8LatentCache``) runs on the backends whose
``fp8`` flag is set, ragged paged in 32-token pages, every field of the unattended rows poisoned (NaN
latent bytes, NaN / Inf / 0 scales, NaN / Inf rope), against the float32 reference on
the dequantized cache at the bf16 tolerance (the kernels compute on bf16 rows).

Hypothesis draws the selections (-1, duplicate and out-of-range ids, a query with
nothing selected, positions before, inside and past the cache), the ragged metadata
(request lengths, new tokens per request, shuffled physical pages) and fresh random
inputs at fixed small shapes; every cache row no query attends holds NaN or +-Inf (and
the paged cache's feature padding NaN), so a kernel reading one fails. Examples are few
and derandomized. The quick tier (``-m "not slow"``) runs each backend once per mode at
its first dtype (``QUICK``), with at most one generated example; the other functions,
read blocks and dtypes are ``slow``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import (
    EXAMPLES,
    OUT_TOL,
    SPARSE_LSE_ATOL,
    SPARSE_MLA,
    examples,
    reference_f32,
    slow_off_accelerator,
)
from helpers import (
    assert_sparse_mla_close,
    attended_rows_flat,
    attended_rows_ragged,
    poison_fp8_cache,
    poison_rows,
    randn,
    random_page_selection,
    rng_for,
    run_interpret,
    sparse_mla_flat_case,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attn_reference as ref
from attn_common import dequantize_latent_cache, padded_dk, quantize_latent_cache

SM_SCALE = 0.07
FNS = ("sparse_mla_attention", "sparse_mla_attention_qblock")

# Flat shapes: (batch, seq, heads, kv_len, top_k) per read_block; read_block=1 selects
# more tokens than two 64-row blocks hold.
FLAT = {16: (1, 8, 2, 88, 4), 1: (1, 4, 2, 160, 136)}
# Ragged: 3 requests of at most PAGES_PER_REQUEST pages each, NUM_Q new tokens in all.
PAGE, PAGES_PER_REQUEST, NUM_Q, SPARE_PAGES, RAGGED_TOP_K, RAGGED_HEADS = 16, 3, 12, 2, 4, 2


# The quick tier's case of each backend per mode, at its first dtype: (function,
# read_block). Hopper's per-query kernel (what ``sparse_mla_attention`` runs) flat at token
# level (read_block=1, which the TPU kernels do not take), its query-blocked kernel
# ragged paged (5.7 s in interpret mode here against the per-query kernel's 25.5 s).
QUICK = {
    "flat": {"reference": (FNS[0], 16), "pallas-tpu": (FNS[0], 16), "mosaic-gpu": (FNS[0], 1)},
    "ragged": {"reference": (FNS[0], 16), "pallas-tpu": (FNS[0], 16), "mosaic-gpu": (FNS[1], 16)},
}


def _cases(mode: str):
    """(backend, function, dtype, read_block) the backend supports; ``QUICK``'s run in the
    quick tier, the others (``_qblock`` twins, read blocks, dtypes) are ``slow``, except
    where the kernels run natively: there the first dtype of each function that is a
    kernel of its own (not the reference's ``_qblock`` twin) is not
    (``conformance.slow_off_accelerator``)."""
    out = []
    for backend in SPARSE_MLA:
        blocks = [16] if mode == "ragged" else [16, 1]
        for rb in blocks:
            if rb == 1 and not backend.read_block_1:
                continue
            for i, dtype in enumerate(backend.dtypes):
                for fn in FNS:
                    own_kernel = fn == FNS[0] or backend.name != "reference"
                    if i == 0 and QUICK[mode][backend.name] == (fn, rb):
                        marks = []
                    elif i == 0 and own_kernel:
                        marks = slow_off_accelerator(backend)
                    else:
                        marks = [pytest.mark.slow]
                    name = f"{backend}-{fn.removeprefix('sparse_mla_attention') or 'plain'}"
                    ident = f"{name}-{dtype}-rb{rb}"
                    out.append(pytest.param(backend, fn, dtype, rb, id=ident, marks=marks))
    return out


def _call(backend, fn_name: str, dv: int, **static):
    """The backend's function on host arrays: jitted, one compile per shape for every
    example (run eagerly, each of its operations around the kernel compiles on its own:
    ~60 in a TPU case), except Hopper's, called eagerly (its flat case ran 31 s per
    example under jit against 20 s eagerly in interpret mode here)."""
    if backend.name == "mosaic-gpu":
        return _eager_call(backend, fn_name, dv, **static)
    return _jitted_call(backend, fn_name, dv, tuple(sorted(static.items())))


def _eager_call(backend, fn_name: str, dv: int, **static):
    fn = getattr(backend.module(), fn_name)
    kw = backend.call_kwargs()
    return lambda q, kv, idx, pos, tables: fn(
        q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=dv, return_lse=True,
        **tables, **static, **kw,
    )  # fmt: skip


@functools.cache
def _jitted_call(backend, fn_name: str, dv: int, static: tuple):
    return jax.jit(_eager_call(backend, fn_name, dv, **dict(static)))


def _check(got, want, dtype):
    rtol, atol = OUT_TOL[dtype]
    assert_sparse_mla_close(got, want, rtol_l2=rtol, atol=atol, lse_atol=SPARSE_LSE_ATOL[dtype])


def _run(backend, fn, dtype, args, tables, **static):
    dv = backend.sparse_dims[0]
    got = run_interpret(_call(backend, fn, dv, **static), *args, tables)
    q, kv, *rest = args
    if kv.ndim == 4:  # the paged cache, float32 holds one token per packed row
        kv = np.asarray(kv, np.float32).reshape(kv.shape[0], -1, 1, kv.shape[-1])
    want = reference_f32(
        getattr(ref, fn), q, kv, *rest, sm_scale=SM_SCALE, kv_lora_rank=dv, return_lse=True,
        **tables, **static,
    )  # fmt: skip
    return got, want


# -------------------------------------------------------------------------- flat mode


@st.composite
def flat_selection(draw, *, batch, seq, kv_len, rb, top_k):
    """``(indices [B, S, K], positions [B, S])``: ids anywhere in [-1, units + 2] with
    duplicates, one query with nothing selected, positions from before the cache to
    past its end, the query's own unit usually among its picks."""
    units = -(-kv_len // rb)
    pos = np.asarray(
        draw(st.lists(st.integers(-3, kv_len + 8), min_size=batch * seq, max_size=batch * seq)),
        np.int32,
    ).reshape(batch, seq)
    ids = st.integers(-1, units + 2)
    flat = draw(st.lists(ids, min_size=batch * seq * top_k, max_size=batch * seq * top_k))
    idx = np.asarray(flat, np.int32).reshape(batch, seq, top_k)
    own = draw(st.lists(st.booleans(), min_size=batch * seq, max_size=batch * seq))
    own = np.asarray(own).reshape(batch, seq)
    idx[..., 0] = np.where(own, np.clip(pos, 0, kv_len - 1) // rb, idx[..., 0])
    b, s = draw(st.integers(0, batch - 1)), draw(st.integers(0, seq - 1))
    idx[b, s] = -1  # nothing selected
    if top_k > 1:
        b, s = draw(st.integers(0, batch - 1)), draw(st.integers(0, seq - 1))
        idx[b, s, 1:] = idx[b, s, 0]  # the same id K times
    return idx, pos


def _examples(backend):
    """Hypothesis settings with the backend's example budget, at most one generated
    example in the quick tier."""
    return settings(EXAMPLES, **examples(backend, backend.sparse_examples, quick=1))


@pytest.mark.parametrize(("backend", "fn", "dtype", "rb"), _cases("flat"))
def test_flat(backend, fn, dtype, rb):
    backend.require()
    batch, seq, _, kv_len, top_k = FLAT[rb]
    strategy = flat_selection(batch=batch, seq=seq, kv_len=kv_len, rb=rb, top_k=top_k)

    @_examples(backend)
    @given(sel=strategy, seed=st.integers(0, 2**31 - 1))
    def check(sel, seed):
        flat_case(backend, fn, dtype, rb, sel, seed)

    example(sel=_flat_edges(rb), seed=1)(check)()


def _flat_edges(rb):
    """The explicit flat example: ``helpers.sparse_mla_flat_case``'s edges (duplicate,
    triplicate, out-of-range ids, nothing selected, a negative position, only the partial
    tail unit, a selection after its query) for units; for tokens, K distinct tokens per
    query with duplicates, -1 every 7th, ids past T and negative ids."""
    batch, seq, _, kv_len, top_k = FLAT[rb]
    if rb > 1:
        return sparse_mla_flat_case(
            0, dk=8, batch=batch, seq=seq, heads=1, kv_len=kv_len, rb=rb, top_k=top_k
        )[2:]
    rng = rng_for(2)
    idx = np.stack([rng.permutation(kv_len)[:top_k] for _ in range(seq)])[None]
    idx[0, 0, :20] = idx[0, 0, 20:40]
    idx[0, 1, ::7] = -1
    idx[0, 3, :5] = [kv_len, kv_len + 3, 2**30, -1, -7]
    pos = np.asarray([[kv_len - 1, kv_len // 2, 10, 0]], np.int32)
    return idx.astype(np.int32), pos


def flat_case(backend, fn, dtype, rb, sel, seed):
    dv, rope = backend.sparse_dims
    batch, seq, heads, kv_len, _ = FLAT[rb]
    idx, pos = sel
    rng = rng_for(seed)
    q = randn(rng, (batch, seq, heads, dv + rope), dtype)
    kv = randn(rng, (batch, kv_len, dv + rope), dtype)
    want_clean = reference_f32(
        ref.sparse_mla_attention, q, kv, idx, pos, sm_scale=SM_SCALE, kv_lora_rank=dv,
        read_block=rb, return_lse=True,
    )  # fmt: skip
    keep = attended_rows_flat(idx, pos, kv_len=kv_len, read_block=rb)
    dirty = poison_rows(kv, keep, seed=seed)
    got, want = _run(backend, fn, dtype, (q, dirty, idx, pos), {}, read_block=rb)
    _check(got, want, dtype)
    _check(got, want_clean, dtype)  # the poison changed nothing the kernel may read


# ------------------------------------------------------------------------ ragged mode


@st.composite
def ragged_layout(draw, page=PAGE):
    """Three requests, NUM_Q new tokens in all, each request ``PAGES_PER_REQUEST`` page
    slots (its extent) of ``page`` tokens with up to that many pages of tokens; physical
    pages shuffled, ``SPARE_PAGES`` never referenced."""
    cuts = sorted(draw(st.lists(st.integers(0, NUM_Q), min_size=2, max_size=2)))
    new_lens = np.diff([0, *cuts, NUM_Q])
    cap = page * PAGES_PER_REQUEST
    seq_lens = [draw(st.integers(max(int(n), 1), cap)) for n in new_lens]
    perm = draw(st.permutations(range(3 * PAGES_PER_REQUEST + SPARE_PAGES)))
    return layout_dict(new_lens, seq_lens, perm, page)


def layout_dict(new_lens, seq_lens, perm, page=PAGE):
    """The ``helpers.build_ragged_layout`` dict of three requests of
    ``PAGES_PER_REQUEST`` page slots of ``page`` tokens each, ``perm`` the physical
    pages."""
    new_lens, seq_lens = np.asarray(new_lens), np.asarray(seq_lens)
    cu_kv = np.arange(4) * page * PAGES_PER_REQUEST
    positions = np.concatenate(
        [np.arange(int(s) - int(n), int(s)) for s, n in zip(seq_lens, new_lens, strict=True)]
    )
    return {
        "seq_lens": seq_lens.astype(np.int32),
        "cu_kv_lens": cu_kv.astype(np.int32),
        "q_seq_id": np.repeat(np.arange(3), new_lens).astype(np.int32),
        "positions": positions.astype(np.int32),
        "page_indices": np.asarray(perm[: 3 * PAGES_PER_REQUEST], np.int32),
        "num_pages": 3 * PAGES_PER_REQUEST + SPARE_PAGES,
        "extents": np.full(3, PAGES_PER_REQUEST, np.int64),
    }


@pytest.mark.parametrize(("backend", "fn", "dtype", "rb"), _cases("ragged"))
def test_ragged_paged(backend, fn, dtype, rb):
    backend.require()

    @_examples(backend)
    @given(layout=ragged_layout(), seed=st.integers(0, 2**31 - 1))
    # Explicit edge cases: a request with no new token, one whose last page is partial,
    # one that is all new tokens in a single partial page; pages out of order.
    @example(layout=layout_dict([5, 0, 7], [40, 3, 7], [10, 3, 7, 0, 8, 1, 5, 9, 2, 4, 6]), seed=1)
    def check(layout, seed):
        ragged_case(backend, fn, dtype, layout, seed)

    check()


def dirty_ragged_inputs(layout, seed, dv, rope, dtype, *, bind_kv_len):
    """A ragged case's ``q``, paged cache (NaN / Inf in every row no query attends and in
    the feature padding), selection, positions, kept rows ``[num_pages * PAGE]`` and
    tables. ``bind_kv_len``: one query's position moved 40 past its request's length, so
    ``kv_len`` binds."""
    rng = rng_for(seed)
    pk = 2 if dtype == "bfloat16" else 1
    num_pages = layout["num_pages"]
    dk_pad = -(-(dv + rope) // 128) * 128
    cache = randn(rng, (num_pages, PAGE // pk, pk, dk_pad), dtype)
    q = randn(rng, (1, NUM_Q, RAGGED_HEADS, dv + rope), dtype)
    idx = random_page_selection(rng, layout, RAGGED_TOP_K, PAGE)
    positions = layout["positions"].copy()
    if bind_kv_len:
        positions[rng.integers(0, NUM_Q)] += 40
    keep = attended_rows_ragged(layout, idx, positions, page_size=PAGE, num_pages=num_pages)
    rows = poison_rows(cache.reshape(num_pages * PAGE, -1), keep, seed=seed)
    rows[:, dv + rope :] = np.nan  # the feature padding past Dk
    names = ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")
    tables = {k: jnp.asarray(layout[k]) for k in names}
    return q, rows.reshape(cache.shape), idx, positions, keep, tables


def ragged_case(backend, fn, dtype, layout, seed):
    dv, rope = backend.sparse_dims
    q, dirty, idx, positions, _, tables = dirty_ragged_inputs(
        layout, seed, dv, rope, dtype, bind_kv_len=True
    )
    args = (q, dirty, idx[None], positions[None])
    got, want = _run(backend, fn, dtype, args, tables, read_block=PAGE, page_size=PAGE)
    _check(got, want, dtype)


# ---------------------------------------------------------------- FP8 latent cache

FP8_DV, FP8_ROPE = 512, 64  # the only split an Fp8LatentCache holds
FP8_PAGE = 32  # whole 8-bit tiles: the compiled TPU kernels' FP8 unit (any backend takes it)


def _fp8_cases():
    """(backend, function) for the backends that read an FP8 cache, all ``slow`` (the
    default tier has each backend's own FP8 tests: tests/test_sparse_mla_fp8_reference.py,
    packages/attn-pallas-tpu/tests/test_fp8_interpret.py)."""
    out = []
    for backend in SPARSE_MLA:
        if not backend.fp8:
            continue
        for fn in FNS:
            name = f"{backend}-{fn.removeprefix('sparse_mla_attention') or 'plain'}"
            marks = [pytest.mark.slow, pytest.mark.fp8]
            out.append(pytest.param(backend, fn, id=f"{name}-fp8", marks=marks))
    return out


@pytest.mark.parametrize(("backend", "fn"), _fp8_cases())
def test_ragged_paged_fp8(backend, fn):
    backend.require()

    @_examples(backend)
    @given(layout=ragged_layout(FP8_PAGE), seed=st.integers(0, 2**31 - 1))
    @example(
        layout=layout_dict([5, 0, 7], [70, 3, 7], [10, 3, 7, 0, 8, 1, 5, 9, 2, 4, 6], FP8_PAGE),
        seed=1,
    )
    def check(layout, seed):
        ragged_fp8_case(backend, fn, layout, seed)

    check()


def ragged_fp8_case(backend, fn, layout, seed):
    rng = rng_for(seed)
    num_pages, dk = layout["num_pages"], FP8_DV + FP8_ROPE
    cache = quantize_latent_cache(jnp.asarray(randn(rng, (num_pages, FP8_PAGE, dk), np.float32)))
    q = randn(rng, (1, NUM_Q, RAGGED_HEADS, dk), "bfloat16")
    idx = random_page_selection(rng, layout, RAGGED_TOP_K, FP8_PAGE)
    positions = layout["positions"].copy()
    positions[rng.integers(0, NUM_Q)] += 40  # kv_len (the request's length) binds
    keep = attended_rows_ragged(layout, idx, positions, page_size=FP8_PAGE, num_pages=num_pages)
    dirty = poison_fp8_cache(cache, keep, seed=seed)
    names = ("q_seq_id", "seq_lens", "cu_kv_lens", "page_indices")
    tables = {k: jnp.asarray(layout[k]) for k in names}
    static = dict(read_block=FP8_PAGE, page_size=FP8_PAGE)
    args = (q, dirty, idx[None], positions[None])
    got = run_interpret(_call(backend, fn, FP8_DV, **static), *args, tables)
    deq = np.asarray(dequantize_latent_cache(cache))  # the clean cache's values, float32
    deq = np.pad(deq, ((0, 0), (0, 0), (0, padded_dk(dk) - dk)))[:, :, None, :]
    want = reference_f32(
        getattr(ref, fn), q, deq, idx[None], positions[None], sm_scale=SM_SCALE,
        kv_lora_rank=FP8_DV, return_lse=True, **tables, **static,
    )  # fmt: skip
    _check(got, want, "bfloat16")
