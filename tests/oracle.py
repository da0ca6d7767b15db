"""Independent float64 numpy oracles, written from docs/design.md (the two ops' semantics).

Nothing here imports ``attn_common`` or ``attn_reference``: every rule (the ranker mask,
the soft caps, unit selection as a set, the ragged paged layout, the scatter) is
re-derived from the specification with plain loops and numpy, so the reference is
checked against a second, separately written definition of the same semantics.
"""

from __future__ import annotations

import math

import numpy as np


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _cap_name(cap_method) -> str:
    if cap_method is None:
        return "none"
    name = getattr(cap_method, "value", cap_method)  # CapMethod enum or plain string
    return str(name).lower()


def apply_cap(s: np.ndarray, cap_method, cap_value) -> np.ndarray:
    """The soft cap (docs/design.md#ranker-attention), in float64."""
    name = _cap_name(cap_method)
    if name == "none":
        return s
    c = float(cap_value)
    if name == "tanh":
        return c * np.tanh(s / c)
    if name == "soft_sign":
        return s / (1.0 + np.abs(s) / c)
    raise ValueError(f"unknown cap method {cap_method!r}")


def cap_grad(s: np.ndarray, cap_method, cap_value) -> np.ndarray:
    """d cap(s) / d s, derived by hand from the formulas above."""
    name = _cap_name(cap_method)
    if name == "none":
        return np.ones_like(s)
    c = float(cap_value)
    if name == "tanh":
        return 1.0 / np.cosh(s / c) ** 2
    if name == "soft_sign":
        return 1.0 / (1.0 + np.abs(s) / c) ** 2
    raise ValueError(f"unknown cap method {cap_method!r}")


def ranker_allowed(bounds_row, seq_len: int) -> np.ndarray:
    """``[S, S]`` bool: query i may attend key j (docs/design.md#ranker-attention), by
    explicit loops.

    Bounds are used exactly as written: ``j in [lo, hi)`` for positions ``0 <= j < S``.
    Out-of-range values therefore act as if clipped, and ``hi <= lo`` is empty.
    """
    hl, hu, cl, cu = (int(x) for x in bounds_row)
    allowed = np.zeros((seq_len, seq_len), dtype=bool)
    for i in range(seq_len):
        i_hist = hl <= i < hu
        i_cand = cl <= i < cu
        for j in range(seq_len):
            j_hist = hl <= j < hu
            allowed[i, j] = (j_hist and (i_hist or i_cand)) or (i_cand and j == i)
    return allowed


def _bounds_rows(bounds, batch: int) -> np.ndarray:
    b = np.asarray(bounds, dtype=np.int64)
    if b.ndim == 1:
        b = b[None]
    if b.shape[0] == 1:
        b = np.repeat(b, batch, axis=0)
    assert b.shape == (batch, 4), b.shape
    return b


def _masked_softmax(s: np.ndarray, allowed: np.ndarray):
    """Rows of ``s`` [..., n] restricted to ``allowed`` [..., n]: (p, lse); empty row: 0, -inf."""
    s = np.where(allowed, s, -np.inf)
    has = allowed.any(axis=-1, keepdims=True)
    m = np.where(has, s.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    e = np.where(allowed, np.exp(s - m), 0.0)
    z = e.sum(axis=-1, keepdims=True)
    p = np.where(has, e / np.where(has, z, 1.0), 0.0)
    lse = np.where(has[..., 0], m[..., 0] + np.log(np.where(has, z, 1.0))[..., 0], -np.inf)
    return p, lse


def ranker_oracle(q, k, v, bounds, sm_scale=None, cap_method=None, cap_value=None):
    """Ranker attention in float64. Returns ``out [B,S,Hq,D]`` and ``lse [B,Hq,S]``.

    ``bounds``: ``[B, 4]`` or ``[4]``. Rows with no allowed key: out 0, lse -inf.
    """
    seq_len = np.shape(q)[1]
    rows = _bounds_rows(bounds, np.shape(q)[0])
    masks = [ranker_allowed(row, seq_len) for row in rows]
    return _oracle_from_masks(q, k, v, masks, sm_scale, cap_method, cap_value)


def _oracle_from_masks(q, k, v, masks, sm_scale, cap_method, cap_value):
    """Masked softmax attention in float64 with one ``[S, S]`` mask per batch row."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    batch, seq_len, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    assert q_heads % kv_heads == 0
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    out = np.zeros_like(q)
    lse = np.full((batch, q_heads, seq_len), -np.inf)
    for b in range(batch):
        allowed = masks[b]
        for h in range(q_heads):
            kh = h // group
            s = apply_cap((q[b, :, h] @ k[b, :, kh].T) * scale, cap_method, cap_value)
            p, lse[b, h] = _masked_softmax(s, allowed)
            out[b, :, h] = p @ v[b, :, kh]
    return out, lse


def ranker_oracle_grad(
    q, k, v, bounds, d_out, d_lse, sm_scale=None, cap_method=None, cap_value=None
):
    """Analytic float64 backward of ``sum(out * d_out) + sum(lse * d_lse)`` (finite lse only).

    Derived by hand: with p = softmax(y) over allowed keys, y = cap(s), s = scale q.k,
      dv_j = sum_i p_ij do_i;  dp_ij = do_i . v_j;
      dy_ij = p_ij (dp_ij - sum_j' p_ij' dp_ij') + p_ij dlse_i   (d lse / d y = p);
      ds = dy * cap'(s);  dq_i = scale sum_j ds_ij k_j;  dk_j = scale sum_i ds_ij q_i.
    GQA: dk, dv sum over the query heads of a group. Returns (dq, dk, dv).
    """
    seq_len = np.shape(q)[1]
    rows = _bounds_rows(bounds, np.shape(q)[0])
    masks = [ranker_allowed(row, seq_len) for row in rows]
    return _oracle_grad_from_masks(q, k, v, masks, d_out, d_lse, sm_scale, cap_method, cap_value)


def _oracle_grad_from_masks(q, k, v, masks, d_out, d_lse, sm_scale, cap_method, cap_value):
    q, k, v = _f64(q), _f64(k), _f64(v)
    d_out, d_lse = _f64(d_out), _f64(d_lse)
    batch, _, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(batch):
        allowed = masks[b]
        for h in range(q_heads):
            kh = h // group
            s = (q[b, :, h] @ k[b, :, kh].T) * scale
            p, lse = _masked_softmax(apply_cap(s, cap_method, cap_value), allowed)
            o = p @ v[b, :, kh]
            do = d_out[b, :, h]
            dl = np.where(np.isfinite(lse), d_lse[b, h], 0.0)
            dv[b, :, kh] += p.T @ do
            dp = do @ v[b, :, kh].T
            dy = p * (dp - (do * o).sum(axis=1, keepdims=True)) + p * dl[:, None]
            ds = np.where(allowed, dy * cap_grad(s, cap_method, cap_value), 0.0)
            dq[b, :, h] = scale * ds @ k[b, :, kh]
            dk[b, :, kh] += scale * ds.T @ q[b, :, h]
    return dq, dk, dv


# --------------------------------------------------------------------------------------
# Packed rows: several users per row (bounds [B, U, 4])


def ranker_allowed_packed(users, seq_len: int) -> np.ndarray:
    """``[S, S]`` bool for one packed row, ``users [U, 4]`` = per-user (hl, hu, cl, cu).

    Written from the packed rule "a token attends only within its own user": each
    position has at most one owner (the user whose history or candidates hold it; the
    users must be disjoint, which is asserted); an owned query ``i`` of user ``u`` sees
    ``u``'s history keys, and itself when it is one of ``u``'s candidates. Bounds are
    used as written (``[lo, hi)`` over ``0 <= j < S``), so out-of-range values act as
    clipped, inverted segments as empty, all-zero slots as unused.
    """
    users = [tuple(int(x) for x in u) for u in np.asarray(users).reshape(-1, 4)]
    owner = [None] * seq_len
    for u, (hl, hu, cl, cu) in enumerate(users):
        for t in range(seq_len):
            if hl <= t < hu or cl <= t < cu:
                assert owner[t] in (None, u), f"position {t}: users {owner[t]} and {u} overlap"
                owner[t] = u
    allowed = np.zeros((seq_len, seq_len), dtype=bool)
    for i in range(seq_len):
        if owner[i] is None:
            continue
        hl, hu, cl, cu = users[owner[i]]
        for j in range(seq_len):
            allowed[i, j] = (hl <= j < hu) or (cl <= i < cu and j == i)
    return allowed


def _packed_masks(bounds, batch: int, seq_len: int):
    b = np.asarray(bounds, dtype=np.int64)
    if b.ndim == 2:
        b = b[:, None, :]
    if b.shape[0] == 1:
        b = np.repeat(b, batch, axis=0)
    assert b.ndim == 3 and b.shape[0] == batch and b.shape[2] == 4, b.shape
    return [ranker_allowed_packed(b[r], seq_len) for r in range(batch)]


def ranker_oracle_packed(q, k, v, bounds, sm_scale=None, cap_method=None, cap_value=None):
    """Packed ranker attention in float64 (``bounds [B, U, 4]``, ``[1, U, 4]`` or
    ``[B, 4]``): ``out [B,S,Hq,D]``, ``lse [B,Hq,S]``; rows with no key: 0 and -inf."""
    masks = _packed_masks(bounds, np.shape(q)[0], np.shape(q)[1])
    return _oracle_from_masks(q, k, v, masks, sm_scale, cap_method, cap_value)


def ranker_oracle_packed_grad(
    q, k, v, bounds, d_out, d_lse, sm_scale=None, cap_method=None, cap_value=None
):
    """The hand-derived float64 backward (see ``ranker_oracle_grad``) for packed rows."""
    masks = _packed_masks(bounds, np.shape(q)[0], np.shape(q)[1])
    return _oracle_grad_from_masks(q, k, v, masks, d_out, d_lse, sm_scale, cap_method, cap_value)


def _attend_tokens(q_sh, keys, dv: int, scale: float):
    """One query's heads ``[H, Dk]`` over ``keys [n, Dk]``: (out [H, dv], lse [H])."""
    heads = q_sh.shape[0]
    if keys.shape[0] == 0:
        return np.zeros((heads, dv)), np.full((heads,), -np.inf)
    s = (q_sh @ keys.T) * scale
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - m)
    z = e.sum(axis=1, keepdims=True)
    return (e / z) @ keys[:, :dv], m[:, 0] + np.log(z[:, 0])


def sparse_mla_oracle_flat(q, kv, indices, positions, sm_scale, dv, read_block):
    """Flat sparse MLA in float64: ``out [B,S,H,Dv]``, ``lse [B,S,H]``.

    Token t is a key of query (b, s) iff ``t // read_block`` is in the set of its
    selected ids (``-1``/negative = none; duplicates count once; ids whose tokens lie at
    or beyond T select nothing), ``t <= positions[b, s]`` and ``t < T``.
    """
    q, kv = _f64(q), _f64(kv)
    indices = np.asarray(indices, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    batch, seq, heads, _ = q.shape
    num_tokens = kv.shape[1]
    out = np.zeros((batch, seq, heads, dv))
    lse = np.full((batch, seq, heads), -np.inf)
    for b in range(batch):
        for s in range(seq):
            units = {int(u) for u in indices[b, s] if u >= 0}
            tokens = [
                t for t in range(num_tokens) if t // read_block in units and t <= positions[b, s]
            ]
            keys = kv[b, tokens]
            out[b, s], lse[b, s] = _attend_tokens(q[b, s], keys, dv, float(sm_scale))
    return out, lse


def _paged_row(cache: np.ndarray, page: int, row: int) -> np.ndarray:
    """Row ``row`` of physical page ``page`` of ``[num_pages, page_size // pk, pk, D]``."""
    pk = cache.shape[2]
    return cache[page, row // pk, row % pk]


def ragged_request_tokens(cache, page_indices, cu_kv_lens, r: int, page_size: int):
    """Request ``r``'s whole page extent as ``[extent * page_size, D]`` float64 rows."""
    base = int(cu_kv_lens[r]) // page_size
    n_pages = (int(cu_kv_lens[r + 1]) - int(cu_kv_lens[r])) // page_size
    rows = []
    for j in range(n_pages * page_size):
        phys = int(page_indices[base + j // page_size])
        rows.append(_paged_row(cache, phys, j % page_size))
    d = cache.shape[-1]
    return _f64(np.stack(rows)) if rows else np.zeros((0, d))


def sparse_mla_oracle_ragged(
    q,
    cache,
    indices,
    positions,
    q_seq_id,
    seq_lens,
    cu_kv_lens,
    page_indices,
    *,
    page_size,
    sm_scale,
    dv,
):
    """Ragged paged sparse MLA in float64.

    q ``[1, S, H, Dk]`` (or ``[S, H, Dk]``), cache ``[num_pages, page_size // pk, pk,
    Dk_pad]``, indices ``[1, S, K]`` / ``[S, K]`` request-local page ids, positions
    ``[1, S]`` / ``[S]`` request-local. Request r's token j lives on physical page
    ``page_indices[cu_kv_lens[r] // page_size + j // page_size]`` at row
    ``j % page_size``. A local page id p is a selection iff ``0 <= p < extent`` with
    ``extent = (cu_kv_lens[r+1] - cu_kv_lens[r]) // page_size``. Token j is a key iff its
    page is selected, ``j <= position`` and ``j < seq_lens[r]``.
    Returns ``out [1, S, H, Dv]``, ``lse [1, S, H]``.
    """
    q = _f64(q)
    if q.ndim == 4:
        q = q[0]
    indices = np.asarray(indices, dtype=np.int64).reshape(q.shape[0], -1)
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    q_seq_id = np.asarray(q_seq_id, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    cu_kv_lens = np.asarray(cu_kv_lens, dtype=np.int64)
    page_indices = np.asarray(page_indices, dtype=np.int64)
    cache = np.asarray(cache)
    num_q, heads, dk = q.shape
    out = np.zeros((num_q, heads, dv))
    lse = np.full((num_q, heads), -np.inf)
    per_request = {}
    for i in range(num_q):
        r = int(q_seq_id[i])
        if r not in per_request:
            per_request[r] = ragged_request_tokens(cache, page_indices, cu_kv_lens, r, page_size)
        tokens_r = per_request[r]
        extent = (cu_kv_lens[r + 1] - cu_kv_lens[r]) // page_size
        pages = {int(p) for p in indices[i] if 0 <= p < extent}
        tokens = [
            j for j in range(int(seq_lens[r])) if j // page_size in pages and j <= positions[i]
        ]
        keys = tokens_r[tokens, :dk]
        out[i], lse[i] = _attend_tokens(q[i], keys, dv, float(sm_scale))
    return out[None], lse[None]


def scatter_oracle(cache, rows, loc):
    """``cache[loc[t]] = rows[t]`` for every ``0 <= loc[t] < num_pages * page_size``.

    Flat slot s is page ``s // page_size``, row ``s % page_size`` of the paged layout
    ``[num_pages, page_size // pk, pk, D]``; rows are cast to the cache dtype. Returns a
    new numpy array; the input is not modified.
    """
    new = np.array(cache, copy=True)
    num_pages, _, pk, _ = new.shape
    page_size = new.shape[1] * pk
    rows = np.asarray(rows)
    for t, slot in enumerate(np.asarray(loc, dtype=np.int64)):
        if 0 <= slot < num_pages * page_size:
            page, row = divmod(int(slot), page_size)
            new[page, row // pk, row % pk] = rows[t].astype(new.dtype)
    return new
