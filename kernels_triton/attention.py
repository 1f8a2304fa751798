"""Attention forward (FlashAttention-2 style): out = softmax(q k^T * scale [+ causal mask]) v.

Floors (H200: ~790 TFLOP/s dense bf16, ~4.3 TB/s), B=4 H=32 S=Skv=4096 D=128 bf16:
- FLOPs: 4*B*H*S*Skv*D = 2.2 PFLOP non-causal (~2.8 ms at 790 TFLOP/s), about half of that causal.
- Bytes: q, k, v, out once each = 4*B*H*S*D*2 = 537 MB (~0.13 ms): compute-bound by ~20x, so the
  goal is tensor-core rate (wgmma) and fewest wasted tiles, not bandwidth.

One program per (BLOCK_M query rows, b*H + h): grid axis 0 = M blocks (limit 2^31 - 1), axis 1 = B*H
(limit 65535, i.e. B*H up to 65535).
Online softmax in fp32 registers with exp2 and scale*log2(e) folded into one multiply. GQA: kv head
h // (H // Hkv). Causal mask aligned bottom-right: query i sees key j iff j <= i + (Skv - S). The key loop
is split: tiles every row of the block fully sees run unmasked; the diagonal tiles (and a ragged Skv tail)
run with the mask; tiles past the last visible key are skipped. Rows that see no key (S > Skv) give 0.
fp32 inputs use input_precision="ieee" (no tf32), so fp32 means fp32.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels_triton._config import div16_attrs, is_hip, is_interpreter
from kernels_triton._tiles import dot

_LOG2E = 1.4426950408889634
_MAX_GRID_Y = 65535  # CUDA/HIP limit of grid axis 1


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, H, HKV, S, SKV, qk_scale, S_BUCKET, SKV_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # S_BUCKET / SKV_BUCKET are unused here: they exist so the autotuner can key on bucketed lengths.
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hkv = h // (H // HKV)
    q_base = q_ptr + bh.to(tl.int64) * S * HEAD_DIM
    o_base = o_ptr + bh.to(tl.int64) * S * HEAD_DIM
    kv_off = (b.to(tl.int64) * HKV + hkv) * SKV * HEAD_DIM
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=offs_m[:, None] < S, other=0.0)
    # K is read as a [HEAD_DIM, BLOCK_N] view of row-major [SKV, HEAD_DIM] (K-major B operand).
    kt_ptrs = k_ptr + kv_off + offs_n[None, :] * HEAD_DIM + offs_d[:, None]
    v_ptrs = v_ptr + kv_off + offs_n[:, None] * HEAD_DIM + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    diag = SKV - S  # row i sees keys j <= i + diag
    if CAUSAL:
        hi = tl.maximum(tl.minimum(SKV, m0 + BLOCK_M + diag), 0)  # past the last key any row sees
        full_end = tl.maximum(tl.minimum(m0 + diag + 1, SKV), 0)  # keys < this: seen by every row
        full_end = (full_end // BLOCK_N) * BLOCK_N
    else:
        hi = SKV
        full_end = (SKV // BLOCK_N) * BLOCK_N

    # Unmasked tiles: every row sees every key, so every row max is finite after the first tile.
    # qk_scale >= 0 (the launcher flips the sign of q otherwise), so max(qk) * scale is the scaled max
    # and the scale folds into one FMA per score: exp2(qk * qk_scale - m).
    for start_n in range(0, full_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kt = tl.load(kt_ptrs + start_n * HEAD_DIM)
        qk = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs + start_n * HEAD_DIM)
        acc = dot(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new

    # Diagonal / ragged-tail tiles: mask, and keep rows with no visible key yet at m = -inf without NaNs.
    for start_n in range(full_end, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kn = start_n + offs_n
        k_in = kn < SKV
        kt = tl.load(kt_ptrs + start_n * HEAD_DIM, mask=k_in[None, :], other=0.0)
        s = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE) * qk_scale
        valid = k_in[None, :]
        if CAUSAL:
            valid = valid & (kn[None, :] <= offs_m[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs + start_n * HEAD_DIM, mask=k_in[:, None], other=0.0)
        acc = dot(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no visible key: acc is 0, so the row stays exactly 0
    out = acc / l_safe[:, None]
    tl.store(o_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=offs_m[:, None] < S)  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# tile tables: HEAD_DIM -> [(BLOCK_M, BLOCK_N, num_warps, num_stages), ...], first entry = default.
# ----------------------------------------------------------------------------------------------------
# Hopper (sm_90), per program the fp32 accumulator is BLOCK_M x D and the score tile BLOCK_M x BLOCK_N.
# Measured on the H200 (bf16, B4 S4096, triton 3.6; TFLOP/s, non-causal / causal):
#   D64 : 128x64 w8 s3 420/379 (s4 the same); 128x64 w4 410/365; 128x128 w8 348/315.
#   D128: 128x64 w8 s3 485/436 (s4 the same); 128x128 w8 s3 475/431; 128x128 s2 468/411.
#   D256: 128x64 w8 s2 488/448; 128x32 w8 s3 439/399; 64x64 w4 357/328; 128x128 w8 s1 321/313 (the
#         128x256 fp32 accumulator is already 128 regs/thread at 8 warps, so larger score tiles spill);
#         128x64 s3 needs 256 KB of shared memory (> 227 KB).
_CUDA_TILES: dict[int, list[tuple[int, int, int, int]]] = {
    64: [(128, 64, 8, 3), (128, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3)],
    256: [(128, 64, 8, 2)],
}
# CDNA (gfx942): 64-wide waves, 64 KB LDS; smaller N tiles and single-buffered (stream pipeliner) K/V.
_HIP_TILES: dict[int, list[tuple[int, int, int, int]]] = {
    64: [(128, 64, 4, 1)],
    128: [(128, 64, 4, 1)],
    256: [(64, 64, 4, 1)],
}
_INTERP_TILE = (16, 16, 1, 1)  # the CPU interpreter: numpy per tile, small tiles are fastest


@functools.cache
def _tuned(head_dim: int):
    table = (_HIP_TILES if is_hip() else _CUDA_TILES)[head_dim]
    cfgs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in table]
    # Keyed on power-of-two buckets of the lengths (re-tune per octave, not per length); head_dim, causal
    # and dtype are constexprs / pointer types, which the autotuner keys on by itself.
    return triton.autotune(cfgs, key=["S_BUCKET", "SKV_BUCKET"])(_attn_fwd_kernel)


def attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    _config: tuple[int, int, int, int] | None = None,
) -> None:
    """out[B, H, S, D] = attention(q, k, v) as `fusekit.reference.attention`; writes `out`, returns None.

    `_config` = (BLOCK_M, BLOCK_N, num_warps, num_stages) forces a tile (tests, benchmarks).
    """
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    if k.shape != (B, Hkv, Skv, D) or v.shape != k.shape or out.shape != q.shape or H % Hkv != 0:
        raise ValueError(
            f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}"
        )
    if D not in (64, 128, 256):
        raise ValueError(f"attention: head_dim must be 64, 128 or 256, got {D}")
    if not all(t.is_contiguous() for t in (out, q, k, v)):
        raise ValueError("attention: tensors must be contiguous")
    qk_scale = float(scale) * _LOG2E
    if qk_scale < 0:  # the kernel folds the scale into the row max, which needs scale >= 0
        q, qk_scale = q.neg(), -qk_scale  # exact: (-q).k * (-scale) == q.k * scale
    ieee = q.dtype == torch.float32
    # Grid axis 1 (B*H) is limited to 65535: split larger batches into slabs (contiguous views).
    bstep = max(1, _MAX_GRID_Y // H)
    for b0 in range(0, B, bstep):
        sl = slice(b0, min(B, b0 + bstep))
        nb = sl.stop - sl.start
        args = (q[sl], k[sl], v[sl], out[sl], H, Hkv, S, Skv, qk_scale, _bucket(S), _bucket(Skv))
        if is_interpreter() or _config is not None:
            bm, bn, w, st = _config or _INTERP_TILE
            _attn_fwd_kernel[(triton.cdiv(S, bm), nb * H)](
                *args, HEAD_DIM=D, CAUSAL=bool(causal), IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                num_stages=st,
            )  # fmt: skip
            continue
        with torch.cuda.device(q.device):
            _tuned(D)[lambda m, nb=nb: (triton.cdiv(S, m["BLOCK_M"]), nb * H)](
                *args, HEAD_DIM=D, CAUSAL=bool(causal), IEEE=ieee
            )


def _bucket(n: int) -> int:
    """Autotune key: sequence lengths rounded up to a power of two (re-tune per octave, not per length)."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def aot_specs() -> list[tuple[str, object, dict, dict, dict, dict]]:
    """(name, jit kernel, signature, constexprs, options, attrs) for every tile the launcher can pick on CUDA.

    fp16/bf16 x head_dim {64, 128, 256} x causal x the CUDA tile table; options = num_warps/num_stages.
    attrs = ASTSource attrs (16-divisible pointers and row strides): pass them as
    `ASTSource(fn, signature, constexprs, attrs)`, else the GEMM loops compile unpipelined.
    """
    specs: list[tuple[str, object, dict, dict, dict]] = []
    for dt in ("fp16", "bf16"):
        p = f"*{dt}"
        for d, tiles in _CUDA_TILES.items():
            for causal in (False, True):
                for bm, bn, w, s in tiles:
                    sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "H": "i32", "HKV": "i32", "S": "i32",
                           "SKV": "i32", "qk_scale": "fp32", "S_BUCKET": "i32", "SKV_BUCKET": "i32",
                           "HEAD_DIM": "constexpr", "CAUSAL": "constexpr",
                           "IEEE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}  # fmt: skip
                    const = {"HEAD_DIM": d, "CAUSAL": causal, "IEEE": False, "BLOCK_M": bm, "BLOCK_N": bn}
                    name = f"attn_{dt}_d{d}_c{int(causal)}_{bm}x{bn}_w{w}s{s}"
                    specs.append((name, _attn_fwd_kernel, sig, const, {"num_warps": w, "num_stages": s}))
    return [(*spec, div16_attrs(spec[2])) for spec in specs]
