"""The "coop" mode of the row norms: one row cut into SPLIT register-resident chunks, one per program, whose
partial statistics meet at a per-row barrier in global memory, so x is read from HBM exactly once.

Why: "reload" (the mode for N > NORM_REG_MAX) reads each row twice, the second time from L2, which holds
~132 rows in flight only while a row is short: at 131072-262144 bf16 columns (256-512 KB rows) it ran at
64-69% of the copy ceiling on the H100, and capping its grid to fit the L2 did not help (_config.py).
Here each program keeps its chunk in registers between the statistics and the normalize, so no re-read.

Protocol (per row): every program of the row's group stores its partial statistics, then `row_barrier`:
a CTA barrier (every thread's stores precede it), an atomic arrival on cnt[row] with release semantics
(GPU scope; cumulative, so it publishes the stores the barrier ordered), and acquire polls of cnt[row]
until all SPLIT programs arrived. Each program then reads the SPLIT partials in the same fixed order:
identical statistics in every chunk, bit-identical run to run (no floating-point atomics).
cnt[M] is zeroed per call (torch.zeros: one fill launch, negligible beside these 0.4+ ms kernels; no state
survives a call, so CUDA-graph replays and concurrent streams cannot see a stale count).

Co-residency: a program spins until its row's other programs arrive, so all programs of a group must run
at the same time. The launch is cooperative (`launch_cooperative_grid=True`: the driver refuses a grid
that cannot be resident at once, with an error, never a hang), and the grid is groups x SPLIT <= programs
per SM x SMs. Never in the CPU interpreter, which runs programs one after another (the first would spin
forever): `_config.coop_supported()` says False there and the planners never offer the mode.

Persistent: group g takes rows g, g + G, ...; the next row's chunk is loaded before the barrier, so the
SM's loads stay in flight while the group waits (the wait is ~1-2 us of atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._config import COOP_SPLIT_MAX, NORM_SM_THREADS, NormConfig, device_index, is_hip, num_sms

_FIT: dict[tuple, int] = {}  # (kernel, launch key) -> programs of it one SM holds


def coop_fit(fn, key: tuple, args: tuple, kwargs: dict, num_warps: int, dev: int) -> int:
    """Programs of the compiled kernel one SM holds at once, from its registers (NVIDIA: 64 K registers
    per SM, allocated per warp in 256-register units; at most 2048 threads and 32 programs). Compiles once
    per key (plan time, not per call); 1 on AMD, where the driver's cooperative check is the guard."""
    fit = _FIT.get(key)
    if fit is None:
        if is_hip():
            fit = 1
        else:
            k = fn.warmup(*args, grid=(1,), **kwargs)
            k._init_handles()  # loads the cubin: n_regs
            per_warp = -(-k.n_regs * 32 // 256) * 256
            fit = min((65536 // per_warp) // num_warps, NORM_SM_THREADS // (32 * num_warps), 32)
        _FIT[key] = fit
    return fit


def coop_groups(M: int, N: int, split: int, progs: int, dev: int) -> int:
    """Row groups of the grid: groups x split <= progs x SMs programs (split chunks per row of N)."""
    slots = progs * num_sms(dev)
    if progs < 1 or split > COOP_SPLIT_MAX or split > slots:
        raise ValueError(
            f"coop: a row of {N} in {split} chunks needs {split} programs resident at once "
            f"(at most {min(COOP_SPLIT_MAX, slots)} here: {progs} per SM)"
        )
    return max(1, min(M, slots // split))


def coop_launch(
    fn, key: tuple, x: torch.Tensor, cfg: NormConfig, stats: int, head: list, tail: list, kw: dict
) -> None:
    """Launches a coop kernel over x[M, N]: fn(*head, part, cnt, M, N, SPLIT, *tail, **kw) with the
    [M, SPLIT, stats] fp32 partials, the per-call zeroed arrival counters and a cooperative grid of
    groups x SPLIT programs (programs per SM capped by `coop_fit`). `key` names the kernel variant."""
    M, N = x.shape
    dev = device_index(x)
    split = -(-N // cfg.block)
    part = torch.empty((M * split * stats,), dtype=torch.float32, device=x.device)
    cnt = torch.zeros((M,), dtype=torch.int32, device=x.device)
    args = [*head, part, cnt, M, N, split, *tail]
    kw = kw | dict(
        BLOCK=cfg.block, BLOCK_S=COOP_SPLIT_MAX, num_warps=cfg.num_warps, launch_cooperative_grid=True
    )
    fit = coop_fit(fn, (*key, cfg, split, dev), args, kw, cfg.num_warps, dev)
    groups = coop_groups(M, N, split, min(cfg.progs, fit), dev)
    fn[(groups * split,)](*args, **kw)


@triton.jit
def coop_chunk(N, SPLIT, BLOCK: tl.constexpr):
    """This program's place: (row groups G, its group, its chunk k of the row, columns c, column mask)."""
    pid = tl.program_id(0)
    k = pid % SPLIT
    c = k * BLOCK + tl.arange(0, BLOCK)
    return tl.num_programs(0) // SPLIT, pid // SPLIT, k, c, c < N


@triton.jit
def row_barrier(cnt_ptr, row, split):
    """Arrive at row `row`'s barrier and wait until all `split` programs of the row have arrived."""
    tl.debug_barrier()  # every thread's partial stores come before this program's arrival
    n = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu") + 1
    while n < split:
        n = tl.atomic_add(cnt_ptr + row, 0, sem="acquire", scope="gpu")


@triton.jit
def widen_again(x):
    """x as fp32, through a different op chain than x.to(fp32) for bf16 (its bits shifted into the high half)
    so the compiler cannot merge the statistics' widening with the normalize's, meant to keep only the bf16
    chunk alive across the barrier, not its fp32 copy. A/B on an H200 (.dev/s/widen_ab.py at 01bd565: the
    coop kernels patched to widen with x.to(fp32) in a fresh process, two rounds each, device time, bf16):
    rms_norm's 64 KB chunks are 5-10% faster with it (1024 threads, N=131072 401 -> 371 us, N=262144
    419 -> 380; 512 threads 394 -> 376, 408 -> 386); layer_norm's 32 KB candidate ~0.5% slower (505 -> 506,
    523 -> 527). ptxas reports the same 127 registers for the 32-element rms variant either way, and a
    16 KB-chunk candidate (no longer offered) was slower with it (H100 460 -> 516 us at 4096 x 65536)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)
