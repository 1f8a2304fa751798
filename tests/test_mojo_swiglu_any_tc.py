"""swiglu_ffn's dynamic-shape tensor-core path on the mojo backend (mojo/swiglu_ffn.mojo _ffn_tc_any),
opted in with FUSEKIT_MOJO_FFN_ANY_TC=1 (default off: it has not run on a GPU yet).

On the CPU: the workspace plan (specs._ffn_plan) with the variable off is today's, and with it on sizes
g / h / out_pad for every bf16/fp16 (D, F) with D and F multiples of ANY_TC_ALIGN on NVIDIA from TC_MIN_T
tokens (the g size is what makes the kernel take the path); the mirrored constant matches the kernel's.
On CUDA (`--device cuda`): the op against a float64 oracle and against the GEMV path (variable off),
forward and backward (the forward saves gu for it), at Llama-3-8B's (D, F) and small shapes. Each test
sets and clears the variable itself (monkeypatch), so it need not be in the environment:

    python -m pytest tests/test_mojo_swiglu_any_tc.py --device cuda --backends mojo
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fusekit.backends.mojo import specs

MOJO = Path(__file__).resolve().parents[1] / "mojo"
ENV = "FUSEKIT_MOJO_FFN_ANY_TC"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _sizes(t: int, d: int, f: int, dtype: torch.dtype) -> dict[str, int]:
    ms = specs.phase_spec("swiglu_ffn", "forward")
    ins = (_meta(t, d, dtype=dtype), _meta(f, d, dtype=dtype))
    return {w.name: w.size((), ins, 132) for w in ms.workspaces}


def _need(t: int, d: int, f: int, dtype: torch.dtype, nvidia: bool, any_tc: bool) -> dict[str, int]:
    """mojo/swiglu_ffn.mojo swiglu_ffn_gpu_save: _ffn_tc for _STATIC_DF (bf16), _ffn_tc_any (bf16/fp16, D and
    F multiples of 128) when opted in, else the GEMV path; execute takes _ffn_tc_any iff g >= Tp * F."""
    tp = _cdiv(t, 256) * 256
    need = {"xn": (tp if t >= 16 else t) * d, "h": min(t, 16) * f, "g": 0, "out_pad": 0}
    static = dtype == torch.bfloat16 and (d, f) == (4096, 11008)
    dyn = any_tc and dtype in (torch.bfloat16, torch.float16) and d % 128 == 0 and f % 128 == 0
    if nvidia and t >= 16 and (static or dyn):
        need.update(h=tp * f, g=tp * f, out_pad=tp * d)
    return need


def test_align_mirrors_the_kernel() -> None:
    m = re.search(r"^comptime ANY_TC_ALIGN = (\d+)", (MOJO / "swiglu_ffn.mojo").read_text(), flags=re.M)
    assert m and int(m.group(1)) == specs.SW_ANY_TC_ALIGN


@pytest.mark.parametrize("on", (False, True), ids=("default", "any_tc"))
@pytest.mark.parametrize("hip", (False, True), ids=("nvidia", "amd"))
def test_workspace_plan(on: bool, hip: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2" if hip else None)
    if on:
        monkeypatch.setenv(ENV, "1")
    else:
        monkeypatch.delenv(ENV, raising=False)
    shapes = ((4096, 11008), (4096, 14336), (3584, 18944), (8192, 28672), (256, 768), (256, 704), (64, 96))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for d, f in shapes:
            for t in (1, 15, 16, 17, 37, 255, 256, 257, 2048):
                assert _sizes(t, d, f, dtype) == _need(t, d, f, dtype, not hip, on), (t, d, f, dtype)


def test_only_1_switches_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    for value, on in (("0", False), ("", False), ("true", False), ("1", True)):
        monkeypatch.setenv(ENV, value)
        assert (_sizes(64, 256, 768, torch.bfloat16)["g"] > 0) is on, value


# --- on a GPU ---------------------------------------------------------------------------------------
def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _oracle(x, wg, wu, wd, nw, eps=1e-6):
    xd = x.double()
    rstd = 1.0 / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)
    xn = xd * rstd * nw.double()
    h = torch.nn.functional.silu(xn @ wg.double().T) * (xn @ wu.double().T)
    return h @ wd.double().T


@pytest.fixture
def cuda_mojo(device: str) -> None:
    if device != "cuda":
        pytest.skip("GPU checks: run with --device cuda")
    from fusekit import backends

    why = backends.available()["mojo"]
    if why is not None:
        pytest.skip(f"the mojo backend is not installed: {why}")


TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize(
    "t, d, f",
    [
        (16, 256, 768),
        (37, 384, 640),
        (2048, 256, 768),
        (16, 4096, 14336),
        (37, 4096, 14336),
        (2048, 4096, 14336),
    ],
)
def test_forward_and_backward_on_cuda(
    t: int, d: int, f: int, dtype: torch.dtype, cuda_mojo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fusekit import ops

    g = torch.Generator(device="cuda").manual_seed(t + d + f)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale + shift).to(dtype)

    x = rnd(t, d)
    wg, wu = rnd(f, d, scale=d**-0.5), rnd(f, d, scale=d**-0.5)
    wd = rnd(d, f, scale=f**-0.5)
    nw = rnd(d, scale=0.1, shift=1.0)
    dy = rnd(t, d)

    def run(on: bool):
        if on:
            monkeypatch.setenv(ENV, "1")
        else:
            monkeypatch.delenv(ENV, raising=False)
        xs = [a.detach().clone().requires_grad_(True) for a in (x, wg, wu, wd, nw)]
        y = ops.swiglu_ffn(xs[0], xs[1], xs[2], xs[3], norm_weight=xs[4], backend="mojo")
        y.backward(dy)
        torch.cuda.synchronize()
        return y.detach(), [a.grad for a in xs]

    monkeypatch.delenv(ENV, raising=False)  # the caller's environment may have it on
    assert _sizes(t, d, f, dtype)["g"] == 0  # variable off: the GEMV path
    y_gemv, grads_gemv = run(False)
    y_tc, grads_tc = run(True)
    assert _sizes(t, d, f, dtype)["g"] == _cdiv(t, 256) * 256 * f  # the path is taken
    tol = TOL[dtype]
    want = _oracle(x, wg, wu, wd, nw)
    assert torch.isfinite(y_tc).all()
    assert _rel(y_tc, want) <= tol, (_rel(y_tc, want), _rel(y_gemv, want))
    assert _rel(y_tc, y_gemv) <= tol
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down", "norm_weight"), grads_tc, grads_gemv):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) <= 2 * tol, (name, _rel(a, b))
