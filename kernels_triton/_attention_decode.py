"""Split-KV (flash-decoding) attention forward: a few queries (S <= 16) against a long KV, GQA groups together.

    decode_forward(o, lse, q, k, v, kv_len, causal, qk_scale)   (called by attention.forward for small S)

q/o [B, H, S, D] read and written through their strides (last dim contiguous: a [B, S, H, D] source, o in
q's memory order), lse [B, H, S] fp32 contiguous; k/v [B, Hkv, Skv, D] read through their strides (last dim
contiguous), e.g. `k_cache.transpose(1, 2)[:, :, :L]` of a cache [B, max_len, Hkv, D] read in place;
kv_len: int32 [B] or None (sequence b sees keys 0..kv_len[b] - 1, clamped to [0, Skv]; with `causal` its S
queries are its last S positions: query i sees key j iff j <= i + kv_len[b] - S).

Floor: decode is a stream over the KV cache. Bytes = the KV read, B·Skv·Hkv·D·2·es (k and v once each; q, o,
lse and the fp32 partials are small next to it when the split count is chosen as below). H200 (4.3 TB/s):
B1 Hkv8 Skv32768 D128 bf16 = 134 MB, 31 us; Skv2048: 8.4 MB, 2 us (launch-bound: the goal there is >= 1.0x
SDPA). FLOPs are 4·B·H·S·Skv·D: at most 256 per KV element pair (S = 16, GQA 8): the kernel stays memory-bound
except at that corner.

Two kernels:
1. `_decode_split_kernel`, one program per (b, kv head, row block, split): the G = H/Hkv query heads of the
   kv head and the S queries of each, G·S rows (row r = g·S + s: head g of the group, query s, found in
   q and o through their strides), attend to one chunk of the sequence's keys, so each K/V tile is read
   once per GQA group (the FlashAttention kernel reads it once per query head, H/Hkv times). Rows beyond
   BLOCK_M (G·S > 128, or > 64 at D 256) go to further row blocks. Sequence b's L_b keys are split into
   `n_splits` chunks of whole BLOCK_N tiles (per sequence: with kv_len every program of a sequence gets an
   equal share). Online softmax in fp32 with exp2 and the scale folded into one multiply, as the
   FlashAttention kernel; tiles that every row sees fully run unmasked, the causal diagonal and the ragged
   tail masked (at most two tiles per split). Each program writes a partial (o normalized by its own l,
   fp32) and its log2-domain lse; with one split it writes o and lse directly (no second launch).
2. `_decode_combine_kernel`, one program per output row (b, h, s): lse = log-sum-exp of the partial lses,
   o = sum_i 2^(lse_i - lse) o_i, in a fixed order: deterministic (bit-identical repeats, no atomics).
   On sm_90+ it is launched with programmatic dependent launch (`pdl_supported`): every split program
   first signals `gdc_launch_dependents`, so the combine's programs are scheduled while the split kernel
   runs and wait in `gdc_wait` (which returns once the split kernel's writes are complete and visible)
   instead of paying a launch after it. Same kernels, same math: bit-identical to serialized launches.
   H200, measured on this change (.dev/s/dec_ab.py, device time, best of two rounds, PDL vs serialized vs SDPA):
   B1 H32/8 D128 Skv 1024 11.1 / 13.0 / 12.2 us, Skv 2048 13.1 / 13.9 / 13.1, Skv 8192 22.2 / 22.3 / 22.9,
   Skv 32768 49.6 / 49.8 / 50.1; D64 30.8 / 33.4 / 30.8. The combine still costs ~3 us of the B1 calls
   (the split kernel alone: 10.5 us at Skv 2048): a last-arriving-program combine would need a counter
   that survives calls, which launch replay and concurrent streams rule out for now.

Non-finite values: as the FlashAttention kernel (a NaN in a query row or in a key that a row sees makes that
row NaN; a +inf score gives lse = +inf, o NaN); keys past kv_len are never loaded (a cache may hold anything
there); a row with no visible key (kv_len 0, or causal with S > kv_len) gets o = 0, lse = -inf.

Split count (`decode_splits`): programs P = B·Hkv·row blocks·splits. One program per SM already streams its
K/V tiles at the SM's share of the bandwidth (3-stage pipeline), so the model is in waves of one program per
SM: time ~ (KV bytes + partial bytes) · ceil(P / SMs) · SMs / P (fewer programs than SMs leave SMs idle; a
few programs past a multiple of the SM count add a whole tail wave); each split costs rows·D fp32 of
partials written and read back; at least DECODE_MIN_TILES KV tiles per split; ties (within 3%) go to fewer
splits. Measured on the H200 (132 SMs, bf16, kernel time with the L2 flushed; SDPA's flash-decoding beside
it): the split sweep's best count is the one that fills the SMs in one wave: B1 H32/8 D128 Skv 8192 16
splits 22.3 us (SDPA 22.7; the first model's 33 splits: 23.3), Skv 32768 50.4 (50.3; 33: 51.4), H32/32 4
splits 138.8 (138.5; 9: 151.9), B8 Skv 8192 2 splits 80.6 (79.8; 5: 86.0), B32 Skv 2048 1 split 76.8
(76.0; 2: 90.6), B32 Skv 8192 254.0 (252.2; 2: 290.2), where both stream at ~99% of the KV-read floor.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels_triton import _launch
from kernels_triton._config import device_index, is_hip, is_interpreter, num_sms, pdl_options, pdl_supported
from kernels_triton._launch import fast_launch, launch_keyed
from kernels_triton._tiles import dot

DECODE_MAX_S = 16  # queries per sequence up to which attention.forward picks this path
DECODE_MAX_ROWS = 128  # G·S rows of one GQA group up to which it does (beyond: the FlashAttention kernel)
DECODE_MIN_TILES = 2  # KV tiles per split at least
DECODE_MAX_SPLITS = 256

# (BLOCK_N, num_stages) per head dim. sm_90: a K and a V tile per stage (D·BLOCK_N·2 bytes each, 16 KB at
# D 128 / BLOCK_N 64), three stages in flight = 96 KB of shared memory: two programs per SM; D 128 takes four
# (128 KB, one program per SM, as the split model counts): H200 decode suite at 3de9595, B1 D128 Skv 32768
# H32/32 138.3 us (was 143.0 at three stages) and Skv 131072 H32/8 138.0 (was 142.3), SDPA 139.4 / 139.8 in
# the same run; the other D128 shapes moved by at most 1.3% (noise).
_CUDA_DECODE: dict[int, tuple[int, int]] = {64: (128, 3), 128: (64, 4), 256: (32, 3)}
# gfx942: 64 KB of LDS, single-buffered (stream pipeliner), 64-wide waves. Not measured on an MI300 yet.
_HIP_DECODE: dict[int, tuple[int, int]] = {64: (64, 1), 128: (64, 1), 256: (32, 1)}
_INTERP_BLOCK_N = 16  # the CPU interpreter: numpy per tile, small tiles are fastest


def decode_block_m(rows: int, head_dim: int) -> int:
    """Rows of a GQA group per program: 16 (the smallest tl.dot M), 64 or 128 (64 at D 256: the fp32
    accumulator and the q operand of 128 x 256 would not fit the registers); more rows go to row blocks."""
    if rows <= 16:
        return 16
    if rows <= 64 or head_dim > 128:
        return 64
    return 128


def decode_warps(block_m: int, block_n: int, head_dim: int) -> int:
    """4 warps while the fp32 accumulator (BLOCK_M x D) and score tile (BLOCK_M x BLOCK_N) are <= 8 K
    elements (<= 64 registers a thread each at 32-wide warps), 8 beyond."""
    return 4 if max(block_m * head_dim, block_m * block_n) <= 8192 else 8


def decode_tile(head_dim: int) -> tuple[int, int]:
    if is_interpreter():
        return _INTERP_BLOCK_N, 1
    return (_HIP_DECODE if is_hip() else _CUDA_DECODE)[head_dim]


@functools.lru_cache(maxsize=4096)
def decode_splits(groups: int, rows: int, skv: int, head_dim: int, es: int, block_n: int, sms: int) -> int:
    """Split count for `groups` = B·Hkv·row blocks programs per split of `rows` query rows each (see the
    module docstring for the model)."""
    max_s = max(1, min(DECODE_MAX_SPLITS, math.ceil(skv / (block_n * DECODE_MIN_TILES))))
    kv = groups * skv * head_dim * 2 * es
    best_t, best = math.inf, 1
    for s in range(1, max_s + 1):
        part = 0 if s == 1 else groups * rows * s * (head_dim + 1) * 4 * 2  # written, then read back
        programs = groups * s
        t = (kv + part) * (-(-programs // sms)) * sms / programs  # waves of one program per SM
        if t < best_t * 0.97:  # ties go to fewer splits
            best_t, best = t, s
    return best


# ------------------------------------------------------------------------------------------------ kernels
@fast_launch
@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, po_ptr, plse_ptr, kv_len_ptr,
    H, HKV, S, SKV, qk_scale,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
    has_kv_len, causal, n_splits, row_blocks, direct,
    HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # causal, has_kv_len and direct are runtime flags (they only change the few masked tiles and the final
    # store), so one binary per (dtype, head dim, BLOCK_M) serves every call.
    if PDL:  # the combine kernel (launched with PDL) may be scheduled now; it waits for our partials itself
        gdc_launch_dependents()
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    bhkv = pid // row_blocks
    rb = pid % row_blocks
    b = bhkv // HKV
    hkv = bhkv % HKV
    GS = (H // HKV) * S  # rows of the group
    L = SKV
    if has_kv_len:
        L = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), SKV)
    # this program's keys: the sequence's L keys in n_splits chunks of whole tiles
    chunk = tl.cdiv(tl.cdiv(L, BLOCK_N), n_splits) * BLOCK_N
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, L)  # a multiple of BLOCK_N, or L

    offs_r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_in = offs_r < GS
    q_row0 = (b.to(tl.int64) * H + hkv * (H // HKV)) * S  # the group's first row in lse and the partials
    # q and o through their strides (a [B, S, H, D] source read as [B, H, S, D] in place): group row r is
    # head hkv * G + r // S, query r % S
    head = (hkv * (H // HKV) + offs_r // S).to(tl.int64)
    qo_s = (offs_r % S).to(tl.int64)
    q_rows = b.to(tl.int64) * stride_qb + head * stride_qh + qo_s * stride_qm
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_in[:, None], other=0.0)
    skn = stride_kn.to(tl.int64)
    svn = stride_vn.to(tl.int64)
    # K as a [HEAD_DIM, BLOCK_N] view (K-major B operand), V as [BLOCK_N, HEAD_DIM]; int64 tile offsets
    k_base = k_ptr + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    kt_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    diag = L - S  # causal: query s sees keys j <= s + diag
    full = tl.where(causal != 0, tl.maximum(diag + 1, 0), L)  # keys < full: seen by every row
    u_end = tl.maximum(lo, tl.minimum(hi, (full // BLOCK_N) * BLOCK_N))

    # Unmasked tiles (every row sees every key): qk_scale >= 0, so the scale folds into one FMA per score.
    for start_n in range(lo, u_end, BLOCK_N):
        kt = tl.load(kt_ptrs + start_n * skn)
        qk = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every score -inf: p = 0, not NaN
        p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs + start_n * svn)
        acc = dot(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new

    # Causal diagonal and ragged tail: keys past L are not loaded (other=0) and masked; rows that have seen
    # no key yet stay at m = -inf without NaNs.
    s_idx = offs_r % S
    for start_n in range(u_end, hi, BLOCK_N):
        kn = start_n + offs_n
        k_in = kn < L
        kt = tl.load(kt_ptrs + start_n * skn, mask=k_in[None, :], other=0.0)
        s = dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE) * qk_scale
        valid = k_in[None, :] & ((causal == 0) | (kn[None, :] <= s_idx[:, None] + diag))
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs + start_n * svn, mask=k_in[:, None], other=0.0)
        acc = dot(p.to(v.dtype), v, acc, IEEE)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no visible key in this chunk: acc is 0, the row stays 0
    out = acc / l_safe[:, None]
    # log2-domain lse of the chunk: -inf when it has no visible key, +inf on a +inf score, NaN on a NaN one
    lse2 = m_i + tl.math.log2(l_safe)
    lse2 = tl.where(l_i == 0.0, float("-inf"), lse2)
    lse2 = tl.where(m_i == float("inf"), float("inf"), lse2)
    if direct:  # one split: this is the answer
        rows = q_row0 + offs_r
        o_rows = b.to(tl.int64) * stride_ob + head * stride_oh + qo_s * stride_om
        tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_in[:, None])  # fmt: skip
        tl.store(lse_ptr + rows, lse2 * 0.6931471805599453, mask=row_in)  # natural log
    else:  # partials [B·H·S rows, n_splits, D] fp32 and [B·H·S, n_splits]: a row's splits are contiguous
        prow = (q_row0 + offs_r) * n_splits + sp
        tl.store(po_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_in[:, None])
        tl.store(plse_ptr + prow, lse2, mask=row_in)


@fast_launch
@triton.jit
def _decode_combine_kernel(
    po_ptr, plse_ptr, o_ptr, lse_ptr, n_splits, H, S, stride_ob, stride_oh, stride_om,
    HEAD_DIM: tl.constexpr, BLOCK_SP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # row = (b * H + h) * S + s of lse and the partials; o through its strides (q's memory order)
    if PDL:  # launched early (PDL): the split kernel's partials are complete and visible after this
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_SP)
    offs_d = tl.arange(0, HEAD_DIM)
    base = row * n_splits
    # pass 1: the largest partial lse (fixed order, so the result does not depend on scheduling)
    m = tl.full([BLOCK_SP], float("-inf"), dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_SP):
        sp = s0 + offs_s
        m = tl.maximum(m, tl.load(plse_ptr + base + sp, mask=sp < n_splits, other=float("-inf")))
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # no split saw a key: every weight is 0
    # pass 2: o = sum_i 2^(lse_i - m) o_i / sum_i 2^(lse_i - m); a NaN lse_i or o_i makes the row NaN
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    wsum = tl.zeros([BLOCK_SP], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_SP):
        sp = s0 + offs_s
        s_in = sp < n_splits
        w = tl.math.exp2(tl.load(plse_ptr + base + sp, mask=s_in, other=float("-inf")) - m_safe)
        o_i = tl.load(
            po_ptr + (base + sp)[:, None] * HEAD_DIM + offs_d[None, :], mask=s_in[:, None], other=0.0
        )
        acc += tl.sum(w[:, None] * o_i, axis=0)  # past n_splits: w = 0 and o_i = 0
        wsum += w
    l_sum = tl.sum(wsum, axis=0)
    l_safe = tl.where(l_sum == 0.0, 1.0, l_sum)
    o_row = (row // (H * S)) * stride_ob + ((row // S) % H) * stride_oh + (row % S) * stride_om
    tl.store(o_ptr + o_row + offs_d, (acc / l_safe).to(o_ptr.dtype.element_ty))
    lse = (m_safe + tl.math.log2(l_safe)) * 0.6931471805599453
    lse = tl.where(l_sum == 0.0, float("-inf"), lse)
    lse = tl.where(m_max == float("inf"), float("inf"), lse)
    tl.store(lse_ptr + row, lse)


def combine_block(head_dim: int) -> int:
    """Splits per combine step: an 8 K-element fp32 tile of partials (32 KB)."""
    return 16 if is_interpreter() else 8192 // head_dim


# ------------------------------------------------------------------------------------------------ launch
class _Plan:
    """What a decode problem's launches need apart from the KV length (FlashInfer's plan/run split): tiles,
    row blocks, warps, and the split count per KV length (a growing cache has a new length every token)."""

    __slots__ = ("block_m", "block_n", "es", "forced", "groups", "key", "pdl", "row_blocks", "rows", "sms",
                 "splits", "stages", "warps")  # fmt: skip

    def __init__(self, B: int, H: int, S: int, D: int, Hkv: int, q: torch.Tensor, splits: int | None) -> None:
        rows = (H // Hkv) * S
        self.block_m = decode_block_m(rows, D)
        self.block_n, self.stages = decode_tile(D)
        self.row_blocks = triton.cdiv(rows, self.block_m)
        self.groups = B * Hkv * self.row_blocks
        self.rows = triton.cdiv(rows, self.row_blocks)  # query rows per program
        self.es = q.element_size()
        self.sms = num_sms(device_index(q))
        self.pdl = pdl_supported(device_index(q))  # the combine launched early (see the module doc)
        self.forced = None if splits is None else max(1, int(splits))
        self.warps = 1 if is_interpreter() else decode_warps(self.block_m, self.block_n, D)
        self.splits: dict[int, int] = {}
        # the problem and everything the launches compile in (tiles, warps): part of their keyed launch key
        self.key = (B, H, S, D, Hkv, q.dtype, q.device, self.block_m, self.block_n, self.stages, self.warps,
                    self.pdl)  # fmt: skip

    def n_splits(self, skv: int, head_dim: int) -> int:
        n = self.splits.get(skv)
        if n is None:
            n = self.forced or decode_splits(
                self.groups, self.rows, skv, head_dim, self.es, self.block_n, self.sms
            )
            if len(self.splits) >= 4096:
                self.splits.clear()
            self.splits[skv] = n
        return n


_PLANS: dict[tuple, _Plan] = {}
_I32 = 2**31


def decode_forward(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_len: torch.Tensor | None,
    causal: bool,
    qk_scale: float,
    *,
    splits: int | None = None,
) -> None:
    """Writes o, lse (shapes checked by attention.forward; qk_scale = scale·log2(e) >= 0). `splits` forces the
    split count (tests, benchmarks); None picks it (`decode_splits`).

    Host path: the plan is found by the problem without its KV length, and the launches are remembered by a
    key of what Triton specializes on (`_launch.launch_keyed`): the KV length's and strides' classes, not
    their values, so a cache that grows every token costs no plan, no split search after the first time at
    that length, and no per-argument keying."""
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    plan_key = (q.shape, Hkv, q.dtype, q.device, splits)
    plan = _PLANS.get(plan_key)
    if plan is None:
        plan = _Plan(B, H, S, D, Hkv, q, splits)
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        _PLANS[plan_key] = plan
    n_splits = plan.n_splits(Skv, D)
    direct = n_splits == 1
    if direct:
        po = plse = lse  # not touched (direct stores); any fp32 pointer will do
    else:
        n = B * H * S * n_splits  # partial rows; o and lse partials share one allocation
        part = torch.empty(n * (D + 1), dtype=torch.float32, device=q.device)
        po = part[: n * D].view(B * H * S, n_splits, D)
        plse = part[n * D :].view(B * H * S, n_splits)
    has_kv_len = kv_len is not None
    kl = kv_len if has_kv_len else lse.view(torch.int32)  # never read without kv_len
    ieee = q.dtype == torch.float32
    ks, vs, qs, os_ = k.stride(), v.stride(), q.stride(), o.stride()
    # The launches' key: every pointer 16-byte aligned and every stride a multiple of 16 within int32 (the
    # usual case: anything else takes the per-argument key), the KV length's class; the rest is the plan's.
    # On AMD the per-argument key, which holds each tensor's storage class (_launch.HIP_STORAGE_KEY).
    bits = ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2] | qs[0] | qs[1] | qs[2] | os_[0] | os_[1] | os_[2]
    ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr() | lse.data_ptr() | po.data_ptr()
    ptrs |= plse.data_ptr() | kl.data_ptr()
    key = None
    if not (bits & 15 or ptrs & 15) and bits < _I32 and Skv < _I32 and not _launch.HIP_STORAGE_KEY:
        key = (plan.key, k.dtype, v.dtype, o.dtype, causal, has_kv_len, Skv == 1, Skv & 15 == 0, n_splits)
    grid = (plan.groups, n_splits)
    launch_keyed(
        _decode_split_kernel, None if key is None else ("split", *key), grid,
        (q, k, v, o, lse, po, plse, kl, H, Hkv, S, Skv, qk_scale, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
         qs[0], qs[1], qs[2], os_[0], os_[1], os_[2], int(has_kv_len), int(bool(causal)), n_splits,
         plan.row_blocks, int(direct)),
        {"HEAD_DIM": D, "IEEE": ieee, "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "PDL": plan.pdl,
         "num_warps": plan.warps, "num_stages": plan.stages},
    )  # fmt: skip
    if not direct:
        kw = {"HEAD_DIM": D, "BLOCK_SP": combine_block(D), "PDL": plan.pdl,
              "num_warps": 1 if is_interpreter() else 4, "num_stages": 1, **pdl_options(plan.pdl)}  # fmt: skip
        launch_keyed(
            _decode_combine_kernel, None if key is None else ("combine", *key), (B * H * S,),
            (po, plse, o, lse, n_splits, H, S, os_[0], os_[1], os_[2]), kw,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------------ AOT
def aot_specs_decode() -> list[tuple[str, object, dict, dict, dict]]:
    """(name, jit kernel, signature, constexprs, options) of every decode config the launcher can pick, per
    target: sm_90 with its tile table and PDL (the combine launched with `launch_pdl`), gfx942 with its tile
    table and no PDL (griddepcontrol is PTX): fp16/bf16 x head dim x BLOCK_M {16, 64, 128 (not at D 256)},
    and the combine kernel per dtype x head dim: 44 specs."""
    specs: list[tuple[str, object, dict, dict, dict]] = []
    for dt in ("fp16", "bf16"):
        p = f"*{dt}"
        sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "lse_ptr": "*fp32", "po_ptr": "*fp32",
               "plse_ptr": "*fp32", "kv_len_ptr": "*i32", "H": "i32", "HKV": "i32", "S": "i32", "SKV": "i32",
               "qk_scale": "fp32", "stride_kb": "i32", "stride_kh": "i32", "stride_kn": "i32",
               "stride_vb": "i32", "stride_vh": "i32", "stride_vn": "i32",
               "stride_qb": "i32", "stride_qh": "i32", "stride_qm": "i32",
               "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32", "has_kv_len": "i32",
               "causal": "i32", "n_splits": "i32", "row_blocks": "i32", "direct": "i32",
               "HEAD_DIM": "constexpr", "IEEE": "constexpr", "BLOCK_M": "constexpr",
               "BLOCK_N": "constexpr", "PDL": "constexpr"}  # fmt: skip
        csig = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "o_ptr": p, "lse_ptr": "*fp32", "n_splits": "i32",
                "H": "i32", "S": "i32", "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32",
                "HEAD_DIM": "constexpr", "BLOCK_SP": "constexpr", "PDL": "constexpr"}  # fmt: skip
        for target, table, pdl in (("sm_90", _CUDA_DECODE, True), ("gfx942", _HIP_DECODE, False)):
            only = {"aot_targets": (target,)}
            for d in (64, 128, 256):
                bn, st = table[d]
                for bm in (16, 64) if d > 128 else (16, 64, 128):
                    w = decode_warps(bm, bn, d)
                    const = {"HEAD_DIM": d, "IEEE": False, "BLOCK_M": bm, "BLOCK_N": bn, "PDL": pdl}
                    name = f"attn_decode_{dt}_d{d}_{bm}x{bn}_w{w}s{st}_{target}"
                    specs.append((name, _decode_split_kernel, sig, const,
                                  {"num_warps": w, "num_stages": st, **only}))  # fmt: skip
                bsp = 8192 // d
                copts = {"num_warps": 4, "num_stages": 1, **only, **pdl_options(pdl)}
                specs.append((f"attn_decode_combine_{dt}_d{d}_sp{bsp}_{target}", _decode_combine_kernel, csig,
                              {"HEAD_DIM": d, "BLOCK_SP": bsp, "PDL": pdl}, copts))  # fmt: skip
    return specs
