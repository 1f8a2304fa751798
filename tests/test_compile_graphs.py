"""torch.compile of a Hugging Face model patched with fusekit is one graph on every backend (a shared
file: each backend's session runs it with its own backend; the model helpers are test_hf's)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fusekit.hf as fh
from tests.test_hf import build, ids


def test_compiled_training_step_of_patched_model_is_one_graph(backend_name: str, monkeypatch):
    """patch(model, backend=...) loads the backend up front (backends.prepare): on the first call of a
    compiled model, loading it (imports) inside the trace was a graph break baked into the compiled
    frames; on the H200 the compiled patched Llama hit dynamo's recompile limit in library._apply."""
    import transformers.masking_utils as mu
    from torch._dynamo.utils import counters

    from fusekit import backends

    kw = dict(num_hidden_layers=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    model = build("llama3", **kw, intermediate_size=96).train()  # head dim 64: every backend's
    x = ids(seq=11)
    monkeypatch.setattr(backends, "_INSTANCES", {})  # as in a fresh process: nothing loaded yet
    fh.patch(model, backend=backend_name)
    monkeypatch.setattr(mu, "is_torchdynamo_exporting", lambda: torch.compiler.is_compiling())
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(input_ids=x, labels=x).loss.backward()
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    assert not breaks, list(breaks)[:3]
    assert all(p.grad is not None for p in model.parameters())
