"""fusekit.bench.merge: ratios only between rows of one GPU session, files of one GPU, later failures kept.

Small hand-built documents shaped like benchmarks/results/<gpu>/<op>.json (CPU only, no torch work)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusekit.bench import merge, results

REPO = Path(__file__).resolve().parents[1]
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
COMMIT = "407e2b3a506b4f7b27579e37a988a2fdbece3c67"
T0 = "2026-12-04T21:18:59+00:00"
METHOD = (
    "CUDA-event median (L2 flushed; a GPU spin holds the device until the call is enqueued: device time only)"
)


def row(provider: str, kind: str, us: float | None, status: str = "ok", case: str = "c", **extra) -> dict:
    r = {"op": "rms_norm", "case": case, "provider": provider, "kind": kind, "status": status,
         "reason": None if status == "ok" else f"{status} here", "time_us": us, "bytes": 1,
         "pct_of_ceiling": 50.0, "method": METHOD}  # fmt: skip
    if status == "ok":
        r["speedup_vs"] = {}
    r.update(extra)
    return r


def doc(*rows: dict, gpu: str = H200, commit: str | None = COMMIT, date: str | None = T0, **meta) -> dict:
    m = {"schema": results.SCHEMA, "device": "cuda", "gpu_name": gpu, "git_commit": commit,
         "git_dirty": False, "date": date, "host": "vm", "command": "python -m fusekit.bench --ops rms_norm"}  # fmt: skip
    m.update(meta)
    return {"meta": m, "op": "rms_norm", "suite": "sweep", "ceilings": {}, "rows": list(rows)}


def baselines_run(**kw) -> dict:
    """The torch/triton process of a session: triton 50 us, liger 100 us, torch-compile 75 us."""
    return doc(
        row("triton", "backend", 50.0),
        row("liger", "baseline", 100.0),
        row("torch-compile", "baseline", 75.0),
        command="python -m fusekit.bench --ops rms_norm --backends triton --baselines liger,torch-compile",
        **kw,
    )


def mojo_run(us: float = 80.0, status: str = "ok", method: str = METHOD, **kw) -> dict:
    """The mojo backend timed in its own process (`--baselines none`)."""
    kw.setdefault("date", "2026-12-04T21:24:07+00:00")  # five minutes later
    return doc(
        row("mojo", "backend", us if status == "ok" else None, status=status, method=method),
        command="python -m fusekit.bench --ops rms_norm --backends mojo --baselines none",
        **kw,
    )


def by_provider(m: dict, case: str = "c") -> dict[str, dict]:
    return {r["provider"]: r for r in m["rows"] if r["case"] == case}


# --- pairing across runs ----------------------------------------------------------------------------
def test_same_session_processes_are_paired() -> None:
    """The mojo process of the same session (same GPU, commit, timer, minutes apart) gets the ratios
    against the baselines timed by the other process; same-run ratios stay as they were."""
    rows = by_provider(merge.merge([baselines_run(), mojo_run()]))
    assert rows["mojo"]["source"] == 1
    assert rows["mojo"]["speedup_vs"] == pytest.approx({"liger": 1.25, "torch-compile": 0.9375})
    assert rows["triton"]["speedup_vs"] == pytest.approx({"liger": 2.0, "torch-compile": 1.5})
    assert rows["liger"]["speedup_vs"] == pytest.approx({"torch-compile": 0.75})
    # 11 h apart is still one session
    late = mojo_run(date="2026-12-05T08:18:59+00:00")
    assert by_provider(merge.merge([baselines_run(), late]))["mojo"]["speedup_vs"] == pytest.approx(
        {"liger": 1.25, "torch-compile": 0.9375}
    )


@pytest.mark.parametrize(
    "other",
    [
        pytest.param({"commit": "fd8ab88"}, id="other-commit"),
        pytest.param({"git_dirty": True}, id="dirty"),
        pytest.param({"date": "2026-12-05T09:19:00+00:00"}, id="12h-apart"),
        pytest.param({"date": "2026-12-07T21:18:59+00:00"}, id="days-apart"),
        pytest.param({"method": "triton.do_bench median (CUDA events, L2 flushed)"}, id="other-method"),
        pytest.param({"date": None}, id="no-date"),
        pytest.param({"commit": None}, id="no-commit"),
    ],
)
def test_other_session_gives_no_ratio(other: dict) -> None:
    """A backend timed in another session (other commit, a dirty tree, more than 12 h apart, another
    timer, or not known) is not compared with this session's baselines: it keeps its time, no ratio."""
    rows = by_provider(merge.merge([baselines_run(), mojo_run(**other)]))
    mojo = rows["mojo"]
    assert mojo["status"] == "ok" and mojo["time_us"] == 80.0 and mojo["source"] == 1
    assert mojo["speedup_vs"] == {}
    # the baseline run's own ratios are untouched
    assert rows["triton"]["speedup_vs"] == pytest.approx({"liger": 2.0, "torch-compile": 1.5})


def test_baseline_of_another_session_is_not_paired_with_a_baseline() -> None:
    """Baseline rows too: liger of one session is not compared with torch-compile timed days later."""
    later = doc(row("torch-compile", "baseline", 60.0), date="2026-12-09T10:00:00+00:00", commit="bec05f2")
    rows = by_provider(merge.merge([baselines_run(), later]))
    assert rows["torch-compile"]["source"] == 1
    assert rows["liger"]["speedup_vs"] == {}
    assert rows["torch-compile"]["speedup_vs"] == {}
    # triton keeps its own run's torch-compile (75 us), not the later 60 us
    assert rows["triton"]["speedup_vs"] == pytest.approx({"liger": 2.0, "torch-compile": 1.5})


def test_rows_without_a_method_are_paired_on_the_run() -> None:
    """method is compared only where both rows record it (older files lack it)."""
    base = baselines_run()
    for r in base["rows"]:
        del r["method"]
    rows = by_provider(merge.merge([base, mojo_run()]))
    assert rows["mojo"]["speedup_vs"] == pytest.approx({"liger": 1.25, "torch-compile": 0.9375})


def test_prior_ratios_are_not_extended_or_overwritten_by_another_session() -> None:
    """A row of an already merged file keeps the ratios it came with; a baseline timed by a later session
    adds no ratio to it and changes none."""
    first = merge.merge([baselines_run(), mojo_run()])
    # a later session re-times liger and adds a baseline neither earlier run timed
    later = doc(
        row("liger", "baseline", 90.0),
        row("torch-native", "baseline", 40.0),
        commit="bec05f2",
        date="2026-12-09T10:00:00+00:00",
    )
    rows = by_provider(merge.merge([first, later]))
    assert rows["liger"]["source"] == 2 and rows["torch-native"]["source"] == 2
    assert rows["triton"]["speedup_vs"] == pytest.approx({"liger": 2.0, "torch-compile": 1.5})
    assert rows["mojo"]["speedup_vs"] == pytest.approx({"liger": 1.25, "torch-compile": 0.9375})
    # the later session's own baselines are compared with each other
    assert rows["liger"]["speedup_vs"] == pytest.approx({"torch-native": 40.0 / 90.0})


# --- one GPU per file -------------------------------------------------------------------------------
def test_files_of_different_gpus_are_refused() -> None:
    with pytest.raises(ValueError, match="different GPUs") as err:
        merge.merge([baselines_run(), mojo_run(gpu=H100)])
    assert H200 in str(err.value) and H100 in str(err.value)


def test_a_merged_file_holding_a_run_of_another_gpu_is_refused() -> None:
    first = merge.merge([baselines_run(), mojo_run()])
    first["meta"]["merged_from"][1]["gpu_name"] = H100
    with pytest.raises(ValueError, match="different GPUs"):
        merge.merge([first, mojo_run(us=70.0)])


def test_committed_files_of_two_gpus_are_refused(tmp_path) -> None:
    """The audit's case: the committed H200 and H100 rms_norm files no longer merge into one 'H200' file."""
    files = [REPO / f"benchmarks/results/{d}/rms_norm.json" for d in ("nvidia-h200", "nvidia-h100-80gb-hbm3")]
    if not all(f.exists() for f in files):
        pytest.skip("committed rms_norm results not present")
    with pytest.raises(ValueError) as err:
        merge.main(["--out", str(tmp_path), *map(str, files)])
    assert "H200" in str(err.value) and "H100" in str(err.value)
    assert not list(tmp_path.iterdir())


def test_each_run_records_its_gpu() -> None:
    single = baselines_run()
    assert results.runs(single)[0]["gpu_name"] == H200  # old single-run files: from meta
    m = merge.merge([single, mojo_run()])
    assert [r["gpu_name"] for r in m["meta"]["merged_from"]] == [H200, H200]
    assert [r["gpu_name"] for r in results.runs(m)] == [H200, H200]


# --- which row wins ---------------------------------------------------------------------------------
def test_later_failure_replaces_earlier_timing() -> None:
    """A later correctness failure is not hidden behind the earlier run's timing."""
    rows = by_provider(merge.merge([baselines_run(), mojo_run(), mojo_run(status="failed")]))
    assert rows["mojo"]["status"] == "failed" and rows["mojo"]["source"] == 2
    assert rows["mojo"]["reason"] == "failed here" and rows["mojo"]["time_us"] is None
    # a baseline that fails later replaces its timing too: no ratio against it, except the same-run ones
    failing = doc(row("liger", "baseline", None, status="failed"), date="2026-12-04T21:30:00+00:00")
    rows = by_provider(merge.merge([baselines_run(), mojo_run(), failing]))
    assert rows["liger"]["status"] == "failed" and rows["liger"]["source"] == 2
    assert rows["mojo"]["speedup_vs"] == pytest.approx({"torch-compile": 0.9375})
    assert rows["triton"]["speedup_vs"] == pytest.approx({"liger": 2.0, "torch-compile": 1.5})


def test_later_skip_never_hides_earlier_timing() -> None:
    rows = by_provider(merge.merge([baselines_run(), mojo_run(), mojo_run(status="skipped")]))
    assert rows["mojo"]["status"] == "ok" and rows["mojo"]["source"] == 1 and rows["mojo"]["time_us"] == 80.0
    assert rows["mojo"]["speedup_vs"] == pytest.approx({"liger": 1.25, "torch-compile": 0.9375})


def test_later_timing_replaces_earlier_failure_and_later_files_win() -> None:
    rows = by_provider(merge.merge([baselines_run(), mojo_run(status="failed"), mojo_run(us=100.0)]))
    assert rows["mojo"]["status"] == "ok" and rows["mojo"]["source"] == 2 and rows["mojo"]["time_us"] == 100.0
    rows = by_provider(merge.merge([baselines_run(), mojo_run(us=100.0), mojo_run(us=40.0)]))
    assert rows["mojo"]["source"] == 2 and rows["mojo"]["speedup_vs"] == pytest.approx(
        {"liger": 2.5, "torch-compile": 1.875}
    )


def test_merged_document_is_plain_json(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, body in ((a, baselines_run()), (b, mojo_run())):
        d.mkdir()
        (d / "rms_norm.json").write_text(json.dumps(body))
    out = tmp_path / "out"
    assert merge.main(["--out", str(out), str(a / "rms_norm.json"), str(b / "rms_norm.json")]) == 0
    m = json.loads((out / "rms_norm.json").read_text())
    assert m["meta"]["gpu_name"] == H200 and len(m["meta"]["merged_from"]) == 2
    assert by_provider(m)["mojo"]["speedup_vs"] == pytest.approx({"liger": 1.25, "torch-compile": 0.9375})
