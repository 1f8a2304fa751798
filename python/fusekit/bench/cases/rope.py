"""rope cases: one x [B, S, H, D] over the S sweep; q and k together (a layer's rope: q with H heads, k
with Hkv heads) for training (fwd+bwd) and for one decode token; Liger-Kernel as the peer baseline.

fusekit computes the angles in-kernel (theta 1e4, HF halves; start_pos 0, or 2047 for the decode
token); the torch-eager/compile baselines and Liger read cos/sin tables built once per case outside
the timed call, as HF builds them once per model.

Byte floor (es = element size): x read and written, 2·B·S·H·D·es; q+k: 2·B·S·(H + Hkv)·D·es forward,
twice that for train (the backward reads dy and writes dx for both). The tables are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from fusekit.bench.cases._base import Case, Rand
from fusekit.bench.cases._liger import Liger
from fusekit.ops.rope import SPEC, tables

# Where the report puts this op (memory-bound ops first, then the matrix ops) and its plot marker.
REPORT_RANK = 3
MARKER = "^"

THETA = 10000.0
_REF = SPEC.reference["forward"]


@dataclass(frozen=True)
class RopeCase(Case):
    """params: B, S, H, D (one x), plus Hkv for a q [B, S, H, D] and k [B, S, Hkv, D] pair, and pos (the
    first position, start_pos; default 0)."""

    op: ClassVar[str] = "rope"

    @property
    def pos(self) -> int:
        return self.params.get("pos", 0)

    @property
    def qk(self) -> bool:
        return "Hkv" in self.params

    def forward_inputs(self, rnd: Rand) -> dict[str, Tensor]:
        p = self.params
        if not self.qk:
            return {"x": rnd(p["B"], p["S"], p["H"], p["D"])}
        return {"q": rnd(p["B"], p["S"], p["H"], p["D"]), "k": rnd(p["B"], p["S"], p["Hkv"], p["D"])}

    def output_shapes(self, fwd: dict[str, Tensor]) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in fwd.values()]

    def fusekit(self, backend: str) -> Callable[..., Tensor | tuple]:
        from fusekit.ops import rope

        kw = {"start_pos": self.pos, "theta": THETA, "backend": backend}
        if not self.qk:
            return lambda x: rope(x, **kw)
        return lambda q, k: rope(q, k, **kw)  # one launch for both, as Liger's liger_rotary_pos_emb

    def reference(self) -> Callable[..., Tensor | tuple]:
        pos = self.pos

        def one(t: Tensor) -> Tensor:
            return _REF(t, None, None, None, None, pos, THETA, False)[0]

        return (lambda x: one(x)) if not self.qk else (lambda q, k: (one(q), one(k)))

    def eager(self) -> Callable[..., Tensor | tuple]:
        # HF-style: cos/sin tables are built once per model, so they are not part of the timed call
        # (computing them inside the compiled graph made inductor recompute sin/cos per element).
        cache: dict[tuple, tuple[Tensor, Tensor]] = {}
        pos = self.pos

        def one(t: Tensor) -> Tensor:
            key = (t.shape[1], t.shape[3], t.device)
            if key not in cache:
                cache[key] = tables(torch.arange(pos + t.shape[1], device=t.device), t.shape[3], THETA)
            cos, sin = cache[key]
            return _REF(t, cos, sin, None, None, pos, THETA, False)[0]

        return (lambda x: one(x)) if not self.qk else (lambda q, k: (one(q), one(k)))

    def bytes_moved(self) -> int:
        p = self.params
        heads = p["H"] + p.get("Hkv", 0)
        return (4 if self.train else 2) * p["B"] * p["S"] * heads * p["D"] * self.torch_dtype.itemsize


def cases(suite: str, *, quick: bool, cpu: bool) -> list[Case]:
    if suite == "sweep":
        if cpu:
            shapes = [(1, 128, 8, 64)] if quick else [(1, s, 8, 64) for s in (16, 128, 1024)]
            return [RopeCase(dict(zip("BSHD", s)), "bf16", "B=1", s[1], "S") for s in shapes]
        out = [RopeCase({"B": 16, "S": 4096, "H": 32, "D": 128}, "bf16", "B=16", 4096, "S")]
        seqs = [128, 16384] if quick else [1, 16, 128, 1024, 4096, 16384, 65536]
        return out + [RopeCase({"B": 1, "S": s, "H": 32, "D": 128}, "bf16", "B=1", s, "S") for s in seqs]
    if suite == "train":
        p = (
            {"B": 1, "S": 16, "H": 4, "Hkv": 2, "D": 64}
            if cpu
            else {"B": 4, "S": 2048, "H": 32, "Hkv": 8, "D": 128}
        )
        return [RopeCase(p, "bf16", "q+k", p["B"] * p["S"], "B·S", suite)]
    if suite == "small":
        # One decode token after a 2047-token prompt (at position 0 the rotation is the identity).
        p = {"B": 1, "S": 1, "H": 32, "Hkv": 8, "D": 128, "pos": 2047}
        return [RopeCase(p, "bf16", "q+k decode", 1, "tokens", suite)]
    return []


class LigerRope(Liger):
    """q and k in one call, on [B, H, S, D] views of fusekit's [B, S, H, D] tensors (Liger transposes
    back to that storage order itself, so no copy); cos/sin [1, S, D] fp32 with duplicated halves."""

    def __init__(self) -> None:
        super().__init__("LigerRopeFunction (q and k in one call, in place)")

    def supports(self, case: Case, device: torch.device) -> str | None:
        return None if case.qk else "Liger rotates q and k together; this case has one x"

    def mutates_inputs(self, case: Case) -> bool:
        return True  # in place on q and k, and in the backward on their gradients

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor | tuple]:
        fn = self.function("rope", "LigerRopeFunction")
        s, d, pos = case.params["S"], case.params["D"], case.pos
        cos, sin = tables(torch.arange(pos, pos + s, device=device), d, THETA)
        cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]

        def liger_rope(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
            qo, ko = fn.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return qo.transpose(1, 2), ko.transpose(1, 2)

        return liger_rope


BASELINES = (LigerRope(),)
