"""aot_mojo's static check of setmaxnreg budgets (an over-budget setmaxnreg.inc hangs the GPU, so it must
fail the CPU build instead). Synthetic PTX in the shape the Mojo sm_90 kernels emit.

    pytest tests/test_aot_setmaxnreg.py
"""

from __future__ import annotations

import pytest

from fusekit.aot_mojo import setmaxnreg_problem


def _ptx(threads: int, dec: int | None, inc: int | None, minctasm: bool = True) -> str:
    head = f".visible .entry k(\n)\n.maxntid {threads}, 1, 1\n"
    if minctasm:
        head += ".minnctapersm 1\n"
    body = "{\n"
    if dec is not None:
        body += f"\tsetmaxnreg.dec.sync.aligned.u32 {dec};\n"
    if inc is not None:
        body += f"\tsetmaxnreg.inc.sync.aligned.u32 {inc};\n"
    return head + body + "\tret;\n}\n"


@pytest.mark.parametrize(
    ("threads", "dec", "inc"),
    [
        (384, 24, 240),  # the D128 / D256 attention kernel: 24 + 2 x 240 = 504 = 168 x 3
        (512, 24, 160),  # D64: 24 + 3 x 160 = 504 <= 128 x 4
        (512, 32, 160),  # exactly the pool (512)
        (256, 40, 232),
    ],
)
def test_budgets_that_fit(threads: int, dec: int, inc: int) -> None:
    assert setmaxnreg_problem(_ptx(threads, dec, inc)) is None


@pytest.mark.parametrize(
    ("threads", "dec", "inc", "need", "pool"),
    [
        (384, 32, 240, 65536, 64512),  # the build that hung on the H200
        (384, 24, 256, 68608, 64512),
        (512, 40, 160, 66560, 65536),
    ],
)
def test_budgets_over_the_pool(threads: int, dec: int, inc: int, need: int, pool: int) -> None:
    msg = setmaxnreg_problem(_ptx(threads, dec, inc))
    assert msg is not None
    assert f"= {need} >" in msg and f"= {pool} (" in msg and "wait forever" in msg


def test_no_setmaxnreg_is_fine() -> None:
    assert setmaxnreg_problem(_ptx(384, None, None)) is None
    assert setmaxnreg_problem(".visible .entry k()\n{\n\tret;\n}\n") is None


def test_setmaxnreg_needs_maxntid_and_minctasm() -> None:
    assert "C7508" in setmaxnreg_problem(_ptx(384, 24, 240, minctasm=False))
    assert "C7508" in setmaxnreg_problem("{\n\tsetmaxnreg.inc.sync.aligned.u32 240;\n}\n")


def test_whole_warpgroups() -> None:
    assert "warpgroups" in setmaxnreg_problem(_ptx(320, 24, 240))
