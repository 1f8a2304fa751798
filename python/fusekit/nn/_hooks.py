"""Whether calling a module runs hooks: fused calls that bypass a module (or call it with another signature)
are taken only when none would run, so hooks always see the calls HF's modules make."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _mm

from fusekit.nn._forms import class_forward


def own_hooks(m: nn.Module) -> bool:
    """True if m has hooks of its own: torch's (forward or backward, pre or post), or a forward replaced on the
    instance (accelerate's add_hook_to_module wraps `m.forward` so; its `_hf_hook` marks it)."""
    return bool(
        m._forward_hooks
        or m._forward_pre_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
        or class_forward(m) is None
        or getattr(m, "_hf_hook", None) is not None
    )


def global_hooks() -> bool:
    """True if torch's global module hooks (register_module_forward_hook and the like) are set."""
    return bool(
        _mm._global_forward_hooks
        or _mm._global_forward_pre_hooks
        or _mm._global_backward_hooks
        or _mm._global_backward_pre_hooks
    )


def hooked(m: nn.Module) -> bool:
    """True if calling m runs a hook of its own (`own_hooks`) or a global one."""
    return own_hooks(m) or global_hooks()
