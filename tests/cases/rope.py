"""rope cases: [B, S, H, D], start positions or per-token `positions` ([B, S] with different rows, as a
left-padded batch; [S], broadcast over B), halves/interleaved, in-kernel angles or tables."""

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
# positions: "rows" ([B, S] int64, a different run per sequence, left padding at position 1 as HF's
# position_ids have it) or "shared" ([S] int32, out of order, repeats).
_CPU_POS = [
    ((2, 5, 3, 8), "rows"),
    ((3, 7, 2, 64), "shared"),
    ((3, 6, 3, 12), "rows"),
    ((2, 9, 1, 16), "shared"),
]
_CUDA_POS = [((4, 512, 32, 128), "rows"), ((2, 1024, 8, 96), "shared")]
CPU += [
    {"shape": s, "start_pos": 0, "positions": kind, "interleaved": il, "tables": tb}
    for s, kind in _CPU_POS
    for il in (False, True)
    for tb in (False, True)
]
CUDA += [
    {"shape": s, "start_pos": 0, "positions": kind, "interleaved": False, "tables": tb}
    for s, kind in _CUDA_POS
    for tb in (False, True)
]

# q and k in one call (HF's apply_rotary_pos_emb(q, k, ...)): k [B, S, Hk, D] with its own head count.
CPU += [
    {"shape": s, "start_pos": p, "k_heads": hk, "interleaved": il, "tables": tb}
    for s, p, hk in (((2, 5, 3, 8), 0, 1), ((1, 7, 4, 64), 13, 6), ((2, 33, 5, 128), 3, 2))
    for il in (False, True)
    for tb in (False, True)
]
CPU += [{"shape": (3, 6, 3, 12), "start_pos": 0, "positions": "rows", "k_heads": 2, "interleaved": False,
         "tables": True}]  # fmt: skip
CUDA += [
    {"shape": s, "start_pos": p, "k_heads": hk, "interleaved": False, "tables": tb}
    for s, p, hk in (((2, 512, 32, 128), 5, 8), ((3, 77, 40, 96), 0, 5), ((1, 1, 32, 128), 2047, 8))
    for tb in (False, True)
]


def _angles(positions: torch.Tensor, d: int, theta: float) -> torch.Tensor:
    inv = theta ** (-(2.0 * torch.arange(d // 2, dtype=F64, device=positions.device)) / d)
    return positions.to(F64)[:, None] * inv[None, :]


def _positions(kind: str, b: int, s: int, device: str) -> torch.Tensor:
    if kind == "shared":  # out of order, with repeats
        return ((torch.arange(s) * 7) % 23 + 2).to(device=device, dtype=torch.int32)
    rows = []
    for i in range(b):  # sequence i: i + 1 left-padding tokens at position 1, then 0, 1, ... (+ 5 i)
        pad = min(i + 1, s)
        row = torch.arange(s) - pad + 5 * i
        row[:pad] = 1
        rows.append(row.clamp(min=0))
    return torch.stack(rows).to(device=device, dtype=torch.int64)


def make(case: dict, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    shape, start = case["shape"], case["start_pos"]
    x = randn(*shape, dtype=dtype, device=device)
    theta = 500000.0 if shape[-1] >= 128 else 10000.0
    kwargs = {"start_pos": start, "theta": theta, "interleaved": case["interleaved"]}
    rows = start + shape[1]
    if case.get("positions"):
        kwargs["positions"] = _positions(case["positions"], shape[0], shape[1], device)
        rows = int(kwargs["positions"].max()) + 1 if kwargs["positions"].numel() else 0
    if case["tables"]:  # tables longer than needed, read from row start_pos (or the positions)
        ang = _angles(torch.arange(rows + 5, device=device), shape[-1], theta)
        kwargs["cos"], kwargs["sin"] = torch.cos(ang).float(), torch.sin(ang).float()
    if case.get("k_heads"):
        kwargs["k"] = randn(shape[0], shape[1], case["k_heads"], shape[3], dtype=dtype, device=device)
    return (x,), kwargs


def oracle(x, start_pos=0, theta=10000.0, interleaved=False, cos=None, sin=None, positions=None, k=None):
    args = (start_pos, theta, interleaved, cos, sin, positions)
    return _rotate(x, *args) if k is None else (*_rotate(x, *args), *_rotate(k, *args))


def _rotate(x, start_pos, theta, interleaved, cos, sin, positions):
    B, S, D = x.shape[0], x.shape[1], x.shape[3]
    half = D // 2
    if positions is None:
        pos = torch.arange(start_pos, start_pos + S, device=x.device).repeat(B, 1)
    else:  # [B, S], or [S] for every sequence
        pos = positions.to(torch.int64).expand(B, S)
    if cos is None:
        ang = _angles(pos.reshape(-1), D, theta).reshape(B, S, half)
        c, s = torch.cos(ang), torch.sin(ang)
    else:
        c, s = cos.to(F64)[pos], sin.to(F64)[pos]  # [B, S, D/2]: row p of the tables
    xd = x.to(F64)
    idx = torch.arange(half, device=x.device)
    i0, i1 = (2 * idx, 2 * idx + 1) if interleaved else (idx, idx + half)
    a, b = xd[..., i0], xd[..., i1]
    c, s = c[:, :, None, :], s[:, :, None, :]
    y = torch.zeros_like(xd)
    y = y.index_copy(-1, i0, a * c - b * s)
    y = y.index_copy(-1, i1, a * s + b * c)
    return (y,)
