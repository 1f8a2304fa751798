"""The custom ops' runtime path without torch.library's Python layers (what a compiled graph calls).

A graph compiled by torch.compile calls `torch.ops.fusekit.<op>` once per op per step, with grad mode
off (AOTAutograd runs the forward and the backward graphs under no_grad). torch.library.custom_op sends
that call through its autograd kernel (`autograd_impl`: a grad check, `forward_no_grad`, a Python
`redispatch`), then its backend wrapper (a dynamo-disable wrapper and an output-aliasing check) before
fusekit's own function: on the CPU here 27 us more per rms_norm forward+backward than the eager path.
On a GPU host that is slower in Python it starved the GPU: a compiled Llama-3.2-1B training step
(16 layers, ~160 fusekit calls) idled the H100 17 ms of 57 between fusekit calls.

`install` registers one Python kernel per op at AutogradCPU / AutogradCUDA (more specific than the
custom op's Autograd alias kernel, so it takes precedence for those tensors): a call that needs no
autograd and meets no Python dispatch (no tensor subclass, no dispatch mode: FakeTensor, functional
tensors, tracing) goes straight to fusekit's implementation; anything else (tracing a graph, a call that
records a gradient) goes to the custom op's own autograd kernel, exactly as before. The implementation is
also the op's CPU / CUDA kernel (more specific than custom_op's CompositeExplicitAutograd wrapper), which
an inference_mode call (no autograd keys) and the standard path's redispatch reach.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

_LIB: torch.library.Library | None = None
_KEYS = ("AutogradCPU", "AutogradCUDA")  # ROCm builds of torch run on the CUDA keys too
_BACKEND_KEYS = ("CPU", "CUDA")
INSTALLED: set[str] = set()  # ops whose runtime calls take the lean kernel (tests read it)
ENV = "FUSEKIT_LEAN_DISPATCH"  # "0": every call keeps torch.library's standard path


def _tools() -> tuple[Callable, Any, Any, Callable] | None:
    """torch internals the lean kernel needs, or None on a torch without them (then nothing changes)."""
    try:
        from torch._library.autograd import make_autograd_impl

        return (
            make_autograd_impl,
            torch._C.DispatchKey.Python,
            torch._C.DispatchKey.Functionalize,
            torch._C._any_requires_grad,
        )
    except (ImportError, AttributeError):  # pragma: no cover - older or newer torch: the standard path
        return None


def install(op: Any, impl: Callable[..., Any]) -> bool:
    """Route `op`'s (a torch.library.custom_op) plain runtime calls straight to `impl`; False if this
    torch lacks what it needs. Call after register_autograd (the fallback reads the formula lazily)."""
    global _LIB
    tools = _tools()
    if tools is None or os.environ.get(ENV, "1") == "0":
        return False
    make_autograd_impl, python_key, functionalize_key, any_requires_grad = tools
    overload = op._opoverload
    standard = make_autograd_impl(overload, op)  # the custom op's own autograd kernel
    is_grad_enabled = torch.is_grad_enabled

    def kernel(keyset: Any, *args: Any) -> Any:
        if (
            keyset.has(python_key)  # a tensor subclass or dispatch mode: FakeTensor, tracing, functional
            or keyset.has(functionalize_key)
            or (is_grad_enabled() and any_requires_grad(*args))
        ):
            return standard(keyset, *args)
        return impl(*args)

    if _LIB is None:
        _LIB = torch.library.Library("fusekit", "IMPL")  # kept for the process: it owns the kernels
    name = overload._schema.name.split("::", 1)[1]
    for key in _KEYS:
        _LIB.impl(name, kernel, key, with_keyset=True)
    # Below autograd (inference_mode skips the autograd keys; the standard path redispatches here): the
    # implementation without custom_op's backend wrapper and its output-aliasing check, but, as that
    # wrapper, under dynamo-disable (a call from an eager stretch of a compiled function runs it rather
    # than compiling fusekit's internals).
    backend_impl = getattr(torch, "_disable_dynamo", lambda fn: fn)(impl)
    for key in _BACKEND_KEYS:
        _LIB.impl(name, backend_impl, key)
    INSTALLED.add(name)
    return True
