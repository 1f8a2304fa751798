"""Attention backward (FlashAttention-2, from the saved lse), deterministic: no atomics anywhere.

    dq, dk, dv <- do, q, k, v, o, lse, kv_len?   (q/o/do/dq [B, H, S, D], k/v/dk/dv [B, Hkv, Skv, D],
                                                  lse [B, H, S], kv_len int32 [B] or None)

k/v may be strided views with a contiguous last dim (a KV cache read in place: the kernels take their
strides); dk/dv are contiguous. With kv_len, sequence b sees keys 0..L_b - 1 (L_b = clamp(kv_len[b], 0, Skv)),
causal bottom-right against L_b; keys past L_b are not loaded and get zero dk/dv.

With s = scale q k^T (visible keys only), p = exp(s - lse), delta = rowsum(do * o):
    dv = p^T do,  dp = do v^T,  ds = p (dp - delta),  dq = scale ds k,  dk = scale ds^T q,
and under GQA each kv head's dk/dv sums its H / Hkv query heads.

Three kernels:
1. `_bwd_preprocess_kernel`, per (query rows, b*H + h): delta = rowsum(do * o) in fp32, and lse2 = lse * log2(e)
   (exp2 domain) with lse = -inf (a row that sees no key) mapped to +inf, so p = exp2(s2 - lse2) is exactly 0
   for such a row without a mask.
2. `_bwd_dkdv_kernel`, per (BLOCK_N keys, b*Hkv + hkv): k, v of its keys stay on chip; it walks every query
   head of the GQA group and every query block that sees any of its keys, accumulating dk, dv in fp32
   registers. The group sum is a loop inside one program, so it is deterministic and needs no atomics.
3. `_bwd_dq_kernel`, per (BLOCK_M queries, b*H + h): q, do, lse2, delta stay on chip; it walks the visible key
   blocks, recomputing p and dp, accumulating dq.
FlashAttention-2 instead accumulates dq with fp32 atomics from the dk/dv program (5 matmuls); atomics make the
sum order, hence the bits, vary run to run, which the contract forbids. Recomputing p and dp in the dq kernel
costs two more matmuls: 7 instead of 5.

FLOP floor: the backward's useful work is 5 matmuls of 2*S*Skv*D each per head = 10*B*H*S*Skv*D non-causal
(2.5x the forward's 4*B*H*S*Skv*D), about half of it causal. B4 H32 S=Skv=4096 D128: 2.75 PFLOP (~3.5 ms at
790 TFLOP/s). This implementation issues 14*B*H*S*Skv*D (7 matmuls): 3.85 PFLOP, ~4.9 ms at the ceiling.
Bytes are negligible (q, k, v, o, do, dq, dk, dv once each ~1.1 GB, ~0.25 ms): compute-bound, so the aim is
the tensor-core rate and no wasted tiles. Throughput is quoted against the 10*B*H*S*Skv*D floor.

Causal masking is bottom-right aligned (query i sees key j iff j <= i + Skv - S). Both main kernels split
their loop as the forward does: tiles that every row/key of the program fully sees run without a mask; the
diagonal tiles and the ragged tails run with one; tiles nobody sees are skipped. exp2 with the scale and
log2(e) folded into one multiply (p = exp2(qk * scale*log2(e) - lse2), one FMA per score). Element offsets
are int64 ((b*H + h) * S * D passes 2^31 at B4 H32 S128k D128). fp32 inputs use input_precision="ieee".

Non-finite values: a NaN/Inf in q, k, v or do reaches the gradients it touches as in float64 autograd of a
softmax over the visible keys, except that a NaN in a *masked* key's k row also reaches the dq rows of its
diagonal tile (ds = 0 there, but 0 * NaN = NaN inside the ds @ k product; float64 autograd of s = q k^T does
the same).

Tile choice (the tables below): the dk/dv program holds two fp32 accumulators of BLOCK_N x D, the dq program
one of BLOCK_M x D, plus the BLOCK_M x BLOCK_N score and dp tiles; on sm_90 a thread has at most 255
registers, so at 8 warps (256 threads) 2 x 128 x 128 fp32 accumulators already take 128 of them. Hence
BLOCK_N(keys) x D <= 16 K elements at 8 warps for dk/dv and query steps of 32/64 rows (the score tile stays
small); for dq, a 128 x D accumulator up to D = 128 with 64-key steps. On sm_90 each kernel also has a TMA
variant (constexpr TMA): k/v, q/do and the dk/dv/dq stores go through tensor descriptors built on the device,
which frees the per-element address registers of pointer loads and lets larger tiles run; the autotuner picks
among both kinds per (head dim, causal, dtype, S bucket, Skv bucket), measured figures beside the tables.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels_triton._config import (
    device_index,
    div16_attrs,
    ensure_tma_allocator,
    is_hip,
    is_interpreter,
    num_sms,
    on_device,
)
from kernels_triton._launch import fast_launch, fast_tuned
from kernels_triton._tiles import dot

_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim. dk/dv: BLOCK_N keys held, BLOCK_M query
# rows per step. dq: BLOCK_M query rows held, BLOCK_N keys per step. A backward tile may carry a fifth
# element, True: the kernel loads through TMA descriptors (sm_90+, 16-byte aligned tensors and strides; see
# `_tma_ok`). First entry = default; the autotuner picks among the entries per (head dim, causal, dtype,
# S bucket, Skv bucket).
Tile = tuple[int, int, int, int] | tuple[int, int, int, int, bool]  # (BLOCK_M, BLOCK_N, warps, stages[, tma])
# Hopper (sm_90), measured on the H200 (Triton 3.6, bf16, B4 S=Skv=4096, H32 at D64/D128, H16 at D256; kernel
# time with the L2 flushed, non-causal / causal where both were run; "spills" = Triton 3.6's count):
#   dk/dv D64 : TMA 64x64 w4 s3 2169 us; 32x128 w4 s3 TMA 2380; pointer 64x64 w4 s3 2429 (the old default).
#   dk/dv D128: TMA 64x64 w4 s2 4090 / 2216 (2-4 spills); TMA 64x128 w8 s3 4071 / 2398 (2-22); pointer
#               32x64 w4 s3 4337 / 2419 (0); pointer 32x64 w4 s2 4887 / 2482 (the old default).
#   dk/dv D256: TMA 64x64 w8 s2 6728 (4 spills); TMA 32x64 w8 s2 9469; pointer 64x32 w8 s2 12142 (old).
#   dq    D64 : TMA 128x64 w8 s3 1458; pointer 128x64 w8 s3 1484; TMA 64x64 w4 s3 1544.
#   dq    D128: TMA 128x32 w8 s3 2906 / 2034; TMA 128x64 w8 s3 3006 / 1700; pointer 128x64 w8 s3 3362 / 1595;
#               pointer 64x64 w4 s2 3670 / 1607.
#   dq    D256: TMA 64x64 w4 s2 3161; TMA 128x32 w8 s2 3724; pointer 128x32 w8 s2 4900 (old).
# Register pressure is what these tiles trade: the dk/dv program holds two fp32 BLOCK_N x D accumulators;
# pointer loads also hold a 64-bit address per element they fetch, which TMA loads do not, so the TMA
# variants run larger tiles at a few spilled registers (measured faster than the spill-free pointer tiles).
# Not taken, measured on the same H200 (D128, B4 H32 S4096): FlashAttention-2's 5-matmul backward, dq
# accumulated in fp32 with atomics from the dk/dv program (TMA reduce-add or red.global), zero + kernel +
# cast: 8304 us non-causal / 4614 causal at its best tile (64x128 w8 s3, 46-76 spills) against 7000 / 3800
# for the two deterministic kernels here: the fifth accumulator spills more than the two extra matmuls cost,
# and it would make dq's bits vary run to run.
# Whole forward + backward against torch SDPA on the same H200 (torch 2.11; SDPA time / ours, non-causal /
# causal; .dev probe at f08967a, B4 S4096): D128 H32 0.79 / 0.82 (0.70 / 0.78 with the old pointer tables),
# D64 0.86 / 0.92, D256 H16 0.71 / 0.77 (0.50 / 0.54 before). Backward alone at D128: 6.88 ms (was 8.34)
# against SDPA's ~5.56 ms; the forward (0.74x SDPA here) is the other third of the gap.
_CUDA_DKDV: dict[int, list[Tile]] = {
    64: [(64, 64, 4, 3), (64, 64, 4, 3, True), (32, 128, 4, 3, True)],
    128: [(32, 64, 4, 3), (64, 64, 4, 2, True), (64, 128, 8, 3, True)],
    256: [(64, 32, 8, 2), (64, 64, 8, 2, True), (32, 64, 8, 2, True)],
}
_CUDA_DQ: dict[int, list[Tile]] = {
    64: [(128, 64, 8, 3), (128, 64, 8, 3, True), (64, 64, 4, 3, True)],
    128: [(128, 64, 8, 3), (128, 32, 8, 3, True), (128, 64, 8, 3, True)],
    256: [(128, 32, 8, 2), (64, 64, 4, 2, True), (128, 32, 8, 2, True)],
}
# CDNA (gfx942): 64-wide waves, 64 KB of LDS: K/V (dk/dv) or Q/dO (dq) blocks must fit it with the streamed
# tiles; single-buffered (stream pipeliner). Not measured on an MI300 yet.
_HIP_DKDV: dict[int, list[Tile]] = {
    64: [(32, 64, 4, 1)],
    128: [(32, 64, 4, 1)],
    256: [(16, 32, 4, 1)],
}
_HIP_DQ: dict[int, list[Tile]] = {
    64: [(64, 32, 4, 1)],
    128: [(64, 32, 4, 1)],
    256: [(32, 32, 4, 1)],
}
_INTERP_TILES: tuple[Tile, Tile] = ((16, 16, 1, 1), (16, 16, 1, 1))  # the interpreter: small is fastest

# Launch order of the backward kernels, here and in _attention_hopper_bwd (figures: its head_chunk): causal
# heads with fewer than CHUNK_MAX_BLOCKS blocks go in chunks of ~CHUNK_BLOCKS_PER_SM heaviest blocks per SM,
# with at most CHUNK_L2_BYTES of a chunk's streamed operands so they stay in L2.
CHUNK_MAX_BLOCKS = tl.constexpr(32)
CHUNK_BLOCKS_PER_SM = 4
CHUNK_L2_BYTES = 8 << 20


def _preprocess_rows(head_dim: int) -> int:
    """Rows per preprocess program: an 8 K-element tile of o and of do (32 fp32 values of each per thread)."""
    return 16 if is_interpreter() else max(16, 8192 // head_dim)


# ------------------------------------------------------------------------------------------------ kernels
@fast_launch
@triton.jit
def _bwd_preprocess_kernel(
    o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, S, H, stride_ob, stride_oh, stride_om,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # o through its strides: the forward writes it in q's memory order ([B, S, H, D] for a transposed q)
    offs_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bh = tl.program_id(1)
    rows = bh.to(tl.int64) * S + offs_m
    in_s = offs_m < S
    offs_d = tl.arange(0, HEAD_DIM)
    o_base = o_ptr + (bh // H).to(tl.int64) * stride_ob + (bh % H).to(tl.int64) * stride_oh
    o_ptrs = o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :]
    o = tl.load(o_ptrs, mask=in_s[:, None], other=0.0).to(tl.float32)
    do_ptrs = do_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
    do = tl.load(do_ptrs, mask=in_s[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, tl.sum(o * do, axis=1), mask=in_s)
    lse = tl.load(lse_ptr + rows, mask=in_s, other=0.0)
    # -inf (no visible key) -> +inf: exp2(s2 - lse2) is then exactly 0 for the whole row, mask or not
    tl.store(
        lse2_ptr + rows, tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634), mask=in_s
    )


@triton.jit
def _head_chunk(n_blocks, n_heads, chunk_work, chunk_cap, CAUSAL: tl.constexpr):
    """Heads per chunk of the launch order (`_tile_of`), the rule of _attention_hopper_bwd.head_chunk taken
    per tile (the autotuner's configs differ in block size): 1 without causal, where every block costs the
    same, and at >= CHUNK_MAX_BLOCKS blocks per head; otherwise enough heads that a chunk holds ~chunk_work
    heaviest-block equivalents, capped at chunk_cap (the host's L2 bound; 1 forces the order of a 2-D grid).
    H200 (bf16, causal, device time of the backward, .dev probe 2026-11-28, against the 2-D grid with dq's
    query blocks lightest first; bit-identical gradients): D128 kv_len B8 H32/8 S1024 652 -> 604 us, B1 H16
    S1024 77.7 -> 75.2, D64 kv_len B2 H32/8 S2048 381 -> 370, D256 B8 H16 S1024 1068 -> 1021, B1 H32/8
    S2048 966 -> 960. At >= 32 blocks the order stays the 2-D grid's: heaviest-first dq there (chunk 1)
    measured 5264 -> 5373 us at D256 B4 H16 S4096."""
    hc = 1
    if CAUSAL:
        hc = tl.minimum(tl.minimum(n_heads, tl.cdiv(chunk_work, n_blocks)), chunk_cap)
        hc = tl.where(n_blocks < CHUNK_MAX_BLOCKS, hc, 1)
    hc = tl.where(chunk_work < 0, chunk_cap, hc)  # forced by FUSEKIT_TRITON_ATTN_CHUNK (_chunk_args)
    return tl.maximum(hc, 1)


@triton.jit
def _tile_of(pid, n_heads, n_blocks, head_chunk):
    """Launch order -> (block, head) on a 1-D grid (this file's kernels, the forward's and the Gluon backward's):
    heads in chunks of `head_chunk`, block-major within a chunk, so a chunk's heaviest blocks (causal, in the
    caller's block numbering) are dispatched before its light ones and the last blocks to start are light.
    Block-fastest over all heads (head_chunk 1, what a 2-D grid gives) leaves the last head's heaviest block
    starting near the end: a tail of up to one heavy block on most SMs, which matters when a head has few
    blocks (_attention_hopper_bwd.head_chunk's figures). A chunk of a few heads keeps their streamed operands
    in L2. The last chunk may hold fewer heads."""
    per_chunk = head_chunk * n_blocks
    chunk = pid // per_chunk
    h0 = chunk * head_chunk
    nh = tl.minimum(head_chunk, n_heads - h0)
    r = pid - chunk * per_chunk
    return r // nh, h0 + r % nh


@triton.jit
def _nonzero(n):
    """max(n, 1): a divisor LLVM cannot assume non-zero from, for a loop's index split (see _bwd_dkdv_kernel)."""
    return tl.maximum(n, 1)


@triton.jit
def _dkdv_step(
    dk, dv, k, v, q_ptr, do_ptr, q_desc, do_desc, lse2_ptr, delta_ptr, row0, m, offs_n, offs_d, S, diag,
    qk_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One query block [m, m + BLOCK_M) of the query head whose first row is `row0` (int64) into dk, dv.

    Computed transposed (keys as rows) so dk, dv accumulate as [BLOCK_N, D] without transposing the products:
    s^T = k q^T, p^T = exp2(s^T * c - lse2), dv += p^T do, dp^T = v do^T, ds^T = p^T (dp^T - delta),
    dk += ds^T q (the scale is applied once at the end). TMA: q and do come through [rows, D] descriptors
    over every head; rows of a tail block past S (the next head's, or zero-filled past the end) are zeroed,
    so they contribute exactly what the pointer path's masked loads (0) do."""
    offs_m = m + tl.arange(0, BLOCK_M)
    rows = row0 + offs_m
    if TMA:
        q = q_desc.load([(row0 + m).to(tl.int32), 0])
    else:
        ptrs = rows[:, None] * HEAD_DIM + offs_d[None, :]
    if MASK:
        in_s = offs_m < S
        if TMA:
            q = tl.where(in_s[:, None], q, 0.0)
        else:
            q = tl.load(q_ptr + ptrs, mask=in_s[:, None], other=0.0)
        lse2 = tl.load(lse2_ptr + rows, mask=in_s, other=float("inf"))
    else:
        if not TMA:
            q = tl.load(q_ptr + ptrs)
        lse2 = tl.load(lse2_ptr + rows)
    st = dot(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
    pt = tl.math.exp2(st * qk_scale - lse2[None, :])
    if TMA:
        do = do_desc.load([(row0 + m).to(tl.int32), 0])
    if MASK:
        if TMA:
            do = tl.where(in_s[:, None], do, 0.0)
        else:
            do = tl.load(do_ptr + ptrs, mask=in_s[:, None], other=0.0)
        delta = tl.load(delta_ptr + rows, mask=in_s, other=0.0)
        # rows past S are selected out: q = 0 there, so a key holding +-inf gives s = NaN, and lse2 = +inf
        # would not make exp2(NaN - inf) zero
        valid = in_s[None, :]
        if CAUSAL:
            valid = valid & (offs_n[:, None] - offs_m[None, :] <= diag)
        pt = tl.where(valid, pt, 0.0)
    else:
        if not TMA:
            do = tl.load(do_ptr + ptrs)
        delta = tl.load(delta_ptr + rows)
    # dp^T and ds^T before the two accumulating products: p^T in fp32 dies before they are issued, so the
    # registers it held are free while their wgmmas run (sm_90: the fast tiles sit at the 255-register limit).
    dpt = dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
    dst = pt * (dpt - delta[None, :])
    dv = dot(pt.to(do.dtype), do, dv, IEEE)
    dk = dot(dst.to(q.dtype), q, dk, IEEE)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse2_ptr, delta_ptr, kv_len_ptr, H, HKV, S, SKV, qk_scale,
    sm_scale, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, has_kv_len, chunk_work,
    chunk_cap, S_BUCKET, SKV_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
):  # fmt: skip
    # S_BUCKET / SKV_BUCKET are unused here: they exist so the autotuner can key on bucketed lengths.
    # causal: low key blocks are seen by the most queries, so they come first in launch order (_tile_of)
    n_kb = tl.cdiv(SKV, BLOCK_N)
    n_heads = tl.num_programs(0) // n_kb
    kb, bhkv = _tile_of(
        tl.program_id(0), n_heads, n_kb, _head_chunk(n_kb, n_heads, chunk_work, chunk_cap, CAUSAL)
    )
    n0 = kb * BLOCK_N
    b = bhkv // HKV
    hkv = bhkv % HKV
    group = H // HKV
    L = SKV  # keys of this sequence: 0..L-1 (kv_len[b] clamped to [0, SKV])
    if has_kv_len:
        L = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), SKV)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_l = (offs_n < L)[:, None]
    kv_base = bhkv.to(tl.int64) * SKV * HEAD_DIM  # dk/dv are contiguous [B, Hkv, Skv, D]
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    # Keys past L load as 0 (never read: a cache may hold anything there). Each key row of dk/dv accumulates
    # on its own, so the steps need no key mask: rows past L are zeroed before the store.
    if TMA:
        # k/v: this sequence's first L keys through their strides (TMA zero-fills rows past L; a descriptor
        # needs a dimension of at least 1, and with L = 0 no step runs). q/do: one [rows, D] descriptor over
        # every head of this launch (TMA coordinates are int32: the launcher checks rows < 2^31).
        k_desc = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(L, 1), HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        v_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(L, 1), HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        n_rows = (n_heads // HKV) * H * S
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[n_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        do_desc = tl.make_tensor_descriptor(do_ptr, shape=[n_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                            block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        k = k_desc.load([n0, 0])
        v = v_desc.load([n0, 0])
    else:
        q_desc = q_ptr  # unused
        do_desc = do_ptr
        # k/v through their strides (a cache view; int64: key * stride can pass 2^31)
        k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :], mask=in_l, other=0.0)
        v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vn + offs_d[None, :], mask=in_l, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    diag = L - S  # query i sees key j iff j <= i + diag
    m_end = tl.cdiv(S, BLOCK_M) * BLOCK_M
    if CAUSAL:
        # queries below n0 - diag see none of these keys; from i_full on they see every (real) one
        m_lo = (tl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M
        i_full = tl.minimum(n0 + BLOCK_N, L) - 1 - diag
        m_full = m_lo + tl.cdiv(tl.maximum(i_full - m_lo, 0), BLOCK_M) * BLOCK_M
        m_full = tl.minimum(m_full, m_end)
    else:
        m_lo = 0
        m_full = 0
    u_end = tl.maximum(m_full, (S // BLOCK_M) * BLOCK_M)  # unmasked blocks: [m_full, u_end)
    n_u = (u_end - m_full) // BLOCK_M
    n_diag = (m_full - m_lo) // BLOCK_M  # masked blocks: [m_lo, m_full) (diagonal), [u_end, m_end) (tail)
    n_mask = n_diag + (m_end - u_end) // BLOCK_M
    n_u = tl.where(n0 < L, n_u, 0)  # a block wholly past L: no query sees it
    n_mask = tl.where(n0 < L, n_mask, 0)
    head0 = b.to(tl.int64) * H + hkv * group  # first query head of the group

    # One flat loop over (query head of the group, query block): the pipeliner keeps loads in flight across
    # head switches. The group sum happens here, in a fixed order: deterministic.
    # The flat index is split by a divisor clamped to >= 1 (`_nonzero`): with num_stages > 1 the pipeliner
    # computes the first iterations' (head, block) ahead of the loop for every trip count, 0 included, and
    # only predicates their loads. `it // n_u` with n_u = 0 there is division by zero, undefined behaviour in
    # LLVM, which then took n_u != 0 as a fact and folded the prologue's `0 < trip count` predicate to true:
    # with no unmasked block (S < BLOCK_M non-causal) the TMA loads of the loop's first stage were issued,
    # never waited for, and their mbarriers invalidated and re-initialized for the masked loop with the
    # transaction in flight - the H100 hang (session 55, Triton 3.6; tests/test_triton_attention_grad.py
    # test_dkdv_prologue_loads_stay_predicated checks the compiled code).
    n_u_div = _nonzero(n_u)
    n_mask_div = _nonzero(n_mask)
    for it in range(0, group * n_u):
        g = it // n_u_div
        m = m_full + (it - g * n_u) * BLOCK_M
        dk, dv = _dkdv_step(dk, dv, k, v, q_ptr, do_ptr, q_desc, do_desc, lse2_ptr, delta_ptr, (head0 + g) * S,
                            m, offs_n, offs_d, S, diag, qk_scale, HEAD_DIM, CAUSAL, IEEE, False, BLOCK_M,
                            BLOCK_N, TMA)  # fmt: skip
    for it in range(0, group * n_mask):
        g = it // n_mask_div
        j = it - g * n_mask
        m = tl.where(j < n_diag, m_lo + j * BLOCK_M, u_end + (j - n_diag) * BLOCK_M)
        dk, dv = _dkdv_step(dk, dv, k, v, q_ptr, do_ptr, q_desc, do_desc, lse2_ptr, delta_ptr, (head0 + g) * S,
                            m, offs_n, offs_d, S, diag, qk_scale, HEAD_DIM, CAUSAL, IEEE, True, BLOCK_M,
                            BLOCK_N, TMA)  # fmt: skip

    dk = tl.where(in_l, dk, 0.0)  # keys past L: zero gradient, whatever the unmasked steps collected
    dv = tl.where(in_l, dv, 0.0)
    if TMA:  # the store clips rows past SKV
        dk_desc = tl.make_tensor_descriptor(dk_ptr + kv_base, shape=[SKV, HEAD_DIM], strides=[HEAD_DIM, 1],
                                            block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        dv_desc = tl.make_tensor_descriptor(dv_ptr + kv_base, shape=[SKV, HEAD_DIM], strides=[HEAD_DIM, 1],
                                            block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        dk_desc.store([n0, 0], (dk * sm_scale).to(dk_ptr.dtype.element_ty))
        dv_desc.store([n0, 0], dv.to(dv_ptr.dtype.element_ty))
    else:
        kv_ptrs = kv_base + offs_n.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
        in_kv = (offs_n < SKV)[:, None]
        tl.store(dk_ptr + kv_ptrs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=in_kv)
        tl.store(dv_ptr + kv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=in_kv)


@triton.jit
def _dq_step(
    dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, kt_offs, vt_offs, skn, svn, n, offs_m, L, diag,
    qk_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One key block [n, n + BLOCK_N) into dq: p = exp2(q k^T * c - lse2), dp = do v^T, dq += p (dp - delta) k.

    Pointer path: k^T, v^T as [HEAD_DIM, BLOCK_N] views of the key rows (K-major B operands), by strides;
    keys past L masked to 0. TMA: [BLOCK_N, HEAD_DIM] key rows, zero-filled past L by the descriptor."""
    offs_n = n + tl.arange(0, BLOCK_N)
    if TMA:
        kt = tl.trans(k_desc.load([n, 0]))
    elif MASK:
        kt = tl.load(k_base + n * skn + kt_offs, mask=(offs_n < L)[None, :], other=0.0)
    else:
        kt = tl.load(k_base + n * skn + kt_offs)
    s = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASK:
        valid = (offs_n < L)[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + diag)
        p = tl.where(valid, p, 0.0)
    if TMA:
        vt = tl.trans(v_desc.load([n, 0]))
    elif MASK:
        vt = tl.load(v_base + n * svn + vt_offs, mask=(offs_n < L)[None, :], other=0.0)
    else:
        vt = tl.load(v_base + n * svn + vt_offs)
    dp = dot(do, vt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
    ds = p * (dp - delta[:, None])
    return dot(ds.to(kt.dtype), tl.trans(kt), dq, IEEE)


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, lse2_ptr, delta_ptr, kv_len_ptr, H, HKV, S, SKV, qk_scale, sm_scale,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, has_kv_len, chunk_work, chunk_cap,
    S_BUCKET, SKV_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
):  # fmt: skip
    n_qb = tl.cdiv(S, BLOCK_M)
    n_heads = tl.num_programs(0) // n_qb
    hc = _head_chunk(n_qb, n_heads, chunk_work, chunk_cap, CAUSAL)
    pid_m, bh = _tile_of(tl.program_id(0), n_heads, n_qb, hc)
    if hc > 1:  # chunked (causal, few blocks per head): heaviest query blocks (the most keys) first; head by
        pid_m = n_qb - 1 - pid_m  # head, the 2-D grid's lightest-first order measured 2% faster (_head_chunk)
    m0 = pid_m * BLOCK_M
    b = bh // H
    h = bh % H
    hkv = h // (H // HKV)
    L = SKV  # keys of this sequence: 0..L-1 (kv_len[b] clamped to [0, SKV])
    if has_kv_len:
        L = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), SKV)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_s = offs_m < S
    rows = bh.to(tl.int64) * S + offs_m
    q_base = bh.to(tl.int64) * S * HEAD_DIM
    # k/v through their strides (a cache view): int64 block offsets, int32 offsets within a tile
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    # Rows past S load q = do = 0 and lse2 = +inf: p = 0 there, so the unmasked steps need no row mask.
    if TMA:
        # this head's [S, D] rows (zero-filled past S, the store clips there) and the first L keys
        q_desc = tl.make_tensor_descriptor(q_ptr + q_base, shape=[S, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        do_desc = tl.make_tensor_descriptor(do_ptr + q_base, shape=[S, HEAD_DIM], strides=[HEAD_DIM, 1],
                                            block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        k_desc = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(L, 1), HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        v_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(L, 1), HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
        q = q_desc.load([m0, 0])
        do = do_desc.load([m0, 0])
    else:
        k_desc = k_ptr  # unused
        v_desc = v_ptr
        ptrs = rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(q_ptr + ptrs, mask=in_s[:, None], other=0.0)
        do = tl.load(do_ptr + ptrs, mask=in_s[:, None], other=0.0)
    lse2 = tl.load(lse2_ptr + rows, mask=in_s, other=float("inf"))
    delta = tl.load(delta_ptr + rows, mask=in_s, other=0.0)
    kt_offs = tl.arange(0, BLOCK_N)[None, :] * stride_kn + offs_d[:, None]
    vt_offs = tl.arange(0, BLOCK_N)[None, :] * stride_vn + offs_d[:, None]
    skn = stride_kn.to(tl.int64)
    svn = stride_vn.to(tl.int64)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    diag = L - S
    if CAUSAL:
        hi = tl.maximum(tl.minimum(L, m0 + BLOCK_M + diag), 0)  # past the last key any row sees
        full_end = tl.maximum(tl.minimum(m0 + diag + 1, L), 0)  # keys < this: seen by every row
        full_end = (full_end // BLOCK_N) * BLOCK_N
    else:
        hi = L
        full_end = (L // BLOCK_N) * BLOCK_N
    for n in range(0, full_end, BLOCK_N):
        n = tl.multiple_of(n, BLOCK_N)
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, kt_offs, vt_offs, skn, svn, n,
                      offs_m, L, diag, qk_scale, HEAD_DIM, CAUSAL, IEEE, False, BLOCK_M, BLOCK_N, TMA)  # fmt: skip
    for n in range(full_end, hi, BLOCK_N):
        n = tl.multiple_of(n, BLOCK_N)
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, k_desc, v_desc, kt_offs, vt_offs, skn, svn, n,
                      offs_m, L, diag, qk_scale, HEAD_DIM, CAUSAL, IEEE, True, BLOCK_M, BLOCK_N, TMA)  # fmt: skip
    out = (dq * sm_scale).to(dq_ptr.dtype.element_ty)
    if TMA:
        dq_desc = tl.make_tensor_descriptor(dq_ptr + q_base, shape=[S, HEAD_DIM], strides=[HEAD_DIM, 1],
                                            block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
        dq_desc.store([m0, 0], out)
    else:
        tl.store(dq_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=in_s[:, None])


# ------------------------------------------------------------------------------------------------ launch
# The autotuners offer the TMA tiles at any length. Session 55 saw the dk/dv TMA tile hang an H100 (triton 3.6,
# non-causal fp16 D64 B1 H1, S 12-32 against Skv 16-80, while the autotuner timed it). Cause (Triton 3.6's
# sm_90 LLVM IR): the unmasked loop's `it // n_u`, computed by the pipeliner's prologue with n_u = 0
# (S < BLOCK_M), let LLVM drop the prologue loads' predicate; the clamped divisor in _bwd_dkdv_kernel fixes it,
# and benchmarks/gpu_checks/tma_hang.py's real_fixed_* cases (the formerly hanging shapes, forced and
# autotuned, forward too) pass on a GPU, so the length gate (TMA_MIN_LEN 128, sessions 55-57) is gone.


def _tma(tile: Tile) -> bool:
    return len(tile) > 4 and bool(tile[4])


def _configs(table: dict[int, list[Tile]], head_dim: int, tma_ok: bool) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": t[0], "BLOCK_N": t[1], "TMA": _tma(t)}, num_warps=t[2], num_stages=t[3])
        for t in table[head_dim]
        if tma_ok or not _tma(t)
    ]


@functools.cache
def _tuned_dkdv(head_dim: int, tma_ok: bool):
    cfgs = _configs(_HIP_DKDV if is_hip() else _CUDA_DKDV, head_dim, tma_ok)
    # Outputs are fully overwritten by every run (no accumulation into dk/dv), so re-runs while tuning are safe.
    return fast_tuned(triton.autotune(cfgs, key=["S_BUCKET", "SKV_BUCKET", "CAUSAL"])(_bwd_dkdv_kernel))


@functools.cache
def _tuned_dq(head_dim: int, tma_ok: bool):
    cfgs = _configs(_HIP_DQ if is_hip() else _CUDA_DQ, head_dim, tma_ok)
    return fast_tuned(triton.autotune(cfgs, key=["S_BUCKET", "SKV_BUCKET", "CAUSAL"])(_bwd_dq_kernel))


def _launch_kw(tile: Tile) -> dict:
    """A forced tile as launch keywords."""
    return {
        "BLOCK_M": tile[0],
        "BLOCK_N": tile[1],
        "TMA": _tma(tile),
        "num_warps": tile[2],
        "num_stages": tile[3],
    }


@functools.cache
def _has_tma(dev: int) -> bool:
    return torch.cuda.get_device_capability(dev)[0] >= 9


def _tma_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *outs: torch.Tensor) -> bool:
    """Whether the TMA variants may run: sm_90+ CUDA (or the interpreter), fp16/bf16, every base address and
    q/k/v stride 16-byte aligned (a descriptor's requirement), and the q rows of a launch addressable by int32
    TMA coordinates."""
    if is_hip() or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not is_interpreter() and (q.device.type != "cuda" or not _has_tma(device_index(q))):
        return False
    if q.numel() == 0 or k.numel() == 0:  # nothing to address: the pointer kernels handle the empty cases
        return False
    per16 = 16 // q.element_size()
    if any(t.data_ptr() % 16 for t in (q, k, v, *outs)):
        return False
    if any(st % per16 for t in (q, k, v, *outs) if t.dim() == 4 for st in t.stride()[:3]):  # q, o: views
        return False
    if any(t.stride(2) == 0 and t.shape[2] > 1 for t in (q, k, v) if t.dim() == 4):
        return False  # rows broadcast (stride 0): a descriptor stride outside cuTensorMapEncodeTiled's rules
    return q.shape[1] * q.shape[2] * q.shape[0] < 2**31


def tma_setup(what: str, forced: tuple[Tile, ...] | None, q, k, v, *outs: torch.Tensor) -> bool:
    """Whether the TMA tiles may run on these tensors (`_tma_ok`); a forced TMA tile they cannot take
    raises, naming `what`; Triton's scratch allocator for device-built descriptors is installed when a TMA
    tile may be launched on a GPU."""
    tma_ok = _tma_ok(q, k, v, *outs)
    if forced is not None and any(_tma(t) for t in forced) and not tma_ok:
        raise ValueError(
            f"{what}: a TMA tile was forced, but TMA needs sm_90+, fp16/bf16 and 16-byte aligned "
            f"tensors and k/v strides (q {q.dtype} on {q.device}, k strides {tuple(k.stride())})"
        )
    if tma_ok and not is_interpreter() and (forced is None or any(_tma(t) for t in forced)):
        ensure_tma_allocator()
    return tma_ok


def attention_backward(
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
    scale: float,
    *,
    s_bucket: int,
    skv_bucket: int,
    max_grid_y: int,
    config: tuple[Tile, Tile] | None = None,
) -> None:
    """Writes dq, dk, dv (shapes validated by the caller; k/v may be strided with a contiguous last dim;
    kv_len: int32 [B] or None). `config` = (dk/dv tile, dq tile), each (BLOCK_M, BLOCK_N, num_warps,
    num_stages[, tma]), forces the tiles (tests, benchmarks); a TMA tile on inputs TMA cannot take raises."""
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    ieee = q.dtype == torch.float32
    qk_scale = float(scale) * _LOG2E  # no row max in the backward: any sign of scale is fine
    delta = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    forced = config if config is not None else (_INTERP_TILES if is_interpreter() else None)
    tma_ok = tma_setup("attention backward", forced, q, k, v, do, dq, dk, dv)
    pre_rows = _preprocess_rows(D)
    strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
    # Grid axis 1 (B*H) is limited to 65535: launch in batch slabs (contiguous views), as the forward does.
    bstep = max(1, max_grid_y // H)
    for b0 in range(0, B, bstep):
        sl = slice(b0, min(B, b0 + bstep))
        nb = sl.stop - sl.start
        _bwd_preprocess_kernel[(triton.cdiv(S, pre_rows), nb * H)](
            o[sl], do[sl], lse[sl], delta[sl], lse2[sl], S, H, *o.stride()[:3], HEAD_DIM=D, BLOCK=pre_rows,
            num_warps=1 if is_interpreter() else 8,
        )  # fmt: skip
        kl = kv_len[sl] if kv_len is not None else lse2.view(torch.int32)  # never read without kv_len
        common = (kl, H, Hkv, S, Skv, qk_scale, float(scale), *strides, int(kv_len is not None))
        buckets = (s_bucket, skv_bucket)
        # launch order (_tile_of / _head_chunk): dk/dv chunks stream q and do of a head, dq k and v
        kv_args = (q[sl], k[sl], v[sl], do[sl], dk[sl], dv[sl], lse2[sl], delta[sl], *common,
                   *_chunk_args(causal, nb * Hkv, 2 * S * D * q.element_size(), q), *buckets)  # fmt: skip
        q_args = (q[sl], k[sl], v[sl], do[sl], dq[sl], lse2[sl], delta[sl], *common,
                  *_chunk_args(causal, nb * H, 2 * Skv * D * q.element_size(), q), *buckets)  # fmt: skip
        kw = {"HEAD_DIM": D, "CAUSAL": bool(causal), "IEEE": ieee}
        with on_device(q):
            if forced is not None:
                t1, t2 = forced
                _bwd_dkdv_kernel[(triton.cdiv(Skv, t1[1]) * nb * Hkv,)](*kv_args, **kw, **_launch_kw(t1))
                _bwd_dq_kernel[(triton.cdiv(S, t2[0]) * nb * H,)](*q_args, **kw, **_launch_kw(t2))
                continue
            _tuned_dkdv(D, tma_ok)[lambda m, nb=nb: (triton.cdiv(Skv, m["BLOCK_N"]) * nb * Hkv,)](
                *kv_args, **kw
            )
            _tuned_dq(D, tma_ok)[lambda m, nb=nb: (triton.cdiv(S, m["BLOCK_M"]) * nb * H,)](*q_args, **kw)


def _chunk_args(causal: bool, n_heads: int, head_bytes: int, q: torch.Tensor) -> tuple[int, int]:
    """(chunk_work, chunk_cap) of the kernels' `_head_chunk`: CHUNK_BLOCKS_PER_SM heaviest blocks per SM, and
    at most CHUNK_L2_BYTES of a chunk's streamed operands (`head_bytes` per head); chunk_cap 1 without causal
    keeps a 2-D grid's order, heads one by one. FUSEKIT_TRITON_ATTN_CHUNK (`forced_chunk`) gives (-1, n)."""
    forced = forced_chunk(n_heads)
    if forced:
        return -1, forced
    if not causal:
        return 0, 1
    cap = min(n_heads, CHUNK_L2_BYTES // max(1, head_bytes))
    return CHUNK_BLOCKS_PER_SM * num_sms(device_index(q)), max(1, cap)


def forced_chunk(n_heads: int) -> int:
    """Heads per chunk forced by FUSEKIT_TRITON_ATTN_CHUNK (probes of the launch order, every attention kernel
    with a chunked order: this file's, the forward's, the Gluon backward's), clamped to [1, n_heads]; 0 when
    unset (the rule decides)."""
    env = os.environ.get("FUSEKIT_TRITON_ATTN_CHUNK")
    return max(1, min(n_heads, int(env))) if env else 0


# ------------------------------------------------------------------------------------------------ AOT
def _union(*tables: dict[int, list]) -> dict[int, list]:
    out: dict[int, list] = {}
    for t in tables:
        for d, tiles in t.items():
            out.setdefault(d, [])
            out[d] += [x for x in tiles if x not in out[d]]
    return out


def aot_specs_backward() -> list[tuple[str, object, dict, dict, dict, dict]]:
    """(name, jit kernel, signature, constexprs, options, attrs) for every backward kernel config the launcher
    can pick on CUDA or HIP: fp16/bf16 x head dim x causal x (CUDA tiles + HIP tiles, pointer and TMA), plus
    the preprocess."""
    specs: list[tuple[str, object, dict, dict, dict]] = []
    for dt in ("fp16", "bf16"):
        p = f"*{dt}"
        for d in (64, 128, 256):
            rows = max(16, 8192 // d)
            sig = {"o_ptr": p, "do_ptr": p, "lse_ptr": "*fp32", "delta_ptr": "*fp32", "lse2_ptr": "*fp32",
                   "S": "i32", "H": "i32", "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32",
                   "HEAD_DIM": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
            specs.append((f"attn_bwd_pre_{dt}_d{d}_r{rows}", _bwd_preprocess_kernel, sig,
                          {"HEAD_DIM": d, "BLOCK": rows}, {"num_warps": 8, "num_stages": 1}))  # fmt: skip
        ints = {"kv_len_ptr": "*i32", "H": "i32", "HKV": "i32", "S": "i32", "SKV": "i32", "qk_scale": "fp32",
                "sm_scale": "fp32", "stride_kb": "i32", "stride_kh": "i32", "stride_kn": "i32",
                "stride_vb": "i32", "stride_vh": "i32", "stride_vn": "i32", "has_kv_len": "i32",
                "chunk_work": "i32", "chunk_cap": "i32", "S_BUCKET": "i32", "SKV_BUCKET": "i32"}  # fmt: skip
        consts = {"HEAD_DIM": "constexpr", "CAUSAL": "constexpr", "IEEE": "constexpr", "BLOCK_M": "constexpr",
                  "BLOCK_N": "constexpr", "TMA": "constexpr"}  # fmt: skip
        kv_sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "do_ptr": p, "dk_ptr": p, "dv_ptr": p,
                  "lse2_ptr": "*fp32", "delta_ptr": "*fp32", **ints, **consts}  # fmt: skip
        q_sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "do_ptr": p, "dq_ptr": p, "lse2_ptr": "*fp32",
                 "delta_ptr": "*fp32", **ints, **consts}  # fmt: skip
        for kind, fn, sig, table in (
            ("dkdv", _bwd_dkdv_kernel, kv_sig, _union(_CUDA_DKDV, _HIP_DKDV)),
            ("dq", _bwd_dq_kernel, q_sig, _union(_CUDA_DQ, _HIP_DQ)),
        ):
            for d, tiles in table.items():
                for causal in (False, True):
                    for t in tiles:
                        bm, bn, w, s = t[:4]
                        const = {"HEAD_DIM": d, "CAUSAL": causal, "IEEE": False, "BLOCK_M": bm, "BLOCK_N": bn,
                                 "TMA": _tma(t)}  # fmt: skip
                        tag = "_tma" if _tma(t) else ""
                        name = f"attn_bwd_{kind}_{dt}_d{d}_c{int(causal)}_{bm}x{bn}_w{w}s{s}{tag}"
                        specs.append((name, fn, sig, const, {"num_warps": w, "num_stages": s}))
    return [(*spec, stride_attrs(spec[2])) for spec in specs]


def stride_attrs(sig: dict[str, str]) -> dict[tuple[int], list[list]]:
    """div16_attrs plus the k/v strides (multiples of the head dim for any cache layout): what Triton's JIT
    specializes for 16-aligned tensors and strides, so the AOT binaries are the ones launched."""
    attrs = div16_attrs(sig)
    attrs.update({(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if k.startswith("stride_")})
    return attrs
