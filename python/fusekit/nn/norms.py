"""RMSNorm and LayerNorm modules over fusekit.ops: state_dict drop-ins for torch.nn and HF norms.

Both keep torch's parameter names (`weight`, `bias`) and attribute names (`normalized_shape`, `eps`,
`elementwise_affine`), so a checkpoint of torch.nn.RMSNorm / torch.nn.LayerNorm / HF LlamaRMSNorm loads
unchanged. `from_module` builds one around an existing module's parameters (the same Parameter
objects, so optimizers and tied weights keep working).

Both normalize over the last dimension only (what the kernels do); a multi-dim `normalized_shape`
raises. `forward(x, residual=None)`: with a residual the add is fused into the norm's single pass
and the module returns (y, h) with h = x + residual, the next residual stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from fusekit import backends, ops
from fusekit.nn._forms import class_forward, hf_form

CASTINGS = ("fp32", "llama", "gemma")


def _last_dim(normalized_shape: int | Sequence[int]) -> int:
    """The one normalized extent; fusekit's norms reduce over the last dimension only."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] <= 0:
        raise ValueError(
            f"normalized_shape: fusekit normalizes over the last dimension only, so it must be one positive "
            f"int (or a 1-tuple), got {normalized_shape!r}"
        )
    return shape[0]


def _check_x(x: Tensor, n: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != n:
        raise ValueError(f"x: the last dimension must be normalized_shape = {n}, got shape {tuple(x.shape)}")


def _default_eps(dtype: torch.dtype) -> float:
    """torch.nn.RMSNorm's eps=None: the eps of its computation dtype (fp32 for 16-bit x)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _refuse_parametrized(module: nn.Module, names: tuple[str, ...]) -> None:
    """from_module shares the module's Parameters; a parametrized one (torch.nn.utils.parametrize) has a
    computed tensor there, not a Parameter (torch's TypeError "cannot assign ... as parameter" said nothing
    of why)."""
    for name in names:
        if parametrize.is_parametrized(module, name):
            raise ValueError(
                f"module: its {name} is parametrized (torch.nn.utils.parametrize), so there is no Parameter to "
                f"share; call parametrize.remove_parametrizations(module, {name!r}) first, or register the "
                "parametrization on the fusekit module after from_module"
            )


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: y = x * rsqrt(mean(x^2) + eps) * weight, math in fp32 (ops.rms_norm).

    A drop-in for torch.nn.RMSNorm (`normalized_shape`, `eps`, `elementwise_affine`, `weight`) and HF
    LlamaRMSNorm / MistralRMSNorm / Qwen2RMSNorm (`weight`, `variance_epsilon`, an alias of `eps`).

    casting: where the rounding to x's dtype happens (see ops.rms_norm):
      - "fp32" (default): one rounding at the end, the most accurate;
      - "llama": normalize in fp32, round, then multiply by the weight and round again, as HF
        LlamaRMSNorm does (use it when replacing an HF Llama/Mistral/Qwen2 norm so logits match HF);
      - "gemma": y = x̂ * (1 + weight), HF GemmaRMSNorm (weights stored as offsets from 1).
    eps: None means the eps of the dtype the norm is computed in, at each call: fp32's for fp32, bf16 and
      fp16 x, fp64's for fp64 (torch.nn.RMSNorm's default; not bf16's own, 7.8e-3).
    elementwise_affine=False: no weight (a unit scale).

    forward(x [..., N], residual=None) -> y, or (y, h) with h = x + residual (fused). Inputs fp32, bf16,
    fp16; the weight in x's dtype or fp32 (HF mixed precision). The output is in x's dtype (HF returns
    the fp32 product when an fp32 weight meets bf16/fp16 activations; fusekit rounds it to x's dtype,
    which is what the next bf16 Linear reads anyway). Gradients flow to x, residual and weight.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        *,
        casting: str = "fp32",
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        n = _last_dim(normalized_shape)
        if casting not in CASTINGS:
            raise ValueError(f"casting: must be one of {', '.join(CASTINGS)}, got {casting!r}")
        self.normalized_shape = (n,)
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        self.casting = casting
        self.backend = backends.prepare(backend)
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(n, device=device, dtype=dtype))
            self.reset_parameters()
        else:
            self.register_parameter("weight", None)

    # HF's norms call it variance_epsilon; code that reads or sets either name keeps working.
    @property
    def variance_epsilon(self) -> float | None:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float | None) -> None:
        self.eps = value

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        n = self.normalized_shape[0]
        _check_x(x, n)
        eps = self.eps if self.eps is not None else _default_eps(x.dtype)
        w = self.weight if self.weight is not None else torch.ones(n, dtype=x.dtype, device=x.device)
        return ops.rms_norm(x, w, eps, residual=residual, casting=self.casting, backend=self.backend)

    @classmethod
    def from_module(cls, module: nn.Module, *, casting: str | None = None, backend: str = "auto") -> RMSNorm:
        """A fusekit RMSNorm sharing `module`'s weight Parameter (torch.nn.RMSNorm or an HF RMSNorm).

        casting defaults to what the module computes: "fp32" for torch.nn.RMSNorm, "llama" / "gemma" for HF
        norms running LlamaRMSNorm's / GemmaRMSNorm's forward (their copies: Mistral, Qwen2/3, Phi3, Gemma2/3
        ...), the module's own for a fusekit RMSNorm. Any other class (Cohere's mean-subtracting norm, OLMo2's
        cast order) raises unless `casting` is given: its math is not guessed.
        """
        _refuse_parametrized(module, ("weight",))
        weight = getattr(module, "weight", None)
        if hasattr(module, "variance_epsilon"):
            eps = module.variance_epsilon
        elif hasattr(module, "eps"):
            eps = module.eps
        else:
            raise TypeError(f"module: {type(module).__name__} has neither `eps` nor `variance_epsilon`")
        if casting is None:
            if isinstance(module, RMSNorm):
                casting = module.casting
            elif class_forward(module) is nn.RMSNorm.forward:
                casting = "fp32"
            else:
                casting = hf_form(module, "norm")
            if casting is None:
                raise ValueError(
                    f"casting: {type(module).__name__} is neither torch.nn.RMSNorm nor an HF norm running "
                    f"LlamaRMSNorm's or GemmaRMSNorm's forward, so what it computes is unknown; pass casting= "
                    f"one of {CASTINGS} after checking it computes that"
                )
        if weight is not None and weight.dim() != 1:
            raise ValueError(
                f"module: fusekit normalizes over the last dimension only; {type(module).__name__}.weight has "
                f"shape {tuple(weight.shape)}"
            )
        n = weight.shape[0] if weight is not None else _last_dim(module.normalized_shape)
        new = cls(
            n,
            eps,
            elementwise_affine=weight is not None,
            casting=casting,
            backend=backend,
            device="meta",
        )
        if weight is not None:
            new.weight = weight  # the same Parameter: optimizer state, ties and hooks stay valid
        return new

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"casting={self.casting!r}, backend={self.backend!r}"
        )


class LayerNorm(nn.Module):
    """LayerNorm over the last dim as torch.nn.LayerNorm (biased variance, fp32 math; ops.layer_norm).

    A drop-in for torch.nn.LayerNorm with a one-dim `normalized_shape`: the same `weight`, `bias`, `eps`,
    `elementwise_affine` and `bias=` constructor flag. elementwise_affine=False: no weight and no bias.

    forward(x [..., N], residual=None) -> y, or (y, h) with h = x + residual (fused). Inputs fp32,
    bf16, fp16; weight and bias in x's dtype or fp32. Gradients flow to x, residual, weight and bias.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        n = _last_dim(normalized_shape)
        self.normalized_shape = (n,)
        self.eps = eps
        self.elementwise_affine = bool(elementwise_affine)
        self.backend = backends.prepare(backend)
        if self.elementwise_affine:
            self.weight = nn.Parameter(torch.empty(n, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.empty(n, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
            self.reset_parameters()
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        n = self.normalized_shape[0]
        _check_x(x, n)
        w = self.weight if self.weight is not None else torch.ones(n, dtype=x.dtype, device=x.device)
        return ops.layer_norm(x, w, self.bias, self.eps, residual=residual, backend=self.backend)

    @classmethod
    def from_module(cls, module: nn.LayerNorm, *, backend: str = "auto") -> LayerNorm:
        """A fusekit LayerNorm sharing a torch.nn.LayerNorm's weight and bias Parameters (or a fusekit
        LayerNorm's); a module with another forward raises (its math is not guessed)."""
        if not isinstance(module, LayerNorm) and class_forward(module) is not nn.LayerNorm.forward:
            raise TypeError(
                f"module: {type(module).__name__} does not run torch.nn.LayerNorm's forward; fusekit's LayerNorm "
                "wraps only that"
            )
        _refuse_parametrized(module, ("weight", "bias"))
        n = _last_dim(module.normalized_shape)
        affine = module.weight is not None
        new = cls(
            n,
            module.eps,
            elementwise_affine=affine,
            bias=getattr(module, "bias", None) is not None,
            backend=backend,
            device="meta",
        )
        if affine:
            new.weight = module.weight
            if module.bias is not None:
                new.bias = module.bias
        return new

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}, backend={self.backend!r}"
        )
