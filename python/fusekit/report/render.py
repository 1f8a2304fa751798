"""Assemble a report (README.md and its PNGs) from every results file under a folder.

Provenance is stated exactly: a file merged from several runs lists each run's commit in the Sources
table, every timed cell carries its run's number when a file has more than one, and each op's table is
followed by its runs (commit, date, versions, command). The timing method is stated per device: CUDA
events with a cold L2 on a GPU, host wall-clock on the CPU. After the op sections come the end-to-end
model (report/e2e.py) and the host path per call (report/host.py), each only where its file exists; the
Targets section (report/targets.py: every numeric target of the open issues, met or not, from the
same files) follows the headline; the report ends with the Reliability section (report/reliability.py: the test and sanitizer records found
beside the results).
"""

from __future__ import annotations

import os
from pathlib import Path

from fusekit.bench import cases
from fusekit.bench.results import load_all, runs, suite_of
from fusekit.report import e2e as e2e_section
from fusekit.report import host as host_section
from fusekit.report import plots, reliability, tables, targets

SUITE_ORDER = ("sweep", "train", "small", "decode")
SUITE_TITLES = {
    "sweep": "",
    "train": " — training (forward + backward)",
    "small": " — small model shapes (per-call overhead)",
    "decode": " — decode (a few queries against a long KV cache)",
}


def _order(item: tuple[str, Path, dict]) -> tuple:
    dev, _, doc = item
    op, suite = doc["op"], suite_of(doc)
    s = SUITE_ORDER.index(suite) if suite in SUITE_ORDER else len(SUITE_ORDER)
    return (dev == "cpu", dev, s, cases.report_rank(op), op)  # bench/cases/<op>.py REPORT_RANK


def _rel(path: Path, root: Path) -> str:
    rel = os.path.relpath(path, root)
    return str(path) if rel.startswith("..") else rel


def _is_cpu(doc: dict) -> bool:
    return doc["meta"].get("device") == "cpu"


def _env_md(entries: list[tuple[str, Path, dict]], root: Path) -> str:
    lines = [
        "| file | device | driver | CUDA | torch | triton | max | mojo | commit | date | host | copy GB/s | matmul TF/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, path, doc in entries:
        m, c = doc["meta"], doc["ceilings"]
        rel = _rel(path, root)
        lines.append(
            f"| `{rel}` | {m.get('gpu_name') or m.get('device')} | {m.get('driver') or '–'} | "
            f"{m.get('cuda') or '–'} | {m.get('torch')} | {m.get('triton') or '–'} | {m.get('max') or '–'} | "
            f"{m.get('mojo') or '–'} | {tables.commits_md(doc)} | {tables.dates_md(doc)} | {m.get('host')} | "
            f"{c['copy']['gbps']:.4g} | {c['matmul']['tflops']:.4g} |"
        )
    return "\n".join(lines) + "\n"


def _timing_sentence(docs: list[dict]) -> str:
    if all(not _is_cpu(d) for d in docs):
        old = sum(str(r.get("method", "")).startswith("triton.do_bench") for d in docs for r in d["rows"])
        return (
            "Times are medians of CUDA-event timings with a cold L2 (rotating inputs, L2 flushed between calls); "
            + (
                f"{old} older rows were timed by triton.do_bench, whose events also hold the host's enqueue time at "
                "decode sizes (each row's `method` in the JSON says which; no ratio pairs rows of the two timers); "
                if old
                else ""
            )
        )
    if all(_is_cpu(d) for d in docs):
        return (
            "These are CPU results: times are medians of host wall-clock timings per call (no device timer, "
            "no cache flush); they say nothing about GPU performance; "
        )
    return (
        "Times are medians of CUDA-event timings with a cold L2 on GPUs and of host wall-clock timings on the "
        "CPU (each device section says which); "
    )


def _device_note(doc: dict) -> str:
    if _is_cpu(doc):
        return (
            "_CPU run: every time below is host wall-clock (the CPU has no device timer here; inputs rotate "
            "between two sets and caches are not flushed). Not comparable with GPU figures._"
        )
    return ""


def render(results_dir: Path, out_dir: Path, draw: bool = True) -> Path | None:
    """Write <out_dir>/README.md plus <device>_<op>.png, <device>_roofline.png and <device>_e2e.png;
    None if no op results.
    draw=False writes the markdown only (same text, the PNGs are not drawn)."""
    docs = load_all(results_dir)
    if not docs:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = sorted(((p.parent.name, p, d) for p, d in docs), key=_order)
    src_root = Path.cwd()  # source files are named relative to where the report is run (the repo root)
    entries = [(dev, p.resolve(), d) for dev, p, d in entries]
    all_docs = [d for _, _, d in entries]
    multi = any(len(runs(d)) > 1 for d in all_docs)
    wall = any(r.get("wall_us") is not None for d in all_docs for r in d["rows"])

    intro = (
        f"{_timing_sentence(all_docs)}"
        "GB/s counts the minimal bytes (each input read once, each output written once); % is of the "
        "roofline bound max(bytes / copy bandwidth, FLOPs / matmul peak), both ceilings measured in the "
        "same run. Every timed output first matched a float64 oracle (rel. error in the JSON). "
        "Ratios are baseline time / fusekit time (> 1: fusekit faster)."
    )
    if wall:
        intro += (
            " Where a cell has a `wall` line, it is the host wall-clock per call of N back-to-back calls "
            "between two synchronizations (launch and Python overhead included), measured separately from "
            "the time above it; training cells on a GPU also give the peak memory one call allocates "
            "(torch.cuda.max_memory_allocated above what was allocated before the call)."
        )
    md: list[str] = [
        "# fusekit benchmark report",
        "",
        "Generated by `python -m fusekit.report` from the JSON files under "
        f"`{results_dir}` (written by `python -m fusekit.bench`); do not edit by hand.",
        "",
        intro,
        "",
    ]
    if multi:
        md += [
            "Provenance: a results file may merge several runs (processes of one GPU session, possibly at "
            "different commits). The Sources table lists every commit of each file; in the tables a timed "
            "cell's superscript is its run, and each table is followed by its runs' commits, dates, "
            "versions and commands. Ratios within a case may compare rows of different runs.",
            "",
        ]
    md += [
        "## Headline: which backend wins each op, and by how much",
        "",
        tables.headline_md(tables.headline(entries, src_root)),
        *targets.section_md(entries, results_dir),
        "## Sources and ceilings",
        "",
    ]
    if multi:
        md += ["Versions and ceilings are each file's first run's; commits and dates cover all its runs.", ""]
    md += [_env_md(entries, src_root)]
    devices = list(dict.fromkeys(dev for dev, _, _ in entries))
    for dev in devices:
        dev_entries = [e for e in entries if e[0] == dev]
        md += [f"## {dev}", ""]
        note = _device_note(dev_entries[0][2])
        if note:
            md += [note, ""]
        sweep_docs = [d for _, _, d in dev_entries if suite_of(d) == "sweep"]
        roof = plots.roofline_plot(sweep_docs, out_dir / f"{dev}_roofline.png", draw)
        if roof:
            md += [f"![roofline on {dev}]({roof.name})", ""]
        for _, path, doc in dev_entries:
            op, suite = doc["op"], suite_of(doc)
            rel = _rel(path, src_root)
            flags = " (quick run)" if doc.get("quick") else ""
            flags += " (truncated by its time budget)" if doc.get("truncated") else ""
            md += [f"### {op}{SUITE_TITLES.get(suite, f' — {suite}')} — `{rel}`{flags}", ""]
            if suite == "sweep":
                png = plots.op_plot(doc, out_dir / f"{dev}_{op}.png", draw)
                if png:
                    md += [f"![{op} on {dev}]({png.name})", ""]
            md += [tables.op_table_md(doc)]
            md += [
                "Runs behind this table (a cell's superscript is its run):"
                if len(runs(doc)) > 1
                else "Run behind this table:",
                "",
                tables.runs_md(doc),
            ]
            e2e = tables.e2e_md(doc)
            if e2e:
                md += ["Per-call overhead (host wall-clock with sync, vs device time):", "", e2e]
            nt = tables.not_timed_md(doc)
            if nt:
                md += ["Not timed:", "", nt]
            rep = next((r["repro"] for r in doc["rows"] if r.get("status") == "ok"), None)
            if rep:
                md += [f"Repro one row: `{rep}` (each row's command is in the JSON).", ""]
    md += e2e_section.section_md(results_dir, out_dir, src_root, draw)  # e2e.json: its own schema
    md += host_section.section_md(results_dir, src_root)  # host.json: its own schema
    md += reliability.section_md(results_dir, src_root)
    path = out_dir / "README.md"
    path.write_text("\n".join(md).rstrip() + "\n")
    return path
