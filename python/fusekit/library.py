"""Running an op from its spec: outputs, providers, the torch.library custom ops and autograd.

Every public op ends in `apply(spec, inputs, scalars, backend)` with flattened, contiguous, validated
inputs (inputs the spec marks `strided` may be views: they reach a provider that `reads_strides` as they
are when their last dim is contiguous, and as contiguous copies otherwise). Two ways through, one meaning:

- Eager with no gradient to record (no input requires grad, or grad mode is off): `run` directly —
  allocate the outputs, resolve the backend, call the provider. This skips the dispatcher's per-call
  cost on the inference hot path.
- Otherwise (an input requires grad, or torch.compile is tracing): the custom op
  `torch.ops.fusekit.<op>`, whose autograd formula (registered once per op, here) saves what the
  spec says and calls `torch.ops.fusekit.<op>_backward`. torch.compile(fullgraph=True) sees both as
  single nodes with fake implementations.

A call that needs a gradient resolves its backend for both phases before running anything, so a
backend without a backward raises naming op, backend and input instead of detaching silently.
Absent optional outputs travel through the custom ops as 0-element placeholders and come back as
None. Empty problems are answered here (outputs zero-filled), so providers never see them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusekit import dispatch, outputs
from fusekit.ops._spec import BACKWARD, FORWARD, SAVE, OpSpec

_SPECS: dict[str, OpSpec] = {}


# --- one phase on one backend ----------------------------------------------------------------------
def _device(values: tuple[Tensor | None, ...]) -> torch.device:
    return next(v.device for v in values if v is not None)


_STRIDED: dict[tuple[str, str], tuple[int, ...]] = {}


def _strided(spec: OpSpec, phase: str) -> tuple[int, ...]:
    """Positions of the phase's inputs that the spec lets arrive as strided views."""
    key = (spec.name, phase)
    pos = _STRIDED.get(key)
    if pos is None:
        pos = _STRIDED[key] = tuple(i for i, a in enumerate(spec.phase(phase).inputs) if a.strided)
    return pos


class _Plan:
    """Everything a call signature decides once (FlashInfer's plan/run split): output layouts, the
    provider, the scalars it receives, whether the problem is empty, the device guard, and which strided
    inputs the provider needs as contiguous copies (`contig`)."""

    __slots__ = ("calls", "contig", "device", "empty", "guard", "kscalars", "layout", "provider", "replay")

    def __init__(
        self, spec: OpSpec, phase: str, inputs: tuple, scalars: tuple, backend: str, cond: dict
    ) -> None:
        named = dict(zip(spec.scalar_names, scalars))
        device = self.device = _device(inputs)
        p = spec.phase(phase)
        self.layout = tuple(spec.output_layout(phase, inputs, named, cond))
        self.empty = inputs[0] is not None and inputs[0].numel() == 0
        key = tuple(spec.dtype_of(v, p.inputs, inputs, named) for v in spec.dtype_vars)
        meta = spec.meta(dict(zip((a.name for a in p.inputs), inputs)), named)
        cls = dispatch.shape_class(spec.name, inputs)  # picks auto's ranking (decode, small, large)
        self.provider = (
            None
            if self.empty
            else dispatch.resolve(spec.name, backend, device, key, phase=phase, shape_class=cls, **meta)
        )
        self.kscalars = spec.kernel_scalars(scalars)
        self.guard = device.type == "cuda"
        # The provider's replay of this signature's launches (Backend.record), tried on calls 2..4:
        # the first call may compile and tune, and a call that is not pure launches never records.
        self.replay = None
        self.calls = 0 if self.guard else _RECORD_TRIES + 1
        # Strided views go through as they are only to a provider that reads strides, and only with a
        # contiguous last dim (the kernels index it directly); the strides are in the plan's signature.
        reads = self.provider is not None and self.provider.reads_strides
        self.contig = tuple(
            i
            for i in _strided(spec, phase)
            if inputs[i] is not None
            and not (reads and inputs[i].stride(-1) == 1)
            and not inputs[i].is_contiguous()
        )


_PLANS: dict[tuple, _Plan] = {}
_PLAN_CACHE = 4096  # signatures kept; a model has a few dozen, a shape sweep more


def _signature(spec: OpSpec, phase: str, inputs: tuple, scalars: tuple, backend: str, cond: dict) -> tuple:
    sig = (
        spec.name,
        phase,
        backend,
        scalars,
        tuple(cond.values()),
        tuple(None if t is None else (t.shape, t.dtype, t.device) for t in inputs),
    )
    if backend == "auto" and dispatch.capturing():  # auto skips capture-unsafe backends (own plans)
        sig += ("capturing",)
    strided = _strided(spec, phase)
    if strided:  # a view's layout decides whether it is copied (see _Plan.contig)
        sig += tuple(None if inputs[i] is None else inputs[i].stride() for i in strided)
    return sig


def _allocate(spec: OpSpec, phase: str, plan: _Plan) -> tuple[Tensor | None, ...]:
    """The phase's outputs (poisoned in tests). Out of GPU memory: torch's OutOfMemoryError again, naming
    the op and what it asked for (what was allocated before the failure is freed with this frame)."""
    empty, device = outputs.empty, plan.device
    try:  # a list comprehension: cheaper than a generator on this path
        return tuple([None if lay is None else empty(lay[0], lay[1], device) for lay in plan.layout])
    except torch.OutOfMemoryError as exc:
        lays = [lay for lay in plan.layout if lay is not None]
        wanted = [(tuple(shape), str(dt).removeprefix("torch.")) for shape, dt in lays]
        total = sum(math.prod(shape) * dt.itemsize for shape, dt in lays)
        raise torch.OutOfMemoryError(
            f"fusekit.{spec.name} ({phase}): out of memory allocating its outputs {wanted} "
            f"({total / 2**30:.2f} GiB in all) on {device}. {exc}"
        ) from exc


def _refuse_first_call_in_capture(spec: OpSpec, phase: str, plan: _Plan) -> None:
    """A provider's first call of a signature may compile or tune (timing runs, synchronization): inside
    a CUDA graph capture that would fail deep in CUDA or record the tuning runs, so it is refused here."""
    setup = plan.provider is not None and plan.provider.first_call_setup
    if plan.guard and setup and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fusekit.{spec.name} ({phase}, backend {plan.provider.name!r}): the first call of this "
            "shape/dtype/layout is inside a CUDA graph capture, and a first call compiles and tunes. "
            "Run the same call once before capturing (a warm-up, as torch.cuda.graph requires); "
            "later calls only launch and capture fine"
        )


def run(
    spec: OpSpec,
    phase: str,
    inputs: tuple[Tensor | None, ...],
    scalars: tuple,
    backend: str,
    cond: dict[str, bool],
) -> tuple[Tensor | None, ...]:
    """Allocate `phase`'s outputs and have the resolved provider fill them (plan cached per signature)."""
    return _execute(spec, phase, _plan_for(spec, phase, inputs, scalars, backend, cond), inputs)


def _plan_for(
    spec: OpSpec, phase: str, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str, cond: dict
) -> _Plan:
    """The cached plan of a call signature (made, and refused inside a capture, on its first call)."""
    sig = _signature(spec, phase, inputs, scalars, backend, cond)
    plan = _PLANS.get(sig)
    if plan is None:
        plan = _Plan(spec, phase, inputs, scalars, backend, cond)
        _refuse_first_call_in_capture(spec, phase, plan)
        if len(_PLANS) >= _PLAN_CACHE:
            _PLANS.clear()
        _PLANS[sig] = plan
    return plan


# torch.cuda.current_device() minus its lazy-init check: a guarded plan exists only for CUDA tensors,
# so CUDA is initialized by the time it is asked.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _execute(
    spec: OpSpec, phase: str, plan: _Plan, inputs: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...]:
    """One call of a planned signature: contiguous copies where the plan says, outputs, the launch."""
    if plan.contig:
        inputs = tuple(v.contiguous() if i in plan.contig else v for i, v in enumerate(inputs))
    outs = _allocate(spec, phase, plan)
    if plan.empty:
        for o in outs:
            if o is not None:
                o.zero_()
        return outs
    device = plan.device  # in the signature
    if plan.guard and device.index != _current_device():
        with torch.cuda.device(device):  # launch on the tensors' GPU, not the current one
            _launch(spec, phase, plan, outs, inputs)
    else:
        _launch(spec, phase, plan, outs, inputs)
    return outs


_RECORD_TRIES = 3  # calls (after the first) on which a plan tries to record a replay


def _launch(spec: OpSpec, phase: str, plan: _Plan, outs: tuple, inputs: tuple) -> None:
    """The provider's kernels for one call: replayed when the plan has a replay that accepts this call
    (same pointer alignments), else through the provider (recording a replay on calls 2..4)."""
    replay = plan.replay
    if replay is not None and replay(outs, inputs):
        return
    calls = plan.calls
    if calls <= _RECORD_TRIES:  # counted only up to the last call that may record
        plan.calls = calls + 1
        if calls and replay is None:
            plan.replay = plan.provider.record(spec, phase, outs, inputs, plan.kscalars)
            return
    plan.provider.run(spec, phase, outs, inputs, plan.kscalars)


def clear_plans() -> None:
    """Forget cached call plans and the ops' validated-call memos (dispatch.clear_cache calls this)."""
    _PLANS.clear()
    for m in _MEMOS:
        m.clear()


# --- the hot path: validated calls remembered per signature --------------------------------------
# A public op builds a key from what its checks depend on (each tensor's type, shape, strides, dtype,
# device and requires_grad; the scalars as (type, value); backend; grad mode). The first call with a
# key runs the checks and `apply`; a forward-only eager call then stores a `Runner`, and every later
# call with that key skips the checks, the resolution and the plan search: it allocates the outputs
# and launches (FlashInfer's plan/run split). Calls that record a gradient or are traced by
# torch.compile never use or fill a memo. Checks that read tensor *values* (attention's kv_len on the
# CPU, rope's [S, D] tables on the CPU) are not in a key, so ops skip the memo for such calls.
_MEMOS: list[dict] = []
_MEMO_SIZE = 1024  # keys per op; a model has a few dozen


def memo() -> dict:
    """A new per-op memo {key: Runner}, cleared by `clear_plans`."""
    m: dict = {}
    _MEMOS.append(m)
    return m


_PLAIN = (bool, int, float, str, type(None))


def call_key(tensors: tuple, scalars: tuple, backend: object) -> tuple | None:
    """A public call's memo key, or None where it must take the checked path: while torch.compile
    traces, for non-tensor arguments, and for scalars that are not plain Python values (a 0-d tensor
    or numpy start_pos could change value under the same identity)."""
    if type(backend) is not str or torch.compiler.is_compiling():
        return None
    if backend == "auto" and dispatch.capturing():
        return None  # auto may pick another backend inside a capture: the checked path decides
    try:  # list comprehensions: cheaper than generators on this path
        tk = tuple([
            None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
            for t in tensors
        ])  # fmt: skip
    except (AttributeError, TypeError):
        return None
    sk = tuple([(type(v), v) for v in scalars])  # (type, value): True and 1 hash alike, check differently
    for tv in sk:
        if tv[0] not in _PLAIN:
            return None
    return (tk, sk, backend, torch.is_grad_enabled())  # grad mode decides the path


class Runner:
    """A validated forward signature's plan: `runner(inputs)` allocates the outputs and launches."""

    __slots__ = ("plan", "spec")

    def __init__(self, spec: OpSpec, plan: _Plan) -> None:
        self.spec, self.plan = spec, plan

    def __call__(self, inputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        return _execute(self.spec, FORWARD, self.plan, inputs)

    def unreplayed(self) -> SizedRunner:
        """This runner for calls that differ from its signature only in sizes its plan does not depend
        on (attention's Skv in a decode step: the outputs, the provider and the copies are the same):
        a copy of the plan that never records or replays launches, since a replay re-issues the
        recorded call's sizes and strides as constants. Each call goes through the provider."""
        plan = object.__new__(_Plan)
        for slot in _Plan.__slots__:
            setattr(plan, slot, getattr(self.plan, slot))
        plan.replay, plan.calls = None, _RECORD_TRIES + 1
        return SizedRunner(self.spec, plan)


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

    def __init__(self, spec: OpSpec, plan: _Plan) -> None:
        super().__init__(spec, plan)
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
) -> tuple[Tensor | None, ...]:
    """`apply`, remembering an eager call under `key` (None: do not remember): a forward-only call's
    plan (Runner), or a call that records a gradient with its backend pinned (GradRunner)."""
    if key is None or torch.compiler.is_compiling():
        return apply(spec, inputs, scalars, backend)
    if _needs_grad(spec, inputs):
        outs, pinned = _apply(spec, inputs, scalars, backend)
        if len(memo_) >= _MEMO_SIZE:
            memo_.clear()
        memo_[key] = GradRunner(spec, inputs, scalars, pinned)
        return outs
    outs = apply(spec, inputs, scalars, backend)
    plan = _PLANS.get(
        _signature(spec, FORWARD, inputs, scalars, backend, spec.conditions(inputs, save=False))
    )
    if plan is not None:
        if len(memo_) >= _MEMO_SIZE:
            memo_.clear()
        memo_[key] = Runner(spec, plan)
    return outs


# --- the public entry ------------------------------------------------------------------------------
_GRAD_POS: dict[str, tuple[tuple[int, str], ...]] = {}


def _needs_grad(spec: OpSpec, inputs: tuple[Tensor | None, ...]) -> list[str]:
    """Names of the inputs that require grad (none under no_grad)."""
    if not torch.is_grad_enabled():
        return []
    pos = _GRAD_POS.get(spec.name)
    if pos is None:
        pos = _GRAD_POS[spec.name] = tuple(
            (i, a.name) for i, a in enumerate(spec.forward.inputs) if a.name in spec.grad_inputs
        )
    return [n for i, n in pos if inputs[i] is not None and inputs[i].requires_grad]


def _check_backward(
    spec: OpSpec, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str, who: list[str]
) -> str:
    """The backend both phases run on; raises (naming op, backend, input) when it has no backward."""
    named = dict(zip(spec.scalar_names, scalars))
    key = tuple(spec.dtype_of(v, spec.forward.inputs, inputs, named) for v in spec.dtype_vars)
    meta = spec.meta(dict(zip((a.name for a in spec.forward.inputs), inputs)), named)
    device = _device(inputs)
    try:
        cls = dispatch.shape_class(spec.name, inputs)
        chosen = dispatch.resolve(
            spec.name, backend, device, key, phase=BACKWARD, shape_class=cls, **meta
        ).name
    except ValueError as exc:
        raise ValueError(
            f"{who[0]}: requires grad, but {spec.name} has no backward here: {exc}. Detach the input, "
            "run under torch.no_grad(), or pick a backend with a backward (backend='torch' always has one)"
        ) from exc
    return chosen


class GradRunner:
    """A remembered eager call that records a gradient (the key holds requires_grad and grad mode).

    The backend both phases run on was resolved and checked for a backward on the first call. A repeat
    skips every per-call decision: the forward plan is this signature's, what the forward saves, what the
    backward phase reads and which of its outputs are the inputs' grads were read off the spec once (its
    autograd glue only selects tensors, see `_selection`), and the backward plan is cached on the first
    backward. A spec whose glue computes falls back to the generic autograd.Function (`_EAGER`)."""

    __slots__ = ("backend", "bcond", "bplan", "bsel", "fast", "fplan", "gsel", "like", "save",
                 "scalars", "spec", "stats", "tail")  # fmt: skip

    def __init__(self, spec: OpSpec, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str) -> None:
        self.spec, self.scalars, self.backend = spec, scalars, backend
        self.tail = (*scalars, backend, True)  # the generic path's trailing arguments
        cond = spec.conditions(inputs, save=True)
        self.fplan = _PLANS.get(_signature(spec, FORWARD, inputs, scalars, backend, cond))
        self.bplan = None
        self.fast = None
        if self.fplan is not None and not self.fplan.empty and _glue(self, spec, inputs, cond):
            self.fast = _fast_function(spec)

    def __call__(self, inputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        if self.fast is not None:
            return self.fast.apply(self, *inputs)
        outs = _as_tuple(_EAGER[self.spec.name].apply(*inputs, *self.tail))
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


def _glue(runner: GradRunner, spec: OpSpec, inputs: tuple, cond: dict[str, bool]) -> bool:
    """Fill the runner's per-signature autograd facts from the spec; False if the glue computes."""
    bp = spec.backward
    if bp is None:
        return False
    fwd, n_in = spec.forward, len(inputs)
    layout = runner.fplan.layout
    ins = {a.name: None if v is None else _From(i) for i, (a, v) in enumerate(zip(fwd.inputs, inputs))}
    outs = {
        a.name: None if lay is None else _From(n_in + j)
        for j, (a, lay) in enumerate(zip(fwd.outputs, layout))
    }
    save = _selection(spec.save, ins, outs)
    if save is None:
        return False
    n_saved = len(save)
    grads = {
        a.name: None if lay is None else _From(n_saved + j)
        for j, (a, lay) in enumerate(zip(fwd.outputs, layout))
    }
    bsel = _selection(spec.backward_inputs, tuple(_From(i) for i in range(n_saved)), grads, cond)
    bouts = {
        a.name: None if a.when is not None and not cond.get(a.when) else _From(j)
        for j, a in enumerate(bp.outputs)
    }
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


_FAST: dict[str, type[torch.autograd.Function]] = {}


def _fast_function(spec: OpSpec) -> type[torch.autograd.Function]:
    """The op's autograd.Function for remembered grad calls: forward(ctx, runner, *inputs)."""
    fn = _FAST.get(spec.name)
    if fn is None:
        fn = _FAST[spec.name] = type(
            f"{spec.name}_fast",
            (torch.autograd.Function,),
            {"forward": staticmethod(_fast_forward), "backward": staticmethod(_fast_backward)},
        )
    return fn


def _fast_forward(ctx, runner: GradRunner, *ins: Tensor | None) -> tuple[Tensor | None, ...]:
    outs = _execute(runner.spec, FORWARD, runner.fplan, ins)
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
            g.append(gv.contiguous())
    both = ctx.saved_tensors + tuple(g)
    bins = tuple([None if i is None else both[i] for i in r.bsel])
    plan = r.bplan
    if plan is None or not same:  # first backward (or a grad of another layout: its own plan, not cached)
        plan = _plan_for(r.spec, BACKWARD, bins, r.scalars, r.backend, r.bcond)
        if same:
            r.bplan = plan
    bouts = _execute(r.spec, BACKWARD, plan, bins)
    need = ctx.needs_input_grad  # [0] is the runner
    return (None, *[None if i is None or not need[k + 1] else bouts[i] for k, i in enumerate(r.gsel)])


def _present(spec: OpSpec, inputs: tuple, outs: tuple, save: bool) -> tuple:
    """Placeholders of outputs the call does not produce back to None."""
    cond = spec.conditions(inputs, save=save)
    return tuple(
        None if a.when is not None and not cond.get(a.when) else o for a, o in zip(spec.forward.outputs, outs)
    )


def apply(
    spec: OpSpec, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str
) -> tuple[Tensor | None, ...]:
    """Forward of `spec` on prepared inputs: direct, or through the custom op when grads or compile need it."""
    return _apply(spec, inputs, scalars, backend)[0]


def _apply(
    spec: OpSpec, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str
) -> tuple[tuple[Tensor | None, ...], str]:
    """`apply`, and the backend the call was pinned to (the given one where nothing was pinned)."""
    who = _needs_grad(spec, inputs)
    if who and spec.backward is None:
        if spec.grad_view is None:
            raise ValueError(f"{who[0]}: requires grad, but {spec.name} has no gradient")
    elif who:
        # Pin the backend for both phases: forward and backward must be one backend's pair.
        backend = _check_backward(spec, inputs, scalars, backend, who)
    compiling = torch.compiler.is_compiling()
    if not who and not compiling:
        return run(spec, FORWARD, inputs, scalars, backend, spec.conditions(inputs, save=False)), backend
    if compiling:
        outs = _as_tuple(getattr(torch.ops.fusekit, spec.name)(*inputs, *scalars, backend, bool(who)))
    else:  # eager with grads: the same formula as a plain autograd.Function (no dispatcher round trips)
        outs = _as_tuple(_EAGER[spec.name].apply(*inputs, *scalars, backend, bool(who)))
    return _present(spec, inputs, outs, bool(who)), backend


# --- custom ops ------------------------------------------------------------------------------------
# Eager calls that record a gradient run the registered autograd formula as a plain
# torch.autograd.Function: torch.library's custom-op dispatch (autograd kernel, redispatch, the
# aliasing check, dynamo-disable wrappers) costs ~0.5 ms of host time per forward+backward on the H200's
# host, more than the kernels at most training shapes. torch.compile still traces the custom ops.
_EAGER: dict[str, type[torch.autograd.Function]] = {}


def _eager_function(name: str, forward, setup_context, backward) -> type[torch.autograd.Function]:
    """The eager Function of an op whose gradient is a view of its output grads (_register_view_grad;
    _register builds its own, with zero-filling for unused outputs). forward(ctx, *args) calls
    setup_context itself: a Function with a separate setup_context binds its arguments through
    inspect.signature on every call (~15 us)."""

    def fwd(ctx, *args):
        out = forward(*args)
        setup_context(ctx, args, out)
        ctx.set_materialize_grads(False)  # no zero-fill launch (reduce_sum, the one such op, has one output)
        return out

    return type(
        f"{name}_eager",
        (torch.autograd.Function,),
        {"forward": staticmethod(fwd), "backward": staticmethod(backward)},
    )


def _schema_tensor(arg, optional: bool) -> str:
    return f"Tensor{'?' if optional else ''} {arg.name}"


def _placeholders(device: torch.device, outs: tuple[Tensor | None, ...]) -> tuple[Tensor, ...] | Tensor:
    """What a custom op returns: absent outputs as 0-element tensors; one output as itself (schema rule)."""
    res = tuple(o if o is not None else torch.empty(0, device=device) for o in outs)
    return res[0] if len(res) == 1 else res


def _as_tuple(outs: Tensor | tuple | list) -> tuple:
    return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)


def _register(spec: OpSpec) -> None:
    n_in, n_sc = len(spec.forward.inputs), len(spec.scalars)
    fwd_args = ", ".join(
        [_schema_tensor(a, a.optional) for a in spec.forward.inputs]
        + [s.schema for s in spec.scalars]
        + ["str backend", "bool save"]
    )
    fwd_ret = ", ".join("Tensor" for _ in spec.forward.outputs)

    def split(args: tuple) -> tuple[tuple, tuple, str, bool]:
        return args[:n_in], args[n_in : n_in + n_sc], args[n_in + n_sc], args[n_in + n_sc + 1]

    def forward_impl(*args):  # absent outputs as 0-element placeholders, as the custom-op schema needs
        ins, sc, backend, save = split(args)
        return _placeholders(_device(ins), run(spec, FORWARD, ins, sc, backend, spec.conditions(ins, save)))

    def forward_fake(*args):
        ins, sc, _, save = split(args)
        named = dict(zip(spec.scalar_names, sc))
        lay = spec.output_layout(FORWARD, ins, named, spec.conditions(ins, save))
        dev = _device(ins)
        return _placeholders(
            dev, tuple(None if lo is None else torch.empty(lo[0], dtype=lo[1], device=dev) for lo in lay)
        )

    op = torch.library.custom_op(
        f"fusekit::{spec.name}", forward_impl, mutates_args=(), schema=f"({fwd_args}) -> ({fwd_ret})"
    )
    op.register_fake(forward_fake)
    in_names = tuple(a.name for a in spec.forward.inputs)
    out_names = tuple(a.name for a in spec.forward.outputs)
    if spec.backward is None:
        if spec.grad_view is not None:
            _register_view_grad(op, spec, split, in_names, out_names, n_sc, forward_impl)
        return

    bp = spec.backward
    n_bin = len(bp.inputs)
    bwd_args = ", ".join(
        [_schema_tensor(a, a.optional) for a in bp.inputs]
        + [s.schema for s in spec.scalars]
        + ["str backend"]
        + [f"bool has_{c}" for c in bp.conditions]  # has_: a condition may share an input's name
    )
    bwd_ret = ", ".join("Tensor" for _ in bp.outputs)

    def bsplit(args: tuple) -> tuple[tuple, tuple, str, dict[str, bool]]:
        ins, sc = args[:n_bin], args[n_bin : n_bin + n_sc]
        backend = args[n_bin + n_sc]
        return ins, sc, backend, dict(zip(bp.conditions, args[n_bin + n_sc + 1 :]))

    def backward_impl(*args):
        ins, sc, backend, cond = bsplit(args)
        return _placeholders(_device(ins), run(spec, BACKWARD, ins, sc, backend, cond))

    def backward_fake(*args):
        ins, sc, _, cond = bsplit(args)
        lay = spec.output_layout(BACKWARD, ins, dict(zip(spec.scalar_names, sc)), cond)
        dev = _device(ins)
        return _placeholders(
            dev, tuple(None if lo is None else torch.empty(lo[0], dtype=lo[1], device=dev) for lo in lay)
        )

    bop = torch.library.custom_op(
        f"fusekit::{spec.name}_backward",
        backward_impl,
        mutates_args=(),
        schema=f"({bwd_args}) -> ({bwd_ret})",
    )
    bop.register_fake(backward_fake)

    # Per-op facts the autograd phases read on every call, decided once here.
    out_meta = tuple((n, a.when, a.grad) for n, a in zip(out_names, spec.forward.outputs))
    bout_meta = tuple((a.name, a.when) for a in bp.outputs)
    bconds, n_pass = bp.conditions, n_sc + 2
    bop_call = getattr(torch.ops.fusekit, f"{spec.name}_backward")  # what torch.compile traces

    def save_context(ctx, ins: tuple, sc: tuple, backend: str, cond: dict, output: tuple) -> None:
        outs = {n: None if w is not None and not cond.get(w) else o for (n, w, _), o in zip(out_meta, output)}
        ctx.save_for_backward(*spec.save(dict(zip(in_names, ins)), outs))
        ctx.fusekit = (sc, backend, cond, tuple(v is not None for v in ins))
        # Statistics and saved values carry no gradient (as torch's own native_layer_norm's mean/rstd):
        # marking them says so, instead of silently dropping what would flow into them.
        stats = [o for (_, _, gr), o in zip(out_meta, outs.values()) if not gr and o is not None]
        if stats:
            ctx.mark_non_differentiable(*stats)

    def setup_context(ctx, inputs, output) -> None:
        ins, sc, backend, save = split(tuple(inputs))
        save_context(ctx, ins, sc, backend, spec.conditions(ins, save), _as_tuple(output))

    def input_grads(ctx, g: dict, eager: bool) -> tuple:
        """The backward phase from the output grads `g` (name -> contiguous grad or None), as autograd
        wants it back: one grad per forward argument, None for scalars, backend and save."""
        sc, backend, cond, present = ctx.fusekit
        bins = spec.backward_inputs(ctx.saved_tensors, g, cond)
        if eager:  # straight to the plan, as backward_impl does after unpacking its arguments
            bouts = run(spec, BACKWARD, tuple(bins), sc, backend, {c: cond[c] for c in bconds})
        else:
            bouts = _as_tuple(bop_call(*bins, *sc, backend, *(cond[c] for c in bconds)))
        named = {n: (None if w is not None and not cond.get(w) else o) for (n, w), o in zip(bout_meta, bouts)}
        gin = spec.input_grads(named, cond)
        gin = tuple(v if p and needed else None for v, p, needed in zip(gin, present, ctx.needs_input_grad))
        return (*gin, *((None,) * n_pass))

    def backward(ctx, *grads):
        # Autograd materializes unused outputs' grads as zeros; absent outputs' placeholders map to None.
        cond = ctx.fusekit[2]
        g = {
            n: None if gr is None or (w is not None and not cond.get(w)) else gr.contiguous()
            for (n, w, _), gr in zip(out_meta, grads)
        }
        return input_grads(ctx, g, False)

    op.register_autograd(backward, setup_context=setup_context)

    # Eager calls that record a gradient: the same formula as a plain autograd.Function whose forward
    # sets up the context itself (a Function with a separate setup_context binds its arguments through
    # inspect.signature on every call, ~15 us) and whose phases go straight to their plans.
    def eager_forward(ctx, *args):
        ins, sc, backend, save = split(args)
        cond = spec.conditions(ins, save)
        out = run(spec, FORWARD, ins, sc, backend, cond)
        save_context(ctx, ins, sc, backend, cond, out)
        # Grads of unused outputs stay None (no zero-fill launch per statistic); the backward fills
        # zeros only for a differentiable output that is present and got no gradient.
        ctx.set_materialize_grads(False)
        ctx.fusekit_like = tuple(
            None if o is None or not gr else (o.shape, o.dtype, o.device)
            for (_, _, gr), o in zip(out_meta, out)
        )
        return out

    def eager_backward(ctx, *grads):
        cond, g = ctx.fusekit[2], {}
        for (n, w, _), gr, like in zip(out_meta, grads, ctx.fusekit_like):
            if w is not None and not cond.get(w):
                g[n] = None  # an absent output
            elif gr is None:  # present, no gradient reached it: zeros if it is differentiable
                g[n] = None if like is None else torch.zeros(like[0], dtype=like[1], device=like[2])
            else:
                g[n] = gr.contiguous()
        return input_grads(ctx, g, True)

    _EAGER[spec.name] = type(
        f"{spec.name}_eager",
        (torch.autograd.Function,),
        {"forward": staticmethod(eager_forward), "backward": staticmethod(eager_backward)},
    )


def _register_view_grad(op, spec: OpSpec, split, in_names, out_names, n_sc: int, forward_impl) -> None:
    """Autograd for an op whose gradient is a view of its output grads (no backward kernel)."""

    def setup_context(ctx, inputs, output) -> None:
        ins = split(tuple(inputs))[0]
        ctx.fusekit = tuple(None if v is None else (v.shape, v.dtype) for v in ins)

    def backward(ctx, *grads):
        gin = spec.grad_view(dict(zip(out_names, grads)), ctx.fusekit)
        gin = tuple(v if needed else None for v, needed in zip(gin, ctx.needs_input_grad))
        return (*gin, *(None for _ in range(n_sc + 2)))

    op.register_autograd(backward, setup_context=setup_context)
    _EAGER[spec.name] = _eager_function(spec.name, forward_impl, setup_context, backward)


def register(spec: OpSpec) -> OpSpec:
    """Register an op's custom ops and autograd formula (once per process); returns the spec."""
    if spec.name not in _SPECS:
        _register(spec)
        _SPECS[spec.name] = spec
    return spec


def specs() -> dict[str, OpSpec]:
    return dict(_SPECS)


__all__ = ["SAVE", "apply", "register", "run", "specs"]
