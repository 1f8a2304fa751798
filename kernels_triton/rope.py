"""Rotary position embedding on x[B, S, H, D] (HF halves or interleaved pairs), fp32 math, one cast.

Entry points (CONTRACT.md): `forward(y, yk, x, cos, sin, positions, k, start_pos, theta, interleaved)` rotates
x (and k, when given: HF's apply_rotary_pos_emb(q, k, ...) in one launch) by the angle, `backward(dx, dk, dy,
cos, sin, positions, dyk, start_pos, theta, interleaved)` by its negative (a rotation's transpose is its
inverse: (a, b) -> (a c + b s, b c - a s)). Both launch the same kernels; the direction is a runtime fp32
`sign` that multiplies the [D/2] sine vector once per program, so backward adds no compiled variant.

Byte floor (forward and backward alike): read x (and k) once, write out once (tables, when given, are
S x D/2 fp32: small and L2-resident). 16 x 4096 x 32 x 128 bf16 = 2 x 537 MB -> 0.25 ms at ~4.3 TB/s.

Positions: start_pos is widened to int64 before s is added (start_pos = 2^31 - 4 with S > 4 would wrap an
int32 and flip the sine's sign) and is not specialized (no recompile per value); validation keeps
start_pos + S <= 2^24, where fp32 holds every position exactly. Element offsets are int64 (b*S*H*D can
pass 2^31). `positions` (int32 [B, S] or None) replaces start_pos + s by positions[b, s]: one scalar load
per program behind a runtime flag (`has_positions`, not specialized, like start_pos), so it adds no compiled
variant. The values are untrusted (CUDA callers skip a host-synced check): they are clamped to
[0, max_position] = [0, St - 1] with tables, [0, 2^24] without, so no value reads outside the tables.

Layouts: x and k are read through their (batch, token, head) strides with each head's D contiguous (the
heads of a fused qkv projection, a [B, H, S, D] tensor read as [B, S, H, D]: no copy before the kernel);
y and yk are dense [B, S, H|Hk, D]. Offsets of a token's first head and of each head are int64.

Tile: one program per (b, s) and BLOCK_H heads x all D, so cos/sin of position s are computed (or read)
once as a [D/2] vector and reused by every head of the tile; each element of x is read and written once.
Interleaved pairs are loaded as one contiguous [BLOCK_H, D] tile and split in registers (reshape + split)
so loads stay 16-byte vectors instead of stride-2 gathers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_triton import _replay
from kernels_triton._config import device_index, last_dim_contiguous, next_pow2, warps_for
from kernels_triton._launch import fast_launch


@triton.jit
def _position(pid_bs, S, start_pos, pos_ptr, has_positions, max_position):
    """The token's position in int64: start_pos + s (an int32 sum wraps for start_pos near 2^31), or
    positions[b, s] clamped to [0, max_position] (untrusted values never index outside the tables)."""
    pos = start_pos.to(tl.int64) + pid_bs % S
    if has_positions:
        p = tl.load(pos_ptr + pid_bs)  # positions is [B, S] contiguous: row b*S + s is program pid_bs
        pos = tl.minimum(tl.maximum(p, 0), max_position).to(tl.int64)
    return pos


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos, i, imask, sign, HALF: tl.constexpr, HAS_TABLE: tl.constexpr):
    """[1, len(i)] cos and sign * sin of position `pos` at frequency indices i (imask: i < D/2): a table row
    of the [St, D/2] fp32 tables, or in-kernel angles fp32(pos) * inv_freq[i], the [D/2] fp32 inv_freq of
    fusekit.ops.rope.inv_freq (float64, rounded once; passed in cos_ptr): every backend's angle has the same
    bits. sign -1 is the backward (the negative angle)."""
    if HAS_TABLE:
        c = tl.load(cos_ptr + pos * HALF + i, mask=imask, other=0.0)
        s = tl.load(sin_ptr + pos * HALF + i, mask=imask, other=0.0)
    else:
        ang = pos.to(tl.float32) * tl.load(cos_ptr + i, mask=imask, other=0.0)
        c = tl.cos(ang)
        s = tl.sin(ang)
    return c[None, :], (s * sign)[None, :]


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, hb, NH, stride_xh, c, s,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, HALVES_AS_PAIRS: tl.constexpr,
):  # fmt: skip
    """Heads hb*BLOCK_H.. of one token: x_ptr at the token's first head (heads stride_xh apart), out_ptr at
    its dense [NH, D] output row: pair (a, b) -> (a c - b s, b c + a s)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = (h < NH)[:, None]
    if INTERLEAVED or HALVES_AS_PAIRS:
        # One [BLOCK_H, D] tile, each head's D contiguous (16-byte vector loads); pairs are separated in
        # registers.
        d = tl.arange(0, HEAD_DIM)
        offs = h[:, None] * HEAD_DIM + d[None, :]
        x_offs = h.to(tl.int64)[:, None] * stride_xh + d[None, :]
        x = tl.load(x_ptr + x_offs, mask=hmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if INTERLEAVED:
            a, b = tl.split(tl.reshape(x, (BLOCK_H, HALF, 2)))
        else:
            a, b = tl.split(tl.permute(tl.reshape(x, (BLOCK_H, 2, HALF)), (0, 2, 1)))
        y = tl.join(a * c - b * s, b * c + a * s)
        if not INTERLEAVED:
            y = tl.permute(y, (0, 2, 1))
        tl.store(out_ptr + offs, tl.reshape(y, (BLOCK_H, HEAD_DIM)).to(out_ptr.dtype.element_ty), mask=hmask)
    else:
        # HF halves as two [BLOCK_H, D/2] half-row tiles.
        i = tl.arange(0, HALF)
        offs = h[:, None] * HEAD_DIM + i[None, :]
        x_offs = h.to(tl.int64)[:, None] * stride_xh + i[None, :]
        a = tl.load(x_ptr + x_offs, mask=hmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        b = tl.load(x_ptr + x_offs + HALF, mask=hmask, other=0.0, eviction_policy="evict_first").to(
            tl.float32
        )
        tl.store(out_ptr + offs, (a * c - b * s).to(out_ptr.dtype.element_ty), mask=hmask)
        tl.store(out_ptr + offs + HALF, (b * c + a * s).to(out_ptr.dtype.element_ty), mask=hmask)


# One binary for every start_pos / positions / table length (no ==1 / %16 variants of these ints), and for
# calls with and without k (its head count and the number of x's head blocks are not specialized either).
# Grid: B*S tokens x `blocks` (x's head blocks then k's) on one axis, blocks fastest: a program rotates one
# token's heads of x or of k with the cos/sin vector it computed; each branch has its own pointers, so loads
# keep their 16-byte alignment.
@fast_launch
@triton.jit(do_not_specialize=["start_pos", "has_positions", "max_position", "HK", "q_blocks", "blocks"])
def _rope_kernel(
    x_ptr, out_ptr, k_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, S, H, HK, q_blocks, blocks, start_pos, has_positions,
    max_position, sign, stride_xb, stride_xs, stride_xh, stride_kb, stride_ks, stride_kh,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, HAS_TABLE: tl.constexpr, INTERLEAVED: tl.constexpr,
    HALVES_AS_PAIRS: tl.constexpr,
):  # fmt: skip
    # x and k through their (batch, token, head) strides: the heads of a fused qkv projection or a
    # [B, H, S, D] tensor are read in place; the outputs are dense [B, S, H|Hk, D].
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)  # one axis, head blocks fastest: a token's heads are neighbours in time
    pid_bs = pid // blocks
    pid_h = pid % blocks
    pos = _position(pid_bs, S, start_pos, pos_ptr, has_positions, max_position)
    i = tl.arange(0, HALF)
    c, s = _cos_sin(cos_ptr, sin_ptr, pos, i, i < HALF, sign, HALF, HAS_TABLE)
    b = (pid_bs // S).to(tl.int64)
    t = (pid_bs % S).to(tl.int64)
    if pid_h < q_blocks:
        _rotate_heads(x_ptr + b * stride_xb + t * stride_xs, out_ptr + pid_bs.to(tl.int64) * H * HEAD_DIM,
                      pid_h, H, stride_xh, c, s, HEAD_DIM, BLOCK_H, INTERLEAVED, HALVES_AS_PAIRS)  # fmt: skip
    else:
        _rotate_heads(k_ptr + b * stride_kb + t * stride_ks, ko_ptr + pid_bs.to(tl.int64) * HK * HEAD_DIM,
                      pid_h - q_blocks, HK, stride_kh, c, s, HEAD_DIM, BLOCK_H, INTERLEAVED,
                      HALVES_AS_PAIRS)  # fmt: skip


@triton.jit
def _rotate_any_d(
    x_ptr, out_ptr, hb, NH, stride_xh, c, s, i, imask,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """_rotate_heads for any even D (pointers at the token's x heads and dense output row, as there)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (h < NH)[:, None] & imask[None, :]
    if INTERLEAVED:
        ja, jb = 2 * i[None, :], 2 * i[None, :] + 1
    else:
        ja, jb = i[None, :], i[None, :] + HALF
    xr, orow = h.to(tl.int64)[:, None] * stride_xh, h[:, None] * HEAD_DIM
    a = tl.load(x_ptr + xr + ja, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + xr + jb, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + orow + ja, (a * c - b * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + orow + jb, (b * c + a * s).to(out_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["start_pos", "has_positions", "max_position", "HK", "q_blocks", "blocks"])
def _rope_any_d_kernel(
    x_ptr, out_ptr, k_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, S, H, HK, q_blocks, blocks, start_pos, has_positions,
    max_position, sign, stride_xb, stride_xs, stride_xh, stride_kb, stride_ks, stride_kh,
    HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_TABLE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Head dims that are not a power of two (e.g. 96): pairs are gathered with masked index vectors."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)  # one axis, head blocks fastest: a token's heads are neighbours in time
    pid_bs = pid // blocks
    pid_h = pid % blocks
    pos = _position(pid_bs, S, start_pos, pos_ptr, has_positions, max_position)
    i = tl.arange(0, BLOCK_HALF)
    imask = i < HALF
    c, s = _cos_sin(cos_ptr, sin_ptr, pos, i, imask, sign, HALF, HAS_TABLE)
    b = (pid_bs // S).to(tl.int64)
    t = (pid_bs % S).to(tl.int64)
    if pid_h < q_blocks:
        _rotate_any_d(x_ptr + b * stride_xb + t * stride_xs, out_ptr + pid_bs.to(tl.int64) * H * HEAD_DIM,
                      pid_h, H, stride_xh, c, s, i, imask, HEAD_DIM, BLOCK_H, INTERLEAVED)  # fmt: skip
    else:
        _rotate_any_d(k_ptr + b * stride_kb + t * stride_ks, ko_ptr + pid_bs.to(tl.int64) * HK * HEAD_DIM,
                      pid_h - q_blocks, HK, stride_kh, c, s, i, imask, HEAD_DIM, BLOCK_H, INTERLEAVED)  # fmt: skip


# A program moves BLOCK_H x D elements: 4 KB of x (16 heads of bf16 at D = 128) on 4 warps, 32 bytes a
# thread (_THREAD_BYTES). Measured on the H200 (bf16 D128, kernel time, L2 flushed): q+k B4 S2048 H32/8
# forward 48.7 us at 16 heads x 2 warps against 56.4 us at the former 32 heads x 8 warps (Liger's kernel
# 46.8, floor 39.3); smaller programs keep more of them in flight per SM, and a program's cos/sin vector
# (D/2 values) is cheap to recompute. With the one-axis grid (.whl/rope_ab.py at 56d5118, same process, two
# rounds): x only B16 S4096 H32 277.8 us (two-axis grid, 2 warps) -> 264.0 (one axis, 2 warps) -> 259.1-259.6
# (one axis, 4 warps; copy_ 257.7, floor 251.5: 97%); q+k B4 S2048 46.3-49.7 at 4 warps vs 48.9-50.5 at 2.
_MAX_TILE_BYTES = 4096
_THREAD_BYTES = 32
# HF halves: load the whole [BLOCK_H, D] row tile and pair the halves in registers (True), or load two
# half-row tiles (False). H200, 16 x 4096 x 32 x 128 bf16 with in-kernel angles: 274 us vs 357 us (the
# two-tile form computes each cos/sin in more threads); with tables both ran 277 us.
HALVES_AS_PAIRS = True


@functools.cache  # pure: decided once per (H, D, dtype size, device), not per call
def _tile(H: int, D: int, elsize: int, dev: int) -> tuple[int, int]:
    block_h = max(1, min(next_pow2(H), _MAX_TILE_BYTES // (D * elsize)))
    return block_h, warps_for(block_h * D, _THREAD_BYTES // elsize, dev, lo=1, hi=8)


def _launch(
    out: torch.Tensor,
    k_out: torch.Tensor | None,
    x: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    start_pos: int,
    theta: float,
    interleaved: bool,
    sign: float,
    block_h: int | None,
    num_warps: int | None,
    halves_as_pairs: bool | None,
) -> None:
    B, S, H, D = x.shape
    has_k = k is not None and k_out is not None
    # x and k are read through their strides (each head's D contiguous); the outputs are written densely
    x = last_dim_contiguous(x)
    k = None if k is None else last_dim_contiguous(k)
    if not out.is_contiguous() or (has_k and not k_out.is_contiguous()):
        raise ValueError("rope: the outputs must be contiguous (x and k may be strided views)")
    if has_k and (k.shape[:2] != x.shape[:2] or k.shape[3] != D or k_out.shape != k.shape):
        raise ValueError(f"rope: k {tuple(k.shape)} must be [B, S, Hk, D] beside x {tuple(x.shape)}")
    HK = k.shape[2] if has_k else H
    bh, nw = _tile(max(H, HK), next_pow2(D), x.element_size(), device_index(x))
    block_h = block_h or bh
    has_table = cos is not None and sin is not None
    q_blocks = triton.cdiv(H, block_h)
    blocks = q_blocks + (triton.cdiv(HK, block_h) if has_k else 0)
    # One grid axis, a token's head blocks consecutive: the programs running at once read and write one
    # contiguous stretch of x and y (with the blocks on a second, slower axis the first wave of programs
    # covered every token's first heads, then came back for the rest).
    grid = (B * S * blocks,)
    if grid[0] >= 2**31:
        raise ValueError(
            f"rope: {B * S} tokens x {blocks} head blocks exceed the 2^31 - 1 programs of one grid"
        )
    cos_t, sin_t = (cos, sin) if has_table else (_inv_freq(D, theta, x.device),) * 2  # sin_t: never read
    positions = _check_positions(positions, B, S, x.device, cos, sin)
    # Without positions an int32 view of out (dense) stands in (never read): the pointer type stays *i32, so the
    # flag is all that differs and no second binary is compiled. Without k, x and out stand in for k (the
    # kernel never reaches k's head blocks).
    pos_t = positions if positions is not None else out.view(-1).view(torch.int32)
    max_position = min(cos.shape[0], sin.shape[0]) - 1 if has_table else _MAX_POSITION
    k_t, ko_t = (k, k_out) if has_k else (x, out)
    args = (x, out, k_t, ko_t, cos_t, sin_t, pos_t, S, H, HK, q_blocks, blocks, int(start_pos),
            int(positions is not None), max_position, sign, *x.stride()[:3], *k_t.stride()[:3])  # fmt: skip
    if D & (D - 1):  # the register-pairing tiles need a power-of-two D; gather the pairs instead
        _rope_any_d_kernel[grid](
            *args, HEAD_DIM=D, BLOCK_HALF=next_pow2(D // 2), BLOCK_H=block_h, HAS_TABLE=has_table,
            INTERLEAVED=interleaved, num_warps=num_warps or nw,
        )  # fmt: skip
        return
    _rope_kernel[grid](
        *args, HEAD_DIM=D, BLOCK_H=block_h, HAS_TABLE=has_table, INTERLEAVED=interleaved,
        HALVES_AS_PAIRS=HALVES_AS_PAIRS if halves_as_pairs is None else halves_as_pairs,
        num_warps=num_warps or nw,
    )  # fmt: skip


_MAX_POSITION = 1 << 24  # in-kernel angles: positions are clamped to [0, 2^24] (fp32 holds them exactly)
_INV_FREQ: dict[tuple[int, float, torch.device], torch.Tensor] = {}


def _inv_freq(d: int, theta: float, device: torch.device) -> torch.Tensor:
    """fusekit.ops.rope.inv_freq as a [D/2] fp32 tensor on `device`, made once per (D, theta, device) and
    shared by every later call, on any stream or thread: so it is finished before it is shared (made on
    this call's stream, nothing would order another stream's kernel after it). A first call is never
    inside a CUDA graph capture (the library refuses those), where the synchronize would be illegal."""
    key = (d, float(theta), device)
    t = _INV_FREQ.get(key)
    if t is None:
        from fusekit.ops.rope import inv_freq

        t = inv_freq(d, theta, torch.float32, device)
        if t.is_cuda and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(t.device).synchronize()
        t = _INV_FREQ[key] = _replay.persistent(t)
    return t


def _check_positions(
    positions: torch.Tensor | None, B: int, S: int, device: torch.device, cos, sin
) -> torch.Tensor | None:
    if positions is None:
        return None
    if positions.shape != (B, S) or positions.dtype != torch.int32 or positions.device != device:
        raise ValueError(
            f"rope: positions must be int32 [{B}, {S}] on {device}, got {positions.dtype} "
            f"{tuple(positions.shape)} on {positions.device}"
        )
    if cos is not None and sin is not None and min(cos.shape[0], sin.shape[0]) == 0:
        raise ValueError("rope: positions index the tables' rows, but the tables have none")
    return positions.contiguous()


def forward(
    y: torch.Tensor,
    yk: torch.Tensor | None,
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    k: torch.Tensor | None,
    start_pos: int,
    theta: float,
    interleaved: bool,
    *,
    _block_h: int | None = None,
    _num_warps: int | None = None,
    _halves_as_pairs: bool | None = None,
) -> None:
    """y[B, S, H, D] <- x rotated by p * theta^(-2i/D) with p = start_pos + s, or positions[b, s] (int32
    [B, S], clamped to [0, 2^24]; then start_pos is 0), or by tables cos/sin [St, D/2] fp32 at row p
    (positions clamped to [0, St - 1]): pair (a, b) -> (a c - b s, b c + a s). With k [B, S, Hk, D] (and
    yk), k is rotated the same way in the same launch. Private `_block_h`/`_num_warps`/`_halves_as_pairs`
    force a tile (tests)."""
    _launch(
        y, yk, x, k, cos, sin, positions, start_pos, theta, interleaved, 1.0, _block_h, _num_warps,
        _halves_as_pairs,
    )  # fmt: skip


def backward(
    dx: torch.Tensor,
    dk: torch.Tensor | None,
    dy: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    dyk: torch.Tensor | None,
    start_pos: int,
    theta: float,
    interleaved: bool,
    *,
    _block_h: int | None = None,
    _num_warps: int | None = None,
    _halves_as_pairs: bool | None = None,
) -> None:
    """dx[B, S, H, D] (and dk) <- dy (and dyk) rotated by the negative angle at the same positions: pair
    (a, b) -> (a c + b s, b c - a s)."""
    _launch(
        dx, dk, dy, dyk, cos, sin, positions, start_pos, theta, interleaved, -1.0, _block_h, _num_warps,
        _halves_as_pairs,
    )  # fmt: skip


rope = forward  # the name the mode tests (tests/test_triton_modes.py) import


# ---- ahead-of-time coverage -------------------------------------------------------------------------------
# start_pos is i32 here (validation keeps it <= 2^24); the JIT types a Python int past 2^31 as i64.
# positions adds no variant: pos_ptr is *i32 with or without it (has_positions is a runtime flag).
_SCALAR_SIG = {"pos_ptr": "*i32", "S": "i32", "H": "i32", "HK": "i32", "q_blocks": "i32", "blocks": "i32"}
_SCALAR_SIG |= {"start_pos": "i32", "has_positions": "i32"}
_SCALAR_SIG |= {"max_position": "i32", "sign": "fp32"}
_SCALAR_SIG |= {f"stride_{t}{d}": "i32" for t in "xk" for d in "bsh"}


def aot_specs() -> list[tuple[str, object, dict, dict]]:
    """D in {64, 128} x both layouts x table/in-kernel angles in bf16, plus fp16/fp32 at D = 128. forward and
    backward share every binary (the direction is the runtime `sign`), and so do calls with and without
    `positions` (the runtime `has_positions`)."""
    specs: list[tuple[str, object, dict, dict]] = []
    for dt, ds in (("bf16", (64, 128)), ("fp16", (128,)), ("fp32", (128,))):
        es = 4 if dt == "fp32" else 2
        for d in ds:
            bh, nw = _tile(32, d, es, 0)
            for table in (True, False):
                for inter in (False, True):
                    sig = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "k_ptr": f"*{dt}", "ko_ptr": f"*{dt}"}
                    sig |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}
                    sig |= _SCALAR_SIG
                    keys = ("HEAD_DIM", "BLOCK_H", "HAS_TABLE", "INTERLEAVED", "HALVES_AS_PAIRS")
                    sig |= {k: "constexpr" for k in keys}
                    ce = {"HEAD_DIM": d, "BLOCK_H": bh, "HAS_TABLE": table, "INTERLEAVED": inter}
                    ce |= {"HALVES_AS_PAIRS": HALVES_AS_PAIRS, "num_warps": nw}
                    name = f"rope_{dt}_d{d}_{'table' if table else 'theta'}_{'inter' if inter else 'half'}"
                    specs.append((name, _rope_kernel, sig, ce))
    for inter in (False, True):  # a non-power-of-two head dim goes through the gather kernel
        sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "k_ptr": "*bf16", "ko_ptr": "*bf16"}
        sig |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}
        sig |= _SCALAR_SIG
        sig |= {k: "constexpr" for k in ("HEAD_DIM", "BLOCK_HALF", "BLOCK_H", "HAS_TABLE", "INTERLEAVED")}
        bh, nw = _tile(32, 128, 2, 0)
        ce = {"HEAD_DIM": 96, "BLOCK_HALF": 64, "BLOCK_H": bh, "HAS_TABLE": False, "INTERLEAVED": inter}
        specs.append(
            (
                f"rope_bf16_d96_theta_{'inter' if inter else 'half'}",
                _rope_any_d_kernel,
                sig,
                ce | {"num_warps": nw},
            )
        )
    return specs
