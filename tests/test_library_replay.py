"""library._launch: when a plan records a replay (Backend.record), uses it, and falls back to the provider.

Pure Python with a stand-in plan and provider (CPU plans never record: only a CUDA plan has launches
worth replaying), so the call-count rules run in CI: call 1 runs normally (it may compile and tune),
calls 2..4 record until one recording succeeds, later calls replay, and a replay that refuses a call
(a pointer whose alignment changed) sends that call through the provider without re-recording.
"""

from __future__ import annotations

from types import SimpleNamespace

from fusekit import library


class _Provider:
    def __init__(self, succeed_on: int | None) -> None:
        self.log: list[str] = []
        self.succeed_on, self.records = succeed_on, 0

    def run(self, spec, phase, outs, inputs, scalars) -> None:
        self.log.append("run")

    def record(self, spec, phase, outs, inputs, scalars):
        self.records += 1
        self.log.append("record")
        if self.records != self.succeed_on:
            return None

        def replay(o, i) -> bool:
            ok = i[0] != "misaligned"
            self.log.append("replay" if ok else "refused")
            return ok

        return replay


def _plan(provider: _Provider) -> SimpleNamespace:
    return SimpleNamespace(provider=provider, kscalars=(), replay=None, calls=0)


def _calls(plan, n: int, inputs=("x",)) -> None:
    for _ in range(n):
        library._launch(None, "forward", plan, (), inputs)


def test_records_on_calls_two_to_four_then_replays() -> None:
    p = _Provider(succeed_on=2)
    plan = _plan(p)
    _calls(plan, 5)
    assert p.log == ["run", "record", "record", "replay", "replay"]


def test_gives_up_after_three_failed_recordings() -> None:
    p = _Provider(succeed_on=None)
    plan = _plan(p)
    _calls(plan, 7)
    assert p.log == ["run", "record", "record", "record", "run", "run", "run"] and plan.replay is None


def test_refused_replay_runs_the_provider() -> None:
    p = _Provider(succeed_on=1)
    plan = _plan(p)
    _calls(plan, 3)
    _calls(plan, 1, inputs=("misaligned",))
    _calls(plan, 1)
    assert p.log == ["run", "record", "replay", "refused", "run", "replay"]


def test_cpu_plans_never_record() -> None:
    p = _Provider(succeed_on=1)
    plan = _plan(p)
    plan.calls = library._RECORD_TRIES + 1  # what _Plan sets for a plan without a device guard
    _calls(plan, 4)
    assert p.log == ["run"] * 4


def test_real_cpu_plan_is_set_up_not_to_record() -> None:
    import torch

    from fusekit import ops

    library.clear_plans()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 16, generator=g), torch.randn(16, generator=g)
    for _ in range(5):
        ops.rms_norm(x, w, backend="torch")
    plans = list(library._PLANS.values())
    assert plans and all(p.replay is None and p.calls > library._RECORD_TRIES for p in plans)


def test_calls_whose_outputs_are_inputs_never_record_or_replay() -> None:
    """An eager backward that writes its outputs into its inputs (Phase.reuse) may launch other kernels
    than a call with fresh outputs (linear_cross_entropy's backward skips an in-place scale by 1): a
    replay recorded on one kind of call must not serve the other. Aliased calls go through the provider
    and leave the plan's replay (recorded on unaliased calls) alone."""
    p = _Provider(succeed_on=1)
    plan = _plan(p)
    for _ in range(3):
        library._launch(None, "backward", plan, (), ("x",), aliased=True)
    assert p.log == ["run"] * 3 and plan.replay is None and plan.calls == 0
    _calls(plan, 3)
    library._launch(None, "backward", plan, (), ("x",), aliased=True)
    assert p.log == ["run"] * 3 + ["run", "record", "replay", "run"]
