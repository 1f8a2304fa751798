"""The mojo attention kernels take `kv_len` (per-sequence KV lengths), forward and backward.

    pytest tests/test_mojo_kv_len.py [--device cuda]

Values against float64 are in the conformance suite (tests/cases/attention.py has kv_len cases with NaN
past every length); here, what it does not pin down: the MAX signature carries kv_len and its flag, a
full kv_len is bit for bit the call without it, keys past kv_len are never read (whatever they hold,
the results and gradients are the same bits, and their gradients are exactly 0), and untrusted lengths
(what CUDA callers pass unchecked) are clamped to [0, Skv] as the other backends clamp them.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusekit import backends, library, ops
from fusekit.backends.mojo import specs
from fusekit.backends.mojo.specs import phase_spec
from fusekit.ops.attention import SPEC


def _mojo(device: str) -> None:
    why = backends.available()["mojo"]
    if why is not None:
        pytest.skip(f"the mojo backend is not installed: {why}")
    if device == "cuda":  # fp32 attention runs on the CPU only; half on CUDA
        pytest.skip("these checks run in float32 on the CPU; --device cuda runs the conformance cases")


def _qkv(b: int, h: int, hkv: int, s: int, skv: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=g) for shape in ((b, h, s, d), (b, hkv, skv, d), (b, hkv, skv, d))
    )


def _grads(q, k, v, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = ops.attention(q, k, v, backend="mojo", **kw)
    g = torch.Generator().manual_seed(9)
    do = torch.randn(o.shape, generator=g)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def test_signature_takes_kv_len() -> None:
    be = backends.get("mojo")
    cpu = torch.device("cpu")
    for phase in ("forward", "backward"):
        assert be.supports("attention", phase, cpu, (torch.float32,), head_dim=64, kv_len=True) is None
        ms = phase_spec("attention", phase)
        assert ms.inputs[-1].name == "kv_len" and ms.inputs[-1].dtype == "int32"
        # the backward's 4th slot selects the tensor-core kernels (specs.attention_bwd_tc, on by default)
        # the forward's 4th slot selects the split-KV decode kernels (specs.ATTN_DECODE, on by default)
        tc = ("bwd_tc",) if phase == "backward" and specs.attention_bwd_tc() else ()
        dec = ("decode",) if phase == "forward" and specs.ATTN_DECODE else ()
        assert ms.params == ("causal", "scale", "has_kv_len", *tc, *dec)


@pytest.mark.parametrize("causal", (False, True))
def test_full_kv_len_is_no_kv_len(causal, device) -> None:
    _mojo(device)
    q, k, v = _qkv(2, 4, 2, 5, 11, 64)
    full = torch.full((2,), 11, dtype=torch.int32)
    for a, b in zip(_grads(q, k, v, causal=causal), _grads(q, k, v, causal=causal, kv_len=full)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", (False, True))
def test_keys_past_kv_len_are_never_read(causal, device) -> None:
    """NaN / inf past each length give the same bits as zeros there; their gradients are exactly 0."""
    _mojo(device)
    q, k, v = _qkv(3, 4, 2, 6, 13, 64, seed=1)
    kv_len = torch.tensor([13, 0, 4], dtype=torch.int32)
    past = torch.arange(13)[None, None, :, None] >= kv_len[:, None, None, None].long()
    runs = []
    for fill in (0.0, math.nan, math.inf):
        kf, vf = (torch.where(past, torch.full_like(t, fill), t) for t in (k, v))
        runs.append(_grads(q, kf, vf, causal=causal, kv_len=kv_len))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    _, dq, dk, dv = runs[1]
    assert torch.equal(dk[past.expand_as(dk)], torch.zeros(int(past.expand_as(dk).sum())))
    assert torch.equal(dv[past.expand_as(dv)], torch.zeros(int(past.expand_as(dv).sum())))
    assert torch.equal(dq[1], torch.zeros_like(dq[1]))  # kv_len 0: no key, no gradient
    assert all(t.isfinite().all() for t in runs[1])


@pytest.mark.parametrize("causal", (False, True))
def test_untrusted_kv_len_is_clamped(causal, device) -> None:
    """What CUDA callers get for lengths outside [0, Skv] (trusted there, no host sync): clamped, never
    read outside k/v. Through the provider directly (the CPU front end raises first)."""
    _mojo(device)
    q, k, v = _qkv(4, 2, 1, 3, 9, 64, seed=2)
    bad = torch.tensor([-3, 9 + 5, 2**31 - 1, -(2**31)], dtype=torch.int32)
    ok = bad.clamp(0, 9)
    scalars = (causal, 1.0 / 8.0)
    cond = SPEC.conditions((q, k, v, ok), save=False)
    fwd = [library.run(SPEC, "forward", (q, k, v, kl), scalars, "mojo", cond) for kl in (bad, ok)]
    for a, b in zip(*fwd):
        assert torch.equal(a, b)
    o, lse = fwd[1]
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(4))
    bwd = [
        library.run(SPEC, "backward", (do, q, k, v, o, lse, kl), scalars, "mojo", cond) for kl in (bad, ok)
    ]
    for a, b in zip(*bwd):
        assert torch.equal(a, b)
