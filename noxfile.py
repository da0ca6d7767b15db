"""Nox sessions for the attention-kernels monorepo.

    nox -s lint tests-cpu   # what CI runs (.ci/run); every developer, CPU only
    nox -s tests-cpu-full   # every test and hypothesis example (tests-cpu: -m "not slow")
    nox -s demo             # the main job: `attn run ranker` / `attn run sparse-mla` on CPU
    nox -s build            # the four wheels, each installed alone in a fresh venv
    nox -s tests-cuda13     # on a Hopper GPU machine (JAX with the CUDA 13 plugin)
    nox -s tests-tpu        # on a TPU VM

Every session pins JAX to the same release so that what CI tests is what runs on the
accelerators. Arguments after ``--`` go to pytest (tests-*) or to the demo.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests-cpu"]

PYTHON = "3.12"
JAX_VERSION = "0.11.2"
RUFF_VERSION = "0.17.6"
# optax: the examples' extra (examples/*/), which tests/test_examples.py runs; it is in no
# wheel's dependencies. Without it those tests skip, saying so.
TEST_DEPS = (
    "pytest>=8",
    "hypothesis>=6.100",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",
    "optax>=0.2.8",
)
# pytest-xdist workers on the CPU sessions: the interpret-mode tests are single-threaded
# Python for most of their time, so two workers keep both cores of a CI machine busy.
CPU_WORKERS = "2"

ROOT = Path(__file__).resolve().parent


def _select_pyenv_python(version: str) -> None:
    """Let nox find ``python<version>`` when pyenv has it installed but not selected.

    On machines where the default Python is older and 3.12 lives under pyenv, the
    ``python3.12`` shim fails until PYENV_VERSION names a 3.12; nox (itself maybe running
    on the older Python) then reports the interpreter as missing. Add the newest installed
    3.12.x to the selection for nox and its children. Does nothing if python3.12 works.
    """
    exe = shutil.which(f"python{version}")
    if exe and subprocess.run([exe, "-c", ""], capture_output=True).returncode == 0:
        return
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return
    listed = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True)
    found = [v for v in listed.stdout.split() if re.fullmatch(rf"{re.escape(version)}\.\d+", v)]
    if not found:
        return
    newest = max(found, key=lambda v: tuple(map(int, v.split("."))))
    current = subprocess.run([pyenv, "version-name"], capture_output=True, text=True)
    selected = current.stdout.strip() if current.returncode == 0 else ""
    os.environ["PYENV_VERSION"] = f"{selected}:{newest}" if selected else newest


_select_pyenv_python(PYTHON)

# Package directory -> import name.
COMMON = "common"
REFERENCE = "packages/attn-reference"
MOSAIC_GPU = "packages/attn-mosaic-gpu"
PALLAS_TPU = "packages/attn-pallas-tpu"
IMPORT_NAMES = {
    COMMON: "attn_common",
    REFERENCE: "attn_reference",
    MOSAIC_GPU: "attn_mosaic_gpu",
    PALLAS_TPU: "attn_pallas_tpu",
}
CONFORMANCE_TESTS = "tests"

# Per accelerator: the JAX build, the JAX_PLATFORMS value (an accelerator that fails to
# initialise is an error, never a silent fall back to CPU) and the packages it installs
# and tests. Each session installs only what it tests.
PLATFORMS = {
    "cpu": {
        "jax": f"jax=={JAX_VERSION}",
        "jax_platforms": "cpu",
        "packages": (COMMON, REFERENCE, MOSAIC_GPU, PALLAS_TPU),
    },
    "cuda13": {
        "jax": f"jax[cuda13]=={JAX_VERSION}",
        "jax_platforms": "cuda,cpu",
        "packages": (COMMON, REFERENCE, MOSAIC_GPU),
    },
    # jax[tpu]==0.11.2 requires libtpu==0.0.48.*; libtpu 0.0.48.1 (cp312, manylinux_2_31
    # x86_64) is on PyPI, so no extra find-links index is needed.
    "tpu": {
        "jax": f"jax[tpu]=={JAX_VERSION}",
        "jax_platforms": "tpu,cpu",
        "packages": (COMMON, REFERENCE, PALLAS_TPU),
    },
}


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff lint and format check over the whole repository."""
    session.install(f"ruff=={RUFF_VERSION}")
    failed = []
    # Run both checks even when the first fails, so one run reports every problem.
    for check in (["check", "."], ["format", "--check", "."]):
        try:
            session.run("ruff", *check)
        except nox.command.CommandFailed:
            failed.append("ruff " + " ".join(check))
    if failed:
        session.error("failed: " + "; ".join(failed))


def _tests(session: nox.Session, platform: str, options: tuple[str, ...] = ()) -> None:
    """pytest over the platform's packages and the conformance tests. ``options`` come
    first, so arguments after ``--`` (which replace the default test paths) can override
    them: ``nox -s tests-cpu -- -m slow tests`` runs only the slow conformance tests."""
    spec = PLATFORMS[platform]
    editables = [arg for pkg in spec["packages"] for arg in ("-e", pkg)]
    # One resolver run, so that attn-common is satisfied by the local checkout. No
    # byte-compiling of every installed file (jax, scipy): a run imports a fraction of them
    # and compiles those as it goes (18 s less install on a 2-core machine).
    session.install("--no-compile", spec["jax"], *editables, *TEST_DEPS)
    paths = [f"{pkg}/tests" for pkg in spec["packages"]] + [CONFORMANCE_TESTS]
    # pytest exits 5 when it collects nothing; nox's default success code is 0 only, so
    # an empty run fails the session instead of passing silently.
    session.run(
        "pytest",
        *options,
        *(session.posargs or paths),
        env={"JAX_PLATFORMS": spec["jax_platforms"]},
        success_codes=[0],
    )


# One session per platform, named tests-cpu, tests-cuda13, tests-tpu (`nox -t tests` selects
# all three). Named sessions rather than @nox.parametrize: parametrize ids give the names
# "tests(cpu)" etc., not the names the README and CI use.
@nox.session(python=PYTHON, name="tests-cpu", tags=["tests"])
def tests_cpu(session: nox.Session) -> None:
    """CPU, what CI runs: every package and the conformance tests, every shipped kernel in
    interpret mode at small shapes; the tests marked ``slow`` are left to tests-cpu-full,
    and ``-m "not slow"`` runs the property tests at a quarter of their hypothesis
    examples (the root conftest.py)."""
    # --durations: every CI log lists the slowest tests, against the 10-minute budget.
    _tests(
        session,
        "cpu",
        ("-n", CPU_WORKERS, "--dist", "worksteal", "-m", "not slow", "--durations=25"),
    )


@nox.session(python=PYTHON, name="tests-cpu-full")
def tests_cpu_full(session: nox.Session) -> None:
    """CPU, every test: tests-cpu plus the ``slow`` ones (larger interpret shapes, the
    schedule variants, more hypothesis examples)."""
    _tests(session, "cpu", ("-n", CPU_WORKERS, "--dist", "worksteal"))


@nox.session(python=PYTHON, name="tests-cuda13", tags=["tests"])
def tests_cuda13(session: nox.Session) -> None:
    """Hopper GPU: common, reference, mosaic-gpu and the conformance tests."""
    _tests(session, "cuda13")


@nox.session(python=PYTHON, name="tests-tpu", tags=["tests"])
def tests_tpu(session: nox.Session) -> None:
    """TPU: common, reference, pallas-tpu and the conformance tests."""
    _tests(session, "tpu")


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Build the four wheels into dist/ and install each one alone in a fresh venv."""
    session.install("build")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    wheels: dict[str, Path] = {}
    for pkg, import_name in IMPORT_NAMES.items():
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist), pkg)
        (wheels[pkg],) = dist.glob(f"{import_name}-*.whl")

    tmp = Path(session.create_tmp())
    check = tmp / "check_import.py"
    check.write_text(_IMPORT_CHECK)
    # jax and its dependencies, unpacked once into a folder that each fresh venv puts on
    # its path (a .pth file): pip, resolving a wheel's requirements inside that venv,
    # finds them installed and adds only the attn wheels (and anything else a wheel
    # declares, from the index). No byte-compiling: the check imports one package.
    deps = (tmp / "jax-deps").resolve()  # a .pth line is read relative to its folder
    shutil.rmtree(deps, ignore_errors=True)
    pip = ("python", "-m", "pip")
    session.run(*pip, "install", "--quiet", "--no-compile", "--target", str(deps),
                f"jax=={JAX_VERSION}")  # fmt: skip
    failed = []
    for pkg, import_name in IMPORT_NAMES.items():
        # The wheel plus attn-common (and jax): nothing else from this repo.
        to_install = [wheels[COMMON]] if pkg == COMMON else [wheels[COMMON], wheels[pkg]]
        venv = tmp / f"venv-{import_name}"
        python = str(venv / "bin" / "python")
        # A venv without pip, filled by the session's pip (--python).
        session.run("python", "-m", "venv", "--clear", "--without-pip", str(venv))
        (site,) = venv.glob("lib/python*/site-packages")
        (site / "jax_deps.pth").write_text(f"{deps}\n")
        session.run(*pip, "--python", python, "install", "--quiet", "--no-compile",
                    f"jax=={JAX_VERSION}", *map(str, to_install))  # fmt: skip
        expected = ",".join(sorted(_dist_name(wheel) for wheel in to_install))
        try:
            # -I: no working directory or PYTHON* variables on the path, so the import can
            # only come from the fresh venv.
            session.run(
                *(python, "-I", str(check), import_name, _dist_name(wheels[pkg]), expected),
                external=True,
            )
        except nox.command.CommandFailed:
            failed.append(import_name)
    session.log("wheels: " + ", ".join(w.name for w in wheels.values()))
    if failed:
        session.error("installed alone, these did not import cleanly: " + ", ".join(failed))


def _dist_name(wheel: Path) -> str:
    return wheel.name.split("-")[0].replace("_", "-")


# Runs inside each fresh venv. argv: import name, distribution name, the attn-*
# distributions expected to be installed (comma separated).
_IMPORT_CHECK = """\
import importlib
import importlib.metadata as md
import sys

name, dist, expected = sys.argv[1], sys.argv[2], sorted(sys.argv[3].split(","))
mod = importlib.import_module(name)
assert mod.__file__, f"{name} imported as a namespace package: the wheel has no __init__.py"
assert mod.__file__.startswith(sys.prefix), f"{name} imported from {mod.__file__}"
assert mod.__version__ == md.version(dist), (mod.__version__, md.version(dist))
found = sorted(
    d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("attn-")
)
assert found == expected, f"attn distributions installed: {found}, expected {expected}"
print(f"{name} {mod.__version__}: imports alone; attn distributions installed: {found}")
"""


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: `attn run ranker` and `attn run sparse-mla` on the CPU default.

    Installs attn-common (the `attn` command) and the reference backend from this
    checkout. Arguments after ``--`` go to both `attn run` calls (e.g. ``-- --small``).
    """
    session.install(f"jax=={JAX_VERSION}", f"./{COMMON}", f"./{REFERENCE}")
    env = {"JAX_PLATFORMS": "cpu"}
    session.run("attn", "info", env=env)
    for op in ("ranker", "sparse-mla"):
        session.run("attn", "run", op, *session.posargs, env=env)


@nox.session(python=PYTHON, name="bench-gpu")
def bench_gpu(session: nox.Session) -> None:
    """Hopper GPU: the ranker benchmark suite against cuDNN/XLA/FA3 (docs/design.md).

    Writes into a new folder attn-results/<timestamp>; ``-- --out docs/results
    --overwrite`` replaces the committed results (commit them with the run's log).
    """
    session.install(f"jax[cuda13]=={JAX_VERSION}", f"./{COMMON}", f"./{MOSAIC_GPU}", "matplotlib")
    session.run("python", "benchmarks/ranker_gpu.py", *session.posargs)


@nox.session(python=PYTHON, name="measure-tpu")
def measure_tpu(session: nox.Session) -> None:
    """No TPU needed: the TPU ranker's cost model tables (docs/tpu_ranker.md)."""
    session.install(f"jax=={JAX_VERSION}", f"./{COMMON}")
    session.run(
        "python",
        f"{PALLAS_TPU}/scripts/ranker_cost.py",
        *(session.posargs or ["--write-docs"]),
        env={"JAX_PLATFORMS": "cpu"},
    )
