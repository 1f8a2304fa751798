"""SwiGLUMLP: the Llama MLP (HF gate_proj / up_proj / down_proj layout) running ops.swiglu_ffn."""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from fusekit import backends, ops
from fusekit.distributed import PLAIN
from fusekit.nn._forms import hf_form
from fusekit.nn._hooks import global_hooks, hooked


def _is_silu(act: object) -> bool:
    """True for torch's SiLU and HF's SiLUActivation (ACT2FN["silu"]) and the functional silu."""
    if isinstance(act, nn.SiLU) or act is nn.functional.silu:
        return True
    return type(act).__name__ in ("SiLUActivation", "SiLU")


_LINEAR_FORWARD = nn.Linear.forward


def _plain_linear(m: nn.Module) -> bool:
    """An nn.Linear (or a subclass keeping its forward) without bias: computes exactly x @ weight.T."""
    return type(m).forward is _LINEAR_FORWARD and getattr(m, "bias", None) is None


def _hook_partial(hook: object) -> functools.partial | None:
    """The functools.partial a distribute_module hook closes over (its input_fn / output_fn), or None."""
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            fn = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(fn, functools.partial):
            return fn
    return None


def _tp_layout(m: nn.Module) -> tuple | None:
    """(style class, input_layouts, output_layouts, use_local_output) of the ParallelStyle whose two hooks
    parallelize_module put on m: distribute_module's pre / post hooks close over partials of the style's
    static _prepare_input_fn(input_layouts, desired_input_layouts, ...) and _prepare_output_fn(
    output_layouts, use_local_output, ...). None where m has any other hook."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if (
        m._backward_hooks
        or m._backward_pre_hooks
        or len(m._forward_pre_hooks) != 1
        or len(m._forward_hooks) != 1
    ):
        return None
    pre = _hook_partial(next(iter(m._forward_pre_hooks.values())))
    post = _hook_partial(next(iter(m._forward_hooks.values())))
    if pre is None or post is None or len(pre.args) != 2 or len(post.args) != 2:
        return None
    for cls in (ColwiseParallel, RowwiseParallel):
        if pre.func is cls._prepare_input_fn and post.func is cls._prepare_output_fn:
            return (cls, tuple(pre.args[0]), tuple(post.args[0]), post.args[1])
    return None


def _default_tp(gate: nn.Module, up: nn.Module, down: nn.Module) -> bool:
    """Whether the projections carry exactly the default ColwiseParallel (gate, up) and RowwiseParallel (down)
    hooks: a replicated x in, a Replicate local output: what the op's tensor-parallel path computes (one
    all-reduce of the F-slice sums). Any other layout (sequence-parallel input_layouts=Shard(1), an
    output_layouts shard, use_local_output=False) means the hooks do something the fused op would not."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col = (ColwiseParallel, (Replicate(),), (Shard(-1),), True)
    return (
        _tp_layout(gate) == col
        and _tp_layout(up) == col
        and _tp_layout(down) == (RowwiseParallel, (Shard(-1),), (Replicate(),), True)
    )


def _replicated(x: object) -> bool:
    """A DTensor x Replicate on every mesh dim: what the default ColwiseParallel hooks pass on as it is (a
    sharded x they redistribute first; the unfused modules do that)."""
    return all(p.is_replicate() for p in getattr(x, "placements", ()))


def _fusable(*projs: nn.Module) -> bool:
    """The three projections can run as one swiglu_ffn: plain Linears, and no hooks - except torch's tensor
    parallelism (parallelize_module) in its default Colwise / Rowwise layout, which hooks the Linears whose
    weights it made DTensors: the op's DTensor path does what those hooks do (fusekit.distributed). Any
    other hook, or a parallel style with other layouts, runs the three modules (exact)."""
    if not all(_plain_linear(m) for m in projs):
        return False
    if not any(hooked(m) for m in projs):
        return True
    if global_hooks():  # it must see the three calls
        return False
    return all(type(m.weight) not in PLAIN for m in projs) and _default_tp(*projs)


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
        if _fusable(g, u, d) and (type(x) in PLAIN or _replicated(x) or type(g.weight) in PLAIN):
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
