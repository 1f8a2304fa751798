"""Output allocation. Tests switch on poisoning so an element a kernel fails to write shows up."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_poison = False


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, or a tensor full of NaN (floats) / the most negative integer while poisoning."""
    if not _poison:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return torch.full(shape, fill, dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Within this block every fusekit output starts as NaN (or INT_MIN) instead of garbage."""
    global _poison
    old, _poison = _poison, True
    try:
        yield
    finally:
        _poison = old
