"""The benchmark loop: for each case, build rotating input sets, compute an independent high-precision
oracle, then for each provider check correctness first and only then time it."""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Callable

import torch

from fusekit import reference
from fusekit.bench.baselines import Provider
from fusekit.bench.cases import Case
from fusekit.bench.timing import Rotation, bench_ms, e2e_ms, kernel_ms, n_rotating_sets

# Sanity tolerances on ‖out − oracle‖ / ‖oracle‖ by output dtype: a few times the output rounding
# alone (bf16 ≈ 1e-3 RMS, fp16 ≈ 1.4e-4). The conformance tests are the strict check; here a failure
# means "do not publish a time for this provider".
TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def oracle(case: Case, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The op in float64 (attention in float32 when a head's S×S scores would exceed 512 MiB), on the
    inputs' device, through `fusekit.reference` (which does its math in float64 for float64 inputs)."""
    up = {k: v.double() for k, v in inputs.items()} if case.op != "attention" else None
    kw = case.kwargs()
    if case.op == "reduce_sum":
        x = up["x"] if kw["dim"] is not None else up["x"].reshape(1, -1)
        return reference.reduce_sum(x, torch.float64)
    if case.op == "rms_norm":
        return reference.rms_norm(up["x"], up["weight"], 1e-6)[0]
    if case.op == "layer_norm":
        return reference.layer_norm(up["x"], up["weight"], up["bias"], 1e-5)[0]
    if case.op == "rope":
        return reference.rope(up["x"], None, None, 0, 10000.0, False)
    if case.op == "swiglu_ffn":
        return reference.swiglu_ffn(up["x"], up["w_gate"], up["w_up"], up["w_down"], None, 1e-6)
    if case.op == "attention":
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        B, H, S, _ = q.shape
        Hkv, Skv = k.shape[1], k.shape[2]
        group = H // Hkv
        dt = torch.float64 if S * Skv * 8 <= 512 * 2**20 else torch.float32
        out = torch.empty(q.shape, dtype=dt, device=q.device)
        # One batch element and one kv head (its query group) at a time bounds the scores' memory.
        for b in range(B):
            for hk in range(Hkv):
                hs = slice(hk * group, (hk + 1) * group)
                out[b : b + 1, hs] = reference.attention(
                    q[b : b + 1, hs].to(dt),
                    k[b : b + 1, hk : hk + 1].to(dt),
                    v[b : b + 1, hk : hk + 1].to(dt),
                    kw["causal"],
                    kw["scale"],
                )
        return out
    raise ValueError(case.op)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf for NaN/inf outputs or a shape mismatch."""
    if out.numel() != ref.numel():
        return math.inf
    o, r = out.reshape(-1).to(torch.float64), ref.reshape(-1).to(torch.float64)
    if not bool(torch.isfinite(o).all()):
        return math.inf
    den = float(torch.linalg.vector_norm(r))
    num = float(torch.linalg.vector_norm(o - r))
    return num / den if den > 0 else num


def repro(case: Case, provider: Provider, device: torch.device) -> str:
    who = (
        f"--backends {provider.name} --baselines none"
        if provider.kind == "backend"
        else (f"--backends none --baselines {provider.name}")
    )
    return (
        f"PYTHONPATH=python python -m fusekit.bench --device {device.type} --ops {case.op} {who} "
        f"--case {shlex.quote(case.label)}"
    )


def _row(case: Case, provider: Provider, device: torch.device) -> dict:
    return {
        "op": case.op,
        "case": case.label,
        "params": dict(case.params),
        "dtype": case.dtype,
        "group": case.group,
        "x": case.x,
        "x_label": case.x_label,
        "provider": provider.name,
        "kind": provider.kind,
        "bytes": case.bytes_moved(),
        "flops": case.flops(),
        "status": "skipped",
        "reason": None,
        "repro": repro(case, provider, device),
    }


def _derive(row: dict, ceilings: dict) -> None:
    """GB/s, TFLOP/s and % of the roofline (the larger of the byte and FLOP floors over the time)."""
    t = row["time_us"] * 1e-6
    row["gbps"] = row["bytes"] / t / 1e9
    row["tflops"] = row["flops"] / t / 1e12 if row["flops"] else None
    bw = ceilings["copy"]["gbps"] * 1e9
    peak = ceilings["matmul"]["tflops"] * 1e12
    floor = max(row["bytes"] / bw, row["flops"] / peak)
    row["floor_us"] = floor * 1e6
    row["pct_of_ceiling"] = 100.0 * floor / t
    row["bound"] = "compute" if row["flops"] / peak > row["bytes"] / bw else "memory"


def _speedups(rows: list[dict]) -> None:
    """speedup_vs[b] = time of baseline b / time of this row, for each baseline timed on the same case."""
    base = {r["provider"]: r["time_us"] for r in rows if r["status"] == "ok" and r["kind"] == "baseline"}
    for r in rows:
        if r["status"] == "ok":
            r["speedup_vs"] = {b: t / r["time_us"] for b, t in base.items() if b != r["provider"]}


def _rotating_call(fn: Callable[..., torch.Tensor], rot: Rotation) -> Callable[[], torch.Tensor]:
    return lambda: fn(**rot.next())


def run_case(
    case: Case,
    providers: list[Provider],
    device: torch.device,
    ceilings: dict,
    *,
    rep_ms: float,
    kernel_time: bool,
    seed: int = 0,
    on_done: Callable[[], None] | None = None,
) -> list[dict]:
    rows: list[dict] = []
    runnable: list[tuple[Provider, dict]] = []
    for prov in providers:
        row = _row(case, prov, device)
        rows.append(row)
        try:
            row["reason"] = prov.supports(case, device)
        except Exception as exc:
            row["reason"] = f"supports() raised {type(exc).__name__}: {exc}"
        if row["reason"] is None:
            runnable.append((prov, row))
        elif on_done:
            on_done()
    if not runnable:
        return rows

    gen = torch.Generator(device=device).manual_seed(seed)
    in_bytes = case.bytes_moved()
    sets = [case.make_inputs(device, gen) for _ in range(n_rotating_sets(in_bytes, device))]
    ref = oracle(case, sets[0])
    tol = TOLERANCE.get(case.out_dtype(), 1e-2)
    for prov, row in runnable:
        try:
            fn = prov.prepare(case, device)
            t0 = time.perf_counter()
            out = fn(**sets[0])
            _sync(device)
            row["first_call_s"] = time.perf_counter() - t0  # includes compilation / graph build
            err = rel_error(out, ref)
            row["rel_error"], row["tolerance"] = err, tol
            del out
            if not err <= tol:
                row["status"], row["reason"] = "failed", f"rel error {err:.3g} > tolerance {tol:g}"
                continue
            rot = Rotation(sets)
            call = _rotating_call(fn, rot)
            ms, method = bench_ms(call, device, rep_ms=rep_ms)
            row["time_us"], row["method"], row["rotating_sets"] = ms * 1e3, method, len(sets)
            row["e2e_us"] = e2e_ms(call, device, rep_ms=rep_ms / 2) * 1e3
            k = kernel_ms(call, device) if kernel_time else None
            row["kernel_us"] = k * 1e3 if k is not None else None
            row["status"] = "ok"
            _derive(row, ceilings)
        except torch.cuda.OutOfMemoryError as exc:
            row["status"], row["reason"] = "failed", f"out of memory: {str(exc)[:200]}"
            torch.cuda.empty_cache()
        except Exception as exc:
            row["status"], row["reason"] = "failed", f"{type(exc).__name__}: {str(exc)[:500]}"
        finally:
            if on_done:
                on_done()
    del sets, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _speedups(rows)
    return rows
