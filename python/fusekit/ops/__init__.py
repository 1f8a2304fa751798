"""The public ops. Every op takes `backend="auto" | "torch" | "triton" | "mojo"` and runs on CPU or CUDA.

Each op is one module, `fusekit/ops/<op>.py`: its spec (tensors, scalars, phases), argument checks,
the reference that defines it (forward and backward, what the `torch` backend runs) and the public
function. Inputs may be non-contiguous (they are made contiguous first), may have any number of
leading dimensions where the docstring says `...`, and may be empty (an empty input gives an empty
output). Outputs carry gradients where the op has one (see each docstring).
"""

from __future__ import annotations

import importlib
import pkgutil

from fusekit.ops._spec import OpSpec

# Every module here not starting with "_" is an op: adding `fusekit/ops/<op>.py` (with `SPEC` and a
# function named like the op) is all it takes to make `fusekit.ops.<op>` exist.
_MODULES = [
    importlib.import_module(f"{__name__}.{m.name}")
    for m in pkgutil.iter_modules(__path__)
    if not m.name.startswith("_")
]
SPECS: dict[str, OpSpec] = {m.SPEC.name: m.SPEC for m in _MODULES}
OPS: tuple[str, ...] = tuple(SPECS)
for _m in _MODULES:
    globals()[_m.SPEC.name] = getattr(_m, _m.SPEC.name)  # the public function replaces the module attribute

__all__ = ["OPS", "SPECS", *OPS]
