"""The `mojo` backend: fusekit's Mojo kernels run as MAX custom ops.

The op package (repo `mojo/`, installed as `fusekit/_mojo/`) is compiled once per op phase x dtypes x
device into a shape-generic MAX graph and kept on disk (runtime.py); calls wrap the torch tensors
without copies and are fenced against torch's current stream (dispatch.py). What each op phase looks
like to MAX is derived from the op's spec (specs.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading

import torch

from fusekit.backends.base import Backend, BackendUnavailable
from fusekit.backends.mojo.specs import X_DTYPE_WEIGHTS, max_spec, phase_spec

HEAD_DIMS = (64, 128, 256)
# Optional spec inputs (by condition) the Mojo kernels do not take yet: `supports` refuses calls that pass
# them, and they are left out of the MAX signature, so the graphs keep the kernels' argument lists.
NOT_TAKEN: dict[str, frozenset[str]] = {"attention": frozenset({"kv_len"})}


@functools.cache
def _phase_spec(op: str, phase: str):
    """specs.phase_spec without the inputs (and condition flags) of NOT_TAKEN."""
    drop = NOT_TAKEN.get(op)
    if not drop:
        return phase_spec(op, phase)
    from fusekit.ops import SPECS as OP_SPECS

    spec = OP_SPECS[op]

    def trim(p):
        if p is None:
            return None
        ins = tuple(a for a in p.inputs if a.when not in drop)
        return dataclasses.replace(p, inputs=ins, conditions=tuple(c for c in p.conditions if c not in drop))

    return max_spec(
        dataclasses.replace(spec, forward=trim(spec.forward), backward=trim(spec.backward)), phase
    )


class MojoBackend(Backend):
    name = "mojo"
    install_hint = "pip install 'fusekit[mojo]'  (max==26.7.0, mojo==1.2.0)"

    def __init__(self, package: str | None = None) -> None:
        super().__init__()
        self._package = package  # None: the installed package (see runtime.locate_package)
        self._compiler = None
        self._dispatcher = None
        self._registered: frozenset[str] | None = None
        self._lock = threading.Lock()

    # --- availability ---------------------------------------------------------------------------
    def _load(self) -> None:
        import max.engine  # noqa: F401 - raises ImportError with the reason when MAX is missing

        from fusekit.backends.mojo.dispatch import Dispatcher
        from fusekit.backends.mojo.runtime import OpCompiler

        self._compiler = OpCompiler(self._package)
        self._dispatcher = Dispatcher()

    def _ready(self) -> None:
        if self._compiler is None:
            with self._lock:
                reason = self.unavailable_reason()  # runs _load once; keeps the install hint
            if reason is not None:
                raise BackendUnavailable(f"the mojo backend is unavailable: {reason}")

    @property
    def compiler(self):
        self._ready()
        return self._compiler

    @property
    def dispatcher(self):
        self._ready()
        return self._dispatcher

    def registered(self) -> frozenset[str]:
        """The MAX op names the package registers (read from its sources once)."""
        if self._registered is None:
            names: set[str] = set()
            for f in self.compiler.package.glob("*.mojo"):
                names.update(re.findall(r'@register\("([\w.]+)"\)', f.read_text()))
            self._registered = frozenset(names)
        return self._registered

    # --- capability -----------------------------------------------------------------------------
    def supports(
        self, op: str, phase: str, device: torch.device, dtypes: tuple[torch.dtype, ...], **meta: object
    ) -> str | None:
        if device.type not in ("cpu", "cuda"):
            return f"the mojo backend runs on cpu and cuda devices, not {device.type}"
        if dtypes[0] == torch.float64:
            return "float64 runs on the torch backend only"
        spec = _phase_spec(op, phase)
        if self._compiler is not None and spec.max_op not in self.registered():
            return f"the Mojo package {self._compiler.package} has no {spec.max_op} op ({op} {phase})"
        if dtypes not in spec.allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            return f"the mojo backend has no {op} kernel for dtypes ({names})"
        if op in X_DTYPE_WEIGHTS and len(set(dtypes)) > 1:
            return f"the mojo {op} kernel takes norm_weight in x's dtype only, got {dtypes[1]} with {dtypes[0]} x"
        if op == "attention" and meta.get("head_dim") not in HEAD_DIMS:
            return f"head dim {meta.get('head_dim')} is not supported (supported: 64, 128, 256)"
        if op == "attention" and meta.get("kv_len"):
            # (Strided k/v are fine: this backend does not read strides, so the library passes copies.)
            return (
                "the mojo attention kernels take no kv_len (per-sequence KV lengths) yet; "
                "use backend='triton' or 'torch'"
            )
        return None

    # --- ops ------------------------------------------------------------------------------------
    def run(self, spec, phase: str, outputs: tuple, inputs: tuple, scalars: tuple) -> None:
        ms = _phase_spec(spec.name, phase)
        drop = NOT_TAKEN.get(spec.name)
        if drop:  # refused by supports() when present, so these are all None here
            inputs = tuple(v for a, v in zip(spec.phase(phase).inputs, inputs) if a.when not in drop)
        outs, ins, params = ms.bind(outputs, inputs, scalars)
        device = next(t.device for t in outputs if t is not None)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # MAX runs on its own stream with host-side work per call (and may compile on first use):
            # not verified to record into torch's graph, so refuse instead of replaying nothing.
            raise RuntimeError(
                f"mojo {ms.op}: running inside a CUDA graph capture is not supported; use backend='triton' "
                "for captured regions (or call the op outside the capture)"
            )
        compiled = self.compiler.get(ms, ms.dtype_key(outs, ins), device)
        disp = self.dispatcher
        disp.run(compiled, disp.state(device), outs, ins, params)
