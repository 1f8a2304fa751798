"""patch / unpatch: run an instantiated transformers Llama / Mistral / Qwen2 / Qwen3 model on fusekit ops.

What patch changes (in place; unpatch puts every original object back):
- every RMSNorm module -> fusekit.nn.RMSNorm(casting="llama"), sharing the original weight Parameter
  (Qwen3's per-head q_norm / k_norm too: the attention forward applies them before the rope, as HF's);
- every MLP -> fusekit.nn.SwiGLUMLP around the original gate/up/down nn.Linear modules (ops.swiglu_ffn);
- every attention module's class -> a subclass whose forward is HF's with ops.rope for the rotary step
  (HF's cos/sin [B, S, D] carry duplicated halves; their first halves are fusekit's tables) and the
  attention core through transformers' registry: config._attn_implementation = "fusekit";
- every decoder layer's class -> a subclass that fuses the residual add after attention into the
  post-attention RMSNorm (ops.rms_norm(..., residual=) returns the norm and the new residual stream in
  one pass). Under no_grad (prefill, generate) the add after the MLP is fused too, into the next norm
  (the next layer's input norm, the final norm after the last layer): the layer computes (norm(h), h)
  and returns h, and that norm, called with exactly h (unchanged since), returns the waiting result.
  With gradients that add stays a torch add.
- model.forward of a <Family>ForCausalLM -> (an instance attribute) HF's causal-LM forward whose loss,
  when `labels` are given, is ops.linear_cross_entropy of the final hidden states and
  lm_head's weight on HF's shifted labels (ForCausalLMLoss: shift by one, ignore_index -100, sum /
  num_items_in_batch when the Trainer passes it, else the mean): the [tokens, vocab] logits and their
  fp32 upcast are never materialized. Such a call returns logits=None in training mode (as Liger's
  lce_forward); in eval mode it still returns the logits (an evaluation loop computes metrics from them)
  beside the fused loss; `skip_logits=True/False` (Liger's keyword) decides explicitly. Without labels,
  with logits_to_keep, or with a custom loss_function, HF's forward runs unchanged. fp16 gradients are as
  accurate as HF's own loss under GradScaler (d logits scaled by a power of two, saved in fp32).
- model.generate -> (an instance attribute) the class's generate wrapped: it checks once, on the host,
  whether the prompt is padded (its attention_mask, or pad tokens in it when none is given) and, if
  not, lets the attention modules read each mask of that generate() call as a causal prefix (see fusekit.hf._attention: static-cache
  decoding then runs without host syncs and compiles into one graph).
The q/k/v/o projections (with Qwen2's q/k/v biases), the embedding, the rotary-table module and the
LM head module stay HF's (the fused loss reads lm_head's weight and bias). Parameters are shared, never copied: state_dict keys and optimizers are unaffected.

Checks before anything changes (ValueError naming the feature): model type, rope type (default and
llama3 only), hidden_act (silu), MLP biases, attention logit softcapping, attention dropout, and a
sliding window shorter than max_position_embeddings (opt in with allow_sliding_window=True: calls whose
mask then has a window pattern fall back to sdpa or raise, see fusekit.hf._attention).
"""

from __future__ import annotations

import contextvars
import inspect
import sys
import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules import module as _mm

from fusekit import backends, ops
from fusekit.distributed import PLAIN
from fusekit.hf import _attention
from fusekit.nn import RMSNorm, SwiGLUMLP
from fusekit.nn._hooks import hooked, own_hooks
from fusekit.nn.rotary import apply_rope, rope_parameters
from fusekit.ops import _amp

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_ATTR = "_fusekit_patch"
# The KV cache's keyword in transformers' forwards: `past_key_values` until 5.23, `cache` from 5.24 (which
# still accepts the old name with a warning). A patched forward takes either and passes on the installed
# transformers' own; one that read only the old name would never update a 5.24 cache (decoding wrong).
CACHE_NAMES = ("cache", "past_key_values")


_CACHE_NAME: list[str] = []  # filled by the first cache_name(): patch() calls it, outside any tracing


def cache_name() -> str:
    """`cache` or `past_key_values`: what the installed transformers' LlamaModel.forward calls it."""
    if not _CACHE_NAME:
        from transformers.models.llama.modeling_llama import LlamaModel

        params = inspect.signature(LlamaModel.forward).parameters
        _CACHE_NAME.append("cache" if "cache" in params else "past_key_values")
    return _CACHE_NAME[0]


def pop_cache(kwargs: dict) -> object:
    """Removes both names from `kwargs` and returns the cache given under either (None if neither)."""
    found = [c for c in (kwargs.pop(name, None) for name in CACHE_NAMES) if c is not None]
    if len(found) > 1:
        raise ValueError("the KV cache was given twice, as `cache` and as `past_key_values`")
    return found[0] if found else None


@dataclass
class _Record:
    backend: str
    attn_implementation: str | None
    children: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)  # parent, name, original
    classes: list[tuple[nn.Module, type]] = field(default_factory=list)  # module, original class
    attrs: list[tuple[nn.Module, str]] = field(default_factory=list)  # instance attributes to delete


def _family_classes(family: str) -> dict[str, type]:
    mod = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["_"])
    p = _PREFIX[family]
    keys = ("RMSNorm", "MLP", "Attention", "DecoderLayer", "Model", "ForCausalLM")
    return {k: getattr(mod, f"{p}{k}") for k in keys}


# --- class swaps -------------------------------------------------------------------------------------
def _half_tables(position_embeddings: tuple, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's (cos, sin) [B, S, D] in the model dtype as fp32 contiguous [B, S, D/2] (its tables repeat
    each angle in both halves; bf16 -> fp32 is exact). The model passes one tuple to every layer of a
    forward: it is converted once, by the first layer, not by each layer's ops.rope (four small kernels
    per layer and token in a decode step). The conversion is kept on HF's cos tensor itself (with sin, the
    width and both version counters, which guard against an in-place update), so it lives exactly as long
    as HF's tables: a module-level cache of the last tuple kept them and its fp32 halves alive between
    forwards (2 MiB at 1x2048 for Llama-3-8B, of fusekit-triton's +3 MiB training peak over HF eager's)."""
    cos, sin = position_embeddings
    if torch.compiler.is_compiling():  # traced: the conversions fuse into the graph
        return cos[..., :half].float().contiguous(), sin[..., :half].float().contiguous()
    vc, vs = _attention.version(cos), _attention.version(sin)
    got = cos.__dict__.get("_fusekit_half")
    if got is not None and got[0] is sin and got[1] == half and vc is not None and (vc, vs) == got[2:4]:
        return got[4]
    tabs = (cos[..., :half].float().contiguous(), sin[..., :half].float().contiguous())
    if vc is not None and vs is not None:  # inference tensors (no version counter): converted per layer
        cos._fusekit_half = (sin, half, vc, vs, tabs)
    return tabs


class _AttentionMixin:
    """HF's Llama/Mistral/Qwen2/Qwen3 attention forward (transformers 5) with fusekit's rope."""

    _fusekit_passes_sliding_window = False
    _fusekit_qk_norm = False

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cache = pop_cache(kwargs)  # `cache` (transformers >= 5.24) or `past_key_values`

        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        backend = self._fusekit_backend
        # ops.rope takes [B, S, H, D]: rotate before the transpose HF does, straight off the projection.
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        if self._fusekit_qk_norm:  # Qwen3: an RMSNorm over each head's D (fusekit's), before the rope
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = _half_tables(position_embeddings, self.head_dim // 2)
        q, k = apply_rope(q, cos, sin, k=k, backend=backend)  # one launch for both
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self._fusekit_eager
        )
        if self._fusekit_passes_sliding_window:
            kwargs["sliding_window"] = (
                self.sliding_window
                if hasattr(self, "sliding_window")
                else getattr(self.config, "sliding_window", None)
            )
        out, weights = interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


class _DecoderLayerMixin:
    """HF's decoder layer with the residual add after attention fused into the post-attention norm."""

    def forward(self, hidden_states, *args, **kwargs):
        if args:  # positional arguments in the HF layer's own order (its KV cache is the 4th in 5.x)
            names = _positional_names(type(self))
            if len(args) > len(names):
                raise TypeError(
                    f"{type(self).__name__}.forward: {len(args) + 1} positional arguments, at most {len(names) + 1}"
                )
            kwargs.update(zip(names, args))
        attention_mask = kwargs.pop("attention_mask", None)
        position_ids = kwargs.pop("position_ids", None)
        use_cache = kwargs.pop("use_cache", False)
        position_embeddings = kwargs.pop("position_embeddings", None)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        norm = self.post_attention_layernorm
        if hooked(norm):  # hooks must see HF's call: norm(attn + residual) -> y
            residual = residual + hidden_states
            hidden_states = norm(residual)
        else:  # (y, h) = (norm(attn + residual), attn + residual): one pass instead of an add and a norm
            hidden_states, residual = norm(hidden_states, residual=residual)
        hidden_states = self.mlp(hidden_states)
        nxt = self.__dict__.get("_fusekit_next_norm")
        w = None if nxt is None else nxt.weight
        if (
            w is not None
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and type(w) in PLAIN
            and w.device == hidden_states.device
            and not torch.is_inference_mode_enabled()  # its tensors have no version to guard the result
            and getattr(_RUNNING, "depth", 0) > 0  # inside the patched model's own loop over its layers
            and not _foreign_hooks(self)
            and not _foreign_hooks(nxt)
        ):
            # Inference: the add after the MLP fused into the next norm (the next layer's input norm, or
            # the model's final norm), which finds its output waiting (_PrecomputedNormMixin). Not with
            # gradients: a checkpointed layer would hand the next one a norm computed outside its graph.
            # Not while the next norm's weight is a DTensor (FSDP2 keeps the next layer's parameters sharded
            # until its own forward: an eval step of FSDP2 training raised here) or elsewhere (accelerate's
            # device_map puts the next layer on another GPU, or offloads its weights to "meta" until its
            # own pre-forward hook loads them). The norm's own forward, not its __call__. Only inside the
            # model's own forward with no hook of anyone else's on this layer or that norm: nothing else can
            # run between here and the norm's call, so nothing can edit h or the weight through `.data`,
            # which bumps no version (a layer-by-layer tool calling layers itself, a hook folding scales
            # into the next norm's weight, got the stale result). transformers' own output-capturing hooks
            # only record outputs.
            y, h = super(_PrecomputedNormMixin, nxt).forward(hidden_states, residual=residual)
            v, vw = _attention.version(h), _attention.version(w)
            if v is not None and vw is not None:  # inference tensors (no version): the norm computes again
                nxt.__dict__["_fusekit_pre"] = (h, v, y, w, vw, h.data_ptr(), w.data_ptr())
            return h
        return residual + hidden_states


class _ModelMixin:
    """HF's base model (LlamaModel, ...) telling its attention calls when their positions are its own
    0..S-1 (no position_ids and no attention_mask given): the sequences cannot be packed, so a mask
    over as many keys as queries is plain causal. transformers cannot skip its packed-sequence check
    while dynamo traces (it reads position_ids), so a compiled prefill or training forward without a
    cache (use_cache=False) gets a materialized mask, whose check would read it on the host: a graph
    break and a sync per layer (H100: compiled 4-layer Llama-3-8B prefill 1x2048 12.0 vs 9.7 ms).

    A 2-D attention_mask of all ones (what a tokenizer returns for an unpadded batch) is dropped while
    tracing a forward that brings no cache, after one host check here: transformers cannot skip it while
    tracing either, and each layer would check the materialized mask (a graph break and a sync per layer,
    15 breaks for a 2-layer model). Eager calls keep it: transformers skips it itself, and a generate()
    step (with a cache) must trace with no data-dependent branch (static-cache CUDA-graph decoding)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, *args, **kwargs):
        if kwargs.get("output_attentions", getattr(self.config, "output_attentions", False)):
            raise ValueError(
                "output_attentions: a fusekit-patched model runs attention without forming its weights (flash "
                "attention), so it has no attention maps to return; fusekit.hf.unpatch(model) first"
            )
        if position_ids is None and not args:
            if (
                attention_mask is not None
                and all(kwargs.get(name) is None for name in CACHE_NAMES)
                and torch.compiler.is_compiling()
                and _all_ones(attention_mask)
            ):
                attention_mask = None  # exact: an all-ones padding mask masks nothing
            if attention_mask is None:
                kwargs[_attention.OWN_POSITIONS] = True
        _RUNNING.depth = getattr(_RUNNING, "depth", 0) + 1
        try:
            return super().forward(input_ids, attention_mask, position_ids, *args, **kwargs)
        finally:
            _RUNNING.depth -= 1


# Per thread: how many patched base models' forwards are running (a layer may fuse its last add into the
# next layer's norm only inside one: _DecoderLayerMixin).
_RUNNING = threading.local()
_CAPTURE_HOOKS = "transformers.utils.output_capturing"


def _foreign_hooks(m: nn.Module) -> bool:
    """Whether calling m runs a forward hook (its own or a global one) other than transformers' output
    recorders, which only read."""
    for hooks in (
        m._forward_hooks,
        m._forward_pre_hooks,
        _mm._global_forward_hooks,
        _mm._global_forward_pre_hooks,
    ):
        for fn in hooks.values():
            if getattr(fn, "__module__", None) != _CAPTURE_HOOKS:
                return True
    return False


_POSITIONAL: dict[type, tuple[str, ...]] = {}


def _positional_names(cls: type) -> tuple[str, ...]:
    """The names of the HF decoder layer's positional parameters after hidden_states (its own order)."""
    names = _POSITIONAL.get(cls)
    if names is None:
        mro = cls.__mro__
        base = mro[mro.index(_DecoderLayerMixin) + 1]  # the HF layer class the mixin sits on (_subclass)
        params = list(inspect.signature(base.forward).parameters.values())[2:]  # self, hidden_states
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = _POSITIONAL[cls] = tuple(p.name for p in params if p.kind in kinds)
    return names


def _all_ones(mask: object) -> bool:
    """A 2-D padding mask with nothing padded (one host read: a graph break while tracing)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())


class _PrecomputedNormMixin:
    """A fusekit RMSNorm that the previous decoder layer may have computed already (fused with its residual
    add): called with exactly that layer's output tensor, unchanged since, with its own weight unchanged since
    and still without gradients, it returns the waiting result (taken once); any other call normalizes as
    usual. (Layer-by-layer tools call one layer, edit the next one's norm weight - AWQ folds its scales into
    it - and only then call the next layer on that output.)

    "Still without gradients": a layer leaves a result only under no_grad, which is also how a reentrant
    checkpoint (use_reentrant=True) runs the layers' forward inside a training step. The model's final norm
    runs outside the checkpoints with gradients on and receives the last layer's very output tensor, so taking
    the waiting result there would hand the loss a norm without a graph: no gradient for any layer (it did, with
    HF's gradient_checkpointing_enable({"use_reentrant": True}), before this check)."""

    def forward(self, x, residual=None):
        if torch.compiler.is_compiling():  # traced layers never leave a result waiting
            return super().forward(x, residual=residual)
        pre = self.__dict__.pop("_fusekit_pre", None)  # taken (or dropped) by every call
        if (
            pre is not None
            and residual is None
            and pre[0] is x
            and pre[1] == _attention.version(x)
            and pre[3] is self.weight  # the norm's weight unchanged since (AWQ-style scale folding edits it)
            and pre[4] == _attention.version(pre[3])
            and pre[5] == x.data_ptr()  # `.data = ...` swaps the storage without a version bump
            and pre[6] == pre[3].data_ptr()
            and not torch.is_grad_enabled()
        ):
            return pre[2]
        return super().forward(x, residual=residual)


def _unpadded(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a generate(...) call's prompt has no padding (one host check per generate call): its 2-D
    attention_mask is all ones, or, without one, no prompt token is the pad token (transformers would
    infer a padding mask from those). Anything else (a 4-D mask, embeddings only) counts as padded. A
    classifier-free-guidance negative prompt (its own forwards inside the call) is held to the same rule."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if "negative_prompt_ids" in kwargs or "negative_prompt_attention_mask" in kwargs:
        neg = {
            "input_ids": kwargs.get("negative_prompt_ids"),
            "attention_mask": kwargs.get("negative_prompt_attention_mask"),
        }
        if neg["attention_mask"] is None:
            del neg["attention_mask"]
        keep = {k: kwargs[k] for k in ("generation_config", "pad_token_id") if k in kwargs}
        if not _unpadded(model, (), {**keep, **neg}):
            return False
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())
    if not isinstance(ids, torch.Tensor):
        return False
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    pad = kwargs.get("pad_token_id", getattr(gc, "pad_token_id", None))
    if pad is None:
        return True
    pads = pad if isinstance(pad, (list, tuple)) else [pad]
    return not any(bool((ids == int(p)).any()) for p in pads)


# True while this thread (context) runs a patched generate() whose prompt has no padding: read by
# _PrepareInputs, so only the forwards that generate() makes itself get the prefix-mask marker (a nested
# generate() of a padded prompt sets it False until it returns; other threads have their own value).
_UNPADDED_GENERATE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fusekit_unpadded_generate", default=False
)


class _Generate:
    """model.generate of a patched model, kept in the model's __dict__ (not a class swap: save_pretrained
    still records the original class name). A plain object holding the model, so deepcopy binds it to
    the copy and pickle (torch.save) restores it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.__doc__ = type(model).generate.__doc__

    def __call__(self, *args, **kwargs):
        """The class's generate(), its own forwards told (by _PrepareInputs) whether their masks are
        causal prefixes: only for a prompt with no padding."""
        model = self.model
        token = _UNPADDED_GENERATE.set(_unpadded(model, args, kwargs))
        try:
            return type(model).generate(model, *args, **kwargs)
        finally:
            _UNPADDED_GENERATE.reset(token)


class _PrepareInputs:
    """model.prepare_inputs_for_generation of a patched model (kept like _Generate): the class's, plus
    `fusekit_prefix_masks=True` in the inputs while the running generate() has an unpadded prompt. The
    marker rides the forward's keywords down to the attention calls, so a forward generate() does not
    make (a LogitsProcessor's, a compiled one, another thread's) is never read as a prefix; under
    torch.compile it is a constant the compiled step guards on. Same signature as the class's:
    generate() validates its model kwargs against it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.__doc__ = type(model).prepare_inputs_for_generation.__doc__

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.model).prepare_inputs_for_generation.__get__(self.model))

    def __call__(self, *args, **kwargs):
        inputs = type(self.model).prepare_inputs_for_generation(self.model, *args, **kwargs)
        if _UNPADDED_GENERATE.get() and isinstance(inputs, dict):
            inputs[_attention.PREFIX_MASKS] = True
        return inputs


class _CausalLMForward:
    """model.forward of a patched <Family>ForCausalLM, kept in the model's __dict__ like _Generate (the
    class name stays HF's for save_pretrained; deepcopy and pickle follow the model). With labels it is
    HF's forward with the LM head and ForCausalLMLoss fused into ops.linear_cross_entropy; otherwise
    HF's forward itself."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.__doc__ = type(model).forward.__doc__

    def __call__(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        skip_logits=None,
        **kwargs,
    ):
        model = self.model
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        kwargs[cache_name()] = pop_cache(kwargs)  # `cache` (transformers >= 5.24) or `past_key_values`
        fused = labels is not None and _fusable(model, logits_to_keep)  # HF: a loss only with labels
        if not fused:
            return type(model).forward(
                model,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return_dict = kwargs.pop("return_dict", None)
        outputs = model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        loss = _fused_loss(model, hidden, labels, **kwargs)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        if skip_logits is None:  # a tuple keeps HF's positions (loss, logits, cache): logits stay in it
            skip_logits = model.training and return_dict
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=None if skip_logits else model.lm_head(hidden),
            **{cache_name(): getattr(outputs, cache_name())},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return out if return_dict else out.to_tuple()


def _fusable(model: nn.Module, logits_to_keep) -> bool:
    """The fused loss is HF's: the default ForCausalLMLoss over every position, a plain nn.Linear head
    without hooks (the fused op reads its weight and never calls it: a hook would not run)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return (
        isinstance(logits_to_keep, int)
        and logits_to_keep == 0
        and getattr(model, "loss_function", None) is ForCausalLMLoss
        and type(model.lm_head) is nn.Linear
        and not hooked(model.lm_head)
    )


def _fused_loss(
    model: nn.Module,
    hidden: torch.Tensor,
    labels,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels=None,
    **_: object,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss(lm_head(hidden), labels, ...) without the logits: tokens < n predict
    n (labels shifted by one, the last position ignored; or the caller's shift_labels), mean over the tokens not ignored, or the sum
    divided by num_items_in_batch (gradient accumulation). Under autocast the head runs in autocast's
    dtype, as nn.Linear would."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    head = model.lm_head
    x, w, b = hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias
    if (cast := _amp.lower(x, w, b)) is not None:  # cast here, not inside the op: the backend check
        x, w, b = cast  # below must see the dtypes the kernels will get
    target = shift_labels.reshape(-1).to(x.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = ops.linear_cross_entropy(
        x, w, target, b, ignore_index=ignore_index, reduction=reduction, backend=getattr(model, _ATTR).backend
    )
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _fusekit_classes(family: str) -> dict[str, type]:
    """The Fusekit subclasses patch() swaps in for a family, by role (RMSNorm: the next-norm class of
    fusekit.nn.RMSNorm, shared by every family)."""
    classes = _family_classes(family)
    eager = sys.modules[classes["Attention"].__module__].eager_attention_forward
    attn = _subclass(
        _AttentionMixin,
        classes["Attention"],
        _fusekit_eager=staticmethod(eager),
        _fusekit_passes_sliding_window=family != "llama",
        _fusekit_qk_norm=family == "qwen3",
    )
    return {
        "Attention": attn,
        "Model": _subclass(_ModelMixin, classes["Model"]),
        "DecoderLayer": _subclass(_DecoderLayerMixin, classes["DecoderLayer"]),
        "RMSNorm": _subclass(_PrecomputedNormMixin, RMSNorm),
    }


def __getattr__(name: str) -> type:
    """Fusekit<class> in a process that has not patched yet (a patched model unpickled): built on demand
    for the family whose class it names."""
    if name.startswith("Fusekit"):
        _attention.register()  # the unpickled config names the "fusekit" attention implementation
        for family, prefix in _PREFIX.items():
            if name.startswith(f"Fusekit{prefix}") or name == "FusekitRMSNorm":
                _fusekit_classes(family)
                if name in globals():
                    return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _subclass(mixin: type, cls: type, **attrs) -> type:
    """Fusekit<cls>, cached and published in this module so pickle finds it by name (`__getattr__` builds
    it in a process that has not patched yet)."""
    name = f"Fusekit{cls.__name__}"
    new = globals().get(name)
    if new is None or cls not in new.__mro__:
        new = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name, **attrs})
        globals()[name] = new
    return new


# --- checks ------------------------------------------------------------------------------------------
def _check_transformers() -> None:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(
            f"fusekit.hf needs transformers >= 5 (verified with 5.23 and 5.24); found {transformers.__version__}"
        )
    cache_name()  # decided here, before any forward can be traced


def _sliding_window(config) -> int | None:
    """The window of the layers that use one, or None when no layer does."""
    sw = getattr(config, "sliding_window", None)
    if sw is None:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return sw


def _kernel_head_dims(backend: str) -> tuple[int, ...] | None:
    """The head dims `backend`'s attention kernels are built for (the backends' own tables, which their
    `supports` checks), None for a backend that runs any (torch) or chooses per call (auto)."""
    if backend == "triton":
        from fusekit.backends.triton import HEAD_DIMS
    elif backend == "mojo":
        from fusekit.backends.mojo.specs import HEAD_DIMS
    else:
        return None
    return HEAD_DIMS


def _check_config(config, allow_sliding_window: bool, backend: str) -> str:
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(
            f"model_type: {family!r} is not supported by fusekit.hf.patch (supported: {', '.join(FAMILIES)})"
        )
    rope_parameters(config)  # raises naming the rope type
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act: {act!r} is not supported; fusekit's MLP is SwiGLU (silu) only")
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias: MLP biases are not supported by fusekit's SwiGLU MLP")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attn_logit_softcapping: attention logit softcapping is not supported by fusekit")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"attention_dropout: attention dropout ({config.attention_dropout}) is not supported by fusekit "
            "attention; set model.config.attention_dropout = 0.0 before patching"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kernel_dims = _kernel_head_dims(backend)
    if kernel_dims is not None and head_dim not in kernel_dims:
        # raised here, with the model untouched, not at the first forward of the patched model
        raise ValueError(
            f"head_dim: {head_dim} is not supported by {backend} attention (supported: "
            f"{', '.join(map(str, kernel_dims))}); "
            'use backend="auto" (falls back to torch for this model) or backend="torch"'
        )
    sw = _sliding_window(config)
    max_pos = getattr(config, "max_position_embeddings", None)
    if sw is not None and (max_pos is None or sw < max_pos) and not allow_sliding_window:
        raise ValueError(
            f"sliding_window: a sliding window ({sw}) shorter than max_position_embeddings ({max_pos}) is not "
            "supported by fusekit attention. patch(..., allow_sliding_window=True) patches anyway: sequences "
            f"up to {sw} tokens run on fusekit, longer ones fall back to sdpa (or raise with strict=True)"
        )
    return family


# --- public ------------------------------------------------------------------------------------------
def patch(
    model: nn.Module,
    backend: str = "auto",
    *,
    strict: bool = False,
    allow_sliding_window: bool = False,
) -> nn.Module:
    """Run a transformers Llama / Mistral / Qwen2 / Qwen3 model's norms, MLPs, rope and attention on fusekit.

    In place; returns `model` (a torch.compile wrapper is patched inside). backend: "auto", "torch",
    "triton" or "mojo" for every op. strict: a call whose attention mask fusekit cannot express (padding,
    a sliding-window pattern) raises instead of falling back to transformers' sdpa with a one-time
    warning. Raises ValueError naming the unsupported feature before changing anything;
    fusekit.hf.unpatch(model) restores the original.
    """
    _check_transformers()
    backends.prepare(backend)  # loaded here, not inside a torch.compile trace of the first call
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers model (nn.Module), got {type(model).__name__}")
    given, model = model, _unwrapped(model)  # a torch.compile wrapper: patch the model it calls
    if hasattr(model, _ATTR):
        raise ValueError("model: already patched by fusekit; call fusekit.hf.unpatch(model) first")
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model: {type(model).__name__} has no `config`; expected a transformers model")
    family = _check_config(config, allow_sliding_window, backend)
    classes = _family_classes(family)
    ours = _fusekit_classes(family)

    # Plan every change first, so an unsupported module raises with the model untouched.
    children: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []
    attentions: list[nn.Module] = []
    layers: list[nn.Module] = []
    bases: list[nn.Module] = []
    paths = {id(m): p for p, m in model.named_modules()}
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) in (classes["RMSNorm"], classes["MLP"]) and own_hooks(child):
                # the module is replaced: its hooks (or accelerate's instance forward) would silently stop running
                where = ".".join(x for x in (paths.get(id(parent), ""), name) if x)
                raise ValueError(
                    f"model: {where} ({type(child).__name__}) has hooks or an instance-level forward, which "
                    "fusekit.hf.patch would drop by replacing it; register them after patching (fusekit's "
                    "modules run hooks as HF's do)"
                )
            if type(child) is classes["RMSNorm"]:
                children.append(
                    (parent, name, child, RMSNorm.from_module(child, casting="llama", backend=backend))
                )
            elif type(child) is classes["MLP"]:
                children.append((parent, name, child, SwiGLUMLP.from_module(child, backend=backend)))
        if type(parent) is classes["Attention"]:
            attentions.append(parent)
        elif type(parent) is classes["DecoderLayer"]:
            if not isinstance(parent.post_attention_layernorm, classes["RMSNorm"]):
                raise TypeError(f"model: {type(parent).__name__}.post_attention_layernorm is not an RMSNorm")
            layers.append(parent)
        elif type(parent) is classes["Model"]:
            bases.append(parent)
    if not attentions:
        raise ValueError(f"model: no {classes['Attention'].__name__} modules found in {type(model).__name__}")
    next_norms = _next_norms(model, layers, {(id(parent), name): new for parent, name, _, new in children})

    rec = _Record(backend=backend, attn_implementation=getattr(config, "_attn_implementation", None))
    _attention.register()
    for parent, name, old, new in children:
        setattr(parent, name, new)
        rec.children.append((parent, name, old))
    _swap_classes(rec, attentions, ours["Attention"])
    for m in attentions:
        m._fusekit_backend = backend
        m._fusekit_strict = strict
        rec.attrs += [(m, "_fusekit_backend"), (m, "_fusekit_strict")]
    if callable(getattr(type(model), "generate", None)):
        model.__dict__["generate"] = _Generate(model)
        rec.attrs.append((model, "generate"))
        if callable(getattr(type(model), "prepare_inputs_for_generation", None)):
            model.__dict__["prepare_inputs_for_generation"] = _PrepareInputs(model)
            rec.attrs.append((model, "prepare_inputs_for_generation"))
    if type(model) is classes["ForCausalLM"]:
        model.__dict__["forward"] = _CausalLMForward(model)
        rec.attrs.append((model, "forward"))
    _swap_classes(rec, bases, ours["Model"])
    _keep_output_capture(bases)
    _swap_classes(rec, layers, ours["DecoderLayer"])
    for layer, norm in next_norms:  # plain attributes, not submodules: state_dict keys stay HF's
        norm.__class__ = ours["RMSNorm"]
        layer.__dict__["_fusekit_next_norm"] = norm
        rec.attrs.append((layer, "_fusekit_next_norm"))
    _set_attn_implementation(model, _attention.NAME)
    object.__setattr__(model, _ATTR, rec)
    return given


def _keep_output_capture(models: list[nn.Module]) -> None:
    """transformers 5 records output_hidden_states / output_attentions through hooks it picks from a
    registry keyed on the model's class name: the Fusekit subclass gets its base class's entry, or both
    came back None, silently."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # a transformers without the registry records them in the forward itself
        return
    for m in models:
        _CAN_RECORD_REGISTRY[m] = getattr(m, "_can_record_outputs", None)


def _swap_classes(rec: _Record, modules: list[nn.Module], cls: type) -> None:
    """Give each module the fusekit subclass `cls` of its class, recorded for unpatch."""
    for m in modules:
        rec.classes.append((m, type(m)))
        m.__class__ = cls


def _next_norms(model: nn.Module, layers: list[nn.Module], new: dict) -> list[tuple[nn.Module, nn.Module]]:
    """(decoder layer, the fusekit RMSNorm that normalizes its output next): the next layer's input norm,
    and for the last layer the model's final norm. Only for the model's layer list run in order (the
    ModuleList holding exactly `layers`, beside a final `norm`); anything else gets no links."""
    for parent in model.modules():
        stack = getattr(parent, "layers", None)
        if not isinstance(stack, nn.ModuleList) or list(stack) != layers or not layers:
            continue
        final = new.get((id(parent), "norm"))
        norms = [new.get((id(layer), "input_layernorm")) for layer in layers[1:]] + [final]
        if any(n is None for n in norms):
            return []
        return list(zip(layers, norms))
    return []


def _set_attn_implementation(model: nn.Module, name: str | None) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None and name is not None:
        setter(name)
    else:
        model.config._attn_implementation = name


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside torch.compile's wrapper (OptimizedModule, which forwards attribute reads to it): patch
    and unpatch work on the model itself, whose forward the wrapper calls. unpatch(compiled) found the
    record through the wrapper, restored the model, then failed deleting it from the wrapper, leaving the
    model unpatched but marked patched."""
    while isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo fusekit.hf.patch: the original modules, classes and attention implementation come back.
    Returns `model` (a torch.compile wrapper is unpatched inside)."""
    given, model = model, _unwrapped(model)
    rec: _Record | None = getattr(model, _ATTR, None)
    if rec is None:
        raise ValueError("model: not patched by fusekit (nothing to unpatch)")
    _set_attn_implementation(model, rec.attn_implementation)
    for m, attr in reversed(rec.attrs):
        m.__dict__.pop(attr, None)
    for m, cls in reversed(rec.classes):
        m.__class__ = cls
    for parent, name, old in reversed(rec.children):
        _hand_back(parent._modules.get(name), old)
        setattr(parent, name, old)
    object.__delattr__(model, _ATTR)
    return given


def _hand_back(new: nn.Module | None, old: nn.Module) -> None:
    """The replacement's current parameters, buffers and shared submodules go back into the original: a
    load_state_dict(assign=True) or to_empty() while patched replaced them in the replacement only, and
    the original still held the objects shared at patch time (stale weights, or meta tensors)."""
    if new is None:
        return
    for slot in ("_parameters", "_buffers", "_modules"):
        mine, theirs = getattr(old, slot), getattr(new, slot)
        for key in mine:
            if key in theirs:
                mine[key] = theirs[key]


def is_patched(model: nn.Module) -> bool:
    return hasattr(_unwrapped(model), _ATTR)
