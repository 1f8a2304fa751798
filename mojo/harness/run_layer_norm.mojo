"""Harness entry for fusekit.layer_norm and fusekit.layer_norm_backward (x f32/f16/bf16, w x or f32, with and
without residual / bias; checks + timing, see _normh.mojo)."""

from ._normh import norm_run


def run(bench: Bool = True) raises:
    norm_run[True](bench)
