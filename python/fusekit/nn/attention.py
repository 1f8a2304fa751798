"""Attention core (no projections): softmax(q k^T * scale) v with GQA, running ops.attention."""

from __future__ import annotations

from torch import Tensor, nn

from fusekit import backends, ops


class Attention(nn.Module):
    """The attention core: q [B, H, S, D], k/v [B, Hkv, Skv, D] -> [B, H, S, D] (ops.attention).

    causal: mask aligned bottom-right (query i sees key j iff j <= i + Skv - S), so decoding one token
    against a KV cache (S = 1) and chunked prefill work; forward's `causal=` overrides it per call.
    scale: None is 1/sqrt(D). GQA: H a multiple of Hkv, kv heads are not repeated. No parameters.
    Gradients flow to q, k and v.
    """

    def __init__(self, *, causal: bool = True, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__()
        self.causal = causal
        self.scale = scale
        self.backend = backends.prepare(backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool | None = None) -> Tensor:
        return ops.attention(
            q,
            k,
            v,
            causal=self.causal if causal is None else causal,
            scale=self.scale,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}, backend={self.backend!r}"
