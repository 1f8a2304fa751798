"""Every code path of the Triton memory-bound kernels, forced, on the CPU interpreter at small shapes.

Self-contained (no conftest fixtures): TRITON_INTERPRET=1 is set before torch/triton are imported, each
output is poisoned with NaN, and results are compared with a float64 computation by relative error.
"""

import os

import pytest

# CPU interpreter only (tests/conftest.py sets TRITON_INTERPRET=1 for --device cpu before triton is
# imported); setting it here would switch a whole --device cuda process into the interpreter.
from kernels_triton._config import is_interpreter

if not is_interpreter():
    pytest.skip("CPU interpreter tests (run with --device cpu)", allow_module_level=True)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import math

import torch
from checks import layer_norm_ref, rel_error, rms_norm_ref, sum_scale

pytest.importorskip("triton")

from fusekit.tolerances import RTOL
from kernels_triton import _config
from kernels_triton import layer_norm as ln_mod
from kernels_triton import rms_norm as rms_mod
from kernels_triton.reduce_sum import _plan as reduce_plan
from kernels_triton.reduce_sum import reduce_sum
from kernels_triton.rope import rope

TOL = {**RTOL, torch.float32: 1e-5}  # fusekit.tolerances, fp32 tighter: one rounding, short sums
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def rms_norm(out, rstd, x, w, eps, **kw) -> None:
    """The contract forward without residual, "fp32" casting (the norms' mode tests below)."""
    rms_mod.forward(out, None, rstd, x, None, w, eps, "fp32", **kw)


def layer_norm(out, mean, rstd, x, w, b, eps, **kw) -> None:
    ln_mod.forward(out, None, mean, rstd, x, None, w, b, eps, **kw)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(
    *shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0, shift: float = 0.0
) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale + shift).to(dtype)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "yes", "y", "0", "false", "off", "", " 1", "2"])
def test_is_interpreter_reads_the_env_as_triton_does(monkeypatch, value: str) -> None:
    """fusekit and Triton agree on whether TRITON_INTERPRET switches the interpreter on (fusekit had read any
    value but "0" as on in its kernels and only "1" in its backend)."""
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", value)
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip("this Triton has no knobs module")
    assert _config.is_interpreter() == bool(knobs.runtime.interpret)


# ---------------------------------------------------------------------------------------------- reduce_sum
def test_reduce_plan_thresholds() -> None:
    # interpreter stand-in: 4 "SMs" -> split targets 16 programs
    assert reduce_plan(4096, 1000, 4, 0) == ("rows", 1)
    mode, split = reduce_plan(1, 1 << 20, 4, 0)
    assert mode == "split" and split > 1
    assert reduce_plan(1, 100, 4, 0)[0] == "rows"  # short row: no point splitting


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "M,N,kw",
    [
        (37, 100, {"_mode": "rows"}),
        (5, 3000, {"_mode": "rows", "_block": 64}),  # loop over N in several BLOCK_N steps
        (1, 5003, {"_mode": "split", "_split": 7}),  # dim=None shape, ragged last chunk
        (3, 2000, {"_mode": "split", "_split": 4, "deterministic": True}),
        (3, 2000, {"_mode": "split", "_split": 4, "deterministic": False}),
        (2, 2560, {"_mode": "split", "_split": 3, "deterministic": True}),  # whole tiles only (no tail)
    ],
)
def test_reduce_sum_float(dtype: torch.dtype, M: int, N: int, kw: dict) -> None:
    x = _randn(M, N, dtype=dtype, seed=M * N)
    for odt in {torch.float32, dtype}:
        out = torch.full((M,), float("nan"), dtype=odt)
        reduce_sum(out, x, **kw)
        ref = x.double().sum(-1)
        tol = TOL[odt] if odt != torch.float32 else 1e-5
        assert rel_error(out, ref, sum_scale(x, -1)) <= tol, (odt, kw)


@pytest.mark.parametrize("xdt", [torch.int32, torch.int64])
@pytest.mark.parametrize("odt", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "kw",
    [
        {"_mode": "rows"},
        {"_mode": "split", "_split": 3},
        {"_mode": "split", "_split": 3, "deterministic": True},
    ],
)
def test_reduce_sum_int_exact(xdt: torch.dtype, odt: torch.dtype, kw: dict) -> None:
    M, N = 3, 1500
    hi = 2**31 - 1 if xdt == torch.int32 else 2**40
    x = torch.randint(-hi, hi, (M, N), dtype=xdt, generator=_gen(5))
    out = torch.full((M,), -7, dtype=odt)
    reduce_sum(out, x, **kw)
    # int64 accumulation, then one cast (wraps to int32 exactly like torch's .to(int32))
    assert torch.equal(out, x.long().sum(-1).to(odt))


def test_reduce_sum_deterministic_is_bitwise_repeatable() -> None:
    x = _randn(2, 4099, dtype=torch.float32, seed=11)
    a = torch.full((2,), float("nan"))
    b = torch.full((2,), float("nan"))
    reduce_sum(a, x, deterministic=True, _mode="split", _split=5)
    reduce_sum(b, x, deterministic=True, _mode="split", _split=5)
    assert torch.equal(a, b)


def test_reduce_sum_default_plan() -> None:
    x = _randn(1, 1 << 14, dtype=torch.float32, seed=3)
    out = torch.full((1,), float("nan"))
    reduce_sum(out, x)  # default plan: split (1 row, long)
    assert rel_error(out, x.double().sum(-1), sum_scale(x, -1)) <= 1e-5


# ---------------------------------------------------------------------------------------------- norms
NORM_CASES = [
    ("reg", 37, 100),  # several rows per program, masked columns
    ("reg", 5, 1128),
    ("rows", 37, 100),  # persistent register tiles with prefetch, ragged last tile
    ("reload", 6, 3000),  # two-pass streaming, ragged last block
    ("split", 3, 2500),  # several programs per row
]
# Persistent kernels (the interpreter stands in 4 SMs, so grid = progs x 4, capped at the row tiles):
# M not a multiple of the grid, M below the grid, N below / not a multiple of the step (interpreter: 256).
PERSISTENT_CASES = [
    ("reload", 7, 3000, {"_progs": 1}),  # grid 4: programs take 2 or 1 rows
    ("reload", 13, 1000, {"_progs": 2}),  # grid 8
    ("reload", 3, 700, {"_progs": 3}),  # M < progs x SMs: grid capped at M
    ("reload", 9, 100, {"_progs": 2}),  # a row shorter than one step
    ("reload", 5, 777, {"_progs": 1, "_block": 128}),  # odd N, several ragged steps
    ("rows", 37, 300, {"_progs": 1, "_block_m": 4}),  # 10 tiles over 4 programs, last tile 1 row
    ("rows", 3, 1128, {"_progs": 2, "_block_m": 1}),  # M < grid
    ("rows", 23, 2000, {"_progs": 2, "_block_m": 2}),
    ("reg", 6, 3000, {"_num_warps": 32, "_block_m": 1}),  # the 32-warp long-row candidate
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode,M,N", NORM_CASES)
def test_rms_norm_modes(dtype: torch.dtype, mode: str, M: int, N: int) -> None:
    x = _randn(M, N, dtype=dtype, seed=N, scale=2.0, shift=0.5)
    w = _randn(N, dtype=dtype, seed=N + 1)
    out = torch.full_like(x, float("nan"))
    rstd = torch.full((M,), float("nan"))
    rms_norm(out, rstd, x, w, 1e-6, _mode=mode, _split=3 if mode == "split" else None)
    xd = x.double()
    ref_rstd = torch.rsqrt(xd.square().mean(-1) + 1e-6)
    ref = xd * ref_rstd[:, None] * w.double()
    assert rel_error(out, ref) <= TOL[dtype]
    assert rel_error(rstd, ref_rstd) <= 1e-5


# layer_norm's own: "loop3" (one program per row, three passes), ragged last step.
LN_CASES = [*NORM_CASES, ("loop3", 6, 3000), ("loop3", 1, 100)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode,M,N", LN_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_modes(dtype: torch.dtype, mode: str, M: int, N: int, with_bias: bool) -> None:
    x = _randn(M, N, dtype=dtype, seed=N, scale=2.0, shift=3.0)
    w = _randn(N, dtype=dtype, seed=N + 1)
    b = _randn(N, dtype=dtype, seed=N + 2) if with_bias else None
    out = torch.full_like(x, float("nan"))
    mean = torch.full((M,), float("nan"))
    rstd = torch.full((M,), float("nan"))
    layer_norm(out, mean, rstd, x, w, b, 1e-5, _mode=mode, _split=3 if mode == "split" else None)
    xd = x.double()
    ref_mean = xd.mean(-1)
    ref_rstd = torch.rsqrt((xd - ref_mean[:, None]).square().mean(-1) + 1e-5)
    ref = (xd - ref_mean[:, None]) * ref_rstd[:, None] * w.double()
    if b is not None:
        ref = ref + b.double()
    assert rel_error(out, ref) <= TOL[dtype]
    assert rel_error(mean, ref_mean) <= 1e-5
    assert rel_error(rstd, ref_rstd) <= 1e-5


@pytest.mark.parametrize(
    "mode,kw",
    [("reg", {}), ("rows", {}), ("reload", {}), ("loop3", {}), ("split", {})],
)
def test_layer_norm_large_mean_is_stable(mode: str, kw: dict) -> None:
    # mean 1e4, std 1: raw E[x^2] - E[x]^2 in fp32 would lose every digit of the variance ("reload" shifts
    # by each row's first value first).
    M, N = 3, 3000
    x = _randn(M, N, dtype=torch.float32, seed=9, shift=1e4)
    w = torch.ones(N)
    out = torch.full_like(x, float("nan"))
    mean = torch.full((M,), float("nan"))
    rstd = torch.full((M,), float("nan"))
    layer_norm(out, mean, rstd, x, w, None, 1e-5, _mode=mode, _split=3 if mode == "split" else None, **kw)
    xd = x.double()
    ref_rstd = torch.rsqrt((xd - xd.mean(-1, keepdim=True)).square().mean(-1) + 1e-5)
    ref = (xd - xd.mean(-1, keepdim=True)) * ref_rstd[:, None]
    # torch's own fp32 result (the reference semantics) sets the bar: the fp32 mean of ~1e4 is off by
    # up to half an ulp (5e-4), which shifts every x - mean by that much.
    xc = x - x.mean(-1, keepdim=True)
    torch_err = rel_error(xc * torch.rsqrt(xc.square().mean(-1, keepdim=True) + 1e-5), ref)
    assert rel_error(rstd, ref_rstd) <= 1e-4
    assert rel_error(out, ref) <= 2 * torch_err + 1e-5


@pytest.mark.parametrize("mode", ["reg", "rows", "reload", "loop3", "split"])
@pytest.mark.parametrize("N", [48, 1000, 3000])
def test_layer_norm_constant_rows_are_exactly_zero(mode: str, N: int) -> None:
    """A constant row centres to exactly 0 in every mode: "reg" / "rows" / "loop3" correct the fp32 mean's
    rounding with the deviations' own sum ("reload" / "split" shift by the row's first value). With the
    mean an ulp off, 12345.678 x 48 gave y = +-0.30 at eps 1e-5."""
    x = torch.full((3, N), 12345.678)
    x[1] = -0.3
    out = torch.full_like(x, float("nan"))
    mean = torch.full((3,), float("nan"))
    rstd = torch.full((3,), float("nan"))
    layer_norm(
        out, mean, rstd, x, torch.ones(N), None, 1e-5, _mode=mode, _split=3 if mode == "split" else None
    )
    assert torch.equal(out, torch.zeros_like(out)), f"max |y| {float(out.abs().max()):.3g}"
    assert torch.equal(mean, x[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,M,N,kw", PERSISTENT_CASES)
def test_norms_persistent(dtype: torch.dtype, mode: str, M: int, N: int, kw: dict) -> None:
    x = _randn(M, N, dtype=dtype, seed=M + N, scale=2.0, shift=1.5)
    w = _randn(N, dtype=dtype, seed=N + 1)
    b = _randn(N, dtype=dtype, seed=N + 2)
    out = torch.full_like(x, float("nan"))
    rstd = torch.full((M,), float("nan"))
    rms_norm(out, rstd, x, w, 1e-6, _mode=mode, **kw)
    ref, ref_rstd = rms_norm_ref(x, w, 1e-6)
    assert rel_error(out, ref) <= TOL[dtype]
    assert rel_error(rstd, ref_rstd) <= 1e-5
    out = torch.full_like(x, float("nan"))
    mean = torch.full((M,), float("nan"))
    rstd = torch.full((M,), float("nan"))
    layer_norm(out, mean, rstd, x, w, b, 1e-5, _mode=mode, **kw)
    ref, ref_mean, ref_rstd = layer_norm_ref(x, w, b, 1e-5)
    assert rel_error(out, ref) <= TOL[dtype]
    assert rel_error(mean, ref_mean) <= 1e-5
    assert rel_error(rstd, ref_rstd) <= 1e-5


def test_norm_tuner_picks_fastest_and_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusekit import device_time

    cfgs = [_config.NormConfig("reg", 1024, 8), _config.NormConfig("rows", 1024, 4, progs=2)]
    cfgs.append(_config.NormConfig("reload", 256, 4, progs=1))
    times = {cfgs[0]: 2.0, cfgs[1]: 1.0}  # cfgs[2] "fails to compile"
    current: list[_config.NormConfig] = []
    x = _randn(8, 64, dtype=torch.float32, seed=4)
    out, rstd = torch.empty_like(x), torch.empty(8)
    ref_rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)

    def run(cfg: _config.NormConfig) -> None:
        if cfg not in times:
            raise RuntimeError("out of resources")
        current[:] = [cfg]
        out.copy_(x * ref_rstd[:, None])
        rstd.copy_(ref_rstd)

    def check() -> _config.NormCheck:
        return _config.norm_check(x, (out, rstd), lambda xs: (xs * ref_rstd[:, None], ref_rstd))

    monkeypatch.setattr(device_time, "device_ms", lambda fn, device, **kw: (fn(), times[current[0]])[1])
    key = ("test", 1024, torch.float32)
    monkeypatch.delitem(_config._NORM_TUNED, key, raising=False)
    with pytest.warns(RuntimeWarning, match="reload.*out of resources"):
        assert _config.norm_tuned(key, cfgs, run, check) == cfgs[1]
    times[cfgs[0]] = 0.5  # cached: not re-timed
    assert _config.norm_tuned(key, cfgs, run, check) == cfgs[1]
    monkeypatch.delitem(_config._NORM_TUNED, key)


BAD_FAULTS = ["one_row", "unwritten_row", "stats"]


# (fault, residual, sampled): every fault without a residual, sampled or not; with the fused residual (and
# an fp32 weight, llama casting for rms_norm) a candidate whose y is right but whose h is stale in one row.
TUNER_CASES = [(f, False, smp) for f in BAD_FAULTS for smp in (False, True)] + [("h_row", True, False)]


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("fault,res,sampled", TUNER_CASES)
def test_norm_tuner_rejects_wrong_candidate(
    monkeypatch: pytest.MonkeyPatch, op: str, fault: str, res: bool, sampled: bool
) -> None:
    # The whole tuned path of the op on the CPU: tuning forced on, fake timings in which a candidate that
    # writes wrong values is the fastest. It must be dropped with a warning, and the result be correct.
    from fusekit import device_time

    mod = rms_mod if op == "rms_norm" else ln_mod
    M, N = (300, 64) if sampled else (37, 100)
    unchecked = M // 2
    if sampled:  # reference and comparison on 256 evenly spaced rows + the last, as for huge x on the GPU
        monkeypatch.setattr(_config, "NORM_CHECK_FULL_ELEMS", 1000)
        rows = _config.norm_check(torch.zeros(M, N), (torch.zeros(M, N),), lambda xs: (xs,)).rows
        assert rows is not None and len(rows) == 257 and int(rows[-1]) == M - 1
        unchecked = min(set(range(M)) - set(rows.tolist()))
    good = _config.NormConfig("reg", 128, 4, block_m=4)
    bad = _config.NormConfig("rows", 128, 4, block_m=4, progs=1)
    slow = _config.NormConfig("reload", 256, 4, progs=2)
    times = {good: 3.0, bad: 1.0, slow: 2.0}
    monkeypatch.setattr(_config, "norm_should_tune", lambda x: True)
    monkeypatch.setattr(_config, "norm_candidates", lambda *a, **k: [good, bad, slow])
    real_launch = mod._launch
    current: list[_config.NormConfig] = []
    launched: list[_config.NormConfig] = []

    def launch(cfg: _config.NormConfig, out: torch.Tensor, *args) -> None:
        current[:] = [cfg]
        launched.append(cfg)
        real_launch(cfg, out, *args)
        if cfg == bad:  # a "miscompiled" kernel: fast, but wrong
            # _launch(cfg, y, h, rstd, ...) for rms_norm, _launch(cfg, y, h, mean, rstd, ...) for layer_norm
            if fault == "one_row":
                out[M - 1] = out[M - 2]  # a stale row (the last row is always checked): O(1) error in one row
            elif fault == "unwritten_row":
                out[unchecked] = float("nan")  # a row the sampled comparison skips: the NaN scan finds it
            elif fault == "h_row":
                args[0][M - 1] = args[0][M - 2]  # y right, the residual sum h stale in one row
            else:
                args[1 if op == "rms_norm" else 2].mul_(1.01)  # rstd off by 1 %

    monkeypatch.setattr(mod, "_launch", launch)
    monkeypatch.setattr(device_time, "device_ms", lambda fn, device, **kw: (fn(), times[current[0]])[1])
    monkeypatch.setattr(_config, "_NORM_TUNED", {})
    monkeypatch.setattr(_config, "_NORM_SELECTED", {})  # no config remembered from an earlier call
    # With a residual: fp16 x, fp32 weight (AMP). Not bf16: the interpreter truncates fp32 -> bf16 casts, so
    # h (and with it rstd) would differ from the check's correctly rounded reference by ~2e-3.
    dt = torch.float16 if res else torch.bfloat16
    x = _randn(M, N, dtype=dt, seed=M + N, scale=2.0, shift=0.5)
    r = _randn(M, N, dtype=dt, seed=M + N + 3) if res else None
    h = torch.full_like(x, float("nan")) if res else None
    w = _randn(N, dtype=torch.float32 if res else torch.bfloat16, seed=N + 1)  # AMP weight with the residual
    b = _randn(N, dtype=w.dtype, seed=N + 2)
    out = torch.full_like(x, float("nan"))
    stats = [torch.full((M,), float("nan")) for _ in range(1 if op == "rms_norm" else 2)]
    with pytest.warns(RuntimeWarning, match=r"dropped rows .*relative error|dropped rows .*unwritten") as rec:
        if op == "rms_norm":
            rms_mod.forward(out, h, stats[0], x, r, w, 1e-6, "llama" if res else "fp32")
            xin = x if not res else (x.float() + r.float()).to(x.dtype)
            ref, *ref_stats = rms_norm_ref(xin, w, 1e-6)
            if res:  # llama: the normalized row rounded to bf16 before the weight
                ref = (xin.double() * ref_stats[0][:, None]).to(x.dtype).double() * w.double()
        else:
            ln_mod.forward(out, h, stats[0], stats[1], x, r, w, b, 1e-5)
            xin = x if not res else (x.float() + r.float()).to(x.dtype)
            ref, *ref_stats = layer_norm_ref(xin, w, b, 1e-5)
    assert len([r for r in rec if "dropped" in str(r.message)]) == 1
    (chosen,) = _config._NORM_TUNED.values()
    assert chosen == slow  # the fastest correct one
    assert launched[-1] == slow  # the chosen config wrote the caller's buffers last
    assert rel_error(out, ref) <= TOL[dt]
    for s, rs in zip(stats, ref_stats):
        assert rel_error(s, rs) <= 1e-5
    if res:
        assert torch.equal(h, xin)


def test_norm_tuner_all_wrong_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    cfgs = [
        _config.NormConfig("reg", 128, 4, block_m=4),
        _config.NormConfig("rows", 128, 4, block_m=4, progs=1),
    ]
    real_launch = rms_mod._launch

    def launch(cfg: _config.NormConfig, out: torch.Tensor, *args) -> None:
        real_launch(cfg, out, *args)
        out.mul_(-1.0)

    monkeypatch.setattr(_config, "norm_should_tune", lambda x: True)
    monkeypatch.setattr(_config, "norm_candidates", lambda *a, **k: cfgs)
    monkeypatch.setattr(rms_mod, "_launch", launch)
    monkeypatch.setattr(_config, "_NORM_TUNED", {})
    x = _randn(9, 100, dtype=torch.float16, seed=3)
    w = _randn(100, dtype=torch.float16, seed=4)
    with pytest.warns(RuntimeWarning, match="dropped"), pytest.raises(RuntimeError, match="no candidate"):
        rms_norm(torch.empty_like(x), torch.empty(9), x, w, 1e-6)
    assert not _config._NORM_TUNED


def test_norm_check_bounds_accept_correct_results() -> None:
    # The torch op itself in the output dtype (an independent correct result) passes the check's bounds,
    # also for rows with a large mean (layer norm) and for an all-zero x (reference norm 0).

    for dtype in FLOATS:
        for shift in (0.0, 1e3):
            x = _randn(40, 700, dtype=dtype, seed=7, scale=3.0, shift=shift)
            w = _randn(700, dtype=dtype, seed=8)
            b = _randn(700, dtype=dtype, seed=9)
            for xx in (x, torch.zeros_like(x)):
                ref = torch.nn.functional.layer_norm(xx.float(), (700,), w.float(), b.float(), 1e-5)
                xd = xx.double()
                mean = xd.mean(-1).float()
                rstd = torch.rsqrt((xd - xd.mean(-1, keepdim=True)).square().mean(-1) + 1e-5).float()
                chk = _config.norm_check(
                    xx, (ref.to(dtype), mean, rstd), lambda xs, w=w, b=b: ln_mod._reference(xs, w, b, 1e-5),
                    mean_stat=(True, False),
                )  # fmt: skip
                assert chk.error() is None, (dtype, shift)
                rr = torch.rsqrt(xd.square().mean(-1) + 1e-6)
                y = (xd * rr[:, None] * w.double()).to(dtype)
                chk = _config.norm_check(xx, (y, rr.float()), lambda xs, w=w: rms_mod._reference(xs, w, 1e-6))
                assert chk.error() is None, (dtype, shift)


def test_norm_aot_covers_tuning_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    # Everything the H200 tuner (132 SMs, 60 MB L2, warp 32) may launch for bf16 must be compiled by the
    # aot session; aot_configs runs with the CPU's stand-in SM count, which filters less.

    for mod in (rms_mod, ln_mod):
        monkeypatch.setattr(_config, "is_interpreter", lambda: False)  # real step sizes, as the aot session
        aot = {n: set(mod.aot_configs(n, 2)) for n in mod.AOT_NS}
        aot_res = {n: set(mod.aot_configs(n, 2, res=True)) for n in mod.AOT_NS}
        monkeypatch.setattr(_config, "num_sms", lambda dev=0: 132)
        monkeypatch.setattr(_config, "l2_bytes", lambda dev=0: 60 << 20)
        for n in mod.AOT_NS:
            for m in (max(264, _config.NORM_TUNE_MIN_ELEMS // n), 32768):  # tuned sizes (no "split")
                first = _config.norm_default(m, n, 2, 0, mod.STREAM_BYTES, mod.STREAM_VECS)
                coop = _config.NORM_COOP_SETS[mod.__name__.rsplit(".", 1)[1]]
                ln = mod is ln_mod  # with layer_norm's "loop3" (FUSEKIT_NORM_LOOP3=0 leaves it out)
                cands = _config.norm_candidates(m, n, 2, 0, first, False, coop, loop3=ln)
                assert set(cands) <= aot[n], (mod.__name__, n, m, set(cands) - aot[n])
                cands = _config.norm_candidates(m, n, 2, 0, first, True, coop, loop3=ln)
                assert set(cands) <= aot_res[n], (mod.__name__, n, m, set(cands) - aot_res[n])
        monkeypatch.undo()


def test_layer_norm_loop3_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unless FUSEKIT_NORM_LOOP3=0, layer_norm (not rms_norm) also times "loop3" for rows of 16-64 KB without a
    fused residual, steps no longer than the row; the candidates of every other case are unchanged."""
    monkeypatch.setattr(_config, "is_interpreter", lambda: False)
    monkeypatch.setattr(_config, "num_sms", lambda dev=0: 132)
    monkeypatch.setattr(_config, "l2_bytes", lambda dev=0: 60 << 20)
    monkeypatch.setattr(_config, "warp_size", lambda dev=0: 32)

    def cands(n: int, es: int = 2, res: bool = False, loop3: bool = True) -> list[_config.NormConfig]:
        first = _config.norm_default(8192, n, es, 0, ln_mod.STREAM_BYTES, ln_mod.STREAM_VECS)
        return _config.norm_candidates(8192, n, es, 0, first, res, loop3=loop3)

    loop3 = [c for c in cands(32768) if c.mode == "loop3"]
    assert [(c.block, c.num_warps) for c in loop3] == [(2048, 16), (4096, 16), (8192, 32)]
    # 16 KB rows: steps <= 16 KB
    assert [c.block for c in cands(8192) if c.mode == "loop3"] == [2048, 4096, 8192]
    assert [c.block for c in cands(8192, es=4) if c.mode == "loop3"] == [1024, 2048, 4096]
    for n, es, res in ((4096, 2, False), (65536, 2, False), (16384, 2, True)):
        assert all(c.mode != "loop3" for c in cands(n, es, res)), (n, es, res)
    for n in (4096, 16384, 32768, 65536):
        assert [c for c in cands(n) if c.mode != "loop3"] == cands(n, loop3=False)
    monkeypatch.delenv(_config.NORM_LOOP3_ENV, raising=False)
    assert _config.norm_loop3()
    monkeypatch.setenv(_config.NORM_LOOP3_ENV, "0")
    assert not _config.norm_loop3()
    monkeypatch.setenv(_config.NORM_LOOP3_ENV, "1")
    assert _config.norm_loop3()


def test_norm_plan_thresholds() -> None:
    sms = _config.num_sms(0)
    assert _config.norm_plan(4096, _config.NORM_REG_MAX, 2, 0)[0] == "reg"
    assert _config.norm_plan(4 * sms, _config.NORM_REG_MAX + 1, 2, 0)[0] == "reload"
    mode, split = _config.norm_plan(1, 1 << 17, 2, 0)
    assert mode == "split" and split >= 2


def test_norm_default_plans_run() -> None:
    # the planner's own choice (interpreter: 4 SMs) for a short and a long row
    for M, N in [(9, 300), (2, _config.NORM_REG_MAX + 5)]:
        x = _randn(M, N, dtype=torch.float32, seed=M)
        w = _randn(N, dtype=torch.float32, seed=M + 1)
        out = torch.full_like(x, float("nan"))
        rstd = torch.full((M,), float("nan"))
        rms_norm(out, rstd, x, w, 1e-6)
        ref = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-6) * w.double()
        assert rel_error(out, ref) <= 1e-5


# ---------------------------------------------------------------------------------------------- rope
def _rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    xd = x.double()
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    D = x.shape[-1]
    if interleaved:
        a, b = xd[..., 0::2], xd[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    a, b = xd[..., : D // 2], xd[..., D // 2 :]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


# (interleaved, halves_as_pairs): the HF-halves layout has two code paths, the interleaved one has one.
ROPE_LAYOUTS = [(False, False), (False, True), (True, None)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("interleaved,halves_as_pairs", ROPE_LAYOUTS)
@pytest.mark.parametrize("tables", [False, True])
def test_rope_modes(
    dtype: torch.dtype, interleaved: bool, halves_as_pairs: bool | None, tables: bool
) -> None:
    B, S, H, D, start, theta = 2, 5, 3, 32, 7, 10000.0
    x = _randn(B, S, H, D, dtype=dtype, seed=D + S)
    pos = torch.arange(start, start + S, dtype=torch.float64)
    inv = theta ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    ang = pos[:, None] * inv[None, :]
    cos = sin = None
    if tables:  # St > start + S rows; the kernel must read rows start .. start + S - 1
        full = torch.arange(start + S + 4, dtype=torch.float64)[:, None] * inv[None, :]
        cos, sin = full.cos().float(), full.sin().float()
    out = torch.full_like(x, float("nan"))
    rope(out, None, x, cos, sin, None, None, start, theta, interleaved, _halves_as_pairs=halves_as_pairs)
    ref = _rope_ref(x, ang.cos(), ang.sin(), interleaved)
    assert rel_error(out, ref) <= TOL[dtype]


def test_rope_partial_head_block() -> None:
    # H not a multiple of BLOCK_H: masked heads in the last program
    x = _randn(1, 3, 5, 16, dtype=torch.float32, seed=1)
    out = torch.full_like(x, float("nan"))
    rope(out, None, x, None, None, None, None, 0, 500.0, False, _block_h=2)
    ang = torch.arange(3, dtype=torch.float64)[:, None] * 500.0 ** (-torch.arange(8, dtype=torch.float64) / 8)
    assert rel_error(out, _rope_ref(x, ang.cos(), ang.sin(), False)) <= 1e-5
    assert math.isfinite(out.sum().item())
