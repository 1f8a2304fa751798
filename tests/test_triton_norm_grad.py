"""The Triton norms' contract entry points, forward and backward, every launch mode forced, on the CPU
interpreter at small shapes, against float64 references written from CONTRACT.md's formulas.

Self-contained (no conftest fixtures): TRITON_INTERPRET=1 is set before torch/triton are imported, each
output is NaN-poisoned, errors are relative 2-norm errors against float64 (tests/checks.py).

Variants are spread over the modes (not a full product, to stay within ~1 minute of interpreter time):
every mode meets every dtype, both weight dtypes, residual on and off, each rms casting, bias on and off,
and odd N (1, 33, 760, 4097) with M not a multiple of any block or of the persistent grid (the interpreter
stands in 4 SMs, so persistent grids are progs x 4 programs).

On the interpreter fp32 -> bf16 casts truncate (GPU: round to nearest even), so bf16 outputs err by up to
one bf16 ulp more than on a GPU: still inside the contract's bf16 tolerance, but h = x + residual is
compared exactly only for fp32/fp16.
"""

import os

import pytest

# CPU interpreter only (tests/conftest.py sets TRITON_INTERPRET=1 for --device cpu before triton is
# imported); setting it here would switch a whole --device cuda process into the interpreter.
from kernels_triton._config import is_interpreter

if not is_interpreter():
    pytest.skip("CPU interpreter tests (run with --device cpu)", allow_module_level=True)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


import torch
from checks import rel_error

pytest.importorskip("triton")

from fusekit.tolerances import RTOL
from kernels_triton import _norm_bwd
from kernels_triton import layer_norm as ln
from kernels_triton import rms_norm as rms

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

TOL = RTOL  # fusekit.tolerances: the one table; gradients get GRAD_FACTOR (2x) of it
STAT_TOL = 1e-5  # fp32 statistics
NAN = float("nan")


def _randn(
    *shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype)


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).to(torch.float64)


def _check_h(h: torch.Tensor, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """h must be x + residual rounded to x's dtype; returns h in float64 (the input the kernel normalized)."""
    ref = x.float() + r.float()
    if x.dtype == BF16:  # the interpreter truncates fp32 -> bf16
        assert rel_error(h, ref) <= TOL[BF16]
    else:
        assert torch.equal(h, ref.to(x.dtype))
    return h.double()


# ---------------------------------------------------------------------------------------------- references
def rms_fwd_ref(xin: torch.Tensor, w: torch.Tensor, eps: float, casting: str, dtype: torch.dtype):
    """(y, rstd) in float64 from xin (float64 of the stored x dtype values)."""
    rstd = torch.rsqrt(xin.square().mean(-1) + eps)
    xh = xin * rstd[:, None]
    wd = w.double()
    if casting == "llama":
        return _round(xh, dtype) * wd, rstd
    return xh * (1.0 + wd if casting == "gemma" else wd), rstd


def rms_bwd_ref(dy, dh, xin, w, rstd, casting: str):
    """(dx, dw) in float64 from CONTRACT.md: x̂ = xin rstd, g = dy weff, dx = rstd (g - x̂ mean(g x̂)) + dh,
    dw = Σ dy x̂ (llama: Σ dy round_x(x̂))."""
    xh = xin.double() * rstd.double()[:, None]
    wd = w.double()
    g = dy.double() * (1.0 + wd if casting == "gemma" else wd)
    dx = rstd.double()[:, None] * (g - xh * (g * xh).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.double()
    terms = dy.double() * (_round(xh, xin.dtype) if casting == "llama" else xh)
    return dx, terms.sum(0), terms.square().sum(0).sqrt()


def ln_fwd_ref(xin: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float):
    mean = xin.mean(-1)
    rstd = torch.rsqrt((xin - mean[:, None]).square().mean(-1) + eps)
    y = (xin - mean[:, None]) * rstd[:, None] * w.double()
    return (y + b.double() if b is not None else y), mean, rstd


def ln_bwd_ref(dy, dh, xin, w, mean, rstd):
    """(dx, dw, db, |dw terms|, |db terms|) in float64: x̂ = (xin - mean) rstd, g = dy w,
    dx = rstd (g - mean(g) - x̂ mean(g x̂)) + dh, dw = Σ dy x̂, db = Σ dy."""
    rs = rstd.double()[:, None]
    xh = (xin.double() - mean.double()[:, None]) * rs
    g = dy.double() * w.double()
    dx = rs * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.double()
    tw, tb = dy.double() * xh, dy.double()
    return dx, tw.sum(0), tb.sum(0), tw.square().sum(0).sqrt(), tb.square().sum(0).sqrt()


def test_references_match_torch_autograd() -> None:
    # The formula references against float64 torch autograd of the forward (fp32 casting / layer_norm).
    x = _randn(5, 33, dtype=torch.float64, seed=1, shift=0.5)
    w = _randn(33, dtype=torch.float64, seed=2)
    b = _randn(33, dtype=torch.float64, seed=3)
    dy = _randn(5, 33, dtype=torch.float64, seed=4)
    for casting in ("fp32", "gemma"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, rstd = rms_fwd_ref(xr, wr, 1e-6, casting, torch.float64)
        y.backward(dy)
        dx, dw, _ = rms_bwd_ref(dy, None, x, w, rstd.detach(), casting)
        assert rel_error(dx, xr.grad) < 1e-12 and rel_error(dw, wr.grad) < 1e-12
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    torch.nn.functional.layer_norm(xr, (33,), wr, br, 1e-5).backward(dy)
    _, mean, rstd = ln_fwd_ref(x, w, b, 1e-5)
    dx, dw, db, _, _ = ln_bwd_ref(dy, None, x, w, mean, rstd)
    assert (
        rel_error(dx, xr.grad) < 1e-12 and rel_error(dw, wr.grad) < 1e-12 and rel_error(db, br.grad) < 1e-12
    )


# ---------------------------------------------------------------------------------------------- forward
# (x dtype, weight dtype, residual, casting) rotated over the modes; each mode sees all of them.
RMS_VARIANTS = [
    (F32, F32, False, "fp32"),
    (BF16, F32, True, "llama"),
    (F16, F16, True, "gemma"),
    (BF16, BF16, False, "gemma"),
    (F16, F32, False, "llama"),
    (BF16, BF16, True, "fp32"),
    (F32, F32, True, "llama"),
]
# (mode, M, N, extra forcing kwargs): reg/rows hold whole rows (N <= 16384), reload/split stream them.
FWD_SHAPES = {
    "reg": [(37, 33, {}), (5, 760, {}), (9, 1, {})],
    "rows": [(37, 33, {"_progs": 1, "_block_m": 4}), (13, 760, {"_progs": 2, "_block_m": 1}), (6, 1, {})],
    "reload": [(7, 4097, {"_progs": 1}), (9, 760, {"_progs": 2}), (3, 33, {"_progs": 1})],
    "split": [(3, 4097, {"_split": 3}), (2, 760, {"_split": 4}), (1, 33, {"_split": 2})],
}
FWD_CASES = [
    (mode, *shape, *RMS_VARIANTS[(i * 3 + j) % len(RMS_VARIANTS)])
    for i, (mode, shapes) in enumerate(FWD_SHAPES.items())
    for j, shape in enumerate(shapes)
]
# every mode also with each variant at one shape
FWD_CASES += [(mode, *FWD_SHAPES[mode][1], *v) for mode in FWD_SHAPES for v in RMS_VARIANTS[::2]]


@pytest.mark.parametrize("mode,M,N,kw,dtype,wdtype,res,casting", FWD_CASES)
def test_rms_forward(mode, M, N, kw, dtype, wdtype, res, casting) -> None:
    x = _randn(M, N, dtype=dtype, seed=M * N + 1, scale=2.0, shift=0.5)
    r = _randn(M, N, dtype=dtype, seed=M * N + 2) if res else None
    w = _randn(N, dtype=wdtype, seed=N + 3, scale=0.2, shift=1.0)
    y = torch.full_like(x, NAN)
    h = torch.full_like(x, NAN) if res else None
    rstd = torch.full((M,), NAN)
    rms.forward(y, h, rstd, x, r, w, 1e-6, casting, _mode=mode, **kw)
    xin = _check_h(h, x, r) if res else x.double()
    ref, ref_rstd = rms_fwd_ref(xin, w, 1e-6, casting, dtype)
    assert rel_error(y, ref) <= TOL[dtype], (mode, dtype, wdtype, res, casting)
    assert rel_error(rstd, ref_rstd) <= STAT_TOL


LN_VARIANTS = [  # (x dtype, weight/bias dtype, residual, bias)
    (F32, F32, False, True),
    (BF16, F32, True, True),
    (F16, F16, True, False),
    (BF16, BF16, False, False),
    (F16, F32, False, True),
]
LN_CASES = [
    (mode, *shape, *LN_VARIANTS[(i * 3 + j) % len(LN_VARIANTS)])
    for i, (mode, shapes) in enumerate(FWD_SHAPES.items())
    for j, shape in enumerate(shapes)
]


@pytest.mark.parametrize("mode,M,N,kw,dtype,wdtype,res,bias", LN_CASES)
def test_layer_norm_forward(mode, M, N, kw, dtype, wdtype, res, bias) -> None:
    x = _randn(M, N, dtype=dtype, seed=M * N + 5, scale=2.0, shift=3.0)
    r = _randn(M, N, dtype=dtype, seed=M * N + 6) if res else None
    w = _randn(N, dtype=wdtype, seed=N + 7, scale=0.2, shift=1.0)
    b = _randn(N, dtype=wdtype, seed=N + 8) if bias else None
    y = torch.full_like(x, NAN)
    h = torch.full_like(x, NAN) if res else None
    mean, rstd = torch.full((M,), NAN), torch.full((M,), NAN)
    ln.forward(y, h, mean, rstd, x, r, w, b, 1e-5, _mode=mode, **kw)
    xin = _check_h(h, x, r) if res else x.double()
    ref, ref_mean, ref_rstd = ln_fwd_ref(xin, w, b, 1e-5)
    assert rel_error(y, ref) <= TOL[dtype], (mode, dtype, wdtype, res, bias)
    assert rel_error(mean, ref_mean) <= STAT_TOL
    assert rel_error(rstd, ref_rstd) <= STAT_TOL


def test_forward_h_residual_pairing() -> None:
    x = _randn(2, 8, dtype=F32, seed=1)
    with pytest.raises(ValueError, match="together"):
        rms.forward(torch.empty_like(x), torch.empty_like(x), torch.empty(2), x, None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="together"):
        ln.forward(torch.empty_like(x), None, torch.empty(2), torch.empty(2), x, x, torch.ones(8), None, 1e-5)
    with pytest.raises(ValueError, match="casting"):
        rms.forward(torch.empty_like(x), None, torch.empty(2), x, None, torch.ones(8), 1e-6, "bogus")


# ---------------------------------------------------------------------------------------------- backward
# (mode, M, N, forcing kwargs): "rows" needs N <= BWD_ROWS_MAX; "col" takes any N.
BWD_SHAPES = {
    # rows: these sizes plan "direct" (one program stores dw itself); _direct=0 forces the partials + sum
    "rows": [
        (37, 33, {"_direct": 0}),
        (7, 760, {"_progs": 1}),
        (9, 1, {}),
        (2, 4097, {"_block_m": 1, "_num_warps": 4, "_direct": 0}),
    ],
    "col": [(37, 33, {}), (7, 760, {"_groups": 3}), (9, 1, {}), (3, 4097, {"_split": 5, "_groups": 2})],
}
BWD_RMS_CASES = [
    (mode, *shape, *RMS_VARIANTS[(i * 4 + j) % len(RMS_VARIANTS)])
    for i, (mode, shapes) in enumerate(BWD_SHAPES.items())
    for j, shape in enumerate(shapes)
]
BWD_RMS_CASES += [(mode, *BWD_SHAPES[mode][1], *v) for mode in BWD_SHAPES for v in RMS_VARIANTS[1::2]]


def _bwd_inputs(M: int, N: int, dtype: torch.dtype, res: bool, seed: int):
    xin = _randn(M, N, dtype=dtype, seed=seed, scale=2.0, shift=0.5)
    dy = _randn(M, N, dtype=dtype, seed=seed + 1)
    dh = _randn(M, N, dtype=dtype, seed=seed + 2, scale=0.5) if res else None
    return xin, dy, dh


@pytest.mark.parametrize("mode,M,N,kw,dtype,wdtype,res,casting", BWD_RMS_CASES)
def test_rms_backward(mode, M, N, kw, dtype, wdtype, res, casting) -> None:
    xin, dy, dh = _bwd_inputs(M, N, dtype, res, seed=M * N + 11)
    w = _randn(N, dtype=wdtype, seed=N + 13, scale=0.2, shift=1.0)
    rstd = torch.rsqrt(xin.double().square().mean(-1) + 1e-6).float()
    dx, dw = torch.full_like(xin, NAN), torch.full_like(w, NAN)
    rms.backward(dx, dw, dy, dh, xin, w, rstd, 1e-6, casting, _mode=mode, **kw)
    ref_dx, ref_dw, dw_scale = rms_bwd_ref(dy, dh, xin, w, rstd, casting)
    assert dx.dtype == dtype and dw.dtype == wdtype
    assert rel_error(dx, ref_dx) <= 2 * TOL[dtype], (mode, dtype, wdtype, res, casting)
    assert rel_error(dw, ref_dw, dw_scale) <= 2 * TOL[wdtype if dtype == F32 else dtype]


BWD_LN_CASES = [
    (mode, *shape, *LN_VARIANTS[(i * 4 + j) % len(LN_VARIANTS)])
    for i, (mode, shapes) in enumerate(BWD_SHAPES.items())
    for j, shape in enumerate(shapes)
]
BWD_LN_CASES += [(mode, *BWD_SHAPES[mode][1], *v) for mode in BWD_SHAPES for v in LN_VARIANTS[:2]]


@pytest.mark.parametrize("mode,M,N,kw,dtype,wdtype,res,bias", BWD_LN_CASES)
def test_layer_norm_backward(mode, M, N, kw, dtype, wdtype, res, bias) -> None:
    xin, dy, dh = _bwd_inputs(M, N, dtype, res, seed=M * N + 21)
    xin = (xin.float() + 3.0).to(dtype)  # a nonzero mean, so x̂ and xin differ
    w = _randn(N, dtype=wdtype, seed=N + 23, scale=0.2, shift=1.0)
    xd = xin.double()
    mean = xd.mean(-1)
    rstd = torch.rsqrt((xd - mean[:, None]).square().mean(-1) + 1e-5).float()
    mean = mean.float()
    dx, dw = torch.full_like(xin, NAN), torch.full_like(w, NAN)
    db = torch.full_like(w, NAN) if bias else None
    ln.backward(dx, dw, db, dy, dh, xin, w, mean, rstd, 1e-5, _mode=mode, **kw)
    ref_dx, ref_dw, ref_db, sw, sb = ln_bwd_ref(dy, dh, xin, w, mean, rstd)
    tol = 2 * TOL[dtype]
    assert rel_error(dx, ref_dx) <= tol, (mode, dtype, wdtype, res, bias)
    assert rel_error(dw, ref_dw, sw) <= tol
    if bias:
        assert db.dtype == wdtype and rel_error(db, ref_db, sb) <= tol


@pytest.mark.parametrize("mode", ["rows", "col"])
def test_backward_deterministic(mode: str) -> None:
    # Several programs (interpreter: 4 SMs x progs; col: row groups) each write a partial row; two runs
    # must give bit-identical dx, dw and db.
    M, N = 23, 100
    xin, dy, dh = _bwd_inputs(M, N, F32, True, seed=5)
    w = _randn(N, dtype=F32, seed=6)
    rstd = torch.rsqrt(xin.square().mean(-1) + 1e-6)
    mean = xin.mean(-1)
    kw = {"_progs": 2, "_block_m": 2, "_direct": 0} if mode == "rows" else {"_groups": 5, "_split": 3}
    outs = []
    for _ in range(2):
        dx, dw = torch.full_like(xin, NAN), torch.full_like(w, NAN)
        rms.backward(dx, dw, dy, dh, xin, w, rstd, 1e-6, "fp32", _mode=mode, **kw)
        ldx, ldw, ldb = torch.full_like(xin, NAN), torch.full_like(w, NAN), torch.full_like(w, NAN)
        ln.backward(ldx, ldw, ldb, dy, dh, xin, w, mean, rstd, 1e-5, _mode=mode, **kw)
        outs.append((dx, dw, ldx, ldw, ldb))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_backward_default_plans() -> None:
    # The planner's own choice: "rows" up to BWD_ROWS_MAX, "col" beyond (here N = 8193, M = 2); "rows" in
    # one program that stores dw itself up to BWD_DIRECT_TILES tiles and BWD_DIRECT_ELEMS elements.
    assert _norm_bwd.bwd_plan(64, 8192, 2, 0).mode == "rows"
    assert _norm_bwd.bwd_plan(64, 8193, 2, 0).mode == "col"
    assert _norm_bwd.bwd_plan(4, 4096, 2, 0).direct and _norm_bwd.bwd_plan(4, 8192, 2, 0).direct
    assert not _norm_bwd.bwd_plan(8, 4096, 2, 0).direct and not _norm_bwd.bwd_plan(64, 1024, 2, 0).direct
    assert not _norm_bwd.bwd_plan(64, 8192, 2, 0).direct
    for M, N in [(3, 8193), (6, 50)]:
        xin, dy, _ = _bwd_inputs(M, N, F32, False, seed=N)
        w = _randn(N, dtype=F32, seed=N + 1)
        rstd = torch.rsqrt(xin.double().square().mean(-1) + 1e-6).float()
        dx, dw = torch.full_like(xin, NAN), torch.full_like(w, NAN)
        rms.backward(dx, dw, dy, None, xin, w, rstd, 1e-6, "fp32")
        ref_dx, ref_dw, sw = rms_bwd_ref(dy, None, xin, w, rstd, "fp32")
        assert rel_error(dx, ref_dx) <= 2 * TOL[F32] and rel_error(dw, ref_dw, sw) <= 2 * TOL[F32]


def test_backward_rejects_unknown_forcing() -> None:
    x = torch.ones(2, 8)
    with pytest.raises(ValueError, match="mode"):
        rms.backward(
            torch.empty_like(x), torch.empty(8), x, None, x, torch.ones(8), torch.ones(2), 1e-6, _mode="x"
        )
    with pytest.raises(TypeError, match="overrides"):
        rms.backward(
            torch.empty_like(x), torch.empty(8), x, None, x, torch.ones(8), torch.ones(2), 1e-6, _bogus=1
        )


def test_forward_backward_roundtrip_residual() -> None:
    # The lead's wiring: forward with a residual saves h and rstd; backward takes xin = h and dh.
    M, N = 11, 760
    x = _randn(M, N, dtype=F16, seed=1, shift=0.3)
    r = _randn(M, N, dtype=F16, seed=2)
    w = _randn(N, dtype=F32, seed=3, scale=0.2, shift=1.0)
    y, h, rstd = torch.full_like(x, NAN), torch.full_like(x, NAN), torch.full((M,), NAN)
    rms.forward(y, h, rstd, x, r, w, 1e-6, "llama")
    dy = _randn(M, N, dtype=F16, seed=4)
    dh = _randn(M, N, dtype=F16, seed=5)
    dx, dw = torch.full_like(x, NAN), torch.full_like(w, NAN)
    rms.backward(dx, dw, dy, dh, h, w, rstd, 1e-6, "llama")
    # float64 autograd through the whole llama forward (rounding of x̂ as a straight-through cast)
    hd = (x.double() + r.double()).requires_grad_()
    wd = w.double().requires_grad_()
    xh = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + 1e-6)
    xr = xh + (_round(xh.detach(), F16) - xh.detach())
    (xr * wd).backward(dy.double())
    assert rel_error(dx, hd.grad + dh.double()) <= 2 * TOL[F16]
    assert rel_error(dw, wd.grad) <= 2 * TOL[F16]


def test_rms_llama_rounds_where_hf_does() -> None:
    # "llama" differs from "fp32" casting by less than the output tolerance, so the checks above cannot tell
    # them apart; these can. fp16, since the interpreter rounds fp32 -> fp16 to nearest, like a GPU.
    M, N = 16, 760
    x = _randn(M, N, dtype=F16, seed=7, scale=2.0)
    w = _randn(N, dtype=F32, seed=8, scale=0.5, shift=1.0)
    y, rstd = torch.full_like(x, NAN), torch.full((M,), NAN)
    rms.forward(y, None, rstd, x, None, w, 1e-6, "llama")
    xh = x.double() * rstd.double()[:, None]  # the kernel's own fp32 rstd
    llama = (xh.to(F16).double() * w.double()).to(F16)
    plain = (xh * w.double()).to(F16)
    same = float((y == llama).double().mean())
    assert same >= 0.99 and float((plain == llama).double().mean()) < 0.95, same
    # dw = Σ dy round_x(x̂): with an fp32 weight (fp32 dw) the kernel must match it to fp32 sum noise, far
    # below the gap to the unrounded Σ dy x̂.
    dy = _randn(M, N, dtype=F16, seed=9)
    for mode in ("rows", "col"):
        dx, dw = torch.full_like(x, NAN), torch.full_like(w, NAN)
        rms.backward(dx, dw, dy, None, x, w, rstd, 1e-6, "llama", _mode=mode)
        _, ref_dw, scale = rms_bwd_ref(dy, None, x, w, rstd, "llama")
        _, unrounded, _ = rms_bwd_ref(dy, None, x, w, rstd, "fp32")
        assert rel_error(dw, ref_dw, scale) <= 1e-5 < rel_error(unrounded, ref_dw, scale), mode
