"""Which backend runs a call: explicit argument, then environment, then the `auto` table.

Resolution order (never a silent fallback for an explicit choice):
1. `backend=` argument, when it is not "auto";
2. `FUSEKIT_BACKEND_<OP>` (e.g. FUSEKIT_BACKEND_RMS_NORM=triton), then `FUSEKIT_BACKEND`, as set when
   the first call resolved (`clear_cache()` reads them again);
3. `auto`: the first backend in the ranking for the call's device type, op and shape class
   (`AUTO_CLASSES`, generated from the committed results by `python -m fusekit.bench.auto_table`;
   the op's default order where no class was measured) that is installed and supports the call.
   Inside a CUDA graph capture `auto` skips backends that refuse capture (mojo).

A backend chosen by 1 or 2 that is missing raises BackendUnavailable with the install command; one
that cannot run this particular call raises ValueError with its reason. A call that records a
gradient resolves with phase "backward", so `auto` picks a backend that has the op's backward.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from fusekit import backends
from fusekit.backends.base import Backend, BackendUnavailable

try:  # generated, per device type, op and shape class; absent: the default orders below
    from fusekit._auto_table import AUTO_CLASSES
except ImportError:  # pragma: no cover - only while bootstrapping the generator
    AUTO_CLASSES: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {}

# The `auto` ranking per device type and op. The CUDA order follows the committed H200 benchmark
# results (benchmarks/report/README.md): the fastest backend first, the torch reference always last
# so `auto` can run everything. On the CPU the reference is the only fast path (Triton runs in an
# interpreter there and MAX's CPU kernels are not tuned), so it goes first.
_CUDA_ORDER = ("triton", "mojo", "torch")
# Per-op exceptions to those orders (none today).
AUTO: dict[str, dict[str, tuple[str, ...]]] = {"cuda": {}, "cpu": {}}


SHAPE_CLASSES = ("decode", "small", "large")
DECODE_TOKENS = 16  # rows/tokens at or below which a call is "decode"
SMALL_BYTES = 8 << 20  # input bytes below which a call is "small" (launch and host cost dominate)
# Where an op's tokens (rows) sit in its first input, forward and backward alike: norms [M, N] (dy too),
# rope [B, S, H, D] (B*S), swiglu_ffn [T, D], attention q / do [B, H, S, D] (S: the query length).
# reduce_sum and linear_cross_entropy (a training loss, never a decode step) are classed by bytes only.
_TOKEN_DIMS: dict[str, tuple[int, ...]] = {
    "rms_norm": (0,),
    "layer_norm": (0,),
    "rope": (0, 1),
    "swiglu_ffn": (0,),
    "attention": (2,),
}


def shape_class(op: str, inputs: tuple[Tensor | None, ...]) -> str:
    """The call's shape class for `auto`: "decode" when its tokens (norms' rows M, rope's B*S,
    swiglu_ffn's T, attention's query length S) are at most DECODE_TOKENS, else "small" when its
    present inputs hold fewer than SMALL_BYTES, else "large". `inputs` are the phase's inputs in spec
    order (shapes only are read: meta tensors work, as fusekit.bench.auto_table uses them)."""
    # plain loops, no generator expressions: torch.compile traces this on the grad path
    dims = _TOKEN_DIMS.get(op)
    first = inputs[0] if inputs else None
    if dims is not None and first is not None and first.dim() > max(dims):
        tokens = 1
        for d in dims:
            tokens *= first.shape[d]
        if tokens <= DECODE_TOKENS:
            return "decode"
    nbytes = 0
    for t in inputs:
        if t is not None:
            nbytes += t.numel() * t.element_size()
    return "small" if nbytes < SMALL_BYTES else "large"


def auto_shape_class(
    op: str, backend: str, device_type: str, inputs: tuple[Tensor | None, ...]
) -> str | None:
    """`shape_class` where the choice reads it (backend "auto" on a device whose ranking is per class for
    `op`), else None. Reading shapes where nothing depends on them put a guard on the token count in every
    trace: an exported program with a dynamic batch was valid for at most DECODE_TOKENS rows."""
    if backend != "auto" or not AUTO_CLASSES.get(device_type, {}).get(op):
        return None
    return shape_class(op, inputs)


def auto_order(op: str, device_type: str, shape_class: str | None = None) -> tuple[str, ...]:
    """The `auto` ranking: the measured one for the shape class, else the op's default order."""
    if device_type == "cpu":
        return AUTO["cpu"].get(op, ("torch",))
    default = AUTO["cuda"].get(op, _CUDA_ORDER)
    if shape_class is None:
        return default
    return AUTO_CLASSES.get(device_type, {}).get(op, {}).get(shape_class, default)


def capturing(device_type: str = "cuda") -> bool:
    """A CUDA graph capture is running on the current stream (never initializes CUDA)."""
    return device_type == "cuda" and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


_cache: dict[tuple, Backend] = {}
# Bumped by clear_cache(): a call that began resolving before a clear does not store its (possibly stale)
# choice or plan after it (dispatch's cache, the call plans, the call memos all check it).
generation = 0


_ENV: dict[str, str] | None = None  # FUSEKIT_BACKEND* by upper-cased name, read once (clear_cache rereads)


def _env_choice(op: str) -> tuple[str, str] | None:
    """(variable, value) of FUSEKIT_BACKEND_<OP>, else FUSEKIT_BACKEND (empty: unset), as the process had
    them at its first resolution or the last clear_cache(): a remembered call and a new one see the same
    choice (a variable changed in between reached only calls of new signatures). A value that is no
    backend raises naming the variable."""
    global _ENV
    if _ENV is None:
        _ENV = {k.upper(): v for k, v in os.environ.items() if k.upper().startswith("FUSEKIT_BACKEND") and v}
    for var in (f"FUSEKIT_BACKEND_{op.upper()}", "FUSEKIT_BACKEND"):
        value = _ENV.get(var)
        if value is not None:
            if value != "auto" and value not in backends.names():
                raise backends.unknown(var, value)
            return var, value
    return None


def resolve(
    op: str,
    backend: str,
    device: torch.device,
    dtypes: tuple[torch.dtype, ...],
    phase: str = "forward",
    shape_class: str | None = None,
    **meta: object,
) -> Backend:
    """The backend object that runs `phase` of `op` for a call with these properties. `shape_class`
    (see `shape_class()`; None: the op's default order) picks the `auto` ranking; an `auto` choice
    made inside a CUDA graph capture is cached apart from the others (the capture flag is in the key)."""
    source = "backend"  # where an explicit choice came from, for its refusal
    if backend == "auto" and (env := _env_choice(op)) is not None:
        source, backend = env  # the variable is what the caller must change
    in_capture = backend == "auto" and capturing(device.type)
    # meta in key-name order: sorting the names (constants) traces under torch.compile, sorting the
    # items (values read off tensor shapes) is a graph break
    key = (
        op,
        phase,
        backend,
        device.type,
        dtypes,
        shape_class,
        in_capture,
        tuple([(k, meta[k]) for k in sorted(meta)]),
    )
    hit = _cache.get(key)
    if hit is not None:
        return hit
    gen = generation
    if backend == "auto":
        reasons = []
        for name in auto_order(op, device.type, shape_class):
            b = backends.get(name)
            why = b.unavailable_reason() or b.supports(op, phase, device, dtypes, **meta)
            if why is None and phase != "forward":  # both phases of a call run on one backend
                why = b.supports(op, "forward", device, dtypes, **meta)
            if why is None and in_capture and not b.capture_safe:
                why = "refuses to run inside a CUDA graph capture"
            if why is None:
                if gen == generation:
                    _cache[key] = b
                return b
            reasons.append(f"{name}: {why}")
        raise ValueError(f"backend: no backend can run {op} ({phase}) here: " + "; ".join(reasons))
    b = backends.get(backend)
    why = b.unavailable_reason()
    if why is not None:
        raise BackendUnavailable(f"{source}: {backend!r} is not available: {why}")
    why = b.supports(op, phase, device, dtypes, **meta)
    if why is not None:
        raise ValueError(f"{source}: {backend!r} cannot run {op} ({phase}) for this call: {why}")
    if gen == generation:
        _cache[key] = b
    return b


def clear_cache() -> None:
    """Forget resolved choices, read the FUSEKIT_BACKEND* variables again and check again the backends
    that could not run (after changing those variables or installing a backend)."""
    from fusekit import library

    global _ENV, generation
    generation += 1
    _ENV = None
    _cache.clear()
    backends.forget_unavailable()
    library.clear_plans()
