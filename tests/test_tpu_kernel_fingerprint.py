"""``tests/tpu_kernel_fingerprint.py``: the same kernels give the same hashes, whatever
wraps them; a changed kernel parameter changes its hash."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

pytest.importorskip(
    "attn_pallas_tpu",
    reason="attn-pallas-tpu is not installed (pip install ./packages/attn-pallas-tpu)",
)
SCRIPT = Path(__file__).with_name("tpu_kernel_fingerprint.py")
CASE = "per-query-flat-h64-u16"


@pytest.fixture(scope="module")
def fingerprint():
    with load_script(SCRIPT, "tpu_kernel_fingerprint") as module:
        yield module


def test_hashes_follow_the_kernels_not_the_code_around_them(fingerprint, monkeypatch):
    from attn_pallas_tpu import config

    ((_, fn, avals),) = fingerprint.cases(CASE)
    first = fingerprint.kernel_hashes(fn, avals)
    assert len(first) == 3  # the forward, dq and dKV kernels
    wrapped = fingerprint.kernel_hashes(lambda *a: fn(*a), avals)  # another Python frame
    assert wrapped == first
    monkeypatch.setattr(config, "RING_SLOTS", config.RING_SLOTS + 1)  # a deeper ring
    deeper = fingerprint.kernel_hashes(lambda *a: fn(*a), avals)  # (a new trace)
    assert deeper != first and len(deeper) == 3


def test_unknown_case_is_named(fingerprint):
    with pytest.raises(SystemExit, match="no case 'nope'"):
        fingerprint.cases("nope")
