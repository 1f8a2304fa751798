"""rms_norm cases: the N sweep, training shapes (fwd+bwd, bf16 and fp32 weights, llama casting), the
fused residual add, and small model shapes; Liger-Kernel as the peer baseline.

Byte floors: see `_norms.py` (forward 2·M·N·es + N·ws; train 5·M·N·es + 3·N·ws; with a residual
4·M·N·es forward, 8·M·N·es train).
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
from fusekit.ops.rms_norm import SPEC

# Where the report puts this op (memory-bound ops first, then the matrix ops) and its plot marker.
REPORT_RANK = 1
MARKER = "s"

EPS = 1e-6
_REF = SPEC.reference["forward"]


@dataclass(frozen=True)
class RmsNormCase(_norms.NormCase):
    """params: M, N; optional w (weight dtype), casting ("fp32" default, "llama", "gemma"), residual."""

    op: ClassVar[str] = "rms_norm"

    @property
    def casting(self) -> str:
        return self.params.get("casting", "fp32")

    def forward_inputs(self, rnd: Rand) -> dict[str, Tensor]:
        inp = self._activations(rnd)
        inp["weight"] = rnd(self.params["N"], scale=0.1, shift=1.0, dtype=self.w_dtype)
        return inp

    def kwargs(self) -> dict:
        return {"eps": EPS, "casting": self.casting}

    def reference(self) -> Callable[..., Tensor | tuple]:
        casting = self.casting

        def rms_norm(x: Tensor, weight: Tensor, residual: Tensor | None = None) -> Tensor | tuple:
            y, h, _ = _REF(x, residual, weight, EPS, casting)
            return (y, h) if residual is not None else y

        return rms_norm


def _case(m: int, n: int, suite: str, group: str, x_label: str = "N (hidden size)", **extra) -> RmsNormCase:
    return RmsNormCase(
        {"M": m, "N": n, **extra}, "bf16", group, n if suite == "sweep" else m * n, x_label, suite
    )


def cases(suite: str, *, quick: bool, cpu: bool) -> list[Case]:
    if suite == "sweep":
        return [_case(m, n, suite, "bf16") for m, n in _norms.sweep_shapes(quick, cpu)] + [
            _case(m, n, suite, "bf16 residual", residual=1) for m, n in _norms.residual_shapes(quick, cpu)
        ]
    if suite == "train":
        out = []
        for m, n in _norms.train_shapes(quick, cpu):
            for w in ("bf16", "fp32") if not (quick and cpu) else ("fp32",):
                out.append(_case(m, n, suite, f"w {w}", "M·N", w=w, casting="llama"))
        out += [
            _case(m, n, suite, "residual", "M·N", residual=1, casting="llama")
            for m, n in _norms.residual_shapes(quick, cpu)
        ]
        return out
    if suite == "small":
        return [_case(m, n, suite, "bf16", "M·N") for m, n in _norms.small_shapes(quick, cpu)]
    return []


# --- Liger-Kernel ----------------------------------------------------------------------------------------
# fusekit casting -> Liger (casting_mode, offset): Liger's "gemma" mode with offset 0 is all-fp32 math with
# one rounding, i.e. fusekit's "fp32"; "llama" is HF Llama's cast-then-scale in both.
_LIGER_MODE = {"fp32": ("gemma", 0.0), "llama": ("llama", 0.0), "gemma": ("gemma", 1.0)}


class LigerRmsNorm(Liger):
    def __init__(self) -> None:
        super().__init__(
            "LigerRMSNormFunction (in_place=False) / LigerFusedAddRMSNormFunction with a residual; "
            "casting fp32 -> Liger gemma mode with offset 0"
        )

    def supports(self, case: Case, device: torch.device) -> str | None:
        return self.row_limit(case.params["N"])

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor | tuple]:
        mode, offset = _LIGER_MODE[case.casting]
        if case.residual:
            fused = self.function("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
            return lambda x, residual, weight: fused.apply(x, residual, weight, EPS, offset, mode, False)
        rms = self.function("rms_norm", "LigerRMSNormFunction")
        # in_place=False: in place, Liger's backward overwrites dy, which the timed loop reuses.
        return lambda x, weight: rms.apply(x, weight, EPS, offset, mode, False)


class TorchRmsNorm(Provider):
    """What a torch user calls: F.rms_norm (fused on a GPU when x and weight share a dtype), after
    h = x + residual in x's dtype when there is one. With an fp32 weight and bf16/fp16 x (the train
    suite's `w fp32` rows) torch has no fused kernel and F.rms_norm runs its unfused composite: a ratio
    against this provider there measures that path; torch-compile is the fused peer for those rows."""

    def __init__(self) -> None:
        super().__init__("torch-native", "torch.nn.functional.rms_norm (and x + residual first)")

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor | tuple]:
        n = (case.params["N"],)

        def rms_norm(x: Tensor, weight: Tensor, residual: Tensor | None = None) -> Tensor | tuple:
            h = x if residual is None else x + residual
            y = F.rms_norm(h, n, weight, EPS)
            return y if residual is None else (y, h)

        return rms_norm


BASELINES = (TorchRmsNorm(), LigerRmsNorm())
