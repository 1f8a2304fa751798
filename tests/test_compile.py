"""torch.compile(fullgraph=True) traces a function calling all six ops without graph breaks."""

from __future__ import annotations

import torch

from fusekit import ops


def layer(x, w, b, wg, wu, wd, q, k, v):
    h = ops.rms_norm(x, w, backend="torch")
    h = ops.layer_norm(h, w, b, backend="torch")
    h = ops.swiglu_ffn(h, wg, wu, wd, norm_weight=w, backend="torch")
    r = ops.rope(q.transpose(1, 2), start_pos=3, backend="torch").transpose(1, 2)
    a = ops.attention(r, k, v, causal=True, backend="torch")
    return ops.reduce_sum(h, -1, backend="torch"), ops.reduce_sum(a, backend="torch")


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
