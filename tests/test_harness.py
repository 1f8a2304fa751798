"""The checks can fail: a provider that skips elements or computes the wrong thing is caught, by the
conformance assertion and by the benchmark's correctness gate alike."""

from __future__ import annotations

import pytest
import torch
from checks import assert_close

import fusekit
from fusekit import backends, dispatch, ops
from fusekit.backends.torch import TorchBackend
from fusekit.bench.baselines import BackendProvider, TorchEager
from fusekit.bench.cases.rms_norm import RmsNormCase
from fusekit.bench.run import run_case


class _SkipsLastRow(TorchBackend):
    """Runs every phase on all rows but the last, leaving that row of each output unwritten."""

    name = "torch"

    def run(self, spec, phase, outputs, inputs, scalars):
        m = inputs[0].shape[0]

        def cut(t):
            return t[: m - 1] if t is not None and t.dim() and t.shape[0] == m else t

        super().run(spec, phase, tuple(map(cut, outputs)), tuple(map(cut, inputs)), scalars)


class _WrongEps(TorchBackend):
    name = "torch"

    def run(self, spec, phase, outputs, inputs, scalars):
        super().run(spec, phase, outputs, inputs, (scalars[0] + 1.0, *scalars[1:]))


@pytest.fixture
def broken(monkeypatch, request):
    monkeypatch.setitem(backends._INSTANCES, "torch", request.param())
    dispatch.clear_cache()
    yield request.param
    dispatch.clear_cache()


@pytest.mark.parametrize("broken", [_SkipsLastRow, _WrongEps], indirect=True)
def test_a_broken_provider_fails_the_check(broken):
    from cases.rms_norm import oracle

    x, w = torch.randn(8, 64), torch.randn(64)
    with fusekit.poisoned():
        y = ops.rms_norm(x, w, backend="torch")
    with pytest.raises(AssertionError):
        assert_close("rms_norm", y, oracle(x, w, 1e-6)[0], 2e-5, "self-test")


@pytest.mark.parametrize("broken", [_SkipsLastRow, _WrongEps], indirect=True)
@pytest.mark.parametrize("suite", ["sweep", "train"])
def test_a_broken_backend_is_not_timed_by_the_bench(broken, suite):
    """The bench's float64 oracle (the op's reference, autograd in float64 for "train") catches a broken
    backend's forward and backward; the baseline next to it still runs."""
    case = RmsNormCase({"M": 8, "N": 64}, "fp32", "g", 64, "N", suite)
    ceil = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}
    provs = [BackendProvider("torch", backends.get("torch")), TorchEager()]
    with fusekit.poisoned():
        rows = run_case(case, provs, torch.device("cpu"), ceil, rep_ms=1, kernel_time=False)
    by = {r["provider"]: r for r in rows}
    assert by["torch"]["status"] == "failed" and "rel error" in by["torch"]["reason"], by["torch"]
    assert "time_us" not in by["torch"]
    assert by["torch-eager"]["status"] == "ok"


def test_poisoning_fills_outputs():
    with fusekit.poisoned():
        from fusekit import outputs

        assert torch.isnan(outputs.empty((4,), torch.bfloat16, torch.device("cpu"))).all()
        assert (outputs.empty((4,), torch.int64, torch.device("cpu")) == torch.iinfo(torch.int64).min).all()


def test_results_beyond_the_dtype_range_must_overflow_with_their_sign():
    """An exact value past fp16's largest finite (65504) is correctly +-inf in fp16 (the fuzz case: an rms_norm
    backward with eps 0 and rows of 4e-5, gradients of 7e4); a kernel that returns something small there, or the
    wrong sign, or inf where the exact value is in range, still fails."""
    ref = torch.tensor([1.0, -2.0, 70469.9, -1e6], dtype=torch.float64)
    good = torch.tensor([1.0, -2.0, float("inf"), float("-inf")], dtype=torch.float16)
    assert_close("overflow", good, ref, 4e-3, "self-test")
    assert_close(
        "overflow", torch.tensor([1.0, -2.0, 65504.0, float("-inf")], dtype=torch.float16), ref, 4e-3, "t"
    )
    for bad in ([1.0, -2.0, 0.0, float("-inf")], [1.0, -2.0, float("-inf"), float("-inf")]):
        with pytest.raises(AssertionError, match=r"beyond the torch\.float16 range"):
            assert_close("overflow", torch.tensor(bad, dtype=torch.float16), ref, 4e-3, "self-test")
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(
            "overflow", torch.tensor([float("inf"), -2.0, float("inf"), float("-inf")]).half(), ref, 4e-3, ""
        )


@pytest.mark.parametrize("broken", [_SkipsLastRow], indirect=True)
def test_the_bench_poisons_outputs_itself(broken):
    """run_case checks under fusekit's NaN poisoning without the caller asking (no bench entry point did:
    an unwritten row read whatever the allocator handed back)."""
    case = RmsNormCase({"M": 8, "N": 64}, "fp32", "g", 64, "N", "sweep")
    ceil = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}
    (row,) = run_case(case, [BackendProvider("torch", backends.get("torch"))], torch.device("cpu"), ceil,
                      rep_ms=1, kernel_time=False)  # fmt: skip
    assert row["status"] == "failed" and "rel error inf" in row["reason"], row


class _Stale(TorchEager):
    """Right on its first call, then the first call's outputs for any input set (what a replay of captured
    pointers, or a wrong remembered path, would return)."""

    def prepare(self, case, device):
        fn, first = super().prepare(case, device), {}

        def call(**inputs):
            if "out" not in first:
                first["out"] = fn(**inputs)
            return first["out"]

        return call


def test_the_steady_state_call_is_checked_on_another_input_set():
    """Only the first call was checked: the memo / replay / graph paths every timed call takes were not, and
    a provider replaying its first call's results was timed and reported correct."""
    case = RmsNormCase({"M": 8, "N": 64}, "fp32", "g", 64, "N", "sweep")
    ceil = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}
    stale = _Stale()
    stale.name = "stale"
    rows = run_case(case, [TorchEager(), stale], torch.device("cpu"), ceil, rep_ms=1, kernel_time=False)
    by = {r["provider"]: r for r in rows}
    assert by["torch-eager"]["status"] == "ok" and by["torch-eager"]["steady_rel_error"] < 1e-5
    assert by["stale"]["status"] == "failed" and by["stale"]["reason"].startswith("steady-state call"), by
    assert "time_us" not in by["stale"]
