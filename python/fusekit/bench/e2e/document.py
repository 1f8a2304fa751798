"""bench.e2e's results document: same-run ratios, the printed table, merging with an earlier file."""

from __future__ import annotations

import json
from pathlib import Path

from fusekit.bench.e2e.config import (
    BASELINES,
    BUDGET_SKIP,
    FP32_LOGITS_RTOL,
    LOW_PRECISION_SLACK,
    PROVIDERS,
    SCENARIOS,
    SCHEMA,
    Setup,
    _label,
)


def add_ratios(rows: list[dict]) -> None:
    """speedup_vs[baseline] = this row's tokens/s / the baseline's, for the same scenario and case."""
    base = {
        (r["provider"], r["scenario"], r["case"]): r
        for r in rows
        if r["provider"] in BASELINES and r["status"] == "ok" and r.get("tokens_per_s")
    }
    for r in rows:
        r.pop("speedup_vs", None)
        if r["status"] != "ok" or not r.get("tokens_per_s"):
            continue
        sv = {}
        for name in BASELINES:
            b = base.get((name, r["scenario"], r["case"]))
            if b is not None:
                sv[name] = r["tokens_per_s"] / b["tokens_per_s"]
                if b.get("run", 0) != r.get("run", 0):
                    sv[f"{name}_other_run"] = True
        r["speedup_vs"] = sv


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def table(rows: list[dict]) -> str:
    cols = (
        "provider",
        "scenario",
        "case",
        "status",
        "tok/s",
        "ms/step",
        "vs eager",
        "vs compile",
        "peak GiB",
    )
    widths = (15, 8, 11, 8, 11, 9, 8, 10, 8)
    fmt = lambda cells: " ".join(
        f"{c:<{w}}" if i < 4 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths))
    )
    lines = [fmt(cols), "-" * (sum(widths) + len(widths) - 1)]
    for r in rows:
        sv = r.get("speedup_vs") or {}
        peak = r.get("peak_mem_bytes")
        line = fmt(
            (
                r["provider"],
                r["scenario"],
                r["case"],
                r["status"],
                _fmt(r.get("tokens_per_s"), ",.0f"),
                _fmt(r.get("ms_per_step"), ".3f"),
                _fmt(sv.get("eager"), ".3g", "x"),
                _fmt(sv.get("compile"), ".3g", "x"),
                _fmt(None if peak is None else peak / 2**30, ".2f"),
            )
        )
        if r["status"] != "ok":
            line += f"  {r.get('reason', '')[:90]}"
        lines.append(line)
    return "\n".join(lines)


def _setup_key(setup: dict) -> dict:
    # files written before `optim` existed ran torch's default (foreach) AdamW
    return {"optim": "foreach"} | {k: v for k, v in setup.items() if k not in ("config", "parameters")}


def load_for_merge(path: Path, setup: dict) -> dict | None:
    """An existing e2e.json to merge into (None when absent); SystemExit when its setup differs."""
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    if old.get("schema") != SCHEMA or _setup_key(old["setup"]) != _setup_key(setup):
        raise SystemExit(f"--merge: {path} holds another setup; use another --out, or drop --merge")
    return old


def _row_key(r: dict) -> tuple[str, str, str]:
    return r["provider"], r["scenario"], r["case"]


def compose(doc: dict, old: dict | None) -> dict:
    """`doc` (this run's rows, all tagged run = len(old runs)) over `old`: a row of this run replaces the
    old row of its provider, scenario and case, except that a row this run skipped for its time budget
    keeps an old measured one; old rows of cases this run did not run (other providers, or scenarios
    left out with --scenarios) stay. Provider records: this run's replace old ones. Ratios recomputed
    over the lot (a ratio across runs is marked as such)."""
    if old is None:
        out = {**doc, "runs": [doc["meta"]]}
    else:
        mine = set(doc["providers"]) | {r["provider"] for r in doc["rows"]}
        order = {p: i for i, p in enumerate(PROVIDERS)}
        measured = {_row_key(r) for r in old["rows"] if r["status"] == "ok"}
        new = [r for r in doc["rows"] if not (r.get("reason") == BUDGET_SKIP and _row_key(r) in measured)]
        replaced = {_row_key(r) for r in new}
        scen = {s: i for i, s in enumerate(SCENARIOS)}
        rows = sorted(
            [r for r in old["rows"] if _row_key(r) not in replaced] + new,
            key=lambda r: (order.get(r["provider"], 99), scen.get(r["scenario"], 99)),
        )
        providers = {k: v for k, v in old["providers"].items() if k not in mine} | doc["providers"]
        out = {
            **doc,
            "runs": [*old["runs"], doc["meta"]],
            "providers": dict(sorted(providers.items(), key=lambda kv: order.get(kv[0], 99))),
            "rows": rows,
        }
    add_ratios(out["rows"])
    return out


def _method(setup: Setup, warmup: int, reps: int, quick: bool) -> dict:
    return {
        "warmup": warmup,
        "reps": reps,
        "quick": quick,
        "timer": "host wall-clock (perf_counter) per call with a device sync before and after; median of reps",
        "prefill": "model(input_ids, use_cache=False): full logits, no KV cache; tokens_per_s = B*S / median",
        "decode": (
            "generate(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0); tokens_per_s = "
            "B*(N-1) / (t(N) - t(1)), decode steps only (the first new token comes from the prefill); "
            "generate_tokens_per_s = B*N / t(N), prefill included"
        ),
        "train": (
            f"AdamW(lr=1e-5, {setup.optim}) step on model(input_ids, labels=random ids).loss (the model's own "
            "shifted cross entropy; Liger's fused linear cross entropy for liger): zero_grad, forward, backward, "
            "step; "
            "peak_mem_bytes = torch.cuda.max_memory_allocated over the timed steps (weights, grads and "
            "AdamW state included; null on the CPU)"
        ),
        "gate": (
            f"before timing: logits on the {_label(*setup.prefill[0])} prefill batch vs HF eager (fp32: "
            f"relative 2-norm <= {FP32_LOGITS_RTOL}; bf16/fp16: vs the same weights in fp32, <= 2x HF eager's "
            f"own error + {LOW_PRECISION_SLACK}), greedy tokens of the decode prompt (identical in fp32, "
            "matching prefix recorded otherwise); fusekit providers: calls reaching the backend's kernels "
            "counted per forward"
        ),
        "first_call_s": (
            "the first call of that scenario; the gate's calls ran before it (compile / tuning of the first "
            "prefill shape and of generate: the provider's gate_s)"
        ),
        "speedup_vs": "this row's tokens_per_s / the baseline's, same scenario and case",
    }
