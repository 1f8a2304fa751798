"""What each fusekit op means: plain torch code with explicit precision semantics.

This module is the definition every backend is tested against (through an independent float64
oracle in `tests/oracle.py`) and is what the `torch` backend runs. Precision rules:

- Element-wise and reduction math happens in float32 (float64 stays float64); a result is cast to
  the output dtype exactly once, at the end.
- Matrix products accumulate in float32; an intermediate that a fused kernel stores in the input
  dtype (the normalized activation and the SwiGLU hidden state of `swiglu_ffn`) is rounded to that
  dtype here too, so the reference matches what a fused kernel can compute.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    if dtype.is_floating_point:
        return torch.float32
    return torch.int64


def reduce_sum(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, N] -> [M]: row sums accumulated in fp32 (floats) or int64 (integers), cast to out_dtype."""
    return x.to(_acc_dtype(x.dtype)).sum(dim=-1).to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N], weight [N] -> (y [M, N] in x.dtype, rstd [M] fp32).

    y = x * rsqrt(mean(x^2) + eps) * weight, all in fp32, one cast at the end.
    """
    xf = x.to(_acc_dtype(x.dtype))
    rstd = torch.rsqrt(xf.square().mean(dim=-1) + eps)
    y = xf * rstd[:, None] * weight.to(xf.dtype)
    return y.to(x.dtype), rstd.float()


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, N] -> (y [M, N] in x.dtype, mean [M] fp32, rstd [M] fp32), biased variance as torch."""
    xf = x.to(_acc_dtype(x.dtype))
    mean = xf.mean(dim=-1)
    xc = xf - mean[:, None]
    rstd = torch.rsqrt(xc.square().mean(dim=-1) + eps)
    y = xc * rstd[:, None] * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype), mean.float(), rstd.float()


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len(positions), D/2] of angle p * theta^(-2i/D), computed in `dtype`."""
    i = torch.arange(head_dim // 2, device=positions.device, dtype=dtype)
    inv_freq = torch.exp(i * (-2.0 * math.log(theta) / head_dim))
    ang = positions.to(dtype)[:, None] * inv_freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def rope(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    start_pos: int,
    theta: float,
    interleaved: bool,
) -> torch.Tensor:
    """x [B, S, H, D] -> rotated x, same dtype.

    Pair (a, b) = (x[..., i], x[..., i + D/2]) (HF Llama halves) or (x[..., 2i], x[..., 2i+1])
    (`interleaved`) becomes (a cos - b sin, b cos + a sin) with angle (start_pos + s) * theta^(-2i/D).
    Given tables cos/sin [St, D/2] (St >= start_pos + S) are read at row start_pos + s.
    """
    _, S, _, D = x.shape
    acc = _acc_dtype(x.dtype)
    if cos is None or sin is None:
        pos = torch.arange(start_pos, start_pos + S, device=x.device)
        cos, sin = rope_tables(pos, D, theta, acc)
    else:
        cos, sin = cos[start_pos : start_pos + S].to(acc), sin[start_pos : start_pos + S].to(acc)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    xf = x.to(acc)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)
    a, b = xf[..., : D // 2], xf[..., D // 2 :]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


def swiglu_ffn(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """x [T, D], w_gate/w_up [F, D], w_down [D, F] -> [T, D].

    xn = rms_norm(x, norm_weight) (rounded to x.dtype) or x; h = silu(xn @ w_gate.T) * (xn @ w_up.T)
    with fp32 accumulation and math, rounded to x.dtype; out = h @ w_down.T accumulated in fp32.
    """
    xn = rms_norm(x, norm_weight, eps)[0] if norm_weight is not None else x
    acc = _acc_dtype(x.dtype)
    g = xn.to(acc) @ w_gate.to(acc).T
    u = xn.to(acc) @ w_up.to(acc).T
    h = (F.silu(g) * u).to(x.dtype)
    return (h.to(acc) @ w_down.to(acc).T).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """q [B, H, S, D], k/v [B, Hkv, Skv, D] -> [B, H, S, D]; head h reads kv head h // (H // Hkv).

    Causal masking is aligned to the bottom-right as in FlashAttention: query i sees key j iff
    j <= i + (Skv - S). A query row that sees no key (only when S > Skv) outputs zeros.
    """
    H, S = q.shape[1], q.shape[2]
    Hkv, Skv = k.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    group = H // Hkv
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    s = (q.to(acc) @ kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(S, device=q.device)[:, None]
        j = torch.arange(Skv, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Skv - S), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows -> zeros
    return (p @ vf).to(q.dtype)
