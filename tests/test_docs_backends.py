"""What README.md and docs/guide.md say about which backend runs which op, checked against
what ``attn info`` reports: the dispatch module's op table (``attn_common.dispatch``:
``OPS``, ``KNOWN_BACKENDS``, ``PREFERENCE``) and the ops each backend module exports.

Each backend table (a markdown table whose first header cell is ``backend``) is parsed
row by row: the backend named in the first cell, its device (a ``device`` column or the
first cell's parentheses), and per op column either "not yet" (the backend must export
none of the column's ops) or a claim that it runs them (it must export every one; an
"all N" must count them). The guide's Dispatch preference sentence is checked against
``PREFERENCE``. A backend installed here is asked as ``attn info`` asks it (its module's
attributes); one that is not is read from its package's ``__all__`` in this checkout.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from attn_common import dispatch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md"]
RANKER_OPS = ("ranker_attention",)
SPARSE_OPS = tuple(op for op in dispatch.OPS if op not in RANKER_OPS)
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}
DEVICE_WORDS = {"hopper": ("hopper",), "tpu": ("tpu",)}


def backend_ops(name: str, *, static: bool = False) -> set[str]:
    """The ops backend ``name`` exports, as ``attn info`` lists them (``static``: read
    from the checkout's ``__all__`` even when the backend is installed)."""
    if not static and name in dispatch.installed_backends():
        module = dispatch.load_backend(name)
        return {op for op in dispatch.OPS if hasattr(module, op)}
    info = dispatch.KNOWN_BACKENDS[name]
    init = ROOT / "packages" / info["dist"] / "src" / info["module"] / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        targets = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        if isinstance(node, ast.AnnAssign):
            targets = [getattr(node.target, "id", None)]
        if "__all__" in targets:
            return set(ast.literal_eval(node.value)) & set(dispatch.OPS)
    raise AssertionError(f"{init}: no __all__ to read backend {name!r}'s ops from")


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def backend_tables(path: Path) -> list[tuple[int, list[str], list[list[str]]]]:
    """``(line, header, rows)`` of every table in ``path`` whose first header is backend."""
    lines = path.read_text().splitlines()
    tables = []
    for i, line in enumerate(lines):
        if not line.startswith("|") or cells(line)[0].lower() != "backend":
            continue
        rows = []
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            rows.append(cells(row))
        tables.append((i + 1, [c.lower() for c in cells(line)], rows))
    return tables


def backend_of(cell: str) -> str:
    names = [n for n in dispatch.KNOWN_BACKENDS if re.search(rf"`(attn-)?{n}`", cell)]
    assert len(names) == 1, f"first cell {cell!r}: expected one backend name, got {names}"
    return names[0]


def count_of(word: str) -> int:
    return int(word) if word.isdigit() else NUMBERS[word.lower()]


TABLES = [(path, *table) for path in DOCS for table in backend_tables(path)]


def test_tables_found():
    """README and the guide each have a backend table (the parser did not miss one)."""
    assert {path.name for path, *_ in TABLES} == {"README.md", "guide.md"}


@pytest.mark.parametrize(
    ("path", "line", "header", "rows"),
    TABLES,
    ids=[f"{path.name}:{line}" for path, line, *_ in TABLES],
)
def test_backend_table_matches_attn_info(path, line, header, rows):
    where = f"{path.relative_to(ROOT)}:{line}"
    columns = {}
    for i, title in enumerate(header):
        if "ranker" in title:
            columns[i] = RANKER_OPS
        elif "sparse" in title:
            columns[i] = SPARSE_OPS
            counted = re.search(r"\((\w+) functions\)", title)
            if counted:
                assert count_of(counted.group(1)) == len(SPARSE_OPS), (
                    f"{where}: header {title!r} counts {counted.group(1)} functions; "
                    f"attn info lists {len(SPARSE_OPS)}: {SPARSE_OPS}"
                )
    assert set(columns.values()) == {RANKER_OPS, SPARSE_OPS}, f"{where}: op columns {header}"
    named = [backend_of(row[0]) for row in rows]
    assert sorted(named) == sorted(dispatch.KNOWN_BACKENDS), (
        f"{where}: rows name {named}; the dispatch knows {sorted(dispatch.KNOWN_BACKENDS)}"
    )
    for row, name in zip(rows, named, strict=True):
        ops = backend_ops(name)
        device_cell = row[header.index("device")] if "device" in header else row[0]
        words = [w for w in DEVICE_WORDS if re.search(rf"\b{w}\b", device_cell.lower())]
        anywhere = re.search(r"\bany\b", device_cell.lower()) is not None
        assert anywhere or len(words) == 1, f"{where}: no device in {device_cell!r}"
        claimed = None if anywhere else DEVICE_WORDS[words[0]]
        assert claimed == dispatch.supported_devices(name), (
            f"{where}: {name} on {device_cell!r}; attn info: "
            f"{dispatch.supported_devices(name) or 'any'}"
        )
        for i, column_ops in columns.items():
            cell = row[i]
            if re.match(r"(not yet|none|-|—)\b", cell.lower()) or not cell:
                lacking = sorted(set(column_ops) & ops)
                assert not lacking, f"{where}: {name} says {cell!r} but exports {lacking}"
                continue
            missing = sorted(set(column_ops) - ops)
            assert not missing, f"{where}: {name} claims {cell[:60]!r} but lacks {missing}"
            for m in re.finditer(r"\ball (\w+)\b", cell):
                if m.group(1).lower() in NUMBERS or m.group(1).isdigit():
                    assert count_of(m.group(1)) == len(column_ops), (
                        f"{where}: {name} {m.group(0)!r}; the column holds {column_ops}"
                    )


def test_guide_dispatch_preference():
    """The guide's "Preference: Hopper -> `a`, then `b`; ...; anything else -> `c`" is
    the dispatch's preference order, and every op it names dispatches as it says."""
    text = (ROOT / "docs" / "guide.md").read_text()
    sentence = re.search(r"Preference:(.*?)\.(\s|$)", text, re.S)
    assert sentence, "docs/guide.md: no 'Preference:' sentence in the Dispatch section"
    claimed = {}
    for part in sentence.group(1).split(";"):
        device, _, order = part.partition("->")
        key = device.strip().lower()
        claimed[key] = tuple(re.findall(r"`([\w-]+)`", order))
    expected = {k.lower(): v for k, v in dispatch.PREFERENCE.items()}
    expected["anything else"] = dispatch.DEFAULT_PREFERENCE
    assert claimed == expected


def test_op_count_words():
    """Every "all N ops" / "N functions" of the docs counts what attn info lists."""
    for path in DOCS:
        for m in re.finditer(r"\ball (\w+) (ops|functions)\b", path.read_text()):
            if m.group(1).lower() in NUMBERS or m.group(1).isdigit():
                assert count_of(m.group(1)) == len(dispatch.OPS), (
                    f"{path.name}: {m.group(0)!r}; attn info lists {len(dispatch.OPS)} ops"
                )


def test_shipped_backends_export_every_op():
    """The premise of the docs' "nothing falls through by op": each shipped backend
    exports all the ops (fallback happens only for inputs a backend's supports refuses)."""
    for name in dispatch.KNOWN_BACKENDS:
        assert backend_ops(name) == set(dispatch.OPS), name


def test_static_op_reading_matches_import():
    """For a backend not installed the ops are read from its ``__all__``: that reading
    agrees with ``attn info``'s for every backend installed here."""
    installed = dispatch.installed_backends()
    assert installed, "no backend installed"
    for name in installed:
        if name in dispatch.KNOWN_BACKENDS:
            assert backend_ops(name, static=True) == backend_ops(name), name


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize(
    "path",
    [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "docs/results/README.md"],
)
def test_relative_links_resolve(path):
    """Every relative link of the docs names a file that exists (results pruned to the
    current set must not leave links behind)."""
    bad = []
    for m in LINK.finditer(path.read_text()):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        if not (path.parent / target).exists():
            bad.append(target)
    assert not bad, f"{path.relative_to(ROOT)}: links to missing files {bad}"
