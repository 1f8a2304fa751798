"""Any device (issue #15, item 3): every op × backend on cuda:1 while the current device is cuda:0.

    pytest tests/test_any_device.py --device cuda --backends triton      (needs two GPUs; else skipped)

- Results (forward and input gradients) on cuda:1 equal the same call on cuda:0, lie on cuda:1, the
  current device stays 0, and device 0's caching allocator sees no new allocation during the calls.
- In a fresh process that never touches cuda:0, calls on cuda:1 leave device 0's primary CUDA context
  inactive (no stray context; read with the driver's cuDevicePrimaryCtxGetState).
- Tensors on different GPUs raise a ValueError naming the argument.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cases import module
from checks import assert_close

from fusekit import ops
from fusekit.tolerances import rtol

DTYPE = torch.bfloat16  # every op runs it on CUDA (float32 attention is CPU-only)
REFUSED = ("cannot run", "has no backward here")
TESTS = Path(__file__).resolve().parent
RICH = ("residual", "bias", "norm", "wf32", "tables", "positions", "kv_len", "cache")


@pytest.fixture(scope="module")
def two_gpus(device: str) -> None:
    if device != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs --device cuda and two GPUs (torch.cuda.device_count() >= 2)")
    torch.cuda.set_device(0)


def _cases(op: str) -> list[dict]:
    """A plain case and the one with the most optional tensors (residual, tables, kv_len, ...)."""
    cpu = module(op).CPU
    rich = max(cpu, key=lambda c: sum(bool(c.get(k)) for k in RICH))
    return [cpu[0]] if rich is cpu[0] else [cpu[0], rich]


def _to(v: object, dev: str) -> object:
    return v.detach().to(dev) if isinstance(v, torch.Tensor) else v


def _call(op: str, args: tuple, kwargs: dict, grads_seed: int, backend: str) -> list[torch.Tensor | None]:
    """Forward outputs, then the gradients of every floating input (not rope's cos/sin tables)."""
    fl = lambda v: isinstance(v, torch.Tensor) and v.dtype.is_floating_point
    args = tuple(a.requires_grad_() if fl(a) else a for a in args)
    kwargs = {k: v.requires_grad_() if fl(v) and k not in ("cos", "sin") else v for k, v in kwargs.items()}
    leaves = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    out = getattr(ops, op)(*args, **kwargs, backend=backend)
    outs = out if isinstance(out, tuple) else (out,)
    ys = [o for o in outs if o.requires_grad]
    g = torch.Generator().manual_seed(grads_seed)
    dys = [torch.randn(y.shape, generator=g).to(y.device, y.dtype) for y in ys]
    return [o.detach() for o in outs] + list(torch.autograd.grad(ys, leaves, dys, allow_unused=True))


def _on(args: tuple, kwargs: dict, dev: str) -> tuple[tuple, dict]:
    return tuple(_to(a, dev) for a in args), {k: _to(v, dev) for k, v in kwargs.items()}


def _allocations(dev: int) -> tuple[int, int]:
    """(allocations made so far, bytes allocated now) by the caching allocator of GPU `dev`."""
    return torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0), torch.cuda.memory_allocated(dev)


@pytest.mark.parametrize("op", ops.OPS)
def test_second_gpu_gives_first_gpu_results(op: str, backend_name: str, two_gpus: None) -> None:
    mod = module(op)
    ran = 0
    for j, case in enumerate(_cases(op)):
        torch.manual_seed(j)
        args, kwargs = mod.make(case, DTYPE, "cpu")
        try:
            want = _call(op, *_on(args, kwargs, "cuda:0"), j, backend_name)
        except ValueError as exc:
            if any(r in str(exc) for r in REFUSED):
                continue
            raise
        a1, k1 = _on(args, kwargs, "cuda:1")
        torch.cuda.synchronize(0)
        before = _allocations(0)
        got = _call(op, a1, k1, j, backend_name)  # the first use of its kernels on cuda:1 (load, tune)
        torch.cuda.synchronize(1)
        repro = f"{op} case {case} backend={backend_name}"
        assert torch.cuda.current_device() == 0, f"the current device changed [{repro}]"
        # No new allocation on cuda:0. Its bytes may drop: memory of the cuda:0 call above can be released
        # late (the autograd engine's device thread drops the graph after grad() returns), as seen on the
        # H200 pair with mojo (-512 bytes, allocation count unchanged).
        after = _allocations(0)
        assert after[0] == before[0] and after[1] <= before[1], (
            f"(allocations, bytes) on cuda:0 went {before} -> {after} [{repro}]"
        )
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            if w is None:
                assert g is None, f"out {i} [{repro}]"
                continue
            assert g.device == torch.device("cuda", 1), f"out {i} is on {g.device} [{repro}]"
            # the same kernels; a per-device tuning choice may change the summation order, hence the bound
            assert_close(f"{op}[{i}]", g.cpu(), w.cpu().double(), 2 * rtol(op, DTYPE, "backward"), repro)
        ran += 1
    if not ran:
        pytest.skip(f"{backend_name} runs no case of {op} in {DTYPE}")


# Run in a fresh process: device 0 is never touched by the script itself, only the current device.
_SCRIPT = """
import ctypes, sys, torch
from cases import module
from fusekit import ops
cu = ctypes.CDLL("libcuda.so.1")
def ctx0_active():
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)
x = torch.ones(4, device="cuda:1", requires_grad=True)
(x * 2).sum().backward()  # plain torch, forward and backward, on cuda:1
torch.cuda.synchronize(1)
if ctx0_active():
    print("SKIP torch itself opens a context on device 0 here"); sys.exit(0)
from fusekit import backends
backends.get(sys.argv[1]).unavailable_reason()  # imports the backend's runtime (triton, MAX)
print("backend loaded ctx0", ctx0_active())  # where a stray context came from, if one appears
for op in ops.OPS:
    mod = module(op)
    torch.manual_seed(0)
    args, kwargs = mod.make(mod.CPU[0], torch.bfloat16, "cuda:1")
    args = tuple(a.requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    try:
        out = getattr(ops, op)(*args, **kwargs, backend=sys.argv[1])
    except ValueError as exc:
        print("refused", op, exc); continue
    outs = out if isinstance(out, tuple) else (out,)
    ys = [o for o in outs if o.requires_grad]
    leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]
    torch.autograd.grad(ys, leaves, [torch.ones_like(y) for y in ys])
    torch.cuda.synchronize(1)
    print(op, "device", torch.cuda.current_device(), "ctx0", ctx0_active())
"""


def test_no_context_on_first_gpu(backend_name: str, two_gpus: None, request: pytest.FixtureRequest) -> None:
    """A fresh process that only uses cuda:1 (every op, forward and backward) never opens device 0."""
    if backend_name == "mojo":  # strict: passing would report XPASS as a failure, so the mark comes off
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="known defect (issue #15): on two H200s at 3aaa15f the mojo backend loads without "
                "touching GPU 0, but its first op on cuda:1 leaves GPU 0's primary context active (MAX's "
                "load / run path or the stream fence; not yet isolated)",
            )
        )
    path = os.pathsep.join(str(p) for p in (TESTS.parent / "python", TESTS.parent, TESTS))
    # our paths first, the caller's after them (MAX staged outside site-packages lives there)
    path = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, backend_name], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout[5:].strip())
    lines = [ln for ln in proc.stdout.splitlines() if " ctx0 " in ln]
    ran = [ln for ln in lines if " device " in ln]
    assert ran, proc.stdout
    # every check false: after loading the backend's runtime, and after each op (current device still 0)
    assert all(ln.endswith("ctx0 False") for ln in lines), proc.stdout
    assert all(ln.endswith("device 0 ctx0 False") for ln in ran), proc.stdout


@pytest.mark.parametrize("op", ops.OPS)
def test_mixed_devices_name_the_argument(op: str, backend_name: str, two_gpus: None) -> None:
    """Each tensor argument in turn on cuda:0, the rest on cuda:1: a ValueError naming it (or the
    argument it is checked against, for the first one)."""
    mod = module(op)
    fn = getattr(ops, op)
    for case in _cases(op):
        args, kwargs = mod.make(case, DTYPE, "cuda:1")
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
        names = [n for n, v in bound.items() if isinstance(v, torch.Tensor)]
        for name in names if len(names) > 1 else []:  # reduce_sum has one tensor: nothing to mix
            moved = {**bound, name: bound[name].to("cuda:0")}
            with pytest.raises(ValueError, match=r"^\w+: is on cuda:[01] but \w+ is on cuda:[01]") as info:
                fn(**moved, backend=backend_name)
            msg = str(info.value)
            assert name in (msg.split(":")[0], msg.split(" but ")[1].split()[0]), msg
