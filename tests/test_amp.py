"""torch.autocast (fusekit.ops._amp): the matrix ops run in the autocast dtype as F.linear / SDPA do, the
gradients reach fp32 parameters in fp32, and a backend's own torch math is never recast by the caller's
autocast region."""

from __future__ import annotations

import pytest
import torch

from fusekit import backends, ops

F32, BF16 = torch.float32, torch.bfloat16
SEED = 20261126


def _amp_dtype(device: str) -> torch.dtype:
    return BF16 if device == "cpu" else torch.float16 if not torch.cuda.is_bf16_supported() else BF16


def _skip_unless(backend: str, op: str, phase: str, device: str, dt: torch.dtype) -> None:
    dtypes = (dt,) * len(ops.SPECS[op].dtype_vars)
    meta = {"head_dim": 64} if op == "attention" else {}
    why = backends.get(backend).supports(op, phase, torch.device(device), dtypes, **meta)
    if why is not None:
        pytest.skip(f"{backend} {op} {phase} {dt}: {why}")


def _cases(device: str, g: torch.Generator) -> dict[str, tuple]:
    """op -> (call(tensors, backend), fp32 inputs): small shapes the kernels of every backend take."""

    def r(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, generator=g) * scale).to(device)

    T, D, F = 9, 64, 128
    return {
        "swiglu_ffn": (
            lambda ts, b: ops.swiglu_ffn(*ts, backend=b),
            (r(T, D), r(F, D, scale=0.1), r(F, D, scale=0.1), r(D, F, scale=0.1)),
        ),
        "attention": (
            lambda ts, b: ops.attention(*ts, causal=True, backend=b),
            (r(1, 4, 11, 64), r(1, 2, 13, 64), r(1, 2, 13, 64)),
        ),
        "linear_cross_entropy": (
            lambda ts, b: ops.linear_cross_entropy(ts[0], ts[1], ts[2], backend=b),
            (r(T, D), r(97, D, scale=0.1), torch.randint(0, 97, (T,), generator=g).to(device)),
        ),
    }


def _case(op: str, backend: str, phase: str, device: str) -> tuple:
    """(call, fp32 inputs, autocast dtype) of `op`'s case, skipped where `backend` has no such kernel."""
    call, ins = _cases(device, torch.Generator().manual_seed(SEED))[op]
    dt = _amp_dtype(device)
    _skip_unless(backend, op, phase, device, dt)
    return call, ins, dt


def _cast(ts, dt: torch.dtype) -> tuple:
    """What autocast hands a matrix op: the floating tensors in dt (target ids stay int64)."""
    return tuple(t.to(dt) if t.is_floating_point() else t for t in ts)


@pytest.mark.parametrize("op", ["swiglu_ffn", "attention", "linear_cross_entropy"])
def test_matrix_ops_run_in_the_autocast_dtype(op: str, backend_name: str, device: str) -> None:
    call, ins, dt = _case(op, backend_name, "forward", device)
    with torch.autocast(device, dtype=dt):
        got = call(ins, backend_name)
    want = call(_cast(ins, dt), backend_name)
    assert got.dtype == want.dtype and (op == "linear_cross_entropy") == (got.dtype == F32)
    assert torch.equal(got, want)  # the same kernels on the same (cast) inputs


@pytest.mark.parametrize("op", ["swiglu_ffn", "attention", "linear_cross_entropy"])
def test_gradients_reach_fp32_leaves_in_fp32(op: str, backend_name: str, device: str) -> None:
    call, ins, dt = _case(op, backend_name, "backward", device)
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in ins]
    with torch.autocast(device, dtype=dt):
        out = call(tuple(leaves), backend_name)
    out.float().sum().backward()
    twins = [t.clone().requires_grad_() if t.is_floating_point() else t for t in ins]
    call(_cast(twins, dt), backend_name).float().sum().backward()
    for a, b in zip(leaves, twins):
        if a.is_floating_point():
            assert a.grad is not None and a.grad.dtype == F32
            assert torch.equal(a.grad, b.grad)


def test_backend_math_is_not_recast_by_the_callers_autocast(device: str) -> None:
    """The torch backend computes swiglu_ffn's products in fp32 (its reference): under a bf16 autocast region
    those matmuls would run in bf16 if the region reached inside the op. Same bits with and without it."""
    g = torch.Generator().manual_seed(SEED)
    _, ins = _cases(device, g)["swiglu_ffn"]
    ins = tuple(t.to(BF16) for t in ins)  # already the autocast dtype: nothing to cast at the entry
    with torch.autocast(device, dtype=BF16):
        got = ops.swiglu_ffn(*ins, backend="torch")
        got_norm = ops.rms_norm(ins[0].float(), torch.ones(64, device=device), backend="torch")
    assert torch.equal(got, ops.swiglu_ffn(*ins, backend="torch"))
    assert torch.equal(got_norm, ops.rms_norm(ins[0].float(), torch.ones(64, device=device), backend="torch"))


def test_norms_and_rope_keep_their_dtype(device: str) -> None:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(4, 8, 2, 64, generator=g).to(device)
    with torch.autocast(device, dtype=BF16):
        assert ops.rms_norm(x, torch.ones(64, device=device), backend="torch").dtype == F32
        assert ops.rope(x, backend="torch").dtype == F32


def test_compiled_call_under_autocast_matches_eager(device: str) -> None:
    g = torch.Generator().manual_seed(SEED)
    call, ins = _cases(device, g)["swiglu_ffn"]
    fn = torch.compile(lambda *ts: ops.swiglu_ffn(*ts, backend="torch"), fullgraph=True, backend="aot_eager")
    with torch.autocast(device, dtype=BF16):
        got, want = fn(*ins), call(ins, "torch")
    assert got.dtype == BF16 and torch.equal(got, want)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_residual_of_another_dtype_is_promoted_as_the_add(op: str, backend_name: str, device: str) -> None:
    """An fp32 residual stream meets a bf16 sublayer output (HF's add under autocast): h = x + residual in
    fp32, as torch promotes, and its norm; the same as the explicit fp32 call."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(6, 64, generator=g).to(device, BF16)
    r = torch.randn(6, 64, generator=g).to(device)
    w = (1.0 + 0.1 * torch.randn(64, generator=g)).to(device)
    fn = getattr(ops, op)
    y, h = fn(x, w, residual=r, backend=backend_name)
    y2, h2 = fn(x.float(), w, residual=r, backend=backend_name)
    assert y.dtype == h.dtype == F32 and torch.equal(y, y2) and torch.equal(h, h2)
    assert torch.equal(h, x.float() + r)


def test_bad_arguments_under_autocast_still_get_named(device: str) -> None:
    w = torch.randn(8, 4, device=device)
    with torch.autocast(device, dtype=BF16), pytest.raises(TypeError, match="x"):
        ops.swiglu_ffn([[1.0] * 4], w, w, w.t(), backend="torch")
    with torch.autocast(device, dtype=BF16), pytest.raises(TypeError, match="weight"):
        ops.linear_cross_entropy(torch.randn(3, 4, device=device), "w", torch.zeros(3, dtype=torch.long))
