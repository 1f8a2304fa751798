"""Merge result files of one op, measured by several processes in one GPU session, into one file.

    python -m fusekit.bench.merge --out benchmarks/results/nvidia-h200 a/rope.json b/rope.json ...

Why several processes: once MAX has run on a GPU its device allocator keeps most of the card's
memory, so torch's large reference tensors no longer fit in the same process. The mojo backend (and
MAX's own attention) is therefore timed in its own process on the same machine, minutes apart, and
the rows are merged here. Speedups are recomputed per case against the baselines in the merged
rows timed in the same session (same GPU, commit and timer, within 12 hours:
`fusekit.bench.pairing.same_session`; a baseline of another session gives no ratio), and files of
different GPUs are refused.
`meta.merged_from` records each source run's command, GPU, commit, date and versions, and each row its
run (`source`), so the report can say exactly which commit timed which row.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from fusekit.bench.pairing import run_of, same_session
from fusekit.bench.results import file_name, runs, suite_of


def _gpu_names(docs: list[dict]) -> set:
    """Every GPU the files name: each file's meta and each run of a merged file that recorded one."""
    names = {d["meta"]["gpu_name"] for d in docs if "gpu_name" in d["meta"]}
    names |= {r["gpu_name"] for d in docs for r in d["meta"].get("merged_from") or [] if "gpu_name" in r}
    return names


def _replaces(new: dict, old: dict | None) -> bool:
    """Later files win, except that a later skip never hides an earlier measurement (a later failure,
    e.g. a correctness check that now fails, does replace an earlier timing)."""
    return old is None or new.get("status") != "skipped" or old.get("status") != "ok"


def merge(docs: list[dict]) -> dict:
    """One document per op and suite: the first document's meta and ceilings, every row (later files
    win, `_replaces`). Files of different GPUs are refused (ValueError). Merging an already merged file
    keeps its rows' sources. A row's speedup over a baseline is against that baseline's timing in the
    row's own run where that run timed it (a backend re-measured later is compared with the baselines
    timed beside it), else the ratio the row came with (an already merged file's), else against the merged
    baseline row only where that row was timed in the same session (`same_session`: a backend timed in its
    own process, `--baselines none`, minutes apart); a baseline of another session gives no ratio.
    """
    kinds = {(d["op"], suite_of(d)) for d in docs}
    if len(kinds) != 1:
        raise ValueError(f"files hold different ops or suites: {sorted(kinds)}")
    gpus = _gpu_names(docs)
    if len(gpus) > 1:
        raise ValueError(f"files hold results of different GPUs: {' vs '.join(sorted(map(str, gpus)))}")
    out = json.loads(json.dumps(docs[0]))
    rows: dict[tuple[str, str], dict] = {}
    sources: list[dict] = []
    session: list[dict] = []  # per source: its run, the GPU from its file's meta where the run lacks it
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
            if _replaces(r, rows.get(key)):
                rows[key] = r
        sources += own
        session += [{"gpu_name": d["meta"].get("gpu_name"), **run} for run in own]
    by_case: dict[str, list[dict]] = defaultdict(list)
    for r in rows.values():
        by_case[r["case"]].append(r)

    for case, case_rows in by_case.items():
        base = [b for b in case_rows if b.get("status") == "ok" and b.get("kind") == "baseline"]
        for r in case_rows:
            if r.get("status") != "ok":
                continue
            # the merged baselines timed in this row's session (its own run, or a process of its session)
            r["speedup_vs"] = {
                b["provider"]: b["time_us"] / r["time_us"]
                for b in base
                if b["provider"] != r["provider"]
                and same_session(r, run_of(r, session), b, run_of(b, session))
            }
            if r.get("kind") == "baseline":
                continue
            # a row of an already merged file keeps the ratios it came with (its run's baselines may since
            # have been replaced by a later run's rows); a run that timed baselines itself keeps its own
            # ratios (same run, same GPU state)
            r["speedup_vs"].update(prior.get((case, r["provider"], r.get("source", 0)), {}))
            mine = own_base.get((case, r.get("source", 0)))
            if mine:
                r["speedup_vs"].update({b["provider"]: b["time_us"] / r["time_us"] for b in mine})
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
