"""reduce_sum: the sum of x over all elements or one dimension — spec, checks, reference, public function."""

from __future__ import annotations

import torch
from torch import Tensor

from fusekit import distributed, library
from fusekit.distributed import PLAIN
from fusekit.ops import _checks as C
from fusekit.ops._spec import FORWARD, OpSpec, Phase, Scalar, t


def _acc(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    return torch.float32 if dtype.is_floating_point else torch.int64


# --- reference (what the op means; the torch backend runs it) ---------------------------------------
def reference_forward(x: Tensor) -> tuple[Tensor]:
    """x [M, N] -> [M]: row sums accumulated in fp32 (floats) or int64 (integers); the provider's
    output buffer (of the requested dtype) takes the one rounding."""
    return (x.to(_acc(x.dtype)).sum(dim=-1),)


def grad_view(grads: dict[str, Tensor], inputs: tuple) -> tuple[Tensor]:
    """d x [M, N] = d out [M] broadcast: a stride-0 view in x's dtype, as torch.sum's own gradient
    (a broadcast needs no kernel, no memory and no bandwidth on any backend)."""
    shape, dtype = inputs[0]
    return (grads["out"].to(dtype)[:, None].expand(shape),)


_PAIRS = frozenset(
    [(a, b) for a in C.ANY_FLOAT for b in C.ANY_FLOAT] + [(a, b) for a in C.INT_DTYPES for b in C.INT_DTYPES]
)

SPEC = library.register(
    OpSpec(
        name="reduce_sum",
        forward=Phase(outputs=(t("out", "M", "out"),), inputs=(t("x", "M N"),)),
        scalars=(Scalar("out_dtype", torch.dtype, lambda v: v),),
        dtype_vars=("x", "out"),
        allowed=_PAIRS,
        reference={FORWARD: reference_forward},
        grad_inputs=("x",),
        grad_view=grad_view,
    )
)


# --- public ------------------------------------------------------------------------------------------
def _check(x: object, dim: object, dtype: object) -> torch.dtype:
    """Returns the output dtype (torch.sum's rule: integers -> int64, floats keep their dtype)."""
    x = C.tensor("x", x, C.ANY_FLOAT + C.INT_DTYPES)
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim: expected None or an int, got {type(dim).__name__}")
        nd = max(x.dim(), 1)
        if not -nd <= dim < nd:
            raise ValueError(f"dim: {dim} is out of range for a tensor with {x.dim()} dimensions")
    floating = x.dtype.is_floating_point
    allowed = C.ANY_FLOAT if floating else C.INT_DTYPES
    if dtype is None:
        return x.dtype if floating else torch.int64
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        raise TypeError(
            f"dtype: {dtype} is not supported for a {str(x.dtype).removeprefix('torch.')} input; "
            f"expected one of {C.names(allowed)}"
        )
    return dtype


_MEMO = library.memo()  # validated calls (see library.call_key)


def reduce_sum(
    x: Tensor, dim: int | None = None, *, dtype: torch.dtype | None = None, backend: str = "auto"
) -> Tensor:
    """Sum of `x` over all elements (`dim=None`, 0-d result) or over one dimension.

    x: int32, int64, float16, bfloat16 or float32, any shape, any strides. Result dtype as torch.sum
    (integers -> int64, floats keep their dtype) unless `dtype` is given. Floating inputs accumulate in
    fp32, integers in int64 (exact). `dtype=torch.float64` sums x cast to float64, as torch.sum (on the
    torch backend: the kernels take no float64); a narrower `dtype` only rounds the fp32 sum once (torch.sum
    casts x first: more roundings, and an element past the dtype's range is inf there). Any `dim` works; a
    dim other than the last costs a transposing copy.

    backend: "auto" (default), "torch", "triton" or "mojo" (see `fusekit.backends.available()`).
    Gradients: d x = the output's gradient broadcast over the summed dimension (floating x).
    Errors: TypeError/ValueError naming `x`, `dim` or `dtype`.
    """
    if type(x) not in PLAIN and (out := distributed.reduce_sum(x, dim, dtype, backend)) is not None:
        return out  # DTensor inputs: local compute on the shards (fusekit.distributed)
    key = library.call_key((x,), (dim, dtype), backend)  # None with a dtype (not a plain scalar)
    run = _MEMO.get(key) if key is not None else None
    if run is None:  # the checked path (first call of a signature, grad, compile)
        out_dtype = _check(x, dim, dtype)
        C.backend_name(backend)
        if out_dtype == torch.float64 and x.dtype != torch.float64 and x.is_floating_point():
            x = x.to(torch.float64)  # as torch.sum: a float64 sum of the values (fp32 lost 1 of 2 here)
    if dim is None or x.dim() == 0:
        rows, shape = x.reshape(1, x.numel()), ()
    else:
        xm = x.movedim(dim, -1) if dim != -1 and dim != x.dim() - 1 else x
        rows, shape = C.rows(xm), tuple(xm.shape[:-1])
    ins = (rows.contiguous(),)
    (out,) = run(ins) if run is not None else library.apply_memo(_MEMO, key, SPEC, ins, (out_dtype,), backend)
    return out if len(shape) == 1 else out.view(shape)
