"""The Gluon FA3-style Hopper attention forward (kernels_triton/_attention_hopper.py) on the CPU.

    pytest tests/test_triton_attention_hopper.py

Gluon kernels do not run on the CPU (nor in Triton's interpreter), so this checks what can be checked there:
the module imports without a GPU, `hopper_supported` refuses what the kernel does not take (no GPU, kv_len,
fp32, head dims other than 64/128/256, non-aligned or empty inputs), and, where the installed Triton has Gluon's
Hopper module, every (dtype, head dim, causal) variant compiles ahead of time for sm_90 down to a cubin with
wgmma instructions. With `--device cuda` on an sm_90 GPU the kernel runs: against a float64 reference at odd
shapes (ragged tails, GQA, causal rows that see no key, a NaN-padded KV-cache view), and through
`ops.attention` with the size threshold lowered, so the routed path runs at test sizes too. The persistent
variant (FUSEKIT_HOPPER_ATTN_PERSIST=1, D64/D128) runs the same odd shapes with its grid at min(SMs, work
tiles) and capped at a few CTAs (barrier phases carried across work tiles), against float64 and bit for bit
against the one-tile-per-CTA kernel; its causal schedules (pairs, sections, global; small sections, ragged last
ones) cover every work tile once (CPU, the kernel's unit mapping in Python) and give bit-identical results (GPU).
The opt-in polynomial exp2 (FUSEKIT_HOPPER_ATTN_EXP2_POLY): its env parsing, that it reaches the launch (consts
and launch key) and the AOT spec names (CPU), that its D64 variants compile with the column split in registers
(fewer ex2, no extra shuffles, shared-memory stores or barriers in the PTX), and on the GPU that o matches float64
and lse stays within 1e-4 of the switch-off lse, persistent and one-tile.
Speed: the benchmarks (and .dev/s/gluon_probe.py, persist_probe.py).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch
from gluon_support import compile_all, need_sm90, qkv, spec_params

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    pytest.mark.usefixtures("fresh_attention_plans"),
]


def _mod():
    from kernels_triton import _attention_hopper

    return _attention_hopper


_qkv = qkv


def test_module_imports_without_a_gpu():
    m = _mod()
    assert isinstance(m.HAS_GLUON, bool)
    assert callable(m.hopper_forward) and callable(m.hopper_supported)
    assert set(m.CONFIGS) == set(m.HEAD_DIMS) == {64, 128, 256}


def test_host_descriptor_copies_a_validated_one() -> None:
    """host_descriptor: the first call of a (dtype, shape, strides, box, layout) builds Gluon's validated
    TensorDescriptor; later ones copy its fields with the new base: equal field by field, no tensor kept
    alive by the remembered fields, a misaligned base refused."""
    import gc
    import weakref

    m = _mod()
    if not m.HAS_GLUON:
        pytest.skip("the installed triton has no Gluon Hopper module")
    lay = m._host_layouts("bf16", 64, 64)[0]
    a, b = torch.randn(8, 40, 64).to(torch.bfloat16), torch.randn(8, 40, 64).to(torch.bfloat16)
    first = m.host_descriptor(a, (1, 64, 64), lay)
    second = m.host_descriptor(b, (1, 64, 64), lay)
    assert type(second) is type(first) and second.base is b
    want = m.TensorDescriptor(b, list(b.shape), list(b.stride()), [1, 64, 64], lay)
    assert vars(second).keys() == vars(want).keys()
    assert all(getattr(second, f) == getattr(want, f) for f in vars(want) if f != "base")
    c = torch.randn(8, 40, 64).to(torch.bfloat16)
    gone = weakref.ref(c)
    m.host_descriptor(c, (1, 64, 64), lay)
    del c, first, second, want, a, b
    gc.collect()
    assert gone() is None
    odd = torch.empty(8 * 40 * 64 + 1, dtype=torch.bfloat16)[1:].view(8, 40, 64)
    with pytest.raises(ValueError, match="16-byte"):
        m.host_descriptor(odd, (1, 64, 64), lay)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_not_supported_on_the_cpu(dtype):
    assert _mod().hopper_supported(*_qkv(dtype), None) is False


def test_not_supported_with_kv_len():
    q, k, v = _qkv()
    assert _mod().hopper_supported(q, k, v, torch.full((1,), 53, dtype=torch.int32)) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_not_supported_dtypes(dtype):
    assert _mod().hopper_supported(*_qkv(dtype), None) is False


@pytest.mark.parametrize("D", [32, 96, 512])
def test_not_supported_head_dims(D):
    assert _mod().hopper_supported(*_qkv(D=D), None) is False


def test_not_supported_empty():
    assert _mod().hopper_supported(*_qkv(S=0), None) is False
    assert _mod().hopper_supported(*_qkv(Skv=0), None) is False


def test_not_supported_under_the_interpreter(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _mod().hopper_supported(*_qkv(), None) is False


def test_forward_refuses_unsupported_inputs():
    q, k, v = _qkv()
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    with pytest.raises(ValueError, match="unsupported"):
        _mod().hopper_forward(o, lse, q, k, v, False, 0.125 * 1.4426950408889634)


def _spec_names() -> list:
    return spec_params([s[0] for s in _mod().aot_specs_gluon()])


def test_aot_spec_names():
    names = [s[0] for s in _mod().aot_specs_gluon()]
    if not _mod().HAS_GLUON:
        pytest.skip("the installed triton has no Gluon Hopper module")
    # dtype x head dim x causal x descriptor kind, + the persistent kernel: dtype x (D64, D128) x causal
    assert len(names) == len(set(names)) == 2 * 3 * 2 * 2 + 2 * 2 * 2
    assert sum("_d256_" in n for n in names) == 8
    assert sorted(n for n in names if n.endswith("_persist")) == sorted(
        f"attn_hopper_{dt}_d{d}_c{c}_persist" for dt in ("fp16", "bf16") for d in (64, 128) for c in (0, 1)
    )


def test_ring_config_env_refuses_one_stage_without_k_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSEKIT_HOPPER_ATTN_CFG with one K/V stage and K freed with V would deadlock on any query block with >= 2
    key tiles (S_j waits for K_j in the only slot, which the producer refills only after P V_{j-1}, issued
    after that wait): refused before a launch. One stage with K_EARLY (K freed after S) and the tables pass."""
    m = _mod()
    for bad in ("128,1", "128,1,0", "64,0,1"):
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_CFG", bad)
        with pytest.raises(ValueError, match="STAGES"):
            m._env_config(128)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_CFG", "64,1,1")
    assert m._env_config(256) == (64, 1, True)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_CFG", "64,2")
    assert m._env_config(128) == (64, 2, False)
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_CFG")
    for d in m.HEAD_DIMS:
        assert m._env_config(d)[1] >= 2
    from kernels_triton import _attention_hopper_bwd as b

    monkeypatch.setenv("FUSEKIT_HOPPER_BWD_CFG", "64,0,128,2")
    with pytest.raises(ValueError, match="STAGES"):
        b._env_config(128)
    monkeypatch.setenv("FUSEKIT_HOPPER_BWD_CFG", "64,1,128,1")  # no overlap across ring slots: 1 works
    assert b._env_config(128) == (64, 1, 128, 1)


def test_persistent_selection(monkeypatch: pytest.MonkeyPatch):
    """The persistent kernel runs where PERSISTENT_DIMS says (D64, D128 since the H200 probe) or where
    FUSEKIT_HOPPER_ATTN_PERSIST=1 forces it, and never at D256 (no shared memory left for its O buffer)."""
    m = _mod()
    assert m.PERSISTENT_DIMS == (64, 128) and set(m.PERSIST_HEAD_DIMS) == {64, 128}
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_PERSIST", raising=False)
    assert [d for d in m.HEAD_DIMS if m.persistent_at(d)] == [64, 128]
    monkeypatch.setattr(m, "PERSISTENT_DIMS", ())
    assert not any(m.persistent_at(d) for d in m.HEAD_DIMS)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST", "1")
    assert [d for d in m.HEAD_DIMS if m.persistent_at(d)] == [64, 128]
    monkeypatch.setattr(m, "PERSISTENT_DIMS", (64, 128, 256))
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST", "0")
    assert not any(m.persistent_at(d) for d in m.HEAD_DIMS)
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_PERSIST")
    assert [d for d in m.HEAD_DIMS if m.persistent_at(d)] == [64, 128]


def _unit_tiles(u: int, pairs: int, sec: int, per: int, n_m: int, bh: int) -> list[tuple[int, int]]:
    """The kernel's _persist_unit transcribed to Python: unit u's (query block, b*H + h) work tiles in order."""
    s, r = divmod(u, per)
    base = s * sec
    g = min(sec, bh - base)
    levels = n_m // (1 + pairs)
    n_lev = g * levels
    k, v = r // g, r - n_lev
    if r < n_lev:
        return [(n_m - 1 - k + w * (2 * k + 1 - n_m), base + r - k * g) for w in range(1 + pairs)]
    return [(levels, base + 2 * v + w) for w in range(1 + (2 * v + 1 < g))]


# (B, H, Hkv, S, Skv, D, order, heads per section or None): several sections with a ragged last one (odd and
# even), odd and even query-block counts, one query block, GQA, one section (the L2 rule), and global.
_SCHED_CASES = [
    (2, 8, 2, 333, 700, 128, "pairs", 6),
    (3, 5, 5, 640, 640, 64, "pairs", 4),
    (1, 6, 2, 1000, 1000, 128, "pairs", 4),
    (2, 4, 1, 77, 300, 64, "pairs", 3),
    (1, 4, 4, 300, 77, 128, "pairs", 1),
    (4, 32, 8, 4096, 4096, 128, "pairs", None),
    (3, 5, 5, 640, 640, 64, "sections", 4),
    (2, 8, 2, 333, 700, 128, "sections", None),
    (4, 32, 32, 4096, 4096, 128, "sections", None),
    (3, 5, 5, 640, 640, 64, "global", 4),
]


@pytest.mark.parametrize("case", _SCHED_CASES, ids=lambda c: "B{}H{}-{}S{}K{}D{}-{}-{}".format(*c))
def test_persist_causal_schedule_covers_every_tile(monkeypatch: pytest.MonkeyPatch, case) -> None:
    """The causal schedule (_persist_schedule's PAIRS, SEC, PER, NU through the kernel's unit mapping) runs every
    work tile exactly once, 1 or 2 per unit, heavier first; a section holds whole GQA groups when the L2 rule sizes
    it, and the CTAs in flight (a window of ~132 consecutive units) touch at most two sections."""
    m = _mod()
    B, H, Hkv, S, Skv, D, order, sec_env = case
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_ORDER", order)
    if sec_env:
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_SECTION", str(sec_env))
    else:
        monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_PERSIST_SECTION", raising=False)
    bh, n_m, l2 = B * H, -(-S // 128), 50 * 2**20
    pairs, sec, per, nu = m._persist_schedule(bh, H // Hkv, n_m, Skv, D, 2, l2, 132)
    assert pairs == (order == "pairs")
    if order == "global":
        assert sec == bh
    elif sec_env:
        assert sec == min(sec_env, bh)
    else:
        kv = Skv * D * 2 * 2
        assert sec % (H // Hkv) == 0 and (sec * kv <= l2 // 2 * (H // Hkv) or sec == H // Hkv or sec == bh)
    tiles = [_unit_tiles(u, pairs, sec, per, n_m, bh) for u in range(nu)]
    flat = [t for ts in tiles for t in ts]
    assert sorted(flat) == [(mb, h) for mb in range(n_m) for h in range(bh)]
    assert all(1 <= len(ts) <= 2 for ts in tiles) and all(ts[0][0] >= ts[-1][0] for ts in tiles)
    if not pairs:
        assert all(
            a[0] >= b[0] for a, b in itertools.pairwise(flat) if a[1] // sec == b[1] // sec
        )  # descending m
    sections = [{h // sec for ts in tiles[u : u + 132] for _, h in ts} for u in range(0, nu, 33)]
    assert max(max(s) - min(s) for s in sections) <= (1 if per >= 132 else -(-132 // per))


def test_persist_causal_schedule_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default causal order: sections sized by the L2 (B4 H32 S4096 D128 bf16 on a 50 MB L2: 2 MB of K+V a
    head, 12 heads in 25 MB; GQA: whole groups), "pairs" where the units spread evenly over the CTAs, "global"
    where whole units would leave some CTAs a unit more than the mean by over 10% (PERSIST_PAIRS_MAX_QUANT);
    the env overrides and their validation."""
    m = _mod()
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_PERSIST_ORDER", raising=False)
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_PERSIST_SECTION", raising=False)
    l2 = 50 * 2**20
    assert m._persist_schedule(128, 1, 32, 4096, 128, 2, l2, 132) == (1, 12, 12 * 16, 128 * 16)
    assert m._persist_schedule(128, 4, 32, 4096, 128, 2, l2, 132)[1] == 48  # 12 KV heads x 4 query heads
    assert m._persist_schedule(1024, 1, 4, 512, 128, 2, l2, 132)[:2] == (1, 100)
    assert m._persist_schedule(32, 1, 512, 65536, 128, 2, l2, 132)[1] == 1  # one head's K/V > 25 MB
    # B4 H32 S1088 D128: 9 query blocks, 47-head sections -> 577 units = 4.37 a CTA, the busiest 5: global
    assert m._persist_schedule(128, 1, 9, 1088, 128, 2, l2, 132)[:2] == (0, 128)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_ORDER", "sections")
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_SECTION", "5")
    assert m._persist_schedule(128, 1, 32, 4096, 128, 2, l2, 132) == (0, 5, 5 * 32, 128 * 32)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_ORDER", "lpt")
    with pytest.raises(ValueError, match="PERSIST_ORDER"):
        m._persist_schedule(128, 1, 32, 4096, 128, 2, l2, 132)


def test_d256_routing(monkeypatch: pytest.MonkeyPatch):
    """attention.use_hopper sends D256 to this kernel only with _GLUON_D256 (on unless
    FUSEKIT_TRITON_ATTN_GLUON_D256=0); use_hopper_bwd never sends D256 to the Gluon backward (D64/D128 only)."""
    from kernels_triton import _attention_hopper_bwd as HB
    from kernels_triton import attention as A

    # the device test (sm_90, CUDA) of both gates; the backward's adds its head dims on top
    monkeypatch.setattr(A, "hopper_supported", lambda *a: True)
    monkeypatch.setattr(HB, "hopper_supported", lambda *a: True)
    monkeypatch.setattr(A, "GLUON", True)
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 0)
    q, k, v = _qkv(D=256)
    for causal in (False, True):
        monkeypatch.setattr(A, "_GLUON_D256", False)
        assert not A.use_hopper(q, k, v, q, causal)
        monkeypatch.setattr(A, "_GLUON_D256", True)
        assert A.use_hopper(q, k, v, q, causal)
    assert not A.use_hopper_bwd(q, k, v, None, q, k, v, q, q)
    q, k, v = _qkv(D=128)
    assert A.use_hopper(q, k, v, q, True) and A.use_hopper_bwd(q, k, v, None, q, k, v, q, q)


def test_d64_causal_routing(monkeypatch: pytest.MonkeyPatch):
    """D64 causal stays on attention.py's kernel (Gluon lost there, persistent or not); D64 non-causal goes to
    Gluon."""
    from kernels_triton import attention as A

    monkeypatch.setattr(A, "hopper_supported", lambda *a: True)
    monkeypatch.setattr(A, "GLUON", True)
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 0)
    q, k, v = _qkv(D=64)
    assert not A.use_hopper(q, k, v, q, True) and A.use_hopper(q, k, v, q, False)


# --- the opt-in polynomial exp2 (FUSEKIT_HOPPER_ATTN_EXP2_POLY) ------------------------------------------------
def test_exp2_poly_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSEKIT_HOPPER_ATTN_EXP2_POLY takes attention.py's values for the Triton kernel's switch: unset / 0 off,
    1 and 4 a quarter, 2 a half, 8 an eighth (EXP2_POLY = log2 of 1 / the fraction); _DEGREE 3 (default), 4, 5,
    ignored when off (the default kernel's constexprs, (0, 3)); anything else raises, naming the values."""
    m = _mod()
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", raising=False)
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE", raising=False)
    assert m.exp2_poly_config() == (0, 3)
    for raw, poly in (("0", 0), ("", 0), ("1", 2), ("2", 1), ("4", 2), ("8", 3), (" 8 ", 3)):
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", raw)
        assert m.exp2_poly_config() == (poly, 3), raw
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", "1")
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE", "5")
    assert m.exp2_poly_config() == (2, 5)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", "0")
    assert m.exp2_poly_config() == (0, 3)
    for raw, deg in (("3", "3"), ("16", "3"), ("1", "2"), ("1", "6"), ("x", "3")):
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", raw)
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE", deg)
        with pytest.raises(ValueError, match="FUSEKIT_HOPPER_ATTN_EXP2_POLY"):
            m.exp2_poly_config()


@pytest.mark.parametrize("persist", ["1", "0"], ids=["persistent", "one-tile"])
def test_exp2_poly_reaches_the_launch(monkeypatch: pytest.MonkeyPatch, persist: str) -> None:
    """run_hopper passes (EXP2_POLY, EXP2_DEGREE) from the env to the kernel's constexprs and into launch_keyed's
    key (so the switch never relaunches a kernel remembered for the other setting); off gives (0, 3), the
    kernels' defaults. CPU tensors, with the descriptors, device queries and the launch replaced."""
    m = _mod()
    launches = []
    monkeypatch.setattr(m, "_host_descriptors", lambda *a: (None,) * 4)
    monkeypatch.setattr(
        m, "launch_keyed", lambda fn, key, grid, args, consts: launches.append((fn, key, consts))
    )
    monkeypatch.setattr(m, "device_index", lambda q: 0)
    monkeypatch.setattr(m, "num_sms", lambda dev: 132)
    monkeypatch.setattr(m, "l2_bytes", lambda dev: 50 * 2**20)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST", persist)
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_DESC", raising=False)
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE", raising=False)
    q, k, v = _qkv(D=64)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    for env in ("0", "4", "2", "8"):
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", env)
        m.run_hopper(o, lse, q, k, v, False, 0.18)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE", "4")
    m.run_hopper(o, lse, q, k, v, False, 0.18)
    kernel = m._attn_fwd_hopper_persist if persist == "1" else m._attn_fwd_hopper_hd
    assert len(launches) == 5 and all(fn is kernel for fn, _, _ in launches)
    got = [(c["EXP2_POLY"], c["EXP2_DEGREE"]) for _, _, c in launches]
    assert got == [(0, 3), (2, 3), (1, 3), (3, 3), (3, 4)]
    keys = [key for _, key, _ in launches]
    assert len(set(keys)) == 5  # each setting its own remembered kernel
    assert all(any(key[i : i + 2] == pd for i in range(len(key) - 1)) for key, pd in zip(keys, got))


def test_aot_spec_names_exp2_poly():
    """aot_specs_gluon(exp2_poly, degree): the same variants with the polynomial compiled in, named with a
    _poly{n}d{deg} suffix; the default list passes EXP2_POLY = 0, EXP2_DEGREE = 3 (the kernels as they ship)."""
    m = _mod()
    if not m.HAS_GLUON:
        pytest.skip("the installed triton has no Gluon Hopper module")
    base, poly = m.aot_specs_gluon(), m.aot_specs_gluon(2, 4)
    assert [s[0] + "_poly2d4" for s in base] == [s[0] for s in poly]
    assert all(s[3]["EXP2_POLY"] == 0 and s[3]["EXP2_DEGREE"] == 3 for s in base)
    assert all(s[3]["EXP2_POLY"] == 2 and s[3]["EXP2_DEGREE"] == 4 for s in poly)
    assert all(s[2]["EXP2_POLY"] == s[2]["EXP2_DEGREE"] == "constexpr" for s in base + poly)


_COMPILE_POLY = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kernels_triton import _attention_hopper as m
want = set(sys.argv[1].split(","))
for poly in (0, 2):
    for name, fn, sig, const, opts in m.aot_specs_gluon(poly, 3):
        if re.sub("_poly.*", "", name) not in want:
            continue
        ptx = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        n = {op: len(re.findall(pat, ptx)) for op, pat in (("ex2", r"ex2\.approx"), ("shfl", r"shfl\.sync"),
             ("sts", r"st\.shared"), ("bar", r"bar\.sync|barrier\.sync"), ("local", r"\.local"))}
        print("RESULT " + json.dumps({"name": re.sub("_poly.*", "", name), "poly": poly, **n}), flush=True)
"""


def test_exp2_poly_compiles_in_registers():
    """The D64 kernels (bf16, persistent non-causal as routed, one-tile causal) with a quarter of p through the
    polynomial compile for sm_90; the column split/join and the convert back to the accumulator's layout stay in
    registers: the PTX has 16 fewer ex2 per softmax instance (64 scores a thread, 6 instances: tile 0, the
    unmasked and the masked loop, per consumer warpgroup) and exactly as many shuffles, shared-memory stores and
    barriers as the kernel without it, and no local memory."""
    import json
    import os
    import subprocess

    m = _mod()
    if not m.HAS_GLUON:
        pytest.skip("the installed triton has no Gluon Hopper module")
    names = ["attn_hopper_bf16_d64_c0_persist", "attn_hopper_bf16_d64_c1"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_POLY, ",".join(names)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    res = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            res[(r.pop("name"), r.pop("poly"))] = r
    assert len(res) == 4, proc.stderr[-3000:]
    for n in names:
        off, on = res[(n, 0)], res[(n, 2)]
        assert on["ex2"] == off["ex2"] - 6 * 16, (n, off, on)
        assert {k: on[k] for k in ("shfl", "sts", "bar", "local")} == {
            k: off[k] for k in ("shfl", "sts", "bar", "local")
        }, (n, off, on)
        assert on["local"] == 0


@functools.cache
def _compiled() -> dict:
    return compile_all("kernels_triton._attention_hopper", "aot_specs_gluon")


@pytest.mark.parametrize("name", _spec_names())
def test_compiles_ahead_of_time_for_sm90(name):
    """Each (dtype, D, causal) variant compiles to a cubin for sm_90 without a GPU (Triton 3.6 and 3.9): wgmma,
    TMA and the warp-specialized register split (setmaxnreg) are in its PTX."""
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError as exc:  # pragma: no cover - Gluon without its AST source class
        pytest.skip(f"no GluonASTSource in this triton: {exc}")
    r = _compiled()[name]
    assert "error" not in r, r.get("error")
    assert r == {"cubin": True, "wgmma": True, "setmaxnreg": True, "tma": True, "tma_store": True}, r


# --- GPU (sm_90) ----------------------------------------------------------------------------------------
def _need_sm90(device: str) -> None:
    need_sm90(device, _mod().HAS_GLUON)


def _reference(q, k, v, causal: bool, scale: float):
    """float64 o and natural-log lse of the visible scaled scores (bottom-right causal); no key: 0, -inf."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * scale
    S, Skv = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(S, device=q.device)[:, None]
        j = torch.arange(Skv, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Skv - S), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


def _assert_matches(o, lse, q, k, v, causal: bool, dtype: torch.dtype) -> None:
    """o and lse (NaN-poisoned before the call) against the float64 reference: every element written, o within
    the dtype's tolerance, rows that see no key o = 0 and lse = -inf exactly, the rest's lse within 1e-3."""
    from fusekit.tolerances import rtol

    ref, ref_lse = _reference(q, k, v, causal, q.shape[-1] ** -0.5)
    assert not o.isnan().any() and not lse.isnan().any()
    err = ((o.double() - ref).norm() / ref.norm()).item()
    assert err < rtol("attention", dtype), err
    fin = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), fin) and (o[~fin] == 0).all()
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-3


# (B, H, Hkv, S, Skv, D, causal): ragged tails, GQA, S > Skv causal (the first rows see no key), S < Skv.
_CASES = [
    (1, 4, 4, 128, 128, 64, False),
    (2, 8, 2, 77, 300, 128, True),
    (1, 4, 1, 300, 77, 128, True),
    (1, 2, 2, 1000, 1000, 64, False),
    (2, 4, 4, 129, 129, 128, True),
    (1, 4, 2, 200, 333, 128, False),
    # D256: the 64-key tile, odd lengths, GQA, causal with S > Skv and S < Skv
    (1, 4, 4, 128, 128, 256, False),
    (2, 4, 2, 77, 300, 256, True),
    (1, 4, 1, 300, 77, 256, True),
    (1, 2, 2, 333, 333, 256, False),
    (2, 4, 4, 129, 129, 256, True),
    (1, 8, 2, 200, 333, 256, False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", _CASES, ids=lambda c: "B{}H{}-{}S{}K{}D{}{}".format(*c[:6], "c" if c[6] else "")
)
def test_gpu_matches_float64(device: str, dtype: torch.dtype, case) -> None:

    _need_sm90(device)
    B, H, Hkv, S, Skv, D, causal = case
    g = torch.Generator(device="cuda").manual_seed(sum(case[:6]))
    q = torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(dtype)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), device="cuda")
    scale = D**-0.5
    _mod().hopper_forward(o, lse, q, k, v, causal, scale * 1.4426950408889634)
    _assert_matches(o, lse, q, k, v, causal, dtype)


@pytest.mark.parametrize(
    "cfg", ["64,2,1", "32,4,1", "128,2,1"], ids=["bn64s2-kearly", "bn32s4-kearly", "bn128s2-kearly"]
)
@pytest.mark.parametrize(
    "case", [(2, 4, 2, 77, 300, True), (1, 4, 1, 300, 77, True), (1, 2, 2, 333, 333, False)]
)
def test_gpu_k_early_matches_float64(device: str, monkeypatch: pytest.MonkeyPatch, cfg: str, case) -> None:
    """K_EARLY (K slots freed after S, FUSEKIT_HOPPER_ATTN_CFG=BLOCK_N,STAGES,1), not in the default tables
    yet: bf16 at D256 (D128 for the 128-key tile, which spills at D256) against float64."""

    _need_sm90(device)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_CFG", cfg)
    B, H, Hkv, S, Skv, causal = case
    D = 128 if cfg.startswith("128") else 256
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(S + Skv)
    q = torch.randn(B, H, S, D, device="cuda", generator=g).to(dt)
    k = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(dt)
    v = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(dt)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), device="cuda")
    _mod().hopper_forward(o, lse, q, k, v, causal, D**-0.5 * 1.4426950408889634)
    _assert_matches(o, lse, q, k, v, causal, dt)


# The persistent kernel (FUSEKIT_HOPPER_ATTN_PERSIST=1) at _CASES' D64/D128 shapes, with its grid at
# min(SMs, work tiles) (fewer work tiles than SMs at these sizes) and capped at 3 CTAs (each loops over several
# work tiles: the ring's and Q's barrier phases carry over between them), plus a case with more work tiles than
# an H100 has SMs (4 x 32 heads x 3 query blocks = 384).
_PERSIST_CASES = [c for c in _CASES if c[5] in (64, 128)] + [(4, 32, 8, 333, 700, 64, True)]


def _persist_inputs(case, dtype):
    B, H, Hkv, S, Skv, D, _ = case
    g = torch.Generator(device="cuda").manual_seed(sum(case[:6]) + 1)
    q = torch.randn(B, H, S, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, Hkv, Skv, D, device="cuda", generator=g).to(dtype)
    return q, k, v


def _persist_run(monkeypatch, q, k, v, causal, persist: bool):
    """o, lse (NaN-poisoned before the call) of hopper_forward with the persistent kernel on or off; asserts
    which kernel ran."""
    m = _mod()
    calls = []
    real = m._run_persistent
    monkeypatch.setattr(m, "_run_persistent", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST", "1" if persist else "0")
    B, H, S, D = q.shape
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), device="cuda")
    m.hopper_forward(o, lse, q, k, v, causal, D**-0.5 * 1.4426950408889634)
    assert bool(calls) == persist, "the persistent kernel did not run" if persist else "it ran unasked"
    return o, lse


@pytest.mark.parametrize("ctas", ["sms", "3"], ids=["grid-sms", "grid-3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", _PERSIST_CASES, ids=lambda c: "B{}H{}-{}S{}K{}D{}{}".format(*c[:6], "c" if c[6] else "")
)
def test_gpu_persistent_matches_float64(
    device: str, monkeypatch: pytest.MonkeyPatch, ctas, dtype, case
) -> None:

    _need_sm90(device)
    if ctas != "sms":
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_CTAS", ctas)
    q, k, v = _persist_inputs(case, dtype)
    causal = case[6]
    o, lse = _persist_run(monkeypatch, q, k, v, causal, True)
    _assert_matches(o, lse, q, k, v, causal, dtype)


@pytest.mark.parametrize(
    "case", _PERSIST_CASES, ids=lambda c: "B{}H{}-{}S{}K{}D{}{}".format(*c[:6], "c" if c[6] else "")
)
def test_gpu_persistent_bit_identical_to_one_tile_per_cta(device: str, monkeypatch, case) -> None:
    """Each work tile runs the same consumer code (_consumer_tile) on the same data in the same order as the
    one-tile-per-CTA kernel: o and lse are bit-identical, whichever CTA takes a tile and after how many."""
    _need_sm90(device)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_CTAS", "5")
    q, k, v = _persist_inputs(case, torch.bfloat16)
    o, lse = _persist_run(monkeypatch, q, k, v, case[6], True)
    o2, lse2 = _persist_run(monkeypatch, q, k, v, case[6], False)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


# The causal orders (FUSEKIT_HOPPER_ATTN_PERSIST_ORDER) with small sections (FUSEKIT_HOPPER_ATTN_PERSIST_SECTION):
# several sections and a ragged last one (odd and even), odd query-block counts (middle blocks paired across
# heads, one left alone), one query block, GQA with sections that split a group, rows that see no key; grid at
# min(SMs, units) and capped at 7 CTAs.
_ORDER_CASES = [
    ((2, 8, 2, 333, 700, 128, True), 6),
    ((3, 5, 5, 640, 640, 64, True), 4),
    ((1, 6, 2, 1000, 1000, 128, True), 4),
    ((2, 4, 1, 77, 300, 64, True), 3),
    ((1, 4, 4, 300, 77, 128, True), 3),
]


@pytest.mark.parametrize("ctas", ["sms", "7"], ids=["grid-sms", "grid-7"])
@pytest.mark.parametrize("order", ["pairs", "sections", "global"])
@pytest.mark.parametrize(
    "case", _ORDER_CASES, ids=lambda c: "B{}H{}-{}S{}K{}D{}".format(*c[0][:6]) + f"-sec{c[1]}"
)
def test_gpu_persistent_causal_orders_bit_identical(device: str, monkeypatch, ctas, order, case) -> None:
    """Every causal order gives o and lse bit-identical to the one-tile-per-CTA kernel (itself checked against
    float64 above): each work tile runs once, through the same code, whichever unit and CTA it falls in."""
    _need_sm90(device)
    shape, sec = case
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_ORDER", order)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_SECTION", str(sec))
    if ctas != "sms":
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_CTAS", ctas)
    q, k, v = _persist_inputs(shape, torch.bfloat16)
    o, lse = _persist_run(monkeypatch, q, k, v, True, True)
    o2, lse2 = _persist_run(monkeypatch, q, k, v, True, False)
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("cfg", ["64,4,1", "128,2,0"], ids=["bn64s4-kearly", "bn128s2"])
def test_gpu_persistent_ring_configs(device: str, monkeypatch: pytest.MonkeyPatch, cfg: str) -> None:
    """The persistent kernel at D128 with other rings (FUSEKIT_HOPPER_ATTN_CFG): 4 stages of 64 keys (the
    slot/phase sequence wraps at another period) and K freed with V (no K_EARLY), over a capped grid."""

    _need_sm90(device)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_CFG", cfg)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_CTAS", "3")
    for case in [
        (2, 8, 2, 77, 300, 128, True),
        (1, 4, 1, 300, 77, 128, True),
        (1, 4, 2, 200, 333, 128, False),
    ]:
        q, k, v = _persist_inputs(case, torch.bfloat16)
        o, lse = _persist_run(monkeypatch, q, k, v, case[6], True)
        _assert_matches(o, lse, q, k, v, case[6], torch.bfloat16)


def test_gpu_kv_cache_view(device: str) -> None:
    """k/v as strided views into a NaN-padded cache [B, max_len, Hkv, D] (read in place through the strides;
    the slots past Skv are never read)."""
    from fusekit.tolerances import rtol

    _need_sm90(device)
    B, H, Hkv, S, Skv, D, max_len = 2, 8, 2, 96, 200, 128, 256
    g = torch.Generator(device="cuda").manual_seed(5)
    dt = torch.bfloat16
    kc = torch.full((B, max_len, Hkv, D), float("nan"), device="cuda", dtype=dt)
    vc = torch.full_like(kc, float("nan"))
    kc[:, :Skv] = torch.randn(B, Skv, Hkv, D, device="cuda", generator=g).to(dt)
    vc[:, :Skv] = torch.randn(B, Skv, Hkv, D, device="cuda", generator=g).to(dt)
    k, v = kc.transpose(1, 2)[:, :, :Skv], vc.transpose(1, 2)[:, :, :Skv]
    q = torch.randn(B, H, S, D, device="cuda", generator=g).to(dt)
    assert _mod().hopper_supported(q, k, v, None)
    o = torch.full_like(q, float("nan"))
    lse = torch.empty(B, H, S, device="cuda")
    _mod().hopper_forward(o, lse, q, k, v, True, D**-0.5 * 1.4426950408889634)
    ref, _ = _reference(q, k, v, True, D**-0.5)
    assert ((o.double() - ref).norm() / ref.norm()).item() < rtol("attention", dt)


@pytest.mark.parametrize("D", [128, 256])
def test_gpu_ops_attention_routes_here(device: str, monkeypatch: pytest.MonkeyPatch, D: int) -> None:
    """ops.attention(backend="triton") runs the Gluon kernel where attention.use_hopper says so (the size
    threshold lowered to test sizes), and its output carries gradients: through the Gluon backward at D128,
    through the kernels of attention_backward.py at D256 (the Gluon backward has no D256)."""
    from fusekit import ops
    from fusekit.tolerances import rtol
    from kernels_triton import attention as A

    _need_sm90(device)
    fwd, bwd = [], []
    real_f, real_b = A.run_hopper, A.run_hopper_bwd
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 0)
    monkeypatch.setattr(A, "_GLUON_D256", True)
    monkeypatch.setattr(A, "run_hopper", lambda *a: (fwd.append(1), real_f(*a))[1])
    monkeypatch.setattr(A, "run_hopper_bwd", lambda *a: (bwd.append(1), real_b(*a))[1])
    g = torch.Generator(device="cuda").manual_seed(D)
    q, k, v = (torch.randn(1, 4, 150, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    q.requires_grad_()
    y = ops.attention(q, k, v, causal=True, backend="triton")
    assert fwd, "the Gluon kernel did not run"
    ref, _ = _reference(q.detach(), k, v, True, D**-0.5)
    assert ((y.double() - ref).norm() / ref.norm()).item() < rtol("attention", torch.bfloat16)
    y.float().sum().backward()
    assert bool(bwd) == (D != 256), f"Gluon backward calls at D{D}: {len(bwd)}"
    assert q.grad is not None and q.grad.isfinite().all()


def test_gpu_strided_q_routes_here_with_a_copy(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A q read from a fused qkv projection ("bshd" heads of [B, S, H + 2 Hkv, D]: strided) still takes the
    Gluon kernels where they run (a dense copy of q first; the FlashAttention kernel would read it in place),
    output and q's gradient as the contiguous call's, against float64."""
    from fusekit import ops
    from fusekit.tolerances import rtol
    from kernels_triton import attention as A

    _need_sm90(device)
    fwd = []
    real_f = A.run_hopper
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 0)
    monkeypatch.setattr(A, "run_hopper", lambda *a: (fwd.append(a[2].is_contiguous()), real_f(*a))[1])
    A.clear_routes()
    g = torch.Generator(device="cuda").manual_seed(11)
    B, S, H, Hkv, D = 2, 150, 4, 2, 128
    qkv = torch.randn(B, S, H + 2 * Hkv, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    q, k, v = qkv[:, :, :H], qkv[:, :, H : H + Hkv], qkv[:, :, H + Hkv :]
    y = ops.attention(q, k, v, causal=True, layout="bshd", backend="triton")
    assert fwd == [True], f"Gluon forward calls (q dense): {fwd}"
    qd, kd, vd = (t.detach().transpose(1, 2) for t in (q, k, v))
    ref, _ = _reference(qd, kd, vd, True, D**-0.5)
    assert ((y.transpose(1, 2).double() - ref).norm() / ref.norm()).item() < rtol("attention", torch.bfloat16)
    y.float().sum().backward()
    want = qkv.detach().clone().requires_grad_()
    qc, kc, vc = (t.transpose(1, 2).contiguous() for t in want.split([H, Hkv, Hkv], dim=2))
    ops.attention(qc, kc, vc, causal=True, backend="triton").float().sum().backward()
    assert torch.equal(qkv.grad, want.grad)  # same kernels on the same values: bit-identical
    A.clear_routes()


def test_gpu_capture_fwd_bwd_replays(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon forward and backward (host TMA descriptors rebuilt per call, launched by the lean path) capture
    in a CUDA graph: after a warm-up, fwd+bwd captured, the inputs overwritten in place and the graph replayed
    give bit-identically what an eager call on the new inputs gives (the size threshold lowered so both
    Gluon kernels run)."""
    from fusekit import ops
    from kernels_triton import attention as A

    _need_sm90(device)
    monkeypatch.setattr(A, "_GLUON_MIN_FLOP", 0)
    calls = []
    real_f, real_b = A.run_hopper, A.run_hopper_bwd
    monkeypatch.setattr(A, "run_hopper", lambda *a: (calls.append("f"), real_f(*a))[1])
    monkeypatch.setattr(A, "run_hopper_bwd", lambda *a, **kw: (calls.append("b"), real_b(*a, **kw))[1])
    g = torch.Generator(device="cuda").manual_seed(3)
    dt = torch.bfloat16
    q = torch.randn(2, 8, 200, 128, device="cuda", generator=g).to(dt).requires_grad_()
    k = torch.randn(2, 2, 200, 128, device="cuda", generator=g).to(dt).requires_grad_()
    v = torch.randn(2, 2, 200, 128, device="cuda", generator=g).to(dt).requires_grad_()
    do = torch.randn(2, 8, 200, 128, device="cuda", generator=g).to(dt)

    def step():
        y = ops.attention(q, k, v, causal=True, backend="triton")
        return (y, *torch.autograd.grad(y, (q, k, v), do))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compiles, picks configs
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    assert "f" in calls and "b" in calls, calls
    with torch.no_grad():
        for t in (q, k, v, do):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g).to(dt))
    graph.replay()
    torch.cuda.synchronize()
    ref = step()
    for name, a, b in zip(("o", "dq", "dk", "dv"), outs, ref, strict=True):
        assert torch.equal(a, b), f"{name}: replay differs from eager"


# The opt-in polynomial exp2 on the GPU: D64 (where it is meant to pay) and D128, causal and not (ragged tails, GQA,
# rows that see no key), persistent and one-tile, each fraction at degree 3 (and 1/2 at degree 4, one case).
_POLY_CASES = [
    (1, 4, 4, 128, 128, 64, False),
    (1, 2, 2, 1000, 1000, 64, False),
    (2, 4, 2, 77, 300, 64, True),
    (1, 4, 1, 300, 77, 64, True),
    (2, 8, 2, 77, 300, 128, True),
    (1, 4, 2, 200, 333, 128, False),
]


@pytest.mark.parametrize("persist", [True, False], ids=["persistent", "one-tile"])
@pytest.mark.parametrize("frac", ["4", "8", "2"], ids=["quarter", "eighth", "half"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", _POLY_CASES, ids=lambda c: "B{}H{}-{}S{}K{}D{}{}".format(*c[:6], "c" if c[6] else "")
)
def test_gpu_exp2_poly_matches_float64(device: str, monkeypatch, persist, frac, dtype, case) -> None:
    """FUSEKIT_HOPPER_ATTN_EXP2_POLY on: o within the dtype's tolerance of float64 (_assert_matches: lse within
    1e-3, rows without a key exactly o = 0, lse = -inf), lse within 1e-4 of the switch-off kernel's (the
    degree-3 polynomial's relative error <= 7.6e-5 bounds the row sum's, so lse moves by <= 7.6e-5) and o within
    1e-3 (relative norm: P's rounding to 16 bits moves a few elements by an ulp)."""
    _need_sm90(device)
    monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE", raising=False)
    q, k, v = _persist_inputs(case, dtype)
    causal = case[6]
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", "0")
    o_off, lse_off = _persist_run(monkeypatch, q, k, v, causal, persist)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", frac)
    o, lse = _persist_run(monkeypatch, q, k, v, causal, persist)
    _assert_matches(o, lse, q, k, v, causal, dtype)
    fin = lse_off.isfinite()
    assert torch.equal(lse.isfinite(), fin)
    assert (lse[fin] - lse_off[fin]).abs().max().item() < 1e-4
    # unless every polynomial column is a masked key (p = 0 both ways)
    if _poly_sees_a_key(case[5], case[4], frac):
        assert not torch.equal(lse, lse_off), "the switch changed nothing: did the polynomial run?"
    assert ((o.double() - o_off.double()).norm() / o_off.double().norm()).item() < 1e-3  # a few output ulps


def _poly_sees_a_key(head_dim: int, skv: int, frac: str) -> bool:
    """Whether some key j < skv falls in a column exp2_mixed_gluon sends through the polynomial: the odd
    columns of each BLOCK_N-key tile (1/2), of its last half (1/4) or of its last quarter (1/8). The last
    query row sees every key, causal or not. (At Skv 77 with 128-key tiles no key reaches the 1/8's columns
    97, 99, ..., 127: the switch cannot change lse there, found on an H200 on 2026-11-28.)"""
    bn = _mod()._env_config(head_dim)[0]
    first = bn - bn * 2 // int(frac)  # 1/2: 0, 1/4: bn / 2, 1/8: 3 bn / 4
    return any(j % bn >= first and j % 2 == 1 for j in range(skv))


def test_gpu_exp2_poly_degree4_and_persistent_bit_identical(device: str, monkeypatch) -> None:
    """With the switch on the persistent kernel still runs each work tile through the same code as the one-tile
    kernel (bit-identical o and lse, grid capped at 5 CTAs), and degree 4 (2.6e-6) keeps lse within 1e-5 of
    the switch-off lse."""
    _need_sm90(device)
    monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_PERSIST_CTAS", "5")
    for case in [(1, 2, 2, 1000, 1000, 64, False), (4, 32, 8, 333, 700, 64, True)]:
        q, k, v = _persist_inputs(case, torch.bfloat16)
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", "0")
        _, lse_off = _persist_run(monkeypatch, q, k, v, case[6], True)
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY", "2")
        monkeypatch.setenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE", "4")
        o, lse = _persist_run(monkeypatch, q, k, v, case[6], True)
        o2, lse2 = _persist_run(monkeypatch, q, k, v, case[6], False)
        monkeypatch.delenv("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE")
        assert torch.equal(o, o2) and torch.equal(lse, lse2)
        _assert_matches(o, lse, q, k, v, case[6], torch.bfloat16)
        fin = lse_off.isfinite()
        assert (lse[fin] - lse_off[fin]).abs().max().item() < 1e-5


def test_checked_entries_route_once_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """attention.forward_checked / backward_checked (the provider's entries): the Gluon gate (use_hopper /
    use_hopper_bwd) is asked once per signature; later calls launch run_hopper / run_hopper_bwd with the same
    arguments forward / backward would pass, and a call with kv_len, a negative scale or a misaligned pointer
    takes forward / backward (which decide everything themselves), as does a decode shape (S <= 16: a new
    Skv every token, never a route of its own). CPU tensors, the launches recorded."""
    from kernels_triton import attention as A

    log: list = []
    gates = {"fwd": 0, "bwd": 0}

    def gate(name: str, answer: bool):
        def f(*a, **k):
            gates[name] += 1
            return answer

        return f

    monkeypatch.setattr(A, "use_hopper", gate("fwd", True))
    monkeypatch.setattr(A, "use_hopper_bwd", gate("bwd", True))
    for name in ("run_hopper", "run_hopper_bwd", "forward", "backward"):
        monkeypatch.setattr(A, name, lambda *a, name=name: log.append((name, a)))
    q, k, v = _qkv(D=64)
    o, lse, do = torch.empty_like(q), torch.empty(q.shape[:3]), torch.randn_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for _ in range(3):
        A.forward_checked(o, lse, q, k, v, None, True, 0.125)
        A.backward_checked(dq, dk, dv, do, q, k, v, o, lse, None, True, 0.125)
    assert gates == {"fwd": 1, "bwd": 1}
    assert [n for n, _ in log] == ["run_hopper", "run_hopper_bwd"] * 3
    assert log[0][1] == (o, lse, q, k, v, True, 0.125 * A._LOG2E)
    assert log[1][1] == (dq, dk, dv, do, q, k, v, o, lse, True, 0.125)
    log.clear()
    kv_len = torch.full((q.shape[0],), k.shape[2], dtype=torch.int32)
    A.forward_checked(o, lse, q, k, v, kv_len, True, 0.125)
    A.forward_checked(o, lse, q, k, v, None, True, -0.125)
    odd = torch.empty(o.numel() + 1, dtype=o.dtype)[1:].view(o.shape)
    A.forward_checked(odd, lse, q, k, v, None, True, 0.125)
    A.backward_checked(dq, dk, dv, do, q, k, v, o, lse, kv_len, True, 0.125)
    A.backward_checked(odd, dk, dv, do, q, k, v, o, lse, None, True, 0.125)
    assert [n for n, _ in log] == ["forward"] * 3 + ["backward"] * 2
    assert log[1][1] == (o, lse, q, k, v, None, True, -0.125)
    log.clear()
    qs, os_ = q[:, :, :16], torch.empty_like(q[:, :, :16])
    for skv in (40, 41, 42):  # a decode step per token
        A.forward_checked(os_, lse[:, :, :16], qs, k[:, :, :skv], v[:, :, :skv], None, True, 0.125)
    assert [n for n, _ in log] == ["forward"] * 3 and gates["fwd"] == 1
    log.clear()
    monkeypatch.setattr(A, "GLUON", False)  # a switch the routes hold: a new signature, the gate asked again
    monkeypatch.setattr(A, "use_hopper", gate("fwd", False))
    A.forward_checked(o, lse, q, k, v, None, True, 0.125)
    A.forward_checked(o, lse, q, k, v, None, True, 0.125)
    assert gates["fwd"] == 2 and [n for n, _ in log] == ["forward", "forward"]
