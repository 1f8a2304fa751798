"""attention cases: the S sweep at 16K tokens (D 64/128/256, causal and not), training at B4 H32 S4096
D128 (fwd+bwd; on the GPU also causal GQA 32/8 at B8 S1024 and B1 S2048), one decode step (1 query against 2048 keys, H32 / Hkv 8) and the decode suite (split-KV
against long caches, reported against the KV-read floor); SDPA and MAX baselines.

FLOPs: forward 4·B·H·D·P, P the visible (query, key) pairs: S·Skv, or about half with the causal mask
(S²/2 at S == Skv, as FlashAttention counts). Train counts the backward as FlashAttention does, 2.5×
the forward (its five products recompute QKᵀ): 14·B·H·D·P in all — the no-recompute minimum is 12, so
"% of ceiling" is up to 14/12 generous there.
Byte floor (es = element size, q = B·H·S·D·es, kv = B·Hkv·Skv·D·es): forward q, k, v read and o written,
2·q + 2·kv; train adds the backward's reads of q, k, v, o, do (3·q + 2·kv) and writes of dq, dk, dv (q + 2·kv): 6·q + 6·kv.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from fusekit.bench.baselines import Provider
from fusekit.bench.cases._base import GRAD, Case, Rand
from fusekit.ops.attention import SPEC

# Where the report puts this op (memory-bound ops first, then the matrix ops) and its plot marker.
REPORT_RANK = 5
MARKER = "*"

_REF = SPEC.reference["forward"]
# Eager / compiled reference attention materializes several fp32 S×Skv score tensors; above this many
# bytes for one of them the case is skipped (reason recorded) instead of exhausting the GPU.
MAX_SCORE_BYTES = 8 * 2**30
# The float64 oracle runs one kv head's query group at a time, in float32 once such a group's scores
# would pass this many bytes.
ORACLE_F64_BYTES = 512 * 2**20


@dataclass(frozen=True)
class AttentionCase(Case):
    """params: B, H, S, D, causal; optional Hkv (GQA) and Skv (keys; default S)."""

    op: ClassVar[str] = "attention"

    @property
    def hkv(self) -> int:
        return self.params.get("Hkv", self.params["H"])

    @property
    def skv(self) -> int:
        return self.params.get("Skv", self.params["S"])

    @property
    def causal(self) -> bool:
        return bool(self.params["causal"])

    @property
    def scale(self) -> float:
        return self.params["D"] ** -0.5

    def forward_inputs(self, rnd: Rand) -> dict[str, Tensor]:
        p = self.params
        b, d = p["B"], p["D"]
        return {
            "q": rnd(b, p["H"], p["S"], d),
            "k": rnd(b, self.hkv, self.skv, d),
            "v": rnd(b, self.hkv, self.skv, d),
        }

    def kwargs(self) -> dict:
        return {"causal": self.causal, "scale": self.scale}

    def reference(self) -> Callable[..., Tensor]:
        causal, scale = self.causal, self.scale
        return lambda q, k, v: _REF(q, k, v, causal, scale)[0]

    def eager(self) -> Callable[..., Tensor]:
        """What a user writes without a fused kernel: native-dtype products, softmax in fp32."""
        causal, scale = self.causal, self.scale

        def naive_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            s = (q @ k.transpose(-1, -2)) * scale
            if causal:
                sq, sk = q.shape[2], k.shape[2]
                keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
                s = s.masked_fill(~keep, float("-inf"))
            return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

        return naive_attention

    def backend_query(self) -> tuple[tuple[torch.dtype, ...], dict]:
        return (self.torch_dtype,), {"head_dim": self.params["D"]}

    def score_bytes(self) -> int:
        """fp32 bytes of one S×Skv score matrix over all heads (what the eager reference materializes)."""
        return 4 * self.params["B"] * self.params["H"] * self.params["S"] * self.skv

    def reference_limit(self) -> str | None:
        # Training keeps the probabilities for the backward next to the scores: twice the memory.
        need = self.score_bytes() * (2 if self.train else 1)
        if need > MAX_SCORE_BYTES:
            return f"the reference would materialize {need / 2**30:.0f} GiB of fp32 scores"
        return None

    def pairs(self) -> float:
        s, skv = self.params["S"], self.skv
        if not self.causal:
            return s * skv
        if s == skv:
            return s * s / 2
        return s * skv - s * s / 2 if s <= skv else skv * skv / 2

    def flops(self) -> int:
        if self.suite == "decode":
            return 0  # memory-bound (a KV-cache stream): reported as GB/s against the copy ceiling
        p = self.params
        return int((14 if self.train else 4) * p["B"] * p["H"] * p["D"] * self.pairs())

    def bytes_moved(self) -> int:
        p, es = self.params, self.torch_dtype.itemsize
        q = p["B"] * p["H"] * p["S"] * p["D"] * es
        kv = p["B"] * self.hkv * self.skv * p["D"] * es
        return 6 * q + 6 * kv if self.train else 2 * q + 2 * kv

    def oracle(self, inputs: dict[str, Tensor]) -> list[Tensor]:
        """The reference (and its autograd gradients) one batch element and kv head — that head's query
        group — at a time, which bounds the scores' memory; float64, or float32 for large groups."""
        q, k = inputs["q"], inputs["k"]
        b_, h, s, _ = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        group = h // hkv
        dt = torch.float64 if group * s * skv * 8 <= ORACLE_F64_BYTES else torch.float32
        step = self.step(self.reference())
        outs: list[Tensor] | None = None
        for b in range(b_):
            for hk in range(hkv):
                hs = slice(hk * group, (hk + 1) * group)
                part = {
                    "q": q[b : b + 1, hs],
                    "k": k[b : b + 1, hk : hk + 1],
                    "v": inputs["v"][b : b + 1, hk : hk + 1],
                }
                if self.train:
                    part[f"{GRAD}0"] = inputs[f"{GRAD}0"][b : b + 1, hs]
                part = {n: t.detach().to(dt).requires_grad_(t.requires_grad) for n, t in part.items()}
                res = [r.detach() for r in step(**part)]
                if outs is None:  # o [B, H, S, D], then dq like q, dk and dv like k
                    outs = [torch.empty(t.shape, dtype=dt, device=q.device) for t in (q, q, k, k)[: len(res)]]
                for full, r in zip(outs, res):
                    heads = hs if full.shape[1] == h else slice(hk, hk + 1)
                    full[b : b + 1, heads] = r
        assert outs is not None
        return outs


def cases(suite: str, *, quick: bool, cpu: bool) -> list[Case]:
    out: list[Case] = []
    if suite == "sweep":
        if cpu:
            tokens, h = 512, 4
            seqs, dims, causals = ([128, 256] if quick else [128, 256, 512]), [64], [False, True]
        else:
            tokens, h = 16384, 32  # B·S fixed at 16K tokens
            if quick:
                seqs, dims, causals = [1024, 8192], [128], [False, True]
            else:
                seqs, dims, causals = [512, 1024, 2048, 4096, 8192, 16384], [64, 128, 256], [False, True]
        for d in dims:
            for c in causals:
                for s in seqs:
                    p = {"B": max(1, tokens // s), "H": h, "S": s, "D": d, "causal": int(c)}
                    out.append(AttentionCase(p, "bf16", f"D={d}{' causal' if c else ''}", s, "S"))
    elif suite == "train":
        b, h, s, d = (1, 2, 64, 64) if cpu else (4, 32, 4096, 128)
        for c in [True] if quick and cpu else [False, True]:
            p = {"B": b, "H": h, "S": s, "D": d, "causal": int(c)}
            out.append(AttentionCase(p, "bf16", f"D={d}{' causal' if c else ''}", s, "S", suite))
        if not cpu and not quick:  # Llama-3-8B's heads (32 q / 8 kv) at a training step's sequence lengths
            for b, s in ((8, 1024), (1, 2048)):
                p = {"B": b, "H": 32, "Hkv": 8, "S": s, "D": 128, "causal": 1}
                out.append(AttentionCase(p, "bf16", "D=128 causal GQA 4", s, "S", suite))
    elif suite == "small":
        p = {
            "B": 1,
            "H": 32,
            "Hkv": 8,
            "S": 1,
            "Skv": 2048 if not (quick and cpu) else 256,
            "D": 128,
            "causal": 0,
        }
        out.append(AttentionCase(p, "bf16", "decode", p["Skv"], "Skv (keys)", suite))
    elif suite == "decode":
        out += _decode_cases(quick, cpu)
    return out


def _decode_cases(quick: bool, cpu: bool) -> list[Case]:
    """Split-KV decode against SDPA: 1 (or 16) queries per sequence, H32 / Hkv 8 D128 (Llama-3-8B) over
    Skv 2K..128K at batch 1 and 2K..8K at batch 32, and GQA 1 / 8, D 64 / 256 at batch 1, 32K keys. The
    floor is the KV read (B·Hkv·Skv·D·2·es): 134 MB at B1 Skv 32K, 31 us at 4.3 TB/s."""
    if cpu:
        grid = [(1, 4, 2, 1, 256, 64)] if quick else [(1, 4, 2, 1, s, 64) for s in (256, 1024)]
    else:
        grid = [(1, 32, 8, 1, s, 128) for s in ((8192, 32768) if quick else (2048, 8192, 32768, 131072))]
        if not quick:
            grid += [(32, 32, 8, 1, s, 128) for s in (2048, 8192)]
            grid += [(1, 32, 32, 1, 32768, 128), (1, 32, 4, 1, 32768, 128), (1, 32, 8, 1, 32768, 64)]
            grid += [(1, 32, 8, 1, 32768, 256), (1, 32, 8, 16, 8192, 128)]
    out: list[Case] = []
    for b, h, hkv, s, skv, d in grid:
        p = {"B": b, "H": h, "Hkv": hkv, "S": s, "Skv": skv, "D": d, "causal": 0}
        series = f"B={b} H={h}/{hkv} S={s} D={d}"
        out.append(AttentionCase(p, "bf16", series, skv, "Skv (keys)", "decode"))
    return out


class SDPA(Provider):
    def __init__(self) -> None:
        super().__init__(
            "sdpa", "torch.nn.functional.scaled_dot_product_attention (forward and, in train, its backward)"
        )

    def supports(self, case: Case, device: torch.device) -> str | None:
        if case.causal and case.params["S"] != case.skv:
            return "SDPA's is_causal is aligned top-left, fusekit's bottom-right: they differ when S != Skv"
        return None

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor]:
        causal, scale = case.causal, case.scale
        extra = {"enable_gqa": True} if case.hkv != case.params["H"] else {}

        def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **extra)

        return sdpa


class MaxAttention(Provider):
    """MAX's flash attention kernel (`mo.mha.no_cache`) in a one-op graph; inputs [B, S, H, D]."""

    def __init__(self) -> None:
        super().__init__("max-attention", "max.nn.kernels.flash_attention_gpu graph")
        self._reason: str | None = None
        self._checked = False
        self._session = None

    def available(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "MAX flash attention runs on a GPU only"
        if not self._checked:
            self._checked = True
            try:
                from max import driver
                from max.nn.kernels import flash_attention_gpu  # noqa: F401

                if driver.accelerator_count() == 0:
                    self._reason = "max is importable but sees no accelerator"
            except Exception as exc:
                self._reason = f"MAX attention not available: {type(exc).__name__}: {exc}"
        return self._reason

    def supports(self, case: Case, device: torch.device) -> str | None:
        if case.train:
            return "the MAX graph is forward only"
        if case.hkv != case.params["H"] or case.skv != case.params["S"]:
            return "MAX no-cache flash attention takes H == Hkv and S == Skv here"
        if case.params["D"] != 128 and not os.environ.get("FUSEKIT_BENCH_MAX_ALL"):
            # Each shape is a fresh MAX graph compile (~10 s); D=128 keeps a full run inside one device call.
            return "MAX attention runs the D=128 sweep only (set FUSEKIT_BENCH_MAX_ALL=1 for every D)"
        return None

    def prepare(self, case: Case, device: torch.device) -> Callable[..., Tensor]:
        from max.driver import Accelerator, Buffer
        from max.dtype import DType
        from max.engine import InferenceSession
        from max.graph import DeviceRef, Graph, TensorType
        from max.nn.attention import MHAMaskVariant
        from max.nn.kernels import flash_attention_gpu

        from fusekit.backends.mojo.dispatch import _make_fence

        p = case.params
        shape = [p["B"], p["S"], p["H"], p["D"]]
        t = TensorType(DType.bfloat16, shape, device=DeviceRef.GPU())
        mask = MHAMaskVariant.CAUSAL_MASK if case.causal else MHAMaskVariant.NULL_MASK
        with Graph(f"fusekit_bench_mha_{'_'.join(map(str, shape))}", input_types=(t, t, t)) as g:
            q, k, v = (x.tensor for x in g.inputs)
            g.output(flash_attention_gpu(q, k, v, mask_variant=mask, scale=case.scale))
        if self._session is None:
            self._acc = Accelerator(device.index or 0)
            self._session = InferenceSession(devices=[self._acc])
        model = self._session.load(g)
        # MAX runs on its own stream: fenced both ways against torch's current stream with events, as the
        # mojo backend's calls are (a host synchronize here put the host's latency into MAX's GPU time).
        fence = _make_fence(device, self._acc.default_queue.native_stream_handle)
        cache: dict[int, tuple] = {}

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            # MAX takes [B, S, H, D]; the transposed copies are made once per input set (untimed after the
            # first call) so the timed region is MAX's kernel plus its execute overhead.
            key = q.data_ptr()
            if key not in cache:
                qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                cache[key] = (qs, ks, vs, [Buffer.from_dlpack(x) for x in (qs, ks, vs)])
            cur = fence.enter()
            out = model.execute(*cache[key][3])[0]
            if cur is not None:
                fence.exit(cur)
            return torch.from_dlpack(out).transpose(1, 2)

        return run


BASELINES = (SDPA(), MaxAttention())
