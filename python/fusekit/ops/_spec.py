"""What an op is to fusekit: its tensors, scalars, phases and reference, as data every layer reads.

One `OpSpec` per op lives in `fusekit/ops/<op>.py` beside the op's validation, float64-exact reference
(forward and backward) and public function. The custom-op registration and autograd wiring
(`fusekit.library`), the providers (`fusekit.backends`), the Mojo graph signatures and the
conformance suite all derive from it, so an op's argument list is written once.

Providers see a phase in destination-passing form, positionally:

    run(spec, phase, outputs, inputs, scalars)   # outputs first, then inputs, then scalars

- `TensorArg.dims` are symbolic ("M N"): the same symbol is the same extent; an output's shape is
  read off the inputs through them (ops with outputs of other shapes give `Phase.shapes`).
- `TensorArg.dtype` is a dtype variable of the op ("x", "w", "out"), a fixed dtype ("float32"), or
  "acc": fp32, fp64 for fp64 x (a loss in fp32 math that float64 gradchecks can still resolve).
  "xsave": x's dtype, but fp32 for fp16 x (`saved_dtype`): gradients a forward computes and saves before
  the loss's own gradient (GradScaler's 2^16 scale) reaches them, which fp16 cannot hold (linear_cross_entropy's
  d x and d weight sit far below fp16's normal range). A backward phase whose inputs have no "x" binds "x"
  to its first "xsave" input (fp32 for fp16 x: its outputs are fp32, autograd rounds them to the leaves').
  "x" binds to the first input typed "x"; "w" (weights that may be fp32 under mixed precision) to the
  first present input typed "w", else to x's dtype; a variable no present input binds comes from the
  scalar `<var>_dtype` (reduce_sum's "out").
- `TensorArg.when` names a condition: the tensor exists only when it holds, and is `None` otherwise.
  Forward conditions are read off the inputs (an optional input is present or not) plus "save"
  (the call records for backward); the backward phase reuses the forward's values.
- `TensorArg.strided` (inputs only): the tensor may arrive as a strided view whose last dim is
  contiguous (a KV cache read in place). The library passes such a view as is to a provider that
  declares `reads_strides` and whose last stride is 1, and a contiguous copy otherwise; the view's
  strides are part of the call's plan signature.
- `TensorArg.like` (outputs only): the output takes that input's memory order when the input is a
  permuted view (attention's o follows q: q read from a [B, S, H, D] source gives o laid out [B, S, H, D],
  so the caller's transpose back to [B, S, H*D] is a free view, as SDPA's output is). The rule
  (`dense_strides_like`) is the same for the real outputs and the fake ones torch.compile traces with; a
  provider that does not declare `writes_strides` fills contiguous buffers the library copies from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

FORWARD, BACKWARD = "forward", "backward"
PHASES = (FORWARD, BACKWARD)
SAVE = "save"  # the condition "this forward call records what its backward needs"
ACC = "acc"  # a tensor dtype: x's accumulator, fp32 (fp64 for fp64 x), see acc_dtype
XSAVE = "xsave"  # a tensor dtype: x's, fp32 for fp16 x, see saved_dtype


@dataclass(frozen=True)
class TensorArg:
    """One tensor of a phase: name, symbolic dims, dtype variable or fixed dtype, presence condition."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    when: str | None = None  # None: always present
    grad: bool = True  # outputs: False for statistics and saved values (no gradient flows into them)
    strided: bool = False  # inputs: may be passed as a strided view (see the module docstring)
    like: str | None = None  # outputs: the input whose memory order this output takes (same dims)

    @property
    def optional(self) -> bool:
        return self.when is not None


def t(
    name: str,
    dims: str,
    dtype: str = "x",
    when: str | None = None,
    grad: bool = True,
    strided: bool = False,
    like: str | None = None,
) -> TensorArg:
    """Shorthand: t("weight", "N", "w") is a tensor [N] of the weight dtype."""
    return TensorArg(name, tuple(dims.split()), dtype, when, grad, strided, like)


def dense_strides_like(t: Tensor) -> tuple[int, ...] | None:
    """Dense strides in `t`'s memory order (dims by decreasing stride, ties in dim order), or None where
    that is the contiguous layout or would not keep the last dim innermost (kernels index it directly)."""
    if t.is_contiguous():
        return None
    shape, stride = t.shape, t.stride()
    order = sorted(range(t.dim()), key=lambda i: (-stride[i], i))
    if order[-1] != t.dim() - 1:
        return None
    out = [0] * t.dim()
    step = 1
    for i in reversed(order):
        out[i] = step
        step *= shape[i]
    return tuple(out)


# Schema types of the scalar kinds, for torch.library.
_SCHEMA = {float: "float", int: "int", bool: "bool", str: "str", torch.dtype: "ScalarType"}


@dataclass(frozen=True)
class Scalar:
    """One non-tensor argument. `check(value) -> normalized value` raises naming the argument."""

    name: str
    kind: type
    check: Callable[[object], object]
    choices: tuple[str, ...] = ()  # str scalars: the allowed values (kernels receive the index)

    @property
    def schema(self) -> str:
        return f"{_SCHEMA[self.kind]} {self.name}"


@dataclass(frozen=True)
class Phase:
    outputs: tuple[TensorArg, ...]
    inputs: tuple[TensorArg, ...]
    # Conditions passed to kernels as flags, in this order (the Mojo params after the scalars).
    conditions: tuple[str, ...] = ()
    # Output shapes that are not read off the inputs' dims: (inputs by name, scalars by name) ->
    # {output name: shape}.
    shapes: Callable[[dict[str, Tensor | None], dict[str, object]], dict[str, tuple[int, ...]]] | None = None
    # (output, input) pairs of a backward phase whose output an eager backward writes into that input
    # (same shape and dtype) instead of a new buffer: the input is a value the forward saved for this
    # backward alone (linear_cross_entropy's precomputed gradients, scaled in place as Liger does), so
    # the step never holds both. Not when the graph is kept for another backward (retain_graph=True,
    # gradcheck: library.plan.may_reuse), and not in traced (torch.compile) backwards, whose custom ops
    # return fresh tensors: those allocate as usual.
    reuse: tuple[tuple[str, str], ...] = ()

    @property
    def tensors(self) -> tuple[TensorArg, ...]:
        return self.outputs + self.inputs


@dataclass(frozen=True)
class OpSpec:
    """An op: phases, scalars, dtype rules, reference and autograd glue."""

    name: str
    forward: Phase
    scalars: tuple[Scalar, ...]
    # The dtype variables in compile-key order, and the allowed combinations (validation enforces them).
    dtype_vars: tuple[str, ...]
    allowed: frozenset[tuple[torch.dtype, ...]]
    # reference[phase](*inputs, *scalars) -> outputs (None where absent): the torch provider runs it.
    # With `reference_fills`, reference[phase](*outputs, *inputs, *scalars) fills the outputs instead
    # (destination passing, as the other providers): it sees which outputs the call wants (no gradient
    # buffers under no_grad) and can write them chunk by chunk (linear_cross_entropy).
    reference: dict[str, Callable[..., tuple[Tensor | None, ...]]]
    reference_fills: bool = False
    backward: Phase | None = None
    # Differentiable forward inputs (by name).
    grad_inputs: tuple[str, ...] = ()
    # Autograd glue (see fusekit.library): what forward saves, how backward's inputs are formed from
    # (saved, output grads, conditions), and how backward's outputs map to the forward inputs' grads.
    save: Callable[..., tuple[Tensor | None, ...]] | None = None
    backward_inputs: Callable[..., tuple[Tensor | None, ...]] | None = None
    input_grads: Callable[..., tuple[Tensor | None, ...]] | None = None
    # An op whose gradient is a view of the output grads needs no backward kernel:
    # (output grads by name, forward input shapes) -> forward input grads.
    grad_view: Callable[..., tuple[Tensor | None, ...]] | None = None
    # Whether the backward depends on the differentiable inputs only through saved tensors that keep their
    # autograd history (saved inputs, or outputs whose history leads to them) and the output grads: then a
    # create_graph=True backward defers its first-order-only error to a differentiation that reaches those
    # inputs (library.autograd.first_order). False (linear_cross_entropy saves gradients its forward
    # computed, with no history): a create_graph=True backward raises at once.
    saved_history: bool = True
    # Facts a provider needs to say whether it runs a call (head_dim, ...): (the phase's inputs by name,
    # scalars by name) -> dict; must give the same answer for both phases (it reads tensors both have).
    meta: Callable[[dict[str, Tensor | None], dict[str, object]], dict[str, object]] = field(
        default=lambda inputs, scalars: {}
    )
    # Forward conditions that are conjunctions of others: (name, (condition, ...)), e.g. a bias gradient
    # output that exists when the bias is given and the call saves for backward.
    derived: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # A forward call the custom op itself refuses, (scalars by name, save) -> the reason or None: a direct
    # torch.ops call skips the public function's checks (linear_cross_entropy saving with reduction="none").
    refuse: Callable[[dict[str, object], bool], str | None] | None = None

    def phase(self, name: str) -> Phase:
        p = self.forward if name == FORWARD else self.backward
        if p is None:
            raise ValueError(f"{self.name} has no {name} phase")
        return p

    @property
    def scalar_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.scalars)

    def kernel_scalars(self, scalars: tuple) -> tuple:
        """The scalars providers and references receive: dtype scalars only size the outputs."""
        return tuple(v for s, v in zip(self.scalars, scalars) if s.kind is not torch.dtype)

    @property
    def differentiable(self) -> bool:
        return self.backward is not None or self.grad_view is not None

    # --- binding a call ------------------------------------------------------------------------------
    def conditions(self, inputs: tuple[Tensor | None, ...], save: bool) -> dict[str, bool]:
        """Forward condition values: an optional input's condition holds iff it is present."""
        cond = {SAVE: save}
        for arg, value in zip(self.forward.inputs, inputs):
            if arg.when is not None:
                cond[arg.when] = cond.get(arg.when, False) or value is not None
        for name, parts in self.derived:
            cond[name] = all(cond.get(c, False) for c in parts)
        return cond

    def dtype_of(
        self, var: str, args: tuple[TensorArg, ...], values: tuple[Tensor | None, ...], scalars: dict
    ) -> torch.dtype:
        """The dtype a variable takes in a call (see the module docstring)."""
        for arg, value in zip(args, values):
            if arg.dtype == var and value is not None:
                return value.dtype
        if f"{var}_dtype" in scalars:
            return scalars[f"{var}_dtype"]  # type: ignore[return-value]
        if var != "x":
            return self.dtype_of("x", args, values, scalars)
        for arg, value in zip(args, values):  # a backward of saved gradients (see the module docstring)
            if arg.dtype == XSAVE and value is not None:
                return value.dtype
        raise ValueError(f"{self.name}: no tensor binds dtype variable {var!r}")

    def output_layout(
        self, phase: str, inputs: tuple[Tensor | None, ...], scalars: dict, cond: dict[str, bool]
    ) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
        """(shape, dtype) of each output of `phase`, None for an absent one."""
        p = self.phase(phase)
        sizes: dict[str, int] = {}
        named = {}
        for arg, value in zip(p.inputs, inputs):
            named[arg.name] = value
            if value is not None:
                for d, n in zip(arg.dims, value.shape):
                    sizes.setdefault(d, n)
        extra = p.shapes(named, scalars) if p.shapes is not None else {}
        layout: list[tuple[tuple[int, ...], torch.dtype] | None] = []
        for arg in p.outputs:
            if arg.when is not None and not cond.get(arg.when, False):
                layout.append(None)
                continue
            shape = extra[arg.name] if arg.name in extra else tuple(sizes[d] for d in arg.dims)
            if arg.dtype in self.dtype_vars:
                dtype = self.dtype_of(arg.dtype, p.inputs, inputs, scalars)
            elif arg.dtype == ACC:
                dtype = acc_dtype(self.dtype_of("x", p.inputs, inputs, scalars))
            elif arg.dtype == XSAVE:
                dtype = saved_dtype(self.dtype_of("x", p.inputs, inputs, scalars))
            else:
                dtype = getattr(torch, arg.dtype)
            layout.append((tuple(shape), dtype))
        return layout

    def output_strides(
        self, phase: str, inputs: tuple[Tensor | None, ...]
    ) -> tuple[tuple[int, ...] | None, ...] | None:
        """Per output of `phase`: strides where it takes an input's memory order (TensorArg.like), else
        None (contiguous); None for the whole phase when every output is contiguous."""
        p = self.phase(phase)
        if not any(a.like for a in p.outputs):
            return None
        named = {a.name: v for a, v in zip(p.inputs, inputs)}
        strides = tuple(
            None if a.like is None or named.get(a.like) is None else dense_strides_like(named[a.like])
            for a in p.outputs
        )
        return strides if any(s is not None for s in strides) else None


def acc_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype "acc" stands for: fp64 for fp64 x (the torch backend's oracle runs), else fp32."""
    return torch.float64 if x_dtype == torch.float64 else torch.float32


def saved_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype "xsave" stands for: fp32 for fp16 x, else x's dtype."""
    return torch.float32 if x_dtype == torch.float16 else x_dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
