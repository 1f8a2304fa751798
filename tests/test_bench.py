"""CPU tests of the benchmark harness and the report (no GPU needed; tiny shapes, well under a minute)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import fusekit.ops
from fusekit.bench import baselines, cases, merge, results
from fusekit.bench.__main__ import main as bench_main
from fusekit.bench.__main__ import select_cases
from fusekit.bench.baselines import BackendProvider, Provider, TorchEager
from fusekit.bench.cases import GRAD, SUITES
from fusekit.bench.cases.attention import AttentionCase
from fusekit.bench.cases.layer_norm import LayerNormCase
from fusekit.bench.cases.reduce_sum import ReduceSumCase
from fusekit.bench.cases.rms_norm import RmsNormCase
from fusekit.bench.cases.rope import RopeCase
from fusekit.bench.cases.swiglu_ffn import SwigluFfnCase
from fusekit.bench.run import rel_error, run_case
from fusekit.report import tables
from fusekit.report.__main__ import main as report_main
from fusekit.report.render import render

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
CEIL = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}


# --- every op's cases module ----------------------------------------------------------------------
@pytest.mark.parametrize("op", fusekit.ops.OPS)
def test_every_op_has_a_cases_module(op: str) -> None:
    mod = cases.module(op)
    assert hasattr(mod, "BASELINES") and callable(mod.cases)
    assert cases.cases(op, "sweep", quick=False, cpu=False), f"{op} has no GPU sweep"
    for suite in SUITES:
        for quick in (False, True):
            for cpu in (False, True):
                cs = cases.cases(op, suite, quick=quick, cpu=cpu)
                labels = [c.label for c in cs]
                assert len(set(labels)) == len(labels), f"{op} {suite}: duplicate labels"
                for c in cs:
                    assert c.op == op and c.suite == suite
                    assert c.bytes_moved() > 0 and c.flops() >= 0
    for c in cases.cases(op, "sweep", quick=True, cpu=True) + cases.cases(op, "train", quick=True, cpu=True):
        inputs = c.make_inputs("cpu", torch.Generator().manual_seed(0))
        for name, t in inputs.items():
            varied = t.numel() == 1 or t.float().std() > 0  # a scalar loss's gradient is one value
            assert t.float().abs().sum() > 0 and varied, f"{c.label}: {name} is constant"
            assert t.requires_grad == (c.train and not name.startswith(GRAD) and t.is_floating_point())
        assert (sum(k.startswith(GRAD) for k in inputs) > 0) == c.train


def test_unknown_op_and_suite() -> None:
    with pytest.raises(ValueError, match="valid"):
        cases.module("no_such_op")
    with pytest.raises(ValueError, match="suite"):
        cases.cases("rms_norm", "nightly")


def test_bytes_and_flops_known_cases() -> None:
    c = ReduceSumCase({"n": 1024}, "fp32", "g", 1024, "n")
    assert c.bytes_moved() == 1024 * 4 + 4 and c.flops() == 0
    assert ReduceSumCase({"n": 1024, "out": "fp32"}, "bf16", "g", 1, "n").bytes_moved() == 1024 * 2 + 4
    assert ReduceSumCase({"m": 8, "n": 1024}, "fp32", "g", 1, "n").bytes_moved() == 8 * 1024 * 4 + 8 * 4
    mn = 32768 * 8192
    assert RmsNormCase({"M": 32768, "N": 8192}, "bf16", "g", 1, "N").bytes_moved() == 2 * mn * 2 + 8192 * 2
    assert LayerNormCase({"M": 4, "N": 8}, "bf16", "g", 1, "N").bytes_moved() == 2 * 32 * 2 + 2 * 8 * 2
    # train: x read twice, dy read, y and dx written; weight read twice and dw written (fp32 weight)
    t = RmsNormCase({"M": 16384, "N": 8192, "w": "fp32"}, "bf16", "g", 1, "M·N", "train")
    assert t.bytes_moved() == 5 * 16384 * 8192 * 2 + 3 * 8192 * 4
    t = LayerNormCase({"M": 16384, "N": 8192}, "bf16", "g", 1, "M·N", "train")
    assert t.bytes_moved() == 5 * 16384 * 8192 * 2 + 5 * 8192 * 2
    r = RmsNormCase({"M": 4096, "N": 4096, "residual": 1}, "bf16", "g", 1, "M·N")
    assert r.bytes_moved() == 4 * 4096 * 4096 * 2 + 4096 * 2
    assert (
        RmsNormCase(r.params, "bf16", "g", 1, "M·N", "train").bytes_moved()
        == 8 * 4096 * 4096 * 2 + 3 * 4096 * 2
    )
    c = RopeCase({"B": 16, "S": 4096, "H": 32, "D": 128}, "bf16", "g", 4096, "S")
    assert c.bytes_moved() == 2 * 16 * 4096 * 32 * 128 * 2
    qk = {"B": 4, "S": 2048, "H": 32, "Hkv": 8, "D": 128}
    assert RopeCase(qk, "bf16", "g", 1, "S", "train").bytes_moved() == 4 * 4 * 2048 * 40 * 128 * 2
    c = SwigluFfnCase({"T": 16, "D": 4096, "F": 11008}, "bf16", "g", 16, "T")
    assert c.flops() == 6 * 16 * 4096 * 11008 and c.bytes_moved() == (2 * 16 * 4096 + 3 * 11008 * 4096) * 2
    c = SwigluFfnCase({"T": 4096, "D": 4096, "F": 14336}, "bf16", "g", 1, "F", "train")
    assert (
        c.flops() == 18 * 4096 * 4096 * 14336 and c.bytes_moved() == (5 * 4096 * 4096 + 9 * 14336 * 4096) * 2
    )
    p = {"B": 4, "H": 32, "S": 4096, "D": 128, "causal": 0}
    c = AttentionCase(p, "bf16", "g", 4096, "S")
    assert c.flops() == 4 * 4 * 32 * 4096 * 4096 * 128
    assert c.bytes_moved() == 4 * 4 * 32 * 4096 * 128 * 2  # q, k, v read, out written
    assert AttentionCase({**p, "causal": 1}, "bf16", "g", 4096, "S").flops() == c.flops() // 2
    tr = AttentionCase(p, "bf16", "g", 4096, "S", "train")
    # forward: q, k, v read, o written; backward: q, k, v, o, do read, dq, dk, dv written
    assert tr.flops() == 14 * 4 * 32 * 4096 * 4096 * 128 and tr.bytes_moved() == 12 * 4 * 32 * 4096 * 128 * 2
    dec = AttentionCase(
        {"B": 1, "H": 32, "Hkv": 8, "S": 1, "Skv": 2048, "D": 128, "causal": 0}, "bf16", "g", 1, "S"
    )
    assert dec.flops() == 4 * 32 * 2048 * 128 and dec.bytes_moved() == (2 * 32 * 128 + 2 * 8 * 2048 * 128) * 2


def test_gpu_sweeps_cover_the_issue_sizes() -> None:
    rs = cases.cases("reduce_sum", "sweep")
    ns = {c.params["n"] for c in rs if c.dtype == "fp32" and c.params.get("m") is None}
    assert min(ns) == 2**10 and max(ns) == 2**30
    assert any(c.dtype == "bf16" for c in rs) and any(c.params.get("m") for c in rs)
    norms = {
        (c.params["M"], c.params["N"]) for c in cases.cases("rms_norm", "sweep") if "residual" not in c.params
    }
    assert {(32768, 8192), (16384, 65536)} <= norms
    assert min(n for _, n in norms) == 512 and max(n for _, n in norms) == 262144
    rope = cases.cases("rope", "sweep")
    assert any(c.params == {"B": 16, "S": 4096, "H": 32, "D": 128} for c in rope)
    ffn = cases.cases("swiglu_ffn", "sweep")
    assert ffn[0].params["T"] == 1 and {"T": 8192, "D": 4096, "F": 11008} in [c.params for c in ffn]
    # issue 14's model shapes at T 1, 16, 128, 4096, 8192 (Llama-3-8B, Qwen2-7B, Llama-3-70B)
    for d, f in ((4096, 14336), (3584, 18944), (8192, 28672)):
        ts = {c.params["T"] for c in ffn if (c.params["D"], c.params["F"]) == (d, f)}
        assert ts == {1, 16, 128, 4096, 8192}, (d, f, ts)
    att = cases.cases("attention", "sweep")
    assert all(c.params["B"] * c.params["S"] == 16384 and c.params["H"] == 32 for c in att)
    assert {c.params["D"] for c in att} == {64, 128, 256} and {c.params["causal"] for c in att} == {0, 1}
    # the committed H200 results' labels are unchanged
    assert "M=32768,N=8192,dtype=bf16" in [c.label for c in cases.cases("rms_norm", "sweep")]
    assert "B=4,H=32,S=4096,D=128,causal=1,dtype=bf16" in [c.label for c in att]


def test_train_and_small_suites_cover_the_issue_shapes() -> None:
    def params(op: str, suite: str) -> list[dict]:
        return [c.params for c in cases.cases(op, suite)]

    for op in ("rms_norm", "layer_norm"):
        got = {(p["M"], p["N"], p.get("w")) for p in params(op, "train") if not p.get("residual")}
        assert got == {(m, n, w) for m, n in ((32768, 4096), (16384, 8192)) for w in ("bf16", "fp32")}
        assert {(p["M"], p["N"]) for p in params(op, "small")} == {(1, 4096), (32, 8192), (4096, 4096)}
    res = [p for p in params("rms_norm", "train") if p.get("residual")]
    assert {(p["M"], p["N"]) for p in res} == {(16384, 8192), (4096, 4096)}
    assert all(p.get("casting") == "llama" for p in params("rms_norm", "train"))
    assert params("rope", "train") == [{"B": 4, "S": 2048, "H": 32, "Hkv": 8, "D": 128}]
    assert [(p["B"], p["S"], p["H"], p["Hkv"], p["D"]) for p in params("rope", "small")] == [
        (1, 1, 32, 8, 128)
    ]
    assert {p["F"] for p in params("swiglu_ffn", "train")} == {11008, 14336}
    assert all((p["T"], p["D"]) == (4096, 4096) for p in params("swiglu_ffn", "train"))
    att = params("attention", "train")
    assert {(p["B"], p["H"], p.get("Hkv", p["H"]), p["S"], p["D"], p["causal"]) for p in att} == {
        (4, 32, 32, 4096, 128, 0),
        (4, 32, 32, 4096, 128, 1),
        (8, 32, 8, 1024, 128, 1),  # Llama-3-8B's heads at a training step's lengths
        (1, 32, 8, 2048, 128, 1),
    }
    dec = params("attention", "small")
    assert [(p["S"], p["Skv"], p["H"], p["Hkv"], p["D"]) for p in dec] == [(1, 2048, 32, 8, 128)]
    assert not cases.cases("reduce_sum", "train") and not cases.cases("swiglu_ffn", "small")


def test_baselines_come_from_the_op_modules() -> None:
    names = baselines.all_baseline_names()
    assert names[:2] == ("torch-eager", "torch-compile")
    assert {"cub", "cublas", "sdpa", "max-attention", "liger", "torch-native"} <= set(names)
    per_op, skipped = baselines.baseline_providers(list(fusekit.ops.OPS), None, CPU)
    assert {p.name for p in per_op["attention"]} == {"torch-eager", "torch-compile", "sdpa"}
    assert {p.name for p in per_op["reduce_sum"]} == {"torch-eager", "torch-compile"}
    # On the CPU, nothing is timed under a GPU library's name: each says why it is skipped.
    assert {"cub", "cublas", "max-attention", "liger"} <= set(skipped)
    assert "CPU" in skipped["cub"] and "CPU" in skipped["cublas"] and "CPU" in skipped["liger"]


def test_rel_error() -> None:
    r = torch.tensor([3.0, 4.0])
    assert rel_error(r.clone(), r) == 0
    assert math.isclose(rel_error(torch.tensor([3.0, 4.5]), r), 0.1)
    assert rel_error(torch.tensor([float("nan"), 4.0]), r) == math.inf
    assert rel_error(torch.zeros(3), r) == math.inf


def test_filter_selects_any_of_several_substrings() -> None:
    sweep = [c for c in cases.cases("rms_norm", "sweep") if "residual" not in c.params]
    labels = [c.label for c in select_cases(sweep, None, "M=32768,N=8192,|M=16384,N=65536,")]
    assert labels == ["M=32768,N=8192,dtype=bf16", "M=16384,N=65536,dtype=bf16"]
    assert [c.label for c in select_cases(sweep, labels[1], None)] == labels[1:]
    assert select_cases(sweep, None, "no such case") == []


# --- the loop: correctness before timing ----------------------------------------------------------
class _Wrong(Provider):
    """A provider whose output is off by 10%: must be recorded as failed, never timed."""

    kind = "backend"

    def __init__(self) -> None:
        super().__init__("wrong", "test")

    def prepare(self, case, device):
        fn = case.eager()
        return lambda **inp: fn(**inp) * 1.1


class _GradScale(torch.autograd.Function):
    """Identity forward, gradient × 1.5: a backward that is wrong while the forward is right."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * 1.5


class _WrongWeightGrad(Provider):
    kind = "backend"

    def __init__(self) -> None:
        super().__init__("wrong-grad", "test")

    def prepare(self, case, device):
        fn = case.eager()
        return lambda x, weight: fn(x, _GradScale.apply(weight))


def _torch_backend() -> BackendProvider:
    from fusekit import backends

    return BackendProvider("torch", backends.get("torch"))


def test_wrong_provider_is_failed_not_timed() -> None:
    case = RmsNormCase({"M": 8, "N": 64}, "bf16", "g", 64, "N")
    rows = run_case(case, [_Wrong(), TorchEager()], CPU, CEIL, rep_ms=2, kernel_time=False)
    by = {r["provider"]: r for r in rows}
    assert by["wrong"]["status"] == "failed" and "rel error" in by["wrong"]["reason"]
    assert "time_us" not in by["wrong"]
    ok = by["torch-eager"]
    assert ok["status"] == "ok" and ok["time_us"] > 0 and ok["e2e_us"] > 0 and ok["rel_error"] < 1e-2
    assert ok["wall_us"] > 0 and ok["wall_calls"] >= 3 and ok["timer"] == "host" and ok["gpu_us"] is None
    assert math.isclose(ok["gbps"], case.bytes_moved() / (ok["time_us"] * 1e-6) / 1e9)


def test_a_wrong_gradient_fails_the_train_check() -> None:
    case = RmsNormCase({"M": 16, "N": 64, "w": "fp32", "casting": "llama"}, "bf16", "g", 1, "M·N", "train")
    rows = run_case(case, [_WrongWeightGrad(), TorchEager()], CPU, CEIL, rep_ms=2, kernel_time=False)
    by = {r["provider"]: r for r in rows}
    assert by["wrong-grad"]["status"] == "failed", by["wrong-grad"]
    assert "dweight" in by["wrong-grad"]["reason"] and "dx" not in by["wrong-grad"]["reason"]
    assert by["torch-eager"]["status"] == "ok"


class _Mutating(TorchEager):
    """Writes into its input (as Liger's rope rotates q and k in place): later providers, and its own
    steady-state check after the warm-up passes over every set, must still see the oracle's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "mutating"

    def mutates_inputs(self, case) -> bool:
        return True

    def prepare(self, case, device):
        fn = case.eager()

        def run(x, weight):
            out = fn(x, weight)
            x.add_(1.0)  # not a scale (rms_norm would not see one)
            return out

        return run


def test_inputs_are_renewed_after_a_provider_that_writes_into_them() -> None:
    case = RmsNormCase({"M": 8, "N": 64}, "fp32", "g", 64, "N")
    rows = run_case(case, [_Mutating(), TorchEager()], CPU, CEIL, rep_ms=2, kernel_time=False)
    assert [r["status"] for r in rows] == ["ok", "ok"], rows


class _Tuning(TorchEager):
    """Logs one measured choice on its first call, as the triton backend's tuners do."""

    def __init__(self) -> None:
        super().__init__()
        self.name, self.log, self.calls = "tuning", [], 0

    def tuning_mark(self) -> int:
        return len(self.log)

    def tuned_since(self, mark: int) -> list[str]:
        return self.log[mark:]

    def prepare(self, case, device):
        fn = case.eager()

        def run(x, weight):
            self.calls += 1
            if self.calls == 1:
                self.log.append("norm (rms_norm, 8): reg block=64 warps=2")
            return fn(x, weight)

        return run


def test_rows_record_what_the_first_call_tuned() -> None:
    """The configs a provider's first call measured and picked go into its row (which one was timed);
    providers that tune nothing, and later cases that reuse a choice, get no entry."""
    case = RmsNormCase({"M": 8, "N": 64}, "fp32", "g", 64, "N")
    tuning = _Tuning()
    rows = run_case(case, [tuning, TorchEager()], CPU, CEIL, rep_ms=2, kernel_time=False)
    assert rows[0]["tuned"] == ["norm (rms_norm, 8): reg block=64 warps=2"] and "tuned" not in rows[1]
    again = run_case(case, [tuning], CPU, CEIL, rep_ms=2, kernel_time=False)
    assert again[0]["status"] == "ok" and "tuned" not in again[0]


class _Sightings(TorchEager):
    """Counts the calls each input set (told apart by its x) has had, as the mojo backend's capture rule
    does with pointers: execute on the first sighting, capture on the second, replay from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.name, self.seen = "sightings", {}

    def prepare(self, case, device):
        fn = case.eager()

        def run(x, weight):
            self.seen[id(x)] = self.seen.get(id(x), 0) + 1
            return fn(x, weight)

        return run


def test_every_input_set_is_in_its_steady_state_before_timing(monkeypatch) -> None:
    """Before any timed loop (and the peak-memory pass), every rotating input set has gone through the
    provider STEADY_PASSES times: no set is timed on its first or second sighting."""
    from fusekit.bench import run as run_mod

    case = RmsNormCase({"M": 8, "N": 64}, "fp32", "g", 64, "N")
    prov = _Sightings()
    entered: list[tuple[str, int, int]] = []
    for name in ("peak_memory_bytes", "bench_ms", "wall_per_call_ms", "e2e_ms"):
        orig = getattr(run_mod, name)

        def timed(*a, _orig=orig, _name=name, **k):
            entered.append((_name, len(prov.seen), min(prov.seen.values())))
            return _orig(*a, **k)

        monkeypatch.setattr(run_mod, name, timed)
    monkeypatch.setattr(run_mod, "n_rotating_sets", lambda nbytes, device: 5)
    rows = run_case(case, [prov], CPU, CEIL, rep_ms=2, kernel_time=False)
    assert rows[0]["status"] == "ok" and len(prov.seen) == 5, rows
    assert [n for n, _, _ in entered] == ["peak_memory_bytes", "bench_ms", "wall_per_call_ms", "e2e_ms"]
    assert all(sets == 5 and least >= run_mod.STEADY_PASSES for _, sets, least in entered), entered


def test_triton_provider_reads_the_kernels_tuning_log(monkeypatch) -> None:
    pytest.importorskip("triton")
    from fusekit import backends
    from kernels_triton import _config

    monkeypatch.setattr(_config, "TUNING_LOG", [])
    prov = BackendProvider("triton", backends.get("triton"))
    mark = prov.tuning_mark()
    _config.note_tuned("norm", ("layer_norm", 32768), "reload block=8192 warps=16")
    assert prov.tuned_since(mark) == ["norm ('layer_norm', 32768): reload block=8192 warps=16"]
    assert _torch_backend().tuned_since(0) == []


@pytest.mark.parametrize(
    "op", [op for op in fusekit.ops.OPS if cases.cases(op, "train", quick=True, cpu=True)]
)
def test_train_case_runs_fwd_bwd_on_the_torch_backend(op: str) -> None:
    case = cases.cases(op, "train", quick=True, cpu=True)[0]
    rows = run_case(case, [_torch_backend(), TorchEager()], CPU, CEIL, rep_ms=1, kernel_time=False)
    for r in rows:
        assert r["status"] == "ok", (r["provider"], r["reason"])
        assert len(r["outputs"]) > 1 and any(n.startswith("d") for n in r["outputs"])
        assert all(e <= t for e, t in zip(r["rel_errors"], r["tolerances"]))
        assert r["wall_us"] > 0 and r["suite"] == "train" and "--suite train" in r["repro"]


# --- a quick CPU run: labels, skips, where it writes, JSON -----------------------------------------
def test_cpu_results_never_go_to_the_committed_tree(tmp_path, monkeypatch, capsys) -> None:
    assert results.default_out(CPU) == results.LOCAL_RESULTS
    assert results.LOCAL_RESULTS.parts[0] == "build"  # git-ignored
    monkeypatch.chdir(tmp_path)
    assert bench_main(["--device", "cpu", "--out", "benchmarks/results/x", "--ops", "rms_norm"]) == 2
    assert "refusing" in capsys.readouterr().err
    assert not (tmp_path / "benchmarks").exists()


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    argv = ["--device", "cpu", "--quick", "--ops", "reduce_sum,rms_norm", "--suite", "sweep,train"]
    argv += ["--backends", "torch", "--baselines", "torch-eager,cub,cublas,liger,sdpa", "--out", str(out)]
    argv += [
        "--rep-ms",
        "2",
        "--no-progress",
        "--no-kernel-time",
        "--filter",
        "n=1024,|M=256,N=1024|M=64,N=256,w=fp32",
    ]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert bench_main(argv) == 0
    return out, buf.getvalue()


def test_quick_cpu_run_says_what_it_skipped(cpu_run) -> None:
    _, log = cpu_run
    assert "host wall-clock" in log and "CUDA" not in log.split("ceilings:")[0].replace("CUDA's", "")
    assert re.search(r"baseline cub skipped: CUB is CUDA's; this run is on the CPU", log)
    assert re.search(r"baseline liger skipped: .*CPU", log)
    assert (
        "baseline sdpa skipped: none of the ops" in log and "baseline cublas skipped: none of the ops" in log
    )
    assert "git-ignored" in log and "render: python -m fusekit.report" in log


def test_quick_cpu_run_writes_json(cpu_run) -> None:
    out, _ = cpu_run
    files = sorted(p.name for p in (out / "cpu").glob("*.json"))
    assert files == ["reduce_sum.json", "rms_norm.json", "rms_norm.train.json"]
    for path, doc in results.load_all(out):
        for key in results.META_KEYS:
            assert key in doc["meta"], key
        assert doc["meta"]["device"] == "cpu" and doc["ceilings"]["copy"]["gbps"] > 0
        assert "cub" in doc["meta"]["skipped_baselines"] and "host" in doc["meta"]["timer"]
        assert "cublas" not in doc["meta"]["providers"] and "cub" not in doc["meta"]["providers"]
        assert doc["suite"] == ("train" if path.name.endswith(".train.json") else "sweep")
        failed = [
            f"{r['case']} {r['provider']}: {r['reason']}" for r in doc["rows"] if r["status"] == "failed"
        ]
        # (a whole-tensor reduce_sum's [1] oracle against its 0-d result failed every row unseen)
        assert not failed, failed
        ok = [r for r in doc["rows"] if r["status"] == "ok"]
        assert {r["provider"] for r in ok} == {"torch", "torch-eager"}
        assert {r["case"] for r in doc["rows"]} == {r["case"] for r in ok}  # every case timed
        for r in ok:
            assert (
                r["time_us"] > 0
                and r["gbps"] > 0
                and r["pct_of_ceiling"] > 0
                and "fusekit.bench" in r["repro"]
            )
            assert r["wall_us"] > 0 and r["timer"] == "host" and r["method"] == "host wall-clock median"
            assert all(e <= t for e, t in zip(r["rel_errors"], r["tolerances"]))
        assert "torch-eager" in next(r for r in ok if r["provider"] == "torch")["speedup_vs"]
        assert json.loads(json.dumps(doc)) == doc  # plain JSON round trip


def test_cpu_report_is_labelled_as_cpu(cpu_run, tmp_path) -> None:
    out, _ = cpu_run
    md = render(out, tmp_path / "report", draw=False).read_text()
    assert "These are CPU results" in md and "_CPU run: every time below is host wall-clock" in md
    assert "CUDA-event" not in md
    assert "rms_norm — training (forward + backward)" in md and "rms_norm (train)" in md
    assert "| liger | not available | all | Liger-Kernel is Triton kernels for a GPU" in md
    assert "wall " in md and "Run behind this table:" in md


def test_report_refuses_cpu_results_in_the_committed_report(cpu_run, tmp_path, monkeypatch) -> None:
    out, _ = cpu_run
    monkeypatch.chdir(tmp_path)
    assert report_main(["--results", str(out), "--out", "benchmarks/report"]) == 2
    assert report_main(["--results", str(tmp_path / "none"), "--out", str(tmp_path / "r")]) == 1


def test_merged_runs_keep_commit_and_versions_per_row(cpu_run, tmp_path) -> None:
    out, _ = cpu_run
    doc = json.loads((out / "cpu" / "rms_norm.json").read_text())
    a = json.loads(json.dumps(doc))
    b = json.loads(json.dumps(doc))
    a["rows"] = [r for r in a["rows"] if r["provider"] == "torch"]
    b["rows"] = [r for r in b["rows"] if r["provider"] != "torch"]
    b["meta"].update(git_commit="feedbeef00", git_dirty=False, date="2031-01-01T00:00:00+00:00", torch="9.9")
    m = merge.merge([a, b])
    assert [r["git_commit"] for r in m["meta"]["merged_from"]] == [doc["meta"]["git_commit"], "feedbeef00"]
    assert m["meta"]["merged_from"][1]["torch"] == "9.9"
    assert {r["provider"]: r["source"] for r in m["rows"] if r["status"] == "ok"} == {
        "torch": 0,
        "torch-eager": 1,
    }
    d = tmp_path / "res" / "cpu"
    d.mkdir(parents=True)
    (d / "rms_norm.json").write_text(json.dumps(m))
    md = render(tmp_path / "res", tmp_path / "rep", draw=False).read_text()
    commit = (doc["meta"]["git_commit"] or "?")[:10]
    assert "(run 1), feedbeef00 (run 2)" in md and commit in md
    assert (
        "<sup>1</sup>" in md and "<sup>2</sup>" in md and "| 2 | feedbeef00 | 2031-01-01T00:00 | 9.9 |" in md
    )


def test_merge_keeps_each_runs_own_baselines() -> None:
    """A backend re-measured in a later run with its own baselines is compared with those; a row of the
    earlier run keeps the earlier baselines; a run without baselines is compared with the merged ones."""

    def row(provider: str, kind: str, us: float) -> dict:
        return {"case": "c", "provider": provider, "kind": kind, "status": "ok", "time_us": us, "bytes": 1,
                "pct_of_ceiling": 50.0}  # fmt: skip

    def doc(commit: str, *rows: dict) -> dict:
        meta = {"git_commit": commit, "date": "2026-12-04T21:00:00+00:00"}
        return {"op": "rms_norm", "suite": "train", "meta": meta, "rows": list(rows)}

    old = doc(
        "a", row("triton", "backend", 50.0), row("mojo", "backend", 400.0), row("liger", "baseline", 100.0)
    )
    new = doc("b", row("mojo", "backend", 80.0), row("liger", "baseline", 120.0))
    alone = doc("b", row("torch", "backend", 60.0))  # a --baselines none process of run b's session
    m = merge.merge([old, new, alone])
    got = {r["provider"]: (r["source"], r["speedup_vs"]) for r in m["rows"]}
    assert got["triton"] == (0, {"liger": 2.0})  # its own run's liger (100 us), not the later 120
    assert got["mojo"] == (1, {"liger": 1.5})  # re-measured beside liger's 120 us
    assert got["torch"] == (2, {"liger": 2.0})  # no baselines of its own: the merged liger row
    assert got["liger"][0] == 1
    # merged again with a later run whose liger replaces the row: earlier rows keep their own runs' ratios
    later = doc("d", row("mojo", "backend", 90.0), row("liger", "baseline", 90.0))
    again = {r["provider"]: r["speedup_vs"] for r in merge.merge([m, later])["rows"]}
    assert again["triton"] == {"liger": 2.0} and again["torch"] == {"liger": 2.0}
    assert again["mojo"] == {"liger": 1.0}
    # the report's headline takes those same-run ratios, not the later liger row shown beside triton
    (best,) = tables.headline([("gpu", Path("x.json"), m)], Path("."))
    assert best["backend"] == "triton" and best["per_baseline"] == {"liger": 2.0}


# --- the committed H200 results -------------------------------------------------------------------
def test_committed_report_is_rendered_from_the_committed_results(tmp_path, monkeypatch) -> None:
    """benchmarks/report/README.md is exactly what the renderer makes of benchmarks/results."""
    monkeypatch.chdir(REPO)
    md = render(Path("benchmarks/results"), tmp_path, draw=False).read_text()
    assert md == (REPO / "benchmarks/report/README.md").read_text()


def test_committed_report_states_every_commit(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    md = render(Path("benchmarks/results"), tmp_path, draw=False).read_text()
    docs = results.load_all(Path("benchmarks/results"))
    for path, doc in docs:
        commits = {r["git_commit"][:10] for r in results.runs(doc)}
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| `{path}`"))
        assert all(c in line for c in commits), (path, commits, line)
        if len(commits) > 1:
            assert "run" in line
    assert "CUDA-event timings with a cold L2" in md and "CPU" not in md.split("## Headline")[0]
    assert "**triton**" in md and "Runs behind this table" in md
