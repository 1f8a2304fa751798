"""The Mojo kernels' GPU scratch memory is the caller's (specs.Workspace), never a MAX allocation.

After a MAX device-graph capture, a kernel that allocated a device buffer (`ctx.enqueue_create_buffer`)
made MAX reserve ~90% of the free GPU memory, so the kernels take workspaces that the dispatcher
allocates with torch, sized in Python from the call. Checked here on the CPU: no op file allocates, the
Mojo signatures take the workspaces where the specs put them, the constants the size functions mirror
match the kernels', and the sizes are at least what each kernel's launch plan needs, against a literal
transcription of that plan, for SM counts from 78 to 304. On a GPU the kernels also
check the lengths they are given (`check_workspace` in mojo/_util.mojo).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusekit.backends.mojo import specs
from fusekit.backends.mojo.dispatch import DeviceState
from fusekit.backends.mojo.runtime import Compiled

ROOT = Path(__file__).resolve().parents[1]
MOJO = ROOT / "mojo"
SMS = (78, 132, 304)  # multi_processor_count: a smaller part, an H100 SXM, an MI300X (CUs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _meta(*shape: int, dtype: torch.dtype = torch.float32, aligned: bool = True) -> torch.Tensor:
    """A shape-only tensor; unaligned: its data starts one element past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    base = torch.empty(n + 1, dtype=dtype, device="meta")
    return (base[:n] if aligned else base[1:]).view(shape)


# --- the sources -----------------------------------------------------------------------------------
def _op_files() -> list[Path]:
    # the op package and its lazy subpackage tc/; mojo/harness/ (test drivers) may allocate
    return sorted(MOJO.glob("*.mojo")) + sorted(MOJO.glob("tc/*.mojo"))


def test_no_op_allocates_device_memory() -> None:
    calls = re.compile(r"enqueue_create_buffer\s*[\[(]")
    offenders = [
        f"{f.name}:{i}"
        for f in _op_files()
        for i, ln in enumerate(f.read_text().splitlines(), 1)
        if calls.search(ln)
    ]
    assert not offenders, (
        f"kernels must take a caller-owned workspace (specs.Workspace), not allocate: {offenders}"
    )


def _execute_params() -> dict[str, list[tuple[str, str]]]:
    """Registered op name -> its execute's (parameter, type) pairs, in order."""
    res = {}
    for f in _op_files():
        for block in f.read_text().split('@register("')[1:]:
            name = block.split('"')[0]
            sig = block[block.index("def execute[") :]
            sig = sig[sig.index("](") + 2 : sig.index("ctx: DeviceContext")]
            res[name] = re.findall(r"(\w+): (\w+)\[", sig)
    return res


# Every MAX op the backend calls: reduce_sum's gradient is a view (no kernel), swiglu_ffn's backward calls
# the element-wise op SWIGLU_FFN_BACKWARD between torch matmuls, linear_cross_entropy's forward its row
# kernel LINEAR_CROSS_ENTROPY_ROWS per chunk (its backward: torch multiplies).
_CALLED = [
    (op, "forward") for op in ("reduce_sum", "rms_norm", "layer_norm", "rope", "attention", "swiglu_ffn")
] + [(op, "backward") for op in ("rms_norm", "layer_norm", "rope", "attention")]


def test_mojo_signatures_take_the_workspaces_after_the_outputs() -> None:
    params = _execute_params()
    assert set(specs.WORKSPACES) <= set(params), set(specs.WORKSPACES) - set(params)
    called = [specs.phase_spec(op, phase) for op, phase in _CALLED]
    for ms in [*called, specs.SWIGLU_FFN_BACKWARD, specs.LINEAR_CROSS_ENTROPY_ROWS]:
        got = params[ms.max_op]
        n_out, n_ws = len(ms.outputs), len(ms.workspaces)
        assert len(got) == n_out + n_ws + len(ms.inputs) + bool(ms.params), (ms.max_op, got)
        ws = got[n_out : n_out + n_ws]
        assert [name for name, _ in ws] == [w.name for w in ms.workspaces], (ms.max_op, got)
        assert all(kind == "MutableInputTensor" for _, kind in got[: n_out + n_ws]), (ms.max_op, got)
        assert all(kind == "InputTensor" for _, kind in got[n_out + n_ws :]), (ms.max_op, got)


def _comptime(file: str, name: str) -> str:
    m = re.search(rf"^comptime {name} = ([^#\n]+)", (MOJO / file).read_text(), flags=re.M)
    assert m, f"comptime {name} not found in mojo/{file}"
    return m.group(1).strip()


def test_mirrored_constants_match_the_kernels() -> None:
    assert int(_comptime("reduce_sum.mojo", "BLOCK")) == specs.RS_BLOCK
    assert int(_comptime("reduce_sum.mojo", "WARP_ROW_MAX")) == specs.RS_WARP_ROW_MAX
    assert int(_comptime("reduce_sum.mojo", "UNROLL")) == specs.RS_UNROLL
    assert int(_comptime("_norm_backward.mojo", "REG_ELEMS")) == specs.NB_REG_ELEMS
    assert int(_comptime("_norm_backward.mojo", "LOOP_BLK")) == specs.NB_LOOP_BLK
    assert int(_comptime("_norm_backward.mojo", "PIPE_COLS")) == specs.NB_PIPE_COLS
    assert int(_comptime("swiglu_ffn.mojo", "DECODE_MAX_T")) == specs.SW_DECODE_MAX_T
    assert int(_comptime("swiglu_ffn.mojo", "TC_MIN_T")) == specs.SW_TC_MIN_T
    assert int(_comptime("swiglu_ffn.mojo", "TC_PAD")) == specs.SW_TC_PAD
    pairs = re.findall(r"\((\d+),\s*(\d+)\)", _comptime("tc/swiglu_ffn_tc.mojo", "_STATIC_DF"))
    assert tuple((int(d), int(f)) for d, f in pairs) == specs.SW_STATIC_DF


# --- sizes against the kernels' launch plans ---------------------------------------------------------
def _reduce_sum_need(m: int, n: int, sms: int, itemsize: int) -> int:
    """mojo/reduce_sum.mojo reduce_sum_gpu: the partials it writes (m * splits when rows are split)."""
    vw = 16 // itemsize
    if n <= 2048:  # WARP_ROW_MAX: one warp per row
        return 0
    wave = sms * (2048 // 256)
    splits = 1
    if m < wave:
        splits = max(1, min(_cdiv(wave, m), n // (256 * vw * 8 * 2)))
    if splits == 1:
        return 0
    chunk = _cdiv(_cdiv(n, splits), vw) * vw
    splits = _cdiv(n, chunk)
    return m * splits


@pytest.mark.parametrize("sms", SMS)
def test_reduce_sum_partials_bound(sms: int) -> None:
    wave = sms * 8
    ms = sorted(set(range(1, 2 * wave + 2, 7)) | {1, 2, 3, wave - 1, wave, wave + 1})
    for itemsize in (1, 2, 4, 8):
        for n in (1, 2048, 2049, 4097, 65535, 65536, 1 << 20, 3000017, 1 << 30):
            for m in ms:
                need = _reduce_sum_need(m, n, sms, itemsize)
                x = SimpleNamespace(shape=(m, n), element_size=lambda s=itemsize: s)
                got = specs.reduce_sum_partials((None,), (x,), sms)
                assert need <= got <= wave + m, (m, n, sms, itemsize, need, got)
                assert (got == 0) == (need == 0), (m, n, sms, itemsize, need, got)  # no unused workspace


def _norm_bwd_need(
    m: int, n: int, sms: int, itemsize: int, aligned: bool, ln: bool, nvidia: bool = False
) -> dict[str, int]:
    """mojo/_norm_backward.mojo norm_bwd_gpu: the row sums and [P, N] partials it writes (nvidia: the
    kernels built for an NVIDIA GPU, where rms_norm's 16-bit rows up to 16 K take the cp.async kernel)."""
    vw = 16 // itemsize
    vec_ok = n % vw == 0 and aligned
    pipe = nvidia and not ln and itemsize == 2 and vec_ok and n <= 1024 * 16
    nvp = 16 // vw if pipe else max(1, 8 // vw)  # vectors per thread of the whole-row kernel
    nv = n // vw
    sums = 0
    if not vec_ok:
        blk = 128 if n <= 4096 else 512
        progs = min(m, sms * (1024 // blk))
    elif nv > 1024 * nvp:
        sums = 2 * m
        chunks = _cdiv(nv, 1024 * nvp)
        progs = max(1, min(m, _cdiv(sms, chunks)))
    else:
        blk = 64
        while blk * nvp < nv:
            blk *= 2
        progs = min(m, sms * max(1, 1024 // blk))
    need = {"sums": sums, "part_w": progs * n}
    if ln:
        need["part_b"] = progs * n
    return need


def _sizes(ms: specs.OpSpec, outs: tuple, ins: tuple, sms: int) -> dict[str, int]:
    return {w.name: w.size(outs, ins, sms) for w in ms.workspaces}


@pytest.mark.parametrize("nvidia", (False, True), ids=("other", "nvidia"))
@pytest.mark.parametrize("ln", (False, True), ids=("rms_norm", "layer_norm"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_norm_backward_partials_bound(
    ln: bool, dtype: torch.dtype, nvidia: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(specs, "_on_nvidia", lambda t: nvidia)  # meta tensors stand for the GPU's
    ms = specs.phase_spec("layer_norm" if ln else "rms_norm", "backward")
    for sms in SMS:
        for m in (1, 2, 7, 100, 1000, 5000, 40000):
            for n in (
                1,
                3,
                8,
                33,
                760,
                1024,
                4096,
                4097,
                8192,
                8200,
                16376,
                16384,
                16392,
                24576,
                65536,
                100000,
            ):
                for aligned in (True, False):
                    x = _meta(m, n, dtype=dtype)
                    dx = _meta(m, n, dtype=dtype, aligned=aligned)  # one misaligned pointer is enough
                    w = _meta(n, dtype=dtype)
                    outs = (dx, w, w) if ln else (dx, w)
                    dh = specs.dummy(dtype, 2, 0)
                    ins = (x, dh, x, w, _meta(m), _meta(m)) if ln else (x, dh, x, w, _meta(m))
                    need = _norm_bwd_need(m, n, sms, dx.element_size(), aligned, ln, nvidia)
                    got = _sizes(ms, outs, ins, sms)
                    # exact: the size functions mirror the plan (a bound would waste [P, N] fp32 rows)
                    assert got == need, (m, n, sms, dtype, aligned)
                    assert got["part_w"] <= max(1, min(m, 16 * sms)) * n  # the harness's allocation


def _ffn_need(t: int, d: int, f: int, dtype: torch.dtype, nvidia: bool, with_tc: bool) -> dict[str, int]:
    """mojo/swiglu_ffn.mojo swiglu_ffn_gpu_save (allow_tc, tc_min_t = TC_MIN_T) and _ffn_tc: the wgmma path
    only in fusekit.swiglu_ffn_tc (with_tc), where it pads xn to TC_PAD rows."""
    tp = _cdiv(t, 256) * 256
    need = {"xn": t * d, "h": min(t, 16) * f, "g": 0, "out_pad": 0}
    if with_tc and dtype == torch.bfloat16 and nvidia and t >= 16 and (d, f) in ((4096, 11008),):
        need.update(xn=tp * d, h=tp * f, g=tp * f, out_pad=tp * d)
    return need


@pytest.mark.parametrize("hip", (False, True), ids=("nvidia", "amd"))
def test_swiglu_ffn_bound(hip: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2" if hip else None)
    for with_tc, ms in (
        (False, specs.phase_spec("swiglu_ffn", "forward")),
        (True, specs.swiglu_ffn_tc_spec()),
    ):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for d, f in ((4096, 11008), (256, 512), (4096, 14336), (64, 96)):
                for t in (*range(1, 40), 255, 256, 257, 4096, 4097):
                    ins = (_meta(t, d, dtype=dtype), _meta(f, d, dtype=dtype))
                    need = _ffn_need(t, d, f, dtype, not hip, with_tc)
                    got = _sizes(ms, (), ins, 132)
                    assert got == need, (t, d, f, dtype, hip, with_tc)


def test_attention_delta() -> None:
    ms = specs.phase_spec("attention", "backward")
    q, k = _meta(2, 8, 33, 64), _meta(2, 2, 40, 64)
    assert _sizes(ms, (q, k, k), (q, q, k, k, q, _meta(2, 8, 33)), 132) == {"delta": 2 * 8 * 33}


# --- what the dispatcher passes ----------------------------------------------------------------------
def _compiled(op: str, phase: str, dtypes: tuple[torch.dtype, ...]) -> Compiled:
    return Compiled(specs.phase_spec(op, phase), dtypes, torch.device("cpu"), model=None)


def test_dispatcher_allocates_what_the_kernel_needs() -> None:
    """The CUDA branch of DeviceState.workspaces (on CPU tensors): torch tensors of the workspace dtype
    and at least the kernel's size (the accumulator dtype follows x: int64 for integers), and a
    1-element dummy for a workspace the launch plan does not use."""
    st = SimpleNamespace(cuda=True, sms=132, device=torch.device("cpu"))
    for dtypes, acc in (
        ((torch.bfloat16, torch.float32), torch.float32),
        ((torch.int32, torch.int64), torch.int64),
    ):
        comp = _compiled("reduce_sum", "forward", dtypes)
        x = torch.empty(3, 1 << 16, dtype=dtypes[0])
        (part,) = DeviceState.workspaces(st, comp, (torch.empty(3, dtype=dtypes[1]),), (x,))
        assert part.dtype == acc and part.numel() >= _reduce_sum_need(3, 1 << 16, 132, x.element_size()) > 0
    comp = _compiled("rms_norm", "backward", (torch.bfloat16, torch.float32))
    x, w = torch.empty(64, 4096, dtype=torch.bfloat16), torch.empty(4096)
    outs, ins, _ = comp.spec.bind((x, w), (x, None, x, w, torch.empty(64)), (1e-6, "fp32"))
    sums, part_w = DeviceState.workspaces(st, comp, outs, ins)
    need = _norm_bwd_need(64, 4096, 132, 2, x.data_ptr() % 16 == 0, ln=False)
    assert need["sums"] == 0 and sums == specs.dummy(torch.float32, 1, ("ws", 0))
    assert part_w.dtype == torch.float32 and part_w.numel() == need["part_w"] > 0


def test_workspace_out_of_memory_names_op_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A workspace that cannot be allocated raises torch's OutOfMemoryError naming the MAX op, the
    workspace and its size (as the library does for outputs), not a bare allocator message."""
    import fusekit.backends.mojo.dispatch as dispatch_mod

    def empty(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    st = SimpleNamespace(cuda=True, sms=132, device=torch.device("cpu"))
    comp = _compiled("reduce_sum", "forward", (torch.float32, torch.float32))
    x = torch.ones(3, 1 << 16)
    monkeypatch.setattr(dispatch_mod.torch, "empty", empty)  # torch.empty itself, for this test only
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"^fusekit\.reduce_sum \(mojo\): .*workspace 'part' \(\d+ x float32, .*stand-in",
    ):
        DeviceState.workspaces(st, comp, (x[:, 0],), (x,))


def test_cpu_calls_pass_one_element_dummies() -> None:
    """No CPU path uses a workspace: the dispatcher passes 1-element dummies of the declared dtypes (one per
    slot, no size function is called)."""
    st = SimpleNamespace(cuda=False)
    comp = _compiled("swiglu_ffn", "forward", (torch.bfloat16, torch.bfloat16))
    markers = DeviceState.workspaces(st, comp, (), ())
    bf, f32 = torch.bfloat16, torch.float32
    assert [(m[1], m[2]) for m in markers] == [(bf, 1), (bf, 1), (f32, 1), (bf, 1)]  # xn, h, g, out_pad
    assert len({m[3] for m in markers}) == len(markers)  # one dummy per slot: never the same buffer twice


def test_bind_remembers_each_pattern_exactly() -> None:
    """specs' bind remembers the dummies and params per (dtypes and presence of the tensors, scalar values):
    interleaved calls with other patterns give what a fresh spec gives, with the call's own tensors."""
    from fusekit.ops import SPECS as OP_SPECS

    fresh = lambda: specs.max_spec(OP_SPECS["rms_norm"], "forward")  # a new spec: an empty memory
    ms = fresh()
    bf, f32 = torch.bfloat16, torch.float32

    def call(xdt: torch.dtype, wdt: torch.dtype, residual: bool, casting: str) -> tuple:
        x, w = torch.ones(2, 8, dtype=xdt), torch.ones(8, dtype=wdt)
        r = torch.ones(2, 8, dtype=xdt) if residual else None
        outs = (
            torch.empty(2, 8, dtype=xdt),
            torch.empty(2, 8, dtype=xdt) if residual else None,
            torch.empty(2),
        )
        return outs, (x, r, w), (1e-5, casting)

    calls = [call(bf, f32, False, "fp32"), call(bf, bf, True, "llama"), call(f32, f32, False, "gemma")]
    for args in calls + calls[::-1] + calls:
        got, want = ms.bind(*args), fresh().bind(*args)
        assert got[2] == want[2]
        for g, w in zip(got[0] + got[1], want[0] + want[1]):
            assert g is w if isinstance(w, torch.Tensor) else g == w
