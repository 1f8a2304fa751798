"""Compile the GPU branch of every fusekit Mojo op ahead of time, for sm_90 and gfx942, on a CPU.

    PYTHONPATH=python python -m fusekit.aot_mojo [--targets sm_90,gfx942] [--only rope,layer_norm] [--jobs N]
                                                 [--exe DIR]   # also build runnable sm_90 harness exes

`mojo precompile` and MAX CPU graphs never elaborate `execute["gpu"]`, so GPU-branch errors (an `Int`
kernel capture, a WARP_SIZE assumption, a bad intrinsic for gfx942) only show when the GPU code is
built. Each op provides a harness entry `mojo/harness/run_<op>.mojo` defining `def run() raises` that
calls `<Op>.execute["gpu"]` for every dtype variant (and, on a GPU, checks and times it). For each entry
this tool writes a two-line `main`, runs `mojo build --emit asm --target-accelerator <target>` and
checks that the package's kernels came out as sidecar files (`.ptx` for NVIDIA, `.amdgcn` for AMD),
one per kernel instantiation, and that no sm_90 kernel's setmaxnreg counts exceed its register pool (a
hang). New ops are picked up by adding their `run_<op>.mojo`.
Exit status is non-zero if any build fails or produces no kernel of the package.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TARGETS = {"sm_90": ".ptx", "gfx942": ".amdgcn"}
# runtime libraries an AOT-built exe needs on a GPU host without MAX (MOJO_FACTS §3.3)
RUNTIME_LIBS = (
    "libKGENCompilerRTShared.so",
    "libAsyncRTMojoBindings.so",
    "libMSupportGlobals.so",
    "libAsyncRTRuntimeGlobals.so",
    "libNVPTX.so",
)
_ROOT = Path(__file__).resolve().parents[2]


def find_mojo() -> Path:
    """The `mojo` next to this Python (a venv's bin/) or on PATH."""
    here = Path(sys.executable).parent / "mojo"
    if here.exists():
        return here
    found = shutil.which("mojo")
    if found is None:
        raise FileNotFoundError("mojo not found next to sys.executable or on PATH (pip install mojo==1.2.0)")
    return Path(found)


def find_package() -> Path:
    """The Mojo op package: mojo/ in a source checkout, fusekit/_mojo when installed."""
    for cand in (_ROOT / "mojo", Path(__file__).resolve().parent / "_mojo"):
        if (cand / "__init__.mojo").exists():
            return cand
    raise FileNotFoundError("fusekit Mojo package (mojo/__init__.mojo) not found")


def runtime_lib_dir() -> Path:
    import modular  # a namespace package shipped by the `mojo`/`max` wheels

    for base in modular.__path__:
        if (Path(base) / "lib" / RUNTIME_LIBS[0]).exists():
            return Path(base) / "lib"
    raise FileNotFoundError(f"{RUNTIME_LIBS[0]} not found under {list(modular.__path__)}")


def harness_ops(pkg: Path) -> list[str]:
    return sorted(p.stem[len("run_") :] for p in (pkg / "harness").glob("run_*.mojo"))


def _stage(pkg: Path, work: Path) -> Path:
    """-I root where the package is importable as `mojo` (it is `fusekit._mojo` when installed)."""
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    link = src / "mojo"
    if not link.exists():
        link.symlink_to(pkg, target_is_directory=True)
    return src


def _write_main(src: Path, work: Path, op: str) -> Path:
    main = work / f"main_{op}.mojo"
    main.write_text(f"from mojo.harness.run_{op} import run\n\n\ndef main() raises:\n    run()\n")
    return main


# setmaxnreg moves registers between a block's warpgroups inside the allocation the block got at launch; an
# `inc` past that pool waits forever (a hang, not an error: a build with 32 + 2 x 240 at 384 threads hung on
# the H200), so every sm_90 kernel that uses it is checked here, on the CPU, before it can reach a GPU.
_MAXNTID = re.compile(r"\.maxntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")


def block_threads(ptx: str) -> int | None:
    """Threads per block a kernel's PTX declares (.maxntid x[, y[, z]]), or None without one."""
    m = _MAXNTID.search(ptx)
    if m is None:
        return None
    threads = 1
    for g in m.groups():
        threads *= int(g) if g else 1
    return threads


def setmaxnreg_problem(ptx: str) -> str | None:
    """Why one kernel's setmaxnreg counts may not fit its block's register pool, or None. The model is this
    package's (FlashAttention-3's) layout: one warpgroup decreases to P, every other one increases to C. The
    pool is the entry count ptxas gives each thread, 65536 / threads rounded down to a multiple of 8 (at most
    248), times the threads; ptxas only knows that count (and otherwise ignores setmaxnreg, info C7508) when
    the kernel declares .maxntid and .minnctapersm."""
    counts = {"inc": [], "dec": []}
    for kind, n in _SETMAXNREG.findall(ptx):
        counts[kind].append(int(n))
    if not counts["inc"] and not counts["dec"]:
        return None
    threads = block_threads(ptx)
    if threads is None or ".minnctapersm" not in ptx:
        return "setmaxnreg without .maxntid and .minnctapersm: ptxas ignores it (C7508)"
    if threads % 128:
        return f"setmaxnreg in a block of {threads} threads, not whole warpgroups"
    entry = min(248, (65536 // threads) // 8 * 8)
    p = max(counts["dec"], default=entry)
    c = max(counts["inc"], default=entry)
    need = 128 * (p + c * (threads // 128 - 1))
    if need > entry * threads:
        return (
            f"setmaxnreg over the block's register pool: 128 x ({p} + {threads // 128 - 1} x {c}) = {need} "
            f"> {entry} x {threads} threads = {entry * threads} (setmaxnreg.inc would wait forever)"
        )
    return None


def build_one(mojo: Path, src: Path, work: Path, op: str, target: str) -> dict:
    """Build one harness entry for one target with --emit asm; count the package's kernel sidecars."""
    main = _write_main(src, work, op)
    out_dir = work / target / op
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cmd = [str(mojo), "build", "--emit", "asm", "--target-accelerator", target, "-I", str(src), str(main)]
    cmd += ["-o", str(out_dir / f"main_{op}.s")]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.time() - t0
    side = [p.name for p in out_dir.glob(f"*{TARGETS[target]}")]
    # sidecars are named <stem>_<module path>_<kernel>_...; keep kernels of the op package, not the harness
    kernels = [n for n in side if "_mojo_" in n and "_mojo_harness_" not in n]
    log = (proc.stdout + proc.stderr).strip()
    errors = [ln for ln in log.splitlines() if "error" in ln and "Crashpad" not in ln]
    problems = []  # a kernel whose setmaxnreg would hang (the build itself succeeded)
    if target == "sm_90":
        for name in kernels:
            problem = setmaxnreg_problem((out_dir / name).read_text(errors="replace"))
            if problem:
                problems.append(f"{name}: {problem}")
    errors += problems
    ok = proc.returncode == 0 and len(kernels) > 0 and not problems
    return {
        "op": op,
        "target": target,
        "ok": ok,
        "secs": secs,
        "kernels": len(kernels),
        "log": log,
        "errors": errors,
        "dir": str(out_dir),
    }


def build_exe(mojo: Path, src: Path, work: Path, op: str, dest: Path) -> dict:
    """A runnable sm_90 harness exe (run it on the GPU host with LD_LIBRARY_PATH=dest)."""
    main = _write_main(src, work, op)
    cmd = [
        str(mojo),
        "build",
        "--target-accelerator",
        "sm_90",
        "-I",
        str(src),
        str(main),
        "-o",
        str(dest / f"run_{op}"),
    ]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return {
        "op": op,
        "target": "sm_90 exe",
        "ok": proc.returncode == 0,
        "secs": time.time() - t0,
        "kernels": -1,
        "log": (proc.stdout + proc.stderr).strip(),
        "errors": [],
        "dir": str(dest),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma list of " + ", ".join(TARGETS))
    ap.add_argument(
        "--only", default="", help="comma list of ops (default: every mojo/harness/run_<op>.mojo)"
    )
    ap.add_argument("--jobs", type=int, default=2, help="parallel mojo builds (each is ~1 core, ~1-2 GB)")
    ap.add_argument("--work", default="", help="keep build outputs here (default: a temp dir, removed)")
    ap.add_argument("--exe", default="", help="also build runnable sm_90 exes + runtime libs into this dir")
    ap.add_argument("-v", "--verbose", action="store_true", help="print build logs")
    args = ap.parse_args(argv)

    mojo, pkg = find_mojo(), find_package()
    ops = harness_ops(pkg)
    if args.only:
        want = [o.strip() for o in args.only.split(",") if o.strip()]
        missing = sorted(set(want) - set(ops))
        if missing:
            print(f"no harness entry mojo/harness/run_<op>.mojo for: {', '.join(missing)}")
            return 2
        ops = want
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        print(f"unknown target(s) {bad}; known: {list(TARGETS)}")
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fusekit_aot_mojo_"))
    work.mkdir(parents=True, exist_ok=True)
    src = _stage(pkg, work)
    print(f"mojo: {mojo}\npackage: {pkg}\nops: {', '.join(ops)}\ntargets: {', '.join(targets)}")

    jobs = [(op, t) for op in ops for t in targets]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda j: build_one(mojo, src, work, j[0], j[1]), jobs))
    if args.exe:
        dest = Path(args.exe)
        dest.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            results += list(pool.map(lambda op: build_exe(mojo, src, work, op, dest), ops))
        libdir = runtime_lib_dir()
        for lib in RUNTIME_LIBS:
            shutil.copy2(libdir / lib, dest / lib)

    print(f"\n{'op':<14}{'target':<11}{'ok':<6}{'seconds':>8}{'kernels':>9}")
    for r in results:
        k = "" if r["kernels"] < 0 else str(r["kernels"])
        print(f"{r['op']:<14}{r['target']:<11}{'yes' if r['ok'] else 'NO':<6}{r['secs']:>8.1f}{k:>9}")
    failed = [r for r in results if not r["ok"]]
    for r in results:
        if args.verbose or not r["ok"]:
            print(f"\n--- {r['op']} {r['target']} ({r['dir']}) ---")
            shown = r["errors"] or r["log"].splitlines()
            print("\n".join(shown[:40]) or "(no output; no kernel sidecar of the package was produced)")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\naot_mojo: {len(results) - len(failed)}/{len(results)} builds ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
