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
    x2 = _normed(x, kwargs)[0].square()
    g, u = _terms(x2, wg), _terms(x2, wu)
    h2 = ((g + 0.28) * u).square()
    return ((h2 @ wd.square().T).sqrt(),)


def _normed(x: torch.Tensor, kwargs: dict) -> tuple:
    """(xn, x̂, rstd) of float64 x [..., D]: xn = x̂ * norm_weight with x̂ = x * rstd, or (x, None, None)
    without a norm weight (the error scales' prologue; the oracle writes its own)."""
    nw = kwargs.get("norm_weight")
    if nw is None:
        return x, None, None
    rstd = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + kwargs.get("eps", 1e-6))
    xhat = x * rstd
    return xhat * nw.detach().to(F64), xhat, rstd


def _terms(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The 2-norms of the terms of x @ w^T, from x2 = x.square()."""
    return (x2 @ w.square().T).sqrt()


def grad_scale(args: tuple, kwargs: dict, grads: tuple) -> tuple:
    """Per gradient (dx, dw_gate, dw_up, dw_down[, dnorm_weight]): the 2-norm-of-terms size of what the
    backward's roundings to x's dtype reach in it, however small the gradient is where its sums cancel.

    Every backend (and the reference) rounds xn, saves g and u rounded to x's dtype, and rounds
    dg = dh u silu'(g) and du = dh silu(g) to it before the GEMMs. g and u then carry ~u G and ~u U, the
    2-norms of their terms (as `scale`), so dg carries ~u |dh| (|silu'(g)| U ⊕ 0.5 |u| G) (|silu''| <= 0.5;
    ⊕: in quadrature, independent roundings) and du ~u |dh| (|silu'(g)| G ⊕ |silu(g)|). dxn = dg W_gate +
    du W_up sums 2F of those, dW_gate = dg^T xn and dW_up = du^T xn sum T, dW_down = dy^T h sums T terms
    of h = silu(g) u (~u (|silu'(g)| G |u| ⊕ |silu(g)| U)); with a norm dx = rstd (nw dxn - x̂ mean(nw dxn
    x̂)) and dnorm_weight = Σ_T dxn x̂. A sum of random-sign terms can land far below its terms' 2-norm:
    one token at D = 1 (a single dnorm_weight, a sum of 510 terms: 0.085 against ~1.0) missed 2e-2 by a
    rounding error of 0.0038, 0.4% of that magnitude (FUSEKIT_FUZZ_SEED=5 FUSEKIT_FUZZ_EXAMPLES=20, bf16,
    the torch reference); the driver's floor of 0.1 per element is below it there. These magnitudes
    (float64) are what the error is measured against where they are larger; without cancellation they
    are about the gradients' own size.
    """
    x, wg, wu, wd = (t.detach().to(F64) for t in args)
    nw = kwargs.get("norm_weight")
    d = x.shape[-1]
    dy = grads[0].detach().to(F64).reshape(-1, d)
    xn, xhat, rstd = _normed(x.reshape(-1, d), kwargs)
    x2 = xn.square()
    g, u = xn @ wg.T, xn @ wu.T  # [T, F]
    tg, tu = _terms(x2, wg), _terms(x2, wu)  # their terms' 2-norms
    sig = torch.sigmoid(g)
    silu, dsilu = (g * sig).abs(), (sig * (1.0 + g * (1.0 - sig))).abs()
    dh = (dy @ wd).abs()
    # independent roundings add in quadrature
    dg2 = dh.square() * ((dsilu * tu).square() + (0.5 * u.abs() * tg).square())
    du2 = dh.square() * ((dsilu * tg).square() + silu.square())
    h2 = (dsilu * tg * u.abs()).square() + (silu * tu).square()
    dxn = (dg2 @ wg.square() + du2 @ wu.square()).sqrt()  # [T, D]
    out = [None, (dg2.T @ x2).sqrt(), (du2.T @ x2).sqrt(), (dy.square().T @ h2).sqrt()]
    if nw is None:
        out[0] = dxn.reshape(args[0].shape)
        return tuple(out)
    gw = dxn * nw.detach().to(F64).abs()
    dx = rstd * (gw.square() + xhat.square() * (gw * xhat).square().sum(-1, keepdim=True) / d**2).sqrt()
    out[0] = dx.reshape(args[0].shape)
    return (*out, (dxn * xhat).square().sum(0).sqrt())
