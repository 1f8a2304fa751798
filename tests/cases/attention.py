"""attention cases: (B, H, Hkv, S, Skv, D) incl. GQA, S ≠ Skv both ways (causal rows with no key);
per-sequence lengths (`kv_len`: odd ones, a 0, one equal to Skv; the keys past them NaN, which must never
be read) and k/v as strided views of a KV cache [B, max_len, Hkv, D] (`cache`: max_len - Skv), read in
place by backends that read strides. S <= 16 runs the triton split-KV decode kernels."""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint

from cases import randn

F64 = torch.float64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRAD = DTYPES
CUDA_DTYPES = (torch.float16, torch.bfloat16)  # fp32 attention on CUDA is refused (TypeError)
_CPU = [
    (1, 2, 2, 16, 16, 64),
    (2, 4, 2, 37, 37, 64),
    (1, 4, 1, 16, 45, 64),
    (1, 2, 2, 45, 16, 128),
    (1, 2, 1, 33, 33, 256),
    (1, 1, 1, 1, 1, 64),
    (1, 2, 2, 0, 8, 64),
    (1, 4, 1, 37, 53, 64),
    (1, 2, 2, 53, 37, 128),
]
_CUDA = [
    (2, 8, 2, 1024, 1024, 128),
    (1, 16, 16, 777, 1025, 64),
    (1, 8, 4, 513, 256, 256),
    (4, 32, 32, 2048, 2048, 128),
]
# (dims, kv_len or None, cache slack or None)
_CPU_KV = [
    ((3, 4, 2, 5, 37, 64), (37, 0, 18), 3),  # decode: GQA 2, a 0 length, a full one
    ((2, 4, 1, 1, 53, 64), (1, 29), 11),  # one query, GQA 4
    ((2, 2, 2, 21, 45, 64), (45, 13), None),  # FlashAttention path; causal with S > kv_len: empty rows
    ((2, 8, 2, 16, 33, 128), None, 5),  # a strided cache without kv_len, 64 rows per GQA group
]
_CUDA_KV = [
    ((4, 32, 8, 1, 4099, 128), (4099, 1, 2048, 3001), 61),
    ((2, 16, 2, 16, 2053, 64), (777, 2053), 17),
    ((2, 8, 1, 5, 1000, 256), (515, 1000), 24),
    ((2, 8, 8, 300, 777, 128), (777, 299), 9),
]
CPU = [{"dims": d, "causal": c} for d in _CPU for c in (False, True)] + [
    {"dims": d, "causal": c, "kv_len": kl, "cache": m} for d, kl, m in _CPU_KV for c in (False, True)
]
CUDA = [{"dims": d, "causal": c} for d in _CUDA for c in (False, True)] + [
    {"dims": d, "causal": c, "kv_len": kl, "cache": m} for d, kl, m in _CUDA_KV for c in (False, True)
]


def make(case: dict, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    b, h, hkv, s, skv, d = case["dims"]
    q = randn(b, h, s, d, dtype=dtype, device=device)
    slack = case.get("cache")
    if slack is None:
        k = randn(b, hkv, skv, d, dtype=dtype, device=device)
        v = randn(b, hkv, skv, d, dtype=dtype, device=device)
    else:  # views of caches [B, max_len, Hkv, D] whose slots past Skv hold NaN (outside the view)
        k_cache = randn(b, skv + slack, hkv, d, dtype=dtype, device=device)
        v_cache = randn(b, skv + slack, hkv, d, dtype=dtype, device=device)
        k_cache[:, skv:] = math.nan
        v_cache[:, skv:] = math.nan
        k, v = k_cache.transpose(1, 2)[:, :, :skv], v_cache.transpose(1, 2)[:, :, :skv]
    kwargs = {"causal": case["causal"]}
    if case.get("kv_len") is not None:
        kv_len = case["kv_len"]
        with torch.no_grad():
            for i, n in enumerate(kv_len):  # keys past a sequence's length are garbage: never read
                k[i, :, n:] = math.nan
                v[i, :, n:] = math.nan
        kwargs["kv_len"] = torch.tensor(kv_len, dtype=torch.int32, device=device)
    return (q, k, v), kwargs


def oracle(q, k, v, causal=False, scale=None, kv_len=None):
    """Float64 attention, computed in blocks of query rows so that its [B, H, rows, Skv] scores stay near
    ORACLE_BLOCK_BYTES (the whole (4, 32, 2048, 2048) score tensor is 4 GiB in float64, and several such
    temporaries per pytest worker ran an H200 out of memory at -n 8); under autograd each block is
    checkpointed, so the float64 backward recomputes it instead of holding every block's scores. The keys and
    values (kv_len-masked, GQA heads expanded, float64) are formed once for all blocks."""
    S = q.shape[2]
    kd, vd, lens, scale, masked, rows = _prepared(q, k, v, causal, scale, kv_len)
    if rows >= S:
        return (_oracle_rows(q, kd, vd, lens, causal, masked, scale, 0, S),)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, kd, vd))
    blocks = []
    for r0 in range(0, S, rows):
        args = (q[:, :, r0 : r0 + rows], kd, vd, lens, causal, masked, scale, r0, S)
        if grad:
            blocks.append(torch.utils.checkpoint.checkpoint(_oracle_rows, *args, use_reentrant=False))
        else:
            blocks.append(_oracle_rows(*args))
    return (torch.cat(blocks, dim=2),)


ORACLE_BLOCK_BYTES = 256 * 2**20


def _kv64(q, k, v, kv_len):
    """Float64 keys and values per query head [B, H, Skv, D] (GQA heads expanded; with kv_len, sequence b's
    keys past kv_len[b] zeroed, whatever they hold) and the keys each sequence sees, lens [B]. v None: the
    keys only (vd None)."""
    B, H = q.shape[:2]
    Hkv, Skv = k.shape[1], k.shape[2]
    lens = torch.full((B,), Skv, device=q.device) if kv_len is None else kv_len.long()
    kd, vd = k.to(F64), None if v is None else v.to(F64)
    if kv_len is not None:
        in_range = (torch.arange(Skv, device=q.device)[None, :] < lens[:, None])[:, None, :, None]
        kd = torch.where(in_range, kd, torch.zeros((), dtype=F64, device=q.device))
        if vd is not None:
            vd = torch.where(in_range, vd, torch.zeros((), dtype=F64, device=q.device))
    kv_head = torch.arange(H, device=q.device) // (H // Hkv)
    return kd[:, kv_head], None if vd is None else vd[:, kv_head], lens


def _prepared(q, k, v, causal, scale, kv_len):
    """What the oracle and the error magnitudes share: (kd, vd, lens) of _kv64, the scale (1/sqrt(D) by
    default), whether scores are masked, and the query rows per block (ORACLE_BLOCK_BYTES of scores)."""
    B, H, _, D = q.shape
    kd, vd, lens = _kv64(q, k, v, kv_len)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    rows = max(1, ORACLE_BLOCK_BYTES // max(1, B * H * k.shape[2] * 8))
    return kd, vd, lens, scale, causal or kv_len is not None, rows


def _oracle_rows(q, kd, vd, lens, causal, masked, scale, r0, S):
    """The float64 attention of the query rows q = rows r0.. of all S (S: for the bottom-right causal
    diagonal) over oracle's float64 kd, vd [B, H, Skv, D] (lens: the keys each sequence sees)."""
    return torch.einsum("bhst,bhtd->bhsd", _probs_rows(q, kd, lens, causal, masked, scale, r0, S), vd)


def _probs_rows(q, kd, lens, causal, masked, scale, r0, S):
    """The float64 probabilities p [B, H, rows, Skv] of `_oracle_rows`."""
    s = torch.einsum("bhsd,bhtd->bhst", q.to(F64), kd) * scale
    if masked:
        i = torch.arange(r0, r0 + q.shape[2], device=q.device)[:, None]
        j = torch.arange(kd.shape[2], device=q.device)[None, :]
        seen = j < lens[:, None, None, None]  # [B, 1, 1, Skv]
        if causal:  # bottom-right against each sequence's own length
            seen = seen & (j <= i + (lens[:, None, None, None] - S))
        s = torch.where(seen, s, torch.tensor(-math.inf, dtype=F64, device=q.device))
    m = s.amax(-1, keepdim=True)
    # A row with no visible key (m = -inf) is defined as zeros; NaN anywhere in a row stays NaN.
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    return torch.where(denom == 0, torch.zeros_like(p), p / torch.where(denom == 0, 1.0, denom))


def grad_magnitude(args: tuple, kwargs: dict) -> float:
    """How much larger than O(1) the gradients' rounding may be: an fp32/half backward recomputes
    p = exp(logit - lse), whose relative error is ~u·|logit|, and |logit| ~ scale·√D for O(1) inputs.
    With the default scale (1/√D) that is 1; a drawn scale of 2.0 at D 64 makes it 16. Inputs whose
    rows are alike along D (a broadcast view) have logits up to D·scale instead: the measured RMS logit
    (`_logit_rms`) raises the estimate there, never lowers it (fuzz: q, k broadcast along D 64 with
    scale 1 put logits near 280 and fp32 dv 1.5x past its tolerance against the √D estimate of 8)."""
    q, k = args[0].detach(), args[1].detach()
    kd, _, _, scale, _, _ = _prepared(  # keys only: v is not read here
        q, k, None, kwargs.get("causal", False), kwargs.get("scale"), kwargs.get("kv_len")
    )
    return max(1.0, abs(scale) * math.sqrt(q.shape[-1]), _logit_rms(q, kd, scale))


def _logit_rms(q: torch.Tensor, kd: torch.Tensor, scale: float) -> float:
    """|scale| times the RMS of q_i · k_j over every query and key of every head (kd: _kv64's float64 keys,
    [B, H, Skv, D]), without forming the scores: sum_ij (q_i · k_j)^2 = <Q^T Q, K^T K> per head."""
    n = q.shape[0] * q.shape[1] * q.shape[2] * kd.shape[2]
    if n == 0:
        return 0.0
    qd = q.to(F64)
    gram = torch.einsum("bhsd,bhse->bhde", qd, qd) * torch.einsum("bhtd,bhte->bhde", kd, kd)
    return abs(scale) * math.sqrt(max(0.0, float(gram.sum())) / n)


def grad_scale(args: tuple, kwargs: dict, grads: tuple) -> tuple:
    """Per gradient (dq, dk, dv): the size of what the rounding of o reaches in it (dv: None, the floor).

    The FlashAttention backward (every backend, and the reference) forms ds = p (dp - delta) with
    delta_i = rowsum(do_i o_i) read from o rounded to x's dtype: row i's delta is off by ~u ||do_i o_i||_2,
    so dq_i = scale sum_j ds_ij k_j is off by ~u scale ||do_i o_i|| |sum_j p_ij k_j| and dk_j = scale
    sum_i ds_ij q_i by ~u scale (sum_i (p_ij ||do_i o_i|| q_i)^2)^(1/2) (GQA: over the group's heads too),
    however small dq and dk are: where dp - delta cancels (a peaked p, keys alike, two keys) the driver's
    floor of 0.1 per element at tol (0.5 u in bf16) is less than that one rounding. Those magnitudes
    (float64, in row blocks as the oracle) are what the error is measured against where they are larger.
    """
    q, k, v = (t.detach() for t in args)
    do = grads[0].detach().to(F64)
    causal = kwargs.get("causal", False)
    kd, vd, lens, scale, masked, rows = _prepared(q, k, v, causal, kwargs.get("scale"), kwargs.get("kv_len"))
    B, H, S, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    t_dq = torch.empty((B, H, S, D), dtype=F64, device=q.device)
    t_dk2 = torch.zeros((B, H, Skv, D), dtype=F64, device=q.device)
    with torch.no_grad():
        for r0 in range(0, S, rows):
            qb = q[:, :, r0 : r0 + rows].to(F64)
            p = _probs_rows(qb, kd, lens, causal, masked, scale, r0, S)
            o = torch.einsum("bhst,bhtd->bhsd", p, vd)
            d2 = (do[:, :, r0 : r0 + rows] * o).square().sum(-1, keepdim=True).sqrt()  # ||do_i o_i||
            t_dq[:, :, r0 : r0 + rows] = scale * d2 * torch.einsum("bhst,bhtd->bhsd", p, kd).abs()
            t_dk2 += torch.einsum("bhst,bhsd->bhtd", (p * d2).square(), qb.square())
    t_dk = scale * t_dk2.view(B, Hkv, H // Hkv, Skv, D).sum(2).sqrt()
    return (t_dq, t_dk, None)


def scale(args: tuple, kwargs: dict) -> tuple:
    """The forward's error magnitude where o cancels (see checks.rel_error). p_ij = exp(s_ij - lse_i) carries a
    relative error of ~u |s_ij|, and |s| ~ grad_magnitude (scale sqrt(D) for O(1) inputs), so o_id = sum_j
    p_ij v_jd moves by ~u magnitude (sum_j (p_ij v_jd)^2)^(1/2) however small o_id is (values that cancel
    under p). With the default scale the magnitude is 1 and the check is the plain relative one (None)."""
    mag = grad_magnitude(args, kwargs)
    if mag <= 1.0:
        return (None,)
    q, k, v = (t.detach() for t in args)
    causal = kwargs.get("causal", False)
    kd, vd, lens, scale, masked, rows = _prepared(q, k, v, causal, kwargs.get("scale"), kwargs.get("kv_len"))
    B, H, S, D = q.shape
    terms = torch.empty((B, H, S, D), dtype=F64, device=q.device)
    with torch.no_grad():
        for r0 in range(0, S, rows):
            p = _probs_rows(q[:, :, r0 : r0 + rows], kd, lens, causal, masked, scale, r0, S)
            terms[:, :, r0 : r0 + rows] = torch.einsum("bhst,bhtd->bhsd", p.square(), vd.square()).sqrt()
    return (mag * terms,)
