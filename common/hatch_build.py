"""Hatchling metadata hook: refuse a Python older than ``requires-python``, by name.

pip resolves a local project's dependencies before it checks the project's own
``requires-python``, so on Python 3.11 ``pip install ./common ...`` failed with "No matching
distribution found for jax<0.12,>=0.11.2", which blames JAX. Hatchling loads this file
while pip prepares the metadata, before anything is resolved; every install command of
this repository names ``./common``, so this one check covers them all.
"""

from __future__ import annotations

import sys

REQUIRES_PYTHON = (3, 12)  # pyproject.toml's requires-python (tests/test_packaging.py)


def python_problem(version: tuple[int, ...] = tuple(sys.version_info)) -> str | None:
    """The error for a Python older than ``REQUIRES_PYTHON``, or None."""
    if tuple(version[:2]) >= REQUIRES_PYTHON:
        return None
    need = ".".join(map(str, REQUIRES_PYTHON))
    have = ".".join(map(str, version[:3]))
    return (
        f"attn-common requires Python >= {need} (requires-python in its pyproject.toml), "
        f"and this pip runs on Python {have}; install with python{need} -m pip install ..."
    )


def get_metadata_hook():
    """Hatchling's entry: the check runs here; the hook itself changes nothing."""
    problem = python_problem()
    if problem:
        raise RuntimeError(problem)
    from hatchling.metadata.plugin.interface import MetadataHookInterface

    class RequiresPython(MetadataHookInterface):
        def update(self, metadata: dict) -> None:
            pass

    return RequiresPython
