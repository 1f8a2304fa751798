"""Hugging Face transformers integration: one call runs a Llama / Mistral / Qwen2 / Qwen3 model on fusekit.

    import fusekit.hf
    model = AutoModelForCausalLM.from_pretrained(...)
    fusekit.hf.patch(model)            # norms, MLP, rope, attention -> fusekit.ops (backend="auto")
    model.generate(...)                # or train: every op has a backward
    fusekit.hf.unpatch(model)          # the original modules back, bit-identical outputs

Needs transformers >= 5 (verified with 5.23 and 5.24, which renamed the KV-cache keyword: both names
work); importing fusekit.hf does not import transformers, patch() does. See fusekit.hf._patch for what is replaced and fusekit.hf._attention for the mask rules.
"""

from fusekit.hf._patch import is_patched, patch, unpatch

__all__ = ["is_patched", "patch", "unpatch"]
