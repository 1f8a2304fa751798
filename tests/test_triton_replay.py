"""kernels_triton._replay: recording a call's lean launches and replaying them with new pointers.

On the CPU: a real JITFunction whose launches are stood in for by a recorder (as in
test_triton_fast_launch.py), driven by toy "launchers" that do what real ones do (views, workspaces,
torch ops, a cached tensor), so each rule of the module doc is checked. On CUDA (--device cuda): the
hot ops replayed through the library are bit-identical to Triton's own launch path.
"""

from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402
from triton_fakes import FakeCompiledKernel as _Kernel  # noqa: E402

from kernels_triton import _launch, _replay  # noqa: E402


def _toy(x_ptr, y_ptr, n, eps, BLOCK: tl.constexpr = 64):  # noqa: F821
    pass


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch):
    log: list = []

    def run(self, *args, grid, warmup, **kwargs):
        log.append(("run", grid, args))
        return _Kernel(log)

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_stream", lambda device: 0)  # no CUDA stream on the CPU
    fn = _launch.fast_launch(JITFunction(_toy))
    _launch.clear()
    yield fn, log
    _launch.clear()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _io(n: int = 64):
    x = torch.randn(2, n)
    return (torch.empty(2, n),), (x, torch.randn(n))


def _warm_and_record(fn, log, launcher, outs, ins):
    launcher(outs, ins)  # fills the lean path's cache (a "run" entry)
    replay = _replay.record(lambda: launcher(outs, ins), outs, ins)
    log.clear()
    return replay


def test_replay_reissues_launches_with_new_pointers(toy) -> None:
    fn, log = toy

    def launcher(outs, ins):
        (y,), (x, w) = outs, ins
        fn[(2,)](x, y, x.shape[1], 1e-6, BLOCK=64)
        fn[(2,)](x[1], w, 7, 0.5, BLOCK=64)  # a view of an input (row 1), a second kernel launch

    outs, ins = _io()
    replay = _warm_and_record(fn, log, launcher, outs, ins)
    assert replay is not None
    outs2, ins2 = _io()
    assert replay(outs2, ins2) is True
    (y2,), (x2, w2) = outs2, ins2
    assert log == [
        ("launch", (2, 1, 1), (_ptr(x2), _ptr(y2), 64, 1e-6, 64)),
        ("launch", (2, 1, 1), (_ptr(x2) + 64 * 4, _ptr(w2), 7, 0.5, 64)),
    ]


def test_workspace_is_allocated_fresh(toy) -> None:
    fn, log = toy

    def launcher(outs, ins):
        (y,), (x, _) = outs, ins
        part = torch.empty(16, dtype=torch.float32)
        fn[(2,)](x, part, 16, 1.0, BLOCK=64)
        fn[(2,)](part[4:], y, 16, 1.0, BLOCK=64)

    outs, ins = _io()
    replay = _warm_and_record(fn, log, launcher, outs, ins)
    assert replay is not None and replay(*_io())
    (_, _, a1), (_, _, a2) = log
    assert a1[1] + 16 == a2[0]  # the same fresh workspace, the view's offset kept
    assert a1[1] not in (_ptr(outs[0]), _ptr(ins[0]))


class _Desc:  # stands in for a host-side tensor descriptor: holds a pointer of this call
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def data_ptr(self) -> int:
        return self.t.data_ptr()


@pytest.mark.parametrize(
    "what", ["torch_op", "host_read", "cached_tensor", "miss", "aliased_views", "same_object", "descriptor"]
)
def test_unrecordable_calls_keep_the_normal_path(toy, what: str) -> None:
    fn, log = toy
    cached = torch.randn(64)

    def launcher(outs, ins):
        (y,), (x, w) = outs, ins
        if what == "torch_op":
            y.zero_()  # work a replay would skip
        if what == "host_read":
            n = int(w[0] > 0)  # a value read on the host: the launch could depend on it
            fn[(2,)](x, y, 64 + n - n, 1.0, BLOCK=64)
            return
        if what == "cached_tensor":
            fn[(2,)](cached, y, 64, 1.0, BLOCK=64)
            return
        if what == "miss":
            fn[(3,)](x, y, 64, 1.0, BLOCK=64)  # a new grid: not in the cache, compiled on this call
            return
        if what == "aliased_views":
            fn[(2,)](x.view(-1)[64:], y, 64, 1.0, BLOCK=64)
            return
        if what == "descriptor":
            fn[(2,)](_Desc(x), y, 64, 1.0, BLOCK=64)
            return
        fn[(2,)](x, y, 64, 1.0, BLOCK=64)

    outs, ins = _io()
    if what == "miss":
        fn[(2,)](ins[0], outs[0], 64, 1.0, BLOCK=64)
        assert _replay.record(lambda: launcher(outs, ins), outs, ins) is None
        return
    if what == "aliased_views":  # w is a view into x's buffer: x.view(-1)[64:] lies in both
        base = torch.randn(2 * 64)
        ins = (base.view(2, 64), base[64:])
    if what == "same_object":  # attention(x, x, x): recorded as "input 0" it would replay input 0 for w too
        ins = (ins[0], ins[0])
    assert _warm_and_record(fn, log, launcher, outs, ins) is None


def test_mm_step_is_replayed_at_the_new_pointers(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.mm(a, b, out=c) in a recorded call (swiglu_ffn's vendor down GEMM) is replayed in order with
    the launches, over the new call's input, a view of an input (w.t()) and a fresh workspace."""
    fn, log = toy
    real_mm = torch.mm

    def spy(a, b, *, out):
        log.append(("mm", a.data_ptr(), tuple(a.shape), b.data_ptr(), tuple(b.stride()), out.data_ptr()))
        return real_mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", spy)

    def launcher(outs, ins):
        (y,), (x, w) = outs, ins
        h = torch.empty(2, 64)  # a workspace the first kernel writes and the mm reads
        fn[(2,)](x, h, 64, 1.0, BLOCK=64)
        torch.mm(h[:, :32], w.view(2, 32).t(), out=y[:, :2])
        torch.mm(x, w.view(64, 1), out=y[:, 2:3])
        fn[(2,)](y, y, 64, 2.0, BLOCK=64)

    outs, ins = _io()
    replay = _warm_and_record(fn, log, launcher, outs, ins)
    assert replay is not None, _replay.last_refusal
    outs2, ins2 = _io()
    assert replay(outs2, ins2) is True
    (y2,), (x2, w2) = outs2, ins2
    (l1, m1, m2, l2) = log
    assert l1[0] == "launch" and l2 == ("launch", (2, 1, 1), (_ptr(y2), _ptr(y2), 64, 2.0, 64))
    h_ptr = l1[2][1]
    assert h_ptr not in (_ptr(x2), _ptr(y2), _ptr(outs[0]))  # fresh, not the recorded call's
    assert m1 == ("mm", h_ptr, (2, 32), _ptr(w2), (1, 32), _ptr(y2))
    assert m2 == ("mm", _ptr(x2), (2, 64), _ptr(w2), (1, 1), _ptr(y2) + 2 * 4)
    # not bit for bit: the CPU BLAS's summation order may depend on the pointers' alignment
    torch.testing.assert_close(y2[:, 2], (x2 @ w2).view(2), rtol=1e-5, atol=1e-5)


def _silu_mul(g_ptr, u_ptr, h_ptr, T, F, IN_GU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):  # noqa: F821
    pass


class _Decided(dict):
    """swiglu_ffn's _CHOICE with every key decided on the vendor steps (no choosing call, no pointer kernel)."""

    def get(self, key, default=None):
        return "blas"


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_swiglu_ffn_vendor_gate_up_is_replayed(toy, monkeypatch: pytest.MonkeyPatch, train: bool) -> None:
    """swiglu_ffn with both steps decided on "blas": gate mm, up mm, the element-wise launch, down mm. It is
    recorded and replayed in that order at the new call's pointers: g in h and u in a fresh workspace
    (inference) or both in gu's halves (training: row stride 2F); h, a fresh workspace, is what the launch
    writes and the down mm reads."""
    import kernels_triton.swiglu_ffn as ffn

    _, log = toy
    # a JITFunction with the real kernel's signature (under the interpreter the kernel is none), its
    # launches stood in for by the toy runner
    assert (
        inspect.signature(_silu_mul).parameters.keys()
        == inspect.signature(ffn._silu_mul_kernel.fn).parameters.keys()
    )
    kern = _launch.fast_launch(JITFunction(_silu_mul, do_not_specialize=["T"]))
    monkeypatch.setattr(ffn, "_silu_mul_kernel", kern)
    monkeypatch.setattr(ffn, "_CHOICE", _Decided())
    real_mm = torch.mm

    def spy(a, b, *, out):
        log.append(("mm", a.data_ptr(), b.data_ptr(), tuple(b.stride()), out.data_ptr(), tuple(out.stride())))
        return real_mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", spy)
    T, D, F = 20, 32, 48

    def io(seed: int):
        g = torch.Generator().manual_seed(seed)
        x, wg, wu = (
            torch.randn(T, D, generator=g),
            torch.randn(F, D, generator=g),
            torch.randn(F, D, generator=g),
        )
        ins = tuple(t.half() for t in (x, wg, wu, torch.randn(D, F, generator=g)))
        gu = torch.full((T, 2 * F), float("nan"), dtype=torch.float16) if train else None
        return (torch.empty(T, D, dtype=torch.float16), None, gu), ins

    def launcher(outs, ins):
        ffn.forward(outs[0], None, outs[2], *ins, None, 1e-6)

    outs, ins = io(0)
    replay = _warm_and_record(kern, log, launcher, outs, ins)
    assert replay is not None, _replay.last_refusal
    outs2, ins2 = io(1)
    assert replay(outs2, ins2) is True
    (y2, _, gu2), (x2, wg2, wu2, wd2) = outs2, ins2
    (m_g, m_u, (what, grid, args), m_d) = log
    assert what == "launch" and grid[0] == ffn._ew_grid(T, F, *ffn._ew_tile(T, F, 2, 0)[:2])[0]
    g_ptr, u_ptr, h_ptr, t, f = args[:5]
    assert (t, f) == (T, F)
    if train:
        assert (g_ptr, u_ptr) == (_ptr(gu2), _ptr(gu2) + F * 2)
        ld = (2 * F, 1)
        # the new call's products, in place (within an ulp: the CPU BLAS's order may depend on alignment)
        torch.testing.assert_close(gu2[:, :F], real_mm(x2, wg2.t()), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(gu2[:, F:], real_mm(x2, wu2.t()), rtol=1e-3, atol=1e-3)
    else:
        ld = (F, 1)
        recorded = {a.data_ptr() for a in (*outs, *ins) if a is not None}
        assert g_ptr == h_ptr != u_ptr and not {h_ptr, u_ptr} & recorded  # fresh workspaces, g in h
    assert m_g == ("mm", _ptr(x2), _ptr(wg2), (1, D), g_ptr, ld)
    assert m_u == ("mm", _ptr(x2), _ptr(wu2), (1, D), u_ptr, ld)
    assert m_d == ("mm", h_ptr, _ptr(wd2), (1, F), _ptr(y2), (D, 1))
    assert h_ptr not in {_ptr(t) for t in (*outs2, *ins2) if t is not None}


def test_alignment_change_falls_back(toy) -> None:
    fn, log = toy

    def launcher(outs, ins):
        (y,), (x, _) = outs, ins
        fn[(2,)](x, y, 64, 1.0, BLOCK=64)

    outs, ins = _io()
    replay = _warm_and_record(fn, log, launcher, outs, ins)
    buf = torch.randn(2 * 64 + 1)
    misaligned = (buf[1:].view(2, 64), ins[1])  # 4-byte offset: Triton would pick another kernel
    assert replay(outs, misaligned) is False and not log


def test_nested_record_is_part_of_the_outer_one(toy) -> None:
    """A recorded call that records again inside (a launcher calling another planned op) neither hangs
    on the lock nor truncates the outer recording: the inner launches belong to the outer replay."""
    fn, log = toy

    def inner(outs, ins):
        (y,), (x, _) = outs, ins
        fn[(2,)](x, y, 64, 2.0, BLOCK=64)

    inner_results = []

    def outer(outs, ins):
        (y,), (x, w) = outs, ins
        fn[(2,)](x, y, 64, 1.0, BLOCK=64)
        inner_results.append(_replay.record(lambda: inner(outs, ins), outs, ins))
        fn[(2,)](w, y, 64, 3.0, BLOCK=64)

    outs, ins = _io()
    replay = _warm_and_record(fn, log, outer, outs, ins)
    assert inner_results[-1] is None  # inside the outer recording: not recorded on its own
    assert replay is not None and replay(*_io())
    assert [a[2][3] for a in log] == [1.0, 2.0, 3.0]


def test_replay_calls_the_c_launch_inline(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the lean path calls Triton 3.6's compiled C launch (_raw_launch), the generated replay calls it
    itself with the launch's constants (grid, function, flags, metadata) and one current-stream lookup; with
    a launch hook registered it takes the runners, so the hook still sees every launch."""
    fn, log = toy
    from triton import knobs

    class _C:  # the compiled launcher object: its flags, and the C launch raw_launcher hands back
        launch_cooperative_grid, launch_pdl = False, True

    def c_launch(gx, gy, gz, stream, function, coop, pdl, gs, ps, md, lm, enter, exit_, *args) -> None:
        assert (gs, ps, lm, enter, exit_) == (None, None, None, None, None)
        log.append(("c", (gx, gy, gz), stream, coop, pdl, args))

    monkeypatch.setattr(_launch, "RAW", True)
    monkeypatch.setattr(_launch, "raw_launcher", lambda run: (c_launch, None))
    monkeypatch.setattr(_launch, "_stream", lambda device: 7)
    monkeypatch.setattr(_Kernel, "run", _C())
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)

    def launcher(outs, ins):
        (y,), (x, w) = outs, ins
        fn[(2,)](x, y, x.shape[1], 1e-6, BLOCK=64)
        fn[(3,)](w, y, 5, 0.5, BLOCK=64)

    outs, ins = _io()
    replay = _warm_and_record(fn, log, launcher, outs, ins)
    assert replay is not None and "l0" in replay.__code__.co_names
    outs2, ins2 = _io()
    assert replay(outs2, ins2) is True
    (y2,), (x2, w2) = outs2, ins2
    assert log == [
        ("c", (2, 1, 1), 7, False, True, (_ptr(x2), _ptr(y2), 64, 1e-6, 64)),
        ("c", (3, 1, 1), 7, False, True, (_ptr(w2), _ptr(y2), 5, 0.5, 64)),
    ]
    log.clear()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # a profiler's hook
    assert replay(outs2, ins2) is True
    assert [e[0] for e in log] == ["hooked", "hooked"]


@pytest.mark.usefixtures("toy")
def test_disabled_lean_path_never_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "ENABLED", False)
    outs, ins = _io()
    ran = []
    assert _replay.record(lambda: ran.append(1), outs, ins) is None and ran == [1]


# --- CUDA: the real hot ops through the library --------------------------------------------------
def test_cuda_replayed_results_equal_normal_launch(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if device != "cuda":
        pytest.skip("needs --device cuda")
    import fusekit
    from fusekit import library
    from fusekit.backends import triton as tb

    g = torch.Generator(device=device).manual_seed(0)

    def r(*s):
        return torch.randn(*s, device=device, dtype=torch.bfloat16, generator=g)

    x, w, b, res = r(4, 4096), r(4096), r(4096), r(4, 4096)
    q, kc, vc = r(2, 32, 1, 128), r(2, 8, 1000, 128), r(2, 8, 1000, 128)
    kv_len = torch.tensor([999, 517], device=device, dtype=torch.int32)
    xs, wg, wu, wd = r(128, 1024) * 0.5, r(2816, 1024) * 0.03, r(2816, 1024) * 0.03, r(1024, 2816) * 0.02
    ops = fusekit.ops
    cases = {
        "rms_norm": lambda: ops.rms_norm(x, w, backend="triton"),
        "rms_norm residual": lambda: ops.rms_norm(x, w, residual=res, backend="triton"),
        "layer_norm": lambda: ops.layer_norm(x, w, b, backend="triton"),
        "rope": lambda: ops.rope(q.transpose(1, 2), start_pos=5, backend="triton"),
        "attention decode": lambda: ops.attention(q, kc, vc, kv_len=kv_len, backend="triton"),
        "reduce_sum": lambda: ops.reduce_sum(x.float(), backend="triton"),
        # prefill GEMMs; the down GEMM may be the vendor one (torch.mm, replayed as an mm step)
        "swiglu_ffn prefill": lambda: ops.swiglu_ffn(xs, wg, wu, wd, backend="triton"),
    }

    def flat(o):
        return [o] if isinstance(o, torch.Tensor) else [t for p in o for t in flat(p)]

    monkeypatch.setattr(tb, "REPLAY", False)
    library.clear_plans()
    want = {k: [t.clone() for t in flat(f())] for k, f in cases.items()}
    monkeypatch.setattr(tb, "REPLAY", True)
    library.clear_plans()
    for k, f in cases.items():
        for _ in range(6):  # call 1 plans, calls 2..4 record, the rest replay
            got = flat(f())
            assert all(torch.equal(a, b_) for a, b_ in zip(got, want[k])), f"{k}: replay changed the result"
    replayed = [p for p in library._PLANS.values() if p.replay is not None]
    assert replayed, "no plan recorded a replay"


def test_cuda_one_object_in_two_slots_never_replays_for_distinct_ones(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signature recorded while one tensor filled two slots (attention(x, x, x), residual=x, bias is
    weight) replayed "input 0" for both on later calls with distinct tensors; such a call is not recorded."""
    if device != "cuda":
        pytest.skip("needs --device cuda (the CPU rule: test_unrecordable_calls_keep_the_normal_path)")
    from fusekit import library, ops
    from fusekit.backends import triton as tb

    g = torch.Generator(device=device).manual_seed(1)

    def r(*s):
        return torch.randn(*s, device=device, dtype=torch.float16, generator=g)

    x, w, q = r(4, 64), r(64), r(1, 2, 8, 64)
    cases = {  # the call, and inputs with one object in two slots
        "attention q=k=v": (lambda a, b, c: ops.attention(a, b, c, backend="triton"), (q, q, q)),
        "rms_norm residual=x": (lambda a, b, c: ops.rms_norm(a, c, residual=b, backend="triton"), (x, x, w)),
        "layer_norm bias=weight": (lambda a, b, c: ops.layer_norm(a, b, c, backend="triton"), (x, w, w)),
    }
    for name, (f, aliased) in cases.items():
        fresh = [r(*t.shape) for t in aliased]
        monkeypatch.setattr(tb, "REPLAY", False)
        library.clear_plans()
        want = f(*fresh)
        want = [t.clone() for t in (want if isinstance(want, tuple) else (want,))]
        monkeypatch.setattr(tb, "REPLAY", True)
        library.clear_plans()
        f(*[r(*t.shape) for t in aliased])  # call 1 plans
        for _ in range(3):  # calls 2..4 would record
            f(*aliased)
        got = f(*fresh)
        got = got if isinstance(got, tuple) else (got,)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{name}: replayed the aliased recording"
