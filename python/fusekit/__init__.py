"""fusekit: one Python front end over interchangeable kernel backends (torch, Triton, Mojo/MAX).

    from fusekit import ops
    y = ops.<op>(..., backend="auto" | "torch" | "triton" | "mojo")   # see fusekit.ops.OPS

Importing fusekit imports torch only; triton, max and mojo load when a backend first needs them.
"""

from fusekit import backends, ops
from fusekit.outputs import poisoned

__version__ = "0.1.0"
__all__ = ["__version__", "backends", "ops", "poisoned"]
