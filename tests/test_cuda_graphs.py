"""CUDA graphs (issue #11, item 2): every op captures in `torch.cuda.graph` and replays on new inputs, and
runs under `torch.compile(mode="reduce-overhead")` (cudagraph trees, forward and backward).

    pytest tests/test_cuda_graphs.py --device cuda --backends triton      (the capture tests need a GPU)

For each op × backend, on the first CUDA case of `tests/cases/<op>.py` (forward, and forward+backward for
differentiable ops): one warm-up call, a capture, then the captured inputs are overwritten in place with
fresh random values and the graph replayed; the replayed outputs must equal an eager call on the new
inputs (same kernels, same configs: bit-identical except where a kernel is documented nondeterministic).
A first call of a signature inside a capture is refused with a clear error (it compiles and tunes). The
mojo backend's launches run on MAX's stream, which the call's stream fence joins to torch's capture;
FUSEKIT_MOJO_CAPTURE=0 refuses mojo calls inside a capture instead. On the CPU only the refusal logic is
checked (with a stand-in plan), the rest skips.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cases import module
from checks import assert_close

from fusekit import backends, library, ops
from fusekit.tolerances import rtol

GRAPH_DTYPE = torch.bfloat16


def test_first_call_in_capture_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU check of the guard: a provider that sets up on first calls is refused while capturing."""
    spec = ops.rms_norm.__globals__["SPEC"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    setup = SimpleNamespace(guard=True, provider=SimpleNamespace(name="triton", first_call_setup=True))
    with pytest.raises(RuntimeError, match=r"rms_norm \(forward, backend 'triton'\).*warm-up"):
        library._refuse_first_call_in_capture(spec, "forward", setup)
    plain = SimpleNamespace(guard=True, provider=SimpleNamespace(name="torch", first_call_setup=False))
    library._refuse_first_call_in_capture(spec, "forward", plain)  # the torch backend needs no warm-up
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    library._refuse_first_call_in_capture(spec, "forward", setup)  # not capturing: nothing to refuse
    assert backends.get("triton").first_call_setup and not backends.get("torch").first_call_setup


def _cuda_case(op: str) -> tuple[tuple, dict]:
    mod = module(op)
    dtype = GRAPH_DTYPE if GRAPH_DTYPE in mod.DTYPES else mod.DTYPES[0]
    return mod.make(mod.CUDA[0], dtype, "cuda")


def _phase_case(op: str, phase: str, device: str) -> tuple:
    """(op function, args, kwargs, whether grads are taken, the args that require grad) of the op's first
    CUDA case; the backward phase makes the floating args leaves. Skips off CUDA."""
    if device != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    torch.manual_seed(0)
    args, kwargs = _cuda_case(op)
    grad = phase == "backward"
    if grad:
        args = tuple(
            a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.dtype.is_floating_point else a
            for a in args
        )
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if grad and not leaves:
        pytest.skip(f"{op} has no floating inputs")
    return getattr(ops, op), args, kwargs, grad, leaves


def _refill(t: object) -> None:
    """New random values in place (the captured addresses stay)."""
    if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel():
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, device=t.device).to(t.dtype))


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("op", ops.OPS)
@pytest.mark.parametrize("phase", ("forward", "backward"))
def test_capture_and_replay(op: str, phase: str, backend_name: str, device: str) -> None:
    fn, args, kwargs, grad, leaves = _phase_case(op, phase, device)

    def step() -> tuple[torch.Tensor, ...]:
        outs = _outputs(fn(*args, **kwargs, backend=backend_name))
        if not grad:
            return outs
        y = [o for o in outs if o.requires_grad]
        return outs + torch.autograd.grad(y, leaves, [torch.ones_like(o) for o in y])

    try:
        side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph's docs do
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
    except ValueError as exc:
        if "cannot run" in str(exc) or "has no backward here" in str(exc):
            pytest.skip(str(exc))
        raise
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for a in args:
        _refill(a)
    for v in kwargs.values():
        _refill(v)
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    for i, (g, w) in enumerate(zip(captured, want)):
        assert_close(
            f"{op}.{phase}[{i}] replay", g, w.double(), rtol(op, g.dtype, phase), f"{op} {backend_name}"
        )


def test_first_call_inside_capture_raises_then_warm_capture_works(backend_name: str, device: str) -> None:
    if device != "cuda" or backend_name != "triton":
        pytest.skip("needs --device cuda and the triton backend")
    x = torch.randn(3, 4099, device="cuda", dtype=torch.float16)  # a shape no other test warms up
    w = torch.randn(4099, device="cuda", dtype=torch.float16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up"), torch.cuda.graph(graph):
        ops.rms_norm(x, w, backend="triton")
    ops.rms_norm(x, w, backend="triton")  # the warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.rms_norm(x, w, backend="triton")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ops.rms_norm(x, w, backend="triton"))


@pytest.mark.parametrize("s", (1, 4))
def test_captured_decode_attention_reads_kv_len_at_replay(s: int, backend_name: str, device: str) -> None:
    """What static-cache decoding under CUDA graphs relies on (fusekit.hf's compiled generate): one graph
    captured over the whole cache [B, Hkv, max_len, D] with a kv_len tensor, replayed after the lengths
    and the values changed in place, gives the eager result for the new lengths."""
    if device != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    torch.manual_seed(0)  # _refill's values
    g = torch.Generator(device="cuda").manual_seed(7)
    b, h, hkv, max_len, d = 3, 8, 2, 300, 128
    q = torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(b, hkv, max_len, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(b, hkv, max_len, d, device="cuda", generator=g).to(torch.bfloat16)
    kv_len = torch.tensor([137, max_len, 5], dtype=torch.int32, device="cuda")

    def step() -> torch.Tensor:
        return ops.attention(q, k, v, causal=True, kv_len=kv_len, backend=backend_name)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            step()
    except ValueError as exc:
        if "cannot run" in str(exc):
            pytest.skip(str(exc))
        raise
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (q, k, v):
        _refill(t)
    kv_len.copy_(torch.tensor([max_len - 1, 64, 200], dtype=torch.int32))  # a decode step later
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    assert_close(
        "attention replay with new kv_len",
        captured,
        want.double(),
        rtol("attention", q.dtype, "forward"),
        f"attention decode S={s} {backend_name}",
    )


def test_mojo_capture_switched_off_is_refused(backend_name: str, device: str, monkeypatch) -> None:
    """FUSEKIT_MOJO_CAPTURE=0: a mojo call inside a capture raises naming the switch (nothing recorded)."""
    if device != "cuda" or backend_name != "mojo":
        pytest.skip("needs --device cuda and the mojo backend")
    import fusekit.backends.mojo as mojo_backend

    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    ops.rms_norm(x, w, backend="mojo")  # the warm-up
    torch.cuda.synchronize()
    monkeypatch.setattr(mojo_backend, "CAPTURE", False)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="FUSEKIT_MOJO_CAPTURE"), torch.cuda.graph(graph):
        ops.rms_norm(x, w, backend="mojo")


@pytest.mark.parametrize("op", ops.OPS)
@pytest.mark.parametrize("phase", ("forward", "backward"))
def test_reduce_overhead_compile(op: str, phase: str, backend_name: str, device: str) -> None:
    """torch.compile(mode="reduce-overhead"): the compiled call (and its backward) run as CUDA graphs of
    cudagraph trees; three steps on inputs refilled in place each give the eager result."""
    fn, args, kwargs, grad, leaves = _phase_case(op, phase, device)

    def f(*a):
        return _outputs(fn(*a, **kwargs, backend=backend_name))

    def step(call) -> tuple[torch.Tensor, ...]:
        outs = call(*args)
        if not grad:
            return tuple(o.detach().clone() for o in outs)
        y = [o for o in outs if o.requires_grad]
        gs = torch.autograd.grad(y, leaves, [torch.ones_like(o) for o in y])
        return tuple(o.detach().clone() for o in (*outs, *gs))

    try:
        step(f)  # the eager warm-up (compiles and tunes the kernels outside any capture)
    except ValueError as exc:
        if "cannot run" in str(exc) or "has no backward here" in str(exc):
            pytest.skip(str(exc))
        raise
    torch._dynamo.reset()
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for i in range(3):  # warm-up, record, replay
        for a in (*args, *kwargs.values()):
            _refill(a)
        torch.compiler.cudagraph_mark_step_begin()
        got = step(compiled)
        want = step(f)
        for j, (g, w) in enumerate(zip(got, want)):
            assert_close(
                f"{op}.{phase}[{j}] reduce-overhead step {i}",
                g,
                w.double(),
                rtol(op, g.dtype, phase),
                f"{op} {backend_name}",
            )
