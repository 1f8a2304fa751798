"""kernels_triton._launch: the lean launch path (on by default, FUSEKIT_TRITON_FAST_LAUNCH=0 turns it off).

On the CPU: the binding and keying logic against a real JITFunction whose `run` is replaced by a
recorder (no compile, no launch). On CUDA (--device cuda): every hot op's results with the lean path are
bit-identical to Triton's own launch, for aligned and misaligned inputs and changing decode positions,
and the lean path was actually taken.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402
from triton_fakes import FakeCompiledKernel as _Kernel  # noqa: E402

from kernels_triton import _launch, _raw_launch  # noqa: E402


def _toy(x_ptr, y_ptr, n, start, BLOCK: tl.constexpr = 64, FLAG: tl.constexpr = False):  # noqa: F821
    pass


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch):
    fn = JITFunction(_toy, do_not_specialize=["start"])
    log: list = []

    def run(self, *args, grid, warmup, **kwargs):
        log.append(("run", grid, args, kwargs))
        return _Kernel(log, "fast")

    monkeypatch.setattr(type(fn), "run", run)
    monkeypatch.setattr(_launch, "_stream", lambda device: 0)  # no CUDA stream on the CPU
    fn = _launch.fast_launch(fn)
    _launch.clear()
    yield fn, log
    _launch.clear()


def test_decorated_kernel_is_still_a_jit_function(toy) -> None:
    fn, _ = toy
    assert isinstance(fn, JITFunction) and type(fn).__name__.startswith("Fast")


def test_disabled_takes_tritons_path(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, log = toy
    monkeypatch.setattr(_launch, "ENABLED", False)
    x = torch.zeros(64)
    for _ in range(3):
        fn[(4,)](x, x, 64, 0, BLOCK=64, num_warps=4)
    assert [e[0] for e in log] == ["run"] * 3 and not _launch._CACHE


def test_enabled_remembers_and_binds_in_parameter_order(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, log = toy
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x, y = torch.zeros(64), torch.zeros(64)
    fn[(4,)](x, y, 64, 7, BLOCK=32, num_warps=4)  # first: Triton's run (compiles, launches)
    fn[(4,)](x, y, 64, 8, BLOCK=32, num_warps=4)  # start is do_not_specialize: same kernel
    assert [e[0] for e in log] == ["run", "fast"]
    _, grid, args = log[-1]
    assert grid == (4, 1, 1)
    # every parameter in order: positionals, the BLOCK keyword, FLAG's default; num_warps is an option
    assert args[:4] == (x, y, 64, 8) and args[4:] == (32, False)


def test_a_registered_launch_hook_takes_tritons_runner(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct launch passes no launch metadata and no hooks; while a hook is registered (a profiler)
    the remembered kernel launches through Triton's runner, which calls it."""
    from triton import knobs

    fn, log = toy
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x, y = torch.zeros(64), torch.zeros(64)
    fn[(4,)](x, y, 64, 7)
    fn[(4,)](x, y, 64, 8)
    old = knobs.runtime.launch_enter_hook
    chain = hasattr(old, "add")  # Triton >= 3.6 keeps a HookChain; older ones a callable or None
    if chain:
        old.add(print)
    else:
        knobs.runtime.launch_enter_hook = print
    try:
        fn[(4,)](x, y, 64, 9)
    finally:
        if chain:
            old.remove(print)
        else:
            knobs.runtime.launch_enter_hook = old
    fn[(4,)](x, y, 64, 10)
    assert [e[0] for e in log] == ["run", "fast", "hooked", "fast"]


@pytest.mark.parametrize(
    "change",
    ["misaligned", "dtype", "n_value_1", "n_divisible_by_16", "block", "flag", "grid", "start_past_int32"],
)
def test_anything_triton_specializes_on_takes_the_normal_path(
    toy, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    fn, log = toy
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    base = torch.zeros(80)
    x, y = base[:64], torch.zeros(64)
    call = dict(grid=(4,), args=[x, y, 64 if change != "n_divisible_by_16" else 65, 0], block=64, flag=False)
    fn[call["grid"]](*call["args"], BLOCK=call["block"], FLAG=call["flag"])
    if change == "misaligned":
        call["args"][0] = base[1:65]  # 4-byte offset: no longer 16-byte aligned
    elif change == "dtype":
        call["args"][0] = x.to(torch.float16)
    elif change == "n_value_1":
        call["args"][2] = 1  # Triton specializes an int equal to 1
    elif change == "n_divisible_by_16":
        call["args"][2] = 80  # 65 -> 80: Triton marks a multiple of 16 ("D")
    elif change == "block":
        call["block"] = 128
    elif change == "flag":
        call["flag"] = True  # a constexpr: its value is compiled in
    elif change == "grid":
        call["grid"] = (8,)
    elif change == "start_past_int32":
        call["args"][3] = 2**31  # int64 from here on
    fn[call["grid"]](*call["args"], BLOCK=call["block"], FLAG=call["flag"])
    assert [e[0] for e in log] == ["run", "run"]


def test_runtime_int_keyed_by_specialization_class_not_value(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode kernel's KV length and strides grow by one token per step: a new value of the same
    class (not 1, same divisibility by 16, same 32/64-bit range) reuses the remembered kernel and
    passes the new value at launch."""
    fn, log = toy
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x, y = torch.zeros(64), torch.zeros(64)
    for n in (17, 18, 19, 33, 2047):
        fn[(4,)](x, y, n, 0, BLOCK=64)
    for n in (32, 48, 4096):
        fn[(4,)](x, y, n, 0, BLOCK=64)
    assert [e[0] for e in log] == ["run"] + ["fast"] * 4 + ["run"] + ["fast"] * 2
    assert [e[2][2] for e in log] == [17, 18, 19, 33, 2047, 32, 48, 4096]


@pytest.mark.parametrize("v", [0, 1, 2, 15, 16, -16, -1, 2**31 - 1, 2**31, 2**31 + 16, 2**63, 2**64 - 16])
def test_int_key_separates_what_triton_specializes(v: int) -> None:
    """Two ints share a key only if Triton's own specialization gives them the same type and attributes."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this Triton has no native_specialize_impl to compare with")

    def triton_class(n: int) -> tuple:  # e.g. ("i32", "D"), ("constexpr", 1), ("i64", "")
        return tuple(native_specialize_impl(BaseBackend, n, False, True, True))

    for w in (0, 1, 2, 3, 16, 17, 32, -16, -3, 2**31 - 1, 2**31, 2**31 + 1, 2**40, 2**63, 2**63 + 16):
        same_key = _launch._specialized_key(v) == _launch._specialized_key(w)
        assert same_key == (triton_class(v) == triton_class(w)), (v, w)


@pytest.fixture
def tuned(toy):
    """The toy kernel under triton.autotune with one config (no benchmarking: chosen without timing)."""
    fn, log = toy
    tuner = triton.autotune([triton.Config({"BLOCK": 32}, num_warps=2)], key=["n"])(fn)
    return _launch.fast_tuned(tuner), log


def test_autotuned_kernel_launches_the_chosen_config_lean(tuned, monkeypatch: pytest.MonkeyPatch) -> None:
    """The autotuner chooses on the first call of a key; from the next call the chosen config goes
    through the lean path (its constexprs and options bound as keywords); a new value of a key argument
    (n) goes back to the autotuner, a new value of another int (start) does not."""
    tuner, log = tuned
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x, y = torch.zeros(64), torch.zeros(64)
    grid = lambda m: (64 // m["BLOCK"],)
    for start in (3, 4, 5):
        tuner[grid](x, y, 64, start)
    assert [e[0] for e in log] == ["run", "run", "fast"]
    assert log[0][3]["BLOCK"] == 32 and log[0][3]["num_warps"] == 2 and log[1][3]["BLOCK"] == 32
    assert log[-1][1] == (2, 1, 1) and log[-1][2][:4] == (x, y, 64, 5) and log[-1][2][4] == 32
    tuner[grid](x, y, 48, 6)  # n is the autotuner's key: it chooses again
    assert [e[0] for e in log][3:] == ["run"]


def test_heuristics_under_the_autotuner_are_computed_per_call(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    """autotune(heuristics(kernel)) (swiglu_ffn's prefill GEMMs: EVEN_K from K and the config's BLOCK_K)
    takes the lean path too, each heuristic value computed from the call's arguments and the chosen config
    as Heuristics.run does, so a value that changes with a non-key argument still reaches the kernel."""
    fn, log = toy
    heur = triton.heuristics({"FLAG": lambda a: a["start"] % a["BLOCK"] == 0})(fn)
    tuner = _launch.fast_tuned(triton.autotune([triton.Config({"BLOCK": 32}, num_warps=2)], key=["n"])(heur))
    assert type(tuner).__name__.startswith("Fast")
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    x, y = torch.zeros(64), torch.zeros(64)
    grid = lambda m: (64 // m["BLOCK"],)
    for start in (3, 64, 5, 96):
        tuner[grid](x, y, 64, start)
    kinds = [e[0] for e in log]
    assert kinds[:2] == ["run", "run"] and kinds[-1] == "fast", kinds  # start=64: FLAG flips, a new kernel
    assert log[0][3]["FLAG"] is False and log[0][3]["BLOCK"] == 32
    flags = [e[2][5] if e[0] == "fast" else e[3]["FLAG"] for e in log[1:]]  # FLAG: the 6th parameter
    assert flags == [True, False, True], log


def test_autotuner_with_hooks_keeps_tritons_path(toy) -> None:
    fn, _ = toy
    tuner = triton.autotune([triton.Config({"BLOCK": 32})], key=["n"], reset_to_zero=["y_ptr"])(fn)
    assert _launch.fast_tuned(tuner) is tuner and type(tuner).__name__ == "Autotuner"


# --- CUDA: the real kernels --------------------------------------------------------------------------
def _ops_cases(dev: str):
    from fusekit import ops

    g = torch.Generator(device=dev).manual_seed(0)

    def r(*s, dtype=torch.bfloat16):
        return torch.randn(*s, device=dev, dtype=dtype, generator=g)

    base = r(4 * 4096 + 8)
    x_mis = base[1 : 1 + 4 * 4096].view(4, 4096)  # misaligned rows
    x, w, b, res = r(4, 4096), r(4096), r(4096), r(4, 4096)
    q, kc, vc = r(2, 32, 1, 128), r(2, 8, 1000, 128), r(2, 8, 1000, 128)
    kv_len = torch.tensor([999, 517], device=dev, dtype=torch.int32)
    x1, wg, wu, wd = r(1, 512), r(1024, 512) * 0.05, r(1024, 512) * 0.05, r(512, 1024) * 0.05
    x32, nw = r(32, 512), r(512)
    qp, kp, vp = r(1, 4, 256, 64), r(1, 2, 256, 64), r(1, 2, 256, 64)
    q4 = r(2, 32, 4, 128)
    flat = r(2 * 8 * 1000 * 128 + 1)  # k/v views one element off 16-byte alignment
    km, vm = flat[1:].view(2, 8, 1000, 128), flat[:-1].view(2, 8, 1000, 128)
    # large enough for the Hopper Gluon kernels (4*B*H*S*Skv*D >= 2**34): host descriptors, _raw_launch' maps
    qg, kg, vg = (r(1, h, 2048, 128).requires_grad_() for h in (8, 2, 2))
    dog = r(1, 8, 2048, 128)

    def gluon_pair() -> list[torch.Tensor]:
        o = ops.attention(qg, kg, vg, causal=True, backend="triton")
        return [o.detach(), *torch.autograd.grad(o, (qg, kg, vg), dog)]

    return [
        ("rms_norm", lambda: ops.rms_norm(x, w, backend="triton")),
        ("rms_norm misaligned", lambda: ops.rms_norm(x_mis, w, backend="triton")),
        ("rms_norm residual", lambda: ops.rms_norm(x, w, residual=res, backend="triton")),
        ("layer_norm", lambda: ops.layer_norm(x, w, b, backend="triton")),
        ("rope", lambda: [ops.rope(q.transpose(1, 2), start_pos=p, backend="triton") for p in (5, 6, 2047)]),
        ("attention decode", lambda: ops.attention(q, kc, vc, kv_len=kv_len, backend="triton")),
        ("swiglu_ffn decode (autotuned GEMVs)", lambda: ops.swiglu_ffn(x1, wg, wu, wd, backend="triton")),
        (  # T > 16: the prefill GEMMs (autotune + heuristics pointer kernels, or the TMA kernels) and rstd
            "swiglu_ffn prefill T=32 with norm",
            lambda: ops.swiglu_ffn(x32, wg, wu, wd, norm_weight=nw, backend="triton"),
        ),
        ("attention prefill (autotuned)", lambda: ops.attention(qp, kp, vp, causal=True, backend="triton")),
        (  # a cache grown by one key per step (HF DynamicCache): new Skv and strides, same kernel
            "attention decode grown",
            lambda: [
                ops.attention(q, kc[:, :, :n].contiguous(), vc[:, :, :n].contiguous(), backend="triton")
                for n in (997, 998, 999, 1000, 1008, 1009, 16, 17, 1)
            ],
        ),
        (  # the same through _attention_decode's keyed launches: views of the cache (strides fixed), kv_len,
            # causal with S > 1, a KV length that changes the split count, and misaligned k/v (generic key)
            "attention decode grown views",
            lambda: (
                [
                    ops.attention(q4, kc[:, :, :n], vc[:, :, :n], causal=c, kv_len=kl, backend="triton")
                    for n in (15, 16, 17, 64, 999, 1000)
                    for c, kl in ((False, None), (True, None), (True, kv_len.clamp(max=n)))
                ]
                + [ops.attention(q, km[:, :, :n], vm[:, :, :n], backend="triton") for n in (500, 512)]
            ),
        ),
        ("attention Gluon forward + backward (sm_90)", gluon_pair),
    ]


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (tuple, list)) else []


def test_cuda_results_equal_tritons_launch(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if device != "cuda":
        pytest.skip("needs --device cuda")
    cases = _ops_cases(device)
    monkeypatch.setattr(_launch, "ENABLED", False)
    want = {name: [t.clone() for t in _flat(f())] for name, f in cases}
    monkeypatch.setattr(_launch, "ENABLED", True)
    _launch.clear()
    for name, f in cases:
        for _ in range(3):  # the first call fills the cache, the next ones take the lean path
            got = _flat(f())
            assert len(got) == len(want[name])
            for g_, w_ in zip(got, want[name]):
                assert torch.equal(g_, w_), f"{name}: lean launch changed the result"
    torch.cuda.synchronize()
    assert _launch._CACHE, "the lean path was never taken"
    assert _launch._KEYED, "decode attention's keyed launches were never taken"
    if torch.cuda.get_device_capability()[0] == 9 and triton.__version__.startswith("3.6"):
        assert _raw_launch._MAPS, "the Gluon launches never reused encoded maps (kernels_triton._raw_launch)"


def test_host_descriptor_key_holds_its_whole_type() -> None:
    """A host TensorDescriptor argument keys the remembered kernel by its dtype, block shape and layout (its
    type in Triton's signature): a bf16 call must never reuse the kernel compiled for fp16 descriptors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    a16 = torch.zeros(64, 64, dtype=torch.float16)
    abf = torch.zeros(64, 64, dtype=torch.bfloat16)
    key = _launch._arg_key
    d = TensorDescriptor(a16, [64, 64], [64, 1], [16, 16])
    assert key(d) == key(TensorDescriptor(a16.clone(), [32, 64], [64, 1], [16, 16]))  # shape: a runtime value
    assert key(d) != key(TensorDescriptor(abf, [64, 64], [64, 1], [16, 16]))
    assert key(d) != key(TensorDescriptor(a16, [64, 64], [64, 1], [32, 16]))


def test_tensor_key_holds_the_storage_class_on_amd(monkeypatch) -> None:
    """On AMD Triton specializes a tensor whose storage is under 2 GiB (buffer loads, 32-bit offsets): a
    kernel remembered for a 128 MiB bf16 tensor must not run on a 4 GiB one of the same dtype and alignment
    (reduce_sum's key was equal for both: its offsets past 2 GiB wrapped). On NVIDIA the class is not
    specialized, so it is not keyed. The large storage is only reserved, never touched."""
    small = torch.empty(64, dtype=torch.bfloat16)
    big = torch.empty(2**30 + 64, dtype=torch.bfloat16)  # 2 GiB + 128 bytes
    monkeypatch.setattr(_launch, "HIP_STORAGE_KEY", False)
    assert _launch._arg_key(small) == _launch._arg_key(big)
    monkeypatch.setattr(_launch, "HIP_STORAGE_KEY", True)
    assert _launch._arg_key(small) != _launch._arg_key(big)
    assert _launch._arg_key(small) == _launch._arg_key(torch.empty(2**20, dtype=torch.bfloat16))


# Triton 3.6's wrap_handle_tensordesc and CudaLauncher.__call__ (triton/backends/nvidia/driver.py), the
# shapes _raw_launch.raw_launcher recognises
_DRIVER_36 = """
_BASE_ARGS_FORMAT_LEN = 13


def wrap_handle_tensordesc(launcher, signature, tensordesc_meta):
    has_tensor_desc_arg = any(isinstance(sig, str) and sig.startswith("tensordesc") for sig in signature.values())
    if not has_tensor_desc_arg:
        return launcher

    tensordesc_indices = set(
        [i for i, sig in enumerate(signature.values()) if isinstance(sig, str) and sig.startswith("tensordesc")])
    if not tensordesc_meta:
        tensordesc_meta = [None] * len(tensordesc_indices)

    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner


class CudaLauncher(object):
    def __init__(self, launch, signature, tensordesc_meta, scratch):
        self.launch = wrap_handle_tensordesc(launch, signature, tensordesc_meta)
        self.global_scratch_size = self.profile_scratch_size = scratch
        self.launch_cooperative_grid = self.launch_pdl = False

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None,
                    None, *args)
"""


class _Desc:
    """Stands in for a host TensorDescriptor: what make_tensordesc_arg reads."""

    def __init__(self, t: torch.Tensor, block: list[int]) -> None:
        self.base, self.shape, self.strides, self.padding = t, list(t.shape), list(t.stride()), "zero"
        self.block_shape = block


@pytest.fixture
def driver36(monkeypatch: pytest.MonkeyPatch):
    """A module laid out as Triton 3.6's CUDA driver; make_launcher(metas, scratch, descriptors) gives a
    CudaLauncher over a recording C launch, plus the lists of encoded pointers and launches."""
    import sys
    import types

    mod = types.ModuleType("fake_triton36_driver")
    encoded: list = []

    def make_tensordesc_arg(arg, metadata):
        if metadata is None:
            return [arg.base, *arg.shape, *arg.strides]
        encoded.append(arg.base.data_ptr())
        return [("map", arg.base.data_ptr(), metadata["swizzle"]), *arg.shape, *arg.strides]

    mod.make_tensordesc_arg = make_tensordesc_arg
    exec(_DRIVER_36, mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)

    class CLaunch(list):
        """The compiled C launch (a builtin: no __code__), recording its arguments."""

        def __call__(self, *args) -> None:
            self.append(args)

    def make_launcher(metas, scratch: int = 0, descriptors: bool = True):
        launched = CLaunch()
        d = "tensordesc<bf16[64, 64]>" if descriptors else "*bf16"
        sig = {"a": d, "n": "i32", "b": d, "X": "constexpr"}
        launcher = mod.CudaLauncher(launched, sig, metas, scratch)
        return launcher, launched

    return make_launcher, encoded


def test_raw_launch_expands_as_tritons_wrapper_and_reuses_maps(driver36) -> None:
    make_launcher, encoded = driver36
    _raw_launch.clear()
    launcher, launched = make_launcher([{"swizzle": 128}, {"swizzle": 64}])
    got = _raw_launch.raw_launcher(launcher)
    assert got is not None and got[1] is not None
    c_launch, expand = got
    x, y = torch.zeros(4, 64), torch.zeros(8, 64)
    args = (_Desc(x, [64, 64]), 7, _Desc(y, [64, 64]), 3)
    launcher(1, 2, 3, 0, "fn", "meta", None, None, None, *args)  # Triton's own path: what the C launch gets
    want = launched[-1]
    encoded.clear()
    c_launch(1, 2, 3, 0, "fn", False, False, None, None, "meta", None, None, None, *expand(args))
    assert launched[-1] == want and len(encoded) == 2
    assert expand((_Desc(x, [64, 64]), 9, _Desc(y, [64, 64]), 3))[5] == 9  # map, 2 dims, 2 strides, then n
    assert len(encoded) == 2, "same pointers, shapes, strides: the maps are reused"
    z = torch.zeros(8, 64)  # another address: encoded again
    expand((_Desc(x, [64, 64]), 7, _Desc(z, [64, 64]), 3))
    assert encoded[-1] == z.data_ptr() and len(encoded) == 3
    expand((_Desc(x[:2], [64, 64]), 7, _Desc(z, [64, 64]), 3))  # same pointer, another shape
    assert len(encoded) == 4
    _raw_launch.clear()


def test_raw_launch_without_descriptors_is_the_c_function(driver36) -> None:
    make_launcher, _ = driver36
    launcher, launched = make_launcher(None, descriptors=False)
    c_launch, expand = _raw_launch.raw_launcher(launcher)
    assert expand is None
    x = torch.zeros(4)
    launcher(1, 2, 3, 0, "fn", "meta", None, None, None, x, 7, x, 3)
    want = launched[-1]
    c_launch(1, 2, 3, 0, "fn", False, False, None, None, "meta", None, None, None, x, 7, x, 3)
    assert len(launched[-1]) == len(want) and all(a is b or a == b for a, b in zip(launched[-1], want))


def test_raw_launch_leaves_other_launchers_to_triton(driver36) -> None:
    make_launcher, encoded = driver36
    assert (
        _raw_launch.raw_launcher(make_launcher([{"swizzle": 128}, {"swizzle": 64}], scratch=256)[0]) is None
    )
    assert _raw_launch.raw_launcher(lambda *a: None) is None

    class CudaLauncher:  # a newer Triton's: __call__ takes the metadata and hooks by name
        launch = staticmethod(lambda *a: None)
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        def __call__(
            self, gx, gy, gz, stream, function, kernel_metadata, launch_metadata, enter, exit_, *args
        ):
            pass

    assert _raw_launch.raw_launcher(CudaLauncher()) is None
    launcher, launched = make_launcher(None)  # no metadata: nothing encoded, nothing remembered
    _, expand = _raw_launch.raw_launcher(launcher)
    x = torch.zeros(4, 64)
    args = (_Desc(x, [64, 64]), 7, _Desc(x, [64, 64]), 3)
    launcher(1, 2, 3, 0, "fn", "meta", None, None, None, *args)
    got = expand(args)
    assert len(got) == len(launched[-1]) - 13 and all(a is b for a, b in zip(got, launched[-1][13:]))
    assert not _raw_launch._MAPS and not encoded
