"""`python -m fusekit.bench.host`: the host path of small (decode-shaped) calls, against a bare launch.

For each case, per-call host wall-clock of N back-to-back calls (sync, N calls, sync; median of
loops: `timing.wall_per_call_ms`), taken in `--rounds` rounds interleaved over the providers below
(the median round is kept, every round is in the row: a shared host drifts by tens of percent), for:
  - `fusekit`: the public op (`fusekit.ops.<op>(..., backend=B)`), remembered path after warm-up;
  - `bare`: the very Triton kernel(s) that call launched, re-launched directly through
    `JITFunction.run` with the arguments recorded from one fusekit call (the output buffers reused,
    nothing allocated, no fusekit Python): the floor of what a Python-launched Triton kernel costs;
  - `bare_autograd` (training cases, forward + backward per call): the same recorded launches inside a
    trivial torch.autograd.Function (forward launches in its forward, backward launches in its backward,
    the same leaves, `.backward(dy)`): the floor of a Python-launched Triton op that trains, with the
    autograd engine's own cost in it (`_bare_autograd`); such rows' target ratio is wall / this floor;
  - `torch`: the torch eager equivalent (F.rms_norm / F.layer_norm / SDPA / HF-style rope), where
    one exists;
  - `liger`: Liger-Kernel's op where installed and the op exists there.
Backend "triton-jit" is the triton backend with its launch shortcuts off (the lean launch path of
kernels_triton/_launch.py and the launch replay of kernels_triton/_replay.py: every launch through
Triton's JITFunction.run, as before they existed); "triton" is the default (both on). Also the GPU time of the fusekit call (CUDA events), so host-bound cases are visible as wall >> GPU.
The target of issue #11: fusekit wall <= 1.3x bare.

Results: <out>/<device slug>/host.json (schema fusekit-bench-host/1) with meta like the other suites.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fusekit.bench.results import environment, slug
from fusekit.bench.run import rel_error
from fusekit.bench.timing import bench_ms, wall_per_call_ms
from fusekit.tolerances import rtol

SCHEMA = "fusekit-bench-host/1"

# a training case's (x, w, dy) leaves, for its bare-in-autograd floor (filled by _cases)
train_leaves: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@contextlib.contextmanager
def _record_launches() -> Iterator[list[tuple]]:
    """Records every JITFunction.run (fn, args, kwargs) made inside the block."""
    from triton.runtime.jit import JITFunction

    seen: list[tuple] = []
    orig = JITFunction.run

    def run(self, *args, **kwargs):
        # grad mode tells a training call's backward launches (the engine runs them with it off) apart
        seen.append((self, args, dict(kwargs), torch.is_grad_enabled()))
        return orig(self, *args, **kwargs)

    JITFunction.run = run
    try:
        yield seen
    finally:
        JITFunction.run = orig


@contextlib.contextmanager
def _fast_launch(on: bool) -> Iterator[None]:
    """The triton backend's launch shortcuts (the lean launch path of kernels_triton/_launch.py and the
    launch replay of kernels_triton/_replay.py) on or off inside the block ("triton-jit" rows and the
    bare recording: off). Plans are forgotten on both sides, so no replay recorded in one mode runs in
    the other."""
    from fusekit import library
    from fusekit.backends import triton as triton_backend
    from kernels_triton import _launch

    was = _launch.ENABLED, triton_backend.REPLAY
    _launch.ENABLED = triton_backend.REPLAY = on
    library.clear_plans()
    try:
        yield
    finally:
        _launch.ENABLED, triton_backend.REPLAY = was
        library.clear_plans()


def _bare(launches: list[tuple]) -> Callable[[], None]:
    def call() -> None:
        for fn, args, kwargs, _ in launches:
            fn.run(*args, **kwargs)

    return call


def _bare_autograd(launches: list[tuple], x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> Callable:
    """A training call's floor: the recorded forward launches in an autograd.Function's forward and the
    backward launches in its backward, applied to the same leaves and run with `.backward(dy)` — so the
    autograd engine's own cost (graph build, engine thread hop, AccumulateGrad into x.grad and w.grad) is
    in it as in the op's call, and only fusekit's Python is not. The gradients it hands the engine are
    preallocated buffers (nothing allocated); the bare launch without autograd is `_bare`."""
    fwd = _bare([r for r in launches if r[3]])
    bwd = _bare([r for r in launches if not r[3]])
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    dx.copy_(dy)  # finite values: AccumulateGrad adds them into the leaves' .grad
    dw.zero_()

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            fwd()
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            bwd()
            return dx, dw

    return lambda: Bare.apply(x, w).backward(dy)


def _cases(dev: str, dtype: torch.dtype) -> list[tuple[str, dict, Callable, Callable | None, str | None]]:
    """(name, params, fusekit(backend), torch eager call or None, liger op name or None)."""
    import torch.nn.functional as F

    from fusekit import ops
    from fusekit.ops.rope import tables

    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=dev, dtype=dtype, generator=g)

    out = []
    train_leaves.clear()
    for m in (1, 4, 32):
        x, w, r, b = rnd(m, 4096), rnd(4096), rnd(m, 4096), rnd(4096)
        out.append(
            (
                f"rms_norm {m}x4096",
                {"M": m, "N": 4096},
                lambda be, x=x, w=w: ops.rms_norm(x, w, backend=be),
                lambda x=x, w=w: F.rms_norm(x, (4096,), w, 1e-6),
                "rms_norm",
            )
        )
        out.append(
            (
                f"rms_norm+residual {m}x4096",
                {"M": m, "N": 4096, "residual": True},
                lambda be, x=x, w=w, r=r: ops.rms_norm(x, w, residual=r, backend=be),
                lambda x=x, w=w, r=r: F.rms_norm(x + r, (4096,), w, 1e-6),
                None,
            )
        )
        out.append(
            (
                f"layer_norm {m}x4096",
                {"M": m, "N": 4096},
                lambda be, x=x, w=w, b=b: ops.layer_norm(x, w, b, backend=be),
                lambda x=x, w=w, b=b: F.layer_norm(x, (4096,), w, b, 1e-5),
                "layer_norm",
            )
        )
    q1 = rnd(1, 1, 32, 128)
    # HF's [B, S, D] tables of position 2047 (the rotation fusekit computes in-kernel), in x's dtype as HF
    c, s_ = tables(torch.tensor([2047], device=dev), 128, 10000.0)
    cos, sin = (torch.cat((t, t), -1)[None].to(dtype) for t in (c, s_))

    def hf_rope(x=q1, cos=cos, sin=sin):
        x1, x2 = x[..., :64], x[..., 64:]
        return x * cos.unsqueeze(2) + torch.cat((-x2, x1), -1) * sin.unsqueeze(2)

    out.append(
        (
            "rope 1 token 32x128",
            {"B": 1, "S": 1, "H": 32, "D": 128},
            lambda be: ops.rope(q1, start_pos=2047, backend=be),
            hf_rope,
            None,
        )
    )
    xs = rnd(4096)
    out.append(
        ("reduce_sum 4096", {"N": 4096}, lambda be: ops.reduce_sum(xs, backend=be), lambda: xs.sum(), None)
    )
    # A training step's norm: forward + backward per call (the autograd path, weight grads accumulated)
    for m in (4, 4096):
        xg, wg, dy = rnd(m, 4096).requires_grad_(), rnd(4096).requires_grad_(), rnd(m, 4096)
        out.append(
            (f"rms_norm fwd+bwd {m}x4096", {"M": m, "N": 4096, "train": True},
             lambda be, xg=xg, wg=wg, dy=dy: ops.rms_norm(xg, wg, backend=be).backward(dy),
             lambda xg=xg, wg=wg, dy=dy: F.rms_norm(xg, (4096,), wg, 1e-6).backward(dy), "rms_norm")
        )  # fmt: skip
        train_leaves[f"rms_norm fwd+bwd {m}x4096"] = (xg, wg, dy)
    for b, skv in ((1, 2048), (32, 2048)):
        qd, kc, vc = rnd(b, 32, 1, 128), rnd(b, 8, skv, 128), rnd(b, 8, skv, 128)
        kv_len = torch.full((b,), skv - 5, device=dev, dtype=torch.int32)
        # torch: SDPA on the same GQA heads (enable_gqa, not K/V repeated 4x outside the call: 4x the KV
        # bytes, which made fusekit "3.6x SDPA" at B32) over the same kv_len keys (views of the cache)
        ke, ve = kc[:, :, : skv - 5], vc[:, :, : skv - 5]
        out.append(
            (
                f"attention decode b{b} kv{skv}",
                {"B": b, "H": 32, "Hkv": 8, "S": 1, "Skv": skv, "D": 128},
                lambda be, qd=qd, kc=kc, vc=vc, kv_len=kv_len: ops.attention(
                    qd, kc, vc, kv_len=kv_len, backend=be
                ),
                lambda qd=qd, ke=ke, ve=ve: F.scaled_dot_product_attention(qd, ke, ve, enable_gqa=True),
                None,
            )
        )
    return out


def _liger(name: str | None, dev: str, dtype: torch.dtype) -> Callable | None:
    if name is None:
        return None
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    return {"rms_norm": LigerRMSNormFunction, "layer_norm": LigerLayerNormFunction}[name]


_WARM = 5  # calls before each timing: plan, record a replay (calls 2..4), then steady state


def run(backends: list[str], dev: str, dtype: torch.dtype, rep_ms: float, rounds: int = 5) -> list[dict]:
    """Per case: every provider (each backend, the bare launch, torch eager, Liger) is timed in `rounds`
    interleaved rounds of rep_ms / rounds each; a row keeps the median and the per-round figures, so a
    drift of the shared host's speed hits every provider alike instead of whichever ran last."""
    device = torch.device(dev)
    rows = []
    for name, params, fk, eager, liger_name in _cases(dev, dtype):
        case_rows: dict[str, dict] = {}
        timers: dict[str, tuple[Callable, Callable[[], object]]] = {}  # label -> (mode context, call)
        for be in backends:
            row = case_rows[be] = {
                "case": name,
                "params": params,
                "backend": be,
                "dtype": str(dtype).split(".")[-1],
            }
            op_be = "triton" if be == "triton-jit" else be
            fn = lambda fk=fk, op_be=op_be: fk(op_be)
            mode = (lambda: _fast_launch(False)) if be == "triton-jit" else contextlib.nullcontext
            try:
                with mode():
                    for _ in range(_WARM):
                        fn()  # compile, tune, plan, record
                    if eager is not None and not params.get("train"):
                        _check_against(fn(), eager(), name, dtype)
                    if dev == "cuda":
                        torch.cuda.synchronize()
                        row["fusekit_gpu_us"] = bench_ms(fn, device, rep_ms=rep_ms)[0] * 1e3
                timers[f"fusekit:{be}"] = (mode, fn)
                if op_be == "triton" and "bare" not in timers:
                    with _fast_launch(False), _record_launches() as seen:
                        fn()
                    row["bare_kernels"] = [f.fn.__name__ if hasattr(f, "fn") else str(f) for f, *_ in seen]
                    if seen:
                        timers["bare"] = (contextlib.nullcontext, _bare(seen))
                        if name in train_leaves:
                            timers["bare_autograd"] = (
                                contextlib.nullcontext,
                                _bare_autograd(seen, *train_leaves[name]),
                            )
                row["status"] = "ok"
            except Exception as e:
                _failed(row, e)
        if eager is not None:
            timers["eager"] = (contextlib.nullcontext, eager)
        lg = _liger(liger_name, dev, dtype)
        if lg is not None:
            timers["liger"] = (contextlib.nullcontext, _liger_call(lg, liger_name, params, dev, dtype))
        walls: dict[str, list[float]] = {k: [] for k in timers}
        for _ in range(rounds):
            for label, (mode, fn) in timers.items():
                try:
                    with mode():
                        for _ in range(_WARM):
                            fn()  # a mode switch forgets plans: plan and record again first
                        walls[label].append(wall_per_call_ms(fn, device, rep_ms=rep_ms / rounds)[0] * 1e3)
                except Exception as e:  # a backend's row says so; a baseline that fails leaves its column out
                    if label.startswith("fusekit:"):
                        _failed(case_rows[label.removeprefix("fusekit:")], e)
        med = {k: statistics.median(v) for k, v in walls.items() if v}
        for be, row in case_rows.items():
            mine = f"fusekit:{be}"
            if row.get("status") == "ok" and mine in med:
                row["fusekit_wall_us"], row["fusekit_wall_us_rounds"] = med[mine], walls[mine]
                if "bare" in med and be in ("triton", "triton-jit"):
                    row["bare_wall_us"] = med["bare"]
                    row["wall_vs_bare"] = med[mine] / med["bare"]
                if "bare_autograd" in med and be in ("triton", "triton-jit"):
                    row["bare_autograd_wall_us"] = med["bare_autograd"]
                    row["wall_vs_bare_autograd"] = med[mine] / med["bare_autograd"]
                if "eager" in med:
                    row["torch_wall_us"] = med["eager"]
                    row["wall_speedup_vs_torch"] = med["eager"] / med[mine]
                if "liger" in med and be == backends[0]:
                    row["liger_wall_us"] = med["liger"]
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _check_against(got: object, want: object, name: str, dtype: torch.dtype) -> None:
    """A warm fusekit call against the torch call it is timed beside (the same math: same inputs, tables,
    kv_len), first outputs compared; raises (the row is an error, not timed) beyond the op's tolerance in
    the one table (`fusekit.tolerances`), doubled: both sides round, neither is the float64 reference."""
    g = got[0] if isinstance(got, tuple) else got
    w = want[0] if isinstance(want, tuple) else want
    err = rel_error(g, w)
    tol = 2 * rtol(re.split(r"[ +]", name, maxsplit=1)[0], dtype)
    if not err <= tol:
        raise AssertionError(f"{name}: fusekit's output is {err:.3g} from torch's (tolerance {tol:g})")


def _failed(row: dict, e: Exception) -> None:
    row["status"], row["reason"] = "error", f"{type(e).__name__}: {e}"[:300]


def _liger_call(fn, name: str, p: dict, dev: str, dtype: torch.dtype) -> Callable[[], object]:
    x = torch.randn(p["M"], p["N"], device=dev, dtype=dtype)
    w = torch.randn(p["N"], device=dev, dtype=dtype)
    if p.get("train"):
        x.requires_grad_()
        w.requires_grad_()
        dy = torch.randn_like(x)
        return lambda: fn.apply(x, w, 1e-6).backward(dy)
    if name == "rms_norm":
        return lambda: fn.apply(x, w, 1e-6)
    b = torch.randn(p["N"], device=dev, dtype=dtype)
    return lambda: fn.apply(x, w, b, 1e-5)


def _line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['case']:<28} {r['backend']:<7} {r['status']}: {r.get('reason')}"
    f = lambda k: f"{r[k]:7.1f}" if k in r else "      -"
    ratio = f"{r['wall_vs_bare']:.2f}x bare" if "wall_vs_bare" in r else ""
    if "wall_vs_bare_autograd" in r:
        ratio += f", {r['wall_vs_bare_autograd']:.2f}x bare in autograd ({r['bare_autograd_wall_us']:.1f} us)"
    return (
        f"{r['case']:<28} {r['backend']:<7} wall {f('fusekit_wall_us')} us  gpu {f('fusekit_gpu_us')}  "
        f"bare {f('bare_wall_us')}  torch {f('torch_wall_us')}  liger {f('liger_wall_us')}  {ratio}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusekit.bench.host", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--backends",
        default="triton,torch",
        help="comma-separated of triton, triton-jit (lean launch and launch replay off), torch, mojo",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--rep-ms", type=float, default=200.0, help="timing budget per provider and case")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per case (median kept)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    rows = run([b.strip() for b in a.backends.split(",") if b.strip()], a.device, dtype, a.rep_ms, a.rounds)
    root = Path(a.out or ("benchmarks/results" if a.device == "cuda" else "build/bench/results"))
    name = slug(torch.cuda.get_device_name()) if a.device == "cuda" else "cpu"
    path = root / name / "host.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = environment(torch.device(a.device))
    meta["schema"] = SCHEMA  # not the op-results schema: the op report skips this file
    meta["command"] = " ".join(
        ["python -m fusekit.bench.host", *(argv if argv is not None else sys.argv[1:])]
    )
    doc = {
        "schema": SCHEMA,
        "meta": meta,
        "method": (
            f"host wall-clock per call of back-to-back calls (timing.wall_per_call_ms), median of {a.rounds} "
            "rounds interleaved over the providers of a case; gpu = CUDA events"
        ),
        "rows": rows,
    }
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {path}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "host.json").write_text(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
