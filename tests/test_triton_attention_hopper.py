"""The Gluon FA3-style Hopper attention forward (kernels_triton/_attention_hopper.py) on the CPU.

    pytest tests/test_triton_attention_hopper.py

Gluon kernels do not run on the CPU (nor in Triton's interpreter), so this checks what can be checked there:
the module imports without a GPU, `hopper_supported` refuses what the kernel does not take (no GPU, kv_len,
fp32, head dims other than 64/128, non-aligned or empty inputs), and, where the installed Triton has Gluon's
Hopper module, every (dtype, head dim, causal) variant compiles ahead of time for sm_90 down to a cubin with
wgmma instructions. Numerics and speed are checked on an H100 by .dev/s/gluon_probe.py (not in CI).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "python"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _mod():
    from kernels_triton import _attention_hopper

    return _attention_hopper


def _qkv(dtype=torch.bfloat16, B=1, H=4, Hkv=2, S=37, Skv=53, D=64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Skv, D, generator=g).to(dtype)
    return q, k, v


def test_module_imports_without_a_gpu():
    m = _mod()
    assert isinstance(m.HAS_GLUON, bool)
    assert callable(m.hopper_forward) and callable(m.hopper_supported)
    assert set(m.CONFIGS) == set(m.HEAD_DIMS) == {64, 128}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_not_supported_on_the_cpu(dtype):
    assert _mod().hopper_supported(*_qkv(dtype), None) is False


def test_not_supported_with_kv_len():
    q, k, v = _qkv()
    assert _mod().hopper_supported(q, k, v, torch.full((1,), 53, dtype=torch.int32)) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_not_supported_dtypes(dtype):
    assert _mod().hopper_supported(*_qkv(dtype), None) is False


@pytest.mark.parametrize("D", [32, 96, 256])
def test_not_supported_head_dims(D):
    assert _mod().hopper_supported(*_qkv(D=D), None) is False


def test_not_supported_empty():
    assert _mod().hopper_supported(*_qkv(S=0), None) is False
    assert _mod().hopper_supported(*_qkv(Skv=0), None) is False


def test_forward_refuses_unsupported_inputs():
    q, k, v = _qkv()
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    with pytest.raises(ValueError, match="unsupported"):
        _mod().hopper_forward(o, lse, q, k, v, False, 0.125 * 1.4426950408889634)


def _spec_names() -> list:
    names = [s[0] for s in _mod().aot_specs_gluon()]
    return [pytest.param(n, id=n) for n in names] or [
        pytest.param(None, marks=pytest.mark.skip(reason="the installed triton has no Gluon Hopper module"))
    ]


# Gluon does not compile under TRITON_INTERPRET=1 (its reductions are jit functions the interpreter swaps
# for InterpretedFunction objects), which the CPU test run sets: compile in a child process without it.
_COMPILE_ALL = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kernels_triton._attention_hopper import aot_specs_gluon
for name, fn, sig, const, opts in aot_specs_gluon():
    try:
        k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)
        ptx = k.asm["ptx"]
        res = {"cubin": bool(k.asm.get("cubin")), "wgmma": "wgmma.mma_async" in ptx,
               "setmaxnreg": "setmaxnreg" in ptx, "tma": "cp.async.bulk.tensor" in ptx}
    except Exception as exc:
        res = {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
    print("RESULT " + json.dumps({"name": name, **res}), flush=True)
"""


@functools.cache
def _compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ALL], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            out[r.pop("name")] = r
    if not out:
        raise AssertionError(f"compile subprocess gave nothing (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return out


@pytest.mark.parametrize("name", _spec_names())
def test_compiles_ahead_of_time_for_sm90(name):
    """Each (dtype, D, causal) variant compiles to a cubin for sm_90 without a GPU (Triton 3.6 and 3.9): wgmma,
    TMA and the warp-specialized register split (setmaxnreg) are in its PTX."""
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError as exc:  # pragma: no cover - Gluon without its AST source class
        pytest.skip(f"no GluonASTSource in this triton: {exc}")
    r = _compiled()[name]
    assert "error" not in r, r.get("error")
    assert r == {"cubin": True, "wgmma": True, "setmaxnreg": True, "tma": True}, r
