"""Cross-backend conformance: op × backend × dtype × case × {forward, backward} against a float64 oracle.

One driver for every op in `fusekit.ops.OPS`; the cases and the oracle of each op are in
`tests/cases/<op>.py`. Every case draws fresh random inputs (the seed is printed on failure), runs
with outputs poisoned (NaN / INT_MIN) so unwritten elements fail, and compares by relative error with
`fusekit.tolerances`. The backward phase feeds non-contiguous random output gradients and compares
every input gradient with float64 autograd of the oracle. On `--device cuda` the case lists grow to
benchmark-sized problems. A backend that declares it cannot run a case (e.g. bf16 matrix ops in the
Triton CPU interpreter) is skipped with its reason.
"""

from __future__ import annotations

import pytest
import torch
from cases import activations, dtypes, module
from checks import assert_close

import fusekit
from fusekit import ops
from fusekit.tolerances import rtol

PHASES = ("forward", "backward")


def _params(device: str) -> list:
    out = []
    for op in ops.OPS:
        mod = module(op)
        cases = list(mod.CPU) + (list(mod.CUDA) if device == "cuda" else [])
        for i, case in enumerate(cases):
            for dtype in dtypes(mod, device):
                for phase in PHASES:
                    if phase == "backward" and (dtype not in mod.GRAD or not case.get("grad", True)):
                        continue
                    fast = i < 2  # the first two CPU cases of every op, dtype and phase (-m fast)
                    cid = f"{op}-{phase}-{str(dtype).removeprefix('torch.')}-{i}"
                    out.append(
                        pytest.param(op, case, dtype, phase, id=cid, marks=pytest.mark.fast if fast else ())
                    )
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conf_case" in metafunc.fixturenames:
        device = metafunc.config.getoption("--device")
        metafunc.parametrize(("op", "case", "dtype", "phase"), _params(device))
        metafunc.parametrize("conf_case", [None])


@pytest.fixture
def seed() -> int:
    s = torch.seed() % (1 << 31)  # fresh every test; printed on failure for a repro
    torch.manual_seed(s)
    return s


def _snapshot(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Every tensor input and a copy of it, to prove afterwards that the op left it alone."""
    named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    return [(n, t, t.detach().clone()) for n, t in named if isinstance(t, torch.Tensor)]


def _assert_untouched(snap: list, when: str, repro: str) -> None:
    """No op writes to its inputs: a changed input means a kernel wrote out of bounds (the H200 run once
    found swiglu_ffn's `x` zeroed by a matmul that stored whole tiles past its output's last row)."""
    for name, t, before in snap:
        now = t.detach()
        same = (  # bit for bit, NaN = NaN (a KV cache's unused tail is NaN-filled on purpose)
            torch.allclose(now, before, rtol=0, atol=0, equal_nan=True)
            if now.is_floating_point()
            else torch.equal(now, before)
        )
        assert same, f"input {name} changed {when} [{repro}]"


def _skip_if_refused(exc: ValueError) -> None:
    msg = str(exc)
    if "cannot run" in msg or "has no backward here" in msg:
        pytest.skip(msg)
    raise exc


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _f64_leaf(t):
    return t.detach().to(torch.float64).requires_grad_() if isinstance(t, torch.Tensor) else t


def test_op(conf_case, op, case, dtype, phase, backend_name, device, seed):
    mod = module(op)
    fn = getattr(ops, op)
    args, kwargs = mod.make(case, dtype, device)
    repro = f"{op} {phase} case={case} {dtype} backend={backend_name} seed={seed}"
    snap = _snapshot(args, kwargs)
    if phase == "forward":
        try:
            with fusekit.poisoned():
                got = _tuple(fn(*args, **kwargs, backend=backend_name))
        except ValueError as exc:
            _skip_if_refused(exc)
        _assert_untouched(snap, "by the forward", repro)
        want = _tuple(mod.oracle(*args, **kwargs))
        scales = mod.scale(args, kwargs) if hasattr(mod, "scale") else (None,) * len(want)
        assert len(got) == len(want), repro
        for i, (g, w, sc) in enumerate(zip(got, want, scales)):
            tol = rtol(op, g.dtype) * (10 if i and g.dtype == torch.float32 != dtype else 1)  # fp32 stats
            if getattr(mod, "OUT_TOL_FROM_INPUT", False):  # an fp32 result of x-dtype values
                tol = max(tol, rtol(op, dtype))
            assert_close(f"{op}.out{i}", g, w, tol, repro, sc)
        return

    # backward: every floating tensor argument gets a gradient; random, non-contiguous output grads
    leaves = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
    kleaves = [  # floating tensor keywords (not rope's tables, not integers such as kv_len)
        k
        for k, v in kwargs.items()
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point and k not in ("cos", "sin")
    ]
    args = tuple(a.detach().requires_grad_() if i in leaves else a for i, a in enumerate(args))
    kwargs = {k: (v.detach().requires_grad_() if k in kleaves else v) for k, v in kwargs.items()}
    inputs = [args[i] for i in leaves] + [kwargs[k] for k in kleaves]
    try:
        with fusekit.poisoned():
            got = _tuple(fn(*args, **kwargs, backend=backend_name))
    except ValueError as exc:
        _skip_if_refused(exc)
    outs = [o for o in got if o.requires_grad]
    assert outs, f"{op}: no output carries a gradient [{repro}]"
    grads = [torch.randn((*o.shape, 2), device=device).to(o.dtype)[..., 0] for o in outs]  # strided views
    with fusekit.poisoned():
        gin = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
    _assert_untouched(snap, "by the forward or backward", repro)
    args64 = tuple(_f64_leaf(a) if i in leaves else a for i, a in enumerate(args))
    kwargs64 = {k: (_f64_leaf(v) if k in kleaves else v) for k, v in kwargs.items()}
    inputs64 = [args64[i] for i in leaves] + [kwargs64[k] for k in kleaves]
    with activations(dtype):  # the oracle's roundings to x's dtype (h = x + residual) stay in float64
        want = [w for w, o in zip(_tuple(mod.oracle(*args64, **kwargs64)), got) if o.requires_grad]
    ref = torch.autograd.grad(want, inputs64, [g.to(torch.float64) for g in grads], allow_unused=True)
    names = [f"arg{i}" for i in leaves] + kleaves
    # Ops whose gradient rounding has a known size that does not shrink with the gradient give it per
    # gradient (attention: the rounded o in delta); the error is measured against it where it is larger
    gscales = mod.grad_scale(args, kwargs, grads) if hasattr(mod, "grad_scale") else (None,) * len(names)
    # Ops whose gradient rounding grows with a scalar (attention's logit scale) say by how much (once per
    # case: attention's estimate forms float64 keys and Gram matrices)
    mag = mod.grad_magnitude(args, kwargs) if hasattr(mod, "grad_magnitude") else 1.0
    for name, x, g, r, gs in zip(names, inputs, gin, ref, gscales):
        if r is None:
            r = torch.zeros_like(x, dtype=torch.float64)
        assert g is not None, f"{op}: no gradient for {name} [{repro}]"
        assert g.dtype == x.dtype and g.shape == x.shape, (
            f"{op}: grad of {name} is {g.dtype} {tuple(g.shape)} [{repro}]"
        )
        # Inputs and output grads are O(1), so gradients are O(1) per element; the floor keeps an
        # (almost) exactly zero gradient (rms_norm of N = 1, one key) from turning rounding into 100% error,
        # times `mag`.
        floor = torch.full((1,), 0.1 * mag * max(1, r.numel()) ** 0.5, dtype=torch.float64)
        if gs is not None and torch.linalg.vector_norm(gs).item() > floor.item():
            floor = gs
        # The activations' dtype bounds every gradient's accuracy (an fp32 weight's gradient in a bf16
        # layer is a sum of bf16-rounded terms), so the tolerance is the case dtype's.
        assert_close(f"{op}.d{name}", g, r, rtol(op, dtype, "backward"), repro, floor)


def _strided(t):
    """The same values in a non-contiguous layout (every other element of a wider buffer)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    wide = torch.empty((*t.shape, 2), dtype=t.dtype, device=t.device)
    wide[..., 0] = t
    return wide[..., 0]


@pytest.mark.parametrize("op", ops.OPS)
def test_non_contiguous_inputs(op, backend_name, device, seed):
    """Strided inputs give the contiguous result, bit for bit (the public layer copies, kernels never see strides)."""
    mod = module(op)
    dts = dtypes(mod, device)
    args, kwargs = mod.make(mod.CPU[0], torch.float32 if torch.float32 in dts else dts[0], device)
    try:
        want = _tuple(getattr(ops, op)(*args, **kwargs, backend=backend_name))
    except ValueError as exc:
        _skip_if_refused(exc)
    sargs = tuple(_strided(a) for a in args)
    skw = {k: _strided(v) for k, v in kwargs.items()}
    assert any(isinstance(a, torch.Tensor) and a.numel() > 1 and not a.is_contiguous() for a in sargs)
    with fusekit.poisoned():
        got = _tuple(getattr(ops, op)(*sargs, **skw, backend=backend_name))
    for g, w in zip(got, want):
        assert torch.equal(g, w), f"{op}: strided inputs changed the result [seed={seed}]"


@pytest.mark.parametrize("causal", [False, True])
def test_attention_oracle_in_row_blocks_matches_whole(monkeypatch: pytest.MonkeyPatch, causal: bool) -> None:
    """The float64 attention oracle computed in blocks of query rows (its memory bound on the GPU) gives the
    whole computation's output and gradients (causal diagonal and kv_len per block)."""
    from cases import attention as A

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((2, 4, 45, 64), (2, 2, 37, 64), (2, 2, 37, 64)))  # fmt: skip
    kv_len = torch.tensor([37, 10], dtype=torch.int32)
    (whole,) = A.oracle(q, k, v, causal=causal, kv_len=kv_len)
    dout = torch.randn(whole.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(whole, (q, k, v), dout)
    monkeypatch.setattr(A, "ORACLE_BLOCK_BYTES", 2 * 4 * 37 * 8 * 7)  # 7 rows a block: 7 blocks, a ragged one
    (blocks,) = A.oracle(q, k, v, causal=causal, kv_len=kv_len)
    got = torch.autograd.grad(blocks, (q, k, v), dout)
    torch.testing.assert_close(blocks, whole, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
