"""Compile every Triton kernel config fusekit can launch, ahead of time, for sm_90 and gfx942, on a CPU.

    PYTHONPATH=python:. python -m fusekit.aot_triton [--jobs N] [--only rope,layer_norm]

Each `kernels_triton/<op>.py` exports `aot_specs()` -> [(name, jit_fn, signature, constexprs[, options])].
Launch options (`num_warps`, `num_stages`, ...) may be given in the optional fifth element or as keys of
`constexprs` that are not kernel arguments; `options["aot_targets"]` (names of TARGETS) limits a spec to
those targets (a CUDA-only feature such as PDL's griddepcontrol has no HIP lowering); they are passed to `triton.compile(..., options=...)`, which
has the same shape in Triton 3.6 and 3.9: `triton.compile(ASTSource(fn, signature, constexprs),
target=GPUTarget(...), options={...})`. Exit status is non-zero if any config fails to produce a cubin
(CUDA) or hsaco (HIP). Needs no GPU and must not run under TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Fusion of a*b+c into FMA is what the launched kernels get on Triton 3.6; say so explicitly (3.9 warns).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

OPTION_KEYS = (
    "num_warps",
    "num_stages",
    "num_ctas",
    "maxnreg",
    "waves_per_eu",
    "matrix_instr_nonkdim",
    "kpack",
)
TARGETS = {"sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
_ROOT = Path(__file__).resolve().parents[2]


def _split_options(fn, constexprs: dict, options: dict | None) -> tuple[dict, dict]:
    args = set(getattr(fn, "arg_names", ()))
    ce, opts = {}, dict(options or {})
    for k, v in constexprs.items():
        if k in OPTION_KEYS and k not in args:
            opts[k] = v
        else:
            ce[k] = v
    return ce, opts


def _cuda_resources(cubin: bytes) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None:
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        tool = str(cand) if cand.exists() else None
    if tool is None:
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res.stdout)
    return f"regs={m[1]} stack={m[2]} local={m[4]}" if m else ""


def _hip_resources(amdgcn: str) -> str:
    f = dict(re.findall(r"\.(vgpr_count|vgpr_spill_count|sgpr_spill_count):\s+(\d+)", amdgcn))
    if not f:
        return ""
    return f"vgprs={f.get('vgpr_count', '?')} spills={f.get('vgpr_spill_count', '0')}/{f.get('sgpr_spill_count', '0')}"


def _compile_one(job: tuple[str, int, str]) -> tuple[str, str, str, bool, str, float]:
    mod_name, idx, tgt_name = job
    t0 = time.time()
    name = f"{mod_name}[{idx}]"
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        spec = importlib.import_module(f"kernels_triton.{mod_name}").aot_specs()[idx]
        name, fn, sig, constexprs = spec[:4]
        ce, opts = _split_options(fn, constexprs, spec[4] if len(spec) > 4 else None)
        only = opts.pop("aot_targets", None)
        if only is not None and tgt_name not in only:
            return name, tgt_name, mod_name, True, f"not built for {tgt_name} (only {', '.join(only)})", 0.0
        target = GPUTarget(*TARGETS[tgt_name])
        attrs = spec[5] if len(spec) > 5 else None  # e.g. tt.divisibility=16 hints that enable pipelining
        k = triton.compile(triton.compiler.ASTSource(fn, sig, ce, attrs), target=target, options=opts)
        binary = "cubin" if target.backend == "cuda" else "hsaco"
        if binary not in k.asm:
            return name, tgt_name, mod_name, False, f"no {binary} in asm ({sorted(k.asm)})", time.time() - t0
        info = (
            _cuda_resources(k.asm["cubin"]) if binary == "cubin" else _hip_resources(k.asm.get("amdgcn", ""))
        )
        shared = getattr(k.metadata, "shared", None)
        info = f"{info} shared={shared}B".strip()
        return name, tgt_name, mod_name, True, info, time.time() - t0
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
        return name, tgt_name, mod_name, False, msg, time.time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="", help="comma-separated module names")
    args = ap.parse_args(argv)
    from kernels_triton._config import is_interpreter

    if is_interpreter():
        print("unset TRITON_INTERPRET: ahead-of-time compilation needs the real compiler", file=sys.stderr)
        return 2
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))
    from fusekit.ops import OPS

    wanted = [m for m in OPS if not args.only or m in args.only.split(",")]
    jobs: list[tuple[str, int, str]] = []
    for mod_name in wanted:
        if importlib.util.find_spec(f"kernels_triton.{mod_name}") is None:
            # every op has a Triton kernel: a missing module is a broken install, not a skip
            print(f"FAIL {mod_name}: kernels_triton/{mod_name}.py is not importable")
            jobs.append((mod_name, -1, "sm_90"))
            continue
        try:
            n = len(importlib.import_module(f"kernels_triton.{mod_name}").aot_specs())
        except Exception as exc:
            print(f"FAIL {mod_name}: aot_specs() raised {type(exc).__name__}: {exc}")
            jobs.append((mod_name, -1, "sm_90"))
            continue
        jobs += [(mod_name, i, t) for i in range(n) for t in TARGETS]
    t0 = time.time()
    ctx = mp.get_context("spawn" if sys.platform == "darwin" else "fork")
    if args.jobs > 1:
        with ctx.Pool(args.jobs) as pool:
            results = pool.map(_compile_one, jobs, chunksize=1)
    else:
        results = [_compile_one(j) for j in jobs]
    width = max((len(r[0]) for r in results), default=10)
    print(f"{'kernel':<{width}}  {'target':<7} {'ok':<4} {'secs':>5}  resources / error")
    for name, tgt, _mod, ok, info, secs in results:
        print(f"{name:<{width}}  {tgt:<7} {'ok' if ok else 'FAIL':<4} {secs:5.1f}  {info}")
    failed = [r for r in results if not r[3]]
    if not results:
        print("no kernels found to compile")
        return 1
    print(
        f"{len(results) - len(failed)}/{len(results)} compiled in {time.time() - t0:.0f} s with {args.jobs} jobs"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
