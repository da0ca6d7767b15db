"""What every ``attn`` command (and every backend's command) shares: argument types with
documented ranges, the output-path rules, and a report's provenance.

* ``OneLineParser``: the parser of ``attn`` and its commands; an argument error is one
  line (``attn run: error: --batch: got 0, expected ...``), exit status 2, no usage block.
* ``bounded_int(lo, hi)``: an argparse type; a value outside ``[lo, hi]`` (or not plain
  decimal digits) is refused with one line naming the range, so the command exits 2
  before it allocates. ``bounded_float(lo, hi)``: the same for a plain decimal number in
  ``[lo, hi)``. ``out_path``: a path argument that is not empty.
* ``check_out_dir`` (a results folder, ``--out``) and ``check_out_file`` (one file,
  ``--json``) follow one rule: a missing folder is created; a file that exists is never
  replaced without ``--overwrite``; an unwritable place is refused up front.
* ``provenance``: the commit of the git checkout in the working directory (else of the
  package's own source tree), ``+dirty`` with local changes, and the command line.
* ``wall_times``: the wall times of a jitted call, after a warm-up call (the
  benchmarks' and the examples' timer on any device).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from attn_common.dispatch import KNOWN_BACKENDS, installed_backends

MAX_SEED = 2**32 - 1
# Upper bounds of counts: far above any real use, low enough that a typo fails at once.
MAX_ITERATIONS = 10_000
MAX_BATCH = 1_000_000


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE (PROG
    --help)``, exit status 2: argparse's own errors print the usage block first, which for
    ``attn run`` is 5-9 lines above the one that matters. Subparsers are of this class
    too; ``commands()`` lists them by name."""

    def add_subparsers(self, **kwargs):
        self._attn_commands = super().add_subparsers(**kwargs)
        return self._attn_commands

    def commands(self) -> dict[str, argparse.ArgumentParser]:
        """The parser's subcommands: name -> parser (empty without any)."""
        action = getattr(self, "_attn_commands", None)
        return dict(action.choices) if action is not None else {}

    def error(self, message: str):
        # argparse says "argument --batch: got 0, ..."; our own checks say "--batch: ..."
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help)\n")


def bounded_int(lo: int, hi: int, what: str = "an int"):
    """argparse type: an int in ``[lo, hi]``, written in decimal digits (``1_0`` and
    `` 7`` are refused, though ``int()`` takes them); the message names the range;
    argparse adds the flag and exits 2."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"-?[0-9]+", text):
            shown = text if len(text) <= 24 else text[:21] + "..."
            raise argparse.ArgumentTypeError(f"got {shown!r}, expected {what} (decimal digits)")
        value = int(text)
        if not lo <= value <= hi:
            shown = text if len(text) <= 24 else text[:21] + "..."
            raise argparse.ArgumentTypeError(f"got {shown}, expected {lo} <= value <= {hi}")
        return value

    parse.__name__ = f"int in [{lo}, {hi}]"
    return parse


# A decimal number as a user types one: digits with an optional fraction and exponent.
# Python's float() also takes "0.0_1", " 0.5", "nan", "inf" and non-ASCII digits.
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def bounded_float(lo: float, hi: float, what: str = "a number"):
    """argparse type: a float in ``[lo, hi)``, written as a plain decimal number (``1.5``,
    ``.5``, ``1e-3``; ``0.0_1``, `` 0.5``, ``nan`` and ``inf`` are refused, though
    ``float()`` takes them); the message names the range; argparse adds the flag and
    exits 2."""

    def parse(text: str) -> float:
        shown = text if len(text) <= 24 else text[:21] + "..."
        if not _DECIMAL.fullmatch(text):
            raise argparse.ArgumentTypeError(f"got {shown!r}, expected {what} (a decimal number)")
        value = float(text)
        if not lo <= value < hi:
            raise argparse.ArgumentTypeError(f"got {shown}, expected {lo:g} <= value < {hi:g}")
        return value

    parse.__name__ = f"float in [{lo:g}, {hi:g})"
    return parse


def out_path(text: str) -> Path:
    """argparse type: a path that is not empty (``Path("")`` would be the working
    directory, and the error would name ``'.'``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a path")
    return Path(text)


positive_int = bounded_int(1, MAX_BATCH, "a positive int")
iterations_int = bounded_int(1, MAX_ITERATIONS, "a positive int")
seed_int = bounded_int(0, MAX_SEED, "an int")


def implementation_choices() -> list[str]:
    """Names ``--implementation`` accepts: the known backends and any installed one."""
    return sorted(set(KNOWN_BACKENDS) | set(installed_backends()))


def default_out_dir(base: Path | None = None) -> Path:
    """A new folder ``attn-results/<timestamp>`` under ``base`` (default: the cwd)."""
    root = (base or Path.cwd()) / "attn-results"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out, n = root / stamp, 1
    while out.exists():
        n += 1
        out = root / f"{stamp}-{n}"
    return out


def _writable(folder: Path, flag: str, given: Path | None = None) -> str | None:
    """Create ``folder`` (with its parents) and probe it; the error, or None. ``given``:
    the argument's value, when the folder is its parent."""
    given = folder if given is None else given
    for above in (folder, *folder.parents):  # the nearest that exists must be a folder
        if above.exists():
            if not above.is_dir():
                return (
                    f"{flag}: got {str(given)!r}, but {str(above)!r} is a file, not a "
                    "folder; expected a path under folders"
                )
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".attn-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        where = "which" if given == folder else f"whose folder {str(folder)!r}"
        return f"{flag}: got {str(given)!r}, {where} is not writable ({e.strerror or e})"
    return None


def check_out_dir(
    out: Path, *, overwrite: bool = False, result_files: tuple[str, ...], flag: str = "--out"
) -> str | None:
    """Why ``out`` cannot take the results (None when it can); creates the folder.

    ``result_files``: the report names a run writes; any of them already in ``out`` is
    refused unless ``overwrite``.
    """
    if out.exists() and not out.is_dir():
        return f"{flag}: got {str(out)!r}, which is a file; expected a folder"
    existing = [name for name in result_files if (out / name).exists()]
    if existing and not overwrite:
        return (
            f"{flag}: got {str(out)!r}, which already holds {', '.join(existing)}; "
            "pass --overwrite to replace them, or leave --out out for a new folder"
        )
    return _writable(out, flag)


def check_out_file(path: Path, *, overwrite: bool = False, flag: str = "--json") -> str | None:
    """Why ``path`` cannot take a report file (None when it can); creates its folder, as
    ``check_out_dir`` does for ``--out``."""
    if path.is_dir():
        return f"{flag}: got {str(path)!r}, which is a folder; expected a file path"
    if path.exists() and not overwrite:
        return f"{flag}: got {str(path)!r}, which exists; pass --overwrite to replace it"
    return _writable(path.parent, flag, path)


def _git_commit(where: Path) -> str | None:
    """``HEAD`` of the checkout holding ``where`` (``+dirty`` with changes), or None."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        commit = head.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if dirty.returncode == 0 and dirty.stdout.strip():
            commit += "+dirty"
        return commit
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(argv: list[str] | None = None) -> dict:
    """The commit and the command of a report.

    The commit: ``$ATTN_PROVENANCE_COMMIT`` when set (a copy of a checkout without its
    git metadata), else the git checkout of the working directory, else the one holding
    this package's source (an editable install), else ``unknown (not a git checkout)``.
    """
    commit = os.environ.get("ATTN_PROVENANCE_COMMIT") or None
    for where in () if commit else (Path.cwd(), Path(__file__).resolve().parent):
        commit = _git_commit(where)
        if commit:
            break
    argv = sys.argv[1:] if argv is None else argv
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "attn"
    if prog in ("cli.py", "__main__.py", "-c", "") or prog.startswith("pytest"):
        prog = "attn"
    return {
        "commit": commit or "unknown (not a git checkout)",
        "command": shlex.join([prog, *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


_T0 = time.perf_counter()


def progress(message: str) -> None:
    """A progress line on stderr, with the seconds since the command started."""
    print(f"  [{time.perf_counter() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def wall_times(fn, *args, repeats: int, warmup: bool = True) -> list[float]:
    """Wall times (seconds) of ``repeats`` calls of ``fn(*args)``, each waited for
    (``jax.block_until_ready``), after one untimed call that compiles and warms up (none
    with ``warmup=False``)."""
    import jax

    if warmup:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def available_memory(device=None) -> tuple[int, str] | None:
    """``(bytes, what)`` a new array may take on ``device`` (default: the first one), or
    None when it cannot be told.

    A GPU/TPU: its ``memory_stats()`` limit less what is in use. The CPU: the host's
    available memory (``MemAvailable`` of /proc/meminfo, else ``sysconf``).
    """
    import jax

    dev = device if device is not None else jax.devices()[0]
    if dev.platform != "cpu":
        try:
            stats = dev.memory_stats() or {}
        except Exception:  # a platform without memory stats
            stats = {}
        if "bytes_limit" in stats:
            free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
            return free, f"free on the {dev.device_kind}"
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available host memory"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
