"""PNG plots (matplotlib, Agg): rate vs size per provider with the measured ceiling dashed, and a
roofline of the matrix ops (arithmetic intensity vs achieved FLOP/s)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fusekit.bench import cases
from fusekit.report.tables import is_matmul, ok_rows

# Fixed colours so a provider looks the same in every plot.
COLORS = {
    "triton": "tab:blue",
    "mojo": "tab:red",
    "torch": "tab:gray",
    "torch-eager": "tab:brown",
    "torch-compile": "tab:orange",
    "cub": "tab:green",
    "cublas": "tab:green",
    "sdpa": "tab:green",
    "max-attention": "tab:purple",
    "liger": "tab:olive",
    "torch-native": "tab:pink",
}


def _num(x: float) -> str:
    """0 decimals for big rates, 3 significant digits for the small CPU ones."""
    return f"{x:.0f}" if x >= 10 else f"{x:.3g}"


def _color(p: str) -> str:
    return COLORS.get(p, "black")


def op_plot(doc: dict, path: Path, draw: bool = True) -> Path | None:
    """One PNG per op: a subplot per sub-sweep (group), x = swept size (log2), y = GB/s or TFLOP/s.
    None when there is nothing to plot; with draw=False only the path it would have."""
    rows = ok_rows(doc)
    if not rows:
        return None
    if not draw:
        return path
    op = doc["op"]
    matmul = is_matmul(doc)
    groups = list(dict.fromkeys(r["group"] for r in rows))
    n = len(groups)
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(max(5.2 * cols, 8.0), 3.9 * nrows + 0.6), squeeze=False)
    bw = doc["ceilings"]["copy"]["gbps"]
    peak = doc["ceilings"]["matmul"]["tflops"]
    for ax, g in zip(axes.flat, groups):
        grows = [r for r in rows if r["group"] == g]
        for p in dict.fromkeys(r["provider"] for r in grows):
            pr = sorted((r for r in grows if r["provider"] == p), key=lambda r: r["x"])
            ys = [r["tflops"] if matmul else r["gbps"] for r in pr]
            style = "-" if pr[0]["kind"] == "backend" else "--"
            ax.plot([r["x"] for r in pr], ys, style, marker="o", ms=3.5, color=_color(p), label=p, lw=1.5)
        if matmul:
            ax.axhline(peak, ls="--", color="k", lw=1, label=f"matmul peak {_num(peak)} TF/s")
            xs = sorted({r["x"] for r in grows})
            by_x = {r["x"]: r for r in grows}
            # The roofline bound at each x: min(peak, intensity × bandwidth).
            roof = [min(peak, by_x[x]["flops"] / by_x[x]["bytes"] * bw / 1e3) for x in xs]
            ax.plot(xs, roof, ":", color="k", lw=1, label="roofline bound")
            ax.set_ylabel("TFLOP/s")
        else:
            ax.axhline(bw, ls="--", color="k", lw=1, label=f"copy {_num(bw)} GB/s")
            ax.set_ylabel("GB/s (minimal bytes)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(grows[0]["x_label"])
        ax.set_title(f"{op} {g}", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    # One legend for the figure, below the plots, so no curve is hidden under it.
    handles: dict[str, object] = {}
    for ax in axes.flat:
        for h, lbl in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lbl, h)
    ncol = min(len(handles), 4 if cols == 1 else 6)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, fontsize=8)
    date = doc["meta"].get("date", "")[:10]
    fig.suptitle(f"{op} on {_device(doc)} ({date})\nsolid: fusekit backends, dashed: baselines", fontsize=10)
    legend_h = 0.28 * math.ceil(len(handles) / ncol) + 0.15  # inches
    fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _device(doc: dict) -> str:
    return doc["meta"].get("gpu_name") or doc["meta"].get("device", "?")


def roofline_plot(docs: list[dict], path: Path, draw: bool = True) -> Path | None:
    """Achieved TFLOP/s against FLOP/byte for every timed FFN/attention row, under the measured roof."""
    pts = [(d, r) for d in docs for r in ok_rows(d) if r.get("flops")]
    if not pts:
        return None
    if not draw:
        return path
    bw = max(d["ceilings"]["copy"]["gbps"] for d, _ in pts)
    peak = max(d["ceilings"]["matmul"]["tflops"] for d, _ in pts)
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    ai = [r["flops"] / r["bytes"] for _, r in pts]
    lo, hi = min(ai) / 2, max(ai) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], "k-", lw=1.5, label="measured roofline")
    ax.axhline(peak, ls="--", color="k", lw=0.8)
    ax.axvline(peak * 1e3 / bw, ls=":", color="gray", lw=0.8)
    ax.text(peak * 1e3 / bw, peak * 1.08, f" ridge {peak * 1e3 / bw:.0f} FLOP/B", fontsize=8, color="gray")
    seen = set()
    for d, r in pts:
        key = (r["provider"], d["op"])
        lbl = f"{r['provider']} · {d['op']}" if key not in seen else None
        seen.add(key)
        ax.scatter(
            r["flops"] / r["bytes"],
            r["tflops"],
            color=_color(r["provider"]),
            marker=cases.marker(d["op"]),
            s=28,
            alpha=0.8,
            label=lbl,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / minimal byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(
        f"Roofline on {_device(pts[0][0])}: copy {_num(bw)} GB/s, matmul {_num(peak)} TFLOP/s", fontsize=10
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
