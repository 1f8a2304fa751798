"""rope: rotary position embedding of x [B, S, H, D], angles in-kernel or from cos/sin tables."""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from fusekit import distributed, library
from fusekit.distributed import PLAIN
from fusekit.ops import _checks as C
from fusekit.ops._spec import BACKWARD, FORWARD, OpSpec, Phase, Scalar, t

F64 = torch.float64


def inv_freq(
    head_dim: int, theta: float, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> Tensor:
    """theta^(-2i/D) for i < D/2, computed in float64 and rounded once to `dtype`. Every backend's angle is
    dtype(position) * this, one rounding: the same inv_freq bits everywhere, so the backends agree at any
    position up to their cos / sin's ulps (an inv_freq rounded differently per backend moves the angle by
    position x its error: 0.013 apart at position 131072, 1.6 at 2^24)."""
    theta = struct.unpack("f", struct.pack("f", theta))[0]  # as fp32, as the mojo kernels receive it
    i = torch.arange(head_dim // 2, dtype=F64, device=device)
    return torch.exp(i * (-2.0 * math.log(theta) / head_dim)).to(dtype)


def tables(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos/sin [len(positions), D/2] of angle p * inv_freq (`inv_freq`), computed in `dtype` (fp32 as the
    kernels)."""
    ang = positions.to(dtype)[:, None] * inv_freq(head_dim, theta, dtype, positions.device)[None, :]
    return torch.cos(ang), torch.sin(ang)


# --- reference (what the op means; the torch backend runs it) ---------------------------------------
def _token_positions(x: Tensor, positions: Tensor | None, start_pos: int, rows: int | None) -> Tensor:
    """int64 [B, S] positions of the tokens, clamped to [0, rows - 1] (tables) or [0, 2^24] as every
    kernel clamps them. Both forms build the same [B, S] layout, so positions = start_pos + arange(S)
    computes exactly what start_pos does (the vectorized cos/sin see the same elements)."""
    b, s = x.shape[0], x.shape[1]
    if positions is None:
        pos = torch.arange(start_pos, start_pos + s, device=x.device)
    else:
        pos = positions.to(device=x.device, dtype=torch.int64)
    hi = C.MAX_POSITION if rows is None else max(rows - 1, 0)
    return pos.expand(b, s).clamp(0, hi)


def _rotate(
    x: Tensor | None,
    cos: Tensor | None,
    sin: Tensor | None,
    positions: Tensor | None,
    start_pos: int,
    theta: float,
    interleaved: bool,
    sign: float,
) -> Tensor | None:
    if x is None:
        return None
    B, S, _, D = x.shape
    acc = F64 if x.dtype == F64 else torch.float32
    if cos is None or sin is None:
        pos = _token_positions(x, positions, start_pos, None)
        cos, sin = (t.view(B, S, D // 2) for t in tables(pos.reshape(-1), D, theta, acc))
    else:
        pos = _token_positions(x, positions, start_pos, min(cos.shape[0], sin.shape[0]))
        cos, sin = cos.to(acc)[pos], sin.to(acc)[pos]  # [B, S, D/2]
    c, s = cos[:, :, None, :], sign * sin[:, :, None, :]
    xf = x.to(acc)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)
    a, b = xf[..., : D // 2], xf[..., D // 2 :]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


def reference_forward(
    x, cos, sin, positions, k, start_pos, theta, interleaved
) -> tuple[Tensor, Tensor | None]:
    """x [B, S, H, D] (and k [B, S, Hk, D], or None) -> (x rotated, k rotated or None), same dtype.

    Pair (a, b) = (x[..., i], x[..., i + D/2]) (HF Llama halves) or (x[..., 2i], x[..., 2i+1])
    (`interleaved`) becomes (a cos - b sin, b cos + a sin) with angle p * theta^(-2i/D) formed in fp32,
    where token (b, s) sits at p = start_pos + s, or p = positions[b, s] (int [B, S]; then start_pos is
    0). Tables cos/sin [St, D/2] are read at row p instead. Positions are clamped to [0, St - 1] (tables)
    or [0, 2^24], as the kernels clamp untrusted values. k (HF's apply_rotary_pos_emb(q, k, ...)) is
    rotated exactly as x, at the same positions.
    """
    args = (cos, sin, positions, start_pos, theta, interleaved, 1.0)
    return _rotate(x, *args), _rotate(k, *args)


def reference_backward(
    dy, cos, sin, positions, dyk, start_pos, theta, interleaved
) -> tuple[Tensor, Tensor | None]:
    """dx (and dk) = dy (and dyk) rotated by the negative angle at the same positions (a rotation's
    transpose is its inverse)."""
    args = (cos, sin, positions, start_pos, theta, interleaved, -1.0)
    return _rotate(dy, *args), _rotate(dyk, *args)


SPEC = library.register(
    OpSpec(
        name="rope",
        forward=Phase(
            outputs=(t("y", "B S H D"), t("yk", "B S Hk D", when="k")),
            inputs=(  # x and k may be views (a fused qkv projection's heads, a [B, H, S, D] tensor)
                t("x", "B S H D", strided=True),
                t("cos", "St Dh", "float32", "tables"),
                t("sin", "St Dh", "float32", "tables"),
                t("positions", "B S", "int32", "positions"),
                t("k", "B S Hk D", when="k", strided=True),
            ),
            conditions=("tables", "positions"),
        ),
        backward=Phase(
            outputs=(t("dx", "B S H D"), t("dk", "B S Hk D", when="k")),
            inputs=(
                t("dy", "B S H D"),
                t("cos", "St Dh", "float32", "tables"),
                t("sin", "St Dh", "float32", "tables"),
                t("positions", "B S", "int32", "positions"),
                t("dyk", "B S Hk D", when="k"),
            ),
            conditions=("tables", "positions", "k"),
        ),
        scalars=(
            Scalar("start_pos", int, lambda v: C.integer("start_pos", v)),
            Scalar("theta", float, lambda v: C.real("theta", v, positive=True)),
            Scalar("interleaved", bool, lambda v: C.flag("interleaved", v)),
        ),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in C.ANY_FLOAT),
        reference={FORWARD: reference_forward, BACKWARD: reference_backward},
        grad_inputs=("x", "k"),
        save=lambda ins, outs: (ins["cos"], ins["sin"], ins["positions"]),
        backward_inputs=lambda saved, g, cond: (g["y"], *saved, g["yk"] if cond["k"] else None),
        # positions: integers, no gradient
        input_grads=lambda g, cond: (g["dx"], None, None, None, g["dk"] if cond["k"] else None),
        meta=lambda ins, scalars: {"positions": ins["positions"] is not None},
    )
)


# --- public ------------------------------------------------------------------------------------------
def _check(x: object, start_pos: int, cos: object, sin: object, positions: bool) -> None:
    x = C.tensor("x", x, C.ANY_FLOAT, ndim=4)
    b, s, _, d = x.shape
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
    # With `positions` the rows read are only known from the values (checked by _positions on the CPU).
    # (the message is formatted only when raised: formatting S on every call pinned a dynamic S under
    # torch.compile / export to a constant)
    need = min(1, b * s) if positions else start_pos + s
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab is None:
            continue
        tab = C.tensor(name, tab, C.ANY_FLOAT, ndim=2)
        C.same_device(name, tab, "x", x)
        if tab.shape[1] not in (d // 2, d) or tab.shape[0] < need:
            what = "1" if positions else f"start_pos + S = {start_pos + s}"
            raise ValueError(
                f"{name}: expected shape [>= {what}, D/2 = {d // 2}] (or [.., D = {d}] as HF builds it), "
                f"got {tuple(tab.shape)}"
            )
    if positions and cos is not None and cos.shape[0] != sin.shape[0]:
        raise ValueError(
            f"cos: with positions, cos and sin must have the same number of rows St (positions are "
            f"clamped to [0, St - 1]), got {cos.shape[0]} and {sin.shape[0]}"
        )


def _positions(positions: object, x: Tensor, start_pos: int, rows: int | None) -> Tensor | None:
    """positions as contiguous int32 [B, S] on x's device ([S] and [1, S] are broadcast over B).

    Values must lie in [0, 2^24] (in-kernel angles) or [0, St) (tables with St = `rows`): checked on the
    CPU; on CUDA they are trusted (checking would be a host sync per call) and every backend clamps them
    into that range, so a bad position can never read outside the tables. (int64 values are converted
    to int32 first; on CUDA one outside int32 wraps, and is then clamped.)"""
    if positions is None:
        return None
    positions = C.tensor("positions", positions, C.INT_DTYPES)
    C.same_device("positions", positions, "x", x)
    b, s = x.shape[0], x.shape[1]
    if tuple(positions.shape) not in ((b, s), (s,), (1, s)):
        raise ValueError(
            f"positions: expected shape [B={b}, S={s}], [1, S={s}] or [S={s}], got {tuple(positions.shape)}"
        )
    if start_pos != 0:
        raise ValueError(
            f"positions: per-token positions and a nonzero start_pos (= {start_pos}) exclude each other; "
            "add start_pos to positions instead"
        )
    hi = C.MAX_POSITION if rows is None else rows - 1
    what = "every value must be in [0, " + (
        "2^24] (in-kernel angles)" if rows is None else "St - 1] (tables)"
    )
    ok = lambda: (positions >= 0) & (positions <= hi)
    if C.values_on_cpu("positions", positions, ok, what) and positions.numel():
        lo, top = (int(v) for v in torch.aminmax(positions))
        if lo < 0 or top > hi:
            bound = "2^24 (in-kernel angles)" if rows is None else f"St - 1 = {hi} (the tables' last row)"
            raise ValueError(f"positions: every value must be in [0, {bound}], got values in [{lo}, {top}]")
    if positions.dtype != torch.int32:
        positions = positions.to(torch.int32)  # int32 callers skip this conversion (one small kernel)
    return positions.expand(b, s).contiguous()  # [B, S] callers: no copy


LAYOUTS = ("bshd", "bhsd")
_MEMO = library.memo()  # validated calls (see library.call_key)


def _half_table(name: str, tab: Tensor, d: int, interleaved: bool) -> Tensor:
    """A table [St, D/2] from one of [St, D/2] or HF's [St, D]: HF repeats each angle for both elements
    of its pair, cat(f, f) for half-split pairs and repeat_interleave(f, 2) for interleaved ones. Such a
    [St, D] table is checked for that repetition on the CPU (on CUDA it would cost a host sync: trusted)."""
    if tab.shape[1] == d // 2:
        return tab
    a, b = (tab[:, 0::2], tab[:, 1::2]) if interleaved else (tab[:, : d // 2], tab[:, d // 2 :])
    pairing = "repeat_interleave(f, 2)" if interleaved else "cat(f, f)"
    why = (
        f"a [St, D] table must repeat each angle for both elements of its pair ({pairing}, "
        f"interleaved={interleaved}); this one does not. Pass the [St, D/2] table instead"
    )
    if C.values_on_cpu(name, tab, lambda: a == b, why) and not torch.equal(a, b):
        raise ValueError(f"{name}: {why}")
    return a


def _check_k(k: object, x: Tensor, bhsd: bool) -> Tensor:
    """k beside x ([B, S, H, D] after the layout's transpose): [B, S, Hk, D] in the same terms (x's B, S, D
    and dtype, any head count), on x's device."""
    k = C.tensor("k", k, C.ANY_FLOAT, ndim=4)
    if bhsd:
        k = k.transpose(1, 2)
    C.same_device("k", k, "x", x)
    if k.dtype != x.dtype:
        raise ValueError(f"k: dtype {C.names((k.dtype,))} differs from x's {C.names((x.dtype,))}")
    b, s, _, d = x.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d) or k.shape[2] == 0:
        raise ValueError(
            f"k: expected [B={b}, S={s}, Hk >= 1, D={d}] (x's batch, sequence and head dim), got {tuple(k.shape)}"
        )
    return k


def rope(
    x: Tensor,
    k: Tensor | None = None,
    *,
    start_pos: int = 0,
    theta: float = 10000.0,
    interleaved: bool = False,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    positions: Tensor | None = None,
    layout: str = "bshd",
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Rotary position embedding of x [B, S, H, D] (D even), same dtype out; with `k`, of x and k in one
    launch: `q, k = rope(q, k, ...)` as HF's apply_rotary_pos_emb(q, k, cos, sin) and Liger's
    liger_rotary_pos_emb (k [B, S, Hk, D]: x's batch, sequence, head dim and dtype, any head count, the
    same positions). Returns y, or (y, k rotated) when k is given.

    Pairs are the two halves of the head dim (HF Llama) or adjacent elements (`interleaved`), rotated
    by angle p * theta^(-2i/D), computed in-kernel in fp32, where token s sits at p = start_pos + s.
    Tables cos/sin [St, D/2] (St >= start_pos + S) replace the in-kernel angles; row p is used. HF's
    [St, D] tables (each angle repeated for both elements of its pair: cat(f, f), or
    repeat_interleave(f, 2) with `interleaved`) are accepted too (checked on the CPU).

    positions: per-token positions instead of start_pos (HF's `position_ids`; left-padded batches; a
    CUDA-graph decode loop, whose device tensor can be updated in place between replays where an int
    start_pos would be baked into the graph): an int32 or int64 tensor [B, S] (or [S] or [1, S], HF's
    position_ids of an unpadded batch: the same for every sequence) on x's device; token (b, s) sits at
    p = positions[b, s]. Not with a nonzero start_pos. Values must lie in [0, 2^24] (in-kernel angles)
    or [0, St) (tables; then cos and sin have the same St): checked on the CPU (ValueError); on CUDA they
    are trusted (no host sync) and clamped into that range, so a bad value can never read outside the tables. Positions carry no
    gradient; int32 [B, S] is passed as is, other forms cost one small conversion kernel.

    layout: "bshd" (default, x is [B, S, H, D]) or "bhsd" (x is [B, H, S, D], as HF's attention holds q
    and k); the result has x's layout (a view of a dense [B, S, H, D]). x and k may be strided views
    (each head's D contiguous: the heads of a fused qkv projection, a "bhsd" tensor): the triton kernel
    reads them in place, other backends get contiguous copies. positions are [B, S] in both layouts.

    start_pos: int, numpy integer or 0-d integer tensor, with start_pos + S <= 2^24 (float32 angles
    are not exact beyond). theta: positive, representable in float32. interleaved: a bool.
    backend: "auto" (default), "torch", "triton" or "mojo". Gradient: d x = d y rotated back, at the
    same positions (and d k likewise).
    Errors: TypeError/ValueError naming `x`, `k`, `start_pos`, `theta`, `interleaved`, `cos`, `sin`,
    `positions` or `layout`.
    """
    if (
        type(x) not in PLAIN
        or type(k) not in PLAIN
        or type(cos) not in PLAIN
        or type(sin) not in PLAIN
        or type(positions) not in PLAIN
    ) and (
        out := distributed.rope(x, k, start_pos, theta, interleaved, cos, sin, positions, layout, backend)
    ) is not None:
        return out  # DTensor inputs: local compute on the shards (fusekit.distributed)
    key = library.call_key((x, cos, sin, positions, k), (start_pos, theta, interleaved, layout), backend)
    if key is not None and x.device.type == "cpu" and (cos is not None or positions is not None):
        key = None  # table and position values are checked on the CPU: no memo
    run = _MEMO.get(key) if key is not None else None
    if run is None:  # the checked path (first call of a signature, grad, compile)
        start_pos, theta, interleaved = (
            s.check(v) for s, v in zip(SPEC.scalars, (start_pos, theta, interleaved))
        )
        bhsd = C.choice("layout", layout, LAYOUTS) == "bhsd"
        x = C.tensor("x", x, C.ANY_FLOAT, ndim=4)
        if bhsd:
            x = x.transpose(1, 2)
        _check(x, start_pos, cos, sin, positions is not None)
        if k is not None:
            k = _check_k(k, x, bhsd)
        positions = _positions(positions, x, start_pos, None if cos is None else cos.shape[0])
        C.backend_name(backend)
    else:  # as _positions makes them: contiguous int32 [B, S]
        bhsd = layout == "bhsd"
        if bhsd:
            x = x.transpose(1, 2)
            if k is not None:
                k = k.transpose(1, 2)
        if positions is not None:
            p = positions if positions.dtype == torch.int32 else positions.to(torch.int32)
            positions = p.expand(x.shape[0], x.shape[1]).contiguous()
    if cos is not None and sin is not None:
        d = x.shape[-1]
        cos = _half_table("cos", cos, d, interleaved).to(torch.float32).contiguous()
        sin = _half_table("sin", sin, d, interleaved).to(torch.float32).contiguous()
    ins = (x, cos, sin, positions, k)  # views as they are: the library copies them where a provider needs
    scalars = (start_pos, theta, interleaved)
    if k is not None and x.numel() == 0 and k.numel():
        # x has no heads (H = 0; B, S and D are k's, and k has Hk >= 1): a call whose first input is
        # empty launches nothing and zeroes every output (library.plan), which would return k rotated
        # as zeros. x and k go as two calls instead (never memoized: the key is this call's)
        y = library.apply_memo(_MEMO, None, SPEC, (*ins[:4], None), scalars, backend)[0]
        yk = library.apply_memo(_MEMO, None, SPEC, (ins[4], *ins[1:4], None), scalars, backend)[0]
    elif run is not None:
        y, yk = run(ins)
    else:
        y, yk = library.apply_memo(_MEMO, key, SPEC, ins, scalars, backend)
    if bhsd:
        y, yk = y.transpose(1, 2), None if yk is None else yk.transpose(1, 2)
    return y if k is None else (y, yk)
