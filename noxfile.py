"""nox sessions: tests per backend, lint, aot (cross-compiles every GPU kernel), bench and report.

Sessions install fusekit with pip, so the machine's pip configuration applies. On CPU machines the
pinned CPU build of torch (TORCH_SPEC, default torch==2.13.0) is installed first so that no later
install pulls the multi-GB CUDA build; set TORCH_SPEC="" to keep whatever torch pip would choose.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["lint", "aot", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
EXTRAS = {"torch": "test,bench", "triton": "test,triton", "mojo": "test,mojo"}
# Which test files each backend session runs: the cross-backend files, plus tests/test_<backend>_*.py.
# The torch session also runs every backend-independent file (everything not named for a backend).
# every backend's session runs these (the torch session runs all of tests/)
SHARED_TESTS = [
    "tests/test_conformance.py",
    "tests/test_hostile_inputs.py",
    "tests/test_fuzz.py",
    "tests/test_layouts.py",
    "tests/test_cuda_graphs.py",
    "tests/test_compile_graphs.py",
    "tests/test_amp.py",
    "tests/test_linear_cross_entropy.py",
    "tests/test_grad_runner.py",
    "tests/test_rope_positions.py",
    "tests/test_bench_model.py",
    "tests/test_any_device.py",
    "tests/test_concurrency.py",
    "tests/test_large_index.py",
    "tests/test_hf_backends.py",
]


def _backend_files(backend: str) -> list[str]:
    return sorted(str(p) for p in Path("tests").glob(f"test_{backend}_*.py"))


def _install(session: nox.Session, extras: str) -> None:
    if TORCH_SPEC:
        session.install(TORCH_SPEC)
    session.install(f".[{extras}]")


@nox.session
@nox.parametrize("backend", list(EXTRAS))
def tests(session: nox.Session, backend: str) -> None:
    """Conformance suite (+ backend-specific tests) on the CPU; pass `-- --device cuda` on a GPU host."""
    _install(session, EXTRAS[backend])
    if backend == "torch":
        files = ["tests"] + [f"--ignore={f}" for b in ("triton", "mojo") for f in _backend_files(b)]
    else:
        files = SHARED_TESTS + _backend_files(backend)
    session.run("python", "-m", "pytest", *files, "--backends", backend, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def aot(session: nox.Session) -> None:
    """Compile every Triton and Mojo GPU kernel for sm_90 and gfx942 on a machine without a GPU."""
    _install(session, "triton,mojo")
    session.run("python", "-m", "fusekit.aot_triton", *session.posargs)
    session.run("python", "-m", "fusekit.aot_mojo", *session.posargs)


@nox.session
def mojo_build(session: nox.Session) -> None:
    """Compile every Mojo op phase ahead of time into fusekit's cache (later first calls are cache loads);
    `-- --device cuda` on a GPU host, `-- --list` to see the entries."""
    _install(session, "mojo")
    session.run("python", "-m", "fusekit.mojo_build", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark every installed backend against the baselines (small sizes on a CPU-only machine)."""
    _install(session, "test,triton,mojo,bench")
    session.run("python", "-m", "fusekit.bench", *(session.posargs or ["--quick"]))


@nox.session
def report(session: nox.Session) -> None:
    """Render benchmarks/report/ (markdown + PNG plots) from the committed results; needs no GPU."""
    _install(session, "bench")
    session.run("python", "-m", "fusekit.report", *session.posargs)


@nox.session(python=False)
def sanitize(session: nox.Session) -> None:
    """compute-sanitizer memcheck, racecheck and synccheck over every kernel (a GPU host; runs in the current
    environment, since the device machine cannot install): see tests/sanitize_gpu.sh."""
    session.run("bash", "tests/sanitize_gpu.sh", *session.posargs, external=True)
