"""The backend registry, backend resolution order and lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fusekit import backends, dispatch, ops
from fusekit.backends.base import BackendUnavailable
from fusekit.backends.triton import TritonBackend


def test_available_lists_every_backend_with_a_reason_or_none():
    avail = backends.available()
    assert list(avail) == ["torch", "triton", "mojo"]
    assert avail["torch"] is None
    for name, why in avail.items():
        assert why is None or (isinstance(why, str) and why), name


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match="valid names are: auto, torch, triton, mojo"):
        backends.get("cuBLAS")


def test_missing_backend_says_how_to_install(monkeypatch):
    def broken_load(self):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(TritonBackend, "_load", broken_load)
    missing = TritonBackend()
    monkeypatch.setitem(backends._INSTANCES, "triton", missing)
    dispatch.clear_cache()
    with pytest.raises(
        BackendUnavailable,
        match=r"'triton' is not available: ImportError: No module named 'triton' "
        r"\(install with: pip install 'fusekit\[triton\]'\)",
    ):
        ops.rms_norm(torch.randn(2, 8), torch.randn(8), backend="triton")
    dispatch.clear_cache()


def test_unsupported_case_names_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    b = TritonBackend()
    b._checked, b._reason, b._interpret = True, None, False
    monkeypatch.setitem(backends._INSTANCES, "triton", b)
    dispatch.clear_cache()
    with pytest.raises(
        ValueError,
        match=r"backend: 'triton' cannot run rms_norm \(forward\) for this call: .*TRITON_INTERPRET=1",
    ):
        ops.rms_norm(torch.randn(2, 8), torch.randn(8), backend="triton")
    dispatch.clear_cache()


def test_resolution_order(monkeypatch):
    dispatch.clear_cache()
    dev = torch.device("cpu")
    f32 = (torch.float32,)
    assert (
        dispatch.resolve("rms_norm", "auto", dev, f32 * 2).name == dispatch.auto_order("rms_norm", "cpu")[0]
    )
    monkeypatch.setenv("FUSEKIT_BACKEND", "torch")
    dispatch.clear_cache()  # the variables are read once, and again by clear_cache
    assert dispatch.resolve("rope", "auto", dev, f32).name == "torch"
    monkeypatch.setenv("FUSEKIT_BACKEND_ROPE", "nonexistent")
    assert dispatch.resolve("rope", "auto", dev, f32).name == "torch"  # not yet read
    dispatch.clear_cache()
    with pytest.raises(ValueError, match=r"^FUSEKIT_BACKEND_ROPE: unknown backend 'nonexistent'"):
        dispatch.resolve("rope", "auto", dev, f32)
    monkeypatch.delenv("FUSEKIT_BACKEND_ROPE")
    monkeypatch.setenv("fusekit_backend_rope", "torch")  # names in any case; values exact
    monkeypatch.setenv("FUSEKIT_BACKEND", "torch ")
    dispatch.clear_cache()
    assert dispatch.resolve("rope", "auto", dev, f32).name == "torch"
    with pytest.raises(ValueError, match=r"^FUSEKIT_BACKEND: unknown backend 'torch '"):
        dispatch.resolve("rms_norm", "auto", dev, f32 * 2)
    # an explicit argument beats the environment
    assert dispatch.resolve("rope", "torch", dev, f32).name == "torch"
    dispatch.clear_cache()


def test_auto_table_covers_every_op_and_ends_with_torch():
    for device_type in ("cpu", "cuda"):
        for op in ops.OPS:
            order = dispatch.auto_order(op, device_type)
            assert order[-1] == "torch", (device_type, op)
            assert set(order) <= set(backends.names())


def test_import_is_lazy():
    code = (
        "import sys, fusekit; from fusekit import ops; "
        "bad = [m for m in ('triton', 'max', 'mojo', 'kernels_triton') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_clear_cache_checks_unavailable_backends_again(monkeypatch):
    """A backend that could not run is checked again after dispatch.clear_cache() (installed since): its
    first reason was kept for the process."""
    monkeypatch.setitem(backends._INSTANCES, "mojo", backends._Missing("mojo", "ModuleNotFoundError: gone"))
    assert backends.available()["mojo"] == "ModuleNotFoundError: gone"
    dispatch.clear_cache()
    assert "mojo" not in backends._INSTANCES
    assert backends.available()["mojo"] != "ModuleNotFoundError: gone"
    dispatch.clear_cache()


def test_threads_making_their_first_calls_at_once_load_a_backend_once(monkeypatch):
    """Eight threads' first calls at once (a server warming up): one instance per backend name and one
    `_load` (each thread ran its own: eight mojo compilers and MAX sessions, one per thread)."""
    import threading
    import time
    import types

    from fusekit.backends.base import Backend

    made = {"init": 0, "load": 0}

    class Slow(Backend):
        name = "slow"

        def __init__(self) -> None:
            super().__init__()
            made["init"] += 1
            time.sleep(0.02)  # a wide window for the other threads

        def _load(self) -> None:
            made["load"] += 1
            time.sleep(0.02)

    mod = types.ModuleType("_fusekit_test_slow_backend")
    mod.Slow = Slow
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(backends._REGISTRY, "slow", f"{mod.__name__}:Slow")
    monkeypatch.delitem(backends._INSTANCES, "slow", raising=False)
    start, seen = threading.Barrier(8), []

    def first_call() -> None:
        start.wait()
        b = backends.get("slow")
        seen.append((b, b.unavailable_reason()))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == {"init": 1, "load": 1}
    assert len({id(b) for b, _ in seen}) == 1 and [r for _, r in seen] == [None] * 8
    monkeypatch.delitem(backends._INSTANCES, "slow")
