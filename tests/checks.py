"""Shared checks for the test suites: one relative-error measure, one assertion with repro, an allocation
watcher."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def rel_error(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """‖out − ref‖ / max(‖ref‖, ‖scale‖) in float64 (1 when both are zero); NaN fails.

    ``scale`` is for results that may cancel: a sum of random terms can be near zero, and its
    rounding error is then tiny against the inputs but large against the result itself. Sums pass
    the 2-norm of the summed terms (``sum_scale``): dropping or repeating one term still moves the
    result by ~1/√n of that, far above any tolerance, while rounding stays ~u·√log n of it.
    """
    o, r = out.to(torch.float64), ref.to(torch.float64)
    assert not torch.isnan(o).any(), "output has unwritten (NaN) elements"
    denom = torch.linalg.vector_norm(r).item()
    if scale is not None:
        denom = max(denom, torch.linalg.vector_norm(scale.to(torch.float64)).item())
    return torch.linalg.vector_norm(o - r).item() / (denom if denom > 0 else 1.0)


def sum_scale(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The 2-norm of the terms behind each sum of ``x.sum(dim)``, in float64 (see ``rel_error``)."""
    sq = x.to(torch.float64).square()
    return (sq.sum() if dim is None else sq.sum(dim=dim)).sqrt()


def assert_close(
    name: str,
    out: torch.Tensor,
    ref: torch.Tensor,
    tol: float,
    repro: str,
    scale: torch.Tensor | None = None,
) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)} [{repro}]"
    if not out.dtype.is_floating_point:
        bad = (out.to(torch.int64) != ref).nonzero()
        assert bad.numel() == 0, (
            f"{name}: {len(bad)} integer mismatches, first at {bad[:3].tolist()} [{repro}]"
        )
        return
    o, r = out.to(torch.float64), ref.to(torch.float64)
    unwritten = torch.isnan(o) & ~torch.isnan(r)
    assert not unwritten.any(), (
        f"{name}: {int(unwritten.sum())} elements NaN (unwritten or overflow), first at "
        f"{unwritten.nonzero()[:3].tolist()} [{repro}]"
    )
    if r.numel() == 0:
        return
    o, r = _beyond_range(name, out.dtype, o, r, tol, repro)
    err = rel_error(o, r, scale)
    if not err <= tol:
        worst = (o - r).abs().flatten().argmax().item()
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {tol:.1e}; worst element {worst}: "
            f"{o.flatten()[worst].item()} vs {r.flatten()[worst].item()} [{repro}]"
        )


def _beyond_range(
    name: str, dtype: torch.dtype, o: torch.Tensor, r: torch.Tensor, tol: float, repro: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, r) without the elements whose exact value is at the edge of `dtype`'s range or past it (|r| >=
    (1 - tol) max finite): there the correct result is +-inf, or the largest finite values for a result
    within the tolerance of them, which a relative error cannot weigh (inf against a finite reference). Such
    elements must carry the reference's sign and be at least (1 - tol) max in magnitude (so a kernel that
    returns 0 or a small value there still fails). Found by fuzzing: an fp16 rms_norm backward with eps 0 and
    rows of 4e-5 has exact gradients of 7e4 > 65504, which round to inf."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return o, r
    edge = torch.finfo(dtype).max * (1 - tol)
    over = r.abs() >= edge
    if not over.any():
        return o, r
    ok = (o[over].abs() >= edge) & (torch.sign(o[over]) == torch.sign(r[over]))
    assert ok.all(), (
        f"{name}: {int((~ok).sum())} elements whose exact value is beyond the {dtype} range are neither "
        f"+-inf nor near the largest finite value with its sign, e.g. {o[over][~ok][:3].tolist()} vs "
        f"{r[over][~ok][:3].tolist()} [{repro}]"
    )
    keep = ~over
    return o[keep], r[keep]


# A tiny Llama config (transformers' LlamaConfig keywords; no download) shared by the HF-patch and
# distributed tests.
TINY_LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 RMSNorm of the rows of x: (y, rstd)."""
    xd = x.double()
    rstd = torch.rsqrt(xd.square().mean(-1) + eps)
    return xd * rstd[:, None] * w.double(), rstd


def layer_norm_ref(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 LayerNorm (biased variance) of the rows of x: (y, mean, rstd)."""
    xd = x.double()
    mean = xd.mean(-1)
    rstd = torch.rsqrt((xd - mean[:, None]).square().mean(-1) + eps)
    y = (xd - mean[:, None]) * rstd[:, None] * w.double()
    return (y + b.double() if b is not None else y), mean, rstd


def graphs_capturable() -> bool:
    """Whether CUDA-graph capture can run here: not under PYTORCH_NO_CUDA_MEMORY_CACHING=1 (the sanitizer
    runs set it so every tensor is its own cudaMalloc, and cudaMalloc is not permitted during capture)."""
    import os

    return os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0")


class Allocations(TorchDispatchMode):
    """Records the shape of every torch.empty made inside the block (a call's outputs: the torch backend's
    own math makes no empty tensors), whichever fusekit path allocates; with `fail_at` the fail_at-th one
    raises torch's OutOfMemoryError instead (a stand-in for a full GPU)."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.fail_at = fail_at

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.empty.memory_format:
            self.calls.append(tuple(args[0]))
            if len(self.calls) == self.fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return func(*args, **(kwargs or {}))
