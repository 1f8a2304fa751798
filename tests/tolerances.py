"""The one tolerance table: max relative error ‖out − ref‖ / ‖ref‖ against the float64 oracle.

Per dtype, from the output rounding unit (fp32 2^-24, fp16 2^-11, bf16 2^-8) with headroom for
fp32 accumulation order and for intermediates the op rounds to the input dtype (swiglu_ffn's xn
and h, attention's P). Rope in fp32 gets more: its angle (start_pos + s)·inv_freq is formed in
fp32, so its error grows with the position (2^-24 of an angle of up to ~4096 rad at the benchmark
shapes). Integer sums must be exact.
"""

from __future__ import annotations

import torch

RTOL: dict[torch.dtype, float] = {
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
    torch.int32: 0.0,
    torch.int64: 0.0,
}
OP_RTOL: dict[tuple[str, torch.dtype], float] = {
    ("rope", torch.float32): 2e-4,
}


def rtol(op: str, dtype: torch.dtype) -> float:
    return OP_RTOL.get((op, dtype), RTOL[dtype])
