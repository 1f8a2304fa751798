"""Running an op from its spec: outputs, providers, the torch.library custom ops and autograd.

Every public op ends in `apply(spec, inputs, scalars, backend)` with flattened, contiguous, validated
inputs (inputs the spec marks `strided` may be views: they reach a provider that `reads_strides` as they
are when their last dim is contiguous, and as contiguous copies otherwise). Two ways through, one meaning:

- Eager with no gradient to record (no input requires grad, or grad mode is off): `run` directly —
  allocate the outputs, resolve the backend, call the provider. This skips the dispatcher's per-call
  cost on the inference hot path.
- Otherwise (an input requires grad, or torch.compile is tracing): the custom op
  `torch.ops.fusekit.<op>`, whose autograd formula (registered once per op, here) saves what the
  spec says and calls `torch.ops.fusekit.<op>_backward`. torch.compile(fullgraph=True) sees both as
  single nodes with fake implementations.

A call that needs a gradient resolves its backend for both phases before running anything, so a
backend without a backward raises naming op, backend and input instead of detaching silently.
Absent optional outputs travel through the custom ops as 0-element placeholders and come back as
None. Empty problems are answered here (outputs zero-filled), so providers never see them.
"""

from fusekit import outputs  # noqa: F401 - tests patch library.outputs.empty
from fusekit.library.autograd import _apply, apply, check_backend, register, specs
from fusekit.library.memo import (
    GradRunner,
    Runner,
    SizedRunner,
    apply_memo,
    call_key,
    clear_plans,
    key_slot,
    key_tensor,
    memo,
)
from fusekit.library.plan import _PLANS, _RECORD_TRIES, _launch, _refuse_first_call_in_capture, run
from fusekit.ops._spec import SAVE

__all__ = [
    "SAVE",
    "_PLANS",
    "_RECORD_TRIES",
    "GradRunner",
    "Runner",
    "SizedRunner",
    "_apply",
    "_launch",
    "_refuse_first_call_in_capture",
    "apply",
    "apply_memo",
    "call_key",
    "check_backend",
    "clear_plans",
    "key_slot",
    "key_tensor",
    "memo",
    "register",
    "run",
    "specs",
]
