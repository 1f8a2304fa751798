"""The conformance checks can fail: a provider that skips elements, or computes the wrong thing, is caught."""

from __future__ import annotations

import pytest
import torch
from checks import assert_close

import fusekit
from fusekit import backends, dispatch, ops
from fusekit.backends.torch import TorchBackend


class _SkipsLastRow(TorchBackend):
    name = "torch"

    def rms_norm(self, out, rstd, x, weight, eps):
        super().rms_norm(out[:-1], rstd[:-1], x[:-1], weight, eps)


class _WrongEps(TorchBackend):
    name = "torch"

    def rms_norm(self, out, rstd, x, weight, eps):
        super().rms_norm(out, rstd, x, weight, eps + 1.0)


@pytest.mark.parametrize("provider", [_SkipsLastRow, _WrongEps])
def test_a_broken_provider_fails_the_check(monkeypatch, provider):
    import oracle

    monkeypatch.setitem(backends._INSTANCES, "torch", provider())
    dispatch.clear_cache()
    x, w = torch.randn(8, 64), torch.randn(64)
    with fusekit.poisoned():
        y = ops.rms_norm(x, w, backend="torch")
    dispatch.clear_cache()
    with pytest.raises(AssertionError):
        assert_close("rms_norm", y, oracle.rms_norm(x, w, 1e-6)[0], 2e-5, "self-test")


def test_poisoning_fills_outputs():
    with fusekit.poisoned():
        from fusekit import outputs

        assert torch.isnan(outputs.empty((4,), torch.bfloat16, torch.device("cpu"))).all()
        assert (outputs.empty((4,), torch.int64, torch.device("cpu")) == torch.iinfo(torch.int64).min).all()
