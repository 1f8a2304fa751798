"""Where a training step's GPU time goes (issue #12): HF eager, torch.compile, fusekit-triton and
fusekit-triton-compile on the same random-weight model, one JSON line per provider.

    PYTHONPATH=python:. python benchmarks/gpu_checks/train_profile.py [--model llama3-8b] [--layers 8]
        [--providers eager,compile,fusekit-triton,fusekit-triton-compile] [--train 1x2048] [--top 12] [--copies]

Per provider (the e2e benchmark's train scenario: forward with labels, HF's loss, backward, AdamW): the
step's wall time (median of 5 after 3 warm-up steps), its host issue time (until step() returns) and the
host syncs it makes (where, by innermost caller outside torch), then one profiled step: the sum of its CUDA
kernel times per category (gemm, attention, norm, rope, ffn_act, loss, optimizer, copy/cast, elementwise,
other, by kernel name) and the largest kernels; --copies adds the copy-like aten ops (copies, clones, casts,
fills, cats) by input shapes and Python caller. wall - kernels is time the GPU sat idle (host-bound or
syncs).

Measured on the H200 (llama3-8b, 8 layers, 1 x 2048, foreach AdamW; b10c7dd, one process per script run):
wall / kernel sum in ms - eager 97.1 / 90.4 (AdamW's multi_tensor_apply 36.4, GEMMs 35.1, copies and casts
8.6, elementwise 4.7, SDPA (cuDNN) fwd+bwd 2.6), torch.compile 89.3 / 83.7 (GEMMs 35.3, its cuDNN backward
4.9 ms against eager's 1.8), fusekit-triton 88.5 / 79.5 and, at a24ac27, 86.9 / 80.6 with no host sync in
the step and 55.8 ms of host issue time (attention fwd+bwd 3.45: _dkdv_hopper 2.05, _dq_hopper 0.72, forward
0.60 - against cuDNN's 2.6, the one fused op slower than what it replaces). The optimizer is 42 % of every
provider's step: the 32-layer e2e with AdamW(fused=True), HF Trainer's default, is
benchmarks/results/nvidia-h200/e2e-llama3-8b-32l-fused-adamw.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import Counter

import torch
from _syncs import host_syncs  # benchmarks/gpu_checks/_syncs.py (the script's folder is on sys.path)
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from fusekit.bench.e2e import config as e2e
from fusekit.bench.e2e import providers as e2e_providers
from fusekit.bench.e2e.scenarios import train_step

# First match wins: kernel name regex -> category.
_CATEGORIES = (
    ("optimizer", r"adam|multi_tensor|foreach|_fused_adam"),
    ("attention", r"flash|fmha|attn|attention|sdpa|_dkdv|_dq_|_bwd_preprocess"),
    ("loss", r"cross_entropy|nll_loss|log_softmax|lce|_ce_"),
    ("norm", r"rms|norm"),
    ("rope", r"rope|rotary"),
    ("ffn_act", r"swiglu|silu|ffn|gate_up|_mlp"),
    ("gemm", r"gemm|sm90_xmma|cutlass|cublas|nvjet|matmul|_mm_|wgmma"),
    ("copy/cast", r"copy|cast|to_copy|convert|fill|memset|memcpy"),
    ("elementwise", r"elementwise|vectorized|reduce|triton_poi|triton_red|triton_per"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in _CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


# aten ops that move or fill memory: with --copies each is listed by input shapes and Python caller
_COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::cat", "aten::fill_",
             "aten::zero_", "aten::reshape", "aten::index_put_", "aten::embedding_dense_backward")  # fmt: skip


def _copies(step, dev: torch.device, top: int) -> list[dict]:
    """One more profiled step with shapes and stacks: the copy-like aten ops (_COPY_OPS) by device time
    (CPU time on the CPU), grouped by input shapes and their innermost callers outside torch."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    verbose = _ExperimentalConfig(verbose=True)  # Python frames in the stacks (torch 2.11+)
    with profile(activities=acts, record_shapes=True, with_stack=True, experimental_config=verbose) as prof:
        step()
        e2e._sync(dev)
    rows = []
    for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=12):
        if e.key not in _COPY_OPS:
            continue
        us = e.device_time_total if dev.type == "cuda" else e.cpu_time_total
        # innermost first; backward ops run on autograd's thread and have none (their shapes say which)
        frames = [f for f in (e.stack or []) if "/torch/" not in f]
        rows.append({"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count, "ms": round(us / 1e3, 3),
                     "where": frames[:3]})  # fmt: skip
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def profile_provider(
    name: str, setup: e2e.Setup, state: dict, b: int, s: int, top: int, copies: bool = False
) -> dict:
    [prov] = e2e_providers.make_providers([name], setup)
    why = prov.unavailable(setup)
    if why:
        return {"provider": name, "status": "skipped", "reason": why}
    model = e2e.fresh_model(setup, state)
    try:
        step = train_step(prov.prepare(model), model, setup, b, s)
        for _ in range(3):
            step()
        dev = setup.torch_device
        e2e._sync(dev)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            step()
            e2e._sync(dev)
            times.append(time.perf_counter() - t0)
        acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]  # CPU: a smoke test
        with profile(activities=acts) as prof:
            step()
            e2e._sync(dev)
        per_cat: Counter = Counter()
        per_kernel: Counter = Counter()
        launches: Counter = Counter()
        for e in prof.key_averages():
            us = e.self_device_time_total if dev.type == "cuda" else e.self_cpu_time_total
            if us <= 0:
                continue
            per_cat[category(e.key)] += us
            per_kernel[e.key[:90]] += us
            launches[category(e.key)] += e.count
        total = sum(per_cat.values())
        e2e._sync(dev)
        t0 = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - t0) * 1e3  # until step() returns: the host's issue time
        e2e._sync(dev)
        syncs = dict(host_syncs(step).most_common(12)) if dev.type == "cuda" else {}
        copy_rows = _copies(step, dev, top) if copies else None
        wall_ms = statistics.median(times) * 1e3
        return {
            "provider": name,
            "status": "ok",
            "wall_ms": round(wall_ms, 2),
            "kernels_ms": round(total / 1e3, 2),
            "idle_ms": round(wall_ms - total / 1e3, 2),
            "host_ms": round(host_ms, 2),
            "syncs": syncs,
            "by_category_ms": {k: round(v / 1e3, 2) for k, v in per_cat.most_common()},
            "launches": dict(launches.most_common()),
            "top_kernels_ms": {k: round(v / 1e3, 2) for k, v in per_kernel.most_common(top)},
            **({"copies": copy_rows} if copy_rows is not None else {}),
        }
    finally:
        prov.close()
        del model
        e2e._free()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=sorted(e2e.MODELS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--providers", default="eager,compile,fusekit-triton,fusekit-triton-compile")
    ap.add_argument("--train", default="1x2048")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copies", action="store_true", help="also list the copy-like aten ops, shapes, callers")
    args = ap.parse_args()
    [(b, s)] = e2e._shapes(args.train)[:1]
    setup = e2e.Setup(device=args.device, model=args.model, layers=args.layers, dtype="bf16", attn_implementation="sdpa",
                      prefill=[(b, s)], decode=[(1, 16, 2)], train=[(b, s)], seed=0)  # fmt: skip
    state = e2e.base_weights(setup)
    gpu = torch.cuda.get_device_name() if setup.torch_device.type == "cuda" else "cpu"
    print(gpu, "torch", torch.__version__, f"{args.model} x{args.layers}", flush=True)
    for name in args.providers.split(","):
        row = profile_provider(name, setup, state, b, s, args.top, args.copies)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
