"""FlashAttention-3-style attention forward for Hopper (sm_90), written in Gluon.

Entry points (attention.forward calls run_hopper where attention.use_hopper says so):
    hopper_supported(q, k, v, kv_len) -> bool    whether hopper_forward can run these tensors
    hopper_forward(o, lse, q, k, v, causal, qk_scale) -> None

Contract (that of attention.forward without kv_len): q/o [B, H, S, D] contiguous, k/v [B, Hkv, Skv, D] with
a contiguous last dim (strided views allowed when every stride is 16-byte aligned), GQA head h // (H // Hkv),
fp16/bf16, D 64, 128 or 256. qk_scale = scale * log2(e) >= 0 (the exp2 domain, folded by the caller). Causal
mask bottom-right aligned: query i sees key j iff j <= i + Skv - S. lse [B, H, S] fp32 = natural-log logsumexp
of the visible scaled scores; a row that sees no key gives o = 0 and lse = -inf.

Structure (FA3, Shah et al. 2024), one CTA per (128 query rows, b*H + h), three partitions:
- producer, 1 warp (24 registers): TMA loads of the two Q halves, then K and V tiles into a STAGES-deep
  shared-memory ring. k_ready/v_ready mbarriers (TMA transaction counts) say a slot is full; kv_empty (count 2,
  one arrival per consumer) says both consumers are done with it. K and V have separate ready barriers so the
  S = Q K^T wgmma starts before V lands.
- two consumer warpgroups (the default partition and one 4-warp worker, 240 registers each), each owning 64
  query rows (wgmma M = 64 per warpgroup). Intra-warpgroup overlap: tile j's S = Q K_j^T is issued async, then
  tile j-1's O += P V_{j-1} (P from registers, the wgmma A operand); the S wait leaves the PV wgmma in flight
  while the softmax of tile j runs on the CUDA cores. By default the warp schedulers interleave the two
  warpgroups freely; FUSEKIT_HOPPER_ATTN_PINGPONG=1 orders their GEMM issue with FA3's named-barrier pingpong
  (bar.sync/bar.arrive 8 and 9 through inline asm: Gluon on Triton 3.6 has no named-barrier op).
- Causal: tiles past the last key the CTA's rows see are never loaded; tiles every row of a warpgroup sees in
  full run without a mask; the diagonal tiles (and a ragged Skv tail) run masked. The first tile is always
  processed masked, so a CTA that sees no key at all (causal with S > Skv) still runs one all-masked tile and
  writes o = 0, lse = -inf. TMA zero-fills loads past S / Skv and clips the O store at S.
TMA descriptors are built on the host by default: q/o as [B*H, S, D] (boxes [1, 64, D], so the ragged S tail
clips at the head's own end) and k/v as [B, Hkv, Skv, D] through their strides (boxes [1, 1, BLOCK_N, D]);
the kernel views its 2-D shared-memory slots with those ranks (same 128-byte swizzle). The alternative,
FUSEKIT_HOPPER_ATTN_DESC=device, builds per-head 2-D descriptors in the kernel (Triton's global scratch
allocator), which costs every CTA four serialized tensormap writes + fences in its prologue.

Measured on an H100 80GB (Triton 3.6.0, torch 2.11+cu130, 2026-11-27; .dev/s/gluon_probe.py and
gluon_overhead.py), bf16 TFLOP/s, kernel only (CUDA graph, L2 not flushed) | do_bench wall (L2 flushed):
                        this kernel     SDPA (cuDNN)   attention.py (_attn_fwd_kernel, autotuned)
  B4 S4096 D128 full :  528 | 544       582 | 603      449 | 459
  B4 S4096 D128 causal:   - | 474         - | 524        - | 424
  B1 S2048 D128 full :  470 | 452       549 | 593      393 | 414   (graph figures in fp16)
  B4 S1024 D128 causal:  298 | 284       370 | 376      273 | 257
  B4 S4096 D64 full  :    - | 422         - | 458        - | 396
  B1 S2048 D64 full  :  392 | (launch-bound)  432 | 416  374 | 333
  B4 S1024 D64 causal:  207 | (launch-bound)  288 | 279  261 | 129
  GQA 32/8 B2 S2048 D128: full - | 517 vs SDPA 607, triton 427; causal - | 396 vs 459, 337.
So: faster than the current Triton kernel for D128 (1.09-1.21x) and D64 non-causal (1.05-1.07x), slower for
D64 causal (0.97x at S4096, 0.79-0.89x at S <= 2048); 0.72-0.92x SDPA everywhere.
The Python launch (TensorDescriptor objects + Gluon's JIT binder with descriptor arguments) costs 150-290 us
per call on that host (device descriptors: 80-160 us), so calls shorter than ~0.5 ms are launch-bound in
eager mode: a lean launcher (cached layouts, the compiled kernel launched directly, or CUDA graphs) is
needed before dispatching small shapes here.
Pingpong: 0.95-1.02x of the free-running warpgroups (553 vs 544 at B4 S4096 D128 full): off by default.

D256 (FA3's hdim-256 forward: 128 query rows = 2 consumer warpgroups x 64, 2 K/V stages; FA3 takes 80-key
tiles, here 64: Gluon's register tensors need power-of-two shapes, so no 80, 48 or 96): the same kernel and
overlap at BLOCK_N 64, STAGES 2. Shared memory: Q 2 x 64 x 256 x 2 = 64 KB (reused for the O store) + 2 stages
of 64 x 256 K and V tiles = 128 KB, 192 KB in all (196864 bytes with the barriers and the epilogue's scratch;
227 KB fit). Registers per consumer thread: the 64 x 256 fp32 O accumulator is 128 of 240, the 64 x 64 S tile
32, P 16 (in flight in the P V wgmma) + 16 (the next tile's); ptxas (Triton 3.6 and 3.9, fp16 and bf16,
causal or not, host or device descriptors): 0 bytes spilled. 128-key tiles (one stage, 192 KB) spill
850-930 bytes (S 64 + P 2 x 32 registers on top of O); 32-key tiles (3 or 4 stages) do not spill either
(FUSEKIT_HOPPER_ATTN_CFG=32,4 for probes). With 2 stages the next tile's K waits until both warpgroups
are done with the P V of the tile before; K_EARLY (FA3's separate K and V pipelines) frees a K slot as soon as
its S = Q K^T is done, through a second set of empty barriers (FUSEKIT_HOPPER_ATTN_CFG=64,2,1; no spills
either; on at D256: K_EARLY_DIMS). Measured on an H100 (Triton 3.6, .dev probe at b7a6498, do_bench with the
L2 flushed, SDPA and attention.py's kernel in the same process), bf16: B4 H32 S4096 D256 699 TFLOP/s (SDPA
669, attention.py 511), causal 615 (607, 465), B16 S1024 564 (591, 418); without K_EARLY 539 / 498 / 459.
attention.use_hopper routes D256 here (FUSEKIT_TRITON_ATTN_GLUON_D256=0 does not).

Persistent variant (issue #13; on by default at D64/D128 since the H200 figures beside PERSISTENT_DIMS;
FUSEKIT_HOPPER_ATTN_PERSIST=0 turns it off). Measured once on an H100 (.dev probe at c445956, do_bench with the L2 flushed, against
this module's one-tile-per-CTA kernel and SDPA in the same process, bf16 H32; outputs bit-identical to the
one-tile kernel at 4 odd shapes, causal and GQA, grid capped at 3 and 7 CTAs): non-causal it wins, D128 B32
S512 1.18x (486 TFLOP/s, 0.89x SDPA), B16 S1024 1.11x (571, 0.92x), B4 S4096 1.01x (610, 1.00x); D64 B32
S512 1.17x, B16 S1024 1.10x. Causal (with the first causal order, "global" below) it loses at D128 (S512 0.90x,
S4096 0.71x: that order interleaves heads, so the CTAs running together read ~132 heads' K/V, far more than the
L2 holds) and wins at D64 (S512 1.17x, S1024 1.06x; D64 causal is not routed to Gluon). The head-grouped causal
orders below were A/B'd on an H200 (.dev/s/persist_probe.py, figures beside PERSISTENT_DIMS): "pairs"
1.07-1.36x the one-tile kernel except B4 S4096 D128 (1.00x; "sections" 0.98x there, "global" 0.81x). Short sequences lose to SDPA (B32 S512 D128 0.67x causal / 0.81x, B16 S1024 0.84x /
0.91x, D64 0.73-0.97x on the H100 harness) because with 4-8 key
tiles per CTA the prologue (Q load, ring fill) and epilogue (normalize, O store, lse) of every CTA overlap with
nothing, and causal CTAs are ragged. _attn_fwd_hopper_persist (FA3's answer): grid (min(SMs, units), 1);
a work tile is 128 query rows of one (b, h); CTA pid takes schedule units pid, pid + nprog, ... (static
round-robin), a unit being one work tile, or two (causal "pairs"). Non-causal: m fastest within a head, so the
CTAs running at the same time read the same head's K/V (L2), and every tile costs the same. Causal (work tile
cost ~ its key tiles, 1..n_m at S = Skv), _persist_unit / _persist_schedule:
- what the static round-robin does with an order: at any moment the ~nprog CTAs run a window of ~nprog
  consecutive units (CTAs fall behind each other only by their load differences so far), and CTA p's total is
  the sum over units p, p + nprog, ...: each "row" of nprog consecutive units gives one to every CTA, so a
  row whose costs fall from its first unit to its last hands CTA 0 the most every time.
- "global" (the first order): descending m across all B*H heads. Each row is one or two m levels: balanced to
  ~one light tile at the end (LPT-like), but the window spans ~nprog heads: B4 H32 S4096 D128 reads ~126
  heads' K/V (2 MB each) at once.
- sections (FA3's L2 swizzle): heads b*H + h cut into sections of SEC consecutive heads (whole GQA groups)
  whose K/V, Skv * D * 2 bytes * 2 per KV head, fit in half the L2 (PERSIST_L2_SHARE; H100 50 MB: 12 heads at
  Skv 4096 D128, 100 at Skv 512); sections in order, the last one ragged. A section is >= ~3 rows of units at
  S = Skv (D <= 128), so the window straddles at most two sections: at most the whole L2 of K/V in flight.
- "sections" (FA3's order within a section: descending m, heads fastest): locality, but a row now spans
  nprog / SEC m levels (B16 S1024 D128: 2.6 of 8), so CTA 0 gets the heaviest tile of every row, and the
  sawtooth at section boundaries only shifts which CTAs. A static-sum model (key tiles + 0.5 per work tile, 132
  CTAs, each CTA's sum of its units) gives the busiest CTA 1.16-1.33x the mean at B32 S512 / B16 S1024 /
  B8 S2048 / B4 S2048 D128 (global 1.03x); only at B4 S4096 D128 is it good (1.003x). FA3 pairs this order
  with a dynamic (atomic) scheduler, where it balances.
- "pairs" (the default): unit (k, h) = head h's blocks n_m - 1 - k, then k (k < n_m // 2, heads fastest within
  the section); their key tiles add up to ~n_m + 1 for every k, so every unit costs about the same and every
  row is balanced, whatever the section boundaries (an odd n_m's middle blocks pair up across heads, after the
  pairs of their section). Same window locality (model: B4 S4096 D128 ~20 heads in flight, global 126). Its
  cost: units are coarse, U units over P CTAs leave the busiest CTA ceil(U / P) against the mean U / P (1.03x
  at the shapes above, 1.15-1.4x at a few units a CTA, e.g. B4 H32 S1088 D128, 4.4 a CTA); where that exceeds
  1.1x (PERSIST_PAIRS_MAX_QUANT) the default takes "global": few units means little K/V to thrash the L2.
  With S > Skv many tiles clamp at one key tile and the pairs are less even (model 1.1x at B3 S4000 Skv1000).
FUSEKIT_HOPPER_ATTN_PERSIST_ORDER=pairs|sections|global and FUSEKIT_HOPPER_ATTN_PERSIST_SECTION=heads force
them (probes, tests). The order is a runtime argument (PAIRS, SEC, PER, NU; not specialized), so the A/B runs
one compiled kernel; each unit's tiles are recomputed from u per tile (the producer has 24 registers).
The same partitions' code runs each work tile (_consumer_tile / _producer_tile, which the one-tile-per-CTA
kernel also calls: its sm_90 PTX is unchanged, Triton 3.6, all 24 variants, debug info
aside), so a work tile should give bit-identically what the one-tile kernel gives (a GPU test checks). Across
work tiles:
- the K/V ring's sequence of loads continues: both sides count the K/V tiles of earlier work tiles (c), and
  load c + j uses slot (c + j) % STAGES, phase ((c + j) // STAGES) & 1; the producer runs ahead into the next
  work tile's K/V as soon as slots free up.
- q_bar (count 1, TMA bytes) completes once per work tile: the i-th is waited for with parity i & 1. A new
  q_empty barrier (count 2, one arrival per consumer warpgroup after its last S = Q K^T of the tile) gates the
  next Q load: the producer waits for parity (i & 1) ^ 1 before tile i's Q (a fresh barrier passes i = 0).
  Neither side can run two phases ahead of the other: Q(i+1) needs both releases of Q(i), and a release of
  Q(i) comes after the wait for Q(i).
- O leaves through its own buffer (2 x 64 x D; each warpgroup waits for its previous TMA store to have read
  it, then writes), so Q's buffer is refilled while the consumers run the last P V, normalize and store.
Shared memory: D128 Q 32 KB + ring 128 KB + O 32 KB = 196928 bytes with barriers and scratch (227 KB fit);
D64 (128 x 3) 131424 bytes. D256 (Q 64 KB + ring 128 KB) has no room for an O buffer: no persistent variant
(PERSIST_HEAD_DIMS). Host descriptors only; no pingpong. ptxas (fp16/bf16 x D64/D128 x causal, Triton 3.6 and
3.9): 168 registers, 0 bytes spilled. FUSEKIT_HOPPER_ATTN_PERSIST_CTAS=n caps the grid (tests: many work
tiles per CTA at small shapes). Next if it pays: an atomic (dynamic) scheduler for causal, as FA3's.
Short causal rows stay behind SDPA even persistent (device time, SDPA in the same process: B32 S512 D128 causal
0.70x on an H100, 0.77x on an H200). Per work tile the first S = Q K^T (waited on before its softmax) and the
last P V run with nothing to overlap, a fixed cost that 1-4 key tiles cannot amortize. Smaller key tiles do
not fix it (.dev/s/cfg_probe.py, 2026-11-28): 64 x 4 against 128 x 2 at D128 causal is 7% faster at B32 S512
on the H100 but 3% on the H200, and 4% slower at B64 S256 (H200); tried in c5080f5 and reverted. What would:
overlapping one work tile's tail with the next one's head (its first S issued before the last P V).

Opt-in polynomial exp2 (issue #13, FlashAttention-4's MUFU offload; a loss on the H100: _exp2_poly.py):
FUSEKIT_HOPPER_ATTN_EXP2_POLY=1|4 (1/4), 2 (1/2), 8 (1/8), FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE=3|4|5 (the values of
attention.py's FUSEKIT_TRITON_ATTN_EXP2_POLY), read per call by run_hopper / _run_persistent and passed as the
kernels' EXP2_POLY / EXP2_DEGREE constexprs (in launch_keyed's key). _softmax_tile then computes p with
_exp2_poly.py's exp2_mixed_gluon: that fraction of each [64, BLOCK_N] score tile's columns through the
polynomial on the FMA pipe, the rest (and alpha) through MUFU ex2. The column split is Gluon's reshape / permute /
split / join on the wgmma accumulator layout, whose inferred layouts keep it in each thread's registers; the
rejoined tile's convert_layout back to s's layout is a renaming. Off (EXP2_POLY = 0, the default) every AOT
variant's PTX is byte-identical to before the switch (md5 of all 32, Triton 3.6 and 3.9, debug info aside).
sm_90 SASS of the D64 kernels (fp16 and bf16, causal or not, one-tile with host or device descriptors and
persistent; Triton 3.6 and 3.9 give the same counts), whole kernel = 6 softmax instances (tile 0, the unmasked
and the masked loop, per consumer warpgroup), 64 scores per thread each: off MUFU.EX2 396 / FFMA 188 / FMUL 604 /
FADD 676 / FMNMX 408; 1/4 through the polynomial (degree 3) 300 / 572 / 700 / 868 / 504, i.e. per instance 66 ->
50 ex2 and per polynomial exp2 +4 FFMA, +1 FMUL, +2 FADD, +1 FMNMX, +1 LEA (9 FMA/ALU-pipe instructions for one
MUFU op); SHFL, STS and BAR counts unchanged, 0 bytes spilled. 1/8: 348 / 380 ex2 / FFMA, 1/2: 204 / 956 (bf16
persistent non-causal, Triton 3.6; 0 spills). D128 (1/4, Triton 3.6): 0 spills except the
causal persistent kernel, 12 bytes (3 STL / 3 LDL); D256 non-causal one-tile 0.

Gluon is experimental and its API moves between Triton releases: written against Triton 3.6 (the GPU host)
and compile-checked for sm_90 with 3.9 (CI). Without Gluon's Hopper module, hopper_supported says False.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels_triton._config import (
    EnvSnapshot,
    device_index,
    is_interpreter,
    l2_bytes,
    num_sms,
    on_device,
    remember,
)
from kernels_triton._exp2_poly import env_config as exp2_env_config
from kernels_triton._launch import fast_launch, int_class, launch_keyed

try:  # Gluon (triton.experimental) is optional: without it this module only says "not supported"
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels_triton._exp2_poly import exp2_mixed_gluon

    HAS_GLUON = hasattr(gl, "warp_specialize") and hasattr(tma, "make_tensor_descriptor")
    # TMA copies were renamed after 3.6 (3.9 keeps the old names only to raise): take whichever this has
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except Exception:  # ImportError, or an API this module does not know
    HAS_GLUON = False

HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128  # query rows per CTA: two consumer warpgroups of 64
WG_M = 64  # query rows per consumer warpgroup (wgmma M)
# (BLOCK_N, STAGES) per head dim: the K/V ring is STAGES * 2 * BLOCK_N * D * 2 bytes, Q 2 * 64 * D * 2 bytes
# (reused for the O store); D128: 2 stages of 128x128 = 128 KB + 32 KB of Q. H100 sweep (B4 S4096, do_bench
# TFLOP/s, host descriptors): D128 full 128x2 545, 64x4 533, 64x3 536; D128 causal 128x2 467, 64x4 490,
# 64x3 492 (a candidate for a causal entry, measured at this shape only); D64 full 128x3 416, 128x2 421,
# 64x4 386; D64 causal 128x3 362, 128x2 363, 64x4 342. D256: 2 stages of 64 x 256 = 128 KB + 64 KB of Q, no
# spills (see the docstring); not measured on a GPU yet.
CONFIGS: dict[int, tuple[int, int]] = {64: (128, 3), 128: (128, 2), 256: (64, 2)}
NUM_WARPS = 4  # the default partition (consumer warpgroup 0); + 4 (consumer 1) + 1 (producer) warps
# Registers: the launch reserves MAXNREG per thread for all 12 warps (the 1-warp producer rounds up to a
# warpgroup), 12 * 32 * 168 = 64512 <= 65536; then setmaxnreg moves them: producer 24, consumers 240
# (128 * 24 + 256 * 240 = 64512).
MAXNREG = 168
CONSUMER_REGS = 240
PRODUCER_REGS = 24
_MAX_GRID_Y = 65535


# Head dims whose K slots are freed as soon as S = Q K^T is done (FA3's separate K and V pipelines) instead of
# after P V with V's: the next K load starts a tile earlier, which matters with 2 stages. H100 at D256 (64 x 2,
# B4 H32 S4096): 699 TFLOP/s against 539 without it, causal 615 against 498, B16 S1024 564 against 459. D128
# (128 x 2): 633 against 552, causal 539 against 475, B8 S1024 causal 340 against 307. D64 (128 x 3): 418
# against 437 non-causal, so not there. (FUSEKIT_HOPPER_ATTN_CFG="BLOCK_N,STAGES,0|1" chooses for probes.)
K_EARLY_DIMS: tuple[int, ...] = (128, 256)


def _env_config(head_dim: int) -> tuple[int, int, bool]:
    """(BLOCK_N, STAGES, K_EARLY): the tables above, or FUSEKIT_HOPPER_ATTN_CFG="BLOCK_N,STAGES[,K_EARLY]"
    (probes)."""
    env = os.environ.get("FUSEKIT_HOPPER_ATTN_CFG")
    if env:
        bn, st, *ke = (int(x) for x in env.split(","))
        k_early = bool(ke and ke[0])
        # One stage deadlocks without K_EARLY: tile j's S = Q K_j^T waits for K_j before tile j-1's P V frees
        # the only slot, and the producer waits for that slot before loading K_j (any query block with >= 2
        # key tiles). With K_EARLY the K slot is freed after S_{j-1}, so one stage can make progress.
        if st < 1 or (st < 2 and not k_early):
            raise ValueError(
                f"FUSEKIT_HOPPER_ATTN_CFG={env!r}: STAGES must be >= 2 (or 1 with K_EARLY=1: 'BLOCK_N,1,1')"
            )
        return bn, st, k_early
    return (*CONFIGS[head_dim], head_dim in K_EARLY_DIMS)


# The persistent variant (_attn_fwd_hopper_persist, issue #13): grid = min(SMs, work tiles), each CTA loops over
# work tiles (128 query rows of one head) from a static round-robin schedule; causal tiles heaviest first. O
# leaves through its own shared-memory buffer (2 x 64 x D), so the producer reloads Q for the next work tile
# while the consumers finish the last P V and the epilogue. Shared memory at D128: Q 32 KB + ring 128 KB + O
# 32 KB = 192 KB (+ barriers, scratch); D64 16 + 96 + 16 KB. D256 (Q 64 KB + ring 128 KB) has no room for an O
# buffer: no persistent variant there. PERSIST_HEAD_DIMS: where it exists; PERSISTENT_DIMS: where run_hopper
# takes it by default. FUSEKIT_HOPPER_ATTN_PERSIST=1 / 0 forces it on (at PERSIST_HEAD_DIMS, host descriptors)
# / off, read per call; FUSEKIT_HOPPER_ATTN_PERSIST_CTAS=n caps the grid (tests and probes: many work tiles per
# CTA at small shapes). H200 (.dev probe at e96184c, do_bench with the L2 flushed, bf16 H32, against the
# one-tile-per-CTA kernel in the same process; bit-identical to it): non-causal D128 B32 S512 1.20x, B16 S1024
# 1.13x, B4 S4096 1.04x, D64 B4 S4096 1.01x; causal ("pairs") D128 B32 S512 1.23x, B16 S1024 1.07x, B4 S4096
# 1.00x, D64 B32 S512 1.36x, B16 S1024 1.24x, B4 S4096 1.08x.
PERSIST_HEAD_DIMS: tuple[int, ...] = (64, 128)
PERSISTENT_DIMS: tuple[int, ...] = (64, 128)


# Opt-in (issue #13, a loss on the H100: _exp2_poly.py): a fraction of p's exponentials on the FMA pipe (the polynomial of
# _exp2_poly.py, FlashAttention-4's MUFU offload; attention.py's FUSEKIT_TRITON_ATTN_EXP2_POLY for the Triton
# kernel) for the softmax-bound D64 tiles. FUSEKIT_HOPPER_ATTN_EXP2_POLY: unset / "0" off (the kernels as
# before: EXP2_POLY = 0 compiles to the same PTX); "1" or "4" 1/4 of each score tile's columns, "2" 1/2, "8" 1/8;
# FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE 3 (default, <= 7.5e-5 relative error), 4 or 5. Read per call (run_hopper,
# _run_persistent), like the other FUSEKIT_HOPPER_ATTN_* switches, so a probe can A/B it in one process.
def exp2_poly_config() -> tuple[int, int]:
    """(EXP2_POLY, EXP2_DEGREE) of the forward kernels from FUSEKIT_HOPPER_ATTN_EXP2_POLY[_DEGREE]
    (_exp2_poly.env_config): (0, 3) when off; a ValueError naming the accepted values otherwise."""
    return exp2_env_config("FUSEKIT_HOPPER_ATTN_EXP2_POLY")


def persistent_at(head_dim: int) -> bool:
    """Whether run_hopper launches the persistent kernel for this head dim (PERSISTENT_DIMS, or the
    FUSEKIT_HOPPER_ATTN_PERSIST override)."""
    if head_dim not in PERSIST_HEAD_DIMS:
        return False
    env = os.environ.get("FUSEKIT_HOPPER_ATTN_PERSIST", "")
    if env:
        return env not in ("0", "false", "False")
    return head_dim in PERSISTENT_DIMS


if HAS_GLUON:

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, rows, cols, start_n, qk_scale, diag, SKV, MASK: gl.constexpr,
                      CAUSAL: gl.constexpr, EXP2_POLY: gl.constexpr, EXP2_DEGREE: gl.constexpr):  # fmt: skip
        # Online softmax of one [64, BLOCK_N] score tile in fp32, exp2 domain (m is the scaled row max).
        # EXP2_POLY > 0 (opt-in, FUSEKIT_HOPPER_ATTN_EXP2_POLY): 1 / 2^EXP2_POLY of p's columns through the
        # degree-EXP2_DEGREE polynomial on the FMA pipe (_exp2_poly.py), the rest (and alpha) through MUFU.
        if MASK:
            kn = start_n + cols
            valid = gl.expand_dims(kn < SKV, 0)
            if CAUSAL:
                valid = valid & (gl.expand_dims(kn, 0) <= gl.expand_dims(rows + diag, 1))
            s = gl.where(valid, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0, no NaN
            if EXP2_POLY == 0:
                p = gl.exp2(s - gl.expand_dims(m_use, 1))
            else:
                p = exp2_mixed_gluon(s - gl.expand_dims(m_use, 1), EXP2_POLY, EXP2_DEGREE)
        else:
            # qk_scale >= 0, so max(s) * scale is the scaled max and the scale folds into one FMA
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # every score -inf: p = 0, not NaN
            if EXP2_POLY == 0:
                p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
            else:
                p = exp2_mixed_gluon(s * qk_scale - gl.expand_dims(m_use, 1), EXP2_POLY, EXP2_DEGREE)
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _named_barrier(dummy, WHICH: gl.constexpr, SYNC: gl.constexpr):
        # FA3's warpgroup pingpong: named barriers 8 + WHICH over both consumer warpgroups (256 threads); a
        # warpgroup syncs on its own before issuing its GEMMs and arrives on the other's after. (Triton's own
        # partition barriers use the low ids.) Inline asm: Gluon on Triton 3.6 has no named-barrier op.
        if SYNC:
            if WHICH == 0:
                gl.inline_asm_elementwise("bar.sync 8, 256;\nmov.b32 $0, $1;", "=r,r", [dummy], dtype=gl.int32,
                                          is_pure=False, pack=1)  # fmt: skip
            else:
                gl.inline_asm_elementwise("bar.sync 9, 256;\nmov.b32 $0, $1;", "=r,r", [dummy], dtype=gl.int32,
                                          is_pure=False, pack=1)  # fmt: skip
        else:
            if WHICH == 0:
                gl.inline_asm_elementwise("bar.arrive 8, 256;\nmov.b32 $0, $1;", "=r,r", [dummy], dtype=gl.int32,
                                          is_pure=False, pack=1)  # fmt: skip
            else:
                gl.inline_asm_elementwise("bar.arrive 9, 256;\nmov.b32 $0, $1;", "=r,r", [dummy], dtype=gl.int32,
                                          is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def _consumer_step(idx, j, p, m_i, l_i, acc, q_s, k_bufs, v_bufs, k_ready, v_ready, kv_empty, rows, cols,
                       qk_scale, diag, SKV, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       MASK: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr,
                       PINGPONG: gl.constexpr, K_EARLY: gl.constexpr, EXP2_POLY: gl.constexpr,
                       EXP2_DEGREE: gl.constexpr):  # fmt: skip
        # Tile j's scores overlap tile j-1's P V: issue S_j, issue PV_{j-1}, wait for S_j only, softmax, then
        # wait for PV_{j-1}, free slot j-1 and rescale O. K_EARLY: K_j's slot is freed once S_j is done.
        # idx: tile j's position in the ring's sequence of loads (j, or j plus the tiles of the work tiles
        # before in the persistent kernel): it gives the slot and the phase.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        slot = idx % STAGES
        pslot = (idx - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (idx // STAGES) & 1)
        if PINGPONG:  # wait for this warpgroup's turn to issue its two GEMMs
            _named_barrier(j, WG, True)
        s_tok = warpgroup_mma(q_s, k_bufs.index(slot).permute((1, 0)),
                              gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False,
                              is_async=True)  # fmt: skip
        mbarrier.wait(v_ready.index(pslot), ((idx - 1) // STAGES) & 1)
        acc_tok = warpgroup_mma(p, v_bufs.index(pslot), acc, is_async=True)
        if PINGPONG:  # hand the tensor cores to the other warpgroup while this one runs its softmax
            if WG == 0:
                _named_barrier(j, 1, False)
            else:
                if j < n_tiles - 1:  # warpgroup 0 waits n_tiles - 1 times; one arrival came before the loop
                    _named_barrier(j, 0, False)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        if K_EARLY:
            mbarrier.arrive(kv_empty.index(STAGES + slot), count=1)
        p_new, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, rows, cols, j * BLOCK_N, qk_scale, diag, SKV,
                                               MASK, CAUSAL, EXP2_POLY, EXP2_DEGREE)  # fmt: skip
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p))  # p stays live until PV is done
        mbarrier.arrive(kv_empty.index(pslot), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
        p = gl.convert_layout(p_new.to(q_s.dtype), p.type.layout)
        return p, m_i, l_i, acc

    @gluon.jit
    def _consumer(o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, lse_ptr, bh, S, SKV,
                  qk_scale, m0, n_tiles, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, HOST: gl.constexpr,
                  PINGPONG: gl.constexpr, K_EARLY: gl.constexpr, EXP2_POLY: gl.constexpr,
                  EXP2_DEGREE: gl.constexpr):  # fmt: skip
        # One work tile per CTA: Q phase 0, the ring from its start, O out through this warpgroup's Q buffer.
        _consumer_tile(o_desc, q_smem.index(WG), q_smem.index(WG), k_bufs, v_bufs, q_bar, 0, q_bar, k_ready,
                       v_ready, kv_empty, lse_ptr, bh, S, SKV, qk_scale, m0, n_tiles, 0, WG, HEAD_DIM, BLOCK_N,
                       STAGES, CAUSAL, HOST, PINGPONG, K_EARLY, False, EXP2_POLY, EXP2_DEGREE)  # fmt: skip

    @gluon.jit
    def _consumer_tile(o_desc, q_s, o_s, k_bufs, v_bufs, q_bar, q_phase, q_empty, k_ready, v_ready, kv_empty,
                       lse_ptr, bh, S, SKV, qk_scale, m0, n_tiles, c, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, HOST: gl.constexpr,
                       PINGPONG: gl.constexpr, K_EARLY: gl.constexpr, PERSIST: gl.constexpr,
                       EXP2_POLY: gl.constexpr, EXP2_DEGREE: gl.constexpr):  # fmt: skip
        # One work tile (64 query rows m0 + 64 WG.. of head bh against n_tiles key tiles) of one consumer
        # warpgroup. q_phase: the parity of q_bar's phase that brings this tile's Q; c: how many K/V tiles the
        # ring carried before this work tile (slot c % STAGES, phase (c // STAGES) & 1 for its first).
        # PERSIST: arrive on q_empty once the last S = Q K^T is done (the producer may refill Q while this
        # warpgroup finishes P V and the epilogue) and send O through o_s, a buffer of its own, after the
        # previous work tile's O store has left it; else o_s is q_s and the store is waited for at the end.
        M: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_s.dtype

        r0 = m0 + WG * M
        rows = r0 + gl.arange(0, M, layout=row_s)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        diag = SKV - S  # row i sees keys j <= i + diag
        if CAUSAL:
            n_full = gl.minimum(gl.maximum(r0 + diag + 1, 0), SKV) // BLOCK_N  # tiles every row sees
        else:
            n_full = SKV // BLOCK_N
        n_full = gl.minimum(n_full, n_tiles)

        # tile 0 (always masked: it may be the only tile and see no key)
        slot0 = c % STAGES
        mbarrier.wait(q_bar, q_phase)
        mbarrier.wait(k_ready.index(slot0), (c // STAGES) & 1)
        s_tok = warpgroup_mma(q_s, k_bufs.index(slot0).permute((1, 0)),
                              gl.zeros([M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                              is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        if K_EARLY:
            mbarrier.arrive(kv_empty.index(STAGES + slot0), count=1)
        m_i = gl.full([M], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([M], gl.float32, row_s)
        p, m_i, l_i, _alpha = _softmax_tile(s, m_i, l_i, rows, cols, 0, qk_scale, diag, SKV, True, CAUSAL,
                                            EXP2_POLY, EXP2_DEGREE)  # fmt: skip
        p = gl.convert_layout(p.to(dtype), p_layout)
        acc = gl.zeros([M, HEAD_DIM], gl.float32, o_layout)
        # warpgroup 0 issues first (compile-time test outside, runtime test inside: not one `and`)
        if PINGPONG and WG == 1:  # noqa: SIM102
            if n_tiles > 1:
                _named_barrier(n_tiles, 0, False)

        for j in range(1, n_full):
            p, m_i, l_i, acc = _consumer_step(c + j, j, p, m_i, l_i, acc, q_s, k_bufs, v_bufs, k_ready, v_ready,
                                              kv_empty, rows, cols, qk_scale, diag, SKV, n_tiles, BLOCK_N, STAGES, False,
                                              CAUSAL, WG, PINGPONG, K_EARLY, EXP2_POLY, EXP2_DEGREE)  # fmt: skip
        for j in range(gl.maximum(n_full, 1), n_tiles):
            p, m_i, l_i, acc = _consumer_step(c + j, j, p, m_i, l_i, acc, q_s, k_bufs, v_bufs, k_ready, v_ready,
                                              kv_empty, rows, cols, qk_scale, diag, SKV, n_tiles, BLOCK_N, STAGES, True,
                                              CAUSAL, WG, PINGPONG, K_EARLY, EXP2_POLY, EXP2_DEGREE)  # fmt: skip
        if PERSIST:  # the last S = Q K^T is done: Q's buffer may take the next work tile's rows
            mbarrier.arrive(q_empty, count=1)

        # the last tile's P V
        last = c + n_tiles - 1
        lslot = last % STAGES
        mbarrier.wait(v_ready.index(lslot), (last // STAGES) & 1)
        acc_tok = warpgroup_mma(p, v_bufs.index(lslot), acc, is_async=True)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, p))
        mbarrier.arrive(kv_empty.index(lslot), count=1)

        # epilogue: O through this warpgroup's Q buffer (its last wgmma is done; PERSIST: its own O buffer, once
        # the previous work tile's store has read it) and a TMA store clipped at S
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # no visible key: acc is 0, the row stays exactly 0
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
        if PERSIST:
            tma.store_wait(0)
        o_s.store(out.to(dtype))
        fence_async_shared()
        if HOST:  # [B*H, S, D] descriptor built on the host: rows clip at this head's S
            _tma_store(o_desc, [bh, r0, 0], o_s.reshape([1, M, HEAD_DIM]))
        else:
            _tma_store(o_desc, [r0, 0], o_s)
        # lse in the natural log: (m + log2 l) * ln 2; no visible key: -inf; a +inf score: +inf
        lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
        lse = gl.where(l_i == 0.0, float("-inf"), lse)
        lse = gl.where(m_i == float("inf"), float("inf"), lse)
        gl.store(lse_ptr + bh.to(gl.int64) * S + rows, lse, mask=rows < S)
        if not PERSIST:  # the persistent consumer waits before its next O store and at its end
            tma.store_wait(0)

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr):
        # The mbarriers of a producer/consumer ring (here and in _attention_hopper_bwd.py): `once` for the
        # tiles loaded once per CTA, two "ready" per slot (two tensors whose TMA loads land separately) and an
        # "empty" per slot on which both consumer warpgroups arrive.
        once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(once, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_a.index(i), count=1)
            mbarrier.init(ready_b.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        return once, ready_a, ready_b, empty

    @gluon.jit
    def _load_kv_tile(desc, b, hkv, row, bar, buf, HOST: gl.constexpr):
        # One K or V tile (rows row..row+BLOCK_N of this kv head) into a ring slot, arriving on `bar`: the
        # [1, 1, BLOCK_N, D] box of a host descriptor over [B, Hkv, Skv, D], or a per-head [BLOCK_N, D] box.
        mbarrier.expect(bar, desc.block_type.nbytes)
        if HOST:
            _tma_load(desc, [b, hkv, row, 0], bar, buf.reshape([1, 1, buf.shape[0], buf.shape[1]]))
        else:
            _tma_load(desc, [row, 0], bar, buf)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, m0,
                  n_tiles, bh, b, hkv, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HOST: gl.constexpr,
                  K_EARLY: gl.constexpr):  # fmt: skip
        _producer_tile(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, m0,
                       n_tiles, bh, b, hkv, 0, BLOCK_N, STAGES, HOST, K_EARLY)  # fmt: skip

    @gluon.jit
    def _producer_tile(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, m0,
                       n_tiles, bh, b, hkv, c, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HOST: gl.constexpr,
                       K_EARLY: gl.constexpr):  # fmt: skip
        # One work tile's loads: Q's two halves, then its n_tiles K/V tiles into the ring, whose sequence of
        # loads is at c (the tiles of earlier work tiles; 0 in the one-tile-per-CTA kernel).
        # HOST: descriptors built on the host over q [B*H, S, D] and k/v [B, Hkv, Skv, D] (through their
        # strides); the 2-D ring slots are viewed with the descriptor's rank. Else per-head 2-D descriptors.
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        if HOST:
            _tma_load(q_desc, [bh, m0, 0], q_bar, q_smem.index(0).reshape([1, 64, HEAD_DIM]))
            _tma_load(q_desc, [bh, m0 + 64, 0], q_bar, q_smem.index(1).reshape([1, 64, HEAD_DIM]))
        else:
            _tma_load(q_desc, [m0, 0], q_bar, q_smem.index(0))
            _tma_load(q_desc, [m0 + 64, 0], q_bar, q_smem.index(1))
        for j in range(n_tiles):
            idx = c + j
            slot = idx % STAGES
            # a fresh mbarrier counts as having completed the phase before 0: the first round passes
            if K_EARLY:  # K's own empty barriers (freed after S = Q K^T), then V's
                mbarrier.wait(kv_empty.index(STAGES + slot), ((idx // STAGES) & 1) ^ 1)
                _load_kv_tile(k_desc, b, hkv, j * BLOCK_N, k_ready.index(slot), k_bufs.index(slot), HOST)
                mbarrier.wait(kv_empty.index(slot), ((idx // STAGES) & 1) ^ 1)
            else:
                mbarrier.wait(kv_empty.index(slot), ((idx // STAGES) & 1) ^ 1)
                _load_kv_tile(k_desc, b, hkv, j * BLOCK_N, k_ready.index(slot), k_bufs.index(slot), HOST)
            _load_kv_tile(v_desc, b, hkv, j * BLOCK_N, v_ready.index(slot), v_bufs.index(slot), HOST)

    @gluon.jit
    def _kv_tiles(m0, S, SKV, BM: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        # Key tiles of the query block at m0 (at least 1: a causal block that sees no key runs one all-masked
        # tile and writes o = 0, lse = -inf).
        if CAUSAL:  # keys past the last one any row of the block sees are never loaded
            hi = gl.minimum(gl.maximum(m0 + BM + SKV - S, 0), SKV)
            n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
        else:
            n_tiles = gl.cdiv(SKV, BLOCK_N)
        return n_tiles

    @gluon.jit
    def _fwd_body(q_desc, k_desc, v_desc, o_desc, lse_ptr, H, HKV, S, SKV, qk_scale, HEAD_DIM: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                  PRODUCER_REGS: gl.constexpr, HOST: gl.constexpr, PINGPONG: gl.constexpr,
                  K_EARLY: gl.constexpr, EXP2_POLY: gl.constexpr, EXP2_DEGREE: gl.constexpr):  # fmt: skip
        BM: gl.constexpr = 128
        M: gl.constexpr = 64
        WG0: gl.constexpr = 0  # partition arguments must be IR values or constexprs, not Python ints
        WG1: gl.constexpr = 1
        dtype: gl.constexpr = q_desc.dtype
        pid_m = gl.program_id(0)
        if CAUSAL:  # heaviest query blocks first
            pid_m = gl.num_programs(0) - 1 - pid_m
        bh = gl.program_id(1)
        b = bh // H
        h = bh % H
        hkv = h // (H // HKV)
        m0 = pid_m * BM
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

        n_tiles = _kv_tiles(m0, S, SKV, BM, BLOCK_N, CAUSAL)

        q_smem = gl.allocate_shared_memory(dtype, [2, M, HEAD_DIM], q_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar, k_ready, v_ready, kv_empty = ring_barriers(STAGES)
        # K_EARLY: kv_empty [0, STAGES) says a V slot is free (after P V), [STAGES, 2 STAGES) a K slot (after S)
        if K_EARLY:
            kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2 * STAGES):
                mbarrier.init(kv_empty.index(i), count=2)

        gl.warp_specialize(
            [
                (_consumer, (o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, lse_ptr, bh, S, SKV,
                             qk_scale, m0, n_tiles, WG0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, HOST,
                             PINGPONG, K_EARLY, EXP2_POLY, EXP2_DEGREE)),
                (_consumer, (o_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, lse_ptr, bh, S, SKV,
                             qk_scale, m0, n_tiles, WG1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, HOST,
                             PINGPONG, K_EARLY, EXP2_POLY, EXP2_DEGREE)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                             m0, n_tiles, bh, b, hkv, BLOCK_N, STAGES, HOST, K_EARLY)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip

    @gluon.jit
    def _attn_fwd_hopper_hd(q_desc, k_desc, v_desc, o_desc, lse_ptr, H, HKV, S, SKV, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr = False,
                            K_EARLY: gl.constexpr = False, EXP2_POLY: gl.constexpr = 0,
                            EXP2_DEGREE: gl.constexpr = 3):  # fmt: skip
        # Host-built descriptors (kernel parameters): no per-CTA descriptor construction in the prologue.
        _fwd_body(q_desc, k_desc, v_desc, o_desc, lse_ptr, H, HKV, S, SKV, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                  CAUSAL, CONSUMER_REGS, PRODUCER_REGS, True, PINGPONG, K_EARLY, EXP2_POLY, EXP2_DEGREE)  # fmt: skip

    _attn_fwd_hopper_hd = fast_launch(_attn_fwd_hopper_hd)  # launched through launch_keyed (run_hopper)

    @gluon.jit
    def _attn_fwd_hopper(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, H, HKV, S, SKV, qk_scale,
                         stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                         HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr = False,
                         K_EARLY: gl.constexpr = False, EXP2_POLY: gl.constexpr = 0,
                         EXP2_DEGREE: gl.constexpr = 3):  # fmt: skip
        # Descriptors built on the device, per head (needs Triton's global scratch allocator).
        M: gl.constexpr = 64
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        bh = gl.program_id(1)
        b = bh // H
        hkv = (bh % H) // (H // HKV)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        qo_off = bh.to(gl.int64) * S * HEAD_DIM
        q_desc = tma.make_tensor_descriptor(q_ptr + qo_off, [S, HEAD_DIM], [HEAD_DIM, 1], [M, HEAD_DIM],
                                            q_layout)  # fmt: skip
        o_desc = tma.make_tensor_descriptor(o_ptr + qo_off, [S, HEAD_DIM], [HEAD_DIM, 1], [M, HEAD_DIM],
                                            q_layout)  # fmt: skip
        k_base = k_ptr + b.to(gl.int64) * stride_kb + hkv.to(gl.int64) * stride_kh
        v_base = v_ptr + b.to(gl.int64) * stride_vb + hkv.to(gl.int64) * stride_vh
        k_desc = tma.make_tensor_descriptor(k_base, [SKV, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM],
                                            kv_layout)  # fmt: skip
        v_desc = tma.make_tensor_descriptor(v_base, [SKV, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM],
                                            kv_layout)  # fmt: skip
        _fwd_body(q_desc, k_desc, v_desc, o_desc, lse_ptr, H, HKV, S, SKV, qk_scale, HEAD_DIM, BLOCK_N, STAGES,
                  CAUSAL, CONSUMER_REGS, PRODUCER_REGS, False, PINGPONG, K_EARLY, EXP2_POLY, EXP2_DEGREE)  # fmt: skip

    # --- persistent variant (FUSEKIT_HOPPER_ATTN_PERSIST / PERSISTENT_DIMS; see the module docstring) -------
    @gluon.jit
    def _persist_tile(t, n_m, S, SKV, BLOCK_N: gl.constexpr):
        # Non-causal work tile t -> (m0, bh, key tiles): m fastest, so the CTAs working at the same time share
        # (b, h) and that head's K/V stays in L2 (every tile costs the same: no balance to keep).
        bh = t // n_m
        mb = t % n_m
        m0 = mb * 128
        return m0, bh, _kv_tiles(m0, S, SKV, 128, BLOCK_N, False)

    @gluon.jit
    def _persist_unit(u, w, PAIRS, SEC, PER, n_m, BH):
        # Causal schedule unit u -> (tiles in it, query block and head of its tile w). Heads (b * H + h) are cut
        # into sections of SEC (the last one may have fewer: g), PER units per full section; sections in order.
        # PAIRS = 0 ("sections", FA3's order; "global" is SEC = B * H): unit (k, h) is the tile of block
        # n_m - 1 - k, heads fastest. PAIRS = 1 ("pairs"): unit (k, h), k < n_m // 2, is head h's blocks
        # n_m - 1 - k, then k (their key tiles add up to about the same for every k), heads fastest; an odd
        # n_m's middle blocks follow, paired across heads (2v, 2v + 1). Recomputed per tile from the (u, w) cursor
        # rather than carried: the producer has 24 registers, the consumers none to spare at D128.
        sec = u // PER
        r = u - sec * PER
        base = sec * SEC
        g = gl.minimum(SEC, BH - base)
        levels = n_m // (1 + PAIRS)  # unit levels per head: n_m // 2 pairs, or n_m single tiles
        n_lev = g * levels
        k = r // g
        v = r - n_lev
        if r < n_lev:
            nt = 1 + PAIRS
            mb = n_m - 1 - k + w * (2 * k + 1 - n_m)
            bh = base + r - k * g
        else:  # an odd n_m's middle block (PAIRS only)
            nt = 1 + (2 * v + 1 < g).to(gl.int32)
            mb = levels + v * 0
            bh = base + 2 * v + w
        return nt, mb, bh

    @gluon.jit
    def _persist_causal_tile(u, w, PAIRS, SEC, PER, n_m, BH, S, SKV, BLOCK_N: gl.constexpr):
        # The causal cursor (unit u, its tile w) -> (tiles in the unit, m0, bh, key tiles): what the producer
        # and the consumers walk in lockstep.
        nt, mb, bh = _persist_unit(u, w, PAIRS, SEC, PER, n_m, BH)
        m0 = mb * 128
        return nt, m0, bh, _kv_tiles(m0, S, SKV, 128, BLOCK_N, True)

    @gluon.jit
    def _persist_next(u, w, nt, nprog):
        # The cursor's next position: the unit's next tile, else tile 0 of this CTA's next unit.
        w += 1
        done = w == nt
        return gl.where(done, u + nprog, u), gl.where(done, 0, w)

    @gluon.jit
    def _consumer_persist(o_desc, q_smem, o_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready, kv_empty,
                          lse_ptr, pid, nprog, BH, S, SKV, qk_scale, PAIRS, SEC, PER, NU, WG: gl.constexpr,
                          HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          CAUSAL: gl.constexpr, K_EARLY: gl.constexpr, EXP2_POLY: gl.constexpr,
                          EXP2_DEGREE: gl.constexpr):  # fmt: skip
        # Work tiles in schedule order (causal: units pid, pid + nprog, ... of NU, each 1 or 2 work tiles; else
        # tiles pid, pid + nprog, ...): the i-th brings its Q with q_bar's phase i (parity i & 1); c counts the
        # K/V tiles the ring carried before it, so slots and phases continue across work tiles.
        n_m = gl.cdiv(S, 128)
        c = 0
        it = 0
        if CAUSAL:
            u = pid
            w = pid * 0
            while u < NU:  # cursor (unit u, its tile w): one loop, fewer registers live than a nested one
                nt, m0, bh, n_tiles = _persist_causal_tile(u, w, PAIRS, SEC, PER, n_m, BH, S, SKV, BLOCK_N)
                _consumer_tile(o_desc, q_smem.index(WG), o_smem.index(WG), k_bufs, v_bufs, q_bar, it & 1, q_empty,
                               k_ready, v_ready, kv_empty, lse_ptr, bh, S, SKV, qk_scale, m0, n_tiles, c, WG,
                               HEAD_DIM, BLOCK_N, STAGES, CAUSAL, True, False, K_EARLY, True, EXP2_POLY,
                               EXP2_DEGREE)  # fmt: skip
                c += n_tiles
                it += 1
                u, w = _persist_next(u, w, nt, nprog)
        else:
            for t in range(pid, n_m * BH, nprog):
                m0, bh, n_tiles = _persist_tile(t, n_m, S, SKV, BLOCK_N)
                _consumer_tile(o_desc, q_smem.index(WG), o_smem.index(WG), k_bufs, v_bufs, q_bar, it & 1, q_empty,
                               k_ready, v_ready, kv_empty, lse_ptr, bh, S, SKV, qk_scale, m0, n_tiles, c, WG,
                               HEAD_DIM, BLOCK_N, STAGES, CAUSAL, True, False, K_EARLY, True, EXP2_POLY,
                               EXP2_DEGREE)  # fmt: skip
                c += n_tiles
                it += 1
        tma.store_wait(0)

    @gluon.jit
    def _producer_persist(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready,
                          kv_empty, pid, nprog, H, HKV, BH, S, SKV, PAIRS, SEC, PER, NU, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, CAUSAL: gl.constexpr, K_EARLY: gl.constexpr):  # fmt: skip
        # The same work tiles in the same order as the consumers. Before the i-th tile's Q it waits until both
        # consumers have released tile i-1's (q_empty phase i-1, parity (i & 1) ^ 1: a fresh barrier passes the
        # first); the K/V loads then run ahead into the ring as slots free up, across work tiles.
        n_m = gl.cdiv(S, 128)
        c = 0
        it = 0
        if CAUSAL:
            u = pid
            w = pid * 0
            while u < NU:
                nt, m0, bh, n_tiles = _persist_causal_tile(u, w, PAIRS, SEC, PER, n_m, BH, S, SKV, BLOCK_N)
                b = bh // H
                hkv = (bh % H) // (H // HKV)
                mbarrier.wait(q_empty, (it & 1) ^ 1)
                _producer_tile(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                               m0, n_tiles, bh, b, hkv, c, BLOCK_N, STAGES, True, K_EARLY)  # fmt: skip
                c += n_tiles
                it += 1
                u, w = _persist_next(u, w, nt, nprog)
        else:
            for t in range(pid, n_m * BH, nprog):
                m0, bh, n_tiles = _persist_tile(t, n_m, S, SKV, BLOCK_N)
                b = bh // H
                hkv = (bh % H) // (H // HKV)
                mbarrier.wait(q_empty, (it & 1) ^ 1)
                _producer_tile(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty,
                               m0, n_tiles, bh, b, hkv, c, BLOCK_N, STAGES, True, K_EARLY)  # fmt: skip
                c += n_tiles
                it += 1

    @gluon.jit(do_not_specialize=["PAIRS", "SEC", "PER", "NU"])
    def _attn_fwd_hopper_persist(q_desc, k_desc, v_desc, o_desc, lse_ptr, H, HKV, S, SKV, BH, qk_scale, PAIRS, SEC,
                                 PER, NU, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                 CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                 K_EARLY: gl.constexpr, EXP2_POLY: gl.constexpr = 0,
                                 EXP2_DEGREE: gl.constexpr = 3):  # fmt: skip
        # Persistent: grid (min(SMs, schedule units), 1), host descriptors; each CTA takes units pid, pid +
        # nprog, ... (static round-robin) over one set of buffers and barriers: non-causal a unit is a work tile,
        # causal one or two (_persist_unit; PAIRS, SEC, PER, NU from _persist_schedule). O leaves through o_smem, so
        # Q's buffer is refilled for the next work tile while the consumers finish P V and the epilogue.
        M: gl.constexpr = 64
        WG0: gl.constexpr = 0
        WG1: gl.constexpr = 1
        dtype: gl.constexpr = q_desc.dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], dtype)
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)

        q_smem = gl.allocate_shared_memory(dtype, [2, M, HEAD_DIM], q_layout)
        o_smem = gl.allocate_shared_memory(dtype, [2, M, HEAD_DIM], q_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        q_bar, k_ready, v_ready, kv_empty = ring_barriers(STAGES)
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_empty, count=2)  # one arrival per consumer warpgroup
        if K_EARLY:
            kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2 * STAGES):
                mbarrier.init(kv_empty.index(i), count=2)

        gl.warp_specialize(
            [
                (_consumer_persist, (o_desc, q_smem, o_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready,
                                     kv_empty, lse_ptr, pid, nprog, BH, S, SKV, qk_scale, PAIRS, SEC, PER, NU, WG0,
                                     HEAD_DIM, BLOCK_N, STAGES, CAUSAL, K_EARLY, EXP2_POLY, EXP2_DEGREE)),
                (_consumer_persist, (o_desc, q_smem, o_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready, v_ready,
                                     kv_empty, lse_ptr, pid, nprog, BH, S, SKV, qk_scale, PAIRS, SEC, PER, NU, WG1,
                                     HEAD_DIM, BLOCK_N, STAGES, CAUSAL, K_EARLY, EXP2_POLY, EXP2_DEGREE)),
                (_producer_persist, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, q_empty, k_ready,
                                     v_ready, kv_empty, pid, nprog, H, HKV, BH, S, SKV, PAIRS, SEC, PER, NU, BLOCK_N,
                                     STAGES, CAUSAL, K_EARLY)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip

    _attn_fwd_hopper_persist = fast_launch(_attn_fwd_hopper_persist)  # launched through launch_keyed


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _aligned16(t: torch.Tensor) -> bool:
    """A host TMA descriptor over t's own shape and strides: a 16-byte aligned base and strides, and no
    broadcast dimension (stride 0 over a size > 1: an expanded MQA k/v, a batch-shared prefix), which
    passes the 16-byte rule but is outside what cuTensorMapEncodeTiled documents; such calls take the
    Triton kernels, which address heads and batches with pointer arithmetic."""
    es = t.element_size()
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return False
    return t.data_ptr() % 16 == 0 and all((st * es) % 16 == 0 for st in t.stride()[:-1])


def hopper_supported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor | None = None
) -> bool:
    """Whether hopper_forward can run these tensors: Gluon with its Hopper module, an sm_90 CUDA device (wgmma
    is sm_90a only), no kv_len, fp16/bf16, D 64/128/256, q, k, v with a contiguous last dim and 16-byte aligned
    base and strides (TMA; a q that is not contiguous is copied first: run_hopper's callers pass it dense),
    non-empty, B*H within the grid limit."""
    if not HAS_GLUON or kv_len is not None:
        return False
    if is_interpreter():
        return False  # Gluon kernels do not run in the interpreter
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or torch.version.hip is not None:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        return False
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    if D not in HEAD_DIMS or k.shape[0] != B or k.shape[3] != D or Hkv == 0 or H % Hkv:
        return False
    if S == 0 or Skv == 0 or B * H == 0:
        return False
    if _capability(q.device.index) != (9, 0):
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    return all(_aligned16(t) for t in (q, k, v))


def hopper_forward(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    qk_scale: float,
) -> None:
    """o[B, H, S, D] = attention(q, k, v), lse[B, H, S] fp32; qk_scale = scale * log2(e) >= 0. Call only where
    hopper_supported(q, k, v, None) is True; o must be contiguous and 16-byte aligned, lse contiguous fp32."""
    if not hopper_supported(q, k, v, None):
        raise ValueError("hopper_forward: unsupported inputs (see hopper_supported)")
    if o.shape != q.shape or o.dtype != q.dtype or not o.is_contiguous() or o.data_ptr() % 16:
        raise ValueError(f"hopper_forward: o must be a contiguous 16-byte aligned {tuple(q.shape)} {q.dtype}")
    B, H, S = q.shape[:3]
    if lse.shape != (B, H, S) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"hopper_forward: lse must be contiguous fp32 {(B, H, S)}")
    if qk_scale < 0:
        raise ValueError("hopper_forward: qk_scale must be >= 0 (negate q instead)")
    with on_device(q):
        run_hopper(o, lse, q.contiguous(), k, v, causal, qk_scale)


# Plan/run split (FlashInfer's): what run_hopper decides from the shapes, k/v strides, dtype, device, causal flag
# and the FUSEKIT_HOPPER_ATTN_* switches - kernel, tile config, schedule, grid, launch key, the descriptors'
# validated fields - is made once per such signature (_FwdPlan); a call then rebases the descriptors on its
# tensors and launches. Before it, run_hopper took 91 us of the H200 host's time per call at B1 H32/8 S2048
# D128 causal, against 34 us for SDPA's whole forward (benchmarks/gpu_checks/attention_host.py at 9f3122f).
_FWD_ENV = EnvSnapshot(
    "FUSEKIT_HOPPER_ATTN_CFG", "FUSEKIT_HOPPER_ATTN_PERSIST", "FUSEKIT_HOPPER_ATTN_DESC", "FUSEKIT_HOPPER_ATTN_PINGPONG",
    "FUSEKIT_HOPPER_ATTN_PERSIST_SECTION", "FUSEKIT_HOPPER_ATTN_PERSIST_ORDER", "FUSEKIT_HOPPER_ATTN_PERSIST_CTAS",
    "FUSEKIT_HOPPER_ATTN_EXP2_POLY", "FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE",
)  # fmt: skip
_FWD_PLANS: dict[tuple, _FwdPlan] = {}


class _FwdPlan:
    """One forward signature's decisions. persistent: one launch of _attn_fwd_hopper_persist (`args` its int
    arguments after qk_scale's place, `ints` those before); else one launch of _attn_fwd_hopper_hd per batch
    slab of at most _MAX_GRID_Y heads (`slabs`: (slice, grid, key) each), or the device-descriptor kernel
    (host False, probes). `fields`: the q, k, v, o descriptors' validated fields per slab shape."""

    __slots__ = ("args", "consts", "fields", "grid", "host", "ints", "key", "persistent", "slabs")


def clear_plans() -> None:
    """Forget the forward plans (tests that patch what a plan is built from: num_sms, l2_bytes, ...)."""
    _FWD_PLANS.clear()


def run_hopper(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    qk_scale: float,
) -> None:
    """hopper_forward minus its checks, on the current device (attention.forward has made both; q dense): the
    signature's plan (_FwdPlan, made on its first call), then the launch. Host descriptors launch through the
    lean path (launch_keyed): Gluon's JIT binder costs 150-290 us per call on descriptor arguments, the
    remembered compiled kernel a few (the descriptors are rebased every call: they hold the data pointers)."""
    sig = (q.shape, k.shape, k.stride(), v.stride(), q.dtype, q.device, bool(causal), _FWD_ENV())
    plan = _FWD_PLANS.get(sig)
    if plan is None:
        plan = remember(_FWD_PLANS, sig, _fwd_plan(q, k, v, bool(causal)))
    if plan.persistent:
        _run_persistent(plan, o, lse, q, k, v, qk_scale)
    elif plan.host:
        for (sl, grid, key), fields in zip(plan.slabs, plan.fields, strict=True):
            qq, kk, vv, oo, ll = (q, k, v, o, lse) if sl is None else (q[sl], k[sl], v[sl], o[sl], lse[sl])
            qd, kd, vd, od = _host_descriptors(fields, qq, kk, vv, oo)
            launch_keyed(_attn_fwd_hopper_hd, (*key, ll.data_ptr() & 15 == 0), grid,
                         (qd, kd, vd, od, ll, *plan.ints, float(qk_scale)), plan.consts)  # fmt: skip
    else:
        from kernels_triton._config import ensure_tma_allocator

        ensure_tma_allocator()
        H, Hkv, S, Skv = plan.ints
        for sl, grid, _ in plan.slabs:
            qq, kk, vv, oo, ll = (q, k, v, o, lse) if sl is None else (q[sl], k[sl], v[sl], o[sl], lse[sl])
            _attn_fwd_hopper[grid](
                qq, kk, vv, oo, ll, H, Hkv, S, Skv, float(qk_scale),
                kk.stride(0), kk.stride(1), kk.stride(2), vv.stride(0), vv.stride(1), vv.stride(2), **plan.consts,
            )  # fmt: skip


def _fwd_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> _FwdPlan:
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    block_n, stages, k_early = _env_config(D)
    poly, degree = exp2_poly_config()
    plan = _FwdPlan()
    plan.host = os.environ.get("FUSEKIT_HOPPER_ATTN_DESC", "host") != "device"
    plan.persistent = plan.host and persistent_at(D)
    if plan.persistent:
        _persistent_plan(plan, q, k, v, causal, block_n, stages, k_early, poly, degree)
        return plan
    pingpong = os.environ.get("FUSEKIT_HOPPER_ATTN_PINGPONG", "0") == "1"
    plan.consts = dict(HEAD_DIM=D, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, CONSUMER_REGS=CONSUMER_REGS,
                       PRODUCER_REGS=PRODUCER_REGS, PINGPONG=pingpong, K_EARLY=k_early, EXP2_POLY=poly,
                       EXP2_DEGREE=degree, num_warps=NUM_WARPS, maxnreg=MAXNREG)  # fmt: skip
    plan.ints = (H, Hkv, S, Skv)
    ints = tuple(int_class(n) for n in plan.ints)
    bstep = max(1, _MAX_GRID_Y // H)
    plan.slabs, plan.fields = [], []
    for b0 in range(0, B, bstep):
        sl = slice(b0, min(B, b0 + bstep))
        grid = (triton_cdiv(S, BLOCK_M), (sl.stop - sl.start) * H)
        # everything the compiled kernel depends on: dtypes, constexprs, grid, device, the int arguments'
        # specialization classes (and, per call, lse's 16-byte alignment; descriptors are aligned by contract)
        key = ("attn_hopper", q.device.index, q.dtype, D, causal, block_n, stages, pingpong, k_early, poly, degree,
               grid, *ints)  # fmt: skip
        plan.slabs.append((None if (sl.start, sl.stop) == (0, B) else sl, grid, key))
        if plan.host:
            plan.fields.append(_descriptor_fields(q[sl], k[sl], v[sl], block_n))
    return plan


# Causal schedule of the persistent kernel (see the module docstring): "pairs" (head h's query blocks n_m-1-k
# and k in one unit), "sections" (FA3's order: descending m, heads fastest) within sections of SEC heads whose
# K/V fit in L2 together, or "global" (descending m across all heads: sections of B*H heads, the first order,
# kept for A/B probes). FUSEKIT_HOPPER_ATTN_PERSIST_ORDER=pairs|sections|global forces one,
# FUSEKIT_HOPPER_ATTN_PERSIST_SECTION=n the heads per section (probes, tests).
PERSIST_ORDERS = ("pairs", "sections", "global")
# L2 share a section's K/V may take: the ~nprog work tiles in flight straddle at most two sections (a section is
# >= ~3 x 132 work tiles at S = Skv, D <= 128 on an H100), so two sections' K/V fill at most the whole L2.
PERSIST_L2_SHARE = 0.5
# "pairs" gives every CTA whole units (two work tiles): with U units over P CTAs the busiest CTA runs ceil(U/P),
# the mean U/P. Past this ratio (few units, e.g. 1.1 units a CTA) the default takes "global", whose last work
# tiles are the lightest of all heads (LPT-like, fine grained) instead; such shapes have little K/V in all.
PERSIST_PAIRS_MAX_QUANT = 1.1


def _persist_units(pairs: bool, sec: int, bh: int, n_m: int) -> tuple[int, int]:
    """(units per full section, units in all) of the causal order: a unit is one work tile, or a pair of them
    (an odd n_m's middle blocks pair up across heads)."""
    if not pairs:
        return sec * n_m, bh * n_m
    npl, odd = n_m // 2, n_m % 2
    per = sec * npl + odd * triton_cdiv(sec, 2)
    full, rem = divmod(bh, sec)
    return per, full * per + rem * npl + odd * triton_cdiv(rem, 2)


def _persist_schedule(
    bh: int, group: int, n_m: int, skv: int, d: int, elem: int, l2: int, sms: int
) -> tuple[int, int, int, int]:
    """(PAIRS, SEC, PER, NU) of the causal persistent kernel: the order (the env override, else "pairs" unless
    it quantizes badly, PERSIST_PAIRS_MAX_QUANT), heads per section (SEC: whole GQA groups whose K/V, Skv * D *
    elem * 2 bytes per KV head, fit in PERSIST_L2_SHARE of the L2; at least one group), units per full section
    and units in all."""
    kv_head = skv * d * elem * 2
    sec = max(1, int(l2 * PERSIST_L2_SHARE) // kv_head) * group
    env_sec = os.environ.get("FUSEKIT_HOPPER_ATTN_PERSIST_SECTION")
    if env_sec:
        sec = int(env_sec)
    sec = max(1, min(sec, bh))
    order = os.environ.get("FUSEKIT_HOPPER_ATTN_PERSIST_ORDER", "")
    if order not in PERSIST_ORDERS:
        if order:
            raise ValueError(f"FUSEKIT_HOPPER_ATTN_PERSIST_ORDER={order!r}: one of {PERSIST_ORDERS}")
        nu = _persist_units(True, sec, bh, n_m)[1]
        p = min(sms, nu)
        order = "pairs" if triton_cdiv(nu, p) <= PERSIST_PAIRS_MAX_QUANT * nu / p else "global"
    if order == "global":
        sec = bh
    pairs = order == "pairs"
    return (int(pairs), sec, *_persist_units(pairs, sec, bh, n_m))


def _persistent_plan(plan: _FwdPlan, q, k, v, causal, block_n, stages, k_early, poly, degree) -> None:
    """The persistent kernel over every (query block, head): grid (min(SMs, schedule units), 1), no batch split
    (work tiles are counted in int32: B * H * ceil(S / 128) < 2**31)."""
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    bh = B * H
    n_m = triton_cdiv(S, BLOCK_M)
    work = n_m * bh
    if work >= 2**31:
        raise ValueError(f"hopper_forward (persistent): {work} work tiles overflow int32")
    dev = device_index(q)
    sms = num_sms(dev)
    pairs, sec, per, units = 0, 1, 1, work  # non-causal: unused (every tile costs the same; m fastest)
    if causal:
        pairs, sec, per, units = _persist_schedule(
            bh, H // Hkv, n_m, Skv, D, q.element_size(), l2_bytes(dev), sms
        )
    cap = os.environ.get("FUSEKIT_HOPPER_ATTN_PERSIST_CTAS")
    ctas = min(sms, units, int(cap) if cap else units)
    plan.grid = (max(ctas, 1), 1)
    plan.consts = dict(HEAD_DIM=D, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, CONSUMER_REGS=CONSUMER_REGS,
                       PRODUCER_REGS=PRODUCER_REGS, K_EARLY=k_early, EXP2_POLY=poly, EXP2_DEGREE=degree,
                       num_warps=NUM_WARPS, maxnreg=MAXNREG)  # fmt: skip
    # everything the compiled kernel depends on (as run_hopper's key), with B*H's specialization class too
    # (PAIRS, SEC, PER and NU are not specialized: do_not_specialize); per call, lse's 16-byte alignment
    plan.key = ("attn_hopper_persist", q.device.index, q.dtype, D, causal, block_n, stages, k_early, poly, degree,
                plan.grid, *(int_class(n) for n in (H, Hkv, S, Skv, bh)))  # fmt: skip
    plan.ints = (H, Hkv, S, Skv, bh)
    plan.args = (pairs, sec, per, units)
    plan.fields = _descriptor_fields(q, k, v, block_n)


def _run_persistent(plan: _FwdPlan, o, lse, q, k, v, qk_scale: float) -> None:
    qd, kd, vd, od = _host_descriptors(plan.fields, q, k, v, o)
    launch_keyed(_attn_fwd_hopper_persist, (*plan.key, lse.data_ptr() & 15 == 0), plan.grid,
                 (qd, kd, vd, od, lse, *plan.ints, float(qk_scale), *plan.args), plan.consts)  # fmt: skip


@functools.cache
def _host_layouts(dtype_name: str, head_dim: int, block_n: int):
    """Shared layouts of the host descriptors: q/o [1, 64, D] boxes of [B*H, S, D], k/v [1, 1, BLOCK_N, D] boxes
    of [B, Hkv, Skv, D]; the kernel views its 2-D ring slots with these ranks (same 128-byte swizzle)."""
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype_name]
    return (gl.NVMMASharedLayout.get_default_for([1, WG_M, head_dim], gdt),
            gl.NVMMASharedLayout.get_default_for([1, 1, block_n, head_dim], gdt))  # fmt: skip


def _descriptor_fields(q, k, v, block_n: int) -> tuple:
    """The validated fields (host_descriptor) of the q/o [1, 64, D] boxes of [B*H, S, D] and the k/v
    [1, 1, BLOCK_N, D] boxes of [B, Hkv, Skv, D] (o has q's shape and layout)."""
    B, H, S, D = q.shape
    q_lay, kv_lay = _host_layouts("bf16" if q.dtype == torch.bfloat16 else "fp16", D, block_n)
    fq = descriptor_fields(q.view(B * H, S, D), (1, WG_M, D), q_lay)
    return (
        fq,
        descriptor_fields(k, (1, 1, block_n, D), kv_lay),
        descriptor_fields(v, (1, 1, block_n, D), kv_lay),
    )


def _host_descriptors(fields: tuple, q, k, v, o) -> tuple:
    """q, k, v, o descriptors: the plan's validated fields rebased on this call's tensors."""
    B, H, S, D = q.shape
    fq, fk, fv = fields
    return (
        rebased(fq, q.view(B * H, S, D)),
        rebased(fk, k),
        rebased(fv, v),
        rebased(fq, o.view(B * H, S, D)),
    )


# Gluon's TensorDescriptor validates itself on construction (rank, alignment, strides, layout: ~8 us a
# descriptor on the CPU here, 11 per backward call, 87 us of its ~180 us host path). Everything it checks
# but the base pointer's alignment is fixed by (dtype, shape, strides, box, layout), so each such signature is
# validated once (descriptor_fields) and later descriptors copy its fields with the new base (rebased). The
# remembered fields hold no tensor (base None): nothing stays alive.
_DESC_FIELDS: dict[tuple, tuple[dict, object]] = {}


def descriptor_fields(t: torch.Tensor, block: tuple[int, ...], layout) -> dict:
    """The fields of a validated Gluon TensorDescriptor over `t` (its own shape and strides) with box `block`
    and shared `layout` (a cached layout object: its identity is part of the key, the entry keeps it alive),
    base None."""
    strides = t.stride()
    key = (t.dtype, t.shape, strides, block, id(layout))
    hit = _DESC_FIELDS.get(key)
    if hit is None:
        d = TensorDescriptor(t, list(t.shape), list(strides), list(block), layout)
        hit = remember(_DESC_FIELDS, key, (dict(vars(d), base=None), layout), 4096)
    return hit[0]


def rebased(fields: dict, t: torch.Tensor):
    """A TensorDescriptor with `fields` (descriptor_fields of a tensor of t's dtype, shape and strides) over t."""
    if t.data_ptr() % 16:
        raise ValueError("host_descriptor: the tensor's base must be 16-byte aligned (TMA)")
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(fields)
    d.base = t
    return d


def host_descriptor(t: torch.Tensor, block: tuple[int, ...], layout):
    """A Gluon TensorDescriptor over `t` (its own shape and strides) with box `block` and shared `layout`."""
    return rebased(descriptor_fields(t, block, layout), t)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def aot_specs_gluon(exp2_poly: int = 0, exp2_degree: int = 3) -> list[tuple[str, object, dict, dict, dict]]:
    """(name, gluon kernel, signature, constexprs, options) per (dtype, D, causal) variant, for an ahead-of-time
    compile for sm_90 with triton.experimental.gluon._runtime.GluonASTSource; [] without Gluon. exp2_poly > 0
    (EXP2_POLY: log2 of 1 / the polynomial's fraction; compile checks of the opt-in, not shipped) gives the same
    variants with the polynomial exp2 of degree exp2_degree, named with a _poly{exp2_poly}d{exp2_degree} suffix;
    the default gives the kernels as they ship (EXP2_POLY = 0 compiles to the PTX it did before the switch)."""
    if not HAS_GLUON:
        return []
    tag = f"_poly{exp2_poly}d{exp2_degree}" if exp2_poly else ""
    specs = []
    for dt in ("fp16", "bf16"):
        p = f"*{dt}"
        for d in HEAD_DIMS:
            bn, st = CONFIGS[d]
            for causal in (False, True):
                sig = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "o_ptr": p, "lse_ptr": "*fp32", "H": "i32", "HKV": "i32",
                       "S": "i32", "SKV": "i32", "qk_scale": "fp32", "stride_kb": "i32", "stride_kh": "i32",
                       "stride_kn": "i32", "stride_vb": "i32", "stride_vh": "i32", "stride_vn": "i32",
                       "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr",
                       "CAUSAL": "constexpr", "CONSUMER_REGS": "constexpr", "PRODUCER_REGS": "constexpr",
                       "PINGPONG": "constexpr", "K_EARLY": "constexpr", "EXP2_POLY": "constexpr",
                       "EXP2_DEGREE": "constexpr"}  # fmt: skip
                const = {"HEAD_DIM": d, "BLOCK_N": bn, "STAGES": st, "CAUSAL": causal,
                         "CONSUMER_REGS": CONSUMER_REGS, "PRODUCER_REGS": PRODUCER_REGS, "PINGPONG": False,
                         "K_EARLY": d in K_EARLY_DIMS, "EXP2_POLY": exp2_poly,
                         "EXP2_DEGREE": exp2_degree if exp2_poly else 3}  # fmt: skip
                opts = {"num_warps": NUM_WARPS, "maxnreg": MAXNREG}
                specs.append(
                    (f"attn_hopper_{dt}_d{d}_c{int(causal)}_devdesc{tag}", _attn_fwd_hopper, sig, const, opts)
                )
                q_lay, kv_lay = _host_layouts(dt, d, bn)
                hsig = {"q_desc": f"tensordesc<{dt}[1, {WG_M}, {d}],{q_lay!r}>",
                        "k_desc": f"tensordesc<{dt}[1, 1, {bn}, {d}],{kv_lay!r}>",
                        "v_desc": f"tensordesc<{dt}[1, 1, {bn}, {d}],{kv_lay!r}>",
                        "o_desc": f"tensordesc<{dt}[1, {WG_M}, {d}],{q_lay!r}>"}  # fmt: skip
                hsig.update({k: t for k, t in sig.items() if not k.endswith("_ptr") or k == "lse_ptr"})
                for k in ("stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn"):
                    del hsig[k]
                specs.append(
                    (f"attn_hopper_{dt}_d{d}_c{int(causal)}{tag}", _attn_fwd_hopper_hd, hsig, const, opts)
                )
                # the persistent kernel: BH, qk_scale, PAIRS, SEC, PER, NU; no PINGPONG
                if d in PERSIST_HEAD_DIMS:
                    psig = {k: t for k, t in hsig.items() if k not in ("qk_scale", "PINGPONG")}
                    psig = {**dict(list(psig.items())[:9]), "BH": "i32", "qk_scale": "fp32", "PAIRS": "i32",
                            "SEC": "i32", "PER": "i32", "NU": "i32", **dict(list(psig.items())[9:])}  # fmt: skip
                    pconst = {k: x for k, x in const.items() if k != "PINGPONG"}
                    specs.append(
                        (
                            f"attn_hopper_{dt}_d{d}_c{int(causal)}_persist{tag}",
                            _attn_fwd_hopper_persist,
                            psig,
                            pconst,
                            opts,
                        )
                    )
    return specs
