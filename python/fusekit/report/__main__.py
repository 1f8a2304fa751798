"""`python -m fusekit.report [--results DIR] [--out DIR]`

Renders results files (no GPU needed) into <out>/README.md and PNG plots. With no arguments: the
committed GPU results (benchmarks/results -> benchmarks/report), and, when a local run left any, the
git-ignored local results (build/bench/results -> build/bench/report, e.g. the CPU job's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fusekit.bench.results import COMMITTED_RESULTS, LOCAL_RESULTS, load_all
from fusekit.report.render import render

COMMITTED_REPORT = Path("benchmarks/report")


def _default_out(results: Path) -> Path:
    """benchmarks/report for the committed results, else a `report` folder beside the results folder."""
    if results.resolve() == COMMITTED_RESULTS.resolve():
        return COMMITTED_REPORT
    return results.parent / "report"


def _render(results: Path, out: Path) -> int:
    if out.resolve() == COMMITTED_REPORT.resolve():
        cpu = [str(p) for p, d in load_all(results) if d["meta"].get("device") == "cpu"]
        if cpu:
            print(
                f"refusing to render CPU results into {COMMITTED_REPORT}: {', '.join(cpu[:3])}",
                file=sys.stderr,
            )
            return 2
    md = render(results, out)
    if md is None:
        print(f"no results files under {results}", file=sys.stderr)
        return 1
    print(f"wrote {md}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusekit.report", description=__doc__.split("\n")[2])
    ap.add_argument(
        "--results", default=None, help=f"results root, searched recursively (default: {COMMITTED_RESULTS})"
    )
    ap.add_argument("--out", default=None, help="output folder for README.md and PNGs")
    args = ap.parse_args(argv)
    if args.results is not None:
        results = Path(args.results)
        return _render(results, Path(args.out) if args.out else _default_out(results))
    rc = _render(COMMITTED_RESULTS, Path(args.out) if args.out else COMMITTED_REPORT)
    if args.out is None and load_all(LOCAL_RESULTS):
        print(f"local results (git-ignored) found under {LOCAL_RESULTS}:")
        rc = max(rc, _render(LOCAL_RESULTS, _default_out(LOCAL_RESULTS)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
