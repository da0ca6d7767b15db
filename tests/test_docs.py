"""Every ```python block in README.md and docs/*.md runs verbatim on the CPU.

Each block runs alone in a fresh interpreter (``sys.executable -c``) with
``JAX_PLATFORMS=cpu``, so a block must define its own inputs. A block whose first line
is ``# devices: N`` gets ``XLA_FLAGS=--xla_force_host_platform_device_count=N``. Shell
blocks (```sh) and untagged blocks are not run. New docs are covered automatically.

A block that imports an optional package (a backend other than the reference the
install may lack, or an example's extra: ``OPTIONAL``) that is not installed is skipped,
the reason naming the package and how to install it; any other import that fails is a
failure (a typo must not turn into a skip).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
DEVICES = re.compile(r"#\s*devices:\s*(\d+)\s*$")
# Import name -> how to install it. attn_common is never optional: every install has it.
OPTIONAL = {
    "attn_reference": "pip install ./packages/attn-reference",
    "attn_mosaic_gpu": "pip install ./packages/attn-mosaic-gpu",
    "attn_pallas_tpu": "pip install ./packages/attn-pallas-tpu",
    "optax": "pip install optax",
    "flax": "pip install flax",
    "matplotlib": "pip install matplotlib",
}


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of each ```python block; ``line`` is the opening fence's (1-based)."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.groups()
        end = i + 1
        while end < len(lines):
            close = FENCE.match(lines[end])
            if close and close.group(2).startswith(fence) and not close.group(3).strip():
                break
            end += 1
        if info.strip().split(" ")[0].lower() in ("python", "py", "python3"):
            body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
            blocks.append((i + 1, "\n".join(body) + "\n"))
        i = end + 1
    return blocks


BLOCKS = [(path, line, code) for path in DOC_FILES for line, code in python_blocks(path)]


def imported_modules(code: str) -> list[str]:
    """Top-level names of every module ``code`` imports (anywhere in it), in order."""
    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return list(dict.fromkeys(names))


def missing_optional(code: str, find_spec=importlib.util.find_spec) -> str | None:
    """The skip reason for a block that imports an optional package not installed, else
    ``None``."""
    for name in imported_modules(code):
        if name in OPTIONAL and find_spec(name) is None:
            return f"needs {name}, which is not installed ({OPTIONAL[name]})"
    return None


def _id(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_blocks_found():
    """The guide has runnable examples, so an extraction bug cannot pass silently."""
    assert any(path.name == "guide.md" for path, _, _ in BLOCKS), "no python block found"


def test_missing_optional_names_the_package():
    code = "import jax\nfrom attn_pallas_tpu import TpuFp8LatentCache\nimport optax.tree\n"
    assert imported_modules(code) == ["jax", "attn_pallas_tpu", "optax"]
    present = {"jax", "attn_pallas_tpu", "optax"}

    def finder(absent):
        return lambda name: None if name in absent or name not in present else object()

    assert missing_optional(code, finder(set())) is None
    reason = missing_optional(code, finder({"attn_pallas_tpu"}))
    assert reason == (
        "needs attn_pallas_tpu, which is not installed (pip install ./packages/attn-pallas-tpu)"
    )
    assert missing_optional(code, finder({"optax"})).startswith("needs optax,")
    # a module outside OPTIONAL that is missing is not a skip: the block runs and fails
    assert missing_optional("import attn_comon\n", finder({"attn_comon"})) is None
    assert missing_optional("from . import x\n", finder(set())) is None


def test_extraction(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("x\n```python\na = 1\n```\n```sh\nls\n```\n  ```python\n  b = 2\n  ```\n")
    assert python_blocks(doc) == [(2, "a = 1\n"), (8, "b = 2\n")]


@pytest.mark.parametrize(
    ("path", "line", "code"), BLOCKS, ids=[_id(path, line) for path, line, _ in BLOCKS]
)
def test_doc_block_runs(path: Path, line: int, code: str, tmp_path):
    reason = missing_optional(code)
    if reason:
        pytest.skip(f"{_id(path, line)} {reason}")
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    devices = DEVICES.match(first)
    if devices:
        flag = f"--xla_force_host_platform_device_count={devices.group(1)}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,  # run where a user would: only the installed packages (and PYTHONPATH)
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"the ```python block at {_id(path, line)} failed (exit {proc.returncode}):\n"
        f"{proc.stderr[-4000:]}"
    )


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, - for spaces."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_design_citations_resolve():
    """Every ``design.md#anchor`` and ``docs/design.md, "Section"`` cited in the repository
    names a heading of docs/design.md."""
    headings = [
        line.lstrip("#").strip()
        for line in (ROOT / "docs" / "design.md").read_text().splitlines()
        if line.startswith("#")
    ]
    anchors = {_anchor(h) for h in headings}
    titles = {h.lower() for h in headings}
    skip = {".git", ".nox", ".venv", "venv", "build", "dist", "node_modules", "__pycache__"}
    bad = []
    for path in ROOT.rglob("*"):
        if path.suffix not in (".py", ".md", ".toml", ".sh") or skip & set(path.parts):
            continue
        if path == Path(__file__).resolve():  # this docstring's placeholders
            continue
        text = path.read_text(errors="replace")
        for m in re.finditer(r"design\.md#([\w-]+)", text):
            if m.group(1) not in anchors:
                bad.append(f"{path.relative_to(ROOT)}: #{m.group(1)}")
        for m in re.finditer(r"design\.md,\s+[\"']([^\"']+)[\"']", text):
            if m.group(1).lower() not in titles:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(1)!r}")
    assert not bad, "citations of docs/design.md with no such section:\n" + "\n".join(bad)


def _named_results(readme: str) -> set[str]:
    """File names the results README names: `x.json` in full, and `.md` / `.log` after
    a full name in the same table cell or line (`ranker_gpu.json`, `.md`, `.png`)."""
    named = set()
    for line in readme.splitlines():
        stem = None
        for token in re.findall(r"`([^`\s]+)`", line):
            if "/" in token:
                continue
            if token.startswith(".") and stem:
                named.add(stem + token)
            elif re.fullmatch(r"[\w-]+\.\w+", token):
                stem = token.rsplit(".", 1)[0]
                named.add(token)
    return named


def test_results_readme_names_every_file():
    """docs/results/ holds the current results only, each named in its README (a file
    nobody lists is a leftover of a superseded run)."""
    results = ROOT / "docs" / "results"
    named = _named_results((results / "README.md").read_text())
    files = {p.name for p in results.iterdir() if p.is_file()} - {"README.md"}
    assert len(files) > 20
    assert files <= named, f"not named in docs/results/README.md: {sorted(files - named)}"
    assert _named_results("| x | `a.json`, `.md` | `b/c.log` |") == {"a.json", "a.md"}


def test_relative_doc_links_resolve():
    """Every relative link in README.md and docs/ names a file that exists."""
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            target = target.split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):
                continue
            if not (path.parent / target).exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}")
    assert not bad, "links to missing files:\n" + "\n".join(bad)
