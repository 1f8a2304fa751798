"""Triton reduce_sum is deterministic by default (issue #13): no atomics, bit-identical repeats."""

from __future__ import annotations

import pytest
import torch
from checks import graphs_capturable

pytest.importorskip("triton")
rs = pytest.importorskip("kernels_triton.reduce_sum")


def test_forward_never_uses_atomics(monkeypatch, device):
    seen: list[bool] = []
    real = rs._split_kernel

    class Spy:
        def __getitem__(self, grid):
            launch = real[grid]

            def run(*args, **kw):
                seen.append(bool(kw.get("ATOMIC")))
                return launch(*args, **kw)

            return run

    monkeypatch.setattr(rs, "_split_kernel", Spy())
    monkeypatch.setattr(rs, "_plan", lambda M, N, elsize, dev: ("split", 4))  # what a GPU picks at 2^30
    x = torch.randn(1, 1 << 14, generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.full((1,), float("nan"), device=device)
    rs.forward(out, x)
    torch.testing.assert_close(out.cpu().double(), x.cpu().double().sum(-1), rtol=1e-5, atol=1e-3)
    assert seen and not any(seen), "the split mode used atomics"


def test_repeats_are_bit_identical(device):
    x = torch.randn(3, 40000, generator=torch.Generator().manual_seed(2)).to(device)
    outs = []
    for _ in range(5):
        out = torch.full((3,), float("nan"), device=device)
        rs.reduce_sum(out, x, deterministic=True, _mode="split", _split=7)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_pdl_finalize_is_bit_identical_and_captures(monkeypatch, device):
    """On an sm_90+ GPU the finalize kernel is launched with PDL (it waits in gdc_wait for the partials):
    the sums equal the serialized launches' bit for bit, and a CUDA graph of the pair replays on new data
    to the eager result."""
    from kernels_triton import _config

    if device != "cuda":
        pytest.skip("PDL needs an sm_90+ GPU with compiled Triton kernels")

    def pdl(on: bool) -> bool:
        monkeypatch.setattr(_config, "PDL_ENABLED", on)
        _config.pdl_supported.cache_clear()
        return _config.pdl_supported(0)

    if not pdl(True):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    x = torch.randn(5, 300001, generator=torch.Generator().manual_seed(3)).to(device)
    got = {}
    for on in (True, False):
        assert pdl(on) == on
        out = torch.full((5,), float("nan"), device=device)
        rs.reduce_sum(out, x, deterministic=True, _mode="split", _split=37)
        got[on] = out
    assert torch.equal(got[True], got[False])
    # float64 references on the CPU: under compute-sanitizer racecheck torch's own GPU reduce kernel reports
    # shared-memory hazards (5120 at ddd47f9 on an H200), which would be charged to these kernels' run
    torch.testing.assert_close(got[True].cpu().double(), x.cpu().double().sum(-1), rtol=1e-5, atol=1e-2)
    if not graphs_capturable():
        return  # the sanitizer runs: no caching allocator, so no capture; the launches above were checked

    pdl(True)
    out = torch.full((5,), float("nan"), device=device)
    rs.reduce_sum(out, x, deterministic=True, _mode="split", _split=37)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rs.reduce_sum(out, x, deterministic=True, _mode="split", _split=37)
    x.copy_(torch.randn(5, 300001, generator=torch.Generator().manual_seed(4)).to(device))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = torch.full((5,), float("nan"), device=device)
    rs.reduce_sum(want, x, deterministic=True, _mode="split", _split=37)
    assert torch.equal(out, want)
