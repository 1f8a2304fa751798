"""A compiled graph's fusekit calls skip torch.library's Python layers (library/lean_dispatch.py), and
every call that needs those layers (a gradient to record, fake tensors, tracing) still gets them."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fusekit.library.autograd as lib_autograd
from fusekit import ops
from fusekit.library import lean_dispatch

pytestmark = pytest.mark.skipif(lean_dispatch._tools() is None, reason="this torch lacks the internals")


def _inputs(device: str, grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 64, generator=g).to(device).requires_grad_(grad)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(device).requires_grad_(grad)
    dy = torch.randn(6, 64, generator=g).to(device)
    return x, w, dy


def _aliasing_checks(monkeypatch) -> list[str]:
    """Names of the custom ops whose standard backend wrapper ran (it checks output aliasing)."""
    import torch._library.utils as lib_utils

    seen: list[str] = []
    real = lib_utils._c_check_aliasing_constraint

    def spy(name, *args, **kwargs):
        seen.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(lib_utils, "_c_check_aliasing_constraint", spy)
    return seen


def test_every_custom_op_has_the_lean_kernel() -> None:
    """Each registered op's forward custom op, and its backward's where it has one, route plain calls."""
    from fusekit.library.autograd import specs

    want = set()
    for name, spec in specs().items():
        want.add(name)
        if spec.backward is not None:
            want.add(f"{name}_backward")
    assert want and want <= lean_dispatch.INSTALLED


def test_compiled_forward_and_backward_take_the_lean_kernel(backend, device, monkeypatch) -> None:
    assert {"rms_norm", "rms_norm_backward"} <= lean_dispatch.INSTALLED
    x, w, dy = _inputs(device, grad=True)
    y_ref = ops.rms_norm(x, w, backend=backend)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), dy)

    def f(x, w):
        return ops.rms_norm(x, w, backend=backend)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    compiled(x, w)  # compile (tracing goes through the standard kernels)
    seen = _aliasing_checks(monkeypatch)
    y = compiled(x, w)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    assert [
        n for n in seen if n.startswith("rms_norm")
    ] == []  # neither phase went through custom_op's wrapper
    # the same kernels as the eager path, so the same bits
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)


def test_inference_mode_calls_skip_the_custom_op_wrapper(backend, device, monkeypatch) -> None:
    """Under inference_mode (no autograd keys) a call reaches fusekit's implementation as the op's own
    CPU/CUDA kernel, not through custom_op's backend wrapper."""
    x, w, _ = _inputs(device, grad=False)
    want = ops.rms_norm(x, w, eps=1e-6, casting="llama", backend=backend)
    seen = _aliasing_checks(monkeypatch)
    with torch.inference_mode():
        y = torch.ops.fusekit.rms_norm(x, None, w, 1e-6, "llama", backend, False)[0]
    assert [n for n in seen if n.startswith("rms_norm")] == []
    assert torch.equal(y, want)


def test_calls_that_record_a_gradient_keep_the_custom_op_autograd(backend, device) -> None:
    x, w, dy = _inputs(device, grad=True)
    y = torch.ops.fusekit.rms_norm(x, None, w, 1e-6, "llama", backend, True)[0]
    assert y.grad_fn is not None
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    y_ref = ops.rms_norm(x, w, eps=1e-6, casting="llama", backend=backend)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)


def test_fake_tensors_never_reach_the_kernels(backend, device, monkeypatch) -> None:
    """Under a dispatch mode (FakeTensorMode, what tracing uses) a call goes to the fake implementation;
    a plain call without grad goes to fusekit's implementation directly."""
    calls = []
    real = lib_autograd.run

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(lib_autograd, "run", counting)
    x, w, _ = _inputs(device, grad=False)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        out = torch.ops.fusekit.rms_norm(fx, None, fw, 1e-6, "llama", backend, False)
    assert calls == [] and out[0].shape == x.shape
    with torch.no_grad():
        y = torch.ops.fusekit.rms_norm(x, None, w, 1e-6, "llama", backend, False)[0]
    assert calls == ["forward"]
    assert torch.equal(y, ops.rms_norm(x, w, eps=1e-6, casting="llama", backend=backend))
