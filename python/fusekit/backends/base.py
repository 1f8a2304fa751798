"""The provider contract every fusekit backend implements.

The library (`fusekit.library`) validates arguments once, makes inputs contiguous, flattens leading
dims, allocates the outputs and then calls a provider in destination-passing style (outputs first,
as MAX's custom ops do), for any op, from its spec (`fusekit.ops.<op>.SPEC`):

    run(spec, phase, outputs, inputs, scalars)     # phase: "forward" or "backward"

A provider therefore only ever sees:
- contiguous tensors on one device, with dtypes and shapes already checked, in the order of
  `spec.phase(phase).outputs` / `.inputs`; an absent optional tensor is None. Exception: an input the
  spec marks `strided` (attention's k/v, read in place from a KV cache) reaches a provider that sets
  `reads_strides = True` as the caller's view, with its last dim contiguous (stride 1); and an output
  the spec lays out like an input (`TensorArg.like`: attention's o in q's memory order) reaches a
  provider that sets `writes_strides = True` with those strides (last dim contiguous);
- outputs it must fully overwrite (tests poison them with NaN first);
- non-empty problems (empty ones are answered by the library without calling a provider).
"""

from __future__ import annotations

import threading

import torch

# Serializes backends' first loads (and backends.get's first instantiation): re-entrant, as a load may
# look at another backend.
LOAD_LOCK = threading.RLock()


class BackendUnavailable(RuntimeError):
    """The backend cannot be loaded here; the message says why and how to install it."""


class Backend:
    """Base class: subclasses set `name`, override `_load`, `supports` and `run`."""

    name: str = ""
    install_hint: str = ""
    # True: the kernels read `strided` spec inputs through their strides (last dim contiguous), so the
    # library passes such views without copying them; False: the library makes them contiguous first.
    reads_strides: bool = False
    # True: the kernels write `like` spec outputs through their strides; False: the provider fills
    # contiguous buffers and the library copies them into the outputs.
    writes_strides: bool = False
    # True: a signature's first call may compile, tune (time candidates, synchronize) or allocate a
    # workspace, none of which a CUDA graph capture allows; the library refuses such a first call inside
    # a capture with a clear error instead of corrupting the capture (warm up first, as torch requires).
    first_call_setup: bool = False
    # False: every call inside a CUDA graph capture is refused (mojo: MAX runs on its own stream), so
    # backend="auto" skips this backend while a capture is running.
    capture_safe: bool = True

    def __init__(self) -> None:
        self._checked = False
        self._reason: str | None = None

    # --- availability -------------------------------------------------------------------
    def _load(self) -> None:
        """Import what the backend needs; raise (any exception) when it cannot run here."""

    def unavailable_reason(self) -> str | None:
        """None when the backend can run here, else why not (with the install hint). Loads once: threads
        making their first calls at once wait for one `_load` (each ran its own: 8 mojo compilers and
        sessions for 8 threads)."""
        if not self._checked:
            with LOAD_LOCK:
                if not self._checked:
                    try:
                        self._load()
                    except Exception as exc:
                        self._reason = f"{type(exc).__name__}: {exc}".strip()
                        if self.install_hint:
                            self._reason += f" (install with: {self.install_hint})"
                    self._checked = True
        return self._reason

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    # --- capability ---------------------------------------------------------------------
    def supports(
        self, op: str, phase: str, device: torch.device, dtypes: tuple[torch.dtype, ...], **meta: object
    ) -> str | None:
        """None if this backend runs `phase` of `op` for these arguments, else the reason it does not.

        `dtypes` are the op's dtype variables in `spec.dtype_vars` order (x first); `meta` carries
        op-specific facts from `spec.meta` (head_dim for attention, tables for rope, ...).
        """
        return f"backend {self.name!r} implements no ops"

    def run(self, spec, phase: str, outputs: tuple, inputs: tuple, scalars: tuple) -> None:
        raise NotImplementedError

    def record(self, spec, phase: str, outputs: tuple, inputs: tuple, scalars: tuple):
        """`run` once; a backend that can replay this call's launches without its launcher Python returns
        a `replay(outputs, inputs) -> bool` for the library to use on later calls of the same plan
        (False: this call cannot be replayed, run normally). Default: no replay."""
        self.run(spec, phase, outputs, inputs, scalars)
        return None
