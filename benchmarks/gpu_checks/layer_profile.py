"""Where a decoder layer's GPU time goes (issue #11, "layer prefill >= 1.05x torch.compile"): the model
benchmark's layer (fusekit.bench.model) per provider, one profiled call after warm-up, its kernels by name.

    PYTHONPATH=python:. python benchmarks/gpu_checks/layer_profile.py [--config llama2-7b]
        [--scenario prefill-2k] [--providers fusekit-triton,torch-compile] [--top 15]

Per provider: the call's GPU time (CUDA events, median of 20), the sum of its kernels and each kernel's
time (one profiled call), so the gap between two providers can be read kernel by kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from fusekit.bench import model as mb
from fusekit.bench.layer import CONFIGS, make_weights


def _events_us(call, n: int = 20) -> float:
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama2-7b", choices=sorted(CONFIGS))
    ap.add_argument("--scenario", default="prefill-2k")
    ap.add_argument("--providers", default="fusekit-triton,torch-compile")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = CONFIGS[args.config]
    sc = mb.scenario_for(args.scenario, cfg)
    gen = torch.Generator(device=dev).manual_seed(0)
    st = mb.make_setup(cfg, sc, make_weights(cfg, dev, dtype, gen), dev, dtype, seed=0)
    provs = {p.name: p for p in mb.all_providers()}
    print(torch.cuda.get_device_name(), "torch", torch.__version__, cfg.name, sc.name, flush=True)
    for name in args.providers.split(","):
        call = provs[name].build(st)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        gpu_us = _events_us(call)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels: Counter = Counter()
        count = 0
        for e in prof.key_averages():
            if e.self_device_time_total > 0:
                kernels[e.key[:100]] += e.self_device_time_total
                count += e.count
        print(json.dumps({
            "provider": name, "gpu_us": round(gpu_us, 1), "kernels_us": round(sum(kernels.values()), 1),
            "launches": count, "top_kernels_us": {k: round(v, 1) for k, v in kernels.most_common(args.top)},
        }), flush=True)  # fmt: skip
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
