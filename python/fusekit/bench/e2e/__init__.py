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

Modules: config (the models, Setup, shapes, a fresh model from one state_dict), providers, timing,
scenarios (the gate, prefill, decode, train), document (ratios, table, merge), cli (one process per
provider).
"""

from __future__ import annotations

from fusekit.bench.e2e.cli import main
from fusekit.bench.e2e.config import (
    BASELINES,
    BUDGET_SKIP,
    DTYPES,
    FILE,
    FP32_LOGITS_RTOL,
    LLAMA3_ROPE,
    LOW_PRECISION_SLACK,
    MODELS,
    PROVIDERS,
    SCENARIOS,
    SCHEMA,
    Setup,
    _decode_shapes,
    _ids,
    _label,
    base_weights,
    file_name,
    fresh_model,
    rel_error,
)
from fusekit.bench.e2e.document import _setup_key, add_ratios, compose, load_for_merge, table
from fusekit.bench.e2e.providers import (
    Compile,
    Eager,
    Fusekit,
    FusekitCompile,
    Liger,
    Provider,
    expected_forward_runs,
    kernel_runs,
    make_providers,
)
from fusekit.bench.e2e.scenarios import (
    Reference,
    ab_decode,
    ab_train,
    gate,
    reference,
    run_decode,
    run_prefill,
    run_provider,
    run_train,
)
from fusekit.bench.e2e.timing import Timing, time_calls

__all__ = [
    "BASELINES",
    "BUDGET_SKIP",
    "DTYPES",
    "FILE",
    "FP32_LOGITS_RTOL",
    "LLAMA3_ROPE",
    "LOW_PRECISION_SLACK",
    "MODELS",
    "PROVIDERS",
    "SCENARIOS",
    "SCHEMA",
    "Compile",
    "Eager",
    "Fusekit",
    "FusekitCompile",
    "Liger",
    "Provider",
    "Reference",
    "Setup",
    "Timing",
    "_decode_shapes",
    "_ids",
    "_label",
    "_setup_key",
    "ab_decode",
    "ab_train",
    "add_ratios",
    "base_weights",
    "compose",
    "expected_forward_runs",
    "file_name",
    "fresh_model",
    "gate",
    "kernel_runs",
    "load_for_merge",
    "main",
    "make_providers",
    "reference",
    "rel_error",
    "run_decode",
    "run_prefill",
    "run_provider",
    "run_train",
    "table",
    "time_calls",
]
