"""nn.Module layers over fusekit.ops, drop-ins for torch.nn and Hugging Face Llama-family modules.

    from fusekit import nn as fnn
    norm = fnn.RMSNorm(4096, eps=1e-5, casting="llama")          # loads an HF LlamaRMSNorm state_dict
    mlp = fnn.SwiGLUMLP(4096, 14336)                               # gate_proj / up_proj / down_proj
    rope = fnn.RotaryEmbedding.from_config(hf_config)              # "default" and "llama3" rope types
    q, k = rope(q, k, start_pos=past_len)                          # q/k [B, S, H, D]
    o = fnn.Attention(causal=True)(q.transpose(1, 2), k.transpose(1, 2), v)

Every module takes `backend="auto" | "torch" | "triton" | "mojo"` (as the ops), accepts fp32, bf16 and
fp16, and has gradients. `from_module(m)` wraps an existing torch/HF module's parameters (shared).
"""

from fusekit.nn.attention import Attention
from fusekit.nn.mlp import SwiGLUMLP
from fusekit.nn.norms import LayerNorm, RMSNorm
from fusekit.nn.rotary import RotaryEmbedding, apply_rope

__all__ = ["Attention", "LayerNorm", "RMSNorm", "RotaryEmbedding", "SwiGLUMLP", "apply_rope"]
