"""The report's Reliability section: the records tests/reliability.py writes (`reliability*.json`, one per
test or sanitizer run, under the results folder) as one table — check, backend, cases, outcomes, commit."""

from __future__ import annotations

import os
from pathlib import Path

from fusekit.bench.results import load_docs

SCHEMA = "fusekit-reliability/1"
# issue #15's checks, in the report's order; a record's other checks follow in file order
CHECK_ORDER = (
    "conformance",
    "hostile inputs",
    "fuzz",
    "large inputs",
    "sanitizer memcheck",
    "sanitizer racecheck",
    "sanitizer synccheck",
    "CUDA graphs",
    "out of memory",
    "concurrency",
    "any device",
)
BACKEND_ORDER = ("torch", "triton", "mojo")


def load(results_dir: Path) -> list[tuple[Path, dict]]:
    """Every reliability record under `results_dir` (recursively), with its path."""
    return load_docs(results_dir, SCHEMA, key="checks", pattern="reliability*.json", in_meta=True)


def _rank(row: dict) -> tuple:
    c, b = row["check"], row["backend"]
    return (
        CHECK_ORDER.index(c) if c in CHECK_ORDER else len(CHECK_ORDER),
        BACKEND_ORDER.index(b) if b in BACKEND_ORDER else len(BACKEND_ORDER),
    )


def _failed(row: dict) -> str:
    """Failed plus errored tests; a sanitizer's own findings added in words."""
    cell = str(row.get("failed", 0) + row.get("errors", 0))
    san = row.get("sanitizer_errors")
    if san is not None:
        cell += f" ({san} sanitizer error{'s' if san != 1 else ''})"
    return cell


def section_md(results_dir: Path, root: Path) -> list[str]:
    """The section's markdown lines; one sentence when there is no record."""
    docs = load(results_dir)
    md = ["## Reliability", ""]
    if not docs:
        return [*md, f"No reliability record (`reliability*.json`) under `{results_dir}`.", ""]
    md += [
        "Test and sanitizer runs on the GPU (tests/run_gpu.sh, tests/sanitize_gpu.sh), recorded by "
        "tests/reliability.py from pytest's JUnit XML: cases counted per check (test file, or sanitizer "
        "tool), backend and device; failed counts errored tests too.",
        "",
        "| check | backend | device | cases | passed | failed | skipped | commit | date | record |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    seen = set()
    rows = [(r, p, d) for p, d in docs for r in d["checks"]]
    for r, p, d in sorted(rows, key=lambda t: _rank(t[0])):
        m = d["meta"]
        seen.add(r["check"])
        commit = (m.get("git_commit") or "?")[:10] + ("+dirty" if m.get("git_dirty") else "")
        device = m.get("gpu_name") if r.get("device") == "cuda" and m.get("gpu_name") else r.get("device")
        rel = os.path.relpath(p.resolve(), root)
        rel = str(p) if rel.startswith("..") else rel
        md.append(
            f"| {r['check']} | {r['backend']} | {device} | {r['cases']} | {r['passed']} | {_failed(r)} | "
            f"{r['skipped']} | {commit} | {(m.get('date') or '?')[:16]} | `{rel}` |"
        )
    missing = [c for c in CHECK_ORDER if c not in seen]
    md.append("")
    if missing:
        md += [f"Not in any record: {', '.join(missing)}.", ""]
    return md
