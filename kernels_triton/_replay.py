"""Launch replay: a planned call's kernel launches, recorded once and then re-issued without the launcher.

A fusekit call of a planned signature (same op, phase, shapes, dtypes, strides, scalars, backend) runs
the same launcher Python every time: config lookup, grid, argument lists, the lean launch's key. For
the small, host-bound calls of a decode step that Python costs as much as the kernels. `record` runs
one call normally while watching it and, when the call was nothing but lean launches
(`_launch.fast_launch` cache hits) whose tensor arguments are the call's outputs, its inputs, views
of them, or workspaces it allocated, returns a generated `replay(outs, inputs)` that re-issues the
same compiled kernels with the new calls' data pointers (and fresh workspaces) and nothing else.

Besides lean launches, a recorded call may run `torch.mm(a, b, out=c)` (aten.mm.out: the vendor GEMM
swiglu_ffn's down projection picks where cuBLAS wins): it is replayed as the same torch.mm over views
rebuilt at the new call's pointers (same dtypes, sizes and strides, constants of the signature).

What makes a call unrecordable (it then simply keeps the normal path; `record` returns None):
- any aten op other than allocating (empty*), viewing a tensor or mm.out, seen by a TorchDispatchMode:
  a copy, a fill, a conversion, a host read (`.item()`): replay would skip that work;
- any launch that did not go through the lean path's cache (a compile, an autotuner, a kernel
  without `@fast_launch`), seen by wrapping `JITFunction.run` while recording;
- a tensor argument that is not (a view of) exactly one output, input or workspace of the call
  (a module-level cached tensor not marked `persistent`, or aliased inputs that make the mapping ambiguous), or an argument
  that is neither a tensor nor a plain int/float/bool/str/None (a host tensor descriptor).
`replay` checks that each pointer keeps its 16-byte alignment (Triton specializes on it) and
returns False, for the normal path, when one does not. Integer and float arguments are constants of
the signature (shapes, scalars), so they are replayed as recorded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels_triton import _launch

_aten = torch.ops.aten
_ALLOC = {  # fresh, uninitialized memory: a pure workspace the replay can allocate anew
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default, _aten.new_empty.default,
    _aten.new_empty_strided.default,
}  # fmt: skip
_CONSTANTS = (int, float, bool, str, type(None))  # argument types replayed as recorded
_VIEWS = {
    _aten.view.default, _aten._unsafe_view.default, _aten.as_strided.default, _aten.slice.Tensor,
    _aten.select.int, _aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.unsqueeze.default,
    _aten.squeeze.dim, _aten.squeeze.default, _aten.expand.default, _aten.alias.default, _aten.detach.default,
    _aten.split.Tensor, _aten.unbind.int, _aten.split_with_sizes.default, _aten.view_as_real.default,
    _aten.view.dtype,
}  # fmt: skip
_LOCK = threading.Lock()  # one recording at a time (it briefly wraps JITFunction.run for every thread)


class _MM:
    """Marks a recorded step as torch.mm(a, b, out=c) (its arguments: [a, b, c]) instead of a launch."""


class _Watch(TorchDispatchMode):
    """Lets allocations and views through (remembering allocated workspaces) and appends mm.out calls to
    the recording `steps` (in order with the launches); anything else is noted."""

    def __init__(self, steps: list) -> None:
        super().__init__()
        self.steps = steps
        self.temps: list[torch.Tensor] = []
        self.other: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ALLOC:
            self.temps.append(out)
        elif func is _aten.mm.out and len(args) == 2 and set(kwargs) == {"out"}:
            self.steps.append((_MM, [args[0], args[1], kwargs["out"]]))
        elif func not in _VIEWS:
            self.other.append(str(func))
        return out


def _tensor_at(base: torch.Tensor, off: int, dtype: torch.dtype, elsize: int, size: tuple, stride: tuple):
    """The view of `base`'s storage starting `off` bytes past base's first element, with the recorded
    dtype, sizes and strides (an mm step's operand at the new call's pointers)."""
    start = base.storage_offset() * base.element_size() + off
    return torch.empty((), dtype=dtype, device=base.device).set_(
        base.untyped_storage(), start // elsize, size, stride
    )


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that the view `t` can address."""
    lo = t.data_ptr()
    if t.numel() == 0:
        return lo, lo
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) + 1
    return lo, lo + span * t.element_size()


_PERSISTENT: dict[int, torch.Tensor] = {}  # id -> a tensor a launcher keeps for the whole process


def persistent(t: torch.Tensor) -> torch.Tensor:
    """Mark `t`, a tensor its launcher caches for the process and never writes (rope's inv_freq table), as
    a constant of any recording that passes it: replayed as that very tensor."""
    _PERSISTENT[id(t)] = t  # the reference keeps the id from being reused
    return t


def _slot(a: Any, bases: list[tuple[str, int, torch.Tensor, int, int]]) -> tuple | None:
    """How argument `a` is rebuilt: ("c", value) a constant (a plain value, or a `persistent` tensor),
    (kind, index, byte offset) a pointer into an output ("o"), input ("i") or workspace ("t"); None if a
    tensor matches no base or more than one. `bases`: (kind, index, tensor, first byte, one past the last
    byte), extents computed once."""
    if _PERSISTENT.get(id(a)) is a:
        return ("c", a)
    if not isinstance(a, torch.Tensor):
        # a plain value is a constant of the signature; anything else (a host-side tensor descriptor,
        # an object with data_ptr) may hold a pointer of this call: never replayed as recorded
        return ("c", a) if type(a) in _CONSTANTS else None
    # the very tensor object, if it fills exactly one slot: one object passed twice (attention(x, x, x),
    # rms_norm(x, w, residual=x)) would bake "slot 0's pointer" into both, and later calls of the signature
    # with distinct tensors would replay reading slot 0 for each
    same = [(kind, i, 0) for kind, i, b, _, _ in bases if a is b]
    if same:
        return same[0] if len(same) == 1 else None
    p = a.data_ptr()
    hits = []
    for kind, i, _, lo, hi in bases:
        if lo <= p < hi or p == lo:
            hits.append((kind, i, p - lo))
    return hits[0] if len(hits) == 1 else None


def _generate(
    launches: list[tuple[Callable, list]], bases: list[tuple[str, int, torch.Tensor, int, int]]
) -> Callable | None:
    """Source of `replay(o, i)` for the recorded launches, compiled with exec."""
    ns: dict[str, Any] = {
        "_empty": torch.empty, "_u8": torch.uint8, "_mm": torch.mm, "_at": _tensor_at, "_stream": _launch._stream,
    }  # fmt: skip
    lines = ["def replay(o, i):"]
    ptrs: dict[tuple[str, int], str] = {}  # base -> local holding its data_ptr()
    mm_ws: set[int] = set()  # workspaces an mm step reads or writes (allocated even without a launch)
    by_slot = {(kind, i): b for kind, i, b, _, _ in bases}
    checks: list[str] = []
    calls: list[str] = []
    inline: list[str] | None = []  # the launches as direct C launches, None when one cannot be
    streams: dict[int, str] = {}  # device index -> local holding its current raw stream
    for k, (runner, args) in enumerate(launches):
        if runner is _MM:
            parts = []
            for j, a in enumerate(args):
                s = _slot(a, bases)
                if s is None or s[0] == "c":
                    return None
                kind, idx, off = s
                base = f"w{idx}" if kind == "t" else f"{kind}[{idx}]"
                if kind == "t":
                    mm_ws.add(idx)
                if kind != "t" and off == 0 and a is by_slot[(kind, idx)]:
                    parts.append(base)  # the output or input itself: no view to build
                    continue
                ns[f"m{k}_{j}"] = (a.dtype, a.element_size(), tuple(a.shape), tuple(a.stride()))
                parts.append(f"_at({base}, {off}, *m{k}_{j})")
            calls.append(f"    _mm({parts[0]}, {parts[1]}, out={parts[2]})")
            if inline is not None:
                inline.append("    " + calls[-1])
            continue
        ns[f"r{k}"] = runner
        inl = getattr(runner, "inline", None)
        if inl is None:
            inline = None
        elif inline is not None:
            c_launch, gx, gy, gz, device, function, coop, pdl, metadata, unhooked = inl
            ns.update({f"l{k}": c_launch, f"x{k}": gx, f"y{k}": gy, f"z{k}": gz, f"f{k}": function,
                       f"q{k}": coop, f"e{k}": pdl, f"md{k}": metadata, "_unhooked": unhooked})  # fmt: skip
            stream = streams.setdefault(device, f"s{len(streams)}")
            ns[f"v{stream}"] = device
        parts = []
        for j, a in enumerate(args):
            s = _slot(a, bases)
            if s is None:
                return None
            if s[0] == "c":
                ns[f"c{k}_{j}"] = s[1]
                parts.append(f"c{k}_{j}")
                continue
            kind, idx, off = s
            name = ptrs.get((kind, idx))
            if name is None:
                name = ptrs[(kind, idx)] = f"p_{kind}{idx}"
            expr = f"({name} + {off})" if off else name
            if kind != "t":  # fresh workspaces are 512-byte aligned, as when recorded
                checks.append(f"(({expr}) & 15 == 0) is {bool(a.data_ptr() & 15 == 0)}")
            parts.append(expr)
        calls.append(f"    r{k}({', '.join(parts)})")
        if inline is not None:
            head = f"x{k}, y{k}, z{k}, {stream}, f{k}, q{k}, e{k}, None, None, md{k}, None, None, None"
            inline.append(f"        l{k}({head}, {', '.join(parts)})")
    if inline is not None:
        # While no launch hook is registered, Triton 3.6's compiled C launches themselves (what each
        # runner, _launch._direct's launch_raw, would call), one current-stream lookup per device;
        # otherwise the runners, which take Triton's hooked path.
        runners = ["    " + c for c in calls]
        calls = ["    if _unhooked():"]
        calls += [f"        {s} = _stream(v{s})" for s in streams.values()]
        calls += [*inline, "    else:", *runners]
    temps = {i: t for kind, i, t, _, _ in bases if kind == "t"}
    for idx in sorted(mm_ws | {idx for kind, idx in ptrs if kind == "t"}):
        t = temps[idx]
        ns[f"n{idx}"], ns[f"d{idx}"] = t.untyped_storage().nbytes(), t.device
        lines.append(f"    w{idx} = _empty(n{idx}, dtype=_u8, device=d{idx})")
    for (kind, idx), name in ptrs.items():
        src = f"w{idx}" if kind == "t" else f"{kind}[{idx}]"
        lines.append(f"    {name} = {src}.data_ptr()")
    if checks:
        lines.append(f"    if not ({' and '.join(sorted(set(checks)))}):")
        lines.append("        return False")
    lines += calls
    lines.append("    return True")
    src = "\n".join(lines)
    code = _CODE.get(src)
    if code is None:  # the source names constants, not their values: one compile per call structure
        if len(_CODE) >= 256:
            _CODE.clear()
        code = _CODE[src] = compile(src, "<fusekit launch replay>", "exec")
    exec(code, ns)  # our own generated source
    return ns["replay"]


_CODE: dict[str, Any] = {}  # replay source -> its compiled code (a grown KV cache re-records per length)


def record(call: Callable[[], None], outs: tuple, ins: tuple) -> Callable[[tuple, tuple], bool] | None:
    """Run `call()` (one launcher call writing `outs` from `ins`) and return its replay, or None when the
    call was not purely lean launches over those tensors (see the module doc). `call` always runs once."""
    nested = _launch.RECORDING.launches is not None  # a call inside a recorded call: part of the outer one
    if (
        nested
        or not _launch.ENABLED
        or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    ):
        call()
        return None
    from triton.runtime.jit import JITFunction

    with _LOCK:
        rec: list[tuple[Callable, list]] = []
        missed: list[bool] = []
        tls = _launch.RECORDING
        orig = JITFunction.run

        def run(self, *args, **kwargs):  # a launch outside the lean path's cache
            if tls.launches is not None:
                missed.append(True)
            return orig(self, *args, **kwargs)

        JITFunction.run = run
        tls.launches = rec
        watch = _Watch(rec)
        try:
            with watch:
                call()
        finally:
            tls.launches = None
            JITFunction.run = orig
    global last_refusal
    if watch.other:
        last_refusal = f"torch ops {sorted(set(watch.other))}"
    elif missed:
        last_refusal = "a launch outside the lean path's cache"
    elif not any(step[0] is not _MM for step in rec):
        last_refusal = "no launch"
    else:
        bases = [("o", i, t) for i, t in enumerate(outs) if t is not None]
        bases += [("i", i, t) for i, t in enumerate(ins) if isinstance(t, torch.Tensor)]
        bases += [("t", i, t) for i, t in enumerate(watch.temps)]
        replay = _generate(rec, [(kind, i, t, *_extent(t)) for kind, i, t in bases])
        last_refusal = (
            None if replay is not None else "a tensor argument that is no output, input or workspace"
        )
        return replay
    return None


last_refusal: str | None = None  # why the latest `record` returned None (diagnostics, tests)
