"""The Gluon FA3-style Hopper attention backward (kernels_triton/_attention_hopper_bwd.py).

    pytest tests/test_triton_attention_hopper_bwd.py                 (CPU: imports, refusals, AOT compile)
    pytest tests/test_triton_attention_hopper_bwd.py --device cuda   (an sm_90 GPU: gradients, determinism)

Gluon kernels do not run on the CPU (nor in Triton's interpreter). On the CPU this checks that the module
imports, that `hopper_bwd_supported` refuses what the kernels do not take, and, where the installed Triton has
Gluon's Hopper module, that every (kernel, dtype, head dim, causal) variant compiles ahead of time for sm_90
to a cubin with wgmma, TMA and setmaxnreg in its PTX. With `--device cuda` on an sm_90 GPU the kernels run:
dq, dk, dv against float64 autograd at odd shapes (ragged S / Skv tails, GQA, causal with S > Skv rows that
see no key, S < Skv, a strided KV-cache view) into NaN-poisoned outputs, and bit-identical on a second run.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from gluon_support import compile_all, need_sm90, qkv, spec_params

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.usefixtures("fresh_attention_plans"),
]


def _mod():
    from kernels_triton import _attention_hopper_bwd

    return _attention_hopper_bwd


_qkv = qkv


def test_module_imports_without_a_gpu():
    m = _mod()
    assert isinstance(m.HAS_GLUON, bool)
    assert callable(m.hopper_backward) and callable(m.hopper_bwd_supported)
    assert set(m.DKDV_CONFIGS) == set(m.DQ_CONFIGS) == set(m.HEAD_DIMS) == {64, 128}


def test_takes_what_the_forward_takes(monkeypatch: pytest.MonkeyPatch):
    """The backward's gate is the forward's (tests/test_triton_attention_hopper.py tests its refusals) at the
    backward's head dims: the forward also takes D256, the backward kernels do not."""
    m = _mod()
    monkeypatch.setattr(m, "hopper_supported", lambda *a: True)
    assert m.hopper_bwd_supported(*_qkv(D=64), None) and m.hopper_bwd_supported(*_qkv(D=128), None)
    assert not m.hopper_bwd_supported(*_qkv(D=256), None)
    monkeypatch.setattr(m, "hopper_supported", lambda *a: False)
    assert not m.hopper_bwd_supported(*_qkv(D=64), None)


def test_backward_refuses_unsupported_inputs():
    q, k, v = _qkv()
    o, do, dq = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    with pytest.raises(ValueError, match="unsupported"):
        _mod().hopper_backward(dq, dk, dv, do, q, k, v, o, lse, False, 0.125)


def _spec_names() -> list:
    return spec_params([s[0] for s in _mod().aot_specs_gluon_bwd()])


def test_aot_specs_cover_every_variant():
    names = [s[0] for s in _mod().aot_specs_gluon_bwd()]
    if not names:
        pytest.skip("the installed triton has no Gluon Hopper module")
    # kernel x dtype x head dim x causal, and the causal dk/dv split variant per dtype x head dim
    assert len(names) == len(set(names)) == 2 * 2 * 2 * 2 + 2 * 2
    assert sum(n.endswith("_s2") for n in names) == 4


@functools.cache
def _compiled() -> dict:
    return compile_all("kernels_triton._attention_hopper_bwd", "aot_specs_gluon_bwd")


@pytest.mark.parametrize("name", _spec_names())
def test_compiles_ahead_of_time_for_sm90(name):
    """Each (kernel, dtype, D, causal) variant compiles to a cubin for sm_90 without a GPU (Triton 3.6 and
    3.9): wgmma, TMA loads and stores and the warp-specialized register split (setmaxnreg) are in its PTX."""
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError as exc:  # pragma: no cover - Gluon without its AST source class
        pytest.skip(f"no GluonASTSource in this triton: {exc}")
    r = _compiled()[name]
    assert "error" not in r, r.get("error")
    split = name.endswith("_s2")  # fp32 partial dk/dv go out by plain stores into the workspace
    assert r == {"cubin": True, "wgmma": True, "setmaxnreg": True, "tma": True, "tma_store": not split}, r


# --- GPU (sm_90) ----------------------------------------------------------------------------------------
def _need_sm90(device: str) -> None:
    need_sm90(device, _mod().HAS_GLUON)


def _forward64(q, k, v, causal: bool, scale: float):
    """float64 attention with autograd: o and the natural-log lse of the visible scaled scores (bottom-right
    causal); a row that sees no key gives o = 0, lse = -inf and zero gradients."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ kk.transpose(-1, -2) * scale
    S, Skv = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(S, device=q.device)[:, None]
        j = torch.arange(Skv, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Skv - S), float("-inf"))
    dead = (s == float("-inf")).all(-1, keepdim=True)  # rows that see no key
    s_safe = torch.where(dead, torch.zeros_like(s), s)
    p = torch.softmax(s_safe, -1) * (~dead)
    lse = torch.logsumexp(s_safe, -1).masked_fill(dead[..., 0], float("-inf"))
    return p @ vv, lse


def _inputs(B, H, Hkv, S, Skv, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(dtype)
    do = torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype)
    return q, k, v, do


def _reference(q, k, v, do, causal: bool, scale: float):
    """(o, lse) in the input dtype / fp32 for the kernel, and float64 autograd dq, dk, dv."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, lse64 = _forward64(q64, k64, v64, causal, scale)
    dq, dk, dv = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    return o64.detach().to(q.dtype).contiguous(), lse64.detach().float().contiguous(), (dq, dk, dv)


def _run(q, k, v, do, o, lse, causal, scale):
    dq = torch.full_like(q, float("nan"))
    dk = torch.full(k.shape, float("nan"), dtype=k.dtype, device=k.device)
    dv = torch.full_like(dk, float("nan"))
    _mod().hopper_backward(dq, dk, dv, do, q, k, v, o, lse, causal, scale)
    return dq, dk, dv


def _check(got, ref, dtype):
    from fusekit.tolerances import rtol

    tol = rtol("attention", dtype, "backward")
    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert not g.isnan().any(), f"{name}: NaN left (poisoned output not fully written?)"
        err = ((g.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


# (B, H, Hkv, S, Skv, D, causal): ragged tails, GQA, S > Skv causal (the first rows see no key), S < Skv.
_CASES = [
    (1, 4, 4, 128, 128, 64, False),
    (1, 4, 4, 256, 256, 128, True),
    (2, 8, 2, 77, 300, 128, True),
    (1, 4, 1, 300, 77, 128, True),
    (1, 4, 1, 300, 77, 64, True),
    (1, 2, 2, 1000, 1000, 64, False),
    (2, 4, 4, 129, 129, 128, True),
    (1, 4, 2, 200, 333, 128, False),
    (1, 8, 2, 333, 200, 64, False),
    (1, 2, 1, 1, 190, 128, True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", _CASES, ids=lambda c: "B{}H{}-{}S{}K{}D{}{}".format(*c[:6], "c" if c[6] else "")
)
def test_gpu_matches_float64(device: str, dtype: torch.dtype, case) -> None:
    _need_sm90(device)
    B, H, Hkv, S, Skv, D, causal = case
    q, k, v, do = _inputs(B, H, Hkv, S, Skv, D, dtype, sum(case[:6]))
    scale = D**-0.5
    o, lse, ref = _reference(q, k, v, do, causal, scale)
    assert _mod().hopper_bwd_supported(q, k, v, None)
    got = _run(q, k, v, do, o, lse, causal, scale)
    _check(got, ref, dtype)
    if causal and Skv < S:  # rows that see no key: dq exactly 0
        dead = torch.arange(S, device="cuda") + (Skv - S) < 0
        assert (got[0][:, :, dead] == 0).all()


def test_gpu_kv_cache_view(device: str) -> None:
    """k/v as strided views into a NaN-padded cache [B, max_len, Hkv, D] (read in place through the strides;
    the slots past Skv are never read)."""
    _need_sm90(device)
    B, H, Hkv, S, Skv, D, max_len = 2, 8, 2, 96, 200, 128, 256
    dt = torch.bfloat16
    q, k0, v0, do = _inputs(B, H, Hkv, S, Skv, D, dt, 5)
    kc = torch.full((B, max_len, Hkv, D), float("nan"), device="cuda", dtype=dt)
    vc = torch.full_like(kc, float("nan"))
    kc[:, :Skv] = k0.transpose(1, 2)
    vc[:, :Skv] = v0.transpose(1, 2)
    k, v = kc.transpose(1, 2)[:, :, :Skv], vc.transpose(1, 2)[:, :, :Skv]
    assert _mod().hopper_bwd_supported(q, k, v, None)
    o, lse, ref = _reference(q, k0, v0, do, True, D**-0.5)
    _check(_run(q, k, v, do, o, lse, True, D**-0.5), ref, dt)


@pytest.mark.parametrize("causal", [False, True])
def test_gpu_deterministic(device: str, causal: bool) -> None:
    """Two runs give bit-identical dq, dk, dv (no atomics; the GQA sum has a fixed order)."""
    _need_sm90(device)
    B, H, Hkv, S, Skv, D = 2, 8, 2, 700, 900, 128
    q, k, v, do = _inputs(B, H, Hkv, S, Skv, D, torch.bfloat16, 11)
    o, lse, _ = _reference(q, k, v, do, causal, D**-0.5)
    a = _run(q, k, v, do, o, lse, causal, D**-0.5)
    b = _run(q, k, v, do, o, lse, causal, D**-0.5)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize(
    "case",
    [(1, 8, 2, 300, 300, 128), (2, 8, 2, 77, 300, 64), (1, 16, 4, 129, 1000, 128), (1, 8, 1, 1000, 129, 128)],
    ids=lambda c: "B{}H{}-{}S{}K{}D{}".format(*c),
)
def test_gpu_split_group_matches_float64(
    device: str, monkeypatch: pytest.MonkeyPatch, split: int, case
) -> None:
    """The dk/dv kernel with each GQA group split over `split` CTAs (fp32 partials summed in order by
    _split_sum_kernel), forced by FUSEKIT_HOPPER_BWD_SPLIT: float64-exact within the tolerance, causal with
    ragged tails and rows that see no key, and bit-identical on a second run."""
    _need_sm90(device)
    monkeypatch.setenv("FUSEKIT_HOPPER_BWD_SPLIT", str(split))
    B, H, Hkv, S, Skv, D = case
    assert _mod().dkdv_split(True, D, 8, B * Hkv, H // Hkv, 0) == split
    dt = torch.bfloat16
    q, k, v, do = _inputs(B, H, Hkv, S, Skv, D, dt, sum(case) + split)
    o, lse, ref = _reference(q, k, v, do, True, D**-0.5)
    got = _run(q, k, v, do, o, lse, True, D**-0.5)
    _check(got, ref, dt)
    again = _run(q, k, v, do, o, lse, True, D**-0.5)
    for x, y in zip(got, again, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("split", [2, 4])
def test_split_sum_kernel_adds_in_split_order(split: int) -> None:
    """_split_sum_kernel (a plain Triton kernel: the CPU interpreter runs it): dk, dv = the fp32 sum of the
    partials in split order, rounded once; bit-identical to that sum done in torch, ragged tail included."""
    import os

    m = _mod()
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU (the triton session) or a GPU")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = 2 * m.SPLIT_BLOCK + 37
    g = torch.Generator(device="cpu").manual_seed(split)
    ws = torch.randn(2, split * n, generator=g).to(dev)
    dk = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=dev)
    dv = torch.full_like(dk, float("nan"))
    m._split_sum_kernel[(-(-n // m.SPLIT_BLOCK), 2)](
        ws[0], ws[1], dk, dv, n, SPLIT=split, BLOCK=m.SPLIT_BLOCK
    )
    for got, part in ((dk, ws[0].view(split, n)), (dv, ws[1].view(split, n))):
        want = part[0].clone()
        for sp in range(1, split):
            want += part[sp]
        assert torch.equal(got, want.to(torch.bfloat16))


def test_dkdv_split_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured rule (unset or "auto"): split 2 for causal D128 with an even group where the grid fits the
    SMs, or twice that with long rows; else 1. A number forces a divisor of the group (else 1)."""
    m = _mod()
    monkeypatch.setattr(m, "num_sms", lambda dev=0: 132)
    for env in (None, "auto"):
        if env is None:
            monkeypatch.delenv("FUSEKIT_HOPPER_BWD_SPLIT", raising=False)
        else:
            monkeypatch.setenv("FUSEKIT_HOPPER_BWD_SPLIT", env)
        assert m.dkdv_split(True, 128, 16, 8, 4, 0) == 2  # B1 H32/8 S2048: 128 CTAs
        assert m.dkdv_split(True, 128, 32, 8, 4, 0) == 2  # B1 H32/8 S4096: 256 CTAs, long rows
        assert m.dkdv_split(True, 128, 16, 16, 4, 0) == 1  # B2 H32/8 S2048: 256 CTAs, short rows
        assert m.dkdv_split(True, 128, 8, 64, 4, 0) == 1  # B8 H32/8 S1024: 512 CTAs
        assert m.dkdv_split(True, 128, 32, 128, 4, 0) == 1  # B4 H32 S4096 GQA: 4096 CTAs
        assert m.dkdv_split(True, 64, 16, 8, 4, 0) == 1  # D64: the split was slower there
        assert m.dkdv_split(False, 128, 16, 8, 4, 0) == 1  # not causal: every CTA's work is the same
        assert m.dkdv_split(True, 128, 16, 8, 1, 0) == 1  # MHA: nothing to split
        assert m.dkdv_split(True, 128, 1, 1, 3, 0) == 1  # odd group
    monkeypatch.setenv("FUSEKIT_HOPPER_BWD_SPLIT", "4")
    assert m.dkdv_split(False, 64, 32, 128, 4, 0) == 4
    assert m.dkdv_split(True, 128, 16, 8, 2, 0) == 1  # 4 does not divide a group of 2
    monkeypatch.setenv("FUSEKIT_HOPPER_BWD_SPLIT", "1")
    assert m.dkdv_split(True, 128, 16, 8, 4, 0) == 1
    monkeypatch.setenv("FUSEKIT_HOPPER_BWD_SPLIT", "")  # set but empty: the rule, as unset
    assert m.dkdv_split(True, 128, 16, 8, 4, 0) == 2
    for bad in ("two", "-2", "1.5"):
        monkeypatch.setenv("FUSEKIT_HOPPER_BWD_SPLIT", bad)
        with pytest.raises(ValueError, match="FUSEKIT_HOPPER_BWD_SPLIT"):
            m.dkdv_split(True, 128, 16, 8, 4, 0)


def test_backward_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """attention.use_hopper_bwd: only without kv_len, at the size threshold, with every dense tensor contiguous
    and 16-byte aligned (what the TMA descriptors need); the device test is hopper_supported's (patched here)."""
    from kernels_triton import attention as A

    monkeypatch.setattr(_mod(), "hopper_supported", lambda *a: True)  # hopper_bwd_supported's device test
    monkeypatch.setattr(A, "GLUON", True)
    q, k, v = _qkv()
    dense = (q, k, v, q, q)
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 0)
    assert A.use_hopper_bwd(q, k, v, None, *dense)
    assert not A.use_hopper_bwd(q, k, v, torch.ones(q.shape[0], dtype=torch.int32), *dense)
    assert not A.use_hopper_bwd(q, k, v, None, q, k, v, q.transpose(2, 3), q)  # a strided do
    off = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # 2-byte offset
    assert not A.use_hopper_bwd(q, k, v, None, off, k, v, q, q)
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 4 * q.numel() * k.shape[2] + 1)
    assert not A.use_hopper_bwd(q, k, v, None, *dense)
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 0)
    monkeypatch.setattr(A, "GLUON", False)  # FUSEKIT_TRITON_ATTN_GLUON=0
    assert not A.use_hopper_bwd(q, k, v, None, *dense)


@pytest.mark.parametrize("causal", [False, True])
def test_gpu_ops_attention_backward_routes_here(device: str, monkeypatch: pytest.MonkeyPatch, causal) -> None:
    """ops.attention(backend="triton")'s backward runs these kernels where attention.use_hopper_bwd says so
    (the size threshold lowered to test sizes): dq, dk, dv against float64 autograd, GQA, ragged S."""
    from fusekit import ops
    from kernels_triton import attention as A

    _need_sm90(device)
    calls = []
    real = A.run_hopper_bwd
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 0)
    monkeypatch.setattr(A, "run_hopper_bwd", lambda *a: (calls.append(1), real(*a))[1])
    dt = torch.bfloat16
    q, k, v, do = _inputs(2, 8, 2, 203, 203, 128, dt, 23)
    _, _, ref = _reference(q, k, v, do, causal, 128**-0.5)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    y = ops.attention(qs, ks, vs, causal=causal, backend="triton")
    got = torch.autograd.grad(y, (qs, ks, vs), do)
    assert calls, "the Gluon backward did not run"
    _check(got, ref, dt)


def test_head_chunk_rule(monkeypatch: pytest.MonkeyPatch):
    """Launch-order chunks (the H200 probe in head_chunk's docstring): 1 without causal and at >= 32 blocks a
    head; else ~4 * SMs / blocks heads, at most 8 MiB of streamed operands and at most every head; the env
    override is clamped to [1, heads]."""
    m = _mod()
    monkeypatch.setattr(m, "num_sms", lambda dev: 132)
    monkeypatch.delenv("FUSEKIT_TRITON_ATTN_CHUNK", raising=False)
    mib = 1 << 20
    assert m.head_chunk(False, 8, 256, mib // 2, 0) == 1
    assert m.head_chunk(True, 32, 128, 2 * mib, 0) == 1  # S 4096: the tail is small, L2 costs
    assert m.head_chunk(True, 8, 256, mib // 2, 0) == 16  # B8 H32/8 S1024 D128 dq: the 8 MiB cap
    assert m.head_chunk(True, 16, 8, mib, 0) == 8  # B1 H32/8 S2048 dk/dv: every head
    assert m.head_chunk(True, 30, 1000, 1, 0) == 18  # cdiv(4 * 132, 30)
    monkeypatch.setenv("FUSEKIT_TRITON_ATTN_CHUNK", "500")
    assert m.head_chunk(False, 8, 64, mib, 0) == 64
    monkeypatch.setenv("FUSEKIT_TRITON_ATTN_CHUNK", "0")
    assert m.head_chunk(True, 8, 64, mib, 0) == 1


def test_launch_keys_hold_head_chunk_class(monkeypatch: pytest.MonkeyPatch):
    """launch_keyed remembers a compiled kernel per key: the key must hold every specialization Triton makes of
    head_chunk (== 1, divisible by 16), so a chunk of 17 never reuses the kernel compiled for 16. CPU tensors,
    with the descriptors, the preprocess and the launch replaced; the grid and the 1-D program count."""
    m = _mod()
    if not hasattr(m, "_dkdv_hopper"):
        pytest.skip("this Triton has no Gluon Hopper module")
    launches = []

    class _Pre:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    monkeypatch.setattr(m, "_bwd_preprocess_kernel", _Pre())  # the name this module launches
    monkeypatch.setattr(m, "_descriptors", lambda *a: {n: None for n in m._blocks(128, 64, 128)})
    monkeypatch.setattr(
        m, "launch_keyed", lambda fn, key, grid, args, consts: launches.append((fn, key, grid))
    )
    q, k, v = (torch.empty(4, 8, 256, 128, dtype=torch.bfloat16) for _ in range(3))
    lse = torch.empty(4, 8, 256)
    for chunk in ("16", "17", "1"):  # 32 heads: none is clamped
        monkeypatch.setenv("FUSEKIT_TRITON_ATTN_CHUNK", chunk)
        m.run_hopper_bwd(q, k, v, q, q, k, v, q, lse, True, 0.088)
    assert [fn for fn, _, _ in launches] == [m._dkdv_hopper, m._dq_hopper] * 3
    assert all(grid == (2 * 4 * 8,) for _, _, grid in launches)  # 2 blocks of 128 rows x B*H (Hkv = H) heads
    keys = [key for _, key, _ in launches]
    assert len(set(keys)) == 6


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace every launch of the forward and backward host paths (and the device queries) with a recorder:
    (kernel, key, grid, arguments with descriptors as (base pointer, shape, strides, box, layout), constexprs)."""
    fwd, bwd = importlib.import_module("kernels_triton._attention_hopper"), _mod()
    log: list = []

    def norm(a):
        if hasattr(a, "block_shape"):
            return (a.base.data_ptr(), tuple(a.shape), tuple(a.strides), tuple(a.block_shape), repr(a.layout))
        if isinstance(a, torch.Tensor):
            return ("tensor", a.data_ptr(), tuple(a.shape), tuple(a.stride()))
        return a

    def keyed(fn, key, grid, args, consts):
        log.append((fn.__name__, key, grid, tuple(norm(a) for a in args), tuple(sorted(consts.items()))))

    class Jit:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: log.append(
                (self.name, grid, tuple(norm(x) for x in a), tuple(sorted(kw.items())))
            )

    for mod in (fwd, bwd):
        monkeypatch.setattr(mod, "launch_keyed", keyed)
        monkeypatch.setattr(mod, "num_sms", lambda *a: 132)
    monkeypatch.setattr(fwd, "device_index", lambda *a: 0)
    monkeypatch.setattr(fwd, "l2_bytes", lambda *a: 50 * 2**20)
    monkeypatch.setattr(bwd, "_bwd_preprocess_kernel", Jit("preprocess"))
    monkeypatch.setattr(bwd, "_split_sum_kernel", Jit("split_sum"))
    return log


@pytest.mark.parametrize(
    "case", [(1, 32, 8, 256, 256, 128, True), (2, 8, 2, 77, 300, 64, True), (1, 8, 8, 129, 1000, 128, False)]
)
def test_plans_launch_as_fresh_ones(monkeypatch: pytest.MonkeyPatch, case) -> None:
    """run_hopper / run_hopper_bwd (CPU tensors, launches recorded): with each signature's plan remembered
    across calls while the FUSEKIT_HOPPER_* switches change between them, every launch equals the launch of a
    plan made fresh for that call - kernel, key, grid, arguments (descriptors field by field), constexprs."""
    if not _mod().HAS_GLUON:
        pytest.skip("the installed triton has no Gluon Hopper module")
    fwd, bwd = importlib.import_module("kernels_triton._attention_hopper"), _mod()
    log = _record_launches(monkeypatch)
    B, H, Hkv, S, Skv, D, causal = case
    g = torch.Generator().manual_seed(sum(case[:6]))
    q = torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)
    kc = torch.randn(B, Skv + 8, Hkv, D, generator=g).to(torch.bfloat16)
    k = kc.transpose(1, 2)[:, :, :Skv]  # a strided view (a cache), as attention takes it
    v = torch.randn(B, Hkv, Skv, D, generator=g).to(torch.bfloat16)
    o, lse, do = torch.empty_like(q), torch.empty(B, H, S), torch.randn_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty(k.shape, dtype=k.dtype), torch.empty_like(v)
    envs = [{}, {"FUSEKIT_HOPPER_BWD_SPLIT": "2"}, {"FUSEKIT_HOPPER_ATTN_PERSIST": "0"}, {},
            {"FUSEKIT_HOPPER_BWD_CFG": "64,3,128,2", "FUSEKIT_HOPPER_ATTN_PERSIST_ORDER": "global"}, {}]  # fmt: skip
    names = {n for e in envs for n in e}

    def calls(fresh: bool) -> list:
        out = []
        for env in envs:
            for n in names:
                monkeypatch.delenv(n, raising=False)
            for n, val in env.items():
                monkeypatch.setenv(n, val)
            for _ in range(2):
                if fresh:
                    fwd.clear_plans()
                    bwd.clear_plans()
                log.clear()
                fwd.run_hopper(o, lse, q, k, v, causal, 0.125)
                bwd.run_hopper_bwd(dq, dk, dv, do, q, k, v, o, lse, causal, 0.09)
                # workspace pointers (delta, lse2, the split's partials) are fresh per call: compare them by class
                out.append([_without_scratch(e, (q, k, v, o, lse, do, dq, dk, dv)) for e in log])
        return out

    warm = calls(False)
    fresh = calls(True)
    assert warm == fresh
    assert len(bwd._BWD_PLANS) == 1 and any(e[0] == "_dkdv_hopper" for e in log)


def _without_scratch(entry, tensors) -> object:
    """A recorded launch with pointers of anything but the call's own tensors replaced by 'scratch'."""
    own = {t.data_ptr() for t in tensors}

    def fix(x):
        if isinstance(x, tuple) and x and x[0] == "tensor":
            return ("tensor", x[1] if x[1] in own else "scratch", *x[2:])
        if isinstance(x, tuple) and len(x) == 5 and isinstance(x[0], int) and isinstance(x[1], tuple):
            return (x[0] if x[0] in own else "scratch", *x[1:])
        if isinstance(x, tuple):
            return tuple(fix(y) for y in x)
        return x

    return fix(entry)
