"""function_apply.applier: the same results and errors as torch.autograd.Function.apply."""

from __future__ import annotations

import pytest
import torch

from fusekit.library.function_apply import applier


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, k: float) -> torch.Tensor:
        ctx.save_for_backward(w)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (w,) = ctx.saved_tensors
        return g * w * ctx.k, None, None


class _WithSetup(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def test_same_output_and_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g, requires_grad=True)
    w = torch.randn(7, generator=g)
    y = applier(_Scale)(x, w, 0.5)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_ScaleBackward"
    (gx,) = torch.autograd.grad(y.sum(), x)
    y2 = _Scale.apply(x, w, 0.5)
    (gx2,) = torch.autograd.grad(y2.sum(), x)
    assert torch.equal(y, y2) and torch.equal(gx, gx2)
    with torch.no_grad():
        assert applier(_Scale)(x, w, 0.5).grad_fn is None


def test_functorch_transform_defers_to_function_apply() -> None:
    """Under torch.func.grad a Function without setup_context raises, through applier as through apply."""
    x, w = torch.randn(3), torch.randn(3)
    with pytest.raises(RuntimeError, match="setup_context") as via_apply:
        torch.func.grad(lambda t: _Scale.apply(t, w, 2.0).sum())(x)
    with pytest.raises(RuntimeError, match="setup_context") as via_applier:
        torch.func.grad(lambda t: applier(_Scale)(t, w, 2.0).sum())(x)
    assert str(via_apply.value) == str(via_applier.value)


def test_a_function_with_setup_context_keeps_torchs_apply() -> None:
    assert applier(_WithSetup) == _WithSetup.apply
    x = torch.randn(4, requires_grad=True)
    assert torch.equal(torch.func.grad(lambda t: applier(_WithSetup)(t).sum())(x), torch.full((4,), 2.0))
