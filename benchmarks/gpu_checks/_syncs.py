"""Host syncs a call makes, for the gpu_checks scripts (torch's CUDA sync-debug mode)."""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Callable

import torch


def host_syncs(fn: Callable[[], object]) -> Counter:
    """Runs fn once with torch.cuda.set_sync_debug_mode("warn") and counts the syncs it makes by their
    innermost caller outside torch ("file:line function"); sum(...values()) is the total."""
    where: Counter = Counter()

    def note(*args, **kwargs) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
        f = frames[-1] if frames else None
        where[f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" if f else "?"] += 1

    shown, warnings.showwarning = warnings.showwarning, note
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
    torch.cuda.synchronize()
    return where
