"""attention: scaled dot-product attention with GQA, bottom-right causal masking, per-sequence KV
lengths (`kv_len`) and KV caches read in place (k/v may be strided views)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusekit import dispatch, distributed, library
from fusekit.distributed import PLAIN
from fusekit.ops import _amp
from fusekit.ops import _checks as C
from fusekit.ops._spec import BACKWARD, FORWARD, OpSpec, Phase, Scalar, t

F64 = torch.float64


def _acc(dtype: torch.dtype) -> torch.dtype:
    return F64 if dtype == F64 else torch.float32


def _masks(
    s: int, skv: int, causal: bool, kv_len: Tensor | None, device
) -> tuple[Tensor | None, Tensor | None]:
    """(visible [B|1, 1, S, Skv] bool, in_range [B, 1, Skv, 1] bool); None where everything is.

    Sequence b's keys are 0..L_b - 1 with L_b = clamp(kv_len[b], 0, Skv) (Skv without kv_len); under
    `causal` its query i sees key j iff j <= i + (L_b - S) (bottom-right, the queries are its last S
    positions), which implies j < L_b.
    """
    if kv_len is None and not causal:
        return None, None
    j = torch.arange(skv, device=device)
    in_range = None
    if kv_len is None:
        lens = torch.full((1,), skv, device=device, dtype=torch.int64)
    else:
        lens = kv_len.to(device=device, dtype=torch.int64).clamp(0, skv)
        in_range = j[None, :] < lens[:, None]  # [B, Skv]
    visible = None if in_range is None else in_range[:, None, None, :]
    if causal:
        i = torch.arange(s, device=device)[:, None]
        c = j[None, None, None, :] <= i[None, None] + (lens[:, None, None, None] - s)
        visible = c if visible is None else visible & c
    return visible, None if in_range is None else in_range[:, None, :, None]


def _in_range(x: Tensor, in_range: Tensor | None) -> Tensor:
    """k or v with the keys past kv_len replaced by 0: they are never read, whatever a cache holds there."""
    return (
        x if in_range is None else torch.where(in_range, x, torch.zeros((), dtype=x.dtype, device=x.device))
    )


def _probs(
    q: Tensor,
    k: Tensor,
    causal: bool,
    scale: float,
    kv_len: Tensor | None = None,
    lse: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(p [B, H, S, Skv], lse [B, H, S]) in the math dtype; kv heads repeated for GQA.

    Rows with no visible key have lse = -inf and p = 0; every NaN/Inf of q or a visible key reaches
    its row as in a plain float softmax (a masked key never matters). `k` must already have its keys
    past kv_len zeroed (`_in_range`).
    """
    S, Skv = q.shape[2], k.shape[2]
    acc = _acc(q.dtype)
    kf = k.to(acc).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.to(acc) @ kf.transpose(-1, -2)) * scale
    visible, _ = _masks(S, Skv, causal, kv_len, q.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    lse = lse.to(acc)
    empty = torch.isneginf(lse)[..., None]  # no visible key: defined as a zero row, not NaN
    p = torch.where(empty, torch.zeros((), dtype=acc, device=q.device), torch.exp(s - lse[..., None]))
    return p, lse


def _group_sum(t: Tensor, hkv: int) -> Tensor:
    """[B, H, ...] -> [B, Hkv, ...]: sum of each kv head's group of query heads."""
    b, h = t.shape[:2]
    return t.view(b, hkv, h // hkv, *t.shape[2:]).sum(dim=2)


# --- reference (what the op means; the torch backend runs it) ---------------------------------------
def reference_forward(
    q: Tensor, k: Tensor, v: Tensor, kv_len: Tensor | None, causal: bool, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """q [B, H, S, D], k/v [B, Hkv, Skv, D] (any strides), kv_len [B] int or None
    -> (o [B, H, S, D], lse [B, H, S] fp32, fp64 for fp64 q).

    Head h reads kv head h // (H // Hkv). Sequence b sees keys 0..L_b - 1, L_b = clamp(kv_len[b], 0,
    Skv) (all Skv without kv_len); keys past L_b are never read (a cache may hold anything there). Causal
    masking is aligned bottom-right as in FlashAttention: query i sees key j iff j <= i + (L_b - S).
    lse = logsumexp of the visible scaled scores (natural log); a row that sees no key outputs zeros
    with lse = -inf. (The older call reference_forward(q, k, v, causal, scale) is still accepted.)
    """
    if isinstance(kv_len, bool):  # reference_forward(q, k, v, causal, scale): the call before kv_len
        kv_len, causal, scale = None, kv_len, causal
    _, in_range = _masks(q.shape[2], k.shape[2], causal, kv_len, q.device)
    p, lse = _probs(q, _in_range(k, in_range), causal, scale, kv_len)
    vf = _in_range(v, in_range).to(p.dtype).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (p @ vf).to(q.dtype), lse  # lse in acc: fp32 (fp64 for fp64 q)


def reference_backward(
    do, q, k, v, o, lse, kv_len: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the saved lse (FlashAttention-2's formulas): p = exp(s - lse),
    dv = p^T do, dp = do v^T, ds = p (dp - rowsum(do o)), dq = scale ds k, dk = scale ds^T q;
    GQA sums each kv head's group. Keys past kv_len get zero gradients (and are never read)."""
    hkv = k.shape[1]
    _, in_range = _masks(q.shape[2], k.shape[2], causal, kv_len, q.device)
    k, v = _in_range(k, in_range), _in_range(v, in_range)
    p, _ = _probs(q, k, causal, scale, kv_len, lse)
    acc = p.dtype
    group = q.shape[1] // hkv
    dof = do.to(acc)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    kf = k.to(acc).repeat_interleave(group, dim=1)
    dv = _group_sum(p.transpose(-1, -2) @ dof, hkv)
    dp = dof @ vf.transpose(-1, -2)
    delta = (dof * o.to(acc)).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ kf) * scale
    dk = _group_sum(ds.transpose(-1, -2) @ q.to(acc), hkv) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


SPEC = library.register(
    OpSpec(
        name="attention",
        forward=Phase(
            # o in q's memory order: a q read from [B, S, H, D] gives o laid out so (a free transpose back)
            outputs=(t("o", "B H S D", like="q"), t("lse", "B H S", "acc", None, grad=False)),
            inputs=(
                t("q", "B H S D", strided=True),
                t("k", "B Hkv Skv D", strided=True),
                t("v", "B Hkv Skv D", strided=True),
                t("kv_len", "B", "int32", when="kv_len"),
            ),
            conditions=("kv_len",),
        ),
        backward=Phase(
            outputs=(t("dq", "B H S D"), t("dk", "B Hkv Skv D"), t("dv", "B Hkv Skv D")),
            inputs=(
                t("do", "B H S D"),
                t("q", "B H S D", strided=True),
                t("k", "B Hkv Skv D", strided=True),
                t("v", "B Hkv Skv D", strided=True),
                t("o", "B H S D", strided=True),  # the forward's o, in q's memory order
                t("lse", "B H S", "acc"),
                t("kv_len", "B", "int32", when="kv_len"),
            ),
            conditions=("kv_len",),
        ),
        scalars=(
            Scalar("causal", bool, lambda v: C.flag("causal", v)),
            Scalar("scale", float, lambda v: C.real("scale", v, positive=True)),
        ),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in C.ANY_FLOAT),
        reference={FORWARD: reference_forward, BACKWARD: reference_backward},
        grad_inputs=("q", "k", "v"),
        save=lambda ins, outs: (ins["q"], ins["k"], ins["v"], outs["o"], outs["lse"], ins["kv_len"]),
        backward_inputs=lambda saved, g, cond: (g["o"], *saved),
        input_grads=lambda g, cond: (g["dq"], g["dk"], g["dv"], None),
        meta=lambda ins, scalars: {"head_dim": ins["q"].shape[-1], "kv_len": ins["kv_len"] is not None},
    )
)


# --- public ------------------------------------------------------------------------------------------
def _check(q: object, k: object, v: object) -> None:
    q = C.tensor("q", q, C.ANY_FLOAT, ndim=4)
    if q.device.type == "cuda" and q.dtype in (torch.float32, F64):
        raise TypeError(
            f"q: {str(q.dtype).removeprefix('torch.')} attention runs on the CPU only; use float16 or bfloat16 on CUDA"
        )
    b, h, _, d = q.shape
    k = C.tensor("k", k, (q.dtype,), ndim=4)
    C.same_device("k", k, "q", q)
    hkv, skv = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k: expected shape [B={b}, Hkv, Skv, D={d}], got {tuple(k.shape)}")
    C.like("v", v, "k", k, tuple(k.shape))
    if hkv == 0 or h % hkv:
        raise ValueError(f"k: q heads H={h} must be a multiple of kv heads Hkv={hkv}")
    if skv == 0:
        raise ValueError("k: the key sequence length Skv must be > 0")
    if d == 0:
        raise ValueError("q: the head dim D must be > 0")


def _kv_len(kv_len: object, q: Tensor, k: Tensor) -> Tensor | None:
    """kv_len as contiguous int32 [B] on q's device. On the CPU its values are checked (0 <= kv_len[b]
    <= Skv); on CUDA they are trusted (checking would be a host sync per call) and every backend clamps
    them to [0, Skv], so a bad length can never read outside k/v."""
    if kv_len is None:
        return None
    kv_len = C.tensor("kv_len", kv_len, C.INT_DTYPES, ndim=1)
    C.same_device("kv_len", kv_len, "q", q)
    b, skv = q.shape[0], k.shape[2]
    if kv_len.shape[0] != b:
        raise ValueError(f"kv_len: expected shape [B={b}], got {tuple(kv_len.shape)}")
    ok = lambda: (kv_len >= 0) & (kv_len <= skv)
    if C.values_on_cpu("kv_len", kv_len, ok, "every length must be in [0, Skv]") and b:
        lo, hi = (int(x) for x in torch.aminmax(kv_len))
        if lo < 0 or hi > skv:
            raise ValueError(f"kv_len: every length must be in [0, Skv={skv}], got values in [{lo}, {hi}]")
    if kv_len.dtype != torch.int32:
        kv_len = kv_len.to(torch.int32)  # int32 callers skip this conversion (one small kernel on CUDA)
    return kv_len.contiguous()


LAYOUTS = ("bhsd", "bshd")
_MEMO = library.memo()  # validated calls (see library.call_key)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    kv_len: Tensor | None = None,
    layout: str = "bhsd",
    backend: str = "auto",
) -> Tensor:
    """Scaled dot-product attention, softmax(q k^T * scale) v, with GQA and per-sequence KV lengths.

    q [B, H, S, D]; k, v [B, Hkv, Skv, D] with H a multiple of Hkv (head h reads kv head
    h // (H / Hkv)); fp16/bf16 (fp32, fp64 on the CPU). Any D on the torch backend; the triton and mojo
    kernels take D in {64, 128, 256}. scale defaults to 1/sqrt(D). `causal` (a bool) masks aligned to
    the bottom-right as in FlashAttention: query i sees key j iff j <= i + Skv - S, so with S < Skv the
    queries are the last S positions; a query that sees no key (S > Skv) gets a zero output row.

    KV caches: k and v may be strided views whose last dim is contiguous, e.g. `k_cache.transpose(1,
    2)[:, :, :L]` of a preallocated cache [B, max_len, Hkv, D]; the triton backend reads them in place
    (no copy), other backends get a contiguous copy. `kv_len` (int32 [B] on q's device; int64 is
    converted): sequence b uses keys 0..kv_len[b] - 1 only, and whatever the cache holds past them is
    never read; with `causal` its S queries are its last S positions (the rule above with Skv =
    kv_len[b]). kv_len[b] must lie in [0, Skv]: checked on the CPU (ValueError); on CUDA the values are
    trusted (no host sync) and clamped to [0, Skv]. A row that sees no key (kv_len[b] = 0, or causal
    with S > kv_len[b]) is zero. For S <= 16 the triton backend runs a split-KV (flash-decoding) kernel.
    (The mojo backend takes kv_len too; it reads contiguous copies of strided k/v.)

    NaN/Inf in q or k reach exactly the rows that see them, as a float64 softmax would; a masked key
    never matters. (A NaN in v at a causally masked position may reach a row through 0·NaN, as in
    every flash kernel: loud, never silent; keys past kv_len are never read at all.)

    layout: "bhsd" (default: q [B, H, S, D], k/v [B, Hkv, Skv, D], as HF's attention receives them) or
    "bshd" (q [B, S, H, D], k/v [B, Skv, Hkv, D], as flash-attention and KV caches hold them; the triton
    backend reads k/v as views, and q too in its FlashAttention and decode kernels - its Gluon kernel
    (large, no kv_len) takes a copy, other backends copy); the output has q's layout (a view for
    "bshd") and q's memory order (as SDPA's output): for a q read from a [B, S, H, D] source it is laid
    out [B, S, H, D], so `o.reshape(B, S, H * D)` after a "bshd" call (or HF's transpose back) copies
    nothing. A [B, S, H, D] tensor passed as "bhsd" cannot be told apart from a valid call when its
    shapes fit: name the layout whenever tensors come from a [B, S, H, D] source.
    backend: "auto" (default), "torch", "triton" or "mojo". Gradients flow to q, k and v
    (FlashAttention-2 backward from the saved log-sum-exp; keys past kv_len get zero gradients).
    Errors: TypeError/ValueError naming `q`, `k`, `v`, `kv_len`, `causal`, `scale` or `layout`.
    """
    if (
        type(q) not in PLAIN or type(k) not in PLAIN or type(v) not in PLAIN or type(kv_len) not in PLAIN
    ) and (out := distributed.attention(q, k, v, causal, scale, kv_len, layout, backend)) is not None:
        return out  # DTensor inputs: local compute on the shards (fusekit.distributed)
    if (cast := _amp.lower(q, k, v)) is not None:  # autocast: as F.scaled_dot_product_attention
        q, k, v = cast
    key = library.call_key((q, k, v, kv_len), (causal, scale, layout), backend)
    if key is not None and kv_len is not None and kv_len.device.type == "cpu":
        key = None  # its values are checked on the CPU: no memo
    run = _MEMO.get(key) if key is not None else None
    grown = None
    if run is None and key is not None and (grown := _grown_key(key, q, k, v, layout)) is not None:
        run = _MEMO.get(grown)
        if run is not None and run.repeats(k.shape[2]):
            run = None  # this length stopped changing: the checked path gives it a replaying runner
    bshd = (layout == "bshd") if run is not None else C.choice("layout", layout, LAYOUTS) == "bshd"
    if bshd:  # shapes are checked (and named) in [B, H, S, D] terms after the transposing views
        if run is None:
            q, k, v = (C.tensor(n, t, C.ANY_FLOAT, ndim=4) for n, t in (("q", q), ("k", k), ("v", v)))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if run is None:  # the checked path (first call of a signature, grad, compile)
        _check(q, k, v)
        causal = SPEC.scalars[0].check(causal)
        s = SPEC.scalars[1].check(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        kv_len = _kv_len(kv_len, q, k)
        C.backend_name(backend)
    elif kv_len is not None:  # as _kv_len makes it: contiguous int32
        kv_len = (kv_len if kv_len.dtype == torch.int32 else kv_len.to(torch.int32)).contiguous()
    # q, k, v go as they are: the library copies them for providers that do not read strides.
    ins = (q, k, v, kv_len)
    if run is not None:
        o = run(ins)[0]
    else:
        o = library.apply_memo(_MEMO, key, SPEC, ins, (causal, s), backend, ("lse",))[0]
        if grown is not None and grown not in _MEMO and isinstance(checked := _MEMO.get(key), library.Runner):
            _MEMO[grown] = checked.unreplayed()  # kept on a promotion: its run lengths are the history
    return o.transpose(1, 2) if bshd else o


def _grown_key(key: tuple, q: Tensor, k: Tensor, v: Tensor, layout: str) -> tuple | None:
    """The memo key of a decode call (S <= 16 queries, "bhsd") with the KV length Skv left out, or None.

    A Hugging Face DynamicCache grows by one key per token, so every decode step is a new signature:
    validation, a new plan and a new memo entry per layer and token (~50 us of host time on a CPU where
    a repeated call costs 8). Nothing a validated call's plan holds depends on Skv here: the outputs are
    [B, H, S, D] and [B, H, S], the provider (the decode shape class goes by S), and which of k/v are
    copied (contiguous ones never; a view's strides, e.g. of a preallocated cache, stay in the key). The
    checks that read Skv are kept in the key as facts: k and v have the same Skv, and it is > 0. Calls
    under such a key run through Runner.unreplayed (no launch replay: it would bake the recorded Skv in;
    re-recording once per length for the other layers to replay was measured slower on the H200: 113-118
    vs 96-103 us per call at B1 H32/8 D128, since a recording costs several plain calls).
    Not inside a CUDA graph capture: a new Skv may be a kernel's first specialization (a compile).
    A length that stops changing (a fixed-size workload after a call of another size) is handed back to
    its exact key after a while (library.SizedRunner.repeats), so it replays as any fixed signature."""
    if q is None or k is None or v is None or layout != "bhsd" or dispatch.capturing():
        return None
    if q.dim() != 4 or q.shape[2] > dispatch.DECODE_TOKENS or k.dim() != 4 or v.dim() != 4:
        return None
    grown = list(key)  # q, k, v present: their entries are the key's first tensor slots
    for pos, kv_t in ((library.key_slot(1), k), (library.key_slot(2), v)):
        shape = kv_t.shape
        grown[pos + 1] = (shape[0], shape[1], shape[3])  # the shape without Skv
        grown[pos + 2] = "C" if kv_t.is_contiguous() else kv_t.stride()
    same = k.shape[2] == v.shape[2] and k.shape[2] > 0
    return ("grown", *grown, same)
