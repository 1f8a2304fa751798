"""HF-shaped inputs (issue #18, item 5): `layout=` of rope and attention, and HF's [S, D] rope tables.

Each check compares the new form with the canonical call of the same backend on the same values
(identical kernels, so exact equality, except where the canonical call itself goes through a
different copy), and the canonical call is checked against float64 by the conformance suite.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusekit import ops

F32 = torch.float32


def _dtype(backend: str, device: str) -> torch.dtype:
    # fp32 on the CPU (attention has an fp32 kernel only there), fp16 on a GPU
    return F32 if device == "cpu" else torch.float16


def _hf_tables(s: int, d: int, theta: float, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, D] built as HF does (each angle repeated for both elements of its pair)."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    emb = f.repeat_interleave(2, dim=-1) if interleaved else torch.cat((f, f), dim=-1)
    return emb.cos().float(), emb.sin().float()


@pytest.mark.parametrize("interleaved", (False, True))
def test_rope_hf_tables_and_bhsd(interleaved: bool, backend_name: str, device: str) -> None:
    torch.manual_seed(0)
    b, s, h, d = 2, 7, 3, 64
    dt = _dtype(backend_name, device)
    x = torch.randn(b, s, h, d, device=device).to(dt)
    cos_full, sin_full = (t.to(device) for t in _hf_tables(s + 2, d, 10000.0, interleaved))
    cos_half = cos_full[:, 0::2] if interleaved else cos_full[:, : d // 2]
    sin_half = sin_full[:, 0::2] if interleaved else sin_full[:, : d // 2]
    kw = {"interleaved": interleaved, "start_pos": 2, "backend": backend_name}
    want = ops.rope(x, cos=cos_half.contiguous(), sin=sin_half.contiguous(), **kw)
    got = ops.rope(x, cos=cos_full, sin=sin_full, **kw)
    assert torch.equal(got, want)
    # [B, H, S, D] in, [B, H, S, D] out: the same rotation as the [B, S, H, D] call
    got_bhsd = ops.rope(x.transpose(1, 2).contiguous(), cos=cos_full, sin=sin_full, layout="bhsd", **kw)
    assert got_bhsd.shape == (b, h, s, d)
    assert torch.equal(got_bhsd.transpose(1, 2), want)
    # the in-kernel angles too
    assert torch.equal(
        ops.rope(x.transpose(1, 2).contiguous(), layout="bhsd", **kw).transpose(1, 2), ops.rope(x, **kw)
    )


def test_rope_bhsd_gradient(backend_name: str, device: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(1, 4, 5, 64, device=device, dtype=_dtype(backend_name, device), requires_grad=True)
    g = torch.randn_like(x)
    (dx,) = torch.autograd.grad(ops.rope(x, layout="bhsd", backend=backend_name), x, g)
    x2 = x.detach().transpose(1, 2).contiguous().requires_grad_()
    (dx2,) = torch.autograd.grad(ops.rope(x2, backend=backend_name), x2, g.transpose(1, 2))
    assert torch.equal(dx, dx2.transpose(1, 2))


@pytest.mark.parametrize("d", (64, 96))  # 96: the gather kernel for a non-power-of-two head dim
def test_rope_reads_strided_views_in_place(d: int, backend_name: str, device: str, monkeypatch) -> None:
    """q and k as a model's layer makes them: heads of one fused qkv projection [B, S, H + 2 Hk, D]
    (token rows (H + 2 Hk) D apart), and a "bhsd" tensor (heads S D apart), rotated as views. Results
    equal the call on contiguous copies bit for bit (same kernel math), gradients too; on the triton
    backend the kernel receives the views themselves (no copy)."""
    torch.manual_seed(6)
    b, s, h, hk = 2, 9, 4, 2
    dt = _dtype(backend_name, device)
    qkv = torch.randn(b, s, h + 2 * hk, d, device=device).to(dt)
    q, k = qkv[:, :, :h], qkv[:, :, h : h + hk]
    seen: list[torch.Tensor] = []
    if backend_name == "triton":
        import kernels_triton.rope as kr

        real = kr._launch
        monkeypatch.setattr(
            kr, "_launch", lambda out, ko, x, kk, *a: (seen.extend((x, kk)), real(out, ko, x, kk, *a))
        )
    kw = {"start_pos": 3, "backend": backend_name}
    got_q, got_k = ops.rope(q, k, **kw)
    want_q, want_k = ops.rope(q.contiguous(), k.contiguous(), **kw)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if backend_name == "triton":
        assert seen[0].data_ptr() == qkv.data_ptr() and seen[0].stride(1) == (h + 2 * hk) * d
        assert seen[1].data_ptr() == k.data_ptr() and not seen[1].is_contiguous()
    xb = torch.randn(b, h, s, d, device=device).to(dt)  # [B, H, S, D]: read as [B, S, H, D] with stride S D
    assert torch.equal(
        ops.rope(xb, layout="bhsd", **kw).transpose(1, 2), ops.rope(xb.transpose(1, 2).contiguous(), **kw)
    )
    # the gradient through the views: the rotation back of the grads, into qkv's slices
    leaf = qkv.detach().clone().requires_grad_()
    gq, gk = torch.randn_like(want_q), torch.randn_like(want_k)
    yq, yk = ops.rope(leaf[:, :, :h], leaf[:, :, h : h + hk], **kw)
    ((yq * gq).sum() + (yk * gk).sum()).backward()
    ref = qkv.detach().clone().requires_grad_()
    rq, rk = ops.rope(ref[:, :, :h].contiguous(), ref[:, :, h : h + hk].contiguous(), **kw)
    ((rq * gq).sum() + (rk * gk).sum()).backward()
    assert torch.equal(leaf.grad, ref.grad)


def test_rope_table_errors() -> None:
    x = torch.randn(1, 4, 2, 8)
    cos, sin = _hf_tables(4, 8, 10000.0, interleaved=False)
    with pytest.raises(ValueError, match=r"^cos: a \[St, D\] table must repeat"):
        ops.rope(x, cos=cos, sin=sin, interleaved=True, backend="torch")  # half-split table, interleaved op
    with pytest.raises(ValueError, match=r"^sin: expected shape"):
        ops.rope(x, cos=cos, sin=sin[:, :3], backend="torch")
    with pytest.raises(ValueError, match=r"^layout: expected one of 'bshd', 'bhsd'"):
        ops.rope(x, layout="sbhd", backend="torch")


def _bshd_or_skip(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backend: str
) -> torch.Tensor:
    try:
        return ops.attention(q, k, v, causal=causal, layout="bshd", backend=backend)
    except ValueError as exc:
        if "cannot run" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.mark.parametrize("causal", (False, True))
def test_attention_bshd(causal: bool, backend_name: str, device: str) -> None:
    torch.manual_seed(2)
    b, h, hkv, s, skv, d = 2, 4, 2, 5, 9, 64
    dt = _dtype(backend_name, device)
    q = torch.randn(b, s, h, d, device=device).to(dt)
    k_cache = torch.randn(b, skv + 3, hkv, d, device=device).to(dt)  # a cache [B, max_len, Hkv, D]
    v_cache = torch.randn(b, skv + 3, hkv, d, device=device).to(dt)
    k, v = k_cache[:, :skv], v_cache[:, :skv]
    got = _bshd_or_skip(q, k, v, causal, backend_name)
    want = ops.attention(
        q.transpose(1, 2).contiguous(),
        k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(),
        causal=causal,
        backend=backend_name,
    )
    assert got.shape == (b, s, h, d)
    assert torch.allclose(got.transpose(1, 2).float(), want.float(), rtol=1e-3, atol=1e-3 * math.sqrt(d))


@pytest.mark.parametrize("causal", (False, True))
def test_attention_reads_a_strided_q_in_place(causal: bool, backend_name: str, device: str) -> None:
    """q as a model's layer makes it: heads of one fused qkv projection [B, S, H + 2 Hkv, D], read as "bshd"
    (row stride (H + 2 Hkv) D, no copy on the triton backend's FlashAttention kernel; S > 16 so that kernel
    runs, not the decode kernels). Output and the gradient through the view against the same call on
    contiguous copies: the forward kernel differs only in its q addressing, the backward copies q."""
    torch.manual_seed(3)
    b, h, hkv, s, d = 2, 4, 2, 37, 64
    dt = _dtype(backend_name, device)
    qkv = torch.randn(b, s, h + 2 * hkv, d, device=device).to(dt).requires_grad_()
    q, k, v = qkv[:, :, :h], qkv[:, :, h : h + hkv], qkv[:, :, h + hkv :]
    got = _bshd_or_skip(q, k, v, causal, backend_name)
    dout = torch.randn_like(got)
    (got * dout).sum().backward()
    ref = qkv.detach().clone().requires_grad_()
    qc, kc, vc = (t.transpose(1, 2).contiguous() for t in ref.split([h, hkv, hkv], dim=2))
    want = ops.attention(qc, kc, vc, causal=causal, backend=backend_name).transpose(1, 2)
    (want * dout).sum().backward()
    assert got.shape == (b, s, h, d)
    tol = {"rtol": 1e-3, "atol": 1e-3 * math.sqrt(d)}
    assert torch.allclose(got.float(), want.float(), **tol)
    assert torch.allclose(qkv.grad.float(), ref.grad.float(), **tol)


@pytest.mark.parametrize("s", (1, 5, 37))
def test_attention_output_takes_q_memory_order(s: int, backend_name: str, device: str) -> None:
    """o is laid out as q is (TensorArg.like): a "bshd" call's output is a contiguous [B, S, H, D], so
    `o.reshape(B, S, H * D)` is a view (as SDPA's output is for transposed inputs), for a q sliced from a
    fused qkv projection and for a plain [B, S, H, D] q; a contiguous [B, H, S, D] q keeps a contiguous o.
    On triton, S = 1 and 5 run the decode kernels (S = 1: q and o are contiguous whatever the layout; S = 5:
    a dense buffer copied into the strided o), S = 37 the FlashAttention kernel (through o's strides).
    Values against the contiguous call."""
    torch.manual_seed(4)
    b, h, hkv, d = 2, 4, 2, 64
    dt = _dtype(backend_name, device)
    qkv = torch.randn(b, s, h + 2 * hkv, d, device=device).to(dt)
    kv = torch.randn(b, 19, 2 * hkv, d, device=device).to(dt)  # a longer KV, as in decode
    k, v = kv[:, :, :hkv], kv[:, :, hkv:]
    want = ops.attention(
        *(t.transpose(1, 2).contiguous() for t in (qkv[:, :, :h], k, v)), causal=True, backend=backend_name
    )
    assert want.is_contiguous()
    for q in (qkv[:, :, :h], qkv[:, :, :h].contiguous()):
        got = _bshd_or_skip(q, k, v, True, backend_name)
        assert got.is_contiguous(), got.stride()
        assert got.reshape(b, s, h * d).data_ptr() == got.data_ptr()
        tol = {"rtol": 1e-3, "atol": 1e-3 * math.sqrt(d)}
        assert torch.allclose(got.float(), want.transpose(1, 2).float(), **tol)
        # the same call in [B, H, S, D] terms: o has q's strides
        o = ops.attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, backend=backend_name
        )
        assert o.transpose(1, 2).is_contiguous()
        assert torch.equal(o.transpose(1, 2), got)


def test_attention_fake_output_has_the_real_strides() -> None:
    """torch.compile traces the custom op with its fake implementation and trusts the strides it reports,
    so the fake o must be laid out exactly as the real one (q's memory order), forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(5)
    qkv = torch.randn(1, 7, 8, 64)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([4, 2, 2], dim=2))
    for qq in (q, q.contiguous()):
        args = (qq, k, v, None, True, 0.125, "torch", True)
        real = torch.ops.fusekit.attention(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = torch.ops.fusekit.attention(
                *(mode.from_tensor(a) if torch.is_tensor(a) else a for a in args)
            )
        for r, f in zip(real, fake):
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
        assert real[0].transpose(1, 2).is_contiguous() == (qq is q)  # q's memory order, both ways


def test_attention_layout_errors() -> None:
    q = torch.randn(1, 5, 4, 64)
    k = torch.randn(1, 9, 3, 64)  # 4 q heads, 3 kv heads in [B, S, H, D]
    with pytest.raises(ValueError, match=r"^k: q heads H=4 must be a multiple of kv heads Hkv=3"):
        ops.attention(q, k, k, layout="bshd", backend="torch")
    with pytest.raises(ValueError, match=r"^layout: expected one of 'bhsd', 'bshd'"):
        ops.attention(q, k, k, layout="BSHD", backend="torch")
    with pytest.raises(ValueError, match=r"^q: expected 4 dimensions"):
        ops.attention(q[0], k, k, layout="bshd", backend="torch")
