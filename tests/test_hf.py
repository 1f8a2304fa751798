"""fusekit.hf.patch on tiny random transformers models (Llama-2, Llama-3 with llama3 rope scaling,
Mistral, Qwen2): logits, greedy generate, a training step's gradients, torch.compile, unpatch, proof
that fusekit's ops ran, the mask rules and the unsupported-config errors.

CPU only, no downloads (models from config classes, HF_HUB_OFFLINE=1), backend "auto" (torch on the
CPU). Tiny configs: hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 128.
"""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import warnings
import weakref

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

import fusekit.hf as fh  # noqa: E402
from fusekit import nn as fnn  # noqa: E402
from fusekit import ops  # noqa: E402
from fusekit.hf import _attention  # noqa: E402
from tests.checks import TINY_LLAMA, rel_error  # noqa: E402

TINY = TINY_LLAMA
ROOT = Path(__file__).resolve().parents[1]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so the 12..40-token sequences here use the scaled bands
}
CONFIGS = {
    "llama2": lambda **kw: LlamaConfig(**{**TINY, **kw}),
    "llama3": lambda **kw: LlamaConfig(**{**TINY, "rope_parameters": dict(LLAMA3_ROPE), **kw}),
    "mistral": lambda **kw: MistralConfig(**{**TINY, "sliding_window": None, **kw}),
    "qwen2": lambda **kw: Qwen2Config(**{**TINY, **kw}),  # q/k/v projections with biases
    "qwen3": lambda **kw: Qwen3Config(**{**TINY, **kw}),  # per-head q/k RMSNorm before the rope
}
FAMILIES = tuple(CONFIGS)
FP32_TOL = 1e-5  # patched vs unpatched logits, relative 2-norm
GRAD_TOL = 4e-5  # CONTRACT.md: gradients get up to 2x the fp32 tolerance


def build(family: str = "llama2", seed: int = 0, **kw) -> torch.nn.Module:
    """A tiny random model with non-trivial weights: norm weights around 1, biases non-zero."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](**kw), attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def ids(batch: int = 2, seq: int = 13, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x, **kw) -> torch.Tensor:
    return model(x, **kw).logits.float()


def generate(model, x, n: int = 12, **kw) -> torch.Tensor:
    return model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(_attention, "_warned", set())


# --- numerics ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_generate_match_fp32(family):
    model = build(family)
    x = ids(seq=37)
    ref = logits(model, x)
    ref_gen = generate(model, x[:1])
    fh.patch(model)
    err = rel_error(logits(model, x), ref)
    assert err <= FP32_TOL, f"{family}: patched logits relative error {err:.2e}"
    gen = generate(model, x[:1])
    assert torch.equal(gen, ref_gen), (
        f"{family}: greedy tokens {gen[0, 37:].tolist()} vs {ref_gen[0, 37:].tolist()}"
    )
    assert gen.shape[1] == 37 + 12


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_kv_cache_fills_under_either_keyword(keyword):
    """transformers 5.24 renamed the forwards' KV-cache keyword past_key_values -> cache. A patched model
    takes either, passes on the installed transformers' own, and its attention appends to the cache: a
    decode step against the cache gives the full forward's last logits (an attention reading only the old
    name would attend to the new token alone)."""
    from transformers import DynamicCache

    model = build("llama3")
    x = ids(batch=2, seq=9)
    fh.patch(model)
    with torch.no_grad():
        full = model(x).logits[:, -1]
        cache = DynamicCache(config=model.config)
        model(x[:, :-1], use_cache=True, **{keyword: cache})
        step = model(x[:, -1:], use_cache=True, **{keyword: cache}).logits[:, -1]
    assert cache.get_seq_length() == x.shape[1]
    err = rel_error(step, full)
    assert err <= FP32_TOL, f"decode step against the {keyword}= cache: relative error {err:.2e}"
    with pytest.raises(ValueError, match="given twice"):
        model(x, cache=cache, past_key_values=cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_low_precision_logits_and_generate(family, dtype):
    """Patched and unpatched half-precision models against the fp32 model: fusekit's error within 2x HF's own."""
    model = build(family)
    x = ids(seq=29)
    exact = logits(model, x)
    model.to(dtype)
    hf_err = rel_error(logits(model, x), exact)
    fh.patch(model)
    out = logits(model, x)
    fk_err = rel_error(out, exact)
    assert fk_err <= 2 * hf_err + 1e-3, f"{family} {dtype}: fusekit error {fk_err:.2e}, HF's {hf_err:.2e}"
    gen = generate(model, x[:1], n=4)
    assert gen.shape == (1, 33) and bool((gen >= 0).all() and (gen < TINY["vocab_size"]).all())


def _grads(model, x) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x, labels=x).loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _patched_grads_match(model, x, label: str) -> None:
    """Every parameter's gradient of the LM loss on x: the unpatched model's, then (patched in place) the
    patched model's, within GRAD_TOL; the model is left patched."""
    ref = _grads(model, x)
    assert len(ref) == len(list(model.parameters()))
    fh.patch(model)
    got = _grads(model, x)
    assert got.keys() == ref.keys(), f"parameters without a gradient: {sorted(ref.keys() - got.keys())}"
    worst = max((rel_error(got[n], ref[n]), n) for n in ref)
    assert worst[0] <= GRAD_TOL, f"{label}: gradient of {worst[1]} relative error {worst[0]:.2e}"


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_training_step_gradients_match_every_parameter(family):
    model = build(family).train()
    _patched_grads_match(model, ids(seq=21), family)
    # one optimizer step moves the shared parameters; unpatching keeps them
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.lm_head.weight.detach().clone()
    opt.step()
    fh.unpatch(model)
    assert not torch.equal(model.lm_head.weight, before)


def test_training_step_copies_no_residual_gradient(monkeypatch: pytest.MonkeyPatch):
    """The fused residual norms copy a gradient only where two leaves could keep one buffer
    (`_norms.own_residual_grad`); a patched model's residual stream (sublayer outputs beside the last
    norm's h) must not pay that copy, while its fused norms are asked."""
    from fusekit.ops import _norms

    asked, copies = [], []
    walk, apply = _norms._may_keep_grad, _norms._OwnGrad.apply
    monkeypatch.setattr(_norms, "_may_keep_grad", lambda t: asked.append(1) or walk(t))
    monkeypatch.setattr(_norms._OwnGrad, "apply", lambda t: copies.append(1) or apply(t))
    model = build("llama3").train()
    fh.patch(model)
    x = ids(seq=21)
    model(x, labels=x).loss.backward()
    assert asked and not copies, (len(asked), len(copies))


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_keeps_every_gradient(reentrant):
    """HF's gradient checkpointing, reentrant (the layers' forward runs under no_grad, where the patched
    layers fuse the post-MLP add into the next norm) or not: every parameter gets its gradient, as unpatched.
    With use_reentrant=True the final norm once took the last layer's no_grad result: only lm_head trained."""
    model = build("llama3").train()
    kw = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 (the older name deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    _patched_grads_match(model, ids(seq=21), f"use_reentrant={reentrant}")
    fh.unpatch(model)


def test_bf16_training_step_runs_and_tracks_fp32():
    """Each bf16 gradient is as close to the fp32 one as unpatched HF's bf16 gradient is (within 1.5x +
    1e-3; a flat 10% bound passed a gradient 9% off)."""
    model = build("llama2").train()
    x = ids(seq=17)
    exact = _grads(model, x)
    model.to(torch.bfloat16)
    hf_bf16 = _grads(model, x)
    fh.patch(model)
    got = _grads(model, x)
    assert got.keys() == exact.keys()
    for n in exact:
        assert torch.isfinite(got[n]).all(), n
        err, hf_err = rel_error(got[n], exact[n]), rel_error(hf_bf16[n], exact[n])
        assert err <= 1.5 * hf_err + 1e-3, (
            f"bf16 gradient of {n}: {err:.2e} from fp32, HF's bf16 {hf_err:.2e}"
        )


def test_torch_compile_of_patched_model():
    model = build("llama3", num_hidden_layers=1)
    x = ids(seq=11)
    fh.patch(model)
    want = logits(model, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    got = logits(compiled, x)
    assert rel_error(got, want) <= FP32_TOL


def test_compiled_prefill_and_training_step_have_no_graph_break(monkeypatch: pytest.MonkeyPatch):
    """A prefill / training forward without a padding mask traces into one graph: the mask function
    answers None (plain causal) from static facts, where transformers (torch < 2.14) materializes a
    mask while tracing whose check would read its values (a graph break per layer, 3x slower prefill
    on the H200)."""
    import transformers.masking_utils as mu

    model = build("llama3", num_hidden_layers=2)
    x = ids(seq=11)
    fh.patch(model)
    want = logits(model, x)
    # what dynamo on torch < 2.14 answers while tracing (the H200's torch 2.11): never skip the mask
    monkeypatch.setattr(mu, "is_torchdynamo_exporting", lambda: torch.compiler.is_compiling())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = logits(compiled, x)
    assert rel_error(got, want) <= FP32_TOL
    model.train()
    compiled(input_ids=x, labels=x).loss.backward()
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_compiled_forward_without_cache_has_no_graph_break(family: str):
    """use_cache=False (a prefill without a cache, HF Trainer's training forward): transformers keeps its
    packed-sequence mask while tracing (it cannot read position_ids there), so the patched base model
    tells its layers their positions are its own and the mask is plain causal. Before, each layer
    checked the mask on the host: a graph break and a sync per layer (H100 prefill 12.0 vs 9.7 ms)."""
    model = build(family, num_hidden_layers=2)
    x = ids(seq=11)
    want = logits(model, x, use_cache=False)
    fh.patch(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert rel_error(logits(compiled, x, use_cache=False), want) <= FP32_TOL
    model.train()
    compiled(input_ids=x, labels=x, use_cache=False).loss.backward()
    torch._dynamo.reset()


def test_compiled_forward_with_an_all_ones_mask_breaks_once():
    """A tokenizer's attention_mask of all ones under torch.compile: one host check at the base model
    (then no mask) instead of a materialized mask checked in every layer (15 graph breaks for 2 layers
    before); the answer is unchanged, and a padded mask still gets transformers' answer (sdpa fallback)."""
    model = build("llama3", num_hidden_layers=2)
    x = ids(seq=11)
    ones = torch.ones_like(x)
    padded = ones.clone()
    padded[0, :3] = 0
    want = logits(model, x, attention_mask=ones, use_cache=False)
    want_padded = logits(model, x, attention_mask=padded, use_cache=False)
    fh.patch(model)
    torch._dynamo.reset()
    with torch.no_grad():
        ex = torch._dynamo.explain(model)(x, attention_mask=ones, use_cache=False)
    sites = {str(b.user_stack[-1]) for b in ex.break_reasons}
    assert len(sites) == 1 and "_all_ones" in sites.pop(), ex.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    assert rel_error(logits(compiled, x, attention_mask=ones, use_cache=False), want) <= FP32_TOL
    with pytest.warns(UserWarning, match="padding"):
        got = logits(compiled, x, attention_mask=padded, use_cache=False)
    assert rel_error(got, want_padded) <= FP32_TOL
    torch._dynamo.reset()


def test_packed_positions_keep_their_mask():
    """position_ids given by the caller may pack several sequences per row: the mask transformers builds
    from them (block-diagonal causal) must reach the attention; fusekit cannot express it and falls back
    to sdpa, eager and compiled - never plain causal over the whole row."""
    model = build("llama3", num_hidden_layers=2)
    x = ids(batch=1, seq=12)
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    want = logits(model, x, position_ids=packed, use_cache=False)
    plain = logits(model, x, use_cache=False)
    assert rel_error(plain, want) > 0.01  # packing really changes the answer
    fh.patch(model)
    with pytest.warns(UserWarning, match="packed"):
        got = logits(model, x, position_ids=packed, use_cache=False)
    assert rel_error(got, want) <= FP32_TOL
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    assert rel_error(logits(compiled, x, position_ids=packed, use_cache=False), want) <= FP32_TOL
    torch._dynamo.reset()


def test_mask_function_keeps_padding_and_windows():
    """The None shortcut is only for the plain causal square: a padding mask, a window or q != kv still
    get transformers' mask (materialized where sdpa would use its top-left is_causal)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    from fusekit.hf._attention import fusekit_mask

    base = dict(batch_size=1, q_length=4, kv_length=4, mask_function=causal_mask_function, device="cpu")
    assert fusekit_mask(**base) is None
    pad = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    assert fusekit_mask(**{**base, "attention_mask": pad}).shape == (1, 1, 4, 4)
    win = sliding_window_causal_mask_function(2)
    assert fusekit_mask(**{**base, "mask_function": win, "local_size": 2}) is not None
    longer = fusekit_mask(**{**base, "kv_length": 6, "q_offset": 2})
    assert longer is not None and longer.shape == (1, 1, 4, 6) and bool(longer[0, 0, 0, 2])


# --- patch / unpatch mechanics -----------------------------------------------------------------------
def test_unpatch_restores_bit_identical_outputs_and_objects():
    model = build("mistral")
    x = ids(seq=19)
    before = logits(model, x)
    gen_before = generate(model, x[:1], n=5)
    snapshot = {id(m): type(m) for m in model.modules()}
    params = {n: p for n, p in model.named_parameters()}
    impl = model.config._attn_implementation
    assert fh.patch(model) is model and fh.is_patched(model)
    assert model.config._attn_implementation == "fusekit"
    assert model.state_dict().keys() == params.keys() | {
        k for k in model.state_dict() if k not in params
    }  # the same parameter names
    assert all(p is params[n] for n, p in model.named_parameters()), "patch must share, not copy, parameters"
    patched = logits(model, x)
    twin = copy.deepcopy(model)  # a copy is patched too, and unpatches on its own
    assert fh.is_patched(twin) and torch.equal(logits(twin, x), patched)
    fh.unpatch(twin)
    assert fh.is_patched(model) and torch.equal(logits(twin, x), before)
    assert fh.unpatch(model) is model and not fh.is_patched(model)
    assert model.config._attn_implementation == impl
    assert {id(m): type(m) for m in model.modules()} == snapshot
    assert not any(k.startswith("_fusekit") for m in model.modules() for k in vars(m))
    assert torch.equal(logits(model, x), before)
    assert torch.equal(generate(model, x[:1], n=5), gen_before)
    fh.patch(model)  # patchable again
    with pytest.raises(ValueError, match="already patched"):
        fh.patch(model)
    fh.unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        fh.unpatch(model)


def test_unpatch_hands_back_parameters_replaced_while_patched():
    """load_state_dict(assign=True) while patched replaces the norms' Parameters in fusekit's modules: unpatch
    puts those back, not the ones shared at patch time (stale weights: logits off by 0.8 relative)."""
    model, src = build("llama2", seed=0), build("llama2", seed=5)
    x = ids(seq=11)
    want = logits(src, x)
    fh.patch(model)
    model.load_state_dict(src.state_dict(), assign=True)
    assert rel_error(logits(model, x), want) <= FP32_TOL
    fh.unpatch(model)
    assert torch.equal(logits(model, x), want)
    assert all(torch.equal(p, src.state_dict()[n]) for n, p in model.state_dict().items())


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_hidden_states_are_recorded_and_attention_maps_refused(family):
    """output_hidden_states on a patched model: the same tuple as HF's (transformers records them through
    a registry keyed on the model's class name, which the patched class must be in); attention maps do not
    exist in a flash kernel, so output_attentions raises instead of returning an empty tuple."""
    model = build(family)
    x = ids(seq=11)
    with torch.no_grad():
        want = model(x, output_hidden_states=True).hidden_states
        fh.patch(model)
        got = model(x, output_hidden_states=True).hidden_states
        base = model.model(x, output_hidden_states=True).hidden_states
    assert got is not None and len(got) == len(want) == TINY["num_hidden_layers"] + 1
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_error(a, b) <= FP32_TOL, f"hidden state {i}"
    assert len(base) == len(want)
    with pytest.raises(ValueError, match=r"^output_attentions: a fusekit-patched model"):
        model(x, output_attentions=True)


def test_fusekit_ops_ran_and_hf_originals_did_not(monkeypatch):
    model = build("llama2")
    fh.patch(model)
    L = model.config.num_hidden_layers
    counts: dict[str, int] = {}

    def counting(name):
        real = getattr(ops, name)

        def wrapper(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return real(*a, **k)

        return wrapper

    for name in ("rms_norm", "swiglu_ffn", "rope", "attention"):
        monkeypatch.setattr(ops, name, counting(name))

    def banned(*a, **k):
        raise AssertionError("an HF original ran in a patched model")

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama as ML

    monkeypatch.setattr(ML, "apply_rotary_pos_emb", banned)
    monkeypatch.setattr(ML, "eager_attention_forward", banned)
    monkeypatch.setattr(ML.LlamaRMSNorm, "forward", banned)
    monkeypatch.setattr(ML.LlamaMLP, "forward", banned)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", banned)
    logits(model, ids(seq=9))
    # rope: q and k in one call per layer
    assert counts == {"rms_norm": 2 * L + 1, "swiglu_ffn": L, "rope": L, "attention": L}, counts
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, fnn.RMSNorm) and layer.input_layernorm.casting == "llama"
    assert isinstance(layer.mlp, fnn.SwiGLUMLP) and isinstance(model.model.norm, fnn.RMSNorm)
    # decode through the KV cache: S = 1 queries, no HF original either
    counts.clear()
    generate(model, ids(batch=1, seq=5), n=3)
    assert counts["attention"] == 3 * L and counts["rope"] == 3 * L


# --- the fused LM-head loss --------------------------------------------------------------------------
def _loss_and_grads(model, x, **kw):
    model.zero_grad(set_to_none=True)
    out = model(x, **kw)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("items", [None, 23], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("family", ["llama2", "mistral", "qwen2"])
def test_fused_loss_matches_hf_loss_and_every_gradient(family, items, monkeypatch):
    """Training with labels: ops.linear_cross_entropy gives HF's ForCausalLMLoss (shifted labels, -100
    ignored, mean or sum / num_items_in_batch) and every parameter's gradient, the LM head never runs
    (no logits), and the output's logits are None."""
    model = build(family).train()
    x = ids(seq=19)
    labels = x.clone()
    labels[0, :6] = -100  # a prompt that does not count
    kw = {"labels": labels} | ({} if items is None else {"num_items_in_batch": torch.tensor(items)})
    ref, ref_g = _loss_and_grads(model, x, **kw)
    fh.patch(model)
    calls = []
    real = ops.linear_cross_entropy
    monkeypatch.setattr(ops, "linear_cross_entropy", lambda *a, **k: calls.append(k) or real(*a, **k))

    linear = nn.Linear.forward

    def banned(self, x):  # nn.Linear.forward, raising for the head (a wrapper on the head instance's forward
        if self is model.lm_head:  # would be a hook, which rightly turns the fusion off)
            raise AssertionError("the LM head ran: the logits were materialized")
        return linear(self, x)

    monkeypatch.setattr(nn.Linear, "forward", banned)
    monkeypatch.setattr(fnn.mlp, "_LINEAR_FORWARD", banned)  # the projections stay plain Linears
    got, got_g = _loss_and_grads(model, x, **kw)
    assert len(calls) == 1 and calls[0].get("reduction", "mean") == ("mean" if items is None else "sum")
    assert got.logits is None
    assert rel_error(got.loss, ref.loss) <= FP32_TOL, (got.loss.item(), ref.loss.item())
    assert got_g.keys() == ref_g.keys()
    worst = max((rel_error(got_g[n], ref_g[n]), n) for n in ref_g)
    assert worst[0] <= GRAD_TOL, f"{family}: gradient of {worst[1]} relative error {worst[0]:.2e}"


def test_a_hook_on_the_lm_head_keeps_hfs_loss_path():
    """A hook on lm_head (logit capture or editing) must run and count: with one, the loss is HF's own over
    the head's (hooked) logits, not the fused op that never calls the head."""

    def run(patched: bool):
        model = build("llama3").train()
        if patched:
            fh.patch(model)
        seen = []

        def hook(mod, args, out):
            seen.append(tuple(out.shape))
            return out * 0.5

        model.lm_head.register_forward_hook(hook)
        x = ids(seq=9)
        return _loss_and_grads(model, x, labels=x), seen

    (ref, ref_g), ref_seen = run(False)
    (got, got_g), got_seen = run(True)
    assert got_seen == ref_seen and len(ref_seen) == 1
    assert rel_error(got.loss, ref.loss) <= FP32_TOL
    worst = max((rel_error(got_g[n], ref_g[n]), n) for n in ref_g)
    assert worst[0] <= GRAD_TOL, worst


@pytest.mark.parametrize("where", ["mlp", "post_attention_layernorm", "input_layernorm"])
def test_patch_refuses_modules_it_would_replace_that_carry_hooks(where):
    """patch() replaces each RMSNorm and MLP: a hook registered on one before patching stopped running, and
    logits moved by up to 29% with no error. It raises naming the module, with the model untouched."""
    model = build("llama3", num_hidden_layers=2)
    getattr(model.model.layers[0], where).register_forward_hook(lambda mod, args, out: out * 1.5)
    before = logits(model, ids(seq=7))
    with pytest.raises(ValueError, match=rf"^model: model\.layers\.0\.{where} \(\w+\) has hooks"):
        fh.patch(model)
    assert not hasattr(model, fh._patch._ATTR) and torch.equal(logits(model, ids(seq=7)), before)


def _wrap_forward(m: nn.Module, scale: float) -> None:
    """accelerate's add_hook_to_module: the instance's forward replaced by a wrapper (no torch hook)."""
    old = m.forward
    m.forward = lambda *a, **k: old(*a, **k) * scale


@pytest.mark.parametrize("where", ["up_proj", "lm_head"])
def test_instance_level_forward_wrappers_are_hooks(where):
    """A projection or head whose forward is wrapped on the instance (accelerate's hooks: offload, device
    maps) must be called: the fused MLP and the fused loss read only `.weight` and skipped the wrapper
    (logits 4.5% off through up_proj; the loss through lm_head)."""

    def run(patched: bool):
        model = build("llama3", num_hidden_layers=2).train()
        if patched:
            fh.patch(model)
        target = model.lm_head if where == "lm_head" else model.model.layers[0].mlp.up_proj
        _wrap_forward(target, 0.5)
        x = ids(seq=9)
        return _loss_and_grads(model, x, labels=x)

    (ref, ref_g), (got, got_g) = run(False), run(True)
    assert rel_error(got.loss, ref.loss) <= FP32_TOL
    worst = max((rel_error(got_g[n], ref_g[n]), n) for n in ref_g)
    assert worst[0] <= GRAD_TOL, worst


def test_fp16_loss_with_gradients_is_as_accurate_as_hfs(monkeypatch):
    """A patched model's fp16 loss with gradients is the fused op on the patch's backend (never "auto", which
    would let FUSEKIT_BACKEND* override it): under a 65536 scale its loss and gradients are HF's own (F.linear,
    fp32 cross-entropy) within fp16's tolerance and as close to float64 (the op scales its d logits by a power
    of two and saves fp32 gradients; it rounded them to fp16 before the loss scale reached them)."""
    from types import SimpleNamespace

    from fusekit.hf import _patch
    from fusekit.tolerances import rtol

    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(16, 40, bias=False).half()
    model = SimpleNamespace(lm_head=head, **{_patch._ATTR: SimpleNamespace(backend="torch")})
    hidden = torch.randn(1, 5, 16, generator=g).half().requires_grad_()
    labels = torch.randint(0, 40, (1, 5), generator=g)
    labels[0, 2] = -100
    seen = []
    real = ops.linear_cross_entropy
    monkeypatch.setattr(
        ops,
        "linear_cross_entropy",
        lambda *a, backend, **k: seen.append(backend) or real(*a, backend=backend, **k),
    )
    monkeypatch.setenv("FUSEKIT_BACKEND", "mojo")
    monkeypatch.setenv("FUSEKIT_BACKEND_LINEAR_CROSS_ENTROPY", "mojo")

    def hf_loss(h, w, num_items=None):  # transformers' ForCausalLMLoss on lm_head(h) (float64 stays float64)
        target = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
        logits = torch.nn.functional.linear(h, w).reshape(-1, 40)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits, target, reduction="mean" if num_items is None else "sum"
        )
        return loss if num_items is None else loss / num_items

    def grads(loss_fn, h, w) -> tuple:
        h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = loss_fn(h, w)
        (loss * 65536).backward()
        return loss.detach().double(), h.grad.double() / 65536, w.grad.double() / 65536

    tol = 2 * rtol("linear_cross_entropy", torch.float16, "backward")  # both sides round
    for num_items in (None, 3):

        def fused(h, w, num_items=num_items):
            with_w = SimpleNamespace(
                lm_head=SimpleNamespace(weight=w, bias=None), **{_patch._ATTR: getattr(model, _patch._ATTR)}
            )
            return _patch._fused_loss(with_w, h, labels, num_items_in_batch=num_items)

        def unfused(h, w, num_items=num_items):
            return hf_loss(h, w, num_items)

        got, hf = grads(fused, hidden, head.weight), grads(unfused, hidden, head.weight)
        exact = grads(unfused, hidden.double(), head.weight.double())
        for a, r, e in zip(got, hf, exact):
            assert float((a - r).norm() / r.norm()) <= tol
            assert float((a - e).norm() / e.norm()) <= 1.25 * float((r - e).norm() / e.norm()) + 1e-6
    assert seen == ["torch", "torch"]


def test_fused_loss_in_eval_keeps_logits_and_unpatch_restores_forward():
    model = build("llama3")  # eval mode
    x = ids(seq=15)
    with torch.no_grad():
        ref = model(x, labels=x)
        fh.patch(model)
        got = model(x, labels=x)
        assert rel_error(got.loss, ref.loss) <= FP32_TOL and rel_error(got.logits, ref.logits) <= FP32_TOL
        assert model(x, labels=x, skip_logits=True).logits is None  # Liger's keyword
        assert torch.equal(model(x, labels=x, return_dict=False)[0], got.loss)
        assert copy.deepcopy(model).forward.model is not model  # the copy's forward runs on the copy
        assert model(x).loss is None  # no labels: HF's forward
    model.train()
    assert model(x, labels=x, skip_logits=False).logits is not None
    assert model(x, labels=x).logits is None  # training: no logits by default (Liger's rule)...
    loss, logits_, *_ = model(x, labels=x, return_dict=False)  # ...but a tuple keeps HF's positions
    assert logits_.shape == (*x.shape, TINY["vocab_size"]) and loss.dim() == 0
    fh.unpatch(model)
    assert "forward" not in vars(model)
    with torch.no_grad():
        assert torch.equal(model(x, labels=x).loss, ref.loss)
    # mojo runs linear_cross_entropy too: the fused loss replaces HF's (head dim 64: mojo attention's)
    model = build("llama2", num_attention_heads=1, num_key_value_heads=1)
    fh.patch(model, backend="mojo")
    assert "forward" in vars(model)
    fh.unpatch(model)


@pytest.mark.parametrize("name", ["triton", "mojo"])
def test_head_dim_the_kernels_lack_raises_at_patch_time(name):
    """TINY's head dim is 16: triton and mojo attention run 64 / 128 / 256 only, so patch raises naming
    head_dim with the model untouched (it used to patch, then raise at the first forward); "auto" patches."""
    model = build("llama2")
    with pytest.raises(ValueError, match="head_dim: 16 is not supported by " + name):
        fh.patch(model, backend=name)
    assert not fh.is_patched(model) and model.config._attn_implementation == "sdpa"
    assert fh.is_patched(fh.patch(model, backend="auto"))


# --- masks -------------------------------------------------------------------------------------------
def test_padded_batch_falls_back_to_sdpa_once_or_raises_when_strict():
    model = build("llama2")
    x = ids(batch=2, seq=12)
    mask = torch.ones_like(x)
    mask[1, :4] = 0  # left padding: positions differ per row (rope per row) and the mask has padding
    ref = generate(model, x, n=6, attention_mask=mask)
    ref_logits = logits(model, x, attention_mask=mask)
    fh.patch(model)
    with pytest.warns(UserWarning, match="padding") as rec:
        got = generate(model, x, n=6, attention_mask=mask)
    assert sum("fusekit attention" in str(w.message) for w in rec) == 1, "warn once, not per call"
    assert torch.equal(got, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = logits(model, x, attention_mask=mask)
    assert (
        rel_error(out[0], ref_logits[0]) <= FP32_TOL and rel_error(out[1, 4:], ref_logits[1, 4:]) <= FP32_TOL
    )
    # an all-ones mask is plain causal: fusekit runs, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logits(model, x, attention_mask=torch.ones_like(x))
    fh.unpatch(model)
    fh.patch(model, strict=True)
    with pytest.raises(ValueError, match="padding"):
        logits(model, x, attention_mask=mask)


def test_mask_kind_recognizes_causal_full_prefix_and_other():
    s, skv = 3, 7
    i, j = torch.arange(s)[:, None], torch.arange(skv)[None, :]
    causal = (j <= i + skv - s)[None, None].expand(2, 1, s, skv)
    C, F = _attention.CAUSAL, _attention.FULL
    assert _attention.mask_kind(None, s, skv, True) == (C, skv)
    assert _attention.mask_kind(None, 1, skv, True) == (F, skv)
    assert _attention.mask_kind(causal.clone(), s, skv, True) == (C, skv)
    assert _attention.mask_kind(torch.ones(2, 1, s, skv, dtype=torch.bool), s, skv, True) == (F, skv)
    # a static cache of 9 slots with 7 filled: the last 2 keys masked for every query -> 7 keys, causal
    padded = torch.cat((causal, torch.zeros(2, 1, s, 2, dtype=torch.bool)), dim=-1)
    assert _attention.mask_kind(padded, s, skv + 2, True) == (C, skv)
    # sdpa's top-left is_causal over 7 keys = bottom-right causal over the first 3 (keys 3.. unseen)
    top_left = (j <= i)[None, None].expand(2, 1, s, skv).clone()
    assert _attention.mask_kind(top_left, s, skv, True) == (C, s)
    shifted = top_left.clone()
    shifted[..., 0, 1] = True  # query 0 also sees key 1: neither causal alignment
    assert "padding" in _attention.mask_kind(shifted, s, skv, True)[0]
    row_padding = causal.clone()
    row_padding[1, :, :, :2] = False  # left padding in one row only
    assert "padding" in _attention.mask_kind(row_padding, s, skv, True)[0]
    additive = torch.zeros(2, 1, s, skv).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert _attention.mask_kind(additive, s, skv, True) == (C, skv)
    assert "bias" in _attention.mask_kind(additive + 0.5, s, skv, True)[0]


def _attention_spy(monkeypatch) -> list[tuple[int, list[int] | None]]:
    """Records (keys passed, kv_len values or None) for every ops.attention call."""
    seen: list[tuple[int, list[int] | None]] = []
    real = ops.attention

    def spy(q, k, v, **kw):
        kv_len = kw.get("kv_len")
        seen.append((k.shape[2], None if kv_len is None else kv_len.tolist()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(ops, "attention", spy)
    return seen


def test_static_cache_generate_passes_the_cache_with_kv_len(monkeypatch):
    """generate() with an unpadded prompt: the whole static cache and per-sequence kv_len (no host
    sync, no slicing); tokens identical to the unpatched model."""
    model = build("qwen2")
    x = ids(batch=2, seq=9)
    ref = generate(model, x, n=5, cache_implementation="static")
    fh.patch(model)
    seen = _attention_spy(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to sdpa
        got = generate(model, x, n=5, cache_implementation="static")
    assert torch.equal(got, ref)
    L = model.config.num_hidden_layers
    size = seen[0][0]
    assert size >= 13 and seen == [(size, [n, n]) for n in range(9, 14) for _ in range(L)], seen
    assert not any(m._fusekit_prefix_masks for m in model.modules() if hasattr(m, "_fusekit_prefix_masks"))


def test_prefix_kv_len_values_and_once_per_mask():
    """kv_len = keys the last query row sees (bool or additive masks, a batch-1 mask broadcast); the same
    mask tensor (every layer of one forward) is reduced once; an in-place change recomputes."""
    s, skv = 3, 9
    i, j = torch.arange(s)[:, None], torch.arange(skv)[None, :]
    lens = torch.tensor([9, 6])
    mask = torch.stack([(j <= i + n - s) & (j < n) for n in lens.tolist()])[:, None]  # [2, 1, 3, 9]
    got = _attention.prefix_kv_len(mask, 2)
    assert got.dtype == torch.int32 and got.tolist() == [9, 6]
    assert _attention.prefix_kv_len(mask, 2) is got, "the same mask again: remembered"
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert _attention.prefix_kv_len(additive, 2).tolist() == [9, 6]
    assert _attention.prefix_kv_len(mask[:1], 3).tolist() == [9, 9, 9]  # one mask for every sequence
    mask[1, :, :, 5] = False  # in place: the version moves, the lengths are recomputed
    assert _attention.prefix_kv_len(mask, 2).tolist() == [9, 5]


def test_static_cache_forward_outside_generate_slices_the_filled_prefix(monkeypatch):
    """A static cache driven by hand (no generate): each mask is checked on the host and the keys past
    the filled prefix are sliced off, as before."""
    from transformers import StaticCache

    model = build("llama2")
    x = ids(batch=1, seq=9)
    fh.patch(model)
    seen = _attention_spy(monkeypatch)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(x, past_key_values=cache, use_cache=True)
        model(x[:, :1], past_key_values=cache, use_cache=True)
    L = model.config.num_hidden_layers
    assert seen == [(9, None)] * L + [(10, None)] * L, seen


def test_padded_prompt_in_static_cache_generate_is_not_trusted():
    """Left padding: generate's masks are checked per call (fallback to sdpa with a warning), tokens
    equal the unpatched model's."""
    model = build("llama2")
    x = ids(batch=2, seq=10)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    ref = generate(model, x, n=4, attention_mask=mask, cache_implementation="static")
    fh.patch(model)
    with pytest.warns(UserWarning, match="padding"):
        got = generate(model, x, n=4, attention_mask=mask, cache_implementation="static")
    assert torch.equal(got, ref)
    # pad tokens in a prompt given without a mask: transformers infers padding, so no trust either
    assert not fh._patch._unpadded(model, (torch.tensor([[0, 5, 6]]),), {"pad_token_id": 0})
    assert fh._patch._unpadded(model, (torch.tensor([[4, 5, 6]]),), {"pad_token_id": 0})
    assert not fh._patch._unpadded(model, (x,), {"attention_mask": mask})


def test_only_the_forwards_of_an_unpadded_generate_call_are_marked(monkeypatch):
    """generate() of an unpadded prompt marks the inputs of its own forwards (prepare_inputs_for_generation)
    as prefix masks; a nested padded call's forwards are not marked while it runs, the outer call's are
    again after it, another thread's and any call outside generate() never are. (A flag on the attention
    modules for the whole call also covered other forwards: test_compiled_padded_forward_inside_generate.)"""
    import inspect
    import threading

    from transformers.generation.utils import GenerationMixin

    model = build("llama2")
    fh.patch(model)
    seen: list[tuple[str, bool]] = []

    def marked() -> bool:
        inputs = model.prepare_inputs_for_generation(torch.tensor([[5, 3, 4]]))
        return inputs.get(_attention.PREFIX_MASKS, False)

    def fake_generate(self, ids, tag, **kw):
        seen.append((f"{tag} runs", marked()))
        if tag == "outer":
            self.generate(torch.tensor([[0, 3, 4]]), tag="inner", pad_token_id=0)  # padded, nested
            seen.append(("outer after inner", marked()))
            t = threading.Thread(target=lambda: seen.append(("other thread", marked())))
            t.start()
            t.join()

    monkeypatch.setattr(GenerationMixin, "generate", fake_generate)
    model.generate(torch.tensor([[5, 3, 4]]), tag="outer", pad_token_id=0)
    assert seen == [
        ("outer runs", True),
        ("inner runs", False),
        ("outer after inner", True),
        ("other thread", False),
    ], seen
    assert not marked()
    bound = type(model).prepare_inputs_for_generation.__get__(model)
    assert inspect.signature(model.prepare_inputs_for_generation) == inspect.signature(bound)
    fh.unpatch(model)
    assert "prepare_inputs_for_generation" not in vars(model)


def test_padded_forward_inside_generate_is_not_read_as_a_prefix():
    """generate() of an unpadded prompt trusts its masks to be causal prefixes; a forward inside the call
    with a padded mask of its own (a LogitsProcessor here; another thread alike) was read that way: the
    padded row's logits off by 1.4, silently. Eager masks are now checked (is_prefix) before that path."""
    from transformers import LogitsProcessor, LogitsProcessorList

    ref = build("llama2")
    model = copy.deepcopy(ref)
    fh.patch(model)
    xb = ids(2, 10, seed=5)
    pad = torch.ones_like(xb)
    pad[1, :4] = 0
    with torch.no_grad():
        want = ref(xb, attention_mask=pad).logits
    got = []

    class Probe(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not got:
                with torch.no_grad():
                    got.append(model(xb, attention_mask=pad).logits)
            return scores

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the padded forward's one-time sdpa fallback warning
        model.generate(
            ids(1, 6), max_new_tokens=2, do_sample=False, logits_processor=LogitsProcessorList([Probe()])
        )
    assert rel_error(got[0][1, 4:], want[1, 4:]) < FP32_TOL and rel_error(got[0][0], want[0]) < FP32_TOL


def test_compiled_padded_forward_inside_generate_is_not_read_as_a_prefix():
    """The compiled form of the test above: while tracing, masks cannot be checked on the host, so the
    prefix path trusted every mask during an unpadded generate() (a flag on the attention modules): a
    LogitsProcessor's padded forward through torch.compile(model) got row 1 off by 1.33, silently. Only
    generate()'s own forwards carry the marker now."""
    from transformers import LogitsProcessor, LogitsProcessorList

    ref = build("llama2")
    model = copy.deepcopy(ref)
    fh.patch(model)
    compiled = torch.compile(model, backend="aot_eager")
    xb = ids(2, 10, seed=5)
    pad = torch.ones_like(xb)
    pad[1, :4] = 0
    with torch.no_grad():
        want = ref(xb, attention_mask=pad, use_cache=False).logits
    got = []

    class Probe(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not got:
                with torch.no_grad():
                    got.append(compiled(xb, attention_mask=pad, use_cache=False).logits)
            return scores

    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the padded forward's one-time sdpa fallback warning
            model.generate(
                ids(1, 6),
                max_new_tokens=2,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([Probe()]),
            )
    finally:
        torch._dynamo.reset()
    assert rel_error(got[0][1, 4:], want[1, 4:]) < FP32_TOL and rel_error(got[0][0], want[0]) < FP32_TOL


def test_classifier_free_guidance_with_a_padded_negative_prompt():
    """guidance_scale with a left-padded negative prompt: transformers' CFG processor runs the model on it
    inside generate(); 7 of 8 tokens differed from the unpatched model, with no warning."""
    ref = build("llama2")
    model = copy.deepcopy(ref)
    fh.patch(model)
    x = ids(1, 9, seed=2) % 100 + 1  # no pad token (0) in the prompt
    neg = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids(1, 5, seed=3) % 100 + 1], 1)
    kw = dict(
        max_new_tokens=8,
        do_sample=False,
        guidance_scale=1.5,
        negative_prompt_ids=neg,
        negative_prompt_attention_mask=(neg != 0).long(),
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    want = ref.generate(x, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model.generate(x, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max(rel_error(a, b) for a, b in zip(got.scores, want.scores)) < FP32_TOL


def test_generate_wrapper_keeps_class_names_and_follows_copies(tmp_path):
    """The generate wrapper is an instance attribute: save_pretrained still records the original class
    (a reload works), a deepcopy's and an unpickled model's generate run on themselves, unpatch removes
    it."""
    import io
    import json

    model = build("llama2")
    x = ids(batch=1, seq=6)
    fh.patch(model)
    assert type(model).__name__ == "LlamaForCausalLM"
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    twin = copy.deepcopy(model)
    assert twin.generate.model is twin and model.generate.model is model
    assert torch.equal(generate(twin, x, n=3), generate(model, x, n=3))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert fh.is_patched(loaded) and loaded.generate.model is loaded
    assert torch.equal(generate(loaded, x, n=3), generate(model, x, n=3))
    # and in a process that never patched: the Fusekit classes and the attention implementation come
    # with `import fusekit.hf` (it failed: "Can't get attribute 'FusekitLlamaModel'")
    torch.save(model, tmp_path / "patched.pt")
    want = generate(model, x, n=3)
    code = (
        "import sys, torch; import fusekit.hf as fh\n"
        f"m = torch.load({str(tmp_path / 'patched.pt')!r}, weights_only=False)\n"
        f"x = torch.tensor({x.tolist()})\n"
        "g = m.generate(x, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)\n"
        "assert fh.is_patched(m); print(g.tolist()); fh.unpatch(m)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str(want.tolist())
    fh.unpatch(model)
    assert "generate" not in vars(model)


def test_static_cache_decode_compiles_into_one_graph():
    """The decode step of a patched model traces with fullgraph=True (no graph break, no host sync in
    fusekit's attention path) under transformers' own compiled static-cache generate."""
    from transformers import CompileConfig

    model = build("llama3", num_hidden_layers=1)
    x = ids(batch=1, seq=7)
    ref = generate(model, x, n=4, cache_implementation="static")
    fh.patch(model)
    cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True  # transformers compiles decode on CUDA only unless told
    torch._dynamo.reset()
    try:
        got = generate(model, x, n=4, cache_implementation="static", compile_config=cc)
        assert hasattr(model, "_compiled_call"), "generate did not take the compiled decode path"
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, ref)


def test_sliding_window_refused_unless_allowed_then_fusekit_within_window():
    with pytest.raises(ValueError, match="sliding_window"):
        fh.patch(build("mistral", sliding_window=16))
    model = build("mistral", sliding_window=16)
    short, long = ids(seq=13), ids(seq=24)
    ref_short, ref_long = logits(model, short), logits(model, long)
    fh.patch(model, allow_sliding_window=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the window: fusekit, no fallback
        assert rel_error(logits(model, short), ref_short) <= FP32_TOL
    with pytest.warns(UserWarning, match="sliding window"):
        assert rel_error(logits(model, long), ref_long) <= FP32_TOL
    fh.unpatch(model)
    fh.patch(model, allow_sliding_window=True, strict=True)
    with pytest.raises(ValueError, match="sliding window"):
        logits(model, long)


# --- unsupported -------------------------------------------------------------------------------------
UNSUPPORTED = [
    (
        "rope_yarn",
        "llama2",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        "rope_type: 'linear'",
    ),
    (
        "rope_dynamic",
        "llama2",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        "rope_type: 'dynamic'",
    ),
    ("softcap", "llama2", {"attn_logit_softcapping": 50.0}, "softcapping"),
    ("mlp_bias", "llama2", {"mlp_bias": True}, "mlp_bias"),
    ("dropout", "qwen2", {"attention_dropout": 0.1}, "attention_dropout"),
    ("gelu", "llama2", {"hidden_act": "gelu"}, "hidden_act"),
    (
        "sliding_window",
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        "sliding_window",
    ),
]


@pytest.mark.parametrize("family,kw,match", [u[1:] for u in UNSUPPORTED], ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_config_raises_naming_the_feature_and_leaves_model_alone(family, kw, match):
    model = build(family, **kw)
    types = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=match):
        fh.patch(model)
    assert not fh.is_patched(model) and [type(m) for m in model.modules()] == types
    assert model.config._attn_implementation == "sdpa"


def test_patch_and_unpatch_through_a_torch_compile_wrapper():
    """patch / unpatch / is_patched of torch.compile(model) act on the model inside: unpatch(compiled) used to
    restore the model, then raise AttributeError deleting the record from the wrapper, leaving the model
    unpatched yet is_patched (patch refused it); patch(compiled) skipped the generate / loss wrappers."""
    ref = build("llama2")
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="eager")
    assert fh.patch(compiled) is compiled and fh.is_patched(model) and fh.is_patched(compiled)
    assert {"generate", "forward", "prepare_inputs_for_generation"} <= set(vars(model))
    x = ids(seq=7)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            assert rel_error(compiled(x).logits, ref(x).logits) <= FP32_TOL
        assert fh.unpatch(compiled) is compiled
        assert not fh.is_patched(model) and not fh.is_patched(compiled)
        assert model.config._attn_implementation == "sdpa" and "generate" not in vars(model)
        with torch.no_grad():
            assert torch.equal(compiled(x).logits, ref(x).logits)
        fh.patch(model)  # patchable again
        assert fh.is_patched(compiled)
    finally:
        torch._dynamo.reset()


def test_unsupported_model_type_and_runtime_dropout():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model_type: 'gpt2'"):
        fh.patch(gpt2)
    model = fh.patch(build("llama2"))
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1  # changed after patching
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(ids(seq=5))


def test_rotary_tables_converted_once_per_forward_and_guarded():
    """The patched attention converts HF's [B, S, D] tables to fp32 [B, S, D/2] once per model forward
    (every layer gets the same tuple); a new tuple or an in-place change of the same one converts again."""
    from fusekit.hf import _patch

    g = torch.Generator().manual_seed(0)
    cos, sin = (torch.randn(1, 5, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    pe = (cos, sin)
    c1, s1 = _patch._half_tables(pe, 4)
    c2, s2 = _patch._half_tables(pe, 4)
    assert c1 is c2 and s1 is s2
    assert c1.dtype == torch.float32 and c1.is_contiguous() and torch.equal(c1, cos[..., :4].float())
    cos.mul_(2)  # in place: the version counter moves
    c3, _ = _patch._half_tables(pe, 4)
    assert c3 is not c1 and torch.equal(c3, cos[..., :4].float())
    c4, _ = _patch._half_tables((cos.clone(), sin), 4)  # another forward's tuple
    assert c4 is not c3 and torch.equal(c4, c3)
    c5, _ = _patch._half_tables((cos, sin.clone()), 4)  # the same cos with another sin
    assert c5 is not c3
    # Nothing outlives HF's tables: once they are gone, so are the converted halves (kept on cos).
    ref = weakref.ref(c5)
    del pe, cos, sin, c1, s1, c2, s2, c3, c4, c5, _
    gc.collect()
    assert ref() is None


def test_post_mlp_add_fused_into_the_next_norm_under_no_grad(monkeypatch):
    """Inference: each layer's add after the MLP runs inside the next norm (the next layer's input norm, the
    final norm for the last layer), whose result that norm then finds waiting; with gradients the add stays
    a torch add (a checkpointed layer must not hand the next one a norm computed outside its graph). Both
    give the unpatched model's logits."""
    model = build("llama3")
    x = ids(seq=11)
    ref = logits(model, x)
    fh.patch(model)
    L = model.config.num_hidden_layers
    calls: list[bool] = []
    real = ops.rms_norm

    def counting(*a, **k):
        calls.append(k.get("residual") is not None)
        return real(*a, **k)

    monkeypatch.setattr(ops, "rms_norm", counting)
    fused = logits(model, x)  # no_grad
    assert calls.count(True) == 2 * L and calls.count(False) == 1, calls
    assert rel_error(fused, ref) < FP32_TOL
    calls.clear()
    plain = model(x).logits.float()  # grad mode: the plain add, every norm computes
    assert calls.count(True) == L and calls.count(False) == L + 1, calls
    assert torch.equal(plain.detach(), fused)
    assert "_fusekit_pre" not in model.model.norm.__dict__  # each waiting result is taken once
    sd = set(model.state_dict())
    assert not any("_fusekit" in k for k in sd)  # the links are not submodules
    fh.unpatch(model)
    assert not any("_fusekit" in k for layer in model.model.layers for k in layer.__dict__)
    assert rel_error(logits(model, x), ref) == 0.0


def test_data_edits_and_hooks_never_get_a_stale_fused_norm():
    """A `.data` edit bumps no version: a layer called by hand (layer-by-layer tools) leaves no waiting norm
    result behind, and inside the model a hook of anyone else's on a layer or its next norm turns the fusion
    off there; transformers' own output recorders (output_hidden_states) leave it on."""
    model = build("llama3")
    x = ids(seq=9)
    fh.patch(model)
    layers, final = model.model.layers, model.model.norm
    with torch.no_grad():
        h = model.model.embed_tokens(x)
        pe = model.model.rotary_emb(h, torch.arange(9)[None])
        out = layers[0](h, position_embeddings=pe)
        norm = layers[1].input_layernorm
        norm.weight.data.mul_(3)  # no version bump
        got = norm(out)
        w = norm.weight.float()
        want = (out.float() * torch.rsqrt(out.float().square().mean(-1, keepdim=True) + norm.eps)) * w
        assert rel_error(got, want) <= FP32_TOL
        norm.weight.data.div_(3)
    ref = build("llama3")

    def scaler(norm: nn.Module):  # a hook that edits a model's final norm mid-forward, after the last layer
        def hook(m, a, o) -> None:
            norm.weight.data.mul_(1.5)

        return hook

    hooks = [
        layers[-1].register_forward_hook(scaler(final)),
        ref.model.layers[-1].register_forward_hook(scaler(ref.model.norm)),
    ]
    assert rel_error(logits(model, x), logits(ref, x)) <= FP32_TOL
    for hk in hooks:
        hk.remove()
    calls: list[bool] = []
    real = ops.rms_norm

    def counting(*a, **k):
        calls.append(k.get("residual") is not None)
        return real(*a, **k)

    with torch.no_grad():
        model(x, output_hidden_states=True)  # installs transformers' recorders on the layers
        ops.rms_norm = counting
        try:
            got = model(x, output_hidden_states=True)
        finally:
            ops.rms_norm = real
    assert calls.count(True) == 2 * model.config.num_hidden_layers, calls  # still fused
    with torch.no_grad():
        want = ref(x, output_hidden_states=True)
    assert rel_error(got.logits, want.logits) <= FP32_TOL
    assert all(rel_error(a, b) <= FP32_TOL for a, b in zip(got.hidden_states, want.hidden_states))


def test_decoder_layer_takes_hfs_positional_order():
    """HF 5's layer order (hidden_states, attention_mask, position_ids, past_key_values, use_cache, ...): a
    cache passed positionally fills, as unpatched (it landed in use_cache and was never updated)."""
    from transformers import DynamicCache

    model = build("llama3")
    layer = model.model.layers[0]
    h = torch.randn(1, 6, TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    pos = torch.arange(6)[None]
    pe = model.model.rotary_emb(h, pos)
    outs = []
    for patched in (False, True):
        if patched:
            fh.patch(model)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            outs.append(layer(h, None, pos, cache, position_embeddings=pe))
        assert cache.get_seq_length(0) == 6
    assert rel_error(outs[1], outs[0]) <= FP32_TOL


def test_inference_mode_forward_and_generate():
    """Under torch.inference_mode (serving, evaluation) tensors have no version counter, which the patched
    model's per-forward caches (rotary tables, mask verdicts, the fused next norm) are guarded by: a patched
    model raised 'Inference tensors do not track version counter' there. Logits and greedy tokens as HF's."""
    model = build("llama3").eval()
    x = ids(seq=11)
    with torch.inference_mode():
        ref = model(x).logits
        ref_tokens = model.generate(x, max_new_tokens=6, do_sample=False)
    fh.patch(model)
    with torch.inference_mode():
        got = model(x).logits
        tokens = model.generate(x, max_new_tokens=6, do_sample=False)
    assert rel_error(got, ref) <= FP32_TOL
    assert torch.equal(tokens, ref_tokens)
    fh.unpatch(model)


def test_next_layer_loaded_by_its_own_hook_is_not_fused_into():
    """accelerate's device_map / offload: a layer's weights arrive on its device only in its own pre-forward
    hook (emulated: layer 1's input norm weight lives on "meta" outside layer 1's forward). Layer 0 must not
    call that norm early; logits as HF's under the same hooks."""
    model = build("llama3", num_hidden_layers=2)
    x = ids(seq=9)

    def offloaded(m):
        layer1 = m.model.layers[1]
        norm = layer1.input_layernorm
        real = norm.weight.detach().clone()
        norm.weight = nn.Parameter(torch.empty_like(real, device="meta"), requires_grad=False)

        def load(mod, args, kwargs):
            norm.weight = nn.Parameter(real.clone(), requires_grad=False)

        def unload(mod, args, kwargs, out):
            norm.weight = nn.Parameter(torch.empty_like(real, device="meta"), requires_grad=False)

        return [layer1.register_forward_pre_hook(load, with_kwargs=True),
                layer1.register_forward_hook(unload, with_kwargs=True)]  # fmt: skip

    hooks = offloaded(model)
    ref = logits(model, x)
    for h in hooks:
        h.remove()
    model = build("llama3", num_hidden_layers=2)
    fh.patch(model)
    hooks = offloaded(model)
    got = logits(model, x)  # no_grad: where the fusion would run
    assert rel_error(got, ref) <= FP32_TOL


def test_hooks_on_a_norm_run_once_with_its_own_input_and_output():
    """A forward hook on a layer's input norm (activation capture, steering) sees that norm's input and output
    once per forward, as without the fusion, and what it returns is what the layer uses."""
    seen: dict[bool, list] = {}

    def run(patched: bool) -> torch.Tensor:
        model = build("llama3", num_hidden_layers=2)
        if patched:
            fh.patch(model)
        calls = seen[patched] = []

        def hook(mod, args, out):
            calls.append((type(out).__name__, tuple(args[0].shape)))
            return out * 2.0

        model.model.layers[1].input_layernorm.register_forward_hook(hook)
        return logits(model, ids(seq=7))

    ref, got = run(False), run(True)
    assert seen[True] == seen[False] == [("Tensor", (2, 7, 64))], seen
    assert rel_error(got, ref) <= FP32_TOL


@pytest.mark.parametrize("grad", [False, True])
def test_hooks_on_the_post_attention_norm_see_hfs_call(grad):
    """The post-attention norm runs fused with the residual add (norm(hidden, residual=...) -> (y, h)); a hook
    on it must still see HF's call, norm(h) -> y, and what it returns is what the MLP gets; gradients too."""
    seen: dict[bool, list] = {}

    def run(patched: bool):
        model = build("llama3", num_hidden_layers=2)
        if patched:
            fh.patch(model)
        calls = seen[patched] = []

        def hook(mod, args, out):
            calls.append((len(args), type(out).__name__))
            return out * 2.0

        model.model.layers[0].post_attention_layernorm.register_forward_hook(hook)
        x = ids(seq=7)
        if not grad:
            return logits(model, x), None
        return None, _grads(model, x)

    (ref, ref_g), (got, got_g) = run(False), run(True)
    assert seen[True] == seen[False] == [(1, "Tensor")], seen
    if grad:
        assert got_g.keys() == ref_g.keys()
        worst = max((rel_error(got_g[n], ref_g[n]), n) for n in ref_g)
        assert worst[0] <= GRAD_TOL, worst
    else:
        assert rel_error(got, ref) <= FP32_TOL


def test_a_norm_weight_edited_between_layers_is_used():
    """Layer-by-layer tools (AWQ folds scales into the next norm's weight) run layer 0, edit layer 1's input
    norm weight in place or replace it, then run layer 1 on layer 0's output: layer 1 must normalize with the
    edited weight, not return what layer 0 computed with the old one."""
    model = build("llama3", num_hidden_layers=2)
    fh.patch(model)
    x = ids(seq=7)
    layers, norm = model.model.layers, model.model.layers[1].input_layernorm
    with torch.no_grad():
        h0 = model.model.embed_tokens(x)
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        emb = model.model.rotary_emb(h0, pos)
        for edit in ("in place", "replaced"):
            h1 = layers[0](h0, position_embeddings=emb, position_ids=pos)
            h1 = h1[0] if isinstance(h1, tuple) else h1
            if edit == "in place":
                norm.weight.mul_(1.5)
            else:
                norm.weight = nn.Parameter(norm.weight * 0.5)
            got = norm(h1)
            want = fnn.RMSNorm.forward(norm, h1)  # computed afresh, past the waiting-result check
            assert rel_error(got, want) <= FP32_TOL, edit


def test_a_changed_layer_output_is_normalized_again():
    """The waiting norm result is used only for the very tensor the layer returned, unchanged: a forward
    hook that edits it in place (version bump) or replaces it makes the next norm compute again."""
    model = build("llama2")
    x = ids(seq=7)
    fh.patch(model)
    layer0 = model.model.layers[0]

    def bump(_mod, _inp, out):
        out.add_(0.5)  # in place: same object, new version (a scale alone would not change its norm)

    h = layer0.register_forward_hook(bump)
    edited = logits(model, x)
    h.remove()
    fh.unpatch(model)
    h = layer0.register_forward_hook(bump)
    ref = logits(model, x)
    h.remove()
    assert rel_error(edited, ref) < FP32_TOL


def test_autocast_training_step_follows_hf_autocast(monkeypatch) -> None:
    """An fp32 model trained under bf16 autocast (torch AMP): the patched model's matrix ops take bf16
    inputs as HF's nn.Linear / SDPA do there (fusekit.ops._amp), the fp32 residual stream meets the bf16
    sublayer outputs in the fused norm as HF's add does (promoted), and the loss and every fp32 gradient
    match the unpatched model's under the same autocast to bf16 accuracy."""
    from fusekit.ops import _amp

    cast_calls = []
    lower = _amp.lower

    def spy(*ts):
        out = lower(*ts)
        cast_calls.append(None if out is None else out[0].dtype)
        return out

    x = ids()
    runs = {}
    for name in ("hf", "fusekit"):
        model = build("llama3").train()
        if name != "hf":
            fh.patch(model, backend="auto")
            monkeypatch.setattr(_amp, "lower", spy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None and g.dtype == torch.float32 for g in grads.values())
        runs[name] = (loss.detach(), grads)
    # 2 layers x (attention, swiglu_ffn) + the fused loss (cast by the patch, which picks its backend for the
    # cast dtypes, then seen already cast by the op): every matrix op saw bf16 inputs
    assert cast_calls == [torch.bfloat16] * 6
    (l_hf, g_hf), (l_fk, g_fk) = runs["hf"], runs["fusekit"]
    assert rel_error(l_fk, l_hf) < 1e-2
    worst = max(rel_error(g_fk[n], g_hf[n]) for n in g_hf)
    assert worst < 6e-2


def test_qwen3_per_head_qk_norms_run_on_fusekit(monkeypatch) -> None:
    """Qwen3's q_norm / k_norm (an RMSNorm over each head's D) become fusekit RMSNorms that the patched
    attention applies before the rope: 2 layers x (input, q, k, post-attention) + the final norm."""
    model = build("qwen3")
    fh.patch(model)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_norm, fnn.RMSNorm) and isinstance(attn.k_norm, fnn.RMSNorm)
    calls = []
    real = ops.rms_norm

    def spy(x, *a, **k):
        calls.append(tuple(x.shape))
        return real(x, *a, **k)

    monkeypatch.setattr(ops, "rms_norm", spy)
    model.train()  # no next-norm fusion with gradients: every norm is its own call
    model(ids(seq=9), labels=ids(seq=9)).loss.backward()
    head_dim = model.config.head_dim or TINY["hidden_size"] // TINY["num_attention_heads"]
    per_head = [c for c in calls if c[-1] == head_dim and len(c) == 4]
    assert len(per_head) == 4 and len(calls) == 2 * 4 + 1
