"""Whether calling a module runs hooks: fused calls that bypass a module (or call it with another signature)
are taken only when none would run, so hooks always see the calls HF's modules make."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _mm


def hooked(m: nn.Module) -> bool:
    """True if calling m runs a hook of its own or a global one (forward or backward, pre or post)."""
    return bool(
        m._forward_hooks
        or m._forward_pre_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
        or _mm._global_forward_hooks
        or _mm._global_forward_pre_hooks
        or _mm._global_backward_hooks
        or _mm._global_backward_pre_hooks
    )
