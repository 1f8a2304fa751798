"""fusekit's benchmark harness: `python -m fusekit.bench --help`.

Every installed backend and the baselines (torch eager, torch.compile, CUB, cuBLAS, SDPA, MAX attention)
are checked for correctness first, then timed with cold caches; results carry GB/s, TFLOP/s and the
percentage of the copy-bandwidth / matmul ceilings measured in the same run.
"""
