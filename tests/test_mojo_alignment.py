"""Mojo kernels against caller layouts they cannot assume: contiguous views at an odd element offset of
their storage (`buf[1:].view(...)`: 2-byte aligned fp16 / bf16 rows, what a parameter packed into a flat
buffer or a slice of a fused projection gives) and row lengths that are not a whole number of 16-byte
vectors.

    pytest tests/test_mojo_alignment.py --backends torch,mojo [--device cuda]

The host wraps every tensor without a copy (backends/mojo/dispatch.py; the library makes inputs contiguous,
never aligned), so each GPU launcher picks its 16-byte / cp.async / TMA kernels from the pointers it is
handed (`is_aligned16`, `Int(p) % 16`) and a scalar variant otherwise: a vector access through a misaligned
pointer faults the CUDA context (misaligned address). On the CPU, where unaligned SIMD loads work, these
tests pin the host side (the launcher sees the caller's pointer itself, and replays are keyed by it) and the
values; with `--device cuda` the same calls exercise the GPU guards (benchmarks/gpu_checks/mojo_align.py runs
them one process per case, so a fault cannot take the other cases down). Shared memory: an array accessed in
wider words than its element must declare that alignment (its default is the element's).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fusekit import backends, ops
from fusekit.tolerances import rtol

ROOT = Path(__file__).resolve().parents[1]
MOJO = ROOT / "mojo"


def _odd(t: torch.Tensor) -> torch.Tensor:
    """t's values, contiguous, one element past its storage's (allocator-aligned) start."""
    buf = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16 != 0
    return out


def _need_mojo() -> None:
    why = backends.available()["mojo"]
    if why is not None:
        pytest.skip(f"the mojo backend is not installed: {why}")


# --- the sources: shared arrays and the word sizes they are accessed in ---------------------------------
_ELEM_BYTES = {"Float32": 4, "_F32": 4, "F32": 4, "DType.float32": 4, "Int32": 4, "DType.int32": 4}


def _op_files() -> list[Path]:
    return sorted(MOJO.glob("*.mojo")) + sorted(MOJO.glob("tc/*.mojo"))


def test_shared_arrays_declare_the_alignment_their_accesses_claim() -> None:
    """`unsafe_stack_allocation[n, T, address_space=SHARED]` is `.shared .align sizeof(T)` in the PTX (checked
    with `mojo build --emit asm --target-accelerator sm_90`); an access with `alignment=K` > that is aligned
    only by the accident of the other arrays' sizes. T a dtype parameter counts as 2 bytes (fp16 / bf16).
    (_attention_decode.mojo's tile kernel read and wrote its fp16 / bf16 K / V tiles in 4-byte words.)
    Dynamic shared memory (`external_memory`) must be declared 16-byte aligned: cp.async writes 16 bytes."""
    alloc = re.compile(r"var (\w+) = unsafe_stack_allocation\[([^\]]*)\]")
    bad = []
    for f in _op_files():
        text = f.read_text()
        for m in alloc.finditer(text):
            name, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
            declared = [a for a in args if a.startswith("alignment=")]
            align = int(declared[0].split("=")[1]) if declared else _ELEM_BYTES.get(args[1], 2)
            for acc in re.finditer(rf"\b{name}\.unsafe_(?:load|store)\[[^\]]*alignment=(\d+)", text):
                if int(acc.group(1)) > align:
                    line = text.count("\n", 0, acc.start()) + 1
                    bad.append(f"{f.name}:{line} {name} (declared {align}, accessed {acc.group(1)})")
        for m in re.finditer(r"external_memory\[(.*?)\]\(\)", text):
            a = re.search(r"alignment=(\d+)", m.group(1))
            if a is None or int(a.group(1)) < 16:
                bad.append(f"{f.name}:{text.count(chr(10), 0, m.start()) + 1} external_memory below 16 bytes")
    assert not bad, f"shared-memory accesses wider than their array's alignment: {bad}"


# --- the host: the launcher gets the caller's pointer, and replays are keyed by it ----------------------
def test_the_launcher_sees_the_callers_misaligned_pointer(monkeypatch) -> None:
    """No layer between ops.rms_norm and the Mojo launcher copies or realigns a contiguous odd-offset view,
    so the kernel choice is the launcher's alone; the dispatcher's replay key is the pointer itself, so a
    graph captured for an aligned call is never replayed for a misaligned one (nor the reverse)."""
    _need_mojo()
    from fusekit.backends.mojo import dispatch

    seen: list[list[torch.Tensor]] = []
    real = dispatch.call_tensors

    def spy(*a, **k):
        ts = real(*a, **k)
        seen.append(ts)
        return ts

    monkeypatch.setattr(dispatch, "call_tensors", spy)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g)
    w = torch.randn(40, generator=g)
    xo, wo = _odd(x), _odd(w)
    y = ops.rms_norm(xo, wo, backend="mojo")
    ptrs = [t.data_ptr() for t in seen[-1]]
    assert xo.data_ptr() in ptrs and wo.data_ptr() in ptrs, "the odd-offset view was copied before the kernel"
    torch.testing.assert_close(y, ops.rms_norm(x, w, backend="torch"))
    assert dispatch.arg_key(xo) != dispatch.arg_key(x.clone())


# --- values: every op on odd-offset views and ragged rows, against backend="torch" -----------------------
def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _grads(out: torch.Tensor | tuple, leaves: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]
    return list(torch.autograd.grad(outs, leaves, cot, allow_unused=True))


def _case_rms_norm(backend, mk, dt, dev):
    g = torch.Generator().manual_seed(1)
    res = []
    for n in (40, 36, 37):  # whole 16-byte rows in fp32 (not bf16), 4-byte rows, odd rows
        x, r = (torch.randn(5, n, generator=g).to(dev, dt) for _ in range(2))
        w = (1 + 0.1 * torch.randn(n, generator=g)).to(dev, dt)
        leaves = [mk(v).requires_grad_() for v in (x, r, w)]
        out = ops.rms_norm(leaves[0], leaves[2], residual=leaves[1], backend=backend)
        res += [*out, *_grads(out, leaves, n)]
    return res


def _case_layer_norm(backend, mk, dt, dev):
    g = torch.Generator().manual_seed(2)
    res = []
    for n in (40, 37):
        x, r = (torch.randn(4, n, generator=g).to(dev, dt) for _ in range(2))
        w, b = ((1 + 0.1 * torch.randn(n, generator=g)).to(dev, dt) for _ in range(2))
        leaves = [mk(v).requires_grad_() for v in (x, r, w, b)]
        out = ops.layer_norm(leaves[0], leaves[2], leaves[3], residual=leaves[1], backend=backend)
        res += [*out, *_grads(out, leaves, n)]
    return res


def _case_rope(backend, mk, dt, dev):
    g = torch.Generator().manual_seed(3)
    res = []
    for d, inter in ((32, False), (40, True), (36, False)):  # half 16 / 20 / 18
        q = torch.randn(2, 3, 4, d, generator=g).to(dev, dt)
        k = torch.randn(2, 3, 2, d, generator=g).to(dev, dt)
        pos = mk(torch.tensor([[5, 0, 9], [1, 2, 3]], dtype=torch.int32, device=dev))
        leaves = [mk(v).requires_grad_() for v in (q, k)]
        out = ops.rope(leaves[0], leaves[1], positions=pos, interleaved=inter, backend=backend)
        res += [*out, *_grads(out, leaves, d)]
        cos = mk(torch.randn(12, d // 2, generator=g).to(dev))
        sin = mk(torch.randn(12, d // 2, generator=g).to(dev))
        res.append(ops.rope(mk(q), start_pos=2, cos=cos, sin=sin, backend=backend))
    return res


def _case_reduce_sum(backend, mk, dt, dev):
    g = torch.Generator().manual_seed(4)
    res = []
    for shape in ((6, 2500), (3, 37)):  # block-per-row rows and one-warp rows on a GPU
        x = mk(torch.randn(shape, generator=g).to(dev, dt)).requires_grad_()
        out = ops.reduce_sum(x, -1, backend=backend)
        res += [out, *_grads(out, [x], shape[1])]
    return res


def _case_swiglu_ffn(backend, mk, dt, dev):
    g = torch.Generator().manual_seed(5)
    res = []
    for tok, d, f in ((3, 40, 48), (20, 36, 44)):  # decode GEMVs; a prefill (the GEMM route on CUDA)
        x = torch.randn(tok, d, generator=g).to(dev, dt)
        ws = [(torch.randn(*s, generator=g) / 6).to(dev, dt) for s in ((f, d), (f, d), (d, f))]
        nw = (1 + 0.1 * torch.randn(d, generator=g)).to(dev, dt)
        leaves = [mk(v).requires_grad_() for v in (x, *ws, nw)]
        out = ops.swiglu_ffn(leaves[0], *leaves[1:4], norm_weight=leaves[4], backend=backend)
        res += [out, *_grads(out, leaves, tok)]
    return res


def _case_linear_cross_entropy(backend, mk, dt, dev):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 40, generator=g).to(dev, dt)
    w = (torch.randn(37, 40, generator=g) / 4).to(dev, dt)  # V = 37: ragged logits rows
    b = torch.randn(37, generator=g).to(dev, dt)
    y = mk(torch.tensor([0, 36, -100, 5, 17, 3, 36], device=dev))
    leaves = [mk(v).requires_grad_() for v in (x, w, b)]
    out = ops.linear_cross_entropy(leaves[0], leaves[1], y, leaves[2], backend=backend)
    return [out, *_grads(out, leaves, 7)]


def _case_attention_decode(backend, mk, dt, dev):
    g = torch.Generator().manual_seed(7)
    res = []
    for h, hkv, s, d in ((8, 2, 1, 64), (32, 2, 1, 128), (8, 8, 3, 64)):  # GQA 4, 16 rows, MHA S 3
        q = torch.randn(2, h, s, d, generator=g).to(dev, dt)
        k, v = (torch.randn(2, hkv, 77, d, generator=g).to(dev, dt) for _ in range(2))
        kv_len = mk(torch.tensor([77, 40], dtype=torch.int32, device=dev))
        leaves = [mk(a).requires_grad_() for a in (q, k, v)]
        out = ops.attention(*leaves, causal=True, kv_len=kv_len, backend=backend)
        res += [out, *_grads(out, leaves, h)]
    return res


CASES = {
    "rms_norm": _case_rms_norm,
    "layer_norm": _case_layer_norm,
    "rope": _case_rope,
    "reduce_sum": _case_reduce_sum,
    "swiglu_ffn": _case_swiglu_ffn,
    "linear_cross_entropy": _case_linear_cross_entropy,
    "attention": _case_attention_decode,
}


@pytest.mark.parametrize("op", list(CASES))
def test_odd_offset_views_match_torch(op: str, device: str) -> None:
    """Every tensor argument one element into its storage (misaligned for any vector width), rows that are
    not whole 16-byte vectors: backend="mojo" gives backend="torch"'s values on aligned tensors."""
    _need_mojo()
    dt = _dtype(device)
    got = CASES[op]("mojo", _odd, dt, device)
    want = CASES[op]("torch", lambda v: v.clone(), dt, device)
    bound = 2 * rtol(op, dt, "backward")
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None, f"{op}[{i}]"
            continue
        assert torch.isfinite(a).all(), f"{op}[{i}]: non-finite values"
        assert _rel(a, b) <= bound, f"{op}[{i}]: relative error {_rel(a, b):.2e} > {bound:.1e}"
