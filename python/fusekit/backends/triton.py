"""The `triton` backend: runs `kernels_triton/<op>.py`'s `forward` / `backward` for any op from its spec.

On a CUDA/ROCm device the kernels are compiled by Triton; on the CPU they run in Triton's interpreter,
which must be switched on (TRITON_INTERPRET=1) before triton is first imported. The interpreter is not
thread-safe (concurrent calls raise InterpreterError or return wrong values), so its launches are
serialised with one lock; compiled launches run concurrently.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from types import ModuleType

import torch

from fusekit.backends.base import Backend

# The interpreter's own bf16 tl.dot is wrong (TRITON_FACTS.md): kernels_triton._interpreter corrects it; on a
# Triton where that cannot be installed these ops refuse bf16 on the CPU rather than return garbage.
_DOT_OPS = ("swiglu_ffn", "attention")
HEAD_DIMS = (64, 128, 256)
_INTERPRETER_LOCK = threading.RLock()
# Launch replay of planned calls (kernels_triton/_replay.py); FUSEKIT_TRITON_REPLAY=0 turns it off.
REPLAY = os.environ.get("FUSEKIT_TRITON_REPLAY", "1") not in ("", "0")


_HAS_KERNEL: dict[str, bool] = {}


def _has_kernel(op: str) -> bool:
    """Whether kernels_triton/<op>.py exists (looked up once: torch.compile traces supports() on the
    grad path, and the import machinery is a graph break)."""
    has = _HAS_KERNEL.get(op)
    if has is None:
        try:
            has = importlib.util.find_spec(f"kernels_triton.{op}") is not None
        except ModuleNotFoundError:  # the kernels_triton package itself is missing
            has = False
        _HAS_KERNEL[op] = has
    return has


class TritonBackend(Backend):
    name = "triton"
    install_hint = "pip install 'fusekit[triton]'"
    reads_strides = True  # attention reads k/v views (a KV cache in place) through their strides
    writes_strides = True  # attention writes o in q's memory order (kernels_triton.attention.forward)
    first_call_setup = True  # JIT compile, norm/GEMM config tuning on a new shape (see Backend)

    def __init__(self) -> None:
        super().__init__()
        self._modules: dict[str, ModuleType] = {}
        self._entries: dict[tuple[str, str], object] = {}

    def _load(self) -> None:
        import triton  # noqa: F401 - raises ImportError with the reason when missing

        from kernels_triton._config import is_interpreter

        self._interpret = is_interpreter()
        self._dot_fixed = False
        if self._interpret:  # bf16 rounding and tl.dot as on a GPU (kernels_triton/_interpreter.py)
            from kernels_triton import _interpreter

            self._dot_fixed = _interpreter.install()
        # Every op's kernel module now (~1 s), not on its first call: torch.compile traces supports()
        # on the grad path, and an import there is a graph break baked into the compiled frames.
        from fusekit.ops import OPS

        for op in OPS:
            if _has_kernel(op):
                self._kernels(op)

    def _kernels(self, op: str) -> ModuleType:
        mod = self._modules.get(op)
        if mod is None:
            mod = self._modules[op] = importlib.import_module(f"kernels_triton.{op}")
        return mod

    def supports(
        self, op: str, phase: str, device: torch.device, dtypes: tuple[torch.dtype, ...], **meta: object
    ) -> str | None:
        if dtypes[0] == torch.float64:
            return "float64 runs on the torch backend only"
        if device.type == "cpu":
            if not self._interpret:
                return (
                    "triton runs on the CPU only in its interpreter: set TRITON_INTERPRET=1 before "
                    "triton is imported"
                )
            if op in _DOT_OPS and dtypes[0] == torch.bfloat16 and not self._dot_fixed:
                return "the Triton CPU interpreter computes bf16 tl.dot wrongly; run bf16 on a GPU"
        elif device.type != "cuda":
            return f"triton does not run on device type {device.type!r}"
        elif self._interpret:
            return "TRITON_INTERPRET=1 is set, so triton cannot launch on the GPU"
        if op == "attention" and meta.get("head_dim") not in HEAD_DIMS:
            return f"head dim {meta.get('head_dim')} is not supported (supported: 64, 128, 256)"
        if not _has_kernel(op):
            return f"kernels_triton/{op}.py is not part of this installation"
        if not hasattr(self._kernels(op), phase):
            return f"kernels_triton/{op}.py has no {phase} kernel"
        return None

    def _entry(self, op: str, phase: str):
        """The op module's phase function; `<phase>_checked` where the module has one: its entry for calls the
        library has validated (kernels_triton/attention.py: the Gluon route decided once per signature)."""
        fn = self._entries.get((op, phase))
        if fn is None:
            mod = self._kernels(op)
            fn = self._entries[(op, phase)] = getattr(mod, f"{phase}_checked", None) or getattr(mod, phase)
        return fn

    def run(self, spec, phase: str, outputs: tuple, inputs: tuple, scalars: tuple) -> None:
        fn = self._entry(spec.name, phase)
        if self._interpret:
            with _INTERPRETER_LOCK:
                fn(*outputs, *inputs, *scalars)
        else:
            fn(*outputs, *inputs, *scalars)

    def record(self, spec, phase: str, outputs: tuple, inputs: tuple, scalars: tuple):
        """A compiled call's launches, replayable without the launcher (kernels_triton/_replay.py)."""
        if self._interpret or not REPLAY:
            return super().record(spec, phase, outputs, inputs, scalars)
        from kernels_triton import _replay

        fn = self._entry(spec.name, phase)
        return _replay.record(lambda: fn(*outputs, *inputs, *scalars), outputs, inputs)
