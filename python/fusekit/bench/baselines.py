"""Providers the harness times: every installed fusekit backend (called through `fusekit.ops`) and the
baselines they are compared against.

Generic baselines (every op): torch eager (the op module's `eager()` as is) and torch.compile of it.
Op-specific baselines (CUB, cuBLAS, SDPA, MAX attention, Liger-Kernel) are defined in the op's
`bench/cases/<op>.py` as `BASELINES`; this module only collects them.

A provider answers `available(device)` (None, or why it cannot run on this device at all: printed once
and recorded in the results' meta), `supports(case, device)` (None, or why it skips this case) and
`prepare(case, device)`: a callable of the public call's tensors returning its outputs (compilation,
graph building and layout conversions happen there or on the first call, outside the timed region).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from fusekit.bench import cases as C
from fusekit.bench.cases._base import Case

GENERIC_BASELINES: tuple[str, ...] = ("torch-eager", "torch-compile")


class Provider:
    """Base class. `kind` is "backend" (a fusekit backend) or "baseline"."""

    kind = "baseline"

    def __init__(self, name: str, description: str) -> None:
        self.name, self.description = name, description

    def available(self, device: torch.device) -> str | None:
        """None when this provider can run on `device` at all, else why not (said once per run)."""
        return None

    def supports(self, case: Case, device: torch.device) -> str | None:
        return None

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor | tuple]:
        raise NotImplementedError

    def mutates_inputs(self, case: Case) -> bool:
        """True when the provider writes into its input tensors (the harness then makes fresh ones)."""
        return False

    def tuning_mark(self) -> int:
        """A position in the provider's log of first-use measured choices (see `tuned_since`)."""
        return 0

    def tuned_since(self, mark: int) -> list[str]:
        """The choices measured since `mark` (a row records those of its case's first call)."""
        return []


# --- fusekit backends ---------------------------------------------------------------------------------
class BackendProvider(Provider):
    """A fusekit backend, called the way a user calls it: `fusekit.ops.<op>(..., backend=name)`."""

    kind = "backend"

    def __init__(self, name: str, backend) -> None:
        super().__init__(name, f"fusekit.ops.<op>(..., backend={name!r})")
        self.backend = backend

    def supports(self, case: Case, device: torch.device) -> str | None:
        dtypes, meta = case.backend_query()
        for phase in case.phases:
            why = self.backend.supports(case.op, phase, device, dtypes, **meta)
            if why is not None:
                return f"no {case.op} {phase} here: {why}"
        if self.name == "torch":  # the torch backend runs the reference itself
            return case.reference_limit()
        return None

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor | tuple]:
        return case.fusekit(self.name)

    def _log(self) -> list[str]:
        # the triton backend's (kernels_triton._config.TUNING_LOG), once its kernels are imported
        mod = sys.modules.get("kernels_triton._config") if self.name == "triton" else None
        return getattr(mod, "TUNING_LOG", [])

    def tuning_mark(self) -> int:
        return len(self._log())

    def tuned_since(self, mark: int) -> list[str]:
        return list(self._log()[mark:])


def backend_providers(wanted: list[str] | None = None) -> tuple[list[Provider], dict[str, str]]:
    """Installed backends as providers, and name -> reason for those that are not usable here."""
    from fusekit import backends

    skipped: dict[str, str] = {}
    out: list[Provider] = []
    for name, reason in backends.available().items():
        if wanted is not None and name not in wanted:
            continue
        if reason is not None:
            skipped[name] = reason
            continue
        out.append(BackendProvider(name, backends.get(name)))
    return out, skipped


# --- generic baselines ----------------------------------------------------------------------------------
class TorchEager(Provider):
    def __init__(self) -> None:
        super().__init__(
            "torch-eager",
            "eager torch: the op's reference (SPEC.reference), native-dtype matmuls for ffn/attention",
        )

    def supports(self, case: Case, device: torch.device) -> str | None:
        return case.reference_limit()

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor | tuple]:
        return case.eager()


class TorchCompile(TorchEager):
    def __init__(self) -> None:
        super().__init__()
        self.name = "torch-compile"
        self.description = (
            "torch.compile of the torch-eager baseline (dynamic=False, compiled per shape; "
            "train: the forward and backward graphs AOTAutograd makes of it)"
        )

    def prepare(self, case: Case, device: torch.device) -> Callable[..., torch.Tensor | tuple]:
        # A fresh static-shape compile per case: with automatic dynamic shapes (the default after the first
        # recompile) inductor drops its split reductions, and a 2^30-element sum ran 35x slower on the H200.
        # The reset also keeps dynamo's per-code-object recompile limit from silently falling back to eager.
        torch._dynamo.reset()
        return torch.compile(case.eager(), dynamic=False)


def all_baseline_names() -> tuple[str, ...]:
    """Every baseline name any op has, generic ones first."""
    names = list(GENERIC_BASELINES)
    for op in C.ops():
        names += [b.name for b in C.baselines(op) if b.name not in names]
    return tuple(names)


def baseline_providers(
    ops: list[str], wanted: list[str] | None, device: torch.device
) -> tuple[dict[str, list[Provider]], dict[str, str]]:
    """op -> the baselines to time for it (torch-eager, torch-compile, then the op's own), and
    name -> reason for each wanted baseline that cannot run on this device at all."""
    generic: list[Provider] = [TorchEager(), TorchCompile()]
    skipped: dict[str, str] = {}
    out: dict[str, list[Provider]] = {}
    for op in ops:
        provs = []
        for p in [*generic, *C.baselines(op)]:
            if wanted is not None and p.name not in wanted:
                continue
            why = p.available(device)
            if why is not None:
                skipped.setdefault(p.name, why)
                continue
            provs.append(p)
        out[op] = provs
    return out, skipped
