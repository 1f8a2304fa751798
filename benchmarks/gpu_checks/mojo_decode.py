"""GPU check of the Mojo split-KV decode attention (mojo/_attention_decode.mojo) against the Triton backend and SDPA.

    PYTHONPATH=python:. python benchmarks/gpu_checks/mojo_decode.py      (sets FUSEKIT_MOJO_ATTN_DECODE=1)

Per shape (B, H/Hkv, Skv, D 128, bf16, one query per sequence): ops.attention with backend="mojo" and
"triton", and SDPA (enable_gqa), checked against SDPA (relative error <= 2e-2), then timed with
triton.testing.do_bench (median ms, L2 flushed between calls: GPU time incl. the host's issue time for
short kernels). Prints one line per (shape, provider) with us and GB/s of the KV read.
"""

from __future__ import annotations

import os

os.environ.setdefault(
    "FUSEKIT_MOJO_ATTN_DECODE", "1"
)  # on by default since 2026-11-27; kept so the check never times the prefill path

import torch
import torch.nn.functional as F
import triton.testing

import fusekit.ops as ops

SHAPES = [(b, 32, 8, skv, 128) for b in (1, 32) for skv in (2048, 8192, 32768)]  # (B, H, Hkv, Skv, D)


def main() -> int:
    bad = 0
    for b, h, hkv, skv, d in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        kv_bytes = 2 * k.numel() * k.element_size()
        runs = {
            "mojo": lambda q=q, k=k, v=v: ops.attention(q, k, v, backend="mojo"),
            "triton": lambda q=q, k=k, v=v: ops.attention(q, k, v, backend="triton"),
            "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        }
        for name, fn in runs.items():
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ok = err <= 2e-2
            bad += not ok
            ms = triton.testing.do_bench(fn, rep=50)
            print(
                f"B{b} H{h}/{hkv} Skv{skv} D{d} {name:7s} {ms * 1e3:9.1f} us "
                f"{kv_bytes / ms / 1e6:8.0f} GB/s err={err:.2e} {'ok' if ok else 'FAIL'}"
            )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
