"""Triton attention forward (o, lse) and backward (dq, dk, dv) against float64 autograd (CONTRACT.md).

    pytest tests/test_triton_attention_grad.py                 # CPU: Triton's interpreter (conftest sets it)
    pytest tests/test_triton_attention_grad.py --device cuda   # GPU: the autotuned kernels, bf16 included

The reference is a plain float64 softmax attention over the visible keys (bottom-right causal mask; a row
with no visible key gives o = 0 and lse = -inf and passes no gradient), differentiated by torch autograd.
bf16 runs on the CPU too (the interpreter's bf16 tl.dot corrected by kernels_triton/_interpreter.py). Small shapes with
odd lengths (S = 9, 37, 53) so every path runs: unmasked tiles, diagonal tiles, ragged tails on both sides,
S > Skv rows with no visible key, GQA ratios 1/2/4/8, head dims 64/128/256. The interpreter runs 16 x 16
tiles unless a test forces others. Outputs are poisoned with NaN before each call.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from checks import rel_error

from fusekit.tolerances import RTOL

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

NAN = float("nan")
TOL = RTOL  # fusekit.tolerances (relative 2-norm vs float64); gradients get 2x
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _skip(dtype: torch.dtype, dev: str) -> None:
    if dtype == torch.float32 and dev == "cuda":
        pytest.skip("fp32 attention is an interpreter (CPU) path; the GPU kernels are tuned for fp16/bf16")


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (o, lse) of softmax(q k^T * scale) v over the visible keys; autograd-friendly.

    Masked scores are replaced by -inf before the softmax (a masked key never matters, NaN or not); a row
    with no visible key gets dummy scores 0 (no NaN, also not in autograd), then o = 0 and lse = -inf.
    """
    H, S, Skv = q.shape[1], q.shape[2], k.shape[2]
    g = H // k.shape[1]
    kf = k.double().repeat_interleave(g, dim=1)
    vf = v.double().repeat_interleave(g, dim=1)
    s = (q.double() @ kf.transpose(-1, -2)) * scale
    i = torch.arange(S, device=q.device)[:, None]
    j = torch.arange(Skv, device=q.device)[None, :]
    vis = (j <= i + (Skv - S)) if causal else torch.ones(S, Skv, dtype=torch.bool, device=q.device)
    has = vis.any(-1)[:, None]
    s = torch.where(has, s.masked_fill(~vis, float("-inf")), 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(~vis, 0.0)
    o = torch.where(has, p @ vf, 0.0)
    lse = torch.where(has[:, 0], torch.logsumexp(s, dim=-1), float("-inf"))
    return o, lse


def _inputs(B, H, Hkv, S, Skv, D, dtype, dev, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (
        torch.randn(*shape, generator=g) for shape in [(B, H, S, D), *[(B, Hkv, Skv, D)] * 2, (B, H, S, D)]
    )
    return [t.to(device=dev, dtype=dtype) for t in (q, k, v, do)]


def _forward(attn, q, k, v, causal, scale, **kw):
    o = torch.full_like(q, NAN)
    lse = torch.full(q.shape[:3], NAN, dtype=torch.float32, device=q.device)
    attn.forward(o, lse, q, k, v, causal, scale, **kw)
    return o, lse


def _backward(attn, do, q, k, v, o, lse, causal, scale, **kw):
    grads = tuple(torch.full_like(t, NAN) for t in (q, k, v))
    attn.backward(*grads, do, q, k, v, o, lse, causal, scale, **kw)
    return grads


def _check_lse(lse: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    lse, ref = lse.double().cpu(), ref.double().cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), f"{what}: -inf rows differ"
    fin = torch.isfinite(ref)
    err = rel_error(lse[fin], ref[fin])
    assert err < tol, f"{what}: lse rel err {err:.2e} > {tol:.1e}"


def _check_all(attn, q, k, v, do, causal, scale, tol, what, fwd_kw=None, bwd_kw=None) -> tuple:
    o, lse = _forward(attn, q, k, v, causal, scale, **(fwd_kw or {}))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rlse = reference(qd, kd, vd, causal, scale)
    err = rel_error(o, ro.detach())
    assert err < tol, f"{what}: o rel err {err:.2e} > {tol:.1e}"
    _check_lse(lse, rlse.detach(), tol, what)
    S, Skv = q.shape[2], k.shape[2]
    if causal and Skv < S:  # the first S - Skv rows see no key: exactly 0
        assert bool((o[:, :, : S - Skv] == 0).all()), f"{what}: rows with no visible key must be exact zeros"
    grads = _backward(attn, do, q, k, v, o, lse, causal, scale, **(bwd_kw or {}))
    ro.backward(do.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (qd.grad, kd.grad, vd.grad), strict=True):
        err = rel_error(got, ref)
        assert err < 2 * tol, f"{what}: {name} rel err {err:.2e} > {2 * tol:.1e}"
    if causal and Skv < S:
        assert bool((grads[0][:, :, : S - Skv] == 0).all()), (
            f"{what}: dq of rows with no visible key must be 0"
        )
    return o, lse, grads


CASES = [
    (1, 2, 2, 16, 16, 64),  # MHA, one tile
    (1, 4, 1, 37, 53, 64),  # GQA 4:1, S < Skv (diagonal shifted right), ragged tails
    (1, 2, 2, 53, 37, 128),  # S > Skv: causal rows 0..15 see no key
    (1, 2, 1, 9, 33, 256),  # GQA 2:1, a short query block against several key tiles
    (2, 8, 1, 21, 19, 64),  # GQA 8:1, batch 2, S > Skv by 2
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,H,Hkv,S,Skv,D", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_forward_backward(attn, dev, B, H, Hkv, S, Skv, D, causal, dtype) -> None:
    _skip(dtype, dev)
    q, k, v, do = _inputs(B, H, Hkv, S, Skv, D, dtype, dev, seed=S * 131 + Skv * 7 + D + causal)
    scale = 1.3 / D**0.5  # a little peakier than 1/sqrt(D)
    _check_all(
        attn, q, k, v, do, causal, scale, TOL[dtype], f"{(B, H, Hkv, S, Skv, D)} causal={causal} {dtype}"
    )


# (dk/dv tile, dq tile): unequal BLOCK_M / BLOCK_N move the causal split between unmasked, diagonal and tail
# blocks; 32-row query steps against 16-key blocks and the converse.
FORCED = {
    "kv16x32-q32x16": ((16, 32, 1, 1), (32, 16, 1, 1)),
    "kv32x16-q16x32": ((32, 16, 1, 1), (16, 32, 1, 1)),
}


@pytest.mark.parametrize("tiles", FORCED.values(), ids=FORCED.keys())
@pytest.mark.parametrize("S,Skv", [(37, 70), (70, 37)], ids=["S<Skv", "S>Skv"])
def test_backward_forced_tiles(attn, dev, tiles, S, Skv) -> None:
    if dev != "cpu":
        pytest.skip("interpreter tile sizes")
    q, k, v, do = _inputs(1, 2, 1, S, Skv, 64, torch.float32, dev, seed=S + Skv)
    for causal in (True, False):
        _check_all(attn, q, k, v, do, causal, 0.125, TOL[torch.float32], f"S={S} Skv={Skv} causal={causal}",
                   bwd_kw={"_config": tiles})  # fmt: skip


# TMA variants (sm_90, and Triton's interpreter): descriptor loads zero-fill rows past S and keys past kv_len,
# stores clip; the q/do descriptor of the dk/dv kernel spans every head, so a tail block's rows past S are the
# next head's and must be zeroed in the kernel (S = 37, 70, 9: tails in every block).
TMA_TILES = ((16, 32, 1, 1, True), (32, 16, 1, 1, True))
PTR_TILES = ((16, 32, 1, 1), (32, 16, 1, 1))
TMA_FWD, PTR_FWD = (32, 16, 1, 1, True), (32, 16, 1, 1)  # forward: 32-row query blocks, 16-key tiles


def _needs_tma(dev: str) -> None:
    if dev == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels need sm_90+")


@pytest.mark.parametrize("S,Skv", [(37, 70), (70, 37), (9, 33)], ids=["S<Skv", "S>Skv", "short"])
def test_tma_tiles(attn, dev, S, Skv) -> None:
    _needs_tma(dev)
    q, k, v, do = _inputs(2, 4, 2, S, Skv, 64, torch.float16, dev, seed=S * 3 + Skv)
    for causal in (True, False):
        _check_all(attn, q, k, v, do, causal, 0.125, TOL[torch.float16], f"TMA S={S} Skv={Skv} causal={causal}",
                   fwd_kw={"_config": TMA_FWD}, bwd_kw={"_config": TMA_TILES})  # fmt: skip


def test_backward_tma_cache_view_kv_len(attn, dev) -> None:
    """TMA tiles on k/v strided views of a cache [B, max_len, Hkv, D] whose slots past kv_len hold NaN: the
    k/v descriptors span kv_len[b] keys only, so nothing past it is read; the gradients equal the pointer
    kernels' (which mask those loads) and keys past kv_len get exact zeros."""
    _needs_tma(dev)
    B, H, Hkv, S, D, L, max_len = 2, 4, 2, 21, 64, 37, 50
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(B, max_len, Hkv, D, generator=g) for _ in "kv")
    for c in (k_cache, v_cache):
        c[0, L:] = NAN
        c[1, 20:] = NAN
    k_cache, v_cache = (c.to(device=dev, dtype=torch.float16) for c in (k_cache, v_cache))
    k, v = k_cache.transpose(1, 2)[:, :, :L], v_cache.transpose(1, 2)[:, :, :L]
    q, do = (torch.randn(B, H, S, D, generator=g).to(device=dev, dtype=torch.float16) for _ in "qd")
    kv_len = torch.tensor([L, 20], dtype=torch.int32, device=dev)
    for causal in (False, True):
        fwd = []
        for tile in (PTR_FWD, TMA_FWD):
            o = torch.full_like(q, NAN)
            lse = torch.full(q.shape[:3], NAN, dtype=torch.float32, device=dev)
            attn.forward(o, lse, q, k, v, kv_len, causal, 0.125, _config=tile)
            fwd.append((o, lse))
        (o, lse), (o_tma, lse_tma) = fwd
        assert bool(torch.isfinite(o_tma).all()), (
            f"causal={causal}: the TMA forward's o has non-finite values"
        )
        assert rel_error(o_tma, o) < 1e-3, (
            f"causal={causal}: the TMA forward's o differs from the pointer one"
        )
        _check_lse(lse_tma, lse, 1e-3, f"causal={causal}: TMA forward")  # rows with no visible key: -inf
        runs = []
        for tiles in (PTR_TILES, TMA_TILES):
            grads = (torch.full_like(q, NAN), torch.full(k.shape, NAN, dtype=k.dtype, device=dev),
                     torch.full(v.shape, NAN, dtype=v.dtype, device=dev))  # fmt: skip
            attn.backward(*grads, do, q, k, v, o, lse, kv_len, causal, 0.125, _config=tiles)
            runs.append(grads)
        for name, want, got in zip(("dq", "dk", "dv"), *runs, strict=True):
            assert bool(torch.isfinite(got).all()), f"causal={causal}: {name} has non-finite values"
            err = rel_error(got, want)
            assert err < 1e-3, f"causal={causal}: TMA {name} differs from the pointer kernels by {err:.1e}"
        assert bool((runs[1][1][1, :, 20:] == 0).all()) and bool((runs[1][2][1, :, 20:] == 0).all())


def test_tma_refuses_unaligned(attn, dev) -> None:
    """A forced TMA tile on k/v whose strides are not 16-byte multiples raises, naming TMA."""
    _needs_tma(dev)
    q, k, v, do = _inputs(1, 2, 1, 16, 16, 64, torch.float16, dev, seed=3)
    k_odd = torch.randn(1, 1, 16, 64 + 1, dtype=torch.float16, device=dev)[..., :64]  # rows 65 elements apart
    o, lse = _forward(attn, q, k, v, False, 0.125)
    with pytest.raises(ValueError, match="TMA"):
        _backward(attn, do, q, k_odd, v, o, lse, False, 0.125, _config=TMA_TILES)
    with pytest.raises(ValueError, match="TMA"):
        _forward(attn, q, k_odd, v, False, 0.125, _config=TMA_FWD)


def test_backward_is_deterministic_and_slabs(attn, dev, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs give bit-identical gradients (GQA group summed in a fixed order, no atomics); then B*H past
    grid axis 1's limit (lowered to force 3 batch slabs) gives the same bits again."""
    dtype = torch.float16
    q, k, v, do = _inputs(3, 2, 1, 21, 29, 64, dtype, dev, seed=5)
    o, lse = _forward(attn, q, k, v, True, 0.125)
    g1 = _backward(attn, do, q, k, v, o, lse, True, 0.125)
    g2 = _backward(attn, do, q, k, v, o, lse, True, 0.125)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)
    monkeypatch.setattr(attn, "_MAX_GRID_Y", 3)  # H = 2: one batch per slab
    o3, lse3 = _forward(attn, q, k, v, True, 0.125)
    assert torch.equal(o3, o) and torch.equal(lse3, lse)
    g3 = _backward(attn, do, q, k, v, o, lse, True, 0.125)
    for a, b in zip(g1, g3, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_launch_order(attn, dev, causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch order (heads in chunks, heaviest causal blocks first: _tile_of / _head_chunk) moves work
    between programs, never changes it: chunks of 1 (a 2-D grid's order), 2, 3, 5 and the default rule give
    bit-identical o / lse and gradients, GQA and S != Skv, with several heads per chunk left ragged."""
    q, k, v, do = _inputs(2, 6, 3, 37, 53, 64, torch.float16, dev, seed=12)
    o, lse = _forward(attn, q, k, v, causal, 0.125)
    base = _backward(attn, do, q, k, v, o, lse, causal, 0.125)
    assert not any(torch.isnan(t).any() for t in (o, *base))
    for chunk in ("1", "2", "3", "5"):
        monkeypatch.setenv("FUSEKIT_TRITON_ATTN_CHUNK", chunk)
        o2, lse2 = _forward(attn, q, k, v, causal, 0.125)
        assert torch.equal(o2, o) and torch.equal(lse2, lse), f"chunk {chunk}: o / lse differ"
        got = _backward(attn, do, q, k, v, o, lse, causal, 0.125)
        for name, a, b in zip(("dq", "dk", "dv"), base, got, strict=True):
            assert torch.equal(a, b), f"chunk {chunk}: {name} differs"
    # the unchunked forward's 2-D grid (what the rule gives at many programs per SM) computes the same
    from kernels_triton import attention as A

    monkeypatch.delenv("FUSEKIT_TRITON_ATTN_CHUNK")
    monkeypatch.setattr(A, "_fwd_chunk_args", lambda *a: (0, 1))
    o2, lse2 = _forward(attn, q, k, v, causal, 0.125)
    assert torch.equal(o2, o) and torch.equal(lse2, lse), "2-D grid: o / lse differ"


def test_forward_chunk_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward takes the backward's chunk rule only while its launch is at most 8 programs per SM at
    128-row tiles (_fwd_chunk_args' H200 probe), a 2-D grid's order (chunk_cap 1) beyond; not causal: 1;
    FUSEKIT_TRITON_ATTN_CHUNK forces the chunk everywhere (chunk_work -1)."""
    from kernels_triton import attention as A
    from kernels_triton import attention_backward as AB

    monkeypatch.setattr(A, "num_sms", lambda dev: 132)
    monkeypatch.setattr(AB, "num_sms", lambda dev: 132)
    monkeypatch.delenv("FUSEKIT_TRITON_ATTN_CHUNK", raising=False)
    q = torch.empty(1, dtype=torch.bfloat16)
    assert A._fwd_chunk_args(True, 32, 2048, 2048, 64, q) == (4 * 132, 16)  # 512 programs; 8 MiB cap
    assert A._fwd_chunk_args(True, 128, 1024, 1024, 128, q) == (4 * 132, 16)  # 1024 programs; 8 MiB cap
    assert A._fwd_chunk_args(True, 256, 1024, 1024, 64, q) == (0, 1)  # 2048 programs > 8 * 132
    assert A._fwd_chunk_args(False, 32, 2048, 2048, 64, q) == (0, 1)
    monkeypatch.setenv("FUSEKIT_TRITON_ATTN_CHUNK", "5")
    assert A._fwd_chunk_args(True, 256, 1024, 1024, 64, q) == (-1, 5)
    assert A._fwd_chunk_args(False, 3, 64, 64, 64, q) == (-1, 3)
    # unchunked (cap 1, not forced): a 2-D grid (query blocks, heads); chunked or forced: 1-D
    assert A._grid(8, 6, (0, 1)) == (8, 6) and A._grid(8, 6, (4 * 132, 1)) == (8, 6)
    assert A._grid(8, 6, (4 * 132, 16)) == (48,) and A._grid(8, 6, (-1, 1)) == (48,)


def test_backward_negative_scale(attn, dev) -> None:
    """The forward runs a negative scale through -q; the backward needs no row max and takes it as is."""
    q, k, v, do = _inputs(1, 2, 1, 19, 23, 64, torch.float32 if dev == "cpu" else torch.float16, dev, seed=9)
    for causal in (False, True):
        _check_all(attn, q, k, v, do, causal, -0.2, TOL[q.dtype], f"scale=-0.2 causal={causal}")


# ---------------------------------------------------------------------------------------------- NaN
def _nan_pattern(
    o: torch.Tensor, lse: torch.Tensor, ro: torch.Tensor, rlse: torch.Tensor, tol: float
) -> None:
    o, lse, ro, rlse = (t.double().cpu() for t in (o, lse, ro, rlse))
    assert torch.equal(torch.isnan(o), torch.isnan(ro)), (
        f"NaN rows of o: got {torch.isnan(o).any(-1).int().tolist()}, want {torch.isnan(ro).any(-1).int().tolist()}"
    )
    assert torch.equal(torch.isnan(lse), torch.isnan(rlse)), "NaN pattern of lse differs"
    fin = torch.isfinite(ro)
    assert rel_error(o[fin], ro[fin]) < tol
    _check_lse(lse.nan_to_num(0.0), rlse.nan_to_num(0.0), tol, "finite lse")


@pytest.mark.parametrize(
    "case,causal",
    [("q_row", False), ("q_row", True), ("visible_key", False), ("visible_key", True), ("masked_key", True)],
)
def test_forward_nan(attn, dev, case: str, causal: bool) -> None:
    """NaN reaches exactly the rows a float64 softmax over the visible keys sends it to."""
    dtype = torch.float32 if dev == "cpu" else torch.float16
    B, H, Hkv, S, Skv, D = (
        1,
        2,
        1,
        21,
        13,
        64,
    )  # S > Skv: causal rows 0..7 see no key, row i sees keys <= i - 8
    q, k, v, _ = _inputs(B, H, Hkv, S, Skv, D, dtype, dev, seed=len(case) + causal)
    if case == "q_row":
        q[0, 1, 11, 5] = NAN  # row 11 of head 1 only
    elif case == "visible_key":
        k[0, 0, 4, 9] = NAN  # causal: rows 12.. see key 4; rows 8..11 see keys before it only
    else:
        k[0, 0, 12, :] = NAN  # the last key: seen by the last row only; masked in every other row's tile
    o, lse = _forward(attn, q, k, v, causal, D**-0.5)
    ro, rlse = reference(q, k, v, causal, D**-0.5)
    _nan_pattern(o, lse, ro, rlse, TOL[dtype])
    nan_rows = torch.isnan(o[0]).any(-1).cpu()  # [H, S]
    if case == "q_row":
        assert nan_rows[1, 11] and int(nan_rows.sum()) == 1, "only the NaN query row is NaN"
        return
    # both query heads read the one kv head: the same rows of each are NaN
    first = {"visible_key": 12, "masked_key": S - 1}[case] if causal else 0  # first row that sees the key
    want = torch.arange(S) >= first
    assert torch.equal(nan_rows, want.expand(H, S)), f"NaN rows {nan_rows.int().tolist()}, want from {first}"
    if causal:
        assert bool((o[0, :, : S - Skv] == 0).all()), "rows with no visible key stay exact zeros"


@pytest.mark.parametrize(("S", "Skv"), [(12, 16), (32, 64), (64, 300), (300, 64), (128, 128), (1000, 333)])
def test_autotuner_offers_tma_tiles_at_any_length(dev, S, Skv, monkeypatch) -> None:
    """The autotuned backward offers the dk/dv and dq TMA tiles at every length where TMA is set up: the
    small-shape hang (S 12-32, session 55) was the pipeliner's zero-trip division, fixed in _bwd_dkdv_kernel
    and proven on a GPU (tma_hang.py real_fixed_*). The tuned path runs on the CPU with its kernels recorded
    instead of launched."""
    import kernels_triton.attention_backward as AB

    if dev == "cuda":
        pytest.skip("checks the host's choice of config table; the GPU runs it in test_hostile_inputs")
    asked: list[tuple[str, bool]] = []

    class _Record:
        def __init__(self, name: str, tma_ok: bool) -> None:
            asked.append((name, tma_ok))

        def __getitem__(self, grid):
            return lambda *args, **kw: None

    monkeypatch.setattr(AB, "is_interpreter", lambda: False)  # the tuned path, not the interpreter's tiles
    monkeypatch.setattr(AB, "tma_setup", lambda *a: True)  # as on an sm_90 GPU with aligned tensors
    monkeypatch.setattr(AB, "_tuned_dkdv", lambda d, tma_ok: _Record("dkdv", tma_ok))
    monkeypatch.setattr(AB, "_tuned_dq", lambda d, tma_ok: _Record("dq", tma_ok))
    q, k, v, do = _inputs(1, 2, 1, S, Skv, 64, torch.float16, dev, seed=S + Skv)
    o, lse = torch.zeros_like(q), torch.zeros(q.shape[:3])
    grads = [torch.empty_like(t) for t in (q, k, v)]
    AB.attention_backward(*grads, do, q, k, v, o, lse, None, False, 0.125, s_bucket=S, skv_bucket=Skv,
                          max_grid_y=65535)  # fmt: skip
    assert asked == [("dkdv", True), ("dq", True)]


@pytest.mark.parametrize(("S", "Skv"), [(32, 64), (300, 64), (128, 128)])
def test_forward_autotuner_offers_tma_tiles_at_any_length(attn, dev, S, Skv, monkeypatch):
    """The forward's autotuner offers its TMA tiles at any length too (S 32 is past the decode kernels)."""
    if dev == "cuda":
        pytest.skip("checks the host's choice of config table on the CPU")
    asked: list[bool] = []

    class _Record:
        def __getitem__(self, grid):
            return lambda *args, **kw: None

    def record(d, tma_ok):
        asked.append(tma_ok)
        return _Record()

    monkeypatch.setattr(attn, "is_interpreter", lambda: False)
    monkeypatch.setattr(attn, "tma_setup", lambda *a: True)
    monkeypatch.setattr(attn, "_tuned", record)
    q, k, v, _ = _inputs(1, 2, 1, S, Skv, 128, torch.float16, dev, seed=S + Skv)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    attn.forward(o, lse, q, k, v, False, 0.125)
    assert asked == [True]


# Compiles the dk/dv kernel for sm_90 as the JIT specializes it for B1 H1 fp16 D64 non-causal S=32 Skv=64 (the
# shape that hung an H100): pointers and 16-divisible ints marked divisible, ints equal to 1 compiled in.
_COMPILE_DKDV = r"""
import json, re, sys
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from kernels_triton import attention_backward as ab
S, SKV, D = 32, 64, 64
ints = dict(H=1, HKV=1, S=S, SKV=SKV, stride_kb=SKV * D, stride_kh=SKV * D, stride_kn=D, stride_vb=SKV * D,
            stride_vh=SKV * D, stride_vn=D, has_kv_len=0, chunk_work=0, chunk_cap=1, S_BUCKET=S, SKV_BUCKET=SKV)
fn = ab._bwd_dkdv_kernel
for tma in (True, False):
    const = dict(HEAD_DIM=D, CAUSAL=False, IEEE=False, BLOCK_M=64, BLOCK_N=64, TMA=tma)
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = {"lse2_ptr": "*fp32", "delta_ptr": "*fp32", "kv_len_ptr": "*i32"}.get(n, "*fp16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ints:
            ty, spec = native_specialize_impl(BaseBackend, ints[n], False, True, True)
            sig[n] = ty
            if ty == "constexpr":
                const[n] = ints[n]
            elif spec == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32"
    src = triton.compiler.ASTSource(fn, sig, const, attrs)
    ll = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3}).asm["llir"]
    expect = re.findall(r'mbarrier\.arrive\.expect_tx[^"]*", "b,r"\(i1 (%[\w.]+)', ll)
    cp = re.findall(r'"cp\.async\.cg\.shared\.global[^"]*", "r,l,r"\(.*?, i32 (\d+|%[\w.]+)\)', ll)
    print("RESULT " + json.dumps({"tma": tma, "expect": expect, "cp_sizes": cp}), flush=True)
"""


def test_dkdv_prologue_loads_stay_predicated() -> None:
    """The software-pipelined q/do loads of the dk/dv kernel stay predicated on the loop's trip count, also
    for the loop that runs 0 times when S < BLOCK_M (the H100 hang, session 55). Its flat (head, block) index
    is split by the block count; divided by a count that may be 0 in the pipeliner's prologue, LLVM took the
    count as non-zero and issued the first stage's loads unconditionally (Triton 3.6): TMA loads never
    waited for, whose mbarriers were then invalidated and re-initialized for the next loop (the hang), and
    on the pointer tile cp.async reads of rows past S. TMA tile: only the k and v loads (outside the loops)
    may arm their mbarrier on the bare one-thread predicate; pointer tile: every cp.async has a runtime
    source size (0 when predicated off), none a constant 16. Compiled for sm_90 on the CPU."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "python"), str(root), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_DKDV], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    res = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            res[r["tma"]] = r
    assert set(res) == {True, False}, proc.stderr[-3000:]
    expect = res[True]["expect"]
    assert len(expect) >= 6, f"k, v and the pipelined q/do loads arm mbarriers: {expect}"
    bare = [p for p in expect if p == expect[0]]  # the k load's predicate: thread 0, nothing else
    assert len(bare) == 2, f"only k and v may be loaded unconditionally; armed on {expect[0]}: {len(bare)}"
    sizes = res[False]["cp_sizes"]
    assert sizes and "16" not in sizes, f"unpredicated cp.async in the pointer tile: {sizes.count('16')}"
