"""GPU check of swiglu_ffn's vendor gate/up candidate ("blas": two cuBLAS / hipBLASLt GEMMs + one Triton
element-wise kernel), bf16, D=4096, no norm (~2 minutes on an H100 / H200, most of it compiling).

    PYTHONPATH=python:. python benchmarks/gpu_checks/ffn_gate_up_blas.py [--F 11008 14336]
        [--T 128 256 512 1024 4096] [--rep-ms 20] [--no-train]

One line per (F, T):
  err     relative error on 16 rows (spread over T) against float64: the automatic choice, and `_gemm="blas"`
          (both GEMMs vendor) - bound 1e-2 (the contract's bf16 tolerance);
  gate_up the selector's pick and every gate/up candidate it timed (us; ptr, the TMA configs, blas), and the
          down GEMM's pick;
  e2e     device time (do_bench median) of fusekit.ops.swiglu_ffn(backend="triton"), of the launcher forced to
          `_gemm="blas"`, of torch.compile of the bf16 MLP and of the eager bf16 MLP (cuBLAS), all in this
          process, and compile / ops (the speedup over torch.compile: >= 1 is the target).
Then one line for training at T=4096, F=14336 (forward saving gu + backward, the launcher entry points,
against torch.compile of the bf16 MLP forward + backward) with y, gu and dx checked on 16 rows, and one line
for a launch replay of the forced vendor path (kernels_triton._replay: record, then replay into fresh
outputs: bit-identical). Exit status 1 if a check fails. With $OUT set, writes $OUT/ffn_gate_up_blas.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn

ROOT = Path(__file__).resolve().parents[2]
for p in (str(ROOT / "python"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import triton  # noqa: E402
from _out import save_json  # noqa: E402 (benchmarks/gpu_checks/_out.py: the script's folder is on sys.path)

import fusekit  # noqa: E402
import kernels_triton.swiglu_ffn as ffn  # noqa: E402
from kernels_triton import _replay  # noqa: E402
from kernels_triton._config import next_pow2  # noqa: E402


# the inputs of benchmarks/gpu_checks/ffn.py, without its optional norm weight
def inputs(T: int, D: int, F: int, seed: int):
    """bf16 x [T, D] ~ N(0, 1) and weights scaled like a trained layer (std 1/sqrt(fan_in))."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    wg = (torch.randn(F, D, device="cuda", generator=g) / D**0.5).bfloat16()
    wu = (torch.randn(F, D, device="cuda", generator=g) / D**0.5).bfloat16()
    wd = (torch.randn(D, F, device="cuda", generator=g) / F**0.5).bfloat16()
    return x, wg, wu, wd


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


D, EPS, TOL_BF16 = 4096, 1e-6, 1e-2
for name in ("recompile_limit", "cache_size_limit"):  # one compiled graph per shape (dynamic=False)
    if hasattr(torch._dynamo.config, name):
        setattr(torch._dynamo.config, name, 64)


def mlp(x, wg, wu, wd):
    return (Fn.silu(x @ wg.T) * (x @ wu.T)) @ wd.T


def mlp64(x, wg, wu, wd):
    return mlp(*(t.double() for t in (x, wg, wu, wd)))


def rows_of(T: int, device: torch.device) -> torch.Tensor:
    """16 rows spread over T (first and last included): the float64 reference is computed for these only."""
    return torch.linspace(0, T - 1, min(T, 16), device=device).long()


def cand_name(c: object) -> str:
    if isinstance(c, tuple):  # a TMA config (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, SUBTILE, WS)
        return f"tma{c[0]}x{c[1]}s{c[5]}{'sub' if c[6] else ''}{'ws' if c[7] else ''}"
    return str(c)


def timings(kind: str, T: int, F: int, save: bool) -> tuple[str, list[tuple[str, float]]]:
    """The selector's pick and timed candidates for the automatic choice (`_gemm=None`) at this shape."""
    for key, times in ffn.TIMINGS.items():
        if key[:3] == (kind, next_pow2(T), F) and key[-2] is None and key[-1] is save:
            return cand_name(ffn._CHOICE[key]), [(cand_name(c), ms) for c, ms in times]
    return "?", []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--F", type=int, nargs="+", default=[11008, 14336])
    ap.add_argument("--T", type=int, nargs="+", default=[128, 256, 512, 1024, 4096])
    ap.add_argument("--rep-ms", type=int, default=20)
    ap.add_argument("--no-train", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    print(f"{dev}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    res: dict = {"device": dev, "torch": torch.__version__, "triton": triton.__version__, "cases": []}

    def bench(fn, grad_to_none=None) -> float:
        """Device time (ms) of fn, median of do_bench (L2 flushed between runs)."""
        fn()
        return triton.testing.do_bench(
            fn, warmup=5, rep=args.rep_ms, grad_to_none=grad_to_none, return_mode="median"
        )

    ok = True
    for F in args.F:
        for T in args.T:
            ok &= case(res, bench, t0, T, F)
    if not args.no_train:
        ok &= train(res, bench, t0)
    ok &= replay_check(res, t0)
    print(f"{'PASS' if ok else 'FAIL'} in {time.time() - t0:.0f} s", flush=True)
    save_json("ffn_gate_up_blas.json", res)
    return 0 if ok else 1


def case(res: dict, bench, t0: float, T: int, F: int) -> bool:
    """Inference at (T, F): correctness on 16 rows, the selector's gate/up pick and timings, end to end."""
    x, wg, wu, wd = inputs(T, D, F, seed=T + F)
    rows = rows_of(T, x.device)
    ref = mlp64(x[rows], wg, wu, wd)
    out = torch.full_like(x, float("nan"))
    ffn.swiglu_ffn(
        out, x, wg, wu, wd, None, EPS
    )  # the automatic choice: checks and times every candidate once
    err_auto = rel(out[rows], ref)
    out_b = torch.full_like(x, float("nan"))
    ffn.swiglu_ffn(out_b, x, wg, wu, wd, None, EPS, _gemm="blas")
    err_blas = rel(out_b[rows], ref)
    good = err_auto < TOL_BF16 and err_blas < TOL_BF16
    pick, cands = timings("gate_up", T, F, False)
    down_pick, _ = timings("down", T, F, False)
    cm = torch.compile(mlp, dynamic=False)
    us = {
        "ops": bench(lambda: fusekit.ops.swiglu_ffn(x, wg, wu, wd, backend="triton")) * 1e3,
        "blas": bench(lambda: ffn.swiglu_ffn(out_b, x, wg, wu, wd, None, EPS, _gemm="blas")) * 1e3,
        "compile": bench(lambda: cm(x, wg, wu, wd)) * 1e3,
        "eager": bench(lambda: mlp(x, wg, wu, wd)) * 1e3,
    }
    speedup = us["compile"] / us["ops"]
    cand = " ".join(f"{c}={ms * 1e3:.0f}" for c, ms in cands)
    print(
        f"F={F:5d} T={T:4d} | err auto {err_auto:.1e} blas {err_blas:.1e} {'ok' if good else 'FAIL'} | "
        f"gate_up {pick} [{cand}] down {down_pick} | ops {us['ops']:.1f} blas {us['blas']:.1f} "
        f"compile {us['compile']:.1f} eager {us['eager']:.1f} us, compile/ops {speedup:.3f} "
        f"({time.time() - t0:.0f} s)",
        flush=True,
    )
    res["cases"].append({"F": F, "T": T, "err_auto": err_auto, "err_blas": err_blas, "gate_up": pick,
                         "gate_up_us": {c: ms * 1e3 for c, ms in cands}, "down": down_pick, "us": us})  # fmt: skip
    return good


def train(res: dict, bench, t0: float, T: int = 4096, F: int = 14336) -> bool:
    """Forward saving gu + backward (kernels_triton entry points) against torch.compile forward + backward."""
    x, wg, wu, wd = inputs(T, D, F, seed=7)
    dy = torch.randn_like(x)
    y = torch.full_like(x, float("nan"))
    gu = torch.full((T, 2 * F), float("nan"), device=x.device, dtype=x.dtype)
    dx, dwg, dwu, dwd = (torch.empty_like(t) for t in (x, wg, wu, wd))

    def fwd() -> None:
        ffn.forward(y, None, gu, x, wg, wu, wd, None, EPS)

    def step() -> None:
        fwd()
        ffn.backward(dx, dwg, dwu, dwd, None, dy, x, wg, wu, wd, None, None, gu, EPS)

    step()
    rows = rows_of(T, x.device)
    xr = x[rows].double().requires_grad_()
    leaves = [xr, *(t.double() for t in (wg, wu, wd))]
    y64 = mlp(*leaves)
    (dx64,) = torch.autograd.grad(y64, (xr,), dy[rows].double())  # no norm: row r of dx needs row r only
    gu64 = torch.cat((xr.detach() @ leaves[1].T, xr.detach() @ leaves[2].T), dim=1)
    errs = {"y": rel(y[rows], y64.detach()), "gu": rel(gu[rows], gu64), "dx": rel(dx[rows], dx64)}
    good = errs["y"] < TOL_BF16 and errs["gu"] < TOL_BF16 and errs["dx"] < 2 * TOL_BF16
    pick, cands = timings("gate_up", T, F, True)
    ms = {"fwd_bwd": bench(step), "fwd": bench(fwd)}
    params = [t.detach().clone().requires_grad_() for t in (x, wg, wu, wd)]
    cm = torch.compile(mlp, dynamic=False)

    def cstep() -> None:
        cm(*params).backward(dy)

    ms["compile_fwd_bwd"] = bench(cstep, grad_to_none=params)
    with torch.no_grad():
        ms["compile_fwd"] = bench(lambda: cm(*params))
    cand = " ".join(f"{c}={t * 1e3:.0f}" for c, t in cands)
    print(
        f"train F={F} T={T} | err y {errs['y']:.1e} gu {errs['gu']:.1e} dx {errs['dx']:.1e} "
        f"{'ok' if good else 'FAIL'} | gate_up {pick} [{cand}] | fwd+bwd {ms['fwd_bwd']:.3f} ms "
        f"(fwd {ms['fwd']:.3f}) compile {ms['compile_fwd_bwd']:.3f} (fwd {ms['compile_fwd']:.3f}), "
        f"compile/ours {ms['compile_fwd_bwd'] / ms['fwd_bwd']:.3f} (target >= 1) ({time.time() - t0:.0f} s)",
        flush=True,
    )
    res["train"] = {"F": F, "T": T, "errors": errs, "gate_up": pick, "gate_up_us": {c: t * 1e3 for c, t in cands},
                    "ms": ms}  # fmt: skip
    return good


def replay_check(res: dict, t0: float, T: int = 256, F: int = 11008) -> bool:
    """The forced vendor path (gate mm, up mm, element-wise launch, down mm) recorded by _replay and replayed
    into fresh outputs: bit-identical to the normal call, inference and training (g, u in gu's halves)."""
    x, wg, wu, wd = inputs(T, D, F, seed=3)
    ins = (x, wg, wu, wd)
    results = []

    def outs_new(save: bool) -> tuple:
        gu = torch.full((T, 2 * F), float("nan"), device=x.device, dtype=x.dtype) if save else None
        return (torch.full_like(x, float("nan")), None, gu)

    def call(outs: tuple) -> None:
        ffn.forward(outs[0], None, outs[2], *ins, None, EPS, _gemm="blas")

    for save in (False, True):
        outs = outs_new(save)
        call(outs)  # decides the key (checked against ptr)
        call(outs)  # warms the lean launch cache
        want = [t.clone() for t in outs if t is not None]
        rep = _replay.record(lambda outs=outs: call(outs), outs, ins)
        outs2 = outs_new(save)
        done = rep is not None and rep(outs2, ins) is True
        torch.cuda.synchronize()
        same = done and all(torch.equal(a, b) for a, b in zip([t for t in outs2 if t is not None], want))
        results.append(same)
        why = "" if rep is not None else f" (not recorded: {_replay.last_refusal})"
        print(f"replay {'training' if save else 'inference'} T={T} F={F}: {'ok' if same else 'FAIL'}{why} "
              f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    res["replay"] = results
    return all(results)


if __name__ == "__main__":
    raise SystemExit(main())
