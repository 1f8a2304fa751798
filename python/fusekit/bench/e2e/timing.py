"""bench.e2e's timer: host wall-clock with a device sync around each call, median of the reps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusekit.bench.e2e.config import _sync


# --- timing ------------------------------------------------------------------------------------------
@dataclass
class Timing:
    first_call_s: float
    times_s: list[float]
    peak_mem_bytes: int | None
    mem_before_bytes: int | None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> Timing:
    """Host wall-clock per call, a device sync before and after each; the first (compile, tuning) call
    is timed on its own, then warmup - 1 more untimed calls, then `reps` timed ones."""
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t
    for _ in range(max(0, warmup - 1)):
        fn()
    _sync(device)
    before = peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    return Timing(first, times, peak, before)
