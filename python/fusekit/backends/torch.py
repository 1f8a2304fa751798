"""The `torch` backend: runs `fusekit.reference` (the definition of every op) on any device."""

from __future__ import annotations

import torch

from fusekit import reference
from fusekit.backends.base import Backend


class TorchBackend(Backend):
    name = "torch"

    def reduce_sum(self, out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(reference.reduce_sum(x, out.dtype))

    def rms_norm(self, out, rstd, x, weight, eps: float) -> None:
        y, r = reference.rms_norm(x, weight, eps)
        out.copy_(y)
        rstd.copy_(r)

    def layer_norm(self, out, mean, rstd, x, weight, bias, eps: float) -> None:
        y, m, r = reference.layer_norm(x, weight, bias, eps)
        out.copy_(y)
        mean.copy_(m)
        rstd.copy_(r)

    def rope(self, out, x, cos, sin, start_pos: int, theta: float, interleaved: bool) -> None:
        out.copy_(reference.rope(x, cos, sin, start_pos, theta, interleaved))

    def swiglu_ffn(self, out, x, w_gate, w_up, w_down, norm_weight, eps: float) -> None:
        out.copy_(reference.swiglu_ffn(x, w_gate, w_up, w_down, norm_weight, eps))

    def attention(self, out, q, k, v, causal: bool, scale: float) -> None:
        out.copy_(reference.attention(q, k, v, causal, scale))
