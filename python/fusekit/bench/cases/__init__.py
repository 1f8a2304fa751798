"""Benchmark cases, one module per op: `fusekit/bench/cases/<op>.py` for every op in `fusekit.ops.OPS`.

Each op module defines a `Case` subclass (inputs, public call, reference, byte/FLOP floors; see
`_base.py`), `cases(suite, quick, cpu) -> list[Case]` for each suite in SUITES (an empty list where
the op has no such suite), and `BASELINES`: the baselines only that op has (CUB, cuBLAS, SDPA, MAX,
Liger-Kernel). Op modules are imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from fusekit.bench.cases._base import DTYPE_NAMES, DTYPES, GRAD, SUITES, Case

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "GRAD",
    "SUITES",
    "Case",
    "baselines",
    "cases",
    "marker",
    "module",
    "ops",
    "report_rank",
]


def ops() -> tuple[str, ...]:
    """The ops, in `fusekit.ops.OPS` order."""
    from fusekit.ops import OPS

    return OPS


def module(op: str) -> ModuleType:
    """`fusekit.bench.cases.<op>`; ValueError naming the valid ops for an unknown one."""
    if op not in ops():
        raise ValueError(f"unknown op {op!r}; valid: {', '.join(ops())}")
    return importlib.import_module(f"{__name__}.{op}")


def cases(op: str, suite: str = "sweep", *, quick: bool = False, cpu: bool = False) -> list[Case]:
    """The cases of one op and suite: full sizes on a GPU, a few small ones on the CPU or with `quick`."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; valid: {', '.join(SUITES)}")
    return module(op).cases(suite, quick=quick, cpu=cpu)


def baselines(op: str) -> tuple:
    """The op's own baselines (providers), beyond torch-eager and torch.compile."""
    return tuple(module(op).BASELINES)


def report_rank(op: str) -> int:
    """Where the report puts the op (its cases module's REPORT_RANK; unknown ops last)."""
    return getattr(module(op), "REPORT_RANK", 99) if op in ops() else 99


def marker(op: str) -> str:
    """The op's plot marker (its cases module's MARKER)."""
    return getattr(module(op), "MARKER", "o") if op in ops() else "o"
