"""The hot path: validated calls remembered per signature (Runner, SizedRunner, GradRunner).

`call_key` builds a public call's key; the first call with a key runs the checks and `apply`, and a later
one goes straight to its runner: a forward-only call allocates and launches (Runner), a call that records
a gradient runs one lean autograd.Function built from the spec's autograd glue (GradRunner).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fusekit import dispatch, outputs
from fusekit.library.autograd import (
    _apply,
    _as_tuple,
    _needs_grad,
    _present,
    apply,
    eager_apply,
    first_order,
    transformed,
)
from fusekit.library.fast_path import compile_run
from fusekit.library.function_apply import applier
from fusekit.library.plan import _PLANS, _RECORD_TRIES, _execute, _Plan, _plan_for, _signature, may_reuse
from fusekit.ops._spec import BACKWARD, FORWARD, OpSpec

# A public op builds a key from what its checks depend on (each tensor's type, shape, strides, dtype,
# device and requires_grad; the scalars as (type, value); backend; grad mode). The first call with a
# key runs the checks and `apply`; a forward-only eager call then stores a `Runner`, and every later
# call with that key skips the checks, the resolution and the plan search: it allocates the outputs
# and launches (FlashInfer's plan/run split); an eager call that records a gradient is remembered as a
# GradRunner. Calls traced by torch.compile never use or fill a memo. Checks that read tensor *values* (attention's kv_len on the
# CPU, rope's [S, D] tables on the CPU) are not in a key, so ops skip the memo for such calls.
_MEMOS: list[dict] = []
_MEMO_SIZE = 1024  # keys per op; a model has a few dozen


def memo() -> dict:
    """A new per-op memo {key: Runner}, cleared by `clear_plans`."""
    m: dict = {}
    _MEMOS.append(m)
    return m


_PLAIN = (bool, int, float, str, type(None))
_SLOTS = 6  # a present tensor's entries in a key: type, shape, strides, dtype, device, requires_grad
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled


def call_key(tensors: tuple, scalars: tuple, backend: object) -> tuple | None:
    """A public call's memo key, or None where it must take the checked path: while torch.compile
    traces, for non-tensor arguments, and for scalars that are not plain Python values (a 0-d tensor
    or numpy start_pos could change value under the same identity), and for tensors whose values are not
    their memory: a lazy negation (neg bit: the general path resolves it, plan._execute) or a sparse,
    nested or mkldnn layout (the checks name the argument).

    One flat tuple (backend, grad mode, per tensor None or its _SLOTS entries, per scalar its type and
    value): hashed and compared without nested tuples, ~1 us less per call than a tuple per tensor on
    the CPU here. `key_tensor` reads a tensor's entries back."""
    if type(backend) is not str or _is_compiling() or transformed():
        return None
    if backend == "auto" and dispatch.capturing():
        return None  # auto may pick another backend inside a capture: the checked path decides
    key = [backend, _grad_enabled()]  # grad mode decides the path (inference_mode: GradRunner asks)
    try:
        for t in tensors:
            if t is None:
                key.append(None)
            elif t.is_neg():
                return None
            else:
                key += (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
    except (AttributeError, TypeError, RuntimeError, NotImplementedError):  # not a tensor; no strides
        return None
    for v in scalars:
        tv = type(v)
        if tv not in _PLAIN:
            return None
        key += (tv, v)  # (type, value): True and 1 hash alike, check differently
    return tuple(key)


def key_slot(i: int) -> int:
    """Where the i-th tensor's entries start in a `call_key` key when every tensor before it is present."""
    return 2 + _SLOTS * i


def key_tensor(key: tuple, i: int) -> tuple | None:
    """The i-th tensor's entries (type, shape, strides, dtype, device, requires_grad) in a `call_key`
    key, or None where that tensor was None (a present tensor's entries start with its type)."""
    pos = 2
    for _ in range(i):
        pos += 1 if key[pos] is None else _SLOTS
    return None if key[pos] is None else key[pos : pos + _SLOTS]


class Runner:
    """A validated forward signature's plan: `runner(inputs)` allocates the outputs and launches.

    `scratch` (per output: a view of the scratch arena, or None) holds the outputs its caller throws away
    (statistics it does not return; outputs.scratch): they are written there instead of allocated."""

    __slots__ = ("fast", "plan", "scratch", "spec")

    def __init__(self, spec: OpSpec, plan: _Plan, scratch: tuple | None = None) -> None:
        self.spec, self.plan, self.scratch = spec, plan, scratch
        self.fast = compile_run(spec, FORWARD, plan, scratch)  # None: the general path every call

    def __call__(self, inputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        fast = self.fast
        if fast is not None:
            return fast(inputs)
        return _execute(self.spec, FORWARD, self.plan, inputs, False, self.scratch)

    def unreplayed(self) -> SizedRunner:
        """This runner for calls that differ from its signature only in sizes its plan does not depend
        on (attention's Skv in a decode step: the outputs, the provider and the copies are the same):
        a copy of the plan that never records or replays launches, since a replay re-issues the
        recorded call's sizes and strides as constants. Each call goes through the provider."""
        plan = object.__new__(_Plan)
        for slot in _Plan.__slots__:
            setattr(plan, slot, getattr(self.plan, slot))
        plan.replay, plan.calls = None, _RECORD_TRIES + 1
        return SizedRunner(self.spec, plan, self.scratch)


class SizedRunner(Runner):
    """An unreplayed runner (Runner.unreplayed) that also tells when a size stops changing.

    A growing KV cache calls it with one size per decode step, as many times in a row as the model has
    layers, then never again with that size. A size repeated far longer than any earlier run of one size
    (and more than PROMOTE_RUN calls: past any model's layer count, so a deep model's decode step is never
    mistaken for it) is a fixed-size workload that reached this runner after a call of another size (a
    benchmark, a sliding window): `repeats(size)` then says True once, and the caller takes the checked
    path for that call, which gives the exact signature its own, replaying, runner."""

    __slots__ = ("last", "longest", "run")
    PROMOTE_RUN = 256

    def __init__(self, spec: OpSpec, plan: _Plan, scratch: tuple | None = None) -> None:
        super().__init__(spec, plan, scratch)
        self.last, self.run, self.longest = None, 0, 0

    def repeats(self, size: object) -> bool:
        if size != self.last:
            self.longest = max(self.longest, self.run)
            self.last, self.run = size, 0
        self.run += 1
        return self.run > max(self.PROMOTE_RUN, 2 * self.longest)


def apply_memo(
    memo_: dict,
    key: tuple | None,
    spec: OpSpec,
    inputs: tuple[Tensor | None, ...],
    scalars: tuple,
    backend: str,
    discard: tuple[str, ...] = (),
) -> tuple[Tensor | None, ...]:
    """`apply`, remembering an eager call under `key` (None: do not remember): a forward-only call's
    plan (Runner), or a call that records a gradient with its backend pinned (GradRunner).

    discard: forward outputs (statistics) the caller throws away; `key` must tell the calls that return
    them apart. A forward-only call's Runner writes them into the scratch arena."""
    if key is None or torch.compiler.is_compiling():
        return apply(spec, inputs, scalars, backend)
    gen = dispatch.generation  # a clear_cache() during this call: remember nothing it resolved
    if _needs_grad(spec, inputs):
        outs, pinned = _apply(spec, inputs, scalars, backend)
        if gen != dispatch.generation:
            return outs
        if len(memo_) >= _MEMO_SIZE:
            memo_.clear()
        memo_[key] = GradRunner(spec, inputs, scalars, pinned)
        return outs
    outs = apply(spec, inputs, scalars, backend)
    plan = _PLANS.get(
        _signature(spec, FORWARD, inputs, scalars, backend, spec.conditions(inputs, save=False))
    )
    if plan is not None and gen == dispatch.generation:
        if len(memo_) >= _MEMO_SIZE:
            memo_.clear()
        memo_[key] = Runner(spec, plan, _scratch(spec, plan, discard) if discard else None)
    return outs


def _scratch(spec: OpSpec, plan: _Plan, discard: tuple[str, ...]) -> tuple | None:
    """Per forward output: a scratch view for a discarded statistic, else None (None: no scratch)."""
    picked = [
        j
        for j, (a, lay) in enumerate(zip(spec.forward.outputs, plan.layout))
        if a.name in discard and lay is not None and not a.grad
    ]
    views = (
        outputs.scratch([plan.layout[j] for j in picked], plan.device) if picked and not plan.empty else None
    )
    if views is None:
        return None
    out: list[Tensor | None] = [None] * len(plan.layout)
    for j, v in zip(picked, views):
        out[j] = v
    return tuple(out)


class GradRunner:
    """A remembered eager call that records a gradient (the key holds requires_grad and grad mode).

    The backend both phases run on was resolved and checked for a backward on the first call. A repeat
    skips every per-call decision: the forward plan is this signature's, what the forward saves, what the
    backward phase reads and which of its outputs are the inputs' grads were read off the spec once (its
    autograd glue only selects tensors, see `_selection`), and the backward plan is cached on the first
    backward. A spec whose glue computes falls back to the generic autograd.Function (`_EAGER`)."""

    __slots__ = ("backend", "bcond", "bplan", "brun", "bsel", "fast", "fplan", "frun", "gsel", "like",
                 "save", "scalars", "spec", "stats", "tail")  # fmt: skip
    # fast: the op's _fast_function, as `function_apply.applier` binds it (cls.apply's steps, once)

    def __init__(self, spec: OpSpec, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str) -> None:
        self.spec, self.scalars, self.backend = spec, scalars, backend
        self.tail = (*scalars, backend, True)  # the generic path's trailing arguments
        cond = spec.conditions(inputs, save=True)
        self.fplan = _PLANS.get(_signature(spec, FORWARD, inputs, scalars, backend, cond))
        self.bplan = self.brun = None  # the backward's plan and its compiled run, from the first backward
        self.fast = self.frun = None
        if self.fplan is not None and not self.fplan.empty and _glue(self, spec, inputs, cond):
            self.fast = _fast_apply(spec)
            self.frun = compile_run(spec, FORWARD, self.fplan)

    def __call__(self, inputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        if _inference_mode():  # enable_grad inside inference_mode: torch records nothing there
            return apply(self.spec, inputs, self.scalars, self.backend)
        if self.fast is not None:
            return self.fast(self, *inputs)
        outs = _as_tuple(eager_apply(self.spec.name)(*inputs, *self.tail))
        return _present(self.spec, inputs, outs, True)


class _From:
    """A placeholder for one tensor of a call while a spec's autograd glue is evaluated once: `src` is
    where the tensor comes from (a position)."""

    __slots__ = ("src",)

    def __init__(self, src: int) -> None:
        self.src = src


def _selection(fn, *args) -> tuple[int | None, ...] | None:
    """The positions `fn(*args)` selects among the placeholders in args, in order (None: no tensor), or
    None when fn does more than select (reads a shape, calls a method, builds a tensor)."""
    try:
        res = fn(*args)
    except Exception:  # a glue function that computes: the generic path runs it per call
        return None
    out = []
    for r in res:
        if r is not None and type(r) is not _From:
            return None
        out.append(None if r is None else r.src)
    return tuple(out)


def _places(args, present: list[bool], base: int) -> dict[str, _From | None]:
    """{tensor name: a placeholder for position base + its index, or None where the tensor is absent}."""
    return {a.name: _From(base + j) if p else None for j, (a, p) in enumerate(zip(args, present))}


def _glue(runner: GradRunner, spec: OpSpec, inputs: tuple, cond: dict[str, bool]) -> bool:
    """Fill the runner's per-signature autograd facts from the spec; False if the glue computes."""
    bp = spec.backward
    if bp is None:
        return False
    fwd, n_in = spec.forward, len(inputs)
    layout = runner.fplan.layout
    out_present = [lay is not None for lay in layout]
    ins = _places(fwd.inputs, [v is not None for v in inputs], 0)
    save = _selection(spec.save, ins, _places(fwd.outputs, out_present, n_in))
    if save is None:
        return False
    n_saved = len(save)
    grads = _places(fwd.outputs, out_present, n_saved)
    bsel = _selection(spec.backward_inputs, tuple(_From(i) for i in range(n_saved)), grads, cond)
    bouts = _places(bp.outputs, [a.when is None or cond.get(a.when, False) for a in bp.outputs], 0)
    gsel = _selection(spec.input_grads, bouts, cond)
    if bsel is None or gsel is None or len(gsel) != n_in:
        return False
    device = runner.fplan.device
    runner.save, runner.bsel, runner.gsel = save, bsel, gsel
    # per output: (shape, dtype, device) of a present differentiable output (its grad; zeros if none came)
    runner.like = tuple(
        None if lay is None or not a.grad else (lay[0], lay[1], device) for a, lay in zip(fwd.outputs, layout)
    )
    runner.stats = tuple(
        j for j, (a, lay) in enumerate(zip(fwd.outputs, layout)) if lay is not None and not a.grad
    )
    runner.bcond = {c: cond[c] for c in bp.conditions}
    return True


_FAST: dict[str, Callable[..., Any]] = {}


def _fast_apply(spec: OpSpec) -> Callable[..., Any]:
    """The apply of the op's autograd.Function for remembered grad calls: forward(ctx, runner, *inputs)."""
    fn = _FAST.get(spec.name)
    if fn is None:
        cls = type(
            f"{spec.name}_fast",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(_fast_forward),
                "backward": staticmethod(first_order(spec.name, _fast_backward, spec.saved_history)),
            },
        )
        fn = _FAST[spec.name] = applier(cls)
    return fn


def _fast_forward(ctx, runner: GradRunner, *ins: Tensor | None) -> tuple[Tensor | None, ...]:
    run = runner.frun
    outs = run(ins) if run is not None else _execute(runner.spec, FORWARD, runner.fplan, ins)
    both = ins + outs
    ctx.save_for_backward(*[None if i is None else both[i] for i in runner.save])
    ctx.fusekit_runner = runner
    # Grads of unused outputs stay None (no zero-fill launch per statistic); the backward fills zeros
    # only for a differentiable output that is present and got no gradient.
    ctx.set_materialize_grads(False)
    if runner.stats:  # statistics carry no gradient (see save_context)
        ctx.mark_non_differentiable(*[outs[j] for j in runner.stats])
    return outs


def _fast_backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    r: GradRunner = ctx.fusekit_runner
    g = []
    same = True  # the grads arrive with their outputs' shapes and dtypes (autograd validates them)
    for gv, like in zip(grads, r.like):
        if like is None:
            g.append(None)  # absent, or a statistic
        elif gv is None:
            g.append(torch.zeros(like[0], dtype=like[1], device=like[2]))
        else:
            same = same and gv.dtype == like[1] and gv.shape == like[0]
            # a lazily negated grad materialized (kernels read memory), then contiguous as any
            g.append((gv.resolve_neg() if gv.is_neg() else gv).contiguous())
    both = ctx.saved_tensors + tuple(g)
    bins = tuple([None if i is None else both[i] for i in r.bsel])
    plan = r.bplan
    if plan is None or not same:  # first backward (or a grad of another layout: its own plan, not cached)
        plan = _plan_for(r.spec, BACKWARD, bins, r.scalars, r.backend, r.bcond)
        if same:
            r.bplan = plan
            r.brun = None if plan.reuse is not None else compile_run(r.spec, BACKWARD, plan)
    run = r.brun if plan is r.bplan else None  # the compiled run of a plan that writes no input
    bouts = run(bins) if run is not None else _execute(r.spec, BACKWARD, plan, bins, may_reuse())
    need = ctx.needs_input_grad  # [0] is the runner
    return (None, *[None if i is None or not need[k + 1] else bouts[i] for k, i in enumerate(r.gsel)])


def clear_plans() -> None:
    """Forget cached call plans and the ops' validated-call memos (dispatch.clear_cache calls this)."""
    _PLANS.clear()
    for m in _MEMOS:
        m.clear()
