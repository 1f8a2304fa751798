"""The mojo backend's runtime: package location, compile-once, disk cache, errors, buffer cache, streams.

These tests use a tiny op package written into a temporary directory (one `fusekit.reduce_sum` op
with the contract's signature), so they do not depend on the real kernels and compile one graph
(about 12 s on 2 CPU cores, once per test session). They skip only when MAX is not importable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checks import rel_error, sum_scale

try:
    import max.engine  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    print(f"skipping the mojo runtime tests: MAX is not importable ({exc})")
    pytest.skip(f"MAX is not importable: {exc}", allow_module_level=True)

from fusekit.backends.base import BackendUnavailable
from fusekit.backends.mojo import MojoBackend
from fusekit.backends.mojo import runtime as rt
from fusekit.backends.mojo import specs as rt_specs
from fusekit.backends.mojo.dispatch import DeviceState

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"

TINY_REDUCE_SUM = """
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import global_idx
from max.gpu.host import DeviceContext


@register("fusekit.reduce_sum")
struct ReduceSum:
    @staticmethod
    def execute[target: StaticString](
        res: MutableInputTensor[rank=1, ...],
        part: MutableInputTensor[rank=1, ...],  # the contract's partials workspace; this kernel needs none
        x: InputTensor[rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var m = Int64(x.dim_size(0))
        var n = Int64(x.dim_size(1))
        var xp = x.unsafe_ptr()
        var rp = res.unsafe_ptr()
        comptime acc_t = DType.float32 if x.dtype.is_floating_point() else DType.int64
        comptime if target == "gpu":
            def kernel() {var xp, var rp, var m, var n}:
                var i = Int64(global_idx.x)
                if i < m:
                    var acc = Scalar[acc_t](0)
                    for j in range(Int(n)):
                        acc += xp[unsafe_offset=Int(i * n) + j].cast[acc_t]()
                    rp[unsafe_offset=Int(i)] = acc.cast[res.dtype]()
            ctx.enqueue_function(kernel, grid_dim=(Int(m) + 127) // 128, block_dim=128)
        else:
            for i in range(Int(m)):
                var acc = Scalar[acc_t](0)
                for j in range(Int(n)):
                    acc += xp[unsafe_offset=i * Int(n) + j].cast[acc_t]()
                rp[unsafe_offset=i] = acc.cast[res.dtype]()
"""


def _write_package(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "__init__.mojo").write_text("")
    (path / "reduce_sum.mojo").write_text(TINY_REDUCE_SUM)
    return path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(package dir, fusekit cache dir) shared by the tests that compile."""
    root = tmp_path_factory.mktemp("mojo_rt")
    return _write_package(root / "pkg"), root / "cache"


@pytest.fixture()
def mojo_be(tiny: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> MojoBackend:
    monkeypatch.setenv(rt.CACHE_ENV, str(tiny[1]))
    return MojoBackend(str(tiny[0]))


def _sum(be: MojoBackend, out: torch.Tensor, x: torch.Tensor) -> None:
    """The row sums of x [M, N] into out [M] through the provider contract (what the library calls)."""
    from fusekit.ops.reduce_sum import SPEC

    be.run(SPEC, "forward", (out,), (x,), ())


def _check_sum(be: MojoBackend, M: int, N: int, device: str = "cpu") -> None:
    x = torch.randn(M, N, device=device)
    out = torch.full((M,), float("nan"), device=device)
    _sum(be, out, x)
    assert rel_error(out, x.double().sum(-1), sum_scale(x, -1)) < 1e-5


# --- package location ----------------------------------------------------------------------------
def test_locate_package_prefers_installed_package_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(rt.PACKAGE_ENV, raising=False)
    installed = tmp_path / "site" / "fusekit"
    (installed / "_mojo").mkdir(parents=True)
    monkeypatch.setattr(rt.importlib.resources, "files", lambda name: installed)
    assert rt.locate_package() == (installed / "_mojo").resolve()


def test_locate_package_falls_back_to_checkout_not_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(rt.PACKAGE_ENV, raising=False)
    monkeypatch.setattr(rt.importlib.resources, "files", lambda name: tmp_path / "nowhere")
    (tmp_path / "mojo").mkdir()
    monkeypatch.chdir(tmp_path)  # a `mojo/` in the working directory must not be picked up
    import fusekit

    # the fallback is relative to the imported fusekit sources (a checkout), never to the CWD
    repo_mojo = Path(fusekit.__file__).resolve().parents[2] / "mojo"
    if repo_mojo.is_dir():
        assert rt.locate_package() == repo_mojo.resolve()
    else:
        with pytest.raises(FileNotFoundError):
            rt.locate_package()
    monkeypatch.setenv(rt.PACKAGE_ENV, str(tmp_path / "mojo"))
    assert rt.locate_package() == (tmp_path / "mojo").resolve()


def test_package_hash_tracks_sources(tmp_path: Path) -> None:
    pkg = _write_package(tmp_path / "p")
    h1 = rt.package_hash(pkg)
    assert rt.package_hash(pkg) == h1
    (pkg / "reduce_sum.mojo").write_text(TINY_REDUCE_SUM + "\n# edit\n")
    assert rt.package_hash(pkg) != h1


def test_graph_writes_outputs_in_place(tiny: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The op gets the caller's output buffers: no MAX temporary copied out by a `mutable.store`."""
    monkeypatch.setenv(rt.CACHE_ENV, str(tiny[1]))
    comp = rt.OpCompiler(str(tiny[0]))
    text = str(comp._graph(rt_specs.SPECS["reduce_sum"], (torch.float32, torch.float32), torch.device("cpu")))
    assert "mo.custom" in text and "mutable.store" not in text, text


# --- compile once, disk cache ----------------------------------------------------------------------
def test_compile_once_per_op_dtype_not_per_shape(mojo_be: MojoBackend) -> None:
    t0 = time.perf_counter()
    _check_sum(mojo_be, 3, 5)
    first = time.perf_counter() - t0
    stats = mojo_be.compiler.stats
    loads = stats.graph_compiles + stats.mef_loads
    assert loads == 1
    t0 = time.perf_counter()
    for M, N in [(37, 111), (1, 4096), (199, 3)]:
        _check_sum(mojo_be, M, N)
    new_shapes = (time.perf_counter() - t0) / 3
    assert stats.graph_compiles + stats.mef_loads == loads  # no graph for a new shape
    print(f"first call {first:.2f}s ({vars(stats)}), new shape {new_shapes * 1e3:.1f} ms")
    assert new_shapes < 1.0


def test_second_process_reuses_disk_cache(mojo_be: MojoBackend, tiny: tuple[Path, Path]) -> None:
    _check_sum(mojo_be, 2, 7)  # make sure this session compiled (or loaded) it
    code = (
        "import json, time, torch\n"
        "t0 = time.perf_counter()\n"
        "from fusekit.backends.mojo import MojoBackend\n"
        f"be = MojoBackend({str(tiny[0])!r})\n"
        "x = torch.randn(6, 9); out = torch.empty(6)\n"
        "from fusekit.ops.reduce_sum import SPEC\n"
        "be.run(SPEC, 'forward', (out,), (x,), ())\n"
        "ok = torch.allclose(out, x.sum(-1), atol=1e-5)\n"
        "print(json.dumps({'s': time.perf_counter() - t0, 'ok': ok, **vars(be.compiler.stats)}))\n"
    )
    env = {
        **os.environ,
        rt.CACHE_ENV: str(tiny[1]),
        "PYTHONPATH": os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"second process: {res['s']:.2f}s incl. imports, {res}")
    assert res["ok"]
    assert res["graph_compiles"] == 0 and res["precompiles"] == 0 and res["mef_loads"] == 1


def test_bad_package_error_shows_mojo_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = _write_package(tmp_path / "broken")
    src = (pkg / "reduce_sum.mojo").read_text()
    (pkg / "reduce_sum.mojo").write_text(
        src.replace("var acc = Scalar[acc_t](0)", "var acc = undefined_name_xyz")
    )
    monkeypatch.setenv(rt.CACHE_ENV, str(tmp_path / "cache"))
    be = MojoBackend(str(pkg))
    with pytest.raises(rt.MojoBuildError) as info:
        _sum(be, torch.empty(2), torch.randn(2, 3))
    msg = str(info.value)
    assert "undefined_name_xyz" in msg and "error" in msg, msg


def test_missing_max_is_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "max.engine", None)  # `import max.engine` now raises ImportError
    be = MojoBackend()
    reason = be.unavailable_reason()
    assert reason is not None and "max==26.7.0" in reason
    with pytest.raises(BackendUnavailable, match="install"):
        _sum(be, torch.empty(1), torch.randn(1, 2))


# --- supports -------------------------------------------------------------------------------------
def test_supports_reasons() -> None:
    be = MojoBackend()
    assert be.unavailable_reason() is None
    cpu = torch.device("cpu")
    f32, bf16 = torch.float32, torch.bfloat16
    assert be.supports("swiglu_ffn", "forward", cpu, (f32, f32)) is None
    # the Mojo FFN kernels take the norm weight in x's dtype or fp32 (AMP), forward and backward (issue #10)
    assert be.supports("swiglu_ffn", "forward", cpu, (bf16, f32)) is None
    assert be.supports("swiglu_ffn", "backward", cpu, (f32, f32)) is None
    assert be.supports("swiglu_ffn", "backward", cpu, (bf16, bf16)) is None
    assert be.supports("swiglu_ffn", "backward", cpu, (bf16, f32)) is None
    assert be.supports("swiglu_ffn", "forward", cpu, (bf16, torch.float16)) is not None
    assert be.supports("attention", "forward", cpu, (bf16,), head_dim=128) is None
    assert be.supports("attention", "forward", cpu, (bf16,), head_dim=96) is not None
    assert be.supports("attention", "forward", cpu, (torch.float64,), head_dim=128) is not None
    assert be.supports("rms_norm", "forward", torch.device("meta"), (f32, f32)) is not None
    assert be.supports("rms_norm", "backward", cpu, (bf16, f32)) is None
    assert be.supports("reduce_sum", "forward", cpu, (torch.int32, f32)) is not None
    assert be.supports("reduce_sum", "forward", cpu, (bf16, f32)) is None


# --- buffer cache ---------------------------------------------------------------------------------
def test_buffer_cache_key_is_pointer_shape_dtype() -> None:
    st = DeviceState(torch.device("cpu"))
    base = torch.arange(12, dtype=torch.float32)
    k1, b1 = st.wrap(base.view(3, 4))
    k2, b2 = st.wrap(base.view(4, 3))  # same pointer, other shape
    k3, b3 = st.wrap(base.view(torch.int32).view(3, 4))  # same pointer and shape, other dtype
    assert len({k1, k2, k3}) == 3 and b1 is not b2 and b1 is not b3
    assert tuple(b2.shape) == (4, 3) and b1._data_ptr() == base.data_ptr()
    assert st.wrap(base.view(3, 4))[1] is b1  # a hit is the identical view


def test_buffer_cache_never_stale_when_memory_is_reused(mojo_be: MojoBackend) -> None:
    storage = torch.empty(4096)
    st = mojo_be.dispatcher.state(torch.device("cpu"))
    for M, N in [(16, 64), (64, 16), (16, 64), (32, 32)]:  # same pointer, shapes/values change
        x = storage[: M * N].view(M, N)
        x.copy_(torch.randn(M, N))
        out = torch.full((M,), float("nan"))
        _sum(mojo_be, out, x)
        assert torch.allclose(out, x.sum(-1), atol=1e-4)
    # freed tensors: the cached views own nothing, so the memory really goes back
    x = torch.randn(256, 512)
    ptr = x.data_ptr()
    out = torch.empty(256)
    _sum(mojo_be, out, x)
    holder = [k for k in st.buffers if k[0] == ptr]
    assert holder, "the call should have cached a view of x"
    weak = x.untyped_storage()._weak_ref()
    del x
    assert torch.UntypedStorage._expired(weak), "the buffer cache must not keep a freed tensor alive"
    y = torch.randn(256, 512)  # may or may not land on ptr; correct either way
    _sum(mojo_be, out, y)
    assert torch.allclose(out, y.sum(-1), atol=1e-3)


def test_cpu_execution_is_complete_on_return(mojo_be: MojoBackend) -> None:
    x = torch.randn(2048, 2048)
    out = torch.full((2048,), float("nan"))
    _sum(mojo_be, out, x)
    assert not torch.isnan(out).any()


# --- CUDA ------------------------------------------------------------------------------------------
def test_device_graph_replay_is_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay is on unless FUSEKIT_MOJO_REPLAY=0 (tests/test_mojo_capture_memory.py checks its memory on a
    GPU); no op is kept from capture: the kernels that used to allocate (which, after a capture, made MAX
    reserve most of the GPU) take caller-owned workspaces instead."""
    from fusekit.backends.mojo.dispatch import REPLAY_ENV, Dispatcher

    monkeypatch.delenv(REPLAY_ENV, raising=False)
    assert Dispatcher().replay is True
    monkeypatch.setenv(REPLAY_ENV, "0")
    assert Dispatcher().replay is False
    monkeypatch.setenv(REPLAY_ENV, "1")
    assert Dispatcher().replay is True
    assert not hasattr(rt_specs, "NO_CAPTURE")
    for op, phase in [("rms_norm", "backward"), ("swiglu_ffn", "forward"), ("reduce_sum", "forward")]:
        assert rt_specs.phase_spec(op, phase).workspaces, (op, phase)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_side_stream_ordering(mojo_be: MojoBackend) -> None:
    """MAX's stream is ordered after the caller's and the caller's after MAX, on both paths of a call: the
    first call of a signature executes, the next ones capture and replay a device graph (on by default;
    FUSEKIT_MOJO_REPLAY=0 keeps every call on the execute path)."""
    dev = torch.device("cuda", 0)
    st = mojo_be.dispatcher.state(dev)
    before = dict(mojo_be.dispatcher.counts)
    M, N = 1024, 2048
    x = torch.randn(M, N, device=dev)
    out = torch.empty(M, device=dev)
    for _ in range(3):
        xnew = torch.randn(M, N, device=dev)
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        with torch.cuda.stream(st.max_stream):
            torch.cuda._sleep(20_000_000)  # MAX's stream is busy: the read below must wait for it
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)  # and MAX must wait for this stream's write of x
            x.copy_(xnew)
            _sum(mojo_be, out, x)
            got = out.clone()
        s.synchronize()
        assert rel_error(got, xnew.double().sum(-1), sum_scale(xnew, -1)) < 1e-5
    ran = {k: v - before[k] for k, v in mojo_be.dispatcher.counts.items()}
    assert ran["execute"] + ran["replay"] == 3, ran  # every call went through one of the two paths
    assert (ran["replay"] >= 1) == mojo_be.dispatcher.replay, ran


def test_graph_device_points_max_graph_at_the_tensors_gpu(monkeypatch) -> None:
    """MAX 26.7's Graph asks `Accelerator()` (GPU 0) for the compile target; while fusekit builds a graph
    for cuda:N (N > 0) that name gives GPU N (no context on GPU 0, the right architecture on a mixed
    machine); restored after, untouched for the CPU and cuda:0."""
    import max.graph.graph as mg

    from fusekit.backends.mojo.runtime import graph_device

    calls = []

    def fake(*args):
        calls.append(args)
        return args

    monkeypatch.setattr(mg, "Accelerator", fake)
    with graph_device(torch.device("cuda", 1)):
        assert mg.Accelerator() == (1,) and mg.Accelerator(3) == (3,)
    assert mg.Accelerator is fake
    for dev in (torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda")):
        with graph_device(dev):
            assert mg.Accelerator is fake
    assert calls == [(1,), (3,)]


def test_capture_switch_sets_what_auto_and_the_library_see() -> None:
    """By default mojo runs inside a CUDA graph capture (capture_safe) and its first call of a signature is
    refused there (first_call_setup: it compiles); FUSEKIT_MOJO_CAPTURE=0 makes it refuse captures."""
    assert MojoBackend.capture_safe and MojoBackend.first_call_setup
    code = "from fusekit.backends.mojo import MojoBackend as B; print(B.capture_safe, B.first_call_setup)"
    env = {**os.environ, "FUSEKIT_MOJO_CAPTURE": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("where", ["worker thread", "main thread"])
def test_loading_max_on_any_thread_exits_cleanly(where: str) -> None:
    """MAX enters its MLIR context on the thread that first imports it and exits it at interpreter exit on
    the main thread: a backend first loaded by a worker thread printed "Unbalanced Context enter/exit" from
    an atexit hook (fusekit.backends.mojo._import_max balances it). A fresh process loads the backend
    (no compile) on `where` and exits with nothing on stderr."""
    code = (
        "import threading\n"
        "from fusekit import backends\n"
        "f = lambda: print(backends.get('mojo').unavailable_reason())\n"
        + ("t = threading.Thread(target=f); t.start(); t.join()\n" if where == "worker thread" else "f()\n")
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "None"  # the backend loaded
    assert "Unbalanced" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-2000:]


def test_replay_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSEKIT_MOJO_REPLAY: default torch CUDA graphs of the fenced call; "max" MAX's own device graphs; "0" off."""
    from fusekit.backends.mojo.dispatch import REPLAY_ENV, Dispatcher

    monkeypatch.delenv(REPLAY_ENV, raising=False)
    d = Dispatcher()
    assert (d.replay, d.torch_graphs) == (True, True)
    monkeypatch.setenv(REPLAY_ENV, "max")
    d = Dispatcher()
    assert (d.replay, d.torch_graphs) == (True, False)
    monkeypatch.setenv(REPLAY_ENV, "0")
    assert Dispatcher().replay is False


def test_graph_cache_bookkeeping() -> None:
    """A key is captured on its second sighting (the first executes and is noted by _launch), replayed from then
    on, and the least recently used graph is handed back for release when the cache overflows (both graph
    kinds share Dispatcher._keep)."""
    from types import SimpleNamespace

    from fusekit.backends.mojo.dispatch import GRAPH_CACHE, Dispatcher

    class _Graph:
        replays = 0

        def replay(self) -> None:
            self.replays += 1

    d = Dispatcher()
    compiled = SimpleNamespace(graphs={}, seen={}, capturable=True, captures=0, replays=0)

    def capture(c, st, key, bufs):  # a capture that succeeds, without CUDA
        g = _Graph()
        d._keep(c, key, g)
        return g

    d._capture_torch = capture
    assert d._torch_graph_call(compiled, None, ("k",), []) is False and not compiled.graphs
    compiled.seen[("k",)] = None  # what _launch does for the executed first call
    assert d._torch_graph_call(compiled, None, ("k",), []) is True
    g = compiled.graphs[("k",)]
    assert g.replays == 1 and ("k",) not in compiled.seen
    assert d._torch_graph_call(compiled, None, ("k",), []) is True and g.replays == 2
    evicted = [d._keep(compiled, (i,), i) for i in range(GRAPH_CACHE)]
    assert evicted[:-1] == [None] * (GRAPH_CACHE - 1) and evicted[-1] is g  # ("k",) was the oldest
    assert len(compiled.graphs) == GRAPH_CACHE


def test_captures_stop_when_replays_do_not_pay_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys cycled over more than the cache holds (an LRU that never hits) would capture on every call; a
    model stops capturing once it is CAPTURE_CREDIT captures ahead of replays / REPLAYS_PER_CAPTURE, its
    calls then execute, and replays of the graphs it kept earn captures back."""
    from types import SimpleNamespace

    from fusekit.backends.mojo import dispatch
    from fusekit.backends.mojo.dispatch import Dispatcher

    monkeypatch.setattr(dispatch, "GRAPH_CACHE", 4)
    monkeypatch.setattr(dispatch, "CAPTURE_CREDIT", 6)
    monkeypatch.setattr(dispatch, "REPLAYS_PER_CAPTURE", 2)

    class _Graph:
        def replay(self) -> None:
            pass

    d = Dispatcher()
    compiled = SimpleNamespace(graphs={}, seen={}, capturable=True, captures=0, replays=0)

    def capture(c, st, key, bufs):  # a capture that succeeds, without CUDA (_keep returns what it evicts)
        g = _Graph()
        d._keep(c, key, g)
        return g

    d._capture_torch = capture

    def call(key) -> bool:  # run()'s CUDA path without CUDA: replay/capture, else execute and note the key
        if d._torch_graph_call(compiled, None, key, []):
            return True
        compiled.seen[key] = None
        return False

    for i in range(10):  # pointers that never come back after their second call: nothing to replay
        assert call((i,)) is False  # a first sighting executes
        assert call((i,)) is (i < 6)  # the second captures (and replays) while the credit lasts
    assert compiled.captures == 6 and compiled.replays == 0  # the capturing calls' own replays earn nothing
    assert len(compiled.graphs) == 4  # the cache's size: the oldest were evicted unused
    hot = (9,)  # seen twice, no credit left: it executes every time
    assert [call(hot) for _ in range(3)] == [False] * 3 and compiled.captures == 6
    assert (
        all(call((5,)) for _ in range(4)) and compiled.replays == 4
    )  # a kept graph replays: 2 captures earned
    assert call(hot) is True and compiled.captures == 7
    assert all(call(hot) for _ in range(3)) and compiled.captures == 7 and compiled.replays == 7


def test_replay_hot_path_needs_no_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call whose key has a captured torch graph replays it without wrapping a single MAX Buffer (the host
    path per call: no LRU touches, no fence); any other key wraps every argument, in argument order."""
    import threading
    from types import SimpleNamespace

    from fusekit.backends.mojo.dispatch import Dispatcher, arg_key

    class _Graph:
        replays = 0

        def replay(self) -> None:
            self.replays += 1

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    y, x, p = torch.empty(4), torch.ones(4), torch.zeros(2)
    wrapped: list[tuple] = []
    st = SimpleNamespace(
        cuda=True,
        lock=threading.Lock(),
        params_tensor=lambda values: p,
        buffer=lambda key, t: wrapped.append(key) or key,
    )
    g = _Graph()
    key = (arg_key(y), arg_key(x), arg_key(p))
    compiled = SimpleNamespace(
        graphs={key: g},
        seen={},
        capturable=True,
        captures=1,
        replays=0,
        workspaces=(),
        spec=SimpleNamespace(params=("eps",)),
    )
    d = Dispatcher()
    d.run(compiled, st, (y,), (x,), (1e-6,))
    assert g.replays == 1 and wrapped == [] and d.counts["replay"] == 1

    y2 = torch.empty(4)  # another output pointer: not captured, so it is wrapped (and would execute)
    d._torch_graph_call = lambda c, s, k, bufs: bufs == list(k)  # stands in for the first-sighting path
    d.run(compiled, st, (y2,), (x,), (1e-6,))
    assert wrapped == [arg_key(y2), arg_key(x), arg_key(p)] and g.replays == 1


def test_plan_replay_traces_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """PlanReplay (MojoBackend.record): each recorded _call's arguments are traced to the plan's outputs and
    inputs; a later call with new tensors replays exactly the graphs whose keys run() would build (fixed
    dummies and params included), touches nothing when any key is missing, and refuses to be built when one
    tensor sits in two places or an argument is a temporary."""
    import threading
    from types import SimpleNamespace

    from fusekit.backends.mojo import dispatch
    from fusekit.backends.mojo.dispatch import Dispatcher, PlanReplay, arg_key

    class _Graph:
        replays = 0

        def replay(self) -> None:
            self.replays += 1

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    dummy, p = torch.zeros(1), torch.zeros(2)
    st = SimpleNamespace(
        lock=threading.Lock(),
        dummy=lambda marker: dummy,
        params_tensor=lambda v: p,
        sms=4,
        device=torch.device("cpu"),
    )
    spec = SimpleNamespace(params=("eps",))
    model = SimpleNamespace(graphs={}, capturable=True, captures=0, replays=0, workspaces=(), spec=spec)
    y, x, w = torch.empty(4), torch.ones(4), torch.ones(4)
    marker = ("dummy", torch.float32, 1, 3)
    d = Dispatcher()
    calls = [(model, st, (y,), (x, marker, w), (1e-6,))]
    rp = PlanReplay.build(d, calls, (y, None), (x, None, w))
    assert rp is not None

    y2, x2 = torch.empty(4), torch.ones(4)  # a later call: new output and input, same weight
    key = (arg_key(y2), arg_key(x2), arg_key(dummy), arg_key(w), arg_key(p))
    assert rp((y2, None), (x2, None, w)) is False  # nothing captured under that key yet
    g = model.graphs[key] = _Graph()
    assert rp((y2, None), (x2, None, w)) is True and g.replays == 1 and d.counts["replay"] == 1
    assert rp((y, None), (x2, None, w)) is False and g.replays == 1  # another output pointer

    # the same pointers again: the remembered lookup (bare pointers) replays the same graph
    assert len(rp.fast) == 1
    assert rp((y2, None), (x2, None, w)) is True and g.replays == 2 and d.counts["replay"] == 2
    # an evicted graph is forgotten by every PlanReplay at once: this key is gone, so nothing replays
    del model.graphs[key]
    d.forget_replays()
    assert not rp.fast
    assert rp((y2, None), (x2, None, w)) is False and g.replays == 2 and not rp.fast  # nor kept alive
    rp.fast[("stale",)] = ()
    with monkeypatch.context() as m:  # the next capture evicts: every PlanReplay forgets its lookups
        m.setattr(dispatch, "GRAPH_CACHE", 1)
        full = SimpleNamespace(graphs={"old": "g_old"}, seen={}, captures=0)
        assert d._keep(full, "new", "g_new") == "g_old" and not rp.fast
    g2 = model.graphs[key] = _Graph()  # captured again: found through run's key, remembered anew
    assert rp((y2, None), (x2, None, w)) is True and g2.replays == 1 and g.replays == 2

    # a workspace: fresh per call at the size read once, between the outputs and the inputs as run passes it
    sized = SimpleNamespace(
        graphs={}, capturable=True, captures=0, replays=0,
        spec=SimpleNamespace(params=(), max_op="fusekit.toy", workspaces=(SimpleNamespace(name="part"),)),
        workspaces=((torch.float32, lambda outs, ins, sms: 3 * sms), (torch.int32, lambda outs, ins, sms: 0)),
    )  # fmt: skip
    rw = PlanReplay.build(d, [(sized, st, (y,), (x,), ())], (y,), (x,))
    assert rw is not None and rw.allocs == ((12, torch.float32, st.device, sized, 0),)
    seen: list = []
    ws = torch.zeros(12)
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda n, dtype, device: seen.append((n, dtype)) or ws)
        gw = sized.graphs[(arg_key(y), arg_key(ws), arg_key(dummy), arg_key(x))] = _Graph()
        assert rw((y,), (x,)) is True and gw.replays == 1 and seen == [(12, torch.float32)]

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with monkeypatch.context() as m:  # named as run's own workspace allocation names it
        m.setattr(torch, "empty", no_memory)
        with pytest.raises(
            torch.OutOfMemoryError, match=r"fusekit\.toy \(mojo\).*workspace 'part' \(12 x float32"
        ):
            rw((y,), (x,))

    assert PlanReplay.build(d, calls, (y, None), (x, x, w)) is None  # x in two places
    assert PlanReplay.build(d, [(model, st, (torch.empty(4),), (x,), ())], (y,), (x,)) is None  # temporary
    assert PlanReplay.build(d, [], (y,), (x,)) is None


def test_plan_replay_only_where_run_is_only_mojo_calls() -> None:
    """MojoBackend.record hands the plan a PlanReplay only for calls whose `run` is nothing but `_call`s:
    the norms, reduce_sum, rope, attention, and swiglu_ffn's forward on its decode route; never a swiglu_ffn
    prefill forward or backward, nor linear_cross_entropy (torch GEMMs run beside the Mojo ops there)."""
    from fusekit.backends.mojo import MojoBackend
    from fusekit.backends.mojo.specs import SW_TC_MIN_T

    be, cuda = MojoBackend(), torch.device("cuda")
    w = torch.empty(64, 32)
    for op in ("reduce_sum", "rms_norm", "layer_norm", "rope", "attention"):
        assert be.replayable(op, "forward", cuda, (torch.empty(2, 32),))
        assert be.replayable(op, "backward", cuda, ())
    decode, prefill = torch.empty(SW_TC_MIN_T - 1, 32), torch.empty(SW_TC_MIN_T, 32)
    assert be.replayable("swiglu_ffn", "forward", cuda, (decode, w))
    assert not be.replayable("swiglu_ffn", "forward", cuda, (prefill, w))
    assert not be.replayable("swiglu_ffn", "backward", cuda, (decode, w))
    assert not be.replayable("linear_cross_entropy", "forward", cuda, (decode, w))


def test_buffer_cache_shared_by_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU calls share a device's wrapped-buffer LRU without a lock: a hit's lookup and its move to the end
    were two steps, and another thread's insert could evict the key in between (KeyError out of
    ops.<op>(..., backend="mojo")). Eight threads rotating over their own tensors through a small cache,
    with the interpreter switching threads as often as it can: no error, and each buffer views its tensor."""
    import threading

    from fusekit.backends.mojo import dispatch as md

    monkeypatch.setattr(md, "BUFFER_CACHE", 8)
    interval = sys.getswitchinterval()
    st = DeviceState(torch.device("cpu"))
    mine = [[torch.full((4,), float(8 * t + i)) for i in range(6)] for t in range(8)]
    start, errors = threading.Barrier(8), []

    def worker(t: int) -> None:
        start.wait()
        try:
            for i in range(20000):
                x = mine[t][i % 6]
                buf = st.buffer(md.arg_key(x), x)
                if i % 5000 == 0:
                    assert torch.equal(torch.from_dlpack(buf), x)
        except Exception as exc:  # reported below
            errors.append(f"thread {t}: {type(exc).__name__}: {exc!r}")

    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert len(st.buffers) <= 8
