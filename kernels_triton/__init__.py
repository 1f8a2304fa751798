"""Triton kernels for fusekit: one file per op, each exporting a destination-passing launcher and `aot_specs()`.

Under Triton's CPU interpreter (TRITON_INTERPRET=1) importing the package corrects the interpreter's bf16
rounding and bf16 tl.dot first (`_interpreter.install`), so the kernels compute there what they compute on
a GPU.
"""

from kernels_triton._config import is_interpreter as _is_interpreter

if _is_interpreter():
    from kernels_triton import _interpreter

    _interpreter.install()
