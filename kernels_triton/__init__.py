"""Triton kernels for fusekit: one file per op, each exporting a destination-passing launcher and `aot_specs()`."""
