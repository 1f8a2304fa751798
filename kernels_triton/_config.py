"""Shared launch helpers for the Triton kernels: interpreter/arch detection, warp size, SM count, warps."""

from __future__ import annotations

import functools
import os

import torch


def is_interpreter() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1): pick one small config, no autotune."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_hip() -> bool:
    return torch.version.hip is not None


@functools.cache
def warp_size(device_index: int = 0) -> int:
    """Threads per warp of the active target (32 on NVIDIA, 64 on AMD CDNA); never assumed."""
    if is_interpreter():
        return 32
    try:
        import triton

        return int(triton.runtime.driver.active.get_current_target().warp_size)
    except Exception:
        return 64 if is_hip() else 32


@functools.cache
def num_sms(device_index: int = 0) -> int:
    """Multiprocessors (CUs on AMD) of the device; a small stand-in on the CPU interpreter."""
    if is_interpreter() or not torch.cuda.is_available():
        return 4
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.type == "cuda" and t.device.index is not None else 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def warps_for(block_elems: int, elems_per_thread: int, dev: int = 0, lo: int = 1, hi: int = 16) -> int:
    """Warps so that each thread holds about `elems_per_thread` elements of a `block_elems` tile.

    Sized in threads, not warps, so a 64-wide AMD wave gets half as many warps as a 32-wide NVIDIA warp.
    """
    threads = max(1, block_elems // elems_per_thread)
    w = next_pow2(max(1, threads // warp_size(dev)))
    return max(lo, min(hi, w))


TL_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int32: "i32",
    torch.int64: "i64",
}


# ---- row-norm planning (shared by rms_norm and layer_norm) -------------------------------------------------
# "reg":    N <= NORM_REG_MAX: the whole row (BLOCK_M rows for short N) lives in registers: one HBM read of x.
#           At 16384 elements a 16-warp program holds 32 fp32 values of x per thread; beyond that the
#           compiler starts spilling, so longer rows switch to...
# "reload": one row per program; pass 1 streams the row for the statistics (loads marked evict_last),
#           pass 2 streams it again to normalize (evict_first). The row was read microseconds earlier and
#           the rows in flight (a few programs per SM x 132 SMs x row bytes) fit in the 60 MB L2, so pass 2
#           mostly hits L2: measured 1.4x (rms) / 1.9x (layer) torch.compile at 16384 x 65536 bf16 on an
#           H200, whose inductor kernel re-reads more of the row from HBM.
# "split":  few rows (M < 2 x SMs) longer than NORM_REG_MAX: rows alone cannot fill the GPU, so each row is
#           cut into SPLIT chunks: kernel 1 writes per-chunk partial statistics, kernel 2 combines them in a
#           fixed order and normalizes its chunk (cluster-free; costs a second read of x, cheap at small M).
NORM_REG_MAX = 16384
NORM_SPLIT_PROGRAMS_PER_SM = 4


def norm_plan(M: int, N: int, elsize: int, dev: int) -> tuple[str, int]:
    """(mode, split) for a row norm of x[M, N]; split > 1 only for mode "split"."""
    if N <= NORM_REG_MAX:
        return "reg", 1
    sms = num_sms(dev)
    if 2 * sms > M:
        split = min(max(2, (NORM_SPLIT_PROGRAMS_PER_SM * sms) // M), max(2, N // 8192))
        return "split", split
    return "reload", 1


def norm_plan_forced(
    M: int, N: int, elsize: int, dev: int, mode: str | None, split: int | None
) -> tuple[str, int]:
    """norm_plan, with the tests' private `_mode` / `_split` overrides applied."""
    planned, planned_split = norm_plan(M, N, elsize, dev)
    if mode is not None:
        return mode, (split or max(2, planned_split)) if mode == "split" else planned_split
    return planned, split if split is not None else planned_split


def split_chunks(N: int, split: int, block: int, split_max: int) -> tuple[int, int]:
    """(parts, chunk): a row of N cut into at most `split_max` parts of whole BLOCK-sized steps."""

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    chunk = cdiv(cdiv(N, min(split, split_max)), block) * block
    return cdiv(N, chunk), chunk


def norm_block(elsize: int, step_bytes: int) -> int:
    """Elements of x per loop step of the streaming kernels (a small block on the interpreter)."""
    return 256 if is_interpreter() else step_bytes // elsize


def norm_reg_tile(M: int, N: int, elsize: int, dev: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for "reg": short rows are packed BLOCK_M to a program so a program
    moves >= ~8 KB; each thread holds ~2 16-byte vectors of x (more once the 16-warp cap is reached)."""
    block_n = next_pow2(N)
    block_m = max(1, min(8192 // elsize // block_n, next_pow2(M), 64))
    nw = warps_for(block_m * block_n, 2 * 16 // elsize, dev, lo=4, hi=16)
    return block_m, block_n, nw


def norm_stream_warps(block: int, elsize: int, vecs_per_thread: int, dev: int) -> int:
    """Warps for the streaming (reload/split) kernels: each thread loads `vecs_per_thread` 16-byte
    vectors per step."""
    return warps_for(block, vecs_per_thread * 16 // elsize, dev, lo=4, hi=32)


ALIGNED_INTS = ("N", "K", "D", "F")  # row strides/extents the AOT variants assume are multiples of 16


def div16_attrs(sig: dict[str, str]) -> dict[tuple[int], list[list]]:
    """ASTSource attrs marking every pointer (and the row-stride ints) 16-divisible, as Triton's JIT does
    for aligned torch tensors; without them there is no cp.async/TMA pipelining (1-stage shared memory).
    A runtime using these binaries must check pointer % 16 == 0 and those ints % 16 == 0 first."""
    return {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
            if v.startswith("*") or k in ALIGNED_INTS}  # fmt: skip
