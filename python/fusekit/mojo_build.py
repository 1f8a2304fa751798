"""`python -m fusekit.mojo_build`: compile every Mojo op phase ahead of time into fusekit's cache.

    python -m fusekit.mojo_build [--device cuda|cuda:N|cpu] [--ops rms_norm,rope] [--phases forward,backward]
                                 [--dtypes bfloat16,float32] [--jobs N] [--list]

The mojo backend compiles one shape-generic MAX graph per op phase x dtypes x device on first use and keeps
it on disk (fusekit/backends/mojo/runtime.py: ~10-20 s each on a GPU host, plus one `mojo precompile` of
the op's compile unit: its file and the files it imports). This walks every entry a call can need — each op's forward and backward over the
dtype combinations the backend runs (MojoBackend.supports: no float64 input; fp32 attention is CPU-only),
for swiglu_ffn's backward its element-wise op and the rms_norm backward it calls, and on a GPU one entry per
value of each compile-time shape parameter (attention: one per head dim, specs.PARAM_VALUES) — and loads or builds
each, so that later processes' first calls are cache loads (--jobs N: N processes, each every N-th
entry; each compile unit is precompiled once, a worker that needs it while another builds it waits on its
lock; the lazy subpackage mojo/tc/ of fusekit.swiglu_ffn_tc, an NVIDIA bf16 entry, is one such unit). One line per entry
(`compiled`, `cached` or the error) and a summary; exit status 1 if any entry failed. Concurrent runs (and concurrent first calls
of user processes) are safe: the cache's per-artifact locks make the second one wait and load.
Cache location: $FUSEKIT_CACHE_DIR, else ~/.cache/fusekit.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass

import torch

PHASES = ("forward", "backward")


@dataclass(frozen=True)
class Entry:
    """One compiled artifact: a MAX op spec (specs.OpSpec) at one dtype key and compile-time parameters."""

    op: str
    phase: str
    spec: object
    dtypes: tuple[torch.dtype, ...]
    parameters: tuple[tuple[str, int], ...] = ()  # e.g. (("head_dim", 128),): attention on a GPU

    def label(self) -> str:
        names = ",".join(str(d).removeprefix("torch.") for d in self.dtypes)
        names += "".join(f", {k}={v}" for k, v in self.parameters)
        return f"{self.spec.max_op} ({names})"


def entries(
    device: torch.device,
    ops: list[str] | None = None,
    phases: tuple[str, ...] = PHASES,
    dtypes: set[torch.dtype] | None = None,
) -> list[Entry]:
    """Every (MAX op, dtypes) a call on `device` can compile, for the chosen ops, phases and dtypes: the
    dtype keys of each phase that the mojo backend says it runs (MojoBackend.supports)."""
    from fusekit import backends
    from fusekit import ops as fops
    from fusekit.backends.mojo import FFN_GEMM_DEVICES, ffn_tc_enabled
    from fusekit.backends.mojo.specs import (
        LINEAR_CROSS_ENTROPY_ROWS,
        NO_KERNEL,
        PARAM_VALUES,
        SWIGLU_FFN_BACKWARD,
        phase_spec,
        swiglu_ffn_tc_spec,
    )

    backend = backends.get("mojo")  # supports() needs no MAX
    out: list[Entry] = []
    seen: set[tuple[str, tuple, tuple]] = set()

    def add(op: str, phase: str, spec, key: tuple[torch.dtype, ...]) -> None:
        # the graphs a call can need: on a GPU one per value of each shape parameter (OpSpec.parameters)
        names = [p for p, _, _ in spec.shape_params] if device.type != "cpu" else []
        for values in itertools.product(*(PARAM_VALUES[p] for p in names)):
            params = tuple(zip(names, values))
            if (spec.max_op, key, params) not in seen:
                seen.add((spec.max_op, key, params))
                out.append(Entry(op, phase, spec, key, params))

    order = lambda keys: sorted(keys, key=lambda k: [str(d) for d in k])  # a stable listing
    for op in ops or list(fops.OPS):
        if op in NO_KERNEL:
            continue  # no Mojo kernel to build
        for phase in phases:
            if phase == "backward" and fops.SPECS[op].backward is None:
                continue  # reduce_sum: its gradient is a view of the output's, no kernel
            spec = phase_spec(op, phase)
            for key in order(spec.allowed):
                if backend.supports(op, phase, device, key, head_dim=64) is not None:
                    continue
                if dtypes is not None and not set(key) <= dtypes:
                    continue
                if op == "attention" and device.type == "cuda" and key[0] == torch.float32:
                    continue  # ops.attention refuses it before any kernel (fp32 attention is a CPU path)
                if op == "linear_cross_entropy":
                    # what the backend runs for it: the per-chunk row kernel between torch matmuls; its
                    # backward is torch multiplies (nothing to build)
                    if phase == "forward":
                        add(op, phase, LINEAR_CROSS_ENTROPY_ROWS, key[:1])
                elif op == "swiglu_ffn" and phase == "forward":
                    # the Mojo op (decode); on a GEMM-route device the rms_norm op and the element-wise op
                    # (forming h) that prefill runs between vendor matmuls; the wgmma twin for bf16 prefill
                    # at a static pair where it is switched on (ffn_tc_enabled; built from mojo/tc/)
                    add(op, phase, spec, key)
                    if device.type in FFN_GEMM_DEVICES:  # h only: no norm_weight (a dummy in x's dtype)
                        add(op, phase, SWIGLU_FFN_BACKWARD, key[:1] * 2)
                    if (
                        ffn_tc_enabled()
                        and device.type == "cuda"
                        and key[0] == torch.bfloat16
                        and torch.version.hip is None
                    ):
                        add(op, phase, swiglu_ffn_tc_spec(), key)
                    add(op, phase, phase_spec("rms_norm", "forward"), key)  # (x, norm_weight)
                elif op == "swiglu_ffn" and phase == "backward":
                    # what the backend runs for it: its element-wise op and the rms_norm backward (both
                    # with norm_weight's dtype) between torch matmuls
                    add(op, phase, SWIGLU_FFN_BACKWARD, key)
                    add(op, phase, phase_spec("rms_norm", "backward"), key)
                else:
                    add(op, phase, spec, key)
    return out


def build(device: torch.device, todo: list[Entry], log=print) -> int:
    """Loads or compiles every entry; returns how many failed."""
    from fusekit import backends

    backend = backends.get("mojo")
    why = backend.unavailable_reason()
    if why is not None:
        log(f"fusekit.mojo_build: the mojo backend is unavailable: {why}")
        return len(todo) or 1
    compiler = backend.compiler
    registered = backend.registered()
    failed = 0
    t_all = time.perf_counter()
    for e in todo:
        if e.spec.max_op not in registered:
            log(f"  skipped   {e.label()}: not registered by the package {compiler.package}")
            continue
        before = compiler.stats.graph_compiles
        t0 = time.perf_counter()
        try:
            compiler.get(e.spec, e.dtypes, device, e.parameters)
        except Exception as exc:  # reported, the others still build
            failed += 1
            log(f"  FAILED    {e.label()}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        what = "compiled" if compiler.stats.graph_compiles > before else "cached"
        log(f"  {what:9s} {e.label()}  {time.perf_counter() - t0:.1f} s")
    s = compiler.stats
    log(
        f"fusekit.mojo_build: {len(todo)} entries on {device} in {time.perf_counter() - t_all:.1f} s: "
        f"{s.graph_compiles} compiled, {s.mef_loads} loaded from the cache, {failed} failed "
        f"(cache: {compiler.cache})"
    )
    return failed


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fusekit.mojo_build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when present), cuda:N or cpu")
    ap.add_argument("--ops", default=None, help="comma list (default: every op)")
    ap.add_argument("--phases", default=",".join(PHASES), help="forward,backward")
    ap.add_argument(
        "--dtypes",
        default=None,
        help="build only entries all of whose dtypes are listed, e.g. bfloat16,float32",
    )
    ap.add_argument("--list", action="store_true", help="print the entries and exit")
    ap.add_argument(
        "--jobs", type=int, default=1, help="build in N processes (each takes every N-th entry; default 1)"
    )
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # "k/N": a --jobs worker's share
    return ap


def _parallel(argv: list[str], jobs: int) -> int:
    """Runs this command in `jobs` worker processes (--shard k/jobs), their output passed through. The
    workers get the same arguments plus `--jobs 1` (argparse keeps the last value, whatever spelling
    the caller used), so a worker never spawns workers of its own."""
    import subprocess

    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fusekit.mojo_build", *argv, "--jobs", "1", "--shard", f"{k}/{jobs}"]
        )
        for k in range(jobs)
    ]
    return max(p.wait() for p in procs)


def main(argv: list[str] | None = None) -> int:
    from fusekit import ops as fops

    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.jobs > 1 and not args.list and not args.shard:
        return _parallel(argv, args.jobs)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    ops = [o for o in args.ops.split(",") if o] if args.ops else None
    phases = tuple(p for p in args.phases.split(",") if p)
    bad = [o for o in ops or [] if o not in fops.OPS] + [p for p in phases if p not in PHASES]
    dtypes = None
    if args.dtypes:
        dtypes = set()
        for name in args.dtypes.split(","):
            dt = getattr(torch, name, None)
            if not isinstance(dt, torch.dtype):
                bad.append(name)
            else:
                dtypes.add(dt)
    if bad:
        print(
            f"unknown ops/phases/dtypes {bad}; ops: {', '.join(fops.OPS)}; phases: {PHASES}", file=sys.stderr
        )
        return 2
    todo = entries(device, ops, phases, dtypes)
    if args.shard:
        k, n = (int(v) for v in args.shard.split("/"))
        todo = todo[k::n]
    if args.list:
        for e in todo:
            print(f"{e.op:11s} {e.phase:8s} {e.label()}")
        return 0
    return 1 if build(device, todo) else 0


if __name__ == "__main__":
    sys.exit(main())
