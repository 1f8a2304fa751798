"""Liger-Kernel (linkedin/Liger-Kernel, `pip install liger-kernel`) as an optional baseline.

Its ops are `torch.autograd.Function`s with Triton kernels, forward and backward, so one provider
covers the forward suites and the "train" suite. Each op's cases module names the
`liger_kernel.ops.<module>.<Function>` it times (checked against 0.8.5; see shared/notes/PEERS_FACTS.md):
the RMSNorm, fused add + RMSNorm, LayerNorm, rope (in place on q/k and on their gradients) and SiLU·mul
functions (the MLP's GEMMs stay in torch).
"""

from __future__ import annotations

import importlib

import torch

from fusekit.bench.baselines import Provider

# Liger's row kernels take the whole row in one block: calculate_settings() refuses
# next_power_of_2(N) > 65536.
MAX_FUSED_SIZE = 65536


class Liger(Provider):
    """Base of the per-op Liger providers: one name, "liger", in every op's results."""

    def __init__(self, description: str) -> None:
        super().__init__("liger", f"Liger-Kernel {description}")
        self._reason: str | None = None
        self._checked = False

    def available(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "Liger-Kernel is Triton kernels for a GPU; this run is on the CPU"
        if not self._checked:
            self._checked = True
            try:
                import liger_kernel  # noqa: F401
            except Exception as exc:
                self._reason = (
                    f"liger_kernel is not importable ({type(exc).__name__}: {exc}); pip install liger-kernel"
                )
        return self._reason

    @staticmethod
    def function(module: str, name: str):
        return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), name)

    @staticmethod
    def row_limit(n: int) -> str | None:
        if 1 << max(0, n - 1).bit_length() > MAX_FUSED_SIZE:
            return f"Liger's row kernels take N <= {MAX_FUSED_SIZE} (calculate_settings), N = {n}"
        return None
