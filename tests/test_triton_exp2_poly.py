"""The software exp2 (kernels_triton/_exp2_poly.py) and the opt-in attention forward that uses it
(FUSEKIT_TRITON_ATTN_EXP2_POLY, issue #13).

    pytest tests/test_triton_exp2_poly.py                 # CPU: Triton's interpreter (conftest sets it)
    pytest tests/test_triton_exp2_poly.py --device cuda   # GPU: the compiled kernels

exp2_poly against float64 torch.exp2 over a dense sweep of [-130, 0] (plus the special values the softmax
feeds it: -inf, NaN, the underflow edge); exp2_mixed's column split (which columns go through the polynomial);
and _attn_fwd_kernel with the switch on (each fraction) against the float64 attention of
test_triton_attention_grad, o and lse, and the backward from that lse (which recomputes p with MUFU exp2),
within that file's tolerances. fp16, fp32 and bf16 on the CPU (the interpreter's bf16 tl.dot corrected by
kernels_triton/_interpreter.py); fp16 and bf16 on the GPU.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

# Max relative error of exp2_poly on [-126, 0] by degree: the fits' 7.48e-5 / 2.59e-6 / 7.49e-8 plus fp32
# evaluation; measured in the interpreter (numpy fp32): 7.48e-5, 2.71e-6, 2.34e-7.
BOUND = {3: 7.6e-5, 4: 3.0e-6, 5: 3.0e-7}


if importlib.util.find_spec("triton") is not None:  # after conftest set TRITON_INTERPRET on the CPU
    import triton
    import triton.language as tl

    from kernels_triton._exp2_poly import exp2_mixed, exp2_poly

    @triton.jit
    def _poly_kernel(x_ptr, y_ptr, N, DEGREE: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + o, mask=o < N, other=0.0)
        tl.store(y_ptr + o, exp2_poly(x, DEGREE), mask=o < N)

    @triton.jit
    def _mixed_kernel(x_ptr, y_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, POLY_LOG2: tl.constexpr):
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        tl.store(y_ptr + offs, exp2_mixed(tl.load(x_ptr + offs), ROWS, COLS, POLY_LOG2))


@pytest.fixture(scope="module")
def kernels(dev):
    def poly(x: torch.Tensor, degree: int) -> torch.Tensor:
        y = torch.full_like(x, math.nan)
        block = 1 << 16
        _poly_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), degree, block)
        return y

    def mixed(x: torch.Tensor, poly_log2: int) -> torch.Tensor:
        y = torch.full_like(x, math.nan)
        _mixed_kernel[(1,)](x, y, x.shape[0], x.shape[1], poly_log2)
        return y

    return poly, mixed


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_exp2_poly_accuracy_sweep(kernels, dev, degree):
    """Relative error vs float64 over [-130, 0] in 2e6 + 1 steps (every ~6.5e-5), and the flush below."""
    poly, _ = kernels
    x = torch.linspace(-130.0, 0.0, 2_000_001, dtype=torch.float32, device=dev)
    y = poly(x, degree).double().cpu()
    x, ref = x.cpu(), torch.exp2(x.cpu().double())
    normal = x >= -126.0
    rel = ((y - ref).abs() / ref)[normal]
    print(f"degree {degree}: max rel err on [-126, 0] {rel.max().item():.3e}, mean {rel.mean().item():.3e}")
    assert rel.max().item() <= BOUND[degree]
    assert bool((y[x < -126.5] == 0).all()), "x < -126.5 must flush to exactly +0"
    edge = (x >= -126.5) & (x < -126.0)  # 2^x in [2^-126.5, 2^-126): what the multiply gives, no garbage
    assert bool((y[edge] >= 2.0**-126.6).all() and (y[edge] <= 2.0**-126).all())
    assert not torch.isnan(y).any() and bool((y >= 0).all())


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_exp2_poly_special_values(kernels, dev, degree):
    poly, _ = kernels
    vals = [-math.inf, math.nan, 0.0, -0.0, -1e30, -127.0, -126.51, 1.0, 10.25, 126.9, 127.0, -3.4e38]
    x = torch.tensor(vals, dtype=torch.float32, device=dev)
    y = poly(x, degree).double().cpu()
    assert y[0].item() == 0.0 and math.copysign(1.0, y[0].item()) == 1.0, "-inf must give exactly +0"
    assert math.isnan(y[1].item()), "NaN must stay NaN"
    for i in (4, 5, 6, 11):
        assert y[i].item() == 0.0, f"exp2_poly({vals[i]}) = {y[i].item()}, want +0"
    for i in (2, 3, 7, 8, 9, 10):  # x = 0 is 1 within the fit's error (c0 is not exactly 1)
        ref = 2.0 ** x[i].item()  # of the fp32 input (126.9 is not one)
        assert abs(y[i].item() - ref) <= BOUND[degree] * ref, (vals[i], y[i].item(), ref)


# which columns of a [ROWS, COLS] tile exp2_mixed sends through the polynomial, by POLY_LOG2
def _poly_cols(cols: int, poly_log2: int) -> set[int]:
    odd = set(range(1, cols, 2))
    return {
        0: set(),
        1: odd,
        2: {c for c in odd if c >= cols // 2},
        3: {c for c in odd if c >= 3 * cols // 4},
    }[poly_log2]


@pytest.mark.parametrize("poly_log2", [0, 1, 2, 3])
@pytest.mark.parametrize("shape", [(16, 16), (32, 64)])
def test_exp2_mixed_columns(kernels, dev, poly_log2, shape):
    """1 / 2^POLY_LOG2 of the columns through the polynomial (the interpreter's tl.math.exp2 is numpy's,
    ~exact, so those are the columns with errors above ~1e-7), every column within the degree-3 bound."""
    _, mixed = kernels
    g = torch.Generator().manual_seed(poly_log2)
    x = (-30.0 * torch.rand(shape, generator=g, dtype=torch.float64)).float()
    x[0, :] = -math.inf  # masked keys
    y = mixed(x.to(dev), poly_log2).double().cpu()
    ref = torch.exp2(x.double())
    assert bool((y[0] == 0).all())
    rel = ((y - ref).abs() / ref)[1:]
    assert rel.max().item() <= BOUND[3]
    if dev == "cpu":
        got = {c for c in range(shape[1]) if rel[:, c].max().item() > 1e-6}
        assert got == _poly_cols(shape[1], poly_log2)


def _env_cases():
    return [("", "", (0, 3)), ("0", "", (0, 3)), ("1", "", (2, 3)), ("2", "4", (1, 4)), ("4", "5", (2, 5)),
            ("8", "3", (3, 3))]  # fmt: skip


@pytest.mark.parametrize(("frac", "degree", "want"), _env_cases())
def test_env_parsing(monkeypatch, frac, degree, want):
    import kernels_triton.attention as attn

    monkeypatch.setenv("FUSEKIT_TRITON_ATTN_EXP2_POLY", frac)
    monkeypatch.setenv("FUSEKIT_TRITON_ATTN_EXP2_POLY_DEGREE", degree)
    assert attn._exp2_poly_env() == want


@pytest.mark.parametrize("bad", [("3", "3"), ("1", "2"), ("on", "3")])
def test_env_parsing_rejects(monkeypatch, bad):
    import kernels_triton.attention as attn

    monkeypatch.setenv("FUSEKIT_TRITON_ATTN_EXP2_POLY", bad[0])
    monkeypatch.setenv("FUSEKIT_TRITON_ATTN_EXP2_POLY_DEGREE", bad[1])
    with pytest.raises(ValueError, match="EXP2_POLY"):
        attn._exp2_poly_env()


# (B, H, Hkv, S, Skv, D): unmasked and diagonal tiles, ragged tails, S > Skv rows with no key, GQA
SHAPES = [(1, 2, 2, 37, 37, 64), (1, 4, 2, 53, 29, 64), (2, 2, 1, 21, 45, 128)]


@pytest.mark.parametrize("poly_log2", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_attention_forward_with_exp2_poly(monkeypatch, dev, poly_log2, causal, shape, dtype):
    """o and lse against float64, and the backward from that lse, at test_triton_attention_grad's
    tolerances; lse within the polynomial's error of the MUFU-only forward's, and (fp16, CPU) not equal to it:
    the polynomial ran."""
    from test_triton_attention_grad import TOL, _check_all, _forward, _inputs, _skip

    import kernels_triton.attention as attn

    _skip(dtype, dev)
    q, k, v, do = _inputs(*shape, dtype, dev, seed=sum(shape) + poly_log2)
    scale = 1.0 / math.sqrt(shape[-1])
    monkeypatch.setattr(attn, "EXP2_POLY", (0, 3))
    _, lse_off = _forward(attn, q, k, v, causal, scale)
    monkeypatch.setattr(attn, "EXP2_POLY", (poly_log2, 3))
    what = f"exp2_poly 1/{2**poly_log2} {shape} causal={causal} {dtype}"
    _, lse, _ = _check_all(attn, q, k, v, do, causal, scale, TOL[dtype], what)
    fin = torch.isfinite(lse_off)
    # the interpreter's exp2 is exact, so the polynomial's error shows in lse (not always at fp32: degree 5)
    if dev == "cpu" and dtype != torch.float32:
        assert not torch.equal(lse[fin], lse_off[fin]), f"{what}: the switch changed nothing"
    # lse moves by at most the polynomial's relative error on l, plus fp32 rounding of lse (~4, ulp 4.8e-7; on
    # the GPU the two runs may also tune different tiles, another summation order of l)
    bound = (BOUND[5] if dtype == torch.float32 else BOUND[3]) + 4e-6
    assert (lse[fin] - lse_off[fin]).abs().max().item() <= bound
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_off))


@pytest.mark.parametrize("tile", [(32, 32, 4, 1), (16, 64, 4, 1)])
def test_attention_forced_tiles_with_exp2_poly(monkeypatch, dev, tile):
    """Wider key tiles than the interpreter's 16 x 16 (the column split at 32 and 64 keys), fp16."""
    from test_triton_attention_grad import TOL, _check_all, _inputs

    import kernels_triton.attention as attn

    if dev == "cuda":
        pytest.skip("forced interpreter-sized tiles: the GPU runs the tuned ones in the test above")
    q, k, v, do = _inputs(1, 2, 1, 70, 93, 64, torch.float16, dev, seed=7)
    monkeypatch.setattr(attn, "EXP2_POLY", (2, 3))
    for causal in (False, True):
        _check_all(attn, q, k, v, do, causal, 0.125, TOL[torch.float16], f"tile {tile} causal={causal}",
                   fwd_kw={"_config": tile})  # fmt: skip
