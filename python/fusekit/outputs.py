"""Output allocation. Tests switch on poisoning so an element a kernel fails to write shows up."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch

_poison = False


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, or a tensor full of NaN (floats) / the most negative integer while poisoning."""
    if not _poison:
        # sizes as separate arguments: torch's argument parser takes them ~0.7 us faster than a Size
        return (
            torch.empty(*shape, dtype=dtype, device=device)
            if shape
            else torch.empty((), dtype=dtype, device=device)
        )
    return torch.full(shape, _poison_value(dtype), dtype=dtype, device=device)


def _poison_value(dtype: torch.dtype) -> float | int:
    return float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min


def empty_strided(
    shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`empty` with the given (dense, permuted) strides: an output in an input's memory order."""
    out = torch.empty_strided(shape, strides, dtype=dtype, device=device)
    if _poison:
        out.fill_(_poison_value(dtype))
    return out


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Within this block every fusekit output starts as NaN (or INT_MIN) instead of garbage."""
    global _poison
    old, _poison = _poison, True
    try:
        yield
    finally:
        _poison = old


# --- scratch for outputs a call throws away ------------------------------------------------------------
# A forward-only call still gets its statistics (rms_norm's rstd, layer_norm's mean/rstd, attention's lse)
# from the kernels, which write them unconditionally; when the caller does not return them they are dead
# on arrival. At decode shapes each such torch.empty costs 2-3.5 us of host time (H100 host, .dev probe at
# dc925c5) beside a 5 us launch, so a remembered forward call (library.Runner) writes them into a scratch
# arena instead. The arena grows by doubling to what the calls so far needed (a 1 MiB arena held from the
# first call was the +1 MiB of fusekit-triton's 32-layer training peak over HF eager's on the H200 at
# 3013609, a 256 KiB one the +264 KiB at 4c62de0: both from the benchmark's inference gate before it); an
# outgrown arena lives on while views of it do (a CUDA graph that captured a call keeps writing there on
# every replay). It is never read; calls racing on it from several streams only overwrite garbage with
# garbage.
SCRATCH_MIN = 4096  # bytes: the first arena of a device
# Larger statistics (prefill's: attention's lse at 32 heads x 2048 tokens is 256 KiB) are allocated per call
# as usual, their 2-3 us beside a kernel of 50 us or more; 64 KiB holds a decode step's (lse of 256
# sequences x 64 heads).
SCRATCH_MAX = 64 << 10  # bytes
_ARENAS: dict[torch.device, torch.Tensor] = {}
_ARENA_LOCK = threading.Lock()


def scratch(
    layouts: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device
) -> list[torch.Tensor] | None:
    """Non-overlapping views of `device`'s scratch arena, one per (shape, dtype), each at a multiple of 256
    bytes from its start (CUDA's allocator aligns it to 512); None when they need more than SCRATCH_MAX."""
    offsets, end = [], 0
    for shape, dtype in layouts:
        offsets.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // 256) * 256
    if end > SCRATCH_MAX:
        return None
    # Neither the arena nor its views are inference tensors (a first call under inference_mode): a repeat
    # outside it writes into them in place (the torch provider's copy_), which torch refuses for those.
    with torch.inference_mode(False):
        with _ARENA_LOCK:
            arena = _ARENAS.get(device)
            if arena is None or arena.numel() < end:
                size = max(SCRATCH_MIN, 2 * arena.numel() if arena is not None else 0)
                while size < end:
                    size *= 2
                arena = _ARENAS[device] = torch.empty(
                    min(size, SCRATCH_MAX), dtype=torch.uint8, device=device
                )
        return [
            arena[o : o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, layouts)
        ]
