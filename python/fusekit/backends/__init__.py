"""The backend registry: which providers exist, which can run here, and why the others cannot.

Backends are imported lazily: `import fusekit` never imports triton, max or mojo. A backend module is
loaded the first time it is asked for, and its `unavailable_reason()` carries the import error and the
install command when it cannot run.
"""

from __future__ import annotations

import importlib

import torch as _torch  # not `torch`: loading the provider fusekit.backends.torch binds that name here

from fusekit.backends.base import LOAD_LOCK, Backend, BackendUnavailable

# name -> "module:Class"; the order is the order `available()` lists them in.
_REGISTRY: dict[str, str] = {
    "torch": "fusekit.backends.torch:TorchBackend",
    "triton": "fusekit.backends.triton:TritonBackend",
    "mojo": "fusekit.backends.mojo:MojoBackend",
}
_INSTANCES: dict[str, Backend] = {}

__all__ = ["Backend", "BackendUnavailable", "available", "forget_unavailable", "get", "names", "prepare"]


def names() -> tuple[str, ...]:
    """Every backend fusekit knows, installed or not."""
    return tuple(_REGISTRY)


def _instantiate(name: str) -> Backend:
    b = _INSTANCES.get(name)
    if b is not None:
        return b
    with LOAD_LOCK:  # one instance per name, also when threads make their first calls at once
        if name not in _INSTANCES:
            module_name, cls_name = _REGISTRY[name].split(":")
            try:
                cls = getattr(importlib.import_module(module_name), cls_name)
                _INSTANCES[name] = cls()
            except ImportError as exc:  # the provider module itself is missing or broken
                _INSTANCES[name] = _Missing(name, f"{type(exc).__name__}: {exc}")
        return _INSTANCES[name]


def unknown(what: str, name: object) -> ValueError:
    """The error for a backend name that is none of "auto" and the registered ones (`what` names its source)."""
    return ValueError(f"{what}: unknown backend {name!r}; valid names are: {', '.join(['auto', *_REGISTRY])}")


def get(name: str) -> Backend:
    """The backend object for `name`; ValueError listing the valid names for an unknown one."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise unknown("backend", name)
    if _torch.compiler.is_compiling():  # before the trace reads _INSTANCES (dynamo keeps what it read)
        _load_untraced(name)  # dynamo runs it as it stands: no import inside the trace
    return _instantiate(name)


def _load_untraced(name: str) -> bool:
    """Load backend `name` where torch.compile traces a first call (a grad call resolves its backend while
    being traced): dynamo calls this function itself instead of tracing it, since its module imports
    would fail the trace ("Attempted to call function marked as skipped")."""
    _instantiate(name).unavailable_reason()
    return True


# torch.compiler.assume_constant_result(_load_untraced), whose import of torch._dynamo would import triton
# with `import fusekit` (the decorator sets only this flag, torch 2.0 to 2.13).
_load_untraced._dynamo_marked_constant = True


# What "auto" may pick that is cheap to load up front (mojo stays lazy: loading MAX can set up its
# device context and memory pool, which a model that never runs mojo should not pay for).
_PREPARE_AUTO = ("triton", "torch")


def prepare(name: str) -> str:
    """Load backend `name` (for "auto": triton and torch) now, outside any torch.compile trace, and
    return `name`. Modules and fusekit.hf.patch call this when they are built: a backend's first load
    imports modules, which inside a trace is a graph break baked into the compiled frames (the H200 run
    of a compiled patched Llama hit dynamo's recompile limit in library._apply after such breaks).
    Unknown names are left to the call, which raises naming them."""
    for n in _PREPARE_AUTO if name == "auto" else (name,):
        if n in _REGISTRY:
            _instantiate(n).unavailable_reason()
    return name


def forget_unavailable() -> None:
    """Drop the backends that could not run, so the next use checks them again (one installed since)."""
    for name in [n for n, b in _INSTANCES.items() if b._checked and b._reason is not None]:
        del _INSTANCES[name]  # (an unchecked one is left unchecked: checking mojo imports MAX)


def available() -> dict[str, str | None]:
    """name -> None for each backend that can run here, or the reason it cannot (with how to install)."""
    return {name: _instantiate(name).unavailable_reason() for name in _REGISTRY}


class _Missing(Backend):
    """Stands in for a backend whose provider module could not be imported."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__()
        self.name = name
        self._checked, self._reason = True, reason
