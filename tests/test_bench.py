"""CPU tests of the benchmark harness and the report (no GPU needed)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fusekit.bench import cases, results
from fusekit.bench.__main__ import main as bench_main
from fusekit.bench.__main__ import select_cases
from fusekit.bench.baselines import Provider
from fusekit.bench.cases import Case
from fusekit.bench.run import rel_error, run_case
from fusekit.report.__main__ import main as report_main


# --- byte and FLOP floors ------------------------------------------------------------------------
def test_bytes_and_flops_known_cases() -> None:
    c = Case("reduce_sum", {"n": 1024}, "fp32", "g", 1024, "n")
    assert c.bytes_moved() == 1024 * 4 + 4 and c.flops() == 0
    c = Case("reduce_sum", {"n": 1024, "out": "fp32"}, "bf16", "g", 1024, "n")
    assert c.bytes_moved() == 1024 * 2 + 4
    c = Case("reduce_sum", {"m": 8, "n": 1024}, "fp32", "g", 8192, "n")
    assert c.bytes_moved() == 8 * 1024 * 4 + 8 * 4
    c = Case("rms_norm", {"M": 32768, "N": 8192}, "bf16", "g", 8192, "N")
    assert c.bytes_moved() == 2 * 32768 * 8192 * 2 + 8192 * 2  # x read, y written, weight read
    c = Case("layer_norm", {"M": 4, "N": 8}, "bf16", "g", 8, "N")
    assert c.bytes_moved() == 2 * 32 * 2 + 2 * 8 * 2  # + weight and bias
    c = Case("rope", {"B": 16, "S": 4096, "H": 32, "D": 128}, "bf16", "g", 4096, "S")
    assert c.bytes_moved() == 2 * 16 * 4096 * 32 * 128 * 2
    c = Case("swiglu_ffn", {"T": 16, "D": 4096, "F": 11008}, "bf16", "g", 16, "T")
    assert c.flops() == 2 * 3 * 16 * 4096 * 11008
    assert c.bytes_moved() == (2 * 16 * 4096 + 3 * 11008 * 4096) * 2
    p = {"B": 4, "H": 32, "S": 4096, "D": 128, "causal": 0}
    c = Case("attention", p, "bf16", "g", 4096, "S")
    assert c.flops() == 4 * 4 * 32 * 4096 * 4096 * 128
    assert c.bytes_moved() == 4 * 4 * 32 * 4096 * 128 * 2  # q, k, v read, out written
    cc = Case("attention", {**p, "causal": 1}, "bf16", "g", 4096, "S")
    assert cc.flops() == c.flops() // 2


def test_gpu_sweeps_cover_the_issue_sizes() -> None:
    rs = cases.sweep("reduce_sum", quick=False, cpu=False)
    ns = {c.params["n"] for c in rs if c.dtype == "fp32" and c.params.get("m") is None}
    assert min(ns) == 2**10 and max(ns) == 2**30
    assert any(c.dtype == "bf16" for c in rs) and any(c.params.get("m") for c in rs)
    norms = {(c.params["M"], c.params["N"]) for c in cases.sweep("rms_norm", quick=False, cpu=False)}
    assert {(32768, 8192), (16384, 65536)} <= norms
    assert min(n for _, n in norms) == 512 and max(n for _, n in norms) == 262144
    rope = cases.sweep("rope", quick=False, cpu=False)
    assert any(c.params == {"B": 16, "S": 4096, "H": 32, "D": 128} for c in rope)
    ffn = cases.sweep("swiglu_ffn", quick=False, cpu=False)
    assert next(c.params["T"] for c in ffn) == 1 and ffn[-1].params == {"T": 8192, "D": 4096, "F": 11008}
    att = cases.sweep("attention", quick=False, cpu=False)
    assert all(c.params["B"] * c.params["S"] == 16384 and c.params["H"] == 32 for c in att)
    assert {c.params["D"] for c in att} == {64, 128, 256} and {c.params["causal"] for c in att} == {0, 1}
    assert {c.params["S"] for c in att} >= {512, 16384}


def test_inputs_are_random_not_zero() -> None:
    for op in cases.OPS:
        case = cases.sweep(op, quick=True, cpu=True)[0]
        inputs = case.make_inputs("cpu", torch.Generator().manual_seed(0))
        for t in inputs.values():
            assert t.dtype == case.torch_dtype and t.float().abs().sum() > 0 and t.float().std() > 0


def test_rel_error() -> None:
    r = torch.tensor([3.0, 4.0])
    assert rel_error(r.clone(), r) == 0
    assert math.isclose(rel_error(torch.tensor([3.0, 4.5]), r), 0.1)
    assert rel_error(torch.tensor([float("nan"), 4.0]), r) == math.inf
    assert rel_error(torch.zeros(3), r) == math.inf


class _Wrong(Provider):
    """A provider whose output is off by 10%: must be recorded as failed, never timed."""

    def __init__(self) -> None:
        super().__init__("wrong", "backend", frozenset({"rms_norm"}), "test")

    def prepare(self, case, device):
        fn = case.reference_fn()
        return lambda **inp: fn(**inp) * 1.1


class _Eager(Provider):
    def __init__(self) -> None:
        super().__init__("eager", "baseline", frozenset({"rms_norm"}), "test")

    def prepare(self, case, device):
        return case.reference_fn()


def test_wrong_provider_is_failed_not_timed() -> None:
    case = Case("rms_norm", {"M": 8, "N": 64}, "bf16", "g", 64, "N")
    ceil = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}
    rows = run_case(case, [_Wrong(), _Eager()], torch.device("cpu"), ceil, rep_ms=2, kernel_time=False)
    by = {r["provider"]: r for r in rows}
    assert by["wrong"]["status"] == "failed" and "rel error" in by["wrong"]["reason"]
    assert "time_us" not in by["wrong"]
    ok = by["eager"]
    assert ok["status"] == "ok" and ok["time_us"] > 0 and ok["e2e_us"] > 0 and ok["rel_error"] < 1e-2
    assert math.isclose(ok["gbps"], case.bytes_moved() / (ok["time_us"] * 1e-6) / 1e9)


def test_filter_selects_any_of_several_substrings() -> None:
    sweep = cases.sweep("rms_norm", quick=False, cpu=False)
    labels = [c.label for c in select_cases(sweep, None, "M=32768,N=8192,|M=16384,N=65536,")]
    assert labels == ["M=32768,N=8192,dtype=bf16", "M=16384,N=65536,dtype=bf16"]
    assert [c.label for c in select_cases(sweep, labels[1], None)] == labels[1:]
    assert select_cases(sweep, None, "no such case") == []


# --- a quick CPU run writes valid JSON -----------------------------------------------------------
def test_quick_cpu_run_writes_json(tmp_path) -> None:
    argv = ["--device", "cpu", "--quick", "--ops", "reduce_sum,rms_norm", "--backends", "torch"]
    argv += ["--baselines", "torch-eager,cub", "--out", str(tmp_path), "--rep-ms", "3", "--no-progress"]
    argv += ["--filter", "1024,"]  # reduce_sum n=1024 (and m=256,n=1024), rms_norm M=256,N=1024
    assert bench_main(argv) == 0
    files = sorted((tmp_path / "cpu").glob("*.json"))
    assert [f.name for f in files] == ["reduce_sum.json", "rms_norm.json"]
    for f in files:
        doc = json.loads(f.read_text())
        for key in results.META_KEYS:
            assert key in doc["meta"], key
        assert doc["meta"]["device"] == "cpu" and doc["ceilings"]["copy"]["gbps"] > 0
        ok = [r for r in doc["rows"] if r["status"] == "ok"]
        assert {r["provider"] for r in ok} == {"torch", "torch-eager"}
        for r in ok:
            assert (
                r["time_us"] > 0 and r["gbps"] > 0 and r["rel_error"] < 1e-2 and "fusekit.bench" in r["repro"]
            )
            assert r["pct_of_ceiling"] > 0
        torch_row = next(r for r in ok if r["provider"] == "torch")
        assert "torch-eager" in torch_row["speedup_vs"]
        cub = [r for r in doc["rows"] if r["provider"] == "cub"]
        assert all(r["status"] == "skipped" and r["reason"] for r in cub)


# --- the report renders from synthetic results ---------------------------------------------------
def _row(op, case, provider, kind, t_us, nbytes, flops, group="g", x=1.0):
    return {
        "op": op,
        "case": case,
        "params": {},
        "dtype": "bf16",
        "group": group,
        "x": x,
        "x_label": "size",
        "provider": provider,
        "kind": kind,
        "bytes": nbytes,
        "flops": flops,
        "status": "ok",
        "reason": None,
        "time_us": t_us,
        "e2e_us": t_us + 10,
        "kernel_us": t_us * 0.9,
        "rel_error": 1e-3,
        "gbps": nbytes / t_us / 1e3,
        "tflops": flops / t_us / 1e6 if flops else None,
        "pct_of_ceiling": 50.0,
        "repro": "PYTHONPATH=python python -m fusekit.bench ...",
    }


@pytest.fixture
def synthetic_results(tmp_path):
    root = tmp_path / "results" / "nvidia-h200"
    root.mkdir(parents=True)
    meta = {k: None for k in results.META_KEYS}
    meta.update(schema=results.SCHEMA, device="cuda", gpu_name="NVIDIA H200", date="2026-11-21T00:00:00")
    ceil = {"copy": {"gbps": 4283.0}, "matmul": {"tflops": 780.0}}
    rows = []
    for i, n in enumerate([2**20, 2**24, 2**28]):
        b = 2 * n * 2
        rows += [
            _row("rms_norm", f"N={n}", "triton", "backend", b / 3800e3 * (1 + i / 10), b, 0, x=n),
            _row("rms_norm", f"N={n}", "torch-eager", "baseline", b / 1200e3, b, 0, x=n),
        ]
    rows.append({**rows[0], "provider": "mojo", "status": "failed", "reason": "rel error 1 > tolerance 0.01"})
    (root / "rms_norm.json").write_text(
        json.dumps({"meta": meta, "op": "rms_norm", "ceilings": ceil, "rows": rows})
    )
    rows = []
    for causal in (0, 1):
        for s in (1024, 4096):
            f = 4 * 32 * s * 16384 * 128 // (2 if causal else 1)
            b = 4 * 16384 * 32 * 128 * 2
            g = f"D=128{' causal' if causal else ''}"
            rows += [
                _row("attention", f"S={s},c={causal}", "triton", "backend", f / 450e6, b, f, g, s),
                _row("attention", f"S={s},c={causal}", "sdpa", "baseline", f / 500e6, b, f, g, s),
            ]
    doc = {"meta": meta, "op": "attention", "ceilings": ceil, "rows": rows}
    (root / "attention.json").write_text(json.dumps(doc))
    return tmp_path / "results"


def test_report_renders(synthetic_results, tmp_path) -> None:
    out = tmp_path / "report"
    assert report_main(["--results", str(synthetic_results), "--out", str(out)]) == 0
    md = (out / "README.md").read_text()
    assert "Headline" in md and "**triton**" in md and "rms_norm.json" in md and "attention.json" in md
    assert "rel error 1 > tolerance" in md  # failures are listed with their reason
    for name in ("nvidia-h200_rms_norm.png", "nvidia-h200_attention.png", "nvidia-h200_roofline.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md


def test_report_without_results(tmp_path) -> None:
    assert report_main(["--results", str(tmp_path / "none"), "--out", str(tmp_path / "r")]) == 1
