"""Two-GPU check (issue #15): which step of the mojo backend opens GPU 0's primary context when every
tensor lives on cuda:1 (tests/test_any_device.py::test_no_context_on_first_gpu[mojo] is a strict xfail).

    FUSEKIT_MOJO_FENCE=torch|driver PYTHONPATH=python:. python benchmarks/gpu_checks/mojo_ctx0.py

MAX staged (source /tmp/maxsite/env.sh). Runs the steps below in ONE fresh process, in order, and prints
GPU 0's primary-context state after each (cuDevicePrimaryCtxGetState; the process never makes device 0
current itself); the first step printing `ctx0 True` is the culprit. Run it twice: the second run finds
every graph in the disk cache (MEF load, no graph build or compile), which separates compiling from
loading and executing.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

_cu = ctypes.CDLL("libcuda.so.1")


def ctx0_active() -> bool:
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert _cu.cuInit(0) == 0 and _cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert _cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return bool(active.value)


def step(name: str) -> None:
    torch.cuda.synchronize(1)
    print(f"{name:<52} ctx0 {ctx0_active()}", flush=True)


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("SKIP: needs two GPUs")
        return 0
    dev = torch.device("cuda", 1)
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    step("torch on cuda:1")
    from max.driver import Accelerator

    acc = Accelerator(1)
    step("max.driver.Accelerator(1)")
    handle = acc.default_queue.native_stream_handle
    step(f"its default queue ({handle:#x})")
    from max.engine import InferenceSession

    InferenceSession(devices=[acc])
    step("InferenceSession(devices=[Accelerator(1)])")
    from fusekit import backends
    from fusekit.backends.mojo.dispatch import DeviceState

    backends.get("mojo").unavailable_reason()
    step("fusekit mojo backend loaded")
    state = DeviceState(dev)
    step(f"DeviceState(cuda:1), fence {os.environ.get('FUSEKIT_MOJO_FENCE', 'driver')}")
    state.wrap(x)
    step("DeviceState.wrap (Buffer from DLPack)")
    cur = state.fence.enter()  # None when torch's current stream is MAX's own
    if cur is not None:
        state.fence.exit(cur)
    step("fence enter + exit")
    from fusekit import ops

    with torch.no_grad():
        y = ops.rms_norm(x, w, 1e-6, backend="mojo")
    step("ops.rms_norm forward (graph build or MEF load, execute)")
    ops.rms_norm(x, w, 1e-6, backend="mojo")
    step("ops.rms_norm forward again (execute only)")
    xg = x.clone().requires_grad_()
    ops.rms_norm(xg, w, 1e-6, backend="mojo").sum().backward()
    step("ops.rms_norm forward + backward")
    ref = torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), 1e-6)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    print(f"rms_norm relative error {err:.2e} (on {y.device})")
    return 0 if err < 1e-2 and y.device == dev else 1


if __name__ == "__main__":
    sys.exit(main())
