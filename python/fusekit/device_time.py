"""Device time of one GPU call with the host's enqueue time kept out: the benchmarks' timer
(`fusekit.bench.timing.bench_ms`) and the first-use tuners' (swiglu_ffn's GEMM selector, the norm tuner).

`triton.testing.do_bench` records its start event right after the L2 flush kernel, so when the host takes
longer to enqueue the call than the GPU takes to flush (a decode-sized call with a long launcher path), the
GPU idles between the events and the "device" time includes host time: on the H200 a triton decode
attention call measured 144.8 us one run and 52.7 the next, its kernels 37.7 us by the profiler
(attention.decode.json at d21b580 and b02a12f). A tuner comparing candidates whose host paths differ (a
vendor GEMM's two torch.mm calls against one Triton launch) then ranks host speed, which varies from
machine to machine, not the GPU time the choice is for: H100 2026-11-27, swiglu_ffn T=256 F=11008, the
vendor gate/up timed 97 us in one process and 116 in another (the Triton GEMM 114-116 in both), so one
process picked it and the other did not. `device_ms` enqueues a GPU spin (`torch.cuda._sleep`) after
the flush, longer than the host's enqueue time of the call (measured first), so the call's kernels start
as soon as the spin ends and the events bracket device time only.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > 4x the H200's 60 MB L2
LEAD_MAX_US = 5000.0  # the longest GPU spin before a timed call (a call whose host path exceeds it leaks)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _spin_cycles_per_us(index: int) -> float:
    """torch.cuda._sleep cycles per microsecond on this device (its SM clock), measured with events."""
    with torch.cuda.device(index):
        torch.cuda._sleep(1000)  # loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 2_000_000
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        return n / max(start.elapsed_time(end) * 1e3, 1e-3)


def _lead_cycles(fn: Callable[[], object], device: torch.device) -> int:
    """A GPU spin that outlasts the host's enqueue of one `fn()`: twice its median host time (5 calls, each
    from an idle GPU) + 20 us, at most LEAD_MAX_US; 0 where torch has no _sleep."""
    if not hasattr(torch.cuda, "_sleep"):
        return 0
    host = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    sync(device)
    us = min(LEAD_MAX_US, 2e6 * statistics.median(host) + 20.0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(us * _spin_cycles_per_us(index))


def device_ms(
    fn: Callable[[], object], device: torch.device | None, warmup_ms: float = 25, rep_ms: float = 100
) -> float:
    """Median device time of one `fn()` in ms (CUDA only; `device` None: the current GPU): the do_bench
    recipe (estimate, warm up, then time each call with events after overwriting an L2-sized buffer) plus
    the GPU spin between the flush and the start event (see the module doc)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    fn()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    sync(device)
    est = max(start.elapsed_time(end) / 5, 1e-3)
    n_warm, n_rep = max(1, int(warmup_ms / est)), max(5, min(10000, int(rep_ms / est)))
    for _ in range(n_warm):
        fn()
    lead = _lead_cycles(fn, device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends):
        flush.zero_()
        if lead:
            torch.cuda._sleep(lead)
        s.record()
        fn()
        e.record()
    sync(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
