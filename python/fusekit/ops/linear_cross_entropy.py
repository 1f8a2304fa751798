"""linear_cross_entropy: cross_entropy(x @ weight.T + bias, target) without the [tokens, vocab] logits.

The LM-head matmul and the loss of a causal LM, fused the way Liger-Kernel's FusedLinearCrossEntropy
does it: the tokens are cut into chunks whose logits [C, V] are about the size of x [T, H]
(`chunk_rows`), and each chunk's logits are made, reduced to the loss and, when the call records a
gradient, turned into d loss / d logits in the same pass, which then gives the chunk's rows of d x and
its share of d weight and d bias straight away. The forward therefore computes the gradients (for the
reduction "mean" or "sum", the gradient of the loss itself), and the backward only scales them by the
loss's output gradient: a training step never holds more than one chunk of logits, and nothing but
those gradients is saved for backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fusekit import distributed, library
from fusekit.distributed import PLAIN
from fusekit.ops import _amp
from fusekit.ops import _checks as C
from fusekit.ops._spec import BACKWARD, FORWARD, XSAVE, OpSpec, Phase, Scalar, acc_dtype, t

REDUCTIONS = ("mean", "sum", "none")


# Smallest chunk logits, in elements (1 GiB of bf16): Liger's rule alone gives 32 chunks at Llama-3's V/H
# whatever T is, and every chunk adds its [V, H] product into d weight: a read and a write of d weight (2 GiB
# at Llama-3-8B bf16) and one rounding to x's dtype per chunk. Measured on an H100 (triton, H 4096,
# V 128256, bf16, training step): 32 chunks 61.7 / 65.8 ms at T 4096 / 8192; floor 2^27 (1024 tokens)
# 21.0 / 42.9 ms; 2^28 21.2 / 42.4; 2^29 (4096 tokens) 21.1 / 40.1 ms, +0.74 GiB (mojo 47.2 -> 41.4 ms at
# T 8192); 2^30 no faster. Peak stays under torch.compile's unchunked step (3.07 GiB at T 8192). Tests lower
# it to exercise chunking.
MIN_CHUNK_LOGITS = 1 << 29


def chunk_rows(T: int, V: int, H: int) -> int:
    """Tokens per chunk: a power of two that keeps a chunk's logits [C, V] about the size of x [T, H]
    (Liger-Kernel's rule: C = next_pow2(T / ceil(V / H))) but at least MIN_CHUNK_LOGITS elements, and at
    most T. Llama-3-8B, T = 8192, H = 4096, V = 128256: 2 chunks of 4096 tokens (1002 MiB of bf16 logits)."""
    inc = -(-V // H)
    c = -(-T // inc)
    c = 1 << (c - 1).bit_length()
    floor = MIN_CHUNK_LOGITS // V
    if floor >= 1:
        c = max(c, 1 << (floor.bit_length() - 1))
    return max(1, min(c, T))


def fp16_grad_scale(scale: Tensor) -> Tensor:
    """S = 2^14 * 2^floor(log2(1 / scale)) for fp16 x: d logits * scale * S lie within 2^14 in magnitude (no
    overflow) and their probabilities down to ~4e-9 stay in fp16's normal range; an all-ignored call (scale
    inf, its rows exact zeros) takes S = 2^14."""
    return torch.exp2(14.0 + torch.floor(torch.log2(1.0 / scale.clamp(max=1.0))))


def mm_f32(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """a @ b of fp16 operands with an fp32 result (fp32 accumulation): CUDA's mm(out_dtype=), elsewhere
    fp32 copies of the operands."""
    if a.is_cuda and hasattr(torch.ops.aten.mm, "dtype"):
        r = torch.mm(a, b, out_dtype=torch.float32)
    else:
        r = a.float() @ b.float()
    if out is None:
        return r
    return out.copy_(r)


# --- reference (what the op means; the torch backend runs it) ---------------------------------------
def reference_forward(
    loss: Tensor,
    dx: Tensor | None,
    dweight: Tensor | None,
    dbias: Tensor | None,
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> None:
    """Fills loss (and, when given, the gradient of the "mean"/"sum" loss d x, d weight, d bias) from
    x [T, H], weight [V, H], target [T] int64, bias [V] (destination passing, chunk by chunk).

    Meaning, per chunk of rows as HF computes the whole: logits = F.linear(x, weight, bias) in x's dtype
    (fp32 accumulation), z = logits in fp32 (fp64 for fp64 x), lse = logsumexp(z), and per row
    loss = lse - (1 - ε) z[target] - ε mean(z) (ε = label_smoothing); a row whose target is
    ignore_index has loss 0 and gradient 0; a target outside [0, V) gives NaN. "mean" divides the sum
    by the number of rows not ignored (all ignored: NaN, gradients 0, as torch). d logits =
    (softmax(z) - (1 - ε) onehot - ε / V) · scale, rounded to x's dtype as autograd through HF's
    `.float()` does; d x = d logits @ weight (x's dtype), d weight = Σ d logitsᵀ x and d bias = Σ d logits
    accumulated over the chunks in fp32 and rounded once.

    fp16 x: d logits · scale are ~softmax / tokens, far below fp16's normal range (6.1e-5) until the loss's
    own gradient (GradScaler's 2^16) multiplies them, which happens only in the backward. So they are
    rounded to fp16 times a power of two S = 2^14 · 2^floor(log2(1 / scale)) (|d logits · S| <= 2^14: no
    overflow, probabilities down to ~4e-9 stay normal), the GEMMs take them with fp32 results, and d x,
    d weight, d bias are saved in fp32 ("xsave") divided by S (exact): the backward's multiply by the
    loss's gradient is their one rounding to fp16. Under a 2^16 loss scale that is as accurate as HF's
    unfused loss, or more (HF rounds d x and d weight to fp16 after their GEMMs too).

    Precision (every backend): lse = m + ls (m the row's max, ls = log Σ exp(z - m) in [0, log V]) is never
    rounded as one number, as torch's log_softmax: loss = (1 - ε)(m - z[target]) + ε (m - mean(z)) + ls
    and softmax(z) = exp((z - m) - ls). An fp32 lse carries ~u |m| (u = 2^-24), which moved every softmax
    value of the row by that relative amount (their sum off 1) and every loss by that much: 20x torch's
    own fp32 error on d x at logits ~18 (4.1e-5 against 2.1e-6; the fuzzer, FUSEKIT_FUZZ_SEED=6 x20), and
    ~1e-4 relative loss error for confident rows (loss ~0.03) at logits ~256.
    """
    T, _ = x.shape
    V = weight.shape[0]
    acc = acc_dtype(x.dtype)
    valid = target != ignore_index
    scale = 1.0 / valid.sum().to(acc) if reduction == "mean" else torch.ones((), dtype=acc, device=x.device)
    rows = torch.empty(T, dtype=acc, device=x.device) if reduction != "none" else loss
    # d weight / d bias accumulate in fp32 and round once (the outputs themselves for fp32 / fp64 x)
    dw = (
        None
        if dweight is None
        else (dweight if dweight.dtype == acc else torch.empty_like(dweight, dtype=acc))
    )
    db = None if dbias is None else torch.zeros(V, dtype=acc, device=x.device)
    # fp16: d logits go to fp16 times S (see the docstring and fp16_grad_scale)
    fp16 = x.dtype == torch.float16 and dx is not None
    S = fp16_grad_scale(scale) if fp16 else None
    step = chunk_rows(T, V, x.shape[1])
    for s in range(0, T, step):
        e = min(s + step, T)
        xc, tc, ok = x[s:e], target[s:e], valid[s:e]
        z = F.linear(xc, weight, bias).to(acc)
        # lse = m + ls is never formed: rounded at |m| it would carry ~u |m| into every loss and every
        # softmax value (see the docstring)
        m = z.amax(dim=-1)
        zm = z - m[:, None]
        ls = torch.log(torch.exp(zm).sum(dim=-1))
        inside = (tc >= 0) & (tc < V)
        zy = z.gather(1, tc.clamp(0, V - 1)[:, None])[:, 0]
        lr = (1.0 - label_smoothing) * (m - zy) + ls
        # only with smoothing: 0 * (m - mean z) is NaN for a -inf logit, where torch's loss is finite
        if label_smoothing != 0.0:
            lr = lr + label_smoothing * (m - z.mean(dim=-1))
        lr = torch.where(inside, lr, torch.nan)
        rows[s:e] = torch.where(ok, lr, 0.0)
        if dx is None:
            continue
        g = torch.exp(zm - ls[:, None])
        g -= label_smoothing / V
        g.scatter_add_(1, tc.clamp(0, V - 1)[:, None], torch.full_like(zy, label_smoothing - 1.0)[:, None])
        g = torch.where(inside[:, None], g, torch.nan)
        g = torch.where(ok[:, None], g * (scale * S if fp16 else scale), 0.0)
        gl = g.to(x.dtype)  # d logits in x's dtype, as the matmuls of the linear's backward see them
        (mm_f32 if fp16 else torch.mm)(gl, weight, out=dx[s:e])
        if dw is not None:
            part = (gl.t().to(acc) @ xc.to(acc)) if gl.dtype != acc else gl.t() @ xc
            if s == 0:
                dw.copy_(part)
            else:
                dw += part
        if db is not None:
            db += gl.to(acc).sum(dim=0)
    if fp16:  # back from d logits · S, exactly (a power of two), in the fp32 saved gradients
        for saved in (dx, dw, db):
            if saved is not None:
                saved.div_(S)
    if dweight is not None and dw is not dweight:
        dweight.copy_(dw)
    if dbias is not None:
        dbias.copy_(db)
    if reduction != "none":
        loss.copy_((rows.sum() * scale).reshape(()))


def reference_backward(
    gx: Tensor,
    gweight: Tensor,
    gbias: Tensor | None,
    dloss: Tensor,
    dx: Tensor,
    dweight: Tensor,
    dbias: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> None:
    """The saved gradients of the loss times the loss's output gradient dloss (0-d) (fp32, fp64 for fp64
    x; "mean" and "sum" only: reduction="none" records no gradient), each rounded once to its output's
    dtype: x's, fp32 for fp16 x (XSAVE), which autograd rounds to the fp16 leaves."""
    for out, saved in ((gx, dx), (gweight, dweight), (gbias, dbias)):
        if out is not None:
            out.copy_(saved.to(dloss.dtype) * dloss)


# --- the fused backends' chunk loop (triton, mojo): Liger's scheme around one row kernel -------------
# rows_kernel(logits [C, V] x's dtype, target [C] int64, rows [C] fp32, scale [1] fp32, grad): fills rows
# with the chunk's per-row losses and, when grad, overwrites logits with d loss / d logits (x's dtype).
RowsKernel = Callable[[Tensor, Tensor, Tensor, Tensor, bool], None]


def fused_forward(
    rows_kernel: RowsKernel,
    loss: Tensor,
    dx: Tensor | None,
    dweight: Tensor | None,
    dbias: Tensor | None,
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> None:
    """The forward of a backend with a row kernel (kernels_triton/linear_cross_entropy.py, the mojo
    backend's fusekit.linear_cross_entropy), destination passing as reference_forward.

    Per chunk of C tokens (chunk_rows): logits = x_c @ weight^T (+ bias) by torch's matmul in x's dtype
    into one reused [C, V] buffer (cuBLAS / hipBLASLt, fp32 accumulation, as HF's F.linear), then the row
    kernel (loss per row; when a gradient is recorded, d logits in place with scale = 1 / rows not ignored
    for "mean", read from the device: no host sync), then grad_x_c = dlogits @ weight (into dx's rows),
    grad_weight += dlogits^T @ x_c (`addmm_` into dweight in x's dtype: each chunk's GEMM accumulates in
    fp32 and the running sum is rounded to x's dtype once per chunk, as Liger's default accum_dtype=None;
    an fp32 accumulator would cost another 4·V·H bytes, 2 GiB at Llama-3-8B), grad_bias = Σ dlogits in
    an fp32 [V] accumulator, rounded once. fp16 x: the row kernel gets scale * S (fp16_grad_scale), the
    GEMMs give fp32 results (mm_f32) into the fp32 saved gradients, divided by S at the end, as
    reference_forward. Deterministic: no atomics, fixed chunk order, torch's reductions.
    """
    T, H = x.shape
    V = weight.shape[0]
    grad = dx is not None
    dev = x.device
    if reduction == "mean":
        n = (target != ignore_index).sum().to(torch.float32)
        scale = (1.0 / n).reshape(1)  # inf with every row ignored: those rows write exact zeros
    else:
        n, scale = None, torch.ones(1, dtype=torch.float32, device=dev)
    # fp16: the row kernel writes d logits times S (fp16_grad_scale), the GEMMs give fp32 results into the
    # fp32 saved gradients ("xsave"), divided by S at the end (as reference_forward)
    S = fp16_grad_scale(scale) if grad and x.dtype == torch.float16 else None
    kscale = scale if S is None else scale * S
    rows = loss if reduction == "none" else torch.empty(T, dtype=torch.float32, device=dev)
    step = chunk_rows(T, V, H)
    buf = torch.empty((min(step, T), V), dtype=x.dtype, device=dev)
    db = torch.zeros(V, dtype=torch.float32, device=dev) if dbias is not None else None
    wt = weight.t()
    for s in range(0, T, step):
        e = min(s + step, T)
        xc, logits = x[s:e], buf[: e - s]
        if bias is not None:
            torch.addmm(bias, xc, wt, out=logits)
        else:
            torch.mm(xc, wt, out=logits)
        rows_kernel(logits, target[s:e], rows[s:e], kscale, grad)
        if not grad:
            continue
        mm = torch.mm if S is None else mm_f32
        mm(logits, weight, out=dx[s:e])
        if s == 0:
            mm(logits.t(), xc, out=dweight)
        elif S is None:
            dweight.addmm_(logits.t(), xc)
        else:  # fp32 dweight, fp16 operands: addmm_ takes one dtype
            dweight += mm_f32(logits.t(), xc)
        if db is not None:
            db += logits.sum(dim=0, dtype=torch.float32)
    if S is not None:
        for saved in (dx, dweight, db):
            if saved is not None:
                saved.div_(S)
    if db is not None:
        dbias.copy_(db)
    if reduction == "sum":
        torch.sum(rows, dim=0, out=loss)
    elif reduction == "mean":
        torch.div(rows.sum(dim=0), n, out=loss)


def fused_backward(
    gx: Tensor,
    gweight: Tensor,
    gbias: Tensor | None,
    dloss: Tensor,
    dx: Tensor,
    dweight: Tensor,
    dbias: Tensor | None,
    *_scalars: object,
) -> None:
    """The fused backends' backward: the forward's gradients of the loss times the loss's gradient dloss
    (0-d), fp32 math, one rounding (bandwidth only: 2 x 1 GiB for d weight at Llama-3-8B bf16). gx / gweight /
    gbias may be dx / dweight / dbias themselves (Phase.reuse: scaled in place). One `_foreach_mul_` by
    dloss as a 0-d device tensor (clip_grad_norm_'s pattern: vectorized, fp32 opmath, no host sync), where
    `torch.mul` of a bf16 tensor by an fp32 [1] one ran torch's unvectorized mixed-dtype kernel (2.25 ms
    for d weight in the H100's 8B training step)."""
    scale_saved(
        [(out, saved) for out, saved in ((gx, dx), (gweight, dweight), (gbias, dbias)) if out is not None],
        dloss,
    )


def scale_saved(pairs: list[tuple[Tensor, Tensor]], dloss: Tensor) -> None:
    """out = saved * dloss for each (out, saved) pair (out may be saved itself), fp32 math, one rounding:
    fused_backward's multiply, and the triton backend's for the pairs its scale kernel does not take."""
    if dloss.numel() != 1:
        for out, saved in pairs:
            torch.mul(saved, dloss, out=out)
        return
    for out, saved in pairs:
        if out.data_ptr() != saved.data_ptr():
            out.copy_(saved)
    if pairs:
        torch._foreach_mul_([out for out, _ in pairs], dloss.reshape(()))


def _loss_shape(ins: dict[str, Tensor | None], sc: dict[str, object]) -> dict[str, tuple[int, ...]]:
    """loss is [T] for reduction="none", else 0-d: returned as allocated, not as a view (FSDP2 warns that an
    in-place op on a view output would drop its pre-backward hook)."""
    return {"loss": (ins["x"].shape[0],) if sc["reduction"] == "none" else ()}


def _label_smoothing(v: object) -> float:
    f = C.real("label_smoothing", v)
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"label_smoothing: must be in [0, 1], got {v}")
    return f


SPEC = library.register(
    OpSpec(
        name="linear_cross_entropy",
        saved_history=False,  # saves dx / dweight / dbias computed by the forward: no history of x, weight
        forward=Phase(
            outputs=(
                t("loss", "L", "acc"),
                t("dx", "T H", XSAVE, "save", grad=False),
                t("dweight", "V H", XSAVE, "save", grad=False),
                t("dbias", "V", XSAVE, "bias_save", grad=False),
            ),
            inputs=(
                t("x", "T H"),
                t("weight", "V H"),
                t("target", "T", "int64"),
                t("bias", "V", "x", "bias"),
            ),
            conditions=("bias", "save"),
            shapes=_loss_shape,
        ),
        backward=Phase(
            # fp32 for fp16 x (XSAVE): autograd rounds the gradients to the leaves' fp16 once
            outputs=(t("gx", "T H", XSAVE), t("gweight", "V H", XSAVE), t("gbias", "V", XSAVE, "bias")),
            inputs=(
                t("dloss", "L", "acc"),
                t("dx", "T H", XSAVE),
                t("dweight", "V H", XSAVE),
                t("dbias", "V", XSAVE, "bias"),
            ),
            conditions=("bias",),
            reuse=(("gx", "dx"), ("gweight", "dweight"), ("gbias", "dbias")),  # scaled in place (eager)
        ),
        scalars=(
            Scalar("ignore_index", int, lambda v: C.integer("ignore_index", v)),
            Scalar("reduction", str, lambda v: C.choice("reduction", v, REDUCTIONS), REDUCTIONS),
            Scalar("label_smoothing", float, _label_smoothing),
        ),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in C.ANY_FLOAT),
        reference={FORWARD: reference_forward, BACKWARD: reference_backward},
        reference_fills=True,
        grad_inputs=("x", "weight", "bias"),
        save=lambda ins, outs: (outs["dx"], outs["dweight"], outs["dbias"]),
        backward_inputs=lambda saved, g, cond: (g["loss"], *saved),
        input_grads=lambda g, cond: (g["gx"], g["gweight"], None, g["gbias"]),
        derived=(("bias_save", ("bias", "save")),),
        refuse=lambda sc, save: (
            "save=True with reduction='none' has no backward (the saved gradients are of the summed loss)"
            if save and sc["reduction"] == "none"
            else None
        ),
    )
)


# --- public ------------------------------------------------------------------------------------------
def _check(x: object, weight: object, target: object, bias: object) -> None:
    x = C.tensor("x", x, C.ANY_FLOAT)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., H] with H > 0, got {tuple(x.shape)}")
    h = x.shape[-1]
    weight = C.tensor("weight", weight, (x.dtype,), ndim=2)
    C.same_device("weight", weight, "x", x)
    if weight.shape[1] != h:
        raise ValueError(
            f"weight: expected shape [V, {h}] (x's hidden size H = {h}), got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight: the vocabulary size V (dim 0) must be > 0")
    C.like("target", target, "x", x, tuple(x.shape[:-1]), (torch.int64,))
    if bias is not None:
        C.like("bias", bias, "x", x, (weight.shape[0],))


def _requires_grad(*ts: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in ts)


_MEMO = library.memo()  # validated calls (see library.call_key)


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """cross_entropy(F.linear(x, weight, bias).float(), target): the loss of an LM head, as HF computes it
    (logits in x's dtype, upcast to fp32), without ever holding more than one chunk of the logits.

    x [..., H] (fp16, bf16, fp32; fp64 on the torch backend); weight [V, H] (lm_head.weight) and bias [V]
    in x's dtype; target int64 [...] (x's leading dims): class indices, `ignore_index` marks rows that
    count for nothing. A target outside [0, V) that is not ignore_index gives a NaN loss (torch raises;
    checking would read the targets on the host every call). label_smoothing ε in [0, 1] as torch's.
    reduction: "mean" (over the rows not ignored; all ignored: NaN, as torch), "sum" (fp32 0-d tensors),
    or "none" (per-row fp32 losses [...], 0 on ignored rows).

    Gradients flow to x, weight and bias for "mean" and "sum": the forward computes them chunk by chunk
    (fp32 softmax math, d logits rounded to x's dtype; fp16: times a power of two, the gradients saved in
    fp32, so a loss scale's underflow never happens) and saves only them; the backward scales them by
    the loss's gradient. reduction="none" with an input that requires grad raises ValueError (its weight
    gradient would need the per-row output gradients before the chunks are summed). Under no_grad no
    gradient is computed. backend: "auto" (default), "torch", "triton", "mojo".
    Errors: TypeError/ValueError naming the argument.
    """
    if (
        type(x) not in PLAIN
        or type(weight) not in PLAIN
        or type(target) not in PLAIN
        or type(bias) not in PLAIN
    ) and (w := distributed.linear_cross_entropy({"x": x, "weight": weight, "target": target, "bias": bias})):
        return linear_cross_entropy(  # AsyncCollectiveTensors, waited for (DTensors raise above)
            w["x"], w["weight"], w["target"], w["bias"], ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, backend=backend,
        )  # fmt: skip
    if (cast := _amp.lower(x, weight, bias)) is not None:  # autocast: the head as F.linear
        x, weight, bias = cast
    key = library.call_key((x, weight, target, bias), (ignore_index, reduction, label_smoothing), backend)
    run = _MEMO.get(key) if key is not None else None
    if run is None:  # the checked path (first call of a signature, grad, compile)
        _check(x, weight, target, bias)
        scalars = tuple(s.check(v) for s, v in zip(SPEC.scalars, (ignore_index, reduction, label_smoothing)))
        C.backend_name(backend)
        if reduction == "none" and _requires_grad(x, weight, bias):
            raise ValueError(
                "reduction: linear_cross_entropy with reduction='none' has no backward here (the forward "
                "computes the weight gradient summed over the rows, before the per-row output gradients "
                "are known); use 'sum' or 'mean', or detach the inputs / run under torch.no_grad()"
            )
        if x.numel() == 0:  # no rows: torch's own answer (NaN for "mean"), nothing to chunk
            if backend != "auto":  # yet a backend that cannot run this call refuses it, as at any size
                ins = (x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), bias)
                library.check_backend(SPEC, ins, scalars, backend)
            z = F.linear(x, weight, bias).float()
            return F.cross_entropy(
                z.reshape(0, weight.shape[0]),
                target.reshape(0),
                ignore_index=ignore_index,
                reduction=reduction,
                label_smoothing=label_smoothing,
            ).reshape(target.shape if reduction == "none" else ())
    b = bias.contiguous() if bias is not None else None
    ins = (C.rows(x), weight.contiguous(), target.contiguous().view(-1), b)
    out = run(ins)[0] if run is not None else library.apply_memo(_MEMO, key, SPEC, ins, scalars, backend)[0]
    return out.view(target.shape) if reduction == "none" else out
