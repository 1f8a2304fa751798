"""Triton reduce_sum is deterministic by default (issue #13): no atomics, bit-identical repeats."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
rs = pytest.importorskip("kernels_triton.reduce_sum")


def test_forward_never_uses_atomics(monkeypatch, device):
    seen: list[bool] = []
    real = rs._split_kernel

    class Spy:
        def __getitem__(self, grid):
            launch = real[grid]

            def run(*args, **kw):
                seen.append(bool(kw.get("ATOMIC")))
                return launch(*args, **kw)

            return run

    monkeypatch.setattr(rs, "_split_kernel", Spy())
    monkeypatch.setattr(rs, "_plan", lambda M, N, elsize, dev: ("split", 4))  # what a GPU picks at 2^30
    x = torch.randn(1, 1 << 14, generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.full((1,), float("nan"), device=device)
    rs.forward(out, x)
    torch.testing.assert_close(out.double(), x.double().sum(-1), rtol=1e-5, atol=1e-3)
    assert seen and not any(seen), "the split mode used atomics"


def test_repeats_are_bit_identical(device):
    x = torch.randn(3, 40000, generator=torch.Generator().manual_seed(2)).to(device)
    outs = []
    for _ in range(5):
        out = torch.full((3,), float("nan"), device=device)
        rs.reduce_sum(out, x, deterministic=True, _mode="split", _split=7)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
