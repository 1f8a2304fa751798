"""One phase of an op on one backend: the call plan cached per signature, outputs, the launch.

`run(spec, phase, inputs, scalars, backend, cond)` finds (or makes, once per call signature) the plan -
output layouts, the resolved provider, strided inputs to copy, the device guard - allocates the outputs and
has the provider fill them, replaying its recorded launches where it can (FlashInfer's plan/run split).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusekit import dispatch, outputs
from fusekit.backends.base import Backend
from fusekit.ops import _amp
from fusekit.ops._spec import OpSpec


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

    __slots__ = (
        "calls", "contig", "device", "empty", "guard", "kscalars", "layout", "provider", "replay", "reuse",
        "staged", "strides",
    )  # fmt: skip

    def __init__(
        self, spec: OpSpec, phase: str, inputs: tuple, scalars: tuple, backend: str, cond: dict
    ) -> None:
        named = dict(zip(spec.scalar_names, scalars))
        device = self.device = _device(inputs)
        p = spec.phase(phase)
        self.layout = tuple(spec.output_layout(phase, inputs, named, cond))
        # per output: strides where it takes an input's memory order (TensorArg.like), or None for all
        self.strides = spec.output_strides(phase, inputs)
        # per output: the position of the input an eager call writes it into (Phase.reuse), or None
        in_pos = {a.name: i for i, a in enumerate(p.inputs)}
        pairs = dict(p.reuse)
        self.reuse = tuple(in_pos.get(pairs.get(a.name)) for a in p.outputs) if pairs else None
        self.empty = inputs[0] is not None and inputs[0].numel() == 0
        # resolved for an empty call too (which launches nothing): a backend that cannot run this call
        # refuses it whatever the size, as it does with grad
        provider = resolve(spec, phase, inputs, scalars, backend)
        self.provider = None if self.empty else provider
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
        # Outputs in an input's memory order that the provider cannot write through strides: it fills
        # contiguous buffers and the library copies them into the strided outputs (_execute).
        writes = self.provider is not None and self.provider.writes_strides
        self.staged = (
            ()
            if self.strides is None or writes or self.empty
            else tuple(
                j for j, st in enumerate(self.strides) if st is not None and self.layout[j] is not None
            )
        )


def resolve(
    spec: OpSpec, phase: str, inputs: tuple, scalars: tuple, backend: str, inputs_of: str | None = None
) -> Backend:
    """The backend that runs `phase` of a call of `spec` (dispatch.resolve with the call's dtypes, meta
    and shape class), `inputs` being those of phase `inputs_of` (default: `phase`)."""
    named = dict(zip(spec.scalar_names, scalars))
    p = spec.phase(inputs_of or phase)
    key = tuple(spec.dtype_of(v, p.inputs, inputs, named) for v in spec.dtype_vars)
    meta = spec.meta(dict(zip((a.name for a in p.inputs), inputs)), named)
    device = _device(inputs)
    # picks auto's ranking (decode, small, large); None where the choice does not read it
    cls = dispatch.auto_shape_class(spec.name, backend, device.type, inputs)
    return dispatch.resolve(spec.name, backend, device, key, phase=phase, shape_class=cls, **meta)


_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def may_reuse() -> bool:
    """Whether an eager backward may write its outputs into what its forward saved (Phase.reuse): not
    when the graph is kept for another backward (retain_graph=True, gradcheck), nor where torch cannot
    tell (then it allocates, as a traced backward does)."""
    return _KEEP_GRAPH is not None and not _KEEP_GRAPH()


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


def _allocate(
    spec: OpSpec, phase: str, plan: _Plan, reuse: tuple | None = None, scratch: tuple | None = None
) -> tuple[Tensor | None, ...]:
    """The phase's outputs (poisoned in tests); with `reuse` (an eager call's inputs), outputs the phase
    writes in place (Phase.reuse) are those inputs; with `scratch` (a remembered forward call's), outputs
    the caller throws away are those views of the scratch arena (outputs.scratch). Out of GPU memory:
    torch's OutOfMemoryError again, naming the op and what it asked for (what was allocated before the
    failure is freed with this frame)."""
    empty, device = outputs.empty, plan.device
    try:  # a list comprehension: cheaper than a generator on this path
        if plan.strides is not None:  # some outputs take an input's memory order (TensorArg.like)
            return _allocate_strided(plan, reuse, scratch)
        if scratch is not None:
            return tuple([
                s if s is not None else None if lay is None else empty(lay[0], lay[1], device)
                for lay, s in zip(plan.layout, scratch)
            ])  # fmt: skip
        if reuse is not None and plan.reuse is not None:
            return tuple([
                None if lay is None else empty(lay[0], lay[1], device) if j is None else reuse[j]
                for lay, j in zip(plan.layout, plan.reuse)
            ])  # fmt: skip
        return tuple([None if lay is None else empty(lay[0], lay[1], device) for lay in plan.layout])
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(spec, phase, plan, exc) from exc


def out_of_memory(spec: OpSpec, phase: str, plan: _Plan, exc: BaseException) -> torch.OutOfMemoryError:
    """torch's OutOfMemoryError again, naming the op, the phase and the outputs it asked for."""
    lays = [lay for lay in plan.layout if lay is not None]
    wanted = [(tuple(shape), str(dt).removeprefix("torch.")) for shape, dt in lays]
    total = sum(math.prod(shape) * dt.itemsize for shape, dt in lays)
    return torch.OutOfMemoryError(
        f"fusekit.{spec.name} ({phase}): out of memory allocating its outputs {wanted} "
        f"({total / 2**30:.2f} GiB in all) on {plan.device}. {exc}"
    )


def _allocate_strided(plan: _Plan, reuse: tuple | None, scratch: tuple | None) -> tuple[Tensor | None, ...]:
    """_allocate's general form: outputs with strides (plan.strides) allocated in that order."""
    outs: list[Tensor | None] = []
    for j, (lay, st) in enumerate(zip(plan.layout, plan.strides)):
        if lay is None:
            outs.append(None)
        elif scratch is not None and scratch[j] is not None:
            outs.append(scratch[j])
        elif reuse is not None and plan.reuse is not None and plan.reuse[j] is not None:
            outs.append(reuse[plan.reuse[j]])
        elif st is not None:
            outs.append(outputs.empty_strided(lay[0], st, lay[1], plan.device))
        else:
            outs.append(outputs.empty(lay[0], lay[1], plan.device))
    return tuple(outs)


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
    reuse: bool = False,
) -> tuple[Tensor | None, ...]:
    """Allocate `phase`'s outputs and have the resolved provider fill them (plan cached per signature).
    reuse: an eager backward, which may write outputs into the inputs Phase.reuse names."""
    return _execute(spec, phase, _plan_for(spec, phase, inputs, scalars, backend, cond), inputs, reuse)


def _plan_for(
    spec: OpSpec, phase: str, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str, cond: dict
) -> _Plan:
    """The cached plan of a call signature (made, and refused inside a capture, on its first call)."""
    sig = _signature(spec, phase, inputs, scalars, backend, cond)
    plan = _PLANS.get(sig)
    if plan is None:
        gen = dispatch.generation
        plan = _Plan(spec, phase, inputs, scalars, backend, cond)
        _refuse_first_call_in_capture(spec, phase, plan)
        if gen == dispatch.generation:  # no clear_cache() since this plan's backend was resolved
            if len(_PLANS) >= _PLAN_CACHE:
                _PLANS.clear()
            _PLANS[sig] = plan
    return plan


# torch.cuda.current_device() minus its lazy-init check: a guarded plan exists only for CUDA tensors,
# so CUDA is initialized by the time it is asked.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def resolved(inputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """`inputs`, with a lazily negated tensor (neg bit: torch._neg_view, conj().imag) materialized: kernels
    read memory, which holds the negation's operand. Never on a remembered call (library.call_key)."""
    for v in inputs:
        if v is not None and v.is_neg():
            return tuple([None if t is None else t.resolve_neg() for t in inputs])
    return inputs


def _execute(
    spec: OpSpec,
    phase: str,
    plan: _Plan,
    inputs: tuple[Tensor | None, ...],
    reuse: bool = False,
    scratch: tuple | None = None,
) -> tuple[Tensor | None, ...]:
    """One call of a planned signature: contiguous copies where the plan says, outputs, the launch."""
    inputs = resolved(inputs)
    if plan.contig:
        inputs = tuple(v.contiguous() if i in plan.contig else v for i, v in enumerate(inputs))
    outs = _allocate(spec, phase, plan, inputs if reuse else None, scratch)
    if plan.empty:
        for o in outs:
            if o is not None:
                o.zero_()
        return outs
    device = plan.device  # in the signature
    if plan.staged:  # the provider fills contiguous buffers; the strided outputs get their values after
        given = outs
        outs = tuple([
            outputs.empty(o.shape, o.dtype, device) if j in plan.staged else o for j, o in enumerate(given)
        ])  # fmt: skip
        _launch_phase(spec, phase, plan, outs, inputs, device, reuse)
        for j in plan.staged:
            given[j].copy_(outs[j])
        return given
    _launch_phase(spec, phase, plan, outs, inputs, device, reuse)
    return outs


def _launch_phase(
    spec: OpSpec, phase: str, plan: _Plan, outs: tuple, inputs: tuple, device: torch.device, reuse: bool
) -> None:
    # outputs that are inputs (Phase.reuse) change what the kernels see (a kernel may skip work in
    # place): such a call neither records nor replays launches, which bake the aliasing in or out
    aliased = reuse and plan.reuse is not None
    if _amp.any_enabled() and _amp.on(device.type):
        # a caller's autocast region must not recast the backend's own torch calls (fusekit.ops._amp)
        with torch.autocast(device.type, enabled=False):
            _launch_on(spec, phase, plan, outs, inputs, device, aliased)
    else:
        _launch_on(spec, phase, plan, outs, inputs, device, aliased)


def _launch_on(
    spec: OpSpec, phase: str, plan: _Plan, outs: tuple, inputs: tuple, device: torch.device, aliased: bool
) -> None:
    if plan.guard and device.index != _current_device():
        with torch.cuda.device(device):  # launch on the tensors' GPU, not the current one
            _launch(spec, phase, plan, outs, inputs, aliased)
    else:
        _launch(spec, phase, plan, outs, inputs, aliased)


_RECORD_TRIES = 3  # calls (after the first) on which a plan tries to record a replay


def _launch(spec: OpSpec, phase: str, plan: _Plan, outs: tuple, inputs: tuple, aliased: bool = False) -> None:
    """The provider's kernels for one call: replayed when the plan has a replay that accepts this call
    (same pointer alignments), else through the provider (recording a replay on calls 2..4); a call whose
    outputs are its inputs (`aliased`) always through the provider."""
    if aliased:
        plan.provider.run(spec, phase, outs, inputs, plan.kscalars)
        return
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
