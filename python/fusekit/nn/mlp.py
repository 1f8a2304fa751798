"""SwiGLUMLP: the Llama MLP (HF gate_proj / up_proj / down_proj layout) running ops.swiglu_ffn."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fusekit import backends, ops
from fusekit.distributed import PLAIN
from fusekit.nn._forms import hf_form
from fusekit.nn._hooks import hooked


def _is_silu(act: object) -> bool:
    """True for torch's SiLU and HF's SiLUActivation (ACT2FN["silu"]) and the functional silu."""
    if isinstance(act, nn.SiLU) or act is nn.functional.silu:
        return True
    return type(act).__name__ in ("SiLUActivation", "SiLU")


_LINEAR_FORWARD = nn.Linear.forward


def _plain_linear(m: nn.Module) -> bool:
    """An nn.Linear (or a subclass keeping its forward) without bias: computes exactly x @ weight.T."""
    return type(m).forward is _LINEAR_FORWARD and getattr(m, "bias", None) is None


def _fusable(*projs: nn.Module) -> bool:
    """The three projections can run as one swiglu_ffn: plain Linears, and no hooks - except torch's tensor
    parallelism (parallelize_module), which hooks the Linears whose weights it made DTensors: the op's DTensor
    path does what those hooks do (fusekit.distributed)."""
    if not all(_plain_linear(m) for m in projs):
        return False
    if not any(hooked(m) for m in projs):
        return True
    return all(type(m.weight) not in PLAIN for m in projs)


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) in one op, with HF LlamaMLP's submodule names.

    gate_proj, up_proj: nn.Linear(hidden_size, intermediate_size, bias=False); down_proj:
    nn.Linear(intermediate_size, hidden_size, bias=False), so an HF LlamaMLP / MistralMLP / Qwen2MLP
    state_dict loads unchanged. The Linear modules hold the weights; forward passes them to
    ops.swiglu_ffn (fp32 accumulation, g and u kept in fp32 until the product is rounded once).

    Biases are not supported (the op has none): bias=True raises. forward(x [..., hidden]) -> [...,
    hidden] in x's dtype; x and the weights share one dtype (fp32, bf16, fp16). Gradients flow to x and
    the three weights. A projection replaced by a module that computes more than its weight (peft's LoRA
    layers, wrapped or quantized linears) or carrying hooks makes forward call the three modules as LlamaMLP
    does (unfused, exact) instead of dropping what the fused op cannot see.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if bias:
            raise ValueError(
                "bias: SwiGLUMLP has no biases (fusekit's swiglu_ffn op takes none); use bias=False"
            )
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.backend = backends.prepare(backend)
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: Tensor) -> Tensor:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        if _fusable(g, u, d):
            return ops.swiglu_ffn(x, g.weight, u.weight, d.weight, backend=self.backend)
        # A projection that computes more than x @ weight.T (a LoRA adapter put in its place by peft after
        # patching, a quantized or otherwise wrapped layer), or one with hooks (activation capture, AWQ/GPTQ
        # calibration): the fused op would read only the weights, dropping the rest and skipping the hooks,
        # so the modules run as HF's LlamaMLP runs them.
        return d(nn.functional.silu(g(x)) * u(x))

    @classmethod
    def from_module(cls, module: nn.Module, *, backend: str = "auto") -> SwiGLUMLP:
        """A SwiGLUMLP around an HF-style MLP's own Linear modules (shared, not copied).

        Raises ValueError naming the feature when the module has biases or an activation other than SiLU, and
        when its forward is not LlamaMLP's down(act(gate(x)) * up(x)) (HF's copies of it: Mistral, Qwen2/3,
        Granite ...) or a fusekit SwiGLUMLP's: extra math (FalconH1's multipliers, a clamp) is not guessed.
        """
        if not isinstance(module, SwiGLUMLP) and hf_form(module, "mlp") != "llama":
            raise ValueError(
                f"module: {type(module).__name__}.forward is not LlamaMLP's down_proj(act_fn(gate_proj(x)) * "
                "up_proj(x)), so what it computes is unknown; build a SwiGLUMLP and assign its Linears if it "
                "computes exactly that"
            )
        projs = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(module, name, None)
            if not isinstance(lin, nn.Linear):
                raise TypeError(
                    f"module: {type(module).__name__}.{name} must be an nn.Linear, got {type(lin).__name__}"
                )
            if lin.bias is not None:
                raise ValueError(
                    f"mlp bias: {type(module).__name__}.{name} has a bias; fusekit's SwiGLU MLP supports none"
                )
            projs[name] = lin
        act = getattr(module, "act_fn", nn.SiLU())
        if not _is_silu(act):
            raise ValueError(
                f"hidden_act: {type(module).__name__}.act_fn is {type(act).__name__}; fusekit's SwiGLU MLP is SiLU only"
            )
        f, d = projs["gate_proj"].weight.shape
        if projs["up_proj"].weight.shape != (f, d) or projs["down_proj"].weight.shape != (d, f):
            raise ValueError(
                f"module: inconsistent projection shapes gate {tuple(projs['gate_proj'].weight.shape)}, up "
                f"{tuple(projs['up_proj'].weight.shape)}, down {tuple(projs['down_proj'].weight.shape)}"
            )
        new = cls(d, f, backend=backend, device="meta")
        for name, lin in projs.items():
            setattr(new, name, lin)
        return new

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, backend={self.backend!r}"
