"""The `torch` backend: runs each op's reference (`fusekit.ops.<op>`, forward and backward) on any device."""

from __future__ import annotations

import torch

from fusekit.backends.base import Backend


class TorchBackend(Backend):
    name = "torch"
    writes_strides = True  # copy_ writes the reference's values into any layout

    def supports(
        self, op: str, phase: str, device: torch.device, dtypes: tuple[torch.dtype, ...], **meta: object
    ) -> str | None:
        return None

    def run(self, spec, phase: str, outputs: tuple, inputs: tuple, scalars: tuple) -> None:
        if spec.reference_fills:
            spec.reference[phase](*outputs, *inputs, *scalars)
            return
        for out, value in zip(outputs, spec.reference[phase](*inputs, *scalars)):
            if out is not None:
                out.copy_(value)
