"""The "fusekit" entry of transformers' attention and attention-mask registries.

transformers calls the attention function with query [B, H, S, D] and key/value [B, Hkv, Skv, D]
(the KV cache already appended, kv heads not repeated) and the mask its mask registry built for the
implementation's name. fusekit's attention expresses two masks: none, and causal aligned bottom-right
(query i sees key j iff j <= i + Skv - S, which is also what a decode step with a cache needs). So:

- The mask function is transformers' sdpa_mask, except that where sdpa would return None and rely on
  torch sdpa's *top-left* `is_causal` (a prefill into a longer, pre-allocated static cache) it
  materializes the mask, because fusekit's causal is bottom-right. None therefore always means "plain
  causal" (or no mask for S = 1).
- A materialized mask is checked once per forward (the same tensor reaches every layer; the verdict
  is cached on it): all visible, or bottom-right causal, over all keys or over a prefix of them that
  every row shares (a static cache's unused tail is masked for everyone: those keys are sliced off).
  Anything else (padding, a window shorter than the keys, packed sequences, an additive bias) cannot
  run on fusekit: by default the call falls back to transformers' "sdpa" implementation with a
  one-time warning naming the feature; with `patch(model, strict=True)` it raises ValueError instead.
  The same rule covers fp32 attention on CUDA (fusekit's GPU attention kernels are fp16/bf16).
  Nothing is silently wrong.
- In the forwards `generate()` of a patched model makes itself, for a prompt with no padding
  (fusekit.hf.patch wraps generate and checks that once, on the host; its prepare_inputs_for_generation
  then adds `fusekit_prefix_masks=True` to those forwards' inputs, which reach the layers' attention as a
  keyword), every mask is a causal prefix pattern: a static cache's masks
  [B, 1, S, max_len] then become per-sequence key counts, `kv_len` = the keys the last query row sees,
  computed on the device; the full cache goes to ops.attention with that kv_len. Traced or captured,
  no host sync and no data-dependent shape: the decode step traces into one graph under torch.compile
  and replays under CUDA graphs (transformers compiles static-cache decoding itself). Any other forward
  during the call (classifier-free guidance's negative prompt, a LogitsProcessor's, another thread's),
  eager or compiled, carries no marker and takes the checked path above (a flag on the modules for the
  whole call read a compiled padded forward inside it as a prefix). Eager, a marked mask is still checked
  to be that pattern (`is_prefix`: one sync per forward); the wrapper also counts a padded negative
  prompt as padding.
  A sliding window shorter than the cache keeps the checked path above.
- A patched base model called without position_ids and without an attention_mask passes its layers
  `fusekit_own_positions=True`: its positions are 0..S-1 of one sequence per row, so a mask over as
  many keys as queries can only be plain causal. transformers keeps its packed-sequence mask while
  dynamo traces (it cannot look at position_ids there): without this a compiled forward with no cache
  (use_cache=False prefill, training) would check a materialized mask per layer (graph break, sync).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor

from fusekit import ops

NAME = "fusekit"
# kwarg a patched base model passes to its layers when the positions are its own 0..S-1 (see below)
OWN_POSITIONS = "fusekit_own_positions"
# kwarg patch's generate() wrapper adds to the model inputs of the forwards generate() itself makes, for an
# unpadded prompt: their masks are causal prefixes (see below); no other forward carries it
PREFIX_MASKS = "fusekit_prefix_masks"
CAUSAL, FULL = "causal", "full"
_warned: set[str] = set()


def version(t: Tensor) -> int | None:
    """t's version counter, which moves on every in-place change; None for an inference tensor (made under
    torch.inference_mode), which has none: nothing derived from one is remembered across calls."""
    return None if t.is_inference() else t._version


class _LastMask:
    """One value remembered for the last mask tensor seen (by weakref) and a key, until the mask is
    changed in place (its _version moves): every layer of a forward gets the same mask tensor, so what
    is derived from it is computed once per forward, not once per layer. An inference tensor's (no version
    counter) is never remembered."""

    def __init__(self) -> None:
        self._entry: tuple[weakref.ref, int, object, object] | None = None

    def get(self, mask: Tensor, key: object) -> object | None:
        e = self._entry
        if e is None or e[0]() is not mask or e[2] != key:
            return None
        v = version(mask)
        return e[3] if v is not None and e[1] == v else None

    def put(self, mask: Tensor, key: object, value: object) -> None:
        v = version(mask)
        self._entry = None if v is None else (weakref.ref(mask), v, key, value)


_verdicts = _LastMask()  # mask_kind's verdict, key (S, Skv)
_kv_lens = _LastMask()  # prefix_kv_len's lengths, key batch
_prefixes = _LastMask()  # is_prefix's verdict, key (batch, causal)


def _verdict(mask: Tensor, s: int, skv: int) -> tuple[str, int]:
    """(CAUSAL or FULL, number of leading keys to attend over), or (what fusekit cannot express, 0)."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (s, skv):
        return f"an attention_mask of shape {tuple(mask.shape)} (expected [B, 1|H, {s}, {skv}])", 0
    if mask.dtype == torch.bool:
        visible = mask
    else:
        # Additive float masks: 0 where visible, a huge negative (or -inf) where masked. Any other value
        # is a bias (ALiBi and the like), which fusekit does not add.
        visible = mask == 0
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((visible | masked).all()):
            return "an additive attention bias (mask values other than 0 and -inf)", 0
    # Keys no query of any row sees, all at the end: a pre-allocated (static) cache's unused tail.
    seen = visible.reshape(-1, skv).any(dim=0)
    n = int(seen.sum())
    if 0 < n < skv and bool(seen[:n].all()):
        visible = visible[..., :n]
    else:
        n = skv
    if bool(visible.all()):
        return FULL, n
    i = torch.arange(s, device=mask.device)[:, None]
    j = torch.arange(n, device=mask.device)[None, :]
    if bool((visible == (j <= i + (n - s))).all()):
        return CAUSAL, n
    return "padding in the attention_mask (or a sliding-window / packed-sequence pattern)", 0


def mask_kind(mask: object, s: int, skv: int, is_causal: bool) -> tuple[str, int]:
    """What `mask` asks of a query block of length s over skv keys: (CAUSAL or FULL, keys to use), or
    (why fusekit cannot run it, 0)."""
    if mask is None:
        return (CAUSAL if is_causal and s > 1 else FULL), skv
    if not isinstance(mask, Tensor):
        return f"a {type(mask).__name__} attention mask (flex attention)", 0
    if torch.compiler.is_compiling():
        return _verdict(mask, s, skv)
    v = _verdicts.get(mask, (s, skv))
    if v is None:
        v = _verdict(mask, s, skv)
        _verdicts.put(mask, (s, skv), v)
    return v


def prefix_kv_len(mask: Tensor, batch: int, eager: bool | None = None) -> Tensor:
    """int32 [B]: the keys the last query row of each sequence sees in a causal prefix mask [B|1, 1|H,
    S, Skv] (bool, or additive with 0 where visible). Device-side only: no sync, traceable. Remembered
    for the last mask in eager mode; never while compiling or capturing a CUDA graph (a capture must
    record the computation, so that a replay derives the lengths from the mask it reads). `eager`: the
    caller's `_eager(mask)`, when it has it."""
    eager = _eager(mask) if eager is None else eager
    hit = _kv_lens.get(mask, batch) if eager else None
    if hit is not None:
        return hit
    last = mask[:, 0, -1, :]
    visible = last if last.dtype == torch.bool else last == 0
    kv_len = visible.sum(-1, dtype=torch.int32)
    kv_len = kv_len.expand(batch).contiguous() if kv_len.shape[0] != batch else kv_len
    if eager:
        _kv_lens.put(mask, batch, kv_len)
    return kv_len


def _eager(mask: Tensor) -> bool:
    """Not tracing and not capturing a CUDA graph: a mask's values may be read on the host."""
    return not torch.compiler.is_compiling() and not (
        mask.is_cuda and torch.cuda.is_current_stream_capturing()
    )


def is_prefix(mask: Tensor, kv_len: Tensor, causal: bool) -> bool:
    """Whether `mask` [B|1, 1|H, S, Skv] is exactly the pattern prefix_kv_len's lengths stand for: sequence b
    sees keys j < kv_len[b], causally aligned bottom-right. The generate() flag said so for every mask of
    the call, but a forward inside it (classifier-free guidance's padded negative prompt, a LogitsProcessor,
    another thread) brings its own padded mask. One device check and one host sync per mask (eager only;
    remembered for the layers that share it)."""
    b = kv_len.shape[0]
    hit = _prefixes.get(mask, (b, causal))
    if hit is not None:
        return hit
    s, skv = mask.shape[-2:]
    visible = mask if mask.dtype == torch.bool else mask == 0
    j = torch.arange(skv, device=mask.device)
    last = kv_len.to(torch.int64).view(b, 1, 1, 1)
    if causal:  # query i sees key j <= i + kv_len - S
        last = last - s + torch.arange(s, device=mask.device).view(1, 1, s, 1)
    else:
        last = last - 1
    ok = bool((visible == (j <= last)).all())
    _prefixes.put(mask, (b, causal), ok)
    return ok


def _fallback(module, query, key, value, attention_mask, reason: str, **kwargs):
    if getattr(module, "_fusekit_strict", False):
        raise ValueError(
            f"attention: fusekit attention does not support {reason} (it supports no mask or a causal one, "
            "fp16/bf16 on CUDA); patch(model, strict=False) falls back to transformers' sdpa for such calls"
        )
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"fusekit attention: {reason} is not supported; these calls run transformers' sdpa attention "
            "instead (patch(model, strict=True) raises instead)",
            stacklevel=3,
        )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def fusekit_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers AttentionInterface entry: returns (attn_output [B, S, H, D], None)."""
    if dropout:
        raise ValueError(
            f"attention dropout ({dropout}) in training is not supported by fusekit attention; set "
            "model.config.attention_dropout = 0.0"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit softcapping is not supported by fusekit attention")
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window")
    s, skv = query.shape[2], key.shape[2]
    backend = getattr(module, "_fusekit_backend", "auto")
    if (
        kwargs.pop(OWN_POSITIONS, False)
        and isinstance(attention_mask, Tensor)
        and s == skv
        and tuple(attention_mask.shape[-2:]) == (s, skv)
        and (window is None or skv <= window)
    ):
        # The model's own positions, no padding mask, as many keys as queries: the mask is transformers'
        # packed-sequence guard over one sequence (kept while tracing), i.e. plain causal.
        attention_mask = None
    if (
        kwargs.pop(PREFIX_MASKS, False)  # a forward of patch's generate() with an unpadded prompt
        and isinstance(attention_mask, Tensor)
        and attention_mask.dim() == 4
        and tuple(attention_mask.shape[-2:]) == (s, skv)
        and (window is None or skv <= window)
        and not (query.device.type == "cuda" and query.dtype in (torch.float32, torch.float64))
    ):
        eager = _eager(attention_mask)
        kv_len = prefix_kv_len(attention_mask, query.shape[0], eager)
        causal = bool(is_causal) and s > 1
        if not eager or is_prefix(attention_mask, kv_len, causal):
            out = ops.attention(
                query, key, value, causal=causal, scale=scaling, kv_len=kv_len, backend=backend
            )
            return out.transpose(1, 2), None
    kind, n = mask_kind(attention_mask, s, skv, bool(is_causal))
    if query.device.type == "cuda" and query.dtype in (torch.float32, torch.float64):
        kind = f"{str(query.dtype).removeprefix('torch.')} attention on CUDA (fusekit's GPU kernels are fp16/bf16)"
    elif window is not None and (keys := n if kind in (CAUSAL, FULL) else key.shape[2]) > window:
        # HF's window: query q sees keys k > q - window; with more keys than that, some are cut off.
        kind = f"a sliding window ({window}) shorter than the {keys} keys"
    if kind not in (CAUSAL, FULL):
        return _fallback(
            module,
            query,
            key,
            value,
            attention_mask,
            kind,
            scaling=scaling,
            dropout=dropout,
            is_causal=is_causal,
            **kwargs,
        )
    if n < skv:  # the keys past n are masked for every query (a static cache's unused tail)
        key, value = key[:, :, :n], value[:, :, :n]
    out = ops.attention(query, key, value, causal=kind == CAUSAL, scale=scaling, backend=backend)
    return out.transpose(1, 2), None


def fusekit_mask(*args, **kwargs):
    """transformers' sdpa_mask, materialized where sdpa would lean on its top-left `is_causal`; None for
    a plain causal mask over as many keys as queries with no padding mask, also while tracing.

    transformers (5.x on torch < 2.14) never skips a mask while dynamo traces, and the materialized
    mask's check (mask_kind) reads its values: a graph break per layer in a compiled prefill or training
    step. Those facts are static here (shapes, the mask function, no padding mask), and for q == kv
    bottom-right causal is top-left causal, so None is exact."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    q, kv = kwargs.get("q_length"), kwargs.get("kv_length")
    if (
        not args
        and kwargs.get("allow_is_causal_skip", True)
        and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        and kwargs.get("attention_mask") is None
        and kwargs.get("local_size") is None
        and isinstance(q, int)
        and q == kv
    ):
        return None
    mask = sdpa_mask(*args, **kwargs)
    if mask is None and q is not None and kv is not None and not (q == 1 or q == kv):
        mask = sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})
    return mask


def register() -> None:
    """Register "fusekit" in transformers' attention and mask registries (idempotent, global)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, fusekit_attention)
    AttentionMaskInterface.register(NAME, fusekit_mask)
