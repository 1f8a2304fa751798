"""One validation layer for every backend: clear errors that name the offending argument.

Type problems (not a tensor, wrong dtype) raise TypeError; value problems (shape, device, ranges,
head dim) raise ValueError. Every message starts with the argument's name. These checks use only
shapes, dtypes and devices, so torch.compile traces through them without graph breaks.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)
HEAD_DIMS = (64, 128, 256)
DEVICE_TYPES = ("cpu", "cuda")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], ndim: int | None = None) -> torch.Tensor:
    """Check that `t` is a tensor of an allowed dtype (and rank), on a supported device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(
            f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not supported; expected one of {_names(dtypes)}"
        )
    if t.device.type not in DEVICE_TYPES:
        raise ValueError(f"{name}: device {t.device} is not supported; expected a CPU or CUDA tensor")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def like(name: str, t: object, ref_name: str, ref: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Check that `t` matches `ref` in dtype and device and has exactly `shape`."""
    tensor(name, t, (ref.dtype,))
    assert isinstance(t, torch.Tensor)
    if t.device != ref.device:
        raise ValueError(f"{name}: is on {t.device} but {ref_name} is on {ref.device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def number(name: str, v: object, *, positive: bool = False, nonnegative: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
    if not math.isfinite(v) or (positive and v <= 0) or (nonnegative and v < 0):
        need = "positive" if positive else "non-negative" if nonnegative else "finite"
        raise ValueError(f"{name}: must be {need} and finite, got {v}")
    return float(v)


def backend_name(backend: object) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a string, got {type(backend).__name__}")
    return backend


# --- per op ----------------------------------------------------------------------------------------


def reduce_sum(x: object, dim: object, dtype: object) -> torch.dtype:
    """Returns the output dtype (torch.sum's rule: integers -> int64, floats keep their dtype)."""
    x = tensor("x", x, FLOAT_DTYPES + INT_DTYPES)
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim: expected None or an int, got {type(dim).__name__}")
        nd = max(x.dim(), 1)
        if not -nd <= dim < nd:
            raise ValueError(f"dim: {dim} is out of range for a tensor with {x.dim()} dimensions")
    floating = x.dtype.is_floating_point
    allowed = FLOAT_DTYPES if floating else INT_DTYPES
    if dtype is None:
        return x.dtype if floating else torch.int64
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        raise TypeError(
            f"dtype: {dtype} is not supported for a {str(x.dtype).removeprefix('torch.')} input; expected one of {_names(allowed)}"
        )
    return dtype


def _normalized_dim(x: torch.Tensor) -> int:
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension (the normalized one), got a 0-d tensor")
    n = x.shape[-1]
    if n == 0:
        raise ValueError("x: the last (normalized) dimension must not be empty")
    return n


def rms_norm(x: object, weight: object, eps: object) -> None:
    x = tensor("x", x, FLOAT_DTYPES)
    like("weight", weight, "x", x, (_normalized_dim(x),))
    number("eps", eps, nonnegative=True)


def layer_norm(x: object, weight: object, bias: object, eps: object) -> None:
    x = tensor("x", x, FLOAT_DTYPES)
    n = _normalized_dim(x)
    like("weight", weight, "x", x, (n,))
    if bias is not None:
        like("bias", bias, "x", x, (n,))
    number("eps", eps, nonnegative=True)


def rope(x: object, start_pos: object, theta: object, cos: object, sin: object) -> None:
    x = tensor("x", x, FLOAT_DTYPES, ndim=4)
    _, s, _, d = x.shape
    if d == 0 or d % 2:
        raise ValueError(f"x: head dim (last dimension) must be even and > 0, got {d}")
    if isinstance(start_pos, bool) or not isinstance(start_pos, int):
        raise TypeError(f"start_pos: expected an int, got {type(start_pos).__name__}")
    if start_pos < 0:
        raise ValueError(f"start_pos: must be >= 0, got {start_pos}")
    number("theta", theta, positive=True)
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: give both tables or neither")
    for name, t in (("cos", cos), ("sin", sin)):
        if t is None:
            continue
        t = tensor(name, t, (*FLOAT_DTYPES, torch.float64), ndim=2)
        if t.device != x.device:
            raise ValueError(f"{name}: is on {t.device} but x is on {x.device}")
        if t.shape[1] != d // 2 or t.shape[0] < start_pos + s:
            raise ValueError(
                f"{name}: expected shape [>= start_pos + S = {start_pos + s}, D/2 = {d // 2}], got {tuple(t.shape)}"
            )


def swiglu_ffn(
    x: object, w_gate: object, w_up: object, w_down: object, norm_weight: object, eps: object
) -> None:
    x = tensor("x", x, FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., D] with D > 0, got {tuple(x.shape)}")
    d = x.shape[-1]
    w_gate = tensor("w_gate", w_gate, (x.dtype,), ndim=2)
    f = w_gate.shape[0]
    if f == 0:
        raise ValueError("w_gate: the hidden dimension F must be > 0")
    like("w_gate", w_gate, "x", x, (f, d))
    like("w_up", w_up, "x", x, (f, d))
    like("w_down", w_down, "x", x, (d, f))
    if norm_weight is not None:
        like("norm_weight", norm_weight, "x", x, (d,))
    number("eps", eps, nonnegative=True)


def attention(q: object, k: object, v: object, scale: object) -> None:
    q = tensor("q", q, FLOAT_DTYPES, ndim=4)
    if q.device.type == "cuda" and q.dtype == torch.float32:
        raise TypeError("q: float32 attention runs on the CPU only; use float16 or bfloat16 on CUDA")
    b, h, _, d = q.shape
    k = tensor("k", k, (q.dtype,), ndim=4)
    if k.device != q.device:
        raise ValueError(f"k: is on {k.device} but q is on {q.device}")
    hkv, skv = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: expected shape [B={b}, Hkv, Skv, D={d}], got {tuple(k.shape)}")
    like("v", v, "k", k, tuple(k.shape))
    if hkv == 0 or h % hkv:
        raise ValueError(f"k: q heads H={h} must be a multiple of kv heads Hkv={hkv}")
    if skv == 0:
        raise ValueError("k: the key sequence length Skv must be > 0")
    if d not in HEAD_DIMS:
        raise ValueError(
            f"q: unsupported head dim {d}; supported head dims are {', '.join(map(str, HEAD_DIMS))}"
        )
    if scale is not None:
        number("scale", scale, positive=True)
