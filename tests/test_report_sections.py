"""The report's end-to-end and host-path sections (report/e2e.py, report/host.py) on small synthetic files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fusekit.bench.results import load_all
from fusekit.report import e2e, host, targets
from fusekit.report.render import render

REPO = Path(__file__).resolve().parents[1]
SLUG = "nvidia-h200"
GIB = 2**30


def _meta(schema: str, commit: str = "abcdef1234567890", date: str = "2031-01-02T03:04:05+00:00") -> dict:
    return {
        "schema": schema,
        "device": "cuda",
        "gpu_name": "NVIDIA H200",
        "torch": "2.11.0",
        "triton": "3.6.0",
        "liger": "0.8.5",
        "transformers": "5.23.0",
        "git_commit": commit,
        "git_dirty": True,
        "date": date,
        "command": "python -m fusekit.bench.e2e --device cuda",
    }


def _row(
    prov: str, scenario: str, case: str, tps: float, eager: float, compile_: float, run: int = 0
) -> dict:
    return {
        "provider": prov,
        "scenario": scenario,
        "case": case,
        "status": "ok",
        "tokens_per_s": tps,
        "ms_per_step": 1e3 / tps,
        "peak_mem_bytes": int(20 * GIB),
        "run": run,
        "speedup_vs": {"eager": tps / eager, "compile": tps / compile_},
    }


def _e2e_doc(wrong: bool = False, merged: bool = False) -> dict:
    """eager / compile / fusekit-triton over prefill, decode and train; optionally a liger that failed
    its gate, and a second run that timed fusekit-triton."""
    base = {"prefill": 1000.0, "decode": 100.0, "train": 400.0}
    comp = {"prefill": 1200.0, "decode": 250.0, "train": 440.0}
    fk = {"prefill": 1100.0, "decode": 90.0, "train": 380.0}
    cases = {"prefill": "1x64", "decode": "1x32+8", "train": "1x64"}
    rows = []
    for prov, tps, run in (("eager", base, 0), ("compile", comp, 0), ("fusekit-triton", fk, int(merged))):
        rows += [_row(prov, sc, cases[sc], tps[sc], base[sc], comp[sc], run) for sc in cases]
    gate = {"passed": True, "logits_rel_error": 0.02, "logits_tol": 0.05, "generate_matching_prefix": 8}
    providers = {
        "eager": {"gate": gate, "gate_s": 0.5, "status": "ok", "run": 0},
        "compile": {"gate": gate, "gate_s": 9.0, "status": "ok", "run": 0},
        "fusekit-triton": {
            "gate": {
                **gate,
                "kernel_runs": {"rms_norm:forward": 5},
                "kernel_runs_expected": {"rms_norm:forward": 5},
            },
            "gate_s": 3.0,
            "status": "ok",
            "run": int(merged),
        },
    }
    if wrong:
        why = "correctness gate failed: logits relative error 0.9 > 0.05"
        providers["liger"] = {"gate": {**gate, "passed": False}, "status": "wrong", "reason": why, "run": 0}
        rows += [
            {"provider": "liger", "scenario": sc, "case": c, "status": "wrong", "reason": why, "run": 0}
            for sc, c in cases.items()
        ]
    meta = _meta(e2e.SCHEMA)
    runs = [meta, _meta(e2e.SCHEMA, commit="fedcba9876543210", date="2031-01-03T00:00:00+00:00")]
    return {
        "schema": e2e.SCHEMA,
        "meta": meta,
        "setup": {
            "model": "tiny",
            "layers": 2,
            "dtype": "bf16",
            "attn_implementation": "sdpa",
            "prefill": [[1, 64]],
            "decode": [1, 32, 8],
            "train": [[1, 64]],
            "config": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4},
            "parameters": 123_456_789,
        },
        "method": {"quick": False},
        "providers": providers,
        "rows": rows,
        "runs": runs if merged else [meta],
    }


def _host_doc() -> dict:
    def row(case: str, backend: str, wall: float, bare: float | None) -> dict:
        r = {"case": case, "backend": backend, "fusekit_wall_us": wall, "fusekit_gpu_us": 5.0}
        if bare is not None:
            r.update(bare_wall_us=bare, wall_vs_bare=wall / bare, bare_kernels=["_k"], liger_wall_us=70.0)
        return {**r, "torch_wall_us": 12.0, "status": "ok"}

    return {
        "schema": host.SCHEMA,
        "meta": {**_meta(host.SCHEMA), "command": "python -m fusekit.bench.host --backends triton,torch"},
        "method": "host wall-clock per call",
        "rows": [
            row("rms_norm 1x4096", "triton", 39.0, 30.0),  # 1.30x: meets the target
            row("rms_norm 1x4096", "torch", 50.0, None),
            row("rope 1 token", "triton", 80.0, 20.0),  # 4x: misses it
            {  # a training row: 3x the bare launches, 1.2x them inside an autograd.Function (its floor)
                **row("rms_norm fwd+bwd", "triton", 120.0, 40.0),
                "bare_autograd_wall_us": 100.0,
                "wall_vs_bare_autograd": 1.2,
            },
            {
                "case": "attention decode",
                "backend": "triton",
                "status": "error",
                "reason": "ValueError: no|pe",
            },
        ],
    }


def _results(tmp_path: Path, e2e_doc: dict | None = None, host_doc: dict | None = None) -> Path:
    """A results tree with one committed op file and the given e2e / host files."""
    res = tmp_path / "res"
    d = res / SLUG
    d.mkdir(parents=True)
    shutil.copy(REPO / "benchmarks/results/nvidia-h200/rope.json", d / "rope.json")
    if e2e_doc is not None:
        (d / "e2e.json").write_text(json.dumps(e2e_doc))
    if host_doc is not None:
        (d / "host.json").write_text(json.dumps(host_doc))
    return res


def _section(md: str, title: str) -> str:
    """The text of the `## ` section that starts with `title`, up to the next one."""
    return md.split(title, 1)[1].split("\n## ", 1)[0]


def test_op_loader_ignores_e2e_and_host_files(tmp_path) -> None:
    res = _results(tmp_path, _e2e_doc(), _host_doc())
    (res / SLUG / "broken.json").write_text("{not json")
    assert [p.name for p, _ in load_all(res)] == ["rope.json"]
    assert [p.name for p, _ in e2e.load(res)] == ["e2e.json"]
    assert [p.name for p, _ in host.load(res)] == ["host.json"]


def test_sections_sit_between_the_op_sections_and_reliability(tmp_path) -> None:
    res = _results(tmp_path, _e2e_doc(), _host_doc())
    md = render(res, tmp_path / "rep", draw=False).read_text()
    i_op, i_e2e = md.index("### rope — "), md.index(e2e.TITLE)
    i_host, i_rel = md.index(host.TITLE), md.index("## Reliability")
    assert i_op < i_e2e < i_host < i_rel
    assert md.count(e2e.TITLE) == 1 and md.count(host.TITLE) == 1
    before = md.split(e2e.TITLE)[0]
    outside_targets = before.split(targets.TITLE)[0] + before.split(targets.TITLE)[1].split("\n## ", 1)[1]
    assert "e2e.json" not in outside_targets  # no op section, Sources row or headline for it


def test_absent_files_leave_no_section(tmp_path) -> None:
    md = render(_results(tmp_path), tmp_path / "rep", draw=False).read_text()
    assert e2e.TITLE not in md and host.TITLE not in md
    assert e2e.section_md(tmp_path / "res", tmp_path / "rep", tmp_path) == []
    assert host.section_md(tmp_path / "res", tmp_path) == []
    assert not (tmp_path / "rep" / f"{SLUG}_e2e.png").exists()


def test_e2e_table_ratios_memory_setup_and_run(tmp_path) -> None:
    md = render(_results(tmp_path, _e2e_doc()), tmp_path / "rep", draw=False).read_text()
    part = _section(md, e2e.TITLE)
    assert "| scenario | eager | compile | fusekit-triton |" in part
    lines = {ln.split(" | ")[0]: ln for ln in part.splitlines() if ln.startswith("| `")}
    prefill = lines["| `prefill 1x64`"]
    assert "1,100 tok/s · 0.909 ms<br>×1.10 eager, ×0.92 compile" in prefill
    assert "**1,200 tok/s · 0.833 ms**<br>×1.20 eager |" in prefill  # fastest in bold, no self-ratio
    assert "×0.83 compile |" in prefill  # eager's column
    assert "peak 20.0 GiB" in lines["| `train 1x64`"] and "GiB" not in prefill
    assert "| `decode 1x32+8`" in lines
    assert "Setup: tiny shapes, 2 layers (hidden 64, FFN 128, 4 heads" in part and "0.12 B parameters" in part
    assert "decode 1x32 prompt + 8 new tokens" in part
    assert "Run: commit abcdef1234+dirty, 2031-01-02 03:04, torch 2.11.0, triton 3.6.0," in part
    assert "transformers 5.23.0" in part and "`python -m fusekit.bench.e2e --device cuda`" in part
    assert f"![end to end on {SLUG}]({SLUG}_e2e.png)" in part
    assert "| fusekit-triton | ok | 0.02 (0.05) | – | 8 of 8 | all | 3.0 |" in part
    assert "<sup>" not in part


def test_e2e_wrong_provider_and_merged_runs(tmp_path) -> None:
    md = render(_results(tmp_path, _e2e_doc(wrong=True, merged=True)), tmp_path / "rep", draw=False)
    part = _section(md.read_text(), e2e.TITLE)
    assert "| scenario | eager | compile | fusekit-triton | liger |" in part
    assert "| wrong |" in part  # liger's cells: not timed
    assert (
        "| liger | train 1x64 | wrong | correctness gate failed: logits relative error 0.9 > 0.05 |" in part
    )
    assert "×1.10 eager, ×0.92 compile<sup>2</sup>" in part  # fusekit-triton's cells are run 2's
    assert "1. commit abcdef1234+dirty, 2031-01-02 03:04" in part
    assert "2. commit fedcba9876+dirty, 2031-01-03 00:00" in part


def test_e2e_plot_is_drawn(tmp_path) -> None:
    doc = _e2e_doc(wrong=True)
    png = e2e.plot(doc, tmp_path / f"{SLUG}_e2e.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert e2e.plot(doc, tmp_path / "x.png", draw=False) == tmp_path / "x.png"
    assert not (tmp_path / "x.png").exists()
    no_eager = {**doc, "rows": [r for r in doc["rows"] if r["provider"] != "eager"]}
    for r in no_eager["rows"]:
        r.pop("speedup_vs", None)
    assert e2e.plot(no_eager, tmp_path / "y.png") is None


def test_render_draws_the_e2e_png(tmp_path) -> None:
    md = render(_results(tmp_path, _e2e_doc()), tmp_path / "rep").read_text()
    assert (tmp_path / "rep" / f"{SLUG}_e2e.png").read_bytes()[:4] == b"\x89PNG"
    assert f"({SLUG}_e2e.png)" in md


def test_host_table_marks_the_target(tmp_path) -> None:
    md = render(_results(tmp_path, host_doc=_host_doc()), tmp_path / "rep", draw=False).read_text()
    part = _section(md, host.TITLE)
    assert e2e.TITLE not in md
    head = "| case | backend | wall µs | GPU µs | bare Triton launch µs | wall ÷ bare | torch eager µs | Liger µs |"
    assert head in part
    assert "| `rms_norm 1x4096` | triton | 39.0 | 5.0 | 30.0 | 1.30× ✓ | 12.0 | 70.0 | `_k` |" in part
    assert "| `rms_norm 1x4096` | torch | 50.0 | 5.0 | – | – | 12.0 | – | – |" in part
    assert "| `rope 1 token` | triton | 80.0 | 5.0 | 20.0 | **4.00× ✗** |" in part
    assert "| `attention decode` | triton | error: ValueError: no/pe |" in part
    assert (
        "| `rms_norm fwd+bwd` | triton | 120.0 | 5.0 | 40.0; in autograd.Function 100.0 | 1.20× ✓ |" in part
    )
    assert "triton: 2 of 3 cases within 1.3× of the bare launch (median 1.30×)." in part
    assert "Run: commit abcdef1234+dirty, 2031-01-02 03:04, torch 2.11.0, triton 3.6.0, liger 0.8.5;" in part
    assert "transformers" not in part


def test_committed_files_render_both_sections(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    md = render(Path("benchmarks/results"), tmp_path, draw=False).read_text()
    assert f"### {SLUG} — `benchmarks/results/{SLUG}/e2e.json`" in md
    assert f"### {SLUG} — `benchmarks/results/{SLUG}/host.json`" in md


# --- the Targets section (report/targets.py) ------------------------------------------------------------
def _op_doc(rows: list[dict]) -> dict:
    meta = {**_meta("fusekit-bench/1"), "command": "python -m fusekit.bench --suite train"}
    return {"meta": meta, "op": "rms_norm", "suite": "train", "rows": rows}


def _bench_row(prov: str, n: int, vs_compile: float, pct: float) -> dict:
    return {
        "op": "rms_norm",
        "suite": "train",
        "case": f"M=8,N={n}",
        "params": {"M": 8, "N": n},
        "dtype": "bf16",
        "provider": prov,
        "kind": "backend",
        "status": "ok",
        "speedup_vs": {"torch-compile": vs_compile},
        "pct_of_ceiling": pct,
    }


def test_targets_met_only_when_every_case_meets_them() -> None:
    doc = _op_doc(
        [
            _bench_row("triton", 4096, 1.3, 85.0),
            _bench_row("triton", 8192, 1.25, 79.0),  # misses the 80% byte floor target
            _bench_row("mojo", 4096, 0.6, 50.0),
        ]
    )
    got = {t.what: cells for _, t, cells in targets.evaluate([(SLUG, Path("x.json"), doc)])}
    compile_ = got["norms fwd+bwd ≥ 1.2× torch.compile"]
    assert compile_["triton"].startswith("**met**: 2/2 cases, worst 1.25×")
    assert compile_["mojo"].startswith("not met: 0/1 cases, worst 0.60×")
    assert got["norms fwd+bwd ≥ 80% of the byte floor"]["triton"].startswith("not met: 1/2 cases, worst 79%")
    assert "abcdef1234" in compile_["triton"]  # the rows' commit
    # no row of that suite/baseline: the target is left out, never assumed met
    assert "norms fwd+bwd ≥ 1.1× Liger" not in got and "attention fwd+bwd ≥ 0.9× SDPA" not in got


def test_target_ratios_against_replaced_baseline_rows_are_marked() -> None:
    """A row's same-run ratio whose baseline row the file has since replaced (a later run, source 1): the
    cell keeps the same-run verdict, marked †, with the verdict against the file's baseline row beside it;
    1.3 against its own run's torch.compile, 0.8 against the 1000 / 1250 us rows the file holds."""
    rows = [
        {**_bench_row("triton", 4096, 1.3, 85.0), "time_us": 1250.0, "source": 0},
        {**_bench_row("torch-compile", 4096, 1.0, 80.0), "kind": "baseline", "time_us": 1000.0, "source": 1},
        {**_bench_row("triton", 8192, 1.25, 85.0), "time_us": 800.0, "source": 1},
        {**_bench_row("torch-compile", 8192, 1.0, 80.0), "kind": "baseline", "time_us": 1000.0, "source": 1},
    ]
    got = {t.what: cells for _, t, cells in targets.evaluate([(SLUG, Path("x.json"), _op_doc(rows))])}
    cell = got["norms fwd+bwd ≥ 1.2× torch.compile"]["triton"]
    assert cell.startswith("**met**: 2/2 cases, worst 1.25×")
    assert "† (against the file's torch-compile rows: not met: 1/2 cases, worst 0.80×" in cell
    assert "†" not in got["norms fwd+bwd ≥ 80% of the byte floor"]["triton"]  # no baseline in a % target


def test_layer_targets_read_the_model_benchs_providers() -> None:
    """model.json names providers fusekit-<backend>[-graph]: eager decode and graphed decode are checked
    on their own rows, by scenario."""

    def row(prov: str, scenario: str, vs_compile: float, pct: float) -> dict:
        r = {**_bench_row(prov, 4096, vs_compile, pct), "op": "model", "suite": "sweep", "scenario": scenario}
        return r | {"case": f"{scenario} {prov}"}

    doc = {**_op_doc([]), "op": "model", "suite": "sweep"}
    doc["rows"] = [
        row("fusekit-triton", "decode-b1-2k", 1.2, 40.0),
        row("fusekit-triton", "decode-b32-2k", 0.9, 70.0),
        row("fusekit-triton-graph", "decode-b1-2k", 1.6, 75.0),
        row("fusekit-triton", "prefill-2k", 1.1, 90.0),
        row("torch-compile", "decode-b1-2k", 1.0, 30.0),
    ]
    got = {t.what: cells for _, t, cells in targets.evaluate([(SLUG, Path("model.json"), doc)])}
    assert got["layer eager decode ≥ 1.0× torch.compile"]["triton"].startswith(
        "not met: 1/2 cases, worst 0.90×"
    )
    assert got["layer graphed decode ≥ 1.5× torch.compile"]["triton"].startswith(
        "**met**: 1/1 cases, worst 1.60×"
    )
    assert got["layer graphed decode ≥ 60% of the byte floor"]["triton"].startswith(
        "**met**: 1/1 cases, worst 75%"
    )
    assert got["layer prefill ≥ 1.05× torch.compile"]["triton"].startswith("**met**: 1/1 cases, worst 1.10×")
    assert got["layer eager decode ≥ 1.0× torch.compile"]["mojo"] == "no data"


def test_e2e_targets_from_step_times_and_commit_mark(tmp_path) -> None:
    res = _results(tmp_path, _e2e_doc(merged=True))
    [(label, provs, items)] = targets.evaluate_e2e(res)
    assert provs == ["fusekit-triton"] and "tiny" in label
    cells = {t.what: c["fusekit-triton"] for t, c in items}
    # train: 380 vs eager 400 tokens/s -> 0.95x, under 1.15x; timed at the second run's commit: marked
    assert cells["training step ≥ 1.15× HF eager"].startswith("not met: 0/1 cases, worst 0.95×")
    assert cells["training step ≥ 1.15× HF eager"].endswith("†")
    assert "decode ≥ 1.0× HF + Liger" not in cells  # no liger rows
    # peak memory: at most eager's (MiB over it; an upper bound: equal meets it)
    assert cells["training step's peak memory ≤ HF eager's"].startswith("**met**: 1/1 cases, worst +0 MiB")
    md = render(res, tmp_path / "rep", draw=False).read_text()
    assert targets.TITLE in md and md.index(targets.TITLE) < md.index("## Sources and ceilings")


def test_e2e_eager_targets_take_the_same_process_ab_ratio(tmp_path) -> None:
    """A row with same-process A/B rounds (bench.e2e ab_decode / ab_train) is judged against HF eager by
    their median ratio, not by the isolated rows' (which carry the host's drift between runs): not marked
    as another run's baseline either. Other baselines keep the isolated ratio."""
    doc = _e2e_doc(merged=True)
    for r in doc["rows"]:
        if r["provider"] == "fusekit-triton" and r["scenario"] == "train":
            r["ab_vs_eager"], r["ab_ratios"] = 1.2, [1.1, 1.2, 1.3]
    [(_, _, items)] = targets.evaluate_e2e(_results(tmp_path, doc))
    cell = {t.what: c["fusekit-triton"] for t, c in items}["training step ≥ 1.15× HF eager"]
    assert cell.startswith("**met**: 1/1 cases, worst 1.20×") and not cell.endswith("†"), cell


def test_e2e_peak_memory_target_is_an_upper_bound(tmp_path) -> None:
    doc = _e2e_doc()
    for r in doc["rows"]:
        if r["provider"] == "fusekit-triton" and r["scenario"] == "train":
            r["peak_mem_bytes"] = int(20 * GIB) + (3 << 20)  # 3 MiB over eager's 20 GiB
    [(_, _, items)] = targets.evaluate_e2e(_results(tmp_path, doc))
    cell = {t.what: c["fusekit-triton"] for t, c in items}["training step's peak memory ≤ HF eager's"]
    assert cell.startswith("not met: 0/1 cases, worst +3 MiB")
    # only one row records what its process held before the step: the peaks themselves are compared
    for r in doc["rows"]:
        if r["provider"] == "fusekit-triton" and r["scenario"] == "train":
            r["mem_before_bytes"] = int(4 * GIB) + (3 << 20)
    [(_, _, items)] = targets.evaluate_e2e(_results(tmp_path / "one", doc))
    cell = {t.what: c["fusekit-triton"] for t, c in items}["training step's peak memory ≤ HF eager's"]
    assert cell.startswith("not met: 0/1 cases, worst +3 MiB")
    # both do: held before the step (a cache from an earlier inference call) is not the step's peak -
    # 3 MiB more held, the same rise as eager's -> +0
    for r in doc["rows"]:
        if r["provider"] == "eager" and r["scenario"] == "train":
            r["mem_before_bytes"] = int(4 * GIB)
    [(_, _, items)] = targets.evaluate_e2e(_results(tmp_path / "both", doc))
    cell = {t.what: c["fusekit-triton"] for t, c in items}["training step's peak memory ≤ HF eager's"]
    assert cell.startswith("**met**: 1/1 cases, worst +0 MiB")


def test_host_targets_from_host_json(tmp_path) -> None:
    res = _results(tmp_path, host_doc=_host_doc())
    got = {(b, w): c for _, b, w, c in targets.evaluate_host(res)}
    bare = got[("triton", targets.HOST_TARGETS[0][1])]  # wall per call <= 1.3x a bare launch
    # 39/30 = 1.30 meets it, 80/20 does not; the training row counts against its autograd floor (1.2x)
    assert bare.startswith("not met: 2/3 cases, worst 4.00×")
    vs_torch = got[("triton", "never slower than the torch eager op (eager wall / fusekit wall)")]
    assert vs_torch.startswith("not met: 0/3 cases, worst 0.10×")  # torch 12 us against 39, 80 and 120 us
    assert not any(b == "mojo" for b, _ in got)  # no mojo rows: no verdict


def test_ratios_pair_only_rows_of_one_session() -> None:
    """A merged file's backend row and a baseline row of another session (another commit, days apart) were
    divided anyway (201 such ratios in the H200 files, e.g. triton attention.small 1.17x SDPA against an
    SDPA row six days older): no ratio now, the case is 'unpaired'. A process of the same session (same
    commit and timer, minutes apart: the mojo process) and the row's own run's stored ratio still count."""
    from fusekit.bench import pairing
    from fusekit.report import tables

    def run(commit: str, date: str, cmd: str) -> dict:
        return {"git_commit": commit, "date": date, "command": cmd, "gpu_name": "NVIDIA H200"}

    def row(prov: str, kind: str, us: float, source: int, sv: dict | None = None) -> dict:
        return {"op": "attention", "case": "c", "provider": prov, "kind": kind, "status": "ok", "time_us": us,
                "source": source, "bytes": 1, "pct_of_ceiling": 50.0, "method": "ev", "speedup_vs": sv or {}}  # fmt: skip

    runs_ = [
        run("aaa", "2026-12-04T10:00:00+00:00", "python -m fusekit.bench --backends triton --baselines none"),
        run("bbb", "2026-11-28T10:00:00+00:00", "python -m fusekit.bench --backends none --baselines sdpa"),
        run("bbb", "2026-11-28T10:20:00+00:00", "python -m fusekit.bench --backends mojo --baselines none"),
    ]
    sdpa = row("sdpa", "baseline", 10.0, 1)
    triton = row("triton", "backend", 8.0, 0, {"sdpa": 1.25})  # the cross-session ratio merge stored
    mojo = row("mojo", "backend", 12.5, 2, {"sdpa": 0.8})
    assert pairing.ratio(triton, sdpa, runs_) is None
    assert pairing.ratio(mojo, sdpa, runs_) == 0.8
    own = {**triton, "speedup_vs": {"sdpa": 1.1}}
    own_runs = [{**runs_[0], "command": "python -m fusekit.bench --baselines sdpa"}, *runs_[1:]]
    assert pairing.ratio(own, sdpa, own_runs) == 1.1  # its own run timed sdpa (row since replaced)
    doc = {"op": "attention", "suite": "small", "meta": {**_meta("fusekit-bench/1"), "merged_from": runs_},
           "rows": [sdpa, triton]}  # fmt: skip
    (h,) = tables.headline([(SLUG, Path("x.json"), doc)], Path("."))
    assert h["backend"] == "triton" and h["speedup"] is None and h["unpaired"] == 1
    assert "0/0 (+1 unpaired ‡)" in tables.headline_md([h])


def test_stale_lists_rows_timed_before_their_kernels_changed(tmp_path) -> None:
    """fusekit.report.stale maps an op to its kernel files (own and shared, per backend) and lists a
    results file whose rows were timed at a commit older than a later change to those files."""
    from fusekit.report import stale

    paths = stale.kernel_paths("triton", "rms_norm")
    assert ":(glob)kernels_triton/_norm_bwd.py" in paths and not any("attention" in p for p in paths)
    assert stale.kernel_paths("mojo", "swiglu_ffn")[:3] == [
        ":(glob)mojo/swiglu_ffn.mojo", ":(glob)mojo/_swiglu*.mojo", ":(glob)mojo/tc"
    ]  # fmt: skip
    first = stale._git("rev-list", "--max-parents=0", "HEAD").split()[0]
    head = stale._git("rev-parse", "--short", "HEAD")
    doc = {"op": "rope", "meta": {"git_commit": first, "date": "2026-01-01T00:00:00+00:00"},
           "rows": [{"case": "c", "provider": "triton", "kind": "backend", "status": "ok"}]}  # fmt: skip
    (tmp_path / "rope.json").write_text(json.dumps(doc))
    ((name, backend, _, later),) = stale.stale_rows(tmp_path)
    assert (name, backend) == ("rope.json", "triton") and later  # kernels_triton/rope.py changed since
    doc["meta"]["git_commit"] = head
    (tmp_path / "rope.json").write_text(json.dumps(doc))
    assert stale.stale_rows(tmp_path) == []
