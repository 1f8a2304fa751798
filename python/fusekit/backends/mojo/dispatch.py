"""Low-overhead calls of compiled MAX models on torch tensors.

Costs measured on an H200 (MOJO_FACTS §8): `Buffer.from_dlpack` ~20 µs per tensor, `model.execute`
with ready Buffers ~20 µs, `Model.replay` of a captured device graph 2.7 µs. So:

- Wrapping: a torch tensor becomes a MAX Buffer through `max._core.dlpack.make_dlpack_capsule`
  (raw pointer + shape + dtype + device, ~0.5 µs) handed to `Buffer._from_dlpack`, skipping torch's
  `__dlpack__` (~20 µs on a slow CPU) and its stream handshake. The Buffer is a NON-OWNING view:
  its capsule keeps only a sentinel alive, never the tensor. Buffers are kept in a small LRU keyed
  by (data_ptr, shape, dtype) per device. That key is exactly what the view describes, so a hit
  is by construction the same view a fresh wrap would give, even when the tensor that created it
  was freed and its memory reused; and because the cache owns no memory, it never keeps a freed
  tensor's memory from the caching allocator.
- Calls go to `Model._execute_device_tensors` (what `Model.execute` ends in, minus per-argument
  type checks). On CUDA, a (pointers, shapes) key seen twice is captured once into a graph and replayed
  from then on: by default a torch CUDA graph of the whole fenced call (the fence's event record/wait
  become the graph's fork and join edges), replayed on the caller's current stream with no fence at all;
  FUSEKIT_MOJO_REPLAY=max keeps MAX's own device graphs (`Model._capture` / `Model._replay`, on MAX's
  stream, fenced both ways on every call). The key (`arg_key` of every argument) is built before any
  wrapping, so a replayed call touches no Buffer at all. A captured graph bakes in
  pointers and shapes, and it is replayed only for a call whose every argument has exactly those
  pointers, shapes and dtypes (so the memory is live and laid out as captured); params live in
  device tensors read at replay time. Captures are kept in an LRU per model and released on
  eviction.
- Workspaces: an op's GPU scratch memory (specs.Workspace) is a torch tensor allocated for each call
  (a cached 1-element dummy where the launch plan needs none) and passed after the outputs, so no
  kernel allocates through MAX (which, after a capture, reserved most of the GPU) and a replay runs
  over torch memory; it is part of the key like every argument.
- Streams: MAX runs on its device's default queue, not on torch's current stream, and MAX has no
  API to run a model on a foreign stream (`Buffer._from_dlpack(capsule, device, stream)` only
  orders MAX after the producer's stream, not the consumer after MAX). So each CUDA call is fenced
  both ways with two reused events: torch's current stream records `ev_in` and MAX's stream
  (`DeviceQueue.native_stream_handle`) waits on it; after the call MAX's stream records `ev_out`
  and torch's current stream waits on it. `_DriverFence` does this with four raw CUDA driver
  calls; `_TorchFence` (fallback, or FUSEKIT_MOJO_FENCE=torch) with torch events. Both waits are on the
  device (no host sync), and to the caller the op behaves like any torch op on its current stream,
  also for the caching allocator (later work on that stream, including reuse of freed blocks, is
  ordered after the kernel). When torch's current stream is MAX's stream, no fence is needed.
- CPU: MAX's CPU execution returns when the work is done; no fences, no capture.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any

import torch

from fusekit.backends.mojo.runtime import Compiled, max_device, max_dtype
from fusekit.backends.mojo.specs import dummy as dummy_marker

BUFFER_CACHE = 256  # wrapped tensors per device (a hit costs one dict lookup)
PARAMS_CACHE = 64  # params tensors per device, keyed by their values
# Captured graphs per compiled model. A model's decode step calls one op model once per call site, each with
# its own pointers (rms_norm: 2 per layer + the final norm, 65 keys per step for Llama-3-8B), and an LRU
# cycled over more keys than it holds never hits: at 64 every such call captured anew (H200, bench small
# suite, whose rotating input sets are the same pattern: mojo rms_norm 1x4096 335 us wall per call against
# 32 us replayed). A kept graph is a cudaGraphExec of the op's few launches; nothing is allocated inside a
# capture (its private pool stays empty). The GPU memory 512 kept graphs take was not measured yet.
GRAPH_CACHE = 512
# Capture budget per compiled model: a capture (~0.3-0.9 ms of host time) pays off only when its key comes
# back, so a model may be CAPTURE_CREDIT captures ahead of its replays / REPLAYS_PER_CAPTURE; past that
# (pointers that never repeat within the cache: more keys than GRAPH_CACHE in rotation) its calls execute
# (tens of us) until replays earn the credit back.
CAPTURE_CREDIT = GRAPH_CACHE
REPLAYS_PER_CAPTURE = 16
# "0" turns device-graph capture/replay off (on by default). Once a MAX device graph had been captured in a
# process, the next kernel that allocated a device buffer inside the op (a norm backward's partials,
# swiglu_ffn's intermediates) made MAX reserve ~90% of the free GPU memory for a graph pool (H100: 78.7 ->
# 7.8 GiB free after capturing rms_norm's forward, then running its backward), starving torch; replay was
# off by default then. No kernel allocates any more (their scratch is a torch workspace, specs.Workspace):
# on an H100 with replay on, every op's forward and backward captured and replayed kept 78.5 of 78.6 GiB
# free, and the host path per call dropped from 74-89 to 43-45 us (rms_norm 4x4096; rope q+k decode 124 ->
# 70 us). tests/test_mojo_capture_memory.py checks the memory on a GPU. Torch CUDA graphs of the fenced call
# (the default since 2026-11-27) drop the per-call fence: H100, same process, median of 5 rounds of 400 calls,
# wall per call torch graphs vs MAX graphs: rms_norm 4x4096 45.9 vs 60.3 us, rope q+k decode 73.9 vs 97.1,
# decode attention b1 kv2048 80.1 vs 80.0 (GPU-bound); outputs bit-identical to the execute path (.dev probe).
REPLAY_ENV = "FUSEKIT_MOJO_REPLAY"  # "0": off; "max": MAX's device graphs; default ("1"): torch CUDA graphs

_KDL_CPU, _KDL_CUDA = 1, 2


def arg_key(t: torch.Tensor) -> tuple:
    """What a wrapped Buffer views, and so what a captured graph baked in: (pointer, shape, dtype)."""
    return (t.data_ptr(), t.shape, t.dtype)


def workspace_sizes(
    compiled: Compiled, outs: tuple, ins: tuple, sms: int
) -> tuple[tuple[torch.dtype, int], ...]:
    """(dtype, elements) of each of the op's workspaces for this call (specs.Workspace sizes; sms 0: none)."""
    return tuple((dtype, size(outs, ins, sms) if sms else 0) for dtype, size in compiled.workspaces)


def workspace_oom(compiled: Compiled, i: int, n: int, device: torch.device, exc: BaseException) -> Exception:
    """Out of memory allocating workspace i, named as the library names its outputs: the op and the size."""
    spec, dtype = compiled.spec, compiled.workspaces[i][0]
    return torch.OutOfMemoryError(
        f"{spec.max_op} (mojo): out of memory allocating its workspace {spec.workspaces[i].name!r} "
        f"({n} x {str(dtype).removeprefix('torch.')}, {n * dtype.itemsize / 2**30:.2f} GiB) on {device}. {exc}"
    )


def call_tensors(
    st: Any, compiled: Compiled, outs: tuple, ins: tuple, params_t: torch.Tensor | None
) -> list[torch.Tensor]:
    """A call's arguments in the model's order: outputs, this call's workspaces, inputs, then the params
    tensor (if the op has params); a dummy marker (an absent optional tensor, an unused workspace) becomes
    its device's fixed dummy. Dispatcher.run and PlanReplay both key calls on exactly these tensors."""
    args = outs + st.workspaces(compiled, outs, ins) + ins if compiled.workspaces else outs + ins
    tensors = [st.dummy(t) if isinstance(t, tuple) else t for t in args]
    if params_t is not None:
        tensors.append(params_t)
    return tensors


class _Owner:
    """What a non-owning capsule keeps alive: nothing of the tensor."""


_OWNER = _Owner()


class _Producer:
    """The DLPack producer protocol over a ready capsule, as `Buffer._from_dlpack` expects."""

    __slots__ = ("capsule", "device")

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self.capsule = capsule
        self.device = device

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:  # the caller fences streams itself
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


class _TorchFence:
    """Cross-stream fence through torch's event API (about 5 µs for both directions on an H200)."""

    def __init__(self, device: torch.device, handle: int) -> None:
        self.device = device
        self.handle = handle
        self.max_stream = torch.cuda.ExternalStream(handle, device=device)
        self.ev_in = torch.cuda.Event()
        self.ev_out = torch.cuda.Event()

    def enter(self) -> Any:
        cur = torch.cuda.current_stream(self.device)
        if cur.cuda_stream == self.handle:
            return None
        self.ev_in.record(cur)
        self.max_stream.wait_event(self.ev_in)
        return cur

    def exit(self, cur: Any) -> None:
        self.ev_out.record(self.max_stream)
        cur.wait_event(self.ev_out)


class _DriverFence:
    """The same fence as four direct CUDA driver calls (cuEventRecord / cuStreamWaitEvent) on raw
    handles, skipping torch's Stream/Event Python objects. Events come from torch (created by one
    record), so they live in torch's (primary) context, where MAX's stream lives too."""

    def __init__(self, device: torch.device, handle: int) -> None:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        self._record = lib.cuEventRecord
        self._wait = lib.cuStreamWaitEvent
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._raw_stream = torch._C._cuda_getCurrentRawStream
        self.index = device.index or 0
        self.handle = handle
        self.events = (torch.cuda.Event(), torch.cuda.Event())  # kept alive: they own the handles
        cur = torch.cuda.current_stream(device)
        for ev in self.events:
            ev.record(cur)  # torch creates the CUevent lazily, on first record
        self.ev_in, self.ev_out = (ev.cuda_event for ev in self.events)

    def enter(self) -> Any:
        cur = self._raw_stream(self.index)
        if cur == self.handle:
            return None
        if self._record(self.ev_in, cur) or self._wait(self.handle, self.ev_in, 0):
            raise RuntimeError("cuEventRecord/cuStreamWaitEvent failed before a MAX call")
        return cur

    def exit(self, cur: Any) -> None:
        if self._record(self.ev_out, self.handle) or self._wait(cur, self.ev_out, 0):
            raise RuntimeError("cuEventRecord/cuStreamWaitEvent failed after a MAX call")


FENCE_ENV = "FUSEKIT_MOJO_FENCE"  # "torch" forces the torch-event fence; default: driver, else torch


def _make_fence(device: torch.device, handle: int) -> Any:
    if os.environ.get(FENCE_ENV, "driver") != "torch":
        try:
            return _DriverFence(device, handle)
        except (OSError, AttributeError):
            pass
    return _TorchFence(device, handle)


class DeviceState:
    """Per torch device: wrapped-buffer LRU, params and dummy tensors, stream fences."""

    def __init__(self, device: torch.device) -> None:
        from max.driver import Buffer

        self.device = device
        self._buffer_cls = Buffer
        self.max_device = max_device(device)
        self.dl_device = (_KDL_CPU, 0) if device.type == "cpu" else (_KDL_CUDA, device.index or 0)
        self.buffers: OrderedDict[tuple, Any] = OrderedDict()
        self.params: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.dummies: dict[tuple, torch.Tensor] = {}
        try:
            from max._core.dlpack import make_dlpack_capsule

            self._capsule = make_dlpack_capsule
        except ImportError:  # older MAX: the slow public path
            self._capsule = None
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.handle = self.max_device.default_queue.native_stream_handle
            self.max_stream = torch.cuda.ExternalStream(self.handle, device=device)
            self.fence = _make_fence(device, self.handle)
            self.lock = threading.Lock()
        # what the kernels read as DeviceAttribute.MULTIPROCESSOR_COUNT (CUs on ROCm): workspace sizes
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if self.cuda else 0
        self._side: torch.cuda.Stream | None = None
        self._retired: list[tuple[torch.cuda.Event, Any]] = []

    # --- torch CUDA graphs of calls (Dispatcher._torch_graph_call) -----------------------------------
    def side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def retire(self, graph: Any) -> None:
        """Drop an evicted graph once the work queued so far (which may still replay it) is done."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._retired = [(e, g) for e, g in self._retired if not e.query()]
        self._retired.append((ev, graph))

    # --- wrapping -------------------------------------------------------------------------------
    def wrap(self, t: torch.Tensor) -> tuple[tuple, Any]:
        key = arg_key(t)
        return key, self.buffer(key, t)

    def buffer(self, key: tuple, t: torch.Tensor) -> Any:
        """The MAX Buffer viewing t (key: arg_key(t)), from the LRU or wrapped now. Each step is one dict
        operation, so threads sharing the state (CPU calls take no lock) never see a key vanish between
        a lookup and its move (another thread's insert may evict it: get + move_to_end raised KeyError)."""
        buf = self.buffers.pop(key, None)
        if buf is None:
            buf = self._new_buffer(t)
        self.buffers[key] = buf  # (re)inserted last: the most recently used
        while len(self.buffers) > BUFFER_CACHE:
            try:
                self.buffers.popitem(last=False)
            except KeyError:  # emptied by other threads meanwhile
                break
        return buf

    def _new_buffer(self, t: torch.Tensor) -> Any:
        if self._capsule is None:
            return self._buffer_cls.from_dlpack(t)
        cap = self._capsule(
            _OWNER,
            t.data_ptr(),
            self.dl_device[0],
            self.dl_device[1],
            max_dtype(t.dtype),
            tuple(t.shape),
            None,
            None,
        )
        return self._buffer_cls._from_dlpack(_Producer(cap, self.dl_device))

    def workspaces(self, compiled: Compiled, outs: tuple, ins: tuple) -> tuple[torch.Tensor | tuple, ...]:
        """The op's scratch buffers for this call (specs.Workspace), passed after the outputs.

        CUDA: fresh torch tensors of the sizes the call's launch plan needs. Freed when the call returns,
        like any temporary of a torch op on the current stream: later work on that stream is fenced after
        the kernels (see the module docstring), and a captured device graph replays over this memory
        (same pointers, same key). A workspace the plan does not use (size 0), and every workspace on the
        CPU (no CPU path uses one), is a 1-element dummy (specs.dummy): never read nor written.
        """
        res = []
        for i, (dtype, n) in enumerate(workspace_sizes(compiled, outs, ins, self.sms if self.cuda else 0)):
            if not n:
                res.append(dummy_marker(dtype, 1, ("ws", i)))
                continue
            try:
                res.append(torch.empty(n, dtype=dtype, device=self.device))
            except torch.OutOfMemoryError as exc:
                raise workspace_oom(compiled, i, n, self.device, exc) from exc
        return tuple(res)

    def dummy(self, marker: tuple) -> torch.Tensor:
        """The [1] * rank tensor standing for an absent optional tensor (specs.dummy), one per slot."""
        t = self.dummies.get(marker)
        if t is None:
            _, dtype, rank, _slot = marker
            t = self.dummies[marker] = torch.zeros((1,) * rank, dtype=dtype, device=self.device)
        return t

    def check_capture_ready(self, compiled: Compiled, params: tuple[float, ...]) -> None:
        """Inside a CUDA graph capture nothing may copy from the host: the call's params tensor must exist
        (made by the warm-up call the library requires before capturing a signature)."""
        if compiled.spec.params and params not in self.params:
            raise RuntimeError(
                f"{compiled.spec.max_op} (mojo): first call with these scalar values is inside a CUDA graph "
                "capture; run the same call once before capturing (a warm-up, as torch.cuda.graph requires)"
            )

    def params_tensor(self, values: tuple[float, ...]) -> torch.Tensor:
        p = self.params.get(values)
        if p is None:
            p = torch.tensor(values, dtype=torch.float32, device=self.device)
            if self.cuda:
                # Evicting p frees it while MAX's stream may still read it: tell the allocator.
                p.record_stream(self.max_stream)
            self.params[values] = p
            if len(self.params) > PARAMS_CACHE:
                self.params.popitem(last=False)
        return p


def _capture_failed(compiled: Compiled, exc: BaseException) -> None:
    """A model whose capture failed executes from then on; say so once (its calls keep working, slower)."""
    compiled.capturable = False
    compiled.capture_error = (
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    )
    warnings.warn(
        f"fusekit: mojo {compiled.spec.max_op}: capturing its calls into a graph failed "
        f"({compiled.capture_error}); they run uncaptured from now on",
        RuntimeWarning,
        stacklevel=3,
    )


def may_capture(compiled: Compiled) -> bool:
    """Whether the model's replays have paid for its captures so far (CAPTURE_CREDIT)."""
    return compiled.captures < CAPTURE_CREDIT + compiled.replays // REPLAYS_PER_CAPTURE


class Dispatcher:
    """Runs a compiled op on torch tensors with the cheapest safe path."""

    def __init__(self) -> None:
        self.states: dict[torch.device, DeviceState] = {}
        mode = os.environ.get(REPLAY_ENV, "1")
        self.replay = mode != "0"
        self.torch_graphs = mode != "max"  # see the module docstring
        self.counts = {"execute": 0, "capture": 0, "replay": 0}
        # the PlanReplays built on this dispatcher: an evicted graph is forgotten by every one of them at once
        self._plan_replays: weakref.WeakSet = weakref.WeakSet()
        self._plans_lock = threading.Lock()

    def state(self, device: torch.device) -> DeviceState:
        st = self.states.get(device)
        if st is None:
            with self._plans_lock:  # one state per device: concurrent first calls share its locks
                st = self.states.get(device)
                if st is None:
                    st = self.states[device] = DeviceState(device)
        return st

    def run(
        self,
        compiled: Compiled,
        st: DeviceState,
        outs: tuple[torch.Tensor | tuple, ...],
        ins: tuple[torch.Tensor | tuple, ...],
        params: tuple[float, ...],
    ) -> None:
        capturing = st.cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            st.check_capture_ready(compiled, params)
        p = st.params_tensor(params) if compiled.spec.params else None
        tensors = call_tensors(st, compiled, outs, ins, p)
        key = tuple([arg_key(t) for t in tensors])
        if not st.cuda:
            compiled.model._execute_device_tensors([st.buffer(k, t) for k, t in zip(key, tensors)])
            self.counts["execute"] += 1
            return
        # One call at a time per device: the fence reuses two events, and ctypes drops the GIL.
        with st.lock:
            torch_graph = not capturing and self.replay and self.torch_graphs and compiled.capturable
            if torch_graph and (g := compiled.graphs.get(key)) is not None:
                # The hot path: a captured call replays from its key alone (no MAX Buffers, no fence).
                compiled.graphs[key] = compiled.graphs.pop(key)  # most recently used last
                g.replay()
                compiled.replays += 1
                self.counts["replay"] += 1
                return
            bufs = [st.buffer(k, t) for k, t in zip(key, tensors)]
            if torch_graph and self._torch_graph_call(compiled, st, key, bufs):
                return
            cur = st.fence.enter()
            try:
                if capturing:
                    # Inside torch's CUDA graph capture: the fence's event wait made MAX's stream part of
                    # the capture (a fork joined back by exit), so MAX's plain launches are recorded into
                    # torch's graph. Never MAX's own device-graph capture or replay here (a capture inside
                    # a capture), and no bookkeeping that would make a later call capture.
                    compiled.model._execute_device_tensors(bufs)
                    self.counts["execute"] += 1
                else:
                    self._launch(compiled, key, bufs)
            finally:
                if cur is not None:
                    st.fence.exit(cur)

    def _torch_graph_call(self, compiled: Compiled, st: DeviceState, key: tuple, bufs: list[Any]) -> bool:
        """Replay (or, on a key's second sighting, capture then replay) the call as a torch CUDA graph on the
        caller's current stream; False: the caller executes (a first sighting, or a capture that failed).

        The capture runs the fenced call on a side stream: the fence's event record on that stream and MAX's
        stream's wait on it fork MAX's stream into the capture, the record/wait after the call join it back,
        so the replayed graph is ordered after the caller's earlier work and before its later work like the
        fenced call, with no event calls per replay. Nothing is allocated inside the capture (outputs,
        workspaces and params exist already)."""
        graphs = compiled.graphs
        g = graphs.get(key)
        if g is None:
            # a first sighting, or captures not paid for yet: _launch executes it and notes the key
            if key not in compiled.seen or not may_capture(compiled):
                return False
            g = self._capture_torch(compiled, st, key, bufs)
            if g is None:
                return False
        else:
            graphs[key] = graphs.pop(key)  # most recently used last
            compiled.replays += 1  # a replay that pays for its capture (the capturing call's own does not)
        g.replay()
        self.counts["replay"] += 1
        return True

    def _capture_torch(self, compiled: Compiled, st: DeviceState, key: tuple, bufs: list[Any]) -> Any:
        cur = torch.cuda.current_stream(st.device)
        side = st.side_stream()
        side.wait_stream(cur)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                # its own (empty) pool: a shared pool handle dies with the last graph that used it (torch 2.11
                # then asserts in the caching allocator on the next capture_begin with that handle)
                g.capture_begin(capture_error_mode="thread_local")
                try:
                    fcur = st.fence.enter()
                    compiled.model._execute_device_tensors(bufs)
                    if fcur is not None:
                        st.fence.exit(fcur)
                finally:
                    g.capture_end()
        except Exception as exc:  # capture is best effort: this model then always executes (fenced)
            cur.wait_stream(side)
            _capture_failed(compiled, exc)
            return None
        cur.wait_stream(side)
        if (old := self._keep(compiled, key, g)) is not None:
            st.retire(old)
        return g

    def _launch(self, compiled: Compiled, key: tuple, bufs: list[Any]) -> None:
        model = compiled.model
        graphs = compiled.graphs
        gk = graphs.get(key)
        if gk is not None:
            compiled.replays += 1  # a replay that pays for its capture (the capturing call's own does not)
        elif (
            self.replay
            and not self.torch_graphs
            and compiled.capturable
            and key in compiled.seen
            and may_capture(compiled)
        ):
            gk = self._capture(compiled, key, bufs)
        if gk is not None:
            model._replay([gk], bufs)
            graphs[key] = graphs.pop(key)  # most recently used last
            self.counts["replay"] += 1
            return
        compiled.seen[key] = None
        if len(compiled.seen) > 4 * GRAPH_CACHE:
            del compiled.seen[next(iter(compiled.seen))]
        model._execute_device_tensors(bufs)
        self.counts["execute"] += 1

    def _capture(self, compiled: Compiled, key: tuple, bufs: list[Any]) -> int | None:
        """Capture the call's launches into a device graph (replayed right after, and from then on)."""
        model = compiled.model
        gk = compiled.next_graph
        compiled.next_graph += 1
        try:
            model._capture([gk], bufs)
        except Exception as exc:  # capture is best effort: this model then always executes
            _capture_failed(compiled, exc)
            return None
        if (old := self._keep(compiled, key, gk)) is not None:
            model._release_captured_graph([old])
        return gk

    def _keep(self, compiled: Compiled, key: tuple, graph: Any) -> Any:
        """Remember a captured graph (either kind) under its key, most recent last; returns the least recently
        used one when the cache overflows (GRAPH_CACHE), for the caller to release."""
        compiled.seen.pop(key, None)
        compiled.graphs[key] = graph
        compiled.captures += 1
        self.counts["capture"] += 1
        if len(compiled.graphs) > GRAPH_CACHE:
            self.forget_replays()
            return compiled.graphs.pop(next(iter(compiled.graphs)))
        return None

    def register_replay(self, replay: PlanReplay) -> None:
        with self._plans_lock:
            self._plan_replays.add(replay)

    def forget_replays(self) -> None:
        """Empty every PlanReplay's remembered lookups (a captured graph is being dropped): none replays it,
        nor keeps it alive. Rare (an eviction), and cheaper than checking on every replayed call."""
        with self._plans_lock:
            plans = list(self._plan_replays)
        for pr in plans:
            pr.fast.clear()


class PlanReplay:
    """Replays one plan's mojo calls from their captured torch graphs, given only the plan's arguments
    (MojoBackend.record; the library keeps one per call signature and tries it before `run`).

    Built from the `_call`s one call of the plan made: every bound argument is traced to one of the plan's
    outputs or inputs by identity, or is an absent input's dummy (resolved to its device's fixed dummy
    once); the params tensor is held here so its pointer stays valid, and each workspace's size is read
    once (a plan fixes every shape). A later call rebuilds each `_call`'s tensors in `call_tensors`' order
    (fresh workspaces of those sizes) and replays only if every `run` key has a captured graph; otherwise
    (new pointers seen for the first time, a capture in progress) it returns False and the plan runs the op
    normally, which captures on the key's second sighting. Keys are exactly `run`'s, so a replay is the
    graph `run` itself would have replayed.

    The hot path: the graphs found for one set of pointers are remembered under the bare data pointers of
    the plan's arguments and workspaces (shapes and dtypes are the plan's, so they add nothing to the key;
    building `run`'s keys of (pointer, shape, dtype) per tensor was ~10 us of a 15 us replayed rms_norm on
    the H200's host). Every PlanReplay's entries are dropped when a captured graph is evicted
    (Dispatcher.forget_replays), so none replays, nor keeps alive, a graph `run` has dropped.
    """

    __slots__ = ("__weakref__", "allocs", "disp", "fast", "lock", "steps", "var")
    # Pointer sets remembered per plan: as many as a model keeps graphs (GRAPH_CACHE). A decode step has
    # one per call site (an 80-layer model's two norms a layer: 160); with 64, 256 rotating sets ran at
    # 29-38 us per replayed call on the H200 (the lookup kept missing), 13-15 with one set.
    FAST_ENTRIES = GRAPH_CACHE

    def __init__(self, disp: Dispatcher, lock: Any, steps: tuple, var: tuple, allocs: tuple) -> None:
        self.disp = disp
        self.lock = lock
        self.steps = steps  # per _call: (compiled, slots); a slot is an int >= 0 (plan argument),
        # an int < 0 (workspace -1 - slot of this call's fresh ones) or a fixed tensor (dummy, params)
        self.var = var  # indices of the plan arguments the calls read, in the fast key's order
        self.allocs = allocs  # (size, dtype, device, its model, its index) of each fresh workspace
        self.fast: dict[tuple, tuple] = {}  # pointers -> ((compiled, key, graph), ...)
        disp.register_replay(self)

    @classmethod
    def build(cls, disp: Dispatcher, calls: list, outputs: tuple, inputs: tuple) -> PlanReplay | None:
        """None when the recorded call cannot be replayed this way: no `_call`, one whose model may not be
        captured, an argument that is neither the plan's nor fixed, or one tensor passed in two places (its
        position would be ambiguous on later calls, which may pass two different tensors there)."""
        where: dict[int, int] = {}  # id of a plan argument -> its index in outputs + inputs
        for i, t in enumerate(outputs + inputs):
            if t is not None:
                if id(t) in where:
                    return None
                where[id(t)] = i
        if not calls or len({id(st) for _, st, *_ in calls}) != 1:
            return None
        steps, used, allocs = [], set(), []

        def slot(a: Any) -> Any:
            if isinstance(a, tuple):
                return st.dummy(a)
            i = where.get(id(a))
            if i is not None:
                used.add(i)
            return i

        for compiled, st, outs, ins, params in calls:
            if not compiled.capturable:
                return None
            ws = []
            for i, (dtype, n) in enumerate(workspace_sizes(compiled, outs, ins, st.sms)):
                if n:
                    allocs.append((n, dtype, st.device, compiled, i))
                    ws.append(-len(allocs))
                else:
                    ws.append(st.dummy(dummy_marker(dtype, 1, ("ws", i))))
            slots = [slot(a) for a in outs] + ws + [slot(a) for a in ins]
            if any(s is None for s in slots):
                return None
            if compiled.spec.params:
                slots.append(st.params_tensor(params))
            steps.append((compiled, tuple(slots)))
        return cls(disp, calls[0][1].lock, tuple(steps), tuple(sorted(used)), tuple(allocs))

    def __call__(self, outputs: tuple, inputs: tuple) -> bool:
        if torch.cuda.is_current_stream_capturing():
            return False  # run() records MAX's launches into the caller's capture
        plan_args = outputs + inputs
        # the workspaces stay allocated until the graphs are enqueued (freed after, as run's are)
        ws = []
        for n, dt, dev, compiled, i in self.allocs:
            try:
                ws.append(torch.empty(n, dtype=dt, device=dev))
            except torch.OutOfMemoryError as exc:
                raise workspace_oom(compiled, i, n, dev, exc) from exc
        fkey = tuple([plan_args[i].data_ptr() for i in self.var] + [w.data_ptr() for w in ws])
        disp = self.disp
        with self.lock:
            hit = self.fast.get(fkey)
            if hit is not None:
                for compiled, key, g in hit:
                    graphs = compiled.graphs
                    graphs[key] = graphs.pop(key)  # most recently used last
                    g.replay()
                    compiled.replays += 1
                disp.counts["replay"] += len(hit)
                return True
        found = []
        for compiled, slots in self.steps:
            tensors = [s if type(s) is not int else plan_args[s] if s >= 0 else ws[-1 - s] for s in slots]
            key = tuple([arg_key(t) for t in tensors])
            if key not in compiled.graphs:
                return False
            found.append((compiled, key))
        with self.lock:
            entry = []
            for compiled, key in found:
                g = compiled.graphs.get(key)
                if g is None:  # evicted by another thread since the lookup: run the whole call normally
                    return False
                entry.append((compiled, key, g))
            for compiled, key, g in entry:
                compiled.graphs[key] = compiled.graphs.pop(key)  # most recently used last
                g.replay()
                compiled.replays += 1
            disp.counts["replay"] += len(entry)
            if len(self.fast) >= self.FAST_ENTRIES:
                del self.fast[next(iter(self.fast))]  # the oldest entry
            self.fast[fkey] = tuple(entry)
        return True
