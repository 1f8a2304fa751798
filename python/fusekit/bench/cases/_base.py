"""What a benchmark case is, and what each op's cases module (`bench/cases/<op>.py`) fills in.

A `Case` is one point of one suite of one op. The harness (`bench/run.py`, `bench/baselines.py`) is
op-agnostic: it only calls the methods below, so everything op-specific — shapes, inputs, the public
call, the reference the torch-eager / torch.compile baselines time, the byte and FLOP floors, the
op's own baselines — lives in the op's module.

Suites:
- "sweep": forward over the size sweeps of issue 4 (the committed H200 results);
- "train": forward + backward at training shapes (issue 10): the timed call runs the op, then
  `torch.autograd.grad` of its outputs with fixed random output gradients (no `.grad` accumulation,
  so every call does the same work);
- "small": forward at model shapes where per-call overhead shows (issue 11: decode, small norms).

Correctness: every provider's outputs (and, in "train", its input gradients) are compared with
`oracle()`: the op's float64 reference (`fusekit.ops.<op>.SPEC.reference`), differentiated by
autograd in float64 for "train" — an independent check of the hand-written backward formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from fusekit import tolerances
from fusekit.ops._spec import BACKWARD, FORWARD, OpSpec

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
SUITES: tuple[str, ...] = ("sweep", "train", "small", "decode")
GRAD = "grad_"  # inputs named grad_<i> hold the gradient of output i in a "train" step


class Rand:
    """Seeded random tensors (never zeros): normal * scale + shift, made in fp32, stored in `dtype`."""

    def __init__(self, gen: torch.Generator, device: str | torch.device, dtype: torch.dtype) -> None:
        self.gen, self.device, self.dtype = gen, device, dtype

    def __call__(
        self, *shape: int, scale: float = 1.0, shift: float = 0.0, dtype: torch.dtype | None = None
    ) -> Tensor:
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (t * scale + shift).to(dtype or self.dtype)


def as_tuple(out: Tensor | tuple | list) -> tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _f64(t: Tensor) -> Tensor:
    """A float64 leaf copy (keeping requires_grad) of a floating tensor; others unchanged."""
    if not t.is_floating_point():
        return t
    return t.detach().to(torch.float64).requires_grad_(t.requires_grad)


@dataclass(frozen=True)
class Case:
    """One benchmark point. `params` are the op's shape/flag arguments (they form the label); `dtype`
    the activation dtype; `group` the sub-sweep it belongs to (a line per provider in a plot), `x`
    the swept quantity and `x_label` its name; `suite` one of SUITES."""

    op: ClassVar[str] = ""

    params: dict = field(hash=False)
    dtype: str
    group: str
    x: float
    x_label: str
    suite: str = "sweep"

    # --- naming --------------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.params.items()) + f",dtype={self.dtype}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def train(self) -> bool:
        return self.suite == "train"

    @property
    def phases(self) -> tuple[str, ...]:
        return (FORWARD, BACKWARD) if self.train else (FORWARD,)

    @property
    def spec(self) -> OpSpec:
        from fusekit.ops import SPECS

        return SPECS[self.op]

    # --- what an op's module defines -------------------------------------------------------------------
    def forward_inputs(self, rnd: Rand) -> dict[str, Tensor]:
        """The tensors of the public call, by keyword."""
        raise NotImplementedError

    def kwargs(self) -> dict:
        """The non-tensor keyword arguments of the public call `fusekit.ops.<op>`."""
        return {}

    def fusekit(self, backend: str) -> Callable[..., Tensor | tuple]:
        """The public call as a user writes it: `fusekit.ops.<op>(**tensors, **kwargs, backend=...)`."""
        import fusekit.ops

        fn, kw = getattr(fusekit.ops, self.op), self.kwargs()
        return lambda **inp: fn(**inp, **kw, backend=backend)

    def reference(self) -> Callable[..., Tensor | tuple]:
        """The op's definition (`SPEC.reference["forward"]`) as a function of the public call's tensors,
        returning what the public call returns; exact in float64 (the oracle runs it there)."""
        raise NotImplementedError

    def eager(self) -> Callable[..., Tensor | tuple]:
        """What torch-eager and torch.compile time: the reference, unless the op module says why a user
        would write something else (native-dtype matmuls for the matrix ops)."""
        return self.reference()

    def bytes_moved(self) -> int:
        """The byte floor: the traffic the op cannot avoid (see each module's docstring)."""
        raise NotImplementedError

    def flops(self) -> int:
        """Matrix-unit FLOPs (0 for the memory-bound ops)."""
        return 0

    def backend_query(self) -> tuple[tuple[torch.dtype, ...], dict]:
        """(dtypes in `spec.dtype_vars` order, meta) for `Backend.supports(op, phase, device, ...)`."""
        return (self.torch_dtype,) * len(self.spec.dtype_vars), {}

    def reference_limit(self) -> str | None:
        """Why running the reference itself (torch backend, torch-eager) would not fit, or None."""
        return None

    def output_shapes(self, fwd: dict[str, Tensor]) -> list[tuple[int, ...]]:
        """Shapes of the public call's outputs (the gradients a "train" step feeds back)."""
        return [tuple(next(iter(fwd.values())).shape)]

    def tolerance(self, out: Tensor, phase: str) -> float:
        """Sanity bound on ‖out − oracle‖ / ‖oracle‖ (fusekit.tolerances), by the looser of the
        activation dtype and the output's own: an fp32 weight gradient of bf16 activations carries
        their rounding (llama casting rounds x̂ to bf16 before the weight sees it)."""
        dts = {self.torch_dtype, out.dtype} & set(tolerances.RTOL)
        return max(tolerances.rtol(self.op, d, phase) for d in dts)

    # --- generic ---------------------------------------------------------------------------------------
    def make_inputs(self, device: str | torch.device, gen: torch.Generator) -> dict[str, Tensor]:
        """Fresh random inputs; in "train" the floating inputs require grad and grad_<i> are added."""
        rnd = Rand(gen, device, self.torch_dtype)
        fwd = self.forward_inputs(rnd)
        if not self.train:
            return fwd
        shapes = self.output_shapes(fwd)
        for t in fwd.values():
            if t.is_floating_point():
                t.requires_grad_(True)
        for i, shape in enumerate(shapes):
            fwd[f"{GRAD}{i}"] = rnd(*shape)
        return fwd

    def step(self, fn: Callable[..., Tensor | tuple]) -> Callable[..., tuple[Tensor, ...]]:
        """What is timed for a provider's callable `fn`: its outputs, or (train) its outputs and then
        the gradients of every input that requires grad, in input order."""
        if not self.train:
            return lambda **inp: as_tuple(fn(**inp))

        def fwd_bwd(**inp: Tensor) -> tuple[Tensor, ...]:
            fwd = {k: v for k, v in inp.items() if not k.startswith(GRAD)}
            outs = as_tuple(fn(**fwd))
            leaves = [v for v in fwd.values() if v.requires_grad]
            grads = torch.autograd.grad(outs, leaves, [inp[f"{GRAD}{i}"] for i in range(len(outs))])
            return (*outs, *grads)

        return fwd_bwd

    def output_names(self, inputs: dict[str, Tensor]) -> list[str]:
        """Names of what `step` returns: out0, out1, .. then d<input> for each input that requires grad."""
        fwd = {k: v for k, v in inputs.items() if not k.startswith(GRAD)}
        names = [f"out{i}" for i in range(len(self.output_shapes(fwd)))]
        return names + [f"d{k}" for k, v in fwd.items() if self.train and v.requires_grad]

    def tolerances(self, outs: tuple[Tensor, ...], inputs: dict[str, Tensor]) -> list[float]:
        n_fwd = sum(k.startswith(GRAD) for k in inputs) if self.train else len(outs)
        return [self.tolerance(o, FORWARD if i < n_fwd else BACKWARD) for i, o in enumerate(outs)]

    def oracle(self, inputs: dict[str, Tensor]) -> list[Tensor]:
        """The expected outputs (and gradients): the reference on float64 copies, on the inputs' device."""
        up = {k: _f64(v) for k, v in inputs.items()}
        return [o.detach() for o in self.step(self.reference())(**up)]
