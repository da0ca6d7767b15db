"""These tests need ``attn-pallas-tpu`` installed; without it each test file is skipped
with the install command as the reason (README, Install: install only the backends you
need), instead of failing to import at collection."""

import importlib.util

import pytest

MISSING = importlib.util.find_spec("attn_pallas_tpu") is None
REASON = "attn-pallas-tpu is not installed (pip install ./packages/attn-pallas-tpu)"


class _NotInstalled(pytest.Module):
    def collect(self):
        pytest.skip(REASON)


def pytest_pycollect_makemodule(module_path, parent):
    if MISSING:
        return _NotInstalled.from_parent(parent, path=module_path)
    return None
