"""The report's host-path section: `host.json` files (schema fusekit-bench-host/1, written by
`python -m fusekit.bench.host`) as one table of decode-shaped calls — fusekit's host wall time per call
against its GPU time, a bare re-launch of the same Triton kernels (issue #11's target: <= 1.3x), torch
eager and Liger. Its own schema keeps it out of `bench.results.load_all` and the op sections."""

from __future__ import annotations

import statistics
from pathlib import Path

from fusekit.bench.results import load_docs
from fusekit.report.e2e import rel_path, run_line

SCHEMA = "fusekit-bench-host/1"
TITLE = "## Host path per call (decode shapes)"
TARGET = 1.3  # issue #11: fusekit wall per call <= 1.3x the bare Triton launch
VERSION_KEYS = ("torch", "triton", "liger", "max", "mojo")


def load(results_dir: Path) -> list[tuple[Path, dict]]:
    """Every host-path results file under `results_dir` (recursively), with its path."""
    return load_docs(results_dir, SCHEMA)


def _us(r: dict, key: str) -> str:
    v = r.get(key)
    if v is None:
        return "–"
    return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"


def floor_ratio(r: dict) -> float | None:
    """The row's target ratio: wall / the bare launch, or for a training row (forward + backward per
    call) wall / the bare launches inside a trivial autograd.Function, where the row has that floor."""
    return r.get("wall_vs_bare_autograd", r.get("wall_vs_bare"))


def _bare_us(r: dict) -> str:
    if r.get("bare_autograd_wall_us") is None:
        return _us(r, "bare_wall_us")
    return f"{_us(r, 'bare_wall_us')}; in autograd.Function {_us(r, 'bare_autograd_wall_us')}"


def ratio_md(r: dict) -> str:
    """wall / floor (floor_ratio), with ✓ within the target and a bold ✗ over it."""
    v = floor_ratio(r)
    if v is None:
        return "–"
    return f"{v:.2f}× ✓" if v <= TARGET else f"**{v:.2f}× ✗**"


def table_md(doc: dict) -> str:
    head = (
        "| case | backend | wall µs | GPU µs | bare Triton launch µs | wall ÷ bare | torch eager µs | Liger µs "
        "| kernels |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in doc["rows"]:
        kernels = ", ".join(f"`{k}`" for k in r.get("bare_kernels") or []) or "–"
        if r.get("status") != "ok":
            why = str(r.get("reason", ""))[:160].replace("|", "/").replace("\n", " ")
            lines.append(
                f"| `{r['case']}` | {r['backend']} | {r.get('status', '?')}: {why} | | | | | | {kernels} |"
            )
            continue
        lines.append(
            f"| `{r['case']}` | {r['backend']} | {_us(r, 'fusekit_wall_us')} | {_us(r, 'fusekit_gpu_us')} | "
            f"{_bare_us(r)} | {ratio_md(r)} | {_us(r, 'torch_wall_us')} | {_us(r, 'liger_wall_us')} "
            f"| {kernels} |"
        )
    return "\n".join(lines) + "\n"


def summary_md(doc: dict) -> str:
    """Per backend with a bare launch: how many cases meet the target, and the median ratio."""
    by: dict[str, list[float]] = {}
    for r in doc["rows"]:
        if r.get("status") == "ok" and floor_ratio(r) is not None:
            by.setdefault(r["backend"], []).append(floor_ratio(r))
    parts = [
        f"{b}: {sum(v <= TARGET for v in vs)} of {len(vs)} cases within {TARGET}× of the bare launch "
        f"(median {statistics.median(vs):.2f}×)"
        for b, vs in by.items()
    ]
    return "; ".join(parts) + "." if parts else ""


def section_md(results_dir: Path, root: Path) -> list[str]:
    """The section's markdown lines; nothing when there is no host file."""
    docs = load(results_dir)
    if not docs:
        return []
    md = [
        TITLE,
        "",
        "Host wall-clock per call of back-to-back calls (sync, N calls, sync; median of loops) at decode "
        "shapes: `wall` is the public op (`fusekit.ops.<op>(..., backend=...)`) after warm-up, `GPU` its "
        "CUDA-event time, `bare` the very Triton kernels that call launched re-launched directly "
        "(`JITFunction.run` with the recorded arguments: no fusekit Python, nothing allocated), the floor "
        "of a Python-launched Triton kernel; for a training call (forward + backward) also the same launches "
        "inside a trivial autograd.Function run with `.backward(dy)` on the same leaves, the floor with the "
        "autograd engine in it, and its wall ÷ bare is against that floor. Target (issue #11): wall ÷ bare ≤ "
        f"{TARGET}× (✓ met, ✗ missed). `torch eager` and `Liger` are the wall time per call of torch's "
        "eager equivalent and of Liger-Kernel's op, where one exists.",
        "",
    ]
    for path, doc in docs:
        md += [f"### {path.parent.name} — `{rel_path(path, root)}`", "", table_md(doc)]
        summ = summary_md(doc)
        if summ:
            md += [summ, ""]
        md += [f"Run: {run_line(doc['meta'], VERSION_KEYS)}", ""]
    return md
