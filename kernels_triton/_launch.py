"""A lean launch path for the small, host-bound kernels (norms, rope, decode attention).

`fn[grid](*args, **kw)` goes through `JITFunction.run`: it binds the arguments, computes a
specialization key for every one of them (`native_specialize_impl`), looks the kernel up and builds the
launch metadata, ~15-20 us of Python per launch on the H200's host (a bare launch measured 20 us wall,
benchmarks/results/nvidia-h200/host.json), as much as the kernels themselves at decode shapes.

`@fast_launch` (on top of `@triton.jit`) keeps `fn[grid](...)` as the call syntax but, when enabled,
remembers the compiled kernel per (kernel, grid, device, options, per-argument key) after a normal first
launch and then launches it through `CompiledKernel[grid](*bound_args)` (Triton's own launcher entry,
which handles the stream, launch metadata and hooks as `JITFunction.run` does). The per-argument key is
everything Triton specializes on: a tensor's dtype and 16-byte alignment of its data pointer; a
constexpr's value; a runtime int's specialization class only (== 1, divisible by 16, and its 32/64-bit
range: the classes Triton's `native_specialize_impl` tells apart), so a decode kernel whose KV length
and strides grow by one token per step keeps the lean path instead of paying the JIT path on every new
value; a bool's value; a float's type only (floats are runtime values, never specialized).

On by default; FUSEKIT_TRITON_FAST_LAUNCH=0 (or `ENABLED = False`) sends every launch through
`JITFunction.run`. Under Triton 3.6 the remembered launch calls the compiled C launch itself and keeps host
descriptors' encoded maps (_raw_launch; FUSEKIT_TRITON_RAW_LAUNCH=0: through CudaLauncher as before).
tests/test_triton_fast_launch.py checks on CUDA that both paths give bit-identical results. Under the CPU
interpreter `triton.jit` returns an InterpretedFunction, which is left as it is.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from kernels_triton._config import is_hip
from kernels_triton._raw_launch import clear as raw_clear
from kernels_triton._raw_launch import raw_launcher

ENABLED = os.environ.get("FUSEKIT_TRITON_FAST_LAUNCH", "1") not in ("", "0")
# Triton 3.6's C launch called directly, descriptors' maps remembered (_raw_launch); "0": CudaLauncher's path
RAW = os.environ.get("FUSEKIT_TRITON_RAW_LAUNCH", "1") not in ("", "0")
_MAX_ENTRIES = 4096  # (kernel, grid, args key) entries; a model needs a few dozen
_CACHE: dict[tuple, tuple[Callable[..., None], tuple]] = {}
_ORDERS: dict[tuple, tuple] = {}  # (kernel, positional count, kwarg names) -> binding order
_FAST_TYPES: dict[type, type] = {}
_FAST_SET: set[type] = set()  # the classes fast_launch gives jit functions


class _Recording(threading.local):
    launches: list | None = None  # kernels_triton._replay.record's list while it watches this thread


RECORDING = _Recording()


# On AMD Triton also specializes a tensor whose storage is < 2 GiB ("S": buffer loads with 32-bit offsets);
# a kernel compiled for a small tensor must not run on a larger one of the same dtype (offsets wrap to 0).
HIP_STORAGE_KEY = is_hip()
_2GIB = 2**31


def _arg_key(v: Any) -> Any:
    """A constexpr (or launch option): its value; a tensor: dtype, 16-byte alignment (and on AMD whether its
    storage is under 2 GiB)."""
    if isinstance(v, torch.Tensor):
        if HIP_STORAGE_KEY:
            return (v.dtype, v.data_ptr() & 15 == 0, v.untyped_storage().size() < _2GIB)
        return (v.dtype, v.data_ptr() & 15 == 0)
    if v is None or type(v) is int or type(v) is bool:
        return v
    if type(v) is float:  # the common scalar, keyed before the descriptor probe below (every lean launch)
        return float
    if hasattr(v, "block_shape") and hasattr(v, "base"):  # a host tensor descriptor: its whole type counts
        return (
            type(v),
            v.base.dtype,
            tuple(v.block_shape),
            repr(getattr(v, "layout", None)),
            getattr(v, "padding", None),
        )
    return type(v)


def _int_range(v: int) -> int:
    """Triton's int argument types: 0 i32, 1 i64, 2 u64."""
    return 0 if -(2**31) <= v < 2**31 else 2 if v >= 2**63 else 1


def int_class(v: int) -> tuple[bool, bool, int]:
    """How Triton specializes a runtime int argument: (== 1, % 16 == 0, range), not its value; what a
    `launch_keyed` key must hold for each int argument."""
    return (v == 1, v % 16 == 0, _int_range(v))


def _specialized_key(v: Any) -> Any:
    """A runtime argument Triton specializes: an int by its class (`int_class`), not by its value."""
    if type(v) is int:
        return int_class(v)
    return _arg_key(v)


def _unspecialized_key(v: Any) -> Any:
    """A `do_not_specialize` argument: only its type (and an int's 32/64-bit range) picks the kernel."""
    if type(v) is int:
        return _int_range(v)
    return _arg_key(v)


def _param_keyer(p) -> Callable[[Any], Any]:
    if getattr(p, "is_constexpr", True):
        return _arg_key  # compiled in: its value picks the kernel
    return _unspecialized_key if getattr(p, "do_not_specialize", False) else _specialized_key


_KEYERS: dict[Any, tuple] = {}  # kernel -> per-parameter key function
_KW_KEYERS: dict[Any, dict] = {}  # kernel -> {parameter name: key function}


def _keyers(fn) -> tuple:
    k = _KEYERS.get(fn)
    if k is None:
        k = _KEYERS[fn] = tuple(_param_keyer(p) for p in fn.params)
        _KW_KEYERS[fn] = {p.name: f for p, f in zip(fn.params, k)}
    return k


def _binding(fn, n_pos: int, kw_names: tuple) -> tuple:
    """Where each parameter of `fn` comes from: ("a", i) a positional argument, ("k", name) a keyword,
    ("d", value) the parameter's default."""
    order = []
    for i, p in enumerate(fn.params):
        if i < n_pos:
            order.append(("a", i))
        elif p.name in kw_names:
            order.append(("k", p.name))
        else:
            order.append(("d", p.default))
    return tuple(order)


def _bound(order: tuple, args: tuple, kwargs: dict) -> list:
    return [args[s] if k == "a" else kwargs[s] if k == "k" else s for k, s in order]


def launch(fn, grid: tuple, args: tuple, kwargs: dict) -> tuple | None:
    """`fn[grid](*args, **kwargs)`, through the remembered compiled kernel where one matches. Returns the
    remembered (runner, binding order), None where the launch could not be remembered."""
    keyers = _keyers(fn)
    kw_keyers = _KW_KEYERS[fn]
    key = (
        fn,
        grid,
        torch.cuda.current_device(),
        tuple([f(a) for f, a in zip(keyers, args)]),
        tuple([(k, kw_keyers.get(k, _arg_key)(v)) for k, v in kwargs.items()]),
    )
    hit = _CACHE.get(key)
    if hit is not None:
        runner, order = hit
        bound = _bound(order, args, kwargs)
        runner(*bound)
        rec = RECORDING.launches
        if rec is not None:  # kernels_triton._replay is watching this thread's call
            rec.append((runner, bound))
        return hit
    kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)  # the normal path: compiles, launches
    if kernel is None or not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
        return None
    okey = (fn, len(args), tuple(kwargs))
    order = _ORDERS.get(okey)
    if order is None:
        names = {p.name for p in fn.params}
        if any(k not in names for k in kwargs if k not in _OPTIONS):
            return None  # a keyword Triton would reject or treat specially: never remember
        order = _ORDERS[okey] = _binding(fn, len(args), tuple(k for k in kwargs if k in names))
    if len(_CACHE) >= _MAX_ENTRIES:
        _CACHE.clear()
    hit = _CACHE[key] = (_direct(kernel, (*grid, 1, 1)[:3], key[2]), order)
    return hit


# The current raw stream of a device, as Triton's driver asks torch for it (absent from CPU-only builds).
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _direct(kernel: Any, g3: tuple, device: int) -> Callable[..., None]:
    """A launcher of `kernel` at grid `g3` on `device` (the current device when it was remembered, part of
    the cache key): what `CompiledKernel[g3](*args)` does, minus its per-call Python. That runner asks the
    driver for the device and stream, builds launch metadata and passes Triton's launch hooks, which since
    Triton 3.6 are HookChain objects even when empty, so the C launcher also calls two empty chains: ~3 us
    of its 8.3 us per launch on the H100's host (.dev probe at dc925c5). While no hook is registered this
    calls the compiled launcher with no metadata and no hooks, exactly what the runner does when the hooks
    are unset; with a hook (a profiler such as proton) it takes Triton's runner, which runs it."""
    from triton import knobs

    try:
        from triton.knobs import HookChain as chain
    except ImportError:  # a Triton whose hooks are plain callables or None
        chain = None
    runner = kernel[g3]  # Triton's own runner; also loads the module and function handles
    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    gx, gy, gz = g3
    rt = knobs.runtime

    def unhooked() -> bool:
        e, x = rt.launch_enter_hook, rt.launch_exit_hook
        return (e is None or (type(e) is chain and not e.calls)) and (
            x is None or (type(x) is chain and not x.calls)
        )

    raw = raw_launcher(run) if RAW else None
    if raw is not None:  # Triton 3.6, no scratch: its C launch directly (_raw_launch), descriptors memoized
        c_launch, expand = raw
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl

        def launch_raw(*args: Any) -> None:
            if unhooked():
                c_launch(gx, gy, gz, _stream(device), function, coop, pdl, None, None, metadata, None, None, None,
                         *(args if expand is None else expand(args)))  # fmt: skip
            else:
                runner(*args)

        if expand is None:  # what kernels_triton._replay inlines into a generated replay (one frame less)
            launch_raw.inline = (c_launch, gx, gy, gz, device, function, coop, pdl, metadata, unhooked)
        return launch_raw

    def launch_direct(*args: Any) -> None:
        if unhooked():
            run(gx, gy, gz, _stream(device), function, metadata, None, None, None, *args)
        else:
            runner(*args)

    return launch_direct


_KEYED: dict[tuple, tuple[Callable[..., None], tuple]] = {}


def launch_keyed(fn, key: tuple | None, grid: tuple, args: tuple, kwargs: dict) -> None:
    """`fn[grid](*args, **kwargs)` for a `@fast_launch` kernel, remembered under the caller's `key` instead of
    one computed from every argument (`launch` spends ~25 Python calls a launch on it).

    For launchers that know which of their arguments change between calls and how Triton specializes those:
    decode attention, whose KV length and strides grow every token. `key` must determine the kernel, the
    grid, the device and every specialization Triton makes on the arguments (dtypes, 16-byte pointer
    alignment, each int's class: == 1, divisible by 16, 32/64-bit range; the constexprs and options). None
    (a call the caller cannot summarize): `fn[grid](...)` as usual."""
    if key is not None and ENABLED and type(fn) in _FAST_SET:
        hit = _KEYED.get(key)
        if hit is None:
            hit = launch(fn, grid, args, kwargs)
            if hit is not None:
                if len(_KEYED) >= _MAX_ENTRIES:
                    _KEYED.clear()
                _KEYED[key] = hit
            return None
        runner, order = hit
        bound = _bound(order, args, kwargs)
        runner(*bound)
        rec = RECORDING.launches
        if rec is not None:
            rec.append((runner, bound))
        return None
    fn[grid](*args, **kwargs)
    return None


# Launch options JITFunction.run takes as keywords that are not kernel parameters.
_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl"})


def fast_launch(fn):
    """Decorator over @triton.jit: `fn[grid](...)` takes the lean path when ENABLED (see the module doc)."""
    base = type(fn)
    if not hasattr(fn, "params") or not hasattr(base, "run"):
        return fn  # the CPU interpreter's InterpretedFunction: unchanged
    fast = _FAST_TYPES.get(base)
    if fast is None:

        def getitem(self, grid):
            if not ENABLED or callable(grid):
                return base.__getitem__(self, grid)  # Triton's own path, unchanged
            return lambda *args, **kwargs: launch(self, grid, args, kwargs)

        fast = _FAST_TYPES[base] = type(f"Fast{base.__name__}", (base,), {"__getitem__": getitem})
        _FAST_SET.add(fast)
    fn.__class__ = fast
    return fn


# ------------------------------------------------------------------------------------- autotuned kernels
# `Autotuner.run` builds its key, looks the config up and then calls `JITFunction.run`: the slow path on
# every call. `@fast_tuned` (on top of `triton.autotune(...)`) lets the autotuner choose once per
# (arguments' keys, with its key arguments by value) and from then on launches the chosen config through
# `launch` above; a kernel under one `triton.heuristics` layer gets its heuristic values computed per call
# from the arguments and the chosen config, as Heuristics.run does. Kept on Triton's path: configs or
# autotuners with hooks (reset_to_zero, restore_value, pre_hook: they must run around every launch).
_TUNED: dict[tuple, dict | None] = {}  # key -> the chosen config's kwargs, or None: always Triton's path
_TUNER_KEYERS: dict[Any, tuple[tuple, dict, Any, Any]] = {}
_TUNE_LOCK = threading.Lock()


def _jit_of(tuner) -> tuple[Any, Any]:
    """(the JITFunction an autotuner launches, the `triton.heuristics` layer over it or None)."""
    from triton.runtime.autotuner import Heuristics

    fn = tuner.fn
    return (fn.fn, fn) if isinstance(fn, Heuristics) else (fn, None)


def _tuner_keyers(tuner) -> tuple[tuple, dict, Any, Any]:
    """(per-argument key functions, the same by name, the JITFunction, its heuristics layer or None),
    decided once per autotuner."""
    k = _TUNER_KEYERS.get(tuner)
    if k is None:
        (fn, heur), by_value = _jit_of(tuner), set(tuner.keys)
        pos = tuple(_arg_key if p.name in by_value else f for p, f in zip(fn.params, _keyers(fn)))
        k = _TUNER_KEYERS[tuner] = (pos, {p.name: f for p, f in zip(fn.params, pos)}, fn, heur)
    return k


def _plain(tuner) -> bool:
    """The autotuner wraps a plain JITFunction (directly, or under one `triton.heuristics` layer, whose
    values launch_tuned computes as Heuristics.run does) and has no hooks that must run around each launch."""
    from triton.runtime.jit import JITFunction  # not InterpretedFunction (the CPU interpreter)

    if getattr(tuner, "fn", None) is None:
        return False
    return (
        isinstance(_jit_of(tuner)[0], JITFunction)
        and not getattr(tuner, "reset_to_zero", None)
        and not getattr(tuner, "restore_value", None)
        and not getattr(tuner, "user_defined_pre_hook", False)
        and not getattr(tuner, "user_defined_post_hook", False)
    )


def launch_tuned(tuner, grid, args: tuple, kwargs: dict) -> None:
    """`tuner[grid](*args, **kwargs)`; the chosen config launched through `launch` once it is known."""
    pos, named, jit, heur = _tuner_keyers(tuner)
    key = (
        tuner,
        torch.cuda.current_device(),
        tuple([f(a) for f, a in zip(pos, args)]),
        tuple([(k, named.get(k, _arg_key)(v)) for k, v in kwargs.items()]),
    )
    cfg = _TUNED.get(key, False)
    if cfg is None:
        return tuner.run(*args, grid=grid, warmup=False, **kwargs)  # Triton's own path
    if cfg is False:
        with _TUNE_LOCK:  # best_config is the autotuner's state: read it right after this thread's run
            tuner.run(*args, grid=grid, warmup=False, **kwargs)
            best = getattr(tuner, "best_config", None)
            names = {p.name for p in jit.params} | _LEAN_CONFIG
            ok = best is not None and best.pre_hook is None and all(k in names for k in best.all_kwargs())
            _TUNED[key] = best.all_kwargs() if ok else None
        return None
    kw = {**kwargs, **cfg}
    if heur is not None:  # as Heuristics.run: each value from the arguments and the config
        by_name = dict(zip(heur.arg_names, args))
        for v, f in heur.values.items():
            kw[v] = f({**by_name, **kw})
    if callable(grid):
        grid = grid({**dict(zip(tuner.arg_names, args)), **kw})
    launch(jit, grid, args, kw)
    return None


_LEAN_CONFIG = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})  # options a config may set


def fast_tuned(tuner):
    """Decorator over triton.autotune(...)(jit fn): `tuner[grid](...)` takes `launch_tuned` when ENABLED."""
    if not _plain(tuner):
        return tuner  # heuristics, hooks, or the CPU interpreter's function: Triton's path, unchanged
    base = type(tuner)
    fast = _FAST_TYPES.get(base)
    if fast is None:

        def getitem(self, grid):
            if not ENABLED:
                return base.__getitem__(self, grid)
            return lambda *args, **kwargs: launch_tuned(self, grid, args, kwargs)

        fast = _FAST_TYPES[base] = type(f"Fast{base.__name__}", (base,), {"__getitem__": getitem})
    tuner.__class__ = fast
    return tuner


def clear() -> None:
    """Forget the remembered kernels (tests)."""
    _CACHE.clear()
    _KEYED.clear()
    _ORDERS.clear()
    _KEYERS.clear()
    _KW_KEYERS.clear()
    _TUNED.clear()
    _TUNER_KEYERS.clear()
    raw_clear()
