"""reduce_sum cases: (shape, dim) incl. 0-sized, 1-sized, 0-d; int64 values past 2^31."""

from __future__ import annotations

import torch

from cases import randn

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
GRAD = (torch.float32, torch.float16, torch.bfloat16)
CPU = [
    {"shape": (37,), "dim": None},
    {"shape": (3, 1000), "dim": -1},
    {"shape": (0,), "dim": None},
    {"shape": (1,), "dim": None},
    {"shape": (4097,), "dim": None},
    {"shape": (2, 3, 129), "dim": -1},
    {"shape": (5, 0), "dim": -1},
    {"shape": (6, 7), "dim": 0},
    {"shape": (2, 3, 5), "dim": 1},
    {"shape": (), "dim": None},
    {"shape": (40000,), "dim": None},
    {"shape": (3, 3001), "dim": -1, "out": torch.float32},  # fp32 result of a half input
]
CUDA = [
    {"shape": ((1 << 24) + 3,), "dim": None},
    {"shape": (4096, 8193), "dim": -1},
    {"shape": (1 << 26,), "dim": None},
    {"shape": (3, 1 << 22), "dim": -1},
]


def make(case: dict, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    if dtype.is_floating_point:
        x = randn(*case["shape"], dtype=dtype, device=device)
    else:  # int64 values past 2^31 so that a 32-bit accumulator would fail
        hi = 1 << 40 if dtype == torch.int64 else 1 << 20
        x = torch.randint(-hi, hi, case["shape"], dtype=dtype, device=device)
    out = case.get("out")
    kwargs = {"dtype": out} if out is not None and dtype.is_floating_point else {}
    return (x, case["dim"]), kwargs


def oracle(x: torch.Tensor, dim: int | None, dtype: torch.dtype | None = None) -> tuple[torch.Tensor]:
    acc = x.to(torch.float64) if x.dtype.is_floating_point else x.to(torch.int64)
    return (acc.sum() if dim is None else acc.sum(dim=dim),)


def scale(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None]:
    """The 2-norm of the terms behind each sum (a random sum can cancel; see checks.rel_error)."""
    x, dim = args
    if not x.dtype.is_floating_point:
        return (None,)
    sq = x.to(torch.float64).square()
    return ((sq.sum() if dim is None else sq.sum(dim=dim)).sqrt(),)
