"""Builds benchmarks/baselines/cub_sum.cu into a torch extension (nvcc, offline) and loads it.

The build is cached under <tmp>/fusekit_cub_<hash>, keyed by the source, the torch version and the GPU
architecture, so a second run in the same machine loads it in well under a second.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parents[3] / "benchmarks" / "baselines" / "cub_sum.cu"
_module = None


def load(verbose: bool = False):
    """The compiled module (with `.cub_sum(x)`); raises with the compiler's message if it cannot build."""
    global _module
    if _module is not None:
        return _module
    if not torch.cuda.is_available():
        raise RuntimeError("CUB baseline needs a CUDA GPU")
    if not SOURCE.is_file():
        raise FileNotFoundError(f"CUB baseline source missing: {SOURCE}")
    from torch.utils.cpp_extension import load as load_ext

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}.{minor}"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", arch)  # build for this GPU only: faster, no PTX JIT
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + arch.encode()).hexdigest()[:12]
    build_dir = Path(tempfile.gettempdir()) / f"fusekit_cub_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    _module = load_ext(
        name=f"fusekit_cub_sum_{key}",
        sources=[str(SOURCE)],
        extra_cuda_cflags=["-O3", "-std=c++17"],
        build_directory=str(build_dir),
        verbose=verbose,
    )
    return _module
