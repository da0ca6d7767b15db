"""Host-side packer for ranker batches: several users per sequence row (numpy only).

Input pipeline use: from each user's ``(history_len, num_candidates)`` build packed rows
of length ``S`` for ``ranker_attention`` with packed bounds ``[B, U, 4]``
(``attn_common.packed``), instead of padding every user to ``S``.

Per-user tokens live in one **flat jagged array** (the HSTU layout): user 0's history
then its candidates, then user 1's, ...; user ``i`` owns flat tokens
``token_offsets[i] .. token_offsets[i + 1] - 1`` (its history first). The packer returns

* ``gather_index [B, S]``: the flat token at each packed position, ``-1`` for padding,
  so ``packed = flat[gather_index]`` where ``gather_index >= 0`` (``PackedUsers.gather``);
* ``bounds [B, U, 4]`` int32: slot ``u`` of row ``b`` is one user's ``(history_lo,
  history_hi, candidate_lo, candidate_hi)``; unused slots are all-zero;
* ``scatter_index [T]``: the packed position ``b * S + s`` of each flat token, so
  ``flat = packed.reshape(B * S, ...)[scatter_index]`` brings outputs back to per-user
  order (``PackedUsers.scatter``); gather then scatter is the identity.

Placement: first-fit decreasing. Users are taken longest first (ties by index, so the
result is deterministic) and each goes into the first row with room (and a free user
slot when ``max_users_per_row`` is set), a new row otherwise. Within a row users sit
back to back in placement order, each as ``[history | candidates]``; the rest of the
row is padding. A user is never split across rows; a user longer than ``S`` is refused.
Users with no tokens take no slot (``user_row = -1``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["PackedUsers", "pack_users"]


@dataclasses.dataclass(frozen=True, eq=False)
class PackedUsers:
    """The result of ``pack_users`` (numpy arrays; see the module docstring).

    Attributes:
      seq_len: ``S``, the packed row length.
      bounds: int32 ``[B, U, 4]`` per-row user segments; all-zero unused slots.
      gather_index: int64 ``[B, S]`` flat token per packed position, ``-1`` = padding.
      scatter_index: int64 ``[T]`` packed position ``b * S + s`` of each flat token.
      token_offsets: int64 ``[N + 1]`` user ``i``'s flat tokens are
        ``[token_offsets[i], token_offsets[i + 1])``.
      user_row, user_slot, user_start: int64 ``[N]`` the row, bounds slot and first
        position of each user (``-1`` for users with no tokens).
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
    def num_tokens(self) -> int:
        """``T``, the real tokens (history + candidates of every user)."""
        return int(self.token_offsets[-1])

    @property
    def efficiency(self) -> float:
        """Real tokens / packed positions, ``T / (B * S)`` (1.0 = no padding)."""
        total = self.rows * self.seq_len
        return self.num_tokens / total if total else 1.0

    def gather(self, flat, fill=0):
        """``flat [T, ...]`` (per-user order) -> packed ``[B, S, ...]``, ``fill`` at padding."""
        flat = np.asarray(flat)
        if flat.shape[0] != self.num_tokens:
            raise ValueError(f"flat: got {flat.shape[0]} tokens, expected T = {self.num_tokens}")
        out = np.full((self.rows, self.seq_len, *flat.shape[1:]), fill, dtype=flat.dtype)
        pos = self.gather_index >= 0
        out[pos] = flat[self.gather_index[pos]]
        return out

    def scatter(self, packed):
        """Packed ``[B, S, ...]`` -> ``[T, ...]`` in per-user (flat) order."""
        packed = np.asarray(packed)
        if packed.shape[:2] != (self.rows, self.seq_len):
            raise ValueError(
                f"packed: got shape {packed.shape}, expected [B={self.rows}, S={self.seq_len}, ...]"
            )
        return packed.reshape(self.rows * self.seq_len, *packed.shape[2:])[self.scatter_index]


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
    if max_users_per_row is None:
        cap = max(n, 1)
    elif isinstance(max_users_per_row, bool) or int(max_users_per_row) < 1:
        raise ValueError(f"max_users_per_row: got {max_users_per_row!r}, expected >= 1 or None")
    else:
        cap = int(max_users_per_row)

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
    bounds = np.zeros((rows, slots, 4), np.int32)
    placed = user_row >= 0
    r, s, a = user_row[placed], user_slot[placed], user_start[placed]
    h = hist[placed]
    bounds[r, s] = np.stack([a, a + h, a + h, a + length[placed]], axis=1)

    offsets = np.concatenate([[0], np.cumsum(length)]).astype(np.int64)
    total = int(offsets[-1])
    # Flat token t of user i sits at position user_start[i] + (t - offsets[i]) of its row.
    owner = np.repeat(np.arange(n), length)
    within = np.arange(total) - offsets[owner]
    scatter_index = user_row[owner] * seq_len + user_start[owner] + within
    gather_index = np.full(rows * seq_len, -1, np.int64)
    gather_index[scatter_index] = np.arange(total)
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
