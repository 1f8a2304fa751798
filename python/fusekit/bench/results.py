"""Results files: one JSON per device, op and suite, `<root>/<device-slug>/<op>.json` (the "sweep"
suite, as always) or `<op>.<suite>.json` ("train", "small"), holding the environment (GPU, driver,
CUDA, library versions, commit, date, host, command), the ceilings measured in the same run, and one
row per (case, provider).

Where they go: GPU runs write under `benchmarks/results/` (committed, rendered into the report); CPU
runs write under `build/bench/results/` (git-ignored, rendered into `build/bench/report/`), never into
the committed results.

A file merged from several runs (`fusekit.bench.merge`) lists them in `meta.merged_from` (each with
its command, commit, date and versions) and every row names its run in `source`; `runs(doc)` gives
that list for merged and single-run files alike."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch

SCHEMA = "fusekit-bench/1"
META_KEYS = (
    "schema",
    "device",
    "gpu_name",
    "driver",
    "cuda",
    "torch",
    "triton",
    "max",
    "mojo",
    "liger",
    "python",
    "git_commit",
    "date",
    "host",
    "command",
)


# What identifies one run: kept per run when files are merged.
RUN_KEYS = (
    "command",
    "gpu_name",
    "git_commit",
    "git_dirty",
    "date",
    "host",
    "driver",
    "cuda",
    "torch",
    "triton",
    "max",
    "mojo",
    "liger",
    "python",
)
COMMITTED_RESULTS = Path("benchmarks/results")
LOCAL_RESULTS = Path("build/bench/results")  # git-ignored (build/): CPU and other local runs
SUITE_DEFAULT = "sweep"


def default_out(device: torch.device) -> Path:
    """Where results go by default: the committed tree for GPU runs, build/ for the CPU."""
    return COMMITTED_RESULTS if device.type == "cuda" else LOCAL_RESULTS


def is_committed_path(path: Path) -> bool:
    """Whether `path` lies in the committed results tree (relative to the current directory)."""
    here, root = Path(path).resolve(), COMMITTED_RESULTS.resolve()
    return here == root or root in here.parents


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """FUSEKIT_GIT_COMMIT when set (a copy of the tree elsewhere may carry a .git of another commit),
    else `git rev-parse HEAD`."""
    if os.environ.get("FUSEKIT_GIT_COMMIT"):
        return os.environ["FUSEKIT_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _git_dirty() -> bool | None:
    """True when the work tree differs from the commit (the timed code is not exactly the commit's);
    None when unknown (no git, or the commit was given by FUSEKIT_GIT_COMMIT: FUSEKIT_GIT_DIRTY=0/1)."""
    if os.environ.get("FUSEKIT_GIT_COMMIT"):
        flag = os.environ.get("FUSEKIT_GIT_DIRTY")
        return None if flag is None else flag not in ("", "0")
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
        if out.returncode == 0:
            return bool(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'; the CPU is always 'cpu'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def environment(device: torch.device) -> dict:
    meta: dict = {
        "schema": SCHEMA,
        "device": device.type,
        "gpu_name": device_name(device) if device.type == "cuda" else None,
        "driver": _driver() if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "max": _version("max"),
        "mojo": _version("mojo") or _version("mojo-compiler"),
        "liger": _version("liger-kernel") or _version("liger_kernel"),
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "command": " ".join(["python -m fusekit.bench", *sys.argv[1:]]),
        "cpu": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        meta["sm_count"] = prop.multi_processor_count
        meta["l2_bytes"] = getattr(prop, "L2_cache_size", None)
        meta["capability"] = f"{prop.major}.{prop.minor}"
        meta["memory_bytes"] = prop.total_memory
    return meta


def file_name(op: str, suite: str = SUITE_DEFAULT) -> str:
    return f"{op}.json" if suite == SUITE_DEFAULT else f"{op}.{suite}.json"


def write(
    out_dir: Path,
    device: torch.device,
    op: str,
    meta: dict,
    ceilings: dict,
    rows: list[dict],
    suite: str = SUITE_DEFAULT,
    **extra,
) -> Path:
    """Write (overwrite) <out_dir>/<device slug>/<op>[.<suite>].json; returns its path."""
    d = Path(out_dir) / slug(device_name(device))
    d.mkdir(parents=True, exist_ok=True)
    path = d / file_name(op, suite)
    doc = {"meta": meta, "op": op, "suite": suite, "ceilings": ceilings, **extra, "rows": rows}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def suite_of(doc: dict) -> str:
    return doc.get("suite") or SUITE_DEFAULT


def runs(doc: dict) -> list[dict]:
    """The runs behind a file, each with the RUN_KEYS its writer recorded: `meta.merged_from` for a
    merged file, else the file's own meta. Files merged before versions were kept per run list only
    command, commit and date; the run that is also the file's meta (same command, commit and date: the
    first merged file's) gets the versions from there; the others lack those keys (not recorded)."""
    meta = doc["meta"]
    own = {k: meta[k] for k in RUN_KEYS if k in meta}
    merged = meta.get("merged_from")
    if not merged:
        return [own]
    ident = ("command", "git_commit", "date")
    out = []
    for r in merged:
        same = all(r.get(k) == own.get(k) for k in ident)
        out.append({**own, **r} if same else dict(r))
    return out


def load_docs(
    results_dir: Path, schema: str, *, key: str = "rows", pattern: str = "*.json", in_meta: bool = False
) -> list[tuple[Path, dict]]:
    """Every JSON under `results_dir` (recursively, names matching `pattern`) whose schema (top level,
    or meta's with `in_meta`) is `schema` and that holds `key`, with its path; unreadable files skipped."""
    docs = []
    for p in sorted(Path(results_dir).rglob(pattern)):
        try:
            doc = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(doc, dict) or key not in doc:
            continue
        found = doc.get("meta", {}).get("schema") if in_meta else doc.get("schema")
        if found == schema:
            docs.append((p, doc))
    return docs


def load_all(results_dir: Path) -> list[tuple[Path, dict]]:
    """Every op results JSON under `results_dir` (recursively), with its path."""
    return load_docs(results_dir, SCHEMA, in_meta=True)
