"""The `triton` backend: binds the kernels in `kernels_triton/` (one file per op) to the provider API.

On a CUDA/ROCm device the kernels are compiled by Triton; on the CPU they run in Triton's interpreter,
which must be switched on (TRITON_INTERPRET=1) before triton is first imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

from fusekit.backends.base import Backend

# The interpreter's bf16 tl.dot is wrong (TRITON_FACTS.md): refuse rather than return garbage.
_DOT_OPS = ("swiglu_ffn", "attention")


def _has_kernel(op: str) -> bool:
    try:
        return importlib.util.find_spec(f"kernels_triton.{op}") is not None
    except ModuleNotFoundError:  # the kernels_triton package itself is missing
        return False


class TritonBackend(Backend):
    name = "triton"
    install_hint = "pip install 'fusekit[triton]'"

    def _load(self) -> None:
        import triton  # noqa: F401 - raises ImportError with the reason when missing

        self._interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"

    def _kernels(self, op: str) -> ModuleType:
        return importlib.import_module(f"kernels_triton.{op}")

    def supports(self, op: str, device: torch.device, dtype: torch.dtype, **meta: object) -> str | None:
        if not _has_kernel(op):
            return f"kernels_triton/{op}.py is not part of this installation"
        if device.type == "cpu":
            if not self._interpret:
                return (
                    "triton runs on the CPU only in its interpreter: set TRITON_INTERPRET=1 before "
                    "triton is imported"
                )
            if op in _DOT_OPS and dtype == torch.bfloat16:
                return "the Triton CPU interpreter computes bf16 tl.dot wrongly; run bf16 on a GPU"
        elif device.type != "cuda":
            return f"triton does not run on device type {device.type!r}"
        elif self._interpret:
            return "TRITON_INTERPRET=1 is set, so triton cannot launch on the GPU"
        return None

    def reduce_sum(self, out, x) -> None:
        self._kernels("reduce_sum").reduce_sum(out, x)

    def rms_norm(self, out, rstd, x, weight, eps: float) -> None:
        self._kernels("rms_norm").rms_norm(out, rstd, x, weight, eps)

    def layer_norm(self, out, mean, rstd, x, weight, bias, eps: float) -> None:
        self._kernels("layer_norm").layer_norm(out, mean, rstd, x, weight, bias, eps)

    def rope(self, out, x, cos, sin, start_pos: int, theta: float, interleaved: bool) -> None:
        self._kernels("rope").rope(out, x, cos, sin, start_pos, theta, interleaved)

    def swiglu_ffn(self, out, x, w_gate, w_up, w_down, norm_weight, eps: float) -> None:
        self._kernels("swiglu_ffn").swiglu_ffn(out, x, w_gate, w_up, w_down, norm_weight, eps)

    def attention(self, out, q, k, v, causal: bool, scale: float) -> None:
        self._kernels("attention").attention(out, q, k, v, causal, scale)
