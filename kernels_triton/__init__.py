"""Triton kernels for fusekit: one file per op, each exporting a destination-passing launcher and `aot_specs()`.

Under Triton's CPU interpreter (TRITON_INTERPRET=1) importing the package corrects the interpreter's bf16
rounding and bf16 tl.dot first (`_interpreter.install`), so the kernels compute there what they compute on
a GPU.
"""

import os as _os

if _os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from kernels_triton import _interpreter

    _interpreter.install()
