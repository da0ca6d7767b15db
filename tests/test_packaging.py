"""Honest packages: attn-common floors cover the names each backend imports, licenses,
changelogs, and the recorded attn-common API matches what attn-common exports today.

The recorded API is ``tests/data/attn_common_api.json`` (per attn-common version, the
names the package and each module provide; ``python tests/api_history.py`` rebuilds it
from the git history and the working tree).
"""

from __future__ import annotations

import ast
import importlib
import json
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import attn_common

ROOT = Path(__file__).resolve().parents[1]
API = json.loads((ROOT / "tests" / "data" / "attn_common_api.json").read_text())
BACKENDS = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
ALL_PACKAGES = [ROOT / "common", *BACKENDS]


def _project(pkg: Path) -> dict:
    return tomllib.loads((pkg / "pyproject.toml").read_text())["project"]


def _common_requirement(pkg: Path) -> Requirement:
    reqs = [Requirement(r) for r in _project(pkg)["dependencies"]]
    (req,) = [r for r in reqs if r.name == "attn-common"]
    return req


def _floor(req: Requirement) -> str:
    floors = [s.version for s in req.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{req}: expected exactly one >= floor"
    return floors[0]


def attn_common_imports(src: Path) -> set[tuple[str, str]]:
    """(module, name) pairs the package's source uses: module ``""`` is the package."""
    used: set[tuple[str, str]] = set()
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "attn_common":
                    used |= {("", a.name) for a in node.names}
                elif node.module.startswith("attn_common."):
                    mod = node.module.removeprefix("attn_common.")
                    used |= {(mod, a.name) for a in node.names}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("attn_common."):
                        used.add(("", a.name.removeprefix("attn_common.").split(".")[0]))
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "attn_common"
            ):
                used.add(("", node.attr))
    return used


def _provided(version: str, module: str, name: str) -> bool:
    api = API[version]
    if module == "":
        # `attn_common.<submodule>` is provided when the module exists in that version
        return name in api[""] or name in api
    return module in api and name in api[module]


def test_recorded_versions_include_the_current_one():
    current = _project(ROOT / "common")["version"]
    assert current in API, f"attn-common {current} not recorded: run python tests/api_history.py"
    assert sorted(API, key=Version)[-1] == current


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_floor_provides_every_imported_name(pkg):
    req = _common_requirement(pkg)
    floor = _floor(req)
    assert floor in API, f"{pkg.name}: floor attn-common>={floor} is not a recorded version"
    src = pkg / "src"
    used = attn_common_imports(src)
    assert used, f"{pkg.name}: found no attn_common imports (the check would check nothing)"
    missing = sorted(f"{m + '.' if m else ''}{n}" for m, n in used if not _provided(floor, m, n))
    assert not missing, (
        f"{pkg.name} declares attn-common>={floor} but imports names that version lacks: "
        f"{missing}; raise the floor"
    )
    current = _project(ROOT / "common")["version"]
    assert req.specifier.contains(current), f"{pkg.name}: {req} excludes attn-common {current}"


def test_floor_check_catches_a_missing_name():
    assert not _provided("0.1.0", "", "ranker_attention")  # added later in 0.1.x
    assert _provided("0.1.0", "", "KernelConfig")
    assert _provided(sorted(API, key=Version)[-1], "", "ranker_attention")


def test_current_exports_match_the_recorded_list():
    current = _project(ROOT / "common")["version"]
    recorded = set(API[current][""])
    exported = set(attn_common.__all__)
    assert exported == recorded, (
        f"attn_common exports differ from the recorded attn-common {current}: new "
        f"{sorted(exported - recorded)}, gone {sorted(recorded - exported)}; "
        "run python tests/api_history.py (and bump the version if a released name went)"
    )
    for name in recorded:
        assert hasattr(attn_common, name), name


def test_current_modules_keep_the_recorded_names():
    import importlib

    current = _project(ROOT / "common")["version"]
    for module, names in API[current].items():
        if not module:
            continue
        mod = importlib.import_module(f"attn_common.{module}")
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"attn_common.{module} lost {missing}: run tests/api_history.py"


def test_installed_packages_report_their_version():
    """Each installed package's ``__version__`` is its installed metadata's, which is its
    pyproject.toml's (a stale install, an older wheel or an editable install of another
    checkout, fails here), and every name in its ``__all__`` exists."""
    import importlib.metadata as md

    checked = []
    for pkg in ALL_PACKAGES:
        dist = _project(pkg)["name"]
        try:
            installed = md.version(dist)
        except md.PackageNotFoundError:
            continue  # the session installs only its platform's backends
        module = importlib.import_module(dist.replace("-", "_"))
        assert module.__version__ == installed == _project(pkg)["version"], dist
        assert isinstance(module.__all__, list), dist
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{dist}.__all__ names missing attributes: {missing}"
        checked.append(dist)
    assert "attn-common" in checked and len(checked) >= 2, checked


@pytest.mark.parametrize("pkg", ALL_PACKAGES, ids=lambda p: p.name)
def test_license_and_changelog(pkg):
    project = _project(pkg)
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    license_text = (pkg / "LICENSE").read_text()
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    changelog = (pkg / "CHANGELOG.md").read_text()
    assert f"## {project['version']}" in changelog, f"{pkg.name}: no entry for its version"
    assert "SPEC" not in project["description"]


PACKAGE_SOURCES = {
    "attn_common": ROOT / "common" / "src" / "attn_common",
    **{pkg.name.replace("-", "_"): pkg / "src" / pkg.name.replace("-", "_") for pkg in BACKENDS},
}


def _imports(path: Path, package: str | None = None, src: Path | None = None) -> set[str]:
    """Modules ``path`` imports at run time (top level or inside functions, and
    ``importlib.import_module("...")`` with a literal name): ``import a.b`` gives ``a.b``;
    ``from m import x`` gives ``m`` and ``m.x`` (with ``package``: ``m.x`` only for
    ``from package import x`` where ``x`` is a module file in ``src``)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for block in ast.walk(tree):  # ``if TYPE_CHECKING:`` imports never run: not edges
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING":
            block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if package is None:
                found |= {f"{node.module}.{a.name}" for a in node.names}
            elif node.module == package:
                found |= {
                    f"{package}.{a.name}" for a in node.names if (src / f"{a.name}.py").exists()
                }
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def test_common_imports_no_backend():
    """attn-common is the contract: no module of it imports a backend, even lazily (the
    `attn` command finds backend commands through the entry points)."""
    src = PACKAGE_SOURCES["attn_common"]
    backends = {name for name in PACKAGE_SOURCES if name != "attn_common"}
    for path in sorted(src.rglob("*.py")):
        bad = {m for m in _imports(path, "attn_common", src) if m.split(".")[0] in backends}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


# The front door: dispatch (the ops on the best backend), the sharding wrappers over it and
# the `attn` command. A backend is one implementation; it calls no other.
FRONT_DOOR = ("attn_common.dispatch", "attn_common.sharding", "attn_common.cli")
# The backends' tools, which may use the front door: `attn bench` / `attn tune` (registered
# by attn-mosaic-gpu), the TPU's sparse-MLA and ranker suites (`attn bench sparse-mla` /
# `attn bench ranker` on a TPU, registered by attn-pallas-tpu; also `python -m
# attn_pallas_tpu.bench_sparse_mla` / `bench_ranker`) and
# `python -m attn_reference.demo` (= `attn run all --implementation reference`).
BACKEND_TOOLS = {
    "attn_mosaic_gpu.cli",
    "attn_mosaic_gpu.bench",
    "attn_mosaic_gpu.bench_sparse_mla",
    "attn_mosaic_gpu.tuner",
    "attn_pallas_tpu.cli",
    "attn_pallas_tpu.bench_ranker",
    "attn_pallas_tpu.bench_sparse_mla",
    "attn_pallas_tpu.tune_ranker",
    "attn_pallas_tpu._suite",
    "attn_reference.demo",
}


def _front_door_names() -> set[str]:
    """``attn_common.<name>`` for the package's names that live in a front-door module."""
    return {
        f"attn_common.{name}"
        for name in attn_common.__all__
        if getattr(getattr(attn_common, name), "__module__", "").startswith(FRONT_DOOR)
    }


def _backend_rule_breaks(module: str, edges: set[str], front_door: set[str]) -> list[str]:
    """What ``module`` (of a backend) imports that the package rules forbid."""
    own = module.split(".")[0]
    others = {name for name in PACKAGE_SOURCES if name not in ("attn_common", own)}
    bad = [m for m in edges if m.split(".")[0] in others]
    if module not in BACKEND_TOOLS:
        bad += [m for m in edges if m in front_door or m.startswith(FRONT_DOOR)]
    return sorted(bad)


def test_backends_import_no_other_backend_and_no_front_door():
    """A backend imports no other backend (even lazily) and, outside its `attn bench` /
    `attn tune` tools, nothing of the front door: a kernel calls attn_common's specs,
    never the dispatch that calls it."""
    front_door = _front_door_names()
    assert "attn_common.ranker_attention" in front_door  # the check has something to find
    checked = 0
    for package, src in sorted(PACKAGE_SOURCES.items()):
        if package == "attn_common":
            continue
        for path in sorted(src.rglob("*.py")):
            module = ".".join((package, *path.relative_to(src).with_suffix("").parts))
            bad = _backend_rule_breaks(module, _imports(path), front_door)
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
            checked += 1
    assert checked > 20, checked


def test_backend_commands_live_in_listed_tools():
    """A backend that adds `attn` subcommands does so through its entry point module's
    ``cli_commands()`` (what ``attn_common.cli.backend_commands`` looks for), which
    imports them from one of ``BACKEND_TOOLS``."""
    adders = {}
    for package, src in sorted(PACKAGE_SOURCES.items()):
        tree = ast.parse((src / "__init__.py").read_text())
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "cli_commands":
                adders[package] = {
                    f"{node.module}.{a.name}"
                    for node in ast.walk(fn)
                    if isinstance(node, ast.ImportFrom)
                    for a in node.names
                }
    assert set(adders) == {"attn_mosaic_gpu", "attn_pallas_tpu"}
    for package, modules in adders.items():
        assert modules and modules <= BACKEND_TOOLS, (package, modules)


def test_backend_rule_check_catches_offenders(tmp_path):
    """The scan above sees lazy imports, ``import_module`` and front-door names."""
    path = tmp_path / "kernel.py"
    path.write_text(
        "import importlib\n"
        "from attn_common import CapParams, ranker_attention\n"
        "def f():\n"
        "    from attn_common.dispatch import select_backend\n"
        "    return importlib.import_module('attn_reference')\n"
    )
    bad = _backend_rule_breaks("attn_pallas_tpu.kernel", _imports(path), _front_door_names())
    assert bad == [
        "attn_common.dispatch",
        "attn_common.dispatch.select_backend",
        "attn_common.ranker_attention",
        "attn_reference",
    ]
    tool = _backend_rule_breaks("attn_mosaic_gpu.bench", _imports(path), _front_door_names())
    assert tool == ["attn_reference"]


@pytest.mark.parametrize("package", sorted(PACKAGE_SOURCES))
def test_no_import_cycle(package):
    """No package's modules import each other in a circle (lazy imports count)."""
    src = PACKAGE_SOURCES[package]
    graph = {}
    for path in src.glob("*.py"):
        name = package if path.stem == "__init__" else f"{package}.{path.stem}"
        graph[name] = {m for m in _imports(path, package, src) if m.split(".")[0] == package}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == package or nxt not in graph:
                continue  # the package's __init__ runs first anyway; not a circle
            assert state.get(nxt) != 1, f"import circle: {' -> '.join([*stack, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    assert len(graph) > 1
    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_public_names_are_few_and_documented():
    """At most 50 public names, each listed in docs/design.md's "Public names"."""
    assert len(attn_common.__all__) <= 50, len(attn_common.__all__)
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("### Public names", 1)[1].split("Kernel-side helpers", 1)[0]
    import re

    listed = set(re.findall(r"`(\w+)`", section)) - {"__all__"}
    assert listed == set(attn_common.__all__), (
        f"undocumented {sorted(set(attn_common.__all__) - listed)}, "
        f"documented but not exported {sorted(listed - set(attn_common.__all__))}"
    )


def test_moved_names_warn_and_still_work():
    """0.1.x names that left the top level or the package keep working until 0.3.0, with
    a DeprecationWarning naming the new home."""
    import warnings

    from attn_common import _moved

    for name, module in sorted(_moved.DEMOTED.items()):
        with pytest.warns(DeprecationWarning, match=f"attn_common.{module}.{name}"):
            value = getattr(attn_common, name)
        assert value is getattr(importlib.import_module(f"attn_common.{module}"), name)
    installed = set(attn_common.installed_backends())
    for name, (backend, module) in sorted(_moved.MOVED[""].items()):
        if backend not in installed:
            continue
        with pytest.warns(DeprecationWarning, match=f"{module}.{name}"):
            getattr(attn_common, name)
    if "mosaic-gpu" in installed:
        with pytest.warns(DeprecationWarning, match=r"attn_mosaic_gpu\.bench\.device_ms"):
            from attn_common.bench import device_ms  # noqa: F401
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            from attn_common import pack_users  # noqa: F401  (still public: no warning)
    with pytest.raises(AttributeError, match="no_such_name"):
        attn_common.no_such_name  # noqa: B018


def _tracked_sources() -> dict[str, ast.Module]:
    """Every Python file git tracks, parsed: path -> tree."""
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {
        name: ast.parse((ROOT / name).read_text(), name) for name in files if (ROOT / name).exists()
    }


# Underscore names that are public API: the named tuple's methods.
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def _own_private_names(trees: dict[str, ast.Module]) -> tuple[set[str], set[str]]:
    """``(attributes, keywords)``: the underscore names this repository defines, as
    something reached by ``x._name`` (modules, functions, classes, assigned names and
    attributes) and as something passed as ``_name=`` (parameters, class fields)."""
    attributes, keywords = set(), set()
    for name, tree in trees.items():
        attributes.add(Path(name).stem)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                attributes.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                attributes.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                attributes.add(node.attr)
            elif isinstance(node, ast.alias):
                attributes.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.arg):
                keywords.add(node.arg)
            if isinstance(node, ast.ClassDef):
                keywords |= {
                    t.id
                    for item in node.body
                    if isinstance(item, (ast.Assign, ast.AnnAssign))
                    for t in (item.targets if isinstance(item, ast.Assign) else [item.target])
                    if isinstance(t, ast.Name)
                }
    return attributes, keywords


def _private_jax_uses(name: str, tree: ast.Module, own: tuple[set[str], set[str]]) -> list[str]:
    """``path:line what`` for each private JAX name ``tree`` uses: an import from
    ``jax._src`` or of ``_mosaic_gpu_ext``, or an underscore attribute (``tile._pointwise``)
    or keyword (``FragmentedArray(_registers=...)``) that nothing in this repository
    defines, which makes it someone else's private name (JAX's, in practice)."""
    attributes, keywords = own
    found = []
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        if any(m.startswith("jax._src") or m.endswith("_mosaic_gpu_ext") for m in modules):
            found.append(f"{name}:{node.lineno} import {modules[0]}")
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr not in attributes and node.attr not in PUBLIC_UNDERSCORE:
                found.append(f"{name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if _private(kw.arg) and kw.arg not in keywords:
                    found.append(f"{name}:{node.lineno} {kw.arg}=")
    return found


def test_private_jax_names_are_fenced():
    """Every private JAX name (a module, an attribute, a keyword) is used in one module
    per package (``_compat.py``) or, for the tests, in tests/helpers.py: a jax upgrade is
    a one-file job."""
    trees = _tracked_sources()
    own = _own_private_names(trees)
    allowed = {"tests/helpers.py"}
    offenders = [
        use
        for name, tree in sorted(trees.items())
        if name not in allowed and Path(name).name != "_compat.py"
        for use in _private_jax_uses(name, tree, own)
    ]
    assert not offenders, f"private JAX names outside the _compat modules: {offenders}"


def test_private_jax_check_catches_attributes_and_keywords():
    code = (
        "from jax._src import core\n"
        "from jax.experimental.mosaic.gpu import fragmented_array as fa\n"
        "def f(tile, x, own):\n"
        "    y = tile._pointwise(tile._lift_fast_instr('ex2'))\n"
        "    z = fa.FragmentedArray(_registers=x, _layout=None, _is_signed=None)\n"
        "    return own._replace(a=1), own._cached, jax.Array.__init__, own._helper(_n=1)\n"
        "def _helper(_n):\n"
        "    pass\n"
    )
    tree = ast.parse(code)
    own = ({"_cached", "_helper"}, {"_n"})
    assert sorted(_private_jax_uses("m.py", tree, own)) == [
        "m.py:1 import jax._src",
        "m.py:4 ._lift_fast_instr",
        "m.py:4 ._pointwise",
        "m.py:5 _is_signed=",
        "m.py:5 _layout=",
        "m.py:5 _registers=",
    ]


def test_old_python_is_refused_by_name():
    """On a Python older than requires-python, building attn-common's metadata fails
    with a message naming requires-python (pip alone blamed jax): common/hatch_build.py,
    which holds the same minimum as every package's pyproject.toml."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hatch_build", ROOT / "common" / "hatch_build.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    need = ".".join(map(str, hook.REQUIRES_PYTHON))
    for pkg in ALL_PACKAGES:
        assert _project(pkg)["requires-python"] == f">={need}", pkg.name
    common = tomllib.loads((ROOT / "common" / "pyproject.toml").read_text())
    assert "custom" in common["tool"]["hatch"]["metadata"]["hooks"]
    problem = hook.python_problem((3, 11, 7))
    assert f"requires Python >= {need}" in problem and "requires-python" in problem
    assert "3.11.7" in problem and f"python{need} -m pip" in problem
    assert hook.python_problem((*hook.REQUIRES_PYTHON, 0)) is None
    assert hook.python_problem((4, 0, 0)) is None
