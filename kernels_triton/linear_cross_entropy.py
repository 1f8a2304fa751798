"""Fused linear + cross-entropy (Liger-Kernel's FusedLinearCrossEntropy scheme): the loss of x [T, H] against
weight [V, H] (+ bias [V]) and target [T] without the [T, V] logits.

Entry points (CONTRACT.md):
    forward(loss, dx, dweight, dbias, x, weight, target, bias, ignore_index, reduction, label_smoothing)
    backward(gx, gweight, gbias, dloss, dx, dweight, dbias, ignore_index, reduction, label_smoothing)

Forward (the chunk loop is `fusekit.ops.linear_cross_entropy.fused_forward`, shared with the mojo backend,
whose row kernel is mojo/linear_cross_entropy.mojo), per chunk of C tokens (`chunk_rows`: C x V logits about the size of
x, and at least 2^29 elements: 4096 tokens at Llama-3's vocabulary): logits = x_c @ weight^T (+ bias) by torch's matmul in x's dtype into one reused [C, V] buffer (cuBLAS /
hipBLASLt, fp32 accumulation, as HF's F.linear), then ONE Triton launch, one program per row, that reads the
row twice: pass 1 the online logsumexp over V in fp32 (block max, then the rescaled sum of exps) and, with
label smoothing, the row's sum of logits; the row's loss lse - (1-ε) z_y - ε mean(z), as (1-ε)(m - z_y) +
ε(m - mean(z)) + log(s) (the reference's order: see fusekit.ops.linear_cross_entropy). Pass 2 (only when the
call records a gradient) overwrites the logits in place with d loss / d logits = (softmax - (1-ε) onehot -
ε/V) · scale in x's dtype (scale = 1 / rows not ignored for "mean", read from the device: no host sync);
ignored rows get exact zeros, a target outside [0, V) NaN. Then, from that buffer:
grad_x_c = dlogits @ weight (written into dx's rows), grad_weight += dlogits^T @ x_c (`addmm_` into dweight in
x's dtype: each chunk's GEMM accumulates in fp32 and the running sum is rounded to x's dtype once per chunk,
as Liger's default accum_dtype=None; an fp32 accumulator would cost another 4·V·H bytes, 2 GiB at
Llama-3-8B), grad_bias = Σ dlogits in an fp32 [V] accumulator, rounded once. Everything is deterministic:
no atomics, fixed chunk order, torch's reductions.

Backward: the saved gradients times the loss's gradient (a [1] fp32 tensor; "mean"/"sum" only), computed in
fp32 and rounded once, by _scale_kernel: it reads the loss's gradient on the device and, scaling in place
(Phase.reuse: the eager backward), touches no memory when it is 1 (`loss.backward()`, the usual case), so
d weight's 2 x 1 GiB round trip at Llama-3-8B is skipped without a host sync. A `torch.mul` with a bf16
tensor and an fp32 [1] factor ran torch's unvectorized mixed-dtype kernel: 2.25 ms of a 48.8 ms 4-layer
Llama-3-8B training step on the H100 (fusekit-triton, 35afcc5), where that step is 1.08x HF eager.

Byte floor of the row kernel per chunk: read C·V logits twice, write them once (3 · 2 · C · V bytes in bf16);
at Llama-3-8B (C = 4096, V = 128256) 3.15 GB -> ~0.73 ms at 4.3 TB/s against ~19 ms of the chunk's three GEMMs
(6 · C · H · V FLOP at ~700 TFLOP/s). A row (256 KB of bf16 at V = 128256) does not fit in shared memory, so
its second read is a second pass over HBM/L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusekit.ops.linear_cross_entropy import fused_forward, scale_saved
from kernels_triton._config import device_index, is_interpreter, next_pow2, warps_for
from kernels_triton._launch import fast_launch

# One program per row walks V in blocks of up to MAX_BLOCK fp32 values (Liger: 32768, 1024 threads;
# fewer and rows take more loop steps, more and the registers spill). The interpreter runs every lane in
# numpy: small blocks there.
MAX_BLOCK = 32768
_INTERP_BLOCK = 1024
_ELEMS_PER_THREAD = 32  # 32768 values over 1024 threads: 32 warps of 32 (NVIDIA), 16 waves of 64 (AMD)


@fast_launch
@triton.jit
def _ce_rows_kernel(
    logits_ptr,  # [C, V] x's dtype; overwritten with d loss / d logits when GRAD
    target_ptr,  # [C] int64
    loss_ptr,  # [C] fp32 per-row losses
    scale_ptr,  # [1] fp32: d loss / d row loss (1 / rows not ignored for "mean", else 1)
    V,
    ignore_index,
    eps,  # label smoothing
    BLOCK: tl.constexpr,
    GRAD: tl.constexpr,
    SMOOTH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V  # int64: C x V passes 2^31 at Llama-3 shapes
    y = tl.load(target_ptr + row)
    ignored = y == ignore_index
    inside = (y >= 0) & (y < V)
    offs = tl.arange(0, BLOCK)
    # pass 1: online logsumexp (and the sum of logits for label smoothing), fp32
    m = -float("inf")
    s = 0.0
    zsum = 0.0
    for k in range(0, V, BLOCK):
        c = k + offs
        z = tl.load(base + c, mask=c < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # a block of only -inf (classes masked by a -inf bias) leaves m_new -inf: exp(-inf - -inf) was NaN
        m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_sub) + tl.sum(tl.exp(z - m_sub), axis=0)
        m = m_new
        if SMOOTH:
            zsum += tl.sum(tl.where(c < V, z, 0.0), axis=0)
    # lse = m + ls is never formed (rounded at |m| it would put ~u |m| into every loss and softmax value)
    ls = tl.log(s)
    zy = tl.load(base + y, mask=inside, other=0.0).to(tl.float32)
    loss = (1.0 - eps) * (m - zy) + ls
    if SMOOTH:
        loss += eps * (m - zsum / V)
    loss = tl.where(inside, loss, float("nan"))
    loss = tl.where(ignored, 0.0, loss)
    tl.store(loss_ptr + row, loss)
    if GRAD:
        # pass 2: d loss / d logits in place, in x's dtype
        sc = tl.load(scale_ptr)
        for k in range(0, V, BLOCK):
            c = k + offs
            z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            g = tl.exp((z - m) - ls)
            if SMOOTH:
                g -= eps / V
            g = tl.where(c == y, g - (1.0 - eps), g) * sc
            g = tl.where(inside, g, float("nan"))
            g = tl.where(ignored, 0.0, g)
            tl.store(base + c, g.to(logits_ptr.dtype.element_ty), mask=c < V)


def _block(V: int) -> int:
    return min(next_pow2(V), _INTERP_BLOCK if is_interpreter() else MAX_BLOCK)


def forward(
    loss: torch.Tensor,
    dx: torch.Tensor | None,
    dweight: torch.Tensor | None,
    dbias: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
) -> None:
    """loss ([1] for "mean"/"sum", [T] for "none", fp32) and, when dx is given, the loss's gradient dx [T, H],
    dweight [V, H], dbias [V] (x's dtype): the shared chunk loop (fused_forward) around _ce_rows_kernel."""
    V = weight.shape[0]
    block = _block(V)
    nw = warps_for(block, _ELEMS_PER_THREAD, device_index(x), hi=32)
    smooth = label_smoothing != 0.0

    def rows_kernel(logits, tc, rows, scale, grad: bool) -> None:
        _ce_rows_kernel[(logits.shape[0],)](
            logits,
            tc,
            rows,
            scale,
            V,
            ignore_index,
            label_smoothing,
            BLOCK=block,
            GRAD=grad,
            SMOOTH=smooth,
            num_warps=nw,
        )

    outs = (loss, dx, dweight, dbias)
    fused_forward(rows_kernel, *outs, x, weight, target, bias, ignore_index, reduction, label_smoothing)


_SCALE_BLOCK = 4096  # 16 KB of fp32 math per program: 8 bf16 per thread at 4 warps


@fast_launch
@triton.jit
def _scale_kernel(
    src_ptr,  # [n] a saved gradient (x's dtype)
    dst_ptr,  # [n] its output: src itself when scaling in place
    dloss_ptr,  # [1] the loss's gradient
    n,
    BLOCK: tl.constexpr,
    SKIP_ONE: tl.constexpr,  # dst is src: nothing to do when dloss == 1
):
    s = tl.load(dloss_ptr).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: d weight passes 2^31
    if SKIP_ONE:
        n = tl.where(s != 1.0, n, 0)  # all lanes masked off: they neither load nor store
    mask = offs < n
    v = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (v * s).to(dst_ptr.dtype.element_ty), mask=mask)


def backward(
    gx: torch.Tensor,
    gweight: torch.Tensor,
    gbias: torch.Tensor | None,
    dloss: torch.Tensor,
    dx: torch.Tensor,
    dweight: torch.Tensor,
    dbias: torch.Tensor | None,
    *scalars: object,
) -> None:
    """The saved gradients (dx, dweight, dbias) times dloss [1], into gx, gweight, gbias (which may be the
    saved tensors themselves: then a dloss of 1 costs one near-empty launch each); the shared multiply
    (ops/linear_cross_entropy.py scale_saved) for anything else (a dloss of another shape, float64,
    non-contiguous tensors)."""
    rest = []
    for out, saved in ((gx, dx), (gweight, dweight), (gbias, dbias)):
        if out is None:
            continue
        if (
            dloss.numel() != 1
            or saved.dtype == torch.float64  # fp64 math, as the multiply's own
            or not (saved.is_contiguous() and out.is_contiguous())
            or out.shape != saved.shape
        ):
            rest.append((out, saved))
        elif n := saved.numel():
            _scale_kernel[(triton.cdiv(n, _SCALE_BLOCK),)](
                saved,
                out,
                dloss,
                n,
                BLOCK=_SCALE_BLOCK,
                SKIP_ONE=out.data_ptr() == saved.data_ptr(),
                num_warps=4,
            )
    scale_saved(rest, dloss)


# ---- ahead-of-time coverage -------------------------------------------------------------------------------
def aot_specs() -> list[tuple[str, object, dict, dict]]:
    """The row kernel for each logits dtype, with and without the gradient pass and label smoothing, at the
    block every vocabulary >= 16385 takes (Llama-2/3, Mistral, Qwen2) and at a 4096 block (small vocabularies:
    the other blocks differ only in the loop bound). Warps on a 32-wide target; the JIT serves the rest."""
    specs: list[tuple[str, object, dict, dict]] = []
    for dt in ("fp32", "fp16", "bf16"):
        for block in (MAX_BLOCK, 4096):
            for grad in (True, False):
                for smooth in (False, True):
                    sig = {
                        "logits_ptr": f"*{dt}",
                        "target_ptr": "*i64",
                        "loss_ptr": "*fp32",
                        "scale_ptr": "*fp32",
                    }
                    sig |= {"V": "i32", "ignore_index": "i32", "eps": "fp32"}
                    sig |= {"BLOCK": "constexpr", "GRAD": "constexpr", "SMOOTH": "constexpr"}
                    nw = max(1, min(32, block // _ELEMS_PER_THREAD // 32))
                    ce = {"BLOCK": block, "GRAD": grad, "SMOOTH": smooth, "num_warps": nw}
                    name = f"lce_rows_{dt}_b{block}{'_grad' if grad else ''}{'_smooth' if smooth else ''}"
                    specs.append((name, _ce_rows_kernel, sig, ce))
        for skip in (True, False):
            sig = {"src_ptr": f"*{dt}", "dst_ptr": f"*{dt}", "dloss_ptr": "*fp32", "n": "i32"}
            sig |= {"BLOCK": "constexpr", "SKIP_ONE": "constexpr"}
            ce = {"BLOCK": _SCALE_BLOCK, "SKIP_ONE": skip, "num_warps": 4}
            specs.append((f"lce_scale_{dt}{'_inplace' if skip else ''}", _scale_kernel, sig, ce))
    return specs
