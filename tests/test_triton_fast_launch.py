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

from kernels_triton import _launch  # noqa: E402


def _toy(x_ptr, y_ptr, n, start, BLOCK: tl.constexpr = 64, FLAG: tl.constexpr = False):  # noqa: F821
    pass


class _Kernel:
    """Stands in for a CompiledKernel: `kernel[grid]` returns a runner that records its arguments."""

    function = packed_metadata = None

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, *a) -> None:  # presence checked by the launcher
        raise AssertionError("not called directly")

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("fast", grid, args))


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch):
    fn = JITFunction(_toy, do_not_specialize=["start"])
    log: list = []

    def run(self, *args, grid, warmup, **kwargs):
        log.append(("run", grid, args, kwargs))
        return _Kernel(log)

    monkeypatch.setattr(type(fn), "run", run)
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


@pytest.mark.parametrize(
    "change",
    ["misaligned", "dtype", "n_value_1", "block", "grid", "start_past_int32"],
)
def test_anything_triton_specializes_on_takes_the_normal_path(
    toy, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    fn, log = toy
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    base = torch.zeros(80)
    x, y = base[:64], torch.zeros(64)
    call = dict(grid=(4,), args=[x, y, 64, 0], block=64)
    fn[call["grid"]](*call["args"], BLOCK=call["block"])
    if change == "misaligned":
        call["args"][0] = base[1:65]  # 4-byte offset: no longer 16-byte aligned
    elif change == "dtype":
        call["args"][0] = x.to(torch.float16)
    elif change == "n_value_1":
        call["args"][2] = 1  # Triton specializes an int equal to 1
    elif change == "block":
        call["block"] = 128
    elif change == "grid":
        call["grid"] = (8,)
    elif change == "start_past_int32":
        call["args"][3] = 2**31  # int64 from here on
    fn[call["grid"]](*call["args"], BLOCK=call["block"])
    assert [e[0] for e in log] == ["run", "run"]


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
    return [
        ("rms_norm", lambda: ops.rms_norm(x, w, backend="triton")),
        ("rms_norm misaligned", lambda: ops.rms_norm(x_mis, w, backend="triton")),
        ("rms_norm residual", lambda: ops.rms_norm(x, w, residual=res, backend="triton")),
        ("layer_norm", lambda: ops.layer_norm(x, w, b, backend="triton")),
        ("rope", lambda: [ops.rope(q.transpose(1, 2), start_pos=p, backend="triton") for p in (5, 6, 2047)]),
        ("attention decode", lambda: ops.attention(q, kc, vc, kv_len=kv_len, backend="triton")),
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
