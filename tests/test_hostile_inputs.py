"""Hostile but legal inputs (issue #16): NaN propagation, scalar ranges, loose flags, threads, hangs.

Every backend must give the float64 answer or a clear error naming the argument — never a silent
wrong result and never a hang (potential hangs run in a subprocess under a timeout).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from cases import attention as attention_case
from cases import rope as rope_case

from fusekit import nn as fnn
from fusekit import ops

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"


def _attn(backend: str, q, k, v, causal: bool):
    try:
        return ops.attention(q, k, v, causal=causal, backend=backend)
    except ValueError as exc:
        if "cannot run" in str(exc):
            pytest.skip(str(exc))
        raise


# --- 1. attention propagates NaN exactly like a float64 softmax -------------------------------------
def _qkv(device: str, s: int = 16, skv: int = 16, dtype=torch.float32):
    if device == "cuda":
        dtype = torch.float16
    g = torch.Generator().manual_seed(7)
    return [torch.randn(1, 1, n, 64, generator=g).to(device=device, dtype=dtype) for n in (s, skv, skv)]


def test_attention_nan_in_one_query_row_reaches_only_that_row(backend_name, device):
    q, k, v = _qkv(device)
    q[0, 0, 3, 0] = float("nan")
    out = _attn(backend_name, q, k, v, causal=False)[0, 0]
    nan_rows = out.isnan().any(-1)
    assert nan_rows[3] and out[3].isnan().all(), "the NaN query row must be NaN"
    assert not nan_rows[torch.arange(16) != 3].any(), "NaN leaked into other rows"


@pytest.mark.parametrize("causal", [False, True])
def test_attention_nan_key_reaches_the_rows_that_see_it(backend_name, device, causal):
    q, k, v = _qkv(device)
    k[0, 0, 5, 0] = float("nan")
    out = _attn(backend_name, q, k, v, causal=causal)[0, 0]
    sees = torch.arange(16) >= 5 if causal else torch.ones(16, dtype=torch.bool)
    got = out.isnan().all(-1).cpu()
    assert torch.equal(got, sees), f"rows with NaN: {got.int().tolist()}, expected {sees.int().tolist()}"
    assert not out[~sees.to(out.device)].isnan().any()


def test_attention_masked_nan_key_does_not_leak_and_empty_rows_are_zero(backend_name, device):
    """A NaN key is seen only by the last row. (A NaN in v at a masked position is not part of the
    contract: flash kernels multiply it by p = 0 inside a diagonal tile, which gives NaN — loud, not silent.)"""
    q, k, v = _qkv(device, s=12, skv=8)  # causal with S > Skv: rows 0..3 see no key
    k[0, 0, 7, :] = float("nan")
    out = _attn(backend_name, q, k, v, causal=True)[0, 0]
    assert torch.equal(out[:4], torch.zeros_like(out[:4])), "rows with no visible key must be zero"
    assert not out[4:11].isnan().any(), "a masked NaN key leaked"
    assert out[11].isnan().all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("s", "skv"), [(12, 16), (12, 40), (24, 80)])  # S 12: decode kernels; 40+: tiles
def test_attention_row_whose_visible_scores_are_all_neginf_is_zero(backend_name, device, causal, s, skv):
    """Query row 9 holds -inf against positive keys, so every score it sees is -inf: a zero row, the
    reference's rule (and SDPA's), not NaN; the other rows are what they are without it. Its gradient
    reaches nothing: dq row 9 is 0 and dv stays finite (dk takes 0 * -inf from q's -inf, as in float64)."""
    q, k, v = _qkv(device, s=s, skv=skv)
    k = k.abs() + 0.25
    clean = q.clone()
    q[0, 0, 9, 0] = float("-inf")
    out = _attn(backend_name, q, k, v, causal=causal)[0, 0]
    assert torch.equal(out[9], torch.zeros_like(out[9])), f"row 9: {out[9, :4].tolist()}"
    want = _attn(backend_name, clean, k, v, causal=causal)[0, 0]
    rest = torch.arange(s, device=out.device) != 9
    assert torch.equal(out[rest], want[rest])
    q, v = q.requires_grad_(), v.requires_grad_()
    dq, dv = torch.autograd.grad(_attn(backend_name, q, k, v, causal=causal).float().sum(), (q, v))
    assert torch.equal(dq[0, 0, 9], torch.zeros_like(dq[0, 0, 9])) and torch.isfinite(dq[0, 0, rest]).all()
    assert torch.isfinite(dv).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("s", "skv"), [(20, 32), (1, 24), (12, 40)]
)  # S past a whole query tile: padded rows
def test_attention_key_whose_scores_are_all_neginf_gets_zero_grads(backend_name, device, causal, s, skv):
    """Key 3 holds -inf against queries positive in that component: every score of it is -inf, p = 0, so
    its dk and dv are 0 and the other keys' are the float64 reference's. Triton's dk/dv kernel loaded q = 0
    in the padded query rows of a tail tile, where s = -inf * 0 = NaN passed through exp2(NaN - lse2 = +inf)
    unmasked: dk = dv = NaN whenever S was not a multiple of its query tile (the mask now selects them)."""
    q, k, v = _qkv(device, s=s, skv=skv)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[0, 0, 3, 0] = float("-inf")
    k, v = k.requires_grad_(), v.requires_grad_()
    out = _attn(backend_name, q, k, v, causal=causal)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    dk, dv = torch.autograd.grad(out, (k, v), do)
    ref = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    (o,) = attention_case.oracle(
        *ref, causal=causal
    )  # outside fusekit: the torch backend passed its own bugs
    rk, rv = torch.autograd.grad(o, ref[1:], do.cpu().double())
    for name, got, want in (("dk", dk, rk), ("dv", dv, rv)):
        assert torch.equal(got[0, 0, 3].cpu(), torch.zeros_like(got[0, 0, 3].cpu())), f"{name} of key 3"
        tol = 2e-2 if got.dtype == torch.float16 else 1e-4
        torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("s", [1, 32])  # 1: the decode kernel; 32: the tiled forward, and dq
def test_attention_kv_view_with_a_huge_per_key_stride(backend_name, device, s):
    """k and v views into one buffer 1.5e8 elements per key apart (legal: every offset fits int64; 4.5 GB
    reserved, 16 rows touched). Triton's kernels form a key's offset within a tile in int32: 15 x 1.5e8
    wrapped, and the CPU interpreter faulted (a GPU reads wrong keys); such views are now copied."""
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    skv, d, stride = 16, 64, 150_000_000
    n = (skv - 1) * stride + d
    g = torch.Generator().manual_seed(5)
    dense = torch.randn(1, 1, skv, d, generator=g).to(device, dt)
    kv = torch.empty(n, dtype=dt, device=device).as_strided((1, 1, skv, d), (n, n, stride, 1))
    kv.copy_(dense)
    q = torch.randn(1, 1, s, d, generator=g).to(device, dt).requires_grad_()
    out = _attn(backend_name, q, kv, kv, causal=False)
    do = torch.randn(out.shape, generator=g).to(out)
    (dq,) = torch.autograd.grad(out, q, do)
    ref = [t.detach().cpu().double() for t in (q, dense)]
    ref[0].requires_grad_()
    (want,) = attention_case.oracle(ref[0], ref[1], ref[1])
    (want_dq,) = torch.autograd.grad(want, ref[0], do.cpu().double())
    tol = 2e-2 if dt == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.detach().cpu().double(), want.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(dq.cpu().double(), want_dq, rtol=tol, atol=tol)
    del kv


def test_reduce_sum_to_float64_sums_in_float64(backend_name, device):
    """dtype=torch.float64 sums x cast to float64, as torch.sum (an fp32 accumulation gave 1 or 0 for 2);
    the kernel backends take no float64 and say so."""
    x = torch.tensor([1e8, 1.0, -1e8, 1.0]).to(device)
    if backend_name != "torch":
        with pytest.raises(ValueError, match="float64 runs on the torch backend only"):
            ops.reduce_sum(x, dtype=torch.float64, backend=backend_name)
        return
    out = ops.reduce_sum(x, dtype=torch.float64, backend=backend_name)
    assert out.dtype == torch.float64 and out.item() == 2.0


def test_float64_statistics_keep_float64_gradients():
    """float64 inputs (the torch backend: gradchecks, oracles) save float64 statistics: rounded to fp32,
    layer_norm's dx on a near-constant row at eps 1e-12 was off by 1.7e8 (torch's largest |dx| 1.4e6)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(6)
    x = (1000.1 + 1e-3 * torch.randn(3, 8, generator=g, dtype=torch.float64)).requires_grad_()
    w, b = (torch.randn(8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    dy = torch.randn(3, 8, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(ops.layer_norm(x, w, b, 1e-12, backend="torch"), (x, w, b), dy)
    want = torch.autograd.grad(F.layer_norm(x, (8,), w, b, 1e-12), (x, w, b), dy)
    for name, a, e in zip(("dx", "dw", "db"), got, want):
        assert ((a - e).norm() / e.norm()).item() <= 1e-9, name
    q, k, v = (torch.randn(1, 2, 5, 64, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    got = torch.autograd.grad(ops.attention(q, k, v, backend="torch"), (q, k, v), torch.ones(1, 2, 5, 64))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), torch.ones(1, 2, 5, 64))
    for a, e in zip(got, want):
        assert ((a - e).norm() / e.norm()).item() <= 1e-12


@pytest.mark.parametrize("eps", [1e-12, 1e-5, 1e-40])
def test_layer_norm_of_constant_rows_is_its_bias(backend_name, device, eps):
    """Constant rows (large values, N not a power of two): the centred row is exactly 0, so y = bias. An
    fp32 mean one ulp off left (x - mean) = ulp and, with eps 1e-12, y = +-1 on the torch backend; on the
    H200 Triton's approximate `/` (div.full) left ~1e-10 (|y - b| 9e-5). eps 1e-40 is subnormal: NVIDIA's
    rsqrt.approx.ftz read it as 0, so rstd was inf and y = 0 * inf = NaN."""
    g = torch.Generator().manual_seed(2)
    x = torch.full((3, 37), 12345.678).to(device)
    x[1] = -0.3
    w, b = (torch.randn(37, generator=g).to(device) for _ in range(2))
    y = ops.layer_norm(x, w, b, eps, backend=backend_name)
    assert torch.equal(y, b.expand_as(y)), f"max |y - b| {float((y - b).abs().max()):.3g}"


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "swiglu_ffn"])
def test_norm_of_rows_whose_mean_square_is_subnormal(backend_name, device, op):
    """eps 0 and rows of ~1e-20: mean(x^2) ~ 1e-40 is below fp32's normal range, which NVIDIA's
    rsqrt.approx.ftz (tl.rsqrt, Mojo's 1 / sqrt) reads as 0: rstd was inf and y inf / NaN, where the float64
    reference normalizes the rows to |y| ~ 3."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(7)
    x = 1e-20 * torch.randn(3, 64, generator=g)
    w, b = (torch.randn(64, generator=g) for _ in range(2))
    xd, wd, bd = x.double(), w.double(), b.double()
    if op == "rms_norm":
        got = ops.rms_norm(x.to(device), w.to(device), 0.0, backend=backend_name)
        want = F.rms_norm(xd, (64,), wd, 0.0)
    elif op == "layer_norm":
        got = ops.layer_norm(x.to(device), w.to(device), b.to(device), 0.0, backend=backend_name)
        want = F.layer_norm(xd, (64,), wd, bd, 0.0)
    else:
        wg, wu, wdn = (0.1 * torch.randn(*s, generator=g) for s in ((128, 64), (128, 64), (64, 128)))
        args = (x.to(device), wg.to(device), wu.to(device), wdn.to(device))
        got = ops.swiglu_ffn(*args, norm_weight=w.to(device), eps=0.0, backend=backend_name)
        h = F.rms_norm(xd, (64,), wd, 0.0)
        want = (F.silu(h @ wg.double().T) * (h @ wu.double().T)) @ wdn.double().T
    got = got.double().cpu()
    assert torch.isfinite(got).all(), f"{op}: {int((~torch.isfinite(got)).sum())} non-finite outputs"
    assert ((got - want).norm() / want.norm()).item() < 1e-3


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norm_weight_of_x_dtype_beside_a_wider_residual(backend_name, device, op):
    """bf16 x and weight with an fp32 residual stream: h = x + residual is fp32 (torch's promotion), and the
    bf16 weight is widened with it (HF multiplies it into the fp32 h the same way); it was refused with
    'weight: dtype bfloat16 is not supported; expected one of float32', naming neither x nor the residual."""
    g = torch.Generator().manual_seed(8)
    x, w, b = torch.randn(3, 64, generator=g), torch.randn(64, generator=g), torch.randn(64, generator=g)
    res = torch.randn(3, 64, generator=g)
    xb, wb, bb = (t.bfloat16().to(device).requires_grad_() for t in (x, w, b))
    rf = res.to(device).requires_grad_()
    if op == "rms_norm":
        y, h = ops.rms_norm(xb, wb, residual=rf, backend=backend_name)
        hd = xb.detach().double().cpu() + res.double()
        want = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + 1e-6) * wb.detach().double().cpu()
        leaves = (xb, wb, rf)
    else:
        y, h = ops.layer_norm(xb, wb, bb, residual=rf, backend=backend_name)
        hd = xb.detach().double().cpu() + res.double()
        want = torch.nn.functional.layer_norm(
            hd, (64,), wb.detach().double().cpu(), bb.detach().double().cpu(), 1e-5
        )
        leaves = (xb, wb, bb, rf)
    assert y.dtype == h.dtype == torch.float32
    assert ((y.double().cpu() - want).norm() / want.norm()).item() < 1e-5
    dy = torch.randn(y.shape, generator=g)
    grads = torch.autograd.grad((y, h), leaves, (dy.to(device), dy.to(device)))
    assert [gr.dtype for gr in grads] == [t.dtype for t in leaves]
    # the values too (a residual gradient 3x too large passed the dtype / finite checks): float64 autograd
    # of the same formula through y and h
    ref = [t.detach().cpu().double().requires_grad_() for t in leaves]
    hd = ref[0] + ref[-1]
    if op == "rms_norm":
        yd = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + 1e-6) * ref[1]
    else:
        yd = torch.nn.functional.layer_norm(hd, (64,), ref[1], ref[2], 1e-5)
    wants = torch.autograd.grad((yd, hd), ref, (dy.double(), dy.double()))
    names = ("x", "weight", "residual") if op == "rms_norm" else ("x", "weight", "bias", "residual")
    for t, gr, wt in zip(names, grads, wants):
        err = ((gr.double().cpu() - wt).norm() / wt.norm()).item()
        assert err < (1e-5 if gr.dtype == torch.float32 else 1e-2), f"d{t}: relative error {err:.2e}"


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_narrower_norm_weight_beside_fp32_x_computes_in_fp32(backend_name, device, op):
    """A bf16 model's norm fed fp32 activations (fp32 inputs_embeds under autocast): torch and HF promote
    `weight * x` to fp32; fusekit refused the bf16 weight ('expected one of float32'), so a patched model
    crashed where HF ran. The weight (and bias) are widened (exact): fp32 result, grads in their dtypes."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 64, generator=g).to(device).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(device, torch.bfloat16).requires_grad_()
    b = (0.1 * torch.randn(64, generator=g)).to(device, torch.bfloat16).requires_grad_()
    for _ in range(2):  # the checked call, then the remembered one
        if op == "rms_norm":
            y = ops.rms_norm(x, w, backend=backend_name)
            want = torch.nn.functional.rms_norm(x.double(), (64,), w.double(), 1e-6)
            leaves = (x, w)
        else:
            y = ops.layer_norm(x, w, b, backend=backend_name)
            want = torch.nn.functional.layer_norm(x.double(), (64,), w.double(), b.double(), 1e-5)
            leaves = (x, w, b)
        assert y.dtype == torch.float32
        assert ((y.double() - want).norm() / want.norm()).item() < 1e-5
        y2, h2 = getattr(ops, op)(x, *leaves[1:], residual=x, backend=backend_name)  # an fp32 residual too
        assert y2.dtype == h2.dtype == torch.float32 and torch.equal(h2, x + x)
        grads = torch.autograd.grad(y.sum(), leaves)
        ref = torch.autograd.grad(want.sum(), leaves)
        assert [gr.dtype for gr in grads] == [t.dtype for t in leaves]
        for gr, rf in zip(grads, ref):
            assert ((gr.double() - rf.double()).norm() / rf.double().norm()).item() < 1e-2
    with torch.no_grad():  # torch.nn.RMSNorm of a bf16 model, fed fp32: its result, as a fusekit module
        tm = torch.nn.RMSNorm(64, eps=1e-6).to(device, torch.bfloat16)
        got = fnn.RMSNorm.from_module(tm, backend=backend_name)(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, tm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_rope_k_rotated_beside_x_without_heads(backend_name, device, layout):
    """x with no heads (H = 0) beside a k that has them: k is still rotated, and still gets its gradient.
    (An empty first input made the whole call empty: k came back as zeros, its gradient too. Found by
    test_fuzz at FUSEKIT_FUZZ_SEED=1 FUSEKIT_FUZZ_EXAMPLES=10.)"""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 0, 8, generator=g).to(device)
    k = torch.randn(2, 3, 2, 8, generator=g).to(device)
    if layout == "bhsd":
        x, k = x.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    x.requires_grad_()
    k.requires_grad_()
    try:
        y, yk = ops.rope(x, k, start_pos=5, layout=layout, backend=backend_name)
    except ValueError as exc:
        if "cannot run" in str(exc) or "has no backward here" in str(exc):
            pytest.skip(str(exc))
        raise

    def oracle(t: torch.Tensor) -> torch.Tensor:  # float64, outside fusekit, in the call's layout
        t = t.transpose(1, 2) if layout == "bhsd" else t
        (r,) = rope_case.oracle(t, start_pos=5)
        return r.transpose(1, 2) if layout == "bhsd" else r

    want = oracle(k.detach().cpu().double())
    assert y.shape == x.shape and yk.shape == k.shape
    torch.testing.assert_close(yk.detach().cpu().double(), want, rtol=1e-5, atol=1e-5)
    dy = torch.randn(k.shape, generator=g).to(device)
    dx, dk = torch.autograd.grad((y.sum(), yk), (x, k), (torch.ones((), device=device), dy))
    k64 = k.detach().cpu().double().requires_grad_()
    (dk_want,) = torch.autograd.grad(oracle(k64), k64, dy.cpu().double())
    assert dx.shape == x.shape
    torch.testing.assert_close(dk.cpu().double(), dk_want, rtol=1e-5, atol=1e-5)


# --- 2. scalars: finite and representable in float32, or a ValueError naming them ------------------
x4 = torch.randn(1, 3, 2, 8)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ops.rope(x4, theta=1e39), r"^theta: 1e\+39 is not representable in float32"),
        (lambda: ops.rope(x4, theta=3.5e38), r"^theta: 3.5e\+38 is not representable"),
        (lambda: ops.rope(x4, theta=1e-46), r"^theta: 1e-46 is not representable"),
        (lambda: ops.rope(x4, theta=math.inf), r"^theta: must be positive and finite"),
        (lambda: ops.rope(x4, theta=math.nan), r"^theta: must be positive and finite"),
        (lambda: ops.rms_norm(x4, torch.ones(8), eps=1e39), r"^eps: 1e\+39 is not representable"),
        (lambda: ops.layer_norm(x4, torch.ones(8), eps=1e-50), r"^eps: 1e-50 is not representable"),
        (lambda: ops.attention(x4, x4, x4, scale=1e39), r"^scale: 1e\+39 is not representable"),
        (lambda: ops.attention(x4, x4, x4, scale=0.0), r"^scale: must be positive"),
        # an int beyond any float: float() raised OverflowError, naming nothing
        (lambda: ops.rms_norm(x4, torch.ones(8), eps=10**400), r"^eps: int value too large for float32"),
        (lambda: ops.rope(x4, theta=10**400), r"^theta: int value too large for float32"),
        (lambda: ops.attention(x4, x4, x4, scale=-(10**400)), r"^scale: int value too large"),
        (
            lambda: ops.rope(x4, start_pos=2**31 - 4),
            r"^start_pos: positions up to start_pos \+ S = 2147483647",
        ),
        (lambda: ops.rope(x4, start_pos=2**63), r"^start_pos: 9223372036854775808 is outside the int64"),
        (lambda: ops.rope(x4, start_pos=(1 << 24) - 2), r"^start_pos: positions up to .* exceed 2\^24"),
        (
            lambda: ops.rms_norm(x4, torch.ones(8), casting="bf16"),
            r"^casting: expected one of 'fp32', 'llama'",
        ),
        (  # wrapped to -100 (the default ignore_index) on its way to the kernels: rows silently ignored
            lambda: ops.linear_cross_entropy(
                x4[0, 0], torch.ones(3, 8), torch.zeros(2, dtype=torch.long), ignore_index=2**64 - 100
            ),
            r"^ignore_index: 18446744073709551516 is outside the int64 range",
        ),
        (
            lambda: ops.linear_cross_entropy(
                x4[0, 0], torch.ones(3, 8), torch.zeros(2, dtype=torch.long), ignore_index=-(2**63) - 100
            ),
            r"^ignore_index: -9223372036854775908 is outside the int64 range",
        ),
    ],
)
def test_scalar_ranges_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rope_position_bound_is_inclusive():
    y = ops.rope(torch.randn(1, 3, 2, 8, dtype=torch.float64), start_pos=(1 << 24) - 3, backend="torch")
    assert y.isfinite().all()


def test_lazily_negated_inputs_are_read_by_value(backend_name, device):
    """A tensor with the neg bit (torch._neg_view; z.conj().imag) holds -values in memory: the kernels read
    memory, so triton and mojo computed from -x (rms_norm off by 6.4) with the same key as a plain tensor.
    Inputs, weights and a backward's output gradient are read by value, on first and remembered calls."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 64, generator=g).to(device)
    w = (torch.rand(64, generator=g) + 0.5).to(device)
    neg = lambda t: torch._neg_view(-t)  # the same values, negated lazily
    assert neg(x).is_neg() and torch.equal(neg(x), x)
    for _ in range(2):  # the plain call first (remembered), then the lazily negated one, twice
        want = ops.rms_norm(x, w, backend=backend_name)
        assert torch.equal(ops.rms_norm(neg(x), w, backend=backend_name), want)
        assert torch.equal(ops.rms_norm(x, neg(w), backend=backend_name), want)
        s = ops.reduce_sum(x, -1, backend=backend_name)
        assert torch.equal(ops.reduce_sum(neg(x), -1, backend=backend_name), s)
    xr = x.clone().requires_grad_()
    dy = torch.randn(4, 64, generator=g).to(device)
    dyt = torch.randn(64, 4, generator=g).to(device).t()  # a transposed grad: its negation stays transposed
    grads = []
    for gy in (dy, neg(dy), dy, dyt.contiguous(), neg(dyt)):
        xr.grad = None
        ops.rms_norm(xr, w, backend=backend_name).backward(gy)
        grads.append(xr.grad)
    assert torch.equal(grads[1], grads[0]) and torch.equal(grads[2], grads[0])
    assert torch.equal(grads[4], grads[3])


def test_inference_mode_with_enable_grad_records_no_gradient(backend_name, device):
    """torch records nothing inside inference_mode, even under enable_grad (F.rms_norm returns an inference
    tensor without grad_fn); fusekit tried to save inference tensors for backward and raised, also after a
    gradient call of the same signature was remembered outside the mode."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).to(device)
    w = torch.ones(16, device=device, requires_grad=True)
    ops.rms_norm(x, w, backend=backend_name).sum().backward()  # remembered with a gradient
    for _ in range(2):
        with torch.inference_mode(), torch.enable_grad():
            y = ops.rms_norm(x, w, backend=backend_name)
        assert y.is_inference() and not y.requires_grad and y.grad_fn is None
        torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (16,), w.detach(), 1e-6))


def _odd_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one element into a flat buffer: not 16-byte aligned (the
    layout of a parameter packed into a flat buffer at an odd offset)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    v = flat[1:].view(t.shape)
    v.copy_(t)
    assert v.is_contiguous() and v.data_ptr() % 16 != 0
    return v


@pytest.mark.parametrize("T", [1, 5, 40])  # 1, 5: the decode GEMVs (16-byte weight loads on a GPU)
def test_weights_at_an_odd_offset_of_a_flat_buffer(backend_name, device, T):
    """Misaligned but contiguous operands give the aligned operands' result: mojo's GEMV loaded 16 bytes at
    a time from any weight pointer (a misaligned-address fault on a GPU, which poisons the CUDA context).
    Within rounding: a misaligned pointer takes another path (MKL here, by 1e-6; triton's pointer kernel
    instead of its TMA one on a GPU, another accumulation order: one or two bf16 ulps of the ~1-3 outputs,
    where a misread weight would be off by O(1))."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = {"rtol": 2e-2, "atol": 3e-2} if dtype == torch.bfloat16 else {}
    g = torch.Generator().manual_seed(3)
    D, F = 64, 96
    x = torch.randn(T, D, generator=g).to(device, dtype)
    ws = [(torch.randn(*s, generator=g) / 8).to(device, dtype) for s in ((F, D), (F, D), (D, F))]
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    want = ops.swiglu_ffn(x, *ws, norm_weight=nw, backend=backend_name)
    for args in (
        (_odd_view(x), *ws, nw),
        (x, *[_odd_view(w) for w in ws], _odd_view(nw)),
    ):
        got = ops.swiglu_ffn(args[0], *args[1:4], norm_weight=args[4], backend=backend_name)
        torch.testing.assert_close(got, want, **tol)
    want = ops.swiglu_ffn(x, *ws, backend=backend_name)  # no norm: the GEMV reads x itself
    got = ops.swiglu_ffn(_odd_view(x), *[_odd_view(w) for w in ws], backend=backend_name)
    torch.testing.assert_close(got, want, **tol)
    y = ops.rms_norm(x, nw, backend=backend_name)
    torch.testing.assert_close(
        ops.rms_norm(_odd_view(x), _odd_view(nw), backend=backend_name), y, rtol=0, atol=0
    )


@pytest.mark.filterwarnings("ignore:.*(beta|prototype)")  # torch's notes on sparse CSR / nested tensors
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_non_strided_tensors_are_named(layout):
    """Sparse and nested tensors have no strides: torch's own error leaked out of the memo key."""
    x = torch.randn(4, 8)
    make = {
        "sparse_coo": lambda t: t.to_sparse(),
        "sparse_csr": lambda t: t.to_sparse_csr(),
        "nested": lambda t: torch.nested.nested_tensor([t[:2], t[2:]]),
    }[layout]
    name = "nested" if layout == "nested" else layout
    with pytest.raises(TypeError, match=rf"^x: expected a dense \(strided\) tensor, got a {name} one"):
        ops.rms_norm(make(x), torch.ones(8))
    with pytest.raises(TypeError, match=r"^weight: expected a dense"):
        ops.rms_norm(x, torch.ones(8).to_sparse())
    with pytest.raises(TypeError, match=r"^x: expected a dense"):
        ops.reduce_sum(make(x))
    with pytest.raises(TypeError, match=r"^target: expected a dense"):
        ops.linear_cross_entropy(x, torch.ones(3, 8), torch.zeros(4, dtype=torch.long).to_sparse())


# --- 3. flags must be bools; integer-like positions are accepted -------------------------------------
@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ops.attention(x4, x4, x4, causal="no"), r"^causal: expected a bool, got str 'no'"),
        (lambda: ops.attention(x4, x4, x4, causal=1), r"^causal: expected a bool, got int"),
        (lambda: ops.rope(x4, interleaved="yes"), r"^interleaved: expected a bool"),
        (lambda: ops.rope(x4, interleaved=None), r"^interleaved: expected a bool"),
        (lambda: ops.rope(x4, start_pos=1.0), r"^start_pos: expected an int, got float"),
        (lambda: ops.rope(x4, start_pos=True), r"^start_pos: expected an int, got bool"),
        (lambda: ops.rope(x4, start_pos=torch.tensor([1])), r"^start_pos: expected an int or a 0-d"),
        (lambda: ops.rope(x4, start_pos=torch.tensor(1.0)), r"^start_pos: expected an int or a 0-d"),
        (lambda: ops.rms_norm(x4, torch.ones(8), casting=1), r"^casting: expected one of"),
        (
            lambda: ops.rms_norm(x4, torch.ones(8), return_rstd="no"),
            r"^return_rstd: expected a bool, got str",
        ),
        (
            lambda: ops.layer_norm(x4, torch.ones(8), return_stats=1),
            r"^return_stats: expected a bool, got int",
        ),
    ],
)
def test_loose_flags_rejected(call, match):
    with pytest.raises(TypeError, match=match):
        call()


@pytest.mark.parametrize(
    "start_pos", [np.int64(5), np.int32(5), torch.tensor(5), torch.tensor(5, dtype=torch.int32)]
)
def test_integer_like_start_pos(start_pos):
    want = ops.rope(x4, start_pos=5, backend="torch")
    assert torch.equal(ops.rope(x4, start_pos=start_pos, backend="torch"), want)


def test_numpy_bool_flags():
    want = ops.attention(x4, x4, x4, causal=True, backend="torch")
    assert torch.equal(ops.attention(x4, x4, x4, causal=np.bool_(True), backend="torch"), want)


# --- 4. thread safety: many threads give the serial results -----------------------------------------
def _workload(backend: str, device: str):
    g = torch.Generator().manual_seed(3)

    def r(*s):
        return torch.randn(*s, generator=g).to(device)

    x, w, xr = r(37, 96), r(96), r(2, 5, 3, 16)
    calls = [
        lambda: ops.reduce_sum(x, backend=backend),
        lambda: ops.rms_norm(x, w, backend=backend),
        lambda: ops.layer_norm(x, w, w, backend=backend),
        lambda: ops.rope(xr, start_pos=3, backend=backend),
    ]
    return calls


def test_threads_give_serial_results(backend_name, device):
    calls = _workload(backend_name, device)
    serial = [c() for c in calls]
    results: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for rep in range(3):
                for i, c in enumerate(calls):
                    results[(t, rep * len(calls) + i)] = c()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    for (_, j), got in results.items():
        want = serial[j % len(calls)]
        assert torch.equal(got, want), f"call {j % len(calls)} differed under threads"


# --- 5. no hang for extreme but legal thetas (each backend, in a subprocess) -------------------------
@pytest.mark.parametrize("theta", [1e-30, 1e-38, 3e38])
def test_rope_extreme_theta_finishes(backend_name, device, theta):
    """Angles far beyond 2^26 rad (theta < 1) must come out finite and still be rotations.

    No two implementations agree on cos/sin of an fp32 angle of 1e30 (one ulp of the fp32 inverse
    frequency moves it by 1e23 rad), so the check is what every rotation keeps: the norm of each pair.
    """
    code = (
        "import torch, sys; from fusekit import ops\n"
        f"x = torch.randn(1, 4, 2, 16).to('{device}')\n"
        "try:\n"
        f"    y = ops.rope(x, start_pos=7, theta={theta!r}, backend='{backend_name}')\n"
        "except ValueError as e:\n"
        "    print('refused', e); sys.exit(3)\n"
        "assert y.isfinite().all(), y\n"
        "pair = lambda t: t[..., :8].double() ** 2 + t[..., 8:].double() ** 2\n"
        "err = ((pair(y) - pair(x)).abs() / pair(x).clamp_min(1e-6)).max().item()\n"
        "print('err', err); assert err < 1e-5, err\n"
    )
    # keep the caller's PYTHONPATH after ours: MAX (or Liger) may be on it, not installed
    path = [
        str(PYTHON_DIR),
        str(PYTHON_DIR.parent),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    env = {
        "PYTHONPATH": os.pathsep.join(path),
        "TRITON_INTERPRET": "1" if device == "cpu" else "0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_fused_residual_leaf_grads_are_separate_buffers(backend_name, device, op):
    """x and residual both leaves (not 2-d): the fused norm's backward gives both the same dx, and the
    [M, N] views made of them turned it into two views of one storage that both leaves kept as .grad: a
    second accumulation added into it twice (3x the gradient instead of 2x) and zeroing x.grad zeroed
    residual.grad. Found by a read-only audit helper (every backend)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(11)
    x, r = (torch.randn(2, 3, 40, generator=g).to(device).requires_grad_() for _ in range(2))
    w, b = torch.randn(40, generator=g).to(device), torch.randn(40, generator=g).to(device)
    xd, rd = (t.detach().cpu().double().requires_grad_() for t in (x, r))
    hd = xd + rd
    if op == "rms_norm":
        want = hd * (hd.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * w.cpu().double()
    else:
        want = F.layer_norm(hd, (40,), w.cpu().double(), b.cpu().double(), 1e-6)
    want.sum().backward()
    for _ in range(2):  # two accumulation steps
        if op == "rms_norm":
            y, _h = ops.rms_norm(x, w, 1e-6, residual=r, backend=backend_name)
        else:
            y, _h = ops.layer_norm(x, w, b, 1e-6, residual=r, backend=backend_name)
        y.sum().backward()
    assert x.grad.data_ptr() != r.grad.data_ptr()
    for got, ref in ((x.grad, xd.grad), (r.grad, rd.grad)):
        torch.testing.assert_close(got.cpu().double(), 2 * ref, rtol=1e-4, atol=1e-4)
    x.grad.zero_()
    torch.testing.assert_close(r.grad.cpu().double(), 2 * rd.grad, rtol=1e-4, atol=1e-4)


def test_residual_stream_of_a_model_takes_no_gradient_copy():
    """own_residual_grad copies a gradient only where leaves could keep it: a sublayer's output beside the
    last norm's h (a model's residual stream) passes through as is; a leaf, or a view of one, does not."""
    from fusekit.ops._norms import own_residual_grad

    g = torch.Generator().manual_seed(12)
    p, lin = torch.randn(2, 3, 8, generator=g, requires_grad=True), torch.nn.Linear(8, 8)
    _y, h = ops.rms_norm(p * 2, torch.ones(8), residual=p * 3, backend="torch")
    out = lin(h)  # a sublayer's output: its grad goes into the linear's backward, which makes new tensors
    assert own_residual_grad(out, h) is h
    leaf = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    assert own_residual_grad(out, leaf) is leaf  # x's gradient is consumed: nothing shared survives
    c = leaf.clone()  # a clone hands its gradient on unchanged: to the leaf, which keeps it
    assert own_residual_grad(leaf.view(6, 8).view(2, 3, 8), c) is not c
    with torch.no_grad():
        assert own_residual_grad(leaf, leaf) is leaf


def test_fused_residual_under_torch_func_grad_gets_the_ops_refusal():
    """Under torch.func.grad over x and residual, the gradient-copy identity (own_residual_grad) must not
    raise torch's setup_context error before the op's own refusal, which names the op."""
    x, r, w = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(8)
    f = lambda x, r: ops.rms_norm(x, w, residual=r, backend="torch")[0].sum()
    with pytest.raises(ValueError, match=r"rms_norm: called inside a torch\.func transform"):
        torch.func.grad(f, argnums=(0, 1))(x, r)
