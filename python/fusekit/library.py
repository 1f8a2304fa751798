"""The ops as torch.library custom ops, so torch.compile(fullgraph=True) traces them as single nodes.

Each custom op takes flattened, contiguous, validated inputs plus the requested backend name, resolves
the backend at run time, allocates the outputs and calls the provider (destination-passing). Empty
problems are answered here, so providers never see them. In eager mode `fusekit.ops` calls the same
implementation directly and skips the dispatcher's per-call cost.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusekit import dispatch, outputs


def _rows(x: Tensor) -> tuple[int, ...]:
    return (x.shape[0],)


# --- reduce_sum ------------------------------------------------------------------------------------
def reduce_sum_impl(x: Tensor, out_dtype: torch.dtype, backend: str) -> Tensor:
    out = outputs.empty(_rows(x), out_dtype, x.device)
    if x.numel() == 0:
        return out.zero_()
    dispatch.resolve("reduce_sum", backend, x.device, x.dtype, out_dtype=out_dtype).reduce_sum(out, x)
    return out


# --- rms_norm --------------------------------------------------------------------------------------
def rms_norm_impl(x: Tensor, weight: Tensor, eps: float, backend: str) -> tuple[Tensor, Tensor]:
    out = outputs.empty(x.shape, x.dtype, x.device)
    rstd = outputs.empty(_rows(x), torch.float32, x.device)
    if x.numel():
        dispatch.resolve("rms_norm", backend, x.device, x.dtype).rms_norm(out, rstd, x, weight, eps)
    return out, rstd


# --- layer_norm ------------------------------------------------------------------------------------
def layer_norm_impl(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    out = outputs.empty(x.shape, x.dtype, x.device)
    mean = outputs.empty(_rows(x), torch.float32, x.device)
    rstd = outputs.empty(_rows(x), torch.float32, x.device)
    if x.numel():
        b = dispatch.resolve("layer_norm", backend, x.device, x.dtype)
        b.layer_norm(out, mean, rstd, x, weight, bias, eps)
    return out, mean, rstd


# --- rope ------------------------------------------------------------------------------------------
def rope_impl(
    x: Tensor,
    cos: Tensor | None,
    sin: Tensor | None,
    start_pos: int,
    theta: float,
    interleaved: bool,
    backend: str,
) -> Tensor:
    out = outputs.empty(x.shape, x.dtype, x.device)
    if x.numel():
        b = dispatch.resolve("rope", backend, x.device, x.dtype, tables=cos is not None)
        b.rope(out, x, cos, sin, start_pos, theta, interleaved)
    return out


# --- swiglu_ffn ------------------------------------------------------------------------------------
def swiglu_ffn_impl(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    backend: str,
) -> Tensor:
    out = outputs.empty(x.shape, x.dtype, x.device)
    if x.numel():
        b = dispatch.resolve("swiglu_ffn", backend, x.device, x.dtype)
        b.swiglu_ffn(out, x, w_gate, w_up, w_down, norm_weight, eps)
    return out


# --- attention -------------------------------------------------------------------------------------
def attention_impl(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, backend: str) -> Tensor:
    out = outputs.empty(q.shape, q.dtype, q.device)
    if q.numel():
        b = dispatch.resolve("attention", backend, q.device, q.dtype, head_dim=q.shape[-1])
        b.attention(out, q, k, v, causal, scale)
    return out


# --- registration ----------------------------------------------------------------------------------
def _register(name: str, impl, fake) -> None:
    op = torch.library.custom_op(f"fusekit::{name}", mutates_args=())(impl)
    op.register_fake(fake)


def _empty_rows(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return x.new_empty(_rows(x), dtype=dtype)


_register("reduce_sum", reduce_sum_impl, lambda x, out_dtype, backend: _empty_rows(x, out_dtype))
_register("rms_norm", rms_norm_impl, lambda x, w, eps, backend: (torch.empty_like(x), _empty_rows(x)))
_register(
    "layer_norm",
    layer_norm_impl,
    lambda x, w, b, eps, backend: (torch.empty_like(x), _empty_rows(x), _empty_rows(x)),
)
_register("rope", rope_impl, lambda x, cos, sin, start_pos, theta, interleaved, backend: torch.empty_like(x))
_register("swiglu_ffn", swiglu_ffn_impl, lambda x, wg, wu, wd, nw, eps, backend: torch.empty_like(x))
_register("attention", attention_impl, lambda q, k, v, causal, scale, backend: torch.empty_like(q))

_IMPLS = {
    "reduce_sum": reduce_sum_impl,
    "rms_norm": rms_norm_impl,
    "layer_norm": layer_norm_impl,
    "rope": rope_impl,
    "swiglu_ffn": swiglu_ffn_impl,
    "attention": attention_impl,
}


def call(op: str, *args):
    """Run op `op`: through the custom op while torch.compile traces, directly otherwise."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.fusekit, op)(*args)
    return _IMPLS[op](*args)
