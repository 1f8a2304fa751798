"""What each fusekit op looks like as a MAX custom op: a data table read by the mojo runtime.

One `OpSpec` per op (see .dev/MOJO_CONTRACT.md): the registered MAX op name, the output and input
tensors in order, each with symbolic dim names (one compiled graph covers every shape) and a dtype
rule, the allowed dtype combinations, and `bind`, which maps the provider's destination-passing
arguments to (outputs, inputs, params). Adding an op is adding an entry to `SPECS`; the backend,
the compile cache and `supports` read everything from here.

Dtype rules: a tensor's `dtype` is either a dtype variable of the op (`"x"`, `"out"`), which takes
the dtype of the call's tensors and is part of the compile key, or a fixed dtype (`"float32"`).
Scalars travel in a trailing float32 `params` input of length `len(params)` on the op's device.

Outputs are mutable buffers: the graph passes the caller's output tensors to the op as MAX buffers
(`ops.inplace_custom`), so in Mojo every output parameter is a
`MutableInputTensor` (`from extensibility import _MutableInputTensor as MutableInputTensor`), never an
`OutputTensor`. An OutputTensor is a MAX-allocated temporary that the graph would have to copy into
the caller's buffer afterwards: an extra read + write of every output (half the bandwidth of a
memory-bound op). Kernels must write every element of every output (a buffer holds whatever the caller left in it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)

# Stands for a [1, 1] float32 placeholder on the op's device, passed where an optional input is
# absent (the kernel reads the matching has_* flag and never touches it).
DUMMY_F32 = "dummy_f32"

Bound = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | str, ...], tuple[float, ...]]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor argument of a MAX custom op: name, symbolic dims, dtype variable or fixed dtype."""

    name: str
    dims: tuple[str | int, ...]
    dtype: str  # a dtype variable of the op ("x", "out") or a torch dtype name ("float32")


@dataclass(frozen=True)
class OpSpec:
    """A fusekit op as a MAX custom op (outputs first, then inputs, then params)."""

    op: str
    max_op: str
    outputs: tuple[TensorSpec, ...]
    inputs: tuple[TensorSpec, ...]
    params: tuple[str, ...]  # names of the float32 params entries, in order ("" = no params input)
    dtype_vars: tuple[str, ...]  # e.g. ("x",) or ("x", "out")
    allowed: frozenset[tuple[torch.dtype, ...]]  # allowed dtypes for dtype_vars, in order
    bind: Callable[..., Bound]  # provider args -> (outputs, inputs, params values)

    def __post_init__(self) -> None:
        # Position (in outputs + inputs) of the first tensor typed by each dtype variable.
        specs = self.outputs + self.inputs
        pos = tuple(next(i for i, t in enumerate(specs) if t.dtype == v) for v in self.dtype_vars)
        object.__setattr__(self, "_dtype_pos", pos)

    def dtype_key(self, outs: tuple[torch.Tensor, ...], ins: tuple[torch.Tensor | str, ...]) -> tuple:
        """The dtypes of this call's dtype variables (part of the compile key)."""
        args = outs + ins
        return tuple(args[i].dtype for i in self._dtype_pos)  # type: ignore[attr-defined, union-attr]

    def tensor_dtype(self, spec: TensorSpec, key: tuple[torch.dtype, ...]) -> torch.dtype:
        """The torch dtype of one tensor argument for a compile key."""
        if spec.dtype in self.dtype_vars:
            return key[self.dtype_vars.index(spec.dtype)]
        return getattr(torch, spec.dtype)


def _t(name: str, dims: str, dtype: str) -> TensorSpec:
    return TensorSpec(name, tuple(int(d) if d.isdigit() else d for d in dims.split()), dtype)


# --- bind functions: provider (DPS) arguments -> (outputs, inputs, params) ---------------------------
def _bind_reduce_sum(out: torch.Tensor, x: torch.Tensor) -> Bound:
    return (out,), (x,), ()


def _bind_rms_norm(
    out: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> Bound:
    return (out, rstd), (x, weight), (float(eps),)


def _bind_layer_norm(
    out: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> Bound:
    # No bias: the weight is passed again as a dummy and has_bias = 0 tells the kernel to skip it.
    b = weight if bias is None else bias
    return (out, mean, rstd), (x, weight, b), (float(eps), 0.0 if bias is None else 1.0)


def _bind_rope(
    out: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    start_pos: int,
    theta: float,
    interleaved: bool,
) -> Bound:
    has = cos is not None and sin is not None
    c = cos if has else DUMMY_F32
    s = sin if has else DUMMY_F32
    return (out,), (x, c, s), (float(theta), float(start_pos), float(bool(interleaved)), float(has))


_REDUCE_PAIRS = frozenset(
    [(a, b) for a in FLOATS for b in FLOATS] + [(a, b) for a in INTS for b in INTS]
)  # floating: fp32 accumulation; integer: int64 accumulation; one cast at the end


def _bind_swiglu_ffn(out, x, w_gate, w_up, w_down, norm_weight, eps) -> Bound:
    nw = x[0] if norm_weight is None else norm_weight  # dummy [D]; not read when has_norm == 0
    return (out,), (x, w_gate, w_up, w_down, nw), (float(eps), 0.0 if norm_weight is None else 1.0)


def _bind_attention(out, q, k, v, causal, scale) -> Bound:
    return (out,), (q, k, v), (float(scale), float(bool(causal)))


SPECS: dict[str, OpSpec] = {
    "reduce_sum": OpSpec(
        op="reduce_sum",
        max_op="fusekit.reduce_sum",
        outputs=(_t("out", "M", "out"),),
        inputs=(_t("x", "M N", "x"),),
        params=(),
        dtype_vars=("x", "out"),
        allowed=_REDUCE_PAIRS,
        bind=_bind_reduce_sum,
    ),
    "rms_norm": OpSpec(
        op="rms_norm",
        max_op="fusekit.rms_norm",
        outputs=(_t("out", "M N", "x"), _t("rstd", "M", "float32")),
        inputs=(_t("x", "M N", "x"), _t("weight", "N", "x")),
        params=("eps",),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in FLOATS),
        bind=_bind_rms_norm,
    ),
    "layer_norm": OpSpec(
        op="layer_norm",
        max_op="fusekit.layer_norm",
        outputs=(_t("out", "M N", "x"), _t("mean", "M", "float32"), _t("rstd", "M", "float32")),
        inputs=(_t("x", "M N", "x"), _t("weight", "N", "x"), _t("bias", "N", "x")),
        params=("eps", "has_bias"),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in FLOATS),
        bind=_bind_layer_norm,
    ),
    "rope": OpSpec(
        op="rope",
        max_op="fusekit.rope",
        outputs=(_t("out", "B S H D", "x"),),
        inputs=(_t("x", "B S H D", "x"), _t("cos", "St Dh", "float32"), _t("sin", "St Dh", "float32")),
        params=("theta", "start_pos", "interleaved", "has_tables"),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in FLOATS),
        bind=_bind_rope,
    ),
    "swiglu_ffn": OpSpec(
        op="swiglu_ffn",
        max_op="fusekit.swiglu_ffn",
        outputs=(_t("out", "T D", "x"),),
        inputs=(
            _t("x", "T D", "x"),
            _t("w_gate", "F D", "x"),
            _t("w_up", "F D", "x"),
            _t("w_down", "D F", "x"),
            _t("norm_weight", "D", "x"),
        ),
        params=("eps", "has_norm"),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in FLOATS),
        bind=_bind_swiglu_ffn,
    ),
    "attention": OpSpec(
        op="attention",
        max_op="fusekit.attention",
        outputs=(_t("out", "B H S D", "x"),),
        inputs=(_t("q", "B H S D", "x"), _t("k", "B Hkv Skv D", "x"), _t("v", "B Hkv Skv D", "x")),
        params=("scale", "causal"),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in FLOATS),
        bind=_bind_attention,
    ),
}

# rope's start_pos travels as float32: exact only up to 2^24.
ROPE_MAX_POSITION = 1 << 24
