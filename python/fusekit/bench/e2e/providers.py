"""bench.e2e's providers: HF eager, torch.compile, fusekit's patch (and compiled), Liger-Kernel; counting the
fusekit kernel runs that prove a patched model ran them."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch import nn

from fusekit.bench.e2e.config import PROVIDERS, Setup


# --- providers ---------------------------------------------------------------------------------------
class Provider:
    """One way of running the model: how to make it, its forward, its generate, its evidence."""

    name = ""
    what = ""
    backend: str | None = None  # the fusekit backend whose kernel runs are counted
    ab = False  # suspend/resume can take the change off a prepared model and put it back (A/B rounds)

    def unavailable(self, setup: Setup) -> str | None:
        return None

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        """Change `model` in place; return the callable the forward scenarios call."""
        return model

    def generate_kwargs(self, setup: Setup) -> dict | str:
        """generate()'s extra arguments, or why this provider's decode is not timed here."""
        return {}

    def suspend(self, model: nn.Module) -> None:
        """Take this provider's change off `model` (and anything global): HF as is, for an A/B round."""
        raise NotImplementedError(f"{self.name} has no A/B rounds")

    def resume(self, model: nn.Module) -> None:
        """Put the change `suspend` took off back on."""
        raise NotImplementedError(f"{self.name} has no A/B rounds")

    def close(self) -> None:
        """Undo anything global (called after the provider's last row)."""


class Eager(Provider):
    name = "eager"

    def __init__(self, attn: str) -> None:
        self.what = f'transformers as is, attn_implementation="{attn}", no compile'


class Compile(Provider):
    name = "compile"
    what = (
        "torch.compile(model, dynamic=False) (inductor) for prefill and training; decode: "
        'generate(cache_implementation="static"), which transformers compiles itself on CUDA '
        '(CompileConfig default, mode "reduce-overhead")'
    )

    def unavailable(self, setup: Setup) -> str | None:
        if setup.device == "cpu" and not (
            os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        ):
            return "torch.compile (inductor) needs a C++ compiler on the CPU; none found"
        return None

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        return torch.compile(model, dynamic=False)

    def generate_kwargs(self, setup: Setup) -> dict | str:
        if setup.device != "cuda":
            return (
                "transformers 5 compiles generate's decode steps only on CUDA/XPU (static cache); on the CPU "
                "this would time eager decoding"
            )
        return {"cache_implementation": "static"}

    def close(self) -> None:
        torch._dynamo.reset()  # drop the graphs (and the references they hold) before the next provider


class Fusekit(Provider):
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.name = f"fusekit-{backend}"
        self.what = f'fusekit.hf.patch(model, backend="{backend}", strict=True)'

    def unavailable(self, setup: Setup) -> str | None:
        from fusekit import backends

        if self.backend not in backends.names():
            return f"unknown fusekit backend {self.backend!r} (known: {', '.join(backends.names())})"
        why = backends.get(self.backend).unavailable_reason()  # loads only this backend
        from kernels_triton._config import is_interpreter

        interpreted = is_interpreter()
        if why is None and self.backend == "triton" and setup.device == "cpu" and not interpreted:
            why = "triton runs on the CPU only in its interpreter: set TRITON_INTERPRET=1 before the run"
        return why

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        import fusekit.hf

        fusekit.hf.patch(model, backend=self.backend, strict=True)
        return model

    ab = True

    def suspend(self, model: nn.Module) -> None:
        import fusekit.hf

        fusekit.hf.unpatch(model)  # gives back HF's exact modules

    def resume(self, model: nn.Module) -> None:
        import fusekit.hf

        fusekit.hf.patch(model, backend=self.backend, strict=True)


class FusekitCompile(Fusekit):
    """fusekit.hf.patch, then compiled as the "compile" provider compiles HF."""

    ab = False  # a compiled model is not re-patched between rounds

    def __init__(self, backend: str) -> None:
        super().__init__(backend)
        self.name = f"fusekit-{backend}-compile"
        self.what = f'fusekit.hf.patch(model, backend="{backend}", strict=True), then: {Compile.what}'

    def unavailable(self, setup: Setup) -> str | None:
        return super().unavailable(setup) or Compile().unavailable(setup)

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        return torch.compile(super().prepare(model), dynamic=False)

    def generate_kwargs(self, setup: Setup) -> dict | str:
        return Compile().generate_kwargs(setup)

    def close(self) -> None:
        Compile().close()


_MISSING = object()  # an instance attribute a module did not have


class Liger(Provider):
    name = "liger"
    what = (
        "liger_kernel.transformers.apply_liger_kernel_to_llama(model=model), its defaults (rope, rms_norm, "
        "swiglu, fused linear cross entropy)"
    )

    ab = True
    # what apply_liger_kernel_to_llama(model=...) binds on module instances (its _bind_method_to_module)
    _BOUND = ("forward", "extra_repr", "_get_name")

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []  # (object, attribute, HF's value)
        self._liger: list[tuple[object, str, object]] = []  # (object, attribute, Liger's value)
        self._bound: list[tuple[nn.Module, list]] = []  # per patched module: what Liger bound (prepare)

    def unavailable(self, setup: Setup) -> str | None:
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger_kernel is not importable (pip install liger-kernel)"
        if setup.device != "cuda":
            return "Liger-Kernel's kernels are Triton GPU kernels; it has no CPU path"
        return None

    def prepare(self, model: nn.Module) -> Callable[..., object]:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.loss import loss_utils
        from transformers.models.llama import modeling_llama as ml

        # apply_liger_kernel_to_llama also rebinds module-level names (rope, RMSNorm, MLP classes, maybe
        # cross entropy): keep the originals, so later providers get an unpatched transformers.
        for obj, attr in (
            (ml, "apply_rotary_pos_emb"),
            (ml, "LlamaRMSNorm"),
            (ml, "LlamaMLP"),
            (ml.LlamaForCausalLM, "forward"),
            (loss_utils.nn.functional, "cross_entropy"),
        ):
            self._saved.append((obj, attr, getattr(obj, attr)))
        before = [(m, {k: m.__dict__.get(k, _MISSING) for k in self._BOUND}) for m in model.modules()]
        apply_liger_kernel_to_llama(model=model)
        self._liger = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in self._saved]
        # per module, each instance attribute Liger bound or replaced: (name, HF's value or _MISSING,
        # Liger's value); only what apply changed, so nothing of HF's own is ever touched
        self._bound = []
        for m, old in before:
            changed = [(k, v, m.__dict__[k]) for k, v in old.items() if m.__dict__.get(k, _MISSING) is not v]
            if changed:
                self._bound.append((m, changed))
        return model

    def suspend(self, model: nn.Module) -> None:
        """HF as is: the instance methods Liger bound put back as they were (the classes' own apply
        again), the module-level names it rebound restored. The attributes it added (casting_mode, offset,
        ...) stay: HF's forwards never read them."""
        for m, changed in self._bound:
            for k, hf, _ in changed:
                if hf is _MISSING:
                    m.__dict__.pop(k, None)
                else:
                    m.__dict__[k] = hf
        for obj, attr, value in self._saved:
            setattr(obj, attr, value)

    def resume(self, model: nn.Module) -> None:
        for m, changed in self._bound:
            for k, _, liger in changed:
                m.__dict__[k] = liger
        for obj, attr, value in self._liger:
            setattr(obj, attr, value)

    def close(self) -> None:
        for obj, attr, value in reversed(self._saved):
            setattr(obj, attr, value)
        self._saved.clear()
        self._liger.clear()
        self._bound.clear()


def make_providers(names: list[str], setup: Setup) -> list[Provider]:
    out: list[Provider] = []
    for n in names:
        if n == "eager":
            out.append(Eager(setup.attn_implementation))
        elif n == "compile":
            out.append(Compile())
        elif n == "liger":
            out.append(Liger())
        elif n.startswith("fusekit-") and n.endswith("-compile"):
            out.append(FusekitCompile(n.removeprefix("fusekit-").removesuffix("-compile")))
        elif n.startswith("fusekit-"):
            out.append(Fusekit(n.removeprefix("fusekit-")))
        else:
            raise ValueError(f"unknown provider {n!r}; valid: {', '.join(PROVIDERS)}")
    return out


@contextlib.contextmanager
def kernel_runs(backend: str | None) -> Iterator[Counter]:
    """Counts "<op>:<phase>" for every planned call whose kernels run on fusekit backend `backend`
    (library._launch: through the provider or a launch replay of it): evidence that the patched model
    ran fusekit, not HF's modules or sdpa. Counting provider.run alone misses replayed calls."""
    counts: Counter = Counter()
    if backend is None:
        yield counts
        return
    from fusekit.library import plan as library_plan

    real = library_plan._launch

    def counting(spec, phase, plan, *args, **kwargs):
        if plan.provider is not None and plan.provider.name == backend:
            counts[f"{spec.name}:{phase}"] += 1
        return real(spec, phase, plan, *args, **kwargs)

    library_plan._launch = counting  # _execute looks the module global up on every call
    try:
        yield counts
    finally:
        library_plan._launch = real


def expected_forward_runs(layers: int) -> dict[str, int]:
    return {
        "rms_norm:forward": 2 * layers + 1,
        "rope:forward": layers,  # q and k in one call
        "attention:forward": layers,
        "swiglu_ffn:forward": layers,
    }


def _classify(exc: BaseException) -> tuple[str, str]:
    """("skipped", why) for what a provider cannot run here (backend missing, op or config unsupported),
    else ("failed", the error)."""
    from fusekit.backends import BackendUnavailable

    msg = f"{type(exc).__name__}: {exc}".strip()
    msg = msg if len(msg) <= 600 else msg[:600] + " ..."
    unsupported = isinstance(exc, BackendUnavailable) or (
        isinstance(exc, ValueError)
        and any(k in str(exc) for k in ("backend: ", "not supported", "does not support", "has no backward"))
    )
    return ("skipped" if unsupported else "failed"), msg
