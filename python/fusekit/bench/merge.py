"""Merge result files of one op, measured by several processes in one GPU session, into one file.

    python -m fusekit.bench.merge --out benchmarks/results/nvidia-h200 a/rope.json b/rope.json ...

Why several processes: once MAX has run on a GPU its device allocator keeps most of the card's
memory, so torch's large reference tensors no longer fit in the same process. The mojo backend (and
MAX's own attention) is therefore timed in its own process on the same machine, minutes apart, and
the rows are merged here. Speedups are recomputed per case against the baselines in the merged
rows; `meta.merged_from` records each source's command, commit and date.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from fusekit.bench.run import _speedups


def merge(docs: list[dict]) -> dict:
    """One document per op: the first document's meta and ceilings, every row (later files win).

    Merging an already merged file keeps its rows' sources.
    """
    ops = {d["op"] for d in docs}
    if len(ops) != 1:
        raise ValueError(f"files hold different ops: {sorted(ops)}")
    out = json.loads(json.dumps(docs[0]))
    rows: dict[tuple[str, str], dict] = {}
    sources: list[dict] = []
    for d in docs:
        # each row keeps `source`: its index in meta.merged_from (command, commit, date of its run)
        own = d["meta"].get("merged_from") or [
            {k: d["meta"].get(k) for k in ("command", "git_commit", "date")}
        ]
        for r in d["rows"]:
            r = dict(r, source=len(sources) + r.get("source", 0))
            key = (r["case"], r["provider"])
            if r.get("status") == "ok" or rows.get(key, {}).get("status") != "ok":
                rows[key] = r  # a later skip never hides an earlier measurement
        sources += own
    by_case: dict[str, list[dict]] = defaultdict(list)
    for r in rows.values():
        by_case[r["case"]].append(r)
    for case_rows in by_case.values():
        _speedups(case_rows)
    out["rows"] = [r for case_rows in by_case.values() for r in case_rows]
    out["truncated"] = any(d.get("truncated") for d in docs)
    out["meta"]["merged_from"] = sources
    providers = {}
    for d in docs:
        providers.update(d["meta"].get("providers", {}))
    out["meta"]["providers"] = providers
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder to write <op>.json into")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    groups: dict[str, list[dict]] = defaultdict(list)
    for f in args.files:
        doc = json.loads(f.read_text())
        groups[doc["op"]].append(doc)
    args.out.mkdir(parents=True, exist_ok=True)
    for op, docs in groups.items():
        (args.out / f"{op}.json").write_text(json.dumps(merge(docs), indent=1))
        print(f"{op}: {len(docs)} file(s) -> {args.out / (op + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
