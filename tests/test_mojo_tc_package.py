"""The tensor-core swiglu op lives in a lazy subpackage (issue #14 item 3: any op's first call <= 20 s).

`from linalg.matmul.gpu import _matmul_gpu` alone made the op package's `mojo precompile`, which every
op's first call in a fresh process pays, 7 s instead of 3 s on a 2-core CPU. Only fusekit.swiglu_ffn_tc
needs it, so it lives in mojo/tc/, precompiled into a .mojoc of its own when a call is first routed there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("max.engine", reason="MAX is not importable")

from fusekit import backends
from fusekit.backends.mojo import MojoBackend, specs
from fusekit.backends.mojo import runtime as rt

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "mojo"
_T, _D, _F = 20, 32, 48  # a swiglu_ffn case small enough for the CPU


def _ffn_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """x, w_gate, w_up, w_down, norm_weight of a small fp32 swiglu_ffn call."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(_T, _D, generator=g),
        torch.randn(_F, _D, generator=g) * 0.1,
        torch.randn(_F, _D, generator=g) * 0.1,
        torch.randn(_D, _F, generator=g) * 0.1,
        torch.rand(_D, generator=g) + 0.5,
    )


def _run_cpu(be: MojoBackend, ms: specs.OpSpec, ins: tuple) -> tuple[torch.Tensor, ...]:
    """The MAX op `ms` on the CPU: (y, rstd, gu), NaN-poisoned before the call."""
    outs = (
        torch.full((_T, _D), float("nan")),
        torch.full((_T,), float("nan")),
        torch.full((_T, 2 * _F), float("nan")),
    )
    be._call(ms, torch.device("cpu"), outs, ins, (1e-6,))
    return outs


def test_op_package_does_not_import_linalg_or_the_subpackage() -> None:
    """No top-level file of the op package imports linalg (its matmuls) or the lazy subpackage: either
    would bring the cost back into every op's first call."""
    for f in rt.package_files(PKG):
        text = f.read_text()
        assert not re.search(r"^\s*(from|import)\s+linalg\b", text, re.MULTILINE), f.name
        assert not re.search(r"^\s*from\s+\.(tc)\b", text, re.MULTILINE), f.name
    assert "_matmul_gpu" in (PKG / "tc" / "swiglu_ffn_tc.mojo").read_text()


def test_subpackage_compiles_only_what_it_imports() -> None:
    ops = rt.registered_ops(PKG)
    assert ops[specs.SWIGLU_FFN_TC_OP] == "tc"
    assert ops["fusekit.swiglu_ffn"] == "swiglu_ffn" and ops["fusekit.rms_norm"] == "rms_norm"
    names = {f.relative_to(PKG).as_posix() for f in rt.unit_files(PKG, "tc")}
    assert {"__init__.mojo", "swiglu_ffn.mojo", "_util.mojo", "_swiglu_backward.mojo"} <= names
    assert {"tc/__init__.mojo", "tc/swiglu_ffn_tc.mojo"} <= names
    assert "attention.mojo" not in names  # not imported by the tc op: an edit there keeps its models
    assert rt.package_hash(PKG, "tc") != rt.package_hash(PKG)


def test_tc_package_is_built_on_first_use_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh cache: fusekit.swiglu_ffn builds its own unit only; the first fusekit.swiglu_ffn_tc call
    builds the subpackage (its own .mojoc and MEF dir) and computes what the plain op does on the CPU."""
    monkeypatch.setenv(rt.CACHE_ENV, str(tmp_path))
    be = MojoBackend()
    comp = be.compiler
    assert specs.SWIGLU_FFN_TC_OP in be.registered()
    ins = _ffn_inputs(7)
    plain = _run_cpu(be, specs.phase_spec("swiglu_ffn", "forward"), ins)
    digest = comp.digest_of("swiglu_ffn")
    assert comp.stats.precompiles == 1 and list(comp._libraries) == ["swiglu_ffn"]
    assert [p.name for p in tmp_path.glob("fusekit_*.mojoc")] == [f"fusekit_swiglu_ffn_{digest}.mojoc"]

    tc = _run_cpu(be, specs.swiglu_ffn_tc_spec(), ins)
    tc_digest = rt.package_hash(PKG, "tc")
    assert comp.stats.precompiles == 2 and comp.stats.graph_compiles == 2
    assert (tmp_path / f"fusekit_tc_{tc_digest}.mojoc").is_file()
    assert len(list((tmp_path / "mef" / tc_digest).glob("swiglu_ffn-*.mef"))) == 1
    assert len(list((tmp_path / "mef" / digest).glob("swiglu_ffn-*.mef"))) == 1
    for a, b in zip(plain, tc):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_tc_op_runs_through_max_on_cpu() -> None:
    """fusekit.swiglu_ffn_tc (the op with the wgmma path compiled in) is registered and, on the CPU where
    that path does not exist, computes exactly what fusekit.swiglu_ffn does."""
    be = backends.get("mojo")
    ins = _ffn_inputs(5)
    got = [
        _run_cpu(be, ms, ins)
        for ms in (specs.phase_spec("swiglu_ffn", "forward"), specs.swiglu_ffn_tc_spec())
    ]
    assert specs.swiglu_ffn_tc_spec().max_op == "fusekit.swiglu_ffn_tc" in be.registered()
    # each MAX op its own compiled model (a cache keyed by the fusekit op alone ran the plain op for both)
    cpu, key = torch.device("cpu"), (torch.float32, torch.float32)  # (x, w)
    plain = be.compiler.get(specs.phase_spec("swiglu_ffn", "forward"), key, cpu)
    tc = be.compiler.get(specs.swiglu_ffn_tc_spec(), key, cpu)
    assert plain is not tc and (plain.spec.max_op, tc.spec.max_op) == (
        "fusekit.swiglu_ffn",
        "fusekit.swiglu_ffn_tc",
    )
    for a, b in zip(*got):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_each_op_file_is_its_own_unit() -> None:
    """A top-level op's first call precompiles its file, the files it imports and __init__.mojo only (issue
    #14 item 3: the whole package's precompile took 6.4 s of CPU on a 2-core box, rms_norm's unit 4.3 s), so an
    edit to another op keeps its .mojoc and MEFs."""
    names = lambda unit: [f.relative_to(PKG).as_posix() for f in rt.unit_files(PKG, unit)]
    assert names("rms_norm") == [
        "__init__.mojo",
        "_norm.mojo",
        "_norm_backward.mojo",
        "_util.mojo",
        "rms_norm.mojo",
    ]
    assert names("reduce_sum") == ["__init__.mojo", "_util.mojo", "reduce_sum.mojo"]
    assert "attention.mojo" not in names("swiglu_ffn")
    ops = rt.registered_ops(PKG)
    assert ops["fusekit.attention_backward"] == "attention" and ops["fusekit.rms_norm_backward"] == "rms_norm"
    for op, unit in ops.items():  # every registered op is compiled by its unit
        assert any(f'@register("{op}")' in f.read_text() for f in rt.unit_files(PKG, unit)), op
    assert len({rt.package_hash(PKG, u) for u in set(ops.values())}) == len(set(ops.values()))
