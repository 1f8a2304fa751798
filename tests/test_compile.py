"""torch.compile(fullgraph=True) traces a function calling all six ops without graph breaks."""

from __future__ import annotations

import re

import pytest
import torch

from fusekit import ops


def layer(x, w, b, wg, wu, wd, q, k, v):
    h = ops.rms_norm(x, w, backend="torch")
    h = ops.layer_norm(h, w, b, backend="torch")
    h = ops.swiglu_ffn(h, wg, wu, wd, norm_weight=w, backend="torch")
    r = ops.rope(q.transpose(1, 2), start_pos=3, backend="torch").transpose(1, 2)
    a = ops.attention(r, k, v, causal=True, backend="torch")
    return ops.reduce_sum(h, -1, backend="torch"), ops.reduce_sum(a, backend="torch")


def scalars(x, w, q):
    """The checked float scalars (eps, theta, scale, label_smoothing), by default and given explicitly."""
    h = ops.rms_norm(x, w, backend="torch") + ops.rms_norm(x, w, 1e-5, backend="torch")
    h = h + ops.layer_norm(x, w, w, backend="torch")
    r = ops.rope(q, backend="torch") + ops.rope(q, theta=5e5, backend="torch")
    a = ops.attention(r, r, r, scale=0.1, backend="torch")
    t = torch.arange(x.shape[0]) % x.shape[1]
    return (
        h,
        a,
        ops.linear_cross_entropy(x, w.expand(x.shape[1], -1), t, label_smoothing=0.1, backend="torch"),
    )


def test_fullgraph_dynamic_compile_of_checked_float_scalars():
    """dynamic=True: the finiteness check of a default eps or theta used math.isfinite, which Dynamo cannot
    trace there ("torch.* op returned non-Tensor"), so rms_norm, layer_norm and rope failed to compile."""
    torch.manual_seed(0)
    args = (torch.randn(6, 32), torch.randn(32), torch.randn(1, 5, 2, 64))
    torch._dynamo.reset()
    compiled = torch.compile(scalars, fullgraph=True, dynamic=True, backend="aot_eager")
    for g, w in zip(compiled(*args), scalars(*args)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_fullgraph_compile_all_ops():
    torch.manual_seed(0)
    d, f = 64, 96
    args = (
        torch.randn(5, d),
        torch.randn(d),
        torch.randn(d),
        torch.randn(f, d) * 0.1,
        torch.randn(f, d) * 0.1,
        torch.randn(d, f) * 0.1,
        torch.randn(1, 4, 7, 64),
        torch.randn(1, 2, 9, 64),
        torch.randn(1, 2, 9, 64),
    )
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(*args)
    want = layer(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_fullgraph_compile_with_grads_as_the_first_call_of_a_process():
    """The first fusekit call of a process, traced by torch.compile(fullgraph=True) with an input that
    requires grad: resolving the backward's backend loads the backend module inside the trace, which
    failed ("Attempted to call function marked as skipped", naming neither fusekit nor a remedy) until one
    eager call had been made. backends.get loads it outside the trace (assume_constant_result)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (
        "import torch\n"
        "from fusekit import ops\n"
        "torch.manual_seed(0)\n"
        "x, w = torch.randn(3, 16, requires_grad=True), torch.randn(16, requires_grad=True)\n"
        "f = torch.compile(lambda x, w: ops.rms_norm(x, w), backend='aot_eager', fullgraph=True)\n"
        "f(x, w).sum().backward()\n"
        "g = x.grad.clone(); x.grad = None\n"
        "ops.rms_norm(x, w, backend='torch').sum().backward()\n"
        "assert torch.allclose(g, x.grad, rtol=1e-5, atol=1e-6)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "python"), str(root)])}
    env.pop("FUSEKIT_BACKEND", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_export_with_a_dynamic_batch_past_the_decode_class():
    """torch.export of a module whose parameters require grad, batch dynamic up to 64: the backward pinning
    read the call's shape class (tokens <= 16: "decode") though an explicit backend (and "auto" on the CPU)
    does not depend on it, so export raised (2-D x: guard 2 <= b <= 16) or the program refused more than 16
    tokens at run time (3-D x)."""
    from torch.export import Dim, export

    from fusekit import nn as fnn

    torch.manual_seed(0)
    for backend in ("torch", "auto"):
        norm = fnn.RMSNorm(16, backend=backend)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(16))
        ep = export(norm, (torch.randn(4, 16),), dynamic_shapes={"x": {0: Dim("b", max=64)}})
        x = torch.randn(40, 16)
        assert torch.equal(ep.module()(x), norm(x))
        ep = export(
            norm, (torch.randn(2, 3, 16),), dynamic_shapes={"x": {0: Dim("b", max=64), 1: Dim("s", max=64)}}
        )
        x = torch.randn(4, 5, 16)
        assert torch.equal(ep.module()(x), norm(x))


def test_strict_export_of_rope_with_a_dynamic_sequence():
    """rope formatted its shape message ('start_pos + S = ...') on every call: formatting pinned a dynamic S
    to a constant (strict export raised 'Constraints violated', compile(dynamic=True) recompiled per S)."""
    from torch.export import Dim, export

    class Rope(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ops.rope(x, start_pos=4, backend="torch")

    ep = export(Rope(), (torch.randn(2, 3, 4, 16),), dynamic_shapes=({1: Dim("s", max=64)},), strict=True)
    x = torch.randn(2, 9, 4, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ep.module()(x), Rope()(x))


def test_cpu_value_checks_hold_under_compile():
    """The values eager checks on the CPU (a [St, D] rope table's repeated halves, positions, kv_len) were
    skipped while compiling: the compiled call answered (only half of a bad table used) where eager raised.
    They are asserts in the graph now."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 2, 16, generator=g)
    ang = torch.randn(8, 16, generator=g)
    q = torch.randn(2, 2, 3, 64, generator=g)
    cases = (
        (
            lambda x, c, s: ops.rope(x, cos=c, sin=s, backend="torch"),
            (x, ang.cos(), ang.sin()),
            "cos: a [St, D]",
        ),
        (
            lambda x, p: ops.rope(x, positions=p, backend="torch"),
            (x, torch.tensor([0, 1, -1, 2])),
            "positions:",
        ),
        (
            lambda q, n: ops.attention(q, q, q, kv_len=n, backend="torch"),
            (q, torch.tensor([9, 1])),
            "kv_len:",
        ),
    )
    for fn, args, match in cases:
        with pytest.raises(ValueError, match=re.escape(match)):
            fn(*args)
        with pytest.raises(RuntimeError, match=re.escape(match)):
            torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    good = ang[:, :8].repeat(1, 2)
    fn = torch.compile(cases[0][0], fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(x, good.cos(), good.sin()), cases[0][0](x, good.cos(), good.sin()))
