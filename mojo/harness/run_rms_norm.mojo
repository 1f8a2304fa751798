"""Harness entry for fusekit.rms_norm and fusekit.rms_norm_backward (x f32/f16/bf16, w x or f32; checks +
timing, see _normh.mojo)."""

from ._normh import norm_run


def run(bench: Bool = True) raises:
    norm_run[False](bench)
