"""Build ``tests/data/attn_common_api.json``: the names each attn-common version provides.

For every version of ``common/pyproject.toml`` in the git history, the names that *every*
commit carrying that version provided (the intersection over those commits, so a floor
``attn-common>=X`` is only credited with names any build labelled X had):

* ``""``: the package's public names (``attn_common.__all__``, else the names bound in
  ``__init__.py``);
* ``"<module>"``: the public top-level names of ``attn_common/<module>.py``.

The version in the working tree (unreleased) is recorded from the working tree. Run
``python tests/api_history.py`` from the repository root after changing what attn-common
exports, and commit the JSON; ``tests/test_packaging.py`` checks it against the packages.
"""

from __future__ import annotations

import ast
import json
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "common/src/attn_common"
OUT = ROOT / "tests" / "data" / "attn_common_api.json"


def module_names(source: str, *, init: bool) -> set[str]:
    """Public names a module binds at top level (``__all__`` for the package)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in tree.body:
        is_all = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        )
        if init and is_all:
            return {ast.literal_eval(e) for e in node.value.elts}
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return {n for n in names if not n.startswith("_")}


def api_of(files: dict[str, str]) -> dict[str, set[str]]:
    """``files``: module file name -> source."""
    api = {}
    for name, source in files.items():
        key = "" if name == "__init__.py" else name.removesuffix(".py")
        api[key] = module_names(source, init=name == "__init__.py")
    return api


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def _version(pyproject: str) -> str:
    return tomllib.loads(pyproject)["project"]["version"]


def history() -> dict[str, dict[str, list[str]]]:
    per_version: dict[str, dict[str, set[str]]] = {}
    for commit in reversed(_git("log", "--format=%H", "--", "common").split()):
        version = _version(_git("show", f"{commit}:common/pyproject.toml"))
        listing = _git("ls-tree", "--name-only", f"{commit}:{PACKAGE}").split()
        files = {n: _git("show", f"{commit}:{PACKAGE}/{n}") for n in listing if n.endswith(".py")}
        api = api_of(files)
        if version not in per_version:
            per_version[version] = api
        else:  # names every commit of this version had
            old = per_version[version]
            per_version[version] = {k: old[k] & api[k] for k in old.keys() & api.keys()}
    tree = ROOT / PACKAGE
    current = _version((ROOT / "common" / "pyproject.toml").read_text())
    per_version[current] = api_of({p.name: p.read_text() for p in sorted(tree.glob("*.py"))})
    return {
        v: {k: sorted(names) for k, names in sorted(api.items())} for v, api in per_version.items()
    }


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(history(), indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
