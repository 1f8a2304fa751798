"""Merge result files of one op, measured by several processes in one GPU session, into one file.

    python -m fusekit.bench.merge --out benchmarks/results/nvidia-h200 a/rope.json b/rope.json ...

Why several processes: once MAX has run on a GPU its device allocator keeps most of the card's
memory, so torch's large reference tensors no longer fit in the same process. The mojo backend (and
MAX's own attention) is therefore timed in its own process on the same machine, minutes apart, and
the rows are merged here. Speedups are recomputed per case against the baselines in the merged
rows; `meta.merged_from` records each source run's command, commit, date and versions, and each row
its run (`source`), so the report can say exactly which commit timed which row.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from fusekit.bench.results import file_name, runs, suite_of
from fusekit.bench.run import speedups


def merge(docs: list[dict]) -> dict:
    """One document per op and suite: the first document's meta and ceilings, every row (later files
    win). Merging an already merged file keeps its rows' sources. A row's speedup over a baseline is
    against that baseline's timing in the row's own run where that run timed it (a backend re-measured
    later is compared with the baselines timed beside it, not with another session's), else against the
    merged baseline row (a backend timed in its own process of the same session, `--baselines none`).
    """
    kinds = {(d["op"], suite_of(d)) for d in docs}
    if len(kinds) != 1:
        raise ValueError(f"files hold different ops or suites: {sorted(kinds)}")
    out = json.loads(json.dumps(docs[0]))
    rows: dict[tuple[str, str], dict] = {}
    sources: list[dict] = []
    own_base: dict[tuple[str, int], list[dict]] = defaultdict(list)  # (case, source) -> its baseline rows
    # (case, provider, source) -> the ratios a row came with (a merged file's: its own run's)
    prior: dict[tuple[str, str, int], dict[str, float]] = {}
    for d in docs:
        # each row keeps `source`: its index in meta.merged_from (command, commit, date of its run)
        own = runs(d)
        for r in d["rows"]:
            r = dict(r, source=len(sources) + r.get("source", 0))
            if r.get("kind") != "baseline" and r.get("speedup_vs"):
                prior[(r["case"], r["provider"], r["source"])] = dict(r["speedup_vs"])
            key = (r["case"], r["provider"])
            if r.get("status") == "ok" and r.get("kind") == "baseline":
                own_base[(r["case"], r["source"])].append(r)
            if r.get("status") == "ok" or rows.get(key, {}).get("status") != "ok":
                rows[key] = r  # a later skip never hides an earlier measurement
        sources += own
    by_case: dict[str, list[dict]] = defaultdict(list)
    for r in rows.values():
        by_case[r["case"]].append(r)
    for case, case_rows in by_case.items():
        speedups(case_rows)
        # a run that timed baselines itself keeps its own ratios (same run, same GPU state); a row of an
        # already merged file keeps the ratios it came with (its run's baselines may since have been
        # replaced by a later run's rows); the merged baselines only fill what neither gives
        for r in case_rows:
            if r.get("status") != "ok" or r.get("kind") == "baseline":
                continue
            r["speedup_vs"].update(prior.get((case, r["provider"], r.get("source", 0)), {}))
            base = own_base.get((case, r.get("source", 0)))
            if base:
                r["speedup_vs"].update({b["provider"]: b["time_us"] / r["time_us"] for b in base})
    out["rows"] = [r for case_rows in by_case.values() for r in case_rows]
    out["truncated"] = any(d.get("truncated") for d in docs)
    out["meta"]["merged_from"] = sources
    providers = {}
    for d in docs:
        providers.update(d["meta"].get("providers", {}))
    out["meta"]["providers"] = providers
    # What could not run on the device, from any run, unless another run timed it.
    timed = {r["provider"] for r in out["rows"] if r.get("status") == "ok"}
    for key in ("skipped_backends", "skipped_baselines"):
        merged = {}
        for d in docs:
            merged.update(d["meta"].get(key) or {})
        if merged or key in out["meta"]:
            out["meta"][key] = {p: why for p, why in merged.items() if p not in timed}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder to write <op>.json into")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for f in args.files:
        doc = json.loads(f.read_text())
        groups[(doc["op"], suite_of(doc))].append(doc)
    args.out.mkdir(parents=True, exist_ok=True)
    for (op, suite), docs in groups.items():
        path = args.out / file_name(op, suite)
        path.write_text(json.dumps(merge(docs), indent=1))
        print(f"{op} ({suite}): {len(docs)} file(s) -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
