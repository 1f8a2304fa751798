"""Remembered grad calls (library.GradRunner) give exactly what the first, checked call gives.

The first call of a signature that records a gradient runs the generic autograd.Function; every later one
runs the lean per-op Function built from the spec's autograd glue (save / backward_inputs / input_grads read
once on placeholders). Both must save, select and return the same tensors: outputs and every gradient of
the second call are compared bit for bit with the first's, for each op with all its optional tensors, and
with only some inputs requiring grad. Both Functions are first-order only: create_graph=True gives the same
gradients, and differentiating them again raises naming the op (library.autograd.first_order).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fusekit import library, ops

F32 = torch.float32


def _calls(dev: str) -> dict[str, tuple[Callable[..., object], tuple[torch.Tensor, ...]]]:
    g = torch.Generator(device="cpu").manual_seed(7)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, dtype=F32)).to(dev)

    def norm_weight(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g, dtype=F32)).to(dev)

    def half(*shape: int) -> torch.Tensor:  # attention on a GPU takes fp16 / bf16 only
        return r(*shape).to(F32 if dev == "cpu" else torch.bfloat16)

    target = torch.randint(0, 100, (9,), generator=g).to(dev)
    target[::4] = -100
    return {
        "rms_norm": (
            lambda x, w, res, be: ops.rms_norm(x, w, residual=res, backend=be),
            (r(5, 48), norm_weight(48), r(5, 48)),
        ),
        "layer_norm": (
            lambda x, w, b, res, be: ops.layer_norm(x, w, b, residual=res, backend=be),
            (r(5, 48), norm_weight(48), r(48), r(5, 48)),
        ),
        "rope": (
            lambda q, k, be: ops.rope(q, k, start_pos=3, backend=be),
            (r(2, 5, 4, 16), r(2, 5, 2, 16)),
        ),
        "swiglu_ffn": (
            lambda x, wg, wu, wd, nw, be: ops.swiglu_ffn(x, wg, wu, wd, norm_weight=nw, backend=be),
            (r(6, 32), r(64, 32, scale=0.2), r(64, 32, scale=0.2), r(32, 64, scale=0.2), norm_weight(32)),
        ),
        "attention": (
            lambda q, k, v, be: ops.attention(q, k, v, causal=True, backend=be),
            (half(1, 4, 9, 64), half(1, 2, 11, 64), half(1, 2, 11, 64)),
        ),
        "reduce_sum": (lambda x, be: ops.reduce_sum(x, dim=-1, backend=be), (r(6, 40),)),
        "linear_cross_entropy": (
            lambda x, w, b, be: ops.linear_cross_entropy(x, w, target, b, label_smoothing=0.1, backend=be),
            (r(9, 32), r(100, 32, scale=0.3), r(100)),
        ),
    }


def _step(fn, leaves: tuple[torch.Tensor, ...], backend: str, seed: int):
    outs = fn(*leaves, backend)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device="cpu").manual_seed(seed)
    grads = [torch.randn(o.shape, generator=g, dtype=F32).to(o.device, o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    res = [o.detach().clone() for o in outs], [None if t.grad is None else t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return res, outs


def _op_node(out: torch.Tensor):
    """The op's autograd node behind an output (past a view: linear_cross_entropy's 0-d loss)."""
    node = out.grad_fn
    while type(node).__name__ == "ViewBackward0":
        node = node.next_functions[0][0]
    return node


@pytest.mark.parametrize(
    "op", ["rms_norm", "layer_norm", "rope", "swiglu_ffn", "attention", "reduce_sum", "linear_cross_entropy"]
)
@pytest.mark.parametrize("which", ["all", "first"])
def test_second_grad_call_matches_the_first(op: str, which: str, backend_name: str, device: str) -> None:
    fn, tensors = _calls(device)[op]
    leaves = tuple(t.clone().requires_grad_(which == "all" or i == 0) for i, t in enumerate(tensors))
    library.clear_plans()  # an earlier test in this process (any order, pytest-xdist) may have made this call's memo
    try:
        (outs1, grads1), first = _step(fn, leaves, backend_name, seed=11)
    except ValueError as exc:  # a backend that declares it cannot run this call (dtype, interpreter)
        if "cannot run" in str(exc) or "has no backward here" in str(exc):
            pytest.skip(str(exc))
        raise
    (outs2, grads2), second = _step(fn, leaves, backend_name, seed=11)
    if op != "reduce_sum":  # its gradient is a view of the output grad: no backward phase, no glue
        node1, node2 = _op_node(first[0]), _op_node(second[0])
        assert type(node2).__name__ == f"{op}_fastBackward", type(node2).__name__
        assert type(node1).__name__ != type(node2).__name__
    for a, b in zip(outs1, outs2):
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(grads1, grads2)):
        if which == "first" and i > 0:
            assert a is None and b is None
        else:
            assert a is not None and b is not None and torch.equal(a, b), f"grad of input {i}"
            assert torch.isfinite(a).all()


def test_unused_output_gets_zeros_not_garbage(backend_name: str, device: str) -> None:
    """rms_norm with a residual returns (y, h); a loss on y alone: h's grad is zero on both paths."""
    x, w, res = (t.to(device) for t in (torch.randn(4, 32), torch.rand(32) + 0.5, torch.randn(4, 32)))
    grads = []
    for _ in range(2):
        xl = x.clone().requires_grad_()
        y, _h = ops.rms_norm(xl, w, residual=res, backend=backend_name)
        y.sum().backward()
        grads.append(xl.grad)
    assert torch.equal(grads[0], grads[1]) and torch.isfinite(grads[1]).all()


def _leaves_and_outputs(op: str, backend_name: str, device: str) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Fresh leaves of `op`'s test inputs and its outputs on the backend (skips where it has no backward)."""
    fn, tensors = _calls(device)[op]
    leaves = tuple(t.clone().requires_grad_() for t in tensors)
    try:
        outs = fn(*leaves, backend_name)
    except ValueError as exc:
        if "cannot run" in str(exc) or "has no backward here" in str(exc):
            pytest.skip(str(exc))
        raise
    return leaves, outs if isinstance(outs, tuple) else (outs,)


@pytest.mark.parametrize(
    "op", ["rms_norm", "layer_norm", "rope", "swiglu_ffn", "attention", "linear_cross_entropy"]
)
def test_gradient_of_a_gradient_raises_naming_the_op(op: str, backend_name: str, device: str) -> None:
    """A gradient penalty through an op: create_graph=True returns the plain gradients, and the backward
    of the penalty raises instead of dropping (triton, mojo) or mis-computing (torch: saved outputs taken
    as constants) the second-order term. Twice: the generic Function, then the remembered call's."""
    fn = _calls(device)[op][0]
    for _ in range(2):
        leaves, outs = _leaves_and_outputs(op, backend_name, device)
        g = torch.Generator(device="cpu").manual_seed(5)
        ws = [
            torch.randn(o.shape, generator=g, dtype=F32).to(o.device, o.dtype).requires_grad_() for o in outs
        ]
        loss = sum((o * w).float().sum() for o, w in zip(outs, ws))
        plain = torch.autograd.grad(loss, leaves, retain_graph=True)
        if op == "linear_cross_entropy":  # saves no history of x / weight: raises in the create_graph call
            with pytest.raises(RuntimeError, match=f"fusekit.{op}: its backward is first-order only"):
                torch.autograd.grad(loss, leaves, create_graph=True)
            continue
        twice = torch.autograd.grad(loss, leaves, create_graph=True)
        for a, b in zip(plain, twice):
            assert torch.equal(a, b)
        penalty = sum(t.float().square().sum() for t in twice)
        with pytest.raises(RuntimeError, match=f"fusekit.{op}: its backward is first-order only"):
            penalty.backward()
        # a plain loss: its output gradient requires no grad, and linear_cross_entropy saves only the
        # gradients its forward computed (none requiring grad either): its penalty term was dropped. Where
        # nothing carries history (rope's saved tables, linear_cross_entropy) the create_graph call raises.
        outs = fn(*leaves, backend_name)
        outs = outs if isinstance(outs, tuple) else (outs,)
        with pytest.raises(RuntimeError, match=f"fusekit.{op}: its backward is first-order only"):
            twice = torch.autograd.grad(sum(o.float().sum() for o in outs), leaves, create_graph=True)
            sum(t.float().square().sum() for t in twice).backward()


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "swiglu_ffn", "attention", "linear_cross_entropy"])
def test_gradient_penalty_differentiated_for_one_weight_raises(
    op: str, backend_name: str, device: str
) -> None:
    """torch.autograd.grad(penalty + other terms, weight) after a create_graph=True gradient: the error node
    hung on the results alone had no path to the weight, so autograd pruned it and returned the other terms
    only (rms_norm: exactly 2·w for penalty + |w|², float64 says otherwise), silently. It now also hangs on
    the saved inputs, so reaching the weight reaches it."""
    leaves, outs = _leaves_and_outputs(op, backend_name, device)
    x, weight = leaves[0], leaves[1]
    with pytest.raises(RuntimeError, match=f"fusekit.{op}: its backward is first-order only"):
        (gx,) = torch.autograd.grad(sum(o.float().square().sum() for o in outs), x, create_graph=True)
        torch.autograd.grad(gx.float().square().sum() + weight.float().square().sum(), weight)


def test_rope_tables_that_require_grad_raise_naming_them(backend_name: str, device: str) -> None:
    """rope has no gradient for its cos / sin tables: one that requires grad raises before anything runs
    (its gradient would be dropped), on every backend, whether or not x requires grad."""
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(1, 5, 2, 16, generator=g).to(device)
    ang = torch.arange(5.0)[:, None] * torch.rand(8, generator=g)[None, :]
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    for name, x_grad in (("cos", False), ("sin", True)):
        tables = {"cos": cos, "sin": sin}
        tables[name] = tables[name].clone().requires_grad_()
        with pytest.raises(ValueError, match=f"^{name}: requires grad, but rope has no gradient for {name}"):
            ops.rope(x.clone().requires_grad_(x_grad), **tables, backend=backend_name)
        with torch.no_grad():
            y = ops.rope(x, **tables, backend=backend_name)
        assert torch.equal(y, ops.rope(x, cos=cos, sin=sin, backend=backend_name))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "rope", "swiglu_ffn", "attention", "reduce_sum"])
def test_forward_mode_and_torch_func_transforms_raise_naming_them(
    op: str, backend_name: str, device: str
) -> None:
    """Forward-mode AD: the kernels' outputs would carry no tangent (dropped silently on triton and mojo);
    torch.func transforms: the kernels cannot read wrapped tensors. Both raise, first and repeated calls."""
    import torch.autograd.forward_ad as fwad

    fn, tensors = _calls(device)[op]
    for _ in range(2):
        with fwad.dual_level():
            dual = (fwad.make_dual(tensors[0], torch.ones_like(tensors[0])), *tensors[1:])
            with pytest.raises(ValueError, match=f"carries a forward-mode tangent .* but {op} has no"):
                fn(*dual, backend_name)
        with pytest.raises(ValueError, match=f"^{op}: called inside a torch.func transform"):
            torch.func.vmap(lambda t: fn(t, *tensors[1:], backend_name))(tensors[0][None])
    fn(*tensors, backend_name)  # and outside them, the call runs


@pytest.mark.parametrize("op", ["rms_norm", "attention"])
def test_forward_mode_inside_torch_compile_raises(op: str, backend_name: str, device: str) -> None:
    """Under torch.compile dynamo shows the code plain tensors (a dual input's tangent reads None) and the
    custom op has no jvp: torch.func.jvp returned zeros and a dual_level call no tangent, where eager
    raises. A compiled call under a forward-mode level now raises naming the op."""
    import torch.autograd.forward_ad as fwad

    fn, tensors = _calls(device)[op]
    compiled = torch.compile(lambda *t: fn(*t, backend_name), fullgraph=True, backend="aot_eager")
    tangent = torch.ones_like(tensors[0])

    def dual_call() -> None:
        with fwad.dual_level():
            compiled(fwad.make_dual(tensors[0], tangent), *tensors[1:])

    def jvp_call() -> None:
        def jvp(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return torch.func.jvp(lambda x: fn(x, *tensors[1:], backend_name), (x,), (t,))[1]

        torch.compile(jvp, fullgraph=True, backend="aot_eager")(tensors[0], tangent)

    for call in (jvp_call, dual_call):
        with pytest.raises(Exception) as info:  # dynamo wraps the ValueError
            call()
        chain = [info.value]
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)
        assert any(f"{op}: called under forward-mode AD" in str(e) for e in chain), chain
    torch._dynamo.reset()
