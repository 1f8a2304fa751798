"""What the two norms' cases (RMSNorm, LayerNorm) share: shapes per suite, inputs, byte floors.

Byte floor (es = x's element size, ws = the weight's; M×N activations):
- forward: x read, y written, weight (and bias) read: 2·M·N·es + (1 or 2)·N·ws;
  with residual: x and residual read, y and h = x + residual written: 4·M·N·es.
- train (forward + backward): the forward's, then the backward reads the normalized input (x, or h)
  and dy (and dh with a residual) and writes dx once (it is also d residual): 5·M·N·es
  (x twice, dy, y, dx), 8·M·N·es with a residual (x, residual, y, h, h, dy, dh, dx); weights read
  twice and their gradients written: 3·N·ws (RMSNorm), 5·N·ws (LayerNorm: + bias read, db written).
  The per-row statistics (mean/rstd, 4–8 bytes a row) are left out: a kernel may recompute them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fusekit.bench.cases._base import DTYPES, Case, Rand


@dataclass(frozen=True)
class NormCase(Case):
    """params: M, N; optional w (weight dtype, default x's), residual (1: fused residual add)."""

    n_weights = 1  # tensors of N elements in weight dtype read by the forward (1, or 2 with a bias)

    @property
    def w_dtype(self) -> torch.dtype:
        return DTYPES[self.params.get("w", self.dtype)]

    @property
    def residual(self) -> bool:
        return bool(self.params.get("residual"))

    def _activations(self, rnd: Rand, shift: float = 0.0) -> dict[str, Tensor]:
        m, n = self.params["M"], self.params["N"]
        out = {"x": rnd(m, n, shift=shift)}
        if self.residual:
            out["residual"] = rnd(m, n)
        return out

    def output_shapes(self, fwd: dict[str, Tensor]) -> list[tuple[int, ...]]:
        shape = tuple(fwd["x"].shape)
        return [shape, shape] if self.residual else [shape]

    def backend_query(self) -> tuple[tuple[torch.dtype, ...], dict]:
        return (self.torch_dtype, self.w_dtype), {}

    def bytes_moved(self) -> int:
        mn, n = self.params["M"] * self.params["N"], self.params["N"]
        es, ws = self.torch_dtype.itemsize, self.w_dtype.itemsize
        if self.train:
            # weights: read by the forward, the weight read again by the backward, every gradient written
            return (8 if self.residual else 5) * mn * es + (2 * self.n_weights + 1) * n * ws
        return (4 if self.residual else 2) * mn * es + self.n_weights * n * ws


def sweep_shapes(quick: bool, cpu: bool) -> list[tuple[int, int]]:
    if cpu:
        return [(256, 1024), (16, 8192)] if quick else [(2**20 // n, n) for n in (512, 2048, 8192, 32768)]
    ns = [8192, 65536] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
    # ~512 MiB of bf16 per tensor (2^28 elements), far beyond the 60 MB L2; 16384×65536 is 2 GiB.
    shapes = [(2**28 // n, n) for n in ns]
    if not quick:
        shapes.append((16384, 65536))
    return shapes


def train_shapes(quick: bool, cpu: bool) -> list[tuple[int, int]]:
    """Llama-7B/13B and 70B-class hidden sizes at 32K / 16K tokens (issue 10)."""
    if cpu:
        return [(64, 256)] if quick else [(64, 256), (33, 760)]
    return [(16384, 8192)] if quick else [(32768, 4096), (16384, 8192)]


def residual_shapes(quick: bool, cpu: bool) -> list[tuple[int, int]]:
    if cpu:
        return [(64, 256)]
    return [(16384, 8192)] if quick else [(16384, 8192), (4096, 4096)]


def small_shapes(quick: bool, cpu: bool) -> list[tuple[int, int]]:
    """One decode token, a decode batch, a short prefill (issue 11): launch cost shows here."""
    if cpu:
        return [(1, 4096), (32, 8192)] if quick else [(1, 4096), (32, 8192), (4096, 4096)]
    return [(1, 4096), (32, 8192), (4096, 4096)]
