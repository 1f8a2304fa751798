"""The README's headline table, generated from the committed H200 results (never typed by hand: the
hand-kept table drifted from the JSON beside it, by up to 20% on some rows).

    python -m fusekit.report.readme_table            # print the table
    python -m fusekit.report.readme_table --write    # replace the block between the README's markers

Each cell gives a backend's time (TFLOP/s where the case is compute-bound) and the commit that timed it.
A ratio (baseline time / fusekit time, > 1: fusekit faster) is printed only where the baseline was
timed in the same session: the same run, or another process of it (same commit, GPU and timer, within
12 hours); or, where a later run replaced that baseline row, against the baseline the row's own run
timed ("against its own run's"). Elsewhere the cell gives the time alone: a ratio across sessions
compares different commits, days or timing methods. tests/test_readme.py checks the README holds
exactly this output.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

from fusekit.bench.pairing import own_run_ratio, run_of, same_session
from fusekit.bench.results import runs

RESULTS = Path("benchmarks/results/nvidia-h200")
README = Path("README.md")
BEGIN, END = "<!-- headline-table:begin -->", "<!-- headline-table:end -->"

# (results file, case, baseline provider, label)
CASES = (
    ("reduce_sum", "n=1073741824,dtype=fp32", "cub", "reduce_sum fp32 2^30"),
    ("reduce_sum", "n=1073741824,out=fp32,dtype=bf16", "cub", "reduce_sum bf16 → fp32 2^30"),
    ("rms_norm", "M=32768,N=8192,dtype=bf16", "torch-compile", "rms_norm 32768×8192"),
    ("rms_norm", "M=16384,N=65536,dtype=bf16", "torch-compile", "rms_norm 16384×65536"),
    ("layer_norm", "M=32768,N=8192,dtype=bf16", "torch-compile", "layer_norm 32768×8192"),
    ("layer_norm", "M=16384,N=65536,dtype=bf16", "torch-compile", "layer_norm 16384×65536"),
    ("rope", "B=16,S=4096,H=32,D=128,dtype=bf16", "torch-compile", "rope B16 S4096 H32 D128"),
    ("swiglu_ffn", "T=1,D=4096,F=11008,dtype=bf16", "torch-compile", "swiglu_ffn T=1 D4096 F11008"),
    ("swiglu_ffn", "T=4096,D=4096,F=11008,dtype=bf16", "torch-compile", "swiglu_ffn T=4096 D4096 F11008"),
    ("attention", "B=4,H=32,S=4096,D=64,causal=0,dtype=bf16", "sdpa", "attention B4 H32 S4096 D64"),
    ("attention", "B=4,H=32,S=4096,D=64,causal=1,dtype=bf16", "sdpa", "attention D64 causal"),
    ("attention", "B=4,H=32,S=4096,D=128,causal=0,dtype=bf16", "sdpa", "attention D128"),
    ("attention", "B=4,H=32,S=4096,D=128,causal=1,dtype=bf16", "sdpa", "attention D128 causal"),
    ("attention", "B=4,H=32,S=4096,D=256,causal=0,dtype=bf16", "sdpa", "attention D256"),
    ("attention", "B=4,H=32,S=4096,D=256,causal=1,dtype=bf16", "sdpa", "attention D256 causal"),
)
BACKENDS = ("triton", "mojo")
NAMES = {"cub": "CUB", "torch-compile": "torch.compile", "sdpa": "SDPA"}


def _figure(r: dict) -> str:
    if r.get("tflops") and r.get("bound") == "compute":
        return f"{r['tflops']:.0f} TFLOP/s"
    return f"{r['time_us']:.1f} µs" if r["time_us"] < 100 else f"{r['time_us']:.0f} µs"


def _commit(run: dict) -> str:
    return str(run.get("git_commit", "?"))[:7]


def rows(results: Path = RESULTS) -> list[tuple[str, ...]]:
    """One (label, triton cell, mojo cell, baseline cell) per headline case present in the results."""
    out = []
    docs: dict[str, dict] = {}
    for stem, case, base, label in CASES:
        path = results / f"{stem}.json"
        if stem not in docs:
            docs[stem] = json.loads(path.read_text()) if path.is_file() else {"rows": [], "meta": {}}
        doc = docs[stem]
        srcs = runs(doc) if doc["meta"] else []
        by = {r["provider"]: r for r in doc["rows"] if r["case"] == case and r.get("status") == "ok"}
        if not by:
            continue
        run = partial(run_of, srcs=srcs)
        b = by.get(base)
        cells = []
        for name in BACKENDS:
            r = by.get(name)
            if r is None:
                cells.append("not timed")
            elif b is None:
                cells.append(f"{_figure(r)} ({_commit(run(r))})")
            elif same_session(r, run(r), b, run(b)):
                cells.append(f"{b['time_us'] / r['time_us']:.2f}× ({_figure(r)}, {_commit(run(r))})")
            elif (own := own_run_ratio(r, run(r), base)) is not None:
                cells.append(f"{own:.2f}× against its own run's ({_figure(r)}, {_commit(run(r))})")
            else:
                cells.append(f"{_figure(r)} ({_commit(run(r))}; baseline of another session)")
        base_cell = f"{NAMES.get(base, base)} {_figure(b)} ({_commit(run(b))})" if b else "not timed"
        out.append((label, *cells, base_cell))
    return out


def table(results: Path = RESULTS) -> str:
    lines = [
        "| op, case (bf16 unless noted) | triton | mojo | baseline |",
        "|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in rows(results)),
    ]
    return "\n".join(lines) + "\n"


def block(results: Path = RESULTS) -> str:
    """The README block, markers included."""
    return f"{BEGIN}\n{table(results)}{END}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"replace the block in {README}")
    args = ap.parse_args(argv)
    if not args.write:
        sys.stdout.write(table())
        return 0
    text = README.read_text()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        print(f"{README}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    README.write_text(text[:i] + block() + text[j + len(END) :])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
