#!/usr/bin/env python3
"""Which variant of the attention-backward TMA pattern hangs an H100 (Triton 3.6)? Standalone probe, written
after session 55's hang (kernels_triton/attention_backward.TMA_MIN_LEN); `python benchmarks/gpu_checks/tma_hang.py`.
The real_fixed_* cases passed on the H200 in session 58 and the gate went (1bdac17): the autotuners offer TMA
at any length, so the cases below that once forced TMA_MIN_LEN to 0 need nothing forced.

Run from a checkout's root (the `real_*` cases import kernels_triton from there; they are skipped when it is
not importable):   python benchmarks/gpu_checks/tma_hang.py [--cases a,b,...] [--timeout 20] [--budget 110] [--iters N]

Each case runs in its own subprocess under a timeout; a case that does not return is reported HANG with its
last progress line (so you can tell "first launch" from "launch k of N"). Cases run in priority order and
new ones stop being started when --budget seconds have passed (the rest are SKIPPED).

Hypotheses and the cases that isolate them (minimal kernel `_mini`: one k tile held, q tiles streamed in two
loops like _bwd_dkdv_kernel: an unmasked loop with runtime trip count N_U and a masked one with N_MASK;
device-side descriptors unless said otherwise; grid = 1 program unless said otherwise):
  H1 software pipelining of descriptor loads in a loop with runtime trip count 0 / 1:
       mini_s3            N_U=0 N_MASK=1, num_stages=3, box 64 rows over a 32-row tensor (the hung shape)
       mini_s1            same, num_stages=1 (no pipelining)
       mini_s3_noloop1    same as mini_s3 without the first (zero-trip) loop
       mini_s3_u1         N_U=1 N_MASK=0 (the S=64 pattern that completed)
       mini_s3_div        mini_s3 plus the real kernel's `g = it // n` index math over a count known >= 0
                          (division by a 0 trip count is computed, unpredicated, in the pipeliner's prologue)
       mini_s3_divfix     mini_s3_div with the fix's divisor max(n, 1)
  H0 (found on the CPU afterwards, Triton 3.6's sm_90 LLVM IR of _bwd_dkdv_kernel at S 32 Skv 64): H1's
     division. `0 // n_u` in the prologue is undefined behaviour for n_u = 0; with n_u >= 0 known LLVM folds
     the prologue's `n_u > 0` predicate to true, so the first stage's q/do TMA loads are issued though the
     loop runs 0 times, never waited for, and their mbarriers are invalidated and re-initialized (same shared
     memory) for the masked loop with the transaction in flight. mini_s3_div compiles to exactly that (one
     unpredicated loop-1 TMA load); mini_s3 and mini_s3_divfix do not. Expect mini_s3_div to hang or be flaky
     (a race), the others and the real_fixed_* cases (the repository's kernel, now dividing by max(n, 1)) to
     pass. tests/test_triton_attention_grad.py::test_dkdv_prologue_loads_stay_predicated checks the kernel's
     compiled code on the CPU.
  H2 a box whose rows exceed the tensor's global rows:
       mini_s3_fitbox     mini_s3 with a 64-row tensor (box == tensor) and the same trip counts
  H3 device-side descriptor creation (tensormap written to global scratch, fenced) vs host-side:
       mini_s3_host       mini_s3 with host-side TensorDescriptor (kernel params), no global scratch
  H4 stale tensormap: Triton's global scratch is freed after each launch and torch's caching allocator hands
     the next launch (another kernel / config) the *same* address; with 1-2 programs the same SM re-creates a
     descriptor at the same address whose previous contents had another box size -> if the tensormap-proxy
     acquire did not take, the TMA unit uses the old box and the mbarrier's expect_tx never balances (hang):
       mini_alt_box       alternate launches: box 32 rows / box 64 rows, same scratch address (grid 1)
       mini_alt_box_fresh same, but the allocator never reuses an address (all scratch kept alive)
       mini_alt_box_wide  same as mini_alt_box with 528 programs (many descriptors per SM)
  The real kernels (kernels_triton.attention_backward, forced tiles (dkdv, dq)), fp16 D64 B1 H1 non-causal:
       real_fixed_sweep   the fixed kernel, forced dk/dv TMA tiles (64x64 w4 s3, 32x128 w4 s3; dq TMA 128x64)
                          at every small shape class that hung or could (S 12-48 against Skv 16-80, causal and
                          not), each launched repeatedly and checked against the pointer tiles
       real_fixed_autotune the original failure with the fix: autotuned backward, TMA_MIN_LEN forced to 0,
                          S 12-32 against Skv 16-80 non-causal (and causal), fresh process, repeated calls
       real_s32_ptrdq     dkdv TMA 64x64 w4 s3, dq pointer tile: S=32 Skv=64 (hung once forced)
       real_s32_tmadq     dkdv TMA 64x64 w4 s3, dq TMA 128x64 w8 s3 (box 128 at slot 0: H4 mismatch)
       real_s32_s1        dkdv TMA 64x64 w4 s1, dq pointer (H1 on the real kernel)
       real_s32_fresh     real_s32_tmadq with the never-reuse allocator (H4 on the real kernel)
       real_s32_32x128    dkdv TMA 32x128 w4 s3 (the autotuner's third dk/dv config)
       real_s12           S=12 Skv=16 dkdv TMA 64x64 s3, dq TMA 128x64 (completed once)
       real_autotune_s24  the original failure: autotuned backward with TMA_MIN_LEN forced to 0, S=24 Skv=80
       real_s128          S=Skv=128 B1 H1 (now offered by the autotuner): both TMA tiles, repeated
       real_s128_autotune autotuned at S=Skv=128 B1 H1 (TMA offered since 8c75690), fresh process
       real_big           S=Skv=1024 B1 H8, both TMA tiles, repeated (many programs)
  The forward (attention.py; its autotuner now takes TMA_MIN_LEN too, forced back to 0 here), D128:
       real_fwd_d128_s32      autotuned forward, fp16 D128 B1 H1 S=32 Skv=64 non-causal, repeated
       real_fwd_d128_s32_tma  forced forward TMA tile (64, 64, 4, 3, True), same shape
  The Gluon kernels (_attention_hopper.py, _attention_hopper_bwd.py; sm_90 only, bf16), at the edge shapes the
  GPU tests do not cover (S = Skv = 1: both specialized to constants; S < 64: the second 64-row Q box wholly
  past S; Skv == BLOCK_N; S >> Skv causal: query blocks that see no key run one all-masked tile, dq blocks load
  no K/V tile; S << Skv causal: dk/dv key blocks no query sees run no step; GQA 8:1), each shape launched
  repeatedly into NaN-poisoned outputs and compared with float32 torch on the GPU:
       gluon_fwd_edges        hopper_forward, D64/128/256, one-tile kernel and the persistent one (grid as
                              planned and capped at 1 CTA: every work tile through one ring)
       gluon_bwd_edges        hopper_backward, D64/128, plus the split dk/dv (FUSEKIT_HOPPER_BWD_SPLIT=2)
       gluon_fwd_stage1       FUSEKIT_HOPPER_ATTN_CFG=64,1,1: one K/V stage with K_EARLY (the one-stage ring
                              _env_config still accepts; without K_EARLY it deadlocks and is refused)
A HANG whose last line is "compiling / first ..." may be a slow compile: rerun that case with --timeout 90.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import triton
import triton.language as tl
from _isolated import run_case  # benchmarks/gpu_checks/_isolated.py (the script's folder is on sys.path)

CASES = [  # priority order: the most telling first (the budget may cut the tail)
    "real_fixed_sweep", "real_fixed_autotune", "mini_s3_div", "mini_s3_divfix",
    "mini_s3", "mini_s1", "mini_s3_fitbox", "mini_s3_host", "mini_alt_box", "mini_alt_box_fresh",
    "real_s32_tmadq", "real_s32_fresh", "real_s32_ptrdq", "real_s32_s1", "real_autotune_s24",
    "real_s128_autotune", "mini_s3_noloop1", "mini_s3_u1", "mini_alt_box_wide",
    "real_s32_32x128", "real_s12", "real_s128", "real_big", "real_fwd_d128_s32", "real_fwd_d128_s32_tma",
    "gluon_fwd_edges", "gluon_bwd_edges", "gluon_fwd_stage1",
]  # fmt: skip
SLOW = {
    "real_fixed_sweep": 180.0,
    "real_fixed_autotune": 240.0,
    "real_autotune_s24": 60.0,
    "real_s128_autotune": 60.0,
    "real_fwd_d128_s32": 60.0,
    "gluon_fwd_edges": 300.0,  # ~10 Gluon variants to compile
    "gluon_bwd_edges": 300.0,
    "gluon_fwd_stage1": 120.0,
}  # autotuning compiles 6 configs: own timeout


# ------------------------------------------------------------------------------------------------ child side
def _progress(msg: str) -> None:
    print(msg, flush=True)


@triton.jit
def _body(q_desc, k_desc, out_ptr, n_rows, n_u, n_mask, BM: tl.constexpr, BN: tl.constexpr,
          D: tl.constexpr, FIRST_LOOP: tl.constexpr, DIV: tl.constexpr):  # fmt: skip
    k = k_desc.load([0, 0])
    acc = tl.zeros([BN, D], dtype=tl.float32)
    if DIV:  # the real kernel's block count is provably >= 0 (max(.., 0) // BLOCK_M); LLVM needs that too
        n_u = tl.maximum(n_u, 0)
    if FIRST_LOOP:
        for it in range(0, n_u):
            if DIV:  # the real kernel's (head, block) split of a flat index: it // n_u (DIV 2: the fix's
                g = it // tl.maximum(n_u, 1) if DIV == 2 else it // n_u  # divisor clamped to >= 1)
                m = (it - g * n_u) * BM
            else:
                m = it * BM
            q = q_desc.load([m, 0])
            st = tl.dot(k, tl.trans(q))
            acc = tl.dot(st.to(q.dtype), q, acc)
    for it in range(0, n_mask):
        if DIV:
            g = it // n_mask
            m = n_u * BM + (it - g * n_mask) * BM
        else:
            m = n_u * BM + it * BM
        q = q_desc.load([m, 0])
        rows = m + tl.arange(0, BM)
        q = tl.where((rows < n_rows)[:, None], q, 0.0)  # q through registers, as the masked step
        st = tl.dot(k, tl.trans(q))
        acc = tl.dot(st.to(q.dtype), q, acc)
    offs = tl.program_id(0) * BN * D + tl.arange(0, BN)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + offs, acc)


@triton.jit(do_not_specialize=["n_u", "n_mask"])  # runtime trip counts, as the real kernel's
def mini_device(q_ptr, k_ptr, out_ptr, n_rows, L, n_u, n_mask, BM: tl.constexpr, BN: tl.constexpr,
                D: tl.constexpr, FIRST_LOOP: tl.constexpr, DIV: tl.constexpr):  # fmt: skip
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[n_rows, D], strides=[D, 1], block_shape=[BM, D])
    _body(q_desc, k_desc, out_ptr, n_rows, n_u, n_mask, BM, BN, D, FIRST_LOOP, DIV)


@triton.jit(do_not_specialize=["n_u", "n_mask"])  # runtime trip counts, as the real kernel's
def mini_host(q_desc, k_desc, out_ptr, n_rows, n_u, n_mask, BM: tl.constexpr, BN: tl.constexpr,
              D: tl.constexpr, FIRST_LOOP: tl.constexpr, DIV: tl.constexpr):  # fmt: skip
    _body(q_desc, k_desc, out_ptr, n_rows, n_u, n_mask, BM, BN, D, FIRST_LOOP, DIV)


def _kernels():
    return mini_device, mini_host


class _Alloc:
    """Triton's global-scratch allocator on torch: `reuse` False keeps every block alive (no address reuse)."""

    def __init__(self, reuse: bool) -> None:
        self.reuse, self.kept, self.addrs = reuse, [], set()

    def __call__(self, size: int, alignment: int, stream):
        import torch

        t = torch.empty(size + 128, device="cuda", dtype=torch.int8)
        off = (-t.data_ptr()) % 128
        t = t[off : off + size]
        self.addrs.add(t.data_ptr())
        if not self.reuse:
            self.kept.append(t)
        return t


def _mini(case: str, iters: int) -> None:
    import torch
    import triton

    mini_device, mini_host = _kernels()
    alloc = _Alloc(reuse=not case.endswith("_fresh"))
    triton.set_allocator(alloc)
    D, BN = 64, 64
    dt = torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    stages = 1 if case == "mini_s1" else 3
    n_rows, L, n_u, n_mask = 32, 64, 0, 1  # S=32 (< 64-row box), Skv=64: the hung forced shape
    first, div, bm = True, 0, 64
    if case == "mini_s3_noloop1":
        first = False
    if case == "mini_s3_u1":
        n_rows, n_u, n_mask = 64, 1, 0
    if case == "mini_s3_div":
        div = 1
    if case == "mini_s3_divfix":
        div = 2
    if case == "mini_s3_fitbox":
        n_rows = 64  # the box fits; trip counts as the hung shape (0, 1)
    q = torch.randn(max(n_rows, 1), D, device="cuda", dtype=dt, generator=g)
    k = torch.randn(L, D, device="cuda", dtype=dt, generator=g)
    grid = 528 if case == "mini_alt_box_wide" else 1
    out = torch.empty(grid * BN * D, device="cuda", dtype=torch.float32)

    def launch(bm_: int) -> None:
        if case == "mini_s3_host":
            from triton.tools.tensor_descriptor import TensorDescriptor

            qd = TensorDescriptor(q, [n_rows, D], [D, 1], [bm_, D])
            kd = TensorDescriptor(k, [L, D], [D, 1], [BN, D])
            mini_host[(grid,)](qd, kd, out, n_rows, n_u, n_mask, BM=bm_, BN=BN, D=D, FIRST_LOOP=first,
                               DIV=div, num_warps=4, num_stages=stages)  # fmt: skip
        else:
            mini_device[(grid,)](q, k, out, n_rows, L, n_u, n_mask, BM=bm_, BN=BN, D=D, FIRST_LOOP=first,
                                 DIV=div, num_warps=4, num_stages=stages)  # fmt: skip

    alt = case.startswith("mini_alt_box")
    sizes = (32, 64) if alt else (bm,)
    for b in sizes:  # compile + one checked launch each
        _progress(f"compiling / first launch BM={b} ...")
        launch(b)
        torch.cuda.synchronize()
        _progress(f"first launch BM={b} ok")
    for i in range(iters):
        launch(sizes[i % len(sizes)])
        if i % 200 == 199:
            torch.cuda.synchronize()
            _progress(f"launch {i + 1}/{iters} ok")
    torch.cuda.synchronize()
    _progress(f"done: {iters} launches, {len(alloc.addrs)} distinct scratch addresses")


def _repeat(launch, iters: int, what: str) -> None:
    """The first call (compile included), then `iters` more, reporting progress every 100."""
    import torch

    _progress(f"compiling / first call ({what}) ...")
    launch()
    torch.cuda.synchronize()
    _progress(f"first call ok ({what})")
    for i in range(iters):
        launch()
        if i % 100 == 99:
            torch.cuda.synchronize()
            _progress(f"call {i + 1}/{iters} ok")
    torch.cuda.synchronize()
    _progress(f"done: {iters} calls")


def _real(case: str, iters: int, repo: str) -> None:
    import torch

    sys.path.insert(0, repo)
    from kernels_triton import attention_backward as ab

    if case.endswith("_fresh"):
        import triton

        alloc = _Alloc(reuse=False)
        triton.set_allocator(alloc)  # ensure_tma_allocator leaves a user allocator in place
    B, H, D, S, Skv = 1, 1, 64, 32, 64
    dk_tile, dq_tile = (64, 64, 4, 3, True), (128, 64, 8, 3)
    autotune = False
    if case == "real_s32_tmadq" or case == "real_s32_fresh":
        dq_tile = (128, 64, 8, 3, True)
    if case == "real_s32_s1":
        dk_tile = (64, 64, 4, 1, True)
    if case == "real_s32_32x128":
        dk_tile = (32, 128, 4, 3, True)
    if case == "real_s12":
        S, Skv, dq_tile = 12, 16, (128, 64, 8, 3, True)
    if case == "real_autotune_s24":
        S, Skv, autotune = 24, 80, True
    if case == "real_s128":
        S = Skv = 128
        dq_tile = (128, 64, 8, 3, True)
    if case == "real_s128_autotune":
        S = Skv = 128
        autotune = True
    if case == "real_big":
        H, S, Skv = 8, 1024, 1024
        dq_tile = (128, 64, 8, 3, True)
        iters = max(1, iters // 20)
    dt = torch.float16
    g = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=g)

    q, k, v, do, o = rnd(B, H, S, D), rnd(B, H, Skv, D), rnd(B, H, Skv, D), rnd(B, H, S, D), rnd(B, H, S, D)
    lse = torch.full((B, H, S), 4.0, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def p2(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())

    cfg = None if autotune else (dk_tile, dq_tile)

    def launch() -> None:
        ab.attention_backward(dq, dk, dv, do, q, k, v, o, lse, None, False, 0.125, s_bucket=p2(S),
                              skv_bucket=p2(Skv), max_grid_y=65535, config=cfg)  # fmt: skip

    _repeat(launch, iters, f"S={S} Skv={Skv} cfg={cfg}")


def _real_fwd(case: str, iters: int, repo: str) -> None:
    import torch

    sys.path.insert(0, repo)
    from kernels_triton import attention as fa

    B, H, D, S, Skv = 1, 1, 128, 32, 64
    cfg = (64, 64, 4, 3, True) if case.endswith("_tma") else None
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (
        torch.randn(B, H, n, D, device="cuda", dtype=torch.float16, generator=g) for n in (S, Skv, Skv)
    )
    o = torch.empty_like(q)
    lse = torch.empty((B, H, S), device="cuda", dtype=torch.float32)

    def launch() -> None:
        fa.forward(o, lse, q, k, v, None, False, 0.125, _config=cfg)

    _repeat(launch, iters, f"forward D{D} S={S} Skv={Skv} cfg={cfg}")


def _real_fixed(case: str, iters: int, repo: str) -> None:
    """The repository's dk/dv kernel (its flat loop index divided by max(n, 1), the H0 fix) at the small shapes
    that hung: forced TMA tiles, each launched repeatedly and compared with the pointer tiles on the same
    inputs (real_fixed_sweep), or the autotuner offering its TMA tiles at any length (real_fixed_autotune,
    TMA_MIN_LEN forced to 0). A line per shape; the last line printed names the shape that hung."""
    import torch

    sys.path.insert(0, repo)
    from kernels_triton import attention_backward as ab

    D, dt = 64, torch.float16
    gen = torch.Generator(device="cuda").manual_seed(3)
    reps = max(20, iters // 10)
    pointer = ((64, 64, 4, 3), (128, 64, 8, 3))  # the D64 pointer tiles: the reference on the same inputs
    if case == "real_fixed_sweep":
        tiles = [((64, 64, 4, 3, True), (128, 64, 8, 3, True)), ((32, 128, 4, 3, True), (128, 64, 8, 3))]
        shapes = [(S, Skv, c) for c in (False, True) for S in (12, 24, 32, 48) for Skv in (16, 64, 80)]
        shapes += [(1, 24, False), (63, 64, False), (64, 64, False), (64, 16, False)]
    else:
        tiles = [None]
        shapes = [(S, Skv, False) for S in (12, 16, 20, 24, 28, 32) for Skv in (16, 32, 48, 64, 80)]
        shapes += [(S, Skv, True) for S in (12, 24, 32) for Skv in (32, 80)]

    def p2(n: int) -> int:
        return 1 << max(0, (n - 1).bit_length())

    def grads(ins, causal: bool, cfg):
        q, k, v, do, o, lse = ins
        out = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        ab.attention_backward(*out, do, q, k, v, o, lse, None, causal, 0.125, s_bucket=p2(q.shape[2]),
                              skv_bucket=p2(k.shape[2]), max_grid_y=65535, config=cfg)  # fmt: skip
        return out

    for S, Skv, causal in shapes:
        q, do, o = (torch.randn(1, 1, S, D, device="cuda", dtype=dt, generator=gen) for _ in range(3))
        k, v = (torch.randn(1, 1, Skv, D, device="cuda", dtype=dt, generator=gen) for _ in range(2))
        ins = (q, k, v, do, o, torch.full((1, 1, S), 4.0, device="cuda", dtype=torch.float32))
        ref = grads(ins, causal, pointer)
        torch.cuda.synchronize()
        for cfg in tiles:
            what = f"S={S} Skv={Skv} causal={causal} cfg={cfg or 'autotuned'}"
            _progress(f"first call {what} ...")
            got = grads(ins, causal, cfg)
            torch.cuda.synchronize()
            err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0))
                      for a, b in zip(got, ref))  # fmt: skip
            if not err <= 2e-2:  # NaN included: a gradient the kernel did not write
                raise SystemExit(f"MISMATCH {what}: max error {err:.3g} against the pointer tiles")
            for _ in range(reps):
                grads(ins, causal, cfg)
            torch.cuda.synchronize()
            _progress(f"ok {what}: {reps + 1} calls, max error {err:.2e}")
    _progress(f"done: {len(shapes)} shapes x {len(tiles)} configs")


# (B, H, Hkv, S, Skv, causal) of the Gluon cases, each at every head dim of the case
_GLUON_SHAPES = [
    (1, 2, 1, 1, 1, False),
    (1, 2, 1, 1, 1, True),
    (1, 4, 2, 17, 1, False),
    (1, 4, 2, 64, 64, True),
    (2, 4, 4, 1000, 5, True),
    (1, 2, 2, 5, 1000, True),
    (1, 8, 1, 130, 129, False),
]


def _attn_ref(q, k, v, causal: bool, scale: float):
    """float32 o and natural-log lse (bottom-right causal; a row that sees no key: o = 0, lse = -inf), with
    autograd through q, k, v."""
    import torch

    rep = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = q.float() @ kk.transpose(-1, -2) * scale
    S, Skv = q.shape[2], k.shape[2]
    if causal:
        seen = (
            torch.arange(Skv, device=q.device)[None, :] <= torch.arange(S, device=q.device)[:, None] + Skv - S
        )
        s = s.masked_fill(~seen, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(-1e30)  # a row with no key: finite, so e = 0, not NaN
    e = (s - m).exp()
    den = e.sum(-1, keepdim=True)
    o = (e / den.clamp_min(1e-30)) @ vv
    return o, (den.log() + m).squeeze(-1)


def _rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def _gluon(case: str, iters: int, repo: str) -> None:
    """The Gluon forward / backward at the edge shapes of _GLUON_SHAPES (see the module docstring): a progress
    line before each shape's first launch (the last line printed names the shape that hung), then `reps`
    more launches, and the outputs against float32 torch."""
    import torch

    sys.path.insert(0, repo)
    from kernels_triton import _attention_hopper as fh
    from kernels_triton import _attention_hopper_bwd as bh

    if torch.cuda.get_device_capability() != (9, 0) or not fh.HAS_GLUON:
        raise SystemExit("needs an sm_90 GPU and Triton's Gluon")
    dt, gen = torch.bfloat16, torch.Generator(device="cuda").manual_seed(4)
    reps = max(5, iters // 50)

    def inputs(B, H, Hkv, S, Skv, D):
        return (torch.randn(B, H, S, D, device="cuda", dtype=dt, generator=gen),
                torch.randn(B, Hkv, Skv, D, device="cuda", dtype=dt, generator=gen),
                torch.randn(B, Hkv, Skv, D, device="cuda", dtype=dt, generator=gen))  # fmt: skip

    def check(what: str, err: float, tol: float = 2e-2) -> None:
        if not err <= tol:  # NaN included: an output the kernel did not write
            raise SystemExit(f"MISMATCH {what}: relative error {err:.3g}")

    n = 0
    if case.startswith("gluon_fwd"):
        variants = [("64,1,1", "0", None)] if case == "gluon_fwd_stage1" else [(None, "0", None)]
        if case == "gluon_fwd_edges":
            variants += [(None, "1", None), (None, "1", "1")]
        dims = (128, 256) if case == "gluon_fwd_stage1" else (64, 128, 256)
        shapes = _GLUON_SHAPES + ([(1, 2, 2, 300, 700, True), (1, 2, 2, 333, 333, False)] if case ==
                                  "gluon_fwd_stage1" else [])  # fmt: skip
        for cfg, persist, ctas in variants:
            for var, val in (("FUSEKIT_HOPPER_ATTN_CFG", cfg), ("FUSEKIT_HOPPER_ATTN_PERSIST", persist),
                             ("FUSEKIT_HOPPER_ATTN_PERSIST_CTAS", ctas)):  # fmt: skip
                if val is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = val
            for D in dims:
                if persist == "1" and D not in fh.PERSIST_HEAD_DIMS:
                    continue
                for B, H, Hkv, S, Skv, causal in shapes:
                    q, k, v = inputs(B, H, Hkv, S, Skv, D)
                    o = torch.full_like(q, float("nan"))
                    lse = torch.full((B, H, S), float("nan"), device="cuda")
                    scale = D**-0.5
                    what = f"fwd D{D} B{B} H{H}/{Hkv} S={S} Skv={Skv} causal={causal} cfg={cfg} persist={persist}"
                    what += f" ctas={ctas}"
                    _progress(f"first call {what} ...")
                    for _ in range(reps + 1):
                        fh.hopper_forward(o, lse, q, k, v, causal, scale * 1.4426950408889634)
                    torch.cuda.synchronize()
                    ro, rl = _attn_ref(q, k, v, causal, scale)
                    check(what, _rel_err(o, ro))
                    fin = rl.isfinite()
                    if not (torch.equal(lse.isfinite(), fin) and (o[~fin] == 0).all()):
                        raise SystemExit(f"MISMATCH {what}: rows that see no key")
                    check(what + " lse", float((lse[fin] - rl[fin]).abs().max()) if fin.any() else 0.0, 5e-2)
                    _progress(f"ok {what}: {reps + 1} calls")
                    n += 1
    else:
        for split in (None, "2"):
            if split is None:
                os.environ.pop("FUSEKIT_HOPPER_BWD_SPLIT", None)
            else:
                os.environ["FUSEKIT_HOPPER_BWD_SPLIT"] = split
            for D in (64, 128) if split is None else (128,):
                shapes = (
                    _GLUON_SHAPES if split is None else [(1, 8, 2, 5, 300, True), (1, 8, 2, 1000, 5, True)]
                )
                for B, H, Hkv, S, Skv, causal in shapes:
                    q, k, v = (t.requires_grad_() for t in inputs(B, H, Hkv, S, Skv, D))
                    scale = D**-0.5
                    ro, rl = _attn_ref(q, k, v, causal, scale)
                    do = torch.randn(q.shape, device="cuda", dtype=dt, generator=gen)
                    ref = torch.autograd.grad(ro, (q, k, v), do.float())
                    o, lse = ro.detach().to(dt).contiguous(), rl.detach().contiguous()
                    qd, kd, vd = q.detach(), k.detach(), v.detach()
                    got = [torch.full_like(t, float("nan")) for t in (qd, kd, vd)]
                    what = f"bwd D{D} B{B} H{H}/{Hkv} S={S} Skv={Skv} causal={causal} split={split}"
                    _progress(f"first call {what} ...")
                    for _ in range(reps + 1):
                        bh.hopper_backward(*got, do, qd, kd, vd, o, lse, causal, scale)
                    torch.cuda.synchronize()
                    for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
                        if r.norm() > 0:
                            check(f"{what} {name}", _rel_err(g, r))
                        elif not (g == 0).all():
                            raise SystemExit(f"MISMATCH {what} {name}: not 0")
                    _progress(f"ok {what}: {reps + 1} calls")
                    n += 1
    _progress(f"done: {n} shapes")


def child(case: str, iters: int, repo: str) -> None:
    import torch

    _progress(f"{case}: {torch.cuda.get_device_name()} torch {torch.__version__} "
              f"triton {__import__('triton').__version__}")  # fmt: skip
    if case.startswith("mini"):
        _mini(case, iters)
    elif case.startswith("real_fwd"):
        _real_fwd(case, iters, repo)
    elif case.startswith("real_fixed"):
        _real_fixed(case, iters, repo)
    elif case.startswith("gluon"):
        _gluon(case, iters, repo)
    else:
        _real(case, iters, repo)


# ----------------------------------------------------------------------------------------------- parent side
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per case (compile included)")
    ap.add_argument("--budget", type=float, default=110.0, help="start no case after this many seconds")
    ap.add_argument("--iters", type=int, default=2000, help="launches per mini case (real: /4)")
    ap.add_argument("--repo", default=os.getcwd(), help="checkout root holding kernels_triton/")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.iters if a.child.startswith("mini") else max(1, a.iters // 4), a.repo)
        return
    have_repo = os.path.isdir(os.path.join(a.repo, "kernels_triton"))
    t0 = time.time()
    rows = []
    for case in [c for c in a.cases.split(",") if c]:
        if case not in CASES:
            rows.append((case, "UNKNOWN", 0.0, ""))
            continue
        if case.startswith("real") and not have_repo:
            rows.append((case, "SKIPPED (no kernels_triton under --repo)", 0.0, ""))
            continue
        if time.time() - t0 > a.budget:
            rows.append((case, "SKIPPED (budget)", 0.0, ""))
            continue
        args = [case, "--iters", str(a.iters), "--repo", a.repo]
        status, secs, last = run_case(__file__, args, max(a.timeout, SLOW.get(case, 0.0)), "HANG")
        rows.append((case, status, secs, last))
        print(f"{case:20s} {status:10s} {secs:6.1f}s  {last[:150]}", flush=True)
    print("\nsummary")
    for case, status, _dt, _last in rows:
        print(f"  {case:20s} {status}")
    print(f"total {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
