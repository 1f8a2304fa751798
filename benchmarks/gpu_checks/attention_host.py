"""Where ops.attention's training call spends host time (issues #10, #11), ~1 min on a GPU.

    PYTHONPATH=python:. python benchmarks/gpu_checks/attention_host.py [--shape 1x32x8x2048x128] [--top 30]

At one shape (B x H x Hkv x S x D, bf16, causal), for fusekit's triton backend and SDPA: the host time of the
forward call and of `backward` (perf_counter around each, no sync: the GPU runs behind), the loop's wall time
per forward + backward, the GPU time of the pair (CUDA events), then cProfile over fusekit's loop: the
functions with the most own time and the most cumulative time, and torch.profiler's CPU-side aten ops of one
pair (which allocations, copies and small kernels the host path issues). host >> GPU means a model of this
shape waits on fusekit's launcher Python. With $OUT set, writes $OUT/attention_host.json
(--autograd-only: $OUT/attention_host_autograd.json; --loop-only: $OUT/attention_host_loop.json).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _out import run_meta, save_json  # benchmarks/gpu_checks/_out.py (the script's folder is on sys.path)

from fusekit import ops


def fk(q, k, v):
    """fusekit's triton attention (causal), the call measured."""
    return ops.attention(q, k, v, causal=True, backend="triton")


def sd(q, k, v):
    """SDPA with GQA (causal), the baseline."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _pair(fn, q, k, v, do):
    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        o = fn(q, k, v)
        t1 = time.perf_counter()
        o.backward(do)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    return run


def measure(name: str, fn, q, k, v, do, reps: int) -> dict:
    run = _pair(fn, q, k, v, do)
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    fwd, bwd = [], []
    t0 = time.perf_counter()
    for _ in range(reps):
        a, b = run()
        fwd.append(a)
        bwd.append(b)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # GPU time: queue the pairs behind a sleep so the host never paces them
    torch.cuda._sleep(int(2e8))
    e0.record()
    for _ in range(reps):
        run()
    e1.record()
    torch.cuda.synchronize()
    gpu = e0.elapsed_time(e1) / reps * 1e3
    row = {"provider": name, "fwd_host_us": 1e6 * statistics.median(fwd), "bwd_host_us": 1e6 * statistics.median(bwd),
           "wall_us": 1e6 * wall, "gpu_us": gpu}  # fmt: skip
    print(f"{name:8s} fwd host {row['fwd_host_us']:7.1f} us  bwd host {row['bwd_host_us']:7.1f} us  "
          f"loop wall {row['wall_us']:7.1f} us  GPU {gpu:7.1f} us", flush=True)  # fmt: skip
    return row


def _host_us(fn, reps: int) -> float:
    """Median host time of fn() over reps calls, the queue drained every 8 calls (never backs up)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)


def _prepared(q, k, v) -> tuple:
    """Detached q, k, v, the scale, o and lse from kernels_triton's forward, and empty dq, dk, dv."""
    from kernels_triton import attention as A

    qd, kd, vd = q.detach(), k.detach(), v.detach()
    B, H, S, D = q.shape
    scale = D**-0.5
    o = torch.empty_like(qd)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    A.forward(o, lse, qd, kd, vd, None, True, scale)
    return qd, kd, vd, scale, o, lse, torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)


def layers(q, k, v, do, reps: int) -> dict:
    """Host time of each layer of the triton path, innermost first: the Gluon launch functions, the
    kernels_triton entry points, ops.attention without and with autograd, the autograd backward."""
    from kernels_triton import attention as A
    from kernels_triton._attention_hopper import run_hopper
    from kernels_triton._attention_hopper_bwd import run_hopper_bwd

    qd, kd, vd, scale, o, lse, dq, dk, dv = _prepared(q, k, v)
    with torch.cuda.device(q.device):
        r = {
            "layer": "host_us",
            "torch.empty x4": _host_us(lambda: [torch.empty_like(qd) for _ in range(4)], reps),
            "run_hopper": _host_us(
                lambda: run_hopper(o, lse, qd, kd, vd, True, scale * 1.4426950408889634), reps
            ),
            "A.forward": _host_us(lambda: A.forward(o, lse, qd, kd, vd, None, True, scale), reps),
            "ops.attention no grad": _host_us(
                lambda: ops.attention(qd, kd, vd, causal=True, backend="triton"), reps
            ),
            "ops.attention grad (fwd)": _host_us(
                lambda: ops.attention(q, k, v, causal=True, backend="triton"), reps
            ),
            "run_hopper_bwd": _host_us(
                lambda: run_hopper_bwd(dq, dk, dv, do, qd, kd, vd, o, lse, True, scale), reps
            ),
            "A.backward": _host_us(
                lambda: A.backward(dq, dk, dv, do, qd, kd, vd, o, lse, None, True, scale), reps
            ),
        }
        y = ops.attention(q, k, v, causal=True, backend="triton")
        r["autograd.grad (bwd)"] = _host_us(
            lambda: torch.autograd.grad(y, (q, k, v), do, retain_graph=True), reps
        )
        ys = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        r["sdpa fwd"] = _host_us(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), reps
        )
        r["sdpa autograd.grad (bwd)"] = _host_us(
            lambda: torch.autograd.grad(ys, (q, k, v), do, retain_graph=True), reps
        )
    for name, us in r.items():
        if name != "layer":
            print(f"  host {name:28s} {us:8.1f} us", flush=True)
    return r


def autograd_probe(q, k, v, do, reps: int, top: int) -> dict:
    """Where the autograd backward's time goes beyond kernels_triton's backward. Bare autograd.Functions whose
    backward returns ready grads ("empty"), allocates them, or runs A.backward; each one's host time through
    torch.autograd.grad, the time its body took inside the engine (perf_counter in backward) and the thread it
    ran on; the same with the engine's device threads off (set_multithreading_enabled(False)); one grad queued
    behind a 50 ms GPU sleep (a host sync inside would make it ~50 ms); A.backward handed to a Python thread;
    then cProfile of fusekit's backward."""
    import queue
    import threading

    from kernels_triton import attention as A

    qd, kd, vd, scale, o, lse, dq, dk, dv = _prepared(q, k, v)
    body: list[float] = []
    threads: set[int] = set()

    def fn_of(run):
        class Bare(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):
                return o.clone()

            @staticmethod
            def backward(ctx, g):
                t0 = time.perf_counter()
                threads.add(threading.get_ident())
                r = run(g)
                body.append(time.perf_counter() - t0)
                return r

        return Bare

    def full(g):
        A.backward(dq, dk, dv, g, qd, kd, vd, o, lse, None, True, scale)
        return dq, dk, dv

    variants = {
        "empty": lambda g: (dq, dk, dv),
        "alloc x3": lambda g: (torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)),
        "A.backward": full,
    }
    r: dict = {"layer": "autograd_host_us", "main_thread": threading.get_ident()}
    r["A.backward direct"] = _host_us(lambda: full(do), reps)
    for name, run in variants.items():
        y = fn_of(run).apply(q, k, v)
        for mt in (True, False):
            body.clear()
            threads.clear()
            with torch.autograd.set_multithreading_enabled(mt):
                us = _host_us(lambda y=y: torch.autograd.grad(y, (q, k, v), do, retain_graph=True), reps)
            key = f"bare {name}" + ("" if mt else " (engine threads off)")
            r[key] = us
            r[key + " body"] = 1e6 * statistics.median(body)
            r[key + " ran on main thread"] = threads == {r["main_thread"]}
    y = ops.attention(q, k, v, causal=True, backend="triton")
    r["ops.attention grad"] = _host_us(lambda: torch.autograd.grad(y, (q, k, v), do, retain_graph=True), reps)
    with torch.autograd.set_multithreading_enabled(False):
        r["ops.attention grad (engine threads off)"] = _host_us(
            lambda: torch.autograd.grad(y, (q, k, v), do, retain_graph=True), reps
        )
    ys = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    r["sdpa grad"] = _host_us(lambda: torch.autograd.grad(ys, (q, k, v), do, retain_graph=True), reps)
    for name, yy in (("ops.attention", y), ("sdpa", ys)):  # a host sync would wait out the sleep
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e8))  # ~50 ms of GPU clock cycles
        t0 = time.perf_counter()
        torch.autograd.grad(yy, (q, k, v), do, retain_graph=True)
        r[f"{name} grad behind a GPU sleep"] = 1e6 * (time.perf_counter() - t0)
        torch.cuda.synchronize()
    jobs: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def worker() -> None:
        while (job := jobs.get()) is not None:
            done.put(job())

    th = threading.Thread(target=worker, daemon=True)
    th.start()

    def handed():
        jobs.put(lambda: full(do))
        done.get()

    r["A.backward on a Python thread"] = _host_us(handed, reps)
    r["empty job on a Python thread"] = _host_us(lambda: (jobs.put(lambda: None), done.get()), reps)
    jobs.put(None)
    for name, us in r.items():
        if name not in ("layer", "main_thread"):
            print(f"  {name:52s} {us:9.1f}" if isinstance(us, float) else f"  {name:52s} {us}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        torch.autograd.grad(y, (q, k, v), do, retain_graph=True)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
    print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[:5000])
    r["cprofile"] = buf.getvalue()
    return r


def loop_probe(q, k, v, do, reps: int) -> dict:
    """The training pattern (forward, then backward, every step a new graph) against the isolated calls: the
    median host time of each half in loops that differ in one thing (Python's GC off; autograd.grad instead of
    .backward; the engine's device threads off), each half issued behind a 50 ms GPU sleep (a host sync inside
    it would make it ~50 ms), and the syncs torch's sync-debug mode reports in one pair."""
    import gc
    import warnings

    def loop(f, back) -> tuple[float, float]:
        fw, bw = [], []
        for i in range(reps + 5):
            t0 = time.perf_counter()
            y = f(q, k, v)
            t1 = time.perf_counter()
            back(y)
            t2 = time.perf_counter()
            if i >= 5:
                fw.append(t1 - t0)
                bw.append(t2 - t1)
        torch.cuda.synchronize()
        return 1e6 * statistics.median(fw), 1e6 * statistics.median(bw)

    r: dict = {"layer": "loop_host_us"}
    for name, f in (("triton", fk), ("sdpa", sd)):
        r[f"{name} .backward"] = loop(f, lambda y: y.backward(do))
        gc.disable()
        r[f"{name} .backward, gc off"] = loop(f, lambda y: y.backward(do))
        gc.enable()
        r[f"{name} autograd.grad"] = loop(f, lambda y: torch.autograd.grad(y, (q, k, v), do))
        with torch.autograd.set_multithreading_enabled(False):
            r[f"{name} .backward, engine threads off"] = loop(f, lambda y: y.backward(do))
        for _ in range(3):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(1e8))
            t0 = time.perf_counter()
            y = f(q, k, v)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(1e8))
            t2 = time.perf_counter()
            y.backward(do)
            t3 = time.perf_counter()
            torch.cuda.synchronize()
        r[f"{name} behind a GPU sleep"] = (1e6 * (t1 - t0), 1e6 * (t3 - t2))
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                f(q, k, v).backward(do)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        r[f"{name} syncs (sync-debug mode)"] = [str(w.message)[:200] for w in caught]
    for name, v_ in r.items():
        if name != "layer":
            print(f"  {name:44s} {v_}", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x32x8x2048x128", help="BxHxHkvxSxD (bf16, causal)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--autograd-only", action="store_true", help="only the autograd backward's breakdown")
    ap.add_argument("--loop-only", action="store_true", help="only the training-loop pattern's probes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_host.py: needs a CUDA GPU", file=sys.stderr)
        return 2

    B, H, Hkv, S, D = (int(x) for x in args.shape.split("x"))
    torch.manual_seed(0)
    mk = lambda h: torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = mk(H), mk(Hkv), mk(Hkv)
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)

    print(torch.cuda.get_device_name(), "torch", torch.__version__, args.shape, flush=True)
    if args.loop_only:
        r = loop_probe(q, k, v, do, args.reps)
        save_json("attention_host_loop.json", {"meta": run_meta(command=" ".join(sys.argv)), "rows": [r]})
        return 0
    if args.autograd_only:
        r = autograd_probe(q, k, v, do, args.reps, args.top)
        save_json("attention_host_autograd.json", {"meta": run_meta(command=" ".join(sys.argv)), "rows": [r]})
        return 0
    rows = [measure("triton", fk, q, k, v, do, args.reps), measure("sdpa", sd, q, k, v, do, args.reps)]

    rows.append(layers(q, k, v, do, args.reps))

    run = _pair(fk, q, k, v, do)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        run()
    prof.disable()
    torch.cuda.synchronize()
    stats = {}
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(order).print_stats(args.top)
        stats[order] = buf.getvalue()
        print(f"--- cProfile, 20 pairs, by {order}")
        print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[:6000])

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        run()
    torch.cuda.synchronize()
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
    print("--- torch.profiler, one pair, CPU ops")
    print(table)
    save_json("attention_host.json", {"meta": run_meta(command=" ".join(sys.argv)), "rows": rows,
                                      "cprofile": stats, "aten": table})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
