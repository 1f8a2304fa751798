"""Which backend runs a call: explicit argument, then environment, then the `auto` table.

Resolution order (never a silent fallback for an explicit choice):
1. `backend=` argument, when it is not "auto";
2. `FUSEKIT_BACKEND_<OP>` (e.g. FUSEKIT_BACKEND_RMS_NORM=triton), then `FUSEKIT_BACKEND`;
3. `auto`: the first backend in `AUTO[device type][op]` that is installed and supports the call.

A backend chosen by 1 or 2 that is missing raises BackendUnavailable with the install command; one
that cannot run this particular call raises ValueError with its reason.
"""

from __future__ import annotations

import os

import torch

from fusekit import backends
from fusekit.backends.base import Backend, BackendUnavailable

# The `auto` ranking per device type and op. The CUDA order follows the committed H200 benchmark
# results (benchmarks/report/README.md): the fastest backend first, the torch reference always last
# so `auto` can run everything. On the CPU the reference is the only fast path (Triton runs in an
# interpreter there and MAX's CPU kernels are not tuned), so it goes first.
AUTO: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {
        "reduce_sum": ("triton", "mojo", "torch"),
        "rms_norm": ("triton", "mojo", "torch"),
        "layer_norm": ("triton", "mojo", "torch"),
        "rope": ("triton", "mojo", "torch"),
        "swiglu_ffn": ("triton", "torch"),
        "attention": ("triton", "torch"),
    },
    "cpu": {op: ("torch",) for op in backends.OPS},
}

_cache: dict[tuple, Backend] = {}


def _env_choice(op: str) -> str | None:
    return os.environ.get(f"FUSEKIT_BACKEND_{op.upper()}") or os.environ.get("FUSEKIT_BACKEND") or None


def resolve(op: str, backend: str, device: torch.device, dtype: torch.dtype, **meta: object) -> Backend:
    """The backend object that runs `op` for a call with these properties."""
    if backend == "auto":
        backend = _env_choice(op) or "auto"
    key = (op, backend, device.type, dtype, tuple(sorted(meta.items())))
    hit = _cache.get(key)
    if hit is not None:
        return hit
    if backend == "auto":
        reasons = []
        for name in AUTO[device.type][op]:
            b = backends.get(name)
            why = b.unavailable_reason() or b.supports(op, device, dtype, **meta)
            if why is None:
                _cache[key] = b
                return b
            reasons.append(f"{name}: {why}")
        raise ValueError(f"backend: no backend can run {op} here: " + "; ".join(reasons))
    b = backends.get(backend)
    why = b.unavailable_reason()
    if why is not None:
        raise BackendUnavailable(f"backend: {backend!r} is not available: {why}")
    why = b.supports(op, device, dtype, **meta)
    if why is not None:
        raise ValueError(f"backend: {backend!r} cannot run {op} for this call: {why}")
    _cache[key] = b
    return b


def clear_cache() -> None:
    """Forget resolved choices (after changing FUSEKIT_BACKEND* variables or installing a backend)."""
    _cache.clear()
