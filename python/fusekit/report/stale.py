"""Which committed results predate a change to the kernels they measure (what to re-measure next).

    python -m fusekit.report.stale [--results benchmarks/results/nvidia-h200]

For each results file and kernel backend (triton, mojo): the commits that timed its rows, and the commits
since the oldest of them that touched the op's kernel files (`kernel_paths`; shared launch / utility
files count for every op). Reads git history, so it is a planning tool, not part of the rendered report
(which must not change when an unrelated commit lands).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from fusekit.bench.results import runs

# op -> file globs per backend (the op's kernels, forward and backward), and each backend's shared files
_OWN = {
    "triton": {
        "attention": ("attention*.py", "_attention*.py", "_exp2_poly.py"),
        "rms_norm": ("rms_norm.py", "_norm_bwd.py", "_coop.py"),
        "layer_norm": ("layer_norm.py", "_norm_bwd.py", "_coop.py"),
        "swiglu_ffn": ("swiglu_ffn.py", "_ffn*.py"),
        "rope": ("rope.py",),
        "reduce_sum": ("reduce_sum.py",),
        "linear_cross_entropy": ("linear_cross_entropy.py",),
    },
    "mojo": {
        "attention": ("attention.mojo", "_attention*.mojo"),
        "rms_norm": ("rms_norm.mojo", "_norm*.mojo"),
        "layer_norm": ("layer_norm.mojo", "_norm*.mojo"),
        "swiglu_ffn": ("swiglu_ffn.mojo", "_swiglu*.mojo", "tc"),
        "rope": ("rope.mojo",),
        "reduce_sum": ("reduce_sum.mojo",),
        "linear_cross_entropy": ("linear_cross_entropy.mojo",),
    },
}
_SHARED = {
    "triton": ("_config.py", "_launch.py", "_raw_launch.py", "_replay.py", "_tiles.py"),
    "mojo": ("_util.mojo",),
}
_DIR = {"triton": "kernels_triton", "mojo": "mojo"}


def kernel_paths(backend: str, op: str) -> list[str]:
    """git pathspecs of the files whose change makes `backend`'s `op` figures stale."""
    own = _OWN.get(backend, {}).get(op)
    if own is None:
        return []
    return [f":(glob){_DIR[backend]}/{g}" for g in (*own, *_SHARED[backend])]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def later_commits(commit: str, paths: list[str]) -> list[str]:
    """Short hashes of commits after `commit` (on HEAD's history) touching `paths`, newest first; a commit
    git does not know gives every commit touching them."""
    try:
        _git("cat-file", "-e", f"{commit}^{{commit}}")
        rng = [f"{commit}..HEAD"]
    except subprocess.CalledProcessError:
        rng = ["HEAD"]
    out = _git("log", "--format=%h", *rng, "--", *paths)
    return out.split() if out else []


def stale_rows(results: Path) -> list[tuple[str, str, str, list[str]]]:
    """(file, backend, commits that timed its rows, later kernel commits) for every stale pair."""
    out = []
    for path in sorted(results.glob("*.json")):
        doc = json.loads(path.read_text())
        if "rows" not in doc or "meta" not in doc or doc.get("op") not in _OWN["triton"]:
            continue
        srcs = runs(doc)
        for backend in _OWN:
            commits = {
                str(srcs[min(r.get("source", 0), len(srcs) - 1)].get("git_commit", "?"))[:7]
                for r in doc["rows"]
                if r["provider"] == backend and r.get("status") == "ok"
            }
            if not commits:
                continue
            paths = kernel_paths(backend, doc["op"])
            later = set()
            for c in commits:
                later |= set(later_commits(c, paths))
            if later:
                order = _git("log", "--format=%h", "HEAD", "--", *paths).split()  # newest first
                out.append((path.name, backend, ", ".join(sorted(commits)), [h for h in order if h in later]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/nvidia-h200"))
    args = ap.parse_args(argv)
    rows = stale_rows(args.results)
    print("| file | backend | timed at | later kernel commits (newest first) |")
    print("|---|---|---|---|")
    for name, backend, commits, later in rows:
        shown = ", ".join(later[:4]) + (f" (+{len(later) - 4})" if len(later) > 4 else "")
        print(f"| {name} | {backend} | {commits} | {len(later)}: {shown} |")
    if not rows:
        print(
            "(none: every kernel backend row was timed at or after its kernels' last change)", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
