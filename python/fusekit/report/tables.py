"""Markdown tables from committed results: a headline (who wins each op, by how much, from which
file) and one table per op (every provider's time and rate, winner in bold, speedups over baselines)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

MATMUL_OPS = frozenset({"swiglu_ffn", "attention"})


def ok_rows(doc: dict) -> list[dict]:
    return [r for r in doc["rows"] if r.get("status") == "ok"]


def by_case(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """case label -> provider -> row (case order as in the file)."""
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["case"], {})[r["provider"]] = r
    return out


def providers_in(doc: dict) -> tuple[list[str], list[str]]:
    """(backends, baselines) that apply to the file's op, in first-seen order (a baseline of another op,
    e.g. SDPA in the rms_norm file, is left out)."""
    seen: dict[str, str] = {}
    for r in doc["rows"]:
        if r.get("status") == "skipped" and str(r.get("reason", "")).endswith(f"has no {doc['op']}"):
            continue
        seen.setdefault(r["provider"], r["kind"])
    return [p for p, k in seen.items() if k == "backend"], [p for p, k in seen.items() if k == "baseline"]


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def _rate(r: dict) -> str:
    if r.get("tflops"):
        return f"{r['tflops']:.0f} TF/s" if r["tflops"] >= 10 else f"{r['tflops']:.2f} TF/s"
    g = r["gbps"]
    return f"{g:.0f} GB/s" if g >= 10 else f"{g:.2f} GB/s"


def _us(t: float) -> str:
    return f"{t:.1f}" if t < 1000 else f"{t:,.0f}"


def headline(entries: list[tuple[str, Path, dict]], root: Path) -> list[dict]:
    """Per (device, op): the fusekit backend with the best geometric-mean speedup over the best baseline of
    each case, with its range, the per-baseline geomeans, how many cases it won, and the source file."""
    out = []
    for dev, path, doc in entries:
        cases = by_case(ok_rows(doc))
        backends, baselines = providers_in(doc)
        best: dict | None = None
        for b in backends:
            sp, per_base, won, pct, n = [], defaultdict(list), 0, [], 0
            largest: tuple[int, float] = (-1, math.nan)  # (bytes, speedup) of the biggest case
            for rows in cases.values():
                if b not in rows:
                    continue
                base_ts = {p: r["time_us"] for p, r in rows.items() if r["kind"] == "baseline"}
                if not base_ts:
                    continue
                n += 1
                t = rows[b]["time_us"]
                sp.append(min(base_ts.values()) / t)
                if rows[b]["bytes"] > largest[0]:
                    largest = (rows[b]["bytes"], sp[-1])
                for p, bt in base_ts.items():
                    per_base[p].append(bt / t)
                won += t <= min(r["time_us"] for r in rows.values())
                pct.append(rows[b]["pct_of_ceiling"])
            if not n:
                continue
            cand = {
                "device": dev,
                "op": doc["op"],
                "backend": b,
                "speedup": geomean(sp),
                "min": min(sp),
                "max": max(sp),
                "largest": largest[1],
                "per_baseline": {p: geomean(v) for p, v in per_base.items()},
                "won": won,
                "cases": n,
                "pct_median": statistics.median(pct),
                "source": str(path.relative_to(root)) if path.is_relative_to(root) else str(path),
                "baselines": baselines,
            }
            if best is None or cand["speedup"] > best["speedup"]:
                best = cand
        if best:
            out.append(best)
    return out


def headline_md(items: list[dict]) -> str:
    if not items:
        return "_No fusekit backend has a timed case next to a baseline yet._\n"
    lines = [
        "| device | op | fastest fusekit backend | × best baseline (geomean) | range | largest case "
        "| × each baseline (geomean) | cases won | median % of ceiling | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for h in items:
        per = ", ".join(f"{p} {v:.2f}×" for p, v in h["per_baseline"].items())
        lines.append(
            f"| {h['device']} | {h['op']} | **{h['backend']}** | **{h['speedup']:.2f}×** | "
            f"{h['min']:.2f}–{h['max']:.2f}× | {h['largest']:.2f}× | {per} | {h['won']}/{h['cases']} | {h['pct_median']:.0f}% | "
            f"`{h['source']}` |"
        )
    return "\n".join(lines) + "\n"


def op_table_md(doc: dict) -> str:
    """Rows = cases; one column per provider (time µs, rate, % of ceiling), fastest in bold; then the best
    backend's speedup over each baseline."""
    backends, baselines = providers_in(doc)
    cases = by_case(doc["rows"])
    provs = backends + baselines
    head = ["case", *provs, *[f"best backend × {b}" for b in baselines]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, rows in cases.items():
        ok = {p: r for p, r in rows.items() if r.get("status") == "ok"}
        fastest = min(ok, key=lambda p: ok[p]["time_us"]) if ok else None
        cells = [f"`{label}`"]
        for p in provs:
            r = rows.get(p)
            if r is None or r.get("status") == "skipped":
                cells.append("–")
            elif r.get("status") != "ok":
                cells.append("failed")
            else:
                c = f"{_us(r['time_us'])} µs<br>{_rate(r)}, {r['pct_of_ceiling']:.0f}%"
                cells.append(f"**{c}**" if p == fastest else c)
        okb = [ok[b] for b in backends if b in ok]
        bb = min(okb, key=lambda r: r["time_us"]) if okb else None
        for b in baselines:
            if bb is None or b not in ok:
                cells.append("–")
            else:
                cells.append(f"{ok[b]['time_us'] / bb['time_us']:.2f}× ({bb['provider']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def not_timed_md(doc: dict) -> str:
    """Failed and skipped providers with their reasons (grouped, counted)."""
    groups: dict[tuple[str, str, str], int] = defaultdict(int)
    for r in doc["rows"]:
        if r.get("status") == "ok":
            continue
        if r["status"] == "skipped" and str(r.get("reason", "")).endswith(f"has no {doc['op']}"):
            continue  # a baseline of another op: not news
        groups[(r["provider"], r["status"], str(r.get("reason"))[:200])] += 1
    if not groups:
        return ""
    lines = ["| provider | status | cases | reason |", "|---|---|---|---|"]
    for (p, s, why), n in sorted(groups.items()):
        lines.append(f"| {p} | {s} | {n} | {why.replace('|', '/').replace(chr(10), ' ')} |")
    return "\n".join(lines) + "\n"


def e2e_md(doc: dict) -> str:
    """Device time vs end-to-end call time (and kernel-only time where the profiler saw it), per provider:
    the median over cases of each, to show per-call overhead (MAX's execute, Python dispatch)."""
    per: dict[str, list[dict]] = defaultdict(list)
    for r in ok_rows(doc):
        per[r["provider"]].append(r)
    if not per:
        return ""
    lines = [
        "| provider | cases | median e2e − device time (µs) | median kernel-only / device time |",
        "|---|---|---|---|",
    ]
    for p, rows in per.items():
        over = statistics.median(r["e2e_us"] - r["time_us"] for r in rows)
        ks = [r["kernel_us"] / r["time_us"] for r in rows if r.get("kernel_us")]
        k = f"{statistics.median(ks):.2f}" if ks else "–"
        lines.append(f"| {p} | {len(rows)} | {over:.1f} | {k} |")
    return "\n".join(lines) + "\n"
