"""Repository-wide pytest setup, loaded before any test module (and before JAX starts).

XLA's CPU client runs programs on an intra-op thread pool of ``NPROC`` threads, or as
many as the process may use cores when ``NPROC`` is unset. The Pallas interpreters
(Mosaic GPU and Mosaic TPU interpret mode) run each warpgroup or core as its own XLA
program on its own thread, and those programs block on one another at barriers. With a
pool smaller than the number of programs that must run at once, a program that another
one waits for never gets a thread: the test hangs. On a two-core CI machine that happened
depending on the schedule; pinned to one core (``taskset -c 0``) it hangs every time. A
pool of at least 16 threads is more than any kernel here interprets at once.

The backend packages' tests need their package installed; without it each test file under
``packages/<dist>/tests`` is skipped with the install command as the reason (README,
Install: install only the backends you need), instead of failing to import at collection.
"""

import importlib.util
import os
from pathlib import Path

import pytest

_MIN_XLA_CPU_THREADS = 16

if int(os.environ.get("NPROC", "0") or 0) < _MIN_XLA_CPU_THREADS:
    os.environ["NPROC"] = str(_MIN_XLA_CPU_THREADS)


def pytest_addoption(parser, pluginmanager):
    """Without pytest-timeout (not needed to run the tests), declare the two ini options
    pyproject.toml sets for it, so that pytest does not warn about unknown options; the
    per-test time limit then does not apply."""
    if not pluginmanager.has_plugin("timeout"):
        parser.addini("timeout", "per-test limit in seconds (read by pytest-timeout)")
        parser.addini("timeout_method", "signal or thread (read by pytest-timeout)")


def pytest_configure(config):
    """The quick tier: a run that deselects the tests marked slow (``-m "not slow"``, as
    tests-cpu and CI do) also runs the property tests with fewer hypothesis examples
    (``helpers.tier_examples``); tests-cpu-full, with no marker filter, runs them all.
    ``ATTN_TEST_TIER=full`` or ``quick`` set by hand wins. The interpreters' host
    callbacks get their arguments boxed cheaply (``helpers.box_interpret_callbacks_cheaply``:
    JAX's boxing was 10-12 % of the interpret-mode test files' time, docs/design.md)."""
    if "ATTN_TEST_TIER" not in os.environ:
        quick = "not slow" in (config.getoption("markexpr", "") or "")
        os.environ["ATTN_TEST_TIER"] = "quick" if quick else "full"
    from helpers import box_interpret_callbacks_cheaply

    box_interpret_callbacks_cheaply()


_PACKAGES = Path(__file__).resolve().parent / "packages"
# Backend distribution directory -> the import name its tests need.
_BACKENDS = {"attn-mosaic-gpu": "attn_mosaic_gpu", "attn-pallas-tpu": "attn_pallas_tpu"}


class _NotInstalled(pytest.Module):
    """A test file whose backend is not installed: collected as one skip."""

    reason = ""

    def collect(self):
        pytest.skip(self.reason)


def pytest_pycollect_makemodule(module_path, parent):
    path = Path(module_path).resolve()
    for dist, name in _BACKENDS.items():
        if (
            path.is_relative_to(_PACKAGES / dist / "tests")
            and importlib.util.find_spec(name) is None
        ):
            module = _NotInstalled.from_parent(parent, path=module_path)
            module.reason = f"{dist} is not installed (pip install ./packages/{dist})"
            return module
    return None
