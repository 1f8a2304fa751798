"""Mojo rope / reduce_sum / attention kernels (forward + backward) through MAX on the CPU (issue #16).

The ops run through the mojo runtime directly (OpSpec -> OpCompiler -> Dispatcher) with the
argument layout of .dev/CONTRACT.md ("Mojo" section), independent of the Python provider:

- fusekit.rope / rope_backward: (y | dx [B,S,H,D]) <- (x | dy, cos?, sin?, positions?), params
  [start_pos, theta, interleaved, has_tables, has_positions] (positions absent here: an int32 dummy); compared with a float64 rotation by the kernel's
  fp32 angle (f32(pos) * f32(exp(f32(i) * f32(-2 ln(theta) / D)))), incl. start_pos = 2^24 - S and
  thetas (1e-30, 1e-38, 3e38) that used to hang or give NaN; those run in a subprocess with a
  timeout, so a hang fails one test instead of the suite.
- fusekit.reduce_sum_backward: dx [M, N] <- dout [M].
- fusekit.attention: (o, lse) <- (q, k, v, kv_len?), params [causal, scale, has_kv_len] (kv_len absent
  here: an int32 dummy; tests/test_mojo_kv_len.py and the conformance cases cover it); a float64 softmax over the
  visible keys, incl. NaN/Inf inputs, GQA, causal with S < Skv and S > Skv (rows with no visible key).
- fusekit.attention_backward: (dq, dk, dv), workspace delta <- (do, q, k, v, o, lse, kv_len?) vs float64
  autograd.
- swiglu_ffn backward (issue #10) through the provider (`swiglu_ffn(..., backend="mojo")`: the training
  forward saving gu, torch GEMMs + fusekit.swiglu_ffn_backward + fusekit.rms_norm_backward) vs float64
  autograd, with and without the norm weight, in fp32 / fp16 / bf16.

MAX CPU graph compiles are slow (~10-40 s each), so there are few distinct (op, dtype) specs; they
are cached on disk (FUSEKIT_CACHE_DIR), so a second run takes seconds.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import rel_error

try:
    import max.engine  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"MAX is not importable: {exc}", allow_module_level=True)

from fusekit.backends.mojo.dispatch import Dispatcher
from fusekit.backends.mojo.runtime import OpCompiler
from fusekit.backends.mojo.specs import WORKSPACES, OpSpec, TensorSpec
from fusekit.ops.swiglu_ffn import swiglu_ffn
from fusekit.tolerances import rtol

CPU = torch.device("cpu")
TESTS_DIR = Path(__file__).resolve().parent
PYTHON_DIR = TESTS_DIR.parent / "python"
NAN = float("nan")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
NO_POSITIONS = torch.zeros(1, 1, dtype=torch.int32)  # absent optional int32 inputs: dummies, flag 0
NO_KV_LEN = torch.zeros(1, dtype=torch.int32)


def _ts(name: str, dims: str, dtype: str) -> TensorSpec:
    return TensorSpec(name, tuple(dims.split()), dtype)


def _bind(*args: object) -> tuple:
    raise NotImplementedError  # the tests call the runtime with (outs, ins, params) directly


def _rope_spec(op: str) -> OpSpec:
    y = "y" if op == "rope" else "dx"
    x = "x" if op == "rope" else "dy"
    return OpSpec(
        op=op,
        max_op=f"fusekit.{op}",
        # optional tensors: their own dim names (a [1, 1] / [1, 1, 1, 1] dummy where they are absent)
        outputs=(_ts(y, "B S H D", "x"), _ts(f"{y}k", "Bk Sk Hk Dk", "x")),
        inputs=(
            _ts(x, "B S H D", "x"),
            _ts("cos", "St Dh", "float32"),
            _ts("sin", "St Dh", "float32"),
            _ts("positions", "Bp Sp", "int32"),
            _ts(f"{x}k", "Bk Sk Hk Dk", "x"),
        ),
        params=("start_pos", "theta", "interleaved", "has_tables", "has_positions"),
        dtype_vars=("x",),
        allowed=frozenset((d,) for d in FLOATS),
        bind=_bind,
    )


ROPE = _rope_spec("rope")
ROPE_BWD = _rope_spec("rope_backward")
REDUCE_SUM_BWD = OpSpec(
    op="reduce_sum_backward",
    max_op="fusekit.reduce_sum_backward",
    outputs=(_ts("dx", "M N", "x"),),
    inputs=(_ts("dout", "M", "out"),),
    params=(),
    dtype_vars=("x", "out"),
    allowed=frozenset((a, b) for a in FLOATS for b in FLOATS),
    bind=_bind,
)
ATTENTION = OpSpec(
    op="attention",
    max_op="fusekit.attention",
    outputs=(_ts("o", "B H S D", "x"), _ts("lse", "B H S", "float32")),
    inputs=(
        _ts("q", "B H S D", "x"),
        _ts("k", "B Hkv Skv D", "x"),
        _ts("v", "B Hkv Skv D", "x"),
        _ts("kv_len", "Bk", "int32"),
    ),
    params=("causal", "scale", "has_kv_len"),
    dtype_vars=("x",),
    allowed=frozenset((d,) for d in FLOATS),
    bind=_bind,
    workspaces=WORKSPACES["fusekit.attention"],  # part (the GPU decode kernels' partials; a dummy on the CPU)
)
ATTENTION_BWD = OpSpec(
    op="attention_backward",
    max_op="fusekit.attention_backward",
    outputs=(_ts("dq", "B H S D", "x"), _ts("dk", "B Hkv Skv D", "x"), _ts("dv", "B Hkv Skv D", "x")),
    inputs=(
        _ts("do", "B H S D", "x"),
        _ts("q", "B H S D", "x"),
        _ts("k", "B Hkv Skv D", "x"),
        _ts("v", "B Hkv Skv D", "x"),
        _ts("o", "B H S D", "x"),
        _ts("lse", "B H S", "float32"),
        _ts("kv_len", "Bk", "int32"),
    ),
    params=("causal", "scale", "has_kv_len"),
    dtype_vars=("x",),
    allowed=frozenset((d,) for d in FLOATS),
    bind=_bind,
    workspaces=WORKSPACES["fusekit.attention_backward"],  # delta, allocated by the dispatcher
)


class Runner:
    """One OpCompiler + Dispatcher for the module (each (op, dtypes) compiles once, then is cached)."""

    def __init__(self) -> None:
        self.compiler = OpCompiler()  # the repo's mojo/ package (or $FUSEKIT_MOJO_PACKAGE)
        self.dispatcher = Dispatcher()

    def __call__(self, spec: OpSpec, outs: tuple, ins: tuple, params: tuple = ()) -> None:
        compiled = self.compiler.get(spec, spec.dtype_key(outs, ins), CPU)
        self.dispatcher.run(compiled, self.dispatcher.state(CPU), outs, ins, tuple(float(p) for p in params))


_RUNNER: Runner | None = None


@pytest.fixture(scope="module")
def run() -> Runner:
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = Runner()
    return _RUNNER


# --- rope ------------------------------------------------------------------------------------------
def rope_angles_f32(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """The kernels' fp32 angles [P, D/2]: f32(pos) * f32(exp(i * c)), c = -2 ln(theta) / D, exp in float64
    rounded once (fusekit.ops.rope.inv_freq, every backend's inv_freq).

    theta is rounded to fp32 first, as the kernel receives it: at extreme thetas (angles ~1e36 rad)
    one ulp of c changes every angle, so the reference must start from the same fp32 theta."""
    theta32 = torch.tensor(theta, dtype=torch.float32).item()  # the kernel gets theta as fp32 params
    c = -2.0 * math.log(theta32) / head_dim
    inv = torch.tensor([math.exp(i * c) for i in range(head_dim // 2)], dtype=torch.float64).to(torch.float32)
    return positions.to(torch.float32)[:, None] * inv[None, :]


def _cos_sin_f64(ang: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin in float64 of fp32 angles through libm (exact range reduction for any double)."""
    flat = ang.to(torch.float64).flatten().tolist()
    cos = torch.tensor([math.cos(a) for a in flat], dtype=torch.float64).view(ang.shape)
    sin = torch.tensor([math.sin(a) for a in flat], dtype=torch.float64).view(ang.shape)
    return cos, sin


def rope_ref64(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    backward: bool,
) -> torch.Tensor:
    """float64 rotation of x [B, S, H, D] by cos/sin [S, D/2] (the negative angle when backward)."""
    D = x.shape[-1]
    c = cos.to(torch.float64)[None, :, None, :]
    s = sin.to(torch.float64)[None, :, None, :]
    if backward:
        s = -s
    xf = x.to(torch.float64)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    a, b = xf[..., : D // 2], xf[..., D // 2 :]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)


ROPE_TOL = {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rope_call(
    run: Runner,
    x: torch.Tensor,
    start_pos: int,
    theta: float,
    interleaved: bool,
    tables: tuple[torch.Tensor, torch.Tensor] | None,
    backward: bool,
) -> torch.Tensor:
    out = torch.full_like(x, NAN)
    # absent tables: [1, 1] dummies (their own symbolic dims), has_tables = 0
    cos, sin = tables if tables is not None else (torch.zeros(1, 1), torch.zeros(1, 1))
    params = (start_pos, theta, float(interleaved), float(tables is not None), 0.0)
    no_k = torch.zeros(1, 1, 1, 1, dtype=x.dtype)
    run(ROPE_BWD if backward else ROPE, (out, no_k), (x, cos, sin, NO_POSITIONS, no_k), params)
    return out


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("start_pos", [0, 13, (1 << 24) - 9])
def test_rope_in_kernel_angles(run: Runner, backward: bool, interleaved: bool, start_pos: int) -> None:
    torch.manual_seed(start_pos + 2 * interleaved + backward)
    B, S, H, D, theta = 2, 9, 3, 128, 10000.0
    x = torch.randn(B, S, H, D)
    pos = torch.arange(start_pos, start_pos + S)
    cos, sin = _cos_sin_f64(rope_angles_f32(pos, D, theta))
    out = _rope_call(run, x, start_pos, theta, interleaved, None, backward)
    ref = rope_ref64(x, cos, sin, interleaved, backward)
    err = rel_error(out, ref)
    assert err < ROPE_TOL[torch.float32], f"rope err {err:.2e} (start_pos={start_pos})"


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_rope_tables(run: Runner, backward: bool, interleaved: bool) -> None:
    torch.manual_seed(7 + interleaved + 2 * backward)
    B, S, H, D, start_pos = 3, 5, 2, 6, 4
    x = torch.randn(B, S, H, D)
    st = start_pos + S + 3  # the table may be longer than needed
    cos, sin = torch.randn(st, D // 2), torch.randn(st, D // 2)  # any values: checks the indexing
    out = _rope_call(run, x, start_pos, 10000.0, interleaved, (cos, sin), backward)
    ref = rope_ref64(x, cos[start_pos : start_pos + S], sin[start_pos : start_pos + S], interleaved, backward)
    assert rel_error(out, ref) < ROPE_TOL[torch.float32]


def test_rope_backward_is_the_transpose(run: Runner) -> None:
    """<rope(x), dy> == <x, rope_backward(dy)> (the backward is the adjoint of the forward)."""
    torch.manual_seed(3)
    x, dy = torch.randn(2, 7, 3, 64), torch.randn(2, 7, 3, 64)
    y = _rope_call(run, x, 5, 500000.0, False, None, False)
    dx = _rope_call(run, dy, 5, 500000.0, False, None, True)
    lhs = (y.double() * dy.double()).sum().item()
    rhs = (x.double() * dx.double()).sum().item()
    assert abs(lhs - rhs) <= 1e-5 * (x.double().norm() * dy.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_rope_backward_low_precision(run: Runner, dtype: torch.dtype) -> None:
    torch.manual_seed(11)
    B, S, H, D, start_pos, theta = 1, 37, 2, 64, 100, 10000.0
    x = torch.randn(B, S, H, D).to(dtype)
    cos, sin = _cos_sin_f64(rope_angles_f32(torch.arange(start_pos, start_pos + S), D, theta))
    for inter in (False, True):
        out = _rope_call(run, x, start_pos, theta, inter, None, True)
        assert out.dtype == dtype
        assert rel_error(out, rope_ref64(x, cos, sin, inter, True)) < 2 * ROPE_TOL[dtype]


# Extreme thetas (issue #16): each must finish (a hang fails after the timeout) with the values below.
_EXTREME = [
    # (theta, start_pos, S, expect): finite angles up to ~5.7e36 (1e-30 at positions near 2^24),
    # inv_freq ~2.5e37 (1e-38), inv_freq ~1e-38 (3e38); inf / 0 in fp32 give NaN, never a hang
    (1e-30, (1 << 24) - 9, 9, "finite"),
    (1e-38, 0, 9, "finite"),
    (3e38, 13, 9, "finite"),
    (1e39, 0, 4, "nan"),  # inf in fp32
    (1e-46, 0, 4, "nan"),  # 0 in fp32
]


def _extreme_child(out_path: str) -> None:
    """Runs in a subprocess: every _EXTREME case forward and backward; saves the outputs."""
    run = Runner()
    torch.manual_seed(5)
    res = []
    for theta, start_pos, S, _ in _EXTREME:
        x = torch.randn(1, S, 2, 128)
        res.append(
            (
                x,
                *(
                    _rope_call(run, x, start_pos, theta, inter, None, bwd)
                    for inter in (False, True)
                    for bwd in (False, True)
                ),
            )
        )
    torch.save(res, out_path)


def test_rope_extreme_theta_finishes(run: Runner, tmp_path: Path) -> None:
    _rope_call(run, torch.randn(1, 1, 1, 4), 0, 1e4, False, None, False)  # compile here, not in the child
    _rope_call(run, torch.randn(1, 1, 1, 4), 0, 1e4, False, None, True)
    out_path = tmp_path / "extreme.pt"
    code = f"import sys; sys.path[:0] = [{str(TESTS_DIR)!r}]; import test_mojo_grad_misc as t; t._extreme_child({str(out_path)!r})"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PYTHON_DIR), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
    except subprocess.TimeoutExpired:
        pytest.fail("rope with an extreme theta did not finish in 300 s (a hang: issue #16)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(out_path)
    for (theta, start_pos, S, expect), (x, *outs) in zip(_EXTREME, results, strict=True):
        ang = rope_angles_f32(
            torch.arange(start_pos, start_pos + S), 128, theta if expect == "finite" else 1.0
        )
        cos, sin = _cos_sin_f64(ang)
        for (inter, bwd), out in zip(
            [(i, b) for i in (False, True) for b in (False, True)], outs, strict=True
        ):
            what = f"theta={theta} start_pos={start_pos} interleaved={inter} backward={bwd}"
            if expect == "nan":
                assert torch.isnan(out).all(), f"{what}: expected NaN everywhere (invalid theta)"
                continue
            assert torch.isfinite(ang).all()
            assert torch.isfinite(out).all(), f"{what}: non-finite output"
            err = rel_error(out, rope_ref64(x, cos, sin, inter, bwd))
            assert err < ROPE_TOL[torch.float32], f"{what}: rel err {err:.2e}"


# --- reduce_sum backward ---------------------------------------------------------------------------
# one (x, out) pair: the kernel is dtype-generic, and bf16 <- f32 also checks the one rounding of dout
@pytest.mark.parametrize(("x_dtype", "out_dtype"), [(torch.bfloat16, torch.float32)], ids=["bf16-f32"])
def test_reduce_sum_backward(run: Runner, x_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    for M, N in [(37, 33), (1, 4097), (5, 760), (3, 1), (9, 7)]:
        dout = torch.randn(M).to(out_dtype)
        dx = torch.full((M, N), NAN, dtype=x_dtype)
        run(REDUCE_SUM_BWD, (dx,), (dout,))
        ref = dout.to(x_dtype)[:, None].expand(M, N)  # one rounding of dout to x's dtype, exact
        assert torch.equal(dx, ref), f"M={M} N={N}"


# --- attention ---------------------------------------------------------------------------------------
def attention_ref64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax over the VISIBLE keys only (a masked key never contributes, not even 0 * NaN).

    o [B, H, S, D], lse [B, H, S]; rows with no visible key: o = 0, lse = -inf. A NaN score makes the
    row NaN; +inf / all -inf make o NaN (inf - inf), lse = torch.logsumexp (+inf / -inf).
    """
    H, S = q.shape[1], q.shape[2]
    Hkv, Skv = k.shape[1], k.shape[2]
    g = H // Hkv
    qf = q.double()
    kf = k.double().repeat_interleave(g, dim=1)
    vf = v.double().repeat_interleave(g, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale  # [B, H, S, Skv]
    i = torch.arange(S)[:, None]
    j = torch.arange(Skv)[None, :]
    vis = (j <= i + (Skv - S)) if causal else torch.ones(S, Skv, dtype=torch.bool)
    has = vis.any(-1)[:, None]  # [S, 1]
    # masked scores never enter (NaN-free even for a NaN in a masked key); rows with no visible key
    # get dummy scores 0 and a denominator of 1 (no NaN, also not in autograd), then o = 0, lse = -inf
    s = torch.where(has, s.masked_fill(~vis, float("-inf")), 0.0)
    m = s.amax(-1, keepdim=True).detach()  # NaN-propagating; softmax does not depend on it
    p = torch.exp(s - m).masked_fill(~vis, 0.0)
    p = p / torch.where(has, p.sum(-1, keepdim=True), 1.0)
    # o = sum over visible j only: a NaN/Inf in a masked v row must not reach the row
    vv = torch.where(vis[None, None, :, :, None], vf[:, :, None, :, :], 0.0)  # [B, H, S, Skv, D]
    o = (p[..., None] * vv).sum(-2)
    o = torch.where(has[None, None], o, 0.0)
    lse = torch.where(has[None, None, :, 0], torch.logsumexp(s, -1), float("-inf"))
    return o, lse


def _attention(run: Runner, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, S = q.shape[:3]
    o = torch.full_like(q, NAN)
    lse = torch.full((B, H, S), NAN)
    run(ATTENTION, (o, lse), (q, k, v, NO_KV_LEN), (float(causal), scale, 0.0))
    return o, lse


def _check_same_nonfinite(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Same NaN pattern, same +-inf, and the finite part within tol (relative 2-norm)."""
    g, r = got.double(), ref.double()
    assert torch.equal(torch.isnan(g), torch.isnan(r)), (
        f"{name}: NaN pattern differs: {int(torch.isnan(g).sum())} NaN vs {int(torch.isnan(r).sum())} expected"
    )
    inf_r = torch.isinf(r)
    assert torch.equal(torch.isinf(g), inf_r) and torch.equal(g[inf_r], r[inf_r]), f"{name}: +-inf differ"
    fin = torch.isfinite(r)
    if fin.any():
        err = rel_error(g[fin], r[fin])
        assert err < tol, f"{name}: rel err {err:.2e} on the finite part"


ATTN_TOL = 2e-5  # fp32


@pytest.mark.parametrize(
    ("S", "Skv", "causal"),
    [(37, 45, False), (37, 45, True), (45, 37, True), (1, 53, True)],
    ids=["S<Skv", "S<Skv-causal", "S>Skv-causal", "decode-causal"],
)
def test_attention_forward(run: Runner, S: int, Skv: int, causal: bool) -> None:
    torch.manual_seed(S * 100 + Skv + causal)
    B, H, Hkv, D = 2, 4, 2, 64
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hkv, Skv, D), torch.randn(B, Hkv, Skv, D)
    scale = 2.0 / math.sqrt(D)  # a peakier softmax than 1/sqrt(D)
    o, lse = _attention(run, q, k, v, causal, scale)
    ro, rlse = attention_ref64(q, k, v, causal, scale)
    _check_same_nonfinite("o", o, ro, ATTN_TOL)
    _check_same_nonfinite("lse", lse, rlse, ATTN_TOL)
    if causal and Skv < S:  # the first S - Skv rows see no key
        assert (o[:, :, : S - Skv] == 0).all() and (lse[:, :, : S - Skv] == float("-inf")).all()


def _nan_cases() -> list[tuple[str, bool]]:
    return [
        ("q_nan_row", False),
        ("q_nan_row", True),
        ("k_nan_key", False),
        ("k_nan_key", True),
        ("v_nan", True),
        ("v_inf", True),
        ("k_inf", True),
        ("masked_only", True),
    ]


@pytest.mark.parametrize(
    ("case", "causal"), _nan_cases(), ids=[f"{c}-{'causal' if k else 'full'}" for c, k in _nan_cases()]
)
def test_attention_nonfinite(run: Runner, case: str, causal: bool) -> None:
    """NaN/Inf reach exactly the rows a float64 softmax over the visible keys sends them to."""
    torch.manual_seed(sum(map(ord, case)) + causal)
    B, H, Hkv, S, Skv, D = 1, 2, 1, 9, 13, 64  # off = 4: row i sees keys 0 .. i + 4
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hkv, Skv, D), torch.randn(B, Hkv, Skv, D)
    if case == "q_nan_row":
        q[0, 1, 3, 7] = NAN
    elif case == "k_nan_key":
        k[0, 0, 6, 10] = NAN  # causal: rows 2.. see key 6, rows 0, 1 do not
    elif case == "v_nan":
        v[0, 0, 6, 5] = NAN
    elif case == "v_inf":
        v[0, 0, 6, 5] = float("inf")
        v[0, 0, 9, 2] = float("-inf")
    elif case == "k_inf":
        k[0, 0, 6, 10] = float("inf")
    elif case == "masked_only":  # key 12 is seen by the last row only; keys of rows 0.. masked
        k[0, 0, 12, 3] = NAN
        v[0, 0, 12, 4] = NAN
        v[0, 0, 11, 4] = float("inf")
    o, lse = _attention(run, q, k, v, causal, 1.0 / math.sqrt(D))
    ro, rlse = attention_ref64(q, k, v, causal, 1.0 / math.sqrt(D))
    assert not torch.isfinite(ro).all() or case == "none", "the case should produce non-finite values"
    _check_same_nonfinite(f"{case} o", o, ro, ATTN_TOL)
    _check_same_nonfinite(f"{case} lse", lse, rlse, ATTN_TOL)
    if causal:  # under the mask some rows never see the bad key: they stay finite
        assert torch.isfinite(o).any(), "rows that do not see the bad values stay finite"


def attention_grads_ref64(q, k, v, do, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    o, _ = attention_ref64(qd, kd, vd, causal, scale)
    o.backward(do.double())
    return qd.grad, kd.grad, vd.grad


@pytest.mark.parametrize(
    ("H", "Hkv", "S", "Skv", "causal"),
    [(4, 2, 37, 45, False), (4, 2, 37, 45, True), (2, 1, 45, 37, True), (3, 3, 9, 9, True)],
    ids=["gqa", "gqa-causal", "S>Skv-causal", "mha-causal"],
)
def test_attention_backward(run: Runner, H: int, Hkv: int, S: int, Skv: int, causal: bool) -> None:
    torch.manual_seed(H * 1000 + S + causal)
    B, D = 2, 64
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hkv, Skv, D), torch.randn(B, Hkv, Skv, D)
    do = torch.randn(B, H, S, D)
    scale = 1.5 / math.sqrt(D)
    o, lse = _attention(run, q, k, v, causal, scale)
    grads = tuple(torch.full_like(t, NAN) for t in (q, k, v))
    run(ATTENTION_BWD, grads, (do, q, k, v, o, lse, NO_KV_LEN), (float(causal), scale, 0.0))
    refs = attention_grads_ref64(q, k, v, do, causal, scale)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs, strict=True):
        err = rel_error(g, r)
        assert err < 2 * ATTN_TOL, f"{name}: rel err {err:.2e}"
    # deterministic: a second call gives bit-identical gradients
    again = tuple(torch.full_like(t, NAN) for t in (q, k, v))
    run(ATTENTION_BWD, again, (do, q, k, v, o, lse, NO_KV_LEN), (float(causal), scale, 0.0))
    for g, g2 in zip(grads, again, strict=True):
        assert torch.equal(g, g2)


# --- swiglu_ffn backward -----------------------------------------------------------------------------
def swiglu_ref64(x, wg, wu, wd, nw, eps: float) -> torch.Tensor:
    """float64 swiglu_ffn (no intermediate rounding): the autograd oracle of the gradients."""
    if nw is not None:
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * nw
    g, u = x @ wg.T, x @ wu.T
    return (g * torch.sigmoid(g) * u) @ wd.T


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("dtype", FLOATS, ids=["fp32", "fp16", "bf16"])
def test_swiglu_ffn_backward(dtype: torch.dtype, norm: bool) -> None:
    torch.manual_seed(17 + 2 * FLOATS.index(dtype) + norm)
    T, D, F, eps = 9, 64, 72, 1e-6
    args = [
        torch.randn(T, D),
        torch.randn(F, D) * D**-0.5,
        torch.randn(F, D) * D**-0.5,
        torch.randn(D, F) * F**-0.5,
    ]
    if norm:
        args.append(1.0 + 0.1 * torch.randn(D))
    args = [a.to(dtype) for a in args]
    leaves = [a.clone().requires_grad_() for a in args]
    nw = leaves[4] if norm else None
    y = swiglu_ffn(*leaves[:4], norm_weight=nw, eps=eps, backend="mojo")
    # the training forward (which also writes gu) gives the inference forward's output, bit for bit
    with torch.no_grad():
        y0 = swiglu_ffn(*args[:4], norm_weight=args[4] if norm else None, eps=eps, backend="mojo")
    assert torch.equal(y.detach(), y0)
    dy = torch.randn(T, D).to(dtype)
    grads = torch.autograd.grad(y, leaves, dy)
    ref = [a.double().requires_grad_() for a in args]
    want = torch.autograd.grad(swiglu_ref64(*ref[:4], ref[4] if norm else None, eps), ref, dy.double())
    tol = rtol("swiglu_ffn", dtype, "backward")
    names = ("dx", "dw_gate", "dw_up", "dw_down", "dnorm_weight")
    for name, a, g, w in zip(names, args, grads, want, strict=False):
        assert g.dtype == a.dtype and g.shape == a.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        # O(1) gradients per element: the floor keeps a near-zero gradient from reading as a huge error
        floor = torch.full((1,), 0.1 * w.numel() ** 0.5, dtype=torch.float64)
        err = rel_error(g, w, floor)
        assert err < tol, f"{name} ({dtype}, norm={norm}): rel err {err:.2e} > {tol:.1e}"
