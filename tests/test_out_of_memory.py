"""Out of memory (issue #15, item 5): a call whose outputs cannot be allocated raises torch's
OutOfMemoryError naming the op and what it asked for, and the next call succeeds.

On the CPU the allocator is made to fail (a stand-in for a full GPU); with `--device cuda` the GPU is
really filled, and memory_allocated must come back to its value before the failed call.
"""

from __future__ import annotations

import gc

import pytest
import torch
from checks import Allocations

from fusekit import dispatch, ops


@pytest.mark.parametrize("remembered", (False, True))
def test_oom_names_op_and_size_and_next_call_works(monkeypatch: pytest.MonkeyPatch, remembered: bool) -> None:
    dispatch.clear_cache()
    x, w = torch.randn(8, 256), torch.randn(256)
    # return_rstd: both outputs are allocated (a remembered call that drops rstd writes it to scratch)
    if remembered:  # the second path: a validated signature's plan (library.Runner)
        ops.rms_norm(x, w, backend="torch", return_rstd=True)
    with Allocations(fail_at=2), pytest.raises(torch.OutOfMemoryError) as info:
        ops.rms_norm(x, w, backend="torch", return_rstd=True)
    msg = str(info.value)
    assert msg.startswith("fusekit.rms_norm (forward): out of memory allocating its outputs"), msg
    assert "(8, 256)" in msg and "GiB in all" in msg and "stand-in" in msg, msg
    y = ops.rms_norm(x, w, backend="torch")  # the next call succeeds
    assert torch.isfinite(y).all()


def test_oom_in_backward_names_the_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    y = ops.rms_norm(x, w, backend="torch")
    with (
        Allocations(fail_at=2),
        pytest.raises(torch.OutOfMemoryError, match=r"^fusekit\.rms_norm \(backward\)"),
    ):
        y.sum().backward()


def test_real_gpu_oom_frees_everything(device: str) -> None:
    if device != "cuda":
        pytest.skip("needs --device cuda")
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    n = 4096
    m = max(1, int(free * 0.3) // (n * 2))
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ops.rms_norm(x, w, backend="triton")  # warm (plan, compile)
    torch.cuda.empty_cache()  # the warm call's freed output would otherwise be reused from the cache
    free, _ = torch.cuda.mem_get_info()
    blocker = torch.empty(max(0, free - x.numel() * x.element_size() // 2), dtype=torch.uint8, device="cuda")
    gc.collect()  # garbage of earlier tests (cycles holding CUDA tensors) is freed before, not during, the count
    before = torch.cuda.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError, match=r"^fusekit\.rms_norm"):
        ops.rms_norm(x, w, backend="triton")
    gc.collect()
    assert torch.cuda.memory_allocated() == before  # nothing leaked
    del blocker
    y = ops.rms_norm(x, w, backend="triton")
    assert torch.isfinite(y[:: max(1, m // 64)]).all()  # a sample: isfinite(y) makes y-sized temporaries
