"""The row norms' "coop" mode (kernels_triton/_coop.py) on a GPU: one row cut into register-resident chunks
whose partial statistics meet at a per-row barrier in global memory, launched cooperatively.

It cannot run in the CPU interpreter (programs run one after another there, so the first would wait
forever for its row's other chunks): on --device cpu this file checks only that the mode is refused with
a clear error and never offered; with --device cuda it checks values against float64 references and
against "reload", ragged chunks and groups, residual / casting / bias variants, bit-identical repeats and
CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch
from checks import layer_norm_ref, rel_error, rms_norm_ref

pytest.importorskip("triton")

from fusekit.tolerances import RTOL
from kernels_triton import _config
from kernels_triton import layer_norm as ln_mod
from kernels_triton import rms_norm as rms_mod

TOL = {**RTOL, torch.float32: 1e-5}  # fusekit.tolerances, fp32 tighter: one rounding, short sums


def _randn(
    *shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).cuda()


@pytest.fixture
def cuda(device: str) -> None:
    if device != "cuda":
        pytest.skip("coop needs a GPU (--device cuda)")


def test_coop_refused_in_interpreter(device: str) -> None:
    if device != "cpu":
        pytest.skip("the interpreter's refusal (--device cpu)")
    assert not _config.coop_supported()
    coop = _config.NORM_COOP_SETS["rms_norm"]
    assert all(c.mode != "coop" for c in _config.norm_candidates(4096, 262144, 2, 0, coop_set=coop))
    x = torch.randn(2, 300)
    y, rstd = torch.empty_like(x), torch.empty(2)
    with pytest.raises(ValueError, match="coop"):
        rms_mod.forward(y, None, rstd, x, None, torch.ones(300), 1e-6, _mode="coop")


# (M, N, dtype, block, progs): ragged last chunk, more groups than rows, rows not a multiple of the groups,
# several rows per group, many chunks per row
CASES = [
    (7, 70000, torch.bfloat16, 16384, 1),  # 5 chunks, the last 4464 long; 7 groups of one row
    (300, 65536, torch.float16, 8192, 2),  # 8 chunks, ~33 groups, 9-10 rows each
    (3, 262144, torch.float32, 8192, 2),  # 32 chunks, 3 groups
    (61, 131072, torch.bfloat16, 16384, 1),  # 8 chunks
    (5, 3000, torch.float32, 256, 1),  # short rows in tiny chunks: 12 chunks
]


@pytest.mark.parametrize("M,N,dtype,block,progs", CASES)
def test_rms_coop(cuda: None, M: int, N: int, dtype: torch.dtype, block: int, progs: int) -> None:
    x = _randn(M, N, dtype=dtype, seed=N, scale=2.0, shift=0.5)
    w = _randn(N, dtype=dtype, seed=N + 1)
    y = torch.full_like(x, float("nan"))
    rstd = torch.full((M,), float("nan"), device="cuda")
    rms_mod.forward(y, None, rstd, x, None, w, 1e-6, _mode="coop", _block=block, _progs=progs)
    ref, ref_rstd = rms_norm_ref(x, w, 1e-6)
    assert rel_error(y, ref) <= TOL[dtype]
    assert rel_error(rstd, ref_rstd) <= 1e-5
    y2, rstd2 = torch.full_like(y, float("nan")), torch.full_like(rstd, float("nan"))
    rms_mod.forward(y2, None, rstd2, x, None, w, 1e-6, _mode="coop", _block=block, _progs=progs)
    assert torch.equal(y, y2) and torch.equal(rstd, rstd2)  # fixed-order combine: bit-identical repeats


@pytest.mark.parametrize("casting", ["fp32", "llama", "gemma"])
def test_rms_coop_residual_casting(cuda: None, casting: str) -> None:
    # fp32 weight under AMP, fused residual: h and y against "reload" (same rounding rules), rstd to fp64
    M, N = 37, 100000
    x = _randn(M, N, dtype=torch.bfloat16, seed=1, scale=2.0)
    r = _randn(M, N, dtype=torch.bfloat16, seed=2)
    w = _randn(N, dtype=torch.float32, seed=3, scale=0.1, shift=1.0)
    outs = []
    for mode in ("coop", "reload"):
        y = torch.full_like(x, float("nan"))
        h = torch.full_like(x, float("nan"))
        rstd = torch.full((M,), float("nan"), device="cuda")
        kw = dict(_block=8192, _progs=2) if mode == "coop" else {}
        rms_mod.forward(y, h, rstd, x, r, w, 1e-6, casting, _mode=mode, **kw)
        outs.append((y, h, rstd))
    (y, h, rstd), (y_r, h_r, _) = outs
    assert torch.equal(h, h_r)  # x + residual rounded once, either way
    hd = h.double()
    assert rel_error(rstd, torch.rsqrt(hd.square().mean(-1) + 1e-6)) <= 1e-5
    assert rel_error(y, y_r) <= 8e-3  # both round the same fp32 value; rstd differs in the last bits


@pytest.mark.parametrize("M,N,dtype,block,progs", CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_coop(
    cuda: None, M: int, N: int, dtype: torch.dtype, block: int, progs: int, with_bias: bool
) -> None:
    x = _randn(M, N, dtype=dtype, seed=N, scale=2.0, shift=3.0)
    w = _randn(N, dtype=dtype, seed=N + 1)
    b = _randn(N, dtype=dtype, seed=N + 2) if with_bias else None
    y = torch.full_like(x, float("nan"))
    mean = torch.full((M,), float("nan"), device="cuda")
    rstd = torch.full((M,), float("nan"), device="cuda")
    ln_mod.forward(y, None, mean, rstd, x, None, w, b, 1e-5, _mode="coop", _block=block, _progs=progs)
    ref, ref_mean, ref_rstd = layer_norm_ref(x, w, b, 1e-5)
    assert rel_error(y, ref) <= TOL[dtype]
    assert rel_error(mean, ref_mean) <= 1e-5
    assert rel_error(rstd, ref_rstd) <= 1e-5
    y2 = torch.full_like(y, float("nan"))
    ln_mod.forward(
        y2, None, mean.clone(), rstd.clone(), x, None, w, b, 1e-5, _mode="coop", _block=block, _progs=progs
    )
    assert torch.equal(y, y2)


def test_layer_norm_coop_residual_large_mean(cuda: None) -> None:
    # mean 1e4, std 1 (the shifted sums keep the variance), fp32 weight and bias, fused residual
    M, N = 9, 90000
    x = _randn(M, N, dtype=torch.float32, seed=4, shift=1e4)
    r = _randn(M, N, dtype=torch.float32, seed=5)
    w = _randn(N, dtype=torch.float32, seed=6)
    b = _randn(N, dtype=torch.float32, seed=7)
    y, h = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    mean = torch.full((M,), float("nan"), device="cuda")
    rstd = torch.full((M,), float("nan"), device="cuda")
    ln_mod.forward(y, h, mean, rstd, x, r, w, b, 1e-5, _mode="coop", _block=16384, _progs=1)
    assert torch.equal(h, x + r)
    ref, _, ref_rstd = layer_norm_ref(h, w, b, 1e-5)
    assert rel_error(y, ref) <= 1e-5
    assert rel_error(rstd, ref_rstd) <= 1e-5


def test_coop_cuda_graph_replay(cuda: None) -> None:
    # captured once, replayed on new inputs: the per-call counter reset is part of the graph
    M, N = 40, 131072
    x = _randn(M, N, dtype=torch.bfloat16, seed=8)
    w = _randn(N, dtype=torch.bfloat16, seed=9)
    y = torch.empty_like(x)
    rstd = torch.empty(M, device="cuda")

    def run() -> None:
        rms_mod.forward(y, None, rstd, x, None, w, 1e-6, _mode="coop", _block=16384, _progs=1)

    run()  # compile and plan outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for seed in (10, 11):
        x.copy_(_randn(M, N, dtype=torch.bfloat16, seed=seed))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, ref_rstd = rms_norm_ref(x, w, 1e-6)
        assert rel_error(y, ref) <= TOL[torch.bfloat16]
        assert rel_error(rstd, ref_rstd) <= 1e-5


def test_coop_is_a_tuning_candidate(cuda: None) -> None:
    dev = torch.cuda.current_device()
    for op, coop in _config.NORM_COOP_SETS.items():
        assert any(c.mode == "coop" for c in _config.norm_candidates(1024, 262144, 2, dev, coop_set=coop)), op
        assert all(c.mode != "coop" for c in _config.norm_candidates(4096, 8192, 2, dev, coop_set=coop)), op
