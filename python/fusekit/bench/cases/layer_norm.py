"""layer_norm cases (with bias): the N sweep, training shapes (fwd+bwd, bf16 and fp32 weights) and
small model shapes; Liger-Kernel as the peer baseline.

Byte floors: see `_norms.py` (forward 2·M·N·es + 2·N·ws; train 5·M·N·es + 5·N·ws).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from fusekit.bench.baselines import Provider
from fusekit.bench.cases import _norms
from fusekit.bench.cases._base import Case, Rand
from fusekit.bench.cases._liger import Liger
from fusekit.ops.layer_norm import SPEC

# Where the report puts this op (memory-bound ops first, then the matrix ops) and its plot marker.
REPORT_RANK = 2
MARKER = "D"

EPS = 1e-5
_REF = SPEC.reference["forward"]


@dataclass(frozen=True)
class LayerNormCase(_norms.NormCase):
    """params: M, N; optional w (weight and bias dtype), residual."""

    op: ClassVar[str] = "layer_norm"
    n_weights = 2  # weight and bias

    def forward_inputs(self, rnd: Rand) -> dict[str, Tensor]:
        inp = self._activations(rnd, shift=0.3)  # a non-zero mean, so centring matters
        n, w = self.params["N"], self.w_dtype
        inp["weight"] = rnd(n, scale=0.1, shift=1.0, dtype=w)
        inp["bias"] = rnd(n, scale=0.1, dtype=w)
        return inp

    def kwargs(self) -> dict:
        return {"eps": EPS}

    def reference(self) -> Callable[..., Tensor | tuple]:
        def layer_norm(
            x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor | None = None
        ) -> Tensor | tuple:
            y, h, _, _ = _REF(x, residual, weight, bias, EPS)
            return (y, h) if residual is not None else y

        return layer_norm


def _case(m: int, n: int, suite: str, group: str, x_label: str = "N (hidden size)", **extra) -> LayerNormCase:
    return LayerNormCase(
        {"M": m, "N": n, **extra}, "bf16", group, n if suite == "sweep" else m * n, x_label, suite
    )


def cases(suite: str, *, quick: bool, cpu: bool) -> list[Case]:
    if suite == "sweep":
        return [_case(m, n, suite, "bf16") for m, n in _norms.sweep_shapes(quick, cpu)]
    if suite == "train":
        ws = ("fp32",) if quick and cpu else ("bf16", "fp32")
        return [
            _case(m, n, suite, f"w {w}", "M·N", w=w) for m, n in _norms.train_shapes(quick, cpu) for w in ws
        ]
    if suite == "small":
        return [_case(m, n, suite, "bf16", "M·N") for m, n in _norms.small_shapes(quick, cpu)]
    return []


class LigerLayerNorm(Liger):
    def __init__(self) -> None:
        super().__init__("LigerLayerNormFunction")

    def supports(self, case: Case, device: torch.device) -> str | None:
        if case.residual:
            return "Liger has no fused residual layer_norm"
        return self.row_limit(case.params["N"])

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor | tuple]:
        ln = self.function("layer_norm", "LigerLayerNormFunction")
        return lambda x, weight, bias: ln.apply(x, weight, bias, EPS)


class TorchLayerNorm(Provider):
    """What a torch user calls: F.layer_norm (torch's fused kernels, mixed bf16/fp32 weights included)."""

    def __init__(self) -> None:
        super().__init__("torch-native", "torch.nn.functional.layer_norm (and x + residual first)")

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor | tuple]:
        n = (case.params["N"],)

        def layer_norm(
            x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor | None = None
        ) -> Tensor | tuple:
            h = x if residual is None else x + residual
            y = F.layer_norm(h, n, weight, bias, EPS)
            return y if residual is None else (y, h)

        return layer_norm


BASELINES = (TorchLayerNorm(), LigerLayerNorm())
