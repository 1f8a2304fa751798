"""What each fusekit op phase looks like as a MAX custom op, derived from the op's spec.

`max_spec(spec, phase)` gives an `OpSpec` (MAX level): the registered op name (`fusekit.<op>` or
`fusekit.<op>_backward`), the output and input tensors in order with symbolic dim names (one compiled
graph covers every shape) and dtype rules, the allowed dtype combinations, and `bind`, which maps the
provider's destination-passing arguments to (outputs, inputs, params). The compile cache and the
dispatcher read everything from here.

- Dtype rules: a tensor's dtype is a dtype variable of the op ("x", "w", "out"), which takes the
  dtype of the call's tensors and is part of the compile key, or a fixed dtype ("float32").
- Params: the op's scalars as float32 (bools 0/1, choices by index, e.g. casting "fp32"/"llama"/"gemma"
  = 0/1/2; dtype scalars are compile keys, not params), then one 0/1 flag per condition of the phase,
  in a trailing float32 `params` input on the op's device.
- Optional tensors: each has its own symbolic dims, and an absent one is passed as a dummy of its
  dtype with every dim 1 (its flag is 0; the kernel never reads it).

Outputs are mutable buffers: the graph passes the caller's output tensors to the op as MAX buffers
(`ops.inplace_custom`), so in Mojo every output parameter is a `MutableInputTensor`, never an
`OutputTensor` (a MAX temporary the graph would copy into the caller's buffer afterwards: an extra
read + write of every output). Kernels must write every element of every output.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Ops whose Mojo kernels take their weights in x's dtype only (no second dtype parameter yet).
X_DTYPE_WEIGHTS = frozenset({"swiglu_ffn"})

Bound = tuple[tuple[torch.Tensor | tuple, ...], tuple[torch.Tensor | tuple, ...], tuple[float, ...]]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor argument of a MAX custom op: name, symbolic dims, dtype variable or fixed dtype."""

    name: str
    dims: tuple[str | int, ...]
    dtype: str  # a dtype variable of the op ("x", "w", "out") or a torch dtype name ("float32")


@dataclass(frozen=True)
class OpSpec:
    """A fusekit op phase as a MAX custom op (outputs first, then inputs, then params)."""

    op: str
    max_op: str
    outputs: tuple[TensorSpec, ...]
    inputs: tuple[TensorSpec, ...]
    params: tuple[str, ...]  # names of the float32 params entries, in order (() = no params input)
    dtype_vars: tuple[str, ...]  # e.g. ("x",) or ("x", "w")
    allowed: frozenset[tuple[torch.dtype, ...]]  # allowed dtypes for dtype_vars, in order
    bind: Callable[..., Bound]  # (outputs, inputs, scalars) -> (outputs, inputs, params values)

    def __post_init__(self) -> None:
        # Position (in outputs + inputs) of the tensors typed by each dtype variable.
        specs = self.outputs + self.inputs
        pos = tuple(tuple(i for i, t in enumerate(specs) if t.dtype == v) for v in self.dtype_vars)
        object.__setattr__(self, "_dtype_pos", pos)

    def dtype_key(self, outs: tuple, ins: tuple) -> tuple:
        """The dtypes of this call's dtype variables (part of the compile key); dummies carry theirs."""
        args = outs + ins
        key = []
        for positions in self._dtype_pos:  # type: ignore[attr-defined]
            found = None
            for i in positions:
                a = args[i]
                found = a.dtype if isinstance(a, torch.Tensor) else a[1]
                if isinstance(a, torch.Tensor):
                    break
            key.append(found)
        return tuple(key)

    def tensor_dtype(self, spec: TensorSpec, key: tuple[torch.dtype, ...]) -> torch.dtype:
        """The torch dtype of one tensor argument for a compile key."""
        if spec.dtype in self.dtype_vars:
            return key[self.dtype_vars.index(spec.dtype)]
        return getattr(torch, spec.dtype)


def dummy(dtype: torch.dtype, rank: int, slot: int) -> tuple:
    """Stands for an absent optional tensor: the dispatcher passes a [1] * rank tensor of `dtype`."""
    return ("dummy", dtype, rank, slot)


def _param(scalar, value: object) -> float:
    if scalar.kind is str:
        return float(scalar.choices.index(value))
    return float(value)  # type: ignore[arg-type]


def max_spec(spec, phase: str, drop: frozenset[str] = frozenset()) -> OpSpec:
    """The MAX custom-op view of `phase` of a fusekit op spec, without the tensors whose condition is in
    `drop` (and without those conditions' flags): a second tensor the provider runs as another call."""
    p = spec.phase(phase)
    if drop:
        p = dataclasses.replace(
            p,
            outputs=tuple(a for a in p.outputs if a.when not in drop),
            inputs=tuple(a for a in p.inputs if a.when not in drop),
            conditions=tuple(c for c in p.conditions if c not in drop),
        )
    op = spec.name if phase == "forward" else f"{spec.name}_backward"

    def tensor(arg) -> TensorSpec:
        dims = tuple(f"{d}_{arg.name}" for d in arg.dims) if arg.optional else arg.dims
        return TensorSpec(arg.name, dims, arg.dtype)

    scalars = [s for s in spec.scalars if s.kind is not torch.dtype]  # dtype scalars are compile keys
    params = tuple(s.name for s in scalars) + tuple(f"has_{c}" for c in p.conditions)
    n_out = len(p.outputs)

    def bind(outs: tuple, ins: tuple, values: tuple) -> Bound:
        key = {}
        for arg, v in zip(p.tensors, outs + ins):
            if v is not None:
                key.setdefault(arg.dtype, v.dtype)
        x_dtype = key.get("x")

        def fill(args, vals, base: int) -> tuple:
            res = []
            for i, (arg, v) in enumerate(zip(args, vals)):
                if v is None:
                    dt = key.get(arg.dtype) or (
                        x_dtype if arg.dtype in spec.dtype_vars else getattr(torch, arg.dtype)
                    )
                    v = dummy(dt, len(arg.dims), base + i)
                res.append(v)
            return tuple(res)

        flags = []
        for c in p.conditions:
            present = any(v is not None for a, v in zip(p.tensors, outs + ins) if a.when == c)
            flags.append(1.0 if present else 0.0)
        return (
            fill(p.outputs, outs, 0),
            fill(p.inputs, ins, n_out),
            tuple(_param(s, v) for s, v in zip(scalars, values)) + tuple(flags),
        )

    return OpSpec(
        op=op,
        max_op=f"fusekit.{op}",
        outputs=tuple(tensor(a) for a in p.outputs),
        inputs=tuple(tensor(a) for a in p.inputs),
        params=params,
        dtype_vars=spec.dtype_vars,
        allowed=spec.allowed,
        bind=bind,
    )


def _bind_swiglu_backward(outs: tuple, ins: tuple, values: tuple) -> Bound:
    """(h, dg, du, xn?), (dh, gu, x, norm_weight?, rstd?), () -> the kernel's arguments (has_norm = xn given)."""
    h, dg, du, xn = outs
    dh, gu, x, nw, rstd = ins
    dt = dh.dtype
    return (
        (h, dg, du, xn if xn is not None else dummy(dt, 2, 3)),
        (
            dh,
            gu,
            x,
            nw if nw is not None else dummy(dt, 1, 7),
            rstd if rstd is not None else dummy(torch.float32, 1, 8),
        ),
        (float(xn is not None),),
    )


# The element-wise part of the swiglu_ffn backward (mojo/_swiglu_backward.mojo). It is not the spec's
# backward phase: the provider runs the phase's five GEMMs as torch matmuls (see __init__.py) and calls
# this op between them, and the norm part through fusekit.rms_norm_backward. It holds the phase's MAX
# name, so the package registering it is what makes the backward available.
SWIGLU_FFN_BACKWARD = OpSpec(
    op="swiglu_ffn_backward",
    max_op="fusekit.swiglu_ffn_backward",
    outputs=(
        TensorSpec("h", ("T", "F"), "x"),
        TensorSpec("dg", ("T", "F"), "x"),
        TensorSpec("du", ("T", "F"), "x"),
        TensorSpec("xn", ("T_xn", "D_xn"), "x"),
    ),
    inputs=(
        TensorSpec("dh", ("T", "F"), "x"),
        TensorSpec("gu", ("T", "G"), "x"),
        TensorSpec("x", ("T", "D"), "x"),
        TensorSpec("norm_weight", ("D_norm_weight",), "x"),
        TensorSpec("rstd", ("T_rstd",), "float32"),
    ),
    params=("has_norm",),
    dtype_vars=("x",),
    allowed=frozenset((d,) for d in (torch.float32, torch.float16, torch.bfloat16)),
    bind=_bind_swiglu_backward,
)


# MAX ops whose GPU kernels create device buffers (`ctx.enqueue_create_buffer`: weight-gradient partials,
# split partial sums, the swiglu intermediate). After a MAX device-graph capture, such a kernel makes MAX
# reserve a graph memory pool of ~90% of the free device memory (H100: 78.7 -> 7.6 GiB free after
# capturing rms_norm's backward once; 78.3 -> 7.8 when only its forward was captured and the backward ran
# uncaptured), which starves torch's allocator for the rest of the process. So replay is off by default
# (dispatch.REPLAY_ENV), and with it opted in these ops are still never captured: each of their calls
# executes (~20 us of host time, small beside these kernels). tests/test_mojo_capture_memory.py checks
# on the GPU, in a fresh process, that the default settings keep the device memory.
NO_CAPTURE = frozenset(
    {
        "fusekit.rms_norm_backward",
        "fusekit.layer_norm_backward",
        "fusekit.attention_backward",
        "fusekit.reduce_sum",
        "fusekit.swiglu_ffn",
    }
)


# Tensors a fusekit spec has that the Mojo op does not take: the provider runs them as a second call of
# the same op (rope's k: rotated by a second launch at the same positions).
SECOND_CALL: dict[str, frozenset[str]] = {"rope": frozenset({"k"})}


@functools.cache
def phase_spec(op: str, phase: str) -> OpSpec:
    """The MAX spec of one phase of a registered fusekit op (cached)."""
    from fusekit.ops import SPECS as OP_SPECS

    return max_spec(OP_SPECS[op], phase, SECOND_CALL.get(op, frozenset()))


def __getattr__(name: str) -> dict[str, OpSpec]:
    if (
        name == "SPECS"
    ):  # op name -> forward MAX spec (built lazily: fusekit.ops imports the backends' registry)
        from fusekit.ops import SPECS as OP_SPECS

        return {op: phase_spec(op, "forward") for op in OP_SPECS}
    raise AttributeError(name)
