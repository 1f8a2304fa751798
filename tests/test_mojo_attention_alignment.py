"""Mojo attention on misaligned views: a contiguous q / k / v one element into its storage (what slicing a
packed buffer gives) must not reach the kernels that read in 16-byte chunks (cp.async) or 4-byte pairs.

    pytest tests/test_mojo_attention_alignment.py [--device cuda]

On CUDA those calls take the kernels that need no alignment (mojo/attention.mojo `fa2_aligned`,
`tc_aligned`; the decode path's `vec` and q check), with the values of the same call on aligned copies
(within the tolerance of two different kernels); on the CPU both run one kernel, so the misaligned
call is also checked against the float64 oracle (the aligned comparison alone passed a kernel whose every
output was 1.5x too large).
"""

from __future__ import annotations

import pytest
import torch
from cases import attention as attention_case

from fusekit import backends, ops
from fusekit.tolerances import rtol


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values, contiguous, one element past its storage's (512-byte aligned) start."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


# decode (S 1: the split-KV kernels; S 16: 64 rows of GQA 4), prefill (the flash-attention kernel)
CASES = [(1, 300, 8, 2), (16, 200, 16, 4), (37, 45, 4, 2)]


@pytest.mark.parametrize(("s", "skv", "h", "hkv"), CASES)
def test_misaligned_views_match_aligned(s: int, skv: int, h: int, hkv: int, device: str) -> None:
    why = backends.available()["mojo"]
    if why is not None:
        pytest.skip(f"the mojo backend is not installed: {why}")
    dt = torch.float16 if device == "cuda" else torch.float32
    tol = 1e-2 if dt == torch.float16 else 1e-4
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape, generator=g).to(device, dt)
        for shape in ((2, h, s, 64), (2, hkv, skv, 64), (2, hkv, skv, 64))
    )
    do = torch.randn(2, h, s, 64, generator=g).to(device, dt)

    def run(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = [t.detach().requires_grad_() for t in (qq, kk, vv)]
        o = ops.attention(*leaves, causal=True, backend="mojo")
        return (o.detach(), *torch.autograd.grad(o, leaves, do))

    ref = run(q, k, v)
    mis = [_misaligned(t) for t in (q, k, v)]
    if device == "cuda":
        assert all(t.data_ptr() % 4 != 0 for t in mis)
    got = run(*mis)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    (o64,) = attention_case.oracle(*leaves, causal=True)
    want = (o64.detach(), *torch.autograd.grad(o64, leaves, do.cpu().double()))
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        err = ((a.cpu().double() - w).norm() / w.norm()).item()
        bound = rtol("attention", dt, "forward" if name == "o" else "backward")
        assert err <= bound, f"{name}: relative error {err:.2e} > {bound:.1e} against float64"
