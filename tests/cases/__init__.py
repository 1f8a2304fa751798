"""Conformance cases, one module per op (named like the op): shapes, inputs, and a float64 oracle.

Each module defines:
- `DTYPES`: the input dtypes to test; `GRAD`: which of them get a gradient check; optionally
  `CUDA_DTYPES` where CUDA takes fewer (attention: no fp32 on CUDA, refused with a TypeError);
- `CPU` / `CUDA`: case dicts (CUDA adds benchmark-sized ones on `--device cuda`);
- `make(case, dtype, device) -> (args, kwargs)`: fresh random inputs (never zeros) for `ops.<op>`;
- `oracle(*args, **kwargs) -> tuple`: the op's outputs, in the public return order, in float64 (int64
  for integer sums), written from the op's definition independently of `fusekit.ops` and
  differentiable, so float64 autograd of it is the gradient oracle;
- optionally `scale(args, kwargs) -> tuple` of per-output error scales (sums that may cancel).

An oracle that rounds an intermediate to the activations' dtype, as the op defines (the norms' h = x +
residual, rms_norm's "llama" cast), does so with `round_as`: the backward driver calls the oracle on
float64 copies of the inputs (autograd leaves), and inside `activations(dtype)` those still round to
`dtype`, so the gradient oracle is the derivative at the rounded values the kernels compute with.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from fusekit.ops import OPS


def module(op: str):
    return importlib.import_module(f"cases.{op}")


def dtypes(mod, device: str) -> tuple[torch.dtype, ...]:
    """The dtypes an op's module tests on this device."""
    return getattr(mod, "CUDA_DTYPES", mod.DTYPES) if device == "cuda" else mod.DTYPES


def randn(
    *shape: int, dtype: torch.dtype, device: str, scale: float = 1.0, shift: float = 0.0
) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale + shift).to(dtype)


_ACTIVATIONS: ContextVar[torch.dtype | None] = ContextVar("activations", default=None)


@contextmanager
def activations(dtype: torch.dtype) -> Iterator[None]:
    """Within: an oracle's float64 inputs stand for `dtype` tensors (the backward's float64 leaves)."""
    token = _ACTIVATIONS.set(dtype)
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def round_as(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`t` rounded to x's dtype, in float64; autograd passes straight through (as the kernels' backward
    uses the rounded value). x float64 inside `activations(dtype)` is a float64 copy of a `dtype` input:
    `dtype` then."""
    dtype = x.dtype
    if dtype == torch.float64 and _ACTIVATIONS.get() is not None:
        dtype = _ACTIVATIONS.get()
    return t.to(dtype).to(torch.float64)


__all__ = ["OPS", "activations", "dtypes", "module", "randn", "round_as"]
