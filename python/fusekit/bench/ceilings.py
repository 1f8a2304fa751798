"""The two ceilings every result is judged against, measured in the same run on the same device:
device-to-device copy bandwidth (bytes read + bytes written) and the bf16 matrix-product rate on
random data (fp32 on the CPU, where bf16 matmul is not the fast path)."""

from __future__ import annotations

import torch

from fusekit.bench.timing import bench_ms


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> dict:
    """GB/s of `dst.copy_(src)` counting read + write; 2 GiB on a GPU (far past the L2)."""
    if nbytes is None:
        nbytes = 2 * 2**30 if device.type == "cuda" else 64 * 2**20
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms, method = bench_ms(lambda: dst.copy_(src), device)
    assert torch.equal(dst, src), "copy ceiling: the copy did not copy"
    gbps = 2 * nbytes / (ms * 1e-3) / 1e9
    return {"name": "copy", "gbps": gbps, "bytes": 2 * nbytes, "time_us": ms * 1e3, "method": method}


def matmul_peak(device: torch.device, n: int | None = None) -> dict:
    """TFLOP/s of an n×n×n product on random inputs (zeros run faster and would flatter the peak)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    ms, method = bench_ms(lambda: a @ b, device)
    tflops = 2 * n**3 / (ms * 1e-3) / 1e12
    return {
        "name": f"{str(dtype).removeprefix('torch.')} matmul {n}^3",
        "tflops": tflops,
        "time_us": ms * 1e3,
        "method": method,
    }


def measure(device: torch.device) -> dict:
    """Both ceilings plus the ridge point (FLOP/byte where the roofline bends)."""
    bw = copy_bandwidth(device)
    mm = matmul_peak(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy": bw, "matmul": mm, "ridge_flop_per_byte": mm["tflops"] * 1e12 / (bw["gbps"] * 1e9)}
