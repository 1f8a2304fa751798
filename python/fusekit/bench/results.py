"""Results files: one JSON per op and device, `benchmarks/results/<device-slug>/<op>.json`, holding the
environment (GPU, driver, CUDA, library versions, commit, date, host), the ceilings measured in the
same run, and one row per (case, provider)."""

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
    "python",
    "git_commit",
    "date",
    "host",
    "command",
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
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
    return os.environ.get("FUSEKIT_GIT_COMMIT")


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
        "python": platform.python_version(),
        "git_commit": _git_commit(),
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


def write(
    out_dir: Path, device: torch.device, op: str, meta: dict, ceilings: dict, rows: list[dict], **extra
) -> Path:
    """Write (overwrite) <out_dir>/<device slug>/<op>.json; returns its path."""
    d = Path(out_dir) / slug(device_name(device))
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{op}.json"
    doc = {"meta": meta, "op": op, "ceilings": ceilings, **extra, "rows": rows}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def load_all(results_dir: Path) -> list[tuple[Path, dict]]:
    """Every results JSON under `results_dir` (recursively), with its path."""
    docs = []
    for p in sorted(Path(results_dir).rglob("*.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict) and doc.get("meta", {}).get("schema") == SCHEMA and "rows" in doc:
            docs.append((p, doc))
    return docs
