"""A stand-in for Triton's CompiledKernel, shared by the lean-launch and launch-replay CPU tests: the
compiled launcher (`run`) and Triton's hooked runner (`kernel[grid]`) only record their arguments."""

from __future__ import annotations


class FakeCompiledKernel:
    """`run` logs (tag, grid, args) as _launch's direct path calls it (no metadata, no hooks);
    `kernel[grid](*args)` logs ("hooked", grid, args), the runner taken while a launch hook is set."""

    function = packed_metadata = None

    def __init__(self, log: list, tag: str = "launch") -> None:
        self.log = log
        self.tag = tag

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args) -> None:
        assert launch_metadata is None and enter is None and exit_ is None
        self.log.append((self.tag, (gx, gy, gz), args))

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("hooked", grid, args))


def fake_ffn_choice(monkeypatch, tma_auto):
    """swiglu_ffn's automatic ptr-vs-TMA choice made testable on the CPU: `tma_auto(tensors)` decides TMA
    eligibility, caches start empty, and the timer runs each candidate once and calls later candidates
    faster (the TMA config wins wherever it competes). Returns (the module, the list of timed runs)."""
    import kernels_triton.swiglu_ffn as ffn

    monkeypatch.setattr(ffn, "_tma_auto", tma_auto)
    monkeypatch.setattr(ffn, "_CHOICE", {})
    monkeypatch.setattr(ffn, "TIMINGS", {})
    monkeypatch.setattr(ffn, "_BROKEN", set())
    calls: list[int] = []

    def bench(fn, device) -> float:
        fn()
        calls.append(1)
        return 10.0 - len(calls)

    monkeypatch.setattr(ffn, "_bench_ms", bench)
    return ffn, calls
