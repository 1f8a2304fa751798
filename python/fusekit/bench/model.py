"""`python -m fusekit.bench.model`: one Llama decoder layer (bench/layer.py) timed per provider.

    python -m fusekit.bench.model [--config tiny|llama2-7b|llama3-8b[,..]] [--scenarios a,b]
                                  [--providers a,b] [--quick] [--device cuda|cpu] [--dtype bf16]
                                  [--out DIR] [--rep-ms MS] [--budget-s SECONDS]

Scenarios: decode of one new token at batch 1 and 32 against a KV cache already filled to 2K or 32K
tokens, and a prefill of 2048 tokens at batch 1 (the "tiny" config runs them scaled down: contexts
/16, batch 32 -> 4, prefill 2048 -> 64 tokens). Providers: the fusekit layer on each backend, the
triton layer captured in a CUDA graph, the torch eager layer (also the correctness reference),
torch.compile of it, and torch.compile(mode="reduce-overhead"). Every provider's output is checked
against the eager layer before it is timed; a wrong one is not timed.

Timing (bench/timing.py): on a GPU, `gpu_us` is the median CUDA-event time of one layer call with the
L2 flushed (do_bench), `wall_us` the host wall-clock per call of back-to-back calls (launch and Python
overhead included) and `e2e_us` one call plus a sync; on the CPU only host wall-clock exists. The byte
floor is what an ideal layer must move: weights, the KV cache read up to kv_len, the new k/v written,
and the layer's inputs and outputs; `pct_of_ceiling` is the roofline floor max(bytes / copy bandwidth,
FLOPs / matmul peak), both measured in the same run (on the CPU: a torch copy and matmul there),
over the time. Ratios: `speedup_vs[baseline]` = baseline time / this time (GPU time, or wall on the
CPU); `wall_speedup_vs` the same for wall time.

Writes <out>/<device slug>/model.json (the bench results format: bench/results.py; rows keyed by
case and provider, so `python -m fusekit.bench.merge` merges runs) after each scenario, GPU runs under
benchmarks/results, CPU runs under build/bench/results. On CUDA the default run leaves fusekit-mojo out
(MOJO_OWN_PROCESS says why): time it with `--providers fusekit-mojo` in its own process and merge.
Every layer call of one scenario replays the same position (start_pos = context), rewriting the new
token's k/v slot, so calls are identical and the cache stays filled to the context.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fusekit.bench import ceilings, results
from fusekit.bench.layer import CONFIGS, DecoderLayer, KVCache, LayerConfig, attends_kv_len, make_weights
from fusekit.bench.run import rel_error, speedups
from fusekit.bench.timing import bench_ms, e2e_ms, kernel_ms, wall_per_call_ms

OP = "model"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# rel error of each output (layer output and residual stream) against the eager layer in the same dtype:
# loose (two different roundings of a whole layer), far below what a wrong kernel gives (O(1)).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class Scenario:
    """One new chunk of `tokens` tokens per sequence after `context` cached ones, for `batch` sequences."""

    name: str
    kind: str  # "decode" or "prefill"
    batch: int
    context: int
    tokens: int

    @property
    def kv_len(self) -> int:
        return self.context + self.tokens

    def label(self, cfg: LayerConfig) -> str:
        what = f"ctx {self.context}" if self.kind == "decode" else f"S {self.tokens}"
        return f"{cfg.name} {self.kind} B{self.batch} {what}"


SCENARIOS: dict[str, Scenario] = {
    "decode-b1-2k": Scenario("decode-b1-2k", "decode", 1, 2048, 1),
    "decode-b1-32k": Scenario("decode-b1-32k", "decode", 1, 32768, 1),
    "decode-b32-2k": Scenario("decode-b32-2k", "decode", 32, 2048, 1),
    "decode-b32-32k": Scenario("decode-b32-32k", "decode", 32, 32768, 1),
    "prefill-2k": Scenario("prefill-2k", "prefill", 1, 0, 2048),
}
QUICK = ("decode-b1-2k", "decode-b32-2k", "prefill-2k")


def scenario_for(name: str, cfg: LayerConfig) -> Scenario:
    """The scenario at the config's scale: "tiny" divides contexts by 16, batch 32 -> 4, prefill -> 64."""
    sc = SCENARIOS[name]
    if cfg.name != "tiny":
        return sc
    return Scenario(sc.name, sc.kind, min(sc.batch, 4), sc.context // 16, min(sc.tokens, 64))


def floors(cfg: LayerConfig, sc: Scenario, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes, FLOPs) an ideal layer call must move / do.

    bytes: weights once, k and v of kv_len positions per sequence read and of the new tokens written,
    x and residual read, output and residual stream written. FLOPs: 2 per GEMM weight per token, and
    attention's 4·B·H·D per visible (query, key) pair (bottom-right causal: query i of S sees
    context + i + 1 keys).
    """
    es = torch.empty((), dtype=dtype).element_size()
    t = sc.batch * sc.tokens
    kv_row = cfg.kv_heads * cfg.head_dim * 2 * es  # k and v of one position
    nbytes = es * cfg.weight_numel() + sc.batch * (sc.kv_len + sc.tokens) * kv_row + 4 * t * cfg.hidden * es
    pairs = sc.tokens * sc.context + sc.tokens * (sc.tokens + 1) // 2
    flops = 2 * t * cfg.gemm_params() + 4 * sc.batch * cfg.heads * cfg.head_dim * pairs
    return int(nbytes), int(flops)


@dataclass
class Setup:
    """What every provider of one (config, scenario) shares: weights, cache, inputs."""

    cfg: LayerConfig
    sc: Scenario
    weights: dict[str, torch.Tensor]
    cache: KVCache
    x: torch.Tensor
    residual: torch.Tensor
    device: torch.device
    dtype: torch.dtype

    def layer(self, backend: str) -> DecoderLayer:
        return DecoderLayer(self.cfg, self.weights, self.cache, backend)


Call = Callable[[], tuple[torch.Tensor, torch.Tensor]]


MOJO_OWN_PROCESS = (
    "not in the default CUDA run: once MAX has run, its allocator keeps most of the GPU's memory and the "
    "next scenarios' KV caches no longer fit; time it in its own process (--providers fusekit-mojo) and "
    "merge the files with python -m fusekit.bench.merge"
)


# --- providers ------------------------------------------------------------------------------------------
class Provider:
    kind = "baseline"

    def __init__(self, name: str, description: str) -> None:
        self.name, self.description = name, description

    def available(self, device: torch.device) -> str | None:
        """None if this provider can run on `device` at all, else why not."""
        return None

    def supports(self, st: Setup) -> str | None:
        return None

    def build(self, st: Setup) -> Call:
        raise NotImplementedError


def _op_support(backend: str, st: Setup) -> str | None:
    """Why the fusekit backend cannot run one of the layer's ops at this device and dtype, or None."""
    from fusekit import backends

    be = backends.get(backend)
    d, dt = st.device, st.dtype
    attn_kv_len = attends_kv_len(backend, d, dt, st.cfg.head_dim)
    queries = (
        ("rms_norm", (dt, dt), {}),
        ("rope", (dt,), {}),
        ("attention", (dt,), {"head_dim": st.cfg.head_dim, "kv_len": attn_kv_len}),
        ("swiglu_ffn", (dt, dt), {}),
    )
    for op, dtypes, meta in queries:
        why = be.supports(op, "forward", d, dtypes, **meta)
        if why is not None:
            return f"{op}: {why}"
    return None


def torch_attention_bytes(st: Setup) -> int:
    """Rough peak of the torch backend's attention over the cache: the library's contiguous copy of the
    k/v views, the reference's masked copy, its fp32 copy and the fp32 copy repeated for GQA."""
    k = st.cache.k
    group = st.cfg.heads // st.cfg.kv_heads
    return 2 * k.numel() * (2 * k.element_size() + 4 + 4 * group)


class FusekitLayer(Provider):
    kind = "backend"

    def __init__(self, backend: str) -> None:
        super().__init__(f"fusekit-{backend}", f"the layer on fusekit.ops(..., backend={backend!r})")
        self.backend = backend

    def available(self, device: torch.device) -> str | None:
        from fusekit import backends

        return backends.get(self.backend).unavailable_reason()  # loads this backend only

    def supports(self, st: Setup) -> str | None:
        if self.backend == "torch" and st.device.type == "cuda":
            need = torch_attention_bytes(st)
            free = torch.cuda.mem_get_info(st.device)[0]
            if need > 0.8 * free:
                return (
                    f"the torch backend's reference attention would materialize ~{need / 2**30:.0f} GiB "
                    f"(contiguous, masked, fp32 and GQA-repeated copies of the cache); {free / 2**30:.0f} GiB free"
                )
        return _op_support(self.backend, st)

    def build(self, st: Setup) -> Call:
        layer, x, r, pos = st.layer(self.backend), st.x, st.residual, st.sc.context
        return lambda: layer(x, r, pos)


class FusekitGraph(FusekitLayer):
    """The fusekit layer captured in one CUDA graph (warmed up on a side stream first, as fusekit
    refuses a signature's first call inside a capture); the timed call is the replay."""

    def __init__(self, backend: str) -> None:
        super().__init__(backend)
        self.name = f"fusekit-{backend}-graph"
        self.description = f"the fusekit {backend} layer captured in a torch.cuda.CUDAGraph, replayed"

    def available(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if self.backend == "mojo":
            return (
                "the mojo backend refuses every call inside a CUDA graph capture (MAX runs on its own "
                "stream with host work per call): backends/mojo run()"
            )
        return super().available(device)

    def build(self, st: Setup) -> Call:
        layer, x, r, pos = st.layer(self.backend), st.x, st.residual, st.sc.context
        side = torch.cuda.Stream(st.device)
        side.wait_stream(torch.cuda.current_stream(st.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles and tunes every op's signature outside the capture
                layer(x, r, pos)
        torch.cuda.current_stream(st.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, r, pos)

        def replay() -> tuple[torch.Tensor, torch.Tensor]:
            graph.replay()  # inputs are static: x, residual and the cache are the captured tensors
            return out

        return replay


class Eager(Provider):
    def __init__(self) -> None:
        super().__init__("torch-eager", "the layer in plain torch (SDPA, F.silu, HF RMSNorm and rope)")

    def build(self, st: Setup) -> Call:
        layer, x, r, pos = st.layer("eager"), st.x, st.residual, st.sc.context
        return lambda: layer(x, r, pos)


class Compiled(Eager):
    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.mode = mode
        self.name = "torch-compile" if mode is None else "torch-compile-ro"
        self.description = f"torch.compile of the eager layer (dynamic=False, mode={mode!r})"

    def available(self, device: torch.device) -> str | None:
        if self.mode == "reduce-overhead" and device.type != "cuda":
            return "mode='reduce-overhead' is CUDA graphs: CUDA only"
        return None

    def build(self, st: Setup) -> Call:
        # A fresh static-shape compile per scenario (as the op benchmark's torch-compile baseline): the
        # scenario loop resets dynamo before a scenario and, without A/B rounds, after every provider.
        layer = torch.compile(st.layer("eager"), dynamic=False, mode=self.mode)
        x, r, pos = st.x, st.residual, st.sc.context
        if self.mode != "reduce-overhead":
            return lambda: layer(x, r, pos)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            torch.compiler.cudagraph_mark_step_begin()  # each call is a new decode step
            return layer(x, r, pos)

        return step


def all_providers() -> list[Provider]:
    return [
        FusekitLayer("triton"),
        FusekitLayer("mojo"),
        FusekitLayer("torch"),
        FusekitGraph("triton"),
        FusekitGraph("mojo"),
        Eager(),
        Compiled(None),
        Compiled("reduce-overhead"),
    ]


# --- measuring ------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_count(fn: Callable[[], object], device: torch.device) -> int | None:
    """CUDA activities (kernels, memsets, copies) of one call, from the torch profiler; None off CUDA."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        n = sum(1 for ev in prof.events() if "CUDA" in str(getattr(ev, "device_type", "")))
        return n or None
    except Exception:
        return None


def _cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:
        return 0


def make_setup(
    cfg: LayerConfig,
    sc: Scenario,
    weights: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> Setup:
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache.allocate(cfg, sc.batch, sc.kv_len, device, dtype, gen, filled=sc.context)
    cache.kv_len.fill_(sc.kv_len)  # what the layer attends over after writing the new tokens
    shape = (sc.batch, sc.tokens, cfg.hidden)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    residual = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return Setup(cfg, sc, weights, cache, x, residual, device, dtype)


def repro(cfg: LayerConfig, sc: Scenario, prov: Provider, device: torch.device, dtype: str) -> str:
    return (
        f"PYTHONPATH=python:. python -m fusekit.bench.model --device {device.type} --dtype {dtype} "
        f"--config {cfg.name} --scenarios {sc.name} --providers {prov.name}"
    )


def _row(st: Setup, prov: Provider, dtype_name: str, nbytes: int, flops: int) -> dict:
    cfg, sc = st.cfg, st.sc
    return {
        "op": OP,
        "suite": results.SUITE_DEFAULT,
        "case": sc.label(cfg),
        "config": cfg.name,
        "scenario": sc.name,
        "params": {
            "B": sc.batch,
            "context": sc.context,
            "S": sc.tokens,
            "kv_len": sc.kv_len,
            "hidden": cfg.hidden,
            "ffn": cfg.ffn,
            "heads": cfg.heads,
            "kv_heads": cfg.kv_heads,
            "theta": cfg.theta,
        },
        "dtype": dtype_name,
        "group": f"{cfg.name} {sc.kind} B{sc.batch}",
        "x": sc.context if sc.kind == "decode" else sc.tokens,
        "x_label": "context" if sc.kind == "decode" else "tokens",
        "provider": prov.name,
        "kind": prov.kind,
        "bytes": nbytes,
        "flops": flops,
        "status": "skipped",
        "ok": False,
        "reason": None,
        "wall_us": None,  # set when timed (gpu_us too, on a GPU)
        "gpu_us": None,
        "repro": repro(cfg, sc, prov, st.device, dtype_name),
    }


def _derive(row: dict, ceil: dict) -> None:
    """GB/s, TFLOP/s and % of the roofline floor, from time_us (GPU time, or wall on the CPU)."""
    t = row["time_us"] * 1e-6
    bw, peak = ceil["copy"]["gbps"] * 1e9, ceil["matmul"]["tflops"] * 1e12
    floor = max(row["bytes"] / bw, row["flops"] / peak)
    row["gbps"] = row["bytes"] / t / 1e9
    row["tflops"] = row["flops"] / t / 1e12
    row["floor_us"] = floor * 1e6
    row["byte_floor_us"] = row["bytes"] / bw * 1e6
    row["pct_of_byte_floor"] = 100.0 * row["bytes"] / bw / t
    row["pct_of_ceiling"] = 100.0 * floor / t
    row["wall_pct_of_ceiling"] = 100.0 * floor / (row["wall_us"] * 1e-6)
    row["bound"] = "compute" if row["flops"] / peak > row["bytes"] / bw else "memory"


def wall_speedups(rows: list[dict]) -> None:
    base = {r["provider"]: r["wall_us"] for r in rows if r["status"] == "ok" and r["kind"] == "baseline"}
    for r in rows:
        if r["status"] == "ok":
            r["wall_speedup_vs"] = {b: t / r["wall_us"] for b, t in base.items() if b != r["provider"]}


CHECKED = ("out", "h", "k_new", "v_new")  # the layer's outputs, then the cache slots it writes


def new_slots(st: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the new tokens' k and v slots of the shared cache (positions context .. kv_len - 1)."""
    sl = slice(st.sc.context, st.sc.kv_len)
    return st.cache.k[:, sl], st.cache.v[:, sl]


def run_provider(
    prov: Provider, st: Setup, ref: tuple[torch.Tensor, ...], row: dict, ceil: dict, rep_ms: float
) -> Call | None:
    """Build, check against the eager reference, then time (only a correct provider); fills `row`.
    `ref` = (out, h, k_new, v_new): the eager layer's outputs and the cache slots it wrote. Every provider
    rewrites the same slots of the shared cache, so they are NaN-filled before the checked call: a provider
    that skipped its cache write would otherwise read (and leave) the reference's values and pass.
    Returns the timed call (None where it failed the check)."""
    dev = st.device
    skips0 = _cudagraph_skips()
    t0 = time.perf_counter()
    call = prov.build(st)
    out = call()
    _sync(dev)
    row["first_call_s"] = time.perf_counter() - t0  # compilation, tuning, graph capture included
    if dev.type == "cuda":  # check a steady-state call: reduce-overhead records its graph on a later one
        for _ in range(3):
            out = call()
    if dev.type == "cuda":
        # reduce-overhead falls back to plain compiled code (silently, but for a log line) where it
        # cannot use a CUDA graph: recorded so such a row is not read as a CUDA-graph timing.
        row["cudagraph_skips"] = _cudagraph_skips() - skips0
    for t in new_slots(st):
        t.fill_(math.nan)
    out = call()
    _sync(dev)
    n_out = len(out)
    got = (*out[:2], *new_slots(st)) if n_out == 2 else tuple(out)
    errs = [rel_error(o.detach(), r) for o, r in zip(got, ref)]
    tol = TOLERANCE[st.dtype]
    row.update(rel_error=max(errs, default=math.inf), rel_errors=errs, tolerance=tol, outputs=list(CHECKED))
    del out, got
    bad = [f"{n} rel error {e:.3g} > {tol:g}" for n, e in zip(CHECKED, errs) if not e <= tol]
    if n_out != 2:  # zip would stop at the shorter: a provider returning only `out` passed
        bad.append(f"{n_out} outputs, the reference has 2 (out, h)")
    if bad:
        row["status"], row["reason"] = "failed", "; ".join(bad) + " (not timed)"
        return None
    if dev.type == "cuda":
        ms, method = bench_ms(call, dev, rep_ms=rep_ms)
        row["gpu_us"], row["method"], row["timer"] = ms * 1e3, method, "cuda-events"
        row["e2e_us"] = e2e_ms(call, dev, rep_ms=rep_ms / 2) * 1e3
    wall, n = wall_per_call_ms(call, dev, rep_ms=rep_ms / 2)
    row["wall_us"], row["wall_calls"] = wall * 1e3, n
    if dev.type != "cuda":  # synchronous: one call is what a caller waits for
        row["gpu_us"], row["method"], row["timer"] = None, "host wall-clock median", "host"
        row["e2e_us"] = row["wall_us"]
    row["time_us"] = row["gpu_us"] if row["gpu_us"] is not None else row["wall_us"]
    k = kernel_ms(call, dev)
    row["kernel_us"] = k * 1e3 if k is not None else None
    row["kernels"] = kernel_count(call, dev)
    row["status"], row["ok"] = "ok", True
    _derive(row, ceil)
    return call


def ab_rounds(timed: dict[str, tuple[dict, Call]], device: torch.device, rounds: int, rep_ms: float) -> None:
    """Same-process A/B: every timed provider of a scenario again in `rounds` alternating rounds (the
    order rotated each round), so a clock or thermal drift between providers timed one after another
    (the H200 moved the same kernels' layer time by up to 7% between such runs) reaches all of them
    alike. Per row: `ab_us` (median of its rounds) and `ab_speedup_vs` (per baseline, the median of the
    per-round ratios baseline time / this time), which the report's targets read before `speedup_vs`."""
    names = list(timed)
    per: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            per[n].append(bench_ms(timed[n][1], device, warmup_ms=5, rep_ms=rep_ms)[0])
    base = [n for n in names if timed[n][0]["kind"] == "baseline"]
    for n, (row, _) in timed.items():
        row["ab_rounds"] = rounds
        row["ab_us"] = statistics.median(per[n]) * 1e3
        row["ab_speedup_vs"] = {
            b: statistics.median(tb / t for tb, t in zip(per[b], per[n])) for b in base if b != n
        }


def run_scenario(
    cfg: LayerConfig,
    sc: Scenario,
    weights: dict[str, torch.Tensor],
    providers: list[Provider],
    device: torch.device,
    dtype_name: str,
    ceil: dict,
    rep_ms: float,
    seed: int = 0,
    rounds: int = 0,
) -> list[dict]:
    """Every provider of one scenario, checked and timed; with `rounds`, then all of them again in
    alternating A/B rounds (ab_rounds), their compiled graphs and CUDA graphs kept alive until then."""
    dtype = DTYPES[dtype_name]
    st = make_setup(cfg, sc, weights, device, dtype, seed)
    nbytes, flops = floors(cfg, sc, dtype)
    rows: list[dict] = []
    ref: tuple[torch.Tensor, ...] | None = None
    ref_error: str | None = None
    try:
        ref = tuple(t.clone() for t in (*st.layer("eager")(st.x, st.residual, sc.context), *new_slots(st)))
    except Exception as exc:  # e.g. out of memory: nothing can be checked, so nothing is timed
        ref_error = f"the eager reference failed: {type(exc).__name__}: {str(exc)[:300]}"
    timed: dict[str, tuple[dict, Call]] = {}
    torch._dynamo.reset()
    for prov in providers:
        row = _row(st, prov, dtype_name, nbytes, flops)
        rows.append(row)
        row["reason"] = prov.available(device) or ref_error
        if row["reason"] is None:
            try:
                row["reason"] = prov.supports(st)
            except Exception as exc:
                row["reason"] = f"supports() raised {type(exc).__name__}: {exc}"
        if row["reason"] is not None:
            continue
        assert ref is not None
        try:
            call = run_provider(prov, st, ref, row, ceil, rep_ms)
            if rounds and call is not None:
                timed[prov.name] = (row, call)
        except torch.cuda.OutOfMemoryError as exc:
            row["status"], row["reason"] = "failed", f"out of memory: {str(exc)[:200]}"
        except Exception as exc:
            row["status"], row["reason"] = "failed", f"{type(exc).__name__}: {str(exc)[:500]}"
        finally:
            if not rounds:
                _release(device)
    if len(timed) > 1:
        ab_rounds(timed, device, rounds, rep_ms)
    timed.clear()  # drop the calls (compiled graphs, CUDA graphs) before _release can free their memory
    if rounds:
        _release(device)
    speedups(rows)
    wall_speedups(rows)
    return rows


def _release(device: torch.device) -> None:
    torch._dynamo.reset()  # drops compiled graphs and reduce-overhead's CUDA graph pools
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- CLI ------------------------------------------------------------------------------------------------
def _list(s: str | None) -> list[str] | None:
    return None if s is None else [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fusekit.bench.model", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--config",
        default=None,
        help=f"comma-separated of {', '.join(CONFIGS)} (default: tiny on the CPU, llama2-7b,llama3-8b on CUDA)",
    )
    ap.add_argument("--scenarios", default=None, help=f"comma-separated of {', '.join(SCENARIOS)}")
    names = [p.name for p in all_providers()]
    ap.add_argument("--providers", default=None, help=f"comma-separated of {', '.join(names)}")
    ap.add_argument("--quick", action="store_true", help=f"scenarios {', '.join(QUICK)}, shorter timing")
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument(
        "--out",
        default=None,
        help=f"results root (default: {results.COMMITTED_RESULTS} on a GPU, {results.LOCAL_RESULTS} on the CPU)",
    )
    ap.add_argument("--rep-ms", type=float, default=None, help="timed milliseconds per measurement")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new scenario after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ab-rounds",
        type=int,
        default=0,
        help="after each scenario, every timed provider again in N alternating rounds (same-process A/B; "
        "the targets read these ratios)",
    )
    return ap.parse_args(argv)


def _fmt(r: dict) -> str:
    head = f"  {r['case']:<34} {r['provider']:<22}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {str(r['reason'])[:150]}"
    gpu = f"{r['gpu_us']:10.1f}" if r.get("gpu_us") is not None else f"{'–':>10}"
    vs = (r.get("ab_speedup_vs") or r.get("speedup_vs", {})).get("torch-compile")
    wvs = r.get("wall_speedup_vs", {}).get("torch-compile")
    ratio = f"{vs:5.2f}x/{wvs:5.2f}x" if vs is not None and wvs is not None else f"{'–':>12}"
    kern = f"{r['kernels']:4d}" if r.get("kernels") else f"{'–':>4}"
    return (
        f"{head} {gpu} {r['wall_us']:10.1f} {r['pct_of_ceiling']:6.1f}% {ratio} {kern} {r['rel_error']:.1e}"
    )


TABLE_HEAD = (
    f"  {'case':<34} {'provider':<22} {'gpu us':>10} {'wall us':>10} {'floor%':>7} "
    f"{'vs compile g/w':>12} {'kern':>4} err"
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_type == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if dev_type == "cuda" else torch.device("cpu")
    if device.type == "cpu":  # triton runs on the CPU in its interpreter (before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    cfg_names = _list(args.config) or (["tiny"] if device.type == "cpu" else ["llama2-7b", "llama3-8b"])
    sc_names = _list(args.scenarios) or list(QUICK if args.quick else SCENARIOS)
    provs = all_providers()
    wanted = _list(args.providers)
    for what, got, valid in (
        ("configs", cfg_names, list(CONFIGS)),
        ("scenarios", sc_names, list(SCENARIOS)),
        ("providers", wanted or [], [p.name for p in provs]),
    ):
        bad = [n for n in got if n not in valid]
        if bad:
            print(f"unknown {what} {bad}; valid: {', '.join(valid)}", file=sys.stderr)
            return 2
    held_back: dict[str, str] = {}
    if wanted is not None:
        provs = [p for p in provs if p.name in wanted]
    elif device.type == "cuda":  # see MOJO_OWN_PROCESS
        held_back = {p.name: MOJO_OWN_PROCESS for p in provs if p.name == "fusekit-mojo"}
        provs = [p for p in provs if p.name not in held_back]
    out_root = Path(args.out) if args.out else results.default_out(device)
    if device.type == "cpu" and results.is_committed_path(out_root):
        print(f"refusing to write CPU timings under {results.COMMITTED_RESULTS}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    meta = results.environment(device)
    meta["command"] = " ".join(
        ["python -m fusekit.bench.model", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]
    )
    meta["timer"] = (
        "gpu_us: CUDA events, L2 flushed (do_bench); wall_us: host perf_counter over back-to-back calls"
        if device.type == "cuda"
        else "host wall-clock on the CPU (no device timer, no cache flush; calls are synchronous)"
    )
    meta["providers"] = {p.name: {"kind": p.kind, "description": p.description} for p in provs}
    unavailable = {p.name: (p.kind, why) for p in provs if (why := p.available(device)) is not None}
    unavailable.update({name: ("backend", why) for name, why in held_back.items()})
    for key, kind in (("skipped_backends", "backend"), ("skipped_baselines", "baseline")):
        meta[key] = {n: why for n, (k, why) in unavailable.items() if k == kind}
    where = results.device_name(device)
    print(f"fusekit.bench.model on {where} ({dtype_name}): {meta['timer']}", flush=True)
    print(f"  configs {', '.join(cfg_names)}; scenarios {', '.join(sc_names)}", flush=True)
    for name, (_, why) in unavailable.items():
        print(f"  provider {name} skipped: {why[:200]}", flush=True)
    ceil = ceilings.measure(device)
    print(
        f"ceilings: copy {ceil['copy']['gbps']:.0f} GB/s, {ceil['matmul']['name']} "
        f"{ceil['matmul']['tflops']:.3g} TFLOP/s",
        flush=True,
    )
    rep_ms = args.rep_ms or (30.0 if args.quick else 100.0)
    extra = {
        "quick": args.quick,
        "configs": {c: vars(CONFIGS[c]) | {"head_dim": CONFIGS[c].head_dim} for c in cfg_names},
        "scenarios": {c: {n: vars(scenario_for(n, CONFIGS[c])) for n in sc_names} for c in cfg_names},
        "tolerance": {str(k).removeprefix("torch."): v for k, v in TOLERANCE.items()},
        "ab_rounds": args.ab_rounds,
    }
    rows: list[dict] = []
    truncated, path = False, None
    with torch.no_grad():
        for cname in cfg_names:
            cfg = CONFIGS[cname]
            gen = torch.Generator(device=device).manual_seed(args.seed)
            weights = make_weights(cfg, device, DTYPES[dtype_name], gen)
            for sname in sc_names:
                if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                    truncated = True
                    break
                sc = scenario_for(sname, cfg)
                new = run_scenario(
                    cfg, sc, weights, provs, device, dtype_name, ceil, rep_ms, args.seed, args.ab_rounds
                )
                rows += new
                path = results.write(out_root, device, OP, meta, ceil, rows, truncated=truncated, **extra)
                print(TABLE_HEAD, flush=True)
                for r in new:
                    print(_fmt(r), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del weights
    if truncated and path is not None:
        path = results.write(out_root, device, OP, meta, ceil, rows, truncated=True, **extra)
    print(f"done in {time.perf_counter() - t_start:.0f} s; wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
