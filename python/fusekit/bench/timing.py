"""Timing: median device time (CUDA events around each call, the GPU held ahead of the host), host
wall-clock per call (back-to-back calls, and one call + sync), peak memory, and optional kernel-only time
from the torch profiler.

Cold caches: the caller hands in several input sets (`Rotation`) so the working set of small cases
exceeds the L2 (60 MB on an H200), and the event loop additionally overwrites a 256 MB buffer between
calls (as `triton.testing.do_bench` does).

Device time without the host: `fusekit.device_time.device_ms` (a GPU spin holds the device until the
call is enqueued; why, there). Host time is reported on its own (wall per call).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusekit.device_time import device_ms
from fusekit.device_time import sync as _sync


@dataclass
class Rotation:
    """Cycles through input sets: each call sees a set that is not in the L2."""

    sets: list[dict[str, torch.Tensor]]
    i: int = 0

    def next(self) -> dict[str, torch.Tensor]:
        s = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return s


def n_rotating_sets(bytes_per_set: int, device: torch.device, max_sets: int = 256) -> int:
    """How many input sets to keep so that together they are ≥ 4x the L2 (1 when one set already is)."""
    if device.type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 * 2**20) or 60 * 2**20
    return max(1, min(max_sets, -(-4 * l2 // max(1, bytes_per_set))))


def _wall_loop(fn: Callable[[], object], device: torch.device, warmup_ms: float, rep_ms: float) -> float:
    """Median host wall-clock per call, synchronizing after each call (what a user waiting sees)."""
    t_end = time.perf_counter() + warmup_ms / 1e3
    fn()
    _sync(device)
    while time.perf_counter() < t_end:
        fn()
        _sync(device)
    times: list[float] = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 10000):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_ms(
    fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25, rep_ms: float = 100
) -> tuple[float, str]:
    """Median time of one call in ms, and the method used."""
    if device.type == "cuda":
        return device_ms(fn, device, warmup_ms, rep_ms), METHOD_CUDA
    return _wall_loop(fn, device, warmup_ms, rep_ms), "host wall-clock median"


METHOD_CUDA = (
    "CUDA-event median (L2 flushed; a GPU spin holds the device until the call is enqueued: device time only)"
)


def e2e_ms(
    fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 10, rep_ms: float = 50
) -> float:
    """Median host wall-clock of one call followed by a device sync: launch and host overhead included."""
    return _wall_loop(fn, device, warmup_ms, rep_ms)


def wall_per_call_ms(
    fn: Callable[[], object], device: torch.device, *, rep_ms: float = 50, repeats: int = 3
) -> tuple[float, int]:
    """Host wall-clock per call of N back-to-back calls: sync, time N calls with perf_counter, sync.

    What a training or decode loop sees: launch, Python and dispatch overhead included, and hidden
    behind the device where the device is the slower one. N is sized to about rep_ms / repeats per
    loop (at least 3 calls, one loop when that is already 3x over budget); the median of the loops'
    per-call times is returned, with N.
    """
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    est = max(time.perf_counter() - t0, 1e-6)
    n = max(3, min(10000, int(rep_ms / 1e3 / repeats / est)))
    if n * est * repeats > 3 * rep_ms / 1e3:  # slow calls (a loaded CPU): one loop of 3 is enough
        repeats = 1
    per_call: list[float] = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        per_call.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(per_call), n


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Device memory one call allocates at its peak above what was allocated before it (outputs, saved
    activations and gradients included): torch.cuda.max_memory_allocated delta. None off CUDA."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return int(peak)


def kernel_ms(fn: Callable[[], object], device: torch.device, n: int = 5) -> float | None:
    """Device time of the kernels one call launches (sum over kernels, median over `n` calls), from the
    torch profiler (CUPTI). None where the profiler cannot see CUDA kernels."""
    if device.type != "cuda":
        return None
    try:
        import warnings

        from torch.profiler import ProfilerActivity, profile

        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        fn()
        _sync(device)
        per_call: list[float] = []
        for _ in range(n):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                _sync(device)
            total_us = 0.0
            for ev in prof.events():
                dev_type = getattr(ev, "device_type", None)
                if dev_type is not None and "CUDA" in str(dev_type):
                    total_us += ev.time_range.elapsed_us()
            if total_us <= 0:
                return None
            per_call.append(total_us / 1e3)
        return statistics.median(per_call)
    except Exception:
        return None
