"""Every validation error: the right exception type, and a message that names the argument."""

from __future__ import annotations

import importlib

import pytest
import torch

from fusekit import ops

F32, BF16 = torch.float32, torch.bfloat16
x2 = torch.randn(4, 8)
w8 = torch.randn(8)


def _raises(exc: type[Exception], match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        # reduce_sum
        (lambda: ops.reduce_sum([1, 2]), TypeError, r"^x: expected a torch.Tensor, got list"),
        (
            lambda: ops.reduce_sum(torch.randn(3, dtype=torch.complex64)),
            TypeError,
            r"^x: dtype complex64 is not supported",
        ),
        (lambda: ops.reduce_sum(torch.ones(3, dtype=torch.bool)), TypeError, r"^x: dtype bool"),
        (lambda: ops.reduce_sum(x2, dim=2), ValueError, r"^dim: 2 is out of range"),
        (lambda: ops.reduce_sum(x2, dim=1.0), TypeError, r"^dim: expected None or an int"),
        (
            lambda: ops.reduce_sum(x2, dtype=torch.int64),
            TypeError,
            r"^dtype: torch.int64 is not supported for a float32",
        ),
        (
            lambda: ops.reduce_sum(x2.int(), dtype=F32),
            TypeError,
            r"^dtype: torch.float32 is not supported for a int32",
        ),
        # rms_norm
        (
            lambda: ops.rms_norm(x2.half(), w8.to(BF16)),  # fp16 x: its own dtype or fp32
            TypeError,
            r"^weight: dtype bfloat16 is not supported; expected one of float16, float32",
        ),
        (lambda: ops.rms_norm(x2, torch.randn(7)), ValueError, r"^weight: expected shape \(8,\), got \(7,\)"),
        (lambda: ops.rms_norm(x2, w8, eps=-1.0), ValueError, r"^eps: must be non-negative"),
        (lambda: ops.rms_norm(x2, w8, eps="1e-6"), TypeError, r"^eps: expected a number"),
        (lambda: ops.rms_norm(x2.int(), w8), TypeError, r"^x: dtype int32 is not supported"),
        (
            lambda: ops.rms_norm(torch.randn(4, 0), torch.randn(0)),
            ValueError,
            r"^x: the last \(normalized\) dimension",
        ),
        (lambda: ops.rms_norm(torch.tensor(1.0), w8), ValueError, r"^x: expected at least 1 dimension"),
        (lambda: ops.rms_norm(x2, w8, backend=3), TypeError, r"^backend: expected a string"),
        # layer_norm
        (lambda: ops.layer_norm(x2, w8, torch.randn(9)), ValueError, r"^bias: expected shape \(8,\)"),
        (lambda: ops.layer_norm(x2.bfloat16(), w8, w8.half()), TypeError, r"^bias: dtype float16"),
        (lambda: ops.layer_norm(x2, w8[None]), ValueError, r"^weight: expected shape"),
        # rope
        (lambda: ops.rope(torch.randn(2, 3, 4)), ValueError, r"^x: expected 4 dimensions"),
        (
            lambda: ops.rope(torch.randn(1, 2, 2, 7)),
            ValueError,
            r"^x: head dim \(last dimension\) must be even",
        ),
        (lambda: ops.rope(torch.randn(1, 2, 2, 8), start_pos=-1), ValueError, r"^start_pos: must be >= 0"),
        (lambda: ops.rope(torch.randn(1, 2, 2, 8), start_pos=1.5), TypeError, r"^start_pos: expected an int"),
        (lambda: ops.rope(torch.randn(1, 2, 2, 8), theta=0.0), ValueError, r"^theta: must be positive"),
        (
            lambda: ops.rope(torch.randn(1, 2, 2, 8), cos=torch.randn(2, 4)),
            ValueError,
            r"^cos, sin: give both",
        ),
        (
            lambda: ops.rope(torch.randn(1, 4, 2, 8), cos=torch.randn(3, 4), sin=torch.randn(3, 4)),
            ValueError,
            r"^cos: expected shape \[>= start_pos \+ S = 4, D/2 = 4\]",
        ),
        (
            lambda: ops.rope(torch.randn(1, 2, 2, 8), cos=torch.randn(2, 4), sin=torch.randn(2, 3)),
            ValueError,
            r"^sin: expected shape",
        ),
        (
            lambda: ops.rope(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 8)),
            ValueError,
            r"^k: expected 4 dimensions",
        ),
        (
            lambda: ops.rope(torch.randn(1, 2, 2, 8), torch.randn(1, 3, 1, 8)),
            ValueError,
            r"^k: expected \[B=1, S=2, Hk >= 1, D=8\]",
        ),
        (
            lambda: ops.rope(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 1, 8).double()),
            ValueError,
            r"^k: dtype float64 differs from x's float32",
        ),
        (lambda: ops.rope(torch.randn(1, 2, 2, 8), [1.0]), TypeError, r"^k: expected a torch.Tensor"),
        # swiglu_ffn
        (
            lambda: ops.swiglu_ffn(x2, torch.randn(6, 8), torch.randn(6, 8), torch.randn(6, 8)),
            ValueError,
            r"^w_down: expected shape \(8, 6\)",
        ),
        (
            lambda: ops.swiglu_ffn(x2, torch.randn(6, 7), torch.randn(6, 8), torch.randn(8, 6)),
            ValueError,
            r"^w_gate: expected shape \(6, 8\)",
        ),
        (
            lambda: ops.swiglu_ffn(x2, torch.randn(6, 8), torch.randn(5, 8), torch.randn(8, 6)),
            ValueError,
            r"^w_up: expected shape",
        ),
        (
            lambda: ops.swiglu_ffn(
                x2, torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6), norm_weight=torch.randn(3)
            ),
            ValueError,
            r"^norm_weight: expected shape \(8,\)",
        ),
        (
            lambda: ops.swiglu_ffn(x2, torch.randn(6, 8).half(), torch.randn(6, 8), torch.randn(8, 6)),
            TypeError,
            r"^w_gate: dtype float16",
        ),
        # attention
        (
            lambda: ops.attention(torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 0), torch.randn(1, 2, 4, 0)),
            ValueError,
            r"^q: the head dim D must be > 0",
        ),
        (
            lambda: ops.attention(
                torch.randn(1, 3, 4, 64), torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64)
            ),
            ValueError,
            r"^k: q heads H=3 must be a multiple of kv heads Hkv=2",
        ),
        (
            lambda: ops.attention(
                torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), torch.randn(1, 2, 5, 64)
            ),
            ValueError,
            r"^v: expected shape \(1, 2, 4, 64\)",
        ),
        (
            lambda: ops.attention(
                torch.randn(1, 2, 4, 64), torch.randn(2, 2, 4, 64), torch.randn(2, 2, 4, 64)
            ),
            ValueError,
            r"^k: expected shape \[B=1",
        ),
        (
            lambda: ops.attention(
                torch.randn(1, 2, 4, 64), torch.randn(1, 2, 0, 64), torch.randn(1, 2, 0, 64)
            ),
            ValueError,
            r"^k: the key sequence length Skv must be > 0",
        ),
        (
            lambda: ops.attention(
                torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64).half(), torch.randn(1, 2, 4, 64)
            ),
            TypeError,
            r"^k: dtype float16",
        ),
        (
            lambda: ops.attention(
                torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), scale=-1.0
            ),
            ValueError,
            r"^scale: must be positive",
        ),
        (
            lambda: ops.attention(torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.randn(2, 4, 64)),
            ValueError,
            r"^q: expected 4 dimensions",
        ),
        # backend names
        (
            lambda: ops.rms_norm(x2, w8, backend="cuda"),
            ValueError,
            r"^backend: unknown backend 'cuda'; valid names are: auto, torch, triton, mojo",
        ),
    ],
)
def test_validation_errors(call, exc, match):
    _raises(exc, match, call)


def test_meta_device_rejected():
    with pytest.raises(ValueError, match=r"^x: device meta is not supported"):
        ops.rms_norm(torch.randn(2, 8, device="meta"), torch.randn(8, device="meta"))


def test_fp32_attention_rejected_on_cuda():
    # validation reads only q.device; a meta-like stand-in is not enough, so check the rule directly
    check = importlib.import_module("fusekit.ops.attention")._check

    class FakeCuda(torch.Tensor):
        @property
        def device(self):  # type: ignore[override]
            return torch.device("cuda", 0)

    q = torch.randn(1, 2, 4, 64).as_subclass(FakeCuda)
    with pytest.raises(TypeError, match=r"^q: float32 attention runs on the CPU only"):
        check(q, q, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to mix devices")
def test_mixed_devices_rejected():
    with pytest.raises(ValueError, match=r"^weight: is on cpu but x is on cuda"):
        ops.rms_norm(torch.randn(2, 8, device="cuda"), torch.randn(8))


def test_empty_inputs_give_correct_empty_results():
    assert ops.reduce_sum(torch.randn(0)).item() == 0.0
    assert ops.reduce_sum(torch.zeros(0, dtype=torch.int32)).dtype == torch.int64
    assert torch.equal(ops.reduce_sum(torch.randn(3, 0), -1), torch.zeros(3))
    assert ops.rms_norm(torch.randn(0, 16), torch.randn(16)).shape == (0, 16)
    y, m, r = ops.layer_norm(torch.randn(2, 0, 16), torch.randn(16), return_stats=True)
    assert y.shape == (2, 0, 16) and m.shape == (2, 0) and r.shape == (2, 0)
    assert ops.rope(torch.randn(0, 3, 2, 8)).shape == (0, 3, 2, 8)
    assert ops.attention(
        torch.randn(1, 2, 0, 64), torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    ).shape == (1, 2, 0, 64)
