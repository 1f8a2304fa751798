"""ops.rope(x, positions=...): per-token positions as a tensor (HF's position_ids, CUDA-graph decode loops).

    pytest tests/test_rope_positions.py --backends torch,triton,mojo [--device cuda]

positions = start_pos + arange(S) computes exactly what start_pos does (bit for bit, forward and
backward, both layouts, tables or in-kernel angles); [S] equals [B, S] with the row repeated; rows are
independent; bad positions raise naming `positions` on the CPU and are clamped (never read outside the
tables) where they are trusted; torch.compile(fullgraph=True) takes them; on `--device cuda` a captured
graph replays with positions updated in place (every backend; mojo's launches are fenced into torch's
capture). The mojo MAX signature with positions is checked in tests/test_mojo_rope_positions.py.
"""

from __future__ import annotations

import pytest
import torch
from checks import assert_close

from fusekit import ops
from fusekit.ops.rope import tables
from fusekit.tolerances import rtol

GRAPH_BACKENDS = ("torch", "triton", "mojo")  # backends that run inside a CUDA graph capture


def _x(shape, dtype, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def _tables(rows: int, d: int, theta: float, device: str) -> dict:
    cos, sin = tables(torch.arange(rows, device=device), d, theta)
    return {"cos": cos, "sin": sin}


@pytest.mark.parametrize("use_tables", (False, True), ids=("angles", "tables"))
@pytest.mark.parametrize("interleaved", (False, True), ids=("halves", "interleaved"))
@pytest.mark.parametrize("d", (16, 12))  # 12: the triton gather kernel for non-power-of-two head dims
@pytest.mark.parametrize("layout", ("bshd", "bhsd"))
def test_positions_equal_start_pos_bitwise(use_tables, interleaved, d, layout, backend_name, device):
    b, s, h, start, theta = 3, 6, 2, 37, 10000.0
    x = _x((b, s, h, d) if layout == "bshd" else (b, h, s, d), torch.float32, device)
    kw = {"theta": theta, "interleaved": interleaved, "layout": layout, "backend": backend_name}
    if use_tables:
        kw |= _tables(start + s + 3, d, theta, device)
    want = ops.rope(x, start_pos=start, **kw)
    ar = torch.arange(start, start + s, device=device)
    for pos in (ar.expand(b, s), ar.to(torch.int32), ar.expand(b, s).to(torch.int32).contiguous()):
        got = ops.rope(x, positions=pos, **kw)
        assert torch.equal(got, want), f"positions {pos.dtype} {tuple(pos.shape)} differ from start_pos"
    # backward: the rotation back at the same positions
    g = _x(want.shape, torch.float32, device, seed=1)
    grads = []
    for extra in ({"start_pos": start}, {"positions": ar.expand(b, s)}):
        xl = x.clone().requires_grad_()
        (dx,) = torch.autograd.grad(ops.rope(xl, **extra, **kw), xl, g)
        grads.append(dx)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("use_tables", (False, True), ids=("angles", "tables"))
def test_shared_positions_equal_repeated_rows(use_tables, backend_name, device):
    b, s, h, d, theta = 3, 7, 2, 8, 500.0
    x = _x((b, s, h, d), torch.float16, device)
    pos = torch.tensor([5, 0, 9, 9, 2, 31, 1], device=device)
    kw = {"theta": theta, "backend": backend_name} | (_tables(40, d, theta, device) if use_tables else {})
    got = ops.rope(x, positions=pos, **kw)
    assert torch.equal(got, ops.rope(x, positions=pos.repeat(b, 1), **kw))
    assert torch.equal(got, ops.rope(x, positions=pos.to(torch.int32).expand(b, s), **kw))
    assert torch.equal(got, ops.rope(x, positions=pos[None], **kw))  # HF's position_ids [1, S]


@pytest.mark.parametrize("use_tables", (False, True), ids=("angles", "tables"))
def test_rows_are_independent(use_tables, backend_name, device):
    """A left-padded batch: sequence i rotated at its own positions, as if it were alone at start_pos."""
    b, s, h, d, theta = 3, 5, 2, 16, 10000.0
    x = _x((b, s, h, d), torch.float32, device)
    kw = {"theta": theta, "backend": backend_name} | (_tables(20, d, theta, device) if use_tables else {})
    starts = (0, 4, 11)
    pos = torch.stack([torch.arange(p, p + s) for p in starts]).to(device)
    got = ops.rope(x, positions=pos, **kw)
    for i, p in enumerate(starts):
        want = ops.rope(x[i : i + 1], start_pos=p, **kw)
        assert_close(f"rope row {i}", got[i : i + 1], want, rtol("rope", torch.float32), f"row {i}")


def test_validation_names_positions() -> None:
    x = torch.randn(2, 4, 1, 8)
    tab = _tables(10, 8, 10000.0, "cpu")
    ok = torch.arange(4)
    cases = [
        ({"positions": ok, "start_pos": 3}, ValueError, r"^positions: per-token positions and a nonzero"),
        (
            {"positions": torch.arange(5)},
            ValueError,
            r"^positions: expected shape \[B=2, S=4\], \[1, S=4\] or \[S=4\]",
        ),
        ({"positions": torch.zeros(3, 4, dtype=torch.int64)}, ValueError, r"^positions: expected shape"),
        ({"positions": torch.zeros(1, 2, 4, dtype=torch.int64)}, ValueError, r"^positions: expected shape"),
        ({"positions": ok.float()}, TypeError, r"^positions: dtype float32 is not supported"),
        ({"positions": ok.tolist()}, TypeError, r"^positions: expected a torch.Tensor"),
        ({"positions": ok - 1}, ValueError, r"^positions: every value must be in \[0, 2\^24"),
        ({"positions": ok + (1 << 24) - 2}, ValueError, r"^positions: every value must be in \[0, 2\^24"),
        ({"positions": ok + 7, **tab}, ValueError, r"^positions: every value must be in \[0, St - 1 = 9"),
        ({"positions": ok, "cos": tab["cos"][:9], "sin": tab["sin"]}, ValueError, r"^cos: with positions"),
        (
            {"positions": ok, "cos": tab["cos"][:0], "sin": tab["sin"][:0]},
            ValueError,
            r"^cos: expected shape",
        ),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            ops.rope(x, **kw, backend="torch")
    # the bounds are inclusive: 2^24 with in-kernel angles, St - 1 with tables; start_pos=0 is allowed
    y = ops.rope(x.double(), positions=ok + (1 << 24) - 3, start_pos=0, backend="torch")
    assert y.isfinite().all()
    ops.rope(x, positions=ok + 6, **tab, backend="torch")


@pytest.mark.parametrize("use_tables", (False, True), ids=("angles", "tables"))
def test_untrusted_positions_are_clamped(use_tables, backend_name, device):
    """What CUDA callers get for out-of-range positions (trusted there, no host sync): every backend
    clamps them to [0, St - 1] / [0, 2^24] instead of reading outside the tables. Checked here through
    the backends directly (the CPU front end raises first)."""
    from fusekit import library
    from fusekit.ops.rope import SPEC

    b, s, h, d, theta = 2, 3, 1, 8, 10000.0
    x = _x((b, s, h, d), torch.float32, device)
    tab = _tables(6, d, theta, device) if use_tables else {"cos": None, "sin": None}
    hi = 5 if use_tables else 1 << 24
    bad = torch.tensor([[-7, 0, hi + 1], [2**31 - 1, -(2**31), hi]], dtype=torch.int32, device=device)
    ok = bad.clamp(0, hi)
    run = [
        library.run(
            SPEC, "forward", (x, tab["cos"], tab["sin"], p, None), (0, theta, False), backend_name, {}
        )[0]
        for p in (bad, ok)
    ]
    assert torch.equal(run[0], run[1])


def test_compile_fullgraph_with_positions(monkeypatch) -> None:
    """torch.compile(fullgraph=True) with positions (forward and backward: the backward custom op takes
    positions and its condition flag), [B, S] int64 converted inside the graph, equals eager."""

    def step(x, positions, cos, sin):
        return ops.rope(x, positions=positions, cos=cos, sin=sin, layout="bhsd", backend="torch")

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 16, generator=g)  # [B, H, S, D]
    pos = torch.tensor([[1, 1, 0, 1, 2], [4, 5, 6, 7, 8]])
    cos, sin = tables(torch.arange(12), 16, 10000.0)
    torch._dynamo.reset()
    from torch._inductor import config as inductor_config

    # config.patch restores the setting exactly (monkeypatch's undo left the aliased option unset)
    with inductor_config.patch(force_disable_caches=True):  # lower it here, not from a cache
        compiled = torch.compile(step, fullgraph=True)
        results = []
        for fn in (step, compiled):  # eager first: it resolves the backend (dispatch's import is not traced)
            for c, s in ((None, None), (cos, sin)):
                xg = x.clone().requires_grad_()
                out = fn(xg, pos, c, s)
                out.backward(torch.ones_like(out))
                results.append((out.detach(), xg.grad))
        for want, got in zip(results[:2], results[2:]):
            for w, o in zip(want, got):
                torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", (torch.int32, torch.int64))
def test_cuda_graph_replays_with_positions_updated_in_place(dtype, backend_name, device):
    """A decode step captured once; each replay reads the positions tensor as updated in place."""
    if device != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    if backend_name not in GRAPH_BACKENDS:
        pytest.skip(f"backend {backend_name!r} refuses calls inside a CUDA graph capture")
    b, h, d, theta = 4, 8, 128, 500000.0
    x = _x((b, 1, h, d), torch.bfloat16, device)
    pos = torch.tensor([[3], [17], [0], [250]], dtype=dtype, device=device)
    tab = _tables(512, d, theta, device)
    for kw in ({}, tab):

        def step(kw=kw):
            return ops.rope(x, positions=pos, theta=theta, backend=backend_name, **kw)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: a first call compiles, never inside a capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step()
        for t in range(3):
            with torch.no_grad():
                pos.add_(1 + t)  # in place: the captured address stays
                x.copy_(_x(x.shape, x.dtype, device, seed=10 + t))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, step()), f"replay {t} ignored the updated positions"


@pytest.mark.parametrize("start", [131072, (1 << 24) - 8])
def test_in_kernel_angles_agree_with_the_reference_at_large_positions(start, backend_name, device):
    """Every backend's angle is fp32(position) * inv_freq with the same inv_freq bits (float64, rounded once:
    fusekit.ops.rope.inv_freq), so they agree with the reference to cos / sin ulps at any position: each
    rounded inv_freq its own way, 0.013 apart at 131072 (|x| ~ 3) and 1.6 at 2^24."""
    x = _x((1, 8, 2, 64), torch.float32, device, seed=4) * 3
    try:
        y = ops.rope(x, start_pos=start, theta=5e5, backend=backend_name)
    except ValueError as exc:
        if "cannot run" in str(exc):
            pytest.skip(str(exc))
        raise
    # an oracle outside fusekit: the fp32 angle fp32(p) * fp32(inv_freq), rotated in float64 (the torch
    # backend as the reference passed its own bugs: a position shifted by one past 2^16 went unseen)
    d = x.shape[-1]
    inv = (5e5 ** (-(2.0 * torch.arange(d // 2, dtype=torch.float64)) / d)).float()
    ang = (torch.arange(start, start + x.shape[1]).float()[:, None] * inv[None, :]).double()
    c, s_ = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    xd = x.cpu().double()
    a, b = xd[..., : d // 2], xd[..., d // 2 :]
    want = torch.cat((a * c - b * s_, a * s_ + b * c), dim=-1)
    assert float((y.cpu().double() - want).abs().max()) <= 2e-6 * float(x.abs().max())
