"""Selects backends and device for the whole suite.

    pytest --backends torch,triton --device cpu      (or FUSEKIT_TEST_BACKENDS / FUSEKIT_TEST_DEVICE)

Installed backends always run; a backend that is not installed is skipped with the reason printed
(`-ra` is on). On the CPU, Triton runs in its interpreter: TRITON_INTERPRET=1 is set here, before any
test imports triton, and the interpreter's bf16 rounding and bf16 tl.dot are corrected to compute what
compiled kernels do (kernels_triton/_interpreter.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

# The repo root (kernels_triton) and python/ (fusekit) for runs from a checkout; appended, so an installed
# fusekit (nox's, the only one carrying fusekit._mojo) still comes first.
_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "python")):
    if _p not in sys.path:
        sys.path.append(_p)

ALL_BACKENDS = ("torch", "triton", "mojo")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backends",
        default=os.environ.get("FUSEKIT_TEST_BACKENDS", ",".join(ALL_BACKENDS)),
        help="comma-separated backends to test (default: all)",
    )
    parser.addoption(
        "--device",
        default=os.environ.get("FUSEKIT_TEST_DEVICE", "cpu"),
        choices=("cpu", "cuda"),
        help="device to run the conformance suite on",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Under TRITON_INTERPRET importing the package corrects the interpreter, before any test runs (a missing
    # triton is handled inside; ImportError: kernels_triton is not importable here).
    with contextlib.suppress(ImportError):
        import kernels_triton  # noqa: F401


def selected_backends(config: pytest.Config) -> list[str]:
    names = [b.strip() for b in config.getoption("--backends").split(",") if b.strip()]
    unknown = set(names) - set(ALL_BACKENDS)
    if unknown:
        raise pytest.UsageError(f"--backends: unknown {sorted(unknown)}; valid: {', '.join(ALL_BACKENDS)}")
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", selected_backends(metafunc.config), scope="session")


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Under pytest-xdist on a GPU (`-n 4 --device cuda`: kernels compile in parallel) every worker shares one
    GPU, and torch's caching allocator kept each worker's largest test's memory: workers holding 38 and 24 GiB
    left the others out of memory (121 of 901 triton tests on an H100). Each worker gives it back per test."""
    if os.environ.get("PYTEST_XDIST_WORKER") and item.config.getoption("--device") == "cuda":
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> str:
    dev = pytestconfig.getoption("--device")
    if dev == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.exit("--device cuda was asked for but torch sees no CUDA device", returncode=2)
    return dev


@pytest.fixture(scope="session")
def backend_name(backend: str) -> str:
    """The backend under test; skipped (with the reason) only when it is not installed here."""
    from fusekit import backends

    why = backends.available()[backend]
    if why is not None:
        pytest.skip(f"backend {backend!r} is not installed: {why}")
    return backend


# --- Triton kernel tests (tests/test_triton_*.py) ---------------------------------------------------
@pytest.fixture(scope="module")
def dev(device: str) -> str:
    """The device of a Triton kernel test; on the CPU it needs the interpreter (set above)."""
    from kernels_triton._config import is_interpreter

    if device == "cpu" and not is_interpreter():
        pytest.skip(
            "the CPU run needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)"
        )
    return device


@pytest.fixture(scope="module")
def attn():
    """kernels_triton.attention (imported on first use: only Triton sessions have triton)."""
    import kernels_triton.attention as mod

    return mod


@pytest.fixture
def fresh_attention_plans():
    """The Gluon attention's per-signature plans and routes (kernels_triton/_attention_hopper*.py, attention.py)
    cleared before and after a test: some tests build them from patched module attributes (num_sms, l2_bytes,
    GLUON, ...), and none may outlive its test."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        yield
        return
    from kernels_triton import _attention_hopper, _attention_hopper_bwd, attention

    clears = (_attention_hopper.clear_plans, _attention_hopper_bwd.clear_plans, attention.clear_routes)
    for clear in clears:
        clear()
    yield
    for clear in clears:
        clear()
