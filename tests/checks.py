"""Shared numeric checks for the test suites: one relative-error measure, one assertion with repro."""

from __future__ import annotations

import torch


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (the plain norm of out − ref when ref is all zeros); NaN fails."""
    o, r = out.to(torch.float64), ref.to(torch.float64)
    assert not torch.isnan(o).any(), "output has unwritten (NaN) elements"
    denom = torch.linalg.vector_norm(r).item()
    return torch.linalg.vector_norm(o - r).item() / (denom if denom > 0 else 1.0)


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float, repro: str) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)} [{repro}]"
    if not out.dtype.is_floating_point:
        bad = (out.to(torch.int64) != ref).nonzero()
        assert bad.numel() == 0, (
            f"{name}: {len(bad)} integer mismatches, first at {bad[:3].tolist()} [{repro}]"
        )
        return
    o, r = out.to(torch.float64), ref.to(torch.float64)
    unwritten = torch.isnan(o) & ~torch.isnan(r)
    assert not unwritten.any(), (
        f"{name}: {int(unwritten.sum())} elements NaN (unwritten or overflow), first at "
        f"{unwritten.nonzero()[:3].tolist()} [{repro}]"
    )
    if r.numel() == 0:
        return
    err = rel_error(o, r)
    if not err <= tol:
        worst = (o - r).abs().flatten().argmax().item()
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {tol:.1e}; worst element {worst}: "
            f"{o.flatten()[worst].item()} vs {r.flatten()[worst].item()} [{repro}]"
        )
