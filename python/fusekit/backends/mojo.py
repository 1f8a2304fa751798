"""The `mojo` backend: fusekit's Mojo kernels run as MAX custom ops.

The op package (repo `mojo/`, installed as `fusekit/_mojo/`) is compiled once per op x dtypes x
device into a shape-generic MAX graph and kept on disk (mojo_runtime.py); calls wrap the torch
tensors without copies and are fenced against torch's current stream (mojo_dispatch.py). What
each op looks like to MAX is the table in mojo_specs.py.
"""

from __future__ import annotations

import threading

import torch

from fusekit.backends.base import Backend, BackendUnavailable
from fusekit.backends.mojo_specs import ROPE_MAX_POSITION, SPECS

_TENSOR_CORE_REASON = "not implemented in the mojo backend yet (follow-up issue: tensor-core ops)"


class MojoBackend(Backend):
    name = "mojo"
    install_hint = "pip install 'fusekit[mojo]'  (max==26.7.0, mojo==1.2.0)"

    def __init__(self, package: str | None = None) -> None:
        super().__init__()
        self._package = package  # None: the installed package (see mojo_runtime.locate_package)
        self._compiler = None
        self._dispatcher = None
        self._lock = threading.Lock()

    # --- availability ---------------------------------------------------------------------------
    def _load(self) -> None:
        import max.engine  # noqa: F401 - raises ImportError with the reason when MAX is missing

        from fusekit.backends.mojo_dispatch import Dispatcher
        from fusekit.backends.mojo_runtime import OpCompiler

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

    # --- capability -----------------------------------------------------------------------------
    def supports(self, op: str, device: torch.device, dtype: torch.dtype, **meta: object) -> str | None:
        spec = SPECS.get(op)
        if spec is None:
            return f"{op} is {_TENSOR_CORE_REASON}"
        if device.type not in ("cpu", "cuda"):
            return f"the mojo backend runs on cpu and cuda devices, not {device.type}"
        key = (dtype, meta.get("out_dtype", dtype)) if len(spec.dtype_vars) == 2 else (dtype,)
        if key not in spec.allowed:
            names = " -> ".join(str(d).removeprefix("torch.") for d in key)
            return f"the mojo backend has no {op} kernel for {names}"
        if op == "rope":
            seq = meta.get("seq_len", 0)
            start = meta.get("start_pos", 0)
            if int(start) + int(seq) > ROPE_MAX_POSITION:  # type: ignore[call-overload]
                return "rope positions beyond 2^24 are not exact in the mojo kernel's float32 params"
        if self._compiler is not None and not self._compiler.has_op(op):
            return f"the Mojo package {self._compiler.package} has no {op}.mojo"
        return None

    # --- ops ------------------------------------------------------------------------------------
    def _run(self, op: str, *args: object) -> None:
        spec = SPECS.get(op)
        if spec is None:
            raise NotImplementedError(f"{op} is {_TENSOR_CORE_REASON}")
        outs, ins, params = spec.bind(*args)
        device = outs[0].device
        compiled = self.compiler.get(spec, spec.dtype_key(outs, ins), device)
        disp = self.dispatcher
        disp.run(compiled, disp.state(device), outs, ins, params)

    def reduce_sum(self, out: torch.Tensor, x: torch.Tensor) -> None:
        self._run("reduce_sum", out, x)

    def rms_norm(
        self, out: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        self._run("rms_norm", out, rstd, x, weight, eps)

    def layer_norm(
        self,
        out: torch.Tensor,
        mean: torch.Tensor,
        rstd: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
    ) -> None:
        self._run("layer_norm", out, mean, rstd, x, weight, bias, eps)

    def rope(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        start_pos: int,
        theta: float,
        interleaved: bool,
    ) -> None:
        if start_pos + x.shape[1] > ROPE_MAX_POSITION:
            raise ValueError("rope positions beyond 2^24 are not exact in the mojo kernel's float32 params")
        self._run("rope", out, x, cos, sin, start_pos, theta, interleaved)

    def swiglu_ffn(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        norm_weight: torch.Tensor | None,
        eps: float,
    ) -> None:
        self._run("swiglu_ffn", out, x, w_gate, w_up, w_down, norm_weight, eps)

    def attention(
        self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> None:
        self._run("attention", out, q, k, v, causal, scale)
