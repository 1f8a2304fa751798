"""The public entry of every op (`apply`), the torch.library custom ops and their autograd formulas.

A call that needs a gradient resolves its backend for both phases before running anything, so a backend
without a backward raises naming op, backend and input instead of detaching silently. Eager calls that
record a gradient run the registered formula as a plain autograd.Function (`_EAGER`); torch.compile
traces the custom ops `torch.ops.fusekit.<op>` / `<op>_backward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C import _functions as _autograd_functions
from torch.autograd import forward_ad as _fwad

from fusekit.library import lean_dispatch
from fusekit.library.function_apply import applier
from fusekit.library.plan import _device, may_reuse, resolve, run
from fusekit.ops._spec import BACKWARD, FORWARD, OpSpec

_SPECS: dict[str, OpSpec] = {}


# op -> (positions and names of the inputs with a gradient, those of the inputs without one)
_GRAD_POS: dict[str, tuple[tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]]] = {}


def grad_on() -> bool:
    """Whether a call records a gradient: grad mode on, outside inference_mode (torch records nothing there
    even under enable_grad, and inference tensors cannot be saved for backward). Dynamo cannot trace the
    inference-mode query (a fundamental graph break), and a traced graph is recorded under its grad mode."""
    return torch.is_grad_enabled() and (
        torch.compiler.is_compiling() or not torch.is_inference_mode_enabled()
    )


def _needs_grad(spec: OpSpec, inputs: tuple[Tensor | None, ...]) -> list[str]:
    """Names of the inputs that require grad (none under no_grad or inference_mode). An input the op has
    no gradient for (rope's cos / sin tables) that requires grad raises, naming it: its gradient would be
    dropped."""
    if not grad_on():
        return []
    pos = _GRAD_POS.get(spec.name)
    if pos is None:
        named = tuple(enumerate(a.name for a in spec.forward.inputs))
        pos = _GRAD_POS[spec.name] = (
            tuple((i, n) for i, n in named if n in spec.grad_inputs),
            tuple((i, n) for i, n in named if n not in spec.grad_inputs),
        )
    for i, n in pos[1]:
        if inputs[i] is not None and inputs[i].requires_grad:
            raise ValueError(
                f"{n}: requires grad, but {spec.name} has no gradient for {n} (only for "
                f"{', '.join(spec.grad_inputs)}); pass {n}.detach()"
            )
    return [n for i, n in pos[0] if inputs[i] is not None and inputs[i].requires_grad]


_functorch_level = torch._C._functorch.maybe_current_level


def transformed() -> bool:
    """A forward-mode AD level or a torch.func transform (vmap, grad, jacrev, ...) is active: calls take
    the checked path, which refuses what the kernels cannot honour (`_refuse_transforms`)."""
    return _fwad._current_level >= 0 or _functorch_level() is not None


def _refuse_transforms(spec: OpSpec, inputs: tuple[Tensor | None, ...]) -> None:
    """Raise where a call would silently lose a transform: forward-mode tangents (the kernels write plain
    outputs: the tangent was dropped) or torch.func's wrapped tensors (vmap's batch dimension, grad's
    levels: the kernels cannot read them). Under torch.compile the levels alone decide: dynamo shows the
    traced code plain tensors (a dual input's tangent reads None there), and the custom op silently gave
    a zero / missing tangent where eager raised."""
    if _fwad._current_level >= 0 and torch.compiler.is_compiling():
        raise ValueError(
            f"{spec.name}: called under forward-mode AD (torch.autograd.forward_ad.dual_level or "
            "torch.func.jvp) inside torch.compile; fusekit's ops have no forward-mode derivative and a "
            "compiled call cannot tell whether its inputs carry tangents: use reverse mode (backward, "
            "torch.autograd.grad), or call it outside the dual level"
        )
    if _functorch_level() is not None:
        raise ValueError(
            f"{spec.name}: called inside a torch.func transform (vmap, grad, jacrev, jvp, ...), which fusekit's "
            "ops do not support: call it outside the transform (for vmap, on the batched tensors directly; for "
            "gradients, torch.autograd)"
        )
    for a, t in zip(spec.forward.inputs, inputs):
        if t is not None and _fwad.unpack_dual(t).tangent is not None:
            raise ValueError(
                f"{a.name}: carries a forward-mode tangent (torch.autograd.forward_ad), but {spec.name} has no "
                "forward-mode derivative (its output would have none); use reverse mode (backward, "
                "torch.autograd.grad)"
            )


def first_order(op: str, backward: Callable[..., tuple], saved_history: bool = True) -> Callable[..., tuple]:
    """An autograd backward that is not itself differentiable, as torch's `once_differentiable`, but
    which also catches the saved inputs: under create_graph=True it runs without recording and its
    results carry an error node, so differentiating them again (a gradient penalty, a Hessian) raises
    naming the op instead of dropping or mis-computing the second-order term (the kernels' backward
    phases are not differentiable).

    The error node's inputs are the results and every saved tensor and output grad with autograd
    history: a differentiation reaches it from whichever input the second-order term depends on. With
    the results alone, `torch.autograd.grad(penalty, weight)` pruned it (no path to weight) and returned
    the other terms only, silently. Where the saved tensors keep no history of the inputs (saved_history
    False: linear_cross_entropy) or nothing carries history, the create_graph backward raises at once."""
    msg = (
        f"fusekit.{op}: its backward is first-order only, so a gradient of its gradient (create_graph=True: "
        "a gradient penalty, a Hessian-vector product) cannot be computed through it; compute that term "
        "with the equivalent torch operations"
    )

    def wrapped(ctx, *grads):
        if not torch.is_grad_enabled():  # a plain backward (no create_graph): nothing to guard
            return backward(ctx, *grads)
        links = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, Tensor) and t.requires_grad]
        if not saved_history or not links:
            raise RuntimeError(msg)
        with torch.no_grad():
            out = backward(ctx, *grads)
        at = [i for i, v in enumerate(out) if v is not None]
        if not at:
            return out
        flagged = _autograd_functions.DelayedError(msg, len(at) + len(links))(
            *[out[i].detach().requires_grad_() for i in at], *links
        )  # two or more inputs: a tuple
        res = list(out)
        for i, v in zip(at, flagged):
            res[i] = v
        return tuple(res)

    return wrapped


def _check_backward(
    spec: OpSpec, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str, who: list[str]
) -> str:
    """The backend both phases run on; raises (naming op, backend, input) when it has no backward."""
    if backend != "auto":
        # an unknown name, or a backend without this call's forward, raises as without grad (not as a
        # missing backward: detaching would not help); "auto" checks both phases in dispatch.resolve
        resolve(spec, FORWARD, inputs, scalars, backend)
    try:
        chosen = resolve(spec, BACKWARD, inputs, scalars, backend, inputs_of=FORWARD).name
    except ValueError as exc:
        raise ValueError(
            f"{who[0]}: requires grad, but {spec.name} has no backward here: {exc}. Detach the input, "
            "run under torch.no_grad(), or pick a backend with a backward (backend='torch' always has one)"
        ) from exc
    return chosen


def check_backend(spec: OpSpec, inputs: tuple[Tensor | None, ...], scalars: tuple, backend: str) -> None:
    """Refuses, as `apply` would and launching nothing, a backend that cannot run the phases this call
    needs (its forward; with grad also its backward): for a call answered without a kernel (empty)."""
    who = _needs_grad(spec, inputs)
    if who:
        _check_backward(spec, inputs, scalars, backend, who)
    else:
        resolve(spec, FORWARD, inputs, scalars, backend)


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
    if transformed():
        _refuse_transforms(spec, inputs)
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
        outs = _as_tuple(eager_apply(spec.name)(*inputs, *scalars, backend, bool(who)))
    return _present(spec, inputs, outs, bool(who)), backend


# --- custom ops ------------------------------------------------------------------------------------
# Eager calls that record a gradient run the registered autograd formula as a plain
# torch.autograd.Function: torch.library's custom-op dispatch (autograd kernel, redispatch, the
# aliasing check, dynamo-disable wrappers) costs ~0.5 ms of host time per forward+backward on the H200's
# host, more than the kernels at most training shapes. torch.compile still traces the custom ops.
_EAGER: dict[str, type[torch.autograd.Function]] = {}
_EAGER_APPLY: dict[str, Callable[..., Any]] = {}


def eager_apply(name: str) -> Callable[..., Any]:
    """`_EAGER[name].apply`, bound once (function_apply.applier)."""
    fn = _EAGER_APPLY.get(name)
    if fn is None:
        fn = _EAGER_APPLY[name] = applier(_EAGER[name])
    return fn


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


def _fake_outputs(lay: list, strides: tuple | None, device: torch.device) -> tuple[Tensor | None, ...]:
    """A custom op's fake outputs: the real ones' shapes, dtypes and strides (plan._allocate's rule)."""
    return tuple(
        None
        if lo is None
        else torch.empty(lo[0], dtype=lo[1], device=device)
        if strides is None or strides[j] is None
        else torch.empty_strided(lo[0], strides[j], dtype=lo[1], device=device)
        for j, lo in enumerate(lay)
    )


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

    def refuse(sc: tuple, save: bool) -> None:
        why = spec.refuse(dict(zip(spec.scalar_names, sc)), save) if spec.refuse is not None else None
        if why is not None:
            raise ValueError(f"torch.ops.fusekit.{spec.name}: {why}")

    def forward_impl(*args):  # absent outputs as 0-element placeholders, as the custom-op schema needs
        ins, sc, backend, save = split(args)
        refuse(sc, save)
        return _placeholders(_device(ins), run(spec, FORWARD, ins, sc, backend, spec.conditions(ins, save)))

    def forward_fake(*args):
        ins, sc, _, save = split(args)
        refuse(sc, save)
        named = dict(zip(spec.scalar_names, sc))
        lay = spec.output_layout(FORWARD, ins, named, spec.conditions(ins, save))
        return _placeholders(
            _device(ins), _fake_outputs(lay, spec.output_strides(FORWARD, ins), _device(ins))
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
        return _placeholders(
            _device(ins), _fake_outputs(lay, spec.output_strides(BACKWARD, ins), _device(ins))
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
            bouts = run(spec, BACKWARD, tuple(bins), sc, backend, {c: cond[c] for c in bconds}, may_reuse())
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

    op.register_autograd(first_order(spec.name, backward, spec.saved_history), setup_context=setup_context)
    lean_dispatch.install(op, forward_impl)
    lean_dispatch.install(bop, backward_impl)

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
        {
            "forward": staticmethod(eager_forward),
            "backward": staticmethod(first_order(spec.name, eager_backward, spec.saved_history)),
        },
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
    lean_dispatch.install(op, forward_impl)
    _EAGER[spec.name] = _eager_function(spec.name, forward_impl, setup_context, backward)


def register(spec: OpSpec) -> OpSpec:
    """Register an op's custom ops and autograd formula (once per process); returns the spec."""
    if spec.name not in _SPECS:
        _register(spec)
        _SPECS[spec.name] = spec
    return spec


def specs() -> dict[str, OpSpec]:
    return dict(_SPECS)
