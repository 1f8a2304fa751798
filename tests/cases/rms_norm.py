"""rms_norm cases: odd hidden sizes, N = 1, empty rows; residual, casting modes, fp32 weights."""

from __future__ import annotations

import torch

from cases import randn, round_as

F32 = torch.float32
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD = DTYPES
_SHAPES_CPU = [
    (4, 64),
    (1, 1),
    (5, 111),
    (3, 4, 760),
    (2, 1128),
    (7, 3000),
    (0, 64),
    (2, 8192),
    (1, 70000),
    (9, 4097),
]
CPU = (
    [{"shape": s} for s in _SHAPES_CPU]
    + [{"shape": (5, 33), "residual": True}, {"shape": (3, 760), "residual": True, "wf32": True}]
    + [{"shape": (6, 96), "casting": c} for c in ("llama", "gemma")]
    + [
        {"shape": (4, 200), "casting": "llama", "wf32": True, "residual": True},
        {"shape": (3, 4097), "wf32": True},
    ]
)
CUDA = [{"shape": s} for s in [(4096, 8192), (37, 65536), (4, 262144), (199, 4097), (1024, 5120)]] + [
    {"shape": (4096, 4096), "residual": True, "wf32": True},
    {"shape": (1024, 8192), "casting": "llama", "wf32": True},
    {"shape": (333, 2048), "casting": "gemma", "residual": True},
]


def make(case: dict, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    shape = case["shape"]
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    wdt = F32 if case.get("wf32") and dtype != F32 else dtype
    w = randn(shape[-1], dtype=wdt, device=device, scale=0.5, shift=1.0)
    kwargs = {"eps": 1e-6, "return_rstd": True, "casting": case.get("casting", "fp32")}
    if case.get("residual"):
        kwargs["residual"] = randn(*shape, dtype=dtype, device=device)
    return (x, w), kwargs


def oracle(x, w, eps, residual=None, casting="fp32", return_rstd=True):
    xd = x.to(torch.float64)
    h = None
    if residual is not None:
        h = round_as(xd + residual.to(torch.float64), x)
        xd = h
    ms = (xd * xd).sum(-1, keepdim=True) / x.shape[-1]
    rstd = 1.0 / torch.sqrt(ms + eps)
    xhat = xd * rstd
    wd = w.to(torch.float64)
    if casting == "llama":
        y = round_as(xhat, x) * wd
    elif casting == "gemma":
        y = xhat * (1.0 + wd)
    else:
        y = xhat * wd
    out = (y,) if h is None else (y, h)
    return (*out, rstd.squeeze(-1)) if return_rstd else out


def grad_scale(args: tuple, kwargs: dict, grads: tuple) -> tuple:
    """Per gradient (dx, dw[, d residual]): the size of the terms whose difference dx is (dw: None, the floor).

    dx = rstd (g - x̂ mean(g x̂)) is a difference, and every backend (the float64 oracle aside) forms both
    terms from fp32 x̂ = x rstd: its rounding is ~u of the terms, however small their difference. At N = 1
    the difference is g eps rstd^3 (x̂^2 = ms / (ms + eps)), ~6e-4 of the terms at |x| 0.04 and eps 1e-6,
    so one fp32 rounding of x̂ (6e-8) is 1e-4 of dx: more than the 0.1-per-element floor allows at the
    fp32 tolerance whenever |x| < ~0.05 (about 1% of N(0, 3^2) draws). The 2-norm of the two terms per
    element (as `checks.sum_scale` for sums) is that size; for N >> 1 the projected term is ~1/sqrt(N) of
    g, so the scale is ||dx|| to within ~1/N and no wider. A dropped or doubled term still moves dx by a
    whole term, far above any tolerance.
    """
    x, w = (t.detach().to(torch.float64) for t in args[:2])
    residual = kwargs.get("residual")
    if residual is not None:
        x = round_as(x + residual.detach().to(torch.float64), args[0])
    rstd = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + kwargs["eps"])
    xhat = x * rstd
    weff = 1.0 + w if kwargs.get("casting") == "gemma" else w
    g = grads[0].detach().to(torch.float64) * weff
    proj = xhat * (g * xhat).mean(-1, keepdim=True)
    dx = rstd * (g.square() + proj.square()).sqrt()
    return (dx, None) + ((dx,) if residual is not None else ())
