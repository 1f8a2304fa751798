"""Property-based fuzzing (issue #15, item 6): every op × backend against the float64 oracle.

For each op in `fusekit.ops.OPS`, hypothesis draws calls (tests/fuzz_strategies.py: shapes with 1,
primes, 2^k ± 1 and empty extents, dtypes, layouts, scalars, flags, a seed) and checks two properties
on the backend under test (`--backends`, the conftest's `backend_name`):

- `test_fuzz`: a valid call gives the float64 oracle's answer. Each example goes through the
  conformance driver (`test_conformance.test_op`, fed the drawn arguments instead of a listed case):
  forward with poisoned outputs, then (float inputs) backward with strided random output gradients
  against float64 autograd of `tests/cases/<op>.py`'s oracle, tolerances from `fusekit.tolerances`.
  Rope's in-kernel angles are formed in fp32 (its definition), so once a position makes an angle's
  fp32 error larger than the tolerance allows, only the pairs whose angle is still exact enough are
  compared with the oracle, and every pair must keep its norm (a rotation); see `_rope_far`.
- `test_fuzz_invalid`: the same call with one argument broken (wrong shape, dtype, range, type)
  raises TypeError or ValueError whose message starts with the broken argument's name — never
  another exception, never a result.

A backend that refuses a drawn call ("cannot run ...") rejects the example (hypothesis draws another);
one that has no backward for it ("has no backward here") keeps the forward check. Example counts are
per op and backend (`fuzz_strategies.PROFILES`; FUSEKIT_FUZZ_EXAMPLES=<factor> scales them for a
longer local run), with derandomize=True and no database: every run draws the same examples, so CI is
reproducible (FUSEKIT_FUZZ_SEED=<n> picks another such stream for a local hunt). A failure prints the
drawn case (shapes, layouts, scalars, seed) as the repro.
"""

from __future__ import annotations

import inspect
import math
import os
from collections import Counter
from unittest import mock

import pytest
import test_conformance as conformance
import torch
from cases import module
from checks import assert_close
from fuzz_strategies import F16, F32, F64, I32, I64, MAX_POSITION, PROFILES, STRATEGIES, Case
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

import fusekit
from fusekit import ops
from fusekit.tolerances import rtol

SCALE = float(os.environ.get("FUSEKIT_FUZZ_EXAMPLES", "1"))
# Another derandomized stream for a local hunt (derandomize=True ignores --hypothesis-seed): unset, the
# streams CI draws; FUSEKIT_FUZZ_SEED=<n> draws other (equally reproducible) examples.
STREAM = os.environ.get("FUSEKIT_FUZZ_SEED", "")


def _settings(n: int) -> settings:
    return settings(
        max_examples=max(1, round(n * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        # the Triton interpreter and MAX are slow per call; refusals are filtered, not failures
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


def _strategy(op: str, backend: str, device: str) -> st.SearchStrategy[Case]:
    if op not in STRATEGIES:
        pytest.fail(f"fusekit.ops.{op} has no fuzz strategy: add one to tests/fuzz_strategies.py")
    kw = {}
    if op == "attention":  # per-sequence KV lengths, once both the op and its oracle take them
        kw["kv_len"] = all("kv_len" in _params(f) for f in (ops.attention, module("attention").oracle))
    return STRATEGIES[op](PROFILES[backend], device, **kw)


def _seed(case: Case) -> int:
    return int(case.desc.split()[0].removeprefix("seed="))


def _refused(exc: BaseException) -> str | None:
    """'forward' or 'backward' when the backend declined the call, else None."""
    msg = str(exc)
    if "has no backward here" in msg:
        return "backward"
    if "cannot run" in msg:
        return "forward"
    return None


# --- valid calls against the oracle ---------------------------------------------------------------------
def _conformance(case: Case, phase: str, backend: str, device: str) -> None:
    """One phase of `case` through the conformance driver (its listed-case `make` swapped for ours)."""
    torch.manual_seed(_seed(case))  # the driver's random output gradients
    with mock.patch.object(module(case.op), "make", lambda *_: (case.args, case.kwargs)):
        conformance.test_op(None, case.op, case, case.dtype, phase, backend, device, _seed(case))


def _rope_angle_error(case: Case) -> torch.Tensor | None:
    """An upper estimate of the fp32 error of each in-kernel angle [S, D/2], in radians (None with tables).

    angle = (start_pos + s) · inv_freq_i with inv_freq_i = 2^(-a_i), a_i = 2i·log2(theta)/D, formed in
    fp32 (the op's definition). For a_i = 0 (i = 0, or theta = 1) inv_freq is exactly 1 and every
    position up to 2^24 is an fp32 integer: the angle is exact. Otherwise a_i carries ~3 roundings
    relative to itself, 2^x and the product one ulp each: relative error <= 2^-24 · (3·a_i + 3).
    """
    if case.kwargs.get("cos") is not None:
        return None
    x, start, theta = case.args[0], case.kwargs["start_pos"], case.kwargs["theta"]
    s, d = x.shape[1], x.shape[3]
    a = 2.0 * torch.arange(d // 2, dtype=F64) * math.log2(theta) / d
    ang = torch.arange(start, start + s, dtype=F64)[:, None] * torch.exp2(-a)[None, :]
    return torch.where(a > 0, ang * (3.0 * a + 3.0) * 2.0**-24, 0.0)


def _rope_far(case: Case, phase: str, backend: str, device: str, err: torch.Tensor) -> None:
    """Rope where some fp32 angles are off by more than the tolerance allows (large start_pos).

    The oracle's float64 angles are then not what any fp32 kernel can produce, so: (1) the elements
    whose pair's angle error is under a quarter of the tolerance match the oracle to the usual
    tolerance; (2) every pair keeps its 2-norm (the output is a rotation of the input: a wrong index,
    a lost sign or an unwritten element changes it). With k (q and k in one call) both outputs are checked.
    """
    x, kw = case.args[0], dict(case.kwargs)
    k = kw.pop("k", None)
    tol = rtol("rope", case.dtype, phase)
    repro = f"{case!r} {phase} backend={backend}"
    ins = [x] if k is None else [x, k]
    if phase == "forward":
        with fusekit.poisoned():
            got = ops.rope(x, k, **kw, backend=backend)
        got = [got] if k is None else list(got)
        want = list(module("rope").oracle(x, **kw, k=k))
        srcs = ins
    else:
        leaves = [t.detach().requires_grad_() for t in ins]
        with fusekit.poisoned():
            ys = ops.rope(*leaves, **kw, backend=backend)
        ys = [ys] if k is None else list(ys)
        torch.manual_seed(_seed(case))
        srcs = [torch.randn((*y.shape, 2), device=device).to(y.dtype)[..., 0] for y in ys]  # strided grads
        with fusekit.poisoned():
            got = list(torch.autograd.grad(ys, leaves, srcs))
        x64 = [t.detach().to(F64).requires_grad_() for t in ins]
        outs64 = module("rope").oracle(x64[0], **kw, k=None if k is None else x64[1])
        want = list(torch.autograd.grad(list(outs64), x64, [g.to(F64) for g in srcs]))
    d = x.shape[-1]
    pair = torch.arange(d) // 2 if kw["interleaved"] else torch.arange(d) % (d // 2)

    def norms(t: torch.Tensor) -> torch.Tensor:
        t = t.to(F64)
        if kw["interleaved"]:
            return t.unflatten(-1, (d // 2, 2)).norm(dim=-1)
        return torch.stack((t[..., : d // 2], t[..., d // 2 :]), dim=-1).norm(dim=-1)

    for name, t, g, w, src in zip(("x", "k"), ins, got, want, srcs):
        assert g.dtype == t.dtype and g.shape == t.shape, repro
        near = (err <= tol / 4)[:, pair].to(device)[None, :, None, :].expand(t.shape)
        assert_close(f"rope.{phase}.{name}[exact angles]", g[near], w[near], tol, repro)
        assert_close(f"rope.{phase}.{name}|pair|", norms(g), norms(src), tol, repro)
    event("rope: fp32 angles past the tolerance (exact-angle pairs + pair norms)")


def _check(case: Case, backend: str, device: str, counts: Counter) -> None:
    phases = ("forward", "backward") if case.dtype.is_floating_point else ("forward",)
    err = _rope_angle_error(case) if case.op == "rope" else None
    far = err is not None and err.numel() > 0 and err.max().item() > rtol("rope", case.dtype) / 4
    for phase in phases:
        try:
            if far:
                _rope_far(case, phase, backend, device, err)
            else:
                _conformance(case, phase, backend, device)
        except (pytest.skip.Exception, ValueError) as exc:
            why = _refused(exc)
            if why is None:
                raise
            if why == "forward" and phase == "forward":
                counts["refused"] += 1
                event(f"refused by {backend}: {str(exc).split(': ', 2)[-1][:80]}")
                reject()
            counts["no backward"] += 1
            event(f"{backend}: no backward for this call")
            return
        counts[phase + (" (rope far)" if far else "")] += 1


@pytest.mark.parametrize("op", ops.OPS)
def test_fuzz(op, backend_name, device):
    strategy = _strategy(op, backend_name, device)
    counts: Counter = Counter()

    def body(case: Case) -> None:
        _check(case, backend_name, device, counts)

    # its own derandomized stream
    body._hypothesis_internal_add_digest = f"{op}/{backend_name}{STREAM}".encode()
    _settings(PROFILES[backend_name].examples[op])(given(case=strategy)(body))()
    print(f"fuzz {op} on {backend_name}: {dict(counts)}")  # shown with -s (or -rP)


# --- invalid calls: a clear TypeError / ValueError naming the argument --------------------------------------
def _other_float(dtype: torch.dtype, allowed: tuple[torch.dtype, ...] = ()) -> torch.dtype:
    """A float dtype different from `dtype` and outside `allowed`."""
    return next(d for d in (F16, torch.bfloat16, F32, F64) if d != dtype and d not in allowed)


def _bad_param_dtype(x: torch.dtype, allowed: tuple[torch.dtype, ...]) -> torch.dtype | None:
    """A float dtype a norm refuses for a weight / bias beside x: outside `allowed`, and (for fp32 / fp64 x)
    not narrower than x, since narrower parameters are widened as torch promotes them (_norms.widen_params);
    None where every float is taken (fp64 x)."""
    widened = (F16, torch.bfloat16, F32) if x in (F32, F64) else ()
    return next((d for d in (F16, torch.bfloat16, F32, F64) if d != x and d not in allowed + widened), None)


def _like(t: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype or t.dtype, device=t.device)


_DROP = object()  # a breaker's marker: leave this keyword out


def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


BAD_REALS = [(-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError), (1e39, ValueError)]
BAD_REALS += [(1e-50, ValueError), ("1e-6", TypeError), (True, TypeError), (None, TypeError)]


def _breakers(case: Case):
    """(label, args, kwargs, names the message may start with, exception type) — one broken argument each."""
    a, kw, op = list(case.args), dict(case.kwargs), case.op
    out = []

    def brk(label, names, exc, args=None, **changes):
        k = dict(kw)
        for key, val in changes.items():
            if val is _DROP:
                k.pop(key, None)
            else:
                k[key] = val
        out.append((label, tuple(a if args is None else args), k, names, exc))

    x = a[0]
    brk("x not a tensor", ("x", "q"), TypeError, [[1.0, 2.0], *a[1:]])
    brk("x bool", ("x", "q"), TypeError, [x.bool(), *a[1:]])
    brk("backend type", ("backend",), TypeError, None, backend=3)
    if x.numel():  # an empty call never resolves its backend: see test_unknown_backend_on_empty_input
        brk("backend unknown", ("backend",), ValueError, None, backend="cuda")
    if op == "reduce_sum":
        nd = max(case.facts["nd"], 1)
        brk("dim too large", ("dim",), ValueError, [x, nd])
        brk("dim too small", ("dim",), ValueError, [x, -nd - 1])
        brk("dim float", ("dim",), TypeError, [x, 0.0])
        brk("dim bool", ("dim",), TypeError, [x, True])
        brk("dtype other kind", ("dtype",), TypeError, None, dtype=I64 if x.dtype.is_floating_point else F32)
        brk("dtype a string", ("dtype",), TypeError, None, dtype="float32")
    if op in ("rms_norm", "layer_norm"):
        w, n, wdt = a[1], case.facts["shape"][-1], case.facts["wdt"]
        allowed = (x.dtype, F32) if x.dtype in (F16, torch.bfloat16) else (x.dtype,)
        brk("weight length", ("weight",), ValueError, [x, _like(w, (n + 1,)), *a[2:]])
        brk("weight 2-d", ("weight",), ValueError, [x, w[None], *a[2:]])
        if (bad := _bad_param_dtype(x.dtype, allowed)) is not None:
            brk("weight dtype", ("weight",), TypeError, [x, w.to(bad), *a[2:]])
        brk("weight a list", ("weight",), TypeError, [x, w.tolist(), *a[2:]])
        brk("x int", ("x",), TypeError, [x.to(I32), *a[1:]])
        brk("x 0-d", ("x",), ValueError, [x.flatten()[:1].sum() if x.numel() else x.new_ones(()), *a[1:]])
        brk("x N = 0", ("x",), ValueError, [x[..., :0], w[:0], *a[2:]])
        res = kw.get("residual")
        brk("residual shape", ("residual",), ValueError, None, residual=_like(x, (*x.shape[:-1], n + 1)))
        if res is not None:
            # another float dtype is promoted as x + residual (fusekit.ops._norms.promote_residual): not a float
            brk("residual dtype", ("residual",), TypeError, None, residual=res.to(I32))
        if op == "rms_norm":
            for v, e in BAD_REALS:
                if v is not None:  # eps=None is not a default here: a type error too, but skip the noise
                    brk(f"eps={v!r}", ("eps",), e, None, eps=v)
            brk("casting unknown", ("casting",), ValueError, None, casting="bf16")
            brk("casting not a str", ("casting",), TypeError, None, casting=1)
        else:
            b = a[2]
            for v, e in BAD_REALS:
                if v is not None:
                    brk(f"eps={v!r}", ("eps",), e, [x, w, b, v])
            brk("bias length", ("bias",), ValueError, [x, w, _like(w, (n + 2,)), a[3]])
            if (bad := _bad_param_dtype(x.dtype, (wdt,))) is not None:  # the weight's dtype, or widened
                brk("bias dtype", ("bias",), TypeError, [x, w, _like(w, (n,), bad), a[3]])
    if op == "rope":
        s, d = x.shape[1], x.shape[3]
        brk("x odd head dim", ("x",), ValueError, [x[..., : d - 1]])
        brk("x 3-d", ("x",), ValueError, [x.flatten(0, 1)])
        brk("x int", ("x",), TypeError, [x.to(I32)])
        brk("start_pos negative", ("start_pos",), ValueError, None, start_pos=-1)
        brk("start_pos past 2^24", ("start_pos",), ValueError, None, start_pos=MAX_POSITION - s + 1)
        brk("start_pos 2^63", ("start_pos",), ValueError, None, start_pos=1 << 63)
        brk("start_pos float", ("start_pos",), TypeError, None, start_pos=1.0)
        brk("start_pos bool", ("start_pos",), TypeError, None, start_pos=True)
        brk("start_pos float tensor", ("start_pos",), TypeError, None, start_pos=torch.tensor(1.0))
        for v, e in [(0.0, ValueError), *BAD_REALS]:
            if v is not None:
                brk(f"theta={v!r}", ("theta",), e, None, theta=v)
        brk("interleaved int", ("interleaved",), TypeError, None, interleaved=1)
        brk("interleaved None", ("interleaved",), TypeError, None, interleaved=None)
        # tables as broadcast views: start_pos may be near 2^24 (the checks read shapes only)
        rows = kw["start_pos"] + s

        def table(n: int, width: int = d // 2, dtype: torch.dtype = F32) -> torch.Tensor:
            return torch.ones(1, width, dtype=dtype, device=x.device).expand(n, width)

        brk("one table only", ("cos, sin",), ValueError, None, cos=table(rows + 1), sin=_DROP)
        if rows:
            brk("table too short", ("cos",), ValueError, None, cos=table(rows - 1), sin=table(rows))
        bad = d // 2 + 1 if d // 2 + 1 != d else d + 1  # neither D/2 nor HF's D (at D = 2, D/2 + 1 is D)
        brk("table width", ("cos",), ValueError, None, cos=table(rows, bad), sin=table(rows))
        brk("sin table width", ("sin",), ValueError, None, cos=table(rows), sin=table(rows, bad))
        brk("table int", ("cos",), TypeError, None, cos=table(rows, dtype=I32), sin=table(rows))
    if op == "swiglu_ffn":
        wg, wu, wd = a[1:]
        d, f = case.facts["D"], case.facts["F"]
        brk("x int", ("x",), TypeError, [x.to(I32), wg, wu, wd])
        brk("x D = 0", ("x",), ValueError, [x[..., :0], wg, wu, wd])
        brk("w_gate width", ("w_gate",), ValueError, [x, _like(wg, (f, d + 1)), wu, wd])
        brk("w_gate 1-d", ("w_gate",), ValueError, [x, wg[0], wu, wd])
        brk("w_gate dtype", ("w_gate",), TypeError, [x, wg.to(_other_float(x.dtype)), wu, wd])
        brk("F = 0", ("w_gate",), ValueError, [x, wg[:0], wu[:0], wd[:, :0]])
        brk("w_up rows", ("w_up",), ValueError, [x, wg, _like(wu, (f + 1, d)), wd])
        brk("w_up dtype", ("w_up",), TypeError, [x, wg, wu.to(_other_float(x.dtype)), wd])
        brk("w_down shape", ("w_down",), ValueError, [x, wg, wu, _like(wd, (d, f + 1))])
        brk("w_down dtype", ("w_down",), TypeError, [x, wg, wu, wd.to(_other_float(x.dtype))])
        nw_allowed = (x.dtype, F32) if x.dtype in (F16, torch.bfloat16) else (x.dtype,)
        brk("norm_weight length", ("norm_weight",), ValueError, None, norm_weight=_like(x, (d + 1,)))
        brk(
            "norm_weight dtype",
            ("norm_weight",),
            TypeError,
            None,
            norm_weight=_like(x, (d,), _other_float(x.dtype, nw_allowed)),
        )
        for v, e in BAD_REALS:
            if v is not None:
                brk(f"eps={v!r}", ("eps",), e, None, eps=v)
    if op == "attention":
        q, k, v = a
        b, hkv, skv, d = k.shape
        h = q.shape[1]
        brk(
            "H not a multiple of Hkv",
            ("k",),
            ValueError,
            [q, _like(k, (b, h + 1, skv, d)), _like(v, (b, h + 1, skv, d))],
        )
        brk(
            "k head dim", ("k",), ValueError, [q, k[..., : d - 1] if d > 1 else _like(k, (b, hkv, skv, 2)), v]
        )
        brk("k batch", ("k",), ValueError, [q, _like(k, (b + 1, hkv, skv, d)), v])
        brk("v shape", ("v",), ValueError, [q, k, _like(v, (b, hkv, skv + 1, d))])
        brk("Skv = 0", ("k",), ValueError, [q, k[:, :, :0], v[:, :, :0]])
        brk("D = 0", ("q",), ValueError, [q[..., :0], k[..., :0], v[..., :0]])
        brk("q 3-d", ("q",), ValueError, [q.flatten(0, 1), k, v])
        brk("q int", ("q",), TypeError, [q.to(I32), k, v])
        brk("k dtype", ("k",), TypeError, [q, k.to(_other_float(q.dtype)), v])
        brk("v dtype", ("v",), TypeError, [q, k, v.to(_other_float(q.dtype))])
        brk("causal int", ("causal",), TypeError, None, causal=1)
        brk("causal str", ("causal",), TypeError, None, causal="no")
        for val, e in [(0.0, ValueError), *BAD_REALS]:
            if val is not None:
                brk(f"scale={val!r}", ("scale",), e, None, scale=val)
        if "kv_len" in kw or "kv_len" in _params(ops.attention):
            brk(
                "kv_len shape",
                ("kv_len",),
                ValueError,
                None,
                kv_len=torch.zeros(b + 1, dtype=I32, device=q.device),
            )
            brk(
                "kv_len float",
                ("kv_len",),
                TypeError,
                None,
                kv_len=torch.zeros(b, dtype=F32, device=q.device),
            )
            if b:
                brk(
                    "kv_len past Skv",
                    ("kv_len",),
                    ValueError,
                    None,
                    kv_len=torch.full((b,), skv + 1, dtype=I32, device=q.device),
                )
    if op == "linear_cross_entropy":
        w, t = a[1], a[2]
        h, v = case.facts["H"], case.facts["V"]
        brk("x int", ("x",), TypeError, [x.to(I32), w, t])
        brk("x H = 0", ("x",), ValueError, [x[..., :0], w[:, :0], t])
        brk("weight H mismatch", ("weight",), ValueError, [x, _like(w, (v, h + 1)), t])
        brk("weight 1-d", ("weight",), ValueError, [x, w[0], t])
        brk("weight dtype", ("weight",), TypeError, [x, w.to(_other_float(x.dtype)), t])
        brk("V = 0", ("weight",), ValueError, [x, w[:0], t])
        brk("target int32", ("target",), TypeError, [x, w, t.to(I32)])
        brk("target float", ("target",), TypeError, [x, w, t.to(x.dtype)])
        brk("target shape", ("target",), ValueError, [x, w, _like(t, (*t.shape, 2))])
        brk("target a list", ("target",), TypeError, [x, w, t.tolist()])
        brk("bias V mismatch", ("bias",), ValueError, None, bias=_like(x, (v + 1,)))
        brk("bias dtype", ("bias",), TypeError, None, bias=_like(x, (v,), _other_float(x.dtype)))
        brk("reduction unknown", ("reduction",), ValueError, None, reduction="avg")
        brk("reduction not a str", ("reduction",), TypeError, None, reduction=None)
        brk("ignore_index float", ("ignore_index",), TypeError, None, ignore_index=-100.0)
        brk("ignore_index bool", ("ignore_index",), TypeError, None, ignore_index=True)
        for val, e in [(1.5, ValueError), *BAD_REALS]:
            brk(f"label_smoothing={val!r}", ("label_smoothing",), e, None, label_smoothing=val)
    return out


@pytest.mark.parametrize("op", ops.OPS)
def test_fuzz_invalid(op, backend_name, device):
    strategy = _strategy(op, backend_name, device)
    fn = getattr(ops, op)
    counts: Counter = Counter()

    def body(case: Case, data: st.DataObject) -> None:
        label, args, kwargs, names, exc_type = data.draw(st.sampled_from(_breakers(case)), label="broken")
        repro = f"{case!r} broken: {label} backend={backend_name}"
        with pytest.raises(Exception) as info:  # any type: checked below, with the repro
            fn(*args, **{"backend": backend_name, **kwargs})
        err = info.value
        assert type(err) in (TypeError, ValueError), f"{type(err).__name__}: {err} [{repro}]"
        head = str(err).split(":")[0]
        assert head in names, f"the message names {head!r}, not {' or '.join(names)}: {err} [{repro}]"
        assert isinstance(err, exc_type), (
            f"{type(err).__name__} instead of {exc_type.__name__}: {err} [{repro}]"
        )
        counts[label] += 1
        event(f"broken: {label}")

    body._hypothesis_internal_add_digest = f"invalid/{op}/{backend_name}{STREAM}".encode()
    n = max(20, PROFILES[backend_name].examples[op])
    _settings(n)(given(case=strategy, data=st.data())(body))()
    print(f"fuzz invalid {op} on {backend_name}: {sum(counts.values())} calls, {len(counts)} kinds of break")
