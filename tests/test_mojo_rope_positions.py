"""The mojo rope kernels take `positions` (per-token positions), forward and backward.

    pytest tests/test_mojo_rope_positions.py [--device cuda]

Values against float64 are in the conformance suite (tests/cases/rope.py has positions cases); here,
what it does not pin down for mojo (tests/test_rope_positions.py checks the same for torch and triton):
the MAX signature carries positions and their flag, positions = start_pos + arange(S) give exactly
the start_pos bits (forward and backward, tables or in-kernel angles, both pairings), [S] equals [B, S]
with the row repeated, and untrusted values (what CUDA callers pass unchecked) are clamped to
[0, St - 1] (tables) or [0, 2^24] as the other backends clamp them.
"""

from __future__ import annotations

import pytest
import torch

from fusekit import backends, library, ops
from fusekit.backends.mojo.specs import phase_spec
from fusekit.ops.rope import SPEC, tables


def _mojo() -> None:
    why = backends.available()["mojo"]
    if why is not None:
        pytest.skip(f"the mojo backend is not installed: {why}")


def _x(shape, device, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def _tables(rows: int, d: int, theta: float, device: str) -> dict:
    cos, sin = tables(torch.arange(rows, device=device), d, theta)
    return {"cos": cos, "sin": sin}


def test_signature_takes_positions() -> None:
    be = backends.get("mojo")
    cpu = torch.device("cpu")
    for phase in ("forward", "backward"):
        assert be.supports("rope", phase, cpu, (torch.float32,), positions=True) is None
        ms = phase_spec("rope", phase)
        k = "k" if phase == "forward" else "dyk"  # k rides in the same call (one launch for q and k)
        assert [t.name for t in ms.inputs][1:] == ["cos", "sin", "positions", k]
        assert ms.inputs[3].dtype == "int32" and len(ms.outputs) == 2
        flags = ("has_tables", "has_positions") + (("has_k",) if phase == "backward" else ())
        assert ms.params == ("start_pos", "theta", "interleaved", *flags)


@pytest.mark.parametrize("use_tables", (False, True), ids=("angles", "tables"))
@pytest.mark.parametrize("interleaved", (False, True), ids=("halves", "interleaved"))
def test_positions_equal_start_pos_bitwise(use_tables, interleaved, device) -> None:
    _mojo()
    b, s, h, d, start, theta = 3, 6, 2, 16, 37, 10000.0
    x = _x((b, s, h, d), device)
    kw = {"theta": theta, "interleaved": interleaved, "backend": "mojo"}
    if use_tables:
        kw |= _tables(start + s + 3, d, theta, device)
    want = ops.rope(x, start_pos=start, **kw)
    ar = torch.arange(start, start + s, device=device)
    for pos in (ar.expand(b, s), ar.to(torch.int32)):
        assert torch.equal(ops.rope(x, positions=pos, **kw), want)
    g = _x(want.shape, device, seed=1)
    grads = []
    for extra in ({"start_pos": start}, {"positions": ar.expand(b, s)}):
        xl = x.clone().requires_grad_()
        grads.append(torch.autograd.grad(ops.rope(xl, **extra, **kw), xl, g)[0])
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("use_tables", (False, True), ids=("angles", "tables"))
def test_shared_positions_equal_repeated_rows(use_tables, device) -> None:
    _mojo()
    b, s, h, d, theta = 3, 7, 2, 8, 500.0
    x = _x((b, s, h, d), device, dtype=torch.float16)
    pos = torch.tensor([5, 0, 9, 9, 2, 31, 1], device=device)
    kw = {"theta": theta, "backend": "mojo"} | (_tables(40, d, theta, device) if use_tables else {})
    got = ops.rope(x, positions=pos, **kw)
    assert torch.equal(got, ops.rope(x, positions=pos.repeat(b, 1), **kw))
    # each row as if it were alone: the same bits as start_pos at the row's first position
    runs = torch.stack([torch.arange(p, p + s) for p in (0, 4, 11)]).to(device)
    got = ops.rope(x, positions=runs, **kw)
    for i, p in enumerate((0, 4, 11)):
        assert torch.equal(got[i : i + 1], ops.rope(x[i : i + 1], start_pos=p, **kw))


@pytest.mark.parametrize("use_tables", (False, True), ids=("angles", "tables"))
def test_untrusted_positions_are_clamped(use_tables, device) -> None:
    """Through the provider directly (the CPU front end raises first), forward and backward."""
    _mojo()
    b, s, h, d, theta = 2, 3, 1, 8, 10000.0
    x = _x((b, s, h, d), device)
    tab = _tables(6, d, theta, device) if use_tables else {"cos": None, "sin": None}
    hi = 5 if use_tables else 1 << 24
    bad = torch.tensor([[-7, 0, hi + 1], [2**31 - 1, -(2**31), hi]], dtype=torch.int32, device=device)
    ok = bad.clamp(0, hi)
    for phase in ("forward", "backward"):
        cond = SPEC.conditions((x, tab["cos"], tab["sin"], ok, None), save=False)
        run = [
            library.run(SPEC, phase, (x, tab["cos"], tab["sin"], p, None), (0, theta, False), "mojo", cond)[0]
            for p in (bad, ok)
        ]
        assert torch.equal(run[0], run[1])
