"""layer_norm cases: odd sizes, offset means (stable variance), bias or not, residual, fp32 weights."""

from __future__ import annotations

import torch

from cases import randn, round_as

F32 = torch.float32
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD = DTYPES
_SHAPES_CPU = [(4, 64), (1, 1), (5, 111), (3, 4, 760), (2, 1128), (7, 3000), (0, 64), (2, 8192), (1, 70000)]
# N = 1: y = bias whatever x is, and d x = rstd (g - g) with rstd = 1/sqrt(eps) ~ 316 amplifying the
# rounding of an exact zero: forward only ("grad": False).
CPU = (
    [{"shape": s, "bias": i % 2 == 0, "grad": s[-1] > 1} for i, s in enumerate(_SHAPES_CPU)]
    + [{"shape": (5, 33), "bias": True, "residual": True}, {"shape": (3, 760), "bias": True, "wf32": True}]
    + [{"shape": (9, 4097), "bias": False, "residual": True, "wf32": True}]
)
CUDA = [
    {"shape": s, "bias": True} for s in [(4096, 8192), (37, 65536), (4, 262144), (199, 4097), (8192, 32768)]
] + [{"shape": (4096, 4096), "bias": True, "residual": True, "wf32": True}]


def make(case: dict, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    shape = case["shape"]
    x = randn(*shape, dtype=dtype, device=device, scale=2.0, shift=5.0)  # offset mean: stable variance
    wdt = F32 if case.get("wf32") and dtype != F32 else dtype
    w = randn(shape[-1], dtype=wdt, device=device, scale=0.5, shift=1.0)
    b = randn(shape[-1], dtype=wdt, device=device) if case.get("bias") else None
    kwargs = {"return_stats": True}
    if case.get("residual"):
        kwargs["residual"] = randn(*shape, dtype=dtype, device=device)
    return (x, w, b, 1e-5), kwargs


def oracle(x, w, b, eps, residual=None, return_stats=True):
    xd = x.to(torch.float64)
    h = None
    if residual is not None:
        h = round_as(xd + residual.to(torch.float64), x)
        xd = h
    n = x.shape[-1]
    mean = xd.sum(-1, keepdim=True) / n
    var = ((xd - mean) ** 2).sum(-1, keepdim=True) / n
    rstd = 1.0 / torch.sqrt(var + eps)
    y = (xd - mean) * rstd * w.to(torch.float64)
    if b is not None:
        y = y + b.to(torch.float64)
    out = (y,) if h is None else (y, h)
    return (*out, mean.squeeze(-1), rstd.squeeze(-1)) if return_stats else out
