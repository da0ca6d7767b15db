"""The attn-mosaic-gpu package imports and reports the version it was installed with."""

import tomllib
from importlib.metadata import version
from pathlib import Path

import attn_mosaic_gpu

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_matches_installed_metadata() -> None:
    installed = version("attn-mosaic-gpu")
    assert attn_mosaic_gpu.__version__ == installed
    # "0+unknown" is the fallback for an uninstalled source tree; the tests run on an install.
    assert attn_mosaic_gpu.__version__ != "0+unknown"


def test_installed_metadata_matches_pyproject() -> None:
    # A stale install (older wheel or editable from another checkout) fails here.
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert version("attn-mosaic-gpu") == declared


def test_all_names_exist() -> None:
    assert isinstance(attn_mosaic_gpu.__all__, list)
    missing = [name for name in attn_mosaic_gpu.__all__ if not hasattr(attn_mosaic_gpu, name)]
    assert missing == []
