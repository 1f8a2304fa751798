"""The Mojo norm ops through MAX, straight through the mojo runtime (OpSpec -> OpCompiler -> Dispatcher).

fusekit.rms_norm / layer_norm (fused residual, weight dtype fp32 or x's, rms_norm casting modes) and
fusekit.rms_norm_backward / layer_norm_backward against float64 references of CONTRACT.md's formulas.
The MAX graphs are built here from `OpSpec`s that follow CONTRACT.md's "Mojo" section (outputs,
workspaces (specs.WORKSPACES, allocated by the dispatcher), inputs, params [scalars..., flags...],
optional tensors with their own dims, absent ones as 1-sized dummies), so the tests do not depend on
the Python provider layer.

Each (op, x dtype, w dtype) is one MAX graph compile (tens of seconds on a 2-core CPU), so every test
compiles one graph and loops over shapes and flags inside. The 9 graphs (about 30 s each here) give
every op fp32 (the tight tolerance that catches formula slips) and a half dtype, fp16 and bf16
activations, and weights in fp32 and in x's dtype. Dummies are NaN-filled: a kernel that read one
would put NaN into a checked output, and a dummy output that was written would lose its NaN.
"""

from __future__ import annotations

import pytest
import torch
from checks import assert_close

try:
    import max.engine  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"MAX is not importable: {exc}", allow_module_level=True)

from fusekit.backends.mojo.dispatch import Dispatcher
from fusekit.backends.mojo.runtime import OpCompiler
from fusekit.backends.mojo.specs import WORKSPACES, OpSpec, TensorSpec
from fusekit.tolerances import RTOL

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

TOL = RTOL  # fusekit.tolerances: the one table; gradients get GRAD_FACTOR (2x) of it
CASTING = {"fp32": 0, "llama": 1, "gemma": 2}
EPS = 1e-5
SHAPES = [(5, 1), (7, 33), (4, 760), (3, 4097)]  # odd N: scalar tails, unaligned rows, > 4096
NAN = float("nan")


def _ids(dtypes: tuple[torch.dtype, torch.dtype]) -> str:
    return "-".join(str(d).removeprefix("torch.") for d in dtypes)


def _t(name: str, dims: str, dtype: str) -> TensorSpec:
    return TensorSpec(name, tuple(dims.split()), dtype)


def _spec(
    op: str, outputs: tuple[TensorSpec, ...], inputs: tuple[TensorSpec, ...], params: tuple[str, ...]
) -> OpSpec:
    return OpSpec(
        op=op,
        max_op=f"fusekit.{op}",
        outputs=outputs,
        inputs=inputs,
        params=params,
        dtype_vars=("x", "w"),
        allowed=frozenset((x, w) for x in (F32, F16, BF16) for w in {x, F32}),
        bind=lambda *args: args,  # unused: the tests pass (outputs, inputs, params) themselves
        workspaces=WORKSPACES.get(
            f"fusekit.{op}", ()
        ),  # the backward's partials (the dispatcher allocates them)
    )


# CONTRACT.md "Mojo": every optional tensor has its own dims (an absent one is a [1]*rank dummy).
SPECS = {
    "rms_norm": _spec(
        "rms_norm",
        (_t("y", "M N", "x"), _t("h", "Mh Nh", "x"), _t("rstd", "M", "float32")),
        (_t("x", "M N", "x"), _t("residual", "Mr Nr", "x"), _t("weight", "N", "w")),
        ("eps", "casting", "has_residual"),
    ),
    "layer_norm": _spec(
        "layer_norm",
        (_t("y", "M N", "x"), _t("h", "Mh Nh", "x"), _t("mean", "M", "float32"), _t("rstd", "M", "float32")),
        (_t("x", "M N", "x"), _t("residual", "Mr Nr", "x"), _t("weight", "N", "w"), _t("bias", "Nb", "w")),
        ("eps", "has_residual", "has_bias"),
    ),
    "rms_norm_backward": _spec(
        "rms_norm_backward",
        (_t("dx", "M N", "x"), _t("dw", "N", "w")),
        (
            _t("dy", "M N", "x"),
            _t("dh", "Mh Nh", "x"),
            _t("xin", "M N", "x"),
            _t("weight", "N", "w"),
            _t("rstd", "M", "float32"),
        ),
        ("eps", "casting", "has_residual"),
    ),
    "layer_norm_backward": _spec(
        "layer_norm_backward",
        (_t("dx", "M N", "x"), _t("dw", "N", "w"), _t("db", "Nb", "w")),
        (
            _t("dy", "M N", "x"),
            _t("dh", "Mh Nh", "x"),
            _t("xin", "M N", "x"),
            _t("weight", "N", "w"),
            _t("mean", "M", "float32"),
            _t("rstd", "M", "float32"),
        ),
        ("eps", "has_residual", "has_bias"),
    ),
}


class Runner:
    """One compiled graph per (op, dtypes); calls write the given outputs in place."""

    def __init__(self) -> None:
        self.compiler = OpCompiler()
        self.dispatcher = Dispatcher()

    def __call__(self, op: str, dtypes: tuple[torch.dtype, torch.dtype], outs, ins, params) -> None:
        dev = outs[0].device
        compiled = self.compiler.get(SPECS[op], dtypes, dev)
        self.dispatcher.run(compiled, self.dispatcher.state(dev), tuple(outs), tuple(ins), tuple(params))


@pytest.fixture(scope="module")
def run() -> Runner:
    return Runner()


def _dummy(rank: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full((1,) * rank, NAN, dtype=dtype, device=device)


def _rx(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round_x of a float64 value (the reference's cast to x's dtype, back to float64)."""
    return t.to(dtype).to(torch.float64)


def _inputs(M: int, N: int, dtype: torch.dtype, wdtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, N, generator=g) + 0.5).to(dtype)  # nonzero mean: exercises two-pass variance
    res = torch.randn(M, N, generator=g).to(dtype)
    w = (torch.rand(N, generator=g) + 0.5).to(wdtype)
    b = (torch.rand(N, generator=g) - 0.5).to(wdtype)
    dy = torch.randn(M, N, generator=g).to(dtype)
    dh = torch.randn(M, N, generator=g).to(dtype)
    return [t.to(device) for t in (x, res, w, b, dy, dh)]


# --- float64 references of CONTRACT.md ---------------------------------------------------------------
def ref_rms(xin: torch.Tensor, w: torch.Tensor, casting: str, dtype: torch.dtype):
    xd, wd = xin.double(), w.double()
    rstd = torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS)
    if casting == "llama":
        y = _rx(xd * rstd, dtype) * wd
    elif casting == "gemma":
        y = xd * rstd * (1 + wd)
    else:
        y = xd * rstd * wd
    return y, rstd.squeeze(-1)


def ref_ln(xin: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
    xd = xin.double()
    mean = xd.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xd - mean).square().mean(-1, keepdim=True) + EPS)
    y = (xd - mean) * rstd * w.double()
    if b is not None:
        y = y + b.double()
    return y, mean.squeeze(-1), rstd.squeeze(-1)


def ref_rms_bwd(dy, dh, xin, w, rstd, casting: str, dtype: torch.dtype):
    """(dx, scale of dx's error, the terms dy * x̂ summed into dw). dx = rstd * g - rstd * x̂ * mean(g x̂)
    cancels where x̂² ≈ 1 (N = 1: dx ~ g eps / x²), so fp32 rounding is measured against rstd * g."""
    xh = xin.double() * rstd.double()[:, None]
    weff = 1 + w.double() if casting == "gemma" else w.double()
    g = dy.double() * weff
    dx = rstd.double()[:, None] * (g - xh * (g * xh).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.double()
    terms = dy.double() * (_rx(xh, dtype) if casting == "llama" else xh)
    return dx, rstd.double()[:, None] * g, terms


def ref_ln_bwd(dy, dh, xin, w, mean, rstd):
    xh = (xin.double() - mean.double()[:, None]) * rstd.double()[:, None]
    g = dy.double() * w.double()
    dx = rstd.double()[:, None] * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.double()
    return dx, rstd.double()[:, None] * g, dy.double() * xh


def _check_sum(name: str, got: torch.Tensor, terms: torch.Tensor, tol: float, repro: str) -> None:
    """A column sum over rows: the error is measured against the 2-norm of the summed terms. A fp32
    result (w dtype fp32) only carries fp32 accumulation error, so it gets a tight bound; a 16-bit one
    must also round like the float64 sum (see _check_rounding)."""
    scale = terms.square().sum(0).sqrt()
    ref = terms.sum(0)
    assert_close(name, got, ref, 1e-5 if got.dtype == F32 else tol, repro, scale=scale)
    _check_rounding(name, got, ref, repro)


def _check_rounding(name: str, got: torch.Tensor, ref: torch.Tensor, repro: str) -> None:
    """A 16-bit result must equal the float64 reference rounded to its dtype almost everywhere: the
    kernel's fp32 math is ~2^-24 off, so only values at a rounding boundary may flip. A wrong rounding
    step (e.g. "llama" casting without its intermediate round_x) is below the dtype's relative
    tolerance but flips a large fraction of the elements."""
    if got.dtype == F32 or got.numel() < 32:
        return
    frac = (got != ref.to(got.dtype)).double().mean().item()
    assert frac <= 0.02, f"{name}: {frac:.1%} of the elements are not the rounded reference [{repro}]"


# --- forward -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtypes", [(F32, F32), (F16, F16), (BF16, F32)], ids=_ids)
def test_rms_norm_forward(run: Runner, device: str, dtypes) -> None:
    dtype, wdtype = dtypes
    tol = TOL[dtype]
    for si, (M, N) in enumerate(SHAPES):
        x, res, w, _, _, _ = _inputs(M, N, dtype, wdtype, device, seed=100 + si)
        for casting in CASTING:
            for has_res in (False, True):
                repro = f"rms_norm M={M} N={N} {dtype}/{wdtype} casting={casting} residual={has_res}"
                y = torch.full((M, N), NAN, dtype=dtype, device=device)
                h = torch.full((M, N) if has_res else (1, 1), NAN, dtype=dtype, device=device)
                rstd = torch.full((M,), NAN, device=device)
                r_in = res if has_res else _dummy(2, dtype, device)
                params = (EPS, CASTING[casting], float(has_res))
                run("rms_norm", dtypes, (y, h, rstd), (x, r_in, w), params)
                xin = x + res if has_res else x  # torch rounds the fp32 sum once, as the contract does
                if has_res:
                    assert torch.equal(h, xin), f"h != round_x(x + residual) [{repro}]"
                else:
                    assert torch.isnan(h).all(), f"the h dummy was written [{repro}]"
                y_ref, rstd_ref = ref_rms(xin, w, casting, dtype)
                assert_close("y", y, y_ref, tol, repro)
                _check_rounding("y", y, y_ref, repro)
                assert_close("rstd", rstd, rstd_ref, 2e-5, repro)


@pytest.mark.parametrize("dtypes", [(F32, F32), (F16, F32)], ids=_ids)
def test_layer_norm_forward(run: Runner, device: str, dtypes) -> None:
    dtype, wdtype = dtypes
    tol = TOL[dtype]
    for si, (M, N) in enumerate(SHAPES):
        x, res, w, b, _, _ = _inputs(M, N, dtype, wdtype, device, seed=200 + si)
        for has_res in (False, True):
            for has_bias in (False, True):
                repro = f"layer_norm M={M} N={N} {dtype}/{wdtype} residual={has_res} bias={has_bias}"
                y = torch.full((M, N), NAN, dtype=dtype, device=device)
                h = torch.full((M, N) if has_res else (1, 1), NAN, dtype=dtype, device=device)
                mean = torch.full((M,), NAN, device=device)
                rstd = torch.full((M,), NAN, device=device)
                r_in = res if has_res else _dummy(2, dtype, device)
                b_in = b if has_bias else _dummy(1, wdtype, device)
                params = (EPS, float(has_res), float(has_bias))
                run("layer_norm", dtypes, (y, h, mean, rstd), (x, r_in, w, b_in), params)
                xin = x + res if has_res else x
                if has_res:
                    assert torch.equal(h, xin), f"h != round_x(x + residual) [{repro}]"
                else:
                    assert torch.isnan(h).all(), f"the h dummy was written [{repro}]"
                y_ref, mean_ref, rstd_ref = ref_ln(xin, w, b if has_bias else None)
                assert_close("y", y, y_ref, tol, repro)
                _check_rounding("y", y, y_ref, repro)
                assert_close("mean", mean, mean_ref, 2e-5, repro, scale=xin.double().abs().mean(-1))
                assert_close("rstd", rstd, rstd_ref, 2e-5, repro)


# --- backward ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16)], ids=_ids)
def test_rms_norm_backward(run: Runner, device: str, dtypes) -> None:
    dtype, wdtype = dtypes
    tol = 2 * TOL[dtype]
    for si, (M, N) in enumerate(SHAPES):
        xin, _, w, _, dy, dh = _inputs(M, N, dtype, wdtype, device, seed=300 + si)
        rstd = ref_rms(xin, w, "fp32", dtype)[1].float()
        for casting in CASTING:
            for has_res in (False, True):
                repro = f"rms_norm_backward M={M} N={N} {dtype}/{wdtype} casting={casting} residual={has_res}"
                dx = torch.full((M, N), NAN, dtype=dtype, device=device)
                dw = torch.full((N,), NAN, dtype=wdtype, device=device)
                dh_in = dh if has_res else _dummy(2, dtype, device)
                params = (EPS, CASTING[casting], float(has_res))
                run("rms_norm_backward", dtypes, (dx, dw), (dy, dh_in, xin, w, rstd), params)
                dx_ref, dx_scale, terms = ref_rms_bwd(
                    dy, dh if has_res else None, xin, w, rstd, casting, dtype
                )
                assert_close("dx", dx, dx_ref, tol, repro, scale=dx_scale)
                _check_sum("dw", dw, terms, tol, repro)
                if casting == "fp32" and has_res:  # deterministic: a second run is bit-identical
                    dx2, dw2 = torch.full_like(dx, NAN), torch.full_like(dw, NAN)
                    run("rms_norm_backward", dtypes, (dx2, dw2), (dy, dh_in, xin, w, rstd), params)
                    assert torch.equal(dx, dx2) and torch.equal(dw, dw2), f"not deterministic [{repro}]"


@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, F32)], ids=_ids)
def test_layer_norm_backward(run: Runner, device: str, dtypes) -> None:
    dtype, wdtype = dtypes
    tol = 2 * TOL[dtype]
    for si, (M, N) in enumerate(SHAPES):
        xin, _, w, _, dy, dh = _inputs(M, N, dtype, wdtype, device, seed=400 + si)
        _, mean, rstd = ref_ln(xin, w, None)
        mean, rstd = mean.float(), rstd.float()
        for has_res in (False, True):
            for has_bias in (False, True):
                repro = f"layer_norm_backward M={M} N={N} {dtype}/{wdtype} residual={has_res} bias={has_bias}"
                dx = torch.full((M, N), NAN, dtype=dtype, device=device)
                dw = torch.full((N,), NAN, dtype=wdtype, device=device)
                db = torch.full((N,) if has_bias else (1,), NAN, dtype=wdtype, device=device)
                dh_in = dh if has_res else _dummy(2, dtype, device)
                params = (EPS, float(has_res), float(has_bias))
                run("layer_norm_backward", dtypes, (dx, dw, db), (dy, dh_in, xin, w, mean, rstd), params)
                dx_ref, dx_scale, terms = ref_ln_bwd(dy, dh if has_res else None, xin, w, mean, rstd)
                assert_close("dx", dx, dx_ref, tol, repro, scale=dx_scale)
                _check_sum("dw", dw, terms, tol, repro)
                if has_bias:
                    _check_sum("db", db, dy.double(), tol, repro)
                else:
                    assert torch.isnan(db).all(), f"the db dummy was written [{repro}]"
                if has_res and has_bias:
                    dx2, dw2, db2 = (torch.full_like(t, NAN) for t in (dx, dw, db))
                    run(
                        "layer_norm_backward",
                        dtypes,
                        (dx2, dw2, db2),
                        (dy, dh_in, xin, w, mean, rstd),
                        params,
                    )
                    assert torch.equal(dx, dx2) and torch.equal(dw, dw2) and torch.equal(db, db2), (
                        f"not deterministic [{repro}]"
                    )
