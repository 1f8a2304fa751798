"""fusekit.hf.patch and fusekit.nn on every installed backend (test_hf.py and test_nn.py run backend "auto",
torch on the CPU: the patched model on triton or mojo was never checked in CI). Tiny Llama-3 / Qwen2 models
with head_dim 64 (the kernels' smallest head dim) in fp32: patched vs unpatched logits, greedy generate
and every parameter's gradient of one training step; nn.LayerNorm against torch's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fusekit.hf as fh
from fusekit import nn as fnn
from tests.checks import rel_error
from tests.test_hf import _grads, build, generate, ids, logits

# test_hf's fp32 bounds (measured: logits within 6e-7 on all three backends)
LOGIT_TOL, GRAD_TOL = 1e-5, 4e-5
HEADS = {"num_attention_heads": 1, "num_key_value_heads": 1}  # hidden 64: head_dim 64


def _refused(exc: ValueError) -> None:
    if "cannot run" in str(exc) or "has no backward here" in str(exc):
        pytest.skip(str(exc))
    raise exc


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_patched_model_on_the_backend_matches_unpatched(family: str, backend_name: str, device: str) -> None:
    model = build(family, **HEADS).to(device)
    x = ids(seq=19).to(device)
    ref, ref_gen = logits(model, x), generate(model, x[:1], n=8)
    ref_grads = _grads(model.train(), x)
    try:
        fh.patch(model.eval(), backend=backend_name)
        got = logits(model, x)
    except ValueError as exc:
        _refused(exc)
    err = rel_error(got, ref)
    assert err <= LOGIT_TOL, f"{family} on {backend_name}: logits relative error {err:.2e}"
    gen = generate(model, x[:1], n=8)
    assert torch.equal(gen, ref_gen), f"greedy tokens {gen[0, 19:].tolist()} vs {ref_gen[0, 19:].tolist()}"
    got_grads = _grads(model.train(), x)
    assert got_grads.keys() == ref_grads.keys()
    worst = max((rel_error(got_grads[n], ref_grads[n]), n) for n in ref_grads)
    assert worst[0] <= GRAD_TOL, f"gradient of {worst[1]} relative error {worst[0]:.2e}"
    fh.unpatch(model)


def test_nn_layer_norm_on_the_backend_matches_torch(backend_name: str, device: str) -> None:
    torch.manual_seed(0)
    ref = torch.nn.LayerNorm(96).to(device)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.2 * torch.randn(96))
        ref.bias.copy_(0.1 * torch.randn(96))
    mod = fnn.LayerNorm.from_module(ref, backend=backend_name)
    x = torch.randn(5, 96, device=device, requires_grad=True)
    try:
        y = mod(x)
    except ValueError as exc:
        _refused(exc)
    want = ref(x)
    assert rel_error(y, want) <= 1e-5
    dy = torch.randn(5, 96, device=device)
    got = torch.autograd.grad(y, (x, mod.weight, mod.bias), dy)
    exp = torch.autograd.grad(want, (x, ref.weight, ref.bias), dy)
    for name, a, b in zip(("x", "weight", "bias"), got, exp):
        assert rel_error(a, b) <= 2e-5, f"d{name}: {rel_error(a, b):.2e}"
