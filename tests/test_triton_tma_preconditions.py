"""TMA preconditions on every input a caller can pass: the tensor-descriptor kernels must never meet a base
address that is not 16-byte aligned or a stride that is not a multiple of 16 bytes.

    pytest tests/test_triton_tma_preconditions.py                  # CPU: Triton's interpreter (conftest sets it)
    pytest tests/test_triton_tma_preconditions.py --device cuda    # sm_90+: the layout cases on the GPU

On a GPU a device-built descriptor (tl.make_tensor_descriptor) over such memory gives undefined results or a
fault, not an error; Triton's interpreter validates each descriptor it builds (base aligned, leading strides
16-byte multiples, last stride 1) and raises, so on the CPU a launch that got past a launcher's gate with a
bad layout fails here. Layouts a caller can pass: q/k/v views at element offsets (`buf[1:].view(...)`,
`qkv[..., 64:]`), KV cache views with any per-key stride, bshd transposes, rows padded by a few elements;
outputs (o, dq, dk, dv) and grads (do) at odd offsets. Each case either runs the forced TMA tile (then it
must match the pointer tile) or is refused with the TMA ValueError; which one is pinned per case, so the
gate is neither vacuous nor looser than the descriptors. The tuned paths' choices follow each call's
alignment (autotuner per TMA eligibility, the FFN's choice key), also through fusekit's call memo.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from triton_fakes import fake_ffn_choice

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

F16 = torch.float16
B, H, HKV, S, SKV, D = 2, 2, 1, 16, 24, 64
TMA_FWD, PTR_FWD = (16, 16, 1, 1, True), (16, 16, 1, 1)
TMA_BWD, PTR_BWD = ((16, 16, 1, 1, True),) * 2, ((16, 16, 1, 1),) * 2
_GEN = torch.Generator().manual_seed(0)


def _needs_tma(dev: str) -> None:
    if dev == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels need sm_90+")


def _cpu_only(dev: str) -> None:
    if dev == "cuda":
        pytest.skip("checks the host's choices with the CPU interpreter's descriptor checks")


def _at(dev: str, shape: tuple[int, ...], off: int = 0, pad: int = 0, bshd: bool = False) -> torch.Tensor:
    """A [b, h, s, d] fp16 view `off` elements into its storage, rows `pad` elements longer than d, laid out
    [b, h, s, d] or (bshd) [b, s, h, d]."""
    b, h, s, d = shape
    n = b * h * s * (d + pad)
    buf = torch.randn(off + n, generator=_GEN, dtype=torch.float32).to(dev, F16)[off:]
    if bshd:
        return buf.view(b, s, h, d + pad)[..., :d].transpose(1, 2)
    return buf.view(b, h, s, d + pad)[..., :d]


def _cache(dev: str, off: int, key_pad: int) -> torch.Tensor:
    """k or v as a KV cache view: [B, max_len, Hkv, D + key_pad] read as [B, Hkv, SKV, D] (per-key stride
    Hkv * (D + key_pad) elements), `off` elements into its storage."""
    max_len = SKV + 8
    n = B * max_len * HKV * (D + key_pad)
    buf = torch.randn(off + n, generator=_GEN, dtype=torch.float32).to(dev, F16)[off:]
    return buf.view(B, max_len, HKV, D + key_pad)[:, :SKV, :, :D].transpose(1, 2)


def _odd_head_stride(dev: str) -> torch.Tensor:
    """k [B, Hkv=2, SKV, D] whose heads are SKV * D + 3 elements apart (rows 16-byte multiples, head and
    batch strides not)."""
    per = SKV * D + 3
    buf = torch.randn(B * 2 * per, generator=_GEN, dtype=torch.float32).to(dev, F16)
    return buf.as_strided((B, 2, SKV, D), (2 * per, per, D, 1))


# name -> (builder of {q, k, v, o} overrides, refused): every case but the override is dense and aligned
FWD_CASES = {
    "dense": (lambda d: {}, False),
    "bshd_views": (
        lambda d: {"q": _at(d, (B, H, S, D), bshd=True), "o": _at(d, (B, H, S, D), bshd=True)},
        False,
    ),
    "kv_cache_view": (lambda d: {"k": _cache(d, 0, 0), "v": _cache(d, 0, 0)}, False),
    "q_16_bytes_in": (lambda d: {"q": _at(d, (B, H, S, D), off=8)}, False),
    "q_2_bytes_in": (lambda d: {"q": _at(d, (B, H, S, D), off=1)}, True),
    "q_bshd_2_bytes_in": (lambda d: {"q": _at(d, (B, H, S, D), off=1, bshd=True)}, True),
    "q_rows_padded_8_bytes": (lambda d: {"q": _at(d, (B, H, S, D), pad=4)}, True),
    "q_rows_padded_16_bytes": (lambda d: {"q": _at(d, (B, H, S, D), pad=8)}, False),
    "k_cache_2_bytes_in": (lambda d: {"k": _cache(d, 1, 0)}, True),
    "k_cache_key_stride_odd": (lambda d: {"k": _cache(d, 0, 1)}, True),
    "v_cache_key_stride_8_bytes": (lambda d: {"v": _cache(d, 0, 4)}, True),
    "v_cache_key_stride_16_bytes": (lambda d: {"v": _cache(d, 0, 8)}, False),
    "k_head_stride_odd": (lambda d: {"k": _odd_head_stride(d), "v": _odd_head_stride(d)}, True),
    "o_2_bytes_in": (lambda d: {"o": _at(d, (B, H, S, D), off=1)}, True),
    "o_bshd_rows_padded_8_bytes": (lambda d: {"o": _at(d, (B, H, S, D), pad=4, bshd=True)}, True),
}


def _fwd_inputs(d: str, case: str) -> tuple[dict[str, torch.Tensor], bool]:
    build, refused = FWD_CASES[case]
    over = build(d)
    hkv = over["k"].shape[1] if "k" in over else HKV
    t = {
        "q": _at(d, (B, H, S, D)),
        "k": _at(d, (B, hkv, SKV, D)),
        "v": _at(d, (B, hkv, SKV, D)),
        "o": _at(d, (B, H, S, D)),
    }
    t.update(over)
    return t, refused


@pytest.mark.parametrize("case", list(FWD_CASES))
def test_forward_tma_tile_only_on_tma_legal_inputs(attn, dev: str, case: str) -> None:
    """A forced TMA tile runs (and matches the pointer tile) or is refused, as pinned; never a descriptor
    over a misaligned base or stride (the interpreter would raise InterpreterError)."""
    _needs_tma(dev)
    t, refused = _fwd_inputs(dev, case)
    q, k, v, o = t["q"], t["k"], t["v"], t["o"]
    lse = torch.empty(q.shape[:3], device=dev)
    if refused:
        with pytest.raises(ValueError, match="TMA"):
            attn.forward(o, lse, q, k, v, None, True, 0.125, _config=TMA_FWD)
        return
    attn.forward(o, lse, q, k, v, None, True, 0.125, _config=TMA_FWD)
    o_ptr, lse_ptr = torch.empty(q.shape, dtype=F16, device=dev), torch.empty(q.shape[:3], device=dev)
    attn.forward(o_ptr, lse_ptr, q, k, v, None, True, 0.125, _config=PTR_FWD)
    torch.testing.assert_close(o, o_ptr, rtol=1e-3, atol=1e-3)  # the same bits in the interpreter
    torch.testing.assert_close(lse, lse_ptr, rtol=1e-4, atol=1e-4)


def _contig_at(dev: str, shape: tuple[int, ...], off: int) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.randn(off + n, generator=_GEN, dtype=torch.float32).to(dev, F16)[off:].view(shape)


BWD_CASES = {
    "dense": ({}, False),
    "kv_cache_view": ({"k": lambda d: _cache(d, 0, 0), "v": lambda d: _cache(d, 0, 0)}, False),
    "k_cache_key_stride_odd": ({"k": lambda d: _cache(d, 0, 1)}, True),
    "q_2_bytes_in": ({"q": lambda d: _contig_at(d, (B, H, S, D), 1)}, True),
    "do_2_bytes_in": ({"do": lambda d: _contig_at(d, (B, H, S, D), 1)}, True),  # a grad narrowed out of a cat
    "dq_2_bytes_in": ({"dq": lambda d: _contig_at(d, (B, H, S, D), 1)}, True),
    "dk_2_bytes_in": ({"dk": lambda d: _contig_at(d, (B, HKV, SKV, D), 1)}, True),
    "dv_16_bytes_in": ({"dv": lambda d: _contig_at(d, (B, HKV, SKV, D), 8)}, False),
}


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_backward_tma_tiles_only_on_tma_legal_inputs(attn, dev: str, case: str) -> None:
    """The backward's forced TMA tiles (dk/dv and dq kernels) likewise: run and match, or refused."""
    _needs_tma(dev)
    d = dev
    over, refused = BWD_CASES[case]
    t = {
        "q": _at(d, (B, H, S, D)), "k": _at(d, (B, HKV, SKV, D)), "v": _at(d, (B, HKV, SKV, D)),
        "do": _contig_at(d, (B, H, S, D), 0), "dq": _contig_at(d, (B, H, S, D), 0),
        "dk": _contig_at(d, (B, HKV, SKV, D), 0), "dv": _contig_at(d, (B, HKV, SKV, D), 0),
    }  # fmt: skip
    t.update({n: f(d) for n, f in over.items()})
    o, lse = torch.empty(B, H, S, D, dtype=F16, device=d), torch.empty(B, H, S, device=d)
    attn.forward(o, lse, t["q"], t["k"], t["v"], None, True, 0.125, _config=PTR_FWD)
    args = (t["do"], t["q"], t["k"], t["v"], o, lse, None, True, 0.125)
    if refused:
        with pytest.raises(ValueError, match="TMA"):
            attn.backward(t["dq"], t["dk"], t["dv"], *args, _config=TMA_BWD)
        return
    attn.backward(t["dq"], t["dk"], t["dv"], *args, _config=TMA_BWD)
    want = [torch.empty_like(t[n]) for n in ("dq", "dk", "dv")]
    attn.backward(*want, *args, _config=PTR_BWD)
    for name, w in zip(("dq", "dk", "dv"), want, strict=True):
        torch.testing.assert_close(
            t[name], w, rtol=1e-3, atol=1e-3, msg=f"{name}: TMA tiles differ from pointer tiles"
        )


def test_tuned_forward_follows_each_calls_alignment(attn, dev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through fusekit.ops.attention's call memo (its key holds shapes and strides, not storage offsets): calls
    with one key, q at 0 / 2 / 0 / 8 / 16 bytes into its storage, get the autotuner with TMA tiles exactly when
    q is 16-byte aligned (TMA eligibility is decided per call and picks the autotuner: no cached choice of an
    aligned call reaches a misaligned one)."""
    _cpu_only(dev)
    from fusekit.ops.attention import attention

    asked: list[bool] = []

    class _Launch:
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    monkeypatch.setattr(attn, "is_interpreter", lambda: False)  # the tuned path (its gate still sees the CPU)
    monkeypatch.setattr(attn, "_tuned", lambda d, tma_ok: asked.append(tma_ok) or _Launch())
    s = 32  # any length: the autotuner offers TMA tiles wherever the preconditions hold
    n = 1 * 2 * s * D
    buf = torch.zeros(n + 8, dtype=F16)
    k = v = torch.zeros(1, 1, s, D, dtype=F16)
    for off in (0, 1, 0, 4, 8):
        attention(buf[off : off + n].view(1, 2, s, D), k, v, backend="triton")
    assert asked == [True, False, True, False, True]


@pytest.fixture
def ffn_tma(monkeypatch: pytest.MonkeyPatch):
    """swiglu_ffn's automatic ptr-vs-TMA choice on the CPU with the GPU's eligibility rule (alignment only),
    fresh caches, timings faked so that the TMA config wins wherever it competes."""
    import kernels_triton.swiglu_ffn as ffn

    return fake_ffn_choice(monkeypatch, ffn._tma_aligned)[0]


def test_ffn_tma_choice_is_keyed_on_alignment(dev: str, ffn_tma) -> None:
    """A weight view 2 bytes into its storage (contiguous: the op's .contiguous() keeps it) after an aligned
    call of the same shapes: its own choice key, no TMA candidate, so the pointer kernels (the interpreter
    would raise on a TMA descriptor over it); the aligned call keeps its TMA choice."""
    _cpu_only(dev)
    ffn = ffn_tma
    T, Dm, Fh = 40, 64, 48
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(T, Dm, generator=g)).to(F16)
    w = [(torch.randn(*s, generator=g) / s[1] ** 0.5).to(F16) for s in ((Fh, Dm), (Fh, Dm), (Dm, Fh))]
    y_tma = torch.empty(T, Dm, dtype=F16)
    ffn.forward(y_tma, None, None, x, *w, None, 1e-6, _path="prefill")
    picked = {k[0]: v for k, v in ffn._CHOICE.items()}
    assert picked == {"gate_up": ffn._TMA_INTERP, "down": ffn._TMA_INTERP}
    wu_odd = torch.empty(Fh * Dm + 1, dtype=F16)[1:].view(Fh, Dm).copy_(w[1])
    assert wu_odd.is_contiguous() and wu_odd.data_ptr() % 16
    y_odd = torch.empty(T, Dm, dtype=F16)
    ffn.forward(y_odd, None, None, x, w[0], wu_odd, w[2], None, 1e-6, _path="prefill")
    by_align = {(k[0], k[6]): v for k, v in ffn._CHOICE.items()}
    assert by_align[("gate_up", False)] == "ptr" and by_align[("down", False)] == "ptr"
    assert by_align[("gate_up", True)] == ffn._TMA_INTERP
    torch.testing.assert_close(y_odd, y_tma, rtol=2e-3, atol=2e-3)


def test_broadcast_rows_and_heads_never_reach_a_descriptor(dev: str) -> None:
    """A stride of 0 over a dimension of size > 1 (an expanded MQA k/v, a batch-shared prefix, keys
    broadcast over the sequence) is 16-byte aligned but outside cuTensorMapEncodeTiled's documented rules:
    the Gluon host descriptors (4-d, every stride) refuse any such dimension, the Triton TMA tiles (2-d per
    head: the row stride) a broadcast row dimension; size-1 dimensions stay free. On the CPU the interpreter
    stands for an sm_90 GPU; on a GPU the tensors are its own (on the CPU tensors `_tma_ok` is False there)."""
    _needs_tma(dev)
    from kernels_triton import _attention_hopper as hop
    from kernels_triton import attention_backward as ab

    k1 = torch.randn(B, 1, SKV, D, dtype=F16, device=dev)
    assert hop._aligned16(k1.expand(B, 1, SKV, D))
    assert not hop._aligned16(k1.expand(B, 4, SKV, D))  # MQA heads expanded: stride 0 over 4 heads
    assert not hop._aligned16(k1[:1].expand(B, 1, SKV, D))  # a prefix shared by the batch
    assert hop._aligned16(torch.randn(1, 1, SKV, D, dtype=F16, device=dev).expand(1, 1, SKV, D))
    q = torch.randn(B, H, S, D, dtype=F16, device=dev)
    row = torch.randn(B, HKV, 1, D, dtype=F16, device=dev)
    assert ab._tma_ok(q, row.expand(B, HKV, SKV, D), row.expand(B, HKV, SKV, D)) is False
    kv = torch.randn(B, HKV, SKV, D, dtype=F16, device=dev)
    assert ab._tma_ok(q, kv, kv) is True
    assert ab._tma_ok(q, kv[:1].expand(B, HKV, SKV, D), kv) is True  # batch broadcast: per-head 2-d boxes
