"""Triton 3.6's compiled C launch called directly; host tensor descriptors encoded once per address.

`CudaLauncher.__call__` (Triton 3.6) allocates global and profile scratch (two closures per launch, also for
kernels that need none) and then calls its `launch`. For a kernel without scratch, `raw_launcher` hands back
that `launch`, which the lean launch path (_launch._direct) calls with the same 13 leading arguments.

For kernels with descriptor arguments that `launch` is `wrap_handle_tensordesc`'s `inner`: on every launch it
walks all arguments and turns each host TensorDescriptor into a CUtensorMap through `make_tensordesc_arg`
(Python, then `fill_tma_descriptor`: cuTensorMapEncodeTiled). The Hopper attention forward passes 4
descriptors and its backward 11, re-encoding maps whose inputs (base address, shape, strides, box, swizzle,
dtype) repeat from one training step to the next: the caching allocator hands a layer the same addresses.
`raw_launcher` recognises that wrapper (the names it closes over, the globals it uses) and returns with the C
launch a function that builds the same argument list, each encoded map remembered under everything
`make_tensordesc_arg` reads: the descriptor's metadata, its base's data pointer, shape, strides and padding.
A map holds nothing else, so a hit is the map Triton would build (another tensor at the same address with the
same shape and strides gets an identical map). Any other launcher (a newer Triton's, a kernel with scratch)
gets None: the caller keeps Triton's path. FUSEKIT_TRITON_RAW_LAUNCH=0 turns this off (_launch.RAW).

H200, B1 H32/8 S2048 D128 bf16 causal, one lease, on / off: host time of a fwd+bwd pair in a training loop
510 / 696 us, of the backward 305 / 586 us (benchmarks/results/nvidia-h200/attention-host.json).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from kernels_triton._config import remember

_BASE_LEN = 13  # Triton 3.6 _BASE_ARGS_FORMAT "iiiKKppOOOOOO": grid x3, stream, function, 2 flags, 6 objects
_MAPS: dict[tuple, list] = {}
_MAPS_CAP = 4096  # encoded maps: 15 per attention layer's forward + backward, a 128-layer model's worth


def raw_launcher(launcher: Any) -> tuple[Callable[..., None], Callable[[tuple], list] | None] | None:
    """(the raw C launch, None or - for kernels with descriptor arguments - a function kernel args -> the raw
    launch's kernel args with descriptors encoded through the memo) for a Triton 3.6 CudaLauncher without
    scratch memory; None for any other launcher (the caller launches through it as usual).

    The raw launch takes (grid x, y, z, stream, function, cooperative, pdl, global scratch, profile scratch,
    packed metadata, launch metadata, enter hook, exit hook, *kernel args), as CudaLauncher.__call__ passes."""
    call = type(launcher).__dict__.get("__call__")  # the class's own, not an inherited slot wrapper
    code = getattr(call, "__code__", None)
    mod = sys.modules.get(type(launcher).__module__)
    if (
        type(launcher).__name__ != "CudaLauncher"
        or code is None
        or code.co_argcount != 6  # 3.6: (self, gridX, gridY, gridZ, stream, function, *args)
        or getattr(mod, "_BASE_ARGS_FORMAT_LEN", None) != _BASE_LEN
        or getattr(launcher, "global_scratch_size", 1) != 0
        or getattr(launcher, "profile_scratch_size", 1) != 0
        or not hasattr(launcher, "launch_cooperative_grid")
        or not hasattr(launcher, "launch_pdl")
    ):
        return None
    inner = getattr(launcher, "launch", None)
    if inner is None:
        return None
    if not hasattr(inner, "__code__"):  # no descriptor arguments: `launch` is the C function itself
        return inner, None
    return _with_descriptors(inner)


def _with_descriptors(inner: Any) -> tuple[Callable[..., None], Callable[[tuple], list]] | None:
    code, cells = inner.__code__, getattr(inner, "__closure__", None)
    if cells is None:
        return None
    free = dict(zip(code.co_freevars, cells))
    g = getattr(inner, "__globals__", {})
    mk = g.get("make_tensordesc_arg")
    if (
        not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= free.keys()
        or g.get("_BASE_ARGS_FORMAT_LEN") != _BASE_LEN
        or mk is None
        or len(inspect.signature(mk).parameters) != 2
    ):
        return None
    raw = free["launcher"].cell_contents
    indices = sorted(free["tensordesc_indices"].cell_contents)
    metas = free["tensordesc_meta"].cell_contents
    if len(metas) != len(indices):
        return None
    # per descriptor: (position among the kernel args, its metadata, the metadata as a hashable key)
    slots = tuple((i, m, None if m is None else repr(sorted(m.items()))) for i, m in zip(indices, metas))

    def expand(args: tuple) -> list:
        out: list = []
        prev = 0
        for i, m, mkey in slots:
            out.extend(args[prev:i])
            d = args[i]
            if mkey is None:  # no metadata: Triton passes the descriptor's fields, nothing to encode
                out.extend(mk(d, m))
            else:
                key = (mkey, d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding)
                enc = _MAPS.get(key)
                if enc is None:
                    enc = remember(_MAPS, key, mk(d, m), _MAPS_CAP)
                out.extend(enc)
            prev = i + 1
        out.extend(args[prev:])
        return out

    return raw, expand


def clear() -> None:
    """Forget the encoded maps (tests)."""
    _MAPS.clear()
