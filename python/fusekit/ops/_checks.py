"""Shared argument checks: clear errors that name the offending argument, one rule per kind of value.

Type problems (not a tensor, wrong dtype, a str where a bool belongs) raise TypeError; value
problems (shape, device, ranges, head dim) raise ValueError. Every message starts with the argument's
name. Tensor checks use only shapes, dtypes and devices, so torch.compile traces through them.

Scalars: every float a kernel receives travels as float32 on some backend, so each must be finite
and representable in float32 (no overflow to inf, no underflow of a non-zero value to 0); rope
positions are exact up to `MAX_POSITION` (float32 angles and the Mojo params carry them).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ANY_FLOAT = (*FLOAT_DTYPES, torch.float64)  # float64 runs on the torch backend only (gradcheck, oracles)
INT_DTYPES = (torch.int32, torch.int64)
DEVICE_TYPES = ("cpu", "cuda")
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive (subnormal) float32
MAX_POSITION = 1 << 24  # rope: start_pos + S; float32 holds every integer up to here exactly


def names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], ndim: int | None = None) -> torch.Tensor:
    """Check that `t` is a tensor of an allowed dtype (and rank), on a supported device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        what = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise TypeError(
            f"{name}: expected a dense (strided) tensor, got a {what} one; call .to_dense() first"
        )
    if t.dtype not in dtypes:
        raise TypeError(
            f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not supported; expected one of {names(dtypes)}"
        )
    if t.device.type not in DEVICE_TYPES:
        raise ValueError(f"{name}: device {t.device} is not supported; expected a CPU or CUDA tensor")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: is on {t.device} but {ref_name} is on {ref.device}")


def like(
    name: str,
    t: object,
    ref_name: str,
    ref: torch.Tensor,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    """Check that `t` is on `ref`'s device, has exactly `shape`, and `ref`'s dtype (or one of `dtypes`)."""
    t = tensor(name, t, dtypes or (ref.dtype,))
    same_device(name, t, ref_name, ref)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def values_on_cpu(name: str, t: torch.Tensor, ok: Callable[[], torch.Tensor], message: str) -> bool:
    """Whether a value check of `t` is left to the caller: True in eager on the CPU, where the caller
    reads the values and raises ValueError naming them. Under torch.compile (CPU) the values are unknown
    while tracing: `ok()` (bool, all True when the values are fine) becomes a runtime assert in the graph
    (RuntimeError "name: message"; `message` names no size, which would pin a dynamic one), where
    skipping the check gave a compiled call another answer than eager's error. On CUDA values are
    trusted (a check would be a host sync per call): False, nothing computed."""
    if t.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():
        torch._assert_async(ok().all(), f"{name}: {message}")
        return False
    return True


def weight_dtypes(x: torch.Tensor) -> tuple[torch.dtype, ...]:
    """Norm weights and biases: x's dtype, or fp32 with fp16/bf16 x (mixed precision, as HF keeps them)."""
    return (x.dtype, torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else (x.dtype,)


def real(name: str, v: object, *, positive: bool = False, nonnegative: bool = False) -> float:
    """A real number that survives the trip to float32: finite, |v| <= FLT_MAX, non-zero stays non-zero."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:  # an int beyond any float
        raise ValueError(
            f"{name}: {type(v).__name__} value too large for float32 (|{name}| must be at most {FLOAT32_MAX:.4g}); "
            "the kernels compute in float32"
        ) from None
    # f - f != 0 exactly for inf and NaN; unlike math.isfinite it traces under torch.compile(dynamic=True)
    if f - f != 0 or (positive and f <= 0) or (nonnegative and f < 0):
        need = "positive and finite" if positive else "non-negative and finite" if nonnegative else "finite"
        raise ValueError(f"{name}: must be {need}, got {v}")
    if abs(f) > FLOAT32_MAX or (f != 0 and abs(f) < FLOAT32_TINY):
        raise ValueError(
            f"{name}: {v} is not representable in float32 (|{name}| must be 0 or within "
            f"[{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.4g}]); the kernels compute in float32"
        )
    return f


def flag(name: str, v: object) -> bool:
    """A real bool (numpy's bool_ too): `causal='no'` must not mean True."""
    if isinstance(v, bool):
        return v
    if type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"):
        return bool(v)
    raise TypeError(f"{name}: expected a bool, got {type(v).__name__} {v!r}")


def integer(name: str, v: object) -> int:
    """A Python int, numpy integer or 0-d integer tensor (not a bool, not a float)."""
    if isinstance(v, torch.Tensor):
        if v.dim() != 0 or v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise TypeError(
                f"{name}: expected an int or a 0-d integer tensor, got a {v.dtype} tensor {tuple(v.shape)}"
            )
        return int(v.item())
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if not -(2**63) <= int(v) < 2**63:  # 2**64 - 100 wrapped to -100 on its way to a kernel
        raise ValueError(f"{name}: {int(v)} is outside the int64 range")
    return int(v)


def choice(name: str, v: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected one of {', '.join(map(repr, allowed))}, got {type(v).__name__}")
    if v not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, allowed))}, got {v!r}")
    return v


def backend_name(backend: object) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    return backend


def normalized_dim(x: torch.Tensor) -> int:
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension (the normalized one), got a 0-d tensor")
    n = x.shape[-1]
    if n == 0:
        raise ValueError("x: the last (normalized) dimension must not be empty")
    return n


def rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] -> contiguous [M, N] (a view when x is already contiguous)."""
    if x.dim() == 2 and x.is_contiguous():  # the common case, without a view (a view costs ~1 us)
        return x
    n = x.shape[-1]
    return x.contiguous().view(-1, n) if n else x.reshape(math.prod(x.shape[:-1]), 0)
