"""Harness entry for fusekit.layer_norm (fp32/fp16/bf16, with/without bias; see _normh.mojo)."""

from ._normh import norm_run


def run(bench: Bool = True) raises:
    norm_run[True](bench)
