"""Repository-wide pytest setup, loaded before any test module (and before JAX starts).

XLA's CPU client runs programs on an intra-op thread pool of ``NPROC`` threads, or as
many as the process may use cores when ``NPROC`` is unset. The Pallas interpreters
(Mosaic GPU and Mosaic TPU interpret mode) run each warpgroup or core as its own XLA
program on its own thread, and those programs block on one another at barriers. With a
pool smaller than the number of programs that must run at once, a program that another
one waits for never gets a thread: the test hangs. On a two-core CI machine that happened
depending on the schedule; pinned to one core (``taskset -c 0``) it hangs every time. A
pool of at least 16 threads is more than any kernel here interprets at once.
"""

import os

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
