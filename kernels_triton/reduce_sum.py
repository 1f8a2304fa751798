"""Row sums x[M, N] -> out[M] (fp32 accumulation for floats, exact int64 for integers), and their gradient.

Entry points (CONTRACT.md): `forward(out, x)` (the row sums below) and `backward(dx, dout)`:
dx[M, N] = dout[:, None] broadcast, rounded once to x's dtype (float x only).

Byte floor, forward: read M*N*elsize once, write M*out_elsize. 2^30 fp32 = 4.29 GB -> 0.95 ms at the
4530 GB/s that CUB's sum reaches on an H200; no arithmetic term matters (one add per element).
Byte floor, backward: write M*N*elsize once (dout's M elements are noise): 2^30 bf16 = 2.15 GB -> ~0.5 ms
at ~4.3 TB/s. `_bcast_kernel` writes [BLOCK_M, BLOCK_N] tiles of 16 KB, 16-byte vector stores (4 per
thread) whenever N * elsize is a multiple of 16 (the JIT's divisibility specialization of N proves the
rows aligned), int64 row offsets, one flat grid of row-tiles x column-tiles (no 65535 grid-axis limit).

Modes (chosen by `_plan`, forced in tests with `_mode=`):
- "rows":  each program owns BLOCK_M whole rows and loops over N in BLOCK_N columns; a [BLOCK_M, BLOCK_N]
           fp32/int64 accumulator is reduced once at the end. Used whenever there are enough row blocks
           to fill the GPU (>= ~2 programs per SM) or rows are short.
- "split": few long rows (dim=None arrives as M == 1): SPLIT programs per row, each summing every SPLIT-th
           tile of the row (grid-stride; 4 programs per SM in all for rows that give each a wide step, else
           4 fp32 / 8 bf16 programs per SM). Partial sums are either
             * atomically added into `out` (deterministic=False and out.dtype is the accumulator dtype:
               memset + one kernel), or
             * written to a [M, SPLIT] scratch and summed in a fixed order by `_finalize_kernel`
               (deterministic=True, or a narrower out dtype: one kernel + one tiny kernel, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels_triton._config import (
    device_index,
    is_interpreter,
    next_pow2,
    num_sms,
    pdl_options,
    pdl_supported,
    warps_for,
)  # fmt: skip
from kernels_triton._launch import fast_launch


@fast_launch
@triton.jit
def _rows_kernel(x_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_INT: tl.constexpr):
    ACC: tl.constexpr = tl.int64 if IS_INT else tl.float32
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    # int64 row offsets: M*N may exceed 2^31 elements.
    base = x_ptr + rows.to(tl.int64)[:, None] * N
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k in range(0, N, BLOCK_N):
        c = k + cols
        m = row_mask[:, None] & (c < N)[None, :]
        acc += tl.load(base + c[None, :], mask=m, other=0).to(ACC)
    s = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, s.to(out_ptr.dtype.element_ty), mask=row_mask)


@fast_launch
@triton.jit
def _split_kernel(
    x_ptr, dst_ptr, N, SPLIT,
    BLOCK: tl.constexpr, IS_INT: tl.constexpr, ATOMIC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per (row, part). Grid-stride: part p sums the row's whole BLOCK tiles p, p + SPLIT,
    # p + 2 SPLIT, ... (unmasked, 16-byte aligned loads when N is), so at any moment all programs read one
    # SPLIT x BLOCK window of the row together instead of SPLIT far-apart chunks: H200 fp32 2^30 958 us
    # against 973 with contiguous chunks (CUB 955). The row's last, partial tile goes to the program whose
    # turn it would be; the order of every add is fixed by (N, SPLIT, BLOCK) -> bitwise reproducible.
    if PDL:  # the finalize kernel (launched with PDL) may be scheduled now; it waits for the partials
        gdc_launch_dependents()
    ACC: tl.constexpr = tl.int64 if IS_INT else tl.float32
    pid = tl.program_id(0)
    row = pid // SPLIT
    part = pid % SPLIT
    base = x_ptr + row.to(tl.int64) * N
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=ACC)
    # t is i64 whenever N is (N >= 2^31 elements, and always in the AOT signature): the loop takes the
    # widest type of its bounds, so t * BLOCK cannot wrap.
    n_full = N // BLOCK
    for t in range(part, n_full, SPLIT):
        acc += tl.load(base + t * BLOCK + offs).to(ACC)
    if part == n_full % SPLIT:
        o = n_full * BLOCK + offs
        acc += tl.load(base + o, mask=o < N, other=0).to(ACC)
    s = tl.sum(acc, axis=0)
    if ATOMIC:
        tl.atomic_add(dst_ptr + row, s)
    else:
        tl.store(dst_ptr + pid, s)


@fast_launch
@triton.jit
def _finalize_kernel(
    part_ptr, out_ptr, M, SPLIT, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr
):
    # Fixed-order second stage: the same partials always meet in the same tree -> bitwise reproducible.
    if PDL:  # launched early (PDL): the split kernel's partials are complete and visible after this
        gdc_wait()
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_S)
    acc = tl.zeros((BLOCK_M, BLOCK_S), dtype=part_ptr.dtype.element_ty)
    for k in range(0, SPLIT, BLOCK_S):
        c = k + cols
        m = rmask[:, None] & (c < SPLIT)[None, :]
        acc += tl.load(part_ptr + rows[:, None] * SPLIT + c[None, :], mask=m, other=0)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rmask)


# ---- configuration ---------------------------------------------------------------------------------------
# A tile of 16 KB per program per loop step (4096 fp32 / 8192 bf16 / 2048 int64 elements) keeps ~32 KB in
# flight per SM at 2+ resident programs, which is what HBM3e's latency x bandwidth needs (~25 KB/SM).
_TILE_BYTES = 16384
# Threads hold 4 x 16-byte vectors each: 8 warps (NVIDIA) / 4 waves (AMD) for a 16 KB tile.
_VEC_PER_THREAD = 4
# Split rows when fewer row blocks than half this many programs per SM would fill the GPU.
_SPLIT_PROGRAMS_PER_SM = 4
# A split program streams steps of at most 4096 elements (16 KB fp32, 8 KB bf16), ~64 KB of them in flight per
# SM (4 fp32 / 8 bf16 programs per SM), in chunks of at least 8 KB. H200, M = 1, device time with L2 flushed
# (.dev probe, 2026-11-28), before -> after (the plan before: 16 KB steps, 4/SM, chunks >= 32 KB): bf16 2^16
# 8.7 -> 5.9 us, 2^20 9.2 -> 7.6, 2^24 20.3 -> 18.7, 2^26 51.9 -> 46.7, 2^30 551 -> 489 (torch.sum 505);
# fp32 2^16 7.3 -> 6.1, 2^18 8.2 -> 6.3, 2^22..2^30 unchanged (953 us at 2^30). 128 KB per SM, or 8 KB bf16
# steps at 4/SM, were 2-10% slower from 2^22 up. Earlier (fp32 2^30): 16 KB / 8 warps at 4/SM within 1% of
# 32 KB / 16 warps at 2/SM and of 16 KB / 4 warps at 8/SM; plain loads: an evict_first hint cost ~5%.
_SPLIT_BLOCK_ELEMS = 4096
_SPLIT_BYTES_PER_SM = 65536
# Rows long enough that each of 4 programs per SM gets a whole one take wide steps of 8192 elements (32 KB
# fp32, 16 KB bf16; 4-byte elements or narrower) at 8 warps, 4 programs per SM. H200, grid-stride split,
# same process as CUB (.dev probe at 84aa6e3), today's steps -> wide: fp32 2^30 950.4 -> 937.3 us (CUB 935.8),
# 2^26 75.9 -> 74.1 (CUB 75.0), 8 x 2^25 250.3 -> 247.0; bf16 2^30 481.1 -> 477.9, 2^26 49.7 -> 46.2,
# 8 x 2^25 132.3 -> 132.1. 16 warps or 8 programs per SM were within 0.5%; 2048-element steps lost 14-20%.
# Integer inputs of 4 bytes or fewer follow the same rule (not measured: their int64 accumulator doubles the
# registers, 128 a thread on sm_90 for int32).
_WIDE_BLOCK_ELEMS = 8192
_WIDE_ELEMS_PER_THREAD = 32  # 8 warps (NVIDIA) / 4 waves (AMD) for a wide step
_SPLIT_MIN_CHUNK_BYTES = 8192
_FIN_BLOCK_M, _FIN_BLOCK_S = 16, 128


def _tile(elsize: int) -> int:
    return _TILE_BYTES // elsize


def _plan(M: int, N: int, elsize: int, dev: int) -> tuple[str, int]:
    """("rows", 1) or ("split", SPLIT): split only when row blocks cannot fill the GPU and rows are long."""
    tile = _tile(elsize)
    block_n = min(max(32, next_pow2(N)), tile)
    row_programs = triton.cdiv(M, tile // block_n)
    sms = num_sms(dev)
    if row_programs >= _SPLIT_PROGRAMS_PER_SM * sms // 2 or 4 * tile > N:
        return "rows", 1
    if _wide(M, N, elsize, sms):
        return "split", max(2, triton.cdiv(_SPLIT_PROGRAMS_PER_SM * sms, M))
    target = max(1, _SPLIT_BYTES_PER_SM // (_split_step(elsize, False)[0] * elsize)) * sms
    split = min(triton.cdiv(target, M), triton.cdiv(N * elsize, _SPLIT_MIN_CHUNK_BYTES))
    return ("split", split) if split > 1 else ("rows", 1)


def _split_step(elsize: int, wide: bool) -> tuple[int, int]:
    """(elements per loop step, elements per thread) of a split program: a wide step, or (rows too short for
    one) at most 4096 elements in 4 x 16-byte vectors a thread. The launcher and the AOT specs both ask here."""
    if wide:
        return _WIDE_BLOCK_ELEMS, _WIDE_ELEMS_PER_THREAD
    return min(_tile(elsize), _SPLIT_BLOCK_ELEMS), 16 // elsize * _VEC_PER_THREAD


def _wide(M: int, N: int, elsize: int, sms: int) -> bool:
    """Whether split rows take wide steps: every one of 4 programs per SM owns a whole wide step."""
    return elsize <= 4 and _WIDE_BLOCK_ELEMS * triton.cdiv(_SPLIT_PROGRAMS_PER_SM * sms, M) <= N


def reduce_sum(
    out: torch.Tensor,
    x: torch.Tensor,
    *,
    deterministic: bool = False,
    _mode: str | None = None,
    _split: int | None = None,
    _block: int | None = None,
    _num_warps: int | None = None,
) -> None:
    """out[M] = sum(x[M, N], -1). Private `_mode`/`_split`/`_block`/`_num_warps` force a config (tests)."""
    M, N = x.shape
    is_int = not x.dtype.is_floating_point
    dev = device_index(x)
    elsize = x.element_size()
    mode, split = _plan(M, N, elsize, dev)
    if _mode is not None:
        mode = _mode
        split = _split if _split is not None else (max(2, split) if mode == "split" else 1)
    elif _split is not None:
        split = _split
    tile = _tile(elsize)
    vec = 16 // elsize
    if mode == "rows":
        block_n = _block or min(max(32, next_pow2(N)), tile)
        block_m = max(1, tile // block_n)
        nw = _num_warps or warps_for(block_m * block_n, vec * _VEC_PER_THREAD, dev)
        grid = (triton.cdiv(M, block_m),)
        _rows_kernel[grid](x, out, M, N, BLOCK_M=block_m, BLOCK_N=block_n, IS_INT=is_int, num_warps=nw)
        return
    step, per_thread = _split_step(elsize, _wide(M, N, elsize, num_sms(dev)))
    block = _block or (512 if is_interpreter() else step)
    nw = _num_warps or warps_for(block, per_thread, dev)
    split = max(1, min(split, N // block))  # every part owns at least one whole tile
    acc_dtype = torch.int64 if is_int else torch.float32
    grid = (M * split,)
    if not deterministic and out.dtype == acc_dtype:
        out.zero_()
        _split_kernel[grid](
            x, out, N, split, BLOCK=block, IS_INT=is_int, ATOMIC=True, PDL=False, num_warps=nw
        )
        return
    part = torch.empty((M, split), dtype=acc_dtype, device=x.device)
    # The finalize kernel is launched with programmatic dependent launch where the GPU has it (see
    # kernels_triton/_config.pdl_supported): it starts while the split kernel runs, hiding its launch.
    pdl = pdl_supported(dev)
    _split_kernel[grid](x, part, N, split, BLOCK=block, IS_INT=is_int, ATOMIC=False, PDL=pdl, num_warps=nw)
    _finalize_kernel[(triton.cdiv(M, _FIN_BLOCK_M),)](
        part, out, M, split, BLOCK_M=_FIN_BLOCK_M, BLOCK_S=_FIN_BLOCK_S, PDL=pdl, num_warps=4,
        **pdl_options(pdl),
    )  # fmt: skip


@fast_launch
@triton.jit
def _bcast_kernel(dout_ptr, dx_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx[rows, cols] = dout[rows] in dx's dtype; program p owns one [BLOCK_M, BLOCK_N] tile."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    rows = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    v = tl.load(dout_ptr + rows, mask=rmask, other=0.0).to(dx_ptr.dtype.element_ty)
    tile = tl.broadcast_to(v[:, None], (BLOCK_M, BLOCK_N))
    # int64 row offsets: M*N may exceed 2^31 elements. Written once, never re-read: evict first.
    ptrs = dx_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(ptrs, tile, mask=rmask[:, None] & (cols < N)[None, :], eviction_policy="evict_first")


def _bcast_tile(N: int, elsize: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a 16 KB tile (the forward's step): whole short rows, 16 KB slices of long ones."""
    tile = _tile(elsize)
    block_n = min(max(16 // elsize, next_pow2(N)), tile)
    return tile // block_n, block_n


def backward(dx: torch.Tensor, dout: torch.Tensor, *, _block_n: int | None = None) -> None:
    """dx[M, N] (x's dtype, floating) = dout[M][:, None]: the gradient of the row sum. `_block_n` forces a
    tile width (tests)."""
    M, N = dx.shape
    block_m, block_n = _bcast_tile(N, dx.element_size())
    if _block_n is not None:
        block_n = _block_n
        block_m = max(1, _tile(dx.element_size()) // block_n)
    if is_interpreter():  # the interpreter runs every lane in numpy: keep its tiles small
        block_m = min(block_m, next_pow2(M))
    vec = 16 // dx.element_size()
    nw = warps_for(block_m * block_n, vec * _VEC_PER_THREAD, device_index(dx))
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _bcast_kernel[grid](dout, dx, M, N, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=nw)


def forward(out: torch.Tensor, x: torch.Tensor, *_out_dtype: object) -> None:
    """out[M] = sum(x[M, N], -1), accumulated in fp32 (floats) or int64 (integers), rounded once to out's
    dtype. (A trailing out_dtype scalar, if a spec passes one, is implied by `out` and ignored.)

    Deterministic: the split mode writes per-chunk partials and sums them in a fixed order (no
    atomics), so identical calls give bit-identical sums on any stream, thread or CUDA graph replay
    (issue #13: 50 identical atomic calls gave 4 different sums). The extra kernel reads M x SPLIT
    partials (~2k floats at 2^30 elements): noise against the 4.3 GB read."""
    reduce_sum(out, x, deterministic=True)


# ---- ahead-of-time coverage -------------------------------------------------------------------------------
_OUT_FOR = {"fp32": "fp32", "fp16": "fp32", "bf16": "bf16", "i32": "i64", "i64": "i64"}
_ELSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "i32": 4, "i64": 8}


def aot_specs() -> list[tuple[str, object, dict, dict]]:
    """Every tile/warp shape the launcher picks on a 32-wide target, for each input dtype (one out dtype)."""
    specs: list[tuple[str, object, dict, dict]] = []
    for xt in ("fp32", "fp16", "bf16", "i32", "i64"):
        ot, es, is_int = _OUT_FOR[xt], _ELSIZE[xt], xt.startswith("i")
        acc = "i64" if is_int else "fp32"
        tile = _tile(es)
        vec = 16 // es
        nw = max(1, min(16, tile // (vec * _VEC_PER_THREAD) // 32))
        block_ns = [tile] if xt != "fp32" else [b for b in (32, 64, 128, 256, 512, 1024, 2048, 4096)]
        for bn in block_ns:
            sig = {"x_ptr": f"*{xt}", "out_ptr": f"*{ot}", "M": "i32", "N": "i32"}
            sig |= {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "IS_INT": "constexpr"}
            ce = {"BLOCK_M": tile // bn, "BLOCK_N": bn, "IS_INT": is_int, "num_warps": nw}
            specs.append((f"reduce_rows_{xt}_n{bn}", _rows_kernel, sig, ce))
        # the split kernel: atomic (no dependent kernel, no PDL) on both targets; writing partials, with PDL
        # on sm_90 (the finalize kernel launched with launch_pdl) and without on gfx942 (no griddepcontrol)
        sig = {"x_ptr": f"*{xt}", "dst_ptr": f"*{acc}", "N": "i64", "SPLIT": "i32"}
        sig |= {"BLOCK": "constexpr", "IS_INT": "constexpr", "ATOMIC": "constexpr", "PDL": "constexpr"}
        fsig = {"part_ptr": f"*{acc}", "out_ptr": f"*{ot}", "M": "i32", "SPLIT": "i32"}
        fsig |= {"BLOCK_M": "constexpr", "BLOCK_S": "constexpr", "PDL": "constexpr"}
        for blk, per_thread in [_split_step(es, wide) for wide in (False, True) if es <= 4 or not wide]:
            snw = max(1, min(16, blk // per_thread // 32))
            ce = {"BLOCK": blk, "IS_INT": is_int, "ATOMIC": True, "PDL": False, "num_warps": snw}
            specs.append((f"reduce_split_{xt}_b{blk}_atomic", _split_kernel, sig, ce))
            for target, pdl in (("sm_90", True), ("gfx942", False)):
                only = {"aot_targets": (target,)}
                ce = {"BLOCK": blk, "IS_INT": is_int, "ATOMIC": False, "PDL": pdl}
                specs.append(
                    (
                        f"reduce_split_{xt}_b{blk}_part_{target}",
                        _split_kernel,
                        sig,
                        ce,
                        {"num_warps": snw, **only},
                    )
                )
        for target, pdl in (("sm_90", True), ("gfx942", False)):
            only = {"aot_targets": (target,)}
            ce = {"BLOCK_M": _FIN_BLOCK_M, "BLOCK_S": _FIN_BLOCK_S, "PDL": pdl}
            opts = {"num_warps": 4, **only, **pdl_options(pdl)}
            specs.append((f"reduce_finalize_{acc}_{ot}_{target}", _finalize_kernel, fsig, ce, opts))
    # backward: the x dtypes with their own-dtype dout and (half types) an fp32 dout; the 16 KB tile of long
    # rows and one short-row tile (N = 128). Other (N, dout dtype) pairs are served by the JIT.
    for xt, dt in (("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "fp32"), ("bf16", "fp32")):
        es = _ELSIZE[xt]
        for n in (1 << 20, 128):
            bm, bn = _bcast_tile(n, es)
            nw = max(1, min(16, bm * bn // (16 // es * _VEC_PER_THREAD) // 32))
            sig = {"dout_ptr": f"*{dt}", "dx_ptr": f"*{xt}", "M": "i32", "N": "i32"}
            sig |= {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
            ce = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": nw}
            specs.append((f"reduce_bcast_{dt}_{xt}_{bm}x{bn}", _bcast_kernel, sig, ce))
    return list({s[0]: s for s in specs}.values())  # fp16 and fp32 share the fp32 -> fp32 finalize
