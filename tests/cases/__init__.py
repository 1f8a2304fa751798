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
"""

from __future__ import annotations

import importlib

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


__all__ = ["OPS", "dtypes", "module", "randn"]
