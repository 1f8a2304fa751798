"""What each fusekit op phase looks like as a MAX custom op, derived from the op's spec.

`max_spec(spec, phase)` gives an `OpSpec` (MAX level): the registered op name (`fusekit.<op>` or
`fusekit.<op>_backward`), the output and input tensors in order with symbolic dim names (one compiled
graph covers every shape) and dtype rules, the allowed dtype combinations, and `bind`, which maps the
provider's destination-passing arguments to (outputs, inputs, params). The compile cache and the
dispatcher read everything from here.

- Dtype rules: a tensor's dtype is a dtype variable of the op ("x", "w", "out"), which takes the
  dtype of the call's tensors and is part of the compile key, or a fixed dtype ("float32").
- Params: the op's scalars as float32 (bools 0/1, choices by index, e.g. casting "fp32"/"llama"/"gemma"
  = 0/1/2; dtype scalars are compile keys, not params), then one 0/1 flag per condition of the phase,
  in a trailing float32 `params` input on the op's device.
- Optional tensors: each has its own symbolic dims, and an absent one is passed as a dummy of its
  dtype with every dim 1 (its flag is 0; the kernel never reads it).

Outputs are mutable buffers: the graph passes the caller's output tensors to the op as MAX buffers
(`ops.inplace_custom`), so in Mojo every output parameter is a `MutableInputTensor`, never an
`OutputTensor` (a MAX temporary the graph would copy into the caller's buffer afterwards: an extra
read + write of every output). Kernels must write every element of every output.

Workspaces: the GPU kernels' scratch memory (split partial sums, weight-gradient partials, swiglu_ffn's
intermediates) is the caller's too. Each `Workspace` of an op is one more `MutableInputTensor` (a
rank-1 buffer with its own symbolic length) between the outputs and the inputs; the dispatcher
allocates it with torch for each call from its size function (dispatch.DeviceState.workspaces). No
kernel calls `ctx.enqueue_create_buffer` (tests/test_mojo_workspace.py): after a MAX device-graph
capture such an allocation made MAX reserve ~90% of the free GPU memory for its graph pool (H100:
78 -> 7.8 GiB free), and a captured graph now replays over torch memory. A size function mirrors its
kernel's launch plan with a bound documented in both places; the kernel checks the size it is given
(`check_workspace` in mojo/_util.mojo) and raises rather than write past it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from fusekit.ops._spec import ACC, acc_dtype

# Ops the Mojo package has no kernel for (yet): the backend refuses them before building any MAX spec, so
# backend="mojo" raises naming op and backend, "auto" passes over it, and mojo_build lists none of them.
NO_KERNEL: frozenset[str] = frozenset()

Bound = tuple[tuple[torch.Tensor | tuple, ...], tuple[torch.Tensor | tuple, ...], tuple[float, ...]]
# Compile-time parameters of a MAX custom op, as passed to `ops.inplace_custom(parameters=...)`:
# ((name, value), ...) in the spec's order; part of the compile key and of the MEF's name.
Parameters = tuple[tuple[str, int], ...]
# The head dims the attention kernels take (mojo/attention.mojo, mojo/_attention_decode.mojo).
HEAD_DIMS = (64, 128, 256)
# The values each shape parameter (OpSpec.shape_params) can take: what mojo_build builds ahead of time.
PARAM_VALUES: dict[str, tuple[int, ...]] = {"head_dim": HEAD_DIMS}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor argument of a MAX custom op: name, symbolic dims, dtype variable or fixed dtype."""

    name: str
    dims: tuple[str | int, ...]
    dtype: str  # a dtype variable of the op ("x", "w", "out") or a torch dtype name ("float32")


# (bound outputs, bound inputs, the device's SM count) -> elements; tensors in the spec's order, an absent
# optional one as a specs.dummy marker.
SizeFn = Callable[[tuple, tuple, int], int]


@dataclass(frozen=True)
class Workspace:
    """Scratch memory of a MAX op's GPU kernels, owned by the caller (see the module docstring).

    `size` gives the elements one GPU call needs (at least; 0 allowed): a function of the bound call's
    shapes (and alignment, where the kernel picks its plan by it) and of the SM count for grids sized
    from it. On the CPU the dispatcher passes a 1-element dummy instead: no CPU path uses a workspace.
    """

    name: str
    dtype: str  # as TensorSpec.dtype, or "acc": the accumulator dtype of x (int64 for integers, else fp32)
    size: SizeFn = field(repr=False, compare=False)

    @property
    def dims(self) -> tuple[str]:
        return (f"ws_{self.name}",)  # its own symbolic length


@dataclass(frozen=True)
class OpSpec:
    """A fusekit op phase as a MAX custom op (outputs first, then workspaces, then inputs, then params)."""

    op: str
    max_op: str
    outputs: tuple[TensorSpec, ...]
    inputs: tuple[TensorSpec, ...]
    params: tuple[str, ...]  # names of the float32 params entries, in order (() = no params input)
    dtype_vars: tuple[str, ...]  # e.g. ("x",) or ("x", "w")
    allowed: frozenset[tuple[torch.dtype, ...]]  # allowed dtypes for dtype_vars, in order
    bind: Callable[..., Bound]  # (outputs, inputs, scalars) -> (outputs, inputs, params values)
    workspaces: tuple[Workspace, ...] = ()  # caller-allocated GPU scratch, passed after the outputs
    # Compile-time parameters of the op's GPU graphs read from a tensor's size: (parameter, tensor name, dim).
    # attention's ("head_dim", "q", 3): one GPU graph per head dim, instantiating only its kernels (issue #14
    # item 3: a virtual sm_90 compile of every head dim's 19 kernels took 29 s). CPU graphs get none (their
    # loops take any size; a parameter would only multiply their compiles).
    shape_params: tuple[tuple[str, str, int], ...] = ()

    def __post_init__(self) -> None:
        # Position (in outputs + inputs) of the tensors typed by each dtype variable.
        specs = self.outputs + self.inputs
        pos = tuple(tuple(i for i, t in enumerate(specs) if t.dtype == v) for v in self.dtype_vars)
        object.__setattr__(self, "_dtype_pos", pos)
        names = [t.name for t in specs]
        where = tuple((p, names.index(t), d) for p, t, d in self.shape_params)
        object.__setattr__(self, "_param_pos", where)

    def parameters(self, outs: tuple, ins: tuple, device: torch.device) -> Parameters:
        """The compile-time parameters of this call's graph (shape_params; none on the CPU)."""
        if not self._param_pos or device.type == "cpu":  # type: ignore[attr-defined]
            return ()
        args = outs + ins
        return tuple((p, int(args[i].shape[d])) for p, i, d in self._param_pos)  # type: ignore[attr-defined]

    def dtype_key(self, outs: tuple, ins: tuple) -> tuple:
        """The dtypes of this call's dtype variables (part of the compile key); dummies carry theirs."""
        args = outs + ins
        key = []
        for positions in self._dtype_pos:  # type: ignore[attr-defined]
            found = None
            for i in positions:
                a = args[i]
                found = a.dtype if isinstance(a, torch.Tensor) else a[1]
                if isinstance(a, torch.Tensor):
                    break
            key.append(found)
        return tuple(key)

    def tensor_dtype(self, spec: TensorSpec | Workspace, key: tuple[torch.dtype, ...]) -> torch.dtype:
        """The torch dtype of one tensor argument (or workspace) for a compile key."""
        if spec.dtype in self.dtype_vars:
            return key[self.dtype_vars.index(spec.dtype)]
        if spec.dtype == "acc":  # mojo/_util.mojo acc_dtype
            x = key[self.dtype_vars.index("x")]
            return x if x == torch.float64 else torch.float32 if x.is_floating_point else torch.int64
        return getattr(torch, spec.dtype)


def dummy(dtype: torch.dtype, rank: int, slot: int) -> tuple:
    """Stands for an absent optional tensor: the dispatcher passes a [1] * rank tensor of `dtype`."""
    return ("dummy", dtype, rank, slot)


def _param(scalar, value: object) -> float:
    if scalar.kind is str:
        return float(scalar.choices.index(value))
    return float(value)  # type: ignore[arg-type]


_BIND_PLANS = 256  # remembered (dtypes, presence, scalar values) patterns per op phase; a model has a few


def max_spec(spec, phase: str) -> OpSpec:
    """The MAX custom-op view of `phase` of a fusekit op spec: its tensors in order (an absent optional one
    as a dummy), then its scalars and condition flags as params."""
    p = spec.phase(phase)
    op = spec.name if phase == "forward" else f"{spec.name}_backward"

    def tensor(arg) -> TensorSpec:
        dims = tuple(f"{d}_{arg.name}" for d in arg.dims) if arg.optional else arg.dims
        return TensorSpec(arg.name, dims, arg.dtype)

    scalars = [s for s in spec.scalars if s.kind is not torch.dtype]  # dtype scalars are compile keys
    params = tuple(s.name for s in scalars) + tuple(f"has_{c}" for c in p.conditions)
    n_out = len(p.outputs)

    def plan(args: tuple, values: tuple) -> tuple[tuple, tuple, tuple]:
        """(dummy or None per output, the same per input, params) for a call's present tensors and values."""
        key = {}
        for arg, v in zip(p.tensors, args):
            if v is not None:
                key.setdefault(arg.dtype, v.dtype)
        x_dtype = key.get("x")

        def fill(specs: tuple, vals: tuple, base: int) -> tuple:
            res = []
            for i, (arg, v) in enumerate(zip(specs, vals)):
                dt = None
                if v is None:
                    dt = key.get(arg.dtype) or (
                        x_dtype
                        if arg.dtype in spec.dtype_vars
                        else acc_dtype(x_dtype)
                        if arg.dtype == ACC
                        else getattr(torch, arg.dtype)
                    )
                res.append(None if dt is None else dummy(dt, len(arg.dims), base + i))
            return tuple(res)

        flags = []
        for c in p.conditions:
            present = any(v is not None for a, v in zip(p.tensors, args) if a.when == c)
            flags.append(1.0 if present else 0.0)
        return (
            fill(p.outputs, args[:n_out], 0),
            fill(p.inputs, args[n_out:], n_out),
            tuple(_param(s, v) for s, v in zip(scalars, values)) + tuple(flags),
        )

    plans: dict[tuple, tuple] = {}  # (dtype or None per tensor, values) -> plan: the same for every such call

    def bind(outs: tuple, ins: tuple, values: tuple) -> Bound:
        args = outs + ins
        k = (tuple([None if v is None else v.dtype for v in args]), values)
        hit = plans.get(k)
        if hit is None:
            hit = plan(args, values)
            if len(plans) < _BIND_PLANS:
                plans[k] = hit
        od, idm, params = hit
        return (
            tuple([d if v is None else v for v, d in zip(outs, od)]),
            tuple([d if v is None else v for v, d in zip(ins, idm)]),
            params,
        )

    return OpSpec(
        op=op,
        max_op=f"fusekit.{op}",
        outputs=tuple(tensor(a) for a in p.outputs),
        inputs=tuple(tensor(a) for a in p.inputs),
        params=params,
        dtype_vars=spec.dtype_vars,
        allowed=spec.allowed,
        bind=bind,
        workspaces=WORKSPACES.get(f"fusekit.{op}", ()),
    )


def _bind_swiglu_backward(outs: tuple, ins: tuple, values: tuple) -> Bound:
    """(h, dg?, du?, xn?), (dh?, gu, x, norm_weight?, rstd?), () -> the kernel's arguments (has_norm = xn
    given; grads = dh given: without it, h only, and dg, du, dh are dummies)."""
    h, dg, du, xn = outs
    dh, gu, x, nw, rstd = ins
    dt = h.dtype
    grads = dh is not None
    if grads != (dg is not None) or grads != (du is not None):
        raise ValueError(
            "swiglu_ffn_backward: dh, dg and du come together (gradients) or not at all (h only)"
        )
    return (
        (
            h,
            dg if grads else dummy(dt, 2, 4),
            du if grads else dummy(dt, 2, 5),
            xn if xn is not None else dummy(dt, 2, 3),
        ),
        (
            dh if grads else dummy(dt, 2, 6),
            gu,
            x,
            nw if nw is not None else dummy(dt, 1, 7),
            rstd if rstd is not None else dummy(torch.float32, 1, 8),
        ),
        (float(xn is not None), float(grads)),
    )


# The element-wise part of the swiglu_ffn backward (mojo/_swiglu_backward.mojo). It is not the spec's
# backward phase: the provider runs the phase's five GEMMs as torch matmuls (see __init__.py) and calls
# this op between them, and the norm part through fusekit.rms_norm_backward. It holds the phase's MAX
# name, so the package registering it is what makes the backward available.
SWIGLU_FFN_BACKWARD = OpSpec(
    op="swiglu_ffn_backward",
    max_op="fusekit.swiglu_ffn_backward",
    outputs=(
        TensorSpec("h", ("T", "F"), "x"),
        TensorSpec("dg", ("T_dg", "F_dg"), "x"),
        TensorSpec("du", ("T_du", "F_du"), "x"),
        TensorSpec("xn", ("T_xn", "D_xn"), "x"),
    ),
    inputs=(
        TensorSpec("dh", ("T_dh", "F_dh"), "x"),
        TensorSpec("gu", ("T", "G"), "x"),
        TensorSpec("x", ("T", "D"), "x"),
        TensorSpec("norm_weight", ("D_norm_weight",), "w"),
        TensorSpec("rstd", ("T_rstd",), "float32"),
    ),
    params=("has_norm", "grads"),
    dtype_vars=("x", "w"),  # w: norm_weight's, x's or fp32 (the swiglu_ffn op's own pairs)
    allowed=frozenset(
        [(d, d) for d in (torch.float32, torch.float16, torch.bfloat16)]
        + [(d, torch.float32) for d in (torch.float16, torch.bfloat16)]
    ),
    bind=_bind_swiglu_backward,
)


def _ignore_pieces(ignore_index: int) -> tuple[float, float, float]:
    """ignore_index = hi 2^48 + mid 2^24 + lo with mid, lo in [0, 2^24): each piece exact in float32, so
    every int64 survives the float32 params (mojo/linear_cross_entropy.mojo LceFlags joins them)."""
    return (float(ignore_index >> 48), float((ignore_index >> 24) & 0xFFFFFF), float(ignore_index & 0xFFFFFF))


def _bind_lce_rows(outs: tuple, ins: tuple, values: tuple) -> Bound:
    """(logits, rows), (target, scale), (ignore_index, label_smoothing, grad) -> the kernel's arguments."""
    ignore_index, label_smoothing, grad = values
    return outs, ins, (*_ignore_pieces(ignore_index), float(label_smoothing), float(grad))


# The row kernel of the linear_cross_entropy forward (mojo/linear_cross_entropy.mojo), called once per chunk
# of tokens: it is not the spec's forward phase; the provider runs the chunk loop and the GEMMs as torch
# matmuls around it (ops/linear_cross_entropy.py fused_forward, as the Triton backend does). logits is read
# and, when grad, overwritten with d loss / d logits. It holds the forward's MAX name, so the package
# registering it is what makes the forward available; the backward (torch multiplies of the saved
# gradients) runs wherever it does (RUNS_ON).
LINEAR_CROSS_ENTROPY_ROWS = OpSpec(
    op="linear_cross_entropy",
    max_op="fusekit.linear_cross_entropy",
    outputs=(TensorSpec("logits", ("C", "V"), "x"), TensorSpec("rows", ("C",), "float32")),
    inputs=(TensorSpec("labels", ("C",), "int64"), TensorSpec("scale", (1,), "float32")),
    params=("ignore_hi", "ignore_mid", "ignore_lo", "label_smoothing", "grad"),
    dtype_vars=("x",),
    allowed=frozenset((d,) for d in (torch.float32, torch.float16, torch.bfloat16)),
    bind=_bind_lce_rows,
)
# MAX op names of phases that have no Mojo op of their own -> the op whose registration they need.
RUNS_ON = {"fusekit.linear_cross_entropy_backward": LINEAR_CROSS_ENTROPY_ROWS.max_op}


# --- workspace sizes: each mirrors its kernel's launch plan (the Mojo file states the same bound) ---------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _aligned16(*ts: torch.Tensor | tuple) -> bool:
    """Every tensor's data is 16-byte aligned (a dummy marker stands for a fresh torch allocation: it is)."""
    return all(not isinstance(t, torch.Tensor) or t.data_ptr() % 16 == 0 for t in ts)


# mojo/reduce_sum.mojo
RS_BLOCK = 256  # BLOCK
RS_WARP_ROW_MAX = 2048  # WARP_ROW_MAX
RS_UNROLL = 8  # UNROLL


def reduce_sum_partials(outs: tuple, ins: tuple, sms: int) -> int:
    """The partials reduce_sum_gpu writes: rows longer than WARP_ROW_MAX are split only while
    m < wave = sms * (2048 // BLOCK), into splits = min(cdiv(wave, m), n // (BLOCK * VW * UNROLL * 2))
    chunks (each keeps two unrolled steps a thread): m * splits, none where splits is 1 (one kernel, no
    partials: a decode-sized sum allocates no workspace per call)."""
    x = ins[0]
    m, n = x.shape
    wave = sms * (2048 // RS_BLOCK)
    if n <= RS_WARP_ROW_MAX or m >= wave:
        return 0
    splits = min(-(-wave // m), n // (RS_BLOCK * (16 // x.element_size()) * RS_UNROLL * 2))
    return m * splits if splits > 1 else 0


# mojo/_norm_backward.mojo (norm_bwd_gpu)
NB_REG_ELEMS = 8  # REG_ELEMS
NB_PIPE_COLS = 16  # PIPE_COLS: columns per thread of rms_norm's cp.async kernel (NVIDIA, 16-bit x)
NB_LOOP_BLK = 512  # LOOP_BLK


class _NormBwdPlan(NamedTuple):
    m: int
    n: int
    nv: int  # 16-byte vectors per row
    nv_per: int  # vectors per thread of the whole-row kernel: NV (register kernel), or 2 in rms_norm's cp.async one
    vec_ok: bool  # N a whole number of vectors and every pointer 16-byte aligned


def _on_nvidia(t: torch.Tensor) -> bool:
    """The tensor lives on an NVIDIA GPU (the kernels' `DeviceContext.default_device_info.api == "cuda"`)."""
    return t.device.type == "cuda" and torch.version.hip is None


def _norm_bwd_plan(outs: tuple, ins: tuple, ln: bool) -> _NormBwdPlan:
    dx, dy, dh, xin, w = outs[0], ins[0], ins[1], ins[2], ins[3]
    m, n = dx.shape
    vw = 16 // dx.element_size()
    vec_ok = n % vw == 0 and _aligned16(dx, dy, xin, w, dh)
    # rms_norm's cp.async kernel (NVIDIA, 16-bit x, aligned rows of <= 1024 * 16) holds 16 columns per thread;
    # its rows never reach the column-tiled plan (N <= 1024 * nv_per vectors)
    pipe = not ln and vec_ok and _on_nvidia(dx) and dx.element_size() == 2 and n <= 1024 * NB_PIPE_COLS
    nv_per = NB_PIPE_COLS // vw if pipe else max(1, NB_REG_ELEMS // vw)
    return _NormBwdPlan(m, n, n // vw, nv_per, vec_ok)


def norm_bwd_sums(outs: tuple, ins: tuple, sms: int, ln: bool = False) -> int:
    """The column-tiled kernel's row sums (aligned rows of more than 1024 * NV vectors that rms_norm's
    cp.async kernel does not take; `ln`: layer_norm's backward): [M, 2]."""
    p = _norm_bwd_plan(outs, ins, ln)
    return 2 * p.m if p.vec_ok and p.nv > 1024 * p.nv_per else 0


def norm_bwd_partials(outs: tuple, ins: tuple, sms: int, ln: bool = False) -> int:
    """P * N fp32 partials of dw (and of db), P = the persistent grid's rows of partials (exactly the
    plan's): unaligned: min(M, SMs * 1024 // BLK) (BLK 128 up to N = 4096, else LOOP_BLK); long aligned
    rows: max(1, min(M, cdiv(SMs, chunks))) with chunks = cdiv(N / VW, 1024 * NV); else
    min(M, SMs * max(1, 1024 // BLK)) with BLK the smallest power of two >= 64 holding the row in NV
    vectors per thread, or in 16 columns per thread in rms_norm's cp.async kernel. So P <= max(1, min(M,
    16 SMs)) on every plan."""
    p = _norm_bwd_plan(outs, ins, ln)
    if not p.vec_ok:
        progs = min(p.m, sms * (1024 // (128 if p.n <= 4096 else NB_LOOP_BLK)))
    elif p.nv > 1024 * p.nv_per:
        progs = max(1, min(p.m, _cdiv(sms, _cdiv(p.nv, 1024 * p.nv_per))))
    else:
        blk = max(64, 1 << max(0, _cdiv(p.nv, p.nv_per) - 1).bit_length())
        progs = min(p.m, sms * max(1, 1024 // blk))
    return progs * p.n


# mojo/attention.mojo (attention_backward_gpu)
def attention_delta(outs: tuple, ins: tuple, sms: int) -> int:
    """delta_i = rowsum(do_i * o_i): one fp32 per query row, B * H * S."""
    b, h, s, _ = outs[0].shape
    return b * h * s


# mojo/_attention_decode.mojo (decode_applies, decode_plan, decode_part_len): the split-KV forward's partials
AD_MAX_S = 16  # DECODE_MAX_S
AD_MAX_ROWS = 128  # DECODE_MAX_ROWS
AD_CTAS_PER_SM = 4  # DECODE_CTAS_PER_SM
AD_MIN_TILES = 2  # DECODE_MIN_TILES
AD_MAX_SPLITS = 256  # DECODE_MAX_SPLITS
AD_TILE_BYTES = 8192  # DECODE_TILE_BYTES
AD_MAX_BN = 32  # DECODE_MAX_BN
AD_Q_ELEMS = 4096  # DECODE_Q_ELEMS
AD_REG_ROWS = 8  # DECODE_REG_ROWS: groups of at most this many rows take the register kernel
AD_REG_CTAS_PER_SM = 8  # DECODE_REG_CTAS_PER_SM
AD_REG_MIN_KEYS = 64  # DECODE_REG_MIN_KEYS
AD_MMA_MIN_ROWS = 2  # DECODE_MMA_MIN_ROWS: 2-byte dtypes from 2 rows: the tensor-core plan
AD_MMA_MAX_D = 128  # DECODE_MMA_MAX_D
AD_MMA_CTAS_PER_SM = 2  # DECODE_MMA_CTAS_PER_SM
AD_MMA_MIN_TILES = 2  # DECODE_MMA_MIN_TILES
AD_MMA_BN = 64  # DECODE_MMA_BN: keys per tile


def attention_decode_splits(b: int, h: int, hkv: int, s: int, skv: int, d: int, es: int, sms: int) -> int:
    """The split count of the decode kernels (decode_plan), 0 where attention_gpu does not take them: S <= 16,
    a GQA group of H/Hkv * S <= 128 rows, D 64 / 128 / 256. fp16 / bf16 at D <= 128 with >= 2 rows: the
    tensor-core kernel's count (MMA_* below). Otherwise blocks = B * Hkv * row_blocks * splits aim at
    CTAS_PER_SM per SM, each split at least MIN_TILES tiles of BN keys, at most MAX_SPLITS; groups of at most
    REG_ROWS rows (the register kernel, one row block): B * Hkv * splits aim at REG_CTAS_PER_SM per SM, each
    split at least REG_MIN_KEYS keys, at most MAX_SPLITS."""
    if d not in (64, 128, 256) or s > AD_MAX_S or (h // hkv) * s > AD_MAX_ROWS:
        return 0
    rows = (h // hkv) * s
    if es == 2 and rows >= AD_MMA_MIN_ROWS and d <= AD_MMA_MAX_D:
        # the tensor-core kernel (MMA_BN-key tiles): B * Hkv * splits fill one wave of MMA_CTAS_PER_SM blocks per SM,
        # each split at least MMA_MIN_TILES tiles (the SIMT kernels take the same count where it does not run)
        max_m = max(1, min(AD_MAX_SPLITS, _cdiv(skv, AD_MMA_BN) // AD_MMA_MIN_TILES))
        return max(1, min(max_m, sms * AD_MMA_CTAS_PER_SM // max(b * hkv, 1)))
    if rows <= AD_REG_ROWS:
        max_r = max(1, min(AD_MAX_SPLITS, skv // AD_REG_MIN_KEYS))
        return max(1, min(max_r, _cdiv(sms * AD_REG_CTAS_PER_SM, max(b * hkv, 1))))
    bn = max(1, min(AD_MAX_BN, AD_TILE_BYTES // (d * es)))
    row_blocks = max(1, _cdiv(rows, min(64, AD_Q_ELEMS // d)))
    groups = b * hkv * row_blocks
    max_s = max(1, min(AD_MAX_SPLITS, _cdiv(skv, bn) // AD_MIN_TILES))
    return max(1, min(max_s, _cdiv(sms * AD_CTAS_PER_SM, max(groups, 1))))


# The split-KV decode kernels run decode shapes by default (checked on an H100, 2026-11-27: the harness's
# attn_decode cases 0 failures; the GPU conformance suite's attention forward and kv_len cases passed with them;
# B1 H32/8 D128 2.1x / 3.1x / 4.2x the prefill kernels at Skv 2048 / 8192 / 32768, B32 1.3x, with the tile
# kernel for every decode shape; the register kernel that now takes groups of <= 8 rows: harness 1680 checks,
# 0 failures, 2.7-4.5x the tile kernel, mojo/_attention_decode.mojo's header).
# FUSEKIT_MOJO_ATTN_DECODE=0 keeps the prefill kernels for decode shapes. On, the forward spec gets a 4th
# params slot (`decode`, its presence read by Attention.execute, as the backward's bwd_tc) and the workspace
# its size. Read once per process.
ATTN_DECODE_ENV = "FUSEKIT_MOJO_ATTN_DECODE"
ATTN_DECODE = os.environ.get(ATTN_DECODE_ENV, "1") not in ("", "0")


def attention_decode_part(outs: tuple, ins: tuple, sms: int) -> int:
    """The split partials, fp32: B*H*S * splits * (D + 1) (o then lse per split); 0 with one split, where
    the decode kernels do not run, or while they are off (ATTN_DECODE)."""
    if not ATTN_DECODE:
        return 0
    q, k = ins[0], ins[1]
    b, h, s, d = q.shape
    splits = attention_decode_splits(b, h, k.shape[1], s, k.shape[2], d, q.element_size(), sms)
    return b * h * s * splits * (d + 1) if splits > 1 else 0


# mojo/swiglu_ffn.mojo (swiglu_ffn_gpu_save)
SW_DECODE_MAX_T = 16  # DECODE_MAX_T
SW_TC_MIN_T = 16  # TC_MIN_T
SW_TC_PAD = 256  # TC_PAD
SW_STATIC_DF = ((4096, 11008),)  # _STATIC_DF: the (D, F) pairs of the bf16 wgmma path (NVIDIA only)


class _FfnPlan(NamedTuple):
    t: int
    d: int
    f: int
    tp: int  # xn's rows: T rounded up to TC_PAD on the wgmma path, else T
    tc: bool  # the static-shape wgmma path (_STATIC_DF; fusekit.swiglu_ffn_tc only)


def ffn_static_tc(x: torch.Tensor, d: int, f: int) -> bool:
    """The Mojo op's own tensor-core path: bf16 at a (D, F) of _STATIC_DF on NVIDIA (T >= TC_MIN_T)."""
    return x.dtype == torch.bfloat16 and (d, f) in SW_STATIC_DF and torch.version.hip is None


def _ffn_plan(ins: tuple, with_tc: bool) -> _FfnPlan:
    """fusekit.swiglu_ffn (with_tc False: GEMV path only) or fusekit.swiglu_ffn_tc (with the wgmma path)."""
    x, w_gate = ins[0], ins[1]
    t, d = x.shape
    f = w_gate.shape[0]
    tc = with_tc and t >= SW_TC_MIN_T and ffn_static_tc(x, d, f)
    return _FfnPlan(t, d, f, _cdiv(t, SW_TC_PAD) * SW_TC_PAD if tc else t, tc)


def swiglu_xn(outs: tuple, ins: tuple, sms: int, with_tc: bool = False) -> int:
    """The normed activations, Tp * D."""
    p = _ffn_plan(ins, with_tc)
    return p.tp * p.d


def swiglu_h(outs: tuple, ins: tuple, sms: int, with_tc: bool = False) -> int:
    """h = silu(g) u in x's dtype: Tp * F on the wgmma path, else one GEMV chunk of min(T, DECODE_MAX_T) rows."""
    p = _ffn_plan(ins, with_tc)
    return p.tp * p.f if p.tc else min(p.t, SW_DECODE_MAX_T) * p.f


def swiglu_g(outs: tuple, ins: tuple, sms: int, with_tc: bool = False) -> int:
    """The wgmma path's fp32 gate product G, Tp * F."""
    p = _ffn_plan(ins, with_tc)
    return p.tp * p.f if p.tc else 0


def swiglu_out(outs: tuple, ins: tuple, sms: int, with_tc: bool = False) -> int:
    """The wgmma path's padded output, Tp * D (its first T rows are copied to the caller's y)."""
    p = _ffn_plan(ins, with_tc)
    return p.tp * p.d if p.tc else 0


def _swiglu_workspaces(with_tc: bool) -> tuple[Workspace, ...]:
    fns = (
        ("xn", "x", swiglu_xn),
        ("h", "x", swiglu_h),
        ("g", "float32", swiglu_g),
        ("out_pad", "x", swiglu_out),
    )
    return tuple(Workspace(n, dt, functools.partial(fn, with_tc=with_tc)) for n, dt, fn in fns)


# fusekit.swiglu_ffn with the wgmma path compiled in (mojo/swiglu_ffn.mojo SwigluFfnTc): the backend calls it
# only for a bf16 prefill at a _STATIC_DF pair, so other calls never compile MAX's sm90 matmuls (~70 s).
SWIGLU_FFN_TC_OP = "fusekit.swiglu_ffn_tc"


_LN_SUMS = functools.partial(norm_bwd_sums, ln=True)
_LN_PARTIALS = functools.partial(norm_bwd_partials, ln=True)
# The workspaces of each MAX op, in the Mojo op's parameter order (after its outputs).
WORKSPACES: dict[str, tuple[Workspace, ...]] = {
    "fusekit.reduce_sum": (Workspace("part", "acc", reduce_sum_partials),),
    "fusekit.rms_norm_backward": (
        Workspace("sums", "float32", norm_bwd_sums),
        Workspace("part_w", "float32", norm_bwd_partials),
    ),
    "fusekit.layer_norm_backward": (
        Workspace("sums", "float32", _LN_SUMS),
        Workspace("part_w", "float32", _LN_PARTIALS),
        Workspace("part_b", "float32", _LN_PARTIALS),
    ),
    "fusekit.attention": (Workspace("part", "float32", attention_decode_part),),
    "fusekit.attention_backward": (Workspace("delta", "float32", attention_delta),),
    "fusekit.swiglu_ffn": _swiglu_workspaces(False),
    SWIGLU_FFN_TC_OP: _swiglu_workspaces(True),
}


# attention's backward runs the tensor-core kernels (mojo/_attention_backward.mojo: FlashAttention-2, mma.sync,
# deterministic) by default since they passed the H100 harness (60 cases against float64 and the SIMT kernels,
# 25-48x faster than SIMT at S 2048); FUSEKIT_MOJO_ATTN_BWD_TC=0 keeps the SIMT kernels. The tensor-core
# choice is a 4th params slot, bwd_tc = 1, after [causal, scale, has_kv_len]: the Mojo launcher reads the
# slot's presence (params' length is known on the host; reading its value would need a device -> host copy).
# Read once per process, when the phase's spec is first built.
ATTN_BWD_TC_ENV = "FUSEKIT_MOJO_ATTN_BWD_TC"


def attention_bwd_tc() -> bool:
    return os.environ.get(ATTN_BWD_TC_ENV, "1") != "0"


def with_flag(ms: OpSpec, name: str) -> OpSpec:
    """The spec with one more params slot `name`, always 1: its presence (params' length) selects kernels in
    the Mojo launcher (attention's backward `bwd_tc`, forward `decode`)."""
    bind = ms.bind

    def bind_flag(outs: tuple, ins: tuple, values: tuple) -> Bound:
        o, i, params = bind(outs, ins, values)
        return o, i, (*params, 1.0)

    return dataclasses.replace(ms, params=(*ms.params, name), bind=bind_flag)


@functools.cache
def swiglu_ffn_tc_spec() -> OpSpec:
    """swiglu_ffn's forward spec as fusekit.swiglu_ffn_tc (the same tensors; its own workspace plan)."""
    fwd = phase_spec("swiglu_ffn", "forward")
    return dataclasses.replace(fwd, max_op=SWIGLU_FFN_TC_OP, workspaces=WORKSPACES[SWIGLU_FFN_TC_OP])


@functools.cache
def phase_spec(op: str, phase: str) -> OpSpec:
    """The MAX spec of one phase of a registered fusekit op (cached)."""
    from fusekit.ops import SPECS as OP_SPECS

    ms = max_spec(OP_SPECS[op], phase)
    if op == "attention" and phase == "backward" and attention_bwd_tc():
        ms = with_flag(ms, "bwd_tc")
    if op == "attention" and phase == "forward" and ATTN_DECODE:
        ms = with_flag(ms, "decode")
    if op == "attention":  # q [B, H, S, D] in both phases
        ms = dataclasses.replace(ms, shape_params=(("head_dim", "q", 3),))
    return ms


def __getattr__(name: str) -> dict[str, OpSpec]:
    if (
        name == "SPECS"
    ):  # op name -> forward MAX spec (built lazily: fusekit.ops imports the backends' registry)
        from fusekit.ops import SPECS as OP_SPECS

        return {op: phase_spec(op, "forward") for op in OP_SPECS}
    raise AttributeError(name)
