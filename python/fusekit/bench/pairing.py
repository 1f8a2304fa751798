"""Which baseline a fusekit row may be compared with: one timed in the same session.

A merged results file (fusekit.bench.merge) holds rows of several runs, some days and commits apart. A
ratio between a backend row and a baseline row is honest only where both were timed in one session: the
same run, or two processes of it (the mojo backend runs in its own process) with the same commit, GPU and
timer, started within SESSION_H hours. Where a later run replaced the baseline row, the ratio the row's
own run measured (kept in its `speedup_vs`) still holds if that run's command timed the baseline.
"""

from __future__ import annotations

import datetime as _dt

SESSION_H = 12.0  # processes of one GPU session are minutes apart; other sessions are days apart


def _date(run: dict) -> _dt.datetime | None:
    try:
        d = _dt.datetime.fromisoformat(str(run["date"]))
    except (KeyError, TypeError, ValueError):
        return None
    return d if d.tzinfo else d.replace(tzinfo=_dt.timezone.utc)


def same_session(a: dict, ra: dict, b: dict, rb: dict) -> bool:
    """Rows a and b, of runs ra and rb (results.runs entries), were timed in one GPU session: one run, or
    two processes of it (the mojo backend times in its own process, `--baselines none`) with the same GPU,
    the same known commit (neither dirty), the same timing method (where both rows record it), started
    within SESSION_H hours of each other. Unknown commit or date: not shown to be one session."""
    if a.get("source", 0) == b.get("source", 0):
        return True
    if ra.get("gpu_name") != rb.get("gpu_name"):
        return False
    if not ra.get("git_commit") or ra.get("git_commit") != rb.get("git_commit"):
        return False
    if ra.get("git_dirty") or rb.get("git_dirty"):
        return False
    if a.get("method") and b.get("method") and a["method"] != b["method"]:
        return False
    da, db = _date(ra), _date(rb)
    return da is not None and db is not None and abs((da - db).total_seconds()) <= SESSION_H * 3600


def own_run_ratio(r: dict, run: dict, base: str) -> float | None:
    """The ratio r's own run measured against `base` (kept in r's speedup_vs after a later run replaced
    that baseline row), where the run timed `base`: its command names it after --baselines (the op bench)
    or --providers (the model bench), or names neither (then it timed every baseline that ran there);
    else None. A run that recorded no command (hand-built documents; every committed run has one) is
    taken at its stored ratios."""
    ratio = (r.get("speedup_vs") or {}).get(base)
    if not ratio:
        return None
    words = str(run.get("command") or "").replace("=", " ").split()
    for flag in ("--baselines", "--providers"):
        if flag in words[:-1]:
            return ratio if base in words[words.index(flag) + 1].split(",") else None
    return ratio


def run_of(row: dict, srcs: list[dict]) -> dict:
    """The run that timed `row`, of the file's runs `srcs` (fusekit.bench.results.runs)."""
    i = row.get("source", 0)
    return srcs[i] if 0 <= i < len(srcs) else {}


def ratio(r: dict, b: dict, srcs: list[dict]) -> float | None:
    """Baseline row b's time / row r's time where honest (see the module doc), else None."""
    if same_session(r, run_of(r, srcs), b, run_of(b, srcs)):
        return b["time_us"] / r["time_us"]
    return own_run_ratio(r, run_of(r, srcs), b["provider"])
