"""What the two norms (RMSNorm, LayerNorm) share: dtype rules, the residual add, argument checks, return shapes."""

from __future__ import annotations

import torch
from torch import Tensor

from fusekit.ops import _checks as C

F64 = torch.float64
# (x, w): the weight (and bias) in x's dtype, or fp32 under fp16/bf16 x; float64 for gradcheck.
NORM_DTYPES = frozenset(
    [(d, d) for d in C.ANY_FLOAT] + [(d, torch.float32) for d in (torch.float16, torch.bfloat16)]
)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Math dtype of the norms: fp32, or fp64 for fp64 inputs."""
    return F64 if dtype == F64 else torch.float32


def add_residual(x: Tensor, residual: Tensor | None) -> Tensor | None:
    """h = x + residual, added in fp32 and rounded once to x's dtype (None without a residual)."""
    if residual is None:
        return None
    acc = acc_dtype(x.dtype)
    return (x.to(acc) + residual.to(acc)).to(x.dtype)


def promote_residual(x: Tensor, residual: Tensor | None, *params: Tensor | None) -> tuple:
    """(x, residual, *params) in torch's promotion of x + residual: an fp32 residual stream meeting a
    bf16 sublayer output (an fp32 model under bf16 autocast, as HF adds them) is normalized in fp32, the
    narrower tensor cast once. A weight / bias of the narrower dtype is widened too (exact; HF multiplies
    it into the promoted h the same way), where the kernels would refuse it beside the promoted x. Same
    dtypes (the common case) pass through untouched."""
    if (
        not isinstance(x, Tensor)
        or not isinstance(residual, Tensor)
        or residual.dtype == x.dtype
        or not (x.is_floating_point() and residual.is_floating_point())
    ):
        return (x, residual, *widen_params(x, *params))  # the common case; or the checks name the argument
    dt = torch.promote_types(x.dtype, residual.dtype)
    x = x.to(dt)
    return (x, residual.to(dt), *widen_params(x, *params))


# Backward nodes that hand their incoming gradient on unchanged or as a view of it (the rest make new tensors).
_PASS_ON = frozenset(
    ("View", "UnsafeView", "Reshape", "ReshapeAlias", "Alias", "AsStrided", "Clone", "Add", "T", "Transpose",
     "Permute", "Squeeze", "Unsqueeze", "Expand", "Unfold", "Split", "Unbind", "Narrow")
)  # fmt: skip


def _may_keep_grad(t: Tensor) -> bool:
    """Whether autograd may keep the very gradient tensor t receives (or a view of it) as a leaf's .grad:
    t is a leaf, or a chain of pass-on nodes (views, clone, add) reaches one. A graph too deep to tell
    counts as yes."""
    stack, seen = [t.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None:
            if seen == 0:
                return True  # t is a leaf
            continue
        seen += 1
        if seen > 32:
            return True
        name = type(node).__name__
        if name == "AccumulateGrad":
            return True
        if name.rstrip("0123456789").removesuffix("Backward") in _PASS_ON:
            stack.extend(f for f, _ in node.next_functions)
    return False


class _OwnGrad(torch.autograd.Function):
    """Identity whose backward hands on a copy of its gradient (setup_context form: inside a torch.func
    transform the op's own refusal, which names it, is what the caller sees)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(t: Tensor) -> Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g.clone()


def own_residual_grad(x: Tensor, residual: Tensor) -> Tensor:
    """residual, or an identity of it whose gradient is a copy, where x's and residual's gradients could
    otherwise end up as one buffer. The fused norm's backward gives both the same dx; torch copies a
    gradient that reaches two leaves as one tensor, but the [M, N] views of non-2-d inputs turn it into two
    views of one storage, which the leaves keep as their .grad: the next accumulation added into it twice
    (3x instead of 2x) and zeroing one zeroed the other. Only when both could keep it (leaves, or views /
    clones / adds of leaves); a model's residual stream (sublayer outputs, the last norm's h) pays nothing.
    Not while compiling (the compiled backward returns its grads as separate outputs)."""
    if (
        torch.is_grad_enabled()
        and isinstance(x, Tensor)  # not yet validated: the checks name a non-tensor argument
        and isinstance(residual, Tensor)
        and x.requires_grad
        and residual.requires_grad
        and not (x.dim() == 2 and x.is_contiguous() and residual.dim() == 2 and residual.is_contiguous())
        and not torch.compiler.is_compiling()
        and _may_keep_grad(x)
        and _may_keep_grad(residual)
    ):
        return _OwnGrad.apply(residual)
    return residual


def wider(x: object, p: object) -> bool:
    """Whether x is fp32 / fp64 and p (a weight or bias) a tensor of another dtype: widen_params' cheap guard
    (a few attribute reads on the hot path; non-tensors go on to the checks)."""
    try:
        xd = x.dtype  # type: ignore[attr-defined]
        return (xd is torch.float32 or xd is F64) and p.dtype is not xd  # type: ignore[attr-defined]
    except AttributeError:
        return False


def widen_params(x: object, *params: Tensor | None) -> tuple:
    """Weights / biases narrower than an fp32 / fp64 x, widened to x's dtype (exact), as torch promotes
    `weight * x`: a bf16 model's norms fed fp32 activations (fp32 inputs_embeds under autocast) compute in
    fp32 and return fp32, as HF's and torch's norms do; the kernels take weights of x's dtype there. Half
    x (the AMP case: fp32 weights allowed) and same dtypes pass through untouched, before any other check."""
    dt = getattr(x, "dtype", None)
    if dt is not torch.float32 and dt is not F64:
        return params
    for p in params:
        if isinstance(p, Tensor) and p.dtype is not dt:
            break
    else:
        return params  # same dtypes: no new tuple
    return tuple(
        p.to(dt)
        if isinstance(p, Tensor)
        and p.dtype is not dt
        and p.is_floating_point()
        and torch.promote_types(p.dtype, dt) == dt
        else p
        for p in params
    )


def check_norm_inputs(x: object, weight: object, bias: object, residual: object) -> int:
    """Checks x, weight, bias, residual of a norm; returns N (the normalized extent)."""
    x = C.tensor("x", x, C.ANY_FLOAT)
    n = C.normalized_dim(x)
    wd = C.weight_dtypes(x)
    weight = C.like("weight", weight, "x", x, (n,), wd)
    if bias is not None:
        C.like("bias", bias, "weight", weight, (n,))  # the same dtype as the weight
    if residual is not None:
        C.like("residual", residual, "x", x, tuple(x.shape))
    return n


def norm_returns(x: Tensor, y: Tensor, h: Tensor | None, stats: tuple[Tensor, ...]) -> Tensor | tuple:
    """y (and h) back in x's shape, stats in x's leading shape: y, (y, h), (y, *stats) or (y, h, *stats)."""
    # y/h are [M, N] and stats [M]: views only where x is not 2-d (view(*sizes) is ~3x cheaper than
    # view(torch.Size) on the host path)
    if x.dim() == 2:
        res = [y] if h is None else [y, h]
        res.extend(stats)
    else:
        shape, lead = tuple(x.shape), tuple(x.shape[:-1])
        res = [y.view(*shape)] if h is None else [y.view(*shape), h.view(*shape)]
        res.extend(s.view(*lead) if lead else s.view(()) for s in stats)
    return res[0] if len(res) == 1 else tuple(res)
