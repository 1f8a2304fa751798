"""`python -m fusekit.bench.e2e` on the CPU at the tiny config: the CLI runs end to end, the JSON has one
row per (provider, scenario, case) with its status, the fusekit rows passed the correctness gate and carry
the evidence that fusekit's kernels ran, and --merge keeps other runs' providers.

One CLI run (a subprocess, --quick --reps 1, ~20-30 s on 2 cores) shared by the tests: eager,
fusekit-torch, fusekit-triton (Triton's interpreter: seconds at this size in fp32) and liger (always
skipped on the CPU). torch.compile is left out (inductor's first compile of the model takes ~35 s here).
No timing assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fusekit.bench import e2e, results
from fusekit.bench.e2e.config import FP32_GRAD_RTOL

ROOT = Path(__file__).resolve().parents[1]
PROVIDERS = ("eager", "fusekit-torch", "fusekit-triton", "liger")
LAYERS = e2e.MODELS["tiny"]["layers"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("e2e")
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'python'}:{ROOT}",
        "TRITON_INTERPRET": "1",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "fusekit.bench.e2e",
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--quick",
        "--reps",
        "1",
        "--providers",
        ",".join(PROVIDERS),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = out / "cpu" / e2e.FILE
    assert path.exists(), proc.stdout[-2000:]
    return json.loads(path.read_text()), proc.stdout


def _rows(doc: dict, provider: str) -> list[dict]:
    return [r for r in doc["rows"] if r["provider"] == provider]


def test_file_has_provenance_and_the_setup(run):
    doc, stdout = run
    assert doc["schema"] == e2e.SCHEMA and doc["meta"]["schema"] == e2e.SCHEMA
    meta = doc["meta"]
    for key in ("git_commit", "date", "torch", "transformers", "command", "device", "host"):
        assert key in meta, key
    assert meta["device"] == "cpu" and meta["command"].startswith("python -m fusekit.bench.e2e")
    setup = doc["setup"]
    assert (setup["model"], setup["dtype"], setup["layers"]) == ("tiny", "fp32", LAYERS)
    assert setup["parameters"] > 0 and doc["runs"] == [meta]
    assert "provider" in stdout and "fusekit-torch" in stdout  # the table was printed


def test_one_row_per_provider_scenario_and_case(run):
    doc, _ = run
    cases = {"prefill": ["1x16"], "decode": ["1x8+8", "2x8+4"], "train": ["1x16"]}  # the tiny config's
    want = [(p, sc, c) for p in PROVIDERS for sc in e2e.SCENARIOS for c in cases[sc]]
    got = [(r["provider"], r["scenario"], r["case"]) for r in doc["rows"]]
    assert sorted(got) == sorted(want), got
    assert set(doc["providers"]) == set(PROVIDERS)
    for r in doc["rows"]:
        assert r["status"] in ("ok", "skipped"), r
        if r["status"] == "skipped":
            assert r["reason"], r
    for r in _rows(doc, "liger"):
        assert r["status"] == "skipped" and ("liger" in r["reason"].lower()), r


@pytest.mark.parametrize("provider", ["eager", "fusekit-torch"])
def test_eager_and_fusekit_torch_rows_are_timed(run, provider):
    doc, _ = run
    rows = _rows(doc, provider)
    assert [r["status"] for r in rows] == ["ok"] * 4, rows  # prefill, two decode cases, train
    for r in rows:
        assert r["tokens"] > 0 and len(r["times_s"]) == 1 and r["peak_mem_bytes"] is None
        if r["scenario"] != "decode":  # decode's rate is null when t(N) - t(1) is below the noise
            assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
            assert r["speedup_vs"]["eager"] > 0 and "compile" not in r["speedup_vs"]
        else:
            assert r["generate_tokens_per_s"] > 0 and r["generate_kwargs"] == {}
    train = next(r for r in rows if r["scenario"] == "train")
    assert train["loss_first"] > 0 and train["loss_last"] > 0
    if provider == "eager":
        assert all(r["speedup_vs"]["eager"] == 1.0 for r in rows if r.get("speedup_vs"))


@pytest.mark.parametrize("provider", ["fusekit-torch", "fusekit-triton"])
def test_fusekit_gate_passed_and_its_kernels_ran(run, provider):
    doc, _ = run
    rec = doc["providers"][provider]
    if provider == "fusekit-triton" and rec["status"] == "skipped":
        pytest.skip(f"triton not usable here: {rec['reason']}")
    assert rec["status"] == "ok", rec
    g = rec["gate"]
    assert g["passed"] and g["logits_rel_error"] <= e2e.FP32_LOGITS_RTOL
    assert g["generate_same_tokens"], g
    # every norm, rope, attention and MLP of one forward reached this backend's kernels
    expected = {
        "rms_norm:forward": 2 * LAYERS + 1,
        "rope:forward": LAYERS,
        "attention:forward": LAYERS,
        "swiglu_ffn:forward": LAYERS,
    }
    assert g["kernel_runs"] == expected == g["kernel_runs_expected"]
    # one training step's gradient of every parameter against HF eager's (the tiny model has 21)
    assert g["grad_params_checked"] == 21 and "grad_missing" not in g, g
    assert g["grad_rel_error"] <= g["grad_tol"] == FP32_GRAD_RTOL
    # every decode step's logits with HF eager's tokens forced (the KV-cache path generate() takes)
    assert g["decode_logits_rel_error"] <= g["decode_logits_tol"] == e2e.FP32_LOGITS_RTOL
    train = next(r for r in _rows(doc, provider) if r["scenario"] == "train")
    assert train["status"] == "ok", train
    runs = train["kernel_runs_first_step"]
    for op in ("rms_norm", "rope", "attention", "swiglu_ffn"):
        assert runs[f"{op}:backward"] == expected[f"{op}:forward"], runs


def test_eager_gate_is_the_reference(run):
    doc, _ = run
    g = doc["providers"]["eager"]["gate"]
    assert g["passed"] and g["logits_rel_error"] == 0.0 and "kernel_runs" not in g


def test_the_op_report_ignores_e2e_files(tmp_path):
    d = tmp_path / "cpu"
    d.mkdir()
    (d / e2e.FILE).write_text(json.dumps({"schema": e2e.SCHEMA, "meta": {"schema": e2e.SCHEMA}, "rows": []}))
    assert results.load_all(tmp_path) == []


def test_merge_keeps_other_providers_and_recomputes_ratios():
    def row(p, tps, run):
        return {
            "provider": p,
            "scenario": "prefill",
            "case": "1x16",
            "status": "ok",
            "tokens_per_s": tps,
            "run": run,
        }

    old = {
        "runs": [{"date": "a"}],
        "providers": {"eager": {"status": "ok"}, "fusekit-mojo": {"status": "ok"}},
        "rows": [row("eager", 100.0, 0), row("fusekit-mojo", 50.0, 0)],
    }
    new = {"meta": {"date": "b"}, "providers": {"eager": {"status": "ok"}}, "rows": [row("eager", 200.0, 1)]}
    doc = e2e.compose(new, old)
    assert doc["runs"] == [{"date": "a"}, {"date": "b"}]
    assert [(r["provider"], r["run"]) for r in doc["rows"]] == [("eager", 1), ("fusekit-mojo", 0)]
    mojo = doc["rows"][1]["speedup_vs"]
    assert mojo == {"eager": 0.25, "eager_other_run": True}
    assert list(doc["providers"]) == ["eager", "fusekit-mojo"]


def test_merge_replaces_only_the_cases_a_run_measured():
    """A --scenarios train run replaces that provider's train row only; a case the new run skipped for
    its time budget keeps the old measurement (a cut-short run erases nothing)."""

    def row(p, sc, tps, run, status="ok", reason=None):
        r = {"provider": p, "scenario": sc, "case": "1x16", "status": status, "tokens_per_s": tps, "run": run}
        return r if reason is None else {**r, "reason": reason}

    old = {
        "runs": [{"date": "a"}],
        "providers": {"eager": {"status": "ok"}, "compile": {"status": "ok"}},
        "rows": [
            row("eager", "prefill", 100.0, 0),
            row("eager", "train", 10.0, 0),
            row("compile", "prefill", 150.0, 0),
            row("compile", "train", 12.0, 0),
        ],
    }
    new = {
        "meta": {"date": "b"},
        "providers": {"eager": {"status": "ok"}, "compile": {"status": "ok"}},
        "rows": [
            row("eager", "train", 20.0, 1),
            row("compile", "train", None, 1, "skipped", e2e.BUDGET_SKIP),
        ],
    }
    doc = e2e.compose(new, old)
    got = [(r["provider"], r["scenario"], r["tokens_per_s"], r["run"]) for r in doc["rows"]]
    assert got == [
        ("eager", "prefill", 100.0, 0),
        ("eager", "train", 20.0, 1),
        ("compile", "prefill", 150.0, 0),
        ("compile", "train", 12.0, 0),
    ]
    train = doc["rows"][3]["speedup_vs"]
    assert train["eager"] == 12.0 / 20.0 and train["eager_other_run"]


def test_cpu_timings_never_go_to_the_committed_results(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert e2e.main(["--device", "cpu", "--out", str(results.COMMITTED_RESULTS)]) == 2
    assert "refusing" in capsys.readouterr().err


def test_fusekit_compile_provider_is_the_patch_then_what_compile_does() -> None:
    """fusekit-<backend>-compile: patched with that backend, compiled like "compile", the same generate
    arguments (static cache on CUDA; on the CPU the reason decode is not compiled there)."""
    (prov,) = e2e.make_providers(["fusekit-triton-compile"], None)
    assert isinstance(prov, e2e.FusekitCompile) and prov.backend == "triton"
    assert prov.name == "fusekit-triton-compile" and prov.name in e2e.PROVIDERS
    assert "patch" in prov.what and "torch.compile" in prov.what

    def setup(device: str) -> e2e.Setup:
        return e2e.Setup(device, "tiny", 1, "fp32", "sdpa", [(1, 8)], (1, 8, 4), [(1, 8)], 0)

    assert prov.generate_kwargs(setup("cuda")) == {"cache_implementation": "static"}
    assert isinstance(prov.generate_kwargs(setup("cpu")), str)


def test_decode_cases_parse_and_each_gets_a_row(run) -> None:
    """--decode takes a comma list (the first case is the gate's prompt); every case gets its own row."""
    assert e2e._decode_shapes("1x2048+128,32x2048+128") == [(1, 2048, 128), (32, 2048, 128)]
    doc, _ = run
    cases = [tuple(c) for c in doc["setup"]["decode"]]
    assert len(cases) >= 2, "the tiny model times two decode cases"
    for prov in PROVIDERS:
        got = [r["case"] for r in doc["rows"] if r["provider"] == prov and r["scenario"] == "decode"]
        assert got == [e2e._label(*c) for c in cases], (prov, got)


def test_report_setup_line_reads_one_or_several_decode_cases() -> None:
    from fusekit.report.e2e import setup_line

    one = setup_line({"setup": {"decode": [1, 512, 128]}})
    many = setup_line({"setup": {"decode": [[1, 2048, 128], [32, 2048, 128]]}})
    assert "decode 1x512 prompt + 128 new tokens" in one
    assert "decode 1x2048 prompt + 128 new tokens, 32x2048 prompt + 128 new tokens" in many


def test_results_file_per_model() -> None:
    assert e2e.file_name("llama3-8b") == e2e.file_name("tiny") == e2e.FILE
    assert e2e.file_name("llama3.2-1b") == "e2e-llama3.2-1b.json"
    assert e2e.file_name("llama3-8b", 4) == e2e.FILE  # the model's default layer count
    assert e2e.file_name("llama3-8b", 32) == "e2e-llama3-8b-32l.json"
    # training shapes other than the model's default: a file of their own (a file holds one setup)
    assert e2e.file_name("llama3.2-1b", None, "1x2048") == "e2e-llama3.2-1b.json"
    assert e2e.file_name("llama3.2-1b", 16, "4x2048") == "e2e-llama3.2-1b-train4x2048.json"
    assert e2e.file_name("llama3-8b", 32, "1x2048,2x1024") == "e2e-llama3-8b-32l-train1x2048_2x1024.json"


def test_kernel_runs_counts_replayed_calls():
    """A planned call whose launches are replayed (GPU, calls 5+) never reaches provider.run: the gate
    must still count it (on the H200 it saw 2 of 9 rms_norm runs when it counted provider.run)."""
    from fusekit import library, ops

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    library.clear_plans()  # plans and memos of earlier tests: the one call below makes the only plan
    with torch.no_grad():
        ops.rms_norm(x, w, backend="torch")
        plan = next(p for k, p in library._PLANS.items() if k[0] == "rms_norm" and k[2] == "torch")
        seen = []
        plan.replay = lambda outs, ins: seen.append(1) or True  # stands in for a recorded replay
        try:
            with e2e.kernel_runs("torch") as runs:
                for _ in range(3):
                    ops.rms_norm(x, w, backend="torch")
            with e2e.kernel_runs("triton") as other:
                ops.rms_norm(x, w, backend="torch")
        finally:
            library.clear_plans()
    assert len(seen) == 4 and runs == {"rms_norm:forward": 3} and not other


def test_isolate_runs_each_provider_in_its_own_process(tmp_path):
    """--isolate (the CUDA default): one worker process per provider, merged into one file (one run
    record per provider), the whole table printed once by the parent."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'python'}:{ROOT}", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "fusekit.bench.e2e", "--device", "cpu", "--model", "tiny", "--quick"]
    cmd += ["--reps", "1", "--providers", "eager,fusekit-torch", "--scenarios", "prefill", "--isolate"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "cpu" / e2e.FILE).read_text())
    assert set(doc["providers"]) == {"eager", "fusekit-torch"} and len(doc["runs"]) == 2
    assert [(r["provider"], r["run"], r["status"]) for r in doc["rows"]] == [
        ("eager", 0, "ok"),
        ("fusekit-torch", 1, "ok"),
    ]
    assert doc["rows"][1]["speedup_vs"]["eager"] > 0  # ratios span the workers' runs
    assert proc.stdout.count("provider ") == 1  # one table, the parent's


def test_prompts_hold_no_pad_token():
    """generate() runs with pad_token_id=0: a random prompt holding token 0 would be read as padded."""
    spec = e2e.MODELS["tiny"]
    setup = e2e.Setup("cpu", "tiny", 2, "fp32", "sdpa", [(1, 16)], [(1, 8, 8)], [(1, 16)], 0, spec["config"])
    ids = e2e._ids(setup, 4, 4096, salt=2)
    assert ids.min() >= 1 and ids.max() < spec["config"]["vocab_size"]


def test_fused_adamw_option_is_recorded_and_old_files_still_merge(tmp_path) -> None:
    """--optim fused runs the training step with AdamW(fused=True) (transformers' TrainingArguments
    default) and says so in the setup and the method; a file written before the option existed counts as
    the foreach setup, so --merge still accepts it."""
    argv = ["--device", "cpu", "--model", "tiny", "--quick", "--reps", "1", "--providers", "eager",
            "--scenarios", "train", "--optim", "fused", "--out", str(tmp_path)]  # fmt: skip
    assert e2e.main(argv) == 0
    doc = json.loads((tmp_path / "cpu" / e2e.FILE).read_text())
    assert doc["setup"]["optim"] == "fused"
    assert "fused" in doc["method"]["train"]
    (row,) = [r for r in doc["rows"] if r["scenario"] == "train"]
    assert row["status"] == "ok", row
    old = {k: v for k, v in doc["setup"].items() if k != "optim"}
    assert e2e._setup_key(old) == e2e._setup_key({**old, "optim": "foreach"})
    assert e2e._setup_key(old) != e2e._setup_key(doc["setup"])


def test_patched_rows_carry_same_process_ab_rounds(run) -> None:
    """fusekit-<backend> decode and train rows give their ratio to HF eager from alternating unpatched /
    patched rounds in one process (bench.e2e.ab_decode, ab_train); the compiled and baseline providers do
    not."""
    doc, _ = run
    seen = set()
    for r in doc["rows"]:
        if r["scenario"] not in ("decode", "train") or r["status"] != "ok":
            continue
        seen.add((r["provider"], r["scenario"]))
        if r["provider"].startswith("fusekit-") and not r["provider"].endswith("-compile"):
            # a round whose decode steps fell below the tiny model's timing noise has no rate: dropped
            assert len(r["ab_eager_ms_per_step"]) == len(r["ab_ms_per_step"]) == len(r["ab_ratios"]) <= 3, r
            assert all(ms > 0 for ms in r["ab_eager_ms_per_step"] + r["ab_ms_per_step"])
            assert (r["ab_vs_eager"] is None) == (not r["ab_ratios"])
            if r["scenario"] == "train":  # every round has a step time
                assert len(r["ab_ratios"]) == 3 and r["ab_vs_eager"] > 0, r
        else:
            assert "ab_ratios" not in r, r["provider"]
    assert {("fusekit-torch", "decode"), ("fusekit-torch", "train")} <= seen, seen


def test_rows_are_saved_as_they_are_measured(tmp_path, monkeypatch) -> None:
    """A process killed mid-provider (a device call's time limit) keeps the rows it measured: the file is
    rewritten before each case and after the last, the provider marked partial until it has finished."""
    from fusekit.bench.e2e import cli

    seen: list[tuple[int, bool]] = []
    real = cli._write

    def spy(path: Path, doc: dict) -> None:
        mine = [r for r in doc["rows"] if r["provider"] == "eager"]
        seen.append((len(mine), doc["providers"]["eager"].get("partial", False)))
        real(path, doc)

    monkeypatch.setattr(cli, "_write", spy)
    argv = ["--device", "cpu", "--model", "tiny", "--quick", "--reps", "1", "--providers", "eager",
            "--scenarios", "prefill,train", "--out", str(tmp_path)]  # fmt: skip
    assert e2e.main(argv) == 0
    doc = json.loads((tmp_path / "cpu" / e2e.FILE).read_text())
    n = len(_rows(doc, "eager"))
    assert n >= 2 and all(r["status"] == "ok" for r in _rows(doc, "eager"))
    assert "partial" not in doc["providers"]["eager"]
    counts = [c for c, _ in seen]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == n
    assert [c for c, partial in seen if partial] == list(range(n + 1))  # one save per case, then the last
    assert seen[-1] == (n, False)


def test_liger_provider_suspends_and_resumes_its_patch(monkeypatch) -> None:
    """Liger's A/B rounds: suspend gives back HF as is (the instance methods Liger bound removed, the
    module-level names it rebound restored: HF's logits exactly), resume puts Liger back, close leaves
    transformers unpatched. liger_kernel is not installed on the CPU, so a stand-in patches the way
    apply_liger_kernel_to_llama(model=...) does (module-level names, methods bound on instances)."""
    import types

    from transformers.models.llama import modeling_llama as ml

    def liger_like_forward(self, x):  # a norm/MLP "kernel" whose results differ from HF's
        return x * 2.0

    def apply(model=None, **kw) -> None:
        ml.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: (q, k)  # no rotation at all
        ml.LlamaRMSNorm, ml.LlamaMLP = torch.nn.Identity, torch.nn.Identity
        for m in model.modules():
            if type(m).__name__ in ("LlamaRMSNorm", "LlamaMLP"):
                m.__dict__["forward"] = liger_like_forward.__get__(m, type(m))
                m.__dict__["_get_name"] = lambda: "Liger"

    pkg, sub = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    sub.apply_liger_kernel_to_llama = apply
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    spec = e2e.MODELS["tiny"]
    setup = e2e.Setup("cpu", "tiny", 2, "fp32", "sdpa", [(1, 16)], [(1, 8, 8)], [(1, 16)], 0, spec["config"])
    model = e2e.fresh_model(setup, e2e.base_weights(setup))
    ids = e2e._ids(setup, 1, 8, salt=5)
    own = model.model.norm.__dict__["_get_name"] = lambda: "HF's own"  # an instance attribute before Liger
    hf_names = (ml.apply_rotary_pos_emb, ml.LlamaRMSNorm, ml.LlamaMLP)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        prov = e2e.Liger()
        prov.prepare(model)
        patched = model(input_ids=ids).logits
        assert not torch.equal(patched, want)
        for _ in range(2):
            prov.suspend(model)
            assert (ml.apply_rotary_pos_emb, ml.LlamaRMSNorm, ml.LlamaMLP) == hf_names
            assert torch.equal(model(input_ids=ids).logits, want)
            assert model.model.norm.__dict__["_get_name"] is own  # put back, not dropped
            assert "forward" not in model.model.norm.__dict__
            prov.resume(model)
            assert torch.equal(model(input_ids=ids).logits, patched)
        prov.close()
    assert (ml.apply_rotary_pos_emb, ml.LlamaRMSNorm, ml.LlamaMLP) == hf_names
    assert prov.ab and e2e.Fusekit("torch").ab and not e2e.FusekitCompile("torch").ab


def test_grad_gate_fails_a_missing_a_wrong_and_a_nan_gradient() -> None:
    """The training gate (scenarios.grad_gate): a parameter HF's loss reaches that gets no gradient (a
    silently detached op), one off by more than its tolerance, and a NaN one (which stays the worst) each
    fail it; low precision measures against the fp32 model with 2x HF eager's own error + slack."""
    from fusekit.bench.e2e.scenarios import Reference, grad_gate

    g = torch.Generator().manual_seed(0)
    want = {n: torch.randn(5, 7, generator=g) for n in ("a", "b", "c")}
    ref = Reference(torch.zeros(1), None, None, None, grads={**want, "frozen": None})
    rec, bad = grad_gate({n: w * (1 + 1e-5) for n, w in want.items()}, ref)
    assert bad == [] and rec["grad_params_checked"] == 3 and rec["grad_rel_error"] <= 2e-5
    rec, bad = grad_gate({"a": want["a"], "b": want["b"], "c": None}, ref)
    assert rec["grad_missing"] == ["c"] and "no gradient reached 1 parameter(s), e.g. c" in bad[0]
    rec, bad = grad_gate({**want, "b": want["b"] * 1.01}, ref)
    assert rec["grad_worst_param"] == "b" and "gradient of b" in bad[0], (rec, bad)
    nan = want["a"].clone()
    nan[0, 0] = float("nan")
    rec, bad = grad_gate({**want, "a": nan, "b": want["b"] * 1.01}, ref)
    assert rec["grad_worst_param"] == "a" and "gradient of a: relative error nan" in bad[0], (rec, bad)
    low = Reference(torch.zeros(1), None, torch.zeros(1), 0.0, grads=want, grads_exact=want,
                    grads_eager_err={"a": 0.1, "b": 0.0, "c": 0.0})  # fmt: skip
    rec, bad = grad_gate({**want, "a": want["a"] * 1.2}, low)  # 0.2 <= 2 * 0.1 + slack
    assert bad == [] and rec["grad_vs"].startswith("the fp32 model"), (rec, bad)
    rec, bad = grad_gate({**want, "b": want["b"] * 1.05}, low)  # 0.05 > 2 * 0 + slack
    assert "gradient of b" in bad[0], (rec, bad)


def test_gate_fails_a_wrong_decode_path() -> None:
    """A model right on a full forward but off by 1% on generate()'s steps (its KV-cache path) kept its
    greedy tokens and passed the gate; the logits of every step with HF eager's tokens forced now fail it."""
    from fusekit.bench.e2e import config, scenarios
    from fusekit.bench.e2e.providers import Provider

    setup = config.Setup(device="cpu", model="tiny", layers=LAYERS, dtype="fp32", attn_implementation="sdpa",
                         prefill=[(1, 16)], decode=[(1, 8, 8)], train=[(1, 16)], seed=0)  # fmt: skip
    state = config.base_weights(setup)
    gate_ids, prompt = config._ids(setup, 1, 16, salt=1), config._ids(setup, 1, 8, salt=2)
    ref = scenarios.reference(setup, state, gate_ids, prompt, 8)
    model = config.fresh_model(setup, state)
    g = scenarios.gate(Provider(), model, model, setup, ref, gate_ids, prompt, 8)
    assert g["passed"] and g["decode_logits_rel_error"] == 0.0, g
    step = lambda m, i, o: o * 1.01 if o.shape[1] == 1 else o  # generate's steps: one position
    model.lm_head.register_forward_hook(step)
    g = scenarios.gate(Provider(), model, model, setup, ref, gate_ids, prompt, 8)
    assert g["generate_same_tokens"] and g["logits_rel_error"] == 0.0, g
    assert not g["passed"] and any(p.startswith("decode logits") for p in g["problems"]), g
