"""The reliability record (tests/reliability.py) and the report's Reliability section, on synthetic files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import reliability  # tests/reliability.py

from fusekit.bench.results import load_all
from fusekit.report import reliability as section
from fusekit.report.render import render

REPO = Path(__file__).resolve().parents[1]
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="triton-cuda" errors="1" failures="1" skipped="2" tests="7"
  timestamp="2031-01-02T03:04:05.000000+00:00">
 <testcase classname="tests.test_conformance" name="test_op[None-rope-forward-bfloat16-0-triton]" time="0.1"/>
 <testcase classname="tests.test_conformance" name="test_op[None-rope-backward-bfloat16-0-triton]" time="0.1">
  <failure message="boom">assert 0</failure></testcase>
 <testcase classname="tests.test_conformance" name="test_op[None-rope-forward-float32-1-triton]" time="0">
  <skipped message="cannot run">skip</skipped></testcase>
 <testcase classname="tests.test_cuda_graphs" name="test_capture_and_replay[forward-rope-triton]" time="1"/>
 <testcase classname="tests.test_hostile_inputs" name="test_scalar_ranges_are_named[call0-theta]" time="0"/>
 <testcase classname="tests.test_concurrency" name="test_threads_and_streams_give_serial_bits[rope-triton]">
  <error message="setup">fixture</error></testcase>
 <testcase classname="" name="tests.test_triton_modes" time="0">
  <skipped message="collection skipped">CPU interpreter tests</skipped></testcase>
</testsuite></testsuites>
"""
SANITIZER_LOG = """========= COMPUTE-SANITIZER
12 passed, 2 skipped in 40.1s
========= ERROR SUMMARY: 0 errors
triton memcheck sanitize-triton-memcheck.log exit=0 ========= ERROR SUMMARY: 0 errors 12 passed, 2 skipped in 40.1s
"""


def _record(tmp_path: Path, monkeypatch) -> dict:
    """tests/reliability.py over one test run's XML and one sanitizer log without XML."""
    monkeypatch.setenv("FUSEKIT_GIT_COMMIT", "c0ffee1234567")
    monkeypatch.setenv("FUSEKIT_GIT_DIRTY", "0")
    (tmp_path / "tests-triton.xml").write_text(JUNIT)
    (tmp_path / "sanitize-triton-memcheck.log").write_text(SANITIZER_LOG)
    out = tmp_path / "res" / "nvidia-h200" / "reliability-triton.json"
    files = [str(tmp_path / "tests-triton.xml"), str(tmp_path / "sanitize-triton-memcheck.log")]
    assert reliability.main(["--out", str(out), *files]) == 0
    doc = json.loads(out.read_text())
    doc["meta"]["gpu_name"] = "NVIDIA H200"  # what a GPU host records (this may run on a CPU)
    out.write_text(json.dumps(doc))
    return doc


def test_record_counts_per_check_backend_and_device(tmp_path, monkeypatch) -> None:
    doc = _record(tmp_path, monkeypatch)
    rows = {r["check"]: r for r in doc["checks"]}
    conf = rows["conformance"]
    assert (conf["backend"], conf["device"], conf["cases"]) == ("triton", "cuda", 3)
    assert (conf["passed"], conf["failed"], conf["skipped"], conf["errors"]) == (1, 1, 1, 0)
    assert conf["failures"] == ["tests.test_conformance::test_op[None-rope-backward-bfloat16-0-triton]"]
    assert rows["CUDA graphs"]["passed"] == 1 and rows["concurrency"]["errors"] == 1
    assert rows["hostile inputs"]["backend"] == "triton"  # no backend parameter: the run's (suite name)
    san = rows["sanitizer memcheck"]  # from the log alone; the appended summary copy is not counted twice
    assert (san["cases"], san["passed"], san["skipped"], san["sanitizer_errors"], san["exit_code"]) == (
        14,
        12,
        2,
        0,
        0,
    )
    assert rows["triton modes"]["skipped"] == 1 and "" not in rows  # skipped at collection: named by module
    assert doc["totals"]["cases"] == 21 and doc["totals"]["failed"] == 1
    m = doc["meta"]
    assert m["git_commit"] == "c0ffee1234567" and m["git_dirty"] is False and m["schema"] == section.SCHEMA
    assert m["runs_started"].startswith("2031-01-02T03:04") and m["date"] and m["torch"]


def test_meta_from_a_gpu_record(tmp_path, monkeypatch) -> None:
    """--meta-from: logs fetched from several device calls get the GPU record's commit, GPU and versions
    (not this machine's), with this call's command and inputs."""
    gpu = _record(tmp_path, monkeypatch)  # its meta says NVIDIA H200, commit c0ffee1234567
    monkeypatch.setenv("FUSEKIT_GIT_COMMIT", "0000000")
    src = tmp_path / "res" / "nvidia-h200" / "reliability-triton.json"
    log = tmp_path / "sanitize-triton-racecheck-decode.log"
    log.write_text(SANITIZER_LOG.replace("memcheck", "racecheck"))
    out = tmp_path / "merged.json"
    assert reliability.main(["--out", str(out), "--meta-from", str(src), str(log)]) == 0
    m = json.loads(out.read_text())["meta"]
    assert m["gpu_name"] == "NVIDIA H200" and m["git_commit"] == gpu["meta"]["git_commit"]
    assert m["meta_from"] == src.name and m["inputs"] == [log.name] and "--meta-from" in m["command"]


def test_sanitizer_summaries_and_pytest_counts() -> None:
    race = "========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)\nx exit=97\n"
    assert reliability._sanitizer(race) == {"sanitizer_errors": 2, "sanitizer_warnings": 1, "exit_code": 97}
    assert reliability._pytest_counts("1 failed, 4 passed, 2 skipped, 1 error in 3.2s")["cases"] == 8
    assert reliability._pytest_counts("========= ERROR SUMMARY: 1 error") is None
    assert reliability.check_name("tests.test_out_of_memory") == "out of memory"
    assert reliability.backend_of("test_x[mojo]") == "mojo" and reliability.backend_of("test_y[a-b]") is None


def test_report_renders_the_section(tmp_path, monkeypatch) -> None:
    _record(tmp_path, monkeypatch)
    res = tmp_path / "res"
    shutil.copy(REPO / "benchmarks/results/nvidia-h200/rope.json", res / "nvidia-h200" / "rope.json")
    assert [p.name for p, _ in load_all(res)] == ["rope.json"]  # the record is no bench results file
    md = render(res, tmp_path / "rep", draw=False).read_text()
    part = md.split("## Reliability")[1]
    assert "| check | backend | device | cases | passed | failed | skipped | commit | date |" in part
    assert "| conformance | triton | NVIDIA H200 | 3 | 1 | 1 | 1 | c0ffee1234 | 20" in part
    assert "| sanitizer memcheck | triton | NVIDIA H200 | 14 | 12 | 0 (0 sanitizer errors) | 2 |" in part
    lines = [ln for ln in part.splitlines() if "NVIDIA H200" in ln]
    assert [ln.split(" | ")[0] for ln in lines] == [  # issue #15's order
        "| conformance",
        "| hostile inputs",
        "| sanitizer memcheck",
        "| CUDA graphs",
        "| concurrency",
        "| triton modes",
    ]
    assert "Not in any record: fuzz, large inputs" in part


def test_report_without_a_record_says_so(tmp_path) -> None:
    d = tmp_path / "res" / "nvidia-h200"
    d.mkdir(parents=True)
    shutil.copy(REPO / "benchmarks/results/nvidia-h200/rope.json", d / "rope.json")
    (d / "reliability-broken.json").write_text("{not json")  # unreadable records are ignored
    md = render(tmp_path / "res", tmp_path / "rep", draw=False).read_text()
    part = md.split("## Reliability")[1].strip().splitlines()
    assert part == [f"No reliability record (`reliability*.json`) under `{tmp_path / 'res'}`."]
