"""Benchmark cases: the op sweeps, their inputs, and the byte / FLOP floor of each case.

A `Case` knows how to build fresh random inputs (never zeros), how to call `fusekit.ops` and the
torch reference on them, and the minimal traffic the op needs: each input read once, each output
written once (`bytes_moved`), plus the arithmetic for the matrix ops (`flops`). Those two numbers
turn a time into GB/s, TFLOP/s and a "% of roofline" against the ceilings measured in the same run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fusekit import reference

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
OPS: tuple[str, ...] = ("reduce_sum", "rms_norm", "layer_norm", "rope", "swiglu_ffn", "attention")
MATMUL_OPS = frozenset({"swiglu_ffn", "attention"})


@dataclass(frozen=True)
class Case:
    """One benchmark point. `params` are the op's shape/flag arguments; `dtype` the input dtype."""

    op: str
    params: dict = field(hash=False)
    dtype: str
    group: str  # the sub-sweep this point belongs to (one line per provider in a plot)
    x: float  # the swept quantity, for plots
    x_label: str

    # --- naming ------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.params.items()) + f",dtype={self.dtype}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    # --- inputs --------------------------------------------------------------------------------
    def make_inputs(self, device: str | torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """Fresh random inputs as keyword arguments of the `fusekit.ops` call (tensors only)."""
        p, dt = self.params, self.torch_dtype

        def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
            return (t * scale + shift).to(dt)

        if self.op == "reduce_sum":
            # A positive mean keeps the sum away from zero, so the relative error measures rounding,
            # not cancellation.
            shape = (p["n"],) if p.get("m") is None else (p["m"], p["n"])
            return {"x": rnd(*shape, shift=0.5)}
        if self.op == "rms_norm":
            return {"x": rnd(p["M"], p["N"]), "weight": rnd(p["N"], scale=0.1, shift=1.0)}
        if self.op == "layer_norm":
            return {
                "x": rnd(p["M"], p["N"], shift=0.3),
                "weight": rnd(p["N"], scale=0.1, shift=1.0),
                "bias": rnd(p["N"], scale=0.1),
            }
        if self.op == "rope":
            return {"x": rnd(p["B"], p["S"], p["H"], p["D"])}
        if self.op == "swiglu_ffn":
            T, D, F = p["T"], p["D"], p["F"]
            # Weights scaled like a trained layer (std 1/sqrt(fan_in)) so activations stay O(1).
            return {
                "x": rnd(T, D),
                "w_gate": rnd(F, D, scale=D**-0.5),
                "w_up": rnd(F, D, scale=D**-0.5),
                "w_down": rnd(D, F, scale=F**-0.5),
            }
        if self.op == "attention":
            B, H, Hkv, S, D = p["B"], p["H"], p.get("Hkv", p["H"]), p["S"], p["D"]
            return {"q": rnd(B, H, S, D), "k": rnd(B, Hkv, S, D), "v": rnd(B, Hkv, S, D)}
        raise ValueError(f"unknown op {self.op!r}")

    # --- calls ---------------------------------------------------------------------------------
    def kwargs(self) -> dict:
        """Non-tensor keyword arguments of the `fusekit.ops` call."""
        p = self.params
        if self.op == "reduce_sum":
            out = {"dim": None if p.get("m") is None else -1}
            if p.get("out") is not None:
                out["dtype"] = DTYPES[p["out"]]
            return out
        if self.op == "attention":
            return {"causal": bool(p["causal"]), "scale": p["D"] ** -0.5}
        return {}

    def out_dtype(self) -> torch.dtype:
        if self.op == "reduce_sum" and self.params.get("out") is not None:
            return DTYPES[self.params["out"]]
        return self.torch_dtype

    def call_ops(self, ops_module, inputs: dict[str, torch.Tensor], backend: str) -> torch.Tensor:
        """The user-facing call `fusekit.ops.<op>(..., backend=backend)`."""
        return getattr(ops_module, self.op)(**inputs, **self.kwargs(), backend=backend)

    def reference_fn(self) -> Callable[..., torch.Tensor]:
        """A function of the input tensors that runs `fusekit.reference` (what eager/compile time)."""
        kw = self.kwargs()
        if self.op == "reduce_sum":
            out_dtype = self.out_dtype()
            if kw["dim"] is None:
                return lambda x: reference.reduce_sum(x.reshape(1, -1), out_dtype)
            return lambda x: reference.reduce_sum(x, out_dtype)
        if self.op == "rms_norm":
            return lambda x, weight: reference.rms_norm(x, weight, 1e-6)[0]
        if self.op == "layer_norm":
            return lambda x, weight, bias: reference.layer_norm(x, weight, bias, 1e-5)[0]
        if self.op == "rope":
            return lambda x: reference.rope(x, None, None, 0, 10000.0, False)
        if self.op == "swiglu_ffn":
            return lambda x, w_gate, w_up, w_down: reference.swiglu_ffn(x, w_gate, w_up, w_down, None, 1e-6)
        if self.op == "attention":
            causal, scale = kw["causal"], kw["scale"]
            return lambda q, k, v: reference.attention(q, k, v, causal, scale)
        raise ValueError(self.op)

    def native_fn(self) -> Callable[..., torch.Tensor]:
        """What a user writes in plain torch, in the input dtype: the eager / torch.compile baselines.

        The reference upcasts the matrix ops to fp32 (it defines the precision), which would make
        torch eager and torch.compile straw men for swiglu_ffn and attention; their baselines run the
        bf16 matmuls a user would (tensor cores, fp32 accumulation inside cuBLAS). The other ops read
        and write the same bytes either way, so they time the reference itself.
        """
        if self.op == "swiglu_ffn":
            return lambda x, w_gate, w_up, w_down: (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T
        if self.op == "attention":
            kw = self.kwargs()
            causal, scale = kw["causal"], kw["scale"]

            def naive_attention(q, k, v):
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                s = (q @ k.transpose(-1, -2)) * scale
                if causal:
                    sq, sk = q.shape[2], k.shape[2]
                    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
                    s = s.masked_fill(~keep, float("-inf"))
                return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

            return naive_attention
        if self.op == "rope":
            # HF-style: cos/sin tables are built once per model, so they are not part of the timed call
            # (computing them inside the compiled graph made inductor recompute sin/cos per element).
            tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

            def rope_with_tables(x):
                key = (x.shape[1], x.shape[3], x.device)
                if key not in tables:
                    pos = torch.arange(x.shape[1], device=x.device)
                    tables[key] = reference.rope_tables(pos, x.shape[3], 10000.0)
                cos, sin = tables[key]
                return reference.rope(x, cos, sin, 0, 10000.0, False)

            return rope_with_tables
        return self.reference_fn()

    # --- floors --------------------------------------------------------------------------------
    def bytes_moved(self) -> int:
        """Minimal device-memory traffic: each input read once, each output written once."""
        p, es = self.params, self.torch_dtype.itemsize
        oes = self.out_dtype().itemsize
        if self.op == "reduce_sum":
            m = p.get("m") or 1
            return m * p["n"] * es + m * oes
        if self.op == "rms_norm":
            return 2 * p["M"] * p["N"] * es + p["N"] * es
        if self.op == "layer_norm":
            return 2 * p["M"] * p["N"] * es + 2 * p["N"] * es
        if self.op == "rope":
            return 2 * p["B"] * p["S"] * p["H"] * p["D"] * es
        if self.op == "swiglu_ffn":
            T, D, F = p["T"], p["D"], p["F"]
            return (2 * T * D + 3 * F * D) * es
        if self.op == "attention":
            B, H, Hkv, S, D = p["B"], p["H"], p.get("Hkv", p["H"]), p["S"], p["D"]
            return (2 * B * H * S * D + 2 * B * Hkv * S * D) * es
        raise ValueError(self.op)

    def flops(self) -> int:
        """Matrix-unit FLOPs (0 for the memory-bound ops). Attention: 4·B·H·S·Skv·D, halved for
        causal with S == Skv (only the lower triangle is computed); FFN: three T×D×F products."""
        p = self.params
        if self.op == "swiglu_ffn":
            return 2 * 3 * p["T"] * p["D"] * p["F"]
        if self.op == "attention":
            f = 4 * p["B"] * p["H"] * p["S"] * p["S"] * p["D"]
            return f // 2 if p["causal"] else f
        return 0

    def score_bytes(self) -> int:
        """fp32 bytes of one S×Skv score matrix per head (what eager reference attention materializes)."""
        if self.op != "attention":
            return 0
        p = self.params
        return 4 * p["B"] * p["H"] * p["S"] * p["S"]

    def meta(self) -> dict:
        """The extra facts `Backend.supports(op, device, dtype, **meta)` takes."""
        if self.op == "attention":
            return {"head_dim": self.params["D"]}
        if self.op == "reduce_sum":
            return {"out_dtype": self.out_dtype()}
        return {}


# --- sweeps ----------------------------------------------------------------------------------------
def _reduce_sum(quick: bool, cpu: bool) -> list[Case]:
    out: list[Case] = []
    if cpu:
        sizes = [2**10, 2**16] if quick else [2**k for k in range(10, 25, 2)]
    else:
        sizes = [2**10, 2**16, 2**24, 2**30] if quick else [2**k for k in range(10, 31, 2)]
    for n in sizes:
        out.append(Case("reduce_sum", {"n": n}, "fp32", "fp32 all", n, "elements"))
    if quick:
        bf = sizes[-1:] if cpu else sizes[-2:]
    else:
        bf = [n for n in sizes if n >= 2**16]
    for n in bf:
        out.append(Case("reduce_sum", {"n": n, "out": "fp32"}, "bf16", "bf16->fp32 all", n, "elements"))
    if cpu:
        rows = [(256, 1024)] if quick else [(1024, 1024), (64, 16384)]
    else:
        rows = [(32768, 8192)] if quick else [(262144, 1024), (32768, 8192), (2048, 131072), (8, 2**25)]
    for m, n in rows:
        out.append(Case("reduce_sum", {"m": m, "n": n}, "fp32", "fp32 rows", m * n, "elements"))
    return out


def _norm(op: str, quick: bool, cpu: bool) -> list[Case]:
    if cpu:
        shapes = [(256, 1024), (16, 8192)] if quick else [(2**20 // n, n) for n in (512, 2048, 8192, 32768)]
    else:
        ns = [8192, 65536] if quick else [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
        # ~512 MiB of bf16 per tensor (2^28 elements), far beyond the 60 MB L2; 16384×65536 is 2 GiB.
        shapes = [(2**28 // n, n) for n in ns]
        if not quick:
            shapes.append((16384, 65536))
    return [Case(op, {"M": m, "N": n}, "bf16", "bf16", n, "N (hidden size)") for m, n in shapes]


def _rope(quick: bool, cpu: bool) -> list[Case]:
    if cpu:
        shapes = [(1, 128, 8, 64)] if quick else [(1, s, 8, 64) for s in (16, 128, 1024)]
        return [Case("rope", dict(zip("BSHD", s)), "bf16", "B=1", s[1], "S") for s in shapes]
    out = [Case("rope", {"B": 16, "S": 4096, "H": 32, "D": 128}, "bf16", "B=16", 4096, "S")]
    seqs = [128, 16384] if quick else [1, 16, 128, 1024, 4096, 16384, 65536]
    out += [Case("rope", {"B": 1, "S": s, "H": 32, "D": 128}, "bf16", "B=1", s, "S") for s in seqs]
    return out


def _ffn(quick: bool, cpu: bool) -> list[Case]:
    if cpu:
        D, F = 256, 512
        ts = [1, 16] if quick else [1, 16, 128]
    else:
        D, F = 4096, 11008
        ts = [1, 256, 4096] if quick else [1, 16, 64, 256, 1024, 4096, 8192]
    return [Case("swiglu_ffn", {"T": t, "D": D, "F": F}, "bf16", f"D={D},F={F}", t, "T (tokens)") for t in ts]


def _attention(quick: bool, cpu: bool) -> list[Case]:
    out: list[Case] = []
    if cpu:
        tokens, H = 512, 4
        seqs, dims, causals = ([128, 256] if quick else [128, 256, 512]), [64], [False, True]
    else:
        tokens, H = 16384, 32  # B·S fixed at 16K tokens
        if quick:
            seqs, dims, causals = [1024, 8192], [128], [False, True]
        else:
            seqs, dims, causals = [512, 1024, 2048, 4096, 8192, 16384], [64, 128, 256], [False, True]
    for d in dims:
        for c in causals:
            for s in seqs:
                p = {"B": max(1, tokens // s), "H": H, "S": s, "D": d, "causal": int(c)}
                out.append(Case("attention", p, "bf16", f"D={d}{' causal' if c else ''}", s, "S"))
    return out


def sweep(op: str, *, quick: bool, cpu: bool) -> list[Case]:
    """The cases of one op: the full sweep on a GPU, a few small sizes on the CPU or with `quick`."""
    if op == "reduce_sum":
        return _reduce_sum(quick, cpu)
    if op in ("rms_norm", "layer_norm"):
        return _norm(op, quick, cpu)
    if op == "rope":
        return _rope(quick, cpu)
    if op == "swiglu_ffn":
        return _ffn(quick, cpu)
    if op == "attention":
        return _attention(quick, cpu)
    raise ValueError(f"unknown op {op!r}; valid: {', '.join(OPS)}")


def arithmetic_intensity(case: Case) -> float:
    """FLOP per byte of the minimal traffic (0 for memory-bound ops)."""
    b = case.bytes_moved()
    return case.flops() / b if b else math.nan
