"""Rotary position embedding: HF rope types "default" and "llama3" as cos/sin tables for ops.rope.

The inverse frequencies are computed exactly as transformers computes them (same formula, same
fp32 ops), so tables built here equal the first halves of HF's duplicated cos/sin bit for bit.
ops.rope reads tables [St, D/2] at row start_pos + s; `apply_rope` also takes one table per batch
row ([B, S, D/2], e.g. left-padded batches whose positions differ per row).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fusekit import backends, ops

ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def inv_freq(
    head_dim: int,
    theta: float = 10000.0,
    rope_type: str = "default",
    *,
    factor: float | None = None,
    low_freq_factor: float | None = None,
    high_freq_factor: float | None = None,
    original_max_position_embeddings: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """theta^(-2i/D) for i < D/2 in fp32 [D/2], rescaled for "llama3" (Llama 3.1's long-context rule).

    llama3: wavelengths 2π/f above original_max_position_embeddings / low_freq_factor are divided by
    `factor`, those below original / high_freq_factor kept, those between interpolated smoothly.
    Other rope types raise ValueError naming the type.
    """
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type: {rope_type!r} is not supported by fusekit (supported: {', '.join(ROPE_TYPES)})"
        )
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: must be even and > 0, got {head_dim}")
    # As transformers: int64 arange cast to fp32, then 1 / base ** (i / dim).
    f = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if rope_type == "default":
        return f
    vals = dict(
        zip(_LLAMA3_KEYS, (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings))
    )
    missing = [k for k, v in vals.items() if v is None]
    if missing:
        raise ValueError(f"rope_type 'llama3': missing {', '.join(missing)}")
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / f
    f_llama = torch.where(wavelen > low_wavelen, f / factor, f)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * f_llama / factor + smooth * f_llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, f_llama)


def rope_parameters(config: object) -> dict:
    """An HF config's rope settings as {"rope_type", "theta", "head_dim", and llama3's four keys}.

    Reads transformers 5's `rope_parameters` (or 4.x's `rope_scaling` + `rope_theta`). Raises ValueError
    naming the rope type (or `partial_rotary_factor`) for anything fusekit does not compute.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer-type rope parameters are not supported by fusekit")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type: {rope_type!r} is not supported by fusekit (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor: {partial} is not supported by fusekit (only 1.0)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    out = {"rope_type": rope_type, "theta": float(params.get("rope_theta", 10000.0)), "head_dim": head_dim}
    if rope_type == "llama3":
        for k in _LLAMA3_KEYS:
            if params.get(k) is None:
                raise ValueError(f"rope_parameters: rope_type 'llama3' needs {k!r}")
            out[k] = params[k]
    return out


def apply_rope(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    k: Tensor | None = None,
    interleaved: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """ops.rope of x [B, S, H, D] (and k [B, S, Hk, D] in the same launch) with tables cos/sin [S, D/2]
    (every batch row at the same positions) or [B, S, D/2] (one table per row; [1, S, D/2] counts as
    shared). Same dtype out: x rotated, or (x, k) rotated when k is given.

    Per-row tables run as one call on x viewed as [1, B*S, H, D], whose row b*S + s reads table row
    b*S + s: any positions per row, still one kernel launch.
    """
    if cos.dim() == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    if cos.dim() == 2:
        return ops.rope(x, k, cos=cos, sin=sin, interleaved=interleaved, backend=backend)
    if cos.dim() != 3 or x.dim() != 4 or tuple(cos.shape[:2]) != tuple(x.shape[:2]):
        raise ValueError(
            f"cos: expected [S, D/2] or [B, S, D/2] tables for x {tuple(x.shape)}, got {tuple(cos.shape)}"
        )
    b, s, h, d = x.shape
    if k is not None and (k.dim() != 4 or tuple(k.shape[:2]) != (b, s)):
        raise ValueError(f"k: expected [B={b}, S={s}, Hk, D], got {tuple(k.shape)}")
    out = ops.rope(
        x.reshape(1, b * s, h, d),
        None if k is None else k.reshape(1, b * s, k.shape[2], k.shape[3]),
        cos=cos.reshape(b * s, -1),
        sin=sin.reshape(b * s, -1),
        interleaved=interleaved,
        backend=backend,
    )
    if k is None:
        return out.view(b, s, h, d)
    return out[0].view(b, s, h, d), out[1].view(k.shape)


class RotaryEmbedding(nn.Module):
    """Rotary embedding for q/k laid out [B, S, H, D] (HF "halves" pairing, or `interleaved`).

    head_dim, theta, rope_type ("default" or "llama3" with factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings): as HF's rope parameters; other types raise ValueError naming
    the type. `from_config(hf_config)` reads them from a Llama / Mistral / Qwen2 config.

    tables(position_ids) -> (cos, sin) fp32 [..., D/2]: the angles position * inv_freq as HF forms them.
    forward(q, k=None, *, start_pos=0, position_ids=None) rotates q (and k) at positions
    start_pos + s, or at position_ids ([S] or [B, S]); returns q, or (q, k). Gradients flow to q and k.
    `inv_freq` is a non-persistent buffer (not in the state_dict), as in HF.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        theta: float = 10000.0,
        rope_type: str = "default",
        factor: float | None = None,
        low_freq_factor: float | None = None,
        high_freq_factor: float | None = None,
        original_max_position_embeddings: int | None = None,
        interleaved: bool = False,
        backend: str = "auto",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rope_type = rope_type
        self.interleaved = interleaved
        self.backend = backends.prepare(backend)
        self.register_buffer(
            "inv_freq",
            inv_freq(
                head_dim,
                theta,
                rope_type,
                factor=factor,
                low_freq_factor=low_freq_factor,
                high_freq_factor=high_freq_factor,
                original_max_position_embeddings=original_max_position_embeddings,
                device=device,
            ),
            persistent=False,
        )

    @classmethod
    def from_config(cls, config: object, *, backend: str = "auto", device=None) -> RotaryEmbedding:
        p = rope_parameters(config)
        head_dim, theta = p.pop("head_dim"), p.pop("theta")
        return cls(head_dim, theta=theta, backend=backend, device=device, **p)

    def _apply(self, fn, recurse: bool = True):
        """`.to(dtype)` / `.half()` / `.double()` move inv_freq but keep it fp32: rounded to bf16 its angles
        were off by up to 1.5 rad of q at position 4000 (HF keeps it fp32 through from_pretrained)."""
        inv = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != inv.dtype:
            self.inv_freq = inv.to(self.inv_freq.device)
        return self

    @torch.no_grad()
    def tables(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        ang = position_ids[..., None].float() * self.inv_freq.to(
            device=position_ids.device, dtype=torch.float32
        )
        return ang.cos(), ang.sin()

    def forward(
        self,
        q: Tensor,
        k: Tensor | None = None,
        *,
        start_pos: int = 0,
        position_ids: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if q.dim() != 4 or q.shape[-1] != self.head_dim:
            raise ValueError(f"q: expected [B, S, H, D={self.head_dim}], got {tuple(q.shape)}")
        if position_ids is None:
            position_ids = torch.arange(start_pos, start_pos + q.shape[1], device=q.device)
        elif start_pos:
            raise ValueError("start_pos: give start_pos or position_ids, not both")
        elif (
            position_ids.shape[-1:] != q.shape[1:2]
            or position_ids.dim() not in (1, 2)
            or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, q.shape[0]))
        ):
            raise ValueError(
                f"position_ids: expected [S={q.shape[1]}] or [B={q.shape[0]}, S={q.shape[1]}] for q "
                f"{tuple(q.shape)}, got {tuple(position_ids.shape)}"
            )
        cos, sin = self.tables(position_ids.to(q.device))
        kw = {"interleaved": self.interleaved, "backend": self.backend}
        return apply_rope(q, cos, sin, k=k, **kw)  # q and k in one launch

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, theta={self.theta}, rope_type={self.rope_type!r}, "
            f"interleaved={self.interleaved}, backend={self.backend!r}"
        )
