"""The `mojo` backend: fusekit's Mojo kernels run as MAX custom ops.

The op package (repo `mojo/`, installed as `fusekit/_mojo/`) is compiled once per op phase x dtypes x
device into a shape-generic MAX graph and kept on disk (runtime.py); calls wrap the torch tensors
without copies and are fenced against torch's current stream (dispatch.py). What each op phase looks
like to MAX is derived from the op's spec (specs.py).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

import torch

from fusekit.backends.base import Backend, BackendUnavailable
from fusekit.backends.mojo.specs import (
    HEAD_DIMS,
    LINEAR_CROSS_ENTROPY_ROWS,
    NO_KERNEL,
    RUNS_ON,
    SW_TC_MIN_T,
    SWIGLU_FFN_BACKWARD,
    ffn_static_tc,
    phase_spec,
    swiglu_ffn_tc_spec,
)
from fusekit.ops.linear_cross_entropy import fused_backward, fused_forward

# Calls inside torch's CUDA graph capture record MAX's launches into torch's graph (dispatch.py: the
# stream fence joins MAX's stream to the capture); "0" refuses them instead.
CAPTURE_ENV = "FUSEKIT_MOJO_CAPTURE"
CAPTURE = os.environ.get(CAPTURE_ENV, "1") != "0"
# Devices where swiglu_ffn's forward from SW_TC_MIN_T tokens on runs as vendor GEMMs around the Mojo norm and
# the Mojo element-wise h (MojoBackend._swiglu_ffn_forward_gemm).
FFN_GEMM_DEVICES: tuple[str, ...] = ("cuda",)
# "1": bf16 prefill at a static (D, F) pair takes the Mojo op's own wgmma path (fusekit.swiglu_ffn_tc: MAX's
# sm90 matmuls at a compile-time shape) instead of the GEMM route. Off by default: on the H200 that path ran
# T=16..8192 at F=11008 in 0.52-0.74x torch.compile (T=4096: 2036 us, 544 TFLOP/s, against cuBLAS's three
# GEMMs at 707; swiglu_ffn.json, 83463ee), and its first call compiles MAX's matmuls (~70 s).
FFN_TC_ENV = "FUSEKIT_MOJO_FFN_TC"


def ffn_tc_enabled() -> bool:
    """FFN_TC_ENV is "1", read per call (ffn_route and mojo_build: the variable may be set after import)."""
    return os.environ.get(FFN_TC_ENV) == "1"


def ffn_route(device: torch.device, x: torch.Tensor, w_gate: torch.Tensor, more: tuple = ()) -> str:
    """A swiglu_ffn forward's path: "gemm" MojoBackend._swiglu_ffn_forward_gemm, "op" the Mojo op's GEMV
    kernels (decode; the CPU's loops), "tc" the Mojo op with the wgmma path (fusekit.swiglu_ffn_tc; opt-in,
    FFN_TC_ENV). `more`: the other weights (w_up, w_down). "tc" only when every weight's base is 16-byte
    aligned: MAX's sm90 matmul builds TMA descriptors over the caller's weights and checks no pointer (a
    contiguous view at an odd element offset, e.g. `buf[1:].view(F, D)`, would fail the tensor map's
    encoding); such weights take the GEMM path (torch.mm reads any alignment)."""
    t, d = x.shape
    if t < SW_TC_MIN_T:
        return "op"
    if (
        device.type == "cuda"
        and ffn_tc_enabled()
        and ffn_static_tc(x, d, w_gate.shape[0])
        and all(w.data_ptr() % 16 == 0 for w in (w_gate, *more))
    ):
        return "tc"
    return "gemm" if device.type in FFN_GEMM_DEVICES else "op"


def _import_max() -> None:
    """Import MAX (ImportError with the reason when it is missing). MAX enters its default MLIR context on
    the importing thread and registers an atexit exit of it, which runs on the main thread: imported first on
    another thread (a first mojo call from a worker), exit raised "Unbalanced Context enter/exit" at
    interpreter shutdown. Then an atexit hook registered after MAX's (atexit runs last-in first-out) enters
    the context on the main thread first, so MAX's exit balances it."""
    fresh = "max._mlir_context" not in sys.modules
    import max.engine  # noqa: F401

    if fresh and threading.current_thread() is not threading.main_thread():
        ctx = sys.modules.get("max._mlir_context")
        if ctx is not None and hasattr(ctx, "default_mlir_context"):
            atexit.register(ctx.default_mlir_context().__enter__)


class MojoBackend(Backend):
    name = "mojo"
    capture_safe = CAPTURE  # MAX launches on its own stream, fenced into torch's capture (dispatch.py)
    first_call_setup = True  # a new op x dtypes compiles (and loads onto the GPU): never inside a capture
    install_hint = "pip install 'fusekit[mojo]'  (max==26.7.0, mojo==1.2.0)"

    def __init__(self, package: str | None = None) -> None:
        super().__init__()
        self._package = package  # None: the installed package (see runtime.locate_package)
        self._compiler = None
        self._dispatcher = None
        self._registered: frozenset[str] | None = None
        self._lock = threading.Lock()
        self._recording = threading.local()  # .calls: the _calls of the `record` running in this thread

    # --- availability ---------------------------------------------------------------------------
    def _load(self) -> None:
        _import_max()  # raises ImportError with the reason when MAX is missing

        from fusekit.backends.mojo.dispatch import Dispatcher
        from fusekit.backends.mojo.runtime import OpCompiler

        self._compiler = OpCompiler(self._package)
        self._dispatcher = Dispatcher()
        # read the package's op names now: supports() needs them, and torch.compile traces supports() on
        # the grad path, where reading files is a graph break
        self.registered()

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
        """The MAX op names the package registers, its lazy subpackages' included (runtime.registered_ops,
        read from its sources once)."""
        if self._registered is None:
            self._registered = frozenset(self.compiler.ops)
        return self._registered

    # --- capability -----------------------------------------------------------------------------
    def supports(
        self, op: str, phase: str, device: torch.device, dtypes: tuple[torch.dtype, ...], **meta: object
    ) -> str | None:
        if device.type not in ("cpu", "cuda"):
            return f"the mojo backend runs on cpu and cuda devices, not {device.type}"
        if op in NO_KERNEL:
            return f"the mojo backend has no {op} kernel yet (backend='triton' or 'torch' run it)"
        if dtypes[0] == torch.float64:
            return "float64 runs on the torch backend only"
        spec = phase_spec(op, phase)
        needs = RUNS_ON.get(spec.max_op, spec.max_op)
        if self._compiler is not None and needs not in self.registered():
            return f"the Mojo package {self._compiler.package} has no {needs} op ({op} {phase})"
        if dtypes not in spec.allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            return f"the mojo backend has no {op} kernel for dtypes ({names})"
        if op == "attention" and meta.get("head_dim") not in HEAD_DIMS:
            return f"head dim {meta.get('head_dim')} is not supported (supported: 64, 128, 256)"
        # Every optional input of the specs is taken (attention's kv_len, rope's positions); strided k/v
        # are fine too: this backend does not read strides, so the library passes contiguous copies.
        return None

    # --- ops ------------------------------------------------------------------------------------
    def run(self, spec, phase: str, outputs: tuple, inputs: tuple, scalars: tuple) -> None:
        ms = phase_spec(spec.name, phase)
        device = next(t.device for t in outputs if t is not None)
        if device.type == "cuda" and not CAPTURE and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"mojo {ms.op}: running inside a CUDA graph capture is switched off ({CAPTURE_ENV}=0); "
                "use backend='triton' for captured regions (or call the op outside the capture)"
            )
        if spec.name == "swiglu_ffn" and phase == "backward":
            self._swiglu_ffn_backward(outputs, inputs, scalars)
        elif spec.name == "swiglu_ffn" and (route := ffn_route(device, *inputs[:2], inputs[2:4])) != "op":
            if route == "tc":
                self._call(swiglu_ffn_tc_spec(), device, outputs, inputs, scalars)
            else:
                self._swiglu_ffn_forward_gemm(device, outputs, inputs, scalars)
        elif spec.name == "linear_cross_entropy":
            self._linear_cross_entropy(phase, device, outputs, inputs, scalars)
        else:
            self._call(ms, device, outputs, inputs, scalars)

    def _call(self, ms, device: torch.device, outputs: tuple, inputs: tuple, scalars: tuple) -> None:
        """One MAX custom op call (ms: a specs.OpSpec) on the provider's arguments."""
        outs, ins, params = ms.bind(outputs, inputs, scalars)
        compiled = self.compiler.get(ms, ms.dtype_key(outs, ins), device, ms.parameters(outs, ins, device))
        disp = self.dispatcher
        st = disp.state(device)
        calls = getattr(self._recording, "calls", None)
        if calls is not None:
            calls.append((compiled, st, outs, ins, params))
        disp.run(compiled, st, outs, ins, params)

    # Ops whose `run` is nothing but `_call`s on the library's own tensors (no torch op around them), so a
    # plan may replay their captured graphs directly (`record`); swiglu_ffn only on its "op" route (the
    # decode GEMVs: T < SW_TC_MIN_T), since its prefill and backward run torch GEMMs beside the Mojo ops, as
    # linear_cross_entropy does.
    _REPLAYABLE = frozenset({"reduce_sum", "rms_norm", "layer_norm", "rope", "attention"})

    def replayable(self, op: str, phase: str, device: torch.device, inputs: tuple) -> bool:
        """Whether `run` of this call is only `_call`s (what PlanReplay can stand in for); the route depends
        on shapes and dtypes only, so it holds for every call of a plan."""
        if op in self._REPLAYABLE:
            return True
        return op == "swiglu_ffn" and phase == "forward" and ffn_route(device, inputs[0], inputs[1]) == "op"

    def record(self, spec, phase: str, outputs: tuple, inputs: tuple, scalars: tuple):
        """`run` once; on CUDA with torch-graph replay (the default), a `replay(outputs, inputs)` that
        replays this plan's captured graphs straight from the argument pointers (dispatch.PlanReplay),
        skipping the routing, binding and compile-cache lookups of `run` on every later call."""
        device = next((t.device for t in outputs if t is not None), None)
        disp = self.dispatcher
        if (
            device is None
            or device.type != "cuda"
            or not (disp.replay and disp.torch_graphs)
            or not self.replayable(spec.name, phase, device, inputs)
        ):
            return super().record(spec, phase, outputs, inputs, scalars)
        from fusekit.backends.mojo.dispatch import PlanReplay

        self._recording.calls = calls = []
        try:
            self.run(spec, phase, outputs, inputs, scalars)
        finally:
            self._recording.calls = None
        return PlanReplay.build(disp, calls, outputs, inputs)

    def _swiglu_ffn_forward_gemm(
        self, device: torch.device, outputs: tuple, inputs: tuple, scalars: tuple
    ) -> None:
        """swiglu_ffn's forward at T >= SW_TC_MIN_T on a GEMM-route device (every (D, F) and dtype; bf16 at
        _STATIC_DF's pair only unless ffn_tc_enabled() sends it to the Mojo op's wgmma path), laid out as the
        backward: the norm is the Mojo op fusekit.rms_norm (casting "fp32": the reference's xn and rstd), the
        three GEMMs torch matmuls (cuBLAS: fp32 accumulation, results in x's dtype). g and u go straight into
        the halves of gu (the saved [T, 2F] with gradients, a scratch one without: torch.mm with a row-strided
        out, which cuBLAS writes in place), and the backward's element-wise op without gradients
        (fusekit.swiglu_ffn_backward, grads = 0) forms h = silu(g) u in fp32 from them, rounded once: one pass
        over g and u where torch's float / silu / mul / cast took five (T=4096, F=14336 bf16: ~2 GB of traffic
        -> ~0.35 GB), and the same expression as the backward's recomputed h. Against the reference, g and u
        are rounded to x's dtype before h (one more rounding, <= 2^-9 relative in bf16; the Mojo wgmma path
        rounds u the same way). The Mojo op's own GEMV path re-streams the weights every 16 tokens (112 ms at
        Llama-3-8B's (4096, 14336) and 2048 tokens on an H100) and MAX 26.7's multistage matmul with runtime N
        and K left most of its output unwritten there (mojo/swiglu_ffn.mojo), hence cuBLAS here."""
        y, rstd, gu = outputs
        x, w_gate, w_up, w_down, nw = inputs
        t, f = x.shape[0], w_gate.shape[0]
        xn = x
        if nw is not None:
            xn = torch.empty_like(x)
            self._call(
                phase_spec("rms_norm", "forward"),
                device,
                (xn, None, rstd),
                (x, None, nw),
                (scalars[0], "fp32"),
            )
        if gu is None:
            gu = torch.empty((t, 2 * f), dtype=x.dtype, device=x.device)
        torch.mm(xn, w_gate.t(), out=gu[:, :f])
        torch.mm(xn, w_up.t(), out=gu[:, f:])
        del xn
        h = torch.empty((t, f), dtype=x.dtype, device=x.device)
        self._call(SWIGLU_FFN_BACKWARD, device, (h, None, None, None), (None, gu, x, None, None), ())
        torch.mm(h, w_down.t(), out=y)

    def _swiglu_ffn_backward(self, outputs: tuple, inputs: tuple, scalars: tuple) -> None:
        """swiglu_ffn's backward (ops/swiglu_ffn.py reference_backward), laid out as the Triton backend's.

        The five GEMMs are torch matmuls (cuBLAS on the GPU: fp32 accumulation, results in x's dtype),
        the element-wise parts Mojo ops: fusekit.swiglu_ffn_backward gives h, dg, du from dh and the
        saved gu (and xn = round(x * rstd * nw) with a norm), fusekit.rms_norm_backward (casting "fp32":
        the same formula) gives dx and dnorm_weight through xn. dh and dxn are rounded to x's dtype (one
        rounding more than the reference each; Triton does the same, the backward tolerance covers it).
        """
        dx, dw_gate, dw_up, dw_down, dnw = outputs
        dy, x, w_gate, w_up, w_down, nw, rstd, gu = inputs
        device = x.device
        dh = torch.matmul(dy, w_down)  # [T, F]
        h, dg, du = (torch.empty_like(dh) for _ in range(3))
        xn = torch.empty_like(x) if nw is not None else None
        self._call(SWIGLU_FFN_BACKWARD, device, (h, dg, du, xn), (dh, gu, x, nw, rstd), ())
        del dh
        torch.matmul(dy.t(), h, out=dw_down)
        del h
        xa = x if xn is None else xn
        torch.matmul(dg.t(), xa, out=dw_gate)
        torch.matmul(du.t(), xa, out=dw_up)
        del xn, xa
        dxn = dx if nw is None else torch.empty_like(x)
        torch.matmul(dg, w_gate, out=dxn)
        dxn.addmm_(du, w_up)
        if nw is not None:  # rms_norm's scalars: (eps, casting); eps is unused (rstd is saved)
            rms = phase_spec("rms_norm", "backward")
            self._call(rms, device, (dx, dnw), (dxn, None, x, nw, rstd), (scalars[0], "fp32"))

    def _linear_cross_entropy(
        self, phase: str, device: torch.device, outputs: tuple, inputs: tuple, scalars: tuple
    ) -> None:
        """linear_cross_entropy laid out as the Triton backend's: the chunk loop, the logits GEMM and the
        gradient GEMMs are torch (ops/linear_cross_entropy.py fused_forward; cuBLAS on the GPU), each
        chunk's row kernel the Mojo op fusekit.linear_cross_entropy (LINEAR_CROSS_ENTROPY_ROWS); the
        backward is a torch multiply (one _foreach_mul_) of the saved gradients (fused_backward)."""
        if phase == "backward":
            fused_backward(*outputs, *inputs)
            return
        ignore_index, _, label_smoothing = scalars

        def rows_kernel(logits, target, rows, scale, grad: bool) -> None:
            values = (ignore_index, label_smoothing, grad)
            self._call(LINEAR_CROSS_ENTROPY_ROWS, device, (logits, rows), (target, scale), values)

        fused_forward(rows_kernel, *outputs, *inputs, *scalars)
