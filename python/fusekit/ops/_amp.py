"""torch.autocast for the fusekit ops, as torch treats its own ops under it.

Matrix ops (swiglu_ffn, attention, linear_cross_entropy) are on autocast's lower-precision list, as
F.linear and F.scaled_dot_product_attention are: under `torch.autocast(device, dtype)` their floating
inputs (not float64, as autocast leaves those) are cast to `dtype` first, so an fp32 model under bf16
autocast runs them as bf16 kernels, and the casts carry the gradients back to the fp32 parameters in
fp32. The other ops keep their inputs' dtypes (they already compute in fp32 and round once).

The kernels themselves always run with autocast off (fusekit.library.plan): a backend's own torch calls
(the torch backend's fp32 reference math, the GEMMs of the fused loss) keep the precision the op defines
instead of being recast by an autocast region the caller opened.
"""

from __future__ import annotations

import torch
from torch import Tensor

_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
# True when autocast is on for any device: one C call, no device object (torch >= 2.4 has it; the CI's
# 2.13 and the GPU host's 2.11 do)
any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
)
# device types with an autocast mode (torch.is_autocast_enabled raises for others, e.g. "meta")
AMP_DEVICES = frozenset(("cpu", "cuda", "xpu", "mps", "hpu"))


def on(device_type: str) -> bool:
    """Autocast is on for this device type. Callers on the hot path ask `any_enabled()` first: one C call,
    no device object made, when no autocast region is open anywhere (the common case)."""
    return device_type in AMP_DEVICES and torch.is_autocast_enabled(device_type)


def lower(first: Tensor, *ts: Tensor | None) -> tuple[Tensor | None, ...] | None:
    """(first, *ts) cast to the autocast dtype of first's device when autocast is on there, else None
    (the caller goes on with its own tensors). None entries (absent optional tensors) stay None."""
    if not any_enabled() or not isinstance(first, Tensor):  # the hot path: one cheap check, no device
        return None  # object made; a bad argument goes on to the op's checks, which name it
    dev = first.device.type
    if not on(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    return tuple(
        t.to(dt) if isinstance(t, Tensor) and t.dtype in _ELIGIBLE and t.dtype != dt else t
        for t in (first, *ts)
    )
