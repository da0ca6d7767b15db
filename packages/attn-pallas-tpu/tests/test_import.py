"""The attn-pallas-tpu package imports and reports the version it was installed with."""

import tomllib
from importlib.metadata import version
from pathlib import Path

import attn_pallas_tpu

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_matches_installed_metadata() -> None:
    installed = version("attn-pallas-tpu")
    assert attn_pallas_tpu.__version__ == installed
    # "0+unknown" is the fallback for an uninstalled source tree; the tests run on an install.
    assert attn_pallas_tpu.__version__ != "0+unknown"


def test_installed_metadata_matches_pyproject() -> None:
    # A stale install (older wheel or editable from another checkout) fails here.
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert version("attn-pallas-tpu") == declared


def test_all_names_exist() -> None:
    assert isinstance(attn_pallas_tpu.__all__, list)
    missing = [name for name in attn_pallas_tpu.__all__ if not hasattr(attn_pallas_tpu, name)]
    assert missing == []
