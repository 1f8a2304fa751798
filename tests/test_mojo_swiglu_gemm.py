"""swiglu_ffn's forward on the mojo backend from SW_TC_MIN_T tokens on, where the Mojo op has no tensor-core
path of its own: torch GEMMs around the Mojo norm (MojoBackend._swiglu_ffn_forward_gemm).

    pytest tests/test_mojo_swiglu_gemm.py [--device cuda]

On the GPU that path is the default for every (D, F) but _STATIC_DF's in bf16; on the CPU the Mojo op's
own loops run, so these tests switch the path on for the CPU too (FFN_GEMM_DEVICES) and check it against
the float64 reference and, for the gradients, against the torch backend (the backward is the same code
either way: what it reads is the gu this forward saved).
"""

from __future__ import annotations

import pytest
import torch

import fusekit.backends.mojo as mojo_backend
from fusekit import backends, ops
from fusekit.ops.swiglu_ffn import reference_forward
from fusekit.tolerances import rtol


@pytest.fixture(autouse=True)
def _gemm_path_here(monkeypatch: pytest.MonkeyPatch, device: str):
    why = backends.available()["mojo"]
    if why is not None:
        pytest.skip(f"the mojo backend is not installed: {why}")
    monkeypatch.setattr(mojo_backend, "FFN_GEMM_DEVICES", ("cuda", "cpu"))
    calls: list[int] = []
    real = mojo_backend.MojoBackend._swiglu_ffn_forward_gemm

    def spy(self, *args):
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(mojo_backend.MojoBackend, "_swiglu_ffn_forward_gemm", spy)
    return calls


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_forward_and_gradients(dtype, norm, device, _gemm_path_here) -> None:
    g = torch.Generator(device="cpu").manual_seed(11)
    t, d, f = 37, 64, 96  # T >= SW_TC_MIN_T (16); D, F outside _STATIC_DF

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x, wg, wu, wd = r(t, d), r(f, d, scale=0.1), r(f, d, scale=0.1), r(d, f, scale=0.1)
    nw = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype) if norm else None
    leaves = [v.clone().requires_grad_() for v in (x, wg, wu, wd)]
    y = ops.swiglu_ffn(*leaves, norm_weight=nw, backend="mojo")
    assert _gemm_path_here == [1]
    want = reference_forward(
        *(v.double() for v in (x, wg, wu, wd)), None if nw is None else nw.double(), 1e-6
    )[0]
    tol = rtol("swiglu_ffn", dtype)
    assert _rel(y, want) <= tol, f"forward {_rel(y, want):.2e} > {tol:.0e}"
    dy = r(t, d)
    got = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [v.double().requires_grad_() for v in (x, wg, wu, wd)]
    y_ref = ops.swiglu_ffn(*ref_leaves, norm_weight=None if nw is None else nw.double(), backend="torch")
    ref = torch.autograd.grad(y_ref, ref_leaves, dy.double())
    gtol = rtol("swiglu_ffn", dtype, "backward")
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), got, ref):
        assert _rel(a, b) <= gtol, f"{name} {_rel(a, b):.2e} vs float64 > {gtol:.0e}"


def test_short_inputs_keep_the_mojo_op(device, _gemm_path_here) -> None:
    """Below SW_TC_MIN_T tokens (decode) the Mojo op's GEMV kernels run, not the GEMM path."""
    x = torch.randn(4, 64, device=device)
    w = torch.randn(96, 64, device=device) * 0.1
    ops.swiglu_ffn(x, w, w, torch.randn(64, 96, device=device) * 0.1, backend="mojo")
    assert _gemm_path_here == []


def test_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which path a forward takes: the GEMM path for prefill on a GPU (the wgmma op for bf16 prefill at a
    static pair only when FUSEKIT_MOJO_FFN_TC=1), the Mojo op (GEMV kernels; the CPU's loops) for decode and
    on the CPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def route(device, t, d, f, dtype=torch.bfloat16) -> str:
        x = torch.empty(t, d, dtype=dtype, device="meta")
        return mojo_backend.ffn_route(device, x, torch.empty(f, d, dtype=dtype, device="meta"))

    monkeypatch.delenv(mojo_backend.FFN_TC_ENV, raising=False)
    assert route(cuda, 32, 4096, 11008) == "gemm"
    monkeypatch.setenv(mojo_backend.FFN_TC_ENV, "1")
    assert route(cuda, 32, 4096, 11008) == "tc"
    assert route(cuda, 32, 4096, 14336) == "gemm"  # not a static pair
    monkeypatch.delenv(mojo_backend.FFN_TC_ENV)
    assert route(cuda, 15, 4096, 11008) == "op"
    assert route(cuda, 32, 4096, 11008, torch.float16) == "gemm"
    assert route(cuda, 2048, 4096, 14336) == "gemm"
    assert route(cpu, 2048, 4096, 14336) == "gemm"  # FFN_GEMM_DEVICES includes the CPU in this module
    mojo_backend.FFN_GEMM_DEVICES = ("cuda",)
    assert route(cpu, 2048, 4096, 14336) == "op"


def test_tc_route_needs_aligned_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opt-in wgmma route hands the caller's weights to MAX's sm90 matmul, whose TMA descriptors need
    16-byte aligned bases (it checks none): a contiguous weight view at an odd element offset (2 bytes in)
    takes the GEMM route instead, whichever weight it is."""
    cuda = torch.device("cuda")
    bf = torch.bfloat16
    t, d, f = 32, 4096, 11008

    def meta(rows: int, cols: int, off: int = 0) -> torch.Tensor:  # meta: data_ptr() is the byte offset
        return torch.empty(rows * cols + off, dtype=bf, device="meta")[off:].view(rows, cols)

    x = meta(t, d)
    monkeypatch.setenv(mojo_backend.FFN_TC_ENV, "1")
    assert mojo_backend.ffn_route(cuda, x, meta(f, d)) == "tc"
    assert mojo_backend.ffn_route(cuda, x, meta(f, d, 1)) == "gemm"  # w_gate 2 bytes into its storage
    assert mojo_backend.ffn_route(cuda, x, meta(f, d), (meta(f, d), meta(d, f))) == "tc"
    assert mojo_backend.ffn_route(cuda, x, meta(f, d, 8), (meta(f, d), meta(d, f))) == "tc"  # 16 bytes in
    for odd in range(3):
        ws = [meta(f, d), meta(f, d), meta(d, f)]
        ws[odd] = meta(*ws[odd].shape, 1)
        assert mojo_backend.ffn_route(cuda, x, ws[0], tuple(ws[1:])) == "gemm", f"weight {odd} misaligned"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_h_is_the_backward_h(dtype, device, _gemm_path_here) -> None:
    """The GEMM path's h comes from the backward's element-wise op without gradients (grads = 0): the same
    bits as the h that op recomputes with them, from the same gu; dg and du are left alone (dummies); and an
    inference call (scratch gu) gives the training call's y."""
    from fusekit.backends.mojo.specs import SWIGLU_FFN_BACKWARD

    be = backends.get("mojo")
    g = torch.Generator(device="cpu").manual_seed(5)
    t, f, d = 19, 40, 24
    gu = (torch.randn(t, 2 * f, generator=g) * 3).to(device=device, dtype=dtype)
    dh = torch.randn(t, f, generator=g).to(device=device, dtype=dtype)
    x = torch.randn(t, d, generator=g).to(device=device, dtype=dtype)
    h1, h2, dg, du = (torch.full((t, f), float("nan"), device=device, dtype=dtype) for _ in range(4))
    be._call(SWIGLU_FFN_BACKWARD, torch.device(device), (h1, dg, du, None), (dh, gu, x, None, None), ())
    be._call(SWIGLU_FFN_BACKWARD, torch.device(device), (h2, None, None, None), (None, gu, x, None, None), ())
    assert torch.equal(h1, h2) and not h2.isnan().any()
    gf, uf = gu[:, :f].double(), gu[:, f:].double()
    assert _rel(h2, gf * torch.sigmoid(gf) * uf) <= rtol("swiglu_ffn", dtype)
    w = [
        (torch.randn(*s, generator=g) * 0.1).to(device=device, dtype=dtype) for s in ((f, d), (f, d), (d, f))
    ]
    xs = torch.randn(t, d, generator=g).to(device=device, dtype=dtype)
    leaves = [v.clone().requires_grad_() for v in (xs, *w)]
    y = ops.swiglu_ffn(*leaves, backend="mojo")
    with torch.no_grad():
        y0 = ops.swiglu_ffn(xs, *w, backend="mojo")
    assert torch.equal(y0, y.detach())
    assert _gemm_path_here == [1, 1]
