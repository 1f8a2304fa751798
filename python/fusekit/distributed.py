"""DTensor inputs: every public op but linear_cross_entropy (which refuses them, naming the argument) runs on
the local shards and wraps its outputs back as DTensors.

A public op checks its tensor arguments' types against `PLAIN` (one set lookup each, ~20 ns) and only
for anything else calls the handler here, which returns None when no argument is a DTensor (another
tensor subclass: the op goes on as usual). A DTensor never reaches `library.call_key`, a memo or a
provider: the handler calls the op again with `.to_local()` tensors. As Liger's RMSNorm, the compute
is local; unlike a `full_tensor()` gather it moves no data, so the placements must make the local call
mean the same as the global one. Per mesh dim:

- rms_norm / layer_norm: x (and residual, with x's placements) Replicate or Shard on any dim but the
  normalized last one; weight / bias Replicate DTensors. y, h and the stats keep x's placements.
- rope: x Replicate or Shard on the batch or head dim (not the sequence: positions would shift; not D).
  cos / sin: plain tensors or Replicate; positions [B, S] follow x's batch sharding.
- attention: q, k, v with the same placements, Replicate or Shard on the batch or head dim (heads
  split evenly: H and Hkv divisible by the shard count keeps the GQA group mapping local).
- swiglu_ffn: weights Replicate (x Replicate or Shard off its last dim), or the tensor-parallel layout
  of ColwiseParallel / RowwiseParallel (w_gate, w_up Shard(0), w_down Shard(1), norm_weight Replicate)
  with a replicated x, where each rank's output is a partial sum: all-reduced here. A plain x next to
  DTensor weights counts as replicated (as ColwiseParallel's input hook treats it) and gets a plain,
  all-reduced output back (fusekit.nn.SwiGLUMLP fuses only under the default Colwise / Rowwise styles,
  whose hooks do exactly that).
- reduce_sum: any placement; a sum over a sharded dim is all-reduced (fp32 partials for a 16-bit
  result, rounded once); a Partial sum / avg input stays Partial, a Partial max / min raises.

An AsyncCollectiveTensor (what a functional collective hands back: RowwiseParallel's output, or the
tensor-parallel swiglu_ffn's all-reduced plain output below) is waited for and passed on as a plain
tensor, its gradient flowing through (`_Wait`): a kernel must not read it before the collective is done,
and its wrapper has no storage for a launch to point at.

Anything else raises ValueError naming the argument and its placement, on every rank alike where a
shard would be empty (a rank raising alone would leave the others in the next collective). Gradients
flow through to_local / from_local; a Replicate input used by sharded work (a norm weight under a
batch-sharded x) gets a Partial gradient, which DTensor reduces when it is read, as its own ops do.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import Tensor, nn

# Argument types that need no check: anything else (DTensor, FakeTensor, ...) asks a handler here.
PLAIN = frozenset({Tensor, nn.Parameter, type(None)})


def _dtensor_cls() -> type | None:
    """DTensor, if torch.distributed.tensor is loaded (no DTensor can exist before it is)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return None if mod is None else mod.DTensor


def _mesh(named: dict[str, object]):
    """The device mesh the DTensors among `named` share, or None when there is no DTensor."""
    cls = _dtensor_cls()
    if cls is None:
        return None
    meshes = [(n, t.device_mesh) for n, t in named.items() if isinstance(t, cls)]
    if not meshes:
        return None
    first, mesh = meshes[0]
    for n, m in meshes[1:]:
        if m != mesh:
            raise ValueError(f"{n}: a DTensor on another device mesh than {first} ({m} vs {mesh})")
    return mesh


class _Wait(torch.autograd.Function):
    """An AsyncCollectiveTensor as the plain tensor it wraps, once its collective is done; the gradient
    passes through unchanged (its own `.wait()` returns the inner tensor outside the autograd graph)."""

    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:
        return t.trigger_wait()

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g


def waited(named: dict[str, object]) -> dict[str, object] | None:
    """`named` with each AsyncCollectiveTensor waited for (plain tensors), or None when it holds none."""
    mod = sys.modules.get("torch.distributed._functional_collectives")
    cls = None if mod is None else getattr(mod, "AsyncCollectiveTensor", None)
    if cls is None or not any(isinstance(t, cls) for t in named.values()):
        return None
    return {n: _Wait.apply(t) if isinstance(t, cls) else t for n, t in named.items()}


def _is_dt(t: object) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def _pl(p) -> str:
    return type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "()")


def _need_dt(name: str, t: object, other: str) -> None:
    if t is not None and not _is_dt(t):
        raise ValueError(
            f"{name}: a plain torch.Tensor next to DTensor {other}; pass a DTensor (e.g. "
            f"DTensor.from_local({name}, mesh, [Replicate()]), as torch's SequenceParallel does for norm weights)"
        )


def _replicated(name: str, t, sharded: list[bool]) -> list | None:
    """A DTensor that must be Replicate on every mesh dim: its gradient placements (Partial where the
    work is sharded on that mesh dim, so the per-rank contributions are summed), or None for None."""
    from torch.distributed.tensor import Partial, Replicate

    if t is None:
        return None
    for p in t.placements:
        if not p.is_replicate():
            raise ValueError(f"{name}: expected a Replicate DTensor, got placement {_pl(p)}")
    return [Partial() if s else Replicate() for s in sharded]


def _same(name: str, t, ref_name: str, ref) -> None:
    if t is not None and tuple(t.placements) != tuple(ref.placements):
        raise ValueError(
            f"{name}: placements {[_pl(p) for p in t.placements]} differ from {ref_name}'s "
            f"{[_pl(p) for p in ref.placements]}; the op runs on local shards and needs them alike"
        )


def _empty_shard(name: str, t, dim: int, what: str) -> None:
    """Raise on every rank alike (before any collective) where sharding t's `dim` leaves a rank an empty
    shard of it (torch's chunking: ceil(n / ways) per rank, the last ones empty when n is small): the
    op would raise on that rank only, and the others would wait in the next collective."""
    n, ways = int(t.shape[dim]), 1
    for p, size in zip(t.placements, t.device_mesh.shape):
        if p.is_shard() and p.dim % t.dim() == dim:
            ways *= size
    chunk = -(-n // ways)
    if ways > 1 and (ways - 1) * chunk >= n:
        raise ValueError(
            f"{name}: {what} ({n}) sharded {ways} ways leaves a rank an empty shard (torch gives each rank "
            f"ceil({n}/{ways}) = {chunk}); shard it fewer ways"
        )


def _stride(local: Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """The global stride of a DTensor of `shape` laid out as `local` (same dim order)."""
    order = sorted(range(local.dim()), key=lambda d: (local.stride(d), -d))  # innermost first
    stride, acc = [0] * local.dim(), 1
    for d in order:
        stride[d] = acc
        acc *= max(int(shape[d]), 1)
    return tuple(stride)


def _wrap(local: Tensor, mesh, placements, shape: Sequence[int]):
    from torch.distributed.tensor import DTensor

    shape = torch.Size(shape)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=_stride(local, shape)
    )


def _rows(name: str, x, allowed: set[int] | None = None, what: str = "") -> list[bool]:
    """Checks x's placements for a row-wise op (no Partial; Shard only off the last dim, or on the dims
    in `allowed`); returns per mesh dim whether x is sharded there."""
    n = x.dim()
    sharded = []
    for p in x.placements:
        if p.is_partial():
            raise ValueError(f"{name}: a Partial DTensor (pending sum) cannot be used; redistribute it first")
        if p.is_shard():
            d = p.dim % n if n else 0
            if (allowed is None and d == n - 1) or (allowed is not None and d not in allowed):
                raise ValueError(
                    f"{name}: placement {_pl(p)} shards {what or 'the normalized last dim'}; the op runs "
                    f"on local shards and needs {name} Replicate or sharded on "
                    + ("another dim" if allowed is None else f"dim(s) {sorted(allowed)}")
                )
        sharded.append(p.is_shard())
    return sharded


def _out(res, mesh, x, placements, n_like_x: int):
    """Wraps an op's result (a tensor or tuple): the first `n_like_x` like x, the rest x.shape[:-1]."""
    outs = res if isinstance(res, tuple) else (res,)
    shapes = [x.shape] * n_like_x + [x.shape[:-1]] * (len(outs) - n_like_x)
    wrapped = tuple(_wrap(o, mesh, placements, s) for o, s in zip(outs, shapes))
    return wrapped if isinstance(res, tuple) else wrapped[0]


# --- per-op handlers: None when no argument is a DTensor -------------------------------------------
def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None,
    casting: str,
    return_rstd: bool,
    backend: str,
) -> Tensor | tuple | None:
    named = {"x": x, "weight": weight, "residual": residual}
    mesh = _mesh(named)
    from fusekit.ops.rms_norm import rms_norm as op

    if mesh is None:
        if (w := waited(named)) is None:
            return None
        return op(w["x"], w["weight"], eps, residual=w["residual"], casting=casting, return_rstd=return_rstd,
                  backend=backend)  # fmt: skip

    _need_dt("x", x, "weight/residual")
    _need_dt("weight", weight, "x")
    _need_dt("residual", residual, "x")
    sharded = _rows("x", x)
    _same("residual", residual, "x", x)
    wg = _replicated("weight", weight, sharded)
    r = residual.to_local() if residual is not None else None
    res = op(
        x.to_local(),
        weight.to_local(grad_placements=wg),
        eps,
        residual=r,
        casting=casting,
        return_rstd=return_rstd,
        backend=backend,
    )
    return _out(res, mesh, x, x.placements, 2 if residual is not None else 1)


def layer_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    residual: Tensor | None,
    return_stats: bool,
    backend: str,
) -> Tensor | tuple | None:
    named = {"x": x, "weight": weight, "bias": bias, "residual": residual}
    mesh = _mesh(named)
    from fusekit.ops.layer_norm import layer_norm as op

    if mesh is None:
        if (w := waited(named)) is None:
            return None
        return op(w["x"], w["weight"], w["bias"], eps, residual=w["residual"], return_stats=return_stats,
                  backend=backend)  # fmt: skip

    _need_dt("x", x, "weight/bias/residual")
    for n, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        _need_dt(n, t, "x")
    sharded = _rows("x", x)
    _same("residual", residual, "x", x)
    wg, bg = _replicated("weight", weight, sharded), _replicated("bias", bias, sharded)
    res = op(
        x.to_local(),
        weight.to_local(grad_placements=wg),
        bias.to_local(grad_placements=bg) if bias is not None else None,
        eps,
        residual=residual.to_local() if residual is not None else None,
        return_stats=return_stats,
        backend=backend,
    )
    return _out(res, mesh, x, x.placements, 2 if residual is not None else 1)


def _aux(name: str, t, batch: list[bool]):
    """A non-differentiable helper input (tables, positions, kv_len) as a local tensor. `batch[i]`: x is
    sharded on its batch dim on mesh dim i, so a [B, ...] helper must be a DTensor sharded alike
    (Shard(0)); elsewhere it must be Replicate. A plain tensor passes as is where x is not batch-sharded."""
    if t is None:
        return None
    if not _is_dt(t):
        if any(batch):
            raise ValueError(f"{name}: x is sharded on its batch dim; pass {name} as a DTensor sharded alike")
        return t
    for p, b in zip(t.placements, batch):
        ok = (p.is_shard() and p.dim == 0) if b else p.is_replicate()
        if not ok:
            want = "Shard(0) (x is batch-sharded there)" if b else "Replicate"
            raise ValueError(f"{name}: placement {_pl(p)} where {want} is needed")
    return t.to_local()


def _batch(x, dim: int = 0) -> list[bool]:
    return [p.is_shard() and p.dim == dim for p in x.placements]


def rope(
    x: Tensor,
    k: Tensor | None,
    start_pos: object,
    theta: float,
    interleaved: bool,
    cos: Tensor | None,
    sin: Tensor | None,
    positions: Tensor | None,
    layout: str,
    backend: str,
) -> Tensor | tuple[Tensor, Tensor] | None:
    named = {"x": x, "k": k, "cos": cos, "sin": sin, "positions": positions}
    mesh = _mesh(named)
    from fusekit.ops.rope import rope as op

    if mesh is None:
        if (w := waited(named)) is None:
            return None
        return op(w["x"], w["k"], start_pos=start_pos, theta=theta, interleaved=interleaved, cos=w["cos"],
                  sin=w["sin"], positions=w["positions"], layout=layout, backend=backend)  # fmt: skip

    _need_dt("x", x, "k/cos/sin/positions")
    _need_dt("k", k, "x")
    heads = 2 if layout == "bshd" else 1
    _rows("x", x, {0, heads}, "the sequence or head dim D (positions / pairs would change)")
    if k is not None:
        _rows("k", k, {0, heads}, "the sequence or head dim D (positions / pairs would change)")
        if _batch(k) != _batch(x):
            raise ValueError("k: must be sharded on the batch dim exactly where x is (the same positions)")
        _empty_shard("k", k, heads, "its head count Hk")
    none = [False] * mesh.ndim
    pos_batch = _batch(x) if positions is not None and positions.dim() == 2 else none
    out = op(
        x.to_local(),
        None if k is None else k.to_local(),
        start_pos=start_pos,
        theta=theta,
        interleaved=interleaved,
        cos=_aux("cos", cos, none),
        sin=_aux("sin", sin, none),
        positions=_aux("positions", positions, pos_batch),
        layout=layout,
        backend=backend,
    )
    if k is None:
        return _wrap(out, mesh, x.placements, x.shape)
    return _wrap(out[0], mesh, x.placements, x.shape), _wrap(out[1], mesh, k.placements, k.shape)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float | None,
    kv_len: Tensor | None,
    layout: str,
    backend: str,
) -> Tensor | None:
    named = {"q": q, "k": k, "v": v, "kv_len": kv_len}
    mesh = _mesh(named)
    from fusekit.ops.attention import attention as op

    if mesh is None:
        if (w := waited(named)) is None:
            return None
        return op(w["q"], w["k"], w["v"], causal=causal, scale=scale, kv_len=w["kv_len"], layout=layout,
                  backend=backend)  # fmt: skip

    for n, t in (("q", q), ("k", k), ("v", v)):
        _need_dt(n, t, "q/k/v")
    heads = 1 if layout == "bhsd" else 2
    _rows("q", q, {0, heads}, "the sequence or head dim D")
    _same("k", k, "q", q)
    _same("v", v, "q", q)
    split = 1
    for p, size in zip(q.placements, mesh.shape):
        split *= size if p.is_shard() and p.dim == heads else 1
    h, hkv = q.shape[heads], k.shape[heads]
    if h % split or hkv % split:
        raise ValueError(
            f"q: heads sharded {split} ways need H={h} and Hkv={hkv} divisible by {split} "
            "(even head shards keep each q head with its kv head)"
        )
    o = op(
        q.to_local(),
        k.to_local(),
        v.to_local(),
        causal=causal,
        scale=scale,
        kv_len=_aux("kv_len", kv_len, _batch(q)),
        layout=layout,
        backend=backend,
    )
    return _wrap(o, mesh, q.placements, q.shape)


def swiglu_ffn(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    backend: str,
) -> Tensor | None:
    named = {"x": x, "w_gate": w_gate, "w_up": w_up, "w_down": w_down, "norm_weight": norm_weight}
    mesh = _mesh(named)
    from fusekit.ops.swiglu_ffn import swiglu_ffn as op

    if mesh is None:
        if (w := waited(named)) is None:
            return None
        return op(w["x"], w["w_gate"], w["w_up"], w["w_down"], norm_weight=w["norm_weight"], eps=eps,
                  backend=backend)  # fmt: skip
    from torch.distributed.tensor import Partial, Replicate

    for n in ("w_gate", "w_up", "w_down", "norm_weight"):
        _need_dt(n, named[n], "x" if _is_dt(x) else "weights")
    plain_x = not _is_dt(x)
    xp = [Replicate()] * mesh.ndim if plain_x else list(x.placements)
    ws = (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))
    grads: dict[str, list] = {n: [] for n in ("x", "w_gate", "w_up", "w_down", "norm_weight")}
    out_pl, partial = [], []
    for i, p in enumerate(xp):
        wp = [t.placements[i] for _, t in ws]
        nwp = norm_weight.placements[i] if norm_weight is not None else Replicate()
        tp = wp[0].is_shard(0) and wp[1].is_shard(0) and wp[2].is_shard(1)
        if tp and not nwp.is_replicate():
            raise ValueError(
                f"norm_weight: placement {_pl(nwp)} on mesh dim {i}; beside tensor-parallel weights it must "
                "be Replicate"
            )
        if tp:  # ColwiseParallel gate/up, RowwiseParallel down: each rank sums over its F slice
            _empty_shard("w_gate", w_gate, 0, "the hidden dim F")
            if not p.is_replicate():
                raise ValueError(
                    f"x: placement {_pl(p)} with tensor-parallel weights (mesh dim {i}); x must be replicated"
                )
            grads["x"].append(Partial())
            for n, q in zip(("w_gate", "w_up", "w_down"), wp):
                grads[n].append(q)
            grads["norm_weight"].append(Partial())
            out_pl.append(Partial())
            partial.append(True)
            continue
        for (n, _), q in zip((*ws, ("norm_weight", None)), (*wp, nwp)):
            if not q.is_replicate():
                raise ValueError(
                    f"{n}: placement {_pl(q)} on mesh dim {i}; swiglu_ffn takes Replicate weights or the "
                    "tensor-parallel layout w_gate/w_up Shard(0), w_down Shard(1), norm_weight Replicate"
                )
        if p.is_partial() or (p.is_shard() and p.dim % x.dim() == x.dim() - 1):
            raise ValueError(f"x: placement {_pl(p)}; expected Replicate or Shard off the last (hidden) dim")
        g = Partial() if p.is_shard() else Replicate()
        for n in ("w_gate", "w_up", "w_down", "norm_weight"):
            grads[n].append(g)
        grads["x"].append(p)
        out_pl.append(p)
        partial.append(False)
    if plain_x:
        from torch.distributed.tensor import DTensor

        x = DTensor.from_local(x, mesh, xp, run_check=False)
    named["x"] = x
    loc = {n: None if t is None else t.to_local(grad_placements=grads[n]) for n, t in named.items()}
    y = op(
        loc["x"],
        loc["w_gate"],
        loc["w_up"],
        loc["w_down"],
        norm_weight=loc["norm_weight"],
        eps=eps,
        backend=backend,
    )
    out = _wrap(y, mesh, out_pl, x.shape)
    if any(partial):  # the tensor-parallel sum over F: one all-reduce
        out = out.redistribute(mesh, [Replicate() if s else p for p, s in zip(out_pl, partial)])
    return out.to_local() if plain_x else out


def reduce_sum(x: Tensor, dim: int | None, dtype: torch.dtype | None, backend: str) -> Tensor | None:
    mesh = _mesh({"x": x})
    from fusekit.ops.reduce_sum import reduce_sum as op

    if mesh is None:
        if (w := waited({"x": x})) is None:
            return None
        return op(w["x"], dim, dtype=dtype, backend=backend)
    from torch.distributed.tensor import Partial, Replicate, Shard

    n = x.dim()
    d = None if dim is None or n == 0 else dim % n
    out_pl, reduce = [], []
    for p in x.placements:
        if p.is_shard() and (d is None or p.dim % n == d):
            out_pl.append(Partial())  # each rank summed its shard: the total is their sum
            reduce.append(True)
            continue
        if p.is_partial() and getattr(p, "reduce_op", "sum") not in ("sum", "avg"):
            raise ValueError(
                f"x: placement Partial({p.reduce_op!r}); a sum of per-rank {p.reduce_op}s is not their "
                "sum: redistribute x to Replicate first"
            )
        if p.is_shard():
            out_pl.append(Shard(p.dim - (p.dim > d)))
        else:
            out_pl.append(p)  # Replicate, or a Partial sum / avg input (the sum is linear: still pending)
        reduce.append(False)
    # a 16-bit sum over ranks: each rank's partial and the all-reduce in fp32, rounded once (as one process)
    half = (dtype or x.dtype) in (torch.float16, torch.bfloat16) and any(reduce)
    y = op(x.to_local(), dim, dtype=torch.float32 if half else dtype, backend=backend)
    shape = () if d is None else tuple(s for i, s in enumerate(x.shape) if i != d)
    out = _wrap(y, mesh, out_pl, shape)
    if any(reduce):
        out = out.redistribute(mesh, [Replicate() if r else p for p, r in zip(out_pl, reduce)])
    return out.to(dtype or x.dtype) if half else out


def linear_cross_entropy(named: dict[str, object]) -> dict[str, object] | None:
    """DTensor arguments are refused, naming one: the loss reduces over every token and the whole
    vocabulary (a vocabulary-parallel weight or a sequence-sharded x would each need collectives inside
    the row kernel's max and sum), which this op does not do. AsyncCollectiveTensors are waited for:
    `named` with plain tensors, or None when there is nothing to wait for."""
    for n, t in named.items():
        if _is_dt(t):
            raise ValueError(
                f"{n}: a DTensor (placements {[_pl(p) for p in t.placements]}); linear_cross_entropy runs on "
                "plain tensors only: pass .full_tensor(), or the local shards for a loss of the local rows"
            )
    return waited(named)
