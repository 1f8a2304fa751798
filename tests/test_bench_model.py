"""CPU tests of the decoder-layer benchmark (fusekit/bench/layer.py, fusekit/bench/model.py).

    pytest tests/test_bench_model.py -x -q          # well under 30 s; triton runs in its interpreter

The fusekit layer on each installed backend must match the plain-torch (eager) layer in fp32 (tight
tolerances; the interpreter is slow) for decode against a KV cache read in place with kv_len (the
slots past kv_len hold NaN: never read), a chunk after a prefix and a prefill from 0, and must write the
same k/v into the cache. Then the floors, the refusal to time a wrong provider, and the CLI end to end.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from fusekit.bench import model
from fusekit.bench.layer import CONFIGS, DecoderLayer, KVCache, LayerConfig, copy_wide, make_weights
from fusekit.bench.run import rel_error

# head_dim 64 (the smallest the triton and mojo attention kernels take), GQA group 2, small FFN: the
# Triton interpreter runs one layer call in about a second.
MICRO = LayerConfig("micro", hidden=128, ffn=192, heads=2, kv_heads=1, theta=10000.0)
TOL = 1e-4  # fp32; measured errors are ~1e-6
CPU = torch.device("cpu")

# (batch, context, new tokens): decode with a cached context, a chunk after a prefix, a prefill from 0.
SHAPES = {"decode": (2, 37, 1), "chunk": (1, 20, 5), "prefill": (1, 0, 24)}


def _setup(b: int, ctx: int, s: int, spare: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = make_weights(MICRO, CPU, torch.float32, gen)
    cache = KVCache.allocate(MICRO, b, ctx + s + spare, CPU, torch.float32, gen, filled=ctx)
    cache.kv_len.fill_(ctx + s)
    x = torch.randn(b, s, MICRO.hidden, generator=gen)
    r = torch.randn(b, s, MICRO.hidden, generator=gen)
    return w, cache, x, r


def _copy(cache: KVCache) -> KVCache:
    return KVCache(cache.k.clone(), cache.v.clone(), cache.kv_len.clone())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_layer_matches_eager(shape: str, backend_name: str) -> None:
    b, ctx, s = SHAPES[shape]
    w, cache, x, r = _setup(b, ctx, s)
    assert torch.isnan(cache.k[:, ctx:]).all()  # the unused slots are NaN: reading one would show
    ref_cache, fk_cache = _copy(cache), _copy(cache)
    with torch.no_grad():
        ref = DecoderLayer(MICRO, w, ref_cache, "eager")(x, r, ctx)
        layer = DecoderLayer(MICRO, w, fk_cache, backend_name)
        out = layer(x, r, ctx)
    if backend_name in ("torch", "triton"):
        assert layer.use_kv_len  # the whole cache view goes in, with kv_len
    for o, e in zip(out, ref):
        assert o.shape == e.shape
        assert rel_error(o, e) < TOL
    n = ctx + s
    for got, want, before in ((fk_cache.k, ref_cache.k, cache.k), (fk_cache.v, ref_cache.v, cache.v)):
        assert rel_error(got[:, ctx:n], want[:, ctx:n]) < TOL  # the new tokens' k/v, written in place
        assert torch.equal(got[:, :ctx], before[:, :ctx])  # the context is left alone
        assert torch.isnan(got[:, n:]).all()  # nothing written past kv_len


@pytest.mark.parametrize(
    ("dtype", "d", "lo", "hi"),
    [
        (torch.bfloat16, 64, 4, 8),
        (torch.float16, 6, 2, 4),
        (torch.float32, 3, 2, 4),
        (torch.bfloat16, 8, 3, 4),
    ],
)
def test_copy_wide_writes_exactly_the_slice(dtype: torch.dtype, d: int, lo: int, hi: int) -> None:
    # heads [lo, hi) of a [B, S, 12, D] projection into a cache slice: 8-byte words (D 64), 4-byte words
    # (fp16 D 6), the plain copy (fp32 D 3: 12-byte rows); bf16 D 8 from head 3 (offset 48 bytes) too.
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 7, 12, d, generator=gen).to(dtype)
    cache = torch.full((2, 20, hi - lo, d), math.nan, dtype=dtype)
    copy_wide(cache[:, 3:10], qkv[:, :, lo:hi])
    assert torch.equal(cache[:, 3:10], qkv[:, :, lo:hi])
    assert torch.isnan(cache[:, :3].float()).all() and torch.isnan(cache[:, 10:].float()).all()


def test_configs_and_floors() -> None:
    # Per-layer parameters of the real models (x32 layers + embeddings = 6.7B and 8.0B).
    assert CONFIGS["llama2-7b"].weight_numel() == 202_383_360
    assert CONFIGS["llama3-8b"].weight_numel() == 218_112_000
    cfg = CONFIGS["llama3-8b"]
    sc = model.SCENARIOS["decode-b1-2k"]
    nbytes, flops = model.floors(cfg, sc, torch.bfloat16)
    kv = (2048 + 2) * 8 * 128 * 2 * 2  # k and v of 2049 positions read, the new one written
    assert nbytes == 2 * 218_112_000 + kv + 4 * 4096 * 2
    assert flops == 2 * cfg.gemm_params() + 4 * 32 * 128 * 2049
    tiny = model.scenario_for("decode-b32-32k", CONFIGS["tiny"])
    assert (tiny.batch, tiny.context, tiny.tokens) == (4, 2048, 1)


class _Altered(model.Eager):
    """The eager layer with its outputs passed through `alter`: must be refused, not timed."""

    def __init__(self, name: str, alter) -> None:
        super().__init__()
        self.name, self._alter = name, alter

    def build(self, st):
        call = super().build(st)
        return lambda: self._alter(call())


def test_wrong_provider_is_not_timed() -> None:
    sc = model.Scenario("t", "decode", 1, 16, 1)
    w = make_weights(MICRO, CPU, torch.float32, torch.Generator().manual_seed(0))
    ceil = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}
    rows = model.run_scenario(
        MICRO,
        sc,
        w,
        [model.Eager(), _Altered("wrong", lambda outs: tuple(t * 1.01 for t in outs))],
        CPU,
        "fp32",
        ceil,
        rep_ms=2,
    )
    good, bad = rows
    assert good["status"] == "ok" and good["ok"] and good["rel_error"] == 0.0
    assert bad["status"] == "failed" and not bad["ok"] and "not timed" in bad["reason"]
    assert bad["wall_us"] is None
    assert bad["rel_error"] > TOL


def test_a_provider_missing_an_output_is_not_timed() -> None:
    sc = model.Scenario("t", "decode", 1, 16, 1)
    w = make_weights(MICRO, CPU, torch.float32, torch.Generator().manual_seed(0))
    ceil = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}
    out_only = _Altered("out-only", lambda outs: outs[:1])  # the right out, no h (the residual stream)
    (row,) = model.run_scenario(MICRO, sc, w, [out_only], CPU, "fp32", ceil, rep_ms=2)
    assert row["status"] == "failed" and "1 outputs, the reference has 2" in row["reason"], row


class _NoCacheWrite(model.Eager):
    """The eager layer over a private copy of the cache: right outputs, but the shared cache's new-token
    slots are never written (they hold whatever the last provider left there)."""

    name = "no-cache-write"

    def build(self, st):
        cache = KVCache(st.cache.k.clone(), st.cache.v.clone(), st.cache.kv_len.clone())
        layer = DecoderLayer(st.cfg, st.weights, cache, "eager")
        return lambda: layer(st.x, st.residual, st.sc.context)


def test_a_provider_that_skips_its_cache_write_is_not_timed() -> None:
    """Every provider rewrites the new token's k/v slots of one shared cache, which the eager reference
    filled first: a provider that never wrote them passed with the reference's values still in place.
    The slots are NaN-filled before the checked call and compared with the reference's."""
    sc = model.Scenario("t", "decode", 1, 16, 1)
    w = make_weights(MICRO, CPU, torch.float32, torch.Generator().manual_seed(0))
    ceil = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}
    rows = model.run_scenario(MICRO, sc, w, [model.Eager(), _NoCacheWrite()], CPU, "fp32", ceil, rep_ms=2)
    good, bad = rows
    assert good["status"] == "ok" and good["outputs"] == ["out", "h", "k_new", "v_new"]
    assert good["rel_errors"] == [0.0] * 4, good["rel_errors"]
    assert bad["status"] == "failed" and "k_new rel error inf" in bad["reason"], bad["reason"]
    assert "v_new rel error inf" in bad["reason"] and "out rel" not in bad["reason"]


def test_cli_end_to_end(tmp_path) -> None:
    provs = "torch-eager,fusekit-torch,torch-compile-ro,fusekit-triton-graph"
    argv = ["--device", "cpu", "--config", "tiny", "--quick", "--providers", provs, "--rep-ms", "4"]
    assert model.main([*argv, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "cpu" / "model.json").read_text())
    assert doc["op"] == "model" and doc["meta"]["device"] == "cpu"
    assert doc["meta"]["git_commit"] is None or len(doc["meta"]["git_commit"]) == 40
    rows = doc["rows"]
    assert {r["scenario"] for r in rows} == set(model.QUICK)
    assert {r["provider"] for r in rows} == set(provs.split(","))
    for r in rows:
        assert {"provider", "scenario", "wall_us", "ok"} <= r.keys()
        if r["provider"] in ("torch-eager", "fusekit-torch"):
            assert r["ok"] and r["status"] == "ok", r["reason"]
            assert r["wall_us"] > 0 and math.isfinite(r["pct_of_ceiling"])
            assert r["rel_error"] <= r["tolerance"]
        else:  # CUDA graphs on the CPU: skipped with the reason, not an error
            assert r["status"] == "skipped" and not r["ok"] and "CUDA" in r["reason"]
    fk = next(r for r in rows if r["provider"] == "fusekit-torch")
    assert "torch-eager" in fk["speedup_vs"] and "torch-eager" in fk["wall_speedup_vs"]
    assert "fusekit-triton-graph" in doc["meta"]["skipped_backends"]
    assert "torch-compile-ro" in doc["meta"]["skipped_baselines"]


def test_ab_rounds_time_every_provider_again_alternating(monkeypatch) -> None:
    """--ab-rounds: after the scenario's providers are timed one after another, each is timed again in
    alternating rounds (order rotated per round) with its compiled graph still alive; each row gets the
    median of its rounds and, per baseline, the median of the per-round ratios (what the targets read)."""
    sc = model.Scenario("t", "decode", 1, 16, 1)
    w = make_weights(MICRO, CPU, torch.float32, torch.Generator().manual_seed(0))
    ceil = {"copy": {"gbps": 10.0}, "matmul": {"tflops": 0.1}}
    seen: list[object] = []
    real = model.bench_ms

    def spy(fn, device, **kw):
        seen.append(fn)
        return real(fn, device, **kw)

    monkeypatch.setattr(model, "bench_ms", spy)
    provs = [model.Eager(), model.FusekitLayer("torch"), model.Compiled(None)]
    rows = model.run_scenario(MICRO, sc, w, provs, CPU, "fp32", ceil, rep_ms=2, rounds=3)
    assert [r["status"] for r in rows] == ["ok"] * 3, [r["reason"] for r in rows]
    calls = seen  # on the CPU the sequential timing is wall-clock only: these are the 3 x 3 A/B calls
    assert len(calls) == 9 and len(set(calls)) == 3
    assert calls[0] != calls[3] and calls[3] != calls[6]  # each round starts with another provider
    for r in rows:
        assert r["ab_rounds"] == 3 and r["ab_us"] > 0
    fk = rows[1]
    assert set(fk["ab_speedup_vs"]) == {"torch-eager", "torch-compile"}
    assert all(v > 0 and math.isfinite(v) for v in fk["ab_speedup_vs"].values())
    assert set(rows[2]["ab_speedup_vs"]) == {"torch-eager"}  # baselines against the other baselines


def test_targets_read_the_ab_ratio() -> None:
    pytest.importorskip(
        "matplotlib", reason="the report needs the bench extra (the torch session installs it)"
    )
    from fusekit.report import targets

    t = next(t for t in targets.TARGETS if t.what.startswith("layer prefill"))
    row = {"speedup_vs": {"torch-compile": 0.9}, "ab_speedup_vs": {"torch-compile": 1.07}}
    assert targets._value(row, t, None, []) == 1.07
    assert targets._value({"speedup_vs": {"torch-compile": 0.9}}, t, None, []) == 0.9


def test_cli_rejects_unknown_names(tmp_path, capsys) -> None:
    assert model.main(["--device", "cpu", "--providers", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown providers" in capsys.readouterr().err
