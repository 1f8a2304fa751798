"""Markdown tables from results files: a headline (who wins each op, by how much, from which file), one
table per op and suite (every provider's time and rate, winner in bold, speedups over baselines), and
the provenance of every timed cell (which run — commit, date, versions, command — measured it)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from fusekit.bench import pairing
from fusekit.bench.results import runs, suite_of

NOT_RECORDED = "n/r"  # a version the run did not record (files merged before versions were kept per run)


def ok_rows(doc: dict) -> list[dict]:
    return [r for r in doc["rows"] if r.get("status") == "ok"]


def is_matmul(doc: dict) -> bool:
    """An op whose rows count FLOPs (rates in TFLOP/s); the others are memory-bound (GB/s)."""
    return any(r.get("flops") for r in doc["rows"])


def op_title(doc: dict) -> str:
    """The op, with its suite when it is not the forward sweep: "layer_norm (train)"."""
    suite = suite_of(doc)
    return doc["op"] if suite == "sweep" else f"{doc['op']} ({suite})"


def by_case(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """case label -> provider -> row (case order as in the file)."""
    out: dict[str, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r["case"], {})[r["provider"]] = r
    return out


def providers_in(doc: dict) -> tuple[list[str], list[str]]:
    """(backends, baselines) that apply to the file's op, in first-seen order (a baseline of another op,
    e.g. SDPA in an old norm file, is left out)."""
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


def _mib(b: float) -> str:
    m = b / 2**20
    return f"{m:.1f} MiB" if m < 100 else f"{m:,.0f} MiB"


# --- provenance ----------------------------------------------------------------------------------------
def commit_str(run: dict) -> str:
    c = (run.get("git_commit") or "?")[:10]
    return f"{c}+dirty" if run.get("git_dirty") else c


def run_tag(doc: dict, row: dict) -> str:
    """A superscript naming the row's run, where the file holds more than one run."""
    if len(runs(doc)) < 2:
        return ""
    return f"<sup>{row.get('source', 0) + 1}</sup>"


def _ranges(nums: list[int]) -> str:
    """[1, 2, 3, 5] -> "1–3, 5"."""
    out, start = [], None
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}–{n}")
            start = None
    return ", ".join(out)


def commits_md(doc: dict) -> str:
    """Every commit behind a file with the runs it timed: "9ab55b2 (runs 1–3), fd8ab88 (runs 4–5)"; a
    single-run file names just its commit."""
    rs = runs(doc)
    by: dict[str, list[int]] = {}
    for i, r in enumerate(rs, 1):
        by.setdefault(commit_str(r), []).append(i)
    if len(rs) == 1:
        return next(iter(by))
    return ", ".join(f"{c} (run{'s' if len(ns) > 1 else ''} {_ranges(ns)})" for c, ns in by.items())


def dates_md(doc: dict) -> str:
    ds = sorted((r.get("date") or "")[:16] for r in runs(doc))
    return ds[0] if ds[0] == ds[-1] else f"{ds[0]} – {ds[-1][11:] if ds[0][:10] == ds[-1][:10] else ds[-1]}"


def runs_md(doc: dict) -> str:
    """The runs behind a table: commit, date, versions and command of each, and what each timed."""
    rs = runs(doc)
    timed: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in ok_rows(doc):
        timed[r.get("source", 0)][r["provider"]] += 1
    keys = ("torch", "triton", "max", "mojo", "liger")
    head = "| run | commit | date | " + " | ".join(keys) + " | command | timed rows |"
    lines = [head, "|" + "---|" * (len(keys) + 5)]
    for i, run in enumerate(rs):
        vers = []
        for k in keys:
            v = run.get(k, NOT_RECORDED) if k in run else NOT_RECORDED
            vers.append("–" if v is None else str(v))
        who = ", ".join(f"{p} {n}" for p, n in timed.get(i, {}).items()) or "none"
        cmd = str(run.get("command") or "?").replace("|", "\\|")
        lines.append(
            f"| {i + 1} | {commit_str(run)} | {(run.get('date') or '')[:16]} | {' | '.join(vers)} | "
            f"`{cmd}` | {who} |"
        )
    return "\n".join(lines) + "\n"


# --- tables -------------------------------------------------------------------------------------------
def _ratios(row: dict, base_rows: dict[str, dict], srcs: list[dict]) -> dict[str, float]:
    """Baseline time / this row's time per baseline timed in the row's session (fusekit.bench.pairing:
    the same run or process of it, or the ratio the row's own run measured where a later run replaced
    that baseline row); a baseline of another session gives no ratio (it compared other commits, days
    or timers: 201 such pairs were in the merged files)."""
    out = {}
    for p, b in base_rows.items():
        if (v := pairing.ratio(row, b, srcs)) is not None:
            out[p] = v
    return out


def headline(entries: list[tuple[str, Path, dict]], root: Path) -> list[dict]:
    """Per (device, op, suite): the fusekit backend with the best geometric-mean speedup over the best
    baseline of each case (ratios of its session only, `_ratios`; a case whose fastest baseline was timed
    in another session is left out and counted as unpaired), with its range, the per-baseline geomeans,
    how many cases it won, and the source file."""
    out = []
    for dev, path, doc in entries:
        cases = by_case(ok_rows(doc))
        backends, baselines = providers_in(doc)
        srcs = runs(doc)
        cands: list[dict] = []
        for b in backends:
            sp, per_base, won, pct, n, stale, unpaired = [], defaultdict(list), 0, [], 0, False, 0
            largest: tuple[int, float] = (-1, math.nan)  # (bytes, speedup) of the biggest case
            for rows in cases.values():
                if b not in rows:
                    continue
                base_rows = {p: r for p, r in rows.items() if r["kind"] == "baseline"}
                if not base_rows:
                    continue
                ratios = _ratios(rows[b], base_rows, srcs)
                for p, v in ratios.items():
                    per_base[p].append(v)
                # the case counts only where its fastest baseline was timed in the row's session: a
                # weaker baseline standing in for it would flatter the backend
                if min(base_rows, key=lambda p: base_rows[p]["time_us"]) not in ratios:
                    unpaired += 1
                    continue
                n += 1
                t = rows[b]["time_us"]
                # a ratio from the row's own run whose baseline row the file has since replaced
                stale |= any(rows[p].get("source") != rows[b].get("source") for p in ratios)
                sp.append(min(ratios.values()))
                if rows[b]["bytes"] > largest[0]:
                    largest = (rows[b]["bytes"], sp[-1])
                won += t <= min(r["time_us"] for r in rows.values())
                pct.append(rows[b]["pct_of_ceiling"])
            src = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
            if not n:
                if unpaired:  # timed, but never beside its session's fastest baseline: no ratio to show
                    cands.append({"device": dev, "op": op_title(doc), "backend": b, "speedup": None,
                                  "unpaired": unpaired, "source": src})  # fmt: skip
                continue
            cands.append(
                {
                    "device": dev,
                    "op": op_title(doc),
                    "backend": b,
                    "speedup": geomean(sp),
                    "min": min(sp),
                    "max": max(sp),
                    "largest": largest[1],
                    "per_baseline": {p: geomean(v) for p, v in per_base.items()},
                    "won": won,
                    "cases": n,
                    "pct_median": statistics.median(pct),
                    "source": src,
                    "baselines": baselines,
                    "stale": stale,
                    "unpaired": unpaired,
                }
            )
        # the best kernel backend with ratios; else one timed without a same-session baseline; the torch
        # backend (the reference) only where no kernel backend was timed
        kernels = [c for c in cands if c["backend"] != "torch"]
        pool = [c for c in kernels if c["speedup"] is not None] or kernels or cands
        if pool:
            out.append(max(pool, key=lambda c: -math.inf if c["speedup"] is None else c["speedup"]))
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
        if h["speedup"] is None:
            lines.append(
                f"| {h['device']} | {h['op']} | **{h['backend']}** | – | – | – | – "
                f"| 0/0 (+{h['unpaired']} unpaired ‡) | – | `{h['source']}` |"
            )
            continue
        per = ", ".join(f"{p} {v:.2f}×" for p, v in h["per_baseline"].items())
        won = f"{h['won']}/{h['cases']}" + (f" (+{h['unpaired']} unpaired ‡)" if h.get("unpaired") else "")
        lines.append(
            f"| {h['device']} | {h['op']} | **{h['backend']}**{' †' if h.get('stale') else ''} | **{h['speedup']:.2f}×** | "
            f"{h['min']:.2f}–{h['max']:.2f}× | {h['largest']:.2f}× | {per} | {won} | {h['pct_median']:.0f}% | "
            f"`{h['source']}` |"
        )
    lines += [
        "",
        "Ratios only against baselines timed in the backend row's session (its run, or a process of that "
        "session: same commit, GPU and timer; `fusekit.bench.pairing`).",
    ]
    if any(h.get("unpaired") for h in items):
        lines += [
            "",
            "‡ cases left out of the × columns: their fastest baseline was timed in another session (the "
            "times are in the op's table).",
        ]
    if any(h.get("stale") for h in items):
        lines += [
            "",
            "† some of these ratios are against baseline rows of the backend's own run that the file has since "
            "replaced with a later run's (the cases won compare the times in the file): see the targets section.",
        ]
    return "\n".join(lines) + "\n"


def _cell(doc: dict, r: dict, fastest: bool) -> str:
    """Time, (host wall per call in a loop), rate and % of the ceiling, (peak memory); the run tag."""
    parts = [f"{_us(r['time_us'])} µs"]
    if r.get("wall_us") is not None:
        parts.append(f"wall {_us(r['wall_us'])} µs")
    parts.append(f"{_rate(r)}, {r['pct_of_ceiling']:.0f}%")
    if r.get("peak_mem_bytes") is not None and suite_of(doc) == "train":
        parts.append(f"peak {_mib(r['peak_mem_bytes'])}")
    c = "<br>".join(parts)
    return (f"**{c}**" if fastest else c) + run_tag(doc, r)


def op_table_md(doc: dict) -> str:
    """Rows = cases; one column per provider (time µs, rate, % of ceiling), fastest in bold; then the best
    backend's speedup over each baseline."""
    backends, baselines = providers_in(doc)
    cases = by_case(doc["rows"])
    srcs = runs(doc)
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
                cells.append(_cell(doc, r, p == fastest))
        okb = [ok[b] for b in backends if b in ok]
        bb = min(okb, key=lambda r: r["time_us"]) if okb else None
        for b in baselines:
            v = _ratios(bb, {b: ok[b]}, srcs).get(b) if bb is not None and b in ok else None
            if v is None:
                cells.append("–" if bb is None or b not in ok else "– (other session)")
            else:
                cells.append(f"{v:.2f}× ({bb['provider']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def not_timed_md(doc: dict) -> str:
    """Failed and skipped providers with their reasons (grouped, counted), and the backends and baselines
    that could not run on the device at all."""
    groups: dict[tuple[str, str, str], int | str] = defaultdict(int)
    for r in doc["rows"]:
        if r.get("status") == "ok":
            continue
        if r["status"] == "skipped" and str(r.get("reason", "")).endswith(f"has no {doc['op']}"):
            continue  # a baseline of another op: not news
        groups[(r["provider"], r["status"], str(r.get("reason"))[:200])] += 1
    meta = doc["meta"]
    for key in ("skipped_backends", "skipped_baselines"):
        for p, why in (meta.get(key) or {}).items():
            groups[(p, "not available", str(why)[:200])] = "all"
    if not groups:
        return ""
    lines = ["| provider | status | cases | reason |", "|---|---|---|---|"]
    for (p, s, why), n in sorted(groups.items()):
        lines.append(f"| {p} | {s} | {n} | {why.replace('|', '/').replace(chr(10), ' ')} |")
    return "\n".join(lines) + "\n"


def e2e_md(doc: dict) -> str:
    """Device time vs end-to-end call time (and kernel-only time where the profiler saw it), per provider:
    the median over cases of each, to show per-call overhead (MAX's execute, Python dispatch). Rows that
    record it also give the host wall time per call of back-to-back calls."""
    per: dict[str, list[dict]] = defaultdict(list)
    for r in ok_rows(doc):
        per[r["provider"]].append(r)
    if not per:
        return ""
    wall = any(r.get("wall_us") is not None for r in ok_rows(doc))
    head = "| provider | cases | median e2e − device time (µs) | median kernel-only / device time |"
    lines = [
        head + (" median wall per call (loop) − device time (µs) |" if wall else ""),
        "|---|---|---|---|",
    ]
    lines[1] += "---|" if wall else ""
    for p, rows in per.items():
        over = statistics.median(r["e2e_us"] - r["time_us"] for r in rows)
        ks = [r["kernel_us"] / r["time_us"] for r in rows if r.get("kernel_us")]
        k = f"{statistics.median(ks):.2f}" if ks else "–"
        line = f"| {p} | {len(rows)} | {over:.1f} | {k} |"
        if wall:
            ws = [r["wall_us"] - r["time_us"] for r in rows if r.get("wall_us") is not None]
            line += f" {statistics.median(ws):.1f} |" if ws else " – |"
        lines.append(line)
    return "\n".join(lines) + "\n"
