"""bench.e2e's models and setup: the Llama configs it builds (seeded random weights, no download), the
run's Setup, shape parsing, the results file name, and building a fresh model from one state_dict."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from torch import nn

SCHEMA = "fusekit-bench-e2e/1"
FILE = "e2e.json"
PROVIDERS = (
    "eager",
    "compile",
    "fusekit-triton",
    "fusekit-triton-compile",
    "fusekit-torch",
    "liger",
    "fusekit-mojo",
)
# mojo last: once MAX has run on a GPU its allocator keeps most of the memory (run_gpu.sh); liger before
# it, and its global patches are undone after its rows.
SCENARIOS = ("prefill", "decode", "train")
BUDGET_SKIP = "--budget-s reached before it started"  # a row's reason when the run's time ran out
BASELINES = ("eager", "compile")
FP32_LOGITS_RTOL = 1e-4  # relative 2-norm of the logits against HF eager, fp32
LOW_PRECISION_SLACK = 5e-3  # bf16/fp16: error vs the fp32 model <= 2x HF eager's own + this
# The training gate: each parameter's gradient of one step's loss, relative 2-norm. fp32: against HF eager's
# (kernels that reorder fp32 sums differ by ~1e-6; a wrong or detached term by O(1)). bf16/fp16: against
# the fp32 model's, within 2x HF eager's own error + this slack (gradients round more than logits do).
FP32_GRAD_RTOL = 1e-3
LOW_PRECISION_GRAD_SLACK = 2e-2

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
MODELS: dict[str, dict] = {
    "llama3-8b": {
        "config": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters=LLAMA3_ROPE,
            tie_word_embeddings=False,
        ),
        "layers": 4,
        "prefill": "1x2048,8x512",
        "decode": "1x512+128,1x2048+128,32x2048+128",
        "train": "1x2048",
    },
    # Llama-3.2-1B: every layer (1.24 B parameters, tied embeddings), head dim 64, llama3 rope factor 32
    "llama3.2-1b": {
        "config": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={**LLAMA3_ROPE, "factor": 32.0},
            tie_word_embeddings=True,
        ),
        "layers": 16,
        "prefill": "1x2048,8x512",
        "decode": "1x2048+128,32x2048+128",
        "train": "1x2048",
    },
    "tiny": {
        # head_dim 64 (not hidden/heads = 16): the Triton and Mojo attention kernels take 64/128/256 only
        "config": dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=256,
            max_position_embeddings=256,
            rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 16},
            tie_word_embeddings=False,
        ),
        "layers": 2,
        "prefill": "1x16",
        "decode": "1x8+8,2x8+4",
        "train": "1x16",
    },
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --- setup -------------------------------------------------------------------------------------------
@dataclass
class Setup:
    """Everything that makes two runs comparable (a --merge refuses files whose setup differs)."""

    device: str
    model: str
    layers: int
    dtype: str
    attn_implementation: str
    prefill: list[tuple[int, int]]
    decode: list[tuple[int, int, int]]  # (batch, prompt, new tokens) per case; the first is the gate's
    train: list[tuple[int, int]]
    seed: int
    config: dict = field(default_factory=dict)
    # The training step's AdamW: "foreach" (torch's default, what every committed e2e.json so far used) or
    # "fused" (AdamW(fused=True): transformers' TrainingArguments default, optim="adamw_torch_fused").
    optim: str = "foreach"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        b, sq = part.lower().split("x")
        out.append((int(b), int(sq)))
    return out


def _decode_shapes(s: str) -> list[tuple[int, int, int]]:
    """ "1x2048+128,32x2048+128" -> [(1, 2048, 128), (32, 2048, 128)]."""
    out = []
    for part in s.split(","):
        bs, n = part.split("+")
        (b, p) = _shapes(bs)[0]
        out.append((b, p, int(n)))
    return out


def file_name(model: str, layers: int | None = None, train: str | None = None) -> str:
    """e2e.json for the default GPU model (llama3-8b) and the tiny one, e2e-<model>.json for others;
    a layer count other than the model's default adds -<layers>l (the whole Llama-3-8B: e2e-llama3-8b-32l),
    training shapes (--train) other than the model's default add -train<shapes> (e2e-llama3.2-1b-train4x2048):
    a file holds one setup, so such a run cannot merge into the default file."""
    stem = f"e2e-{model}"
    if layers is not None and layers != MODELS[model]["layers"]:
        stem += f"-{layers}l"
    if train is not None and _shapes(train) != _shapes(MODELS[model]["train"]):
        stem += "-train" + "_".join(f"{b}x{s}" for b, s in _shapes(train))
    return FILE if stem in ("e2e-llama3-8b", "e2e-tiny") else f"{stem}.json"


def _label(b: int, s: int, n: int | None = None) -> str:
    return f"{b}x{s}" if n is None else f"{b}x{s}+{n}"


def _config(setup: Setup):
    from transformers import LlamaConfig

    return LlamaConfig(**MODELS[setup.model]["config"], num_hidden_layers=setup.layers, attention_dropout=0.0)


def _new_model(setup: Setup, dtype: torch.dtype | None = None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device(setup.torch_device):  # built in place: a 2B-parameter init on the host is slow
        model = AutoModelForCausalLM.from_config(
            _config(setup),
            dtype=dtype or setup.torch_dtype,
            attn_implementation=setup.attn_implementation,
        )
    return model.to(setup.torch_device).eval()


def base_weights(setup: Setup) -> dict[str, torch.Tensor]:
    """The seeded random weights every provider's model loads, kept on the host. Norm weights around 1
    and projections with std ~1.2/sqrt(hidden), so activations and logits are far from trivial."""
    model = _new_model(setup)
    std = min(0.15, 1.2 / MODELS[setup.model]["config"]["hidden_size"] ** 0.5)
    torch.manual_seed(setup.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if setup.torch_device.type == "cuda":
        state = {k: v.pin_memory() for k, v in state.items()}
    del model
    _free()
    return state


def fresh_model(setup: Setup, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> nn.Module:
    model = _new_model(setup, dtype)
    dt = dtype or setup.torch_dtype
    model.load_state_dict({k: v.to(dt) if v.is_floating_point() else v for k, v in state.items()})
    return model


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ids(setup: Setup, b: int, s: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(setup.seed * 1000 + salt)
    vocab = MODELS[setup.model]["config"]["vocab_size"]
    # from 1: generate() runs with pad_token_id=0 and would read a prompt holding token 0 as padded
    # (transformers infers a padding mask from pad tokens), a different path from an unpadded prompt
    return torch.randint(1, vocab, (b, s), generator=g).to(setup.torch_device)


def _generate(model: nn.Module, ids: torch.Tensor, n: int, **kw) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖, norms accumulated in float64 (without a float64 copy of 1 GB logits); NaN stays NaN."""
    o, r = out.float(), ref.float()
    num = torch.linalg.vector_norm(o - r, dtype=torch.float64)
    return float(num / torch.linalg.vector_norm(r, dtype=torch.float64).clamp_min(1e-300))
