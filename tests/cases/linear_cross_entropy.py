"""linear_cross_entropy cases: (lead dims, H, V) with odd token counts (1, 9, 37) and vocabularies
(1000, 1031) that cut the tokens into several chunks, ignore_index rows, all rows ignored, label
smoothing, bias or not, every reduction. reduction="none" records no gradient (the op raises), so those
cases are forward only."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cases import randn, round_as

F64 = torch.float64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD = DTYPES
# The loss is fp32 math on logits rounded to x's dtype (HF's F.linear(...).float()): x's dtype bounds
# its accuracy, so the forward check uses the case dtype's tolerance (as the gradients do).
OUT_TOL_FROM_INPUT = True


def _case(lead, h, v, reduction="mean", *, bias=False, ignore=False, ls=0.0, **kw) -> dict:
    case = {"lead": lead, "H": h, "V": v, "reduction": reduction, "bias": bias, "ignore": ignore, "ls": ls}
    case.update(kw)
    if reduction == "none":
        case["grad"] = False
    return case


CPU = [
    _case((9,), 64, 1000),
    _case((37,), 96, 1031, "sum", bias=True, ignore=True, ls=0.1),
    _case((1,), 64, 1000),
    _case((37,), 64, 1000, bias=True, ignore=True, ls=0.2),
    _case((2, 5), 64, 1031, "none", ignore=True),
    _case((37,), 96, 1000, "none", bias=True, ls=0.1),
    _case((9,), 64, 1031, "sum", all_ignored=True),
    _case((9,), 64, 1000, "none", bias=True, all_ignored=True),
    _case((0,), 64, 1000, "sum", bias=True),
    _case((37,), 64, 1000, ignore=True, ignore_index=5),  # a real class id as ignore_index
    _case((37,), 64, 64, "sum", bias=True),  # V <= H: one chunk
]
CUDA = [
    _case((4096,), 4096, 32000, ignore=True),
    # 2 x 300 tokens: the float64 oracle's [T, V] logits and their gradient stay < 1 GB each (at 2 x 1000 a
    # worker held 37 GB and a neighbour of the 3-worker GPU run went out of memory)
    _case((2, 300), 2048, 128256, "sum", bias=True, ignore=True, ls=0.1),
    _case((511,), 4096, 128256, ignore=True),
    _case((300,), 1024, 151936, "none"),
]


def make(case: dict, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    h, v = case["H"], case["V"]
    x = randn(*case["lead"], h, dtype=dtype, device=device)
    # an LM head's scale (std 1/sqrt(H)) times 2: logits O(1), a softmax that is not flat
    w = randn(v, h, dtype=dtype, device=device, scale=2 * h**-0.5)
    target = torch.randint(0, v, case["lead"], device=device)
    ii = case.get("ignore_index", -100)
    if case["ignore"]:
        target.view(-1)[::4] = ii
    if case.get("all_ignored"):
        target.fill_(ii)
    kwargs = {"reduction": case["reduction"], "label_smoothing": case["ls"]}
    if "ignore_index" in case:
        kwargs["ignore_index"] = ii
    if case["bias"]:
        kwargs["bias"] = randn(v, dtype=dtype, device=device, scale=0.5)
    return (x, w, target), kwargs


def oracle(x, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """torch's cross_entropy, in float64, of the logits rounded to x's dtype as the op defines them (HF's
    F.linear(x, weight, bias).float()). Unrounded, the fp16 loss of one row with logits ~4 (x and weight
    broadcast along H: a coherent sum) was 2.7e-3 off against 2e-3 (FUSEKIT_FUZZ_SEED=6 x20): that
    rounding moves the loss by ~u |z|, relative to a loss that may be far smaller than |z|."""
    z = F.linear(x.to(F64), weight.to(F64), None if bias is None else bias.to(F64))
    z = round_as(z, x)
    out = F.cross_entropy(
        z.reshape(-1, weight.shape[0]),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return (out.reshape(target.shape) if reduction == "none" else out,)


def grad_magnitude(args: tuple, kwargs: dict) -> float:
    """The gradients are O(1/V)-per-element softmax terms (smaller still under "mean"): the floor on
    the reference's norm only keeps exactly-zero gradients (all rows ignored) from dividing by zero."""
    return 1e-3


def grad_scale(args: tuple, kwargs: dict, grads: tuple) -> tuple:
    """Per gradient (dx, dweight[, dbias]): the size of the terms dx is summed from (dweight, dbias: None,
    the floor).

    dx_t = g_t / n * sum_v W[v] (p_tv - q_tv) (q: the target distribution, label smoothing included; n: the
    valid rows under "mean"). Where the terms cancel - W's rows alike (the fuzzer's weight broadcast along
    H), p peaked on the target - dx is far smaller than they are, and any evaluation that is not float64
    rounds at their size, ~u sqrt(V) |g_t| / n sum_v |W[v]| (p_tv + q_tv), whatever dx's own size (fuzz,
    FUSEKIT_FUZZ_SEED=16 x20: one fp32 token, V 13243, equal weight columns, dx -0.0020 off by 3e-6 on the
    torch backend, 1.5e-3 relative). That magnitude (float64) is what dx's error is measured against where
    it is larger."""
    x, w, target = args[:3]
    bias = kwargs.get("bias")
    rest = (None,) + ((None,) if bias is not None else ())
    reduction = kwargs.get("reduction", "mean")
    if reduction == "none" or x.numel() == 0:
        return (None, *rest)
    v, h = w.shape
    ii = kwargs.get("ignore_index", -100)
    ls = kwargs.get("label_smoothing", 0.0)
    with torch.no_grad():
        wd = w.detach().to(F64)
        z = x.detach().to(F64).reshape(-1, h) @ wd.T
        if bias is not None:
            z = z + bias.detach().to(F64)
        p = torch.softmax(z, -1)
        t = target.reshape(-1)
        valid = t != ii
        q = torch.full_like(p, ls / v)
        rows = valid.nonzero().flatten()
        q[rows, t[rows]] += 1 - ls
        mag = (p + q) @ wd.abs()
        mag[~valid] = 0
        n = max(int(valid.sum()), 1) if reduction == "mean" else 1
        mag = mag * grads[0].detach().to(F64).abs() / n
    return (mag.reshape(x.shape), *rest)
