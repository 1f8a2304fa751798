"""`python -m fusekit.mojo_build` (issue #14 item 3): the entries it builds, and that a later process's
first call is a cache load.

The build test compiles one graph (reduce_sum float32 on the CPU) into a fresh FUSEKIT_CACHE_DIR, in
subprocesses with timeouts (the op package's precompile plus one MAX CPU compile: tens of seconds, minutes
on a loaded 2-core box).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("max.engine", reason="MAX is not importable")

from fusekit import mojo_build, ops
from fusekit.backends.mojo.specs import NO_KERNEL

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 1200  # s


def test_entries_cover_every_op_phase_and_kernel_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = mojo_build.entries(torch.device("cpu"))
    cuda = mojo_build.entries(torch.device("cuda", 0))
    ops_phases = {(e.op, e.phase) for e in cpu}
    with_kernel = set(ops.OPS) - NO_KERNEL  # ops the Mojo package has no kernel for are not built
    assert {op for op, _ in ops_phases} == with_kernel
    # reduce_sum's gradient is a view, linear_cross_entropy's backward torch multiplies: nothing to build
    no_bwd = {"reduce_sum", "linear_cross_entropy"}
    assert {(op, "backward") for op in with_kernel - no_bwd} <= ops_phases
    keys = [(e.spec.max_op, e.dtypes) for e in cpu]
    assert len(keys) == len(set(keys)), "an artifact listed twice"
    # the backend's own rule (MojoBackend.supports): float64 x runs on the torch backend only, while a
    # float64 *result* of reduce_sum is a mojo kernel (reduce_sum(x, dtype=torch.float64, backend="mojo"))
    assert all(e.dtypes[0] != torch.float64 for e in cpu), "float64 x runs on the torch backend"
    assert ("fusekit.reduce_sum", (torch.float32, torch.float64)) in keys
    # swiglu_ffn's backward: its element-wise op and the rms_norm backward it calls, each with norm_weight
    # in x's dtype or (AMP) fp32 under a half x
    swiglu_bwd = {
        e.spec.max_op for e in mojo_build.entries(torch.device("cpu"), ["swiglu_ffn"], ("backward",))
    }
    assert swiglu_bwd == {"fusekit.swiglu_ffn_backward", "fusekit.rms_norm_backward"}
    bf16, f32 = torch.bfloat16, torch.float32
    amp = {(e.spec.max_op, e.dtypes) for e in mojo_build.entries(torch.device("cpu"), ["swiglu_ffn"])}
    assert {("fusekit.swiglu_ffn", (bf16, f32)), ("fusekit.swiglu_ffn_backward", (bf16, f32))} <= amp
    assert ("fusekit.rms_norm_backward", (bf16, f32)) in amp
    # its forward: the op, the rms_norm op of the GEMM path, on a GPU the element-wise op forming h there,
    # and on NVIDIA the bf16 wgmma twin only where FUSEKIT_MOJO_FFN_TC=1 routes prefill to it
    tc_keys = {("fusekit.swiglu_ffn_tc", (torch.bfloat16, w)) for w in (torch.bfloat16, torch.float32)}
    for dev, tc_env, tc in (("cpu", "1", set()), ("cuda", "", set()), ("cuda", "1", tc_keys)):
        monkeypatch.setenv("FUSEKIT_MOJO_FFN_TC", tc_env)
        fwd = {
            (e.spec.max_op, e.dtypes)
            for e in mojo_build.entries(torch.device(dev), ["swiglu_ffn"], ("forward",))
        }
        assert {k for k in fwd if k[0] == "fusekit.swiglu_ffn_tc"} == tc, dev
        gemm = {"fusekit.swiglu_ffn_backward"} if dev == "cuda" else set()
        want = {"fusekit.swiglu_ffn", "fusekit.rms_norm"} | gemm | {k[0] for k in tc}
        assert {k[0] for k in fwd} == want, (dev, tc_env)
    # linear_cross_entropy: its per-chunk row kernel, for every x dtype (fp16 gradients are refused, not
    # its fp16 forward)
    lce = {
        (e.spec.max_op, e.dtypes)
        for e in mojo_build.entries(torch.device("cuda", 0), ["linear_cross_entropy"])
    }
    assert lce == {
        ("fusekit.linear_cross_entropy", (d,)) for d in (torch.float32, torch.float16, torch.bfloat16)
    }
    # fp32 attention is refused on CUDA before any kernel: not built there
    att32 = lambda es: [e for e in es if e.op == "attention" and e.dtypes == (torch.float32,)]
    assert att32(cpu) and not att32(cuda)
    only = mojo_build.entries(
        torch.device("cpu"), ["rms_norm"], ("forward",), {torch.bfloat16, torch.float32}
    )
    assert sorted((e.dtypes for e in only), key=str) == sorted(
        [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
        key=str,
    )


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "FUSEKIT_CACHE_DIR": str(cache),
        "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=REPO
    )


FIRST_CALL = r"""
import json, torch
from fusekit import backends, ops
torch.manual_seed(0)
x = torch.randn(37, 53)
got = ops.reduce_sum(x, -1, backend="mojo")
stats = backends.get("mojo").compiler.stats
print("RESULT " + json.dumps({
    "err": float((got.double() - x.double().sum(-1)).abs().max()),
    "graph_compiles": stats.graph_compiles, "mef_loads": stats.mef_loads, "precompiles": stats.precompiles,
}))
"""


def test_build_makes_the_next_process_first_call_a_cache_load(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cmd = ["-m", "fusekit.mojo_build", "--device", "cpu", "--ops", "reduce_sum", "--dtypes", "float32"]
    first = _run(cmd, cache)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "compiled  fusekit.reduce_sum (float32,float32)" in first.stdout, first.stdout
    assert "1 entries on cpu" in first.stdout and "0 failed" in first.stdout, first.stdout
    again = _run(cmd, cache)
    assert again.returncode == 0 and "cached    fusekit.reduce_sum (float32,float32)" in again.stdout, (
        again.stdout + again.stderr
    )
    call = _run(["-c", FIRST_CALL], cache)
    assert call.returncode == 0, call.stdout + call.stderr
    res = json.loads(next(ln for ln in call.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res["err"] < 1e-3, res
    assert res["graph_compiles"] == 0 and res["precompiles"] == 0 and res["mef_loads"] == 1, res
    assert "compiling" not in call.stderr, call.stderr  # no progress line: nothing was compiled


def test_bad_arguments_exit_2(capsys) -> None:
    assert mojo_build.main(["--ops", "nope", "--list"]) == 2
    assert mojo_build.main(["--dtypes", "float99", "--list"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_jobs_split_the_entries_between_workers(capsys) -> None:
    """--jobs N runs N workers with --shard k/N; the shards partition the listing."""
    assert mojo_build.main(["--device", "cpu", "--list"]) == 0
    whole = capsys.readouterr().out.splitlines()
    parts = []
    for k in range(3):
        assert mojo_build.main(["--device", "cpu", "--list", "--shard", f"{k}/3"]) == 0
        parts.append(capsys.readouterr().out.splitlines())
    assert sorted(ln for p in parts for ln in p) == sorted(whole) and all(parts)


def test_workers_get_jobs_1_and_never_spawn(monkeypatch) -> None:
    """Each --jobs worker runs the caller's arguments plus --jobs 1 --shard k/N (an abbreviated --job 4
    included), and a worker with a shard never starts workers itself."""
    import subprocess as sp

    started: list[list[str]] = []

    class Fake:
        def __init__(self, cmd):
            started.append(cmd)

        def wait(self):
            return 0

    monkeypatch.setattr(sp, "Popen", Fake)
    assert mojo_build.main(["--device", "cpu", "--job", "2", "--ops", "rope"]) == 0
    assert [c[3:] for c in started] == [
        ["--device", "cpu", "--job", "2", "--ops", "rope", "--jobs", "1", "--shard", f"{k}/2"]
        for k in range(2)
    ]
    args = mojo_build._parser().parse_args(started[0][3:])
    assert args.jobs == 1 and args.shard == "0/2"
    started.clear()
    monkeypatch.setattr(mojo_build, "build", lambda device, todo: 0)
    assert mojo_build.main(["--device", "cpu", "--jobs", "3", "--shard", "1/3", "--ops", "rope"]) == 0
    assert started == [], "a worker spawned workers"
