"""Float64 oracle for every op, written from the op definitions independently of fusekit.reference.

Everything is computed in float64 (int64 for integer sums) on the input's device, with explicit
formulas (einsum, explicit index arithmetic) rather than the reference's code paths.
"""

from __future__ import annotations

import math

import torch

f64 = torch.float64


def reduce_sum(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    acc = x.to(f64) if x.dtype.is_floating_point else x.to(torch.int64)
    return acc.sum() if dim is None else acc.sum(dim=dim)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xd = x.to(f64)
    ms = (xd * xd).sum(-1, keepdim=True) / x.shape[-1]
    rstd = 1.0 / torch.sqrt(ms + eps)
    return xd * rstd * w.to(f64), rstd.squeeze(-1)


def layer_norm(x, w, b, eps):
    xd = x.to(f64)
    n = x.shape[-1]
    mean = xd.sum(-1, keepdim=True) / n
    var = ((xd - mean) ** 2).sum(-1, keepdim=True) / n
    rstd = 1.0 / torch.sqrt(var + eps)
    y = (xd - mean) * rstd * w.to(f64)
    if b is not None:
        y = y + b.to(f64)
    return y, mean.squeeze(-1), rstd.squeeze(-1)


def rope(x, start_pos, theta, interleaved, cos=None, sin=None):
    S, D = x.shape[1], x.shape[3]
    half = D // 2
    if cos is None:
        pos = torch.arange(S, dtype=f64, device=x.device) + start_pos
        inv = theta ** (-(2.0 * torch.arange(half, dtype=f64, device=x.device)) / D)
        ang = pos[:, None] * inv[None, :]
        c, s = torch.cos(ang), torch.sin(ang)
    else:
        c, s = cos[start_pos : start_pos + S].to(f64), sin[start_pos : start_pos + S].to(f64)
    xd = x.to(f64)
    idx = torch.arange(half, device=x.device)
    i0, i1 = (2 * idx, 2 * idx + 1) if interleaved else (idx, idx + half)
    a, b = xd[..., i0], xd[..., i1]
    c, s = c[None, :, None, :], s[None, :, None, :]
    y = torch.empty_like(xd)
    y[..., i0] = a * c - b * s
    y[..., i1] = a * s + b * c
    return y


def swiglu_ffn(x, wg, wu, wd, nw, eps):
    xd = x.to(f64)
    if nw is not None:
        xd = rms_norm(x, nw, eps)[0]
    g = torch.einsum("td,fd->tf", xd, wg.to(f64))
    u = torch.einsum("td,fd->tf", xd, wu.to(f64))
    h = g / (1.0 + torch.exp(-g)) * u
    return torch.einsum("tf,df->td", h, wd.to(f64))


def attention(q, k, v, causal, scale):
    H, S, D = q.shape[1], q.shape[2], q.shape[3]
    Hkv, Skv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kv_head = torch.arange(H, device=q.device) // (H // Hkv)
    kd, vd = k.to(f64)[:, kv_head], v.to(f64)[:, kv_head]
    s = torch.einsum("bhsd,bhtd->bhst", q.to(f64), kd) * scale
    if causal:
        allowed = torch.arange(Skv, device=q.device)[None, :] <= torch.arange(S, device=q.device)[:, None] + (
            Skv - S
        )
        s = torch.where(allowed, s, torch.tensor(-math.inf, dtype=f64, device=q.device))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = torch.where(denom > 0, p / denom.clamp_min(1e-300), torch.zeros_like(p))
    return torch.einsum("bhst,bhtd->bhsd", p, vd)
