"""H200 check of the Hopper attention backward's GQA split (kernels_triton/_attention_hopper_bwd.py), ~1 min.

    PYTHONPATH=python:. python benchmarks/gpu_checks/attention_split.py [--shapes 1x32x8x2048x128,...]

Per shape (B x H x Hkv x S x D, bf16, causal): the backward alone - `run_hopper_bwd` on prepared tensors
(preprocess, dk/dv, the split sum, dq), no autograd, so the host never paces it - at FUSEKIT_HOPPER_BWD_SPLIT
1, 2, 4 and what "auto" picks, against SDPA's backward (its forward graph built once, `torch.autograd.grad`
with retain_graph), each do_bench's median with the L2 flushed. Every split's dq, dk, dv are checked against
split 1 (relative error <= 1e-2; exit status 1 otherwise). dkdv_split's default rule was read off this
script's rows (benchmarks/results/nvidia-h200/attention-split.json).
With $OUT set, writes $OUT/attention_split.json.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
import torch.nn.functional as F
import triton
from _out import run_meta, save_json  # benchmarks/gpu_checks/_out.py (the script's folder is on sys.path)

SHAPES = "1x32x8x2048x128,1x32x8x4096x128,2x32x8x2048x128,1x32x8x2048x64,8x32x8x1024x128"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_shape(B: int, H: int, Hkv: int, S: int, D: int, rep_ms: int) -> list[dict]:
    from kernels_triton import _attention_hopper_bwd as hb

    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    q = torch.randn(B, H, S, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dt, requires_grad=True)
    do = torch.randn(B, H, S, D, device=dev, dtype=dt)
    scale = D**-0.5
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    sdpa_us = 1e3 * triton.testing.do_bench(
        lambda: torch.autograd.grad(y, (q, k, v), do, retain_graph=True), rep=rep_ms
    )
    # o and lse from fusekit's own forward (the backward's inputs as training feeds them)
    attn_op = importlib.import_module("fusekit.ops.attention")  # the module (fusekit.ops.attention is the op)
    o, lse = attn_op.reference_forward(q.detach(), k.detach(), v.detach(), None, True, scale)[:2]
    o, lse = o.to(dt).contiguous(), lse.float().contiguous()
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    n_kb = -(-S // hb.BLOCK_KEYS)
    rows, base = [], None
    for split in ("1", "2", "4", "auto"):
        os.environ["FUSEKIT_HOPPER_BWD_SPLIT"] = split
        picked = hb.dkdv_split(True, D, n_kb, B * Hkv, H // Hkv, q.device.index)
        if split != "auto" and picked != int(split):
            continue
        dq, dk, dv = torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd)

        def call(dq=dq, dk=dk, dv=dv) -> None:
            hb.run_hopper_bwd(dq, dk, dv, do, qd, kd, vd, o, lse, True, scale)

        call()
        got = (dq.clone(), dk.clone(), dv.clone())
        if base is None:
            base = got
        err = max(_rel(g, b) for g, b in zip(got, base, strict=True))
        us = 1e3 * triton.testing.do_bench(call, rep=rep_ms)
        rows.append({"shape": f"B{B} H{H}/{Hkv} S{S} D{D}", "split": split, "picked": picked, "bwd_us": us,
                     "sdpa_bwd_us": sdpa_us, "vs_sdpa": sdpa_us / us, "rel_err_vs_split1": err,
                     "ok": err <= 1e-2})  # fmt: skip
    os.environ.pop("FUSEKIT_HOPPER_BWD_SPLIT", None)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="BxHxHkvxSxD[,...] (bf16, causal)")
    ap.add_argument("--rep-ms", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_split.py: needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    from kernels_triton import _attention_hopper_bwd as hb

    if not hb.HAS_GLUON:
        print("attention_split.py: this triton has no Gluon Hopper module", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__, flush=True)
    out, ok = [], True
    for spec in args.shapes.split(","):
        B, H, Hkv, S, D = (int(x) for x in spec.split("x"))
        for r in run_shape(B, H, Hkv, S, D, args.rep_ms):
            out.append(r)
            ok &= r["ok"]
            print(f"{r['shape']:22s} split {r['split']:>4s} (={r['picked']})  bwd {r['bwd_us']:8.1f} us  "
                  f"SDPA bwd {r['sdpa_bwd_us']:8.1f}  ratio {r['vs_sdpa']:.3f}  err {r['rel_err_vs_split1']:.1e}"
                  f"{'' if r['ok'] else '  FAIL'}", flush=True)  # fmt: skip
    save_json("attention_split.json", {"meta": run_meta(command=" ".join(sys.argv)), "rows": out})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
