"""Packer for ranker batches: several users per sequence row.

Input pipeline use: from each user's ``(history_len, num_candidates)`` build packed rows
of length ``S`` for ``ranker_attention`` with packed bounds ``[B, U, 4]``
(``attn_common.packed``), instead of padding every user to ``S``. The planning
(``pack_users``) is numpy on the host; moving token features into the packed rows and
back (``PackedUsers.gather`` / ``scatter``) runs on the host too, or inside a jitted,
differentiated training step.

Per-user tokens live in one **flat jagged array** (the HSTU layout): user 0's history
then its candidates, then user 1's, ...; user ``i`` owns flat tokens
``token_offsets[i] .. token_offsets[i + 1] - 1`` (its history first). The packer returns

* ``gather_index [B, S]``: the flat token at each packed position, ``-1`` for padding,
  so ``packed = flat[gather_index]`` where ``gather_index >= 0`` (``PackedUsers.gather``);
* ``bounds [B, U, 4]`` int32: slot ``u`` of row ``b`` is one user's ``(history_lo,
  history_hi, candidate_lo, candidate_hi)``; unused slots are all-zero;
* ``scatter_index [F]``: the packed position ``b * S + s`` of each flat token, so
  ``flat = packed.reshape(B * S, ...)[scatter_index]`` brings outputs back to per-user
  order (``PackedUsers.scatter``); gather then scatter is the identity. ``F`` is the
  number of tokens ``T``, or the ``flat_len`` the flat arrays were padded to, whose
  entries past ``T`` are ``-1`` (no packed position: ``scatter`` fills them).

Placement: first-fit decreasing. Users are taken longest first (ties by index, so the
result is deterministic) and each goes into the first row with room (and a free user
slot when ``max_users_per_row`` or ``users_per_row`` is set), a new row otherwise.
Within a row users sit back to back in placement order, each as ``[history |
candidates]``; the rest of the row is padding. A user is never split across rows; a
user longer than ``S`` is refused. Users with no tokens take no slot (``user_row =
-1``), so zero-length users pad a batch to a fixed number of users.

Inside a training step: ``PackedUsers`` is a JAX pytree (its arrays are the leaves,
``seq_len`` is static), so it can be an argument of a jitted step, and ``gather`` and
``scatter`` of a JAX array (or a tracer) are JAX gathers: traceable and differentiable
(each is the other's transpose on the real tokens; padding gets ``fill`` and sends no
gradient). With ``num_rows``, ``users_per_row`` and ``flat_len`` fixed (and a fixed
number of users), every batch has the same shapes and the step compiles once. Numpy
in gives numpy out, for the input pipeline.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PackedUsers", "pack_users"]


def _on_host(*arrays) -> bool:
    """No JAX array (and no tracer) among ``arrays``: the numpy path applies."""
    return not any(isinstance(a, jax.Array) for a in arrays)


def _fill_where(valid, values, fill, xp):
    """``values`` where ``valid`` (``[...]``, broadcast over trailing dims), else ``fill``."""
    valid = valid.reshape(valid.shape + (1,) * (values.ndim - valid.ndim))
    return xp.where(valid, values, xp.asarray(fill, dtype=values.dtype))


def _take_rows(source, index, fill, xp):
    """``source[index]`` along axis 0 where ``index >= 0``, ``fill`` elsewhere."""
    shape = (*index.shape, *source.shape[1:])
    if source.shape[0] == 0 or 0 in index.shape:  # nothing to take: every entry is fill
        return xp.full(shape, fill, dtype=source.dtype)
    valid = index >= 0
    if xp is np:
        taken = source[np.where(valid, index, 0)]
    else:  # a gather; its transpose (the gradient) is a scatter-add onto ``source``
        taken = jnp.take(source, jnp.where(valid, index, 0), axis=0, mode="clip")
    return _fill_where(valid, taken, fill, xp)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedUsers:
    """The result of ``pack_users`` (see the module docstring); a JAX pytree.

    Attributes:
      seq_len: ``S``, the packed row length (static: pytree metadata).
      bounds: int32 ``[B, U, 4]`` per-row user segments; all-zero unused slots.
      gather_index: int64 ``[B, S]`` flat token per packed position, ``-1`` = padding.
      scatter_index: int64 ``[F]`` packed position ``b * S + s`` of each flat token,
        ``-1`` past the ``T`` real tokens (``F = flat_len``).
      token_offsets: int64 ``[N + 1]`` user ``i``'s flat tokens are
        ``[token_offsets[i], token_offsets[i + 1])``.
      user_row, user_slot, user_start: int64 ``[N]`` the row, bounds slot and first
        position of each user (``-1`` for users with no tokens).

    Under ``jit`` the arrays are tracers: ``gather``, ``scatter``, ``bounds`` and the
    shapes (``rows``, ``users_per_row``, ``flat_len``) work there; ``num_tokens`` and
    ``efficiency`` are host facts (read them before the step).
    """

    seq_len: int
    bounds: np.ndarray
    gather_index: np.ndarray
    scatter_index: np.ndarray
    token_offsets: np.ndarray
    user_row: np.ndarray
    user_slot: np.ndarray
    user_start: np.ndarray

    @property
    def rows(self) -> int:
        """``B``, the number of packed rows."""
        return self.bounds.shape[0]

    @property
    def users_per_row(self) -> int:
        """``U``, the bounds slots per row."""
        return self.bounds.shape[1]

    @property
    def flat_len(self) -> int:
        """``F``, the length of the flat token axis ``gather`` takes and ``scatter``
        returns: ``num_tokens``, or the ``flat_len`` given to ``pack_users``."""
        return self.scatter_index.shape[0]

    @property
    def num_tokens(self) -> int:
        """``T``, the real tokens (history + candidates of every user). Host only."""
        if isinstance(self.token_offsets, jax.core.Tracer):
            raise TypeError(
                "PackedUsers.num_tokens: token_offsets is traced here (inside jit or grad); "
                "the token count is a host fact, read it before the traced step"
            )
        return int(self.token_offsets[-1])

    @property
    def efficiency(self) -> float:
        """Real tokens / packed positions, ``T / (B * S)`` (1.0 = no padding). Host only."""
        total = self.rows * self.seq_len
        return self.num_tokens / total if total else 1.0

    def gather(self, flat, fill=0):
        """``flat [F, ...]`` (per-user order) -> packed ``[B, S, ...]``, ``fill`` at padding.

        Numpy in, numpy out. A JAX array or tracer in (or a traced ``PackedUsers``): JAX
        ops, usable inside ``jit`` and differentiable in ``flat`` (the gradient of a
        padding position is dropped)."""
        xp = np if _on_host(flat, self.gather_index) else jnp
        flat = xp.asarray(flat)
        if flat.ndim < 1 or flat.shape[0] != self.flat_len:
            raise ValueError(
                f"flat: got shape {flat.shape}, expected [F={self.flat_len}, ...] (the flat "
                "token axis first: num_tokens, or the flat_len given to pack_users)"
            )
        return _take_rows(flat, xp.asarray(self.gather_index), fill, xp)

    def scatter(self, packed, fill=0):
        """Packed ``[B, S, ...]`` -> ``[F, ...]`` in per-user (flat) order; ``fill`` for
        the flat entries past the real tokens (``flat_len`` padding).

        Numpy in, numpy out; a JAX array or tracer in: JAX ops, usable inside ``jit``
        and differentiable in ``packed`` (padding positions get zero gradient)."""
        xp = np if _on_host(packed, self.scatter_index) else jnp
        packed = xp.asarray(packed)
        if packed.shape[:2] != (self.rows, self.seq_len):
            raise ValueError(
                f"packed: got shape {packed.shape}, expected [B={self.rows}, S={self.seq_len}, ...]"
            )
        rows = packed.reshape(self.rows * self.seq_len, *packed.shape[2:])
        return _take_rows(rows, xp.asarray(self.scatter_index), fill, xp)


jax.tree_util.register_dataclass(
    PackedUsers,
    data_fields=[f.name for f in dataclasses.fields(PackedUsers) if f.name != "seq_len"],
    meta_fields=["seq_len"],
)


def _lengths(x, name: str, n: int | None) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: got dtype {arr.dtype}, expected integers")
    if arr.ndim > 1:
        raise ValueError(f"{name}: got shape {arr.shape}, expected a scalar or [num_users]")
    if n is not None:
        if arr.ndim == 1 and arr.shape[0] != n:
            raise ValueError(f"{name}: got {arr.shape[0]} users, expected {n} (history_lens)")
        arr = np.broadcast_to(arr, (n,))
    if (arr < 0).any():
        i = int(np.argmax(arr < 0))
        raise ValueError(f"{name}: user {i} has {int(arr[i])}, expected >= 0")
    return arr.astype(np.int64)


def pack_users(
    history_lens,
    num_candidates,
    *,
    seq_len: int,
    max_users_per_row: int | None = None,
    num_rows: int | None = None,
    users_per_row: int | None = None,
    flat_len: int | None = None,
    align: int = 1,
) -> PackedUsers:
    """Pack users into rows of ``seq_len`` tokens (first-fit decreasing).

    Args:
      history_lens: int ``[N]`` history length of each user.
      num_candidates: int ``[N]`` or a scalar: candidates of each user.
      seq_len: ``S``, the packed row length; every user needs ``h + c <= S``.
      max_users_per_row: at most this many users per row (``U`` of the bounds; the
        kernels' work per tile grows with ``U``). Default: no limit, ``U`` is the most
        users any row got.
      num_rows: pad the result to exactly this many rows (static shapes for a jitted
        step); ``ValueError`` when the users need more. Default: the rows used.
      users_per_row: exactly this many bounds slots per row (static shapes): at most
        this many users go into a row (as ``max_users_per_row``, the smaller of the two
        applies) and the bounds are padded with all-zero slots to ``U = users_per_row``.
      flat_len: the flat token arrays are padded to this length (static shapes):
        ``gather`` takes ``[flat_len, ...]`` (entries past the real tokens are never
        read) and ``scatter`` returns ``[flat_len, ...]`` (``fill`` there);
        ``ValueError`` when the users have more tokens. Default: the token count.
      align: each user starts at a multiple of ``align`` positions (1: back to back).

    Returns a ``PackedUsers``. Example: users of lengths (3+1, 2+1, 5+2) at ``S = 8``::

        p = pack_users([3, 2, 5], [1, 1, 2], seq_len=8)
        p.bounds  # [[[0, 5, 5, 7], [0, 0, 0, 0]],   row 0: user 2
        #  [[0, 3, 3, 4], [4, 6, 6, 7]]]   row 1: users 0, 1
        p.efficiency  # 14 / 16
    """
    for name, value in (("seq_len", seq_len), ("align", align)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name}: got {value!r}, expected a positive int")
    hist = _lengths(history_lens, "history_lens", None)
    if hist.ndim != 1:
        raise ValueError(f"history_lens: got shape {hist.shape}, expected [num_users]")
    n = hist.shape[0]
    cand = _lengths(num_candidates, "num_candidates", n)
    length = hist + cand
    too_long = length > seq_len
    if too_long.any():
        i = int(np.argmax(too_long))
        raise ValueError(
            f"history_lens, num_candidates: user {i} has {int(hist[i])} + {int(cand[i])} = "
            f"{int(length[i])} tokens, more than seq_len = {seq_len}; a user is never split "
            "across rows (raise seq_len or truncate its history)"
        )
    cap = max(n, 1)
    for name, value in (("max_users_per_row", max_users_per_row), ("users_per_row", users_per_row)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name}: got {value!r}, expected >= 1 or None")
        cap = min(cap, int(value))
    total = int(length.sum())
    if flat_len is not None:
        if isinstance(flat_len, bool) or not isinstance(flat_len, int | np.integer):
            raise ValueError(f"flat_len: got {flat_len!r}, expected an int >= the token count")
        if flat_len < total:
            raise ValueError(
                f"flat_len: got {flat_len}, expected at least the users' {total} tokens "
                "(history + candidates)"
            )

    order = np.argsort(-length, kind="stable")  # longest first, ties by index
    used = np.zeros(max(n, 1), np.int64)  # positions taken in each open row
    count = np.zeros(max(n, 1), np.int64)  # users in each open row
    n_rows = 0
    user_row = np.full(n, -1, np.int64)
    user_slot = np.full(n, -1, np.int64)
    user_start = np.full(n, -1, np.int64)
    for i in order:
        need = int(length[i])
        if need == 0:
            continue
        start = -(-used[:n_rows] // align) * align
        fits = (start + need <= seq_len) & (count[:n_rows] < cap)
        row = int(np.argmax(fits)) if fits.any() else n_rows
        if row == n_rows:
            n_rows += 1
            at = 0
        else:
            at = int(start[row])
        user_row[i], user_slot[i], user_start[i] = row, count[row], at
        used[row] = at + need
        count[row] += 1

    rows = n_rows if num_rows is None else int(num_rows)
    if rows < n_rows:
        raise ValueError(f"num_rows: got {num_rows}, the users need {n_rows} rows of {seq_len}")
    slots = max(int(count[:n_rows].max()) if n_rows else 0, 1)
    if users_per_row is not None:
        slots = int(users_per_row)
    bounds = np.zeros((rows, slots, 4), np.int32)
    placed = user_row >= 0
    r, s, a = user_row[placed], user_slot[placed], user_start[placed]
    h = hist[placed]
    bounds[r, s] = np.stack([a, a + h, a + h, a + length[placed]], axis=1)

    offsets = np.concatenate([[0], np.cumsum(length)]).astype(np.int64)
    # Flat token t of user i sits at position user_start[i] + (t - offsets[i]) of its row.
    owner = np.repeat(np.arange(n), length)
    within = np.arange(total) - offsets[owner]
    scatter_index = user_row[owner] * seq_len + user_start[owner] + within
    gather_index = np.full(rows * seq_len, -1, np.int64)
    gather_index[scatter_index] = np.arange(total)
    pad = (total if flat_len is None else int(flat_len)) - total
    scatter_index = np.concatenate([scatter_index, np.full(pad, -1, np.int64)])
    return PackedUsers(
        seq_len=int(seq_len),
        bounds=bounds,
        gather_index=gather_index.reshape(rows, seq_len),
        scatter_index=scatter_index,
        token_offsets=offsets,
        user_row=user_row,
        user_slot=user_slot,
        user_start=user_start,
    )


def __getattr__(name: str):
    """``simulate_ranker_users`` moved to the Hopper backend's ``bench`` (deprecated here)."""
    from attn_common import _moved

    return _moved.resolve("packing", name)
