"""Decode attention (issue #11 item 3): the Triton split-KV kernels, kv_len, KV caches read in place.

    pytest tests/test_triton_decode_attention.py                 # CPU: Triton's interpreter (conftest sets it)
    pytest tests/test_triton_decode_attention.py --device cuda   # GPU: the compiled kernels (fp16 and bf16)

The split-KV path (kernels_triton/_attention_decode.py) is forced with 1, 3 or 8 splits and checked against
a float64 softmax computed per sequence on the sliced keys 0..kv_len[b]-1 (an independent formulation: no
masks), for S in {1, 5, 16} against Skv in {515, 1000, 2048}, GQA 1/4/8, head dims 64/128, causal and not,
with kv_len (odd lengths, a 0) and k/v as strided views of a cache [B, max_len, Hkv, D] whose unused slots
hold NaN (keys past kv_len are never read); fp32 (bf16 on the GPU), fp16 and bf16 cases. Then: bit-identical repeats (fixed-order combine), the no-copy path of a cache view
through `ops.attention` to the triton provider (a spy on the kernel entry), the library's contiguous fallback
for providers that do not read strides, kv_len validation, and the mojo backend's refusal of kv_len.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from checks import graphs_capturable, rel_error

import fusekit
from fusekit import ops
from fusekit.tolerances import RTOL

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

NAN = float("nan")

TOL = RTOL  # fusekit.tolerances: the one table
LSE_TOL = 2e-5  # lse is fp32 math on the inputs as stored, whatever their dtype


def _dtype(dtype: torch.dtype, dev: str) -> torch.dtype:
    """fp32 cases run as bf16 on the GPU (the kernels are tuned for 16-bit there); fp16 stays fp16."""
    return torch.bfloat16 if dev == "cuda" and dtype == torch.float32 else dtype


def reference(q, k, v, kv_len, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (o, lse), one sequence at a time on its own keys k[b, :, :L] (no masks but the causal one)."""
    B, H, S, _ = q.shape
    g = H // k.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((B, H, S), -math.inf, dtype=torch.float64)
    for b in range(B):
        L = k.shape[2] if kv_len is None else int(kv_len[b])
        if L == 0:
            continue
        qb = q[b].double().cpu()
        kb = k[b, :, :L].double().cpu().repeat_interleave(g, 0)
        vb = v[b, :, :L].double().cpu().repeat_interleave(g, 0)
        s = (qb @ kb.transpose(-1, -2)) * scale
        if causal:  # the S queries are the sequence's last S positions
            i = torch.arange(S)[:, None]
            s = s.masked_fill(torch.arange(L)[None, :] > i + (L - S), -math.inf)
        m = torch.logsumexp(s, -1)
        seen = torch.isfinite(m)
        p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, m, 0.0)[..., None]), 0.0)
        o[b] = p @ vb
        lse[b] = m
    return o, lse


def make(B, H, Hkv, S, Skv, D, dtype, dev, seed, kv_len=None, cache_slack=None):
    """q, k, v (k/v as views of NaN-tailed caches when cache_slack is given; NaN past kv_len), kv_len."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g).to(device=dev, dtype=dtype)
    if cache_slack is None:
        k, v = (torch.randn(B, Hkv, Skv, D, generator=g).to(device=dev, dtype=dtype) for _ in range(2))
    else:
        caches = [
            torch.randn(B, Skv + cache_slack, Hkv, D, generator=g).to(device=dev, dtype=dtype) for _ in "kv"
        ]
        for c in caches:
            c[:, Skv:] = NAN
        k, v = (c.transpose(1, 2)[:, :, :Skv] for c in caches)
    kl = None
    if kv_len is not None:
        for b, n in enumerate(kv_len):
            k[b, :, n:] = NAN
            v[b, :, n:] = NAN
        kl = torch.tensor(kv_len, dtype=torch.int32, device=dev)
    return q, k, v, kl


def run_forward(attn, q, k, v, kl, causal, scale, **kw):
    o = torch.full_like(q, NAN)
    lse = torch.full(q.shape[:3], NAN, dtype=torch.float32, device=q.device)
    attn.forward(o, lse, q, k, v, kl, causal, scale, **kw)
    return o, lse


def check(o, lse, ro, rlse, tol, what):
    err = rel_error(o.cpu(), ro)
    assert err < tol, f"{what}: o rel err {err:.2e} > {tol:.1e}"
    lse, rlse = lse.double().cpu(), rlse
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse)), f"{what}: rows with no visible key differ"
    assert bool((o.cpu()[torch.isneginf(rlse)] == 0).all()), f"{what}: rows with no visible key must be 0"
    fin = torch.isfinite(rlse)
    if fin.any():
        err = rel_error(lse[fin], rlse[fin])
        assert err < LSE_TOL, f"{what}: lse rel err {err:.2e} > {LSE_TOL:.1e}"


# (S, Skv, GQA, D, splits, dtype, kv_len of each sequence or None, cache slack or None). Every (S, Skv) pair
# of the issue, both causal modes (parametrized), GQA 1/4/8, D 64/128, splits 1/3/8, fp32/fp16/bf16, with
# and without kv_len and strided caches, spread over 9 cases to keep the interpreter under a few minutes.
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES = [
    (1, 515, 1, 64, 3, F32, None, None),
    (1, 1000, 4, 128, 8, F16, (1000, 0), 13),
    (1, 2048, 8, 64, 1, F32, (777, 2048), 3),
    (5, 515, 8, 128, 3, BF16, (4, 515), None),  # causal: 1 of the 5 queries sees nothing in sequence 0
    (5, 1000, 1, 64, 8, F32, None, 7),
    (5, 2048, 4, 64, 3, F32, (1, 1999), 1),
    (16, 515, 4, 64, 8, F32, (515, 9), 17),  # causal: 7 of the 16 queries see no key in sequence 1
    (16, 1000, 8, 128, 1, BF16, None, 5),  # 128 rows per GQA group
    (16, 2048, 1, 128, 3, F16, (2047, 33), None),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=[f"S{c[0]}-Skv{c[1]}-g{c[2]}-d{c[3]}-sp{c[4]}" for c in CASES])
def test_split_kv(attn, dev, case, causal) -> None:
    S, Skv, group, D, splits, dtype, kv_len, slack = case
    dtype = _dtype(dtype, dev)
    Hkv = 2 if group == 1 else 1
    B = 2 if kv_len is not None else 1
    q, k, v, kl = make(B, Hkv * group, Hkv, S, Skv, D, dtype, dev, seed=S * 7 + Skv + D, kv_len=kv_len,
                       cache_slack=slack)  # fmt: skip
    scale = 1.2 / math.sqrt(D)
    o, lse = run_forward(attn, q, k, v, kl, causal, scale, _splits=splits)
    ro, rlse = reference(q, k, v, kv_len, causal, scale)
    check(o, lse, ro, rlse, TOL[dtype], f"{case} causal={causal}")


def test_split_kv_is_deterministic_and_matches_one_split(attn, dev) -> None:
    """Repeats with 8 splits are bit-identical (fixed-order combine, no atomics); 1, 3 and 8 splits agree to
    rounding; the automatic choice (no `_splits`) runs the decode path too (S <= 16) and agrees."""
    dtype = _dtype(torch.float16, dev)
    q, k, v, kl = make(2, 8, 2, 5, 1000, 64, dtype, dev, seed=11, kv_len=(613, 1000), cache_slack=3)
    runs = [run_forward(attn, q, k, v, kl, True, 0.125, _splits=8) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    ro, rlse = reference(q, k, v, (613, 1000), True, 0.125)
    for splits in (1, 3, None):
        o, lse = run_forward(attn, q, k, v, kl, True, 0.125, _splits=splits)
        check(o, lse, ro, rlse, TOL[dtype], f"splits={splits}")
    assert attn.use_decode(q, k)


@pytest.mark.parametrize("splits", [1, 3])  # 1: the split kernel writes o itself; 3: the combine kernel does
def test_split_kv_strided_q_and_o(attn, dev, splits) -> None:
    """q read and o written through their strides: q a [B, S, H, D] source's view as [B, H, S, D] (the heads of
    a fused qkv projection, row stride (H + 2 Hkv) D), o laid out [B, S, H, D] as the library allocates it for
    such a q. Bit-identical to the contiguous call (same math, other addresses), lse too."""
    dtype = _dtype(torch.float16, dev)
    B, H, Hkv, S, D = 2, 8, 2, 5, 64
    q0, k, v, kl = make(B, H, Hkv, S, 700, D, dtype, dev, seed=21, kv_len=(700, 333), cache_slack=4)
    qkv = torch.randn(B, S, H + 2 * Hkv, D, device=dev).to(dtype)
    qkv[:, :, :H] = q0.transpose(1, 2)
    q = qkv[:, :, :H].transpose(1, 2)  # [B, H, S, D], strides of a [B, S, H + 2 Hkv, D] buffer
    assert not q.is_contiguous() and torch.equal(q, q0)
    o = torch.full((B, S, H, D), NAN, dtype=dtype, device=dev).transpose(1, 2)  # q's memory order
    lse = torch.full((B, H, S), NAN, dtype=torch.float32, device=dev)
    attn.forward(o, lse, q, k, v, kl, True, 0.125, _splits=splits)
    want_o, want_lse = run_forward(attn, q0, k, v, kl, True, 0.125, _splits=splits)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


def test_split_kv_nonfinite(attn, dev) -> None:
    """A NaN in a visible key reaches exactly the rows that see it, across splits; a NaN query row stays in
    its row; keys past kv_len (NaN in the cache) never matter."""
    dtype = _dtype(torch.float32, dev)
    q, k, v, kl = make(1, 4, 1, 5, 515, 64, dtype, dev, seed=3, kv_len=(300,), cache_slack=4)
    k[0, 0, 298, 3] = NAN  # seen by causal queries 3 and 4 only (query i sees keys <= i + 295)
    q[0, 2, 1, 0] = NAN
    o, lse = run_forward(attn, q, k, v, kl, True, 0.1, _splits=3)
    nan_rows = o.isnan().any(-1).cpu()
    want = torch.zeros(1, 4, 5, dtype=torch.bool)
    want[0, :, 3:] = True
    want[0, 2, 1] = True
    assert torch.equal(nan_rows, want), f"NaN rows {nan_rows.int().tolist()}"
    assert torch.equal(lse.isnan().cpu(), want)


# --- the heuristic -----------------------------------------------------------------------------------------
def test_split_heuristic() -> None:
    """More splits when few programs would stream a long KV, one when the batch alone fills the GPU, never
    more than the KV has tiles for (2 per split), and fewer for many rows (larger partials)."""
    from kernels_triton._attention_decode import DECODE_MAX_SPLITS, decode_splits

    sms = 132
    long1 = decode_splits(8, 4, 32768, 128, 2, 64, sms)  # B1 Hkv8, GQA 4, S 1
    assert 8 < long1 <= DECODE_MAX_SPLITS
    assert decode_splits(32 * 8, 4, 32768, 128, 2, 64, sms) < long1  # B32: the batch fills the SMs
    assert decode_splits(4096, 4, 2048, 128, 2, 64, sms) == 1
    assert decode_splits(8, 4, 200, 128, 2, 64, sms) <= 2  # 4 tiles of 64 keys
    assert decode_splits(8, 128, 32768, 128, 2, 64, sms) <= long1  # 128 rows: partials weigh more


# --- PDL: the combine kernel launched early (sm_90) ---------------------------------------------------------
def _pdl(monkeypatch, on: bool) -> bool:
    """Turns programmatic dependent launch on or off for the next decode calls (fresh plans and launches)."""
    from kernels_triton import _attention_decode, _config, _launch

    monkeypatch.setattr(_config, "PDL_ENABLED", on)
    _config.pdl_supported.cache_clear()
    _attention_decode._PLANS.clear()
    _launch._KEYED.clear()
    return _config.pdl_supported(0)


def test_pdl_only_where_compiled_for_cuda(monkeypatch) -> None:
    """PDL is never used under the interpreter (or on HIP: griddepcontrol is PTX); the AOT specs build it
    for sm_90 only, with `launch_pdl` on the combine kernel, and the gfx942 specs without it."""
    from kernels_triton._attention_decode import aot_specs_decode
    from kernels_triton._config import pdl_supported

    if not torch.cuda.is_available():
        assert not pdl_supported(0)
    specs = aot_specs_decode()
    for name, _fn, _sig, const, opts in specs:
        (target,) = opts["aot_targets"]
        assert const["PDL"] == (target == "sm_90"), name
        assert opts.get("launch_pdl", False) == (target == "sm_90" and "combine" in name), name
    assert {s[4]["aot_targets"][0] for s in specs} == {"sm_90", "gfx942"}
    try:
        pdl_supported.cache_clear()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not pdl_supported(0)
    finally:
        pdl_supported.cache_clear()


def test_pdl_combine_bit_identical_and_graph_capture(attn, dev, monkeypatch) -> None:
    """On a GPU with PDL: the split + combine pair with the combine launched early gives bit-identical o and
    lse to the serialized launches, over several split counts and with kv_len; captured in a CUDA graph it
    replays on new inputs to the eager result."""
    if dev != "cuda" or not _pdl(monkeypatch, True):
        pytest.skip("PDL needs an sm_90+ GPU with compiled Triton kernels")
    dtype = torch.bfloat16
    q, k, v, kl = make(2, 32, 8, 1, 3000, 128, dtype, dev, seed=21, kv_len=(2999, 1234), cache_slack=5)
    runs = {}
    for on in (True, False):
        assert _pdl(monkeypatch, on) == on
        runs[on] = [run_forward(attn, q, k, v, kl, False, 0.09, _splits=s) for s in (None, 4, 16, 47)]
    for (o1, l1), (o0, l0) in zip(runs[True], runs[False]):
        assert torch.equal(o1, o0) and torch.equal(l1, l0)
    ro, rlse = reference(q, k, v, (2999, 1234), False, 0.09)
    check(*runs[True][0], ro, rlse, TOL[dtype], "pdl auto splits")
    if not graphs_capturable():
        return  # the sanitizer runs: no caching allocator, so no capture; the launches above were checked

    _pdl(monkeypatch, True)
    sq, sk, sv = q.clone(), k.clone(), v.clone()
    o = torch.full_like(q, NAN)
    lse = torch.full(q.shape[:3], NAN, dtype=torch.float32, device=dev)
    attn.forward(o, lse, sq, sk, sv, kl, False, 0.09, _splits=16)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.forward(o, lse, sq, sk, sv, kl, False, 0.09, _splits=16)
    q2, k2, v2, _ = make(2, 32, 8, 1, 3000, 128, dtype, dev, seed=22, cache_slack=5)
    for src, dst in ((q2, sq), (k2, sk), (v2, sv)):
        dst.copy_(src)
    o.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    want_o, want_lse = run_forward(attn, sq, sk, sv, kl, False, 0.09, _splits=16)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


# --- the library path: no copy for a cache view, contiguous copies for others ---------------------------------
def _spy(monkeypatch, mod, name: str, seen: list):
    real = getattr(mod, name)

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, spy)


def test_cache_view_reaches_triton_without_copy(attn, dev, monkeypatch) -> None:
    """A view k_cache.transpose(1, 2)[:, :, :L] goes to the kernels as is (same data pointer and strides),
    forward and backward, and the result equals the one from contiguous copies."""
    dtype = _dtype(torch.float16, dev)
    B, Hkv, D, L, max_len = 2, 2, 64, 37, 50
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (
        torch.randn(B, max_len, Hkv, D, generator=g).to(device=dev, dtype=dtype) for _ in "kv"
    )
    q = torch.randn(B, 4, 3, D, generator=g).to(device=dev, dtype=dtype)
    k, v = k_cache.transpose(1, 2)[:, :, :L], v_cache.transpose(1, 2)[:, :, :L]
    kv_len = torch.tensor([L, 20], dtype=torch.int32, device=dev)
    fwd, bwd = [], []
    _spy(monkeypatch, attn, "forward", fwd)
    _spy(monkeypatch, attn, "backward", bwd)
    with fusekit.poisoned():
        out = ops.attention(q, k, v, causal=True, kv_len=kv_len, backend="triton")
    ((_, _, _, k_seen, v_seen, kl_seen, *_),) = fwd
    for seen, view in ((k_seen, k), (v_seen, v)):
        assert seen.data_ptr() == view.data_ptr() and seen.stride() == view.stride(), (
            "the cache view was copied"
        )
    assert kl_seen.data_ptr() == kv_len.data_ptr()
    want = ops.attention(q, k.contiguous(), v.contiguous(), causal=True, kv_len=kv_len, backend="triton")
    assert torch.equal(out, want)

    kg, vg = k.detach().requires_grad_(), v.detach().requires_grad_()
    with fusekit.poisoned():
        o = ops.attention(q, kg, vg, causal=True, kv_len=kv_len, backend="triton")
        o.backward(torch.ones_like(o))
    assert fwd[-1][3].data_ptr() == kg.data_ptr() and fwd[-1][3].stride() == kg.stride()
    ((_, _, _, _, _, k_b, v_b, *_),) = bwd
    assert k_b.data_ptr() == kg.data_ptr() and k_b.stride() == kg.stride(), "the backward got a copy of k"
    assert v_b.data_ptr() == vg.data_ptr()
    assert bool((kg.grad[1, :, 20:] == 0).all()) and bool((vg.grad[1, :, 20:] == 0).all())  # past kv_len


def test_contiguous_fallback_and_plan_signature(dev, monkeypatch) -> None:
    """A provider that does not read strides (torch) gets contiguous k/v; one that does (triton) gets a copy
    when the last dim is strided. Same shapes with other strides are another plan: results stay right."""
    from fusekit.ops.attention import SPEC

    dtype = _dtype(torch.float32, dev)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2, 4, 64, generator=g).to(device=dev, dtype=dtype)
    wide = torch.randn(1, 2, 29, 128, generator=g).to(device=dev, dtype=dtype)
    k_last = wide[..., ::2]  # last dim strided: the kernels cannot read it in place (used as v)
    cache = torch.randn(1, 40, 2, 64, generator=g).to(device=dev, dtype=dtype)
    k_view = cache.transpose(1, 2)[:, :, :29]
    seen: list = []
    real = SPEC.reference["forward"]
    monkeypatch.setitem(SPEC.reference, "forward", lambda *a: seen.append(a) or real(*a))
    want = ops.attention(q, k_view.contiguous(), k_last.contiguous(), backend="torch")
    for k, v in ((k_view, k_last), (k_view.contiguous(), k_last.contiguous()), (k_view, k_last)):
        got = ops.attention(q, k, v, backend="torch")
        assert seen[-1][1].is_contiguous() and seen[-1][2].is_contiguous()
        assert torch.equal(got, want)
    trit: list = []
    import kernels_triton.attention as mod

    _spy(monkeypatch, mod, "forward", trit)
    got = ops.attention(q, k_view, k_last, backend="triton")
    assert trit[-1][3].data_ptr() == k_view.data_ptr() and trit[-1][4].stride(-1) == 1
    assert rel_error(got.cpu(), want.cpu()) < TOL[dtype]


# --- validation and refusals --------------------------------------------------------------------------------
def test_kv_len_validation() -> None:
    q, k = torch.randn(2, 2, 3, 64), torch.randn(2, 1, 9, 64)
    ok = ops.attention(q, k, k, kv_len=torch.tensor([9, 4]), backend="torch")  # int64 is converted
    assert torch.equal(
        ok, ops.attention(q, k, k, kv_len=torch.tensor([9, 4], dtype=torch.int32), backend="torch")
    )
    with pytest.raises(ValueError, match=r"^kv_len: every length must be in \[0, Skv=9\]"):
        ops.attention(q, k, k, kv_len=torch.tensor([10, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^kv_len: every length must be in"):
        ops.attention(q, k, k, kv_len=torch.tensor([-1, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"^kv_len: dtype float32 is not supported"):
        ops.attention(q, k, k, kv_len=torch.tensor([1.0, 4.0]))
    with pytest.raises(ValueError, match=r"^kv_len: expected shape \[B=2\]"):
        ops.attention(q, k, k, kv_len=torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^kv_len: expected 1 dimensions"):
        ops.attention(q, k, k, kv_len=torch.tensor(3, dtype=torch.int32))


def test_compile_fullgraph_kv_len_cache_view(monkeypatch) -> None:
    """torch.compile(fullgraph=True) of a decode step on a cache view with kv_len, forward and backward
    (the backward custom op's schema takes kv_len and its condition flag), equals eager."""

    def step(q, k_cache, v_cache, kv_len):
        k, v = k_cache.transpose(1, 2)[:, :, :17], v_cache.transpose(1, 2)[:, :, :17]
        return ops.attention(q, k, v, causal=True, kv_len=kv_len, backend="torch")

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 3, 64, generator=g)
    k_cache, v_cache = (torch.randn(2, 20, 2, 64, generator=g) for _ in "kv")
    kv_len = torch.tensor([17, 5], dtype=torch.int32)
    torch._dynamo.reset()
    from torch._inductor import config as inductor_config

    # config.patch restores the setting exactly (monkeypatch's undo left the aliased option unset)
    with inductor_config.patch(force_disable_caches=True):  # lower it here, not from a cache
        compiled = torch.compile(step, fullgraph=True)
        grads = []
        for fn in (step, compiled):  # eager first: it resolves the backend (dispatch's import is not traced)
            qg, kg = q.clone().requires_grad_(), k_cache.clone().requires_grad_()
            out = fn(qg, kg, v_cache, kv_len)
            out.backward(torch.ones_like(out))
            grads.append((out.detach(), qg.grad, kg.grad))
        for want, got in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert bool((grads[1][2][1, 5:] == 0).all())  # cache slots past kv_len get no gradient
