"""Attention (FlashAttention-2 style): o = softmax(q k^T * scale [+ causal mask]) v, and lse; backward.

Entry points (CONTRACT.md; the spec's order: outputs, inputs, scalars):
    forward(o, lse, q, k, v, kv_len, causal, scale)                    o [B, H, S, D], lse [B, H, S] fp32
    backward(dq, dk, dv, do, q, k, v, o, lse, kv_len, causal, scale)   (kernels in attention_backward.py)
(The pre-kv_len forms forward(o, lse, q, k, v, causal, scale) / backward(..., lse, causal, scale) still work.)
k/v [B, Hkv, Skv, D] may be strided views with a contiguous last dim, e.g. `k_cache.transpose(1, 2)[:, :, :L]`
of a cache [B, max_len, Hkv, D]: every kernel reads them through their strides, in place. kv_len: int32 [B]
or None: sequence b sees keys 0..L_b - 1, L_b = clamp(kv_len[b], 0, Skv) (clamped in-kernel, so untrusted
values never read outside k/v); keys past L_b are never loaded. lse = logsumexp of the visible scaled scores
(natural log); a row with no visible key (L_b = 0, or causal with S > L_b) gives o = 0 and lse = -inf.
Few queries (S <= 16 with at most 128 rows per GQA group: decode) run the split-KV kernels of
_attention_decode.py instead of the kernel below; on sm_90 without kv_len, D128 and full-attention D64 run
the Gluon FA3-style kernel of _attention_hopper.py (`use_hopper`), and the backward at D64/D128 the Gluon
kernels of _attention_hopper_bwd.py (`use_hopper_bwd`).

Floors (H200: ~790 TFLOP/s dense bf16, ~4.3 TB/s), B=4 H=32 S=Skv=4096 D=128 bf16:
- FLOPs: 4*B*H*S*Skv*D = 1.1 PFLOP non-causal (~1.4 ms at 790 TFLOP/s), about half of that causal.
  (The backward's floor is 2.5x this, 10*B*H*S*Skv*D: see attention_backward.py.)
- Bytes: q, k, v, out once each = 4*B*H*S*D*2 = 537 MB (~0.13 ms): compute-bound by ~10x, so the
  goal is tensor-core rate (wgmma) and fewest wasted tiles, not bandwidth. lse adds B*H*S*4 bytes.
  (Decode is the opposite, a stream over the KV: see _attention_decode.py for its byte floor.)

One program per (BLOCK_M query rows, b*H + h) on a 1-D grid in the backward's launch order
(attention_backward._tile_of / _head_chunk: causal heads with few query blocks in chunks, heaviest block
first) while the launch is a few waves (_fwd_chunk_args), else head by head; launched in batch slabs of at
most 65535 heads (what a 2-D grid allowed; it keeps pids small).
Online softmax in fp32 registers with exp2 and scale*log2(e) folded into one multiply (opt-in,
FUSEKIT_TRITON_ATTN_EXP2_POLY: a fraction of the exponentials on the FMA pipe, _exp2_poly.py). GQA: kv head
h // (H // Hkv). Causal mask aligned bottom-right: query i sees key j iff j <= i + (L_b - S). The key loop
is split: tiles every row of the block fully sees run unmasked; the diagonal tiles (and a ragged tail at
L_b) run with the mask; tiles past the last visible key are skipped. Rows that see no key give 0.
fp32 inputs use input_precision="ieee" (no tf32), so fp32 means fp32. kv_len is a runtime flag plus one
scalar load per program (no extra compiled variants); the k/v strides are runtime ints (Triton's JIT
specializes their 16-divisibility, as it did the contiguous row stride).

Non-finite inputs: a NaN in q row i makes row i NaN; a NaN/Inf in a key that row i sees reaches row i as in
a float64 softmax; a masked key's k never matters (its scores are replaced by -inf before any use). A NaN/Inf
in a causally masked key's *v* row inside a diagonal tile does reach the rows of that tile (p = 0 times NaN
inside the p @ v product), as in every flash kernel; the contract does not cover that case. Keys past kv_len
are not loaded at all (0 in their place), so whatever a cache holds there never matters.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from kernels_triton._attention_decode import DECODE_MAX_ROWS, DECODE_MAX_S, aot_specs_decode, decode_forward
from kernels_triton._attention_hopper import hopper_supported, run_hopper
from kernels_triton._attention_hopper_bwd import aot_specs_split_sum, hopper_bwd_supported, run_hopper_bwd
from kernels_triton._config import (
    device_index,
    is_hip,
    is_interpreter,
    kv_tile_addressable,
    last_dim_contiguous,
    num_sms,
    on_device,
    remember,
)
from kernels_triton._exp2_poly import env_config as exp2_env_config
from kernels_triton._exp2_poly import exp2_mixed
from kernels_triton._launch import fast_tuned
from kernels_triton._tiles import dot
from kernels_triton.attention_backward import (
    Tile,
    _chunk_args,
    _configs,
    _head_chunk,
    _launch_kw,
    _tile_of,
    _tma,
    _union,
    aot_specs_backward,
    attention_backward,
    stride_attrs,
    tma_setup,
)

_LOG2E = 1.4426950408889634
_MAX_GRID_Y = 65535  # CUDA/HIP limit of grid axis 1


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, kv_len_ptr, H, HKV, S, SKV, qk_scale, stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    has_kv_len, chunk_work, chunk_cap, S_BUCKET, SKV_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
    EXP2_POLY: tl.constexpr = 0, EXP2_DEGREE: tl.constexpr = 3, GRID_2D: tl.constexpr = False,
):  # fmt: skip
    # S_BUCKET / SKV_BUCKET are unused here: they exist so the autotuner can key on bucketed lengths.
    # has_kv_len is a runtime flag (one scalar load per program), so kv_len adds no compiled variants.
    # TMA (sm_90+, fp16/bf16, 16-byte aligned tensors and k/v strides): q, k, v and o go through tensor
    # descriptors built on the device (k/v: this sequence's first L keys through their strides, zero-filled
    # past L), which frees the per-element address registers of pointer loads and makes the loads async.
    # EXP2_POLY > 0 (opt-in, FUSEKIT_TRITON_ATTN_EXP2_POLY): 1 / 2^EXP2_POLY of each score tile's exponentials
    # go through a degree-EXP2_DEGREE polynomial on the FMA pipe instead of MUFU (_exp2_poly.exp2_mixed).
    # Launch order: GRID_2D, a 2-D grid (query blocks, heads) runs head by head, lightest block first, with no
    # index arithmetic (the host launches it where the order is not chunked: _grid); a 1-D grid takes
    # attention_backward's _tile_of / _head_chunk order: causal heads with few query blocks in chunks,
    # heaviest blocks (the most keys) first. A constexpr, not a test of num_programs(1): with a runtime
    # branch the 1-D (chunked) launches ran 1.5-2.4% slower on the H200 (same tile; D64 B2 H32/8 S2048
    # 104.6 -> 107.0 us).
    if GRID_2D:
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
    else:
        n_qb = tl.cdiv(S, BLOCK_M)
        n_heads = tl.num_programs(0) // n_qb
        hc = _head_chunk(n_qb, n_heads, chunk_work, chunk_cap, CAUSAL)
        start_m, bh = _tile_of(tl.program_id(0), n_heads, n_qb, hc)
        if hc > 1:
            start_m = n_qb - 1 - start_m
    b = bh // H
    h = bh % H
    hkv = h // (H // HKV)
    L = SKV  # keys of this sequence: 0..L-1 (kv_len[b] clamped to [0, SKV])
    if has_kv_len:
        L = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), SKV)
    # q and o through their strides (a [B, S, H, D] source read as [B, H, S, D], and o written in q's
    # memory order: no transposing copy either way)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    o_base = o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    if TMA:
        # this head's [S, D] rows (zero-filled past S; the store clips there) and the first L keys (a
        # descriptor needs a dimension >= 1; with L = 0 no tile is loaded)
        q_desc = tl.make_tensor_descriptor(q_base, shape=[S, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        k_desc = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(L, 1), HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        v_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(L, 1), HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        q = q_desc.load([m0, 0])
    else:
        # int64 row offsets within the head too: offs_m * stride passes 2^31 at S * HEAD_DIM >= 2^31.
        q = tl.load(q_base + offs_m.to(tl.int64)[:, None] * stride_qm + offs_d[None, :],
                    mask=offs_m[:, None] < S, other=0.0)  # fmt: skip
    # k/v are read through their strides (a KV cache view; the last dim is contiguous). K as a
    # [HEAD_DIM, BLOCK_N] view (K-major B operand); tile offsets in int64 (start_n * stride can pass 2^31).
    skn = stride_kn.to(tl.int64)
    svn = stride_vn.to(tl.int64)
    kt_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    diag = L - S  # row i sees keys j <= i + diag
    if CAUSAL:
        hi = tl.maximum(tl.minimum(L, m0 + BLOCK_M + diag), 0)  # past the last key any row sees
        full_end = tl.maximum(tl.minimum(m0 + diag + 1, L), 0)  # keys < this: seen by every row
        full_end = (full_end // BLOCK_N) * BLOCK_N
    else:
        hi = L
        full_end = (L // BLOCK_N) * BLOCK_N

    # Unmasked tiles: every row sees every key. qk_scale >= 0 (the launcher flips the sign of q otherwise),
    # so max(qk) * scale is the scaled max and the scale folds into one FMA per score: exp2(qk * qk_scale - m).
    # A row whose scores are all -inf (a -inf in q or k) keeps m = -inf and takes 0 as its reference, so
    # p = 0 instead of exp2(-inf - -inf) = NaN: the reference's zero row (as FlashAttention's rescale).
    for start_n in range(0, full_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if TMA:
            kt = tl.trans(k_desc.load([start_n, 0]))
        else:
            kt = tl.load(kt_ptrs + start_n * skn)
        qk = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if EXP2_POLY == 0:
            p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
        else:
            p = exp2_mixed(qk * qk_scale - m_safe[:, None], BLOCK_M, BLOCK_N, EXP2_POLY, EXP2_DEGREE)
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if TMA:
            v = v_desc.load([start_n, 0])
        else:
            v = tl.load(v_ptrs + start_n * svn)
        acc = dot(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new

    # Diagonal / ragged-tail tiles: mask, and keep rows with no visible key yet at m = -inf without NaNs.
    # Keys past L (kv_len) are not even loaded: a cache may hold anything there.
    for start_n in range(full_end, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kn = start_n + offs_n
        k_in = kn < L
        if TMA:
            kt = tl.trans(k_desc.load([start_n, 0]))
        else:
            kt = tl.load(kt_ptrs + start_n * skn, mask=k_in[None, :], other=0.0)
        s = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE) * qk_scale
        valid = k_in[None, :]
        if CAUSAL:
            valid = valid & (kn[None, :] <= offs_m[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if EXP2_POLY == 0:
            p = tl.math.exp2(s - m_safe[:, None])
        else:  # masked scores are -inf here: exp2_poly gives exactly 0 there, as MUFU does
            p = exp2_mixed(s - m_safe[:, None], BLOCK_M, BLOCK_N, EXP2_POLY, EXP2_DEGREE)
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if TMA:
            v = v_desc.load([start_n, 0])
        else:
            v = tl.load(v_ptrs + start_n * svn, mask=k_in[:, None], other=0.0)
        acc = dot(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no visible key: acc is 0, so the row stays exactly 0
    out = (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty)
    if TMA:
        o_desc = tl.make_tensor_descriptor(o_base, shape=[S, HEAD_DIM], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        o_desc.store([m0, 0], out)
    else:
        tl.store(o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :], out,
                 mask=offs_m[:, None] < S)  # fmt: skip
    # lse in the natural log: (m + log2 l) * ln 2, as m is the exp2-domain row max. No visible key: -inf;
    # a +inf score: +inf (as logsumexp); a NaN score: l is NaN, so lse is NaN.
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
    lse = tl.where(l_i == 0.0, float("-inf"), lse)
    lse = tl.where(m_i == float("inf"), float("inf"), lse)
    tl.store(lse_ptr + bh.to(tl.int64) * S + offs_m, lse, mask=offs_m < S)


# ----------------------------------------------------------------------------------------------------
# tile tables: HEAD_DIM -> [(BLOCK_M, BLOCK_N, num_warps, num_stages[, tma]), ...], first entry = default;
# tma True: the tensor-descriptor variant (sm_90+, aligned inputs only; see attention_backward._tma_ok).
# ----------------------------------------------------------------------------------------------------
# Hopper (sm_90), per program the fp32 accumulator is BLOCK_M x D and the score tile BLOCK_M x BLOCK_N.
# Measured on the H200 (bf16, B4 S4096, triton 3.6; TFLOP/s, non-causal / causal):
#   D64 : 128x64 w8 s3 420/379 (s4 the same); 128x64 w4 410/365; 128x128 w8 348/315.
#   D128: 128x64 w8 s3 485/436 (s4 the same); 128x128 w8 s3 475/431; 128x128 s2 468/411.
#   D256: 128x64 w8 s2 488/448; 128x32 w8 s3 439/399; 64x64 w4 357/328; 128x128 w8 s1 321/313 (the
#         128x256 fp32 accumulator is already 128 regs/thread at 8 warps, so larger score tiles spill);
#         128x64 s3 needs 256 KB of shared memory (> 227 KB).
# Measured on an H100 80GB (2026-11-26, .dev sweep; TFLOP/s at B4 S4096 | B1 S2048 | B4 S1024, bf16, kernel
# time with the L2 flushed; SDPA in the same run 460-600 non-causal, 280-530 causal):
#   D64  causal : 128x64 w8 s3 377 | 228 | 230; 64x64 w4 s3 380 | 257 | 254 (TMA: 355 | 222 | 189).
#   D128 full   : 128x128 w8 s3 451 | 395 | 350; TMA 466 | 395 | 331; 64x64 w4 s3 TMA 462 | 415 | 357.
#   D128 causal : 128x128 w8 s3 432 | 291 | 255; 128x64 w8 s3 423 | 293 | 262; 64x64 TMA 418 | 296 | 246.
#   D256 full   : 128x64 w8 s2 399 | 360 | 318; TMA 523 | 463 | 390 (TMA frees the address registers that
#                 the 128x256 accumulator leaves no room for). Causal: 407 | 282 | 231; TMA 465 | 318 | 244.
#   Not taken: tl.range(warp_specialize=True) on the unmasked loop (compiles on sm_90 with Triton 3.6, same
#   speed), causal blocks in reverse order (heaviest first: same speed), 64x128 tiles (0.42-0.68x SDPA), and
#   (2026-11-27, H100) the unmasked loop software-pipelined by hand (tile j+1's scores issued before tile j's
#   softmax, FA3's intra-warpgroup overlap): Triton 3.6 still waits on the score wgmma, the second live score
#   tile costs registers and 128x128 s3 no longer fits shared memory: 0.6-1.06x the plain loop, 0.93x at
#   best on the defaults. Reaching SDPA (cuDNN: 674 TFLOP/s D128 here) needs explicit warpgroup control
#   (Gluon / FA3 pingpong), not a Triton-level loop rewrite.
# The autotuner keys on (S bucket, Skv bucket, causal): causal and full attention pick different tiles.
_CUDA_TILES: dict[int, list[Tile]] = {
    64: [(128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(128, 128, 8, 3), (128, 128, 8, 3, True), (64, 64, 4, 3, True), (128, 64, 8, 3)],
    256: [(128, 64, 8, 2, True), (128, 64, 8, 2)],
}
# CDNA (gfx942): 64-wide waves, 64 KB LDS; smaller N tiles and single-buffered (stream pipeliner) K/V.
_HIP_TILES: dict[int, list[Tile]] = {
    64: [(128, 64, 4, 1)],
    128: [(128, 64, 4, 1)],
    256: [(64, 64, 4, 1)],
}
_INTERP_TILE = (16, 16, 1, 1)  # the CPU interpreter: numpy per tile, small tiles are fastest


@functools.cache
def _tuned(head_dim: int, tma_ok: bool):
    cfgs = _configs(_HIP_TILES if is_hip() else _CUDA_TILES, head_dim, tma_ok)
    # Keyed on power-of-two buckets of the lengths (re-tune per octave, not per length) and on causal (a
    # key the autotuner needs by name: it keys on tensor dtypes by itself, but not on constexpr values);
    # head_dim has a tuner of its own.
    # EXP2_POLY / EXP2_DEGREE: keys only when passed (the opt-in polynomial exp2), so the default key is as before
    key = ["S_BUCKET", "SKV_BUCKET", "CAUSAL", "EXP2_POLY", "EXP2_DEGREE"]
    return fast_tuned(triton.autotune(cfgs, key=key)(_attn_fwd_kernel))


_LEGACY = object()  # marks the pre-kv_len call forms (…, causal, scale) of the entry points below


def _kv_args(kv_len, causal, scale):
    """(kv_len, causal, scale) of a call; the pre-kv_len form passes (causal, scale) in the first two slots."""
    if scale is _LEGACY:
        return None, kv_len, causal
    return kv_len, causal, scale


def use_decode(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `forward` runs the split-KV decode kernels: few queries (S <= 16) and a GQA group of at most
    128 rows (H/Hkv · S), where one program per kv head holds every query row of the group."""
    S, group = q.shape[2], q.shape[1] // k.shape[1]
    return S <= DECODE_MAX_S and group * S <= DECODE_MAX_ROWS


def _exp2_poly_env() -> tuple[int, int]:
    """(EXP2_POLY, EXP2_DEGREE) of _attn_fwd_kernel from FUSEKIT_TRITON_ATTN_EXP2_POLY[_DEGREE] (_exp2_poly.env_config:
    unset / "0" the MUFU-only kernel; "1" / "4", "2", "8" a quarter, half, eighth of each score tile's
    exponentials through the polynomial; degree 3, 4 or 5)."""
    return exp2_env_config("FUSEKIT_TRITON_ATTN_EXP2_POLY")


# Opt-in (issue #13, a loss on the H100: _exp2_poly.py): a fraction of the forward's exponentials on the FMA pipe
# (_exp2_poly.py; FlashAttention-4's MUFU offload) for the softmax-bound D64 tiles. (0, 3) launches the
# kernel exactly as without it (no extra launch arguments, so the same compiled kernel and tuning key).
# A module global, so a probe can flip it in-process: EXP2_POLY = (log2 of 1/fraction, degree).
EXP2_POLY: tuple[int, int] = _exp2_poly_env()

# FUSEKIT_TRITON_ATTN_GLUON=0 keeps every prefill call on the kernel above (see use_hopper).
GLUON = os.environ.get("FUSEKIT_TRITON_ATTN_GLUON", "1") not in ("", "0")
# Below ~17 GFLOP (4*B*H*S*Skv*D; e.g. B1 H32 S=Skv=512 D128 is 4.3) the Gluon call's host path (four host
# TMA descriptors per call) outweighs its kernel: H100, B1 H32 S128 D128 causal 106 us wall per call against
# ~45 us on the kernel above; B1 H32/8 S2048 D128 causal (34 GFLOP) 1.55x the kernel above.
_GLUON_MIN_FLOP = 1 << 34
# D256 in the Gluon kernel (causal or not; 64-key tiles with K_EARLY). H100, .dev probe at b7a6498 (do_bench,
# L2 flushed, same process): B4 H32 S4096 699 TFLOP/s (1.37x the kernel above, 1.05x SDPA), causal 615 (1.32x,
# 1.01x), B16 S1024 564 (1.35x, 0.96x). FUSEKIT_TRITON_ATTN_GLUON_D256=0 keeps D256 on the kernel above.
_GLUON_D256 = os.environ.get("FUSEKIT_TRITON_ATTN_GLUON_D256", "1") not in ("", "0")


def use_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, causal: bool) -> bool:
    """Whether `forward` runs the Gluon FA3-style kernel of _attention_hopper.py (sm_90; no kv_len): where it
    beat the kernel above on the H100 (D128 1.09-1.21x, causal or not; D64 full 1.05-1.07x; D256 1.32-1.37x,
    _GLUON_D256). Not D64 causal: softmax-bound there, the one-tile kernel ran at 0.79-0.97x the kernel above
    (H100) and even the persistent one at 0.57-0.99x (H200, .dev probe at 1983f47: B32 S512 0.74x, B4 S4096
    0.98x, B1 H32/8 S2048 0.57x). With 16-byte aligned o and tensors it takes, at sizes where its kernel
    outweighs its host path (_GLUON_MIN_FLOP)."""
    B, H, S, D = q.shape
    return (
        GLUON
        and (D == 128 or (D == 64 and not causal) or (D == 256 and _GLUON_D256))
        and 4 * B * H * S * k.shape[2] * D >= _GLUON_MIN_FLOP
        and o.data_ptr() % 16 == 0
        and hopper_supported(q, k, v, None)
    )


def use_hopper_bwd(q, k, v, kv_len, *dense: torch.Tensor) -> bool:
    """Whether `backward` runs the Gluon FA3-style kernels of _attention_hopper_bwd.py (sm_90, no kv_len, D64
    or D128, at the forward's size threshold; `dense` = dq, dk, dv, do: contiguous and 16-byte aligned, as
    its TMA descriptors need; o is read through its strides). H100 (.dev probe at 332704d, B4 H32 S4096,
    kernel time against the kernels of attention_backward.py): D128 1.11x non-causal, 1.09x causal; D64 1.00x / 1.01x; B1 H32/8 S2048 D128
    causal 1.05x; dq, dk, dv bit-identical across runs."""
    B, H, S, D = q.shape
    return (
        GLUON
        and kv_len is None
        and 4 * B * H * S * k.shape[2] * D >= _GLUON_MIN_FLOP
        and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in dense)
        and hopper_bwd_supported(q, k, v, None)  # the forward's gate at the backward's head dims (no D256)
    )


def forward(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    scale: float = _LEGACY,  # type: ignore[assignment]
    *,
    _config: Tile | None = None,
    _splits: int | None = None,
) -> None:
    """o[B, H, S, D] = attention(q, k, v), lse[B, H, S] (fp32) = logsumexp of the visible scaled scores.

    k/v [B, Hkv, Skv, D] may be strided views with a contiguous last dim (read in place; others are copied).
    kv_len: int32 [B] or None; sequence b sees keys 0..kv_len[b] - 1 (clamped to [0, Skv]), causal
    bottom-right against its own length. Few queries (S <= 16, see `use_decode`) run the split-KV decode
    kernels (_attention_decode.py), the rest the FlashAttention kernel above. Writes `o` and `lse`, returns
    None. `_config` = (BLOCK_M, BLOCK_N, num_warps, num_stages) forces the FlashAttention kernel with that
    tile; `_splits` forces the decode kernels with that many KV splits (tests, benchmarks). The older form
    forward(o, lse, q, k, v, causal, scale) is still accepted.
    """
    kv_len, causal, scale = _kv_args(kv_len, causal, scale)
    B, H, S, D = _check(q, k, v, o)
    q, k, v = last_dim_contiguous(q), kv_tile_addressable(k), kv_tile_addressable(v)
    kv_len = _check_kv_len(kv_len, B, q.device)
    Hkv, Skv = k.shape[1], k.shape[2]
    if lse.shape != (B, H, S) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(
            f"attention: lse must be contiguous fp32 {(B, H, S)}, got {tuple(lse.shape)} {lse.dtype}"
        )
    qk_scale = float(scale) * _LOG2E
    if qk_scale < 0:  # the kernels fold the scale into the row max, which needs scale >= 0
        q, qk_scale = q.neg(), -qk_scale  # exact: (-q).k * (-scale) == q.k * scale; lse is unchanged
    if _splits is not None or (_config is None and use_decode(q, k)):
        with on_device(q):  # q read and o written through their strides
            decode_forward(o, lse, q, k, v, kv_len, causal, qk_scale, splits=_splits)
        return
    if _config is None and kv_len is None and use_hopper(q, k, v, o, causal):
        with on_device(q), _dense(o) as od:
            run_hopper(od, lse, q.contiguous(), k, v, causal, qk_scale)
        return
    ieee = q.dtype == torch.float32
    tma_ok = tma_setup("attention", None if _config is None else (_config,), q, k, v, o)
    has_kv_len = int(kv_len is not None)
    kl = kv_len if kv_len is not None else lse.view(torch.int32)  # never read without kv_len
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
    # Batch slabs (views) of at most _MAX_GRID_Y heads per launch.
    bstep = max(1, _MAX_GRID_Y // H)
    # fp32 inputs (the CPU; CUDA refuses fp32 attention) keep P in fp32, so they take the degree-5 polynomial
    # (2.3e-7, ~ex2.approx's error) rather than one sized for P rounded to half precision.
    poly, degree = EXP2_POLY[0], (5 if ieee else EXP2_POLY[1])
    exp2_kw = {"EXP2_POLY": poly, "EXP2_DEGREE": degree} if poly else {}  # off: the launch as before
    for b0 in range(0, B, bstep):
        sl = slice(b0, min(B, b0 + bstep))
        nb = sl.stop - sl.start
        chunk = _fwd_chunk_args(causal, nb * H, S, Skv, D, q)
        grid_kw = {"GRID_2D": True} if _is_2d(chunk) else {}  # absent: the 1-D kernel, as AOT-compiled
        args = (q[sl], k[sl], v[sl], o[sl], lse[sl], kl[sl] if kv_len is not None else kl, H, Hkv, S, Skv,
                qk_scale, *strides, has_kv_len, *chunk, _bucket(S), _bucket(Skv))  # fmt: skip
        if is_interpreter() or _config is not None:
            tile = _config or _INTERP_TILE
            with on_device(q):
                _attn_fwd_kernel[_grid(triton.cdiv(S, tile[0]), nb * H, chunk)](
                    *args, HEAD_DIM=D, CAUSAL=bool(causal), IEEE=ieee, **exp2_kw, **grid_kw, **_launch_kw(tile)
                )  # fmt: skip
            continue
        with on_device(q):
            _tuned(D, tma_ok)[
                lambda m, nb=nb, chunk=chunk: _grid(triton.cdiv(S, m["BLOCK_M"]), nb * H, chunk)
            ](*args, HEAD_DIM=D, CAUSAL=bool(causal), IEEE=ieee, **exp2_kw, **grid_kw)


@contextlib.contextmanager
def _dense(o: torch.Tensor) -> Iterator[torch.Tensor]:
    """o itself when contiguous, else a contiguous buffer copied into o afterwards: the Gluon kernel writes o
    densely (the kernel above and the decode kernels write it through its strides, in q's memory order)."""
    if o.is_contiguous():
        yield o
        return
    dense = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    yield dense
    o.copy_(dense)


def _is_2d(chunk: tuple[int, int]) -> bool:
    """Whether the forward launches on a 2-D grid: where its order is not chunked (chunk_cap 1, not forced)."""
    return chunk[1] == 1 and chunk[0] >= 0


def _grid(n_qb: int, n_heads: int, chunk: tuple[int, int]) -> tuple[int, ...]:
    """The forward's grid: 2-D (query blocks, heads) where the order is not chunked (head by head, the kernel
    reads its tile straight off the program ids: GRID_2D), else 1-D (_tile_of's order). n_heads <=
    _MAX_GRID_Y per launch (the batch slabs)."""
    return (n_qb, n_heads) if _is_2d(chunk) else (n_qb * n_heads,)


# The forward chunks heads (_fwd_chunk_args) only while its launch is a few waves: up to this many programs
# per SM at the largest query tile (128 rows).
_FWD_CHUNK_MAX_WAVES = 8


def _fwd_chunk_args(causal: bool, n_heads: int, S: int, Skv: int, D: int, q: torch.Tensor) -> tuple[int, int]:
    """(chunk_work, chunk_cap) of the forward's launch order: the backward's rule (_chunk_args; a chunk
    streams k and v of its heads) while there are at most _FWD_CHUNK_MAX_WAVES programs per SM, else a 2-D
    grid's order. H200 (bf16 causal, device time, same call, against the 2-D grid; .dev probe 2026-11-28):
    programs <= 8 per SM: D64 B1 H32/8 S2048 66.4 -> 55.5 us, D128 kv_len B2 H32/8 S2048 204 -> 186,
    B4 H32/8 S1024 130 -> 124; more: D64 B8 H32/8 S1024 121 -> 126, B16 H32 S1024 229 -> 243 (chunks of
    32 heads cost L2 reuse there, and the tail is a small part)."""
    work, cap = _chunk_args(causal, n_heads, 2 * Skv * D * q.element_size(), q)
    if work >= 0 and n_heads * triton.cdiv(S, 128) > _FWD_CHUNK_MAX_WAVES * num_sms(device_index(q)):
        return 0, 1
    return work, cap


def attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    scale: float = _LEGACY,  # type: ignore[assignment]
    *,
    _config: Tile | None = None,
    _splits: int | None = None,
) -> None:
    """The forward without a caller-given lse (it goes to scratch): the entry of the older callers (which may
    also pass (out, q, k, v, causal, scale))."""
    kv_len, causal, scale = _kv_args(kv_len, causal, scale)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    forward(out, lse, q, k, v, kv_len, causal, scale, _config=_config, _splits=_splits)


def backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    scale: float = _LEGACY,  # type: ignore[assignment]
    *,
    _config: tuple[Tile, Tile] | None = None,
) -> None:
    """dq [B, H, S, D], dk/dv [B, Hkv, Skv, D] of attention from the forward's o and lse (FlashAttention-2,
    deterministic: GQA groups are summed inside one program per kv block, no atomics). Writes all three.
    k/v may be strided views (last dim contiguous); with kv_len, keys past kv_len[b] get zero gradients.

    `_config` = (dk/dv tile, dq tile), each (BLOCK_M, BLOCK_N, num_warps, num_stages[, tma]), forces the
    tiles (tma True: the TMA-descriptor variant, sm_90+ and aligned inputs only).
    The older form backward(dq, dk, dv, do, q, k, v, o, lse, causal, scale) is still accepted.
    """
    kv_len, causal, scale = _kv_args(kv_len, causal, scale)
    B, H, S, _ = _check(q, k, v, o)
    q = q.contiguous()  # the backward kernels index q densely (the forward reads a strided q in place)
    k, v = kv_tile_addressable(k), kv_tile_addressable(v)
    kv_len = _check_kv_len(kv_len, B, q.device)
    if (dq.shape, do.shape) != (q.shape, q.shape) or dk.shape != k.shape or dv.shape != k.shape:
        raise ValueError(
            f"attention backward shapes: dq {tuple(dq.shape)}, dk {tuple(dk.shape)}, dv {tuple(dv.shape)}, "
            f"do {tuple(do.shape)} for q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if lse.shape != (B, H, S) or lse.dtype != torch.float32:
        raise ValueError(
            f"attention backward: lse must be fp32 {(B, H, S)}, got {tuple(lse.shape)} {lse.dtype}"
        )
    if not all(t.is_contiguous() for t in (dq, dk, dv, do, lse)):
        raise ValueError("attention backward: tensors must be contiguous")
    if _config is None and use_hopper_bwd(q, k, v, kv_len, dq, dk, dv, do):
        with on_device(q):
            run_hopper_bwd(dq, dk, dv, do, q, k, v, o, lse, causal, scale)
        return
    attention_backward(
        dq, dk, dv, do, q, k, v, o, lse, kv_len, causal, scale, s_bucket=_bucket(S),
        skv_bucket=_bucket(k.shape[2]), max_grid_y=_MAX_GRID_Y, config=_config,
    )  # fmt: skip


# fusekit's provider path (backends/triton.py) calls forward_checked / backward_checked: the library has validated
# the call (shapes, dtypes, devices, kv_len) and made o, lse, dq, dk, dv fresh contiguous outputs on the tensors'
# device. Whether a signature (shapes, strides, dtype, device, kv_len present, causal, the Gluon switches) takes
# the Gluon kernels is decided on its first call (use_hopper / use_hopper_bwd); later calls check only what
# moves between calls - the pointers' 16-byte alignment and the scale's sign - and launch. forward's and
# backward's own checks and gates cost 37 and 60 us of the H200 host's time per call around the Gluon launches
# (benchmarks/results/nvidia-h200/attention-host.json, before this). Anything else takes forward / backward.
_ROUTES: dict[tuple, bool] = {}
_ROUTES_CAP = 4096  # a sweep of shapes; a model has a few


def clear_routes() -> None:
    """Forget the per-signature Gluon decisions (tests that patch GLUON, hopper_supported, ...)."""
    _ROUTES.clear()


def _aligned_ptrs(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


def forward_checked(o, lse, q, k, v, kv_len, causal: bool, scale: float) -> None:
    """forward for a call fusekit's library has validated (see above); same results."""
    # decode shapes (S <= DECODE_MAX_S: a new Skv every token) go straight to forward: no route per length
    if kv_len is None and q.shape[2] > DECODE_MAX_S and scale >= 0 and _aligned_ptrs(o, q, k, v):
        sig = ("f", q.shape, q.stride(), k.shape, k.stride(), v.stride(), o.stride(), lse.stride(), q.dtype,
               q.device, causal, GLUON, _GLUON_D256, _GLUON_MIN_FLOP)  # fmt: skip
        hopper = _ROUTES.get(sig)
        if hopper is None:
            hopper = lse.is_contiguous() and use_hopper(q, k, v, o, causal)
            remember(_ROUTES, sig, hopper, _ROUTES_CAP)
        if hopper:
            with _dense(o) as od:
                run_hopper(od, lse, q.contiguous(), k, v, causal, float(scale) * _LOG2E)
            return
    forward(o, lse, q, k, v, kv_len, causal, scale)


def backward_checked(dq, dk, dv, do, q, k, v, o, lse, kv_len, causal: bool, scale: float) -> None:
    """backward for a call fusekit's library has validated (see above); same results."""
    q = q.contiguous()  # as backward: its kernels index q densely
    if kv_len is None and _aligned_ptrs(dq, dk, dv, do, o, q, k, v):
        sig = ("b", q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), o.stride(), dq.stride(),
               dk.stride(), dv.stride(), lse.stride(), q.dtype, q.device, causal, GLUON, _GLUON_MIN_FLOP)  # fmt: skip
        hopper = _ROUTES.get(sig)
        if hopper is None:
            hopper = lse.is_contiguous() and use_hopper_bwd(q, k, v, None, dq, dk, dv, do)
            remember(_ROUTES, sig, hopper, _ROUTES_CAP)
        if hopper:
            run_hopper_bwd(dq, dk, dv, do, q, k, v, o, lse, causal, scale)
            return
    backward(dq, dk, dv, do, q, k, v, o, lse, kv_len, causal, scale)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> tuple[int, int, int, int]:
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    if k.shape != (B, Hkv, Skv, D) or v.shape != k.shape or out.shape != q.shape or H % Hkv != 0:
        raise ValueError(
            f"attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}"
        )
    if D not in (64, 128, 256):
        raise ValueError(f"attention: head_dim must be 64, 128 or 256, got {D}")
    if out.stride(-1) != 1:
        raise ValueError("attention: o needs a contiguous last dim (its other dims may be strided, as q's)")
    return B, H, S, D


def _check_kv_len(kv_len: torch.Tensor | None, B: int, device: torch.device) -> torch.Tensor | None:
    if kv_len is None:
        return None
    if kv_len.shape != (B,) or kv_len.dtype != torch.int32 or kv_len.device != device:
        raise ValueError(
            f"attention: kv_len must be int32 [{B}] on {device}, got {kv_len.dtype} {tuple(kv_len.shape)} "
            f"on {kv_len.device}"
        )
    return kv_len.contiguous()


def _bucket(n: int) -> int:
    """Autotune key: sequence lengths rounded up to a power of two (re-tune per octave, not per length)."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def aot_specs() -> list[tuple[str, object, dict, dict, dict, dict]]:
    """(name, jit kernel, signature, constexprs, options, attrs) for every tile the launchers can pick.

    Forward: fp16/bf16 x head_dim {64, 128, 256} x causal x (the CUDA + HIP tile tables); the split-KV decode
    kernels (_attention_decode.aot_specs_decode); backward: the same for its kernels
    (attention_backward.aot_specs_backward). options = num_warps/num_stages. attrs = ASTSource attrs
    (16-divisible pointers, row strides and k/v strides): pass them as `ASTSource(fn, signature, constexprs,
    attrs)`, else the GEMM loops compile unpipelined.
    """
    specs: list[tuple[str, object, dict, dict, dict]] = []
    for dt in ("fp16", "bf16"):
        p = f"*{dt}"
        for d, tiles in _union(_CUDA_TILES, _HIP_TILES).items():
            for causal in (False, True):
                for t, g2 in itertools.product(tiles, (False, True)):
                    bm, bn, w, s = t[:4]
                    sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "lse_ptr": "*fp32",
                           "kv_len_ptr": "*i32", "H": "i32", "HKV": "i32", "S": "i32", "SKV": "i32",
                           "qk_scale": "fp32", "stride_qb": "i32", "stride_qh": "i32", "stride_qm": "i32",
                           "stride_kb": "i32", "stride_kh": "i32", "stride_kn": "i32",
                           "stride_vb": "i32", "stride_vh": "i32", "stride_vn": "i32",
                           "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32", "has_kv_len": "i32",
                           "chunk_work": "i32", "chunk_cap": "i32", "S_BUCKET": "i32", "SKV_BUCKET": "i32",
                           "HEAD_DIM": "constexpr", "CAUSAL": "constexpr", "IEEE": "constexpr",
                           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "TMA": "constexpr",
                           "EXP2_POLY": "constexpr", "EXP2_DEGREE": "constexpr", "GRID_2D": "constexpr"}  # fmt: skip
                    # EXP2_POLY: the default kernel (FUSEKIT_TRITON_ATTN_EXP2_POLY is opt-in, not AOT-compiled)
                    const = {"HEAD_DIM": d, "CAUSAL": causal, "IEEE": False, "BLOCK_M": bm, "BLOCK_N": bn,
                             "TMA": _tma(t), "EXP2_POLY": 0, "EXP2_DEGREE": 3, "GRID_2D": g2}  # fmt: skip
                    name = f"attn_{dt}_d{d}_c{int(causal)}_{bm}x{bn}_w{w}s{s}{'_tma' if _tma(t) else ''}{'_2d' * g2}"
                    specs.append((name, _attn_fwd_kernel, sig, const, {"num_warps": w, "num_stages": s}))
    specs += aot_specs_decode()
    return [(*spec, stride_attrs(spec[2])) for spec in specs] + aot_specs_backward() + aot_specs_split_sum()
