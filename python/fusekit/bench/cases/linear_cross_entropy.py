"""linear_cross_entropy cases: the loss of a Llama-3-8B LM head (H 4096, V 128256, bf16) over a token
sweep (forward: the eval loss) and a training step at T 8192 (issue #12); Liger-Kernel's
LigerFusedLinearCrossEntropyLoss as the peer baseline. torch eager and torch.compile time what HF writes:
`F.cross_entropy(F.linear(x, weight).float(), target)`, which holds the [T, V] logits in bf16 and fp32
(and their gradient in training): the harness's peak memory (`peak_mem_bytes`) beside the time is the
point of this op.

FLOPs: the logits GEMM 2·T·H·V; train adds d x and d weight, 6·T·H·V in all.
Byte floor (es = element size): x and weight read once, (T·H + V·H)·es + 8·T (targets); train also writes
d x and d weight, (2·T·H + 2·V·H)·es + 8·T. The chunked logits never need to leave the L2 in principle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from fusekit.bench.cases._base import GRAD, Case, Rand
from fusekit.bench.cases._liger import Liger

REPORT_RANK = 6
MARKER = "P"


def hf_loss(x: Tensor, weight: Tensor, target: Tensor) -> Tensor:
    """HF's causal-LM loss on given logits rows: the logits in x's dtype, upcast to fp32 (fp64 stays)."""
    z = F.linear(x, weight)
    return F.cross_entropy(z if z.dtype == torch.float64 else z.float(), target)


@dataclass(frozen=True)
class LinearCrossEntropyCase(Case):
    """params: T (tokens), H (hidden size), V (vocabulary); reduction "mean", ~1/8 of the rows ignored."""

    op: ClassVar[str] = "linear_cross_entropy"

    def forward_inputs(self, rnd: Rand) -> dict[str, Tensor]:
        t, h, v = self.params["T"], self.params["H"], self.params["V"]
        target = torch.randint(0, v, (t,), generator=rnd.gen, device=rnd.device)
        target[::8] = -100  # padding / prompt tokens, as a training batch has
        return {"x": rnd(t, h), "weight": rnd(v, h, scale=h**-0.5), "target": target}

    def output_shapes(self, fwd: dict[str, Tensor]) -> list[tuple[int, ...]]:
        return [(1,)]  # drawn as [1] (Rand needs a size), fed back 0-d: see make_inputs

    def make_inputs(self, device: str | torch.device, gen: torch.Generator) -> dict[str, Tensor]:
        inputs = super().make_inputs(device, gen)
        if self.train:
            inputs[f"{GRAD}0"] = inputs[f"{GRAD}0"].reshape(())  # the loss is 0-d
        return inputs

    def reference(self) -> Callable[..., Tensor]:
        return hf_loss

    def bytes_moved(self) -> int:
        t, h, v = self.params["T"], self.params["H"], self.params["V"]
        k = 2 if self.train else 1
        return k * (t * h + v * h) * self.torch_dtype.itemsize + 8 * t

    def flops(self) -> int:
        p = self.params
        return (6 if self.train else 2) * p["T"] * p["H"] * p["V"]


def cases(suite: str, *, quick: bool, cpu: bool) -> list[Case]:
    h, v = (64, 1031) if cpu else (4096, 128256)
    if suite == "sweep":
        if cpu:
            ts = [9, 64] if quick else [9, 64, 256]
        else:
            ts = [1024, 8192] if quick else [512, 1024, 2048, 4096, 8192, 16384]
        return [
            LinearCrossEntropyCase({"T": t, "H": h, "V": v}, "bf16", f"H={h},V={v}", t, "T (tokens)")
            for t in ts
        ]
    if suite == "train":
        ts = ([37] if quick else [37, 128]) if cpu else ([8192] if quick else [4096, 8192])
        return [
            LinearCrossEntropyCase({"T": t, "H": h, "V": v}, "bf16", f"H={h},V={v}", t, "T (tokens)", suite)
            for t in ts
        ]
    return []


class LigerFLCE(Liger):
    def __init__(self) -> None:
        super().__init__("LigerFusedLinearCrossEntropyLoss (chunked logits, gradients in the forward)")

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor]:
        import importlib

        mod = importlib.import_module("liger_kernel.transformers.fused_linear_cross_entropy")
        loss_fn = mod.LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")

        def call(x: Tensor, weight: Tensor, target: Tensor) -> Tensor:
            out = loss_fn(weight, x, target)  # Liger's order: (lin_weight, _input, target)
            return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

        return call


BASELINES = (LigerFLCE(),)
