"""Every path of the tensor-core Triton kernels (swiglu_ffn, attention), on the CPU interpreter.

Small shapes (the interpreter is slow); each mode is forced through the launchers' private switches.
Compared against float64 by relative error; outputs are poisoned with NaN first. bf16 is not run here:
the interpreter's bf16 tl.dot is wrong (see TRITON_FACTS.md); bf16 is checked on the GPU instead.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before torch/triton are imported

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
from checks import rel_error

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "python"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

if importlib.util.find_spec("triton") is not None:
    from fusekit import reference as R
    from kernels_triton.attention import attention
    from kernels_triton.swiglu_ffn import swiglu_ffn

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _skip_bf16_on_cpu(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        reason = "bf16 tl.dot is wrong in the Triton CPU interpreter; bf16 is checked on the GPU"
        print(f"SKIP: {reason}")
        pytest.skip(reason)


# ---------------------------------------------------------------------------------------------- ffn
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize(
    "T,path,prologue",
    [(1, "decode", "fused"), (5, "decode", "fused"), (16, "decode", "fused"), (37, "prefill", "fused"),
     (37, "prefill", "xn"), (3, "prefill", "fused")],
)  # fmt: skip
def test_swiglu_ffn_paths(T: int, path: str, prologue: str, norm: bool, dtype: torch.dtype) -> None:
    _skip_bf16_on_cpu(dtype)
    torch.manual_seed(T)
    D, F = 80, 72  # not multiples of the interpreter's K tile (32): exercises the K-tail masks
    x = torch.randn(T, D, dtype=dtype)
    wg = (torch.randn(F, D) / D**0.5).to(dtype)
    wu = (torch.randn(F, D) / D**0.5).to(dtype)
    wd = (torch.randn(D, F) / F**0.5).to(dtype)
    nw = (1 + 0.1 * torch.randn(D)).to(dtype) if norm else None
    out = torch.full((T, D), float("nan"), dtype=dtype)
    swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6, _path=path, _prologue=prologue)
    ref = R.swiglu_ffn(
        x.double(), wg.double(), wu.double(), wd.double(), None if nw is None else nw.double(), 1e-6
    )
    assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("T,path", [(1, "decode"), (4, "decode"), (20, "prefill")])
def test_swiglu_ffn_even_k(T: int, path: str, dtype: torch.dtype) -> None:
    """D and F multiples of the K tile: the GEMMs' unmasked (EVEN_K) loads."""
    torch.manual_seed(100 + T)
    D, F = 64, 96
    x = torch.randn(T, D, dtype=dtype)
    wg, wu = ((torch.randn(F, D) / D**0.5).to(dtype) for _ in range(2))
    wd = (torch.randn(D, F) / F**0.5).to(dtype)
    nw = (1 + 0.1 * torch.randn(D)).to(dtype)
    for prologue in ("xn", "fused"):
        out = torch.full((T, D), float("nan"), dtype=dtype)
        swiglu_ffn(out, x, wg, wu, wd, nw, 1e-5, _path=path, _prologue=prologue)
        ref = R.swiglu_ffn(x.double(), wg.double(), wu.double(), wd.double(), nw.double(), 1e-5)
        assert rel_error(out, ref) < TOL[dtype]


def test_swiglu_ffn_decode_rejects_large_t() -> None:
    x = torch.randn(17, 32)
    w = torch.randn(16, 32)
    with pytest.raises(ValueError):
        swiglu_ffn(torch.empty_like(x), x, w, w, w.T.contiguous(), None, 1e-6, _path="decode")


def _ffn_case(T: int, D: int, F: int, dtype: torch.dtype, norm: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(T, D, dtype=dtype)
    wg, wu = ((torch.randn(F, D) / D**0.5).to(dtype) for _ in range(2))
    wd = (torch.randn(D, F) / F**0.5).to(dtype)
    nw = (1 + 0.1 * torch.randn(D)).to(dtype) if norm else None
    ref = R.swiglu_ffn(
        x.double(), wg.double(), wu.double(), wd.double(), None if nw is None else nw.double(), 1e-6
    )
    return (x, wg, wu, wd, nw), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("T", [17, 70])
def test_swiglu_ffn_tma(T: int, norm: bool, dtype: torch.dtype) -> None:
    """The TMA persistent GEMMs: T, F (72) and D (80) are not multiples of the 16x16x32 interpreter tile,
    so the descriptors' zero-filled loads and clipped stores handle every tail; T=70 gives 25 gate/up
    tiles to 4 persistent programs (several tiles per program)."""
    (x, wg, wu, wd, nw), ref = _ffn_case(T, 80, 72, dtype, norm, seed=200 + T)
    out = torch.full((T, 80), float("nan"), dtype=dtype)
    swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6, _path="prefill", _gemm="tma")
    assert rel_error(out, ref) < TOL[dtype]


def test_swiglu_ffn_tma_rejects() -> None:
    (x, wg, wu, wd, nw), _ = _ffn_case(20, 80, 72, torch.float32)
    out = torch.empty_like(x)
    with pytest.raises(ValueError):  # the fused prologue has no TMA variant
        swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6, _path="prefill", _prologue="fused", _gemm="tma")
    with pytest.raises(ValueError):
        swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6, _path="prefill", _gemm="cublas")
    (x, wg, wu, wd, nw), _ = _ffn_case(20, 81, 72, torch.float16)  # 162-byte rows: not TMA-legal
    with pytest.raises(ValueError):
        swiglu_ffn(torch.empty_like(x), x, wg, wu, wd, nw, 1e-6, _path="prefill", _gemm="tma")


@pytest.fixture
def ffn_choice(monkeypatch: pytest.MonkeyPatch):
    """The automatic ptr-vs-TMA choice on the CPU: TMA made eligible, timings faked, caches fresh."""
    import kernels_triton.swiglu_ffn as ffn_mod

    monkeypatch.setattr(ffn_mod, "_tma_auto", lambda tensors: True)
    monkeypatch.setattr(ffn_mod, "_CHOICE", {})
    monkeypatch.setattr(ffn_mod, "TIMINGS", {})
    monkeypatch.setattr(ffn_mod, "_BROKEN", set())
    calls: list[int] = []

    def fake_bench(fn) -> float:  # later candidates "faster": the TMA config wins unless it is excluded
        fn()
        calls.append(1)
        return 10.0 - len(calls)

    monkeypatch.setattr(ffn_mod, "_bench_ms", fake_bench)
    return ffn_mod, calls


def test_swiglu_ffn_choice_picks_and_caches(ffn_choice) -> None:
    ffn_mod, calls = ffn_choice
    (x, wg, wu, wd, nw), ref = _ffn_case(40, 80, 72, torch.float16, seed=5)
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6)
        assert rel_error(out, ref) < TOL[torch.float16]
    assert len(calls) == 4, "ptr and TMA timed once per GEMM; the second call must reuse the choice"
    assert {k[0]: v for k, v in ffn_mod._CHOICE.items()} == {
        "gate_up": ffn_mod._TMA_INTERP,
        "down": ffn_mod._TMA_INTERP,
    }
    out = torch.full_like(x, float("nan"))  # the fused prologue has no TMA variant: ptr, no timing
    swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6, _prologue="fused")
    assert rel_error(out, ref) < TOL[torch.float16] and len(calls) == 4


def test_swiglu_ffn_choice_excludes_failing_tma(ffn_choice, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TMA kernel that does not compile on this Triton is warned about once and the pointer GEMM runs."""
    ffn_mod, _calls = ffn_choice

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("fake compile error")

            return launch

    monkeypatch.setattr(ffn_mod, "_gate_up_tma_kernel", Broken())
    (x, wg, wu, wd, nw), ref = _ffn_case(40, 80, 72, torch.float16, seed=6)
    out = torch.full_like(x, float("nan"))
    with pytest.warns(RuntimeWarning, match="fake compile error"):
        swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6)
    assert rel_error(out, ref) < TOL[torch.float16]
    choice = {k[0]: v for k, v in ffn_mod._CHOICE.items()}
    assert choice == {"gate_up": "ptr", "down": ffn_mod._TMA_INTERP}
    assert ("gate_up", ffn_mod._TMA_INTERP) in ffn_mod._BROKEN
    (x, wg, wu, wd, nw), ref = _ffn_case(300, 80, 72, torch.float16, seed=7)  # new T bucket: no retry
    out = torch.full_like(x, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6)
    assert rel_error(out, ref) < TOL[torch.float16]


# ---------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    "B,H,Hkv,S,Skv,D",
    [
        (1, 2, 2, 37, 37, 64),  # odd S, one M tile with a ragged tail
        (2, 4, 1, 50, 77, 64),  # GQA 4:1, batch > 1, several tiles
        (1, 2, 1, 40, 77, 128),  # S < Skv: causal diagonal shifted right
        (1, 2, 2, 77, 40, 64),  # S > Skv: the first 37 rows see no key when causal -> exact zeros
        (1, 2, 2, 21, 33, 256),
    ],
)
def test_attention(
    B: int, H: int, Hkv: int, S: int, Skv: int, D: int, causal: bool, dtype: torch.dtype
) -> None:
    _skip_bf16_on_cpu(dtype)
    torch.manual_seed(S * 7 + Skv)
    q = torch.randn(B, H, S, D, dtype=dtype)
    k = torch.randn(B, Hkv, Skv, D, dtype=dtype)
    v = torch.randn(B, Hkv, Skv, D, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    scale = D**-0.5
    attention(out, q, k, v, causal, scale)
    ref = R.attention(q.double(), k.double(), v.double(), causal, scale)
    assert rel_error(out, ref) < TOL[dtype]
    if causal and Skv < S:
        assert bool((out[:, :, : S - Skv] == 0).all()), "rows that see no key must be exact zeros"


@pytest.mark.parametrize("tile", [(16, 32, 1, 1), (32, 16, 1, 1)], ids=["16x32", "32x16"])
def test_attention_tiles(tile: tuple[int, int, int, int]) -> None:
    """Unequal BLOCK_M / BLOCK_N move the causal split between unmasked and diagonal tiles."""
    torch.manual_seed(1)
    q = torch.randn(1, 2, 53, 64)
    k = torch.randn(1, 2, 70, 64)
    v = torch.randn(1, 2, 70, 64)
    for causal in (True, False):
        out = torch.full_like(q, float("nan"))
        attention(out, q, k, v, causal, 0.125, _config=tile)
        ref = R.attention(q.double(), k.double(), v.double(), causal, 0.125)
        assert rel_error(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("scale", [-0.3, 0.0], ids=["negative", "zero"])
def test_attention_odd_scale(scale: float) -> None:
    """The kernel folds a non-negative scale into the row max; a negative one goes through -q."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 37, 64) for _ in range(3))
    for causal in (True, False):
        out = torch.full_like(q, float("nan"))
        attention(out, q, k, v, causal, scale)
        ref = R.attention(q.double(), k.double(), v.double(), causal, scale)
        assert rel_error(out, ref) < TOL[torch.float32]


def test_attention_grid_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """B*H beyond grid axis 1's limit is launched in batch slabs (limit lowered to force 2 slabs)."""
    import kernels_triton.attention as attn_mod

    monkeypatch.setattr(attn_mod, "_MAX_GRID_Y", 5)
    torch.manual_seed(3)
    q, k, v = (torch.randn(3, 2, 21, 64) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    attention(out, q, k, v, True, 0.125)
    ref = R.attention(q.double(), k.double(), v.double(), True, 0.125)
    assert rel_error(out, ref) < TOL[torch.float32]
