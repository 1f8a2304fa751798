"""The tensor-core attention backward of the mojo backend (the default; FUSEKIT_MOJO_ATTN_BWD_TC=0 opts out).

    pytest tests/test_mojo_attention_bwd_tc.py

The kernels themselves (mojo/_attention_backward.mojo, NVIDIA only) are checked by the GPU harness
(`FUSEKIT_HARNESS_ONLY=attn_bwd_tc`, mojo/harness/run_attention.mojo). Here, on the CPU: by default the
backward's params carry a 4th slot `bwd_tc` = 1 that the MAX graph takes and the CPU path ignores; opted
out, the signature is the forward's (compiled and run through MAX in a subprocess, since the spec is read
once per process): the gradients are the same bits either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusekit import backends, ops
from fusekit.backends.mojo import specs
from fusekit.ops import SPECS as OP_SPECS

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"
_DEFAULT = ("causal", "scale", "has_kv_len")


def test_default_signature_has_the_slot() -> None:
    if not specs.attention_bwd_tc():
        pytest.skip(f"{specs.ATTN_BWD_TC_ENV}=0 in this process")
    assert specs.phase_spec("attention", "backward").params == (*_DEFAULT, "bwd_tc")
    # the forward's own 4th slot selects the split-KV decode kernels (specs.ATTN_DECODE, on by default)
    decode = ("decode",) if specs.ATTN_DECODE else ()
    assert specs.phase_spec("attention", "forward").params == (*_DEFAULT, *decode)


def test_opt_in_adds_the_slot() -> None:
    base = specs.max_spec(OP_SPECS["attention"], "backward")
    tc = specs.with_flag(base, "bwd_tc")
    assert tc.params == (*_DEFAULT, "bwd_tc")
    assert tc.op == base.op and tc.max_op == base.max_op and tc.workspaces == base.workspaces
    q = torch.randn(1, 2, 5, 64)
    k = torch.randn(1, 1, 7, 64)
    o, lse = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5)
    outs = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(k))
    ins = (torch.randn_like(q), q, k, k, o, lse, None)
    _, _, p_base = base.bind(outs, ins, (True, 0.125))
    _, _, p_tc = tc.bind(outs, ins, (True, 0.125))
    assert p_base == (1.0, 0.125, 0.0)
    assert p_tc == (*p_base, 1.0)


# The call both processes make (the child opted out, this one with the default): out = [o, dq, dk, dv].
_GRADS = r"""
g = torch.Generator().manual_seed(3)
q = torch.randn(2, 4, 5, 64, generator=g, requires_grad=True)
k = torch.randn(2, 2, 9, 64, generator=g, requires_grad=True)
v = torch.randn(2, 2, 9, 64, generator=g, requires_grad=True)
kv_len = torch.tensor([9, 4], dtype=torch.int32)
o = ops.attention(q, k, v, causal=True, kv_len=kv_len, backend="mojo")
do = torch.randn(o.shape, generator=g)
out = [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]
"""
_CHILD = (
    "import sys, torch\nfrom fusekit import ops\nfrom fusekit.backends.mojo import specs\n"
    'assert specs.phase_spec("attention", "backward").params[-1] == "has_kv_len"\n'
    + _GRADS
    + "torch.save(out, sys.argv[1])\n"
)


def test_opt_out_runs_through_max_on_cpu(tmp_path) -> None:
    why = backends.available()["mojo"]
    if why is not None:
        pytest.skip(f"the mojo backend is not installed: {why}")
    out = tmp_path / "grads.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]))
    env[specs.ATTN_BWD_TC_ENV] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out)
    ns: dict = {"torch": torch, "ops": ops}
    exec(_GRADS, ns)  # the same call here, with the default
    for a, b in zip(got, ns["out"]):
        assert torch.equal(a, b)
