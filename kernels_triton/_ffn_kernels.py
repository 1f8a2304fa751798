"""The SwiGLU feed-forward block's forward kernels (kernels_triton/swiglu_ffn.py chooses and launches them):
the norm's rstd, gate/up GEMMs with the fused silu*mul (pointer and TMA persistent), the down GEMM (nt),
the element-wise h, and the decode GEMVs. Tile tables, the selector and the launches stay in swiglu_ffn.py."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels_triton._ffn_backward import _tile_rows_cols
from kernels_triton._launch import fast_launch
from kernels_triton._tiles import dot, rsqrt_full_range


@fast_launch
@triton.jit
def _rstd_kernel(x_ptr, nw_ptr, rstd_ptr, xn_ptr, D, eps, WRITE_XN: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: rstd = rsqrt(mean(x^2) + eps) in fp32; optionally xn = x*rstd*w in x.dtype."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * D
    offs = tl.arange(0, BLOCK)
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, D, BLOCK):
        x = tl.load(x_row + k + offs, mask=k + offs < D, other=0.0).to(tl.float32)
        ss += x * x
    rstd = rsqrt_full_range(tl.sum(ss, axis=0) / D + eps)
    tl.store(rstd_ptr + row, rstd)
    if WRITE_XN:
        for k in range(0, D, BLOCK):
            m = k + offs < D
            x = tl.load(x_row + k + offs, mask=m, other=0.0).to(tl.float32)
            w = tl.load(nw_ptr + k + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(xn_ptr + row * D + k + offs, (x * rstd * w).to(xn_ptr.dtype.element_ty), mask=m)


@triton.jit
def _grouped(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row-blocks share each weight column-block while it is in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    # >= 1 for every real tile. The persistent TMA kernels' pipelined loops also compute the tiles past a
    # program's last one (their loads predicated off), where this is 0 when GROUP_M divides num_pid_m: clamped,
    # so `% group_size` is never a division by 0, undefined behaviour LLVM may take as a fact to fold those
    # loads' predicates (what hung the dk/dv kernel: see attention_backward._bwd_dkdv_kernel).
    group_size = tl.maximum(tl.minimum(num_pid_m - first_m, GROUP_M), 1)
    pid_m = first_m + ((tile % in_group) % group_size)
    pid_n = (tile % in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _swiglu(g, u):
    """h = silu(g) * u in fp32: the one formula of every forward epilogue (the pointer and TMA GEMMs, the
    decode GEMV, the vendor step's element-wise kernel), so each writes the same h from the same g and u.
    The backward's _swiglu_bwd_kernel keeps sig(g) for silu'(g) and forms h as g * sig(g) * u."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    return _grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)


@triton.jit(do_not_specialize=["M"])  # T only sets the grid and the wrap: no recompile per T
def _gate_up_kernel(
    a_ptr, wg_ptr, wu_ptr, nw_ptr, rstd_ptr, h_ptr, gu_ptr, M, N, K,
    HAS_NORM: tl.constexpr, SAVE_GU: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """h[M, N] = silu(a' @ Wg^T) * (a' @ Wu^T), a' = round(a * rstd * nw) if HAS_NORM else a.
    SAVE_GU (training): also gu[M, 2N] = [round(a' @ Wg^T), round(a' @ Wu^T)], the pre-activations."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # Wrapped (modulo) row/col indices keep the loads unmasked in M and N; the store masks them.
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None].to(tl.int64) * K + offs_k[None, :]
    # B tiles are read as [BLOCK_K, BLOCK_N] views of the row-major [N, K] weights (K-major operand).
    wg_ptrs = wg_ptr + offs_bn[None, :].to(tl.int64) * K + offs_k[:, None]
    wu_ptrs = wu_ptr + offs_bn[None, :].to(tl.int64) * K + offs_k[:, None]
    if HAS_NORM:
        r = tl.load(rstd_ptr + offs_am)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        if EVEN_K:  # K % BLOCK_K == 0: no K mask, so the copies are plain 16-byte cp.async
            a = tl.load(a_ptrs)
            bg = tl.load(wg_ptrs)
            bu = tl.load(wu_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            bg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            bu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + k * BLOCK_K + offs_k, mask=offs_k < k_left, other=0.0)
            a = ((a.to(tl.float32) * r[:, None]) * nw.to(tl.float32)[None, :]).to(a_ptr.dtype.element_ty)
        acc_g = dot(a, bg, acc_g, IEEE)
        acc_u = dot(a, bu, acc_u, IEEE)
        a_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    h = _swiglu(acc_g, acc_u)
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    c_ptrs = h_ptr + offs_cm[:, None].to(tl.int64) * N + offs_cn[None, :]
    tl.store(c_ptrs, h.to(h_ptr.dtype.element_ty), mask=c_mask)
    if SAVE_GU:
        gu_ptrs = gu_ptr + offs_cm[:, None].to(tl.int64) * (2 * N) + offs_cn[None, :]
        tl.store(gu_ptrs, acc_g.to(gu_ptr.dtype.element_ty), mask=c_mask)
        tl.store(gu_ptrs + N, acc_u.to(gu_ptr.dtype.element_ty), mask=c_mask)


@triton.jit(do_not_specialize=["M"])  # T only sets the grid and the wrap: no recompile per T
def _matmul_nt_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """c[M, N] = a[M, K] @ b[N, K]^T, fp32 accumulation, stored in c's dtype (the down projection)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None].to(tl.int64) * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_bn[None, :].to(tl.int64) * K + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = dot(a, b, acc, IEEE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_cm[:, None].to(tl.int64) * N + offs_cn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))


@fast_launch
@triton.jit(do_not_specialize=["T"])  # T only sets the grid and the row mask
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, T, F, IN_GU: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_F: tl.constexpr):  # fmt: skip
    """The "blas" gate/up step's epilogue: h[T, F] = round(silu(g) * u), computed in fp32 from the vendor
    GEMMs' g and u (already rounded to x's dtype). Inference: g is h itself (overwritten element by element,
    each read before its write) and u a [T, F] workspace (row stride F); IN_GU (training): g and u are the
    halves of gu [T, 2F] the GEMMs wrote in place (row stride 2F)."""
    rows, cols, mask = _tile_rows_cols(T, F, BLOCK_T, BLOCK_F)
    r64 = rows.to(tl.int64)[:, None]
    if IN_GU:
        src = r64 * (2 * F) + cols[None, :]
    else:
        src = r64 * F + cols[None, :]
    g = tl.load(g_ptr + src, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    u = tl.load(u_ptr + src, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    h = _swiglu(g, u)
    tl.store(h_ptr + r64 * F + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


# TMA + persistent GEMMs (sm_90+). Descriptors are built on the device (tl.make_tensor_descriptor: 128 B of
# global scratch per descriptor, from triton.set_allocator), so the kernels take plain pointers and AOT
# like any other kernel. TMA zero-fills out-of-bounds rows/columns of a load and clips a store, so the M,
# N and K tails need no masks. One program per SM walks tiles start, start + NUM_SMS, ... in the grouped
# order; `flatten` lets the pipeliner overlap the next tile's first loads with this tile's epilogue (the
# epilogue recomputes its tile from a second counter, as tutorial 09 does, so the flattened loop's load
# prologue and store epilogue share no value).
# Hopper's warp specialization (a producer warp issuing TMA, consumer warpgroups on wgmma) does not work
# with a flattened loop, so WARP_SPECIALIZE configs run with FLATTEN=False (as in Triton's tutorial 09).
# M is not specialized (do_not_specialize): a new T must not recompile the kernel.
@fast_launch
@triton.jit(do_not_specialize=["M"])
def _gate_up_tma_kernel(
    a_ptr, wg_ptr, wu_ptr, h_ptr, gu_ptr, M, N, K,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    SAVE_GU: tl.constexpr,
):  # fmt: skip
    """h[M, N] = silu(a @ Wg^T) * (a @ Wu^T); a [M, K] (the materialized xn), Wg/Wu [N, K] K-major.
    SAVE_GU: also gu[M, 2N] = [round(a @ Wg^T), round(a @ Wu^T)], through two [M, N] descriptors of row
    stride 2N (a TMA store clips at its descriptor's N, so a tile's column tail never reaches the u half;
    the u half's base gu + N must be 16-byte aligned: the launcher checks)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    g_desc = tl.make_tensor_descriptor(wg_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    u_desc = tl.make_tensor_descriptor(wu_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    if SAVE_GU:
        sg_desc = tl.make_tensor_descriptor(
            gu_ptr, shape=[M, N], strides=[2 * N, 1], block_shape=[BLOCK_M, BLOCK_N]
        )
        su_desc = tl.make_tensor_descriptor(
            gu_ptr + N, shape=[M, N], strides=[2 * N, 1], block_shape=[BLOCK_M, BLOCK_N]
        )
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile_c = tl.program_id(0) - NUM_SMS  # the epilogue's own tile counter (see above)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        pid_m, pid_n = _grouped(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            bg = g_desc.load([off_n, off_k])
            bu = u_desc.load([off_n, off_k])
            acc_g = dot(a, bg.T, acc_g, IEEE)
            acc_u = dot(a, bu.T, acc_u, IEEE)
        tile_c += NUM_SMS
        pid_m, pid_n = _grouped(tile_c, num_pid_m, num_pid_n, GROUP_M)
        h = _swiglu(acc_g, acc_u)
        h_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], h.to(h_ptr.dtype.element_ty))
        if SAVE_GU:
            sg_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc_g.to(gu_ptr.dtype.element_ty))
            su_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc_u.to(gu_ptr.dtype.element_ty))


@fast_launch
@triton.jit(do_not_specialize=["M"])
def _matmul_nt_tma_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    SUBTILE: tl.constexpr,
):  # fmt: skip
    """c[M, N] = a[M, K] @ b[N, K]^T (the down projection). SUBTILE stores the tile as two [BLOCK_M,
    BLOCK_N/2] halves: half the epilogue's shared-memory buffer, which buys a 128x256 tile a 4th stage."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    C_N: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, C_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile_c = tl.program_id(0) - NUM_SMS  # the epilogue's own tile counter (see above)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):  # fmt: skip
        pid_m, pid_n = _grouped(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            b = b_desc.load([off_n, off_k])
            acc = dot(a, b.T, acc, IEEE)
        tile_c += NUM_SMS
        pid_m, pid_n = _grouped(tile_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            c_desc.store([off_m, off_n], c0.to(c_ptr.dtype.element_ty))
            c_desc.store([off_m, off_n + BLOCK_N // 2], c1.to(c_ptr.dtype.element_ty))
        else:
            c_desc.store([off_m, off_n], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def _gemv_rows(acc, x, w, BLOCK_T: tl.constexpr, IEEE: tl.constexpr):
    """acc[BLOCK_T, BLOCK_R] += x[BLOCK_T, BLOCK_K] @ w[BLOCK_R, BLOCK_K]^T for a handful of rows.

    One token (BLOCK_T == 1): acc is [BLOCK_R, BLOCK_K] partial products, reduced once after the K loop
    (no cross-lane shuffles per step and no tensor-core padding of 1 row to 16)."""
    if BLOCK_T == 1:
        acc += w.to(tl.float32) * x.to(tl.float32)
    else:
        acc = dot(x, tl.trans(w), acc, IEEE)
    return acc


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, wg_ptr, wu_ptr, nw_ptr, h_ptr, gu_ptr, rstd_ptr, T, D, F, eps,
    HAS_NORM: tl.constexpr, SAVE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Decode gate/up: program p owns rows [p*BLOCK_F, +BLOCK_F) of Wg and Wu and reads each byte once.
    HAS_NORM: also rstd[T] (program 0). SAVE (training): also gu[T, 2F] = [round(g), round(u)]."""
    pid = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_f = pid * BLOCK_F + tl.arange(0, BLOCK_F)
    offs_k0 = tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    f_mask = offs_f < F
    x_rows = x_ptr + offs_t[:, None] * D
    if HAS_NORM:
        # Every program recomputes rstd of the <= 16 token rows: D*T*2 bytes from L2, no extra launch.
        ss = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        for k in range(0, D, BLOCK_K):
            xk = tl.load(x_rows + k + offs_k0[None, :], mask=t_mask[:, None] & (k + offs_k0[None, :] < D))
            xk = xk.to(tl.float32)
            ss += xk * xk
        rstd = rsqrt_full_range(tl.sum(ss, axis=1) / D + eps)
        if pid == 0:  # every program computed the same values; the first one stores them
            tl.store(rstd_ptr + offs_t, rstd, mask=t_mask)
    if BLOCK_T == 1:
        acc_g = tl.zeros([BLOCK_F, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_F, BLOCK_K], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_T, BLOCK_F], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_T, BLOCK_F], dtype=tl.float32)
    wg_rows = wg_ptr + offs_f[:, None].to(tl.int64) * D
    wu_rows = wu_ptr + offs_f[:, None].to(tl.int64) * D
    for k in range(0, D, BLOCK_K):
        offs_k = k + offs_k0
        k_mask = offs_k < D
        x = tl.load(x_rows + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) * rstd[:, None]) * nw[None, :]).to(x_ptr.dtype.element_ty)
        wmask = f_mask[:, None] & k_mask[None, :]
        wg = tl.load(wg_rows + offs_k[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        wu = tl.load(wu_rows + offs_k[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        acc_g = _gemv_rows(acc_g, x, wg, BLOCK_T, IEEE)
        acc_u = _gemv_rows(acc_u, x, wu, BLOCK_T, IEEE)
    if BLOCK_T == 1:
        g = tl.sum(acc_g, axis=1)[None, :]
        u = tl.sum(acc_u, axis=1)[None, :]
    else:
        g = acc_g
        u = acc_u
    h = _swiglu(g, u)
    h_ptrs = h_ptr + offs_t[:, None] * F + offs_f[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=t_mask[:, None] & f_mask[None, :])
    if SAVE:
        gu_ptrs = gu_ptr + offs_t[:, None] * (2 * F) + offs_f[None, :]
        tl.store(gu_ptrs, g.to(gu_ptr.dtype.element_ty), mask=t_mask[:, None] & f_mask[None, :])
        tl.store(gu_ptrs + F, u.to(gu_ptr.dtype.element_ty), mask=t_mask[:, None] & f_mask[None, :])


@triton.jit
def _gemv_nt_kernel(
    a_ptr, w_ptr, c_ptr, T, N, K,
    IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Decode down projection: c[T, N] = a[T, K] @ w[N, K]^T, program p owns BLOCK_N rows of w."""
    pid = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k0 = tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    n_mask = offs_n < N
    if BLOCK_T == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    a_rows = a_ptr + offs_t[:, None] * K
    for k in range(0, K, BLOCK_K):
        offs_k = k + offs_k0
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        acc = _gemv_rows(acc, a, w, BLOCK_T, IEEE)
    if BLOCK_T == 1:
        c = tl.sum(acc, axis=1)[None, :]
    else:
        c = acc
    c_ptrs = c_ptr + offs_t[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, c.to(c_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :])
