"""bench.e2e's scenarios: the correctness gate against HF eager, then prefill, decode (and the same-process
A/B against HF eager) and the training step, per provider."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fusekit.bench.e2e.config import (
    BUDGET_SKIP,
    FP32_GRAD_RTOL,
    FP32_LOGITS_RTOL,
    LOW_PRECISION_GRAD_SLACK,
    LOW_PRECISION_SLACK,
    Setup,
    _decode_shapes,
    _free,
    _generate,
    _ids,
    _label,
    _shapes,
    _sync,
    fresh_model,
    rel_error,
)
from fusekit.bench.e2e.providers import Provider, _classify, expected_forward_runs, kernel_runs
from fusekit.bench.e2e.timing import Timing, time_calls


# --- the run -----------------------------------------------------------------------------------------
@dataclass
class Reference:
    logits: torch.Tensor  # HF eager on the gate batch, float32
    tokens: torch.Tensor | None  # HF eager's greedy generate of the decode prompt
    exact: torch.Tensor | None  # low precision only: the same model in fp32
    eager_err: float | None  # low precision only: HF eager's error against `exact`
    # train: HF eager's parameter gradients of one training step's loss (host copies, by parameter name);
    # in low precision also the fp32 model's and HF eager's error against them, per parameter
    grads: dict[str, torch.Tensor | None] | None = None
    grads_exact: dict[str, torch.Tensor | None] | None = None
    grads_eager_err: dict[str, float] | None = None
    # decode: HF eager's logits of every generate() step with its own greedy tokens forced (`forced_decode`);
    # in low precision also the fp32 model's on the same tokens and HF eager's error against them
    decode: torch.Tensor | None = None
    decode_exact: torch.Tensor | None = None
    decode_eager_err: float | None = None


def forced_decode(model: nn.Module, prompt: torch.Tensor, tokens: torch.Tensor, **kw) -> torch.Tensor:
    """generate() over the prompt with every step's token forced to `tokens` [B, n] (teacher forcing: a
    near tie that flips one greedy token no longer sends the rest of the sequence elsewhere), through the
    provider's own decode path (`kw`: its cache, its compiled steps); the raw logits of the n steps,
    [B, n, V] float32. The decode attention over the KV cache is what these logits check."""
    from transformers import LogitsProcessor, LogitsProcessorList

    start = prompt.shape[1]

    class Force(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            want = tokens[:, input_ids.shape[1] - start].to(scores.device)
            return torch.full_like(scores, float("-inf")).scatter_(1, want[:, None], 0.0)

    out = _generate(model, prompt, tokens.shape[1], logits_processor=LogitsProcessorList([Force()]),
                    output_logits=True, return_dict_in_generate=True, **kw)  # fmt: skip
    return torch.stack([step.float() for step in out.logits], 1)


def train_batch(setup: Setup, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The train scenario's (input ids, labels) at B x S; labels are random targets (HF shifts them)."""
    return _ids(setup, b, s, salt=20 + s), _ids(setup, b, s, salt=30 + s)


def loss_grads(fwd: Callable, model: nn.Module, setup: Setup) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's gradient (a host copy; None where none reached it) of the loss of one
    forward with labels at the first train shape, as the training step computes it; the model is left
    with no gradients, in eval mode."""
    ids, labels = train_batch(setup, *setup.train[0])
    model.train()
    model.zero_grad(set_to_none=True)
    try:
        fwd(input_ids=ids, labels=labels).loss.backward()
        return {
            n: None if p.grad is None else p.grad.detach().to("cpu", copy=True)
            for n, p in model.named_parameters()
            if p.requires_grad
        }
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def reference(
    setup: Setup,
    state: dict,
    gate_ids: torch.Tensor,
    prompt: torch.Tensor | None,
    n_new: int,
    train: bool = False,
) -> Reference:
    """HF eager's logits (and greedy tokens when `prompt` is given; with `train` its parameter gradients);
    in low precision also the fp32 model's."""
    model = fresh_model(setup, state)
    with torch.no_grad():
        logits = model(gate_ids, use_cache=False).logits.float()
    tokens = _generate(model, prompt, n_new) if prompt is not None else None
    new = tokens[:, prompt.shape[1] :] if tokens is not None and prompt is not None else None
    decode = forced_decode(model, prompt, new) if new is not None else None
    grads = loss_grads(model, model, setup) if train else None
    del model
    exact = err = grads_exact = grads_err = decode_exact = decode_err = None
    if setup.torch_dtype != torch.float32:
        _free()
        model = fresh_model(setup, state, dtype=torch.float32)
        with torch.no_grad():
            exact = model(gate_ids, use_cache=False).logits.float()
        if new is not None:
            decode_exact = forced_decode(model, prompt, new)
            decode_err = rel_error(decode, decode_exact)
        grads_exact = loss_grads(model, model, setup) if train else None
        del model
        err = rel_error(logits, exact)
        if grads is not None and grads_exact is not None:
            grads_err = {
                n: rel_error(g, grads_exact[n])
                for n, g in grads.items()
                if g is not None and grads_exact.get(n) is not None
            }
    _free()
    return Reference(
        logits, tokens, exact, err, grads, grads_exact, grads_err, decode, decode_exact, decode_err
    )


def grad_gate(got: dict[str, torch.Tensor | None], ref: Reference) -> tuple[dict, list[str]]:
    """A provider's parameter gradients (`loss_grads`) against the reference's: every parameter HF eager's
    loss reaches must get a gradient (a silently detached op leaves None), each within its tolerance (fp32:
    FP32_GRAD_RTOL against HF eager; else against the fp32 model, 2x HF eager's own error + slack).
    Returns (record, problems)."""
    assert ref.grads is not None
    low = ref.grads_exact is not None
    want = ref.grads_exact if low else ref.grads
    missing, worst = [], (None, 0.0, 0.0)  # (name, error, its tolerance) of the largest error / tolerance
    checked, worst_ratio = 0, -1.0  # a NaN ratio is the worst and stays
    for name, w in want.items():
        if w is None:
            continue
        g = got.get(name)
        if g is None:
            missing.append(name)
            continue
        err = rel_error(g, w)
        tol = 2 * ref.grads_eager_err[name] + LOW_PRECISION_GRAD_SLACK if low else FP32_GRAD_RTOL
        checked += 1
        ratio = err / tol
        if not math.isnan(worst_ratio) and (math.isnan(ratio) or ratio > worst_ratio):
            worst, worst_ratio = (name, err, tol), ratio
    rec = {
        "grad_params_checked": checked,
        "grad_worst_param": worst[0],
        "grad_rel_error": worst[1],
        "grad_tol": worst[2],
        "grad_vs": "the fp32 model, 2x HF eager's own error + slack" if low else "HF eager, fp32",
    }
    problems = []
    if missing:
        rec["grad_missing"] = missing
        problems.append(f"no gradient reached {len(missing)} parameter(s), e.g. {missing[0]}")
    if worst[0] is not None and not worst[1] <= worst[2]:
        problems.append(f"gradient of {worst[0]}: relative error {worst[1]:.3g} > {worst[2]:.3g}")
    return rec, problems


def _logits_rule(
    got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor | None, eager_err: float | None, dtype: str
) -> tuple[float, float, str]:
    """(error, tolerance, against what) of logits: fp32 against HF eager's at FP32_LOGITS_RTOL; in low
    precision (`exact` given) against the fp32 model's, within 2x HF eager's own error + slack."""
    if exact is None:
        return rel_error(got, eager), FP32_LOGITS_RTOL, "HF eager, fp32"
    vs = f"the fp32 model; HF eager {dtype}'s own error {eager_err:.3g}"
    return rel_error(got, exact), 2 * eager_err + LOW_PRECISION_SLACK, vs


def gate(
    prov: Provider,
    fwd: Callable,
    model: nn.Module,
    setup: Setup,
    ref: Reference,
    gate_ids: torch.Tensor,
    prompt: torch.Tensor,
    n_new: int,
) -> dict:
    """Logits against HF eager (fp32: rtol 1e-4; else against the fp32 model, within 2x HF eager's own
    error), the same rule for the logits of every decode step with HF eager's tokens forced
    (`forced_decode`: the provider's generate() path, its KV cache and decode attention), greedy tokens
    (fp32: identical; else the matching prefix is recorded), kernel evidence; with the reference's
    gradients (a train scenario), each parameter's gradient of one step (`grad_gate`)."""
    out: dict = {"passed": False}
    with kernel_runs(prov.backend) as runs, torch.no_grad():
        logits = fwd(gate_ids, use_cache=False).logits.float()
    if prov.backend is not None:
        out["kernel_runs"] = dict(runs)
        out["kernel_runs_expected"] = expected_forward_runs(setup.layers)
    err, tol, vs = _logits_rule(logits, ref.logits, ref.exact, ref.eager_err, setup.dtype)
    out.update(logits_rel_error=err, logits_tol=tol, logits_vs=vs)
    if ref.exact is not None:
        out["logits_rel_error_vs_eager"] = rel_error(logits, ref.logits)
    problems = []
    if not err <= tol:  # NaN fails
        problems.append(f"logits relative error {err:.3g} > {tol:.3g}")
    if prov.backend is not None and out["kernel_runs"] != out["kernel_runs_expected"]:
        problems.append(
            f"fusekit {prov.backend} kernel runs {out['kernel_runs']} != {out['kernel_runs_expected']}"
        )
    kw = prov.generate_kwargs(setup)
    if ref.decode is not None and isinstance(kw, dict):
        got = forced_decode(model, prompt, ref.tokens[:, prompt.shape[1] :], **kw)
        derr, dtol, vs = _logits_rule(got, ref.decode, ref.decode_exact, ref.decode_eager_err, setup.dtype)
        out.update(decode_logits_rel_error=derr, decode_logits_tol=dtol, decode_logits_vs=vs)
        if not derr <= dtol:
            problems.append(
                f"decode logits (HF eager's tokens forced) relative error {derr:.3g} > {dtol:.3g}"
            )
    if ref.tokens is not None and isinstance(kw, dict):
        tokens = _generate(model, prompt, n_new, **kw)
        p = prompt.shape[1]
        same = (tokens[:, p:] == ref.tokens[:, p:]).all(dim=0).long()
        prefix = int(same.cumprod(0).sum()) if tokens.shape == ref.tokens.shape else 0
        out.update(generate_same_tokens=bool(prefix == n_new), generate_matching_prefix=prefix)
        if setup.torch_dtype == torch.float32 and prefix != n_new:
            problems.append(f"greedy tokens differ from HF eager after {prefix} of {n_new}")
    elif ref.tokens is not None:
        out["generate"] = f"not checked: {kw}"
    if ref.grads is not None:
        rec, bad = grad_gate(loss_grads(fwd, model, setup), ref)
        out.update(rec)
        problems += bad
    out["passed"] = not problems
    if problems:
        out["problems"] = problems
    return out


def _row(prov: str, scenario: str, case: str, status: str, **kw) -> dict:
    return {"provider": prov, "scenario": scenario, "case": case, "status": status, **kw}


def _cases(setup: Setup, scenario: str) -> list[str]:
    if scenario == "prefill":
        return [_label(b, s) for b, s in setup.prefill]
    if scenario == "decode":
        return [_label(*d) for d in setup.decode]
    return [_label(b, s) for b, s in setup.train]


def _mem(t: Timing) -> dict:
    return {"peak_mem_bytes": t.peak_mem_bytes, "mem_before_bytes": t.mem_before_bytes}


def run_prefill(fwd, setup: Setup, b: int, s: int, warmup: int, reps: int) -> dict:
    ids = _ids(setup, b, s, salt=10 + s)

    def call():
        with torch.no_grad():
            fwd(ids, use_cache=False)

    t = time_calls(call, setup.torch_device, warmup, reps)
    return {
        "tokens": b * s,
        "tokens_per_s": b * s / t.median_s,
        "ms_per_step": 1e3 * t.median_s,
        "median_s": t.median_s,
        "times_s": t.times_s,
        "first_call_s": t.first_call_s,
        **_mem(t),
    }


def run_decode(
    model, prov: Provider, setup: Setup, b: int, p: int, n: int, warmup: int, reps: int
) -> dict | str:
    kw = prov.generate_kwargs(setup)
    if isinstance(kw, str):
        return kw
    prompt = _ids(setup, b, p, salt=2)
    dev = setup.torch_device
    one = time_calls(lambda: _generate(model, prompt, 1, **kw), dev, warmup, reps)
    full = time_calls(lambda: _generate(model, prompt, n, **kw), dev, warmup, reps)
    decode_s = full.median_s - one.median_s
    rate = b * (n - 1) / decode_s if n > 1 and decode_s > 0 else None
    return {
        "tokens": b * n,
        "tokens_per_s": rate,
        "ms_per_step": 1e3 * decode_s / (n - 1) if rate else None,
        "generate_tokens_per_s": b * n / full.median_s,
        "generate_s": full.median_s,
        "prefill_s": one.median_s,
        "times_s": full.times_s,
        "prefill_times_s": one.times_s,
        "first_call_s": full.first_call_s,
        "generate_kwargs": kw,
        **_mem(full),
    }


def _ab(model, prov: Provider, rounds: int, measure: Callable[[Provider], dict | str]) -> dict[str, object]:
    """Same-process A/B against HF eager: per round, the provider's change taken off the model
    (prov.suspend: fusekit.hf.unpatch gives back HF's exact modules; Liger's bound methods and module-level
    names are put back) and measured as HF eager, then put back on (prov.resume) and measured. The host's
    speed drifts between and within processes by tens of percent (the isolated rows' ratios carry that);
    alternating in one process cancels most of it. A round either side of which has no step time is
    dropped. Leaves the model as the provider prepared it."""
    ratios, eager_ms, patched_ms = [], [], []
    for _ in range(rounds):
        prov.suspend(model)
        try:
            e = measure(Provider())  # HF as is
        finally:
            prov.resume(model)
        f = measure(prov)
        if isinstance(e, dict) and isinstance(f, dict) and e["ms_per_step"] and f["ms_per_step"]:
            ratios.append(e["ms_per_step"] / f["ms_per_step"])
            eager_ms.append(e["ms_per_step"])
            patched_ms.append(f["ms_per_step"])
    return {
        "ab_vs_eager": statistics.median(ratios) if ratios else None,
        "ab_ratios": ratios,
        "ab_eager_ms_per_step": eager_ms,
        "ab_ms_per_step": patched_ms,
    }


def ab_decode(
    model, prov: Provider, setup: Setup, b: int, p: int, n: int, reps: int, rounds: int
) -> dict[str, object]:
    """_ab of the decode (timed as run_decode does; HF eager with no generate kwargs)."""
    return _ab(model, prov, rounds, lambda pv: run_decode(model, pv, setup, b, p, n, 1, reps))


def ab_train(
    model, prov: Provider, setup: Setup, b: int, s: int, warmup: int, reps: int, rounds: int
) -> dict[str, object]:
    """_ab of the training step (timed as run_train does: a fresh AdamW, the first step untimed). At batch 1
    the step leaves the GPU waiting on the host part of the time, so the host's drift weighs on it most."""
    return _ab(model, prov, rounds, lambda pv: run_train(model, model, pv, setup, b, s, warmup, reps))


def train_step(fwd, model, setup: Setup, b: int, s: int, losses: list | None = None):
    """The train scenario's step on a B x S batch (model put in train mode): zero_grad, forward with
    labels (the model's own loss), backward, AdamW (setup.optim); each loss appended to `losses`."""
    ids, labels = train_batch(setup, b, s)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=setup.optim == "fused")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = fwd(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.detach())

    return step


def run_train(fwd, model, prov: Provider, setup: Setup, b: int, s: int, warmup: int, reps: int) -> dict:
    losses: list[torch.Tensor] = []
    step = train_step(fwd, model, setup, b, s, losses)
    dev = setup.torch_device
    _sync(dev)
    t0 = time.perf_counter()
    with kernel_runs(prov.backend) as runs:
        step()  # the first step on its own: compile, optimizer state, kernels counted
    _sync(dev)
    first = time.perf_counter() - t0
    t = time_calls(step, dev, max(1, warmup - 1), reps)
    losses_f = [float(x) for x in losses]
    model.zero_grad(set_to_none=True)
    model.eval()
    out = {
        "tokens": b * s,
        "tokens_per_s": b * s / t.median_s,
        "ms_per_step": 1e3 * t.median_s,
        "median_s": t.median_s,
        "times_s": t.times_s,
        "first_call_s": first,
        "loss_first": losses_f[0],
        "loss_last": losses_f[-1],
        **_mem(t),
    }
    if prov.backend is not None:
        out["kernel_runs_first_step"] = dict(runs)
    return out


def run_provider(
    prov: Provider,
    setup: Setup,
    scenarios: list[str],
    state: dict,
    ref: Reference,
    warmup: int,
    reps: int,
    deadline: float | None,
    log: Callable[[str], None],
    ab_rounds: int = 0,
    checkpoint: Callable[[dict, list[dict]], None] | None = None,
) -> tuple[dict, list[dict]]:
    """Gate, then time each scenario; returns (provider record, rows). A patched provider's decode and
    train rows also get `ab_rounds` same-process rounds against HF eager (ab_decode, ab_train), where it can
    be unpatched.
    `checkpoint(rec, rows)` is called after the gate and after each row, so a caller can save the rows
    measured so far: a process killed mid-provider (a device call's time limit) keeps them."""
    rec: dict = {"what": prov.what}
    rows: list[dict] = []
    save = checkpoint or (lambda rec, rows: None)

    def all_rows(status: str, reason: str) -> list[dict]:
        return [_row(prov.name, sc, c, status, reason=reason) for sc in scenarios for c in _cases(setup, sc)]

    why = prov.unavailable(setup)
    if why is None and deadline is not None and time.perf_counter() > deadline:
        why = BUDGET_SKIP
    if why is not None:
        rec.update(status="skipped", reason=why)
        return rec, all_rows("skipped", why)
    b, p, n = setup.decode[0]
    gate_ids = _ids(setup, *setup.prefill[0], salt=1)
    prompt = _ids(setup, b, p, salt=2)
    model = None
    try:
        model = fresh_model(setup, state)
        fwd = prov.prepare(model)
        t = time.perf_counter()
        rec["gate"] = g = gate(prov, fwd, model, setup, ref, gate_ids, prompt, n)
        rec["gate_s"] = time.perf_counter() - t  # compile / tuning of the gate's shapes happens here
    except Exception as exc:
        status, msg = _classify(exc)
        rec.update(status=status, reason=msg)
        prov.close()
        del model
        _free()
        return rec, all_rows(status, msg)
    if not g["passed"]:
        reason = "correctness gate failed: " + "; ".join(g["problems"])
        rec.update(status="wrong", reason=reason)
        prov.close()
        del model, fwd
        _free()
        return rec, all_rows("wrong", reason)
    rec["status"] = "ok"
    log(f"  {prov.name}: gate passed (logits rel error {g['logits_rel_error']:.2e})")
    for sc in scenarios:
        for case in _cases(setup, sc):
            save(rec, rows)
            _free()
            if deadline is not None and time.perf_counter() > deadline:
                rows.append(_row(prov.name, sc, case, "skipped", reason=BUDGET_SKIP))
                continue
            try:
                if sc == "prefill":
                    bb, ss = _shapes(case)[0]
                    res = run_prefill(fwd, setup, bb, ss, warmup, reps)
                elif sc == "decode":
                    shape = _decode_shapes(case)[0]
                    res = run_decode(model, prov, setup, *shape, warmup, reps)
                    if ab_rounds and prov.ab and isinstance(res, dict):
                        res.update(ab_decode(model, prov, setup, *shape, reps, ab_rounds))
                else:
                    bb, ss = _shapes(case)[0]
                    res = run_train(fwd, model, prov, setup, bb, ss, warmup, reps)
                    if ab_rounds and prov.ab:
                        res.update(ab_train(model, prov, setup, bb, ss, warmup, reps, ab_rounds))
            except Exception as exc:
                status, msg = _classify(exc)
                rows.append(_row(prov.name, sc, case, status, reason=msg))
                log(f"  {prov.name} {sc} {case}: {status}: {msg[:200]}")
                model.zero_grad(set_to_none=True)
                model.eval()
                continue
            if isinstance(res, str):
                rows.append(_row(prov.name, sc, case, "skipped", reason=res))
                continue
            if sc == "decode" and res["tokens_per_s"] is None:
                res["note"] = "t(N) <= t(1): the decode steps took less than the timing noise (tiny model?)"
            finite = sc != "train" or all(math.isfinite(res[k]) for k in ("loss_first", "loss_last"))
            if not finite:
                rows.append(_row(prov.name, sc, case, "wrong", reason="non-finite training loss", **res))
                continue
            rows.append(_row(prov.name, sc, case, "ok", **res))
            tps = res["tokens_per_s"]
            log(f"  {prov.name} {sc} {case}: " + (f"{tps:,.0f} tok/s" if tps else "ok"))
    save(rec, rows)
    prov.close()
    del model, fwd
    _free()
    return rec, rows
