"""One Llama decoder layer built from fusekit ops (or plain torch), for the model-shape benchmark.

    cfg = CONFIGS["llama3-8b"]
    w = make_weights(cfg, device, torch.bfloat16, gen)             # shared by every provider's layer
    cache = KVCache.allocate(cfg, batch=1, max_len=2049, ...)       # [B, max_len, Hkv, D] k and v
    layer = DecoderLayer(cfg, w, cache, backend="triton")           # or "torch", "mojo", "eager"
    out, h = layer(x, residual, start_pos=2048)                     # x, residual [B, S, hidden]

The layer is a middle layer of a vLLM-style residual stream: it takes (x, residual) and returns
(mlp output, h) with h = x + residual + attention, so every norm fuses the residual add before it:

    y, h   = rms_norm(x, w_in, residual=residual)       # one kernel: h = x + residual, y = norm(h)
    qkv    = y @ w_qkv^T                                # one GEMM (q, k and v weights concatenated)
    q, k   = rope(qkv[q and k heads], start_pos)        # one kernel for q and k together
    cache[start_pos : start_pos + S] = k, v             # in place (copy_wide), the cache is [B, max_len, Hkv, D]
    o      = attention(q, cache views, causal, kv_len)  # the cache read in place through its strides
    a      = o @ w_o^T
    y2, h2 = rms_norm(a, w_post, residual=h)            # one kernel again
    out    = swiglu_ffn(y2, w_gate, w_up, w_down)       # no norm_weight: the norm ran fused with the add

swiglu_ffn could fuse the post-attention norm itself (norm_weight=), but not the residual add, which
would then cost a separate add kernel; the fused-residual rms_norm gives one kernel per op instead.
GEMMs are torch (cuBLAS) in every provider. The "eager" layer computes the same math with plain torch
(HF LlamaRMSNorm, rotate-half rope in fp32 from cos/sin tables, SDPA with enable_gqa, F.silu): it is
the torch-eager baseline, what torch.compile compiles, and the correctness reference.

Positions: `start_pos` is a Python int (the benchmark replays one position per scenario; dynamo
specializes on it and fusekit's rope takes it as a scalar). `cache.kv_len` must hold start_pos + S for
every sequence: the caller advances it, as a serving loop does outside the layer. A fusekit backend that
takes kv_len gets the whole cache view and kv_len (nothing past kv_len is read); one that does not (mojo)
gets the cache sliced to start_pos + S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BACKENDS = ("eager", "torch", "triton", "mojo")
# HF LlamaRMSNorm's rounding (normalize in fp32, round, then scale): the eager layer does the same.
CASTING = "llama"


@dataclass(frozen=True)
class LayerConfig:
    name: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    theta: float
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        d, hd = self.hidden, self.head_dim
        return {
            "input_norm": (d,),
            "w_qkv": ((self.heads + 2 * self.kv_heads) * hd, d),
            "w_o": (d, self.heads * hd),
            "post_norm": (d,),
            "w_gate": (self.ffn, d),
            "w_up": (self.ffn, d),
            "w_down": (d, self.ffn),
        }

    def weight_numel(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())

    def gemm_params(self) -> int:
        """Weights that take part in a GEMM (all but the two norm weights): 2 FLOPs each per token."""
        return self.weight_numel() - 2 * self.hidden


CONFIGS: dict[str, LayerConfig] = {
    # head_dim 64: the smallest head dim the triton and mojo attention kernels take.
    "tiny": LayerConfig("tiny", hidden=256, ffn=640, heads=4, kv_heads=2, theta=10000.0),
    "llama2-7b": LayerConfig("llama2-7b", hidden=4096, ffn=11008, heads=32, kv_heads=32, theta=10000.0),
    "llama3-8b": LayerConfig("llama3-8b", hidden=4096, ffn=14336, heads=32, kv_heads=8, theta=500000.0),
}


def make_weights(
    cfg: LayerConfig, device: torch.device | str, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, Tensor]:
    """Seeded weights: projections N(0, 1/fan_in) (activations stay O(1)), norm weights 1 + N(0, 0.1²)."""
    out: dict[str, Tensor] = {}
    for name, shape in cfg.weight_shapes().items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        t = 1.0 + 0.1 * t if len(shape) == 1 else t / math.sqrt(shape[1])
        out[name] = t.to(dtype)
    return out


@dataclass
class KVCache:
    """k, v [B, max_len, Hkv, D] (the layout serving engines preallocate) and kv_len int32 [B]."""

    k: Tensor
    v: Tensor
    kv_len: Tensor

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    @classmethod
    def allocate(
        cls,
        cfg: LayerConfig,
        batch: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        gen: torch.Generator,
        filled: int = 0,
    ) -> KVCache:
        """A cache whose first `filled` positions hold random keys/values (the context already decoded);
        the rest is NaN, so a kernel reading past kv_len shows up in the output."""
        shape = (batch, max_len, cfg.kv_heads, cfg.head_dim)
        k = torch.full(shape, math.nan, device=device, dtype=dtype)
        v = torch.full(shape, math.nan, device=device, dtype=dtype)
        for t in (k, v):
            for b in range(batch if filled else 0):  # one sequence at a time: no cache-sized fp32 temporary
                t[b, :filled] = torch.randn(
                    (filled, *shape[2:]), generator=gen, device=device, dtype=torch.float32
                ).to(dtype)
        kv_len = torch.full((batch,), filled, device=device, dtype=torch.int32)
        return cls(k, v, kv_len)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def rope_tables(cfg: LayerConfig, max_len: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """cos/sin [max_len, D/2] fp32, HF's inverse frequencies (plain torch, independent of fusekit)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    ang = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return ang.cos(), ang.sin()


def _eager_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """HF LlamaRMSNorm: normalize in fp32, round to x's dtype, then scale."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def _eager_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, S, H, D] rotated (HF halves pairing) with cos/sin [S, D/2], math in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


def copy_wide(dst: Tensor, src: Tensor) -> None:
    """dst.copy_(src) for same-dtype views whose last dim is contiguous (k/v heads sliced out of a qkv
    projection into a cache slice), moved as 8-byte words where the bytes allow: torch's copy of
    non-contiguous tensors moves one element per load, so 2-byte elements run it at ~0.9 TB/s on an H200
    (Llama-2-7B prefill: 2 x 16 MiB in ~78 us); the same bytes as int64 move 4x fewer elements."""
    if src.dtype == dst.dtype and src.stride(-1) == 1 and dst.stride(-1) == 1:
        es = src.element_size()
        # every byte offset the copy steps by (a row, the outer strides) and both pointers
        spans = (src.shape[-1] * es, *(st * es for st in (*src.stride()[:-1], *dst.stride()[:-1])))
        spans += (src.data_ptr(), dst.data_ptr())
        for wide in (torch.int64, torch.int32):
            if all(b % wide.itemsize == 0 for b in spans):
                dst.view(wide).copy_(src.view(wide))
                return
    dst.copy_(src)


def attends_kv_len(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the fusekit backend's attention takes kv_len (mojo's does not yet)."""
    from fusekit import backends

    be = backends.get(backend)
    if be.unavailable_reason() is not None:  # also loads the backend, which supports() needs
        return False
    return be.supports("attention", "forward", device, (dtype,), head_dim=head_dim, kv_len=True) is None


class DecoderLayer(nn.Module):
    """A Llama decoder layer over shared weights and a shared KV cache; `backend` picks the ops.

    backend: "eager" (plain torch), or a fusekit backend ("torch", "triton", "mojo") for the norms,
    rope, attention and MLP. Weights are Parameters (requires_grad False) aliasing `weights`; the cache
    tensors are buffers aliasing `cache` (torch.compile treats both as static, as in gpt-fast), so
    several layers of different backends read and write one cache.
    """

    def __init__(self, cfg: LayerConfig, weights: dict[str, Tensor], cache: KVCache, backend: str) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.cfg, self.backend = cfg, backend
        for name, t in weights.items():
            setattr(self, name, nn.Parameter(t, requires_grad=False))
        self.register_buffer("k_cache", cache.k, persistent=False)
        self.register_buffer("v_cache", cache.v, persistent=False)
        self.register_buffer("kv_len", cache.kv_len, persistent=False)
        if backend == "eager":
            cos, sin = rope_tables(cfg, cache.max_len, cache.k.device)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
            self.use_kv_len = False
        else:
            self.use_kv_len = attends_kv_len(backend, cache.k.device, cache.k.dtype, cfg.head_dim)

    def forward(self, x: Tensor, residual: Tensor, start_pos: int) -> tuple[Tensor, Tensor]:
        if self.backend == "eager":
            return self._eager(x, residual, start_pos)
        return self._fusekit(x, residual, start_pos)

    def _write_cache(self, k: Tensor, v: Tensor, start_pos: int) -> None:
        s = k.shape[1]
        # under torch.compile plain copies: inductor fuses these stores into its rope kernel
        copy = Tensor.copy_ if torch.compiler.is_compiling() else copy_wide
        copy(self.k_cache[:, start_pos : start_pos + s], k)
        copy(self.v_cache[:, start_pos : start_pos + s], v)

    def _fusekit(self, x: Tensor, residual: Tensor, start_pos: int) -> tuple[Tensor, Tensor]:
        from fusekit import ops

        cfg, be = self.cfg, self.backend
        b, s, _ = x.shape
        h_q, h_kv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        y, h = ops.rms_norm(x, self.input_norm, cfg.eps, residual=residual, casting=CASTING, backend=be)
        qkv = F.linear(y, self.w_qkv).view(b, s, h_q + 2 * h_kv, d)
        qk = ops.rope(qkv[:, :, : h_q + h_kv], start_pos=start_pos, theta=cfg.theta, backend=be)
        self._write_cache(qk[:, :, h_q:], qkv[:, :, h_q + h_kv :], start_pos)
        q, kc, vc = qk[:, :, :h_q], self.k_cache, self.v_cache  # [B, S|max_len, H|Hkv, D]: "bshd"
        if self.use_kv_len:
            o = ops.attention(q, kc, vc, causal=True, kv_len=self.kv_len, layout="bshd", backend=be)
        else:
            n = start_pos + s
            o = ops.attention(q, kc[:, :n], vc[:, :n], causal=True, layout="bshd", backend=be)
        a = F.linear(o.reshape(b, s, h_q * d), self.w_o)
        y2, h2 = ops.rms_norm(a, self.post_norm, cfg.eps, residual=h, casting=CASTING, backend=be)
        return ops.swiglu_ffn(y2, self.w_gate, self.w_up, self.w_down, backend=be), h2

    def _eager(self, x: Tensor, residual: Tensor, start_pos: int) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        b, s, _ = x.shape
        h_q, h_kv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        h = x + residual
        y = _eager_rms_norm(h, self.input_norm, cfg.eps)
        q, k, v = F.linear(y, self.w_qkv).view(b, s, h_q + 2 * h_kv, d).split([h_q, h_kv, h_kv], dim=2)
        cos, sin = self.cos[start_pos : start_pos + s], self.sin[start_pos : start_pos + s]
        q, k = _eager_rope(q, cos, sin), _eager_rope(k, cos, sin)
        self._write_cache(k, v, start_pos)
        n = start_pos + s
        kc, vc = self.k_cache[:, :n].transpose(1, 2), self.v_cache[:, :n].transpose(1, 2)
        # SDPA's is_causal is aligned top-left: right for prefill from 0 and (vacuous) for one query;
        # a chunk after a prefix needs fusekit's bottom-right mask spelled out.
        mask, causal = None, s > 1 and start_pos == 0
        if s > 1 and start_pos > 0:
            i = torch.arange(s, device=x.device)[:, None]
            mask = torch.arange(n, device=x.device)[None, :] <= i + start_pos
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), kc, vc, attn_mask=mask, is_causal=causal, enable_gqa=h_q != h_kv
        )
        a = F.linear(o.transpose(1, 2).reshape(b, s, h_q * d), self.w_o)
        h2 = a + h
        y2 = _eager_rms_norm(h2, self.post_norm, cfg.eps)
        out = F.linear(F.silu(F.linear(y2, self.w_gate)) * F.linear(y2, self.w_up), self.w_down)
        return out, h2
