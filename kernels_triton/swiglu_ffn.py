"""SwiGLU feed-forward block: out = (silu(xn @ Wg^T) * (xn @ Wu^T)) @ Wd^T, xn = RMSNorm(x) or x.

Entry points (CONTRACT.md):
- forward(y, rstd?, gu?, x, w_gate, w_up, w_down, norm_weight?, eps): rstd = gu = None is the inference
  path (the kernels below, unchanged). A training call passes gu [T, 2F] (x's dtype) and, with a norm,
  rstd [T] fp32: the gate/up kernels' epilogues (pointer GEMM, TMA GEMM, decode GEMV) also store
  gu = [round(g), round(u)] from their fp32 accumulators (h is still formed from the unrounded ones), and
  rstd comes from the prologue (prefill) or program 0 of the GEMV (decode). Extra bytes: 2*T*F*2 written
  (T=4096, F=11008 bf16: 180 MB, ~45 us). norm_weight may be fp32 with fp16/bf16 x (it is only ever read
  and widened to fp32).
- backward(dx, dw_gate, dw_up, dw_down, dnorm_weight?, dy, x, w_gate, w_up, w_down, norm_weight?, rstd?,
  gu, eps): kernels_triton/_ffn_backward.py (saved: x, weights, rstd, gu; recomputed: xn and h). Five
  products (six cuBLAS calls) plus three fused element-wise Triton kernels; 12*T*D*F FLOPs.

Floors (H200: ~4.3 TB/s copy, ~790 TFLOP/s dense bf16), Llama-7B dims D=4096, F=11008, bf16:
- FLOPs: forward 6*T*D*F (three GEMMs), backward 12*T*D*F (six).  T=4096: forward 1.11 PFLOP -> ~1.4 ms
  at 790 TFLOP/s (compute-bound), backward 2.2 PFLOP -> ~2.8 ms.
- Bytes: weights 3*D*F*2 = 270 MB dominate at small T -> ~63 us at 4.3 TB/s for T=1 (memory-bound);
  activations add T*(2D + F)*2 (x, out, h written+read once more), noise for T <= 16.
Crossover ~ T where 6*T*D*F/790e12 = 6*D*F/4.3e12, i.e. T ~ 180: below it the weights' bytes set the time.

Paths (chosen by T; tests force them with `_path=`):
- decode (T <= DECODE_MAX_T): GEMV kernels that stream the weights once. gate/up: one program per BLOCK_F
  rows of F reads contiguous [BLOCK_F, BLOCK_K] slabs of Wg and Wu (16-byte loads), recomputes the RMSNorm
  of the T <= 16 activation rows itself (they sit in L2) and writes h [T, F]. down: one program per
  BLOCK_N rows of Wd. T == 1 accumulates [rows, BLOCK_K] partial products and reduces once at the end
  (no tensor cores needed for one row); 2 <= T <= 16 pads T to 16 and uses tl.dot.
- prefill: (1) a row kernel computes rstd [T] and (default `_prologue="xn"`) writes xn = round(x*rstd*w);
  (2) the gate/up GEMM loads each activation tile once and feeds it to two accumulators (gate, up),
  epilogue silu(g) * u -> h [T, F] in x.dtype; (3) the down GEMM h @ Wd^T. `_prologue="fused"` instead
  scales the A tiles by rstd * norm_weight in registers and rounds them to x.dtype before tl.dot (exactly
  the reference's rounded xn); on the H200 both ran within 1% (1.98 vs 1.99 ms at T=4096), and the
  materialized xn (32 MB extra traffic, ~15 us) keeps the GEMM a plain one.
  Each GEMM comes in two kinds (tests and benchmarks force one with `_gemm="ptr" | "tma"`):
  * "ptr": one program per output tile, pointer loads (cp.async), triton.autotune over _GATE_UP_CUDA /
    _DOWN_CUDA. Runs everywhere (HIP, fp32, the fused prologue, unaligned rows).
  * "tma": persistent (one program per SM walking the tiles in grouped order), TMA loads/stores through
    device-side tensor descriptors, wgmma; configs _GATE_UP_TMA / _DOWN_TMA (+ warp-specialized rows
    where tl.range has warp_specialize). CUDA sm_90+ with 16-byte aligned pointers and rows only.
  With `_gemm=None` on CUDA sm_90+ (fp16/bf16, aligned, xn prologue) every TMA config is timed and
  checked against the pointer kernel on first use per (GEMM, T rounded up to a power of 2, F, D, dtype):
  "ptr" (its autotuned best) runs first on the caller's inputs and its output is kept; each TMA config
  then writes the same NaN-poisoned buffer and competes only if it matches (`_mismatch`, after its first
  launch and again after its timed runs). The fastest survivor (triton.testing.do_bench, a few ms each)
  is cached (`_CHOICE`, timings in `TIMINGS`). A TMA config that fails to compile or launch, or writes
  wrong values, is warned about once (RuntimeWarning with the error) and excluded for good (`_BROKEN`);
  a wrong-but-fast kernel can never be picked. `_gemm="tma"` checks its configs the same way. Inputs
  whose pointer-kernel output is non-finite or all zero cannot judge a candidate: that call runs "ptr"
  (under `_gemm="tma"`: its first config, unchecked) and the choice waits for the next call. On any GPU in
  fp16/bf16 the down GEMM also has the vendor GEMM ("blas": torch.mm, cuBLAS / hipBLASLt) among its
  candidates, checked and timed the same way (`_blas_auto`), and so does the gate/up step where xn is
  materialized: g = xn Wg^T and u = xn Wu^T by two torch.mm(out=) (into h and one [T, F] workspace; a
  training call writes them straight into gu's halves), then `_silu_mul_kernel` h = round(silu(g) * u)
  in fp32.
  Its g and u are rounded to x's dtype before h, one rounding more than the fused epilogues (bf16: y's
  error vs float64 3.35e-3 -> 4.24e-3 of the contract's 1e-2; see _VERIFY_TOL). `_gemm="blas"` forces
  both vendor steps. Elsewhere (CPU, fp32; gate/up with the fused prologue) "ptr" runs without timing or
  checks.
  A decided key (`_CHOICE` holds both GEMMs) only launches; a "blas" step is torch.mm(out=) calls and
  one lean launch, which kernels_triton/_replay.py records and replays like the Triton GEMMs.
Measured (H200, bf16, D=4096, F=11008, triton 3.6): T=1 83 us (3.26 TB/s; torch.compile 96 us, cuBLAS
97.5 us); T=4096 "ptr" 534-559 TFLOP/s end to end (gate/up GEMM alone 562, down 549; torch.compile of
the native-bf16 MLP 646-667, cuBLAS 634-637, torch.compile of the fp32 reference 50). With the TMA
candidates and the vendor down GEMM (H100 80GB, bf16, D=4096, ecc7406, `.dev` probe, torch.compile of the
bf16 MLP in the same process): T=4096 F=11008 1.56 ms = 709 TFLOP/s, 1.09x; F=14336 0.97x; T=8192
F=14336 1.03x; T=512 F=11008 0.99x; T=128 F=14336 1.60x. The gate/up GEMM picks the warp-specialized
TMA config from T=512 on; benchmarks/gpu_checks/ffn.py prints what the selector picked.
Training (H200, bf16, T=4096, D=4096, triton 3.6, torch 2.11; no norm; median of do_bench, best of 3):
forward saving gu + backward 5.14 ms at F=11008 (torch.compile of the bf16 MLP, forward + backward:
5.16 ms, 1.005x) and 6.68 ms at F=14336 (6.59 ms, 0.987x). Forward saving gu 1.67 / 2.20 ms (the gate/up
GEMM picks the warp-specialized TMA config: 0.99 ms at F=11008 against 1.16-1.23 ms for the others);
backward 3.43 / 4.36 ms, its GEMMs 660-770 TFLOP/s (cuBLAS), the swiglu element-wise kernel 4.0 TB/s.
The remaining gap at F=14336 is the Triton gate/up GEMM (1.32-1.45 ms against 2 x 0.60 ms for cuBLAS),
hence the vendor gate/up candidate ("blas" above). Its element-wise step moves 3*T*F elements (T=4096,
F=14336 bf16: 352 MB, ~0.1 ms at 3.3 TB/s), so it wins only where cuBLAS's two GEMMs beat the fused
Triton GEMM by more than that. Measured (H100, bf16, D=4096, 7a1e9e7, benchmarks/gpu_checks/
ffn_gate_up_blas.py, torch.compile of the bf16 MLP in the same process; gate/up step alone, us): F=11008
T=256 blas 96 vs ptr 117 / best TMA 124 (ops.swiglu_ffn 1.12x compile), T=1024 271 vs 295 (0.995x),
T=4096 1093 vs TMA-ws 1034 (TMA kept; 0.986x); F=14336 T=256 468 vs ptr 128 (ptr kept; 0.964x), T=1024
342 vs 345 (0.988x), T=4096 1370 vs 1348 (0.994x); training F=14336 T=4096 blas 1362 vs TMA-ws 1448,
forward saving gu + backward 6.44 ms against compile's 5.91 (0.917x; forward 2.17 vs 1.97 ms, backward
4.27 vs 3.94). The "ops" and "compile" columns of that check are do_bench times, which include host time
where the host is slower than the GPU: at a49548a on another H100 host the same check gave T=256 gate/up
blas 97 vs ptr 116 again but ops 212 us against compile's 150, while the bench (device time only:
fusekit.device_time) timed ops.swiglu_ffn at 169 us (0.896x) with the selector keeping "ptr" (114 us vs
blas 116 in that process, host time included). The selector now times device time only: at c68fd1f (H100)
it picks blas at T=256 (97 vs ptr 117 us; ops.swiglu_ffn 1.01x compile, bench sweep). The bench's train
suite at a49548a: T=4096 F=11008 and F=14336 1.00x torch.compile.
fp32 inputs use input_precision="ieee" so fp32 means fp32 (no tf32).
Index widths (inputs past 2^31 elements, e.g. h [T, F] at T 150000 x F 14336): every row offset is int64
(`row.to(tl.int64) * D`, `offs.to(tl.int64) * K`) before it meets a row length; tile, column and K offsets
stay int32 (each < one matrix dimension). TMA coordinates are 32-bit (row < T, col < F); the decode GEMVs
index their T <= 16 activation rows in int32. The forward's grids are 1-D (tile counts, far below 2^31).
"""

from __future__ import annotations

import functools
import itertools
import os
import warnings

import torch
import triton
import triton.language as tl

from kernels_triton._config import (
    device_index,
    div16_attrs,
    ensure_tma_allocator,
    is_hip,
    is_interpreter,
    next_pow2,
    note_tuned,
    num_sms,
    on_device,
)
from kernels_triton._ffn_backward import _ew_grid, _ew_tile, backward
from kernels_triton._ffn_backward import aot_specs as _backward_aot_specs
from kernels_triton._ffn_kernels import (
    _gate_up_gemv_kernel,
    _gate_up_kernel,
    _gate_up_tma_kernel,
    _gemv_nt_kernel,
    _matmul_nt_kernel,
    _matmul_nt_tma_kernel,
    _rstd_kernel,
    _silu_mul_kernel,
)
from kernels_triton._launch import fast_tuned

__all__ = ["aot_specs", "backward", "forward", "swiglu_ffn"]

DECODE_MAX_T = 16  # at or below this many tokens the weights' bytes dominate: GEMV path


# ----------------------------------------------------------------------------------------------------
# tile tables
# ----------------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages). Hopper (sm_90): 128-row tiles with
# 64-wide K fill a wgmma warpgroup pair; gate/up holds TWO fp32 accumulators, so its 128x128 tile costs
# the registers of a 128x256 GEMM tile and each stage of (A + 2 B) bf16 tiles 48 KB of shared memory.
# Small-T configs (BLOCK_M 64) avoid computing 128 rows of padding when T is a few dozen tokens.
# Measured on the H200 (T=4096, D=4096, F=11008, bf16, triton 3.6): gate/up 128x128x64 w8 s4 562 TFLOP/s,
# down 128x128x64 w8 s3 549 TFLOP/s; 128x256 (down), 256x128, 64x256 and GROUP_M=16 all lost.
_GATE_UP_CUDA = [
    (128, 128, 64, 8, 8, 4),
    (128, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 4, 4),
]
_DOWN_CUDA = [
    (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
    (64, 128, 64, 8, 4, 4),
]
# CDNA (gfx942): 2 LDS stages are the norm for its stream pipeliner; 64-wide waves, so fewer warps.
_GATE_UP_HIP = [(128, 128, 64, 8, 8, 2), (64, 128, 64, 8, 4, 2)]
_DOWN_HIP = [(128, 128, 64, 8, 8, 2), (64, 128, 64, 8, 4, 2)]
_RSTD_BLOCK = 1024  # row chunk of the rstd kernel: 4 warps x 8 elements of 16 bytes (bf16), any D loops
_MM_INTERP = (16, 16, 32, 2, 1, 1)  # the CPU interpreter: small tiles, and no autotuning

# TMA persistent GEMMs (CUDA sm_90+): (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SUBTILE,
# WARP_SPECIALIZE). Shared memory per stage: gate/up (A + 2 B) 128x64 bf16 tiles = 48 KB, so 4 stages +
# the 32 KB h tile = 224 KB of the 227 KB; down 128x256: A + B = 48 KB per stage, 3 stages + the 64 KB C
# tile, or 4 stages with the C tile stored in two halves (SUBTILE). gate/up stays at 128x128: its two
# fp32 accumulators already hold 128 registers per thread at 8 warps (a 128x256 GEMM tile's worth).
# WARP_SPECIALIZE rows (always FLATTEN=False) are listed only where tl.range takes warp_specialize; on
# Triton 3.9 their sm_90 PTX has no setmaxnreg/partitioning and matches the plain unflattened loop, so
# there they are simply the unflattened candidate; Triton 3.6 may differ, the timing decides.
# 64-row tiles are candidates only up to _SMALL_T tokens (fewer padded rows at small T).
_GATE_UP_TMA = [
    (128, 128, 64, 8, 8, 3, False, False),
    (128, 128, 64, 8, 8, 4, False, False),
    (128, 128, 64, 8, 8, 3, False, True),
    (64, 128, 64, 8, 4, 4, False, False),
]
_DOWN_TMA = [
    (128, 256, 64, 8, 8, 3, False, False),
    (128, 256, 64, 8, 8, 4, True, False),
    (128, 128, 64, 8, 8, 4, False, False),
    (128, 256, 64, 8, 8, 3, False, True),
    (64, 128, 64, 8, 4, 4, False, False),
]
_SMALL_T = 256
_AOT_SMS = 132  # H200 multiprocessors: the persistent grid's stride, a constexpr of the AOT binaries
_TMA_INTERP = (16, 16, 32, 2, 1, 1, False, False)

# Decode GEMV, per BLOCK_T (1: one token, 16: 2..16 tokens on tensor cores):
# (rows of the weight per program, BLOCK_K, num_warps). Enough bytes in flight per SM is the goal:
# gate/up 16 rows -> F/16 = 688 programs, each step reading 2 x 16 x 512 x 2 B = 32 KB of Wg/Wu;
# down 8 rows -> D/8 = 512 programs (fewer rows per program balance 132 SMs better than 16).
# Measured (T=1, bf16): gate/up 56 us = 3.2 TB/s, down 30 us = 3.0 TB/s (cuBLAS: 62 us, 37 us).
# The (16, 128, 4) entries at BLOCK_T 16 exist for fp32: its 16 x 512 tiles need 233 KB of shared memory
# (over the 227 KB limit); the autotuner drops a config that runs out of resources and keeps the other.
# (32, 256, 4) at BLOCK_T 16: twice the weight rows per activation tile (the [16, BLOCK_K] x tile is re-read
# from L2 by every program). H200, bf16, T 16, each GEMV alone (.dev probe at 84aa6e3): gate/up D8192 F28672
# 229.4 us = 96% of its byte floor where 16 x 512 did not reach the best four (>= 240.8), D4096 F11008 55.2-
# 55.5 (76%); down D8192 119.6 us = 92% against 16 x 512 at >= 133.4; at D 4096 down stays 16 x 512 (35.7 us,
# 59%: 256 programs, the next thing to fix).
_GEMV_CUDA = {
    "gate_up": {1: [(16, 512, 4), (32, 256, 4)], 16: [(16, 512, 4), (32, 256, 4), (16, 128, 4)]},
    "down": {1: [(8, 512, 4)], 16: [(16, 512, 4), (32, 256, 4), (16, 128, 4)]},
}
_GEMV_HIP = {
    "gate_up": {1: [(16, 512, 4)], 16: [(16, 512, 4)]},
    "down": {1: [(16, 512, 4)], 16: [(16, 512, 4)]},
}
_GEMV_INTERP = (16, 32, 1)


def _mm_configs(table: list[tuple[int, ...]]) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g}, num_warps=w, num_stages=s)
        for m, n, k, g, w, s in table
    ]


def _even_k(args: dict) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


@functools.cache
def _tuned(kind: str, block_t: int = 0):
    hip = is_hip()
    even = triton.heuristics({"EVEN_K": _even_k})
    if kind == "gate_up" and not block_t:
        cfgs = _mm_configs(_GATE_UP_HIP if hip else _GATE_UP_CUDA)
        return fast_tuned(
            triton.autotune(cfgs, key=["M", "N", "K", "HAS_NORM", "SAVE_GU"])(even(_gate_up_kernel))
        )
    if kind == "down" and not block_t:
        cfgs = _mm_configs(_DOWN_HIP if hip else _DOWN_CUDA)
        return fast_tuned(triton.autotune(cfgs, key=["M", "N", "K"])(even(_matmul_nt_kernel)))
    table = (_GEMV_HIP if hip else _GEMV_CUDA)["gate_up" if kind == "gate_up_gemv" else "down"][block_t]
    if kind == "gate_up_gemv":
        cfgs = [triton.Config({"BLOCK_F": r, "BLOCK_K": k}, num_warps=w) for r, k, w in table]
        return fast_tuned(
            triton.autotune(cfgs, key=["T", "D", "F", "HAS_NORM", "SAVE"])(_gate_up_gemv_kernel)
        )
    cfgs = [triton.Config({"BLOCK_N": r, "BLOCK_K": k}, num_warps=w) for r, k, w in table]
    return fast_tuned(triton.autotune(cfgs, key=["T", "N", "K"])(_gemv_nt_kernel))


def _gemv_save_row(block_t: int, elsize: int, hip: bool = False) -> tuple[int, int, int]:
    """The decode gate/up config of a training call (SAVE): training with T <= 16 tokens is rare, so one
    fixed row of the table instead of timing (and AOT-compiling) every row: the first, except for fp32,
    whose 16 x 512 tiles at BLOCK_T = 16 need more shared memory than an SM has (the table's last row)."""
    table = (_GEMV_HIP if hip else _GEMV_CUDA)["gate_up"][block_t]
    return table[0] if elsize < 4 else table[-1]


def _gemv_save_config(block_t: int, elsize: int) -> tuple[int, int, int]:
    return _GEMV_INTERP if is_interpreter() else _gemv_save_row(block_t, elsize, is_hip())


# ----------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------
def _check(out, x, w_gate, w_up, w_down, norm_weight, rstd=None, gu=None) -> tuple[int, int, int]:
    T, D = x.shape
    F = w_gate.shape[0]
    if w_gate.shape != (F, D) or w_up.shape != (F, D) or w_down.shape != (D, F) or out.shape != (T, D):
        raise ValueError(
            f"swiglu_ffn shapes: x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_up {tuple(w_up.shape)},"
            f" w_down {tuple(w_down.shape)}, out {tuple(out.shape)}"
        )
    ts = [t for t in (out, x, w_gate, w_up, w_down, norm_weight, rstd, gu) if t is not None]
    if not all(t.is_contiguous() for t in ts):
        raise ValueError("swiglu_ffn: tensors must be contiguous")
    if norm_weight is not None and norm_weight.shape != (D,):
        raise ValueError(f"swiglu_ffn: norm_weight must be [{D}], got {tuple(norm_weight.shape)}")
    if gu is not None and (gu.shape != (T, 2 * F) or gu.dtype != x.dtype):
        raise ValueError(
            f"swiglu_ffn: gu must be [{T}, {2 * F}] of x's dtype, got {tuple(gu.shape)} {gu.dtype}"
        )
    if rstd is not None and (norm_weight is None or rstd.shape != (T,) or rstd.dtype != torch.float32):
        raise ValueError(f"swiglu_ffn: rstd must be [{T}] float32 and comes with norm_weight")
    return T, D, F


def forward(
    y: torch.Tensor,
    rstd: torch.Tensor | None,
    gu: torch.Tensor | None,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    *,
    _path: str | None = None,
    _prologue: str = "xn",
    _gemm: str | None = None,
) -> None:
    """y[T, D] = swiglu_ffn(x[T, D]) (CONTRACT.md); writes y (and rstd, gu when given), returns None.

    Inference (gu = None): nothing beyond y (and rstd when given) is written. Training: gu [T, 2F] (x's
    dtype) receives [round(g), round(u)] from the gate/up GEMM's epilogue (g, u are its fp32 accumulators; h is still formed
    from them before rounding), and rstd [T] fp32 (given iff norm_weight is) the row statistics. norm_weight
    may be fp32 with fp16/bf16 x. `_path` ("decode" | "prefill"), `_prologue` ("fused": scale A tiles in the
    GEMM, "xn": write the normalized activation first) and `_gemm` ("ptr" | "tma" | "blas": both GEMMs of
    that kind, checked against "ptr") are private switches for tests and benchmarks.
    """
    T, D, F = _check(y, x, w_gate, w_up, w_down, norm_weight, rstd, gu)
    path = _path or ("decode" if T <= DECODE_MAX_T else "prefill")
    if path == "decode" and T > DECODE_MAX_T:
        raise ValueError(f"decode path handles T <= {DECODE_MAX_T}, got T={T}")
    ieee = x.dtype == torch.float32
    has_norm = norm_weight is not None
    nw = norm_weight if has_norm else x  # a dummy pointer the kernel never reads
    interp = is_interpreter()
    h = torch.empty((T, F), device=x.device, dtype=x.dtype)
    if has_norm and rstd is None:  # both paths' kernels write rstd with a norm (T floats)
        rstd = torch.empty((T,), device=x.device, dtype=torch.float32)
    with on_device(x):
        if path == "decode":
            _decode(y, rstd, gu, x, w_gate, w_up, w_down, nw, h, eps, T, D, F, has_norm, ieee)
            return
        if path != "prefill":
            raise ValueError(f"unknown swiglu_ffn path {path!r}")
        a, rstd_buf = x, rstd if has_norm else x  # x: dummies the kernels never read without a norm
        if has_norm:
            write_xn = _prologue == "xn"
            if write_xn:
                a = torch.empty_like(x)
            _rstd_kernel[(T,)](
                x, nw, rstd_buf, a, D, eps, WRITE_XN=write_xn, BLOCK=_RSTD_BLOCK, num_warps=1 if interp else 4
            )
            has_norm = not write_xn  # with xn materialized, the GEMM reads it as a plain operand

        save = gu is not None
        tensors = (a, w_gate, w_up, w_down, h, y)
        if save:  # the TMA epilogue's second gu descriptor starts at gu + F: that address must be aligned too
            tensors += (gu, gu[:, F:])
        # alignment is part of the key: a cached TMA choice must never meet a misaligned view
        key = (next_pow2(T), F, D, x.dtype, has_norm, _tma_aligned(tensors), device_index(x), _gemm, save)
        chosen_gu, chosen_down = _CHOICE.get(("gate_up", *key)), _CHOICE.get(("down", *key))
        if chosen_gu is not None and chosen_down is not None:  # the run half: both GEMMs decided for this key
            _launch_gate_up(chosen_gu, a, w_gate, w_up, nw, rstd_buf, h, T, F, D, has_norm, ieee, gu)
            _launch_down(chosen_down, h, w_down, y, T, D, F, ieee)
            return
        # TMA needs the materialized xn
        cands = _candidates(T, tensors, _gemm, tma_ok=not has_norm, save=save)

        def gate_up(cfg: object) -> None:
            _launch_gate_up(cfg, a, w_gate, w_up, nw, rstd_buf, h, T, F, D, has_norm, ieee, gu)

        def down(cfg: object) -> None:
            _launch_down(cfg, h, w_down, y, T, D, F, ieee)

        # _choose may leave h / y / gu holding any candidate's result (or NaN): the chosen config always
        # rewrites them right after, and down is chosen only after the chosen gate/up has written h.
        gate_up(_choose("gate_up", key, cands, gate_up, (h, gu) if save else h))
        down(_choose("down", key, cands, down, y))


def _decode(y, rstd, gu, x, w_gate, w_up, w_down, nw, h, eps, T, D, F, has_norm, ieee) -> None:
    """The GEMV path (T <= DECODE_MAX_T): gate/up (+ the norm) in one kernel, then the down GEMV."""
    # Training is gu given; rstd comes with every call that has a norm (the op's spec allocates it, a
    # statistic an inference call discards): it must not pick the training variant (gu written, T padded
    # to 16, one fixed config), which it did, for every decode step with a fused norm.
    save = gu is not None
    # one token: the [rows, BLOCK_K] partial-product GEMV; a training call always pads to 16 (tl.dot), one
    # variant fewer to compile for a case (training on <= 16 tokens) that is rare
    bt = 1 if T == 1 and not save else 16
    gu_t = gu if save else h  # a dummy the kernel never touches without SAVE
    rstd_t = rstd if has_norm else h  # a dummy the kernel never touches without HAS_NORM
    if save or is_interpreter():
        r, bk, w = _gemv_save_config(bt, x.element_size()) if save else _GEMV_INTERP
        _gate_up_gemv_kernel[(triton.cdiv(F, r),)](
            x, w_gate, w_up, nw, h, gu_t, rstd_t, T, D, F, eps, HAS_NORM=has_norm, SAVE=save, IEEE=ieee,
            BLOCK_T=bt, BLOCK_F=r, BLOCK_K=bk, num_warps=w,
        )  # fmt: skip
    else:
        _tuned("gate_up_gemv", bt)[lambda m: (triton.cdiv(F, m["BLOCK_F"]),)](
            x, w_gate, w_up, nw, h, gu_t, rstd_t, T, D, F, eps, HAS_NORM=has_norm, SAVE=False, IEEE=ieee,
            BLOCK_T=bt,
        )  # fmt: skip
    if is_interpreter():
        r, bk, w = _GEMV_INTERP
        _gemv_nt_kernel[(triton.cdiv(D, r),)](
            h, w_down, y, T, D, F, IEEE=ieee, BLOCK_T=bt, BLOCK_N=r, BLOCK_K=bk, num_warps=w
        )
    else:
        _tuned("down", bt)[lambda m: (triton.cdiv(D, m["BLOCK_N"]),)](
            h, w_down, y, T, D, F, IEEE=ieee, BLOCK_T=bt
        )


def swiglu_ffn(
    out: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    **private: object,
) -> None:
    """The inference call `forward(out, None, None, x, ...)` (benchmarks/gpu_checks/ffn.py uses this name)."""
    forward(out, None, None, x, w_gate, w_up, w_down, norm_weight, eps, **private)


# ----------------------------------------------------------------------------------------------------
# prefill GEMM selection: pointer kernels vs TMA persistent kernels, by measurement on first use
# ----------------------------------------------------------------------------------------------------
# (kind, T bucket, F, D, dtype, fused norm, TMA-aligned, device, _gemm) -> "ptr" | "blas" | a TMA config
_CHOICE: dict[tuple, object] = {}
TIMINGS: dict[tuple, list[tuple[object, float]]] = {}  # same key -> [(candidate, ms)], for benchmarks
_BROKEN: set[tuple] = set()  # (kind, TMA config) that failed to compile or launch on this Triton


def _grid(m: dict, M: int, N: int) -> tuple[int]:
    return (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)


def _tma_aligned(tensors: tuple[torch.Tensor, ...]) -> bool:
    """TMA descriptors need 16-byte aligned base pointers and row strides (last dim contiguous)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def _tma_auto(tensors: tuple[torch.Tensor, ...]) -> bool:
    """TMA kernels compete in the automatic choice: CUDA sm_90+, fp16/bf16, aligned. HIP stays on the
    pointer kernels (gfx942 has no TMA; its tensor descriptors would lower to plain loads).
    FUSEKIT_FFN_TMA=0 keeps every call on the pointer kernels (no timing on first use)."""
    x = tensors[0]
    if (
        os.environ.get("FUSEKIT_FFN_TMA", "1") == "0"
        or is_interpreter()
        or is_hip()
        or x.device.type != "cuda"
        or x.dtype not in (torch.float16, torch.bfloat16)
    ):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9 and _tma_aligned(tensors)


@functools.cache
def _has_warp_specialize() -> bool:
    import inspect

    return "warp_specialize" in inspect.signature(tl.range.__init__).parameters


def _tma_configs(kind: str, T: int, save: bool = False) -> list[tuple]:
    if is_interpreter():
        return [_TMA_INTERP]
    if kind == "gate_up" and save:
        return [c for c in _GATE_UP_TMA if _tma_save_ok(c)]
    table = _GATE_UP_TMA if kind == "gate_up" else _DOWN_TMA
    return [c for c in table if (c[0] == 128 or T <= _SMALL_T) and (not c[7] or _has_warp_specialize())]


def _tma_save_ok(cfg: tuple) -> bool:
    """The gate/up TMA configs that also store gu (training): the 128-row ones (a training batch is
    thousands of tokens; fewer variants to compile ahead of time), the warp-specialized one included where
    this Triton has it (H200, triton 3.6, T=4096, D=4096, bf16, saving gu: it ran the gate/up GEMM in
    0.99 ms at F=11008 where the others took 1.16-1.23 ms). AOT sm_90: storing gu adds no shared memory (the
    epilogue buffer is reused) and no registers."""
    return cfg[0] == 128 and (not cfg[7] or _has_warp_specialize())


def _candidates(
    T: int, tensors: tuple[torch.Tensor, ...], gemm: str | None, tma_ok: bool, save: bool = False
) -> dict[str, list]:
    """Per GEMM kind, the configs to choose from ("ptr" = the autotuned pointer kernel, "blas" = the vendor
    GEMM). `tma_ok`: the gate/up GEMM reads a materialized xn (no fused norm prologue), which TMA and the
    vendor GEMM both need."""
    if gemm not in (None, "ptr", "tma", "blas"):
        raise ValueError(f"unknown swiglu_ffn _gemm {gemm!r}")
    if gemm == "blas":  # forced (tests, benchmarks): both GEMMs vendor, still checked against "ptr"
        if not tma_ok or tensors[0].dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("swiglu_ffn _gemm='blas' needs fp16/bf16 and _prologue='xn' (or no norm)")
        return {"gate_up": ["blas"], "down": ["blas"]}
    if gemm == "tma":
        if not tma_ok or not _tma_aligned(tensors):
            raise ValueError(
                "swiglu_ffn _gemm='tma' needs _prologue='xn' (or no norm) and 16-byte aligned rows"
            )
        return {k: _tma_configs(k, T, save) for k in ("gate_up", "down")}
    blas = ["blas"] if gemm is None and _blas_auto(tensors) else []
    blas_gu = blas if tma_ok else []  # the fused prologue normalizes A inside the Triton GEMM only
    if gemm is None and tma_ok and _tma_auto(tensors):
        return {
            "gate_up": ["ptr", *_tma_configs("gate_up", T, save), *blas_gu],
            "down": ["ptr", *_tma_configs("down", T, save), *blas],
        }
    return {"gate_up": ["ptr", *blas_gu], "down": ["ptr", *blas]}


def _blas_auto(tensors: tuple[torch.Tensor, ...]) -> bool:
    """The vendor GEMM (cuBLAS / hipBLASLt through torch.mm) competes on a GPU in fp16/bf16, CUDA and ROCm:
    - down, y = h @ Wd^T: the same product class as the Triton kernels (fp32 accumulation, one rounding of y);
    - gate/up (with xn materialized): g = xn @ Wg^T and u = xn @ Wu^T (fp32 accumulation, each rounded to
      x's dtype), then `_silu_mul_kernel` forms h in fp32 from the rounded g and u (see `_launch_gate_up`).
    The first-use timing picks whichever is faster at the shape and the check against the pointer kernel
    holds it to the same bound. Not for fp32 (torch may run it in TF32; fusekit's fp32 is IEEE), nor on the
    CPU / interpreter. FUSEKIT_FFN_BLAS=0 leaves it out of both."""
    x = tensors[0]
    return (
        os.environ.get("FUSEKIT_FFN_BLAS", "1") != "0"
        and not is_interpreter()
        and x.device.type == "cuda"
        and x.dtype in (torch.float16, torch.bfloat16)
    )


def _bench_ms(fn, device: torch.device) -> float:
    """A few ms of device time per candidate (median of the runs, L2 flushed, the host's enqueue time kept
    out: the vendor candidate's torch.mm calls cost more host time than one Triton launch, which must not
    decide a GPU-time choice; fusekit.device_time says why); the choice is cached per shape bucket."""
    from fusekit.device_time import device_ms

    return device_ms(fn, device, warmup_ms=2, rep_ms=8)


class _WrongResult(RuntimeError):
    """A TMA candidate ran but its output does not match the pointer kernel's."""


# Accepted distance of a TMA candidate's output from the pointer kernel's, on the same inputs. Both GEMMs
# accumulate in fp32 over the same BLOCK_K steps (only the MMA instruction's internal order differs:
# wgmma vs mma.sync, ~1e-7 relative) and round to the output dtype once, so an element differs by at most
# 1 ulp <= eps * |value| where the fp32 sums straddle a rounding boundary (bf16 eps 7.8e-3, fp16 9.8e-4).
# Bounds of ~2.5-4 eps hold with margin both for the relative 2-norm and for the largest |difference|
# against the largest |value|. The max test catches what the norm can miss: one zeroed 128x128 tile of
# the 2752 in a 4096x11008 h is only sqrt(1/2752) = 1.9e-2 in norm, but ~50-100% of max |h| in max.
# NaN (the poison left in tiles a kernel never wrote) or inf fail outright. fp32 (forced _gemm="tma"
# only, input_precision="ieee") has no final rounding: 1e-4 allows fp32 sums in another order.
# The vendor gate/up ("blas") rounds g and u to x's dtype before h (<= 2^-8 relative each in bf16, 2^-11
# in fp16; RMS ~2^-9.3 / 2^-12.3), which moves h by ~(kappa(g) dg + du) with kappa = g silu'(g) / silu(g)
# <= 1.28 where h is large. Simulated on the CPU (fp32 sums, round-to-nearest; D x F = 1024 x 2816,
# 2048 x 5632, 4096 x 11008): h vs the fused epilogue's rel 2-norm 3.5e-3 / max 5.5e-3 in bf16 (bound
# 2e-2), 4.4e-4 / 6.7e-4 in fp16 (bound 4e-3); y vs float64 3.35e-3 -> 4.24e-3 in bf16 (contract 1e-2),
# 4.18e-4 -> 5.31e-4 in fp16 (2e-3). The Mojo path and the backward round g and u the same way.
_VERIFY_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
_VERIFY_CHUNK = 1 << 22  # elements per float64 slice of the check: bounded temporary memory at any T


def _judgeable(ref: torch.Tensor) -> bool:
    """The reference can tell a wrong kernel from a right one: all finite and not all zero."""
    return bool(torch.isfinite(ref).all()) and bool(ref.any())


def _mismatch(cand: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None if `cand` matches the pointer kernel's `ref` within _VERIFY_TOL, else what is wrong."""
    tol = _VERIFY_TOL.get(ref.dtype, 1e-4)
    c2, r2 = cand.reshape(-1, cand.shape[-1]), ref.reshape(-1, ref.shape[-1])
    step = max(1, _VERIFY_CHUNK // max(1, r2.shape[1]))
    # [non-finite count, sum d^2, sum r^2] add up over the slices, [max |d|, max |r|] take the max
    acc = torch.zeros(5, dtype=torch.float64, device=ref.device)
    for i in range(0, r2.shape[0], step):
        c, r = c2[i : i + step].double(), r2[i : i + step].double()
        d = (c - r).abs_()
        part = torch.stack([(~torch.isfinite(c)).sum().double(), d.square().sum(), r.square().sum(),
                            d.amax(), r.abs().amax()])  # fmt: skip
        acc = torch.cat([acc[:3] + part[:3], torch.maximum(acc[3:], part[3:])])
    bad, ss_d, ss_r, max_d, max_r = acc.tolist()
    if bad:
        return f"{int(bad)} of {cand.numel()} outputs are NaN/inf (NaN: tiles left unwritten)"
    if ss_d <= tol * tol * ss_r and max_d <= tol * max_r:
        return None
    rel = (ss_d / ss_r) ** 0.5 if ss_r else float("inf")
    rel_max = max_d / max_r if max_r else float("inf")
    return (
        f"wrong values vs the pointer kernel: rel 2-norm error {rel:.2e}, max |diff| / max |ptr| "
        f"{rel_max:.2e} (bound {tol:g} on both)"
    )


def _verify(cands: tuple[torch.Tensor, ...], refs: list[torch.Tensor]) -> None:
    for i, (cand, ref) in enumerate(zip(cands, refs)):
        err = _mismatch(cand, ref)
        if err is not None:
            raise _WrongResult(err if i == 0 else f"saved gu: {err}")


def _choose(
    kind: str, key: tuple, cands: dict[str, list], launch, dst: torch.Tensor | tuple[torch.Tensor, ...]
) -> object:
    """The fastest candidate for this key whose output matches the pointer kernel's, timed once.

    `launch(cfg)` writes `dst` (h, and gu when saving, for gate/up; out for down) from the caller's real
    inputs. "ptr" runs first and its outputs are kept (one copy per key, first use only); every TMA config
    (and "blas", the vendor GEMM) then writes dst after it is poisoned with NaN and must match that copy
    before it is timed, and again after its timed runs (a race that shows up only sometimes). Candidates
    that fail to compile or launch, or do not match, are warned about and dropped for good (out of memory:
    for this key only). dst is left with an arbitrary candidate's output: the caller launches the returned
    config, which rewrites it.
    """
    dsts = dst if isinstance(dst, tuple) else (dst,)
    key = (kind, *key)
    if key in _CHOICE:
        return _CHOICE[key]
    live = [c for c in cands[kind] if c == "ptr" or (kind, c) not in _BROKEN]
    if not live:
        raise RuntimeError(f"swiglu_ffn: no {kind} GEMM config compiled (see the warnings)")
    if live == ["ptr"]:  # nothing to compare or time
        _CHOICE[key] = "ptr"
        TIMINGS[key] = [("ptr", float("nan"))]
        return "ptr"
    launch("ptr")  # compiles (autotunes) the pointer kernel; its output is the reference
    refs = [d.clone() for d in dsts]
    if not _judgeable(refs[0]):  # e.g. a warm-up on torch.empty or zeros: decide on a later call
        return "ptr" if "ptr" in live else live[0]
    timed = len(live) > 1  # a single (forced) candidate is checked but not timed
    dev = dsts[0].device
    times: list[tuple[object, float]] = []
    if "ptr" in live:
        times.append(("ptr", _bench_ms(lambda: launch("ptr"), dev) if timed else float("nan")))
    for cfg in (c for c in live if c != "ptr"):
        try:
            for d in dsts:
                d.fill_(float("nan"))  # a tile the kernel never writes stays NaN and fails the check
            launch(cfg)  # compiles outside the timed runs
            _verify(dsts, refs)
            ms = float("nan")
            if timed:
                ms = _bench_ms(lambda cfg=cfg: launch(cfg), dev)
                _verify(dsts, refs)  # the last timed run's output
            times.append((cfg, ms))
        except Exception as exc:
            oom = isinstance(exc, torch.OutOfMemoryError)  # e.g. "blas"'s workspaces: this key only
            if not oom:
                _BROKEN.add((kind, cfg))
            what = "wrong results" if isinstance(exc, _WrongResult) else "out of memory" if oom else "failed"
            warnings.warn(
                f"swiglu_ffn: {'TMA ' if cfg != 'blas' else ''}{kind} config {cfg} excluded on triton "
                f"{triton.__version__} ({what}): "
                f"{type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
    if not times:
        raise RuntimeError(f"swiglu_ffn: no {kind} GEMM config compiled and matched (see the warnings)")
    best = min(times, key=lambda t: t[1] if t[1] == t[1] else 0.0)[0]
    _CHOICE[key] = best
    TIMINGS[key] = times
    note_tuned("ffn gemm", key, str(best))
    if os.environ.get("TRITON_PRINT_AUTOTUNING") == "1":  # the same switch as Triton's autotuner log
        print(f"[fusekit ffn gemm] {key}: picked {best}; " + ", ".join(f"{c}: {t:.3f} ms" for c, t in times))
    return best


def _launch_gate_up(
    cfg, a, w_gate, w_up, nw, rstd, h, T: int, F: int, D: int, has_norm: bool, ieee: bool, gu=None
) -> None:
    save = gu is not None
    if cfg == "blas":
        # Vendor GEMMs (fp32 accumulation, outputs rounded to x's dtype), then h in fp32 from the rounded g
        # and u: one rounding more than the fused epilogues (see _blas_auto, _VERIFY_TOL). Training writes
        # g and u straight into gu's halves, which is what gu must hold anyway (a row-strided out: torch
        # passes ldc = 2F to cuBLAS / hipBLASLt, no copy): no workspace, and 2*T*F fewer elements moved than
        # [T, F] workspaces the element-wise kernel would copy into gu. Inference: g goes into h (the kernel
        # overwrites it in place) and u into one [T, F] workspace (T=4096, F=14336 bf16: 117 MB).
        # torch.mm(out=) into views and a lean launch: the call stays replayable (_replay.py).
        if save:
            g, u = gu[:, :F], gu[:, F:]
        else:
            g, u = h, torch.empty((T, F), device=a.device, dtype=a.dtype)
        torch.mm(a, w_gate.t(), out=g)
        torch.mm(a, w_up.t(), out=u)
        bm, bn, warps = _ew_tile(T, F, a.element_size(), device_index(a))
        _silu_mul_kernel[_ew_grid(T, F, bm, bn)](
            g, u, h, T, F, IN_GU=save, BLOCK_T=bm, BLOCK_F=bn, num_warps=warps
        )
        return
    gu_t = gu if save else h  # a dummy the kernel never touches without SAVE_GU
    if cfg == "ptr":
        if is_interpreter():
            bm, bn, bk, g, w, _s = _MM_INTERP
            m = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g}
            _gate_up_kernel[_grid(m, T, F)](
                a, w_gate, w_up, nw, rstd, h, gu_t, T, F, D, HAS_NORM=has_norm, SAVE_GU=save, IEEE=ieee,
                EVEN_K=D % bk == 0, **m, num_warps=w,
            )  # fmt: skip
        else:
            _tuned("gate_up")[lambda m: _grid(m, T, F)](
                a, w_gate, w_up, nw, rstd, h, gu_t, T, F, D, HAS_NORM=has_norm, SAVE_GU=save, IEEE=ieee
            )
        return
    bm, bn, bk, g, w, s, _sub, ws = cfg
    sms = num_sms(device_index(a))
    if not is_interpreter():
        ensure_tma_allocator()
    _gate_up_tma_kernel[(min(sms, triton.cdiv(T, bm) * triton.cdiv(F, bn)),)](
        a, w_gate, w_up, h, gu_t, T, F, D, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g,
        NUM_SMS=sms, FLATTEN=not ws, WARP_SPECIALIZE=ws, SAVE_GU=save, num_warps=w, num_stages=s,
    )  # fmt: skip


def _launch_down(cfg, h, w_down, out, T: int, D: int, F: int, ieee: bool) -> None:
    if cfg == "blas":
        torch.mm(h, w_down.t(), out=out)
        return
    if cfg == "ptr":
        if is_interpreter():
            bm, bn, bk, g, w, _s = _MM_INTERP
            m = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g}
            _matmul_nt_kernel[_grid(m, T, D)](
                h, w_down, out, T, D, F, IEEE=ieee, EVEN_K=F % bk == 0, **m, num_warps=w
            )
        else:
            _tuned("down")[lambda m: _grid(m, T, D)](h, w_down, out, T, D, F, IEEE=ieee)
        return
    bm, bn, bk, g, w, s, sub, ws = cfg
    sms = num_sms(device_index(h))
    if not is_interpreter():
        ensure_tma_allocator()
    _matmul_nt_tma_kernel[(min(sms, triton.cdiv(T, bm) * triton.cdiv(D, bn)),)](
        h, w_down, out, T, D, F, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, NUM_SMS=sms,
        FLATTEN=not ws, WARP_SPECIALIZE=ws, SUBTILE=sub, num_warps=w, num_stages=s,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# ahead-of-time specs
# ----------------------------------------------------------------------------------------------------
# The training (gu-saving) variants are listed for bf16 only, the dtype models train in: the fp16 ones are the
# same tiles with another operand type (same registers and shared memory), and CI compiles every spec on
# 2 cores. The JIT serves fp16 training.
_SAVE_AOT = {"bf16": (False, True), "fp16": (False,)}


def aot_specs() -> list[tuple[str, object, dict, dict, dict, dict]]:
    """(name, jit kernel, signature, constexprs, options, attrs) for every GPU variant of the CUDA tables.

    fp16/bf16 only; `options` carries num_warps/num_stages for triton.compile (the HIP build of the same
    shapes should cap num_stages at 2). attrs = ASTSource attrs (16-divisible pointers and row strides):
    pass them as `ASTSource(fn, signature, constexprs, attrs)`, else the GEMM loops compile unpipelined.
    GEMMs are listed with EVEN_K=True only (D and F multiples of 64, as in every Llama-style model);
    other shapes are served by the JIT. The TMA kernels (ffn_tma_*) are launched on CUDA sm_90 only;
    Triton also compiles them for gfx942 (tensor descriptors lower to plain loads there, no TMA), but the
    HIP runtime never picks them. Their NUM_SMS constexpr is the H200's 132.
    """
    specs: list[tuple[str, object, dict, dict, dict]] = []
    mm_const = ("IEEE", "EVEN_K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
    for dt in ("fp16", "bf16"):
        p = f"*{dt}"
        # the norm weight in x's dtype, and fp32 (mixed precision) for the materialized-xn prologue
        for wt, write_xn in ((dt, False), (dt, True), ("fp32", True)):
            sig = {"x_ptr": p, "nw_ptr": f"*{wt}", "rstd_ptr": "*fp32", "xn_ptr": p, "D": "i32", "eps": "fp32",
                   "WRITE_XN": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
            tag = "" if wt == dt else "_wfp32"
            specs.append((f"ffn_rstd_{dt}_xn{int(write_xn)}{tag}", _rstd_kernel, sig,
                          {"WRITE_XN": write_xn, "BLOCK": _RSTD_BLOCK}, {"num_warps": 4}))  # fmt: skip
        for (bm, bn, bk, g, w, s), save in itertools.product(_GATE_UP_CUDA, _SAVE_AOT[dt]):
            # HAS_NORM=False only: the launcher's default prologue writes xn and runs the plain GEMM.
            sig = {"a_ptr": p, "wg_ptr": p, "wu_ptr": p, "nw_ptr": p, "rstd_ptr": "*fp32", "h_ptr": p,
                   "gu_ptr": p, "M": "i32", "N": "i32", "K": "i32", "HAS_NORM": "constexpr",
                   "SAVE_GU": "constexpr"}  # fmt: skip
            sig |= dict.fromkeys(mm_const, "constexpr")
            const = {"HAS_NORM": False, "SAVE_GU": save, "IEEE": False, "EVEN_K": True, "BLOCK_M": bm,
                     "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g}  # fmt: skip
            specs.append((f"ffn_gate_up_{dt}_{bm}x{bn}x{bk}_w{w}s{s}{'_save' if save else ''}", _gate_up_kernel,
                          sig, const, {"num_warps": w, "num_stages": s}))  # fmt: skip
        # the vendor gate/up step's element-wise kernel (tile of F >= 1024 columns: Llama-style sizes)
        bm, bn, ew_warps = _ew_tile(1 << 16, 1 << 14, 2, 0)
        for in_gu in _SAVE_AOT[dt]:
            sig = {"g_ptr": p, "u_ptr": p, "h_ptr": p, "T": "i32", "F": "i32", "IN_GU": "constexpr",
                   "BLOCK_T": "constexpr", "BLOCK_F": "constexpr"}  # fmt: skip
            specs.append((f"ffn_silu_mul_{dt}{'_gu' if in_gu else ''}", _silu_mul_kernel, sig,
                          {"IN_GU": in_gu, "BLOCK_T": bm, "BLOCK_F": bn}, {"num_warps": ew_warps}))  # fmt: skip
        for bm, bn, bk, g, w, s in _DOWN_CUDA:
            sig = {"a_ptr": p, "b_ptr": p, "c_ptr": p, "M": "i32", "N": "i32", "K": "i32"}
            sig |= dict.fromkeys(mm_const, "constexpr")
            const = {"IEEE": False, "EVEN_K": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g}
            specs.append((f"ffn_down_{dt}_{bm}x{bn}x{bk}_w{w}s{s}", _matmul_nt_kernel, sig, const,
                          {"num_warps": w, "num_stages": s}))  # fmt: skip
        # TMA persistent GEMMs, sm_90 only at run time (see _tma_auto); NUM_SMS is the H200's 132.
        tma_sig = {"IEEE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                   "GROUP_M": "constexpr", "NUM_SMS": "constexpr", "FLATTEN": "constexpr",
                   "WARP_SPECIALIZE": "constexpr"}  # fmt: skip
        for kind, table in (("gate_up", _GATE_UP_TMA), ("down", _DOWN_TMA)):
            for bm, bn, bk, g, w, s, sub, ws in table:
                if ws and not _has_warp_specialize():
                    continue
                const = {"IEEE": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g,
                         "NUM_SMS": _AOT_SMS, "FLATTEN": not ws, "WARP_SPECIALIZE": ws}  # fmt: skip
                tag = f"{bm}x{bn}x{bk}_w{w}s{s}" + ("_sub" if sub else "") + ("_ws" if ws else "")
                opts = {"num_warps": w, "num_stages": s}
                if kind == "gate_up":
                    sig = {"a_ptr": p, "wg_ptr": p, "wu_ptr": p, "h_ptr": p, "gu_ptr": p, "M": "i32", "N": "i32",
                           "K": "i32"} | tma_sig | {"SAVE_GU": "constexpr"}  # fmt: skip
                    for save in _SAVE_AOT[dt] if _tma_save_ok((bm, bn, bk, g, w, s, sub, ws)) else (False,):
                        name = f"ffn_tma_gate_up_{dt}_{tag}{'_save' if save else ''}"
                        specs.append((name, _gate_up_tma_kernel, sig, const | {"SAVE_GU": save}, opts))
                else:
                    sig = {"a_ptr": p, "b_ptr": p, "c_ptr": p, "M": "i32", "N": "i32", "K": "i32"}
                    sig |= tma_sig | {"SUBTILE": "constexpr"}
                    const["SUBTILE"] = sub
                    specs.append((f"ffn_tma_down_{dt}_{tag}", _matmul_nt_tma_kernel, sig, const, opts))
        # Decode gate/up: inference autotunes over every table row (norm weight of x's dtype, or none; fp32
        # norm weights get each BLOCK_T's first row); a training call (SAVE) runs one fixed row
        # (_gemv_save_config) with no norm, or a norm weight of x's dtype or fp32.
        gemv: list[tuple[int, tuple[int, int, int], str | None, bool]] = []
        for bt, table in _GEMV_CUDA["gate_up"].items():
            gemv += [(bt, row, wt, False) for row in table for wt in (None, dt)]
            gemv += [(bt, table[0], "fp32", False)]
            if bt == 16 and True in _SAVE_AOT[dt]:  # a training call always runs BLOCK_T = 16 (see _decode)
                gemv += [(bt, _gemv_save_row(bt, 2), wt, True) for wt in (None, dt, "fp32")]
        for bt, (r, bk, w), wt, save in gemv:
            sig = {"x_ptr": p, "wg_ptr": p, "wu_ptr": p, "nw_ptr": f"*{wt or dt}", "h_ptr": p, "gu_ptr": p,
                   "rstd_ptr": "*fp32", "T": "i32", "D": "i32", "F": "i32", "eps": "fp32",
                   "HAS_NORM": "constexpr", "SAVE": "constexpr", "IEEE": "constexpr", "BLOCK_T": "constexpr",
                   "BLOCK_F": "constexpr", "BLOCK_K": "constexpr"}  # fmt: skip
            const = {"HAS_NORM": wt is not None, "SAVE": save, "IEEE": False, "BLOCK_T": bt, "BLOCK_F": r,
                     "BLOCK_K": bk}  # fmt: skip
            tag = f"n{int(wt is not None)}" + ("_wfp32" if wt == "fp32" else "") + ("_save" if save else "")
            specs.append((f"ffn_gemv_gate_up_{dt}_{tag}_t{bt}_{r}x{bk}_w{w}", _gate_up_gemv_kernel, sig, const,
                          {"num_warps": w}))  # fmt: skip
        for bt, table in _GEMV_CUDA["down"].items():
            for r, bk, w in table:
                sig = {"a_ptr": p, "w_ptr": p, "c_ptr": p, "T": "i32", "N": "i32", "K": "i32",
                       "IEEE": "constexpr", "BLOCK_T": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}  # fmt: skip
                const = {"IEEE": False, "BLOCK_T": bt, "BLOCK_N": r, "BLOCK_K": bk}
                specs.append((f"ffn_gemv_down_{dt}_t{bt}_{r}x{bk}_w{w}", _gemv_nt_kernel, sig, const,
                              {"num_warps": w}))  # fmt: skip
    specs += _backward_aot_specs()
    return [(*spec, div16_attrs(spec[2])) for spec in specs]
