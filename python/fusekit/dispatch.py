"""Which backend runs a call: explicit argument, then environment, then the `auto` table.

Resolution order (never a silent fallback for an explicit choice):
1. `backend=` argument, when it is not "auto";
2. `FUSEKIT_BACKEND_<OP>` (e.g. FUSEKIT_BACKEND_RMS_NORM=triton), then `FUSEKIT_BACKEND`;
3. `auto`: the first backend in `AUTO[device type][op]` that is installed and supports the call.

A backend chosen by 1 or 2 that is missing raises BackendUnavailable with the install command; one
that cannot run this particular call raises ValueError with its reason. A call that records a
gradient resolves with phase "backward", so `auto` picks a backend that has the op's backward.
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
_CUDA_ORDER = ("triton", "mojo", "torch")
AUTO: dict[str, dict[str, tuple[str, ...]]] = {"cuda": {}, "cpu": {}}


def auto_order(op: str, device_type: str) -> tuple[str, ...]:
    if device_type == "cpu":
        return AUTO["cpu"].get(op, ("torch",))
    return AUTO["cuda"].get(op, _CUDA_ORDER)


_cache: dict[tuple, Backend] = {}


def _env_choice(op: str) -> str | None:
    return os.environ.get(f"FUSEKIT_BACKEND_{op.upper()}") or os.environ.get("FUSEKIT_BACKEND") or None


def resolve(
    op: str,
    backend: str,
    device: torch.device,
    dtypes: tuple[torch.dtype, ...],
    phase: str = "forward",
    **meta: object,
) -> Backend:
    """The backend object that runs `phase` of `op` for a call with these properties."""
    if backend == "auto":
        backend = _env_choice(op) or "auto"
    key = (op, phase, backend, device.type, dtypes, tuple(sorted(meta.items())))
    hit = _cache.get(key)
    if hit is not None:
        return hit
    if backend == "auto":
        reasons = []
        for name in auto_order(op, device.type):
            b = backends.get(name)
            why = b.unavailable_reason() or b.supports(op, phase, device, dtypes, **meta)
            if why is None:
                _cache[key] = b
                return b
            reasons.append(f"{name}: {why}")
        raise ValueError(f"backend: no backend can run {op} ({phase}) here: " + "; ".join(reasons))
    b = backends.get(backend)
    why = b.unavailable_reason()
    if why is not None:
        raise BackendUnavailable(f"backend: {backend!r} is not available: {why}")
    why = b.supports(op, phase, device, dtypes, **meta)
    if why is not None:
        raise ValueError(f"backend: {backend!r} cannot run {op} ({phase}) for this call: {why}")
    _cache[key] = b
    return b


def clear_cache() -> None:
    """Forget resolved choices (after changing FUSEKIT_BACKEND* variables or installing a backend)."""
    from fusekit import library

    _cache.clear()
    library.clear_plans()
