"""`python -m fusekit.bench.e2e`: end-to-end benchmark of a Hugging Face Llama model, per provider.

    python -m fusekit.bench.e2e [--device cuda|cpu] [--model llama3-8b|llama3.2-1b|tiny] [--layers N]
                                [--providers eager,compile,fusekit-triton,fusekit-triton-compile,...]
                                [--scenarios prefill,decode,train] [--quick] [--out DIR] [--merge]
                                [--prefill 1x2048,8x512] [--decode 1x512+128] [--train 1x2048] [--optim fused]
                                [--warmup N] [--reps N] [--budget-s S] [--dtype bf16|fp16|fp32]

The model is built from a transformers config class with seeded random weights (no download):
"llama3-8b" has Llama-3-8B's shapes with few layers (default 4; bf16, for the GPU), "llama3.2-1b" is
Llama-3.2-1B whole (16 layers, tied embeddings, head dim 64; bf16, for the GPU), "tiny" is hidden 64,
2 layers, 4 heads of dim 64, 2 kv heads, vocab 256 (fp32, for the CPU and the tests). Every provider
gets a fresh model with the same weights (one state_dict, loaded into each):

  eager           transformers as is (attn_implementation "sdpa", its default; --attn eager for the other)
  compile         torch.compile(model, dynamic=False) for prefill and training; decode is
                  generate(cache_implementation="static"), which transformers compiles itself on CUDA
  fusekit-<name>  fusekit.hf.patch(model, backend=<name>, strict=True) for triton, torch and mojo
                  (strict: a call fusekit cannot run raises instead of falling back to sdpa)
  fusekit-<name>-compile  the same patch, then what "compile" does: torch.compile for prefill and
                  training, static-cache generate (compiled by transformers, CUDA graphs) for decode;
                  fusekit's ops are custom ops inside those graphs
  liger           liger_kernel.transformers.apply_liger_kernel_to_llama(model=model) (its defaults: rope,
                  rms_norm, swiglu, fused linear cross entropy); its module-level patches are undone after

Scenarios: prefill (one forward of B x S tokens, full logits, no cache), decode (greedy generate of N
new tokens after a prompt; rate = B·(N−1) / (t(N) − t(1)), t(n) the time of generate with n new
tokens: the first new token comes out of the prefill), train (forward with labels, the model's own
cross entropy, backward, AdamW step). Before any timing each provider passes a correctness gate
against HF eager on the prefill batch (logits) and the decode prompt (greedy tokens); one that fails is
recorded "wrong" and not timed. fusekit providers also prove their kernels ran: the gate counts the
calls that reached the backend (rms_norm 2L+1, swiglu_ffn L, rope L (q and k in one call), attention L per forward).

Times are host wall-clock with a device sync around each call (what a serving or training loop sees),
median of --reps after --warmup. Results: <out>/<device slug>/e2e.json (e2e-<model>.json for
llama3.2-1b; GPU default
benchmarks/results, CPU build/bench/results), schema "fusekit-bench-e2e/1" (the op report skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from fusekit.bench import results

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


def file_name(model: str, layers: int | None = None) -> str:
    """e2e.json for the default GPU model (llama3-8b) and the tiny one, e2e-<model>.json for others;
    a layer count other than the model's default adds -<layers>l (the whole Llama-3-8B: e2e-llama3-8b-32l)."""
    if layers is not None and layers != MODELS[model]["layers"]:
        return f"e2e-{model}-{layers}l.json"
    return FILE if model in ("llama3-8b", "tiny") else f"e2e-{model}.json"


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


# --- providers ---------------------------------------------------------------------------------------
class Provider:
    """One way of running the model: how to make it, its forward, its generate, its evidence."""

    name = ""
    what = ""
    backend: str | None = None  # the fusekit backend whose kernel runs are counted

    def unavailable(self, setup: Setup) -> str | None:
        return None

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        """Change `model` in place; return the callable the forward scenarios call."""
        return model

    def generate_kwargs(self, setup: Setup) -> dict | str:
        """generate()'s extra arguments, or why this provider's decode is not timed here."""
        return {}

    def close(self) -> None:
        """Undo anything global (called after the provider's last row)."""


class Eager(Provider):
    name = "eager"

    def __init__(self, attn: str) -> None:
        self.what = f'transformers as is, attn_implementation="{attn}", no compile'


class Compile(Provider):
    name = "compile"
    what = (
        "torch.compile(model, dynamic=False) (inductor) for prefill and training; decode: "
        'generate(cache_implementation="static"), which transformers compiles itself on CUDA '
        '(CompileConfig default, mode "reduce-overhead")'
    )

    def unavailable(self, setup: Setup) -> str | None:
        if setup.device == "cpu" and not (
            os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        ):
            return "torch.compile (inductor) needs a C++ compiler on the CPU; none found"
        return None

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        return torch.compile(model, dynamic=False)

    def generate_kwargs(self, setup: Setup) -> dict | str:
        if setup.device != "cuda":
            return (
                "transformers 5 compiles generate's decode steps only on CUDA/XPU (static cache); on the CPU "
                "this would time eager decoding"
            )
        return {"cache_implementation": "static"}

    def close(self) -> None:
        torch._dynamo.reset()  # drop the graphs (and the references they hold) before the next provider


class Fusekit(Provider):
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.name = f"fusekit-{backend}"
        self.what = f'fusekit.hf.patch(model, backend="{backend}", strict=True)'

    def unavailable(self, setup: Setup) -> str | None:
        from fusekit import backends

        if self.backend not in backends.names():
            return f"unknown fusekit backend {self.backend!r} (known: {', '.join(backends.names())})"
        why = backends.get(self.backend).unavailable_reason()  # loads only this backend
        from kernels_triton._config import is_interpreter

        interpreted = is_interpreter()
        if why is None and self.backend == "triton" and setup.device == "cpu" and not interpreted:
            why = "triton runs on the CPU only in its interpreter: set TRITON_INTERPRET=1 before the run"
        return why

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        import fusekit.hf

        fusekit.hf.patch(model, backend=self.backend, strict=True)
        return model


class FusekitCompile(Fusekit):
    """fusekit.hf.patch, then compiled as the "compile" provider compiles HF."""

    def __init__(self, backend: str) -> None:
        super().__init__(backend)
        self.name = f"fusekit-{backend}-compile"
        self.what = f'fusekit.hf.patch(model, backend="{backend}", strict=True), then: {Compile.what}'

    def unavailable(self, setup: Setup) -> str | None:
        return super().unavailable(setup) or Compile().unavailable(setup)

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        return torch.compile(super().prepare(model), dynamic=False)

    def generate_kwargs(self, setup: Setup) -> dict | str:
        return Compile().generate_kwargs(setup)

    def close(self) -> None:
        Compile().close()


class Liger(Provider):
    name = "liger"
    what = (
        "liger_kernel.transformers.apply_liger_kernel_to_llama(model=model), its defaults (rope, rms_norm, "
        "swiglu, fused linear cross entropy)"
    )

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def unavailable(self, setup: Setup) -> str | None:
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not importable (pip install liger-kernel)"
        if setup.device != "cuda":
            return "Liger-Kernel's kernels are Triton GPU kernels; it has no CPU path"
        return None

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.loss import loss_utils
        from transformers.models.llama import modeling_llama as ml

        # apply_liger_kernel_to_llama also rebinds module-level names (rope, RMSNorm, MLP classes, maybe
        # cross entropy): keep the originals, so later providers get an unpatched transformers.
        for obj, attr in (
            (ml, "apply_rotary_pos_emb"),
            (ml, "LlamaRMSNorm"),
            (ml, "LlamaMLP"),
            (ml.LlamaForCausalLM, "forward"),
            (loss_utils.nn.functional, "cross_entropy"),
        ):
            self._saved.append((obj, attr, getattr(obj, attr)))
        apply_liger_kernel_to_llama(model=model)
        return model

    def close(self) -> None:
        for obj, attr, value in reversed(self._saved):
            setattr(obj, attr, value)
        self._saved.clear()


def make_providers(names: list[str], setup: Setup) -> list[Provider]:
    out: list[Provider] = []
    for n in names:
        if n == "eager":
            out.append(Eager(setup.attn_implementation))
        elif n == "compile":
            out.append(Compile())
        elif n == "liger":
            out.append(Liger())
        elif n.startswith("fusekit-") and n.endswith("-compile"):
            out.append(FusekitCompile(n.removeprefix("fusekit-").removesuffix("-compile")))
        elif n.startswith("fusekit-"):
            out.append(Fusekit(n.removeprefix("fusekit-")))
        else:
            raise ValueError(f"unknown provider {n!r}; valid: {', '.join(PROVIDERS)}")
    return out


@contextlib.contextmanager
def kernel_runs(backend: str | None) -> Iterator[Counter]:
    """Counts "<op>:<phase>" for every planned call whose kernels run on fusekit backend `backend`
    (library._launch: through the provider or a launch replay of it): evidence that the patched model
    ran fusekit, not HF's modules or sdpa. Counting provider.run alone misses replayed calls."""
    counts: Counter = Counter()
    if backend is None:
        yield counts
        return
    from fusekit.library import plan as library_plan

    real = library_plan._launch

    def counting(spec, phase, plan, *args, **kwargs):
        if plan.provider is not None and plan.provider.name == backend:
            counts[f"{spec.name}:{phase}"] += 1
        return real(spec, phase, plan, *args, **kwargs)

    library_plan._launch = counting  # _execute looks the module global up on every call
    try:
        yield counts
    finally:
        library_plan._launch = real


def expected_forward_runs(layers: int) -> dict[str, int]:
    return {
        "rms_norm:forward": 2 * layers + 1,
        "rope:forward": layers,  # q and k in one call
        "attention:forward": layers,
        "swiglu_ffn:forward": layers,
    }


def _classify(exc: BaseException) -> tuple[str, str]:
    """("skipped", why) for what a provider cannot run here (backend missing, op or config unsupported),
    else ("failed", the error)."""
    from fusekit.backends import BackendUnavailable

    msg = f"{type(exc).__name__}: {exc}".strip()
    msg = msg if len(msg) <= 600 else msg[:600] + " ..."
    unsupported = isinstance(exc, BackendUnavailable) or (
        isinstance(exc, ValueError)
        and any(k in str(exc) for k in ("backend: ", "not supported", "does not support", "has no backward"))
    )
    return ("skipped" if unsupported else "failed"), msg


# --- timing ------------------------------------------------------------------------------------------
@dataclass
class Timing:
    first_call_s: float
    times_s: list[float]
    peak_mem_bytes: int | None
    mem_before_bytes: int | None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> Timing:
    """Host wall-clock per call, a device sync before and after each; the first (compile, tuning) call
    is timed on its own, then warmup - 1 more untimed calls, then `reps` timed ones."""
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t
    for _ in range(max(0, warmup - 1)):
        fn()
    _sync(device)
    before = peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    return Timing(first, times, peak, before)


# --- the run -----------------------------------------------------------------------------------------
@dataclass
class Reference:
    logits: torch.Tensor  # HF eager on the gate batch, float32
    tokens: torch.Tensor | None  # HF eager's greedy generate of the decode prompt
    exact: torch.Tensor | None  # low precision only: the same model in fp32
    eager_err: float | None  # low precision only: HF eager's error against `exact`


def reference(
    setup: Setup, state: dict, gate_ids: torch.Tensor, prompt: torch.Tensor | None, n_new: int
) -> Reference:
    """HF eager's logits (and greedy tokens when `prompt` is given); in low precision also the fp32 model's."""
    model = fresh_model(setup, state)
    with torch.no_grad():
        logits = model(gate_ids, use_cache=False).logits.float()
    tokens = _generate(model, prompt, n_new) if prompt is not None else None
    del model
    exact = err = None
    if setup.torch_dtype != torch.float32:
        _free()
        model = fresh_model(setup, state, dtype=torch.float32)
        with torch.no_grad():
            exact = model(gate_ids, use_cache=False).logits.float()
        del model
        err = rel_error(logits, exact)
    _free()
    return Reference(logits, tokens, exact, err)


def gate(
    prov: Provider,
    fwd: Callable,
    model: nn.Module,
    setup: Setup,
    ref: Reference,
    gate_ids: torch.Tensor,
    prompt: torch.Tensor,
    n_new: int,
) -> dict:
    """Logits against HF eager (fp32: rtol 1e-4; else against the fp32 model, within 2x HF eager's own
    error), greedy tokens (fp32: identical; else the matching prefix is recorded), kernel evidence."""
    out: dict = {"passed": False}
    with kernel_runs(prov.backend) as runs, torch.no_grad():
        logits = fwd(gate_ids, use_cache=False).logits.float()
    if prov.backend is not None:
        out["kernel_runs"] = dict(runs)
        out["kernel_runs_expected"] = expected_forward_runs(setup.layers)
    if ref.exact is None:
        err, tol = rel_error(logits, ref.logits), FP32_LOGITS_RTOL
        out.update(logits_rel_error=err, logits_tol=tol, logits_vs="HF eager, fp32")
    else:
        err = rel_error(logits, ref.exact)
        tol = 2 * ref.eager_err + LOW_PRECISION_SLACK
        out.update(
            logits_rel_error=err,
            logits_tol=tol,
            logits_vs=f"the fp32 model; HF eager {setup.dtype}'s own error {ref.eager_err:.3g}",
            logits_rel_error_vs_eager=rel_error(logits, ref.logits),
        )
    problems = []
    if not err <= tol:  # NaN fails
        problems.append(f"logits relative error {err:.3g} > {tol:.3g}")
    if prov.backend is not None and out["kernel_runs"] != out["kernel_runs_expected"]:
        problems.append(
            f"fusekit {prov.backend} kernel runs {out['kernel_runs']} != {out['kernel_runs_expected']}"
        )
    kw = prov.generate_kwargs(setup)
    if ref.tokens is not None and isinstance(kw, dict):
        tokens = _generate(model, prompt, n_new, **kw)
        p = prompt.shape[1]
        same = (tokens[:, p:] == ref.tokens[:, p:]).all(dim=0).long()
        prefix = int(same.cumprod(0).sum()) if tokens.shape == ref.tokens.shape else 0
        out.update(generate_same_tokens=bool(prefix == n_new), generate_matching_prefix=prefix)
        if setup.torch_dtype == torch.float32 and prefix != n_new:
            problems.append(f"greedy tokens differ from HF eager after {prefix} of {n_new}")
    elif ref.tokens is not None:
        out["generate"] = f"not checked: {kw}"
    out["passed"] = not problems
    if problems:
        out["problems"] = problems
    return out


def _row(prov: str, scenario: str, case: str, status: str, **kw) -> dict:
    return {"provider": prov, "scenario": scenario, "case": case, "status": status, **kw}


def _cases(setup: Setup, scenario: str) -> list[str]:
    if scenario == "prefill":
        return [_label(b, s) for b, s in setup.prefill]
    if scenario == "decode":
        return [_label(*d) for d in setup.decode]
    return [_label(b, s) for b, s in setup.train]


def _mem(t: Timing) -> dict:
    return {"peak_mem_bytes": t.peak_mem_bytes, "mem_before_bytes": t.mem_before_bytes}


def run_prefill(fwd, setup: Setup, b: int, s: int, warmup: int, reps: int) -> dict:
    ids = _ids(setup, b, s, salt=10 + s)

    def call():
        with torch.no_grad():
            fwd(ids, use_cache=False)

    t = time_calls(call, setup.torch_device, warmup, reps)
    return {
        "tokens": b * s,
        "tokens_per_s": b * s / t.median_s,
        "ms_per_step": 1e3 * t.median_s,
        "median_s": t.median_s,
        "times_s": t.times_s,
        "first_call_s": t.first_call_s,
        **_mem(t),
    }


def run_decode(
    model, prov: Provider, setup: Setup, b: int, p: int, n: int, warmup: int, reps: int
) -> dict | str:
    kw = prov.generate_kwargs(setup)
    if isinstance(kw, str):
        return kw
    prompt = _ids(setup, b, p, salt=2)
    dev = setup.torch_device
    one = time_calls(lambda: _generate(model, prompt, 1, **kw), dev, warmup, reps)
    full = time_calls(lambda: _generate(model, prompt, n, **kw), dev, warmup, reps)
    decode_s = full.median_s - one.median_s
    rate = b * (n - 1) / decode_s if n > 1 and decode_s > 0 else None
    return {
        "tokens": b * n,
        "tokens_per_s": rate,
        "ms_per_step": 1e3 * decode_s / (n - 1) if rate else None,
        "generate_tokens_per_s": b * n / full.median_s,
        "generate_s": full.median_s,
        "prefill_s": one.median_s,
        "times_s": full.times_s,
        "prefill_times_s": one.times_s,
        "first_call_s": full.first_call_s,
        "generate_kwargs": kw,
        **_mem(full),
    }


def ab_decode(
    model, prov: Fusekit, setup: Setup, b: int, p: int, n: int, reps: int, rounds: int
) -> dict[str, object]:
    """Same-process A/B of a patched model's decode against HF eager: per round, the model unpatched
    (fusekit.hf.unpatch gives back HF's exact modules) then patched again, each decode timed as
    run_decode does. The host's speed drifts between processes by tens of percent (the isolated rows'
    ratios carry that); alternating in one process cancels most of it. Leaves the model patched."""
    import fusekit.hf

    ratios, eager_ms, patched_ms = [], [], []
    for _ in range(rounds):
        fusekit.hf.unpatch(model)
        try:
            e = run_decode(model, Provider(), setup, b, p, n, 1, reps)  # HF as is: no generate kwargs
        finally:
            fusekit.hf.patch(model, backend=prov.backend, strict=True)
        f = run_decode(model, prov, setup, b, p, n, 1, reps)
        if isinstance(e, dict) and isinstance(f, dict) and e["tokens_per_s"] and f["tokens_per_s"]:
            ratios.append(f["tokens_per_s"] / e["tokens_per_s"])
            eager_ms.append(e["ms_per_step"])
            patched_ms.append(f["ms_per_step"])
    return {
        "ab_vs_eager": statistics.median(ratios) if ratios else None,
        "ab_ratios": ratios,
        "ab_eager_ms_per_step": eager_ms,
        "ab_ms_per_step": patched_ms,
    }


def run_train(fwd, model, prov: Provider, setup: Setup, b: int, s: int, warmup: int, reps: int) -> dict:
    ids = _ids(setup, b, s, salt=20 + s)
    labels = _ids(setup, b, s, salt=30 + s)  # random targets: HF shifts them by one inside the loss
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=setup.optim == "fused")
    losses: list[torch.Tensor] = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = fwd(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    dev = setup.torch_device
    _sync(dev)
    t0 = time.perf_counter()
    with kernel_runs(prov.backend) as runs:
        step()  # the first step on its own: compile, optimizer state, kernels counted
    _sync(dev)
    first = time.perf_counter() - t0
    t = time_calls(step, dev, max(1, warmup - 1), reps)
    losses_f = [float(x) for x in losses]
    model.zero_grad(set_to_none=True)
    model.eval()
    out = {
        "tokens": b * s,
        "tokens_per_s": b * s / t.median_s,
        "ms_per_step": 1e3 * t.median_s,
        "median_s": t.median_s,
        "times_s": t.times_s,
        "first_call_s": first,
        "loss_first": losses_f[0],
        "loss_last": losses_f[-1],
        **_mem(t),
    }
    if prov.backend is not None:
        out["kernel_runs_first_step"] = dict(runs)
    return out


def run_provider(
    prov: Provider,
    setup: Setup,
    scenarios: list[str],
    state: dict,
    ref: Reference,
    warmup: int,
    reps: int,
    deadline: float | None,
    log: Callable[[str], None],
    ab_rounds: int = 0,
) -> tuple[dict, list[dict]]:
    """Gate, then time each scenario; returns (provider record, rows). A patched provider's decode rows
    also get `ab_rounds` same-process rounds against HF eager (ab_decode), where it can be unpatched."""
    rec: dict = {"what": prov.what}
    rows: list[dict] = []

    def all_rows(status: str, reason: str) -> list[dict]:
        return [_row(prov.name, sc, c, status, reason=reason) for sc in scenarios for c in _cases(setup, sc)]

    why = prov.unavailable(setup)
    if why is None and deadline is not None and time.perf_counter() > deadline:
        why = BUDGET_SKIP
    if why is not None:
        rec.update(status="skipped", reason=why)
        return rec, all_rows("skipped", why)
    b, p, n = setup.decode[0]
    gate_ids = _ids(setup, *setup.prefill[0], salt=1)
    prompt = _ids(setup, b, p, salt=2)
    model = None
    try:
        model = fresh_model(setup, state)
        fwd = prov.prepare(model)
        t = time.perf_counter()
        rec["gate"] = g = gate(prov, fwd, model, setup, ref, gate_ids, prompt, n)
        rec["gate_s"] = time.perf_counter() - t  # compile / tuning of the gate's shapes happens here
    except Exception as exc:
        status, msg = _classify(exc)
        rec.update(status=status, reason=msg)
        prov.close()
        del model
        _free()
        return rec, all_rows(status, msg)
    if not g["passed"]:
        reason = "correctness gate failed: " + "; ".join(g["problems"])
        rec.update(status="wrong", reason=reason)
        prov.close()
        del model, fwd
        _free()
        return rec, all_rows("wrong", reason)
    rec["status"] = "ok"
    log(f"  {prov.name}: gate passed (logits rel error {g['logits_rel_error']:.2e})")
    for sc in scenarios:
        for case in _cases(setup, sc):
            _free()
            if deadline is not None and time.perf_counter() > deadline:
                rows.append(_row(prov.name, sc, case, "skipped", reason=BUDGET_SKIP))
                continue
            try:
                if sc == "prefill":
                    bb, ss = _shapes(case)[0]
                    res = run_prefill(fwd, setup, bb, ss, warmup, reps)
                elif sc == "decode":
                    shape = _decode_shapes(case)[0]
                    res = run_decode(model, prov, setup, *shape, warmup, reps)
                    if ab_rounds and type(prov) is Fusekit and isinstance(res, dict):
                        res.update(ab_decode(model, prov, setup, *shape, reps, ab_rounds))
                else:
                    bb, ss = _shapes(case)[0]
                    res = run_train(fwd, model, prov, setup, bb, ss, warmup, reps)
            except Exception as exc:
                status, msg = _classify(exc)
                rows.append(_row(prov.name, sc, case, status, reason=msg))
                log(f"  {prov.name} {sc} {case}: {status}: {msg[:200]}")
                model.zero_grad(set_to_none=True)
                model.eval()
                continue
            if isinstance(res, str):
                rows.append(_row(prov.name, sc, case, "skipped", reason=res))
                continue
            if sc == "decode" and res["tokens_per_s"] is None:
                res["note"] = "t(N) <= t(1): the decode steps took less than the timing noise (tiny model?)"
            finite = sc != "train" or all(math.isfinite(res[k]) for k in ("loss_first", "loss_last"))
            if not finite:
                rows.append(_row(prov.name, sc, case, "wrong", reason="non-finite training loss", **res))
                continue
            rows.append(_row(prov.name, sc, case, "ok", **res))
            tps = res["tokens_per_s"]
            log(f"  {prov.name} {sc} {case}: " + (f"{tps:,.0f} tok/s" if tps else "ok"))
    prov.close()
    del model, fwd
    _free()
    return rec, rows


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs[baseline] = this row's tokens/s / the baseline's, for the same scenario and case."""
    base = {
        (r["provider"], r["scenario"], r["case"]): r
        for r in rows
        if r["provider"] in BASELINES and r["status"] == "ok" and r.get("tokens_per_s")
    }
    for r in rows:
        r.pop("speedup_vs", None)
        if r["status"] != "ok" or not r.get("tokens_per_s"):
            continue
        sv = {}
        for name in BASELINES:
            b = base.get((name, r["scenario"], r["case"]))
            if b is not None:
                sv[name] = r["tokens_per_s"] / b["tokens_per_s"]
                if b.get("run", 0) != r.get("run", 0):
                    sv[f"{name}_other_run"] = True
        r["speedup_vs"] = sv


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def table(rows: list[dict]) -> str:
    cols = (
        "provider",
        "scenario",
        "case",
        "status",
        "tok/s",
        "ms/step",
        "vs eager",
        "vs compile",
        "peak GiB",
    )
    widths = (15, 8, 11, 8, 11, 9, 8, 10, 8)
    fmt = lambda cells: " ".join(
        f"{c:<{w}}" if i < 4 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths))
    )
    lines = [fmt(cols), "-" * (sum(widths) + len(widths) - 1)]
    for r in rows:
        sv = r.get("speedup_vs") or {}
        peak = r.get("peak_mem_bytes")
        line = fmt(
            (
                r["provider"],
                r["scenario"],
                r["case"],
                r["status"],
                _fmt(r.get("tokens_per_s"), ",.0f"),
                _fmt(r.get("ms_per_step"), ".3f"),
                _fmt(sv.get("eager"), ".3g", "x"),
                _fmt(sv.get("compile"), ".3g", "x"),
                _fmt(None if peak is None else peak / 2**30, ".2f"),
            )
        )
        if r["status"] != "ok":
            line += f"  {r.get('reason', '')[:90]}"
        lines.append(line)
    return "\n".join(lines)


def _setup_key(setup: dict) -> dict:
    # files written before `optim` existed ran torch's default (foreach) AdamW
    return {"optim": "foreach"} | {k: v for k, v in setup.items() if k not in ("config", "parameters")}


def load_for_merge(path: Path, setup: dict) -> dict | None:
    """An existing e2e.json to merge into (None when absent); SystemExit when its setup differs."""
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    if old.get("schema") != SCHEMA or _setup_key(old["setup"]) != _setup_key(setup):
        raise SystemExit(f"--merge: {path} holds another setup; use another --out, or drop --merge")
    return old


def _row_key(r: dict) -> tuple[str, str, str]:
    return r["provider"], r["scenario"], r["case"]


def compose(doc: dict, old: dict | None) -> dict:
    """`doc` (this run's rows, all tagged run = len(old runs)) over `old`: a row of this run replaces the
    old row of its provider, scenario and case, except that a row this run skipped for its time budget
    keeps an old measured one; old rows of cases this run did not run (other providers, or scenarios
    left out with --scenarios) stay. Provider records: this run's replace old ones. Ratios recomputed
    over the lot (a ratio across runs is marked as such)."""
    if old is None:
        out = {**doc, "runs": [doc["meta"]]}
    else:
        mine = set(doc["providers"]) | {r["provider"] for r in doc["rows"]}
        order = {p: i for i, p in enumerate(PROVIDERS)}
        measured = {_row_key(r) for r in old["rows"] if r["status"] == "ok"}
        new = [r for r in doc["rows"] if not (r.get("reason") == BUDGET_SKIP and _row_key(r) in measured)]
        replaced = {_row_key(r) for r in new}
        scen = {s: i for i, s in enumerate(SCENARIOS)}
        rows = sorted(
            [r for r in old["rows"] if _row_key(r) not in replaced] + new,
            key=lambda r: (order.get(r["provider"], 99), scen.get(r["scenario"], 99)),
        )
        providers = {k: v for k, v in old["providers"].items() if k not in mine} | doc["providers"]
        out = {
            **doc,
            "runs": [*old["runs"], doc["meta"]],
            "providers": dict(sorted(providers.items(), key=lambda kv: order.get(kv[0], 99))),
            "rows": rows,
        }
    add_ratios(out["rows"])
    return out


def _method(setup: Setup, warmup: int, reps: int, quick: bool) -> dict:
    return {
        "warmup": warmup,
        "reps": reps,
        "quick": quick,
        "timer": "host wall-clock (perf_counter) per call with a device sync before and after; median of reps",
        "prefill": "model(input_ids, use_cache=False): full logits, no KV cache; tokens_per_s = B*S / median",
        "decode": (
            "generate(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0); tokens_per_s = "
            "B*(N-1) / (t(N) - t(1)), decode steps only (the first new token comes from the prefill); "
            "generate_tokens_per_s = B*N / t(N), prefill included"
        ),
        "train": (
            f"AdamW(lr=1e-5, {setup.optim}) step on model(input_ids, labels=random ids).loss (the model's own "
            "shifted cross entropy; Liger's fused linear cross entropy for liger): zero_grad, forward, backward, "
            "step; "
            "peak_mem_bytes = torch.cuda.max_memory_allocated over the timed steps (weights, grads and "
            "AdamW state included; null on the CPU)"
        ),
        "gate": (
            f"before timing: logits on the {_label(*setup.prefill[0])} prefill batch vs HF eager (fp32: "
            f"relative 2-norm <= {FP32_LOGITS_RTOL}; bf16/fp16: vs the same weights in fp32, <= 2x HF eager's "
            f"own error + {LOW_PRECISION_SLACK}), greedy tokens of the decode prompt (identical in fp32, "
            "matching prefix recorded otherwise); fusekit providers: calls reaching the backend's kernels "
            "counted per forward"
        ),
        "first_call_s": (
            "the first call of that scenario; the gate's calls ran before it (compile / tuning of the first "
            "prefill shape and of generate: the provider's gate_s)"
        ),
        "speedup_vs": "this row's tokens_per_s / the baseline's, same scenario and case",
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fusekit.bench.e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument(
        "--model", choices=tuple(MODELS), default=None, help="llama3-8b (cuda default), llama3.2-1b or tiny"
    )
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (llama3-8b: 4, tiny: 2)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="bf16 on cuda, fp32 on cpu")
    ap.add_argument(
        "--attn", default="sdpa", choices=("sdpa", "eager"), help="HF attention (eager, compile, liger)"
    )
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma list, in the order run")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--prefill", default=None, help="BxS[,BxS...] (the first is the gate batch)")
    ap.add_argument("--decode", default=None, help="BxPROMPT+NEW[,BxPROMPT+NEW...] (the first is the gate's)")
    ap.add_argument("--train", default=None, help="BxS[,BxS...]")
    ap.add_argument(
        "--optim", default="foreach", choices=("foreach", "fused"),
        help="the training step's AdamW: torch's default (foreach) or fused=True (HF Trainer's default)",
    )  # fmt: skip
    ap.add_argument(
        "--ab-rounds", type=int, default=3,
        help="same-process decode rounds of each patched (not compiled) provider against HF eager (0: off)",
    )  # fmt: skip
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls, the first included (2; quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls, median reported (5; quick 2)")
    ap.add_argument("--quick", action="store_true", help="fewer warm-up and timed calls")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default=None, help="results root (cuda: benchmarks/results, cpu: build/bench/results)"
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows this run does not measure from an existing e2e.json",
    )
    ap.add_argument(
        "--budget-s", type=float, default=None, help="start no new provider or case after S seconds"
    )
    ap.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each provider in its own process (default on CUDA with several providers): what one "
        "provider leaves behind (dynamo's caches and hooks after torch.compile, CUDA-graph pools, a "
        "grown heap) must not slow the next one down",
    )
    return ap


def _isolated(names: list[str], argv: list[str], merge: bool, deadline: float | None, path: Path) -> int:
    """Run each provider as `python -m fusekit.bench.e2e <argv> --providers <p> --no-isolate`, merging
    into one e2e.json (the first keeps --merge as given, the others merge into it), then print the lot.
    Why: in one-process H200 runs, fusekit-triton decode timed after the compile providers took 6.4-6.7
    ms/token and 4.4 when timed first; its own process later gave 7.6, so process state was not the whole
    story there, but no provider's leftovers can bias another's rows this way."""
    rc = 0
    for i, name in enumerate(names):
        extra = ["--providers", name, "--no-isolate"] + (["--merge"] if merge or i else [])
        if deadline is not None:
            extra += ["--budget-s", f"{max(0.0, deadline - time.perf_counter()):.1f}"]
        cmd = [sys.executable, "-m", "fusekit.bench.e2e", *argv, *extra]
        res = subprocess.run(cmd, env={**os.environ, "FUSEKIT_E2E_QUIET_TABLE": "1"}, check=False)
        rc = rc or res.returncode
    if path.exists():
        print(table(json.loads(path.read_text())["rows"]))
    return rc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    model_name = args.model or ("llama3-8b" if device.type == "cuda" else "tiny")
    spec = MODELS[model_name]
    names = [p for p in args.providers.split(",") if p]
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [p for p in names if p not in PROVIDERS] + [s for s in scenarios if s not in SCENARIOS]
    if bad:
        print(f"unknown providers/scenarios {bad}; valid: {PROVIDERS} / {SCENARIOS}", file=sys.stderr)
        return 2
    out_root = Path(args.out) if args.out else results.default_out(device)
    if device.type == "cpu" and results.is_committed_path(out_root):
        print(
            f"refusing to write CPU timings under {results.COMMITTED_RESULTS}; use --out {results.LOCAL_RESULTS}",
            file=sys.stderr,
        )
        return 2
    setup = Setup(
        device=str(device),
        model=model_name,
        layers=args.layers or spec["layers"],
        dtype=args.dtype or ("bf16" if device.type == "cuda" else "fp32"),
        attn_implementation=args.attn,
        prefill=_shapes(args.prefill or spec["prefill"]),
        decode=_decode_shapes(args.decode or spec["decode"]),
        train=_shapes(args.train or spec["train"]),
        seed=args.seed,
        config={**spec["config"], "num_hidden_layers": args.layers or spec["layers"]},
        optim=args.optim,
    )
    warmup = args.warmup or (1 if args.quick else 2)
    reps = args.reps or (2 if args.quick else 5)
    path = out_root / results.slug(results.device_name(device)) / file_name(model_name, setup.layers)
    setup_doc = json.loads(json.dumps(asdict(setup)))  # tuples -> lists, as a loaded file has them
    old = load_for_merge(path, setup_doc) if args.merge else None
    run_index = len(old["runs"]) if old else 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    deadline = None if args.budget_s is None else t0 + args.budget_s
    isolate = args.isolate if args.isolate is not None else device.type == "cuda" and len(names) > 1
    if isolate:
        return _isolated(names, list(sys.argv[1:] if argv is None else argv), args.merge, deadline, path)
    log = lambda s: print(s, flush=True)
    log(f"e2e: {model_name}, {setup.layers} layers, {setup.dtype} on {device}; providers {', '.join(names)}")
    state = base_weights(setup)
    b, p, n = setup.decode[0]
    ref = reference(setup, state, _ids(setup, *setup.prefill[0], salt=1), _ids(setup, b, p, salt=2), n)
    if ref.eager_err is not None:
        log(f"  HF eager {setup.dtype} logits vs fp32: relative error {ref.eager_err:.3g}")

    meta = results.environment(device)
    meta["schema"] = SCHEMA
    meta["command"] = " ".join(["python -m fusekit.bench.e2e", *(sys.argv[1:] if argv is None else argv)])
    meta["transformers"] = transformers.__version__
    doc: dict = {
        "schema": SCHEMA,
        "meta": meta,
        "setup": {**setup_doc, "parameters": sum(v.numel() for v in state.values())},
        "method": _method(setup, warmup, reps, args.quick),
        "reference": {"eager_logits_rel_error_vs_fp32": ref.eager_err},
        "providers": {},
        "rows": [],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    final = doc
    for prov in make_providers(names, setup):
        log(f"{prov.name}:")
        rec, rows = run_provider(
            prov, setup, scenarios, state, ref, warmup, reps, deadline, log, ab_rounds=args.ab_rounds
        )
        if rec["status"] != "ok":
            log(f"  {prov.name}: {rec['status']}: {rec['reason'][:300]}")
        doc["providers"][prov.name] = {**rec, "run": run_index}
        doc["rows"] += [{**r, "run": run_index} for r in rows]
        final = compose(doc, old)
        _write(path, final)  # after each provider: a run cut short keeps what finished
    if not os.environ.get("FUSEKIT_E2E_QUIET_TABLE"):  # an isolated worker: the parent prints the lot
        print(table(final["rows"]))
    label = "" if device.type == "cuda" else " (CPU host timings, git-ignored)"
    log(f"results -> {path}{label}  ({time.perf_counter() - t0:.0f} s)")
    return 0


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
