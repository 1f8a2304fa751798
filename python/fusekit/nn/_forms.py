"""Which known forward a module runs, so `from_module` wraps only modules whose math it reproduces.

A wrapper reads a module's parameters and replaces its forward: a class that computes anything else (Gemma's
x * (1 + w), Cohere's mean-subtracting "RMS" norm, an MLP with multipliers or a clamp) must not be wrapped by
guesswork. HF's "Copied from" classes (Mistral, Qwen2/3, Phi3, Granite ... RMSNorm and MLP) compile to the
very code of the Llama / Gemma originals, so comparing code objects recognizes them exactly.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from torch import nn


def class_forward(module: nn.Module) -> Callable | None:
    """The forward `module` runs when called: its class's, or None when the instance replaced it (a wrapper
    such as accelerate's hooks: the math it runs is unknown)."""
    return None if "forward" in module.__dict__ else type(module).forward


def _code(fn: Callable | None) -> tuple | None:
    f = getattr(fn, "__code__", None)
    return None if f is None else (f.co_code, f.co_consts, f.co_names)


@functools.cache
def _hf_forms(kind: str) -> dict[tuple, str]:
    """{code of an HF original's forward: its name} for kind "norm" or "mlp"; empty without transformers."""
    originals = {
        "norm": (("llama", "LlamaRMSNorm", "llama"), ("gemma", "GemmaRMSNorm", "gemma")),
        "mlp": (("llama", "LlamaMLP", "llama"),),
    }[kind]
    forms = {}
    for module, name, form in originals:
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
        except (ImportError, AttributeError):
            continue
        code = _code(getattr(cls, "forward", None))
        if code is not None:
            forms[code] = form
    return forms


def hf_form(module: nn.Module, kind: str) -> str | None:
    """ "llama" / "gemma" when `module` runs HF's LlamaRMSNorm / GemmaRMSNorm forward (kind "norm"), "llama"
    when it runs LlamaMLP's down(act(gate(x)) * up(x)) (kind "mlp"); None for any other forward."""
    fwd = class_forward(module)
    if fwd is None or not type(module).__module__.startswith("transformers."):
        return None
    return _hf_forms(kind).get(_code(fwd))
