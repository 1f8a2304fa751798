"""The report's Targets section: every numeric target of the open issues, checked against the committed
results of each device and backend — met or not, worst case, how many cases, at which commits.

A target is a ratio against a baseline measured in the same run (`speedup_vs`, baseline time / fusekit
time; a row's same-process A/B ratio `ab_speedup_vs` where it has one: the model bench's --ab-rounds) or a
share of the roofline bound (`pct_of_ceiling`), over the cases of one op and suite that the
target names (`where`). It is met on a device when every such case of the backend meets it; "no data"
says the committed results do not cover it (a target is never assumed). The end-to-end targets read
e2e.json (HF eager / torch.compile / Liger step times of the same file; against HF eager a row's
same-process A/B ratio, against Liger, where both rows have one, the ratio of the two A/B ratios).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fusekit.bench import pairing
from fusekit.bench.results import runs, suite_of
from fusekit.report import e2e as e2e_section
from fusekit.report import host as host_section
from fusekit.report.tables import commit_str, ok_rows

TITLE = "## Targets of the open issues"
BACKENDS = ("triton", "mojo")
Where = Callable[[dict], bool]


@dataclass(frozen=True)
class Target:
    issue: int
    what: str  # the issue's words
    ops: tuple[str, ...]
    suite: str  # "sweep", "train", "small", "decode"
    baseline: str | None  # speedup_vs key; None: pct_of_ceiling
    at_least: float  # ratio, or percent of the roofline bound when baseline is None
    where: Where | None = None  # on a row: params, dtype
    provider: str = "{b}"  # the rows' provider for backend b (the model bench names its own)


def _p(**want: object) -> Where:
    return lambda r: all((r.get("params") or {}).get(k) == v for k, v in want.items())


def _n_in(lo: int, hi: int) -> Where:
    return lambda r: lo <= int((r.get("params") or {}).get("N", 0)) <= hi


def _scenario(prefix: str) -> Where:
    return lambda r: str(r.get("scenario", "")).startswith(prefix)


def _pow2_n(lo: int, hi: int, dtype: str | None = None) -> Where:
    def f(r: dict) -> bool:
        n = int((r.get("params") or {}).get("n", 0))
        return (1 << lo) <= n <= (1 << hi) and (dtype is None or r.get("dtype") == dtype)

    return f


NORMS = ("rms_norm", "layer_norm")
TARGETS: tuple[Target, ...] = (
    # #10 training: forward + backward
    Target(10, "norms fwd+bwd ≥ 1.2× torch.compile", NORMS, "train", "torch-compile", 1.2),
    Target(10, "norms fwd+bwd ≥ 1.1× Liger", NORMS, "train", "liger", 1.1),
    Target(10, "norms fwd+bwd ≥ 80% of the byte floor", NORMS, "train", None, 80.0),
    Target(10, "rope fwd+bwd ≥ 1.5× Liger", ("rope",), "train", "liger", 1.5),
    Target(10, "swiglu_ffn fwd+bwd ≥ 1.0× torch.compile", ("swiglu_ffn",), "train", "torch-compile", 1.0),
    Target(10, "attention fwd+bwd ≥ 0.9× SDPA", ("attention",), "train", "sdpa", 0.9),
    # #11 model-shape speed
    Target(11, "decode attention ≥ 1.0× SDPA", ("attention",), "decode", "sdpa", 1.0),
    # GPU time (the small-suite files also hold wall time per call: the host-path targets are in host.json)
    Target(
        11,
        "norms, rope at small shapes ≥ 1.0× torch.compile",
        (*NORMS, "rope"),
        "small",
        "torch-compile",
        1.0,
    ),
    Target(11, "norms, rope at small shapes ≥ 1.0× Liger", (*NORMS, "rope"), "small", "liger", 1.0),
    # a decoder layer (model.json): eager fusekit layers, and the same captured in a CUDA graph
    Target(
        11,
        "layer eager decode ≥ 1.0× torch.compile",
        ("model",),
        "sweep",
        "torch-compile",
        1.0,
        _scenario("decode"),
        "fusekit-{b}",
    ),
    Target(
        11,
        "layer graphed decode ≥ 1.5× torch.compile",
        ("model",),
        "sweep",
        "torch-compile",
        1.5,
        _scenario("decode"),
        "fusekit-{b}-graph",
    ),
    Target(
        11,
        "layer graphed decode ≥ 60% of the byte floor",
        ("model",),
        "sweep",
        None,
        60.0,
        _scenario("decode"),
        "fusekit-{b}-graph",
    ),
    Target(
        11,
        "layer prefill ≥ 1.05× torch.compile",
        ("model",),
        "sweep",
        "torch-compile",
        1.05,
        _scenario("prefill"),
        "fusekit-{b}",
    ),
    # #13 / #14 forward sweeps
    Target(13, "attention forward ≥ 1.0× SDPA", ("attention",), "sweep", "sdpa", 1.0),
    Target(
        13, "reduce_sum fp32 2^30 ≥ 1.0× CUB", ("reduce_sum",), "sweep", "cub", 1.0, _pow2_n(30, 30, "fp32")
    ),
    Target(13, "reduce_sum 2^20–2^26 ≥ 0.95× CUB", ("reduce_sum",), "sweep", "cub", 0.95, _pow2_n(20, 26)),
    Target(
        13,
        "norms N 512–262144 ≥ 1.0× torch.compile",
        NORMS,
        "sweep",
        "torch-compile",
        1.0,
        _n_in(512, 262144),
    ),
    Target(
        13, "norms N 512–262144 ≥ 95% of the copy ceiling", NORMS, "sweep", None, 95.0, _n_in(512, 262144)
    ),
    Target(
        13,
        "rope B16 S4096 H32 D128 ≥ 95% of the copy floor",
        ("rope",),
        "sweep",
        None,
        95.0,
        _p(B=16, S=4096),
    ),
    Target(14, "swiglu_ffn forward ≥ 1.0× torch.compile", ("swiglu_ffn",), "sweep", "torch-compile", 1.0),
)


@dataclass(frozen=True)
class E2ETarget:
    issue: int
    what: str
    scenario: str
    baseline: str  # a provider of e2e.json: "eager", "compile", "liger"
    # metric "speed": at_least is the least baseline step time / ours; "peak": the most MiB the step's peak
    # may rise over what its process held when the step began, beyond the baseline's rise (an upper bound;
    # what a provider held before - a cache from an earlier inference call - is not the step's cost)
    at_least: float
    metric: str = "speed"


E2E_TARGETS: tuple[E2ETarget, ...] = (
    E2ETarget(12, "decode ≥ 1.3× HF eager", "decode", "eager", 1.3),
    E2ETarget(12, "decode ≥ 1.0× HF + torch.compile", "decode", "compile", 1.0),
    E2ETarget(12, "training step ≥ 1.15× HF eager", "train", "eager", 1.15),
    # "with no more peak memory" (#12): the training step's peak against HF eager's, same case
    E2ETarget(12, "training step's peak memory ≤ HF eager's", "train", "eager", 0.0, "peak"),
    E2ETarget(12, "decode ≥ 1.0× HF + Liger", "decode", "liger", 1.0),
    E2ETarget(12, "training ≥ 1.0× HF + Liger", "train", "liger", 1.0),
)


def _value(r: dict, t: Target, b: dict | None, srcs: list[dict]) -> float | None:
    """The row's % of the ceiling, or its ratio against t.baseline (row b, where the file holds one): a
    same-process A/B ratio (the model bench's --ab-rounds) where the row has one, else a ratio against a
    baseline of its session only (fusekit.bench.pairing)."""
    if t.baseline is None:
        v = r.get("pct_of_ceiling")
    else:
        v = (r.get("ab_speedup_vs") or {}).get(t.baseline)
        if v is None:
            v = (
                pairing.ratio(r, b, srcs)
                if b is not None
                else pairing.own_run_ratio(r, pairing.run_of(r, srcs), t.baseline)
            )
    return None if v is None else float(v)


def _cell(vals: list[float], at_least: float, unit: str, commits: set[str], at_most: bool = False) -> str:
    """ "met: k/n cases, worst, median (commits)"; at_most: the target is an upper bound (worst = largest)."""
    if not vals:
        return "no data"
    met = sum((v <= at_least) if at_most else (v >= at_least) for v in vals)
    worst, med = (max(vals) if at_most else min(vals)), statistics.median(vals)
    verdict = "**met**" if met == len(vals) else "not met"
    fmts = {"%": lambda v: f"{v:.0f}%", "µs": lambda v: f"{v:.1f} µs", "MiB": lambda v: f"{v:+.0f} MiB"}

    def ratio(v: float) -> str:  # a miss that two decimals would round onto the bound gets three
        short = f"{v:.2f}×"
        missed = v > at_least if at_most else v < at_least
        return f"{v:.3f}×" if missed and float(short[:-1]) == round(at_least, 2) else short

    fmt = fmts.get(unit, ratio)
    tail = f" ({', '.join(sorted(commits))})" if commits else ""
    return f"{verdict}: {met}/{len(vals)} cases, worst {fmt(worst)}, median {fmt(med)}{tail}"


def _values(docs: list[dict], t: Target, backend: str) -> Iterator[tuple[float, str, float | None]]:
    """(value, commit, against the file's baseline row) of each timed row of `backend` in the op files `t`
    names. The third is None where the row's ratio is against the baseline row the file holds (same run);
    else the ratio of that row's time to this row's: its own run's baseline row was replaced by a later
    run's (a file merged over sessions), so the stored ratio no longer matches the times beside it."""
    for d in docs:
        if d["op"] not in t.ops or suite_of(d) != t.suite:
            continue
        rs = runs(d)
        rows = ok_rows(d)
        base = {r["case"]: r for r in rows if t.baseline is not None and r["provider"] == t.baseline}
        for r in rows:
            b = base.get(r["case"])
            if (
                r["provider"] == t.provider.format(b=backend)
                and (t.where is None or t.where(r))
                and (v := _value(r, t, b, rs)) is not None
            ):
                other = (
                    b["time_us"] / r["time_us"]
                    if b is not None and b.get("source", 0) != r.get("source", 0) and r.get("time_us")
                    else None
                )
                yield v, commit_str(rs[min(r.get("source", 0), len(rs) - 1)]), other


def evaluate(entries: list[tuple[str, Path, dict]]) -> list[tuple[str, Target, dict[str, str]]]:
    """Per device and op target: backend -> cell. A cell some of whose ratios are against baseline rows
    the file no longer holds is marked † and followed by the verdict against the file's baseline rows."""
    out = []
    for dev in dict.fromkeys(dev for dev, _, _ in entries):
        docs = [d for dv, _, d in entries if dv == dev]
        for t in TARGETS:
            cells = {}
            for b in BACKENDS:
                found = list(_values(docs, t, b))
                unit = "%" if t.baseline is None else "×"
                commits = {c for _, c, _ in found}
                cells[b] = _cell([v for v, _, _ in found], t.at_least, unit, commits)
                if any(o is not None for _, _, o in found):
                    alt = [v if o is None else o for v, _, o in found]
                    cells[b] += (
                        f" † (against the file's {t.baseline} rows: {_cell(alt, t.at_least, unit, set())})"
                    )
            if any(c != "no data" for c in cells.values()):
                out.append((dev, t, cells))
    return out


def _peak_over(r: dict, b: dict) -> float:
    """MiB by which row r's training step's peak rose beyond baseline row b's: each over what its process
    held when the step began, where both rows record that (mem_before_bytes), else the peaks themselves."""
    held = r.get("mem_before_bytes") is not None and b.get("mem_before_bytes") is not None
    rise_r = r["peak_mem_bytes"] - (r["mem_before_bytes"] if held else 0)
    rise_b = b["peak_mem_bytes"] - (b["mem_before_bytes"] if held else 0)
    return (rise_r - rise_b) / 2**20


def evaluate_e2e(results_dir: Path) -> list[tuple[str, list[str], list[tuple[E2ETarget, dict[str, str]]]]]:
    """Per e2e.json: (label, fusekit providers, [(target, provider -> cell)]), from the ratios of median
    step times in that file; against HF eager, a row's same-process A/B ratio where it has one (unpatched
    and patched alternately in one process: the host's drift cancels); against another provider whose row
    has one too (Liger), the ratio of the two A/B ratios. Every provider runs in its own
    process (a run); a ratio whose baseline row was measured at another commit (a file merged over
    sessions) is marked †."""
    out = []
    for path, doc in e2e_section.load(results_dir):
        label = f"{path.parent.name} — {doc.get('setup', {}).get('model') or path.stem} — `{path.name}`"
        rows = [r for r in doc["rows"] if r.get("status") == "ok"]
        base = {(r["provider"], r["scenario"], r["case"]): r for r in rows}
        commits = {i: commit_str(run) for i, run in enumerate(doc.get("runs") or [])}
        provs = [p for p in dict.fromkeys(r["provider"] for r in rows) if p.startswith("fusekit")]
        items = []
        for t in E2E_TARGETS:
            cells = {}
            for p in provs:
                vals, cs, other = [], set(), False
                for r in rows:
                    if r["provider"] != p or r["scenario"] != t.scenario:
                        continue
                    b = base.get((t.baseline, r["scenario"], r["case"]))
                    if t.metric == "peak":  # a row without a peak figure (e.g. CPU runs) has no verdict
                        v = (
                            _peak_over(r, b)
                            if b and b.get("peak_mem_bytes") and r.get("peak_mem_bytes")
                            else None
                        )
                    elif t.baseline == "eager" and r.get("ab_vs_eager"):
                        # same-process A/B rounds (bench.e2e ab_decode / ab_train)
                        v, b = r["ab_vs_eager"], None
                    elif r.get("ab_vs_eager") and b and b.get("ab_vs_eager"):
                        # both rows A/B'd against HF eager in their own process: the ratio of the two
                        # drift-free ratios (the isolated rows' own ratio carries the host's drift)
                        v, b = r["ab_vs_eager"] / b["ab_vs_eager"], None
                    else:
                        v = b["ms_per_step"] / r["ms_per_step"] if b else None
                    if v is not None:
                        vals.append(v)
                        cs.add(commits.get(r.get("run"), "?"))
                        other |= b is not None and commits.get(b.get("run")) != commits.get(r.get("run"))
                peak = t.metric == "peak"
                cell = _cell(vals, t.at_least, "MiB" if peak else "×", cs, at_most=peak)
                cells[p] = cell + (" †" if other else "")
            if any(not c.startswith("no data") for c in cells.values()):
                items.append((t, cells))
        if items:
            out.append((label, provs, items))
    return out


def _vs_torch(r: dict) -> float | None:
    f, t = r.get("fusekit_wall_us"), r.get("torch_wall_us")
    return t / f if f and t else None


_NOT_SLOWER = "never slower than the torch eager op (eager wall / fusekit wall)"
# issue #11 item 1, from host.json (report/host.py): per backend, (what, row value, bound, unit, at most)
HOST_TARGETS: tuple[tuple[str, str, Callable[[dict], float | None], float, str, bool], ...] = (
    (
        "triton",
        f"wall per call ≤ {host_section.TARGET}× a bare launch of the same kernels (fwd+bwd rows: of "
        "those launches inside a trivial autograd.Function, the floor with the autograd engine in it)",
        host_section.floor_ratio,
        host_section.TARGET,
        "×",
        True,
    ),
    ("mojo", "wall per call ≤ 15 µs", lambda r: r.get("fusekit_wall_us"), 15.0, "µs", True),
    *((b, _NOT_SLOWER, _vs_torch, 1.0, "×", False) for b in ("triton", "mojo")),
)


def evaluate_host(results_dir: Path) -> list[tuple[str, str, str, str]]:
    """Per host.json and host target that has rows: (file label, backend, target, cell)."""
    out = []
    for path, doc in host_section.load(results_dir):
        commit = commit_str(doc.get("meta") or {})
        rows = [r for r in doc.get("rows", []) if r.get("status") == "ok"]
        for backend, what, value, bound, unit, at_most in HOST_TARGETS:
            vals = [v for r in rows if r.get("backend") == backend and (v := value(r)) is not None]
            if vals:
                label = f"{path.parent.name} `{path.name}`"
                out.append((label, backend, what, _cell(vals, bound, unit, {commit}, at_most)))
    return out


def section_md(entries: list[tuple[str, Path, dict]], results_dir: Path) -> list[str]:
    """The Targets section: one table per device for the op targets, one per e2e file."""
    md = [
        TITLE,
        "",
        "Each target checked against the committed results: **met** when every case of that op and suite "
        "meets it; ratios are against baselines measured in the same run; commits are the rows' runs. "
        "Results measured before a kernel was rewritten still count here: their commits say so. † marks a "
        "cell where some rows' same-run baseline rows were since replaced in the file by a later run's; the "
        "verdict against the file's current baseline rows follows in brackets.",
        "",
    ]
    rows = evaluate(entries)
    for dev in dict.fromkeys(dev for dev, _, _ in rows):
        md += [f"### {dev}", "", "| issue | target | " + " | ".join(BACKENDS) + " |", "|---|---|---|---|"]
        for d, t, cells in rows:
            if d == dev:
                md.append(f"| #{t.issue} | {t.what} | " + " | ".join(cells[b] for b in BACKENDS) + " |")
        md.append("")
    host = evaluate_host(results_dir)
    if host:
        md += [
            "### Host path per call (#11)",
            "",
            "| file | backend | target | result |",
            "|---|---|---|---|",
        ]
        md += [f"| {f} | {b} | {w} | {c} |" for f, b, w, c in host]
        md.append("")
    for label, provs, items in evaluate_e2e(results_dir):
        md += [f"### e2e: {label}", "", "| issue | target | " + " | ".join(provs) + " |"]
        md.append("|---|---|" + "---|" * len(provs))
        for t, cells in items:
            md.append(f"| #{t.issue} | {t.what} | " + " | ".join(cells[p] for p in provs) + " |")
        md += [
            "",
            "† the baseline's row was measured at another commit (the file merges several sessions). "
            "Against HF eager a row's same-process A/B ratio counts where it has one; against a baseline "
            "whose row has one too (Liger), the ratio of the two A/B ratios (each provider alternated with "
            "HF eager in its own process, so the hosts' drift between processes cancels).",
            "",
        ]
    return md
