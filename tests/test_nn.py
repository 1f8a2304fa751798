"""fusekit.nn modules against the torch.nn / Hugging Face modules they replace: state_dict round trips,
outputs and gradients (fp32 tight, bf16/fp16 at the contract's tolerances), and the clear errors.

CPU, backend "auto" (torch on the CPU). HF modules come from transformers (test extra).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusekit import nn as fnn
from fusekit.tolerances import RTOL
from tests.checks import assert_close

TOL = RTOL  # fusekit.tolerances: the one table
GRAD_TOL = {d: 2 * t for d, t in TOL.items()}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _hf_llama():
    return pytest.importorskip("transformers.models.llama.modeling_llama")


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=128,
    )
    return LlamaConfig(**{**base, **kw})


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, then d x and d every parameter for loss = <module(x), dy>."""
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad()
    y = module(x)
    (y.float() * dy).sum().backward()
    out = {"y": y.detach(), "x.grad": x.grad}
    out.update({f"{n}.grad": p.grad for n, p in module.named_parameters()})
    return out


def _compare(name: str, got: dict, want: dict, dtype: torch.dtype, repro: str) -> None:
    assert got.keys() == want.keys(), f"{name}: {sorted(got)} vs {sorted(want)}"
    for k in want:
        tol = TOL[dtype] if k == "y" else GRAD_TOL[dtype]
        assert_close(f"{name} {k}", got[k], want[k], tol, repro)


# --- RMSNorm -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_torch_state_dict_round_trip_and_outputs(dtype):
    torch.manual_seed(0)
    ref = nn.RMSNorm(37, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(37))
    ours = fnn.RMSNorm(37, eps=1e-5, dtype=dtype)
    ours.load_state_dict(ref.state_dict())  # strict: the same keys
    back = nn.RMSNorm(37, eps=1e-5, dtype=dtype)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.weight, ref.weight)
    x, dy = torch.randn(3, 9, 37, dtype=dtype), torch.randn(3, 9, 37)
    _compare("RMSNorm vs nn.RMSNorm", _grads(ours, x, dy), _grads(ref, x, dy), dtype, f"{dtype} [3,9,37]")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_eps_none_and_no_affine_match_torch(dtype):
    """eps=None is the eps of the computation dtype (fp32 for 16-bit x, not bf16's 7.8e-3), as torch's."""
    torch.manual_seed(1)
    x = (torch.randn(5, 33) * (1e-3 if dtype == torch.float32 else 0.05)).to(dtype)  # small: eps matters
    for kw in ({"eps": None}, {"eps": 1e-4, "elementwise_affine": False}):
        ref, ours = nn.RMSNorm(33, **kw, dtype=dtype), fnn.RMSNorm(33, **kw, dtype=dtype)
        assert ours.state_dict().keys() == ref.state_dict().keys()
        assert_close(f"RMSNorm {kw}", ours(x), ref(x), TOL[dtype], f"{kw} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf_llama_rms_norm(dtype):
    L = _hf_llama()
    torch.manual_seed(2)
    hf = L.LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
    ours = fnn.RMSNorm(64, eps=1e-5, casting="llama", dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    assert ours.variance_epsilon == hf.variance_epsilon
    x, dy = torch.randn(4, 7, 64, dtype=dtype), torch.randn(4, 7, 64)
    _compare("RMSNorm(llama) vs LlamaRMSNorm", _grads(ours, x, dy), _grads(hf, x, dy), dtype, str(dtype))
    # from_module shares the Parameter and picks the llama casting for an HF norm
    wrapped = fnn.RMSNorm.from_module(hf)
    assert wrapped.weight is hf.weight and wrapped.casting == "llama" and wrapped.eps == 1e-5


def test_rms_norm_from_module_takes_the_math_the_module_runs():
    """Gemma-style norms (x * (1 + w), `eps` attribute) were wrapped with casting "fp32" (x * w: 91-99% off)
    and Cohere's mean-subtracting norm (it has `variance_epsilon`) as a Llama RMSNorm (62% off). The casting
    now follows the module's forward; an unknown forward needs an explicit casting."""
    import importlib

    torch.manual_seed(4)
    x = torch.randn(3, 5, 32)

    def hf(family: str, name: str, **kw) -> nn.Module:
        cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
        m = cls(32, eps=1e-6, **kw)
        with torch.no_grad():
            m.weight.copy_(torch.randn(32) * 0.5)
        return m

    for family, name, casting in (
        ("gemma", "GemmaRMSNorm", "gemma"),
        ("gemma3", "Gemma3RMSNorm", "gemma"),
        ("qwen3", "Qwen3RMSNorm", "llama"),
        ("mistral", "MistralRMSNorm", "llama"),
    ):
        m = hf(family, name)
        ours = fnn.RMSNorm.from_module(m)
        assert ours.casting == casting, name
        assert_close(f"from_module({name})", ours(x), m(x), TOL[torch.float32], name)
    assert fnn.RMSNorm.from_module(nn.RMSNorm(32)).casting == "fp32"
    cohere = hf("cohere", "CohereLayerNorm", bias=False)
    with pytest.raises(ValueError, match=r"^casting: CohereLayerNorm is neither torch.nn.RMSNorm nor"):
        fnn.RMSNorm.from_module(cohere)
    with pytest.raises(TypeError, match=r"^module: CohereLayerNorm does not run torch.nn.LayerNorm"):
        fnn.LayerNorm.from_module(cohere)


def test_swiglu_mlp_from_module_refuses_other_forwards():
    """An MLP with LlamaMLP's Linears and SiLU but more math in its forward (FalconH1's multipliers, a clamp)
    was wrapped as down(silu(gate(x)) * up(x)) and the extra math dropped; HF's copies of LlamaMLP wrap."""
    L = _hf_llama()
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    class Scaled(L.LlamaMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)

    cfg = _llama_config()
    with pytest.raises(ValueError, match=r"^module: Scaled.forward is not LlamaMLP's"):
        fnn.SwiGLUMLP.from_module(Scaled(cfg))
    torch.manual_seed(5)
    m = Qwen2MLP(cfg)
    x = torch.randn(2, 3, 64)
    assert_close("from_module(Qwen2MLP)", fnn.SwiGLUMLP.from_module(m)(x), m(x), TOL[torch.float32], "qwen2")


def test_rms_norm_fused_residual_and_mixed_precision_weight():
    torch.manual_seed(3)
    x, r = torch.randn(6, 64, dtype=torch.bfloat16), torch.randn(6, 64, dtype=torch.bfloat16)
    norm = fnn.RMSNorm(64, eps=1e-6)  # fp32 weight, bf16 activations
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    y, h = norm(x, residual=r)
    h_ref = (x.float() + r.float()).bfloat16()
    assert torch.equal(h, h_ref)
    hf64 = h_ref.double()
    y_ref = hf64 * (hf64.square().mean(-1, keepdim=True) + 1e-6).rsqrt() * norm.weight.double()
    assert y.dtype == torch.bfloat16
    assert_close("RMSNorm residual y", y, y_ref, TOL[torch.bfloat16], "bf16 x, fp32 w")


def test_rms_norm_errors_name_the_argument():
    with pytest.raises(ValueError, match="normalized_shape"):
        fnn.RMSNorm((4, 8))
    with pytest.raises(ValueError, match="casting"):
        fnn.RMSNorm(8, casting="t5")
    with pytest.raises(ValueError, match="x: the last dimension"):
        fnn.RMSNorm(8)(torch.randn(2, 9))


# --- LayerNorm ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kw", [{}, {"bias": False}, {"elementwise_affine": False}], ids=["affine", "nobias", "none"]
)
def test_layer_norm_matches_torch(dtype, kw):
    torch.manual_seed(4)
    ref = nn.LayerNorm(53, eps=1e-5, dtype=dtype, **kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    ours = fnn.LayerNorm(53, eps=1e-5, dtype=dtype, **kw)
    ours.load_state_dict(ref.state_dict())
    back = nn.LayerNorm(53, eps=1e-5, dtype=dtype, **kw)
    back.load_state_dict(ours.state_dict())
    x, dy = torch.randn(2, 9, 53, dtype=dtype) + 0.5, torch.randn(2, 9, 53)
    _compare("LayerNorm vs nn.LayerNorm", _grads(ours, x, dy), _grads(ref, x, dy), dtype, f"{dtype} {kw}")
    wrapped = fnn.LayerNorm.from_module(ref)
    assert wrapped.weight is ref.weight and wrapped.bias is ref.bias
    assert_close("LayerNorm.from_module", wrapped(x), ref(x), TOL[dtype], str(kw))


def test_layer_norm_fused_residual_and_errors():
    torch.manual_seed(5)
    ln = nn.LayerNorm(40)
    ours = fnn.LayerNorm.from_module(ln)
    x, r = torch.randn(3, 40), torch.randn(3, 40)
    y, h = ours(x, residual=r)
    assert_close("LayerNorm residual h", h, x + r, TOL[torch.float32], "fp32")
    assert_close("LayerNorm residual y", y, ln(x + r), TOL[torch.float32], "fp32")
    with pytest.raises(ValueError, match="normalized_shape"):
        fnn.LayerNorm([4, 10])


# --- SwiGLUMLP ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_mlp_matches_hf_llama_mlp(dtype):
    L = _hf_llama()
    torch.manual_seed(6)
    hf = L.LlamaMLP(_llama_config(hidden_size=48, intermediate_size=80)).to(dtype)
    ours = fnn.SwiGLUMLP(48, 80, dtype=dtype)
    ours.load_state_dict(hf.state_dict())
    back = L.LlamaMLP(_llama_config(hidden_size=48, intermediate_size=80)).to(dtype)
    back.load_state_dict(ours.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), hf.state_dict().values()))
    x, dy = torch.randn(2, 7, 48, dtype=dtype), torch.randn(2, 7, 48)
    _compare("SwiGLUMLP vs LlamaMLP", _grads(ours, x, dy), _grads(hf, x, dy), dtype, str(dtype))
    wrapped = fnn.SwiGLUMLP.from_module(hf)
    assert wrapped.gate_proj is hf.gate_proj and wrapped.down_proj is hf.down_proj


class _LoRA(nn.Module):
    """As peft's lora.Linear: the base Linear wrapped, B(A(x)) added; `weight` is the base layer's."""

    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


@pytest.mark.parametrize("proj", ["gate_proj", "up_proj", "down_proj"])
def test_swiglu_mlp_runs_an_adapter_put_on_a_projection(proj):
    """peft's get_peft_model after fusekit.hf.patch replaces the MLP's Linear modules with LoRA layers: the
    adapter's output and gradients must count (the fused op saw only the base weight and dropped them)."""
    L = _hf_llama()
    torch.manual_seed(7)
    hf = L.LlamaMLP(_llama_config(hidden_size=48, intermediate_size=80))
    ours = fnn.SwiGLUMLP.from_module(hf)
    x, dy = torch.randn(2, 5, 48), torch.randn(2, 5, 48)
    fused = ours(x)
    setattr(hf, proj, _LoRA(getattr(hf, proj)))
    setattr(ours, proj, getattr(hf, proj))  # the same adapter module in both
    got, want = _grads(ours, x, dy), _grads(hf, x, dy)
    assert not torch.allclose(got["y"], fused), "the adapter changed nothing: the test cannot tell"
    _compare("SwiGLUMLP with a LoRA projection vs LlamaMLP", got, want, torch.float32, proj)
    assert any(k.endswith("lora_A.weight.grad") for k in got), sorted(got)


def test_swiglu_mlp_runs_hooks_on_its_projections():
    """A forward hook on a projection (activation capture, AWQ/GPTQ calibration) fires with the projection's
    input and output, and what it returns is used, as in LlamaMLP (the fused op never called the modules)."""
    L = _hf_llama()
    torch.manual_seed(8)
    hf = L.LlamaMLP(_llama_config(hidden_size=48, intermediate_size=80))
    ours = fnn.SwiGLUMLP.from_module(hf)
    x, dy = torch.randn(2, 5, 48), torch.randn(2, 5, 48)
    seen = []

    def hook(mod, args, out):
        seen.append((tuple(args[0].shape), tuple(out.shape)))
        return out * 0.5

    handle = hf.up_proj.register_forward_hook(hook)  # the same Linear module in both
    want = _grads(hf, x, dy)
    got = _grads(ours, x, dy)
    handle.remove()
    assert seen == [((2, 5, 48), (2, 5, 80))] * 2, seen
    _compare("SwiGLUMLP with a hooked projection vs LlamaMLP", got, want, torch.float32, "hook")


def test_swiglu_mlp_errors_name_the_feature():
    L = _hf_llama()
    with pytest.raises(ValueError, match="bias"):
        fnn.SwiGLUMLP(16, 32, bias=True)
    with pytest.raises(ValueError, match="mlp bias"):
        fnn.SwiGLUMLP.from_module(L.LlamaMLP(_llama_config(mlp_bias=True)))
    with pytest.raises(ValueError, match="hidden_act"):
        fnn.SwiGLUMLP.from_module(L.LlamaMLP(_llama_config(hidden_act="gelu")))


# --- rotary ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_rotary_tables_equal_hf_and_rotation_matches(rope):
    L = _hf_llama()
    torch.manual_seed(7)
    cfg = _llama_config(**({"rope_parameters": dict(rope)} if rope else {}))
    hf = L.LlamaRotaryEmbedding(cfg)
    ours = fnn.RotaryEmbedding.from_config(cfg)
    assert ours.rope_type == (rope["rope_type"] if rope else "default")
    assert torch.equal(ours.inv_freq, hf.inv_freq), "inv_freq differs from transformers'"
    pos = torch.tensor([[0, 1, 2, 3, 40, 41, 1000], [5, 6, 7, 8, 9, 10, 11]])  # per-row positions
    q, k = torch.randn(2, 7, 4, 16), torch.randn(2, 7, 2, 16)
    cos, sin = hf(q, pos)  # [B, S, D], duplicated halves
    tc, ts = ours.tables(pos)
    assert torch.equal(tc, cos[..., :8]) and torch.equal(ts, sin[..., :8])
    q_ref, k_ref = L.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    q_out, k_out = ours(q, k, position_ids=pos)
    assert_close("rope q", q_out, q_ref.transpose(1, 2), 2e-4, str(rope))
    assert_close("rope k", k_out, k_ref.transpose(1, 2), 2e-4, str(rope))
    # start_pos: the same as position_ids = start_pos + arange(S) for every row
    a = ours(q, start_pos=40)
    b = ours(q, position_ids=torch.arange(40, 47))
    assert torch.equal(a, b)
    # position_ids of another length than q's S (or another batch) is a caller's bug: it raised nothing and
    # used the first S positions
    for bad in (
        torch.arange(9),
        torch.arange(9)[None],
        torch.arange(14).view(2, 7)[:, None],
        pos.repeat(3, 1),
    ):
        with pytest.raises(ValueError, match=r"^position_ids: expected"):
            ours(q, position_ids=bad)


def test_rotary_grad_and_dtypes():
    torch.manual_seed(8)
    rope = fnn.RotaryEmbedding(32, theta=10000.0)
    q = torch.randn(2, 5, 3, 32, requires_grad=True)
    y = rope(q, start_pos=3)
    dy = torch.randn_like(y)
    y.backward(dy)
    # float64 reference: HF's q * cos + rotate_half(q) * sin at positions 3..7, through autograd
    ang = torch.arange(3, 8, dtype=torch.float64)[:, None] * rope.inv_freq.double()[None, :]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]
    q64 = q.detach().double().requires_grad_(True)
    y64 = q64 * cos + torch.cat((-q64[..., 16:], q64[..., :16]), -1) * sin
    y64.backward(dy.double())
    assert_close("rope y", y, y64, 2e-4, "fp32")
    assert_close("rope dq", q.grad, q64.grad, 2e-4, "fp32")
    for dt in (torch.bfloat16, torch.float16):
        out = rope(q.detach().to(dt), start_pos=3)
        assert out.dtype == dt
        assert_close(f"rope {dt}", out, y.detach(), TOL[dt], str(dt))


def test_rotary_keeps_fp32_frequencies_through_dtype_conversions():
    """model.to(bf16) / .half() / .double() cast the inv_freq buffer: rounded to bf16 the angles at
    position 4000 moved q by up to 1.5. The frequencies stay fp32 (moved with the module)."""
    torch.manual_seed(9)
    ref = fnn.RotaryEmbedding(64, theta=500000.0, backend="torch")
    q = torch.randn(1, 3, 2, 64)
    pos = torch.tensor([4000, 4001, 4002])
    want = ref(q, position_ids=pos)
    for conv in (
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.double(),
        lambda m: m.float(),
    ):
        m = conv(fnn.RotaryEmbedding(64, theta=500000.0, backend="torch"))
        assert m.inv_freq.dtype == torch.float32 and torch.equal(m.inv_freq, ref.inv_freq)
        assert torch.equal(m(q, position_ids=pos), want)


def test_rotary_unknown_type_names_it():
    with pytest.raises(ValueError, match="rope_type: 'yarn'"):
        fnn.RotaryEmbedding(16, rope_type="yarn")
    with pytest.raises(ValueError, match="low_freq_factor"):
        fnn.RotaryEmbedding(
            16, rope_type="llama3", factor=8.0, high_freq_factor=4.0, original_max_position_embeddings=8
        )
    pytest.importorskip("transformers")
    cfg = _llama_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type: 'dynamic'"):
        fnn.RotaryEmbedding.from_config(cfg)


# --- attention core ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,skv", [(9, 9), (1, 13), (4, 13)], ids=["prefill", "decode", "chunk"])
def test_attention_core_matches_sdpa(dtype, s, skv):
    torch.manual_seed(9)
    q = torch.randn(2, 4, s, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, skv, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, skv, 16, dtype=dtype, requires_grad=True)
    # bottom-right causal: query i sees key j <= i + skv - s
    mask = torch.arange(skv)[None, :] <= torch.arange(s)[:, None] + (skv - s)
    want = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=mask, enable_gqa=True)
    dy = torch.randn_like(want)
    got = fnn.Attention(causal=True)(q, k, v)
    assert got.dtype == dtype
    assert_close("Attention", got, want, TOL[dtype], f"{dtype} S={s} Skv={skv}")
    gq, gk, gv = torch.autograd.grad((got.double() * dy).sum(), (q, k, v))
    wq, wk, wv = torch.autograd.grad((want * dy).sum(), (q, k, v))
    for n, g, w in (("dq", gq, wq), ("dk", gk, wk), ("dv", gv, wv)):
        assert_close(f"Attention {n}", g, w, GRAD_TOL[dtype], f"{dtype} S={s} Skv={skv}")
    full = fnn.Attention(causal=True)(q, k, v, causal=False)
    want_full = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), enable_gqa=True)
    assert_close("Attention causal=False", full, want_full, TOL[dtype], f"{dtype} S={s} Skv={skv}")


def test_from_module_of_a_parametrized_norm_names_the_parametrization():
    """A parametrized weight (torch.nn.utils.parametrize) is a computed tensor, not a Parameter to share:
    from_module raised torch's TypeError "cannot assign ... as parameter 'weight'", which said nothing of
    why; it now names the parametrization and what to do."""
    from torch.nn.utils import parametrize

    class Scale(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    for module, cls in ((torch.nn.RMSNorm(8), fnn.RMSNorm), (torch.nn.LayerNorm(8), fnn.LayerNorm)):
        parametrize.register_parametrization(module, "weight", Scale())
        with pytest.raises(ValueError, match="weight is parametrized"):
            cls.from_module(module)
