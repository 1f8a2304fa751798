"""The report's end-to-end section: `e2e.json` files (schema fusekit-bench-e2e/1, written by
`python -m fusekit.bench.e2e`) as a table of tokens/s per scenario and provider with the ratios to HF
eager and torch.compile, a bar chart of tokens/s relative to eager, the correctness gate, the setup
and the runs behind it. These files carry their own schema, so `bench.results.load_all` and the op
sections never see them."""

from __future__ import annotations

import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fusekit.bench.results import load_docs
from fusekit.report import plots
from fusekit.report.tables import commit_str

SCHEMA = "fusekit-bench-e2e/1"
TITLE = "## End to end: a patched Hugging Face Llama"
BASELINES = ("eager", "compile")
# e2e provider -> the op plots' provider whose colour it takes
COLOR_OF = {"eager": "torch-eager", "compile": "torch-compile"}
VERSION_KEYS = ("torch", "triton", "transformers", "liger", "max", "mojo")


def load(results_dir: Path) -> list[tuple[Path, dict]]:
    """Every e2e results file under `results_dir` (recursively), with its path."""
    return load_docs(results_dir, SCHEMA)


def rel_path(path: Path, root: Path) -> str:
    rel = os.path.relpath(path.resolve(), root)
    return str(path) if rel.startswith("..") else rel


def run_line(run: dict, keys: tuple[str, ...] = VERSION_KEYS) -> str:
    """One run's meta in a line: commit 46cc0c3574+dirty, 2026-11-23 14:11, torch 2.11.0, …; `command`."""
    vers = ", ".join(f"{k} {run[k]}" for k in keys if run.get(k))
    date = (run.get("date") or "?")[:16].replace("T", " ")
    cmd = str(run.get("command") or "?").replace("|", "\\|")
    return f"commit {commit_str(run)}, {date}, {vers}; `{cmd}`"


def _runs(doc: dict) -> list[dict]:
    return doc.get("runs") or [doc["meta"]]


def providers(doc: dict) -> list[str]:
    """Baselines first, then the others in the file's order."""
    seen = list(dict.fromkeys([*doc.get("providers", {}), *(r["provider"] for r in doc["rows"])]))
    return [p for p in BASELINES if p in seen] + [p for p in seen if p not in BASELINES]


def cases(doc: dict) -> dict[str, dict[str, dict]]:
    """Label "<scenario> <case>" -> provider -> row, scenarios in the file's order."""
    out: dict[str, dict[str, dict]] = {}
    for r in doc["rows"]:
        out.setdefault(f"{r['scenario']} {r['case']}", {})[r["provider"]] = r
    return out


def _tok(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _cell(doc: dict, prov: str, r: dict | None, fastest: bool) -> str:
    if r is None:
        return "–"
    if r.get("status") != "ok" or not r.get("tokens_per_s"):
        return str(r.get("status", "?"))
    head = f"{_tok(r['tokens_per_s'])} tok/s · {r['ms_per_step']:.3g} ms"
    parts = [f"**{head}**" if fastest else head]
    sv = r.get("speedup_vs") or {}
    # "<baseline>_other_run" flags a ratio whose baseline ran in another process: marked, not a ratio
    ratios = [
        f"×{v:.2f} {b}{'‡' if sv.get(f'{b}_other_run') else ''}"
        for b, v in sv.items()
        if b != prov and not b.endswith("_other_run") and v
    ]
    if ratios:
        parts.append(", ".join(ratios))
    if r.get("ab_vs_eager"):  # bench.e2e.ab_decode: unpatched and patched alternately in one process
        parts.append(
            f"×{r['ab_vs_eager']:.2f} eager, same process ({len(r.get('ab_ratios') or [])} A/B rounds)"
        )
    if r["scenario"] == "train" and r.get("peak_mem_bytes") is not None:
        parts.append(f"peak {r['peak_mem_bytes'] / 2**30:.1f} GiB")
    tag = f"<sup>{r.get('run', 0) + 1}</sup>" if len(_runs(doc)) > 1 else ""
    return "<br>".join(parts) + tag


def table_md(doc: dict) -> str:
    """Rows = scenario and case; one column per provider: tokens/s and ms per step (fastest in bold),
    the ratios to the baselines it is not, peak memory for training."""
    provs = providers(doc)
    lines = ["| scenario | " + " | ".join(provs) + " |", "|" + "---|" * (len(provs) + 1)]
    for label, rows in cases(doc).items():
        ok = {p: r for p, r in rows.items() if r.get("status") == "ok" and r.get("tokens_per_s")}
        best = max(ok, key=lambda p: ok[p]["tokens_per_s"]) if ok else None
        cells = [_cell(doc, p, rows.get(p), p == best) for p in provs]
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def gate_md(doc: dict) -> str:
    """Each provider's correctness gate: logits error and tolerance, greedy tokens, kernel evidence."""
    recs = doc.get("providers") or {}
    if not recs:
        return ""
    n_new = ((doc.get("setup") or {}).get("decode") or [None])[-1]
    lines = [
        "| provider | status | logits rel. error (tolerance) | vs HF eager | greedy tokens as HF eager's "
        "| fusekit kernels ran | gate s |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in providers(doc):
        rec = recs.get(p)
        if rec is None:
            continue
        g = rec.get("gate") or {}
        err = g.get("logits_rel_error")
        tol = g.get("logits_tol")
        err_s = f"{err:.3g} ({tol:.3g})" if err is not None and tol is not None else "–"
        ve = g.get("logits_rel_error_vs_eager")
        pre = g.get("generate_matching_prefix")
        toks = "–" if pre is None else f"{pre}" + (f" of {n_new}" if n_new else "")
        kr = g.get("kernel_runs")
        kern = "–" if kr is None else ("all" if kr == g.get("kernel_runs_expected") else "**missing**")
        gs = rec.get("gate_s")
        lines.append(
            f"| {p} | {rec.get('status', '?')} | {err_s} | {'–' if ve is None else f'{ve:.3g}'} | {toks} | "
            f"{kern} | {'–' if gs is None else f'{gs:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


def not_timed_md(doc: dict) -> str:
    """Rows that did not time, with their reasons."""
    bad = [r for r in doc["rows"] if r.get("status") != "ok"]
    if not bad:
        return ""
    lines = ["| provider | scenario | status | reason |", "|---|---|---|---|"]
    for r in bad:
        why = str(r.get("reason", ""))[:200].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['provider']} | {r['scenario']} {r['case']} | {r['status']} | {why} |")
    return "\n".join(lines) + "\n"


def setup_line(doc: dict) -> str:
    s, c = doc.get("setup") or {}, (doc.get("setup") or {}).get("config") or {}
    shapes = []
    for sc in ("prefill", "train"):
        if s.get(sc):
            shapes.append(f"{sc} " + ", ".join("x".join(map(str, bs)) for bs in s[sc]))
            if sc == "train":  # files before the option ran torch's default (foreach) AdamW
                shapes[-1] += f" ({s.get('optim', 'foreach')} AdamW)"
    if s.get("decode"):
        # one [b, p, n] case (files before 2026-11-23's fifth session) or a list of them
        cases = [s["decode"]] if isinstance(s["decode"][0], int) else s["decode"]
        shapes.append("decode " + ", ".join(f"{b}x{p} prompt + {n} new tokens" for b, p, n in cases))
    model = (
        f"{s.get('model', '?')} shapes, {s.get('layers', '?')} layers (hidden {c.get('hidden_size', '?')}, "
        f"FFN {c.get('intermediate_size', '?')}, {c.get('num_attention_heads', '?')} heads / "
        f"{c.get('num_key_value_heads', '?')} kv heads, vocab {c.get('vocab_size', '?')}"
    )
    params = f", {s['parameters'] / 1e9:.2f} B parameters" if s.get("parameters") else ""
    return (
        f"Setup: {model}{params}), {s.get('dtype', '?')}, seeded random weights, attention "
        f"`{s.get('attn_implementation', '?')}`; {'; '.join(shapes)}."
    )


def _color(p: str) -> str:
    return plots.COLORS.get(COLOR_OF.get(p, p.removeprefix("fusekit-")), "black")


def plot(doc: dict, path: Path, draw: bool = True) -> Path | None:
    """Grouped bars: per scenario and case, each provider's tokens/s relative to HF eager's."""
    groups = {
        label: {
            p: r["speedup_vs"]["eager"] for p, r in rows.items() if (r.get("speedup_vs") or {}).get("eager")
        }
        for label, rows in cases(doc).items()
        if rows.get("eager", {}).get("status") == "ok"
    }
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        return None
    if not draw:
        return path
    provs = [p for p in providers(doc) if any(p in v for v in groups.values())]
    width = 0.8 / len(provs)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(groups) * len(provs) + 2.0), 4.6))
    for i, p in enumerate(provs):
        xs = [g + (i - (len(provs) - 1) / 2) * width for g, v in enumerate(groups.values()) if p in v]
        ys = [v[p] for v in groups.values() if p in v]
        bars = ax.bar(xs, ys, width * 0.92, color=_color(p), label=p)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=1)
    ax.axhline(1.0, ls="--", color="k", lw=1)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=9)
    ax.set_ylabel("tokens/s ÷ HF eager's")
    ax.set_ylim(0, max(max(v.values()) for v in groups.values()) * 1.12)  # room for the labels
    ax.grid(alpha=0.3, axis="y")
    # The legend below the axes, as in the op plots, so no bar is hidden under it.
    fig.legend(fontsize=8, ncol=min(len(provs), 6), loc="lower center")
    s, m = doc.get("setup") or {}, doc["meta"]
    dev = m.get("gpu_name") or m.get("device", "?")
    ax.set_title(
        f"{s.get('model', '?')}, {s.get('layers', '?')} layers, {s.get('dtype', '?')} on {dev} "
        f"({(m.get('date') or '')[:10]})\ntokens/s relative to HF eager (> 1: faster)",
        fontsize=10,
    )
    legend_h = 0.28 * math.ceil(len(provs) / 6) + 0.15  # inches
    fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def section_md(results_dir: Path, out_dir: Path, root: Path, draw: bool = True) -> list[str]:
    """The section's markdown lines (and its PNGs in `out_dir`); nothing when there is no e2e file."""
    docs = load(results_dir)
    if not docs:
        return []
    md = [
        TITLE,
        "",
        "A Hugging Face transformers Llama built with seeded random weights, run as is (`eager`, SDPA "
        "attention), under torch.compile (`compile`), patched by `fusekit.hf.patch` (`fusekit-<backend>`, "
        "strict: no fallback) and by Liger-Kernel (`liger`). Times are host wall-clock per step with a "
        "device sync around it (median of the reps): prefill is one forward with full logits and no cache, "
        "decode counts the greedy generate steps after the first token, train is forward, the model's "
        "cross entropy, backward and an AdamW step. Cells give tokens/s and ms per step (a forward, one "
        "new token, or an optimizer step); ratios are this provider's tokens/s over the baseline's (> 1: "
        "faster; ‡: the baseline ran in another process of the run, and the host's speed drifts between "
        "processes, so such ratios carry that noise; a patched provider's decode cell also gives its ratio to HF "
        "eager measured in its own process, unpatched and patched alternately); the fastest provider of a row is in bold. Before "
        "any timing each provider went "
        "through the correctness gate below (one that fails it is `wrong` and not timed).",
        "",
    ]
    for path, doc in docs:
        dev = path.parent.name
        flags = " (quick run)" if (doc.get("method") or {}).get("quick") else ""
        md += [f"### {dev} — `{rel_path(path, root)}`{flags}", "", setup_line(doc), ""]
        png = plot(doc, out_dir / f"{dev}_{path.stem}.png", draw)  # e2e.json -> <dev>_e2e.png
        if png:
            md += [f"![end to end on {dev}]({png.name})", ""]
        md += [table_md(doc)]
        gate = gate_md(doc)
        if gate:
            md += ["Correctness gate (before any timing):", "", gate]
        nt = not_timed_md(doc)
        if nt:
            md += ["Not timed:", "", nt]
        rs = _runs(doc)
        if len(rs) == 1:
            md += [f"Run: {run_line(rs[0])}", ""]
        else:
            md += ["Runs (a cell's superscript is its run):", ""]
            md += [f"{i}. {run_line(r)}" for i, r in enumerate(rs, 1)] + [""]
    return md
