"""DTensor inputs, FSDP2 and tensor parallelism on 2 processes: results equal one process.

    pytest tests/test_distributed.py                                  (CPU, gloo, backend torch: CI)
    pytest tests/test_distributed.py --device cuda --backends triton  (2 GPUs, NCCL; else skipped)

One spawn runs every scenario (process start-up and imports dominate the cost) and reports each one's
outcome; the tests below read those reports. Scenarios:
- ops: rms_norm / layer_norm / rope / attention / swiglu_ffn / reduce_sum on Replicate and Shard
  DTensors, forward and backward, against the same call on the full tensors in one process;
- errors: placements whose local compute would mean something else raise ValueError naming them;
- fsdp2: a tiny HF Llama patched with fusekit.hf.patch(backend="torch") trains 2 SGD steps under
  fully_shard; losses and updated parameters equal the unpatched model's under the same run, and the
  fusekit ops ran;
- fsdp2_bf16: the same in bfloat16 (model.to(torch.bfloat16)), patched, against the patched bf16 model
  trained in one process on every rank's batch: losses and updated parameters equal within bf16
  tolerances (relative error of whole tensors), and fusekit's attention ran (a bf16 model's attention
  is fusekit's on the CPU and on CUDA; two H200s with triton: passed at 8c1e921);
- tp: the patched model under parallelize_module (ColwiseParallel q/k/v/gate/up, RowwiseParallel
  o/down): logits and gradients equal the single-process patched model.
On GPUs (`--device cuda`, two of them) each rank runs on cuda:<rank> with NCCL and the ops on the triton
backend when --backends names it, else torch: float32 for the norms, rope, reduce_sum, swiglu_ffn
and the models but fsdp2_bf16, bfloat16 for attention (fusekit's CUDA attention kernels are fp16/bf16; a
float32 model's attention goes to transformers' own, as fusekit_attention documents: fsdp2_bf16 is
where a model's attention runs fusekit's kernels under FSDP2), head dim 64 (the GPU kernels take
64/128/256).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import time
import traceback
from collections.abc import Iterator

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

from tests.checks import TINY_LLAMA, rel_error  # noqa: E402

WORLD = 2
# Where the workers run; _worker replaces it with the test's (spawned workers import this module afresh).
CFG = {"dist": "gloo", "device": "cpu", "backend": "torch"}
TIMEOUT_S = 150  # the whole spawn; CI must never hang
SCENARIOS = ("ops", "errors", "fsdp2", "fsdp2_eval", "fsdp2_bf16", "tp", "mlp_styles")


# --- helpers (run inside the workers) ------------------------------------------------------------
def _on_gpu() -> bool:
    return CFG["device"] == "cuda"


def _dev(t: torch.Tensor) -> torch.Tensor:
    """t on this rank's device (inputs are drawn on the CPU from seeded generators: the same everywhere)."""
    return t.to(f"cuda:{torch.cuda.current_device()}") if _on_gpu() else t


def _close(a, b, name: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    from torch.distributed.tensor import DTensor

    a = a.full_tensor() if isinstance(a, DTensor) else a
    b = b.full_tensor() if isinstance(b, DTensor) else b
    if a.dtype in (torch.bfloat16, torch.float16):  # a sharded call may pick other tiles: an ulp or two
        rtol, atol = max(rtol, 2e-2), max(atol, 2e-2)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _run_both(fn, full: dict, mesh, placements: dict, grads_of: tuple[str, ...]):
    """fn(**tensors) on the full tensors and on DTensors placed as asked; compares outputs and the grads
    of `grads_of` under a fixed random cotangent."""
    from torch.distributed.tensor import distribute_tensor

    ref_in = {n: t.clone().requires_grad_(n in grads_of) if t is not None else None for n, t in full.items()}
    dt_in = {
        n: None
        if t is None
        else (distribute_tensor(t, mesh, placements[n]) if n in placements else t.clone()).requires_grad_(
            n in grads_of
        )
        for n, t in full.items()
    }
    ref, out = fn(**ref_in), fn(**dt_in)
    ref = ref if isinstance(ref, tuple) else (ref,)
    out = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    cots = [
        torch.randn(r.shape, generator=gen).to(r.device, r.dtype) if r.is_floating_point() else None
        for r in ref
    ]
    loss_ref = sum((r * c).sum() for r, c in zip(ref, cots) if c is not None and r.requires_grad)
    loss_dt = 0
    for o, c in zip(out, cots):
        if c is not None and o.requires_grad:
            cd = distribute_tensor(c, mesh, o.placements) if hasattr(o, "placements") else c
            loss_dt = loss_dt + (o * cd).sum()
    for i, (r, o) in enumerate(zip(ref, out)):
        _close(o, r, f"output {i}")
    if grads_of:
        loss_ref.backward()
        (loss_dt.full_tensor() if hasattr(loss_dt, "full_tensor") else loss_dt).backward()
        for n in grads_of:
            _close(dt_in[n].grad, ref_in[n].grad, f"grad of {n}", rtol=1e-5, atol=1e-5)


def _scenario_ops(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard

    from fusekit import ops

    g = torch.Generator().manual_seed(0)
    rn = lambda *s: _dev(torch.randn(*s, generator=g))
    R, S = Replicate(), Shard
    bk = CFG["backend"]
    hd = 64 if _on_gpu() else 8  # head dim (the GPU kernels take 64/128/256)
    x, res, w, b = rn(4, 6, 16), rn(4, 6, 16), 1 + 0.2 * rn(16), rn(16)
    for p in (R, S(0), S(1)):  # replicated, batch-sharded, sequence-sharded
        _run_both(
            lambda x, residual, weight: ops.rms_norm(
                x, weight, residual=residual, return_rstd=True, backend=bk
            ),
            {"x": x, "residual": res, "weight": w},
            mesh,
            {"x": [p], "residual": [p], "weight": [R]},
            ("x", "residual", "weight"),
        )
        _run_both(
            lambda x, weight, bias: ops.layer_norm(x, weight, bias, backend=bk),
            {"x": x, "weight": w, "bias": b},
            mesh,
            {"x": [p], "weight": [R], "bias": [R]},
            ("x", "weight", "bias"),
        )
    xr = rn(2, 6, 4, hd)  # [B, S, H, D]
    cos, sin = rn(8, hd // 2), rn(8, hd // 2)
    for p in (R, S(0), S(2)):  # replicated, batch, heads
        _run_both(lambda x: ops.rope(x, start_pos=1, backend=bk), {"x": xr}, mesh, {"x": [p]}, ("x",))
        _run_both(
            lambda x, cos, sin: ops.rope(x, cos=cos, sin=sin, backend=bk),
            {"x": xr, "cos": cos, "sin": sin},
            mesh,
            {"x": [p]},
            ("x",),
        )
        _run_both(  # q and k in one call, both placed alike
            lambda x, k: ops.rope(x, k, start_pos=2, backend=bk),
            {"x": xr, "k": rn(2, 6, 2, hd)},
            mesh,
            {"x": [p], "k": [p]},
            ("x", "k"),
        )
    q, k, v = rn(2, 4, 6, hd), rn(2, 2, 6, hd), rn(2, 2, 6, hd)
    if _on_gpu():
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    for p in (R, S(0), S(1)):  # replicated, batch, heads (GQA 4:2 -> 2:1 per rank)
        _run_both(
            lambda q, k, v: ops.attention(q, k, v, causal=True, backend=bk),
            {"q": q, "k": k, "v": v},
            mesh,
            {"q": [p], "k": [p], "v": [p]},
            ("q", "k", "v"),
        )
    xs, wg, wu, wd, nw = rn(3, 5, 16), 0.2 * rn(24, 16), 0.2 * rn(24, 16), 0.2 * rn(16, 24), 1 + 0.1 * rn(16)
    ffn = lambda x, w_gate, w_up, w_down, norm_weight: ops.swiglu_ffn(
        x, w_gate, w_up, w_down, norm_weight=norm_weight, backend=bk
    )
    full = {"x": xs, "w_gate": wg, "w_up": wu, "w_down": wd, "norm_weight": nw}
    names = tuple(full)
    _run_both(ffn, full, mesh, {**{n: [R] for n in names}, "x": [S(0)]}, names)  # data parallel
    tp = {"w_gate": [S(0)], "w_up": [S(0)], "w_down": [S(1)], "norm_weight": [R]}
    _run_both(ffn, full, mesh, {**tp, "x": [R]}, names)  # tensor parallel, x a Replicate DTensor
    _run_both(ffn, full, mesh, tp, names)  # tensor parallel, x a plain (replicated) tensor
    xi = rn(6, 5)
    for p in (R, S(0), S(1)):
        for dim in (None, 0, 1):
            _run_both(lambda x, d=dim: ops.reduce_sum(x, d, backend=bk), {"x": xi}, mesh, {"x": [p]}, ("x",))
    # a bf16 sum over ranks is rounded once, as in one process: rank 0's 1 + 2^-8 rounded to 1 in bf16, then
    # 1 + 2^-8 again (1.0 where the fp32 sum 1 + 2^-7 is exact in bf16)
    from torch.distributed.tensor import distribute_tensor

    xb = torch.tensor([1.0, 2**-8, 2**-8, 0.0])
    for x16, dt in ((xb, torch.bfloat16), (xb.bfloat16(), None)):
        got = ops.reduce_sum(distribute_tensor(_dev(x16), mesh, [S(0)]), dtype=dt, backend=bk).full_tensor()
        assert got.dtype == torch.bfloat16 and got.item() == 1 + 2**-7, got


def _scenario_errors(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fusekit import ops

    def raises(fn, match: str) -> None:
        try:
            fn()
        except ValueError as e:
            assert match in str(e), f"{match!r} not in {e}"
            return
        raise AssertionError(f"no ValueError ({match!r})")

    d = lambda t, p: distribute_tensor(_dev(t), mesh, [p])
    x, w = torch.randn(4, 16), _dev(torch.ones(16))
    raises(
        lambda: ops.rms_norm(d(x, Shard(1)), d(w, Replicate())), "x: placement Shard(1) shards the normalized"
    )
    raises(lambda: ops.layer_norm(d(x, Shard(1)), d(w, Replicate())), "x: placement Shard(1)")
    raises(lambda: ops.rms_norm(d(x, Shard(0)), d(w, Shard(0))), "weight: expected a Replicate DTensor")
    raises(lambda: ops.rms_norm(d(x, Shard(0)), w), "weight: a plain torch.Tensor next to DTensor")
    xr = torch.randn(2, 6, 4, 8)
    raises(lambda: ops.rope(d(xr, Shard(1))), "x: placement Shard(1) shards the sequence")
    raises(lambda: ops.rope(d(xr, Shard(3))), "x: placement Shard(3)")
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 1, 6, 8)
    raises(lambda: ops.attention(d(q, Shard(1)), d(k, Shard(1)), d(k, Shard(1))), "Hkv=1 divisible by 2")
    raises(lambda: ops.attention(d(q, Shard(0)), d(k, Replicate()), d(k, Shard(0))), "k: placements")
    wg = torch.randn(24, 16)
    raises(
        lambda: ops.swiglu_ffn(
            d(x, Replicate()), d(wg, Shard(1)), d(wg, Shard(1)), d(wg.T.contiguous(), Shard(0))
        ),
        "w_gate: placement Shard(1)",
    )
    raises(
        lambda: ops.swiglu_ffn(d(x, Shard(0)), d(wg, Shard(0)), d(wg, Shard(0)), d(wg.T, Shard(1))),
        "x must be",
    )
    # every rank raises alike before a collective where one shard would be empty (the rank whose local op
    # raised alone left the other waiting in the all-reduce until gloo's timeout)
    w1 = torch.randn(1, 16)
    raises(
        lambda: ops.swiglu_ffn(
            d(x, Replicate()), d(w1, Shard(0)), d(w1, Shard(0)), d(w1.T.contiguous(), Shard(1))
        ),
        "w_gate: the hidden dim F (1) sharded 2 ways leaves a rank an empty shard",
    )
    qh, kh = torch.randn(2, 6, 4, 8), torch.randn(2, 6, 1, 8)
    raises(lambda: ops.rope(d(qh, Shard(2)), d(kh, Shard(2))), "k: its head count Hk (1) sharded 2 ways")
    # a sum of per-rank maxima is not a sum (Partial('max') from DTensor.amax was kept pending as one)
    from torch.distributed.tensor import DTensor, Partial

    pmax = DTensor.from_local(_dev(torch.randn(3, 4)), mesh, [Partial("max")], run_check=False)
    raises(lambda: ops.reduce_sum(pmax), "x: placement Partial('max')")
    # linear_cross_entropy takes no DTensor (it failed deep inside with DTensor's own errors)
    raises(
        lambda: ops.linear_cross_entropy(
            d(x, Replicate()), d(wg, Replicate()), d(torch.zeros(4, dtype=torch.long), Replicate())
        ),
        "x: a DTensor",
    )


def _scenario_mlp_styles(mesh) -> None:
    """SwiGLUMLP under parallel styles other than the default Colwise / Rowwise pair (here sequence
    parallel: gate / up take Shard(1) inputs, down returns Shard(1)) runs its three projections, whose
    hooks do the redistribution: fused, a plain x was taken for replicated (0.44 off, silently)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fusekit import nn as fnn

    torch.manual_seed(5)
    ref = fnn.SwiGLUMLP(16, 24, backend=CFG["backend"]).to(_dev(torch.empty(0)).device)
    x = _dev(torch.randn(2, 6, 16))
    want = ref(x)
    for styles, fused in (
        ((ColwiseParallel(), RowwiseParallel()), True),
        ((ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1))), False),
    ):
        m = copy.deepcopy(ref)
        plan = {"gate_proj": styles[0], "up_proj": styles[0], "down_proj": styles[1]}
        parallelize_module(m, mesh, plan)
        from fusekit.nn import mlp

        assert mlp._fusable(m.gate_proj, m.up_proj, m.down_proj) is fused
        if fused:
            _close(m(x), want, "default TP MLP", rtol=1e-5, atol=1e-6)
            # a sequence-sharded DTensor x: the default Colwise hooks redistribute it (the fused op refused it)
            xs = distribute_tensor(x, mesh, [Shard(1)])
            _close(m(xs), want, "default TP MLP on a Shard(1) DTensor x", rtol=1e-5, atol=1e-6)
        else:
            rows = x.chunk(WORLD, dim=1)[dist.get_rank()]
            _close(
                m(rows),
                want.chunk(WORLD, dim=1)[dist.get_rank()],
                "sequence-parallel MLP",
                rtol=1e-5,
                atol=1e-6,
            )


TINY = TINY_LLAMA


def _tiny_config() -> dict:
    return {**TINY, "head_dim": 64} if _on_gpu() else TINY


def _tiny_llama() -> torch.nn.Module:
    """As tests/test_hf.py builds them: a tiny random Llama with non-trivial weights (on this rank's GPU
    in a GPU run: the same weights, drawn on the CPU first)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**_tiny_config()), attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return _dev(model)


@contextlib.contextmanager
def _counting() -> Iterator[dict[str, int]]:
    """Counts the calls of the fusekit ops (and those with a DTensor argument) made inside the block in
    the yielded dict; the ops are put back on exit."""
    from torch.distributed.tensor import DTensor

    from fusekit import ops

    counts: dict[str, int] = {}
    names = ("rms_norm", "swiglu_ffn", "rope", "attention")
    reals = {name: getattr(ops, name) for name in names}
    for name, real in reals.items():

        def wrapper(*a, _real=real, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            if any(isinstance(t, DTensor) for t in (*a, *k.values())):
                counts[f"{_name} on DTensors"] = counts.get(f"{_name} on DTensors", 0) + 1
            return _real(*a, **k)

        setattr(ops, name, wrapper)
    try:
        yield counts
    finally:
        for name, real in reals.items():
            setattr(ops, name, real)


def _keyed_types() -> set[str]:
    """The names of the tensor types that reach fusekit's call memo (where every op starts its own work)
    from now on, collected in the returned set."""
    from fusekit import library

    seen: set[str] = set()
    real = library.call_key

    def call_key(tensors, *a, **k):
        seen.update(type(t).__name__ for t in tensors if t is not None)
        return real(tensors, *a, **k)

    library.call_key = call_key
    return seen


STEPS, LR = 2, 0.5  # the training scenarios' SGD steps


def _batches() -> list[torch.Tensor]:
    """Each rank's input ids (rank r's from seed 10 + r), drawn alike on every rank."""
    return [
        _dev(torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(10 + r)))
        for r in range(WORLD)
    ]


def _trainable(base: torch.nn.Module, patched: bool, mesh=None) -> torch.nn.Module:
    """A copy of `base` in train mode, patched by fusekit.hf if asked, and with a mesh under FSDP2:
    fully_shard on each decoder layer, then on the model."""
    from torch.distributed.fsdp import fully_shard

    import fusekit.hf as fh

    model = copy.deepcopy(base).train()
    if patched:
        fh.patch(model, backend=CFG["backend"])
    if mesh is not None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _sgd(model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """STEPS SGD steps of `model` on the mean of the causal-LM losses of `batches` (one backward each,
    the gradients accumulated: as FSDP2 averages the ranks' gradients, one batch per rank). Returns the
    losses [STEPS, len(batches)] and the updated parameters (full tensors)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        for ids in batches:
            loss = model(ids, labels=ids).loss
            (loss / len(batches)).backward()
            losses.append(loss.detach().float())
        opt.step()
        opt.zero_grad()
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()
    }
    return torch.stack(losses).view(STEPS, len(batches)), params


def _train_counts(attention: bool) -> dict[str, int]:
    """The fusekit op calls of one patched model's STEPS training steps (the backward calls none).
    FSDP2 all-gathers the parameters into plain tensors for each layer's forward: no DTensor reaches an
    op."""
    L = TINY["num_hidden_layers"]
    want = {"rms_norm": STEPS * (2 * L + 1), "swiglu_ffn": STEPS * L, "rope": STEPS * L}
    return {**want, "attention": STEPS * L} if attention else want


def _scenario_fsdp2(mesh) -> None:
    base = _tiny_llama()
    ids = _batches()[dist.get_rank()]
    with _counting() as counts:
        runs = {patched: _sgd(_trainable(base, patched, mesh), [ids]) for patched in (False, True)}
    # a float32 model's attention on CUDA is transformers' own (fusekit_attention's fallback)
    assert counts == _train_counts(attention=not _on_gpu()), counts
    _close(runs[True][0], runs[False][0], "losses", rtol=1e-5, atol=1e-5)
    moved = 0.0
    for n, p in runs[False][1].items():
        _close(runs[True][1][n], p, n, rtol=1e-4, atol=2e-5)
        moved = max(moved, float((p - dict(base.named_parameters())[n].detach()).abs().max()))
    assert moved > 1e-3, "the parameters did not train"


def _scenario_fsdp2_eval(mesh) -> None:
    """An evaluation forward (no_grad) of a patched model under FSDP2, as a training loop's eval step runs it:
    the inference-only fusions (each layer's post-MLP add done by the next norm) must not touch a layer
    whose parameters FSDP2 still holds sharded. Logits as the unpatched FSDP2 model's."""
    base = _tiny_llama()
    ids = _batches()[dist.get_rank()]
    out = {}
    for patched in (False, True):
        model = _trainable(base, patched, mesh).eval()
        with torch.no_grad():
            out[patched] = model(ids).logits.float()
    _close(out[True], out[False], "no_grad logits under FSDP2", rtol=1e-5, atol=1e-5)


def _scenario_fsdp2_bf16(mesh) -> None:
    rank = dist.get_rank()
    base = _tiny_llama().to(torch.bfloat16)
    batches = _batches()
    # the reference: the same patched bf16 model in this one process, on every rank's batch
    want_losses, want_params = _sgd(_trainable(base, True), batches)
    with _counting() as counts:
        losses, params = _sgd(_trainable(base, True, mesh), [batches[rank]])
    # bf16 attention is fusekit's on both devices (on the CPU through the torch backend, on CUDA through
    # the backend under test)
    assert counts == _train_counts(attention=True), counts
    # Tolerances (checks.rel_error: relative error of the whole tensor). Each rank runs the reference's
    # ops on the same shapes and inputs, and FSDP2's gradient average of 2 ranks (power-of-2 scalings, one
    # bf16 rounding of a sum of two) matches the reference's accumulation of loss / 2: on the CPU the two
    # runs are bitwise equal. What may differ on a GPU is rounding (atomics, the collective's order): an
    # ulp here and there of a bf16 parameter, whose ulp is at most 2^-7 of its value. So
    # - every updated parameter within 2e-2: 2.5x the 7.8e-3 of every element one ulp off;
    # - the losses within 2e-2 (float32 losses of bf16 forwards over such parameters; the first step's
    #   see the same weights);
    # - the update of all parameters together (p - p0, concatenated) within 0.25: every element one ulp
    #   off would give 0.08 here (the updates are ~7% of the weights), a gradient not averaged over
    #   the ranks (each rank's own, or their sum) gives ~1. A parameter's own update is not checked:
    #   a norm weight near 1 moves one or two bf16 ulps in these 2 steps.
    err = rel_error(losses[:, 0], want_losses[:, rank])
    assert err <= 2e-2, (
        f"losses: rel err {err:.1e}: {losses[:, 0].tolist()} vs {want_losses[:, rank].tolist()}"
    )
    init = {n: p.detach() for n, p in base.named_parameters()}
    for n, want in want_params.items():
        assert (err := rel_error(params[n], want)) <= 2e-2, f"{n}: rel err {err:.1e}"
    flat = lambda ps: torch.cat([ps[n].float().flatten() for n in init])
    p0 = flat(init)
    moved, want_moved = flat(params) - p0, flat(want_params) - p0
    assert (err := rel_error(moved, want_moved)) <= 0.25, f"parameter updates: rel err {err:.2f}"
    assert float(want_moved.norm() / p0.norm()) > 1e-2, "the parameters did not train"


def _scenario_tp(mesh) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fusekit.hf as fh

    ref = fh.patch(_tiny_llama().eval(), backend=CFG["backend"])
    model = copy.deepcopy(ref)
    plan = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({f"model.layers.*.mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")})
    plan["model.layers.*.self_attn.o_proj"] = RowwiseParallel()
    plan["model.layers.*.mlp.down_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    assert isinstance(model.model.layers[0].mlp.gate_proj.weight, DTensor)
    ids = _dev(torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3)))
    keyed = _keyed_types()
    with _counting() as counts:
        out, want = model(ids).logits, ref(ids).logits
    L = TINY["num_hidden_layers"]
    # RowwiseParallel's outputs (o_proj, down_proj) and the TP swiglu_ffn's all-reduce are
    # AsyncCollectiveTensors: waited for before any op reads them (a kernel must not launch on one)
    assert keyed and not any("AsyncCollectiveTensor" in t for t in keyed), sorted(keyed)
    # both models run on fusekit; under TP the MLP gets DTensor weights (the projections' hooks give the
    # attention plain local heads)
    assert counts["swiglu_ffn"] == 2 * L and counts["swiglu_ffn on DTensors"] == L, counts
    if not _on_gpu():  # float32 attention on CUDA is transformers' own (see _scenario_fsdp2)
        assert counts["attention"] == 2 * L and "attention on DTensors" not in counts, counts
    _close(out, want, "logits", rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    want.square().mean().backward()
    for n, p in ref.named_parameters():
        q = dict(model.named_parameters())[n]
        _close(q.grad, p.grad, f"grad of {n}", rtol=1e-4, atol=1e-5)


def _worker(rank: int, port: int, outdir: str, cfg: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    CFG.update(cfg)
    torch.set_num_threads(1)
    kw = {}
    if _on_gpu():
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(CFG["dist"], rank=rank, world_size=WORLD, **kw)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(CFG["device"], (WORLD,))
    report = {}
    for name in SCENARIOS:
        try:
            globals()[f"_scenario_{name}"](mesh)
            report[name] = "ok"
        except Exception:  # reported to the test
            report[name] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    # both ranks done before either tears gloo down: a rank that closes its connections while the other
    # is still in its last collective can abort the other process (SIGABRT seen once in CI at a72d63c)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(device: str, backends: list[str]) -> dict:
    """gloo + torch on the CPU; on CUDA NCCL + the first GPU backend asked for (triton, else torch)."""
    if device != "cuda":
        return dict(CFG)
    if torch.cuda.device_count() < WORLD or not dist.is_nccl_available():
        pytest.skip(f"--device cuda needs {WORLD} GPUs and NCCL (torch.cuda.device_count() >= {WORLD})")
    return {"dist": "nccl", "device": "cuda", "backend": "triton" if "triton" in backends else "torch"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory, device, pytestconfig) -> list[dict]:
    from conftest import selected_backends

    pytest.importorskip("transformers")
    cfg = _cfg(device, selected_backends(pytestconfig))
    outdir = str(tmp_path_factory.mktemp("dist"))
    ctx = mp.start_processes(
        _worker, args=(_free_port(), outdir, cfg), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {WORLD}-process run did not finish in {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    out = []
    for r in range(WORLD):
        with open(os.path.join(outdir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_processes_equal_one(reports, scenario):
    for rank, rep in enumerate(reports):
        assert rep[scenario] == "ok", f"rank {rank}:\n{rep[scenario]}"


def test_plain_tensors_skip_the_dtensor_path():
    """Plain tensors (and Parameters) never reach fusekit.distributed: the type check is a set lookup."""
    from fusekit import distributed, ops

    x, w = torch.randn(3, 8), torch.nn.Parameter(torch.ones(8))
    assert type(x) in distributed.PLAIN and type(w) in distributed.PLAIN
    assert distributed.rms_norm(x, w, 1e-6, None, "fp32", False, "torch") is None
    torch.testing.assert_close(
        ops.rms_norm(x, w, backend="torch"), ops.rms_norm(x, w.detach(), backend="torch")
    )
