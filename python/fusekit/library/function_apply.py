"""`torch.autograd.Function.apply` without its per-call Python layers, for the eager calls that record a
gradient (the hot path of a small training step).

`Function.apply` checks whether the class defines setup_context (ours do not), asks whether a functorch
transform is active, unwraps dead functorch wrappers among the arguments and calls the C++ apply. `applier`
does the same steps for a class bound once: on the CPU here 8.3 -> 6.9 us per call of a three-argument
Function (the difference is the per-call closure, `inspect`-free checks and the generator of
`unwrap_dead_wrappers`). Under a functorch transform (vmap, grad, ...) it defers to `Function.apply`, which
raises there for a Function without setup_context, exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import _is_setup_context_defined

_BASE_APPLY = torch._C._FunctionBase.__dict__.get("apply")  # the C++ classmethod Function.apply ends in


def applier(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """A callable equivalent to `cls.apply` for a Function without setup_context."""
    if _is_setup_context_defined(cls.setup_context):
        return cls.apply  # one with setup_context binds its arguments per call: keep torch's path
    try:
        base = _BASE_APPLY.__get__(None, cls)
        active = torch._C._are_functorch_transforms_active
        unwrap = torch._C._functorch.unwrap_if_dead
    except AttributeError:  # pragma: no cover - a torch without these internals: its own apply
        return cls.apply
    tensor = torch.Tensor

    def apply(*args: Any) -> Any:
        if active():
            return cls.apply(*args)
        return base(*[unwrap(a) if isinstance(a, tensor) else a for a in args])

    return apply
