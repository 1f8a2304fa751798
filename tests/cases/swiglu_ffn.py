"""swiglu_ffn cases: (lead dims, D, F), with and without the fused RMSNorm (fp32 norm weight too)."""

from __future__ import annotations

import torch

from cases import randn

F64 = torch.float64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD = DTYPES
_CPU = [((5,), 64, 96), ((1,), 16, 24), ((2, 3), 32, 80), ((37,), 48, 40), ((0,), 16, 24), ((9,), 64, 72)]
CPU = [{"lead": lead, "D": d, "F": f, "norm": norm} for lead, d, f in _CPU for norm in (True, False)] + [
    {"lead": (7,), "D": 32, "F": 48, "norm": True, "wf32": True}
]
CUDA = [
    {"lead": lead, "D": d, "F": f, "norm": True}
    for lead, d, f in [((1,), 4096, 11008), ((16,), 4096, 11008), ((300,), 1024, 2816), ((2048,), 2048, 5632)]
]


def make(case: dict, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    d, f = case["D"], case["F"]
    x = randn(*case["lead"], d, dtype=dtype, device=device)
    # weights scaled like a trained layer (std 1/sqrt(fan_in)) so activations stay O(1)
    wg = randn(f, d, dtype=dtype, device=device, scale=d**-0.5)
    wu = randn(f, d, dtype=dtype, device=device, scale=d**-0.5)
    wd = randn(d, f, dtype=dtype, device=device, scale=f**-0.5)
    kwargs = {"eps": 1e-6}
    if case["norm"]:
        wdt = torch.float32 if case.get("wf32") and dtype != torch.float32 else dtype
        kwargs["norm_weight"] = randn(d, dtype=wdt, device=device, scale=0.1, shift=1.0)
    return (x, wg, wu, wd), kwargs


def oracle(x, wg, wu, wd, norm_weight=None, eps=1e-6):
    xd = x.to(F64)
    if norm_weight is not None:
        rstd = 1.0 / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)
        xd = xd * rstd * norm_weight.to(F64)
    g = torch.einsum("...d,fd->...f", xd, wg.to(F64))
    u = torch.einsum("...d,fd->...f", xd, wu.to(F64))
    h = g / (1.0 + torch.exp(-g)) * u
    return (torch.einsum("...f,df->...d", h, wd.to(F64)),)


def scale(args: tuple, kwargs: dict) -> tuple[torch.Tensor]:
    """The 2-norm-of-terms magnitude of the output (see checks.rel_error): the gate/up/down dot products
    are sums that can cancel (a drawn input nearly orthogonal to a weight row), and their rounding is
    then relative to the terms, not to the result. Each sum is replaced by the 2-norm of its terms;
    silu(g)·u by |g|·|u| (|silu(g)| <= |g| + 0.28 and silu' <= 1.1 bound the propagated error)."""
    x, wg, wu, wd = (t.to(F64) for t in args)
    nw = kwargs.get("norm_weight")
    if nw is not None:
        rstd = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + kwargs.get("eps", 1e-6))
        x = x * rstd * nw.to(F64)
    x2 = x.square()
    g = (x2 @ wg.square().T).sqrt()
    u = (x2 @ wu.square().T).sqrt()
    h2 = ((g + 0.28) * u).square()
    return ((h2 @ wd.square().T).sqrt(),)
