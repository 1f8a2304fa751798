"""Concurrency (issue #15, item 4): every op × backend from 8 threads on 4 CUDA streams gives the serial bits.

    pytest tests/test_concurrency.py --device cuda --backends triton

For each op, every thread draws its own inputs (and output gradients) for a fixed list of calls: forward,
and forward + backward where the op has gradients, on a few cases of tests/cases/<op>.py. The lists are
first run serially on the default stream: the reference. Then 8 threads run their lists REPS times at
once, thread i inside `torch.cuda.stream(streams[i % 4])`, each call on fresh copies of its inputs made
on that stream, so a kernel launched on another stream than the current one would race with the copy.
Every result must equal the serial one bit for bit. Every path is deterministic, so no tolerance: the
Triton reduce_sum forward runs with deterministic=True (kernels_triton/reduce_sum.py `forward`: per-chunk
partials summed in a fixed order, no atomics); norm weight gradients, the FFN backward and attention
backward sum fixed-order partials; the Mojo kernels use no atomics. On the CPU the same test runs with
threads only (no streams), one small case per op and one repetition: seconds.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from dataclasses import dataclass, field

import pytest
import torch
from cases import module

from fusekit import ops

THREADS, STREAMS = 8, 4
REFUSED = ("cannot run", "has no backward here")  # a backend declaring it cannot run a case (skipped)


@dataclass
class Call:
    """One call of the list: inputs drawn once; `grads` (output gradients) drawn on the first run."""

    label: str
    args: tuple
    kwargs: dict
    backward: bool
    seed: int
    grads: list[torch.Tensor] | None = field(default=None)


def _plan(device: str) -> tuple[torch.dtype, int, int]:
    """(dtype, CPU cases per op, repetitions per thread); on CUDA one benchmark-sized case is added."""
    if device == "cuda":
        return torch.bfloat16, 2, 3  # float32 attention is CPU-only; bf16 runs every op
    return torch.float32, 1, 1  # fp32: the interpreter is slow, and attention has an fp32 kernel there


def _copy(v: object) -> object:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _floating(v: object) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _run(op: str, call: Call, backend: str) -> tuple[torch.Tensor | None, ...]:
    """The call on fresh copies of its inputs (made on the current stream); outputs, then input grads."""
    args = tuple(_copy(a) for a in call.args)
    kwargs = {k: _copy(v) for k, v in call.kwargs.items()}
    fn = getattr(ops, op)
    if not call.backward:
        out = fn(*args, **kwargs, backend=backend)
        return out if isinstance(out, tuple) else (out,)
    # every floating tensor argument is a leaf (not rope's cos/sin tables, not integers such as kv_len)
    leaves = [a.requires_grad_() for a in args if _floating(a)]
    leaves += [v.requires_grad_() for k, v in kwargs.items() if _floating(v) and k not in ("cos", "sin")]
    out = fn(*args, **kwargs, backend=backend)
    outs = out if isinstance(out, tuple) else (out,)
    ys = [o for o in outs if o.requires_grad]
    if call.grads is None:  # the serial run draws the output gradients (seeded, on the CPU)
        g = torch.Generator().manual_seed(call.seed)
        call.grads = [torch.randn(y.shape, generator=g).to(y.device, y.dtype) for y in ys]
    gin = torch.autograd.grad(ys, leaves, [_copy(g) for g in call.grads], allow_unused=True)
    return tuple(o.detach() for o in outs) + tuple(gin)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _differs(got: torch.Tensor | None, want: torch.Tensor | None) -> str | None:
    """Why `got` is not bit-identical to `want` (NaN payloads and signed zeros included), or None."""
    if got is None or want is None:
        return None if got is want else f"{got is None=} {want is None=}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
    if torch.equal(_bits(got), _bits(want)):
        return None
    diff = (got.double() - want.double()).abs().nan_to_num(nan=float("inf"))
    return f"max |diff| {diff.max().item():.3g} at {diff.argmax().item()} of {got.numel()}"


def _calls(op: str, device: str) -> tuple[list[list[Call]], int]:
    """Per thread, the fixed list of calls on its own inputs; and the repetitions."""
    mod = module(op)
    dtype, n_cpu, reps = _plan(device)
    cases = list(mod.CPU[:n_cpu]) + (list(mod.CUDA[:1]) if device == "cuda" else [])
    if dtype not in mod.DTYPES:
        dtype = mod.DTYPES[0]
    lists = []
    for t in range(THREADS):
        calls = []
        for j, case in enumerate(cases):
            phases = [False] + ([True] if dtype in mod.GRAD and case.get("grad", True) else [])
            for backward in phases:
                seed = 1000 * t + 10 * j + backward
                torch.manual_seed(seed)
                args, kwargs = mod.make(case, dtype, device)
                label = f"{op} case {j} {'forward+backward' if backward else 'forward'}"
                calls.append(Call(label, args, kwargs, backward, seed))
        lists.append(calls)
    return lists, reps


@pytest.mark.parametrize("op", ops.OPS)
def test_threads_and_streams_give_serial_bits(op: str, backend_name: str, device: str) -> None:
    cuda = device == "cuda"
    lists, reps = _calls(op, device)
    # serial reference, call by call (a call a backend refuses is left out of every thread's list)
    refs: dict[tuple[int, int], tuple] = {}
    keep, refused = [], []
    for j in range(len(lists[0])):
        try:
            for t in range(THREADS):
                refs[(t, j)] = _run(op, lists[t][j], backend_name)
        except ValueError as exc:
            if not any(r in str(exc) for r in REFUSED):
                raise
            refused.append(f"{lists[0][j].label}: {exc}")
            continue
        keep.append(j)
    if not keep:
        pytest.skip("; ".join(refused))

    streams = [torch.cuda.Stream() for _ in range(STREAMS)] if cuda else []
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # the inputs, drawn on the default stream, are ready
    results: dict[tuple[int, int, int], tuple] = {}
    errors: list[str] = []
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        try:
            start.wait(timeout=300)  # all threads launch at once
            with torch.cuda.stream(streams[t % STREAMS]) if cuda else contextlib.nullcontext():
                for rep in range(reps):
                    for j in keep:
                        results[(t, rep, j)] = _run(op, lists[t][j], backend_name)
        except BaseException:  # reported below, with the thread
            errors.append(f"thread {t}: {traceback.format_exc()}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if cuda:
        torch.cuda.synchronize()  # every stream's work done; all tensors stayed alive until here
    assert not errors, errors[0]
    assert len(results) == THREADS * reps * len(keep)
    bad = []
    for (t, rep, j), got in results.items():
        want = refs[(t, j)]
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            why = _differs(g, w)
            if why:
                bad.append(f"thread {t} (stream {t % STREAMS}) rep {rep} {lists[t][j].label} out {i}: {why}")
    assert not bad, f"{len(bad)} results differ from the serial run:\n" + "\n".join(bad[:10])


def test_a_first_call_on_a_busy_stream_shares_nothing_unfinished(backend_name: str, device: str) -> None:
    """A first call may build something later calls share (triton rope's inv_freq table per D and theta).
    Made on a stream still busy with earlier work, it must be finished before another stream's call reads
    it: the first call runs behind ~0.5 s of queued GPU sleep on stream 1, the next at once on stream 2
    (the table used to be cached as soon as its kernels were queued: stream 2 read unwritten memory)."""
    if device != "cuda":
        pytest.skip("streams need --device cuda")
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(15)
    x = torch.randn(1, 16, 8, 128, generator=gen).to(dev)  # [B, S, H, D]
    theta = 10000.0 + 1.0 * torch.randint(1, 1 << 20, (1,), generator=gen).item()  # a table no call made
    ref = ops.rope(x.double(), theta=theta, backend="torch").to(x.dtype)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with torch.cuda.stream(s1):
        junk = [torch.full((256,), float("nan"), device=dev) for _ in range(64)]  # NaN in freed blocks
        del junk
        torch.cuda._sleep(1 << 30)
        y1 = ops.rope(x, theta=theta, backend=backend_name)
    with torch.cuda.stream(s2):
        y2 = ops.rope(x, theta=theta, backend=backend_name)
    torch.cuda.synchronize()
    assert torch.equal(y1, y2), "the second stream's call differs from the first's"
    torch.testing.assert_close(y2, ref, rtol=1e-5, atol=1e-5)
