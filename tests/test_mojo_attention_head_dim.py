"""attention's GPU graphs are compiled per head dim (issue #14 item 3): the custom op takes a compile-time
`head_dim` parameter (mojo/attention.mojo `execute[..., head_dim]`), so one graph instantiates only that
head dim's flash-attention and decode kernels. The parameter is part of the compile key and of the MEF's
name, `python -m fusekit.mojo_build` builds one entry per head dim, and a call's results do not depend on
it (checked on the CPU, where the kernel ignores it: the GPU branch is checked by the virtual-GPU compile
and the GPU conformance suite).

    pytest tests/test_mojo_attention_head_dim.py
"""

from __future__ import annotations

import pytest
import torch

from fusekit import backends, mojo_build
from fusekit.backends.mojo import runtime as rt
from fusekit.backends.mojo.specs import HEAD_DIMS, phase_spec

pytest.importorskip("max.engine", reason="MAX is not importable")

CUDA = torch.device("cuda", 0)  # only a key here: nothing runs on it
CPU = torch.device("cpu")


def _bound(phase: str, d: int, dtype: torch.dtype = torch.float32):
    """The bound (outs, ins, params) of an attention call at head dim d (B1 H4/Hkv2 S8)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, d, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 8, d, generator=g).to(dtype) for _ in range(2))
    ms = phase_spec("attention", phase)
    scalars = (True, d**-0.5)
    if phase == "forward":
        o, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"))
        return ms, (q, k, v), ms.bind((o, lse), (q, k, v, None), scalars)
    do, o, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(q.shape[:3])
    outs = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return ms, (q, k, v), ms.bind(outs, (do, q, k, v, o, lse, None), scalars)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_head_dim_is_a_gpu_compile_parameter(phase: str) -> None:
    for d in HEAD_DIMS:
        ms, _, (outs, ins, _) = _bound(phase, d)
        assert ms.parameters(outs, ins, CUDA) == (("head_dim", d),)
        assert ms.parameters(outs, ins, CPU) == ()  # CPU loops take any head dim: one graph
    rms = phase_spec("rms_norm", "forward")
    assert rms.shape_params == ()


def test_two_head_dims_two_models_and_two_mef_names(monkeypatch: pytest.MonkeyPatch) -> None:
    comp = rt.OpCompiler()
    loads = []
    monkeypatch.setattr(
        comp, "_load", lambda spec, dtypes, device, params=(): loads.append(params) or object()
    )
    ms = phase_spec("attention", "forward")
    key = (torch.bfloat16,)
    a = comp.get(ms, key, CUDA, (("head_dim", 64),))
    b = comp.get(ms, key, CUDA, (("head_dim", 128),))
    assert a is not b and a.model is not b.model
    assert comp.get(ms, key, CUDA, (("head_dim", 64),)) is a  # a hit: no second load
    assert loads == [(("head_dim", 64),), (("head_dim", 128),)]
    assert (a.parameters, b.parameters) == ((("head_dim", 64),), (("head_dim", 128),))
    names = {comp.mef_rel(ms, key, CPU, p).name for p in ((), (("head_dim", 64),), (("head_dim", 128),))}
    assert len(names) == 3
    assert comp.mef_rel(ms, key, CPU, (("head_dim", 64),)).name.startswith(
        "attention-bfloat16-head_dim64-cpu-"
    )
    # ops without parameters keep their names
    assert comp.mef_rel(ms, key, CPU).name.startswith("attention-bfloat16-cpu-")


def test_mojo_build_has_one_gpu_entry_per_head_dim() -> None:
    for phase in ("forward", "backward"):
        cuda = mojo_build.entries(CUDA, ["attention"], (phase,))
        for dt in (torch.float16, torch.bfloat16):
            got = sorted(e.parameters for e in cuda if e.dtypes == (dt,))
            assert got == [(("head_dim", d),) for d in HEAD_DIMS], (phase, dt)
        assert {e.label() for e in cuda} >= {f"{cuda[0].spec.max_op} (bfloat16, head_dim=128)"}
        cpu = mojo_build.entries(CPU, ["attention"], (phase,))
        assert cpu and all(e.parameters == () for e in cpu)


def test_results_unchanged_with_the_parameter() -> None:
    """The same call through the graph without the parameter and the graph with it (CPU: two compiles on
    first use, cached after): bit-identical outputs, two models, two cache files."""
    be = backends.get("mojo")
    if (why := be.unavailable_reason()) is not None:
        pytest.skip(f"the mojo backend is unavailable: {why}")
    comp, disp = be.compiler, be.dispatcher
    st = disp.state(CPU)
    ms, (q, k, v), (outs, ins, params) = _bound("forward", 64)
    res = []
    for p in ((), (("head_dim", 64),)):
        compiled = comp.get(ms, ms.dtype_key(outs, ins), CPU, p)
        for t in outs:
            t.fill_(float("nan"))
        disp.run(compiled, st, outs, ins, params)
        res.append(tuple(t.clone() for t in outs))
        rel = comp.mef_rel(ms, ms.dtype_key(outs, ins), CPU, p)
        assert any(path.exists() for path in comp.store.candidates(rel)), rel
    assert comp.get(ms, (torch.float32,), CPU) is not comp.get(ms, (torch.float32,), CPU, (("head_dim", 64),))
    for x, y in zip(*res):
        assert torch.equal(x, y)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True
    )
    assert (res[0][0].double() - ref).abs().max().item() < 1e-5
