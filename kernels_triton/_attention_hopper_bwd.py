"""FlashAttention-3-style attention backward for Hopper (sm_90), written in Gluon; deterministic (no atomics).

Entry points (attention.backward runs it through `use_hopper_bwd`):
    hopper_bwd_supported(q, k, v, kv_len) -> bool    whether hopper_backward can run these tensors
    hopper_backward(dq, dk, dv, do, q, k, v, o, lse, causal, scale) -> None

Contract (that of attention_backward.attention_backward without kv_len): q/do/dq [B, H, S, D] contiguous (o
may be strided with a contiguous last dim: the forward writes it in q's memory order),
k/v [B, Hkv, Skv, D] with a contiguous last dim (strided views allowed when every stride is 16-byte aligned),
dk/dv [B, Hkv, Skv, D] contiguous, lse [B, H, S] fp32 natural log (-inf for a row that sees no key), GQA head
h // (H // Hkv), fp16/bf16, D 64 or 128. Causal bottom-right (query i sees key j iff j <= i + Skv - S). With
s = scale q k^T over the visible keys, p = exp(s - lse), delta = rowsum(do * o):
    dv = p^T do,  dp = do v^T,  ds = p (dp - delta),  dq = scale ds k,  dk = scale ds^T q,
each kv head's dk/dv summing its H / Hkv query heads in a fixed order.

Three launches, as attention_backward.py (7 matmuls, no atomics):
1. `_bwd_preprocess_kernel` (attention_backward.py, reused): delta and lse2 = lse * log2(e), -inf -> +inf, so
   p = exp2(s * scale * log2(e) - lse2) is exactly 0 for a row that sees no key without a mask.
2. `_dkdv_hopper`, one CTA per (128 keys, b*Hkv + hkv), three partitions (FA3's warp specialization):
   - producer, 1 warp: TMA loads of the CTA's K and V (two 64-key halves each, once), then Q and dO tiles of
     BLOCK_M query rows into a STAGES-deep ring (q_ready/do_ready mbarriers with TMA transaction counts,
     qdo_empty with one arrival per consumer), walking every query head of the GQA group and every query
     block that sees the CTA's keys.
   - two consumer warpgroups, each owning 64 keys (wgmma M = 64) and their fp32 dk, dv [64, D] in registers.
     Per ring slot, computed transposed (keys as rows): S^T = K Q^T and dP^T = V dO^T (both A and B from
     shared memory, issued back to back, async), P^T = exp2(S^T c - lse2), dS^T = P^T (dP^T - delta), then
     dV += P^T dO and dK += dS^T Q with P^T / dS^T as register A operands (no shared-memory round trip).
     Both consumers see the same slots: the two warpgroups' GEMMs interleave on the tensor cores.
   - epilogue: dk * scale, dv through the warpgroup's own K/V shared buffers and TMA stores clipped at Skv.
3. `_dq_hopper`, one CTA per (128 queries, b*H + h): producer loads Q and dO once (two 64-row halves) and
   streams K, V tiles of BLOCK_N keys through a ring (separate K and V ready barriers); each consumer
   warpgroup owns 64 query rows: S = Q K^T, dP = dO V^T, P, dS = P (dP - delta), dQ += dS K (dS from
   registers), dq * scale stored through its Q buffer by TMA (clipped at S).
Causal: query blocks (dk/dv) and key tiles (dq) nobody sees are never loaded; only the diagonal tiles (and for
dq the ragged Skv tail, whose zero-filled keys would otherwise give p = exp2(-lse2)) run masked. A ragged S
tail needs no mask: TMA zero-fills q/do rows past S (the [B*H, S, D] descriptors clip at the head's end) and
lse2 loads as +inf there, so p = 0 exactly. Keys past Skv in a dk/dv CTA collect garbage that the store clips.
A key block no query sees (causal, S < Skv... or rows seeing nothing) runs no step and stores dk = dv = 0.

Measured (H100, torch 2.11, Triton 3.6, .dev probe at 332704d; kernel time with do_bench, L2 flushed; B4 H32
S=Skv=4096 bf16; FLOPs 10*B*H*S*Skv*D, half causal): D128 446 TFLOP/s non-causal (1.11x the kernels of
attention_backward.py), 396 causal (1.09x); D64 357 / 323 (1.00x / 1.01x); B1 H32/8 S2048 D128 causal 239
(1.05x). SDPA's backward ran at 523 / 455 (D128) and 438 / 371 (D64) in the same process: FA3's dq via
fp32 atomics in the dk/dv kernel saves the second kernel's recompute (tried here and lost: below). Config sweep
(same run, D128): dq BLOCK_N 128 x 2 stages 1-2% faster than 64 x 3 (the table below); dk/dv BLOCK_M 64 beat
32 by 5-10% (32 x 3: 407 TFLOP/s), 3 stages = 2. D64: the table's (64, 3) / (128, 2) was the best of three.
FUSEKIT_HOPPER_BWD_CFG="DKDV_BLOCK_M,DKDV_STAGES,DQ_BLOCK_N,DQ_STAGES" overrides them (probes).

Atomic dq, tried and removed (8d72676, fa4b21e; the code is in git at fa4b21e): FA3's and SDPA's way, dQ +=
scale dS K inside the dk/dv kernel (5 matmuls instead of 7) through relaxed fp32 `red.global.add` into a zeroed
fp32 [B, H, S, D] buffer, then one copy to dq's dtype. It lost on the H100 (Triton 3.6, torch 2.11, 2026-11-27;
do_bench, L2 flushed; B4 H32 S=Skv=4096 bf16; FLOPs 10*B*H*S*Skv*D, half causal): D128 356 TFLOP/s against 446
for the deterministic kernels, causal 279 against 403; D64 242 / 356, causal 232 / 322; B1 H32/8 S2048 D128
causal 144 / 239; the zero-fill + copy alone took 0.22 ms at D128. It was correct (dq within 3.5e-5 of the
deterministic kernels', dk/dv bit-identical). Through the bench's train suite (fwd+bwd): 391 TFLOP/s against
489. Why: every dk/dv CTA adds a full [S, D] fp32 slice per query head, B*H*(Skv/128)*S*D = 2.1 G scalar atomic
adds at that shape (~8.6 GB of atomic traffic); FA3 makes the same adds as bulk TMA reduce-adds of shared-memory
tiles, which Gluon on Triton 3.6 lacks (3.9 has TMA reduce); and its D128 variant spilled 428-1016 bytes (ptxas,
3.6). Worth another try from fa4b21e once the GPU host's Triton has TMA reduce.
The deterministic path's split in the same run (each kernel timed with the preprocess; ms): D128 dk/dv 3.88, dq
2.41 (whole backward 6.17), causal 2.21 / 1.36 (3.41); D64 2.51 / 1.48, causal 1.38 / 0.82. SDPA's backward:
5.26 / 2.96 (D128, non-causal / causal), 3.16 / 1.91 (D64). So the remaining gap is in the dk/dv kernel
(4 matmuls, ~580 TFLOP/s actual); the dq kernel (3 matmuls) runs near 700 TFLOP/s actual.

Gluon is experimental and its API moves between Triton releases: written against Triton 3.6 (the GPU host)
and compile-checked for sm_90 with 3.6 and 3.9. Without Gluon's Hopper module, hopper_bwd_supported says False.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels_triton._attention_hopper import HAS_GLUON, descriptor_fields, hopper_supported, rebased
from kernels_triton._config import EnvSnapshot, num_sms, on_device, remember
from kernels_triton._launch import fast_launch, int_class, launch_keyed
from kernels_triton.attention_backward import (
    CHUNK_BLOCKS_PER_SM,
    CHUNK_L2_BYTES,
    CHUNK_MAX_BLOCKS,
    _bwd_preprocess_kernel,
    _preprocess_rows,
    _tile_of,
    forced_chunk,
)

if HAS_GLUON:  # the forward module's guarded import succeeded: these names exist
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from kernels_triton._attention_hopper import ring_barriers

    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

_LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
WG_M = 64  # rows per consumer warpgroup (wgmma M)
BLOCK_KEYS = 128  # dk/dv CTA: keys (two warpgroups of 64)
BLOCK_QUERIES = 128  # dq CTA: query rows (two warpgroups of 64)
# dk/dv: (BLOCK_M query rows per ring slot, STAGES); shared memory: K, V 2 * 128 * D * 2 bytes + the ring
# STAGES * 2 * BLOCK_M * D * 2 (D128: 64 KB + 2 * 32 KB). Registers per consumer thread: dk, dv 2 * 64 * D / 128,
# S^T and dP^T 2 * 64 * BLOCK_M / 128 (D128, BLOCK_M 64: 128 + 64). ptxas (Triton 3.6, sm_90a): D64 64x3 spills
# nothing (128x2 spilled 532-1256 bytes); D128 64x2 spills 88 / 172 bytes (non-causal / causal): dk, dv, S^T,
# dP^T, P^T/dS^T as wgmma operands and delta are ~240 registers; 32x3 spills nothing (smaller wgmmas): to measure.
DKDV_CONFIGS: dict[int, tuple[int, int]] = {64: (64, 3), 128: (64, 2)}
# dq: (BLOCK_N keys per ring slot, STAGES); Q, dO 2 * 128 * D * 2 bytes + STAGES * 2 * BLOCK_N * D * 2.
DQ_CONFIGS: dict[int, tuple[int, int]] = {64: (128, 2), 128: (128, 2)}
NUM_WARPS = 4  # default partition = consumer warpgroup 0; + 4 (consumer 1) + 1 (producer) warps
MAXNREG = 168  # 12 warps * 32 * 168 <= 65536, then setmaxnreg: consumers 240, producer 24 (as the forward)
CONSUMER_REGS = 240
PRODUCER_REGS = 24
_MAX_GRID_Y = 65535
# Causal dk/dv with few CTAs (B1 H32/8 S2048: 16 key blocks x 8 kv heads = 128 on 132 SMs) is bound by its
# heaviest CTA - the first key block walks all 4 query heads x 32 query blocks, ~2x the mean. Splitting each
# GQA group over SPLIT CTAs (fp32 partial dk/dv into a workspace, summed in split order by _split_sum_kernel:
# deterministic) shortens that path SPLIT-fold for 2 * SPLIT * B*Hkv*Skv*D*4 bytes written and read back.
# dkdv_split's rule, from benchmarks/results/nvidia-h200/attention-split.json (H200, bf16 causal H32/8, the
# backward alone, us for split 1 / 2 / 4; SDPA's backward in brackets): B1 S2048 D128 341 / 254 / 275 (274),
# B1 S4096 D128 1072 / 959 / 945 (793), B2 S2048 D128 475 / 501 / 538 (471), B8 S1024 D128 569 / 622 / 711
# (583), B1 S2048 D64 264 / 431 / 440 (181). So: D128 only, split 2 where the grid fits the SMs once, or
# twice with >= SPLIT_LONG_KB key blocks (long causal rows: the partials are a small share of the work).
SPLIT_LONG_KB = 32
SPLIT_HEAD_DIMS = (128,)
SPLIT_BLOCK = 2048  # _split_sum_kernel elements per program


def _env_config(head_dim: int) -> tuple[int, int, int, int]:
    """(DKDV_BLOCK_M, DKDV_STAGES, DQ_BLOCK_N, DQ_STAGES): the tables, or FUSEKIT_HOPPER_BWD_CFG (probes)."""
    env = os.environ.get("FUSEKIT_HOPPER_BWD_CFG")
    if env:
        a, b, c, d = (int(x) for x in env.split(","))
        if b < 1 or d < 1:  # a ring needs a slot (slot = t % STAGES)
            raise ValueError(f"FUSEKIT_HOPPER_BWD_CFG={env!r}: DKDV_STAGES and DQ_STAGES must be >= 1")
        return a, b, c, d
    return (*DKDV_CONFIGS[head_dim], *DQ_CONFIGS[head_dim])


if HAS_GLUON:
    # ------------------------------------------------------------------------------------------ dk / dv
    @gluon.jit
    def _dkdv_step(t, m, dk, dv, k_s, v_s, q_bufs, do_bufs, q_ready, do_ready, qdo_empty, lse2_ptr, delta_ptr,
                   row_base, keys, cols, S, diag, qk_scale, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                   MASK: gl.constexpr):  # fmt: skip
        # One ring slot (query rows [m, m + BLOCK_M) of one head) into this warpgroup's dk, dv [64, D].
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])  # fmt: skip
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
        dtype: gl.constexpr = k_s.dtype
        slot = t % STAGES
        phase = (t // STAGES) & 1
        q_s = q_bufs.index(slot)
        do_s = do_bufs.index(slot)
        mbarrier.wait(q_ready.index(slot), phase)
        s_tok = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([64, BLOCK_M], gl.float32, s_layout),
                              use_acc=False, is_async=True)  # fmt: skip
        mbarrier.wait(do_ready.index(slot), phase)
        dp_tok = warpgroup_mma(v_s, do_s.permute((1, 0)), gl.zeros([64, BLOCK_M], gl.float32, s_layout),
                               use_acc=False, is_async=True)  # fmt: skip
        qi = m + cols
        in_s = qi < S
        # rows past S: lse2 = +inf (q and do are zero-filled there too); p is selected to 0 below
        lse2 = gl.load(lse2_ptr + row_base + qi, mask=in_s, other=float("inf"))
        delta = gl.load(delta_ptr + row_base + qi, mask=in_s, other=0.0)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if MASK:  # causal diagonal: key j visible to query i iff j <= i + diag; rows past S selected out
            seen = (gl.expand_dims(keys, 1) <= gl.expand_dims(qi + diag, 0)) & gl.expand_dims(in_s, 0)
            pt = gl.where(seen, pt, 0.0)
        elif m + BLOCK_M > S:  # the ragged last block: its q rows past S are 0, and a +-inf key makes s NaN
            pt = gl.where(gl.expand_dims(in_s, 0), pt, 0.0)
        # dV += P^T dO goes to the tensor cores while dS^T is formed (wgmma groups retire in order: waiting
        # for all but one leaves exactly that dV in flight once dP^T is done)
        p16 = gl.convert_layout(pt.to(dtype), a_layout)
        dv_tok = warpgroup_mma(p16, do_s, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok,))
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        ds16 = gl.convert_layout(dst.to(dtype), a_layout)
        dk_tok = warpgroup_mma(ds16, q_s, dk, is_async=True)
        dv, dk, p16, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, p16, ds16))
        mbarrier.arrive(qdo_empty.index(slot), count=1)
        return dk, dv

    @gluon.jit
    def _dkdv_consumer(dk_desc, dv_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, do_ready, qdo_empty,
                       lse2_ptr, delta_ptr, wsk_ptr, wsv_ptr, head0, bhkv, ws_row0, n0, S, SKV, qk_scale, sm_scale,
                       m_lo, n_diag, n_m, group, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])  # fmt: skip
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
        dtype: gl.constexpr = k_smem.dtype
        k_s = k_smem.index(WG)
        v_s = v_smem.index(WG)
        r0 = n0 + WG * 64
        keys = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        diag = SKV - S
        dk = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
        dv = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
        mbarrier.wait(kv_bar, 0)
        t = 0
        # the GQA group sum in a fixed order (head, then query block): deterministic
        for g in range(group):
            row_base = (head0 + g).to(gl.int64) * S
            for i in range(n_diag):  # causal diagonal blocks: masked
                dk, dv = _dkdv_step(t, m_lo + i * BLOCK_M, dk, dv, k_s, v_s, q_bufs, do_bufs, q_ready, do_ready,
                                    qdo_empty, lse2_ptr, delta_ptr, row_base, keys, cols, S, diag, qk_scale,
                                    BLOCK_M, STAGES, True)  # fmt: skip
                t += 1
            for i in range(n_diag, n_m):  # every row sees every key of the CTA (or rows past S: p = 0)
                dk, dv = _dkdv_step(t, m_lo + i * BLOCK_M, dk, dv, k_s, v_s, q_bufs, do_bufs, q_ready, do_ready,
                                    qdo_empty, lse2_ptr, delta_ptr, row_base, keys, cols, S, diag, qk_scale,
                                    BLOCK_M, STAGES, False)  # fmt: skip
                t += 1
        if SPLIT == 1:
            # epilogue: this warpgroup's own K/V buffers are free (its last wgmma is done); the store clips at
            # Skv
            k_s.store((dk * sm_scale).to(dtype))
            v_s.store(dv.to(dtype))
            fence_async_shared()
            _tma_store(dk_desc, [bhkv, r0, 0], k_s.reshape([1, 64, HEAD_DIM]))
            _tma_store(dv_desc, [bhkv, r0, 0], v_s.reshape([1, 64, HEAD_DIM]))
            tma.store_wait(0)
        else:
            # this CTA's share of the GQA group: fp32 partial sums into the workspace's rows ws_row0 + key,
            # which _split_sum_kernel adds up in split order (deterministic); keys past Skv are not stored
            rows = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
            dcol = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
            rows2 = gl.expand_dims(rows, 1) + gl.expand_dims(dcol, 0) * 0
            off = (ws_row0 + rows2.to(gl.int64)) * HEAD_DIM + gl.expand_dims(dcol, 0)
            gl.store(wsk_ptr + off, dk * sm_scale, mask=rows2 < SKV)
            gl.store(wsv_ptr + off, dv, mask=rows2 < SKV)

    @gluon.jit
    def _dkdv_producer(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready,
                       do_ready, qdo_empty, b, hkv, head0, n0, m_lo, n_m, group, BLOCK_M: gl.constexpr,
                       STAGES: gl.constexpr):  # fmt: skip
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [b, hkv, n0, 0], kv_bar, k_smem.index(0).reshape([1, 1, 64, HEAD_DIM]))
        _tma_load(k_desc, [b, hkv, n0 + 64, 0], kv_bar, k_smem.index(1).reshape([1, 1, 64, HEAD_DIM]))
        _tma_load(v_desc, [b, hkv, n0, 0], kv_bar, v_smem.index(0).reshape([1, 1, 64, HEAD_DIM]))
        _tma_load(v_desc, [b, hkv, n0 + 64, 0], kv_bar, v_smem.index(1).reshape([1, 1, 64, HEAD_DIM]))
        for t in range(group * n_m):
            g = t // n_m
            m = m_lo + (t - g * n_m) * BLOCK_M
            bh = head0 + g
            slot = t % STAGES
            # a fresh mbarrier counts as having completed the phase before 0: the first round passes
            mbarrier.wait(qdo_empty.index(slot), ((t // STAGES) & 1) ^ 1)
            qb = q_ready.index(slot)
            mbarrier.expect(qb, q_desc.block_type.nbytes)
            _tma_load(q_desc, [bh, m, 0], qb, q_bufs.index(slot).reshape([1, BLOCK_M, HEAD_DIM]))
            db = do_ready.index(slot)
            mbarrier.expect(db, do_desc.block_type.nbytes)
            _tma_load(do_desc, [bh, m, 0], db, do_bufs.index(slot).reshape([1, BLOCK_M, HEAD_DIM]))

    @gluon.jit
    def _dkdv_hopper(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2_ptr, delta_ptr, wsk_ptr, wsv_ptr, H,
                     HKV, S, SKV, qk_scale, sm_scale, head_chunk, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
        BN: gl.constexpr = 128
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        dtype: gl.constexpr = q_desc.dtype
        # causal: low key blocks are seen by the most queries, so they come first in launch order (_tile_of)
        n_kb = gl.cdiv(SKV, BN)
        n_units = gl.num_programs(0) // n_kb  # (kv head, split) pairs of this launch's batch slab
        kb, unit = _tile_of(gl.program_id(0), n_units, n_kb, head_chunk)
        bhkv = unit // SPLIT
        sp = unit % SPLIT  # this CTA's share of the GQA group (SPLIT > 1: a partial sum into the workspace)
        n0 = kb * BN
        b = bhkv // HKV
        hkv = bhkv % HKV
        group = H // HKV // SPLIT
        head0 = b * H + hkv * group * SPLIT + sp * group  # first query head of the share (in the batch slab)
        ws_row0 = (sp * (n_units // SPLIT) + bhkv).to(gl.int64) * SKV  # workspace [SPLIT, B*Hkv, Skv, D]
        diag = SKV - S
        m_end = gl.cdiv(S, BLOCK_M) * BLOCK_M
        if CAUSAL:
            # queries below n0 - diag see none of these keys; from i_full on they see every (real) one
            m_lo = gl.minimum((gl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M, m_end)
            i_full = gl.minimum(n0 + BN, SKV) - 1 - diag
            m_full = m_lo + gl.cdiv(gl.maximum(i_full - m_lo, 0), BLOCK_M) * BLOCK_M
            m_full = gl.minimum(m_full, m_end)
            n_diag = (m_full - m_lo) // BLOCK_M
        else:
            m_lo = 0
            n_diag = 0
        n_m = (m_end - m_lo) // BLOCK_M  # query blocks per head: n_diag masked, then the rest unmasked

        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], kv_layout)
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
        kv_bar, q_ready, do_ready, qdo_empty = ring_barriers(STAGES)

        gl.warp_specialize(
            [
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, do_ready,
                                  qdo_empty, lse2_ptr, delta_ptr, wsk_ptr, wsv_ptr, head0, bhkv, ws_row0, n0, S,
                                  SKV, qk_scale, sm_scale, m_lo, n_diag, n_m, group, WG0, HEAD_DIM, BLOCK_M,
                                  STAGES, CAUSAL, SPLIT)),
                (_dkdv_consumer, (dk_desc, dv_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, q_ready, do_ready,
                                  qdo_empty, lse2_ptr, delta_ptr, wsk_ptr, wsv_ptr, head0, bhkv, ws_row0, n0, S,
                                  SKV, qk_scale, sm_scale, m_lo, n_diag, n_m, group, WG1, HEAD_DIM, BLOCK_M,
                                  STAGES, CAUSAL, SPLIT)),
                (_dkdv_producer, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar,
                                  q_ready, do_ready, qdo_empty, b, hkv, head0, n0, m_lo, n_m, group, BLOCK_M,
                                  STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip

    _dkdv_hopper = fast_launch(_dkdv_hopper)

    # ---------------------------------------------------------------------------------------------- dq
    @gluon.jit
    def _dq_step(j, dq, q_s, do_s, k_bufs, v_bufs, k_ready, v_ready, kv_empty, lse2, delta, rows, cols, SKV,
                 diag, qk_scale, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr,
                 CAUSAL: gl.constexpr):  # fmt: skip
        # One key tile [j * BLOCK_N, (j + 1) * BLOCK_N) into this warpgroup's dq [64, D].
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq.type.layout, k_width=2)
        slot = j % STAGES
        phase = (j // STAGES) & 1
        k_s = k_bufs.index(slot)
        v_s = v_bufs.index(slot)
        mbarrier.wait(k_ready.index(slot), phase)
        s_tok = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)  # fmt: skip
        mbarrier.wait(v_ready.index(slot), phase)
        dp_tok = warpgroup_mma(do_s, v_s.permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                               use_acc=False, is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        if MASK:  # the causal diagonal and the ragged Skv tail (zero-filled keys: s = 0, p = exp2(-lse2))
            kn = j * BLOCK_N + cols
            valid = gl.expand_dims(kn < SKV, 0)
            if CAUSAL:
                valid = valid & (gl.expand_dims(kn, 0) <= gl.expand_dims(rows + diag, 1))
            p = gl.where(valid, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
        ds = p * (dp - gl.expand_dims(delta, 1))
        ds16 = gl.convert_layout(ds.to(q_s.dtype), a_layout)
        dq_tok = warpgroup_mma(ds16, k_s, dq, is_async=True)
        dq, ds16 = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ds16))
        mbarrier.arrive(kv_empty.index(slot), count=1)
        return dq

    @gluon.jit
    def _dq_consumer(dq_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, k_ready, v_ready, kv_empty, lse2_ptr,
                     delta_ptr, bh, m0, S, SKV, qk_scale, sm_scale, n_tiles, WG: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr):  # fmt: skip
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = q_smem.dtype
        q_s = q_smem.index(WG)
        do_s = do_smem.index(WG)
        r0 = m0 + WG * 64
        rows = r0 + gl.arange(0, 64, layout=row_s)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        in_s = rows < S
        row_base = bh.to(gl.int64) * S
        lse2 = gl.load(lse2_ptr + row_base + rows, mask=in_s, other=float("inf"))  # past S: p = 0
        delta = gl.load(delta_ptr + row_base + rows, mask=in_s, other=0.0)
        diag = SKV - S
        if CAUSAL:
            n_full = gl.minimum(gl.maximum(r0 + diag + 1, 0), SKV) // BLOCK_N  # tiles every row sees
        else:
            n_full = SKV // BLOCK_N
        n_full = gl.minimum(n_full, n_tiles)
        dq = gl.zeros([64, HEAD_DIM], gl.float32, acc_layout)
        mbarrier.wait(qdo_bar, 0)
        for j in range(0, n_full):
            dq = _dq_step(j, dq, q_s, do_s, k_bufs, v_bufs, k_ready, v_ready, kv_empty, lse2, delta, rows, cols,
                          SKV, diag, qk_scale, BLOCK_N, STAGES, False, CAUSAL)  # fmt: skip
        for j in range(n_full, n_tiles):
            dq = _dq_step(j, dq, q_s, do_s, k_bufs, v_bufs, k_ready, v_ready, kv_empty, lse2, delta, rows, cols,
                          SKV, diag, qk_scale, BLOCK_N, STAGES, True, CAUSAL)  # fmt: skip
        # epilogue through this warpgroup's Q buffer (its last wgmma is done); the store clips at S
        q_s.store((dq * sm_scale).to(dtype))
        fence_async_shared()
        _tma_store(dq_desc, [bh, r0, 0], q_s.reshape([1, 64, HEAD_DIM]))
        tma.store_wait(0)

    @gluon.jit
    def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, k_ready,
                     v_ready, kv_empty, bh, b, hkv, m0, n_tiles, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):  # fmt: skip
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        mbarrier.expect(qdo_bar, 4 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [bh, m0, 0], qdo_bar, q_smem.index(0).reshape([1, 64, HEAD_DIM]))
        _tma_load(q_desc, [bh, m0 + 64, 0], qdo_bar, q_smem.index(1).reshape([1, 64, HEAD_DIM]))
        _tma_load(do_desc, [bh, m0, 0], qdo_bar, do_smem.index(0).reshape([1, 64, HEAD_DIM]))
        _tma_load(do_desc, [bh, m0 + 64, 0], qdo_bar, do_smem.index(1).reshape([1, 64, HEAD_DIM]))
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)
            kb = k_ready.index(slot)
            mbarrier.expect(kb, k_desc.block_type.nbytes)
            _tma_load(
                k_desc, [b, hkv, j * BLOCK_N, 0], kb, k_bufs.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM])
            )
            vb = v_ready.index(slot)
            mbarrier.expect(vb, v_desc.block_type.nbytes)
            _tma_load(
                v_desc, [b, hkv, j * BLOCK_N, 0], vb, v_bufs.index(slot).reshape([1, 1, BLOCK_N, HEAD_DIM])
            )

    @gluon.jit
    def _dq_hopper(q_desc, k_desc, v_desc, do_desc, dq_desc, lse2_ptr, delta_ptr, H, HKV, S, SKV, qk_scale,
                   sm_scale, head_chunk, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                   PRODUCER_REGS: gl.constexpr):  # fmt: skip
        BM: gl.constexpr = 128
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        dtype: gl.constexpr = q_desc.dtype
        n_qb = gl.cdiv(S, BM)
        pid_m, bh = _tile_of(gl.program_id(0), gl.num_programs(0) // n_qb, n_qb, head_chunk)
        if CAUSAL:  # heaviest query blocks first
            pid_m = n_qb - 1 - pid_m
        b = bh // H
        h = bh % H
        hkv = h // (H // HKV)
        m0 = pid_m * BM
        if CAUSAL:  # keys past the last one any row of the block sees are never loaded (0 tiles: dq = 0)
            hi = gl.minimum(gl.maximum(m0 + BM + SKV - S, 0), SKV)
            n_tiles = gl.cdiv(hi, BLOCK_N)
        else:
            n_tiles = gl.cdiv(SKV, BLOCK_N)

        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        qdo_bar, k_ready, v_ready, kv_empty = ring_barriers(STAGES)

        gl.warp_specialize(
            [
                (_dq_consumer, (dq_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, k_ready, v_ready, kv_empty,
                                lse2_ptr, delta_ptr, bh, m0, S, SKV, qk_scale, sm_scale, n_tiles, WG0, HEAD_DIM,
                                BLOCK_N, STAGES, CAUSAL)),
                (_dq_consumer, (dq_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar, k_ready, v_ready, kv_empty,
                                lse2_ptr, delta_ptr, bh, m0, S, SKV, qk_scale, sm_scale, n_tiles, WG1, HEAD_DIM,
                                BLOCK_N, STAGES, CAUSAL)),
                (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, qdo_bar,
                                k_ready, v_ready, kv_empty, bh, b, hkv, m0, n_tiles, BLOCK_N, STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip

    _dq_hopper = fast_launch(_dq_hopper)


# ------------------------------------------------------------------------------------------------ host
def hopper_bwd_supported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor | None = None
) -> bool:
    """What the forward takes (same layouts and TMA descriptors, hopper_supported) at the backward's head
    dims (the forward also takes D256)."""
    return q.shape[-1] in HEAD_DIMS and hopper_supported(q, k, v, kv_len)


def _check_out(name: str, t: torch.Tensor, like: torch.Tensor, dense: bool = True) -> None:
    """`dense`: contiguous and 16-byte aligned (a TMA descriptor's tensor); else a contiguous last dim only."""
    layout_ok = (t.is_contiguous() and t.data_ptr() % 16 == 0) if dense else t.stride(-1) == 1
    if t.shape != like.shape or t.dtype != like.dtype or not layout_ok:
        want = f"{tuple(like.shape)} {like.dtype}"
        want = f"contiguous 16-byte aligned {want}" if dense else f"{want} with a contiguous last dim"
        raise ValueError(f"hopper_backward: {name} must be a {want}")


def hopper_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> None:
    """Writes dq [B, H, S, D], dk, dv [B, Hkv, Skv, D] (all contiguous, 16-byte aligned) from do, o (contiguous
    like q), lse [B, H, S] fp32 (natural log) and q, k, v. Call only where hopper_bwd_supported(q, k, v, None)
    is True."""
    if not hopper_bwd_supported(q, k, v, None):
        raise ValueError("hopper_backward: unsupported inputs (see hopper_bwd_supported)")
    _check_out("dq", dq, q)
    _check_out("do", do, q)
    _check_out("o", o, q, dense=False)  # read through its strides (the preprocess only)
    _check_out("dk", dk, k)
    _check_out("dv", dv, k)
    B, H, S = q.shape[:3]
    if lse.shape != (B, H, S) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"hopper_backward: lse must be contiguous fp32 {(B, H, S)}")
    with on_device(q):
        run_hopper_bwd(dq, dk, dv, do, q, k, v, o, lse, causal, scale)


@fast_launch
@triton.jit
def _split_sum_kernel(wsk_ptr, wsv_ptr, dk_ptr, dv_ptr, n, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """dk[i] = sum over s of wsk[s, i] (dv from wsv on program_id(1) == 1), fp32, s in order, then cast."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    if tl.program_id(1) == 0:
        src = wsk_ptr
        dst = dk_ptr
    else:
        src = wsv_ptr
        dst = dv_ptr
    acc = tl.load(src + offs, mask=m, other=0.0)
    for sp in tl.static_range(1, SPLIT):
        acc += tl.load(src + offs + sp * n.to(tl.int64), mask=m, other=0.0)  # int64: split * n may pass 2^31
    tl.store(dst + offs, acc.to(dst.dtype.element_ty), mask=m)


def dkdv_split(causal: bool, head_dim: int, n_kb: int, n_bhkv: int, group: int, device: int) -> int:
    """CTAs per GQA group in the dk/dv kernel (see SPLIT_LONG_KB): 2 where causal, D in SPLIT_HEAD_DIMS, an
    even group and a grid of n_kb * n_bhkv CTAs <= the SMs (or <= 2x with n_kb >= SPLIT_LONG_KB); else 1.
    FUSEKIT_HOPPER_BWD_SPLIT=N forces N where it divides the group (probes, tests); "auto", empty or unset: the
    rule; anything else a ValueError naming the variable."""
    env = os.environ.get("FUSEKIT_HOPPER_BWD_SPLIT", "").strip() or "auto"  # set but empty: unset
    if env != "auto":
        if not env.isdigit():
            raise ValueError(f"FUSEKIT_HOPPER_BWD_SPLIT={env!r}: expected 'auto' or a positive integer")
        forced = int(env)
        return forced if forced >= 1 and group % forced == 0 else 1
    if not causal or head_dim not in SPLIT_HEAD_DIMS or group % 2:
        return 1
    ctas, sms = n_kb * n_bhkv, num_sms(device)
    return 2 if ctas <= sms or (n_kb >= SPLIT_LONG_KB and ctas <= 2 * sms) else 1


# Plan/run split (FlashInfer's), as run_hopper's: per signature (shapes, k/v strides, dtype, device, causal, the
# switches below) the tile configs, the split, head chunks, grids, launch keys and the 11 descriptors' validated
# fields are decided once (_BwdSlab per batch slab); a call allocates delta / lse2 (and the split's workspace),
# rebases the descriptors and launches. Before it, run_hopper_bwd took 378 us of the H200 host's time per call
# at B1 H32/8 S2048 D128 causal (benchmarks/gpu_checks/attention_host.py at 9f3122f), its kernels ~250.
_BWD_ENV = EnvSnapshot("FUSEKIT_HOPPER_BWD_CFG", "FUSEKIT_HOPPER_BWD_SPLIT", "FUSEKIT_TRITON_ATTN_CHUNK")
_BWD_PLANS: dict[tuple, list] = {}


class _BwdSlab:
    """One batch slab's launches (at most _MAX_GRID_Y heads): `sl` (None: the whole batch), the preprocess
    grid, the dk/dv and dq kernels' grids, keys around the per-call pointer alignments (`*_key`, `*_key_tail`),
    constexprs and int arguments, the split and its workspace size, and the descriptors' fields by name."""

    __slots__ = ("fields", "grid_kv", "grid_pre", "grid_q", "grid_sum", "kv_consts", "kv_ints", "kv_key",
                 "kv_key_tail", "n_el", "pre_rows", "q_consts", "q_ints", "q_key", "q_key_tail", "sl", "split")  # fmt: skip


def clear_plans() -> None:
    """Forget the backward plans (tests that patch what a plan is built from: num_sms, ...)."""
    _BWD_PLANS.clear()


def run_hopper_bwd(dq, dk, dv, do, q, k, v, o, lse, causal: bool, scale: float) -> None:
    """hopper_backward minus its checks, on the current device: the preprocess (attention_backward.py's
    kernel), then the dk/dv (and split sum) and dq kernels through the lean launch path (launch_keyed, host
    descriptors), as the signature's plan (_bwd_plan) says."""
    sig = (q.shape, k.shape, k.stride(), v.stride(), q.dtype, q.device, bool(causal), _BWD_ENV())
    slabs = _BWD_PLANS.get(sig)
    if slabs is None:
        slabs = remember(_BWD_PLANS, sig, _bwd_plan(q, k, v, do, dq, dk, dv, bool(causal)))
    B, H, S, D = q.shape
    qk_scale = float(scale) * _LOG2E  # no row max in the backward: any sign of scale is fine
    sm_scale = float(scale)
    delta = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    for p in slabs:
        sl = p.sl
        if sl is None:
            qq, kk, vv, dd, oo, ll, dqq, dkk, dvv, l2, dl = q, k, v, do, o, lse, dq, dk, dv, lse2, delta
        else:
            qq, kk, vv, dd, oo, ll = q[sl], k[sl], v[sl], do[sl], o[sl], lse[sl]
            dqq, dkk, dvv, l2, dl = dq[sl], dk[sl], dv[sl], lse2[sl], delta[sl]
        _bwd_preprocess_kernel[p.grid_pre](
            oo, dd, ll, dl, l2, S, H, *oo.stride()[:3], HEAD_DIM=D, BLOCK=p.pre_rows, num_warps=8
        )
        ds = _descriptors(p.fields, qq, kk, vv, dd, dqq, dkk, dvv)
        aligned = (l2.data_ptr() & 15 == 0, dl.data_ptr() & 15 == 0)  # the fp32 pointers' 16-byte alignment
        split = p.split
        # split > 1: fp32 partials [2 (dk, dv), split, B*Hkv*Skv*D]; else unused (delta stands in)
        ws = torch.empty((2, split * p.n_el), dtype=torch.float32, device=q.device) if split > 1 else None
        wsk, wsv = (ws[0], ws[1]) if ws is not None else (dl, dl)
        args = (ds["q"], ds["k"], ds["v"], ds["do"], ds["dk"], ds["dv"], l2, dl, wsk, wsv, *p.kv_ints[:4], qk_scale,
                sm_scale, p.kv_ints[4])  # fmt: skip
        launch_keyed(_dkdv_hopper, (*p.kv_key, *aligned, *p.kv_key_tail), p.grid_kv, args, p.kv_consts)
        if ws is not None:
            _split_sum_kernel[p.grid_sum](
                wsk, wsv, dkk, dvv, p.n_el, SPLIT=split, BLOCK=SPLIT_BLOCK, num_warps=8
            )
        args = (ds["q64"], ds["kq"], ds["vq"], ds["do64"], ds["dq"], l2, dl, *p.q_ints[:4], qk_scale, sm_scale,
                p.q_ints[4])  # fmt: skip
        launch_keyed(_dq_hopper, (*p.q_key, *aligned, *p.q_key_tail), p.grid_q, args, p.q_consts)


def _bwd_plan(q, k, v, do, dq, dk, dv, causal: bool) -> list[_BwdSlab]:
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    bm, st_kv, bn, st_q = _env_config(D)
    kv_consts = dict(HEAD_DIM=D, BLOCK_M=bm, STAGES=st_kv, CAUSAL=causal, CONSUMER_REGS=CONSUMER_REGS,
                     PRODUCER_REGS=PRODUCER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)  # fmt: skip
    q_consts = dict(HEAD_DIM=D, BLOCK_N=bn, STAGES=st_q, CAUSAL=causal, CONSUMER_REGS=CONSUMER_REGS,
                    PRODUCER_REGS=PRODUCER_REGS, num_warps=NUM_WARPS, maxnreg=MAXNREG)  # fmt: skip
    # everything the compiled kernels depend on: dtypes, constexprs, grid, device, the int arguments'
    # specialization classes (head_chunk's too); per call, the fp32 pointers' 16-byte alignment (descriptors:
    # aligned by contract)
    ints = tuple(int_class(n) for n in (H, Hkv, S, Skv))
    n_kb, n_qb = triton_cdiv(Skv, BLOCK_KEYS), triton_cdiv(S, BLOCK_QUERIES)
    dt = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    bstep = max(1, _MAX_GRID_Y // H)
    slabs = []
    for b0 in range(0, B, bstep):
        sl = slice(b0, min(B, b0 + bstep))
        nb = sl.stop - sl.start
        p = _BwdSlab()
        p.sl = None if nb == B else sl
        p.pre_rows = _preprocess_rows(D)
        p.grid_pre = (triton_cdiv(S, p.pre_rows), nb * H)
        p.split = split = dkdv_split(causal, D, n_kb, nb * Hkv, H // Hkv, q.device.index)
        n_units = nb * Hkv * split
        hc = head_chunk(causal, n_kb, n_units, 2 * S * D * q.element_size() // split, q.device.index)
        p.grid_kv = (n_kb * n_units,)
        p.n_el = nb * Hkv * Skv * D
        p.grid_sum = (triton_cdiv(p.n_el, SPLIT_BLOCK), 2)
        p.kv_key = ("attn_hopper_bwd_dkdv", q.device.index, q.dtype, D, causal, bm, st_kv, p.grid_kv, *ints)
        p.kv_key_tail = (int_class(hc), split)
        p.kv_ints = (H, Hkv, S, Skv, hc)
        p.kv_consts = {**kv_consts, "SPLIT": split}
        hc = head_chunk(causal, n_qb, nb * H, 2 * Skv * D * q.element_size(), q.device.index)
        p.grid_q = (n_qb * nb * H,)
        p.q_key = ("attn_hopper_bwd_dq", q.device.index, q.dtype, D, causal, bn, st_q, p.grid_q, *ints)
        p.q_key_tail = (int_class(hc),)
        p.q_ints = (H, Hkv, S, Skv, hc)
        p.q_consts = q_consts
        src = _sources(q[sl], k[sl], v[sl], do[sl], dq[sl], dk[sl], dv[sl])
        p.fields = {
            name: descriptor_fields(src[name], box, _layout(dt, box))
            for name, box in _blocks(D, bm, bn).items()
        }
        slabs.append(p)
    return slabs


def head_chunk(causal: bool, n_blocks: int, n_heads: int, head_bytes: int, device: int) -> int:
    """Heads per chunk of the launch order (`_tile_of`). 1 (block-fastest, the order a 2-D grid gives) without
    causal, where every block costs the same, and at n_blocks >= 32 (CHUNK_MAX_BLOCKS; the constants live in
    attention_backward.py, whose kernels take the same rule). Otherwise enough heads that a chunk
    averages ~2 heaviest blocks of work per SM (h heads of n causal blocks hold ~h * n / 2 heaviest-block
    equivalents), so its heaviest blocks, which start first, end before its light ones; at most 8 MiB of the
    heads' streamed operands (`head_bytes` each: q and do for dk/dv, k and v for dq) so they stay in L2.
    H200, bf16 D128 causal, device time of the backward (.dev probe, 2026-11-28; SDPA's backward in brackets):
    B8 H32/8 S1024 636 us with 1, 574 with 16 (579); B1 H32/8 S2048 359 / 344 with 8 (270). At n_blocks >= 32
    the tail is a small part and larger chunks only cost L2: B4 H32 S4096 D128 3271-3338 us with 1,
    3290-3295 with 17; D64 2033 with 1, 2051-2068 with 17; B2 S8192 6186-6313 with 1, 6589-7061 with 9.
    FUSEKIT_TRITON_ATTN_CHUNK forces it (probes; attention_backward._chunk_args)."""
    forced = forced_chunk(n_heads)
    if forced:
        return forced
    if not causal or n_blocks >= CHUNK_MAX_BLOCKS.value:
        return 1
    work = triton_cdiv(CHUNK_BLOCKS_PER_SM * num_sms(device), n_blocks)
    return max(1, min(n_heads, work, CHUNK_L2_BYTES // max(1, head_bytes)))


_LAYOUTS: dict[tuple, object] = {}


def _layout(dtype_name: str, block: tuple[int, ...]):
    """The 128-byte-swizzled shared layout of a host descriptor's box (cached: building one costs Python)."""
    lay = _LAYOUTS.get((dtype_name, block))
    if lay is None:
        gdt = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype_name]
        lay = _LAYOUTS[(dtype_name, block)] = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    return lay


def _blocks(head_dim: int, bm: int, bn: int) -> dict[str, tuple[int, ...]]:
    """Descriptor boxes: dk/dv kernel q/do [1, BLOCK_M, D] of [B*H, S, D], k/v [1, 1, 64, D] of [B, Hkv, Skv,
    D], dk/dv [1, 64, D] of [B*Hkv, Skv, D]; dq kernel q/do/dq [1, 64, D], k/v [1, 1, BLOCK_N, D]."""
    d = head_dim
    return {"q": (1, bm, d), "do": (1, bm, d), "k": (1, 1, 64, d), "v": (1, 1, 64, d), "dk": (1, 64, d),
            "dv": (1, 64, d), "q64": (1, 64, d), "do64": (1, 64, d), "dq": (1, 64, d), "kq": (1, 1, bn, d),
            "vq": (1, 1, bn, d)}  # fmt: skip


def _sources(q, k, v, do, dq, dk, dv) -> dict:
    """The tensor each descriptor of _blocks reads or writes: q, do, dq as [B*H, S, D], k, v as they are,
    dk, dv as [B*Hkv, Skv, D]."""
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    q3, do3 = q.view(B * H, S, D), do.view(B * H, S, D)
    return {"q": q3, "do": do3, "k": k, "v": v, "dk": dk.view(B * Hkv, Skv, D), "dv": dv.view(B * Hkv, Skv, D),
            "q64": q3, "do64": do3, "dq": dq.view(B * H, S, D), "kq": k, "vq": v}  # fmt: skip


def _descriptors(fields: dict, q, k, v, do, dq, dk, dv) -> dict:
    """Every descriptor of _blocks over this call's tensors: the plan's fields rebased."""
    src = _sources(q, k, v, do, dq, dk, dv)
    return {name: rebased(f, src[name]) for name, f in fields.items()}


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def aot_specs_split_sum() -> list[tuple[str, object, dict, dict, dict, dict]]:
    """(name, jit kernel, signature, constexprs, options, attrs) of _split_sum_kernel per dtype and split (a
    plain Triton kernel: compiled for every target with the rest of attention's specs)."""
    from kernels_triton._config import div16_attrs

    specs = []
    for dt in ("fp16", "bf16"):
        for split in (2, 4, 8):
            sig = {"wsk_ptr": "*fp32", "wsv_ptr": "*fp32", "dk_ptr": f"*{dt}", "dv_ptr": f"*{dt}", "n": "i32",
                   "SPLIT": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
            specs.append((f"attn_bwd_split_sum_{dt}_s{split}", _split_sum_kernel, sig,
                          {"SPLIT": split, "BLOCK": SPLIT_BLOCK}, {"num_warps": 8}, div16_attrs(sig)))  # fmt: skip
    return specs


def aot_specs_gluon_bwd() -> list[tuple[str, object, dict, dict, dict]]:
    """(name, gluon kernel, signature, constexprs, options) per (kernel, dtype, D, causal) variant, for an
    ahead-of-time compile for sm_90 with triton.experimental.gluon._runtime.GluonASTSource; [] without Gluon.
    (The preprocess is attention_backward.py's kernel: aot_specs_backward covers it.)"""
    if not HAS_GLUON:
        return []
    specs = []
    for dt in ("fp16", "bf16"):
        for d in HEAD_DIMS:
            bm, st_kv, bn, st_q = (*DKDV_CONFIGS[d], *DQ_CONFIGS[d])
            blocks = _blocks(d, bm, bn)

            def desc(name: str, dt=dt, blocks=blocks) -> str:
                box = blocks[name]
                return f"tensordesc<{dt}[{', '.join(map(str, box))}],{_layout(dt, box)!r}>"

            tail = {"lse2_ptr": "*fp32", "delta_ptr": "*fp32", "H": "i32", "HKV": "i32", "S": "i32", "SKV": "i32",
                    "qk_scale": "fp32", "sm_scale": "fp32", "head_chunk": "i32", "HEAD_DIM": "constexpr"}  # fmt: skip
            ws = {"wsk_ptr": "*fp32", "wsv_ptr": "*fp32"}
            regs = {"CAUSAL": "constexpr", "CONSUMER_REGS": "constexpr", "PRODUCER_REGS": "constexpr"}
            opts = {"num_warps": NUM_WARPS, "maxnreg": MAXNREG}
            for causal in (False, True):
                kv_sig = {"q_desc": desc("q"), "k_desc": desc("k"), "v_desc": desc("v"), "do_desc": desc("do"),
                          "dk_desc": desc("dk"), "dv_desc": desc("dv"), "lse2_ptr": "*fp32", "delta_ptr": "*fp32",
                          **ws, **{n: t for n, t in tail.items() if n not in ("lse2_ptr", "delta_ptr")},
                          "BLOCK_M": "constexpr", "STAGES": "constexpr", **regs, "SPLIT": "constexpr"}  # fmt: skip
                for split in (1, 2) if causal else (1,):  # split: the causal small-grid variant (dkdv_split)
                    kv_const = {"HEAD_DIM": d, "BLOCK_M": bm, "STAGES": st_kv, "CAUSAL": causal,
                                "CONSUMER_REGS": CONSUMER_REGS, "PRODUCER_REGS": PRODUCER_REGS, "SPLIT": split}  # fmt: skip
                    name = f"attn_hopper_bwd_dkdv_{dt}_d{d}_c{int(causal)}" + (
                        f"_s{split}" if split > 1 else ""
                    )
                    specs.append((name, _dkdv_hopper, kv_sig, kv_const, opts))
                q_sig = {"q_desc": desc("q64"), "k_desc": desc("kq"), "v_desc": desc("vq"), "do_desc": desc("do64"),
                         "dq_desc": desc("dq"), **tail, "BLOCK_N": "constexpr", "STAGES": "constexpr", **regs}  # fmt: skip
                q_const = {"HEAD_DIM": d, "BLOCK_N": bn, "STAGES": st_q, "CAUSAL": causal,
                           "CONSUMER_REGS": CONSUMER_REGS, "PRODUCER_REGS": PRODUCER_REGS}  # fmt: skip
                specs.append(
                    (f"attn_hopper_bwd_dq_{dt}_d{d}_c{int(causal)}", _dq_hopper, q_sig, q_const, opts)
                )
    return specs
