"""`backend="auto"` per op and shape class (issue 11): the class rule, the generated ranking table,
CUDA graph capture safety and the resolution cache. CPU only: backends are stand-ins and CUDA's
availability and capture state are monkeypatched (a "cuda" device object needs no GPU to resolve)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from fusekit import backends, dispatch, ops
from fusekit.backends.base import Backend
from fusekit.bench import auto_table

CUDA = torch.device("cuda")
BF16 = (torch.bfloat16, torch.bfloat16)


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("op", "inputs", "expected"),
    [
        ("rms_norm", (meta(16, 4096), None, meta(4096)), "decode"),
        ("rms_norm", (meta(17, 4096), None, meta(4096)), "small"),
        ("rms_norm", (meta(1023, 4096), None, meta(4096)), "large"),  # exactly 8 MiB of inputs
        ("rms_norm", (meta(1022, 4096), None, meta(4096)), "small"),
        ("layer_norm", (meta(1, 8), None, meta(8), meta(8)), "decode"),
        ("rope", (meta(2, 8, 32, 128), None, None, None), "decode"),  # B*S = 16
        ("rope", (meta(1, 17, 32, 128), None, None, None), "small"),
        ("rope", (meta(1, 1024, 32, 128), None, None, None), "large"),
        ("swiglu_ffn", (meta(16, 4096), meta(14336, 4096), meta(14336, 4096)), "decode"),
        ("swiglu_ffn", (meta(17, 64), meta(128, 64), meta(128, 64)), "small"),
        ("swiglu_ffn", (meta(17, 4096), meta(14336, 4096), meta(14336, 4096)), "large"),
        ("attention", (meta(64, 32, 16, 128), meta(64, 8, 4096, 128), meta(64, 8, 4096, 128)), "decode"),
        ("attention", (meta(1, 32, 17, 128), meta(1, 8, 17, 128), meta(1, 8, 17, 128)), "small"),
        ("reduce_sum", (meta(1, dtype=torch.uint8),), "small"),  # bytes only: never "decode"
        ("reduce_sum", (meta((8 << 20) - 1, dtype=torch.uint8),), "small"),
        ("reduce_sum", (meta(8 << 20, dtype=torch.uint8),), "large"),
    ],
)
def test_shape_class_boundaries(op: str, inputs: tuple, expected: str) -> None:
    assert dispatch.shape_class(op, inputs) == expected


class Fake(Backend):
    """Stands in for an installed backend; `no_backward` / `no_forward` refuse that phase."""

    def __init__(self, name: str, no_backward: bool = False) -> None:
        super().__init__()
        self.name, self.no_backward, self.no_forward = name, no_backward, False
        self.capture_safe = name != "mojo"  # mojo as it declares itself with FUSEKIT_MOJO_CAPTURE=0

    def supports(self, op, phase, device, dtypes, **meta) -> str | None:
        if self.no_forward and phase == "forward":
            return "no forward"
        return "no backward" if self.no_backward and phase == "backward" else None


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, Fake]:
    made = {name: Fake(name) for name in backends.names()}
    for name, b in made.items():
        monkeypatch.setitem(backends._INSTANCES, name, b)
    monkeypatch.delenv("FUSEKIT_BACKEND", raising=False)
    monkeypatch.delenv("FUSEKIT_BACKEND_RMS_NORM", raising=False)
    monkeypatch.setattr(
        dispatch,
        "AUTO_CLASSES",
        {"cuda": {"rms_norm": {"decode": ("mojo", "triton", "torch"), "large": ("torch", "triton", "mojo")}}},
    )
    dispatch.clear_cache()
    yield made
    dispatch.clear_cache()


def capturing(monkeypatch: pytest.MonkeyPatch, flag: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: flag)


def test_table_lookup_picks_per_class(fakes, monkeypatch) -> None:
    capturing(monkeypatch, False)
    pick = lambda cls: dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class=cls).name
    assert pick("decode") == "mojo"
    assert pick("large") == "torch"
    assert pick("small") == "triton"  # not in the table: the op's default order
    assert pick(None) == "triton"
    # the CPU always runs the torch backend under auto
    assert (
        dispatch.resolve("rms_norm", "auto", torch.device("cpu"), BF16, shape_class="decode").name == "torch"
    )


def test_cache_keys_separate_classes(fakes, monkeypatch) -> None:
    capturing(monkeypatch, False)
    a = dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode")
    b = dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="large")
    assert (a.name, b.name) == ("mojo", "torch")
    classes = {k[5] for k in dispatch._cache if k[0] == "rms_norm"}
    assert classes == {"decode", "large"}
    assert dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode") is a  # a cache hit


def test_capture_skips_backends_that_refuse_it(fakes, monkeypatch) -> None:
    capturing(monkeypatch, True)
    assert dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode").name == "triton"
    # the choice made in a capture is not reused outside one, nor the other way round
    capturing(monkeypatch, False)
    assert dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode").name == "mojo"
    capturing(monkeypatch, True)
    assert dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode").name == "triton"
    # an explicit choice is the caller's: not filtered (the provider itself refuses in a capture)
    assert dispatch.resolve("rms_norm", "mojo", CUDA, BF16, shape_class="decode").name == "mojo"
    # the backend's capture_safe attribute decides
    fakes["triton"].capture_safe = False
    dispatch.clear_cache()
    assert dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode").name == "torch"
    fakes["torch"].capture_safe = False
    dispatch.clear_cache()
    with pytest.raises(ValueError, match="refuses to run inside a CUDA graph capture"):
        dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode")


def test_capture_flag_needs_cuda(fakes, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode").name == "mojo"


def test_backward_picks_a_backend_with_a_backward(fakes, monkeypatch) -> None:
    capturing(monkeypatch, False)
    fakes["mojo"].no_backward = True
    res = dispatch.resolve("rms_norm", "auto", CUDA, BF16, phase="backward", shape_class="decode")
    assert res.name == "triton"
    assert dispatch.resolve("rms_norm", "auto", CUDA, BF16, shape_class="decode").name == "mojo"


def test_backward_picks_a_backend_with_both_phases(fakes, monkeypatch) -> None:
    """A call with grad runs both phases on the backend auto picks for the backward: one without this
    call's forward (a package with only the backward kernel) is passed over, not picked and then refused."""
    capturing(monkeypatch, False)
    fakes["mojo"].no_forward = True
    res = dispatch.resolve("rms_norm", "auto", CUDA, BF16, phase="backward", shape_class="decode")
    assert res.name == "triton"


@pytest.fixture
def forwardless(monkeypatch: pytest.MonkeyPatch) -> Fake:
    """A stand-in "triton" that runs no forward (whatever is installed: the torch session has no triton),
    first in the CPU's rms_norm ranking; no FUSEKIT_BACKEND* set."""
    fake = Fake("triton")
    fake.no_forward = True
    monkeypatch.setitem(backends._INSTANCES, "triton", fake)
    monkeypatch.setitem(dispatch.AUTO["cpu"], "rms_norm", ("triton", "torch"))
    monkeypatch.delenv("FUSEKIT_BACKEND", raising=False)
    monkeypatch.delenv("FUSEKIT_BACKEND_RMS_NORM", raising=False)
    dispatch.clear_cache()
    yield fake
    dispatch.clear_cache()


def test_grad_call_on_auto_skips_a_backend_without_the_forward(forwardless) -> None:
    """The same through a real call on the CPU: the first backend of the ranking has only a backward."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ops.rms_norm(x, torch.ones(64)).sum().backward()  # raised: 'triton' cannot run rms_norm (forward)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_backend_without_the_forward_is_named_for_the_forward_with_grad(forwardless) -> None:
    """An explicit backend that cannot run a call's forward says so, with grad as without: not "requires
    grad, but rms_norm has no backward here ... run under torch.no_grad()", advice that fails again."""
    forwardless.no_backward = True  # neither phase, as triton for float64
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(ValueError, match=r"^backend: 'triton' cannot run rms_norm \(forward\)"):
        ops.rms_norm(x, torch.ones(64), backend="triton")


@pytest.mark.parametrize("var", ["FUSEKIT_BACKEND", "FUSEKIT_BACKEND_RMS_NORM"])
def test_a_refusal_of_an_environment_choice_names_the_variable(forwardless, monkeypatch, var: str) -> None:
    monkeypatch.setenv(var, "triton")
    dispatch.clear_cache()
    with pytest.raises(ValueError, match=rf"^{var}: 'triton' cannot run rms_norm \(forward\)"):
        ops.rms_norm(torch.randn(4, 64), torch.ones(64))


@pytest.mark.parametrize("grad", [False, True])
def test_an_empty_call_is_refused_as_any_other_by_an_explicit_backend(forwardless, grad: bool) -> None:
    """Empty inputs launch nothing, yet a backend that cannot run the call refuses it as at any size
    (an empty float64 call on triton returned zeros without grad and raised with it)."""
    x = torch.randn(0, 64, requires_grad=grad)
    with pytest.raises(ValueError, match=r"backend: 'triton' cannot run rms_norm \(forward\)"):
        ops.rms_norm(x, torch.ones(64), backend="triton")
    q = torch.randn(0, 2, 3, 64, requires_grad=grad)
    with pytest.raises(ValueError, match=r"backend: 'triton' cannot run attention \(forward\)"):
        ops.attention(q, q, q, backend="triton")
    w = torch.randn(10, 64, requires_grad=grad)
    with pytest.raises(ValueError, match=r"backend: 'triton' cannot run linear_cross_entropy \(forward\)"):
        ops.linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.int64), backend="triton")
    assert ops.rms_norm(x, torch.ones(64)).shape == (0, 64)  # auto passes the stand-in over
    assert ops.linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.int64), backend="torch").isnan()


def test_library_passes_the_call_class(monkeypatch) -> None:
    """Forward plans and grad calls of backend "auto" resolve with the class of their inputs where the
    device's ranking is per class (a CPU table stands in for CUDA's here); an explicit backend, or a device
    without per-class rankings, reads no shapes (each read is a guard in a torch.export / compile trace)."""
    seen: list[tuple[str, str | None]] = []
    real = dispatch.resolve

    def spy(op, backend, device, dtypes, phase="forward", shape_class=None, **meta):
        seen.append((phase, shape_class))
        return real(op, backend, device, dtypes, phase=phase, shape_class=shape_class, **meta)

    monkeypatch.setattr(dispatch, "resolve", spy)
    dispatch.clear_cache()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, generator=gen)
    x = torch.randn(2, 3, 64, generator=gen, requires_grad=True)
    ops.rms_norm(x, w, backend="torch").sum().backward()
    ops.rms_norm(x, w).sum().backward()  # "auto", no per-class ranking on the CPU
    assert seen and all(c is None for _, c in seen), seen
    seen.clear()
    monkeypatch.setattr(dispatch, "AUTO_CLASSES", {"cpu": {"rms_norm": {"decode": ("torch",)}}})
    dispatch.clear_cache()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, generator=gen)
    ops.rms_norm(torch.randn(4, 64, generator=gen), w)
    ops.rms_norm(torch.randn(40, 64, generator=gen), w)
    x = torch.randn(2, 3, 64, generator=gen, requires_grad=True)
    ops.rms_norm(x, w).sum().backward()
    dispatch.clear_cache()
    assert ("forward", "decode") in seen and ("forward", "small") in seen
    assert ("backward", "decode") in seen  # _check_backward: the grad call's class
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_generated_table_names_only_known_things() -> None:
    table = importlib.import_module("fusekit._auto_table").AUTO_CLASSES
    assert dispatch.AUTO_CLASSES is table
    assert set(table) <= {"cuda"}
    for per_op in table.values():
        assert set(per_op) <= set(ops.OPS)
        for per_class in per_op.values():
            assert per_class and set(per_class) <= set(dispatch.SHAPE_CLASSES)
            for order in per_class.values():
                assert isinstance(order, tuple) and len(set(order)) == len(order)
                assert set(order) <= set(backends.names())
                assert "torch" in order  # auto can always run the call


def _row(case: str, params: dict, provider: str, us: float) -> dict:
    return {
        "op": "rms_norm",
        "case": case,
        "params": params,
        "dtype": "bf16",
        "provider": provider,
        "kind": "backend",
        "status": "ok",
        "time_us": us,
    }


def test_generator_ranks_per_class(tmp_path) -> None:
    """Synthetic results: mojo clearly faster at decode, triton at large, a 2% gap is a tie."""
    rows = []
    for m, times in (
        (1, {"mojo": 2.0, "triton": 5.0, "torch": 9.0}),
        (8192, {"mojo": 100.0, "triton": 50.0}),
    ):
        for prov, us in times.items():
            rows.append(_row(f"M={m},N=4096,dtype=bf16", {"M": m, "N": 4096}, prov, us))
    rows.append(_row("M=64,N=256,dtype=bf16", {"M": 64, "N": 256}, "mojo", 9.8))
    rows.append(_row("M=64,N=256,dtype=bf16", {"M": 64, "N": 256}, "triton", 10.0))
    rows.append({**_row("M=64,N=256,dtype=bf16", {"M": 64, "N": 256}, "liger", 1.0), "kind": "baseline"})
    doc = {"meta": {"schema": "fusekit-bench/1", "git_commit": "abc1234"}, "op": "rms_norm", "rows": rows}
    (tmp_path / "rms_norm.json").write_text(json.dumps(doc))
    out = tmp_path / "table.py"
    auto_table.main(["--results", str(tmp_path), "--out", str(out)])
    ns: dict = {}
    exec(out.read_text(), ns)
    got = ns["AUTO_CLASSES"]["cuda"]["rms_norm"]
    assert got == {
        "decode": ("mojo", "triton", "torch"),
        "small": ("triton", "mojo", "torch"),  # within the tie margin: default order
        "large": ("triton", "mojo", "torch"),
    }
    assert "abc1234" in out.read_text()
