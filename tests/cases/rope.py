"""rope cases: [B, S, H, D], start positions, halves/interleaved, in-kernel angles or tables."""

from __future__ import annotations

import torch

from cases import randn

F64 = torch.float64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD = DTYPES
_CPU = [((2, 5, 3, 8), 0), ((1, 7, 4, 64), 13), ((1, 1, 1, 2), 0), ((2, 33, 5, 128), 3), ((0, 4, 2, 16), 0)]
_CUDA = [((2, 512, 32, 128), 0), ((1, 4096, 8, 128), 100), ((3, 77, 40, 96), 7)]
CPU = [
    {"shape": s, "start_pos": p, "interleaved": il, "tables": tb}
    for s, p in _CPU
    for il in (False, True)
    for tb in (False, True)
]
CUDA = [
    {"shape": s, "start_pos": p, "interleaved": False, "tables": tb} for s, p in _CUDA for tb in (False, True)
]


def _angles(positions: torch.Tensor, d: int, theta: float) -> torch.Tensor:
    inv = theta ** (-(2.0 * torch.arange(d // 2, dtype=F64, device=positions.device)) / d)
    return positions.to(F64)[:, None] * inv[None, :]


def make(case: dict, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    shape, start = case["shape"], case["start_pos"]
    x = randn(*shape, dtype=dtype, device=device)
    theta = 500000.0 if shape[-1] >= 128 else 10000.0
    kwargs = {"start_pos": start, "theta": theta, "interleaved": case["interleaved"]}
    if case["tables"]:  # tables longer than needed, read from row start_pos
        ang = _angles(torch.arange(start + shape[1] + 5, device=device), shape[-1], theta)
        kwargs["cos"], kwargs["sin"] = torch.cos(ang).float(), torch.sin(ang).float()
    return (x,), kwargs


def oracle(x, start_pos=0, theta=10000.0, interleaved=False, cos=None, sin=None):
    S, D = x.shape[1], x.shape[3]
    half = D // 2
    if cos is None:
        ang = _angles(torch.arange(start_pos, start_pos + S, device=x.device), D, theta)
        c, s = torch.cos(ang), torch.sin(ang)
    else:
        c, s = cos[start_pos : start_pos + S].to(F64), sin[start_pos : start_pos + S].to(F64)
    xd = x.to(F64)
    idx = torch.arange(half, device=x.device)
    i0, i1 = (2 * idx, 2 * idx + 1) if interleaved else (idx, idx + half)
    a, b = xd[..., i0], xd[..., i1]
    c, s = c[None, :, None, :], s[None, :, None, :]
    y = torch.zeros_like(xd)
    y = y.index_copy(-1, i0, a * c - b * s)
    y = y.index_copy(-1, i1, a * s + b * c)
    return (y,)
