"""Registers, spills and resident threads per SM of built sm_90 kernels: a development aid, not a CI check.

    PYTHONPATH=python python -m fusekit.aot_mojo --targets sm_90 --work /tmp/aot
    PYTHONPATH=python python -m fusekit.mojo_occupancy /tmp/aot/sm_90 [--all]

Runs `ptxas -arch=sm_90a -v` on every kernel sidecar (`*.ptx`, one per instantiation) and lists those whose
registers or static shared memory leave fewer than 1024 resident threads per SM (`--all`: every kernel).
Memory-bound kernels sized for ~1024-2048 resident threads lose their latency hiding there: b5f625f took
mojo rope's 16-byte kernels from 122-128 to 154-164 registers, one 256-thread block per SM instead of two,
and B16 S4096 H32 D128 from 309 to 402 us on the H200. A kernel that declares `.minnctapersm` (nvvm.minctasm)
chose its count; it is marked "declared". Dynamic shared memory is not in the PTX and not counted.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fusekit.aot_mojo import block_threads

REGS_PER_SM = 65536
REG_UNIT = 256  # registers are allocated per warp in units of 256 (8 per thread)
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024
WARP = 32


@dataclass
class KernelUse:
    name: str
    threads: int  # threads per block (.maxntid)
    registers: int
    spill_bytes: int
    smem_bytes: int  # static shared memory
    min_blocks: int | None  # .minnctapersm, when declared

    @property
    def blocks_per_sm(self) -> int:
        warps = -(-self.threads // WARP)
        per_warp = -(-self.registers * WARP // REG_UNIT) * REG_UNIT
        by_regs = REGS_PER_SM // max(1, per_warp * warps)
        by_threads = MAX_THREADS_PER_SM // self.threads
        by_smem = SMEM_PER_SM // (self.smem_bytes + SMEM_RESERVED_PER_BLOCK)
        return min(by_regs, by_threads, by_smem, MAX_BLOCKS_PER_SM)

    @property
    def threads_per_sm(self) -> int:
        return self.blocks_per_sm * self.threads


def parse(ptx: str, ptxas_log: str) -> KernelUse | None:
    """The kernel's use from its PTX (entry name, .maxntid, .minnctapersm) and `ptxas -v`'s log."""
    entry = re.search(r"\.entry\s+(\w+)", ptx)
    threads = block_threads(ptx)
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    if not (entry and threads and regs):
        return None
    spill = re.search(r"(\d+) bytes spill stores", ptxas_log)
    smem = re.search(r"(\d+) bytes smem", ptxas_log)
    minc = re.search(r"\.minnctapersm\s+(\d+)", ptx)
    return KernelUse(
        entry.group(1),
        threads,
        int(regs.group(1)),
        int(spill.group(1)) if spill else 0,
        int(smem.group(1)) if smem else 0,
        int(minc.group(1)) if minc else None,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="a folder of sm_90 kernel sidecars (aot_mojo --work DIR: DIR/sm_90)")
    ap.add_argument(
        "--all", action="store_true", help="list every kernel, not only those under 1024 threads/SM"
    )
    args = ap.parse_args(argv)
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        print("ptxas not found on PATH (CUDA toolkit or the nvidia-cuda-nvcc wheel)")
        return 2
    rows = []
    for f in sorted(Path(args.dir).rglob("*.ptx")):
        proc = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(f), "-o", "/dev/null"], capture_output=True, text=True
        )
        use = parse(f.read_text(errors="replace"), proc.stdout + proc.stderr)
        if use is not None and (args.all or use.threads_per_sm < 1024):
            rows.append((f.parent.name, use))
    print(f"{'op':<22}{'threads':>8}{'regs':>6}{'spill':>7}{'smem':>7}{'blocks/SM':>10}{'thr/SM':>8}  kernel")
    for op, u in sorted(rows, key=lambda r: (r[0], r[1].threads_per_sm)):
        note = f"  (declared {u.min_blocks})" if u.min_blocks is not None else ""
        print(
            f"{op:<22}{u.threads:>8}{u.registers:>6}{u.spill_bytes:>7}{u.smem_bytes:>7}{u.blocks_per_sm:>10}"
            f"{u.threads_per_sm:>8}  {u.name[:60]}{note}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
