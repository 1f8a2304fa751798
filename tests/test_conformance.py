"""Cross-backend conformance: op × backend × dtype × shape against the float64 oracle.

Every case draws fresh random inputs (the seed is printed on failure), runs with outputs poisoned
(NaN / INT_MIN) so unwritten elements fail, and compares by relative error with `tolerances.py`.
On `--device cuda` the shape lists grow to benchmark-sized problems.
"""

from __future__ import annotations

import math

import oracle
import pytest
import torch
from checks import assert_close, sum_scale
from tolerances import rtol

import fusekit
from fusekit import backends, ops

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FLOATS = (F32, F16, BF16)

# (shape, dim) for reduce_sum; 0-sized and 1-sized shapes included
REDUCE_CPU = [
    ((37,), None),
    ((3, 1000), -1),
    ((0,), None),
    ((1,), None),
    ((4097,), None),
    ((2, 3, 129), -1),
    ((5, 0), -1),
    ((6, 7), 0),
    ((2, 3, 5), 1),
    ((), None),
    ((40000,), None),
]
REDUCE_CUDA = [(((1 << 24) + 3,), None), ((4096, 8193), -1), ((1 << 26,), None), ((3, 1 << 22), -1)]
# [..., N] for the norms: odd hidden sizes, N = 1, empty rows
NORM_CPU = [(4, 64), (1, 1), (5, 111), (3, 4, 760), (2, 1128), (7, 3000), (0, 64), (2, 8192), (1, 70000)]
NORM_CUDA = [(4096, 8192), (37, 65536), (4, 262144), (199, 4097), (1024, 5120)]
# [B, S, H, D], start_pos
ROPE_CPU = [
    ((2, 5, 3, 8), 0),
    ((1, 7, 4, 64), 13),
    ((1, 1, 1, 2), 0),
    ((2, 33, 5, 128), 3),
    ((0, 4, 2, 16), 0),
]
ROPE_CUDA = [((2, 512, 32, 128), 0), ((1, 4096, 8, 128), 100), ((3, 77, 40, 96), 7)]
# (lead dims, D, F)
FFN_CPU = [((5,), 64, 96), ((1,), 16, 24), ((2, 3), 32, 80), ((37,), 48, 40), ((0,), 16, 24)]
FFN_CUDA = [((1,), 4096, 11008), ((16,), 4096, 11008), ((300,), 1024, 2816), ((2048,), 2048, 5632)]
# (B, H, Hkv, S, Skv, D)
ATTN_CPU = [
    (1, 2, 2, 16, 16, 64),
    (2, 4, 2, 37, 37, 64),
    (1, 4, 1, 16, 45, 64),
    (1, 2, 2, 45, 16, 128),
    (1, 2, 1, 33, 33, 256),
    (1, 1, 1, 1, 1, 64),
    (1, 2, 2, 0, 8, 64),
]
ATTN_CUDA = [
    (2, 8, 2, 1024, 1024, 128),
    (1, 16, 16, 777, 1025, 64),
    (1, 8, 4, 513, 256, 256),
    (4, 32, 32, 2048, 2048, 128),
]


def _cases(cpu: list, cuda: list, device: str) -> list:
    """CPU cases (the first two marked `fast`), plus the big ones on CUDA."""
    cases = [pytest.param(c, marks=pytest.mark.fast if i < 2 else ()) for i, c in enumerate(cpu)]
    return cases + (list(cuda) if device == "cuda" else [])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    device = metafunc.config.getoption("--device")
    table = {
        "reduce_case": (REDUCE_CPU, REDUCE_CUDA),
        "norm_shape": (NORM_CPU, NORM_CUDA),
        "rope_case": (ROPE_CPU, ROPE_CUDA),
        "ffn_case": (FFN_CPU, FFN_CUDA),
        "attn_case": (ATTN_CPU, ATTN_CUDA),
    }
    for name, (cpu, cuda) in table.items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, _cases(cpu, cuda, device), ids=str)


# --- helpers ---------------------------------------------------------------------------------------


@pytest.fixture
def seed() -> int:
    s = torch.seed() % (1 << 31)  # fresh every test; printed on failure for a repro
    torch.manual_seed(s)
    return s


def _require(backend: str, op: str, device: str, dtype: torch.dtype, **meta: object) -> None:
    why = backends.get(backend).supports(op, torch.device(device), dtype, **meta)
    if why is not None:
        pytest.skip(f"{backend} does not run {op} ({dtype}) on {device}: {why}")


def _randn(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)


# --- the suite -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, BF16, torch.int32, torch.int64], ids=str)
def test_reduce_sum(backend_name, device, dtype, reduce_case, seed):
    shape, dim = reduce_case
    out_dtype = dtype if dtype.is_floating_point else torch.int64
    _require(backend_name, "reduce_sum", device, dtype, out_dtype=out_dtype)
    if dtype.is_floating_point:
        x = _randn(*shape, dtype=dtype, device=device)
    else:  # int64 values past 2^31 so that a 32-bit accumulator would fail
        hi = 1 << 40 if dtype == torch.int64 else 1 << 20
        x = torch.randint(-hi, hi, shape, dtype=dtype, device=device)
    with fusekit.poisoned():
        out = ops.reduce_sum(x, dim, backend=backend_name)
    assert out.dtype == out_dtype
    # fp16 results of long sums: the output rounding (2^-11) dominates, as for any fp16 result
    assert_close(
        "reduce_sum",
        out,
        oracle.reduce_sum(x, dim),
        rtol("reduce_sum", dtype),
        f"shape={shape} dim={dim} {dtype} seed={seed}",
        scale=sum_scale(x, dim) if dtype.is_floating_point else None,
    )


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_reduce_sum_fp32_result(backend_name, device, dtype, seed):
    _require(backend_name, "reduce_sum", device, dtype, out_dtype=F32)
    x = _randn(3, 3001, dtype=dtype, device=device)
    with fusekit.poisoned():
        out = ops.reduce_sum(x, -1, dtype=F32, backend=backend_name)
    assert out.dtype == F32
    ref = oracle.reduce_sum(x, -1)
    assert_close("reduce_sum", out, ref, rtol("reduce_sum", F32), f"seed={seed}", sum_scale(x, -1))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rms_norm(backend_name, device, dtype, norm_shape, seed):
    _require(backend_name, "rms_norm", device, dtype)
    x = _randn(*norm_shape, dtype=dtype, device=device, scale=3.0)
    w = _randn(norm_shape[-1], dtype=dtype, device=device)
    with fusekit.poisoned():
        y, rstd = ops.rms_norm(x, w, 1e-6, return_rstd=True, backend=backend_name)
    ry, rr = oracle.rms_norm(x, w, 1e-6)
    repro = f"shape={norm_shape} {dtype} seed={seed}"
    assert y.dtype == dtype and rstd.dtype == F32
    assert_close("rms_norm.y", y, ry, rtol("rms_norm", dtype), repro)
    assert_close("rms_norm.rstd", rstd, rr, rtol("rms_norm", F32) * 10, repro)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_layer_norm(backend_name, device, dtype, norm_shape, with_bias, seed):
    _require(backend_name, "layer_norm", device, dtype)
    # an offset mean tests that the variance is computed stably
    x = (_randn(*norm_shape, dtype=F32, device=device, scale=2.0) + 5.0).to(dtype)
    w = _randn(norm_shape[-1], dtype=dtype, device=device)
    b = _randn(norm_shape[-1], dtype=dtype, device=device) if with_bias else None
    with fusekit.poisoned():
        y, mean, rstd = ops.layer_norm(x, w, b, 1e-5, return_stats=True, backend=backend_name)
    ry, rm, rr = oracle.layer_norm(x, w, b, 1e-5)
    repro = f"shape={norm_shape} {dtype} bias={with_bias} seed={seed}"
    assert_close("layer_norm.y", y, ry, rtol("layer_norm", dtype), repro)
    assert_close("layer_norm.mean", mean, rm, rtol("layer_norm", F32) * 10, repro)
    assert_close("layer_norm.rstd", rstd, rr, rtol("layer_norm", F32) * 10, repro)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("tables", [False, True], ids=["inkernel", "tables"])
def test_rope(backend_name, device, dtype, rope_case, interleaved, tables, seed):
    shape, start_pos = rope_case
    _require(backend_name, "rope", device, dtype, tables=tables)
    x = _randn(*shape, dtype=dtype, device=device)
    theta = 500000.0 if shape[-1] >= 128 else 10000.0
    cos = sin = None
    if tables:  # tables longer than needed, read from row start_pos
        pos = torch.arange(start_pos + shape[1] + 5, dtype=torch.float64, device=device)
        inv = theta ** (-(2.0 * torch.arange(shape[-1] // 2, dtype=torch.float64, device=device)) / shape[-1])
        ang = pos[:, None] * inv[None, :]
        cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    with fusekit.poisoned():
        y = ops.rope(
            x,
            start_pos=start_pos,
            theta=theta,
            interleaved=interleaved,
            cos=cos,
            sin=sin,
            backend=backend_name,
        )
    ref = oracle.rope(x, start_pos, theta, interleaved, cos, sin)
    assert_close(
        "rope",
        y,
        ref,
        rtol("rope", dtype),
        f"shape={shape} start_pos={start_pos} interleaved={interleaved} tables={tables} {dtype} seed={seed}",
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
def test_swiglu_ffn(backend_name, device, dtype, ffn_case, norm, seed):
    lead, d, f = ffn_case
    _require(backend_name, "swiglu_ffn", device, dtype)
    x = _randn(*lead, d, dtype=dtype, device=device)
    # weights scaled like a trained layer (std 1/sqrt(fan_in)) so activations stay O(1)
    wg = _randn(f, d, dtype=dtype, device=device, scale=d**-0.5)
    wu = _randn(f, d, dtype=dtype, device=device, scale=d**-0.5)
    wd = _randn(d, f, dtype=dtype, device=device, scale=f**-0.5)
    nw = (1.0 + 0.1 * torch.randn(d, device=device)).to(dtype) if norm else None
    with fusekit.poisoned():
        y = ops.swiglu_ffn(x, wg, wu, wd, norm_weight=nw, eps=1e-6, backend=backend_name)
    ref = oracle.swiglu_ffn(x.reshape(-1, d), wg, wu, wd, nw, 1e-6).reshape(*lead, d)
    assert_close(
        "swiglu_ffn",
        y,
        ref,
        rtol("swiglu_ffn", dtype),
        f"lead={lead} D={d} F={f} {dtype} norm={norm} seed={seed}",
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention(backend_name, device, dtype, attn_case, causal, seed):
    b, h, hkv, s, skv, d = attn_case
    if device == "cuda" and dtype == F32:
        pytest.skip(
            "float32 attention is a CPU-only mode (validation rejects it on CUDA; tested in test_validation)"
        )
    _require(backend_name, "attention", device, dtype, head_dim=d)
    q = _randn(b, h, s, d, dtype=dtype, device=device)
    k = _randn(b, hkv, skv, d, dtype=dtype, device=device)
    v = _randn(b, hkv, skv, d, dtype=dtype, device=device)
    with fusekit.poisoned():
        y = ops.attention(q, k, v, causal=causal, backend=backend_name)
    ref = oracle.attention(q, k, v, causal, 1.0 / math.sqrt(d))
    assert_close(
        "attention",
        y,
        ref,
        rtol("attention", dtype),
        f"B={b} H={h} Hkv={hkv} S={s} Skv={skv} D={d} causal={causal} {dtype} seed={seed}",
    )


# --- layouts the public layer must handle for every backend ----------------------------------------


def test_non_contiguous_inputs(backend_name, device, seed):
    _require(backend_name, "rms_norm", device, F32)
    base = _randn(64, 2 * 96, dtype=F32, device=device)
    x = base[:, ::2]  # strided rows and columns
    w = _randn(2 * 96, dtype=F32, device=device)[::2]
    with fusekit.poisoned():
        y = ops.rms_norm(x, w, backend=backend_name)
    assert_close(
        "rms_norm(strided)", y, oracle.rms_norm(x, w, 1e-6)[0], rtol("rms_norm", F32), f"seed={seed}"
    )
    xt = _randn(40, 24, dtype=F32, device=device).t()  # transposed: dim=-1 sums the original columns
    with fusekit.poisoned():
        s = ops.reduce_sum(xt, -1, backend=backend_name)
    assert_close(
        "reduce_sum(transposed)",
        s,
        oracle.reduce_sum(xt, -1),
        rtol("reduce_sum", F32),
        f"seed={seed}",
        sum_scale(xt, -1),
    )
    _require(backend_name, "rope", device, F32, tables=False)
    xr = _randn(2, 6, 4, 32, dtype=F32, device=device).transpose(1, 2).contiguous().transpose(1, 2)
    with fusekit.poisoned():
        r = ops.rope(xr, start_pos=2, backend=backend_name)
    assert_close("rope(strided)", r, oracle.rope(xr, 2, 10000.0, False), rtol("rope", F32), f"seed={seed}")
