"""swiglu_ffn cases (the Llama MLP without the fused norm): the token sweep at D 4096, F 11008 (and on the
GPU at Llama-3-8B's, Qwen2-7B's and Llama-3-70B's (D, F) for T 1, 16, 128, 4096, 8192), and
training at T 4096 for F 11008 (Llama-2-7B) and 14336 (Llama-3-8B); cuBLAS-only and Liger baselines.

FLOPs: forward three T×D×F products, 6·T·D·F; train adds the backward's six (dh, dW_down, the two
halves of dxn, dW_gate, dW_up), 18·T·D·F in all (the saved gate/up pre-activations spare a recompute).
Byte floor (es = element size): forward x, the three weights read and y written, (2·T·D + 3·F·D)·es;
train also reads dy, x and the weights again and writes dx and the three weight gradients,
(5·T·D + 9·F·D)·es. The [T, F] activations are left out (compute-bound at these sizes anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from fusekit.bench.baselines import Provider
from fusekit.bench.cases._base import Case, Rand
from fusekit.bench.cases._liger import Liger
from fusekit.ops.swiglu_ffn import SPEC

# Where the report puts this op (memory-bound ops first, then the matrix ops) and its plot marker.
REPORT_RANK = 4
MARKER = "v"

EPS = 1e-6
_REF = SPEC.reference["forward"]


def native_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """What a user writes in torch: three native-dtype products (cuBLAS on a GPU, fp32 accumulation)."""
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


@dataclass(frozen=True)
class SwigluFfnCase(Case):
    """params: T (tokens), D (model dim), F (hidden dim)."""

    op: ClassVar[str] = "swiglu_ffn"

    def forward_inputs(self, rnd: Rand) -> dict[str, Tensor]:
        t, d, f = self.params["T"], self.params["D"], self.params["F"]
        # Weights scaled like a trained layer (std 1/sqrt(fan_in)) so activations stay O(1).
        return {
            "x": rnd(t, d),
            "w_gate": rnd(f, d, scale=d**-0.5),
            "w_up": rnd(f, d, scale=d**-0.5),
            "w_down": rnd(d, f, scale=f**-0.5),
        }

    def reference(self) -> Callable[..., Tensor]:
        return lambda x, w_gate, w_up, w_down: _REF(x, w_gate, w_up, w_down, None, EPS)[0]

    def eager(self) -> Callable[..., Tensor]:
        # The reference upcasts to fp32 (it defines the precision), which would make torch eager and
        # torch.compile straw men; they run the native-dtype products a user would.
        return native_ffn

    def bytes_moved(self) -> int:
        t, d, f = self.params["T"], self.params["D"], self.params["F"]
        td, fd = (5 * t * d, 9 * f * d) if self.train else (2 * t * d, 3 * f * d)
        return (td + fd) * self.torch_dtype.itemsize

    def flops(self) -> int:
        p = self.params
        return (18 if self.train else 6) * p["T"] * p["D"] * p["F"]


MODEL_SHAPES = ((4096, 14336), (3584, 18944), (8192, 28672))  # (D, F) swept beside Llama-2-7B's 4096 x 11008


def cases(suite: str, *, quick: bool, cpu: bool) -> list[Case]:
    if suite == "sweep":
        if cpu:
            d, f = 256, 512
            ts = [1, 16] if quick else [1, 16, 128]
        else:
            d, f = 4096, 11008
            ts = [1, 256, 4096] if quick else [1, 16, 64, 256, 1024, 4096, 8192]
        sweeps = [(d, f, ts)]
        if not (cpu or quick):  # issue 14's model shapes: Llama-3-8B / Mistral-7B, Qwen2-7B, Llama-3-70B
            sweeps += [(dd, ff, [1, 16, 128, 4096, 8192]) for dd, ff in MODEL_SHAPES]
        return [
            SwigluFfnCase({"T": t, "D": dd, "F": ff}, "bf16", f"D={dd},F={ff}", t, "T (tokens)")
            for dd, ff, tts in sweeps
            for t in tts
        ]
    if suite == "train":
        if cpu:
            shapes = [(16, 64, 128)] if quick else [(16, 64, 128), (9, 64, 176)]
        else:
            shapes = [(4096, 4096, 11008)] if quick else [(4096, 4096, 11008), (4096, 4096, 14336)]
        return [
            SwigluFfnCase({"T": t, "D": d, "F": f}, "bf16", f"T={t}", f, "F", suite) for t, d, f in shapes
        ]
    return []


class CublasFFN(Provider):
    def __init__(self) -> None:
        super().__init__("cublas", "three torch matmuls (cuBLAS) + silu*mul, unfused")

    def available(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "cuBLAS is CUDA's; on the CPU torch-eager already times these three matmuls"
        return None

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor]:
        return native_ffn


class LigerFFN(Liger):
    def __init__(self) -> None:
        super().__init__("LigerSiLUMulFunction between torch GEMMs (Liger's LlamaMLP)")

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor]:
        silu_mul = self.function("swiglu", "LigerSiLUMulFunction")
        return lambda x, w_gate, w_up, w_down: silu_mul.apply(x @ w_gate.T, x @ w_up.T) @ w_down.T


BASELINES = (CublasFFN(), LigerFFN())
