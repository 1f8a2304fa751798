"""reduce_sum cases: whole-tensor sums (fp32, bf16 -> fp32) from 2^10 to 2^30 elements and row sums,
against CUB's DeviceReduce::Sum.

Byte floor: x read once, the sums written once (m·n·es + m·out_es). No FLOPs counted: a sum is
memory-bound. No "train" or "small" suite: the gradient is a broadcast view (no kernel, no traffic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from fusekit import tolerances
from fusekit.bench.baselines import Provider
from fusekit.bench.cases._base import DTYPES, Case, Rand
from fusekit.ops.reduce_sum import SPEC, _acc

# Where the report puts this op (memory-bound ops first, then the matrix ops) and its plot marker.
REPORT_RANK = 0
MARKER = "o"

_REF = SPEC.reference["forward"]


@dataclass(frozen=True)
class ReduceSumCase(Case):
    """params: n, optional m (row sums of [m, n]; absent: the sum of all n elements), out (output dtype)."""

    op: ClassVar[str] = "reduce_sum"

    @property
    def whole(self) -> bool:
        return self.params.get("m") is None

    @property
    def out_dtype(self) -> torch.dtype:
        out = self.params.get("out")
        return DTYPES[out] if out is not None else self.torch_dtype

    def forward_inputs(self, rnd: Rand) -> dict[str, Tensor]:
        # A positive mean keeps the sum away from zero, so the relative error measures rounding,
        # not cancellation.
        n = self.params["n"]
        return {"x": rnd(n, shift=0.5) if self.whole else rnd(self.params["m"], n, shift=0.5)}

    def kwargs(self) -> dict:
        kw: dict = {"dim": None if self.whole else -1}
        if self.params.get("out") is not None:
            kw["dtype"] = self.out_dtype
        return kw

    def reference(self) -> Callable[..., Tensor]:
        # the spec's reference sums rows: a whole-tensor sum is one row, its [1] result the op's 0-d one
        if self.whole:
            return lambda x: _REF(x.reshape(1, -1))[0].reshape(())
        return lambda x: _REF(x)[0]

    def eager(self) -> Callable[..., Tensor]:
        # what a user writes: torch.sum accumulating in the wide dtype (the reference's x.to(fp32).sum()
        # first materialized an fp32 copy of a bf16 x: 4008 us at 2^30 on the H200 against torch.sum's
        # ~490, an 8x "speedup" over a baseline nobody would write)
        dim, out, acc = (None if self.whole else -1), self.out_dtype, _acc(self.torch_dtype)
        return lambda x: torch.sum(x, dim=dim, dtype=acc).to(out)

    def backend_query(self) -> tuple[tuple[torch.dtype, ...], dict]:
        return (self.torch_dtype, self.out_dtype), {}

    def tolerance(self, out: Tensor, phase: str) -> float:
        # The inputs are exact in their dtype and the sum accumulates in fp32: the output's rounding is
        # the only one, so its dtype's bound applies (bf16 -> fp32 is held to fp32's).
        return tolerances.rtol(self.op, self.out_dtype, phase)

    def bytes_moved(self) -> int:
        m = self.params.get("m") or 1
        return m * self.params["n"] * self.torch_dtype.itemsize + m * self.out_dtype.itemsize


def cases(suite: str, *, quick: bool, cpu: bool) -> list[Case]:
    if suite != "sweep":
        return []
    out: list[Case] = []
    if cpu:
        sizes = [2**10, 2**16] if quick else [2**k for k in range(10, 25, 2)]
    else:
        sizes = [2**10, 2**16, 2**24, 2**30] if quick else [2**k for k in range(10, 31, 2)]
    out += [ReduceSumCase({"n": n}, "fp32", "fp32 all", n, "elements") for n in sizes]
    if quick:
        bf = sizes[-1:] if cpu else sizes[-2:]
    else:
        bf = [n for n in sizes if n >= 2**16]
    out += [ReduceSumCase({"n": n, "out": "fp32"}, "bf16", "bf16->fp32 all", n, "elements") for n in bf]
    if cpu:
        rows = [(256, 1024)] if quick else [(1024, 1024), (64, 16384)]
    else:
        rows = [(32768, 8192)] if quick else [(262144, 1024), (32768, 8192), (2048, 131072), (8, 2**25)]
    out += [ReduceSumCase({"m": m, "n": n}, "fp32", "fp32 rows", m * n, "elements") for m, n in rows]
    return out


class CubSum(Provider):
    """cub::DeviceReduce::Sum over the whole fp32 tensor (benchmarks/baselines/cub_sum.cu)."""

    def __init__(self) -> None:
        super().__init__("cub", "cub::DeviceReduce::Sum (fp32, whole tensor)")
        self._error: str | None = None

    def available(self, device: torch.device) -> str | None:
        return None if device.type == "cuda" else "CUB is CUDA's; this run is on the CPU"

    def supports(self, case: Case, device: torch.device) -> str | None:
        if case.dtype != "fp32" or not case.whole or case.params.get("out"):
            return "CUB baseline covers the fp32 whole-tensor sum only"
        if self._error is None:
            try:
                from fusekit.bench import cub

                cub.load()
            except Exception as exc:
                self._error = f"CUB build failed: {type(exc).__name__}: {str(exc)[-800:]}"
            else:
                self._error = ""
        return self._error or None

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor]:
        from fusekit.bench import cub

        mod = cub.load()
        return lambda x: mod.cub_sum(x)


BASELINES = (CubSum(),)
