"""Shared launch helpers for the Triton kernels: interpreter/arch detection, warp size, SM count, warps."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable

import torch

# What Triton's own TRITON_INTERPRET knob (knobs.runtime.interpret, 3.6 and 3.9) reads as on, case-insensitive.
_TRUTHY = ("1", "true", "on", "yes", "y")


def is_interpreter() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1): pick one small config, no autotune.
    Read as Triton reads it ("true", "on", ... count; "false", "off" do not), so fusekit and Triton never
    disagree on whether a launch is interpreted."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUTHY


class EnvSnapshot:
    """The values of a fixed set of environment variables (None where unset; encoded on POSIX) as one tuple,
    for a plan cache to key on (the plan's builder reads them as usual): a probe's or a test's change of a
    FUSEKIT_* switch (monkeypatch.setenv) reaches the next call, and a call whose switches did not change finds
    its plan. Reads os.environ's own mapping where it is a plain dict of encoded names (POSIX: ~0.7 us for 9
    names against ~9 through os.environ.get)."""

    def __init__(self, *names: str) -> None:
        self.names = names
        data = getattr(os.environ, "_data", None)
        enc = getattr(os.environ, "encodekey", None)
        self._data = data if isinstance(data, dict) and enc is not None else None
        self._keys = tuple(enc(n) for n in names) if self._data is not None else names

    def __call__(self) -> tuple:
        data = self._data
        if data is not None:
            return tuple([data.get(k) for k in self._keys])
        return tuple([os.environ.get(n) for n in self.names])


PLAN_CACHE = 1024  # signatures a per-signature table keeps (remember); a model has a few, a shape sweep more


def remember(table: dict, key: object, value: object, cap: int = PLAN_CACHE) -> object:
    """table[key] = value, the table emptied first when it holds `cap` entries (per-signature caches: plans,
    routes, descriptor fields); returns value."""
    if len(table) >= cap:
        table.clear()
    table[key] = value
    return value


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


class _Current:
    """A no-op context: the tensor's GPU is already the current one (or it is not on a GPU)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_CURRENT = _Current()
_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def on_device(t: torch.Tensor):
    """`torch.cuda.device(t.device)` where t's GPU is not the current one, else a no-op: Triton launches
    on the current device, and entering torch.cuda.device costs microseconds on a decode step."""
    if t.device.type != "cuda" or t.device.index is None or t.device.index == _get_device():
        return _CURRENT
    return torch.cuda.device(t.device)


def _torch_alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # the current device: the launchers run under on_device(tensor)
    return torch.empty(size, device="cuda", dtype=torch.int8)


def ensure_tma_allocator() -> None:
    """Device-side TMA descriptors (tl.make_tensor_descriptor) need Triton's global scratch allocator (128 B
    per descriptor per program); install one on torch's caching allocator unless the user has set one."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except Exception:
        pass
    import triton

    triton.set_allocator(_torch_alloc)


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
# Both norms move 2 bytes of HBM per element of x (read x, write out); the floor is that at the copy rate.
# What decides how close a kernel gets is the bytes of x *in flight* per SM: ~4.3 TB/s x ~0.8 us loaded
# latency ~= 3.5 MB across 132 SMs, ~26 KB per SM, kept up continuously. Registers bound it: a thread's
# landing registers for loads in flight plus the fp32 copies it computes on, times the resident threads,
# must fit the 64 K registers of an SM. Hence the modes:
# "reg":    N <= NORM_REG_MAX, one tile of BLOCK_M rows per program, held in registers: one HBM read of x.
#           Simple, but a program's loads are in flight only until its tile lands; the reduction and the
#           store that follow leave the SM's memory pipe idle unless another program fills it.
# "rows":   the same register tile, persistent: NORM_PROGS x SMs programs walk the row tiles, and each loads
#           its NEXT tile before reducing and storing the current one, so a tile per program is always in
#           flight (prefetch costs only the bf16/fp16 landing registers).
# "reload": long rows (any N; the only choice beyond NORM_REG_MAX). Persistent programs, one row at a time:
#           pass 1 streams the row for the statistics (evict_last), pass 2 re-reads it from L2 (evict_first)
#           to normalize. The L2 (60 MB) must hold the rows in flight, progs x SMs x row bytes: 17 MB at one
#           128 KB row per SM. (The earlier one-program-per-row grid left residency to the hardware.) Pass 1
#           loads ahead (rms_norm two steps, layer_norm one: its second accumulator leaves no registers for
#           more, AOT showed spills), and the next row's first step(s) are loaded before pass 2, so neither
#           the pass switch nor the row switch drains the SM's loads.
# "split":  few rows (M < 2 x SMs) longer than NORM_REG_MAX: rows alone cannot fill the GPU, so each row is
#           cut into SPLIT chunks: kernel 1 writes per-chunk partial statistics, kernel 2 combines them in a
#           fixed order and normalizes its chunk (cluster-free; costs a second read of x, cheap at small M).
# "coop":   rows longer than 128 KB (tuned runs on a GPU): each row cut into register-resident chunks, one
#           program each, the partial statistics meeting at a per-row barrier (kernels_triton/_coop.py).
# With a fused residual add (the contract's forward(y, h, ..., x, residual, ...)) every mode reads x and the
# residual once and writes h = x + residual once; "reload"/"split" re-read h (from L2), not x and residual.
# Which tile, warps, programs per SM and step win is not derivable to the last 5 %, so for large problems
# (M x N >= NORM_TUNE_MIN_ELEMS, not in the interpreter, not under CUDA-graph capture) each call shape is
# timed once over `norm_candidates` and the fastest is cached (`norm_tuned`); small problems and the CPU
# interpreter take the heuristic `norm_default` without measurement. On that first use every candidate is
# also CHECKED against an fp32 torch reference of the caller's own inputs before it may be timed or picked
# (NORM_CHECK_TOL below): one that the GPU's compiler gets wrong is dropped with a RuntimeWarning.
NORM_REG_MAX = 16384
NORM_SPLIT_PROGRAMS_PER_SM = 4
# Below NORM_TUNE_MIN_ELEMS launch overhead dominates and tuning (~0.1 s per candidate) is not worth it.
NORM_TUNE_MIN_ELEMS = 1 << 22
# A persistent grid must be resident all at once (a program that starts late finishes late): its kernels
# compile to <= 64 registers per thread (AOT, sm_90), so progs x threads <= 1024 fits an SM's 64 K registers.
NORM_PERSIST_THREADS = 1024
NORM_ROWS_PROGS = 2  # default programs per SM of "rows"
NORM_RELOAD_PROGS = 1  # default programs per SM of "reload" (one row per SM in flight: 17 MB of L2 at 128 KB)


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """One launch of a row norm. `block` is BLOCK_N ("reg"/"rows") or elements per step ("reload"/"split");
    `progs` is programs per SM of the persistent kernels ("rows"/"reload")."""

    mode: str
    block: int
    num_warps: int
    block_m: int = 1
    progs: int = 0
    split: int = 1

    def label(self) -> str:
        s = f"{self.mode} block={self.block} warps={self.num_warps}"
        s += f" block_m={self.block_m}" if self.mode in ("reg", "rows") else ""
        s += f" progs/SM={self.progs}" if self.progs else ""
        return s + (f" split={self.split}" if self.mode == "split" else "")


def norm_plan(M: int, N: int, elsize: int, dev: int) -> tuple[str, int]:
    """(mode, split) of the heuristic plan for x[M, N]; split > 1 only for mode "split"."""
    if N <= NORM_REG_MAX:
        return "reg", 1
    sms = num_sms(dev)
    if 2 * sms > M:
        split = min(max(2, (NORM_SPLIT_PROGRAMS_PER_SM * sms) // M), max(2, N // 8192))
        return "split", split
    return "reload", 1


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


def norm_default(M: int, N: int, elsize: int, dev: int, step_bytes: int, step_vecs: int) -> NormConfig:
    """The heuristic config (no measurement): small problems, the interpreter, CUDA-graph capture."""
    mode, split = norm_plan(M, N, elsize, dev)
    if mode == "reg":
        bm, bn, nw = norm_reg_tile(M, N, elsize, dev)
        return NormConfig("reg", bn, nw, block_m=bm)
    if mode == "split":
        step_bytes, step_vecs = _split_step(step_bytes, step_vecs)
    block = norm_block(elsize, step_bytes)
    nw = norm_stream_warps(block, elsize, step_vecs, dev)
    if mode == "reload":
        return NormConfig("reload", block, nw, progs=NORM_RELOAD_PROGS)
    return NormConfig("split", block, nw, split=split)


def _split_step(step_bytes: int, step_vecs: int) -> tuple[int, int]:
    # "split" steps are capped at 16 KB / 2 vectors per thread: its normalize kernel at 32 KB / 4 vectors
    # spilled 32 VGPRs on gfx942 (AOT); it runs only for M < 2 x SMs rows, where the step size hardly matters.
    return min(step_bytes, 16384), min(step_vecs, 2)


def norm_forced(
    M: int, N: int, elsize: int, dev: int, step_bytes: int, step_vecs: int, **force: int | str | None
) -> NormConfig | None:
    """The tests' private overrides (`mode`, `split`, `block`, `num_warps`, `block_m`, `progs`) applied to
    the heuristic config of the forced mode; None when nothing is forced."""
    if all(v is None for v in force.values()):
        return None
    mode = force.get("mode") or norm_plan(M, N, elsize, dev)[0]
    if mode == "coop":
        if not coop_supported():
            raise ValueError("norm mode 'coop' needs a compiled GPU kernel with cooperative launches")
        progs, chunk_bytes, threads = NORM_COOP_SETS["rms_norm"][0]
        cfg = NormConfig("coop", chunk_bytes // elsize, max(1, threads // warp_size(dev)), progs=progs)
    elif mode in ("reg", "rows"):
        bm, bn, nw = norm_reg_tile(M, N, elsize, dev)
        cfg = NormConfig(mode, bn, nw, block_m=bm, progs=NORM_ROWS_PROGS if mode == "rows" else 0)
    else:
        if mode == "split":
            step_bytes, step_vecs = _split_step(step_bytes, step_vecs)
        block = norm_block(elsize, step_bytes)
        nw = norm_stream_warps(block, elsize, step_vecs, dev)
        planned_split = norm_plan(M, N, elsize, dev)[1]
        cfg = NormConfig(mode, block, nw, progs=NORM_RELOAD_PROGS if mode == "reload" else 0,
                         split=max(2, planned_split) if mode == "split" else 1)  # fmt: skip
    repl = {k: v for k, v in force.items() if k != "mode" and v is not None}
    return dataclasses.replace(cfg, **repl)


# Candidates the tuner times. Sizes are in threads and 16-byte vectors per thread, so a 64-wide AMD wave
# gets half the warps. Each keeps 1-4 vectors of x per thread in flight; the persistent ones keep
# progs x threads <= NORM_PERSIST_THREADS. AOT on sm_90: none spills, all persistent ones <= 64 registers.
# "reload" entries: (programs per SM, step bytes, threads); the rows in flight (programs per SM, at most
# what NORM_SM_THREADS allows resident, x SMs x row bytes) stay within NORM_RELOAD_L2_FRACTION of the L2.
# 16 programs per SM is in effect a grid of one program per row with the hardware keeping as many resident
# as fit (torch.compile's layer_norm: one row per program, two passes, the second from L2): H100 probe at
# 3bd9701 (.dev/s/reload_probe.py, bf16, 2^28 elements, % of the copy rate; the tuned pick's config first):
# layer_norm 16384x16384 16 KB step/512 threads at 2 per SM 94.7, at 16 per SM 96.4; 8192x32768 88.1 -> 91.8
# (torch.compile 81.9); rms_norm 8192x32768 32 KB step/512 threads at 1 per SM 97.5, at 16 per SM 100.0.
# Rows longer than that share per SM (N >= 131072 bf16 on the H100's 50 MB) get only the default, and run at
# 64-69 % of the copy ceiling. Not from L2 thrash: capping the grid so the rows in flight fit the L2 (tried,
# 2acb83f, reverted) timed 514.5 vs 514.5 us at 2048 x 131072 (120 programs) and 591 vs 551 at 1024 x 262144
# (60), H100, same process.
NORM_RELOAD_SET = ((1, 32768, 1024), (2, 16384, 512), (2, 8192, 256), (4, 8192, 256), (16, 16384, 512),
                   (16, 32768, 512))  # fmt: skip
# "loop3" (layer_norm without a fused residual, rows of 16-64 KB; FUSEKIT_NORM_LOOP3=0 leaves it out):
# one program per row, three passes of one fp32 accumulator each (sum, centred squares, y), the
# last two from L2 - torch.compile's layer_norm, which ran 16384 x 16384 / 8192 x 32768 bf16 on the H200 in
# 260 / 278 us (4 KB step / 512 threads and 32 KB / 1024; 31-32 registers) where the tuner's best took
# 278 / 317 ("rows" / "reload", 187ab72). N is a constexpr: with a constant trip count ptxas unrolls the
# passes (sm_90 PTX: 19 global loads per thread, one branch, as Inductor's kernel, whose N is a constant
# too); with a runtime N (2e48b9a: 5 loads, 6 branches, one step in flight per thread) it ran 311-360 us.
# Entries: (step bytes, threads); 32 KB / 1024 threads compiled to 48 registers here (1 program per SM).
# Tuned beside the other modes on the H200 at 3013609 (gpu_checks/norms.py --loop3, same process as
# torch.compile): 16384 x 16384 257.2 us (8 KB step / 512 threads) vs 278.9 without it and 261.5 for torch.compile;
# 8192 x 32768 262.8 (16 KB / 1024) vs 316.4 and 277.2; 32768 x 8192 still picks "reg" (260.7 vs 260.6).
NORM_LOOP3_SET = ((4096, 512), (8192, 512), (16384, 1024))
NORM_LOOP3_ROW_BYTES = (16384, 65536)
NORM_LOOP3_ENV = "FUSEKIT_NORM_LOOP3"


def norm_loop3() -> bool:
    """Whether layer_norm's tuner times "loop3" (on unless FUSEKIT_NORM_LOOP3=0)."""
    return os.environ.get(NORM_LOOP3_ENV, "1") != "0"


NORM_SM_THREADS = 2048  # resident threads per SM (sm_90; a gfx942 CU also holds 2048: 32 waves of 64)
NORM_RELOAD_L2_FRACTION = 0.7
# "coop" entries per op (kernels_triton/_coop.py): (programs per SM, chunk bytes, threads), offered for rows
# longer than NORM_COOP_MIN_ROW_BYTES cut into <= COOP_SPLIT_MAX chunks; `coop_fit` caps programs per SM at
# what the compiled kernel's registers allow. H100, bf16, % of the copy rate (device time, L2 flushed,
# .dev/s/coop_probe.py at M x N = 2^28; "reload" and torch.compile in the same process):
#   rms_norm   N=65536: reload 83.5, coop 64 KB/1024 threads 79.6, 64 KB/512 76.8, 32 KB chunks 68-70
#              N=131072: reload 70.3, coop 64 KB/1024 80.8, 64 KB/512 78.3 (torch.compile 65.8)
#              N=262144: reload 65.6, coop 64 KB/1024 79.9, 64 KB/512 76.3 (torch.compile 64.4)
#   layer_norm N=131072: reload 64.2, coop 32 KB/512 64.5; N=262144: 59.1 vs 62.1; 64 KB chunks 50-55
#              (its second statistic and the bias leave fewer registers: ptxas spills at 64 KB chunks).
# H200 (01bd565, same probe): rms_norm N=131072 reload 67.5 vs coop 68.7, N=262144 62.3 vs 67.9; layer_norm's
# coop loses there (48.8-52.1 vs reload 52.5-61.5): the tuner keeps reload.
# Short of the ceiling because a program's next chunk (its only loads in flight while its group waits at
# the barrier, ~1-2 us of atomics) is at most 64 KB per SM. Rows <= 128 KB keep "reload" (its L2 re-read
# still hits there).
NORM_COOP_SETS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "rms_norm": ((1, 65536, 1024), (1, 65536, 512)),
    "layer_norm": ((1, 32768, 512),),
}
NORM_COOP_MIN_ROW_BYTES = 131072 + 1
COOP_SPLIT_MAX = 64  # chunks per row; a row's partials are read in one [COOP_SPLIT_MAX] load


def coop_supported() -> bool:
    """Whether "coop" can run: compiled (not the interpreter, whose sequential programs would spin forever)
    and a Triton with cooperative launches (the driver then refuses a grid that cannot be resident)."""
    if is_interpreter():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # a Triton without the NVIDIA backend
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


PDL_ENABLED = os.environ.get("FUSEKIT_TRITON_PDL", "1") not in ("", "0")


@functools.cache
def pdl_supported(device_index: int = 0) -> bool:
    """Whether a dependent kernel may be launched with programmatic dependent launch (PDL: it starts while
    the kernel before it drains and waits in `gdc_wait` for that kernel's memory): compiled (not the
    interpreter), CUDA (griddepcontrol is PTX; HIP has none), sm_90 or newer, a Triton with the
    `launch_pdl` option. FUSEKIT_TRITON_PDL=0 turns it off (A/B, tests)."""
    if not PDL_ENABLED or is_interpreter() or is_hip() or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except Exception:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_options(pdl: bool) -> dict[str, bool]:
    """Launch options of a kernel that depends on the one before it: `launch_pdl` where PDL is on (passed
    only then: the interpreter and HIP take no such option)."""
    return {"launch_pdl": True} if pdl else {}


# "reg" tiles the tuner times beside the heuristic's (8 KB of x per program, 2 vectors per thread) and its
# 1-vector variant: (tile rows x 2 / the heuristic's, vectors per thread). The H200 probe at 54df273
# (.dev/s/norm_small.py, bf16, M x N = 2^28, % of the copy rate; heuristic first):
#   layer_norm N=512 88.0 | same tile 4 vectors 99.2 | half tile 2 vectors 92.8 | double tile 4 vectors 96.7
#              N=1024 87.7 | 97.2 | 99.9 | 88.6;  N=2048 96.3 | 97.0 | 100.4 | 99.4;  N=4096 96.8 | 96.9 | - | 99.4
#   rms_norm   N=512 98.6 | 97.6 | 99.7 | 97.8;  N=1024 98.7 | 97.9 | 99.9 | 97.9;  N=2048 98.1 | 98.0 | 100.3 | 98.6
#              N=4096 97.5 | 97.2 | - | 97.9  (double tile at 2 vectors, 16 warps: 66-96%, not offered)
# layer_norm's heuristic tile needs 48 registers a thread at 8 warps (rms_norm 39): 5 programs per SM, 40 KB
# of x in flight, where 4 warps of 4 vectors keep 64 KB.
NORM_REG_VARIANTS = ((2, 4), (1, 2), (4, 4))
# "rows" entries: (programs per SM, vectors per thread).
NORM_ROWS_SET = ((2, 2), (1, 1), (1, 2))  # (1, 2) only where the others do not fit (N = 16384 bf16)


# Tried on the H200 (187ab72, tuned afresh beside the default candidates) and removed: register-capped
# "reg" twins (Triton's maxnreg=64; layer_norm's 1 x 16384 / 16-warp tile took 93 registers on Triton 3.6,
# one 512-thread program per SM): 16384 x 16384 429 -> 281 us, but "rows" took 278; one-pass layer_norm
# "reg" twins (Σd, Σd² in one block reduction): 298-308 us there, 319 at 8192 x 32768 against "reload"'s 317.


def norm_candidates(
    M: int,
    N: int,
    elsize: int,
    dev: int,
    first: NormConfig | None = None,
    res: bool = False,
    coop_set: tuple[tuple[int, int, int], ...] = (),
    loop3: bool = False,
) -> list[NormConfig]:
    """Configs the tuner times for x[M, N] (modes "reg", "rows", "reload", "coop"; with `loop3` layer_norm's
    "loop3"), deduplicated: `first` (the op's heuristic config), then the tables above. At most 10 (N
    8192-32768; 13 with loop3), each a JIT compile (~0.5 s) at the first tuned call.
    With a fused residual (`res`: a second input stream and the h store) register tiles of >= 16 elements
    per thread at 1024 threads are left out: they spilled at the 64 registers that leaves (AOT, sm_90)."""
    vec = 16 // elsize
    ws = warp_size(dev)
    cands: list[NormConfig] = [first] if first is not None else []

    def add(c: NormConfig) -> None:
        threads = c.num_warps * ws
        if res and c.mode in ("reg", "rows") and threads >= 1024 and c.block_m * c.block >= 16 * threads:
            return
        if c not in cands:
            cands.append(c)

    bn = next_pow2(N)
    if N <= NORM_REG_MAX:
        bm, bn, nw = norm_reg_tile(M, N, elsize, dev)
        add(NormConfig("reg", bn, nw, block_m=bm))
        tile = bm * bn
        threads = tile // vec  # the heuristic holds 2 vectors per thread; also try 1 (more threads)
        if threads <= 1024:
            add(NormConfig("reg", bn, threads // ws, block_m=bm))
        # Fewer, fuller threads and other tile heights (NORM_REG_VARIANTS): on the H200 the heuristic's
        # 8 KB / 8 warps ran layer_norm at 88% of the copy rate for N 512-1024, 4 warps at 97-100%.
        for rows_mul, vecs in NORM_REG_VARIANTS:
            vbm = bm * rows_mul // 2
            threads = vbm * bn // (vecs * vec)
            if vbm >= 1 and 4 * ws <= threads <= 1024:
                add(NormConfig("reg", bn, threads // ws, block_m=vbm))
        n_rows = 0
        for progs, vecs in NORM_ROWS_SET:
            threads = tile // (vecs * vec)
            if n_rows < 2 and 4 * ws <= threads and progs * threads <= NORM_PERSIST_THREADS:
                add(NormConfig("rows", bn, threads // ws, block_m=bm, progs=progs))
                n_rows += 1
    elif bn <= 1024 * 4 * vec and bn * elsize <= 65536:  # a row still fits 1024 threads x 4 vectors
        add(NormConfig("reg", bn, 1024 // ws, block_m=1))
    row_bytes = N * elsize
    l2 = l2_bytes(dev)
    for progs, step_bytes, threads in NORM_RELOAD_SET:
        resident = min(progs, NORM_SM_THREADS // threads)
        if row_bytes < step_bytes or resident * num_sms(dev) * row_bytes > NORM_RELOAD_L2_FRACTION * l2:
            continue
        add(NormConfig("reload", step_bytes // elsize, max(1, threads // ws), progs=progs))
    lo, hi = NORM_LOOP3_ROW_BYTES
    if loop3 and not res and lo <= row_bytes <= hi:
        for step_bytes, threads in NORM_LOOP3_SET:
            if step_bytes <= row_bytes:
                add(NormConfig("loop3", step_bytes // elsize, max(1, threads // ws)))
    if row_bytes >= NORM_COOP_MIN_ROW_BYTES and coop_supported():
        for progs, chunk_bytes, threads in coop_set:
            # (a GPU with too few SMs for the grid: coop_groups raises and the tuner drops the candidate)
            if -(-row_bytes // chunk_bytes) <= COOP_SPLIT_MAX:
                add(NormConfig("coop", chunk_bytes // elsize, max(1, threads // ws), progs=progs))
    return cands


@functools.cache
def l2_bytes(device_index: int = 0) -> int:
    """L2 cache size (60 MB on the H200); a stand-in on the CPU."""
    if is_interpreter() or not torch.cuda.is_available():
        return 60 << 20
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 60 << 20))


def norm_grid(cfg: NormConfig, M: int, dev: int) -> int:
    """Programs to launch: one per row tile ("reg", "loop3"), or a persistent grid of progs x SMs ("rows"/"reload")."""
    tiles = -(-M // cfg.block_m)
    return tiles if cfg.mode in ("reg", "loop3") else max(1, min(tiles, cfg.progs * num_sms(dev)))


def norm_should_tune(x: torch.Tensor) -> bool:
    """Tune (time candidates) only for large CUDA problems outside graph capture; FUSEKIT_NORM_TUNE=0 never."""
    if is_interpreter() or not x.is_cuda or x.numel() < NORM_TUNE_MIN_ELEMS:
        return False
    if os.environ.get("FUSEKIT_NORM_TUNE", "1") == "0":
        return False
    return not torch.cuda.is_current_stream_capturing()


_NORM_TUNED: dict[tuple, NormConfig] = {}
# Every first-use measured choice of this process, in order ("<what> <key>: <choice>"): the benchmarks
# record the entries a case's first call added, so a committed row says which config it timed.
TUNING_LOG: list[str] = []


def note_tuned(what: str, key: object, choice: str) -> None:
    if len(TUNING_LOG) >= 4096:
        del TUNING_LOG[:2048]
    TUNING_LOG.append(f"{what} {key}: {choice}")


_NORM_SELECTED: dict[tuple, NormConfig] = {}  # (op key, M, device, step, res) -> the config norm_select chose


def norm_m_bucket(M: int, dev: int) -> int:
    """Rows per SM as a power of two capped at 16: the tuning key's only dependence on M."""
    return min(16, next_pow2(-(-M // num_sms(dev))))


NORM_NOT_FORCED = (None,) * 6  # the launchers' private config overrides (tests), all absent


def norm_selected(key: tuple, x: torch.Tensor, step: tuple[int, int], res: bool = False) -> NormConfig | None:
    """The config norm_select decided before for this exact problem, or None: the launchers' hot path
    (no closures, no force dict) before they fall back to norm_select."""
    return _NORM_SELECTED.get(_selected_key(key, x, step, res))


def _selected_key(key: tuple, x: torch.Tensor, step: tuple[int, int], res: bool) -> tuple:
    return (key, x.shape[0], x.device, step, res)


def norm_select(
    key: tuple,
    x: torch.Tensor,
    step: tuple[int, int],
    force: dict[str, int | str | None],
    launch: Callable[[NormConfig], None],
    make_check: Callable[[], NormCheck],
    res: bool = False,
) -> NormConfig:
    """The config of one row-norm call on x[M, N] with the op's (step bytes, vectors) streaming step: the
    tests' forced one, else on large CUDA problems the tuned one (key = the op's key prefix + M bucket +
    device), else the heuristic default. `res`: the call fuses a residual add. Shared by rms_norm and
    layer_norm."""
    M, N = x.shape  # (an unforced call decided before never gets here: the launchers ask norm_selected)
    memo_key = _selected_key(key, x, step, res)
    dev = device_index(x)
    es = x.element_size()
    cfg = norm_forced(M, N, es, dev, *step, **force)
    if cfg is not None:
        return cfg
    default = norm_default(M, N, es, dev, *step)
    if default.mode == "split" or not norm_should_tune(x):
        cfg = default
    else:
        coop = NORM_COOP_SETS.get(key[0], ())
        ln = key[0] == "layer_norm"
        cands = norm_candidates(M, N, es, dev, default, res, coop, loop3=ln and norm_loop3())
        cfg = norm_tuned((*key, norm_m_bucket(M, dev), dev), cands, launch, make_check, x.device)
    # Remembered unless the decision depended on a CUDA graph capture (no tuning inside one: a later call
    # outside may tune) or on the FUSEKIT_NORM_TUNE switch, which tests flip.
    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()) and "FUSEKIT_NORM_TUNE" not in os.environ:
        if len(_NORM_SELECTED) >= 4096:
            _NORM_SELECTED.clear()
        _NORM_SELECTED[memo_key] = cfg
    return cfg


def norm_aot_specs(specs: list[tuple]) -> list[tuple]:
    """A norm module's (name, fn, sig, constexprs) specs, deduplicated by name, as aot_triton takes them:
    (name, fn, sig, constexprs, no options, the 16-divisibility attrs)."""
    specs = list({s[0]: s for s in specs}.values())
    return [(name, fn, sig, ce, {}, div16_attrs(sig)) for name, fn, sig, ce in specs]


def norm_aot_configs(
    n: int,
    es: int,
    step: tuple[int, int],
    res: bool = False,
    coop_set: tuple[tuple[int, int, int], ...] = (),
    layer_norm: bool = False,
) -> list[NormConfig]:
    """Every config a row-norm launcher can pick for rows of n (with a fused residual: `res`): the heuristic
    plans and all tuning candidates, layer_norm's opt-in "loop3" included."""
    cfgs = [norm_default(1 << 20, n, es, 0, *step)]
    cands = norm_candidates(1 << 20, n, es, 0, cfgs[0], res, coop_set, loop3=layer_norm)
    cfgs += [c for c in cands if c not in cfgs]
    if n > NORM_REG_MAX:
        cfgs.append(norm_default(4, n, es, 0, *step))  # "split"
    return cfgs


# ---- the tuner's correctness gate -------------------------------------------------------------------------
# A candidate is timed only after its outputs on the caller's own inputs match an fp32 torch reference: a
# kernel that the device's compiler miscompiles (the persistent ones were checked by the CPU interpreter
# and by AOT only) and that runs fast but writes wrong values must never be picked. Bounds on
# ||out - ref|| / ||ref|| (fp32 norms) over the checked rows: a correct kernel differs from the fp32
# reference by the final rounding to the output dtype, at most the unit roundoff per element (so also in
# norm): 2^-8 = 3.9e-3 for bf16, 2^-11 = 4.9e-4 for fp16 (RMS about half that), plus fp32 sum-order noise
# in rstd/mean (~1e-6, which is all an fp32 output shows). The bounds sit 2.5x / 4x / 100x above those
# worst cases, while a real fault (a stale or foreign row, a lost weight, a wrong rstd) errs by O(1) where
# it hits: confined to 1 of the 257 checked rows it still shows as ~1/16 of that. Unwritten (NaN-poisoned)
# elements are caught in every row, checked or not.
NORM_CHECK_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
# Statistics are fp32 in every kernel: rstd agrees to sum-order noise (~1e-6). The mean is measured against
# the rows' RMS, not its own norm: it cancels to ~0 for centred rows while its rounding scales with |x|.
# Layer norm's one-pass "reload"/"split" statistics (shifted by K = x[row, 0]) lose a factor 1 + ((K - mean)
# * rstd)^2 of precision in the variance (6e-8 x that): the bound, far above the usual ~1e-6, stays
# above that unless column 0 is an outlier >~ 180 std away, and still catches an rstd 1% off.
NORM_CHECK_STAT_TOL = 2e-3
# Past NORM_CHECK_FULL_ELEMS elements the reference is computed and compared on NORM_CHECK_ROWS evenly
# spaced rows plus the last (a 16384 x 65536 bf16 x is 2 GB; its fp32 reference would be 4 GB). Every row is
# still checked for unwritten (NaN-poisoned) output, through fp32 row sums (one read of out, M floats).
NORM_CHECK_FULL_ELEMS = 1 << 24
NORM_CHECK_ROWS = 256


@dataclasses.dataclass
class NormCheck:
    """What a tuning candidate must reproduce: the caller's output buffers `outs` (out[M, N] first, then the
    fp32 statistics [M]) and their fp32 reference `refs` on `rows` (None: every row); with a fused residual
    also `h` (h[M, N] = x + residual in x's dtype) and its reference `h_ref` (the same rows)."""

    outs: tuple[torch.Tensor, ...]
    refs: tuple[torch.Tensor, ...]
    rows: torch.Tensor | None
    live: torch.Tensor  # bool [M]: rows with finite input (and params): their outputs must not stay NaN
    tol: float
    row_rms: torch.Tensor | None  # RMS of each checked row of the normalized input: the mean's error scale
    mean_stat: tuple[bool, ...]  # per statistic: is it a mean
    h: torch.Tensor | None = None
    h_ref: torch.Tensor | None = None

    def poison(self) -> None:
        for t in (*self.outs, self.h):
            if t is not None:
                t.fill_(float("nan"))

    def error(self) -> str | None:
        """None when the outputs (written since `poison`) match the reference, else what is wrong."""
        out = self.outs[0]
        unwritten = torch.isnan(out.sum(-1, dtype=torch.float32)) & self.live
        if self.h is not None:
            unwritten |= torch.isnan(self.h.sum(-1, dtype=torch.float32)) & self.live
        for s in self.outs[1:]:
            unwritten |= torch.isnan(s) & self.live
        n_bad = int(unwritten.sum())
        if n_bad:
            return f"{n_bad} of {self.live.numel()} rows left NaN (unwritten)"
        pairs = list(zip(self.outs, self.refs))
        if self.h is not None and self.h_ref is not None:
            pairs.append((self.h, self.h_ref))
        n_stats = len(self.outs) - 1
        for i, (o, r) in enumerate(pairs):
            got = (o if self.rows is None else o.index_select(0, self.rows)).float()
            ok = torch.isfinite(r.reshape(r.shape[0], -1)).all(-1)  # rows the reference itself overflows
            got, r = got[ok], r[ok]
            denom = float(torch.linalg.vector_norm(r))
            is_stat = 0 < i <= n_stats
            if is_stat and i <= len(self.mean_stat) and self.mean_stat[i - 1] and self.row_rms is not None:
                denom = max(denom, float(torch.linalg.vector_norm(self.row_rms[ok])))
            err = float(torch.linalg.vector_norm(got - r)) / (denom if denom > 0 else 1.0)
            tol = NORM_CHECK_STAT_TOL if is_stat else self.tol
            if not err <= tol:  # NaN fails too
                what = "out" if i == 0 else f"statistic {i}" if is_stat else "h (x + residual)"
                return f"{what} relative error {err:.3g} > {tol:g} vs the fp32 torch reference"
        return None


def norm_check(
    x: torch.Tensor,
    outs: tuple[torch.Tensor, ...],
    reference: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    params: tuple[torch.Tensor | None, ...] = (),
    mean_stat: tuple[bool, ...] = (),
    residual: torch.Tensor | None = None,
    h: torch.Tensor | None = None,
) -> NormCheck:
    """The NormCheck of one call: `reference(xin_rows_fp32)` returns (out, stats...) in fp32 for those rows,
    where xin is x, or h = round_x(x + residual) when `residual` is given (then the output `h` is checked
    too); `params` (weight, bias) must be finite for outputs to be expected finite; `mean_stat[i]` marks
    statistic i as a mean (its error is measured against the rows' RMS)."""
    M, N = x.shape
    rows = None
    if M * N > NORM_CHECK_FULL_ELEMS and M > NORM_CHECK_ROWS + 1:
        idx = torch.linspace(0, M - 2, NORM_CHECK_ROWS, dtype=torch.float64).round().long()
        rows = torch.unique(torch.cat([idx, torch.tensor([M - 1])])).to(x.device)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t.index_select(0, rows)

    with torch.no_grad():
        xs = pick(x).float()
        live = torch.isfinite(x.sum(-1, dtype=torch.float32))
        h_ref = None
        if residual is not None:
            xs = (xs + pick(residual).float()).to(x.dtype).float()  # h, rounded to x's dtype as stored
            h_ref = xs
            live &= torch.isfinite(residual.sum(-1, dtype=torch.float32))
        refs = tuple(r.float() for r in reference(xs))
        row_rms = xs.square().mean(-1).sqrt() if any(mean_stat) else None
        for p in params:
            if p is not None and not bool(torch.isfinite(p).all()):
                live &= False
    tol = NORM_CHECK_TOL.get(x.dtype, 1e-4)
    return NormCheck(tuple(outs), refs, rows, live, tol, row_rms, mean_stat, h, h_ref)


def norm_tuned(
    key: tuple,
    candidates: list[NormConfig],
    run: Callable[[NormConfig], None],
    make_check: Callable[[], NormCheck],
    device: torch.device | None = None,
) -> NormConfig:
    """The fastest correct one of `candidates` for `key`, chosen once per process. Every candidate is first
    CHECKED: its outputs, NaN-poisoned before its run, must match an fp32 torch reference of the caller's
    own inputs (`make_check`, built once, at this first use; see NORM_CHECK_TOL); then the survivors are
    TIMED (median device time, L2 flushed between runs, host enqueue time kept out, as the benchmarks
    time: fusekit.device_time.device_ms). A candidate that fails to compile/launch or to match is
    dropped with a RuntimeWarning; if none is left this raises (never a wrong result). `run(cfg)` launches
    the op with `cfg` into the caller's buffers; outputs are pure functions of the inputs, so the re-runs
    are harmless, and the caller launches the chosen config once more after this returns, so the buffers
    end holding its result. `device`: the tensors' GPU, where the candidates are timed (None: the current
    one). TRITON_PRINT_AUTOTUNING=1 prints the times and the choice."""
    hit = _NORM_TUNED.get(key)
    if hit is not None:
        return hit
    check = make_check()
    passed: list[NormConfig] = []
    for cfg in candidates:
        try:
            check.poison()
            run(cfg)  # also compiles, outside the timing
            bad = check.error()
        except Exception as exc:  # a config the compiler or device rejects (resources)
            bad = f"failed: {type(exc).__name__}: {exc}"
        if bad is None:
            passed.append(cfg)
        else:
            warnings.warn(
                f"fusekit norm tuner {key}: dropped {cfg.label()}: {bad}", RuntimeWarning, stacklevel=3
            )
    if not passed:
        raise RuntimeError(
            f"fusekit norm tuner {key}: no candidate produced correct output: {[c.label() for c in candidates]}"
        )
    if len(passed) == 1:  # e.g. rows so long that only the default fits the L2: nothing to time
        _NORM_TUNED[key] = passed[0]
        note_tuned("norm", key, passed[0].label() + " (the only correct candidate)")
        return passed[0]
    from fusekit.device_time import device_ms

    # device time (the host's enqueue time kept out: fusekit.device_time) on the tensors' GPU (`device`,
    # the current one when None)
    timed: list[tuple[float, NormConfig]] = []
    for cfg in passed:
        try:
            timed.append((device_ms(lambda cfg=cfg: run(cfg), device, warmup_ms=5, rep_ms=25), cfg))
        except Exception as exc:
            warnings.warn(
                f"fusekit norm tuner {key}: dropped {cfg.label()}: timing failed: {type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
    if not timed:
        raise RuntimeError(
            f"fusekit norm tuner {key}: no candidate could be timed: {[c.label() for c in passed]}"
        )
    best_t, best = min(timed, key=lambda tc: tc[0])
    if os.environ.get("TRITON_PRINT_AUTOTUNING"):
        table = "; ".join(f"{c.label()}: {t * 1e3:.1f} us" for t, c in timed)
        print(f"[fusekit norm tune] {key}: best {best.label()} {best_t * 1e3:.1f} us | {table}", flush=True)
    _NORM_TUNED[key] = best
    note_tuned("norm", key, f"{best.label()} ({best_t * 1e3:.1f} us of {len(timed)} timed)")
    return best


ALIGNED_INTS = ("N", "K", "D", "F")  # row strides/extents the AOT variants assume are multiples of 16


def div16_attrs(sig: dict[str, str]) -> dict[tuple[int], list[list]]:
    """ASTSource attrs marking every pointer (and the row-stride ints) 16-divisible, as Triton's JIT does
    for aligned torch tensors; without them there is no cp.async/TMA pipelining (1-stage shared memory).
    A runtime using these binaries must check pointer % 16 == 0 and those ints % 16 == 0 first."""
    return {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items())
            if v.startswith("*") or k in ALIGNED_INTS}  # fmt: skip


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t as it is when its last dim is contiguous (kernels read the other dims through strides), else a
    contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


_TILE_KEYS_MAX = 256  # the largest key tile of attention's pointer kernels (forward, decode, dq)


def kv_tile_addressable(t: torch.Tensor) -> torch.Tensor:
    """k or v [B, Hkv, Skv, D] as `last_dim_contiguous` gives it, or a contiguous copy when the offsets within
    one key tile (key in tile x per-key stride, int32 in the kernels: 64-bit only per tile start) would pass
    2^31: a view into a huge buffer, e.g. per-key stride 1.5e8, read the wrong keys or faulted."""
    t = last_dim_contiguous(t)
    if (min(t.shape[2], _TILE_KEYS_MAX) - 1) * t.stride(2) + t.shape[3] >= 2**31:
        return t.contiguous()
    return t
