"""What the Gluon kernel tests share (tests/test_triton_attention_hopper*.py): CPU inputs, the sm_90 gate of the
GPU tests, and the ahead-of-time compile of a module's variants for sm_90 in a child process.

Gluon does not compile under TRITON_INTERPRET=1 (its reductions are jit functions the interpreter swaps for
InterpretedFunction objects), which the CPU test run sets: the compile runs in a child process without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

_COMPILE_ALL = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
specs = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
for name, fn, sig, const, opts in specs():
    try:
        k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)
        ptx = k.asm["ptx"]
        res = {"cubin": bool(k.asm.get("cubin")), "wgmma": "wgmma.mma_async" in ptx,
               "setmaxnreg": "setmaxnreg" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
               "tma_store": "cp.async.bulk.tensor" in ptx and ".global.shared::cta" in ptx}
    except Exception as exc:
        res = {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
    print("RESULT " + json.dumps({"name": name, **res}), flush=True)
"""


def qkv(dtype=torch.bfloat16, B=1, H=4, Hkv=2, S=37, Skv=53, D=64):
    """Seeded CPU q, k, v (the refusal tests: what the kernels must not take)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype)
    return q, k, v


def need_sm90(device: str, has_gluon: bool) -> None:
    """Skip a GPU test, with the reason, unless it can run: --device cuda, Gluon's Hopper module, sm_90."""
    if device != "cuda":
        pytest.skip("the Gluon kernels run on an sm_90 GPU only (--device cuda)")
    if not has_gluon:
        pytest.skip("the installed triton has no Gluon Hopper module")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels need sm_90 (wgmma)")


def spec_params(names: list[str]) -> list:
    """pytest params of the variant names, or one skipped param when this triton has no Gluon."""
    return [pytest.param(n, id=n) for n in names] or [
        pytest.param(None, marks=pytest.mark.skip(reason="the installed triton has no Gluon Hopper module"))
    ]


def compile_all(module: str, specs_fn: str) -> dict[str, dict]:
    """{variant: PTX checks or {"error": ...}} of `module.specs_fn()`, compiled for sm_90 in a child process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ALL, module, specs_fn], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            out[r.pop("name")] = r
    if not out:
        raise AssertionError(f"compile subprocess gave nothing (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return out
