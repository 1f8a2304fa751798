"""fusekit.bench.host on the CPU: interleaved rounds, one row per backend, providers kept apart."""

from __future__ import annotations

import pytest
import torch

from fusekit.bench import host


def _tiny_cases(dev: str, dtype: torch.dtype):
    from fusekit import ops

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 64, generator=g), torch.randn(64, generator=g)
    calls = {"eager": 0}

    def eager():
        calls["eager"] += 1
        return torch.nn.functional.rms_norm(x, (64,), w, 1e-6)

    return [
        ("rms_norm 2x64", {"M": 2, "N": 64}, lambda be: ops.rms_norm(x, w, backend=be), eager, None),
        ("reduce_sum 64", {"N": 64}, lambda be: ops.reduce_sum(x[0], backend=be), None, None),
    ]


def test_rounds_and_providers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "_cases", _tiny_cases)
    rows = host.run(["torch", "nosuch"], "cpu", torch.float32, rep_ms=4.0, rounds=3)
    assert [(r["case"], r["backend"]) for r in rows] == [
        ("rms_norm 2x64", "torch"),
        ("rms_norm 2x64", "nosuch"),
        ("reduce_sum 64", "torch"),
        ("reduce_sum 64", "nosuch"),
    ]
    ok = rows[0]
    assert ok["status"] == "ok" and len(ok["fusekit_wall_us_rounds"]) == 3
    assert ok["fusekit_wall_us"] == sorted(ok["fusekit_wall_us_rounds"])[1]  # the median
    assert (
        ok["torch_wall_us"] > 0 and ok["wall_speedup_vs_torch"] == ok["torch_wall_us"] / ok["fusekit_wall_us"]
    )
    assert "torch_wall_us" not in rows[2]  # no eager equivalent given for that case
    assert rows[1]["status"] == "error" and "backend" in rows[1]["reason"]
    assert "fusekit_wall_us" not in rows[1]


def test_a_backend_failing_in_the_timed_rounds_is_an_error_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm-up passes, then every later call raises: the row must say so, not stay "ok" without a time."""
    calls = {"n": 0}

    def flaky(be: str):
        calls["n"] += 1
        if calls["n"] > host._WARM:
            raise RuntimeError("lost the device")

    monkeypatch.setattr(host, "_cases", lambda dev, dtype: [("flaky", {}, flaky, None, None)])
    (row,) = host.run(["torch"], "cpu", torch.float32, rep_ms=2.0, rounds=2)
    assert row["status"] == "error" and "lost the device" in row["reason"] and "fusekit_wall_us" not in row


def test_bare_autograd_runs_forward_launches_forward_and_backward_launches_backward() -> None:
    """The training floor: launches recorded with grad mode on run in the Function's forward, the others in
    its backward (the engine runs backward with grad mode off); the leaves get the engine's gradients."""
    order: list[str] = []

    class Launch:
        def __init__(self, name: str) -> None:
            self.name = name

        def run(self, *args, **kwargs) -> None:
            order.append(self.name)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=g).requires_grad_()
    w = torch.randn(8, generator=g).requires_grad_()
    dy = torch.randn(2, 8, generator=g)
    launches = [
        (Launch("fwd"), (), {}, True),
        (Launch("bwd1"), (), {}, False),
        (Launch("bwd2"), (), {}, False),
    ]
    call = host._bare_autograd(launches, x, w, dy)
    call()
    assert order == ["fwd", "bwd1", "bwd2"]
    torch.testing.assert_close(x.grad, dy)
    assert w.grad is not None and w.grad.shape == w.shape
    call()
    assert order == ["fwd", "bwd1", "bwd2"] * 2
    torch.testing.assert_close(x.grad, 2 * dy)  # accumulated, as the op's own training calls are


def test_recorded_launches_say_whether_grad_mode_was_on() -> None:
    """_record_launches tags each launch with grad mode, which _bare_autograd splits on."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    class Stub(JITFunction):
        def __init__(self) -> None:  # no kernel behind it: only JITFunction.run is exercised
            pass

    orig = JITFunction.run
    try:
        JITFunction.run = lambda self, *a, **k: None
        with host._record_launches() as seen:
            Stub().run(1, k=2)
            with torch.no_grad():
                Stub().run(3)
    finally:
        JITFunction.run = orig
    assert [(a, k, grad) for _, a, k, grad in seen] == [((1,), {"k": 2}, True), ((3,), {}, False)]


def test_each_case_is_checked_against_the_torch_call_beside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward case's fusekit output equals the torch call it is timed beside (the same tables, GQA
    heads and kv_len keys: the decode baseline used to repeat K/V 4x outside the call and read every key),
    and a fusekit call computing something else is an error row, never timed."""
    checked = 0
    for name, params, fk, eager, _ in host._cases("cpu", torch.float32):
        if eager is not None and not params.get("train"):
            host._check_against(fk("torch"), eager(), name, torch.float32)  # raises on a mismatch
            checked += 1
    assert checked >= 10

    def wrong(dev: str, dtype: torch.dtype):
        (name, params, fk, eager, _), *_ = _tiny_cases(dev, dtype)
        return [(name, params, lambda be: fk(be) * 1.01, eager, None)]

    monkeypatch.setattr(host, "_cases", wrong)
    (row,) = host.run(["torch"], "cpu", torch.float32, rep_ms=0.5, rounds=1)
    assert row["status"] == "error" and "from torch's" in row["reason"] and "fusekit_wall_us" not in row
