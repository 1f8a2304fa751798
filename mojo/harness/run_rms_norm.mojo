"""Harness entry for fusekit.rms_norm (fp32/fp16/bf16; checks + timing, see _normh.mojo)."""

from ._normh import norm_run


def run(bench: Bool = True) raises:
    norm_run[False](bench)
