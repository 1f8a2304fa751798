"""Forward/backward entry points (CONTRACT.md) of the Triton rope, reduce_sum and swiglu_ffn kernels, on the
CPU interpreter at small, odd shapes.

Self-contained: TRITON_INTERPRET=1 is set before torch/triton are imported, every output is poisoned with
NaN, and results are compared by relative 2-norm error with float64 computations of the contract's math
(swiglu_ffn gradients: float64 autograd). Tolerances are the contract's (gradients 2x).
The FFN's GEMM kernels run in fp16/fp32 here (their bf16 runs in test_triton_mm_modes; the FFN backward's
GEMMs are torch.matmul, so its bf16 case runs, from float64-derived saved tensors); bf16 results are compared
within tolerance, never bit for bit.
"""

import math
import os

import pytest

# CPU interpreter only: tests/conftest.py sets TRITON_INTERPRET=1 for --device cpu before triton is
# imported. Setting it here would switch a whole `--device cuda` process (every xdist worker collects
# this file) into the interpreter.
from kernels_triton._config import is_interpreter

if not is_interpreter():
    pytest.skip("CPU interpreter tests (run with --device cpu)", allow_module_level=True)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import torch
import torch.nn.functional as Fn
from checks import rel_error

pytest.importorskip("triton")

from fusekit.tolerances import GRAD_FACTOR, RTOL, rtol
from kernels_triton import reduce_sum as RS
from kernels_triton import rope as RP
from kernels_triton import swiglu_ffn as FFN

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

TOL = RTOL  # fusekit.tolerances: the one table
ROPE_TOL = {d: rtol("rope", d) for d in (F32, F16, BF16)}  # fp32 wider: angles formed in fp32
GRAD = GRAD_FACTOR  # gradients stack two roundings (CONTRACT.md)


def _randn(
    *shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale + shift).to(dtype)


def _nan_like(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else torch.full_like(t, float("nan"))


# ---------------------------------------------------------------------------------------------- rope
def _rotate64(x: torch.Tensor, ang: torch.Tensor, interleaved: bool, sign: float) -> torch.Tensor:
    """x [B, S, H, D] rotated by sign * ang [S, D/2] (float64)."""
    xd = x.to(F64)
    c, s = ang.cos()[None, :, None, :], sign * ang.sin()[None, :, None, :]
    D = x.shape[-1]
    if interleaved:
        a, b = xd[..., 0::2], xd[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    a, b = xd[..., : D // 2], xd[..., D // 2 :]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


def _angles64(positions: torch.Tensor, D: int, theta: float) -> torch.Tensor:
    inv = theta ** (-torch.arange(D // 2, dtype=F64) * 2 / D)
    return positions.to(F64)[:, None] * inv[None, :]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("D", [32, 24], ids=["d32", "d24-gather"])  # 24: the non-power-of-two gather kernel
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "inter"])
@pytest.mark.parametrize("tables", [False, True], ids=["theta", "tables"])
@pytest.mark.parametrize("start_pos", [0, 13])
def test_rope_forward_backward(
    dtype: torch.dtype, D: int, interleaved: bool, tables: bool, start_pos: int
) -> None:
    B, S, H, theta = 2, 7, 3, 10000.0
    x = _randn(B, S, H, D, dtype=dtype, seed=D + start_pos)
    dy = _randn(B, S, H, D, dtype=dtype, seed=D + start_pos + 1)
    ang = _angles64(torch.arange(start_pos, start_pos + S), D, theta)
    cos = sin = None
    if tables:  # St > start_pos + S rows: the kernel must read rows start_pos .. start_pos + S - 1
        full = _angles64(torch.arange(start_pos + S + 3), D, theta)
        cos, sin = full.cos().float(), full.sin().float()
    y = torch.full_like(x, float("nan"))
    RP.forward(y, None, x, cos, sin, None, None, start_pos, theta, interleaved)
    assert rel_error(y, _rotate64(x, ang, interleaved, 1.0)) <= ROPE_TOL[dtype]
    dx = torch.full_like(dy, float("nan"))
    RP.backward(dx, None, dy, cos, sin, None, None, start_pos, theta, interleaved)
    assert rel_error(dx, _rotate64(dy, ang, interleaved, -1.0)) <= GRAD * ROPE_TOL[dtype]


@pytest.mark.parametrize("start_pos", [(1 << 24) - 5, (1 << 31) - 4], ids=["2^24-S", "2^31-4"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "inter"])
def test_rope_large_positions_match_float64_angles(start_pos: int, interleaved: bool) -> None:
    """Pairs (1, 0) make the kernel write (cos, sin) of its fp32 angle (backward: (cos, -sin)). Each must lie
    within the fp32 formation error of the float64 angle pos * theta^(-2i/D): 32 units of 2^-24 of the
    angle (the position and the step rounded to fp32, exp2 of an argument up to log2(theta) ~ 20) — a
    bound that is tight for the low frequencies, where an int32 wrap of start_pos + s (2^31 - 4 with s >= 4:
    the sine's sign flips) errs by up to 2. Validation stops start_pos + S at 2^24; the kernel stays right
    beyond."""
    B, S, H, D, theta = 1, 8, 2, 64, 1.0e6
    x = torch.zeros(B, S, H, D)
    if interleaved:
        x[..., 0::2] = 1.0
    else:
        x[..., : D // 2] = 1.0
    ang = _angles64(torch.arange(start_pos, start_pos + S, dtype=torch.int64), D, theta)  # [S, D/2]
    bound = ang.abs() * 32 * 2.0**-24 + 1e-6
    for sign, fn in ((1.0, RP.forward), (-1.0, RP.backward)):
        out = torch.full_like(x, float("nan"))
        fn(out, None, x, None, None, None, None, start_pos, theta, interleaved)
        a, b = (out[..., 0::2], out[..., 1::2]) if interleaved else (out[..., : D // 2], out[..., D // 2 :])
        err_c = (a.to(F64) - ang.cos()[None, :, None, :]).abs()
        err_s = (b.to(F64) - sign * ang.sin()[None, :, None, :]).abs()
        assert bool((err_c <= bound[None, :, None, :]).all()), f"cos off by {float(err_c.max()):.3g}"
        assert bool((err_s <= bound[None, :, None, :]).all()), f"sin off by {float(err_s.max()):.3g}"


def test_rope_backward_inverts_forward_fp32() -> None:
    """A rotation's transpose is its inverse: backward(forward(x)) == x to fp32 rounding."""
    x = _randn(2, 9, 5, 64, dtype=F32, seed=3)
    y, z = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    RP.forward(y, None, x, None, None, None, None, 1000, 500000.0, False)
    RP.backward(z, None, y, None, None, None, None, 1000, 500000.0, False)
    assert rel_error(z, x) <= 1e-6


# ---------------------------------------------------------------------------------------------- reduce_sum
@pytest.mark.parametrize(
    "xdt,ddt", [(F32, F32), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32), (F32, BF16)], ids=str
)
@pytest.mark.parametrize("M,N", [(1, 4097), (37, 33), (5, 760)])
@pytest.mark.parametrize("narrow", [False, True], ids=["auto", "narrow"])
def test_reduce_sum_backward(xdt: torch.dtype, ddt: torch.dtype, M: int, N: int, narrow: bool) -> None:
    """dx[M, N] = dout[:, None] in x's dtype. Exact wherever the interpreter rounds like the GPU (fp32 and
    fp16 outputs, or a dout already in x's dtype); an fp32 dout into bf16 dx within bf16 rounding.
    `narrow` forces several column tiles per row, the last one partial (16 or 512 wide)."""
    block_n = (16 if N < 1000 else 512) if narrow else None
    dout = _randn(M, dtype=ddt, seed=M * N, scale=3.0)
    dx = torch.full((M, N), float("nan"), dtype=xdt)
    RS.backward(dx, dout, _block_n=block_n)
    ref = dout.to(F64)[:, None].expand(M, N)
    if xdt == BF16 and ddt != BF16:
        assert rel_error(dx, ref) <= TOL[BF16]
        assert bool((dx == dx[:, :1]).all()), "every column must hold the row's value"
    else:
        assert torch.equal(dx, dout.to(xdt)[:, None].expand(M, N))


def test_reduce_sum_forward_entry_point() -> None:
    x = _randn(37, 760, dtype=F32, seed=4)
    out = torch.full((37,), float("nan"))
    RS.forward(out, x)
    assert rel_error(out, x.to(F64).sum(-1), x.to(F64).square().sum(-1).sqrt()) <= TOL[F32]


# ---------------------------------------------------------------------------------------------- swiglu_ffn
def _ffn64(x, wg, wu, wd, nw, eps: float):
    """The contract's forward in float64 (no intermediate rounding): (y, g, u, rstd)."""
    if nw is not None:
        rstd = (x.square().mean(-1) + eps).rsqrt()
        xn = x * rstd[:, None] * nw
    else:
        rstd, xn = None, x
    g, u = xn @ wg.T, xn @ wu.T
    return (Fn.silu(g) * u) @ wd.T, g, u, rstd


def _ffn_inputs(T: int, D: int, F: int, dtype: torch.dtype, norm: str, seed: int):
    """x, w_gate, w_up, w_down, norm_weight (None, x's dtype or fp32), dy."""
    x = _randn(T, D, dtype=dtype, seed=seed)
    wg = _randn(F, D, dtype=dtype, seed=seed + 1, scale=D**-0.5)
    wu = _randn(F, D, dtype=dtype, seed=seed + 2, scale=D**-0.5)
    wd = _randn(D, F, dtype=dtype, seed=seed + 3, scale=F**-0.5)
    nw = (
        None
        if norm == "none"
        else _randn(D, dtype=F32 if norm == "w32" else dtype, seed=seed + 4, scale=0.1, shift=1.0)
    )
    dy = _randn(T, D, dtype=dtype, seed=seed + 5)
    return x, wg, wu, wd, nw, dy


def _grads64(x, wg, wu, wd, nw, dy, eps: float):
    """Float64 autograd of the contract's math: (dx, dw_gate, dw_up, dw_down, dnorm_weight or None)."""
    leaves = [None if t is None else t.detach().to(F64).requires_grad_() for t in (x, wg, wu, wd, nw)]
    y, *_ = _ffn64(*leaves, eps)
    y.backward(dy.to(F64))
    return [None if t is None else t.grad for t in leaves]


def _ffn_backward(x, wg, wu, wd, nw, dy, rstd, gu, eps: float, **kw) -> list[torch.Tensor | None]:
    grads = [_nan_like(t) for t in (x, wg, wu, wd, nw)]
    FFN.backward(*grads, dy, x, wg, wu, wd, nw, rstd, gu, eps, **kw)
    return grads


GRAD_NAMES = ("dx", "dw_gate", "dw_up", "dw_down", "dnorm_weight")


def _check_grads(got, ref, tol: float, case: str) -> None:
    for name, g, r in zip(GRAD_NAMES, got, ref):
        assert (g is None) == (r is None), f"{name}: presence [{case}]"
        if g is not None:
            err = rel_error(g, r)
            assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} [{case}]"


NORMS = ["none", "w", "w32"]  # no norm; norm weight of x's dtype; fp32 norm weight (mixed precision)


# an fp32 norm weight with fp32 x is the "w" case
TRAIN_CASES = [(n, d) for d in (F16, F32) for n in NORMS if not (d == F32 and n == "w32")]


@pytest.mark.parametrize("norm,dtype", TRAIN_CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in TRAIN_CASES])
@pytest.mark.parametrize("D,F", [(48, 40), (64, 96)], ids=["48x40", "64x96"])
@pytest.mark.parametrize("T", [1, 9, 37])  # decode (BLOCK_T 16), decode, prefill
def test_swiglu_ffn_train(T: int, D: int, F: int, norm: str, dtype: torch.dtype) -> None:
    """Forward saving gu/rstd (both checked), the inference forward, then backward from the saved tensors:
    all five gradients against float64 autograd."""
    eps = 1e-6
    x, wg, wu, wd, nw, dy = _ffn_inputs(T, D, F, dtype, norm, seed=T * 100 + D)
    case = f"T={T} D={D} F={F} norm={norm} {dtype}"
    y64, g64, u64, rstd64 = _ffn64(*(None if t is None else t.to(F64) for t in (x, wg, wu, wd, nw)), eps)

    y = torch.full((T, D), float("nan"), dtype=dtype)
    gu = torch.full((T, 2 * F), float("nan"), dtype=dtype)
    rstd = None if nw is None else torch.full((T,), float("nan"))
    FFN.forward(y, rstd, gu, x, wg, wu, wd, nw, eps)
    assert rel_error(y, y64) <= TOL[dtype], case
    assert rel_error(gu, torch.cat((g64, u64), dim=1)) <= TOL[dtype], case
    if nw is not None:
        assert rel_error(rstd, rstd64) <= 1e-6, case

    y_inf = torch.full((T, D), float("nan"), dtype=dtype)
    FFN.forward(y_inf, None, None, x, wg, wu, wd, nw, eps)
    assert rel_error(y_inf, y64) <= TOL[dtype], case

    got = _ffn_backward(x, wg, wu, wd, nw, dy, rstd, gu, eps)
    _check_grads(got, _grads64(x, wg, wu, wd, nw, dy, eps), GRAD * TOL[dtype], case)


@pytest.mark.parametrize(
    "T,kw",
    [(9, {"_path": "prefill"}), (37, {"_prologue": "fused"}), (37, {"_gemm": "tma"}), (9, {"_path": "prefill", "_gemm": "tma"}),
     (37, {"_gemm": "blas"}), (9, {"_path": "prefill", "_gemm": "blas"})],
    ids=["prefill-small-T", "fused-prologue", "tma", "tma-small-T", "blas", "blas-small-T"],
)  # fmt: skip
@pytest.mark.parametrize("norm", ["w", "w32", "none"])
def test_swiglu_ffn_save_paths(T: int, kw: dict, norm: str) -> None:
    """Every gate/up kernel that stores gu: the pointer GEMM with the materialized-xn and the fused-norm
    prologue, the TMA GEMM (two [T, F] descriptors of row stride 2F), the vendor GEMMs (torch.mm into gu's
    halves, then the element-wise h) and the decode GEMV (other test)."""
    D, F, eps = 48, 40, 1e-5
    x, wg, wu, wd, nw, _ = _ffn_inputs(T, D, F, F16, norm, seed=7 + T)
    y64, g64, u64, rstd64 = _ffn64(*(None if t is None else t.to(F64) for t in (x, wg, wu, wd, nw)), eps)
    y = torch.full((T, D), float("nan"), dtype=F16)
    gu = torch.full((T, 2 * F), float("nan"), dtype=F16)
    rstd = None if nw is None else torch.full((T,), float("nan"))
    FFN.forward(y, rstd, gu, x, wg, wu, wd, nw, eps, **kw)
    assert rel_error(y, y64) <= TOL[F16]
    assert rel_error(gu[:, :F], g64) <= TOL[F16] and rel_error(gu[:, F:], u64) <= TOL[F16]
    if nw is not None:
        assert rel_error(rstd, rstd64) <= 1e-6


def test_swiglu_ffn_save_matches_inference_bitwise() -> None:
    """Prefill: saving gu changes only the epilogue's extra stores; y is bit-identical to the inference call."""
    x, wg, wu, wd, nw, _ = _ffn_inputs(37, 64, 96, F16, "w", seed=11)
    y_inf, y_train = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    FFN.forward(y_inf, None, None, x, wg, wu, wd, nw, 1e-6)
    FFN.forward(y_train, torch.empty(37), torch.empty(37, 192, dtype=F16), x, wg, wu, wd, nw, 1e-6)
    assert torch.equal(y_inf, y_train)


def _saved_from_float64(x, wg, wu, wd, nw, eps: float):
    """rstd (fp32) and gu (x's dtype) as a training forward saves them, from the float64 forward."""
    _, g, u, rstd = _ffn64(*(None if t is None else t.to(F64) for t in (x, wg, wu, wd, nw)), eps)
    return (None if rstd is None else rstd.float()), torch.cat((g, u), dim=1).to(x.dtype)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("T", [1, 37])
def test_swiglu_ffn_backward_bf16(T: int, norm: str) -> None:
    """bf16: the backward's GEMMs are torch.matmul and its element-wise kernels run right in bf16 on the
    interpreter, so the whole backward is checked from float64-derived saved rstd/gu."""
    D, F, eps = 64, 96, 1e-6
    x, wg, wu, wd, nw, dy = _ffn_inputs(T, D, F, BF16, norm, seed=T + 50)
    rstd, gu = _saved_from_float64(x, wg, wu, wd, nw, eps)
    got = _ffn_backward(x, wg, wu, wd, nw, dy, rstd, gu, eps)
    _check_grads(got, _grads64(x, wg, wu, wd, nw, dy, eps), GRAD * TOL[BF16], f"bf16 T={T} norm={norm}")


@pytest.mark.parametrize("dtype", [F16, F32], ids=str)
@pytest.mark.parametrize("block_d", [16, 32], ids=["3-chunks", "2-chunks-tail"])
def test_swiglu_ffn_backward_chunked_norm(block_d: int, dtype: torch.dtype) -> None:
    """Rows longer than the norm kernel's register row (forced small): mean(gw * xhat) from the row-dot
    kernel, then column chunks (D = 48: 3 whole chunks of 16, or 32 + a masked tail of 16)."""
    T, D, F, eps = 37, 48, 40, 1e-6
    x, wg, wu, wd, nw, dy = _ffn_inputs(T, D, F, dtype, "w32" if dtype == F16 else "w", seed=block_d)
    rstd, gu = _saved_from_float64(x, wg, wu, wd, nw, eps)
    got = _ffn_backward(x, wg, wu, wd, nw, dy, rstd, gu, eps, _norm_block_d=block_d)
    _check_grads(got, _grads64(x, wg, wu, wd, nw, dy, eps), GRAD * TOL[dtype], f"block_d={block_d}")


def test_swiglu_ffn_backward_deterministic() -> None:
    """Two backward calls give bit-identical gradients (dnorm_weight: fixed-order partial sums)."""
    x, wg, wu, wd, nw, dy = _ffn_inputs(37, 48, 40, F16, "w32", seed=5)
    rstd, gu = _saved_from_float64(x, wg, wu, wd, nw, 1e-6)
    a = _ffn_backward(x, wg, wu, wd, nw, dy, rstd, gu, 1e-6)
    b = _ffn_backward(x, wg, wu, wd, nw, dy, rstd, gu, 1e-6)
    for name, ga, gb in zip(GRAD_NAMES, a, b):
        assert torch.equal(ga, gb), name
    assert a[4].dtype == F32 and not math.isnan(float(a[4].sum()))
