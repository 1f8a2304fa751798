"""Providers the harness times: every installed fusekit backend (through `fusekit.ops`) and the
baselines they are compared against.

Baselines: torch eager (the reference run as is), torch.compile of the reference, CUB
DeviceReduce::Sum (reduce_sum), cuBLAS-only FFN (three torch matmuls + silu), torch SDPA and MAX's own
flash attention (`max.nn.kernels.flash_attention_gpu`, when `max` is importable with a GPU).

A provider answers `supports(case, device)` with None or the reason it does not run the case, and
`prepare(case, device)` returns a callable of the input tensors (compilation and graph building happen
there, outside the timed region).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusekit.bench.cases import Case

# Eager / compiled reference attention materializes several fp32 S×Skv score tensors; above this many
# bytes for one of them the case is skipped (reason recorded) instead of exhausting the GPU.
MAX_SCORE_BYTES = 8 * 2**30


@dataclass
class Provider:
    name: str
    kind: str  # "backend" (a fusekit backend, through fusekit.ops) or "baseline"
    ops: frozenset[str]
    description: str

    def supports(self, case: Case, device: torch.device) -> str | None:
        if case.op not in self.ops:
            return f"{self.name} has no {case.op}"
        return None

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
        raise NotImplementedError


# --- fusekit backends ---------------------------------------------------------------------------------
def _ops_module():
    """`fusekit.ops`, or a stand-in that runs the reference when ops.py is not there yet."""
    try:
        from fusekit import ops

        return ops
    except ImportError:
        return None


class BackendProvider(Provider):
    """A fusekit backend, called the way a user calls it: `fusekit.ops.<op>(..., backend=name)`."""

    def __init__(self, name: str, backend) -> None:
        from fusekit.bench.cases import OPS

        super().__init__(name, "backend", frozenset(OPS), f"fusekit.ops.<op>(..., backend={name!r})")
        self.backend = backend

    def supports(self, case: Case, device: torch.device) -> str | None:
        why = super().supports(case, device)
        if why is None and self.backend is not None:
            why = self.backend.supports(case.op, device, case.torch_dtype, **case.meta())
        if why is None and self.name == "torch" and case.score_bytes() > MAX_SCORE_BYTES:
            why = f"torch reference would materialize {case.score_bytes() / 2**30:.0f} GiB fp32 scores"
        return why

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
        ops = _ops_module()
        if ops is None:  # ops.py not landed yet: the torch backend is the reference itself
            if self.name != "torch":
                raise RuntimeError("fusekit.ops is not importable")
            return case.reference_fn()
        kw, op, name = case.kwargs(), getattr(ops, case.op), self.name
        return lambda **inp: op(**inp, **kw, backend=name)


def backend_providers(wanted: list[str] | None = None) -> tuple[list[Provider], dict[str, str]]:
    """Installed backends as providers, and name -> reason for those that are not usable."""
    skipped: dict[str, str] = {}
    out: list[Provider] = []
    try:
        from fusekit import backends

        avail = backends.available()
    except ImportError as exc:  # registry not there: only the reference adapter
        avail, backends = {"torch": None}, None
        skipped["registry"] = f"fusekit.backends not importable ({exc}); timing the reference as 'torch'"
    for name, reason in avail.items():
        if wanted is not None and name not in wanted:
            continue
        if reason is not None:
            skipped[name] = reason
            continue
        out.append(BackendProvider(name, backends.get(name) if backends else None))
    return out, skipped


# --- baselines --------------------------------------------------------------------------------------
class TorchEager(Provider):
    def __init__(self) -> None:
        from fusekit.bench.cases import OPS

        super().__init__(
            "torch-eager",
            "baseline",
            frozenset(OPS),
            "eager torch: the reference, native-dtype matmuls for ffn/attention",
        )

    def supports(self, case: Case, device: torch.device) -> str | None:
        if case.score_bytes() > MAX_SCORE_BYTES:
            return f"would materialize {case.score_bytes() / 2**30:.0f} GiB of fp32 scores per tensor"
        return super().supports(case, device)

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
        fn = case.native_fn()
        return lambda **inp: fn(**inp)


class TorchCompile(TorchEager):
    def __init__(self) -> None:
        super().__init__()
        self.name = "torch-compile"
        self.description = "torch.compile of the torch-eager baseline, dynamic=False, compiled per shape"

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
        # A fresh static-shape compile per case: with automatic dynamic shapes (the default after the first
        # recompile) inductor drops its split reductions, and a 2^30-element sum ran 35x slower on the H200.
        # The reset also keeps dynamo's per-code-object recompile limit from silently falling back to eager.
        torch._dynamo.reset()
        fn = torch.compile(case.native_fn(), dynamic=False)
        return lambda **inp: fn(**inp)


class CubSum(Provider):
    def __init__(self) -> None:
        desc = "cub::DeviceReduce::Sum (fp32, whole tensor)"
        super().__init__("cub", "baseline", frozenset({"reduce_sum"}), desc)
        self._error: str | None = None

    def supports(self, case: Case, device: torch.device) -> str | None:
        why = super().supports(case, device)
        if why:
            return why
        if device.type != "cuda":
            return "CUB needs a CUDA GPU"
        if case.dtype != "fp32" or case.params.get("m") is not None or case.params.get("out"):
            return "CUB baseline covers the fp32 whole-tensor sum only"
        if self._error is None:
            try:
                from fusekit.bench import cub

                cub.load()
            except Exception as exc:
                self._error = f"CUB build failed: {type(exc).__name__}: {str(exc)[-800:]}"
            else:
                self._error = ""
        return self._error or None

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
        from fusekit.bench import cub

        mod = cub.load()
        return lambda x: mod.cub_sum(x)


class CublasFFN(Provider):
    def __init__(self) -> None:
        desc = "three torch matmuls (cuBLAS) + silu*mul, unfused"
        super().__init__("cublas", "baseline", frozenset({"swiglu_ffn"}), desc)

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
        def ffn(x, w_gate, w_up, w_down):
            return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T

        return ffn


class SDPA(Provider):
    def __init__(self) -> None:
        super().__init__(
            "sdpa", "baseline", frozenset({"attention"}), "torch.nn.functional.scaled_dot_product_attention"
        )

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
        kw = case.kwargs()
        gqa = case.params.get("Hkv", case.params["H"]) != case.params["H"]

        def sdpa(q, k, v):
            extra = {"enable_gqa": True} if gqa else {}
            return F.scaled_dot_product_attention(q, k, v, is_causal=kw["causal"], scale=kw["scale"], **extra)

        return sdpa


class MaxAttention(Provider):
    """MAX's flash attention kernel (`mo.mha.no_cache`) in a one-op graph; inputs [B, S, H, D]."""

    def __init__(self) -> None:
        super().__init__(
            "max-attention", "baseline", frozenset({"attention"}), "max.nn.kernels.flash_attention_gpu graph"
        )
        self._reason: str | None = None
        self._checked = False
        self._session = None

    def _check(self) -> str | None:
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
        why = super().supports(case, device)
        if why:
            return why
        if device.type != "cuda":
            return "MAX flash attention runs on a GPU only"
        if case.params.get("Hkv", case.params["H"]) != case.params["H"]:
            return "MAX no-cache flash attention takes H == Hkv here"
        if case.params["D"] != 128 and not os.environ.get("FUSEKIT_BENCH_MAX_ALL"):
            # Each shape is a fresh MAX graph compile (~10 s); D=128 keeps a full run inside one device call.
            return "MAX attention runs the D=128 sweep only (set FUSEKIT_BENCH_MAX_ALL=1 for every D)"
        return self._check()

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
        from max.driver import Accelerator, Buffer
        from max.dtype import DType
        from max.engine import InferenceSession
        from max.graph import DeviceRef, Graph, TensorType
        from max.nn.attention import MHAMaskVariant
        from max.nn.kernels import flash_attention_gpu

        p, kw = case.params, case.kwargs()
        shape = [p["B"], p["S"], p["H"], p["D"]]
        t = TensorType(DType.bfloat16, shape, device=DeviceRef.GPU())
        mask = MHAMaskVariant.CAUSAL_MASK if kw["causal"] else MHAMaskVariant.NULL_MASK
        with Graph(f"fusekit_bench_mha_{'_'.join(map(str, shape))}", input_types=(t, t, t)) as g:
            q, k, v = (x.tensor for x in g.inputs)
            g.output(flash_attention_gpu(q, k, v, mask_variant=mask, scale=kw["scale"]))
        if self._session is None:
            self._acc = Accelerator()
            self._session = InferenceSession(devices=[self._acc])
        acc, model = self._acc, self._session.load(g)
        cache: dict[int, tuple] = {}

        def run(q, k, v):
            # MAX takes [B, S, H, D]; the transposed copies are made once per input set (untimed after the
            # first call) so the timed region is MAX's kernel plus its execute overhead.
            key = q.data_ptr()
            if key not in cache:
                qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                torch.cuda.synchronize()  # the copies are made on torch's stream; MAX reads on its own
                cache[key] = (qs, ks, vs, [Buffer.from_dlpack(x) for x in (qs, ks, vs)])
            out = model.execute(*cache[key][3])[0]
            acc.synchronize()  # MAX runs on its own stream: make the result visible to torch's
            return torch.from_dlpack(out).transpose(1, 2)

        return run


def baseline_providers(wanted: list[str] | None = None) -> list[Provider]:
    all_ = [TorchEager(), TorchCompile(), CubSum(), CublasFFN(), SDPA(), MaxAttention()]
    return [p for p in all_ if wanted is None or p.name in wanted]


BASELINE_NAMES: tuple[str, ...] = ("torch-eager", "torch-compile", "cub", "cublas", "sdpa", "max-attention")
