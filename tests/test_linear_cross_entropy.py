"""linear_cross_entropy beyond the conformance cases: autograd through torch.library (torch.compile
fullgraph forward + backward), nothing computed or saved for backward without grad, float64 gradcheck,
the reductions' edge cases, and which backends claim it (torch, triton and mojo, fp16 gradients included).

The conformance driver (tests/cases/linear_cross_entropy.py) checks values and gradients against the
float64 oracle; the fuzz breakers check that bad arguments raise naming the argument.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from checks import assert_close

from fusekit import backends, ops
from fusekit.ops.linear_cross_entropy import SPEC, chunk_rows
from fusekit.tolerances import rtol

lce = importlib.import_module("fusekit.ops.linear_cross_entropy")  # ops.linear_cross_entropy is the function
T, H, V = 37, 64, 1031  # 37 tokens in chunks of 4 (chunk_rows): ten chunks, the last one short


def _inputs(device: str, dtype=torch.float32, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w = (torch.randn(V, H, generator=g) * 2 * H**-0.5).to(device, dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(device, dtype) if bias else None
    t = torch.randint(0, V, (T,), generator=g).to(device)
    t[::3] = -100
    return x, w, t, b


def _refused(exc: ValueError) -> None:
    if "cannot run" in str(exc) or "has no backward here" in str(exc):
        pytest.skip(str(exc))
    raise exc


def _hf(x, w, t, b, **kw):
    return F.cross_entropy(F.linear(x, w, b).float(), t, **kw)


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Liger's chunk rule alone (no 1 GiB floor), so these small cases run in several chunks."""
    monkeypatch.setattr(lce, "MIN_CHUNK_LOGITS", 0)


def test_chunks_are_about_the_size_of_x(monkeypatch):
    assert chunk_rows(T, V, H) == 4  # V / H -> 17 logits rows per x row: 37 / 17 -> 3 -> 4
    assert chunk_rows(8192, 128256, 4096) == 256  # Llama-3-8B by Liger's rule: 32 chunks of 256 tokens
    assert chunk_rows(9, 64, 64) == 9 and chunk_rows(1, 128256, 64) == 1
    monkeypatch.setattr(lce, "MIN_CHUNK_LOGITS", 1 << 29)  # the default floor: 1 GiB of bf16 logits
    assert chunk_rows(8192, 128256, 4096) == 4096  # 2 chunks of 4096 tokens
    assert chunk_rows(16384, 128256, 2048) == 4096 and chunk_rows(600, 128256, 4096) == 600
    assert chunk_rows(T, V, H) == T  # a small vocabulary: one chunk


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_compile_fullgraph_forward_and_backward(reduction, backend_name, device):
    """torch.compile(fullgraph=True) traces the loss (a graph break would raise) and its backward gives
    eager's gradients for x, weight and bias."""
    x, w, t, b = _inputs(device)

    def loss_fn(x, w, b):
        return ops.linear_cross_entropy(x, w, t, b, reduction=reduction, backend=backend_name) * 3.0

    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    try:
        want = loss_fn(*leaves)
    except ValueError as exc:
        _refused(exc)
    want_g = torch.autograd.grad(want, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)
    leaves2 = [v.clone().requires_grad_() for v in (x, w, b)]
    got = compiled(*leaves2)
    got_g = torch.autograd.grad(got, leaves2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


class _Spy:
    """Wraps a backend's forward to record which gradient outputs each call was handed."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, loss, dx, dweight, dbias, *rest):
        self.calls.append((dx is not None, dweight is not None, dbias is not None))
        return self.fn(loss, dx, dweight, dbias, *rest)


def _spy(monkeypatch, backend_name: str) -> _Spy:
    """The backend's forward entry, spied: the torch reference, the triton launcher, or the chunk loop the
    mojo backend hands its row kernel to (fused_forward)."""
    if backend_name == "mojo":
        import fusekit.backends.mojo as mb

        real, kernels = mb.fused_forward, []
        spy = _Spy(lambda *args: real(kernels[-1], *args))

        def entry(rows_kernel, *args):
            kernels.append(rows_kernel)
            return spy(*args)

        monkeypatch.setattr(mb, "fused_forward", entry)
        return spy
    if backend_name == "triton":
        import kernels_triton.linear_cross_entropy as k

        spy = _Spy(k.forward)
        monkeypatch.setattr(k, "forward", spy)
        # the backend keeps each op's entry once looked up: an earlier test's call would bypass the spy
        monkeypatch.setattr(backends.get("triton"), "_entries", {})
    else:
        spy = _Spy(SPEC.reference["forward"])
        monkeypatch.setitem(SPEC.reference, "forward", spy)
    return spy


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_leaf"])
def test_no_gradient_computed_or_saved_without_grad(mode, monkeypatch, backend_name, device):
    x, w, t, b = _inputs(device)
    leaves = [v.requires_grad_(mode != "no_leaf") for v in (x, w, b)]
    spy = _spy(monkeypatch, backend_name)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    try:
        with ctx():
            loss = ops.linear_cross_entropy(*leaves[:2], t, leaves[2], backend=backend_name)
    except ValueError as exc:
        _refused(exc)
    assert spy.calls == [(False, False, False)]
    assert loss.grad_fn is None and not loss.requires_grad
    torch.testing.assert_close(loss, _hf(x.detach(), w.detach(), t, b.detach()), rtol=1e-5, atol=1e-5)
    with torch.enable_grad():  # the same call recording a gradient computes all three
        leaves = [v.detach().requires_grad_() for v in (x, w, b)]
        ops.linear_cross_entropy(*leaves[:2], t, leaves[2], backend=backend_name)
    assert spy.calls[-1] == (True, True, True)


def test_gradcheck_float64_torch_backend():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(13, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 13, (9,), generator=g)
    t[2] = -100
    for reduction in ("mean", "sum"):
        for ls in (0.0, 0.3):

            def f(x, w, b, reduction=reduction, ls=ls):
                return ops.linear_cross_entropy(
                    x, w, t, b, reduction=reduction, label_smoothing=ls, backend="torch"
                )

            assert torch.autograd.gradcheck(f, (x, w, b))


def test_reduction_none_with_grad_raises_before_running(backend_name, device):
    x, w, t, b = _inputs(device)
    with pytest.raises(ValueError, match=r"^reduction: .*'none' has no backward here"):
        ops.linear_cross_entropy(x.requires_grad_(), w, t, reduction="none", backend=backend_name)
    with torch.no_grad():  # without a gradient "none" is fine
        try:
            out = ops.linear_cross_entropy(x, w, t, b, reduction="none", backend=backend_name)
        except ValueError as exc:
            _refused(exc)
    torch.testing.assert_close(out, _hf(x, w, t, b, reduction="none"), rtol=1e-5, atol=1e-5)
    assert out.shape == (T,) and out[::3].eq(0).all()


def test_mean_of_all_ignored_rows_is_nan_with_zero_gradients(backend_name, device):
    """torch: reduction="mean" over no rows is 0/0 = NaN, and the gradients are 0 (not NaN)."""
    x, w, _, b = _inputs(device)
    t = torch.full((T,), -100, device=device)
    leaves = [v.requires_grad_() for v in (x, w, b)]
    try:
        loss = ops.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], backend=backend_name)
    except ValueError as exc:
        _refused(exc)
    assert loss.isnan()
    for gr in torch.autograd.grad(loss, leaves):
        assert gr.eq(0).all()


def test_target_out_of_range_gives_nan(backend_name, device):
    x, w, t, b = _inputs(device)
    t = t.clone()
    t[1], t[2] = V, -5  # neither a class nor ignore_index
    with torch.no_grad():
        try:
            out = ops.linear_cross_entropy(x, w, t, b, reduction="none", backend=backend_name)
        except ValueError as exc:
            _refused(exc)
    assert out[1].isnan() and out[2].isnan() and out[3:].isfinite().all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_logit_gives_nan_rows_and_gradients(bad, backend_name, device):
    """A NaN or +inf bias entry makes every row's logsumexp NaN, as torch's. Mojo's CPU exp returns +inf for
    NaN, so its rows were +inf (finite-looking: inf, not NaN) and its dx +-inf with no NaN."""
    x, w, t, b = _inputs(device)
    b = b.clone()
    b[5] = bad
    t = t.clone()
    t[0], t[1] = 5, 7  # a row whose target is the bad class and one whose is not
    try:
        with torch.no_grad():
            out = ops.linear_cross_entropy(x, w, t, b, reduction="none", backend=backend_name)
        x.requires_grad_()
        (dx,) = torch.autograd.grad(ops.linear_cross_entropy(x, w, t, b, backend=backend_name), x)
    except ValueError as exc:
        _refused(exc)
    want = _hf(x.detach(), w, t, b, reduction="none")
    assert torch.equal(out.isnan(), want.isnan()), (out, want)
    assert dx[t != -100].isnan().all(), "a row with a NaN logsumexp has a NaN gradient"


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_neginf_logit_keeps_the_loss_finite(smoothing, backend_name, device):
    """A class masked by a -inf bias: torch's loss is finite without label smoothing (the reference added
    0 * (m - mean z) = NaN) and +inf with it (-log p of the masked class), on every backend."""
    x, w, t, b = _inputs(device)
    b = b.clone()
    b[5] = float("-inf")
    t = t.clone()
    t[t == 5] = 6
    try:
        with torch.no_grad():
            out = ops.linear_cross_entropy(x, w, t, b, label_smoothing=smoothing, backend=backend_name)
    except ValueError as exc:
        _refused(exc)
    want = _hf(x, w, t, b, label_smoothing=smoothing)
    if smoothing:
        assert want.isinf() and out.item() == want.item(), (out, want)
    else:
        torch.testing.assert_close(out.cpu(), want.cpu(), rtol=1e-5, atol=1e-6)


def test_a_leading_block_of_masked_classes_keeps_the_loss_and_grads_finite(backend_name, device):
    """The first 1024 classes masked by a -inf bias (constrained decoding): a block (Triton: the interpreter's
    1024 block) or a thread's share of the row (Mojo on a GPU) that holds only -inf had a running max of -inf,
    and exp(z - max) = exp(-inf + inf) = NaN made the loss NaN. torch's loss and gradients are finite."""
    x, w, t, b = _inputs(device)
    b = b.clone()
    b[:1024] = float("-inf")
    t = t.clone()
    t[t >= 0] = 1024 + t[t >= 0] % (V - 1024)
    try:
        got = [v.clone().requires_grad_() for v in (x, w, b)]
        loss = ops.linear_cross_entropy(*got[:2], t, got[2], backend=backend_name)
    except ValueError as exc:
        _refused(exc)
    loss.backward()
    want = [v.clone().requires_grad_() for v in (x, w, b)]
    ref = _hf(want[0], want[1], t, want[2])
    ref.backward()
    assert ref.isfinite() and want[0].grad.isfinite().all()
    torch.testing.assert_close(loss.detach().cpu(), ref.detach().cpu(), rtol=1e-5, atol=1e-6)
    for i, (a, r) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.grad.cpu(), r.grad.cpu(), rtol=1e-4, atol=1e-5, msg=f"grad of input {i}")


def test_direct_op_call_saving_with_reduction_none_raises():
    """The public function refuses a gradient with reduction='none'; a direct torch.ops call skipped that
    check, and its backward broadcast the per-row output grads over the saved [T, H] dx (T == H: dx off by
    3.6, silently). The custom op itself now refuses it, eagerly and under fake tensors."""
    x, w, t, _ = _inputs("cpu")
    with pytest.raises(
        ValueError, match=r"^torch.ops.fusekit.linear_cross_entropy: save=True with reduction"
    ):
        torch.ops.fusekit.linear_cross_entropy(x, w, t, None, -100, "none", 0.0, "torch", True)
    loss = torch.ops.fusekit.linear_cross_entropy(x, w, t, None, -100, "none", 0.0, "torch", False)[0]
    torch.testing.assert_close(
        loss, F.cross_entropy(F.linear(x, w), t, reduction="none"), rtol=1e-5, atol=1e-5
    )


def test_fp32_large_logits_keep_torchs_accuracy(backend_name, device):
    """lse = m + log(s) rounded to fp32 as one number carries ~u |m|: every softmax value of the row moved
    by that relative amount and every loss by that much, 20x torch's own error (fuzzer, FUSEKIT_FUZZ_SEED=6
    x20: d x 4.1e-5 > 4e-5 at logits ~18, torch 2.1e-6). Here logits ~256 (a common offset, which softmax
    ignores) with each target 12 above the rest (losses ~0.03): the old form missed the fp32 tolerance by
    10x on the loss (1.9e-4) and 6x on d x (2.5e-4); the log_softmax form (torch's) gives 2.5e-6 and
    3.5e-6. The logits are exact in fp32 (x one-hot, weights on a 2^-8 grid): only the loss's own
    rounding counts."""
    n, h, v = 16, 16, 1031  # V past the Triton interpreter's 1024 block: the online rescale runs too
    g = torch.Generator().manual_seed(0)
    x = torch.eye(n, h)
    w = torch.randn(v, h, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    w[t, torch.arange(n)] += 12.0
    w = (w * 256).round() / 256
    b = torch.full((v,), 256.0)
    x, w, t, b = (a.to(device) for a in (x, w, t, b))
    x64, w64, b64 = (a.double().requires_grad_() for a in (x, w, b))
    want = F.cross_entropy(F.linear(x64, w64, b64), t, reduction="none")
    try:
        with torch.no_grad():
            rows = ops.linear_cross_entropy(x, w, t, b, reduction="none", backend=backend_name)
        leaves = [a.clone().requires_grad_() for a in (x, w, b)]
        loss = ops.linear_cross_entropy(*leaves[:2], t, leaves[2], reduction="sum", backend=backend_name)
    except ValueError as exc:
        _refused(exc)
    assert_close("loss rows", rows, want.detach(), rtol("linear_cross_entropy", torch.float32), "fp32")
    got = torch.autograd.grad(loss, leaves)
    ref = torch.autograd.grad(want.sum(), (x64, w64, b64))
    tol = rtol("linear_cross_entropy", torch.float32, "backward")
    for name, a, r in zip(("dx", "dweight", "dbias"), got, ref):
        assert_close(name, a, r, tol, "fp32")


def test_deterministic(backend_name, device):
    """No atomics: identical calls give bit-identical losses and gradients."""
    x, w, t, b = _inputs(device, seed=3)
    res = []
    for _ in range(2):
        leaves = [v.clone().requires_grad_() for v in (x, w, b)]
        try:
            loss = ops.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], backend=backend_name)
        except ValueError as exc:
            _refused(exc)
        res.append((loss, *torch.autograd.grad(loss, leaves)))
    for a, e in zip(*res):
        assert torch.equal(a, e)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_loss_is_0d_and_not_a_view(reduction, backend_name, device):
    """The reduced loss is its own 0-d tensor: FSDP2 warns that an in-place op on a view output (say
    `loss.div_(accum_steps)`) drops its pre-backward hook; in-place scaling still back-propagates."""
    x, w, t, b = _inputs(device, seed=4)
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    try:
        loss = ops.linear_cross_entropy(*leaves[:2], t, leaves[2], reduction=reduction, backend=backend_name)
    except ValueError as exc:
        _refused(exc)
    assert loss.shape == () and not loss._is_view()
    want = _hf(*(v.detach() for v in (x, w)), t, b, reduction=reduction)
    tol = rtol("linear_cross_entropy", torch.float32)
    assert_close("loss", loss.detach(), want, tol, reduction)
    loss.div_(4.0)
    (gx,) = torch.autograd.grad(loss, leaves[0])
    xr = x.clone().requires_grad_()
    (want_gx,) = torch.autograd.grad(_hf(xr, w, t, b, reduction=reduction) / 4.0, xr)
    assert_close("grad x", gx, want_gx, rtol("linear_cross_entropy", torch.float32, "backward"), reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp16_gradients_are_as_accurate_as_hfs_under_a_loss_scale(reduction, backend_name, device):
    """fp16 d logits are ~softmax / tokens, below fp16's normal range until GradScaler's 2^16 reaches them
    in the backward: every backend rounds them times a power of two (the row kernels take scale * S) and
    saves d x / d weight / d bias in fp32, so under a 65536 loss scale its gradients are as close to float64
    as HF's unfused loss (F.linear + fp32 cross_entropy) and at scale 1 closer (rounded to fp16 in the
    forward they were 3x HF's error: 7.3e-4 against 2.4e-4 at T 512 V 8192, and the fused backends refused
    fp16 gradients; "sum" under 2^8, where 2^16 overflows). An all-ignored "mean" gives zero gradients."""
    g = torch.Generator().manual_seed(5)
    t_, h_, v_ = 256, 64, 8192  # chunks of 32 tokens (_small_chunks)
    x = torch.randn(t_, h_, generator=g).half().to(device)
    w = (torch.randn(v_, h_, generator=g) * 0.05).half().to(device)
    b = (torch.randn(v_, generator=g) * 0.5).half().to(device)
    t = torch.randint(0, v_, (t_,), generator=g).to(device)
    t[::7] = -100
    leaves64 = [v.double().requires_grad_() for v in (x, w, b)]
    F.cross_entropy(F.linear(*leaves64), t, reduction=reduction).backward()
    want = [v.grad for v in leaves64]

    def errors(fn, scale: float) -> list[float]:
        leaves = [v.clone().requires_grad_() for v in (x, w, b)]
        (fn(*leaves) * scale).backward()
        assert all(v.grad.dtype == torch.float16 for v in leaves)
        return [float((v.grad.double() / scale - r).norm() / r.norm()) for v, r in zip(leaves, want)]

    def op(xx, ww, bb):
        try:
            return ops.linear_cross_entropy(xx, ww, t, bb, reduction=reduction, backend=backend_name)
        except ValueError as exc:
            _refused(exc)

    def hf(xx, ww, bb):
        return _hf(xx, ww, t, bb, reduction=reduction)

    tol = rtol("linear_cross_entropy", torch.float16, "backward")
    big = 65536.0 if reduction == "mean" else 256.0  # "sum" is 256x larger: 2^16 overflows fp16 (HF's too)
    for scale in (big, 1.0):
        got, ref = errors(op, scale), errors(hf, big)
        assert all(e <= 1.25 * r + 1e-5 and e <= tol for e, r in zip(got, ref)), (scale, got, ref)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops.linear_cross_entropy(xs, ws, torch.full_like(t, -100), backend=backend_name).backward()
    assert not xs.grad.any() and not ws.grad.any()


def test_fp16_gradients_compile_as_eager():
    """The fp32 saved gradients of fp16 x (the "xsave" dtype role) trace: torch.compile(fullgraph=True) gives
    eager's fp16 gradients bit for bit (the backward's fake outputs are fp32, autograd rounds them)."""
    x, w, t, b = _inputs("cpu", torch.float16)

    def f(xx, ww, bb):
        return ops.linear_cross_entropy(xx, ww, t, bb, backend="torch") * 1024.0

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [v.clone().requires_grad_() for v in (x, w, b)]
        fn(*leaves).backward()
        grads.append([v.grad for v in leaves])
    assert all(g.dtype == torch.float16 and torch.equal(g, e) for g, e in zip(*grads))


@pytest.mark.parametrize(
    "reduction, ls, ignore_index",
    [("mean", 0.0, -100), ("sum", 0.1, 2**40 + 3), ("none", 0.2, -(2**62) - 5)],
)
def test_mojo_runs_it_and_matches_the_torch_backend(reduction, ls, ignore_index, device):
    """The mojo backend (its row kernel fusekit.linear_cross_entropy between torch matmuls) gives the torch
    backend's loss and gradients, with label smoothing and an ignore_index beyond float32's integers (the
    kernel gets it as three exact 24-bit pieces); auto ranks it after triton on CUDA."""
    from fusekit import dispatch

    if backends.available()["mojo"] is not None:
        pytest.skip(f"mojo backend unavailable: {backends.available()['mojo']}")
    x, w, t, b = _inputs(device)
    t[::3] = ignore_index
    grad = reduction != "none"
    if not grad:
        t[1] = ignore_index + 1  # out of range (and off by one in the lowest 24-bit piece only): NaN
    res = {}
    for be in ("torch", "mojo"):
        leaves = [v.clone().requires_grad_(grad) for v in (x, w, b)]
        kw = {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": ls, "backend": be}
        loss = ops.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], **kw)
        res[be] = (loss, *torch.autograd.grad(loss * 1.5, leaves)) if grad else (loss,)
    if not grad:
        assert res["mojo"][0][1].isnan() and (res["mojo"][0][::3] == 0).all()
    for a, e in zip(res["mojo"], res["torch"]):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert dispatch.auto_order("linear_cross_entropy", "cuda").index("mojo") > 0  # triton first


def test_eager_backward_scales_the_saved_gradients_in_place(monkeypatch, backend_name, device):
    """As Liger: the weight's .grad is the very [V, H] buffer the forward filled (scaled in place by the
    loss's gradient, then taken over by autograd), so a step never holds a second one; on the first
    (checked) call and on remembered ones. A retained graph (retain_graph=True) keeps its saved
    gradients: both backwards are right."""
    spy = _spy(monkeypatch, backend_name)
    ptrs = []
    real = spy.fn

    def keep(loss, dx, dweight, dbias, *rest):
        ptrs.append(None if dweight is None else dweight.data_ptr())
        return real(loss, dx, dweight, dbias, *rest)

    spy.fn = keep
    x, w, t, b = _inputs(device)
    for _ in range(3):
        leaves = [v.detach().clone().requires_grad_() for v in (x, w, b)]
        try:
            loss = ops.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], backend=backend_name)
        except ValueError as exc:
            _refused(exc)
        (2.5 * loss).backward()
        assert leaves[1].grad.data_ptr() == ptrs[-1]
        want = torch.autograd.grad(2.5 * _hf(x, leaves[1], t, b), leaves[1])[0]
        torch.testing.assert_close(leaves[1].grad, want, rtol=1e-5, atol=1e-6)
    leaves[1].grad = None
    loss = ops.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], backend=backend_name)
    loss.backward(retain_graph=True)
    assert leaves[1].grad.data_ptr() != ptrs[-1]
    loss.backward()
    want = torch.autograd.grad(2 * _hf(x, leaves[1], t, b), leaves[1])[0]
    torch.testing.assert_close(leaves[1].grad, want, rtol=1e-5, atol=1e-6)
