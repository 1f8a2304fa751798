"""Which real Triton launchers the launch replay can record (kernels_triton/_replay.py), on the CPU.

The hot, host-bound calls of a decode or training step must stay replayable: a launcher change that
adds a torch op, a cached tensor or a non-lean launch silently costs ~20 us per call on the GPU host.
This drives the real `kernels_triton.<op>.forward/backward` launchers with CPU tensors in a
subprocess where Triton is not in interpreter mode (so the kernels are real JITFunctions with the lean
launch path) and every compile/launch is stood in for by a recorder, then asks `_replay.record`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]

_PROBE = r"""
import json, os, importlib
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.runtime.jit import JITFunction
from kernels_triton import _launch, _replay

class _Kernel:  # a CompiledKernel stand-in: launches do nothing
    function = packed_metadata = None
    def run(self, *a): pass
    def __getitem__(self, grid): return lambda *a: None

JITFunction.run = lambda self, *a, grid, warmup, **k: _Kernel()
torch.cuda.current_device = lambda: 0
_launch._stream = lambda device: 0  # no CUDA stream on the CPU
_launch.ENABLED = True
out = {}

def probe(name, op, phase, outs, ins, scalars):
    fn = getattr(importlib.import_module(f"kernels_triton.{op}"), phase)
    for _ in range(2):  # compile (stood in) and fill the lean path's cache
        fn(*outs, *ins, *scalars)
    ok = _replay.record(lambda: fn(*outs, *ins, *scalars), outs, ins) is not None
    out[name] = "replay" if ok else _replay.last_refusal

g = torch.Generator().manual_seed(0)
bf = torch.bfloat16
r = lambda *s, dt=bf: torch.randn(*s, generator=g).to(dt)
x, w, b, res, dy = r(4, 4096), r(4096), r(4096), r(4, 4096), r(4, 4096)
e = torch.empty_like
rstd, mean = torch.rand(4, generator=g) + 0.5, torch.randn(4, generator=g)
probe("rms_norm forward", "rms_norm", "forward", (e(x), None, e(rstd)), (x, None, w), (1e-6, "fp32"))
probe("rms_norm forward residual", "rms_norm", "forward", (e(x), e(x), e(rstd)), (x, res, w), (1e-6, "llama"))
probe("rms_norm backward", "rms_norm", "backward", (e(x), e(w)), (dy, None, x, w, rstd), (1e-6, "fp32"))
probe("layer_norm forward", "layer_norm", "forward", (e(x), None, e(mean), e(rstd)), (x, None, w, b), (1e-5,))
probe("layer_norm forward residual no bias", "layer_norm", "forward", (e(x), e(x), e(mean), e(rstd)), (x, res, w, None), (1e-5,))
probe("layer_norm backward", "layer_norm", "backward", (e(x), e(w), e(b)), (dy, None, x, w, mean, rstd), (1e-5,))
q, pos = r(1, 1, 32, 128), torch.tensor([[7]], dtype=torch.int32)
probe("rope forward", "rope", "forward", (e(q), None), (q, None, None, None, None), (2047, 500000.0, False))
probe("rope forward positions", "rope", "forward", (e(q), None), (q, None, None, pos, None), (0, 10000.0, False))
probe("rope backward", "rope", "backward", (e(q), None), (q, None, None, None, None), (2047, 500000.0, False))
kq = r(1, 1, 8, 128)
probe("rope forward q+k", "rope", "forward", (e(q), e(kq)), (q, None, None, None, kq), (2047, 500000.0, False))
qa, kc, vc = r(2, 32, 1, 128), r(2, 8, 1000, 128), r(2, 8, 1000, 128)
kv_len = torch.tensor([999, 517], dtype=torch.int32)
o, lse = e(qa), torch.empty(2, 32, 1)
probe("attention decode kv_len", "attention", "forward", (o, lse), (qa, kc, vc, kv_len), (False, 128**-0.5))
probe("attention decode cache view", "attention", "forward", (o, lse), (qa, kc[:, :, :515], vc[:, :, :515], None), (True, 128**-0.5))
qp, kp, vp = r(1, 4, 64, 64), r(1, 2, 64, 64), r(1, 2, 64, 64)
lsep = torch.randn(1, 4, 64, generator=g)
probe("attention backward", "attention", "backward", (e(qp), e(kp), e(vp)), (e(qp), qp, kp, vp, e(qp), lsep, None), (True, 0.125))
probe("reduce_sum", "reduce_sum", "forward", (torch.empty(4),), (x.float(),), ())
probe("reduce_sum backward", "reduce_sum", "backward", (e(x),), (r(4),), ())
long = r(1, 1 << 20, dt=torch.float32)
rs, o1 = importlib.import_module("kernels_triton.reduce_sum"), torch.empty(1)
rs.reduce_sum(o1, long); rs.reduce_sum(o1, long)  # the non-deterministic (atomic) path, used directly
out["reduce_sum atomic"] = _replay.record(lambda: rs.reduce_sum(o1, long), (o1,), (long,)) and "replay" or _replay.last_refusal
print("PROBE" + json.dumps(out))
"""

REPLAYABLE = [
    "rms_norm forward",
    "rms_norm forward residual",
    "rms_norm backward",
    "layer_norm forward",
    "layer_norm forward residual no bias",
    "layer_norm backward",
    "rope forward",
    "rope forward positions",
    "rope backward",
    "rope forward q+k",
    "attention decode kv_len",
    "attention decode cache view",
    "attention backward",
    "reduce_sum",
    "reduce_sum backward",
]


@pytest.fixture(scope="module")
def probed() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO)])}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE"))
    return json.loads(line.removeprefix("PROBE"))


@pytest.mark.parametrize("call", REPLAYABLE)
def test_hot_launcher_is_replayable(probed: dict[str, str], call: str) -> None:
    assert probed[call] == "replay", f"{call}: not replayable: {probed[call]}"


def test_reduce_sum_atomic_path_is_not_replayed(probed: dict[str, str]) -> None:
    """A few long rows are summed with atomics into an output zero-filled by a torch op first: a replay
    would skip the fill, so the recording refuses it."""
    assert "zero" in probed["reduce_sum atomic"]
