"""`python -m fusekit.report [--results benchmarks/results] [--out benchmarks/report]`

Renders the committed results (no GPU needed) into <out>/README.md and PNG plots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fusekit.report.render import render


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusekit.report", description=__doc__.split("\n")[2])
    ap.add_argument("--results", default="benchmarks/results", help="results root (searched recursively)")
    ap.add_argument("--out", default="benchmarks/report", help="output folder for README.md and PNGs")
    args = ap.parse_args(argv)
    md = render(Path(args.results), Path(args.out))
    if md is None:
        print(f"no results files under {args.results}", file=sys.stderr)
        return 1
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
