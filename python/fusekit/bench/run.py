"""The benchmark loop: for each case, build rotating input sets, compute the float64 oracle (outputs,
and input gradients in the "train" suite), then for each provider check correctness first and only
then time it, after every input set has gone through it STEADY_PASSES more times and the steady-state
call has been checked again, on another input set (the memo / launch-replay / CUDA-graph paths the
timed calls take are not the first call's: a bug there, or a replay of the first call's pointers, was
timed and published as correct). Checked calls run with fusekit's outputs NaN-poisoned, and on CUDA
after a NaN-filled block went back to the allocator (a provider leaving part of its output unwritten
read the previous provider's correct values). Nothing here knows an op: the case
(`bench/cases/<op>.py`) supplies everything."""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Callable

import torch

from fusekit.bench.baselines import Provider
from fusekit.bench.cases import Case
from fusekit.bench.timing import (
    Rotation,
    bench_ms,
    e2e_ms,
    kernel_ms,
    n_rotating_sets,
    peak_memory_bytes,
    wall_per_call_ms,
)
from fusekit.outputs import poisoned

# Passes over the rotating input sets before any timing, so every set is timed in its steady state: the
# mojo backend executes a call's first sighting of its pointers, captures a graph on the second and replays
# from then on. Timed from the first pass, 256 small sets put up to 512 executes and captures into the
# timed loops (H200, rope small at d1ea527: wall 402 us per call, 28-38 once replayed).
STEADY_PASSES = 2


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf for NaN/inf outputs or a shape mismatch (shapes, not element
    counts: a [S, H] result of an [H, S] contract is a different answer, even where its values happen to
    line up)."""
    if tuple(out.shape) != tuple(ref.shape):
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
        else f"--backends none --baselines {provider.name}"
    )
    return (
        f"PYTHONPATH=python python -m fusekit.bench --device {device.type} --suite {case.suite} "
        f"--ops {case.op} {who} --case {shlex.quote(case.label)}"
    )


def _row(case: Case, provider: Provider, device: torch.device) -> dict:
    return {
        "op": case.op,
        "suite": case.suite,
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


def speedups(rows: list[dict]) -> None:
    """speedup_vs[b] = time of baseline b / time of this row, for each baseline timed on the same case."""
    base = {r["provider"]: r["time_us"] for r in rows if r["status"] == "ok" and r["kind"] == "baseline"}
    for r in rows:
        if r["status"] == "ok":
            r["speedup_vs"] = {b: t / r["time_us"] for b, t in base.items() if b != r["provider"]}


def _clone(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in inputs.items() if isinstance(t, torch.Tensor)}


def _restore(inputs: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, t in saved.items():
            inputs[k].copy_(t)


def _rotating_call(fn: Callable[..., tuple], rot: Rotation) -> Callable[[], tuple]:
    return lambda: fn(**rot.next())


def _check(
    case: Case, out: tuple[torch.Tensor, ...], ref: list[torch.Tensor], inputs: dict
) -> tuple[dict, str | None]:
    """Per-output relative errors and tolerances; the failure reason, or None."""
    names = case.output_names(inputs)
    if len(out) != len(ref):
        return {}, f"{len(out)} outputs, the oracle has {len(ref)} ({', '.join(names)})"
    errs = [rel_error(o.detach(), r) for o, r in zip(out, ref)]
    tols = case.tolerances(out, inputs)
    worst = max(range(len(errs)), key=lambda i: errs[i] / tols[i] if tols[i] else errs[i])
    info = {
        "rel_error": errs[worst],
        "tolerance": tols[worst],
        "outputs": names,
        "rel_errors": errs,
        "tolerances": tols,
    }
    bad = [f"{n} rel error {e:.3g} > tolerance {t:g}" for n, e, t in zip(names, errs, tols) if not e <= t]
    return info, "; ".join(bad) or None


def _poisoned_allocator(device: torch.device, nbytes: int) -> None:
    """On CUDA, hand the caching allocator a NaN-filled block of about the case's size, so a baseline's
    outputs (not under fusekit's poisoning) start as NaN rather than as the last provider's results."""
    if device.type != "cuda":
        return
    try:
        block = torch.empty(min(max(nbytes, 1 << 20), 4 << 30) // 4, dtype=torch.float32, device=device)
    except torch.cuda.OutOfMemoryError:
        return
    block.fill_(float("nan"))
    del block


def _checked_call(
    fn: Callable[..., tuple], case: Case, inputs: dict, ref: list[torch.Tensor], device: torch.device
) -> tuple[dict, str | None]:
    _poisoned_allocator(device, case.bytes_moved())
    with poisoned():
        out = fn(**inputs)
    _sync(device)
    info, bad = _check(case, out, ref, inputs)
    del out
    return info, bad


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

    n_sets = n_rotating_sets(case.bytes_moved(), device)

    def fresh_sets() -> list[dict[str, torch.Tensor]]:
        gen = torch.Generator(device=device).manual_seed(seed)
        return [case.make_inputs(device, gen) for _ in range(n_sets)]

    sets = fresh_sets()
    ref = case.oracle(sets[0])
    # the steady-state check's set (another one than the first call's where there are two) and its oracle,
    # both taken before any provider ran: one that writes into its inputs must not change what is expected
    steady = len(sets) - 1
    steady_ref = ref if steady == 0 else case.oracle(sets[steady])
    for prov, row in runnable:
        try:
            # a provider that writes into its inputs gets the steady set's values back, at the same
            # addresses (its steady state), before that check: its warm-up passes rewrote them
            pristine = _clone(sets[steady]) if prov.mutates_inputs(case) else None
            fn = case.step(prov.prepare(case, device))
            mark = prov.tuning_mark()
            _poisoned_allocator(device, case.bytes_moved())
            t0 = time.perf_counter()
            with poisoned():
                out = fn(**sets[0])
            _sync(device)
            row["first_call_s"] = time.perf_counter() - t0  # includes compilation / graph build
            tuned = prov.tuned_since(mark)
            if tuned:  # the configs its first call measured and picked (norm tiles, FFN GEMMs)
                row["tuned"] = tuned
            info, bad = _check(case, out, ref, sets[0])
            row.update(info)
            del out
            if bad is not None:
                row["status"], row["reason"] = "failed", bad
                continue
            call = _rotating_call(fn, Rotation(sets))
            for _ in range(STEADY_PASSES * len(sets)):
                call()
            _sync(device)
            if pristine is not None:
                _restore(sets[steady], pristine)
            info, bad = _checked_call(fn, case, sets[steady], steady_ref, device)
            row["steady_rel_error"] = info.get("rel_error")
            if bad is not None:
                row["status"], row["reason"] = "failed", f"steady-state call (input set {steady}): {bad}"
                continue
            row["peak_mem_bytes"] = peak_memory_bytes(call, device)
            ms, method = bench_ms(call, device, rep_ms=rep_ms)
            row["time_us"], row["method"], row["rotating_sets"] = ms * 1e3, method, len(sets)
            row["timer"] = "cuda-events" if device.type == "cuda" else "host"
            row["gpu_us"] = row["time_us"] if device.type == "cuda" else None
            wall, n = wall_per_call_ms(call, device, rep_ms=rep_ms / 2)
            row["wall_us"], row["wall_calls"] = wall * 1e3, n
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
            if prov.mutates_inputs(case):  # the next provider gets untouched inputs
                sets = fresh_sets()
            if on_done:
                on_done()
    del sets, ref, steady_ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    speedups(rows)
    return rows
