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
