"""The one tolerance table (tests and bench): max relative error ‖out − ref‖ / ‖ref‖ against float64.

Per dtype, from the output rounding unit (fp32 2^-24, fp16 2^-11, bf16 2^-8) with headroom for
fp32 accumulation order and for intermediates the op rounds to the input dtype (swiglu_ffn's xn
and h, attention's P). Rope in fp32 gets more: its angle (start_pos + s)·inv_freq is formed in
fp32, so its error grows with the position (2^-24 of an angle of up to ~4096 rad at the benchmark
shapes). Integer sums must be exact. Gradients stack two roundings (the saved forward values and
the backward's own) and reductions over the other dimension (weight grads sum M rows): twice the
forward bound.
"""

from __future__ import annotations

import torch

RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
    torch.int32: 0.0,
    torch.int64: 0.0,
}
OP_RTOL: dict[tuple[str, torch.dtype], float] = {
    ("rope", torch.float32): 2e-4,
}
GRAD_FACTOR = 2.0


def rtol(op: str, dtype: torch.dtype, phase: str = "forward") -> float:
    base = OP_RTOL.get((op, dtype), RTOL[dtype])
    return base * GRAD_FACTOR if phase == "backward" else base
