"""H200 check of Triton split-KV decode attention: the split count and the host path (~2.5 min).

    PYTHONPATH=python:. python benchmarks/gpu_checks/decode.py [--sweep-only | --host-only] [--shapes N | --select 2,9]

1. Split sweep: per decode shape (B, H/Hkv, Skv, D; one query per sequence), kernel time (do_bench median,
   L2 flushed) of every BLOCK_N x stages x warps tile and forced split count, beside SDPA's flash-decoding
   and the split count `decode_splits` picks, with the KV-read floor (B*Hkv*Skv*D*2 elements at 4.25 TB/s).
   `_attention_decode.decode_splits`'s one-wave model was chosen from this sweep (its docstring has the
   figures); a pick slower than the sweep's best by more than 3% means the model needs another look.
   Short caches (B1 Skv 2K-8K: kernels of 8-15 us) are host-bound: do_bench's event times then include
   the host's issue time and move with the host (a run of --shapes 2 on a slow host put the default at
   81 us against a best of 18 at Skv 2K), so judge the split model on the long-cache and batched shapes.
2. Host path per call at B1 H32/8 D128 bf16 with a KV cache that grows by one key per call (an HF
   DynamicCache: torch.cat gives a new Skv and new strides every token) and with a fixed one: ops.attention
   (the grown path runs the provider per call; a fixed signature replays its recorded launches), the
   kernels_triton entry, decode_forward alone, and SDPA the same way.
Each output of (1) is checked against SDPA (relative error <= 2e-2 in bf16); exit status 1 if one is off.
With $OUT set, writes $OUT/decode_check.json.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F
from _out import save_json  # benchmarks/gpu_checks/_out.py (the script's folder is on sys.path)

SHAPES = [  # (B, H, Hkv, Skv, D)
    (1, 32, 8, 2048, 128),
    (1, 32, 8, 8192, 128),
    (1, 32, 8, 32768, 128),
    (32, 32, 8, 2048, 128),
    (32, 32, 8, 8192, 128),
    (8, 32, 8, 8192, 128),
    (1, 32, 32, 32768, 128),
    (1, 32, 8, 32768, 64),
    (1, 32, 8, 32768, 256),
    (1, 32, 8, 131072, 128),
]
BLOCK_N = {64: (64, 128, 256), 128: (32, 64, 128), 256: (16, 32, 64)}
SPLITS = (None, 1, 2, 4, 8, 16, 24, 33, 48, 64, 128)  # None: decode_splits' pick (33 x 8 kv heads: 2 waves)
SMEM = 200 * 1024  # K and V tiles of all stages must fit the shared memory (227 KB on sm_90, some margin)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _sweep_shape(B: int, H: int, Hkv: int, Skv: int, D: int, rep_ms: int) -> tuple[dict, bool]:
    import triton

    from kernels_triton import _attention_decode as AD
    from kernels_triton import _launch

    g = torch.Generator(device="cuda").manual_seed(Skv + D)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hkv, Skv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, Hkv, Skv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    o, lse = torch.full_like(q, float("nan")), torch.empty(B, H, 1, device="cuda")
    scale = D**-0.5
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale)
    sdpa = triton.testing.do_bench(
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale), rep=rep_ms
    )
    tile, warps = AD.decode_tile, AD.decode_warps
    timed, ok = [], True
    try:
        for bn, st, w in itertools.product(BLOCK_N[D], (2, 3, 4), (4, 8)):
            if bn * D * 2 * 2 * st > SMEM:
                continue
            AD.decode_tile = lambda d, bn=bn, st=st: (bn, st)
            AD.decode_warps = lambda bm, bn_, d, w=w: w
            for sp in SPLITS:
                if sp is not None and sp * bn > Skv:
                    continue
                AD._PLANS.clear()
                _launch.clear()  # the keyed launches remember a plan's kernel

                def run(sp=sp) -> None:
                    AD.decode_forward(o, lse, q, k, v, None, False, scale * 1.4426950408889634, splits=sp)

                run()
                err = _rel(o, want)
                if err > 2e-2:
                    ok = False
                    print(f"  WRONG B{B} H{H}/{Hkv} Skv{Skv} D{D} {bn}/{st}/{w} splits {sp}: rel {err:.3g}")
                picked = next(iter(AD._PLANS.values())).splits.get(Skv)
                timed.append((triton.testing.do_bench(run, rep=rep_ms) * 1e3, bn, st, w, sp, picked))
    finally:
        AD.decode_tile, AD.decode_warps = tile, warps
        AD._PLANS.clear()
        _launch.clear()
    cur = [t for t in timed if t[4] is None and (t[1], t[2]) == tile(D) and t[3] == warps(16, t[1], D)]
    timed.sort()
    floor = B * Hkv * Skv * D * 2 * 2 / 4.25e12 * 1e6
    row = {
        "shape": {"B": B, "H": H, "Hkv": Hkv, "Skv": Skv, "D": D},
        "floor_us": floor,
        "sdpa_us": sdpa * 1e3,
        "default_us": cur[0][0] if cur else None,
        "default_splits": cur[0][5] if cur else None,
        "best": [dict(zip(("us", "block_n", "stages", "warps", "splits"), t[:5])) for t in timed[:5]],
    }
    print(
        f"B{B} H{H}/{Hkv} Skv{Skv} D{D}: floor {floor:.1f} us, SDPA {row['sdpa_us']:.1f}, default "
        f"{row['default_us'] or float('nan'):.1f} ({row['default_splits']} splits)",
        flush=True,
    )
    for t in timed[:5]:
        print(f"    {t[0]:7.1f} us  BLOCK_N {t[1]} stages {t[2]} warps {t[3]} splits {t[4]}", flush=True)
    return row, ok


def sweep(rep_ms: int, shapes: list[tuple[int, ...]]) -> tuple[list[dict], bool]:
    rows, ok = [], True
    for shape in shapes:
        row, good = _sweep_shape(*shape, rep_ms)
        rows.append(row)
        ok = ok and good
    return rows, ok


def host(calls: int = 200) -> dict[str, float]:
    from fusekit import ops
    from kernels_triton import _attention_decode as AD
    from kernels_triton import attention as KA

    B, H, Hkv, D, L0 = 1, 32, 8, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ks = [
        torch.randn(B, Hkv, L0 + i, D, device="cuda", dtype=torch.bfloat16, generator=g) for i in range(calls)
    ]
    vs = [torch.randn_like(t) for t in ks]
    o, lse = torch.empty_like(q), torch.empty(B, H, 1, device="cuda")
    scale = D**-0.5
    cases = {
        "sdpa grown": lambda i: F.scaled_dot_product_attention(q, ks[i], vs[i], enable_gqa=True),
        "sdpa fixed": lambda i: F.scaled_dot_product_attention(q, ks[0], vs[0], enable_gqa=True),
        "ops.attention grown": lambda i: ops.attention(q, ks[i], vs[i], backend="triton"),
        "ops.attention fixed": lambda i: ops.attention(q, ks[0], vs[0], backend="triton"),
        "kernels_triton forward grown": lambda i: KA.forward(o, lse, q, ks[i], vs[i], None, False, scale),
        "decode_forward grown": lambda i: AD.decode_forward(
            o, lse, q, ks[i], vs[i], None, False, scale * 1.4427
        ),
    }
    res = {}
    for name, fn in cases.items():
        for i in range(calls):  # every length's specialization compiled before timing
            fn(i)
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        res[name] = best
        print(f"{name:32s} {best:7.1f} us/call", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--host-only", action="store_true")
    ap.add_argument("--rep-ms", type=int, default=25)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="sweep only the first N shapes")
    ap.add_argument("--select", default="", help="sweep only these SHAPES indices (comma-separated)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode check: needs a CUDA GPU", file=sys.stderr)
        return 2
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    ok = True
    if not args.host_only:
        picked = [SHAPES[int(i)] for i in args.select.split(",")] if args.select else SHAPES[: args.shapes]
        out["sweep"], ok = sweep(args.rep_ms, picked)
    if not args.sweep_only:
        out["host_us_per_call"] = host()
    save_json("decode_check.json", out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
