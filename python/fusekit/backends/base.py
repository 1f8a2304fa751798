"""The provider contract every fusekit backend implements.

The public API (`fusekit.ops`) validates arguments once, makes inputs contiguous, flattens leading
dims, allocates the outputs and then calls a provider in destination-passing style (outputs first,
as MAX's custom ops do). A provider therefore only ever sees:

- contiguous tensors on one device, with dtypes and shapes already checked;
- outputs it must fully overwrite (tests poison them with NaN first);
- non-empty problems (empty ones are answered by `fusekit.ops` without calling a provider).

Provider methods (all return None):

    reduce_sum(out[M], x[M, N])                    # out.dtype is the result dtype; fp32 accumulation
                                                   # for floating x (int64 for integer x); dim=None
                                                   # arrives as M == 1
    rms_norm(out[M, N], rstd[M] f32, x[M, N], weight[N], eps)
    layer_norm(out[M, N], mean[M] f32, rstd[M] f32, x[M, N], weight[N], bias[N] | None, eps)
    rope(out[B, S, H, D], x[B, S, H, D], cos[St, D/2] f32 | None, sin[St, D/2] f32 | None,
         start_pos, theta, interleaved)            # tables are indexed at row start_pos + s
    swiglu_ffn(out[T, D], x[T, D], w_gate[F, D], w_up[F, D], w_down[D, F], norm_weight[D] | None, eps)
    attention(out[B, H, S, D], q[B, H, S, D], k[B, Hkv, Skv, D], v[B, Hkv, Skv, D], causal, scale)
"""

from __future__ import annotations

import torch

OPS: tuple[str, ...] = ("reduce_sum", "rms_norm", "layer_norm", "rope", "swiglu_ffn", "attention")


class BackendUnavailable(RuntimeError):
    """The backend cannot be loaded here; the message says why and how to install it."""


class Backend:
    """Base class: subclasses set `name`, override `_load` and the op methods they implement."""

    name: str = ""
    install_hint: str = ""

    def __init__(self) -> None:
        self._checked = False
        self._reason: str | None = None

    # --- availability -------------------------------------------------------------------
    def _load(self) -> None:
        """Import what the backend needs; raise (any exception) when it cannot run here."""

    def unavailable_reason(self) -> str | None:
        """None when the backend can run here, else why not (with the install hint)."""
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
    def supports(self, op: str, device: torch.device, dtype: torch.dtype, **meta: object) -> str | None:
        """None if this backend runs `op` for these arguments, else the reason it does not.

        `meta` carries op-specific facts: `head_dim` for attention, `out_dtype` for reduce_sum.
        """
        if not hasattr(self, op):
            return f"backend {self.name!r} does not implement {op}"
        return None
