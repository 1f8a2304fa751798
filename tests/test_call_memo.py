"""The hot path (issue #11, item 1): validated calls remembered per signature (`library.call_key`).

A repeated forward-only call skips the checks and the plan search; everything that could make the
remembered plan wrong must take the checked path instead: a gradient to record, a different layout,
dtype, device or scalar, values that the checks read (kv_len on the CPU), non-plain scalars.
"""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
from checks import Allocations

import fusekit
from fusekit import backends, dispatch, library, ops

RMS = sys.modules["fusekit.ops.rms_norm"]
ATT = sys.modules["fusekit.ops.attention"]
MEMO = sys.modules["fusekit.library.memo"]


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the norm checks rms_norm runs (each checked-path call runs them once)."""
    dispatch.clear_cache()
    calls: list[int] = []
    real = RMS.check_norm_inputs

    def spy(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(RMS, "check_norm_inputs", spy)
    return calls


@pytest.fixture
def attention_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the shape checks attention runs (each checked-path call runs them once); plans cleared."""
    dispatch.clear_cache()
    library.clear_plans()
    calls: list[int] = []
    real = ATT._check
    monkeypatch.setattr(ATT, "_check", lambda *a: (calls.append(1), real(*a))[1])
    return calls


def test_repeat_call_skips_checks_and_matches(checks: list[int]) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(64)
    y1 = ops.rms_norm(x, w, backend="torch")
    y2 = ops.rms_norm(x, w, backend="torch")
    assert len(checks) == 1
    assert torch.equal(y1, y2) and y1.data_ptr() != y2.data_ptr()  # fresh outputs every call
    x2 = torch.randn(5, 64)  # new values, same signature: still the memo, and the new answer
    assert torch.equal(
        ops.rms_norm(x2, w, backend="torch"), RMS.SPEC.reference["forward"](x2, None, w, 1e-6, "fp32")[0]
    )
    assert len(checks) == 1


def test_anything_in_the_signature_takes_the_checked_path(checks: list[int]) -> None:
    x, w = torch.randn(6, 32), torch.randn(32)
    ops.rms_norm(x, w, backend="torch")
    ops.rms_norm(x.t().contiguous().t(), w, backend="torch")  # other strides
    ops.rms_norm(x.half(), w.half(), backend="torch")  # other dtype
    ops.rms_norm(x, w, 1e-5, backend="torch")  # other eps
    ops.rms_norm(x, w, backend="torch", casting="llama")  # other casting
    ops.rms_norm(x[:5], w, backend="torch")  # other shape
    assert len(checks) == 6
    with pytest.raises(TypeError, match=r"^weight"):  # a bad call after good ones still raises
        ops.rms_norm(x, w.to(torch.int32), backend="torch")
    with pytest.raises(ValueError, match=r"^eps"):
        ops.rms_norm(x, w, -1.0, backend="torch")


def test_grad_mode_is_part_of_the_key(checks: list[int]) -> None:
    """A plan remembered under no_grad must never serve a call that records a gradient."""
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(16)
    with torch.no_grad():
        ops.rms_norm(x, w, backend="torch")
        y = ops.rms_norm(x, w, backend="torch")
    assert y.grad_fn is None and len(checks) == 1
    y = ops.rms_norm(x, w, backend="torch")
    assert y.grad_fn is not None  # not silently detached
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    g1 = x.grad.clone()
    x.grad = None
    y2 = ops.rms_norm(x, w, backend="torch")  # a grad call is remembered under its own key (GradRunner)
    assert len(checks) == 2
    assert y2.grad_fn is not None  # the remembered grad call still records its gradient
    y2.sum().backward()
    assert torch.equal(x.grad, g1)
    with torch.no_grad():  # ... and never serves a no_grad call, nor the reverse
        assert ops.rms_norm(x, w, backend="torch").grad_fn is None
    assert len(checks) == 2


def test_clear_cache_forgets_memos(checks: list[int]) -> None:
    x, w = torch.randn(3, 8), torch.randn(8)
    ops.rms_norm(x, w, backend="torch")
    ops.rms_norm(x, w, backend="torch")
    dispatch.clear_cache()
    ops.rms_norm(x, w, backend="torch")
    assert len(checks) == 2


def test_memo_path_outputs_are_poisoned_like_the_checked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unwritten outputs show up on the remembered path too (poisoned allocation at call time)."""
    x, w = torch.randn(3, 8), torch.randn(8)
    ops.rms_norm(x, w, backend="torch")  # remembered
    monkeypatch.setattr(backends.get("torch"), "run", lambda *a: None)  # a provider that writes nothing
    with fusekit.poisoned():
        y = ops.rms_norm(x, w, backend="torch")
    assert torch.isnan(y).all()


@pytest.mark.parametrize(
    "op, stats",
    [
        (lambda x, w, b, r: ops.rms_norm(x, w, return_rstd=r, backend="torch"), 1),
        (lambda x, w, b, r: ops.layer_norm(x, w, b, return_stats=r, backend="torch"), 2),
    ],
    ids=["rms_norm", "layer_norm"],
)
def test_remembered_call_writes_dropped_statistics_to_scratch(
    monkeypatch: pytest.MonkeyPatch, op, stats: int
) -> None:
    """A remembered forward call allocates only what it returns: statistics it drops go to the scratch
    arena (outputs.scratch); a call that returns them (its own key) gets fresh ones with the right values."""
    dispatch.clear_cache()
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 64), torch.randn(64), torch.randn(64)
    want = op(x, w, b, True)
    op(x, w, b, False)  # remembered now
    with Allocations() as seen:
        y = op(x, w, b, False)
    assert seen.calls == [(6, 64)]  # y only
    assert torch.equal(y, want[0])
    for _ in range(2):  # the first call of this key is checked, the second remembered: both allocate all
        with Allocations() as seen:
            got = op(x, w, b, True)
        assert len(seen.calls) == 1 + stats
        for g_, w_ in zip(got, want):
            assert torch.equal(g_, w_)
    arena = library.outputs._ARENAS[x.device]
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert all(not lo <= t.data_ptr() < hi for t in got)  # returned statistics are never scratch


def test_scratch_views_do_not_overlap_and_large_ones_are_allocated() -> None:
    f32 = torch.float32
    views = library.outputs.scratch([((5,), f32), ((3, 7), torch.bfloat16), ((1,), f32)], torch.device("cpu"))
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    base = library.outputs._ARENAS[torch.device("cpu")].data_ptr()  # 512-byte aligned on CUDA
    assert all((v.data_ptr() - base) % 256 == 0 for v in views) and [v.shape for v in views] == [
        (5,),
        (3, 7),
        (1,),
    ]
    big = library.outputs.SCRATCH_MAX // 4 + 1
    assert library.outputs.scratch([((big,), f32)], torch.device("cpu")) is None


def test_scratch_arena_grows_to_what_calls_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena starts at SCRATCH_MIN bytes and doubles past a larger request; views handed out before
    keep their (outgrown) arena alive and never overlap the new one."""
    monkeypatch.setattr(library.outputs, "_ARENAS", {})
    cpu, f32 = torch.device("cpu"), torch.float32
    (small,) = library.outputs.scratch([((8,), f32)], cpu)
    assert library.outputs._ARENAS[cpu].numel() == library.outputs.SCRATCH_MIN
    small.fill_(1.0)
    n = 3 * library.outputs.SCRATCH_MIN // 4  # 3x the first arena
    (large,) = library.outputs.scratch([((n,), f32)], cpu)
    assert library.outputs._ARENAS[cpu].numel() == 4 * library.outputs.SCRATCH_MIN
    large.fill_(2.0)
    assert torch.equal(small, torch.ones(8))  # the old view's memory is still its own
    (again,) = library.outputs.scratch([((8,), f32)], cpu)  # fits: no new arena
    assert again.data_ptr() == large.data_ptr()
    big = library.outputs.SCRATCH_MAX // 4
    (top,) = library.outputs.scratch([((big,), f32)], cpu)
    assert library.outputs._ARENAS[cpu].numel() == library.outputs.SCRATCH_MAX == top.numel() * 4


@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_residual", "layer_norm"])
def test_first_call_under_inference_mode_repeats_outside_it(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signature first called under inference_mode (a fresh scratch arena made there) and repeated under
    no_grad and plain grad mode: same outputs. The remembered call writes the dropped statistics into
    scratch views, which were inference tensors that torch refuses to write outside inference_mode."""
    dispatch.clear_cache()
    monkeypatch.setattr(library.outputs, "_ARENAS", {})
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    call = {
        "rms_norm": lambda: ops.rms_norm(x, w, backend="torch"),
        "rms_norm_residual": lambda: ops.rms_norm(x, w, residual=x, backend="torch")[0],
        "layer_norm": lambda: ops.layer_norm(x, w, b, backend="torch"),
    }[op]
    with torch.inference_mode():
        first = call()
    with torch.no_grad():
        assert torch.equal(call(), first)
    assert torch.equal(call(), first)
    with torch.inference_mode():
        assert torch.equal(call(), first)


def test_large_dropped_statistics_are_allocated_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    dispatch.clear_cache()
    monkeypatch.setattr(library.outputs, "SCRATCH_MAX", 256)  # rstd of 65 rows (260 bytes) does not fit
    x, w = torch.randn(65, 8), torch.randn(8)
    ops.rms_norm(x, w, backend="torch")
    with Allocations() as seen:
        ops.rms_norm(x, w, backend="torch")
    assert seen.calls == [(65, 8), (65,)]


def test_values_read_by_checks_are_never_memoized() -> None:
    """kv_len's values are checked on the CPU on every call, however often its signature was seen."""
    q = torch.randn(2, 2, 3, 64)
    k = torch.randn(2, 2, 7, 64)
    good = torch.tensor([7, 4], dtype=torch.int32)
    for _ in range(3):
        ops.attention(q, k, k, kv_len=good, backend="torch")
    with pytest.raises(ValueError, match=r"^kv_len"):
        ops.attention(q, k, k, kv_len=torch.tensor([8, 4], dtype=torch.int32), backend="torch")


def test_non_plain_scalars_take_the_checked_path() -> None:
    assert library.call_key((torch.ones(1),), (torch.tensor(3),), "torch") is None
    assert library.call_key((torch.ones(1),), (3,), ["torch"]) is None
    assert library.call_key(([1.0],), (), "torch") is None
    k1 = library.call_key((torch.ones(1),), (True,), "torch")
    k2 = library.call_key((torch.ones(1),), (1,), "torch")
    assert k1 is not None and k1 != k2  # True and 1 check differently


@pytest.mark.parametrize(
    "call",
    [
        lambda: ops.layer_norm(torch.randn(4, 32), torch.randn(32), torch.randn(32), backend="torch"),
        lambda: ops.reduce_sum(torch.randn(4, 9), -1, backend="torch"),
        lambda: ops.reduce_sum(torch.randn(4, 9), backend="torch"),
        lambda: ops.reduce_sum(torch.randn(4, 9, 2), 1, backend="torch"),
        lambda: ops.attention(
            torch.randn(1, 2, 3, 64), torch.randn(1, 1, 5, 64), torch.randn(1, 1, 5, 64), backend="torch"
        ),
        lambda: ops.attention(
            torch.randn(1, 3, 2, 64),
            torch.randn(1, 5, 1, 64),
            torch.randn(1, 5, 1, 64),
            layout="bshd",
            backend="torch",
        ),
        lambda: ops.swiglu_ffn(
            torch.randn(3, 16),
            torch.randn(24, 16),
            torch.randn(24, 16),
            torch.randn(16, 24),
            norm_weight=torch.randn(16),
            backend="torch",
        ),
    ],
)
def test_every_op_memo_path_equals_checked_path(call) -> None:
    """Same seed, same inputs: the checked first call and the remembered second call agree exactly."""
    dispatch.clear_cache()
    torch.manual_seed(1)
    first = call()
    torch.manual_seed(1)
    second = call()
    assert first.shape == second.shape and torch.equal(first, second)


@pytest.mark.parametrize("view", [False, True], ids=["grown-cat", "cache-view"])
def test_decode_with_a_growing_kv_cache_is_remembered_once(attention_checks: list[int], view: bool) -> None:
    """A decode step whose KV cache grew by one key (HF DynamicCache: torch.cat; or a preallocated cache
    read as a view) is the same call but Skv: validated and planned once, then every length runs through
    one remembered runner that never replays (a replay would bake the recorded Skv in); results equal a
    fresh checked call at every length."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 16, generator=g)
    cache_k, cache_v = torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    outs = []
    with torch.no_grad():
        for n in range(20, 30):
            k, v = cache_k[:, :, :n], cache_v[:, :, :n]
            if not view:
                k, v = k.contiguous(), v.contiguous()
            outs.append((n, k, v, ops.attention(q, k, v, causal=True, backend="torch")))
        assert (
            len(attention_checks) == 1 and len(ATT._MEMO) == 2
        )  # the first call's exact entry + the grown one
        grown = next(r for key, r in ATT._MEMO.items() if key[0] == "grown")
        assert grown.plan.replay is None and grown.plan.calls > library._RECORD_TRIES
        for n, k, v, o in outs:  # each length again, each a fresh checked call
            library.clear_plans()
            ref = ATT.SPEC.reference["forward"](q, k.contiguous(), v.contiguous(), None, True, 0.25)[0]
            assert torch.equal(o, ops.attention(q, k, v, causal=True, backend="torch")), n
            assert torch.allclose(o, ref, rtol=1e-5, atol=1e-6), n
    assert len(attention_checks) == 1 + len(outs)


def test_a_length_that_stops_growing_gets_its_own_runner(attention_checks: list[int]) -> None:
    """Decode steps of a growing cache (L layers per length, then a new length) stay on the grown runner;
    one length repeated far past any earlier run (a fixed-size workload after a call of another size)
    takes the checked path once and then has its own exact, replayable entry; results stay equal."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 1, 16, generator=g)
    cache = torch.randn(1, 2, 200, 16, generator=g)
    with torch.no_grad():
        for layers in (6, 126):  # a small model, then one as deep as Llama-3.1-405B
            for n in range(20, 30):  # 10 decode steps: never promoted
                k = cache[:, :, :n].contiguous()
                for _ in range(layers):
                    ops.attention(q, k, k, backend="torch")
        assert len(attention_checks) == 1
        k = cache[:, :, :150].contiguous()
        want = ops.attention(q, k, k, backend="torch")
        runs = library.SizedRunner.PROMOTE_RUN + 5
        outs = [ops.attention(q, k, k, backend="torch") for _ in range(runs)]
    assert len(attention_checks) == 2  # the promotion: one checked call, then the exact entry
    exact = [
        r for key, r in ATT._MEMO.items() if key[0] != "grown" and library.key_tensor(key, 1)[1][2] == 150
    ]
    assert len(exact) == 1 and type(exact[0]) is library.Runner
    assert all(torch.equal(o, want) for o in outs)


def test_grown_kv_key_keeps_the_checks_that_read_skv() -> None:
    """k and v of different lengths, or no keys at all, still raise after a remembered decode call."""
    library.clear_plans()
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 6, 8)
    with torch.no_grad():
        ops.attention(q, k, k.clone(), backend="torch")
        with pytest.raises(ValueError, match=r"^v"):
            ops.attention(q, k, torch.randn(1, 1, 7, 8), backend="torch")
        with pytest.raises(ValueError, match=r"^k: the key sequence length"):
            ops.attention(q, k[:, :, :0], k[:, :, :0], backend="torch")
        ops.attention(q, k[:, :, :5].contiguous(), k[:, :, :5].contiguous(), backend="torch")  # still fine


def test_backend_variables_are_read_once_and_again_by_clear_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSEKIT_BACKEND* as the process had them at the first resolution: a remembered signature and a new
    one see the same choice (a changed variable reached only new signatures, a remembered call kept the
    old backend); dispatch.clear_cache() reads them again, and a bad value raises naming the variable."""
    monkeypatch.delenv("FUSEKIT_BACKEND", raising=False)
    monkeypatch.delenv("FUSEKIT_BACKEND_REDUCE_SUM", raising=False)
    dispatch.clear_cache()
    x = torch.randn(4, 8)
    ops.reduce_sum(x, -1)
    monkeypatch.setenv("FUSEKIT_BACKEND_REDUCE_SUM", "nonexistent")
    ops.reduce_sum(x, -1)  # remembered
    ops.reduce_sum(torch.randn(5, 8), -1)  # new: the same (unchanged) reading
    dispatch.clear_cache()
    for t in (x, torch.randn(6, 8)):
        with pytest.raises(ValueError, match=r"^FUSEKIT_BACKEND_REDUCE_SUM: unknown backend 'nonexistent'"):
            ops.reduce_sum(t, -1)
    monkeypatch.delenv("FUSEKIT_BACKEND_REDUCE_SUM")
    dispatch.clear_cache()
    ops.reduce_sum(x, -1)


def test_a_clear_during_a_call_keeps_nothing_that_call_resolved(checks: list[int], monkeypatch) -> None:
    """A dispatch.clear_cache() (another thread's, after changing FUSEKIT_BACKEND*) while a call resolves its
    backend: that call's choice, plan and memo entry, made before the clear, are not stored after it, so the
    next call resolves again (reads the variables again) instead of reusing the old choice."""
    x, w = torch.randn(3, 8), torch.randn(8)
    torch_backend = backends.get("torch")
    real_supports = type(torch_backend).supports

    def supports_then_clear(self, *a, **kw):
        why = real_supports(self, *a, **kw)
        dispatch.clear_cache()  # as another thread would, while this call resolves
        return why

    monkeypatch.setattr(type(torch_backend), "supports", supports_then_clear)
    want = ops.rms_norm(x, w, backend="torch")
    assert not dispatch._cache and not library._PLANS
    assert all(not m for m in MEMO._MEMOS)
    monkeypatch.setattr(type(torch_backend), "supports", real_supports)
    torch.testing.assert_close(ops.rms_norm(x, w, backend="torch"), want, rtol=0, atol=0)
    assert len(checks) == 2  # resolved and checked again, not served from a memo
    assert dispatch._cache and library._PLANS  # an undisturbed call is remembered as before
