"""The Mojo attention forward's split-KV decode path (mojo/_attention_decode.mojo) on the CPU: its workspace
`part` (specs.attention_decode_part) mirrors the kernel's launch plan, and the constants the size function
mirrors match the kernel's. The kernels themselves run on a GPU only (the harness: FUSEKIT_HARNESS_ONLY=
attn_decode, and the conformance suite with --device cuda); the CPU path is unchanged and takes no workspace.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fusekit.backends.mojo import specs

MOJO = Path(__file__).resolve().parents[1] / "mojo"
SMS = (78, 132, 304)


@pytest.fixture(autouse=True)
def _decode_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The size function as it runs with the kernels on (the default; FUSEKIT_MOJO_ATTN_DECODE=0 is off)."""
    monkeypatch.setattr(specs, "ATTN_DECODE", True)


def test_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Switched off (FUSEKIT_MOJO_ATTN_DECODE=0) the forward spec has no `decode` slot (the Mojo launcher keeps
    the prefill kernels for decode shapes) and allocates no partials."""
    monkeypatch.setattr(specs, "ATTN_DECODE", False)
    specs.phase_spec.cache_clear()  # phase_spec is cached per process: the switch is read once
    try:
        base = specs.phase_spec("attention", "forward")
        assert base.params[-1] != "decode" and len(base.params) == 3
        q = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, 8, 2048, 128, dtype=torch.bfloat16, device="meta")
        assert _sizes(q, k, 132) == 0
        flagged = specs.with_flag(base, "decode")
        assert flagged.params[-1] == "decode" and len(flagged.params) == 4
    finally:
        specs.phase_spec.cache_clear()  # later tests (same process) see the default spec again


def _comptime(name: str) -> int:
    m = re.search(rf"^comptime {name} = (\d+)", (MOJO / "_attention_decode.mojo").read_text(), flags=re.M)
    assert m, f"comptime {name} not found in mojo/_attention_decode.mojo"
    return int(m.group(1))


def test_mirrored_constants_match_the_kernel() -> None:
    pairs = {
        "DECODE_MAX_S": specs.AD_MAX_S,
        "DECODE_MAX_ROWS": specs.AD_MAX_ROWS,
        "DECODE_CTAS_PER_SM": specs.AD_CTAS_PER_SM,
        "DECODE_MIN_TILES": specs.AD_MIN_TILES,
        "DECODE_MAX_SPLITS": specs.AD_MAX_SPLITS,
        "DECODE_TILE_BYTES": specs.AD_TILE_BYTES,
        "DECODE_MAX_BN": specs.AD_MAX_BN,
        "DECODE_Q_ELEMS": specs.AD_Q_ELEMS,
        "DECODE_REG_ROWS": specs.AD_REG_ROWS,
        "DECODE_REG_CTAS_PER_SM": specs.AD_REG_CTAS_PER_SM,
        "DECODE_REG_MIN_KEYS": specs.AD_REG_MIN_KEYS,
        "DECODE_MMA_MIN_ROWS": specs.AD_MMA_MIN_ROWS,
        "DECODE_MMA_MAX_D": specs.AD_MMA_MAX_D,
        "DECODE_MMA_CTAS_PER_SM": specs.AD_MMA_CTAS_PER_SM,
        "DECODE_MMA_MIN_TILES": specs.AD_MMA_MIN_TILES,
        "DECODE_MMA_BN": specs.AD_MMA_BN,
    }
    for name, value in pairs.items():
        assert _comptime(name) == value, name


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _plan(b: int, h: int, hkv: int, s: int, skv: int, d: int, es: int, sms: int) -> int:
    """A literal transcription of decode_applies + decode_plan (mojo/_attention_decode.mojo): the splits."""
    if d not in (64, 128, 256) or not (s <= 16 and (h // hkv) * s <= 128):
        return 0
    bn = max(1, min(32, 8192 // (d * es)))
    rb = min(64, 4096 // d)
    rows = (h // hkv) * s
    if es == 2 and rows >= 2 and d <= 128:  # tensor cores: 64-key tiles, one wave of 2 per SM, >= 2 tiles
        return max(1, min(max(1, min(256, _cdiv(skv, 64) // 2)), sms * 2 // max(b * hkv, 1)))
    if rows <= 8:  # the register kernel: one row block, 8 blocks per SM, >= 64 keys per split
        return max(1, min(max(1, min(256, skv // 64)), _cdiv(sms * 8, max(b * hkv, 1))))
    row_blocks = max(1, _cdiv(rows, rb))
    groups = b * hkv * row_blocks
    max_s = max(1, min(256, _cdiv(skv, bn) // 2))
    return max(1, min(max_s, _cdiv(sms * 4, max(groups, 1))))


def _sizes(q: torch.Tensor, k: torch.Tensor, sms: int) -> int:
    ms = specs.phase_spec("attention", "forward")
    assert [w.name for w in ms.workspaces] == ["part"]
    lse = torch.empty(q.shape[:3], device="meta")
    return ms.workspaces[0].size((q, lse), (q, k, k, None), sms)


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_part_bound(sms: int, dtype: torch.dtype) -> None:
    for b in (1, 3, 32):
        for h, hkv in ((32, 8), (8, 8), (32, 4), (64, 1), (4, 2)):
            for s in (1, 2, 4, 7, 16, 17, 64):
                for d in (64, 96, 128, 256):
                    for skv in (0, 1, 31, 64, 2048, 32768):
                        q = torch.empty(b, h, s, d, dtype=dtype, device="meta")
                        k = torch.empty(b, hkv, skv, d, dtype=dtype, device="meta")
                        splits = _plan(b, h, hkv, s, skv, d, q.element_size(), sms)
                        need = b * h * s * splits * (d + 1) if splits > 1 else 0
                        assert _sizes(q, k, sms) == need, (b, h, hkv, s, d, skv, sms)


def test_decode_shapes_split_to_fill_the_gpu() -> None:
    """132 SMs (H100 / H200), H32/8 D128. bf16 with >= 2 rows: the tensor-core kernel, B * Hkv * splits filling
    at most one wave of 264 blocks (2 per SM), at least 2 tiles of 64 keys per split: B1 (8 kv heads) Skv 2048
    has 32 tiles, so 16 splits; Skv 32768 33; B32 (256 groups) 1; 8 rows over 300 keys: 5 tiles, 2 splits.
    fp32, 4 rows: the register kernel, 1056 blocks wanted (8 per SM): Skv 2048 allows 32 splits of 64 keys. fp32, 16 rows (S 4):
    the tile kernel, 528 blocks wanted (4 per SM): Skv 2048 has 128 tiles of 16 keys, so 64 splits. D256 bf16
    keeps the register kernel's plan: Skv 32768, 132 splits."""
    bf = torch.bfloat16
    assert specs.attention_decode_splits(1, 32, 8, 1, 2048, 128, 2, 132) == 16
    assert specs.attention_decode_splits(1, 32, 8, 1, 32768, 128, 2, 132) == 33
    assert specs.attention_decode_splits(32, 32, 8, 1, 2048, 128, 2, 132) == 1
    assert specs.attention_decode_splits(32, 32, 8, 1, 32768, 128, 2, 132) == 1
    assert specs.attention_decode_splits(8, 32, 8, 1, 32768, 128, 2, 132) == 4  # 64 groups: 264 // 64
    assert specs.attention_decode_splits(1, 64, 8, 1, 300, 128, 2, 132) == 2  # 8 rows, 5 tiles
    assert specs.attention_decode_splits(1, 32, 8, 4, 2048, 128, 2, 132) == 16  # 16 rows
    assert specs.attention_decode_splits(32, 32, 8, 4, 2048, 128, 2, 132) == 1
    assert specs.attention_decode_splits(1, 32, 32, 1, 2048, 128, 2, 132) == 32  # MHA: 1 row, register kernel
    assert specs.attention_decode_splits(1, 32, 8, 1, 2048, 128, 4, 132) == 32  # fp32: register kernel
    assert specs.attention_decode_splits(1, 32, 8, 4, 2048, 128, 4, 132) == 64  # fp32 16 rows: tile kernel
    assert specs.attention_decode_splits(1, 32, 8, 1, 32768, 256, 2, 132) == 132  # D256: register kernel
    assert specs.attention_decode_splits(1, 32, 8, 17, 2048, 128, 2, 132) == 0  # S > 16: prefill kernel
    q = torch.empty(1, 32, 1, 128, dtype=bf, device="meta")
    k = torch.empty(1, 8, 2048, 128, dtype=bf, device="meta")
    assert _sizes(q, k, 132) == 32 * 16 * 129
