"""The H200 check scripts (benchmarks/gpu_checks/*.py) still import on the CPU.

They run only where device time is spent, so a rename in fusekit broke one unseen for several sessions
(norms.py imported the removed `fusekit.reference`, and its first device call of 2026-12-02 failed). Each
script's `--help` must print its usage; a script that needs a GPU at import may instead stop on the
missing CUDA driver, never on a missing module or name of this repository.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks" / "gpu_checks").glob("*.py"))
NO_GPU = ("libcuda", "CUDA", "cuda")  # what a GPU-only import may stop on here


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_gpu_check_script_imports(script: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)])}
    res = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode == 0:
        assert "usage" in res.stdout.lower(), res.stdout[-2000:]
        return
    last = (res.stderr.strip().splitlines() or [""])[-1]
    broken = ("ImportError", "ModuleNotFoundError", "AttributeError", "NameError", "SyntaxError")
    assert not last.startswith(broken) and any(s in last for s in NO_GPU), res.stderr[-3000:]


def test_the_scripts_are_found() -> None:
    assert {"norms.py", "decode.py", "ffn.py"} <= {p.name for p in SCRIPTS}
