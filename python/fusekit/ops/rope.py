"""rope: rotary position embedding of x [B, S, H, D], angles in-kernel or from cos/sin tables."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusekit import library
from fusekit.ops import _checks as C
from fusekit.ops._spec import BACKWARD, FORWARD, OpSpec, Phase, Scalar, t

F64 = torch.float64


def tables(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos/sin [len(positions), D/2] of angle p * theta^(-2i/D), computed in `dtype` (fp32 as the kernels)."""
    i = torch.arange(head_dim // 2, device=positions.device, dtype=dtype)
    inv_freq = torch.exp(i * (-2.0 * math.log(theta) / head_dim))
    ang = positions.to(dtype)[:, None] * inv_freq[None, :]
    return torch.cos(ang), torch.sin(ang)


# --- reference (what the op means; the torch backend runs it) ---------------------------------------
def _rotate(
    x: Tensor,
    cos: Tensor | None,
    sin: Tensor | None,
    start_pos: int,
    theta: float,
    interleaved: bool,
    sign: float,
) -> Tensor:
    _, S, _, D = x.shape
    acc = F64 if x.dtype == F64 else torch.float32
    if cos is None or sin is None:
        cos, sin = tables(torch.arange(start_pos, start_pos + S, device=x.device), D, theta, acc)
    else:
        cos, sin = cos[start_pos : start_pos + S].to(acc), sin[start_pos : start_pos + S].to(acc)
    c, s = cos[None, :, None, :], sign * sin[None, :, None, :]
    xf = x.to(acc)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)
    a, b = xf[..., : D // 2], xf[..., D // 2 :]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


def reference_forward(x, cos, sin, start_pos: int, theta: float, interleaved: bool) -> tuple[Tensor]:
    """x [B, S, H, D] -> rotated x, same dtype.

    Pair (a, b) = (x[..., i], x[..., i + D/2]) (HF Llama halves) or (x[..., 2i], x[..., 2i+1])
    (`interleaved`) becomes (a cos - b sin, b cos + a sin) with angle (start_pos + s) * theta^(-2i/D)
    formed in fp32. Tables cos/sin [St, D/2] (St >= start_pos + S) are read at row start_pos + s.
    """
    return (_rotate(x, cos, sin, start_pos, theta, interleaved, 1.0),)


def reference_backward(dy, cos, sin, start_pos: int, theta: float, interleaved: bool) -> tuple[Tensor]:
    """dx = dy rotated by the negative angle (a rotation's transpose is its inverse)."""
    return (_rotate(dy, cos, sin, start_pos, theta, interleaved, -1.0),)


SPEC = library.register(
    OpSpec(
        name="rope",
        forward=Phase(
            outputs=(t("y", "B S H D"),),
            inputs=(
                t("x", "B S H D"),
                t("cos", "St Dh", "float32", "tables"),
                t("sin", "St Dh", "float32", "tables"),
            ),
            conditions=("tables",),
        ),
        backward=Phase(
            outputs=(t("dx", "B S H D"),),
            inputs=(
                t("dy", "B S H D"),
                t("cos", "St Dh", "float32", "tables"),
                t("sin", "St Dh", "float32", "tables"),
            ),
            conditions=("tables",),
        ),
        scalars=(
            Scalar("start_pos", int, lambda v: C.integer("start_pos", v)),
            Scalar("theta", float, lambda v: C.real("theta", v, positive=True)),
            Scalar("interleaved", bool, lambda v: C.flag("interleaved", v)),
        ),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in C.ANY_FLOAT),
        reference={FORWARD: reference_forward, BACKWARD: reference_backward},
        grad_inputs=("x",),
        save=lambda ins, outs: (ins["cos"], ins["sin"]),
        backward_inputs=lambda saved, g, cond: (g["y"], *saved),
        input_grads=lambda g, cond: (g["dx"], None, None),
    )
)


# --- public ------------------------------------------------------------------------------------------
def _check(x: object, start_pos: int, cos: object, sin: object) -> None:
    x = C.tensor("x", x, C.ANY_FLOAT, ndim=4)
    _, s, _, d = x.shape
    if d == 0 or d % 2:
        raise ValueError(f"x: head dim (last dimension) must be even and > 0, got {d}")
    if start_pos < 0:
        raise ValueError(f"start_pos: must be >= 0, got {start_pos}")
    if start_pos + s > C.MAX_POSITION:
        raise ValueError(
            f"start_pos: positions up to start_pos + S = {start_pos + s} exceed 2^24 = {C.MAX_POSITION}, "
            "beyond which float32 positions and angles are not exact"
        )
    if (cos is None) != (sin is None):
        raise ValueError("cos, sin: give both tables or neither")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab is None:
            continue
        tab = C.tensor(name, tab, C.ANY_FLOAT, ndim=2)
        C.same_device(name, tab, "x", x)
        if tab.shape[1] not in (d // 2, d) or tab.shape[0] < start_pos + s:
            raise ValueError(
                f"{name}: expected shape [>= start_pos + S = {start_pos + s}, D/2 = {d // 2}] (or [.., D = {d}] "
                f"as HF builds it), got {tuple(tab.shape)}"
            )


LAYOUTS = ("bshd", "bhsd")


def _half_table(name: str, tab: Tensor, d: int, interleaved: bool) -> Tensor:
    """A table [St, D/2] from one of [St, D/2] or HF's [St, D]: HF repeats each angle for both elements
    of its pair, cat(f, f) for half-split pairs and repeat_interleave(f, 2) for interleaved ones. Such a
    [St, D] table is checked for that repetition on the CPU (on CUDA it would cost a host sync: trusted)."""
    if tab.shape[1] == d // 2:
        return tab
    a, b = (tab[:, 0::2], tab[:, 1::2]) if interleaved else (tab[:, : d // 2], tab[:, d // 2 :])
    if tab.device.type == "cpu" and not torch.compiler.is_compiling() and not torch.equal(a, b):
        pairing = "repeat_interleave(f, 2)" if interleaved else "cat(f, f)"
        raise ValueError(
            f"{name}: a [St, D] table must repeat each angle for both elements of its pair ({pairing}, "
            f"interleaved={interleaved}); this one does not. Pass the [St, D/2] table instead"
        )
    return a


def rope(
    x: Tensor,
    *,
    start_pos: int = 0,
    theta: float = 10000.0,
    interleaved: bool = False,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    layout: str = "bshd",
    backend: str = "auto",
) -> Tensor:
    """Rotary position embedding of x [B, S, H, D] (D even), same dtype out.

    Pairs are the two halves of the head dim (HF Llama) or adjacent elements (`interleaved`), rotated
    by angle (start_pos + s) * theta^(-2i/D), computed in-kernel in fp32. Tables cos/sin [St, D/2]
    (St >= start_pos + S) replace the in-kernel angles; row start_pos + s is used. HF's [St, D] tables
    (each angle repeated for both elements of its pair: cat(f, f), or repeat_interleave(f, 2) with
    `interleaved`) are accepted too (checked on the CPU).

    layout: "bshd" (default, x is [B, S, H, D]) or "bhsd" (x is [B, H, S, D], as HF's attention holds q
    and k); the result has x's layout (a view; "bhsd" costs a transposing copy of x).

    start_pos: int, numpy integer or 0-d integer tensor, with start_pos + S <= 2^24 (float32 angles
    are not exact beyond). theta: positive, representable in float32. interleaved: a bool.
    backend: "auto" (default), "torch", "triton" or "mojo". Gradient: d x = d y rotated back.
    Errors: TypeError/ValueError naming `x`, `start_pos`, `theta`, `interleaved`, `cos`, `sin` or `layout`.
    """
    start_pos, theta, interleaved = (
        s.check(v) for s, v in zip(SPEC.scalars, (start_pos, theta, interleaved))
    )
    bhsd = C.choice("layout", layout, LAYOUTS) == "bhsd"
    x = C.tensor("x", x, C.ANY_FLOAT, ndim=4)
    if bhsd:
        x = x.transpose(1, 2)
    _check(x, start_pos, cos, sin)
    C.backend_name(backend)
    if cos is not None and sin is not None:
        d = x.shape[-1]
        cos = _half_table("cos", cos, d, interleaved).to(torch.float32).contiguous()
        sin = _half_table("sin", sin, d, interleaved).to(torch.float32).contiguous()
    (y,) = library.apply(SPEC, (x.contiguous(), cos, sin), (start_pos, theta, interleaved), backend)
    return y.transpose(1, 2) if bhsd else y
