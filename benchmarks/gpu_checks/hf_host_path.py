"""Where a patched Hugging Face model's time goes on the host (issues #11, #12): HF eager against
fusekit.hf.patch on the same random-weight model, one JSON line per (provider, scenario).

    PYTHONPATH=python:. python benchmarks/gpu_checks/hf_host_path.py [--model llama3.2-1b] [--backend triton]

Per provider:
- prefill B x S (use_cache=False): `host_ms` from the call to its return (what the host spends issuing
  the forward; the GPU may still be running), `done_ms` until the device is idle, `kernel_ms` the CUDA
  kernels' sum from the profiler, `syncs` the host syncs torch's sync-debug mode reports in one forward.
  host_ms > kernel_ms means the forward is host-bound: the GPU waits for the launcher Python.
- decode (generate, 1 x prompt + new tokens): ms per token and CUDA launches per token.
Measured on the H200 at b02a12f (llama3.2-1b, 16 layers, bf16, 1 x 2048): HF eager prefill host 10.7 ms,
fusekit-triton 16.9 ms with 8.8 ms of kernels (eager 11.6); decode per token 23.5 / 14.2 ms, launches 724 /
255 (the .dev probes this script replaces). H100 at 6801f6c (after eee742b / 90848e0 put the swiglu_ffn
prefill call on the decided-key path and made it replayable): eager prefill host 17.1 ms, done 18.5, kernels
12.1; fusekit-triton host 14.8, done 16.2 (1.14x eager), kernels 9.0, 1 sync; decode 25.6 / 11.7 ms per
token (2.18x), launches 724 / 255. Both prefills are host-bound on that host: HF's own module Python is
most of it (cProfile: 81 fusekit op calls per forward, ~25 us each, against 65 torch linears at ~28 us).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _syncs import host_syncs  # benchmarks/gpu_checks/_syncs.py (the script's folder is on sys.path)
from torch.profiler import ProfilerActivity, profile

import fusekit.hf
from fusekit.bench.e2e import config as e2e

_LAUNCHES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchKernelExC",
    "cudaGraphLaunch",
)


def _prefill(model, ids: torch.Tensor) -> dict:
    for _ in range(3):
        model(ids, use_cache=False)
    torch.cuda.synchronize()
    host, done = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        model(ids, use_cache=False)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        done.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(ids, use_cache=False)
        torch.cuda.synchronize()
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
    syncs = sum(host_syncs(lambda: model(ids, use_cache=False)).values())
    host.sort()
    done.sort()
    return {"host_ms": host[2] * 1e3, "done_ms": done[2] * 1e3, "kernel_ms": kernel_us / 1e3, "syncs": syncs}


def _decode(model, ids: torch.Tensor, new: int) -> dict:
    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e2e._generate(model, ids, n)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(3)
    per = sorted((gen(new + 1) - gen(1)) / new for _ in range(3))[1]
    counts = []
    for n in (1, 9):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            e2e._generate(model, ids, n)
        counts.append(sum(1 for e in prof.events() if e.name in _LAUNCHES))
    return {"ms_per_token": per * 1e3, "launches_per_token": (counts[1] - counts[0]) / 8}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3.2-1b", choices=sorted(e2e.MODELS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--prefill", default="1x2048")
    ap.add_argument("--decode", default="1x2048+32")
    args = ap.parse_args()
    layers = args.layers or e2e.MODELS[args.model].get("layers", 16)
    (b, s), (db, dp, dn) = e2e._shapes(args.prefill)[0], e2e._decode_shapes(args.decode)[0]
    setup = e2e.Setup(device="cuda", model=args.model, layers=layers, dtype="bf16", attn_implementation="sdpa",
                      prefill=[(b, s)], decode=[(db, dp, dn)], train=[(1, s)], seed=0)  # fmt: skip
    state = e2e.base_weights(setup)
    with torch.no_grad():
        model = e2e.fresh_model(setup, state)
        for name in ("eager", f"fusekit-{args.backend}"):
            if name != "eager":
                fusekit.hf.patch(model, backend=args.backend, strict=True)
            row = {"provider": name, "model": args.model, "layers": layers, "prefill": args.prefill}
            row.update(_prefill(model, e2e._ids(setup, b, s, 0)))
            row["decode"] = args.decode
            row.update(_decode(model, e2e._ids(setup, db, dp, 1), dn))
            print(
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )


if __name__ == "__main__":
    main()
