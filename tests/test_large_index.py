"""Inputs past 2^31 elements (issue #15 item 2): correct results on every backend, never wrapped indices.

    pytest tests/test_large_index.py --device cuda --backends triton,mojo -m large

GPU only (marked `large`; skipped on the CPU and when the GPU has too little free memory): several GB per
tensor, so each test checks a sample against a float64 reference computed on the sampled rows (or heads)
only, never on a float64 copy of the whole input. The samples always include the rows on both sides of
element 2^31 and the last row, where an int32 offset would wrap. Sizes:
- reduce_sum: 2^31 + 17 elements (fp32, bf16, int32 -> int64), the elements from 2^31 - 8 on set to
  large sentinels so a dropped or repeated tail moves the sum far past the tolerance;
- rms_norm / layer_norm: 2^20 x 2304 bf16 (2.42e9 elements), with and without the fused residual, and
  dx of the backward on the sampled rows;
- rope: 260 x 512 x 128 x 128 bf16 (B S H D, 2.18e9 elements), forward and dx;
- attention: 520 x 32 x 1024 x 128 bf16 (B H S D, q, k, v and o each 2.18e9 elements), causal and not,
  o and dq, dk, dv on sampled heads; and decode (S = 16, GQA 32/8, 33000 sequences: q past 2^31, k/v past
  2^31 too), which takes the split-KV kernel on Triton;
- swiglu_ffn: D 4096, F 11008 bf16 (the (D, F) of mojo's static tensor-core path) with a norm, at T 196608
  (h [T, F] and gu [T, 2F] past 2^31 elements: forward, and dx of the backward) and at T 528384 (x and out
  [T, D] past 2^31 as well: forward; mojo's padded-output copy had an Int32 length there);
- linear_cross_entropy: V 32000, H 4096 bf16, T 589824: x [T, H] and each chunk's logits [C, V] (C 131072,
  4.2e9 elements) past 2^31; per-row losses (reduction="none") and dx of reduction="sum".
"""

from __future__ import annotations

import gc

import pytest
import torch
from checks import assert_close

import fusekit
from fusekit.ops.attention import reference_forward as attention_ref
from fusekit.ops.layer_norm import reference_forward as layer_norm_ref
from fusekit.ops.linear_cross_entropy import chunk_rows
from fusekit.ops.rms_norm import reference_forward as rms_norm_ref
from fusekit.ops.rope import reference_forward as rope_ref
from fusekit.ops.swiglu_ffn import reference_forward as swiglu_ref
from fusekit.tolerances import rtol

pytestmark = pytest.mark.large

BIG = 1 << 31  # the first element index an int32 offset cannot address
GIB = 1 << 30
BF16 = torch.bfloat16
F64 = torch.float64


@pytest.fixture
def cuda(device: str):
    """The CUDA device of a test; its tensors are released afterwards (the next test needs the memory)."""
    if device != "cuda":
        pytest.skip("large-index tests need --device cuda (several GB per tensor)")
    yield device
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def seed() -> int:
    s = torch.seed() % (1 << 31)  # fresh every test; printed in every failure message for a repro
    torch.manual_seed(s)
    return s


def _need(gib: float, backend: str) -> None:
    """Skip unless `gib` GiB (x 3 for the torch backend: its fp32 intermediates) are free on the GPU."""
    want = gib * (3 if backend == "torch" else 1.25) * GIB
    free, _ = torch.cuda.mem_get_info()
    if free < want:
        pytest.skip(f"needs ~{want / GIB:.0f} GiB of free GPU memory, {free / GIB:.0f} GiB free")


def _call(fn, *args, **kwargs):
    """The op's result; a backend that declares it cannot run the call is a skip, as in the conformance, and
    so is running out of GPU memory (a size limit of this GPU, not an indexing error)."""
    try:
        with fusekit.poisoned():
            return fn(*args, **kwargs)
    except torch.cuda.OutOfMemoryError as exc:
        pytest.skip(f"out of GPU memory: {exc}")
    except ValueError as exc:
        msg = str(exc)
        if "cannot run" in msg or "has no backward here" in msg:
            pytest.skip(msg)
        raise


def _grad(out: torch.Tensor, inputs: tuple, dout: torch.Tensor) -> tuple:
    with fusekit.poisoned():
        return torch.autograd.grad(out, inputs, dout)


def _rows(m: int, row_elems: int, n_random: int = 4) -> list[int]:
    """Sampled row indices of an [m, row_elems] tensor: the first, the ones around element 2^31, the
    last, and a few random ones."""
    b = BIG // row_elems
    fixed = [0, 1, b - 1, b, b + 1, m - 1]
    rnd = torch.randint(0, m, (n_random,)).tolist()
    return sorted({r for r in fixed + rnd if 0 <= r < m})


# ---- reduce_sum --------------------------------------------------------------------------------------------
def _chunked_sum(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """sum(x) (or sum(x^2)) in float64 (int64 for integers), 2^27 elements at a time."""
    acc = F64 if x.dtype.is_floating_point else torch.int64
    tot = torch.zeros((), dtype=acc, device=x.device)
    for i in range(0, x.numel(), 1 << 27):
        c = x[i : i + (1 << 27)].to(acc)
        tot += (c * c).sum() if square else c.sum()
    return tot


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.int32], ids=str)
def test_reduce_sum_past_2_31(dtype, backend_name, cuda, seed):
    n = BIG + 17
    _need(n * dtype.itemsize / GIB + 2, backend_name)
    if dtype.is_floating_point:
        x = torch.rand(n, device=cuda, dtype=dtype).mul_(2).sub_(1)  # zero mean: the sum is ~sqrt(n)
        sentinel = 64.0
    else:
        x = torch.randint(-1000, 1000, (n,), device=cuda, dtype=dtype)
        sentinel = 1 << 30  # 25 of them overflow int32: the int64 accumulation is checked as well
    x[BIG - 8 :] = sentinel
    repro = f"reduce_sum {dtype} n={n} backend={backend_name} seed={seed}"
    got = _call(fusekit.ops.reduce_sum, x, backend=backend_name)
    want = _chunked_sum(x)
    if not dtype.is_floating_point:
        assert got.dtype == torch.int64, repro
        assert got.item() == want.item(), f"{got.item()} != {want.item()} [{repro}]"
        return
    scale = _chunked_sum(x, square=True).sqrt()  # dropping the 25 sentinels moves the sum by ~1600 / 27000
    assert_close("reduce_sum", got, want, rtol("reduce_sum", dtype), repro, scale)


# ---- rms_norm / layer_norm ---------------------------------------------------------------------------------
NORM_M, NORM_N = 1 << 20, 2304  # 2.42e9 elements of bf16


def _norm_ref(
    op: str, xin: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """float64 y of the rows `xin` (float64 copies of x, or of h = x + residual rounded as the op does)."""
    if op == "rms_norm":
        return rms_norm_ref(xin, None, w.to(F64), eps, "fp32")[0]
    return layer_norm_ref(xin, None, w.to(F64), None if b is None else b.to(F64), eps)[0]


def _norm_call(op: str, x, w, b, eps: float, residual, backend: str):
    if op == "rms_norm":
        return _call(fusekit.ops.rms_norm, x, w, eps, residual=residual, backend=backend)
    return _call(fusekit.ops.layer_norm, x, w, b, eps, residual=residual, backend=backend)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norm_forward_past_2_31(op, residual, backend_name, cuda, seed):
    M, N = NORM_M, NORM_N
    _need(M * N * 2 * (4 if residual else 2) / GIB + 2, backend_name)
    x = torch.randn(M, N, device=cuda, dtype=BF16)
    r = torch.randn(M, N, device=cuda, dtype=BF16) if residual else None
    w = torch.rand(N, device=cuda, dtype=BF16).add_(0.5)
    b = torch.randn(N, device=cuda, dtype=BF16) if op == "layer_norm" else None
    eps = 1e-5
    out = _norm_call(op, x, w, b, eps, r, backend_name)
    y, h = (out[0], out[1]) if residual else (out, None)
    tol = rtol(op, BF16)
    for row in _rows(M, N):
        repro = f"{op} residual={residual} row={row} of {M}x{N} bf16 backend={backend_name} seed={seed}"
        xin = x[row : row + 1]
        if residual:
            xin = (xin.float() + r[row : row + 1].float()).to(BF16)  # h as the op defines it: one rounding
            assert_close(f"{op}.h", h[row : row + 1], xin, tol, repro)
        assert_close(f"{op}.y", y[row : row + 1], _norm_ref(op, xin.to(F64), w, b, eps), tol, repro)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norm_backward_past_2_31(op, backend_name, cuda, seed):
    M, N = NORM_M, NORM_N
    _need(M * N * 2 * 4 / GIB + 4, backend_name)
    x = torch.randn(M, N, device=cuda, dtype=BF16).requires_grad_()
    w = torch.rand(N, device=cuda, dtype=BF16).add_(0.5)
    b = torch.randn(N, device=cuda, dtype=BF16) if op == "layer_norm" else None
    eps = 1e-5
    y = _norm_call(op, x, w, b, eps, None, backend_name)
    dy = torch.randn(M, N, device=cuda, dtype=BF16)
    (dx,) = _grad(y, (x,), dy)
    del y
    tol = rtol(op, BF16, "backward")
    for row in _rows(M, N):
        repro = f"{op} backward row={row} of {M}x{N} bf16 backend={backend_name} seed={seed}"
        xr = x.detach()[row : row + 1].to(F64).requires_grad_()
        (want,) = torch.autograd.grad(_norm_ref(op, xr, w, b, eps), (xr,), dy[row : row + 1].to(F64))
        assert_close(f"{op}.dx", dx[row : row + 1], want, tol, repro)


# ---- rope --------------------------------------------------------------------------------------------------
ROPE_SHAPE = (260, 512, 128, 128)  # B S H D: 2.18e9 elements; positions stay < 512 (exact fp32 angles)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_rope_past_2_31(interleaved, backend_name, cuda, seed):
    B, S, H, D = ROPE_SHAPE
    _need(B * S * H * D * 2 * 4 / GIB + 2, backend_name)
    x = torch.randn(B, S, H, D, device=cuda, dtype=BF16).requires_grad_()
    y = _call(fusekit.ops.rope, x, interleaved=interleaved, backend=backend_name)
    dy = torch.randn_like(y)
    (dx,) = _grad(y, (x,), dy)
    tol = rtol("rope", BF16)
    for bi in _rows(B, S * H * D, n_random=1):  # whole sequences: position = s does not depend on b
        repro = (
            f"rope interleaved={interleaved} b={bi} of {ROPE_SHAPE} bf16 backend={backend_name} seed={seed}"
        )
        xr = x.detach()[bi : bi + 1].to(F64).requires_grad_()
        want = rope_ref(xr, None, None, None, None, 0, 10000.0, interleaved)[0]
        assert_close("rope.y", y.detach()[bi : bi + 1], want, tol, repro)
        (dwant,) = torch.autograd.grad(want, (xr,), dy[bi : bi + 1].to(F64))
        assert_close("rope.dx", dx[bi : bi + 1], dwant, rtol("rope", BF16, "backward"), repro)


# ---- attention ---------------------------------------------------------------------------------------------
ATTN_SHAPE = (520, 32, 1024, 128)  # B H S D: q, k, v, o 2.18e9 elements each
DECODE_SHAPE = (33000, 32, 8, 16, 64, 128)  # B H Hkv S Skv D: q, o 2.16e9 elements, k, v 2.16e9 each


def _heads(B: int, H: int, S: int, D: int) -> list[tuple[int, int]]:
    """Sampled (b, h) query heads: the first, both sides of element 2^31 of q, the last, one random."""
    return [(i // H, i % H) for i in _rows(B * H, S * D, n_random=1)]


def _attn_check(q, k, v, o, causal: bool, grads, do, heads, repro: str) -> None:
    H, Hkv = q.shape[1], k.shape[1]
    tol = rtol("attention", BF16)
    for b, h in heads:
        hk = h // (H // Hkv)
        r = f"{repro} b={b} h={h}"
        leaves = [
            t.detach()[b : b + 1, hh : hh + 1].to(F64).requires_grad_()
            for t, hh in ((q, h), (k, hk), (v, hk))
        ]
        want, _ = attention_ref(*leaves, None, causal, q.shape[-1] ** -0.5)
        assert_close("attention.o", o.detach()[b : b + 1, h : h + 1], want, tol, r)
        if grads is None:
            continue
        # dk/dv of kv head hk sum over its whole query group: the one-head reference matches them only
        # without GQA (the prefill test, Hkv == H).
        ref = torch.autograd.grad(want, leaves, do[b : b + 1, h : h + 1].to(F64))
        for name, g, w, hh in zip(("dq", "dk", "dv"), grads, ref, (h, hk, hk)):
            assert_close(
                f"attention.{name}", g[b : b + 1, hh : hh + 1], w, rtol("attention", BF16, "backward"), r
            )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_past_2_31(causal, backend_name, cuda, seed):
    B, H, S, D = ATTN_SHAPE
    n = B * H * S * D
    _need(n * 2 * 8 / GIB + 4, backend_name)
    q, k, v = (torch.randn(B, H, S, D, device=cuda, dtype=BF16).requires_grad_() for _ in range(3))
    o = _call(fusekit.ops.attention, q, k, v, causal=causal, backend=backend_name)
    do = torch.randn_like(o)
    grads = _grad(o, (q, k, v), do)
    repro = f"attention causal={causal} {(B, H, S, D)} bf16 backend={backend_name} seed={seed}"
    _attn_check(q, k, v, o, causal, grads, do, _heads(B, H, S, D), repro)


def test_attention_decode_past_2_31(backend_name, cuda, seed):
    B, H, Hkv, S, Skv, D = DECODE_SHAPE
    _need(B * H * S * D * 2 * 4 / GIB + 2, backend_name)
    q = torch.randn(B, H, S, D, device=cuda, dtype=BF16)
    k, v = (torch.randn(B, Hkv, Skv, D, device=cuda, dtype=BF16) for _ in range(2))
    with torch.no_grad():
        o = _call(fusekit.ops.attention, q, k, v, causal=True, backend=backend_name)
    repro = f"attention decode {(B, H, Hkv, S, Skv, D)} bf16 backend={backend_name} seed={seed}"
    _attn_check(q, k, v, o, True, None, None, _heads(B, H, S, D), repro)


# ---- swiglu_ffn --------------------------------------------------------------------------------------------
FFN_D, FFN_F = 4096, 11008  # Llama-2-7B: mojo's static tensor-core pair, so its GEMMs (and copy) run
# T: h [T, F] (and gu [T, 2F]) past 2^31 elements; and T * D past 2^31 too (x, xn, out, mojo's out_pad)
FFN_T = {"TxF": 196608, "TxD": 528384}


def _ffn_inputs(T: int, cuda: str):
    D, F = FFN_D, FFN_F
    x = torch.randn(T, D, device=cuda, dtype=BF16)
    # weights scaled like a trained layer (std 1/sqrt(fan_in)): activations stay O(1)
    wg = torch.randn(F, D, device=cuda, dtype=BF16).mul_(D**-0.5)
    wu = torch.randn(F, D, device=cuda, dtype=BF16).mul_(D**-0.5)
    wd = torch.randn(D, F, device=cuda, dtype=BF16).mul_(F**-0.5)
    nw = torch.rand(D, device=cuda, dtype=BF16).add_(0.5)
    return x, wg, wu, wd, nw


def _ffn_rows(T: int) -> list[int]:
    """Rows on both sides of element 2^31 of every [T, n] buffer the op touches: x / out (D), h (F), gu (2F)."""
    return sorted(set(_rows(T, FFN_D, 2)) | set(_rows(T, FFN_F, 2)) | set(_rows(T, 2 * FFN_F, 0)))


@pytest.mark.parametrize("case", list(FFN_T))
def test_swiglu_ffn_past_2_31(case, backend_name, cuda, seed):
    T, D, F = FFN_T[case], FFN_D, FFN_F
    # x, out, xn, mojo's out_pad [T, D]; h [T, F] bf16; mojo's g [T, F] fp32
    _need(T * (4 * D + F) * 2 / GIB + T * F * 4 / GIB + 2, backend_name)
    x, wg, wu, wd, nw = _ffn_inputs(T, cuda)
    eps = 1e-6
    with torch.no_grad():
        y = _call(fusekit.ops.swiglu_ffn, x, wg, wu, wd, norm_weight=nw, eps=eps, backend=backend_name)
    w64 = [t.to(F64) for t in (wg, wu, wd, nw)]
    tol = rtol("swiglu_ffn", BF16)
    for row in _ffn_rows(T):
        repro = f"swiglu_ffn {case} row={row} of T={T} D={D} F={F} bf16 backend={backend_name} seed={seed}"
        want = swiglu_ref(x[row : row + 1].to(F64), *w64[:3], w64[3], eps)[0]
        assert_close("swiglu_ffn.y", y[row : row + 1], want, tol, repro)


def test_swiglu_ffn_backward_past_2_31(backend_name, cuda, seed):
    T, D, F = FFN_T["TxF"], FFN_D, FFN_F
    # forward as above plus the saved gu [T, 2F]; backward dy, dx [T, D] and dh, h, dg, du [T, F]
    _need(T * (7 * D + 7 * F) * 2 / GIB + T * F * 4 / GIB + 4, backend_name)
    x, wg, wu, wd, nw = _ffn_inputs(T, cuda)
    x.requires_grad_()
    eps = 1e-6
    y = _call(fusekit.ops.swiglu_ffn, x, wg, wu, wd, norm_weight=nw, eps=eps, backend=backend_name)
    dy = torch.randn_like(y)
    (dx,) = _grad(y, (x,), dy)
    del y
    w64 = [t.to(F64) for t in (wg, wu, wd, nw)]
    tol = rtol("swiglu_ffn", BF16, "backward")
    for row in _ffn_rows(T):
        repro = f"swiglu_ffn backward row={row} of T={T} D={D} F={F} bf16 backend={backend_name} seed={seed}"
        xr = x.detach()[row : row + 1].to(F64).requires_grad_()
        want = swiglu_ref(xr, *w64[:3], w64[3], eps)[0]
        (dwant,) = torch.autograd.grad(want, (xr,), dy[row : row + 1].to(F64))
        assert_close("swiglu_ffn.dx", dx[row : row + 1], dwant, tol, repro)


# ---- linear_cross_entropy ----------------------------------------------------------------------------------
LCE_T, LCE_H, LCE_V = 589824, 4096, 32000  # x [T, H] 2.4e9 elements; chunks of C = 131072 rows: C x V 4.2e9


def _lce_inputs(cuda: str):
    x = torch.randn(LCE_T, LCE_H, device=cuda, dtype=BF16)
    w = torch.randn(LCE_V, LCE_H, device=cuda, dtype=BF16).mul_(LCE_H**-0.5)  # logits ~ N(0, 1)
    t = torch.randint(0, LCE_V, (LCE_T,), device=cuda)
    t[BIG // LCE_V] = -100  # an ignored row next to element 2^31 of the first chunk's logits
    return x, w, t


def _lce_rows() -> list[int]:
    """Rows on both sides of element 2^31 of x and of the first chunk's logits (rows 0..C), and the last."""
    C = chunk_rows(LCE_T, LCE_V, LCE_H)
    assert C * LCE_V > BIG, f"the chunk rule changed: C={C} x V={LCE_V} no longer passes 2^31; resize"
    return sorted(set(_rows(LCE_T, LCE_H, 2)) | set(_rows(C, LCE_V, 0)) | {LCE_T - 1})


def test_linear_cross_entropy_past_2_31(backend_name, cuda, seed):
    T, H, V = LCE_T, LCE_H, LCE_V
    C = chunk_rows(T, V, H)
    _need((T * H + C * V) * 2 / GIB + 2, backend_name)
    x, w, t = _lce_inputs(cuda)
    with torch.no_grad():
        loss = _call(fusekit.ops.linear_cross_entropy, x, w, t, reduction="none", backend=backend_name)
    rows = _lce_rows()
    z = x[rows].to(F64) @ w.to(F64).T  # the float64 logits of the sampled rows only
    want = torch.nn.functional.cross_entropy(z, t[rows], ignore_index=-100, reduction="none")
    repro = f"linear_cross_entropy none rows={rows} T={T} H={H} V={V} bf16 backend={backend_name} seed={seed}"
    assert_close("linear_cross_entropy.loss", loss[rows], want, rtol("linear_cross_entropy", BF16), repro)


def test_linear_cross_entropy_grad_past_2_31(backend_name, cuda, seed):
    T, H, V = LCE_T, LCE_H, LCE_V
    C = chunk_rows(T, V, H)
    _need((2 * T * H + C * V) * 2 / GIB + 2, backend_name)
    x, w, t = _lce_inputs(cuda)
    x.requires_grad_()
    loss = _call(fusekit.ops.linear_cross_entropy, x, w, t, reduction="sum", backend=backend_name)
    (dx,) = _grad(loss, (x,), torch.ones_like(loss))
    del loss
    rows = _lce_rows()
    xr = x.detach()[rows].to(F64).requires_grad_()
    z = xr @ w.to(F64).T
    ref = torch.nn.functional.cross_entropy(z, t[rows], ignore_index=-100, reduction="sum")
    (want,) = torch.autograd.grad(ref, (xr,))  # "sum": row r's gradient depends on row r only
    repro = (
        f"linear_cross_entropy sum dx rows={rows} T={T} H={H} V={V} bf16 backend={backend_name} seed={seed}"
    )
    assert_close(
        "linear_cross_entropy.dx", dx[rows], want, rtol("linear_cross_entropy", BF16, "backward"), repro
    )
